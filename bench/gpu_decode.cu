/* SPDX-License-Identifier: MIT */
/*
 * One decode step of one layer at Llama-3.1-8B's shape (32 query heads, 8 KV heads, head dim 128,
 * fp16), batch 1 and 8, contexts 32K to 1M tokens, three ways:
 * - RESIDENT: exact attention with every K/V row in HBM, a flash-decoding kernel of this file (split
 *   over chunks of tokens, each block serving the 4 query heads of a GQA group from one read of K/V,
 *   fp32 accumulation, then a merge kernel). Its HBM bytes read per second against the
 *   device-to-device copy bandwidth measured in this binary (read + write bytes, as gpu_scan.cu);
 *   checked against an fp32 CPU reference on a small case first.
 * - NAIVE OFFLOAD: the batch's whole K/V copied from pinned host memory (one contiguous
 *   cudaMemcpyAsync per tensor), then the resident kernel.
 * - KVTIER: kvt_append + kvt_attend through the public API (CUDA backend, one layer), after a
 *   chunked prefill of generated K/V whose attention is concentrated the way real attention is
 *   (see the generator), so that Top-p selects a few percent of the tokens.
 * Times are CUDA-event medians on one stream after warm-up (resident: over --reps launches; kvtier:
 * per step, event before kvt_append to event after kvt_attend, host synchronized between steps).
 * Ratios: kvtier / resident and naive / kvtier, with the goals of the issue (reported, never
 * asserted: a missed goal does not change the exit status). A (context, batch) whose K/V exceeds
 * --max-host-gib is skipped with the reason (1M x batch 8 is 32 GiB, pinned twice at once).
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "kvtier.h"

#include "gpu_bench.cuh"

enum { D = 128, HKV = 8, HQ = 32, G = HQ / HKV, ROW = 4 * D, THREADS = 256 };

/* ---- the generator --------------------------------------------------------------------------
 * Each KV head has NTOPIC random directions ("topics", norm about 1) and a fixed bias (norm about
 * 8, which the key centroid removes). The context is a sequence of passages of TOPIC_RUN tokens;
 * each passage of each (sequence, KV head) is about one topic, drawn by hash. A key is
 * a * topic + bias + N(0, 1) noise per element, with a strength a uniform in [4.8, 8] per token; a
 * value is N(0, 1) per element. A decode query of KV head h's group looks for one topic (the topic
 * of a passage picked by hash, so the context holds it): 12 * topic + N(0, 0.3^2) noise, the noise
 * fresh at every step and for every query head. So a query's attention mass sits on the tokens of
 * its topic's passages (about 1/NTOPIC of the context), most of it on their stronger keys: Top-p(0.9)
 * then selects a few percent of the tokens, the same ones from step to step, as in real decoding;
 * uniform noise would make Top-p select nearly everything. Prefill queries (for the query centroid)
 * look for a random topic each. Appended tokens follow the same rules at their positions. Every
 * element is a function of (sequence, head, position, element) alone, so the resident buffers and
 * the chunks handed to kvtier hold the same numbers. */
enum { NTOPIC = 32, TOPIC_RUN = 512 };
static const float KEY_A0 = 4.8f, KEY_A1 = 3.2f, KEY_NOISE = 1.0f, BIAS = 0.7f, Q_STRENGTH = 12.0f,
		   Q_NOISE = 0.3f;

static __device__ __forceinline__ uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

static __device__ __forceinline__ uint64_t hcat(uint64_t a, uint64_t b)
{
	return mix64(a ^ (b * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull));
}

/* N(0, 1) from 64 hashed bits (Box-Muller). */
static __device__ __forceinline__ float gauss(uint64_t x)
{
	const float u1 = ((float)(x >> 40) + 1.0f) * (1.0f / 16777216.0f),
		    u2 = (float)(x & 0xffffffu) * (1.0f / 16777216.0f);
	return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

/* topic[h][t][e] and bias[h][e], float, device */
struct gen_tables {
	float *topic, *bias;
};

static __global__ void init_tables(gen_tables g)
{
	const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < HKV * NTOPIC * D)
		g.topic[i] = gauss(hcat(11, i)) * rsqrtf((float)D);
	if (i < HKV * D)
		g.bias[i] = BIAS * gauss(hcat(12, i));
}

static __device__ __forceinline__ uint32_t tok_topic(uint32_t s, uint32_t h, uint32_t pos)
{
	return (uint32_t)(hcat(hcat(hcat(1, s), h), pos / TOPIC_RUN) % NTOPIC);
}

/* The 8 elements [8 c, 8 c + 8) of K and V of (sequence s, KV head h, position pos), as fp16. */
static __device__ void gen_kv8(const gen_tables &g, uint32_t s, uint32_t h, uint32_t pos, uint32_t c,
			       uint4 *k, uint4 *v)
{
	const uint64_t rb = hcat(hcat(hcat(2, s), h), pos);
	const uint32_t t = tok_topic(s, h, pos);
	const float a = KEY_A0 + KEY_A1 * (float)(hcat(rb, 999) >> 40) * (1.0f / 16777216.0f);
	__half kk[8], vv[8];
#pragma unroll
	for (int j = 0; j < 8; j++) {
		const uint32_t e = 8 * c + j;
		kk[j] = __float2half(a * g.topic[(h * NTOPIC + t) * D + e] + g.bias[h * D + e] +
				     KEY_NOISE * gauss(hcat(rb, 2 * e)));
		vv[j] = __float2half(gauss(hcat(rb, 2 * e + 1)));
	}
	*k = *(const uint4 *)kk;
	*v = *(const uint4 *)vv;
}

/*
 * K and V of sequences [s0, s0 + n_seqs), positions [p0, p0 + n_tok).
 * seq_major: the resident layout [s][h][t][D]; else kvtier's [s][t][h][D].
 */
