/* SPDX-License-Identifier: MIT */
/*
 * kvbench's internal interface, shared by its source files:
 *   kvbench_main.c    the executable's main (everything else is the kvbench static library)
 *   kvbench.c         kvbench_main: the options, then the mode they select
 *   kvbench_common.c  what every mode shares: errors, the files a failed run removes, time,
 *                     progress, device buffers, the cache config and creation, the window rule,
 *                     the check of gathered positions, JSON
 *   kvbench_run.c     one synthetic run: setup, prefill, decode steps, its result
 *   kvbench_opts.c    options (those of --trace too), defaults (kvtier.h's KVT_DEFAULT_*) and --help
 *   kvbench_eval.c    the exact reference and the comparison with what the library attended
 *   kvbench_tier.c    the tier configuration, room-making spills and the --capacity phases
 *   kvbench_report.c  the per-step table, the summary and the JSON object
 *   kvbench_plan.c    the capacity arithmetic of --plan (kvbench_plan.h)
 *   kvbench_base.c    the baselines: oracle Top-p, oracle and Quest-style pages at kvtier's budget
 *   kvbench_sweep.c   --plan runs, --sweep points, the baseline table, CSV/JSON and the progress bar
 *   kvbench_svg.c     the SVG plots written next to the CSV
 *   kvbench_stress.c  --stress: the fetch path under load, every fetched row verified
 *   kvbench_verify.c  the row verifier (kvbench_verify.h), also linked by a test
 *   kvbench_trace.c   --trace: the replay of a captured trace and its exact reference
 *   kvbench_trace_report.c  the replay's per-head figures, table and JSON
 * Each mode keeps its own context: kb_run is the spine of a synthetic run, kb_phases the capacity
 * experiment's, kb_base the baselines', the sweep its bar, each stress mode its sctx, the trace
 * replay its kb_trace.
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
/* --gpu-cache auto (the default): the library's self-sized hot cache (gpu_cache_bytes 0) */
#define KB_GPU_CACHE_AUTO UINT64_MAX

typedef struct opts {
	uint32_t context, steps, layers, seqs, q_heads, kv_heads, head_dim, chunk;
	uint32_t sinks, window, flush, budget_min, budget_max, dtype, backend;
	uint32_t correction;    /* kvt_config.correction_steps (CPU backend; 0: off) */
	float rescore;          /* kvt_config.rescore_p (CPU backend; 0: off) */
	float keep;             /* kvt_config.keep_weight (CPU backend; 0: off) */
	uint32_t keep_steps;    /* kvt_config.keep_steps (0: 1) */
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
	uint64_t gpu_cache;     /* kvt_config.gpu_cache_bytes, or KB_GPU_CACHE_AUTO (the default) */
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
	const char *stress_only;  /* an option given that only --stress takes, for the check */
	uint32_t stress_budget;   /* budget_max (and min) of adversarial selections */
	/* --trace DIR: the shape comes from the trace; --layers is a list of its layers */
	const char *trace_dir;
	const char *layer_list;   /* --layers with --trace ("0,3,8-11"); NULL: every layer */
	const char *hot_log;      /* --hot-log FILE with --trace: the simulated cache's reads */
	char not_trace[64];       /* an option given that a trace replay does not take */
} opts;

/* Per-step (and, summed, per-phase and whole-run) quality figures. */
typedef struct acc {
	double recall_sum, recall_min, budget_sum, oracle_sum, err2, full2;
	uint64_t recall_n, recall_low, kv_n, needles, needles_found;
	uint64_t ns; /* wall time of kvt_append + kvt_attend */
} acc;

/* The device side of a run: libcudart (tools/cudart.h) when the cache runs on CUDA. With the CPU
 * backend, "device" pointers are the host buffers themselves. */
typedef struct kb_dev {
	cudart cu;
	bool on_dev;
} kb_dev;

/* A staging buffer: host memory and, on CUDA, its device copy. */
typedef struct buf {
	void *host, *dev;
} buf;

/* The progress line on stderr: on a terminal one line rewritten in place (\r) and cleared at the
 * end; otherwise whole lines, one per 10 %, so that logs stay short. Nothing with --quiet. A mode
 * that keeps its own bar (the sweep) takes the reports through `hook`. */
