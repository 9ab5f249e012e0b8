/* SPDX-License-Identifier: MIT */
/*
 * Shared helpers of the cmocka tests: a seeded generator, independent fp16/bf16 converters (the
 * tests' own oracle, not lib/half.h), checks that print the case with got and wanted values, and a
 * small CPU-backend configuration.
 */
#ifndef KVT_TEST_COMMON_H
#define KVT_TEST_COMMON_H

#include <ctype.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "harness.h"

/*
 * Fail the current cmocka test when `cond` is false, after printing where, the condition, and a
 * message that names the case and the got/wanted values.
 */
#define T_CHECK(cond, ...)                                                                         \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			print_error("%s:%d: check failed: %s\n    ", __FILE__, __LINE__, #cond);      \
			print_error(__VA_ARGS__);                                                  \
			print_error("\n");                                                         \
			fail();                                                                    \
		}                                                                                  \
	} while (0)

/* Like T_CHECK but only counts the failure in *nfail, so a table-driven test reports every case. */
#define T_SOFT(nfail, cond, ...)                                                                   \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			print_error("%s:%d: check failed: %s\n    ", __FILE__, __LINE__, #cond);      \
			print_error(__VA_ARGS__);                                                  \
			print_error("\n");                                                         \
			++*(nfail);                                                                \
		}                                                                                  \
	} while (0)

/* ---- generator: splitmix64 seeding xoshiro256** ------------------------------------------ */

typedef struct t_rng {
	uint64_t s[4];
	uint64_t seed; /* printed by failing checks */
} t_rng;

static inline uint64_t t_splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static inline void t_rng_seed(t_rng *r, uint64_t seed)
{
	uint64_t x = seed;
	for (int i = 0; i < 4; i++)
		r->s[i] = t_splitmix64(&x);
	r->seed = seed;
}

static inline uint64_t t_rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static inline uint64_t t_next(t_rng *r)
{
	uint64_t *s = r->s;
	uint64_t out = t_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = t_rotl(s[3], 45);
	return out;
}

/* Uniform in [0, 1). */
static inline double t_unif(t_rng *r)
{
	return (double)(t_next(r) >> 11) * 0x1p-53;
}

static inline double t_range(t_rng *r, double lo, double hi)
{
	return lo + (hi - lo) * t_unif(r);
}

/* Uniform integer in [0, n). */
static inline uint32_t t_below(t_rng *r, uint32_t n)
{
	return (uint32_t)(((t_next(r) >> 32) * (uint64_t)n) >> 32);
}

