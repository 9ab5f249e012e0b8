/* SPDX-License-Identifier: MIT */
/*
 * The exact reference of kvbench and its comparison with what the library attended: for each query
 * head, softmax over every token of the sequence in fp32 from the same rounded K/V/q the library
 * received; the mass covered by the attended positions (recall), the exact Top-p oracle's share of
 * the indexed tokens (budget), and the error of the attention output.
 */
#include "kvbench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float dotf(const float *a, const float *x, uint32_t d)
{
	/* four chains: the scalar build is latency-bound on one */
	float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
	for (uint32_t i = 0; i < d; i += 4) {
		s0 += a[i] * x[i];
		s1 += a[i + 1] * x[i + 1];
		s2 += a[i + 2] * x[i + 2];
		s3 += a[i + 3] * x[i + 3];
	}
	return (s0 + s1) + (s2 + s3);
}

/* Ascending LSD radix sort of non-negative floats by their bit patterns, which order like the
 * values: four 8-bit passes, linear in n (qsort's comparisons were a tenth of the run). */
static void sort_probs(uint32_t *x, uint32_t *tmp, uint32_t n)
{
	for (uint32_t shift = 0; shift < 32; shift += 8) {
		uint32_t cnt[257] = {0}, *t = x;
		for (uint32_t i = 0; i < n; i++)
			cnt[((x[i] >> shift) & 255u) + 1]++;
		for (uint32_t i = 0; i < 256; i++)
			cnt[i + 1] += cnt[i];
		for (uint32_t i = 0; i < n; i++)
			tmp[cnt[(x[i] >> shift) & 255u]++] = x[i];
		x = tmp;
		tmp = t;
	}
}

/* Exact Top-p of one head over the indexed range [lo, lo + n), renormalized there: the smallest
 * set by descending probability with mass >= p, extended over ties. Marks it into b->ref.mark and
 * returns its size. */
static uint32_t oracle_mark(kb_run *b, const float *pr, uint32_t lo, uint32_t n)
{
	double total = 0, cum = 0;
	uint32_t k = 0, cnt = 0;
	float v = 0;
	for (uint32_t i = lo; i < lo + n; i++)
		total += pr[i];
	memcpy(b->ref.sorted, pr + lo, n * sizeof(float));
	sort_probs(b->ref.sorted, b->ref.sorted + b->cap, n);
	for (k = 0; k < n && (b->o.p >= 1.0f || cum < (double)b->o.p * total); k++) {
		memcpy(&v, &b->ref.sorted[n - 1 - k], sizeof(v));
		cum += v;
	}
	for (uint32_t i = lo; k && i < lo + n; i++)
		if (pr[i] >= v) {
			b->ref.mark[i] = 1;
			cnt++;
		}
	return cnt;
}

/* Softmax over all `len` tokens for each query head of a group: probabilities into b->ref.prob,
 * entropies into b->ref.ent. */
static void group_softmax(kb_run *b, const float *K, const float *q, uint32_t len)
{
	float scale = 1.0f / sqrtf((float)b->d);
	for (uint32_t t = 0; t < len; t++)
		for (uint32_t g = 0; g < b->group; g++)
			b->ref.score[(size_t)g * b->cap + t] =
				dotf(q + (size_t)g * b->d, K + (size_t)t * b->d, b->d) * scale;
	for (uint32_t g = 0; g < b->group; g++) {
		float *sc = b->ref.score + (size_t)g * b->cap, *pr = b->ref.prob + (size_t)g * b->cap;
		float m = sc[0];
		double z = 0, h = 0;
		for (uint32_t t = 1; t < len; t++)
			m = sc[t] > m ? sc[t] : m;
		for (uint32_t t = 0; t < len; t++)
			z += pr[t] = expf(sc[t] - m);
		for (uint32_t t = 0; t < len; t++) {
			pr[t] = (float)(pr[t] / z);
			if (pr[t] > 0)
				h -= pr[t] * log(pr[t]);
		}
		b->ref.ent[g] = h;
	}
}

