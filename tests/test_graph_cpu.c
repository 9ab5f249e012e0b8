/* SPDX-License-Identifier: MIT */
/*
 * kvt_graph_reserve and kvt_attend_graph (kvtier_graph.h) on the CPU backend (suite unit):
 *   - bad arguments: each value its -EINVAL, a text naming it, the out buffer untouched and the
 *     reservation kept (a valid call afterwards gives the same rows);
 *   - slot errors (a sequence not open, closed after the reservation or out of range, a sequence in
 *     two valid slots, a length that differs, a sequence longer than max_tokens): -EINVAL, the slot
 *     in kvt_last_error_entry and in the text, and not one byte of out written;
 *   - equivalence: 200 decode steps over three sequences of different lengths on two caches fed
 *     the same tokens, with window flushes along the way: every valid slot of kvt_attend_graph
 *     (padded by seqs < 0 or by valid[] == 0, lengths given or NULL, garbage q rows in the padded
 *     slots) equals kvt_attend's row of its sequence bit for bit, and every padded row keeps its
 *     sentinel bytes;
 *   - kvt_graph_reserve(cache, 0, 0) drops the reservation.
 */
#include "common.h"

#define D 64
#define NKV 2
#define NQ 4
#define NL 2
#define ROW (NKV * D)
#define QROW (NQ * D)
#define NS 3     /* sequences */
#define SLOTS 5  /* slots of the graph batch */
#define MAXTOK 4096
#define SENTINEL 0xcd
#define QNAN 0x7e00 /* an fp16 NaN: the q rows of padded slots */

static uint16_t g_q[8 * QROW], g_k[NS * ROW], g_v[NS * ROW];
static float g_out[8 * QROW], g_ref[8 * QROW], g_base[8 * QROW];
static uint16_t g_pk[1100 * ROW], g_pv[1100 * ROW];

static kvt_cache *make_cache(void)
{
	kvt_config cfg = t_config(NL, NQ, NKV, D, KVT_DTYPE_F16); /* sinks 4, window 16, flush 8 */
	cfg.p = 0.9f;
	cfg.budget_min = KVT_NONE; /* let p alone decide the selection */
	return t_create(&cfg);
}

/* Prefill seq s of c with n random tokens on every layer (the same stream for a given seed). */
static void prefill(kvt_cache *c, uint32_t s, uint32_t n, uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	for (uint32_t l = 0; l < NL; l++) {
		t_fill(&r, KVT_DTYPE_F16, (size_t)n * ROW, 0.2, 1.0, g_pk, NULL);
		t_fill(&r, KVT_DTYPE_F16, (size_t)n * ROW, 0.0, 1.0, g_pv, NULL);
		int rc = kvt_prefill(c, s, l, NULL, g_pk, g_pv, n, NULL);
		T_CHECK(rc == 0, "prefill seq %u layer %u with %u tokens: %d (%s)", s, l, n, rc,
			kvt_last_error(c));
	}
}

static void poison(void *buf, size_t bytes)
{
	memset(buf, SENTINEL, bytes);
}

/* Index of the first byte of buf[0, bytes) that is not the sentinel, or -1. */
static long first_written(const void *buf, size_t bytes)
{
	const unsigned char *p = (const unsigned char *)buf;
	for (size_t i = 0; i < bytes; i++)
		if (p[i] != SENTINEL)
			return (long)i;
	return -1;
}

/* ---- the fixture of the bad-argument and slot-error tables --------------------------------- */

static const uint32_t fx_len[NS] = {40, 60, 80};

struct fx {
	kvt_cache *c;    /* reserved (SLOTS, MAXTOK), NS sequences with fx_len tokens */
	kvt_cache *bare; /* the same sequences, no reservation */
	uint32_t s[NS], closed;
	char msg[512]; /* the detail, when a case makes calls after the failing one */
	int entry;     /* kvt_last_error_entry then */
};

/* The good batch: [s0, s1, s2, pad, pad] by seqs < 0. */
static int32_t g_seqs[8];
static int32_t g_lens[8];
static uint8_t g_valid[8];
static kvt_graph_batch g_b;

