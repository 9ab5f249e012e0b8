/* SPDX-License-Identifier: MIT */
/*
 * Query preparation and the INT4 x binary scan on the GPU: the twins of kvt_query_prepare and
 * kvt_score (lib/estimate.c). Both reproduce the CPU's float operations in the CPU's order, so the
 * prepared query and every score are bit-equal to the CPU's. C and C++.
 */
#ifndef KVT_GPU_SCORE_CUH
#define KVT_GPU_SCORE_CUH

#include <stddef.h>
#include <stdint.h>

#include "index.cuh"
#include "scanbins.h"
#include "select.cuh"

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_GPU_MAX_GROUP 63u /* query heads per KV head the scan serves */

/* A query prepared for the scan (416 bytes, device memory). */
typedef struct kvt_gpu_qcode {
	float x_l, delta, sum_u, qc_ck; /* as in kvt_qcode */
	float A, B, C; /* E = A <b, u> + B popcount(b) + C, as kvt_score forms them */
	uint32_t d;
	uint32_t planes[4][8];  /* bit-plane p of u, packed like the codes (d/32 words used) */
	uint32_t frag[8][4][2]; /* u in the scan's MMA operand order (gpu/score.cu) */
} kvt_gpu_qcode;

/*
 * Prepare every query head of n_seqs queries: x = rot (q - c_q), INT4 quantization, bit planes,
 * and <q - c_q, c_k>, with the KV head of query head j being j / (n_q_heads / n_kv_heads).
 *   q:    device [n_seqs][n_q_heads][d] of dtype (F16 or BF16)
 *   c_q, c_k: device arrays [n_seqs] of device pointers, each to [n_kv_heads][d] floats
 *   rot:  device [d][d], as for kvt_gpu_index_build
 *   out:  device [n_seqs][n_q_heads]
 * Returns 0, -EINVAL (NULL pointer, n_kv_heads 0 or not dividing n_q_heads, n_seqs * n_q_heads
 * > 2^31 - 1), -EOPNOTSUPP (d not 64/128/256, dtype) or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_query_prepare(uint32_t d, uint32_t dtype, uint32_t n_seqs, uint32_t n_q_heads,
			  uint32_t n_kv_heads, const float *rot, const void *q,
			  const float *const *c_q, const float *const *c_k, kvt_gpu_qcode *out,
			  void *stream);

/*
 * Score every indexed token of every (sequence, KV head) for all query heads of its group, reading
 * each KV head's codes once (GQA): scores[s][j][t] for query head j of sequence s and index
 * position t < n_tokens[s] is bit-equal to kvt_score on the same prepared query and index entry.
 *   qc:       device [n_seqs][n_q_heads] (kvt_gpu_query_prepare)
 *   views:    device [n_seqs]: the index of each sequence (gpu/index.cuh layout)
 *   n_tokens: device [n_seqs]: indexed tokens per KV head, each <= max_n and <= its view's cap
 *   max_n:    host-side bound (sizes the grid), <= ld
 *   scores:   device [n_seqs][n_q_heads][ld] floats; ld a multiple of 4 (16-byte rows for the
 *             selection); entries from n_tokens[s] on are not written
 *   stats:    device [n_seqs][n_q_heads] or NULL: each head's max, min and first non-finite
 *             score are merged in (atomics), for kvt_gpu_topp_threshold; zero them before
 *   bins:     host struct or NULL: each head's scores are also binned (scanbins.h) and added
 *             into bins->count and bins->dsum, which the caller zeroes before; groups of at most
 *             four query heads per KV head. kvt_gpu_topp_threshold and kvt_gpu_topp_select
 *             read it as their `ring` (select.cuh), which they leave zeroed; on the H200 the
 *             scan takes 1.3x as long with it at 1M tokens, 1.4x at 128K (doc/selection.md)
 *   err:      device error word or NULL: KVT_GPU_ERR_RANGE when n_tokens[s] > max_n or > cap
 *             (that sequence is not scored)
 * The group n_q_heads / n_kv_heads is at most KVT_GPU_MAX_GROUP. Returns 0, -EINVAL (NULL
 * pointer, shapes, ld, bins' pointers or a scale not positive and finite), -EOPNOTSUPP (d, or
 * bins with a group above 4) or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_score(uint32_t d, uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
		  const kvt_gpu_qcode *qc, const kvt_gpu_index_view *views,
		  const uint32_t *n_tokens, uint32_t max_n, float *scores, size_t ld,
		  kvt_gpu_segstats *stats, const kvt_gpu_bins *bins, unsigned long long *err,
		  void *stream);

#ifdef __cplusplus
}
#endif

#endif
