/* SPDX-License-Identifier: MIT */
/*
 * What the host would gain by attending the hot cache's misses itself instead of sending their rows
 * over PCIe (doc/cuda-backend.md, "When the selection changes from step to step": decision (c),
 * not built). On drifting queries a decode step is bound by the rows its misses move over PCIe;
 * the host could instead read each missed row where it lies and send back a partial softmax (a
 * running max, a sum and head_dim floats per query head, kvt_attention_begin / feed: the pieces a
 * GPU merge would take).
 *
 * The workload: a pool of K/V rows in host memory (fp16, K then V, 4 head_dim bytes a row), items
 * (sequence, KV head) of `misses` rows each at random positions of the pool, ascending as the
 * fetch lists them, and G = 4 query heads an item (Llama-3.1-8B's group). T threads take the items
 * in turn. Timed (wall clock, median of the repeats):
 * - ATTEND: each item's partial softmax over its rows (the library's kvt_attention_feed);
 * - READ PEERS: passes that read the same rows in the same order and threads and sum their words,
 *   plainly (random rows are bound by memory latency) and with each row prefetched PF_AHEAD rows
 *   before it is read (the memory's limit for this access pattern, which a host kernel tuned for
 *   it could approach), measured in the same run.
 * Reported: rows per second and GB/s of rows for each, ATTEND as a share of the faster read, and
 * ATTEND and that read against a PCIe rate given on the command line (--pcie-gbs, default 53: the
 * H2D rate bench/gpu_decode measures on the H200), i.e. how many times faster than sending the
 * rows the host disposes of them with these threads, today and at best. Nothing is asserted.
 *   cpu_miss_attend [--pool-mib N] [--misses N] [--items N] [--threads N] [--head-dim 64|128|256]
 *                   [--pcie-gbs X] [--repeats N]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_bench.h"
#include "half.h"
#include "internal.h"

enum { G = 4, MAX_THREADS = 256, PF_AHEAD = 16 };

/* What a pass does with each item's rows. */
enum { PASS_READ, PASS_PREFETCH, PASS_ATTEND };

struct options {
	uint64_t pool_mib;
	uint32_t misses, items, threads, d, repeats;
	double pcie_gbs;
};

/* The shared workload and one timed pass's kind. */
struct work {
	const struct options *o;
	const char *pool;
	uint32_t *pos;  /* [items][misses] row indices, ascending per item */
	float *q;       /* [items][G][d] */
	int kind;       /* PASS_READ, PASS_PREFETCH or PASS_ATTEND */
	uint64_t sink[MAX_THREADS];
};

struct thread_arg {
	struct work *w;
	uint32_t id;
};

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static void *run_items(void *p)
{
	const struct thread_arg *a = p;
	struct work *w = a->w;
	const struct options *o = w->o;
	const size_t row = 4u * o->d, M = o->misses;
	const void **rows = malloc(sizeof(void *) * M);
	float *acc = malloc(sizeof(float) * G * o->d);
	float m[G], l[G];
	uint64_t sink = 0;
	if (!rows || !acc) {
		fprintf(stderr, "cpu_miss_attend: out of memory\n");
		exit(1);
	}
	for (uint32_t it = a->id; it < o->items; it += o->threads) {
		const uint32_t *pos = w->pos + (size_t)it * M;
		if (w->kind == PASS_ATTEND) {
			for (size_t i = 0; i < M; i++)
				rows[i] = w->pool + (size_t)pos[i] * row;
			kvt_attention_begin(o->d, G, m, l, acc);
			const float *q = w->q + (size_t)it * G * o->d;
			kvt_attention_feed(o->d, KVT_DTYPE_F16, 0.0883883f, G, q, NULL, 0,
					   (uint32_t)M, rows, m, l, acc);
			sink += (uint64_t)(l[0] > 0.0f) + (uint64_t)(acc[o->d - 1] != 0.0f);
		} else {
			for (size_t i = 0; i < M; i++) {
				if (w->kind == PASS_PREFETCH && i + PF_AHEAD < M) {
					const char *f = w->pool + (size_t)pos[i + PF_AHEAD] * row;
					for (size_t c = 0; c < row; c += 64)
						__builtin_prefetch(f + c);
				}
				const char *r = w->pool + (size_t)pos[i] * row;
				for (size_t j = 0; j < row / 8; j++)
					sink += ((const uint64_t *)r)[j];
			}
		}
	}
	w->sink[a->id] = sink;
	free(rows);
	free(acc);
	return NULL;
}

/* One pass over every item with o->threads threads: its wall time in ns. */
static uint64_t pass(struct work *w)
{
	pthread_t th[MAX_THREADS];
	struct thread_arg args[MAX_THREADS];
	const uint64_t t0 = kvt_now_ns();
	for (uint32_t i = 0; i < w->o->threads; i++) {
		args[i] = (struct thread_arg){w, i};
		if (pthread_create(&th[i], NULL, run_items, &args[i])) {
			fprintf(stderr, "cpu_miss_attend: pthread_create failed\n");
			exit(1);
		}
	}
	for (uint32_t i = 0; i < w->o->threads; i++)
		pthread_join(th[i], NULL);
	return kvt_now_ns() - t0;
}

static uint64_t median_pass(struct work *w, uint64_t *t)
{
	(void)pass(w); /* warm-up */
	for (uint32_t r = 0; r < w->o->repeats; r++)
		t[r] = pass(w);
	return bench_median(t, w->o->repeats);
}

static void usage(void)
{
	fprintf(stderr,
		"usage: cpu_miss_attend [--pool-mib N >= 1] [--misses N >= 1] [--items N >= 1] "
		"[--threads 1..%d] [--head-dim 64|128|256] [--pcie-gbs X > 0] "
		"[--repeats 1..1000]\n",
		MAX_THREADS);
	exit(2);
}

