/* SPDX-License-Identifier: MIT */
/*
 * `kvbench --trace DIR`: replay a trace captured from a real model (doc/trace-format.md) through
 * kvtier and compare every decode step with exact attention over the whole context.
 *
 * Layers are independent in kvtier (each has its own rotation, centroids, index, window and hot
 * cache), so the replay runs one layer at a time, prefill then every decode step, with one
 * sequence that it closes before the next layer: only one layer of the trace is in memory, and a
 * subset of layers (--layers) gives the same figures as a full run. The cache keeps the trace's
 * layer count, so layer L always gets the rotation it gets in a runtime.
 *
 * The reference is computed in double precision from the values the library received (the trace
 * rounded to the cache's dtype), with the trace's attention scale: unlike the synthetic runs'
 * fp32 reference (kvbench_eval.c), a captured trace has no bound on its logits' range.
 *
 * Options, staging buffers, the cache's configuration and creation, the window rule, the check of
 * the gathered positions, the progress line and the error reports are kvbench's own
 * (kvbench_common.c); what is the replay's alone lives in kb_trace (kvbench_trace.h).
 */
#include "kvbench_trace.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "constants.h" /* KVT_GPU_HOT_WAYS */

_Noreturn static void trace_fail(const kb_trace *t)
{
	fail("trace", t->err);
}

/* "0,3,8-11": each layer in range of the trace; a bad list exits 2 naming --layers. */
static void parse_layers(kb_trace *t)
{
	const char *s = t->o->layer_list;
	char want[96];
	t->n_sel = 0;
	for (;;) {
		char *end;
		errno = 0;
		unsigned long a = strtoul(s, &end, 10), b = a;
		if (!isdigit((unsigned char)*s) || end == s || errno) /* no space, no sign */
			break;
		s = end;
		if (*s == '-') {
			s++;
			b = strtoul(s, &end, 10);
			if (!isdigit((unsigned char)*s) || end == s || errno || b < a)
				break;
			s = end;
		}
		if (b >= t->m.n_layers) {
			snprintf(want, sizeof want, "layer %lu, but the trace has %u layers (0 to %u)",
				 b, t->m.n_layers, t->m.n_layers - 1);
			bad_value("--layers", t->o->layer_list, want);
		}
		for (unsigned long l = a; l <= b; l++) {
			t->n_sel += !t->sel[l];
			t->sel[l] = true;
		}
		if (!*s)
			return;
		if (*s++ != ',')
			break;
	}
	bad_value("--layers", t->o->layer_list, "expected a list like 0,3,8-11");
}

/* ---- one layer ------------------------------------------------------------------------------ */

/* Round n rows of `heads` vectors into the staging buffer and (when truth is not NULL) into the
 * truth [heads, cap, d] at token t0; a value the cache's dtype cannot hold exits 1, naming it. */
static void round_rows(kb_trace *t, const float *src, uint32_t n, uint32_t heads, uint16_t *dst,
		       float *truth, uint32_t t0, uint32_t layer, unsigned arr, uint32_t row0)
{
	const uint32_t dt = t->o->dtype;
	for (uint32_t r = 0; r < n; r++)
		for (uint32_t h = 0; h < heads; h++)
			for (uint32_t i = 0; i < t->d; i++) {
				size_t at = ((size_t)r * heads + h) * t->d + i;
				uint16_t b = dtype_bits(dt, src[at]);
				float f = dtype_float(dt, b);
				if (!isfinite(f)) {
					char nm[64];
					trace_file_name(layer, arr, nm, sizeof(nm));
					snprintf(t->err, sizeof t->err, "%s/%s: data: %g (%s %u, head %u, "
						 "dim %u) overflows %s; replay with --dtype bf16",
						 t->o->trace_dir, nm, (double)src[at],
						 arr >= 3 ? "step" : "token", row0 + r, h, i,
						 dt == KVT_DTYPE_BF16 ? "bfloat16" : "float16");
					trace_fail(t);
				}
				dst[at] = b;
				if (truth)
					truth[((size_t)h * t->cap + t0 + r) * t->d + i] = f;
			}
}

