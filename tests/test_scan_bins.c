/* SPDX-License-Identifier: MIT */
/*
 * The Top-p threshold from the scan's ring (gpu/scanring.h), on the CPU: the arithmetic the
 * threshold's consumer of kvt_gpu_score's bins (gpu/select.cu's hist_from_ring) does, checked
 * without a GPU (issue 15, point 1). On
 * random score sets of every t_scores distribution, sizes 1 to 70000, several scales and p:
 * - a segment the ring serves (kvt_bins_serves) has every score binned, and a segment it does not
 *   spans KVT_BINS / G nats or more (64 at G = 32 bins a nat), or reaches past the domain;
 * - every D lies below KVT_BINS_DMAX, so that a scan block's slot sums fit 32 bits;
 * - kvt_bins_power(j) lies within 2^-42 of e^(-j/G), kvt_bins_exp_small(c) within 2^-52 of e^c;
 * - each slot's mass (kvt_bins_mass with those two factors) lies within 2^-21 of its exact mass
 *   (long double) plus one unit of 2^-40;
 * - the set decided from those masses (the cut's bin by the converted prefix, then the bin's
 *   scores one by one with their own terms) differs from the exact Top-p set only in tokens whose
 *   mass-above lies within tol = 2^-19 Z + n 2^-38 of p Z, and covers at least p Z - tol: the
 *   guarantee doc/selection.md states for the GPU threshold.
 * Built twice: at the library's grid (G = KVT_BINS_GRID, 32) and as test_scan_bins_16 at 1/16 nat,
 * the width doc/selection.md weighs for the ring.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gpu/scanring.h"

_Static_assert((uint64_t)KVT_BINS_BLOCK_TOKENS * KVT_BINS_DMAX < (1ull << 32),
	       "a scan block's slot sums of D fit 32 bits");

#define SPAN_NATS ((long double)KVT_BINS / KVT_BINS_GRID) /* what the ring's slots span */

/* A term as the threshold computes it (exp((s - max) scale) in 2^-40 units, truncated), in long
 * double here: within the per-term bound of the float one. */
static uint64_t term40(float s, float max, float scale)
{
	return (uint64_t)(expl((long double)(s - max) * scale) * 0x1p40L);
}

static uint64_t g_cases, g_served, g_differ;

