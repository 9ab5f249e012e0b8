/* SPDX-License-Identifier: MIT */
/*
 * The list of a spilled fetch's misses (gpu/fetch.cuh; part of test_gpu_kernels, whose main runs
 * it), on fresh random selections of three sequences of two KV heads, some of their block table
 * entries NULL (on NVMe), after a warm-up fetch has put every third sink or selected row in the hot
 * cache and kvt_gpu_hot_move has moved that cache into a larger one, as a growth of the self-sized
 * cache does (so the lookup's hits below are the moved rows, found in their new sets, and the
 * fill's checked contents include them):
 * - kvt_gpu_fetch_lookup_spilled lists exactly the sink and selected rows of the sequences flagged
 *   KVT_GPU_FETCH_SPILLED that miss the hot cache and lie in NULL blocks, as (item, row, position),
 *   compared as sets (the device writes them in no fixed order): not the hits, not the rows of
 *   present blocks, not the window rows (read from the ring, whatever their block), nothing of the
 *   sequence not flagged, whose one selected row in a NULL block raises LOOKUP_BLOCK as before;
 *   nothing is written past the count, and a list too short for its misses counts them all and
 *   keeps the ones that fit, writing nothing past its end;
 * - kvt_gpu_spill_scatter writes addr[i] into row miss[i] where addr[i] != 0 and nothing else;
 * - kvt_gpu_fetch_fill then serves every row with its content (kvt_gpu_rows_copy), the staged ones
 *   from the host's staging, and reports the one row left unstaged as FILL_BLOCK;
 * - the launchers' argument checks (kvt_gpu_hot_move's too).
 * The list lives in pinned, mapped host memory, as gpu/spilled.c keeps it.
 */
#include "gpu_kernels.h"
#include "gpu/fetch.cuh"

enum { SP_D = 64, SP_RB = 4 * SP_D, SP_H = 2, SP_NS = 3, SP_NB = 5, SP_SETS = 2048 };
#define SP_BT KVT_BLOCK_TOKENS

/* One sequence of the batch. A NULL block whose rows are asked for is a spilled one when the
 * sequence is flagged, a missing one otherwise. */
struct seq_spec {
	unsigned long long uid;
	uint32_t flags, n_sink, n_indexed, n_tokens, wcap;
	uint8_t absent[SP_H][SP_NB]; /* 1: the block table entry is NULL */
};

static const struct seq_spec g_specs[SP_NS] = {
	/* spilled; its window (positions 1004..1099) partly in NULL blocks */
	{11, KVT_GPU_FETCH_SPILLED, 4, 1000, 1100, 128, {{1, 0, 1, 0, 1}, {0, 1, 0, 1, 1}}},
	/* not spilled: KV head 1's block 2 (positions 512..767) is missing; one selected row lies in
	 * it (index positions 508..599), and the window (604..649) */
	{22, 0, 4, 600, 650, 64, {{0, 0, 0, 0, 0}, {0, 0, 1, 0, 0}}},
	/* spilled, no sinks and no window; KV head 0 has every block */
	{33, KVT_GPU_FETCH_SPILLED, 0, 700, 700, 1, {{0, 0, 0, 0, 0}, {0, 0, 1, 1, 0}}},
};

/* The lone selected row of the missing block: sequence 1, KV head 1, index positions from 508. */
#define LONE_SEQ 1u
#define LONE_HEAD 1u
#define LONE_FROM 508u
#define LONE_SPAN 92u

/* Word j of the row of (sequence s, KV head h, token position p), as the host tier holds it. */
static uint16_t row_word(uint32_t s, uint32_t h, uint32_t p, uint32_t j)
{
	uint64_t x = g_seed ^ ((uint64_t)s << 56 | (uint64_t)h << 48 | (uint64_t)p << 16 | j);
	return (uint16_t)t_splitmix64(&x);
}

static void row_fill(void *dst, uint32_t s, uint32_t h, uint32_t p)
{
	for (uint32_t j = 0; j < SP_RB / 2; j++)
		((uint16_t *)dst)[j] = row_word(s, h, p, j);
}

/* The token position of row k of an item: sinks, the selected tokens, then the window. */
static uint32_t row_pos(const struct seq_spec *q, const uint32_t *sel, uint32_t m, uint32_t k)
{
	if (k < q->n_sink)
		return k;
	if (k < q->n_sink + m)
		return q->n_sink + sel[k - q->n_sink];
	return q->n_sink + q->n_indexed + (k - q->n_sink - m);
}

