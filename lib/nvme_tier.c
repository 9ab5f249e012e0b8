/* SPDX-License-Identifier: MIT */
/*
 * The NVMe tier seen from the cache: spill and restore of whole sequences and the LRU spill policy.
 * Direct serving of spilled rows, through a host-memory block cache, is lib/bcache.c.
 *
 * Only full host-tier blocks whose tokens are all sinks or indexed are spilled. Index builds (window
 * flushes) and row stores touch only the window and the last block, so they never need a spilled
 * row and never fail on I/O; only attention and gather read spilled rows, and they are read-only.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/*
 * One bounce slot for queue depth qd. Up to qd 32, 1 MiB (the store's default). Deeper, the
 * largest power of two b, at least 64 KiB, with 2 qd b <= 64 MiB, plus 4 KiB: a full block of b
 * payload bytes and its header (rounded to an I/O alignment of at most 4 KiB) fits one slot
 * whole, so the block is still read in as many I/Os as with 1 MiB slots and no piece is split at
 * a slot's edge. The pinned pool (2 qd slots) thus stays near 64 MiB (2 qd x 1 MiB at most 64 MiB
 * up to 32; 66 MiB at 128; 136 MiB at 1024) instead of growing as 2 qd MiB (2 GiB at 1024). A
 * chunk read of direct serving takes one slot whatever its size, and a deeper queue is what brings
 * those reads to a drive's rate (doc/cuda-backend.md). A block larger than b + 4 KiB (head_dim 256
 * is 256 KiB of rows) spans several slots from qd 256 on.
 */
static uint32_t bounce_for(uint32_t qd)
{
	if ((uint64_t)2 * qd <= 64)
		return (uint32_t)1 << 20;
	uint32_t b = (uint32_t)1 << 20;
	while (b > (64u << 10) && (uint64_t)2 * qd * b > (64ull << 20))
		b >>= 1;
	return b + 4096;
}

int kvt_tier_init(kvt_cache *c)
{
	if (c->cfg.n_nvme == 0)
		return 0;
	struct kvt_err err;
	const struct kvt_nvme_config nc = {
		.paths = c->cfg.nvme_paths,
		.bytes = c->cfg.nvme_bytes,
		.n_files = c->cfg.n_nvme,
		.queue_depth = c->cfg.nvme_queue_depth,
		.bounce_bytes = bounce_for(c->cfg.nvme_queue_depth),
		.flags = c->cfg.nvme_flags & KVT_NVME_KEEP_FILES ? KVT_NVME_KEEP : 0,
	};
	int rc = kvt_nvme_open(&nc, &c->nvme, &err);
	KVT_RETURN_IF(rc < 0, NULL, rc, "NVMe tier: %s", err.msg);
	return kvt_bcache_init(c);
}

void kvt_tier_fini(kvt_cache *c)
{
	kvt_bcache_fini(c);
	kvt_nvme_close(c->nvme);
	c->nvme = NULL;
}

static int need_tier(kvt_cache *c)
{
	KVT_RETURN_IF(!c->nvme, c, -EOPNOTSUPP,
		      "no NVMe tier: n_nvme = 0 in the config%s",
		      KVT_HAVE_LIBURING ? "" : " (and this build has no liburing)");
	return 0;
}

static uint32_t block_rows(const kvt_cache *c, const struct kvt_layer *l, uint32_t b)
{
	uint32_t end = (b + 1) * KVT_BLOCK_TOKENS;
	return (end < l->n_tokens ? end : l->n_tokens) - b * KVT_BLOCK_TOKENS;
}

/* The identity of block b of KV head h of l as written: by the layer of sequence uid sp->uid (a
 * forked sequence reads its parent's), generation sp->gen. */
