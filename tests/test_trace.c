/* SPDX-License-Identifier: MIT */
/*
 * Traces (tools/trace.c, doc/trace-format.md): the writer and the reader round-trip; .npy headers
 * as numpy writes them are accepted and nonsense is rejected; every malformed trace (bad magic,
 * wrong shape, truncated array, NaN, bad JSON, missing file, wrong dtype, a header length that
 * lies, ...) fails with a message naming the file and the field; and `kvbench --trace` replays a
 * small trace end to end on the CPU backend (recall 1 at p = 1) and fails, naming the file, on a
 * corrupted one (test_trace_replay.c); the replay's simulated hot cache keeps the rows read most
 * recently, to the share of a step where its edge falls, and its self-sized one follows the CUDA
 * backend's rule (test_hot_sim). Shared helpers: trace_testutil.h.
 */
#include "trace_testutil.h"

#include "gpu/hotsize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* ---- UTF-8 (issue 11, defect 8) ------------------------------------------------------------- */

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

/* ---- the trace replay's simulated hot cache (tools/kvbench_hotsim.c) ---------------------- */

/* By hand, two rows of room in one set: a row held is a hit, and a miss takes the least recently
 * used way not used in this step, or none; no room, nothing hits; room for all, every read after
 * the first does. Two rows of one set in a direct-mapped cache of two sets push each other out.
 * Then the self-sized cache on two sequences. */
static void test_hot_sim(void **state)
{
	(void)state;
	enum { A, B, C, D };
	/* A B | A B C D (C and D find both ways used in this step: read in place) | A B C: 4 hits;
	 * A | B | C (takes A's way) | B | A (takes C's) | B: 2 hits */
	static const uint64_t l0[][4] = {{A, B}, {A, B, C, D}, {A, B, C}},
			      l1[][1] = {{A}, {B}, {C}, {B}, {A}, {B}};
	static const size_t n0[] = {2, 4, 3};
	static const double want_hits[2][6] = {{0, 2, 4}, {0, 0, 0, 1, 1, 2}};
	static const uint64_t want_reads[2][6] = {{0, 4, 7}, {0, 1, 2, 3, 4, 5}};
	kb_lru l;
	for (int c = 0; c < 2; c++) {
		const uint32_t steps = c ? 6 : 3;
		T_CHECK(kb_lru_init(&l, 4, 2, steps, 2, 0) == 0, "kb_lru_init failed");
		for (uint32_t s = 0; s < steps; s++) {
			T_CHECK(kb_lru_step(&l, s, c ? l1[s] : l0[s], c ? 1 : n0[s]) == 0,
				"kb_lru_step failed");
			T_CHECK(l.hits == want_hits[c][s] && l.reads == want_reads[c][s],
				"case %d, after step %u: hits %g of %llu reads, want %g of %llu", c, s,
				l.hits, (unsigned long long)l.reads, want_hits[c][s],
				(unsigned long long)want_reads[c][s]);
		}
		kb_lru_free(&l);
	}
	static const uint64_t s0[] = {A, B}, s1[] = {A, B}, s2[] = {C}, s3[] = {A}, s4[] = {B, D};
	const uint64_t *steps[] = {s0, s1, s2, s3, s4};
	const size_t n[] = {2, 2, 1, 1, 2};
	for (uint32_t cap = 0; cap <= 4; cap += 4) {
		T_CHECK(kb_lru_init(&l, 4, cap, 5, cap, 0) == 0, "kb_lru_init failed");
		for (uint32_t s = 0; s < 5; s++)
			T_CHECK(kb_lru_step(&l, s, steps[s], n[s]) == 0, "kb_lru_step failed");
		const double want = cap ? 4.0 : 0.0; /* A and B at step 1, A at 3, B at 4 */
		T_CHECK(l.hits == want && l.reads == 6, "cap %u: hits %g of %llu reads, want %g of 6",
			cap, l.hits, (unsigned long long)l.reads, want);
		kb_lru_free(&l);
	}
	/* direct mapped, two sets: positions 0 and 2 of KV head 1 share a set (gpu/hotsize.h: the
	 * head's mix plus the position, modulo the sets); read in turn, they never hit, where 1 and
	 * 2 (two sets) hit from their second reads on */
	T_CHECK(kvt_hot_set(KB_HOT_UID, 1, 0, 2) == kvt_hot_set(KB_HOT_UID, 1, 2, 2) &&
			kvt_hot_set(KB_HOT_UID, 1, 1, 2) != kvt_hot_set(KB_HOT_UID, 1, 2, 2),
		"kvt_hot_set: positions 0 and 2 should share a set, 1 and 2 not");
	for (int c = 0; c < 2; c++) {
		T_CHECK(kb_lru_init(&l, 8, 2, 6, 1, 4) == 0, "kb_lru_init failed");
		for (uint32_t s = 0; s < 6; s++) {
			const uint64_t r = 4 + (s % 2 ? 2 : (uint64_t)c); /* KV head 1 */
			T_CHECK(kb_lru_step(&l, s, &r, 1) == 0, "kb_lru_step failed");
		}
		T_CHECK(l.hits == (c ? 4.0 : 0.0) && l.reads == 5,
			"direct mapped, positions %d and 2: hits %g of %llu, want %g of 5", c, l.hits,
			(unsigned long long)l.reads, c ? 4.0 : 0.0);
		kb_lru_free(&l);
	}
	/* a growth keeps the rows it held: self-sized, direct mapped, rows 0-9 at steps 0-3 and rows
	 * 10-29 at step 2 too; it grows to 20 sets after step 0 (nothing held: step 1 misses) and to
	 * 60 after step 2, whose hits (0-9) it moves into their new sets and hits again at step 3 */
	T_CHECK(kb_lru_init(&l, 100, 0, 4, 1, 100) == 0, "kb_lru_init failed");
	l.grows = KB_LRU_RULE;
	for (uint32_t s = 0; s < 4; s++) {
		uint64_t r[30];
		const size_t nr = s == 2 ? 30 : 10;
		for (uint64_t i = 0; i < nr; i++)
			r[i] = i;
		T_CHECK(kb_lru_step(&l, s, r, nr) == 0, "kb_lru_step failed");
	}
	T_CHECK(l.cap == 60 && l.hits == 20.0 && l.reads == 50,
		"growth: %llu rows, hits %g of %llu reads; want 60 rows, 20 hits of 50",
		(unsigned long long)l.cap, l.hits, (unsigned long long)l.reads);
	kb_lru_free(&l);
	/* self-sized (gpu/hotsize.h's rule), 100 rows direct mapped (so whole sets are rows, and ten
	 * neighbouring positions take ten sets), ten steps of ten rows: the same ten every
	 * step grow it once, to twice the demand, after the first step (which found no room, so
	 * the second misses too), and hit from the third on; ten new ones every step
	 * double it each time its misses have filled it (after steps 0, 2, 4, 8: 20, 40, 80, then
	 * 160 cut to the 100 rows) and never hit; on demand alone they leave it at 20 */
	static const char *const what[3] = {"the same rows", "new rows", "new rows, on demand"};
	for (int drift = 0; drift < 3; drift++) {
		T_CHECK(kb_lru_init(&l, 100, 0, 10, 1, 100) == 0, "kb_lru_init failed");
		l.grows = drift == 2 ? KB_LRU_DEMAND : KB_LRU_RULE;
		const uint64_t want_cap[10] = {20, 20, 40, 40, 80, 80, 80, 80, 100, 100};
		for (uint32_t s = 0; s < 10; s++) {
			uint64_t r[10];
			for (uint64_t i = 0; i < 10; i++)
				r[i] = drift ? 10 * s + i : i;
			T_CHECK(kb_lru_step(&l, s, r, 10) == 0, "kb_lru_step failed");
			const uint64_t want = drift == 1 ? want_cap[s] : 20;
			T_CHECK(l.cap == want, "self-sized, %s, step %u: %llu rows, want %llu",
				what[drift], s, (unsigned long long)l.cap,
				(unsigned long long)want);
		}
		T_CHECK(l.hits == (drift ? 0.0 : 80.0) && l.reads == 90,
			"self-sized, %s: hits %g of %llu reads, want %g of 90", what[drift], l.hits,
			(unsigned long long)l.reads, drift ? 0.0 : 80.0);
		kb_lru_free(&l);
	}
}

