/* SPDX-License-Identifier: MIT */
/* Exact attention over gathered rows, fp32 accumulation, one pass with a running maximum. */
#include <math.h>

#include "half.h"
#include "internal.h"

/* At most KVT_ATTENTION_GROUP queries in one pass over the rows. */
static void attend_pass(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			uint32_t n, const void *const *rows, float *out)
{
	float acc[KVT_ATTENTION_GROUP][KVT_MAX_HEAD_DIM], k[KVT_MAX_HEAD_DIM], v[KVT_MAX_HEAD_DIM];
	float m[KVT_ATTENTION_GROUP], l[KVT_ATTENTION_GROUP];
	for (uint32_t h = 0; h < g; h++) {
		m[h] = -INFINITY;
		l[h] = 0.0f;
		for (uint32_t j = 0; j < d; j++)
			acc[h][j] = 0.0f;
	}
	for (uint32_t i = 0; i < n; i++) {
		/* the row once for the group; each query then does what it would do alone */
		for (uint32_t j = 0; j < d; j++) {
			k[j] = kvt_load(rows[i], j, dtype);
			v[j] = kvt_load(rows[i], d + j, dtype);
		}
		for (uint32_t h = 0; h < g; h++) {
			const float *qh = q + (size_t)h * d;
			float s = 0.0f;
			for (uint32_t j = 0; j < d; j++)
				s += qh[j] * k[j];
			s *= scale;
			if (s > m[h]) {
				/* rescale what was accumulated under the old maximum */
				float f = expf(m[h] - s);
				l[h] *= f;
				for (uint32_t j = 0; j < d; j++)
					acc[h][j] *= f;
				m[h] = s;
			}
			float w = expf(s - m[h]);
			l[h] += w;
			for (uint32_t j = 0; j < d; j++)
				acc[h][j] += w * v[j];
		}
	}
	for (uint32_t h = 0; h < g; h++) {
		float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
		for (uint32_t j = 0; j < d; j++)
			out[(size_t)h * d + j] = acc[h][j] * inv;
	}
}

void kvt_attention_group(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			 uint32_t n, const void *const *rows, float *out)
{
	for (uint32_t g0 = 0; g0 < g; g0 += KVT_ATTENTION_GROUP) {
		const uint32_t gn = g - g0 < KVT_ATTENTION_GROUP ? g - g0 : KVT_ATTENTION_GROUP;
		attend_pass(d, dtype, scale, gn, q + (size_t)g0 * d, n, rows, out + (size_t)g0 * d);
	}
}

void kvt_attention(uint32_t d, uint32_t dtype, float scale, const float *q, uint32_t n,
		   const void *const *rows, float *out)
{
	kvt_attention_group(d, dtype, scale, 1, q, n, rows, out);
}
