/* SPDX-License-Identifier: MIT */
/*
 * kvbench's output: the per-step table, the summary in words and the JSON object (doc/kvbench.md
 * defines every field). With an NVMe tier, the tiers' configuration and counters; with --capacity,
 * one record per phase.
 */
#include "kvbench.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *dtype_name(uint32_t dtype)
{
	return dtype == KVT_DTYPE_BF16 ? "bf16" : "f16";
}

static const char *spill_name(uint32_t policy)
{
	return policy == KVT_SPILL_LRU ? "lru" : "none";
}

static double mib(uint64_t bytes)
{
	return (double)bytes / 1048576.0;
}

/* Mean of a sum over n, NaN (printed as null or "-") when there is nothing to average. */
static double mean(double sum, uint64_t n)
{
	return n ? sum / (double)n : NAN;
}

/* ---- the table --------------------------------------------------------------------------- */

/* A cell of a table (the step rows, the phases): a figure (fixed or, with sci, exponent
 * notation), or "-" where the table has none. */
static void cell(double v, int width, int prec, bool sci)
{
	if (!isfinite(v))
		printf(" %*s", width, "-");
	else if (sci)
		printf(" %*.*e", width, prec, v);
	else
		printf(" %*.*f", width, prec, v);
}

void print_row(const kb_run *b, int step, const acc *a)
{
	double bud = mean(a->budget_sum, a->kv_n), orc = mean(a->oracle_sum, a->kv_n);
	if (step < 0)
		printf("  all");
	else
		printf("%5d", step);
	printf(" %9u  %.4f  %.4f ", b->o.context + (step < 0 ? b->steps_total : (uint32_t)step + 1),
	       mean(a->recall_sum, a->recall_n), a->recall_min);
	/* no token indexed: "-", not nan */
	cell(bud, 6, 4, false);
	printf(" ");
	cell(orc, 6, 4, false);
	printf(" ");
	cell(orc > 0 ? bud / orc : NAN, 5, 2, false);
	printf("  %.2e  %8.2f\n", sqrt(a->err2 / a->full2),
	       (double)a->ns / 1e6 / b->o.layers / (step < 0 ? b->steps_total : 1));
}

void print_header(const kb_run *b)
{
	const opts *o = &b->o;
	char h[32], k[32], f[32];
	kvt_stats st = {.size = sizeof(st)};
	int rc = kvt_get_stats(b->cache, &st);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
	printf("kvbench %s: %u query heads, %u KV heads, head_dim %u, %s; %u layers, %u seq, "
	       "context %u, %u decode steps; p %.3g, sinks %u, window %u, flush %u; backend %s\n",
	       kvt_version_string(), o->q_heads, o->kv_heads, o->head_dim, dtype_name(o->dtype),
	       o->layers, o->seqs, o->context, b->steps_total, (double)o->p, o->sinks, o->window,
	       o->flush, st.backend ? st.backend : "?");
	if (o->n_nvme)
		printf("tiers: K/V %s on a host tier of %s (x%.2f); NVMe %u file%s of %s, spill %s%s\n",
		       fmt_bytes(tier_kv_bytes(b), k, sizeof k),
		       fmt_bytes(st.host_bytes_capacity, h, sizeof h),
		       (double)tier_kv_bytes(b) / (double)st.host_bytes_capacity, o->n_nvme,
		       o->n_nvme > 1 ? "s" : "", fmt_bytes(b->nvme_sizes[0], f, sizeof f),
		       spill_name(o->spill), o->capacity ? "; phases: fill, decode_spilled, restore, "
							  "decode_restored" : "");
}

void print_columns(void)
{
	printf(" step    tokens  recall  r_min   budget  oracle  b/o    rel_err  ms/layer\n");
}

