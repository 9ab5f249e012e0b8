/* SPDX-License-Identifier: MIT */
/*
 * Reader of trace directories (doc/trace-format.md): the .npy parser, meta.json's fields (its
 * JSON parser is tools/trace_json.c) and the checks of a trace against its metadata. The writer,
 * used by the tests, is tools/trace_write.c.
 * Inputs are untrusted: every length is checked before it is used, and nothing is allocated from a
 * size that was not first checked against the file it came from.
 */
#include "trace.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const array_names[TRACE_ARRAYS] = {
	"prefill.q", "prefill.k", "prefill.v", "decode.q", "decode.k", "decode.v",
};

int trace_errf(char *err, size_t n, int code, const char *fmt, ...)
{
	if (err && n) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, n, fmt, ap);
		va_end(ap);
	}
	return code;
}

/* ---- fp16 / bf16 ---------------------------------------------------------------------------- */

float trace_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
	float f;
	if (e == 0x1f) {
		x = sign | 0x7f800000u | (man << 13);
	} else if (e) {
		x = sign | ((e + 112u) << 23) | (man << 13);
	} else {
		f = (float)man * 0x1p-24f; /* subnormal (or zero): exact */
		memcpy(&x, &f, sizeof(x));
		x |= sign;
	}
	memcpy(&f, &x, sizeof(f));
	return f;
}

uint16_t trace_f32_to_f16(float f)
{
	const uint32_t f16max = (127u + 16u) << 23, magic_u = ((127u - 15u) + (23u - 10u) + 1u)
							      << 23;
	uint32_t x, sign;
	uint16_t o;
	memcpy(&x, &f, sizeof(x));
	sign = x & 0x80000000u;
	x ^= sign;
	if (x >= f16max) {
		o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
	} else if (x < (113u << 23)) {
		/* subnormal result: the addition rounds to nearest even at the right place */
		float fx, magic;
		uint32_t r;
		memcpy(&fx, &x, sizeof(fx));
		memcpy(&magic, &magic_u, sizeof(magic));
		fx += magic;
		memcpy(&r, &fx, sizeof(r));
		o = (uint16_t)(r - magic_u);
	} else {
		uint32_t odd = (x >> 13) & 1u;
		x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
		o = (uint16_t)(x >> 13);
	}
	return (uint16_t)(o | (sign >> 16));
}

float trace_bf16_to_f32(uint16_t h)
{
	uint32_t x = (uint32_t)h << 16;
	float f;
	memcpy(&f, &x, sizeof(f));
	return f;
}

uint16_t trace_f32_to_bf16(float f)
{
	uint32_t x;
	memcpy(&x, &f, sizeof(x));
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40u);
	return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ---- .npy ----------------------------------------------------------------------------------- */

/* A cursor over the header dict of a .npy file. */
typedef struct hcur {
	const char *s;
	size_t i, n;
} hcur;

static void h_ws(hcur *c)
{
	while (c->i < c->n && (c->s[c->i] == ' ' || c->s[c->i] == '\t' || c->s[c->i] == '\n' ||
			       c->s[c->i] == '\r'))
		c->i++;
}

static bool h_eat(hcur *c, char ch)
{
	h_ws(c);
	if (c->i < c->n && c->s[c->i] == ch) {
		c->i++;
		return true;
	}
	return false;
}

/* A Python string literal without escapes, in single or double quotes, into out[n]. */
static bool h_str(hcur *c, char *out, size_t n)
{
	h_ws(c);
	if (c->i >= c->n || (c->s[c->i] != '\'' && c->s[c->i] != '"'))
		return false;
	char q = c->s[c->i++];
	size_t k = 0;
	while (c->i < c->n && c->s[c->i] != q) {
		if (c->s[c->i] == '\\' || k + 1 >= n)
			return false;
		out[k++] = c->s[c->i++];
	}
	if (c->i >= c->n)
		return false;
	c->i++;
	out[k] = 0;
	return true;
}

static bool h_word(hcur *c, const char *w)
{
	size_t n = strlen(w);
	h_ws(c);
	if (c->n - c->i < n || memcmp(c->s + c->i, w, n))
		return false;
	char nx = c->i + n < c->n ? c->s[c->i + n] : ' ';
	if ((nx >= 'A' && nx <= 'Z') || (nx >= 'a' && nx <= 'z') || (nx >= '0' && nx <= '9') ||
	    nx == '_')
		return false;
	c->i += n;
	return true;
}

