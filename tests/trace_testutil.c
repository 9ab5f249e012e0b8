/* SPDX-License-Identifier: MIT */
/* What the trace tests share (trace_testutil.h). */
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "trace_testutil.h"

/* ---- helpers -------------------------------------------------------------------------------- */


void path_of(const tdir *t, const char *file, char *out, size_t n)
{
	snprintf(out, n, "%s/%s", t->path, file);
}

/* A trace of random post-RoPE-like vectors: keys with a shared offset, queries that prefer a few
 * tokens, so that attention is neither uniform nor one-hot. */
void fill_layer(t_rng *r, const trace_meta *m, trace_layer *l)
{
	size_t T = m->prefill_tokens, S = m->decode_steps, D = m->head_dim;
	size_t nq[2] = {T * m->n_q_heads * D, S * m->n_q_heads * D};
	size_t nk[2] = {T * m->n_kv_heads * D, S * m->n_kv_heads * D};
	float **q[2] = {&l->prefill_q, &l->decode_q}, **k[2] = {&l->prefill_k, &l->decode_k},
	      **v[2] = {&l->prefill_v, &l->decode_v};
	for (int p = 0; p < 2; p++) {
		*q[p] = t_alloc(nq[p] * sizeof(float));
		*k[p] = t_alloc(nk[p] * sizeof(float));
		*v[p] = t_alloc(nk[p] * sizeof(float));
		for (size_t i = 0; i < nq[p]; i++)
			(*q[p])[i] = (float)(1.5 * t_normal(r));
		for (size_t i = 0; i < nk[p]; i++) {
			(*k[p])[i] = (float)(t_normal(r) + (i % D < 4 ? 3.0 : 0.0));
			(*v[p])[i] = (float)t_normal(r);
		}
	}
}

void make_trace(tdir *t, trace_dtype dtype, uint32_t layers, uint32_t T, uint32_t S,
		uint64_t seed)
{
	char err[ERRLEN];
	t_rng r;
	t_rng_seed(&r, seed);
	strcpy(t->path, "/tmp/kvt_trace_XXXXXX");
	T_CHECK(mkdtemp(t->path) != NULL, "mkdtemp failed");
	t->m = (trace_meta){.n_layers = layers,
			    .n_q_heads = 4,
			    .n_kv_heads = 2,
			    .head_dim = 64,
			    .dtype = dtype,
			    .prefill_tokens = T,
			    .decode_steps = S,
			    .scale = 0};
	snprintf(t->m.model, sizeof(t->m.model), "test \"random\" model");
	snprintf(t->m.rope, sizeof(t->m.rope), "none (random vectors)");
	T_CHECK(trace_write_meta(t->path, &t->m, err, sizeof(err)) == 0, "write meta: %s", err);
	for (uint32_t l = 0; l < layers; l++) {
		trace_layer tl;
		fill_layer(&r, &t->m, &tl);
		T_CHECK(trace_write_layer(t->path, &t->m, l, &tl, err, sizeof(err)) == 0,
			"write layer %u: %s", l, err);
		trace_layer_free(&tl);
	}
}

void remove_trace(tdir *t)
{
	char p[256];
	path_of(t, "meta.json", p, sizeof(p));
	unlink(p);
	for (uint32_t l = 0; l < t->m.n_layers + 1; l++)
		for (unsigned a = 0; a < TRACE_ARRAYS; a++) {
			char nm[64];
			trace_file_name(l, a, nm, sizeof(nm));
			path_of(t, nm, p, sizeof(p));
			unlink(p);
		}
	rmdir(t->path);
}

void write_bytes(const char *path, const void *b, size_t n)
{
	FILE *f = fopen(path, "wb");
	T_CHECK(f != NULL, "cannot create %s", path);
	T_CHECK(fwrite(b, 1, n, f) == n, "write %s", path);
	fclose(f);
}

