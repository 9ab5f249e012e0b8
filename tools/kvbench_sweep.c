/* SPDX-License-Identifier: MIT */
/*
 * --plan (the capacity arithmetic, then a scaled run), --sweep (every point of the crossed axes, a
 * progress bar on stderr, a table or JSON on stdout, CSV and SVG plots) and the baseline table
 * (--baselines). Each point is a standard run of its own cache (kvbench.c run_point).
 */
#include "kvbench.h"
#include "constants.h" /* KVT_GPU_HOT_AUTO_SHARE */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the progress bar -------------------------------------------------------------------- */

/* The sweep's own progress: one bar over every point, which each point's run reports into. */
typedef struct sweep_bar {
	bool on, tty;
	uint32_t i, n;
	double done_w, total_w, w; /* work of the points before this one, of all, of this one */
	uint64_t t0;
	int last_pct;
	char label[96];
} sweep_bar;

static void fmt_eta(double s, char *out, size_t n)
{
	if (!isfinite(s) || s < 0)
		snprintf(out, n, "?");
	else if (s >= 3600)
		snprintf(out, n, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
	else
		snprintf(out, n, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
}

/* Within a point, the prefill is counted as 40 % of its work and the decode as 60 %. */
static bool sweep_progress(void *ctx, const char *what, uint64_t done, uint64_t total)
{
	sweep_bar *bar = ctx;
	if (!bar->on)
		return false;
	bool dec = !strcmp(what, "decode");
	double in = (dec ? 0.4 + 0.6 * (double)done / total : 0.4 * (double)done / total);
	double frac = (bar->done_w + bar->w * in) / bar->total_w;
	double el = (double)(now_ns() - bar->t0) / 1e9;
	char eta[32];
	fmt_eta(frac > 0.001 ? el / frac - el : NAN, eta, sizeof eta);
	int pct = (int)(frac * 100);
	if (bar->tty) {
		char fill[21];
		int k = (int)(frac * 20);
		for (int j = 0; j < 20; j++)
			fill[j] = j < k ? '#' : '.';
		fill[20] = 0;
		fprintf(stderr, "\r\033[Kkvbench: [%s] %3d%% point %u/%u %s %s, ETA %s", fill, pct,
			bar->i + 1, bar->n, bar->label, what, eta);
		fflush(stderr);
	} else if (pct / 10 > bar->last_pct / 10) {
		bar->last_pct = pct;
		fprintf(stderr, "kvbench: sweep %d%% point %u/%u %s, ETA %s\n", pct, bar->i + 1, bar->n,
			bar->label, eta);
	}
	return true;
}

/* ---- the points -------------------------------------------------------------------------- */

uint32_t kb_parse_axes(const opts *o, kb_axis *ax)
{
	for (uint32_t a = 0; a < o->n_sweep; a++) {
		const char *eq = strchr(o->sweep[a], '=');
		snprintf(ax[a].name, sizeof ax[a].name, "%.*s", (int)(eq - o->sweep[a]), o->sweep[a]);
		ax[a].copy = strdup(eq + 1);
		if (!ax[a].copy)
			fail("out of memory", "--sweep");
		ax[a].n = 0;
		for (char *p = ax[a].copy, *next; p; p = next) {
			next = strchr(p, ',');
			if (next)
				*next++ = 0;
			if (!*p || ax[a].n == 64) {
				fprintf(stderr, "kvbench: --sweep %s: empty value or more than 64\n",
					o->sweep[a]);
				exit(2);
			}
			ax[a].vals[ax[a].n++] = p;
		}
	}
	return o->n_sweep;
}

bool kb_point_opts(const opts *o, const kb_axis *ax, uint32_t na, uint32_t idx, opts *po)
{
	*po = *o;
	po->n_sweep = 0;
	po->point = true;
	po->baselines = true;
	bool topk = false, p_later = false, rs = po->rescore != 0.0f, sel_axis = false;
	char flag[32];
	/* a Top-k point runs p = 1, where the second stage has nothing to do (and kvbench refuses
	 * the pair): such a point is skipped before its options are set */
	for (uint32_t a = 0, i = idx; a < na; i /= ax[a].n, a++) {
		const char *val = ax[a].vals[i % ax[a].n];
		topk |= !strcmp(ax[a].name, "topk") && strcmp(val, "0");
		rs = !strcmp(ax[a].name, "rescore") ? strtod(val, NULL) != 0.0 : rs; /* 0.0: off */
	}
	if (topk && rs)
		return false;
	topk = false;
	for (uint32_t a = 0; a < na; a++) {
		uint32_t v = idx % ax[a].n;
		idx /= ax[a].n;
		const char *val = ax[a].vals[v];
		if (!strcmp(ax[a].name, "topk") && !strcmp(val, "0"))
			continue;
		topk |= !strcmp(ax[a].name, "topk");
		p_later |= !strcmp(ax[a].name, "p") && v > 0;
		sel_axis |= !strcmp(ax[a].name, "p") || !strcmp(ax[a].name, "rescore");
		snprintf(flag, sizeof flag, "--%.20s", ax[a].name);
		opts_set(po, flag, val);
	}
	/* the second stage takes rescore_p in (p, 1] (kvt_config): where the axes cross into a pair
	 * outside it, that point is left out, saying so, rather than failing the sweep there */
	if (sel_axis && po->rescore != 0.0f && po->rescore <= po->p) {
		fprintf(stderr, "kvbench: sweep point p %g, rescore %g left out: the second stage "
			"takes rescore in (p, 1]\n", (double)po->p, (double)po->rescore);
		return false;
	}
	return !(topk && p_later);
}

static void label_of(const opts *po, char *out, size_t n)
{
	if (po->topk)
		snprintf(out, n, "context=%u seqs=%u topk=%u", po->context, po->seqs, po->topk);
	else if (po->correction || po->rescore != 0.0f || po->keep != 0.0f)
		snprintf(out, n, "context=%u seqs=%u p=%.3g corr=%u rescore=%.3g keep=%.3g",
			 po->context, po->seqs, (double)po->p, po->correction, (double)po->rescore,
			 (double)po->keep);
	else
		snprintf(out, n, "context=%u seqs=%u p=%.3g", po->context, po->seqs, (double)po->p);
}

/* ---- output ------------------------------------------------------------------------------ */

static const char *const csv_cols[] = {
	"context", "seqs", "layers", "p", "topk", "correction", "rescore", "keep", "rescore_k_frac",
	"budget", "oracle_budget", "recall", "recall_min",
	"recall_p5", "recall_p1",
	"output_rel_err", "step_ms_per_layer", "tokens_per_s", "hot_hit_rate", "pcie_bytes_per_step",
	"ms_index", "ms_store", "ms_score", "ms_select", "ms_attend", "host_bytes_used",
	"index_bytes", "oracle_topp_budget", "oracle_topp_recall", "oracle_topp_err",
	"oracle_at_budget_budget", "oracle_at_budget_recall", "oracle_at_budget_err", "quest_budget",
	"quest_recall", "quest_err", "plan_kvtier_seqs", "plan_full_seqs", "plan_kvtier_tokens",
	"plan_full_tokens"};
enum { N_COLS = sizeof(csv_cols) / sizeof(csv_cols[0]) };

static void values(const kb_result *r, double v[N_COLS])
{
	const double x[N_COLS] = {
		r->context, r->seqs, r->layers, r->p, r->topk, r->correction, r->rescore, r->keep,
		r->rescore_k,
		r->budget, r->oracle_budget,
		r->recall, r->recall_min, r->recall_p5, r->recall_p1, r->err, r->step_ms, r->tok_s, r->hit_rate, r->pcie_step,
		r->stage_ms[0], r->stage_ms[1], r->stage_ms[2], r->stage_ms[3], r->stage_ms[4],
		(double)r->host_used, (double)r->index_bytes,
		r->base_budget[0], r->base_recall[0], r->base_err[0],
		r->base_budget[1], r->base_recall[1], r->base_err[1],
		r->base_budget[2], r->base_recall[2], r->base_err[2],
		(double)r->plan.kvt_seqs, (double)r->plan.full_seqs, (double)r->plan.kvt_tokens,
		(double)r->plan.full_tokens};
	memcpy(v, x, sizeof(x));
}

static void num(FILE *f, double v, bool json)
{
	if (!isfinite(v))
		fputs(json ? "null" : "", f);
	else if (v == floor(v) && fabs(v) < 9e15)
		fprintf(f, "%.0f", v);
	else
		fprintf(f, "%.6g", v);
}

static int write_csv(const char *path, const kb_result *r, uint32_t n)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return -1;
	for (int c = 0; c < N_COLS; c++)
		fprintf(f, "%s%s", c ? "," : "", csv_cols[c]);
	fputc('\n', f);
	for (uint32_t i = 0; i < n; i++) {
		double v[N_COLS];
		values(&r[i], v);
		for (int c = 0; c < N_COLS; c++) {
			if (c)
				fputc(',', f);
			num(f, v[c], false);
		}
		fputc('\n', f);
	}
	return fclose(f) ? -1 : 0;
}

static void print_json_points(const kb_result *r, uint32_t n, const char *csv, char names[3][512])
{
	printf("{\"library_version\": \"%s\", \"points\": [", kvt_version_string());
	for (uint32_t i = 0; i < n; i++) {
		double v[N_COLS];
		values(&r[i], v);
		printf("%s{", i ? ", " : "");
		for (int c = 0; c < N_COLS; c++) {
			printf("%s\"%s\": ", c ? ", " : "", csv_cols[c]);
			num(stdout, v[c], true);
		}
		printf(", \"plan_limit\": \"%s\"}", r[i].plan.limit ? r[i].plan.limit : "");
	}
	printf("], \"vs_p_sweep\": [");
	kb_print_vs_sweep(r, n, true);
	printf("]");
	if (csv) {
		printf(", \"csv\": ");
		jstr(csv);
		printf(", \"svg\": [");
		for (int i = 0; i < 3; i++) {
			printf("%s", i ? ", " : "");
			jstr(names[i]);
		}
		printf("]");
	}
	printf("}\n");
}

static void print_point_columns(void)
{
	printf("context seqs layers      p  topk  corr rescore   keep  budget  oracle  recall    r_p5   "
	       "r_min  rel_err  ms/layer    tok/s  hit   PCIe MiB/step\n");
}

static void cellf(double v, int w, int prec)
{
	if (isfinite(v))
		printf(" %*.*f", w, prec, v);
	else
		printf(" %*s", w, "-");
}

static void print_point(const kb_result *r)
{
	printf("%7u %4u %6u %6.3g %5u %5u %7.3g %6.3g", r->context, r->seqs, r->layers,
	       (double)r->p, r->topk, r->correction, (double)r->rescore, (double)r->keep);
	cellf(r->budget, 7, 4);
	cellf(r->oracle_budget, 7, 4);
	cellf(r->recall, 7, 4);
	cellf(r->recall_p5, 7, 4);
	cellf(r->recall_min, 7, 4);
	printf("  %.2e", r->err);
	cellf(r->step_ms, 9, 2);
	cellf(r->tok_s, 8, 1);
	cellf(r->hit_rate, 5, 3);
	cellf(r->pcie_step / 1048576.0, 9, 3);
	printf("\n");
}

/* The comparison: kvtier, the oracle Top-p, the oracle and Quest at kvtier's budget, and Top-k by
 * the estimate (its own points), at every budget the points ran. */
static void print_base_table(const kb_result *r, uint32_t n)
{
	printf("\nbaselines (budget: share of the indexed tokens fetched per KV head; recall: exact "
	       "softmax mass covered)\n");
	printf("context seqs  method                          budget  recall   r_min  rel_err\n");
	for (uint32_t i = 0; i < n; i++) {
		const kb_result *x = &r[i];
		char m[64];
		if (x->topk)
			snprintf(m, sizeof m, "topk k=%u (kvtier estimate)", x->topk);
		else if (x->keep != 0.0f)
			snprintf(m, sizeof m, "kvtier p=%.3g corr=%u rs=%.3g keep=%.3g", (double)x->p,
				 x->correction, (double)x->rescore, (double)x->keep);
		else if (x->correction || x->rescore != 0.0f)
			snprintf(m, sizeof m, "kvtier p=%.3g corr=%u rs=%.3g", (double)x->p,
				 x->correction, (double)x->rescore);
		else
			snprintf(m, sizeof m, "kvtier p=%.3g", (double)x->p);
		printf("%7u %4u  %-30s", x->context, x->seqs, m);
		cellf(x->budget, 7, 4);
		cellf(x->recall, 7, 4);
		cellf(x->recall_min, 7, 4);
		printf("  %.2e\n", x->err);
		static const char *const bn[KB_N_BASE] = {"  oracle Top-p (exact)", "  oracle at that budget",
							 "  Quest pages at that budget"};
		for (int k = 0; k < KB_N_BASE; k++) {
			if (x->topk && k == KB_BASE_ORACLE_TOPP)
				continue; /* p = 1: the whole index */
			printf("%7s %4s  %-30s", "", "", bn[k]);
			cellf(x->base_budget[k], 7, 4);
			cellf(x->base_recall[k], 7, 4);
			printf(" %7s  %.2e\n", "", x->base_err[k]);
		}
	}
}

/* The SVG files next to the CSV ("x.csv" -> "x-recall.svg" ...); a path whose names would not fit
 * is refused (exit 2), never cut. */
static void svg_names(const char *csv, char names[3][512])
{
	static const char *const suf[3] = {"-recall.svg", "-stages.svg", "-capacity.svg"};
	size_t n = strlen(csv);
	if (n > 4 && !strcmp(csv + n - 4, ".csv"))
		n -= 4;
	for (int i = 0; i < 3; i++)
		if (snprintf(names[i], 512, "%.*s%s", (int)n, csv, suf[i]) >= 512) {
			char want[128];
			snprintf(want, sizeof want, "expected a path of at most %zu bytes, so that "
				 "the SVG files' names next to it fit in 511",
				 511 - strlen(suf[2]) + (strlen(csv) - n));
			bad_value("--csv", csv, want);
		}
}

/* Find out before the run, not after it, that an output file cannot be written; one that this
 * run creates is removed if the run fails, one that was there is left as it was until then. */
static void check_output(const char *path, const char *what)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
	if (fd >= 0) {
		close(fd);
		created_file(path);
		return;
	}
	FILE *f = errno == EEXIST ? fopen(path, "a") : NULL;
	if (!f)
		fail(what, path);
	fclose(f);
}

