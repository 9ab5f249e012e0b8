/* SPDX-License-Identifier: MIT */
/* The public interface: argument checks, sequence bookkeeping, dispatch to the backend (the calls
 * on one sequence are in api_seq.c). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "half.h"
#include "internal.h"

static const char *backend_name(uint32_t b)
{
	return b == KVT_BACKEND_CPU ? "CPU" : b == KVT_BACKEND_CUDA ? "CUDA" : "AUTO";
}

/* Pick the backend. Where the CUDA backend finds the device usable, the cache takes its memory
 * hooks whatever backend it runs: its host tier is pinned, as kvt_stats.host_pinned reports. */
static int choose_backend(kvt_cache *c, char *busid, size_t n)
{
	const struct kvt_backend_ops *cuda = kvt_cuda_backend_ops;
	uint32_t want = c->cfg.backend;
	struct kvt_err why = {.msg = "this build has no CUDA backend", .item = -1};
	int gpu = -ENODEV;
	if (c->cfg.device_busid) {
		KVT_RETURN_IF(!cuda, NULL, -EOPNOTSUPP,
			      "device_busid = \"%s\" but this build has no CUDA backend",
			      c->cfg.device_busid);
		gpu = cuda->find_device(c->cfg.device_busid, &c->cfg.device, &why);
		KVT_RETURN_IF(gpu < 0, NULL, gpu, "device_busid = \"%s\": %s", c->cfg.device_busid,
			      why.msg);
		c->cfg.device_busid = NULL; /* resolved: `device` is the ordinal from here on */
	}
	if (cuda)
		gpu = cuda->probe(c->cfg.device, busid, n, &why);
	if (gpu == 0)
		c->mem.hooks = cuda->mem_hooks;
	if (want == KVT_BACKEND_CPU || (want == KVT_BACKEND_AUTO && gpu != 0)) {
		c->ops = &kvt_cpu_backend;
		return 0;
	}
	KVT_RETURN_IF(!cuda, NULL, -EOPNOTSUPP,
		      "backend = CUDA (%u) but this build has no CUDA backend", want);
	KVT_RETURN_IF(gpu != 0, NULL, -ENODEV, "backend = %s, device = %d: %s", backend_name(want),
		      c->cfg.device, why.msg);
	c->ops = kvt_cuda_backend_ops;
	return 0;
}

static void cache_free(kvt_cache *c)
{
	if (c->seqs) {
		for (uint32_t s = 0; s < c->cfg.max_seqs; s++)
			if (c->seqs[s].open)
				kvt_seq_close(c, s);
	}
	kvt_share_fini(c);
	kvt_io_fini(c);
	kvt_graph_fini(c);
	if (c->ops && c->ops->fini)
		c->ops->fini(c);
	kvt_tier_fini(c);
	kvt_extents_fini(&c->host);
	kvt_pool_detach(&c->pool);
	kvt_mem_free(KVT_MEM_HOST, c->seqs, 0);
	kvt_mem_free(KVT_MEM_HOST, c->batch, 0);
	kvt_mem_free(KVT_MEM_HOST, c->batch_tokens, 0);
	kvt_mem_free(KVT_MEM_HOST, c->lru_saved, 0);
	kvt_mem_free(KVT_MEM_HOST, c->sel_counts, 0);
	kvt_mem_free(KVT_MEM_HOST, c->store_jobs, 0);
	kvt_mem_free(KVT_MEM_HOST, c->index_jobs, 0);
	kvt_mem_free(KVT_MEM_HOST, c->rot, 0);
	kvt_mem_free(KVT_MEM_HOST, c->scores, 0);
	kvt_mem_free(KVT_MEM_HOST, c->work, 0);
	kvt_mem_free(KVT_MEM_HOST, c->mask, 0);
	kvt_mem_free(KVT_MEM_HOST, c->cand, 0);
	kvt_mem_free(KVT_MEM_HOST, c->cand_pos, 0);
	kvt_mem_free(KVT_MEM_HOST, c->keys, 0);
	kvt_mem_free(KVT_MEM_HOST, c->rows, 0);
	kvt_corr_fini(c);
	kvt_mem_free(KVT_MEM_HOST, c, 0);
}