/* Whether the warm-up puts row k (a sink or selected row, at position p) in the hot cache. */
static bool warmed(uint32_t s, uint32_t h, uint32_t k, uint32_t p, uint32_t lone_pos)
{
	return k % 3 == 1 && !(s == LONE_SEQ && h == LONE_HEAD && p == lone_pos);
}

static int miss_cmp(const void *x, const void *y)
{
	const kvt_gpu_spill_miss *a = x, *b = y;
	if (a->item != b->item)
		return a->item < b->item ? -1 : 1;
	return a->k < b->k ? -1 : a->k > b->k;
}

static bool all_ff(const void *p, size_t bytes)
{
	for (size_t i = 0; i < bytes; i++)
		if (((const unsigned char *)p)[i] != 0xff)
			return false;
	return true;
}

/* The batch: selections, rows, block tables, rings and the fetch descriptors on the device. */
struct spill_batch {
	uint32_t *sel[SP_NS][SP_H], m[SP_NS][SP_H], lone_pos, ld, max_rows;
	uint32_t *wsel[SP_NS], wm[SP_NS][SP_H];
	void *dpool, *dtab, *dring[SP_NS], *dsel[SP_NS], *dseln[SP_NS], *dwsel[SP_NS],
		*dwseln[SP_NS];
	kvt_gpu_fetch_seq fs[SP_NS], ws[SP_NS];
};

static void make_selections(struct spill_batch *b)
{
	t_rng rng;
	seeded(&rng, 900);
	b->ld = 1;
	b->max_rows = 0;
	for (uint32_t s = 0; s < SP_NS; s++)
		for (uint32_t h = 0; h < SP_H; h++) {
			const struct seq_spec *q = &g_specs[s];
			const bool lone = s == LONE_SEQ && h == LONE_HEAD;
			uint32_t *sel = (uint32_t *)t_alloc(4 * (size_t)q->n_indexed), m = 0;
			for (uint32_t i = 0; i < (lone ? LONE_FROM : q->n_indexed); i++)
				if (t_below(&rng, 100) < 8)
					sel[m++] = i;
			if (lone) {
				sel[m] = LONE_FROM + t_below(&rng, LONE_SPAN);
				b->lone_pos = q->n_sink + sel[m++];
			}
			b->sel[s][h] = sel;
			b->m[s][h] = m;
			b->ld = m > b->ld ? m : b->ld;
			const uint32_t rows = q->n_tokens - q->n_indexed + m; /* + sinks + window */
			b->max_rows = rows > b->max_rows ? rows : b->max_rows;
		}
}

/* Rows in blocks (all present on the device: the test's tables leave the absent ones NULL), the
 * rings' window rows, and the warm-up's selections: the warmed rows' positions (its sinks 0). */
static void make_rows(struct spill_batch *b)
{
	const size_t blk = (size_t)SP_BT * SP_RB, n_blk = (size_t)SP_NS * SP_H * SP_NB;
	char *pool = (char *)t_alloc(blk * n_blk);
	void **tab = (void **)t_alloc(sizeof(void *) * 2 * n_blk);
	for (size_t x = 0; x < n_blk; x++)
		for (uint32_t r = 0; r < SP_BT; r++)
			row_fill(pool + x * blk + (size_t)r * SP_RB, (uint32_t)(x / (SP_H * SP_NB)),
				 (uint32_t)(x / SP_NB % SP_H), (uint32_t)(x % SP_NB) * SP_BT + r);
	b->dpool = dcopy(pool, blk * n_blk);
	for (size_t x = 0; x < n_blk; x++) {
		const struct seq_spec *q = &g_specs[x / (SP_H * SP_NB)];
		tab[n_blk + x] = (char *)b->dpool + x * blk;
		tab[x] = q->absent[x / SP_NB % SP_H][x % SP_NB] ? NULL : tab[n_blk + x];
	}
	b->dtab = dcopy(tab, sizeof(void *) * 2 * n_blk);
	for (uint32_t s = 0; s < SP_NS; s++) {
		const struct seq_spec *q = &g_specs[s];
		const size_t rbytes = (size_t)SP_H * q->wcap * SP_RB;
		char *ring = (char *)t_alloc(rbytes);
		uint32_t *wsel = (uint32_t *)t_alloc(4 * (size_t)SP_H * b->max_rows);
		for (uint32_t h = 0; h < SP_H; h++) {
			for (uint32_t i = q->n_indexed; i < q->n_tokens - q->n_sink; i++)
				row_fill(ring + ((size_t)h * q->wcap + i % q->wcap) * SP_RB, s, h,
					 q->n_sink + i);
			uint32_t wm = 0;
			for (uint32_t k = 0; k < q->n_sink + b->m[s][h]; k++) {
				const uint32_t p = row_pos(q, b->sel[s][h], b->m[s][h], k);
				if (warmed(s, h, k, p, b->lone_pos))
					wsel[(size_t)h * b->max_rows + wm++] = p;
			}
			b->wm[s][h] = wm;
		}
		b->dring[s] = dcopy(ring, rbytes);
		b->wsel[s] = wsel;
		b->dwsel[s] = dcopy(wsel, 4 * (size_t)SP_H * b->max_rows);
		b->dwseln[s] = dcopy(b->wm[s], sizeof b->wm[s]);
		free(ring);
	}
	free(pool);
	free(tab);
}

