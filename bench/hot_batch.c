/* SPDX-License-Identifier: MIT */
/*
 * The self-sized hot cache on a batch, simulated on the CPU. `kvbench --trace DIR --hot-log FILE`
 * writes the rows each decode step of one sequence reads through the CUDA backend's hot cache
 * (tools/kvbench_trace.h, KB_HOT_LOG_WORDS); this replays several such logs as one batch whose
 * sequences share one layer's cache, as kvt_attend's batch does: at step s the cache sees the
 * reads of step s of every log, each log's rows as a sequence of its own. The cache is kvbench's
 * simulation of the backend's (tools/kvbench_hotsim.c: 8-way sets, the growth rule of
 * gpu/hotsize.h, within the batch's rows), so the figures are the trace replay's self-sized cache,
 * for a batch instead of one sequence. Each log alone is replayed first, for comparison.
 *
 * Printed for each replay: the steps at which the cache grew and the share of the rows it held
 * after each growth; its final share; its hit rate over the reads after the first step, and over
 * the second half of the steps (after most growths); and the misses per step in the second half as
 * a share of the batch's rows (what crosses PCIe, in rows). Nothing is asserted.
 *
 *   hot_batch [--layer L|all] LOG...   (L: a layer every log has, default the first log's first;
 *                                      all: every layer of every log, each a sequence)
 *
 * The rule's miss threshold (gpu/hotsize.h's KVT_HOT_MISS_DEN, default 8: grow while a full cache
 * misses more than an eighth of its reads) can be set for an experiment by building this by hand,
 * from the repository root: cc -O2 -DKVT_HOT_MISS_DEN=4u -Itools -Ilib -I. -o hot_batch4
 * bench/hot_batch.c tools/kvbench_hotsim.c -lm
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbench_trace.h"
#include "constants.h" /* KVT_GPU_HOT_WAYS */

/* One sequence of the batch: a log's reads on one layer, as kvbench keeps a layer's reads for its
 * offline optimum (kb_hotlog), and the stride of its row ids. */
struct log {
	kb_hotlog h;
	uint64_t stride;
};

static _Noreturn void die(const char *path, const char *what)
{
	fprintf(stderr, "hot_batch: %s: %s\n", path, what);
	exit(1);
}

static void *xrealloc(void *p, size_t bytes)
{
	p = realloc(p, bytes ? bytes : 1);
	if (!p)
		die("memory", "out of memory");
	return p;
}

/* A layer of a log and its records (steps). */
struct layer_steps {
	uint64_t layer;
	uint32_t steps;
};

/* The layers of path's records, in the order each first appears, with their record counts, into
 * ls[0 .. return value); every record header checked. */
static int scan(const char *path, struct layer_steps *ls, int max)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		die(path, "cannot open");
	uint64_t rec[KB_HOT_LOG_WORDS];
	int n = 0;
	while (fread(rec, sizeof rec, 1, f) == 1) {
		const uint64_t rows = rec[2], stride = rec[3], m = rec[4];
		if (!stride || rows % stride || m > rows ||
		    fseek(f, (long)(m * sizeof(uint64_t)), SEEK_CUR))
			die(path, "not a hot-cache log (kvbench --trace DIR --hot-log FILE writes one)");
		int k = 0;
		while (k < n && ls[k].layer != rec[0])
			k++;
		if (k == n) {
			if (n == max)
				die(path, "more layers than hot_batch takes");
			ls[n++] = (struct layer_steps){rec[0], 0};
		}
		ls[k].steps++;
	}
	if (ferror(f))
		die(path, "read error");
	fclose(f);
	if (!n)
		die(path, "no record");
	return n;
}

/* The `steps` records of `layer` from path, in step order, into g. */
static void load(struct log *g, const char *path, uint64_t layer, uint32_t steps)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		die(path, "cannot open");
	uint64_t rec[KB_HOT_LOG_WORDS], *ids = NULL;
	size_t room = 0;
	g->h = (kb_hotlog){0};
	while (fread(rec, sizeof rec, 1, f) == 1) {
		const uint64_t step = rec[1], rows = rec[2], n = rec[4];
		if (rec[0] != layer) {
			if (fseek(f, (long)(n * sizeof(uint64_t)), SEEK_CUR))
				die(path, "truncated");
			continue;
		}
		if (!g->h.first) {
			if (kb_hotlog_init(&g->h, rows, steps) < 0)
				die("memory", "out of memory");
			g->stride = rec[3];
		}
		if (rows != g->h.rows || rec[3] != g->stride || step != g->h.done)
			die(path, "the layer's records are not one layer's steps in order");
		if (n > room)
			ids = xrealloc(ids, (room = n) * sizeof(uint64_t));
		if (fread(ids, sizeof(uint64_t), n, f) != n)
			die(path, "truncated");
		for (uint64_t i = 0; i < n; i++)
			if (ids[i] >= rows)
				die(path, "a row id beyond the layer's rows");
		if (kb_hotlog_step(&g->h, ids, n) < 0)
			die("memory", "out of memory");
	}
	free(ids);
	fclose(f);
}