static double dot(const float *a, const float *b, uint32_t d)
{
	double s = 0;
	for (uint32_t i = 0; i < d; i++)
		s += (double)a[i] * b[i];
	return s;
}

/* Exact softmax of query q over all tokens into t->prob; the exact output into full[d]. */
static void exact_attention(kb_trace *t, const float *q, const float *K, const float *V,
			    double *full)
{
	double mx = -INFINITY, z = 0;
	for (uint32_t i = 0; i < t->len; i++) {
		t->prob[i] = t->scale * dot(q, K + (size_t)i * t->d, t->d);
		mx = t->prob[i] > mx ? t->prob[i] : mx;
	}
	for (uint32_t i = 0; i < t->len; i++)
		z += t->prob[i] = exp(t->prob[i] - mx);
	memset(full, 0, t->d * sizeof(double));
	for (uint32_t i = 0; i < t->len; i++) {
		double w = t->prob[i] /= z;
		for (uint32_t j = 0; j < t->d; j++)
			full[j] += w * V[(size_t)i * t->d + j];
	}
}

/* One query head at one step: recall of the attended positions and the output's error. */
static void eval_head(kb_trace *t, uint32_t layer, uint32_t step, uint32_t qh, const int32_t *p,
		      int32_t cnt)
{
	const uint32_t h = qh / t->group;
	const float *K = t->K + (size_t)h * t->cap * t->d, *V = t->V + (size_t)h * t->cap * t->d;
	const float *q = t->Q + ((size_t)step * t->m.n_q_heads + qh) * t->d;
	const float *o = (const float *)t->out.host + (size_t)qh * t->d;
	double full[TRACE_MAX_HEAD_DIM], rec = 0, e2 = 0, f2 = 0;
	exact_attention(t, q, K, V, full);
	for (int32_t i = 0; i < cnt; i++)
		rec += t->prob[p[i]];
	for (uint32_t i = 0; i < t->d; i++) {
		double e = o[i] - full[i];
		e2 += e * e;
		f2 += full[i] * full[i];
	}
	size_t hi = (size_t)layer * t->m.n_q_heads + qh;
	hacc *a = &t->heads[hi];
	a->recall_sum += rec;
	a->recall_min = rec < a->recall_min ? rec : a->recall_min;
	a->err2 += e2;
	a->full2 += f2;
	a->n++;
	t->recall[hi * t->m.decode_steps + step] = rec;
}

/* One decode step of one layer after kvt_attend + kvt_gather. */
static void eval_step(kb_trace *t, uint32_t layer, uint32_t step)
{
	uint32_t lo = rule_sinks(t->o, t->len), hi = lo + t->n_idx;
	char where[64];
	size_t nh = 0;
	for (uint32_t h = 0; h < t->m.n_kv_heads; h++) {
		const int32_t *p = (const int32_t *)t->pos.host + (size_t)h * t->len;
		int32_t cnt = t->counts[h];
		snprintf(where, sizeof where, "layer %u, KV head %u", layer, h);
		uint32_t sel = check_positions(p, cnt, t->len, lo, hi, where);
		/* the rows the step reads through the CUDA backend's hot cache: sinks and selected
		 * (the window's rows live in HBM); positions ascend, so they are distinct */
		for (int32_t i = 0; i < cnt && (uint32_t)p[i] < hi; i++)
			t->hot_rows[nh++] = (uint64_t)h * t->cap + (uint32_t)p[i];
		for (uint32_t g = 0; g < t->group; g++)
			eval_head(t, layer, step, h * t->group + g, p, cnt);
		if (t->n_idx) {
			kacc *k = &t->kvs[(size_t)layer * t->m.n_kv_heads + h];
			k->budget_sum += (double)sel / t->n_idx;
			k->n++;
		}
	}
	for (int k = 0; k < KB_HOT_ALL; k++)
		if (kb_lru_step(&t->hot[k], step, t->hot_rows, nh) < 0)
			fail("out of memory", "the simulated hot cache");
	if (kb_hotlog_step(&t->hot_log, t->hot_rows, nh) < 0)
		fail("out of memory", "the simulated hot cache's log");
	if (t->hot_file) {
		const uint64_t rec[KB_HOT_LOG_WORDS] = {layer, step, t->hot[0].rows, t->cap, nh};
		if (fwrite(rec, sizeof rec, 1, t->hot_file) != 1 ||
		    fwrite(t->hot_rows, sizeof(uint64_t), nh, t->hot_file) != nh)
			fail("cannot write the hot-cache log", t->o->hot_log);
	}
	t->hot_demand += (double)nh / (double)t->hot[0].rows;
	t->hot_steps++;
}

