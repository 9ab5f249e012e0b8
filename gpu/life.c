/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's verbs of a sequence's lifecycle (lib/lifecycle.c calls them, after
 * synchronizing the device): a truncation's window ring refilled from the host tier (and so is a
 * failed call's, gpu_rewind), a forked sequence's mirror copied on the device (never rebuilt from
 * the host tier), and a row range copied out of the host tier (dense, or placed in a runtime's
 * paged or strided buffer through a dense device scratch: rows.cu). Rows of one block are adjacent in the host tier, so each copy moves a run of
 * rows of one KV head up to a block edge (and, into the ring, up to its wrap).
 */
#include "cuda_backend.h"
#include "rows.cuh"

static uint32_t min_u32(uint32_t a, uint32_t b)
{
	return a < b ? a : b;
}

/* Index positions [from, to) of l back into their ring slots (i % wcap) from the host tier. */
static int ring_fill(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer *g, uint32_t from,
		     uint32_t to, void *stream)
{
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++)
		for (uint32_t i = from, n; i < to; i += n) {
			const uint32_t pos = c->cfg.n_sink + i, slot = i % g->wcap;
			n = min_u32(to - i, g->wcap - slot);
			n = min_u32(n, KVT_BLOCK_TOKENS - pos % KVT_BLOCK_TOKENS);
			char *dst = (char *)g->ring + ((size_t)h * g->wcap + slot) * c->row_bytes;
			CU(c, cudaMemcpyAsync(dst, kvt_row(c, l, h, pos), n * c->row_bytes,
					      cudaMemcpyHostToDevice, (cudaStream_t)stream));
		}
	return 0;
}

int gpu_truncate(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t ni, uint32_t n_tokens,
		 void *stream)
{
	struct gpu_seq_layer *g = l->dev;
	if (!g)
		return 0;
	g->keep_stamp = 0; /* keep_weight's favored selection: forgotten, as on the CPU */
	/* the window after the call: index positions [ni, n_tokens - n_sink); those below the old
	 * index count were not in the ring since they were indexed */
	const uint32_t end = n_tokens > c->cfg.n_sink ? n_tokens - c->cfg.n_sink : 0;
	const uint32_t to = min_u32(l->n_indexed, end);
	KVT_TRY(gpu_wait_index(c, layer, stream)); /* a flush may still read the ring */
	if (ni < to)
		KVT_TRY(ring_fill(c, l, g, ni, to, stream));
	/* blocks past the new length go back: the next new ones are uploaded again */
	g->blk_n = min_u32(g->blk_n, (n_tokens + KVT_BLOCK_TOKENS - 1) / KVT_BLOCK_TOKENS);
	return 0;
}

int gpu_rewind(kvt_cache *c, struct kvt_layer *l, void *stream)
{
	struct gpu_seq_layer *g = l->dev;
	const uint32_t S = c->cfg.n_sink;
	if (!g || !g->ring || l->n_tokens <= S + l->n_indexed)
		return 0;
	return ring_fill(c, l, g, l->n_indexed, l->n_tokens - S, stream);
}

int gpu_fork(kvt_cache *c, struct kvt_layer *from, struct kvt_layer *to, uint32_t layer,
	     void *stream)
{
	const struct gpu_seq_layer *p = from->dev;
	struct gpu_seq_layer *g;
	if (!p)
		return 0;
	/* on failure the caller frees `to`, and with it the mirror made here */
	KVT_TRY(gpu_mirror_get(c, to, &g));
	/* keep_weight: the child's next step favors what the parent's would (the CPU copies the
	 * stamps), read from the parent's slot of the layer's last selection while it stands */
	g->keep_stamp = p->keep_stamp;
	g->keep_slot = p->keep_slot;
	if (p->codes) {
		KVT_TRY(gpu_mirror_reserve(c, to, g, layer, p->cap, stream));
		if (from->n_indexed)
			KVT_TRY(gpu_mirror_copy_index(c, p, from->n_indexed, g, stream));
	}
	/* in stream order, as every step that reads them */
	const enum cudaMemcpyKind d2d = cudaMemcpyDeviceToDevice;
	const cudaStream_t s = (cudaStream_t)stream;
	CU(c, cudaMemcpyAsync(g->cent, p->cent, sizeof(float) * 2 * c->cfg.n_kv_heads * c->d, d2d,
			      s));
	CU(c, cudaMemcpyAsync(g->ring, p->ring, (size_t)c->cfg.n_kv_heads * g->wcap * c->row_bytes,
			      d2d, s));
	return 0;
}

int gpu_read_rows(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k, void *v,
		  void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t half = c->d * c->elem, pitch = H * half;
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t p = from, n; p < to; p += n) {
			n = min_u32(to - p, KVT_BLOCK_TOKENS - p % KVT_BLOCK_TOKENS);
			const char *src = kvt_row(c, l, h, p);
			const size_t at = ((size_t)(p - from) * H + h) * half;
			CU(c, cudaMemcpy2DAsync((char *)k + at, pitch, src, c->row_bytes, half, n,
						cudaMemcpyHostToDevice, (cudaStream_t)stream));
			CU(c, cudaMemcpy2DAsync((char *)v + at, pitch, src + half, c->row_bytes, half, n,
						cudaMemcpyHostToDevice, (cudaStream_t)stream));
		}
	return 0;
}

/* The dense rows of n tokens (K then V, [n, n_kv_heads, d] each) in the device scratch, and m's
 * slot mapping after them (NULL without one), uploaded on the stream: a pageable copy, so the
 * caller's array may change once this returns. */
static int rows_scratch(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, char **dense,
			const int64_t **slots, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const size_t one = gpu_up((size_t)n * c->cfg.n_kv_heads * c->d * c->elem);
	const size_t map = m->slot ? sizeof(int64_t) * n : 0;
	KVT_TRY(gpu_grow(c, &b->rows_mem, &b->rows_bytes, 2 * one + map, stream,
			 "the dense rows of a paged or strided layout"));
	*dense = b->rows_mem;
	*slots = m->slot ? (const int64_t *)(*dense + 2 * one) : NULL;
	if (m->slot)
		CU(c, cudaMemcpyAsync((void *)*slots, m->slot, map, cudaMemcpyHostToDevice,
				      (cudaStream_t)stream));
	return 0;
}

int gpu_read_rows_at(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
		     void *v, const struct kvt_rows_map *m, void *stream)
{
	const uint32_t n = to - from;
	const size_t one = gpu_up((size_t)n * c->cfg.n_kv_heads * c->d * c->elem);
	char *dense;
	const int64_t *slots;
	KVT_TRY(rows_scratch(c, m, n, &dense, &slots, stream));
	KVT_TRY(gpu_read_rows(c, l, from, to, dense, dense + one, stream));
	LAUNCH(c, kvt_gpu_rows_place(c->d, c->cfg.n_kv_heads, n, slots, m->slot_stride,
				     m->head_stride, k, v, dense, dense + one, 1, stream));
	return 0;
}

int gpu_gather_rows(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, const void *k,
		    const void *v, void **dk, void **dv, void *stream)
{
	const size_t one = gpu_up((size_t)n * c->cfg.n_kv_heads * c->d * c->elem);
	char *dense;
	const int64_t *slots;
	KVT_TRY(rows_scratch(c, m, n, &dense, &slots, stream));
	LAUNCH(c, kvt_gpu_rows_place(c->d, c->cfg.n_kv_heads, n, slots, m->slot_stride,
				     m->head_stride, (void *)k, (void *)v, dense, dense + one, 0,
				     stream));
	*dk = dense;
	*dv = dense + one;
	return 0;
}
