/* SPDX-License-Identifier: MIT */
/*
 * The synthetic decode workload of bench/gpu_decode.cu, gpu_throughput.cu and gpu_spilled.cu
 * (included after their shape constants D, HKV, HQ, G): generated K/V and queries whose attention
 * is concentrated the way real attention is, so that Top-p selects a few percent of the tokens;
 * and the helpers their checks share (h2f, rel_error).
 */
#ifndef KVT_BENCH_GPU_DECODE_WORKLOAD_CUH
#define KVT_BENCH_GPU_DECODE_WORKLOAD_CUH

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
 * the chunks handed to kvtier hold the same numbers.
 * With a drift d > 0 (gpu_decode --drift) a decode query looks for two topics: its own, weighted
 * sqrt(1 - d), and one drawn afresh at every step, weighted sqrt(d), so that part of the selection
 * changes from step to step as on a trained model's queries (there consecutive steps share about
 * half their selection: a hot cache of 1.2x a step's selection hits 56 %, issue 15). d = 0 is the
 * original generator, bit for bit. */
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
			      uint32_t focus_n, int prefill, uint32_t p0, float drift)
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
		float x = Q_STRENGTH * g.topic[(h * NTOPIC + t) * D + e] + Q_NOISE * gauss(noise);
		if (!prefill && drift > 0.0f) {
			/* the step's own topic, from a passage drawn by (sequence, KV head, step) */
			const uint32_t f2 = (uint32_t)(hcat(hcat(hcat(7, r), h), step) % focus_n);
			const uint32_t t2 = tok_topic(r, h, f2);
			x = Q_STRENGTH * (sqrtf(1.0f - drift) * g.topic[(h * NTOPIC + t) * D + e] +
					  sqrtf(drift) * g.topic[(h * NTOPIC + t2) * D + e]) +
			    Q_NOISE * gauss(noise);
		}
		q[i] = __half_as_ushort(__float2half(x));
	}
}

static void launch_fill_kv(const gen_tables &g, uint16_t *k, uint16_t *v, uint32_t s0,
			   uint32_t n_seqs, uint32_t p0, uint32_t n_tok, int seq_major,
			   cudaStream_t st)
{
	fill_kv<<<4096, 256, 0, st>>>(g, k, v, s0, n_seqs, p0, n_tok, seq_major);
	CK(cudaGetLastError());
}

/* The decode queries' drift (--drift D of the benches that use this workload; 0: every step
 * looks for the same topic). */
static float g_drift = 0.0f;

/* Takes `--drift D` (D in [0, 1]) into g_drift: whether a = flag, val = its value was that. */
static bool drift_option(const char *a, const char *val)
{
	if (strcmp(a, "--drift") || !(atof(val) >= 0.0 && atof(val) <= 1.0))
		return false;
	g_drift = (float)atof(val);
	return true;
}

static void launch_fill_q(const gen_tables &g, uint16_t *q, uint32_t n, uint32_t step,
			  uint32_t focus_n, int prefill, uint32_t p0, cudaStream_t st)
{
	fill_q<<<1024, 256, 0, st>>>(g, q, n, step, focus_n, prefill, p0, g_drift);
	CK(cudaGetLastError());
}

static float h2f(uint16_t x)
{
	return __half2float(__ushort_as_half(x));
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

#endif