static void make_descriptors(struct spill_batch *b)
{
	const size_t n_blk = (size_t)SP_NS * SP_H * SP_NB;
	for (uint32_t s = 0; s < SP_NS; s++) {
		const struct seq_spec *q = &g_specs[s];
		uint32_t *packed = (uint32_t *)t_alloc(4 * (size_t)SP_H * b->ld);
		for (uint32_t h = 0; h < SP_H; h++)
			memcpy(packed + (size_t)h * b->ld, b->sel[s][h], 4 * (size_t)b->m[s][h]);
		b->dsel[s] = dcopy(packed, 4 * (size_t)SP_H * b->ld);
		b->dseln[s] = dcopy(b->m[s], sizeof b->m[s]);
		free(packed);
		b->fs[s] = (kvt_gpu_fetch_seq){
			.blocks = (void *const *)b->dtab + (size_t)s * SP_H * SP_NB,
			.sel = (const uint32_t *)b->dsel[s],
			.sel_n = (const uint32_t *)b->dseln[s],
			.ring = b->dring[s],
			.uid = q->uid,
			.sel_ld = b->ld,
			.blk_cap = SP_NB,
			.wcap = q->wcap,
			.n_sink = q->n_sink,
			.n_indexed = q->n_indexed,
			.n_tokens = q->n_tokens,
			.flags = q->flags,
		};
		/* the warm-up: every block present, no sinks, no window, the warmed positions */
		b->ws[s] = b->fs[s];
		b->ws[s].blocks = (void *const *)b->dtab + n_blk + (size_t)s * SP_H * SP_NB;
		b->ws[s].sel = (const uint32_t *)b->dwsel[s];
		b->ws[s].sel_n = (const uint32_t *)b->dwseln[s];
		b->ws[s].sel_ld = b->max_rows;
		b->ws[s].n_sink = 0;
		b->ws[s].n_indexed = b->ws[s].n_tokens = SP_NB * SP_BT;
		b->ws[s].flags = 0;
	}
}

static void free_batch(struct spill_batch *b)
{
	cudaFree(b->dpool);
	cudaFree(b->dtab);
	for (uint32_t s = 0; s < SP_NS; s++) {
		for (uint32_t h = 0; h < SP_H; h++)
			free(b->sel[s][h]);
		free(b->wsel[s]);
		cudaFree(b->dring[s]);
		cudaFree(b->dsel[s]);
		cudaFree(b->dseln[s]);
		cudaFree(b->dwsel[s]);
		cudaFree(b->dwseln[s]);
	}
}

/* The rows the list must hold (by item, then row) and the premises of the case. */
static uint32_t wanted_list(const struct spill_batch *b, kvt_gpu_spill_miss *want)
{
	uint32_t n = 0, hit_null = 0, present = 0;
	for (uint32_t s = 0; s < SP_NS; s++)
		for (uint32_t h = 0; g_specs[s].flags && h < SP_H; h++)
			for (uint32_t k = 0; k < g_specs[s].n_sink + b->m[s][h]; k++) {
				const uint32_t p = row_pos(&g_specs[s], b->sel[s][h], b->m[s][h], k);
				const bool absent = g_specs[s].absent[h][p / SP_BT];
				if (warmed(s, h, k, p, b->lone_pos))
					hit_null += absent;
				else if (absent)
					want[n++] = (kvt_gpu_spill_miss){s * SP_H + h, k, (int32_t)p, 0};
				else
					present++;
			}
	T_CHECK(n > 1 && hit_null > 0 && present > 0,
		"premises (seed %llu): %u misses in NULL blocks (wanted > 1), %u hits in NULL blocks, "
		"%u misses in present blocks (wanted > 0)",
		(unsigned long long)g_seed, n, hit_null, present);
	return n;
}

