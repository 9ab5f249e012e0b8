/* SPDX-License-Identifier: MIT */
/*
 * kvbench's comparison of a sweep's methods with its p-sweep at equal budget
 * (tools/kvbench_frontier.c) against cases computed by hand: which points make the sweep (plain
 * p, the same shape), the linear interpolation between the two that bracket a budget, nothing
 * outside their range, the budget in bytes (half a row per extra key), and which points are shown;
 * the same at equal simulated misses (a trace replay's keep points).
 */
#include <math.h>

/* before common.h: cmocka's fail() macro would rename kvbench's fail() */
#include "kvbench.h"

#include "common.h"

static kb_result plain(double budget, double p5, double p1, double min)
{
	return (kb_result){.context = 4096, .seqs = 1, .layers = 2, .p = 0.9f, .budget = budget,
			   .recall_p5 = p5, .recall_p1 = p1, .recall_min = min, .rescore_k = 0.0,
			   .misses = NAN}; /* no trace: no simulated misses */
}

#define NEAR(x, want) T_CHECK(fabs((x) - (want)) < 1e-12, "%s = %.15g, wanted %.15g", #x, (x), (want))

/*
 * Plain points at budgets 0.4, 0.2 and 0.3 (out of order), one of another context, a rescore point
 * at budget 0.25 with 0.2 extra keys per token (bytes 0.25 + 0.1 = 0.35) and a top-k point.
 * At 0.25: halfway between 0.2 (p5 0.80, p1 0.70, min 0.60) and 0.3 (0.86, 0.78, 0.64):
 * p5 0.83, p1 0.74, min 0.62. At 0.35: halfway between 0.3 and 0.4 (0.90, 0.84, 0.70):
 * p5 0.88, p1 0.81, min 0.67. Outside [0.2, 0.4]: NAN. The other context's point is no part of it.
 */
static void test_interpolation(void **state)
{
	(void)state;
	kb_result r[6] = {plain(0.4, 0.90, 0.84, 0.70), plain(0.2, 0.80, 0.70, 0.60),
			  plain(0.3, 0.86, 0.78, 0.64), plain(0.25, 0.1, 0.1, 0.1)};
	r[3].context = 8192;
	r[4] = plain(0.25, 0.87, 0.85, 0.84);
	r[4].rescore = 0.97f;
	r[4].rescore_k = 0.2;
	r[5] = plain(0.3, 0.5, 0.4, 0.3);
	r[5].topk = 64;
	kb_result capped = r[0];
	capped.budget_max = 512;
	T_CHECK(kb_is_plain(&r[0]) && !kb_is_plain(&r[4]) && !kb_is_plain(&r[5]) &&
			!kb_is_plain(&capped),
		"plain points");
	NEAR(kb_bytes_budget(&r[4]), 0.35);
	NEAR(kb_bytes_budget(&r[0]), 0.4);
	kb_tail t;
	T_CHECK(kb_sweep_at(r, 6, &r[4], 0.25, &t) == 3, "three plain points of the shape");
	NEAR(t.p5, 0.83);
	NEAR(t.p1, 0.74);
	NEAR(t.min, 0.62);
	kb_sweep_at(r, 6, &r[4], kb_bytes_budget(&r[4]), &t);
	NEAR(t.p5, 0.88);
	NEAR(t.p1, 0.81);
	NEAR(t.min, 0.67);
	kb_sweep_at(r, 6, &r[4], 0.4, &t); /* the last point itself */
	NEAR(t.p5, 0.90);
	kb_sweep_at(r, 6, &r[4], 0.19, &t);
	T_CHECK(isnan(t.p5) && isnan(t.p1) && isnan(t.min), "below the sweep: %g", t.p5);
	kb_sweep_at(r, 6, &r[4], 0.41, &t);
	T_CHECK(isnan(t.p5), "above the sweep: %g", t.p5);
	/* the other context has one plain point: a value only at its own budget */
	T_CHECK(kb_sweep_at(r, 6, &r[3], 0.25, &t) == 1, "one plain point of 8192");
	NEAR(t.p5, 0.1);
	kb_sweep_at(r, 6, &r[3], 0.3, &t);
	T_CHECK(isnan(t.p5), "a single point elsewhere: %g", t.p5);
	/* the table shows the rescore and the top-k point; an all-plain sweep shows none */
	T_CHECK(kb_print_vs_sweep(r, 6, false) == 2, "two points against the sweep");
	T_CHECK(kb_print_vs_sweep(r, 4, false) == 0, "plain points only");
	printf("\n[");
	T_CHECK(kb_print_vs_sweep(r, 6, true) == 2, "two JSON objects");
	printf("]\n");
}

/*
 * At equal simulated misses (a trace replay's): plain points with misses 0.03, 0.01 and 0.02 (out
 * of order, their budgets in another order), a keep point at misses 0.015: halfway between 0.01
 * (p5 0.70, p1 0.60, min 0.50) and 0.02 (0.80, 0.72, 0.56): 0.75, 0.66, 0.53; at 0.035, past
 * them: NAN. A keep point is not plain; points without misses (NAN: no trace) make no curve.
 */
static void test_misses(void **state)
{
	(void)state;
	kb_result r[5] = {plain(0.2, 0.90, 0.80, 0.60), plain(0.4, 0.70, 0.60, 0.50),
			  plain(0.3, 0.80, 0.72, 0.56)};
	r[0].misses = 0.03;
	r[1].misses = 0.01;
	r[2].misses = 0.02;
	r[3] = plain(0.35, 0.76, 0.70, 0.55);
	r[3].keep = 8.0f;
	r[3].misses = 0.015;
	r[4] = plain(0.3, 0.1, 0.1, 0.1);
	r[4].misses = NAN;
	T_CHECK(!kb_is_plain(&r[3]), "a keep point is not plain");
	kb_tail t;
	T_CHECK(kb_sweep_at_misses(r, 5, &r[3], 0.015, &t) == 3,
		"three plain points with misses");
	NEAR(t.p5, 0.75);
	NEAR(t.p1, 0.66);
	NEAR(t.min, 0.53);
	kb_sweep_at_misses(r, 5, &r[3], 0.035, &t);
	T_CHECK(isnan(t.p5), "past the sweep's misses: %g", t.p5);
	T_CHECK(kb_print_vs_sweep(r, 4, false) == 1, "the keep point against the sweep");
	printf("\n[");
	T_CHECK(kb_print_vs_sweep(r, 4, true) == 1, "one JSON object");
	printf("]\n");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_interpolation),
		cmocka_unit_test(test_misses),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
