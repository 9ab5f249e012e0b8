/* SPDX-License-Identifier: MIT */
/*
 * The trace replay's context (kvbench --trace), shared by the replay (kvbench_trace.c) and its
 * report (kvbench_trace_report.c). Options, buffers, cache creation, the window rule, the check
 * of the gathered positions and the progress line are kvbench's own (kvbench.h).
 */
#ifndef KVBENCH_TRACE_REPLAY_H
#define KVBENCH_TRACE_REPLAY_H

#include "kvbench.h"
#include "trace.h"

/* Sums over decode steps of one (layer, query head), and of one (layer, KV head). */
typedef struct hacc {
	double recall_sum, recall_min, err2, full2;
	uint64_t n;
} hacc;

typedef struct kacc {
	double budget_sum;
	uint64_t n;
} kacc;

/* What the fetch path did during one layer's decode steps: the library's counters (kvt_stats)
 * over those steps, and the time of kvt_append + kvt_attend. */
typedef struct tfetch {
	uint64_t steps, hot_hits, hot_misses, pcie_bytes, nvme_bytes, nvme_reads;
	uint64_t candidates, rescored_unselected; /* indexed tokens scored; the second stage's key
						     reads of tokens not selected */
	double step_ms;         /* summed over the steps */
} tfetch;

/*
 * A simulated hot cache (kvbench_hotsim.c): `cap` of a layer's `rows` rows over `steps` decode
 * steps in sets of `ways` ways (cap / ways whole sets), kept by the CUDA backend's rule; row
 * h * stride + pos is (KV head h, position pos), whose set is gpu/hotsize.h's kvt_hot_set of
 * sequence KB_HOT_UID. kb_lru_step gives it one step's distinct rows. The rule (gpu/fetch.cuh): a
 * row held is a hit and is marked used in this step; then each miss, in an order the step's warps
 * make (here: by kb_row_hash of the row and the step), takes a free way of its set, else the way of
 * its set least recently used (the first of equals) among those no row of this step holds; a miss
 * that finds none is read in place and not kept. So a cache smaller than a step's rows keeps the
 * rows the step found in it before the new ones. hits / reads is its hit rate over the steps after
 * the first (the first step's reads all miss). With `grows` set (after kb_lru_init, with cap 0)
 * it sizes itself after each step within the layer's rows: KB_LRU_RULE by the CUDA backend's rule
 * (gpu/hotsize.h), KB_LRU_DEMAND by that rule's demand alone (the rule before misses counted), in
 * whole sets, moving its rows as a growth does (gpu/fetch.cu's k_hot_move). kb_lru_init and
 * kb_lru_step return -1 out of memory. With ways = cap it is one set: fully associative.
 */
enum { KB_LRU_FIXED = 0, KB_LRU_RULE = 1, KB_LRU_DEMAND = 2 };
#define KB_HOT_UID 1u
typedef struct kb_lru_ent {
	uint64_t tie, row;
} kb_lru_ent;
typedef struct kb_lru {
	uint64_t cap, rows, sets, stride;
	uint32_t steps, ways;
	int grows;        /* KB_LRU_FIXED, KB_LRU_RULE or KB_LRU_DEMAND */
	uint64_t to_fill; /* when it grows: the rule's empty ways left to fill */
	uint64_t *tag;    /* [sets * ways] the row a way holds + 1, 0: empty */
	int32_t *last;    /* [sets * ways] the step that last used the way, -1: empty */
	kb_lru_ent *fresh; /* a step's misses */
	size_t fresh_room;
	double hits;
	uint64_t reads;
} kb_lru;

int kb_lru_init(kb_lru *l, uint64_t rows, uint64_t cap, uint32_t steps, uint32_t ways,
		uint64_t stride);
int kb_lru_step(kb_lru *l, uint32_t step, const uint64_t *rows, size_t n);
void kb_lru_free(kb_lru *l);
/* The simulations' tie-break: a bijection of 64-bit words (splitmix64's finalizer). */
uint64_t kb_row_hash(uint64_t x);
#define KB_STEP_MIX 0x9e3779b97f4a7c15ull /* a step's misses go by kb_row_hash(row ^ (step + 1)
					     * KB_STEP_MIX), ascending */

/*
 * `kvbench --trace DIR --hot-log FILE` writes the rows each replayed decode step reads through the
 * simulated hot cache, one record per (layer, step) in replay order, in the host's byte order:
 * KB_HOT_LOG_WORDS uint64 words (layer, step, the layer's rows, the stride, n), then n uint64 row
 * ids, ascending: KV head h's position p is h * stride + p, and the layer has rows = n_kv_heads *
 * stride of them. bench/hot_batch replays several logs as one batch sharing a cache.
 */
#define KB_HOT_LOG_WORDS 5

