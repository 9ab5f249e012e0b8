/* SPDX-License-Identifier: MIT */
/*
 * A sweep's methods against its p-sweep at equal budget (issue 15 point 5: a method must move the
 * curve, not slide along it). The plain points of a shape (p alone: no topk, no corrections, no
 * second stage, no budget cap, no keep; same context, seqs and layers) trace the p-sweep's tail as
 * a function of the budget; every other point of that shape is compared with that curve, linearly interpolated, at
 * its own budget counted two ways: rows (the budget: rows fetched per indexed token) and bytes
 * (the budget plus half a row per extra key the second stage read: a key is half a row); and, in
 * a trace replay, at its simulated misses (the rows a step reads over PCIe through a hot cache:
 * what the selection's hysteresis, keep_weight, saves).
 */
#include "kvbench.h"

#include <math.h>
#include <stdlib.h>

static bool same_shape(const kb_result *a, const kb_result *b)
{
	return a->context == b->context && a->seqs == b->seqs && a->layers == b->layers;
}

bool kb_is_plain(const kb_result *r)
{
	return !r->topk && !r->correction && r->rescore == 0.0f && !r->budget_max &&
	       r->keep == 0.0f;
}

double kb_bytes_budget(const kb_result *r)
{
	return r->budget + 0.5 * (isfinite(r->rescore_k) ? r->rescore_k : 0.0);
}

/* The x a plain point is placed at: its budget, or its simulated misses. */
static double x_of(const kb_result *r, bool misses)
{
	return misses ? r->misses : r->budget;
}

static int cmp_x(const void *a, const void *b, bool misses)
{
	const double x = x_of(*(const kb_result *const *)a, misses),
		     y = x_of(*(const kb_result *const *)b, misses);
	return (x > y) - (x < y);
}

static int by_budget(const void *a, const void *b)
{
	return cmp_x(a, b, false);
}

static int by_misses(const void *a, const void *b)
{
	return cmp_x(a, b, true);
}

static uint32_t sweep_at(const kb_result *r, uint32_t n, const kb_result *shape, double at,
			 bool misses, kb_tail *out)
{
	const kb_result **p = xcalloc(n ? n : 1, sizeof *p);
	uint32_t m = 0;
	for (uint32_t i = 0; i < n; i++)
		if (kb_is_plain(&r[i]) && same_shape(&r[i], shape) && isfinite(x_of(&r[i], misses)))
			p[m++] = &r[i];
	qsort(p, m, sizeof *p, misses ? by_misses : by_budget);
	*out = (kb_tail){NAN, NAN, NAN};
	for (uint32_t i = 0; i + 1 < m && isfinite(at); i++) {
		const double b0 = x_of(p[i], misses), b1 = x_of(p[i + 1], misses);
		if (at < b0 || at > b1 || b1 <= b0)
			continue;
		const double t = (at - b0) / (b1 - b0);
		out->p5 = p[i]->recall_p5 + t * (p[i + 1]->recall_p5 - p[i]->recall_p5);
		out->p1 = p[i]->recall_p1 + t * (p[i + 1]->recall_p1 - p[i]->recall_p1);
		out->min = p[i]->recall_min + t * (p[i + 1]->recall_min - p[i]->recall_min);
		break;
	}
	if (m == 1 && at == x_of(p[0], misses)) /* a single point: only its own x */
		*out = (kb_tail){p[0]->recall_p5, p[0]->recall_p1, p[0]->recall_min};
	free(p);
	return m;
}

uint32_t kb_sweep_at(const kb_result *r, uint32_t n, const kb_result *shape, double budget,
		     kb_tail *out)
{
	return sweep_at(r, n, shape, budget, false, out);
}

uint32_t kb_sweep_at_misses(const kb_result *r, uint32_t n, const kb_result *shape,
			    double misses, kb_tail *out)
{
	return sweep_at(r, n, shape, misses, true, out);
}

/* One comparison's cells: the method's value and its lead over the sweep (blank outside it). */
static void lead(double mine, double sweep)
{
	if (isfinite(sweep))
		printf(" %+7.3f", mine - sweep);
	else
		printf(" %7s", "-");
}

static void jnum(const char *name, double v, bool comma)
{
	if (isfinite(v))
		printf("\"%s\": %.6g%s", name, v, comma ? ", " : "");
	else
		printf("\"%s\": null%s", name, comma ? ", " : "");
}