void print_phase_line(const phase *ph)
{
	const kvt_stats *e = &ph->st1, *s = &ph->st0;
	printf("-- %s: %.2f s; host %.1f of %.1f MiB, NVMe %.1f MiB; spills %" PRIu64
	       " (auto %" PRIu64 "), restores %" PRIu64, ph->name, (double)ph->ns / 1e9,
	       mib(e->host_bytes_used), mib(e->host_bytes_capacity), mib(e->nvme_bytes_used),
	       e->spills - s->spills, e->auto_spills - s->auto_spills, e->restores - s->restores);
	if (ph->restored >= 0)
		printf("; seq %u back, %.1f MiB", ph->restored_seq, mib((uint64_t)ph->restored));
	printf("\n");
}

/* ---- spread over heads ------------------------------------------------------------------- */

/* min, median, max over (layer, query head) of a per-head mean over sequences and steps */
static void spread(const kb_run *b, const double *sum, double out[3])
{
	size_t n = (size_t)b->o.layers * b->o.q_heads;
	double *v = xcalloc(n, sizeof(double));
	for (size_t i = 0; i < n; i++)
		v[i] = sum[i] / ((double)b->o.seqs * b->steps_total);
	qsort(v, n, sizeof(double), kb_cmp_double);
	out[0] = v[0];
	out[1] = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
	out[2] = v[n - 1];
	free(v);
}

/* The spread of the heads' oracle shares; NaN (null in the JSON) when no token was indexed. */
static void oracle_spread(const kb_run *b, double out[3])
{
	if (b->all.kv_n)
		spread(b, b->head_oracle, out);
	else
		out[0] = out[1] = out[2] = NAN;
}

/* ---- JSON -------------------------------------------------------------------------------- */


/* One JSON member: a number (integral values print as integers, non-finite ones as null) or, with
 * s set, a string. */
typedef struct jv {
	const char *k;
	double v;
	const char *s;
} jv;

static void jmembers(const jv *m, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		printf("%s\"%s\": ", i ? ", " : "", m[i].k);
		if (m[i].s)
			jstr(m[i].s);
		else if (!isfinite(m[i].v))
			printf("null");
		else if (m[i].v == floor(m[i].v) && fabs(m[i].v) < 9e15)
			printf("%.0f", m[i].v);
		else
			printf("%.6g", m[i].v);
	}
}

/* A member object (key NULL: an array element), followed by a comma when `more`. */
#define JOBJ(key, more, ...)                                                                       \
	do {                                                                                       \
		const jv m_[] = {__VA_ARGS__};                                                     \
		const char *k_ = (key);                                                            \
		if (k_)                                                                            \
			printf("\"%s\": ", k_);                                                    \
		printf("{");                                                                       \
		jmembers(m_, sizeof(m_) / sizeof(m_[0]));                                          \
		printf("}%s", (more) ? ", " : "");                                                 \
	} while (0)

static void json_stages(const char *key, const kvt_stats *e, const kvt_stats *s, double div)
{
	JOBJ(key, true, {"index", (double)(e->ns_index - s->ns_index) / 1e6 / div, NULL},
	     {"store", (double)(e->ns_store - s->ns_store) / 1e6 / div, NULL},
	     {"score", (double)(e->ns_score - s->ns_score) / 1e6 / div, NULL},
	     {"select", (double)(e->ns_select - s->ns_select) / 1e6 / div, NULL},
	     {"attend", (double)(e->ns_attend - s->ns_attend) / 1e6 / div, NULL});
}

static void json_per_step(const kb_run *b)
{
	printf("\"per_step\": [");
	for (uint32_t i = 0; i < b->steps_total; i++) {
		const acc *a = &b->step[i];
		JOBJ(NULL, i + 1 < b->steps_total, {"step", i, NULL},
		     {"recall_mean", mean(a->recall_sum, a->recall_n), NULL},
		     {"recall_min", a->recall_min, NULL},
		     {"budget_mean", mean(a->budget_sum, a->kv_n), NULL},
		     {"oracle_budget_mean", mean(a->oracle_sum, a->kv_n), NULL},
		     {"output_rel_err", sqrt(a->err2 / a->full2), NULL},
		     {"ms_per_layer", (double)a->ns / 1e6 / b->o.layers, NULL});
	}
	printf("]");
}

enum { N_TIER = 13 };

