/* SPDX-License-Identifier: MIT */
/*
 * kvbench's options. The selection and tier defaults come from kvtier.h's KVT_DEFAULT_* rather
 * than copies, so that kvbench measures what a caller of the library gets by default and --help
 * states it.
 */
#include "kvbench.h"

#include "constants.h" /* KVT_GPU_HOT_AUTO_SHARE */

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The --capacity preset: enough sequences that three hosts' worth of K/V must share one, each short
 * enough that kvbench's exact reference keeps the run well under a minute on two cores. */
#define CAP_SEQS 6u
#define CAP_CONTEXT 2048u
#define CAP_STEPS 8u

static const char *const spill_names[] = {"none", "lru", NULL};
static const uint32_t spill_codes[] = {KVT_SPILL_NONE, KVT_SPILL_LRU};

static void opts_default(opts *o)
{
	/* nvme_qd and budget_max 0: the library's own defaults (32; no cap) */
	*o = (opts){.context = 24576, .steps = 16, .layers = 2, .seqs = 1, .q_heads = 32,
		    .kv_heads = 8, .head_dim = 128, .chunk = 4096, .dtype = KVT_DTYPE_F16,
		    .backend = KVT_BACKEND_AUTO, .seed = 1, .p = KVT_DEFAULT_P,
		    .sinks = KVT_DEFAULT_N_SINK, .window = KVT_DEFAULT_WINDOW,
		    .flush = KVT_DEFAULT_FLUSH_BATCH, .budget_min = KVT_DEFAULT_BUDGET_MIN,
		    .budget_max = 0, .nvme_cache = KVT_DEFAULT_NVME_CACHE_BYTES, .nvme_qd = 0,
		    .spill = KVT_SPILL_NONE, .gpu_cache = KB_GPU_CACHE_AUTO,
		    .model_layers = 32, .gpu_bytes = 80ull << 30,
		    .weights_bytes = 15ull << 30, .stress_modes = "all", .stress_budget = 1024};
}

/* The trace replay's own defaults: the library's seed (kvbench's workload seeds 1). */
static void trace_preset(opts *o, const char *dir)
{
	o->trace_dir = dir;
	o->seed = KVT_DEFAULT_SEED;
}

static void capacity_preset(opts *o)
{
	o->capacity = true;
	o->seqs = CAP_SEQS;
	o->context = CAP_CONTEXT;
	o->steps = CAP_STEPS;
	o->spill = KVT_SPILL_LRU;
}

const char *fmt_bytes(uint64_t bytes, char *out, size_t n)
{
	static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
	double x = (double)bytes;
	int u = 0;
	while (x >= 1024.0 && u < 4) {
		x /= 1024.0;
		u++;
	}
	snprintf(out, n, u ? "%.1f %s" : "%.0f %s", x, unit[u]);
	return out;
}

