/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's verbs of prefill and append (called by lib/pipeline.c in this order): reserve
 * the device index and staging, freeze the centroids, index tokens stored earlier (from the window
 * ring), store rows (host tier through the block table, window tokens also to the ring), and index
 * a chunk's keys or the flushed window tokens on the low-priority stream.
 */
#include "cuda_backend.h"

int gpu_reserve(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t index_tokens,
		uint32_t staged, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_seq_layer *g;
	KVT_TRY(gpu_mirror_get(c, l, &g));
	KVT_TRY(gpu_mirror_reserve(c, l, g, layer, index_tokens, stream));
	if (!staged)
		return 0;
	/* the staging buffer may still be read by the last chunk's build */
	if (b->staging_pending)
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, b->staging_ev, 0));
	const size_t tok_bytes = (size_t)c->cfg.n_kv_heads * c->d * c->elem;
	return gpu_grow(c, &b->staging, &b->staging_bytes, tok_bytes * staged, stream,
			"prefill staging");
}

int gpu_centroids(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q, const void *k,
		  uint32_t n, void *stream)
{
	const struct gpu_seq_layer *g = l->dev;
	const uint32_t H = c->cfg.n_kv_heads, d = c->d;
	const uint64_t re = c->row_bytes / c->elem; /* elements per ring row */
	KVT_TRY(gpu_wait_index(c, layer, stream));
	if (k)
		LAUNCH(c, kvt_gpu_centroids(d, c->cfg.dtype, H, c->group, k, (uint64_t)H * d, d, q, n,
					    g->cent, g->cent + (size_t)H * d, stream));
	else /* the oldest window tokens: index positions [0, n), ring slots [0, n) */
		LAUNCH(c, kvt_gpu_centroids(d, c->cfg.dtype, H, c->group, g->ring, re,
					    (uint64_t)g->wcap * re, NULL, n, g->cent,
					    g->cent + (size_t)H * d, stream));
	return 0;
}

int gpu_store(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_store_job *jobs,
	      void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads, d = c->d;
	kvt_gpu_store_job *sj = b->host;
	uint32_t max_n = 0;
	for (uint32_t i = 0; i < n_jobs; i++)
		KVT_TRY(gpu_mirror_sync_blocks(c, jobs[i].l, jobs[i].l->dev, stream));
	KVT_TRY(gpu_wait_index(c, layer, stream));
	for (uint32_t i = 0; i < n_jobs; i++) {
		const struct gpu_seq_layer *g = jobs[i].l->dev;
		sj[i] = (kvt_gpu_store_job){.k = jobs[i].k,
					    .v = jobs[i].v,
					    .blocks = (void *const *)g->blk,
					    .ring = g->ring,
					    .stride = (uint64_t)H * d,
					    .blk_cap = g->blk_cap,
					    .wcap = g->wcap,
					    .first = jobs[i].first,
					    .n = jobs[i].n,
					    .ring_from = jobs[i].window_from,
					    .n_sink = c->cfg.n_sink};
		max_n = jobs[i].n > max_n ? jobs[i].n : max_n;
	}
	struct gpu_timing *t = gpu_timing(c, stream, T_STORE);
	gpu_mark(t, 0, stream);
	LAUNCH(c, kvt_gpu_store_rows(d, H, n_jobs, sj, max_n, b->err, stream));
	gpu_mark(t, 1, stream);
	return 0;
}

/* Index jobs over index positions [from, to) held in g's window ring (two when it wraps). */
static uint32_t ring_jobs(const kvt_cache *c, const struct gpu_seq_layer *g, uint32_t view,
			  uint32_t from, uint32_t to, kvt_gpu_index_job *jobs)
{
	uint32_t n = 0;
	const uint64_t re = c->row_bytes / c->elem; /* elements per row */
	while (from < to) {
		uint32_t slot = from % g->wcap, len = to - from;
		len = len < g->wcap - slot ? len : g->wcap - slot;
		jobs[n++] = (kvt_gpu_index_job){
			.keys = (const char *)g->ring + (size_t)slot * c->row_bytes,
			.token_stride = re,
			.head_stride = re * g->wcap,
			.c_k = g->cent,
			.c_q = g->cent + c->cfg.n_kv_heads * c->d,
			.view = view,
			.first = from,
			.n = len};
		from += len;
	}
	return n;
}

