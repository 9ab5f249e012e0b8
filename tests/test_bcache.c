/* SPDX-License-Identifier: MIT */
/*
 * The block cache of direct serving (lib/bcache.c) driven step by step through the internal calls
 * the backends use (kvt_rows_round, kvt_rows_get, the prefetch), on sequences spilled to NVMe:
 *   - a loop of steps whose working set is 1.5 times the cache gets hits in every step after the
 *     first (a clock or LRU gets none: each chunk is evicted just before it is needed again);
 *   - a one-step scan larger than the cache does not flush a working set that the next step reuses;
 *   - the prefetch reads every miss of a step before its kvt_rows_get calls, which then read
 *     nothing; a step that does not fit prefetches what fits and still succeeds;
 *   - a prefetch that fails (each completion failed in turn, each allocation failed in turn) returns
 *     the error or succeeds, changes no row and loses nothing: the step's calls then serve every
 *     row, byte for byte, and nothing leaks;
 *   - work beside the prefetch's reads (kvt_rows_prefetch_idle) serves cached chunks, never one
 *     being read, and leaves the hits, misses and reads as they were; with faults, as above.
 * Every row returned is compared with the rows prefilled. Exits 77 (skip) without io_uring.
 */
#include "common.h"

#include "tier_util.h"

enum { D = 64, NKV = 2, NQ = 2, LAYERS = 2, NS = 3, T = 1300 };
#define ROW_BYTES (2u * D * 2u)
#define PER_CHUNK (KVT_NVME_CHUNK / ROW_BYTES)

static uint16_t g_k[NS][LAYERS][T * NKV * D], g_v[NS][LAYERS][T * NKV * D];
static const void *g_rows[T];
static int32_t g_pos[T];

struct bworld {
	kvt_cache *c;
	tt_files f;
	uint32_t seqs[NS];
	int64_t live;
	int fds;
};

static struct kvt_layer *layer_of(struct bworld *w, uint32_t s, uint32_t l)
{
	return &w->c->seqs[w->seqs[s]].layers[l];
}

static void bw_open(struct bworld *w, uint64_t cache_bytes)
{
	w->live = kvt_mem_live();
	w->fds = t_fd_count();
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	tt_make_files(&w->f, 1, (uint64_t)16 << 20);
	cfg.nvme_paths = w->f.ptrs;
	cfg.nvme_bytes = w->f.bytes;
	cfg.n_nvme = 1;
	cfg.nvme_cache_bytes = cache_bytes;
	w->c = t_create(&cfg);
	tt_unlink(&w->f);
	t_rng r;
	t_rng_seed(&r, 0xbcac4e01u);
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(kvt_seq_open(w->c, &w->seqs[s]) == 0, "seq_open: %s", kvt_last_error(w->c));
		for (uint32_t l = 0; l < LAYERS; l++) {
			t_fill(&r, KVT_DTYPE_F16, T * NKV * D, 0.3, 1.0, g_k[s][l], NULL);
			t_fill(&r, KVT_DTYPE_F16, T * NKV * D, -0.2, 1.0, g_v[s][l], NULL);
			int rc = kvt_prefill(w->c, w->seqs[s], l, NULL, g_k[s][l], g_v[s][l], T, NULL);
			T_CHECK(rc == 0, "prefill seq %u layer %u: %s", s, l, kvt_last_error(w->c));
		}
		int64_t moved = kvt_seq_spill(w->c, w->seqs[s]);
		T_CHECK(moved > 0, "spill seq %u: got %lld (%s)", s, (long long)moved,
			kvt_last_error(w->c));
	}
}

static void bw_close(struct bworld *w, const char *name)
{
	kvt_cache_destroy(w->c);
	TT_CHECK_RELEASED(name, w->live, w->fds);
}

/* Positions [first, first + n) (all rows of their chunks when first and n are multiples of 16). */
static uint32_t span(uint32_t first, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		g_pos[i] = (int32_t)(first + i);
	return n;
}