typedef struct kb_progress {
	bool quiet, tty;
	int last_decile;
	bool (*hook)(void *ctx, const char *what, uint64_t done, uint64_t total);
	void *hook_ctx;
} kb_progress;

/* Recall, budget and output error of one baseline selection (kvbench_base.c). */
typedef struct bacc {
	double recall_sum, recall_min, budget_sum, err2, full2;
	uint64_t recall_n, kv_n;
} bacc;

enum { KB_BASE_ORACLE_TOPP, KB_BASE_ORACLE_AT, KB_BASE_QUEST, KB_N_BASE };
extern const char *const kb_base_names[KB_N_BASE];
/* The baselines' scratch and sums, kept by the runs that evaluate them (kvbench_base.c). */
typedef struct kb_base kb_base;

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

/* The capacity experiment's own record: its phases, in order (kvbench_tier.c). */
typedef struct kb_phases {
	phase ph[KB_MAX_PHASES];
	uint32_t n;
} kb_phases;

/* The exact reference's scratch for one KV head's group (kvbench_eval.c). */
typedef struct kb_ref {
	float *score, *prob;    /* [group, cap] */
	double *ent;            /* [group] entropy of each head's distribution */
	uint32_t *sorted;       /* [2, cap] float bits and radix-sort scratch */
	uint8_t *mark;          /* [cap] */
} kb_ref;

/*
 * One synthetic run: the spine that the default experiment, --capacity, every --plan and --sweep
 * point and each --stress mode build on. It holds the cache, the workload and its rounded truth,
 * the window rule's counters, the staging buffers and the figures; what only one mode needs lives
 * in that mode's own context (kb_phases, kb_base, the sweep's bar, the stress modes' sctx).
 */
typedef struct kb_run {
	opts o;
	kvt_cache *cache;
	kb_dev dev;
	wl *w;
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
	kb_ref ref;
	double *head_oracle, *head_eff; /* [layers * q_heads] sums over seqs and steps */
	double *recalls;        /* every query head's recall of every step, for the low percentiles */
	size_t n_recalls, cap_recalls;
	acc *step;              /* [steps_total] */
	acc all;
	uint64_t ns_prefill, ns_gather;
	uint64_t ns_lib;        /* time inside the library calls that phases report */
	uint64_t ns_decode;     /* wall time of the decode steps, kvbench's work included */
	kvt_stats st_prefill, st_end;
	uint64_t nvme_sizes[KB_MAX_NVME]; /* kvt_config.nvme_bytes */
	kb_progress prog;
	bool table;             /* the per-step table is printed */
	kb_base *base;          /* with --baselines (every sweep point), else NULL */
} kb_run;

/* What kvbench_sweep.c keeps of one run. */
typedef struct kb_result {
	uint32_t context, seqs, layers, topk;
	float p;
	uint32_t correction;
	uint32_t budget_max;    /* the cap of a Top-p point (0: none; a topk point has its own) */
	float rescore;          /* kvt_config.rescore_p (0: off) */
	float keep;             /* kvt_config.keep_weight (0: off) */
	double rescore_k;       /* its extra key reads per indexed token */
	double misses;          /* a trace replay's simulated hot cache of a quarter of a layer's
				   rows: the rows a step reads over PCIe, per row of the layer (NAN
				   without a trace) */
	double recall, recall_min, recall_p5, recall_p1, budget, oracle_budget, err, step_ms, tok_s;
	double hit_rate, pcie_step;
	double stage_ms[5];     /* index, store, score, select, attend per (step, layer) */
	double base_recall[KB_N_BASE], base_budget[KB_N_BASE], base_err[KB_N_BASE];
	uint64_t host_used, index_bytes;
	kb_plan plan;           /* at this point's context */
} kb_result;

/* kvbench's whole run: options, then the mode they select. Returns the exit status (0, 1 or 2);
 * some errors exit the process with that status directly. */
int kvbench_main(int argc, char **argv);

/* ---- kvbench_opts.c ---------------------------------------------------------------------- */