/* One segment: returns false when the ring does not serve it. */
static bool check_segment(const float *x, uint32_t n, float scale, float p, float *sorted,
			  long double *above)
{
	float mx = x[0], mn = x[0];
	for (uint32_t i = 1; i < n; i++) {
		mx = x[i] > mx ? x[i] : mx;
		mn = x[i] < mn ? x[i] : mn;
	}
	g_cases++;
	if (!kvt_bins_serves(mx, mn, scale)) {
		const bool far = (long double)(mx - mn) * scale >= SPAN_NATS - 0.1L ||
				 fabsl((long double)mx * scale) >= 4095.0L ||
				 fabsl((long double)mn * scale) >= 4095.0L;
		T_CHECK(far, "a segment of span %.3Lg nats at scale %g not served",
			(long double)(mx - mn) * scale, (double)scale);
		return false;
	}
	g_served++;
	/* the ring, as the scan's blocks build it */
	static uint32_t cnt[KVT_BINS];
	static uint64_t dsum[KVT_BINS];
	static long double exact[KVT_BINS];
	memset(cnt, 0, sizeof cnt);
	memset(dsum, 0, sizeof dsum);
	for (uint32_t j = 0; j < KVT_BINS; j++)
		exact[j] = 0;
	const int32_t bm = kvt_bins_bin(mx, scale);
	for (uint32_t i = 0; i < n; i++) {
		uint32_t slot = 0, dv = 0;
		T_CHECK(kvt_bins_of(x[i], scale, &slot, &dv), "score %.9g not binned",
			(double)x[i]);
		T_CHECK(dv < KVT_BINS_DMAX, "score %.9g: D %u, bound %u", (double)x[i], dv,
			KVT_BINS_DMAX);
		cnt[slot]++;
		dsum[slot] += dv;
		const int32_t j = kvt_bins_bin(x[i], scale) - bm;
		T_CHECK(j >= 0 && j < (int32_t)KVT_BINS &&
				((uint32_t)(bm + j) & (KVT_BINS - 1)) == slot,
			"score %.9g: bin %d below the max's, slot %u", (double)x[i], j, slot);
		exact[j] += expl(((long double)x[i] - mx) * scale) * 0x1p40L;
	}
	/* the consumer: slot masses, the cut's bin, then the bin's scores one by one */
	const uint32_t nb = (uint32_t)(kvt_bins_bin(mn, scale) - bm) + 1;
	const double f = kvt_bins_exp_small(kvt_bins_offset(mx, scale, bm));
	static uint64_t m[KVT_BINS];
	uint64_t z = 0;
	for (uint32_t j = 0; j < nb; j++) {
		const uint32_t slot = (uint32_t)(bm + (int32_t)j) & (KVT_BINS - 1);
		m[j] = kvt_bins_mass(cnt[slot], dsum[slot], kvt_bins_power(j), f);
		T_CHECK(fabsl((long double)m[j] - exact[j]) <= 0x1p-21L * exact[j] + 1.0L,
			"bin %u of %u (%u scores): mass %llu, exact %.6Lf (scale %g)", j, nb,
			cnt[slot], (unsigned long long)m[j], exact[j], (double)scale);
		z += m[j];
	}
	const double target = (double)p * (double)z;
	uint32_t c = 0;
	uint64_t a = 0;
	while (c + 1 < nb && !((double)(a + m[c]) >= target)) /* A_c < target <= A_c + m_c */
		a += m[c++];
	uint32_t k = 0; /* the cut bin's scores, largest first */
	for (uint32_t i = 0; i < n; i++)
		if ((uint32_t)(kvt_bins_bin(x[i], scale) - bm) == c)
			sorted[k++] = x[i];
	qsort(sorted, k, sizeof(float), t_cmp_desc);
	float thresh = sorted[0];
	uint64_t est = a;
	for (uint32_t i = 0; i < k;) {
		uint32_t e = i; /* a tie group goes in or out together */
		while (e < k && sorted[e] == sorted[i])
			e++;
		if (!((double)est < target))
			break;
		thresh = sorted[i];
		for (; i < e; i++)
			est += term40(sorted[i], mx, scale);
	}
	/* against the exact set: terms exp(fl(s - max) scale), masses in long double */
	memcpy(sorted, x, 4 * (size_t)n);
	qsort(sorted, n, sizeof(float), t_cmp_desc);
	long double zx = 0;
	for (uint32_t i = 0; i < n; i++) {
		above[i] = i && sorted[i] == sorted[i - 1] ? above[i - 1] : zx;
		zx += expl((long double)(sorted[i] - mx) * scale);
	}
	const long double tol = 0x1p-19L * zx + n * 0x1p-38L, pz = (long double)p * zx;
	long double covered = 0;
	int bad = 0;
	for (uint32_t i = 0; i < n; i++) {
		const bool in = sorted[i] >= thresh, want = above[i] < pz;
		if (in)
			covered += expl((long double)(sorted[i] - mx) * scale);
		if (in != want) {
			g_differ++;
			T_SOFT(&bad, fabsl(above[i] - pz) <= tol,
			       "n %u scale %g p %g: token of rank %u %s, mass above %.12Lg against "
			       "p Z %.12Lg (tol %.3Lg)",
			       n, (double)scale, (double)p, i, in ? "in" : "out", above[i], pz,
			       tol);
		}
	}
	T_CHECK(bad == 0, "%d tokens outside the window", bad);
	T_CHECK(covered >= pz - tol, "covered %.12Lg < p Z - tol %.12Lg", covered, pz - tol);
	return true;
}

static void test_ring_threshold(void **state)
{
	(void)state;
	for (uint32_t j = 0; j < KVT_BINS; j++) {
		const long double w = expl(-(long double)j / KVT_BINS_GRID);
		T_CHECK(fabsl(kvt_bins_power(j) - w) <= 0x1p-42L * w,
			"e^(-%u/%d): %.17g, exact %.20Lg", j, KVT_BINS_GRID, kvt_bins_power(j), w);
	}
	for (int i = -64; i <= 32768 / KVT_BINS_GRID; i++) { /* c in [-2^-9, 1/G] */
		const double c = i * 0x1p-15;
		T_CHECK(fabsl(kvt_bins_exp_small(c) - expl(c)) <= 0x1p-52L * expl(c),
			"e^%.9g: %.17g, exact %.20Lg", c, kvt_bins_exp_small(c), expl(c));
	}
	const uint32_t ns[5] = {1, 2, 100, 4099, 70000};
	const float scales[4] = {0.0884f, 0.3f, 1.0f, 5.0f}, ps[3] = {0.5f, 0.9f, 0.99f};
	float *x = (float *)t_alloc(4 * 70000), *sorted = (float *)t_alloc(4 * 70000);
	long double *above = (long double *)t_alloc(sizeof(long double) * 70000);
	t_rng r;
	t_rng_seed(&r, 0x5ca7b1u);
	for (int d = 0; d < D_NDIST; d++)
		for (int ni = 0; ni < 5; ni++)
			for (int si = 0; si < 4; si++)
				for (int pi = 0; pi < 3; pi++) {
					t_scores(&r, (enum t_dist)d, ns[ni], x);
					check_segment(x, ns[ni], scales[si], ps[pi], sorted, above);
				}
	printf("ring threshold at 1/%d nat: %llu segments, %llu served by the ring, %llu tokens "
	       "off the exact set (all within the tolerance)\n",
	       KVT_BINS_GRID, (unsigned long long)g_cases, (unsigned long long)g_served,
	       (unsigned long long)g_differ);
	T_CHECK(g_served > g_cases / 2, "only %llu of %llu segments served",
		(unsigned long long)g_served, (unsigned long long)g_cases);
	free(x);
	free(sorted);
	free(above);
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_ring_threshold)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
