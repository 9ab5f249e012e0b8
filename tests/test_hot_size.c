/* SPDX-License-Identifier: MIT */
/*
 * The self-sized hot cache's sizing rule (gpu/hotsize.h), on the CPU:
 * - demand: an empty cache grows to twice a step's rows; one that holds twice the demand stays;
 * - a growth is at least 1.5x the old size;
 * - misses: a full cache whose step missed more than an eighth of its rows doubles (exactly an
 *   eighth does not); one still filling the ways of its last growth does not, whatever it
 *   misses, and the measure takes its misses off the ways left; demand still grows it meanwhile;
 * - never past the rows of the contexts served, and never shrunk by that bound; a growth that
 *   bound cuts short only when it adds an eighth, so contexts growing a set of rows a measure do
 *   not grow a cache at their rows each measure;
 * - over a run of measures: steady queries keep the cache at twice the demand; drifting ones
 *   double it each time it has filled, until the bound the caller applies or until it holds the
 *   rows the queries come back to, where it stops missing and growing.
 */
#include "common.h"
#include "gpu/hotsize.h"

/* The rule with f ways left to fill; *after gets the count it leaves. */
static uint64_t want(uint64_t have, uint64_t demand, uint64_t reads, uint64_t misses,
		     uint64_t served, uint64_t f, uint64_t *after)
{
	const uint64_t r = kvt_hot_rows_wanted(have, demand, reads, misses, served, &f);
	*after = f;
	return r;
}

static void test_cases(void **state)
{
	(void)state;
	const uint64_t M = UINT64_MAX; /* no bound from the served rows */
	static const struct {
		uint64_t have, demand, reads, misses, served, to_fill, rows, to_fill_after;
		const char *what;
	} cs[] = {
		{0, 100, 100, 100, M, 0, 200, 0, "empty: twice the demand"},
		{0, 0, 0, 0, M, 0, 0, 0, "empty, no demand: stays empty"},
		{200, 100, 100, 10, M, 0, 200, 0, "twice the demand, 10 % missed: stays"},
		{500, 100, 100, 10, M, 0, 500, 0, "above the demand: never shrinks"},
		{200, 100, 100, 30, M, 0, 400, 0, "full, 30 % missed: doubles"},
		{2000, 1000, 1000, 125, M, 0, 2000, 0, "exactly an eighth missed: stays"},
		{2000, 1000, 1000, 126, M, 0, 4000, 0, "just above an eighth: doubles"},
		{400, 100, 100, 60, M, 150, 400, 90, "filling: misses fill it, no growth"},
		{400, 100, 100, 60, M, 60, 800, 0, "the measure that fills it: doubles"},
		{200, 150, 150, 100, M, 500, 300, 400, "filling: demand still grows it"},
		{1000, 600, 600, 0, M, 0, 1500, 0, "a growth is at least 1.5x"},
		{1000, 100, 0, 0, M, 0, 1000, 0, "kvt_select's measure: no reads, no miss growth"},
		{1ull << 40, 1ull << 39, 1ull << 39, 1ull << 39, M, 0, 1ull << 41, 0, "large"},
		{0, 100, 100, 100, 150, 0, 150, 0, "empty: twice the demand, within the rows"},
		{200, 100, 100, 30, 300, 0, 300, 0, "doubling stops at the served rows"},
		{1000, 600, 600, 0, 1200, 0, 1200, 0, "a growth of 1.5x too"},
		{400, 300, 300, 100, 300, 0, 400, 0, "more than the served rows: stays, unshrunk"},
		{300, 100, 100, 90, 300, 0, 300, 0, "holds every served row: stays"},
		{800, 600, 600, 0, 899, 0, 800, 0, "cut by the rows to less than an eighth: stays"},
		{800, 600, 600, 0, 900, 0, 900, 0, "to an eighth more: grows to the rows"},
		{800, 100, 100, 90, 808, 0, 800, 0, "drifting at the rows, a set more: stays"},
	};
	int nfail = 0;
	for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
		uint64_t f;
		const uint64_t r = want(cs[i].have, cs[i].demand, cs[i].reads, cs[i].misses,
					cs[i].served, cs[i].to_fill, &f);
		T_SOFT(&nfail, r == cs[i].rows && f == cs[i].to_fill_after,
		       "%s: have %llu demand %llu reads %llu misses %llu served %llu to fill %llu: "
		       "got %llu rows (to fill %llu), wanted %llu (to fill %llu)",
		       cs[i].what, (unsigned long long)cs[i].have, (unsigned long long)cs[i].demand,
		       (unsigned long long)cs[i].reads, (unsigned long long)cs[i].misses,
		       (unsigned long long)cs[i].served, (unsigned long long)cs[i].to_fill,
		       (unsigned long long)r,
		       (unsigned long long)f, (unsigned long long)cs[i].rows,
		       (unsigned long long)cs[i].to_fill_after);
	}
	T_CHECK(nfail == 0, "%d of the rule's cases failed", nfail);
}