static void good_batch(const struct fx *f)
{
	for (int i = 0; i < 8; i++) {
		g_seqs[i] = -1;
		g_lens[i] = 0;
		g_valid[i] = 0;
	}
	for (int i = 0; i < NS; i++) {
		g_seqs[i] = (int32_t)f->s[i];
		g_lens[i] = (int32_t)fx_len[i];
		g_valid[i] = 1;
	}
	memset(&g_b, 0, sizeof g_b);
	g_b.n_slots = SLOTS;
	g_b.seqs = g_seqs;
}

static void fx_queries(void)
{
	t_rng r;
	t_rng_seed(&r, 91);
	t_fill(&r, KVT_DTYPE_F16, (size_t)8 * QROW, 0.3, 1.0, g_q, NULL);
}

/* The good batch on layer 0 must still succeed and give the baseline's rows. */
static void expect_intact(struct fx *f, const char *name, int *nfail)
{
	good_batch(f);
	poison(g_out, sizeof g_out);
	int rc = kvt_attend_graph(f->c, 0, &g_b, g_q, g_out, NULL);
	T_SOFT(nfail, rc == 0, "[%s]: the good batch afterwards: got %d (%s)", name, rc,
	       kvt_last_error(f->c));
	T_SOFT(nfail, !memcmp(g_out, g_base, sizeof g_out),
	       "[%s]: the good batch afterwards gives other rows (reservation or cache changed)",
	       name);
}

struct bad_case {
	const char *name;
	const char *needle[2];
	int (*call)(struct fx *f);
	int want_entry; /* slot errors: the slot; -2: not checked */
};

#define BAD(fn, prep, expr)                                                                        \
	static int fn(struct fx *f)                                                                \
	{                                                                                          \
		good_batch(f);                                                                     \
		prep;                                                                              \
		return (expr);                                                                     \
	}
#define AG(c, layer) kvt_attend_graph((c), (layer), &g_b, g_q, g_out, NULL)

BAD(b_null_cache, (void)0, kvt_attend_graph(NULL, 0, &g_b, g_q, g_out, NULL))
BAD(b_null_batch, (void)0, kvt_attend_graph(f->c, 0, NULL, g_q, g_out, NULL))
BAD(b_null_seqs, g_b.seqs = NULL, AG(f->c, 0))
BAD(b_null_q, (void)0, kvt_attend_graph(f->c, 0, &g_b, NULL, g_out, NULL))
BAD(b_null_out, (void)0, kvt_attend_graph(f->c, 0, &g_b, g_q, NULL, NULL))
BAD(b_pad, g_b.pad = 7, AG(f->c, 0))
BAD(b_zero_slots, g_b.n_slots = 0, AG(f->c, 0))
BAD(b_many_slots, g_b.n_slots = SLOTS + 1, AG(f->c, 0))
BAD(b_layer, (void)0, AG(f->c, NL))
BAD(r_null, (void)0, kvt_graph_reserve(NULL, SLOTS, MAXTOK, NULL))
BAD(r_slots, (void)0, kvt_graph_reserve(f->c, 9, MAXTOK, NULL))
BAD(r_tokens0, (void)0, kvt_graph_reserve(f->c, SLOTS, 0, NULL))
BAD(r_tokens_big, (void)0, kvt_graph_reserve(f->c, SLOTS, 1u << 24, NULL))

static int b_unreserved(struct fx *f)
{
	good_batch(f);
	int rc = AG(f->bare, 0);
	snprintf(f->msg, sizeof f->msg, "%s", kvt_last_error(f->bare));
	f->entry = kvt_last_error_entry(f->bare);
	return rc;
}

/* slot errors */
BAD(s_closed, g_seqs[2] = (int32_t)f->closed; g_seqs[3] = (int32_t)f->s[2], AG(f->c, 0))
BAD(s_huge, g_seqs[1] = 100000; g_seqs[3] = (int32_t)f->s[1], AG(f->c, 1))
BAD(s_never, g_seqs[0] = 7; g_seqs[3] = (int32_t)f->s[0], AG(f->c, 0))
BAD(s_repeat, g_seqs[3] = (int32_t)f->s[0], AG(f->c, 0))
/* padded by valid[]: slot 3 repeats slot 0's s2; s1 in padded slot 1 and valid slot 2 is none */
BAD(s_repeat_valid,
    g_b.valid = g_valid; g_seqs[0] = (int32_t)f->s[2]; g_valid[0] = 1; g_seqs[1] = (int32_t)f->s[1];
    g_valid[1] = 0; g_seqs[2] = (int32_t)f->s[1]; g_valid[2] = 1; g_seqs[3] = (int32_t)f->s[2];
    g_valid[3] = 1; g_seqs[4] = 12345; g_valid[4] = 0, AG(f->c, 0))