static void usage(FILE *f, const opts *d)
{
	const uint64_t trace_seed = KVT_DEFAULT_SEED;
	char nc[32];
	fprintf(f,
		"usage: kvbench [options]\n"
		"Prefill a synthetic long context into a kvtier cache, decode, and compare with exact\n"
		"attention. Defaults: a Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128,\n"
		"fp16), 2 layers, 16 steps, one sequence of 24576 tokens, backend auto (CUDA when\n"
		"built and a GPU is present, else CPU); selection and tier settings are the\n"
		"library's defaults (KVT_DEFAULT_*), shown in parentheses.\n"
		"  --context N      prefill tokens per sequence (%u)\n"
		"  --steps N        decode steps (%u; per decode phase with --capacity)\n"
		"  --layers N       layers (%u)\n"
		"  --seqs N         sequences decoded together (%u)\n"
		"  --p X            Top-p mass in (0, 1] (%.3g)\n"
		"  --seed N         workload and rotation seed (%" PRIu64 ")\n"
		"  --q-heads N      query heads (%u)\n"
		"  --kv-heads N     KV heads, dividing --q-heads (%u)\n"
		"  --head-dim N     64, 128 or 256 (%u)\n"
		"  --dtype T        f16 or bf16 (%s)\n",
		d->context, d->steps, d->layers, d->seqs, (double)d->p, d->seed, d->q_heads,
		d->kv_heads, d->head_dim, d->dtype == KVT_DTYPE_BF16 ? "bf16" : "f16");
	fprintf(f,
		"  --sinks N        sink tokens always attended, 0-65536 (%u)\n"
		"  --window N       local window W, 0-65536 (%u)\n"
		"  --flush N        flush batch B, 1-65536 (%u)\n"
		"  --budget-min N   min indexed tokens per query head per step (%u)\n"
		"  --budget-max N   max indexed tokens per query head per step, 0 = none (%u)\n"
		"  --correction N   score corrections from the exact logits of the last N steps,\n"
		"                   0-64 (CPU backend; 0 = off, the default)\n"
		"  --rescore P      second selection stage: the Top-P candidates on the estimate are\n"
		"                   scored exactly from their keys, P in (p, 1] (0 = off, the\n"
		"                   default)\n"
		"  --keep W         selection hysteresis: Top-p ranks the last step's selection as\n"
		"                   if (1 + W) times as probable, W in [0, 1e6] (0 = off, the\n"
		"                   default)\n"
		"  --keep-steps R   with --keep: the selections of the last R steps, 0-64 (0: 1; the\n"
		"                   CUDA backend takes 1 only)\n"
		"  --chunk N        prefill chunk tokens (%u)\n"
		"  --backend B      cpu, cuda or auto: CUDA when built and a GPU is present (auto)\n",
		d->sinks, d->window, d->flush, d->budget_min, d->budget_max, d->chunk);
	fprintf(f,
		"Tiers (sizes are bytes with an optional K, M, G or T suffix, powers of 1024):\n"
		"  --host-bytes N   host tier capacity (sized by kvbench: never the limit, or a third\n"
		"                   of the K/V with --capacity)\n"
		"  --nvme P[,P...]  files of the NVMe tier, left in place after the run; a regular file\n"
		"                   that is not empty is refused (none; %s with --capacity)\n"
		"  --nvme-bytes N   bytes of each NVMe file, >= 4K (sized by kvbench from the K/V)\n"
		"  --nvme-qd N      NVMe I/Os in flight, 1 .. 1024 (%u%s)\n"
		"  --nvme-cache N   block cache of direct serving, 1M .. 1T (%s)\n"
		"  --spill P        none or lru: what the cache does when the host tier is full (%s)\n"
		"  --capacity       the capacity experiment: --seqs %u --context %u --steps %u --spill\n"
		"                   lru unless given; fill the sequences one by one, decode them all,\n"
		"                   restore the least recently used one, decode again; per-phase report\n",
		KB_NVME_DEFAULT, d->nvme_qd, d->nvme_qd ? "" : ": the library's default",
		fmt_bytes(d->nvme_cache, nc, sizeof nc), spill_names[d->spill], CAP_SEQS,
		CAP_CONTEXT, CAP_STEPS);
	fprintf(f,
		"Capacity plan (--plan): the arithmetic for the whole model, then a scaled run:\n"
		"  --plan           print kvtier's capacity against full K/V in HBM, then run the\n"
		"                   planned sequences at --context on --layers layers (scaled)\n"
		"  --model-layers N the model's layers for the arithmetic (%u)\n"
		"  --gpu-bytes N    HBM of the GPU (80G)   --weights-bytes N  model weights (15G)\n"
		"  --gpu-cache N    kvt_config.gpu_cache_bytes, the hot cache, <= 1T, or auto (%s: the\n"
		"                   library sizes it; --plan counts a quarter of the HBM left after\n"
		"                   the weights, its bound)\n"
		"  --plan-host-bytes N, --plan-nvme-bytes N  host memory and NVMe of the deployment\n"
		"                   (256G and the --nvme files, or 0)\n"
		"  --run-fraction X share of the planned sequences to run (default: at most 4)\n"
		"Baselines and sweeps:\n"
		"  --baselines      also evaluate the exact Top-p oracle, the oracle and Quest pages at\n"
		"                   kvtier's budget\n"
		"  --topk K         Top-k by kvtier's estimate: p = 1, budget min = max = K\n"
		"  --sweep A=V,...  run every point: A one of context, seqs, p, topk, layers, budget-max,\n"
		"                   correction, rescore, keep\n"
		"                   (repeatable, one axis each, crossed; topk points take the first p)\n"
		"  --csv FILE       the sweep's points as CSV, and SVG plots next to it (files the\n"
		"                   sweep creates are removed if it fails)\n"
		"Fetch-path stress:\n"
		"  --stress S       S seconds per mode, every fetched row verified\n"
		"  --stress-mode M  with --stress: many, adversarial, qd, spill or all, comma-\n"
		"                   separated (all); qd and spill are skipped, saying so, without an\n"
		"                   NVMe tier\n"
		"  --stress-budget N  with --stress: tokens per query head of adversarial selections\n"
		"                   (%u)\n",
		d->model_layers,
		d->gpu_cache == KB_GPU_CACHE_AUTO ? "auto" : fmt_bytes(d->gpu_cache, nc, sizeof nc),
		d->stress_budget);
	fprintf(f,
		"Trace replay (doc/trace-format.md): the shape comes from the trace\n"
		"  --trace DIR      replay a captured trace; takes --p, --sinks, --window, --flush,\n"
		"                   --budget-min, --budget-max, --correction, --rescore, --keep,\n"
		"                   --keep-steps, --chunk, --dtype, --backend, --gpu-cache,\n"
		"                   --seed (the library's, %" PRIu64 "), --json, --quiet, --nvme P[,P...]\n"
		"                   (each layer's sequence spilled after its prefill, so the decode\n"
		"                   steps read from NVMe) with --nvme-bytes, --nvme-qd, --nvme-cache,\n"
		"                   --sweep over p, correction, rescore, budget-max, keep (each\n"
		"                   method against the p-sweep at equal budget and at equal\n"
		"                   simulated misses), and:\n"
		"  --layers LIST    with --trace: the trace's layers to replay, e.g. 0,3,8-11 (all)\n"
		"  --hot-log FILE   with --trace: write the rows each step reads through the\n"
		"                   simulated hot cache (bench/hot_batch replays several such logs\n"
		"                   as one batch sharing a cache); removed if the replay fails\n"
		"Output:\n"
		"  --json           print one JSON object on stdout instead of the table\n"
		"  --quiet          no progress on stderr, no per-step table (per-head rows with\n"
		"                   --trace)\n"
		"  --help           this text\n"
		"Progress goes to stderr only: on a terminal one line rewritten in place and cleared\n"
		"at the end, elsewhere a whole line per 10 %%.\n"
		"Exit status: 0 done, 1 library or system error, 2 bad option.\n",
		trace_seed);
}

