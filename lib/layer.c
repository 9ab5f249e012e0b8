/* SPDX-License-Identifier: MIT */
/* Storage of one (sequence, layer): index arrays, centroids, host-tier block table. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Replace *p (old_n elements of `size` per KV head, `old_cap` per head) by a fresh array of new_cap
 * per head with the old contents copied head by head. */
static void *regrow(kvt_cache *c, const void *old, size_t size, uint32_t old_cap, uint32_t new_cap,
		    uint32_t heads)
{
	char *n = kvt_mem_alloc(KVT_MEM_HOST, size * new_cap * heads);
	if (n && old)
		for (uint32_t h = 0; h < heads; h++)
			memcpy(n + size * new_cap * h, (const char *)old + size * old_cap * h,
			       size * old_cap);
	(void)c;
	return n;
}

static int reserve_scratch(kvt_cache *c, uint32_t tokens)
{
	uint32_t rows = c->cfg.n_sink + tokens + c->cfg.window + c->cfg.flush_batch;
	if (tokens <= c->scratch_cap && rows <= c->rows_cap)
		return 0;
	KVT_TRY(kvt_corr_reserve(c, tokens));
	float *s = kvt_mem_alloc(KVT_MEM_HOST, sizeof(float) * tokens);
	float *w = kvt_mem_alloc(KVT_MEM_HOST, sizeof(float) * rows);
	uint8_t *m = kvt_mem_alloc(KVT_MEM_HOST, tokens);
	const void **r = kvt_mem_alloc(KVT_MEM_HOST, sizeof(void *) * rows);
	/* the second stage's (rescore_p): candidates of a query head and their union, positions */
	const bool rs = c->cfg.rescore_p != 0.0f;
	uint8_t *cm = rs ? kvt_mem_alloc(KVT_MEM_HOST, 2 * (size_t)tokens) : NULL;
	int32_t *cp = rs ? kvt_mem_alloc(KVT_MEM_HOST, sizeof(int32_t) * tokens) : NULL;
	/* keep_weight's keys and their threshold's (key, score) pairs */
	const bool kw = kvt_sel_slots(c) > 1;
	float *ky = kw ? kvt_mem_alloc(KVT_MEM_HOST, 3 * sizeof(float) * tokens) : NULL;
	if (!s || !w || !m || !r || (rs && (!cm || !cp)) || (kw && !ky)) {
		kvt_mem_free(KVT_MEM_HOST, s, 0);
		kvt_mem_free(KVT_MEM_HOST, w, 0);
		kvt_mem_free(KVT_MEM_HOST, m, 0);
		kvt_mem_free(KVT_MEM_HOST, r, 0);
		kvt_mem_free(KVT_MEM_HOST, cm, 0);
		kvt_mem_free(KVT_MEM_HOST, cp, 0);
		kvt_mem_free(KVT_MEM_HOST, ky, 0);
		return kvt_seterr(c, -ENOMEM, "out of memory growing scratch to %u tokens", tokens);
	}
	kvt_mem_free(KVT_MEM_HOST, c->scores, 0);
	kvt_mem_free(KVT_MEM_HOST, c->work, 0);
	kvt_mem_free(KVT_MEM_HOST, c->mask, 0);
	kvt_mem_free(KVT_MEM_HOST, c->rows, 0);
	kvt_mem_free(KVT_MEM_HOST, c->cand, 0);
	kvt_mem_free(KVT_MEM_HOST, c->cand_pos, 0);
	kvt_mem_free(KVT_MEM_HOST, c->keys, 0);
	c->scores = s;
	c->work = w;
	c->mask = m;
	c->rows = r;
	c->cand = cm;
	c->cand_pos = cp;
	c->keys = ky;
	c->scratch_cap = tokens;
	c->rows_cap = rows;
	return 0;
}

