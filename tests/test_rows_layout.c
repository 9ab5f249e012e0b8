/* SPDX-License-Identifier: MIT */
/*
 * kvt_seq_read_rows_at and kvt_seq_write_rows_at on the CPU backend (suite unit): rows through a
 * runtime's paged K/V buffer ([n_slots, n_kv_heads, head_dim] with a slot mapping) or a strided view.
 *   - read: a shuffled slot mapping with skipped tokens puts in each slot what kvt_seq_read_rows
 *     gives densely for its token, and leaves every other byte of the buffer as it was; a strided
 *     view likewise (the gaps between heads and slots untouched);
 *   - write: rows written from a paged buffer (shuffled, a slot used twice) or a strided view give
 *     the sequence that kvt_seq_write_rows of the same rows dense gives: lengths, index counts,
 *     centroids and attention outputs bit for bit;
 *   - bad arguments: each value its code, a text naming it, and no change;
 *   - allocation faults: the write and read paths failing at the N-th allocation for N = 1, 2, ...
 *     change nothing and leak nothing.
 */
#include "common.h"

#define D 64
#define NKV 2
#define NQ 4
#define NL 2
#define ROW (NKV * D)
#define QROW (NQ * D)
#define NT 600      /* tokens of the stream */
#define NSLOT 1024  /* slots of the paged buffer */
#define HS (D + 24) /* strided view: elements between heads */
#define SS (NKV * HS + 40)

static uint16_t g_k[NL][NT * ROW], g_v[NL][NT * ROW];             /* the stream, dense */
static uint16_t g_pk[NSLOT * ROW], g_pv[NSLOT * ROW];             /* a paged buffer */
static uint16_t g_rk[NSLOT * ROW], g_rv[NSLOT * ROW];             /* another, read into */
static uint16_t g_sk[NT * SS], g_sv[NT * SS];                     /* a strided view */
static uint16_t g_dk[NT * ROW], g_dv[NT * ROW], g_q[QROW];
static int64_t g_map[NT];