/* The batch of sequences g[0 .. n) sharing one self-sized cache over `steps` steps. */
static void replay(const struct log *g, int n, uint32_t steps, const char *name)
{
	const uint64_t rows = g[0].h.rows, total = rows * (uint64_t)n;
	kb_lru l;
	if (kb_lru_init(&l, total, 0, steps, KVT_GPU_HOT_WAYS, g[0].stride) < 0)
		die("memory", "out of memory");
	l.grows = KB_LRU_RULE;
	size_t room = 0;
	for (int i = 0; i < n; i++)
		for (uint32_t s = 0; s < steps; s++) {
			const size_t m = g[i].h.first[s + 1] - g[i].h.first[s];
			room = m > room ? m : room;
		}
	uint64_t *ids = xrealloc(NULL, room * (size_t)n * sizeof(uint64_t));
	double hits_half = 0.0;
	uint64_t reads_half = 0, cap = 0;
	printf("%s:", name);
	for (uint32_t s = 0; s < steps; s++) {
		size_t m = 0;
		for (int i = 0; i < n; i++) /* sequence i's rows after those of 0 .. i - 1 */
			for (size_t j = g[i].h.first[s]; j < g[i].h.first[s + 1]; j++)
				ids[m++] = (uint64_t)i * rows + g[i].h.row[j];
		if (s == steps / 2) {
			hits_half = l.hits;
			reads_half = l.reads;
		}
		if (kb_lru_step(&l, s, ids, m) < 0)
			die("memory", "out of memory");
		if (l.cap != cap)
			printf(" step %u %.1f %%;", s, 100.0 * (double)l.cap / (double)total);
		cap = l.cap;
	}
	const double h2 = l.hits - hits_half, r2 = (double)(l.reads - reads_half);
	printf(" holds %.1f %% of the rows, hits %.1f %% (second half %.1f %%), misses %.3f %% of "
	       "the rows a step (second half)\n", 100.0 * (double)l.cap / (double)total,
	       l.reads ? 100.0 * l.hits / (double)l.reads : 0.0, r2 > 0 ? 100.0 * h2 / r2 : 0.0,
	       100.0 * (r2 - h2) / (double)(steps - steps / 2) / (double)total);
	free(ids);
	kb_lru_free(&l);
}

enum { MAX_LAYERS = 1024 };

int main(int argc, char **argv)
{
	uint64_t layer = UINT64_MAX;
	bool all = false;
	int a = 1;
	if (a + 1 < argc && !strcmp(argv[a], "--layer")) {
		char *end;
		all = !strcmp(argv[a + 1], "all");
		layer = strtoull(argv[a + 1], &end, 10);
		if (!all && (*end || end == argv[a + 1]))
			die(argv[a + 1], "--layer takes a layer number or all");
		a += 2;
	}
	const int logs = argc - a;
	if (logs < 1 || !strncmp(argv[a], "--", 2)) {
		fprintf(stderr, "usage: hot_batch [--layer L|all] LOG...  (kvbench --trace DIR "
			"--hot-log LOG writes one)\n");
		return 2;
	}
	/* the sequences: each log's chosen layer (by default the first log's first), or (all) each
	 * layer of each log */
	static struct layer_steps ls[MAX_LAYERS];
	struct log *g = NULL;
	int n = 0;
	uint32_t steps = UINT32_MAX;
	for (int i = 0; i < logs; i++) {
		const int nl = scan(argv[a + i], ls, MAX_LAYERS);
		layer = layer == UINT64_MAX ? ls[0].layer : layer;
		for (int k = 0; k < nl; k++) {
			if (!all && ls[k].layer != layer)
				continue;
			g = xrealloc(g, sizeof *g * (size_t)(n + 1));
			load(&g[n], argv[a + i], ls[k].layer, ls[k].steps);
			if (g[n].h.rows != g[0].h.rows || g[n].stride != g[0].stride)
				die(argv[a + i], "its layer's rows differ from the first log's");
			steps = g[n].h.done < steps ? g[n].h.done : steps;
			n++;
		}
		if (!all && n != i + 1)
			die(argv[a + i], "has no record of the layer");
	}
	if (all)
		printf("hot_batch: every layer of each log a sequence, ");
	else
		printf("hot_batch: layer %" PRIu64 ", ", layer);
	printf("%" PRIu64 " rows a sequence, %u steps, %d sequence%s; each alone, then all in one "
	       "cache\n", g[0].h.rows, steps, n, n > 1 ? "s" : "");
	char name[64];
	for (int i = 0; n > 1 && i < n; i++) {
		snprintf(name, sizeof name, "  sequence %d alone", i + 1);
		replay(&g[i], 1, steps, name);
	}
	snprintf(name, sizeof name, "  batch of %d", n);
	replay(g, n, steps, name);
	for (int i = 0; i < n; i++)
		kb_hotlog_free(&g[i].h);
	free(g);
	return 0;
}
