/* SPDX-License-Identifier: MIT */
/*
 * kvt_last_error_entry (issue 13's per-sequence status) on the CPU backend: a batch call that fails
 * because of one sequence names that entry of its `seqs`, changes nothing, and the same call without
 * that entry succeeds; an error of the whole call names none (-1). Cases: a sequence not open, a
 * sequence twice, an empty sequence, a non-finite key (kvt_append) and query (kvt_attend,
 * kvt_select), a non-finite key and query in a varlen kvt_extend (the entry whose rows hold it),
 * kvt_gather's max_tokens and a missing selection; -1 for a bad layer, a prefill's non-finite key and
 * a fresh cache. Then kvt_seq_status: a sequence put in error (as the CUDA backend does when its
 * kernels find a non-finite score of one of its queries) fails every call that would compute with or
 * store into it, naming it, and nothing else; truncation and closing clear it; so does one found
 * by the pipeline's own check after the call's (test_status_late).
 */
#include "common.h"
#include "internal.h"

enum { L = 1, HQ = 4, HKV = 2, D = 64, NS = 4, T = 300 };

static uint16_t g_k[T * HKV * D], g_v[T * HKV * D], g_q[T * HQ * D];

static kvt_cache *make(uint32_t *ids)
{
	kvt_config cfg = t_config(L, HQ, HKV, D, KVT_DTYPE_F16);
	kvt_cache *c = t_create(&cfg);
	t_rng r;
	t_rng_seed(&r, 11);
	t_fill(&r, KVT_DTYPE_F16, (size_t)T * HKV * D, 0.0, 1.0, g_k, NULL);
	t_fill(&r, KVT_DTYPE_F16, (size_t)T * HKV * D, 0.0, 1.0, g_v, NULL);
	t_fill(&r, KVT_DTYPE_F16, (size_t)T * HQ * D, 0.0, 1.0, g_q, NULL);
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(kvt_seq_open(c, &ids[s]) == 0, "open: %s", kvt_last_error(c));
		if (s < NS - 1) /* the last one stays empty */
			T_CHECK(kvt_prefill(c, ids[s], 0, g_q, g_k, g_v, T - 10 * s, NULL) == 0,
				"prefill: %s", kvt_last_error(c));
	}
	return c;
}

/* rc is the failure wanted, naming entry `entry`; the call changed no length. */
static void want(kvt_cache *c, const uint32_t *ids, int rc, int code, int entry, const char *what)
{
	T_CHECK(rc == code, "%s: rc %d, wanted %d (%s)", what, rc, code, kvt_last_error(c));
	T_CHECK(kvt_last_error_entry(c) == entry, "%s: entry %d, wanted %d (%s)", what,
		kvt_last_error_entry(c), entry, kvt_last_error(c));
	for (uint32_t s = 0; s < NS - 1; s++)
		T_CHECK(kvt_seq_length(c, ids[s], 0) == T - 10 * s, "%s: seq %u has %lld tokens",
			what, s, (long long)kvt_seq_length(c, ids[s], 0));
}

