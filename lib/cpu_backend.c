/* SPDX-License-Identifier: MIT */
/* The CPU backend: the whole pipeline of DESIGN.md in plain C, and the twin of every GPU kernel. */
#include <math.h>
#include <string.h>

#include "half.h"
#include "internal.h"

/* Reject a non-finite element of a [rows, d] tensor, naming it. A 16-bit element is not finite
 * exactly when its exponent bits are all set, so blocks are tested on their bits (a loop the
 * compiler vectorizes), and only a block that holds one is read element by element to name it. */
static int check_finite(kvt_cache *c, const char *name, const void *x, uint32_t rows,
			uint32_t heads)
{
	enum { BLOCK = 512 };
	const size_t n = (size_t)rows * heads * c->d;
	const uint16_t *h = x, e = c->cfg.dtype == KVT_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
	for (size_t b = 0; b < n; b += BLOCK) {
		const size_t end = n - b < BLOCK ? n : b + BLOCK;
		unsigned hit = 0;
		for (size_t i = b; i < end; i++)
			hit |= (h[i] & e) == e;
		if (!hit)
			continue;
		for (size_t i = b; i < end; i++) {
			float f = kvt_load(x, i, c->cfg.dtype);
			if (!isfinite(f)) /* the row: the pipeline makes it a batch entry */
				return kvt_err_entry(
					c, (uint32_t)(i / c->d / heads),
					kvt_seterr(c, -EINVAL, "%s[%zu, %zu, %zu] = %g is not finite",
						   name, i / c->d / heads, i / c->d % heads, i % c->d,
						   (double)f));
		}
	}
	return 0;
}

static void load_vec(const kvt_cache *c, const void *base, size_t at, float *out)
{
	for (uint32_t j = 0; j < c->d; j++)
		out[j] = kvt_load(base, at + j, c->cfg.dtype);
}

/* Copy token t of a [n, H, d] K and V pair into the host-tier row of position pos. */
static void store_rows(kvt_cache *c, struct kvt_layer *l, const void *k, const void *v, uint32_t t,
		       uint32_t pos)
{
	const size_t half = c->d * c->elem;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		char *row = kvt_row(c, l, h, pos);
		size_t at = ((size_t)t * c->cfg.n_kv_heads + h) * half;
		memcpy(row, (const char *)k + at, half);
		memcpy(row + half, (const char *)v + at, half);
	}
}

/* Element j of key t of KV head h for the centroids: a chunk's keys [n, H, d], or (k == NULL) the
 * stored row of index position t, which is token n_sink + t. */
static float centroid_key(const kvt_cache *c, const struct kvt_layer *l, const void *k, uint32_t h,
			  uint32_t t, uint32_t j)
{
	if (k)
		return kvt_load(k, ((size_t)t * c->cfg.n_kv_heads + h) * c->d + j, c->cfg.dtype);
	return kvt_load(kvt_row(c, l, h, c->cfg.n_sink + t), j, c->cfg.dtype);
}

/* Freeze the centroids: mean of n keys and, when q is given, of the [n, n_q_heads, d] queries of
 * each KV head's group. The CUDA twin leaves non-finite elements out of the means; none reach this
 * one (check_finite refused them). */
static int cpu_centroids(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
			 const void *k, uint32_t n, void *stream)
{
	const uint32_t d = c->d, G = c->group;
	double acc[KVT_MAX_HEAD_DIM];
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		for (uint32_t j = 0; j < d; j++)
			acc[j] = 0.0;
		for (uint32_t t = 0; t < n; t++)
			for (uint32_t j = 0; j < d; j++)
				acc[j] += centroid_key(c, l, k, h, t, j);
		for (uint32_t j = 0; j < d; j++)
			l->c_k[(size_t)h * d + j] = (float)(acc[j] / n);
		for (uint32_t j = 0; j < d; j++)
			acc[j] = 0.0;
		for (uint32_t t = 0; q && t < n; t++)
			for (uint32_t g = 0; g < G; g++) {
				size_t at = ((size_t)t * c->cfg.n_q_heads + h * G + g) * d;
				for (uint32_t j = 0; j < d; j++)
					acc[j] += kvt_load(q, at + j, c->cfg.dtype);
			}
		for (uint32_t j = 0; j < d; j++)
			l->c_q[(size_t)h * d + j] = q ? (float)(acc[j] / ((double)n * G)) : 0.0f;
	}
	return 0;
}