static void prefill_layer(kb_trace *t, const trace_layer *tl, uint32_t l)
{
	const trace_meta *m = &t->m;
	size_t qr = (size_t)m->n_q_heads * t->d, kr = (size_t)m->n_kv_heads * t->d;
	for (uint32_t t0 = 0; t0 < m->prefill_tokens; t0 += t->chunk) {
		uint32_t n = m->prefill_tokens - t0 < t->chunk ? m->prefill_tokens - t0 : t->chunk;
		round_rows(t, tl->prefill_q + t0 * qr, n, m->n_q_heads, t->q.host, NULL, t0, l, 0, t0);
		round_rows(t, tl->prefill_k + t0 * kr, n, m->n_kv_heads, t->k.host, t->K, t0, l, 1,
			   t0);
		round_rows(t, tl->prefill_v + t0 * kr, n, m->n_kv_heads, t->v.host, t->V, t0, l, 2,
			   t0);
		buf_sync(&t->dev, &t->q, n * qr * 2, KB_H2D);
		buf_sync(&t->dev, &t->k, n * kr * 2, KB_H2D);
		buf_sync(&t->dev, &t->v, n * kr * 2, KB_H2D);
		int rc = kvt_prefill(t->cache, t->seq, l, t->q.dev, t->k.dev, t->v.dev, n, NULL);
		if (rc < 0)
			lib_fail(t->cache, rc, "kvt_prefill");
		dev_sync(&t->dev);
		rule_prefill(t->o, &t->len, &t->n_idx, n);
		progress(&t->prog, t->what, ++t->done, t->total);
	}
}

static void snap(kb_trace *t, kvt_stats *st)
{
	st->size = sizeof(*st);
	int rc = kvt_get_stats(t->cache, st);
	if (rc < 0)
		lib_fail(t->cache, rc, "kvt_get_stats");
}

/* The step's kvt_append + kvt_attend, timed: CUDA events on the default stream (which the calls
 * given a NULL stream run on) when the cache runs on CUDA, else the wall clock (the CPU backend
 * computes inside the calls). Returns milliseconds. */
static double append_attend(kb_trace *t, uint32_t l)
{
	const cudart *cu = &t->dev.cu;
	uint64_t w0 = now_ns();
	if (t->device_time && cu->event_record_(t->ev[0], NULL))
		fail("cudaEventRecord failed", "the step's start");
	int rc = kvt_append(t->cache, l, 1, &t->seq, t->k.dev, t->v.dev, NULL);
	if (rc < 0)
		lib_fail(t->cache, rc, "kvt_append");
	rule_append(t->o, &t->len, &t->n_idx);
	if ((rc = kvt_attend(t->cache, l, 1, &t->seq, t->q.dev, t->out.dev, NULL)) < 0)
		lib_fail(t->cache, rc, "kvt_attend");
	if (!t->device_time)
		return (double)(now_ns() - w0) / 1e6;
	float ms = 0;
	if (cu->event_record_(t->ev[1], NULL) || cu->event_sync_(t->ev[1]) ||
	    cu->event_elapsed_(&ms, t->ev[0], t->ev[1]))
		fail("CUDA events failed", "timing a decode step");
	return ms;
}

