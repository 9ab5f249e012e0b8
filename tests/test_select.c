/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection (lib/select.c) against the sort-based definition computed in double: the
 * threshold and count, the k-th largest, budget clamping with ties, and rejection of non-finite
 * scores; the keyed form (ranked by keys, the mass the scores') against its own definition.
 */
#include "common.h"

/*
 * The definition: sort descending, take the smallest prefix whose softmax(score * scale) mass is
 * >= p, threshold = the score ending it, selected = every score >= threshold. In long double.
 * *mass_before / *mass_at receive the cumulative mass without and with the boundary score, for
 * diagnostics.
 */
static uint32_t ref_topp(const float *s, uint32_t n, float scale, float p, float *thr,
			 double *mass_before, double *mass_at)
{
	float *a = (float *)t_alloc(sizeof(float) * n);
	memcpy(a, s, sizeof(float) * n);
	qsort(a, n, sizeof(float), t_cmp_desc);
	long double z = 0, cum = 0, prev = 0;
	for (uint32_t i = 0; i < n; i++)
		z += expl(((long double)a[i] - a[0]) * scale);
	uint32_t m = n;
	if (p < 1)
		for (uint32_t i = 0; i < n; i++) {
			prev = cum;
			cum += expl(((long double)a[i] - a[0]) * scale) / z;
			if (cum >= p) {
				m = i + 1;
				break;
			}
		}
	*thr = a[m - 1];
	*mass_before = (double)prev;
	*mass_at = (double)cum;
	uint32_t count = 0;
	for (uint32_t i = 0; i < n; i++)
		count += s[i] >= *thr;
	free(a);
	return count;
}

static void test_threshold_vs_sort(void **state)
{
	(void)state;
	const uint32_t ns[] = {1, 2, 3, 10, 257, 4096, 100000};
	const float ps[] = {1e-6f, 0.1f, 0.63f, 0.9f, 0.999f, 1.0f};
	const float scales[] = {1.0f, 0.125f};
	float *s = (float *)t_alloc(sizeof(float) * 100000), *scr = (float *)t_alloc(sizeof(float) * 100000);
	int cases = 0;
	for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
		for (int kind = 0; kind < D_NDIST; kind++)
			for (size_t si = 0; si < 2; si++) {
				uint64_t seed = 0x70b0000u + ni * 100 + (uint64_t)kind * 10 + si;
				t_rng rng;
				t_rng_seed(&rng, seed);
				uint32_t n = ns[ni];
				t_scores(&rng, (enum t_dist)kind, n, s);
				for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
					float p = ps[pi], scale = scales[si], thr = NAN, wthr;
					uint32_t bad = 12345;
					double mb, ma;
					uint32_t want = ref_topp(s, n, scale, p, &wthr, &mb, &ma);
					int got = kvt_topp_threshold(s, n, scale, p, scr, &thr, &bad);
					T_CHECK(got == (int)want && thr == wthr,
						"%s n=%u p=%g scale=%g seed 0x%llx: count got %d, wanted %u; "
						"threshold got %.9g, wanted %.9g (mass before/at the "
						"boundary %.12f / %.12f)",
						t_dist_name[kind], n, (double)p, (double)scale,
						(unsigned long long)seed, got, want, (double)thr,
						(double)wthr, mb, ma);
					if (p >= 1.0f || kind == D_UNIFORM)
						T_CHECK(got == (int)n, "%s n=%u p=%g: got %d, wanted all",
							t_dist_name[kind], n, (double)p, got);
					cases++;
				}
			}
	T_CHECK(cases == 7 * D_NDIST * 2 * 6, "cases run: got %d", cases);
	free(s);
	free(scr);
}

/* The keyed definition: pairs sorted by key descending (ties: any order, the boundary key takes
 * them all), the smallest prefix whose mass of softmax(score * scale) reaches p, threshold = the
 * key ending it, selected = every key >= threshold. In long double. */
static const float *ref_keys;
static int cmp_key_desc(const void *a, const void *b)
{
	const float x = ref_keys[*(const uint32_t *)a], y = ref_keys[*(const uint32_t *)b];
	return (x < y) - (x > y);
}

