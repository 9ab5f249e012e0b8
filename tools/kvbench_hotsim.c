/* SPDX-License-Identifier: MIT */
/*
 * A simulated hot cache for the trace replay (kvbench --trace): how often the rows a decode step
 * reads through the CUDA backend's hot cache (its sinks and selected rows) would be in a cache of a
 * given size kept by the backend's rule, in its 8-way sets, on any backend and on real queries
 * (kvbench_trace.h states the rule). One more cache sizes itself by the CUDA backend's rule
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

/* Room for `sets` sets: tags and steps of every way empty. */
static int lru_alloc(kb_lru *l, uint64_t sets)
{
	const uint64_t n = sets * l->ways;
	l->tag = calloc(n + 1, sizeof(uint64_t));
	l->last = malloc(n * sizeof(int32_t) + 1);
	if (!l->tag || !l->last)
		return -1;
	for (uint64_t i = 0; i < n; i++)
		l->last[i] = -1;
	l->sets = sets;
	l->cap = n;
	return 0;
}

int kb_lru_init(kb_lru *l, uint64_t rows, uint64_t cap, uint32_t steps, uint32_t ways,
		uint64_t stride)
{
	*l = (kb_lru){.rows = rows, .steps = steps, .ways = ways ? ways : 1,
		      .stride = stride ? stride : rows + 1};
	if (lru_alloc(l, cap / l->ways) < 0) {
		kb_lru_free(l);
		return -1;
	}
	return 0;
}

void kb_lru_free(kb_lru *l)
{
	free(l->tag);
	free(l->last);
	free(l->fresh);
	l->tag = NULL;
	l->last = NULL;
	l->fresh = NULL;
	l->fresh_room = 0;
}

/* The first way of row r's set. */
static uint64_t lru_set(const kb_lru *l, uint64_t r)
{
	return (uint64_t)kvt_hot_set(KB_HOT_UID, (uint32_t)(r / l->stride), (uint32_t)(r % l->stride),
				     (uint32_t)l->sets) * l->ways;
}

/* The way a miss of step s takes in the set from w0: a free one, else the least recently used
 * one not used in this step (the first of equals), or -1. */
static int64_t lru_victim(const kb_lru *l, uint64_t w0, int32_t s)
{
	int64_t best = -1;
	for (uint64_t w = w0; w < w0 + l->ways; w++)
		if (l->last[w] != s && (best < 0 || l->last[w] < l->last[best]))
			best = (int64_t)w;
	return best;
}

/* Grows the cache to `sets` sets, moving the rows it held, in order, into the first free way of
 * their new sets; a row whose new set is full is dropped (gpu/fetch.cu's k_hot_move). */
static int lru_grow(kb_lru *l, uint64_t sets)
{
	kb_lru old = *l;
	if (lru_alloc(l, sets) < 0) {
		free(l->tag);
		free(l->last);
		l->tag = old.tag;
		l->last = old.last;
		l->sets = old.sets;
		l->cap = old.cap;
		return -1;
	}
	for (uint64_t i = 0; i < old.cap; i++) {
		if (!old.tag[i])
			continue;
		const uint64_t w0 = lru_set(l, old.tag[i] - 1);
		for (uint64_t w = w0; w < w0 + l->ways; w++)
			if (!l->tag[w]) {
				l->tag[w] = old.tag[i];
				l->last[w] = old.last[i];
				break;
			}
	}
	free(old.tag);
	free(old.last);
	return 0;
}

static int fresh_cmp(const void *a, const void *b)
{
	const uint64_t x = ((const kb_lru_ent *)a)->tie, y = ((const kb_lru_ent *)b)->tie;
	return (x > y) - (x < y);
}

int kb_lru_step(kb_lru *l, uint32_t step, const uint64_t *rows, size_t n)
{
	kb_lru_ent *f = reserve(l->fresh, &l->fresh_room, n, sizeof(kb_lru_ent));
	if (!f)
		return -1;
	l->fresh = f;
	const int32_t s = (int32_t)step;
	const double hits0 = l->hits;
	size_t nf = 0;
	/* the lookup: a held row is a hit, marked used in this step */
	for (size_t i = 0; i < n; i++) {
		const uint64_t r = rows[i];
		if (step > 0) /* the first step's reads all miss, whatever the size */
			l->reads++;
		int64_t way = -1;
		if (l->sets) {
			const uint64_t w0 = lru_set(l, r);
			for (uint64_t w = w0; w < w0 + l->ways && way < 0; w++)
				if (l->tag[w] == r + 1)
					way = (int64_t)w;
		}
		if (way < 0) {
			f[nf++] = (kb_lru_ent){kb_row_hash(r ^ (step + 1ull) * KB_STEP_MIX), r};
			continue;
		}
		if (step > 0)
			l->hits += 1.0;
		l->last[way] = s;
	}
	/* the fill: each miss, in the order of its hash, takes a way of its set not used in this
	 * step, or is read in place */
	qsort(f, nf, sizeof(kb_lru_ent), fresh_cmp);
	for (size_t i = 0; i < nf && l->sets; i++) {
		const int64_t w = lru_victim(l, lru_set(l, f[i].row), s);
		if (w >= 0) {
			l->tag[w] = f[i].row + 1;
			l->last[w] = s;
		}
	}
	if (l->grows == KB_LRU_FIXED)
		return 0;
	/* the backend's rule on this step's measure (the first step's reads all missed); on demand
	 * alone, as if nothing missed; whole sets, as gpu/hot.c's growth */
	uint64_t misses = step ? n - (uint64_t)llround(l->hits - hits0) : n;
	if (l->grows == KB_LRU_DEMAND)
		misses = 0;
	const uint64_t want = kvt_hot_rows_wanted(l->cap, n, n, misses, l->rows, &l->to_fill);
	const uint64_t have = l->cap;
	if (want / l->ways > l->sets) {
		if (lru_grow(l, want / l->ways) < 0)
			return -1;
		l->to_fill = l->cap - have;
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
