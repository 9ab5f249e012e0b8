/* SPDX-License-Identifier: MIT */
/*
 * One synthetic run of kvbench, the spine of every mode but the trace replay. It prefills a
 * synthetic long context (workload.h) into a cache, runs decode steps through kvt_append +
 * kvt_attend, reads back which tokens each KV head attended (kvt_gather), and compares everything
 * with exact fp32 attention over the whole context computed from the same rounded K/V/q
 * (kvbench_eval.c): the softmax mass covered (recall), the share of indexed tokens fetched against
 * the exact Top-p oracle (budget), and the error of the attention output. With --capacity the
 * sequences' K/V exceeds the host tier and moves through the NVMe tier (kvbench_tier.c).
 * doc/kvbench.md describes the workload and every output field; kvbench.h lists the source files.
 */
#include "kvbench.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- setup ------------------------------------------------------------------------------- */

uint16_t to_bits(const kb_run *b, float x)
{
	return dtype_bits(b->o.dtype, x);
}

float from_bits(const kb_run *b, uint16_t h)
{
	return dtype_float(b->o.dtype, h);
}

float *truth(const kb_run *b, float *base, uint32_t s, uint32_t l, uint32_t kvh)
{
	size_t i = ((size_t)s * b->o.layers + l) * b->o.kv_heads + kvh;
	return base + i * b->cap * b->d;
}

static void create_cache(kb_run *b)
{
	const opts *o = &b->o;
	const kb_shape sh = {o->layers, o->q_heads, o->kv_heads, o->head_dim, o->seqs};
	kvt_config cfg;
	cache_config(o, &sh, tier_sizes(b), b->nvme_sizes, &cfg);
	cache_open(&cfg, &b->cache, &b->dev, tier_created, o);
	for (uint32_t s = 0; s < o->seqs; s++) {
		int rc = kvt_seq_open(b->cache, &b->ids[s]);
		if (rc < 0)
			lib_fail(b->cache, rc, "kvt_seq_open");
		b->lru[s] = s;
	}
}

static void setup_workload(kb_run *b)
{
	const opts *o = &b->o;
	wl_params wp;
	wl_params_default(&wp);
	wp.n_layers = o->layers;
	wp.n_q_heads = o->q_heads;
	wp.n_kv_heads = o->kv_heads;
	wp.head_dim = o->head_dim;
	wp.context = o->context;
	wp.steps = b->steps_total; /* needles are spread over every decode phase */
	wp.seed = o->seed;
	if (wl_create(&wp, &b->w) < 0)
		fail("cannot build the workload", "out of memory or bad shape");
}

