/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's verbs of a decode step and of a gather: the step's scratch carved from one
 * arena, its descriptors uploaded in one piece, then query preparation, scoring, the Top-p
 * threshold and union into the layer's selection, and (kvt_attend) the fetch of the selected rows
 * through the hot cache and exact attention. The step enqueues kernels, parameter uploads and one
 * small copy of the error word (and, with the self-sized hot cache, two of a counter): no
 * allocation once the scratch fits and the hot cache stops growing, and no host synchronization,
 * so it can be captured in a CUDA graph after warm-up steps at the same shape (gpu/hot.c).
 */
#include <math.h>

#include "cuda_backend.h"

/* The per-step scratch of a batch, carved from the arena. */
struct step_scratch {
	kvt_gpu_index_view *views;
	uint32_t *ntok;
	const float **cq, **ck;
	kvt_gpu_fetch_seq *fetch;
	size_t desc_bytes;
	kvt_gpu_qcode *qc;
	float *scores;
	kvt_gpu_topp *topp;
	kvt_gpu_segstats *stats; /* [n][Hq]: the scan's, for the threshold */
	kvt_gpu_bins ring;       /* the scan's first histogram (scanbins.h), or count NULL */
	size_t zero_bytes;       /* from stats on: the statistics and the ring, in one piece */
	kvt_gpu_topp *topp_r;    /* [n][Hq]: the threshold at rescore_p (the second stage) */
	void *rbits;             /* the candidates' union bits (the second stage's counts) */
	uint32_t *sel; /* [n][H][ld]: the selection's positions, from the layer's bits */
	uint32_t ld;
	kvt_gpu_selbits bits; /* the step's selection as bits, and its counts ([n][H]): the layer's,
				 or a graph step's own */
	kvt_gpu_keep keep;    /* keep_weight: the selections the step favors (keep_snapshot) */
	uint32_t *sel_n;
	void *sscratch;
	size_t sbytes;
	const void **rows;
	kvt_gpu_rows *items;
	int32_t *pos;
	void *ascratch;
	size_t abytes;
	size_t bytes;
	bool spilled; /* a sequence of the batch has blocks on NVMe (gpu/spilled.c) */
};

/* Whether a step's scan builds the threshold's first histogram: 1 when its scores overflow the L2
 * cache, 0 never, 2 always (compile-time, for an A/B). */
#ifndef KVT_STEP_RING
#define KVT_STEP_RING 1
#endif

/* Scratch of n sequences with ld scores each and at most max_rows rows per item, carved from base
 * (NULL: only the sizes). */
