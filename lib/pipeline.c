/* SPDX-License-Identifier: MIT */
/*
 * The pipeline of a cache, written once for both backends: what a prefill chunk, an append, a
 * decode step and a gather do to a (sequence, layer), in which order the backend's verbs run, and
 * what the counters say afterwards. Decided here: the window and flush rule, prefill targets,
 * which index positions come from tokens stored earlier and which from the chunk, selection epochs,
 * and the counters of kvt_stats that do not depend on the device. Both backends read the rows of
 * spilled blocks in place (through kvt_rows_get), so nothing is restored for a step. The backend
 * (struct kvt_backend_ops in internal.h) executes; it never calls tier policy.
 *
 * Failure: every verb that can fail for lack of memory (reserve, the host-tier blocks) runs before
 * the first verb that changes state, so a call that fails changes nothing the caller can observe.
 */
#include "internal.h"

/* The flush rule: appending up to n_tokens makes layer l flush when its window then holds W + B. */
static bool flush_due(const kvt_cache *c, const struct kvt_layer *l, uint32_t n_tokens)
{
	return n_tokens - kvt_sinks_of(c, n_tokens) - l->n_indexed >=
	       c->cfg.window + c->cfg.flush_batch;
}

static int enter(kvt_cache *c, void *stream)
{
	return c->ops->enter ? c->ops->enter(c, stream) : 0;
}

/* enter for the n layers of a call: a sequence of theirs that this enter (or one since the call's
 * own check) put in error fails the call before anything changes (kvt_layers_check_status). */
static int enter_batch(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls, bool batch,
		       void *stream)
{
	KVT_TRY(enter(c, stream));
	return kvt_layers_check_status(c, n, ls, batch);
}

/*
 * Refuse a non-finite element of x [rows, heads, d]. The backend's error names the row (err_entry);
 * cu (NULL: row i is batch entry i) maps rows to the entries of a varlen batch; a prefill
 * (one = true) has no batch.
 */
static int check_finite(kvt_cache *c, const char *name, const void *x, uint32_t rows,
			uint32_t heads, const uint32_t *cu, bool one)
{
	int rc = c->ops->check_finite ? c->ops->check_finite(c, name, x, rows, heads) : 0;
	if (rc >= 0 || c->err_entry < 0)
		return rc;
	if (one)
		c->err_entry = -1;
	else if (cu) {
		uint32_t e = 0;
		while (cu[e + 1] <= (uint32_t)c->err_entry)
			e++;
		c->err_entry = (int32_t)e;
	}
	return rc;
}

static uint32_t max_u32(uint32_t a, uint32_t b)
{
	return a > b ? a : b;
}

/*
 * What a prefill chunk of n tokens does to l, decided before anything runs: the chunk takes the
 * layer from `first` to `total` tokens and its index from ni0 to `target` entries; index positions
 * [ni0, stored_to) are tokens stored before the chunk (the old window), [chunk_from, target) tokens
 * of the chunk (from_chunk of them).
 */
struct prefill_plan {
	uint32_t n, first, total, ni0, target, stored_to, chunk_from, from_chunk;
};

static struct prefill_plan prefill_plan(const kvt_cache *c, const struct kvt_layer *l, uint32_t n)
{
	const uint32_t S = c->cfg.n_sink;
	struct prefill_plan p = {.n = n, .first = l->n_tokens, .ni0 = l->n_indexed};
	p.total = p.first + n;
	p.target = max_u32(kvt_prefill_target(c, p.total), p.ni0);
	p.stored_to = p.first > S ? (p.first - S < p.target ? p.first - S : p.target) : 0;
	p.chunk_from = (p.first > S ? p.first : S) - S;
	p.from_chunk = p.target > p.chunk_from ? p.target - p.chunk_from : 0;
	return p;
}

/* Room for the chunk's prefill run and index: what can fail before the chunk changes anything. */
static int prefill_reserve(kvt_cache *c, struct kvt_layer *l, uint32_t layer,
			   const struct prefill_plan *p, void *stream)
{
	KVT_TRY(kvt_layer_reserve_run(c, l));
	return c->ops->reserve(c, l, layer, p->target, p->from_chunk, stream);
}