struct kvt_nvme_block_id kvt_tier_block_id(const kvt_cache *c, const struct kvt_layer *l,
					   uint32_t h, uint32_t b, const struct kvt_spill *sp)
{
	return (struct kvt_nvme_block_id){
		.seq = sp->uid,
		.generation = sp->gen,
		.first_token = (uint64_t)b * KVT_BLOCK_TOKENS,
		.n_tokens = block_rows(c, l, b),
		.layer = l->index,
		.kv_head = h,
		.head_dim = c->d,
		.flags = (uint16_t)c->cfg.dtype,
	};
}

/* Blocks of l that may be spilled: full, host resident, all tokens sinks or indexed. */
static uint32_t spillable_blocks(const kvt_cache *c, const struct kvt_layer *l)
{
	return (kvt_sinks_of(c, l->n_tokens) + l->n_indexed) / KVT_BLOCK_TOKENS;
}

static int ensure_spill_table(kvt_cache *c, struct kvt_layer *l)
{
	if (l->spill || !l->blk_cap)
		return 0;
	l->spill = kvt_mem_alloc(KVT_MEM_HOST, sizeof *l->spill * l->blk_cap * c->cfg.n_kv_heads);
	KVT_RETURN_IF(!l->spill, c, -ENOMEM, "out of memory for a spill table of %u blocks",
		      l->blk_cap);
	return 0;
}

/* The uid and layer/head/block of every spill candidate of s, in a stable order. */
#define FOR_EACH_BLOCK(c, s, l, h, b)                                                               \
	for (uint32_t layer_ = 0; layer_ < (c)->cfg.n_layers; layer_++)                             \
		for (struct kvt_layer *l = &(s)->layers[layer_]; l; l = NULL)                       \
			for (uint32_t h = 0; h < (c)->cfg.n_kv_heads; h++)                          \
				for (uint32_t b = 0; b < l->n_blocks; b++)

/* ---- blocks shared by forked sequences (lib/share.c) ---------------------------------------- */

/* The share-table key of block (h, b) of l: its host block, or its NVMe copy. */
static uint64_t key_of(const struct kvt_layer *l, uint32_t h, uint32_t b)
{
	size_t at = (size_t)h * l->blk_cap + b;
	return l->blocks[at] ? kvt_share_host_key(l->blocks[at]) : kvt_share_nvme_key(&l->spill[at].loc);
}

static bool shared(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t b)
{
	return c->share && kvt_share_holders(c, key_of(l, h, b)) > 1;
}

/* Whether x (another sequence's layer of the same number) holds the block (h, b) of l: a fork
 * shares blocks at the same position, and they never move. */
static bool same_block(const struct kvt_layer *x, const struct kvt_layer *l, uint32_t h, uint32_t b)
{
	if (x == l || b >= x->n_blocks)
		return false;
	size_t ax = (size_t)h * x->blk_cap + b, al = (size_t)h * l->blk_cap + b;
	if (l->blocks[al])
		return x->blocks[ax] == l->blocks[al];
	return !x->blocks[ax] && x->spill && x->spill[ax].gen == l->spill[al].gen;
}

/* Every other holder x (in sequence slot s_) of block (h, b) of l. */
#define FOR_EACH_HOLDER(c, l, h, b, x)                                                              \
	for (uint32_t s_ = 0; s_ < (c)->cfg.max_seqs; s_++)                                         \
		for (struct kvt_layer *x = (c)->seqs[s_].open ? &(c)->seqs[s_].layers[(l)->index]   \
							       : NULL;                             \
		     x; x = NULL)                                                                   \
			if (same_block(x, l, h, b))

/* s stays in the host tier: the `keep` of the spill at hand, or pinned by the call. */
static bool kept(const struct kvt_seq *s, const struct kvt_seq *keep)
{
	return s == keep || s->pinned != KVT_PIN_NONE;
}

/*
 * Whether block (h, b) of l, a layer of s, is spilled with s: resident, all its tokens sinks or
 * indexed (flushes read window rows from the host tier), and when shared, so in every holder and
 * none of them `keep` (a shared block moves for all its holders at once). *first: s is its holder
 * of the lowest slot, so that a count over sequences counts a shared block once.
 */
