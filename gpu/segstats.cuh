/* SPDX-License-Identifier: MIT */
/*
 * A segment's score statistics (kvt_gpu_segstats, select.cuh) gathered where scores pass: by the
 * scan as it writes them (score.cu), or by the threshold's first pass when no scan gave them
 * (select.cu). C++ only.
 */
#ifndef KVT_GPU_SEGSTATS_CUH
#define KVT_GPU_SEGSTATS_CUH

#include "common.cuh"
#include "select.cuh"

/* One score at position i into a thread's running statistics. */
static __device__ __forceinline__ void kvt_d_stat(float f, uint32_t i, uint32_t *kmax,
						  uint32_t *nmin, uint32_t *bad)
{
	if (!isfinite(f)) {
		*bad = max(*bad, 0xffffffffu - i);
		return;
	}
	const uint32_t key = kvt_d_fkey(f);
	*kmax = max(*kmax, key);
	*nmin = max(*nmin, ~key);
}

/*
 * A cheaper running form of kvt_d_stat for a thread's own scores, two instructions a score against
 * about eight: the greatest and least score with NaN propagated (PTX max.NaN, min.NaN, sm_80 and
 * later). kvt_d_frange_stat turns it into kvt_d_stat's statistics when every score was finite;
 * when one was not (false), the caller walks its scores again with kvt_d_stat, for the position.
 */
struct kvt_d_frange {
	float hi = -INFINITY, lo = INFINITY;
};

static __device__ __forceinline__ void kvt_d_frange_add(kvt_d_frange &r, float f)
{
	asm("max.NaN.f32 %0, %0, %1;" : "+f"(r.hi) : "f"(f));
	asm("min.NaN.f32 %0, %0, %1;" : "+f"(r.lo) : "f"(f));
}

/* kvt_d_stat's kmax and nmin from r (both 0 when r saw nothing), or false when r saw a score that
 * is not finite: a NaN reaches both ends, +inf the top, -inf the bottom. */
static __device__ __forceinline__ bool kvt_d_frange_stat(const kvt_d_frange &r, uint32_t *kmax,
							 uint32_t *nmin)
{
	if (r.hi != r.hi || r.hi == INFINITY || r.lo != r.lo || r.lo == -INFINITY)
		return false;
	*kmax = r.hi == -INFINITY ? 0u : kvt_d_fkey(r.hi);
	*nmin = r.lo == INFINITY ? 0u : ~kvt_d_fkey(r.lo);
	return true;
}

/* Lanes l and l ^ m for every m >= lo (a power of two) combine their running statistics: every
 * lane ends with its group's. Every lane of the warp calls it. */
static __device__ __forceinline__ void kvt_d_stat_reduce(uint32_t *kmax, uint32_t *nmin,
							 uint32_t *bad, uint32_t lo)
{
	for (uint32_t o = 16; o >= lo; o >>= 1) {
		*kmax = max(*kmax, __shfl_xor_sync(0xffffffffu, *kmax, (int)o));
		*nmin = max(*nmin, __shfl_xor_sync(0xffffffffu, *nmin, (int)o));
		*bad = max(*bad, __shfl_xor_sync(0xffffffffu, *bad, (int)o));
	}
}

/* Statistics merged into dst (device or shared memory) with atomics; zero fields add nothing. */
static __device__ __forceinline__ void kvt_d_stat_add(uint32_t kmax, uint32_t nmin, uint32_t bad,
						      kvt_gpu_segstats *dst)
{
	if (kmax)
		atomicMax(&dst->max_key, kmax);
	if (nmin)
		atomicMax(&dst->nmin_key, nmin);
	if (bad)
		atomicMax(&dst->bad, bad);
}

/*
 * The running statistics of a warp's lanes into statistics elsewhere: kvt_d_stat_reduce, then each
 * lane below lo adds the result into its dst (NULL: none).
 */
static __device__ __forceinline__ void kvt_d_stat_flush(uint32_t kmax, uint32_t nmin, uint32_t bad,
							uint32_t lo, kvt_gpu_segstats *dst)
{
	kvt_d_stat_reduce(&kmax, &nmin, &bad, lo);
	if (threadIdx.x % 32 < lo && dst)
		kvt_d_stat_add(kmax, nmin, bad, dst);
}

#endif