static struct options parse(int argc, char **argv)
{
	const long cores = sysconf(_SC_NPROCESSORS_ONLN);
	struct options o = {2048, 4096, 256, 1, 128, 9, 53.0};
	o.threads = cores > 0 && cores <= MAX_THREADS ? (uint32_t)cores : 1;
	for (int i = 1; i < argc; i += 2) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!v)
			usage();
		const unsigned long long x = strtoull(v, NULL, 0);
		if (!strcmp(a, "--pool-mib") && x >= 1)
			o.pool_mib = x;
		else if (!strcmp(a, "--misses") && x >= 1 && x <= (1u << 24))
			o.misses = (uint32_t)x;
		else if (!strcmp(a, "--items") && x >= 1 && x <= (1u << 20))
			o.items = (uint32_t)x;
		else if (!strcmp(a, "--threads") && x >= 1 && x <= MAX_THREADS)
			o.threads = (uint32_t)x;
		else if (!strcmp(a, "--head-dim") && (x == 64 || x == 128 || x == 256))
			o.d = (uint32_t)x;
		else if (!strcmp(a, "--repeats") && x >= 1 && x <= 1000)
			o.repeats = (uint32_t)x;
		else if (!strcmp(a, "--pcie-gbs") && atof(v) > 0.0)
			o.pcie_gbs = atof(v);
		else
			usage();
	}
	return o;
}

int main(int argc, char **argv)
{
	const struct options o = parse(argc, argv);
	const size_t row = 4u * o.d, pool_rows = (size_t)(o.pool_mib << 20) / row;
	if (pool_rows < o.misses) {
		fprintf(stderr,
			"cpu_miss_attend: a pool of %llu MiB holds %zu rows, fewer than the %u "
			"misses of an item\n",
			(unsigned long long)o.pool_mib, pool_rows, o.misses);
		return 2;
	}
	struct work w = {.o = &o};
	char *pool = malloc(pool_rows * row);
	w.pos = malloc(sizeof(uint32_t) * (size_t)o.items * o.misses);
	w.q = malloc(sizeof(float) * (size_t)o.items * G * o.d);
	uint64_t *t = malloc(sizeof *t * o.repeats);
	if (!pool || !w.pos || !w.q || !t) {
		fprintf(stderr, "cpu_miss_attend: out of memory (a pool of %llu MiB)\n",
			(unsigned long long)o.pool_mib);
		return 1;
	}
	/* rows of N(0, 1)-like halves, written once (so the pool is resident) */
	uint16_t *h = (uint16_t *)pool;
	for (size_t i = 0; i < pool_rows * row / 2; i++)
		h[i] = kvt_f32_to_f16((float)((int)(bench_next() % 2001) - 1000) / 1000.0f);
	for (size_t i = 0; i < (size_t)o.items * G * o.d; i++)
		w.q[i] = (float)((int)(bench_next() % 2001) - 1000) / 1000.0f;
	for (uint32_t it = 0; it < o.items; it++) {
		uint32_t *p = w.pos + (size_t)it * o.misses;
		for (uint32_t i = 0; i < o.misses; i++)
			p[i] = (uint32_t)(bench_next() % pool_rows);
		qsort(p, o.misses, sizeof *p, cmp_u32);
	}
	w.pool = pool;
	const double bytes = (double)o.items * o.misses * row, rows = (double)o.items * o.misses;
	w.kind = PASS_READ;
	const uint64_t t_read = median_pass(&w, t);
	w.kind = PASS_PREFETCH;
	const uint64_t t_pf = median_pass(&w, t);
	w.kind = PASS_ATTEND;
	const uint64_t t_att = median_pass(&w, t);
	const double read_gbs = bytes / (double)t_read, pf_gbs = bytes / (double)t_pf,
		     att_gbs = bytes / (double)t_att;
	const double best_gbs = pf_gbs > read_gbs ? pf_gbs : read_gbs;
	printf("cpu_miss_attend: %u items x %u missed rows of %zu bytes (head_dim %u, fp16 K and "
	       "V) at random positions of a %llu MiB pool, %d query heads an item, %u threads, "
	       "median of %u\n",
	       o.items, o.misses, row, o.d, (unsigned long long)o.pool_mib, G, o.threads,
	       o.repeats);
	printf("  attend (partial softmax): %8.3f ms  %7.2f GB/s of rows  %7.1f M rows/s  "
	       "(%.2f GB/s a thread)\n",
	       (double)t_att / 1e6, att_gbs, rows / ((double)t_att / 1e3), att_gbs / o.threads);
	printf("  read peer:                %8.3f ms  %7.2f GB/s of rows  %7.1f M rows/s\n",
	       (double)t_read / 1e6, read_gbs, rows / ((double)t_read / 1e3));
	printf("  read peer, prefetched:    %8.3f ms  %7.2f GB/s of rows  %7.1f M rows/s  (%d rows "
	       "ahead)\n",
	       (double)t_pf / 1e6, pf_gbs, rows / ((double)t_pf / 1e3), PF_AHEAD);
	printf("  attend / the faster read: %.2f; against PCIe at %.1f GB/s (--pcie-gbs): attend "
	       "%.3gx, the faster read %.3gx (above 1: the host disposes of a miss faster than "
	       "PCIe carries its row)\n",
	       att_gbs / best_gbs, o.pcie_gbs, att_gbs / o.pcie_gbs, best_gbs / o.pcie_gbs);
	uint64_t sink = 0;
	for (uint32_t i = 0; i < o.threads; i++)
		sink += w.sink[i];
	free(pool);
	free(w.pos);
	free(w.q);
	free(t);
	return sink == 42 ? 3 : 0;
}
