/* SPDX-License-Identifier: MIT */
/*
 * The device mirror of one (sequence, layer) (struct gpu_seq_layer): the index arrays, the
 * centroids, the window ring and the block table the kernels follow into the host tier. Created on
 * a layer's first call, grown with its index (keeping what it holds), and brought up to date with
 * the host block table before a kernel reads rows through it.
 */
#include "cuda_backend.h"

void gpu_mirror_free(kvt_cache *c, struct gpu_seq_layer *g)
{
	if (!g)
		return;
	gpu_dfree(c, g->codes);
	gpu_dfree(c, g->sigma);
	gpu_dfree(c, g->beta);
	gpu_dfree(c, g->cent);
	gpu_dfree(c, g->ring);
	gpu_dfree(c, g->blk);
	kvt_mem_free(KVT_MEM_HOST, g, 0);
}

int gpu_mirror_get(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer **out)
{
	if (!l->dev) {
		const uint32_t H = c->cfg.n_kv_heads;
		struct gpu_seq_layer *g = kvt_mem_alloc(KVT_MEM_HOST, sizeof *g);
		KVT_RETURN_IF(!g, c, -ENOMEM, "out of memory for a layer's GPU state");
		g->wcap = c->cfg.window + 2 * c->cfg.flush_batch;
		int rc = gpu_dalloc(c, (void **)&g->cent, sizeof(float) * 2 * H * c->d, "centroids");
		if (rc == 0)
			rc = gpu_dalloc(c, &g->ring, (size_t)H * g->wcap * c->row_bytes,
					"the window ring");
		if (rc < 0) {
			gpu_mirror_free(c, g);
			return rc;
		}
		l->dev = g;
	}
	*out = l->dev;
	return 0;
}

/* Copy the first n_indexed entries per KV head of the old index arrays into the new ones. */
static int copy_index(kvt_cache *c, const struct gpu_seq_layer *g, uint32_t ni, uint32_t cap,
		      void *codes, void *sigma, void *beta, void *stream)
{
	const enum cudaMemcpyKind k = cudaMemcpyDeviceToDevice;
	const cudaStream_t s = (cudaStream_t)stream;
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t cw = sizeof(uint32_t) * c->words, cs = 2 * (size_t)cap, gs = 2 * (size_t)g->cap;
	CU(c, cudaMemcpy2DAsync(codes, cw * cap, g->codes, cw * g->cap, cw * ni, H, k, s));
	CU(c, cudaMemcpy2DAsync(sigma, cs, g->sigma, gs, 2 * (size_t)ni, H, k, s));
	CU(c, cudaMemcpy2DAsync(beta, cs, g->beta, gs, 2 * (size_t)ni, H, k, s));
	return 0;
}

int gpu_mirror_reserve(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer *g, uint32_t layer,
		       uint32_t tokens, void *stream)
{
	if (tokens <= g->cap && g->codes)
		return 0;
	KVT_TRY(gpu_no_capture(c, stream, "growing the index"));
	const uint32_t H = c->cfg.n_kv_heads, W = c->words;
	uint32_t cap = g->cap ? g->cap * 2 : 1024;
	cap = cap < tokens ? tokens : cap;
	void *codes = NULL, *sigma = NULL, *beta = NULL;
	int rc = gpu_dalloc(c, &codes, sizeof(uint32_t) * W * H * cap, "the index codes");
	if (rc == 0)
		rc = gpu_dalloc(c, &sigma, sizeof(uint16_t) * H * cap, "the index sigma");
	if (rc == 0)
		rc = gpu_dalloc(c, &beta, sizeof(uint16_t) * H * cap, "the index beta");
	if (rc == 0)
		rc = gpu_wait_index(c, layer, stream);
	if (rc == 0 && cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess)
		rc = kvt_seterr(c, -EIO, "cudaStreamSynchronize before growing the index failed");
	if (rc == 0 && g->codes && l->n_indexed) {
		rc = copy_index(c, g, l->n_indexed, cap, codes, sigma, beta, stream);
		/* the old arrays are freed below: the copies read them */
		if (rc == 0 && cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess)
			rc = kvt_seterr(c, -EIO, "cudaStreamSynchronize after growing the index failed");
	}
	if (rc < 0) {
		gpu_dfree(c, codes);
		gpu_dfree(c, sigma);
		gpu_dfree(c, beta);
		return rc;
	}
	gpu_dfree(c, g->codes);
	gpu_dfree(c, g->sigma);
	gpu_dfree(c, g->beta);
	g->codes = codes;
	g->sigma = sigma;
	g->beta = beta;
	g->cap = cap;
	return 0;
}

int gpu_mirror_sync_blocks(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer *g,
			   void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	if (g->blk && g->blk_cap == l->blk_cap && g->blk_gen == l->blocks_gen) {
		if (l->n_blocks <= g->blk_n)
			return 0;
		/* new blocks at the end: upload just those, in stream order */
		for (uint32_t h = 0; h < H; h++) {
			size_t at = (size_t)h * l->blk_cap + g->blk_n;
			LAUNCH(c, kvt_gpu_upload(g->blk + at, l->blocks + at,
						 sizeof(void *) * (l->n_blocks - g->blk_n), stream));
		}
		g->blk_n = l->n_blocks;
		return 0;
	}
	KVT_TRY(gpu_no_capture(c, stream, "a new block table"));
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	if (g->blk_cap != l->blk_cap || !g->blk) {
		void *t = NULL;
		KVT_TRY(gpu_dalloc(c, &t, sizeof(void *) * H * l->blk_cap, "a block table"));
		CU(c, cudaDeviceSynchronize());
		gpu_dfree(c, g->blk);
		g->blk = t;
		g->blk_cap = l->blk_cap;
	}
	/* in stream order: a plain cudaMemcpy from pageable memory returns before its bytes land,
	 * and a non-blocking stream's next kernel would not wait for them */
	CU(c, cudaMemcpyAsync(g->blk, l->blocks, sizeof(void *) * H * l->blk_cap,
			      cudaMemcpyHostToDevice, (cudaStream_t)stream));
	g->blk_n = l->n_blocks;
	g->blk_gen = l->blocks_gen;
	return 0;
}

int gpu_mirror_copy_index(kvt_cache *c, const struct gpu_seq_layer *from, uint32_t ni,
			  struct gpu_seq_layer *to, void *stream)
{
	return copy_index(c, from, ni, to->cap, to->codes, to->sigma, to->beta, stream);
}

kvt_gpu_index_view gpu_mirror_view(const struct gpu_seq_layer *g)
{
	return (kvt_gpu_index_view){
		.codes = g->codes, .sigma = g->sigma, .beta = g->beta, .cap = g->cap};
}

kvt_gpu_fetch_seq gpu_mirror_fetch(const kvt_cache *c, struct kvt_layer *l,
				   const struct gpu_seq_layer *g, uint32_t n_tokens, uint32_t n_indexed)
{
	return (kvt_gpu_fetch_seq){.blocks = (void *const *)g->blk,
				   .ring = g->ring,
				   .uid = l->seq_uid,
				   .blk_cap = g->blk_cap,
				   .wcap = g->wcap,
				   .n_sink = kvt_sinks_of(c, n_tokens),
				   .n_indexed = n_indexed,
				   .n_tokens = n_tokens,
				   .flags = kvt_layer_spilled(c, l) ? KVT_GPU_FETCH_SPILLED : 0};
}
