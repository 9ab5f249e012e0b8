/* SPDX-License-Identifier: MIT */
/*
 * What a serving runtime does to a sequence besides prefill and decode, written once for both
 * backends: truncate (speculative-decoding rollback), fork (prefix sharing, copy on write) and
 * reading a range of rows.
 *
 * Truncate goes back to the state the layer had at the shorter length: the index count comes from
 * its history (the prefill runs, and the append rule between them, struct kvt_run), so appending
 * the same tokens again gives what a sequence that never had the dropped ones gives, bit for bit.
 * Index entries of the tokens kept are unchanged (they depend on the key and the frozen centroids
 * only); tokens that leave the index return to the window, whose rows the backend refills; the
 * centroids are unfrozen when the event that froze them is dropped.
 *
 * Fork shares the parent's full host-tier blocks and the NVMe copies of its spilled ones (lib/
 * share.c counts the holders). Rows are written once, at positions past the sequence's length, so a
 * full block is never written again and is safe to share; the partial last block, which the next
 * append writes, is copied, and a truncation that makes a shared block the partial last one copies
 * it first. The index, centroids and window are copied.
 *
 * Failure: everything that can fail (memory, host-tier blocks, a restore, the backend's device
 * work) runs before the first change, so a failed call changes nothing the caller can observe
 * (a spilled sequence may be left restored, as a step leaves it).
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static uint32_t blocks_for(uint32_t tokens)
{
	return (tokens + KVT_BLOCK_TOKENS - 1) / KVT_BLOCK_TOKENS;
}

static uint32_t max_u32(uint32_t a, uint32_t b)
{
	return a > b ? a : b;
}

/* The cache's device current and its earlier errors reported, and leave to block the host (both
 * calls synchronize the device: they read and free rows the device may be writing). */
static int begin(kvt_cache *c, void *stream, const char *what)
{
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	if (c->ops->may_block)
		KVT_TRY(c->ops->may_block(c, stream, what));
	if (c->ops->quiesce)
		KVT_TRY(c->ops->quiesce(c));
	return 0;
}

/* n free host-tier blocks into out, spilling others first under KVT_SPILL_LRU (never `keep`);
 * a failure undoes those spills. */
static int take_blocks(kvt_cache *c, uint32_t n, void **out, const struct kvt_seq *keep)
{
	const uint64_t bytes = (uint64_t)n * c->host.block_bytes;
	struct kvt_tier_mark m;
	struct kvt_err e = {.msg = "", .item = -1};
	kvt_tier_mark(c, &m);
	if (bytes > kvt_extents_free_bytes(&c->host) && c->cfg.spill_policy == KVT_SPILL_LRU)
		KVT_TRY(kvt_tier_make_room(c, bytes, keep));
	int rc = kvt_extents_take(&c->host, n, out, &e);
	if (rc < 0)
		return kvt_tier_undo(c, &m, kvt_seterr(c, rc, "host tier: %u blocks of %zu bytes: %s",
							n, c->host.block_bytes, e.msg));
	return 0;
}

/* ---- truncate -------------------------------------------------------------------------------- */

/* The index count l had at length n, from its history: the last prefill run begun before n, then
 * the append rule (a flush of B whenever the window reaches W + B) up to n. */
static uint32_t indexed_at(const kvt_cache *c, const struct kvt_layer *l, uint32_t n)
{
	const uint64_t W = c->cfg.window, B = c->cfg.flush_batch;
	uint64_t ni = 0;
	for (uint32_t i = l->n_runs; i-- > 0;) {
		const struct kvt_run *r = &l->runs[i];
		if (r->from >= n)
			continue;
		if (n <= r->to) /* inside the run: what a run ending at n indexes */
			return max_u32(kvt_prefill_target(c, n), r->ni);
		ni = max_u32(kvt_prefill_target(c, r->to), r->ni);
		break;
	}
	const uint64_t f = n - kvt_sinks_of(c, n); /* tokens past the sinks */
	if (f >= ni + W + B)
		ni += B * ((f - ni - W) / B);
	return (uint32_t)ni;
}

/* The layer's index count after dropping its last n tokens (never more than it has). */
static uint32_t truncated_ni(const kvt_cache *c, const struct kvt_layer *l, uint32_t n)
{
	uint32_t ni = indexed_at(c, l, l->n_tokens - n);
	return ni < l->n_indexed ? ni : l->n_indexed;
}