BAD(s_length, g_b.lengths = g_lens; g_lens[1] = (int32_t)fx_len[1] + 1, AG(f->c, 0))
BAD(s_length_neg, g_b.lengths = g_lens; g_lens[2] = -1, AG(f->c, 1))

/* A reservation of max_tokens 50: s1 (60 tokens) in slot 2 is too long; kvt_attend still works. */
static int s_too_long(struct fx *f)
{
	int rc = kvt_graph_reserve(f->c, SLOTS, 50, NULL);
	T_CHECK(rc == 0, "reserve (5, 50): %d (%s)", rc, kvt_last_error(f->c));
	good_batch(f);
	g_seqs[0] = (int32_t)f->s[0];
	g_seqs[1] = -1;
	g_seqs[2] = (int32_t)f->s[1];
	g_seqs[3] = -1;
	g_seqs[4] = -1;
	rc = AG(f->c, 0);
	snprintf(f->msg, sizeof f->msg, "%s", kvt_last_error(f->c));
	f->entry = kvt_last_error_entry(f->c);
	float o[QROW];
	int rc2 = kvt_attend(f->c, 0, 1, &f->s[1], g_q, o, NULL);
	T_CHECK(rc2 == 0, "kvt_attend of a sequence longer than max_tokens: %d (%s)", rc2,
		kvt_last_error(f->c));
	rc2 = kvt_graph_reserve(f->c, SLOTS, MAXTOK, NULL);
	T_CHECK(rc2 == 0, "reserve again: %d (%s)", rc2, kvt_last_error(f->c));
	return rc;
}

static void run_cases(struct fx *f, const struct bad_case *cases, size_t n)
{
	int nfail = 0;
	for (size_t i = 0; i < n; i++) {
		const struct bad_case *t = &cases[i];
		f->msg[0] = 0;
		f->entry = -3;
		poison(g_out, sizeof g_out);
		int rc = t->call(f);
		const int no_cache = t->call == b_null_cache || t->call == r_null;
		const char *msg = f->msg[0] ? f->msg : kvt_last_error(no_cache ? NULL : f->c);
		const int entry = f->entry != -3 ? f->entry : kvt_last_error_entry(f->c);
		T_SOFT(&nfail, rc == -EINVAL, "[%s]: got %d (%s), wanted %d (-EINVAL); detail \"%s\"",
		       t->name, rc, kvt_strerror(rc), -EINVAL, msg);
		for (int k = 0; k < 2 && t->needle[k]; k++)
			T_SOFT(&nfail, t_contains(msg, t->needle[k]),
			       "[%s]: detail \"%s\" does not name \"%s\"", t->name, msg, t->needle[k]);
		if (t->want_entry != -2)
			T_SOFT(&nfail, entry == t->want_entry,
			       "[%s]: kvt_last_error_entry got %d, wanted %d; detail \"%s\"", t->name,
			       entry, t->want_entry, msg);
		const long w = first_written(g_out, sizeof g_out);
		T_SOFT(&nfail, w < 0, "[%s]: out written at byte %ld (row %ld), wanted untouched",
		       t->name, w, w / (long)(QROW * sizeof(float)));
		expect_intact(f, t->name, &nfail);
	}
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
}