static struct step_scratch carve(const kvt_cache *c, char *base, uint32_t n, uint32_t ld,
				 uint32_t max_rows)
{
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads;
	struct step_scratch s;
	s.keep = (kvt_gpu_keep){0}; /* a step's own: keep_snapshot's */
	size_t o = 0;
#define PIECE(field, type, count)                                                                  \
	do {                                                                                       \
		s.field = (type)(base ? base + o : NULL);                                          \
		o += gpu_up((size_t)(count));                                                      \
	} while (0)
	/* the descriptors first, in one piece, so that one upload per step carries them; pointer
	 * arrays stay 8-byte aligned (views are 24 bytes, ntok is padded) */
	size_t at = sizeof(kvt_gpu_index_view) * n;
	s.views = (kvt_gpu_index_view *)base;
	s.ntok = (uint32_t *)(base ? base + at : NULL);
	at += (sizeof(uint32_t) * n + 7) & ~(size_t)7;
	s.cq = (const float **)(base ? base + at : NULL);
	at += sizeof(void *) * n;
	s.ck = (const float **)(base ? base + at : NULL);
	at += sizeof(void *) * n;
	s.fetch = (kvt_gpu_fetch_seq *)(base ? base + at : NULL);
	at += sizeof(kvt_gpu_fetch_seq) * n;
	s.desc_bytes = at;
	o = gpu_up(at);
	PIECE(qc, kvt_gpu_qcode *, sizeof(kvt_gpu_qcode) * n * Hq);
	PIECE(scores, float *, sizeof(float) * n * Hq * ld);
	PIECE(topp, kvt_gpu_topp *, sizeof(kvt_gpu_topp) * n * Hq);
	const size_t zero_at = o; /* the statistics and the ring, zeroed in one piece each step */
	PIECE(stats, kvt_gpu_segstats *, sizeof(kvt_gpu_segstats) * n * Hq);
	/* the scan bins its scores for the threshold (groups of at most 4) where that pays: when
	 * the scores overflow the L2 cache, so that the threshold's first pass would read them from
	 * HBM (figures in doc/selection.md) */
	const size_t score_bytes = sizeof(float) * n * Hq * ld;
	const bool ring = c->group <= 4 &&
			  (KVT_STEP_RING == 2 || (KVT_STEP_RING == 1 &&
						  score_bytes > gpu_of(c)->l2_bytes));
	PIECE(ring.count, uint32_t *, ring ? sizeof(uint32_t) * n * Hq * KVT_BINS : 0);
	PIECE(ring.dsum, unsigned long long *, ring ? 8 * (size_t)n * Hq * KVT_BINS : 0);
	s.zero_bytes = o - zero_at;
	s.ring.scale = c->scale;
	/* past the L2 a declined segment reads its scores again from HBM: the ring serves up to
	 * KVT_BINS_SERVE_MAX candidates (1M x 8: 1.98 ms a step where the default 512 gave
	 * 2.20-2.31) */
	s.ring.serve_max = KVT_BINS_SERVE_MAX;
	if (!ring)
		s.ring.count = NULL, s.ring.dsum = NULL;
	const bool rs = c->cfg.rescore_p != 0.0f;
	PIECE(topp_r, kvt_gpu_topp *, rs ? sizeof(kvt_gpu_topp) * n * Hq : 0);
	PIECE(rbits, void *, rs ? kvt_gpu_selbits_bytes((size_t)n * H, ld) : 0);
	PIECE(sel, uint32_t *, sizeof(uint32_t) * n * H * ld);
	s.ld = ld;
	s.sbytes = kvt_gpu_select_scratch_bytes(n, Hq, H, ld);
	PIECE(sscratch, void *, s.sbytes);
	PIECE(rows, const void **, sizeof(void *) * n * H * max_rows);
	PIECE(items, kvt_gpu_rows *, sizeof(kvt_gpu_rows) * n * H);
	PIECE(pos, int32_t *, sizeof(int32_t) * n * H * max_rows);
	s.abytes = kvt_gpu_attend_scratch_bytes(n, Hq, H, c->d, max_rows);
	PIECE(ascratch, void *, s.abytes);
#undef PIECE
	s.bytes = o;
	return s;
}

size_t gpu_step_host_bytes(const kvt_cache *c, uint32_t n_seqs)
{
	return carve(c, NULL, n_seqs, 4, 1).desc_bytes;
}

/* Rows of the longest (sequence, KV head) item the batch may attend, and the largest index, at the
 * lengths of the selection being made (or read back). */
static void bounds(const kvt_cache *c, uint32_t n_seqs, struct kvt_layer *const *ls,
		   uint32_t *max_ni, uint32_t *max_rows)
{
	const uint64_t bmax = c->cfg.budget_max;
	*max_ni = *max_rows = 0;
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		uint32_t nt = l->sel_tokens, ni = l->sel_indexed;
		uint64_t sel = ni;
		if (bmax && (uint64_t)c->group * bmax < sel)
			sel = (uint64_t)c->group * bmax;
		uint32_t rows = nt - ni + (uint32_t)sel; /* sinks + window + selected */
		*max_ni = ni > *max_ni ? ni : *max_ni;
		*max_rows = rows > *max_rows ? rows : *max_rows;
	}
}