KVT_API int kvt_cache_create(const kvt_config *cfg, kvt_cache **out)
{
	KVT_RETURN_IF(!out, NULL, -EINVAL, "out is NULL");
	kvt_config resolved;
	KVT_TRY(kvt_config_load(cfg, &resolved));
	cfg = &resolved;
	kvt_cache *c = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c);
	KVT_RETURN_IF(!c, NULL, -ENOMEM, "out of memory allocating the cache (%zu bytes)", sizeof *c);
	c->cfg = resolved;
	c->err_entry = -1;
	c->d = cfg->head_dim;
	c->words = c->d / 32;
	c->group = cfg->n_q_heads / cfg->n_kv_heads;
	c->scale = cfg->scale;
	c->elem = 2;
	c->row_bytes = 2 * c->d * c->elem;
	c->out_elem = c->cfg.out_dtype == KVT_DTYPE_F32 ? 4 : 2;
	c->st.size = sizeof c->st;
	c->st.host_bytes_capacity = cfg->host_bytes;
	c->st.index_bytes_per_token_head = c->d / 8 + 4;
	char busid[32] = "";
	int rc = choose_backend(c, busid, sizeof busid);
	if (rc < 0) {
		kvt_mem_free(KVT_MEM_HOST, c, 0);
		return rc;
	}
	c->st.backend = c->ops->name;
	size_t rot_bytes = sizeof(float) * cfg->n_layers * c->d * c->d;
	c->rot = kvt_mem_alloc(KVT_MEM_HOST, rot_bytes);
	c->seqs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->seqs * cfg->max_seqs);
	c->batch = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->batch * cfg->max_seqs);
	c->batch_tokens = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->batch_tokens * cfg->max_seqs);
	c->lru_saved = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->lru_saved * cfg->max_seqs);
	c->sel_counts = kvt_mem_alloc(KVT_MEM_HOST,
				      sizeof *c->sel_counts * cfg->max_seqs * cfg->n_kv_heads);
	c->store_jobs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->store_jobs * cfg->max_seqs);
	c->index_jobs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->index_jobs * cfg->max_seqs);
	rc = kvt_extents_init(&c->host, cfg->host_bytes, KVT_BLOCK_TOKENS * c->row_bytes,
			      busid[0] ? busid : NULL, &c->mem, NULL);
	if (!c->rot || !c->seqs || !c->batch || !c->batch_tokens || !c->lru_saved || !c->sel_counts ||
	    !c->store_jobs || !c->index_jobs || rc < 0) {
		cache_free(c);
		return kvt_seterr(NULL, -ENOMEM, "out of memory allocating rotations (%zu bytes) or "
				  "the sequence table (%u sequences)", rot_bytes, cfg->max_seqs);
	}
	if (cfg->host_pool) {
		struct kvt_err e;
		rc = kvt_pool_attach(&c->pool, cfg->host_pool, cfg->host_pool_bytes, &e);
		if (rc < 0) {
			cache_free(c);
			return kvt_seterr(NULL, rc, "%s", e.msg);
		}
		c->host.pool = &c->pool;
		c->cfg.host_pool = c->pool.name; /* the caller's string need not outlive the call */
	}
	for (uint32_t l = 0; l < cfg->n_layers && rc == 0; l++)
		rc = kvt_rotation_generate(cfg->seed, l, c->d, c->rot + (size_t)l * c->d * c->d);
	if (rc == 0)
		rc = kvt_tier_init(c);
	if (rc < 0) {
		char why[512];
		snprintf(why, sizeof why, "%s", kvt_last_error(NULL));
		kvt_nvme_keep_none(c->nvme); /* a failed create keeps no file it made */
		cache_free(c);
		return kvt_seterr(NULL, rc, "%s", why);
	}
	if (c->ops->init)
		rc = c->ops->init(c);
	if (rc < 0) {
		char why[512];
		snprintf(why, sizeof why, "%s", c->err);
		const char *name = c->st.backend;
		kvt_nvme_keep_none(c->nvme);
		cache_free(c);
		return kvt_seterr(NULL, rc, "%s backend initialization failed: %s", name,
				  why[0] ? why : kvt_strerror(rc));
	}
	*out = c;
	return 0;
}

KVT_API void kvt_cache_destroy(kvt_cache *cache)
{
	if (cache)
		cache_free(cache);
}

/* The open sequence `seq`, or an error naming it. */
int kvt_seq_lookup(kvt_cache *c, uint32_t seq, struct kvt_seq **out)
{
	KVT_RETURN_IF(seq >= c->cfg.max_seqs || !c->seqs[seq].open, c, -ENOENT,
		      "seq = %u is not an open sequence", seq);
	*out = &c->seqs[seq];
	return 0;
}

