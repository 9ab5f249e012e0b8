/* SPDX-License-Identifier: MIT */
/* The CPU backend: the whole pipeline of DESIGN.md in plain C, and the twin of every GPU kernel. */
#include <math.h>
#include <string.h>

#include "half.h"
#include "internal.h"

/* Reject a non-finite element of a [rows, d] tensor, naming it. */
static int check_finite(kvt_cache *c, const char *name, const void *x, uint32_t rows,
			uint32_t heads)
{
	const size_t n = (size_t)rows * heads * c->d;
	for (size_t i = 0; i < n; i++) {
		float f = kvt_load(x, i, c->cfg.dtype);
		KVT_RETURN_IF(!isfinite(f), c, -EINVAL, "%s[%zu, %zu, %zu] = %g is not finite", name,
			      i / c->d / heads, i / c->d % heads, i % c->d, (double)f);
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

/* Freeze the centroids: mean of n keys (rows from `first` in the host tier) and, when q is given,
 * of the [n, n_q_heads, d] queries of each KV head's group. */
static void set_centroids(kvt_cache *c, struct kvt_layer *l, uint32_t first, uint32_t n,
			  const void *q)
{
	const uint32_t d = c->d, G = c->group;
	double acc[KVT_MAX_HEAD_DIM];
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		for (uint32_t j = 0; j < d; j++)
			acc[j] = 0.0;
		for (uint32_t t = 0; t < n; t++) {
			const void *row = kvt_row(c, l, h, first + t);
			for (uint32_t j = 0; j < d; j++)
				acc[j] += kvt_load(row, j, c->cfg.dtype);
		}
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
	l->centroids = true;
}

/* Index the tokens [n_indexed, to) of the index (positions n_sink + i) from their host rows. */
static void index_to(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t to)
{
	const uint32_t d = c->d, cap = l->idx_cap;
	const float *rot = c->rot + (size_t)layer * d * d;
	float key[KVT_MAX_HEAD_DIM];
	uint64_t t0 = kvt_now_ns();
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		for (uint32_t i = l->n_indexed; i < to; i++) {
			load_vec(c, kvt_row(c, l, h, c->cfg.n_sink + i), 0, key);
			size_t at = (size_t)h * cap + i;
			kvt_index_build(d, rot, l->c_k + (size_t)h * d, l->c_q + (size_t)h * d, 1, key,
					d, l->codes + at * c->words, l->sigma + at, l->beta + at);
		}
	}
	c->st.tokens_indexed += to - l->n_indexed;
	l->n_indexed = to;
	c->st.ns_index += kvt_now_ns() - t0;
}

static int cpu_prefill(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
		       const void *k, const void *v, uint32_t n, void *stream)
{
	(void)stream;
	KVT_TRY(check_finite(c, "k", k, n, c->cfg.n_kv_heads));
	if (q)
		KVT_TRY(check_finite(c, "q", q, n, c->cfg.n_q_heads));
	uint32_t first = l->n_tokens, total = first + n, target = kvt_prefill_target(c, total);
	target = target > l->n_indexed ? target : l->n_indexed;
	KVT_TRY(kvt_layer_reserve_index(c, l, target));
	KVT_TRY(kvt_layers_grow_rows(c, 1, &l, &total));
	/* nothing below can fail */
	uint64_t t0 = kvt_now_ns();
	for (uint32_t t = 0; t < n; t++)
		store_rows(c, l, k, v, t, first + t);
	c->st.ns_store += kvt_now_ns() - t0;
	if (!l->centroids)
		set_centroids(c, l, first, n, q);
	l->n_tokens = total;
	c->st.tokens += n;
	index_to(c, l, layer, target);
	l->sel_epoch = 0;
	return 0;
}

static int cpu_append(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const void *k, const void *v, void *stream)
{
	(void)stream;
	const uint32_t W = c->cfg.window, B = c->cfg.flush_batch;
	uint32_t *total = c->batch_tokens;
	KVT_TRY(check_finite(c, "k", k, n_seqs, c->cfg.n_kv_heads));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		total[i] = l->n_tokens + 1;
		uint32_t win = total[i] - kvt_sinks_of(c, total[i]) - l->n_indexed;
		KVT_TRY(kvt_layer_reserve_index(c, l, l->n_indexed + (win >= W + B ? B : 0)));
	}
	KVT_TRY(kvt_layers_grow_rows(c, n_seqs, ls, total));
	/* nothing below can fail */
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		uint64_t t0 = kvt_now_ns();
		store_rows(c, l, (const char *)k + (size_t)i * c->cfg.n_kv_heads * c->d * c->elem,
			   (const char *)v + (size_t)i * c->cfg.n_kv_heads * c->d * c->elem, 0,
			   l->n_tokens);
		c->st.ns_store += kvt_now_ns() - t0;
		l->n_tokens = total[i];
		c->st.tokens++;
		l->sel_epoch = 0;
		if (total[i] - kvt_sinks_of(c, total[i]) - l->n_indexed < W + B)
			continue;
		/* lazy flush: the oldest B window tokens join the index in one batch */
		if (!l->centroids)
			set_centroids(c, l, c->cfg.n_sink + l->n_indexed, B, NULL);
		index_to(c, l, layer, l->n_indexed + B);
		c->st.flushes++;
	}
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

