/* SPDX-License-Identifier: MIT */
/*
 * kvt_graph_reserve and kvt_attend_graph (kvtier_graph.h): the reservation's bounds, the refresh of
 * the backend's per-sequence records after the calls that change a sequence (kvt_graph_touch),
 * and the cpu path of kvt_attend_graph, which reads the slot buffers on the host and runs one
 * kvt_attend over the valid slots. A backend with an attend_graph verb (CUDA) reads them on the
 * device instead.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

int kvt_graph_slot_error(kvt_cache *c, uint32_t layer, uint32_t slot, uint32_t cause,
			 bool padded)
{
	static const char *const why[] = {
		[KVT_SLOT_NOT_OPEN] = "its sequence id is not that of an open sequence holding tokens on "
				  "the layer (or its device record could not be refreshed: out of "
				  "memory)",
		[KVT_SLOT_REPEATED] = "its sequence is also in an earlier valid slot",
		[KVT_SLOT_LENGTH] = "its sequence holds another number of tokens than lengths[] says",
		[KVT_SLOT_TOO_LONG] = "its sequence holds more tokens than kvt_graph_reserve's max_tokens",
		[KVT_SLOT_SPILLED] = "its sequence has blocks on NVMe (kvt_seq_restore it before it "
				 "enters a graph's batch)",
		[KVT_SLOT_IN_ERROR] = "its sequence is in error (kvt_seq_status; kvt_seq_truncate "
				  "clears it)",
	};
	const char *w = cause < sizeof why / sizeof *why && why[cause] ? why[cause] : "unknown cause";
	return kvt_seterr(c, -EINVAL, "kvt_attend_graph on layer %u: slot %u %s: %s", layer, slot,
			  padded ? "was padded (its out row left as it was)"
				 : "cannot be served (nothing was written)",
			  w);
}

int kvt_graph_touch(kvt_cache *c, uint32_t n, const uint32_t *seqs, int layer, void *stream,
		    int64_t rc)
{
	/* failed calls too: a reserve or a block-table sync before the failure may have moved what
	 * a record names, and the undo leaves the host state consistent. A record that cannot be
	 * made reads as no sequence (its slots pad and report), so the call's own result stands,
	 * and its error text, entry and count too. */
	if (c->graph_slots && c->ops->graph_publish) {
		kvt_err_mute(c, true);
		(void)c->ops->graph_publish(c, n, seqs, layer, stream);
		kvt_err_mute(c, false);
	}
	return (int)rc;
}

void kvt_graph_touch_now(kvt_cache *c, uint32_t seq)
{
	kvt_graph_touch(c, 1, &seq, -1, NULL, 0);
	if (!c->graph_slots || !c->ops->quiesce)
		return;
	kvt_err_mute(c, true);
	(void)c->ops->quiesce(c);
	kvt_err_mute(c, false);
}

void kvt_graph_fini(kvt_cache *c)
{
	kvt_mem_free(KVT_MEM_HOST, c->graph_ids, sizeof(uint32_t) * c->graph_slots);
	c->graph_ids = NULL;
	c->graph_slots = c->graph_tokens = 0;
}

KVT_API int kvt_graph_reserve(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens,
			      void *stream)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(max_slots > c->cfg.max_seqs, c, -EINVAL,
		      "max_slots = %u is above the cache's max_seqs (%u)", max_slots,
		      c->cfg.max_seqs);
	KVT_RETURN_IF(max_slots && (max_tokens == 0 || max_tokens > KVT_GPU_SELECT_MAX_N), c,
		      -EINVAL, "max_tokens = %u is outside [1, %u]", max_tokens,
		      (unsigned)KVT_GPU_SELECT_MAX_N);
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	if (c->ops->may_block)
		KVT_TRY(c->ops->may_block(c, stream, "kvt_graph_reserve"));
	uint32_t *ids = NULL;
	if (max_slots) {
		ids = kvt_mem_alloc(KVT_MEM_HOST, sizeof(uint32_t) * max_slots);
		KVT_RETURN_IF(!ids, c, -ENOMEM, "out of memory for %u graph slots", max_slots);
	}
	if (c->ops->graph_reserve) {
		int rc = c->ops->graph_reserve(c, max_slots, max_tokens, stream);
		if (rc < 0) {
			/* the backend dropped its reservation (what graphs read may have moved) */
			kvt_mem_free(KVT_MEM_HOST, ids, sizeof(uint32_t) * max_slots);
			kvt_graph_fini(c);
			return rc;
		}
	}
	kvt_graph_fini(c);
	c->graph_ids = ids;
	c->graph_slots = max_slots;
	c->graph_tokens = max_slots ? max_tokens : 0;
	return 0;
}

static bool slot_valid(const kvt_graph_batch *b, uint32_t i)
{
	return b->valid ? b->valid[i] != 0 : b->seqs[i] >= 0;
}

