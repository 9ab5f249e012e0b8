/* SPDX-License-Identifier: MIT */
/*
 * The resident baseline of bench/gpu_decode.cu (included by it alone, after its shape constants
 * and gpu_decode_workload.cuh): a flash-decoding kernel over K/V held in HBM, its launch plans and
 * timing, and the fp64 CPU reference it is checked against.
 */
#ifndef KVT_BENCH_GPU_DECODE_RESIDENT_CUH
#define KVT_BENCH_GPU_DECODE_RESIDENT_CUH

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

/* The variants a benchmark picks the fastest of. */
static std::vector<variant> resident_variants(void)
{
	return {make_variant<32, 4>("tile 32 x 4 stages"), make_variant<32, 6>("tile 32 x 6 stages"),
		make_variant<64, 3>("tile 64 x 3 stages"), make_variant<16, 8>("tile 16 x 8 stages"),
		make_variant<32, 8>("tile 32 x 8 stages"), make_variant<64, 4>("tile 64 x 4 stages")};
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

/* The fastest plan for this shape among the variants and 1, 2 or 4 waves (5 launches each). */
static res_plan best_plan(const std::vector<variant> &vs, int sms, res_scratch &sc,
			  const uint16_t *K, const uint16_t *V, const uint16_t *q, uint32_t n_seqs,
			  uint32_t n, float *out, cudaStream_t st)
{
	res_plan best = plan_for(vs[0], 1, sms, n_seqs * HKV, n);
	float best_ms = INFINITY;
	for (const variant &v : vs)
		for (int waves : {1, 2, 4}) {
			const res_plan p = plan_for(v, waves, sms, n_seqs * HKV, n);
			const float t = resident_time(p, sc, K, V, q, n_seqs, n, out, st, 5);
			if (t < best_ms) {
				best_ms = t;
				best = p;
			}
		}
	return best;
}

/* fp64 reference of one (sequence, query head) over K/V in the resident layout (host copies). */
static inline void reference(const std::vector<uint16_t> &k, const std::vector<uint16_t> &v,
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

#endif