/* Score, threshold and union for KV head h of sequence i; fills l->sel for h. */
static int select_head(kvt_cache *c, uint32_t layer, const struct kvt_layer *l, uint32_t h,
		       const void *q, uint32_t i)
{
	const uint32_t d = c->d, G = c->group, ni = l->n_indexed, cap = l->idx_cap;
	const float *rot = c->rot + (size_t)layer * d * d;
	uint32_t *sel = l->sel + (size_t)h * cap, m = 0;
	if (ni == 0) {
		l->sel_n[h] = 0;
		return 0;
	}
	memset(c->mask, 0, ni);
	for (uint32_t g = 0; g < G; g++) {
		float qf[KVT_MAX_HEAD_DIM];
		kvt_qcode qc;
		uint64_t t0 = kvt_now_ns();
		load_vec(c, q, ((size_t)i * c->cfg.n_q_heads + h * G + g) * d, qf);
		kvt_query_prepare(d, rot, l->c_q + (size_t)h * d, l->c_k + (size_t)h * d, qf, &qc);
		kvt_score(d, &qc, ni, l->codes + (size_t)h * cap * c->words, l->sigma + (size_t)h * cap,
			  l->beta + (size_t)h * cap, c->scores);
		uint64_t t1 = kvt_now_ns();
		int clamped;
		uint32_t bad = 0;
		int rc = kvt_topp_mark(c->scores, ni, c->scale, c->cfg.p, c->cfg.budget_min,
				       c->cfg.budget_max, c->work, c->mask, &clamped, &bad);
		c->st.ns_score += t1 - t0;
		c->st.ns_select += kvt_now_ns() - t1;
		KVT_RETURN_IF(rc < 0, c, -EINVAL,
			      "estimated score of indexed token %u (KV head %u, query head %u, batch "
			      "entry %u) is %g: the key's sigma or beta overflowed fp16",
			      bad, h, h * G + g, i, (double)c->scores[bad]);
		c->st.budget_max_hits += clamped < 0;
		c->st.budget_min_hits += clamped > 0;
	}
	for (uint32_t t = 0; t < ni; t++)
		if (c->mask[t])
			sel[m++] = t;
	l->sel_n[h] = m;
	c->st.selected_tokens += m;
	c->st.candidate_tokens += ni;
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

/* Exact attention of KV head h's query group of batch entry i over its selection. */
static int attend_head(kvt_cache *c, const struct kvt_layer *l, uint32_t h, const void *q,
		       void *out, uint32_t i)
{
	const uint32_t d = c->d, G = c->group;
	int32_t *pos = (int32_t *)c->work; /* scores and work are free again here */
	uint64_t t0 = kvt_now_ns();
	uint32_t n = positions(c, l, h, pos);
	KVT_TRY(kvt_rows_get(c, l, h, n, pos, c->rows));
	/* the group's queries together, so that each row is converted once per pass */
	for (uint32_t g0 = 0; g0 < G; g0 += KVT_ATTENTION_GROUP) {
		const uint32_t gn = G - g0 < KVT_ATTENTION_GROUP ? G - g0 : KVT_ATTENTION_GROUP;
		float qf[KVT_ATTENTION_GROUP][KVT_MAX_HEAD_DIM], o[KVT_ATTENTION_GROUP][KVT_MAX_HEAD_DIM];
		float *qd = qf[0], *od = o[0]; /* packed: query g at g * d */
		const size_t at = ((size_t)i * c->cfg.n_q_heads + h * G + g0) * d;
		for (uint32_t g = 0; g < gn; g++)
			load_vec(c, q, at + (size_t)g * d, qd + (size_t)g * d);
		kvt_attention_group(d, c->cfg.dtype, c->scale, gn, qd, n, c->rows, od);
		for (uint32_t g = 0; g < gn; g++)
			store_out(c, out, at + (size_t)g * d, od + (size_t)g * d);
	}
	c->st.rows_fetched += n;
	c->st.bytes_fetched += (uint64_t)n * c->row_bytes;
	c->st.ns_attend += kvt_now_ns() - t0;
	return 0;
}

/* The batch's selections are dropped, not left half made. */
static int drop_selections(struct kvt_layer *const *ls, uint32_t upto, int rc)
{
	for (uint32_t j = 0; j <= upto; j++)
		ls[j]->sel_epoch = 0;
	return rc;
}

static int cpu_attend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const void *q, void *out, void *stream)
{
	(void)stream;
	uint32_t most = 0;
	KVT_TRY(check_finite(c, "q", q, n_seqs, c->cfg.n_q_heads));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
			int rc = select_head(c, layer, l, h, q, i);
			if (rc < 0)
				return drop_selections(ls, i, rc);
		}
		l->sel_epoch = ++c->clock;
		l->sel_tokens = l->n_tokens;
		l->sel_indexed = l->n_indexed;
		c->st.steps++;
		for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
			uint32_t n = kvt_sinks_of(c, l->n_tokens) + l->sel_n[h] + kvt_window_count(c, l);
			most = n > most ? n : most;
			int rc = out ? attend_head(c, l, h, q, out, i) : 0;
			if (rc < 0)
				return drop_selections(ls, i, rc);
		}
	}
	return (int)most;
}

