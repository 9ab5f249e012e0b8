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
 *
 * Two more policies replay a layer's reads whole at the fixed sizes, to say how far recency is
 * from the best any cache could do on the same reads (the offline optimum) and from one that
 * also counts reads (by frequency); both keep whole rows, so their hits are whole numbers.
 */
#include "kvbench_trace.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- the log, the offline optimum and the frequency cache -------------------------------- */

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
	if (g->n + n > g->room) {
		size_t room = g->room ? g->room : 4096;
		while (room < g->n + n)
			room *= 2;
		uint64_t *r = realloc(g->row, room * sizeof(*r));
		if (!r)
			return -1;
		g->row = r;
		g->room = room;
	}
	memcpy(g->row + g->n, rows, n * sizeof(*rows));
	g->n += n;
	g->first[++g->done] = g->n;
	return 0;
}

/* A row's tie-break: splitmix64's finalizer. */
static uint64_t row_hash(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	return x ^ x >> 31;
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
	return row_hash(a.row) > row_hash(b.row);
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

typedef struct fent {
	double w;
	uint64_t h, row;
} fent;

/* Whether a is kept before b: the larger weight, then the larger hash. */
static int fent_before(const fent *a, const fent *b)
{
	return a->w != b->w ? a->w > b->w : a->h > b->h;
}

/* Puts the k entries kept first at e[0, k) (in no order): a quickselect. */
static void keep_first(fent *e, size_t n, size_t k)
{
	size_t lo = 0, hi = n;
	while (hi - lo > 1) {
		const fent p = e[lo + (hi - lo) / 2];
		size_t a = lo, b = hi; /* [lo, a) before p, [b, hi) not before p */
		for (size_t i = lo; i < b;) {
			if (fent_before(&e[i], &p)) {
				fent t = e[a];
				e[a++] = e[i];
				e[i++] = t;
			} else if (fent_before(&p, &e[i])) {
				fent t = e[--b];
				e[b] = e[i];
				e[i] = t;
			} else {
				i++;
			}
		}
		/* [a, b) equal to p: one entry, the weights and hashes being distinct per row */
		if (k < a)
			hi = a;
		else if (k >= b)
			lo = b;
		else
			return;
	}
}

int kb_hot_frequency(const kb_hotlog *g, uint64_t cap, double decay, uint64_t *hits,
		     uint64_t *reads)
{
	*hits = *reads = 0;
	size_t most = 0; /* the most rows a step reads */
	for (uint32_t s = 0; s < g->done; s++)
		if (g->first[s + 1] - g->first[s] > most)
			most = g->first[s + 1] - g->first[s];
	const size_t room = (cap < g->rows ? cap : g->rows) + most;
	double *w = malloc(g->rows * sizeof(double) + 1);
	unsigned char *in = calloc(g->rows + 1, 1);
	fent *e = malloc(room * sizeof(fent) + 1);
	if (!w || !in || !e) {
		free(w);
		free(in);
		free(e);
		return -1;
	}
	size_t n = 0;    /* held rows: e[0, n) */
	double unit = 1; /* a read's weight at this step: 1 / decay per step, rescaled */
	for (uint32_t s = 0; s < g->done; s++) {
		if (s)
			unit /= decay;
		if (unit > 0x1p500) { /* rescale before the weights overflow */
			for (size_t i = 0; i < n; i++)
				w[e[i].row] *= 0x1p-500;
			unit *= 0x1p-500;
		}
		for (size_t i = g->first[s]; i < g->first[s + 1]; i++) {
			const uint64_t r = g->row[i];
			if (s) {
				*hits += in[r];
				(*reads)++;
			}
			if (!in[r]) {
				in[r] = 1;
				w[r] = 0; /* dropped rows forget */
				e[n++] = (fent){0, 0, r};
			}
			w[r] += unit;
		}
		if (n <= cap)
			continue;
		for (size_t i = 0; i < n; i++) {
			e[i].w = w[e[i].row];
			e[i].h = row_hash(e[i].row ^ (uint64_t)(s + 1) * 0x9e3779b97f4a7c15ull);
		}
		keep_first(e, n, cap);
		for (size_t i = cap; i < n; i++)
			in[e[i].row] = 0;
		n = cap;
	}
	free(w);
	free(in);
	free(e);
	return 0;
}