int kvt_check_layer(kvt_cache *c, uint32_t layer)
{
	KVT_RETURN_IF(layer >= c->cfg.n_layers, c, -EINVAL, "layer = %u, must be < n_layers = %u",
		      layer, c->cfg.n_layers);
	return 0;
}

void kvt_lru_use(kvt_cache *c, struct kvt_lru_mark *m, uint32_t n, const uint32_t *seqs,
		 const uint32_t *cu)
{
	m->call_start = c->call_start;
	c->call_start = c->clock + 1;
	for (uint32_t i = 0; i < n; i++) {
		c->lru_saved[i] = c->seqs[seqs[i]].last_use;
		if (!cu || cu[i + 1] > cu[i])
			c->seqs[seqs[i]].last_use = ++c->clock;
	}
}

int64_t kvt_lru_done(kvt_cache *c, const struct kvt_lru_mark *m, uint32_t n, const uint32_t *seqs,
			 int64_t rc)
    {
	    if (rc >= 0)
		    return rc;
	for (uint32_t i = 0; i < n; i++)
		c->seqs[seqs[i]].last_use = c->lru_saved[i];
	c->call_start = m->call_start;
	return rc;
}

KVT_API int kvt_prefill_at(kvt_cache *c, uint32_t seq, uint32_t layer, const void *q,
			   const void *k, const void *v, uint32_t n_tokens,
			   const kvt_io_layout *layout, void *stream)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	KVT_TRY(kvt_check_layer(c, layer));
	KVT_RETURN_IF(!k || !v, c, -EINVAL, "%s is NULL", !k ? "k" : "v");
	KVT_RETURN_IF(n_tokens == 0, c, -EINVAL, "n_tokens = 0, must be >= 1");
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	KVT_TRY(kvt_seq_check_status(c, seq, s));
	struct kvt_layer *l = &s->layers[layer];
	KVT_RETURN_IF((uint64_t)l->n_tokens + n_tokens > INT32_MAX, c, -EINVAL,
		      "n_tokens = %u would grow seq %u layer %u past %d tokens", n_tokens, seq, layer,
		      INT32_MAX);
	struct kvt_io io = {.q = q, .k = k, .v = v};
	KVT_TRY(kvt_io_begin(c, "kvt_prefill_at", layout, n_tokens, &io, stream));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, 1, &seq, NULL);
	const int64_t rc = kvt_lru_done(c, &m, 1, &seq,
					kvt_pipe_prefill(c, l, layer, io.q, io.k, io.v, n_tokens,
							 stream));
	return kvt_graph_touch(c, 1, &seq, (int)layer, stream, rc);
}

KVT_API int kvt_prefill(kvt_cache *c, uint32_t seq, uint32_t layer, const void *q, const void *k,
			const void *v, uint32_t n_tokens, void *stream)
{
	return kvt_prefill_at(c, seq, layer, q, k, v, n_tokens, NULL, stream);
}

/* Resolve a batch of distinct open sequences to their layer state. */
static int batch(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		 struct kvt_layer **ls, void *stream)
{
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_seq *s = NULL;
		int rc = kvt_seq_lookup(c, seqs[i], &s);
		if (rc < 0)
			return kvt_err_entry(c, i, rc);
		for (uint32_t j = 0; j < i; j++)
			if (seqs[j] == seqs[i])
				return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
					"seqs[%u] = seqs[%u] = %u: a sequence appears twice in one batch",
					j, i, seqs[i]));
		ls[i] = &s->layers[layer];
	}
	/* errors the backend found since the last call go to their sequences (or fail this call
	 * when they name none), then a sequence in error fails the call naming its entry */
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	c->status_new = false;
	for (uint32_t i = 0; i < n_seqs; i++) {
		int rc = kvt_seq_check_status(c, seqs[i], &c->seqs[seqs[i]]);
		if (rc < 0)
			return kvt_err_entry(c, i, rc);
	}
	return 0;
}

/* Common checks of the batched calls; *ls receives the cache's batch array (no allocation on the
 * decode path). */