int sweep_main(opts *o)
{
	kb_axis ax[4];
	uint32_t na = kb_parse_axes(o, ax), total = 1;
	for (uint32_t a = 0; a < na; a++)
		total *= ax[a].n;
	kb_result *res = xcalloc(total, sizeof(kb_result));
	opts *po = xcalloc(total, sizeof(opts));
	uint32_t n = 0;
	for (uint32_t i = 0; i < total; i++)
		if (kb_point_opts(o, ax, na, i, &po[n]))
			n++;
	sweep_bar bar = {.on = !o->quiet && na > 0, .tty = isatty(STDERR_FILENO), .n = n,
			 .t0 = now_ns(), .last_pct = -10};
	kb_progress prog = {.hook = sweep_progress, .hook_ctx = &bar};
	for (uint32_t i = 0; i < n; i++)
		bar.total_w += (double)po[i].context * po[i].seqs * po[i].layers;
	char names[3][512] = {"", "", ""};
	if (o->csv) {
		svg_names(o->csv, names);
		check_output(o->csv, "cannot write the CSV file");
		for (int i = 0; i < 3; i++)
			check_output(names[i], "cannot write the SVG file");
	}
	bool table = !o->json;
	if (table && na)
		print_point_columns();
	for (uint32_t i = 0; i < n; i++) {
		kb_plan_in in;
		kb_plan plan;
		opts_plan_in(&po[i], po[i].context, &in);
		if (kb_plan_compute(&in, &plan) < 0)
			fail("capacity plan", "bad shape");
		bar.i = i;
		bar.w = (double)po[i].context * po[i].seqs * po[i].layers;
		label_of(&po[i], bar.label, sizeof bar.label);
		if (!na) /* --baselines alone: one run with its table and summary */
			po[i].point = false;
		run_point(&po[i], &plan, &prog, &res[i]);
		bar.done_w += bar.w;
		if (bar.on && bar.tty)
			fprintf(stderr, "\r\033[K");
		if (table && na) {
			print_point(&res[i]);
			fflush(stdout);
		}
	}
	bar.on = false;
	if (o->csv) {
		if (write_csv(o->csv, res, n) < 0)
			fail("cannot write the CSV file", o->csv);
		if (svg_write_all(o->csv, res, n, names) < 0)
			fail("cannot write the SVG files next to", o->csv);
	}
	if (table) {
		print_base_table(res, n);
		kb_print_vs_sweep(res, n, false);
		if (o->csv)
			printf("\nwrote %s, %s, %s, %s\n", o->csv, names[0], names[1], names[2]);
	} else if (na || o->csv) {
		print_json_points(res, n, o->csv, names);
	}
	for (uint32_t a = 0; a < na; a++)
		free(ax[a].copy);
	free(res);
	free(po);
	opts_free(o);
	return 0;
}