static bool may_spill(const kvt_cache *c, const struct kvt_seq *s, const struct kvt_layer *l,
		      uint32_t h, uint32_t b, const struct kvt_seq *keep, bool *first)
{
	if (first)
		*first = true;
	if (b >= spillable_blocks(c, l) || !l->blocks[(size_t)h * l->blk_cap + b])
		return false;
	if (!shared(c, l, h, b))
		return true;
	FOR_EACH_HOLDER(c, l, h, b, x)
	{
		if (kept(&c->seqs[s_], keep) || b >= spillable_blocks(c, x))
			return false;
		if (first && &c->seqs[s_] < s)
			*first = false;
	}
	return true;
}

/* Spill tables for every holder of the shared blocks about to be spilled with s. */
static int holders_ready(kvt_cache *c, struct kvt_seq *s, const struct kvt_seq *keep)
{
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		if (!may_spill(c, s, l, h, b, keep, NULL) || !shared(c, l, h, b))
			continue;
		FOR_EACH_HOLDER(c, l, h, b, x)
		{
			KVT_TRY(ensure_spill_table(c, x));
		}
	}
	return 0;
}

/* Block (h, b) of l is now on NVMe as sp, for every holder; its host block goes back. */
static void spilled_to(kvt_cache *c, struct kvt_layer *l, uint32_t h, uint32_t b,
		       const struct kvt_spill *sp)
{
	size_t at = (size_t)h * l->blk_cap + b;
	if (shared(c, l, h, b)) {
		FOR_EACH_HOLDER(c, l, h, b, x)
		{
			size_t ax = (size_t)h * x->blk_cap + b;
			x->spill[ax] = *sp;
			x->blocks[ax] = NULL;
			x->blocks_gen++;
		}
		kvt_share_rekey(c, kvt_share_host_key(l->blocks[at]), kvt_share_nvme_key(&sp->loc));
	}
	l->spill[at] = *sp;
	kvt_extents_give(&c->host, 1, &l->blocks[at]);
	l->blocks[at] = NULL;
	l->blocks_gen++;
}

/* Block (h, b) of l is back in host block q, for every holder (its NVMe copy is freed by the
 * caller). */
static void restored_to(kvt_cache *c, struct kvt_layer *l, uint32_t h, uint32_t b, void *q)
{
	size_t at = (size_t)h * l->blk_cap + b;
	if (shared(c, l, h, b)) {
		FOR_EACH_HOLDER(c, l, h, b, x)
		{
			size_t ax = (size_t)h * x->blk_cap + b;
			x->blocks[ax] = q;
			memset(&x->spill[ax], 0, sizeof x->spill[ax]);
			x->blocks_gen++;
		}
		kvt_share_rekey(c, kvt_share_nvme_key(&l->spill[at].loc), kvt_share_host_key(q));
	}
	l->blocks[at] = q;
	l->blocks_gen++;
	memset(&l->spill[at], 0, sizeof l->spill[at]);
}

