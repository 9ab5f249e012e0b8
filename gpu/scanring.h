/* SPDX-License-Identifier: MIT */
/*
 * The scan's ring as the Top-p threshold reads it (issue 15, point 1; gpu/select.cu's
 * hist_from_ring, the consumer of kvt_gpu_score's bins, gpu/scanbins.h): which segments it can
 * serve, and each slot's mass in the threshold's units, computed the same on host and device;
 * and the ring built on the host, for tests and benchmarks. tests/test_scan_bins.c checks on the
 * CPU that a Top-p set decided from these masses keeps the GPU threshold's stated tolerance. C
 * and CUDA; kept apart from scanbins.h so that the scan's kernel does not include it (adding these
 * to what it includes changed the code nvcc generated for it).
 */
#ifndef KVT_GPU_SCANRING_H
#define KVT_GPU_SCANRING_H

#include "scanbins.h"

/*
 * What the threshold does with the ring (doc/selection.md). Given a segment's max M and min m (its
 * statistics), the ring can serve it when both are binned and
 * kvt_bins_bin(m) - kvt_bins_bin(M) < KVT_BINS: every score's slot then holds its bin alone, the
 * slot of bin b_M + j being (b_M + j) mod KVT_BINS for j = 0, 1, ... Slot j's mass, in the
 * threshold's units (2^-40 of e^(M scale), gpu/select.cu), for its count k and sum of D S, is
 *   2^19 (k 2^21 - (S - KVT_BINS_DOFF k)) e^(e_b - M scale), e_b = -(b_M + j) / G,
 * with e^(e_b - M scale) = e^(-j / G) e^c, c = -b_M / G - M scale (exact in double, in
 * [-2^-13, 1/G]; G = KVT_BINS_GRID, scanbins.h): the first factor from kvt_bins_power, the second
 * from kvt_bins_exp_small, both the same sequence of double operations on host and device, so
 * that both convert to the same integers (no table to upload, no libm exp to differ in the last
 * bit).
 */

/* Whether the ring can serve a segment of finite scores with this max and min (above; the
 * threshold also wants few candidates in the boundary bins, gpu/select.cu). */
KVT_BINS_FN bool kvt_bins_serves(float max, float min, float scale)
{
	return kvt_bins_in(max, scale) && kvt_bins_in(min, scale) &&
	       kvt_bins_bin(min, scale) - kvt_bins_bin(max, scale) < (int32_t)KVT_BINS;
}

/* e^c for |c| <= 2^-5 in double: Taylor to c^8 (truncation below 2^-60; 2^-54 for |c| <= 2^-4,
 * at 1/16 nat) evaluated with fma. */
KVT_BINS_FN double kvt_bins_exp_small(double c)
{
	double p = 0x1.a01a01a01a01ap-16; /* 1/8!, then 1/7! ... 1/2!, 1, 1 */
	p = fma(c, p, 0x1.a01a01a01a01ap-13);
	p = fma(c, p, 0x1.6c16c16c16c17p-10);
	p = fma(c, p, 0x1.1111111111111p-7);
	p = fma(c, p, 0x1.5555555555555p-5);
	p = fma(c, p, 0x1.5555555555555p-3);
	p = fma(c, p, 0.5);
	p = fma(c, p, 1.0);
	return fma(c, p, 1.0);
}

/* c = -b_M / G - M scale for a segment whose max M has bin b_M: exact in double (M scale has
 * at most 48 significant bits, and both terms lie within 2^13 of 0). */
KVT_BINS_FN double kvt_bins_offset(float max, float scale, int32_t bmax)
{
	return (double)-bmax / (double)KVT_BINS_PER_NAT - (double)max * (double)scale;
}

/* e^(-j/G) for j < KVT_BINS: e^(-1/G) (KVT_BINS_STEP, rounded) raised to j by squaring; each
 * squaring doubles the error before it, which stays below 2^-42.6 of the power (all j checked in
 * test_scan_bins), far below the 2^-21 per term the tolerance counts. */
KVT_BINS_FN double kvt_bins_power(uint32_t j)
{
	double r = 1.0, x = KVT_BINS_STEP;
	for (; j; j >>= 1) {
		if (j & 1)
			r = kvt_bins_dmul(r, x);
		x = kvt_bins_dmul(x, x);
	}
	return r;
}

/* Slot mass in 2^-40 units of e^(M scale), truncated: k scores with sum of D dsum, the slot j bins
 * below the max's, pw = kvt_bins_power(j), f = kvt_bins_exp_small(c). Below 2^64 for
 * k < 2^24 (the threshold's bound on n). */
KVT_BINS_FN uint64_t kvt_bins_mass(uint32_t k, uint64_t dsum, double pw, double f)
{
	/* k 2^21 - (dsum - 512 k): an integer below 2^45, exact */
	const double num = (double)k * 2097152.0 - ((double)dsum - (double)KVT_BINS_DOFF * k);
	return (uint64_t)kvt_bins_dmul(kvt_bins_dmul(num * 524288.0, pw), f);
}

/* One segment's n scores binned on the host as kvt_gpu_score bins them (its twin, kvt_bins_of),
 * added into count and dsum (KVT_BINS slots each): for tests and benchmarks. Returns how many
 * were binned (the others lie past the domain or are not finite). */
static inline uint32_t kvt_bins_add_host(const float *x, uint32_t n, float scale, uint32_t *count,
					 unsigned long long *dsum)
{
	uint32_t binned = 0;
	for (uint32_t t = 0; t < n; t++) {
		uint32_t slot = 0, dv = 0;
		if (kvt_bins_of(x[t], scale, &slot, &dv)) {
			count[slot]++;
			dsum[slot] += dv;
			binned++;
		}
	}
	return binned;
}

#endif
