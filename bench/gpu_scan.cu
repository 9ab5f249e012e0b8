/* SPDX-License-Identifier: MIT */
/*
 * The INT4 x binary scan on the GPU (kvt_gpu_score), D 128, 8 KV heads, 32 query heads, batch 1:
 * - 4096 tokens: microseconds per step, against the RaBitQCache paper's 13.0 us on Hopper;
 * - 64K, 128K and 1M tokens: index bytes read per second as a fraction of the device-to-device copy
 *   bandwidth measured in this binary (cudaMemcpyAsync of 1 GiB, bytes read plus written).
 * Timed with CUDA events after warm-up, median of 50 runs, each run one launch alone (launch
 * latency included) or a burst of 20 launches back to back (per launch; as in a captured decode
 * step); at 4096 tokens also per launch in a CUDA graph of 20 and alone but queued behind a held
 * stream (gpu_bench.cuh's queued_ms: the host's launch latency left out), and an empty kernel's
 * time the same four ways (the launch floor), less which the scan's own time is given. Each launch
 * scans another copy of the index, the copies together several times the L2, so the figure is
 * HBM's, not the cache's; the score buffer is reused, as the decode step reuses it.
 * The same scan building the first histogram too (kvt_gpu_score's bins, gpu/scanbins.h; issue 15,
 * point 1) is timed beside each, as a ratio to the scan alone, and the 4096-token scores' spread
 * in nats is printed (the histogram's slots in use depend on it).
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "internal.h"
}
#include "gpu/score.cuh"

#include "gpu_bench.cuh"

enum { D = 128, HKV = 8, HQ = 32, RUNS = 50 };

/* Random codes, sigma in [0.5, 1.5) and beta in [-1, 1) as fp16: never zeros. */
static __global__ void fill_index(uint32_t *codes, uint16_t *sigma, uint16_t *beta, size_t tokens,
				  uint64_t salt)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < tokens;
	     i += (size_t)gridDim.x * blockDim.x) {
		for (int w = 0; w < D / 32; w++)
			codes[i * (D / 32) + w] = hash32(salt + i * 8 + w);
		const uint32_t h = hash32(salt ^ (i * 0x9e37u + 77));
		sigma[i] = __half_as_ushort(__float2half(0.5f + (h & 0xffff) / 65536.0f));
		beta[i] = __half_as_ushort(__float2half(-1.0f + (h >> 16) / 32768.0f));
	}
}

static __global__ void fill_f16(uint16_t *x, size_t n, uint64_t salt)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		x[i] = __half_as_ushort(
			__float2half((hash32(salt + i) & 0xffff) / 32768.0f - 1.0f));
}

struct setup {
	uint32_t n, copies;
	std::vector<kvt_gpu_index_view *> views; /* device, one per copy */
	uint32_t *n_tok;
	kvt_gpu_qcode *qc;
	float *scores;
	kvt_gpu_segstats *stats; /* gathered as the step's scan gathers them (zeroed once) */
	kvt_gpu_bins bins;       /* the scan's histogram, when timed with it (zeroed once) */
	std::vector<void *> mem;
};

