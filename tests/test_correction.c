/* SPDX-License-Identifier: MIT */
/*
 * Score corrections from exact logits (kvt_config.correction_steps, lib/correct.c), CPU backend.
 * Each decode step's selection is checked against a reference built here from the stated rule:
 * a token attended at some of the last R steps is scored estimate + w . deltas, the deltas (exact
 * logit minus estimate) of every query head of the group at the most recent 32 / G of those steps,
 * w the least-squares weights of the query head's rotated residual on theirs (ridge 0.1 of each
 * one's squared norm; Cholesky; the prediction summed in four running sums), every sum in the
 * rule's order. Also: correction off and at p = 1 changes nothing, a truncate forgets every
 * correction and a fork's child starts without, a step that fails under an allocation fault leaves
 * the corrections (and so every later step) as a fault-free twin has them, an attend in place
 * (out the same buffer as q) records what a separate out records. And the second selection stage
 * (rescore_p), against the same reference extended by its rule.
 */
#include "common.h"
#include "half.h"
#ifdef KVT_TEST_LS_MAX /* the library's corrections built here with smaller limits (meson.build) */
#include "../lib/correct.c"
#endif

#define FX_STEPS 6
#include "decode_fixture.h" /* make_data(seed, 2.5, 0.8): consecutive queries alike, as a head's
			       are, so beta is near 1 but never exactly */

static float g_rescore; /* config()'s rescore_p (test_rescore sets it) */

static kvt_config config(uint32_t R, float p)
{
	kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
	cfg.p = p;
	cfg.budget_min = KVT_NONE; /* the selection follows the scores alone */
	cfg.correction_steps = R;
	cfg.rescore_p = g_rescore;
	return cfg;
}

static kvt_cache *make(uint32_t R, float p, uint32_t *seq)
{
	kvt_config cfg = config(R, p);
	return fx_open(&cfg, seq);
}

/* ---- the reference --------------------------------------------------------------------------- */

/* What the reference remembers: per step (1-based), KV head and index position, whether the step
 * attended it and each query head's exact-minus-estimate then; each step's rotated query residuals. */
struct ref {
	uint32_t R;
	float rp;                      /* rescore_p: the second stage (0: off) */
	uint64_t rescored, unselected; /* what it read, what of that the step did not select */
	uint8_t seen[STEPS + 1][HKV][CTX];
	float delta[STEPS + 1][HKV][G][CTX];
	float x[STEPS + 1][HKV][G][D];
};

#ifdef KVT_TEST_LS_MAX
#define REF_LS_MAX KVT_TEST_LS_MAX
#else
#define REF_LS_MAX 32u
#endif
#define REF_RIDGE 0.1

static double ref_dot(const float *a, const float *b)
{
	double s = 0.0;
	for (uint32_t j = 0; j < D; j++)
		s += (double)a[j] * b[j];
	return s;
}

/* The rule's prediction of token t's estimate error for query head g (residual x) at `step`. */
static double ref_predict(const struct ref *rf, uint32_t step, uint32_t h, uint32_t g,
			  const float *x, uint32_t t)
{
	/* n <= REF_LS_MAX (steps * mps), which gcc cannot see with REF_LS_MAX 1 (-Warray-bounds):
	 * one spare row and column */
	enum { N = REF_LS_MAX + 1 };
	const float *xs[N];
	double dl[N], A[N][N], f[N][N], w[N];
	/* every query head of a step, or (more than REF_LS_MAX of them) the query head's own */
	const uint32_t mps = G <= REF_LS_MAX ? G : 1, r0 = mps == 1 ? g : 0;
	uint32_t n = 0, steps = 0;
	for (uint32_t s = step - 1; s >= 1 && step - s <= rf->R && steps < REF_LS_MAX / mps; s--) {
		if (!rf->seen[s][h][t])
			continue;
		steps++;
		for (uint32_t r = r0; r < r0 + mps; r++) {
			const double nn = ref_dot(rf->x[s][h][r], rf->x[s][h][r]);
			if (!(nn > 0.0 && isfinite(nn)))
				continue;
			xs[n] = rf->x[s][h][r];
			dl[n++] = rf->delta[s][h][r][t];
		}
	}
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t j = 0; j < n; j++)
			A[i][j] = ref_dot(xs[i], xs[j]) + (i == j ? REF_RIDGE * ref_dot(xs[i], xs[i]) : 0);
	for (uint32_t i = 0; i < n; i++) /* Cholesky, row by row */
		for (uint32_t j = 0; j <= i; j++) {
			double v = A[i][j];
			for (uint32_t k = 0; k < j; k++)
				v -= f[i][k] * f[j][k];
			if (i == j) {
				if (!(v > 0.0))
					return 0.0;
				f[i][i] = sqrt(v);
			} else {
				f[i][j] = v / f[j][j];
			}
		}
	for (uint32_t i = 0; i < n; i++) {
		double v = ref_dot(x, xs[i]);
		for (uint32_t k = 0; k < i; k++)
			v -= f[i][k] * w[k];
		w[i] = v / f[i][i];
	}
	for (uint32_t i = n; i-- > 0;) {
		double v = w[i];
		for (uint32_t k = i + 1; k < n; k++)
			v -= f[k][i] * w[k];
		w[i] = v / f[i][i];
	}
	double sum[4] = {0.0, 0.0, 0.0, 0.0};
	for (uint32_t i = 0; i < n; i++)
		sum[i % 4] += w[i] * dl[i];
	return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