/* Whether l's partial last block after dropping n tokens is shared (the next append writes it),
 * wherever it lies: a spilled block keeps its holders under its NVMe key, and is restored first. */
static bool cow_due(const kvt_cache *c, const struct kvt_layer *l, uint32_t n, uint32_t h)
{
	const uint32_t keep = l->n_tokens - n, b = keep / KVT_BLOCK_TOKENS;
	if (keep % KVT_BLOCK_TOKENS == 0 || !c->share)
		return false;
	const size_t at = (size_t)h * l->blk_cap + b;
	void *blk = l->blocks[at];
	if (blk)
		return kvt_share_holders(c, kvt_share_host_key(blk)) > 1;
	return l->spill && l->spill[at].loc.bytes &&
	       kvt_share_holders(c, kvt_share_nvme_key(&l->spill[at].loc)) > 1;
}

/* Whether a block truncation must have in the host tier is spilled: the new window's (flushes read
 * it; the CUDA backend refills its ring from it) up to the partial last block (appends write it). */
static bool truncate_needs_restore(const kvt_cache *c, const struct kvt_layer *l, uint32_t n)
{
	const uint32_t keep = l->n_tokens - n, ni = truncated_ni(c, l, n);
	const uint32_t from = (kvt_sinks_of(c, keep) + ni) / KVT_BLOCK_TOKENS;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
		for (uint32_t b = from; b < blocks_for(keep); b++)
			if (!l->blocks[(size_t)h * l->blk_cap + b])
				return true;
	return false;
}

/* Drop the prefill runs past length n: a run cut short ends at n. */
static void truncate_runs(struct kvt_layer *l, uint32_t n)
{
	while (l->n_runs && l->runs[l->n_runs - 1].from >= n)
		l->n_runs--;
	if (l->n_runs && l->runs[l->n_runs - 1].to > n)
		l->runs[l->n_runs - 1].to = n;
}

/* Commit the truncation of one layer; `fresh` holds a private block for each head whose partial
 * last block is shared (consumed from *next). */
static void truncate_layer(kvt_cache *c, struct kvt_layer *l, uint32_t n, uint32_t ni,
			   void *const *fresh, uint32_t *next)
{
	const uint32_t keep = l->n_tokens - n, b = keep / KVT_BLOCK_TOKENS;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		if (!cow_due(c, l, n, h))
			continue;
		void **at = &l->blocks[(size_t)h * l->blk_cap + b];
		void *own = fresh[(*next)++];
		memcpy(own, *at, (size_t)(keep % KVT_BLOCK_TOKENS) * c->row_bytes);
		kvt_share_drop(c, kvt_share_host_key(*at)); /* another holder keeps it */
		*at = own;
		l->blocks_gen++;
	}
	kvt_layer_drop_blocks(c, l, blocks_for(keep));
	truncate_runs(l, keep);
	/* the hot cache (CUDA) tags rows by uid and position: positions that were indexed or sinks
	 * are written again with other rows, so the layer takes a new name */
	if (ni < l->n_indexed || keep < c->cfg.n_sink)
		l->seq_uid = ++c->next_uid;
	if (keep < l->cent_keep)
		l->centroids = false;
	c->st.tokens -= n;
	c->st.tokens_indexed -= l->n_indexed - ni;
	l->n_tokens = keep;
	l->n_indexed = ni;
	l->sel_epoch = 0;
	if (kvt_sel_slots(c) > 1 && l->sel) /* keep_weight's stamps: forgotten */
		memset(l->sel + (size_t)c->cfg.n_kv_heads * l->idx_cap, 0,
		       sizeof *l->sel * c->cfg.n_kv_heads * l->idx_cap);
	kvt_corr_forget(c, l);
}

