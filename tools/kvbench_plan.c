/* SPDX-License-Identifier: MIT */
/*
 * Capacity arithmetic (kvbench_plan.h). What it counts, per layer and KV head:
 *   full K/V in HBM   4 D bytes per token (K and V, 2 bytes per element)
 *   kvtier in HBM     D/8 + 4 bytes per indexed token (the index: code, sigma, beta), the window
 *                     ring of window + 2 flush full rows per sequence (the CUDA backend's: a flush
 *                     reads its oldest B rows while B more arrive), each layer's last selection
 *                     (4 bytes per indexed token, the count rounded up to 4 and at least 4, plus
 *                     one for its length; sized by the batch, so counted as if every sequence held
 *                     decodes in one batch), and the hot-token cache once
 *   host tier         every token's row, in whole 256-token blocks
 *   NVMe              the same blocks, each with its header, 4 KiB aligned
 * It leaves out what does not scale with the sequences (rotations, centroids, staging) and the
 * scratch of one step (once, not per layer: scores, row lists and the threshold's histograms,
 * doc/cuda-backend.md), and counts
 * a spilled sequence's NVMe blocks without the window blocks it keeps in host memory: kvt_seqs is
 * an upper bound that a run (kvbench --plan) then checks.
 */
#include "kvbench_plan.h"

#include <stddef.h>

static uint64_t round_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}

int kb_plan_compute(const kb_plan_in *in, kb_plan *out)
{
	if (!in->layers || !in->kv_heads || !in->head_dim || in->head_dim % 8 || !in->context)
		return -1;
	const uint64_t kl = (uint64_t)in->kv_heads * in->layers, row = 4ull * in->head_dim;
	kb_plan p = {0};
	p.kv_free = in->gpu_bytes > in->weights_bytes ? in->gpu_bytes - in->weights_bytes : 0;
	p.full_token_bytes = row * kl;
	p.full_tokens = p.kv_free / p.full_token_bytes;
	p.full_seqs = p.full_tokens / in->context;

	uint64_t front = (uint64_t)in->sinks + in->window;
	p.index_token_bytes = ((uint64_t)in->head_dim / 8 + 4) * kl;
	p.index_tokens = in->context > front ? in->context - front : 0;
	p.window_seq_bytes = ((uint64_t)in->window + 2ull * in->flush) * row * kl;
	const uint64_t sel_ld = p.index_tokens ? round_up(p.index_tokens, 4) : 4;
	p.sel_seq_bytes = 4 * (sel_ld + 1) * kl;
	p.hbm_seq_bytes = p.index_tokens * p.index_token_bytes + p.window_seq_bytes + p.sel_seq_bytes;
	uint64_t hbm = p.kv_free > in->hot_bytes ? p.kv_free - in->hot_bytes : 0;
	p.hbm_seqs = p.hbm_seq_bytes ? hbm / p.hbm_seq_bytes : UINT64_MAX;

	p.block_bytes = KB_PLAN_BLOCK_TOKENS * row;
	uint64_t chunks = (p.block_bytes + 4095) / 4096;
	p.nvme_block_bytes = round_up(KB_PLAN_NVME_HDR + 4 * chunks, KB_PLAN_NVME_ALIGN) +
			     round_up(p.block_bytes, KB_PLAN_NVME_ALIGN);
	p.seq_blocks = (in->context + KB_PLAN_BLOCK_TOKENS - 1) / KB_PLAN_BLOCK_TOKENS * kl;
	uint64_t host_blocks = in->host_bytes / p.block_bytes;
	uint64_t nvme_blocks = in->nvme_bytes / p.nvme_block_bytes;
	p.host_seqs = host_blocks / p.seq_blocks;
	p.tier_seqs = (host_blocks + nvme_blocks) / p.seq_blocks;

	int hbm_bound = p.hbm_seqs <= p.tier_seqs;
	p.kvt_seqs = hbm_bound ? p.hbm_seqs : p.tier_seqs;
	p.kvt_tokens = p.kvt_seqs * in->context;
	p.limit = hbm_bound ? "HBM" : in->nvme_bytes ? "host+NVMe" : "host";
	*out = p;
	return 0;
}
