/* SPDX-License-Identifier: MIT */
/*
 * Traces (tools/trace.c, doc/trace-format.md): the writer and the reader round-trip; .npy headers
 * as numpy writes them are accepted and nonsense is rejected; every malformed trace (bad magic,
 * wrong shape, truncated array, NaN, bad JSON, missing file, wrong dtype, a header length that
 * lies, ...) fails with a message naming the file and the field; and `kvbench --trace` replays a
 * small trace end to end on the CPU backend (recall 1 at p = 1) and fails, naming the file, on a
 * corrupted one.
 */
#include "kvbench.h" /* before common.h, whose fail() macro it would clash with */
#include "common.h"
#include "trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define ERRLEN 1024

/* ---- helpers -------------------------------------------------------------------------------- */

typedef struct tdir {
	char path[64];
	trace_meta m;
} tdir;

static void path_of(const tdir *t, const char *file, char *out, size_t n)
{
	snprintf(out, n, "%s/%s", t->path, file);
}

/* A trace of random post-RoPE-like vectors: keys with a shared offset, queries that prefer a few
 * tokens, so that attention is neither uniform nor one-hot. */
static void fill_layer(t_rng *r, const trace_meta *m, trace_layer *l)
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

static void make_trace(tdir *t, trace_dtype dtype, uint32_t layers, uint32_t T, uint32_t S,
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

static void remove_trace(tdir *t)
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

static void write_bytes(const char *path, const void *b, size_t n)
{
	FILE *f = fopen(path, "wb");
	T_CHECK(f != NULL, "cannot create %s", path);
	T_CHECK(fwrite(b, 1, n, f) == n, "write %s", path);
	fclose(f);
}

static unsigned char *read_bytes(const char *path, size_t *n)
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
static size_t npy_image(unsigned char *out, int major, const char *dict, size_t data)
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
static void expect_reject(const tdir *t, const char *what, const char *w1, const char *w2)
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

/* ---- conversions ---------------------------------------------------------------------------- */

static void test_half(void **state)
{
	(void)state;
	int bad = 0;
	for (uint32_t h = 0; h < 65536; h++) {
		float a = trace_f16_to_f32((uint16_t)h), b = t_h2f((uint16_t)h);
		if (isnan(b))
			T_SOFT(&bad, isnan(a), "f16 0x%04x: got %g, want NaN", h, (double)a);
		else
			T_SOFT(&bad, t_fbits(a) == t_fbits(b) && trace_f32_to_f16(a) == h,
			       "f16 0x%04x: got %g (back 0x%04x), want %g", h, (double)a,
			       trace_f32_to_f16(a), (double)b);
	}
	t_rng r;
	t_rng_seed(&r, 7);
	for (int i = 0; i < 200000; i++) {
		float f = (float)(t_normal(&r) * pow(2.0, t_range(&r, -30, 18)));
		T_SOFT(&bad, trace_f32_to_f16(f) == t_f2h(f), "f32 %a: f16 got 0x%04x, want 0x%04x",
		       (double)f, trace_f32_to_f16(f), t_f2h(f));
		T_SOFT(&bad, trace_f32_to_bf16(f) == t_f2bf(f),
		       "f32 %a: bf16 got 0x%04x, want 0x%04x", (double)f, trace_f32_to_bf16(f),
		       t_f2bf(f));
		if (bad > 10)
			break;
	}
	T_CHECK(bad == 0, "%d conversion mismatches", bad);
}

/* ---- .npy ----------------------------------------------------------------------------------- */

static void test_npy_headers(void **state)
{
	(void)state;
	static const struct {
		int major;
		const char *dict;
		size_t data;
		int ok;
		const char *word; /* in the message when rejected */
	} cases[] = {
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 4), }          \n", 24,
		 1, 0},
		{1, "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }\n", 20, 1, 0},
		{2, "{\"descr\": \"<f4\", \"shape\": (2,3,), \"fortran_order\": False}", 24, 1, 0},
		{1, "{'descr':'<f2','fortran_order':False,'shape':()}", 2, 1, 0},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 8), }\n", 0, 1, 0},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5), }\n", 10, 0, "tuple"},
		{1, "{'descr': '<f8', 'fortran_order': False, 'shape': (5,), }\n", 40, 0, "descr"},
		{1, "{'descr': '>f2', 'fortran_order': False, 'shape': (5,), }\n", 10, 0, "descr"},
		{1, "{'descr': '<f2', 'fortran_order': True, 'shape': (5,), }\n", 10, 0,
		 "fortran_order"},
		{1, "{'descr': '<f2', 'shape': (5,), }\n", 10, 0, "fortran_order"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,), 'x': 1}\n", 10, 0,
		 "unknown key"},
		{1, "{'descr': '<f2', 'descr': '<f2', 'fortran_order': False, 'shape': (5,)}\n", 10,
		 0, "twice"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,)} x\n", 10, 0, "after"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (-5,)}\n", 10, 0, "shape"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (05,)}\n", 10, 0, "shape"},
		{1, "{'descr': '<f2', 'fortran_order': Falsey, 'shape': (5,)}\n", 10, 0,
		 "fortran_order"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,)}\n", 8, 0, "truncated"},
		{1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,)}\n", 12, 0,
		 "after the"},
		{1,
		 "{'descr': '<f2', 'fortran_order': False, 'shape': (1099511627776, "
		 "1099511627776)}",
		 0, 0, "shape"},
		{1, "['descr', '<f2']\n", 0, 0, "dict"},
	};
	static unsigned char img[4096];
	int bad = 0;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char err[ERRLEN] = "";
		trace_npy x;
		size_t n = npy_image(img, cases[i].major, cases[i].dict, cases[i].data);
		int rc = trace_npy_parse(img, n, "case.npy", &x, err, sizeof(err));
		if (cases[i].ok)
			T_SOFT(&bad, rc == 0, "case %zu (%s): rejected: %s", i, cases[i].dict, err);
		else
			T_SOFT(&bad,
			       rc < 0 && strstr(err, "case.npy") && strstr(err, cases[i].word),
			       "case %zu (%s): rc %d, message '%s', wanted one naming case.npy and "
			       "'%s'",
			       i, cases[i].dict, rc, err, cases[i].word);
	}
	/* the preamble: magic, version, a header length that runs past the end */
	const char *dict = "{'descr': '<f2', 'fortran_order': False, 'shape': (1,), }\n";
	struct {
		size_t at, len;
		unsigned char v;
		const char *word;
	} pre[] = {{0, 0, 'X', "magic"},	  {6, 0, 3, "version"},	      {7, 0, 1, "version"},
		   {9, 0, 0x7f, "header length"}, {0, 9, 0, "header length"}, {0, 5, 0, "magic"}};
	for (size_t i = 0; i < sizeof(pre) / sizeof(pre[0]); i++) {
		char err[ERRLEN] = "";
		trace_npy x;
		size_t n = npy_image(img, 1, dict, 2);
		if (pre[i].len)
			n = pre[i].len;
		else
			img[pre[i].at] = pre[i].v;
		int rc = trace_npy_parse(img, n, "pre.npy", &x, err, sizeof(err));
		T_SOFT(&bad, rc < 0 && strstr(err, "pre.npy") && strstr(err, pre[i].word),
		       "preamble case %zu: rc %d, message '%s', wanted '%s'", i, rc, err,
		       pre[i].word);
	}
	T_CHECK(bad == 0, "%d .npy header cases failed", bad);
}