static __global__ void fill_kv(gen_tables g, uint16_t *k, uint16_t *v, uint32_t s0,
			       uint32_t n_seqs, uint32_t p0, uint32_t n_tok, int seq_major)
{
	const uint64_t total = (uint64_t)n_seqs * HKV * n_tok * (D / 8);
	for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < total;
	     i += (uint64_t)gridDim.x * blockDim.x) {
		const uint32_t c = (uint32_t)(i % (D / 8));
		const uint64_t row = i / (D / 8);
		uint32_t s, h, t;
		if (seq_major) {
			t = (uint32_t)(row % n_tok);
			h = (uint32_t)(row / n_tok % HKV);
			s = (uint32_t)(row / n_tok / HKV);
		} else {
			h = (uint32_t)(row % HKV);
			t = (uint32_t)(row / HKV % n_tok);
			s = (uint32_t)(row / HKV / n_tok);
		}
		uint4 kk, vv;
		gen_kv8(g, s0 + s, h, p0 + t, c, &kk, &vv);
		((uint4 *)k)[i] = kk;
		((uint4 *)v)[i] = vv;
	}
}

/*
 * Decode queries [n_seqs][HQ][D] of step `step`, each query head looking for the topic of the
 * passage at a hashed position below focus_n; with prefill set, queries [n_tok][HQ][D] of one
 * sequence's prefill positions p0..., each looking for a random topic.
 */
static __global__ void fill_q(gen_tables g, uint16_t *q, uint32_t n, uint32_t step,
			      uint32_t focus_n, int prefill, uint32_t p0)
{
	const uint64_t total = (uint64_t)n * HQ * D;
	for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < total;
	     i += (uint64_t)gridDim.x * blockDim.x) {
		const uint32_t e = (uint32_t)(i % D), j = (uint32_t)(i / D % HQ),
			       r = (uint32_t)(i / D / HQ), h = j / G;
		uint32_t t;
		uint64_t noise;
		if (prefill) {
			t = (uint32_t)(hcat(hcat(5, p0 + r), j) % NTOPIC);
			noise = hcat(hcat(hcat(6, p0 + r), j), e);
		} else {
			const uint32_t focus = (uint32_t)(hcat(hcat(3, r), h) % focus_n);
			t = tok_topic(r, h, focus);
			noise = hcat(hcat(hcat(hcat(4, r), j), step), e);
		}
		const float x = Q_STRENGTH * g.topic[(h * NTOPIC + t) * D + e] + Q_NOISE * gauss(noise);
		q[i] = __half_as_ushort(__float2half(x));
	}
}

/* ---- the resident baseline ------------------------------------------------------------------
 * Block (chunk c, item = sequence * HKV + KV head): tokens [c * chunk, (c + 1) * chunk) of the
 * item. K and V tiles of TR rows stream into shared memory through an ST-stage cp.async pipeline
 * (ST - 1 tiles in flight while one is used, so HBM sees many requests per SM without the registers
 * they would take), and 16 row groups of 16 lanes consume them: a lane holds 8 dimensions of each
 * of the 4 query heads, so one 16-byte read of K serves the whole group, and the dot products are
 * reduced over the 16 lanes with shuffles. Scores are in log2 units (q pre-scaled by
 * scale * log2 e), with a running maximum per head; the block merges its groups and writes
 * (max, sum) and the unnormalized output of each head, which k_merge combines over the chunks. */
static __device__ __forceinline__ void cp_async16(void *sdst, const void *gsrc, uint32_t bytes)
{
	const uint32_t sa = (uint32_t)__cvta_generic_to_shared(sdst);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gsrc),
		     "r"(bytes));
}

static __device__ __forceinline__ void cp_commit(void)
{
	asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> static __device__ __forceinline__ void cp_wait(void)
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void unpack8(const uint4 &u, float *f)
{
	const __half2 *h = (const __half2 *)&u;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		const float2 x = __half22float2(h[i]);
		f[2 * i] = x.x;
		f[2 * i + 1] = x.y;
	}
}

/* Shared memory of a block: the pipeline's stages, or the merge of its row groups afterwards. */
static constexpr size_t merge_smem = (size_t)16 * G * (D + 2) * 4;
template <int TR, int ST> static constexpr size_t res_smem(void)
{
	return std::max((size_t)ST * TR * D * 2 * 2, merge_smem);
}