static uint32_t ref_topp_keyed(const float *s, const float *k, uint32_t n, float scale, float p,
			       float *thr)
{
	uint32_t *o = t_alloc(sizeof(uint32_t) * n);
	float mx = s[0];
	for (uint32_t i = 0; i < n; i++) {
		o[i] = i;
		mx = s[i] > mx ? s[i] : mx;
	}
	ref_keys = k;
	qsort(o, n, sizeof *o, cmp_key_desc);
	long double z = 0, cum = 0;
	for (uint32_t i = 0; i < n; i++)
		z += expl(((long double)s[i] - mx) * scale);
	uint32_t m = n;
	for (uint32_t i = 0; p < 1 && i < n; i++) {
		/* every pair of this key at once: the boundary key takes its ties */
		uint32_t j = i;
		while (j < n && k[o[j]] == k[o[i]])
			cum += expl(((long double)s[o[j++]] - mx) * scale) / z;
		if (cum >= p) {
			m = j;
			break;
		}
		i = j - 1;
	}
	*thr = k[o[m - 1]];
	uint32_t count = 0;
	for (uint32_t i = 0; i < n; i++)
		count += k[i] >= *thr;
	free(o);
	return count;
}

/* Top-p ranked by keys (kvt_config.keep_weight: a third of the tokens ranked higher by a bonus)
 * with the scores' mass, against the keyed definition; a zero bonus selects the unkeyed set; and
 * a budget cap keeps the largest keys. */
static void test_threshold_keyed(void **state)
{
	(void)state;
	const uint32_t ns[] = {1, 3, 10, 257, 4096};
	const float ps[] = {0.1f, 0.63f, 0.9f, 0.999f, 1.0f}, bonus[] = {0.0f, 0.5f, 3.0f};
	float *s = t_alloc(sizeof(float) * 4096), *k = t_alloc(sizeof(float) * 4096);
	float *scr = t_alloc(sizeof(float) * 2 * 4096);
	uint8_t *mask = t_alloc(4096);
	int cases = 0;
	for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
		for (int kind = 0; kind < D_NDIST; kind++)
			for (size_t bi = 0; bi < 3; bi++) {
				t_rng rng;
				t_rng_seed(&rng, 0x6ee0000u + ni * 100 + (uint64_t)kind * 10 + bi);
				const uint32_t n = ns[ni];
				const float scale = bi == 2 ? 0.125f : 1.0f;
				t_scores(&rng, (enum t_dist)kind, n, s);
				for (uint32_t i = 0; i < n; i++)
					k[i] = t_next(&rng) % 3 == 0 ? s[i] + bonus[bi] / scale : s[i];
				for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
					float thr = NAN, wthr, uthr;
					uint32_t bad = 0;
					const uint32_t want =
						ref_topp_keyed(s, k, n, scale, ps[pi], &wthr);
					const int got = kvt_topp_threshold_keyed(s, k, n, scale, ps[pi],
										 scr, &thr, &bad);
					T_CHECK(got == (int)want && thr == wthr,
						"%s n=%u p=%g bonus %g: count got %d, wanted %u; "
						"threshold got %.9g, wanted %.9g", t_dist_name[kind], n,
						(double)ps[pi], (double)bonus[bi], got, want, (double)thr,
						(double)wthr);
					if (bi == 0) {
						const int u = kvt_topp_threshold(s, n, scale, ps[pi], scr,
										 &uthr, &bad);
						T_CHECK(u == got && uthr == thr,
							"%s n=%u p=%g: keys = scores select %d at %.9g, "
							"unkeyed %d at %.9g", t_dist_name[kind], n,
							(double)ps[pi], got, (double)thr, u, (double)uthr);
					}
					cases++;
				}
				/* a cap below the set keeps the cap's largest keys */
				const uint32_t cap = n / 4 + 1;
				int clamped = 0;
				uint32_t bad = 0;
				memset(mask, 0, n);
				const int got = kvt_topp_mark(s, k, n, scale, 0.999f, 0, cap, scr, mask,
							      &clamped, &bad);
				uint32_t marked = 0;
				float low = INFINITY, high = -INFINITY; /* least marked, most unmarked */
				for (uint32_t i = 0; i < n; i++) {
					marked += mask[i];
					if (mask[i])
						low = k[i] < low ? k[i] : low;
					else
						high = k[i] > high ? k[i] : high;
				}
				T_CHECK(got >= 0 && (uint32_t)got == marked && marked <= cap &&
						(clamped == 0 || marked == cap) && low >= high,
					"%s n=%u bonus %g, cap %u: marked %u (returned %d, clamped %d), "
					"least marked key %g, most unmarked %g", t_dist_name[kind], n,
					(double)bonus[bi], cap, marked, got, clamped, (double)low,
					(double)high);
			}
	T_CHECK(cases == 5 * D_NDIST * 3 * 5, "cases run: got %d", cases);
	free(s);
	free(k);
	free(scr);
	free(mask);
}

