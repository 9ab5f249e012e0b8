/* SPDX-License-Identifier: MIT */
/*
 * What storing the host tier's K/V rows as fp8 E4M3 would cost in accuracy (decision (b) of
 * doc/cuda-backend.md: half the bytes of each miss over PCIe and twice the sequences host memory
 * holds; not built). On kvbench's synthetic workload (tools/workload.h, its default shape:
 * 32 query heads, 8 KV heads, head_dim 128), each decode query's exact attention over a context's
 * rows as the library stores them (fp16, the reference) is compared with the same attention over
 * rows rounded to E4M3 (OCP E4M3FN: round to nearest even, saturated at +-448, subnormals kept):
 * - K and V with one scale of 1 for every row (vLLM's kv_cache_dtype "fp8" without calibration);
 * - K and V, each row's K and V scaled by their own absolute maximum / 448 (a scale stored beside
 *   the row: 8 more bytes a row);
 * - V alone, then K alone, in E4M3 with a scale a row and the other half fp16: which half the
 *   error comes from;
 * - K in INT8 (symmetric, a scale a row: its absolute maximum / 127) and V in E4M3 with a scale a
 *   row: a uniform grid suits keys, whose elements share a large offset (post-RoPE keys have one),
 *   better than a float format's relative one;
 * - the same with K's scales per channel over each block of 256 tokens (the host tier's block;
 *   KIVI's choice for keys, whose outlier channels a row's scale would let dominate the row): 2
 *   bytes a token of scales instead of 4;
 * - both again with V in INT8 with a scale a row instead of E4M3: a value row's elements spread
 *   around zero, where INT8's uniform grid is finer than E4M3's over most of the range.
 * The peer, measured in the same run: the exact Top-p oracle at p over the fp16 rows (the smallest
 * set of tokens holding mass p of the exact softmax, attended alone), the error a Top-p selection
 * at p accepts by its definition (kvtier's attends sinks and the window besides, which lowers it);
 * and the same oracle over the rows of the last INT8 form (its softmax, its set, its values), the
 * two errors together, against the same fp16 reference.
 * Everything is computed in double from the rounded values, so the figures are the storage's
 * alone. Reported over (layer, query head, step): the output's relative L2 error against the
 * reference and the total variation distance between the softmax weights (half their L1
 * distance: the share of attention mass that moves; for the oracle, the mass it leaves out),
 * median, 95th percentile and maximum. Nothing is asserted. With --trace DIR the rows and queries
 * are a trained model's (a kvbench trace, doc/trace-format.md): its prefill is the context, its
 * decode queries the queries, its shape and scale the trace's (--layers, default 2, takes its first
 * layers; --steps its first steps).
 *   cpu_fp8_error [--context N] [--steps N] [--layers N] [--p X] [--seed N] [--trace DIR]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trace.h"
#include "workload.h"

enum { HQ = 32, HKV = 8, D_MAX = 512 }; /* the workload's heads; the largest head_dim taken */
/* the rows attended: fp16 (the reference), then E4M3 variants, then the oracle's peer */
enum {
	REF, BOTH_TENSOR, BOTH_ROW, V_ONLY, K_ONLY, K_INT8, K_INT8_CH, KV_INT8, KV_INT8_CH, TOPP, TOPP8,
	KINDS
};
static const char *const kind_name[KINDS] = {
	"fp16", "E4M3 K and V, scale/tensor", "E4M3 K and V, scale/row", "E4M3 V only, scale/row",
	"E4M3 K only, scale/row", "INT8 K + E4M3 V, scale/row", "INT8 K/channel + E4M3 V/row",
	"INT8 K and V, scale/row", "INT8 K/channel + INT8 V/row", "Top-p oracle (fp16)",
	"Top-p oracle over INT8 rows"};
/* which stored keys and values each kind attends: 0 fp16, 1 E4M3 with one scale, 2 E4M3 with a
 * scale a row, 3 INT8 with a scale a row, 4 INT8 with a scale a channel a block (keys only) */
static const int kind_k[TOPP] = {0, 1, 2, 0, 2, 3, 4, 3, 4};
static const int kind_v[TOPP] = {0, 1, 2, 2, 0, 2, 2, 3, 3};
enum { BLOCK = 256 }; /* tokens a per-channel scale covers: the host tier's block */

/* x rounded to the nearest E4M3 value (ties to even), saturated at +-448. */
static double e4m3(double x)
{
	const double a = fabs(x);
	if (a >= 448.0)
		return copysign(448.0, x);
	int e;
	frexp(a, &e); /* a = f 2^e, f in [0.5, 1): the binade's step is 2^(e - 4) */
	const double step = ldexp(1.0, (e - 4 < -9 ? -9 : e - 4)); /* subnormals: 2^-9 */
	return copysign(nearbyint(a / step) * step, x);
}

