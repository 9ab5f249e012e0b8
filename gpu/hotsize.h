/* SPDX-License-Identifier: MIT */
/*
 * The self-sized hot cache's sizing rule (gpu/hot.c applies it; tests/test_hot_size.c checks it
 * without a GPU). After each measured eager step of a layer the cache should hold:
 * - twice the rows the step read through it (its selected rows and its batch's sinks), so that
 *   the rows of one step stay for the next;
 * - twice what it holds, when it is full and the step missed more than KVT_HOT_MISS_NUM /
 *   KVT_HOT_MISS_DEN of those rows: queries whose selection drifts come back to rows over many
 *   steps, not only from the last one (issue 15, point 3). Full: the measured misses since the
 *   last growth have filled the ways it added (a growth keeps the rows it held), so a cache still
 *   filling does not grow for its own cold misses, and one that holds every row a workload reads
 *   stops missing and growing;
 * - at least KVT_HOT_GROWTH_NUM / KVT_HOT_GROWTH_DEN of the old size when it grows, so slow growth
 *   does not resize each step (each resize synchronizes the device);
 * - never more than the rows of the contexts it serves: a cache that holds them all hits no more
 *   for being larger (at 1M x 1 on drifting queries the doubling rule would otherwise have taken
 *   6.4 GB for a layer whose whole K/V is 4.3 GB); and a growth that bound cuts short only when it
 *   still adds an eighth, so a cache at the bound does not follow its contexts a set a step.
 * The caller bounds the result further (its share of gpu_cache_max_bytes, half of the free memory)
 * and never shrinks the cache.
 */
#ifndef KVT_GPU_HOTSIZE_H
#define KVT_GPU_HOTSIZE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define KVT_HOT_FN static __host__ __device__ __forceinline__
#else
#define KVT_HOT_FN static inline
#endif

/* The set of (sequence uid, KV head h, token position pos) in a cache of `sets` sets (> 0): a mix
 * of the sequence and head plus the position, so neighbouring tokens spread over neighbouring
 * sets. The kernels (fetch_rows.cuh) and kvbench's simulated cache (tools/kvbench_hotsim.c) use
 * it. */
KVT_HOT_FN uint32_t kvt_hot_set(unsigned long long uid, uint32_t h, uint32_t pos, uint32_t sets)
{
	unsigned long long x = uid * 0x9e3779b97f4a7c15ull ^ ((unsigned long long)h << 17);
	x ^= x >> 29;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 32;
	return (uint32_t)((x + pos) % sets);
}

#define KVT_HOT_GROWTH_NUM 3u
#define KVT_HOT_GROWTH_DEN 2u
/* an eighth, not a quarter: on the H200 at 128K x 8 on drifting queries a quarter stopped the
 * cache at 2.2 GB a layer, missing 75 MB a step, where an eighth reached 4.0 GB and 48 MB
 * (doc/hysteresis.md, session 36) */
#define KVT_HOT_MISS_NUM 1u
#ifndef KVT_HOT_MISS_DEN /* an experiment may set it (bench/hot_batch.c) */
#define KVT_HOT_MISS_DEN 8u
#endif

/* A growth the served rows cut short is made only when it adds at least 1 / KVT_HOT_SERVED_STEP_DEN
 * of the cache: contexts grow by a token a step, so a cache held at their rows would otherwise grow
 * by a set nearly every step, and each growth synchronizes the device and copies the cache (at 1M
 * x 1 one set of 8 rows is a step's append on 8 KV heads). */
#define KVT_HOT_SERVED_STEP_DEN 8u
/* `rows` within the `served` rows of the cache's contexts, never below the `have` it holds, and
 * not a growth to them of less than an eighth of `have`. */
KVT_HOT_FN uint64_t kvt_hot_within(uint64_t have, uint64_t rows, uint64_t served)
{
	if (rows <= served)
		return rows > have ? rows : have;
	return served > have && served - have >= have / KVT_HOT_SERVED_STEP_DEN ? served : have;
}

/*
 * The rows the cache should hold after a measure of `reads` rows read through it, `misses` of them
 * from the host tier, and `demand` rows asked for (its selected rows and sinks), when it holds
 * `have` and its contexts have `served` rows: `have` itself when it should not grow. *to_fill
 * counts the empty ways the cache still has to fill before misses may grow it; this takes the
 * measure's misses off it. The caller, when it grows the cache, sets *to_fill to the ways it
 * added. With `served` UINT64_MAX, kvt_hot_within applies that bound afterwards, alike: a caller
 * for whom counting the served rows costs counts them only when the cache would grow.
 */
KVT_HOT_FN uint64_t kvt_hot_rows_wanted(uint64_t have, uint64_t demand, uint64_t reads,
					uint64_t misses, uint64_t served, uint64_t *to_fill)
{
	uint64_t rows = 2 * demand;
	const bool full = *to_fill <= misses;
	*to_fill = full ? 0 : *to_fill - misses;
	if (full && misses * KVT_HOT_MISS_DEN > reads * KVT_HOT_MISS_NUM && rows < 2 * have)
		rows = 2 * have;
	if (rows <= have)
		return have;
	const uint64_t least = have * KVT_HOT_GROWTH_NUM / KVT_HOT_GROWTH_DEN;
	return kvt_hot_within(have, rows > least ? rows : least, served);
}

#endif