int64_t kvt_tier_spill(kvt_cache *c, struct kvt_seq *s, uint32_t slot, const struct kvt_seq *keep)
{
	KVT_TRY(need_tier(c));
	if (c->ops->quiesce)
		KVT_TRY(c->ops->quiesce(c));
	uint32_t n = 0;
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		n += may_spill(c, s, l, h, b, keep, NULL);
	}
	if (n == 0)
		return 0;
	for (uint32_t i = 0; i < c->cfg.n_layers; i++)
		KVT_TRY(ensure_spill_table(c, &s->layers[i]));
	KVT_TRY(holders_ready(c, s, keep));
	struct kvt_nvme_block *blocks = kvt_mem_alloc(KVT_MEM_HOST, sizeof *blocks * n);
	struct kvt_nvme_loc *locs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *locs * n);
	if (!blocks || !locs) {
		kvt_mem_free(KVT_MEM_HOST, blocks, 0);
		kvt_mem_free(KVT_MEM_HOST, locs, 0);
		return kvt_seterr(c, -ENOMEM, "out of memory spilling seq %u (%u blocks)", slot, n);
	}
	uint32_t i = 0;
	uint64_t gen0 = c->next_gen;
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		if (may_spill(c, s, l, h, b, keep, NULL)) {
			const struct kvt_spill sp = {.gen = gen0 + i + 1, .uid = l->seq_uid};
			blocks[i].id = kvt_tier_block_id(c, l, h, b, &sp);
			blocks[i++].payload = l->blocks[(size_t)h * l->blk_cap + b];
		}
	}
	uint64_t t0 = kvt_now_ns();
	struct kvt_err err;
	int rc = kvt_nvme_write_blocks(c->nvme, n, blocks, locs, &err);
	c->st.ns_nvme += kvt_now_ns() - t0;
	if (rc < 0) {
		kvt_mem_free(KVT_MEM_HOST, blocks, 0);
		kvt_mem_free(KVT_MEM_HOST, locs, 0);
		return kvt_seterr(c, rc, "spilling seq %u: %s", slot, err.msg);
	}
	c->next_gen = gen0 + n;
	i = 0;
	int64_t moved = 0;
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		if (may_spill(c, s, l, h, b, keep, NULL)) {
			const struct kvt_spill sp = {
				.loc = locs[i], .gen = blocks[i].id.generation, .uid = l->seq_uid};
			spilled_to(c, l, h, b, &sp);
			moved += (int64_t)blocks[i++].id.n_tokens * (int64_t)c->row_bytes;
		}
	}
	kvt_mem_free(KVT_MEM_HOST, blocks, 0);
	kvt_mem_free(KVT_MEM_HOST, locs, 0);
	c->st.spills++;
	/* the blocks moved may be shared: every record is refreshed */
	(void)kvt_graph_touch(c, 0, NULL, -1, NULL, 0);
	return moved;
}

static bool has_spillable(const kvt_cache *c, const struct kvt_seq *s, const struct kvt_seq *keep)
{
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		if (may_spill(c, s, l, h, b, keep, NULL))
			return true;
	}
	return false;
}

/*
 * The least recently used sequence with blocks to spill: idle ones first, then those of the
 * current call (their spillable blocks are never written by it: rows are stored past the index and
 * flushes read only the window, and attention serves spilled rows from NVMe).
 */
static uint32_t pick_victim(const kvt_cache *c, const struct kvt_seq *keep)
{
	for (int pass = 0; pass < 2; pass++) {
		uint32_t victim = UINT32_MAX;
		for (uint32_t i = 0; i < c->cfg.max_seqs; i++) {
			const struct kvt_seq *s = &c->seqs[i];
			if (!s->open || kept(s, keep) || (pass == 0 && s->last_use >= c->call_start))
				continue;
			if ((victim == UINT32_MAX || s->last_use < c->seqs[victim].last_use) &&
			    has_spillable(c, s, keep))
				victim = i;
		}
		if (victim != UINT32_MAX)
			return victim;
	}
	return UINT32_MAX;
}

/* Host-tier bytes that spilling every other open sequence's resident indexed blocks would free. */
static uint64_t spillable_bytes(const kvt_cache *c, const struct kvt_seq *keep)
{
	uint64_t n = 0;
	for (uint32_t i = 0; i < c->cfg.max_seqs; i++) {
		const struct kvt_seq *s = &c->seqs[i];
		if (!s->open || kept(s, keep))
			continue;
		FOR_EACH_BLOCK(c, s, l, h, b)
		{
			bool first;
			n += may_spill(c, s, l, h, b, keep, &first) && first;
		}
	}
	return n * c->host.block_bytes;
}