/* kvt_rows_get of n positions of (s, l, h), every row compared with the prefilled K and V. */
static void get_rows(struct bworld *w, uint32_t s, uint32_t l, uint32_t h, uint32_t n,
		     const char *what)
{
	int rc = kvt_rows_get(w->c, layer_of(w, s, l), h, n, g_pos, g_rows);
	T_CHECK(rc == 0, "%s: kvt_rows_get seq %u layer %u head %u (%u rows): got %d (%s), wanted 0",
		what, s, l, h, n, rc, kvt_last_error(w->c));
	for (uint32_t i = 0; i < n; i++) {
		size_t at = ((size_t)g_pos[i] * NKV + h) * D;
		const char *row = (const char *)g_rows[i];
		T_CHECK(!memcmp(row, &g_k[s][l][at], D * 2) && !memcmp(row + D * 2, &g_v[s][l][at], D * 2),
			"%s: seq %u layer %u head %u row %d differs from the row prefilled", what, s, l,
			h, g_pos[i]);
	}
}

/* Which (sequence, KV head)s of one layer a step reads: [s0, s1) x [h0, h1), `rows` rows from
 * `first`. */
struct items {
	uint32_t layer, s0, s1, h0, h1, first, rows;
};

/* The round of a step over the items, and (plan) the prefetch planned: begin and every add. */
static void begin_step(struct bworld *w, const struct items *it, bool plan)
{
	struct kvt_layer *ls[NS];
	for (uint32_t s = it->s0; s < it->s1; s++)
		ls[s - it->s0] = layer_of(w, s, it->layer);
	kvt_rows_round(w->c, it->s1 - it->s0, ls);
	if (!plan)
		return;
	kvt_rows_prefetch_begin(w->c);
	for (uint32_t s = it->s0; s < it->s1; s++)
		for (uint32_t h = it->h0; h < it->h1; h++)
			kvt_rows_prefetch_add(w->c, ls[s - it->s0], h, span(it->first, it->rows),
					      g_pos);
}

/* The step's kvt_rows_get calls, every row checked. */
static void get_items(struct bworld *w, const struct items *it, const char *what)
{
	for (uint32_t s = it->s0; s < it->s1; s++)
		for (uint32_t h = it->h0; h < it->h1; h++)
			get_rows(w, s, it->layer, h, span(it->first, it->rows), what);
}

/* One decode step over sequences [s0, s1), every layer and head reading `rows` rows from `first`;
 * with prefetch, the step's misses are read ahead. Returns the hits of the step. */
static uint64_t step(struct bworld *w, uint32_t s0, uint32_t s1, uint32_t first, uint32_t rows,
		     bool prefetch, const char *what)
{
	uint64_t h0 = t_stats(w->c).nvme_cache_hits;
	for (uint32_t l = 0; l < LAYERS; l++) {
		const struct items it = {l, s0, s1, 0, NKV, first, rows};
		begin_step(w, &it, prefetch);
		int rc = prefetch ? kvt_rows_prefetch(w->c) : 0;
		T_CHECK(rc == 0, "%s: prefetch got %d (%s), wanted 0", what, rc, kvt_last_error(w->c));
		get_items(w, &it, what);
	}
	return t_stats(w->c).nvme_cache_hits - h0;
}

/* 1 MiB = 256 chunks; a step reads 2 seqs x 2 layers x 2 heads x 48 chunks = 384 = 1.5 x that. */
static void test_loop_larger_than_cache(void **state)
{
	(void)state;
	tt_skip_unless_available();
	for (int pf = 0; pf < 2; pf++) {
		struct bworld w;
		bw_open(&w, (uint64_t)1 << 20);
		uint64_t hits[6];
		for (int k = 0; k < 6; k++)
			hits[k] = step(&w, 0, 2, 0, 48 * PER_CHUNK, pf, "loop");
		print_message("loop of 384 chunks through 256 slots%s: hits per step %llu %llu %llu "
			      "%llu %llu %llu\n", pf ? " (prefetch)" : "", (unsigned long long)hits[0],
			      (unsigned long long)hits[1], (unsigned long long)hits[2],
			      (unsigned long long)hits[3], (unsigned long long)hits[4],
			      (unsigned long long)hits[5]);
		T_CHECK(hits[0] == 0, "loop: the first step got %llu hits, wanted 0",
			(unsigned long long)hits[0]);
		for (int k = 1; k < 6; k++)
			T_CHECK(hits[k] >= 128, "loop%s step %d: got %llu hits, wanted >= 128 (half the "
				"cache: the chunks the previous step used are kept)",
				pf ? " with prefetch" : "", k, (unsigned long long)hits[k]);
		bw_close(&w, "loop");
	}
}