static float exact_logit(const float *q, uint32_t pos, uint32_t h)
{
	float e = 0.0f;
	for (uint32_t j = 0; j < D; j++)
		e += q[j] * t_h2f(g_k[(size_t)pos * KROW + h * D + j]);
	return e;
}

/* The indexed part of step `step`'s selection (1-based) of KV head h as the rule gives it: mask
 * [ni]. Records what attending it teaches the reference. */
static void ref_step(kvt_cache *c, struct ref *rf, uint32_t step, const uint16_t *q, uint32_t h,
		     uint8_t *mask, uint32_t *changed)
{
	const struct kvt_layer *l = &c->seqs[0].layers[0];
	const uint32_t ni = l->n_indexed, S = c->cfg.n_sink, cap = l->idx_cap;
	static float sc[CTX], raw[G][CTX], work[4 * CTX];
	static uint8_t plain[CTX], cand[CTX], cand_union[CTX];
	memset(mask, 0, ni);
	memset(plain, 0, ni);
	memset(cand_union, 0, ni);
	for (uint32_t g = 0; g < G; g++) {
		float qf[D];
		kvt_qcode qc;
		for (uint32_t j = 0; j < D; j++)
			qf[j] = t_h2f(q[(h * G + g) * D + j]);
		kvt_query_prepare(D, c->rot, l->c_q + h * D, l->c_k + h * D, qf, &qc);
		kvt_score(D, &qc, ni, l->codes + (size_t)h * cap * c->words, l->sigma + (size_t)h * cap,
			  l->beta + (size_t)h * cap, raw[g]);
		memcpy(rf->x[step][h][g], qc.x, sizeof qc.x[0] * D);
		memcpy(sc, raw[g], sizeof sc[0] * ni);
		int clamped;
		uint32_t bad;
		T_CHECK(kvt_topp_mark(sc, NULL, ni, c->scale, c->cfg.p, 0, 0, work, plain, &clamped, &bad) >=
				0, "reference Top-p");
		for (uint32_t t = 0; t < ni && rf->R; t++) {
			bool any = false;
			for (uint32_t s = step - 1; s >= 1 && step - s <= rf->R; s--)
				any |= rf->seen[s][h][t] != 0;
			if (!any)
				continue;
			const float s = sc[t] + (float)ref_predict(rf, step, h, g, qc.x, t);
			sc[t] = isfinite(s) ? s : sc[t];
		}
		if (rf->rp != 0.0f) { /* the second stage: Top-p(rp) of these scores, made exact */
			memset(cand, 0, ni);
			T_CHECK(kvt_topp_mark(sc, NULL, ni, c->scale, rf->rp, 0, 0, work, cand, &clamped,
					      &bad) >= 0, "reference candidates");
			for (uint32_t t = 0; t < ni; t++)
				if (cand[t]) {
					sc[t] = exact_logit(qf, S + t, h);
					cand_union[t] = 1;
				}
		}
		T_CHECK(kvt_topp_mark(sc, NULL, ni, c->scale, c->cfg.p, 0, 0, work, mask, &clamped, &bad) >= 0,
			"reference Top-p");
	}
	for (uint32_t t = 0; rf->rp != 0.0f && t < ni; t++) {
		rf->rescored += cand_union[t];
		rf->unselected += cand_union[t] && !mask[t];
	}
	for (uint32_t t = 0; t < ni; t++)
		*changed += mask[t] != plain[t];
	/* the step attends the union: every query head of the group learns each of its tokens */
	for (uint32_t g = 0; g < G; g++) {
		float qf[D];
		for (uint32_t j = 0; j < D; j++)
			qf[j] = t_h2f(q[(h * G + g) * D + j]);
		for (uint32_t t = 0; t < ni; t++)
			if (mask[t]) {
				const float d = exact_logit(qf, S + t, h) - raw[g][t];
				rf->delta[step][h][g][t] = isfinite(d) ? d : 0.0f;
				rf->seen[step][h][t] = 1;
			}
	}
}

