/* SPDX-License-Identifier: MIT */
/*
 * Exact attention over gathered rows, fp32 accumulation, one pass with a running maximum. The
 * pass is split into begin / feed / finish so that a caller may feed the rows in pieces (a causal
 * chunk, rows read block by block): each query does the same operations in the same order however
 * the rows are cut, so its result is bit for bit what one call over all its rows gives.
 *
 * The rule (tests/test_attention.c writes it out and checks it bit for bit): row by row, each
 * query's logit is a float sum of q[j] * k[j] over j ascending from 0, then the running maximum,
 * sum and accumulators are updated as take_rows says. The pass does that arithmetic with four-lane
 * vectors whose lanes are rows (the logits) or elements (the accumulators), never reordering a
 * sum, so the bits are the scalar rule's; the CUDA backend's twins and the score corrections rely
 * on them. It reads rows where they lie (a gather's pointers) and prefetches them AHEAD rows ahead.
 * bench/cpu_miss_attend measures it against a read of the same rows.
 */
#include <math.h>
#include <stdbool.h>

#include "half_vec.h"
#include "internal.h"

void kvt_attention_begin(uint32_t d, uint32_t g, float *m, float *l, float *acc)
{
	for (uint32_t h = 0; h < g; h++) {
		m[h] = -INFINITY;
		l[h] = 0.0f;
	}
	for (size_t j = 0; j < (size_t)g * d; j++)
		acc[j] = 0.0f;
}

/* Rows converted and scored together (a query's logits of a block are two four-lane vectors, lane
 * r the row's), queries scored together, and how many rows ahead the pass prefetches (as the read
 * peer of bench/cpu_miss_attend does; 8 to 32 measured the same). */
enum { BLK = 8, QUAD = 4, AHEAD = 16 };

/*
 * One query takes n rows of a block in order (their logits raw, their V converted in v): the
 * running maximum and sum row by row, then each element of acc the rows' rescales and weighted V,
 * row by row as well, sixteen elements at a time held in registers: every element does what a
 * row-by-row pass does to it, in the same order.
 */
static inline void take_rows(uint32_t d, float scale, uint32_t n, const float *raw,
			     const float (*v)[KVT_MAX_HEAD_DIM], float *m, float *l, float *acc)
{
	float w[BLK], f[BLK];
	for (uint32_t r = 0; r < n; r++) {
		float s = raw[r] * scale;
		f[r] = 1.0f; /* no rescale: acc keeps its value (multiplying by 1 is exact) */
		if (s > *m) {
			/* rescale what was accumulated under the old maximum */
			f[r] = expf(*m - s);
			*l *= f[r];
			*m = s;
		}
		w[r] = expf(s - *m);
		*l += w[r];
	}
	for (uint32_t j = 0; j < d; j += 16) {
		kvt_v4f a0 = kvt_v4f_load(acc + j), a1 = kvt_v4f_load(acc + j + 4),
			a2 = kvt_v4f_load(acc + j + 8), a3 = kvt_v4f_load(acc + j + 12);
		for (uint32_t r = 0; r < n; r++) {
			if (f[r] != 1.0f) {
				a0 *= f[r];
				a1 *= f[r];
				a2 *= f[r];
				a3 *= f[r];
			}
			a0 += w[r] * kvt_v4f_load(v[r] + j);
			a1 += w[r] * kvt_v4f_load(v[r] + j + 4);
			a2 += w[r] * kvt_v4f_load(v[r] + j + 8);
			a3 += w[r] * kvt_v4f_load(v[r] + j + 12);
		}
		kvt_v4f_store(acc + j, a0);
		kvt_v4f_store(acc + j + 4, a1);
		kvt_v4f_store(acc + j + 8, a2);
		kvt_v4f_store(acc + j + 12, a3);
	}
}

/*
 * The logits q.k of four queries (q_h at q + h d) over a block's rows (kt: K transposed, kt[j] the
 * BLK rows' element j): raw[h][r] = sum over j ascending of q_h[j] * k_r[j] in float, from 0. The
 * lanes of a vector are rows, so each sum keeps its order; the eight vectors are independent
 * chains.
 */
