/* SPDX-License-Identifier: MIT */
/*
 * What the GPU kernel tests share (test_gpu_kernels.c, which holds main and these helpers,
 * test_gpu_select.c, test_gpu_bins.c and test_gpu_spill_list.c): the run's seed and mode, device
 * buffers poisoned with 0xff bytes, and the selection's order key.
 */
#ifndef KVT_TESTS_GPU_KERNELS_H
#define KVT_TESTS_GPU_KERNELS_H

#include <cuda_runtime.h>

#include "common.h"
#include "half.h"
#include "gpu/score.cuh"
#include "gpu/scanring.h"
#include "gpu/select.cuh"

#define CU(x)                                                                                      \
	do {                                                                                       \
		cudaError_t e_ = (x);                                                              \
		T_CHECK(e_ == cudaSuccess, "%s: %s", #x, cudaGetErrorString(e_));                  \
	} while (0)

extern uint64_t g_seed;
extern int g_quick; /* KVT_TEST_QUICK: a subset, for the slow sanitizer runs */
extern const uint32_t dims[3]; /* the head dims: 64, 128, 256 */

/* Device memory filled with 0xff bytes (NaN floats, fp16 NaN, all-ones words). */
void *dpoison(size_t bytes);
/* A poisoned device copy of h. */
void *dcopy(const void *h, size_t bytes);
/* h = d after the device has finished. */
void fetch(void *h, const void *d, size_t bytes);
/* r seeded from the run's seed and a salt. */
void seeded(t_rng *r, uint64_t salt);
/* A d x d rotation from the run's seed (kvt_rotation_generate). */
float *rotation(uint32_t d);
/* n draws of N(mean, sd^2). */
void fill_f(t_rng *r, float *x, size_t n, double mean, double sd);
/* The selection's order key of a score (-0 taken as +0) above the complement of its position, as
 * the GPU's cut reads it. */
uint64_t sel_key(float x, uint32_t t);
/* The statistics kvt_gpu_score gathers, of n scores: the largest and the complemented smallest key
 * of a finite score, the complement of the first non-finite position. */
kvt_gpu_segstats host_segstats(const float *x, uint32_t n);

/* test_gpu_select.c: a segment's reference, computed once for the several thresholds checked
 * against it: the CPU's threshold and count, and for 0 < p < 1 its keys sorted down with the prefix
 * sums of their scores' terms in long double (cum[i]: the terms of sorted[0 .. i)) */
typedef struct {
	float thr;
	int cnt;
	float *sorted;
	long double *cum;
} seg_ref;
/* The references of S x Hq segments of scores hs (keys hk, or NULL: the scores), ld apart. */
seg_ref *refs_make(uint32_t S, uint32_t Hq, const uint32_t *n, const float *hs, const float *hk,
		   size_t ld, float scale, float p, uint32_t max_n);
void refs_free(seg_ref *r, uint32_t segs);
/* A segment's GPU threshold o within the stated tolerance of r's exact set, its clamp by the rule;
 * true when its count is the CPU's (then so must its threshold be). */
bool check_window(const char *what, uint32_t seg, const seg_ref *r, uint32_t n, float p,
		  uint32_t bmin, uint32_t bmax, const kvt_gpu_topp *o, int *bad);
extern uint32_t g_segs, g_exact; /* segments checked, and those equal to the CPU's set */
/* Every segment of out by check_window against refs, its cut marking `marked` of its keys hk (the
 * scores, or keys, laid out as the scores), and each KV head's listed union sel/seln ([S * Hkv]
 * [max_n]) the union of its group's marks. */
void check_segments(const char *what, uint32_t S, uint32_t Hq, uint32_t Hkv, const uint32_t *n,
		    uint32_t max_n, const float *hk, size_t ld, const seg_ref *refs, float p,
		    uint32_t bmin, uint32_t bmax, const kvt_gpu_topp *out, const uint32_t *sel,
		    const uint32_t *seln, int *bad);
void test_select(void **state);
void test_select_nonfinite(void **state);
void test_select_keep(void **state);

/* test_gpu_bins.c */
void test_scan_bins(void **state);
void test_scan_bins_arguments(void **state);

/* test_gpu_spill_list.c */
void test_spill_list(void **state);
void test_spill_arguments(void **state);

#endif
