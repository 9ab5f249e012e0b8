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

struct kb_base {
	bacc acc[KB_N_BASE];
	uint8_t *bmask;         /* [cap] a baseline's set */
	float *pmax;            /* [cap] max over the group of the exact probability */
	float *kmin, *kmax;     /* [cap / 16 + 1, d] Quest page bounds */
	float *pscore;          /* [cap / 16 + 1] Quest page scores */
	uint32_t *porder;       /* [cap / 16 + 1] */
};

kb_base *base_alloc(const kb_run *b)
{
	size_t pages = b->cap / PAGE + 1;
	kb_base *x = xcalloc(1, sizeof(*x));
	x->bmask = xcalloc(b->cap, 1);
	x->pmax = xcalloc(b->cap, sizeof(float));
	x->kmin = xcalloc(pages * b->d, sizeof(float));
	x->kmax = xcalloc(pages * b->d, sizeof(float));
	x->pscore = xcalloc(pages, sizeof(float));
	x->porder = xcalloc(pages, sizeof(uint32_t));
	for (int i = 0; i < KB_N_BASE; i++)
		x->acc[i] = (bacc){.recall_min = 1.0};
	return x;
}

void base_free(kb_base *x)
{
	if (!x)
		return;
	void *p[] = {x->bmask, x->pmax, x->kmin, x->kmax, x->pscore, x->porder};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
	free(x);
}

const bacc *base_acc(const kb_base *x, int i)
{
	return &x->acc[i];
}

/* Recall and output error of the set x->bmask (sinks and window included) for the group. */
static void score_set(kb_run *b, const float *V, uint32_t len, uint32_t lo, uint32_t hi, bacc *a)
{
	kb_base *x = b->base;
	double full[256], part[256];
	uint32_t cnt = 0;
	for (uint32_t t = lo; t < hi; t++)
		cnt += x->bmask[t];
	for (uint32_t g = 0; g < b->group; g++) {
		const float *pr = b->ref.prob + (size_t)g * b->cap;
		double r = 0;
		memset(full, 0, sizeof(full));
		memset(part, 0, sizeof(part));
		for (uint32_t t = 0; t < len; t++) {
			const float *v = V + (size_t)t * b->d;
			bool in = t < lo || t >= hi || x->bmask[t];
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
static void oracle_at(kb_run *b, uint32_t lo, uint32_t hi, uint32_t sel)
{
	kb_base *x = b->base;
	uint32_t n = hi - lo;
	memset(x->bmask + lo, 0, n);
	if (!sel)
		return;
	for (uint32_t t = lo; t < hi; t++) {
		float m = 0;
		for (uint32_t g = 0; g < b->group; g++)
			m = fmaxf(m, b->ref.prob[(size_t)g * b->cap + t]);
		x->pmax[t - lo] = m;
	}
	float thr = kth_largest(x->pmax, n, sel < n ? sel : n, b->ref.score);
	uint32_t taken = 0;
	for (uint32_t t = lo; t < hi; t++)
		if (x->pmax[t - lo] > thr) {
			x->bmask[t] = 1;
			taken++;
		}
	for (uint32_t t = lo; t < hi && taken < sel; t++)
		if (x->pmax[t - lo] == thr && !x->bmask[t]) {
			x->bmask[t] = 1;
			taken++;
		}
}

static const kb_run *sort_b;

static int cmp_page(const void *x, const void *y)
{
	const float *ps = sort_b->base->pscore;
	float a = ps[*(const uint32_t *)x], c = ps[*(const uint32_t *)y];
	return (a < c) - (a > c);
}

/* Quest: pages of the indexed range ranked by their upper bound, whole pages up to sel tokens. */
static void quest(kb_run *b, const float *K, const float *q, uint32_t lo, uint32_t hi, uint32_t sel)
{
	kb_base *x = b->base;
	const uint32_t d = b->d, pages = (hi - lo + PAGE - 1) / PAGE;
	memset(x->bmask + lo, 0, hi - lo);
	if (!sel || !pages)
		return;
	for (uint32_t pg = 0; pg < pages; pg++) {
		float *mn = x->kmin + (size_t)pg * d, *mx = x->kmax + (size_t)pg * d;
		uint32_t t0 = lo + pg * PAGE, t1 = t0 + PAGE < hi ? t0 + PAGE : hi;
		memcpy(mn, K + (size_t)t0 * d, d * sizeof(float));
		memcpy(mx, K + (size_t)t0 * d, d * sizeof(float));
		for (uint32_t t = t0 + 1; t < t1; t++)
			for (uint32_t j = 0; j < d; j++) {
				float k = K[(size_t)t * d + j];
				mn[j] = fminf(mn[j], k);
				mx[j] = fmaxf(mx[j], k);
			}
		x->pscore[pg] = -INFINITY;
	}
	/* per head: bounds relative to the head's best page, so heads compare on one scale */
	float *ub = x->pmax; /* pages <= cap */
	for (uint32_t g = 0; g < b->group; g++) {
		const float *qg = q + (size_t)g * d;
		float best = -INFINITY;
		for (uint32_t pg = 0; pg < pages; pg++) {
			const float *mn = x->kmin + (size_t)pg * d, *mx = x->kmax + (size_t)pg * d;
			float s = 0;
			for (uint32_t j = 0; j < d; j++)
				s += fmaxf(qg[j] * mn[j], qg[j] * mx[j]);
			ub[pg] = s;
			best = fmaxf(best, s);
		}
		for (uint32_t pg = 0; pg < pages; pg++)
			x->pscore[pg] = fmaxf(x->pscore[pg], ub[pg] - best);
	}
	for (uint32_t pg = 0; pg < pages; pg++)
		x->porder[pg] = pg;
	sort_b = b;
	qsort(x->porder, pages, sizeof(uint32_t), cmp_page);
	uint32_t taken = 0;
	for (uint32_t i = 0; i < pages && taken < sel; i++) {
		uint32_t t0 = lo + x->porder[i] * PAGE, t1 = t0 + PAGE < hi ? t0 + PAGE : hi;
		memset(x->bmask + t0, 1, t1 - t0);
		taken += t1 - t0;
	}
}

void base_eval(kb_run *b, const float *K, const float *V, const float *q, uint32_t len,
	       uint32_t lo, uint32_t hi, uint32_t sel)
{
	kb_base *x = b->base;
	memcpy(x->bmask + lo, b->ref.mark + lo, hi - lo);
	score_set(b, V, len, lo, hi, &x->acc[KB_BASE_ORACLE_TOPP]);
	oracle_at(b, lo, hi, sel);
	score_set(b, V, len, lo, hi, &x->acc[KB_BASE_ORACLE_AT]);
	quest(b, K, q, lo, hi, sel);
	score_set(b, V, len, lo, hi, &x->acc[KB_BASE_QUEST]);
}