/* A Python int literal as numpy writes dims: decimal, no sign, no leading zero, at most 2^40. */
static bool h_int(hcur *c, uint64_t *v)
{
	h_ws(c);
	size_t i0 = c->i;
	uint64_t x = 0;
	while (c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9') {
		x = x * 10 + (uint64_t)(c->s[c->i++] - '0');
		if (x > (1ull << 40))
			return false;
	}
	if (c->i == i0 || (c->i - i0 > 1 && c->s[i0] == '0'))
		return false;
	*v = x;
	return true;
}

void trace_shape_text(const uint64_t *shape, uint32_t ndim, char *out, size_t n)
{
	size_t k = (size_t)snprintf(out, n, "(");
	for (uint32_t i = 0; i < ndim && k < n; i++)
		k += (size_t)snprintf(out + k, n - k, "%s%llu", i ? ", " : "",
				      (unsigned long long)shape[i]);
	if (k < n)
		snprintf(out + k, n - k, ndim == 1 ? ",)" : ")");
}

/* The shape tuple: "()", "(3,)", "(3, 4)", "(3, 4,)"; "(3)" is an int in Python, not a tuple. */
static int h_shape(hcur *c, trace_npy *o, const char *name, char *err, size_t en)
{
	if (!h_eat(c, '('))
		return trace_errf(err, en, -EINVAL, "%s: header: 'shape' is not a tuple", name);
	o->ndim = 0;
	bool comma = false;
	while (!h_eat(c, ')')) {
		if (o->ndim && !comma)
			return trace_errf(err, en, -EINVAL, "%s: header: 'shape': expected ',' or ')'",
				    name);
		if (o->ndim == TRACE_MAX_DIMS)
			return trace_errf(err, en, -EINVAL, "%s: header: 'shape' has more than %d dims",
				    name, TRACE_MAX_DIMS);
		if (!h_int(c, &o->shape[o->ndim]))
			return trace_errf(err, en, -EINVAL,
				    "%s: header: 'shape': dim %u is not an integer in [0, 2^40]",
				    name, o->ndim);
		o->ndim++;
		comma = h_eat(c, ',');
	}
	if (o->ndim == 1 && !comma)
		return trace_errf(err, en, -EINVAL,
			    "%s: header: 'shape' (%llu) is not a tuple (want (%llu,))", name,
			    (unsigned long long)o->shape[0], (unsigned long long)o->shape[0]);
	return 0;
}

static int h_dict(hcur *c, trace_npy *o, const char *name, char *err, size_t en)
{
	bool seen[3] = {false, false, false}, fortran = false;
	char key[32], descr[32];
	int rc;
	if (!h_eat(c, '{'))
		return trace_errf(err, en, -EINVAL, "%s: header: not a dict (no '{')", name);
	while (!h_eat(c, '}')) {
		int k;
		if (!h_str(c, key, sizeof(key)))
			return trace_errf(err, en, -EINVAL, "%s: header: expected a quoted key or '}'",
				    name);
		k = !strcmp(key, "descr")	    ? 0
		    : !strcmp(key, "fortran_order") ? 1
		    : !strcmp(key, "shape")	    ? 2
						    : -1;
		if (k < 0)
			return trace_errf(err, en, -EINVAL, "%s: header: unknown key '%s'", name, key);
		if (seen[k])
			return trace_errf(err, en, -EINVAL, "%s: header: key '%s' given twice", name,
				    key);
		seen[k] = true;
		if (!h_eat(c, ':'))
			return trace_errf(err, en, -EINVAL, "%s: header: '%s': expected ':'", name, key);
		if (k == 0 && !h_str(c, descr, sizeof(descr)))
			return trace_errf(err, en, -EINVAL, "%s: header: 'descr' is not a short string",
				    name);
		if (k == 1 && !(fortran = h_word(c, "True")) && !h_word(c, "False"))
			return trace_errf(err, en, -EINVAL,
				    "%s: header: 'fortran_order' is not True or False", name);
		if (k == 2 && (rc = h_shape(c, o, name, err, en)) < 0)
			return rc;
		if (!h_eat(c, ',')) {
			if (h_eat(c, '}'))
				break;
			return trace_errf(err, en, -EINVAL, "%s: header: after '%s': expected ',' or '}'",
				    name, key);
		}
	}
	h_ws(c);
	if (c->i != c->n)
		return trace_errf(err, en, -EINVAL, "%s: header: text after the dict at byte %zu", name,
			    c->i);
	for (int k = 0; k < 3; k++)
		if (!seen[k])
			return trace_errf(err, en, -EINVAL, "%s: header: no '%s' key", name,
				    k == 0   ? "descr"
				    : k == 1 ? "fortran_order"
					     : "shape");
	if (fortran)
		return trace_errf(err, en, -EINVAL, "%s: header: 'fortran_order' is True: want C order",
			    name);
	if (!strcmp(descr, "<f2"))
		o->dtype = TRACE_F16;
	else if (!strcmp(descr, "<f4"))
		o->dtype = TRACE_F32;
	else
		return trace_errf(
			err, en, -EINVAL,
			"%s: header: 'descr' is '%s': want '<f2' or '<f4' (little-endian float16 "
			"or float32)",
			name, descr);
	return 0;
}

