/* SPDX-License-Identifier: MIT */
/*
 * A simulated hot cache for the trace replay (kvbench --trace): how often the rows a decode step
 * reads through the CUDA backend's hot cache (its sinks and selected rows) would be in a cache of a
 * given size kept by the backend's rule, on any backend and on real queries (kvbench_trace.h
 * states the rule). The CUDA backend's cache is 8-way set associative; this one is fully
 * associative, so it reads a little higher. One more cache sizes itself by the CUDA backend's rule
 * (gpu/hotsize.h), from the hits and misses it simulates, within the layer's rows (the backend's
 * bound, HBM, is not the trace's to know), and another by that rule's demand alone, the rule
 * before misses counted. Beside them, the offline optimum at the fixed sizes: the most hits any
 * cache of the size could get on the same reads. doc/kvbench.md, "Trace replay", has what it
 * reports.
 */
#include "kvbench_trace.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/hotsize.h"

uint64_t kb_row_hash(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	return x ^ x >> 31;
}

/* p0 (room for *room elements of `size` bytes) with room for n, doubling: p0 itself, or a larger
 * copy; NULL out of memory (p0 left as it was). */
static void *reserve(void *p0, size_t *room, size_t n, size_t size)
{
	if (n <= *room && p0)
		return p0;
	size_t r = *room ? *room : 1024;
	while (r < n)
		r *= 2;
	void *p = realloc(p0, r * size);
	if (p)
		*room = r;
	return p;
}

/* ---- the backend's rule ------------------------------------------------------------------- */

int kb_lru_init(kb_lru *l, uint64_t rows, uint64_t cap, uint32_t steps)
{
	*l = (kb_lru){.cap = cap, .rows = rows, .steps = steps};
	l->last = malloc(rows * sizeof(int32_t) + 1);
	if (!l->last)
		return -1;
	for (uint64_t r = 0; r < rows; r++)
		l->last[r] = -1;
	return 0;
}

void kb_lru_free(kb_lru *l)
{
	free(l->last);
	free(l->heap);
	free(l->fresh);
	l->last = NULL;
	l->heap = l->fresh = NULL;
	l->n_heap = l->heap_room = l->fresh_room = 0;
}

/* Whether a comes before b: the earlier read, then the smaller tie. */
static int lru_before(const kb_lru_ent *a, const kb_lru_ent *b)
{
	return a->last != b->last ? a->last < b->last : a->tie < b->tie;
}

static void lru_push(kb_lru *l, kb_lru_ent e)
{
	kb_lru_ent *h = l->heap;
	size_t i = l->n_heap++;
	while (i && lru_before(&e, &h[(i - 1) / 2])) {
		h[i] = h[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h[i] = e;
}

static kb_lru_ent lru_pop(kb_lru *l)
{
	kb_lru_ent *h = l->heap, top = h[0], e = h[--l->n_heap];
	const size_t n = l->n_heap;
	size_t i = 0;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= n)
			break;
		if (c + 1 < n && lru_before(&h[c + 1], &h[c]))
			c++;
		if (!lru_before(&h[c], &e))
			break;
		h[i] = h[c];
		i = c;
	}
	if (n)
		h[i] = e;
	return top;
}

static int lru_stale(const kb_lru *l, const kb_lru_ent *e)
{
	return l->last[e->row] != e->last;
}

/* Drops the stale entries once they outnumber the held rows. */
static void lru_compact(kb_lru *l)
{
	if (l->n_heap < 2 * l->held + 1024)
		return;
	size_t n = 0;
	for (size_t i = 0; i < l->n_heap; i++)
		if (!lru_stale(l, &l->heap[i]))
			l->heap[n++] = l->heap[i];
	l->n_heap = 0;
	for (size_t i = 0; i < n; i++)
		lru_push(l, l->heap[i]); /* pushes never pass the entries still to be read */
}

static int fresh_cmp(const void *a, const void *b)
{
	const uint64_t x = ((const kb_lru_ent *)a)->tie, y = ((const kb_lru_ent *)b)->tie;
	return (x > y) - (x < y);
}