/* Descriptors of the batch, in host scratch laid out as on the device, uploaded in one piece. */
static int upload_descriptors(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
			      struct kvt_layer *const *ls, bool reread, struct step_scratch *s,
			      void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads;
	char *h = b->host;
	kvt_gpu_index_view *views = (kvt_gpu_index_view *)h;
	uint32_t *ntok = (uint32_t *)(h + ((char *)s->ntok - (char *)s->views));
	const float **cq = (const float **)(h + ((char *)s->cq - (char *)s->views));
	const float **ck = (const float **)(h + ((char *)s->ck - (char *)s->views));
	kvt_gpu_fetch_seq *f = (kvt_gpu_fetch_seq *)(h + ((char *)s->fetch - (char *)s->views));
	uint32_t n_spilled = 0;
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		const struct gpu_seq_layer *g = l->dev;
		const uint32_t slot = reread ? g->sel_slot : i;
		views[i] = gpu_mirror_view(g);
		ntok[i] = l->sel_indexed;
		ck[i] = g->cent;
		cq[i] = g->cent + (size_t)H * c->d;
		f[i] = gpu_mirror_fetch(c, ls[i], g, l->sel_tokens, l->sel_indexed);
		f[i].sel = s->sel + (size_t)i * H * s->ld;
		f[i].sel_n = s->sel_n + (size_t)slot * H;
		f[i].sel_ld = s->ld;
		n_spilled += f[i].flags != 0;
	}
	/* the descriptors' upload also starts the step's epoch of the layer's hot cache */
	LAUNCH(c, kvt_gpu_upload_bump(s->views, h, s->desc_bytes, b->epochs + layer, stream));
	s->spilled = n_spilled != 0;
	return 0;
}

/* The run of batch entries from i on whose selections lie in consecutive slots of the layer's
 * last selection (the step's own batch is one run); *slot: the first's. */
static uint32_t slot_run(struct kvt_layer *const *ls, uint32_t n_seqs, uint32_t i, uint32_t *slot)
{
	uint32_t run = 1;
	*slot = ((const struct gpu_seq_layer *)ls[i]->dev)->sel_slot;
	while (i + run < n_seqs &&
	       ((const struct gpu_seq_layer *)ls[i + run]->dev)->sel_slot == *slot + run)
		run++;
	return run;
}

/* The positions of a gather's batch from the bits of the layer's last selection, into the step
 * scratch: one launch per run of consecutive slots, so the step's own batch takes one. */
static int list_selection(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
			  struct kvt_layer *const *ls, const struct step_scratch *s, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	for (uint32_t i = 0, run, slot; i < n_seqs; i += run) {
		run = slot_run(ls, n_seqs, i, &slot);
		kvt_gpu_selbits v = s->bits;
		v.mask += (size_t)slot * H * v.words;
		v.ccount += (size_t)slot * H * v.chunks;
		/* the counts are those of the step: rewritten with the same values */
		LAUNCH(c, kvt_gpu_selbits_list(run * H, v, s->sel + (size_t)i * H * s->ld, s->ld,
					       s->sel_n + (size_t)slot * H, stream));
	}
	return 0;
}

/* Which selection a step lays out: none (a gather rereads the last), the layer's (kvt_attend,
 * kvt_select), or kvt_attend_graph's own. */
enum sel_kind { SEL_NONE, SEL_STEP, SEL_GRAPH };

/* Carve the scratch of a step of n_seqs with max_ni index tokens and max_rows rows per item from
 * the arena, and lay out the selection `select` names for it in s->bits and s->sel_n (the layer's
 * y->bits and y->sel_n too for SEL_STEP; SEL_NONE: the layer's as they are); both grown when
 * short. */
static int step_scratch(kvt_cache *c, uint32_t layer, uint32_t n_seqs, uint32_t max_ni,
			uint32_t max_rows, enum sel_kind select, void *stream,
			struct step_scratch *s)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	const uint32_t ld = max_ni ? (max_ni + 3) & ~3u : 4;
	const uint32_t rows = max_rows ? max_rows : 1;
	*s = carve(c, NULL, n_seqs, ld, rows);
	KVT_TRY(gpu_grow(c, &b->arena, &b->arena_bytes, s->bytes, stream, "step scratch"));
	*s = carve(c, b->arena, n_seqs, ld, rows);
	if (select != SEL_NONE) {
		const size_t items = (size_t)n_seqs * c->cfg.n_kv_heads,
			     bits = kvt_gpu_selbits_bytes(items, max_ni);
		void **mem = select == SEL_GRAPH ? &y->g_sel_mem : &y->sel_mem;
		size_t *have = select == SEL_GRAPH ? &y->g_sel_bytes : &y->sel_bytes;
		KVT_TRY(gpu_grow(c, mem, have, bits + sizeof(uint32_t) * items, stream,
				 "the selection"));
		s->bits = kvt_gpu_selbits_at(*mem, items, max_ni);
		s->sel_n = (uint32_t *)((char *)*mem + bits);
		if (select == SEL_STEP) {
			y->bits = s->bits;
			y->sel_n = s->sel_n;
		}
	} else {
		s->bits = y->bits;
		s->sel_n = y->sel_n;
	}
	return 0;
}

