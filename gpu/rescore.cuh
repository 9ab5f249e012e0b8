/* SPDX-License-Identifier: MIT */
/*
 * The second selection stage on the GPU (kvt_config.rescore_p), the twin of rescore() in
 * lib/cpu_backend.c. C and C++.
 */
#ifndef KVT_GPU_RESCORE_CUH
#define KVT_GPU_RESCORE_CUH

#include <stddef.h>
#include <stdint.h>

#include "fetch.cuh"
#include "select.cuh"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Every query head's candidates (the tokens kvt_gpu_topp_threshold at rescore_p marked: ckey >= cut
 * where marked > 0) get their exact logit <q, k> in place of the estimate in scores, computed as the
 * CPU computes it (q and k as floats, products and sums in order over d, round to nearest, no
 * contraction: bit-equal), unless it is not finite (then the estimate stays, as on the CPU). The
 * key is read from the layer's hot cache when the row is there, else from the host tier (zero-copy);
 * a row of a spilled block is in neither and keeps its estimate (the CPU backend reads it from
 * NVMe: on such a sequence the two stages may differ).
 *   d, dtype: head dim (64, 128, 256) and K/query dtype (F16, BF16); rows of 4 d bytes
 *   seqs:     device [n_seqs] (the step's fetch descriptors: blocks, n_sink, n_indexed, uid)
 *   hot:      the layer's hot cache (read only: no way is claimed or marked used)
 *   q:        device [n_seqs][n_q_heads][d] of dtype, dense
 *   topp:     device [n_seqs][n_q_heads], the threshold at rescore_p
 *   scores:   device [n_seqs][n_q_heads][ld], as kvt_gpu_score wrote them
 * Returns 0, -EINVAL, -EOPNOTSUPP (d, dtype) or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_rescore(uint32_t d, uint32_t dtype, uint32_t n_seqs, uint32_t n_q_heads,
		    uint32_t n_kv_heads, const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot,
		    const void *q, const kvt_gpu_topp *topp, float *scores, size_t ld,
		    uint32_t max_n, void *stream);

/*
 * The second stage's counts of a step: over n_items (sequence, KV head) items, the candidates'
 * union (cand, the union bits of the threshold at rescore_p) and those of them the step did not
 * select (not in sel, the step's bits), added to counters[0] and counters[1].
 */
int kvt_gpu_rescore_count(uint32_t n_items, kvt_gpu_selbits cand, kvt_gpu_selbits sel,
			  unsigned long long *counters, void *stream);

#ifdef __cplusplus
}
#endif

#endif