/* Parse argv into *o (defaults from KVT_DEFAULT_*); --help exits 0, a bad option exits 2. */
void parse_args(int argc, char **argv, opts *o);
void opts_free(opts *o);
/* Apply one option as if given on the command line (a sweep point's override). */
void opts_set(opts *o, const char *flag, const char *val);
/* The plan's inputs from the options. */
void opts_plan_in(const opts *o, uint32_t context, kb_plan_in *in);
/* "1.5 GiB"-style text of a byte count, into out (n bytes); returns out. */
const char *fmt_bytes(uint64_t bytes, char *out, size_t n);
/* Exit 2 naming the option, the value and what was expected. */
_Noreturn void bad_value(const char *flag, const char *val, const char *want);

/* ---- kvbench_common.c: what every mode shares ------------------------------------------------ */

/* Report a failed library call: the call, kvt_strerror(rc), kvt_last_error(c); exits 1. */
_Noreturn void lib_fail(const kvt_cache *c, int64_t rc, const char *what);
_Noreturn void fail(const char *what, const char *detail);
void *xcalloc(size_t n, size_t size);
/* A file this run created (the path is copied): if the run fails it is removed, by an exit
 * handler wherever the failure exits, or by created_files_end(false). */
void created_file(const char *path);
/* The end of the run: keep (it succeeded) or remove the files created_file recorded. */
void created_files_end(bool keep);
/* qsort's comparison of doubles, ascending. */
int kb_cmp_double(const void *a, const void *b);
/* The 5th (pct[0]) and 1st (pct[1]) percentiles of v[0..n) by nearest rank: the smallest value that
 * at least q % of the values are at or below. Sorts v; NAN for n == 0. */
void low_percentiles(double *v, size_t n, double pct[2]);
/* The 5th and 1st percentiles of every query head's recall over the steps of a run. */
void run_percentiles(const kb_run *b, double *p5, double *p1);
uint64_t now_ns(void);
/* Report done of total units of `what` (see kb_progress). */
void progress(kb_progress *pg, const char *what, uint64_t done, uint64_t total);
/* Clear a progress line on the terminal before a table row goes to stdout. */
void progress_clear(const kb_progress *pg);
void buf_alloc(kb_dev *dv, buf *x, size_t bytes);
void buf_free(kb_dev *dv, buf *x);
void buf_sync(kb_dev *dv, buf *x, size_t bytes, int dir);
/* Wait for the device (CUDA backend): wall-clock times then cover the work, not its launch. */
void dev_sync(kb_dev *dv);
enum { KB_H2D = CUDART_H2D, KB_D2H = CUDART_D2H };
/* The cache's element type: a float rounded to it (bits) and back. */
uint16_t dtype_bits(uint32_t dtype, float x);
float dtype_float(uint32_t dtype, uint16_t h);
/* A cache's shape: the synthetic one from the options, or a trace's. */
typedef struct kb_shape {
	uint32_t layers, q_heads, kv_heads, head_dim, max_seqs;
} kb_shape;
/* A cache config from the options (selection, dtype, backend, hot cache, the NVMe tier when
 * o->n_nvme, with nvme_sizes[n_nvme] bytes per file), a shape and the host tier's bytes. */
void cache_config(const opts *o, const kb_shape *sh, uint64_t host_bytes,
		  const uint64_t *nvme_sizes, kvt_config *cfg);
/* A host tier that is never the limit: twice the rows of `pairs` (sequence, layer) pairs of cap
 * tokens each, in whole blocks, plus 64 MiB of slack. */
uint64_t host_bytes_ample(uint64_t cap, uint64_t pairs, uint32_t kv_heads, uint32_t head_dim);
/* Bytes of each of n_files NVMe files for kv_bytes of K/V: a quarter more for each block's header
 * and alignment padding (a 128 KiB block takes 132 KiB at 4 KiB alignment) and 16 MiB, split
 * over the files, in whole MiB. */
uint64_t nvme_bytes_ample(uint64_t kv_bytes, uint32_t n_files);
/* kvt_cache_create, then libcudart when the cache runs on CUDA. Calls created(ctx) whatever the
 * result (the preset's NVMe file is removed there); a failure exits 1. Returns the backend used. */