int gpu_step_reserve(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct step_scratch s;
	for (uint32_t y = 0; y < c->cfg.n_layers; y++) {
		/* the layer's selection is laid out anew: none made before stays readable */
		b->lay[y].stamp = ++b->stamp;
		KVT_TRY(step_scratch(c, y, max_slots, max_tokens, max_tokens, SEL_GRAPH, stream,
				     &s));
		KVT_TRY(step_scratch(c, y, max_slots, max_tokens, max_tokens, SEL_STEP, stream,
				     &s));
	}
	return 0;
}

/* The sizes of a step of n_seqs with at most *max_ni index tokens and *max_rows rows per item
 * checked against the selection's limit and the reservation (whose bounds replace them), and its
 * scratch made (selection `sel`). */
static int step_size(kvt_cache *c, uint32_t layer, uint32_t n_seqs, uint32_t *max_ni,
		     uint32_t *max_rows, uint32_t *split, enum sel_kind sel, void *stream,
		     struct step_scratch *s)
{
	KVT_RETURN_IF(*max_ni > KVT_GPU_SELECT_MAX_N, c, -E2BIG,
		      "a sequence has %u indexed tokens on layer %u; the CUDA backend selects among at "
		      "most %u",
		      *max_ni, layer, KVT_GPU_SELECT_MAX_N);
	const uint32_t ni = *max_ni, rows = *max_rows;
	KVT_RETURN_IF(!gpu_graph_geometry(c, n_seqs, max_ni, max_rows, split), c, -E2BIG,
		      "a batch of %u sequences attending up to %u rows (%u indexed tokens) on layer "
		      "%u is outside kvt_graph_reserve's bounds (%u slots, %u tokens): its scratch "
		      "would move what captured graphs read; reserve larger bounds first",
		      n_seqs, rows, ni, layer, gpu_of(c)->g_slots, gpu_of(c)->g_tokens);
	return step_scratch(c, layer, n_seqs, *max_ni, *max_rows, sel, stream, s);
}

int gpu_step_prepare(kvt_cache *c, uint32_t layer, uint32_t n_seqs, uint32_t max_ni,
		     uint32_t max_rows, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct step_scratch s;
	uint32_t split;
	/* the layer's selection is laid out anew: none made before stays readable */
	b->lay[layer].stamp = ++b->stamp;
	return step_size(c, layer, n_seqs, &max_ni, &max_rows, &split, SEL_STEP, stream, &s);
}

/* Make room for a step's scratch and (unless reread: a gather of the last selection) the bits of
 * its selection, and upload its descriptors; a reread lists the last selection's positions.
 * Within kvt_graph_reserve's bounds the sizes are the reservation's (*split: the batch size the
 * attention's split is laid out for, 0: the batch's). */
static int step_setup(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      bool reread, void *stream, struct step_scratch *s, uint32_t *max_ni,
		      uint32_t *max_rows, uint32_t *split)
{
	bounds(c, n_seqs, ls, max_ni, max_rows);
	KVT_TRY(step_size(c, layer, n_seqs, max_ni, max_rows, split,
			  reread ? SEL_NONE : SEL_STEP, stream, s));
	KVT_TRY(upload_descriptors(c, layer, n_seqs, ls, reread, s, stream));
	return reread && *max_ni ? list_selection(c, layer, n_seqs, ls, s, stream) : 0;
}

/* The hot cache of a layer with its counters. */
static kvt_gpu_hot hot_of(const kvt_cache *c, uint32_t layer, uint32_t flags)
{
	struct gpu_cache *b = gpu_of(c);
	kvt_gpu_hot hot = b->lay[layer].hot;
	hot.counters = b->counters + (size_t)layer * KVT_GPU_CNT_N;
	hot.flags = flags;
	hot.epoch = b->epochs + layer;
	return hot;
}

