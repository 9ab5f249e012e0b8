/* SPDX-License-Identifier: MIT */
/*
 * Rows of spilled blocks, served in place by a decode step or a gather of the CUDA backend (issue
 * 14): nothing of the sequence is restored, only the rows the step selected that missed the hot
 * cache cross the disk.
 *
 * Between the two halves of the fetch (gpu/fetch.cuh): the lookup has written, for every (sequence,
 * KV head) item, the token position of each row and the hot-cache hits; for the sequences with
 * blocks on NVMe (KVT_GPU_FETCH_SPILLED) the rows, positions and selected counts come back to the
 * host (one synchronization). Each missed row of a spilled block is read through the NVMe tier's
 * block cache (kvt_rows_get: 4 KiB chunks, crc-verified before use), copied into pinned, mapped
 * staging and its address written back tagged KVT_GPU_ROW_STAGED; the fill then treats it as any
 * other miss (a hot-cache way, or read in place by the attention). A read that fails fails the
 * step with its code and text; nothing unverified reaches the device.
 *
 * The step waits for the disk, so it cannot be captured into a CUDA graph: a capture that meets a
 * spilled sequence is refused (restore the sequence first).
 */
#include <stdio.h>
#include <string.h>

#include "cuda_backend.h"

/* Wait until no queued work reads the staging or the metadata buffer. */
static int staging_idle(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	if (b->sp_pending) {
		CU(c, cudaEventSynchronize(b->sp_ev));
		b->sp_pending = false;
	}
	return 0;
}

/* Grow a pinned, mapped host buffer to `need` bytes (contents not kept). */
static int pinned_grow(kvt_cache *c, void **p, size_t *have, size_t need, const char *what)
{
	if (need <= *have && *p)
		return 0;
	size_t want = (need + need / 4 + 4095) & ~(size_t)4095;
	void *q = NULL;
	KVT_TRY(gpu_pinned_alloc(c, &q, want, what));
	gpu_pinned_free(c, *p, *have);
	*p = q;
	*have = want;
	return 0;
}

int gpu_spilled_done(kvt_cache *c, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	if (!b->sp_used)
		return 0;
	b->sp_used = false;
	CU(c, cudaEventRecord(b->sp_ev, (cudaStream_t)stream));
	b->sp_pending = true;
	return 0;
}

/*
 * The rows of item (sequence j of the spilled ones, KV head h) that missed the hot cache and lie in
 * spilled blocks, compacted in place: their positions to the front of the item's position array,
 * their row numbers to k_out. Returns their count.
 */
static uint32_t misses_of(const struct kvt_layer *l, uint32_t h, const void *const *rows,
			  int32_t *pos, uint32_t n, uint32_t *k_out)
{
	uint32_t m = 0;
	for (uint32_t k = 0; k < n; k++) {
		const uint32_t at = (uint32_t)pos[k], b = at / KVT_BLOCK_TOKENS;
		if (rows[k] || b >= l->n_blocks || l->blocks[(size_t)h * l->blk_cap + b])
			continue;
		pos[m] = (int32_t)at; /* m <= k: read before written */
		k_out[m++] = k;
	}
	return m;
}

