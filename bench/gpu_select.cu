/* SPDX-License-Identifier: MIT */
/*
 * The Top-p threshold on the GPU (kvt_gpu_topp_threshold) at 128K tokens x 32 query heads, against
 * a sort-based Top-p in the same binary, the reference code's method (torch.sort + cumsum): sort
 * each head's scores descending, softmax terms, inclusive scan per head, first position whose
 * cumulative mass reaches p. Two sorts are timed: CUB's segmented radix sort, and a single CUB
 * radix sort over (head, score) keys, which is the faster on few long segments; the ratio is given
 * to the faster. CUDA events after warm-up, median of 50 runs of one call each (and, for ours, of
 * bursts of 10 calls, per call, of 10 calls captured in a CUDA graph, and of one call alone but
 * queued behind a held stream, gpu_bench.cuh's queued_ms); the same ways, the launch floor (three
 * empty kernels launched as the threshold's passes are) and the threshold less it; random normal
 * scores. Also the threshold given the scan's ring (its first histogram, built on the host as
 * kvt_gpu_score builds it), in a graph, less the copy that refills the ring, on these scores and
 * on peaked ones. A profile build (nvcc's -DKVT_SEL_TIMING, through meson's gpu_arch option) also
 * prints when each pass's blocks reached each point.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "gpu/scanring.h"
#include "gpu/select.cuh"
#ifdef KVT_SEL_TIMING
#include "gpu/select_common.cuh" /* seg_state: the candidates of a segment */
extern "C" void kvt_sel_timing_hist(int reset);
extern "C" void kvt_sel_timing_cand(int reset);
#endif

#include "gpu_bench.cuh"

enum { N = 131072, HQ = 32, HKV = 8, RUNS = 50 };
static const float P = 0.9f, SCALE = 0.08838834764831845f;

/* Normal(1, 3) scores (Box-Muller on hashed uniforms): never zeros, realistic spread. */
static __global__ void fill_scores(float *s, size_t n)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float u1 = (hash32(2 * i) + 1.0f) * 2.3283064e-10f,
			    u2 = hash32(2 * i + 1) * 2.3283064e-10f;
		s[i] = 1.0f + 3.0f * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
	}
}

struct seg_of {
	__host__ __device__ uint32_t operator()(uint32_t i) const
	{
		return i / N;
	}
};

static __device__ __forceinline__ uint32_t fkey(float f)
{
	uint32_t u = __float_as_uint(f);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Each head's statistics, as the scan gathers them for the threshold (max and min keys). */
static __global__ void make_stats(const float *s, kvt_gpu_segstats *st)
{
	const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i >= (size_t)N * HQ)
		return;
	const uint32_t k = fkey(s[i] + 0.0f);
	atomicMax(&st[i / N].max_key, k);
	atomicMax(&st[i / N].nmin_key, ~k);
}

/* (head, descending score) packed so that an ascending sort orders each head's scores down. */
static __global__ void make_keys(const float *s, unsigned long long *k)
{
	const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i < (size_t)N * HQ)
		k[i] = (unsigned long long)(i / N) << 32 | (uint32_t)~fkey(s[i]);
}

static __global__ void keys_to_scores(const unsigned long long *k, float *s)
{
	const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i < (size_t)N * HQ) {
		const uint32_t key = ~(uint32_t)k[i];
		s[i] = __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
	}
}

static __global__ void terms(const float *sorted, float *t)
{
	const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i < (size_t)N * HQ)
		t[i] = expf((sorted[i] - sorted[i / N * N]) * SCALE);
}

static __global__ void threshold(const float *sorted, const float *cum, float *thr)
{
	const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i >= (size_t)N * HQ)
		return;
	const size_t seg = i / N, j = i % N;
	const float target = P * cum[seg * N + N - 1];
	if (cum[i] >= target && (j == 0 || cum[i - 1] < target))
		thr[seg] = sorted[i];
}

/* Median microseconds per call of f over RUNS timings, each of `burst` calls back to back. */
template <class F>
static float time_us(F f, int burst = 1)
{
	return 1000.0f / burst * median_ms(0, 10, RUNS, [&](int) {
		       for (int b = 0; b < burst; b++)
			       f();
	       });
}

