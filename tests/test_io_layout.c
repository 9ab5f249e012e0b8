/* SPDX-License-Identifier: MIT */
/*
 * kvt_prefill_at, kvt_append_at, kvt_attend_at and kvt_extend_at on the CPU backend (suite unit):
 * q, k, v and out as the strided views runtimes hand over.
 *   - a fused qkv projection split three ways (token stride (n_q_heads + 2 n_kv_heads) head_dim,
 *     out padded between heads and tokens) and [B, H, T, D] transposes (token stride head_dim,
 *     head stride T head_dim, out with a gap after each head): each call gives, bit for bit, the
 *     outputs and the sequence state that the plain call gives on a twin cache with the same
 *     values dense; the gaps of the input views hold NaN (a gathered gap would be refused or show),
 *     and no byte of out outside its (token, head) rows changes;
 *   - a dense layout (NULL, all zero, the dense strides spelt out, one strided row that is dense
 *     anyway) allocates no scratch;
 *   - bad layouts: -EINVAL naming the field, its value and the limit, and nothing changed;
 *   - allocation faults: a strided prefill and attend failing at the N-th allocation for N = 1, 2,
 *     ... change nothing (out untouched) and leak nothing.
 */
#include "common.h"

#define D 64
#define NKV 2
#define NQ 4
#define NL 2
#define QKV ((NQ + 2 * NKV) * D) /* fused projection: elements per token */
#define OUT_HS (D + 16)          /* fused case: out's head stride and token stride (padded) */
#define OUT_TS ((NQ - 1) * OUT_HS + D + 8)
#define MAXT 320
#define NSEQ 3

enum kind { FUSED, TRANSPOSED, NKIND };
static const char *const kind_name[NKIND] = {"fused qkv", "[B, H, T, D]"};

static uint16_t g_q[MAXT * NQ * D], g_k[MAXT * NKV * D], g_v[MAXT * NKV * D]; /* dense values */
static uint16_t g_in[MAXT * QKV];              /* the strided inputs (NaN between rows) */
static uint8_t g_out[MAXT * (NQ + 1) * OUT_TS * 4]; /* the strided out (a sentinel elsewhere) */
static uint8_t g_want[sizeof g_out];
static uint8_t g_dense_out[MAXT * NQ * D * 4];
static t_rng g_rng;