static uint32_t D = 128; /* head_dim: the workload's, or the trace's */

/* d values rounded to E4M3 under a scale (x / scale rounded, times scale). */
static void round_row(const double *x, double scale, double *out)
{
	for (uint32_t j = 0; j < D; j++)
		out[j] = e4m3(x[j] / scale) * scale;
}

/* The scale that puts the largest |x| of n values (stride apart) on a grid's largest value `top`:
 * 1 for all zeros. */
static double grid_scale(const double *x, uint32_t n, size_t stride, double top)
{
	double m = 0.0;
	for (uint32_t i = 0; i < n; i++)
		m = fabs(x[i * stride]) > m ? fabs(x[i * stride]) : m;
	return m > 0.0 ? m / top : 1.0;
}

/* n values (stride apart) on the symmetric INT8 grid of their absolute maximum: a row's (stride
 * 1), or a channel's over a block of tokens (stride D). */
static void round_int8(const double *x, uint32_t n, size_t stride, double *out)
{
	const double scale = grid_scale(x, n, stride, 127.0);
	for (uint32_t i = 0; i < n; i++)
		out[i * stride] = nearbyint(x[i * stride] / scale) * scale;
}

static void *xmalloc(size_t bytes)
{
	void *m = malloc(bytes);
	if (!m) {
		fprintf(stderr, "cpu_fp8_error: out of memory for %zu bytes\n", bytes);
		exit(1);
	}
	return m;
}

static int cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Softmax weights of q over n keys (logits times scale) into w; the output over v into out. */
static void attend(const double *q, uint32_t n, const double *k, const double *v, double scale,
		   double *w, double *out)
{
	double m = -INFINITY, z = 0.0;
	for (uint32_t t = 0; t < n; t++) {
		double s = 0.0;
		for (uint32_t j = 0; j < D; j++)
			s += q[j] * k[(size_t)t * D + j];
		w[t] = s * scale;
		m = w[t] > m ? w[t] : m;
	}
	for (uint32_t t = 0; t < n; t++) {
		w[t] = exp(w[t] - m);
		z += w[t];
	}
	memset(out, 0, sizeof *out * D);
	for (uint32_t t = 0; t < n; t++) {
		w[t] /= z;
		for (uint32_t j = 0; j < D; j++)
			out[j] += w[t] * v[(size_t)t * D + j];
	}
}

/* The exact Top-p oracle over weights w of n tokens: the largest until their sum reaches p, their
 * weights renormalized into w_out (0 elsewhere) and their values' mix into out. */
static void topp_oracle(const double *w, const double *v, uint32_t n, double p, double *order,
			double *w_out, double *out)
{
	memcpy(order, w, sizeof(double) * n);
	qsort(order, n, sizeof(double), cmp_double);
	double mass = 0.0, cut = order[0];
	for (uint32_t t = n; t-- > 0;) {
		mass += order[t];
		cut = order[t];
		if (mass >= p)
			break;
	}
	double z = 0.0;
	for (uint32_t t = 0; t < n; t++) {
		w_out[t] = w[t] >= cut ? w[t] : 0.0;
		z += w_out[t];
	}
	memset(out, 0, sizeof *out * D);
	for (uint32_t t = 0; t < n; t++) {
		w_out[t] /= z;
		for (uint32_t j = 0; w_out[t] > 0.0 && j < D; j++)
			out[j] += w_out[t] * v[(size_t)t * D + j];
	}
}

static void report(const char *what, double *x, size_t n)
{
	qsort(x, n, sizeof *x, cmp_double);
	printf(" %-28s median %.3e  p95 %.3e  max %.3e\n", what, x[n / 2], x[(size_t)(0.95 * (n - 1))],
	       x[n - 1]);
}

/* Where the rows and queries come from: kvbench's workload, or a trace's layers one at a time. */
struct source {
	wl *w;
	const char *dir;
	trace_meta m;
	trace_layer tl;
	uint32_t layers, nq, nkv, ctx, steps;
	double scale;
};

/* Key and value of token t of KV head h on the current layer, as floats. */
static void source_row(const struct source *src, uint32_t layer, uint32_t h, uint32_t t, float *k,
		       float *v)
{
	if (src->w) {
		wl_token(src->w, 0, layer, h, t, -1, k, v, NULL, NULL);
		return;
	}
	memcpy(k, src->tl.prefill_k + ((size_t)t * src->nkv + h) * D, sizeof(float) * D);
	memcpy(v, src->tl.prefill_v + ((size_t)t * src->nkv + h) * D, sizeof(float) * D);
}

