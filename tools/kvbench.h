/* SPDX-License-Identifier: MIT */
/*
 * kvbench's internal interface, shared by its source files:
 *   kvbench.c         main, setup, prefill, decode steps, helpers (errors, time, progress)
 *   kvbench_opts.c    options, defaults (from KVT_CONFIG_INIT) and --help
 *   kvbench_eval.c    the exact reference and the comparison with what the library attended
 *   kvbench_tier.c    the tier configuration, room-making spills and the --capacity phases
 *   kvbench_report.c  the per-step table, the summary and the JSON object
 * doc/kvbench.md describes the experiments and every output field.
 */
#ifndef KVBENCH_H
#define KVBENCH_H

#include "kvtier.h"
#include "workload.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* Tokens of one host-tier block (of one layer and KV head), as kvtier.h's kvt_seq_spill states:
 * the unit in which the host tier grows and in which sequences are spilled. */
#define KB_BLOCK_TOKENS 256u
/* The file the --capacity preset uses when no --nvme is given, in the current directory. */
#define KB_NVME_DEFAULT "kvbench-nvme.img"
/* The library's limit on NVMe files (kvt_config.n_nvme). */
#define KB_MAX_NVME 64u

typedef struct opts {
	uint32_t context, steps, layers, seqs, q_heads, kv_heads, head_dim, chunk;
	uint32_t sinks, window, flush, budget_min, budget_max, dtype, backend;
	uint64_t seed;
	float p;
	bool json, quiet;
	/* tiers */
	bool capacity;          /* the phased capacity experiment (kvbench_tier.c) */
	uint64_t host_bytes;    /* host tier; 0: sized by kvbench */
	char *nvme_arg;         /* copy of the --nvme argument, cut at the commas into nvme_paths */
	const char *nvme_paths[KB_MAX_NVME];
	uint32_t n_nvme;
	bool nvme_own;          /* the preset's KB_NVME_DEFAULT: kvbench removes it */
	uint64_t nvme_bytes;    /* per file; 0: sized by kvbench */
	uint64_t nvme_cache;    /* kvt_config.nvme_cache_bytes */
	uint32_t nvme_qd;       /* kvt_config.nvme_queue_depth (0: the library's default) */
	uint32_t spill;         /* kvt_spill_policy */
	const char *nvme_only;  /* an option given that needs an NVMe tier, for the check there is one */
} opts;

/* Per-step (and, summed, per-phase and whole-run) quality figures. */
typedef struct acc {
	double recall_sum, recall_min, budget_sum, oracle_sum, err2, full2;
	uint64_t recall_n, recall_low, kv_n, needles, needles_found;
	uint64_t ns; /* wall time of kvt_append + kvt_attend */
} acc;

/* Device memory for the CUDA backend through libcudart, found at run time so that kvbench needs no
 * CUDA header; with the CPU backend, "device" pointers are the host buffers themselves. */
typedef struct cudart {
	void *lib;
	int (*malloc_)(void **, size_t);
	int (*free_)(void *);
	int (*memcpy_)(void *, const void *, size_t, int);
	int (*sync_)(void); /* cudaDeviceSynchronize: the calls are asynchronous on the device */
} cudart;

typedef struct buf {
	void *host, *dev;
} buf;

/* One phase of the capacity experiment. */
typedef struct phase {
	const char *name;
	uint32_t step0, steps;  /* the decode steps it ran (none for fill and restore) */
	uint64_t ns;            /* wall time, kvbench's own work included */
	uint64_t ns_lib;        /* time inside kvt_prefill/append/attend/gather/spill/restore */
	int64_t restored;       /* bytes kvt_seq_restore moved (restore phase), else -1 */
	uint32_t restored_seq;
	kvt_stats st0, st1;     /* the library's counters at its start and end */
} phase;

enum { KB_MAX_PHASES = 4 };

