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
/* The most decode steps whose score corrections a sequence remembers (kvt_config.correction_steps;
 * lib/correct.c keeps one bit per remembered step in a 64-bit word). */
#define KVT_MAX_KEEP_STEPS 64u /* kvt_config.keep_steps */
#define KVT_MAX_CORRECTION_STEPS 64u
/* Blocks per KV head a block table starts with (lib/layer.c; kvt_footprint_of counts them). */
#define KVT_TABLE_MIN_BLOCKS 4u

/* Why kvt_attend_graph cannot serve a slot: the cpu path's checks (lib/graph.c) and the CUDA
 * descriptor kernel's (gpu/graph.cu, which raises the cause in bits 16..23 of the error word's
 * `where`); lib/graph.c words each one. */
enum kvt_slot_cause {
	KVT_SLOT_NOT_OPEN = 1, /* the id is out of range, or no open sequence with rows */
	KVT_SLOT_REPEATED = 2, /* an earlier valid slot holds the same sequence */
	KVT_SLOT_LENGTH = 3,   /* lengths[i] differs from the sequence's tokens */
	KVT_SLOT_TOO_LONG = 4, /* more tokens than the reservation's max_tokens */
	KVT_SLOT_SPILLED = 5,  /* blocks on NVMe (CUDA only: the cpu path reads them in place) */
	KVT_SLOT_IN_ERROR = 6, /* the sequence is in error (kvt_seq_status) */
};

#endif