/* Set while opts_set applies a --sweep point's value, so that a bad one names --sweep too. */
static bool from_sweep;

_Noreturn void bad_value(const char *flag, const char *val, const char *want)
{
	fprintf(stderr, "kvbench: %s%s: invalid value '%s' (%s)\n", flag,
		from_sweep ? " (a --sweep value)" : "", val, want);
	exit(2);
}

/* strtoull and strtod skip leading white space and take a sign: a value must start as a number
 * is written, with a digit (or, with frac, a '.'). */
static bool starts_plain(const char *val, bool frac)
{
	return isdigit((unsigned char)val[0]) || (frac && val[0] == '.');
}

static uint64_t parse_uint(const char *flag, const char *val, uint64_t lo, uint64_t hi)
{
	char *end, want[96];
	errno = 0;
	unsigned long long x = strtoull(val, &end, 10);
	if (!starts_plain(val, false) || errno || end == val || *end || x < lo || x > hi) {
		snprintf(want, sizeof(want), "expected an integer in [%" PRIu64 ", %" PRIu64 "]", lo, hi);
		bad_value(flag, val, want);
	}
	return x;
}

/* A byte count: an integer with an optional suffix K, M, G or T (case-insensitive, powers of
 * 1024), in [lo, hi]. */
static uint64_t parse_size(const char *flag, const char *val, uint64_t lo, uint64_t hi)
{
	static const char suffixes[] = "KMGT";
	char *end, want[128], l[32], h[32];
	errno = 0;
	unsigned long long x = strtoull(val, &end, 10);
	unsigned shift = 0;
	const char *s = *end ? strchr(suffixes, toupper((unsigned char)*end)) : NULL;
	if (s) {
		shift = 10u * (unsigned)(s - suffixes + 1);
		end++;
	}
	bool ok = starts_plain(val, false) && !errno && end != val && !*end &&
		  x <= (UINT64_MAX >> shift);
	uint64_t bytes = ok ? (uint64_t)x << shift : 0;
	if (!ok || bytes < lo || bytes > hi) {
		if (hi == UINT64_MAX)
			snprintf(want, sizeof(want), "expected a byte count of at least %s, optionally "
				 "with a K, M, G or T suffix", fmt_bytes(lo, l, sizeof l));
		else
			snprintf(want, sizeof(want), "expected a byte count in [%s, %s], optionally "
				 "with a K, M, G or T suffix", fmt_bytes(lo, l, sizeof l),
				 fmt_bytes(hi, h, sizeof h));
		bad_value(flag, val, want);
	}
	return bytes;
}

static uint32_t parse_enum(const char *flag, const char *val, const char *const *names,
			   const uint32_t *codes, const char *want)
{
	for (uint32_t i = 0; names[i]; i++)
		if (!strcmp(val, names[i]))
			return codes[i];
	bad_value(flag, val, want);
}