static kvt_cache *make_cache(uint32_t out_dtype)
{
	kvt_config cfg = t_config(NL, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.out_dtype = out_dtype;
	cfg.p = 0.9f;
	cfg.budget_min = KVT_NONE;
	return t_create(&cfg);
}

static size_t out_elem(uint32_t out_dtype)
{
	return out_dtype == KVT_DTYPE_F32 ? 4 : 2;
}

static void fill(uint32_t n)
{
	t_fill(&g_rng, KVT_DTYPE_F16, (size_t)n * NQ * D, 0.3, 1.0, g_q, NULL);
	t_fill(&g_rng, KVT_DTYPE_F16, (size_t)n * NKV * D, 0.2, 1.0, g_k, NULL);
	t_fill(&g_rng, KVT_DTYPE_F16, (size_t)n * NKV * D, 0.0, 1.0, g_v, NULL);
}

/* The layout of `kind` for n rows. */
static kvt_io_layout layout_of(enum kind kind, uint32_t n)
{
	kvt_io_layout lo = {sizeof lo, 0, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
	if (kind == FUSED) {
		lo.q = lo.k = lo.v = (kvt_io_view){QKV, D};
		lo.out = (kvt_io_view){OUT_TS, OUT_HS};
	} else {
		lo.q = lo.k = lo.v = (kvt_io_view){D, (uint64_t)n * D};
		lo.out = (kvt_io_view){D, (uint64_t)(n + 1) * D};
	}
	return lo;
}

/* Dense [n, heads, D] rows of `elem` bytes from src into the view v of dst, or back (to_dense). */
static void move_rows(void *view, const kvt_io_view *v, void *dense, uint32_t n, uint32_t heads,
		      size_t elem, int to_dense)
{
	const uint64_t hs = v->head_stride ? v->head_stride : D;
	const uint64_t ts = v->token_stride ? v->token_stride : heads * hs;
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t h = 0; h < heads; h++) {
			uint8_t *a = (uint8_t *)view + (t * ts + h * hs) * elem;
			uint8_t *b = (uint8_t *)dense + ((size_t)t * heads + h) * D * elem;
			memcpy(to_dense ? b : a, to_dense ? a : b, D * elem);
		}
}

/* The strided inputs of n rows in g_in (NaN elsewhere); q, k, v receive their views' bases. */
static void place(enum kind kind, uint32_t n, const kvt_io_layout *lo, const void **q,
		  const void **k, const void **v)
{
	memset(g_in, 0xff, sizeof g_in);
	uint16_t *b[3];
	if (kind == FUSED) {
		b[0] = g_in;
		b[1] = g_in + NQ * D;
		b[2] = g_in + (NQ + NKV) * D;
	} else {
		b[0] = g_in;
		b[1] = g_in + (size_t)NQ * n * D;
		b[2] = b[1] + (size_t)NKV * n * D;
	}
	move_rows(b[0], &lo->q, g_q, n, NQ, 2, 0);
	move_rows(b[1], &lo->k, g_k, n, NKV, 2, 0);
	move_rows(b[2], &lo->v, g_v, n, NKV, 2, 0);
	*q = b[0];
	*k = b[1];
	*v = b[2];
}

/* g_out to the sentinel, and g_want to what it must hold once the dense out (n rows) is placed. */
static void out_prepare(void)
{
	memset(g_out, 0xa5, sizeof g_out);
	memset(g_want, 0xa5, sizeof g_want);
}

static void out_expect(const char *what, const kvt_io_layout *lo, uint32_t n, size_t elem)
{
	move_rows(g_want, &lo->out, g_dense_out, n, NQ, elem, 0);
	for (size_t x = 0; x < sizeof g_out; x++)
		T_CHECK(g_out[x] == g_want[x], "%s: out byte %zu got 0x%02x, wanted 0x%02x (%s)", what,
			x, g_out[x], g_want[x], g_want[x] == 0xa5 ? "outside the rows" : "a row");
}

/* a of ca and b of cb: the same lengths, index counts, centroids, rows and attention outputs. */
static void expect_same(kvt_cache *ca, uint32_t a, kvt_cache *cb, uint32_t b, const char *what)
{
	static uint16_t ka[2 * MAXT * 8 * NKV * D], kb[sizeof ka / 2], va[sizeof ka / 2];
	for (uint32_t l = 0; l < NL; l++) {
		const struct kvt_layer *la = &ca->seqs[a].layers[l], *lb = &cb->seqs[b].layers[l];
		T_CHECK(la->n_tokens == lb->n_tokens && la->n_indexed == lb->n_indexed,
			"%s layer %u: tokens %u indexed %u, wanted %u indexed %u", what, l,
			la->n_tokens, la->n_indexed, lb->n_tokens, lb->n_indexed);
		T_CHECK(la->centroids == lb->centroids &&
			(!la->centroids || (!memcmp(la->c_k, lb->c_k, sizeof(float) * NKV * D) &&
					    !memcmp(la->c_q, lb->c_q, sizeof(float) * NKV * D))),
			"%s layer %u: centroids differ", what, l);
		if (!la->n_tokens)
			continue;
		T_CHECK(la->n_tokens * NKV * D <= sizeof ka / 2, "%s: test buffer too small", what);
		T_CHECK(kvt_seq_read_rows(ca, a, l, 0, la->n_tokens, ka, va, NULL) > 0 &&
			kvt_seq_read_rows(cb, b, l, 0, lb->n_tokens, kb, va, NULL) > 0 &&
			!memcmp(ka, kb, (size_t)la->n_tokens * NKV * D * 2), "%s layer %u: rows differ",
			what, l);
		uint16_t q[NQ * D];
		float oa[NQ * D] = {0}, ob[NQ * D] = {0}; /* fp16 outputs fill half */
		t_fill(&g_rng, KVT_DTYPE_F16, NQ * D, 0.3, 1.0, q, NULL);
		T_CHECK(kvt_attend(ca, l, 1, &a, q, oa, NULL) == 0 &&
			kvt_attend(cb, l, 1, &b, q, ob, NULL) == 0, "%s layer %u: attend: %s / %s",
			what, l, kvt_last_error(ca), kvt_last_error(cb));
		T_CHECK(!memcmp(oa, ob, sizeof oa), "%s layer %u: attention output differs", what, l);
	}
}

/* Twin caches (strided c, dense r) with NSEQ sequences each, holding pre[i] dense tokens. */
struct twin {
	kvt_cache *c, *r;
	uint32_t sc[NSEQ], sr[NSEQ];
};

static void twin_open(struct twin *w, uint32_t out_dtype, const uint32_t *pre)
{
	w->c = make_cache(out_dtype);
	w->r = make_cache(out_dtype);
	for (int i = 0; i < NSEQ; i++) {
		T_CHECK(kvt_seq_open(w->c, &w->sc[i]) == 0 && kvt_seq_open(w->r, &w->sr[i]) == 0, "open");
		if (!pre || !pre[i])
			continue;
		fill(pre[i]);
		for (uint32_t l = 0; l < NL; l++)
			T_CHECK(kvt_prefill(w->c, w->sc[i], l, g_q, g_k, g_v, pre[i], NULL) == 0 &&
				kvt_prefill(w->r, w->sr[i], l, g_q, g_k, g_v, pre[i], NULL) == 0,
				"twin prefill: %s", kvt_last_error(w->c));
	}
}

static void twin_check(struct twin *w, const char *what)
{
	for (int i = 0; i < NSEQ; i++)
		expect_same(w->c, w->sc[i], w->r, w->sr[i], what);
	kvt_cache_destroy(w->c);
	kvt_cache_destroy(w->r);
}

/* ---- each call against its plain twin --------------------------------------------------------- */

static void test_prefill(void **state)
{
	(void)state;
	static const uint32_t chunk[3] = {300, 7, 45};
	for (int kind = 0; kind < NKIND; kind++) {
		t_rng_seed(&g_rng, 100 + (uint64_t)kind);
		struct twin w;
		twin_open(&w, KVT_DTYPE_F32, NULL);
		for (int i = 0; i < 3; i++)
			for (uint32_t l = 0; l < NL; l++) {
				const uint32_t n = chunk[i];
				kvt_io_layout lo = layout_of((enum kind)kind, n);
				const void *q, *k, *v;
				fill(n);
				place((enum kind)kind, n, &lo, &q, &k, &v);
				const int noq = i == 1; /* a chunk without queries: q's view unread */
				int rc = kvt_prefill_at(w.c, w.sc[0], l, noq ? NULL : q, k, v, n, &lo, NULL);
				T_CHECK(rc == 0, "%s prefill_at chunk %d layer %u: %d (%s)", kind_name[kind],
					i, l, rc, kvt_last_error(w.c));
				rc = kvt_prefill(w.r, w.sr[0], l, noq ? NULL : g_q, g_k, g_v, n, NULL);
				T_CHECK(rc == 0, "reference prefill: %s", kvt_last_error(w.r));
			}
		twin_check(&w, kind_name[kind]);
	}
}

static void test_append(void **state)
{
	(void)state;
	static const uint32_t pre[NSEQ] = {100, 30, 5};
	for (int kind = 0; kind < NKIND; kind++) {
		t_rng_seed(&g_rng, 200 + (uint64_t)kind);
		struct twin w;
		twin_open(&w, KVT_DTYPE_F32, pre);
		for (int step = 0; step < 40; step++)
			for (uint32_t l = 0; l < NL; l++) {
				const uint32_t n = step % 4 == 3 ? 1 : NSEQ; /* one row: some views dense */
				kvt_io_layout lo = layout_of((enum kind)kind, n);
				const void *q, *k, *v;
				fill(n);
				place((enum kind)kind, n, &lo, &q, &k, &v);
				int rc = kvt_append_at(w.c, l, n, w.sc, k, v, &lo, NULL);
				T_CHECK(rc == 0, "%s append_at step %d: %d (%s)", kind_name[kind], step, rc,
					kvt_last_error(w.c));
				T_CHECK(kvt_append(w.r, l, n, w.sr, g_k, g_v, NULL) == 0, "reference append");
			}
		twin_check(&w, kind_name[kind]);
	}
}

/* kvt_select_at of the strided q against kvt_select of the dense one: the same count, then the
 * same gathered positions. */
static void select_same(struct twin *w, uint32_t l, uint32_t n, const void *q,
			const kvt_io_layout *lo, const char *what)
{
	static int32_t pc[NSEQ * NKV * MAXT], pr[NSEQ * NKV * MAXT];
	int32_t cc[NSEQ * NKV], cr[NSEQ * NKV];
	int mc = kvt_select_at(w->c, l, n, w->sc, q, lo, NULL);
	int mr = kvt_select(w->r, l, n, w->sr, g_q, NULL);
	T_CHECK(mc == mr && mc > 0, "%s: select_at %d (%s), select %d", what, mc,
		kvt_last_error(w->c), mr);
	int gc = kvt_gather(w->c, l, n, w->sc, MAXT, cc, pc, NULL, NULL, NULL);
	int gr = kvt_gather(w->r, l, n, w->sr, MAXT, cr, pr, NULL, NULL, NULL);
	T_CHECK(gc == gr && gc > 0 && !memcmp(cc, cr, sizeof(int32_t) * n * NKV) &&
			!memcmp(pc, pr, sizeof(int32_t) * n * NKV * MAXT),
		"%s: select_at's selection differs from select's (%d and %d tokens)", what, gc, gr);
}

static void test_attend(void **state)
{
	(void)state;
	static const uint32_t pre[NSEQ] = {200, 64, 9};
	static const uint32_t out_dtype[2] = {KVT_DTYPE_F32, KVT_DTYPE_F16};
	for (int kind = 0; kind < NKIND; kind++)
		for (int o = 0; o < 2; o++) {
			t_rng_seed(&g_rng, 300 + (uint64_t)(2 * kind + o));
			struct twin w;
			twin_open(&w, out_dtype[o], pre);
			const size_t elem = out_elem(out_dtype[o]);
			char what[96];
			for (uint32_t n = 1; n <= NSEQ; n++)
				for (uint32_t l = 0; l < NL; l++) {
					snprintf(what, sizeof what, "%s attend_at out %zu bytes n %u layer %u",
						 kind_name[kind], elem, n, l);
					kvt_io_layout lo = layout_of((enum kind)kind, n);
					const void *q, *k, *v;
					fill(n);
					place((enum kind)kind, n, &lo, &q, &k, &v);
					out_prepare();
					int rc = kvt_attend_at(w.c, l, n, w.sc, q, g_out, &lo, NULL);
					T_CHECK(rc == 0, "%s: %d (%s)", what, rc, kvt_last_error(w.c));
					rc = kvt_attend(w.r, l, n, w.sr, g_q, g_dense_out, NULL);
					T_CHECK(rc == 0, "reference attend: %s", kvt_last_error(w.r));
					out_expect(what, &lo, n, elem);
					select_same(&w, l, n, q, &lo, what);
				}
			twin_check(&w, kind_name[kind]);
		}
}

static void test_extend(void **state)
{
	(void)state;
	static const uint32_t pre[NSEQ] = {40, 150, 0};
	static const uint32_t out_dtype[2] = {KVT_DTYPE_F32, KVT_DTYPE_F16};
	static const uint32_t cu[2][NSEQ + 1] = {{0, 5, 5, 17}, {0, 1, 31, 32}};
	for (int kind = 0; kind < NKIND; kind++)
		for (int o = 0; o < 2; o++) {
			t_rng_seed(&g_rng, 400 + (uint64_t)(2 * kind + o));
			struct twin w;
			twin_open(&w, out_dtype[o], pre);
			const size_t elem = out_elem(out_dtype[o]);
			char what[96];
			for (int round = 0; round < 2; round++)
				for (uint32_t l = 0; l < NL; l++) {
					const uint32_t n = cu[round][NSEQ];
					snprintf(what, sizeof what, "%s extend_at out %zu bytes round %d layer %u",
						 kind_name[kind], elem, round, l);
					kvt_io_layout lo = layout_of((enum kind)kind, n);
					const void *q, *k, *v;
					fill(n);
					place((enum kind)kind, n, &lo, &q, &k, &v);
					out_prepare();
					int rc = kvt_extend_at(w.c, l, NSEQ, w.sc, cu[round], q, k, v, g_out, 0,
							       &lo, NULL);
					T_CHECK(rc == 0, "%s: %d (%s)", what, rc, kvt_last_error(w.c));
					rc = kvt_extend(w.r, l, NSEQ, w.sr, cu[round], g_q, g_k, g_v,
							g_dense_out, 0, NULL);
					T_CHECK(rc == 0, "reference extend: %s", kvt_last_error(w.r));
					out_expect(what, &lo, n, elem);
				}
			twin_check(&w, kind_name[kind]);
		}
}

/* ---- the dense layout costs nothing ----------------------------------------------------------- */

static void test_dense(void **state)
{
	(void)state;
	static const uint32_t pre[NSEQ] = {50, 20, 3};
	t_rng_seed(&g_rng, 500);
	struct twin w;
	twin_open(&w, KVT_DTYPE_F32, pre);
	const kvt_io_layout zero = {sizeof zero, 0, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
	const kvt_io_layout spelt = {sizeof spelt, 0, {NQ * D, D}, {NKV * D, D}, {NKV * D, D},
				     {NQ * D, D}};
	/* one row with a padded token stride is dense; a prefill's out view is not read */
	const kvt_io_layout one = {sizeof one, 0, {QKV, D}, {QKV, D}, {QKV, D}, {5 * QKV, D}};
	const kvt_io_layout pre_lo = {sizeof pre_lo, 0, {0, 0}, {0, 0}, {0, 0}, {1, 1}};
	const kvt_io_layout *los[4] = {NULL, &zero, &spelt, &one};
	for (int i = 0; i < 4; i++) {
		const uint32_t n = i == 3 ? 1 : NSEQ;
		fill(n);
		T_CHECK(kvt_append_at(w.c, 0, n, w.sc, g_k, g_v, los[i], NULL) == 0 &&
			kvt_append(w.r, 0, n, w.sr, g_k, g_v, NULL) == 0, "dense append_at %d: %s", i,
			kvt_last_error(w.c));
		out_prepare();
		T_CHECK(kvt_attend_at(w.c, 0, n, w.sc, g_q, g_out, los[i], NULL) == 0 &&
			kvt_attend(w.r, 0, n, w.sr, g_q, g_dense_out, NULL) == 0,
			"dense attend_at %d: %s", i, kvt_last_error(w.c));
		T_CHECK(!memcmp(g_out, g_dense_out, (size_t)n * NQ * D * 4), "dense attend_at %d: out "
			"differs", i);
	}
	fill(10);
	T_CHECK(kvt_prefill_at(w.c, w.sc[2], 1, g_q, g_k, g_v, 10, &pre_lo, NULL) == 0 &&
		kvt_prefill(w.r, w.sr[2], 1, g_q, g_k, g_v, 10, NULL) == 0,
		"prefill_at with an out view: %s", kvt_last_error(w.c));
	T_CHECK(w.c->io_scratch == NULL && w.c->io_scratch_bytes == 0,
		"dense layouts allocated a scratch of %zu bytes", w.c->io_scratch_bytes);
	twin_check(&w, "dense layouts");
}

/* ---- bad layouts ------------------------------------------------------------------------------ */

/* seqs a, b hold 40 tokens each; the calls take 8 rows (prefill, extend) or 2 (append, attend). */
struct fx {
	kvt_cache *c;
	uint32_t s[2];
};
static kvt_io_layout g_lo;
static const uint32_t g_cu[3] = {0, 5, 8};

#define PF kvt_prefill_at(f->c, f->s[0], 0, g_in, g_in, g_in, 8, &g_lo, NULL)
#define AP kvt_append_at(f->c, 0, 2, f->s, g_in, g_in, &g_lo, NULL)
#define AT kvt_attend_at(f->c, 0, 2, f->s, g_in, g_out, &g_lo, NULL)
#define EX kvt_extend_at(f->c, 0, 2, f->s, g_cu, g_in, g_in, g_in, g_out, 0, &g_lo, NULL)
#define BAD(fn, setup, expr)                                                                       \
	static int fn(struct fx *f)                                                                \
	{                                                                                          \
		g_lo = (kvt_io_layout){sizeof g_lo, 0, {0, 0}, {0, 0}, {0, 0}, {0, 0}};            \
		setup;                                                                             \
		return (expr);                                                                     \
	}
BAD(b_size0, g_lo.size = 0, PF)
BAD(b_size71, g_lo.size = offsetof(kvt_io_layout, out) + 15, AT)
BAD(b_flags, g_lo.flags = 2, AP)
BAD(b_q_hs, g_lo.q.head_stride = D - 1, PF)
BAD(b_k_hs, g_lo.k.head_stride = 1, AP)
BAD(b_v_hs_big, g_lo.v.head_stride = UINT64_MAX / 2, EX)
BAD(b_out_hs, g_lo.out.head_stride = 32, EX)
BAD(b_v_ts, g_lo.v.token_stride = NKV * D - 1, PF)
BAD(b_out_ts, g_lo.out.token_stride = 100, AT)
BAD(b_k_ts_heads, g_lo.k.token_stride = D, AP)
BAD(b_q_headmajor, (g_lo.q.token_stride = D, g_lo.q.head_stride = 8 * D - 1), PF)
BAD(b_q_ts_small, (g_lo.q.token_stride = D - 1, g_lo.q.head_stride = 8 * D), EX)
BAD(b_k_ts_big, g_lo.k.token_stride = UINT64_MAX / 4, EX)
/* the default token stride (heads x head_stride) past the range: the text says it is the default */
BAD(b_q_ts_default, g_lo.q.head_stride = (uint64_t)PTRDIFF_MAX / 2 / NQ, PF)
/* one row: any token stride >= head_dim would do, and the text says so */
BAD(b_q_ts_one, g_lo.q.token_stride = 8, kvt_attend_at(f->c, 0, 1, f->s, g_in, g_out, &g_lo, NULL))
BAD(b_out_null, (g_lo.out.head_stride = 1), kvt_attend_at(f->c, 0, 2, f->s, g_in, NULL, &g_lo,
							  NULL))

static void test_bad_layouts(void **state)
{
	(void)state;
	const struct {
		const char *name;
		const char *needle[3];
		int (*call)(struct fx *f);
	} cases[] = {
		{"prefill, size 0", {"kvt_prefill_at", "layout->size = 0", ">= 72"}, b_size0},
		{"attend, size 71", {"layout->size = 71", ">= 72"}, b_size71},
		{"append, flags 2", {"kvt_append_at", "layout->flags = 0x2"}, b_flags},
		{"prefill, q head_stride 63", {"layout->q.head_stride = 63", "head_dim = 64"}, b_q_hs},
		{"append, k head_stride 1", {"layout->k.head_stride = 1", "head_dim = 64"}, b_k_hs},
		{"extend, v head_stride past the range", {"kvt_extend_at", "layout->v.head_stride = 9223372036854775807"}, b_v_hs_big},
		{"extend, out head_stride 32", {"layout->out.head_stride = 32", "head_dim = 64"}, b_out_hs},
		{"prefill, v token_stride 127", {"layout->v.token_stride = 127", ">= (heads - 1) * head_stride + head_dim = 128"}, b_v_ts},
		{"attend, out token_stride 100", {"layout->out.token_stride = 100", "= 256"}, b_out_ts},
		{"append, k heads overlap", {"layout->k.token_stride = 64", "= 128"}, b_k_ts_heads},
		{"prefill, head-major q one short", {"layout->q.token_stride = 64", "head_stride = 511", "= 63]"}, b_q_headmajor},
		{"extend, head-major q token_stride below head_dim", {"layout->q.token_stride = 63", "head-major"}, b_q_ts_small},
		{"extend, k rows past ptrdiff_t", {"layout->k.token_stride = 4611686018427387903", "ptrdiff_t"}, b_k_ts_big},
		{"prefill, q's default token_stride past ptrdiff_t", {"layout->q.token_stride = ", "(0: the default)", "must be at most"}, b_q_ts_default},
		{"attend one row, q token_stride 8", {"layout->q.token_stride = 8", ">= head_dim = 64 (one row)"}, b_q_ts_one},
		{"attend, out NULL before its view", {"out is NULL"}, b_out_null},
	};
	t_rng_seed(&g_rng, 600);
	struct fx f;
	f.c = make_cache(KVT_DTYPE_F32);
	fill(40);
	for (int i = 0; i < 2; i++) {
		T_CHECK(kvt_seq_open(f.c, &f.s[i]) == 0, "open");
		for (uint32_t l = 0; l < NL; l++)
			T_CHECK(kvt_prefill(f.c, f.s[i], l, g_q, g_k, g_v, 40, NULL) == 0, "prefill");
	}
	for (size_t x = 0; x < sizeof g_in / 2; x++)
		g_in[x] = (uint16_t)(0x3c00 + x % 512); /* finite: only the layout is wrong */
	int nfail = 0;
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
		float o0[NQ * D], o1[NQ * D];
		T_CHECK(kvt_attend(f.c, 1, 1, f.s, g_q, o0, NULL) == 0, "attend");
		kvt_stats before = t_stats(f.c);
		int64_t live = kvt_mem_live();
		out_prepare();
		int rc = cases[i].call(&f);
		const char *msg = kvt_last_error(f.c);
		T_SOFT(&nfail, rc == -EINVAL, "[%s]: got %d (%s), wanted -EINVAL; detail \"%s\"",
		       cases[i].name, rc, kvt_strerror(rc), msg);
		for (int k = 0; k < 3 && cases[i].needle[k]; k++)
			T_SOFT(&nfail, t_contains(msg, cases[i].needle[k]),
			       "[%s]: detail \"%s\" does not name \"%s\"", cases[i].name, msg,
			       cases[i].needle[k]);
		kvt_stats after = t_stats(f.c);
		T_SOFT(&nfail, after.tokens == before.tokens && after.steps == before.steps &&
		       kvt_mem_live() == live && after.host_bytes_used == before.host_bytes_used &&
		       kvt_seq_length(f.c, f.s[0], 0) == 40 && kvt_seq_length(f.c, f.s[1], 0) == 40,
		       "[%s]: the cache changed (tokens %llu -> %llu, steps %llu -> %llu, live %lld -> "
		       "%lld)", cases[i].name, (unsigned long long)before.tokens,
		       (unsigned long long)after.tokens, (unsigned long long)before.steps,
		       (unsigned long long)after.steps, (long long)live, (long long)kvt_mem_live());
		T_SOFT(&nfail, !memcmp(g_out, g_want, sizeof g_out), "[%s]: out was written",
		       cases[i].name);
		T_CHECK(kvt_attend(f.c, 1, 1, f.s, g_q, o1, NULL) == 0, "attend");
		T_SOFT(&nfail, !memcmp(o0, o1, sizeof o0), "[%s]: attention changed", cases[i].name);
	}
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
	kvt_cache_destroy(f.c);
}

/* ---- allocation faults ------------------------------------------------------------------------ */

/* A fused-qkv prefill of 120 tokens on layer 1 after 60, or a strided attend of both sequences. */
static int op_prefill(kvt_cache *c, const uint32_t *s, const kvt_io_layout *lo)
{
	return kvt_prefill_at(c, s[0], 1, g_in, g_in + NQ * D, g_in + (NQ + NKV) * D, 120, lo, NULL);
}

static int op_attend(kvt_cache *c, const uint32_t *s, const kvt_io_layout *lo)
{
	return kvt_attend_at(c, 1, 2, s, g_in, g_out, lo, NULL);
}

static void fault_loop(const char *name, int (*op)(kvt_cache *, const uint32_t *,
						   const kvt_io_layout *), uint32_t want_len)
{
	t_rng_seed(&g_rng, 700);
	fill(120);
	const kvt_io_layout lo = layout_of(FUSED, 120);
	const void *q, *k, *v;
	place(FUSED, 120, &lo, &q, &k, &v);
	const int64_t live0 = kvt_mem_live();
	uint64_t n = 1;
	for (;; n++) {
		kvt_cache *c = make_cache(KVT_DTYPE_F32);
		uint32_t s[2];
		for (int i = 0; i < 2; i++) {
			T_CHECK(kvt_seq_open(c, &s[i]) == 0, "open");
			for (uint32_t l = 0; l < NL; l++)
				T_CHECK(kvt_prefill(c, s[i], l, g_q, g_k, g_v, 60, NULL) == 0, "prefill");
		}
		kvt_stats st0 = t_stats(c);
		out_prepare();
		kvt_mem_fail_at(n);
		int rc = op(c, s, &lo);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc < 0) {
			kvt_stats st1 = t_stats(c);
			T_CHECK(fired && rc == -ENOMEM && strlen(kvt_last_error(c)) > 0,
				"%s N=%llu: got %d (%s), fired %d", name, (unsigned long long)n, rc,
				kvt_last_error(c), fired);
			T_CHECK(st1.tokens == st0.tokens && st1.host_bytes_used == st0.host_bytes_used &&
				c->seqs[s[0]].layers[1].n_tokens == 60 && !memcmp(g_out, g_want,
										   sizeof g_out),
				"%s N=%llu: a failed call changed the cache or out (tokens %llu -> %llu)",
				name, (unsigned long long)n, (unsigned long long)st0.tokens,
				(unsigned long long)st1.tokens);
		} else {
			T_CHECK(c->seqs[s[0]].layers[1].n_tokens == want_len, "%s N=%llu: %u tokens",
				name, (unsigned long long)n, c->seqs[s[0]].layers[1].n_tokens);
		}
		kvt_cache_destroy(c);
		T_CHECK(kvt_mem_live() == live0, "%s N=%llu: live allocations %lld after destroy, "
			"wanted %lld", name, (unsigned long long)n, (long long)kvt_mem_live(),
			(long long)live0);
		if (!fired)
			break;
	}
	T_CHECK(n > 1, "%s: no allocation to fail", name);
	print_message("%s: %llu allocation faults, each left the cache as it was\n", name,
		      (unsigned long long)(n - 1));
}

static void test_faults(void **state)
{
	(void)state;
	fault_loop("prefill_at fused qkv", op_prefill, 180);
	fault_loop("attend_at fused qkv", op_attend, 60);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_prefill),     cmocka_unit_test(test_append),
		cmocka_unit_test(test_attend),      cmocka_unit_test(test_extend),
		cmocka_unit_test(test_dense),       cmocka_unit_test(test_bad_layouts),
		cmocka_unit_test(test_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
