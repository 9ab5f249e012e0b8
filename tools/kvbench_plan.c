/* SPDX-License-Identifier: MIT */
/*
 * Capacity arithmetic (kvbench_plan.h) on the library's sizing call, kvt_footprint_of: the row,
 * block, index, window and selection bytes are the library's; this file only divides the GPU, host
 * and NVMe budgets by them. What it counts, per layer and KV head:
 *   full K/V in HBM   4 D bytes per token (K and V, 2 bytes per element)
 *   kvtier in HBM     D/8 + 4 bytes per indexed token (the index: code, sigma, beta), the window
 *                     ring of window + 2 flush full rows per sequence (the CUDA backend's: a flush
 *                     reads its oldest B rows while B more arrive), each layer's last selection
 *                     (kept as bits: 1 bit per indexed token, 4 bytes per 8192 tokens and 4 for its
 *                     length; sized by the batch, so counted as if every sequence held decodes in
 *                     one batch), and the hot-token cache once
 *   host tier         every token's row, in whole 256-token blocks
 *   NVMe              the same blocks, each with its header, 4 KiB aligned
 * It leaves out the rotations (once per cache), the centroids and the device block table (per
 * sequence, small: kvt_footprint's hbm_centroid_bytes and hbm_block_table_bytes), staging, and the
 * scratch of one step (once, not per layer: scores, row lists and the threshold's histograms,
 * doc/cuda-backend.md), and counts
 * a spilled sequence's NVMe blocks without the window blocks it keeps in host memory: kvt_seqs is
 * an upper bound that a run (kvbench --plan) then checks. Both backends serve a spilled
 * sequence's rows in place (the CUDA backend since issue 14), so NVMe blocks count on either; the
 * hbm_* figures answer what the GPU alone bounds: its sequences, with their K/V in the host tier
 * first and the rest on NVMe, however much NVMe that takes.
 */
#include "kvbench_plan.h"

#include <stddef.h>

#include "kvtier.h"

/* The library's figures for one sequence of in->context tokens (kvt_footprint_of). */
static int footprint(const kb_plan_in *in, kvt_footprint *f)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = in->layers;
	cfg.n_q_heads = in->kv_heads; /* query heads change no byte of the footprint */
	cfg.n_kv_heads = in->kv_heads;
	cfg.head_dim = in->head_dim;
	cfg.n_sink = KVT_EXACT(in->sinks);
	cfg.window = KVT_EXACT(in->window);
	cfg.flush_batch = in->flush;
	f->size = sizeof *f;
	return kvt_footprint_of(&cfg, in->context, f) < 0 ? -1 : 0;
}

int kb_plan_compute(const kb_plan_in *in, kb_plan *out)
{
	kvt_footprint f;
	if (!in->layers || !in->kv_heads || !in->head_dim || !in->context || !in->flush ||
	    footprint(in, &f) < 0)
		return -1;
	kb_plan p = {0};
	p.kv_free = in->gpu_bytes > in->weights_bytes ? in->gpu_bytes - in->weights_bytes : 0;
	p.full_token_bytes = f.row_bytes * in->kv_heads * in->layers;
	p.full_tokens = p.kv_free / p.full_token_bytes;
	p.full_seqs = p.full_tokens / in->context;

	p.index_token_bytes = f.index_token_bytes;
	p.index_tokens = f.index_tokens;
	p.window_seq_bytes = f.hbm_window_bytes;
	p.sel_seq_bytes = f.hbm_selection_bytes;
	p.hbm_seq_bytes = f.hbm_index_bytes + p.window_seq_bytes + p.sel_seq_bytes;
	uint64_t hbm = p.kv_free > in->hot_bytes ? p.kv_free - in->hot_bytes : 0;
	p.hbm_seqs = p.hbm_seq_bytes ? hbm / p.hbm_seq_bytes : UINT64_MAX;

	p.block_bytes = f.block_bytes;
	p.nvme_block_bytes = f.nvme_block_bytes;
	p.seq_blocks = f.seq_blocks;
	uint64_t host_blocks = in->host_bytes / p.block_bytes;
	uint64_t nvme_blocks = in->nvme_bytes / p.nvme_block_bytes;
	p.host_seqs = host_blocks / p.seq_blocks;
	p.tier_seqs = (host_blocks + nvme_blocks) / p.seq_blocks;

	int hbm_bound = p.hbm_seqs <= p.tier_seqs;
	p.kvt_seqs = hbm_bound ? p.hbm_seqs : p.tier_seqs;
	p.kvt_tokens = p.kvt_seqs * in->context;
	p.limit = hbm_bound ? "HBM" : in->nvme_bytes ? "host+NVMe" : "host";

	uint64_t hbm_blocks = p.hbm_seqs * p.seq_blocks;
	uint64_t in_host = hbm_blocks < host_blocks ? hbm_blocks : host_blocks;
	p.hbm_tokens = p.hbm_seqs * in->context;
	p.hbm_host_bytes = in_host * p.block_bytes;
	p.hbm_nvme_bytes = (hbm_blocks - in_host) * p.nvme_block_bytes;
	*out = p;
	return 0;
}