static void test_entries(void **state)
{
	(void)state;
	uint32_t ids[NS];
	kvt_cache *c = make(ids);
	T_CHECK(kvt_last_error_entry(c) == -1, "a fresh cache names entry %d",
		kvt_last_error_entry(c));
	T_CHECK(kvt_last_error_entry(NULL) == -1, "NULL names an entry");
	static float out[NS * HQ * D];
	uint16_t k[NS * HKV * D], v[NS * HKV * D], q[NS * HQ * D];
	memcpy(k, g_k, sizeof k);
	memcpy(v, g_v, sizeof v);
	memcpy(q, g_q, sizeof q);

	/* a sequence not open, then twice in the batch */
	uint32_t b[3] = {ids[0], 77, ids[1]};
	want(c, ids, kvt_attend(c, 0, 3, b, q, out, NULL), -ENOENT, 1, "seq not open");
	b[1] = ids[0];
	want(c, ids, kvt_append(c, 0, 3, b, k, v, NULL), -EINVAL, 1, "seq twice");
	/* the empty sequence */
	uint32_t e[2] = {ids[1], ids[NS - 1]};
	want(c, ids, kvt_attend(c, 0, 2, e, q, out, NULL), -EINVAL, 1, "empty seq");
	/* a non-finite key of entry 2, then a non-finite query of entry 1 */
	uint32_t three[3] = {ids[0], ids[1], ids[2]};
	k[2 * HKV * D + 5] = 0x7e00;
	want(c, ids, kvt_append(c, 0, 3, three, k, v, NULL), -EINVAL, 2, "NaN key");
	k[2 * HKV * D + 5] = g_k[2 * HKV * D + 5];
	q[1 * HQ * D + 3 * D + 7] = 0x7c00; /* +inf */
	want(c, ids, kvt_attend(c, 0, 3, three, q, out, NULL), -EINVAL, 1, "inf query");
	want(c, ids, kvt_select(c, 0, 3, three, q, NULL), -EINVAL, 1, "inf query (select)");
	/* the same calls without the bad entry succeed */
	uint32_t two[2] = {ids[0], ids[2]};
	uint16_t q2[2 * HQ * D];
	memcpy(q2, q, sizeof(uint16_t) * HQ * D);
	memcpy(q2 + HQ * D, q + 2 * HQ * D, sizeof(uint16_t) * HQ * D);
	T_CHECK(kvt_attend(c, 0, 2, two, q2, out, NULL) == 0, "without the bad entry: %s",
		kvt_last_error(c));
	q[1 * HQ * D + 3 * D + 7] = g_q[1 * HQ * D + 3 * D + 7];
	/* kvt_gather: entry 1 has no selection (entry 0 has one), then max_tokens too small */
	int32_t counts[NS * HKV];
	want(c, ids, kvt_gather(c, 0, 2, (uint32_t[]){ids[0], ids[1]}, 4096, counts, NULL, NULL,
				NULL, NULL),
	     -EINVAL, 1, "no selection");
	T_CHECK(kvt_select(c, 0, 2, two, q2, NULL) > 0, "select: %s", kvt_last_error(c));
	want(c, ids, kvt_gather(c, 0, 2, two, 1, counts, NULL, NULL, NULL, NULL), -EINVAL, 0,
	     "max_tokens");
	/* kvt_extend, varlen [3, 0, 4]: a NaN key in the third entry's rows, a NaN query in the
	 * first's */
	uint32_t cu[4] = {0, 3, 3, 7};
	static uint16_t ek[7 * HKV * D], ev[7 * HKV * D], eq[7 * HQ * D];
	static float eout[7 * HQ * D];
	memcpy(ek, g_k, sizeof ek);
	memcpy(ev, g_v, sizeof ev);
	memcpy(eq, g_q, sizeof eq);
	ek[5 * HKV * D] = 0x7e00; /* row 5: the entry [3, 7) */
	want(c, ids, kvt_extend(c, 0, 3, three, cu, eq, ek, ev, eout, 0, NULL), -EINVAL, 2,
	     "extend NaN key");
	ek[5 * HKV * D] = g_k[5 * HKV * D];
	eq[2 * HQ * D] = 0x7e00; /* row 2: the entry [0, 3) */
	want(c, ids, kvt_extend(c, 0, 3, three, cu, eq, ek, ev, eout, 0, NULL), -EINVAL, 0,
	     "extend NaN query");
	/* errors of the whole call, or of a call without a batch */
	want(c, ids, kvt_attend(c, 5, 2, two, q2, out, NULL), -EINVAL, -1, "bad layer");
	k[0] = 0x7e00;
	want(c, ids, kvt_prefill(c, ids[NS - 1], 0, NULL, k, v, 1, NULL), -EINVAL, -1,
	     "prefill NaN key");
	kvt_cache_destroy(c);
}

/*
 * A step that fails at entry 1's non-finite score, after entry 0's selection was made, counts
 * nothing but the error (kvtier.h: a failed call changes no counter but `errors`): no selected
 * tokens, budget hits or fetched rows of entry 0. A bf16 cache, so that a finite query (1e37) is
 * too large for the estimate.
 */