/* A hot cache of `sets` sets, every way empty. */
static kvt_gpu_hot hot_alloc(uint32_t sets)
{
	const size_t ways = (size_t)sets * KVT_GPU_HOT_WAYS;
	kvt_gpu_hot hot;
	memset(&hot, 0, sizeof hot);
	hot.tag_hi = (unsigned long long *)dpoison(8 * ways);
	hot.tag_lo = (unsigned long long *)dpoison(8 * ways);
	hot.last_use = (uint32_t *)dpoison(4 * ways);
	hot.rows = dpoison(ways * SP_RB);
	hot.sets = sets;
	CU(cudaMemset(hot.tag_hi, 0, 8 * ways));
	CU(cudaMemset(hot.tag_lo, 0, 8 * ways));
	CU(cudaMemset(hot.last_use, 0, 4 * ways));
	return hot;
}

static void hot_free(kvt_gpu_hot *hot)
{
	cudaFree(hot->tag_hi);
	cudaFree(hot->tag_lo);
	cudaFree(hot->last_use);
	cudaFree(hot->rows);
}

/* After the lookup: items, positions, hits in the cache, misses NULL, window rows in the ring. */
static void check_lookup(const struct spill_batch *b, const void **rows, const void *drows,
			 const void *dpos, const void *ditems, const kvt_gpu_hot *hot, int *bad)
{
	const uint32_t NI = SP_NS * SP_H, mr = b->max_rows;
	int32_t *pos = (int32_t *)t_alloc(4 * (size_t)NI * mr);
	kvt_gpu_rows *items = (kvt_gpu_rows *)t_alloc(sizeof(kvt_gpu_rows) * NI);
	fetch(pos, dpos, 4 * (size_t)NI * mr);
	fetch(items, ditems, sizeof(kvt_gpu_rows) * NI);
	const uintptr_t h0 = (uintptr_t)hot->rows,
			h1 = h0 + (size_t)hot->sets * KVT_GPU_HOT_WAYS * SP_RB;
	for (uint32_t s = 0; s < SP_NS; s++)
		for (uint32_t h = 0; h < SP_H; h++) {
			const struct seq_spec *q = &g_specs[s];
			const uint32_t item = s * SP_H + h, m = b->m[s][h], S = q->n_sink,
				       n = q->n_tokens - q->n_indexed + m;
			T_SOFT(bad,
			       items[item].n == n &&
				       items[item].rows == (const void *const *)drows + (size_t)item * mr,
			       "item %u: n %u (wanted %u), rows %p (wanted %p)", item, items[item].n, n,
			       (const void *)items[item].rows,
			       (const void *)((const void *const *)drows + (size_t)item * mr));
			for (uint32_t k = 0; k < n; k++) {
				const size_t j = (size_t)item * mr + k;
				const uint32_t p = row_pos(q, b->sel[s][h], m, k);
				const uintptr_t r = (uintptr_t)rows[j];
				T_SOFT(bad, pos[j] == (int32_t)p, "item %u row %u: position %d, wanted %u",
				       item, k, pos[j], p);
				if (k >= S + m) {
					const uint32_t i = p - S;
					T_SOFT(bad,
					       r == (uintptr_t)b->dring[s] +
							    ((size_t)h * q->wcap + i % q->wcap) * SP_RB,
					       "item %u window row %u (position %u): %p, not its ring slot",
					       item, k, p, rows[j]);
				} else if (warmed(s, h, k, p, b->lone_pos)) {
					T_SOFT(bad, r >= h0 && r < h1,
					       "item %u row %u (position %u): %p, wanted a hit", item, k, p,
					       rows[j]);
				} else {
					T_SOFT(bad, r == 0, "item %u row %u (position %u): %p, wanted a miss",
					       item, k, p, rows[j]);
				}
			}
		}
	free(pos);
	free(items);
}

