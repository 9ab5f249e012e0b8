/* SPDX-License-Identifier: MIT */
/*
 * Baselines on kvbench's workload, evaluated per (sequence, layer, KV head, step) beside kvtier's
 * own selection, from the exact softmax and the keys kvbench generated:
 *   oracle_topp   the exact Top-p set: per query head the smallest set of indexed tokens with mass
 *                 >= p of the exact softmax, united over the group (its budget is its own)
 *   oracle_at     the indexed tokens with the largest exact probability (max over the group), as
 *                 many as kvtier selected: the best any selector can do at kvtier's budget
 *   quest         Quest-style pages: 16-token pages of the indexed range with per-dimension min and
 *                 max of their keys, ranked by the upper bound sum_j max(q_j min_j, q_j max_j)
 *                 (relative to the head's best page, best over the group), whole pages taken until
 *                 kvtier's budget is reached
 * Every set also holds the sinks and the window. Recall is the exact mass the set covers; the output
 * is exact attention over the set (the softmax renormalized on it), compared with full attention.
 * The fourth baseline, Top-k by kvtier's own estimate, is a run of the library (--topk K).
 */
#include "kvbench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PAGE 16u

const char *const kb_base_names[KB_N_BASE] = {"oracle_topp", "oracle_at_budget", "quest"};

void base_alloc(bench *b)
{
	size_t pages = b->cap / PAGE + 1;
	b->bmask = xcalloc(b->cap, 1);
	b->pmax = xcalloc(b->cap, sizeof(float));
	b->kmin = xcalloc(pages * b->d, sizeof(float));
	b->kmax = xcalloc(pages * b->d, sizeof(float));
	b->pscore = xcalloc(pages, sizeof(float));
	b->porder = xcalloc(pages, sizeof(uint32_t));
	for (int i = 0; i < KB_N_BASE; i++)
		b->base[i] = (bacc){.recall_min = 1.0};
}