/*
 * The header of a .npy file whose first `avail` bytes are b and whose whole size is `size`: on
 * success o->data is left NULL and o->header_len, shape and dtype are set, and the size of the data
 * has been checked against the file.
 */
static int npy_header(const unsigned char *b, size_t avail, uint64_t size, const char *name,
		      trace_npy *o, char *err, size_t en)
{
	memset(o, 0, sizeof(*o));
	if (avail < 8 || memcmp(b, "\x93NUMPY", 6))
		return trace_errf(err, en, -EINVAL, "%s: magic: not a .npy file (want \\x93NUMPY)", name);
	unsigned major = b[6], minor = b[7];
	if ((major != 1 && major != 2) || minor)
		return trace_errf(err, en, -EINVAL, "%s: version: %u.%u, want 1.0 or 2.0", name, major,
			    minor);
	size_t pre = major == 1 ? 10 : 12;
	if (avail < pre)
		return trace_errf(err, en, -EINVAL, "%s: header length: truncated file (%llu bytes)",
			    name, (unsigned long long)size);
	uint32_t hlen = major == 1 ? (uint32_t)b[8] | (uint32_t)b[9] << 8
				   : (uint32_t)b[8] | (uint32_t)b[9] << 8 | (uint32_t)b[10] << 16 |
					     (uint32_t)b[11] << 24;
	if (hlen > TRACE_MAX_NPY_HEADER)
		return trace_errf(err, en, -EINVAL, "%s: header length: %u bytes, more than the limit %u",
			    name, hlen, TRACE_MAX_NPY_HEADER);
	if (hlen > avail - pre)
		return trace_errf(err, en, -EINVAL,
			    "%s: header length: %u bytes, but only %zu follow the length field",
			    name, hlen, avail - pre);
	for (size_t i = pre; i < pre + hlen; i++)
		if (b[i] >= 0x7f || (b[i] < 0x20 && b[i] != '\n' && b[i] != '\t' && b[i] != '\r'))
			return trace_errf(err, en, -EINVAL,
				    "%s: header: byte 0x%02x at offset %zu is not printable ASCII",
				    name, b[i], i);
	hcur c = {(const char *)b + pre, 0, hlen};
	int rc = h_dict(&c, o, name, err, en);
	if (rc < 0)
		return rc;
	uint64_t count = 1, item = o->dtype == TRACE_F16 ? 2 : 4;
	for (uint32_t i = 0; i < o->ndim; i++) {
		if (o->shape[i] && count > UINT64_MAX / 16 / o->shape[i])
			return trace_errf(err, en, -EINVAL, "%s: shape: too many elements", name);
		count *= o->shape[i];
	}
	o->count = count;
	o->header_len = pre + hlen;
	char sh[160];
	trace_shape_text(o->shape, o->ndim, sh, sizeof(sh));
	uint64_t have = size - o->header_len, need = count * item;
	if (have < need)
		return trace_errf(
			err, en, -EINVAL,
			"%s: data: truncated: shape %s of %s needs %llu bytes, the file has %llu",
			name, sh, o->dtype == TRACE_F16 ? "'<f2'" : "'<f4'",
			(unsigned long long)need, (unsigned long long)have);
	if (have > need)
		return trace_errf(
			err, en, -EINVAL,
			"%s: data: %llu bytes after the %llu of shape %s (want exactly the array)",
			name, (unsigned long long)(have - need), (unsigned long long)need, sh);
	return 0;
}