typedef struct bench {
	opts o;
	kvt_cache *cache;
	wl *w;
	cudart cu;
	bool on_dev;
	uint32_t d, group, cap;
	uint32_t steps_total;   /* decode steps over all phases: steps, or 2 x steps with --capacity */
	uint32_t *ids;          /* [seqs] */
	uint32_t *lru;          /* [seqs] sequence indexes, least recently used first */
	float *K, *V;           /* rounded truth [seqs, layers, kv_heads, cap, d] */
	uint32_t *len;          /* [seqs * layers] tokens held */
	uint32_t *n_idx;        /* [seqs * layers] tokens indexed, by the documented flush rule */
	buf q, k, v, out, pos;
	float *qf;              /* rounded decode queries [seqs, q_heads, d] */
	float *qtmp;            /* [group, d] */
	int64_t *needle;        /* [seqs, q_heads] needle position asked for, or -1 */
	int32_t *counts;        /* [seqs, kv_heads] */
	float *score, *prob;    /* [group, cap] */
	double *ent;            /* [group] entropy of each head's distribution */
	uint32_t *sorted;       /* [2, cap] float bits and radix-sort scratch */
	uint8_t *mark;          /* [cap] */
	double *head_oracle, *head_eff; /* [layers * q_heads] sums over seqs and steps */
	acc *step;              /* [steps_total] */
	acc all;
	uint64_t ns_prefill, ns_gather;
	uint64_t ns_lib;        /* time inside the library calls that phases report */
	kvt_stats st_prefill, st_end;
	uint64_t nvme_sizes[KB_MAX_NVME]; /* kvt_config.nvme_bytes */
	phase phases[KB_MAX_PHASES];
	uint32_t n_phases;
	bool tty, table;        /* progress on a terminal; the per-step table is printed */
	int last_decile;
} bench;

/* ---- kvbench_opts.c ---------------------------------------------------------------------- */

/* Parse argv into *o (defaults from KVT_CONFIG_INIT); --help exits 0, a bad option exits 2. */
void parse_args(int argc, char **argv, opts *o);
void opts_free(opts *o);
/* "1.5 GiB"-style text of a byte count, into out (n bytes); returns out. */
const char *fmt_bytes(uint64_t bytes, char *out, size_t n);

/* ---- kvbench.c --------------------------------------------------------------------------- */

/* Report a failed library call: the call, kvt_strerror(rc), kvt_last_error(c); exits 1. */
_Noreturn void lib_fail(const kvt_cache *c, int64_t rc, const char *what);
_Noreturn void fail(const char *what, const char *detail);
void *xcalloc(size_t n, size_t size);
uint64_t now_ns(void);
void progress(bench *b, const char *what, uint64_t done, uint64_t total);
/* The rounded truth of (sequence s, layer l, KV head kvh): [cap, d] floats. */
float *truth(const bench *b, float *base, uint32_t s, uint32_t l, uint32_t kvh);
uint32_t sinks_of(const bench *b, uint32_t len);
/* Fetch the library's counters into *st and check the token counts against the window rule. */
void check_stats(bench *b, kvt_stats *st, const char *when);
/* Prefill sequence s (all chunks, chunk-major, layer-minor), the s-th of the fill. */
void prefill_seq(bench *b, uint32_t s);
/* Decode steps [first, first + n) of every sequence, as one batch, with the table rows. */
void decode_steps(bench *b, uint32_t first, uint32_t n);
/* Mark sequence index s (0-based in ids) as the most recently used. */
void lru_touch(bench *b, uint32_t s);

/* ---- kvbench_eval.c ---------------------------------------------------------------------- */

/* Compare one sequence on one layer after kvt_attend + kvt_gather; adds to *a. */
void evaluate(bench *b, uint32_t s, uint32_t l, const float *out, acc *a);
void acc_init(acc *a);
void acc_add(acc *to, const acc *a);

/* ---- kvbench_tier.c ---------------------------------------------------------------------- */

/* The tier fields of the cache config (host_bytes always; the NVMe tier when configured). */
void tier_config(bench *b, kvt_config *cfg);
/* After kvt_cache_create, whatever its result: remove the preset's NVMe file, which the cache (if
 * any) holds open, so that nothing is left behind however kvbench ends. */
void tier_created(const bench *b);
/* K/V bytes of all sequences at their final length, in whole host-tier blocks. */
uint64_t tier_kv_bytes(const bench *b);
/* Spill least recently used sequences with kvt_seq_spill until the next n decode steps' appends
 * fit in the host tier. No-op without an NVMe tier. */
void tier_room_for_steps(bench *b, uint32_t n);
/* The four phases of --capacity: fill, decode (spilled), restore, decode (restored). */
void capacity_run(bench *b);

/* ---- kvbench_report.c -------------------------------------------------------------------- */

/* The run's shape and tiers, then (print_columns) the header of the per-step table. */
void print_header(const bench *b);
void print_columns(void);
/* One table row: a decode step, or with step < 0 the `all` row over acc a. */
void print_row(const bench *b, int step, const acc *a);
/* A line in the table between phases. */
void print_phase_line(const phase *ph);
void print_json(const bench *b, double wall);
void print_summary(const bench *b, double wall);

#endif /* KVBENCH_H */