/* Index positions [from, to) of each job from their host rows (stored before the chunk's index
 * job runs: the pipeline stores first). */
static int cpu_index(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_index_job *jobs,
		     bool before_store, void *stream)
{
	const uint32_t d = c->d;
	const float *rot = c->rot + (size_t)layer * d * d;
	float key[KVT_MAX_HEAD_DIM];
	uint64_t t0 = kvt_now_ns();
	for (uint32_t j = 0; j < n_jobs; j++) {
		const struct kvt_layer *l = jobs[j].l;
		for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
			for (uint32_t i = jobs[j].from; i < jobs[j].to; i++) {
				load_vec(c, kvt_row(c, l, h, c->cfg.n_sink + i), 0, key);
				size_t at = (size_t)h * l->idx_cap + i;
				kvt_index_build(d, rot, l->c_k + (size_t)h * d, l->c_q + (size_t)h * d,
						1, key, d, l->codes + at * c->words, l->sigma + at,
						l->beta + at);
			}
	}
	c->st.ns_index += kvt_now_ns() - t0;
	return 0;
}

static int cpu_reserve(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t index_tokens,
		       uint32_t staged, void *stream)
{
	return kvt_layer_reserve_index(c, l, index_tokens);
}

static int cpu_store(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_store_job *jobs,
		     void *stream)
{
	uint64_t t0 = kvt_now_ns();
	for (uint32_t j = 0; j < n_jobs; j++)
		for (uint32_t t = 0; t < jobs[j].n; t++)
			store_rows(c, jobs[j].l, jobs[j].k, jobs[j].v, t, jobs[j].first + t);
	c->st.ns_store += kvt_now_ns() - t0;
	return 0;
}

/* The token positions attended for KV head h of l's current selection, ascending. */
static uint32_t positions(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, int32_t *pos)
{
	const uint32_t S = kvt_sinks_of(c, l->sel_tokens), m = l->sel_n[h];
	const uint32_t *sel = l->sel + (size_t)h * l->idx_cap;
	uint32_t n = 0;
	for (uint32_t i = 0; i < S; i++)
		pos[n++] = (int32_t)i;
	for (uint32_t i = 0; i < m; i++)
		pos[n++] = (int32_t)(c->cfg.n_sink + sel[i]);
	for (uint32_t i = S + l->sel_indexed; i < l->sel_tokens; i++)
		pos[n++] = (int32_t)i;
	return n;
}

static float max_abs(uint32_t d, const float *x)
{
	float m = 0.0f;
	for (uint32_t j = 0; j < d; j++)
		m = fabsf(x[j]) > m || x[j] != x[j] ? fabsf(x[j]) : m;
	return m;
}

/*
 * A non-finite estimated score, blamed on its true cause. Index entries are saturated (an entry is
 * finite whatever the key: kvt_index_build), so with a finite entry the query is what overflows the
 * estimate: its residual's rotation and INT4 range, or its product with the key centroid.
 */
static int score_error(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t qh, uint32_t i,
		       uint32_t bad, const float *qf, const kvt_qcode *qc)
{
	const size_t at = (size_t)h * l->idx_cap + bad;
	const float sg = kvt_f16_to_f32(l->sigma[at]), bt = kvt_f16_to_f32(l->beta[at]);
	if (!isfinite(sg) || !isfinite(bt))
		return kvt_seterr(c, -EINVAL,
				  "estimated score of indexed token %u (KV head %u, query head %u, "
				  "batch entry %u) is %g: the key's index entry is not finite (sigma "
				  "%g, beta %g)", bad, h, qh, i, (double)c->scores[bad], (double)sg,
				  (double)bt);
	return kvt_seterr(c, -EINVAL,
			  "estimated score of indexed token %u (KV head %u, query head %u, batch entry "
			  "%u) is %g: the query is too large for the estimate (max |q| = %g; its "
			  "rotated residual spans [%g, %g]; <q - c_q, c_k> = %g against the key "
			  "centroid's max |c_k| = %g); not the key: its index entry is finite (sigma %g, "
			  "beta %g, stored saturated at the fp16 maximum 65504)",
			  bad, h, qh, i, (double)c->scores[bad], (double)max_abs(c->d, qf),
			  (double)qc->x_l, (double)(qc->x_l + 15.0f * qc->delta), (double)qc->qc_ck,
			  (double)max_abs(c->d, l->c_k + (size_t)h * c->d), (double)sg, (double)bt);
}