void setup(kb_run *b)
{
	const opts *o = &b->o;
	b->d = o->head_dim;
	b->group = o->q_heads / o->kv_heads;
	b->steps_total = o->capacity ? 2 * o->steps : o->steps;
	b->cap = o->context + b->steps_total;
	b->prog.tty = isatty(STDERR_FILENO);
	b->prog.quiet = o->quiet;
	b->table = !o->json && !o->quiet && !o->point;
	setup_workload(b);
	size_t truth_n = (size_t)o->seqs * o->layers * o->kv_heads * b->cap * b->d;
	size_t sl = (size_t)o->seqs * o->layers, rows = o->chunk > o->seqs ? o->chunk : o->seqs;
	b->ids = xcalloc(o->seqs, sizeof(uint32_t));
	b->lru = xcalloc(o->seqs, sizeof(uint32_t));
	b->K = xcalloc(truth_n, sizeof(float));
	b->V = xcalloc(truth_n, sizeof(float));
	b->len = xcalloc(sl, sizeof(uint32_t));
	b->n_idx = xcalloc(sl, sizeof(uint32_t));
	b->qf = xcalloc((size_t)o->seqs * o->q_heads * b->d, sizeof(float));
	b->needle = xcalloc((size_t)o->seqs * o->q_heads, sizeof(int64_t));
	b->counts = xcalloc((size_t)o->seqs * o->kv_heads, sizeof(int32_t));
	b->ref.score = xcalloc((size_t)b->group * b->cap, sizeof(float));
	b->ref.ent = xcalloc(b->group, sizeof(double));
	b->qtmp = xcalloc((size_t)b->group * b->d, sizeof(float));
	b->ref.prob = xcalloc((size_t)b->group * b->cap, sizeof(float));
	b->ref.sorted = xcalloc(2 * (size_t)b->cap, sizeof(uint32_t));
	b->ref.mark = xcalloc(b->cap, 1);
	b->head_oracle = xcalloc((size_t)o->layers * o->q_heads, sizeof(double));
	b->head_eff = xcalloc((size_t)o->layers * o->q_heads, sizeof(double));
	b->step = xcalloc(b->steps_total, sizeof(acc));
	b->cap_recalls = (size_t)b->steps_total * o->seqs * o->layers * o->q_heads;
	b->recalls = xcalloc(b->cap_recalls ? b->cap_recalls : 1, sizeof(double));
	for (uint32_t i = 0; i < b->steps_total; i++)
		acc_init(&b->step[i]);
	acc_init(&b->all);
	if (o->baselines)
		b->base = base_alloc(b);
	create_cache(b);
	buf_alloc(&b->dev, &b->q, rows * o->q_heads * b->d * 2);
	buf_alloc(&b->dev, &b->k, rows * o->kv_heads * b->d * 2);
	buf_alloc(&b->dev, &b->v, rows * o->kv_heads * b->d * 2);
	buf_alloc(&b->dev, &b->out, (size_t)o->seqs * o->q_heads * b->d * sizeof(float));
	buf_alloc(&b->dev, &b->pos, (size_t)o->seqs * o->kv_heads * b->cap * sizeof(int32_t));
}

void teardown(kb_run *b)
{
	for (uint32_t s = 0; s < b->o.seqs; s++)
		kvt_seq_close(b->cache, b->ids[s]);
	kvt_cache_destroy(b->cache);
	buf *bufs[] = {&b->q, &b->k, &b->v, &b->out, &b->pos};
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		buf_free(&b->dev, bufs[i]);
	cudart_close(&b->dev.cu);
	wl_destroy(b->w);
	void *p[] = {b->ids, b->lru, b->K, b->V, b->len, b->n_idx, b->qf, b->needle, b->counts,
		     b->ref.score, b->ref.ent, b->qtmp, b->ref.prob, b->ref.sorted, b->ref.mark, b->head_oracle,
		     b->head_eff, b->step, b->recalls};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
	base_free(b->base);
}

/* ---- the documented window rule (kvbench_common.c), checked against the library -------- */

void run_rule_append(kb_run *b, size_t sl)
{
	rule_append(&b->o, &b->len[sl], &b->n_idx[sl]);
}

