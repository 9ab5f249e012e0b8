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
 * The rule's miss threshold (gpu/hotsize.h's KVT_HOT_MISS_DEN, default 4: grow while a full cache
 * misses more than a quarter of its reads) can be set for an experiment by building this by hand,
 * from the repository root: cc -O2 -DKVT_HOT_MISS_DEN=8u -Itools -Ilib -I. -o hot_batch8
 * bench/hot_batch.c tools/kvbench_hotsim.c -lm
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbench_trace.h"
#include "constants.h" /* KVT_GPU_HOT_WAYS */

/* One sequence of the batch, a log's reads on one layer: steps [0, steps), step s's rows
 * row[first[s] .. first[s + 1]). */
struct log {
	const char *path;
	uint64_t rows, stride;
	uint32_t steps;
	size_t *first;
	uint64_t *row;
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

/* The records of `layer` (UINT64_MAX: the file's first record's) from path; *layer set. */
static void load(struct log *g, const char *path, uint64_t *layer)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		die(path, "cannot open");
	*g = (struct log){.path = path};
	size_t n_rows = 0, room = 0, first_room = 0;
	uint64_t rec[KB_HOT_LOG_WORDS];
	while (fread(rec, sizeof rec, 1, f) == 1) {
		const uint64_t l = rec[0], step = rec[1], rows = rec[2], stride = rec[3], n = rec[4];
		if (!stride || rows % stride || n > rows)
			die(path, "not a hot-cache log (kvbench --trace DIR --hot-log FILE writes one)");
		if (*layer == UINT64_MAX)
			*layer = l;
		if (l != *layer) {
			if (fseek(f, (long)(n * sizeof(uint64_t)), SEEK_CUR))
				die(path, "truncated");
			continue;
		}
		if (step != g->steps)
			die(path, "the layer's steps are not in order");
		g->rows = rows;
		g->stride = stride;
		if (n_rows + n > room) {
			room = 2 * (n_rows + n);
			g->row = xrealloc(g->row, room * sizeof(uint64_t));
		}
		if (fread(g->row + n_rows, sizeof(uint64_t), n, f) != n)
			die(path, "truncated");
		for (uint64_t i = 0; i < n; i++)
			if (g->row[n_rows + i] >= rows)
				die(path, "a row id beyond the layer's rows");
		if (g->steps + 2 > first_room) {
			first_room = 2 * (g->steps + 2);
			g->first = xrealloc(g->first, first_room * sizeof(size_t));
		}
		g->first[g->steps] = n_rows;
		n_rows += n;
		g->first[++g->steps] = n_rows;
	}
	if (ferror(f))
		die(path, "read error");
	fclose(f);
	if (!g->steps)
		die(path, "no step of the layer");
}

/* The batch of sequences g[0 .. n) sharing one self-sized cache over `steps` steps. */
static void replay(const struct log *g, int n, uint32_t steps, const char *name)
{
	const uint64_t rows = g[0].rows, total = rows * (uint64_t)n;
	kb_lru l;
	if (kb_lru_init(&l, total, 0, steps, KVT_GPU_HOT_WAYS, g[0].stride) < 0)
		die("memory", "out of memory");
	l.grows = KB_LRU_RULE;
	size_t room = 0;
	for (int i = 0; i < n; i++)
		for (uint32_t s = 0; s < steps; s++)
			room = g[i].first[s + 1] - g[i].first[s] > room ? g[i].first[s + 1] - g[i].first[s]
									: room;
	uint64_t *ids = xrealloc(NULL, room * (size_t)n * sizeof(uint64_t));
	double hits_half = 0.0;
	uint64_t reads_half = 0, cap = 0;
	printf("%s:", name);
	for (uint32_t s = 0; s < steps; s++) {
		size_t m = 0;
		for (int i = 0; i < n; i++) /* sequence i's rows after those of 0 .. i - 1 */
			for (size_t j = g[i].first[s]; j < g[i].first[s + 1]; j++)
				ids[m++] = (uint64_t)i * rows + g[i].row[j];
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

/* The distinct layers of path's records, in the order they first appear, into l[0 .. *n). */
static void scan_layers(const char *path, uint64_t *l, int *n, int max)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		die(path, "cannot open");
	uint64_t rec[KB_HOT_LOG_WORDS];
	*n = 0;
	while (fread(rec, sizeof rec, 1, f) == 1) {
		int k = 0;
		while (k < *n && l[k] != rec[0])
			k++;
		if (k == *n) {
			if (*n == max)
				die(path, "more layers than hot_batch takes");
			l[(*n)++] = rec[0];
		}
		if (rec[4] > rec[2] || fseek(f, (long)(rec[4] * sizeof(uint64_t)), SEEK_CUR))
			die(path, "not a hot-cache log (kvbench --trace DIR --hot-log FILE writes one)");
	}
	fclose(f);
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
	/* the sequences: each log's chosen layer, or (all) each layer of each log */
	static uint64_t ls[MAX_LAYERS];
	struct log *g = NULL;
	int n = 0;
	uint32_t steps = UINT32_MAX;
	for (int i = 0; i < logs; i++) {
		int nl = 1;
		if (all)
			scan_layers(argv[a + i], ls, &nl, MAX_LAYERS);
		for (int k = 0; k < nl; k++, n++) {
			uint64_t y = all ? ls[k] : layer;
			g = xrealloc(g, sizeof *g * (size_t)(n + 1));
			load(&g[n], argv[a + i], &y);
			layer = all ? layer : y;
			if (g[n].rows != g[0].rows || g[n].stride != g[0].stride)
				die(argv[a + i], "its layer's rows differ from the first log's");
			steps = g[n].steps < steps ? g[n].steps : steps;
		}
	}
	if (all)
		printf("hot_batch: every layer of each log a sequence, ");
	else
		printf("hot_batch: layer %" PRIu64 ", ", layer);
	printf("%" PRIu64 " rows a sequence, %u steps, %d sequence%s; each alone, then all in one "
	       "cache\n", g[0].rows, steps, n, n > 1 ? "s" : "");
	char name[64];
	for (int i = 0; n > 1 && i < n; i++) {
		snprintf(name, sizeof name, "  sequence %d alone", i + 1);
		replay(&g[i], 1, steps, name);
	}
	snprintf(name, sizeof name, "  batch of %d", n);
	replay(g, n, steps, name);
	for (int i = 0; i < n; i++) {
		free(g[i].first);
		free(g[i].row);
	}
	free(g);
	return 0;
}