/* Attend step s's query and compare each KV head's selected index positions with the reference. */
static void check_step(kvt_cache *c, uint32_t seq, struct ref *rf, uint32_t step, const char *what,
		       uint32_t *changed)
{
	static float out[QROW];
	static int32_t pos[HKV * (CTX + 8)];
	int32_t counts[HKV];
	static uint8_t mask[CTX];
	T_CHECK(kvt_attend(c, 0, 1, &seq, g_q[step - 1], out, NULL) == 0, "%s step %u: %s", what,
		step, kvt_last_error(c));
	T_CHECK(kvt_gather(c, 0, 1, &seq, CTX + 8, counts, pos, NULL, NULL, NULL) >= 0, "gather");
	const uint32_t S = c->cfg.n_sink, ni = c->seqs[seq].layers[0].n_indexed;
	for (uint32_t h = 0; h < HKV; h++) {
		ref_step(c, rf, step, g_q[step - 1], h, mask, changed);
		uint32_t got = 0, want = 0;
		for (int32_t i = 0; i < counts[h]; i++) {
			int32_t p = pos[(size_t)h * (CTX + 8) + i];
			if (p < (int32_t)S || (uint32_t)p - S >= ni)
				continue;
			T_CHECK(mask[p - S], "%s step %u KV head %u: position %d selected, the rule does "
				"not select it", what, step, h, p);
			got++;
		}
		for (uint32_t t = 0; t < ni; t++)
			want += mask[t];
		T_CHECK(got == want, "%s step %u KV head %u: %u indexed tokens selected, the rule "
			"selects %u", what, step, h, got, want);
	}
}

/* Every step's selection is the rule's, for R = 1, 2 and 64, and the corrections change it. */
static void test_rule(void **state)
{
	(void)state;
	make_data(11, 2.5f, 0.8f);
	const uint32_t Rs[] = {1, 2, 64};
	for (size_t k = 0; k < sizeof Rs / sizeof Rs[0]; k++) {
		uint32_t seq, changed = 0;
		kvt_cache *c = make(Rs[k], 0.8f, &seq);
		static struct ref rf;
		memset(&rf, 0, sizeof rf);
		rf.R = Rs[k];
		char what[32];
		snprintf(what, sizeof what, "R = %u", Rs[k]);
		for (uint32_t s = 1; s <= STEPS; s++)
			check_step(c, seq, &rf, s, what, &changed);
		print_message("%s: %u indexed tokens chosen differently from the uncorrected scores\n",
			      what, changed);
		T_CHECK(changed > 0, "%s: the corrections never changed a selection", what);
		kvt_cache_destroy(c);
	}
}

/*
 * The second stage (rescore_p): every step's selection is the rule's (the corrected estimate's
 * Top-p(rescore_p) candidates scored exactly, then Top-p(p)), alone and with corrections, and at
 * rescore_p = 1 (every token exact: the exact Top-p); the stats count the keys it read and those
 * the step did not select, as the rule does.
 */
static void test_rescore(void **state)
{
	(void)state;
	make_data(17, 2.5f, 0.8f);
	const struct { uint32_t R; float rp; } cases[] = {{0, 0.95f}, {0, 1.0f}, {8, 0.9f}};
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		uint32_t seq, changed = 0;
		g_rescore = cases[k].rp;
		kvt_cache *c = make(cases[k].R, 0.8f, &seq);
		g_rescore = 0.0f;
		static struct ref rf;
		memset(&rf, 0, sizeof rf);
		rf.R = cases[k].R;
		rf.rp = cases[k].rp;
		char what[48];
		snprintf(what, sizeof what, "rescore_p %.2f, R = %u", (double)rf.rp, rf.R);
		for (uint32_t s = 1; s <= STEPS; s++)
			check_step(c, seq, &rf, s, what, &changed);
		kvt_stats st = {.size = sizeof st};
		T_CHECK(kvt_get_stats(c, &st) == 0, "stats");
		print_message("%s: %u indexed tokens chosen differently from the plain estimate; keys "
			      "read %llu, not selected %llu\n", what, changed,
			      (unsigned long long)st.rescored_tokens,
			      (unsigned long long)st.rescored_unselected);
		T_CHECK(changed > 0, "%s: the second stage never changed a selection", what);
		T_CHECK(st.rescored_tokens == rf.rescored && st.rescored_unselected == rf.unselected,
			"%s: keys read %llu (rule %llu), not selected %llu (rule %llu)", what,
			(unsigned long long)st.rescored_tokens, (unsigned long long)rf.rescored,
			(unsigned long long)st.rescored_unselected,
			(unsigned long long)rf.unselected);
		kvt_cache_destroy(c);
	}
}

