/* SPDX-License-Identifier: MIT */
/*
 * The CPU reference kernels, pure functions of their arguments shared by lib/, gpu/ (the CUDA
 * kernels' twins) and the tests: numbers, the estimator, the Top-p selection and exact attention.
 * Part of internal.h, which includes it. Never installed.
 */
#ifndef KVT_KERNELS_H
#define KVT_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "constants.h"

/* ---- numbers (lib/half.h, lib/rotation.c) ------------------------------------------------ */

/*
 * The rotation of `layer`: R = P^T, an orthogonal d x d matrix, row-major, so that y = R r.
 * Gaussian entries from a counter-based generator and an arithmetic-only logarithm, then Householder
 * QR in double with the signs of R's diagonal fixed (Haar distributed). Uses only +, -, *, /, sqrt
 * with contraction disabled, so every IEEE platform produces the same bits for a seed.
 * Returns 0 or -ENOMEM (scratch of 2 d^2 + 2 d doubles).
 */
int kvt_rotation_generate(uint64_t seed, uint32_t layer, uint32_t d, float *rot);

/* ---- the estimator (lib/estimate.c) ----------------------------------------------------- */

/*
 * Index `n` keys: for key i (floats at keys + i * key_stride), r = k - c_k, y = R r / ||r||,
 * code = [y > 0] packed little-endian into d/32 words (bit j of word w is coordinate 32w + j),
 * sigma = ||r|| / alpha with alpha = ||y||_1 / sqrt(d), beta = <c_q, k>; sigma and beta stored as
 * fp16 bits, saturated: +-65504 beyond the fp16 range, 0 for a NaN, so an entry is always finite.
 * A zero residual gives code 0 and sigma 0.
 */
void kvt_index_build(uint32_t d, const float *rot, const float *c_k, const float *c_q, uint32_t n,
		     const float *keys, size_t key_stride, uint32_t *codes, uint16_t *sigma,
		     uint16_t *beta);

/* A query prepared for scoring against one KV head's index. */
typedef struct kvt_qcode {
	float x_l;     /* min of x */
	float delta;   /* (max x - x_l) / 15, 0 when x is constant */
	float sum_u;   /* sum of the quantized coordinates */
	float qc_ck;   /* <q - c_q, c_k> */
	uint32_t planes[4][KVT_MAX_WORDS]; /* bit-plane j of x_u, packed like the codes */
	float x[KVT_MAX_HEAD_DIM];         /* unquantized x = R (q - c_q) (for tests and twins) */
	uint8_t u[KVT_MAX_HEAD_DIM];       /* quantized x_u in [0, 15] */
} kvt_qcode;

void kvt_query_prepare(uint32_t d, const float *rot, const float *c_q, const float *c_k,
		       const float *q, kvt_qcode *qc);

/* Estimated <q, k> of n indexed tokens through the INT4 x binary bit-plane popcount. */
void kvt_score(uint32_t d, const kvt_qcode *qc, uint32_t n, const uint32_t *codes,
	       const uint16_t *sigma, const uint16_t *beta, float *scores);

/* The same estimate with E evaluated in floating point on the quantized (u) or unquantized x. */
float kvt_score_float(uint32_t d, const kvt_qcode *qc, bool quantized, const uint32_t *code,
		      uint16_t sigma, uint16_t beta);

/* ---- selection (lib/select.c) ----------------------------------------------------------- */

/*
 * Top-p threshold of softmax(scores * scale) over n scores, in expected linear time (partitioning on
 * mass, no sort). The selected set is every i with scores[i] >= *thresh: the sort-based definition's
 * smallest prefix with mass >= p, extended over ties at the boundary. p >= 1 selects all.
 * `scratch` holds n floats. Returns the number selected, or -EINVAL when a score is NaN or
 * infinite (*bad receives its index).
 */
int kvt_topp_threshold(const float *scores, uint32_t n, float scale, float p, float *scratch,
		       float *thresh, uint32_t *bad);

/*
 * The m-th largest of n scores (1 <= m <= n), expected linear time. `scratch` holds n floats.
 */
float kvt_kth_largest(const float *scores, uint32_t n, uint32_t m, float *scratch);

/*
 * The same with the tokens ordered by keys[i] instead of scores[i], the mass still softmax(scores *
 * scale): the smallest set of the largest keys whose mass reaches p, extended over ties of the
 * boundary key (tied keys may hold different scores; each counts its own mass). The set is every i
 * with keys[i] >= *thresh. `scratch` holds 2 n floats. keys == scores gives the unkeyed set, but
 * not bit for bit its mass order: call kvt_topp_threshold for that.
 */
int kvt_topp_threshold_keyed(const float *scores, const float *keys, uint32_t n, float scale,
			     float p, float *scratch, float *thresh, uint32_t *bad);

/*
 * Mark in `mask` (n bytes, OR-ed, not cleared) the Top-p set clamped to [bmin, bmax] tokens
 * (bmax 0: no cap), ordered by keys (kvt_topp_threshold_keyed; NULL: by the scores). Exactly
 * clamp(count, bmin, bmax) tokens are marked when clamping applies: the largest keys, among tied
 * keys at the boundary the lowest positions. *clamped: 0, +1 raised to bmin, -1 cut to bmax.
 * `scratch` holds n floats, 2 n with keys. Returns the number marked by this call's set, or
 * -EINVAL (a non-finite score; *bad).
 */
int kvt_topp_mark(const float *scores, const float *keys, uint32_t n, float scale, float p,
		  uint32_t bmin, uint32_t bmax, float *scratch, uint8_t *mask, int *clamped,
		  uint32_t *bad);

/* ---- attention (lib/attention.c) -------------------------------------------------------- */

/*
 * Exact attention of one query (d floats) over n K/V rows (row i at rows[i]: K then V, d elements
 * each of `dtype`), softmax(q.K * scale) V with fp32 accumulation, written to out (d floats).
 */
void kvt_attention(uint32_t d, uint32_t dtype, float scale, const float *q, uint32_t n,
		   const void *const *rows, float *out);

/* Queries kvt_attention_group takes per pass over the rows (more take several passes). */
#define KVT_ATTENTION_GROUP 8u

/*
 * The same for g queries over the same rows (q and out: g x d floats), each row's elements
 * converted once for the group: every query's result is bit for bit what kvt_attention gives it
 * alone (the same operations in the same order). logits: g x n floats receiving each query's q.k
 * of each row before the scale (a float sum over j ascending), or NULL.
 */
void kvt_attention_group(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			 uint32_t n, const void *const *rows, float *out, float *logits);

/*
 * The same pass in pieces, for g queries (q: g x d floats) of any number: kvt_attention_begin sets
 * the running state (m, l: g floats; acc: g x d floats), kvt_attention_feed takes rows of token
 * positions first .. first + n - 1 (rows[i] holds position first + i), each query h only those below
 * end[h] (end NULL: all), in the order given; kvt_attention_finish writes g x d outputs. A query fed
 * its rows in any number of pieces gets, bit for bit, what kvt_attention gives it over them at once.
 */
void kvt_attention_begin(uint32_t d, uint32_t g, float *m, float *l, float *acc);
void kvt_attention_feed(uint32_t d, uint32_t dtype, float scale, uint32_t g, const float *q,
			const uint32_t *end, uint32_t first, uint32_t n, const void *const *rows,
			float *m, float *l, float *acc);
void kvt_attention_finish(uint32_t d, uint32_t g, const float *l, const float *acc, float *out);

#endif
