/* SPDX-License-Identifier: MIT */
/*
 * Holders of shared blocks. kvt_seq_fork lets the child hold the parent's full host-tier blocks
 * (and the NVMe copies of spilled ones) instead of copying them; a block is then freed when its
 * last holder lets it go. Only blocks held more than once are in this table (absent: one holder),
 * so a cache that never forks pays one NULL test per freed block.
 *
 * A key names where a block's rows are: a host-tier block by its address (even: blocks are
 * aligned), an NVMe copy by file and offset (odd). Spill and restore move a shared block for all
 * its holders at once and carry its count from one key to the other (kvt_share_rekey).
 *
 * Open addressing with linear probing, at most half full, deletion by backward shift; growth only
 * in kvt_share_reserve, so every other call here is infallible and can run after the point where
 * a call commits.
 */
#include <string.h>

#include "internal.h"

struct share_slot {
	uint64_t key; /* 0: empty */
	uint32_t holders;
};

struct kvt_share {
	uint32_t cap, n; /* cap: a power of two */
	struct share_slot *slot;
};

uint64_t kvt_share_host_key(const void *block)
{
	return (uint64_t)(uintptr_t)block;
}

uint64_t kvt_share_nvme_key(const struct kvt_nvme_loc *loc)
{
	return loc->offset << 7 | (uint64_t)loc->file << 1 | 1u;
}

static uint32_t home(const struct kvt_share *t, uint64_t key)
{
	key ^= key >> 33;
	key *= 0xff51afd7ed558ccdull;
	key ^= key >> 33;
	return (uint32_t)key & (t->cap - 1);
}

/* The slot holding key, or the empty slot where it would go. */
static uint32_t find(const struct kvt_share *t, uint64_t key)
{
	uint32_t i = home(t, key);
	while (t->slot[i].key && t->slot[i].key != key)
		i = (i + 1) & (t->cap - 1);
	return i;
}

int kvt_share_reserve(kvt_cache *c, uint32_t more)
{
	struct kvt_share *t = c->share;
	uint64_t want = (uint64_t)(t ? t->n : 0) + more;
	if (t && want * 2 <= t->cap)
		return 0;
	uint64_t cap = 64;
	while (cap < want * 2)
		cap *= 2;
	KVT_RETURN_IF(cap > UINT32_MAX, c, -ENOMEM, "%llu shared blocks are more than the table holds",
		      (unsigned long long)want);
	if (!t) {
		t = kvt_mem_alloc(KVT_MEM_HOST, sizeof *t);
		KVT_RETURN_IF(!t, c, -ENOMEM, "out of memory for the table of shared blocks");
		c->share = t;
	}
	struct share_slot *s = kvt_mem_alloc(KVT_MEM_HOST, sizeof *s * cap);
	KVT_RETURN_IF(!s, c, -ENOMEM, "out of memory growing the table of shared blocks to %llu",
		      (unsigned long long)cap);
	struct share_slot *old = t->slot;
	uint32_t old_cap = t->cap;
	t->slot = s;
	t->cap = (uint32_t)cap;
	for (uint32_t i = 0; i < old_cap; i++)
		if (old[i].key)
			t->slot[find(t, old[i].key)] = old[i];
	kvt_mem_free(KVT_MEM_HOST, old, 0);
	return 0;
}

void kvt_share_fini(kvt_cache *c)
{
	if (!c->share)
		return;
	kvt_mem_free(KVT_MEM_HOST, c->share->slot, 0);
	kvt_mem_free(KVT_MEM_HOST, c->share, 0);
	c->share = NULL;
}

uint32_t kvt_share_holders(const kvt_cache *c, uint64_t key)
{
	const struct kvt_share *t = c->share;
	if (!t || !t->n)
		return 1;
	const struct share_slot *s = &t->slot[find(t, key)];
	return s->key ? s->holders : 1;
}

void kvt_share_add(kvt_cache *c, uint64_t key)
{
	struct kvt_share *t = c->share; /* kvt_share_reserve made room */
	struct share_slot *s = &t->slot[find(t, key)];
	if (s->key) {
		s->holders++;
		return;
	}
	*s = (struct share_slot){.key = key, .holders = 2};
	t->n++;
}

/* Empty slot i, moving later entries of its probe run back so every entry stays reachable. */
static void remove_at(struct kvt_share *t, uint32_t i)
{
	const uint32_t mask = t->cap - 1;
	for (uint32_t j = (i + 1) & mask; t->slot[j].key; j = (j + 1) & mask) {
		uint32_t h = home(t, t->slot[j].key);
		/* j's entry may fill the hole at i when its home is not in (i, j] (cyclically) */
		if (((j - h) & mask) >= ((j - i) & mask)) {
			t->slot[i] = t->slot[j];
			i = j;
		}
	}
	t->slot[i].key = 0;
	t->n--;
}

uint32_t kvt_share_drop(kvt_cache *c, uint64_t key)
{
	struct kvt_share *t = c->share;
	if (!t || !t->n)
		return 0;
	uint32_t i = find(t, key);
	if (!t->slot[i].key)
		return 0;
	uint32_t left = --t->slot[i].holders;
	if (left == 1)
		remove_at(t, i);
	return left;
}

void kvt_share_rekey(kvt_cache *c, uint64_t from, uint64_t to)
{
	struct kvt_share *t = c->share;
	if (!t || !t->n)
		return;
	uint32_t i = find(t, from);
	if (!t->slot[i].key)
		return;
	uint32_t holders = t->slot[i].holders;
	remove_at(t, i);
	t->slot[find(t, to)] = (struct share_slot){.key = to, .holders = holders};
	t->n++;
}