/* --nvme PATH[,PATH...]: a copy of the argument, cut at the commas. */
static void set_nvme(opts *o, const char *flag, const char *val)
{
	free(o->nvme_arg);
	o->nvme_arg = strdup(val);
	if (!o->nvme_arg)
		fail("out of memory", "copying --nvme");
	o->n_nvme = 0;
	o->nvme_own = false;
	for (char *p = o->nvme_arg, *next; p; p = next) {
		next = strchr(p, ',');
		if (next)
			*next++ = 0;
		if (!*p)
			bad_value(flag, val, "expected PATH[,PATH...] with no empty path");
		if (o->n_nvme == KB_MAX_NVME)
			bad_value(flag, val, "at most 64 files");
		o->nvme_paths[o->n_nvme++] = p;
	}
}

/* Options whose value is a 32-bit count; false when `flag` is not one. */
static bool set_u32(opts *o, const char *flag, const char *val)
{
	const uint64_t big = INT32_MAX / 2; /* positions are int32 in kvt_gather */
	const uint64_t lib = 65536;         /* kvt_config's limit on n_sink, window, flush_batch */
	const struct { const char *name; uint32_t *dst; uint64_t lo, hi; } u32[] = {
		{"--context", &o->context, 1, big}, {"--steps", &o->steps, 1, 1u << 20},
		{"--layers", &o->layers, 1, 4096}, {"--seqs", &o->seqs, 1, 4096},
		{"--q-heads", &o->q_heads, 1, 1024}, {"--kv-heads", &o->kv_heads, 1, 1024},
		{"--sinks", &o->sinks, 0, lib}, {"--window", &o->window, 0, lib},
		{"--flush", &o->flush, 1, lib}, {"--budget-min", &o->budget_min, 0, big},
		{"--budget-max", &o->budget_max, 0, big}, {"--chunk", &o->chunk, 1, 1u << 20},
		{"--nvme-qd", &o->nvme_qd, 1, 1024}, {"--model-layers", &o->model_layers, 1, 4096},
		{"--topk", &o->topk, 1, big}, {"--stress", &o->stress_s, 1, 86400},
		{"--stress-budget", &o->stress_budget, 1, big}, {"--correction", &o->correction, 0, 64},
		{"--keep-steps", &o->keep_steps, 0, 64},
	};
	for (size_t i = 0; i < sizeof(u32) / sizeof(u32[0]); i++)
		if (!strcmp(flag, u32[i].name)) {
			*u32[i].dst = (uint32_t)parse_uint(flag, val, u32[i].lo, u32[i].hi);
			return true;
		}
	return false;
}

/* --sweep NAME=V1,V2,...: the name is checked here, each value when its point is set up. */
static void add_sweep(opts *o, const char *flag, const char *val)
{
	static const char *const axes[] = {"context", "seqs", "p", "topk", "layers", "budget-max",
					   "correction", "rescore", "keep"};
	const char *eq = strchr(val, '=');
	size_t n = eq ? (size_t)(eq - val) : 0;
	bool known = false;
	for (size_t i = 0; i < sizeof(axes) / sizeof(axes[0]); i++)
		known |= eq && strlen(axes[i]) == n && !strncmp(val, axes[i], n);
	if (!known || !eq[1])
		bad_value(flag, val, "expected NAME=V1,V2,... with NAME context, seqs, p, topk, "
			  "layers, budget-max, correction, rescore or keep");
	for (uint32_t i = 0; i < o->n_sweep; i++)
		if (!strncmp(o->sweep[i], val, n + 1))
			bad_value(flag, val, "an axis given twice: give all its values in one "
				  "--sweep");
	if (o->n_sweep == 4)
		bad_value(flag, val, "at most 4 --sweep axes");
	if (!(o->sweep[o->n_sweep++] = strdup(val)))
		fail("out of memory", "copying --sweep");
}

/* What a trace replay takes besides --trace: the selection, the cache's dtype and backend, the
 * prefill chunk, the hot cache, an NVMe tier, the seed and the layer list (the shape is the
 * trace's). */
static bool trace_takes(const char *flag)
{
	static const char *const ok[] = {"--trace", "--p", "--sinks", "--window", "--flush",
		"--budget-min", "--budget-max", "--chunk", "--dtype", "--backend", "--gpu-cache",
		"--seed", "--layers", "--json", "--quiet", "--nvme", "--nvme-bytes", "--nvme-qd",
		"--nvme-cache", "--correction", "--rescore", "--keep", "--keep-steps", "--sweep",
		"--hot-log"};
	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
		if (!strcmp(flag, ok[i]))
			return true;
	return false;
}

