/* SPDX-License-Identifier: MIT */
/*
 * kvbench's internal interface, shared by its source files:
 *   kvbench.c         main, setup, prefill, decode steps, helpers (errors, time, progress)
 *   kvbench_opts.c    options, defaults (from KVT_CONFIG_INIT) and --help
 *   kvbench_eval.c    the exact reference and the comparison with what the library attended
 *   kvbench_tier.c    the tier configuration, room-making spills and the --capacity phases
 *   kvbench_report.c  the per-step table, the summary and the JSON object
 *   kvbench_plan.c    the capacity arithmetic of --plan (kvbench_plan.h)
 *   kvbench_base.c    the baselines: oracle Top-p, oracle and Quest-style pages at kvtier's budget
 *   kvbench_sweep.c   --plan runs, --sweep points, the baseline table, CSV/JSON and the progress bar
 *   kvbench_svg.c     the SVG plots written next to the CSV
 *   kvbench_stress.c  --stress: the fetch path under load, every fetched row verified
 *   kvbench_verify.c  the row verifier (kvbench_verify.h), also linked by a test
 * doc/kvbench.md describes the experiments and every output field.
 */
#ifndef KVBENCH_H
#define KVBENCH_H

#include "kvtier.h"
#include "cudart.h"
#include "kvbench_plan.h"
#include "kvbench_verify.h"
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
	uint64_t gpu_cache;     /* kvt_config.gpu_cache_bytes */
	/* --plan: the capacity arithmetic for a whole model, then a scaled run */
	bool plan;
	uint32_t model_layers;  /* the model's layers (the run uses --layers) */
	uint64_t gpu_bytes, weights_bytes;
	uint64_t plan_host, plan_nvme; /* --plan-host-bytes, --plan-nvme-bytes: the deployment's */
	double run_fraction;    /* share of the planned sequences to run; 0: at most 4 sequences */
	/* baselines and sweeps */
	bool baselines;         /* evaluate the oracle and Quest selections at kvtier's budget */
	uint32_t topk;          /* kvtier with p = 1, budget_min = budget_max = topk (0: off) */
	uint32_t n_sweep;
	char *sweep[4];         /* "name=v1,v2,..." */
	const char *csv;        /* --csv FILE */
	bool point;             /* a run inside --plan/--sweep: no table, no summary */
	/* --stress */
	uint32_t stress_s;
	const char *stress_modes; /* comma-separated: many, adversarial, qd, spill (or all) */
	uint32_t stress_budget;   /* budget_max (and min) of adversarial selections */
} opts;

/* Per-step (and, summed, per-phase and whole-run) quality figures. */
typedef struct acc {
	double recall_sum, recall_min, budget_sum, oracle_sum, err2, full2;
	uint64_t recall_n, recall_low, kv_n, needles, needles_found;
	uint64_t ns; /* wall time of kvt_append + kvt_attend */
} acc;

/* Device memory for the CUDA backend through libcudart (tools/cudart.h); with the CPU backend,
 * "device" pointers are the host buffers themselves. */

typedef struct buf {
	void *host, *dev;
} buf;

/* Recall, budget and output error of one baseline selection (kvbench_base.c). */
typedef struct bacc {
	double recall_sum, recall_min, budget_sum, err2, full2;
	uint64_t recall_n, kv_n;
} bacc;

enum { KB_BASE_ORACLE_TOPP, KB_BASE_ORACLE_AT, KB_BASE_QUEST, KB_N_BASE };
extern const char *const kb_base_names[KB_N_BASE];

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
	bacc base[KB_N_BASE];   /* with --baselines */
	uint8_t *bmask;         /* [cap] a baseline's set */
	float *pmax;            /* [cap] max over the group of the exact probability */
	float *kmin, *kmax;     /* [cap / 16 + 1, d] Quest page bounds */
	float *pscore;          /* [cap / 16 + 1] Quest page scores */
	uint32_t *porder;       /* [cap / 16 + 1] */
	const kb_plan *plan;    /* --plan: printed with the run */
	uint64_t ns_decode;     /* wall time of the decode steps, kvbench's work included */
} bench;

/* What kvbench_sweep.c keeps of one run. */
typedef struct kb_result {
	uint32_t context, seqs, layers, topk;
	float p;
	double recall, recall_min, budget, oracle_budget, err, step_ms, tok_s, hit_rate, pcie_step;
	double stage_ms[5];     /* index, store, score, select, attend per (step, layer) */
	double base_recall[KB_N_BASE], base_budget[KB_N_BASE], base_err[KB_N_BASE];
	uint64_t host_used, index_bytes;
	kb_plan plan;           /* at this point's context */
} kb_result;

/* kvbench's whole run: options, then the mode they select. Returns the exit status (0, 1 or 2);
 * some errors exit the process with that status directly. */
int kvbench_main(int argc, char **argv);

/* ---- kvbench_opts.c ---------------------------------------------------------------------- */

/* Parse argv into *o (defaults from KVT_CONFIG_INIT); --help exits 0, a bad option exits 2. */
void parse_args(int argc, char **argv, opts *o);
void opts_free(opts *o);
/* Apply one option as if given on the command line (a sweep point's override). */
void opts_set(opts *o, const char *flag, const char *val);
/* The plan's inputs from the options. */
void opts_plan_in(const opts *o, uint32_t context, kb_plan_in *in);
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
/* One standard run (prefill, decode) of opts o, into *r; with o->point no table or summary. */
void run_point(const opts *o, const kb_plan *plan, kb_result *r);
void setup(bench *b);
void teardown(bench *b);
void buf_alloc(bench *b, buf *x, size_t bytes);
void buf_free(bench *b, buf *x);
void buf_sync(bench *b, buf *x, size_t bytes, int dir);
void dev_sync(bench *b);
void prefill_all(bench *b);
uint16_t to_bits(const bench *b, float x);
float from_bits(const bench *b, uint16_t h);
/* The documented window rule for one append of (sequence, layer) sl. */
void rule_append(bench *b, size_t sl);
enum { KB_H2D = CUDART_H2D, KB_D2H = CUDART_D2H };

/* ---- kvbench_eval.c ---------------------------------------------------------------------- */

/* Compare one sequence on one layer after kvt_attend + kvt_gather; adds to *a. */
void evaluate(bench *b, uint32_t s, uint32_t l, const float *out, acc *a);
void acc_init(acc *a);
void acc_add(acc *to, const acc *a);

/* ---- kvbench_base.c ---------------------------------------------------------------------- */

/* The baselines of one KV head: b->prob holds the group's exact softmax over len tokens, b->mark
 * the exact Top-p union over [lo, hi); sel indexed tokens is kvtier's budget. */
void base_eval(bench *b, const float *K, const float *V, const float *q, uint32_t len,
	       uint32_t lo, uint32_t hi, uint32_t sel);
void base_alloc(bench *b);
void base_free(bench *b);

/* ---- kvbench_sweep.c --------------------------------------------------------------------- */

int plan_main(opts *o);
int sweep_main(opts *o);
/* The sweep bar, when one is running: progress() reports into it. */
bool sweep_progress(const char *what, uint64_t done, uint64_t total);

/* ---- kvbench_svg.c ----------------------------------------------------------------------- */

/* The three plots of a sweep, next to csv ("x.csv" -> "x-recall.svg" ...). Returns 0 or -1. */
int svg_write_all(const char *csv, const kb_result *r, uint32_t n, char names[3][512]);

/* ---- kvbench_stress.c -------------------------------------------------------------------- */

int stress_main(opts *o);

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
