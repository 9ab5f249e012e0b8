/* SPDX-License-Identifier: MIT */
/*
 * The decode fixture of test_correction.c and test_keep.c: one layer of HQ query and HKV KV heads
 * of D, a sequence prefilled with CTX tokens, and STEPS decode queries (the includer defines
 * FX_STEPS), each head's a persistent part plus a fresh one drawn at every step; and a loop of
 * allocation faults over one step.
 */
#ifndef KVT_TEST_DECODE_FIXTURE_H
#define KVT_TEST_DECODE_FIXTURE_H

#include "common.h"

enum { HQ = 4, HKV = 2, G = HQ / HKV, D = 64, CTX = 700, STEPS = FX_STEPS };
#define KROW (HKV * D)
#define QROW (HQ * D)

static uint16_t g_k[(CTX + 8) * KROW], g_v[(CTX + 8) * KROW], g_q[STEPS][QROW];

/* Keys and values, and queries of standard deviation base_sd (the persistent part) plus fresh_sd
 * (drawn afresh at every step). */
static void make_data(uint64_t seed, float base_sd, float fresh_sd)
{
	t_rng r;
	t_rng_seed(&r, seed);
	t_fill(&r, KVT_DTYPE_F16, (size_t)(CTX + 8) * KROW, 0.1, 1.0, g_k, NULL);
	t_fill(&r, KVT_DTYPE_F16, (size_t)(CTX + 8) * KROW, -0.2, 1.0, g_v, NULL);
	float base[QROW];
	for (uint32_t j = 0; j < QROW; j++)
		base[j] = (float)t_normal(&r) * base_sd;
	for (uint32_t s = 0; s < STEPS; s++)
		for (uint32_t j = 0; j < QROW; j++)
			g_q[s][j] = t_f2h(base[j] + (float)t_normal(&r) * fresh_sd);
}

/* A cache of cfg with one sequence open (*seq) and prefilled with the CTX tokens. */
static kvt_cache *fx_open(const kvt_config *cfg, uint32_t *seq)
{
	kvt_cache *c = t_create(cfg);
	T_CHECK(kvt_seq_open(c, seq) == 0, "open");
	T_CHECK(kvt_prefill(c, *seq, 0, NULL, g_k, g_v, CTX, NULL) == 0, "prefill: %s",
		kvt_last_error(c));
	return c;
}

/* Steps from .. to - 1 attended, step s's output at out + s * QROW. */
static void run_steps(kvt_cache *c, uint32_t seq, uint32_t from, uint32_t to, float *out)
{
	for (uint32_t s = from; s < to; s++)
		T_CHECK(kvt_attend(c, 0, 1, &seq, g_q[s], out + (size_t)s * QROW, NULL) == 0,
			"attend: %s", kvt_last_error(c));
}

/* Step k of a run: attended (out + k * QROW), or (select) only selected. */
static void fx_step(kvt_cache *c, uint32_t s, uint32_t k, bool select, float *out)
{
	int rc = select ? kvt_select(c, 0, 1, &s, g_q[k], NULL)
			: kvt_attend(c, 0, 1, &s, g_q[k], out + (size_t)k * QROW, NULL);
	T_CHECK(rc >= 0, "step %u: %s", k, kvt_last_error(c));
}

/*
 * Step k (>= 1) of a cache from make() failing under allocation fault n, for every n that fires,
 * then retried (or, with select, a kvt_select of its query in its place), then the steps after:
 * every output equals a fault-free twin's bit for bit, and nothing leaks. So whatever the failed
 * step had changed (the corrections it recorded, the selection it kept) never counts. Returns the
 * faults that failed the step.
 */
static uint64_t fx_fault_loop(kvt_cache *(*make)(uint32_t *seq), uint32_t k, bool select)
{
	static float want[STEPS * QROW], got[STEPS * QROW];
	uint32_t s;
	kvt_cache *c = make(&s);
	memset(want, 0, sizeof want);
	run_steps(c, s, 0, k, want);
	fx_step(c, s, k, select, want);
	run_steps(c, s, k + 1, STEPS, want);
	kvt_cache_destroy(c);
	const int64_t live0 = kvt_mem_live();
	uint64_t n = 1, failed = 0;
	for (;; n++) {
		c = make(&s);
		memset(got, 0, sizeof got);
		run_steps(c, s, 0, k, got);
		kvt_mem_fail_at(n);
		int rc = kvt_attend(c, 0, 1, &s, g_q[k], got + (size_t)k * QROW, NULL);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		T_CHECK(rc == 0 || (fired && rc == -ENOMEM), "N=%llu: got %d (%s)",
			(unsigned long long)n, rc, kvt_last_error(c));
		if (rc < 0) {
			failed++;
			memset(got + (size_t)k * QROW, 0, QROW * sizeof(float));
			fx_step(c, s, k, select, got);
		}
		/* an attend that succeeded is the twin's step only when the twin attended too */
		if (rc < 0 || !select) {
			run_steps(c, s, k + 1, STEPS, got);
			T_CHECK(!memcmp(got, want, sizeof got),
				"N=%llu: outputs differ from the fault-free run", (unsigned long long)n);
		}
		kvt_cache_destroy(c);
		T_CHECK(kvt_mem_live() == live0, "N=%llu: %lld allocations live after destroy, wanted "
			"%lld", (unsigned long long)n, (long long)kvt_mem_live(), (long long)live0);
		if (!fired)
			break;
	}
	T_CHECK(failed > 0, "no allocation of the step failed");
	return failed;
}

#endif