/* The outputs of STEPS steps of a cache. */
/* Off, and at p = 1 (everything selected), the outputs are those of a cache without corrections. */
static void test_neutral(void **state)
{
	(void)state;
	make_data(12, 2.5f, 0.8f);
	static float a[STEPS * QROW], b[STEPS * QROW];
	uint32_t sa, sb;
	kvt_cache *ca = make(0, 1.0f, &sa), *cb = make(8, 1.0f, &sb);
	run_steps(ca, sa, 0, STEPS, a);
	run_steps(cb, sb, 0, STEPS, b);
	T_CHECK(!memcmp(a, b, sizeof a), "p = 1: corrections changed an output");
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

/* A truncate forgets every correction of the sequence, and a fork's child starts without: their
 * next steps equal a cache that never corrected. */
static void test_forget(void **state)
{
	(void)state;
	make_data(13, 2.5f, 0.8f);
	static float a[STEPS * QROW], b[STEPS * QROW];
	uint32_t sa, sb;
	kvt_cache *ca = make(4, 0.8f, &sa), *cb = make(0, 0.8f, &sb);
	run_steps(ca, sa, 0, 3, a);
	run_steps(cb, sb, 0, 3, b);
	T_CHECK(memcmp(a, b, 3 * QROW * sizeof(float)), "the corrections changed nothing: no test");
	uint32_t child, twin;
	T_CHECK(kvt_seq_fork(ca, sa, &child, NULL) == 0, "fork: %s", kvt_last_error(ca));
	T_CHECK(kvt_seq_fork(cb, sb, &twin, NULL) == 0, "fork: %s", kvt_last_error(cb));
	float x[QROW], y[QROW];
	T_CHECK(kvt_attend(ca, 0, 1, &child, g_q[3], x, NULL) == 0, "attend child");
	T_CHECK(kvt_attend(cb, 0, 1, &twin, g_q[3], y, NULL) == 0, "attend twin");
	T_CHECK(!memcmp(x, y, sizeof x), "a fork's first step used its parent's corrections");
	T_CHECK(kvt_seq_truncate(ca, sa, 1, NULL) == 0, "truncate: %s", kvt_last_error(ca));
	T_CHECK(kvt_seq_truncate(cb, sb, 1, NULL) == 0, "truncate: %s", kvt_last_error(cb));
	T_CHECK(kvt_attend(ca, 0, 1, &sa, g_q[4], x, NULL) == 0, "attend");
	T_CHECK(kvt_attend(cb, 0, 1, &sb, g_q[4], y, NULL) == 0, "attend");
	T_CHECK(!memcmp(x, y, sizeof x), "the first step after a truncate used corrections");
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

/* An attend whose out is its q (in place: out_dtype = dtype) corrects as one with a separate out:
 * the corrections record the queries, never the outputs written over them. */
static void test_in_place(void **state)
{
	(void)state;
	make_data(15, 2.5f, 0.8f);
	kvt_config cfg = config(4, 0.8f);
	cfg.out_dtype = KVT_DTYPE_F16;
	kvt_cache *a = t_create(&cfg), *b = t_create(&cfg);
	uint32_t sa, sb;
	T_CHECK(kvt_seq_open(a, &sa) == 0 && kvt_seq_open(b, &sb) == 0, "open");
	T_CHECK(kvt_prefill(a, sa, 0, NULL, g_k, g_v, CTX, NULL) == 0, "prefill");
	T_CHECK(kvt_prefill(b, sb, 0, NULL, g_k, g_v, CTX, NULL) == 0, "prefill");
	for (uint32_t s = 0; s < STEPS; s++) {
		uint16_t want[QROW], got[QROW];
		memcpy(got, g_q[s], sizeof got);
		T_CHECK(kvt_attend(a, 0, 1, &sa, g_q[s], want, NULL) == 0, "attend: %s",
			kvt_last_error(a));
		T_CHECK(kvt_attend(b, 0, 1, &sb, got, got, NULL) == 0, "attend in place: %s",
			kvt_last_error(b));
		T_CHECK(!memcmp(got, want, sizeof got), "step %u: the attend in place differs from "
			"one with a separate out", s);
	}
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

static kvt_cache *make_faulted(uint32_t *seq)
{
	return make(3, 0.8f, seq);
}

/*
 * A step failing under allocation fault n changes no correction: followed by the same step
 * (retried) or by a kvt_select of its query, it and the steps after give a fault-free twin's
 * outputs bit for bit (what the failed step recorded never counts).
 */
static void test_faults(void **state)
{
	(void)state;
	make_data(14, 2.5f, 0.8f);
	for (int select = 0; select < 2; select++)
		print_message("%s: %llu allocation faults in a corrected step, each changed nothing\n",
			      select ? "then select" : "then retried",
			      (unsigned long long)fx_fault_loop(make_faulted, 2, select));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_rule),
		cmocka_unit_test(test_neutral),
		cmocka_unit_test(test_forget),
		cmocka_unit_test(test_in_place),
		cmocka_unit_test(test_faults),
		cmocka_unit_test(test_rescore),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
