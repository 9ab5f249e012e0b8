/* SPDX-License-Identifier: MIT */
/*
 * The scan's first histogram (issue 15, point 1; doc/selection.md, "A scan-built histogram
 * without an anchor"): while kvt_gpu_score writes a query head's scores it can also bin them on a
 * fixed grid, so that the Top-p threshold need not stream them for its histogram. C and CUDA: the
 * kernel and its CPU twin (tests/test_gpu_bins.c) bin with this one function, which is why every
 * operation is written out and rounded as written.
 *
 * The grid is absolute, so every block bins a score the same way without knowing the segment's
 * maximum: with x = s * scale in nats and G = KVT_BINS_GRID bins a nat (32 unless built
 * otherwise, below), bin b = floor(-x G) (bin 0 holds x in (-1/G, 0]; larger scores have
 * negative bins). A score's term relative to its bin's top edge e_b = -b / G is exp(x - e_b), in
 * (e^-1/G, 1]; what is summed is D = round((1 - exp(x - e_b)) 2^21) + KVT_BINS_DOFF (an integer
 * below KVT_BINS_DMAX), so a bin's mass is e^(e_b) (count - 2^-21 (sum D - KVT_BINS_DOFF count))
 * relative to e^0, exactly and in any order.
 *
 * How it is computed, so that its error is bounded whatever |x| is (bench/selection_grid_check.py
 * shows that fl(s scale) - e_b alone errs by up to 2^-16 at large logits): h = fl(s scale) and
 * l = fma(s, scale, -h) give h + l = s scale exactly; b comes from h; y = (h - e_b) + l, where
 * h - e_b is exact (Sterbenz) and y lies within |l| of (-1/G, 0]; 1 - exp(y) is a degree-4
 * polynomial in y (truncation below 2^-31 for |y| <= 2^-5 + 2^-13, 2^-26 for 2^-4 + 2^-13)
 * evaluated with fmaf, which rounds the same on both sides. The term's error is then below
 * 2^-21.9 of the term (2^-21.8 at 1/16 nat), the rounding of D included, within the 2^-21 per
 * term that doc/selection.md's tolerance assumes.
 *
 * Binned: finite scores with |h| < KVT_BINS_DOMAIN nats (then |l| <= 2^-13, so D lies in
 * [0, KVT_BINS_DMAX) with the offset). Others are not binned: their segment's statistics show
 * them (a non-finite score, or a max or min past the domain), and such a segment takes the
 * threshold's own passes.
 *
 * The ring: bin b is counted at slot b mod KVT_BINS (KVT_BINS / G nats of bins: 64 at 1/32 nat).
 * Two binned scores share a slot only if their bins differ by a multiple of KVT_BINS, that is only
 * in a segment whose scores span KVT_BINS / G nats or more, which its statistics show too.
 *
 * The width: KVT_BINS_GRID is 32 (1/32 nat); a build with -DKVT_BINS_GRID=16 (1/16 nat, 2048 slots
 * spanning 128 nats) trades the ring's span for twice the population of its cut bins. Its bounds
 * are checked on the CPU (tests/test_scan_bins builds both) and it passes the GPU twin tests, but
 * it measured slower where the 1/32 ring already serves (doc/selection.md), so 32 is the default.
 */
#ifndef KVT_GPU_SCANBINS_H
#define KVT_GPU_SCANBINS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifndef KVT_BINS_GRID
#define KVT_BINS_GRID 32 /* bins a nat (the grid: 1/G nat wide) */
#endif
#if KVT_BINS_GRID == 32
#define KVT_BINS_DMAX 65600u /* D's bound: (1 - e^(-1/32 - 2^-13)) 2^21 + 512 = 65282.7 */
#define KVT_BINS_STEP 0x1.f03f56a88b5d8p-1 /* e^(-1/32), correctly rounded to double */
#elif KVT_BINS_GRID == 16
#define KVT_BINS_DMAX 128000u /* (1 - e^(-1/16 - 2^-13)) 2^21 + 512 = 127812.5 */
#define KVT_BINS_STEP 0x1.e0fabfbc702a4p-1 /* e^(-1/16), correctly rounded to double */
#else
#error "KVT_BINS_GRID: 32 or 16 bins a nat, the widths whose bounds are checked"
#endif
#define KVT_BINS 2048u                          /* ring slots per query head */
#define KVT_BINS_PER_NAT ((float)KVT_BINS_GRID) /* bin width 1/G nat */
#define KVT_BINS_DOMAIN 4096.0f                 /* |s scale| binned below it, in nats */
#define KVT_BINS_DOFF 512 /* added to every D: y up to 2^-13 above 0 makes D -256 */
#define KVT_BINS_BLOCK_TOKENS 32768u /* tokens a scan block bins at most: a slot's sum of D fits
					32 bits in shared memory (2^15 KVT_BINS_DMAX < 2^32) */