/* Score and select into the layer's selection. */
static int select_rows(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const void *q,
		       const struct step_scratch *s, uint32_t max_ni, struct gpu_timing *t,
		       void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads, d = c->d;
	if (!max_ni) {
		gpu_mark(t, 1, stream);
		CU(c, cudaMemsetAsync(s->sel_n, 0, sizeof(uint32_t) * n_seqs * H,
				      (cudaStream_t)stream));
		return 0;
	}
	LAUNCH(c, kvt_gpu_query_prepare(d, c->cfg.dtype, n_seqs, Hq, H,
					b->rot + (size_t)layer * d * d, q, s->cq, s->ck, s->qc,
					stream));
	/* the statistics and the ring in one memset (the threshold leaves the ring zeroed, but a
	 * step that failed between the scan and the threshold would not) */
	CU(c, cudaMemsetAsync(s->stats, 0, s->zero_bytes, (cudaStream_t)stream));
	/* the ring, with this layer's counter of the thresholds it decides; none is built for a
	 * step whose only threshold ranks by keep_weight's keys (it bins scores, not keys) */
	const bool rs = c->cfg.rescore_p != 0.0f;
	unsigned long long *cnt = b->counters + (size_t)layer * KVT_GPU_CNT_N;
	kvt_gpu_bins rg = s->ring;
	rg.served = cnt + KVT_GPU_CNT_SCANHIST;
	const kvt_gpu_bins *ring = s->ring.count && (rs || !s->keep.mask) ? &rg : NULL;
	LAUNCH(c, kvt_gpu_score(d, n_seqs, Hq, H, s->qc, s->views, s->ntok, max_ni, s->scores,
				s->ld, s->stats, ring, b->err, stream));
	gpu_mark(t, 1, stream);
	kvt_gpu_selbits rbits = {0};
	if (rs) {
		/* the second stage: the candidates of Top-p(rescore_p) get their exact logits, then
		 * the threshold at p runs on them (its statistics gathered anew) */
		const kvt_gpu_hot hot = hot_of(c, layer, 0);
		rbits = kvt_gpu_selbits_at(s->rbits, (size_t)n_seqs * H, max_ni);
		LAUNCH(c, kvt_gpu_topp_select(n_seqs, Hq, H, s->scores, s->ld, s->ntok, max_ni,
					      c->scale, c->cfg.rescore_p, c->cfg.budget_min,
					      c->cfg.budget_max, s->stats, ring, s->topp_r, rbits, NULL,
					      NULL, s->sscratch, s->sbytes, b->err, stream));
		LAUNCH(c, kvt_gpu_rescore(d, c->cfg.dtype, n_seqs, Hq, H, s->fetch, hot, q,
					  s->topp_r, s->scores, s->ld, max_ni, stream));
	}
	/* with keep_weight's keys, pass 1 gathers their statistics (the scan's are the scores') */
	const bool own = rs || s->keep.mask;
	LAUNCH(c, kvt_gpu_topp_select(n_seqs, Hq, H, s->scores, s->ld, s->ntok, max_ni, c->scale,
				      c->cfg.p, c->cfg.budget_min, c->cfg.budget_max,
				      own ? NULL : s->stats, own ? NULL : ring, s->topp, s->bits,
				      &s->keep, cnt + KVT_GPU_CNT_BMAX, s->sscratch, s->sbytes,
				      b->err, stream));
	if (rs)
		LAUNCH(c, kvt_gpu_rescore_count(n_seqs * H, rbits, s->bits,
						cnt + KVT_GPU_CNT_RESCORED, stream));
	LAUNCH(c, kvt_gpu_selbits_list(n_seqs * H, s->bits, s->sel, s->ld, s->sel_n, stream));
	return 0;
}


/*
 * The rows of the batch's selections through the hot cache (flags: hot_of's; pos: positions out, or
 * NULL), rows of spilled blocks read from NVMe between the lookup and the fill; with rows == false
 * (a gather of positions only) a batch with spilled blocks gets its positions and reads nothing.
 * The caller calls gpu_spilled_done after the kernels that read the rows, whatever this returns.
 */