uint32_t kb_print_vs_sweep(const kb_result *r, uint32_t n, bool json)
{
	uint32_t shown = 0;
	for (uint32_t i = 0; i < n; i++) {
		kb_tail rows, bytes;
		if (kb_is_plain(&r[i]) || kb_sweep_at(r, n, &r[i], r[i].budget, &rows) < 2)
			continue;
		kb_tail miss;
		kb_sweep_at(r, n, &r[i], kb_bytes_budget(&r[i]), &bytes);
		kb_sweep_at_misses(r, n, &r[i], r[i].misses, &miss);
		const bool traced = isfinite(r[i].misses); /* a trace replay's: misses simulated */
		if (json) {
			printf("%s{\"context\": %u, \"seqs\": %u, \"p\": %.6g, \"topk\": %u, "
			       "\"correction\": %u, \"rescore\": %.6g, \"budget_max\": %u, "
			       "\"keep\": %.6g, ",
			       shown ? ", " : "", r[i].context, r[i].seqs, (double)r[i].p, r[i].topk,
			       r[i].correction, (double)r[i].rescore, r[i].budget_max,
			       (double)r[i].keep);
			jnum("budget_rows", r[i].budget, true);
			jnum("budget_bytes", kb_bytes_budget(&r[i]), true);
			jnum("recall_p5", r[i].recall_p5, true);
			jnum("recall_p1", r[i].recall_p1, true);
			jnum("recall_min", r[i].recall_min, true);
			jnum("sweep_p5_at_rows", rows.p5, true);
			jnum("sweep_p1_at_rows", rows.p1, true);
			jnum("sweep_min_at_rows", rows.min, true);
			jnum("sweep_p5_at_bytes", bytes.p5, true);
			jnum("sweep_p1_at_bytes", bytes.p1, true);
			jnum("sweep_min_at_bytes", bytes.min, traced);
			if (traced) {
				jnum("misses", r[i].misses, true);
				jnum("sweep_p5_at_misses", miss.p5, true);
				jnum("sweep_p1_at_misses", miss.p1, true);
				jnum("sweep_min_at_misses", miss.min, false);
			}
			printf("}");
		} else {
			if (!shown)
				printf("\nagainst the p-sweep at equal budget (the plain-p points of the same "
				       "shape, linear between them; rows: the budget; bytes: the budget plus "
				       "half a row per extra key read;%s '-': outside the sweep's budgets)\n"
				       "context seqs  method                          rows   bytes     p5 "
				       "  @rows  @bytes     p1   @rows  @bytes    min   @rows  @bytes%s\n",
				       traced ? " misses: the rows a step reads over PCIe through a "
						"simulated hot cache of a quarter of a layer's rows, per "
						"row;" : "",
				       traced ? "   misses   @m:p5   @m:p1  @m:min" : "");
			char m[64];
			if (r[i].topk)
				snprintf(m, sizeof m, "topk k=%u", r[i].topk);
			else if (r[i].keep != 0.0f)
				snprintf(m, sizeof m, "p=%.3g corr=%u rs=%.3g keep=%.3g", (double)r[i].p,
					 r[i].correction, (double)r[i].rescore, (double)r[i].keep);
			else if (r[i].budget_max)
				snprintf(m, sizeof m, "p=%.3g corr=%u rs=%.3g bmax=%u", (double)r[i].p,
					 r[i].correction, (double)r[i].rescore, r[i].budget_max);
			else
				snprintf(m, sizeof m, "p=%.3g corr=%u rescore=%.3g", (double)r[i].p,
					 r[i].correction, (double)r[i].rescore);
			printf("%7u %4u  %-30s %6.4f %6.4f %6.3f", r[i].context, r[i].seqs, m,
			       r[i].budget, kb_bytes_budget(&r[i]), r[i].recall_p5);
			lead(r[i].recall_p5, rows.p5);
			lead(r[i].recall_p5, bytes.p5);
			printf(" %6.3f", r[i].recall_p1);
			lead(r[i].recall_p1, rows.p1);
			lead(r[i].recall_p1, bytes.p1);
			printf(" %6.3f", r[i].recall_min);
			lead(r[i].recall_min, rows.min);
			lead(r[i].recall_min, bytes.min);
			if (traced) {
				printf(" %8.5f", r[i].misses);
				lead(r[i].recall_p5, miss.p5);
				lead(r[i].recall_p1, miss.p1);
				lead(r[i].recall_min, miss.min);
			}
			printf("\n");
		}
		shown++;
	}
	return shown;
}