/*
 * Where kvt_gpu_score adds its histogram: per (sequence, query head) segment, KVT_BINS counts
 * and KVT_BINS sums of D, slot-indexed, both zeroed by the caller before (they are added to).
 */
typedef struct kvt_gpu_bins {
	float scale;              /* the softmax scale the threshold will use (nats per score) */
	uint32_t *count;          /* device [n_seqs][n_q_heads][KVT_BINS] */
	unsigned long long *dsum; /* device [n_seqs][n_q_heads][KVT_BINS] */
	/* the threshold takes a segment's decisions from the ring when its boundary bins hold at
	 * most this many scores (resolved from its candidate list; more stream the segment):
	 * 0 for KVT_BINS_SERVE_DEFAULT; at most KVT_BINS_SERVE_MAX */
	uint32_t serve_max;
	/* device: the threshold adds the segments it decided from the ring (or NULL) */
	unsigned long long *served;
} kvt_gpu_bins;

#define KVT_BINS_SERVE_DEFAULT 512u /* what the resolution ranks, its cheapest way (SEL_RANK) */
#define KVT_BINS_SERVE_MAX 4096u    /* measured up to this (doc/selection.md); within the list */

#ifdef __CUDACC__
#define KVT_BINS_FN static __host__ __device__ __forceinline__
#else
#define KVT_BINS_FN static inline
#endif

/* a * b and a + b rounded once, without contraction, on either side (the host's C is compiled
 * with -ffp-contract=off) */
#ifdef __CUDA_ARCH__
KVT_BINS_FN float kvt_bins_mul(float a, float b) { return __fmul_rn(a, b); }
KVT_BINS_FN float kvt_bins_add(float a, float b) { return __fadd_rn(a, b); }
KVT_BINS_FN double kvt_bins_dmul(double a, double b) { return __dmul_rn(a, b); }
#else
KVT_BINS_FN float kvt_bins_mul(float a, float b) { return a * b; }
KVT_BINS_FN float kvt_bins_add(float a, float b) { return a + b; }
KVT_BINS_FN double kvt_bins_dmul(double a, double b) { return a * b; }
#endif

/* Whether score s is binned: finite, with |fl(s scale)| below the domain. */
KVT_BINS_FN bool kvt_bins_in(float s, float scale)
{
	const float h = kvt_bins_mul(s, scale);
	return h > -KVT_BINS_DOMAIN && h < KVT_BINS_DOMAIN; /* false for NaN too */
}

/* The bin of a binned score: floor(-fl(s scale) 32), in (-131072, 131072]. */
KVT_BINS_FN int32_t kvt_bins_bin(float s, float scale)
{
	return (int32_t)floorf(kvt_bins_mul(-kvt_bins_mul(s, scale), KVT_BINS_PER_NAT));
}

/* Bins score s: true with its slot (b mod KVT_BINS) and D, false when it is not binned. Its test
 * and bin are kvt_bins_in's and kvt_bins_bin's, written out as the kernel was verified with them
 * (test_scan_bins checks that the slots agree with kvt_bins_bin). */
KVT_BINS_FN bool kvt_bins_of(float s, float scale, uint32_t *slot, uint32_t *d)
{
	const float h = kvt_bins_mul(s, scale);
	if (!(h > -KVT_BINS_DOMAIN && h < KVT_BINS_DOMAIN)) /* NaN too */
		return false;
	const float l = fmaf(s, scale, -h);
	const float bf = floorf(kvt_bins_mul(-h, KVT_BINS_PER_NAT));
	const float y = kvt_bins_add(fmaf(bf, 1.0f / KVT_BINS_PER_NAT, h), l);
	/* 1 - e^y = -y (1 + y (1/2 + y (1/6 + y / 24))) */
	float p = fmaf(y, 0x1.555556p-5f, 0x1.555556p-3f); /* 1/24, 1/6 rounded */
	p = fmaf(y, p, 0.5f);
	p = fmaf(y, p, 1.0f);
	const float dl = kvt_bins_mul(-y, p);
	*slot = (uint32_t)(int32_t)bf & (KVT_BINS - 1u);
	*d = (uint32_t)((int32_t)rintf(kvt_bins_mul(dl, 2097152.0f)) + KVT_BINS_DOFF);
	return true;
}

#endif