/* The most hits any cache of `cap` rows gets on the log: every choice of what to keep after each
 * step (at most cap rows of those it held and those the step read), by dynamic programming over
 * the held sets of up to eight rows. */
static uint64_t best_hits(const uint32_t *masks, uint32_t steps, uint32_t rows, uint32_t cap)
{
	int64_t best[256], nb[256]; /* the most hits so far with this set held, -1: unreachable */
	for (uint32_t m = 0; m < 1u << rows; m++)
		best[m] = m == 0 ? 0 : -1;
	for (uint32_t s = 0; s < steps; s++) {
		for (uint32_t m = 0; m < 1u << rows; m++)
			nb[m] = -1;
		for (uint32_t m = 0; m < 1u << rows; m++) {
			if (best[m] < 0)
				continue;
			const int64_t h = best[m] + (s ? __builtin_popcount(m & masks[s]) : 0);
			const uint32_t can = m | masks[s];
			for (uint32_t k = can;; k = (k - 1) & can) { /* every subset of can */
				if ((uint32_t)__builtin_popcount(k) <= cap && h > nb[k])
					nb[k] = h;
				if (!k)
					break;
			}
		}
		memcpy(best, nb, sizeof(best));
	}
	int64_t most = 0;
	for (uint32_t m = 0; m < 1u << rows; m++)
		most = best[m] > most ? best[m] : most;
	return (uint64_t)most;
}

/* The CUDA backend's rule as kvbench_trace.h states it, `sets` sets of `ways` ways, rows h * 4 +
 * pos, written out row by row. */