const char *cache_open(const kvt_config *cfg, kvt_cache **cache, kb_dev *dv,
		       void (*created)(const void *ctx), const void *ctx);
/* The documented window rule (kvtier.h): the sinks of a sequence of len tokens; after a prefill
 * chunk of n tokens the window holds min(W, len - sinks) tokens and the rest is indexed; an append
 * adds a window token, and at W + B window tokens the oldest B are indexed. */
uint32_t rule_sinks(const opts *o, uint32_t len);
void rule_prefill(const opts *o, uint32_t *len, uint32_t *n_idx, uint32_t n);
void rule_append(const opts *o, uint32_t *len, uint32_t *n_idx);
/* What kvt_gather returned for one KV head: positions must ascend, stay below len and include
 * every sink and window token (all but the indexed range [lo, hi)); else exit 1 naming `where`.
 * Returns how many indexed tokens were selected. */
uint32_t check_positions(const int32_t *p, int32_t cnt, uint32_t len, uint32_t lo, uint32_t hi,
			 const char *where);
/* A JSON string on stdout: quotes, backslashes and control characters escaped. */
void jstr(const char *s);

/* ---- kvbench_run.c: one synthetic run ---------------------------------------------------- */

/* The rounded truth of (sequence s, layer l, KV head kvh): [cap, d] floats. */
float *truth(const kb_run *b, float *base, uint32_t s, uint32_t l, uint32_t kvh);
uint16_t to_bits(const kb_run *b, float x);
float from_bits(const kb_run *b, uint16_t h);
/* Fetch the library's counters into *st and check the token counts against the window rule. */
void check_stats(kb_run *b, kvt_stats *st, const char *when);
/* Prefill sequence s (all chunks, chunk-major, layer-minor), the s-th of the fill. */
void prefill_seq(kb_run *b, uint32_t s);
void prefill_all(kb_run *b);
/* Decode steps [first, first + n) of every sequence, as one batch, with the table rows. */
void decode_steps(kb_run *b, uint32_t first, uint32_t n);
/* Mark sequence index s (0-based in ids) as the most recently used. */
void lru_touch(kb_run *b, uint32_t s);
/* Prefill every sequence, then decode them together, with the table when it is printed. */
void standard_run(kb_run *b);
/* One standard run (prefill, decode) of opts o, into *r; with o->point no table or summary. The
 * progress goes to prog (a sweep's bar) when it is not NULL. */
void run_point(const opts *o, const kb_plan *plan, kb_progress *prog, kb_result *r);
void setup(kb_run *b);
void teardown(kb_run *b);
/* The window rule for (sequence, layer) sl of a run. */
void run_rule_append(kb_run *b, size_t sl);

/* ---- kvbench_eval.c ---------------------------------------------------------------------- */

/* Compare one sequence on one layer after kvt_attend + kvt_gather; adds to *a. */
void evaluate(kb_run *b, uint32_t s, uint32_t l, const float *out, acc *a);
void acc_init(acc *a);
void acc_add(acc *to, const acc *a);

/* ---- kvbench_base.c ---------------------------------------------------------------------- */

/* The baselines of one KV head: b->ref.prob holds the group's exact softmax over len tokens,
 * b->ref.mark the exact Top-p union over [lo, hi); sel indexed tokens is kvtier's budget. */
void base_eval(kb_run *b, const float *K, const float *V, const float *q, uint32_t len,
	       uint32_t lo, uint32_t hi, uint32_t sel);
kb_base *base_alloc(const kb_run *b);
void base_free(kb_base *x);
/* The sums of baseline i (KB_BASE_*). */
const bacc *base_acc(const kb_base *x, int i);

/* ---- kvbench_sweep.c --------------------------------------------------------------------- */

int plan_main(opts *o);
int sweep_main(opts *o);
/* A --sweep axis: its name and values (pointers into copy, which the caller frees). */
typedef struct kb_axis {
	char name[16];
	char *vals[64];
	uint32_t n;
	char *copy;
} kb_axis;
/* The axes of o's --sweep options into ax[4]; returns how many. Exits 2 on an empty value. */
uint32_t kb_parse_axes(const opts *o, kb_axis *ax);
/* The options of point `idx` (mixed radix over the axes, the first fastest); false for a point
 * to skip: a Top-k point ignores p, so it runs only with p's first value, and never with the
 * second stage. */