static int batch_args(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		      struct kvt_layer ***ls, void *stream)
{
	KVT_TRY(kvt_check_layer(c, layer));
	KVT_RETURN_IF(n_seqs == 0 || n_seqs > c->cfg.max_seqs, c, -EINVAL,
		      "n_seqs = %u, must be in [1, max_seqs = %u]", n_seqs, c->cfg.max_seqs);
	KVT_RETURN_IF(!seqs, c, -EINVAL, "seqs is NULL");
	*ls = c->batch;
	return batch(c, layer, n_seqs, seqs, *ls, stream);
}


KVT_API int kvt_append_at(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *k, const void *v, const kvt_io_layout *layout, void *stream)
{
	struct kvt_layer **ls;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!k || !v, c, -EINVAL, "%s is NULL", !k ? "k" : "v");
	KVT_TRY(batch_args(c, layer, n_seqs, seqs, &ls, stream));
	for (uint32_t i = 0; i < n_seqs; i++)
		if (ls[i]->n_tokens >= INT32_MAX)
			return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
					"seq %u layer %u holds %d tokens, the limit", seqs[i], layer,
					INT32_MAX));
	struct kvt_io io = {.k = k, .v = v};
	KVT_TRY(kvt_io_begin(c, "kvt_append_at", layout, n_seqs, &io, stream));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, n_seqs, seqs, NULL);
	const int64_t rc = kvt_lru_done(c, &m, n_seqs, seqs,
					kvt_pipe_append(c, layer, n_seqs, ls, io.k, io.v, stream));
	return kvt_graph_touch(c, n_seqs, seqs, (int)layer, stream, rc);
}

KVT_API int kvt_append(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *k, const void *v, void *stream)
{
	return kvt_append_at(c, layer, n_seqs, seqs, k, v, NULL, stream);
}

static int attend_common(kvt_cache *c, const char *call, uint32_t layer, uint32_t n_seqs,
			 const uint32_t *seqs, const void *q, void *out, const kvt_io_layout *lo,
			 void *stream)
{
	struct kvt_layer **ls;
	KVT_TRY(batch_args(c, layer, n_seqs, seqs, &ls, stream));
	for (uint32_t i = 0; i < n_seqs; i++)
		if (ls[i]->n_tokens == 0)
			return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
					"seq %u holds no tokens on layer %u", seqs[i], layer));
	struct kvt_io io = {.q = q, .out = out};
	KVT_TRY(kvt_io_begin(c, call, lo, n_seqs, &io, stream));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, n_seqs, seqs, NULL);
	int rc = kvt_pipe_step(c, layer, n_seqs, ls, io.q, io.out, stream);
	return (int)kvt_lru_done(c, &m, n_seqs, seqs, kvt_io_end(c, &io, rc, stream));
}

KVT_API int kvt_attend_at(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *q, void *out, const kvt_io_layout *layout, void *stream)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!q || !out, c, -EINVAL, "%s is NULL", !q ? "q" : "out");
	int rc = attend_common(c, "kvt_attend_at", layer, n_seqs, seqs, q, out, layout, stream);
	return rc < 0 ? rc : 0;
}

KVT_API int kvt_attend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *q, void *out, void *stream)
{
	return kvt_attend_at(c, layer, n_seqs, seqs, q, out, NULL, stream);
}

KVT_API int kvt_select_at(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *q, const kvt_io_layout *layout, void *stream)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!q, c, -EINVAL, "q is NULL");
	return attend_common(c, "kvt_select_at", layer, n_seqs, seqs, q, NULL, layout, stream);
}

KVT_API int kvt_select(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *q, void *stream)
{
	return kvt_select_at(c, layer, n_seqs, seqs, q, NULL, stream);
}

KVT_API int kvt_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       uint32_t max_tokens, int32_t *counts, int32_t *pos, void *k_out, void *v_out,
		       void *stream)
{
	struct kvt_layer **ls;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!counts, c, -EINVAL, "counts is NULL");
	KVT_RETURN_IF(!k_out != !v_out, c, -EINVAL, "%s is NULL but %s is not",
		      !k_out ? "k_out" : "v_out", !k_out ? "v_out" : "k_out");
	static const char *const names[] = {"pos", "k_out", "v_out"};
	const void *const ptrs[] = {pos, k_out, v_out};
	KVT_TRY(kvt_check_reach(c, "kvt_gather", 3, names, ptrs, stream));
	KVT_TRY(batch_args(c, layer, n_seqs, seqs, &ls, stream));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, n_seqs, seqs, NULL);
	return (int)kvt_lru_done(c, &m, n_seqs, seqs,
				 kvt_pipe_gather(c, layer, n_seqs, seqs, ls, max_tokens, counts, pos,
						 k_out, v_out, stream));
}