/* The cpu path's checks of every valid slot, before anything is computed. */
static int check_slots(kvt_cache *c, uint32_t layer, const kvt_graph_batch *b)
{
	for (uint32_t i = 0; i < b->n_slots; i++) {
		if (!slot_valid(b, i))
			continue;
		const int32_t s = b->seqs[i];
		uint32_t cause = 0;
		const struct kvt_layer *l = NULL;
		if (s < 0 || (uint32_t)s >= c->cfg.max_seqs || !c->seqs[s].open ||
		    c->seqs[s].layers[layer].n_tokens == 0)
			cause = KVT_SLOT_NOT_OPEN;
		else
			l = &c->seqs[s].layers[layer];
		for (uint32_t j = 0; j < i && !cause; j++)
			if (slot_valid(b, j) && b->seqs[j] == s)
				cause = KVT_SLOT_REPEATED;
		if (!cause && b->lengths && (int64_t)b->lengths[i] != (int64_t)l->n_tokens)
			cause = KVT_SLOT_LENGTH;
		if (!cause && l->n_tokens > c->graph_tokens)
			cause = KVT_SLOT_TOO_LONG;
		if (!cause && c->seqs[s].status)
			cause = KVT_SLOT_IN_ERROR;
		if (cause)
			return kvt_err_entry(c, i, kvt_graph_slot_error(c, layer, i, cause, false));
	}
	return 0;
}

/*
 * The cpu path after the slot checks: one kvt_attend over the valid slots' sequences, so the call
 * is all or nothing as kvt_attend is. Padded slots between valid ones have their query rows
 * packed into a scratch batch and the outputs scattered back on success (out is then untouched
 * on failure); a batch without padding is attended in place.
 */
static int attend_valid(kvt_cache *c, uint32_t layer, const kvt_graph_batch *b, const void *q,
			void *out, void *stream)
{
	const size_t qrow = (size_t)c->cfg.n_q_heads * c->d * c->elem,
		     orow = (size_t)c->cfg.n_q_heads * c->d * c->out_elem;
	uint32_t n = 0;
	for (uint32_t i = 0; i < b->n_slots; i++)
		if (slot_valid(b, i))
			c->graph_ids[n++] = (uint32_t)b->seqs[i];
	if (n == 0)
		return 0;
	char *pq = NULL, *po = NULL;
	const size_t bytes = (size_t)n * (qrow + orow);
	if (n < b->n_slots) {
		pq = (char *)kvt_mem_alloc(KVT_MEM_HOST, bytes);
		KVT_RETURN_IF(!pq, c, -ENOMEM, "kvt_attend_graph: %zu bytes to pack %u valid slots "
			      "of %u", bytes, n, b->n_slots);
		po = pq + (size_t)n * qrow;
		for (uint32_t i = 0, j = 0; i < b->n_slots; i++)
			if (slot_valid(b, i))
				memcpy(pq + (size_t)j++ * qrow, (const char *)q + i * qrow, qrow);
	}
	int rc = kvt_attend(c, layer, n, c->graph_ids, pq ? pq : q, po ? po : out, stream);
	if (rc >= 0 && po)
		for (uint32_t i = 0, j = 0; i < b->n_slots; i++)
			if (slot_valid(b, i))
				memcpy((char *)out + i * orow, po + (size_t)j++ * orow, orow);
	kvt_mem_free(KVT_MEM_HOST, pq, bytes);
	if (rc >= 0)
		return 0;
	/* the text and the entry name the slot; the failure was counted once */
	char detail[sizeof c->err];
	const int32_t e = c->err_entry;
	memcpy(detail, c->err, sizeof detail);
	if (e < 0)
		return kvt_err_wrap(c, rc, "the kvt_attend of the %u valid slots: %.400s", n, detail);
	uint32_t slot = 0;
	for (int32_t j = -1; slot < b->n_slots; slot++)
		if (slot_valid(b, slot) && ++j == e)
			break;
	return kvt_err_entry(c, slot, kvt_err_wrap(c, rc, "slot %u (entry %d of the kvt_attend of "
						     "the %u valid slots): %.400s", slot, e, n,
						     detail));
}

KVT_API int kvt_attend_graph(kvt_cache *c, uint32_t layer, const kvt_graph_batch *b,
			     const void *q, void *out, void *stream)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!b || !q || !out, c, -EINVAL, "%s is NULL", !b ? "batch" : !q ? "q" : "out");
	KVT_RETURN_IF(!b->seqs, c, -EINVAL, "batch->seqs is NULL");
	KVT_RETURN_IF(b->pad, c, -EINVAL, "batch->pad = %u: must be 0", b->pad);
	KVT_RETURN_IF(!c->graph_slots, c, -EINVAL,
		      "kvt_attend_graph needs kvt_graph_reserve first (no reservation)");
	KVT_RETURN_IF(b->n_slots == 0 || b->n_slots > c->graph_slots, c, -EINVAL,
		      "batch->n_slots = %u is outside [1, %u] (kvt_graph_reserve's max_slots)",
		      b->n_slots, c->graph_slots);
	KVT_TRY(kvt_check_layer(c, layer));
	{
		static const char *const names[] = {"q", "out", "batch->seqs", "batch->lengths",
						    "batch->valid"};
		const void *const ptrs[] = {q, out, b->seqs, b->lengths, b->valid};
		KVT_TRY(kvt_check_reach(c, "kvt_attend_graph", 5, names, ptrs, stream));
	}
	if (c->ops->attend_graph) {
		if (c->ops->enter)
			KVT_TRY(c->ops->enter(c, stream));
		return c->ops->attend_graph(c, layer, b, q, out, stream);
	}
	KVT_TRY(check_slots(c, layer, b));
	return attend_valid(c, layer, b, q, out, stream);
}
