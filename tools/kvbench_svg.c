/* SPDX-License-Identifier: MIT */
/*
 * The SVG plots of a sweep, plain SVG 1.1 written by hand:
 *   NAME-recall.svg    recall against budget: kvtier's points, the exact Top-p oracle, the oracle
 *                      and Quest pages at kvtier's budget, Top-k by the estimate
 *   NAME-stages.svg    decode time per step and layer of every point, stacked by stage (kvt_stats
 *                      ns_index, ns_store, ns_score, ns_select, ns_attend deltas)
 *   NAME-capacity.svg  sequences held at each context: kvtier against full K/V in HBM (the plan)
 */
#include "kvbench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { W = 720, H = 440, ML = 70, MR = 190, MT = 40, MB = 70 };

static const char *const colors[] = {"#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#d62728",
				     "#8c564b"};

static void text(FILE *f, double x, double y, const char *anchor, int size, const char *s)
{
	fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"%d\" text-anchor=\"%s\">", x, y, size,
		anchor);
	for (; *s; s++) {
		if (*s == '<')
			fputs("&lt;", f);
		else if (*s == '>')
			fputs("&gt;", f);
		else if (*s == '&')
			fputs("&amp;", f);
		else
			fputc(*s, f);
	}
	fputs("</text>\n", f);
}

static FILE *svg_open(const char *path, const char *title)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return NULL;
	fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
		   "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" "
		   "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
		   "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"white\"/>\n",
		W, H, W, H, W, H);
	text(f, W / 2.0, 24, "middle", 16, title);
	return f;
}

static int svg_close(FILE *f)
{
	fputs("</svg>\n", f);
	return fclose(f) ? -1 : 0;
}

/* A "nice" tick step for a range. */
static double tick_step(double range)
{
	double s = pow(10, floor(log10(range / 5))), r = range / s;
	return r > 7 ? 2 * s : r > 3.5 ? s : r > 1.5 ? s / 2 : s / 5;
}

typedef struct frame {
	double x0, x1, y0, y1;
} frame;

static double px(const frame *fr, double x)
{
	return ML + (x - fr->x0) / (fr->x1 - fr->x0) * (W - ML - MR);
}

static double py(const frame *fr, double y)
{
	return H - MB - (y - fr->y0) / (fr->y1 - fr->y0) * (H - MT - MB);
}

static void axes(FILE *f, const frame *fr, const char *xl, const char *yl, bool xticks)
{
	char t[32];
	fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" "
		   "stroke=\"black\"/>\n", ML, MT, W - ML - MR, H - MT - MB);
	double ys = tick_step(fr->y1 - fr->y0);
	for (double y = ceil(fr->y0 / ys) * ys; y <= fr->y1 + 1e-9; y += ys) {
		fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
			ML, py(fr, y), W - MR, py(fr, y));
		snprintf(t, sizeof t, "%g", fabs(y) < 1e-12 ? 0 : y);
		text(f, ML - 6, py(fr, y) + 4, "end", 11, t);
	}
	if (xticks) {
		double xs = tick_step(fr->x1 - fr->x0);
		for (double x = ceil(fr->x0 / xs) * xs; x <= fr->x1 + 1e-9; x += xs) {
			snprintf(t, sizeof t, "%g", fabs(x) < 1e-12 ? 0 : x);
			text(f, px(fr, x), H - MB + 16, "middle", 11, t);
		}
	}
	text(f, (ML + W - MR) / 2.0, H - 20, "middle", 13, xl);
	fprintf(f, "<g transform=\"translate(18,%.1f) rotate(-90)\">\n", (MT + H - MB) / 2.0);
	text(f, 0, 0, "middle", 13, yl);
	fputs("</g>\n", f);
}

static void legend(FILE *f, int i, const char *color, const char *name)
{
	double y = MT + 10 + 20 * i;
	fprintf(f, "<rect x=\"%d\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\"/>\n", W - MR + 12,
		y - 10, color);
	text(f, W - MR + 30, y, "start", 12, name);
}

/* ---- recall against budget --------------------------------------------------------------- */

typedef struct pt {
	double x, y;
} pt;

static int cmp_pt(const void *a, const void *b)
{
	double x = ((const pt *)a)->x, y = ((const pt *)b)->x;
	return (x > y) - (x < y);
}