/* The device's list (sorted here) against the wanted one. */
static void check_list(kvt_gpu_spill_miss *got, uint32_t n, const kvt_gpu_spill_miss *want,
		       uint32_t n_want, int *bad)
{
	T_SOFT(bad, n == n_want, "the list counts %u misses of spilled blocks, wanted %u", n,
	       n_want);
	if (n != n_want)
		return;
	qsort(got, n, sizeof *got, miss_cmp);
	for (uint32_t i = 0; i < n; i++)
		T_SOFT(bad,
		       got[i].item == want[i].item && got[i].k == want[i].k &&
			       got[i].pos == want[i].pos && got[i].reserved == 0,
		       "list entry %u (sorted): item %u row %u position %d reserved %u, wanted item %u "
		       "row %u position %d",
		       i, got[i].item, got[i].k, got[i].pos, got[i].reserved, want[i].item, want[i].k,
		       want[i].pos);
}

/* A list of cap entries, fewer than the misses: all counted, cap of them kept, none past it. */
static void check_short_list(const struct spill_batch *b, const kvt_gpu_fetch_seq *dfs,
			     kvt_gpu_hot hot, const kvt_gpu_spill_miss *want, uint32_t n_want,
			     int *bad)
{
	const uint32_t NI = SP_NS * SP_H, cap = n_want / 2;
	kvt_gpu_spill_miss *miss = NULL;
	CU(cudaHostAlloc((void **)&miss, sizeof *miss * (cap + 1), cudaHostAllocMapped));
	memset(miss, 0xff, sizeof *miss * (cap + 1));
	uint32_t *dcount = (uint32_t *)dpoison(4), n = 0;
	CU(cudaMemset(dcount, 0, 4));
	void *drows = dpoison(sizeof(void *) * NI * b->max_rows),
	     *ditems = dpoison(sizeof(kvt_gpu_rows) * NI);
	const kvt_gpu_spill_list list = {dcount, miss, cap};
	int rc = kvt_gpu_fetch_lookup_spilled(SP_RB, SP_NS, SP_H, dfs, hot, 2, (const void **)drows,
					      (kvt_gpu_rows *)ditems, b->max_rows, NULL, list, NULL,
					      NULL);
	T_CHECK(rc == 0, "kvt_gpu_fetch_lookup_spilled, list of %u: %d", cap, rc);
	fetch(&n, dcount, 4);
	T_SOFT(bad, n == n_want, "a list of %u entries counts %u misses, wanted %u", cap, n, n_want);
	qsort(miss, cap, sizeof *miss, miss_cmp);
	for (uint32_t i = 0; i < cap; i++) {
		const kvt_gpu_spill_miss *w =
			(const kvt_gpu_spill_miss *)bsearch(&miss[i], want, n_want, sizeof *want,
							    miss_cmp);
		T_SOFT(bad, w && w->pos == miss[i].pos && (i == 0 || miss_cmp(&miss[i - 1], &miss[i])),
		       "a list of %u: entry %u (item %u row %u position %d) not wanted or twice", cap,
		       i, miss[i].item, miss[i].k, miss[i].pos);
	}
	T_SOFT(bad, all_ff(&miss[cap], sizeof *miss), "a list of %u: its end was written", cap);
	cudaFreeHost(miss);
	cudaFree(dcount);
	cudaFree(drows);
	cudaFree(ditems);
}

/*
 * Stage every listed row but the first (the host's reads), scatter, and check the rows array: the
 * staged addresses in their rows, every other element as the lookup left it. One more entry
 * (miss[n], room for it in the list) names a hit, item 0's row 1 (a sink), with address 0: its
 * row must keep its hot-cache pointer.
 */
static void check_scatter(const struct spill_batch *b, kvt_gpu_spill_miss *miss, uint32_t n,
			  const void **rows, void *drows, uint64_t *addr, char *stage, int *bad)
{
	const size_t nr = (size_t)SP_NS * SP_H * b->max_rows;
	const void **want = (const void **)t_alloc(sizeof(void *) * nr),
		   **got = (const void **)t_alloc(sizeof(void *) * nr);
	memcpy(want, rows, sizeof(void *) * nr);
	T_CHECK(rows[1] != NULL && warmed(0, 0, 1, 1, b->lone_pos), "item 0 row 1 is no hit: %p",
		rows[1]);
	miss[n] = (kvt_gpu_spill_miss){0, 1, 1, 0};
	addr[n] = 0;
	addr[0] = 0; /* not staged: left NULL, for the fill to report */
	for (uint32_t i = 1; i < n; i++) {
		row_fill(stage + (size_t)i * SP_RB, miss[i].item / SP_H, miss[i].item % SP_H,
			 (uint32_t)miss[i].pos);
		addr[i] = (uintptr_t)(stage + (size_t)i * SP_RB) | KVT_GPU_ROW_STAGED;
		want[(size_t)miss[i].item * b->max_rows + miss[i].k] = (const void *)(uintptr_t)addr[i];
	}
	int rc = kvt_gpu_spill_scatter(miss, addr, n + 1, (const void **)drows, b->max_rows, NULL);
	T_CHECK(rc == 0, "kvt_gpu_spill_scatter of %u: %d", n + 1, rc);
	fetch(got, drows, sizeof(void *) * nr);
	for (size_t j = 0; j < nr; j++)
		T_SOFT(bad, got[j] == want[j], "after the scatter, element %zu (item %zu row %zu): %p, "
		       "wanted %p", j, j / b->max_rows, j % b->max_rows, got[j], want[j]);
	free(want);
	free(got);
}