int kvt_layer_reserve_index(kvt_cache *c, struct kvt_layer *l, uint32_t tokens)
{
	const uint32_t H = c->cfg.n_kv_heads, d = c->d, SH = H * kvt_sel_slots(c);
	if (tokens <= l->idx_cap && l->c_k)
		return 0;
	uint32_t cap = l->idx_cap;
	if (tokens > cap || cap == 0) {
		cap = cap ? cap * 2 : 256;
		cap = cap < tokens ? tokens : cap;
	}
	KVT_TRY(reserve_scratch(c, cap));
	float *ck = l->c_k ? NULL : kvt_mem_alloc(KVT_MEM_HOST, sizeof(float) * H * d);
	float *cq = l->c_q ? NULL : kvt_mem_alloc(KVT_MEM_HOST, sizeof(float) * H * d);
	uint32_t *sel_n = l->sel_n ? NULL : kvt_mem_alloc(KVT_MEM_HOST, sizeof(uint32_t) * H);
	uint32_t *codes = NULL, *sel = NULL;
	uint16_t *sigma = NULL, *beta = NULL;
	if (cap > l->idx_cap) {
		codes = regrow(c, l->codes, sizeof(uint32_t) * c->words, l->idx_cap, cap, H);
		sigma = regrow(c, l->sigma, sizeof(uint16_t), l->idx_cap, cap, H);
		beta = regrow(c, l->beta, sizeof(uint16_t), l->idx_cap, cap, H);
		sel = regrow(c, l->sel, sizeof(uint32_t), l->idx_cap, cap, SH);
	}
	if ((!l->c_k && !ck) || (!l->c_q && !cq) || (!l->sel_n && !sel_n) ||
	    (cap > l->idx_cap && (!codes || !sigma || !beta || !sel))) {
		kvt_mem_free(KVT_MEM_HOST, ck, 0);
		kvt_mem_free(KVT_MEM_HOST, cq, 0);
		kvt_mem_free(KVT_MEM_HOST, sel_n, 0);
		kvt_mem_free(KVT_MEM_HOST, codes, 0);
		kvt_mem_free(KVT_MEM_HOST, sigma, 0);
		kvt_mem_free(KVT_MEM_HOST, beta, 0);
		kvt_mem_free(KVT_MEM_HOST, sel, 0);
		return kvt_seterr(c, -ENOMEM, "out of memory growing the index to %u tokens per KV head",
				  cap);
	}
	if (ck) {
		l->c_k = ck;
		l->c_q = cq;
		l->sel_n = sel_n;
	}
	if (cap > l->idx_cap) {
		kvt_mem_free(KVT_MEM_HOST, l->codes, 0);
		kvt_mem_free(KVT_MEM_HOST, l->sigma, 0);
		kvt_mem_free(KVT_MEM_HOST, l->beta, 0);
		kvt_mem_free(KVT_MEM_HOST, l->sel, 0);
		l->codes = codes;
		l->sigma = sigma;
		l->beta = beta;
		l->sel = sel;
		l->idx_cap = cap;
	}
	return 0;
}

static uint32_t blocks_for(uint32_t tokens)
{
	return (tokens + KVT_BLOCK_TOKENS - 1) / KVT_BLOCK_TOKENS;
}

/* Make l's block table hold `blocks` per KV head. */
static int reserve_table(kvt_cache *c, struct kvt_layer *l, uint32_t blocks, struct kvt_err *e)
{
	if (blocks <= l->blk_cap)
		return 0;
	uint32_t cap = l->blk_cap ? l->blk_cap * 2 : KVT_TABLE_MIN_BLOCKS;
	cap = cap < blocks ? blocks : cap;
	void **t = regrow(c, l->blocks, sizeof(void *), l->blk_cap, cap, c->cfg.n_kv_heads);
	struct kvt_spill *sp = NULL;
	if (t && l->spill)
		sp = regrow(c, l->spill, sizeof *sp, l->blk_cap, cap, c->cfg.n_kv_heads);
	if (!t || (l->spill && !sp)) {
		kvt_mem_free(KVT_MEM_HOST, t, 0);
		return kvt_err_set(e, -ENOMEM, "no memory for a block table of %u blocks", cap);
	}
	kvt_mem_free(KVT_MEM_HOST, l->blocks, 0);
	l->blocks = t;
	if (sp) {
		kvt_mem_free(KVT_MEM_HOST, l->spill, 0);
		l->spill = sp;
	}
	l->blk_cap = cap;
	return 0;
}