static void test_failed_step_counts_nothing(void **state)
{
	(void)state;
	kvt_config cfg = t_config(L, HQ, HKV, D, KVT_DTYPE_BF16);
	cfg.budget_min = 2;
	cfg.budget_max = 3;
	kvt_cache *c = t_create(&cfg);
	static uint16_t k[T * HKV * D], v[T * HKV * D], q[2 * HQ * D];
	t_rng r;
	t_rng_seed(&r, 12);
	t_fill(&r, KVT_DTYPE_BF16, (size_t)T * HKV * D, 0.0, 1.0, k, NULL);
	t_fill(&r, KVT_DTYPE_BF16, (size_t)T * HKV * D, 0.0, 1.0, v, NULL);
	t_fill(&r, KVT_DTYPE_BF16, (size_t)2 * HQ * D, 0.0, 1.0, q, NULL);
	uint32_t s[2];
	for (int i = 0; i < 2; i++) {
		T_CHECK(kvt_seq_open(c, &s[i]) == 0, "open: %s", kvt_last_error(c));
		T_CHECK(kvt_prefill(c, s[i], 0, NULL, k, v, T, NULL) == 0, "prefill: %s",
			kvt_last_error(c));
	}
	for (uint32_t j = 0; j < HQ * D; j++)
		q[HQ * D + j] = t_f2bf(j & 1 ? 1e37f : -1e37f);
	static float out[2 * HQ * D];
	for (int call = 0; call < 2; call++) {
		const kvt_stats a = t_stats(c);
		const int rc = call ? kvt_select(c, 0, 2, s, q, NULL)
				    : kvt_attend(c, 0, 2, s, q, out, NULL);
		const kvt_stats b = t_stats(c);
		const char *what = call ? "select" : "attend";
		T_CHECK(rc == -EINVAL && kvt_last_error_entry(c) == 1, "%s: rc %d entry %d (%s), "
			"wanted -EINVAL naming entry 1", what, rc, kvt_last_error_entry(c),
			kvt_last_error(c));
		T_CHECK(b.errors == a.errors + 1 && b.steps == a.steps &&
				b.selected_tokens == a.selected_tokens &&
				b.candidate_tokens == a.candidate_tokens &&
				b.budget_max_hits == a.budget_max_hits &&
				b.budget_min_hits == a.budget_min_hits &&
				b.rows_fetched == a.rows_fetched &&
				b.bytes_fetched == a.bytes_fetched,
			"failed %s: errors +%llu, steps +%llu, selected_tokens +%llu, "
			"budget_max_hits +%llu, rows_fetched +%llu; wanted errors +1 and nothing "
			"else", what, (unsigned long long)(b.errors - a.errors),
			(unsigned long long)(b.steps - a.steps),
			(unsigned long long)(b.selected_tokens - a.selected_tokens),
			(unsigned long long)(b.budget_max_hits - a.budget_max_hits),
			(unsigned long long)(b.rows_fetched - a.rows_fetched));
	}
	kvt_cache_destroy(c);
}

/* The status of seq: code and text (the text must contain `has`, "" for none). */
static void status_is(kvt_cache *c, uint32_t seq, int code, const char *has)
{
	int st = 1;
	char text[256];
	T_CHECK(kvt_seq_status(c, seq, &st, text, sizeof text) == 0, "status: %s",
		kvt_last_error(c));
	T_CHECK(st == code && (*has ? strstr(text, has) != NULL : !*text),
		"seq %u: status %d (%s), wanted %d (%s)", seq, st, text, code, has);
}

static void test_status(void **state)
{
	(void)state;
	uint32_t ids[NS];
	kvt_cache *c = make(ids);
	static float out[NS * HQ * D];
	uint16_t k[NS * HKV * D], v[NS * HKV * D];
	memcpy(k, g_k, sizeof k);
	memcpy(v, g_v, sizeof v);
	int st = 0;
	char text[8];
	/* bad arguments */
	T_CHECK(kvt_seq_status(NULL, ids[0], &st, NULL, 0) == -EINVAL, "NULL cache");
	T_CHECK(kvt_seq_status(c, ids[0], NULL, NULL, 0) == -EINVAL, "NULL status");
	T_CHECK(kvt_seq_status(c, ids[0], &st, NULL, 4) == -EINVAL, "NULL text with a size");
	T_CHECK(kvt_seq_status(c, 77, &st, text, sizeof text) == -ENOENT, "not open");
	status_is(c, ids[1], 0, "");
	/* seq 1 in error: the text is truncated to the caller's buffer */
	kvt_seq_set_status(c, ids[1], -EINVAL, "a non-finite score at step %u", 7u);
	kvt_seq_set_status(c, ids[1], -EIO, "a second error"); /* the first one sticks */
	status_is(c, ids[1], -EINVAL, "non-finite score at step 7");
	T_CHECK(kvt_seq_status(c, ids[1], &st, text, sizeof text) == 0 && st == -EINVAL &&
			strlen(text) == sizeof text - 1, "truncated text: %d '%s'", st, text);
	status_is(c, ids[0], 0, "");
	/* every call that would compute with it fails, naming it; the others go on */
	uint32_t three[3] = {ids[0], ids[1], ids[2]}, two[2] = {ids[0], ids[2]};
	want(c, ids, kvt_append(c, 0, 3, three, k, v, NULL), -EINVAL, 1, "append, seq in error");
	T_CHECK(strstr(kvt_last_error(c), "non-finite score at step 7") != NULL, "text: %s",
		kvt_last_error(c));
	want(c, ids, kvt_attend(c, 0, 3, three, g_q, out, NULL), -EINVAL, 1, "attend");
	want(c, ids, kvt_select(c, 0, 3, three, g_q, NULL), -EINVAL, 1, "select");
	uint32_t cu[4] = {0, 1, 2, 3};
	want(c, ids, kvt_extend(c, 0, 3, three, cu, g_q, k, v, out, 0, NULL), -EINVAL, 1, "extend");
	want(c, ids, kvt_prefill(c, ids[1], 0, NULL, k, v, 1, NULL), -EINVAL, -1, "prefill");
	want(c, ids, kvt_seq_write_rows(c, ids[1], 0, T - 10, T - 9, k, v, NULL), -EINVAL, -1,
	     "write_rows");
	uint32_t child = 0;
	want(c, ids, kvt_seq_fork(c, ids[1], &child, NULL), -EINVAL, -1, "fork");
	T_CHECK(kvt_append(c, 0, 2, two, k, v, NULL) == 0, "the others: %s", kvt_last_error(c));
	T_CHECK(kvt_attend(c, 0, 2, two, g_q, out, NULL) == 0, "the others: %s",
		kvt_last_error(c));
	/* reading its rows still works */
	static uint16_t rk[HKV * D], rv[HKV * D];
	T_CHECK(kvt_seq_read_rows(c, ids[1], 0, 0, 1, rk, rv, NULL) == 1, "read: %s",
		kvt_last_error(c));
	/* a truncation of one token clears it */
	T_CHECK(kvt_seq_truncate(c, ids[1], 1, NULL) == 0, "truncate: %s", kvt_last_error(c));
	status_is(c, ids[1], 0, "");
	T_CHECK(kvt_attend(c, 0, 3, three, g_q, out, NULL) == 0, "after the truncation: %s",
		kvt_last_error(c));
	/* closing clears it: the slot reopens clean */
	kvt_seq_set_status(c, ids[2], -EINVAL, "bad");
	T_CHECK(kvt_seq_close(c, ids[2]) == 0, "close: %s", kvt_last_error(c));
	uint32_t again = 0;
	T_CHECK(kvt_seq_open(c, &again) == 0 && again == ids[2], "reopen: %s", kvt_last_error(c));
	status_is(c, again, 0, "");
	kvt_cache_destroy(c);
}