int trace_npy_parse(const void *buf, size_t len, const char *name, trace_npy *out, char *err,
		    size_t errlen)
{
	if (!buf && len)
		return trace_errf(err, errlen, -EINVAL, "%s: no data", name);
	int rc = npy_header(buf, len, len, name, out, err, errlen);
	if (rc < 0)
		return rc;
	out->data = (const unsigned char *)buf + out->header_len;
	return 0;
}

/* ---- meta.json ------------------------------------------------------------------------------ */

void trace_file_name(uint32_t layer, unsigned a, char *out, size_t n)
{
	snprintf(out, n, "layer%u.%s.npy", layer, a < TRACE_ARRAYS ? array_names[a] : "?");
}

static int m_uint(const trace_json *j, const trace_json_node *root, const char *key, uint32_t lo,
		  uint32_t hi, uint32_t *v, const char *name, char *err, size_t en)
{
	const trace_json_node *x = trace_json_get(j, root, key);
	if (!x)
		return trace_errf(err, en, -EINVAL, "%s: %s: missing", name, key);
	if (x->type != TJ_NUMBER || x->num != floor(x->num) || x->num < lo || x->num > hi)
		return trace_errf(err, en, -EINVAL, "%s: %s: want an integer in [%u, %u]%s", name, key,
			    lo, hi,
			    x->type == TJ_NUMBER ? ", got another number" : ", got no number");
	*v = (uint32_t)x->num;
	return 0;
}

static int m_str(const trace_json *j, const trace_json_node *root, const char *key, char *v,
		 size_t n, const char *name, char *err, size_t en)
{
	const trace_json_node *x = trace_json_get(j, root, key);
	if (!x)
		return trace_errf(err, en, -EINVAL, "%s: %s: missing", name, key);
	if (x->type != TJ_STRING)
		return trace_errf(err, en, -EINVAL, "%s: %s: want a string", name, key);
	if (strlen(x->str) >= n)
		return trace_errf(err, en, -EINVAL, "%s: %s: longer than %zu bytes", name, key, n - 1);
	strcpy(v, x->str);
	return 0;
}

/* `files` must name each array of each layer exactly once. */
static int m_files(const trace_json *j, const trace_json_node *root, const trace_meta *m,
		   const char *name, char *err, size_t en)
{
	const trace_json_node *f = trace_json_get(j, root, "files");
	uint32_t want = m->n_layers * TRACE_ARRAYS;
	if (!f || f->type != TJ_ARRAY)
		return trace_errf(err, en, -EINVAL, "%s: files: %s", name,
			    f ? "want an array of file names" : "missing");
	uint8_t *seen = calloc(want, 1);
	if (!seen)
		return trace_errf(err, en, -ENOMEM, "%s: out of memory", name);
	int rc = 0;
	uint32_t i = 0;
	for (uint32_t c = f->child; c && !rc; c = j->nodes[c].next, i++) {
		const char *s = j->nodes[c].type == TJ_STRING ? j->nodes[c].str : NULL;
		unsigned layer = 0, a = 0;
		int used = 0;
		char kind[16] = "", tail[8] = "";
		if (s && sscanf(s, "layer%u.%15[a-z.]%n", &layer, kind, &used) == 2) {
			/* kind is "prefill.q.npy"-like: split the array name from ".npy" */
			size_t kl = strlen(kind);
			if (kl > 4 && !strcmp(kind + kl - 4, ".npy") && !s[used]) {
				kind[kl - 4] = 0;
				strcpy(tail, ".npy");
			}
		}
		for (a = 0; a < TRACE_ARRAYS && strcmp(kind, array_names[a]); a++)
			;
		char canon[64];
		trace_file_name(layer, a, canon, sizeof(canon));
		if (!s || a == TRACE_ARRAYS || !tail[0] || layer >= m->n_layers || strcmp(s, canon))
			rc = trace_errf(err, en, -EINVAL,
				  "%s: files[%u]: %s%s%s is not "
				  "layer{L}.{prefill,decode}.{q,k,v}.npy "
				  "with L < n_layers = %u",
				  name, i, s ? "'" : "", s ? s : "not a string", s ? "'" : "",
				  m->n_layers);
		else if (seen[layer * TRACE_ARRAYS + a]++)
			rc = trace_errf(err, en, -EINVAL, "%s: files[%u]: '%s' listed twice", name, i, s);
	}
	for (uint32_t k = 0; k < want && !rc; k++)
		if (!seen[k]) {
			char nm[64];
			trace_file_name(k / TRACE_ARRAYS, k % TRACE_ARRAYS, nm, sizeof(nm));
			rc = trace_errf(err, en, -EINVAL, "%s: files: '%s' is missing", name, nm);
		}
	free(seen);
	return rc;
}