/* A decimal number as strtod reads it, but starting with a digit or '.', or exit naming the flag
 * and `want`. */
static double parse_number(const char *flag, const char *val, const char *want)
{
	char *end;
	errno = 0;
	double x = strtod(val, &end);
	if (!starts_plain(val, true) || errno || end == val || *end)
		bad_value(flag, val, want);
	return x;
}

/* A number in (0, 1] that stays above 0 as the float the library takes (where 0 would mean its
 * default), or exit naming the flag and `want`. */
static float parse_share(const char *flag, const char *val, const char *want)
{
	double x = parse_number(flag, val, want);
	if (!(x > 0.0 && x <= 1.0 && (float)x > 0.0f))
		bad_value(flag, val, want);
	return (float)x;
}

/* --stress-mode: many, adversarial, qd, spill or all, comma-separated, none empty. */
static void check_stress_modes(const char *flag, const char *val)
{
	static const char *const modes[] = {"many", "adversarial", "qd", "spill", "all"};
	for (const char *p = val;; p++) {
		size_t n = strcspn(p, ",");
		bool known = false;
		for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
			known |= strlen(modes[i]) == n && !strncmp(p, modes[i], n);
		if (!known)
			bad_value(flag, val, "expected many, adversarial, qd, spill or all, "
				  "comma-separated, none empty");
		p += n;
		if (!*p)
			return;
	}
}