/* ---- --plan ------------------------------------------------------------------------------ */

static void plan_table(const opts *o, const kb_plan_in *in, const kb_plan *p)
{
	char a[32], b[32], c[32], d[32], e[32];
	printf("capacity plan: %u layers x %u KV heads x head_dim %u, context %u; GPU %s, weights "
	       "%s, hot cache %s; host %s, NVMe %s\n", in->layers, in->kv_heads, in->head_dim,
	       in->context, fmt_bytes(in->gpu_bytes, a, sizeof a),
	       fmt_bytes(in->weights_bytes, b, sizeof b), fmt_bytes(in->hot_bytes, c, sizeof c),
	       fmt_bytes(in->host_bytes, d, sizeof d), fmt_bytes(in->nvme_bytes, e, sizeof e));
	printf("                          HBM/token   HBM/sequence   sequences        tokens  "
	       "limit\n");
	printf("full K/V in HBM         %11s  %13s  %10" PRIu64 "  %12" PRIu64 "  HBM\n",
	       fmt_bytes(p->full_token_bytes, a, sizeof a),
	       fmt_bytes(p->full_token_bytes * in->context, b, sizeof b), p->full_seqs,
	       p->full_seqs * in->context);
	/* per token of context: index, window ring and selection together */
	printf("kvtier, by HBM          %11s  %13s  %10" PRIu64 "\n",
	       fmt_bytes(p->hbm_seq_bytes / in->context, a, sizeof a),
	       fmt_bytes(p->hbm_seq_bytes, b, sizeof b), p->hbm_seqs);
	printf("kvtier, by host+NVMe    %11s  %13s  %10" PRIu64 "  (host alone %" PRIu64 ")\n", "-",
	       fmt_bytes(p->seq_blocks * p->block_bytes, b, sizeof b), p->tier_seqs, p->host_seqs);
	printf("kvtier                  %11s  %13s  %10" PRIu64 "  %12" PRIu64 "  %s", "", "",
	       p->kvt_seqs, p->kvt_tokens, p->limit);
	if (p->full_seqs)
		printf("  (x%.2f the sequences of full K/V)", (double)p->kvt_seqs / p->full_seqs);
	printf("\n");
	(void)o;
}