static void series(FILE *f, const frame *fr, pt *p, uint32_t n, const char *color, bool line)
{
	qsort(p, n, sizeof(pt), cmp_pt);
	if (line && n > 1) {
		fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", color);
		for (uint32_t i = 0; i < n; i++)
			fprintf(f, "%s%.1f,%.1f", i ? " " : "", px(fr, p[i].x), py(fr, p[i].y));
		fputs("\"/>\n", f);
	}
	for (uint32_t i = 0; i < n; i++)
		fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\"/>\n", px(fr, p[i].x),
			py(fr, p[i].y), color);
}

/*
 * Recall against budget, a series per method: kvtier's plain Top-p points (kb_is_plain), its other
 * methods (rescore, corrections, keep, budget_max: points only, as they are several knobs), the
 * baselines, Top-k. A series is joined by a line only when its points share one shape (context,
 * sequences, layers): across shapes a line would join unlike points.
 */
static int plot_recall(const char *path, const kb_result *r, uint32_t n)
{
	enum { KVT, ORACLE, AT, QUEST, TOPK, OTHER, NS };
	static const char *const names[NS] = {"kvtier (Top-p)", "oracle Top-p", "oracle at budget",
					      "Quest pages", "Top-k estimate",
					      "kvtier, other methods"};
	pt *p[NS];
	uint32_t m[NS] = {0};
	const kb_result *shape[NS] = {0};
	bool line[NS];
	frame fr = {0, 0, 1, 0};
	for (int s = 0; s < NS; s++)
		line[s] = s != OTHER;
	for (int s = 0; s < NS; s++)
		p[s] = calloc(n ? n : 1, sizeof(pt));
	for (uint32_t i = 0; i < n; i++) {
		const kb_result *x = &r[i];
		pt c[NS] = {{x->budget, x->recall}, {x->base_budget[0], x->base_recall[0]},
			    {x->base_budget[1], x->base_recall[1]},
			    {x->base_budget[2], x->base_recall[2]}, {x->budget, x->recall},
			    {x->budget, x->recall}};
		for (int s = 0; s < NS; s++) {
			if ((s == KVT && !kb_is_plain(x)) || (s == TOPK && !x->topk) ||
			    (s == OTHER && (x->topk || kb_is_plain(x))))
				continue;
			if (s == ORACLE && x->topk)
				continue;
			if (!isfinite(c[s].x) || !isfinite(c[s].y))
				continue;
			if (!shape[s])
				shape[s] = x;
			else if (shape[s]->context != x->context || shape[s]->seqs != x->seqs ||
				 shape[s]->layers != x->layers)
				line[s] = false;
			p[s][m[s]++] = c[s];
			fr.x1 = fmax(fr.x1, c[s].x);
			fr.y0 = fmin(fr.y0, c[s].y);
		}
	}
	fr.x1 = fr.x1 > 0 ? fr.x1 * 1.1 : 1;
	fr.y0 = fmax(0, floor(fr.y0 * 20) / 20 - 0.05);
	if (fr.y0 > 0.95)
		fr.y0 = 0.9;
	fr.y1 = 1.0;
	FILE *f = svg_open(path, "Recall against budget");
	if (!f)
		return -1;
	axes(f, &fr, "budget: share of the indexed tokens fetched", "recall (exact mass)", true);
	for (int s = 0, k = 0; s < NS; s++) {
		if (!m[s])
			continue;
		series(f, &fr, p[s], m[s], colors[s], line[s]);
		legend(f, k++, colors[s], names[s]);
	}
	for (int s = 0; s < NS; s++)
		free(p[s]);
	return svg_close(f);
}

/* ---- stacked stage bars ------------------------------------------------------------------ */

static void bar_label(const kb_result *x, char *out, size_t n)
{
	if (x->topk)
		snprintf(out, n, "%u/%u/k%u", x->context, x->seqs, x->topk);
	else if (x->correction || x->rescore != 0.0f || x->keep != 0.0f)
		snprintf(out, n, "%u/%u/p%.3g/c%u/r%.3g/w%.3g", x->context, x->seqs, (double)x->p,
			 x->correction, (double)x->rescore, (double)x->keep);
	else
		snprintf(out, n, "%u/%u/p%.3g", x->context, x->seqs, (double)x->p);
}

/* A bar chart of n bars: the y range up to its tallest bar times `head` (1 when there is none),
 * the file with its title and axes, and the width of a bar into *bw. NULL when the file cannot be
 * created. */