static void test_nonfinite_rejected(void **state)
{
	(void)state;
	const float bads[3] = {NAN, INFINITY, -INFINITY};
	const char *names[3] = {"NaN", "+inf", "-inf"};
	enum { N = 50 };
	float s[N], scr[N], thr = 7.0f;
	uint8_t mask[N];
	t_rng rng;
	t_rng_seed(&rng, 0xbad);
	for (int b = 0; b < 3; b++)
		for (uint32_t at = 0; at < N; at += 7) {
			for (uint32_t i = 0; i < N; i++)
				s[i] = (float)t_normal(&rng);
			s[at] = bads[b];
			uint32_t bad = 9999;
			int rc = kvt_topp_threshold(s, N, 1.0f, 0.9f, scr, &thr, &bad);
			T_CHECK(rc == -EINVAL && bad == at,
				"threshold with %s at %u: got rc %d bad %u, wanted %d and %u", names[b],
				at, rc, bad, -EINVAL, at);
			bad = 9999;
			int clamped = 0;
			memset(mask, 0, sizeof mask);
			rc = kvt_topp_mark(s, NULL, N, 1.0f, 0.9f, 2, 10, scr, mask, &clamped, &bad);
			T_CHECK(rc == -EINVAL && bad == at,
				"mark with %s at %u: got rc %d bad %u, wanted %d and %u", names[b], at,
				rc, bad, -EINVAL, at);
			/* also when p = 1 would select everything without looking at mass */
			bad = 9999;
			rc = kvt_topp_threshold(s, N, 1.0f, 1.0f, scr, &thr, &bad);
			T_CHECK(rc == -EINVAL && bad == at,
				"threshold p=1 with %s at %u: got rc %d bad %u, wanted %d and %u",
				names[b], at, rc, bad, -EINVAL, at);
		}
}

static void test_kth_largest(void **state)
{
	(void)state;
	const uint32_t ns[] = {1, 2, 5, 100, 10000};
	float *s = (float *)t_alloc(sizeof(float) * 10000), *sorted = (float *)t_alloc(sizeof(float) * 10000),
	      *scr = (float *)t_alloc(sizeof(float) * 10000), *keep = (float *)t_alloc(sizeof(float) * 10000);
	for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
		for (int kind = 0; kind < D_NDIST; kind++) {
			uint32_t n = ns[ni];
			t_rng rng;
			t_rng_seed(&rng, 0x4747u + ni * 10 + (uint64_t)kind);
			t_scores(&rng, (enum t_dist)kind, n, s);
			memcpy(sorted, s, sizeof(float) * n);
			memcpy(keep, s, sizeof(float) * n);
			qsort(sorted, n, sizeof(float), t_cmp_desc);
			uint32_t ms[5] = {1, n, (n + 1) / 2, 1 + t_below(&rng, n), n > 1 ? 2 : 1};
			for (int mi = 0; mi < 5; mi++) {
				float got = kvt_kth_largest(s, n, ms[mi], scr);
				T_CHECK(got == sorted[ms[mi] - 1],
					"%s n=%u m=%u (seed 0x%llx): got %.9g, wanted %.9g",
					t_dist_name[kind], n, ms[mi], (unsigned long long)rng.seed,
					(double)got, (double)sorted[ms[mi] - 1]);
			}
			T_CHECK(memcmp(s, keep, sizeof(float) * n) == 0,
				"%s n=%u: kvt_kth_largest modified its input", t_dist_name[kind], n);
		}
	free(s);
	free(sorted);
	free(scr);
	free(keep);
}

/* Ordering of positions by (score descending, position ascending). */
static const float *order_scores;
static int cmp_pos(const void *a, const void *b)
{
	uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
	float x = order_scores[i], y = order_scores[j];
	if (x != y)
		return x > y ? -1 : 1;
	return (i > j) - (i < j);
}