void check_stats(kb_run *b, kvt_stats *st, const char *when)
{
	int rc;
	st->size = sizeof(*st);
	if ((rc = kvt_get_stats(b->cache, st)) < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
	uint64_t tok = 0, idx = 0;
	for (size_t i = 0; i < (size_t)b->o.seqs * b->o.layers; i++) {
		tok += b->len[i];
		idx += b->n_idx[i];
	}
	if (st->tokens != tok || st->tokens_indexed != idx) {
		fprintf(stderr,
			"kvbench: %s: the library holds %" PRIu64 " tokens, %" PRIu64 " indexed; the "
			"documented window rule gives %" PRIu64 " and %" PRIu64 "\n",
			when, st->tokens, st->tokens_indexed, tok, idx);
		exit(1);
	}
}

/* ---- prefill ----------------------------------------------------------------------------- */

/* Round to the cache's dtype: the bits for the library, the rounded floats kept for the truth. */
static void round_into(const kb_run *b, float *x, uint16_t *bits)
{
	for (uint32_t i = 0; i < b->d; i++) {
		bits[i] = to_bits(b, x[i]);
		x[i] = from_bits(b, bits[i]);
	}
}

/* Tokens [t0, t0 + n) of sequence s on layer l: keys and values into the truth arrays and as bits
 * into kb, vb [n, kv_heads, d]; queries as bits into qb [n, q_heads, d] and, for a decode step,
 * into b->qf with the needles they ask for. */
static void gen_tokens(kb_run *b, uint32_t s, uint32_t l, uint32_t t0, uint32_t n, int32_t step,
		       uint16_t *kb, uint16_t *vb, uint16_t *qb)
{
	const uint32_t d = b->d, G = b->group, KV = b->o.kv_heads, QH = b->o.q_heads;
	for (uint32_t h = 0; h < KV; h++) {
		float *K = truth(b, b->K, s, l, h), *V = truth(b, b->V, s, l, h);
		int64_t *asked = step >= 0 ? b->needle + (size_t)s * QH + h * G : NULL;
		for (uint32_t t = t0; t < t0 + n; t++) {
			float *kt = K + (size_t)t * d, *vt = V + (size_t)t * d;
			wl_token(b->w, s, l, h, t, step, kt, vt, b->qtmp, asked);
			round_into(b, kt, kb + ((size_t)(t - t0) * KV + h) * d);
			round_into(b, vt, vb + ((size_t)(t - t0) * KV + h) * d);
			for (uint32_t g = 0; g < G; g++) {
				float *q = b->qtmp + (size_t)g * d;
				round_into(b, q, qb + ((size_t)(t - t0) * QH + h * G + g) * d);
				if (step >= 0)
					memcpy(b->qf + ((size_t)s * QH + h * G + g) * d, q,
					       d * sizeof(float));
			}
		}
	}
}

/* One prefill chunk: tokens [t0, t0 + n) of sequence s on layer l. */
static void prefill_chunk(kb_run *b, uint32_t s, uint32_t l, uint32_t t0, uint32_t n)
{
	const opts *o = &b->o;
	gen_tokens(b, s, l, t0, n, -1, b->k.host, b->v.host, b->q.host);
	buf_sync(&b->dev, &b->q, (size_t)n * o->q_heads * b->d * 2, KB_H2D);
	buf_sync(&b->dev, &b->k, (size_t)n * o->kv_heads * b->d * 2, KB_H2D);
	buf_sync(&b->dev, &b->v, (size_t)n * o->kv_heads * b->d * 2, KB_H2D);
	uint64_t t = now_ns();
	int rc = kvt_prefill(b->cache, b->ids[s], l, b->q.dev, b->k.dev, b->v.dev, n, NULL);
	dev_sync(&b->dev);
	t = now_ns() - t;
	b->ns_prefill += t;
	b->ns_lib += t;
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_prefill");
	size_t sl = (size_t)s * o->layers + l;
	rule_prefill(o, &b->len[sl], &b->n_idx[sl], n);
}

static uint32_t chunk_len(const opts *o, uint32_t t0)
{
	return o->context - t0 < o->chunk ? o->context - t0 : o->chunk;
}

void prefill_seq(kb_run *b, uint32_t s)
{
	const opts *o = &b->o;
	uint32_t chunks = (o->context + o->chunk - 1) / o->chunk;
	uint64_t per = (uint64_t)chunks * o->layers, done = s * per;
	for (uint32_t t0 = 0; t0 < o->context; t0 += o->chunk)
		for (uint32_t l = 0; l < o->layers; l++) {
			prefill_chunk(b, s, l, t0, chunk_len(o, t0));
			progress(&b->prog, "fill", ++done, per * o->seqs);
		}
	lru_touch(b, s);
}

/* Every sequence at once: chunk-major, layer-minor, as a runtime runs its layers over one chunk at
 * a time. */
void prefill_all(kb_run *b)
{
	const opts *o = &b->o;
	uint32_t chunks = (o->context + o->chunk - 1) / o->chunk;
	uint64_t done = 0, total = (uint64_t)chunks * o->layers * o->seqs;
	for (uint32_t t0 = 0; t0 < o->context; t0 += o->chunk)
		for (uint32_t l = 0; l < o->layers; l++)
			for (uint32_t s = 0; s < o->seqs; s++) {
				prefill_chunk(b, s, l, t0, chunk_len(o, t0));
				progress(&b->prog, "prefill", ++done, total);
			}
	for (uint32_t s = 0; s < o->seqs; s++)
		lru_touch(b, s);
	check_stats(b, &b->st_prefill, "after prefill");
}

/* ---- decode ------------------------------------------------------------------------------ */

void lru_touch(kb_run *b, uint32_t s)
{
	uint32_t i = 0;
	while (b->lru[i] != s)
		i++;
	memmove(b->lru + i, b->lru + i + 1, (b->o.seqs - 1 - i) * sizeof(uint32_t));
	b->lru[b->o.seqs - 1] = s;
}

static void decode_layer(kb_run *b, uint32_t step, uint32_t l)
{
	const opts *o = &b->o;
	uint32_t pos = o->context + step, len = pos + 1;
	uint16_t *kb = b->k.host, *vb = b->v.host, *qb = b->q.host;
	size_t kv_row = (size_t)o->kv_heads * b->d, q_row = (size_t)o->q_heads * b->d;
	int rc;
	for (uint32_t s = 0; s < o->seqs; s++)
		gen_tokens(b, s, l, pos, 1, (int32_t)step, kb + s * kv_row, vb + s * kv_row,
			   qb + s * q_row);
	buf_sync(&b->dev, &b->k, o->seqs * kv_row * 2, KB_H2D);
	buf_sync(&b->dev, &b->v, o->seqs * kv_row * 2, KB_H2D);
	buf_sync(&b->dev, &b->q, o->seqs * q_row * 2, KB_H2D);
	uint64_t t0 = now_ns();
	if ((rc = kvt_append(b->cache, l, o->seqs, b->ids, b->k.dev, b->v.dev, NULL)) < 0)
		lib_fail(b->cache, rc, "kvt_append");
	if ((rc = kvt_attend(b->cache, l, o->seqs, b->ids, b->q.dev, b->out.dev, NULL)) < 0)
		lib_fail(b->cache, rc, "kvt_attend");
	dev_sync(&b->dev);
	uint64_t t1 = now_ns();
	/* max_tokens = the sequence length is always enough, whatever was selected */
	rc = kvt_gather(b->cache, l, o->seqs, b->ids, len, b->counts, b->pos.dev, NULL, NULL, NULL);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_gather");
	uint64_t t2 = now_ns();
	b->ns_gather += t2 - t1;
	b->ns_lib += t2 - t0;
	b->step[step].ns += t1 - t0;
	buf_sync(&b->dev, &b->out, o->seqs * q_row * sizeof(float), KB_D2H);
	buf_sync(&b->dev, &b->pos, (size_t)o->seqs * o->kv_heads * len * sizeof(int32_t), KB_D2H);
	for (uint32_t s = 0; s < o->seqs; s++) {
		run_rule_append(b, (size_t)s * o->layers + l);
		evaluate(b, s, l, b->out.host, &b->step[step]);
	}
}

void decode_steps(kb_run *b, uint32_t first, uint32_t n)
{
	const opts *o = &b->o;
	uint64_t t0 = now_ns();
	for (uint32_t st = first; st < first + n; st++) {
		for (uint32_t l = 0; l < o->layers; l++) {
			decode_layer(b, st, l);
			progress(&b->prog, "decode", (uint64_t)(st - first) * o->layers + l + 1,
				 (uint64_t)n * o->layers);
		}
		check_stats(b, &b->st_end, "after a decode step");
		acc_add(&b->all, &b->step[st]);
		if (b->table) {
			progress_clear(&b->prog); /* the progress line shares the terminal */
			print_row(b, (int)st, &b->step[st]);
			fflush(stdout);
		}
	}
	b->ns_decode += now_ns() - t0;
	/* the library stamps a batch's sequences in the order given: ids[0] is used first */
	for (uint32_t s = 0; s < o->seqs; s++)
		lru_touch(b, s);
}

void standard_run(kb_run *b)
{
	prefill_all(b);
	tier_room_for_steps(b, b->o.steps);
	if (b->table) {
		print_header(b);
		print_columns();
	}
	decode_steps(b, 0, b->o.steps);
	if (b->table)
		print_row(b, -1, &b->all);
}

static double ratio(double x, double y)
{
	return y > 0 ? x / y : NAN;
}

/* What the sweep, the plan and the baseline table keep of a run. */
static void result_of(const kb_run *b, kb_result *r)
{
	const opts *o = &b->o;
	const kvt_stats *e = &b->st_end, *s = &b->st_prefill;
	const acc *a = &b->all;
	double sl = (double)b->steps_total * o->layers;
	*r = (kb_result){.context = o->context, .seqs = o->seqs, .layers = o->layers,
			 .topk = o->topk, .p = o->p};
	r->recall = ratio(a->recall_sum, (double)a->recall_n);
	r->recall_min = a->recall_min;
	r->correction = o->correction;
	r->budget_max = o->topk ? 0 : o->budget_max;
	r->rescore = o->rescore;
	r->keep = o->keep;
	r->misses = NAN; /* no trace: no simulated hot cache */
	r->rescore_k = ratio((double)(e->rescored_unselected - s->rescored_unselected),
			     (double)(e->candidate_tokens - s->candidate_tokens));
	run_percentiles(b, &r->recall_p5, &r->recall_p1);
	r->budget = ratio(a->budget_sum, (double)a->kv_n);
	r->oracle_budget = ratio(a->oracle_sum, (double)a->kv_n);
	r->err = sqrt(ratio(a->err2, a->full2));
	r->step_ms = (double)a->ns / 1e6 / sl;
	/* decode tokens (one per sequence and step) per second of append + attend over the layers run */
	r->tok_s = ratio((double)o->seqs * b->steps_total, (double)a->ns / 1e9);
	double h = (double)(e->hot_hits - s->hot_hits), m = (double)(e->hot_misses - s->hot_misses);
	r->hit_rate = ratio(h, h + m);
	r->pcie_step = (double)(e->pcie_bytes - s->pcie_bytes) / b->steps_total;
	const uint64_t e5[5] = {e->ns_index, e->ns_store, e->ns_score, e->ns_select, e->ns_attend};
	const uint64_t s5[5] = {s->ns_index, s->ns_store, s->ns_score, s->ns_select, s->ns_attend};
	for (int i = 0; i < 5; i++)
		r->stage_ms[i] = (double)(e5[i] - s5[i]) / 1e6 / sl;
	for (int i = 0; i < KB_N_BASE; i++) {
		const bacc *x = b->base ? base_acc(b->base, i) : NULL;
		r->base_recall[i] = x ? ratio(x->recall_sum, (double)x->recall_n) : NAN;
		r->base_budget[i] = x ? ratio(x->budget_sum, (double)x->kv_n) : NAN;
		r->base_err[i] = x ? sqrt(ratio(x->err2, x->full2)) : NAN;
	}
	r->host_used = e->host_bytes_used;
	r->index_bytes = e->index_bytes;
}

void run_point(const opts *o, const kb_plan *plan, kb_progress *prog, kb_result *r)
{
	kb_run *b = xcalloc(1, sizeof(*b));
	b->o = *o;
	uint64_t t0 = now_ns();
	setup(b);
	if (prog) {
		b->prog.hook = prog->hook;
		b->prog.hook_ctx = prog->hook_ctx;
	}
	standard_run(b);
	double wall = (double)(now_ns() - t0) / 1e9;
	if (!o->point) {
		if (o->json)
			print_json(b, NULL, wall);
		else
			print_summary(b, NULL, wall);
	}
	result_of(b, r);
	if (plan)
		r->plan = *plan;
	teardown(b);
	free(b);
}