/* What each tier holds at snapshot e, and what moved since snapshot s. */
static void tier_members(const kvt_stats *e, const kvt_stats *s, jv m[N_TIER])
{
	const jv t[N_TIER] = {
		{"host_bytes_used", (double)e->host_bytes_used, NULL},
		{"host_bytes_capacity", (double)e->host_bytes_capacity, NULL},
		{"nvme_bytes_used", (double)e->nvme_bytes_used, NULL},
		{"nvme_bytes_capacity", (double)e->nvme_bytes_capacity, NULL},
		{"nvme_bytes_written", (double)(e->nvme_bytes_written - s->nvme_bytes_written), NULL},
		{"nvme_bytes_read", (double)(e->nvme_bytes_read - s->nvme_bytes_read), NULL},
		{"nvme_reads", (double)(e->nvme_reads - s->nvme_reads), NULL},
		{"nvme_cache_hits", (double)(e->nvme_cache_hits - s->nvme_cache_hits), NULL},
		{"nvme_cache_misses", (double)(e->nvme_cache_misses - s->nvme_cache_misses), NULL},
		{"spills", (double)(e->spills - s->spills), NULL},
		{"restores", (double)(e->restores - s->restores), NULL},
		{"auto_spills", (double)(e->auto_spills - s->auto_spills), NULL},
		{"ns_nvme", (double)(e->ns_nvme - s->ns_nvme), NULL},
	};
	memcpy(m, t, sizeof(t));
}

/* Members m, then the tier members of (e, s). */
static void jmembers_tiers(const jv *m, size_t n, const kvt_stats *e, const kvt_stats *s)
{
	jv t[N_TIER];
	tier_members(e, s, t);
	jmembers(m, n);
	printf(", ");
	jmembers(t, N_TIER);
}

static void json_tiers(const kb_run *b)
{
	const opts *o = &b->o;
	const kvt_stats *e = &b->st_end;
	double kv = (double)tier_kv_bytes(b);
	const jv m[] = {{"mode", 0, o->capacity ? "capacity" : "standard"},
			{"spill_policy", 0, spill_name(o->spill)}, {"kv_bytes", kv, NULL},
			{"kv_over_host", kv / (double)e->host_bytes_capacity, NULL},
			{"nvme_files", o->n_nvme, NULL},
			{"nvme_bytes_per_file", (double)b->nvme_sizes[0], NULL},
			{"nvme_queue_depth", o->nvme_qd, NULL},
			{"nvme_cache_bytes", (double)o->nvme_cache, NULL}};
	/* the paths first: jmembers has no arrays */
	printf("\"tiers\": {\"nvme_paths\": [");
	for (uint32_t i = 0; i < o->n_nvme; i++) {
		printf("%s", i ? ", " : "");
		jstr(o->nvme_paths[i]);
	}
	printf("], ");
	jmembers_tiers(m, sizeof(m) / sizeof(m[0]), e, &(kvt_stats){0});
	printf("}, ");
}

/* --baselines: each baseline's budget, recall and output error over the run, under the names of
 * the sweep's columns (oracle_topp_budget ...). */
static void json_baselines(const kb_run *b)
{
	static const char *const what[3] = {"budget", "recall", "err"};
	printf("\"baselines\": {");
	for (int i = 0; i < KB_N_BASE; i++) {
		const bacc *x = base_acc(b->base, i);
		const double v[3] = {mean(x->budget_sum, x->kv_n), mean(x->recall_sum, x->recall_n),
				     x->full2 > 0 ? sqrt(x->err2 / x->full2) : NAN};
		for (int k = 0; k < 3; k++) {
			char key[64];
			snprintf(key, sizeof key, "%s_%s", kb_base_names[i], what[k]);
			jmembers(&(jv){key, v[k], NULL}, 1);
			printf("%s", i + 1 < KB_N_BASE || k < 2 ? ", " : "");
		}
	}
	printf("}, ");
}

/* The second stage's extra reads over the decode steps (e minus s): keys of indexed tokens it read
 * and the step did not select, per indexed token scored. */