static void decode_layer(kb_trace *t, const trace_layer *tl, uint32_t l)
{
	const trace_meta *m = &t->m;
	size_t qr = (size_t)m->n_q_heads * t->d, kr = (size_t)m->n_kv_heads * t->d;
	uint32_t T = m->prefill_tokens;
	kvt_stats st0, st1;
	tfetch *f = &t->fetch[l];
	const uint64_t rows = (uint64_t)m->n_kv_heads * t->cap;
	for (int k = 0; k < KB_HOT_ALL; k++)
		if (kb_lru_init(&t->hot[k], rows, k < KB_HOT_SIZES ? rows / KB_HOT_DEN(k) : 0,
				m->decode_steps, KVT_GPU_HOT_WAYS, t->cap) < 0)
			fail("out of memory", "the simulated hot cache");
	if (kb_hotlog_init(&t->hot_log, rows, m->decode_steps) < 0)
		fail("out of memory", "the simulated hot cache's log");
	t->hot[KB_HOT_SELF].grows = KB_LRU_RULE;
	t->hot[KB_HOT_DEMAND].grows = KB_LRU_DEMAND;
	snap(t, &st0);
	for (uint32_t s = 0; s < m->decode_steps; s++) {
		uint16_t *qb = t->q.host;
		round_rows(t, tl->decode_k + s * kr, 1, m->n_kv_heads, t->k.host, t->K, T + s, l, 4, s);
		round_rows(t, tl->decode_v + s * kr, 1, m->n_kv_heads, t->v.host, t->V, T + s, l, 5, s);
		round_rows(t, tl->decode_q + s * qr, 1, m->n_q_heads, qb, NULL, 0, l, 3, s);
		for (size_t i = 0; i < qr; i++)
			t->Q[s * qr + i] = dtype_float(t->o->dtype, qb[i]);
		buf_sync(&t->dev, &t->k, kr * 2, KB_H2D);
		buf_sync(&t->dev, &t->v, kr * 2, KB_H2D);
		buf_sync(&t->dev, &t->q, qr * 2, KB_H2D);
		f->step_ms += append_attend(t, l);
		f->steps++;
		/* max_tokens = the sequence length is always enough, whatever was selected */
		int rc = kvt_gather(t->cache, l, 1, &t->seq, t->len, t->counts, t->pos.dev, NULL, NULL,
				    NULL);
		if (rc < 0)
			lib_fail(t->cache, rc, "kvt_gather");
		dev_sync(&t->dev);
		buf_sync(&t->dev, &t->out, qr * sizeof(float), KB_D2H);
		buf_sync(&t->dev, &t->pos, (size_t)m->n_kv_heads * t->len * sizeof(int32_t), KB_D2H);
		eval_step(t, l, s);
		progress(&t->prog, t->what, ++t->done, t->total);
	}
	snap(t, &st1);
	f->hot_hits = st1.hot_hits - st0.hot_hits;
	f->hot_misses = st1.hot_misses - st0.hot_misses;
	f->pcie_bytes = st1.pcie_bytes - st0.pcie_bytes;
	f->nvme_bytes = st1.nvme_bytes_read - st0.nvme_bytes_read;
	f->nvme_reads = st1.nvme_reads - st0.nvme_reads;
	f->candidates = st1.candidate_tokens - st0.candidate_tokens;
	f->rescored_unselected = st1.rescored_unselected - st0.rescored_unselected;
	t->hot_self_share[0] += (double)t->hot[KB_HOT_SELF].cap / (double)rows;
	t->hot_self_share[1] += (double)t->hot[KB_HOT_DEMAND].cap / (double)rows;
	t->hot_layers++;
	for (int k = 0; k < KB_HOT_SIZES; k++) {
		uint64_t h, n;
		if (kb_hot_optimum(&t->hot_log, t->hot[k].cap, &h, &n) < 0)
			fail("out of memory", "the simulated hot cache's optimum");
		t->hot_opt[k] += (double)h;
	}
	kb_hotlog_free(&t->hot_log);
	for (int k = 0; k < KB_HOT_ALL; k++) {
		t->hot_hits[k] += t->hot[k].hits;
		t->hot_reads[k] += (double)t->hot[k].reads;
		kb_lru_free(&t->hot[k]);
	}
}