/* The verbs of a prefill chunk after its host-tier rows were grown (see kvt_pipe_prefill). */
static int prefill_run(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
		       const void *k, const void *v, const struct prefill_plan *p, void *stream)
{
	const struct kvt_backend_ops *ops = c->ops;
	const uint32_t S = c->cfg.n_sink, H = c->cfg.n_kv_heads;
	if (!l->centroids)
		KVT_TRY(ops->centroids(c, l, layer, q, k, p->n, stream));
	struct kvt_index_job old = {.l = l, .from = p->ni0, .to = p->stored_to};
	if (p->stored_to > p->ni0)
		KVT_TRY(ops->index(c, layer, 1, &old, true, stream));
	const struct kvt_store_job store = {.l = l,
					    .k = k,
					    .v = v,
					    .first = p->first,
					    .n = p->n,
					    .window_from = S + p->target};
	KVT_TRY(ops->store(c, layer, 1, &store, stream));
	if (p->from_chunk) {
		const size_t at = (size_t)(p->chunk_from + S - p->first) * H * c->d * c->elem;
		struct kvt_index_job chunk = {
			.l = l, .from = p->chunk_from, .to = p->target, .keys = (const char *)k + at};
		KVT_TRY(ops->index(c, layer, 1, &chunk, false, stream));
	}
	return ops->end ? ops->end(c, stream) : 0;
}

/* The chunk's verbs succeeded: the layer holds it. */
static void prefill_commit(kvt_cache *c, struct kvt_layer *l, const struct prefill_plan *p)
{
	if (!l->centroids)
		l->cent_keep = p->first + 1;
	l->centroids = true;
	kvt_layer_note_run(l, p->first, p->total, p->ni0);
	l->n_tokens = p->total;
	c->st.tokens += p->n;
	c->st.tokens_indexed += p->target - p->ni0;
	l->n_indexed = p->target;
	l->sel_epoch = 0;
}

/*
 * A verb that fails after the host-tier rows were grown (a device allocation, a sticky device
 * error) gives the grown blocks back and reads back the sequences spilled to make room for them:
 * the call changes nothing (issue 11, defect 3).
 */
static int undo_grow(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls,
		     const struct kvt_tier_mark *m, int rc, void *stream)
{
	/* queued device work may still write the grown blocks: drained before they are reused
	 * (its own error, on a device that failed already, adds nothing to rc) */
	kvt_err_mute(c, true); /* rc's text stands: what the clean-up meets adds nothing to it */
	if (c->ops->quiesce)
		(void)c->ops->quiesce(c);
	kvt_layers_ungrow(c, n, ls);
	/* and the backend's window copies (a stored chunk may have written over slots of theirs) */
	for (uint32_t i = 0; i < n && c->ops->rewind; i++)
		(void)c->ops->rewind(c, ls[i], stream);
	kvt_err_mute(c, false);
	return kvt_tier_undo(c, m, rc);
}

int kvt_pipe_prefill(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
		     const void *k, const void *v, uint32_t n, void *stream)
{
	const struct prefill_plan p = prefill_plan(c, l, n);
	KVT_TRY(enter_batch(c, 1, &l, false, stream));
	KVT_TRY(check_finite(c, "k", k, n, c->cfg.n_kv_heads, NULL, true));
	if (q)
		KVT_TRY(check_finite(c, "q", q, n, c->cfg.n_q_heads, NULL, true));
	KVT_TRY(prefill_reserve(c, l, layer, &p, stream));
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	KVT_TRY(kvt_layers_grow_rows(c, 1, &l, &p.total));
	int rc = prefill_run(c, l, layer, q, k, v, &p, stream);
	if (rc < 0)
		return undo_grow(c, 1, &l, &m, rc, stream);
	prefill_commit(c, l, &p);
	return 0;
}

/* The chunks of an extend stored and indexed, then attended (see kvt_pipe_extend); with Top-p the
 * backend gets each entry's index count with its chunk in. */
static int extend_run(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const uint32_t *cu, const void *q, const void *k, const void *v, void *out,
		      bool topp, void *stream)
{
	const size_t q_row = (size_t)c->cfg.n_q_heads * c->d * c->elem;
	const size_t kv_row = (size_t)c->cfg.n_kv_heads * c->d * c->elem;
	uint32_t *indexed = topp ? c->sel_counts : NULL;
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct prefill_plan p = prefill_plan(c, ls[i], cu[i + 1] - cu[i]);
		if (indexed)
			indexed[i] = p.target;
		if (p.n)
			KVT_TRY(prefill_run(c, ls[i], layer, (const char *)q + cu[i] * q_row,
					    (const char *)k + cu[i] * kv_row,
					    (const char *)v + cu[i] * kv_row, &p, stream));
	}
	kvt_rows_round(c, n_seqs, ls);
	return c->ops->extend(c, layer, n_seqs, ls, cu, indexed, q, out, stream);
}

/*
 * The step counters of a Top-p extend's chunk, each query row one step: candidates are the indexed
 * tokens at positions up to the row's, over the KV heads.
 */