/* Counters of kvt_stats that a call adds up as it goes, added to c->st by the caller only once
 * the call can no longer fail (kvtier.h: a failed call changes no counter but `errors`). */
struct sel_tally {
	uint64_t selected, max_hits, min_hits, rescored, rescored_unselected, rows;
};

static void tally_add(kvt_cache *c, const struct sel_tally *t)
{
	c->st.selected_tokens += t->selected;
	c->st.budget_max_hits += t->max_hits;
	c->st.budget_min_hits += t->min_hits;
	c->st.rescored_tokens += t->rescored;
	c->st.rescored_unselected += t->rescored_unselected;
	c->st.rows_fetched += t->rows;
	c->st.bytes_fetched += t->rows * c->row_bytes;
}

/*
 * Score the first ni indexed tokens of KV head h for each query head of its group (query row `row`
 * of q, [rows, n_q_heads, d]) and mark the union of their Top-p sets in c->mask[0, ni). The one
 * selection of the CPU backend: a decode step takes every indexed token (ni = l->n_indexed), a row
 * of a Top-p extend those at positions up to its own. The scores take the corrections of the
 * layer's next selection (a step commits it, a Top-p extend row only looks). Errors name batch
 * entry i.
 */
#define RESCORE_PIECE 256u /* rows per kvt_rows_get of the second stage */

/*
 * The second stage (rescore_p): the tokens of Top-p(rescore_p) on the estimate in scores (with
 * budget_min and budget_max as the step's) get their exact logits <q, k>, computed from the K half
 * of their rows (through the block cache for a spilled sequence), in place of the estimate; the
 * candidates join the group's union in cand + ni. qf: the query head's query as floats.
 */
static int rescore(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t ni,
		   const float *qf)
{
	const uint32_t d = c->d;
	uint8_t *cm = c->cand, *un = c->cand + ni;
	int clamped;
	uint32_t bad = 0, m = 0;
	memset(cm, 0, ni);
	if (kvt_topp_mark(c->scores, NULL, ni, c->scale, c->cfg.rescore_p, c->cfg.budget_min,
			  c->cfg.budget_max, c->work, cm, &clamped, &bad) < 0)
		return 0; /* a non-finite score: the step's own Top-p reports it */
	for (uint32_t k = 0; k < ni; k++)
		if (cm[k]) {
			c->cand_pos[m++] = (int32_t)(c->cfg.n_sink + k);
			un[k] = 1;
		}
	if (!m)
		return 0;
	/* in pieces, so that a spilled sequence's reads fit the block cache whatever m is */
	for (uint32_t r0 = 0; r0 < m; r0 += RESCORE_PIECE) {
		const uint32_t k = m - r0 < RESCORE_PIECE ? m - r0 : RESCORE_PIECE;
		KVT_TRY(kvt_rows_get(c, l, h, k, c->cand_pos + r0, c->rows));
		for (uint32_t r = 0; r < k; r++) {
			float e = 0.0f;
			for (uint32_t j = 0; j < d; j++)
				e += qf[j] * kvt_load(c->rows[r], j, c->cfg.dtype);
			/* an exact logit past float's range keeps its (saturated) estimate */
			if (isfinite(e))
				c->scores[c->cand_pos[r0 + r] - c->cfg.n_sink] = e;
		}
	}
	return 0;
}

/*
 * keep_weight (doc/hysteresis.md): the keys Top-p ranks the first ni indexed tokens of KV head h by,
 * the scores with ln(1 + keep_weight) / scale added to those that one of the layer's last
 * keep_steps kvt_select / kvt_attend calls that succeeded selected (their stamps), in c->keys;
 * NULL when it is off or nothing was selected yet, so that Top-p ranks by the scores themselves.
 */
static const float *keep_keys(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t ni)
{
	if (kvt_sel_slots(c) < 2 || !l->keep_step || c->cfg.p >= 1.0f)
		return NULL;
	const uint32_t *stamp = l->sel + ((size_t)c->cfg.n_kv_heads + h) * l->idx_cap;
	const uint32_t now = l->keep_step, R = c->cfg.keep_steps ? c->cfg.keep_steps : 1;
	const float bonus = logf(1.0f + c->cfg.keep_weight) / c->scale;
	for (uint32_t t = 0; t < ni; t++)
		c->keys[t] = stamp[t] && now - stamp[t] < R ? c->scores[t] + bonus : c->scores[t];
	return c->keys;
}