static void make_stream(uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	for (int l = 0; l < NL; l++) {
		t_fill(&r, KVT_DTYPE_F16, (size_t)NT * ROW, 0.2, 1.0, g_k[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, (size_t)NT * ROW, 0.0, 1.0, g_v[l], NULL);
	}
}

/* g_map[0 .. n): distinct slots of [0, NSLOT) in random order; every `skip`-th token -1 (0: none). */
static void make_map(uint64_t seed, uint32_t n, uint32_t skip)
{
	static int64_t perm[NSLOT];
	t_rng r;
	t_rng_seed(&r, seed);
	for (int64_t i = 0; i < NSLOT; i++)
		perm[i] = i;
	for (uint32_t i = NSLOT - 1; i > 0; i--) {
		uint32_t j = t_below(&r, i + 1);
		int64_t t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	for (uint32_t i = 0; i < n; i++)
		g_map[i] = skip && i % skip == skip - 1 ? -1 : perm[i];
}

static kvt_cache *make_cache(void)
{
	kvt_config cfg = t_config(NL, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 0.9f;
	cfg.budget_min = KVT_NONE;
	return t_create(&cfg);
}

static uint32_t len(kvt_cache *c, uint32_t s)
{
	return (uint32_t)kvt_seq_length(c, s, 0);
}

static void prefill(kvt_cache *c, uint32_t s)
{
	for (uint32_t l = 0; l < NL; l++)
		T_CHECK(kvt_prefill(c, s, l, NULL, g_k[l], g_v[l], NT, NULL) == 0, "prefill: %s",
			kvt_last_error(c));
}

/* Place token i's rows (of src, dense from token `first`) at `slot` in buf with the given strides. */
static void put(uint16_t *buf, const uint16_t *src, uint32_t i, int64_t slot, uint64_t ss,
		uint64_t hs)
{
	for (uint32_t h = 0; h < NKV; h++)
		memcpy(buf + slot * (int64_t)ss + h * hs, src + ((size_t)i * NKV + h) * D, D * 2);
}

/* ---- read ------------------------------------------------------------------------------------- */

static void test_read_paged(void **state)
{
	(void)state;
	make_stream(1);
	kvt_cache *c = make_cache();
	uint32_t s;
	T_CHECK(kvt_seq_open(c, &s) == 0, "open");
	prefill(c, s);
	const uint32_t from = 37, to = 537, n = to - from;
	for (uint32_t l = 0; l < NL; l++) {
		make_map(10 + l, n, 7);
		int rc = kvt_seq_read_rows(c, s, l, from, to, g_dk, g_dv, NULL);
		T_CHECK(rc == (int)n, "read_rows: %d (%s)", rc, kvt_last_error(c));
		static uint16_t want_k[NSLOT * ROW], want_v[NSLOT * ROW];
		memset(g_pk, 0xa5, sizeof g_pk);
		memset(g_pv, 0x5a, sizeof g_pv);
		memcpy(want_k, g_pk, sizeof g_pk);
		memcpy(want_v, g_pv, sizeof g_pv);
		for (uint32_t i = 0; i < n; i++)
			if (g_map[i] >= 0) {
				put(want_k, g_dk, i, g_map[i], ROW, D);
				put(want_v, g_dv, i, g_map[i], ROW, D);
			}
		kvt_rows_layout lo = {sizeof lo, 0, g_map, 0, 0};
		rc = kvt_seq_read_rows_at(c, s, l, from, to, g_pk, g_pv, &lo, NULL);
		T_CHECK(rc == (int)n, "read_rows_at paged layer %u: got %d (%s), wanted %u", l, rc,
			kvt_last_error(c), n);
		for (uint32_t x = 0; x < NSLOT * ROW; x++)
			T_CHECK(g_pk[x] == want_k[x] && g_pv[x] == want_v[x],
				"read_rows_at paged layer %u: element %u (slot %u) got %04x/%04x, wanted "
				"%04x/%04x", l, x, x / ROW, g_pk[x], g_pv[x], want_k[x], want_v[x]);
	}
	kvt_cache_destroy(c);
}

static void test_read_strided(void **state)
{
	(void)state;
	make_stream(2);
	kvt_cache *c = make_cache();
	uint32_t s;
	T_CHECK(kvt_seq_open(c, &s) == 0, "open");
	prefill(c, s);
	static uint16_t want_k[NT * SS], want_v[NT * SS];
	for (uint32_t l = 0; l < NL; l++) {
		memset(g_sk, 0xa5, sizeof g_sk);
		memset(g_sv, 0x5a, sizeof g_sv);
		memcpy(want_k, g_sk, sizeof g_sk);
		memcpy(want_v, g_sv, sizeof g_sv);
		for (uint32_t i = 0; i < NT - 3; i++) {
			put(want_k, g_k[l] + (size_t)3 * ROW, i, i, SS, HS);
			put(want_v, g_v[l] + (size_t)3 * ROW, i, i, SS, HS);
		}
		kvt_rows_layout lo = {sizeof lo, 0, NULL, SS, HS};
		int rc = kvt_seq_read_rows_at(c, s, l, 3, NT, g_sk, g_sv, &lo, NULL);
		T_CHECK(rc == NT - 3, "read_rows_at strided: %d (%s)", rc, kvt_last_error(c));
		T_CHECK(!memcmp(g_sk, want_k, sizeof g_sk) && !memcmp(g_sv, want_v, sizeof g_sv),
			"read_rows_at strided layer %u: the view differs (rows or gaps)", l);
		/* the dense layout spelt out equals kvt_seq_read_rows */
		kvt_rows_layout dense = {sizeof dense, 0, NULL, ROW, D};
		memset(g_pk, 0, sizeof g_pk);
		rc = kvt_seq_read_rows_at(c, s, l, 0, NT, g_pk, g_pv, &dense, NULL);
		T_CHECK(rc == NT && !memcmp(g_pk, g_k[l], sizeof g_k[l]) &&
			!memcmp(g_pv, g_v[l], sizeof g_v[l]), "read_rows_at dense layout: %d", rc);
	}
	kvt_cache_destroy(c);
}

/* ---- write ------------------------------------------------------------------------------------ */

static void attend(kvt_cache *c, uint32_t s, uint32_t l, float *out)
{
	int rc = kvt_attend(c, l, 1, &s, g_q, out, NULL);
	T_CHECK(rc == 0, "attend seq %u layer %u: %d (%s)", s, l, rc, kvt_last_error(c));
}

/* a of ca and b of cb: the same lengths, index counts, centroids, rows and outputs, bit for bit. */
static void expect_same(kvt_cache *ca, uint32_t a, kvt_cache *cb, uint32_t b, const char *what)
{
	t_rng r;
	t_rng_seed(&r, 77);
	for (uint32_t l = 0; l < NL; l++) {
		const struct kvt_layer *la = &ca->seqs[a].layers[l], *lb = &cb->seqs[b].layers[l];
		T_CHECK(la->n_tokens == lb->n_tokens && la->n_indexed == lb->n_indexed,
			"%s layer %u: tokens %u indexed %u, wanted %u indexed %u", what, l,
			la->n_tokens, la->n_indexed, lb->n_tokens, lb->n_indexed);
		T_CHECK(la->centroids == lb->centroids &&
			!memcmp(la->c_k, lb->c_k, sizeof(float) * NKV * D),
			"%s layer %u: centroids differ", what, l);
		static uint16_t ka[NT * ROW], kb[NT * ROW];
		T_CHECK(kvt_seq_read_rows(ca, a, l, 0, la->n_tokens, ka, g_dv, NULL) > 0 &&
			kvt_seq_read_rows(cb, b, l, 0, lb->n_tokens, kb, g_dv, NULL) > 0 &&
			!memcmp(ka, kb, (size_t)la->n_tokens * ROW * 2), "%s layer %u: rows differ",
			what, l);
		for (int rep = 0; rep < 3; rep++) {
			float oa[QROW], ob[QROW];
			t_fill(&r, KVT_DTYPE_F16, QROW, 0.3, 1.0, g_q, NULL);
			attend(ca, a, l, oa);
			attend(cb, b, l, ob);
			for (int x = 0; x < QROW; x++)
				T_CHECK(!memcmp(&oa[x], &ob[x], sizeof(float)),
					"%s layer %u query %d: output %d got %.9g, wanted %.9g", what, l,
					rep, x, oa[x], ob[x]);
		}
	}
}

/* Write [0, 350) and [350, NT) of each layer into a paged buffer and from there into seq w of c;
 * the reference rs of r gets the same rows dense. dup: token 5 repeats token 4's slot. */
static void write_paged(kvt_cache *c, uint32_t w, kvt_cache *r, uint32_t rs, int dup)
{
	static const uint32_t cut[3] = {0, 350, NT};
	for (uint32_t l = 0; l < NL; l++)
		for (int part = 0; part < 2; part++) {
			uint32_t from = cut[part], to = cut[part + 1], n = to - from;
			const uint16_t *k = g_k[l] + (size_t)from * ROW, *v = g_v[l] + (size_t)from * ROW;
			make_map(20 + 2 * l + (uint32_t)part, n, 0);
			if (dup) {
				g_map[5] = g_map[4];
				memcpy(g_k[l] + (size_t)(from + 5) * ROW, k + 4 * ROW, ROW * 2);
				memcpy(g_v[l] + (size_t)(from + 5) * ROW, v + 4 * ROW, ROW * 2);
			}
			memset(g_pk, 0xa5, sizeof g_pk);
			memset(g_pv, 0x5a, sizeof g_pv);
			for (uint32_t i = 0; i < n; i++) {
				put(g_pk, k, i, g_map[i], ROW, D);
				put(g_pv, v, i, g_map[i], ROW, D);
			}
			kvt_rows_layout lo = {sizeof lo, 0, g_map, 0, 0};
			int rc = kvt_seq_write_rows_at(c, w, l, from, to, g_pk, g_pv, &lo, NULL);
			T_CHECK(rc == (int)n, "write_rows_at [%u, %u) layer %u: %d (%s)", from, to, l, rc,
				kvt_last_error(c));
			rc = kvt_seq_write_rows(r, rs, l, from, to, k, v, NULL);
			T_CHECK(rc == (int)n, "reference write_rows: %d (%s)", rc, kvt_last_error(r));
		}
}

static void test_write_paged(void **state)
{
	(void)state;
	for (int dup = 0; dup < 2; dup++) {
		make_stream(3 + (uint64_t)dup);
		kvt_cache *c = make_cache(), *r = make_cache();
		uint32_t w, rs;
		T_CHECK(kvt_seq_open(c, &w) == 0 && kvt_seq_open(r, &rs) == 0, "open");
		write_paged(c, w, r, rs, dup);
		expect_same(c, w, r, rs, dup ? "write_rows_at paged, a slot twice" : "write_rows_at paged");
		kvt_cache_destroy(c);
		kvt_cache_destroy(r);
	}
}

static void test_write_strided(void **state)
{
	(void)state;
	make_stream(5);
	kvt_cache *c = make_cache(), *r = make_cache();
	uint32_t w, rs;
	T_CHECK(kvt_seq_open(c, &w) == 0 && kvt_seq_open(r, &rs) == 0, "open");
	for (uint32_t l = 0; l < NL; l++) {
		memset(g_sk, 0xff, sizeof g_sk); /* NaN in the gaps: a gathered gap would be refused */
		memset(g_sv, 0xff, sizeof g_sv);
		for (uint32_t i = 0; i < NT; i++) {
			put(g_sk, g_k[l], i, i, SS, HS);
			put(g_sv, g_v[l], i, i, SS, HS);
		}
		kvt_rows_layout lo = {sizeof lo, 0, NULL, SS, HS};
		int rc = kvt_seq_write_rows_at(c, w, l, 0, NT, g_sk, g_sv, &lo, NULL);
		T_CHECK(rc == NT, "write_rows_at strided layer %u: %d (%s)", l, rc, kvt_last_error(c));
		T_CHECK(kvt_seq_write_rows(r, rs, l, 0, NT, g_k[l], g_v[l], NULL) == NT, "reference");
	}
	expect_same(c, w, r, rs, "write_rows_at strided");
	kvt_cache_destroy(c);
	kvt_cache_destroy(r);
}

/* ---- bad arguments ---------------------------------------------------------------------------- */

/* seq a holds 40 tokens; layouts over 2 tokens unless named. */
struct fx {
	kvt_cache *c;
	uint32_t a;
};
static int64_t g_bad_map[2];
static kvt_rows_layout g_lo;

#define RD(lo) kvt_seq_read_rows_at(f->c, f->a, 0, 10, 12, g_pk, g_pv, (lo), NULL)
#define WR(lo) kvt_seq_write_rows_at(f->c, f->a, 0, 40, 42, g_pk, g_pv, (lo), NULL)
#define BAD(fn, setup, expr)                                                                       \
	static int fn(struct fx *f)                                                                \
	{                                                                                          \
		g_lo = (kvt_rows_layout){sizeof g_lo, 0, g_bad_map, 0, 0};                         \
		g_bad_map[0] = 3;                                                                  \
		g_bad_map[1] = 4;                                                                  \
		setup;                                                                             \
		return (expr);                                                                     \
	}
BAD(b_rd_null, , kvt_seq_read_rows_at(NULL, f->a, 0, 10, 12, g_pk, g_pv, &g_lo, NULL))
BAD(b_rd_k, , kvt_seq_read_rows_at(f->c, f->a, 0, 10, 12, NULL, g_pv, &g_lo, NULL))
BAD(b_rd_past, , kvt_seq_read_rows_at(f->c, f->a, 0, 39, 41, g_pk, g_pv, &g_lo, NULL))
BAD(b_rd_size, g_lo.size = 16, RD(&g_lo))
BAD(b_rd_flags, g_lo.flags = 4, RD(&g_lo))
BAD(b_rd_hs, g_lo.head_stride = D - 1, RD(&g_lo))
BAD(b_rd_hs_big, g_lo.head_stride = UINT64_MAX / 2, RD(&g_lo))
BAD(b_rd_ss, g_lo.slot_stride = ROW - 1, RD(&g_lo))
BAD(b_rd_ss_hs, (g_lo.head_stride = 100, g_lo.slot_stride = 163), RD(&g_lo))
BAD(b_rd_ss_big, g_lo.slot_stride = UINT64_MAX, RD(&g_lo))
BAD(b_rd_slot_neg, g_bad_map[1] = -2, RD(&g_lo))
BAD(b_rd_slot_big, g_bad_map[1] = INT64_MAX, RD(&g_lo))
BAD(b_rd_dup, g_bad_map[1] = 3, RD(&g_lo))
BAD(b_rd_range, (g_lo.slot_mapping = NULL, g_lo.slot_stride = (uint64_t)PTRDIFF_MAX / 2 - 8),
    RD(&g_lo))
BAD(b_wr_null, , kvt_seq_write_rows_at(NULL, f->a, 0, 40, 42, g_pk, g_pv, &g_lo, NULL))
BAD(b_wr_v, , kvt_seq_write_rows_at(f->c, f->a, 0, 40, 42, g_pk, NULL, &g_lo, NULL))
BAD(b_wr_from, , kvt_seq_write_rows_at(f->c, f->a, 0, 39, 41, g_pk, g_pv, &g_lo, NULL))
BAD(b_wr_size, g_lo.size = 0, WR(&g_lo))
BAD(b_wr_flags, g_lo.flags = 1, WR(&g_lo))
BAD(b_wr_hs, g_lo.head_stride = 1, WR(&g_lo))
BAD(b_wr_ss, g_lo.slot_stride = D, WR(&g_lo))
BAD(b_wr_skip, g_bad_map[0] = -1, WR(&g_lo))
BAD(b_wr_slot_big, g_bad_map[0] = INT64_MAX / 4, WR(&g_lo))
BAD(b_wr_nan, memset(g_pk + 4 * ROW, 0xff, 2), WR(&g_lo))

static void test_bad_arguments(void **state)
{
	(void)state;
	make_stream(6);
	const struct {
		const char *name;
		int want;
		const char *needle[2];
		int (*call)(struct fx *f);
	} cases[] = {
		{"read, cache NULL", -EINVAL, {"cache"}, b_rd_null},
		{"read, k NULL", -EINVAL, {"k is NULL"}, b_rd_k},
		{"read, past the end", -EINVAL, {"to = 41", "40"}, b_rd_past},
		{"read, size 16", -EINVAL, {"layout->size = 16", "32"}, b_rd_size},
		{"read, flags 4", -EINVAL, {"layout->flags = 0x4"}, b_rd_flags},
		{"read, head_stride below head_dim", -EINVAL, {"head_stride = 63", "head_dim = 64"}, b_rd_hs},
		{"read, head_stride past ptrdiff_t", -EINVAL, {"kvt_seq_read_rows_at", "head_stride = "}, b_rd_hs_big},
		{"read, slot_stride below a row", -EINVAL, {"slot_stride = 127", "[128,"}, b_rd_ss},
		{"read, slots overlap", -EINVAL, {"slot_stride = 163", "[164,"}, b_rd_ss_hs},
		{"read, slot_stride past ptrdiff_t", -EINVAL, {"slot_stride = 18446744073709551615"}, b_rd_ss_big},
		{"read, slot -2", -EINVAL, {"slot_mapping[1] = -2", "[-1,"}, b_rd_slot_neg},
		{"read, slot past the range", -EINVAL, {"slot_mapping[1] = 9223372036854775807"}, b_rd_slot_big},
		{"read, one slot twice", -EINVAL, {"slot_mapping[0] = slot_mapping[1] = 3"}, b_rd_dup},
		{"read, strided range past ptrdiff_t", -EINVAL, {"2 tokens", "ptrdiff_t"}, b_rd_range},
		{"write, cache NULL", -EINVAL, {"cache"}, b_wr_null},
		{"write, v NULL", -EINVAL, {"v is NULL"}, b_wr_v},
		{"write, from not the end", -EINVAL, {"from = 39", "must be 40"}, b_wr_from},
		{"write, size 0", -EINVAL, {"kvt_seq_write_rows_at", "layout->size = 0"}, b_wr_size},
		{"write, flags 1", -EINVAL, {"layout->flags = 0x1"}, b_wr_flags},
		{"write, head_stride 1", -EINVAL, {"head_stride = 1"}, b_wr_hs},
		{"write, slot_stride 64", -EINVAL, {"slot_stride = 64"}, b_wr_ss},
		{"write, skipped token", -EINVAL, {"slot_mapping[0] = -1", "cannot be skipped"}, b_wr_skip},
		{"write, slot past the range", -EINVAL, {"slot_mapping[0] = 2305843009213693951"}, b_wr_slot_big},
		{"write, non-finite key in a slot", -EINVAL, {"finite"}, b_wr_nan},
	};
	struct fx f;
	f.c = make_cache();
	T_CHECK(kvt_seq_open(f.c, &f.a) == 0, "open");
	for (uint32_t l = 0; l < NL; l++)
		T_CHECK(kvt_prefill(f.c, f.a, l, NULL, g_k[l], g_v[l], 40, NULL) == 0, "prefill");
	int nfail = 0;
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
		kvt_stats before = t_stats(f.c);
		int64_t live = kvt_mem_live();
		float o0[QROW], o1[QROW];
		attend(f.c, f.a, 0, o0);
		for (size_t x = 0; x < NSLOT * ROW; x++)
			g_pk[x] = g_pv[x] = (uint16_t)(0x3c00 + x % 512); /* finite rows */
		memcpy(g_dk, g_pk, sizeof g_dk);
		int rc = cases[i].call(&f);
		const int no_cache = cases[i].call == b_rd_null || cases[i].call == b_wr_null;
		const char *msg = kvt_last_error(no_cache ? NULL : f.c);
		T_SOFT(&nfail, rc == cases[i].want, "[%s]: got %d (%s), wanted %d; detail \"%s\"",
		       cases[i].name, rc, kvt_strerror(rc), cases[i].want, msg);
		for (int k = 0; k < 2 && cases[i].needle[k]; k++)
			T_SOFT(&nfail, t_contains(msg, cases[i].needle[k]),
			       "[%s]: detail \"%s\" does not name \"%s\"", cases[i].name, msg,
			       cases[i].needle[k]);
		kvt_stats after = t_stats(f.c);
		T_SOFT(&nfail, after.tokens == before.tokens && kvt_mem_live() == live &&
		       after.host_bytes_used == before.host_bytes_used && len(f.c, f.a) == 40,
		       "[%s]: the cache changed (tokens %llu -> %llu, live %lld -> %lld)", cases[i].name,
		       (unsigned long long)before.tokens, (unsigned long long)after.tokens,
		       (long long)live, (long long)kvt_mem_live());
		T_SOFT(&nfail, cases[i].call == b_wr_nan || !memcmp(g_dk, g_pk, sizeof g_dk),
		       "[%s]: the buffer was written", cases[i].name);
		attend(f.c, f.a, 0, o1);
		T_SOFT(&nfail, !memcmp(o0, o1, sizeof o0), "[%s]: attention changed", cases[i].name);
	}
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
	kvt_cache_destroy(f.c);
}

/* ---- allocation faults -------------------------------------------------------------------------- */

/* write: a paged ingest of 200 tokens after 300 on the last layer; read: a paged read of 200
 * into a buffer of NSLOT slots (the map's slots go up to NSLOT - 1). */
static int op_write(kvt_cache *c, uint32_t s)
{
	kvt_rows_layout lo = {sizeof lo, 0, g_map, 0, 0};
	return kvt_seq_write_rows_at(c, s, NL - 1, 300, 500, g_pk, g_pv, &lo, NULL);
}

static int op_read(kvt_cache *c, uint32_t s)
{
	kvt_rows_layout lo = {sizeof lo, 0, g_map, 0, 0};
	return kvt_seq_read_rows_at(c, s, 1, 100, 300, g_rk, g_rv, &lo, NULL);
}

static void fault_loop(const char *name, int (*op)(kvt_cache *c, uint32_t s), uint32_t want_len)
{
	make_stream(7);
	make_map(30, 200, 0);
	for (uint32_t i = 0; i < 200; i++) {
		put(g_pk, g_k[0] + (size_t)300 * ROW, i, g_map[i], ROW, D);
		put(g_pv, g_v[0] + (size_t)300 * ROW, i, g_map[i], ROW, D);
	}
	int64_t live0 = kvt_mem_live();
	uint64_t n = 1;
	for (;; n++) {
		kvt_cache *c = make_cache();
		uint32_t s;
		T_CHECK(kvt_seq_open(c, &s) == 0, "open");
		for (uint32_t l = 0; l < NL; l++)
			T_CHECK(kvt_prefill(c, s, l, NULL, g_k[0], g_v[0], 300, NULL) == 0, "prefill");
		kvt_stats st0 = t_stats(c);
		float o0[QROW];
		attend(c, s, NL - 1, o0);
		kvt_mem_fail_at(n);
		int rc = op(c, s);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc < 0) {
			T_CHECK(fired && rc == -ENOMEM && strlen(kvt_last_error(c)) > 0,
				"%s N=%llu: got %d (%s), fired %d", name, (unsigned long long)n, rc,
				kvt_last_error(c), fired);
			kvt_stats st1 = t_stats(c);
			float o1[QROW];
			attend(c, s, NL - 1, o1);
			T_CHECK(st1.tokens == st0.tokens && st1.host_bytes_used == st0.host_bytes_used &&
				c->seqs[s].layers[NL - 1].n_tokens == 300 && !memcmp(o0, o1, sizeof o0),
				"%s N=%llu: a failed call changed the sequence (tokens %llu -> %llu, host "
				"%llu -> %llu)", name, (unsigned long long)n, (unsigned long long)st0.tokens,
				(unsigned long long)st1.tokens, (unsigned long long)st0.host_bytes_used,
				(unsigned long long)st1.host_bytes_used);
		} else {
			T_CHECK(c->seqs[s].layers[NL - 1].n_tokens == want_len, "%s N=%llu: %u tokens",
				name, (unsigned long long)n, c->seqs[s].layers[NL - 1].n_tokens);
		}
		kvt_cache_destroy(c);
		T_CHECK(kvt_mem_live() == live0, "%s N=%llu: live allocations %lld after destroy, "
			"wanted %lld", name, (unsigned long long)n, (long long)kvt_mem_live(),
			(long long)live0);
		if (!fired)
			break;
	}
	print_message("%s: %llu allocation faults, each left the sequence as it was\n", name,
		      (unsigned long long)(n - 1));
}

static void test_faults(void **state)
{
	(void)state;
	fault_loop("write_rows_at paged", op_write, 500);
	fault_loop("read_rows_at paged", op_read, 300);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_read_paged),    cmocka_unit_test(test_read_strided),
		cmocka_unit_test(test_write_paged),   cmocka_unit_test(test_write_strided),
		cmocka_unit_test(test_bad_arguments), cmocka_unit_test(test_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