static int cpu_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      uint32_t max_tokens, int32_t *counts, int32_t *pos, void *k_out, void *v_out,
		      void *stream)
{
	(void)stream;
	(void)layer;
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t half = c->d * c->elem;
	int32_t *tmp = (int32_t *)c->work;
	const void **rows = c->rows;
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			const struct kvt_layer *l = ls[i];
			uint32_t n = kvt_sinks_of(c, l->sel_tokens) + l->sel_n[h] + l->sel_tokens -
				     kvt_sinks_of(c, l->sel_tokens) - l->sel_indexed;
			KVT_RETURN_IF(n > max_tokens, c, -EINVAL,
				      "max_tokens = %u is smaller than the %u tokens selected for "
				      "seqs[%u], KV head %u",
				      max_tokens, n, i, h);
		}
	uint64_t t0 = kvt_now_ns(), total = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			const struct kvt_layer *l = ls[i];
			size_t slot = (size_t)i * H + h;
			uint32_t n = positions(c, l, h, tmp);
			counts[slot] = (int32_t)n;
			if (pos)
				memcpy(pos + slot * max_tokens, tmp, sizeof *tmp * n);
			if (k_out)
				KVT_TRY(kvt_rows_get(c, l, h, n, tmp, rows));
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
	return (int)total;
}

static int cpu_probe(kvt_cache *c)
{
	(void)c;
	return 0;
}

const struct kvt_backend_ops kvt_cpu_backend = {
	.name = "cpu",
	.probe = cpu_probe,
	.prefill = cpu_prefill,
	.append = cpu_append,
	.attend = cpu_attend,
	.gather = cpu_gather,
};