unsigned char *read_bytes(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	T_CHECK(f != NULL, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	*n = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	unsigned char *b = t_alloc(*n + 1);
	T_CHECK(fread(b, 1, *n, f) == *n, "read %s", path);
	fclose(f);
	return b;
}

/* A .npy image from a header dict (padded by the caller or not) and `data` bytes. */
size_t npy_image(unsigned char *out, int major, const char *dict, size_t data)
{
	size_t hl = strlen(dict), pre = major == 1 ? 10 : 12;
	memcpy(out, "\x93NUMPY", 6);
	out[6] = (unsigned char)major;
	out[7] = 0;
	out[8] = (unsigned char)(hl & 0xff);
	out[9] = (unsigned char)(hl >> 8);
	if (major == 2)
		out[10] = out[11] = 0;
	memcpy(out + pre, dict, hl);
	memset(out + pre + hl, 0, data);
	return pre + hl + data;
}

/* The whole trace must be rejected (by trace_open or by loading a layer) with a message that
 * contains every one of the words. */
void expect_reject(const tdir *t, const char *what, const char *w1, const char *w2)
{
	char err[ERRLEN] = "";
	trace_meta m;
	int rc = trace_open(t->path, &m, err, sizeof(err));
	for (uint32_t l = 0; rc == 0 && l < m.n_layers; l++) {
		trace_layer tl;
		rc = trace_load_layer(t->path, &m, l, &tl, err, sizeof(err));
		if (!rc)
			trace_layer_free(&tl);
	}
	T_CHECK(rc < 0, "%s: accepted, wanted an error naming '%s' and '%s'", what, w1, w2);
	T_CHECK(strstr(err, w1) && strstr(err, w2), "%s: message '%s' does not name '%s' and '%s'",
		what, err, w1, w2);
}

/* ---- malformed traces' tools ----------------------------------------------------------- */

/* Rewrite byte `at` of a file (negative: from the end). */
void poke(const tdir *t, const char *file, long at, unsigned char v)
{
	char p[256];
	size_t n;
	path_of(t, file, p, sizeof(p));
	unsigned char *b = read_bytes(p, &n);
	b[at < 0 ? (long)n + at : at] = v;
	write_bytes(p, b, n);
	free(b);
}

void truncate_file(const tdir *t, const char *file, size_t cut)
{
	char p[256];
	size_t n;
	path_of(t, file, p, sizeof(p));
	unsigned char *b = read_bytes(p, &n);
	write_bytes(p, b, n - cut);
	free(b);
}

void write_meta_text(const tdir *t, const char *text)
{
	char p[256];
	path_of(t, "meta.json", p, sizeof(p));
	write_bytes(p, text, strlen(text));
}

/* meta.json as trace_write_meta writes it, with one substring replaced. */
void edit_meta(const tdir *t, const char *from, const char *to)
{
	char p[256];
	size_t n;
	path_of(t, "meta.json", p, sizeof(p));
	char *s = (char *)read_bytes(p, &n);
	s[n] = 0;
	char *at = strstr(s, from);
	T_CHECK(at != NULL, "meta.json has no '%s'", from);
	const size_t pre = (size_t)(at - s), tl = strlen(to), fl = strlen(from);
	char *out = t_alloc(n - fl + tl + 1); /* zeroed: the copies below end in its last 0 */
	memcpy(out, s, pre);
	memcpy(out + pre, to, tl);
	memcpy(out + pre + tl, at + fl, n - pre - fl);
	write_meta_text(t, out);
	free(out);
	free(s);
}

/* ---- UTF-8 (issue 11, defect 8) ------------------------------------------------------------- */

/* The tests' own RFC 3629 check, by code point: the length of the valid sequence at s, or 0. */
size_t t_utf8_ok(const unsigned char *s, size_t n)
{
	if (s[0] < 0x80)
		return 1;
	size_t len = s[0] >= 0xf0 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc0 ? 2 : 0;
	if (!len || len > n || s[0] > 0xf7)
		return 0;
	uint32_t u = s[0] & (0x7fu >> len);
	for (size_t k = 1; k < len; k++) {
		if ((s[k] & 0xc0) != 0x80)
			return 0;
		u = u << 6 | (s[k] & 0x3fu);
	}
	static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
	return u < min[len] || u > 0x10ffff || (u >= 0xd800 && u < 0xe000) ? 0 : len;
}

/* Offset of the first invalid UTF-8 sequence of s[0..n), or n when all of it is valid. */
size_t t_utf8_bad_at(const char *s, size_t n)
{
	for (size_t i = 0, len; i < n; i += len)
		if (!(len = t_utf8_ok((const unsigned char *)s + i, n - i)))
			return i;
	return n;
}

int t_kvbench(char **argv, const char *dir, char **out, char **errs)
{
	int argc = 0;
	while (argv[argc])
		argc++;
	char po[] = "/tmp/kvt_kb_out_XXXXXX", pe[] = "/tmp/kvt_kb_err_XXXXXX";
	int fo = mkstemp(po), fe = mkstemp(pe);
	T_CHECK(fo >= 0 && fe >= 0, "mkstemp failed");
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	T_CHECK(pid >= 0, "fork failed");
	if (pid == 0) {
		dup2(fo, 1);
		dup2(fe, 2);
		if (dir && chdir(dir) != 0)
			_exit(99);
		int st = kvbench_main(argc, argv);
		fflush(stdout);
		fflush(stderr);
		_exit(st);
	}
	int ws = 0;
	T_CHECK(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws), "kvbench did not exit normally");
	int rc = WEXITSTATUS(ws);
	close(fo);
	close(fe);
	size_t n;
	*out = (char *)read_bytes(po, &n);
	(*out)[n] = 0;
	*errs = (char *)read_bytes(pe, &n);
	(*errs)[n] = 0;
	unlink(po);
	unlink(pe);
	return rc;
}

void t_json_stdout(const char *what, const char *out, trace_json *j)
{
	char err[ERRLEN];
	T_CHECK(trace_json_parse(out, strlen(out), "stdout", j, err, sizeof err) == 0,
		"%s: not JSON: %s\n%s", what, err, out);
}
