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

/* code in bits 56..63, where in 32..55 (24 bits), index in 0..31 */
#define KVT_GPU_ERR_MAKE(code, where, index)                                                       \
	(((unsigned long long)(code) << 56) | ((unsigned long long)((where)&0xffffffu) << 32) |    \
	 (unsigned long long)(uint32_t)(index))
#define KVT_GPU_ERR_CODE(w) ((uint32_t)((w) >> 56))
#define KVT_GPU_ERR_WHERE(w) ((uint32_t)((w) >> 32) & 0xffffffu)
#define KVT_GPU_ERR_INDEX(w) ((uint32_t)(w))

#endif