/* After the fill: every served row's content; the unserved two point at their ring. */
static void check_served(const struct spill_batch *b, const kvt_gpu_spill_miss *unstaged,
			 void *drows, void *ditems, int *bad)
{
	const uint32_t NI = SP_NS * SP_H, mr = b->max_rows, half = SP_RB / 2;
	const size_t nr = (size_t)NI * mr;
	const void **rows = (const void **)t_alloc(sizeof(void *) * nr);
	char *hk = (char *)t_alloc(nr * half), *hv = (char *)t_alloc(nr * half), row[SP_RB];
	void *dk = dpoison(nr * half), *dv = dpoison(nr * half);
	fetch(rows, drows, sizeof(void *) * nr);
	int rc = kvt_gpu_rows_copy(SP_D, NI, (const kvt_gpu_rows *)ditems, mr, NULL, dk, dv, NULL,
				   mr, NULL);
	T_CHECK(rc == 0, "kvt_gpu_rows_copy: %d", rc);
	fetch(hk, dk, nr * half);
	fetch(hv, dv, nr * half);
	for (uint32_t s = 0; s < SP_NS; s++)
		for (uint32_t h = 0; h < SP_H; h++) {
			const struct seq_spec *q = &g_specs[s];
			const uint32_t item = s * SP_H + h, m = b->m[s][h],
				       n = q->n_tokens - q->n_indexed + m;
			for (uint32_t k = 0; k < n; k++) {
				const size_t j = (size_t)item * mr + k;
				const uint32_t p = row_pos(q, b->sel[s][h], m, k);
				if ((item == unstaged->item && k == unstaged->k) ||
				    (s == LONE_SEQ && h == LONE_HEAD && p == b->lone_pos)) {
					T_SOFT(bad, rows[j] == b->dring[s],
					       "item %u row %u (position %u), not served: %p, wanted "
					       "the ring %p", item, k, p, rows[j], b->dring[s]);
					continue;
				}
				row_fill(row, s, h, p);
				T_SOFT(bad,
				       !memcmp(hk + j * half, row, half) &&
					       !memcmp(hv + j * half, row + half, half),
				       "item %u row %u (position %u, seed %llu): K or V differs from "
				       "the host tier's row",
				       item, k, p, (unsigned long long)g_seed);
			}
		}
	cudaFree(dk);
	cudaFree(dv);
	free(rows);
	free(hk);
	free(hv);
}

