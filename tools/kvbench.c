/* SPDX-License-Identifier: MIT */
/*
 * kvbench: a capacity experiment for kvtier. It prefills a synthetic long context (workload.h) into a
 * cache, runs decode steps through kvt_append + kvt_attend, reads back which tokens each KV head
 * attended (kvt_gather), and compares everything with exact fp32 attention over the whole context
 * computed here from the same rounded K/V/q: the softmax mass covered (recall), the share of indexed
 * tokens fetched against the exact Top-p oracle (budget), and the error of the attention output.
 * doc/kvbench.md describes the workload and every output field.
 */
#include "kvtier.h"
#include "workload.h"

#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct opts {
	uint32_t context, steps, layers, seqs, q_heads, kv_heads, head_dim, chunk;
	uint32_t sinks, window, flush, budget_min, budget_max, dtype, backend;
	uint64_t seed;
	float p;
	bool json, quiet;
} opts;

/* Per-step (and, summed, whole-run) quality figures. */
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
} cudart;

enum { H2D = 1, D2H = 2 }; /* cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost */

typedef struct buf {
	void *host, *dev;
} buf;

typedef struct bench {
	opts o;
	kvt_cache *cache;
	wl *w;
	cudart cu;
	bool on_dev;
	uint32_t d, group, cap;
	uint32_t *ids;      /* [seqs] */
	float *K, *V;       /* rounded truth [seqs, layers, kv_heads, cap, d] */
	uint32_t *len;      /* [seqs * layers] tokens held */
	uint32_t *n_idx;    /* [seqs * layers] tokens indexed, by the documented flush rule */
	buf q, k, v, out, pos;
	float *qf;          /* rounded decode queries [seqs, q_heads, d] */
	float *qtmp;        /* [group, d] */
	int64_t *needle;    /* [seqs, q_heads] needle position asked for, or -1 */
	int32_t *counts;    /* [seqs, kv_heads] */
	float *score, *prob; /* [group, cap] */
	double *ent;        /* [group] entropy of each head's distribution */
	uint32_t *sorted;   /* [2, cap] float bits and radix-sort scratch */
	uint8_t *mark;      /* [cap] */
	double *head_oracle, *head_eff; /* [layers * q_heads] sums over seqs and steps */
	acc *step;          /* [steps] */
	acc all;
	uint64_t ns_prefill, ns_gather;
	kvt_stats st_prefill, st_end;
	bool tty;
	int last_decile;
} bench;

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvbench [options]\n"
		"Prefill a synthetic long context into a kvtier cache, decode, and compare with exact\n"
		"attention. Defaults: a Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128,\n"
		"fp16), 2 layers, 16 steps, one sequence of 24576 tokens, p 0.9, CPU backend.\n"
		"  --context N      prefill tokens per sequence (24576)\n"
		"  --steps N        decode steps (16)\n"
		"  --layers N       layers (2)\n"
		"  --seqs N         sequences decoded together (1)\n"
		"  --p X            Top-p mass in (0, 1] (0.9)\n"
		"  --seed N         workload and rotation seed (1)\n"
		"  --q-heads N      query heads (32)\n"
		"  --kv-heads N     KV heads, dividing --q-heads (8)\n"
		"  --head-dim N     64, 128 or 256 (128)\n"
		"  --dtype T        f16 or bf16 (f16)\n"
		"  --sinks N        sink tokens always attended (4)\n"
		"  --window N       local window W (64)\n"
		"  --flush N        flush batch B, >= 1 (64)\n"
		"  --budget-min N   min indexed tokens per query head per step (0)\n"
		"  --budget-max N   max indexed tokens per query head per step, 0 = none (0)\n"
		"  --chunk N        prefill chunk tokens (4096)\n"
		"  --backend B      cpu, cuda or auto (cpu)\n"
		"  --json           print one JSON object on stdout instead of the table\n"
		"  --quiet          no progress on stderr, no per-step table\n"
		"  --help           this text\n"
		"Exit status: 0 done, 1 library or system error, 2 bad option.\n");
}

/* ---- options ----------------------------------------------------------------------------- */

static void bad_value(const char *flag, const char *val, const char *want)
{
	fprintf(stderr, "kvbench: %s: invalid value '%s' (%s)\n", flag, val, want);
	exit(2);
}

static uint64_t parse_uint(const char *flag, const char *val, uint64_t lo, uint64_t hi)
{
	char *end, want[96];
	errno = 0;
	unsigned long long x = strtoull(val, &end, 10);
	if (errno || end == val || *end || val[0] == '-' || x < lo || x > hi) {
		snprintf(want, sizeof(want), "expected an integer in [%" PRIu64 ", %" PRIu64 "]", lo, hi);
		bad_value(flag, val, want);
	}
	return x;
}

static uint32_t parse_enum(const char *flag, const char *val, const char *const *names,
			   const uint32_t *codes, const char *want)
{
	for (uint32_t i = 0; names[i]; i++)
		if (!strcmp(val, names[i]))
			return codes[i];
	bad_value(flag, val, want);
	return 0;
}