/* A working set of 96 chunks reused every step; one step scans 2 x 2 x 2 x 80 = 640 chunks of other
 * sequences (2.5 x the cache); the next step finds its 96 chunks still there. */
static void test_scan_keeps_working_set(void **state)
{
	(void)state;
	tt_skip_unless_available();
	for (int pf = 0; pf < 2; pf++) {
		struct bworld w;
		bw_open(&w, (uint64_t)1 << 20);
		step(&w, 0, 1, 0, 24 * PER_CHUNK, pf, "working set");
		uint64_t before = step(&w, 0, 1, 0, 24 * PER_CHUNK, pf, "working set");
		step(&w, 1, 3, 0, 80 * PER_CHUNK, pf, "scan");
		uint64_t after = step(&w, 0, 1, 0, 24 * PER_CHUNK, pf, "working set after the scan");
		print_message("scan%s: working set hits %llu before, %llu after a scan of 640 chunks\n",
			      pf ? " (prefetch)" : "", (unsigned long long)before,
			      (unsigned long long)after);
		T_CHECK(before == 96 && after == 96, "scan%s: working set of 96 chunks got %llu hits "
			"before and %llu after the scan, wanted 96 and 96", pf ? " with prefetch" : "",
			(unsigned long long)before, (unsigned long long)after);
		bw_close(&w, "scan");
	}
}

/* Everything fits: the prefetch reads every chunk of the step, the step's calls read nothing. */
static void test_prefetch_reads_ahead(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct bworld w;
	bw_open(&w, (uint64_t)4 << 20);
	const struct items it = {0, 0, NS, 0, NKV, 0, 80 * PER_CHUNK};
	begin_step(&w, &it, true);
	kvt_stats a = t_stats(w.c);
	T_CHECK(kvt_rows_prefetch(w.c) == 0, "prefetch: %s", kvt_last_error(w.c));
	kvt_stats b = t_stats(w.c);
	get_items(&w, &it, "after the prefetch");
	kvt_stats e = t_stats(w.c);
	T_CHECK(b.nvme_cache_misses - a.nvme_cache_misses == NS * NKV * 80 &&
			e.nvme_cache_misses == b.nvme_cache_misses && e.nvme_reads == b.nvme_reads &&
			e.nvme_cache_hits == b.nvme_cache_hits,
		"prefetch of 480 chunks: misses +%llu by the prefetch (wanted 480), then misses +%llu, "
		"reads +%llu, hits +%llu by the step's calls (wanted 0, 0, 0)",
		(unsigned long long)(b.nvme_cache_misses - a.nvme_cache_misses),
		(unsigned long long)(e.nvme_cache_misses - b.nvme_cache_misses),
		(unsigned long long)(e.nvme_reads - b.nvme_reads),
		(unsigned long long)(e.nvme_cache_hits - b.nvme_cache_hits));
	bw_close(&w, "prefetch reads ahead");
}

/* Three items of 200 chunks each through 256 slots: the prefetch reads what fits, each call still
 * succeeds (it takes pinned slots it does not need before failing). */
static void test_prefetch_what_fits(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct bworld w;
	bw_open(&w, (uint64_t)1 << 20);
	const struct items it = {1, 0, NS, 1, 2, 0, 75 * PER_CHUNK};
	for (int k = 0; k < 3; k++) {
		begin_step(&w, &it, true);
		T_CHECK(kvt_rows_prefetch(w.c) == 0, "prefetch of what fits: %s", kvt_last_error(w.c));
		get_items(&w, &it, "a step larger than the cache");
	}
	bw_close(&w, "prefetch what fits");
}