static int fetch(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		 const struct step_scratch *s, uint32_t flags, uint32_t max_rows, int32_t *pos,
		 bool rows, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads, rb = (uint32_t)c->row_bytes;
	const kvt_gpu_hot hot = hot_of(c, layer, flags);
	const uint32_t epoch = 0; /* read from hot.epoch on the device */
	if (!s->spilled) {
		LAUNCH(c, kvt_gpu_fetch(rb, n_seqs, H, s->fetch, hot, epoch, s->rows, s->items,
					max_rows, pos, b->err, stream));
		return 0;
	}
	if (!rows) {
		LAUNCH(c, kvt_gpu_fetch_lookup(rb, n_seqs, H, s->fetch, hot, epoch, s->rows,
					       s->items, max_rows, s->pos, b->err, stream));
		return 0;
	}
	kvt_gpu_spill_list list;
	KVT_TRY(gpu_spilled_list(c, layer, n_seqs, ls, max_rows, stream, &list));
	LAUNCH(c, kvt_gpu_fetch_lookup_spilled(rb, n_seqs, H, s->fetch, hot, epoch, s->rows,
					       s->items, max_rows, pos, list, b->err, stream));
	KVT_TRY(gpu_serve_spilled(c, layer, n_seqs, ls, s->rows, max_rows, stream));
	LAUNCH(c, kvt_gpu_fetch_fill(rb, n_seqs, H, s->fetch, hot, epoch, s->rows, s->items,
				     max_rows, b->err, stream));
	return 0;
}

/* Exact attention over the fetched rows, split as for a batch of `split` (0: n_seqs). */
static int attend(kvt_cache *c, uint32_t n_seqs, const void *q, const struct step_scratch *s,
		  uint32_t max_rows, uint32_t split, void *out, void *stream)
{
	return kvt_gpu_attend_split(c->d, c->cfg.dtype, c->cfg.out_dtype, n_seqs, c->cfg.n_q_heads,
				    c->cfg.n_kv_heads, c->scale, q, s->items, max_rows, split, out,
				    s->ascratch, s->abytes, gpu_of(c)->err, stream);
}

/* The selected counts of the batch's selections, copied to the host (synchronizes): one copy per
 * run of consecutive slots, so a step's own batch takes one. */
static int read_counts(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		       uint32_t *sel_n, void *stream)
{
	const struct gpu_layer *y = &gpu_of(c)->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads;
	for (uint32_t i = 0, run, slot; i < n_seqs; i += run) {
		run = slot_run(ls, n_seqs, i, &slot);
		CU(c, cudaMemcpyAsync(sel_n + (size_t)i * H, y->sel_n + (size_t)slot * H,
				      sizeof(uint32_t) * H * run, cudaMemcpyDeviceToHost,
				      (cudaStream_t)stream));
	}
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	KVT_TRY(gpu_check_err(c));
	/* an entry of this very step put in error by that check fails it (kvt_select) */
	return kvt_layers_check_status(c, n_seqs, ls, true);
}

/* Whether the layer's last selection holds what entry ls[i]'s next step favors (keep_weight). */
static bool keep_valid(const struct gpu_layer *y, const struct kvt_layer *l)
{
	const struct gpu_seq_layer *g = l->dev;
	return g && g->keep_stamp && g->keep_stamp == y->stamp;
}

/*
 * keep_weight (doc/hysteresis.md): before the step lays out its own selection over the layer's,
 * the bits each entry's step favors (its last selection on the layer, or a forked parent's, where
 * the layer's last selection holds it: keep_valid) copied into y->keep_mem, item i * H + h in the
 * words of that selection's layout, the others' zeroed; *keep names them, or no mask when nothing
 * is favored (keep_weight 0, p >= 1 as on the CPU, or no entry's selection stands).
 */
static int keep_snapshot(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
			 struct kvt_layer *const *ls, void *stream, kvt_gpu_keep *keep)
{
	struct gpu_layer *y = &gpu_of(c)->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads, words = y->bits.words;
	*keep = (kvt_gpu_keep){0};
	if (c->cfg.keep_weight == 0.0f || c->cfg.p >= 1.0f || !y->bits.mask || !words)
		return 0;
	bool any = false;
	for (uint32_t i = 0; i < n_seqs; i++)
		any |= keep_valid(y, ls[i]);
	if (!any)
		return 0;
	const size_t row = sizeof(uint32_t) * H * words;
	KVT_TRY(gpu_grow(c, &y->keep_mem, &y->keep_bytes, row * n_seqs, stream,
			 "the selections keep_weight favors"));
	const cudaStream_t st = (cudaStream_t)stream;
	CU(c, cudaMemsetAsync(y->keep_mem, 0, row * n_seqs, st));
	/* one copy per run of entries whose favored selections lie in consecutive slots */
	for (uint32_t i = 0, run; i < n_seqs; i += run) {
		run = 1;
		if (!keep_valid(y, ls[i]))
			continue;
		const uint32_t slot = ((const struct gpu_seq_layer *)ls[i]->dev)->keep_slot;
		while (i + run < n_seqs && keep_valid(y, ls[i + run]) &&
		       ((const struct gpu_seq_layer *)ls[i + run]->dev)->keep_slot == slot + run)
			run++;
		CU(c, cudaMemcpyAsync((char *)y->keep_mem + row * i,
				      (const char *)y->bits.mask + row * slot, row * run,
				      cudaMemcpyDeviceToDevice, st));
	}
	keep->mask = (const uint32_t *)y->keep_mem;
	keep->words = words;
	keep->bonus = logf(1.0f + c->cfg.keep_weight) / c->scale; /* the CPU's (cpu_backend.c) */
	return 0;
}