static void fx_setup(struct fx *f)
{
	fx_queries();
	f->c = make_cache();
	f->bare = make_cache();
	for (int i = 0; i < NS; i++) {
		uint32_t b;
		T_CHECK(kvt_seq_open(f->c, &f->s[i]) == 0 && kvt_seq_open(f->bare, &b) == 0,
			"open: %s", kvt_last_error(f->c));
		prefill(f->c, f->s[i], fx_len[i], 100 + i);
		prefill(f->bare, b, fx_len[i], 100 + i);
	}
	T_CHECK(kvt_seq_open(f->c, &f->closed) == 0, "open");
	prefill(f->c, f->closed, 30, 200);
	int rc = kvt_graph_reserve(f->c, SLOTS, MAXTOK, NULL);
	T_CHECK(rc == 0, "kvt_graph_reserve(5, 4096): %d (%s)", rc, kvt_last_error(f->c));
	T_CHECK(kvt_seq_close(f->c, f->closed) == 0, "close after the reservation: %s",
		kvt_last_error(f->c));
	good_batch(f);
	poison(g_base, sizeof g_base);
	rc = kvt_attend_graph(f->c, 0, &g_b, g_q, g_base, NULL);
	T_CHECK(rc == 0, "the good batch: %d (%s)", rc, kvt_last_error(f->c));
	/* the baseline itself: rows of kvt_attend, padded rows untouched */
	for (int i = 0; i < NS; i++) {
		rc = kvt_attend(f->c, 0, 1, &f->s[i], g_q + (size_t)i * QROW, g_ref, NULL);
		T_CHECK(rc == 0, "kvt_attend seq %u: %d (%s)", f->s[i], rc, kvt_last_error(f->c));
		T_CHECK(!memcmp(g_ref, g_base + (size_t)i * QROW, sizeof(float) * QROW),
			"the good batch: slot %d differs from kvt_attend of seq %u", i, f->s[i]);
	}
	T_CHECK(first_written(g_base + (size_t)NS * QROW, sizeof g_base - sizeof(float) * NS * QROW) < 0,
		"the good batch wrote a padded row");
}

static void fx_teardown(struct fx *f)
{
	kvt_cache_destroy(f->c);
	kvt_cache_destroy(f->bare);
}

static void test_bad_arguments(void **state)
{
	(void)state;
	const struct bad_case cases[] = {
		{"attend_graph, cache NULL", {"cache"}, b_null_cache, -2},
		{"attend_graph, batch NULL", {"batch"}, b_null_batch, -1},
		{"attend_graph, batch->seqs NULL", {"seqs"}, b_null_seqs, -1},
		{"attend_graph, q NULL", {"q is NULL"}, b_null_q, -1},
		{"attend_graph, out NULL", {"out is NULL"}, b_null_out, -1},
		{"attend_graph, pad 7", {"pad = 7"}, b_pad, -1},
		{"attend_graph, no reservation", {"kvt_graph_reserve", "reservation"}, b_unreserved, -1},
		{"attend_graph, n_slots 0", {"n_slots = 0"}, b_zero_slots, -1},
		{"attend_graph, n_slots 6 > max_slots 5", {"n_slots = 6", "5"}, b_many_slots, -1},
		{"attend_graph, layer 2", {"layer = 2", "n_layers = 2"}, b_layer, -1},
		{"reserve, cache NULL", {"cache"}, r_null, -2},
		{"reserve, max_slots 9 > max_seqs 8", {"max_slots = 9", "8"}, r_slots, -1},
		{"reserve, max_tokens 0", {"max_tokens = 0"}, r_tokens0, -1},
		{"reserve, max_tokens 2^24", {"max_tokens = 16777216", "16777215"}, r_tokens_big, -1},
	};
	struct fx f;
	fx_setup(&f);
	run_cases(&f, cases, sizeof cases / sizeof *cases);
	fx_teardown(&f);
}

static void test_slot_errors(void **state)
{
	(void)state;
	const struct bad_case cases[] = {
		{"seq closed after the reservation, slot 2", {"slot 2"}, s_closed, 2},
		{"seq 100000, slot 1", {"slot 1"}, s_huge, 1},
		{"seq 7 never opened, slot 0", {"slot 0"}, s_never, 0},
		{"s0 in slots 0 and 3", {"slot 3"}, s_repeat, 3},
		{"s2 in valid slots 0 and 3 (valid[])", {"slot 3"}, s_repeat_valid, 3},
		{"lengths[1] one more than held", {"slot 1"}, s_length, 1},
		{"lengths[2] = -1", {"slot 2"}, s_length_neg, 2},
		{"s1 longer than max_tokens 50, slot 2", {"slot 2", "max_tokens"}, s_too_long, 2},
	};
	struct fx f;
	fx_setup(&f);
	run_cases(&f, cases, sizeof cases / sizeof *cases);
	/* a padded slot is not checked: repeats, closed and unknown ids there are no error */
	good_batch(&f);
	g_b.valid = g_valid;
	g_seqs[3] = (int32_t)f.closed;
	g_seqs[4] = (int32_t)f.s[0];
	poison(g_out, sizeof g_out);
	int rc = AG(f.c, 0);
	T_CHECK(rc == 0, "padded slots holding a closed and a repeated seq: %d (%s)", rc,
		kvt_last_error(f.c));
	T_CHECK(!memcmp(g_out, g_base, sizeof g_out), "padded slots: rows differ from the baseline");
	fx_teardown(&f);
}

