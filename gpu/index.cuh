/* SPDX-License-Identifier: MIT */
/*
 * Index build on the GPU: the twin of kvt_index_build (lib/estimate.c), bit for bit. C and C++.
 *
 * The index of one layer of one sequence keeps the CPU layout (struct kvt_layer):
 *   codes [n_kv_heads][cap][d/32] uint32, bit j of word w = coordinate 32w + j
 *   sigma [n_kv_heads][cap] fp16 bits, beta [n_kv_heads][cap] fp16 bits
 * The scan (gpu/score.cu) reads this layout coalesced as it is: lane t of a quad takes word t of a
 * code (for D 128), so one warp-wide 4-byte load covers 8 consecutive tokens, 128 contiguous bytes;
 * sigma and beta stream in separate arrays. No transposed layout is needed.
 */
#ifndef KVT_GPU_INDEX_CUH
#define KVT_GPU_INDEX_CUH

#include <stddef.h>
#include <stdint.h>

#include "errword.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the index of one (sequence, layer) lives: device pointers, the layout above. */
typedef struct kvt_gpu_index_view {
	uint32_t *codes; /* [n_kv_heads][cap][d/32] */
	uint16_t *sigma; /* [n_kv_heads][cap] */
	uint16_t *beta;  /* [n_kv_heads][cap] */
	uint32_t cap;    /* tokens of storage per KV head */
	uint32_t reserved;
} kvt_gpu_index_view;

/* One batch of keys to index (a prefill chunk, or a window flush; a ring buffer that wraps is two). */
typedef struct kvt_gpu_index_job {
	const void *keys;      /* device: element i of token t, KV head h at
				  keys[t * token_stride + h * head_stride + i], of the launch's dtype */
	uint64_t token_stride; /* elements */
	uint64_t head_stride;  /* elements */
	const float *c_k;      /* device [n_kv_heads][d]: key centroids (frozen) */
	const float *c_q;      /* device [n_kv_heads][d]: query centroids */
	uint32_t view;         /* entry of `views` that receives the entries */
	uint32_t first;        /* index position of token 0; first + n <= that view's cap */
	uint32_t n;            /* tokens, <= max_n of the launch */
	uint32_t reserved;
} kvt_gpu_index_job;

/*
 * Index n_jobs batches of keys for every KV head: for key k of head h, r = k - c_k[h],
 * code = [R r > 0], sigma = ||r||^2 / ||R r||_1 * sqrt(d), beta = <c_q[h], k>, exactly as
 * kvt_index_build computes them (same summation order, no contraction), so codes and the fp16
 * sigma/beta are bit-equal to the CPU's.
 *   d:        64, 128 or 256 (else -EOPNOTSUPP)
 *   dtype:    KVT_DTYPE_F16, KVT_DTYPE_BF16 or KVT_DTYPE_F32 (fp32 keys; else -EOPNOTSUPP)
 *   rot:      device [d][d] row-major rotation of the layer (kvt_rotation_generate), y = rot r
 *   jobs:     device [n_jobs]; views: device array indexed by jobs[].view
 *   max_n:    host-side bound on every jobs[].n (sizes the grid)
 *   err:      device error word (gpu/errword.h) or NULL: KVT_GPU_ERR_RANGE when a job's n exceeds
 *             max_n or first + n exceeds its view's cap (that job writes nothing)
 *   stream:   cudaStream_t
 * Returns 0, -EINVAL (NULL pointer, n_kv_heads 0, n_jobs * n_kv_heads > 65535), -EOPNOTSUPP,
 * or -EIO (launch failed). Asynchronous; no allocation, no host synchronization. Thread-safe.
 */
int kvt_gpu_index_build(uint32_t d, uint32_t dtype, uint32_t n_kv_heads, const float *rot,
			uint32_t n_jobs, const kvt_gpu_index_job *jobs, uint32_t max_n,
			const kvt_gpu_index_view *views, unsigned long long *err, void *stream);

#ifdef __cplusplus
}
#endif

#endif
