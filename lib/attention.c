/* SPDX-License-Identifier: MIT */
/*
 * Exact attention over gathered rows, fp32 accumulation, one pass with a running maximum. The
 * pass is split into begin / feed / finish so that a caller may feed the rows in pieces (a causal
 * chunk, rows read block by block): each query does the same operations in the same order however
 * the rows are cut, so its result is bit for bit what one call over all its rows gives.
 */
#include <math.h>

#include "half.h"
#include "internal.h"

void kvt_attention_begin(uint32_t d, uint32_t g, float *m, float *l, float *acc)
{
	for (uint32_t h = 0; h < g; h++) {
		m[h] = -INFINITY;
		l[h] = 0.0f;
	}
	for (size_t j = 0; j < (size_t)g * d; j++)
		acc[j] = 0.0f;
}

/* One query takes one row (k and v converted): the running maximum, sum and accumulators. Returns
 * the logit q.k before the scale. */
static float take_row(uint32_t d, float scale, const float *q, const float *k, const float *v,
		      float *m, float *l, float *acc)
{
	float raw = 0.0f;
	for (uint32_t j = 0; j < d; j++)
		raw += q[j] * k[j];
	float s = raw * scale;
	if (s > *m) {
		/* rescale what was accumulated under the old maximum */
		float f = expf(*m - s);
		*l *= f;
		for (uint32_t j = 0; j < d; j++)
			acc[j] *= f;
		*m = s;
	}
	float w = expf(s - *m);
	*l += w;
	for (uint32_t j = 0; j < d; j++)
		acc[j] += w * v[j];
	return raw;
}

/* kvt_attention_feed, query h's logit of row i also into logits[h * lstride + i] (logits NULL:
 * not kept). */
static void feed(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
		 const uint32_t *end, uint32_t first, uint32_t n, const void *const *rows, float *m,
		 float *l, float *acc, float *logits, size_t lstride)
{
	float k[KVT_MAX_HEAD_DIM], v[KVT_MAX_HEAD_DIM];
	for (uint32_t i = 0; i < n; i++) {
		/* the row once for the group; each query then does what it would do alone */
		for (uint32_t j = 0; j < d; j++) {
			k[j] = kvt_load(rows[i], j, dtype);
			v[j] = kvt_load(rows[i], d + j, dtype);
		}
		for (uint32_t h = 0; h < g; h++)
			if (!end || first + i < end[h]) {
				float raw = take_row(d, scale, q + (size_t)h * d, k, v, &m[h], &l[h],
						     acc + (size_t)h * d);
				if (logits)
					logits[h * lstride + i] = raw;
			}
	}
}

void kvt_attention_feed(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			const uint32_t *end, uint32_t first, uint32_t n, const void *const *rows,
			float *m, float *l, float *acc)
{
	feed(d, dtype, scale, g, q, end, first, n, rows, m, l, acc, NULL, 0);
}

void kvt_attention_finish(uint32_t d, uint32_t g, const float *l, const float *acc, float *out)
{
	for (uint32_t h = 0; h < g; h++) {
		float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
		for (uint32_t j = 0; j < d; j++)
			out[(size_t)h * d + j] = acc[(size_t)h * d + j] * inv;
	}
}

void kvt_attention_group(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			 uint32_t n, const void *const *rows, float *out, float *logits)
{
	float acc[KVT_ATTENTION_GROUP * KVT_MAX_HEAD_DIM];
	float m[KVT_ATTENTION_GROUP], l[KVT_ATTENTION_GROUP];
	for (uint32_t g0 = 0; g0 < g; g0 += KVT_ATTENTION_GROUP) {
		const uint32_t gn = g - g0 < KVT_ATTENTION_GROUP ? g - g0 : KVT_ATTENTION_GROUP;
		kvt_attention_begin(d, gn, m, l, acc);
		feed(d, dtype, scale, gn, q + (size_t)g0 * d, NULL, 0, n, rows, m, l, acc,
		     logits ? logits + (size_t)g0 * n : NULL, n);
		kvt_attention_finish(d, gn, l, acc, out + (size_t)g0 * d);
	}
}

void kvt_attention(uint32_t d, uint32_t dtype, float scale, const float *q, uint32_t n,
		   const void *const *rows, float *out)
{
	kvt_attention_group(d, dtype, scale, 1, q, n, rows, out, NULL);
}
