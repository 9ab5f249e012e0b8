/* SPDX-License-Identifier: MIT */
/*
 * Writer of trace directories (doc/trace-format.md): .npy arrays as numpy writes them, meta.json,
 * and a layer's six arrays. The tests build traces with it; tools/capture_trace.py writes the same
 * format from Python.
 */
#include "trace.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int trace_npy_write(const char *path, trace_dtype dtype, uint32_t ndim, const uint64_t *shape,
		    const void *data, char *err, size_t errlen)
{
	char head[512], sh[400];
	uint64_t count = 1, item = dtype == TRACE_F16 ? 2 : 4;
	if (ndim > TRACE_MAX_DIMS || (dtype != TRACE_F16 && dtype != TRACE_F32))
		return trace_errf(err, errlen, -EINVAL, "%s: bad dtype or dims", path);
	for (uint32_t i = 0; i < ndim; i++)
		count *= shape[i];
	trace_shape_text(shape, ndim, sh, sizeof(sh));
	int k = snprintf(head + 10, sizeof(head) - 10,
			 "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
			 dtype == TRACE_F16 ? "<f2" : "<f4", sh);
	/* numpy pads with spaces so that the data starts at a multiple of 64, and ends with '\n' */
	size_t total = (10 + (size_t)k + 1 + 63) / 64 * 64, hlen = total - 10;
	memset(head + 10 + k, ' ', hlen - (size_t)k - 1);
	head[total - 1] = '\n';
	memcpy(head, "\x93NUMPY\x01\x00", 8);
	head[8] = (char)(hlen & 0xff);
	head[9] = (char)(hlen >> 8);
	FILE *f = fopen(path, "wb");
	if (!f)
		return trace_errf(err, errlen, -errno, "%s: cannot create: %s", path, strerror(errno));
	bool ok = fwrite(head, 1, total, f) == total;
	const unsigned char *p = data;
	/* little-endian on disk whatever the host */
	for (uint64_t i = 0; ok && i < count; i++) {
		unsigned char le[4];
		uint32_t x = 0;
		if (item == 2) {
			uint16_t h;
			memcpy(&h, p + i * 2, 2);
			x = h;
		} else {
			memcpy(&x, p + i * 4, 4);
		}
		for (unsigned j = 0; j < item; j++)
			le[j] = (unsigned char)(x >> (8 * j));
		ok = fwrite(le, 1, item, f) == item;
	}
	if (fclose(f) || !ok)
		return trace_errf(err, errlen, -EIO, "%s: write failed", path);
	return 0;
}

/* ---- meta.json and the arrays of a layer --------------------------------------------------------------------------------- */

static void json_string(FILE *f, const char *s)
{
	fputc('"', f);
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20)
			fprintf(f, "\\u%04x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

int trace_write_meta(const char *dir, const trace_meta *m, char *err, size_t errlen)
{
	char path[4096];
	trace_join(dir, "meta.json", path, sizeof(path));
	FILE *f = fopen(path, "w");
	if (!f)
		return trace_errf(err, errlen, -errno, "%s: cannot create: %s", path, strerror(errno));
	fprintf(f, "{\n  \"format\": \"%s\",\n  \"version\": %d,\n  \"model\": ", TRACE_FORMAT,
		TRACE_VERSION);
	json_string(f, m->model);
	fprintf(f,
		",\n  \"n_layers\": %u,\n  \"n_q_heads\": %u,\n  \"n_kv_heads\": %u,\n"
		"  \"head_dim\": %u,\n  \"dtype\": \"%s\",\n  \"rope\": ",
		m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim,
		m->dtype == TRACE_F16 ? "float16" : "float32");
	json_string(f, m->rope);
	fprintf(f,
		",\n  \"scale\": %.17g,\n  \"prefill_tokens\": %u,\n  \"decode_steps\": %u,\n"
		"  \"files\": [",
		m->scale, m->prefill_tokens, m->decode_steps);
	for (uint32_t l = 0; l < m->n_layers; l++)
		for (unsigned a = 0; a < TRACE_ARRAYS; a++) {
			char nm[64];
			trace_file_name(l, a, nm, sizeof(nm));
			fprintf(f, "%s\n    \"%s\"", l || a ? "," : "", nm);
		}
	fprintf(f, "\n  ]\n}\n");
	if (fclose(f))
		return trace_errf(err, errlen, -EIO, "%s: write failed", path);
	return 0;
}

int trace_write_layer(const char *dir, const trace_meta *m, uint32_t layer, const trace_layer *l,
		      char *err, size_t errlen)
{
	const float *arr[TRACE_ARRAYS] = {l->prefill_q, l->prefill_k, l->prefill_v,
					  l->decode_q,	l->decode_k,  l->decode_v};
	int rc = 0;
	for (unsigned a = 0; a < TRACE_ARRAYS && !rc; a++) {
		char nm[64], path[4096];
		uint64_t shape[3] = {a >= 3 ? m->decode_steps : m->prefill_tokens,
				     a % 3 == 0 ? m->n_q_heads : m->n_kv_heads, m->head_dim};
		size_t n = (size_t)(shape[0] * shape[1] * shape[2]);
		trace_file_name(layer, a, nm, sizeof(nm));
		trace_join(dir, nm, path, sizeof(path));
		if (m->dtype == TRACE_F32) {
			rc = trace_npy_write(path, TRACE_F32, 3, shape, arr[a], err, errlen);
			continue;
		}
		uint16_t *h = malloc(n * sizeof(uint16_t) + 1);
		if (!h)
			return trace_errf(err, errlen, -ENOMEM, "%s: out of memory", path);
		for (size_t i = 0; i < n; i++)
			h[i] = trace_f32_to_f16(arr[a][i]);
		rc = trace_npy_write(path, TRACE_F16, 3, shape, h, err, errlen);
		free(h);
	}
	return rc;
}