/* cu_seqlens [n_seqs + 1] of kvt_extend: from 0, never decreasing, a total of at least one row. */
static int check_seqlens(kvt_cache *c, uint32_t n_seqs, const uint32_t *cu)
{
	KVT_RETURN_IF(cu[0] != 0, c, -EINVAL, "cu_seqlens[0] = %u, must be 0", cu[0]);
	for (uint32_t i = 0; i < n_seqs; i++)
		KVT_RETURN_IF(cu[i + 1] < cu[i], c, -EINVAL,
			      "cu_seqlens[%u] = %u is below cu_seqlens[%u] = %u: must not decrease",
			      i + 1, cu[i + 1], i, cu[i]);
	KVT_RETURN_IF(cu[n_seqs] == 0, c, -EINVAL,
		      "cu_seqlens[%u] = 0: the batch has no new tokens (total 0)", n_seqs);
	KVT_RETURN_IF(cu[n_seqs] > INT32_MAX, c, -EINVAL, "cu_seqlens[%u] = %u, must be <= %d",
		      n_seqs, cu[n_seqs], INT32_MAX);
	return 0;
}

KVT_API int kvt_extend_at(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const uint32_t *cu_seqlens, const void *q, const void *k, const void *v,
			  void *out, uint32_t flags, const kvt_io_layout *layout, void *stream)
{
	struct kvt_layer **ls;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!q || !k || !v || !out, c, -EINVAL, "%s is NULL",
		      !q ? "q" : !k ? "k" : !v ? "v" : "out");
	KVT_RETURN_IF(!cu_seqlens, c, -EINVAL, "cu_seqlens is NULL");
	KVT_RETURN_IF(flags & ~(uint32_t)KVT_EXTEND_TOPP, c, -EINVAL,
		      "flags = 0x%x, unknown bits 0x%x (defined: KVT_EXTEND_TOPP = 0x%x)", flags,
		      flags & ~(uint32_t)KVT_EXTEND_TOPP, (unsigned)KVT_EXTEND_TOPP);
	KVT_RETURN_IF(!c->ops->extend, c, -EOPNOTSUPP,
		      "the %s backend has no multi-token attention (kvt_extend): store the chunks "
		      "with kvt_prefill and attend them with the runtime's own kernel", c->ops->name);
	KVT_RETURN_IF((flags & KVT_EXTEND_TOPP) && !c->ops->extend_topp, c, -EOPNOTSUPP,
		      "flags = KVT_EXTEND_TOPP: the %s backend attends kvt_extend's rows exactly only "
		      "(flags 0); Top-p per query row is the cpu backend's", c->ops->name);
	KVT_TRY(kvt_check_layer(c, layer));
	KVT_RETURN_IF(n_seqs == 0 || n_seqs > c->cfg.max_seqs, c, -EINVAL,
		      "n_seqs = %u, must be in [1, max_seqs = %u]", n_seqs, c->cfg.max_seqs);
	KVT_RETURN_IF(!seqs, c, -EINVAL, "seqs is NULL");
	KVT_TRY(check_seqlens(c, n_seqs, cu_seqlens));
	ls = c->batch;
	KVT_TRY(batch(c, layer, n_seqs, seqs, ls, stream));
	for (uint32_t i = 0; i < n_seqs; i++) {
		const uint32_t n = cu_seqlens[i + 1] - cu_seqlens[i];
		if ((uint64_t)ls[i]->n_tokens + n > INT32_MAX)
			return kvt_err_entry(c, i, kvt_seterr(c, -EINVAL,
				"seqs[%u] = %u: %u new tokens would grow layer %u past %d tokens (it "
				"holds %u)", i, seqs[i], n, layer, INT32_MAX, ls[i]->n_tokens));
	}
	struct kvt_io io = {.q = q, .k = k, .v = v, .out = out};
	KVT_TRY(kvt_io_begin(c, "kvt_extend_at", layout, cu_seqlens[n_seqs], &io, stream));
	/* entries without new tokens are bystanders: not used by this call for the LRU */
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, n_seqs, seqs, cu_seqlens);
	int rc = kvt_pipe_extend(c, layer, n_seqs, seqs, ls, cu_seqlens, io.q, io.k, io.v, io.out,
				 flags, stream);
	return kvt_graph_touch(c, n_seqs, seqs, (int)layer, stream,
			       kvt_lru_done(c, &m, n_seqs, seqs, kvt_io_end(c, &io, rc, stream)));
}