static FILE *bars_open(const char *path, const char *title, frame *fr, double head,
		       const char *xlabel, const char *ylabel, uint32_t n, double *bw)
{
	fr->y1 = fr->y1 > 0 ? fr->y1 * head : 1;
	FILE *f = svg_open(path, title);
	if (!f)
		return NULL;
	axes(f, fr, xlabel, ylabel, false);
	*bw = (W - ML - MR) / (double)(n ? n : 1);
	return f;
}

static int plot_stages(const char *path, const kb_result *r, uint32_t n)
{
	static const char *const st[5] = {"index", "store", "score", "select", "attend"};
	frame fr = {0, n ? n : 1, 0, 0};
	for (uint32_t i = 0; i < n; i++) {
		double t = 0;
		for (int s = 0; s < 5; s++)
			t += r[i].stage_ms[s];
		fr.y1 = fmax(fr.y1, t);
	}
	double bw;
	FILE *f = bars_open(path, "Decode time per step and layer, by stage", &fr, 1.1,
			    "point: context/seqs/p (or k)", "ms per step per layer", n, &bw);
	if (!f)
		return -1;
	for (uint32_t i = 0; i < n; i++) {
		double base = 0;
		char lab[64];
		for (int s = 0; s < 5; s++) {
			double v = r[i].stage_ms[s];
			if (!(v > 0))
				continue;
			fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
				   "fill=\"%s\"/>\n", ML + bw * i + bw * 0.15, py(&fr, base + v),
				bw * 0.7, py(&fr, base) - py(&fr, base + v), colors[s]);
			base += v;
		}
		bar_label(&r[i], lab, sizeof lab);
		fprintf(f, "<g transform=\"translate(%.1f,%d) rotate(30)\">\n", ML + bw * (i + 0.5),
			H - MB + 12);
		text(f, 0, 0, "start", 10, lab);
		fputs("</g>\n", f);
	}
	for (int s = 0; s < 5; s++)
		legend(f, s, colors[s], st[s]);
	return svg_close(f);
}

/* ---- capacity ---------------------------------------------------------------------------- */

static int plot_capacity(const char *path, const kb_result *r, uint32_t n)
{
	uint32_t ctx[64], nc = 0;
	double kv[64], full[64];
	for (uint32_t i = 0; i < n && nc < 64; i++) {
		uint32_t j = 0;
		while (j < nc && ctx[j] != r[i].context)
			j++;
		if (j < nc)
			continue;
		ctx[nc] = r[i].context;
		kv[nc] = (double)r[i].plan.kvt_seqs;
		full[nc++] = (double)r[i].plan.full_seqs;
	}
	frame fr = {0, nc ? nc : 1, 0, 0};
	for (uint32_t j = 0; j < nc; j++)
		fr.y1 = fmax(fr.y1, fmax(kv[j], full[j]));
	double bw;
	FILE *f = bars_open(path, "Concurrent sequences: kvtier against full K/V in HBM", &fr, 1.15,
			    "context (tokens per sequence)", "sequences held", nc, &bw);
	if (!f)
		return -1;
	for (uint32_t j = 0; j < nc; j++) {
		char t[32];
		const double v[2] = {kv[j], full[j]};
		for (int s = 0; s < 2; s++) {
			double x = ML + bw * j + bw * (0.1 + 0.4 * s);
			fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
				   "fill=\"%s\"/>\n", x, py(&fr, v[s]), bw * 0.38,
				py(&fr, 0) - py(&fr, v[s]), colors[s]);
			snprintf(t, sizeof t, "%.0f", v[s]);
			text(f, x + bw * 0.19, py(&fr, v[s]) - 4, "middle", 11, t);
		}
		snprintf(t, sizeof t, "%u", ctx[j]);
		text(f, ML + bw * (j + 0.5), H - MB + 16, "middle", 11, t);
	}
	legend(f, 0, colors[0], "kvtier");
	legend(f, 1, colors[1], "full K/V in HBM");
	return svg_close(f);
}

int svg_write_all(const char *csv, const kb_result *r, uint32_t n, char names[3][512])
{
	(void)csv;
	if (plot_recall(names[0], r, n) < 0 || plot_stages(names[1], r, n) < 0 ||
	    plot_capacity(names[2], r, n) < 0)
		return -1;
	return 0;
}