int gpu_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	     const void *q, void *out, uint32_t *sel_n, void *stream)
{
	return gpu_step_copy(c, layer, n_seqs, ls, q, out, sel_n, true, stream);
}

int gpu_step_copy(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		  const void *q, void *out, uint32_t *sel_n, bool copy_err, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads;
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct gpu_seq_layer *g;
		KVT_TRY(gpu_mirror_get(c, ls[i], &g));
		KVT_TRY(gpu_mirror_sync_blocks(c, ls[i], g, stream));
	}
	KVT_TRY(gpu_hot_before_step(c, layer, n_seqs, stream));
	kvt_gpu_keep keep;
	KVT_TRY(keep_snapshot(c, layer, n_seqs, ls, stream, &keep));
	/* the layer's selection buffer is regrown or rewritten from here: no earlier selection in it
	 * stays readable */
	y->stamp = ++b->stamp;
	struct step_scratch s;
	uint32_t max_ni, max_rows, split;
	KVT_TRY(step_setup(c, layer, n_seqs, ls, false, stream, &s, &max_ni, &max_rows, &split));
	s.keep = keep;
	KVT_TRY(gpu_wait_index(c, layer, stream));
	struct gpu_timing *t = gpu_timing(c, stream, T_STEP);
	gpu_mark(t, 0, stream);
	KVT_TRY(select_rows(c, layer, n_seqs, q, &s, max_ni, t, stream));
	gpu_mark(t, 2, stream);
	if (out) {
		int rc = fetch(c, layer, n_seqs, ls, &s, 0, max_rows, NULL, true, stream);
		int r = rc < 0 ? 0 : attend(c, n_seqs, q, &s, max_rows, split, out, stream);
		if (r < 0)
			rc = kvt_seterr(c, r, "kvt_gpu_attend: %s", kvt_strerror(r));
		/* staged rows stay untouched until whatever was queued has read them */
		int done = gpu_spilled_done(c, stream);
		/* the selection's kernels ran: their errors go with this batch, failed or not */
		int copied = copy_err ? gpu_err_copy_batch(c, layer, n_seqs, ls, stream) : 0;
		KVT_TRY(rc);
		KVT_TRY(done);
		KVT_TRY(copied);
	} else if (copy_err) {
		KVT_TRY(gpu_err_copy_batch(c, layer, n_seqs, ls, stream));
	}
	gpu_mark(t, 3, stream);
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct gpu_seq_layer *g = ls[i]->dev;
		g->sel_stamp = g->keep_stamp = y->stamp;
		g->sel_slot = g->keep_slot = i;
	}
	y->steps += n_seqs;
	if (sel_n) {
		/* kvt_select: the caller needs the counts now; the fetch did not count them */
		KVT_TRY(read_counts(c, layer, n_seqs, ls, sel_n, stream));
		for (size_t i = 0; i < (size_t)n_seqs * H; i++)
			y->selected += sel_n[i];
	}
	return gpu_hot_after_step(c, layer, stream);
}

int gpu_counts(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       uint32_t *sel_n, void *stream)
{
	const struct gpu_layer *y = &gpu_of(c)->lay[layer];
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct gpu_seq_layer *g = ls[i]->dev;
		if (!g || g->sel_stamp != y->stamp)
			return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
				"seqs[%u]: its selection on layer %u was replaced by a later "
				"kvt_select or kvt_attend of another batch on that layer", i, layer));
	}
	return read_counts(c, layer, n_seqs, ls, sel_n, stream);
}