static void extend_count_steps(kvt_cache *c, const struct prefill_plan *p)
{
	const uint32_t S = c->cfg.n_sink;
	uint64_t cand = 0;
	for (uint32_t P = p->first; P < p->total; P++)
		cand += P + 1 > S ? (P + 1 - S < p->target ? P + 1 - S : p->target) : 0;
	c->st.steps += p->n;
	c->st.candidate_tokens += cand * c->cfg.n_kv_heads;
}

/*
 * Entry i's chunk (rows cu[i] .. cu[i + 1] of q, k and v; none when they are equal) stored and
 * indexed as kvt_pipe_prefill stores a chunk, and attended causally by its queries (KVT_EXTEND_TOPP
 * in flags: each over its Top-p selection). All or nothing over the batch: every reservation and
 * the host-tier rows of all the chunks come first; the chunks are stored past each layer's length
 * and attended there; only when all of that succeeded do the layers take them (prefill_commit),
 * and a failure gives the rows back. A backend that reads only the host tier gets the spilled
 * sequences restored once the inputs are checked (a restore, and what it spilled to make room,
 * stay when a later part fails, as a step leaves them).
 */
int kvt_pipe_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		    struct kvt_layer *const *ls, const uint32_t *cu, const void *q, const void *k,
		    const void *v, void *out, uint32_t flags, void *stream)
{
	const bool topp = flags & KVT_EXTEND_TOPP;
	uint32_t *total = c->batch_tokens;
	KVT_TRY(enter_batch(c, n_seqs, ls, true, stream));
	KVT_TRY(check_finite(c, "k", k, cu[n_seqs], c->cfg.n_kv_heads, cu, false));
	KVT_TRY(check_finite(c, "q", q, cu[n_seqs], c->cfg.n_q_heads, cu, false));
	KVT_TRY(kvt_pipe_resident(c, n_seqs, seqs, cu, layer, stream));
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct prefill_plan p = prefill_plan(c, ls[i], cu[i + 1] - cu[i]);
		total[i] = p.total;
		if (p.n)
			KVT_TRY(prefill_reserve(c, ls[i], layer, &p, stream));
	}
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	KVT_TRY(kvt_layers_grow_rows(c, n_seqs, ls, total));
	/* a Top-p extend makes selections (decode steps on the CUDA backend) in the layers of the
	 * entries with new tokens: whatever happens, none made before stays readable there. An entry
	 * without new tokens is left untouched, its selection included. */
	for (uint32_t i = 0; topp && i < n_seqs; i++)
		if (cu[i + 1] > cu[i])
			ls[i]->sel_epoch = 0;
	int rc = extend_run(c, layer, n_seqs, ls, cu, q, k, v, out, topp, stream);
	if (rc < 0)
		return undo_grow(c, n_seqs, ls, &m, rc, stream);
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct prefill_plan p = prefill_plan(c, ls[i], cu[i + 1] - cu[i]);
		if (p.n && topp)
			extend_count_steps(c, &p);
		if (p.n)
			prefill_commit(c, ls[i], &p);
	}
	return 0;
}

/* The verbs of an append after its host-tier rows were grown (see kvt_pipe_append). */
static int append_run(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const void *k, const void *v, const struct kvt_index_job *jobs, uint32_t nj,
		      void *stream)
{
	const struct kvt_backend_ops *ops = c->ops;
	const uint32_t B = c->cfg.flush_batch;
	const size_t tok_bytes = (size_t)c->cfg.n_kv_heads * c->d * c->elem;
	struct kvt_store_job *sj = c->store_jobs;
	for (uint32_t i = 0; i < n_seqs; i++)
		sj[i] = (struct kvt_store_job){.l = ls[i],
					       .k = (const char *)k + i * tok_bytes,
					       .v = (const char *)v + i * tok_bytes,
					       .first = ls[i]->n_tokens,
					       .n = 1,
					       .window_from = c->cfg.n_sink + ls[i]->n_indexed};
	KVT_TRY(ops->store(c, layer, n_seqs, sj, stream));
	for (uint32_t j = 0; j < nj; j++)
		if (!jobs[j].l->centroids)
			KVT_TRY(ops->centroids(c, jobs[j].l, layer, NULL, NULL, B, stream));
	if (nj)
		KVT_TRY(ops->index(c, layer, nj, jobs, false, stream));
	return ops->end ? ops->end(c, stream) : 0;
}

