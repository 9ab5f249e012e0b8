/* SPDX-License-Identifier: MIT */
/*
 * kvt_graph_reserve on the CUDA backend: the device records of every (layer, sequence id) that
 * kvt_attend_graph's descriptor kernel reads when a step runs (gpu/graph.cuh), refreshed by every
 * call that changes a sequence (lib/graph.c's kvt_graph_touch), and the reserved geometry that
 * every step within the bounds uses, so that eager and replayed steps are laid out alike.
 */
#include <string.h>

#include "cuda_backend.h"

/* Records carried per publish launch: one chunk of gpu/graph.cu's parameter blob. */
#define ROWS_PER_PUBLISH 16u

static size_t table_rows(const kvt_cache *c)
{
	return (size_t)c->cfg.n_layers * c->cfg.max_seqs;
}

/* The record of (seq, layer) from the host's state: zeros when there is no sequence with rows. */
static int row_of(kvt_cache *c, uint32_t seq, uint32_t layer, void *stream, kvt_gpu_graph_row *r)
{
	memset(r, 0, sizeof *r);
	struct kvt_seq *s = &c->seqs[seq];
	if (!s->open || !s->layers[layer].n_tokens)
		return 0;
	struct kvt_layer *l = &s->layers[layer];
	struct gpu_seq_layer *g;
	KVT_TRY(gpu_mirror_get(c, l, &g));
	KVT_TRY(gpu_mirror_sync_blocks(c, l, g, stream));
	r->view = gpu_mirror_view(g);
	r->ck = g->cent;
	r->cq = g->cent + (size_t)c->cfg.n_kv_heads * c->d;
	r->f = gpu_mirror_fetch(c, l, g, l->n_tokens, l->n_indexed);
	r->n_tokens = l->n_tokens;
	r->spilled = r->f.flags != 0;
	r->in_error = s->status != 0;
	return 0;
}

/* Every record, built on the host and copied in one piece; complete when it returns. */
static int publish_all(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	const size_t n = table_rows(c), bytes = sizeof(kvt_gpu_graph_row) * n;
	kvt_gpu_graph_row *rows = kvt_mem_alloc(KVT_MEM_HOST, bytes);
	KVT_RETURN_IF(!rows, c, -ENOMEM, "out of memory for %zu graph records", n);
	int rc = 0;
	for (uint32_t y = 0; y < c->cfg.n_layers && rc == 0; y++)
		for (uint32_t s = 0; s < c->cfg.max_seqs && rc == 0; s++)
			rc = row_of(c, s, y, NULL, &rows[(size_t)y * c->cfg.max_seqs + s]);
	/* a record that could not be made leaves the table as it was */
	const cudaError_t e = rc < 0 ? cudaSuccess
				     : cudaMemcpy(b->g_table, rows, bytes, cudaMemcpyHostToDevice);
	kvt_mem_free(KVT_MEM_HOST, rows, bytes);
	CU(c, e);
	if (rc == 0)
		KVT_TRY(gpu_settle(c, "the graph records' upload"));
	return rc;
}

int gpu_graph_publish(kvt_cache *c, uint32_t n, const uint32_t *seqs, int layer, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	if (!b->g_table)
		return 0;
	if (!seqs) {
		/* after a spill or restore the old records may name freed blocks: when they cannot
		 * be rewritten, every one reads as no sequence (graph steps then pad every slot) */
		const int rc = publish_all(c);
		if (rc < 0) {
			(void)cudaMemset(b->g_table, 0, sizeof(kvt_gpu_graph_row) * table_rows(c));
			(void)cudaDeviceSynchronize();
		}
		return rc;
	}
	const uint32_t L = c->cfg.n_layers, y0 = layer < 0 ? 0 : (uint32_t)layer,
		       y1 = layer < 0 ? L : (uint32_t)layer + 1;
	kvt_gpu_graph_row rows[ROWS_PER_PUBLISH];
	uint32_t at[ROWS_PER_PUBLISH], k = 0;
	int rc = 0;
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t y = y0; y < y1; y++) {
			const int e = row_of(c, seqs[i], y, stream, &rows[k]);
			if (e < 0) {
				memset(&rows[k], 0, sizeof rows[k]);
				rc = rc < 0 ? rc : e;
			}
			at[k++] = y * c->cfg.max_seqs + seqs[i];
			if (k == ROWS_PER_PUBLISH || (i + 1 == n && y + 1 == y1)) {
				LAUNCH(c, kvt_gpu_graph_publish((kvt_gpu_graph_row *)b->g_table, k,
								at, rows, stream));
				k = 0;
			}
		}
	return rc;
}

void gpu_graph_fini(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	gpu_dfree(c, b->g_table);
	gpu_dfree(c, b->g_zero);
	b->g_table = NULL;
	b->g_zero = NULL;
	b->g_slots = b->g_tokens = 0;
	for (uint32_t y = 0; b->lay && y < c->cfg.n_layers; y++) {
		gpu_dfree(c, b->lay[y].g_sel_mem);
		b->lay[y].g_sel_mem = NULL;
		b->lay[y].g_sel_bytes = 0;
	}
}

int gpu_graph_reserve(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	KVT_RETURN_IF(max_slots && c->cfg.keep_weight != 0.0f, c, -EOPNOTSUPP,
		      "keep_weight = %g: kvt_attend_graph has no selection hysteresis yet (its "
		      "steps keep no selection a next one could favor); use kvt_attend",
		      (double)c->cfg.keep_weight);
	if (!max_slots) {
		CU(c, cudaDeviceSynchronize()); /* captured graphs may still read the records */
		gpu_graph_fini(c);
		return 0;
	}
	if (!b->g_table) {
		int rc = gpu_dalloc(c, &b->g_table, sizeof(kvt_gpu_graph_row) * table_rows(c),
				    "the graph records");
		if (rc == 0)
			rc = gpu_dalloc(c, (void **)&b->g_zero,
					sizeof(float) * 2 * c->cfg.n_kv_heads * c->d,
					"the graph's zero centroids");
		if (rc < 0) {
			gpu_graph_fini(c);
			return rc;
		}
	}
	/* the scratch of the largest step (and the graph steps' own selection) and the records */
	int rc = gpu_step_reserve(c, max_slots, max_tokens, stream);
	if (rc == 0)
		rc = publish_all(c);
	if (rc == 0 && cudaDeviceSynchronize() != cudaSuccess)
		rc = kvt_seterr(c, -EIO, "kvt_graph_reserve: the device failed: %s",
				cudaGetErrorString(cudaGetLastError()));
	if (rc < 0) {
		/* the scratch may have moved under graphs captured before: no reservation stands */
		(void)cudaDeviceSynchronize();
		gpu_graph_fini(c);
		return rc;
	}
	b->g_slots = max_slots;
	b->g_tokens = max_tokens;
	return 0;
}

bool gpu_graph_geometry(const kvt_cache *c, uint32_t n_seqs, uint32_t *max_ni, uint32_t *max_rows,
			uint32_t *split)
{
	const struct gpu_cache *b = gpu_of(c);
	*split = 0;
	if (!b->g_slots)
		return true;
	if (n_seqs > b->g_slots || *max_ni > b->g_tokens || *max_rows > b->g_tokens)
		return false;
	*max_ni = *max_rows = b->g_tokens;
	*split = b->g_slots;
	return true;
}