/* What one H200 serves on its HBM alone, with the rows in the host tier and the rest on NVMe; a
 * self-sized hot cache counts its bound from the H200's HBM, not from --gpu-bytes. */
static void plan_h200(const opts *o, const kb_plan_in *in)
{
	kb_plan_in h = *in;
	kb_plan p;
	h.gpu_bytes = KB_H200_HBM_BYTES;
	if (o->gpu_cache == KB_GPU_CACHE_AUTO)
		h.hot_bytes = h.gpu_bytes > h.weights_bytes
				      ? (h.gpu_bytes - h.weights_bytes) / KVT_GPU_HOT_AUTO_SHARE
				      : 0;
	if (kb_plan_compute(&h, &p) < 0)
		fail("capacity plan", "bad shape");
	char w[32], hb[32], nb[32];
	printf("one H200 (141 GB HBM, %s weights): %" PRIu64 " tokens, %" PRIu64 " sequences of %u "
	       "(index + hot cache in HBM, K/V on %s host + %s NVMe)\n",
	       fmt_bytes(in->weights_bytes, w, sizeof w), p.hbm_tokens, p.hbm_seqs, in->context,
	       fmt_bytes(p.hbm_host_bytes, hb, sizeof hb), fmt_bytes(p.hbm_nvme_bytes, nb, sizeof nb));
}

