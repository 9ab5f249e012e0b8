/* SPDX-License-Identifier: MIT */
/*
 * What direct serving costs on the disk, in two figures:
 *   chunks         the store's 4 KiB chunk reads (kvt_nvme_read_rows: 8 rows of a 1 MiB block under
 *                  a cached header, batches of 64 x qd requests, the store keeping qd I/Os in
 *                  flight) against a raw io_uring loop of 4 KiB O_DIRECT reads at random 4 KiB
 *                  offsets of the same blocks, at the same queue depth. The two sides alternate,
 *                  --runs times each; the figure is each side's median and the ratio of the
 *                  medians (goal >= 0.9). MB/s counts the bytes each side read from the file.
 *   amplification  a cache with an NVMe tier (CPU backend, 1 layer, 4 KV heads, head_dim 128, f16)
 *                  prefills one sequence, spills it and attends it step after step with queries
 *                  built so that each step asks for 4 of 64 key clusters per KV head and the next
 *                  step keeps 2 of them; the library selects the 1/16 of the tokens with the best
 *                  estimates (p = 1, budget_min = budget_max), about half shared by consecutive
 *                  steps. Per step: the bytes the
 *                  selection needed (attended rows of spilled blocks x 512 B), the part not
 *                  attended the step before, and the NVMe bytes and read I/Os of kvt_stats; the ratio of
 *                  bytes read to bytes needed is the read amplification, for block caches
 *                  (nvme_cache_bytes) of 1/4, 1/2, 3/4 and 5/4 of the spilled rows (the last holds
 *                  them all).
 * Figures and ratios only; nothing is asserted (tests assert behaviour).
 *
 * Usage: nvme_read [--file PATH] [--size BYTES] [--qd N] [--runs N] [--seconds S] [--context N]
 *   defaults: a file kvt-nvme-read-PID.dat in $TMPDIR (or /tmp), created and removed; 256 MiB;
 *   queue depth 32; 5 runs of 1 s per side; context 8192. About 20 s in all.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host/alloc.h"
#include "kvtier.h"
#include "lib/half.h"
#include "nvme_util.h"

typedef struct args {
	char path[PATH_MAX];
	uint64_t size, context;
	uint32_t qd, runs;
	double seconds;
	bool given; /* --file: left in place; else a scratch file that must not exist yet */
} args;

/* ---- options ----------------------------------------------------------------------------- */

static _Noreturn void bad(const char *flag, const char *val, const char *want)
{
	fprintf(stderr, "nvme_read: %s %s: expected %s\n", flag, val, want);
	fprintf(stderr, "usage: nvme_read [--file PATH] [--size BYTES] [--qd N] [--runs N] "
			"[--seconds S] [--context N]\n");
	exit(2);
}

static uint64_t num(const char *flag, const char *val, uint64_t lo, uint64_t hi, const char *want)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(val, &end, 0);
	int shift = !*end ? 0 : strchr("kK", *end) ? 10 : strchr("mM", *end) ? 20
		  : strchr("gG", *end) ? 30 : -1;
	if (shift > 0 && !end[1])
		end++;
	if (errno || end == val || *end || *val == '-' || shift < 0 || v > (hi >> shift) ||
	    (v << shift) < lo)
		bad(flag, val, want);
	return v << shift;
}

