/* SPDX-License-Identifier: MIT */
/*
 * The capacity arithmetic of kvbench --plan: how many sequences of a given context a GPU can serve
 * with kvtier (compact index, window buffer, last selection and hot cache in HBM; full K/V rows in
 * the host tier and on NVMe) against keeping the full K/V in HBM. The bytes per row, block, index
 * token, window and selection come from the library (kvt_footprint_of); tests check the result
 * against hand-computed cases (tests/test_kvbench_plan.c).
 */
#ifndef KVBENCH_PLAN_H
#define KVBENCH_PLAN_H

#include <stdint.h>

typedef struct kb_plan_in {
	uint32_t layers, kv_heads, head_dim; /* the whole model's attention shape */
	uint32_t context;                    /* tokens per sequence */
	uint32_t sinks, window, flush;       /* kvt_config.n_sink, window, flush_batch */
	uint64_t gpu_bytes;                  /* HBM of the GPU */
	uint64_t weights_bytes;              /* HBM the model weights (and activations) take */
	uint64_t hot_bytes;                  /* kvt_config.gpu_cache_bytes: the hot-token cache */
	uint64_t host_bytes;                 /* kvt_config.host_bytes */
	uint64_t nvme_bytes;                 /* all NVMe files together */
} kb_plan_in;

typedef struct kb_plan {
	uint64_t kv_free;          /* gpu_bytes - weights_bytes (0 when the weights do not fit) */
	/* full K/V in HBM */
	uint64_t full_token_bytes; /* K + V of one token over every layer and KV head: 4 D KV L */
	uint64_t full_tokens;      /* kv_free / full_token_bytes */
	uint64_t full_seqs;        /* full_tokens / context */
	/* kvtier */
	uint64_t index_token_bytes; /* (D/8 + 4) KV L */
	uint64_t index_tokens;      /* indexed tokens of a sequence: context - sinks - window (>= 0) */
	uint64_t window_seq_bytes;  /* the window ring: (window + 2 flush) rows of 4 D bytes, KV L */
	uint64_t sel_seq_bytes;     /* the last selection, as bits: kvt_footprint's
				       hbm_selection_bytes */
	uint64_t hbm_seq_bytes;     /* index_tokens * index_token_bytes + window + selection */
	uint64_t hbm_seqs;          /* (kv_free - hot_bytes) / hbm_seq_bytes */
	uint64_t block_bytes;       /* 256 rows of 4 D bytes */
	uint64_t nvme_block_bytes;  /* the same block on disk: header and payload, 4 KiB aligned */
	uint64_t seq_blocks;        /* ceil(context / 256) KV L: one sequence's host-tier blocks */
	uint64_t host_seqs;         /* (host_bytes / block_bytes) / seq_blocks */
	uint64_t tier_seqs;         /* (host blocks + NVMe blocks) / seq_blocks */
	uint64_t kvt_seqs;          /* min(hbm_seqs, tier_seqs) */
	uint64_t kvt_tokens;        /* kvt_seqs * context */
	const char *limit;          /* what bounds kvt_seqs: "HBM" or "host+NVMe" ("host" without NVMe) */
	/* the GPU alone: its hbm_seqs sequences, served from the host tier and NVMe (a spilled
	   sequence is served in place on either backend), whatever host and NVMe that takes */
	uint64_t hbm_tokens;        /* hbm_seqs * context */
	uint64_t hbm_host_bytes;    /* their blocks in the host tier first: min(all, host_bytes) in
				       whole blocks */
	uint64_t hbm_nvme_bytes;    /* the rest on NVMe, in nvme_block_bytes per block */
} kb_plan;

/* One H200's HBM (141 GB) for the plan's "one H200" line. */
#define KB_H200_HBM_BYTES 141000000000ull

/* Fill *out from *in. Returns 0, or -1 when a count is zero or the library refuses the shape
 * (kvt_footprint_of: head_dim 64, 128 or 256, at most 1024 KV heads and 4096 layers, sinks and
 * window at most 65536; kvt_last_error(NULL) says which). */
int kb_plan_compute(const kb_plan_in *in, kb_plan *out);

#endif /* KVBENCH_PLAN_H */