int kb_lru_step(kb_lru *l, uint32_t step, const uint64_t *rows, size_t n)
{
	kb_lru_ent *h = reserve(l->heap, &l->heap_room, l->n_heap + n, sizeof(kb_lru_ent));
	if (!h)
		return -1;
	l->heap = h;
	if (!(h = reserve(l->fresh, &l->fresh_room, n, sizeof(kb_lru_ent))))
		return -1;
	l->fresh = h;
	const int32_t s = (int32_t)step;
	const double hits0 = l->hits;
	size_t nf = 0;
	/* the lookup: a held row is a hit, marked used in this step */
	for (size_t i = 0; i < n; i++) {
		const uint64_t r = rows[i];
		if (step > 0) /* the first step's reads all miss, whatever the size */
			l->reads++;
		if (l->last[r] < 0) {
			l->fresh[nf++] = (kb_lru_ent){s, kb_row_hash(r ^ (step + 1ull) * KB_STEP_MIX), r};
			continue;
		}
		if (step > 0)
			l->hits += 1.0;
		l->last[r] = s;
		lru_push(l, (kb_lru_ent){s, kb_row_hash(r), r});
	}
	/* the fill: each miss takes a free way, else the least recently used one not used in this
	 * step, else it is read in place */
	qsort(l->fresh, nf, sizeof(kb_lru_ent), fresh_cmp);
	for (size_t i = 0; i < nf; i++) {
		if (l->held >= l->cap) {
			while (l->n_heap && lru_stale(l, &l->heap[0]))
				(void)lru_pop(l);
			if (!l->n_heap || l->heap[0].last == s)
				break; /* every way is in use this step */
			l->last[lru_pop(l).row] = -1;
			l->held--;
		}
		const uint64_t r = l->fresh[i].row;
		l->last[r] = s;
		l->held++;
		lru_push(l, (kb_lru_ent){s, kb_row_hash(r), r});
	}
	lru_compact(l);
	if (l->grows == KB_LRU_FIXED)
		return 0;
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
	return 0;
}

/* ---- the log and the offline optimum ------------------------------------------------------ */

int kb_hotlog_init(kb_hotlog *g, uint64_t rows, uint32_t steps)
{
	*g = (kb_hotlog){.rows = rows, .steps = steps};
	g->first = calloc((size_t)steps + 1, sizeof(size_t));
	return g->first ? 0 : -1;
}

void kb_hotlog_free(kb_hotlog *g)
{
	free(g->row);
	free(g->first);
	*g = (kb_hotlog){0};
}

int kb_hotlog_step(kb_hotlog *g, const uint64_t *rows, size_t n)
{
	if (g->done >= g->steps)
		return -1;
	uint64_t *r = reserve(g->row, &g->room, g->n + n, sizeof(*r));
	if (!r)
		return -1;
	g->row = r;
	memcpy(g->row + g->n, rows, n * sizeof(*rows));
	g->n += n;
	g->first[++g->done] = g->n;
	return 0;
}

#define NO_STEP UINT32_MAX

typedef struct ent {
	uint32_t key; /* the step that reads the row next */
	uint64_t row;
} ent;

/* Whether a goes out before b: the later next read, then the larger hash. */
static int ent_above(ent a, ent b)
{
	if (a.key != b.key)
		return a.key > b.key;
	return kb_row_hash(a.row) > kb_row_hash(b.row);
}

static void heap_push(ent *h, size_t *n, ent e)
{
	size_t i = (*n)++;
	while (i && ent_above(e, h[(i - 1) / 2])) {
		h[i] = h[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h[i] = e;
}

static ent heap_pop(ent *h, size_t *n)
{
	ent top = h[0], e = h[--*n];
	size_t i = 0;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= *n)
			break;
		if (c + 1 < *n && ent_above(h[c + 1], h[c]))
			c++;
		if (!ent_above(h[c], e))
			break;
		h[i] = h[c];
		i = c;
	}
	if (*n)
		h[i] = e;
	return top;
}

int kb_hot_optimum(const kb_hotlog *g, uint64_t cap, uint64_t *hits, uint64_t *reads)
{
	*hits = *reads = 0;
	uint32_t *next = malloc(g->n * sizeof(uint32_t) + 1);
	uint32_t *key = malloc(g->rows * sizeof(uint32_t) + 1); /* a held row's next read */
	ent *heap = malloc(g->n * sizeof(ent) + 1); /* held rows by next read; stale ones skipped */
	if (!next || !key || !heap) {
		free(next);
		free(key);
		free(heap);
		return -1;
	}
	/* each read's next read of the same row: the rows of a step are distinct */
	for (uint64_t r = 0; r < g->rows; r++)
		key[r] = NO_STEP;
	for (uint32_t s = g->done; s-- > 0;) {
		for (size_t i = g->first[s]; i < g->first[s + 1]; i++)
			next[i] = key[g->row[i]];
		for (size_t i = g->first[s]; i < g->first[s + 1]; i++)
			key[g->row[i]] = s;
	}
	for (uint64_t r = 0; r < g->rows; r++)
		key[r] = NO_STEP; /* now: not held */
	size_t nh = 0;
	uint64_t held = 0;
	for (uint32_t s = 0; s < g->done; s++) {
		for (size_t i = g->first[s]; i < g->first[s + 1]; i++) {
			const uint64_t r = g->row[i];
			if (s) {
				*hits += key[r] != NO_STEP;
				(*reads)++;
			}
			held -= key[r] != NO_STEP;
			key[r] = next[i];
			if (next[i] != NO_STEP) { /* a row never read again is not kept */
				held++;
				heap_push(heap, &nh, (ent){next[i], r});
			}
		}
		/* keep the rows read again soonest; a row's key only grows, so an entry whose key
		 * is not its row's is stale */
		while (held > cap) {
			const ent e = heap_pop(heap, &nh);
			if (key[e.row] == e.key) {
				key[e.row] = NO_STEP;
				held--;
			}
		}
	}
	free(next);
	free(key);
	free(heap);
	return 0;
}
