/* SPDX-License-Identifier: MIT */
/*
 * What the CUDA backend's tests through the public interface share (test_gpu_backend.c,
 * test_gpu_hot.c, test_gpu_calls.c and the others): a pair of caches, one CPU and one CUDA, fed
 * the same tokens of kvbench's workload, and the checks on them.
 */
#ifndef KVT_TESTS_GPU_PAIR_H
#define KVT_TESTS_GPU_PAIR_H

#include <cuda_runtime.h>
#include <math.h>

#include "common.h"
#include "host/alloc.h"
#include "tools/workload.h"

#define CU(x)                                                                                      \
	do {                                                                                       \
		cudaError_t e_ = (x);                                                              \
		T_CHECK(e_ == cudaSuccess, "%s: %s", #x, cudaGetErrorString(e_));                  \
	} while (0)
#define OK(c, x)                                                                                   \
	do {                                                                                       \
		int r_ = (x);                                                                      \
		T_CHECK(r_ >= 0, "%s = %d: %s", #x, r_, kvt_last_error(c));                        \
	} while (0)

enum { NSEQ = 2, HQ = 8, HKV = 2, D = 128, LAYERS = 2 };

extern int g_quick; /* KVT_TEST_QUICK: fewer steps, for the slow sanitizer runs */

/* A test program's start: false (after saying so) when there is no CUDA device, the program then
 * exits 77 (skipped); sets g_quick. */
bool gpu_tests_start(void);

/* Two caches fed the same tokens: fp16 rows on the host for the CPU, copies on the device. */
struct pair {
	kvt_cache *cpu, *gpu;
	uint32_t sc[NSEQ], sg[NSEQ];
	kvt_cache *lo, *hi; /* with g_bound_delta: CPU caches at p - delta and p + delta, or NULL */
	uint32_t sl[NSEQ], sh[NSEQ];
	wl *w;
	uint32_t ctx;
	uint16_t *hk, *hv, *hq; /* host staging, [n][heads][D] */
	void *dk, *dv, *dq, *dout;
	float *out_c, *out_g;
	uint16_t *rows_k, *rows_v; /* [LAYERS][NSEQ][HKV][max tokens][D]: everything written */
	uint32_t max_tokens;
};

/* Offset of the row of (layer, sequence s, KV head h, position pos) in rows_k / rows_v. */
size_t row_at(const struct pair *p, uint32_t layer, uint32_t s, uint32_t h, uint32_t pos);
/* n tokens of workload sequence s on `layer` from position pos into the host staging (step >= 0:
 * decode queries of that step), remembered in rows_k / rows_v. */
void make(struct pair *p, uint32_t s, uint32_t layer, uint32_t pos, uint32_t n, int32_t step);
/* The staging's first n tokens to the device copies. */
void upload(struct pair *p, uint32_t n);
/* When > 0, pair_init also makes the CPU caches lo and hi at p -/+ this, fed like the others
 * (append_both feeds them too): the GPU's selection must lie between theirs. */
extern float g_bound_delta;
/* config()'s p when > 0 (0: t_config's; a test that selects every indexed token sets 1) */
extern float g_p;
/* config()'s rescore_p (0: off; a test of the second stage sets it) */
extern float g_rescore_p;
/* config()'s keep_weight (0: off; a test of the selection's hysteresis sets it) */
extern float g_keep_weight;
/* config()'s gpu_cache_max_bytes (a test that bounds the self-sized hot cache sets it) */
extern uint64_t g_hot_max;
kvt_config config(uint64_t gpu_cache_bytes);
/* Both caches, NSEQ sequences each prefilled with ctx tokens in two chunks per layer. */
void pair_init(struct pair *p, uint32_t ctx, uint32_t steps, uint64_t gpu_cache_bytes);
void pair_fini(struct pair *p);
/* One decode token for both sequences on `layer`, then the queries of `step` in hq/dq. */
void decode_inputs(struct pair *p, uint32_t layer, uint32_t step);
/* decode_inputs, then their token appended to both caches */
void append_both(struct pair *p, uint32_t layer, uint32_t step);
/* On every cache of the pair: fork sequence `from`, close sequence `gone` (which may be `from`),
 * and put the child in `gone`'s place of the batch. */
void fork_both(struct pair *p, uint32_t from, uint32_t gone);
/* kvt_attend of the decode inputs on both backends; their outputs agree within 1e-3 relative per
 * head (the worst seen in *worst). */
void attend_both(struct pair *p, uint32_t layer, uint32_t step, double *worst);
/* Decode steps [from, to) on every layer (append_both, then attend_both): the worst error. */
double decode_both(struct pair *p, uint32_t from, uint32_t to);
/* Tokens in one of two ascending position lists and not in the other; *a_in_b: every one of a's
 * is in b. */
uint32_t pos_diff(const int32_t *a, int32_t na, const int32_t *b, int32_t nb, bool *a_in_b);
/* kvt_select (queries q, host) then kvt_gather of positions on a CPU cache, the batch seqs in the
 * given order: counts and pos [NSEQ * HKV][T]. */
void cpu_positions(kvt_cache *c, uint32_t layer, const uint32_t *seqs, const uint16_t *q,
		   const uint32_t *order, uint32_t T, int32_t *cnt, int32_t *pos);

#endif
