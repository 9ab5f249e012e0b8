/* SPDX-License-Identifier: MIT */
/*
 * The trace replay's report (doc/trace-format.md, "The replay"): per (layer, query head) the
 * recall's mean, minimum and low percentiles over the decode steps (the tail matters more than
 * the mean: one step that loses the point of a head is what a user sees), the budget and the
 * output error; per layer the same over its heads and what the fetch path did; a summary over
 * the layers replayed. A table, or one JSON object.
 */
#include "kvbench_trace.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "constants.h" /* KVT_GPU_HOT_WAYS */

typedef struct fig {
	double recall_sum, recall_min, budget_sum, err2, full2, err_max;
	double p5_min, p1_min;  /* the lowest per-head percentiles */
	uint64_t n, kv_n;
	tfetch f;               /* the fetch path, summed over the layers */
} fig;

static double rel_err(double e2, double f2)
{
	return f2 > 0 ? sqrt(e2 / f2) : sqrt(e2);
}

/* The 5th and 1st percentiles of one head's recall over the steps (low_percentiles). */
static void percentiles(const kb_trace *t, uint32_t l, uint32_t h, double pct[2])
{
	const uint32_t S = t->m.decode_steps;
	double *v = xcalloc(S, sizeof(double));
	memcpy(v, t->recall + ((size_t)l * t->m.n_q_heads + h) * S, S * sizeof(double));
	low_percentiles(v, S, pct);
	free(v);
}

/* The 5th and 1st percentiles of every recall of layer l (UINT32_MAX: of every replayed layer),
 * pooled over its query heads and steps: the tail of the whole run, as kvbench's default reports. */
static void pooled(const kb_trace *t, uint32_t l, double pct[2])
{
	const size_t S = t->m.decode_steps, H = t->m.n_q_heads;
	double *v = xcalloc(t->m.n_layers * H * S + 1, sizeof(double));
	size_t n = 0;
	for (uint32_t i = 0; i < t->m.n_layers; i++)
		if (t->sel[i] && (l == UINT32_MAX || i == l)) {
			memcpy(v + n, t->recall + (size_t)i * H * S, H * S * sizeof(double));
			n += H * S;
		}
	low_percentiles(v, n, pct);
	free(v);
}

static void fig_head(fig *f, const hacc *a, const double pct[2])
{
	f->recall_sum += a->recall_sum;
	f->recall_min = a->recall_min < f->recall_min ? a->recall_min : f->recall_min;
	f->err2 += a->err2;
	f->full2 += a->full2;
	f->n += a->n;
	double e = rel_err(a->err2, a->full2);
	f->err_max = e > f->err_max ? e : f->err_max;
	f->p5_min = pct[0] < f->p5_min ? pct[0] : f->p5_min;
	f->p1_min = pct[1] < f->p1_min ? pct[1] : f->p1_min;
}

static void fetch_add(tfetch *to, const tfetch *x)
{
	to->steps += x->steps;
	to->hot_hits += x->hot_hits;
	to->hot_misses += x->hot_misses;
	to->pcie_bytes += x->pcie_bytes;
	to->nvme_bytes += x->nvme_bytes;
	to->nvme_reads += x->nvme_reads;
	to->candidates += x->candidates;
	to->rescored_unselected += x->rescored_unselected;
	to->step_ms += x->step_ms;
}

/* Figures of layer l, or of every replayed layer with l = UINT32_MAX. */
static fig figures(const kb_trace *t, uint32_t l)
{
	fig f = {.recall_min = INFINITY, .p5_min = INFINITY, .p1_min = INFINITY};
	for (uint32_t i = 0; i < t->m.n_layers; i++) {
		if (!t->sel[i] || (l != UINT32_MAX && i != l))
			continue;
		for (uint32_t h = 0; h < t->m.n_q_heads; h++) {
			double pct[2];
			percentiles(t, i, h, pct);
			fig_head(&f, &t->heads[(size_t)i * t->m.n_q_heads + h], pct);
		}
		for (uint32_t h = 0; h < t->m.n_kv_heads; h++) {
			f.budget_sum += t->kvs[(size_t)i * t->m.n_kv_heads + h].budget_sum;
			f.kv_n += t->kvs[(size_t)i * t->m.n_kv_heads + h].n;
		}
		fetch_add(&f.f, &t->fetch[i]);
	}
	return f;
}

