/* SPDX-License-Identifier: MIT */
/*
 * The error word of the GPU kernels. Kernels never trap: a kernel that meets input it cannot serve
 * (a non-finite score, an index position past the storage) records the first such event in a
 * caller-owned 64-bit word in device memory and carries on with a defined result. The caller zeroes
 * the word once (cudaMemsetAsync), launches, and reads it whenever it next synchronizes; 0 means no
 * error. C and C++.
 */
#ifndef KVT_GPU_ERRWORD_H
#define KVT_GPU_ERRWORD_H

#include <stdint.h>

enum kvt_gpu_err_code {
	/* a score was NaN or infinite: where = segment, index = position */
	KVT_GPU_ERR_NONFINITE = 1,
	/* a count or position beyond what the launch was sized for: where = work item, index = the
	 * offending count or position */
	KVT_GPU_ERR_RANGE = 2,
	/* a slot of a graph step that could not be served (gpu/graph.cuh): where = layer | cause << 16,
	 * index = the slot */
	KVT_GPU_ERR_SLOT = 3,
};

/*
 * Where a KVT_GPU_ERR_RANGE was raised: the kernel and the check, so that the host's message names
 * them (gpu/backend.c). Kernels pass KVT_GPU_ERR_RANGE_AT(site) as the code.
 */
enum kvt_gpu_err_site {
	KVT_GPU_SITE_NONE = 0,
	KVT_GPU_SITE_INDEX_JOB = 1,    /* k_index_build: a job's token count above max_n */
	KVT_GPU_SITE_INDEX_CAP = 2,    /* k_index_build: a job's end past its index's capacity */
	KVT_GPU_SITE_SCORE_N = 3,      /* k_score: a sequence's indexed count above max_n or cap */
	KVT_GPU_SITE_SELECT_N = 4,     /* the Top-p threshold: a segment's count above max_n */
	KVT_GPU_SITE_LOOKUP_ROWS = 5,  /* k_lookup: an item's rows (sinks + selected + window) above
					* max_rows */
	KVT_GPU_SITE_LOOKUP_BLOCK = 6, /* k_lookup: a selected row whose host block is missing */
	KVT_GPU_SITE_FILL_BLOCK = 7,   /* k_fill: a row of a spilled block that was not staged */
	KVT_GPU_SITE_STORE_BLOCK = 8,  /* k_store: a new row whose host block is missing */
	KVT_GPU_SITE_ATTEND_ROWS = 9,  /* k_attend: an item's rows above max_rows */
	KVT_GPU_SITE_STAGE_BLOCK = 10, /* kvt_extend's staging: a row of a spilled or missing block */
	KVT_GPU_SITE_COUNT = 11,
};

/* code in bits 56..58, the site of a range error in 59..63, where in 32..55 (24 bits), index in
 * 0..31 */
#define KVT_GPU_ERR_RANGE_AT(site) (KVT_GPU_ERR_RANGE | (uint32_t)(site) << 3)
#define KVT_GPU_ERR_MAKE(code, where, index)                                                       \
	(((unsigned long long)(code) << 56) | ((unsigned long long)((where)&0xffffffu) << 32) |    \
	 (unsigned long long)(uint32_t)(index))
#define KVT_GPU_ERR_CODE(w) ((uint32_t)((w) >> 56) & 7u)
#define KVT_GPU_ERR_SITE(w) ((uint32_t)((w) >> 59))
#define KVT_GPU_ERR_WHERE(w) ((uint32_t)((w) >> 32) & 0xffffffu)
#define KVT_GPU_ERR_INDEX(w) ((uint32_t)(w))

#endif