static int meta_fields(const trace_json *j, const trace_json_node *r, trace_meta *m,
		       const char *name, char *err, size_t en)
{
	char fmt[64], dt[16];
	uint32_t ver;
	int rc;
	if (r->type != TJ_OBJECT)
		return trace_errf(err, en, -EINVAL, "%s: want an object at the top", name);
	if ((rc = m_str(j, r, "format", fmt, sizeof(fmt), name, err, en)) < 0)
		return rc;
	if (strcmp(fmt, TRACE_FORMAT))
		return trace_errf(err, en, -EINVAL, "%s: format: '%s', want '" TRACE_FORMAT "'", name,
			    fmt);
	if ((rc = m_uint(j, r, "version", 1, 1000000, &ver, name, err, en)) < 0)
		return rc;
	if (ver != TRACE_VERSION)
		return trace_errf(err, en, -EINVAL, "%s: version: %u, this reader knows version %d", name,
			    ver, TRACE_VERSION);
	if ((rc = m_str(j, r, "model", m->model, sizeof(m->model), name, err, en)) < 0 ||
	    (rc = m_str(j, r, "rope", m->rope, sizeof(m->rope), name, err, en)) < 0 ||
	    (rc = m_uint(j, r, "n_layers", 1, TRACE_MAX_LAYERS, &m->n_layers, name, err, en)) < 0 ||
	    (rc = m_uint(j, r, "n_q_heads", 1, TRACE_MAX_HEADS, &m->n_q_heads, name, err, en)) <
		    0 ||
	    (rc = m_uint(j, r, "n_kv_heads", 1, m->n_q_heads, &m->n_kv_heads, name, err, en)) < 0 ||
	    (rc = m_uint(j, r, "head_dim", 1, TRACE_MAX_HEAD_DIM, &m->head_dim, name, err, en)) <
		    0 ||
	    (rc = m_uint(j, r, "prefill_tokens", 1, TRACE_MAX_TOKENS, &m->prefill_tokens, name, err,
			 en)) < 0 ||
	    (rc = m_uint(j, r, "decode_steps", 1, TRACE_MAX_TOKENS, &m->decode_steps, name, err,
			 en)) < 0 ||
	    (rc = m_str(j, r, "dtype", dt, sizeof(dt), name, err, en)) < 0)
		return rc;
	if (m->n_q_heads % m->n_kv_heads)
		return trace_errf(err, en, -EINVAL, "%s: n_kv_heads: %u does not divide n_q_heads = %u",
			    name, m->n_kv_heads, m->n_q_heads);
	if ((uint64_t)m->prefill_tokens + m->decode_steps > TRACE_MAX_TOKENS)
		return trace_errf(err, en, -EINVAL,
			    "%s: decode_steps: prefill_tokens + decode_steps is "
			    "more than %u",
			    name, TRACE_MAX_TOKENS);
	if (!strcmp(dt, "float16"))
		m->dtype = TRACE_F16;
	else if (!strcmp(dt, "float32"))
		m->dtype = TRACE_F32;
	else
		return trace_errf(err, en, -EINVAL, "%s: dtype: '%s', want 'float16' or 'float32'", name,
			    dt);
	const trace_json_node *sc = trace_json_get(j, r, "scale");
	if (sc && sc->type != TJ_NULL && (sc->type != TJ_NUMBER || !(sc->num >= 0)))
		return trace_errf(err, en, -EINVAL, "%s: scale: want a number >= 0 or null", name);
	m->scale = sc && sc->type == TJ_NUMBER ? sc->num : 0;
	return m_files(j, r, m, name, err, en);
}

