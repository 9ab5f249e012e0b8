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
/* Ways of a set of the CUDA backend's hot cache, and the bytes each way keeps beside its row: two
 * 64-bit tag words and a 32-bit last-use epoch (gpu/fetch.cuh; lib/probe.c sizes it from these). */
#define KVT_GPU_HOT_WAYS 8u
#define KVT_GPU_HOT_TAG_BYTES (2 * 8u + 4u)
/* The self-sized hot cache's default bound: this share (1 / n) of the device memory free at
 * kvt_cache_create (gpu/hot.c; kvbench --plan counts it). */
#define KVT_GPU_HOT_AUTO_SHARE 4u
/* Tokens per count of a selection kept as bits (gpu/union.cu's chunk; kvt_footprint counts it). */
#define KVT_GPU_SEL_CHUNK 8192u
/* |<q - c_q, c_k>| of a prepared query is saturated here (and a NaN made 0), on the CPU and in
 * gpu/score.cu alike: keys or centroids of a magnitude no model produces (bf16 above ~1e36) then
 * give a finite, dominant score instead of failing every batch their sequence joins. */
#define KVT_QC_CK_MAX 1e30f
/* Indexed tokens per sequence and layer the CUDA selection handles (positions and counts fit 24
 * bits), and so the longest sequence a graph reservation bounds (kvtier_graph.h). */
#define KVT_GPU_SELECT_MAX_N ((1u << 24) - 1)
/* Blocks per KV head a block table starts with (lib/layer.c; kvt_footprint_of counts them). */
#define KVT_TABLE_MIN_BLOCKS 4u

#endif