/* An error of the one kvt_attend over the valid slots (a NaN in the query of slot 3, the third
 * valid slot, after slot 0 and a padded slot): -EINVAL, kvt_last_error_entry the slot, a text that
 * names the slot beside the entry its own text names, one error counted; nothing of out written
 * and no step made (the call is all or nothing: before, the run of slot 0 was attended and
 * counted first); the good batch still gives the baseline's rows. */
static void test_attend_error(void **state)
{
	(void)state;
	struct fx f;
	fx_setup(&f);
	int nfail = 0;
	good_batch(&f);
	g_seqs[0] = (int32_t)f.s[0];
	g_seqs[1] = -1;
	g_seqs[2] = (int32_t)f.s[1];
	g_seqs[3] = (int32_t)f.s[2];
	g_seqs[4] = -1;
	static uint16_t q[8 * QROW];
	memcpy(q, g_q, sizeof q);
	q[3 * QROW + 1 * D + 5] = QNAN; /* slot 3, query head 1, element 5 */
	poison(g_out, sizeof g_out);
	kvt_stats st0 = {.size = sizeof st0}, st1 = {.size = sizeof st1};
	T_CHECK(kvt_get_stats(f.c, &st0) == 0, "kvt_get_stats");
	int rc = kvt_attend_graph(f.c, 0, &g_b, q, g_out, NULL);
	const char *msg = kvt_last_error(f.c);
	T_CHECK(kvt_get_stats(f.c, &st1) == 0, "kvt_get_stats");
	T_SOFT(&nfail, st1.errors == st0.errors + 1, "NaN in slot 3's query: %llu errors counted, "
	       "wanted 1", (unsigned long long)(st1.errors - st0.errors));
	T_SOFT(&nfail, rc == -EINVAL, "NaN in slot 3's query: got %d (%s), wanted -EINVAL; \"%s\"",
	       rc, kvt_strerror(rc), msg);
	T_SOFT(&nfail, kvt_last_error_entry(f.c) == 3,
	       "NaN in slot 3's query: kvt_last_error_entry %d, wanted 3; \"%s\"",
	       kvt_last_error_entry(f.c), msg);
	T_SOFT(&nfail, t_contains(msg, "slot 3") && t_contains(msg, "q[2, 1, 5]"),
	       "NaN in slot 3's query: the detail \"%s\" does not name slot 3 and its entry in the "
	       "kvt_attend of the 3 valid slots (q[2, 1, 5])", msg);
	T_SOFT(&nfail, first_written(g_out, sizeof(float) * 8 * QROW) < 0,
	       "NaN in slot 3's query: out was written (the valid slots are packed around the padded "
	       "ones and scattered back only on success)");
	T_SOFT(&nfail, st1.steps == st0.steps && st1.selected_tokens == st0.selected_tokens,
	       "NaN in slot 3's query: steps %llu -> %llu, selected_tokens %llu -> %llu: the valid "
	       "slots before it made their steps (one kvt_attend over the valid slots makes none)",
	       (unsigned long long)st0.steps, (unsigned long long)st1.steps,
	       (unsigned long long)st0.selected_tokens, (unsigned long long)st1.selected_tokens);
	expect_intact(&f, "after the NaN in slot 3", &nfail);
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
	fx_teardown(&f);
}

/* ---- equivalence over 200 decode steps ------------------------------------------------------ */

#define STEPS 200