/* Upload index jobs (and the views after them) to the layer's job area, then build on `stream`
 * or, behind it, on the low-priority stream. */
static int build(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const kvt_gpu_index_job *jobs,
		 uint32_t n_views, const kvt_gpu_index_view *views, void *stream, bool low_priority)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	const size_t jb = sizeof *jobs * n_jobs, vb = sizeof *views * n_views;
	kvt_gpu_index_job *dj = y->jobs;
	kvt_gpu_index_view *dv = (kvt_gpu_index_view *)((char *)y->jobs + gpu_up(jb));
	uint32_t max_n = 0;
	KVT_RETURN_IF(gpu_up(jb) + vb > b->jobs_bytes, c, -EINVAL,
		      "%u index jobs exceed the job area", n_jobs);
	for (uint32_t i = 0; i < n_jobs; i++)
		max_n = jobs[i].n > max_n ? jobs[i].n : max_n;
	LAUNCH(c, kvt_gpu_upload(dj, jobs, jb, stream));
	LAUNCH(c, kvt_gpu_upload(dv, views, vb, stream));
	void *on = stream;
	if (low_priority) {
		CU(c, cudaEventRecord(b->ready, (cudaStream_t)stream));
		CU(c, cudaStreamWaitEvent(b->idx, b->ready, 0));
		on = b->idx;
	}
	struct gpu_timing *t = gpu_timing(c, on, T_INDEX);
	gpu_mark(t, 0, on);
	LAUNCH(c, kvt_gpu_index_build(c->d, c->cfg.dtype, c->cfg.n_kv_heads,
				      b->rot + (size_t)layer * c->d * c->d, n_jobs, dj, max_n, dv,
				      b->err, on));
	gpu_mark(t, 1, on);
	if (low_priority) {
		CU(c, cudaEventRecord(y->indexed, b->idx));
		y->pending = true;
	}
	return 0;
}

/* A prefill chunk's keys: copied to staging in stream order (the caller may reuse its buffer),
 * indexed from there on the low-priority stream. */
static int index_chunk(kvt_cache *c, uint32_t layer, const struct kvt_index_job *job, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const struct gpu_seq_layer *g = job->l->dev;
	const uint32_t H = c->cfg.n_kv_heads, n = job->to - job->from;
	const size_t tok_bytes = (size_t)H * c->d * c->elem;
	CU(c, cudaMemcpyAsync(b->staging, job->keys, n * tok_bytes, cudaMemcpyDeviceToDevice,
			      (cudaStream_t)stream));
	const kvt_gpu_index_job kj = {.keys = b->staging,
				      .token_stride = (uint64_t)H * c->d,
				      .head_stride = c->d,
				      .c_k = g->cent,
				      .c_q = g->cent + (size_t)H * c->d,
				      .view = 0,
				      .first = job->from,
				      .n = n};
	const kvt_gpu_index_view view = gpu_mirror_view(g);
	KVT_TRY(build(c, layer, 1, &kj, 1, &view, stream, true));
	CU(c, cudaEventRecord(b->staging_ev, b->idx));
	b->staging_pending = true;
	return 0;
}

int gpu_index(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_index_job *jobs,
	      bool before_store, void *stream)
{
	KVT_TRY(gpu_wait_index(c, layer, stream));
	if (jobs[0].keys)
		return index_chunk(c, layer, &jobs[0], stream);
	/* tokens in the rings: up to two jobs per range, the views after them */
	kvt_gpu_index_job *kj = gpu_of(c)->host;
	kvt_gpu_index_view *views = (kvt_gpu_index_view *)(kj + 2 * n_jobs);
	uint32_t nj = 0;
	for (uint32_t i = 0; i < n_jobs; i++) {
		const struct gpu_seq_layer *g = jobs[i].l->dev;
		views[i] = gpu_mirror_view(g);
		nj += ring_jobs(c, g, i, jobs[i].from, jobs[i].to, kj + nj);
	}
	return build(c, layer, nj, kj, n_jobs, views, stream, !before_store);
}