static void dots4(uint32_t d, const float *q, const float (*kt)[BLK], float (*raw)[BLK])
{
	kvt_v4f a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
	for (uint32_t j = 0; j < d; j++) {
		const kvt_v4f k0 = kvt_v4f_load(kt[j]), k1 = kvt_v4f_load(kt[j] + 4);
		const float x0 = q[j], x1 = q[d + j], x2 = q[2 * d + j], x3 = q[3 * d + j];
		a0 += x0 * k0;
		b0 += x0 * k1;
		a1 += x1 * k0;
		b1 += x1 * k1;
		a2 += x2 * k0;
		b2 += x2 * k1;
		a3 += x3 * k0;
		b3 += x3 * k1;
	}
	kvt_v4f_store(raw[0], a0);
	kvt_v4f_store(raw[0] + 4, b0);
	kvt_v4f_store(raw[1], a1);
	kvt_v4f_store(raw[1] + 4, b1);
	kvt_v4f_store(raw[2], a2);
	kvt_v4f_store(raw[2] + 4, b2);
	kvt_v4f_store(raw[3], a3);
	kvt_v4f_store(raw[3] + 4, b3);
}

/* The same for one query. */
static void dots1(uint32_t d, const float *q, const float (*kt)[BLK], float *raw)
{
	kvt_v4f a = {0}, b = {0};
	for (uint32_t j = 0; j < d; j++) {
		a += q[j] * kvt_v4f_load(kt[j]);
		b += q[j] * kvt_v4f_load(kt[j] + 4);
	}
	kvt_v4f_store(raw, a);
	kvt_v4f_store(raw + 4, b);
}

/*
 * K of a block's rows (nb of BLK; the lanes past them zeros, their logits unused) transposed into
 * kt, four rows by four elements at a time, and their V into v.
 */
static void convert_block(uint32_t d, uint32_t dtype, uint32_t nb, const void *const *rows,
			  float (*kt)[BLK], float (*v)[KVT_MAX_HEAD_DIM])
{
	for (uint32_t r0 = 0; r0 < BLK; r0 += 4)
		for (uint32_t j = 0; j < d; j += 4) {
			kvt_v4f k[4];
			for (uint32_t e = 0; e < 4; e++)
				k[e] = r0 + e < nb ? kvt_load4(rows[r0 + e], j, dtype)
						   : (kvt_v4f){0};
			/* a 4 x 4 transpose: t0 = k0[0] k1[0] k0[1] k1[1], ... */
			const kvt_v4f t0 = KVT_SHUFFLE4(k[0], k[1], 0, 4, 1, 5),
				      t1 = KVT_SHUFFLE4(k[0], k[1], 2, 6, 3, 7),
				      t2 = KVT_SHUFFLE4(k[2], k[3], 0, 4, 1, 5),
				      t3 = KVT_SHUFFLE4(k[2], k[3], 2, 6, 3, 7);
			kvt_v4f_store(kt[j] + r0, KVT_SHUFFLE4(t0, t2, 0, 1, 4, 5));
			kvt_v4f_store(kt[j + 1] + r0, KVT_SHUFFLE4(t0, t2, 2, 3, 6, 7));
			kvt_v4f_store(kt[j + 2] + r0, KVT_SHUFFLE4(t1, t3, 0, 1, 4, 5));
			kvt_v4f_store(kt[j + 3] + r0, KVT_SHUFFLE4(t1, t3, 2, 3, 6, 7));
		}
	for (uint32_t r = 0; r < nb; r++)
		for (uint32_t j = 0; j < d; j += 4)
			kvt_v4f_store(v[r] + j, kvt_load4(rows[r], d + j, dtype));
}

/* Start loading the n rows of a block: they lie anywhere in memory (4 d bytes each). */
static void prefetch_rows(uint32_t d, uint32_t n, const void *const *rows)
{
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t at = 0; at < 4 * d; at += 64)
			__builtin_prefetch((const char *)rows[i] + at);
}