/* ---- JSON ----------------------------------------------------------------------------------- */

static void test_json(void **state)
{
	(void)state;
	static const struct {
		const char *text;
		int ok;
	} cases[] = {
		{"{\"a\": [1, -2.5e3, 0, true, false, null], \"b\": {\"c\": "
		 "\"x\\\"y\\u00e9\\ud83d\\ude00\"}}",
		 1},
		{" [ ] ", 1},
		{"{}", 1},
		{"\"\\/\\b\\f\\n\\r\\t\"", 1},
		{"{\"a\": 1,}", 0},
		{"[1, 2,]", 0},
		{"{\"a\": 1, \"a\": 2}", 0},
		{"{'a': 1}", 0},
		{"[01]", 0},
		{"[1.]", 0},
		{"[.5]", 0},
		{"[1e]", 0},
		{"[+1]", 0},
		{"[1e999]", 0},
		{"[\"\\ud800\"]", 0},
		{"[\"\\udc00\"]", 0},
		{"[\"\\u0000\"]", 0},
		{"[\"\\x\"]", 0},
		{"[\"a\nb\"]", 0},
		{"[\"abc", 0},
		{"[tru]", 0},
		{"[NaN]", 0},
		{"{} {}", 0},
		{"", 0},
		{"/* c */ {}", 0},
	};
	int bad = 0;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char err[ERRLEN] = "";
		trace_json j;
		int rc = trace_json_parse(cases[i].text, strlen(cases[i].text), "x.json", &j, err,
					  sizeof(err));
		T_SOFT(&bad, (rc == 0) == cases[i].ok, "case %zu '%s': rc %d (%s), want %s", i,
		       cases[i].text, rc, err, cases[i].ok ? "accepted" : "rejected");
		if (rc == 0)
			trace_json_free(&j);
		else
			T_SOFT(&bad, strstr(err, "x.json: line 1, column"),
			       "case %zu: message '%s'", i, err);
	}
	/* decoded values */
	const char *t = cases[0].text;
	trace_json j;
	char err[ERRLEN];
	T_CHECK(trace_json_parse(t, strlen(t), "x.json", &j, err, sizeof(err)) == 0, "%s", err);
	const trace_json_node *a = trace_json_get(&j, &j.nodes[1], "a"),
			      *b = trace_json_get(&j, &j.nodes[1], "b");
	T_CHECK(a && a->type == TJ_ARRAY && a->count == 6, "a: want an array of 6");
	T_CHECK(j.nodes[j.nodes[a->child].next].num == -2500.0, "a[1]: got %g, want -2500",
		j.nodes[j.nodes[a->child].next].num);
	const trace_json_node *c = trace_json_get(&j, b, "c");
	T_CHECK(c && !strcmp(c->str, "x\"y\xc3\xa9\xf0\x9f\x98\x80"), "c: got '%s'",
		c ? c->str : "");
	trace_json_free(&j);
	/* depth limit: deep nesting is an error, not a stack overflow */
	size_t n = 100000;
	char *deep = t_alloc(2 * n);
	memset(deep, '[', n);
	memset(deep + n, ']', n);
	T_CHECK(trace_json_parse(deep, 2 * n, "deep.json", &j, err, sizeof(err)) < 0 &&
			strstr(err, "deep"),
		"deep nesting: message '%s'", err);
	free(deep);
}

