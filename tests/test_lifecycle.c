/* SPDX-License-Identifier: MIT */
/*
 * The lifecycle calls on the CPU backend (suite unit): kvt_seq_truncate, kvt_seq_fork,
 * kvt_seq_read_rows and kvt_seq_write_rows.
 *   - truncate: scripts of prefill chunks, appends, drafted tokens and truncations run on one
 *     sequence, and the same script without the drafted tokens on a fresh one: after every step at
 *     which both hold the same tokens, the index counts, the centroids and the attention outputs
 *     (p = 0.9 and p = 1) are bit for bit equal;
 *   - fork: parent and child attend like sequences built from their own tokens, whatever the other
 *     does (appends, truncation into shared blocks, close); shared blocks are held once in the host
 *     tier and freed with their last holder;
 *   - rows: read_rows gives back the rows given, write_rows equals a prefill without queries;
 *   - bad arguments: each value its code, a text naming it, and no change;
 *   - allocation faults: fork and truncate failing at the N-th allocation for N = 1, 2, ... change
 *     nothing (lengths, outputs, host bytes) and leak nothing.
 */
#include "common.h"

#define D 64
#define NKV 2
#define NQ 4
#define NL 2
#define ROW (NKV * D)
#define QROW (NQ * D)
#define MAXT 1400 /* tokens of a stream */

/* Token streams: the kept tokens and the drafted ones, per layer. */
static uint16_t g_keep[NL][MAXT * ROW], g_keepv[NL][MAXT * ROW];
static uint16_t g_draft[NL][MAXT * ROW], g_draftv[NL][MAXT * ROW];
static uint16_t g_q[QROW], g_buf_k[MAXT * ROW], g_buf_v[MAXT * ROW];

