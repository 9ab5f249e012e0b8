/* SPDX-License-Identifier: MIT */
/*
 * The unbiased score estimator of DESIGN.md: index build (rotated sign codes, sigma, beta) and
 * INT4 x binary scoring. Every float sum runs in index order, without contraction, so that a GPU twin
 * that keeps the same order reproduces the codes and scalars bit for bit.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "half.h"
#include "half_vec.h"
#include "internal.h"

/* y = rot r, each y[j] summed over i in increasing order; rot is row-major, read as columns so the
 * loop over j vectorizes without reordering any single sum. */
static void rotate(uint32_t d, const float *rot, const float *r, float *y)
{
	for (uint32_t j = 0; j < d; j++)
		y[j] = 0.0f;
	for (uint32_t i = 0; i < d; i++) {
		float ri = r[i];
		for (uint32_t j = 0; j < d; j++)
			y[j] += rot[(size_t)j * d + i] * ri;
	}
}

/*
 * The same for four vectors at once (rt: their elements interleaved, rt[4 i + e] = r_e[i]; y4 the
 * same way): lane e of a four-lane vector is vector e, so each y_e[j] is still summed over i in
 * increasing order, bit for bit rotate's; eight rows of rot are independent chains.
 */
static void rotate4(uint32_t d, const float *rot, const float *rt, float *y4)
{
	for (uint32_t j = 0; j < d; j += 8) {
		const float *w = rot + (size_t)j * d;
		kvt_v4f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0},
			a7 = {0};
		for (uint32_t i = 0; i < d; i++) {
			const kvt_v4f ri = kvt_v4f_load(rt + 4 * (size_t)i);
			a0 += w[i] * ri;
			a1 += w[d + i] * ri;
			a2 += w[2 * d + i] * ri;
			a3 += w[3 * d + i] * ri;
			a4 += w[4 * d + i] * ri;
			a5 += w[5 * d + i] * ri;
			a6 += w[6 * d + i] * ri;
			a7 += w[7 * d + i] * ri;
		}
		kvt_v4f_store(y4 + 4 * (size_t)j, a0);
		kvt_v4f_store(y4 + 4 * (size_t)j + 4, a1);
		kvt_v4f_store(y4 + 4 * (size_t)j + 8, a2);
		kvt_v4f_store(y4 + 4 * (size_t)j + 12, a3);
		kvt_v4f_store(y4 + 4 * (size_t)j + 16, a4);
		kvt_v4f_store(y4 + 4 * (size_t)j + 20, a5);
		kvt_v4f_store(y4 + 4 * (size_t)j + 24, a6);
		kvt_v4f_store(y4 + 4 * (size_t)j + 28, a7);
	}
}

/*
 * sigma and beta as fp16, saturated: a value beyond the fp16 range stores +-65504 (0x7bff) and a NaN
 * (a key whose residual overflowed float) stores 0, so an index entry is always finite and a key,
 * however large, can never make a later score non-finite; the batch it joins keeps working and only
 * its own estimate is off. Values within range (every normal input) keep their rounding bit for
 * bit. gpu/index.cu's f16_sat is the twin.
 */
static uint16_t f16_sat(float f)
{
	uint16_t h = kvt_f32_to_f16(f);
	if ((h & 0x7fffu) > 0x7c00u)
		return 0;
	return (h & 0x7fffu) == 0x7c00u ? (uint16_t)((h & 0x8000u) | 0x7bffu) : h;
}

static float dot(uint32_t d, const float *a, const float *b)
{
	float s = 0.0f;
	for (uint32_t i = 0; i < d; i++)
		s += a[i] * b[i];
	return s;
}