template <int TR, int ST>
static __global__ void __launch_bounds__(THREADS, 2)
	k_resident(const uint16_t *K, const uint16_t *V, const uint16_t *q, uint32_t n,
		   uint32_t chunk, uint32_t chunks, float qscale, float2 *part_ml, float *part_acc)
{
	constexpr int LPR = 16, GROUPS = THREADS / LPR, RPG = TR / GROUPS, TILE = TR * D * 2 / 16;
	static_assert(TR % GROUPS == 0, "a tile gives every row group the same rows");
	extern __shared__ uint4 smem[];
	const uint32_t item = blockIdx.y, s = item / HKV, h = item % HKV;
	const uint32_t tid = threadIdx.x, grp = tid / LPR, li = tid % LPR;
	const uint32_t r0 = blockIdx.x * chunk, r1 = min(r0 + chunk, n);
	if (r0 >= n)
		return;
	const uint4 *kg = (const uint4 *)(K + (size_t)item * n * D);
	const uint4 *vg = (const uint4 *)(V + (size_t)item * n * D);

	float qv[G][8], m[G], l[G], acc[G][8];
#pragma unroll
	for (int g = 0; g < G; g++) {
		unpack8(((const uint4 *)(q + ((size_t)s * HQ + h * G + g) * D))[li], qv[g]);
#pragma unroll
		for (int e = 0; e < 8; e++) {
			qv[g][e] *= qscale;
			acc[g][e] = 0.0f;
		}
		m[g] = -INFINITY;
		l[g] = 0.0f;
	}

	const uint32_t ntiles = (r1 - r0 + TR - 1) / TR;
	auto issue = [&](uint32_t t) {
		if (t < ntiles) {
			uint4 *sk = smem + (size_t)(t % ST) * 2 * TILE, *sv = sk + TILE;
			const uint32_t rb = r0 + t * TR;
#pragma unroll
			for (int j = tid; j < TILE; j += THREADS) {
				const bool ok = rb + j / (D / 8) < r1;
				const size_t at = ok ? (size_t)rb * (D / 8) + j : 0;
				cp_async16(sk + j, kg + at, ok ? 16 : 0);
				cp_async16(sv + j, vg + at, ok ? 16 : 0);
			}
		}
		cp_commit(); /* an empty group too: the wait below counts groups */
	};
#pragma unroll
	for (int t = 0; t < ST - 1; t++)
		issue(t);

	for (uint32_t t = 0; t < ntiles; t++) {
		issue(t + ST - 1);
		cp_wait<ST - 1>();
		__syncthreads();
		const uint4 *sk = smem + (size_t)(t % ST) * 2 * TILE, *sv = sk + TILE;
		const uint32_t rb = r0 + t * TR;
		float sc[RPG][G];
#pragma unroll
		for (int u = 0; u < RPG; u++) {
			const uint32_t lr = grp + u * GROUPS;
			float kf[8];
			unpack8(sk[lr * (D / 8) + li], kf);
#pragma unroll
			for (int g = 0; g < G; g++) {
				float dot = 0.0f;
#pragma unroll
				for (int e = 0; e < 8; e++)
					dot = fmaf(qv[g][e], kf[e], dot);
#pragma unroll
				for (int o = LPR / 2; o; o >>= 1)
					dot += __shfl_xor_sync(0xffffffffu, dot, o);
				sc[u][g] = rb + lr < r1 ? dot : -INFINITY;
			}
		}
#pragma unroll
		for (int g = 0; g < G; g++) {
			float mn = m[g];
#pragma unroll
			for (int u = 0; u < RPG; u++)
				mn = fmaxf(mn, sc[u][g]);
			if (mn > m[g]) {
				const float corr = exp2f(m[g] - mn);
				l[g] *= corr;
#pragma unroll
				for (int e = 0; e < 8; e++)
					acc[g][e] *= corr;
				m[g] = mn;
			}
		}
#pragma unroll
		for (int u = 0; u < RPG; u++) {
			const uint32_t lr = grp + u * GROUPS;
			float vf[8];
			unpack8(sv[lr * (D / 8) + li], vf);
#pragma unroll
			for (int g = 0; g < G; g++) {
				const float w = sc[u][g] == -INFINITY ? 0.0f : exp2f(sc[u][g] - m[g]);
				l[g] += w;
#pragma unroll
				for (int e = 0; e < 8; e++)
					acc[g][e] = fmaf(w, vf[e], acc[g][e]);
			}
		}
		__syncthreads(); /* the next iteration refills this stage */
	}
	cp_wait<0>();
	__syncthreads();

	/* merge the 16 row groups: [grp][g][m, l, acc[D]] in the pipeline's memory */
	float *sm = (float *)smem;
#pragma unroll
	for (int g = 0; g < G; g++) {
		float *p = sm + ((size_t)grp * G + g) * (D + 2);
		if (li == 0) {
			p[0] = m[g];
			p[1] = l[g];
		}
#pragma unroll
		for (int e = 0; e < 8; e++)
			p[2 + 8 * li + e] = acc[g][e];
	}
	__syncthreads();
	for (uint32_t o = tid; o < G * D; o += THREADS) {
		const uint32_t g = o / D, e = o % D;
		float M = -INFINITY;
		for (int k = 0; k < GROUPS; k++)
			M = fmaxf(M, sm[((size_t)k * G + g) * (D + 2)]);
		float L = 0.0f, a = 0.0f;
		for (int k = 0; k < GROUPS; k++) {
			const float *p = sm + ((size_t)k * G + g) * (D + 2);
			if (p[0] == -INFINITY)
				continue;
			const float f = exp2f(p[0] - M);
			L = fmaf(f, p[1], L);
			a = fmaf(f, p[2 + e], a);
		}
		const size_t at = ((size_t)item * chunks + blockIdx.x) * G + g;
		part_acc[at * D + e] = a;
		if (e == 0)
			part_ml[at] = make_float2(M, L);
	}
}

/* Block (sequence, query head): combine the chunks' partial results; 8 warps split the chunks, a
 * lane owns 4 dimensions. */
static __global__ void __launch_bounds__(THREADS)
	k_merge(const float2 *part_ml, const float *part_acc, uint32_t chunks, float *out)
{
	__shared__ float wm[THREADS / 32], wl[THREADS / 32], wa[THREADS / 32][D];
	const uint32_t sj = blockIdx.x, item = sj / G, g = sj % G;
	const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	float M = -INFINITY, L = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
	for (uint32_t c = warp; c < chunks; c += THREADS / 32) {
		const size_t at = ((size_t)item * chunks + c) * G + g;
		const float2 ml = part_ml[at];
		const float4 p = ((const float4 *)(part_acc + at * D))[lane];
		const float mn = fmaxf(M, ml.x), f0 = exp2f(M - mn), f1 = exp2f(ml.x - mn);
		L = L * f0 + ml.y * f1;
		a[0] = a[0] * f0 + p.x * f1;
		a[1] = a[1] * f0 + p.y * f1;
		a[2] = a[2] * f0 + p.z * f1;
		a[3] = a[3] * f0 + p.w * f1;
		M = mn;
	}
	if (lane == 0) {
		wm[warp] = M;
		wl[warp] = L;
	}
	for (int e = 0; e < 4; e++)
		wa[warp][4 * lane + e] = a[e];
	__syncthreads();
	if (threadIdx.x < D) {
		float MM = -INFINITY;
		for (int w = 0; w < THREADS / 32; w++)
			MM = fmaxf(MM, wm[w]);
		float LL = 0.0f, aa = 0.0f;
		for (int w = 0; w < THREADS / 32; w++) {
			if (wm[w] == -INFINITY)
				continue;
			const float f = exp2f(wm[w] - MM);
			LL = fmaf(f, wl[w], LL);
			aa = fmaf(f, wa[w][threadIdx.x], aa);
		}
		out[(size_t)sj * D + threadIdx.x] = LL > 0.0f ? aa / LL : 0.0f;
	}
}