int trace_meta_parse(const char *text, size_t len, const char *name, trace_meta *m, char *err,
		     size_t errlen)
{
	trace_json j;
	memset(m, 0, sizeof(*m));
	int rc = trace_json_parse(text, len, name, &j, err, errlen);
	if (rc < 0)
		return rc;
	rc = meta_fields(&j, &j.nodes[1], m, name, err, errlen);
	trace_json_free(&j);
	return rc;
}

/* ---- files ---------------------------------------------------------------------------------- */

/* Read the whole file (at most `limit` bytes unless 0) into *buf (malloc). */
static int read_file(const char *path, size_t limit, unsigned char **buf, size_t *len, char *err,
		     size_t en)
{
	FILE *f = fopen(path, "rb");
	struct stat st;
	*buf = NULL;
	if (!f)
		return trace_errf(err, en, -errno, "%s: cannot open: %s", path, strerror(errno));
	if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode)) {
		fclose(f);
		return trace_errf(err, en, -EINVAL, "%s: not a regular file", path);
	}
	if (limit && (uint64_t)st.st_size > limit) {
		fclose(f);
		return trace_errf(err, en, -EINVAL, "%s: %lld bytes, more than the limit %zu", path,
			    (long long)st.st_size, limit);
	}
	*len = (size_t)st.st_size;
	*buf = malloc(*len + 1);
	if (!*buf) {
		fclose(f);
		return trace_errf(err, en, -ENOMEM, "%s: out of memory for %zu bytes", path, *len);
	}
	size_t got = fread(*buf, 1, *len, f);
	fclose(f);
	if (got != *len) {
		free(*buf);
		*buf = NULL;
		return trace_errf(err, en, -EIO, "%s: read %zu of %zu bytes", path, got, *len);
	}
	return 0;
}

void trace_join(const char *dir, const char *file, char *out, size_t n)
{
	size_t l = strlen(dir);
	snprintf(out, n, "%s%s%s", dir, l && dir[l - 1] == '/' ? "" : "/", file);
}

/* An array's header against meta.json: 3 dims [tokens, heads, head_dim] and the dtype. */
static int check_shape(const trace_meta *m, unsigned a, const trace_npy *x, const char *path,
		       char *err, size_t en)
{
	bool dec = a >= 3, q = a % 3 == 0;
	uint64_t want[3] = {dec ? m->decode_steps : m->prefill_tokens,
			    q ? m->n_q_heads : m->n_kv_heads, m->head_dim};
	const char *field[3] = {dec ? "decode_steps" : "prefill_tokens",
				q ? "n_q_heads" : "n_kv_heads", "head_dim"};
	char sh[160];
	trace_shape_text(x->shape, x->ndim, sh, sizeof(sh));
	if (x->dtype != m->dtype)
		return trace_errf(err, en, -EINVAL, "%s: descr: '%s' but meta.json says dtype = %s", path,
			    x->dtype == TRACE_F16 ? "<f2" : "<f4",
			    m->dtype == TRACE_F16 ? "float16" : "float32");
	if (x->ndim != 3)
		return trace_errf(err, en, -EINVAL,
			    "%s: shape: %s has %u dims, want 3 ([tokens, heads, head_dim])", path,
			    sh, x->ndim);
	for (int i = 0; i < 3; i++)
		if (x->shape[i] != want[i])
			return trace_errf(err, en, -EINVAL, "%s: shape: %s but meta.json says %s = %llu",
				    path, sh, field[i], (unsigned long long)want[i]);
	return 0;
}

static int read_meta(const char *dir, trace_meta *m, char *err, size_t en)
{
	char path[4096];
	unsigned char *buf;
	size_t len;
	trace_join(dir, "meta.json", path, sizeof(path));
	int rc = read_file(path, TRACE_MAX_JSON_BYTES, &buf, &len, err, en);
	if (rc < 0)
		return rc;
	rc = trace_meta_parse((const char *)buf, len, path, m, err, en);
	free(buf);
	return rc;
}