KVT_API int kvt_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const uint32_t *cu_seqlens, const void *q, const void *k, const void *v,
		       void *out, uint32_t flags, void *stream)
{
	return kvt_extend_at(c, layer, n_seqs, seqs, cu_seqlens, q, k, v, out, flags, NULL, stream);
}

KVT_API int kvt_get_stats(kvt_cache *c, kvt_stats *st)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!st, c, -EINVAL, "stats is NULL");
	KVT_TRY(kvt_out_size_check(c, "stats", st->size, KVT_STATS_SIZE_VER0));
	if (c->ops->stats)
		KVT_TRY(c->ops->stats(c, -1, NULL));
	c->st.host_bytes_used = c->host.used;
	c->st.host_placement = c->host.placement;
	c->st.host_numa_node = c->host.node;
	c->st.host_pinned = (uint32_t)c->host.pinned;
	c->st.device = c->ops == kvt_cuda_backend_ops ? c->cfg.device : -1;
	kvt_pool_usage(&c->pool, &c->st.host_pool_bytes, &c->st.host_pool_used,
		       &c->st.host_pool_mine);
	c->st.index_bytes = c->st.tokens_indexed * c->cfg.n_kv_heads * c->st.index_bytes_per_token_head;
	c->st.nvme_bytes_capacity = 0;
	if (c->nvme) {
		struct kvt_nvme_stats ns;
		kvt_nvme_get_stats(c->nvme, &ns);
		c->st.nvme_bytes_used = ns.bytes_used;
		c->st.nvme_bytes_capacity = ns.bytes_used + ns.bytes_free;
		c->st.nvme_bytes_written = ns.bytes_written;
		c->st.nvme_bytes_read = ns.bytes_read;
		c->st.nvme_reads = ns.read_ios;
		c->st.nvme_ios = ns.read_ios + ns.write_ios;
		c->st.nvme_lat_ns_sum = ns.lat_sum_ns;
		c->st.nvme_lat_ns_max = ns.lat_max_ns;
	}
	kvt_out_fill(st, &c->st, sizeof c->st);
	return 0;
}

KVT_API int kvt_get_layer_stats(kvt_cache *c, uint32_t layer, kvt_layer_stats *st)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!st, c, -EINVAL, "stats is NULL");
	KVT_TRY(kvt_out_size_check(c, "stats", st->size, KVT_LAYER_STATS_SIZE_VER0));
	KVT_TRY(kvt_check_layer(c, layer));
	kvt_layer_stats out = {.size = sizeof out};
	if (c->ops->stats)
		KVT_TRY(c->ops->stats(c, (int)layer, &out));
	kvt_out_fill(st, &out, sizeof out);
	return 0;
}

KVT_API int kvt_get_capacity(kvt_cache *c, kvt_capacity *cap)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!cap, c, -EINVAL, "cap is NULL");
	KVT_TRY(kvt_out_size_check(c, "cap", cap->size, KVT_CAPACITY_SIZE_VER0));
	const uint64_t kl = (uint64_t)c->cfg.n_kv_heads * c->cfg.n_layers;
	kvt_capacity k = {
		.size = sizeof k,
		.host_bytes_free = kvt_extents_free_bytes(&c->host),
		.host_bytes_capacity = c->host.capacity,
		.block_bytes = c->host.block_bytes,
		.block_tokens = KVT_BLOCK_TOKENS,
		.row_bytes_per_token = c->row_bytes * kl,
		.index_bytes_per_token = c->st.index_bytes_per_token_head * kl,
		.seqs_open = (uint32_t)c->st.seqs_open,
		.max_seqs = c->cfg.max_seqs,
	};
	if (c->nvme) {
		struct kvt_nvme_stats ns;
		kvt_nvme_get_stats(c->nvme, &ns);
		k.nvme_bytes_free = ns.bytes_free;
		k.nvme_bytes_capacity = ns.bytes_used + ns.bytes_free;
		const struct kvt_nvme_block_id id = {.n_tokens = KVT_BLOCK_TOKENS,
						     .head_dim = c->cfg.head_dim};
		k.nvme_block_bytes = kvt_nvme_block_bytes(c->nvme, &id);
	}
	kvt_out_fill(cap, &k, sizeof k);
	return 0;
}