typedef void (*res_kernel)(const uint16_t *, const uint16_t *, const uint16_t *, uint32_t,
			   uint32_t, uint32_t, float, float2 *, float *);

struct variant {
	const char *name;
	res_kernel fn;
	uint32_t tr;
	size_t smem;
	int occ; /* blocks per SM */
};

template <int TR, int ST> static variant make_variant(const char *name)
{
	variant v = {name, k_resident<TR, ST>, TR, res_smem<TR, ST>(), 0};
	CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)v.smem));
	CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.occ, v.fn, THREADS, v.smem));
	return v;
}

/* How one resident launch is cut: a variant and a number of chunks per item. */
struct res_plan {
	const variant *v;
	uint32_t chunk, chunks;
	int waves;
};

static res_plan plan_for(const variant &v, int waves, int sms, uint32_t items, uint32_t n)
{
	const uint32_t want = std::max<uint32_t>(1, (uint32_t)(waves * v.occ * sms) / items);
	uint32_t chunk = (n + want - 1) / want;
	chunk = std::max(v.tr, (chunk + v.tr - 1) / v.tr * v.tr);
	return {&v, chunk, (n + chunk - 1) / chunk, waves};
}

/* Scratch of the resident kernel, grown on demand. */
struct res_scratch {
	float2 *ml = nullptr;
	float *acc = nullptr;
	size_t cap = 0; /* (item, chunk, head) entries */
	void need(size_t entries)
	{
		if (entries <= cap)
			return;
		if (ml) {
			CK(cudaFree(ml));
			CK(cudaFree(acc));
		}
		CK(cudaMalloc((void **)&ml, entries * sizeof(float2)));
		CK(cudaMalloc((void **)&acc, entries * D * sizeof(float)));
		cap = entries;
	}
};

static void resident_launch(const res_plan &p, res_scratch &sc, const uint16_t *K,
			    const uint16_t *V, const uint16_t *q, uint32_t n_seqs, uint32_t n,
			    float *out, cudaStream_t st)
{
	const uint32_t items = n_seqs * HKV;
	sc.need((size_t)items * p.chunks * G);
	const float qscale = (float)(1.4426950408889634 / sqrt((double)D));
	p.v->fn<<<dim3(p.chunks, items), THREADS, p.v->smem, st>>>(K, V, q, n, p.chunk, p.chunks,
								   qscale, sc.ml, sc.acc);
	CK(cudaGetLastError());
	k_merge<<<n_seqs * HQ, THREADS, 0, st>>>(sc.ml, sc.acc, p.chunks, out);
	CK(cudaGetLastError());
}

/* Median milliseconds of `reps` resident launches, each alone between two events. */
static float resident_time(const res_plan &p, res_scratch &sc, const uint16_t *K,
			   const uint16_t *V, const uint16_t *q, uint32_t n_seqs, uint32_t n,
			   float *out, cudaStream_t st, int reps)
{
	return median_ms(st, 3, reps,
			 [&](int) { resident_launch(p, sc, K, V, q, n_seqs, n, out, st); });
}

static float h2f(uint16_t x)
{
	return __half2float(__ushort_as_half(x));
}

/* fp64 reference of one (sequence, query head) over K/V in the resident layout (host copies). */
static void reference(const std::vector<uint16_t> &k, const std::vector<uint16_t> &v,
		      const std::vector<uint16_t> &q, uint32_t n, uint32_t s, uint32_t j, double *o)
{
	const uint32_t h = j / G;
	const uint16_t *kb = k.data() + ((size_t)s * HKV + h) * n * D;
	const uint16_t *vb = v.data() + ((size_t)s * HKV + h) * n * D;
	const uint16_t *qq = q.data() + ((size_t)s * HQ + j) * D;
	std::vector<double> sc(n);
	double mx = -INFINITY;
	for (uint32_t t = 0; t < n; t++) {
		double d = 0;
		for (int e = 0; e < D; e++)
			d += (double)h2f(qq[e]) * h2f(kb[(size_t)t * D + e]);
		sc[t] = d / sqrt((double)D);
		mx = std::max(mx, sc[t]);
	}
	double sum = 0;
	for (int e = 0; e < D; e++)
		o[e] = 0;
	for (uint32_t t = 0; t < n; t++) {
		const double w = exp(sc[t] - mx);
		sum += w;
		for (int e = 0; e < D; e++)
			o[e] += w * h2f(vb[(size_t)t * D + e]);
	}
	for (int e = 0; e < D; e++)
		o[e] /= sum;
}

/* Largest relative error over (sequence, head): ||out - ref|| / ||ref||. */
static double rel_error(const float *out, const double *ref, size_t heads)
{
	double worst = 0;
	for (size_t i = 0; i < heads; i++) {
		double num = 0, den = 0;
		for (int e = 0; e < D; e++) {
			const double d = out[i * D + e] - ref[i * D + e];
			num += d * d;
			den += ref[i * D + e] * ref[i * D + e];
		}
		worst = std::max(worst, sqrt(num / std::max(den, 1e-30)));
	}
	return worst;
}

static void launch_fill_kv(const gen_tables &g, uint16_t *k, uint16_t *v, uint32_t s0,
			   uint32_t n_seqs, uint32_t p0, uint32_t n_tok, int seq_major,
			   cudaStream_t st)
{
	fill_kv<<<4096, 256, 0, st>>>(g, k, v, s0, n_seqs, p0, n_tok, seq_major);
	CK(cudaGetLastError());
}

