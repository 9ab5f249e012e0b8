/* SPDX-License-Identifier: MIT */
/*
 * Sizes shared by the library (lib/internal.h includes this) and the CUDA kernels of gpu/
 * (gpu/common.cuh), which need these and none of the library's internal interfaces. Plain C,
 * no dependencies. Never installed.
 */
#ifndef KVT_CONSTANTS_H
#define KVT_CONSTANTS_H

#define KVT_MAX_HEAD_DIM 256u
#define KVT_MAX_WORDS (KVT_MAX_HEAD_DIM / 32u)
/* Tokens of one KV head per host-tier block: neighbouring tokens of a head stay contiguous. */
#define KVT_BLOCK_TOKENS 256u

#endif