/*
 * Checked first: when spilling every candidate cannot free `bytes`, nothing is spilled. A spill that
 * fails after others succeeded reads those back (kvt_tier_undo), so a failed call leaves every
 * sequence's residency and the spill counters as they were.
 */
int kvt_tier_make_room(kvt_cache *c, uint64_t bytes, const struct kvt_seq *keep)
{
	uint64_t free = kvt_extents_free_bytes(&c->host);
	if (free >= bytes)
		return 0;
	uint64_t can = spillable_bytes(c, keep);
	char pool[KVT_POOL_NOTE];
	KVT_RETURN_IF(free + can < bytes, c, -ENOSPC,
		      "host tier full: %llu bytes needed, %llu free of host_bytes = %llu%s, and "
		      "spilling every indexed block of the other sequences would free only %llu "
		      "bytes more (no sequence has enough indexed blocks left to spill); nothing was "
		      "spilled",
		      (unsigned long long)bytes, (unsigned long long)free,
		      (unsigned long long)c->host.capacity, kvt_pool_note(c, pool, sizeof pool),
		      (unsigned long long)can);
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	while (kvt_extents_free_bytes(&c->host) < bytes) {
		uint32_t victim = pick_victim(c, keep);
		if (victim == UINT32_MAX) /* cannot happen after the check above; undone all the same */
			return kvt_tier_undo(c, &m, kvt_seterr(c, -ENOSPC,
				"host tier full: %llu bytes needed, %llu free of host_bytes = %llu, "
				"and no sequence has indexed blocks left to spill",
				(unsigned long long)bytes,
				(unsigned long long)kvt_extents_free_bytes(&c->host),
				(unsigned long long)c->host.capacity));
		int64_t rc = kvt_tier_spill(c, &c->seqs[victim], victim, keep);
		if (rc < 0) {
			char why[sizeof c->err];
			snprintf(why, sizeof why, "%s", c->err);
			return kvt_tier_undo(c, &m, kvt_err_wrap(c, (int)rc,
				"automatic spill (KVT_SPILL_LRU) to free %llu bytes of host tier "
				"failed: %s", (unsigned long long)bytes, why));
		}
		c->st.auto_spills++;
	}
	return 0;
}

/* The block at `at` is on NVMe, written after generation `after` (0: any spilled block). */
static bool spilled_after(const struct kvt_layer *l, size_t at, uint64_t after)
{
	return !l->blocks[at] && l->spill[at].gen > after;
}

static uint32_t count_spilled(const kvt_cache *c, struct kvt_seq *s, uint64_t after)
{
	uint32_t n = 0;
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		n += spilled_after(l, (size_t)h * l->blk_cap + b, after);
	}
	return n;
}

/* Read the n blocks of s spilled after generation `after` into host blocks, then zero and free
 * their NVMe copies. On failure nothing changes (the host blocks go back, the NVMe copies stay valid) and
 * *err says why: the caller sets the call's error, once. */
static int read_back(kvt_cache *c, struct kvt_seq *s, uint32_t slot, uint64_t after, uint32_t n,
		     struct kvt_err *err)
{
	void **host = kvt_mem_alloc(KVT_MEM_HOST, sizeof *host * n);
	struct kvt_nvme_loc *locs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *locs * n);
	struct kvt_nvme_block_id *ids = kvt_mem_alloc(KVT_MEM_HOST, sizeof *ids * n);
	struct kvt_err why = {.msg = "no memory for the block lists", .item = -1};
	int rc = host && locs && ids ? kvt_extents_take(&c->host, n, host, &why) : -ENOMEM;
	if (rc < 0) {
		kvt_mem_free(KVT_MEM_HOST, host, 0);
		kvt_mem_free(KVT_MEM_HOST, locs, 0);
		kvt_mem_free(KVT_MEM_HOST, ids, 0);
		return kvt_err_set(err, rc, "restoring seq %u: %s", slot, why.msg);
	}
	uint32_t i = 0;
	FOR_EACH_BLOCK(c, s, l, h, b)
	{
		size_t at = (size_t)h * l->blk_cap + b;
		if (spilled_after(l, at, after)) {
			locs[i] = l->spill[at].loc;
			ids[i++] = kvt_tier_block_id(c, l, h, b, &l->spill[at]);
		}
	}
	uint64_t t0 = kvt_now_ns();
	rc = kvt_nvme_read_blocks(c->nvme, n, locs, ids, host, &why);
	c->st.ns_nvme += kvt_now_ns() - t0;
	if (rc == 0) {
		i = 0;
		FOR_EACH_BLOCK(c, s, l, h, b)
		{
			if (spilled_after(l, (size_t)h * l->blk_cap + b, after))
				restored_to(c, l, h, b, host[i++]);
		}
		/* the rows live in the host tier now: none stays readable in the files */
		kvt_nvme_discard(c->nvme, n, locs);
		kvt_nvme_free(c->nvme, n, locs);
	} else {
		kvt_extents_give(&c->host, n, host);
		rc = kvt_err_set(err, rc, "restoring seq %u: %s", slot, why.msg);
	}
	kvt_mem_free(KVT_MEM_HOST, host, 0);
	kvt_mem_free(KVT_MEM_HOST, locs, 0);
	kvt_mem_free(KVT_MEM_HOST, ids, 0);
	return kvt_graph_touch(c, 0, NULL, -1, NULL, rc);
}

void kvt_tier_mark(const kvt_cache *c, struct kvt_tier_mark *m)
{
	m->gen = c->next_gen;
	m->spills = c->st.spills;
	m->auto_spills = c->st.auto_spills;
}

/*
 * Undo the automatic spills since m: the victims' host blocks went back to the free stack and nothing
 * took them since (the failed call gave back what it took), so the room to read them back is there.
 * A victim whose read-back fails stays spilled (its NVMe copy valid, nothing lost); the others are
 * still read back, and the spill counters count those that stay.
 */
int kvt_tier_undo(kvt_cache *c, const struct kvt_tier_mark *m, int rc)
{
	if (c->next_gen == m->gen)
		return rc; /* nothing was spilled */
	char why[sizeof c->err];
	snprintf(why, sizeof why, "%s", c->err);
	uint32_t stayed = 0, first = 0;
	struct kvt_err first_err = {.msg = "", .item = -1};
	for (uint32_t i = 0; i < c->cfg.max_seqs; i++) {
		struct kvt_seq *s = &c->seqs[i];
		uint32_t n = s->open ? count_spilled(c, s, m->gen) : 0;
		struct kvt_err e;
		if (!n || read_back(c, s, i, m->gen, n, &e) == 0)
			continue;
		if (stayed++ == 0) {
			first = i;
			first_err = e;
		}
	}
	c->st.spills = m->spills + stayed;
	c->st.auto_spills = m->auto_spills + stayed;
	if (!stayed)
		return rc; /* read_back reports through e: the call's text is as it was */
	return kvt_err_wrap(c, rc, "%s; then reading back seq %u failed too (%u sequence(s) spilled "
			    "to make room stay spilled, their NVMe copies valid): %.200s", why, first,
			    stayed, first_err.msg);
}