/* The decode queries of step s for the group of KV head h: [group, D] floats. */
static void source_queries(const struct source *src, uint32_t layer, uint32_t h, uint32_t s,
			   float *q)
{
	const uint32_t G = src->nq / src->nkv;
	if (src->w) {
		float k[D_MAX], v[D_MAX];
		wl_token(src->w, 0, layer, h, src->ctx + s, (int32_t)s, k, v, q, NULL);
		return;
	}
	memcpy(q, src->tl.decode_q + ((size_t)s * src->nq + (size_t)h * G) * D,
	       sizeof(float) * G * D);
}

int main(int argc, char **argv)
{
	uint32_t ctx = 8192, steps = 4, layers = 2;
	double p = 0.9;
	uint64_t seed = 1;
	struct source src = {0};
	for (int i = 1; i + 1 < argc; i += 2) {
		const char *a = argv[i], *val = argv[i + 1];
		if (!strcmp(a, "--context") && atol(val) >= 16)
			ctx = (uint32_t)atol(val);
		else if (!strcmp(a, "--steps") && atol(val) >= 1)
			steps = (uint32_t)atol(val);
		else if (!strcmp(a, "--layers") && atol(val) >= 1)
			layers = (uint32_t)atol(val);
		else if (!strcmp(a, "--p") && atof(val) > 0.0 && atof(val) <= 1.0)
			p = atof(val);
		else if (!strcmp(a, "--seed"))
			seed = strtoull(val, NULL, 0);
		else if (!strcmp(a, "--trace"))
			src.dir = val;
		else {
			fprintf(stderr, "cpu_fp8_error: bad option %s %s\nusage: cpu_fp8_error [--context "
				"N >= 16] [--steps N] [--layers N] [--p X in (0, 1]] [--seed N] [--trace "
				"DIR]\n", a, val);
			return 2;
		}
	}
	if (argc % 2 == 0) {
		fprintf(stderr, "cpu_fp8_error: %s needs a value\n", argv[argc - 1]);
		return 2;
	}
	char msg[512];
	if (src.dir) {
		if (trace_open(src.dir, &src.m, msg, sizeof msg)) {
			fprintf(stderr, "cpu_fp8_error: %s\n", msg);
			return 1;
		}
		if (src.m.head_dim > D_MAX) {
			fprintf(stderr, "cpu_fp8_error: head_dim %u, at most %u\n", src.m.head_dim, D_MAX);
			return 1;
		}
		src.layers = layers < src.m.n_layers ? layers : src.m.n_layers;
		src.nq = src.m.n_q_heads;
		src.nkv = src.m.n_kv_heads;
		D = src.m.head_dim;
		src.ctx = src.m.prefill_tokens;
		src.steps = steps < src.m.decode_steps ? steps : src.m.decode_steps;
		src.scale = src.m.scale > 0.0 ? src.m.scale : 1.0 / sqrt((double)D);
	} else {
		wl_params wp;
		wl_params_default(&wp);
		wp.n_layers = layers;
		wp.n_q_heads = HQ;
		wp.n_kv_heads = HKV;
		wp.head_dim = D;
		wp.context = ctx;
		wp.steps = steps;
		wp.seed = seed;
		if (wl_create(&wp, &src.w)) {
			fprintf(stderr, "cpu_fp8_error: wl_create failed\n");
			return 1;
		}
		src.layers = layers;
		src.nq = HQ;
		src.nkv = HKV;
		src.ctx = ctx;
		src.steps = steps;
		src.scale = 1.0 / sqrt((double)D);
	}
	ctx = src.ctx;
	const uint32_t G = src.nq / src.nkv;
	const size_t rows = (size_t)ctx * D, samples = (size_t)src.layers * src.nq * src.steps;
	double *k[5], *v[4]; /* kind_k's and kind_v's stored forms */
	for (int x = 0; x < 5; x++)
		k[x] = xmalloc(sizeof(double) * rows);
	for (int x = 0; x < 4; x++)
		v[x] = xmalloc(sizeof(double) * rows);
	double *wt[KINDS], *err[KINDS], *tv[KINDS], *order = xmalloc(sizeof(double) * ctx);
	float *qf = xmalloc(sizeof(float) * G * D);
	for (int x = 0; x < KINDS; x++) {
		wt[x] = xmalloc(sizeof(double) * ctx);
		err[x] = xmalloc(sizeof(double) * samples);
		tv[x] = xmalloc(sizeof(double) * samples);
	}
	if (src.dir)
		printf("cpu_fp8_error: trace %s (%s), %u of its layers x %u query heads (%u KV heads, "
		       "head_dim %u), context %u, %u decode steps", src.dir, src.m.model, src.layers,
		       src.nq, src.nkv, D, ctx, src.steps);
	else
		printf("cpu_fp8_error: kvbench's workload, %u layers x %u query heads (%u KV heads, "
		       "head_dim %u), context %u, %u decode steps, seed %llu", src.layers, src.nq,
		       src.nkv, D, ctx, src.steps, (unsigned long long)seed);
	printf("; errors against exact attention over the fp16 rows\n");
	size_t at = 0;
	double saturated = 0.0;
	for (uint32_t layer = 0; layer < src.layers; layer++) {
		if (src.dir && trace_load_layer(src.dir, &src.m, layer, &src.tl, msg, sizeof msg)) {
			fprintf(stderr, "cpu_fp8_error: %s\n", msg);
			return 1;
		}
		for (uint32_t h = 0; h < src.nkv; h++) {
			float kf[D_MAX], vf[D_MAX];
			for (uint32_t t = 0; t < ctx; t++) {
				source_row(&src, layer, h, t, kf, vf);
				double *kr = k[0] + (size_t)t * D, *vr = v[0] + (size_t)t * D;
				for (uint32_t j = 0; j < D; j++) { /* stored as fp16, as the library does */
					kr[j] = wl_f16_to_f32(wl_f32_to_f16(kf[j]));
					vr[j] = wl_f16_to_f32(wl_f32_to_f16(vf[j]));
					saturated += fabs(kr[j]) > 448.0 || fabs(vr[j]) > 448.0;
				}
				round_row(kr, 1.0, k[1] + (size_t)t * D);
				round_row(vr, 1.0, v[1] + (size_t)t * D);
				round_row(kr, grid_scale(kr, D, 1, 448.0), k[2] + (size_t)t * D);
				round_row(vr, grid_scale(vr, D, 1, 448.0), v[2] + (size_t)t * D);
				round_int8(kr, D, 1, k[3] + (size_t)t * D);
				round_int8(vr, D, 1, v[3] + (size_t)t * D);
			}
			for (uint32_t t0 = 0; t0 < ctx; t0 += BLOCK) /* each channel of each block */
				for (uint32_t j = 0; j < D; j++)
					round_int8(k[0] + (size_t)t0 * D + j,
						   ctx - t0 < BLOCK ? ctx - t0 : BLOCK, D,
						   k[4] + (size_t)t0 * D + j);
			for (uint32_t s = 0; s < src.steps; s++) {
				source_queries(&src, layer, h, s, qf);
				for (uint32_t g = 0; g < G; g++, at++) {
					double q[D_MAX], out[KINDS][D_MAX];
					for (uint32_t j = 0; j < D; j++) /* queries arrive as fp16 too */
						q[j] = wl_f16_to_f32(wl_f32_to_f16(qf[g * D + j]));
					for (int x = REF; x < TOPP; x++)
						attend(q, ctx, k[kind_k[x]], v[kind_v[x]], src.scale, wt[x],
						       out[x]);
					topp_oracle(wt[REF], v[0], ctx, p, order, wt[TOPP], out[TOPP]);
					topp_oracle(wt[KV_INT8_CH], v[kind_v[KV_INT8_CH]], ctx, p, order,
						    wt[TOPP8], out[TOPP8]);
					double n2 = 0.0;
					for (uint32_t j = 0; j < D; j++)
						n2 += out[REF][j] * out[REF][j];
					for (int x = BOTH_TENSOR; x < KINDS; x++) {
						double e2 = 0.0, d1 = 0.0;
						for (uint32_t j = 0; j < D; j++)
							e2 += (out[x][j] - out[REF][j]) * (out[x][j] - out[REF][j]);
						for (uint32_t t = 0; t < ctx; t++)
							d1 += fabs(wt[x][t] - wt[REF][t]);
						err[x][at] = sqrt(e2 / (n2 > 0.0 ? n2 : 1.0));
						tv[x][at] = 0.5 * d1;
					}
				}
			}
			fprintf(stderr, "cpu_fp8_error: %3.0f%%\r", 100.0 * at / samples);
		}
		if (src.dir)
			trace_layer_free(&src.tl);
	}
	fprintf(stderr, "\n");
	printf("elements beyond E4M3's 448 (saturated with one scale per tensor): %.0f of %.0f\n",
	       saturated, 2.0 * src.layers * src.nkv * rows);
	printf("output relative L2 error, over %zu (layer, query head, step):\n", samples);
	for (int x = BOTH_TENSOR; x < KINDS; x++)
		report(kind_name[x], err[x], samples);
	printf("attention mass moved (total variation distance of the softmax weights):\n");
	for (int x = BOTH_TENSOR; x < KINDS; x++)
		report(kind_name[x], tv[x], samples);
	printf("(the oracles: Top-p at p %.2f on the exact weights of the fp16 rows, or of the INT8 "
	       "rows; no sinks or window)\n", p);
	for (int x = 0; x < 5; x++)
		free(k[x]);
	for (int x = 0; x < 4; x++)
		free(v[x]);
	for (int x = 0; x < KINDS; x++) {
		free(wt[x]);
		free(err[x]);
		free(tv[x]);
	}
	free(order);
	free(qf);
	if (src.w)
		wl_destroy(src.w);
	return 0;
}