static void set_option(opts *o, const char *flag, const char *val)
{
	static const char *const dt_names[] = {"f16", "bf16", NULL};
	static const uint32_t dt_codes[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
	static const char *const be_names[] = {"cpu", "cuda", "auto", NULL};
	static const uint32_t be_codes[] = {KVT_BACKEND_CPU, KVT_BACKEND_CUDA, KVT_BACKEND_AUTO};
	static const char *const nvme_only[] = {"--nvme-bytes", "--nvme-qd", "--nvme-cache"};
	static const char *const stress_only[] = {"--stress-mode", "--stress-budget"};
	for (size_t i = 0; i < sizeof(nvme_only) / sizeof(nvme_only[0]); i++)
		if (!strcmp(flag, nvme_only[i]))
			o->nvme_only = nvme_only[i];
	for (size_t i = 0; i < sizeof(stress_only) / sizeof(stress_only[0]); i++)
		if (!strcmp(flag, stress_only[i]))
			o->stress_only = stress_only[i];
	if (o->trace_dir && !trace_takes(flag))
		snprintf(o->not_trace, sizeof o->not_trace, "%s", flag);
	if (!strcmp(flag, "--trace")) {
		o->trace_dir = val;
		return;
	}
	if (o->trace_dir && !strcmp(flag, "--layers")) {
		o->layer_list = val; /* a list of the trace's layers, checked against the trace */
		return;
	}
	if (!strcmp(flag, "--hot-log")) {
		o->hot_log = val; /* finish() checks that --trace is given */
		return;
	}
	if (set_u32(o, flag, val))
		return;
	if (!strcmp(flag, "--seed")) {
		o->seed = parse_uint(flag, val, 0, 1ull << 53); /* exact in JSON */
	} else if (!strcmp(flag, "--head-dim")) {
		o->head_dim = (uint32_t)parse_uint(flag, val, 64, 256);
		if (o->head_dim != 64 && o->head_dim != 128 && o->head_dim != 256)
			bad_value(flag, val, "expected 64, 128 or 256");
	} else if (!strcmp(flag, "--rescore")) {
		const char *want = "expected 0 (off) or a number in (p, 1], not 0 as a 32-bit "
				   "float";
		const double x = parse_number(flag, val, want);
		o->rescore = x == 0.0 ? 0.0f : parse_share(flag, val, want);
	} else if (!strcmp(flag, "--keep")) {
		const double x = parse_number(flag, val, "expected a number in [0, 1e6] (0: off)");
		if (!(x >= 0.0 && x <= 1e6) || (x > 0.0 && (float)x == 0.0f))
			bad_value(flag, val, "expected 0 (off) or a number in (0, 1e6], not 0 as a "
				  "32-bit float");
		o->keep = (float)x;
	} else if (!strcmp(flag, "--p")) {
		o->p = parse_share(flag, val, "expected a number in (0, 1], not 0 as a 32-bit "
				   "float");
	} else if (!strcmp(flag, "--dtype")) {
		o->dtype = parse_enum(flag, val, dt_names, dt_codes, "expected f16 or bf16");
	} else if (!strcmp(flag, "--backend")) {
		o->backend = parse_enum(flag, val, be_names, be_codes, "expected cpu, cuda or auto");
	} else if (!strcmp(flag, "--spill")) {
		o->spill = parse_enum(flag, val, spill_names, spill_codes, "expected none or lru");
	} else if (!strcmp(flag, "--host-bytes")) {
		o->host_bytes = parse_size(flag, val, 1, UINT64_MAX);
	} else if (!strcmp(flag, "--nvme-bytes")) {
		o->nvme_bytes = parse_size(flag, val, 4096, UINT64_MAX); /* the library's least */
	} else if (!strcmp(flag, "--nvme-cache")) {
		o->nvme_cache = parse_size(flag, val, 1ull << 20, 1ull << 40);
	} else if (!strcmp(flag, "--nvme")) {
		set_nvme(o, flag, val);
	} else if (!strcmp(flag, "--gpu-bytes")) {
		o->gpu_bytes = parse_size(flag, val, 1, UINT64_MAX);
	} else if (!strcmp(flag, "--weights-bytes")) {
		o->weights_bytes = parse_size(flag, val, 0, UINT64_MAX);
	} else if (!strcmp(flag, "--gpu-cache")) {
		o->gpu_cache = !strcmp(val, "auto") ? KB_GPU_CACHE_AUTO
						    : parse_size(flag, val, 0, 1ull << 40);
	} else if (!strcmp(flag, "--plan-host-bytes")) {
		o->plan_host = parse_size(flag, val, 1, UINT64_MAX);
	} else if (!strcmp(flag, "--plan-nvme-bytes")) {
		o->plan_nvme = parse_size(flag, val, 0, UINT64_MAX);
	} else if (!strcmp(flag, "--run-fraction")) {
		double x = parse_number(flag, val, "expected a number in (0, 1]");
		if (!(x > 0.0 && x <= 1.0))
			bad_value(flag, val, "expected a number in (0, 1]");
		o->run_fraction = x;
	} else if (!strcmp(flag, "--sweep")) {
		add_sweep(o, flag, val);
	} else if (!strcmp(flag, "--csv")) {
		o->csv = val;
	} else if (!strcmp(flag, "--stress-mode")) {
		check_stress_modes(flag, val);
		o->stress_modes = val;
	} else {
		fprintf(stderr, "kvbench: unknown option '%s' (see --help)\n", flag);
		exit(2);
	}
}

/* Every option that takes a value: one given last without it is missing its value, anything else
 * is unknown. */
static bool takes_value(const char *flag)
{
	static const char *const v[] = {"--context", "--steps", "--layers", "--seqs", "--p",
		"--seed", "--q-heads", "--kv-heads", "--head-dim", "--dtype", "--sinks", "--window",
		"--flush", "--budget-min", "--budget-max", "--correction", "--rescore", "--keep",
		"--keep-steps", "--chunk", "--backend", "--host-bytes", "--nvme", "--nvme-bytes",
		"--nvme-qd", "--nvme-cache", "--spill", "--model-layers", "--gpu-bytes",
		"--weights-bytes", "--gpu-cache", "--plan-host-bytes", "--plan-nvme-bytes",
		"--run-fraction", "--topk", "--sweep", "--csv", "--stress", "--stress-mode",
		"--stress-budget", "--trace", "--hot-log"};
	for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
		if (!strcmp(flag, v[i]))
			return true;
	return false;
}

static bool is_switch(const char *a)
{
	return !strcmp(a, "--json") || !strcmp(a, "--quiet") || !strcmp(a, "--capacity") ||
	       !strcmp(a, "--plan") || !strcmp(a, "--baselines") || !strcmp(a, "--help") ||
	       !strcmp(a, "-h");
}

/*
 * One pass over argv. The first pass (apply false) only looks for --capacity, whose preset must be
 * in place before the other options so that those given explicitly override it; it stops quietly
 * at anything malformed, which the second pass reports.
 */
static void scan(int argc, char **argv, opts *o, bool apply)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *eq = strchr(a, '=');
		char flag[64];
		if (is_switch(a)) {
			if (!apply && !strcmp(a, "--capacity"))
				capacity_preset(o);
			if (apply && (!strcmp(a, "--help") || !strcmp(a, "-h"))) {
				opts d;
				opts_default(&d);
				usage(stdout, &d);
				exit(0);
			}
			if (apply && o->trace_dir && !trace_takes(a) && strcmp(a, "--help") &&
			    strcmp(a, "-h"))
				snprintf(o->not_trace, sizeof o->not_trace, "%s", a);
			o->json |= apply && !strcmp(a, "--json");
			o->quiet |= apply && !strcmp(a, "--quiet");
			o->plan |= apply && !strcmp(a, "--plan");
			o->baselines |= apply && !strcmp(a, "--baselines");
			continue;
		}
		size_t n = eq ? (size_t)(eq - a) : strlen(a);
		bool known = !strncmp(a, "--", 2) && n < sizeof(flag), has_value = eq || i + 1 < argc;
		if (!apply && (!known || !has_value))
			return;
		if (known) {
			memcpy(flag, a, n);
			flag[n] = 0;
		}
		if (!known || (!has_value && !takes_value(flag))) {
			fprintf(stderr, "kvbench: unknown option '%s' (see --help)\n", a);
			exit(2);
		}
		if (!has_value) {
			fprintf(stderr, "kvbench: %s needs a value (see --help)\n", flag);
			exit(2);
		}
		const char *val = eq ? eq + 1 : argv[++i];
		if (apply)
			set_option(o, flag, val);
		else if (!strcmp(flag, "--trace"))
			trace_preset(o, val);
	}
}