static int mark_head(kvt_cache *c, uint32_t layer, const struct kvt_layer *l, uint32_t h,
		     uint32_t ni, const void *q, size_t row, uint32_t i, struct sel_tally *t)
{
	const uint32_t d = c->d, G = c->group, cap = l->idx_cap;
	const float *rot = c->rot + (size_t)layer * d * d;
	if (ni == 0)
		return 0;
	memset(c->mask, 0, ni);
	const bool rs = c->cfg.rescore_p != 0.0f;
	if (rs)
		memset(c->cand + ni, 0, ni);
	const uint32_t gp = kvt_corr_heads(c, l); /* query heads whose corrections come together */
	kvt_qcode *qq = gp ? kvt_corr_queries(c) : NULL; /* those heads' prepared queries */
	const uint64_t now = l->corr_step + 1;
	const float *cq = l->c_q + (size_t)h * d, *ck = l->c_k + (size_t)h * d;
	const size_t at = (row * c->cfg.n_q_heads + h * G) * d;
	for (uint32_t g = 0; g < G; g++) {
		float qf[KVT_MAX_HEAD_DIM];
		kvt_qcode own, *qc = gp ? &qq[g % gp] : &own;
		uint64_t t0 = kvt_now_ns();
		load_vec(c, q, at + (size_t)g * d, qf);
		if (!gp) {
			kvt_query_prepare(d, rot, cq, ck, qf, qc);
		} else if (g % gp == 0) {
			/* the heads whose corrections come together, each prepared once for both */
			for (uint32_t gg = 0; gg < gp; gg++) {
				float q2[KVT_MAX_HEAD_DIM];
				if (gg)
					load_vec(c, q, at + (size_t)(g + gg) * d, q2);
				kvt_query_prepare(d, rot, cq, ck, gg ? q2 : qf, &qq[gg]);
			}
			kvt_corr_predict(c, l, h, g, gp, ni, now);
		}
		kvt_score(d, qc, ni, l->codes + (size_t)h * cap * c->words, l->sigma + (size_t)h * cap,
			  l->beta + (size_t)h * cap, c->scores);
		kvt_corr_apply(c, l, h, g, ni, now, c->scores);
		uint64_t t1 = kvt_now_ns(); /* the second stage is selection time */
		if (rs) {
			int rr = rescore(c, l, h, ni, qf);
			if (rr < 0)
				return kvt_err_entry(c, i, rr);
		}
		int clamped;
		uint32_t bad = 0;
		const float *keys = keep_keys(c, l, h, ni);
		int rc = kvt_topp_mark(c->scores, keys, ni, c->scale, c->cfg.p, c->cfg.budget_min,
				       c->cfg.budget_max, keys ? c->keys + c->scratch_cap : c->work,
				       c->mask, &clamped, &bad);
		c->st.ns_score += t1 - t0;
		c->st.ns_select += kvt_now_ns() - t1;
		if (rc < 0)
			return kvt_err_entry(c, i, score_error(c, l, h, h * G + g, i, bad, qf, qc));
		t->max_hits += clamped < 0;
		t->min_hits += clamped > 0;
	}
	for (uint32_t k = 0; rs && k < ni; k++) {
		t->rescored += c->cand[ni + k];
		t->rescored_unselected += c->cand[ni + k] && !c->mask[k];
	}
	return 0;
}

/* Score, threshold and union for KV head h of sequence i; fills l->sel for h; its counters into
 * *t. */
static int select_head(kvt_cache *c, uint32_t layer, const struct kvt_layer *l, uint32_t h,
		       const void *q, uint32_t i, struct sel_tally *t)
{
	const uint32_t ni = l->n_indexed;
	uint32_t *sel = l->sel + (size_t)h * l->idx_cap, m = 0;
	KVT_TRY(mark_head(c, layer, l, h, ni, q, i, i, t));
	for (uint32_t k = 0; k < ni; k++)
		if (c->mask[k])
			sel[m++] = k;
	l->sel_n[h] = m;
	t->selected += m;
	return 0;
}

static void store_out(const kvt_cache *c, void *out, size_t at, const float *o)
{
	for (uint32_t j = 0; j < c->d; j++) {
		if (c->cfg.out_dtype == KVT_DTYPE_F32)
			((float *)out)[at + j] = o[j];
		else if (c->cfg.out_dtype == KVT_DTYPE_BF16)
			((uint16_t *)out)[at + j] = kvt_f32_to_bf16(o[j]);
		else
			((uint16_t *)out)[at + j] = kvt_f32_to_f16(o[j]);
	}
}