static void launch_fill_q(const gen_tables &g, uint16_t *q, uint32_t n, uint32_t step,
			  uint32_t focus_n, int prefill, uint32_t p0, cudaStream_t st)
{
	fill_q<<<1024, 256, 0, st>>>(g, q, n, step, focus_n, prefill, p0);
	CK(cudaGetLastError());
}

struct options {
	std::vector<uint32_t> contexts = {32768, 131072, 524288, 1048576};
	std::vector<uint32_t> batches = {1, 8};
	int steps = 40, warmup = 8, reps = 30;
	uint32_t budget_max = 0;
	long gpu_cache_mib = -1; /* -1: the library's default */
	/* K/V bytes of one (context, batch) at most: naive offload pins that much and kvtier's host
	 * tier as much again, at once; 0.3 of the machine's memory keeps both within 60% of it */
	double max_host_gib = 0.3 * (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) /
			      1073741824.0;
};

static options parse(int argc, char **argv)
{
	options o;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
		if (!val) {
			fprintf(stderr, "%s needs a value\n", a);
			exit(2);
		}
		if (!strcmp(a, "--contexts"))
			o.contexts = parse_u32_list(a, val);
		else if (!strcmp(a, "--batches"))
			o.batches = parse_u32_list(a, val);
		else if (!strcmp(a, "--steps"))
			o.steps = std::max(1, atoi(val));
		else if (!strcmp(a, "--warmup"))
			o.warmup = std::max(1, atoi(val));
		else if (!strcmp(a, "--reps"))
			o.reps = std::max(20, atoi(val));
		else if (!strcmp(a, "--budget-max"))
			o.budget_max = (uint32_t)strtoul(val, NULL, 0);
		else if (!strcmp(a, "--gpu-cache-mib"))
			o.gpu_cache_mib = atol(val);
		else if (!strcmp(a, "--max-host-gib"))
			o.max_host_gib = atof(val);
		else {
			fprintf(stderr,
				"usage: gpu_decode [--contexts N,N..] [--batches N,N..] [--steps N] "
				"[--warmup N] [--reps N>=20] [--budget-max N] [--gpu-cache-mib N] "
				"[--max-host-gib X]\n");
			exit(2);
		}
		i++;
	}
	std::sort(o.contexts.begin(), o.contexts.end());
	std::sort(o.batches.begin(), o.batches.end());
	return o;
}

/* Check the resident kernel, every variant, against the fp64 reference on a small case whose
 * length is no multiple of a tile (the tail masking) and which splits into many chunks. */
static void verify(const std::vector<variant> &vs, int sms, const gen_tables &g, cudaStream_t st)
{
	const uint32_t B = 2, n = 4133;
	const size_t elems = (size_t)B * HKV * n * D;
	uint16_t *k, *v, *q;
	float *out;
	CK(cudaMalloc((void **)&k, elems * 2));
	CK(cudaMalloc((void **)&v, elems * 2));
	CK(cudaMalloc((void **)&q, (size_t)B * HQ * D * 2));
	CK(cudaMalloc((void **)&out, (size_t)B * HQ * D * 4));
	launch_fill_kv(g, k, v, 0, B, 0, n, 1, st);
	launch_fill_q(g, q, B, 0, n, 0, 0, st);
	std::vector<uint16_t> hk(elems), hv(elems), hq((size_t)B * HQ * D);
	CK(cudaMemcpyAsync(hk.data(), k, elems * 2, cudaMemcpyDeviceToHost, st));
	CK(cudaMemcpyAsync(hv.data(), v, elems * 2, cudaMemcpyDeviceToHost, st));
	CK(cudaMemcpyAsync(hq.data(), q, hq.size() * 2, cudaMemcpyDeviceToHost, st));
	CK(cudaStreamSynchronize(st));
	std::vector<double> ref((size_t)B * HQ * D);
	for (uint32_t s = 0; s < B; s++)
		for (uint32_t j = 0; j < HQ; j++)
			reference(hk, hv, hq, n, s, j, &ref[((size_t)s * HQ + j) * D]);
	res_scratch sc;
	std::vector<float> ho((size_t)B * HQ * D);
	double worst = 0;
	for (const variant &vr : vs) {
		const res_plan p = plan_for(vr, 2, sms, B * HKV, n);
		CK(cudaMemsetAsync(out, 0xff, ho.size() * 4, st)); /* NaN: an unwritten output fails */
		resident_launch(p, sc, k, v, q, B, n, out, st);
		CK(cudaMemcpyAsync(ho.data(), out, ho.size() * 4, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));
		double e = rel_error(ho.data(), ref.data(), (size_t)B * HQ);
		if (e != e)
			e = INFINITY;
		worst = std::max(worst, e);
	}
	printf("resident kernel vs fp64 CPU reference (%u seqs x %u tokens, %zu variants, up to %u "
	       "chunks): max over heads of ||out - ref|| / ||ref|| = %.2e (%s)\n",
	       B, n, vs.size(), plan_for(vs[0], 2, sms, B * HKV, n).chunks, worst,
	       worst < 1e-3 ? "ok" : "WRONG");
	CK(cudaFree(k));
	CK(cudaFree(v));
	CK(cudaFree(q));
	CK(cudaFree(out));
	CK(cudaFree(sc.ml));
	CK(cudaFree(sc.acc));
}

/* What the kvtier run of one (context, batch) found; ok == false when the library failed. */
struct kvt_result {
	bool ok = false;
	float ms = 0, wall_ms = 0;
	double sel_frac = 0, hit_rate = 0, pcie_per_step = 0, hbm_bytes = 0, err_vs_exact = -1;
	double ns[5] = {0, 0, 0, 0, 0};
	uint64_t budget_max_hits = 0, flushes = 0;
};