int kvt_pipe_truncate(kvt_cache *c, struct kvt_seq *s, uint32_t slot, uint32_t n, void *stream)
{
	const uint32_t L = c->cfg.n_layers, H = c->cfg.n_kv_heads;
	for (uint32_t i = 0; i < L; i++)
		KVT_RETURN_IF(s->layers[i].n_tokens < n, c, -EINVAL,
			      "n_tokens = %u is more than seq %u holds on layer %u (%u tokens)", n, slot,
			      i, s->layers[i].n_tokens);
	if (n == 0)
		return 0;
	KVT_TRY(begin(c, stream, "truncating a sequence"));
	bool restore = false;
	for (uint32_t i = 0; i < L && !restore; i++)
		restore = truncate_needs_restore(c, &s->layers[i], n);
	/*
	 * The private copies of shared partial blocks come first, then the restore: each undoes its
	 * own automatic spills when it fails, and a failed restore gives the copies back and undoes
	 * theirs, so the call changes nothing. Nothing that can fail is left after the restore but
	 * the device's ring copy (a device failure).
	 */
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	uint32_t cow = 0;
	for (uint32_t i = 0; i < L; i++)
		for (uint32_t h = 0; h < H; h++)
			cow += cow_due(c, &s->layers[i], n, h);
	void **fresh = NULL;
	if (cow) {
		fresh = kvt_mem_alloc(KVT_MEM_HOST, sizeof *fresh * cow);
		KVT_RETURN_IF(!fresh, c, -ENOMEM, "out of memory truncating seq %u", slot);
		int rc = take_blocks(c, cow, fresh, s);
		if (rc < 0) {
			kvt_mem_free(KVT_MEM_HOST, fresh, 0);
			return rc;
		}
	}
	if (restore) {
		int64_t rc = kvt_tier_restore(c, s, slot);
		if (rc < 0) {
			if (cow)
				kvt_extents_give(&c->host, cow, fresh);
			kvt_mem_free(KVT_MEM_HOST, fresh, 0);
			return kvt_tier_undo(c, &m, (int)rc);
		}
	}
	int rc = 0;
	for (uint32_t i = 0; i < L && rc == 0 && c->ops->truncate; i++) {
		struct kvt_layer *l = &s->layers[i];
		rc = c->ops->truncate(c, l, i, truncated_ni(c, l, n), l->n_tokens - n, stream);
	}
	if (rc < 0) {
		if (cow)
			kvt_extents_give(&c->host, cow, fresh);
		kvt_mem_free(KVT_MEM_HOST, fresh, 0);
		return kvt_tier_undo(c, &m, rc);
	}
	uint32_t next = 0;
	for (uint32_t i = 0; i < L; i++) {
		struct kvt_layer *l = &s->layers[i];
		truncate_layer(c, l, n, truncated_ni(c, l, n), fresh, &next);
	}
	kvt_mem_free(KVT_MEM_HOST, fresh, 0);
	return 0;
}

/* ---- fork ------------------------------------------------------------------------------------ */

/* Blocks per KV head of l that are full (shared by a fork); the one past them, if any, is partial. */
static uint32_t full_blocks(const struct kvt_layer *l)
{
	return l->n_tokens / KVT_BLOCK_TOKENS;
}

static void *dup_array(const void *p, size_t bytes, bool *failed)
{
	if (!p || !bytes)
		return NULL;
	void *q = kvt_mem_alloc(KVT_MEM_HOST, bytes);
	if (q)
		memcpy(q, p, bytes);
	else
		*failed = true;
	return q;
}

/* The child's own copies of p's host state: tables (empty: filled at the commit), index, centroids,
 * selection arrays, prefill runs. */
static int fork_arrays(kvt_cache *c, const struct kvt_layer *p, struct kvt_layer *l)
{
	const size_t H = c->cfg.n_kv_heads, cap = p->idx_cap, d = c->d;
	bool failed = false;
	l->blk_cap = p->blk_cap;
	if (p->blk_cap) {
		l->blocks = kvt_mem_alloc(KVT_MEM_HOST, sizeof *l->blocks * H * p->blk_cap);
		failed |= !l->blocks;
	}
	if (p->spill) {
		l->spill = kvt_mem_alloc(KVT_MEM_HOST, sizeof *l->spill * H * p->blk_cap);
		failed |= !l->spill;
	}
	l->idx_cap = p->idx_cap;
	l->codes = dup_array(p->codes, sizeof *p->codes * c->words * H * cap, &failed);
	l->sigma = dup_array(p->sigma, sizeof *p->sigma * H * cap, &failed);
	l->beta = dup_array(p->beta, sizeof *p->beta * H * cap, &failed);
	l->c_k = dup_array(p->c_k, sizeof *p->c_k * H * d, &failed);
	l->c_q = dup_array(p->c_q, sizeof *p->c_q * H * d, &failed);
	const size_t SH = H * kvt_sel_slots(c); /* with keep_weight, its stamps too */
	l->sel = dup_array(p->sel, sizeof *p->sel * SH * cap, &failed);
	l->sel_n = dup_array(p->sel_n, sizeof *p->sel_n * H, &failed);
	l->runs_cap = p->n_runs;
	l->runs = dup_array(p->runs, sizeof *p->runs * p->n_runs, &failed);
	KVT_RETURN_IF(failed, c, -ENOMEM, "out of memory copying layer %u of a forked sequence",
		      p->index);
	return 0;
}

