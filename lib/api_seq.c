/* SPDX-License-Identifier: MIT */
/*
 * The public calls on one sequence: open and close, its error status (kvt_seq_status), spill and
 * restore, length, truncate and fork, row ranges in and out, its bytes. The checks and the LRU
 * stamps they share with the compute calls are in api.c.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

int kvt_seq_set_status(kvt_cache *c, uint32_t seq, int rc, const char *fmt, ...)
{
	struct kvt_seq *s = &c->seqs[seq];
	if (s->status)
		return 0;
	s->status = rc;
	c->status_new = true;
	s->status_text = kvt_mem_alloc(KVT_MEM_HOST, KVT_STATUS_TEXT);
	if (s->status_text) { /* without memory the code alone is kept */
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(s->status_text, KVT_STATUS_TEXT, fmt, ap);
		va_end(ap);
	}
	/* graph steps pad its slots from now on, as the other calls refuse it */
	kvt_graph_touch_now(c, seq);
	return 0;
}

static void clear_status(struct kvt_seq *s)
{
	kvt_mem_free(KVT_MEM_HOST, s->status_text, KVT_STATUS_TEXT);
	s->status_text = NULL;
	s->status = 0;
}

uint32_t kvt_seq_of_uid(const kvt_cache *c, uint32_t layer, uint64_t uid)
{
	for (uint32_t s = 0; s < c->cfg.max_seqs; s++)
		if (c->seqs[s].open && c->seqs[s].layers[layer].seq_uid == uid)
			return s;
	return UINT32_MAX;
}

/* A sequence in error (kvt_seq_status) refuses calls that would compute with it. */
int kvt_seq_check_status(kvt_cache *c, uint32_t seq, const struct kvt_seq *s)
{
	KVT_RETURN_IF(s->status, c, s->status,
		      "seq %u is in error since an earlier step (kvt_seq_status; kvt_seq_truncate "
		      "clears it): %s", seq, s->status_text ? s->status_text : kvt_strerror(s->status));
	return 0;
}

int kvt_layers_check_status(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls, bool batch)
{
	if (!c->status_new)
		return 0;
	c->status_new = false;
	for (uint32_t i = 0; i < n; i++) {
		const uint32_t s = kvt_seq_of_uid(c, ls[i]->index, ls[i]->seq_uid);
		if (s != UINT32_MAX && c->seqs[s].status)
			return batch ? kvt_err_entry(c, i, kvt_seq_check_status(c, s, &c->seqs[s]))
				     : kvt_seq_check_status(c, s, &c->seqs[s]);
	}
	return 0;
}

KVT_API int kvt_seq_status(kvt_cache *c, uint32_t seq, int *status, char *text, size_t text_size)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!status, c, -EINVAL, "status is NULL");
	KVT_RETURN_IF(!text && text_size, c, -EINVAL, "text is NULL, text_size = %zu", text_size);
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	/* errors the backend found since the last call are put on their sequences first */
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, NULL));
	*status = s->status;
	if (text_size)
		snprintf(text, text_size, "%s", s->status_text ? s->status_text : "");
	return 0;
}

/* The lowest free sequence slot. */
static int free_slot(kvt_cache *c, uint32_t *out)
{
	uint32_t s = 0;
	while (s < c->cfg.max_seqs && c->seqs[s].open)
		s++;
	KVT_RETURN_IF(s == c->cfg.max_seqs, c, -ENOSPC, "all max_seqs = %u sequences are open",
		      c->cfg.max_seqs);
	*out = s;
	return 0;
}

KVT_API int kvt_seq_open(kvt_cache *c, uint32_t *seq)
{
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!seq, c, -EINVAL, "seq is NULL");
	uint32_t s = 0;
	KVT_TRY(free_slot(c, &s));
	struct kvt_layer *layers = kvt_mem_alloc(KVT_MEM_HOST, sizeof *layers * c->cfg.n_layers);
	KVT_RETURN_IF(!layers, c, -ENOMEM, "out of memory opening a sequence (%u layers)",
		      c->cfg.n_layers);
	c->seqs[s] = (struct kvt_seq){
		.open = true, .uid = ++c->next_uid, .last_use = ++c->clock, .layers = layers };
	for (uint32_t l = 0; l < c->cfg.n_layers; l++) {
		layers[l].seq_uid = c->seqs[s].uid;
		layers[l].index = l;
	}
	c->st.seqs_open++;
	*seq = s;
	return 0;
}