int gpu_serve_spilled(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      bool reread, const void **rows, int32_t *pos, uint32_t max_rows, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const struct gpu_layer *y = &b->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t rb = c->row_bytes, per = (size_t)H * max_rows;
	uint32_t n_sp = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		n_sp += kvt_layer_spilled(c, ls[i]);
	if (!n_sp)
		return 0;
	char capture[192];
	snprintf(capture, sizeof capture,
		 "layer %u: a sequence of the batch has rows on NVMe, which a step reads from the "
		 "disk: it cannot be captured into a graph (kvt_seq_restore it first)",
		 layer);
	KVT_TRY(gpu_refuse_capture(c, stream, capture));
	if (!b->sp_ev)
		CU(c, cudaEventCreateWithFlags(&b->sp_ev, cudaEventDisableTiming));
	KVT_TRY(staging_idle(c));
	/* metadata (pinned): per spilled sequence its rows, positions and counts; then per item the
	 * row numbers to stage and their count; then one item's row pointers */
	const size_t seq_meta = (per * (sizeof(void *) + sizeof(int32_t)) + H * sizeof(uint32_t) +
				 15) & ~(size_t)15;
	const size_t ks_bytes = (n_sp * per * sizeof(uint32_t) + 15) & ~(size_t)15;
	const size_t meta = n_sp * seq_meta + ks_bytes +
			    ((n_sp * H * sizeof(uint32_t) + 15) & ~(size_t)15) +
			    (size_t)max_rows * sizeof(void *);
	KVT_TRY(pinned_grow(c, &b->sp_meta, &b->sp_meta_bytes, meta, "spilled rows' metadata"));
	char *m = b->sp_meta;
	uint32_t *ks = (uint32_t *)(m + n_sp * seq_meta);
	uint32_t *nw = (uint32_t *)((char *)ks + ks_bytes);
	const void **got = (const void **)(m + meta - (size_t)max_rows * sizeof(void *));
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		const struct gpu_seq_layer *g = ls[i]->dev;
		const uint32_t slot = reread ? g->sel_slot : i;
		char *at = m + (size_t)j++ * seq_meta;
		CU(c, cudaMemcpyAsync(at, rows + (size_t)i * per, per * sizeof(void *),
				      cudaMemcpyDeviceToHost, (cudaStream_t)stream));
		CU(c, cudaMemcpyAsync(at + per * sizeof(void *), pos + (size_t)i * per,
				      per * sizeof(int32_t), cudaMemcpyDeviceToHost,
				      (cudaStream_t)stream));
		CU(c, cudaMemcpyAsync(at + per * (sizeof(void *) + sizeof(int32_t)),
				      y->sel_n + (size_t)slot * H, H * sizeof(uint32_t),
				      cudaMemcpyDeviceToHost, (cudaStream_t)stream));
	}
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	KVT_TRY(gpu_check_err(c)); /* the lookup's range errors first */
	/* one pass: each item's misses in spilled blocks, planned for one read submission */
	size_t total = 0;
	kvt_rows_prefetch_begin(c);
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		char *at = m + (size_t)j * seq_meta;
		const uint32_t *sel_n = (const uint32_t *)(at + per * (sizeof(void *) + sizeof(int32_t)));
		const uint32_t S = kvt_sinks_of(c, l->sel_tokens);
		for (uint32_t h = 0; h < H; h++) {
			const size_t item = (size_t)j * H + h;
			int32_t *p = (int32_t *)(at + per * sizeof(void *)) + (size_t)h * max_rows;
			const uint32_t n = S + sel_n[h] < max_rows ? S + sel_n[h] : max_rows;
			nw[item] = misses_of(l, h, (const void *const *)at + (size_t)h * max_rows, p, n,
					     ks + item * max_rows);
			if (nw[item])
				kvt_rows_prefetch_add(c, l, h, nw[item], p);
			total += nw[item];
		}
		j++;
	}
	KVT_TRY(kvt_rows_prefetch(c));
	KVT_TRY(pinned_grow(c, &b->sp_rows, &b->sp_rows_bytes, total ? total * rb : 1,
			    "staged rows of spilled blocks"));
	/* each item's rows: read (found in the block cache now), staged, their addresses tagged */
	char *stage = b->sp_rows;
	b->sp_used = true; /* the copies below read the metadata buffer */
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		char *at = m + (size_t)j * seq_meta;
		for (uint32_t h = 0; h < H; h++) {
			const size_t item = (size_t)j * H + h;
			const uint32_t w = nw[item], *k = ks + item * max_rows;
			const void **r = (const void **)at + (size_t)h * max_rows;
			const int32_t *p = (const int32_t *)(at + per * sizeof(void *)) +
					   (size_t)h * max_rows;
			if (!w)
				continue;
			int rc = kvt_rows_get(c, l, h, w, p, got);
			if (rc < 0) {
				char why[sizeof c->err];
				snprintf(why, sizeof why, "%s", c->err);
				return kvt_err_entry(c, i, kvt_seterr(c, rc, "seqs[%u]: %s", i, why));
			}
			for (uint32_t t = 0; t < w; t++, stage += rb) {
				memcpy(stage, got[t], rb);
				r[k[t]] = (const void *)((uintptr_t)stage | KVT_GPU_ROW_STAGED);
			}
			/* the item's rows up to its last staged one */
			CU(c, cudaMemcpyAsync(rows + (size_t)i * per + (size_t)h * max_rows, r,
					      (k[w - 1] + 1) * sizeof(void *), cudaMemcpyHostToDevice,
					      (cudaStream_t)stream));
		}
		j++;
	}
	return 0;
}