/* Exact attention of KV head h's query group of batch entry i over its selection. Each query
 * chunk's corrections are recorded before its out is stored, so that an out that aliases q (the
 * same buffer, attention in place) never feeds an output to the record as a query. */
static int attend_head(kvt_cache *c, uint32_t layer, struct kvt_layer *l, uint32_t h,
		       const void *q, void *out, uint32_t i, struct sel_tally *t)
{
	const uint32_t d = c->d, G = c->group;
	int32_t *pos = (int32_t *)c->work; /* scores and work are free again here */
	uint64_t t0 = kvt_now_ns(), t_rec = 0;
	uint32_t n = positions(c, l, h, pos);
	int rc = 0;
	float *logits = kvt_corr_logits(c, n, &rc);
	KVT_TRY(rc);
	KVT_TRY(kvt_rows_get(c, l, h, n, pos, c->rows));
	/* the group's queries together, so that each row is converted once per pass */
	for (uint32_t g0 = 0; g0 < G; g0 += KVT_ATTENTION_GROUP) {
		const uint32_t gn = G - g0 < KVT_ATTENTION_GROUP ? G - g0 : KVT_ATTENTION_GROUP;
		float qf[KVT_ATTENTION_GROUP][KVT_MAX_HEAD_DIM], o[KVT_ATTENTION_GROUP][KVT_MAX_HEAD_DIM];
		float *qd = qf[0], *od = o[0]; /* packed: query g at g * d */
		const size_t at = ((size_t)i * c->cfg.n_q_heads + h * G + g0) * d;
		for (uint32_t g = 0; g < gn; g++)
			load_vec(c, q, at + (size_t)g * d, qd + (size_t)g * d);
		kvt_attention_group(d, c->cfg.dtype, c->scale, gn, qd, n, c->rows, od,
				    logits ? logits + (size_t)g0 * n : NULL);
		if (logits) {
			const uint64_t t1 = kvt_now_ns();
			rc = kvt_corr_record(c, l, layer, h, l->corr_step + 1, g0, gn, qd, n, logits);
			t_rec += kvt_now_ns() - t1;
			if (rc < 0)
				return rc;
		}
		for (uint32_t g = 0; g < gn; g++)
			store_out(c, out, at + (size_t)g * d, od + (size_t)g * d);
	}
	t->rows += n;
	c->st.ns_attend += kvt_now_ns() - t0 - t_rec;
	c->st.ns_score += t_rec; /* the corrections' estimates: scoring's share */
	return 0;
}

/*
 * Read ahead, in one submission, the spilled rows of every sequence and KV head of the batch that
 * the block cache misses, before the per-head kvt_rows_get calls use them.
 */
static int prefetch(kvt_cache *c, uint32_t n_seqs, struct kvt_layer *const *ls)
{
	int32_t *pos = (int32_t *)c->work;
	if (!c->bc)
		return 0;
	kvt_rows_prefetch_begin(c);
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < c->cfg.n_kv_heads && kvt_layer_spilled(c, ls[i]); h++)
			kvt_rows_prefetch_add(c, ls[i], h, positions(c, ls[i], h, pos), pos);
	const int rc = kvt_rows_prefetch(c);
	return rc < 0 ? kvt_rows_blame(c, rc, n_seqs, ls) : 0;
}

/* The step succeeded: its selection's positions take its stamp (keep_weight). */
static void keep_commit(kvt_cache *c, struct kvt_layer *l)
{
	const uint32_t H = c->cfg.n_kv_heads;
	if (kvt_sel_slots(c) < 2)
		return;
	const uint32_t now = ++l->keep_step;
	for (uint32_t h = 0; h < H; h++) {
		uint32_t *stamp = l->sel + ((size_t)H + h) * l->idx_cap;
		const uint32_t *sel = l->sel + (size_t)h * l->idx_cap;
		for (uint32_t j = 0; j < l->sel_n[h]; j++)
			stamp[sel[j]] = now;
	}
}

static int cpu_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		    const void *q, void *out, uint32_t *sel_n, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	struct sel_tally t = {0}; /* counted once the step has succeeded */
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++)
			KVT_TRY(select_head(c, layer, ls[i], h, q, i, &t));
	if (out)
		KVT_TRY(prefetch(c, n_seqs, ls));
	for (uint32_t i = 0; i < n_seqs; i++) {
		for (uint32_t h = 0; out && h < H; h++) {
			int rc = attend_head(c, layer, ls[i], h, q, out, i, &t);
			if (rc < 0)
				return kvt_err_entry(c, i, rc);
		}
		for (uint32_t h = 0; sel_n && h < H; h++)
			sel_n[(size_t)i * H + h] = ls[i]->sel_n[h];
	}
	tally_add(c, &t);
	for (uint32_t i = 0; i < n_seqs; i++) {
		kvt_corr_commit(c, ls[i], out != NULL);
		keep_commit(c, ls[i]);
	}
	return 0;
}