KVT_API int kvt_seq_close(kvt_cache *c, uint32_t seq)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	for (uint32_t l = 0; l < c->cfg.n_layers; l++) {
		c->st.tokens -= s->layers[l].n_tokens;
		c->st.tokens_indexed -= s->layers[l].n_indexed;
		kvt_layer_free(c, &s->layers[l]);
	}
	kvt_mem_free(KVT_MEM_HOST, s->layers, 0);
	clear_status(s);
	memset(s, 0, sizeof *s);
	c->st.seqs_open--;
	/* a graph step naming the id from now on pads its slot */
	kvt_graph_touch_now(c, seq);
	return 0;
}

KVT_API int64_t kvt_seq_spill(kvt_cache *c, uint32_t seq)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	return kvt_tier_spill(c, s, seq, NULL);
}

KVT_API int64_t kvt_seq_restore(kvt_cache *c, uint32_t seq)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, 1, &seq, NULL);
	return kvt_lru_done(c, &m, 1, &seq, kvt_tier_restore(c, s, seq));
}

KVT_API int64_t kvt_seq_length(kvt_cache *c, uint32_t seq, uint32_t layer)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	KVT_TRY(kvt_check_layer(c, layer));
	return s->layers[layer].n_tokens;
}

KVT_API int kvt_seq_truncate(kvt_cache *c, uint32_t seq, uint32_t n_tokens, void *stream)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	if (n_tokens == 0) /* changes nothing, the spill policy's order of use included */
		return 0;
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, 1, &seq, NULL);
	int rc = (int)kvt_lru_done(c, &m, 1, &seq, kvt_pipe_truncate(c, s, seq, n_tokens, stream));
	if (rc >= 0)
		clear_status(s);
	return kvt_graph_touch(c, 1, &seq, -1, stream, rc);
}

KVT_API int kvt_seq_fork(kvt_cache *c, uint32_t parent, uint32_t *child, void *stream)
{
	struct kvt_seq *s = NULL;
	uint32_t slot = 0;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_RETURN_IF(!child, c, -EINVAL, "child is NULL");
	KVT_TRY(kvt_seq_lookup(c, parent, &s));
	if (c->ops->enter) /* errors found since the last call go to their sequences first */
		KVT_TRY(c->ops->enter(c, stream));
	KVT_TRY(kvt_seq_check_status(c, parent, s));
	KVT_TRY(free_slot(c, &slot));
	struct kvt_lru_mark m;
	kvt_lru_use(c, &m, 1, &parent, NULL);
	const int rc = (int)kvt_lru_done(c, &m, 1, &parent,
					 kvt_pipe_fork(c, s, &c->seqs[slot], stream));
	const uint32_t both[2] = {parent, slot};
	KVT_TRY(kvt_graph_touch(c, rc < 0 ? 1 : 2, both, -1, stream, rc));
	*child = slot;
	return 0;
}

/* The checks of a row range [from, to) of seq on layer; *out: its state. */
static int range_args(kvt_cache *c, const char *call, uint32_t seq, uint32_t layer, uint32_t from,
		      uint32_t to, const void *k, const void *v, struct kvt_seq **out, void *stream)
{
	static const char *const names[] = {"k", "v"};
	const void *const ptrs[] = {k, v};
	KVT_TRY(kvt_seq_lookup(c, seq, out));
	KVT_TRY(kvt_check_layer(c, layer));
	KVT_RETURN_IF(!k || !v, c, -EINVAL, "%s is NULL", !k ? "k" : "v");
	KVT_RETURN_IF(to <= from, c, -EINVAL, "to = %u, must be > from = %u", to, from);
	return kvt_check_reach(c, call, 2, names, ptrs, stream);
}

static int read_rows(kvt_cache *c, const char *call, uint32_t seq, uint32_t layer, uint32_t from,
		     uint32_t to, void *k, void *v, const kvt_rows_layout *lo, void *stream)
{
	struct kvt_seq *s = NULL;
	struct kvt_rows_map m;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(range_args(c, call, seq, layer, from, to, k, v, &s, stream));
	const uint32_t n = s->layers[layer].n_tokens;
	KVT_RETURN_IF(to > n, c, -EINVAL, "to = %u, must be <= %u, the tokens seq %u holds on layer %u",
		      to, n, seq, layer);
	int dense = kvt_rows_map_check(c, call, lo, to - from, false, &m);
	if (dense < 0)
		return dense;
	struct kvt_lru_mark lm;
	kvt_lru_use(c, &lm, 1, &seq, NULL);
	return (int)kvt_lru_done(c, &lm, 1, &seq,
				 kvt_pipe_read_rows(c, s, seq, layer, from, to, k, v, dense ? NULL : &m,
						    stream));
}

