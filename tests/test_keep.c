/* SPDX-License-Identifier: MIT */
/*
 * The selection's hysteresis (kvt_config.keep_weight, keep_steps), CPU backend. Each decode step's
 * selection is checked against a reference built here from the stated rule: every query head's
 * Top-p ranks the indexed tokens by their estimates, those its KV head selected at one of the last
 * keep_steps steps that succeeded raised by ln(1 + keep_weight) / scale, and counts each token's
 * own estimated mass; the KV head attends the union. The first step (nothing kept) selects as a
 * cache without it; the weight keeps more of the last step's tokens than no weight does. A
 * truncate forgets the kept selections and a fork's child keeps its parent's; a step that fails
 * under an allocation fault (with score corrections on, whose records allocate after the
 * selection) leaves every later step as a fault-free twin's. Out-of-range weights and steps are
 * refused by name.
 */
#include "common.h"

#define FX_STEPS 8
#include "decode_fixture.h" /* make_data(seed, 2, 2): a fresh part as large as the persistent one,
			       so consecutive selections overlap but differ */

static uint32_t g_steps; /* make()'s keep_steps (test_rule sets it) */

static kvt_cache *make(float w, uint32_t R, uint32_t *seq)
{
	kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
	cfg.p = 0.8f;
	cfg.budget_min = KVT_NONE; /* the selection follows the scores alone */
	cfg.keep_weight = w;
	cfg.keep_steps = w != 0.0f ? g_steps : 0;
	cfg.correction_steps = R;
	return fx_open(&cfg, seq);
}

/* KV head h's indexed selection of this step by the rule (mask [ni]), the favored tokens in
 * kept[ni] (NULL: none); plain[ni] receives it without the weight. */
static void ref_select(kvt_cache *c, const uint16_t *q, uint32_t h, float w, const uint8_t *kept,
		       uint8_t *mask, uint8_t *plain)
{
	const struct kvt_layer *l = &c->seqs[0].layers[0];
	const uint32_t ni = l->n_indexed, cap = l->idx_cap;
	static float sc[CTX], keys[CTX], work[2 * CTX];
	const float bonus = logf(1.0f + w) / c->scale;
	memset(mask, 0, ni);
	memset(plain, 0, ni);
	for (uint32_t g = 0; g < G; g++) {
		float qf[D];
		kvt_qcode qc;
		for (uint32_t j = 0; j < D; j++)
			qf[j] = t_h2f(q[(h * G + g) * D + j]);
		kvt_query_prepare(D, c->rot, l->c_q + h * D, l->c_k + h * D, qf, &qc);
		kvt_score(D, &qc, ni, l->codes + (size_t)h * cap * c->words, l->sigma + (size_t)h * cap,
			  l->beta + (size_t)h * cap, sc);
		for (uint32_t t = 0; t < ni; t++)
			keys[t] = kept && kept[t] ? sc[t] + bonus : sc[t];
		int clamped;
		uint32_t bad;
		T_CHECK(kvt_topp_mark(sc, kept ? keys : NULL, ni, c->scale, c->cfg.p, 0, 0, work, mask,
				      &clamped, &bad) >= 0, "reference Top-p");
		T_CHECK(kvt_topp_mark(sc, NULL, ni, c->scale, c->cfg.p, 0, 0, work, plain, &clamped,
				      &bad) >= 0, "reference Top-p");
	}
}

/* The indexed selection of the last step of KV head h, from kvt_gather, as a mask [ni]. */
static void gathered(kvt_cache *c, uint32_t seq, uint8_t (*sel)[CTX])
{
	static int32_t pos[HKV * (CTX + 8)];
	int32_t counts[HKV];
	T_CHECK(kvt_gather(c, 0, 1, &seq, CTX + 8, counts, pos, NULL, NULL, NULL) >= 0, "gather: %s",
		kvt_last_error(c));
	const uint32_t S = c->cfg.n_sink, ni = c->seqs[seq].layers[0].n_indexed;
	for (uint32_t h = 0; h < HKV; h++) {
		memset(sel[h], 0, CTX);
		for (int32_t i = 0; i < counts[h]; i++) {
			const int32_t p = pos[(size_t)h * (CTX + 8) + i];
			if (p >= (int32_t)S && (uint32_t)p - S < ni)
				sel[h][p - S] = 1;
		}
	}
}