/* Serving chunks while the prefetch reads: each call serves one ready chunk not yet served (its
 * rows through kvt_rows_get, compared) and counts the chunks not ready. */
struct idle_serve {
	struct bworld *w;
	const struct items *it;
	bool served[NS][NKV][64];
	uint32_t in_idle, not_ready, calls;
};

static int serve_ready(void *arg)
{
	struct idle_serve *x = arg;
	const struct items *it = x->it;
	bool more = false, did = false;
	x->calls++;
	for (uint32_t s = it->s0; s < it->s1; s++)
		for (uint32_t h = it->h0; h < it->h1; h++)
			for (uint32_t k = 0; k < it->rows / PER_CHUNK; k++) {
				if (x->served[s][h][k])
					continue;
				const uint32_t first = it->first + k * PER_CHUNK;
				if (!kvt_rows_ready(x->w->c, layer_of(x->w, s, it->layer), h,
						    (int32_t)first)) {
					x->not_ready++;
					more = true;
				} else if (!did) {
					get_rows(x->w, s, it->layer, h, span(first, PER_CHUNK),
						 "served while the prefetch reads");
					x->served[s][h][k] = did = true;
					x->in_idle++;
				} else {
					more = true;
				}
			}
	return more;
}

/* The step's prefetch, with serve_ready beside its reads when `idle` (x: what it served). */
static int prefetch_serving(struct bworld *w, const struct items *it, bool idle,
			    struct idle_serve *x)
{
	memset(x, 0, sizeof *x);
	x->w = w;
	x->it = it;
	const struct kvt_nvme_idle work = {serve_ready, x};
	return idle ? kvt_rows_prefetch_idle(w->c, &work) : kvt_rows_prefetch(w->c);
}

/* The same step with and without work beside the prefetch's reads: the work serves the chunks
 * that were cached (never one being read: every row compared), the rest is served after, and the
 * counts of hits, misses and reads are the plain prefetch's. */
static void test_prefetch_idle(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_stats d[2];
	const struct items it = {0, 0, NS, 0, NKV, 0, 40 * PER_CHUNK};
	for (int idle = 0; idle < 2; idle++) {
		struct bworld w;
		bw_open(&w, (uint64_t)2 << 20);
		step(&w, 0, 1, 0, 16 * PER_CHUNK, false, "warm"); /* seq 0's first 16 chunks cached */
		kvt_stats a = t_stats(w.c);
		begin_step(&w, &it, true);
		static struct idle_serve x;
		int rc = prefetch_serving(&w, &it, idle, &x);
		T_CHECK(rc == 0, "prefetch (idle work %d): %s", idle, kvt_last_error(w.c));
		for (uint32_t s = it.s0; s < it.s1; s++)
			for (uint32_t h = it.h0; h < it.h1; h++)
				for (uint32_t k = 0; k < it.rows / PER_CHUNK; k++)
					if (!x.served[s][h][k])
						get_rows(&w, s, it.layer, h,
							 span(it.first + k * PER_CHUNK, PER_CHUNK),
							 "served after the prefetch");
		if (idle)
			T_CHECK(x.in_idle >= 1 && x.not_ready >= 1,
				"idle work: %u calls served %u chunks and found %u not ready; wanted "
				"some of each",
				x.calls, x.in_idle, x.not_ready);
		kvt_stats b = t_stats(w.c);
		d[idle] = (kvt_stats){.nvme_cache_hits = b.nvme_cache_hits - a.nvme_cache_hits,
				      .nvme_cache_misses = b.nvme_cache_misses - a.nvme_cache_misses,
				      .nvme_reads = b.nvme_reads - a.nvme_reads};
		if (idle)
			print_message("prefetch with idle work: %u calls served %u of %u chunks while "
				      "the reads ran\n",
				      x.calls, x.in_idle, NS * NKV * 40);
		bw_close(&w, idle ? "prefetch with idle work" : "prefetch");
	}
	T_CHECK(d[0].nvme_cache_hits == d[1].nvme_cache_hits &&
			d[0].nvme_cache_misses == d[1].nvme_cache_misses &&
			d[0].nvme_reads == d[1].nvme_reads,
		"hits / misses / reads: %llu / %llu / %llu plain, %llu / %llu / %llu with idle work",
		(unsigned long long)d[0].nvme_cache_hits, (unsigned long long)d[0].nvme_cache_misses,
		(unsigned long long)d[0].nvme_reads, (unsigned long long)d[1].nvme_cache_hits,
		(unsigned long long)d[1].nvme_cache_misses, (unsigned long long)d[1].nvme_reads);
}