static double kv_budget(const kb_trace *t, uint32_t l, uint32_t h)
{
	const kacc *k = &t->kvs[(size_t)l * t->m.n_kv_heads + h];
	return k->n ? k->budget_sum / k->n : 0;
}

/* Hot-cache hit rate: NAN when nothing was looked up (the CPU backend has no hot cache). */
static double hit_rate(const tfetch *f)
{
	uint64_t n = f->hot_hits + f->hot_misses;
	return n ? (double)f->hot_hits / (double)n : NAN;
}

static double per_step(double x, const tfetch *f)
{
	return f->steps ? x / (double)f->steps : NAN;
}

static const char *time_source(const kb_trace *t)
{
	return t->device_time ? "cuda_events" : "wall";
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* A number, or null where there is none (a replay of one decode step has no hit rate). */
static void jval(double v)
{
	if (isfinite(v))
		printf("%.6g", v);
	else
		printf("null");
}

static void jnum(const char *key, double v)
{
	printf(", \"%s\": ", key);
	jval(v);
}

static void print_json_fetch(const tfetch *f)
{
	jnum("hot_hit_rate", hit_rate(f));
	jnum("pcie_bytes_per_step", per_step((double)f->pcie_bytes, f));
	jnum("nvme_bytes_per_step", per_step((double)f->nvme_bytes, f));
	jnum("nvme_reads_per_step", per_step((double)f->nvme_reads, f)); /* read I/Os */
	jnum("step_ms", per_step(f->step_ms, f));
	/* the second stage's extra key reads per indexed token (0 without --rescore) */
	jnum("rescore_k_frac",
	     f->candidates ? (double)f->rescored_unselected / (double)f->candidates : 0.0);
}

static void print_json_fig(const fig *f)
{
	printf("\"recall_mean\": %.6f, \"recall_min\": %.6f, \"budget_mean\": %.6f, "
	       "\"output_error\": %.6g, \"output_error_max\": %.6g",
	       f->n ? f->recall_sum / f->n : 0, f->n ? f->recall_min : 0,
	       f->kv_n ? f->budget_sum / f->kv_n : 0, rel_err(f->err2, f->full2), f->err_max);
}

static void print_json_head(const kb_trace *t, uint32_t l, uint32_t h)
{
	const hacc *a = &t->heads[(size_t)l * t->m.n_q_heads + h];
	double pct[2];
	percentiles(t, l, h, pct);
	printf("%s\n   {\"head\": %u, \"kv_head\": %u, \"recall_mean\": %.6f, \"recall_min\": %.6f, "
	       "\"budget_mean\": %.6f, \"output_error\": %.6g, \"recall_p5\": %.6f, \"recall_p1\": "
	       "%.6f}",
	       h ? "," : "", h, h / t->group, a->n ? a->recall_sum / a->n : 0,
	       a->n ? a->recall_min : 0, kv_budget(t, l, h / t->group), rel_err(a->err2, a->full2),
	       pct[0], pct[1]);
}

static void print_json_meta(const kb_trace *t)
{
	const trace_meta *m = &t->m;
	printf("{\"trace\": {\"dir\": ");
	jstr(t->o->trace_dir);
	printf(", \"model\": ");
	jstr(m->model);
	printf(", \"rope\": ");
	jstr(m->rope);
	printf(", \"n_layers\": %u, \"n_q_heads\": %u, \"n_kv_heads\": %u, \"head_dim\": %u, "
	       "\"dtype\": \"%s\", \"prefill_tokens\": %u, \"decode_steps\": %u, \"scale\": %.9g},\n",
	       m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim,
	       m->dtype == TRACE_F16 ? "float16" : "float32", m->prefill_tokens, m->decode_steps,
	       t->scale);
}

/* The simulated hot cache's hit rate at size k (kvbench_hotsim.c; KB_HOT_SELF and KB_HOT_DEMAND:
 * the self-sized ones), over the replayed layers. */
static double hot_sim_rate(const kb_trace *t, int k)
{
	return t->hot_reads[k] > 0 ? t->hot_hits[k] / t->hot_reads[k] : NAN;
}

/* The offline optimum's hit rate at the fixed size k, over the replayed layers. */
static double hot_sim_optimum(const kb_trace *t, int k)
{
	return t->hot_reads[k] > 0 ? t->hot_opt[k] / t->hot_reads[k] : NAN;
}

static double hot_sim_demand(const kb_trace *t)
{
	return t->hot_steps ? t->hot_demand / (double)t->hot_steps : NAN;
}

/* A self-sized cache's size after the last step (i 0: the rule's, 1: on demand alone), as a share
 * of a layer's rows (the mean over layers). */
static double hot_sim_self_share(const kb_trace *t, int i)
{
	return t->hot_layers ? t->hot_self_share[i] / t->hot_layers : NAN;
}

static void print_json_hot_sim(const kb_trace *t)
{
	printf(", \"hot_sim\": {\"demand_share\": ");
	jval(hot_sim_demand(t));
	printf(", \"share\": [");
	for (int k = 0; k < KB_HOT_SIZES; k++)
		printf("%s%.6g", k ? ", " : "", 1.0 / KB_HOT_DEN(k));
	printf("], \"hit_rate\": [");
	for (int k = 0; k < KB_HOT_SIZES; k++) {
		printf("%s", k ? ", " : "");
		jval(hot_sim_rate(t, k));
	}
	printf("], \"optimum_hit_rate\": [");
	for (int k = 0; k < KB_HOT_SIZES; k++) {
		printf("%s", k ? ", " : "");
		jval(hot_sim_optimum(t, k));
	}
	printf("], \"self_sized\": {\"share\": ");
	jval(hot_sim_self_share(t, 0));
	printf(", \"hit_rate\": ");
	jval(hot_sim_rate(t, KB_HOT_SELF));
	printf(", \"demand_only\": {\"share\": ");
	jval(hot_sim_self_share(t, 1));
	printf(", \"hit_rate\": ");
	jval(hot_sim_rate(t, KB_HOT_DEMAND));
	printf("}}}");
}

static void print_text_hot_sim(const kb_trace *t)
{
	printf("\nhot cache, simulated (the rows each step reads through it, sinks and "
	       "selected, kept by the CUDA backend's rule per layer, in sets of %u ways chosen by "
	       "its hash of the row; hits over the steps after the first): a step reads %.2f %% "
	       "of a layer's rows; a cache of", KVT_GPU_HOT_WAYS, 100.0 * hot_sim_demand(t));
	for (int k = 0; k < KB_HOT_SIZES; k++)
		printf(k ? ", 1/%u %.1f %%" : " 1/%u of them hits %.1f %%", KB_HOT_DEN(k),
		       100.0 * hot_sim_rate(t, k));
	printf("; the self-sized rule (gpu/hotsize.h) grows to %.1f %% of the rows and hits "
	       "%.1f %% (on demand alone, the rule before misses counted: %.1f %%, %.1f %%)",
	       100.0 * hot_sim_self_share(t, 0), 100.0 * hot_sim_rate(t, KB_HOT_SELF),
	       100.0 * hot_sim_self_share(t, 1), 100.0 * hot_sim_rate(t, KB_HOT_DEMAND));
	printf("; the offline optimum (the rows read again soonest: no cache of the size hits "
	       "more):");
	for (int k = 0; k < KB_HOT_SIZES; k++)
		printf("%s 1/%u %.1f %%", k ? "," : "", KB_HOT_DEN(k), 100.0 * hot_sim_optimum(t, k));
	printf("\n");
}

void trace_print_json(kb_trace *t, double wall)
{
	const trace_meta *m = &t->m;
	const opts *o = t->o;
	print_json_meta(t);
	printf(" \"config\": {\"backend\": \"%s\", \"dtype\": \"%s\", \"p\": %.6g, \"sinks\": %u, "
	       "\"window\": %u, \"flush\": %u, \"budget_min\": %u, \"budget_max\": %u, "
	       "\"correction\": %u, \"rescore\": %.6g, \"keep\": %.6g, \"keep_steps\": %u, "
	       "\"chunk\": %u, \"seed\": %" PRIu64 "},\n",
	       t->backend, o->dtype == KVT_DTYPE_BF16 ? "bf16" : "f16", (double)o->p, o->sinks,
	       o->window, o->flush, o->budget_min, o->budget_max, o->correction, (double)o->rescore,
	       (double)o->keep, o->keep != 0.0f ? o->keep_steps : 0, t->chunk, o->seed);
	printf(" \"layers\": [");
	bool first = true;
	for (uint32_t l = 0; l < m->n_layers; l++) {
		if (!t->sel[l])
			continue;
		fig f = figures(t, l);
		printf("%s\n  {\"layer\": %u, ", first ? "" : ",", l);
		print_json_fig(&f);
		printf(", \"heads\": [");
		for (uint32_t h = 0; h < m->n_q_heads; h++)
			print_json_head(t, l, h);
		printf("]");
		double pl[2];
		pooled(t, l, pl);
		jnum("recall_p5", pl[0]);
		jnum("recall_p1", pl[1]);
		jnum("recall_p5_worst_head", f.p5_min);
		jnum("recall_p1_worst_head", f.p1_min);
		print_json_fetch(&f.f);
		printf("}");
		first = false;
	}
	fig all = figures(t, UINT32_MAX);
	printf("],\n \"layers_replayed\": %u, ", t->n_sel);
	print_json_fig(&all);
	printf(", \"wall_s\": %.3f", wall);
	double pa[2];
	pooled(t, UINT32_MAX, pa);
	jnum("recall_p5", pa[0]);
	jnum("recall_p1", pa[1]);
	jnum("recall_p5_worst_head", all.p5_min);
	jnum("recall_p1_worst_head", all.p1_min);
	print_json_fetch(&all.f);
	print_json_hot_sim(t);
	printf(", \"step_time\": \"%s\"}\n", time_source(t));
}

/* ---- the table ------------------------------------------------------------------------------ */

static void print_text_head(const kb_trace *t, uint32_t l, uint32_t h)
{
	const hacc *a = &t->heads[(size_t)l * t->m.n_q_heads + h];
	double pct[2];
	percentiles(t, l, h, pct);
	printf("%6u %6u %4u  %11.4f %10.4f %11.4f %9.2e %9.4f %9.4f\n", l, h, h / t->group,
	       a->n ? a->recall_sum / a->n : 0, a->n ? a->recall_min : 0,
	       kv_budget(t, l, h / t->group), rel_err(a->err2, a->full2), pct[0], pct[1]);
}

/* The fetch path per layer: what crossed PCIe and was read from NVMe per decode step, the hot
 * cache's hit rate, and the time of a step's kvt_append + kvt_attend. */
static void print_text_fetch(const kb_trace *t)
{
	printf("\nfetch path per decode step (kvt_stats over the steps; time of kvt_append + "
	       "kvt_attend: %s)\n", t->device_time ? "device time, CUDA events" : "wall time");
	printf("%6s  %8s %14s %14s %9s\n", "layer", "hot_hit", "pcie_B/step", "nvme_B/step",
	       "ms/step");
	for (uint32_t l = 0; l <= t->m.n_layers; l++) {
		bool all = l == t->m.n_layers;
		if (!all && !t->sel[l])
			continue;
		fig f = figures(t, all ? UINT32_MAX : l);
		char name[16], hr[16];
		double h = hit_rate(&f.f);
		if (all)
			snprintf(name, sizeof name, "all");
		else
			snprintf(name, sizeof name, "%u", l);
		if (isfinite(h))
			snprintf(hr, sizeof hr, "%.4f", h);
		else
			snprintf(hr, sizeof hr, "-");
		printf("%6s  %8s %14.0f %14.0f %9.3f\n", name, hr,
		       per_step((double)f.f.pcie_bytes, &f.f), per_step((double)f.f.nvme_bytes, &f.f),
		       per_step(f.f.step_ms, &f.f));
	}
}

void trace_print_text(kb_trace *t, double wall)
{
	const trace_meta *m = &t->m;
	const opts *o = t->o;
	printf("trace %s: %s, %u layers (%u replayed), %u query heads, %u KV heads, head dim %u, "
	       "%s, %u prefill tokens, %u decode steps\n",
	       o->trace_dir, m->model, m->n_layers, t->n_sel, m->n_q_heads, m->n_kv_heads,
	       m->head_dim, m->dtype == TRACE_F16 ? "float16" : "float32", m->prefill_tokens,
	       m->decode_steps);
	printf("kvtier: %s backend, %s, p %g, sinks %u, window %u, flush %u, budget %u..%u%s, "
	       "correction %u, keep %g, scale %.6g\n\n",
	       t->backend, o->dtype == KVT_DTYPE_BF16 ? "bf16" : "f16", (double)o->p, o->sinks,
	       o->window, o->flush, o->budget_min, o->budget_max, o->budget_max ? "" : " (no cap)",
	       o->correction, (double)o->keep, t->scale);
	printf("%6s %6s %4s  %11s %10s %11s %9s %9s %9s\n", "layer", "head", "kv", "recall_mean",
	       "recall_min", "budget_mean", "out_err", "recall_p5", "recall_p1");
	for (uint32_t l = 0; l < m->n_layers; l++) {
		if (!t->sel[l])
			continue;
		for (uint32_t h = 0; h < m->n_q_heads && !o->quiet; h++)
			print_text_head(t, l, h);
		fig f = figures(t, l);
		double pl[2]; /* the layer's recalls pooled, as the JSON's recall_p5 and recall_p1 */
		pooled(t, l, pl);
		printf("%6u %6s %4s  %11.4f %10.4f %11.4f %9.2e %9.4f %9.4f\n", l, "all", "",
		       f.recall_sum / f.n, f.recall_min, f.kv_n ? f.budget_sum / f.kv_n : 0,
		       rel_err(f.err2, f.full2), pl[0], pl[1]);
	}
	print_text_fetch(t);
	print_text_hot_sim(t);
	fig all = figures(t, UINT32_MAX);
	double pa[2];
	pooled(t, UINT32_MAX, pa);
	printf("\nrecall mean %.4f, 5th percentile %.4f, 1st %.4f, min %.4f (over every head and "
	       "step); budget mean %.4f of the indexed tokens; output error %.2e (worst head "
	       "%.2e); %.1f s\n",
	       all.recall_sum / all.n, pa[0], pa[1], all.recall_min,
	       all.kv_n ? all.budget_sum / all.kv_n : 0, rel_err(all.err2, all.full2), all.err_max,
	       wall);
}

/* ---- a sweep over the selection's options ---------------------------------------------------- */

void trace_summary(const kb_trace *t, kb_result *r)
{
	const fig f = figures(t, UINT32_MAX);
	double pa[2];
	pooled(t, UINT32_MAX, pa);
	*r = (kb_result){.context = t->m.prefill_tokens, .seqs = 1, .layers = t->n_sel,
			 .p = t->o->p, .correction = t->o->correction,
			 .budget_max = t->o->budget_max, .rescore = t->o->rescore,
			 .keep = t->o->keep};
	/* the PCIe rows of a step through the simulated cache of a quarter of the rows */
	r->misses = hot_sim_demand(t) * (1.0 - hot_sim_rate(t, KB_HOT_QUARTER));
	r->rescore_k = f.f.candidates ? (double)f.f.rescored_unselected / (double)f.f.candidates
				      : 0.0;
	r->recall = f.n ? f.recall_sum / f.n : NAN;
	r->recall_min = f.n ? f.recall_min : NAN;
	r->recall_p5 = pa[0];
	r->recall_p1 = pa[1];
	r->budget = f.kv_n ? f.budget_sum / f.kv_n : NAN;
	r->oracle_budget = NAN;
	r->err = rel_err(f.err2, f.full2);
	r->step_ms = per_step(f.f.step_ms, &f.f);
	r->hit_rate = hit_rate(&f.f);
	r->pcie_step = per_step((double)f.f.pcie_bytes, &f.f);
}

void trace_print_sweep(const opts *o, const trace_meta *m, const char *backend, const opts *po,
		       const kb_result *r, uint32_t n)
{
	if (o->json) {
		printf("{\"trace\": {\"dir\": ");
		jstr(o->trace_dir);
		printf(", \"model\": ");
		jstr(m->model);
		printf(", \"prefill_tokens\": %u, \"decode_steps\": %u}, \"points\": [",
		       m->prefill_tokens, m->decode_steps);
		for (uint32_t i = 0; i < n; i++) {
			printf("%s{\"p\": %.6g, \"correction\": %u, \"rescore\": %.6g, "
			       "\"budget_max\": %u, \"keep\": %.6g",
			       i ? ", " : "", (double)r[i].p, r[i].correction, (double)r[i].rescore,
			       r[i].budget_max, (double)r[i].keep);
			jnum("budget_mean", r[i].budget);
			jnum("budget_bytes", kb_bytes_budget(&r[i]));
			jnum("rescore_k_frac", r[i].rescore_k);
			jnum("recall_mean", r[i].recall);
			jnum("recall_p5", r[i].recall_p5);
			jnum("recall_p1", r[i].recall_p1);
			jnum("recall_min", r[i].recall_min);
			jnum("output_error", r[i].err);
			jnum("misses", r[i].misses);
			jnum("step_ms", r[i].step_ms);
			printf("}");
		}
		printf("], \"vs_p_sweep\": [");
		kb_print_vs_sweep(r, n, true);
		printf("]}\n");
		return;
	}
	printf("trace %s: %s, %u prefill tokens, %u decode steps, %u layers replayed; %s backend, "
	       "sinks %u, window %u, flush %u, budget_min %u\n",
	       o->trace_dir, m->model, m->prefill_tokens, m->decode_steps, n ? r[0].layers : 0,
	       backend, o->sinks, o->window, o->flush, o->budget_min);
	printf("     p  corr rescore  bmax   keep  budget   bytes  recall    r_p5    r_p1   r_min  "
	       "out_err   misses  ms/step\n");
	for (uint32_t i = 0; i < n; i++)
		printf("%6.3g %5u %7.3g %5u %6.3g %7.4f %7.4f %7.4f %7.4f %7.4f %7.4f %8.2e %8.5f "
		       "%8.3f\n",
		       (double)r[i].p, r[i].correction, (double)r[i].rescore, po[i].budget_max,
		       (double)r[i].keep, r[i].budget, kb_bytes_budget(&r[i]), r[i].recall,
		       r[i].recall_p5, r[i].recall_p1, r[i].recall_min, r[i].err, r[i].misses,
		       r[i].step_ms);
	kb_print_vs_sweep(r, n, false);
}