static void set_option(opts *o, const char *flag, const char *val)
{
	static const char *const dt_names[] = {"f16", "bf16", NULL};
	static const uint32_t dt_codes[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
	static const char *const be_names[] = {"cpu", "cuda", "auto", NULL};
	static const uint32_t be_codes[] = {KVT_BACKEND_CPU, KVT_BACKEND_CUDA, KVT_BACKEND_AUTO};
	const uint64_t big = INT32_MAX / 2; /* positions are int32 in kvt_gather */
	struct { const char *name; uint32_t *dst; uint64_t lo, hi; } u32[] = {
		{"--context", &o->context, 1, big}, {"--steps", &o->steps, 1, 1u << 20},
		{"--layers", &o->layers, 1, 4096}, {"--seqs", &o->seqs, 1, 4096},
		{"--q-heads", &o->q_heads, 1, 1024}, {"--kv-heads", &o->kv_heads, 1, 1024},
		{"--sinks", &o->sinks, 0, big}, {"--window", &o->window, 0, big},
		{"--flush", &o->flush, 1, big}, {"--budget-min", &o->budget_min, 0, big},
		{"--budget-max", &o->budget_max, 0, big}, {"--chunk", &o->chunk, 1, 1u << 20},
	};
	for (size_t i = 0; i < sizeof(u32) / sizeof(u32[0]); i++)
		if (!strcmp(flag, u32[i].name)) {
			*u32[i].dst = (uint32_t)parse_uint(flag, val, u32[i].lo, u32[i].hi);
			return;
		}
	if (!strcmp(flag, "--seed")) {
		o->seed = parse_uint(flag, val, 0, 1ull << 53); /* exact in JSON */
	} else if (!strcmp(flag, "--head-dim")) {
		o->head_dim = (uint32_t)parse_uint(flag, val, 64, 256);
		if (o->head_dim != 64 && o->head_dim != 128 && o->head_dim != 256)
			bad_value(flag, val, "expected 64, 128 or 256");
	} else if (!strcmp(flag, "--p")) {
		char *end;
		errno = 0;
		double x = strtod(val, &end);
		if (errno || end == val || *end || !(x > 0.0 && x <= 1.0))
			bad_value(flag, val, "expected a number in (0, 1]");
		o->p = (float)x;
	} else if (!strcmp(flag, "--dtype")) {
		o->dtype = parse_enum(flag, val, dt_names, dt_codes, "expected f16 or bf16");
	} else if (!strcmp(flag, "--backend")) {
		o->backend = parse_enum(flag, val, be_names, be_codes, "expected cpu, cuda or auto");
	} else {
		fprintf(stderr, "kvbench: unknown option '%s' (see --help)\n", flag);
		exit(2);
	}
}

static void parse_args(int argc, char **argv, opts *o)
{
	*o = (opts){.context = 24576, .steps = 16, .layers = 2, .seqs = 1, .q_heads = 32,
		    .kv_heads = 8, .head_dim = 128, .chunk = 4096, .sinks = 4, .window = 64,
		    .flush = 64, .dtype = KVT_DTYPE_F16, .backend = KVT_BACKEND_CPU, .seed = 1,
		    .p = 0.9f};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *eq = strchr(a, '=');
		char flag[64];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			exit(0);
		}
		if (!strcmp(a, "--json") || !strcmp(a, "--quiet")) {
			*(a[2] == 'j' ? &o->json : &o->quiet) = true;
			continue;
		}
		size_t n = eq ? (size_t)(eq - a) : strlen(a);
		if (strncmp(a, "--", 2) || n >= sizeof(flag)) {
			fprintf(stderr, "kvbench: unknown option '%s' (see --help)\n", a);
			exit(2);
		}
		memcpy(flag, a, n);
		flag[n] = 0;
		if (!eq && i + 1 >= argc) {
			fprintf(stderr, "kvbench: %s needs a value (see --help)\n", flag);
			exit(2);
		}
		set_option(o, flag, eq ? eq + 1 : argv[++i]);
	}
	char v[16];
	snprintf(v, sizeof(v), "%u", o->q_heads % o->kv_heads ? o->kv_heads : o->budget_max);
	if (o->q_heads % o->kv_heads)
		bad_value("--kv-heads", v, "must divide --q-heads");
	if (o->budget_max && o->budget_max < o->budget_min)
		bad_value("--budget-max", v, "must be 0 or at least --budget-min");
}

/* ---- errors, time, progress -------------------------------------------------------------- */

static void lib_fail(const kvt_cache *c, int rc, const char *what)
{
	fprintf(stderr, "kvbench: %s failed: %s (%d): %s\n", what, kvt_strerror(rc), rc,
		kvt_last_error(c));
	exit(1);
}