/*
 * A layer's decode reads, kept whole for the offline optimum (kvbench_hotsim.c): kb_hotlog_step
 * appends one step's distinct rows (ids below `rows`). kb_hot_optimum replays them at a fixed size
 * of `cap` rows with whole steps as the unit of time (after each step the cache keeps at most `cap`
 * of the rows it held and the rows the step read): it keeps the rows read again soonest (Belady's
 * rule), so no cache of that size hits more on these reads, whatever it knows. It gives hits over
 * the reads after the first step (as kb_lru); -1 out of memory.
 */
typedef struct kb_hotlog {
	uint64_t rows;
	uint64_t *row;  /* [n] the steps' rows, one step after another */
	size_t n, room;
	size_t *first;  /* [steps + 1] where each step's rows start */
	uint32_t steps, done;
} kb_hotlog;

int kb_hotlog_init(kb_hotlog *g, uint64_t rows, uint32_t steps);
int kb_hotlog_step(kb_hotlog *g, const uint64_t *rows, size_t n);
void kb_hotlog_free(kb_hotlog *g);
int kb_hot_optimum(const kb_hotlog *g, uint64_t cap, uint64_t *hits, uint64_t *reads);

/* The simulated caches' sizes: 1/32, 1/16, 1/8, 1/4 and 1/2 of a layer's rows (1 / KB_HOT_DEN(k)
 * for k < KB_HOT_SIZES); then two that size themselves, KB_HOT_SELF by the rule and
 * KB_HOT_DEMAND by its demand alone. */
#define KB_HOT_SIZES 5
#define KB_HOT_DEN(k) (32u >> (k))
#define KB_HOT_QUARTER 3 /* the size of a quarter of the rows: a sweep point's misses */
#define KB_HOT_SELF KB_HOT_SIZES
#define KB_HOT_DEMAND (KB_HOT_SIZES + 1)
#define KB_HOT_ALL (KB_HOT_SIZES + 2)

typedef struct kb_trace {
	const opts *o;
	trace_meta m;
	kvt_cache *cache;
	kb_dev dev;
	kb_progress prog;
	const char *backend;
	bool device_time;       /* step times from CUDA events, else wall time */
	void *ev[2];            /* the CUDA events around a step */
	uint32_t d, group, cap, chunk, seq;
	uint32_t len, n_idx;    /* the sequence of the current layer: tokens, indexed tokens */
	double scale;
	bool *sel;              /* [n_layers] layers to replay */
	uint32_t n_sel;
	buf q, k, v, out, pos;
	int32_t *counts;        /* [n_kv_heads] */
	float *K, *V;           /* rounded truth of the layer [n_kv_heads, cap, d] */
	float *Q;               /* rounded decode queries of the layer [S, n_q_heads, d] */
	double *prob;           /* [cap] */
	hacc *heads;            /* [n_layers, n_q_heads] */
	kacc *kvs;              /* [n_layers, n_kv_heads] */
	double *recall;         /* [n_layers, n_q_heads, S] recall of every step, for percentiles */
	tfetch *fetch;          /* [n_layers] */
	kb_lru hot[KB_HOT_ALL]; /* the current layer's simulated caches */
	uint64_t *hot_rows;     /* [n_kv_heads * cap] a step's rows read through the hot cache */
	double hot_hits[KB_HOT_ALL], hot_reads[KB_HOT_ALL]; /* summed over the layers */
	kb_hotlog hot_log;      /* the current layer's reads */
	FILE *hot_file;         /* --hot-log: where each step's reads are written (KB_HOT_LOG_*) */
	double hot_opt[KB_HOT_SIZES]; /* the optimum's hits at the fixed sizes, over the layers;
					 reads: hot_reads */
	double hot_demand;      /* summed over (layer, step): a step's rows / a layer's rows */
	uint64_t hot_steps;
	double hot_self_share[2]; /* summed over the layers: KB_HOT_SELF's and KB_HOT_DEMAND's size
				     / rows */
	uint32_t hot_layers;
	uint64_t nvme_sizes[KB_MAX_NVME]; /* with --nvme: bytes of each file */
	uint64_t done, total;   /* progress: prefill chunks and decode steps */
	char what[48];          /* progress label */
	char err[1024];
} kb_trace;

/* The report: a table per layer and head, the fetch path per layer, and a summary; or JSON. */
void trace_print_text(kb_trace *t, double wall);
void trace_print_json(kb_trace *t, double wall);
/* The summary of a replay over its layers as a sweep point (context: the prefill tokens). */
void trace_summary(const kb_trace *t, kb_result *r);
/* A trace sweep's points (po: their options) and each method against the p-sweep: a table, or
 * JSON with --json. */
void trace_print_sweep(const opts *o, const trace_meta *m, const char *backend, const opts *po,
		       const kb_result *r, uint32_t n);

#endif