void base_free(bench *b)
{
	void *p[] = {b->bmask, b->pmax, b->kmin, b->kmax, b->pscore, b->porder};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* Recall and output error of the set b->bmask (sinks and window included) for the group. */
static void score_set(bench *b, const float *V, uint32_t len, uint32_t lo, uint32_t hi, bacc *a)
{
	double full[256], part[256];
	uint32_t cnt = 0;
	for (uint32_t t = lo; t < hi; t++)
		cnt += b->bmask[t];
	for (uint32_t g = 0; g < b->group; g++) {
		const float *pr = b->prob + (size_t)g * b->cap;
		double r = 0;
		memset(full, 0, sizeof(full));
		memset(part, 0, sizeof(part));
		for (uint32_t t = 0; t < len; t++) {
			const float *v = V + (size_t)t * b->d;
			bool in = t < lo || t >= hi || b->bmask[t];
			for (uint32_t i = 0; i < b->d; i++)
				full[i] += (double)pr[t] * v[i];
			if (!in)
				continue;
			r += pr[t];
			for (uint32_t i = 0; i < b->d; i++)
				part[i] += (double)pr[t] * v[i];
		}
		for (uint32_t i = 0; i < b->d; i++) {
			double e = (r > 0 ? part[i] / r : 0) - full[i];
			a->err2 += e * e;
			a->full2 += full[i] * full[i];
		}
		a->recall_sum += r;
		a->recall_n++;
		a->recall_min = r < a->recall_min ? r : a->recall_min;
	}
	if (hi > lo) {
		a->budget_sum += (double)cnt / (hi - lo);
		a->kv_n++;
	}
}

static int cmp_desc(const void *x, const void *y)
{
	float a = *(const float *)x, c = *(const float *)y;
	return (a < c) - (a > c);
}

/* The k-th largest of x[0..n) (1 <= k <= n), sorting the copy in tmp. */
static float kth_largest(const float *x, uint32_t n, uint32_t k, float *tmp)
{
	memcpy(tmp, x, n * sizeof(float));
	qsort(tmp, n, sizeof(float), cmp_desc);
	return tmp[k - 1];
}

/* Exactly sel indexed tokens by the largest exact probability of any head of the group (ties by
 * position). */
static void oracle_at(bench *b, uint32_t lo, uint32_t hi, uint32_t sel)
{
	uint32_t n = hi - lo;
	memset(b->bmask + lo, 0, n);
	if (!sel)
		return;
	for (uint32_t t = lo; t < hi; t++) {
		float m = 0;
		for (uint32_t g = 0; g < b->group; g++)
			m = fmaxf(m, b->prob[(size_t)g * b->cap + t]);
		b->pmax[t - lo] = m;
	}
	float thr = kth_largest(b->pmax, n, sel < n ? sel : n, b->score);
	uint32_t taken = 0;
	for (uint32_t t = lo; t < hi; t++)
		if (b->pmax[t - lo] > thr) {
			b->bmask[t] = 1;
			taken++;
		}
	for (uint32_t t = lo; t < hi && taken < sel; t++)
		if (b->pmax[t - lo] == thr && !b->bmask[t]) {
			b->bmask[t] = 1;
			taken++;
		}
}

static const bench *sort_b;

static int cmp_page(const void *x, const void *y)
{
	float a = sort_b->pscore[*(const uint32_t *)x], c = sort_b->pscore[*(const uint32_t *)y];
	return (a < c) - (a > c);
}

/* Quest: pages of the indexed range ranked by their upper bound, whole pages up to sel tokens. */
static void quest(bench *b, const float *K, const float *q, uint32_t lo, uint32_t hi, uint32_t sel)
{
	const uint32_t d = b->d, pages = (hi - lo + PAGE - 1) / PAGE;
	memset(b->bmask + lo, 0, hi - lo);
	if (!sel || !pages)
		return;
	for (uint32_t pg = 0; pg < pages; pg++) {
		float *mn = b->kmin + (size_t)pg * d, *mx = b->kmax + (size_t)pg * d;
		uint32_t t0 = lo + pg * PAGE, t1 = t0 + PAGE < hi ? t0 + PAGE : hi;
		memcpy(mn, K + (size_t)t0 * d, d * sizeof(float));
		memcpy(mx, K + (size_t)t0 * d, d * sizeof(float));
		for (uint32_t t = t0 + 1; t < t1; t++)
			for (uint32_t j = 0; j < d; j++) {
				float k = K[(size_t)t * d + j];
				mn[j] = fminf(mn[j], k);
				mx[j] = fmaxf(mx[j], k);
			}
		b->pscore[pg] = -INFINITY;
	}
	/* per head: bounds relative to the head's best page, so heads compare on one scale */
	float *ub = b->pmax; /* pages <= cap */
	for (uint32_t g = 0; g < b->group; g++) {
		const float *qg = q + (size_t)g * d;
		float best = -INFINITY;
		for (uint32_t pg = 0; pg < pages; pg++) {
			const float *mn = b->kmin + (size_t)pg * d, *mx = b->kmax + (size_t)pg * d;
			float s = 0;
			for (uint32_t j = 0; j < d; j++)
				s += fmaxf(qg[j] * mn[j], qg[j] * mx[j]);
			ub[pg] = s;
			best = fmaxf(best, s);
		}
		for (uint32_t pg = 0; pg < pages; pg++)
			b->pscore[pg] = fmaxf(b->pscore[pg], ub[pg] - best);
	}
	for (uint32_t pg = 0; pg < pages; pg++)
		b->porder[pg] = pg;
	sort_b = b;
	qsort(b->porder, pages, sizeof(uint32_t), cmp_page);
	uint32_t taken = 0;
	for (uint32_t i = 0; i < pages && taken < sel; i++) {
		uint32_t t0 = lo + b->porder[i] * PAGE, t1 = t0 + PAGE < hi ? t0 + PAGE : hi;
		memset(b->bmask + t0, 1, t1 - t0);
		taken += t1 - t0;
	}
}

void base_eval(bench *b, const float *K, const float *V, const float *q, uint32_t len,
	       uint32_t lo, uint32_t hi, uint32_t sel)
{
	memcpy(b->bmask + lo, b->mark + lo, hi - lo);
	score_set(b, V, len, lo, hi, &b->base[KB_BASE_ORACLE_TOPP]);
	oracle_at(b, lo, hi, sel);
	score_set(b, V, len, lo, hi, &b->base[KB_BASE_ORACLE_AT]);
	quest(b, K, q, lo, hi, sel);
	score_set(b, V, len, lo, hi, &b->base[KB_BASE_QUEST]);
}
