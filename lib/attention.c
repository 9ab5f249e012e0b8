/* SPDX-License-Identifier: MIT */
/* Exact attention over gathered rows, fp32 accumulation, one pass with a running maximum. */
#include <math.h>

#include "half.h"
#include "internal.h"

void kvt_attention(uint32_t d, uint32_t dtype, float scale, const float *q, uint32_t n,
		   const void *const *rows, float *out)
{
	float acc[KVT_MAX_HEAD_DIM], v[KVT_MAX_HEAD_DIM];
	float m = -INFINITY, l = 0.0f;
	for (uint32_t j = 0; j < d; j++)
		acc[j] = 0.0f;
	for (uint32_t i = 0; i < n; i++) {
		const void *row = rows[i];
		float s = 0.0f;
		for (uint32_t j = 0; j < d; j++)
			s += q[j] * kvt_load(row, j, dtype);
		s *= scale;
		for (uint32_t j = 0; j < d; j++)
			v[j] = kvt_load(row, d + j, dtype);
		if (s > m) {
			/* rescale what was accumulated under the old maximum */
			float f = expf(m - s);
			l *= f;
			for (uint32_t j = 0; j < d; j++)
				acc[j] *= f;
			m = s;
		}
		float w = expf(s - m);
		l += w;
		for (uint32_t j = 0; j < d; j++)
			acc[j] += w * v[j];
	}
	float inv = l > 0.0f ? 1.0f / l : 0.0f;
	for (uint32_t j = 0; j < d; j++)
		out[j] = acc[j] * inv;
}