static void make_streams(uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	for (int l = 0; l < NL; l++) {
		t_fill(&r, KVT_DTYPE_F16, (size_t)MAXT * ROW, 0.2, 1.0, g_keep[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, (size_t)MAXT * ROW, 0.0, 1.0, g_keepv[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, (size_t)MAXT * ROW, -0.3, 1.5, g_draft[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, (size_t)MAXT * ROW, 0.1, 1.0, g_draftv[l], NULL);
	}
}

static kvt_cache *make_cache(float p, uint32_t host_blocks)
{
	kvt_config cfg = t_config(NL, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = p;
	cfg.budget_min = KVT_NONE; /* let p alone decide the selection */
	if (host_blocks)
		cfg.host_bytes = (uint64_t)host_blocks * KVT_BLOCK_TOKENS * 4 * D;
	return t_create(&cfg);
}

/* ---- steps on a sequence ------------------------------------------------------------------- */

enum kind { PREFILL, APPEND, DRAFT_PREFILL, DRAFT_APPEND, TRUNC, END };
struct step {
	enum kind kind;
	uint32_t n;
};

static uint32_t len_of(kvt_cache *c, uint32_t s)
{
	return (uint32_t)kvt_seq_length(c, s, 0);
}

/* One step on every layer of seq s; rows at the sequence's length from the kept or drafted stream. */
static void run_step(kvt_cache *c, uint32_t s, const struct step *st)
{
	uint32_t at = len_of(c, s);
	bool draft = st->kind == DRAFT_PREFILL || st->kind == DRAFT_APPEND;
	int rc = 0;
	if (st->kind == TRUNC) {
		rc = kvt_seq_truncate(c, s, st->n, NULL);
		T_CHECK(rc == 0, "truncate %u of %u: got %d (%s)", st->n, at, rc, kvt_last_error(c));
		return;
	}
	T_CHECK(at + st->n <= MAXT, "script past the streams");
	for (uint32_t l = 0; l < NL; l++) {
		const uint16_t *k = (draft ? g_draft[l] : g_keep[l]) + (size_t)at * ROW;
		const uint16_t *v = (draft ? g_draftv[l] : g_keepv[l]) + (size_t)at * ROW;
		if (st->kind == PREFILL || st->kind == DRAFT_PREFILL) {
			rc = kvt_prefill(c, s, l, NULL, k, v, st->n, NULL);
			T_CHECK(rc == 0, "prefill %u at %u: %s", st->n, at, kvt_last_error(c));
			continue;
		}
		for (uint32_t t = 0; t < st->n; t++) {
			rc = kvt_append(c, l, 1, &s, k + (size_t)t * ROW, v + (size_t)t * ROW, NULL);
			T_CHECK(rc == 0, "append at %u: %s", at + t, kvt_last_error(c));
		}
	}
}

/* The same step on s of c and on rs of the reference r. */
static void both(kvt_cache *c, uint32_t s, kvt_cache *r, uint32_t rs, const struct step *st)
{
	run_step(c, s, st);
	run_step(r, rs, st);
}

/* Attention of one query over seq s of cache c on layer l, as raw bits. */
static void attend(kvt_cache *c, uint32_t s, uint32_t l, float *out)
{
	int rc = kvt_attend(c, l, 1, &s, g_q, out, NULL);
	T_CHECK(rc == 0, "attend seq %u layer %u: %d (%s)", s, l, rc, kvt_last_error(c));
}

static bool g_other_centroids; /* a truncation into the first chunk keeps its centroids */

/* a of cache ca and b of cache cb hold the same tokens: the same state and outputs, bit for bit. */
static void expect_same(kvt_cache *ca, uint32_t a, kvt_cache *cb, uint32_t b, const char *what,
			uint32_t step)
{
	t_rng r;
	t_rng_seed(&r, 77 + step);
	for (uint32_t l = 0; l < NL; l++) {
		const struct kvt_layer *la = &ca->seqs[a].layers[l], *lb = &cb->seqs[b].layers[l];
		T_CHECK(la->n_tokens == lb->n_tokens && la->n_indexed == lb->n_indexed,
			"%s step %u layer %u: tokens %u indexed %u, wanted %u indexed %u", what, step, l,
			la->n_tokens, la->n_indexed, lb->n_tokens, lb->n_indexed);
		T_CHECK(g_other_centroids || (la->centroids == lb->centroids &&
			(!la->centroids || !memcmp(la->c_k, lb->c_k, sizeof(float) * NKV * D))),
			"%s step %u layer %u: centroids differ (frozen %d, %d)", what, step, l,
			la->centroids, lb->centroids);
		if (!la->n_tokens)
			continue;
		for (int rep = 0; rep < 3; rep++) {
			float oa[QROW], ob[QROW];
			t_fill(&r, KVT_DTYPE_F16, QROW, 0.3, 1.0, g_q, NULL);
			attend(ca, a, l, oa);
			attend(cb, b, l, ob);
			for (int x = 0; x < QROW; x++)
				T_CHECK(!memcmp(&oa[x], &ob[x], sizeof(float)),
					"%s step %u layer %u query %d: output %d got %.9g, wanted %.9g "
					"(bit for bit)", what, step, l, rep, x, oa[x], ob[x]);
		}
	}
}

/* Run a script on seq a of ca, and without its drafted tokens and truncations on b of cb;
 * compare whenever both hold the same tokens. */
static void run_script(const char *name, const struct step *sc, float p)
{
	kvt_cache *ca = make_cache(p, 0), *cb = make_cache(p, 0);
	uint32_t a, b;
	T_CHECK(kvt_seq_open(ca, &a) == 0 && kvt_seq_open(cb, &b) == 0, "open");
	uint32_t compared = 0;
	for (uint32_t i = 0; sc[i].kind != END; i++) {
		run_step(ca, a, &sc[i]);
		if (sc[i].kind == PREFILL || sc[i].kind == APPEND)
			run_step(cb, b, &sc[i]);
		if (len_of(ca, a) == len_of(cb, b)) {
			char what[96];
			snprintf(what, sizeof what, "%s (p = %.2f)", name, (double)p);
			expect_same(ca, a, cb, b, what, i);
			compared++;
		}
	}
	T_CHECK(compared >= 2, "%s: compared only %u times", name, compared);
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

/* sinks 4, window 16, flush batch 8 (t_config) */
static const struct step sc_window[] = {{PREFILL, 100}, {APPEND, 10}, {DRAFT_APPEND, 5},
					{TRUNC, 5}, {APPEND, 30}, {END, 0}};
static const struct step sc_flushes[] = {{PREFILL, 100}, {APPEND, 10}, {DRAFT_APPEND, 27},
					 {TRUNC, 27}, {APPEND, 3}, {DRAFT_APPEND, 40},
					 {TRUNC, 40}, {APPEND, 40}, {END, 0}};
static const struct step sc_chunk[] = {{PREFILL, 100}, {PREFILL, 20}, {DRAFT_PREFILL, 50},
				       {TRUNC, 50}, {APPEND, 40}, {PREFILL, 30}, {DRAFT_APPEND, 9},
				       {TRUNC, 9}, {APPEND, 12}, {END, 0}};
/* back past a second prefill into the appends before it */
static const struct step sc_runs[] = {{PREFILL, 100}, {APPEND, 10}, {DRAFT_PREFILL, 40},
				      {DRAFT_APPEND, 10}, {TRUNC, 50}, {APPEND, 30}, {END, 0}};
/* appends only: back before the first flush (the centroids it fixed are dropped) */
static const struct step sc_appends[] = {{APPEND, 20}, {DRAFT_APPEND, 40}, {TRUNC, 40},
					 {APPEND, 50}, {DRAFT_APPEND, 3}, {TRUNC, 3}, {END, 0}};
/* across blocks: back over whole blocks, to empty, and again */
static const struct step sc_blocks[] = {{PREFILL, 300}, {DRAFT_PREFILL, 500}, {DRAFT_APPEND, 9},
					{TRUNC, 509}, {APPEND, 20}, {DRAFT_APPEND, 1}, {TRUNC, 1},
					{PREFILL, 260}, {END, 0}};

static void test_truncate_exact(void **state)
{
	(void)state;
	make_streams(1);
	const struct {
		const char *name;
		const struct step *sc;
	} scripts[] = {{"window", sc_window}, {"flushes", sc_flushes}, {"chunk", sc_chunk},
		       {"runs", sc_runs}, {"appends", sc_appends}, {"blocks", sc_blocks}};
	for (size_t i = 0; i < sizeof scripts / sizeof *scripts; i++) {
		run_script(scripts[i].name, scripts[i].sc, 0.9f);
		run_script(scripts[i].name, scripts[i].sc, 1.0f);
	}
}

/* Into the first prefill chunk: the centroids stay those of the whole chunk, so only p = 1 (every
 * indexed token selected) is bit-equal to a fresh sequence; and the blocks past the new length go
 * back to the host tier. */
static void test_truncate_first_chunk(void **state)
{
	(void)state;
	make_streams(2);
	kvt_cache *ca = make_cache(1.0f, 0), *cb = make_cache(1.0f, 0);
	uint32_t a, b;
	T_CHECK(kvt_seq_open(ca, &a) == 0 && kvt_seq_open(cb, &b) == 0, "open");
	const struct step full = {PREFILL, 700}, part = {PREFILL, 300}, more = {APPEND, 25};
	run_step(ca, a, &full);
	uint64_t used = t_stats(ca).host_bytes_used;
	const struct step cut = {TRUNC, 400};
	run_step(ca, a, &cut);
	uint64_t after = t_stats(ca).host_bytes_used;
	T_CHECK(after == used / 3 * 2, "host bytes after dropping block 2 of 3: got %llu, wanted %llu",
		(unsigned long long)after, (unsigned long long)(used / 3 * 2));
	T_CHECK(t_stats(ca).tokens == 300 * NL, "tokens got %llu", (unsigned long long)t_stats(ca).tokens);
	run_step(cb, b, &part);
	g_other_centroids = true;
	expect_same(ca, a, cb, b, "first chunk", 0);
	both(ca, a, cb, b, &more);
	expect_same(ca, a, cb, b, "first chunk", 1);
	g_other_centroids = false;
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

/* ---- fork ------------------------------------------------------------------------------------ */

static void test_fork_cow(void **state)
{
	(void)state;
	make_streams(3);
	for (int pi = 0; pi < 2; pi++) {
		float p = pi ? 1.0f : 0.9f;
		kvt_cache *c = make_cache(p, 0), *r = make_cache(p, 0);
		uint32_t par, kid = 99, rp, rk;
		T_CHECK(kvt_seq_open(c, &par) == 0 && kvt_seq_open(r, &rp) == 0 &&
			kvt_seq_open(r, &rk) == 0, "open");
		const struct step pre = {PREFILL, 600}, app = {APPEND, 9};
		run_step(c, par, &pre);
		run_step(c, par, &app);
		uint64_t used = t_stats(c).host_bytes_used;
		int rc = kvt_seq_fork(c, par, &kid, NULL);
		T_CHECK(rc == 0 && kid != par, "fork: %d (%s), child %u", rc, kvt_last_error(c), kid);
		/* only the partial last block of each layer and head is copied */
		uint64_t blk = (uint64_t)KVT_BLOCK_TOKENS * 4 * D;
		T_CHECK(t_stats(c).host_bytes_used == used + (uint64_t)NL * NKV * blk,
			"host bytes after fork: got %llu, wanted %llu", (unsigned long long)t_stats(c).host_bytes_used,
			(unsigned long long)(used + (uint64_t)NL * NKV * blk));
		T_CHECK(t_stats(c).seqs_open == 2, "seqs_open %llu", (unsigned long long)t_stats(c).seqs_open);
		for (int i = 0; i < 2; i++) {
			run_step(r, i ? rk : rp, &pre);
			run_step(r, i ? rk : rp, &app);
		}
		expect_same(c, kid, r, rk, "fork, child", 0);
		expect_same(c, par, r, rp, "fork, parent", 0);
		/* the parent decodes the kept stream on, the child drafted tokens: each its own rows */
		const struct step pa = {APPEND, 30}, ka = {DRAFT_APPEND, 30};
		both(c, par, r, rp, &pa);
		both(c, kid, r, rk, &ka);
		expect_same(c, par, r, rp, "fork, parent after appends", 1);
		expect_same(c, kid, r, rk, "fork, child after appends", 1);
		/* the parent goes back into a shared full block (copied, the child keeps its own) */
		const struct step cut = {TRUNC, 639 - 400};
		const struct step pb = {DRAFT_APPEND, 40};
		both(c, par, r, rp, &cut);
		both(c, par, r, rp, &pb);
		expect_same(c, par, r, rp, "fork, parent after truncation into a shared block", 2);
		expect_same(c, kid, r, rk, "fork, child after the parent's truncation", 2);
		/* a closed parent leaves the child whole; the child's close frees everything */
		T_CHECK(kvt_seq_close(c, par) == 0, "close parent");
		expect_same(c, kid, r, rk, "fork, child after the parent closed", 3);
		T_CHECK(kvt_seq_close(c, kid) == 0, "close child");
		T_CHECK(t_stats(c).host_bytes_used == 0, "host bytes after both closed: %llu",
			(unsigned long long)t_stats(c).host_bytes_used);
		kvt_cache_destroy(c);
		kvt_cache_destroy(r);
	}
}

/* ---- rows ------------------------------------------------------------------------------------ */

static void test_rows(void **state)
{
	(void)state;
	make_streams(4);
	kvt_cache *c = make_cache(0.9f, 0), *r = make_cache(0.9f, 0);
	uint32_t s, w, rs;
	T_CHECK(kvt_seq_open(c, &s) == 0 && kvt_seq_open(c, &w) == 0 && kvt_seq_open(r, &rs) == 0,
		"open");
	const struct step pre = {PREFILL, 500}, app = {APPEND, 37};
	run_step(c, s, &pre);
	run_step(c, s, &app);
	const uint32_t n = 537;
	const kvt_stats before = t_stats(c);
	for (uint32_t l = 0; l < NL; l++) {
		memset(g_buf_k, 0xa5, sizeof g_buf_k);
		memset(g_buf_v, 0x5a, sizeof g_buf_v);
		int rc = kvt_seq_read_rows(c, s, l, 0, n, g_buf_k, g_buf_v, NULL);
		T_CHECK(rc == (int)n, "read_rows layer %u: %d (%s)", l, rc, kvt_last_error(c));
		T_CHECK(!memcmp(g_buf_k, g_keep[l], (size_t)n * ROW * 2) &&
			!memcmp(g_buf_v, g_keepv[l], (size_t)n * ROW * 2), "read_rows layer %u: rows differ", l);
		rc = kvt_seq_read_rows(c, s, l, 250, 263, g_buf_k, g_buf_v, NULL);
		T_CHECK(rc == 13 && !memcmp(g_buf_k, g_keep[l] + (size_t)250 * ROW, (size_t)13 * ROW * 2),
			"read_rows [250, 263) layer %u across a block edge: %d", l, rc);
		const kvt_stats after = t_stats(c);
		T_CHECK(after.rows_fetched == before.rows_fetched &&
				after.bytes_fetched == before.bytes_fetched,
			"read_rows layer %u: rows_fetched %llu -> %llu, bytes_fetched %llu -> %llu; "
			"wanted unchanged (kvtier.h: attention's and gather's rows only)", l,
			(unsigned long long)before.rows_fetched, (unsigned long long)after.rows_fetched,
			(unsigned long long)before.bytes_fetched, (unsigned long long)after.bytes_fetched);
		/* ingest: written in two ranges, as a prefill in the same two chunks */
		rc = kvt_seq_write_rows(c, w, l, 0, 300, g_keep[l], g_keepv[l], NULL);
		T_CHECK(rc == 300, "write_rows [0, 300): %d (%s)", rc, kvt_last_error(c));
		rc = kvt_seq_write_rows(c, w, l, 300, n, g_keep[l] + (size_t)300 * ROW,
					g_keepv[l] + (size_t)300 * ROW, NULL);
		T_CHECK(rc == (int)(n - 300), "write_rows [300, %u): %d (%s)", n, rc, kvt_last_error(c));
		T_CHECK(kvt_prefill(r, rs, l, NULL, g_keep[l], g_keepv[l], 300, NULL) == 0 &&
			kvt_prefill(r, rs, l, NULL, g_keep[l] + (size_t)300 * ROW,
				    g_keepv[l] + (size_t)300 * ROW, n - 300, NULL) == 0, "reference prefill");
	}
	expect_same(c, w, r, rs, "write_rows", 0);
	kvt_cache_destroy(c);
	kvt_cache_destroy(r);
}

/* ---- bad arguments --------------------------------------------------------------------------- */

struct fx {
	kvt_cache *c;
	uint32_t a, closed;
	char msg[512]; /* the detail, when a case makes further calls after the failing one */
};

struct bad_case {
	const char *name;
	int want;
	const char *needle[2];
	int (*call)(struct fx *f);
};

#define BAD(fn, expr)                                                                              \
	static int fn(struct fx *f)                                                                \
	{                                                                                          \
		return (expr);                                                                     \
	}
static uint32_t g_child = 4242;
BAD(b_tr_null, kvt_seq_truncate(NULL, f->a, 1, NULL))
BAD(b_tr_closed, kvt_seq_truncate(f->c, f->closed, 1, NULL))
BAD(b_tr_many, kvt_seq_truncate(f->c, f->a, 41, NULL))
BAD(b_fk_null, kvt_seq_fork(NULL, f->a, &g_child, NULL))
BAD(b_fk_child, kvt_seq_fork(f->c, f->a, NULL, NULL))
BAD(b_fk_closed, kvt_seq_fork(f->c, f->closed, &g_child, NULL))
BAD(b_fk_big, kvt_seq_fork(f->c, 1000, &g_child, NULL))
BAD(b_rd_null, kvt_seq_read_rows(NULL, f->a, 0, 0, 1, g_buf_k, g_buf_v, NULL))
BAD(b_rd_k, kvt_seq_read_rows(f->c, f->a, 0, 0, 1, NULL, g_buf_v, NULL))
BAD(b_rd_v, kvt_seq_read_rows(f->c, f->a, 0, 0, 1, g_buf_k, NULL, NULL))
BAD(b_rd_layer, kvt_seq_read_rows(f->c, f->a, 7, 0, 1, g_buf_k, g_buf_v, NULL))
BAD(b_rd_empty, kvt_seq_read_rows(f->c, f->a, 0, 9, 9, g_buf_k, g_buf_v, NULL))
BAD(b_rd_past, kvt_seq_read_rows(f->c, f->a, 0, 3, 41, g_buf_k, g_buf_v, NULL))
BAD(b_rd_closed, kvt_seq_read_rows(f->c, f->closed, 0, 0, 1, g_buf_k, g_buf_v, NULL))
BAD(b_wr_null, kvt_seq_write_rows(NULL, f->a, 0, 40, 41, g_buf_k, g_buf_v, NULL))
BAD(b_wr_k, kvt_seq_write_rows(f->c, f->a, 0, 40, 41, NULL, g_buf_v, NULL))
BAD(b_wr_layer, kvt_seq_write_rows(f->c, f->a, 5, 40, 41, g_buf_k, g_buf_v, NULL))
BAD(b_wr_from, kvt_seq_write_rows(f->c, f->a, 0, 39, 45, g_buf_k, g_buf_v, NULL))
BAD(b_wr_empty, kvt_seq_write_rows(f->c, f->a, 0, 40, 40, g_buf_k, g_buf_v, NULL))
BAD(b_wr_closed, kvt_seq_write_rows(f->c, f->closed, 0, 0, 1, g_buf_k, g_buf_v, NULL))

static int b_fk_full(struct fx *f)
{
	uint32_t extra[8];
	int n = 0;
	while (n < 8 && kvt_seq_open(f->c, &extra[n]) == 0)
		n++;
	int rc = kvt_seq_fork(f->c, f->a, &g_child, NULL);
	snprintf(f->msg, sizeof f->msg, "%s", kvt_last_error(f->c));
	for (int i = 0; i < n; i++)
		kvt_seq_close(f->c, extra[i]);
	return rc;
}

static void test_bad_arguments(void **state)
{
	(void)state;
	make_streams(5);
	const struct bad_case cases[] = {
		{"truncate, cache NULL", -EINVAL, {"cache"}, b_tr_null},
		{"truncate, closed seq", -ENOENT, {"seq = 1"}, b_tr_closed},
		{"truncate, more than held", -EINVAL, {"n_tokens = 41", "40 tokens"}, b_tr_many},
		{"fork, cache NULL", -EINVAL, {"cache"}, b_fk_null},
		{"fork, child NULL", -EINVAL, {"child"}, b_fk_child},
		{"fork, closed parent", -ENOENT, {"seq = 1"}, b_fk_closed},
		{"fork, parent 1000", -ENOENT, {"seq = 1000"}, b_fk_big},
		{"fork, max_seqs open", -ENOSPC, {"max_seqs = 8"}, b_fk_full},
		{"read_rows, cache NULL", -EINVAL, {"cache"}, b_rd_null},
		{"read_rows, k NULL", -EINVAL, {"k is NULL"}, b_rd_k},
		{"read_rows, v NULL", -EINVAL, {"v is NULL"}, b_rd_v},
		{"read_rows, layer 7", -EINVAL, {"layer = 7", "n_layers = 2"}, b_rd_layer},
		{"read_rows, empty range", -EINVAL, {"to = 9", "from = 9"}, b_rd_empty},
		{"read_rows, past the end", -EINVAL, {"to = 41", "40"}, b_rd_past},
		{"read_rows, closed seq", -ENOENT, {"seq = 1"}, b_rd_closed},
		{"write_rows, cache NULL", -EINVAL, {"cache"}, b_wr_null},
		{"write_rows, k NULL", -EINVAL, {"k is NULL"}, b_wr_k},
		{"write_rows, layer 5", -EINVAL, {"layer = 5"}, b_wr_layer},
		{"write_rows, from not the end", -EINVAL, {"from = 39", "must be 40"}, b_wr_from},
		{"write_rows, empty range", -EINVAL, {"to = 40", "from = 40"}, b_wr_empty},
		{"write_rows, closed seq", -ENOENT, {"seq = 1"}, b_wr_closed},
	};
	struct fx f;
	f.c = make_cache(0.9f, 0);
	T_CHECK(kvt_seq_open(f.c, &f.a) == 0 && kvt_seq_open(f.c, &f.closed) == 0 &&
		kvt_seq_close(f.c, f.closed) == 0, "open");
	const struct step pre = {PREFILL, 30}, app = {APPEND, 10};
	run_step(f.c, f.a, &pre);
	run_step(f.c, f.a, &app);
	int nfail = 0;
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
		const struct bad_case *t = &cases[i];
		kvt_stats before = t_stats(f.c);
		int64_t live = kvt_mem_live();
		float o0[QROW], o1[QROW];
		attend(f.c, f.a, 0, o0);
		g_child = 4242;
		f.msg[0] = 0;
		int rc = t->call(&f);
		const int no_cache = t->call == b_tr_null || t->call == b_fk_null ||
				     t->call == b_rd_null || t->call == b_wr_null;
		const char *msg = f.msg[0] ? f.msg : kvt_last_error(no_cache ? NULL : f.c);
		T_SOFT(&nfail, rc == t->want, "[%s]: got %d (%s), wanted %d; detail \"%s\"", t->name, rc,
		       kvt_strerror(rc), t->want, msg);
		for (int k = 0; k < 2 && t->needle[k]; k++)
			T_SOFT(&nfail, t_contains(msg, t->needle[k]), "[%s]: detail \"%s\" does not name \"%s\"",
			       t->name, msg, t->needle[k]);
		kvt_stats after = t_stats(f.c);
		T_SOFT(&nfail, after.tokens == before.tokens && after.seqs_open == before.seqs_open &&
		       after.host_bytes_used == before.host_bytes_used && kvt_mem_live() == live &&
		       g_child == 4242, "[%s]: the cache changed (tokens %llu -> %llu, seqs %llu -> %llu, "
		       "live %lld -> %lld, child %u)", t->name, (unsigned long long)before.tokens,
		       (unsigned long long)after.tokens, (unsigned long long)before.seqs_open,
		       (unsigned long long)after.seqs_open, (long long)live, (long long)kvt_mem_live(),
		       g_child);
		attend(f.c, f.a, 0, o1);
		T_SOFT(&nfail, !memcmp(o0, o1, sizeof o0), "[%s]: attention changed", t->name);
	}
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
	kvt_cache_destroy(f.c);
}

/* ---- allocation faults ----------------------------------------------------------------------- */

/* What a failed call must leave as it was: lengths, host bytes, and every sequence's attention. */
struct snap {
	uint32_t n_seqs, len[8][NL];
	uint64_t host, tokens, seqs;
	float out[8][NL][QROW];
};

static void snap_take(kvt_cache *c, struct snap *s)
{
	memset(s, 0, sizeof *s);
	kvt_stats st = t_stats(c);
	s->host = st.host_bytes_used;
	s->tokens = st.tokens;
	s->seqs = st.seqs_open;
	for (uint32_t i = 0; i < 8; i++)
		for (uint32_t l = 0; l < NL && c->seqs[i].open; l++) {
			s->len[i][l] = c->seqs[i].layers[l].n_tokens;
			t_rng r;
			t_rng_seed(&r, 11 * i + l);
			t_fill(&r, KVT_DTYPE_F16, QROW, 0.3, 1.0, g_q, NULL);
			attend(c, i, l, s->out[i][l]);
		}
}

/* One script: a parent with a child sharing its blocks, then `op` failing at the N-th allocation. */
typedef int (*fault_op)(kvt_cache *c, uint32_t par, uint32_t kid);
static int op_fork(kvt_cache *c, uint32_t par, uint32_t kid)
{
	uint32_t x;
	(void)kid;
	return kvt_seq_fork(c, par, &x, NULL);
}
static int op_trunc_cow(kvt_cache *c, uint32_t par, uint32_t kid)
{
	(void)kid;
	return kvt_seq_truncate(c, par, 300, NULL); /* 609 -> 309: into a shared full block */
}
static int op_read(kvt_cache *c, uint32_t par, uint32_t kid)
{
	(void)par;
	return kvt_seq_read_rows(c, kid, 1, 100, 600, g_buf_k, g_buf_v, NULL);
}

static void fault_loop(const char *name, fault_op op, int want_ok)
{
	make_streams(6);
	int64_t live0 = kvt_mem_live();
	uint64_t n = 1;
	for (;; n++) {
		kvt_cache *c = make_cache(0.9f, 0);
		uint32_t par, kid;
		T_CHECK(kvt_seq_open(c, &par) == 0, "open");
		const struct step pre = {PREFILL, 600}, app = {APPEND, 9};
		run_step(c, par, &pre);
		run_step(c, par, &app);
		T_CHECK(kvt_seq_fork(c, par, &kid, NULL) == 0, "fork: %s", kvt_last_error(c));
		struct snap s0, s1;
		snap_take(c, &s0);
		kvt_mem_fail_at(n);
		int rc = op(c, par, kid);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc < 0) {
			T_CHECK(fired && (rc == -ENOMEM || rc == -ENOSPC), "%s N=%llu: got %d (%s), fired %d",
				name, (unsigned long long)n, rc, kvt_last_error(c), fired);
			T_CHECK(strlen(kvt_last_error(c)) > 0, "%s N=%llu: no detail", name,
				(unsigned long long)n);
			snap_take(c, &s1);
			T_CHECK(!memcmp(&s0, &s1, sizeof s0), "%s N=%llu: a failed call changed the cache "
				"(host %llu -> %llu, tokens %llu -> %llu, seqs %llu -> %llu)", name,
				(unsigned long long)n, (unsigned long long)s0.host, (unsigned long long)s1.host,
				(unsigned long long)s0.tokens, (unsigned long long)s1.tokens,
				(unsigned long long)s0.seqs, (unsigned long long)s1.seqs);
		} else {
			T_CHECK(rc >= 0 && want_ok, "%s N=%llu: got %d", name, (unsigned long long)n, rc);
		}
		kvt_cache_destroy(c);
		T_CHECK(kvt_mem_live() == live0, "%s N=%llu: live allocations %lld after destroy, wanted "
			"%lld", name, (unsigned long long)n, (long long)kvt_mem_live(), (long long)live0);
		if (!fired)
			break;
	}
	print_message("%s: %llu allocation faults, each left the cache as it was\n", name,
		      (unsigned long long)(n - 1));
}

static void test_faults(void **state)
{
	(void)state;
	fault_loop("fork", op_fork, 1);
	fault_loop("truncate into a shared block", op_trunc_cow, 1);
	fault_loop("read_rows", op_read, 1);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_truncate_exact), cmocka_unit_test(test_truncate_first_chunk),
		cmocka_unit_test(test_fork_cow),       cmocka_unit_test(test_rows),
		cmocka_unit_test(test_bad_arguments),  cmocka_unit_test(test_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