static setup make(uint32_t n, size_t min_bytes, const float *drot, const float *const *dcq,
		  const float *const *dck, const void *dq)
{
	setup s;
	s.n = n;
	const size_t index_bytes = (size_t)n * HKV * (D / 8 + 4);
	s.copies = (uint32_t)std::max<size_t>(1, (min_bytes + index_bytes - 1) / index_bytes);
	for (uint32_t c = 0; c < s.copies; c++) {
		kvt_gpu_index_view v;
		CK(cudaMalloc((void **)&v.codes, (size_t)n * HKV * (D / 8)));
		CK(cudaMalloc((void **)&v.sigma, (size_t)n * HKV * 2));
		CK(cudaMalloc((void **)&v.beta, (size_t)n * HKV * 2));
		v.cap = n;
		v.reserved = 0;
		fill_index<<<1024, 256>>>(v.codes, v.sigma, v.beta, (size_t)n * HKV, 1000 + c);
		CK(cudaGetLastError());
		kvt_gpu_index_view *dv;
		CK(cudaMalloc((void **)&dv, sizeof v));
		CK(cudaMemcpy(dv, &v, sizeof v, cudaMemcpyHostToDevice));
		s.views.push_back(dv);
		s.mem.insert(s.mem.end(),
			     {(void *)v.codes, (void *)v.sigma, (void *)v.beta, (void *)dv});
	}
	CK(cudaMalloc((void **)&s.n_tok, 4));
	CK(cudaMemcpy(s.n_tok, &n, 4, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&s.qc, sizeof(kvt_gpu_qcode) * HQ));
	RC(kvt_gpu_query_prepare(D, KVT_DTYPE_F16, 1, HQ, HKV, drot, dq, dcq, dck, s.qc, NULL));
	CK(cudaMalloc((void **)&s.scores, (size_t)HQ * n * 4));
	CK(cudaMalloc((void **)&s.stats, HQ * sizeof(kvt_gpu_segstats)));
	CK(cudaMemset(s.stats, 0, HQ * sizeof(kvt_gpu_segstats)));
	s.bins.scale = 1.0f / sqrtf((float)D);
	CK(cudaMalloc((void **)&s.bins.count, (size_t)HQ * KVT_BINS * 4));
	CK(cudaMalloc((void **)&s.bins.dsum, (size_t)HQ * KVT_BINS * 8));
	CK(cudaMemset(s.bins.count, 0, (size_t)HQ * KVT_BINS * 4));
	CK(cudaMemset(s.bins.dsum, 0, (size_t)HQ * KVT_BINS * 8));
	s.mem.insert(s.mem.end(), {(void *)s.n_tok, (void *)s.qc, (void *)s.scores, (void *)s.stats,
				   (void *)s.bins.count, (void *)s.bins.dsum});
	CK(cudaDeviceSynchronize());
	return s;
}

static void drop(setup &s)
{
	for (void *p : s.mem)
		CK(cudaFree(p));
}

/* The i-th scan on stream st: of the i-th copy of the index, building the histogram when bins. */
static void scan(setup &s, int i, bool bins, cudaStream_t st)
{
	RC(kvt_gpu_score(D, 1, HQ, HKV, s.qc, s.views[i % s.copies], s.n_tok, s.n, s.scores, s.n,
			 s.stats, bins ? &s.bins : NULL, NULL, st));
}

/* Median time in microseconds of the scan (and, with prep, the query preparation before it). */
static float time_scan(setup &s, bool prep, const float *drot, const float *const *dcq,
		       const float *const *dck, const void *dq)
{
	return 1000.0f * median_ms(0, 10, RUNS, [&](int i) {
		       if (prep)
			       RC(kvt_gpu_query_prepare(D, KVT_DTYPE_F16, 1, HQ, HKV, drot, dq, dcq,
							dck, s.qc, NULL));
		       scan(s, i, false, NULL);
	       });
}

/* Microseconds per scan when `burst` scans are queued back to back (launch latency hidden, as in a
 * captured decode step), median over RUNS bursts. */
static float time_burst(setup &s, int burst, bool bins = false)
{
	return 1000.0f / burst * median_ms(0, 5, RUNS, [&](int i) {
		       for (int b = 0; b < burst; b++)
			       scan(s, i * burst + b, bins, NULL);
	       });
}