static void run_layer(kb_trace *t, uint32_t l)
{
	trace_layer tl;
	if (trace_load_layer(t->o->trace_dir, &t->m, l, &tl, t->err, sizeof(t->err)) < 0)
		trace_fail(t);
	int rc = kvt_seq_open(t->cache, &t->seq);
	if (rc < 0)
		lib_fail(t->cache, rc, "kvt_seq_open");
	snprintf(t->what, sizeof t->what, "trace layer %u", l);
	t->len = t->n_idx = 0;
	prefill_layer(t, &tl, l);
	/* with an NVMe tier the decode steps read the selected rows from the files in place, as a
	 * runtime's spilled sequence does: the fetch path on NVMe, on real queries */
	if (t->o->n_nvme && (rc = (int)kvt_seq_spill(t->cache, t->seq)) < 0)
		lib_fail(t->cache, rc, "kvt_seq_spill");
	decode_layer(t, &tl, l);
	if ((rc = kvt_seq_close(t->cache, t->seq)) < 0)
		lib_fail(t->cache, rc, "kvt_seq_close");
	trace_layer_free(&tl);
}

/* ---- setup ---------------------------------------------------------------------------------- */

static void create_cache(kb_trace *t)
{
	const trace_meta *m = &t->m;
	const kb_shape sh = {m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim, 1};
	kvt_config cfg;
	/* one layer of one sequence at a time is in the cache (in whole blocks: a file is written
	 * in them); with --nvme it is spilled there after its prefill */
	uint64_t blocks = (t->cap + KB_BLOCK_TOKENS - 1) / KB_BLOCK_TOKENS;
	uint64_t kv = blocks * KB_BLOCK_TOKENS * m->n_kv_heads * 2 * m->head_dim * 2;
	for (uint32_t i = 0; i < t->o->n_nvme; i++)
		t->nvme_sizes[i] = t->o->nvme_bytes ? t->o->nvme_bytes
						    : nvme_bytes_ample(kv, t->o->n_nvme);
	cache_config(t->o, &sh, host_bytes_ample(t->cap, 1, m->n_kv_heads, m->head_dim),
		     t->nvme_sizes, &cfg);
	cfg.scale = (float)m->scale;
	t->backend = cache_open(&cfg, &t->cache, &t->dev, NULL, NULL);
	t->scale = cfg.scale > 0 ? (double)cfg.scale : (double)(1.0f / sqrtf((float)m->head_dim));
	const cudart *cu = &t->dev.cu;
	t->device_time = t->dev.on_dev && cu->event_create_ && !cu->event_create_(&t->ev[0]) &&
			 !cu->event_create_(&t->ev[1]);
}

static void trace_setup(kb_trace *t)
{
	const trace_meta *m = &t->m;
	t->d = m->head_dim;
	t->group = m->n_q_heads / m->n_kv_heads;
	t->cap = m->prefill_tokens + m->decode_steps;
	t->chunk = t->o->chunk < m->prefill_tokens ? t->o->chunk : m->prefill_tokens;
	t->prog = (kb_progress){.quiet = t->o->quiet, .tty = isatty(STDERR_FILENO)};
	t->sel = xcalloc(m->n_layers, sizeof(bool));
	if (t->o->layer_list) {
		parse_layers(t);
	} else {
		for (uint32_t l = 0; l < m->n_layers; l++)
			t->sel[l] = true;
		t->n_sel = m->n_layers;
	}
	size_t kv = (size_t)m->n_kv_heads * t->cap * t->d, nh = (size_t)m->n_layers * m->n_q_heads;
	t->K = xcalloc(kv, sizeof(float));
	t->V = xcalloc(kv, sizeof(float));
	t->Q = xcalloc((size_t)m->decode_steps * m->n_q_heads * t->d, sizeof(float));
	t->prob = xcalloc(t->cap, sizeof(double));
	t->counts = xcalloc(m->n_kv_heads, sizeof(int32_t));
	t->heads = xcalloc(nh, sizeof(hacc));
	t->kvs = xcalloc((size_t)m->n_layers * m->n_kv_heads, sizeof(kacc));
	t->recall = xcalloc(nh * m->decode_steps, sizeof(double));
	t->fetch = xcalloc(m->n_layers, sizeof(tfetch));
	t->hot_rows = xcalloc((size_t)m->n_kv_heads * t->cap, sizeof(uint64_t));
	for (size_t i = 0; i < nh; i++)
		t->heads[i].recall_min = INFINITY;
	if (t->o->hot_log && !(t->hot_file = fopen(t->o->hot_log, "wb")))
		fail("cannot create the hot-cache log", t->o->hot_log);
	if (t->hot_file) /* a replay that fails leaves no partial log behind */
		created_file(t->o->hot_log);
	create_cache(t);
	size_t rows = t->chunk;
	buf_alloc(&t->dev, &t->q, rows * m->n_q_heads * t->d * 2);
	buf_alloc(&t->dev, &t->k, rows * m->n_kv_heads * t->d * 2);
	buf_alloc(&t->dev, &t->v, rows * m->n_kv_heads * t->d * 2);
	buf_alloc(&t->dev, &t->out, (size_t)m->n_q_heads * t->d * sizeof(float));
	buf_alloc(&t->dev, &t->pos, (size_t)m->n_kv_heads * t->cap * sizeof(int32_t));
	uint64_t chunks = (m->prefill_tokens + t->chunk - 1) / t->chunk;
	t->total = t->n_sel * (chunks + m->decode_steps);
}