/*
 * The rule applied as gpu/hot.c applies it, within a bound of `cap` rows, over 60 measures of 1000
 * rows: the first (an empty cache) misses them all, later ones a share miss_pct while the cache
 * holds fewer than `reused` rows (the rows the queries come back to) and none once it holds them.
 * Returns the rows reached; *growths and *last (the measure of the last growth) say how.
 */
static uint64_t run(uint32_t miss_pct, uint64_t reused, uint64_t cap, uint32_t *growths,
		    uint32_t *last)
{
	const uint64_t demand = 1000;
	uint64_t have = 0, to_fill = 0;
	*growths = 0;
	*last = 0;
	for (uint32_t m = 0; m < 60; m++) {
		uint64_t misses = demand * miss_pct / 100;
		if (m == 0 || have >= reused)
			misses = m == 0 ? demand : 0;
		uint64_t r = kvt_hot_rows_wanted(have, demand, demand, misses, UINT64_MAX,
						 &to_fill);
		r = r < cap ? r : cap;
		if (r > have) {
			to_fill = r - have;
			have = r;
			++*growths;
			*last = m;
		}
	}
	return have;
}

static void test_runs(void **state)
{
	(void)state;
	const uint64_t never = UINT64_MAX, unbounded = UINT64_MAX;
	uint32_t g, last;
	uint64_t r = run(5, never, unbounded, &g, &last);
	printf("steady (5 %% missed): %llu rows, %u growths\n", (unsigned long long)r, g);
	T_CHECK(r == 2000 && g == 1, "steady: %llu rows after %u growths, wanted 2000 after 1",
		(unsigned long long)r, g);
	/* 400 misses a measure fill 2000 new ways in 5 measures, 4000 in 10, ...: 2000 at measure
	 * 0, then 4000, 8000, 16000, 32000 at measures 5, 10, 20, 40 */
	r = run(40, never, unbounded, &g, &last);
	printf("drifting (40 %% missed): %llu rows, %u growths, the last at measure %u\n",
	       (unsigned long long)r, g, last);
	T_CHECK(r == 32000 && g == 5 && last == 40,
		"drifting: %llu rows after %u growths (the last at %u), wanted 32000 after 5 (at "
		"40)",
		(unsigned long long)r, g, last);
	r = run(40, never, 10000, &g, &last);
	T_CHECK(r == 10000 && g == 4 && last == 20,
		"drifting, bounded: %llu rows after %u growths (the last at %u), wanted 10000 "
		"after 4 (at 20)", (unsigned long long)r, g, last);
	r = run(40, 6000, unbounded, &g, &last);
	T_CHECK(r == 8000 && g == 3, "drifting over 6000 rows: %llu rows after %u growths, wanted "
		"8000 after 3", (unsigned long long)r, g);
	r = run(40, never, 1500, &g, &last);
	T_CHECK(r == 1500 && g == 1, "bounded below the demand: %llu rows after %u growths",
		(unsigned long long)r, g);
}

/*
 * Contexts that grow by a set of 8 rows a measure (a token on 8 KV heads), under queries that miss
 * 40 % of their 1000 rows whatever the cache holds: the cache reaches the served rows, then grows
 * with them only by an eighth at a time, not a set a measure as a bare clamp to them would.
 */