int main(void)
{
	cudaDeviceProp prop;
	if (!bench_device("gpu_scan", &prop))
		return 0;
	printf("gpu_scan on %s (%d SMs, L2 %d MiB): D %d, %d KV heads, %d query heads, batch 1\n",
	       prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, D, HKV, HQ);
	const double copy_bw = d2d_copy_bandwidth();
	printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_bw / 1e9);

	/* the layer's rotation and centroids, and one random query */
	std::vector<float> rot((size_t)D * D), cen((size_t)HKV * D);
	RC(kvt_rotation_generate(0x6b767469u, 0, D, rot.data()));
	for (size_t i = 0; i < cen.size(); i++)
		cen[i] = 0.01f * (float)((i * 2654435761u) % 200) - 1.0f;
	float *drot, *dcen;
	void *dq;
	const float **dcp;
	CK(cudaMalloc((void **)&drot, rot.size() * 4));
	CK(cudaMalloc((void **)&dcen, cen.size() * 4));
	CK(cudaMalloc(&dq, (size_t)HQ * D * 2));
	CK(cudaMalloc((void **)&dcp, sizeof(float *)));
	CK(cudaMemcpy(drot, rot.data(), rot.size() * 4, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(dcen, cen.data(), cen.size() * 4, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(dcp, &dcen, sizeof(float *), cudaMemcpyHostToDevice));
	fill_f16<<<64, 256>>>((uint16_t *)dq, (size_t)HQ * D, 7);
	CK(cudaGetLastError());
	const float *const *dc = (const float *const *)dcp;

	const size_t rotate_bytes = (size_t)prop.l2CacheSize * 8;
	{
		setup s = make(4096, rotate_bytes, drot, dc, dc, dq);
		const float t = time_scan(s, false, drot, dc, dc, dq);
		const float tp = time_scan(s, true, drot, dc, dc, dq), tb = time_burst(s, 20);
		float fb;
		const float f = launch_floor_us(1, 20, &fb);
		const float fg = graph_us(20, [](cudaStream_t st, int) { empty_call(1, st); });
		const float tg = graph_us(20, [&](cudaStream_t st, int b) {
			scan(s, b, false, st);
		});
		const float tgb = graph_us(20, [&](cudaStream_t st, int b) {
			scan(s, b, true, st);
		});
		printf("scan 4096 tokens x %d KV heads: %.2f us per launch timed alone (paper, Hopper: "
		       "13.0 us; ratio %.2fx faster; goal <= 5 us); %.2f us each in a burst of 20 (ratio "
		       "%.2fx); alone with query preparation: %.2f us\n",
		       HKV, t, 13.0 / t, tb, 13.0 / tb, tp);
		printf("  launch floor (an empty kernel timed the same ways): %.2f us alone, %.2f us "
		       "each in a burst of 20, %.2f us each in a graph of 20; the scan: %.2f us each in "
		       "a graph of 20; the scan's own (less the floor): %.2f us alone, %.2f in a burst, "
		       "%.2f in a graph\n",
		       f, fb, fg, tg, t - f, tb - fb, tg - fg);
		const float tq =
			1000.0f * queued_ms(0, 10, RUNS, [&](int i) { scan(s, i, false, NULL); });
		const float fq = 1000.0f * queued_ms(0, 10, RUNS, [](int) { empty_call(1, 0); });
		printf("  alone but queued behind a held stream (nvbench's blocking kernel: the "
		       "host's launch latency left out): the scan %.2f us a launch (goal <= 5 us), "
		       "an empty kernel %.2f us; the scan's own %.2f us\n",
		       tq, fq, tq - fq);
		printf("  with the first histogram (kvt_gpu_score's bins, scanbins.h): %.2f us "
		       "each in a graph of 20 (%.2fx the scan's)\n",
		       tgb, tgb / tg);
		std::vector<float> sc((size_t)HQ * s.n);
		CK(cudaMemcpy(sc.data(), s.scores, sc.size() * 4, cudaMemcpyDeviceToHost));
		std::vector<float> spread(HQ);
		for (int q = 0; q < HQ; q++) {
			const auto mm = std::minmax_element(sc.begin() + (size_t)q * s.n,
							    sc.begin() + (size_t)(q + 1) * s.n);
			spread[q] = (*mm.second - *mm.first) / sqrtf((float)D);
		}
		std::sort(spread.begin(), spread.end());
		printf("  scores' spread at softmax scale 1/sqrt(%d): median %.2f nats over %d "
		       "query heads (%.2f to %.2f)\n",
		       D, spread[HQ / 2], HQ, spread[0], spread[HQ - 1]);
		drop(s);
	}
	const uint32_t ns[3] = {65536, 131072, 1048576};
	for (int i = 0; i < 3; i++) {
		setup s = make(ns[i], rotate_bytes, drot, dc, dc, dq);
		const float ta = time_scan(s, false, drot, dc, dc, dq), t = time_burst(s, 20);
		const float tb = time_burst(s, 20, true);
		const double index_bytes = (double)ns[i] * HKV * (D / 8 + 4);
		const double score_bytes = (double)ns[i] * HQ * 4;
		const double ib = index_bytes / (t * 1e-6);
		printf("scan %7u tokens: %8.2f us each in a burst of 20 (%.2f us timed alone): index "
		       "%.0f GB/s = %.1f%% of copy bandwidth (goal >= 80%%); counting the %.0f MB of "
		       "scores written too: %.1f%%\n",
		       ns[i], t, ta, ib / 1e9, 100.0 * ib / copy_bw, score_bytes / 1e6,
		       100.0 * (index_bytes + score_bytes) / (t * 1e-6) / copy_bw);
		printf("  with the first histogram: %8.2f us each in a burst of 20 (%.2fx the "
		       "scan's)\n",
		       tb, tb / t);
		drop(s);
	}
	return 0;
}