#define KVT_OR_FAIL(call)                                                                          \
	do {                                                                                       \
		const int rc_ = (call);                                                            \
		if (rc_ < 0) {                                                                     \
			printf("  kvtier: %s returned %d (%s): %s\n", #call, rc_,                  \
			       kvt_strerror(rc_), kvt_last_error(cache));                          \
			goto out;                                                                  \
		}                                                                                  \
	} while (0)

/*
 * Prefill n tokens into n_seqs sequences, compare one kvt_attend with the resident result on the
 * same query, then time warm-up + steps decode steps (kvt_append + kvt_attend).
 * res_out: the resident kernel's fp32 output for the query of step 0 (the compare).
 */
static kvt_result run_kvtier(const options &o, const gen_tables &g, uint32_t n_seqs, uint32_t n,
			     const uint16_t *q0, const float *res_out, cudaStream_t st)
{
	kvt_result r;
	kvt_cache *cache = NULL;
	kvt_config cfg = KVT_CONFIG_INIT;
	const uint32_t chunk_max = 65536, total_steps = (uint32_t)(o.warmup + o.steps);
	uint16_t *ck = NULL, *cv = NULL, *cq = NULL, *sk = NULL, *sv = NULL, *sq = NULL, *out = NULL;
	std::vector<uint32_t> seqs(n_seqs);
	std::vector<float> tms, twall;
	kvt_stats s0, s1;
	kvt_layer_stats l0, l1;
	cudaEvent_t e0, e1;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	const size_t step_kv = (size_t)n_seqs * HKV * D, step_q = (size_t)n_seqs * HQ * D;

	cfg.n_layers = 1;
	cfg.n_q_heads = HQ;
	cfg.n_kv_heads = HKV;
	cfg.head_dim = D;
	cfg.backend = KVT_BACKEND_CUDA;
	{
		/* rows of every block the tokens fill, with the decode steps and a spare block */
		const uint64_t blocks = (n + total_steps + 255) / 256 + 1;
		cfg.host_bytes = (uint64_t)n_seqs * HKV * blocks * 256 * ROW;
		cfg.host_bytes += cfg.host_bytes / 32 + ((uint64_t)64 << 20);
	}
	cfg.budget_max = o.budget_max;
	if (o.gpu_cache_mib >= 0)
		cfg.gpu_cache_bytes = KVT_EXACT64((uint64_t)o.gpu_cache_mib << 20); /* 0: none */
	{
		const int rc = kvt_cache_create(&cfg, &cache);
		if (rc < 0) {
			printf("  kvtier: kvt_cache_create returned %d (%s): %s\n", rc,
			       kvt_strerror(rc), kvt_last_error(NULL));
			return r;
		}
	}
	CK(cudaMalloc((void **)&ck, (size_t)chunk_max * HKV * D * 2));
	CK(cudaMalloc((void **)&cv, (size_t)chunk_max * HKV * D * 2));
	CK(cudaMalloc((void **)&cq, (size_t)chunk_max * HQ * D * 2));
	CK(cudaMalloc((void **)&sk, step_kv * total_steps * 2));
	CK(cudaMalloc((void **)&sv, step_kv * total_steps * 2));
	CK(cudaMalloc((void **)&sq, step_q * total_steps * 2));
	CK(cudaMalloc((void **)&out, step_q * 2));
	for (uint32_t s = 0; s < n_seqs; s++)
		KVT_OR_FAIL(kvt_seq_open(cache, &seqs[s]));

	/* prefill, in chunks of at most 64K tokens */
	{
		const auto t0 = std::chrono::steady_clock::now();
		for (uint32_t s = 0; s < n_seqs; s++)
			for (uint32_t p0 = 0; p0 < n; p0 += chunk_max) {
				const uint32_t c = std::min(chunk_max, n - p0);
				launch_fill_kv(g, ck, cv, s, 1, p0, c, 0, st);
				launch_fill_q(g, cq, c, 0, 1, 1, p0, st);
				KVT_OR_FAIL(kvt_prefill(cache, seqs[s], 0, cq, ck, cv, c, st));
			}
		CK(cudaStreamSynchronize(st));
		const double sec =
			std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
		printf("  kvtier prefill: %u x %u tokens in %.2f s (%.1f M tokens/s, generation "
		       "included)\n",
		       n_seqs, n, sec, n_seqs * (double)n / sec / 1e6);
	}

	/* the same query as the resident run, over the same tokens: how far Top-p is from exact */
	{
		KVT_OR_FAIL(kvt_attend(cache, 0, n_seqs, seqs.data(), q0, out, st));
		std::vector<uint16_t> ho(step_q);
		std::vector<float> hr(step_q);
		CK(cudaMemcpyAsync(ho.data(), out, step_q * 2, cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(hr.data(), res_out, step_q * 4, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));
		std::vector<double> ref(hr.begin(), hr.end());
		std::vector<float> got(step_q);
		for (size_t i = 0; i < step_q; i++)
			got[i] = h2f(ho[i]);
		r.err_vs_exact = rel_error(got.data(), ref.data(), (size_t)n_seqs * HQ);
	}

	/* the decode steps' inputs: token n + i of every sequence, the query of step i + 1 */
	for (uint32_t i = 0; i < total_steps; i++) {
		launch_fill_kv(g, sk + i * step_kv, sv + i * step_kv, 0, n_seqs, n + i, 1, 0, st);
		launch_fill_q(g, sq + i * step_q, n_seqs, i + 1, n, 0, 0, st);
	}
	CK(cudaStreamSynchronize(st));

	s0.size = s1.size = sizeof(kvt_stats);
	l0.size = l1.size = sizeof(kvt_layer_stats);
	for (uint32_t i = 0; i < total_steps; i++) {
		if (i == (uint32_t)o.warmup) {
			KVT_OR_FAIL(kvt_get_stats(cache, &s0));
			KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &l0));
		}
		const auto t0 = std::chrono::steady_clock::now();
		CK(cudaEventRecord(e0, st));
		KVT_OR_FAIL(kvt_append(cache, 0, n_seqs, seqs.data(), sk + i * step_kv,
				       sv + i * step_kv, st));
		KVT_OR_FAIL(kvt_attend(cache, 0, n_seqs, seqs.data(), sq + i * step_q, out, st));
		CK(cudaEventRecord(e1, st));
		CK(cudaEventSynchronize(e1));
		const double wall =
			std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
		float ms;
		CK(cudaEventElapsedTime(&ms, e0, e1));
		if (i >= (uint32_t)o.warmup) {
			tms.push_back(ms);
			twall.push_back((float)(wall * 1e3));
		}
	}
	KVT_OR_FAIL(kvt_get_stats(cache, &s1));
	KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &l1));
	{
		const double steps = o.steps;
		r.ms = median(tms);
		r.wall_ms = median(twall);
		const uint64_t cand = s1.candidate_tokens - s0.candidate_tokens;
		r.sel_frac = cand ? (double)(s1.selected_tokens - s0.selected_tokens) / cand : 0;
		const uint64_t hits = l1.hot_hits - l0.hot_hits, miss = l1.hot_misses - l0.hot_misses;
		r.hit_rate = hits + miss ? (double)hits / (hits + miss) : 0;
		r.pcie_per_step = (double)(l1.pcie_bytes - l0.pcie_bytes) / steps;
		r.hbm_bytes = (double)s1.index_bytes + (double)l1.hot_rows * ROW +
			      (double)n_seqs * HKV * (KVT_DEFAULT_WINDOW + KVT_DEFAULT_FLUSH_BATCH) * ROW;
		r.ns[0] = (double)(s1.ns_index - s0.ns_index) / steps;
		r.ns[1] = (double)(s1.ns_store - s0.ns_store) / steps;
		r.ns[2] = (double)(s1.ns_score - s0.ns_score) / steps;
		r.ns[3] = (double)(s1.ns_select - s0.ns_select) / steps;
		r.ns[4] = (double)(s1.ns_attend - s0.ns_attend) / steps;
		r.budget_max_hits = s1.budget_max_hits - s0.budget_max_hits;
		r.flushes = s1.flushes - s0.flushes;
		r.ok = true;
	}