static double rescore_k_frac(const kvt_stats *e, const kvt_stats *s)
{
	const uint64_t n = e->candidate_tokens - s->candidate_tokens;
	return n ? (double)(e->rescored_unselected - s->rescored_unselected) / (double)n : 0.0;
}

/* Hot-cache hit rate of the decode steps (NAN when nothing was looked up: the CPU backend). */
static double hit_rate(const kvt_stats *e, const kvt_stats *s)
{
	double h = (double)(e->hot_hits - s->hot_hits), m = (double)(e->hot_misses - s->hot_misses);
	return h + m > 0 ? h / (h + m) : NAN;
}

/* The figures of a phase's decode steps into *a; returns its (step, layer) count. */
static double phase_acc(const kb_run *b, const phase *ph, acc *a)
{
	acc_init(a);
	for (uint32_t i = ph->step0; i < ph->step0 + ph->steps; i++)
		acc_add(a, &b->step[i]);
	return (double)ph->steps * b->o.layers;
}

/* What a phase's fetch path did, per decode step (NAN where it has none, or the backend does not
 * count it): the phase's counter deltas divided by its steps. */
typedef struct phase_fetch {
	double step_ms, layer_ms; /* append + attend per step (all layers), per (step, layer) */
	double hot_hit;           /* hot cache: rows served / rows looked up (CUDA backend) */
	double bcache_hit;        /* block cache: nvme_cache_hits / (hits + misses) */
	double nvme_bytes, nvme_reads, pcie_bytes; /* per step */
} phase_fetch;

/* The phase's quality figures into *a (phase_acc) and its fetch path into *f. */
static void phase_fetch_of(const kb_run *b, const phase *ph, acc *a, phase_fetch *f)
{
	phase_acc(b, ph, a);
	const kvt_stats *e = &ph->st1, *s = &ph->st0;
	double n = ph->steps ? (double)ph->steps : NAN;
	double h = (double)(e->nvme_cache_hits - s->nvme_cache_hits);
	double m = (double)(e->nvme_cache_misses - s->nvme_cache_misses);
	*f = (phase_fetch){
		.step_ms = (double)a->ns / 1e6 / n,
		.layer_ms = (double)a->ns / 1e6 / (n * b->o.layers),
		.hot_hit = ph->steps ? hit_rate(e, s) : NAN,
		.bcache_hit = h + m > 0 ? h / (h + m) : NAN,
		.nvme_bytes = (double)(e->nvme_bytes_read - s->nvme_bytes_read) / n,
		.nvme_reads = (double)(e->nvme_reads - s->nvme_reads) / n,
		.pcie_bytes = (double)(e->pcie_bytes - s->pcie_bytes) / n,
	};
}

static void json_phases(const kb_run *b, const kb_phases *ps)
{
	printf("\"phases\": [");
	for (uint32_t i = 0; i < ps->n; i++) {
		const phase *ph = &ps->ph[i];
		acc a;
		phase_fetch f;
		phase_fetch_of(b, ph, &a, &f);
		bool rs = ph->restored >= 0;
		const jv m[] = {{"name", 0, ph->name}, {"wall_s", (double)ph->ns / 1e9, NULL},
			{"library_ms", (double)ph->ns_lib / 1e6, NULL}, {"steps", ph->steps, NULL},
			{"step_ms_per_layer", f.layer_ms, NULL}, {"step_ms", f.step_ms, NULL},
			{"hot_hit_rate", f.hot_hit, NULL}, {"nvme_cache_hit_rate", f.bcache_hit, NULL},
			{"nvme_bytes_read_per_step", f.nvme_bytes, NULL},
			{"nvme_reads_per_step", f.nvme_reads, NULL},
			{"pcie_bytes_per_step", f.pcie_bytes, NULL},
			{"recall_mean", mean(a.recall_sum, a.recall_n), NULL},
			{"recall_min", a.recall_n ? a.recall_min : NAN, NULL},
			{"budget_mean", mean(a.budget_sum, a.kv_n), NULL},
			{"oracle_budget_mean", mean(a.oracle_sum, a.kv_n), NULL},
			{"budget_over_oracle", a.oracle_sum > 0 ? a.budget_sum / a.oracle_sum : NAN, NULL},
			{"output_rel_err", a.full2 > 0 ? sqrt(a.err2 / a.full2) : NAN, NULL},
			{"needles_asked", ph->steps ? (double)a.needles : NAN, NULL},
			{"needles_found", ph->steps ? (double)a.needles_found : NAN, NULL},
			{"restored_seq", rs ? (double)ph->restored_seq : NAN, NULL},
			{"restored_bytes", rs ? (double)ph->restored : NAN, NULL}};
		printf("{");
		jmembers_tiers(m, sizeof(m) / sizeof(m[0]), &ph->st1, &ph->st0);
		printf("}%s", i + 1 < ps->n ? ", " : "");
	}
	printf("], ");
}