void test_spill_list(void **state)
{
	(void)state;
	struct spill_batch b;
	memset(&b, 0, sizeof b);
	make_selections(&b);
	make_rows(&b);
	make_descriptors(&b);
	const uint32_t NI = SP_NS * SP_H, mr = b.max_rows;
	const size_t nr = (size_t)NI * mr;
	kvt_gpu_hot hot = hot_alloc(SP_SETS);
	void *dfs = dcopy(b.fs, sizeof b.fs), *dws = dcopy(b.ws, sizeof b.ws);
	void *drows = dpoison(sizeof(void *) * nr), *ditems = dpoison(sizeof(kvt_gpu_rows) * NI),
	     *dpos = dpoison(4 * nr);
	unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
	CU(cudaMemset(derr, 0, 8));
	/* the warm-up, epoch 1: each set takes at most one row of each of the 6 items (positions
	 * below SP_SETS), so every miss claims one of its 8 ways */
	int rc = kvt_gpu_fetch(SP_RB, SP_NS, SP_H, (const kvt_gpu_fetch_seq *)dws, hot, 1,
			       (const void **)drows, (kvt_gpu_rows *)ditems, mr, NULL, derr, NULL);
	T_CHECK(rc == 0, "warm-up kvt_gpu_fetch: %d", rc);
	fetch(&herr, derr, 8);
	T_CHECK(herr == 0, "warm-up: error word 0x%llx", herr);
	/* the warmed rows into a cache of 3 SP_SETS + 1 sets, where each lands in another set (at
	 * most 6 of them in one: none is dropped) */
	kvt_gpu_hot grown = hot_alloc(3 * SP_SETS + 1);
	rc = kvt_gpu_hot_move(hot, grown, SP_RB, NULL);
	T_CHECK(rc == 0, "kvt_gpu_hot_move: %d", rc);
	CU(cudaDeviceSynchronize());
	hot_free(&hot);
	hot = grown;

	/* the lookup, epoch 2, into a list as long as gpu/spilled.c makes it */
	uint32_t cap = 0;
	for (uint32_t s = 0; s < SP_NS; s++)
		cap += g_specs[s].flags ? SP_H * mr : 0;
	kvt_gpu_spill_miss *want = (kvt_gpu_spill_miss *)t_alloc(sizeof *want * cap);
	const uint32_t n_want = wanted_list(&b, want);
	kvt_gpu_spill_miss *miss = NULL;
	CU(cudaHostAlloc((void **)&miss, sizeof *miss * cap, cudaHostAllocMapped));
	memset(miss, 0xff, sizeof *miss * cap);
	uint32_t *dcount = (uint32_t *)dpoison(4), n = 0;
	CU(cudaMemset(dcount, 0, 4));
	CU(cudaMemset(derr, 0, 8));
	const kvt_gpu_spill_list list = {dcount, miss, cap};
	rc = kvt_gpu_fetch_lookup_spilled(SP_RB, SP_NS, SP_H, (const kvt_gpu_fetch_seq *)dfs, hot, 2,
					  (const void **)drows, (kvt_gpu_rows *)ditems, mr,
					  (int32_t *)dpos, list, derr, NULL);
	T_CHECK(rc == 0, "kvt_gpu_fetch_lookup_spilled: %d", rc);
	fetch(&n, dcount, 4);
	fetch(&herr, derr, 8);
	int bad = 0;
	/* the sequence not flagged: its row in a missing block is reported, not listed */
	T_SOFT(&bad,
	       KVT_GPU_ERR_CODE(herr) == KVT_GPU_ERR_RANGE &&
		       KVT_GPU_ERR_SITE(herr) == KVT_GPU_SITE_LOOKUP_BLOCK &&
		       KVT_GPU_ERR_WHERE(herr) == LONE_SEQ * SP_H + LONE_HEAD &&
		       KVT_GPU_ERR_INDEX(herr) == b.lone_pos,
	       "lookup: error word 0x%llx, wanted LOOKUP_BLOCK of item %u position %u", herr,
	       LONE_SEQ * SP_H + LONE_HEAD, b.lone_pos);
	T_SOFT(&bad, n > cap || all_ff(miss + n, sizeof *miss * (cap - n)),
	       "the list was written past its count %u", n);
	const void **rows = (const void **)t_alloc(sizeof(void *) * nr);
	fetch(rows, drows, sizeof(void *) * nr);
	check_lookup(&b, rows, drows, dpos, ditems, &hot, &bad);
	check_list(miss, n, want, n_want, &bad); /* sorts miss, as gpu/spilled.c does */
	T_CHECK(bad == 0, "%d checks of the lookup and its list failed (seed %llu)", bad,
		(unsigned long long)g_seed);
	check_short_list(&b, (const kvt_gpu_fetch_seq *)dfs, hot, want, n_want, &bad);

	uint64_t *addr = NULL;
	char *stage = NULL;
	T_CHECK(n < cap, "no room in the list for the scatter's extra entry: %u of %u", n, cap);
	CU(cudaHostAlloc((void **)&addr, sizeof *addr * (n + 1), cudaHostAllocMapped));
	CU(cudaHostAlloc((void **)&stage, (size_t)SP_RB * n, cudaHostAllocMapped));
	check_scatter(&b, miss, n, rows, drows, addr, stage, &bad);
	CU(cudaMemset(derr, 0, 8));
	rc = kvt_gpu_fetch_fill(SP_RB, SP_NS, SP_H, (const kvt_gpu_fetch_seq *)dfs, hot, 2,
				(const void **)drows, (const kvt_gpu_rows *)ditems, mr, derr, NULL);
	T_CHECK(rc == 0, "kvt_gpu_fetch_fill: %d", rc);
	fetch(&herr, derr, 8);
	T_SOFT(&bad,
	       KVT_GPU_ERR_CODE(herr) == KVT_GPU_ERR_RANGE &&
		       KVT_GPU_ERR_SITE(herr) == KVT_GPU_SITE_FILL_BLOCK &&
		       KVT_GPU_ERR_WHERE(herr) == miss[0].item &&
		       KVT_GPU_ERR_INDEX(herr) == (uint32_t)miss[0].pos,
	       "fill: error word 0x%llx, wanted FILL_BLOCK of item %u position %d", herr,
	       miss[0].item, miss[0].pos);
	check_served(&b, &miss[0], drows, ditems, &bad);
	printf("spill list: %u misses of spilled blocks listed, %u staged (seed %llu)\n", n, n - 1,
	       (unsigned long long)g_seed);
	T_CHECK(bad == 0, "%d checks of the scatter and fill failed (seed %llu)", bad,
		(unsigned long long)g_seed);
	cudaFreeHost(miss);
	cudaFreeHost(addr);
	cudaFreeHost(stage);
	hot_free(&hot);
	cudaFree(dfs);
	cudaFree(dws);
	cudaFree(drows);
	cudaFree(ditems);
	cudaFree(dpos);
	cudaFree(derr);
	cudaFree(dcount);
	free(rows);
	free(want);
	free_batch(&b);
}

