/* SPDX-License-Identifier: MIT */
/*
 * Where a row lives, as the fetch kernels (fetch.cu) and the second selection stage (rescore.cu)
 * find it: in the host tier through the block table, or in the layer's hot cache. C++ only.
 */
#ifndef KVT_GPU_FETCH_ROWS_CUH
#define KVT_GPU_FETCH_ROWS_CUH

#include "common.cuh"
#include "fetch.cuh"
#include "hotsize.h"

/* The host-tier row of KV head h at token position pos, or NULL when its block is not in host
 * memory (spilled). */
static __device__ __forceinline__ char *host_row(void *const *blocks, uint32_t blk_cap, uint32_t h,
						 uint32_t pos, uint32_t row_bytes)
{
	char *b = (char *)blocks[(size_t)h * blk_cap + pos / KVT_BLOCK_TOKENS];
	return b ? b + (size_t)(pos % KVT_BLOCK_TOKENS) * row_bytes : NULL;
}

/* The way of the hot cache holding that row, or -1. */
static __device__ __forceinline__ long long hot_slot(const kvt_gpu_hot &hot, unsigned long long uid,
						     uint32_t h, uint32_t pos)
{
	if (!hot.sets)
		return -1;
	const uint32_t set = kvt_hot_set(uid, h, pos, hot.sets);
	const unsigned long long lo = (unsigned long long)h << 32 | pos;
	/* the set's tags as 16-byte loads issued together (64-byte aligned: hot.c's layout) */
	static_assert(KVT_GPU_HOT_WAYS % 2 == 0, "a set's tags are whole ulonglong2");
	const size_t s0 = (size_t)set * KVT_GPU_HOT_WAYS;
	const ulonglong2 *th = (const ulonglong2 *)(hot.tag_hi + s0),
			 *tl = (const ulonglong2 *)(hot.tag_lo + s0);
	ulonglong2 a[KVT_GPU_HOT_WAYS / 2], b[KVT_GPU_HOT_WAYS / 2];
#pragma unroll
	for (uint32_t w = 0; w < KVT_GPU_HOT_WAYS / 2; w++) {
		a[w] = th[w];
		b[w] = tl[w];
	}
	long long found = -1; /* the first way that matches, as a walk from way 0 finds it */
#pragma unroll
	for (int w = KVT_GPU_HOT_WAYS / 2 - 1; w >= 0; w--) {
		if (a[w].y == uid && b[w].y == lo)
			found = (long long)(s0 + 2 * w + 1);
		if (a[w].x == uid && b[w].x == lo)
			found = (long long)(s0 + 2 * w);
	}
	return found;
}

#endif