/* ---- round trip ----------------------------------------------------------------------------- */

static void round_trip(trace_dtype dtype)
{
	tdir t;
	char err[ERRLEN];
	make_trace(&t, dtype, 2, 37, 5, 11);
	trace_meta m;
	T_CHECK(trace_open(t.path, &m, err, sizeof(err)) == 0, "trace_open: %s", err);
	T_CHECK(m.n_layers == 2 && m.n_q_heads == 4 && m.n_kv_heads == 2 && m.head_dim == 64 &&
			m.prefill_tokens == 37 && m.decode_steps == 5 && m.dtype == dtype &&
			m.scale == 0,
		"meta read back differs");
	T_CHECK(!strcmp(m.model, t.m.model) && !strcmp(m.rope, t.m.rope), "model '%s' rope '%s'",
		m.model, m.rope);
	/* regenerate the same values and compare */
	t_rng r;
	t_rng_seed(&r, 11);
	for (uint32_t l = 0; l < 2; l++) {
		trace_layer want, got;
		fill_layer(&r, &t.m, &want);
		T_CHECK(trace_load_layer(t.path, &m, l, &got, err, sizeof(err)) == 0,
			"layer %u: %s", l, err);
		const float *w[6] = {want.prefill_q, want.prefill_k, want.prefill_v,
				     want.decode_q,  want.decode_k,  want.decode_v};
		const float *g[6] = {got.prefill_q, got.prefill_k, got.prefill_v,
				     got.decode_q,  got.decode_k,  got.decode_v};
		for (unsigned a = 0; a < 6; a++) {
			size_t n = (size_t)(a < 3 ? 37 : 5) * (a % 3 ? 2 : 4) * 64;
			for (size_t i = 0; i < n; i++) {
				float e = dtype == TRACE_F16 ? t_h2f(t_f2h(w[a][i])) : w[a][i];
				T_CHECK(t_fbits(g[a][i]) == t_fbits(e),
					"%s layer %u array %u element %zu: got %a, want %a",
					dtype == TRACE_F16 ? "f16" : "f32", l, a, i,
					(double)g[a][i], (double)e);
			}
		}
		trace_layer_free(&want);
		trace_layer_free(&got);
	}
	remove_trace(&t);
}

static void test_round_trip(void **state)
{
	(void)state;
	round_trip(TRACE_F16);
	round_trip(TRACE_F32);
}

/* ---- malformed traces ----------------------------------------------------------------------- */

/* Rewrite byte `at` of a file (negative: from the end). */
static void poke(const tdir *t, const char *file, long at, unsigned char v)
{
	char p[256];
	size_t n;
	path_of(t, file, p, sizeof(p));
	unsigned char *b = read_bytes(p, &n);
	b[at < 0 ? (long)n + at : at] = v;
	write_bytes(p, b, n);
	free(b);
}

static void truncate_file(const tdir *t, const char *file, size_t cut)
{
	char p[256];
	size_t n;
	path_of(t, file, p, sizeof(p));
	unsigned char *b = read_bytes(p, &n);
	write_bytes(p, b, n - cut);
	free(b);
}

static void write_meta_text(const tdir *t, const char *text)
{
	char p[256];
	path_of(t, "meta.json", p, sizeof(p));
	write_bytes(p, text, strlen(text));
}

