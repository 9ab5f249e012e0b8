/* SPDX-License-Identifier: MIT */
/*
 * Exact attention on the GPU over gathered K/V rows: the twin of kvt_attention (lib/attention.c),
 * batched over (sequence, KV head) items with every query head of the group served by one read of
 * the rows. C and C++.
 */
#ifndef KVT_GPU_ATTEND_CUH
#define KVT_GPU_ATTEND_CUH

#include <stddef.h>
#include <stdint.h>

#include "errword.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The rows one (sequence, KV head) attends to. A row is K then V of one token, d elements each of
 * the launch's dtype (4 d bytes for fp16), 16-byte aligned. The memory may be device memory (a
 * staging buffer, the window, a hot cache) or mapped pinned host memory read directly over PCIe
 * (zero-copy: cudaHostRegisterMapped / cudaHostAllocMapped, the pointer as the device sees it).
 */
typedef struct kvt_gpu_rows {
	const void *const *rows; /* device array [n] of row pointers, or NULL for base/pos */
	const void *base;    /* when rows is NULL: row i at base + (pos ? pos[i] : i) * stride */
	const uint32_t *pos; /* device [n] or NULL */
	uint64_t stride;     /* bytes between consecutive rows at base */
	uint32_t n;          /* rows, <= max_rows of the launch */
	uint32_t reserved;   /* KVT_GPU_ROWS_SKIP (gpu/graph.cuh): a padded slot, out untouched */
} kvt_gpu_rows;

/* Bytes of scratch kvt_gpu_attend needs for these shapes. */
size_t kvt_gpu_attend_scratch_bytes(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				    uint32_t d, uint32_t max_rows);

/*
 * out[s][j] = softmax(q[s][j] . K^T * scale) V over the rows of items[s * n_kv_heads + j / G],
 * G = n_q_heads / n_kv_heads, with fp32 accumulation: the rows are split into chunks of 64 handled
 * by separate blocks (one pass with a running maximum each), then merged.
 *   d:         64, 128 or 256; dtype: KVT_DTYPE_F16 or KVT_DTYPE_BF16 (K, V and q)
 *   out_dtype: KVT_DTYPE_F32, F16 or BF16 (round to nearest even)
 *   q:         device [n_seqs][n_q_heads][d]; out: device [n_seqs][n_q_heads][d]
 *   items:     device [n_seqs][n_kv_heads]; max_rows: host bound on every items[].n
 *   scratch:   device, >= kvt_gpu_attend_scratch_bytes(...), 16-byte aligned
 *   err:       device error word or NULL: KVT_GPU_ERR_RANGE when an item's n exceeds max_rows
 *              (that item's outputs are zeros)
 * An item with no rows gives zeros, as kvt_attention. Returns 0, -EINVAL (NULL, shapes, scratch),
 * -EOPNOTSUPP (d, dtype, out_dtype) or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_attend(uint32_t d, uint32_t dtype, uint32_t out_dtype, uint32_t n_seqs,
		   uint32_t n_q_heads, uint32_t n_kv_heads, float scale, const void *q,
		   const kvt_gpu_rows *items, uint32_t max_rows, void *out, void *scratch,
		   size_t scratch_bytes, unsigned long long *err, void *stream);

/*
 * kvt_gpu_attend with the rows split into chunks as for a batch of max(n_seqs, split_seqs)
 * sequences: the split, and so the rounding of the merge, depends only on split_seqs and max_rows,
 * not on n_seqs (a reserved geometry, kvt_graph_reserve). The scratch of n_seqs suffices.
 */
int kvt_gpu_attend_split(uint32_t d, uint32_t dtype, uint32_t out_dtype, uint32_t n_seqs,
			 uint32_t n_q_heads, uint32_t n_kv_heads, float scale, const void *q,
			 const kvt_gpu_rows *items, uint32_t max_rows, uint32_t split_seqs,
			 void *out, void *scratch, size_t scratch_bytes, unsigned long long *err,
			 void *stream);

#ifdef __cplusplus
}
#endif

#endif