/* Median over the decode steps of the time per step per layer (ms): unlike the mean, it leaves out
 * a first step's one-time costs (scratch sized for the batch, a cold hot cache). */
static double step_median_ms(const kb_run *b)
{
	uint32_t n = b->steps_total;
	if (!n || !b->o.layers)
		return NAN;
	double *t = xcalloc(n, sizeof(double));
	for (uint32_t i = 0; i < n; i++)
		t[i] = (double)b->step[i].ns / 1e6 / b->o.layers;
	for (uint32_t i = 1; i < n; i++) /* insertion sort: a few hundred steps at most */
		for (uint32_t j = i; j > 0 && t[j - 1] > t[j]; j--) {
			double x = t[j];
			t[j] = t[j - 1];
			t[j - 1] = x;
		}
	double m = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
	free(t);
	return m;
}

void print_json(const kb_run *b, const kb_phases *ps, double wall)
{
	const opts *o = &b->o;
	const kvt_stats *e = &b->st_end, *s0 = &b->st_prefill;
	const double steps = b->steps_total ? (double)b->steps_total : 1.0;
	const acc *a = &b->all;
	double sl = (double)b->steps_total * o->layers, ho[3], he[3], p5, p1;
	oracle_spread(b, ho);
	run_percentiles(b, &p5, &p1);
	spread(b, b->head_eff, he);
	const jv top[] = {{"library_version", 0, kvt_version_string()}, {"p", o->p, NULL},
	     {"index_bytes_per_token_head", (double)e->index_bytes_per_token_head, NULL},
	     {"index_overhead", (double)e->index_bytes_per_token_head / (2.0 * b->d * 2), NULL},
	     {"recall_mean", mean(a->recall_sum, a->recall_n), NULL}, {"recall_min", a->recall_min, NULL},
	     {"recall_p5", p5, NULL}, {"recall_p1", p1, NULL},
	     {"recall_below_half", mean((double)a->recall_low, a->recall_n), NULL},
	     {"budget_mean", mean(a->budget_sum, a->kv_n), NULL},
	     {"oracle_budget_mean", mean(a->oracle_sum, a->kv_n), NULL},
	     {"budget_over_oracle", a->oracle_sum > 0 ? a->budget_sum / a->oracle_sum : NAN, NULL},
	     {"rescore_k_frac", rescore_k_frac(e, s0), NULL},
	     {"output_rel_err", sqrt(a->err2 / a->full2), NULL},
	     {"needles_asked", (double)a->needles, NULL},
	     {"needles_found", (double)a->needles_found, NULL},
	     {"prefill_ms", (double)b->ns_prefill / 1e6, NULL},
	     {"step_ms_per_layer", (double)a->ns / 1e6 / sl, NULL},
	     {"step_ms_per_layer_median", step_median_ms(b), NULL},
	     {"gather_ms_per_layer", (double)b->ns_gather / 1e6 / sl, NULL},
	     {"tokens", (double)e->tokens, NULL}, {"tokens_indexed", (double)e->tokens_indexed, NULL},
	     {"index_bytes", (double)e->index_bytes, NULL},
	     {"host_bytes_used", (double)e->host_bytes_used, NULL},
	     {"host_bytes_capacity", (double)e->host_bytes_capacity, NULL},
	     {"host_placement", 0, e->host_placement ? e->host_placement : ""},
	     {"host_numa_node", (double)e->host_numa_node, NULL},
	     {"host_pinned", (double)e->host_pinned, NULL},
	     {"backend_used", 0, e->backend ? e->backend : ""},
	     {"budget_max_hits", (double)e->budget_max_hits, NULL},
	     {"budget_min_hits", (double)e->budget_min_hits, NULL},
	     {"flushes", (double)e->flushes, NULL},
	     {"selected_tokens", (double)e->selected_tokens, NULL},
	     {"candidate_tokens", (double)e->candidate_tokens, NULL},
	     {"rows_fetched", (double)e->rows_fetched, NULL},
	     {"bytes_fetched", (double)e->bytes_fetched, NULL},
	     {"hot_hit_rate", hit_rate(e, s0), NULL},
	     {"pcie_bytes_per_step", (double)(e->pcie_bytes - s0->pcie_bytes) / steps, NULL},
	     {"wall_s", wall, NULL}};
	printf("{");
	jmembers(top, sizeof(top) / sizeof(top[0]));
	printf(", ");
	JOBJ("config", true, {"q_heads", o->q_heads, NULL}, {"kv_heads", o->kv_heads, NULL},
	     {"head_dim", o->head_dim, NULL}, {"dtype", 0, dtype_name(o->dtype)},
	     {"context", o->context, NULL}, {"steps", o->steps, NULL}, {"layers", o->layers, NULL},
	     {"seqs", o->seqs, NULL}, {"seed", (double)o->seed, NULL},
	     {"backend", 0, e->backend ? e->backend : "?"}, {"chunk", o->chunk, NULL},
	     {"sinks", o->sinks, NULL}, {"window", o->window, NULL}, {"flush", o->flush, NULL},
	     {"budget_min", o->budget_min, NULL}, {"budget_max", o->budget_max, NULL},
	     {"correction", o->correction, NULL}, {"rescore", o->rescore, NULL},
	     {"keep", o->keep, NULL},
	     {"keep_steps", o->keep != 0.0f ? o->keep_steps : 0, NULL}); /* as applied */
	JOBJ("heads", true, {"count", (double)o->layers * o->q_heads, NULL},
	     {"oracle_budget_min", ho[0], NULL}, {"oracle_budget_median", ho[1], NULL},
	     {"oracle_budget_max", ho[2], NULL}, {"eff_tokens_min", he[0], NULL},
	     {"eff_tokens_median", he[1], NULL}, {"eff_tokens_max", he[2], NULL});
	json_stages("stage_ms", e, &(kvt_stats){0}, 1.0);
	json_stages("decode_stage_ms_per_step_layer", e, &b->st_prefill, sl);
	if (o->n_nvme)
		json_tiers(b);
	if (ps && ps->n)
		json_phases(b, ps);
	if (b->base)
		json_baselines(b);
	json_per_step(b);
	printf("}\n");
}