static uint64_t rule_hits(const uint32_t *masks, uint32_t steps, uint32_t rows, uint32_t sets,
			  uint32_t ways)
{
	int32_t row_of[8], last[8]; /* [set * ways + way], -1: empty */
	uint64_t hits = 0;
	for (uint32_t w = 0; w < sets * ways; w++)
		row_of[w] = last[w] = -1;
	for (uint32_t s = 0; s < steps; s++) {
		uint32_t fresh[8], nf = 0;
		for (uint32_t i = 0; i < rows; i++) {
			if (!(masks[s] >> i & 1))
				continue;
			int w = -1;
			for (uint32_t x = 0; x < sets * ways; x++)
				if (row_of[x] == (int32_t)i)
					w = (int)x;
			if (w < 0) {
				fresh[nf++] = i;
				continue;
			}
			hits += s > 0;
			last[w] = (int32_t)s;
		}
		for (uint32_t a = 1; a < nf; a++) /* misses by their hash of row and step */
			for (uint32_t b = a; b > 0; b--) {
				const uint64_t x = kb_row_hash(fresh[b - 1] ^ (s + 1ull) * KB_STEP_MIX),
					       y = kb_row_hash(fresh[b] ^ (s + 1ull) * KB_STEP_MIX);
				if (x <= y)
					break;
				const uint32_t t = fresh[b];
				fresh[b] = fresh[b - 1];
				fresh[b - 1] = t;
			}
		for (uint32_t f = 0; f < nf && sets; f++) {
			const uint32_t w0 = kvt_hot_set(KB_HOT_UID, fresh[f] / 4, fresh[f] % 4, sets) * ways;
			int v = -1; /* an empty way, else the least recently used not used in this step */
			for (uint32_t w = w0; w < w0 + ways; w++)
				if (last[w] != (int32_t)s && (v < 0 || last[w] < last[v]))
					v = (int)w;
			if (v < 0)
				continue;
			row_of[v] = (int32_t)fresh[f];
			last[v] = (int32_t)s;
		}
	}
	return hits;
}

/* On random logs of up to eight rows (two KV heads of four positions), at every size: the offline
 * optimum equals the most hits any choice gets; the simulated backend's rule, in one set and in
 * sets of fewer ways, equals the rule written out row by row, and never beats the optimum. */
static void test_hot_policies(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, 5);
	for (int trial = 0; trial < 300; trial++) {
		const uint32_t rows = 1 + (uint32_t)(t_next(&r) % 8),
			       steps = 1 + (uint32_t)(t_next(&r) % 9);
		uint32_t masks[9];
		kb_hotlog g;
		T_CHECK(kb_hotlog_init(&g, rows, steps) == 0, "kb_hotlog_init failed");
		for (uint32_t s = 0; s < steps; s++) {
			masks[s] = (uint32_t)(t_next(&r) & ((1u << rows) - 1));
			uint64_t row[8];
			size_t n = 0;
			for (uint32_t i = 0; i < rows; i++)
				if (masks[s] >> i & 1)
					row[n++] = i;
			T_CHECK(kb_hotlog_step(&g, row, n) == 0, "kb_hotlog_step failed");
		}
		T_CHECK(kb_hotlog_step(&g, g.row, 0) < 0, "a step past the log's steps was kept");
		for (uint32_t cap = 0; cap <= rows; cap++) {
			uint64_t opt, reads;
			T_CHECK(kb_hot_optimum(&g, cap, &opt, &reads) == 0, "out of memory");
			const uint64_t best = best_hits(masks, steps, rows, cap);
			T_CHECK(opt == best, "trial %d (%u rows, %u steps), cap %u: optimum %llu, the "
				"best is %llu", trial, rows, steps, cap, (unsigned long long)opt,
				(unsigned long long)best);
			/* one set, or sets of one, two or four ways */
			for (uint32_t ways = 1; ways <= cap; ways *= 2) {
				const uint32_t wy = ways == 8 || cap % ways ? cap : ways,
					       sets = cap / wy;
				const uint64_t rule = rule_hits(masks, steps, rows, sets, wy);
				kb_lru l;
				T_CHECK(kb_lru_init(&l, rows, cap, steps, wy, 4) == 0,
					"kb_lru_init failed");
				for (uint32_t s = 0; s < steps; s++)
					T_CHECK(kb_lru_step(&l, s, g.row + g.first[s],
							    g.first[s + 1] - g.first[s]) == 0,
						"kb_lru_step failed");
				T_CHECK(l.hits == (double)rule && rule <= best && reads == l.reads,
					"trial %d (%u rows, %u steps), cap %u in %u sets: the rule %g "
					"of %llu reads, written out %llu; the best is %llu", trial,
					rows, steps, cap, sets, l.hits, (unsigned long long)reads,
					(unsigned long long)rule, (unsigned long long)best);
				kb_lru_free(&l);
			}
		}
		kb_hotlog_free(&g);
	}
}

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
		cmocka_unit_test(test_replay_sweep),
		cmocka_unit_test(test_utf8),
		cmocka_unit_test(test_replay_utf8),
		cmocka_unit_test(test_hot_sim),
		cmocka_unit_test(test_hot_policies),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