/* Every step's selection is the rule's (kvt_attend and kvt_select alike), for two weights and for
 * the selections of the last step and of the last three (keep_steps); the weight changes
 * selections and keeps more of the last step's tokens than no weight. */
static void test_rule(void **state)
{
	(void)state;
	make_data(21, 2.0f, 2.0f);
	const float ws[] = {0.5f, 8.0f, 8.0f};
	const uint32_t Rs[] = {0, 1, 3}; /* keep_steps: 0 is 1 */
	for (size_t wi = 0; wi < 3; wi++) {
		uint32_t seq, seq0;
		g_steps = Rs[wi];
		kvt_cache *c = make(ws[wi], 0, &seq), *c0 = make(0.0f, 0, &seq0);
		static uint8_t sel[HKV][CTX], prev[HKV][CTX], sel0[HKV][CTX], prev0[HKV][CTX];
		static uint8_t mask[CTX], plain[CTX], fav[CTX];
		static uint32_t stamp[HKV][CTX]; /* the step (1-based) that last selected a token */
		memset(stamp, 0, sizeof stamp);
		const uint32_t R = Rs[wi] ? Rs[wi] : 1;
		uint64_t changed = 0, kept = 0, kept0 = 0;
		float out[QROW];
		for (uint32_t s = 0; s < STEPS; s++) {
			/* every third step a kvt_select: a selection without attention keeps alike */
			const int rc = s % 3 == 2 ? kvt_select(c, 0, 1, &seq, g_q[s], NULL)
						  : kvt_attend(c, 0, 1, &seq, g_q[s], out, NULL);
			T_CHECK(rc >= 0, "w %g step %u: %s", (double)ws[wi], s, kvt_last_error(c));
			T_CHECK(kvt_attend(c0, 0, 1, &seq0, g_q[s], out, NULL) == 0, "attend");
			gathered(c, seq, sel);
			gathered(c0, seq0, sel0);
			const uint32_t ni = c->seqs[seq].layers[0].n_indexed;
			for (uint32_t h = 0; h < HKV; h++) {
				for (uint32_t t = 0; t < ni; t++) /* s steps made before this one */
					fav[t] = stamp[h][t] && s - stamp[h][t] < R;
				ref_select(c, g_q[s], h, ws[wi], s ? fav : NULL, mask, plain);
				for (uint32_t t = 0; t < ni; t++) {
					T_CHECK(sel[h][t] == mask[t], "w %g R %u step %u KV head %u token "
						"%u: selected %u, the rule says %u", (double)ws[wi], R, s, h,
						t, sel[h][t], mask[t]);
					T_CHECK(sel0[h][t] == plain[t], "no weight, step %u KV head %u "
						"token %u: selected %u, the rule says %u", s, h, t,
						sel0[h][t], plain[t]);
					changed += mask[t] != plain[t];
					kept += s && sel[h][t] && prev[h][t];
					kept0 += s && sel0[h][t] && prev0[h][t];
				}
				T_CHECK(s || !memcmp(sel[h], sel0[h], ni),
					"w %g: the first step (nothing kept) selects otherwise than no "
					"weight", (double)ws[wi]);
			}
			memcpy(prev, sel, sizeof prev);
			memcpy(prev0, sel0, sizeof prev0);
			for (uint32_t h = 0; h < HKV; h++)
				for (uint32_t t = 0; t < ni; t++)
					stamp[h][t] = sel[h][t] ? s + 1 : stamp[h][t];
		}
		T_CHECK(changed > 0 && kept > kept0,
			"w %g R %u: the weight changed %llu selections and kept %llu of the last step's "
			"tokens, %llu without it: no test", (double)ws[wi], R,
			(unsigned long long)changed, (unsigned long long)kept,
			(unsigned long long)kept0);
		print_message("keep_weight %g, keep_steps %u: %llu selections changed, %llu tokens kept "
			      "from the last step (%llu without)\n", (double)ws[wi], R,
			      (unsigned long long)changed,
			      (unsigned long long)kept, (unsigned long long)kept0);
		kvt_cache_destroy(c);
		kvt_cache_destroy(c0);
	}
}