/*
 * The threshold on HQ x N scores (hs: their copy on the host) with and without the scan's ring,
 * built here on the host as kvt_gpu_score builds it, each in a graph of 10; the ring's refill
 * before each call is timed alone and subtracted. Prints the times and whether the thresholds
 * agree, at the ring's default limit and at its largest (kvt_gpu_bins.serve_max).
 */
static void given_ring(const char *what, const std::vector<float> &hs, const float *scores,
		       const kvt_gpu_segstats *stats, const uint32_t *n_tok, kvt_gpu_topp *out,
		       void *scr, size_t sb)
{
	const size_t nb = (size_t)HQ * KVT_BINS;
	std::vector<uint32_t> hc(nb, 0);
	std::vector<unsigned long long> hd(nb, 0);
	uint32_t eligible = 0;
	for (uint32_t g = 0; g < HQ; g++) {
		const float *x = hs.data() + (size_t)g * N;
		kvt_bins_add_host(x, N, SCALE, hc.data() + g * KVT_BINS, hd.data() + g * KVT_BINS);
		const auto mm = std::minmax_element(x, x + N);
		eligible += kvt_bins_serves(*mm.second, *mm.first, SCALE);
	}
	kvt_gpu_bins ring = {SCALE, NULL, NULL, 0, NULL}, pristine = ring;
	CK(cudaMalloc((void **)&ring.count, 4 * nb));
	CK(cudaMalloc((void **)&ring.dsum, 8 * nb));
	CK(cudaMalloc((void **)&pristine.count, 4 * nb));
	CK(cudaMalloc((void **)&pristine.dsum, 8 * nb));
	CK(cudaMemcpy(pristine.count, hc.data(), 4 * nb, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(pristine.dsum, hd.data(), 8 * nb, cudaMemcpyHostToDevice));
	auto refill = [&](cudaStream_t st) {
		CK(cudaMemcpyAsync(ring.count, pristine.count, 4 * nb, cudaMemcpyDeviceToDevice, st));
		CK(cudaMemcpyAsync(ring.dsum, pristine.dsum, 8 * nb, cudaMemcpyDeviceToDevice, st));
	};
	auto call = [&](cudaStream_t st, const kvt_gpu_bins *r) {
		RC(kvt_gpu_topp_threshold(1, HQ, scores, N, n_tok, N, SCALE, P, 0, 0, stats, r, out,
					  scr, sb, NULL, st));
	};
	const float without = graph_us(10, [&](cudaStream_t st, int) { call(st, NULL); });
	const float cg = graph_us(10, [&](cudaStream_t st, int) { refill(st); });
	std::vector<kvt_gpu_topp> a(HQ), b(HQ);
	call(NULL, NULL);
	CK(cudaMemcpy(a.data(), out, HQ * sizeof(kvt_gpu_topp), cudaMemcpyDeviceToHost));
	uint64_t count = 0;
	for (int i = 0; i < HQ; i++)
		count += a[i].count;
	printf("  given the scan's ring, %s scores (%.0f tokens selected per head; %u of %d heads "
	       "span less than its %.0f nats): %.2f us without it, each in a graph of 10 (goal <= "
	       "25 us); with it, less the ring's copy in (%.2f us):\n",
	       what, (double)count / HQ, eligible, HQ, (double)KVT_BINS / KVT_BINS_PER_NAT, without,
	       cg);
	for (uint32_t limit : {0u, KVT_BINS_SERVE_MAX}) {
		ring.serve_max = limit;
		const float rg = graph_us(10, [&](cudaStream_t st, int) {
			refill(st);
			call(st, &ring);
		});
		refill(NULL);
		call(NULL, &ring);
		CK(cudaMemcpy(b.data(), out, HQ * sizeof(kvt_gpu_topp), cudaMemcpyDeviceToHost));
		uint32_t served = 0;
		RC(kvt_gpu_topp_ring_served(scr, 1, HQ, &served));
		int same = 0;
		for (int i = 0; i < HQ; i++)
			same += a[i].thresh == b[i].thresh && a[i].count == b[i].count;
		printf("    serving at most %u candidates (%s): %u heads served, %.2f us; the "
		       "same threshold and count in %d of %d heads\n",
		       limit ? limit : KVT_BINS_SERVE_DEFAULT,
		       limit ? "the largest limit" : "the default", served, rg - cg, same, HQ);
	}
	for (void *pp : {(void *)ring.count, (void *)ring.dsum, (void *)pristine.count,
			 (void *)pristine.dsum})
		CK(cudaFree(pp));
}

int main(void)
{
	cudaDeviceProp prop;
	if (!bench_device("gpu_select", &prop))
		return 0;
	const size_t total = (size_t)N * HQ;
	float *scores, *sorted, *tm, *cum, *thr_sort;
	unsigned long long *keys, *keys_out;
	uint32_t *n_tok, *sel, *sel_n, *offs;
	kvt_gpu_topp *out;
	CK(cudaMalloc((void **)&scores, total * 4));
	CK(cudaMalloc((void **)&sorted, total * 4));
	CK(cudaMalloc((void **)&tm, total * 4));
	CK(cudaMalloc((void **)&cum, total * 4));
	CK(cudaMalloc((void **)&keys, total * 8));
	CK(cudaMalloc((void **)&keys_out, total * 8));
	CK(cudaMalloc((void **)&thr_sort, HQ * 4));
	CK(cudaMalloc((void **)&n_tok, 4));
	CK(cudaMalloc((void **)&sel, (size_t)HKV * N * 4));
	CK(cudaMalloc((void **)&sel_n, HKV * 4));
	CK(cudaMalloc((void **)&offs, (HQ + 1) * 4));
	CK(cudaMalloc((void **)&out, HQ * sizeof(kvt_gpu_topp)));
	fill_scores<<<2048, 256>>>(scores, total);
	CK(cudaGetLastError());
	const uint32_t n = N;
	std::vector<uint32_t> ho(HQ + 1);
	for (int i = 0; i <= HQ; i++)
		ho[i] = (uint32_t)i * N;
	CK(cudaMemcpy(n_tok, &n, 4, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(offs, ho.data(), (HQ + 1) * 4, cudaMemcpyHostToDevice));
	const size_t sb = kvt_gpu_select_scratch_bytes(1, HQ, HKV, N);
	void *scr;
	CK(cudaMalloc(&scr, sb));

	/* temporary storage of the sort-based path, sized once */
	auto seg_keys = thrust::make_transform_iterator(thrust::make_counting_iterator<uint32_t>(0),
							seg_of());
	size_t t1 = 0, t2 = 0, t3 = 0;
	CK(cub::DeviceSegmentedRadixSort::SortKeysDescending(NULL, t1, scores, sorted, (int)total,
							     HQ, offs, offs + 1));
	CK(cub::DeviceRadixSort::SortKeys(NULL, t2, keys, keys_out, total, 0, 37));
	CK(cub::DeviceScan::InclusiveSumByKey(NULL, t3, seg_keys, tm, cum, (int)total));
	void *tmp;
	const size_t tb = std::max(t1, std::max(t2, t3));
	CK(cudaMalloc(&tmp, tb));
	const int blocks = (int)((total + 255) / 256);

	kvt_gpu_segstats *stats;
	CK(cudaMalloc((void **)&stats, HQ * sizeof(kvt_gpu_segstats)));
	CK(cudaMemset(stats, 0, HQ * sizeof(kvt_gpu_segstats)));
	make_stats<<<blocks, 256>>>(scores, stats);
	CK(cudaGetLastError());
	/* as a decode step runs it: after the scan, which gathered the statistics */
	auto ours_on = [&](cudaStream_t st) {
		RC(kvt_gpu_topp_threshold(1, HQ, scores, N, n_tok, N, SCALE, P, 0, 0, stats, NULL, out, scr,
					  sb, NULL, st));
	};
	auto ours = [&] { ours_on(NULL); };
	auto ours_self = [&] {
		RC(kvt_gpu_topp_threshold(1, HQ, scores, N, n_tok, N, SCALE, P, 0, 0, NULL, NULL, out, scr,
					  sb, NULL, NULL));
	};
	auto ours_union = [&] {
		ours();
		RC(kvt_gpu_topp_union(1, HQ, HKV, scores, N, n_tok, N, out, sel, N, sel_n, scr, sb,
				      NULL));
	};
	/* the same selection with the union marked by the threshold's candidate pass (a decode
	 * step's path) */
	void *bmem;
	CK(cudaMalloc(&bmem, kvt_gpu_selbits_bytes(HKV, N)));
	const kvt_gpu_selbits bits = kvt_gpu_selbits_at(bmem, HKV, N);
	auto ours_fused = [&] {
		RC(kvt_gpu_topp_select(1, HQ, HKV, scores, N, n_tok, N, SCALE, P, 0, 0, stats, NULL, out,
				       bits, NULL, NULL, scr, sb, NULL, NULL));
		RC(kvt_gpu_selbits_list(HKV, bits, sel, N, sel_n, NULL));
	};
	auto ours_budget = [&] {
		RC(kvt_gpu_topp_threshold(1, HQ, scores, N, n_tok, N, SCALE, P, 0, 2048, stats, NULL, out,
					  scr, sb, NULL, NULL));
	};
	auto scan_and_pick = [&] {
		size_t b = tb;
		terms<<<blocks, 256>>>(sorted, tm);
		CK(cub::DeviceScan::InclusiveSumByKey(tmp, b, seg_keys, tm, cum, (int)total));
		threshold<<<blocks, 256>>>(sorted, cum, thr_sort);
	};
	auto by_segmented = [&] {
		size_t b = tb;
		CK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
			tmp, b, scores, sorted, (int)total, HQ, offs, offs + 1));
		scan_and_pick();
	};
	auto by_global = [&] {
		size_t b = tb;
		make_keys<<<blocks, 256>>>(scores, keys);
		CK(cub::DeviceRadixSort::SortKeys(tmp, b, keys, keys_out, total, 0, 37));
		keys_to_scores<<<blocks, 256>>>(keys_out, sorted);
		scan_and_pick();
	};

	const float a = time_us(ours), au = time_us(ours_union), ab = time_us(ours_budget);
	const float af = time_us(ours_fused);
	const float a10 = time_us(ours, 10), aself = time_us(ours_self);
	const float s1 = time_us(by_segmented), s2 = time_us(by_global);
	const float sort_best = std::min(s1, s2);

	/* the two methods on the same scores: thresholds (the float cumsum of the sort-based path can
	 * move the boundary by a token where the mass sits within its rounding) */
	ours();
	by_global();
	CK(cudaDeviceSynchronize());
	std::vector<kvt_gpu_topp> ho_out(HQ);
	std::vector<float> hthr(HQ);
	CK(cudaMemcpy(ho_out.data(), out, HQ * sizeof(kvt_gpu_topp), cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(hthr.data(), thr_sort, HQ * 4, cudaMemcpyDeviceToHost));
	int same = 0;
	uint64_t count = 0;
	for (int i = 0; i < HQ; i++) {
		same += ho_out[i].thresh == hthr[i];
		count += ho_out[i].count;
	}
	printf("gpu_select on %s: %d query heads x %d tokens, p = %.2f (%.0f tokens selected per head "
	       "on average)\n",
	       prop.name, HQ, N, (double)P, (double)count / HQ);
	printf("threshold (log-mass histogram in float terms, integer sums, candidates; no sort), with "
	       "the scan's statistics: %.2f us per call timed alone (goal <= 25 us); %.2f us each in "
	       "a burst of 10; gathering the statistics itself: %.2f us\n",
	       a, a10, aself);
	float fb;
	const float f = launch_floor_us(3, 10, &fb);
	const float fg = graph_us(10, [](cudaStream_t st, int) { empty_call(3, st); });
	const float ag = graph_us(10, [&](cudaStream_t st, int) { ours_on(st); });
	printf("  launch floor (three empty kernels, two of them dependent launches, as the "
	       "threshold's passes): %.2f us alone, %.2f us each in a burst of 10, %.2f us each in "
	       "a graph of 10; the threshold: %.2f us each in a graph of 10; its own (less the "
	       "floor): %.2f us alone, %.2f in a burst, %.2f in a graph\n",
	       f, fb, fg, ag, a - f, a10 - fb, ag - fg);
	/* the same, alone but queued behind a held stream (gpu_bench.cuh's queued_ms) */
	const float aq = 1000.0f * queued_ms(0, 10, RUNS, [&](int) { ours(); }),
		    fq = 1000.0f * queued_ms(0, 10, RUNS, [](int) { empty_call(3, 0); });
	printf("  alone but queued behind a held stream (nvbench's blocking kernel: the host's "
	       "launch latency left out): the threshold %.2f us a call, the floor %.2f us; its own "
	       "%.2f us\n",
	       aq, fq, aq - fq);
	printf("  with budget_max 2048 (the clamp too): %.2f us; threshold + union/compaction into %d "
	       "KV-head lists: %.2f us as two calls, %.2f us with the union marked by the candidate "
	       "pass (kvt_gpu_topp_select)\n",
	       ab, HKV, au, af);
	/* the threshold given the scan's ring (kvt_gpu_score's bins, built here on the host as the
	 * scan builds it), on these scores, flat at 1/32 nat (the ring's bins too full: each segment
	 * takes the threshold's own), and on peaked ones (a fiftieth of the tokens raised by about 7
	 * nats, which take most of the mass, as trained attention does): the ring is consumed
	 * (cleared) by each call, so each call first copies a pristine one in; the copy is timed
	 * alone the same way and subtracted */
	{
		std::vector<float> hs((size_t)HQ * N);
		CK(cudaMemcpy(hs.data(), scores, hs.size() * 4, cudaMemcpyDeviceToHost));
		given_ring("flat", hs, scores, stats, n_tok, out, scr, sb);
		for (size_t i = 0; i < hs.size(); i += 50) /* 7 +- 1 nats up, from the score's bits */
			hs[i] += (7.0f + (float)(i / 50 % 17) / 8.0f - 1.0f) / SCALE;
		float *peaked;
		kvt_gpu_segstats *pstats;
		CK(cudaMalloc((void **)&peaked, hs.size() * 4));
		CK(cudaMalloc((void **)&pstats, HQ * sizeof(kvt_gpu_segstats)));
		CK(cudaMemcpy(peaked, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
		CK(cudaMemset(pstats, 0, HQ * sizeof(kvt_gpu_segstats)));
		make_stats<<<blocks, 256>>>(peaked, pstats);
		CK(cudaGetLastError());
		given_ring("peaked", hs, peaked, pstats, n_tok, out, scr, sb);
		CK(cudaFree(peaked));
		CK(cudaFree(pstats));
	}
	printf("sort-based Top-p: CUB segmented radix sort + scan %.2f us, CUB global radix sort over "
	       "(head, score) + scan %.2f us\n",
	       s1, s2);
	printf("ratio: %.1fx faster than the faster sort-based path (goal >= 20x); thresholds equal "
	       "in %d of %d heads\n",
	       sort_best / a, same, HQ);
#ifdef KVT_SEL_TIMING
	/* a profile build: when each pass's blocks reached each point (the max over blocks, from the
	 * first block's start; select_common.cuh's SEL_T), on warm clocks, and the candidates */
	for (int r = 0; r < 3; r++) {
		kvt_sel_timing_hist(1);
		kvt_sel_timing_cand(1);
		ours();
		CK(cudaDeviceSynchronize());
		kvt_sel_timing_hist(0);
		kvt_sel_timing_cand(0);
	}
	seg_state st;
	CK(cudaMemcpy(&st, scr, sizeof st, cudaMemcpyDeviceToHost));
	printf("segment 0: %u candidates (%s)\n", st.ncand, st.listed ? "listed" : "whole segment");
#endif
	return 0;
}