/* The child's block tables: p's full blocks, one more holder each, and the fresh copies of its
 * partial last blocks (consumed from *next). */
static void fork_blocks(kvt_cache *c, const struct kvt_layer *p, struct kvt_layer *l,
			void *const *fresh, uint32_t *next)
{
	const uint32_t full = full_blocks(p), part = p->n_tokens % KVT_BLOCK_TOKENS;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		const size_t row = (size_t)h * p->blk_cap;
		for (uint32_t b = 0; b < full; b++) {
			void *blk = p->blocks[row + b];
			l->blocks[row + b] = blk;
			if (!blk)
				l->spill[row + b] = p->spill[row + b];
			kvt_share_add(c, blk ? kvt_share_host_key(blk)
					     : kvt_share_nvme_key(&p->spill[row + b].loc));
		}
		if (part) {
			void *own = fresh[(*next)++];
			memcpy(own, p->blocks[row + full], (size_t)part * c->row_bytes);
			l->blocks[row + full] = own;
		}
	}
	l->n_blocks = p->n_blocks;
}

/* Everything of the child that can fail: its layers' arrays and backend state, host blocks for
 * the partial last blocks (*fresh, *n_fresh), room in the share table. */
static int fork_prepare(kvt_cache *c, struct kvt_seq *parent, struct kvt_seq *child,
			void ***fresh, uint32_t *n_fresh, void *stream)
{
	const uint32_t L = c->cfg.n_layers, H = c->cfg.n_kv_heads;
	uint64_t shared = 0;
	uint32_t part = 0;
	for (uint32_t i = 0; i < L; i++) {
		shared += (uint64_t)full_blocks(&parent->layers[i]) * H;
		part += parent->layers[i].n_tokens % KVT_BLOCK_TOKENS ? H : 0;
	}
	KVT_RETURN_IF(shared > UINT32_MAX, c, -ENOMEM, "%llu blocks to share",
		      (unsigned long long)shared);
	if (shared)
		KVT_TRY(kvt_share_reserve(c, (uint32_t)shared));
	if (part) {
		*fresh = kvt_mem_alloc(KVT_MEM_HOST, sizeof **fresh * part);
		KVT_RETURN_IF(!*fresh, c, -ENOMEM, "out of memory forking a sequence");
		KVT_TRY(take_blocks(c, part, *fresh, NULL));
		*n_fresh = part;
	}
	for (uint32_t i = 0; i < L; i++) {
		struct kvt_layer *p = &parent->layers[i], *l = &child->layers[i];
		KVT_TRY(fork_arrays(c, p, l));
		if (c->ops->fork)
			KVT_TRY(c->ops->fork(c, p, l, i, stream));
	}
	return 0;
}