/* A backend whose enter (the check every call makes for errors found since the last one) puts
 * g_seq in error at its g_at-th call, as the CUDA backend does when a step's copy of its error
 * word lands. */
static uint32_t g_calls, g_at, g_seq;

static int late_enter(kvt_cache *c, void *stream)
{
	(void)stream;
	if (++g_calls == g_at)
		kvt_seq_set_status(c, g_seq, -EINVAL, "found late");
	return 0;
}

/*
 * An error found by the pipeline's own check, after the call's check of its batch (the device's
 * copy landed in between), still fails the call before anything changes, naming the entry; so
 * does one found by kvt_seq_fork's check, and by a prefill's.
 */
static void test_status_late(void **state)
{
	(void)state;
	uint32_t ids[NS];
	kvt_cache *c = make(ids);
	uint16_t k[NS * HKV * D], v[NS * HKV * D];
	memcpy(k, g_k, sizeof k);
	memcpy(v, g_v, sizeof v);
	struct kvt_backend_ops late = *c->ops;
	const struct kvt_backend_ops *ops = c->ops;
	late.enter = late_enter;
	c->ops = &late;
	uint32_t three[3] = {ids[0], ids[1], ids[2]};
	/* kvt_append: batch()'s check is the first enter, the pipeline's the second */
	g_calls = 0, g_at = 2, g_seq = ids[1];
	want(c, ids, kvt_append(c, 0, 3, three, k, v, NULL), -EINVAL, 1, "append, late error");
	T_CHECK(g_calls >= 2, "enter called %u times", g_calls);
	T_CHECK(kvt_seq_truncate(c, ids[1], 1, NULL) == 0, "truncate: %s", kvt_last_error(c));
	T_CHECK(kvt_prefill(c, ids[1], 0, NULL, k, v, 1, NULL) == 0, "prefill back: %s",
		kvt_last_error(c));
	/* kvt_seq_fork looks before its check */
	g_calls = 0, g_at = 1, g_seq = ids[2];
	uint32_t child = 0;
	want(c, ids, kvt_seq_fork(c, ids[2], &child, NULL), -EINVAL, -1, "fork, late error");
	kvt_stats st = {.size = sizeof st};
	T_CHECK(kvt_get_stats(c, &st) == 0 && st.seqs_open == NS, "fork opened a sequence: %llu open",
		(unsigned long long)st.seqs_open);
	T_CHECK(kvt_seq_truncate(c, ids[2], 1, NULL) == 0, "truncate: %s", kvt_last_error(c));
	T_CHECK(kvt_prefill(c, ids[2], 0, NULL, k, v, 1, NULL) == 0, "prefill back: %s",
		kvt_last_error(c));
	/* a prefill: its own check first, the pipeline's second */
	g_calls = 0, g_at = 2, g_seq = ids[0];
	want(c, ids, kvt_prefill(c, ids[0], 0, NULL, k, v, 1, NULL), -EINVAL, -1,
	     "prefill, late error");
	c->ops = ops;
	kvt_cache_destroy(c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_entries),
		cmocka_unit_test(test_failed_step_counts_nothing),
		cmocka_unit_test(test_status),
		cmocka_unit_test(test_status_late),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