void kvt_layer_drop_blocks(kvt_cache *c, struct kvt_layer *l, uint32_t keep)
{
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
		for (uint32_t b = keep; b < l->n_blocks; b++) {
			size_t at = (size_t)h * l->blk_cap + b;
			if (!l->blocks[at]) {
				if (l->spill)
					kvt_tier_drop_block(c, l, at);
				continue;
			}
			if (kvt_share_drop(c, kvt_share_host_key(l->blocks[at])) == 0)
				kvt_extents_give(&c->host, 1, &l->blocks[at]);
			l->blocks[at] = NULL;
		}
	if (keep < l->n_blocks)
		l->blocks_gen++; /* a device copy of the table must not keep the given-back blocks */
	l->n_blocks = l->n_blocks < keep ? l->n_blocks : keep;
}

int kvt_layer_reserve_run(kvt_cache *c, struct kvt_layer *l)
{
	if ((l->n_runs && l->runs[l->n_runs - 1].to == l->n_tokens) || l->n_runs < l->runs_cap)
		return 0;
	uint32_t cap = l->runs_cap ? 2 * l->runs_cap : 4;
	struct kvt_run *r = kvt_mem_realloc(l->runs, sizeof *r * l->runs_cap, sizeof *r * cap);
	KVT_RETURN_IF(!r, c, -ENOMEM, "out of memory for the prefill runs of a layer (%u)", cap);
	l->runs = r;
	l->runs_cap = cap;
	return 0;
}

void kvt_layer_note_run(struct kvt_layer *l, uint32_t first, uint32_t total, uint32_t ni)
{
	struct kvt_run *last = l->n_runs ? &l->runs[l->n_runs - 1] : NULL;
	if (last && last->to == first)
		last->to = total; /* no append since: the same run */
	else
		l->runs[l->n_runs++] = (struct kvt_run){.from = first, .to = total, .ni = ni};
}

const char *kvt_pool_note(const kvt_cache *c, char *buf, size_t n)
{
	uint64_t total, used, mine;
	kvt_pool_usage(&c->pool, &total, &used, &mine);
	buf[0] = 0;
	if (total)
		snprintf(buf, n,
			 " and of host pool %s: %llu of %llu bytes used by the caches sharing it, "
			 "%llu by this one",
			 c->pool.name, (unsigned long long)used, (unsigned long long)total,
			 (unsigned long long)mine);
	return buf;
}

/* The error of a host tier too full for `bytes`, naming the shared host pool when there is one. */
static int host_full(kvt_cache *c, uint64_t bytes, uint64_t blocks, uint64_t free)
{
	char pool[KVT_POOL_NOTE];
	kvt_pool_note(c, pool, sizeof pool);
	return kvt_seterr(c, -ENOSPC,
			  "host tier full: %llu bytes needed (%llu blocks of %zu bytes), %llu free of "
			  "host_bytes = %llu%s",
			  (unsigned long long)bytes, (unsigned long long)blocks, c->host.block_bytes,
			  (unsigned long long)free, (unsigned long long)c->host.capacity, pool);
}