static void test_equivalence(void **state)
{
	(void)state;
	static const uint32_t plen[NS] = {300, 700, 1100};
	kvt_cache *ca = make_cache(), *cb = make_cache();
	uint32_t sa[NS], sb[NS];
	for (int i = 0; i < NS; i++) {
		T_CHECK(kvt_seq_open(ca, &sa[i]) == 0 && kvt_seq_open(cb, &sb[i]) == 0, "open");
		prefill(ca, sa[i], plen[i], 300 + i);
		prefill(cb, sb[i], plen[i], 300 + i);
	}
	int rc = kvt_graph_reserve(cb, SLOTS, MAXTOK, NULL);
	T_CHECK(rc == 0, "reserve B: %d (%s)", rc, kvt_last_error(cb));
	rc = kvt_graph_reserve(ca, SLOTS, MAXTOK, NULL);
	T_CHECK(rc == 0, "reserve A: %d (%s)", rc, kvt_last_error(ca));
	uint32_t idx0[NL][NS];
	for (uint32_t l = 0; l < NL; l++)
		for (int i = 0; i < NS; i++)
			idx0[l][i] = cb->seqs[sb[i]].layers[l].n_indexed;

	/* slot -> sequence index (-1: padded) */
	static const int layout[SLOTS] = {2, -1, 0, 1, -1};
	static uint16_t qa[NS * QROW], qb[SLOTS * QROW];
	static float oa[NS * QROW], ob[SLOTS * QROW];
	int32_t seqs[SLOTS], lens[SLOTS];
	uint8_t valid[SLOTS];
	t_rng r;
	t_rng_seed(&r, 4242);
	uint64_t compared = 0;
	for (uint32_t step = 0; step < STEPS; step++) {
		for (uint32_t l = 0; l < NL; l++) {
			t_fill(&r, KVT_DTYPE_F16, (size_t)NS * ROW, 0.2, 1.0, g_k, NULL);
			t_fill(&r, KVT_DTYPE_F16, (size_t)NS * ROW, 0.0, 1.0, g_v, NULL);
			rc = kvt_append(ca, l, NS, sa, g_k, g_v, NULL);
			T_CHECK(rc == 0, "step %u layer %u: append A: %d (%s)", step, l, rc,
				kvt_last_error(ca));
			rc = kvt_append(cb, l, NS, sb, g_k, g_v, NULL);
			T_CHECK(rc == 0, "step %u layer %u: append B: %d (%s)", step, l, rc,
				kvt_last_error(cb));
		}
		const int by_valid = step & 1, with_lens = (step / 2) % 3 != 0;
		kvt_graph_batch b = {SLOTS, 0, seqs, with_lens ? lens : NULL, by_valid ? valid : NULL};
		for (uint32_t l = 0; l < NL; l++) {
			t_fill(&r, KVT_DTYPE_F16, (size_t)NS * QROW, 0.3, 1.0, qa, NULL);
			for (int j = 0; j < SLOTS; j++) {
				const int i = layout[j];
				if (i < 0) {
					seqs[j] = by_valid ? 12345 : -1;
					lens[j] = 777;
					valid[j] = 0;
					for (int x = 0; x < QROW; x++)
						qb[(size_t)j * QROW + x] = QNAN;
					continue;
				}
				seqs[j] = (int32_t)sb[i];
				lens[j] = (int32_t)kvt_seq_length(cb, sb[i], l);
				valid[j] = (uint8_t)(1 + j); /* any non-zero value is valid */
				memcpy(qb + (size_t)j * QROW, qa + (size_t)i * QROW, sizeof(uint16_t) * QROW);
			}
			poison(oa, sizeof oa);
			poison(ob, sizeof ob);
			rc = kvt_attend(ca, l, NS, sa, qa, oa, NULL);
			T_CHECK(rc == 0, "step %u layer %u: kvt_attend A: %d (%s)", step, l, rc,
				kvt_last_error(ca));
			rc = kvt_attend_graph(cb, l, &b, qb, ob, NULL);
			T_CHECK(rc == 0, "step %u layer %u (%s padding, lengths %s): kvt_attend_graph B: "
				"%d (%s), entry %d", step, l, by_valid ? "valid[]" : "seqs < 0",
				with_lens ? "given" : "NULL", rc, kvt_last_error(cb),
				kvt_last_error_entry(cb));
			for (int j = 0; j < SLOTS; j++) {
				const int i = layout[j];
				const float *got = ob + (size_t)j * QROW;
				if (i < 0) {
					const long w = first_written(got, sizeof(float) * QROW);
					T_CHECK(w < 0, "step %u layer %u: padded slot %d written at byte %ld",
						step, l, j, w);
					continue;
				}
				const float *want = oa + (size_t)i * QROW;
				for (int x = 0; x < QROW; x++)
					T_CHECK(!memcmp(&got[x], &want[x], sizeof(float)),
						"step %u layer %u (%s padding, lengths %s): slot %d (seq %d) "
						"element %d got %.9g (0x%08x), wanted %.9g (0x%08x) of "
						"kvt_attend, bit for bit", step, l,
						by_valid ? "valid[]" : "seqs < 0",
						with_lens ? "given" : "NULL", j, i, x, got[x], t_fbits(got[x]),
						want[x], t_fbits(want[x]));
				compared++;
			}
		}
	}
	/* the window flushed into the index during the steps, and the lengths grew as appended */
	for (uint32_t l = 0; l < NL; l++)
		for (int i = 0; i < NS; i++) {
			const uint32_t idx = cb->seqs[sb[i]].layers[l].n_indexed;
			T_CHECK(idx > idx0[l][i], "layer %u seq %d: n_indexed %u, %u before the steps: no "
				"window flush happened", l, i, idx, idx0[l][i]);
			T_CHECK(kvt_seq_length(cb, sb[i], l) == (int64_t)(plen[i] + STEPS),
				"layer %u seq %d: length %lld, wanted %u", l, i,
				(long long)kvt_seq_length(cb, sb[i], l), plen[i] + STEPS);
		}
	T_CHECK(compared == (uint64_t)STEPS * NL * NS, "compared %llu rows",
		(unsigned long long)compared);
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

/* ---- dropping the reservation --------------------------------------------------------------- */

static void test_reserve_drop(void **state)
{
	(void)state;
	struct fx f;
	fx_setup(&f);
	int rc = kvt_graph_reserve(f.c, 0, 0, NULL);
	T_CHECK(rc == 0, "kvt_graph_reserve(0, 0): %d (%s)", rc, kvt_last_error(f.c));
	good_batch(&f);
	poison(g_out, sizeof g_out);
	rc = AG(f.c, 0);
	T_CHECK(rc == -EINVAL, "kvt_attend_graph after the reservation was dropped: got %d (%s), "
		"wanted -EINVAL", rc, kvt_last_error(f.c));
	T_CHECK(t_contains(kvt_last_error(f.c), "reservation"),
		"detail \"%s\" does not name the reservation", kvt_last_error(f.c));
	T_CHECK(first_written(g_out, sizeof g_out) < 0, "out written by the refused call");
	/* kvt_attend does not need it */
	rc = kvt_attend(f.c, 0, 1, &f.s[0], g_q, g_ref, NULL);
	T_CHECK(rc == 0 && !memcmp(g_ref, g_base, sizeof(float) * QROW),
		"kvt_attend without a reservation: %d (%s) or other rows", rc, kvt_last_error(f.c));
	/* the largest max_tokens is accepted, and a new reservation works again */
	rc = kvt_graph_reserve(f.c, SLOTS, (1u << 24) - 1, NULL);
	T_CHECK(rc == 0, "kvt_graph_reserve(5, 2^24 - 1): %d (%s)", rc, kvt_last_error(f.c));
	rc = kvt_graph_reserve(f.c, SLOTS, MAXTOK, NULL);
	T_CHECK(rc == 0, "kvt_graph_reserve(5, 4096): %d (%s)", rc, kvt_last_error(f.c));
	int nfail = 0;
	expect_intact(&f, "reserved again", &nfail);
	T_CHECK(nfail == 0, "reserved again: the good batch failed");
	fx_teardown(&f);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_bad_arguments),
		cmocka_unit_test(test_slot_errors),
		cmocka_unit_test(test_attend_error),
		cmocka_unit_test(test_equivalence),
		cmocka_unit_test(test_reserve_drop),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
