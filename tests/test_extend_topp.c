/* SPDX-License-Identifier: MIT */
/*
 * kvt_extend with KVT_EXTEND_TOPP (Top-p per query row) on the CPU backend: each entry's last row
 * bit for bit kvt_attend of its query (also with score corrections recorded, or a selection kept
 * (keep_weight), by earlier decode steps, which change the rows against a twin without them),
 * p = 1 equal to exact attention, every row equal to an oracle built from one-token prefills and
 * kvt_attend (with its selection counters), and later tokens of the chunk masked out of an earlier
 * row's selection. The shape, the streams and the calls: extend_util.h.
 */
#include "extend_util.h"

static kvt_config topp_config(uint32_t dtype, float p, uint32_t window, uint32_t bmin,
			      uint32_t bmax)
{
	kvt_config cfg = config(dtype, dtype == KVT_DTYPE_F16 ? KVT_DTYPE_F32 : dtype, p);
	cfg.window = window;
	cfg.budget_min = bmin;
	cfg.budget_max = bmax;
	return cfg;
}

/* The selection counters of kvt_stats. */
struct sel_stats {
	uint64_t steps, candidates, selected, max_hits, min_hits, rows;
};

static struct sel_stats sel_stats(kvt_cache *c)
{
	kvt_stats st = t_stats(c);
	return (struct sel_stats){st.steps, st.candidate_tokens, st.selected_tokens,
				  st.budget_max_hits, st.budget_min_hits, st.rows_fetched};
}

static struct sel_stats sel_delta(struct sel_stats a, struct sel_stats b)
{
	return (struct sel_stats){b.steps - a.steps, b.candidates - a.candidates,
				  b.selected - a.selected, b.max_hits - a.max_hits,
				  b.min_hits - a.min_hits, b.rows - a.rows};
}