/*
 * kvt_attention_feed, query h's logit of row i also into logits[h * lstride + i] (logits NULL:
 * not kept). A block of rows is converted once for the group, their logits formed for four queries
 * at a time, then each query takes the block's rows in order: every query does what the row-by-row
 * pass does, in the same order, so the bits are the same. Rows are prefetched AHEAD rows ahead.
 */
static void feed(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
		 const uint32_t *end, uint32_t first, uint32_t n, const void *const *rows, float *m,
		 float *l, float *acc, float *logits, size_t lstride)
{
	float kt[KVT_MAX_HEAD_DIM][BLK], v[BLK][KVT_MAX_HEAD_DIM], raw[QUAD][BLK];
	prefetch_rows(d, n < AHEAD ? n : AHEAD, rows);
	for (uint32_t i0 = 0; i0 < n; i0 += BLK) {
		const uint32_t nb = n - i0 < BLK ? n - i0 : BLK;
		const uint32_t nn = n - i0 <= AHEAD ? 0 : n - i0 - AHEAD < BLK ? n - i0 - AHEAD : BLK;
		prefetch_rows(d, nn, rows + i0 + AHEAD);
		convert_block(d, dtype, nb, rows + i0, kt, v);
		for (uint32_t h0 = 0; h0 < g; h0 += QUAD) {
			const uint32_t nq = g - h0 < QUAD ? g - h0 : QUAD;
			const float *qh = q + (size_t)h0 * d;
			bool live = !end;
			for (uint32_t e = 0; e < nq && !live; e++)
				live = first + i0 < end[h0 + e];
			if (!live)
				continue; /* every query of the four ends before the block */
			if (nq == QUAD)
				dots4(d, qh, (const float (*)[BLK])kt, raw);
			else
				for (uint32_t e = 0; e < nq; e++)
					dots1(d, qh + (size_t)e * d, (const float (*)[BLK])kt, raw[e]);
			for (uint32_t e = 0; e < nq; e++) {
				const uint32_t h = h0 + e;
				uint32_t nr = nb; /* rows ascend: those past the query's end are a tail */
				if (end)
					nr = first + i0 >= end[h] ? 0
					     : end[h] - (first + i0) < nb ? end[h] - (first + i0) : nb;
				take_rows(d, scale, nr, raw[e], (const float (*)[KVT_MAX_HEAD_DIM])v,
					  &m[h], &l[h], acc + (size_t)h * d);
				if (logits)
					for (uint32_t r = 0; r < nr; r++)
						logits[h * lstride + i0 + r] = raw[e][r];
			}
		}
	}
}

void kvt_attention_feed(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			const uint32_t *end, uint32_t first, uint32_t n, const void *const *rows,
			float *m, float *l, float *acc)
{
	feed(d, dtype, scale, g, q, end, first, n, rows, m, l, acc, NULL, 0);
}

void kvt_attention_finish(uint32_t d, uint32_t g, const float *l, const float *acc, float *out)
{
	for (uint32_t h = 0; h < g; h++) {
		float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
		for (uint32_t j = 0; j < d; j++)
			out[(size_t)h * d + j] = acc[(size_t)h * d + j] * inv;
	}
}

void kvt_attention_group(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			 uint32_t n, const void *const *rows, float *out, float *logits)
{
	float acc[KVT_ATTENTION_GROUP * KVT_MAX_HEAD_DIM];
	float m[KVT_ATTENTION_GROUP], l[KVT_ATTENTION_GROUP];
	for (uint32_t g0 = 0; g0 < g; g0 += KVT_ATTENTION_GROUP) {
		const uint32_t gn = g - g0 < KVT_ATTENTION_GROUP ? g - g0 : KVT_ATTENTION_GROUP;
		kvt_attention_begin(d, gn, m, l, acc);
		feed(d, dtype, scale, gn, q + (size_t)g0 * d, NULL, 0, n, rows, m, l, acc,
		     logits ? logits + (size_t)g0 * n : NULL, n);
		kvt_attention_finish(d, gn, l, acc, out + (size_t)g0 * d);
	}
}

void kvt_attention(uint32_t d, uint32_t dtype, float scale, const float *q, uint32_t n,
		   const void *const *rows, float *out)
{
	kvt_attention_group(d, dtype, scale, 1, q, n, rows, out, NULL);
}