/* ---- the summary in words ---------------------------------------------------------------- */

static void summary_phases(const kb_run *b, const kb_phases *ps)
{
	printf("phase              wall_s    lib_ms  ms/layer  recall  budget   b/o  rel_err\n");
	for (uint32_t i = 0; i < ps->n; i++) {
		const phase *ph = &ps->ph[i];
		acc a;
		double sl = phase_acc(b, ph, &a);
		printf("%-16s %8.2f %9.1f", ph->name, (double)ph->ns / 1e9, (double)ph->ns_lib / 1e6);
		cell(sl ? (double)a.ns / 1e6 / sl : NAN, 9, 2, false);
		cell(mean(a.recall_sum, a.recall_n), 7, 4, false);
		cell(mean(a.budget_sum, a.kv_n), 7, 4, false);
		cell(a.oracle_sum > 0 ? a.budget_sum / a.oracle_sum : NAN, 5, 2, false);
		cell(a.full2 > 0 ? sqrt(a.err2 / a.full2) : NAN, 8, 2, true);
		printf("\n");
	}
	printf("phase            host MiB used/cap  NVMe MiB used/cap  written   read MiB    reads"
	       "  cache hit/miss  spills auto restores  nvme_ms\n");
	for (uint32_t i = 0; i < ps->n; i++) {
		const kvt_stats *e = &ps->ph[i].st1, *s = &ps->ph[i].st0;
		printf("%-16s %8.1f/%-8.1f %8.1f/%-8.1f %8.1f %8.1f %9" PRIu64 " %8" PRIu64
		       "/%-7" PRIu64 " %5" PRIu64 " %4" PRIu64 " %8" PRIu64 " %8.1f\n",
		       ps->ph[i].name, mib(e->host_bytes_used), mib(e->host_bytes_capacity),
		       mib(e->nvme_bytes_used), mib(e->nvme_bytes_capacity),
		       mib(e->nvme_bytes_written - s->nvme_bytes_written),
		       mib(e->nvme_bytes_read - s->nvme_bytes_read), e->nvme_reads - s->nvme_reads,
		       e->nvme_cache_hits - s->nvme_cache_hits,
		       e->nvme_cache_misses - s->nvme_cache_misses, e->spills - s->spills,
		       e->auto_spills - s->auto_spills, e->restores - s->restores,
		       (double)(e->ns_nvme - s->ns_nvme) / 1e6);
	}
}