/* Checks that involve several options, and the preset's NVMe file. */
static void finish(opts *o)
{
	char v[32];
	if (o->hot_log && !o->trace_dir) {
		fprintf(stderr, "kvbench: --hot-log writes a trace replay's simulated hot-cache "
			"reads: it needs --trace\n");
		exit(2);
	}
	if (o->stress_only && !o->stress_s) {
		fprintf(stderr, "kvbench: %s needs --stress\n", o->stress_only);
		exit(2);
	}
	if (o->csv && (o->stress_s || !(o->n_sweep || (o->baselines && !o->capacity && !o->plan)))) {
		fprintf(stderr, "kvbench: --csv writes the points of a --sweep or of --baselines (not "
			"with --capacity, --plan or --stress): nothing here would write it\n");
		exit(2);
	}
	if (o->hot_log && o->n_sweep) {
		fprintf(stderr, "kvbench: --hot-log writes one replay's reads: leave out --sweep\n");
		exit(2);
	}
	if (o->topk) {
		if (o->rescore != 0.0f) {
			fprintf(stderr, "kvbench: --topk runs p = 1, where --rescore has nothing to do "
				"(it needs p < rescore <= 1): leave one out\n");
			exit(2);
		}
		o->p = 1.0f;
		o->budget_min = o->budget_max = o->topk;
	}
	if (o->trace_dir && o->not_trace[0]) {
		fprintf(stderr, "kvbench: %s does not apply to --trace: the trace gives the shape, and "
			"the replay takes --p, --sinks, --window, --flush, --budget-min, --budget-max, "
			"--correction, --rescore, --keep, --keep-steps, --chunk, --dtype, --backend, "
			"--gpu-cache, "
			"--nvme (with --nvme-bytes, --nvme-qd and --nvme-cache), --seed, --layers LIST, "
			"--sweep, --hot-log, --json and --quiet\n", o->not_trace);
		exit(2);
	}
	for (uint32_t a = 0; o->trace_dir && a < o->n_sweep; a++) {
		static const char *const ok[] = {"p=", "correction=", "rescore=", "budget-max=",
						 "keep="};
		bool fine = false;
		for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
			fine |= !strncmp(o->sweep[a], ok[i], strlen(ok[i]));
		if (!fine)
			bad_value("--sweep", o->sweep[a],
				  "with --trace the axes are the selection's: p, correction, rescore, "
				  "budget-max or keep (the trace gives the shape)");
	}
	int modes = o->capacity + o->plan + (o->stress_s > 0);
	if (modes > 1) {
		fprintf(stderr, "kvbench: --capacity, --plan and --stress are separate experiments: "
			"give one\n");
		exit(2);
	}
	if (o->n_sweep && (o->capacity || o->stress_s)) {
		fprintf(stderr, "kvbench: --sweep runs standard points (or --plan ones), not "
			"--capacity or --stress\n");
		exit(2);
	}
	snprintf(v, sizeof(v), "%u", o->kv_heads);
	if (o->q_heads % o->kv_heads)
		bad_value("--kv-heads", v, "must divide --q-heads");
	snprintf(v, sizeof(v), "%u", o->budget_max);
	if (o->budget_max && o->budget_max < o->budget_min) {
		char want[96];
		snprintf(want, sizeof(want), "must be 0 or at least --budget-min, which is %u",
			 o->budget_min);
		bad_value("--budget-max", v, want);
	}
	snprintf(v, sizeof(v), "%u", o->seqs);
	if (o->capacity && o->seqs < 2)
		bad_value("--seqs", v, "--capacity spills and restores between sequences: at least 2");
	if (o->capacity && o->n_nvme == 0) {
		o->nvme_paths[0] = KB_NVME_DEFAULT;
		o->n_nvme = 1;
		o->nvme_own = true;
	}
	if (o->spill == KVT_SPILL_LRU && o->n_nvme == 0)
		bad_value("--spill", "lru", "spilling needs an NVMe tier: give --nvme or --capacity");
	if (o->nvme_only && o->n_nvme == 0) {
		fprintf(stderr, "kvbench: %s needs an NVMe tier: give --nvme or --capacity\n",
			o->nvme_only);
		exit(2);
	}
}