static void parse(int argc, char **argv, args *a)
{
	const char *tmp = getenv("TMPDIR");
	*a = (args){.size = 256 * MIB, .context = 8192, .qd = 32, .runs = 5, .seconds = 1.0};
	snprintf(a->path, sizeof a->path, "%s/kvt-nvme-read-%d.dat", tmp && *tmp ? tmp : "/tmp",
		 (int)getpid());
	for (int i = 1; i < argc; i += 2) {
		const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
		if (i + 1 >= argc)
			bad(f, "(missing)", "a value");
		if (!strcmp(f, "--file")) {
			if (!*v || strlen(v) >= sizeof a->path)
				bad(f, v, "a path of 1 to PATH_MAX - 1 bytes");
			snprintf(a->path, sizeof a->path, "%s", v);
			a->given = true;
		}
		else if (!strcmp(f, "--size"))
			a->size = num(f, v, 64 * MIB, 1ull << 40,
				      "bytes in [64 MiB, 1 TiB], with an optional K, M or G suffix");
		else if (!strcmp(f, "--qd"))
			a->qd = (uint32_t)num(f, v, 1, KVT_NVME_MAX_QD, "a queue depth in [1, 1024]");
		else if (!strcmp(f, "--runs"))
			a->runs = (uint32_t)num(f, v, 1, 101, "runs in [1, 101]");
		else if (!strcmp(f, "--context"))
			a->context = num(f, v, 1024, 1 << 20, "tokens in [1024, 1048576]");
		else if (!strcmp(f, "--seconds")) {
			char *end;
			a->seconds = strtod(v, &end);
			if (end == v || *end || !(a->seconds >= 0.05 && a->seconds <= 600))
				bad(f, v, "seconds in [0.05, 600]");
		} else
			bad(f, v, "an option among --file, --size, --qd, --runs, --seconds, --context");
	}
}

static int cmp_dbl(const void *x, const void *y)
{
	double a = *(const double *)x, b = *(const double *)y;
	return (a > b) - (a < b);
}