bool kb_point_opts(const opts *o, const kb_axis *ax, uint32_t na, uint32_t idx, opts *po);

/* ---- kvbench_frontier.c: a sweep's methods against its p-sweep at equal budget ------------- */

/* A recall tail: 5th and 1st percentiles and the minimum over (step, query head). */
typedef struct kb_tail {
	double p5, p1, min;
} kb_tail;
/* A plain point: p alone (no topk, no corrections, no second stage, no budget cap, no keep). */
bool kb_is_plain(const kb_result *r);
/* A point's budget in bytes, in rows: its budget plus half a row per extra key read. */
double kb_bytes_budget(const kb_result *r);
/* The p-sweep's tail at `budget`: linear between the two plain points of shape's context, seqs
 * and layers whose budgets bracket it (NANs outside their range; one plain point: only at its own
 * budget). Returns how many plain points that shape has. With misses, the same over the plain
 * points' simulated misses (kb_result.misses) instead of their budgets. */
uint32_t kb_sweep_at(const kb_result *r, uint32_t n, const kb_result *shape, double budget,
		     kb_tail *out);
uint32_t kb_sweep_at_misses(const kb_result *r, uint32_t n, const kb_result *shape,
			    double misses, kb_tail *out);
/* Each point that is not plain, of a shape with two plain points or more, against the sweep at
 * its budget in rows and in bytes, and (a trace replay's) at its simulated misses: a table, or
 * (json) comma-separated JSON objects. Returns the points shown. */
uint32_t kb_print_vs_sweep(const kb_result *r, uint32_t n, bool json);

/* ---- kvbench_svg.c ----------------------------------------------------------------------- */

/* The three plots of a sweep, next to csv ("x.csv" -> "x-recall.svg" ...). Returns 0 or -1. */
int svg_write_all(const char *csv, const kb_result *r, uint32_t n, char names[3][512]);

/* ---- kvbench_stress.c -------------------------------------------------------------------- */

int stress_main(opts *o);

/* ---- kvbench_tier.c ---------------------------------------------------------------------- */

/* The run's tier sizes: the NVMe files' into b->nvme_sizes (when there is an NVMe tier); returns
 * the host tier's. */
uint64_t tier_sizes(kb_run *b);
/* After kvt_cache_create, whatever its result: remove the preset's NVMe file (ctx: the options),
 * which the cache (if any) holds open, so that nothing is left behind however kvbench ends. */
void tier_created(const void *ctx);
/* K/V bytes of all sequences at their final length, in whole host-tier blocks. */
uint64_t tier_kv_bytes(const kb_run *b);
/* Spill least recently used sequences with kvt_seq_spill until the next n decode steps' appends
 * fit in the host tier. No-op without an NVMe tier. */
void tier_room_for_steps(kb_run *b, uint32_t n);
/* The four phases of --capacity: fill, decode (spilled), restore, decode (restored). */
void capacity_run(kb_run *b, kb_phases *ph);

/* ---- kvbench_report.c -------------------------------------------------------------------- */

/* The run's shape and tiers, then (print_columns) the header of the per-step table. */
void print_header(const kb_run *b);
void print_columns(void);
/* One table row: a decode step, or with step < 0 the `all` row over acc a. */
void print_row(const kb_run *b, int step, const acc *a);
/* A line in the table between phases. */
void print_phase_line(const phase *ph);
/* The run's JSON object, or its summary in words; ph: the capacity phases, or NULL. */
void print_json(const kb_run *b, const kb_phases *ph, double wall);
void print_summary(const kb_run *b, const kb_phases *ph, double wall);

/* ---- kvbench_trace.c, kvbench_trace_report.c --------------------------------------------- */

/* kvbench --trace DIR: replay a captured trace (doc/trace-format.md). Returns the exit status. */
int trace_main(const opts *o);

#endif /* KVBENCH_H */