/* Exact outputs of the group and their squared distance to the library's outputs. */
static void group_error(kb_run *b, const float *V, const float *out, uint32_t len, acc *a)
{
	enum { PASS = 8 }; /* query heads per pass over V: each row of V is read once per pass */
	double full[PASS][256];
	for (uint32_t g0 = 0; g0 < b->group; g0 += PASS) {
		const uint32_t gn = b->group - g0 < PASS ? b->group - g0 : PASS;
		memset(full, 0, sizeof(full));
		for (uint32_t t = 0; t < len; t++) {
			const float *v = V + (size_t)t * b->d;
			for (uint32_t g = 0; g < gn; g++) {
				const double pt = b->ref.prob[(size_t)(g0 + g) * b->cap + t];
				for (uint32_t i = 0; i < b->d; i++)
					full[g][i] += pt * v[i];
			}
		}
		for (uint32_t g = 0; g < gn; g++)
			for (uint32_t i = 0; i < b->d; i++) {
				double e = out[(size_t)(g0 + g) * b->d + i] - full[g][i];
				a->err2 += e * e;
				a->full2 += full[g][i] * full[g][i];
			}
	}
}

/* Compare one sequence on one layer after kvt_attend + kvt_gather. */
void evaluate(kb_run *b, uint32_t s, uint32_t l, const float *out, acc *a)
{
	const opts *o = &b->o;
	size_t sl = (size_t)s * o->layers + l;
	uint32_t len = b->len[sl], lo = rule_sinks(o, len), n = b->n_idx[sl], hi = lo + n;
	char where[96];
	for (uint32_t h = 0; h < o->kv_heads; h++) {
		const int32_t *p = (const int32_t *)b->pos.host + ((size_t)s * o->kv_heads + h) * len;
		int32_t cnt = b->counts[(size_t)s * o->kv_heads + h];
		uint32_t jq = h * b->group, uni = 0;
		snprintf(where, sizeof where, "sequence %u, layer %u, KV head %u", s, l, h);
		uint32_t sel = check_positions(p, cnt, len, lo, hi, where);
		group_softmax(b, truth(b, b->K, s, l, h), b->qf + ((size_t)s * o->q_heads + jq) * b->d,
			      len);
		group_error(b, truth(b, b->V, s, l, h), out + ((size_t)s * o->q_heads + jq) * b->d,
			    len, a);
		memset(b->ref.mark + lo, 0, n);
		for (uint32_t g = 0; g < b->group; g++) {
			const float *pr = b->ref.prob + (size_t)g * b->cap;
			double r = 0;
			int64_t nd = b->needle[(size_t)s * o->q_heads + jq + g];
			for (int32_t i = 0; i < cnt; i++) {
				r += pr[p[i]];
				a->needles_found += p[i] == nd;
			}
			a->needles += nd >= 0;
			a->recall_sum += r;
			a->recall_n++;
			a->recall_min = r < a->recall_min ? r : a->recall_min;
			a->recall_low += r < 0.5;
			if (b->n_recalls < b->cap_recalls)
				b->recalls[b->n_recalls++] = r;
			uint32_t one = n ? oracle_mark(b, pr, lo, n) : 0;
			b->head_oracle[(size_t)l * o->q_heads + jq + g] += n ? (double)one / n : 0;
			b->head_eff[(size_t)l * o->q_heads + jq + g] += exp(b->ref.ent[g]);
		}
		for (uint32_t i = lo; i < hi; i++)
			uni += b->ref.mark[i];
		if (b->base)
			base_eval(b, truth(b, b->K, s, l, h), truth(b, b->V, s, l, h),
				  b->qf + ((size_t)s * o->q_heads + jq) * b->d, len, lo, hi, sel);
		if (n) {
			a->budget_sum += (double)sel / n;
			a->oracle_sum += (double)uni / n;
			a->kv_n++;
		}
	}
}

void run_percentiles(const kb_run *b, double *p5, double *p1)
{
	double *v = xcalloc(b->n_recalls ? b->n_recalls : 1, sizeof(double)), pct[2];
	memcpy(v, b->recalls, b->n_recalls * sizeof(double));
	low_percentiles(v, b->n_recalls, pct);
	free(v);
	*p5 = pct[0];
	*p1 = pct[1];
}

void acc_init(acc *a)
{
	*a = (acc){.recall_min = 1.0};
}

void acc_add(acc *to, const acc *a)
{
	to->recall_sum += a->recall_sum;
	to->recall_min = a->recall_min < to->recall_min ? a->recall_min : to->recall_min;
	to->budget_sum += a->budget_sum;
	to->oracle_sum += a->oracle_sum;
	to->err2 += a->err2;
	to->full2 += a->full2;
	to->recall_n += a->recall_n;
	to->recall_low += a->recall_low;
	to->kv_n += a->kv_n;
	to->needles += a->needles;
	to->needles_found += a->needles_found;
	to->ns += a->ns;
}