int gpu_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       uint32_t max_tokens, int32_t *pos, void *k_out, void *v_out, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	for (uint32_t i = 0; i < n_seqs; i++)
		KVT_TRY(gpu_mirror_sync_blocks(c, ls[i], ls[i]->dev, stream));
	struct step_scratch s;
	uint32_t max_ni, max_rows, split;
	KVT_TRY(step_setup(c, layer, n_seqs, ls, true, stream, &s, &max_ni, &max_rows, &split));
	/* the selection was counted when it was made */
	int rc = fetch(c, layer, n_seqs, ls, &s, KVT_GPU_HOT_NO_STEP, max_rows, s.pos, k_out != NULL,
		       stream);
	int r = rc < 0 ? 0 : kvt_gpu_rows_copy(c->d, n_seqs * H, s.items, max_rows, s.pos, k_out,
					       v_out, pos, max_tokens, stream);
	if (r < 0)
		rc = kvt_seterr(c, r, "kvt_gpu_rows_copy: %s", kvt_strerror(r));
	int done = gpu_spilled_done(c, stream);
	KVT_TRY(rc);
	KVT_TRY(done);
	return gpu_err_copy(c, stream);
}

/* gpu_attend_graph's kernels over the scratch s (its selection in the graph steps' own memory). */
static int graph_step(kvt_cache *c, uint32_t layer, const kvt_graph_batch *gb, const void *q,
		      void *out, struct step_scratch *s, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	const uint32_t n = gb->n_slots, H = c->cfg.n_kv_heads;
	s->spilled = false;
	const kvt_gpu_graph_step st = {
		.table = (const kvt_gpu_graph_row *)b->g_table + (size_t)layer * c->cfg.max_seqs,
		.max_seqs = c->cfg.max_seqs,
		.max_tokens = b->g_tokens,
		.layer = layer,
		.seqs = gb->seqs,
		.lengths = gb->lengths,
		.valid = gb->valid,
		.zero = b->g_zero,
		.sel = s->sel,
		.sel_ld = s->ld,
		.sel_n = s->sel_n,
		.epoch = b->epochs + layer,
	};
	LAUNCH(c, kvt_gpu_graph_desc(&st, n, H, s->views, s->ntok, s->cq, s->ck, s->fetch, b->err,
				     stream));
	if (gpu_capturing(stream))
		/* a replay waits for the index builds queued before it, whenever it is launched */
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, y->indexed, cudaEventWaitExternal));
	else
		KVT_TRY(gpu_wait_index(c, layer, stream));
	KVT_TRY(select_rows(c, layer, n, q, s, b->g_tokens, NULL, stream));
	int rc = fetch(c, layer, n, NULL, s, 0, b->g_tokens, NULL, true, stream);
	int r = rc < 0 ? 0 : attend(c, n, q, s, b->g_tokens, b->g_slots, out, stream);
	if (r < 0)
		rc = kvt_seterr(c, r, "kvt_gpu_attend: %s", kvt_strerror(r));
	const int copied = gpu_err_copy(c, stream);
	KVT_TRY(rc);
	return copied;
}

/*
 * kvt_attend_graph: the step of gpu_step over the slots of `gb`, its descriptors built on the
 * device from the caller's slot buffers and the records of gpu/graph.c, at the reserved geometry
 * (scratch grown by kvt_graph_reserve, so nothing here allocates). Nothing of a sequence's host
 * state changes: its selection goes to the graph steps' own memory (the layer's, which kvt_gather
 * reads, stays as it was), and the step is counted only by the device counters.
 */
int gpu_attend_graph(kvt_cache *c, uint32_t layer, const kvt_graph_batch *gb, const void *q,
		     void *out, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t n = gb->n_slots;
	/* no keep_weight here: gpu_graph_reserve refused the reservation these steps need */
	KVT_TRY(gpu_hot_before_step(c, layer, n, stream));
	struct step_scratch s;
	KVT_TRY(step_scratch(c, layer, n, b->g_tokens, b->g_tokens, SEL_GRAPH, stream, &s));
	KVT_TRY(graph_step(c, layer, gb, q, out, &s, stream));
	return gpu_hot_after_step(c, layer, stream);
}