static void trace_teardown(kb_trace *t)
{
	buf *b[] = {&t->q, &t->k, &t->v, &t->out, &t->pos};
	for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
		buf_free(&t->dev, b[i]);
	for (int i = 0; i < 2 && t->device_time; i++)
		t->dev.cu.event_destroy_(t->ev[i]);
	kvt_cache_destroy(t->cache);
	cudart_close(&t->dev.cu);
	if (t->hot_file && fclose(t->hot_file))
		fail("cannot write the hot-cache log", t->o->hot_log);
	t->hot_file = NULL;
	void *p[] = {t->sel, t->K, t->V, t->Q, t->prob, t->counts, t->heads, t->kvs, t->recall,
		     t->fetch, t->hot_rows};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* Open the trace, set up and replay every selected layer (the report is the caller's). */
static void replay(kb_trace *t)
{
	if (trace_open(t->o->trace_dir, &t->m, t->err, sizeof(t->err)) < 0)
		trace_fail(t);
	trace_setup(t);
	for (uint32_t l = 0; l < t->m.n_layers; l++)
		if (t->sel[l])
			run_layer(t, l);
}

/* --sweep with --trace: one replay per point of the selection's axes, then a table (or JSON) of
 * the points and each method against the p-sweep at equal budget (kvbench_frontier.c). */
static int trace_sweep(const opts *o)
{
	kb_axis ax[4];
	uint32_t na = kb_parse_axes(o, ax), total = 1, n = 0;
	for (uint32_t a = 0; a < na; a++)
		total *= ax[a].n;
	kb_result *res = xcalloc(total, sizeof *res);
	opts *po = xcalloc(total, sizeof *po);
	trace_meta meta = {0};
	const char *backend = "";
	for (uint32_t i = 0; i < total; i++) {
		if (!kb_point_opts(o, ax, na, i, &po[n]))
			continue;
		kb_trace t = {.o = &po[n]};
		if (!o->quiet)
			fprintf(stderr, "kvbench: trace sweep point %u/%u: p %g, correction %u, "
				"rescore %g, budget-max %u\n", n + 1, total, (double)po[n].p,
				po[n].correction, (double)po[n].rescore, po[n].budget_max);
		replay(&t);
		trace_summary(&t, &res[n]);
		meta = t.m;
		backend = t.backend;
		trace_teardown(&t);
		n++;
	}
	fflush(stderr);
	trace_print_sweep(o, &meta, backend, po, res, n);
	fflush(stdout);
	for (uint32_t a = 0; a < na; a++)
		free(ax[a].copy);
	free(res);
	free(po);
	return 0;
}

int trace_main(const opts *o)
{
	if (o->n_sweep)
		return trace_sweep(o);
	kb_trace t = {.o = o};
	uint64_t t0 = now_ns();
	replay(&t);
	fflush(stderr);
	double wall = (double)(now_ns() - t0) / 1e9;
	if (o->json)
		trace_print_json(&t, wall);
	else
		trace_print_text(&t, wall);
	fflush(stdout);
	trace_teardown(&t);
	return 0;
}
