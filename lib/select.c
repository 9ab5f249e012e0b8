/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection in expected linear time. The threshold is found by partitioning on probability
 * mass (quickselect that keeps the side holding the boundary), never by sorting: each round
 * partitions the remaining candidates three ways around a pivot and keeps only the side where the
 * cumulative mass crosses p, so the expected work is a constant times n. The keyed form orders the
 * tokens by keys while the mass is the scores' (kvt_config.keep_weight: the last selection's tokens
 * ranked higher), partitioning (key, score) pairs.
 */
#include <math.h>

#include "internal.h"

static int check_finite(const float *s, uint32_t n, float *max, uint32_t *bad)
{
	float m = -INFINITY;
	for (uint32_t i = 0; i < n; i++) {
		if (!isfinite(s[i])) {
			if (bad)
				*bad = i;
			return -EINVAL;
		}
		m = s[i] > m ? s[i] : m;
	}
	*max = m;
	return 0;
}

static float median3(float a, float b, float c)
{
	if (a > b) {
		float t = a;
		a = b;
		b = t;
	}
	return c < a ? a : c > b ? b : c;
}

/*
 * Three-way partition of the m elements of `w` floats at a (w 1: a score; w 2: a key, then its
 * score) around key v: on return elements [0, *ng) have keys > v, [*ng, m - *nl) == v and
 * [m - *nl, m) < v. Inlined with a constant w.
 */
static inline void partition3(float *a, uint32_t w, uint32_t m, float v, uint32_t *ng,
			      uint32_t *nl)
{
	uint32_t lt = 0, i = 0, gt = m;
	/* Dutch national flag with "greater" first */
	while (i < gt) {
		float *x = a + (size_t)w * i, *y;
		if (x[0] > v) {
			y = a + (size_t)w * lt++;
			i++;
		} else if (x[0] < v) {
			y = a + (size_t)w * --gt;
		} else {
			i++;
			continue;
		}
		for (uint32_t j = 0; j < w; j++) {
			const float t = x[j];
			x[j] = y[j];
			y[j] = t;
		}
	}
	*ng = lt;
	*nl = m - gt;
}

/*
 * The quickselect on mass of both thresholds: elements of w floats in scratch (w 1: the scores;
 * w 2: (key, score) pairs), ordered by their first float, each massing exp((score - max) * scale).
 * Tied scores (w 1) mass ne times one term; tied keys (w 2) may hold different scores and sum
 * their own. Inlined with a constant w, so the unkeyed path is the loop it always was.
 */
static inline int threshold(const float *scores, const float *keys, uint32_t w, uint32_t n,
			    float scale, float p, float *scratch, float *thresh, uint32_t *bad)
{
	float max;
	if (n == 0)
		return 0;
	KVT_TRY(check_finite(scores, n, &max, bad));
	double z = 0.0;
	float min = keys[0];
	for (uint32_t i = 0; i < n; i++) {
		scratch[(size_t)w * i] = keys[i];
		scratch[(size_t)w * i + w - 1] = scores[i];
		z += exp((double)(scores[i] - max) * scale);
		min = keys[i] < min ? keys[i] : min;
	}
	if (p >= 1.0f) {
		*thresh = min;
		return (int)n;
	}
	const double target = (double)p * z;
	double acc = 0.0; /* mass of everything above the candidates, always < target */
	uint32_t above = 0; /* count of it */
	float *a = scratch;
	uint32_t m = n;
	for (;;) {
		float v = median3(a[0], a[(size_t)w * (m / 2)], a[(size_t)w * (m - 1)]);
		uint32_t ng, nl;
		partition3(a, w, m, v, &ng, &nl);
		double mg = 0.0, me = 0.0;
		for (uint32_t i = 0; i < ng; i++)
			mg += exp((double)(a[(size_t)w * i + w - 1] - max) * scale);
		const uint32_t ne = m - ng - nl;
		if (w == 1)
			me = (double)ne * exp((double)(v - max) * scale);
		else
			for (uint32_t i = ng; i < ng + ne; i++)
				me += exp((double)(a[(size_t)w * i + w - 1] - max) * scale);
		if (acc + mg >= target) {
			m = ng; /* the boundary lies strictly above v */
			continue;
		}
		if (acc + mg + me >= target || nl == 0) {
			*thresh = v;
			return (int)(above + ng + ne);
		}
		acc += mg + me;
		above += ng + ne;
		a += (size_t)w * (ng + ne);
		m = nl;
	}
}

int kvt_topp_threshold(const float *scores, uint32_t n, float scale, float p, float *scratch,
		       float *thresh, uint32_t *bad)
{
	return threshold(scores, scores, 1, n, scale, p, scratch, thresh, bad);
}

int kvt_topp_threshold_keyed(const float *scores, const float *keys, uint32_t n, float scale,
			     float p, float *scratch, float *thresh, uint32_t *bad)
{
	return threshold(scores, keys, 2, n, scale, p, scratch, thresh, bad);
}

float kvt_kth_largest(const float *scores, uint32_t n, uint32_t m, float *scratch)
{
	for (uint32_t i = 0; i < n; i++)
		scratch[i] = scores[i];
	float *a = scratch;
	uint32_t len = n;
	for (;;) {
		float v = median3(a[0], a[len / 2], a[len - 1]);
		uint32_t ng, nl;
		partition3(a, 1, len, v, &ng, &nl);
		if (m <= ng) {
			len = ng;
		} else if (m <= len - nl) {
			return v;
		} else {
			m -= len - nl;
			a += len - nl;
			len = nl;
		}
	}
}

int kvt_topp_mark(const float *scores, const float *keys, uint32_t n, float scale, float p,
		  uint32_t bmin, uint32_t bmax, float *scratch, uint8_t *mask, int *clamped,
		  uint32_t *bad)
{
	float t;
	*clamped = 0;
	if (n == 0)
		return 0;
	int count = keys ? kvt_topp_threshold_keyed(scores, keys, n, scale, p, scratch, &t, bad)
			 : kvt_topp_threshold(scores, n, scale, p, scratch, &t, bad);
	if (count < 0)
		return count;
	const float *k = keys ? keys : scores;
	uint32_t want = (uint32_t)count;
	if (bmax && want > bmax) {
		want = bmax;
		*clamped = -1;
	} else if (want < bmin) {
		want = bmin < n ? bmin : n;
		*clamped = want > (uint32_t)count ? 1 : 0;
	}
	if (!*clamped) {
		for (uint32_t i = 0; i < n; i++)
			mask[i] |= k[i] >= t;
		return count;
	}
	/* exactly `want` tokens: everything above the want-th largest, then its ties by position */
	float v = kvt_kth_largest(k, n, want, scratch);
	uint32_t taken = 0;
	for (uint32_t i = 0; i < n; i++)
		if (k[i] > v) {
			mask[i] = 1;
			taken++;
		}
	for (uint32_t i = 0; i < n && taken < want; i++)
		if (k[i] == v) {
			mask[i] = 1;
			taken++;
		}
	return (int)want;
}