/* Standard normal (Box-Muller). */
static inline double t_normal(t_rng *r)
{
	double u1 = 1.0 - t_unif(r), u2 = t_unif(r);
	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* qsort's comparison of floats, largest first. */
static inline int t_cmp_desc(const void *a, const void *b)
{
	const float x = *(const float *)a, y = *(const float *)b;
	return (x < y) - (x > y);
}

/* Score distributions the Top-p tests (CPU and GPU) draw from. */
enum t_dist { D_NORMAL, D_TIED, D_ONEHOT, D_UNIFORM, D_WIDE, D_NDIST };
static const char *const t_dist_name[D_NDIST] = {"normal", "tied", "one-hot", "uniform", "wide"};

static inline void t_scores(t_rng *r, enum t_dist kind, uint32_t n, float *s)
{
	uint32_t hot = t_below(r, n);
	for (uint32_t i = 0; i < n; i++) {
		switch (kind) {
		case D_NORMAL:
			s[i] = (float)(3 * t_normal(r) + 1);
			break;
		case D_TIED: /* few distinct values */
			s[i] = (float)t_below(r, 4) * 1.5f - 2;
			break;
		case D_ONEHOT:
			s[i] = i == hot ? 12.5f : -0.75f;
			break;
		case D_UNIFORM:
			s[i] = 0.625f;
			break;
		default: /* far from 0 and spread wide: softmax must subtract the max */
			s[i] = (float)(-5000 + 40 * t_normal(r));
			break;
		}
	}
}

/* ---- fp16 / bf16 (round to nearest even), written independently of lib/half.h ------------ */

static inline uint32_t t_fbits(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	return u;
}

static inline float t_bitsf(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

static inline float t_h2f(uint16_t h)
{
	uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
	if (e == 0) {
		float f = (float)ldexp((double)m, -24);
		return s ? -f : f;
	}
	if (e == 31)
		return t_bitsf(s | 0x7f800000u | (m << 13));
	return t_bitsf(s | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t t_f2h(float f)
{
	uint32_t x = t_fbits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
	if (ax > 0x7f800000u)
		return (uint16_t)(sign | 0x7e00u);
	if (ax >= 0x477ff000u) /* >= 65520 rounds to infinity */
		return (uint16_t)(sign | 0x7c00u);
	if (ax < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, rounded to even by rint */
		double r = rint((double)t_bitsf(ax) * 16777216.0);
		return (uint16_t)(sign | (uint32_t)r);
	}
	uint32_t e = (ax >> 23) - 112u, m = ax & 0x7fffffu;
	uint32_t h = (e << 10) | (m >> 13), rem = m & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
		h++;
	return (uint16_t)(sign | h);
}

static inline float t_bf2f(uint16_t b)
{
	return t_bitsf((uint32_t)b << 16);
}

static inline uint16_t t_f2bf(float f)
{
	uint32_t x = t_fbits(f);
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40u);
	x += 0x7fffu + ((x >> 16) & 1u);
	return (uint16_t)(x >> 16);
}

static inline uint16_t t_enc(uint32_t dtype, float f)
{
	return dtype == KVT_DTYPE_BF16 ? t_f2bf(f) : t_f2h(f);
}

static inline float t_dec(uint32_t dtype, uint16_t b)
{
	return dtype == KVT_DTYPE_BF16 ? t_bf2f(b) : t_h2f(b);
}

static inline const char *t_dtype_name(uint32_t dtype)
{
	return dtype == KVT_DTYPE_BF16 ? "bf16" : dtype == KVT_DTYPE_F16 ? "f16" : "?";
}

/*
 * n normal values mean + sd * N(0,1), rounded to dtype: bits[] receives the encoding and dec[]
 * (when not NULL) the decoded floats the library will see.
 */
static inline void t_fill(t_rng *r, uint32_t dtype, size_t n, double mean, double sd,
			  uint16_t *bits, float *dec)
{
	for (size_t i = 0; i < n; i++) {
		uint16_t b = t_enc(dtype, (float)(mean + sd * t_normal(r)));
		bits[i] = b;
		if (dec)
			dec[i] = t_dec(dtype, b);
	}
}

/* FNV-1a 64 over the little-endian bytes of 32-bit words (the same on every host). */
static inline uint64_t t_fnv1a_words(const uint32_t *w, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (size_t i = 0; i < n; i++)
		for (int b = 0; b < 4; b++) {
			h ^= (w[i] >> (8 * b)) & 0xffu;
			h *= 0x100000001b3ull;
		}
	return h;
}

/* malloc that fails the test instead of returning NULL. */
static inline void *t_alloc(size_t bytes)
{
	void *p = calloc(1, bytes ? bytes : 1);
	if (!p) {
		print_error("test allocation of %zu bytes failed\n", bytes);
		fail();
	}
	return p;
}

/*
 * A small cache configuration on the CPU backend with fp32 outputs: n_sink 4, window 16,
 * flush_batch 8, 64 MiB host tier, 8 sequences; p, budget_min and seed set to the library's
 * defaults explicitly, since reference computations read them from this struct.
 */
static inline kvt_config t_config(uint32_t n_layers, uint32_t n_q_heads, uint32_t n_kv_heads,
				  uint32_t head_dim, uint32_t dtype)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = n_layers;
	cfg.n_q_heads = n_q_heads;
	cfg.n_kv_heads = n_kv_heads;
	cfg.head_dim = head_dim;
	cfg.dtype = dtype;
	cfg.out_dtype = KVT_DTYPE_F32;
	cfg.backend = KVT_BACKEND_CPU;
	cfg.host_bytes = (uint64_t)64 << 20;
	cfg.max_seqs = 8;
	cfg.n_sink = 4;
	cfg.window = 16;
	cfg.flush_batch = 8;
	cfg.p = KVT_DEFAULT_P;
	cfg.budget_min = KVT_DEFAULT_BUDGET_MIN;
	cfg.seed = KVT_DEFAULT_SEED;
	return cfg;
}

/* Create a cache or fail the test with the library's detail. */
static inline kvt_cache *t_create(const kvt_config *cfg)
{
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(cfg, &c);
	T_CHECK(rc == 0 && c != NULL, "kvt_cache_create: got %d (%s: %s), wanted 0", rc,
		kvt_strerror(rc), kvt_last_error(NULL));
	return c;
}

/* Whether text contains needle, ignoring case (error details are checked for the values named). */
static inline int t_contains(const char *text, const char *needle)
{
	for (const char *t = text; *t; t++) {
		size_t i = 0;
		while (needle[i] && tolower((unsigned char)t[i]) == tolower((unsigned char)needle[i]))
			i++;
		if (!needle[i])
			return 1;
	}
	return 0;
}

/* kvt_get_stats or fail. */
static inline kvt_stats t_stats(kvt_cache *c)
{
	kvt_stats st;
	memset(&st, 0, sizeof st);
	st.size = sizeof st;
	int rc = kvt_get_stats(c, &st);
	T_CHECK(rc == 0, "kvt_get_stats: got %d, wanted 0 (%s)", rc, kvt_last_error(c));
	return st;
}

/*
 * Double-precision reference attention of one query over n rows given as decoded floats
 * (K row i at k + i * stride, V row i at v + i * stride). out[j] receives the output and mag[j]
 * (when not NULL) sum_i p_i |v_ij|, the scale against which fp32 accumulation error is measured.
 */
static inline void t_ref_attention(uint32_t d, double scale, const float *q, uint32_t n,
				   const float *const *krows, const float *const *vrows, double *out,
				   double *mag)
{
	double *s = (double *)t_alloc(sizeof(double) * (n ? n : 1)), mx = -INFINITY, z = 0;
	for (uint32_t i = 0; i < n; i++) {
		double dot = 0;
		for (uint32_t j = 0; j < d; j++)
			dot += (double)q[j] * (double)krows[i][j];
		s[i] = dot * scale;
		if (s[i] > mx)
			mx = s[i];
	}
	for (uint32_t i = 0; i < n; i++) {
		s[i] = exp(s[i] - mx);
		z += s[i];
	}
	for (uint32_t j = 0; j < d; j++) {
		double o = 0, m = 0;
		for (uint32_t i = 0; i < n; i++) {
			o += s[i] * (double)vrows[i][j];
			m += s[i] * fabs((double)vrows[i][j]);
		}
		out[j] = o / z;
		if (mag)
			mag[j] = m / z;
	}
	free(s);
}

#endif