int kvt_layers_grow_rows(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls,
			 const uint32_t *new_tokens)
{
	const uint32_t H = c->cfg.n_kv_heads;
	uint64_t need = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t want = blocks_for(new_tokens[i]);
		if (want > ls[i]->n_blocks)
			need += (uint64_t)(want - ls[i]->n_blocks) * H;
	}
	uint64_t bytes = need * c->host.block_bytes;
	/* a failure after the automatic spills undoes them: the call changes nothing */
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	if (bytes > kvt_extents_free_bytes(&c->host) && c->cfg.spill_policy == KVT_SPILL_LRU)
		KVT_TRY(kvt_tier_make_room(c, bytes, NULL));
	uint64_t free = kvt_extents_free_bytes(&c->host);
	if (bytes > free)
		return kvt_tier_undo(c, &m, host_full(c, bytes, need, free));
	uint32_t done = 0;
	int rc = 0;
	struct kvt_err e = {.msg = "", .item = -1}; /* what reserve_table or kvt_extents_take found */
	for (; done < n && rc == 0; done++) {
		struct kvt_layer *l = ls[done];
		uint32_t want = blocks_for(new_tokens[done]), have = l->n_blocks;
		if (want <= have)
			continue;
		rc = reserve_table(c, l, want, &e);
		for (uint32_t h = 0; h < H && rc == 0; h++) {
			rc = kvt_extents_take(&c->host, want - have,
					      l->blocks + (size_t)h * l->blk_cap + have, &e);
			if (rc == 0)
				continue;
			/* give back the heads already served */
			for (uint32_t g = 0; g < h; g++)
				kvt_extents_give(&c->host, want - have,
						 l->blocks + (size_t)g * l->blk_cap + have);
		}
		if (rc == 0)
			l->n_blocks = want;
	}
	if (rc == 0)
		return 0;
	/* undo the layers grown before the failing one (its own heads were given back above) */
	for (uint32_t i = 0; i + 1 < done; i++)
		kvt_layer_drop_blocks(c, ls[i], blocks_for(ls[i]->n_tokens));
	if (rc == -ENOSPC)
		return kvt_tier_undo(c, &m, kvt_seterr(c, rc,
			"host tier full: capacity host_bytes = %llu (%s)",
			(unsigned long long)c->host.capacity, e.msg));
	return kvt_tier_undo(c, &m, kvt_seterr(c, rc,
		"out of memory growing the host tier (extents of %zu bytes): %s",
		c->host.extent_bytes, e.msg));
}

void kvt_layers_ungrow(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls)
{
	for (uint32_t i = 0; i < n; i++)
		kvt_layer_drop_blocks(c, ls[i], blocks_for(ls[i]->n_tokens));
}

bool kvt_layer_spilled(const kvt_cache *c, struct kvt_layer *l)
{
	if (l->spill_gen == l->blocks_gen + 1)
		return l->spilled;
	l->spilled = false;
	for (uint32_t h = 0; h < c->cfg.n_kv_heads && !l->spilled; h++)
		for (uint32_t b = 0; b < l->n_blocks; b++)
			l->spilled |= !l->blocks[(size_t)h * l->blk_cap + b];
	l->spill_gen = l->blocks_gen + 1;
	return l->spilled;
}

bool kvt_range_spilled(const kvt_cache *c, const struct kvt_layer *l, uint32_t from, uint32_t to)
{
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
		for (uint32_t b = from / KVT_BLOCK_TOKENS; b <= (to - 1) / KVT_BLOCK_TOKENS; b++)
			if (!l->blocks[(size_t)h * l->blk_cap + b])
				return true;
	return false;
}

void kvt_layer_free(kvt_cache *c, struct kvt_layer *l)
{
	if (c->ops->layer_fini)
		c->ops->layer_fini(c, l);
	kvt_layer_drop_blocks(c, l, 0);
	kvt_tier_drop(c, l);
	kvt_mem_free(KVT_MEM_HOST, l->blocks, 0);
	kvt_mem_free(KVT_MEM_HOST, l->runs, 0);
	kvt_mem_free(KVT_MEM_HOST, l->codes, 0);
	kvt_mem_free(KVT_MEM_HOST, l->sigma, 0);
	kvt_mem_free(KVT_MEM_HOST, l->beta, 0);
	kvt_mem_free(KVT_MEM_HOST, l->sel, 0);
	kvt_mem_free(KVT_MEM_HOST, l->sel_n, 0);
	kvt_mem_free(KVT_MEM_HOST, l->c_k, 0);
	kvt_mem_free(KVT_MEM_HOST, l->c_q, 0);
	kvt_corr_free(c, l);
	memset(l, 0, sizeof *l);
}
