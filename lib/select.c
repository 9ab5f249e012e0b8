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
 * Three-way partition of a[0..m) around v: on return a[0..*ng) > v, a[*ng..m - *nl) == v,
 * a[m - *nl..m) < v.
 */
static void partition3(float *a, uint32_t m, float v, uint32_t *ng, uint32_t *nl)
{
	uint32_t lt = 0, i = 0, gt = m;
	/* Dutch national flag with "greater" first */
	while (i < gt) {
		if (a[i] > v) {
			float t = a[lt];
			a[lt++] = a[i];
			a[i++] = t;
		} else if (a[i] < v) {
			float t = a[--gt];
			a[gt] = a[i];
			a[i] = t;
		} else {
			i++;
		}
	}
	*ng = lt;
	*nl = m - gt;
}

int kvt_topp_threshold(const float *scores, uint32_t n, float scale, float p, float *scratch,
		       float *thresh, uint32_t *bad)
{
	float max;
	if (n == 0)
		return 0;
	KVT_TRY(check_finite(scores, n, &max, bad));
	double z = 0.0;
	float min = scores[0];
	for (uint32_t i = 0; i < n; i++) {
		scratch[i] = scores[i];
		z += exp((double)(scores[i] - max) * scale);
		min = scores[i] < min ? scores[i] : min;
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
		float v = median3(a[0], a[m / 2], a[m - 1]);
		uint32_t ng, nl;
		partition3(a, m, v, &ng, &nl);
		double mg = 0.0;
		for (uint32_t i = 0; i < ng; i++)
			mg += exp((double)(a[i] - max) * scale);
		uint32_t ne = m - ng - nl;
		double me = (double)ne * exp((double)(v - max) * scale);
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
		a += ng + ne;
		m = nl;
	}
}

/* Three-way partition of the pairs a[0..m) (key, score) around key v, as partition3. */
static void partition3_pairs(float *a, uint32_t m, float v, uint32_t *ng, uint32_t *nl)
{
	uint32_t lt = 0, i = 0, gt = m;
	while (i < gt) {
		float *x = a + 2 * i, t0 = x[0], t1 = x[1];
		if (t0 > v) {
			x[0] = a[2 * lt];
			x[1] = a[2 * lt + 1];
			a[2 * lt] = t0;
			a[2 * lt + 1] = t1;
			lt++;
			i++;
		} else if (t0 < v) {
			gt--;
			x[0] = a[2 * gt];
			x[1] = a[2 * gt + 1];
			a[2 * gt] = t0;
			a[2 * gt + 1] = t1;
		} else {
			i++;
		}
	}
	*ng = lt;
	*nl = m - gt;
}

int kvt_topp_threshold_keyed(const float *scores, const float *keys, uint32_t n, float scale,
			     float p, float *scratch, float *thresh, uint32_t *bad)
{
	float max;
	if (n == 0)
		return 0;
	KVT_TRY(check_finite(scores, n, &max, bad));
	double z = 0.0;
	float min = keys[0];
	for (uint32_t i = 0; i < n; i++) {
		scratch[2 * i] = keys[i];
		scratch[2 * i + 1] = scores[i];
		z += exp((double)(scores[i] - max) * scale);
		min = keys[i] < min ? keys[i] : min;
	}
	if (p >= 1.0f) {
		*thresh = min;
		return (int)n;
	}
	const double target = (double)p * z;
	double acc = 0.0;   /* mass of everything above the candidates, always < target */
	uint32_t above = 0; /* count of it */
	float *a = scratch;
	uint32_t m = n;
	for (;;) {
		float v = median3(a[0], a[2 * (m / 2)], a[2 * (m - 1)]);
		uint32_t ng, nl;
		partition3_pairs(a, m, v, &ng, &nl);
		double mg = 0.0, me = 0.0;
		for (uint32_t i = 0; i < ng; i++)
			mg += exp((double)(a[2 * i + 1] - max) * scale);
		const uint32_t ne = m - ng - nl;
		for (uint32_t i = ng; i < ng + ne; i++) /* equal keys may hold different scores */
			me += exp((double)(a[2 * i + 1] - max) * scale);
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
		a += 2 * (ng + ne);
		m = nl;
	}
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
		partition3(a, len, v, &ng, &nl);
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