/* Each entry's last row equals kvt_attend of that query row right after the call, bit for bit. */
static void test_topp_last_row(void **state)
{
	(void)state;
	static const uint32_t pre[NS] = {40, 0, 300, 7};
	static const uint32_t seqs[NS] = {2, 0, 3, 1}, n[NS] = {37, 50, 0, 1};
	const kvt_config cfgs[] = {topp_config(KVT_DTYPE_F16, 0.9f, 16, 8, 0),
				   topp_config(KVT_DTYPE_BF16, 0.5f, 16, KVT_NONE, 24)};
	for (uint32_t ci = 0; ci < 2; ci++) {
		make_streams(cfgs[ci].dtype, 0x709 + ci);
		kvt_cache *a = make_cache(&cfgs[ci]), *b = make_cache(&cfgs[ci]);
		for (uint32_t s = 0; s < NS; s++)
			for (kvt_cache *c = a; pre[s] && c; c = c == a ? b : NULL)
				prefill(c, s, pre[s]);
		uint8_t *oa = t_alloc(out_bytes(a, 88)), *ob = t_alloc(out_bytes(a, 88));
		uint8_t *o2 = t_alloc(out_bytes(a, NS));
		const struct sel_stats s0 = sel_stats(a);
		extend_ok_flags(a, NS, seqs, n, oa, KVT_EXTEND_TOPP);
		const struct sel_stats d = sel_delta(s0, sel_stats(a));
		extend_ok(b, NS, seqs, n, ob);
		T_CHECK(d.steps == 88 && d.selected < d.candidates && memcmp(oa, ob, out_bytes(a, 88)),
			"config %u: Top-p selected %llu of %llu candidates over %llu steps, outputs %s "
			"the exact ones: the test would not tell Top-p from exact", ci,
			(unsigned long long)d.selected, (unsigned long long)d.candidates,
			(unsigned long long)d.steps, memcmp(oa, ob, out_bytes(a, 88)) ? "differ from" : "equal");
		uint32_t last[NS], m = 0, row = 0;
		for (uint32_t i = 0; i < NS; row += n[i], i++) {
			if (!n[i])
				continue;
			const uint32_t s = seqs[i];
			memcpy(g_bq + (size_t)m * QROW, g_q[s] + (size_t)(len_of(a, s) - 1) * QROW,
			       2ull * QROW);
			last[m++] = row + n[i] - 1;
		}
		static const uint32_t busy[] = {2, 0, 1};
		T_CHECK(kvt_attend(a, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(a));
		for (uint32_t i = 0; i < m; i++)
			T_CHECK(!memcmp(oa + out_bytes(a, last[i]), o2 + out_bytes(a, i), out_bytes(a, 1)),
				"config %u, seq %u: the last row (%u) differs from kvt_attend of its query",
				ci, busy[i], last[i]);
		free(oa);
		free(ob);
		free(o2);
		kvt_cache_destroy(a);
		kvt_cache_destroy(b);
	}
}

/* With score corrections on (correction_steps), or the selection's hysteresis (keep_weight), a
 * Top-p row still selects as the kvt_attend after it does: each entry's last row equals kvt_attend
 * of that query right after the call, bit for bit, after decode steps that recorded corrections or
 * kept a selection; and the option changed the outputs (against a twin cache without it). */
static void topp_after_steps(uint32_t R, float w, const char *what)
{
	static const uint32_t all[NS] = {0, 1, 2, 3};
	static const uint32_t seqs[NS] = {2, 0, 3, 1}, n[NS] = {5, 3, 1, 0};
	kvt_config cfg = topp_config(KVT_DTYPE_F16, 0.8f, 16, 8, 0);
	cfg.correction_steps = R;
	cfg.keep_weight = w;
	make_streams(cfg.dtype, 0x70c);
	kvt_cache *a = make_cache(&cfg);
	cfg.correction_steps = 0;
	cfg.keep_weight = 0.0f;
	kvt_cache *z = make_cache(&cfg);
	uint8_t *oa = t_alloc(out_bytes(a, 9)), *oz = t_alloc(out_bytes(a, 9));
	uint8_t *o2 = t_alloc(out_bytes(a, NS));
	bool changed = false;
	for (uint32_t s = 0; s < NS; s++) {
		prefill(a, s, 300);
		prefill(z, s, 300);
	}
	for (uint32_t round = 0; round < 3; round++) {
		for (uint32_t k = 0; k < 3; k++) {
			decode(a, NS, all, o2);
			decode(z, NS, all, o2);
		}
		extend_ok_flags(a, NS, seqs, n, oa, KVT_EXTEND_TOPP);
		extend_ok_flags(z, NS, seqs, n, oz, KVT_EXTEND_TOPP);
		changed |= memcmp(oa, oz, out_bytes(a, 9)) != 0;
		uint32_t busy[NS], last[NS], m = 0, row = 0;
		for (uint32_t i = 0; i < NS; row += n[i], i++) {
			if (!n[i])
				continue;
			memcpy(g_bq + (size_t)m * QROW,
			       g_q[seqs[i]] + (size_t)(len_of(a, seqs[i]) - 1) * QROW, 2ull * QROW);
			busy[m] = seqs[i];
			last[m++] = row + n[i] - 1;
		}
		T_CHECK(kvt_attend(a, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(a));
		for (uint32_t i = 0; i < m; i++)
			T_CHECK(!memcmp(oa + out_bytes(a, last[i]), o2 + out_bytes(a, i),
					out_bytes(a, 1)),
				"%s, round %u, seq %u: the last row (%u) differs from kvt_attend of "
				"its query", what, round, busy[i], last[i]);
		/* the twin's step without the option, so both stay at the same selection count */
		T_CHECK(kvt_attend(z, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(z));
	}
	T_CHECK(changed, "%s never changed a Top-p row's output: the test proves nothing", what);
	free(oa);
	free(oz);
	free(o2);
	kvt_cache_destroy(a);
	kvt_cache_destroy(z);
}

static void test_topp_corrected(void **state)
{
	(void)state;
	topp_after_steps(4, 0.0f, "corrections");
	topp_after_steps(0, 8.0f, "keep_weight");
}

/* At p = 1 with no budget_max, every indexed token up to a row is selected: the exact outputs. */
static void test_topp_p1(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0x9e1);
	const kvt_config cfg = topp_config(KVT_DTYPE_F16, 1.0f, 16, KVT_DEFAULT_BUDGET_MIN, 0);
	kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg);
	static const uint32_t seqs[3] = {0, 1, 2};
	static const uint32_t chunks[][3] = {{37, 3, 300}, {1, 90, 2}, {200, 0, 17}};
	for (uint32_t k = 0; k < 3; k++) {
		uint32_t total = chunks[k][0] + chunks[k][1] + chunks[k][2];
		uint8_t *oa = t_alloc(out_bytes(a, total)), *ob = t_alloc(out_bytes(a, total));
		extend_ok_flags(a, 3, seqs, chunks[k], oa, KVT_EXTEND_TOPP);
		extend_ok(b, 3, seqs, chunks[k], ob);
		for (uint32_t j = 0; j < total; j++)
			T_CHECK(!memcmp(oa + out_bytes(a, j), ob + out_bytes(a, j), out_bytes(a, 1)),
				"batch %u, row %u: Top-p at p = 1 differs from exact attention", k, j);
		free(oa);
		free(ob);
	}
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/*
 * Every row against an oracle. Without a window every token past the sinks is indexed, so row j
 * of a chunk selects among exactly what a cache holding the tokens up to it has indexed: the same
 * history, the chunk's rows prefilled one at a time and each attended by its query. The selection
 * counters match too (a Top-p row counts as a step).
 */
static void test_topp_oracle(void **state)
{
	(void)state;
	const kvt_config cfgs[] = {topp_config(KVT_DTYPE_F16, 0.9f, KVT_NONE, 8, 0),
				   topp_config(KVT_DTYPE_F16, 0.9f, KVT_NONE, KVT_NONE, 30)};
	const uint32_t s = 1, n = 60;
	for (uint32_t ci = 0; ci < 2; ci++) {
		make_streams(KVT_DTYPE_F16, 0x0ac1e + ci);
		kvt_cache *a = make_cache(&cfgs[ci]), *b = make_cache(&cfgs[ci]);
		prefill(a, s, 200);
		prefill(b, s, 200);
		float *oa = t_alloc(out_bytes(a, n)), ob[QROW];
		const struct sel_stats a0 = sel_stats(a), b0 = sel_stats(b);
		extend_ok_flags(a, 1, &s, &n, oa, KVT_EXTEND_TOPP);
		for (uint32_t j = 0; j < n; j++) {
			prefill(b, s, 1);
			T_CHECK(kvt_attend(b, LAYER, 1, &s, g_q[s] + (size_t)(200 + j) * QROW, ob, NULL) == 0,
				"attend: %s", kvt_last_error(b));
			T_CHECK(!memcmp(oa + (size_t)j * QROW, ob, sizeof ob),
				"config %u, row %u (position %u): Top-p extend differs from the oracle", ci,
				j, 200 + j);
		}
		const struct sel_stats da = sel_delta(a0, sel_stats(a)), db = sel_delta(b0, sel_stats(b));
		T_CHECK(!memcmp(&da, &db, sizeof da) && da.selected < da.candidates &&
				(ci == 0 || da.max_hits > 0),
			"config %u: counters (steps, candidates, selected, max hits, min hits, rows) "
			"got %llu %llu %llu %llu %llu %llu, wanted %llu %llu %llu %llu %llu %llu", ci,
			(unsigned long long)da.steps, (unsigned long long)da.candidates,
			(unsigned long long)da.selected, (unsigned long long)da.max_hits,
			(unsigned long long)da.min_hits, (unsigned long long)da.rows,
			(unsigned long long)db.steps, (unsigned long long)db.candidates,
			(unsigned long long)db.selected, (unsigned long long)db.max_hits,
			(unsigned long long)db.min_hits, (unsigned long long)db.rows);
		free(oa);
		kvt_cache_destroy(a);
		kvt_cache_destroy(b);
	}
}

/*
 * Masking: later tokens of the chunk, indexed, with huge keys aligned with an early row's queries,
 * leave that row and every row before it unchanged (they are not scored for it), while they do
 * change the last row.
 */
static void test_topp_masking(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0x3a5c);
	const kvt_config cfg = topp_config(KVT_DTYPE_F16, 0.9f, 16, 8, 0);
	const uint32_t s = 1, n = 80, j0 = 30, first = 200, G = HQ / HKV;
	kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg);
	prefill(a, s, first);
	prefill(b, s, first);
	uint8_t *oa = t_alloc(out_bytes(a, n)), *ob = t_alloc(out_bytes(a, n));
	extend_ok_flags(a, 1, &s, &n, oa, KVT_EXTEND_TOPP);
	uint16_t *keep = t_alloc(2ull * n * KROW);
	memcpy(keep, g_k[s] + (size_t)first * KROW, 2ull * n * KROW);
	for (uint32_t j = j0 + 1; j < n; j++)
		for (uint32_t h = 0; h < HKV; h++)
			for (uint32_t e = 0; e < D; e++) {
				float qe = t_dec(g_dtype, g_q[s][((size_t)(first + j0) * HQ + h * G) * D + e]);
				g_k[s][((size_t)(first + j) * HKV + h) * D + e] = t_enc(g_dtype, 8.0f * qe);
			}
	extend_ok_flags(b, 1, &s, &n, ob, KVT_EXTEND_TOPP);
	memcpy(g_k[s] + (size_t)first * KROW, keep, 2ull * n * KROW);
	T_CHECK(b->seqs[s].layers[LAYER].n_indexed > first + j0 + 1 - cfg.n_sink,
		"the huge keys are not indexed (%u indexed): the test would prove nothing",
		b->seqs[s].layers[LAYER].n_indexed);
	for (uint32_t j = 0; j <= j0; j++)
		T_CHECK(!memcmp(oa + out_bytes(a, j), ob + out_bytes(a, j), out_bytes(a, 1)),
			"row %u (position %u): changed by keys at positions > %u", j, first + j,
			first + j0);
	T_CHECK(memcmp(oa + out_bytes(a, n - 1), ob + out_bytes(a, n - 1), out_bytes(a, 1)),
		"the last row did not change: the huge keys had no effect, the test proves nothing");
	free(keep);
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/*
 * An entry without new tokens is left untouched, its selection included: after a decode step of
 * both sequences, a Top-p extend of the first alone (the second's entry empty) leaves the second's
 * selection readable by kvt_gather with the same counts, and drops the first's. (Before, every
 * entry's selection was dropped.)
 */
static void test_topp_empty_entry(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0x3a5d);
	const kvt_config cfg = topp_config(KVT_DTYPE_F16, 0.9f, 16, 8, 0);
	const uint32_t seqs[2] = {0, 1}, n[2] = {5, 0};
	kvt_cache *c = make_cache(&cfg);
	prefill(c, 0, 120);
	prefill(c, 1, 150);
	uint8_t *o = t_alloc(out_bytes(c, 8));
	decode(c, 2, seqs, o);
	int32_t before[HKV], after[HKV];
	int rc = kvt_gather(c, LAYER, 1, &seqs[1], MAXT, before, NULL, NULL, NULL, NULL);
	T_CHECK(rc > 0, "gather of seq 1 after the decode step: %d (%s)", rc, kvt_last_error(c));
	extend_ok_flags(c, 2, seqs, n, o, KVT_EXTEND_TOPP);
	rc = kvt_gather(c, LAYER, 1, &seqs[1], MAXT, after, NULL, NULL, NULL, NULL);
	T_CHECK(rc > 0 && !memcmp(before, after, sizeof before),
		"gather of seq 1, the empty entry, after the Top-p extend: %d (%s), counts %s; wanted "
		"its selection kept", rc, rc < 0 ? kvt_last_error(c) : "", rc > 0 ? "changed" : "-");
	rc = kvt_gather(c, LAYER, 1, &seqs[0], MAXT, after, NULL, NULL, NULL, NULL);
	T_CHECK(rc == -EINVAL, "gather of seq 0, which got 5 rows: %d, wanted -EINVAL (its selection "
		"dropped)", rc);
	free(o);
	kvt_cache_destroy(c);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_topp_last_row), cmocka_unit_test(test_topp_corrected),
		cmocka_unit_test(test_topp_p1),       cmocka_unit_test(test_topp_oracle),
		cmocka_unit_test(test_topp_masking),  cmocka_unit_test(test_topp_empty_entry),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