/* The fetch path per decode step of each phase ("-" where it has none). */
static void summary_fetch(const kb_run *b, const kb_phases *ps)
{
	printf("phase             ms/step  ms/layer  hot_hit  bcache_hit  NVMe MiB/step  reads/step"
	       "  PCIe MiB/step\n");
	for (uint32_t i = 0; i < ps->n; i++) {
		const phase *ph = &ps->ph[i];
		acc a;
		phase_fetch f;
		phase_fetch_of(b, ph, &a, &f);
		printf("%-16s", ph->name);
		cell(f.step_ms, 8, 2, false);
		cell(f.layer_ms, 9, 2, false);
		cell(f.hot_hit, 8, 4, false);
		cell(f.bcache_hit, 11, 4, false);
		cell(f.nvme_bytes / 1048576.0, 14, 3, false);
		cell(f.nvme_reads, 11, 1, false);
		cell(ph->steps && isfinite(f.hot_hit) ? f.pcie_bytes / 1048576.0 : NAN, 14, 3, false);
		printf("\n");
	}
}

static void summary_tiers(const kb_run *b)
{
	const kvt_stats *e = &b->st_end;
	char k[32], h[32], n[32], c[32];
	char qd[48] = "the library's default queue depth";
	if (b->o.nvme_qd)
		snprintf(qd, sizeof(qd), "queue depth %u", b->o.nvme_qd);
	printf("tiers    K/V %s = %.2f x the host tier of %s; NVMe %s in %u file%s, %s, block cache "
	       "%s; spill %s\n",
	       fmt_bytes(tier_kv_bytes(b), k, sizeof k),
	       (double)tier_kv_bytes(b) / (double)e->host_bytes_capacity,
	       fmt_bytes(e->host_bytes_capacity, h, sizeof h),
	       fmt_bytes(e->nvme_bytes_capacity, n, sizeof n), b->o.n_nvme,
	       b->o.n_nvme > 1 ? "s" : "", qd,
	       fmt_bytes(b->o.nvme_cache, c, sizeof c), spill_name(b->o.spill));
	printf("nvme     written %.1f MiB, read %.1f MiB in %" PRIu64 " reads, block cache %" PRIu64
	       " hits / %" PRIu64 " misses; spills %" PRIu64 " (auto %" PRIu64 "), restores %" PRIu64
	       "; %.1f ms in NVMe I/O\n",
	       mib(e->nvme_bytes_written), mib(e->nvme_bytes_read), e->nvme_reads, e->nvme_cache_hits,
	       e->nvme_cache_misses, e->spills, e->auto_spills, e->restores,
	       (double)e->ns_nvme / 1e6);
}

