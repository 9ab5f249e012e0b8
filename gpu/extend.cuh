/* SPDX-License-Identifier: MIT */
/*
 * Multi-token causal attention over a sequence's stored rows (kvt_extend on the CUDA backend): the
 * rows are staged from the host tier into dense device buffers a range at a time, and a tiled
 * kernel on the tensor cores attends every query row of a chunk to the staged rows up to its own
 * position, keeping a running maximum, sum and output per row across the ranges. The twin is
 * kvt_attention over the same rows (lib/attention.c, cpu_extend). C and C++.
 */
#ifndef KVT_GPU_EXTEND_CUH
#define KVT_GPU_EXTEND_CUH

#include <stddef.h>
#include <stdint.h>

#include "errword.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Query rows of one tile of the attention kernel: (query row, query head of the group) pairs. */
#define KVT_GPU_EXTEND_TILE 64u

/*
 * Rows [from, to) of every KV head of one sequence, read from the host tier through its block table
 * (mapped pinned memory, as the fetch kernels read it), into dense device buffers: K of head h,
 * position r at k[(h * cap + r - from) * d], V likewise in v. d elements of 2 bytes each.
 *   blocks:    device [n_kv_heads][blk_cap] block pointers (gpu_seq_layer.blk); a NULL block
 *              (spilled) gives zeros and KVT_GPU_ERR_RANGE (where = KV head, index = position)
 *   row_bytes: bytes of a stored row (4 d: K then V)
 *   cap >= to - from
 *   max_blocks: thread blocks per KV head at most (0: as many as the rows need, up to 1024); a
 *              staging that overlaps other kernels takes few, leaving them the SMs
 * Returns 0, -EINVAL or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_stage_rows(uint32_t d, uint32_t n_kv_heads, void *const *blocks, uint32_t blk_cap,
		       uint32_t row_bytes, uint32_t from, uint32_t to, void *k, void *v, size_t cap,
		       uint32_t max_blocks, unsigned long long *err, void *stream);

/* Bytes of the running state of n_rows query rows (kvt_gpu_extend_attend over several ranges). */
size_t kvt_gpu_extend_state_bytes(uint32_t n_rows, uint32_t n_q_heads, uint32_t d);

/* Bytes of the scratch that lets kvt_gpu_extend_attend split a range of `keys` staged rows over
 * more blocks (0: it would not split). Depends on the current device's multiprocessor count. */
size_t kvt_gpu_extend_part_bytes(uint32_t n_rows, uint32_t n_q_heads, uint32_t n_kv_heads,
				 uint32_t d, uint32_t keys);

/*
 * One range of staged rows, positions [r0, r1), attended by n_rows query rows of one sequence:
 * query row j (q[j][n_q_heads][d]) sits at position first + j and attends the positions up to its
 * own. Scores and the softmax in fp32 on fp32 products of the 16-bit inputs; the probabilities are
 * rounded to the input dtype before they weight V (as FlashAttention does), so outputs differ from
 * the fp32 CPU twin by a few units of the dtype's precision (relative to the largest |V|).
 *   d:          64, 128 or 256; dtype KVT_DTYPE_F16 or KVT_DTYPE_BF16 (q, k, v); out_dtype F32,
 *               F16 or BF16
 *   q:          16-byte aligned
 *   k, v:       staged as kvt_gpu_stage_rows leaves them (16-byte aligned), with cap rows per head
 *               and row r0 first
 *   state:      device, kvt_gpu_extend_state_bytes(n_rows, ...) (16-byte aligned), or NULL when
 *               this range is both the first and the last
 *   first_range: the state starts empty (else it holds the earlier ranges')
 *   last_range:  write out (else the state): out[j][n_q_heads][d]
 *   part:       device scratch of part_bytes (16-byte aligned) or NULL: with at least
 *               kvt_gpu_extend_part_bytes(...), few query rows (speculative verification, short
 *               chunks) split the keys over more blocks and merge their results (a second kernel)
 * Returns 0, -EINVAL (NULL, shapes, alignment), -EOPNOTSUPP (d, dtypes, or a device whose shared
 * memory per block cannot hold the tiles: about 110 KB at d 128, 190 KB at d 256) or -EIO.
 * Asynchronous, allocation-free.
 */
int kvt_gpu_extend_attend(uint32_t d, uint32_t dtype, uint32_t out_dtype, uint32_t n_q_heads,
			  uint32_t n_kv_heads, float scale, const void *q, uint32_t n_rows,
			  uint32_t first, const void *k, const void *v, size_t cap, uint32_t r0,
			  uint32_t r1, float *state, int first_range, int last_range, void *out,
			  float *part, size_t part_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif
