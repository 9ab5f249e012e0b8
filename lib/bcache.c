/* SPDX-License-Identifier: MIT */
/*
 * The block cache of direct serving: 4 KiB payload chunks of spilled blocks, read from NVMe on a
 * miss (kvt_rows_get) or ahead of a step (the prefetch), kept by a policy that follows decode steps.
 *
 * Rounds: a round is one decode step over every (sequence, layer) it serves. The pipeline calls
 * kvt_rows_round before each step or gather; a (sequence, layer) met twice starts the next round.
 * A chunk remembers the round it was last used in, which puts it in one of these classes, evicted
 * in this order:
 *   stale     not used in this round or the previous one (and the chunks a prefetched step does not
 *             need of a (sequence, layer, KV head) it covers), oldest first by a clock;
 *   fresh     read in this round and not used again since, newest first (a stack);
 *   previous  used in the previous round, not yet in this one, by a clock;
 *   current   used again in this round, then chunks pinned by the prefetch and not yet used.
 * A chunk needed by the call running is never evicted. Consecutive steps select mostly the same
 * rows, so what the previous round used is what this one is about to use: a step whose working set
 * exceeds the cache recycles its own new chunks (newest first, so that the oldest of them, at the
 * bottom of the stack, stay for the next step) instead of flushing the chunks the next steps reuse,
 * and the hit rate degrades gracefully (about cache / working set of the reused part) instead of
 * dropping to zero as a clock or LRU does on a loop larger than itself.
 *
 * Sizing (kvtier.h, nvme_cache_bytes; doc/data-path.md): a decode step touches, over every layer,
 * spilled sequence and KV head, the 4 KiB chunks holding its selected spilled rows; a cache of that
 * many chunks keeps what consecutive steps share, and 1.5 times it lets the prefetch read every miss
 * of a step in one submission.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* One cached 4 KiB payload chunk of a spilled block, found by the block's generation (unique per
 * block written: the holders of a shared block share its chunks, and rows written again at a
 * position after a truncation never meet a stale chunk); uid, layer and head say whose it is. */
struct bslot {
	uint64_t bgen;
	uint64_t uid;
	uint32_t layer, head, block, chunk;
	int32_t next;   /* hash chain */
	uint32_t gen;   /* bumped at every fill: validates stack entries */
	uint64_t stamp; /* call that last needed it: never evicted during that call */
	uint64_t round; /* round of its last use (0: demoted to stale) */
	uint64_t pin;   /* == the cache's plan: pinned by the current prefetch until used */
	bool used;
	bool fresh;      /* read in `round` and not used again since */
	bool prefetched; /* read by the prefetch, not yet used: its first use is no hit */
	bool reading;    /* being read by the running prefetch (kvt_rows_ready: not yet) */
};

/* The (sequence, layer, KV head) of an item of a plan. */
struct kvt_rows_key {
	uint64_t uid;
	uint32_t layer, head;
};

struct fresh_entry {
	int32_t slot;
	uint32_t gen;
};

struct kvt_bcache {
	uint32_t n_slots, n_buckets;
	uint32_t hand_stale, hand_prev, hand_any; /* clocks of the classes */
	uint64_t stamp, round, plan;
	uint32_t n_used, n_cur, n_prev; /* used slots; of which last used in this / the previous round */
	uint32_t n_free, n_fresh, n_call, n_plan, n_items;
	unsigned char *data;            /* [n_slots, KVT_NVME_CHUNK] */
	struct bslot *slots;            /* [n_slots] */
	int32_t *buckets;               /* [n_buckets] */
	int32_t *free;                  /* [n_slots] unused slots */
	struct fresh_entry *fresh;      /* [2 n_slots] slots read this round, newest last */
	int32_t *call;                  /* [n_slots] slots the running call uses */
	struct kvt_rows_key *items;     /* [max_seqs * n_kv_heads] what the plan covers */
	uint64_t *plan_uid;             /* [n_slots] the reading layer's uid of each planned chunk */
	uint64_t failed_uid;            /* the reading layer's uid of the request that failed the last
					   prefetch, when known (a block refused); else UINT64_MAX */
	uint32_t items_cap;
};

static uint32_t bucket_of(const struct kvt_bcache *bc, uint64_t bgen, uint32_t chunk)
{
	uint64_t h = (bgen * 0x9e3779b97f4a7c15ull ^ chunk) * 0xbf58476d1ce4e5b9ull;
	return (uint32_t)(h >> 32) & (bc->n_buckets - 1);
}

/* ---- the classes ------------------------------------------------------------------------------ */

static void count_out(struct kvt_bcache *bc, const struct bslot *s)
{
	if (s->round == bc->round)
		bc->n_cur--;
	else if (s->round + 1 == bc->round)
		bc->n_prev--;
}

/* s is used in this round. */
static void touch(struct kvt_bcache *bc, struct bslot *s)
{
	if (s->round == bc->round)
		return;
	count_out(bc, s);
	s->round = bc->round;
	bc->n_cur++;
}

static void demote(struct kvt_bcache *bc, struct bslot *s)
{
	count_out(bc, s);
	s->round = 0;
}

static void bc_unlink(struct kvt_bcache *bc, int32_t i)
{
	struct bslot *s = &bc->slots[i];
	int32_t *p = &bc->buckets[bucket_of(bc, s->bgen, s->chunk)];
	while (*p != i)
		p = &bc->slots[*p].next;
	*p = s->next;
	count_out(bc, s);
	s->used = false;
	s->gen++;
	bc->n_used--;
}

static int32_t bc_find(const struct kvt_bcache *bc, uint64_t bgen, uint32_t chunk)
{
	for (int32_t i = bc->buckets[bucket_of(bc, bgen, chunk)]; i >= 0; i = bc->slots[i].next)
		if (bc->slots[i].bgen == bgen && bc->slots[i].chunk == chunk)
			return i;
	return -1;
}

/* Advance *hand to the next used slot that `want` accepts, at most one turn; -1 if none. */
static int32_t sweep(struct kvt_bcache *bc, uint32_t *hand,
		     bool (*want)(const struct kvt_bcache *, const struct bslot *))
{
	for (uint32_t tries = 0; tries < bc->n_slots; tries++) {
		int32_t i = (int32_t)*hand;
		*hand = (*hand + 1) % bc->n_slots;
		if (bc->slots[i].used && want(bc, &bc->slots[i]))
			return i;
	}
	return -1;
}

static bool is_stale(const struct kvt_bcache *bc, const struct bslot *s)
{
	return s->round + 1 < bc->round;
}

static bool is_prev(const struct kvt_bcache *bc, const struct bslot *s)
{
	return s->round + 1 == bc->round;
}

static bool is_free_cur(const struct kvt_bcache *bc, const struct bslot *s)
{
	return s->stamp != bc->stamp && s->pin != bc->plan;
}

static bool is_free_pinned(const struct kvt_bcache *bc, const struct bslot *s)
{
	return s->stamp != bc->stamp;
}

/* The newest fresh chunk of this round that the running call and the plan do not hold, or -1. */
static int32_t pop_fresh(struct kvt_bcache *bc)
{
	while (bc->n_fresh) {
		struct fresh_entry e = bc->fresh[--bc->n_fresh];
		const struct bslot *s = &bc->slots[e.slot];
		if (s->used && s->gen == e.gen && s->fresh && s->round == bc->round &&
		    s->stamp != bc->stamp && s->pin != bc->plan)
			return e.slot;
	}
	return -1;
}

static void push_fresh(struct kvt_bcache *bc, int32_t i)
{
	if (bc->n_fresh == 2 * bc->n_slots) { /* keep the valid entries, in order */
		uint32_t m = 0;
		for (uint32_t k = 0; k < bc->n_fresh; k++) {
			const struct bslot *s = &bc->slots[bc->fresh[k].slot];
			if (s->used && s->gen == bc->fresh[k].gen && s->fresh && s->round == bc->round)
				bc->fresh[m++] = bc->fresh[k];
		}
		bc->n_fresh = m;
	}
	bc->fresh[bc->n_fresh++] = (struct fresh_entry){i, bc->slots[i].gen};
}

/*
 * A slot for a new chunk: unused, stale, or fresh; with `demand` also previous, current and pinned
 * ones. -1 when none is left that the running call does not need (and, without demand, when only
 * chunks that this or the previous round used are left).
 */
static int32_t bc_take(struct kvt_bcache *bc, bool demand)
{
	int32_t i = -1;
	if (bc->n_free)
		return bc->free[--bc->n_free];
	if (bc->n_used > bc->n_cur + bc->n_prev)
		i = sweep(bc, &bc->hand_stale, is_stale);
	if (i < 0)
		i = pop_fresh(bc);
	if (i < 0 && demand && bc->n_prev)
		i = sweep(bc, &bc->hand_prev, is_prev);
	if (i < 0 && demand)
		i = sweep(bc, &bc->hand_any, is_free_cur);
	if (i < 0 && demand)
		i = sweep(bc, &bc->hand_any, is_free_pinned);
	if (i >= 0)
		bc_unlink(bc, i);
	return i;
}

/* Fill slot i with a chunk (not yet read), used in this round. */
static void bc_insert(struct kvt_bcache *bc, int32_t i, uint64_t bgen, uint64_t uid, uint32_t layer,
		      uint32_t head, uint32_t block, uint32_t chunk)
{
	struct bslot *s = &bc->slots[i];
	uint32_t gen = s->gen;
	*s = (struct bslot){.bgen = bgen, .uid = uid, .layer = layer, .head = head, .block = block,
			    .chunk = chunk, .gen = gen, .used = true, .fresh = true};
	uint32_t bk = bucket_of(bc, bgen, chunk);
	s->next = bc->buckets[bk];
	bc->buckets[bk] = i;
	bc->n_used++;
	touch(bc, s);
}

/* The slot a request reads into. */
static int32_t request_slot(const struct kvt_bcache *bc, const struct kvt_nvme_rows *q)
{
	return (int32_t)(((const unsigned char *)q->out - bc->data) / KVT_NVME_CHUNK);
}

/* Give back the slots of requests that could not be read. */
static void drop_pending(struct kvt_bcache *bc, const struct kvt_nvme_rows *reqs, uint32_t n)
{
	for (uint32_t r = 0; r < n; r++) {
		int32_t i = request_slot(bc, &reqs[r]);
		if (bc->slots[i].used) {
			bc_unlink(bc, i);
			bc->free[bc->n_free++] = i;
		}
	}
}

/* ---- set-up ----------------------------------------------------------------------------------- */

int kvt_bcache_init(kvt_cache *c)
{
	struct kvt_bcache *bc = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc);
	KVT_RETURN_IF(!bc, NULL, -ENOMEM, "out of memory for the block cache");
	memset(bc, 0, sizeof *bc);
	c->bc = bc;
	bc->failed_uid = UINT64_MAX;
	bc->n_slots = (uint32_t)(c->cfg.nvme_cache_bytes / KVT_NVME_CHUNK);
	bc->n_buckets = 1;
	while (bc->n_buckets < 2 * bc->n_slots)
		bc->n_buckets *= 2;
	bc->items_cap = c->cfg.max_seqs * c->cfg.n_kv_heads;
	bc->data = kvt_mem_alloc(KVT_MEM_PAGES, (size_t)bc->n_slots * KVT_NVME_CHUNK);
	bc->slots = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->slots * bc->n_slots);
	bc->buckets = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->buckets * bc->n_buckets);
	bc->free = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->free * bc->n_slots);
	bc->fresh = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->fresh * 2 * bc->n_slots);
	bc->call = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->call * bc->n_slots);
	bc->items = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->items * bc->items_cap);
	bc->plan_uid = kvt_mem_alloc(KVT_MEM_HOST, sizeof *bc->plan_uid * bc->n_slots);
	/* one read request per chunk at most, and a call never holds more chunks than slots */
	c->reqs = kvt_mem_alloc(KVT_MEM_HOST, sizeof *c->reqs * bc->n_slots);
	KVT_RETURN_IF(!bc->data || !bc->slots || !bc->buckets || !bc->free || !bc->fresh ||
		      !bc->call || !bc->items || !bc->plan_uid || !c->reqs, NULL, -ENOMEM,
		      "out of memory for the block cache (nvme_cache_bytes = %llu)",
		      (unsigned long long)c->cfg.nvme_cache_bytes);
	memset(bc->slots, 0, sizeof *bc->slots * bc->n_slots);
	for (uint32_t i = 0; i < bc->n_buckets; i++)
		bc->buckets[i] = -1;
	for (uint32_t i = 0; i < bc->n_slots; i++)
		bc->free[i] = (int32_t)(bc->n_slots - 1 - i);
	bc->n_free = bc->n_slots;
	bc->round = 2; /* round 0 means demoted: older than any real round's previous one */
	bc->plan = 1;  /* pin 0: not pinned */
	return 0;
}

void kvt_bcache_fini(kvt_cache *c)
{
	struct kvt_bcache *bc = c->bc;
	if (bc) {
		kvt_mem_free(KVT_MEM_PAGES, bc->data, (size_t)bc->n_slots * KVT_NVME_CHUNK);
		kvt_mem_free(KVT_MEM_HOST, bc->slots, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->buckets, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->free, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->fresh, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->call, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->items, 0);
		kvt_mem_free(KVT_MEM_HOST, bc->plan_uid, 0);
		kvt_mem_free(KVT_MEM_HOST, bc, 0);
		c->bc = NULL;
	}
	kvt_mem_free(KVT_MEM_HOST, c->reqs, 0);
	c->reqs = NULL;
}

void kvt_rows_round(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls)
{
	struct kvt_bcache *bc = c->bc;
	bool again = false;
	if (!bc)
		return;
	for (uint32_t i = 0; i < n; i++)
		again |= ls[i]->bc_round == bc->round;
	if (again) {
		bc->round++;
		bc->n_prev = bc->n_cur;
		bc->n_cur = 0;
		bc->n_fresh = 0;
	}
	for (uint32_t i = 0; i < n; i++)
		ls[i]->bc_round = bc->round;
}

void kvt_bcache_drop(kvt_cache *c, const struct kvt_layer *ls, uint32_t n)
{
	struct kvt_bcache *bc = c->bc;
	const uint32_t first = n ? ls[0].index : 0;
	for (uint32_t i = 0; bc && i < bc->n_slots; i++) {
		const struct bslot *s = &bc->slots[i];
		/* a slot carries the uid of the layer that read it (a truncated layer has its own) */
		if (s->used && s->layer - first < n && s->uid == ls[s->layer - first].seq_uid) {
			bc_unlink(bc, (int32_t)i);
			bc->free[bc->n_free++] = (int32_t)i;
		}
	}
}

/* ---- one call's rows ---------------------------------------------------------------------------- */

/* The slot holding chunk `chunk` of spilled block b of KV head h of l, or -1. */
static int32_t chunk_find(const struct kvt_bcache *bc, const struct kvt_layer *l, uint32_t h,
			  uint32_t b, uint32_t chunk)
{
	return bc_find(bc, l->spill[(size_t)h * l->blk_cap + b].gen, chunk);
}

/* The request reading chunk `chunk` of spilled block b of KV head h of l into out. */
static void chunk_request(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t b,
			  uint32_t chunk, void *out, struct kvt_nvme_rows *q)
{
	const size_t at = (size_t)h * l->blk_cap + b;
	q->loc = l->spill[at].loc;
	q->expect = kvt_tier_block_id(c, l, h, b, &l->spill[at]);
	q->row_begin = chunk * kvt_rows_per_chunk(c);
	q->row_end = q->row_begin + kvt_rows_per_chunk(c);
	q->row_end = q->row_end < q->expect.n_tokens ? q->row_end : q->expect.n_tokens;
	q->out = out;
}

/* The slot of the chunk of spilled position p, found or taken and queued in c->reqs[*nreq]; -1
 * when every slot is held by this call. Counts a hit. */
static int32_t chunk_slot(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t p,
			  uint32_t *nreq, uint32_t *hits)
{
	struct kvt_bcache *bc = c->bc;
	const uint32_t b = p / KVT_BLOCK_TOKENS;
	const uint32_t chunk = p % KVT_BLOCK_TOKENS / kvt_rows_per_chunk(c);
	int32_t i = chunk_find(bc, l, h, b, chunk);
	if (i >= 0) {
		struct bslot *s = &bc->slots[i];
		if (s->stamp != bc->stamp) {
			/* read ahead for this step: its first use is no hit */
			bool ahead = s->prefetched && s->pin == bc->plan;
			*hits += !ahead;
			s->fresh &= ahead; /* used again: no longer fresh */
			s->prefetched = false;
		}
	} else {
		i = bc_take(bc, true);
		if (i < 0)
			return -1;
		bc_insert(bc, i, l->spill[(size_t)h * l->blk_cap + b].gen, l->seq_uid, l->index, h, b,
			  chunk);
		chunk_request(c, l, h, b, chunk, bc->data + (size_t)i * KVT_NVME_CHUNK,
			      &c->reqs[(*nreq)++]);
	}
	struct bslot *s = &bc->slots[i];
	if (s->stamp != bc->stamp)
		bc->call[bc->n_call++] = i;
	s->stamp = bc->stamp;
	s->pin = 0;
	touch(bc, s);
	return i;
}

/* The end of a call: its fresh chunks may be recycled by the next calls, newest first. */
static void end_call(struct kvt_bcache *bc)
{
	for (uint32_t k = 0; k < bc->n_call; k++) {
		const struct bslot *s = &bc->slots[bc->call[k]];
		if (s->used && s->fresh)
			push_fresh(bc, bc->call[k]);
	}
	bc->n_call = 0;
}

int kvt_rows_get(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t n,
		 const int32_t *pos, const void **rows)
{
	struct kvt_bcache *bc = c->bc;
	const uint32_t per_chunk = kvt_rows_per_chunk(c);
	uint32_t nreq = 0, hits = 0, last_b = UINT32_MAX, last_chunk = UINT32_MAX;
	int32_t last_s = -1;
	if (bc) {
		bc->stamp++;
		bc->n_call = 0;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t p = (uint32_t)pos[i], b = p / KVT_BLOCK_TOKENS;
		if (l->blocks[(size_t)h * l->blk_cap + b]) {
			rows[i] = kvt_row(c, l, h, p);
			continue;
		}
		/* a row of the chunk the row before found: chunk_slot would find, stamp and touch
		 * the same slot again (ascending positions make these runs) */
		const uint32_t chunk = p % KVT_BLOCK_TOKENS / per_chunk;
		int32_t s = b == last_b && chunk == last_chunk ? last_s
							    : chunk_slot(c, l, h, p, &nreq, &hits);
		last_b = b;
		last_chunk = chunk;
		last_s = s;
		if (s < 0) {
			drop_pending(bc, c->reqs, nreq);
			end_call(bc);
			return kvt_seterr(c, -ENOSPC,
					  "direct serving of layer %u KV head %u needs more than "
					  "nvme_cache_bytes = %llu of block cache: restore the "
					  "sequence or raise nvme_cache_bytes",
					  l->index, h, (unsigned long long)c->cfg.nvme_cache_bytes);
		}
		rows[i] = bc->data + (size_t)s * KVT_NVME_CHUNK +
			  (size_t)(p % KVT_BLOCK_TOKENS % per_chunk) * c->row_bytes;
	}
	if (!bc)
		return 0;
	c->st.nvme_cache_hits += hits;
	int rc = 0;
	if (nreq) {
		uint64_t t0 = kvt_now_ns();
		struct kvt_err err;
		rc = kvt_nvme_read_rows(c->nvme, nreq, c->reqs, &err);
		c->st.ns_nvme += kvt_now_ns() - t0;
		if (rc < 0) {
			drop_pending(bc, c->reqs, nreq);
			rc = kvt_seterr(c, rc, "direct serving of layer %u KV head %u: %s", l->index,
					h, err.msg);
		} else {
			c->st.nvme_cache_misses += nreq;
		}
	}
	end_call(bc);
	return rc;
}

/* ---- the prefetch of a step --------------------------------------------------------------------- */

void kvt_rows_prefetch_begin(kvt_cache *c)
{
	struct kvt_bcache *bc = c->bc;
	if (!bc)
		return;
	bc->plan++; /* the pins of an earlier plan expire */
	bc->n_plan = 0;
	bc->n_items = 0;
}

void kvt_rows_prefetch_add(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t n,
			   const int32_t *pos)
{
	struct kvt_bcache *bc = c->bc;
	const uint32_t per_chunk = kvt_rows_per_chunk(c);
	uint32_t last_b = UINT32_MAX, last_chunk = UINT32_MAX;
	if (!bc)
		return;
	if (bc->n_items < bc->items_cap)
		bc->items[bc->n_items++] = (struct kvt_rows_key){l->seq_uid, l->index, h};
	for (uint32_t i = 0; i < n; i++) {
		uint32_t p = (uint32_t)pos[i], b = p / KVT_BLOCK_TOKENS;
		uint32_t chunk = p % KVT_BLOCK_TOKENS / per_chunk;
		if (l->blocks[(size_t)h * l->blk_cap + b] || (b == last_b && chunk == last_chunk))
			continue;
		last_b = b;
		last_chunk = chunk;
		int32_t s = chunk_find(bc, l, h, b, chunk);
		if (s >= 0) {
			bc->slots[s].pin = bc->plan;
			touch(bc, &bc->slots[s]);
		} else if (bc->n_plan < bc->n_slots) {
			/* the reader's uid, as kvt_rows_get tags a chunk (a fork reads blocks its
			 * parent wrote, under the parent's identity) */
			bc->plan_uid[bc->n_plan] = l->seq_uid;
			chunk_request(c, l, h, b, chunk, NULL, &c->reqs[bc->n_plan++]);
		}
	}
}

static int cmp_key(const void *pa, const void *pb)
{
	const struct kvt_rows_key *a = pa, *b = pb;
	if (a->uid != b->uid)
		return a->uid < b->uid ? -1 : 1;
	if (a->layer != b->layer)
		return a->layer < b->layer ? -1 : 1;
	return a->head < b->head ? -1 : a->head > b->head;
}

static bool covered(const struct kvt_bcache *bc, const struct bslot *s)
{
	const struct kvt_rows_key k = {s->uid, s->layer, s->head};
	return bsearch(&k, bc->items, bc->n_items, sizeof k, cmp_key) != NULL;
}

/*
 * Chunks of a (sequence, layer, KV head) the plan covers that it does not need are not needed in
 * this round: they become stale, so that the prefetch may use their slots. Done only when the
 * misses outnumber the slots the prefetch may take anyway.
 */
static void demote_uncovered(struct kvt_bcache *bc)
{
	uint32_t avail = bc->n_free + (bc->n_used - bc->n_cur - bc->n_prev) + bc->n_fresh;
	if (bc->n_plan <= avail)
		return;
	qsort(bc->items, bc->n_items, sizeof *bc->items, cmp_key);
	for (uint32_t i = 0; i < bc->n_slots; i++) {
		struct bslot *s = &bc->slots[i];
		if (s->used && s->pin != bc->plan && s->round + 1 >= bc->round && covered(bc, s))
			demote(bc, s);
	}
}

/* The request's chunk, from its identity. */
static int32_t request_find(const kvt_cache *c, const struct kvt_nvme_rows *q)
{
	return bc_find(c->bc, q->expect.generation, q->row_begin / kvt_rows_per_chunk(c));
}

bool kvt_rows_ready(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, int32_t pos)
{
	const struct kvt_bcache *bc = c->bc;
	const uint32_t p = (uint32_t)pos, b = p / KVT_BLOCK_TOKENS;
	if (l->blocks[(size_t)h * l->blk_cap + b])
		return true;
	if (!bc)
		return false;
	const int32_t i = chunk_find(bc, l, h, b, p % KVT_BLOCK_TOKENS / kvt_rows_per_chunk(c));
	return i >= 0 && !bc->slots[i].reading;
}

int kvt_rows_prefetch(kvt_cache *c)
{
	return kvt_rows_prefetch_idle(c, NULL);
}

int kvt_rows_prefetch_idle(kvt_cache *c, const struct kvt_nvme_idle *idle)
{
	struct kvt_bcache *bc = c->bc;
	uint32_t m = 0;
	if (!bc || !bc->n_plan)
		return 0;
	bc->failed_uid = UINT64_MAX;
	bc->stamp++; /* a call: the pointers of the last kvt_rows_get expire */
	demote_uncovered(bc);
	for (uint32_t r = 0; r < bc->n_plan; r++) {
		struct kvt_nvme_rows q = c->reqs[r];
		if (request_find(c, &q) >= 0)
			continue; /* asked for twice */
		int32_t i = bc_take(bc, false);
		if (i < 0)
			break; /* what fits: the rest is read by kvt_rows_get */
		bc_insert(bc, i, q.expect.generation, bc->plan_uid[r], q.expect.layer, q.expect.kv_head,
			  (uint32_t)(q.expect.first_token / KVT_BLOCK_TOKENS),
			  q.row_begin / kvt_rows_per_chunk(c));
		bc->slots[i].pin = bc->plan;
		bc->slots[i].prefetched = true;
		bc->slots[i].reading = true;
		q.out = bc->data + (size_t)i * KVT_NVME_CHUNK;
		c->reqs[m++] = q;
	}
	bc->n_plan = 0;
	if (!m)
		return 0;
	uint64_t t0 = kvt_now_ns();
	struct kvt_err err = {.item = -1};
	int rc = kvt_nvme_read_rows_idle(c->nvme, m, c->reqs, idle, &err);
	c->st.ns_nvme += kvt_now_ns() - t0;
	for (uint32_t r = 0; r < m; r++)
		bc->slots[request_slot(bc, &c->reqs[r])].reading = false;
	if (rc < 0) {
		if (err.item >= 0 && err.item < m)
			bc->failed_uid = bc->slots[request_slot(bc, &c->reqs[err.item])].uid;
		drop_pending(bc, c->reqs, m);
		return kvt_seterr(c, rc, "prefetching %u chunks of direct serving: %s", m, err.msg);
	}
	c->st.nvme_cache_misses += m;
	return 0;
}

int kvt_rows_blame(kvt_cache *c, int rc, uint32_t n_seqs, struct kvt_layer *const *ls)
{
	const uint64_t uid = c->bc ? c->bc->failed_uid : UINT64_MAX;
	for (uint32_t i = 0; rc < 0 && uid != UINT64_MAX && i < n_seqs; i++)
		if (ls[i]->seq_uid == uid)
			return kvt_err_entry(c, i, rc);
	return rc;
}