/* The second stage takes rescore_p in (p, 1] (kvt_config), compared as the floats the library
 * gets. A sweep over p or rescore leaves out the points outside it instead (kb_point_opts). */
static void check_rescore(const opts *o)
{
	for (uint32_t a = 0; a < o->n_sweep; a++)
		if (!strncmp(o->sweep[a], "p=", 2) || !strncmp(o->sweep[a], "rescore=", 8))
			return;
	if (o->rescore == 0.0f || o->rescore > o->p)
		return;
	char v[32], want[96];
	snprintf(v, sizeof v, "%g", (double)o->rescore);
	snprintf(want, sizeof want, "expected 0 (off) or a number in (p, 1], and p is %g",
		 (double)o->p);
	bad_value("--rescore", v, want);
}

/* A regular file given with --nvme that holds data is not kvbench's to zero and resize (as the
 * cache would): refused, as the preset's KB_NVME_DEFAULT is when it exists (tier_sizes). A new
 * path, an empty file and a block device are used. */
static void check_nvme_paths(const opts *o)
{
	struct stat sb;
	for (uint32_t i = 0; i < o->n_nvme && !o->nvme_own; i++)
		if (stat(o->nvme_paths[i], &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0) {
			fprintf(stderr, "kvbench: --nvme: %s exists and is not empty: kvbench "
				"does not overwrite it: remove it, or give a new path, an empty "
				"file or a block device\n", o->nvme_paths[i]);
			exit(2);
		}
}

void parse_args(int argc, char **argv, opts *o)
{
	opts_default(o);
	scan(argc, argv, o, false);
	scan(argc, argv, o, true);
	finish(o);
	/* once, for the command line: not for each sweep point (opts_set), whose p and rescore
	 * cross, and whose earlier points' caches created the --nvme files */
	check_rescore(o);
	check_nvme_paths(o);
}

void opts_set(opts *o, const char *flag, const char *val)
{
	from_sweep = true;
	set_option(o, flag, val);
	finish(o);
	from_sweep = false;
}

/* The hot cache the plan counts: the fixed size given, or the self-sized cache's default bound (a
 * quarter of the device memory free at kvt_cache_create: here, of the HBM the weights leave). */
static uint64_t plan_hot(const opts *o)
{
	if (o->gpu_cache != KB_GPU_CACHE_AUTO)
		return o->gpu_cache;
	return o->gpu_bytes > o->weights_bytes
		       ? (o->gpu_bytes - o->weights_bytes) / KVT_GPU_HOT_AUTO_SHARE
		       : 0;
}

void opts_plan_in(const opts *o, uint32_t context, kb_plan_in *in)
{
	uint64_t nvme = o->plan_nvme;
	if (!nvme && o->n_nvme && o->nvme_bytes)
		nvme = o->nvme_bytes * o->n_nvme;
	*in = (kb_plan_in){.layers = o->model_layers, .kv_heads = o->kv_heads,
			   .head_dim = o->head_dim, .context = context, .sinks = o->sinks,
			   .window = o->window, .flush = o->flush, .gpu_bytes = o->gpu_bytes,
			   .weights_bytes = o->weights_bytes, .hot_bytes = plan_hot(o),
			   .host_bytes = o->plan_host ? o->plan_host : 256ull << 30,
			   .nvme_bytes = nvme};
}

void opts_free(opts *o)
{
	for (uint32_t i = 0; i < o->n_sweep; i++)
		free(o->sweep[i]);
	o->n_sweep = 0;
	free(o->nvme_arg);
	o->nvme_arg = NULL;
	o->n_nvme = 0;
}
