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

void gpu_pinned_free(kvt_cache *c, void *p, size_t bytes)
{
	if (!p)
		return;
	kvt_mem_unpin(&c->mem, p, bytes);
	kvt_mem_free(KVT_MEM_PAGES, p, bytes);
}

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
	void *q = kvt_mem_alloc(KVT_MEM_PAGES, want);
	KVT_RETURN_IF(!q, c, -ENOMEM, "out of host memory for %s (%zu bytes)", what, want);
	if (kvt_mem_pin(&c->mem, q, want) < 0) {
		kvt_mem_free(KVT_MEM_PAGES, q, want);
		return kvt_seterr(c, -ENOMEM, "pinning %zu bytes of host memory for %s failed", want,
				  what);
	}
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

/* One spilled (sequence, KV head) item's rows to stage: positions and row numbers in the item. */
struct want {
	int32_t *pos;
	uint32_t *k;
	uint32_t n;
};

/* The rows of item (i, h) that missed the hot cache and lie in spilled blocks. */
static uint32_t misses_of(const kvt_cache *c, const struct kvt_layer *l, uint32_t h,
			  const void *const *rows, const int32_t *pos, uint32_t n, int32_t *pos_out,
			  uint32_t *k_out)
{
	uint32_t m = 0;
	for (uint32_t k = 0; k < n; k++) {
		const uint32_t at = (uint32_t)pos[k];
		if (rows[k] || at / KVT_BLOCK_TOKENS >= l->n_blocks ||
		    l->blocks[(size_t)h * l->blk_cap + at / KVT_BLOCK_TOKENS])
			continue;
		if (pos_out) {
			pos_out[m] = (int32_t)at;
			k_out[m] = k;
		}
		m++;
	}
	return m;
}

/* Plan and read every item's missed rows of spilled blocks in one submission (the block cache's
 * prefetch); the per-item kvt_rows_get calls that follow find them cached. */
static int prefetch(kvt_cache *c, uint32_t n_seqs, struct kvt_layer *const *ls, const char *m,
		    size_t seq_meta, uint32_t max_rows, int32_t *want_pos, uint32_t *want_k)
{
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t per = (size_t)H * max_rows;
	kvt_rows_prefetch_begin(c);
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		const char *at = m + (size_t)j++ * seq_meta;
		const uint32_t *sel_n = (const uint32_t *)(at + per * (sizeof(void *) + sizeof(int32_t)));
		const uint32_t S = kvt_sinks_of(c, l->sel_tokens);
		for (uint32_t h = 0; h < H; h++) {
			uint32_t n = S + sel_n[h] < max_rows ? S + sel_n[h] : max_rows;
			uint32_t w = misses_of(c, l, h, (const void *const *)at + (size_t)h * max_rows,
					       (const int32_t *)(at + per * sizeof(void *)) +
						       (size_t)h * max_rows,
					       n, want_pos, want_k);
			if (w)
				kvt_rows_prefetch_add(c, l, h, w, want_pos);
		}
	}
	return kvt_rows_prefetch(c);
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
	enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
	CU(c, cudaStreamIsCapturing((cudaStream_t)stream, &cs));
	KVT_RETURN_IF(cs != cudaStreamCaptureStatusNone, c, -EINVAL,
		      "layer %u: a sequence of the batch has rows on NVMe, which a step reads from "
		      "the disk: it cannot be captured into a graph (kvt_seq_restore it first)",
		      layer);
	if (!b->sp_ev)
		CU(c, cudaEventCreateWithFlags(&b->sp_ev, cudaEventDisableTiming));
	KVT_TRY(staging_idle(c));
	/* metadata: per spilled sequence its rows, positions and counts; then one item's wants:
	 * row pointers, positions, row numbers */
	const size_t seq_meta = (per * (sizeof(void *) + sizeof(int32_t)) + H * sizeof(uint32_t) +
				 15) & ~(size_t)15;
	const size_t meta = n_sp * seq_meta + (size_t)max_rows * (sizeof(void *) + 2 * sizeof(int32_t));
	KVT_TRY(pinned_grow(c, &b->sp_meta, &b->sp_meta_bytes, meta, "spilled rows' metadata"));
	char *m = b->sp_meta;
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
	/* how many rows to stage, then the staging, then each item's reads */
	size_t total = 0;
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		const char *at = m + (size_t)j++ * seq_meta;
		const uint32_t *sel_n = (const uint32_t *)(at + per * (sizeof(void *) + sizeof(int32_t)));
		const uint32_t S = kvt_sinks_of(c, l->sel_tokens);
		for (uint32_t h = 0; h < H; h++) {
			uint32_t n = S + sel_n[h] < max_rows ? S + sel_n[h] : max_rows;
			total += misses_of(c, l, h, (const void *const *)at + (size_t)h * max_rows,
					   (const int32_t *)(at + per * sizeof(void *)) +
						   (size_t)h * max_rows,
					   n, NULL, NULL);
		}
	}
	KVT_TRY(pinned_grow(c, &b->sp_rows, &b->sp_rows_bytes, total ? total * rb : 1,
			    "staged rows of spilled blocks"));
	const void **got = (const void **)(m + n_sp * seq_meta);
	int32_t *want_pos = (int32_t *)(got + max_rows);
	uint32_t *want_k = (uint32_t *)(want_pos + max_rows);
	/* the reads of every item in one submission (the queue depth filled), then each item's rows */
	KVT_TRY(prefetch(c, n_seqs, ls, m, seq_meta, max_rows, want_pos, want_k));
	char *stage = b->sp_rows;
	b->sp_used = true; /* the copies below read the metadata buffer */
	for (uint32_t i = 0, j = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		if (!kvt_layer_spilled(c, ls[i]))
			continue;
		char *at = m + (size_t)j++ * seq_meta;
		const uint32_t *sel_n = (const uint32_t *)(at + per * (sizeof(void *) + sizeof(int32_t)));
		const uint32_t S = kvt_sinks_of(c, l->sel_tokens);
		for (uint32_t h = 0; h < H; h++) {
			const void **r = (const void **)at + (size_t)h * max_rows;
			const int32_t *p = (const int32_t *)(at + per * sizeof(void *)) +
					   (size_t)h * max_rows;
			uint32_t n = S + sel_n[h] < max_rows ? S + sel_n[h] : max_rows;
			uint32_t w = misses_of(c, l, h, r, p, n, want_pos, want_k);
			if (!w)
				continue;
			int rc = kvt_rows_get(c, l, h, w, want_pos, got);
			if (rc < 0) {
				char why[sizeof c->err];
				snprintf(why, sizeof why, "%s", c->err);
				gpu_spilled_done(c, stream);
				return kvt_seterr(c, rc, "seqs[%u]: %s", i, why);
			}
			for (uint32_t t = 0; t < w; t++, stage += rb) {
				memcpy(stage, got[t], rb);
				r[want_k[t]] = (const void *)((uintptr_t)stage | KVT_GPU_ROW_STAGED);
			}
			CU(c, cudaMemcpyAsync(rows + (size_t)i * per + (size_t)h * max_rows, r,
					      n * sizeof(void *), cudaMemcpyHostToDevice,
					      (cudaStream_t)stream));
		}
	}
	return 0;
}