/* One kvt_topp_mark call against the definition; the mask starts with `pre`. */
static void check_mark(const char *what, const float *s, uint32_t n, float scale, float p,
		       uint32_t bmin, uint32_t bmax, const uint8_t *pre)
{
	float thr;
	double mb, ma;
	uint32_t count = ref_topp(s, n, scale, p, &thr, &mb, &ma);
	uint32_t want = count;
	int wclamp = 0;
	if (bmax && count > bmax) {
		want = bmax;
		wclamp = -1;
	} else if (count < bmin && count < n) {
		want = bmin < n ? bmin : n;
		wclamp = 1;
	}
	uint8_t *expect = (uint8_t *)t_alloc(n), *mask = (uint8_t *)t_alloc(n);
	float *scr = (float *)t_alloc(sizeof(float) * n);
	uint32_t *ord = (uint32_t *)t_alloc(sizeof(uint32_t) * n);
	if (wclamp == 0) {
		for (uint32_t i = 0; i < n; i++)
			expect[i] = s[i] >= thr;
	} else {
		for (uint32_t i = 0; i < n; i++)
			ord[i] = i;
		order_scores = s;
		qsort(ord, n, sizeof *ord, cmp_pos);
		for (uint32_t i = 0; i < want; i++)
			expect[ord[i]] = 1;
	}
	memcpy(mask, pre, n);
	int clamped = 99;
	uint32_t bad = 0;
	int got = kvt_topp_mark(s, NULL, n, scale, p, bmin, bmax, scr, mask, &clamped, &bad);
	T_CHECK(got == (int)want && clamped == wclamp,
		"%s n=%u p=%g bmin=%u bmax=%u: returned %d clamped %d, wanted %u and %d (top-p count "
		"%u)",
		what, n, (double)p, bmin, bmax, got, clamped, want, wclamp, count);
	uint32_t marked = 0;
	for (uint32_t i = 0; i < n; i++) {
		int w = expect[i] || pre[i];
		T_CHECK((mask[i] != 0) == w,
			"%s n=%u p=%g bmin=%u bmax=%u: mask[%u] got %u, wanted %s (score %.9g, was "
			"%u before)",
			what, n, (double)p, bmin, bmax, i, mask[i], w ? "set" : "clear", (double)s[i],
			pre[i]);
		marked += expect[i];
	}
	T_CHECK(marked == want, "%s: expected set has %u, wanted %u", what, marked, want);
	free(expect);
	free(mask);
	free(scr);
	free(ord);
}

static void test_mark_budget(void **state)
{
	(void)state;
	/* ties at the boundary: the lowest positions win */
	const float tie_top[6] = {1, 5, 5, 5, 0, 5};
	const float tie_mid[6] = {5, 2, 0, 2, 2, -1};
	uint8_t zero[6] = {0}, some[6] = {0, 0, 1, 0, 0, 0};
	check_mark("four tied maxima cut to 2", tie_top, 6, 1, 1e-6f, 0, 2, zero);
	check_mark("four tied maxima cut to 3, mask pre-set", tie_top, 6, 1, 1e-6f, 0, 3, some);
	check_mark("four tied maxima raised to 5", tie_top, 6, 1, 1e-6f, 5, 0, zero);
	check_mark("one max raised to 3 through ties", tie_mid, 6, 1, 1e-6f, 3, 0, zero);
	check_mark("one max raised to 2, mask pre-set", tie_mid, 6, 1, 1e-6f, 2, 4, some);
	check_mark("bmin above n marks all", tie_mid, 6, 1, 1e-6f, 9, 0, zero);
	check_mark("within bounds, not clamped", tie_top, 6, 1, 1e-6f, 2, 4, zero);
	check_mark("count equal to bmax", tie_top, 6, 1, 1e-6f, 1, 4, zero);

	const uint32_t n = 3000;
	float *s = (float *)t_alloc(sizeof(float) * n);
	uint8_t *pre = (uint8_t *)t_alloc(n);
	const uint32_t bounds[][2] = {{0, 0}, {0, 10}, {50, 0}, {20, 60}, {1, 1}, {2999, 0}, {0, 3000}};
	for (int kind = 0; kind < D_NDIST; kind++)
		for (size_t bi = 0; bi < sizeof bounds / sizeof *bounds; bi++) {
			t_rng rng;
			t_rng_seed(&rng, 0x3a2c0000u + (uint64_t)kind * 100 + bi);
			t_scores(&rng, (enum t_dist)kind, n, s);
			for (uint32_t i = 0; i < n; i++)
				pre[i] = t_below(&rng, 10) == 0;
			char what[96];
			snprintf(what, sizeof what, "%s (seed 0x%llx)", t_dist_name[kind],
				 (unsigned long long)rng.seed);
			check_mark(what, s, n, 0.5f, 0.8f, bounds[bi][0], bounds[bi][1], pre);
			check_mark(what, s, n, 1.0f, 0.3f, bounds[bi][0], bounds[bi][1], pre);
		}
	free(s);
	free(pre);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_threshold_vs_sort),
		cmocka_unit_test(test_threshold_keyed),
		cmocka_unit_test(test_nonfinite_rejected),
		cmocka_unit_test(test_kth_largest),
		cmocka_unit_test(test_mark_budget),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