out:
	CK(cudaStreamSynchronize(st));
	kvt_cache_destroy(cache);
	for (void *p : {(void *)ck, (void *)cv, (void *)cq, (void *)sk, (void *)sv, (void *)sq,
			(void *)out})
		CK(cudaFree(p));
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	return r;
}

static const char *goal(bool met)
{
	return met ? "met" : "MISSED";
}

int main(int argc, char **argv)
{
	const options o = parse(argc, argv);
	cudaDeviceProp prop;
	if (!bench_device("gpu_decode", &prop))
		return 0;
	const int sms = prop.multiProcessorCount;
	printf("gpu_decode on %s (%d SMs): one layer, %d query heads, %d KV heads, head dim %d, fp16; "
	       "kvtier %s\n",
	       prop.name, sms, HQ, HKV, D, kvt_version_string());
	cudaStream_t st;
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	cudaEvent_t e0, e1, em;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaEventCreate(&em));
	const double copy_bw = d2d_copy_bandwidth();
	printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_bw / 1e9);

	gen_tables g;
	CK(cudaMalloc((void **)&g.topic, (size_t)HKV * NTOPIC * D * 4));
	CK(cudaMalloc((void **)&g.bias, (size_t)HKV * D * 4));
	init_tables<<<(HKV * NTOPIC * D + 255) / 256, 256, 0, st>>>(g);
	CK(cudaGetLastError());

	std::vector<variant> vs = {make_variant<32, 4>("tile 32 x 4 stages"),
				   make_variant<32, 6>("tile 32 x 6 stages"),
				   make_variant<64, 3>("tile 64 x 3 stages"),
				   make_variant<16, 8>("tile 16 x 8 stages"),
				   make_variant<32, 8>("tile 32 x 8 stages"),
				   make_variant<64, 4>("tile 64 x 4 stages")};
	verify(vs, sms, g, st);

	/* the configurations that fit --max-host-gib of pinned host memory per approach */
	struct cfg_t {
		uint32_t n, b;
	};
	std::vector<cfg_t> cfgs;
	size_t max_bytes = 0;
	for (uint32_t n : o.contexts)
		for (uint32_t b : o.batches) {
			const double bytes = (double)b * HKV * n * ROW;
			if (bytes > o.max_host_gib * (1u << 30)) {
				printf("context %u x batch %u: skipped: its K/V is %.0f GiB, above "
				       "--max-host-gib %.1f (default 0.3 of this machine's memory): "
				       "naive offload keeps that much pinned and kvtier's host tier as "
				       "much again, at once; batch %u is capped below this context\n",
				       n, b, bytes / (1u << 30), o.max_host_gib, b);
				continue;
			}
			cfgs.push_back({n, b});
			max_bytes = std::max(max_bytes, (size_t)bytes);
		}
	if (cfgs.empty())
		return 0;
	/* K and V each: half of the rows' bytes */
	uint16_t *dk, *dv, *hk, *hv, *dq;
	float *dout;
	CK(cudaMalloc((void **)&dk, max_bytes / 2));
	CK(cudaMalloc((void **)&dv, max_bytes / 2));
	CK(cudaHostAlloc((void **)&hk, max_bytes / 2, cudaHostAllocDefault));
	CK(cudaHostAlloc((void **)&hv, max_bytes / 2, cudaHostAllocDefault));
	uint32_t bmax = 0;
	for (const cfg_t &c : cfgs)
		bmax = std::max(bmax, c.b);
	CK(cudaMalloc((void **)&dq, (size_t)bmax * HQ * D * 2));
	CK(cudaMalloc((void **)&dout, (size_t)bmax * HQ * D * 4));
	res_scratch sc;

	printf("%8s %5s | %10s %8s %6s | %10s %7s | %10s %8s %8s | %9s %9s %9s\n", "context",
	       "batch", "resident", "GB/s", "%copy", "naive ms", "H2D GB/s", "kvtier ms",
	       "kvt/res", "nai/kvt", "HBM res", "HBM kvt", "HBM nai");
	for (const cfg_t &c : cfgs) {
		const uint32_t n = c.n, B = c.b;
		const size_t half = (size_t)B * HKV * n * D * 2; /* K (or V) bytes */
		launch_fill_kv(g, dk, dv, 0, B, 0, n, 1, st);
		launch_fill_q(g, dq, B, 0, n, 0, 0, st);
		CK(cudaMemcpyAsync(hk, dk, half, cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(hv, dv, half, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));

		/* (a) resident: the fastest plan for this shape, then its median */
		res_plan best = plan_for(vs[0], 1, sms, B * HKV, n);
		float best_ms = INFINITY;
		for (const variant &v : vs)
			for (int waves : {1, 2, 4}) {
				const res_plan p = plan_for(v, waves, sms, B * HKV, n);
				const float t = resident_time(p, sc, dk, dv, dq, B, n, dout, st, 5);
				if (t < best_ms) {
					best_ms = t;
					best = p;
				}
			}
		const float res_ms =
			resident_time(best, sc, dk, dv, dq, B, n, dout, st, o.reps);
		const double res_bw = 2.0 * half / (res_ms * 1e-3);

		/* (b) naive: the whole K/V over PCIe, then the resident kernel */
		std::vector<float> tn, th;
		for (int i = 0; i < 8; i++) {
			CK(cudaEventRecord(e0, st));
			CK(cudaMemcpyAsync(dk, hk, half, cudaMemcpyHostToDevice, st));
			CK(cudaMemcpyAsync(dv, hv, half, cudaMemcpyHostToDevice, st));
			CK(cudaEventRecord(em, st));
			resident_launch(best, sc, dk, dv, dq, B, n, dout, st);
			CK(cudaEventRecord(e1, st));
			CK(cudaEventSynchronize(e1));
			float a, b;
			CK(cudaEventElapsedTime(&a, e0, em));
			CK(cudaEventElapsedTime(&b, e0, e1));
			if (i >= 2) {
				th.push_back(a);
				tn.push_back(b);
			}
		}
		const float naive_ms = median(tn), h2d_gbs = (float)(2.0 * half / (median(th) * 1e-3) / 1e9);

		printf("context %u x batch %u: resident plan %s, %u tokens per chunk, %u chunks per "
		       "(seq, KV head), %d wave(s)\n",
		       n, B, best.v->name, best.chunk, best.chunks, best.waves);
		/* the resident output of this query stays in dout for kvtier's compare */
		resident_launch(best, sc, dk, dv, dq, B, n, dout, st);
		const kvt_result k = run_kvtier(o, g, B, n, dq, dout, st);
		if (k.ok) {
			printf("  kvtier: Top-p selected %.2f%% of indexed tokens (selected_tokens / "
			       "candidate_tokens over the timed steps); hot-cache hit rate %.1f%%; "
			       "PCIe %.2f MB per step; %llu budget_max cuts, %llu flushes in the timed "
			       "steps; output vs exact attention (query of the resident run, before "
			       "the decode steps): max over heads of ||out - exact|| / ||exact|| = "
			       "%.3g\n",
			       100.0 * k.sel_frac, 100.0 * k.hit_rate, k.pcie_per_step / 1e6,
			       (unsigned long long)k.budget_max_hits, (unsigned long long)k.flushes,
			       k.err_vs_exact);
			printf("  kvtier per step: %.3f ms on the stream (events), %.3f ms on the host "
			       "(wall, append call to attend synchronized); per step by stage, from the "
			       "library's ns_* counters (the CUDA backend records them with CUDA "
			       "events on the stream, so they are device times; it leaves store "
			       "untimed): index %.1f us, store %.1f us, score %.1f us, select %.1f us, "
			       "gather + attend %.1f us\n",
			       k.ms, k.wall_ms, k.ns[0] / 1e3, k.ns[1] / 1e3, k.ns[2] / 1e3,
			       k.ns[3] / 1e3, k.ns[4] / 1e3);
		}
		char kms[32] = "failed", r1[32] = "-", r2[32] = "-", hb[32] = "-";
		if (k.ok) {
			snprintf(kms, sizeof kms, "%.3f", k.ms);
			snprintf(r1, sizeof r1, "%.2fx", k.ms / res_ms);
			snprintf(r2, sizeof r2, "%.1fx", naive_ms / k.ms);
			snprintf(hb, sizeof hb, "%.0f MB", k.hbm_bytes / 1e6);
		}
		printf("%8u %5u | %10.3f %8.0f %5.1f%% | %10.2f %7.1f | %10s %8s %8s | %6.0f MB %9s "
		       "%6.0f MB\n",
		       n, B, res_ms, res_bw / 1e9, 100.0 * res_bw / copy_bw, naive_ms, h2d_gbs, kms,
		       r1, r2, 2.0 * half / 1e6, hb, 2.0 * half / 1e6);
		if (n >= 131072)
			printf("  goal: resident kernel >= 70%% of copy bandwidth at 128K+: %s "
			       "(%.1f%%)\n",
			       goal(res_bw >= 0.7 * copy_bw), 100.0 * res_bw / copy_bw);
		if (n == 131072)
			printf("  goals at 128K: kvtier <= 1.5x resident: %s; kvtier >= 20x faster than "
			       "naive: %s\n",
			       k.ok ? goal(k.ms <= 1.5f * res_ms) : "not measured",
			       k.ok ? goal(naive_ms >= 20.0f * k.ms) : "not measured");
		if (n == 1048576)
			printf("  goal at 1M: kvtier <= 1.0x resident: %s\n",
			       k.ok ? goal(k.ms <= res_ms) : "not measured");
		fflush(stdout);
	}
	return 0;
}