static void fail(const char *what, const char *detail)
{
	fprintf(stderr, "kvbench: %s: %s\n", what, detail);
	exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (!p) {
		fprintf(stderr, "kvbench: out of memory (%zu x %zu bytes)\n", n, size);
		exit(1);
	}
	return p;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* \r updates on a terminal; otherwise one line per 10% so logs stay short. */
static void progress(bench *b, const char *phase, uint64_t done, uint64_t total)
{
	if (b->o.quiet)
		return;
	int pct = (int)(done * 100 / total);
	if (b->tty) {
		/* the line goes away when the phase ends: the table and summary follow on stdout */
		if (done == total)
			fprintf(stderr, "\r\033[K");
		else
			fprintf(stderr, "\rkvbench: %s %3d%% (%" PRIu64 "/%" PRIu64 ")", phase, pct,
				done, total);
		fflush(stderr);
	} else if (pct / 10 > b->last_decile) {
		b->last_decile = done == total ? 0 : pct / 10;
		fprintf(stderr, "kvbench: %s %d%%\n", phase, pct);
	}
}

/* ---- buffers ------------------------------------------------------------------------------ */

static void cuda_open(bench *b)
{
	static const char *const names[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
	for (size_t i = 0; i < 3 && !b->cu.lib; i++)
		b->cu.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	const char *why = b->cu.lib ? NULL : dlerror();
	if (!b->cu.lib)
		fail("the cache runs on CUDA but libcudart could not be loaded", why ? why : "?");
	*(void **)&b->cu.malloc_ = dlsym(b->cu.lib, "cudaMalloc");
	*(void **)&b->cu.free_ = dlsym(b->cu.lib, "cudaFree");
	*(void **)&b->cu.memcpy_ = dlsym(b->cu.lib, "cudaMemcpy");
	if (!b->cu.malloc_ || !b->cu.free_ || !b->cu.memcpy_)
		fail("libcudart", "cudaMalloc, cudaFree or cudaMemcpy missing");
	b->on_dev = true;
}

static void buf_alloc(bench *b, buf *x, size_t bytes)
{
	x->host = xcalloc(1, bytes);
	x->dev = x->host;
	if (b->on_dev && b->cu.malloc_(&x->dev, bytes))
		fail("cudaMalloc failed", "staging buffer");
}

static void buf_free(bench *b, buf *x)
{
	if (b->on_dev)
		b->cu.free_(x->dev);
	free(x->host);
}

static void buf_sync(bench *b, buf *x, size_t bytes, int dir)
{
	if (!b->on_dev)
		return;
	int rc = dir == H2D ? b->cu.memcpy_(x->dev, x->host, bytes, H2D)
			    : b->cu.memcpy_(x->host, x->dev, bytes, D2H);
	if (rc)
		fail("cudaMemcpy failed", dir == H2D ? "to device" : "from device");
}

/* ---- setup ------------------------------------------------------------------------------- */

static uint16_t to_bits(const bench *b, float x)
{
	return b->o.dtype == KVT_DTYPE_BF16 ? wl_f32_to_bf16(x) : wl_f32_to_f16(x);
}

static float from_bits(const bench *b, uint16_t h)
{
	return b->o.dtype == KVT_DTYPE_BF16 ? wl_bf16_to_f32(h) : wl_f16_to_f32(h);
}

static float *truth(const bench *b, float *base, uint32_t s, uint32_t l, uint32_t kvh)
{
	size_t i = ((size_t)s * b->o.layers + l) * b->o.kv_heads + kvh;
	return base + i * b->cap * b->d;
}

static void create_cache(bench *b)
{
	const opts *o = &b->o;
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = o->layers;
	cfg.n_q_heads = o->q_heads;
	cfg.n_kv_heads = o->kv_heads;
	cfg.head_dim = o->head_dim;
	cfg.dtype = o->dtype;
	cfg.out_dtype = KVT_DTYPE_F32;
	cfg.backend = o->backend;
	cfg.max_seqs = o->seqs;
	cfg.p = o->p;
	cfg.n_sink = o->sinks;
	cfg.window = o->window;
	cfg.flush_batch = o->flush;
	cfg.budget_min = o->budget_min;
	cfg.budget_max = o->budget_max;
	cfg.seed = o->seed;
	/* Twice the rows (rounded up to whole 256-token blocks) plus slack: never the limit here. */
	uint64_t rows = ((uint64_t)b->cap + 255) / 256 * 256;
	cfg.host_bytes = 2 * rows * o->seqs * o->layers * o->kv_heads * 2 * o->head_dim * 2 +
			 (64ull << 20);
	int rc = kvt_cache_create(&cfg, &b->cache);
	if (rc < 0)
		lib_fail(NULL, rc, "kvt_cache_create");
	kvt_stats st = {.size = sizeof(st)};
	if ((rc = kvt_get_stats(b->cache, &st)) < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
	if (st.backend && !strcmp(st.backend, "cuda"))
		cuda_open(b);
	for (uint32_t s = 0; s < o->seqs; s++)
		if ((rc = kvt_seq_open(b->cache, &b->ids[s])) < 0)
			lib_fail(b->cache, rc, "kvt_seq_open");
}

static void setup(bench *b)
{
	const opts *o = &b->o;
	b->d = o->head_dim;
	b->group = o->q_heads / o->kv_heads;
	b->cap = o->context + o->steps;
	b->tty = isatty(STDERR_FILENO);
	wl_params wp;
	wl_params_default(&wp);
	wp.n_layers = o->layers;
	wp.n_q_heads = o->q_heads;
	wp.n_kv_heads = o->kv_heads;
	wp.head_dim = o->head_dim;
	wp.context = o->context;
	wp.steps = o->steps;
	wp.seed = o->seed;
	if (wl_create(&wp, &b->w) < 0)
		fail("cannot build the workload", "out of memory or bad shape");
	size_t truth_n = (size_t)o->seqs * o->layers * o->kv_heads * b->cap * b->d;
	size_t sl = (size_t)o->seqs * o->layers, rows = o->chunk > o->seqs ? o->chunk : o->seqs;
	b->ids = xcalloc(o->seqs, sizeof(uint32_t));
	b->K = xcalloc(truth_n, sizeof(float));
	b->V = xcalloc(truth_n, sizeof(float));
	b->len = xcalloc(sl, sizeof(uint32_t));
	b->n_idx = xcalloc(sl, sizeof(uint32_t));
	b->qf = xcalloc((size_t)o->seqs * o->q_heads * b->d, sizeof(float));
	b->needle = xcalloc((size_t)o->seqs * o->q_heads, sizeof(int64_t));
	b->counts = xcalloc((size_t)o->seqs * o->kv_heads, sizeof(int32_t));
	b->score = xcalloc((size_t)b->group * b->cap, sizeof(float));
	b->ent = xcalloc(b->group, sizeof(double));
	b->qtmp = xcalloc((size_t)b->group * b->d, sizeof(float));
	b->prob = xcalloc((size_t)b->group * b->cap, sizeof(float));
	b->sorted = xcalloc(2 * (size_t)b->cap, sizeof(uint32_t));
	b->mark = xcalloc(b->cap, 1);
	b->head_oracle = xcalloc((size_t)o->layers * o->q_heads, sizeof(double));
	b->head_eff = xcalloc((size_t)o->layers * o->q_heads, sizeof(double));
	b->step = xcalloc(o->steps, sizeof(acc));
	for (uint32_t i = 0; i < o->steps; i++)
		b->step[i].recall_min = 1.0;
	b->all.recall_min = 1.0;
	create_cache(b);
	buf_alloc(b, &b->q, rows * o->q_heads * b->d * 2);
	buf_alloc(b, &b->k, rows * o->kv_heads * b->d * 2);
	buf_alloc(b, &b->v, rows * o->kv_heads * b->d * 2);
	buf_alloc(b, &b->out, (size_t)o->seqs * o->q_heads * b->d * sizeof(float));
	buf_alloc(b, &b->pos, (size_t)o->seqs * o->kv_heads * b->cap * sizeof(int32_t));
}

static void teardown(bench *b)
{
	for (uint32_t s = 0; s < b->o.seqs; s++)
		kvt_seq_close(b->cache, b->ids[s]);
	kvt_cache_destroy(b->cache);
	buf_free(b, &b->q);
	buf_free(b, &b->k);
	buf_free(b, &b->v);
	buf_free(b, &b->out);
	buf_free(b, &b->pos);
	if (b->cu.lib)
		dlclose(b->cu.lib);
	wl_destroy(b->w);
	void *p[] = {b->ids, b->K, b->V, b->len, b->n_idx, b->qf, b->needle, b->counts, b->score,
		     b->ent, b->qtmp, b->prob, b->sorted, b->mark, b->head_oracle, b->head_eff, b->step};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* ---- the documented window rule, checked against the library ----------------------------- */

static uint32_t sinks_of(const bench *b, uint32_t len)
{
	return len < b->o.sinks ? len : b->o.sinks;
}

/* After a prefill chunk the window holds min(W, len - sinks) tokens; the rest is indexed. */
static void rule_prefill(bench *b, size_t sl, uint32_t n)
{
	uint32_t len = b->len[sl] += n, rest = len - sinks_of(b, len);
	b->n_idx[sl] = rest - (rest < b->o.window ? rest : b->o.window);
}

/* An append adds a window token; at W + B window tokens the oldest B are indexed. */
static void rule_append(bench *b, size_t sl)
{
	uint32_t len = ++b->len[sl];
	if (len - sinks_of(b, len) - b->n_idx[sl] >= b->o.window + b->o.flush)
		b->n_idx[sl] += b->o.flush;
}

static void check_stats(bench *b, kvt_stats *st, const char *when)
{
	int rc;
	st->size = sizeof(*st);
	if ((rc = kvt_get_stats(b->cache, st)) < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
	uint64_t tok = 0, idx = 0;
	for (size_t i = 0; i < (size_t)b->o.seqs * b->o.layers; i++) {
		tok += b->len[i];
		idx += b->n_idx[i];
	}
	if (st->tokens != tok || st->tokens_indexed != idx) {
		fprintf(stderr,
			"kvbench: %s: the library holds %" PRIu64 " tokens, %" PRIu64 " indexed; the "
			"documented window rule gives %" PRIu64 " and %" PRIu64 "\n",
			when, st->tokens, st->tokens_indexed, tok, idx);
		exit(1);
	}
}

/* ---- prefill ----------------------------------------------------------------------------- */

/* Round to the cache's dtype: the bits for the library, the rounded floats kept for the truth. */
static void round_into(const bench *b, float *x, uint16_t *bits)
{
	for (uint32_t i = 0; i < b->d; i++) {
		bits[i] = to_bits(b, x[i]);
		x[i] = from_bits(b, bits[i]);
	}
}

/* Tokens [t0, t0 + n) of sequence s on layer l: keys and values into the truth arrays and as bits
 * into kb, vb [n, kv_heads, d]; queries as bits into qb [n, q_heads, d] and, for a decode step,
 * into b->qf with the needles they ask for. */
static void gen_tokens(bench *b, uint32_t s, uint32_t l, uint32_t t0, uint32_t n, int32_t step,
		       uint16_t *kb, uint16_t *vb, uint16_t *qb)
{
	const uint32_t d = b->d, G = b->group, KV = b->o.kv_heads, QH = b->o.q_heads;
	for (uint32_t h = 0; h < KV; h++) {
		float *K = truth(b, b->K, s, l, h), *V = truth(b, b->V, s, l, h);
		int64_t *asked = step >= 0 ? b->needle + (size_t)s * QH + h * G : NULL;
		for (uint32_t t = t0; t < t0 + n; t++) {
			float *kt = K + (size_t)t * d, *vt = V + (size_t)t * d;
			wl_token(b->w, s, l, h, t, step, kt, vt, b->qtmp, asked);
			round_into(b, kt, kb + ((size_t)(t - t0) * KV + h) * d);
			round_into(b, vt, vb + ((size_t)(t - t0) * KV + h) * d);
			for (uint32_t g = 0; g < G; g++) {
				float *q = b->qtmp + (size_t)g * d;
				round_into(b, q, qb + ((size_t)(t - t0) * QH + h * G + g) * d);
				if (step >= 0)
					memcpy(b->qf + ((size_t)s * QH + h * G + g) * d, q,
					       d * sizeof(float));
			}
		}
	}
}

/* Chunk-major, layer-minor, as a runtime runs its layers over one chunk at a time. */
static void prefill(bench *b)
{
	const opts *o = &b->o;
	uint32_t chunks = (o->context + o->chunk - 1) / o->chunk;
	uint64_t done = 0, total = (uint64_t)chunks * o->layers * o->seqs;
	for (uint32_t t0 = 0; t0 < o->context; t0 += o->chunk) {
		uint32_t n = o->context - t0 < o->chunk ? o->context - t0 : o->chunk;
		for (uint32_t l = 0; l < o->layers; l++)
			for (uint32_t s = 0; s < o->seqs; s++) {
				gen_tokens(b, s, l, t0, n, -1, b->k.host, b->v.host, b->q.host);
				buf_sync(b, &b->q, (size_t)n * o->q_heads * b->d * 2, H2D);
				buf_sync(b, &b->k, (size_t)n * o->kv_heads * b->d * 2, H2D);
				buf_sync(b, &b->v, (size_t)n * o->kv_heads * b->d * 2, H2D);
				uint64_t t = now_ns();
				int rc = kvt_prefill(b->cache, b->ids[s], l, b->q.dev, b->k.dev,
						     b->v.dev, n, NULL);
				b->ns_prefill += now_ns() - t;
				if (rc < 0)
					lib_fail(b->cache, rc, "kvt_prefill");
				rule_prefill(b, (size_t)s * o->layers + l, n);
				progress(b, "prefill", ++done, total);
			}
	}
	check_stats(b, &b->st_prefill, "after prefill");
}

/* ---- ground truth and comparison --------------------------------------------------------- */

static float dotf(const float *a, const float *x, uint32_t d)
{
	/* four chains: the scalar build is latency-bound on one */
	float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
	for (uint32_t i = 0; i < d; i += 4) {
		s0 += a[i] * x[i];
		s1 += a[i + 1] * x[i + 1];
		s2 += a[i + 2] * x[i + 2];
		s3 += a[i + 3] * x[i + 3];
	}
	return (s0 + s1) + (s2 + s3);
}

/* Ascending LSD radix sort of non-negative floats by their bit patterns, which order like the
 * values: four 8-bit passes, linear in n (qsort's comparisons were a tenth of the run). */
static void sort_probs(uint32_t *x, uint32_t *tmp, uint32_t n)
{
	for (uint32_t shift = 0; shift < 32; shift += 8) {
		uint32_t cnt[257] = {0}, *t = x;
		for (uint32_t i = 0; i < n; i++)
			cnt[((x[i] >> shift) & 255u) + 1]++;
		for (uint32_t i = 0; i < 256; i++)
			cnt[i + 1] += cnt[i];
		for (uint32_t i = 0; i < n; i++)
			tmp[cnt[(x[i] >> shift) & 255u]++] = x[i];
		x = tmp;
		tmp = t;
	}
}

/* Exact Top-p of one head over the indexed range [lo, lo + n), renormalized there: the smallest
 * set by descending probability with mass >= p, extended over ties. Marks it into b->mark and
 * returns its size. */
static uint32_t oracle_mark(bench *b, const float *pr, uint32_t lo, uint32_t n)
{
	double total = 0, cum = 0;
	uint32_t k = 0, cnt = 0;
	float v = 0;
	for (uint32_t i = lo; i < lo + n; i++)
		total += pr[i];
	memcpy(b->sorted, pr + lo, n * sizeof(float));
	sort_probs(b->sorted, b->sorted + b->cap, n);
	for (k = 0; k < n && (b->o.p >= 1.0f || cum < (double)b->o.p * total); k++) {
		memcpy(&v, &b->sorted[n - 1 - k], sizeof(v));
		cum += v;
	}
	for (uint32_t i = lo; k && i < lo + n; i++)
		if (pr[i] >= v) {
			b->mark[i] = 1;
			cnt++;
		}
	return cnt;
}

/* Softmax over all `len` tokens for each query head of a group: probabilities into b->prob,
 * entropies into b->ent. */
static void group_softmax(bench *b, const float *K, const float *q, uint32_t len)
{
	float scale = 1.0f / sqrtf((float)b->d);
	for (uint32_t t = 0; t < len; t++)
		for (uint32_t g = 0; g < b->group; g++)
			b->score[(size_t)g * b->cap + t] =
				dotf(q + (size_t)g * b->d, K + (size_t)t * b->d, b->d) * scale;
	for (uint32_t g = 0; g < b->group; g++) {
		float *sc = b->score + (size_t)g * b->cap, *pr = b->prob + (size_t)g * b->cap;
		float m = sc[0];
		double z = 0, h = 0;
		for (uint32_t t = 1; t < len; t++)
			m = sc[t] > m ? sc[t] : m;
		for (uint32_t t = 0; t < len; t++)
			z += pr[t] = expf(sc[t] - m);
		for (uint32_t t = 0; t < len; t++) {
			pr[t] = (float)(pr[t] / z);
			if (pr[t] > 0)
				h -= pr[t] * log(pr[t]);
		}
		b->ent[g] = h;
	}
}

/* Exact outputs of the group and their squared distance to the library's outputs. */
static void group_error(bench *b, const float *V, const float *out, uint32_t len, acc *a)
{
	double full[256];
	for (uint32_t g = 0; g < b->group; g++) {
		const float *pr = b->prob + (size_t)g * b->cap;
		memset(full, 0, sizeof(full));
		for (uint32_t t = 0; t < len; t++)
			for (uint32_t i = 0; i < b->d; i++)
				full[i] += (double)pr[t] * V[(size_t)t * b->d + i];
		for (uint32_t i = 0; i < b->d; i++) {
			double e = out[(size_t)g * b->d + i] - full[i];
			a->err2 += e * e;
			a->full2 += full[i] * full[i];
		}
	}
}

/* Positions must ascend, stay below len, and include every sink and window token. */
static void check_positions(const int32_t *p, int32_t cnt, uint32_t len, uint32_t lo, uint32_t hi)
{
	uint32_t must = 0;
	for (int32_t i = 0; i < cnt; i++) {
		if (p[i] < 0 || (uint32_t)p[i] >= len || (i && p[i] <= p[i - 1])) {
			fprintf(stderr, "kvbench: kvt_gather returned position %d at %d of %d (length "
				"%u): out of range or not ascending\n", p[i], i, cnt, len);
			exit(1);
		}
		must += (uint32_t)p[i] < lo || (uint32_t)p[i] >= hi;
	}
	if (must != len - (hi - lo)) {
		fprintf(stderr, "kvbench: kvt_gather returned %u of the %u sink and window tokens "
			"(length %u, indexed range [%u, %u))\n", must, len - (hi - lo), len, lo, hi);
		exit(1);
	}
}

/* Compare one sequence on one layer after kvt_attend + kvt_gather. */
static void evaluate(bench *b, uint32_t s, uint32_t l, const float *out, acc *a)
{
	const opts *o = &b->o;
	size_t sl = (size_t)s * o->layers + l;
	uint32_t len = b->len[sl], lo = sinks_of(b, len), n = b->n_idx[sl], hi = lo + n;
	for (uint32_t h = 0; h < o->kv_heads; h++) {
		const int32_t *p = (const int32_t *)b->pos.host + ((size_t)s * o->kv_heads + h) * len;
		int32_t cnt = b->counts[(size_t)s * o->kv_heads + h];
		uint32_t jq = h * b->group, sel = 0, uni = 0;
		check_positions(p, cnt, len, lo, hi);
		group_softmax(b, truth(b, b->K, s, l, h), b->qf + ((size_t)s * o->q_heads + jq) * b->d,
			      len);
		group_error(b, truth(b, b->V, s, l, h), out + ((size_t)s * o->q_heads + jq) * b->d,
			    len, a);
		memset(b->mark + lo, 0, n);
		for (uint32_t g = 0; g < b->group; g++) {
			const float *pr = b->prob + (size_t)g * b->cap;
			double r = 0;
			int64_t nd = b->needle[(size_t)s * o->q_heads + jq + g];
			for (int32_t i = 0; i < cnt; i++) {
				r += pr[p[i]];
				a->needles_found += p[i] == nd;
			}
			a->needles += nd >= 0;
			a->recall_sum += r;
			a->recall_n++;
			a->recall_min = r < a->recall_min ? r : a->recall_min;
			a->recall_low += r < 0.5;
			uint32_t one = n ? oracle_mark(b, pr, lo, n) : 0;
			b->head_oracle[(size_t)l * o->q_heads + jq + g] += n ? (double)one / n : 0;
			b->head_eff[(size_t)l * o->q_heads + jq + g] += exp(b->ent[g]);
		}
		for (uint32_t i = lo; i < hi; i++)
			uni += b->mark[i];
		for (int32_t i = 0; i < cnt; i++)
			sel += (uint32_t)p[i] >= lo && (uint32_t)p[i] < hi;
		if (n) {
			a->budget_sum += (double)sel / n;
			a->oracle_sum += (double)uni / n;
			a->kv_n++;
		}
	}
}

/* ---- decode ------------------------------------------------------------------------------ */

static void decode_layer(bench *b, uint32_t step, uint32_t l)
{
	const opts *o = &b->o;
	uint32_t pos = o->context + step, len = pos + 1;
	uint16_t *kb = b->k.host, *vb = b->v.host, *qb = b->q.host;
	size_t kv_row = (size_t)o->kv_heads * b->d, q_row = (size_t)o->q_heads * b->d;
	int rc;
	for (uint32_t s = 0; s < o->seqs; s++)
		gen_tokens(b, s, l, pos, 1, (int32_t)step, kb + s * kv_row, vb + s * kv_row,
			   qb + s * q_row);
	buf_sync(b, &b->k, o->seqs * kv_row * 2, H2D);
	buf_sync(b, &b->v, o->seqs * kv_row * 2, H2D);
	buf_sync(b, &b->q, o->seqs * q_row * 2, H2D);
	uint64_t t0 = now_ns();
	if ((rc = kvt_append(b->cache, l, o->seqs, b->ids, b->k.dev, b->v.dev, NULL)) < 0)
		lib_fail(b->cache, rc, "kvt_append");
	if ((rc = kvt_attend(b->cache, l, o->seqs, b->ids, b->q.dev, b->out.dev, NULL)) < 0)
		lib_fail(b->cache, rc, "kvt_attend");
	uint64_t t1 = now_ns();
	/* max_tokens = the sequence length is always enough, whatever was selected */
	rc = kvt_gather(b->cache, l, o->seqs, b->ids, len, b->counts, b->pos.dev, NULL, NULL, NULL);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_gather");
	b->ns_gather += now_ns() - t1;
	b->step[step].ns += t1 - t0;
	buf_sync(b, &b->out, o->seqs * q_row * sizeof(float), D2H);
	buf_sync(b, &b->pos, (size_t)o->seqs * o->kv_heads * len * sizeof(int32_t), D2H);
	for (uint32_t s = 0; s < o->seqs; s++) {
		rule_append(b, (size_t)s * o->layers + l);
		evaluate(b, s, l, b->out.host, &b->step[step]);
	}
}

static void acc_add(acc *to, const acc *a)
{
	to->recall_sum += a->recall_sum;
	to->recall_min = a->recall_min < to->recall_min ? a->recall_min : to->recall_min;
	to->budget_sum += a->budget_sum;
	to->oracle_sum += a->oracle_sum;
	to->err2 += a->err2;
	to->full2 += a->full2;
	to->recall_n += a->recall_n;
	to->recall_low += a->recall_low;
	to->kv_n += a->kv_n;
	to->needles += a->needles;
	to->needles_found += a->needles_found;
	to->ns += a->ns;
}

static void print_row(const bench *b, int step, const acc *a)
{
	double bud = a->kv_n ? a->budget_sum / a->kv_n : NAN;
	double orc = a->kv_n ? a->oracle_sum / a->kv_n : NAN;
	if (step < 0)
		printf("  all");
	else
		printf("%5d", step);
	printf(" %9u  %.4f  %.4f  %.4f  %.4f  %5.2f  %.2e  %8.2f\n",
	       b->o.context + (step < 0 ? b->o.steps : (uint32_t)step + 1),
	       a->recall_sum / a->recall_n, a->recall_min, bud, orc, orc > 0 ? bud / orc : 0.0,
	       sqrt(a->err2 / a->full2),
	       (double)a->ns / 1e6 / b->o.layers / (step < 0 ? b->o.steps : 1));
}

static void print_header(const bench *b)
{
	const opts *o = &b->o;
	printf("kvbench %s: %u query heads, %u KV heads, head_dim %u, %s; %u layers, %u seq, "
	       "context %u, %u decode steps; p %.3g, sinks %u, window %u, flush %u; backend %s\n",
	       kvt_version_string(), o->q_heads, o->kv_heads, o->head_dim,
	       o->dtype == KVT_DTYPE_BF16 ? "bf16" : "f16", o->layers, o->seqs, o->context,
	       o->steps, o->p, o->sinks, o->window, o->flush, b->st_prefill.backend);
	printf(" step    tokens  recall  r_min   budget  oracle  b/o    rel_err  ms/layer\n");
}

static void decode(bench *b)
{
	const opts *o = &b->o;
	bool table = !o->json && !o->quiet;
	if (table)
		print_header(b);
	for (uint32_t st = 0; st < o->steps; st++) {
		for (uint32_t l = 0; l < o->layers; l++) {
			decode_layer(b, st, l);
			progress(b, "decode", (uint64_t)st * o->layers + l + 1,
				 (uint64_t)o->steps * o->layers);
		}
		check_stats(b, &b->st_end, "after a decode step");
		acc_add(&b->all, &b->step[st]);
		if (table) {
			if (b->tty) /* the progress line shares the terminal */
				fprintf(stderr, "\r\033[K");
			print_row(b, (int)st, &b->step[st]);
			fflush(stdout);
		}
	}
	if (table)
		print_row(b, -1, &b->all);
}

/* ---- summary ----------------------------------------------------------------------------- */

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* min, median, max over (layer, query head) of a per-head mean over sequences and steps */
static void spread(const bench *b, const double *sum, double out[3])
{
	size_t n = (size_t)b->o.layers * b->o.q_heads;
	double *v = xcalloc(n, sizeof(double));
	for (size_t i = 0; i < n; i++)
		v[i] = sum[i] / ((double)b->o.seqs * b->o.steps);
	qsort(v, n, sizeof(double), cmp_dbl);
	out[0] = v[0];
	out[1] = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
	out[2] = v[n - 1];
	free(v);
}

/* One JSON member: a number (integral values print as integers) or, with s set, a string. */
typedef struct jv {
	const char *k;
	double v;
	const char *s;
} jv;

static void jmembers(const jv *m, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		printf("%s\"%s\": ", i ? ", " : "", m[i].k);
		if (m[i].s)
			printf("\"%s\"", m[i].s);
		else if (!isfinite(m[i].v))
			printf("null");
		else if (m[i].v == floor(m[i].v) && fabs(m[i].v) < 9e15)
			printf("%.0f", m[i].v);
		else
			printf("%.6g", m[i].v);
	}
}

/* A member object (key NULL: an array element), followed by a comma when `more`. */
#define JOBJ(key, more, ...)                                                                       \
	do {                                                                                       \
		const jv m_[] = {__VA_ARGS__};                                                     \
		const char *k_ = (key);                                                            \
		if (k_)                                                                            \
			printf("\"%s\": ", k_);                                                    \
		printf("{");                                                                       \
		jmembers(m_, sizeof(m_) / sizeof(m_[0]));                                          \
		printf("}%s", (more) ? ", " : "");                                                 \
	} while (0)

static void json_stages(const char *key, const kvt_stats *e, const kvt_stats *s, double div)
{
	JOBJ(key, true, {"index", (double)(e->ns_index - s->ns_index) / 1e6 / div, NULL},
	     {"store", (double)(e->ns_store - s->ns_store) / 1e6 / div, NULL},
	     {"score", (double)(e->ns_score - s->ns_score) / 1e6 / div, NULL},
	     {"select", (double)(e->ns_select - s->ns_select) / 1e6 / div, NULL},
	     {"attend", (double)(e->ns_attend - s->ns_attend) / 1e6 / div, NULL});
}

static void json_per_step(const bench *b)
{
	printf("\"per_step\": [");
	for (uint32_t i = 0; i < b->o.steps; i++) {
		const acc *a = &b->step[i];
		JOBJ(NULL, i + 1 < b->o.steps, {"step", i, NULL},
		     {"recall_mean", a->recall_sum / a->recall_n, NULL},
		     {"recall_min", a->recall_min, NULL},
		     {"budget_mean", a->budget_sum / a->kv_n, NULL},
		     {"oracle_budget_mean", a->oracle_sum / a->kv_n, NULL},
		     {"output_rel_err", sqrt(a->err2 / a->full2), NULL},
		     {"ms_per_layer", (double)a->ns / 1e6 / b->o.layers, NULL});
	}
	printf("]");
}

static void print_json(const bench *b, double wall)
{
	const opts *o = &b->o;
	const kvt_stats *e = &b->st_end;
	const acc *a = &b->all;
	double sl = (double)o->steps * o->layers, ho[3], he[3];
	spread(b, b->head_oracle, ho);
	spread(b, b->head_eff, he);
	const jv top[] = {{"library_version", 0, kvt_version_string()}, {"p", o->p, NULL},
	     {"index_bytes_per_token_head", (double)e->index_bytes_per_token_head, NULL},
	     {"index_overhead", (double)e->index_bytes_per_token_head / (2.0 * b->d * 2), NULL},
	     {"recall_mean", a->recall_sum / a->recall_n, NULL}, {"recall_min", a->recall_min, NULL},
	     {"recall_below_half", (double)a->recall_low / a->recall_n, NULL},
	     {"budget_mean", a->budget_sum / a->kv_n, NULL},
	     {"oracle_budget_mean", a->oracle_sum / a->kv_n, NULL},
	     {"budget_over_oracle", a->budget_sum / a->oracle_sum, NULL},
	     {"output_rel_err", sqrt(a->err2 / a->full2), NULL},
	     {"needles_asked", (double)a->needles, NULL},
	     {"needles_found", (double)a->needles_found, NULL},
	     {"prefill_ms", (double)b->ns_prefill / 1e6, NULL},
	     {"step_ms_per_layer", (double)a->ns / 1e6 / sl, NULL},
	     {"gather_ms_per_layer", (double)b->ns_gather / 1e6 / sl, NULL},
	     {"tokens", (double)e->tokens, NULL}, {"tokens_indexed", (double)e->tokens_indexed, NULL},
	     {"index_bytes", (double)e->index_bytes, NULL},
	     {"host_bytes_used", (double)e->host_bytes_used, NULL},
	     {"host_bytes_capacity", (double)e->host_bytes_capacity, NULL},
	     {"budget_max_hits", (double)e->budget_max_hits, NULL},
	     {"budget_min_hits", (double)e->budget_min_hits, NULL},
	     {"flushes", (double)e->flushes, NULL},
	     {"selected_tokens", (double)e->selected_tokens, NULL},
	     {"candidate_tokens", (double)e->candidate_tokens, NULL},
	     {"rows_fetched", (double)e->rows_fetched, NULL},
	     {"bytes_fetched", (double)e->bytes_fetched, NULL}, {"wall_s", wall, NULL}};
	printf("{");
	jmembers(top, sizeof(top) / sizeof(top[0]));
	printf(", ");
	JOBJ("config", true, {"q_heads", o->q_heads, NULL}, {"kv_heads", o->kv_heads, NULL},
	     {"head_dim", o->head_dim, NULL},
	     {"dtype", 0, o->dtype == KVT_DTYPE_BF16 ? "bf16" : "f16"},
	     {"context", o->context, NULL}, {"steps", o->steps, NULL}, {"layers", o->layers, NULL},
	     {"seqs", o->seqs, NULL}, {"seed", (double)o->seed, NULL},
	     {"backend", 0, e->backend ? e->backend : "?"}, {"chunk", o->chunk, NULL},
	     {"sinks", o->sinks, NULL}, {"window", o->window, NULL}, {"flush", o->flush, NULL},
	     {"budget_min", o->budget_min, NULL}, {"budget_max", o->budget_max, NULL});
	JOBJ("heads", true, {"count", sl / o->steps * o->q_heads, NULL},
	     {"oracle_budget_min", ho[0], NULL}, {"oracle_budget_median", ho[1], NULL},
	     {"oracle_budget_max", ho[2], NULL}, {"eff_tokens_min", he[0], NULL},
	     {"eff_tokens_median", he[1], NULL}, {"eff_tokens_max", he[2], NULL});
	json_stages("stage_ms", e, &(kvt_stats){0}, 1.0);
	json_stages("decode_stage_ms_per_step_layer", e, &b->st_prefill, sl);
	json_per_step(b);
	printf("}\n");
}

static void print_summary(const bench *b, double wall)
{
	const kvt_stats *e = &b->st_end, *s = &b->st_prefill;
	const acc *a = &b->all;
	double sl = (double)b->o.steps * b->o.layers, ho[3], he[3];
	double bud = a->budget_sum / a->kv_n, orc = a->oracle_sum / a->kv_n;
	spread(b, b->head_oracle, ho);
	spread(b, b->head_eff, he);
	printf("index    %" PRIu64 " B per token per KV head = %.2f%% of its K+V bytes (%u B)\n",
	       e->index_bytes_per_token_head,
	       100.0 * (double)e->index_bytes_per_token_head / (4.0 * b->d), 4 * b->d);
	printf("recall   mean %.4f, min %.4f, below 0.5 for %.2f%% of query heads x steps (exact "
	       "softmax mass on the attended tokens)\n", a->recall_sum / a->recall_n, a->recall_min,
	       100.0 * (double)a->recall_low / a->recall_n);
	if (a->kv_n)
		printf("budget   %.4f of the indexed tokens fetched; exact Top-%.3g oracle %.4f "
		       "(x%.2f)\n", bud, b->o.p, orc, bud / orc);
	else
		printf("budget   no token was indexed (context within sinks + window)\n");
	printf("output   relative L2 error %.3e; needles found %" PRIu64 " of %" PRIu64 "\n",
	       sqrt(a->err2 / a->full2), a->needles_found, a->needles);
	printf("heads    oracle share min %.4f, median %.4f, max %.4f; effective tokens "
	       "(exp entropy) min %.0f, median %.0f, max %.0f\n",
	       ho[0], ho[1], ho[2], he[0], he[1], he[2]);
	printf("time     prefill %.0f ms; decode %.2f ms per step per layer (index %.2f, store %.2f, "
	       "score %.2f, select %.2f, attend %.2f)\n",
	       (double)b->ns_prefill / 1e6, (double)a->ns / 1e6 / sl,
	       (double)(e->ns_index - s->ns_index) / 1e6 / sl,
	       (double)(e->ns_store - s->ns_store) / 1e6 / sl,
	       (double)(e->ns_score - s->ns_score) / 1e6 / sl,
	       (double)(e->ns_select - s->ns_select) / 1e6 / sl,
	       (double)(e->ns_attend - s->ns_attend) / 1e6 / sl);
	printf("cache    %" PRIu64 " tokens, %" PRIu64 " indexed, host %.1f of %.1f MiB, budget_max "
	       "hits %" PRIu64 ", flushes %" PRIu64 "; wall %.1f s\n",
	       e->tokens, e->tokens_indexed, (double)e->host_bytes_used / 1048576.0,
	       (double)e->host_bytes_capacity / 1048576.0, e->budget_max_hits, e->flushes, wall);
}

int main(int argc, char **argv)
{
	static bench b;
	parse_args(argc, argv, &b.o);
	uint64_t t0 = now_ns();
	setup(&b);
	prefill(&b);
	decode(&b);
	double wall = (double)(now_ns() - t0) / 1e9;
	if (b.o.json)
		print_json(&b, wall);
	else
		print_summary(&b, wall);
	teardown(&b);
	return 0;
}