/* A truncate forgets the kept selection: the next step equals a fresh sequence's first. A fork's
 * child keeps its parent's: its next step equals the parent's. */
static void test_truncate_fork(void **state)
{
	(void)state;
	make_data(22, 2.0f, 2.0f);
	static float a[STEPS * QROW], b[STEPS * QROW];
	uint32_t sa, sb, child;
	kvt_cache *ca = make(8.0f, 0, &sa), *cb = make(8.0f, 0, &sb);
	run_steps(ca, sa, 0, 4, a);
	T_CHECK(kvt_seq_fork(ca, sa, &child, NULL) == 0, "fork: %s", kvt_last_error(ca));
	float x[QROW], y[QROW];
	T_CHECK(kvt_attend(ca, 0, 1, &child, g_q[4], x, NULL) == 0, "attend child");
	T_CHECK(kvt_attend(ca, 0, 1, &sa, g_q[4], y, NULL) == 0, "attend parent");
	T_CHECK(!memcmp(x, y, sizeof x), "a fork's first step differs from its parent's");
	/* one token off both: ca's next step is then cb's, which has made none */
	T_CHECK(kvt_seq_truncate(ca, sa, 1, NULL) == 0, "truncate: %s", kvt_last_error(ca));
	T_CHECK(kvt_seq_truncate(cb, sb, 1, NULL) == 0, "truncate: %s", kvt_last_error(cb));
	run_steps(ca, sa, 5, 6, a);
	run_steps(cb, sb, 5, 6, b);
	T_CHECK(!memcmp(a + 5 * QROW, b + 5 * QROW, QROW * sizeof(float)),
		"the first step after a truncate used the kept selection");
	kvt_cache_destroy(ca);
	kvt_cache_destroy(cb);
}

static kvt_cache *make_faulted(uint32_t *seq)
{
	return make(8.0f, 3, seq);
}

/* A step failing under an allocation fault (keep_weight with score corrections, whose records
 * allocate once the selection is made) leaves the kept selection as it was: retried, it and the
 * steps after give a fault-free twin's outputs bit for bit. */
static void test_faults(void **state)
{
	(void)state;
	make_data(23, 2.0f, 2.0f);
	print_message("%llu allocation faults in a step, each changed nothing\n",
		      (unsigned long long)fx_fault_loop(make_faulted, 3, false));
}

/* Out-of-range weights and steps are refused, the text naming the value; 0 and 1e6 are taken. */
static void test_bad_weight(void **state)
{
	(void)state;
	const float bad[] = {-1.0f, 2e6f, NAN, INFINITY};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
		cfg.keep_weight = bad[i];
		kvt_cache *c = NULL;
		T_CHECK(kvt_cache_create(&cfg, &c) == -EINVAL && !c, "keep_weight %g was taken",
			(double)bad[i]);
		T_CHECK(strstr(kvt_last_error(NULL), "keep_weight = "), "keep_weight %g: the text "
			"does not name it: %s", (double)bad[i], kvt_last_error(NULL));
	}
	const struct {
		float w;
		uint32_t R;
	} bad_steps[] = {{8.0f, KVT_MAX_KEEP_STEPS + 1}, {0.0f, 2}};
	for (size_t i = 0; i < 2; i++) {
		kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
		cfg.keep_weight = bad_steps[i].w;
		cfg.keep_steps = bad_steps[i].R;
		kvt_cache *c = NULL;
		T_CHECK(kvt_cache_create(&cfg, &c) == -EINVAL && !c &&
				strstr(kvt_last_error(NULL), "keep_steps = "),
			"keep_weight %g, keep_steps %u: taken, or the text does not name it: %s",
			(double)bad_steps[i].w, bad_steps[i].R, kvt_last_error(NULL));
	}
	const float good[] = {0.0f, 1e6f};
	for (size_t i = 0; i < 2; i++) {
		kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
		cfg.keep_weight = good[i];
		kvt_cache_destroy(t_create(&cfg));
	}
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_rule),
		cmocka_unit_test(test_truncate_fork),
		cmocka_unit_test(test_faults),
		cmocka_unit_test(test_bad_weight),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