void kvt_index_build(uint32_t d, const float *rot, const float *c_k, const float *c_q, uint32_t n,
		     const float *keys, size_t key_stride, uint32_t *codes, uint16_t *sigma,
		     uint16_t *beta)
{
	const uint32_t words = d / 32;
	float r[KVT_MAX_HEAD_DIM], y[KVT_MAX_HEAD_DIM], n2s[4];
	float rt[4 * KVT_MAX_HEAD_DIM], y4[4 * KVT_MAX_HEAD_DIM];
	for (uint32_t t = 0; t < n; t++) {
		const float *k = keys + (size_t)t * key_stride;
		uint32_t *code = codes + (size_t)t * words;
		const uint32_t e = t % 4;
		if (e == 0) {
			/* the residuals of this key and the next three (zeros past the last: c_k
			 * less itself), rotated together */
			for (uint32_t u = 0; u < 4; u++) {
				const float *ku = t + u < n ? keys + (size_t)(t + u) * key_stride : c_k;
				float n2 = 0.0f;
				for (uint32_t i = 0; i < d; i++) {
					r[i] = ku[i] - c_k[i];
					n2 += r[i] * r[i];
					rt[4 * i + u] = r[i];
				}
				n2s[u] = n2;
			}
			rotate4(d, rot, rt, y4);
		}
		const float n2 = n2s[e];
		float l1 = 0.0f;
		for (uint32_t j = 0; j < d; j++)
			y[j] = y4[4 * j + e];
		for (uint32_t w = 0; w < words; w++) {
			uint32_t bits = 0;
			for (uint32_t j = 0; j < 32; j++)
				bits |= (uint32_t)(y[32 * w + j] > 0.0f) << j;
			code[w] = bits;
		}
		for (uint32_t j = 0; j < d; j++)
			l1 += fabsf(y[j]);
		/* sigma = ||r|| / alpha, alpha = ||y||_1 / (||r|| sqrt(d)) for unnormalized y */
		float s = l1 > 0.0f ? n2 / l1 * sqrtf((float)d) : 0.0f;
		if (!(l1 > 0.0f))
			memset(code, 0, sizeof *code * words);
		sigma[t] = f16_sat(s);
		beta[t] = f16_sat(dot(d, c_q, k));
	}
}

void kvt_query_prepare(uint32_t d, const float *rot, const float *c_q, const float *c_k,
		       const float *q, kvt_qcode *qc)
{
	float r[KVT_MAX_HEAD_DIM] = { 0 };
	for (uint32_t i = 0; i < d; i++)
		r[i] = q[i] - c_q[i];
	const float qc_ck = dot(d, r, c_k);
	qc->qc_ck = qc_ck != qc_ck ? 0.0f
		    : qc_ck > KVT_QC_CK_MAX ? KVT_QC_CK_MAX
		    : qc_ck < -KVT_QC_CK_MAX ? -KVT_QC_CK_MAX : qc_ck;
	rotate(d, rot, r, qc->x);
	float lo = qc->x[0], hi = qc->x[0];
	for (uint32_t j = 1; j < d; j++) {
		lo = qc->x[j] < lo ? qc->x[j] : lo;
		hi = qc->x[j] > hi ? qc->x[j] : hi;
	}
	qc->x_l = lo;
	qc->delta = (hi - lo) / 15.0f;
	memset(qc->planes, 0, sizeof qc->planes);
	uint32_t sum = 0;
	for (uint32_t j = 0; j < d; j++) {
		float t = qc->delta > 0.0f ? (qc->x[j] - lo) / qc->delta : 0.0f;
		float f = floorf(t + 0.5f);
		uint32_t u = f < 0.0f ? 0u : f > 15.0f ? 15u : (uint32_t)f;
		qc->u[j] = (uint8_t)u;
		sum += u;
		for (uint32_t p = 0; p < 4; p++)
			qc->planes[p][j / 32] |= ((u >> p) & 1u) << (j % 32);
	}
	qc->sum_u = (float)sum;
}

static inline uint32_t pop64(uint64_t x)
{
	return (uint32_t)__builtin_popcountll(x);
}

/*
 * The scoring loop, inlined into each variant below: with the popcount instruction and without.
 * Integer popcounts and the same float expression in both, so every variant gives the same bits.
 */