void print_summary(const kb_run *b, const kb_phases *ps, double wall)
{
	const kvt_stats *e = &b->st_end, *s = &b->st_prefill;
	const acc *a = &b->all;
	double sl = (double)b->steps_total * b->o.layers, ho[3], he[3];
	double bud = mean(a->budget_sum, a->kv_n), orc = mean(a->oracle_sum, a->kv_n), p5, p1;
	oracle_spread(b, ho);
	run_percentiles(b, &p5, &p1);
	spread(b, b->head_eff, he);
	if (ps && ps->n) {
		summary_phases(b, ps);
		summary_fetch(b, ps);
	}
	printf("index    %" PRIu64 " B per token per KV head = %.2f%% of its K+V bytes (%u B)\n",
	       e->index_bytes_per_token_head,
	       100.0 * (double)e->index_bytes_per_token_head / (4.0 * b->d), 4 * b->d);
	printf("recall   mean %.4f, 5th percentile %.4f, 1st %.4f, min %.4f, below 0.5 for %.2f%% of "
	       "query heads x steps (exact softmax mass on the attended tokens)\n",
	       mean(a->recall_sum, a->recall_n), p5, p1, a->recall_min,
	       100.0 * mean((double)a->recall_low, a->recall_n));
	if (a->kv_n)
		printf("budget   %.4f of the indexed tokens fetched; exact Top-%.3g oracle %.4f "
		       "(x%.2f)\n", bud, (double)b->o.p, orc, bud / orc);
	else
		printf("budget   no token was indexed (context within sinks + window)\n");
	if (b->o.rescore != 0.0f)
		printf("rescore  second stage at Top-%.3g: keys read of %.4f of the indexed tokens "
		       "beyond those fetched\n",
		       (double)b->o.rescore, rescore_k_frac(e, &b->st_prefill));
	printf("output   relative L2 error %.3e; needles found %" PRIu64 " of %" PRIu64 "\n",
	       sqrt(a->err2 / a->full2), a->needles_found, a->needles);
	if (a->kv_n)
		printf("heads    oracle share min %.4f, median %.4f, max %.4f; ", ho[0], ho[1],
		       ho[2]);
	else
		printf("heads    ");
	printf("effective tokens (exp entropy) min %.0f, median %.0f, max %.0f\n", he[0], he[1],
	       he[2]);
	printf("time     prefill %.0f ms; decode %.2f ms per step per layer, median %.2f (index "
	       "%.2f, store %.2f, score %.2f, select %.2f, attend %.2f)\n",
	       (double)b->ns_prefill / 1e6, (double)a->ns / 1e6 / sl, step_median_ms(b),
	       (double)(e->ns_index - s->ns_index) / 1e6 / sl,
	       (double)(e->ns_store - s->ns_store) / 1e6 / sl,
	       (double)(e->ns_score - s->ns_score) / 1e6 / sl,
	       (double)(e->ns_select - s->ns_select) / 1e6 / sl,
	       (double)(e->ns_attend - s->ns_attend) / 1e6 / sl);
	if (e->hot_hits + e->hot_misses)
		printf("fetch    hot-cache hit rate %.4f; %.3f MiB over PCIe per decode step (all "
		       "layers and sequences)\n",
		       hit_rate(e, s),
		       mib(e->pcie_bytes - s->pcie_bytes) /
			       (b->steps_total ? (double)b->steps_total : 1.0));
	if (b->o.n_nvme)
		summary_tiers(b);
	printf("cache    %" PRIu64 " tokens, %" PRIu64 " indexed, host %.1f of %.1f MiB, budget_max "
	       "hits %" PRIu64 ", budget_min hits %" PRIu64 ", flushes %" PRIu64 "; wall %.1f s\n",
	       e->tokens, e->tokens_indexed, mib(e->host_bytes_used), mib(e->host_bytes_capacity),
	       e->budget_max_hits, e->budget_min_hits, e->flushes, wall);
}