static void test_growing_contexts(void **state)
{
	(void)state;
	const uint64_t demand = 1000, misses = 400;
	uint64_t have = 0, to_fill = 0, served = 4000;
	uint32_t growths = 0, at_bound = 0;
	for (uint32_t m = 0; m < 400; m++, served += 8) {
		const uint64_t miss = m ? misses : demand; /* the first measure misses all */
		const uint64_t r =
			kvt_hot_rows_wanted(have, demand, demand, miss, served, &to_fill);
		T_CHECK(r >= have && r <= served, "measure %u: %llu rows, had %llu, %llu served", m,
			(unsigned long long)r, (unsigned long long)have,
			(unsigned long long)served);
		if (r > have) {
			T_CHECK(r - have >= have / 8, "measure %u: grew %llu to %llu rows", m,
				(unsigned long long)have, (unsigned long long)r);
			at_bound += have > 0 && r == served;
			to_fill = r - have;
			have = r;
			growths++;
		}
	}
	printf("contexts growing 8 rows a measure from 4000 to %llu: %llu rows after %u growths, "
	       "%u of them to the served rows\n", (unsigned long long)served,
	       (unsigned long long)have, growths, at_bound);
	T_CHECK(growths <= 8 && at_bound >= 2 && 8 * have >= 7 * served,
		"%u growths (%u to the served rows) to %llu rows of %llu served", growths, at_bound,
		(unsigned long long)have, (unsigned long long)served);
}

/*
 * The rule's properties over a million random measures (sizes up to 20000 rows, the served rows
 * sometimes unbounded): it never shrinks the cache, never grows it past the served rows nor by
 * less than an eighth, picks one of its candidates (twice the demand, twice the cache, 1.5x the
 * cache, the served rows), takes the misses off the ways left to fill, grows no less for more
 * served rows, and gives with the served rows what kvt_hot_within gives afterwards on its
 * unbounded result (the lazy path gpu/hot.c takes).
 */
static void test_properties(void **state)
{
	(void)state;
	t_rng rng;
	t_rng_seed(&rng, 0x407517e5);
	const uint64_t M = UINT64_MAX;
	for (uint32_t i = 0; i < 1000000; i++) {
		const uint64_t have = t_below(&rng, 4) ? t_below(&rng, 20000) : 0;
		const uint64_t demand = t_below(&rng, 10000), reads = demand + t_below(&rng, 100);
		const uint64_t misses = t_below(&rng, (uint32_t)reads + 1);
		const uint64_t served = t_below(&rng, 8) ? t_below(&rng, 30000) : M;
		const uint64_t fill = t_below(&rng, 2) ? t_below(&rng, 3000) : 0;
		const uint64_t more = served == M ? M : served + t_below(&rng, 5000);
		uint64_t f = fill, f_lazy = fill, f_more = fill;
		const uint64_t r = kvt_hot_rows_wanted(have, demand, reads, misses, served, &f);
		const uint64_t lazy = kvt_hot_within(
			have, kvt_hot_rows_wanted(have, demand, reads, misses, M, &f_lazy), served);
		const uint64_t r_more =
			kvt_hot_rows_wanted(have, demand, reads, misses, more, &f_more);
		const bool candidate = r == have || r == 2 * demand || r == 2 * have ||
				       r == have * KVT_HOT_GROWTH_NUM / KVT_HOT_GROWTH_DEN ||
				       r == served;
		T_CHECK(r >= have && r <= (served > have ? served : have) &&
				(r == have || r - have >= have / KVT_HOT_SERVED_STEP_DEN) &&
				candidate && f == (fill <= misses ? 0 : fill - misses) &&
				lazy == r && f_lazy == f && r_more >= r,
			"seed %llx measure %u: have %llu demand %llu reads %llu misses %llu served "
			"%llu to fill %llu: %llu rows (to fill %llu), lazily %llu, with %llu served "
			"%llu", (unsigned long long)rng.seed, i, (unsigned long long)have,
			(unsigned long long)demand, (unsigned long long)reads,
			(unsigned long long)misses, (unsigned long long)served,
			(unsigned long long)fill, (unsigned long long)r, (unsigned long long)f,
			(unsigned long long)lazy, (unsigned long long)more,
			(unsigned long long)r_more);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_cases),
					   cmocka_unit_test(test_runs),
					   cmocka_unit_test(test_growing_contexts),
					   cmocka_unit_test(test_properties)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