int plan_main(opts *o)
{
	kb_plan_in in;
	kb_plan p;
	opts_plan_in(o, o->context, &in);
	if (kb_plan_compute(&in, &p) < 0)
		fail("capacity plan", "bad shape");
	if (!o->json) {
		plan_table(o, &in, &p);
		plan_h200(o, &in);
	}
	if (!p.kvt_seqs) {
		fprintf(stderr, "kvbench: the plan holds no sequence: nothing to run\n");
		opts_free(o);
		return 1;
	}
	uint64_t run = o->run_fraction > 0 ? (uint64_t)ceil(o->run_fraction * (double)p.kvt_seqs)
					   : (p.kvt_seqs < 4 ? p.kvt_seqs : 4);
	if (run > 4096)
		fail("--run-fraction", "more than 4096 sequences to run: lower it");
	opts ro = *o;
	ro.seqs = (uint32_t)run;
	ro.plan = false;
	if (!o->json)
		printf("run: %u of the %" PRIu64 " planned sequences (%.3g%%), each of context %u, on "
		       "%u of the model's %u layers: per-layer figures carry over; model-wide ones "
		       "are scaled by %u / %u where marked\n\n",
		       ro.seqs, p.kvt_seqs, 100.0 * ro.seqs / (double)p.kvt_seqs, o->context,
		       o->layers, o->model_layers, o->model_layers, o->layers);
	kb_result r;
	run_point(&ro, &p, NULL, &r);
	if (!o->json) {
		printf("plan run: %.2f ms per decode step per layer, %.1f decode tokens/s over the %u "
		       "layers run (%.1f scaled to %u layers); host tier %.1f MiB, index %.1f MiB "
		       "(x%u / %u for the model)",
		       r.step_ms, r.tok_s, o->layers, r.tok_s * o->layers / o->model_layers,
		       o->model_layers, r.host_used / 1048576.0, r.index_bytes / 1048576.0,
		       o->model_layers, o->layers);
		if (isfinite(r.hit_rate))
			printf("; hot-cache hit rate %.4f, %.3f MiB over PCIe per step", r.hit_rate,
			       r.pcie_step / 1048576.0);
		else
			printf("; PCIe 0 B and no hot cache (CPU backend)");
		printf("; budget %.4f, recall %.4f\n", r.budget, r.recall);
	}
	opts_free(o);
	return 0;
}