struct fault {
	uint64_t n;
	int fired;
};

static int fail_nth(void *ctx, uint64_t nth, int res)
{
	struct fault *f = (struct fault *)ctx;
	if (nth != f->n)
		return res;
	f->fired = 1;
	return -EIO;
}

/* A prefetch failing at completion n (io) or allocation n: the error or success, then the step
 * serves every row. Returns whether the fault was reached. */
static int faulty_prefetch(uint64_t n, bool io, bool idle)
{
	struct bworld w;
	char name[128];
	snprintf(name, sizeof name, "prefetch%s with %s %llu failed",
		 idle ? " (rows served beside its reads)" : "", io ? "completion" : "allocation",
		 (unsigned long long)n);
	bw_open(&w, (uint64_t)2 << 20);
	step(&w, 0, 1, 0, 16 * PER_CHUNK, false, name); /* some chunks cached, some not */
	const struct items it = {0, 0, NS, 0, NKV, 0, 40 * PER_CHUNK};
	begin_step(&w, &it, true);
	struct fault f = {.n = n};
	kvt_stats a = t_stats(w.c);
	if (io)
		kvt_nvme_set_cqe_hook(w.c->nvme, fail_nth, &f);
	else
		kvt_mem_fail_at(n);
	static struct idle_serve x;
	int rc = prefetch_serving(&w, &it, idle, &x);
	f.fired |= !io && kvt_mem_fired();
	kvt_mem_fail_at(0);
	kvt_nvme_set_cqe_hook(w.c->nvme, NULL, NULL);
	kvt_stats b = t_stats(w.c);
	T_CHECK(rc == 0 || rc == (io ? -EIO : -ENOMEM), "%s: got %d (%s), wanted 0 or %d", name, rc,
		kvt_last_error(w.c), io ? -EIO : -ENOMEM);
	T_CHECK(rc == 0 || (b.nvme_cache_misses == a.nvme_cache_misses && kvt_last_error(w.c)[0]),
		"%s: the failed prefetch counted %llu misses (wanted none) or left no text", name,
		(unsigned long long)(b.nvme_cache_misses - a.nvme_cache_misses));
	get_items(&w, &it, name);
	step(&w, 0, NS, 0, 40 * PER_CHUNK, true, name);
	bw_close(&w, name);
	return f.fired;
}

static void test_prefetch_faults(void **state)
{
	(void)state;
	tt_skip_unless_available();
	uint64_t n_io = 1, n_mem = 1;
	while (faulty_prefetch(n_io, true, false))
		n_io++;
	while (faulty_prefetch(n_mem, false, false))
		n_mem++;
	/* with rows served beside the reads (every row served is compared), at some completions */
	for (uint64_t k = 1; k < n_io; k += 23)
		faulty_prefetch(k, true, true);
	print_message("prefetch: %llu completions and %llu allocations failed in turn\n",
		      (unsigned long long)(n_io - 1), (unsigned long long)(n_mem - 1));
	T_CHECK(n_io > 1, "prefetch faults: no completion of the prefetch was reached");
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_loop_larger_than_cache),
		cmocka_unit_test(test_scan_keeps_working_set),
		cmocka_unit_test(test_prefetch_reads_ahead),
		cmocka_unit_test(test_prefetch_what_fits),
		cmocka_unit_test(test_prefetch_idle),
		cmocka_unit_test(test_prefetch_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
