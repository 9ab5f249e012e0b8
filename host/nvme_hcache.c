/* SPDX-License-Identifier: MIT */
/*
 * The header cache of the NVMe store: verified block headers, so that direct serving of a block
 * read before reads only its chunks' sectors (nvme_priv.h says what an entry holds and when it
 * goes). Hash buckets keyed by (file, offset), clock eviction, one buffer per entry kept on reuse.
 */
#include <string.h>

#include "kvt_config.h"

#if KVT_HAVE_LIBURING
#include "alloc.h"
#include "nvme_priv.h"

static uint32_t hc_bucket_of(uint32_t file, uint64_t offset)
{
	uint64_t x = (offset ^ ((uint64_t)file << 56)) * 0x9e3779b97f4a7c15ull;
	return (uint32_t)(x >> 32) & (KVT_HC_BUCKETS - 1);
}

/* Field by field: the struct has padding, which memcmp would compare too. */
static int same_id(const struct kvt_nvme_block_id *a, const struct kvt_nvme_block_id *b)
{
	return a->seq == b->seq && a->generation == b->generation &&
	       a->first_token == b->first_token && a->n_tokens == b->n_tokens &&
	       a->layer == b->layer && a->kv_head == b->kv_head && a->head_dim == b->head_dim &&
	       a->flags == b->flags;
}

/* The entry of the block starting at (file, offset), or KVT_HC_NONE; *link is what points at it. */
static uint32_t hc_index(struct kvt_nvme *st, uint32_t file, uint64_t offset, uint32_t **link)
{
	uint32_t *at = &st->hc_bucket[hc_bucket_of(file, offset)];
	while (*at != KVT_HC_NONE) {
		struct hc_ent *e = &st->hc[*at];
		if (e->file == file && e->offset == offset)
			break;
		at = &e->next;
	}
	if (link)
		*link = at;
	return *at;
}

static void hc_unlink(struct kvt_nvme *st, uint32_t i)
{
	uint32_t *link;
	struct hc_ent *e = &st->hc[i];
	if (hc_index(st, e->file, e->offset, &link) == i)
		*link = e->next;
	e->hb = 0;
	e->next = KVT_HC_NONE;
}

const unsigned char *kvt_hc_find(struct kvt_nvme *st, const struct kvt_nvme_loc *l,
				 const struct kvt_nvme_block_id *id, uint32_t hb)
{
	if (!st->hc)
		return NULL;
	uint32_t i = hc_index(st, l->file, l->offset, NULL);
	if (i == KVT_HC_NONE)
		return NULL;
	struct hc_ent *e = &st->hc[i];
	/* Another identity or size at this place: not the block the header was verified for. */
	if (e->bytes != l->bytes || e->hb != hb || !same_id(&e->id, id))
		return NULL;
	e->ref = 1;
	return e->hdr;
}

void kvt_hc_put(struct kvt_nvme *st, const struct kvt_nvme_loc *l,
		const struct kvt_nvme_block_id *id, const unsigned char *hdr, uint32_t hb)
{
	if (!st->hc || !hb || hb > KVT_HC_HDR_MAX)
		return;
	uint32_t i = hc_index(st, l->file, l->offset, NULL);
	if (i == KVT_HC_NONE) {
		/* Clock: pass over entries used since the last turn, clearing their bit. */
		for (;;) {
			struct hc_ent *e = &st->hc[st->hc_hand];
			i = st->hc_hand;
			st->hc_hand = (st->hc_hand + 1) % KVT_HC_ENTRIES;
			if (!e->hb || !e->ref)
				break;
			e->ref = 0;
		}
		if (st->hc[i].hb)
			hc_unlink(st, i);
		uint32_t b = hc_bucket_of(l->file, l->offset);
		st->hc[i].next = st->hc_bucket[b];
		st->hc_bucket[b] = i;
	}
	struct hc_ent *e = &st->hc[i];
	e->file = l->file; /* the key first: hc_unlink finds the entry by it */
	e->offset = l->offset;
	if (e->cap < hb) {
		unsigned char *p = kvt_mem_realloc(e->hdr, e->cap, hb);
		if (!p) {
			hc_unlink(st, i); /* only an optimization: without memory, not cached */
			return;
		}
		e->hdr = p;
		e->cap = hb;
	}
	e->bytes = l->bytes;
	e->id = *id;
	e->hb = hb;
	e->ref = 0;
	memcpy(e->hdr, hdr, hb);
}

void kvt_hc_drop(struct kvt_nvme *st, uint32_t file, uint64_t offset)
{
	uint32_t i = st->hc ? hc_index(st, file, offset, NULL) : KVT_HC_NONE;
	if (i != KVT_HC_NONE)
		hc_unlink(st, i);
}

#endif
