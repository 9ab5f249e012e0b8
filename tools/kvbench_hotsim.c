/* SPDX-License-Identifier: MIT */
/*
 * A simulated hot cache for the trace replay (kvbench --trace): how often the rows a decode step
 * reads through the CUDA backend's hot cache (its sinks and selected rows) would be in a cache of a
 * given size that keeps the rows used most recently, on any backend and on real queries. The CUDA
 * backend's cache is 8-way set associative with LRU ways; this one is fully associative, so it
 * reads a little higher. Steps are its unit of time: rows read in the same step are equally recent,
 * and where the cache's edge falls among them it holds the share of them that fits (so a row there
 * counts as that share of a hit: the mean over the orders in which they could have been evicted).
 * One more cache sizes itself by the CUDA backend's rule (gpu/hotsize.h), from the hits and misses
 * it simulates, within the layer's rows (the backend's bound, HBM, is not the trace's to know), and
 * another by that rule's demand alone, the rule before misses counted. doc/kvbench.md, "Trace
 * replay", has what it reports.
 */
#include "kvbench_trace.h"

#include <math.h>
#include <stdlib.h>

#include "gpu/hotsize.h"

int kb_lru_init(kb_lru *l, uint64_t rows, uint64_t cap, uint32_t steps)
{
	*l = (kb_lru){.cap = cap, .rows = rows, .steps = steps};
	l->last = malloc(rows * sizeof(int32_t) + 1);
	l->at = calloc((size_t)steps + 1, sizeof(uint64_t));
	if (!l->last || !l->at) {
		kb_lru_free(l);
		return -1;
	}
	for (uint64_t r = 0; r < rows; r++)
		l->last[r] = -1;
	return 0;
}

void kb_lru_free(kb_lru *l)
{
	free(l->last);
	free(l->at);
	l->last = NULL;
	l->at = NULL;
}

void kb_lru_step(kb_lru *l, uint32_t step, const uint64_t *rows, size_t n)
{
	/* what the cache holds after the steps before this one: every row last read at a step past
	 * `edge`, and `part` of those read at `edge` */
	int64_t edge = -1;
	double part = 0.0;
	uint64_t held = 0;
	for (int64_t u = (int64_t)step - 1; u >= 0; u--) {
		const uint64_t k = l->at[u];
		if (held + k > l->cap) {
			edge = u;
			part = (double)(l->cap - held) / (double)k;
			break;
		}
		held += k;
	}
	/* the rows are distinct, so a row's update leaves the others' hits as the edge gave them */
	const double hits0 = l->hits;
	for (size_t i = 0; i < n; i++) {
		int32_t *s = &l->last[rows[i]];
		if (step > 0) { /* the first step's reads all miss, whatever the size */
			l->hits += *s < 0 ? 0.0 : *s > edge ? 1.0 : *s == edge ? part : 0.0;
			l->reads++;
		}
		if (*s >= 0)
			l->at[*s]--;
		*s = (int32_t)step;
		l->at[step]++;
	}
	if (l->grows == KB_LRU_FIXED)
		return;
	/* the backend's rule on this step's measure (the first step's reads all missed); on demand
	 * alone, as if nothing missed */
	uint64_t misses = step ? n - (uint64_t)llround(l->hits - hits0) : n;
	if (l->grows == KB_LRU_DEMAND)
		misses = 0;
	uint64_t want = kvt_hot_rows_wanted(l->cap, n, n, misses, &l->to_fill);
	want = want < l->rows ? want : l->rows;
	if (want > l->cap) {
		l->to_fill = want - l->cap;
		l->cap = want;
	}
}