static int cpu_counts(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      uint32_t *sel_n, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	for (uint32_t i = 0; i < n_seqs; i++)
		memcpy(sel_n + (size_t)i * H, ls[i]->sel_n, sizeof *sel_n * H);
	return 0;
}

static int cpu_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      uint32_t max_tokens, int32_t *pos, void *k_out, void *v_out, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t half = c->d * c->elem;
	int32_t *tmp = (int32_t *)c->work;
	const void **rows = c->rows;
	uint64_t t0 = kvt_now_ns(), total = 0;
	if (k_out)
		KVT_TRY(prefetch(c, n_seqs, ls));
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			const struct kvt_layer *l = ls[i];
			size_t slot = (size_t)i * H + h;
			uint32_t n = positions(c, l, h, tmp);
			if (pos)
				memcpy(pos + slot * max_tokens, tmp, sizeof *tmp * n);
			int rc = k_out ? kvt_rows_get(c, l, h, n, tmp, rows) : 0;
			if (rc < 0)
				return kvt_err_entry(c, i, rc);
			for (uint32_t t = 0; k_out && t < n; t++) {
				const char *row = rows[t];
				size_t at = (slot * max_tokens + t) * half;
				memcpy((char *)k_out + at, row, half);
				memcpy((char *)v_out + at, row + half, half);
			}
			total += n;
		}
	if (k_out) {
		c->st.rows_fetched += total;
		c->st.bytes_fetched += total * c->row_bytes;
	}
	c->st.ns_attend += kvt_now_ns() - t0;
	return 0;
}

/* The rows of KV head h from position p to the end of p's block or `to`, whichever comes first,
 * into rows (spilled ones through the block cache, which holds a block's chunks at once): their
 * count, or a negative code. */
static int block_rows(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t p, uint32_t to,
		      const void **rows)
{
	int32_t pos[KVT_BLOCK_TOKENS];
	uint32_t end = (p / KVT_BLOCK_TOKENS + 1) * KVT_BLOCK_TOKENS, n;
	end = end < to ? end : to;
	for (n = 0; p + n < end; n++)
		pos[n] = (int32_t)(p + n);
	KVT_TRY(kvt_rows_get(c, l, h, n, pos, rows));
	return (int)n;
}

/* Rows [from, to) of l into K and V placed by m (skipped tokens left alone), one block of one KV
 * head at a time. */
static int cpu_read_rows_at(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
			    void *v, const struct kvt_rows_map *m, void *stream)
{
	const size_t half = c->d * c->elem;
	const void *rows[KVT_BLOCK_TOKENS];
	(void)stream;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
		for (uint32_t p = from; p < to;) {
			int n = block_rows(c, l, h, p, to, rows);
			if (n < 0)
				return n;
			for (int t = 0; t < n; t++) {
				int64_t at = kvt_rows_at(m, p - from + (uint32_t)t, h);
				if (at < 0)
					continue;
				memcpy((char *)k + (size_t)at * c->elem, rows[t], half);
				memcpy((char *)v + (size_t)at * c->elem, (const char *)rows[t] + half, half);
			}
			p += (uint32_t)n;
		}
	return 0;
}

/* Rows [from, to) of l into dense [n, H, d] K and V. */
static int cpu_read_rows(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
			 void *v, void *stream)
{
	const struct kvt_rows_map dense = {NULL, (uint64_t)c->cfg.n_kv_heads * c->d, c->d};
	return cpu_read_rows_at(c, l, from, to, k, v, &dense, stream);
}

/*
 * Causal attention of KV head h's query group over the chunk of l: n tokens stored at positions
 * first = l->n_tokens onwards, their queries rows row0 .. row0 + n of q (and of out). Query j
 * attends positions [0, first + j]: all of them, in ascending order, as kvt_attend at p = 1 does.
 * The rows are read a block at a time and fed to every query of the chunk that attends them.
 * buf: n G (2 d + 2) floats and n G words. Returns the rows attended, or a negative code.
 */