int kvt_pipe_append(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		    const void *k, const void *v, void *stream)
{
	const struct kvt_backend_ops *ops = c->ops;
	const uint32_t B = c->cfg.flush_batch, H = c->cfg.n_kv_heads;
	uint32_t *total = c->batch_tokens;
	/* lazy flushes, decided once: the oldest B window tokens of each full window join the index */
	struct kvt_index_job *jobs = c->index_jobs;
	uint32_t nj = 0;
	KVT_TRY(enter_batch(c, n_seqs, ls, true, stream));
	KVT_TRY(check_finite(c, "k", k, n_seqs, H, NULL, false));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		total[i] = l->n_tokens + 1;
		bool flush = flush_due(c, l, total[i]);
		if (flush)
			jobs[nj++] = (struct kvt_index_job){
				.l = l, .from = l->n_indexed, .to = l->n_indexed + B};
		KVT_TRY(ops->reserve(c, l, layer, l->n_indexed + (flush ? B : 0), 0, stream));
	}
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	KVT_TRY(kvt_layers_grow_rows(c, n_seqs, ls, total));
	int rc = append_run(c, layer, n_seqs, ls, k, v, jobs, nj, stream);
	if (rc < 0)
		return undo_grow(c, n_seqs, ls, &m, rc, stream);
	for (uint32_t i = 0; i < n_seqs; i++) {
		ls[i]->n_tokens = total[i];
		ls[i]->sel_epoch = 0;
	}
	c->st.tokens += n_seqs;
	for (uint32_t j = 0; j < nj; j++) {
		if (!jobs[j].l->centroids)
			jobs[j].l->cent_keep = jobs[j].l->n_tokens;
		jobs[j].l->centroids = true;
		jobs[j].l->n_indexed += B;
	}
	c->st.tokens_indexed += (uint64_t)nj * B;
	c->st.flushes += nj;
	return 0;
}

/* Tokens attended by KV head h of l's current selection: sinks + m selected + window. */
static uint32_t attended(const struct kvt_layer *l, uint32_t m)
{
	return m + l->sel_tokens - l->sel_indexed;
}

int kvt_pipe_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
		  struct kvt_layer *const *ls, const void *q, void *out, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	uint32_t *sel_n = out ? NULL : c->sel_counts;
	KVT_TRY(enter_batch(c, n_seqs, ls, true, stream));
	KVT_TRY(check_finite(c, "q", q, n_seqs, c->cfg.n_q_heads, NULL, false));
	if (out || c->cfg.rescore_p != 0.0f) /* the second stage reads rows too */
		kvt_rows_round(c, n_seqs, ls);
	/* the selections are rewritten from here: a failure leaves none half made */
	for (uint32_t i = 0; i < n_seqs; i++) {
		ls[i]->sel_epoch = 0;
		ls[i]->sel_tokens = ls[i]->n_tokens;
		ls[i]->sel_indexed = ls[i]->n_indexed;
	}
	KVT_TRY(c->ops->step(c, layer, n_seqs, ls, q, out, sel_n, stream));
	uint32_t most = 0;
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		l->sel_epoch = ++c->clock;
		c->st.steps++;
		c->st.candidate_tokens += (uint64_t)l->n_indexed * H;
		for (uint32_t h = 0; sel_n && h < H; h++)
			most = max_u32(most, attended(l, sel_n[(size_t)i * H + h]));
	}
	return (int)most;
}

int kvt_pipe_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		    struct kvt_layer *const *ls, uint32_t max_tokens, int32_t *counts, int32_t *pos,
		    void *k_out, void *v_out, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	uint32_t *n = c->sel_counts;
	KVT_TRY(enter_batch(c, n_seqs, ls, true, stream));
	for (uint32_t i = 0; i < n_seqs; i++)
		if (!ls[i]->sel_epoch)
			return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
				"seq %u layer %u has no selection: call kvt_select or kvt_attend "
				"first", seqs[i], layer));
	KVT_TRY(c->ops->counts(c, layer, n_seqs, ls, n, stream));
	/* counts is written only once every one fits */
	uint64_t total = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			uint32_t *m = &n[(size_t)i * H + h];
			*m = attended(ls[i], *m);
			if (*m > max_tokens)
				return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
					"max_tokens = %u is smaller than the %u tokens selected for "
					"seqs[%u], KV head %u", max_tokens, *m, i, h));
			total += *m;
		}
	for (size_t i = 0; i < (size_t)n_seqs * H; i++)
		counts[i] = (int32_t)n[i];
	if (k_out)
		kvt_rows_round(c, n_seqs, ls);
	if (pos || k_out)
		KVT_TRY(c->ops->gather(c, layer, n_seqs, ls, max_tokens, pos, k_out, v_out, stream));
	return (int)total;
}