/* meta.json as trace_write_meta writes it, with one substring replaced. */
static void edit_meta(const tdir *t, const char *from, const char *to)
{
	char p[256];
	size_t n;
	path_of(t, "meta.json", p, sizeof(p));
	char *s = (char *)read_bytes(p, &n);
	s[n] = 0;
	char *at = strstr(s, from);
	T_CHECK(at != NULL, "meta.json has no '%s'", from);
	char *out = t_alloc(n + strlen(to) + 1);
	sprintf(out, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
	write_meta_text(t, out);
	free(out);
	free(s);
}

static void test_malformed(void **state)
{
	(void)state;
	tdir t;
	char p[256], err[ERRLEN];
	const trace_dtype f16 = TRACE_F16;
	make_trace(&t, f16, 2, 20, 3, 5);
	/* the valid trace loads */
	expect_reject(&(tdir){.path = "/nonexistent-kvt-trace"}, "no directory", "meta.json",
		      "cannot open");
	trace_meta m;
	T_CHECK(trace_open(t.path, &m, err, sizeof(err)) == 0, "valid trace: %s", err);

	poke(&t, "layer0.prefill.k.npy", 0, 'X');
	expect_reject(&t, "bad magic", "layer0.prefill.k.npy", "magic");
	remove_trace(&t);

	make_trace(&t, f16, 2, 20, 3, 5);
	poke(&t, "layer1.decode.q.npy", 8, 0xff); /* header length 0x..ff: past the end */
	poke(&t, "layer1.decode.q.npy", 9, 0xff);
	expect_reject(&t, "header length lies", "layer1.decode.q.npy", "header length");
	remove_trace(&t);

	make_trace(&t, f16, 2, 20, 3, 5);
	truncate_file(&t, "layer1.prefill.v.npy", 2);
	expect_reject(&t, "truncated", "layer1.prefill.v.npy", "truncated");
	remove_trace(&t);

	make_trace(&t, f16, 2, 20, 3, 5);
	poke(&t, "layer1.decode.k.npy", -1, 0x7e); /* last element's high byte: NaN */
	expect_reject(&t, "NaN", "layer1.decode.k.npy", "NaN");
	poke(&t, "layer1.decode.k.npy", -1, 0x7c);
	poke(&t, "layer1.decode.k.npy", -2, 0x00);
	expect_reject(&t, "infinity", "layer1.decode.k.npy",
		      "(step 2, head 1, dim 63) is infinite");
	remove_trace(&t);

	/* wrong shape: a file for 4 KV heads where meta.json says 2 */
	make_trace(&t, f16, 2, 20, 3, 5);
	{
		uint64_t shape[3] = {20, 4, 64};
		uint16_t *z = t_alloc(20 * 4 * 64 * 2);
		memset(z, 0, 20 * 4 * 64 * 2);
		path_of(&t, "layer0.prefill.k.npy", p, sizeof(p));
		T_CHECK(trace_npy_write(p, TRACE_F16, 3, shape, z, err, sizeof(err)) == 0, "%s",
			err);
		expect_reject(&t, "wrong shape", "layer0.prefill.k.npy: shape: (20, 4, 64)",
			      "n_kv_heads = 2");
		uint64_t shape2[2] = {20, 128};
		T_CHECK(trace_npy_write(p, TRACE_F16, 2, shape2, z, err, sizeof(err)) == 0, "%s",
			err);
		expect_reject(&t, "wrong dims", "layer0.prefill.k.npy", "2 dims");
		/* wrong dtype: float32 where meta.json says float16 */
		uint64_t shape3[3] = {20, 2, 64};
		T_CHECK(trace_npy_write(p, TRACE_F32, 3, shape3, z, err, sizeof(err)) == 0, "%s",
			err);
		expect_reject(&t, "wrong dtype", "layer0.prefill.k.npy", "dtype = float16");
		free(z);
	}
	remove_trace(&t);

	make_trace(&t, f16, 2, 20, 3, 5);
	path_of(&t, "layer0.decode.v.npy", p, sizeof(p));
	unlink(p);
	expect_reject(&t, "missing file", "layer0.decode.v.npy", "cannot open");
	remove_trace(&t);

	/* meta.json */
	static const struct {
		const char *from, *to, *w1, *w2;
	} metas[] = {
		{"\"decode_steps\": 3,", "\"decode_steps\": 3,,", "meta.json: line", "expected"},
		{"\"n_kv_heads\": 2", "\"n_kv_heads\": 3", "meta.json: n_kv_heads", "divide"},
		{"\"n_kv_heads\": 2", "\"n_kv_heads\": 2.5", "meta.json: n_kv_heads", "integer"},
		{"\"n_layers\": 2", "\"n_layers\": \"2\"", "meta.json: n_layers", "integer"},
		{"\"n_layers\": 2", "\"n_layers\": 3", "meta.json: files", "layer2.prefill.q.npy"},
		{"\"n_layers\": 2", "\"n_layers\": 1", "meta.json: files[6]",
		 "layer1.prefill.q.npy"},
		{"\"head_dim\": 64,", "", "meta.json: head_dim", "missing"},
		{"\"float16\"", "\"int8\"", "meta.json: dtype", "int8"},
		{"\"float16\"", "\"float32\"", "layer0.prefill.q.npy: descr", "dtype = float32"},
		{"\"prefill_tokens\": 20", "\"prefill_tokens\": 21", "layer0.prefill.q.npy: shape",
		 "prefill_tokens = 21"},
		{"\"version\": 1", "\"version\": 2", "meta.json: version", "2"},
		{"kvtier-trace", "other", "meta.json: format", "other"},
		{"\"layer0.decode.v.npy\"", "\"layer0.decode.q.npy\"", "meta.json: files[",
		 "twice"},
		{"\"layer0.decode.v.npy\"", "\"layer0.decode.w.npy\"", "meta.json: files[",
		 "decode.w"},
		{"\"layer0.decode.v.npy\"", "7", "meta.json: files[", "not a string"},
		{"\"scale\": 0", "\"scale\": -1", "meta.json: scale", "number"},
		{"{", "[", "meta.json: line", ""},
	};
	int bad = 0;
	for (size_t i = 0; i < sizeof(metas) / sizeof(metas[0]); i++) {
		make_trace(&t, f16, 2, 20, 3, 5);
		edit_meta(&t, metas[i].from, metas[i].to);
		trace_meta mm;
		int rc = trace_open(t.path, &mm, err, sizeof(err));
		T_SOFT(&bad, rc < 0 && strstr(err, metas[i].w1) && strstr(err, metas[i].w2),
		       "meta case %zu ('%s' -> '%s'): rc %d, message '%s', wanted '%s' and '%s'", i,
		       metas[i].from, metas[i].to, rc, err, metas[i].w1, metas[i].w2);
		remove_trace(&t);
	}
	/* members it does not know are ignored; scale may be null */
	make_trace(&t, f16, 2, 20, 3, 5);
	edit_meta(&t, "\"scale\": 0", "\"scale\": null, \"capture\": {\"tool\": [1, {}]}");
	T_CHECK(trace_open(t.path, &m, err, sizeof(err)) == 0, "unknown member: %s", err);
	remove_trace(&t);
	T_CHECK(bad == 0, "%d meta.json cases failed", bad);
}

/* ---- the replay ----------------------------------------------------------------------------- */

/* Run kvbench's entry point (kvbench_main, as the executable does) in a child process, since
 * kvbench exits on errors, with stdout and stderr captured into out and errs (NUL-terminated).
 * Returns the exit status. */
static int run_replay(char **argv, char **out, char **errs)
{
	int argc = 0;
	while (argv[argc])
		argc++;
	char po[] = "/tmp/kvt_trace_out_XXXXXX", pe[] = "/tmp/kvt_trace_err_XXXXXX";
	int fo = mkstemp(po), fe = mkstemp(pe);
	T_CHECK(fo >= 0 && fe >= 0, "mkstemp failed");
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	T_CHECK(pid >= 0, "fork failed");
	if (pid == 0) {
		dup2(fo, 1);
		dup2(fe, 2);
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

static double jnum(const trace_json *j, const trace_json_node *o, const char *key)
{
	const trace_json_node *x = trace_json_get(j, o, key);
	T_CHECK(x && x->type == TJ_NUMBER, "the JSON has no number '%s'", key);
	return x->num;
}

static void test_replay(void **state)
{
	(void)state;
	tdir t;
	char *out, *errs, err[ERRLEN];
	trace_json j;
	make_trace(&t, TRACE_F16, 2, 300, 24, 3);
	char *argv[] = {"kvbench", "--trace", t.path,	 "--backend", "cpu", "--p",
			"1",	   "--json",  "--quiet", "--window",  "16",  "--flush",
			"8",	   "--sinks", "4",	 "--chunk",   "128", NULL};
	int rc = run_replay(argv, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 1: exit %d, stderr: %s", rc, errs);
	T_CHECK(trace_json_parse(out, strlen(out), "stdout", &j, err, sizeof(err)) == 0,
		"--json output: %s\n%s", err, out);
	const trace_json_node *root = &j.nodes[1];
	double rmin = jnum(&j, root, "recall_min"), bud = jnum(&j, root, "budget_mean"),
	       oe = jnum(&j, root, "output_error");
	T_CHECK(rmin > 1 - 1e-5, "p = 1: recall_min got %.9f, want 1", rmin);
	T_CHECK(bud == 1.0, "p = 1: budget_mean got %.9f, want 1", bud);
	T_CHECK(oe < 1e-4, "p = 1: output_error got %g, want < 1e-4", oe);
	const trace_json_node *layers = trace_json_get(&j, root, "layers");
	T_CHECK(layers && layers->count == 2, "want 2 layers in the JSON");
	const trace_json_node *l0 = &j.nodes[layers->child],
			      *heads = trace_json_get(&j, l0, "heads");
	T_CHECK(heads && heads->count == 4, "want 4 heads in layer 0");
	T_CHECK(errs[0] == 0, "--quiet: stderr not empty: %s", errs);
	/* the percentiles of one head: with 24 steps the 1st is the minimum (nearest rank), the 5th
	 * the second lowest, so at least the minimum and at most the largest recall, 1 */
	const trace_json_node *h0 = &j.nodes[heads->child];
	double p5 = jnum(&j, h0, "recall_p5"), p1 = jnum(&j, h0, "recall_p1"),
	       hmin = jnum(&j, h0, "recall_min");
	T_CHECK(p1 == hmin && p5 >= hmin && p5 <= 1 + 1e-6,
		"head 0: recall_p1 %.9g (want the minimum %.9g), recall_p5 %.9g (want in [min, 1])",
		p1, hmin, p5);
	free(out);
	free(errs);

	/* the same replay with each layer's sequence spilled to an NVMe file after its prefill: the
	 * decode steps read their rows from the file, and every figure is the same */
	char img[] = "/tmp/kvt_trace_nvme_XXXXXX";
	int fd = mkstemp(img);
	T_CHECK(fd >= 0, "mkstemp failed");
	close(fd);
	unlink(img); /* the library creates and sizes the file */
	char *argv_nv[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--p", "1", "--json",
			   "--quiet", "--window", "16", "--flush", "8", "--sinks", "4", "--chunk",
			   "128", "--nvme", img, NULL};
	char *out_nv, *errs_nv;
	rc = run_replay(argv_nv, &out_nv, &errs_nv);
	unlink(img);
	if (rc != 0 && strstr(errs_nv, "(-95)")) {
		printf("# --nvme replay skipped: no NVMe tier in this build or kernel\n");
	} else {
		trace_json jn;
		T_CHECK(rc == 0, "replay with --nvme: exit %d, stderr: %s", rc, errs_nv);
		T_CHECK(trace_json_parse(out_nv, strlen(out_nv), "stdout", &jn, err, sizeof(err)) == 0,
			"--nvme --json output: %s\n%s", err, out_nv);
		static const char *const same[] = {"recall_mean", "recall_min", "budget_mean",
						   "output_error", "recall_p5_worst_head"};
		for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++)
			T_CHECK(jnum(&jn, &jn.nodes[1], same[i]) == jnum(&j, root, same[i]),
				"--nvme: %s got %.9g, want %.9g as without", same[i],
				jnum(&jn, &jn.nodes[1], same[i]), jnum(&j, root, same[i]));
		double nb = jnum(&jn, &jn.nodes[1], "nvme_bytes_per_step");
		T_CHECK(nb > 0, "--nvme: nvme_bytes_per_step got %g, want > 0", nb);
		T_CHECK(jnum(&j, root, "nvme_bytes_per_step") == 0,
			"no NVMe tier: nvme_bytes_per_step got %g, want 0",
			jnum(&j, root, "nvme_bytes_per_step"));
		trace_json_free(&jn);
	}
	free(out_nv);
	free(errs_nv);
	trace_json_free(&j);

	/* p = 0.5 on one layer: a subset, recall below 1, budget below 1; the text table */
	char *argv2[] = {"kvbench", "--trace",	t.path, "--backend=cpu", "--p=0.5", "--layers",
			 "1",	    "--window", "16",	"--budget-min",	 "0",	    NULL};
	rc = run_replay(argv2, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 0.5: exit %d, stderr: %s", rc, errs);
	T_CHECK(strstr(out, "recall mean") && strstr(out, "budget_mean"), "text output: %s", out);
	free(out);
	free(errs);
	char *argv3[] = {"kvbench", "--trace",	    t.path,	"--backend", "cpu",
			 "--p",	    "0.5",	    "--layers", "1",	     "--window",
			 "16",	    "--budget-min", "0",	"--json",    NULL};
	rc = run_replay(argv3, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 0.5 --json: exit %d, stderr: %s", rc, errs);
	T_CHECK(trace_json_parse(out, strlen(out), "stdout", &j, err, sizeof(err)) == 0, "%s", err);
	double rm = jnum(&j, &j.nodes[1], "recall_mean");
	bud = jnum(&j, &j.nodes[1], "budget_mean");
	/* the 1-bit estimate of random vectors is rough: recall may fall short of p, but some mass
	 * is found with part of the budget */
	T_CHECK(rm > 0.1 && rm < 1 && bud > 0 && bud < 1,
		"p = 0.5: recall_mean %g (want in (0.1, 1)), budget_mean %g (want in (0, 1))", rm,
		bud);
	T_CHECK(jnum(&j, &j.nodes[1], "layers_replayed") == 1, "--layers 1: want one layer");
	trace_json_free(&j);
	free(out);
	free(errs);

	/* bad options: exit 2 naming the option */
	static const char *bad_opts[][3] = {{"--frobnicate", NULL, "--frobnicate"},
					    {"--p", "1.5", "--p"},
					    {"--backend", "tpu", "tpu"},
					    {"--layers", "7", "--layers"},
					    {"--layers", "1-0", "--layers"},
					    {"--window", "-3", "--window"},
					    {"stray", NULL, "stray"}};
	for (size_t i = 0; i < sizeof(bad_opts) / sizeof(bad_opts[0]); i++) {
		char *av[] = {"kvbench",
			      "--trace",
			      t.path,
			      (char *)bad_opts[i][0],
			      (char *)bad_opts[i][1],
			      NULL};
		rc = run_replay(av, &out, &errs);
		T_CHECK(rc == 2 && strstr(errs, bad_opts[i][2]),
			"option %s %s: exit %d, stderr '%s', want 2 naming '%s'", bad_opts[i][0],
			bad_opts[i][1] ? bad_opts[i][1] : "", rc, errs, bad_opts[i][2]);
		free(out);
		free(errs);
	}
	char *av_none[] = {"kvbench", "--json", "--trace", NULL};
	rc = run_replay(av_none, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--trace"), "no trace directory: exit %d, '%s'", rc, errs);
	free(out);
	free(errs);
	/* an option of the synthetic runs: refused, naming it */
	char *av_shape[] = {"kvbench", "--trace", t.path, "--context", "100", NULL};
	rc = run_replay(av_shape, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--context"), "--trace with --context: exit %d, '%s'", rc,
		errs);
	free(out);
	free(errs);

	/* a corrupted file: exit 1, the file named */
	poke(&t, "layer1.decode.k.npy", -1, 0x7e);
	rc = run_replay(argv, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer1.decode.k.npy") && strstr(errs, "NaN"),
		"corrupted trace: exit %d, stderr '%s', want 1 naming layer1.decode.k.npy", rc,
		errs);
	free(out);
	free(errs);
	truncate_file(&t, "layer0.prefill.q.npy", 1);
	rc = run_replay(argv, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer0.prefill.q.npy"),
		"truncated trace: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	remove_trace(&t);
}

/* float32 trace with a value float16 cannot hold: named, and bf16 replays it */
static void test_replay_overflow(void **state)
{
	(void)state;
	tdir t;
	char err[ERRLEN], p[256], *out, *errs;
	make_trace(&t, TRACE_F32, 1, 40, 4, 9);
	trace_layer tl;
	T_CHECK(trace_load_layer(t.path, &t.m, 0, &tl, err, sizeof(err)) == 0, "%s", err);
	tl.prefill_v[5] = 1e6f;
	T_CHECK(trace_write_layer(t.path, &t.m, 0, &tl, err, sizeof(err)) == 0, "%s", err);
	trace_layer_free(&tl);
	char *argv[] = {"kvbench", "--trace", t.path,	  "--backend", "cpu",
			"--quiet", "--json",  "--window", "8",	       NULL};
	int rc = run_replay(argv, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer0.prefill.v.npy") && strstr(errs, "bf16"),
		"overflow: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	char *argv2[] = {"kvbench", "--trace",	t.path, "--backend", "cpu",  "--quiet",
			 "--json",  "--window", "8",	"--dtype",   "bf16", NULL};
	rc = run_replay(argv2, &out, &errs);
	T_CHECK(rc == 0, "bf16: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	path_of(&t, "meta.json", p, sizeof(p));
	remove_trace(&t);
}

/* ---- UTF-8 (issue 11, defect 8) ------------------------------------------------------------- */

/* The tests' own RFC 3629 check, by code point: the length of the valid sequence at s, or 0. */
static size_t t_utf8_ok(const unsigned char *s, size_t n)
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
static size_t t_utf8_bad_at(const char *s, size_t n)
{
	for (size_t i = 0, len; i < n; i += len)
		if (!(len = t_utf8_ok((const unsigned char *)s + i, n - i)))
			return i;
	return n;
}

/*
 * The JSON parser accepts exactly valid UTF-8 in strings: the longest and shortest forms of each
 * length are accepted; a stray continuation byte, overlong forms, surrogates, code points above
 * U+10FFFF and truncated sequences are rejected with a message naming the byte offset. Then
 * trace_utf8_len agrees with the tests' own check on every 1-, 2- and 3-byte input and on random
 * 4-byte ones.
 */
static void test_utf8(void **state)
{
	(void)state;
	static const struct {
		const char *text;
		size_t bad_at; /* 0: valid */
	} cases[] = {
		{"[\"\x7f \xc2\x80 \xdf\xbf \xe0\xa0\x80 \xef\xbf\xbf \xf0\x90\x80\x80 \xf4\x8f\xbf\xbf\"]",
		 0},
		{"[\"ab\x80\"]", 4},             /* a stray continuation byte */
		{"[\"\xc0\xaf\"]", 2},           /* overlong '/' */
		{"[\"\xc1\xbf\"]", 2},           /* overlong */
		{"[\"x\xe0\x80\xaf\"]", 3},      /* overlong, three bytes */
		{"[\"\xf0\x80\x80\xaf\"]", 2},   /* overlong, four bytes */
		{"[\"\xed\xa0\x80\"]", 2},       /* the surrogate U+D800 */
		{"[\"\xed\xbf\xbf\"]", 2},       /* the surrogate U+DFFF */
		{"[\"\xf4\x90\x80\x80\"]", 2},   /* U+110000 */
		{"[\"\xf5\x80\x80\x80\"]", 2},   /* a lead byte beyond U+10FFFF */
		{"[\"\xff\"]", 2},
		{"[\"\xc3\"]", 2},               /* truncated by the closing quote */
		{"[\"\xe2\x82\"]", 2},           /* truncated */
		{"{\"k\xc3\x28\": 1}", 3},       /* in a member name */
		{"[\"ok\"] \xc3\xa9", 0xffff},   /* outside a string: a syntax error */
	};
	int bad = 0;
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		char err[ERRLEN] = "", want[64];
		trace_json j;
		int rc = trace_json_parse(cases[i].text, strlen(cases[i].text), "u.json", &j, err,
					  sizeof err);
		if (cases[i].bad_at == 0) {
			T_SOFT(&bad, rc == 0, "case %zu: rc %d (%s), wanted accepted", i, rc, err);
			if (rc == 0)
				trace_json_free(&j);
			continue;
		}
		snprintf(want, sizeof want, "invalid UTF-8 at byte offset %zu", cases[i].bad_at);
		T_SOFT(&bad, rc == -EINVAL && (cases[i].bad_at == 0xffff || strstr(err, want)),
		       "case %zu: rc %d, message '%s', wanted -EINVAL and '%s'", i, rc, err,
		       cases[i].bad_at == 0xffff ? "(a syntax error)" : want);
		if (rc == 0)
			trace_json_free(&j);
	}
	/* every 1-, 2- and 3-byte input, and random 4-byte ones */
	unsigned char b[4];
	for (uint32_t x = 0; x < (1u << 24); x++) {
		b[0] = (unsigned char)(x >> 16), b[1] = (unsigned char)(x >> 8), b[2] = (unsigned char)x;
		for (size_t n = 1; n <= 3; n++) {
			if (n < 3 && (x & ((1u << (8 * (3 - n))) - 1)))
				continue;
			size_t want = t_utf8_ok(b, n), got = (size_t)trace_utf8_len(b, n, NULL);
			T_SOFT(&bad, got == want, "trace_utf8_len(%02x %02x %02x, n = %zu) got %zu, wanted %zu",
			       b[0], b[1], b[2], n, got, want);
			if (bad > 10)
				fail();
		}
	}
	t_rng r;
	t_rng_seed(&r, 0x0f8u);
	for (int i = 0; i < 1000000; i++) {
		uint64_t x = t_next(&r);
		memcpy(b, &x, 4);
		b[0] |= 0xf0;
		size_t want = t_utf8_ok(b, 4), got = (size_t)trace_utf8_len(b, 4, NULL);
		T_SOFT(&bad, got == want, "trace_utf8_len(%02x %02x %02x %02x) got %zu, wanted %zu",
		       b[0], b[1], b[2], b[3], got, want);
		if (bad > 10)
			fail();
	}
	T_CHECK(bad == 0, "%d UTF-8 cases failed", bad);
}

static void test_replay_utf8(void **state);

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_half),
		cmocka_unit_test(test_npy_headers),
		cmocka_unit_test(test_json),
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_malformed),
		cmocka_unit_test(test_replay),
		cmocka_unit_test(test_replay_overflow),
		cmocka_unit_test(test_utf8),
		cmocka_unit_test(test_replay_utf8),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * kvbench --json prints valid JSON whatever the bytes: a trace directory whose name is not UTF-8
 * (any bytes but '/' and NUL are a valid Linux name) comes out with U+FFFD in their place, and a
 * meta.json whose model name holds a surrogate is refused, naming the byte offset.
 */
static void test_replay_utf8(void **state)
{
	(void)state;
	tdir t;
	char *out, *errs;
	make_trace(&t, TRACE_F16, 1, 40, 2, 9);
	char odd[sizeof t.path + 16];
	snprintf(odd, sizeof odd, "%s-\xff\xc0\xaf-\xc3\xa9", t.path);
	T_CHECK(rename(t.path, odd) == 0, "rename %s failed", t.path);
	char *argv[] = {"kvbench", "--trace", odd,  "--backend", "cpu", "--json",
			"--quiet", "--window", "8", NULL};
	int rc = run_replay(argv, &out, &errs);
	T_CHECK(rename(odd, t.path) == 0, "rename back failed");
	size_t n = strlen(out), at = t_utf8_bad_at(out, n);
	T_CHECK(rc == 0 && at == n, "replay from a non-UTF-8 directory name: exit %d, stdout invalid "
		"UTF-8 at byte %zu of %zu (got 0x%02x, wanted none), stderr '%s'", rc, at, n,
		at < n ? (unsigned char)out[at] : 0, errs);
	trace_json j;
	char err[ERRLEN];
	T_CHECK(trace_json_parse(out, n, "stdout", &j, err, sizeof err) == 0, "--json: %s", err);
	const trace_json_node *dir =
		trace_json_get(&j, trace_json_get(&j, &j.nodes[1], "trace"), "dir");
	char want[sizeof odd + 16];
	snprintf(want, sizeof want, "%s-\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd-\xc3\xa9", t.path);
	T_CHECK(dir && dir->type == TJ_STRING && !strcmp(dir->str, want),
		"trace in the JSON: got '%s', wanted '%s'", dir && dir->str ? dir->str : "(none)",
		want);
	trace_json_free(&j);
	free(out);
	free(errs);

	edit_meta(&t, "random", "rand\xed\xa0\x80om");
	trace_meta m;
	rc = trace_open(t.path, &m, err, sizeof err);
	T_CHECK(rc == -EINVAL && strstr(err, "meta.json") && strstr(err, "invalid UTF-8 at byte offset"),
		"meta.json with a surrogate in the model name: rc %d, message '%s', wanted -EINVAL "
		"naming meta.json and the byte offset", rc, err);
	remove_trace(&t);
}