static int extend_head(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t row0,
		       uint32_t n, const void *q, void *out, float *buf)
{
	const uint32_t d = c->d, G = c->group, QH = c->cfg.n_q_heads, first = l->n_tokens;
	const size_t nq = (size_t)n * G;
	float *qf = buf, *acc = qf + nq * d, *m = acc + nq * d, *sum = m + nq;
	uint32_t *end = (uint32_t *)(sum + nq);
	const void *rows[KVT_BLOCK_TOKENS];
	for (size_t at = 0; at < nq; at++) {
		load_vec(c, q, ((row0 + at / G) * QH + h * G + at % G) * d, qf + at * d);
		end[at] = first + (uint32_t)(at / G) + 1;
	}
	kvt_attention_begin(d, (uint32_t)nq, m, sum, acc);
	for (uint32_t p = 0; p < first + n;) {
		int got = block_rows(c, l, h, p, first + n, rows);
		if (got < 0)
			return got;
		kvt_attention_feed(d, c->cfg.dtype, c->scale, (uint32_t)nq, qf, end, p,
				   (uint32_t)got, rows, m, sum, acc);
		p += (uint32_t)got;
	}
	kvt_attention_finish(d, (uint32_t)nq, sum, acc, qf);
	for (size_t at = 0; at < nq; at++)
		store_out(c, out, ((row0 + at / G) * QH + h * G + at % G) * d, qf + at * d);
	return (int)(first + n); /* rows attended: <= INT32_MAX (kvt_extend checks the lengths) */
}

/*
 * Whether position p is attended by the row whose selection is c->mask over the first `lim` of the
 * layer's ni indexed tokens (index position k is token S + k): sinks, marked indexed tokens,
 * the window. The caller keeps p at or below the row's position.
 */
static bool topp_takes(const kvt_cache *c, uint32_t ni, uint32_t lim, uint32_t p)
{
	const uint32_t S = c->cfg.n_sink;
	return p < S || p - S >= ni || (p - S < lim && c->mask[p - S]);
}

/*
 * Query row `row` of q (position P of entry i's layer l, which holds ni indexed tokens once the
 * chunk is in) through KV head h with Top-p selection: the indexed tokens at positions <= P
 * (the first lim) scored and selected as a decode step selects them (mark_head), then exact
 * attention of the group's queries over sinks, selected and window tokens up to P, ascending: the
 * order kvt_attend gives them, so a row over the same tokens gets kvt_attend's bits. Rows are read
 * a block at a time (spilled ones in place, as the exact path reads them). buf: G (2 d + 2)
 * floats. Returns the rows attended, or a negative code.
 */
static int topp_row(kvt_cache *c, uint32_t layer, const struct kvt_layer *l, uint32_t h,
		    uint32_t ni, uint32_t P, const void *q, void *out, size_t row, uint32_t i,
		    float *buf, struct sel_tally *t)
{
	const uint32_t d = c->d, G = c->group, S = c->cfg.n_sink;
	const uint32_t lim = P + 1 > S ? (P + 1 - S < ni ? P + 1 - S : ni) : 0;
	float *qf = buf, *acc = qf + (size_t)G * d, *m = acc + (size_t)G * d, *sum = m + G;
	const size_t at = (row * c->cfg.n_q_heads + h * G) * d;
	int32_t pos[KVT_BLOCK_TOKENS];
	const void *rows[KVT_BLOCK_TOKENS];
	uint32_t total = 0;
	KVT_TRY(mark_head(c, layer, l, h, lim, q, row, i, t));
	for (uint32_t k = 0; k < lim; k++)
		t->selected += c->mask[k];
	for (uint32_t g = 0; g < G; g++)
		load_vec(c, q, at + (size_t)g * d, qf + (size_t)g * d);
	kvt_attention_begin(d, G, m, sum, acc);
	for (uint32_t b = 0; b <= P; b += KVT_BLOCK_TOKENS) {
		uint32_t n = 0;
		for (uint32_t p = b; p <= P && p < b + KVT_BLOCK_TOKENS; p++)
			if (topp_takes(c, ni, lim, p))
				pos[n++] = (int32_t)p;
		if (!n)
			continue;
		KVT_TRY(kvt_rows_get(c, l, h, n, pos, rows));
		kvt_attention_feed(d, c->cfg.dtype, c->scale, G, qf, NULL, 0, n, rows, m, sum, acc);
		total += n;
	}
	kvt_attention_finish(d, G, sum, acc, qf);
	for (uint32_t g = 0; g < G; g++)
		store_out(c, out, at + (size_t)g * d, qf + (size_t)g * d);
	return (int)total; /* <= P + 1 <= INT32_MAX (kvt_extend checks the lengths) */
}