int trace_open(const char *dir, trace_meta *m, char *err, size_t errlen)
{
	memset(m, 0, sizeof(*m));
	int rc = read_meta(dir, m, err, errlen);
	for (uint32_t l = 0; l < m->n_layers && !rc; l++)
		for (unsigned a = 0; a < TRACE_ARRAYS && !rc; a++) {
			char nm[64], path[4096];
			unsigned char head[12 + TRACE_MAX_NPY_HEADER];
			trace_npy x;
			struct stat st;
			trace_file_name(l, a, nm, sizeof(nm));
			trace_join(dir, nm, path, sizeof(path));
			FILE *f = fopen(path, "rb");
			if (!f)
				return trace_errf(err, errlen, -errno, "%s: cannot open: %s", path,
					    strerror(errno));
			size_t got = fread(head, 1, sizeof(head), f);
			if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode))
				rc = trace_errf(err, errlen, -EINVAL, "%s: not a regular file", path);
			fclose(f);
			if (!rc)
				rc = npy_header(head, got, (uint64_t)st.st_size, path, &x, err,
						errlen);
			if (!rc)
				rc = check_shape(m, a, &x, path, err, errlen);
		}
	return rc;
}

/* Convert the checked array to floats, rejecting non-finite elements. */
static int to_floats(const trace_meta *m, unsigned a, const trace_npy *x, float *out,
		     const char *path, char *err, size_t en)
{
	const unsigned char *p = x->data;
	uint64_t heads = x->shape[1];
	for (uint64_t i = 0; i < x->count; i++) {
		float f;
		if (x->dtype == TRACE_F16) {
			f = trace_f16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
		} else {
			uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 |
				     (uint32_t)p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24;
			memcpy(&f, &u, sizeof(f));
		}
		if (!isfinite(f))
			return trace_errf(err, en, -EINVAL,
				    "%s: data: element %llu (%s %llu, head %llu, dim %llu) is %s",
				    path, (unsigned long long)i, a >= 3 ? "step" : "token",
				    (unsigned long long)(i / m->head_dim / heads),
				    (unsigned long long)(i / m->head_dim % heads),
				    (unsigned long long)(i % m->head_dim),
				    isnan(f) ? "NaN" : "infinite");
		out[i] = f;
	}
	return 0;
}

int trace_load_layer(const char *dir, const trace_meta *m, uint32_t layer, trace_layer *out,
		     char *err, size_t errlen)
{
	float **arr[TRACE_ARRAYS] = {&out->prefill_q, &out->prefill_k, &out->prefill_v,
				     &out->decode_q,  &out->decode_k,  &out->decode_v};
	int rc = 0;
	memset(out, 0, sizeof(*out));
	if (layer >= m->n_layers)
		return trace_errf(err, errlen, -EINVAL, "layer %u: the trace has %u layers", layer,
			    m->n_layers);
	for (unsigned a = 0; a < TRACE_ARRAYS && !rc; a++) {
		char nm[64], path[4096];
		unsigned char *buf;
		size_t len;
		trace_npy x;
		trace_file_name(layer, a, nm, sizeof(nm));
		trace_join(dir, nm, path, sizeof(path));
		if ((rc = read_file(path, 0, &buf, &len, err, errlen)) < 0)
			break;
		rc = trace_npy_parse(buf, len, path, &x, err, errlen);
		if (!rc)
			rc = check_shape(m, a, &x, path, err, errlen);
		if (!rc && !(*arr[a] = malloc(x.count * sizeof(float) + 1)))
			rc = trace_errf(err, errlen, -ENOMEM, "%s: out of memory", path);
		if (!rc)
			rc = to_floats(m, a, &x, *arr[a], path, err, errlen);
		free(buf);
	}
	if (rc)
		trace_layer_free(out);
	return rc;
}

void trace_layer_free(trace_layer *l)
{
	free(l->prefill_q);
	free(l->prefill_k);
	free(l->prefill_v);
	free(l->decode_q);
	free(l->decode_k);
	free(l->decode_v);
	memset(l, 0, sizeof(*l));
}