int kvt_pipe_fork(kvt_cache *c, struct kvt_seq *parent, struct kvt_seq *child, void *stream)
{
	const uint32_t L = c->cfg.n_layers;
	KVT_TRY(begin(c, stream, "forking a sequence"));
	child->layers = kvt_mem_alloc(KVT_MEM_HOST, sizeof *child->layers * L);
	KVT_RETURN_IF(!child->layers, c, -ENOMEM, "out of memory forking a sequence (%u layers)", L);
	void **fresh = NULL;
	uint32_t n_fresh = 0, next = 0;
	struct kvt_tier_mark m; /* the host blocks of the copies may spill others: undone on failure */
	kvt_tier_mark(c, &m);
	int rc = fork_prepare(c, parent, child, &fresh, &n_fresh, stream);
	if (rc < 0) {
		for (uint32_t i = 0; i < L; i++)
			kvt_layer_free(c, &child->layers[i]); /* its tables hold no block yet */
		kvt_mem_free(KVT_MEM_HOST, child->layers, 0);
		child->layers = NULL;
		if (n_fresh)
			kvt_extents_give(&c->host, n_fresh, fresh);
		kvt_mem_free(KVT_MEM_HOST, fresh, 0);
		return kvt_tier_undo(c, &m, rc);
	}
	child->open = true;
	child->uid = ++c->next_uid;
	child->last_use = ++c->clock;
	for (uint32_t i = 0; i < L; i++) {
		const struct kvt_layer *p = &parent->layers[i];
		struct kvt_layer *l = &child->layers[i];
		fork_blocks(c, p, l, fresh, &next);
		l->n_tokens = p->n_tokens;
		l->n_indexed = p->n_indexed;
		l->centroids = p->centroids;
		l->cent_keep = p->cent_keep;
		l->n_runs = p->n_runs;
		l->keep_step = p->keep_step; /* the stamps copied are of the parent's steps */
		l->seq_uid = child->uid;
		l->index = i;
		c->st.tokens += l->n_tokens;
		c->st.tokens_indexed += l->n_indexed;
	}
	kvt_mem_free(KVT_MEM_HOST, fresh, 0);
	c->st.seqs_open++;
	return 0;
}

/* ---- row ranges ------------------------------------------------------------------------------ */

/* The sequences pinned KVT_PIN_RESTORE (the first of them seqs[first]) read back, one by one. */
static int restore_pinned(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, uint32_t first,
			  void *stream)
{
	char who[80], what[160];
	if (n_seqs == 1)
		snprintf(who, sizeof who, "seq %u", seqs[0]);
	else
		snprintf(who, sizeof who,
			 "seqs[%u] = %u and the other spilled sequences of the batch", first,
			 seqs[first]);
	snprintf(what, sizeof what, "%s (the %s backend reads rows only from host memory)", who,
		 c->ops->name);
	KVT_TRY(kvt_tier_room_for(c, what));
	if (c->ops->may_block)
		KVT_TRY(c->ops->may_block(c, stream, "restoring a spilled sequence"));
	for (uint32_t i = first; i < n_seqs; i++) {
		struct kvt_seq *s = &c->seqs[seqs[i]];
		if (s->pinned != KVT_PIN_RESTORE)
			continue;
		int64_t rc = kvt_tier_restore(c, s, seqs[i]); /* never spills a pinned sequence */
		if (rc < 0)
			return (int)rc;
	}
	return 0;
}

int kvt_pipe_resident(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *cu,
		      uint32_t layer, void *stream)
{
	if (c->ops->read_rows_spilled)
		return 0;
	uint32_t first = n_seqs;
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_seq *s = &c->seqs[seqs[i]];
		if (cu[i + 1] == cu[i])
			continue;
		s->pinned = kvt_layer_spilled(c, &s->layers[layer]) ? KVT_PIN_RESTORE : KVT_PIN_HOLD;
		if (s->pinned == KVT_PIN_RESTORE && first == n_seqs)
			first = i;
	}
	int rc = first < n_seqs ? restore_pinned(c, n_seqs, seqs, first, stream) : 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		c->seqs[seqs[i]].pinned = KVT_PIN_NONE;
	return rc;
}

int kvt_pipe_read_rows(kvt_cache *c, struct kvt_seq *s, uint32_t slot, uint32_t layer,
		       uint32_t from, uint32_t to, void *k, void *v, const struct kvt_rows_map *m,
		       void *stream)
{
	struct kvt_layer *l = &s->layers[layer];
	const uint32_t one[2] = {0, 1};
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	/* a backend that reads only the host tier restores the sequence when the range needs it:
	 * rows appended after a spill are in host memory */
	if (!c->ops->read_rows_spilled && kvt_range_spilled(c, l, from, to))
		KVT_TRY(kvt_pipe_resident(c, 1, &slot, one, layer, stream));
	if (m)
		KVT_TRY(c->ops->read_rows_at(c, l, from, to, k, v, m, stream));
	else
		KVT_TRY(c->ops->read_rows(c, l, from, to, k, v, stream));
	return (int)(to - from); /* not rows_fetched: those are attention's and gather's */
}
