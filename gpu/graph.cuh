/* SPDX-License-Identifier: MIT */
/*
 * The device side of kvt_attend_graph: a table with one record per (layer, sequence id), which the
 * host refreshes whenever a call changes a sequence (gpu/graph.c), and the kernel that turns the
 * caller's slot buffers into the step's descriptors when the step runs, so that a captured graph
 * reads the batch of each replay. C and C++.
 */
#ifndef KVT_GPU_GRAPH_CUH
#define KVT_GPU_GRAPH_CUH

#include <stdint.h>

#include "fetch.cuh"
#include "index.cuh"

#ifdef __cplusplus
extern "C" {
#endif

/* The record of one (layer, sequence): the step's descriptors of that sequence, less the parts a
 * batch slot gives (the selection's place). */
typedef struct kvt_gpu_graph_row {
	kvt_gpu_index_view view;
	const float *ck, *cq;  /* the centroids */
	kvt_gpu_fetch_seq f;   /* sel, sel_n and sel_ld are the slot's */
	uint32_t n_tokens;     /* 0: no sequence (closed, or nothing stored on the layer) */
	uint32_t spilled;      /* blocks on NVMe: not served by a graph step */
	uint32_t in_error;     /* kvt_seq_status: not served either */
	uint32_t reserved;
} kvt_gpu_graph_row;

/* What a slot error's `where` holds besides the layer (bits 0..15): the cause, bits 16..23, one
 * of lib/constants.h's KVT_SLOT_*. */

/* Skip marks: a padded slot's fetch entry, and its attention items (kvt_gpu_rows.reserved). */
#define KVT_GPU_FETCH_SKIP 2u
#define KVT_GPU_ROWS_SKIP 1u

/*
 * Write n rows into `table` at the given indexes (host arrays, carried as kernel parameters in
 * pieces, so the caller's arrays may be reused at once). Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_graph_publish(kvt_gpu_graph_row *table, uint32_t n, const uint32_t *at,
			  const kvt_gpu_graph_row *rows, void *stream);

/* The descriptors of one step over the slots of a kvt_graph_batch. */
typedef struct kvt_gpu_graph_step {
	const kvt_gpu_graph_row *table; /* the layer's records, [max_seqs] */
	uint32_t max_seqs;
	uint32_t max_tokens;            /* of the reservation */
	uint32_t layer;
	const int32_t *seqs, *lengths;  /* device [n_slots]; lengths may be NULL */
	const uint8_t *valid;           /* device [n_slots] or NULL */
	const float *zero;              /* device [2][n_kv_heads][d] zeros: a padded slot's centroids */
	uint32_t *sel;                  /* the step's selection positions, slot i at i * H * sel_ld */
	uint64_t sel_ld;
	uint32_t *sel_n;                /* the layer's counts, slot i at i * H */
	uint32_t *epoch;                /* the layer's hot-cache epoch: bumped once */
} kvt_gpu_graph_step;

/*
 * Fill views, ntok, cq, ck and fetch ([n_slots] each, device) for the step: a valid slot gets its
 * sequence's record; a padded one, or one in error (raised into `err` as KVT_GPU_ERR_SLOT, where
 * = layer | cause << 16, index = slot), gets an empty entry that every later kernel of the step
 * skips.
 * n_kv_heads sizes the slots' selection places. Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_graph_desc(const kvt_gpu_graph_step *st, uint32_t n_slots, uint32_t n_kv_heads,
		       kvt_gpu_index_view *views, uint32_t *ntok, const float **cq,
		       const float **ck, kvt_gpu_fetch_seq *fetch, unsigned long long *err,
		       void *stream);

#ifdef __cplusplus
}
#endif

#endif