int kvt_tier_room_for(kvt_cache *c, const char *what)
{
	KVT_TRY(need_tier(c));
	uint64_t blocks = 0;
	for (uint32_t i = 0; i < c->cfg.max_seqs; i++) {
		struct kvt_seq *s = &c->seqs[i];
		if (!s->open || s->pinned != KVT_PIN_RESTORE)
			continue;
		FOR_EACH_BLOCK(c, s, l, h, b)
		{
			if (!spilled_after(l, (size_t)h * l->blk_cap + b, 0))
				continue;
			bool first = true; /* counted for its restored holder of the lowest slot */
			if (shared(c, l, h, b))
				FOR_EACH_HOLDER(c, l, h, b, x)
				{
					first &= s_ > i || c->seqs[s_].pinned != KVT_PIN_RESTORE;
				}
			blocks += first;
		}
	}
	const uint64_t need = blocks * c->host.block_bytes, free = kvt_extents_free_bytes(&c->host);
	const uint64_t can = c->cfg.spill_policy == KVT_SPILL_LRU ? spillable_bytes(c, NULL) : 0;
	KVT_RETURN_IF(need > free + can, c, -ENOSPC,
		      "%s cannot all be in the host tier at once: reading them back needs %llu "
		      "bytes, %llu are free of host_bytes = %llu, and spilling the sequences the "
		      "call does not use would free %llu more; nothing was restored",
		      what, (unsigned long long)need, (unsigned long long)free,
		      (unsigned long long)c->host.capacity, (unsigned long long)can);
	return 0;
}

int64_t kvt_tier_restore(kvt_cache *c, struct kvt_seq *s, uint32_t slot)
{
	KVT_TRY(need_tier(c));
	uint32_t n = count_spilled(c, s, 0);
	if (n == 0)
		return 0;
	if (c->ops->quiesce)
		KVT_TRY(c->ops->quiesce(c));
	uint64_t bytes = (uint64_t)n * c->host.block_bytes;
	struct kvt_tier_mark m;
	kvt_tier_mark(c, &m);
	if (bytes > kvt_extents_free_bytes(&c->host) && c->cfg.spill_policy == KVT_SPILL_LRU)
		KVT_TRY(kvt_tier_make_room(c, bytes, s)); /* never the sequence being restored */
	char pool[KVT_POOL_NOTE];
	KVT_RETURN_IF(bytes > kvt_extents_free_bytes(&c->host), c, -ENOSPC,
		      "restoring seq %u needs %llu bytes of host tier, %llu free of host_bytes = "
		      "%llu%s", slot, (unsigned long long)bytes,
		      (unsigned long long)kvt_extents_free_bytes(&c->host),
		      (unsigned long long)c->host.capacity, kvt_pool_note(c, pool, sizeof pool));
	struct kvt_err e;
	int rc = read_back(c, s, slot, 0, n, &e);
	if (rc < 0)
		return kvt_tier_undo(c, &m, kvt_seterr(c, rc, "%s", e.msg));
	kvt_bcache_drop(c, s->layers, c->cfg.n_layers);
	c->st.restores++;
	return (int64_t)n * (int64_t)KVT_BLOCK_TOKENS * (int64_t)c->row_bytes;
}

/* The sequence is gone (or its tokens there are): its rows must not stay readable in the files
 * (doc/data-at-rest.md), unless another sequence still holds the block. */
void kvt_tier_drop_block(kvt_cache *c, struct kvt_layer *l, size_t at)
{
	struct kvt_spill *sp = &l->spill[at];
	if (!sp->loc.bytes)
		return;
	if (kvt_share_drop(c, kvt_share_nvme_key(&sp->loc)) == 0) {
		kvt_nvme_discard(c->nvme, 1, &sp->loc);
		kvt_nvme_free(c->nvme, 1, &sp->loc);
	}
	memset(sp, 0, sizeof *sp);
}

void kvt_tier_drop(kvt_cache *c, struct kvt_layer *l)
{
	if (!l->spill)
		return;
	kvt_bcache_drop(c, l, 1);
	/* The sequence is gone: its rows must not stay readable in the files (doc/data-at-rest.md). */
	for (size_t i = 0; i < (size_t)l->blk_cap * c->cfg.n_kv_heads; i++)
		kvt_tier_drop_block(c, l, i);
	kvt_mem_free(KVT_MEM_HOST, l->spill, 0);
	l->spill = NULL;
}