/* Every query row of entry i's chunk (rows row0 .. row0 + n of q) through KV head h, Top-p; the
 * rows each one attended added to *rows. */
static int topp_head(kvt_cache *c, uint32_t layer, const struct kvt_layer *l, uint32_t h,
		     uint32_t ni, uint32_t row0, uint32_t n, const void *q, void *out, uint32_t i,
		     float *buf, struct sel_tally *t, uint64_t *rows)
{
	for (uint32_t j = 0; j < n; j++) {
		int rc = topp_row(c, layer, l, h, ni, l->n_tokens + j, q, out, (size_t)row0 + j, i,
				  buf, t);
		if (rc < 0)
			return rc;
		*rows += (uint64_t)rc;
	}
	return 0;
}

static int cpu_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const uint32_t *cu, const uint32_t *indexed, const void *q, void *out,
		      void *stream)
{
	uint32_t most = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		most = cu[i + 1] - cu[i] > most ? cu[i + 1] - cu[i] : most;
	/* the exact path takes a chunk's queries at once, a Top-p row one query group */
	const size_t nq = (size_t)(indexed ? 1 : most) * c->group;
	const size_t bytes = nq * ((2 * c->d + 2) * sizeof(float) + sizeof(uint32_t));
	float *buf = kvt_mem_alloc(KVT_MEM_HOST, bytes);
	KVT_RETURN_IF(!buf, c, -ENOMEM, "out of memory for the queries of a %u-token chunk (%zu bytes)",
		      most, bytes);
	uint64_t t0 = kvt_now_ns(), rows = 0, sel0 = c->st.ns_score + c->st.ns_select;
	struct sel_tally t = {0};
	int rc = 0;
	uint32_t failed = 0;
	for (uint32_t i = 0; i < n_seqs && rc >= 0; i++)
		for (uint32_t h = 0; h < c->cfg.n_kv_heads && rc >= 0 && cu[i + 1] > cu[i]; h++) {
			failed = i;
			const uint32_t n = cu[i + 1] - cu[i];
			if (indexed) {
				rc = topp_head(c, layer, ls[i], h, indexed[i], cu[i], n, q, out, i, buf,
					       &t, &rows);
				continue;
			}
			rc = extend_head(c, ls[i], h, cu[i], n, q, out, buf);
			rows += rc > 0 ? (uint64_t)rc : 0;
		}
	/* the selection's own time went to ns_score and ns_select (mark_head) */
	c->st.ns_attend += kvt_now_ns() - t0 - (c->st.ns_score + c->st.ns_select - sel0);
	kvt_mem_free(KVT_MEM_HOST, buf, bytes);
	if (rc < 0) /* entry `failed`'s rows or scores (as cpu_step names its entry) */
		return kvt_err_entry(c, failed, rc);
	/* counted only when every entry was attended: a failed call counts no rows */
	t.rows = rows;
	tally_add(c, &t);
	return 0;
}

/* A dense tensor to or from a strided view, one head row at a time (lib/io_layout.c). */
static int cpu_copy_strided(kvt_cache *c, void *dst, const void *src, const struct kvt_strided *s,
			    bool to_view, void *stream)
{
	(void)c;
	(void)stream;
	for (size_t t = 0; t < s->n; t++)
		for (size_t h = 0; h < s->heads; h++) {
			const size_t view = t * s->token_pitch + h * s->head_pitch;
			const size_t dense = (t * s->heads + h) * s->width;
			if (to_view)
				memcpy((char *)dst + view, (const char *)src + dense, s->width);
			else
				memcpy((char *)dst + dense, (const char *)src + view, s->width);
		}
	return 0;
}

const struct kvt_backend_ops kvt_cpu_backend = {
	.name = "cpu",
	.check_finite = check_finite,
	.reserve = cpu_reserve,
	.centroids = cpu_centroids,
	.store = cpu_store,
	.index = cpu_index,
	.step = cpu_step,
	.counts = cpu_counts,
	.gather = cpu_gather,
	.read_rows = cpu_read_rows,
	.read_rows_at = cpu_read_rows_at,
	.extend = cpu_extend,
	.copy_strided = cpu_copy_strided,
	.read_rows_spilled = true,
	.extend_topp = true,
};