static inline __attribute__((always_inline)) void score_loop(uint32_t d, const kvt_qcode *qc,
							     uint32_t n, const uint32_t *codes,
							     const uint16_t *sigma,
							     const uint16_t *beta, float *scores)
{
	const uint32_t words = d / 32, pairs = words / 2;
	const float isd = 1.0f / sqrtf((float)d);
	/* E = A <b, u> + B popcount(b) + C, from DESIGN.md's formula */
	const float A = 2.0f * qc->delta * isd, B = 2.0f * qc->x_l * isd;
	const float C = (-qc->delta * qc->sum_u - (float)d * qc->x_l) * isd;
	uint64_t pl[4][KVT_MAX_WORDS / 2];
	for (uint32_t p = 0; p < 4; p++)
		memcpy(pl[p], qc->planes[p], sizeof(uint32_t) * words);
	for (uint32_t t = 0; t < n; t++) {
		uint64_t b[KVT_MAX_WORDS / 2];
		memcpy(b, codes + (size_t)t * words, sizeof(uint32_t) * words);
		uint32_t pb = 0, bu = 0;
		for (uint32_t w = 0; w < pairs; w++) {
			pb += pop64(b[w]);
			bu += pop64(b[w] & pl[0][w]) + 2 * pop64(b[w] & pl[1][w]) +
			      4 * pop64(b[w] & pl[2][w]) + 8 * pop64(b[w] & pl[3][w]);
		}
		float E = A * (float)bu + B * (float)pb + C;
		scores[t] = kvt_f16_to_f32(sigma[t]) * E + kvt_f16_to_f32(beta[t]) + qc->qc_ck;
	}
}

typedef void score_fn(uint32_t d, const kvt_qcode *qc, uint32_t n, const uint32_t *codes,
		      const uint16_t *sigma, const uint16_t *beta, float *scores);

static void score_generic(uint32_t d, const kvt_qcode *qc, uint32_t n, const uint32_t *codes,
			  const uint16_t *sigma, const uint16_t *beta, float *scores)
{
	score_loop(d, qc, n, codes, sigma, beta, scores);
}

/*
 * The popcount instruction is not in the x86-64 baseline, so the variant with it is chosen at the
 * first call, through a pointer. Not target_clones: its ifunc resolver runs during relocation,
 * before a sanitizer's runtime (TSan) is initialized, and it makes an exported ifunc symbol.
 */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("popcnt"))) static void score_popcnt(uint32_t d, const kvt_qcode *qc,
							    uint32_t n, const uint32_t *codes,
							    const uint16_t *sigma,
							    const uint16_t *beta, float *scores)
{
	score_loop(d, qc, n, codes, sigma, beta, scores);
}

static score_fn *score_pick(void)
{
	__builtin_cpu_init();
	return __builtin_cpu_supports("popcnt") ? score_popcnt : score_generic;
}
#else
static score_fn *score_pick(void)
{
	return score_generic;
}
#endif

/* Relaxed is enough: every thread that races on the first call picks the same variant. */
static _Atomic(score_fn *) score_variant;

void kvt_score(uint32_t d, const kvt_qcode *qc, uint32_t n, const uint32_t *codes,
	       const uint16_t *sigma, const uint16_t *beta, float *scores)
{
	score_fn *f = atomic_load_explicit(&score_variant, memory_order_relaxed);
	if (!f) {
		f = score_pick();
		atomic_store_explicit(&score_variant, f, memory_order_relaxed);
	}
	f(d, qc, n, codes, sigma, beta, scores);
}

float kvt_score_float(uint32_t d, const kvt_qcode *qc, bool quantized, const uint32_t *code,
		      uint16_t sigma, uint16_t beta)
{
	double e = 0.0;
	for (uint32_t j = 0; j < d; j++) {
		double x = quantized ? (double)qc->delta * qc->u[j] + qc->x_l : qc->x[j];
		e += ((code[j / 32] >> (j % 32)) & 1u) ? x : -x;
	}
	e /= sqrt((double)d);
	return (float)((double)kvt_f16_to_f32(sigma) * e + kvt_f16_to_f32(beta) + qc->qc_ck);
}