void test_spill_arguments(void **state)
{
	(void)state;
	void *p = dpoison(1 << 16);
	kvt_gpu_hot hot;
	memset(&hot, 0, sizeof hot);
	const kvt_gpu_spill_list none = {(uint32_t *)p, NULL, 4},
				 list = {(uint32_t *)p, (kvt_gpu_spill_miss *)p, 4};
	T_CHECK(kvt_gpu_fetch_lookup_spilled(256, 1, 1, p, hot, 1, p, p, 8, NULL, none, NULL,
					     NULL) == -EINVAL,
		"a list of 4 entries without their memory");
	T_CHECK(kvt_gpu_fetch_lookup_spilled(100, 1, 1, p, hot, 1, p, p, 8, NULL, list, NULL,
					     NULL) == -EINVAL,
		"lookup with a list: row_bytes 100");
	T_CHECK(kvt_gpu_fetch_lookup_spilled(256, 1, 1, NULL, hot, 1, p, p, 8, NULL, list, NULL,
					     NULL) == -EINVAL,
		"lookup with a list: seqs NULL");
	T_CHECK(kvt_gpu_spill_scatter(NULL, p, 1, p, 8, NULL) == -EINVAL, "scatter: miss NULL");
	T_CHECK(kvt_gpu_spill_scatter(p, NULL, 1, p, 8, NULL) == -EINVAL, "scatter: addr NULL");
	T_CHECK(kvt_gpu_spill_scatter(p, p, 1, NULL, 8, NULL) == -EINVAL, "scatter: rows NULL");
	T_CHECK(kvt_gpu_spill_scatter(NULL, NULL, 0, p, 8, NULL) == 0, "scatter of nothing");
	kvt_gpu_hot a = hot_alloc(4), b = hot_alloc(8), none_hot;
	memset(&none_hot, 0, sizeof none_hot);
	T_CHECK(kvt_gpu_hot_move(b, a, SP_RB, NULL) == -EINVAL, "move: into fewer sets");
	T_CHECK(kvt_gpu_hot_move(a, b, 100, NULL) == -EINVAL, "move: row_bytes 100");
	T_CHECK(kvt_gpu_hot_move(none_hot, none_hot, SP_RB, NULL) == -EINVAL, "move: into no sets");
	T_CHECK(kvt_gpu_hot_move(none_hot, b, SP_RB, NULL) == 0, "move: from an empty cache");
	kvt_gpu_hot half = b;
	half.rows = NULL;
	T_CHECK(kvt_gpu_hot_move(a, half, SP_RB, NULL) == -EINVAL, "move: into a cache, no rows");
	T_CHECK(kvt_gpu_hot_move(half, b, SP_RB, NULL) == -EINVAL, "move: from a cache, no rows");
	hot_free(&a);
	hot_free(&b);
	CU(cudaDeviceSynchronize());
	cudaFree(p);
}