static double median(double *v, uint32_t n)
{
	qsort(v, n, sizeof *v, cmp_dbl);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- chunk reads against raw io_uring ---------------------------------------------------- */

/* One side's runs: reads per second and bytes per second read from the file. */
typedef struct side {
	double *iops, *bps;
} side;

static void chunk_figure(const args *a)
{
	const char *paths[1] = {a->path};
	struct kvt_nvme_config cfg = {paths, &a->size, 1, a->qd, (uint32_t)MIB, 0};
	struct kvt_nvme *st;
	int rc = kvt_nvme_open(&cfg, &st, &bench_err);
	if (rc)
		bench_die("open", rc, bench_err.msg);
	printf("store: %s\n", kvt_nvme_status(st));
	/* 1 MiB blocks over seven eighths of the file */
	struct kvt_nvme_block_id shape = bench_block_fitting(st, MIB);
	uint32_t n = (uint32_t)(a->size / 8 * 7 / MIB), n_off = n * (uint32_t)(MIB / 4096);
	struct kvt_nvme_loc *locs = calloc(n, sizeof *locs);
	struct kvt_nvme_block_id *ids = calloc(n, sizeof *ids);
	uint64_t *offs = calloc(n_off, sizeof *offs);
	unsigned char *out = kvt_mem_alloc(KVT_MEM_PAGES, BENCH_N_OUT * 4096);
	side s = {calloc(a->runs, sizeof(double)), calloc(a->runs, sizeof(double))};
	side r = {calloc(a->runs, sizeof(double)), calloc(a->runs, sizeof(double))};
	if (!locs || !ids || !offs || !out || !s.iops || !s.bps || !r.iops || !r.bps)
		bench_die("allocation", -ENOMEM, "out of memory");
	memset(out, 0, BENCH_N_OUT * 4096);
	fprintf(stderr, "nvme_read: writing %u blocks of 1 MiB\n", n);
	bench_fill(st, n, shape, locs, ids);
	for (uint32_t i = 0; i < n_off; i++)
		offs[i] = locs[i / (MIB / 4096)].offset + (uint64_t)(i % (MIB / 4096)) * 4096;
	double t;
	/* headers into the store's cache, and the device past its first touches, before any timing */
	bench_store_loop(st, locs, ids, n, 1, 1, 64 * a->qd, 0.2, &t, out);
	bench_raw_loop(a->path, a->qd, 4096, offs, n_off, 1, 0.2, &t);
	for (uint32_t run = 0; run < a->runs; run++) {
		fprintf(stderr, "nvme_read: chunk reads, run %u of %u\n", run + 1, a->runs);
		double ops = (double)bench_raw_loop(a->path, a->qd, 4096, offs, n_off, 1, a->seconds,
						   &t);
		r.iops[run] = ops / t;
		r.bps[run] = ops * 4096 / t;
		struct kvt_nvme_stats s0, s1;
		kvt_nvme_get_stats(st, &s0);
		ops = (double)bench_store_loop(st, locs, ids, n, 1, 1, 64 * a->qd, a->seconds, &t, out);
		kvt_nvme_get_stats(st, &s1);
		s.iops[run] = ops / t;
		s.bps[run] = (double)(s1.bytes_read - s0.bytes_read) / t;
	}
	double si = median(s.iops, a->runs), ri = median(r.iops, a->runs);
	double sb = median(s.bps, a->runs), rb = median(r.bps, a->runs);
	printf("chunk reads, 4 KiB at random offsets, queue depth %u, median of %u runs of %.2g s "
	       "per side:\n", a->qd, a->runs, a->seconds);
	printf("  store kvt_nvme_read_rows (8 rows, cached header, %u per call): %8.1f K IOPS "
	       "%8.1f MB/s\n", 64 * a->qd, si / 1e3, sb / 1e6);
	printf("  raw io_uring, O_DIRECT, registered buffers and file:         %8.1f K IOPS "
	       "%8.1f MB/s\n", ri / 1e3, rb / 1e6);
	printf("  ratio store / raw: %.3f IOPS, %.3f MB/s (goal >= 0.9)\n", si / ri, sb / rb);
	kvt_nvme_close(st);
	kvt_mem_free(KVT_MEM_PAGES, out, BENCH_N_OUT * 4096);
	free(locs);
	free(ids);
	free(offs);
	free(s.iops);
	free(s.bps);
	free(r.iops);
	free(r.bps);
}

/* ---- read amplification of a selection pattern ------------------------------------------- */

enum { KVH = 4, D = 128, CLUSTERS = 64, PICK = 4, KEEP = 2, WARM = 2, STEPS = 12 };
#define AMP 16.0f /* key and query length along a cluster: in-cluster logits 16 x 16 / sqrt(D) */

/* The synthetic sequence: per KV head CLUSTERS orthonormal directions, each token's cluster. */
typedef struct pattern {
	uint32_t ctx;
	float u[KVH][CLUSTERS][D];
	uint8_t *cluster;       /* [KVH, ctx] */
	uint32_t pick[KVH][PICK]; /* the clusters the current step asks for */
	uint64_t rng;
} pattern;

static float gauss(uint64_t *s)
{
	double u1 = ((double)(bench_rng(s) >> 11) + 0.5) / 9007199254740992.0;
	double u2 = (double)(bench_rng(s) >> 11) / 9007199254740992.0;
	return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Gram-Schmidt of random vectors: clusters that do not leak into each other's scores. */
static void directions(pattern *p)
{
	for (int h = 0; h < KVH; h++)
		for (int g = 0; g < CLUSTERS; g++) {
			float *v = p->u[h][g];
			for (int j = 0; j < D; j++)
				v[j] = gauss(&p->rng);
			for (int o = 0; o < g; o++) {
				float dot = 0;
				for (int j = 0; j < D; j++)
					dot += v[j] * p->u[h][o][j];
				for (int j = 0; j < D; j++)
					v[j] -= dot * p->u[h][o][j];
			}
			float n = 0;
			for (int j = 0; j < D; j++)
				n += v[j] * v[j];
			for (int j = 0; j < D; j++)
				v[j] /= sqrtf(n);
		}
}

/* K (cluster direction x AMP plus noise of 0.3 per element) and V (N(0,1)) of tokens [t0, t0+n),
 * [n, KVH, D] f16 each. */
static void kv_chunk(pattern *p, uint32_t t0, uint32_t n, uint16_t *k, uint16_t *v)
{
	for (uint32_t t = 0; t < n; t++)
		for (int h = 0; h < KVH; h++) {
			const float *u = p->u[h][p->cluster[(size_t)h * p->ctx + t0 + t]];
			size_t o = ((size_t)t * KVH + h) * D;
			for (int j = 0; j < D; j++) {
				k[o + j] = kvt_f32_to_f16(AMP * u[j] + 0.3f * gauss(&p->rng));
				v[o + j] = kvt_f32_to_f16(gauss(&p->rng));
			}
		}
}

static bool picked(const uint32_t *set, uint32_t n, uint32_t g)
{
	for (uint32_t i = 0; i < n; i++)
		if (set[i] == g)
			return true;
	return false;
}

/* The next step's clusters: KEEP of the current ones (all of them at the first step: none
 * chosen yet), the others new. Then the query, [KVH, D] f16 (MHA: one query head per KV head). */
static void next_query(pattern *p, bool first, uint16_t *q)
{
	for (int h = 0; h < KVH; h++) {
		uint32_t *s = p->pick[h], keep = first ? 0 : KEEP, old[PICK];
		memcpy(old, s, sizeof old);
		for (uint32_t i = 0; i < keep; i++) { /* the kept ones to the front, drawn at random */
			uint32_t j = i + (uint32_t)(bench_rng(&p->rng) % (PICK - i)), x = s[i];
			s[i] = s[j];
			s[j] = x;
		}
		for (uint32_t i = keep; i < PICK; i++) {
			uint32_t g;
			do
				g = (uint32_t)(bench_rng(&p->rng) % CLUSTERS);
			while (picked(s, i, g) || picked(old, first ? 0 : PICK, g));
			s[i] = g;
		}
		for (int j = 0; j < D; j++) {
			float x = 0;
			for (int i = 0; i < PICK; i++)
				x += AMP * p->u[h][s[i]][j];
			q[h * D + j] = kvt_f32_to_f16(x);
		}
	}
}

static _Noreturn void lib_die(kvt_cache *c, int rc, const char *what)
{
	char d[512];
	snprintf(d, sizeof d, "%s", kvt_last_error(c));
	bench_die(what, rc, d);
}

/* What the measured steps of one cache size came to. */
typedef struct amp {
	double need, fresh, read, reads, hits, misses, overlap, chunks;
} amp;

/* The attended rows of spilled blocks of the step just taken: bytes needed, those not attended the
 * step before (prev: [KVH, ctx] marks, updated), the 4 KiB chunks they lie in, and how many of the
 * selected (indexed) positions were selected the step before. */
static void account(kvt_cache *c, const pattern *p, uint32_t spilled_end, uint8_t *prev,
		    int32_t *pos, amp *m, double *sel)
{
	int32_t counts[KVH];
	uint32_t seq = 0;
	int rc = kvt_gather(c, 0, 1, &seq, p->ctx, counts, pos, NULL, NULL, NULL);
	if (rc < 0)
		lib_die(c, rc, "kvt_gather");
	uint8_t *now = prev + (size_t)KVH * p->ctx;
	memset(now, 0, (size_t)KVH * p->ctx);
	for (int h = 0; h < KVH; h++) {
		int64_t last_chunk = -1;
		for (int32_t i = 0; i < counts[h]; i++) {
			uint32_t t = (uint32_t)pos[(size_t)h * p->ctx + (size_t)i];
			now[(size_t)h * p->ctx + t] = 1;
			if (t >= spilled_end)
				continue;
			m->need += ROW_BYTES;
			m->fresh += prev[(size_t)h * p->ctx + t] ? 0 : ROW_BYTES;
			m->overlap += prev[(size_t)h * p->ctx + t];
			*sel += 1;
			m->chunks += (int64_t)(t / 8) != last_chunk;
			last_chunk = t / 8;
		}
	}
	memcpy(prev, now, (size_t)KVH * p->ctx);
}

static kvt_cache *make_cache(const char *path, uint64_t ctx, uint64_t cache_bytes)
{
	static uint64_t nvme_bytes;
	const char *paths[1] = {path};
	uint64_t kv = ctx * KVH * ROW_BYTES;
	nvme_bytes = (kv / 4 * 5 + 16 * MIB + MIB - 1) / MIB * MIB;
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	cfg.n_q_heads = cfg.n_kv_heads = KVH;
	cfg.head_dim = D;
	cfg.out_dtype = KVT_DTYPE_F32;
	cfg.backend = KVT_BACKEND_CPU;
	cfg.host_bytes = kv + 16 * MIB;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = &nvme_bytes;
	cfg.n_nvme = 1;
	cfg.nvme_cache_bytes = cache_bytes;
	/* Top-k of the estimate, k = the asked clusters' tokens on average: the selection is the
	 * clusters whatever the spread of the estimates inside one (Top-p would keep a varying part) */
	cfg.p = 1.0f;
	cfg.budget_min = cfg.budget_max = (uint32_t)(ctx * PICK / CLUSTERS);
	kvt_cache *c;
	int rc = kvt_cache_create(&cfg, &c);
	if (rc < 0)
		lib_die(NULL, rc, "kvt_cache_create");
	return c;
}

static kvt_stats stats(kvt_cache *c)
{
	kvt_stats s = {.size = sizeof s};
	int rc = kvt_get_stats(c, &s);
	if (rc < 0)
		lib_die(c, rc, "kvt_get_stats");
	return s;
}

/* Prefill the sequence in chunks of 4096 tokens, then spill it. Returns where spilled rows end. */
static uint32_t fill_and_spill(kvt_cache *c, pattern *p, uint16_t *k, uint16_t *v)
{
	uint32_t seq;
	int rc = kvt_seq_open(c, &seq);
	if (rc < 0)
		lib_die(c, rc, "kvt_seq_open");
	for (uint32_t t = 0; t < p->ctx; t += 4096) {
		uint32_t n = p->ctx - t < 4096 ? p->ctx - t : 4096;
		kv_chunk(p, t, n, k, v);
		if ((rc = kvt_prefill(c, seq, 0, NULL, k, v, n, NULL)) < 0)
			lib_die(c, rc, "kvt_prefill");
	}
	int64_t moved = kvt_seq_spill(c, seq);
	if (moved < 0)
		lib_die(c, (int)moved, "kvt_seq_spill");
	/* full 256-token blocks of sinks and indexed tokens go; the window's stay (kvtier.h) */
	uint32_t spilled_end = (p->ctx - KVT_DEFAULT_WINDOW) / 256 * 256;
	if ((uint64_t)moved != (uint64_t)spilled_end * KVH * ROW_BYTES)
		bench_die("kvt_seq_spill", -EIO, "moved other bytes than the full blocks before the window");
	return spilled_end;
}

static amp one_cache_size(const args *a, uint64_t cache_bytes, uint64_t seed)
{
	pattern *p = calloc(1, sizeof *p);
	uint32_t ctx = (uint32_t)a->context;
	size_t chunk = (size_t)4096 * KVH * D;
	uint16_t *k = malloc(chunk * 2), *v = malloc(chunk * 2), q[KVH * D];
	float out[KVH * D];
	int32_t *pos = malloc((size_t)KVH * ctx * sizeof(int32_t));
	uint8_t *marks = calloc(2, (size_t)KVH * ctx);
	if (!p || !k || !v || !pos || !marks || !(p->cluster = malloc((size_t)KVH * ctx)))
		bench_die("allocation", -ENOMEM, "out of memory");
	p->ctx = ctx;
	p->rng = seed;
	directions(p);
	for (size_t i = 0; i < (size_t)KVH * ctx; i++)
		p->cluster[i] = (uint8_t)(bench_rng(&p->rng) % CLUSTERS);
	kvt_cache *c = make_cache(a->path, ctx, cache_bytes);
	uint32_t spilled_end = fill_and_spill(c, p, k, v), seq = 0;
	amp m = {0}, skip = {0};
	double sel = 0, skip_sel = 0;
	kvt_stats s0 = {0};
	for (int step = 0; step < WARM + STEPS; step++) {
		if (step == WARM)
			s0 = stats(c);
		next_query(p, step == 0, q);
		int rc = kvt_attend(c, 0, 1, &seq, q, out, NULL);
		if (rc < 0)
			lib_die(c, rc, "kvt_attend");
		account(c, p, spilled_end, marks, pos, step < WARM ? &skip : &m,
			step < WARM ? &skip_sel : &sel);
	}
	kvt_stats s1 = stats(c);
	m.read = (double)(s1.nvme_bytes_read - s0.nvme_bytes_read);
	m.reads = (double)(s1.nvme_reads - s0.nvme_reads);
	m.hits = (double)(s1.nvme_cache_hits - s0.nvme_cache_hits);
	m.misses = (double)(s1.nvme_cache_misses - s0.nvme_cache_misses);
	m.overlap = sel > 0 ? m.overlap / sel : NAN;
	kvt_cache_destroy(c);
	free(p->cluster);
	free(p);
	free(k);
	free(v);
	free(pos);
	free(marks);
	return m;
}

static void amplification(const args *a)
{
	static const uint32_t quarters[] = {1, 2, 3, 5};
	enum { N_SIZES = sizeof quarters / sizeof quarters[0] };
	uint64_t spilled = (a->context - KVT_DEFAULT_WINDOW) / 256 * 256 * KVH * ROW_BYTES, sizes[N_SIZES];
	for (uint32_t i = 0; i < N_SIZES; i++) /* whole MiB, at least the library's 1 MiB */
		sizes[i] = (spilled * quarters[i] / 4 + MIB - 1) / MIB * MIB;
	printf("read amplification: 1 sequence of %llu tokens, 1 layer, %d KV heads, head_dim %d, "
	       "spilled; each step asks for %d of %d key clusters per head (Top-%llu of the estimate), "
	       "the next keeps %d; %d steps measured after %d; spilled rows %.1f MiB; per step:\n",
	       (unsigned long long)a->context, KVH, D, PICK, CLUSTERS,
	       (unsigned long long)(a->context * PICK / CLUSTERS), KEEP, STEPS, WARM,
	       (double)spilled / MIB);
	printf("  bcache MiB  chunks MiB  overlap  needed KiB  new KiB  read KiB  reads  "
	       "bcache_hit  read/needed  read/new\n");
	for (uint32_t i = 0; i < N_SIZES; i++) {
		fprintf(stderr, "nvme_read: amplification, block cache %llu MiB (%u of %u)\n",
			(unsigned long long)(sizes[i] / MIB), i + 1, (unsigned)N_SIZES);
		amp m = one_cache_size(a, sizes[i], 42); /* the same queries for every size */
		double n = STEPS;
		printf("  %10.0f %11.1f %8.3f %11.1f %8.1f %9.1f %6.0f %11.4f %12.2f %9.2f\n",
		       (double)sizes[i] / MIB, m.chunks * 4096 / n / MIB, m.overlap, m.need / n / 1024,
		       m.fresh / n / 1024, m.read / n / 1024, m.reads / n,
		       m.hits + m.misses > 0 ? m.hits / (m.hits + m.misses) : NAN, m.read / m.need,
		       m.read / m.fresh);
	}
	printf("  (chunks: the 4 KiB chunks holding a step's attended spilled rows; overlap: share "
	       "of the selected spilled rows attended the step before; read: kvt_stats "
	       "nvme_bytes_read, headers included)\n");
}

int main(int argc, char **argv)
{
	bench_name = "nvme_read";
	args a;
	parse(argc, argv, &a);
	struct kvt_err why;
	if (!kvt_nvme_available(&why)) {
		printf("nvme_read: skipped: %s\n", why.msg);
		return 77;
	}
	/* A file this run creates is removed at the end (the store and the cache remove the files
	 * they created); one given is left in place. */
	if (!a.given && access(a.path, F_OK) == 0)
		bench_die("scratch file", -EEXIST, a.path);
	printf("nvme_read: %s, %llu MiB, queue depth %u\n", a.path,
	       (unsigned long long)(a.size / MIB), a.qd);
	chunk_figure(&a);
	amplification(&a);
	return 0;
}