KVT_API int kvt_seq_read_rows(kvt_cache *c, uint32_t seq, uint32_t layer, uint32_t from,
			      uint32_t to, void *k, void *v, void *stream)
{
	return read_rows(c, "kvt_seq_read_rows", seq, layer, from, to, k, v, NULL, stream);
}

KVT_API int kvt_seq_read_rows_at(kvt_cache *c, uint32_t seq, uint32_t layer, uint32_t from,
				 uint32_t to, void *k, void *v, const kvt_rows_layout *layout,
				 void *stream)
{
	return read_rows(c, "kvt_seq_read_rows_at", seq, layer, from, to, k, v, layout, stream);
}

/* Rows of a dense layout stored as a prefill chunk without queries; a strided or paged one gathered
 * into a dense buffer first. */
static int write_rows(kvt_cache *c, const char *call, uint32_t seq, uint32_t layer, uint32_t from,
		      uint32_t to, const void *k, const void *v, const kvt_rows_layout *lo,
		      void *stream)
{
	struct kvt_seq *s = NULL;
	struct kvt_rows_map m;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(range_args(c, call, seq, layer, from, to, k, v, &s, stream));
	const uint32_t n = s->layers[layer].n_tokens;
	KVT_RETURN_IF(from != n, c, -EINVAL,
		      "from = %u, must be %u: rows are written at the end of seq %u on layer %u", from,
		      n, seq, layer);
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	KVT_TRY(kvt_seq_check_status(c, seq, s));
	KVT_RETURN_IF((uint64_t)to > INT32_MAX, c, -EINVAL,
		      "to = %u would grow seq %u layer %u past %d tokens", to, seq, layer, INT32_MAX);
	int dense = kvt_rows_map_check(c, call, lo, to - from, true, &m);
	if (dense < 0)
		return dense;
	void *buf = NULL;
	size_t bytes = 0;
	if (!dense && c->ops->gather_rows) {
		void *dk = NULL, *dv = NULL;
		KVT_TRY(c->ops->gather_rows(c, &m, to - from, k, v, &dk, &dv, stream));
		k = dk;
		v = dv;
	} else if (!dense) {
		KVT_TRY(kvt_rows_gather(c, &m, to - from, k, v, &buf, &bytes));
		k = buf;
		v = (char *)buf + bytes / 2;
	}
	struct kvt_lru_mark lm;
	kvt_lru_use(c, &lm, 1, &seq, NULL);
	int rc = (int)kvt_lru_done(c, &lm, 1, &seq,
				   kvt_pipe_prefill(c, &s->layers[layer], layer, NULL, k, v, to - from,
						    stream));
	kvt_mem_free(KVT_MEM_HOST, buf, bytes);
	rc = kvt_graph_touch(c, 1, &seq, (int)layer, stream, rc);
	return rc < 0 ? rc : (int)(to - from);
}

KVT_API int kvt_seq_write_rows(kvt_cache *c, uint32_t seq, uint32_t layer, uint32_t from,
			       uint32_t to, const void *k, const void *v, void *stream)
{
	return write_rows(c, "kvt_seq_write_rows", seq, layer, from, to, k, v, NULL, stream);
}

KVT_API int kvt_seq_write_rows_at(kvt_cache *c, uint32_t seq, uint32_t layer, uint32_t from,
				  uint32_t to, const void *k, const void *v,
				  const kvt_rows_layout *layout, void *stream)
{
	return write_rows(c, "kvt_seq_write_rows_at", seq, layer, from, to, k, v, layout, stream);
}

KVT_API int kvt_seq_bytes(kvt_cache *c, uint32_t seq, uint64_t *host, uint64_t *nvme)
{
	struct kvt_seq *s = NULL;
	KVT_RETURN_IF(!c, NULL, -EINVAL, "cache is NULL");
	KVT_TRY(kvt_seq_lookup(c, seq, &s));
	uint64_t h = 0, n = 0;
	for (uint32_t i = 0; i < c->cfg.n_layers; i++) {
		const struct kvt_layer *l = &s->layers[i];
		for (uint32_t kh = 0; kh < c->cfg.n_kv_heads; kh++)
			for (uint32_t b = 0; b < l->n_blocks; b++) {
				size_t at = (size_t)kh * l->blk_cap + b;
				if (l->blocks[at])
					h += c->host.block_bytes;
				else if (l->spill)
					n += l->spill[at].loc.bytes;
			}
	}
	if (host)
		*host = h;
	if (nvme)
		*nvme = n;
	return 0;
}
