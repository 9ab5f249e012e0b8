/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection on the GPU without sorting: the twins of kvt_topp_threshold and kvt_topp_mark
 * (lib/select.c), then the union over each KV head's query group and its compaction into sorted
 * index positions, as the CPU backend's select_head builds l->sel. C and C++.
 */
#ifndef KVT_GPU_SELECT_CUH
#define KVT_GPU_SELECT_CUH

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "constants.h" /* KVT_GPU_SELECT_MAX_N */
#include "errword.h"
#include "scanbins.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The selection of one (sequence, query head) segment (24 bytes, device memory). */
typedef struct kvt_gpu_topp {
	float thresh;    /* Top-p threshold, as kvt_topp_threshold's *thresh (0 when n is 0) */
	uint32_t count;  /* tokens with score >= thresh: kvt_topp_threshold's return */
	uint32_t marked; /* tokens marked after the budget clamp: kvt_topp_mark's return */
	int32_t clamped; /* as kvt_topp_mark's *clamped: 0, +1 raised to bmin, -1 cut to bmax */
	unsigned long long cut; /* when marked > 0, index position t with score s is marked iff
				   (key(s) << 32 | (0xffffffff - t)) >= cut, key(s) the order-preserving
				   bits of s (-0 taken as +0): ties at the boundary by lowest position */
} kvt_gpu_topp;

/*
 * A segment's score statistics (16 bytes, device memory), gathered by kvt_gpu_score as it writes
 * the scores so that the threshold need not read them once more for them. Zeroed before they are
 * gathered.
 */
typedef struct kvt_gpu_segstats {
	uint32_t max_key;  /* the largest order-preserving key (-0 taken as +0) of a finite score */
	uint32_t nmin_key; /* the complement of the smallest */
	uint32_t bad;      /* 0xffffffff - the position of the first non-finite score, or 0 */
	uint32_t pad;
} kvt_gpu_segstats;

/* Bytes of scratch that kvt_gpu_topp_threshold and kvt_gpu_topp_union need for these shapes. */
size_t kvt_gpu_select_scratch_bytes(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				    uint32_t max_n);

/*
 * The Top-p threshold of softmax(scores * scale) for every (sequence, query head), clamped to
 * [bmin, bmax] tokens (bmax 0: no cap) exactly as kvt_topp_mark clamps, in linear time: a kernel
 * zeroing the scratch's state, then three passes, two when `stats` is given (select.cu; on Hopper
 * the last pass, and the histogram pass when `stats` is given, are launched as programmatic
 * dependents of the kernel before them, so that their blocks start while it ends): max, min and
 * finiteness; a histogram of count and probability mass over 2048 log-mass bins (the terms in float, summed exactly in
 * integers of 2^-40), which picks the bin holding the boundary and those holding the bmin-th and
 * bmax-th largest; then those bins' scores are gathered and the last block resolves the threshold
 * and clamp among them (sorted in shared memory, or by a radix select when there are many), ties
 * at a clamped boundary going to the lowest positions. Counts, ranks and the clamp are exact; the
 * mass is within a stated tolerance (doc/selection.md): with Z the total mass and n the scored
 * tokens, the set differs from the exact definition's only in tokens whose cumulative mass (of the
 * tokens ranked above them) lies within tol = 2^-19 Z + n 2^-38 of p Z, and never covers less
 * than p Z - tol. The same inputs give the same result on every run.
 *   scores:   device [n_seqs][n_q_heads][ld] floats (16-byte aligned), ld a multiple of 4
 *   n_tokens: device [n_seqs]: scored tokens per head, each <= max_n (host bound, <= ld,
 *             <= KVT_GPU_SELECT_MAX_N)
 *   scale > 0 and finite; p > 0 (p >= 1 selects all)
 *   stats:    device [n_seqs][n_q_heads], the scores' statistics as kvt_gpu_score gathered them,
 *             or NULL (then a first pass gathers them)
 *   ring:     host struct or NULL: the histogram kvt_gpu_score built as it wrote these scores
 *             (its bins, at this scale, with stats; count and dsum 16-byte aligned). A segment it
 *             serves takes its first histogram from it instead of streaming its scores: scores
 *             spanning less than its slots (64 nats at the default 1/32 nat a slot, scanbins.h's
 *             KVT_BINS_GRID) whose boundary bins hold at most ring->serve_max scores (0:
 *             KVT_BINS_SERVE_DEFAULT); the others stream as without. ring->served, when not
 *             NULL, is a device counter the call adds those segments to
 *             (kvt_gpu_topp_ring_served counts them after the fact). Every segment's slots are
 *             left zeroed, ready for the next scan (zero them once before the first)
 *   out:      device [n_seqs][n_q_heads]
 *   scratch:  device, scratch_bytes >= kvt_gpu_select_scratch_bytes(...), 16-byte aligned;
 *             no initial contents needed
 *   err:      device error word or NULL: KVT_GPU_ERR_NONFINITE (where = segment
 *             s * n_q_heads + j, index = position) when a score is NaN or infinite; that segment
 *             then marks nothing. KVT_GPU_ERR_RANGE when n_tokens[s] > max_n (likewise).
 * Returns 0, -EINVAL (NULL pointer, shapes, scratch too small, p, scale, a ring without stats or
 * at another scale) or -EIO. Asynchronous,
 * allocation-free. Capturable in a CUDA graph; the grid is
 * sized from the current device's multiprocessor count.
 */
int kvt_gpu_topp_threshold(uint32_t n_seqs, uint32_t n_q_heads, const float *scores, size_t ld,
			   const uint32_t *n_tokens, uint32_t max_n, float scale, float p,
			   uint32_t bmin, uint32_t bmax, const kvt_gpu_segstats *stats,
			   const kvt_gpu_bins *ring, kvt_gpu_topp *out, void *scratch,
			   size_t scratch_bytes, unsigned long long *err, void *stream);

/*
 * How many segments of the last kvt_gpu_topp_threshold or kvt_gpu_topp_select on this scratch
 * (n_seqs x n_q_heads, as given there) took their first histogram from the scan's ring, into
 * *served: for tests and benchmarks. Synchronous (reads the scratch after the device's work).
 * Returns 0, -EINVAL (NULL pointer), -ENOMEM or -EIO.
 */
int kvt_gpu_topp_ring_served(const void *scratch, uint32_t n_seqs, uint32_t n_q_heads,
			     uint32_t *served);

/*
 * The union of the marked sets of each KV head's query group (query heads h * G .. h * G + G - 1,
 * G = n_q_heads / n_kv_heads), compacted into ascending index positions: kvt_gpu_topp_union_bits
 * then kvt_gpu_selbits_list, with the bits in scratch.
 *   scores, ld, n_tokens, max_n: as given to kvt_gpu_topp_threshold; topp: its output
 *   sel:   device [n_seqs][n_kv_heads][sel_ld] uint32, sel_ld >= max_n; entries past the count
 *          are not written
 *   sel_n: device [n_seqs][n_kv_heads]: the counts
 *   scratch: as for kvt_gpu_topp_threshold (the same buffer may serve both)
 * Returns 0, -EINVAL or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_topp_union(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
		       const float *scores, size_t ld, const uint32_t *n_tokens, uint32_t max_n,
		       const kvt_gpu_topp *topp, uint32_t *sel, size_t sel_ld, uint32_t *sel_n,
		       void *scratch, size_t scratch_bytes, void *stream);

/*
 * A selection kept as bits: what a layer holds between a step and a later kvt_gather (1 bit per
 * indexed token and KV head, plus one count per 8192 tokens), instead of a list of positions (32
 * bits per token and KV head). Item i (sequence s, KV head h: i = s n_kv_heads + h) has
 * mask[i * words ..] (bit t % 32 of word t / 32: token t selected) and ccount[i * chunks ..] (the
 * selected tokens of each 8192-token chunk), words and chunks fixed by the max_n it was made for.
 */
typedef struct kvt_gpu_selbits {
	uint32_t *mask;   /* device [items][words] */
	uint32_t *ccount; /* device [items][chunks] */
	uint32_t words;   /* (max_n + 31) / 32 */
	uint32_t chunks;  /* (max_n + 8191) / 8192, at least 1 */
} kvt_gpu_selbits;

/* Whether bits can hold a selection of max_n tokens per item (0: any the bits were made for):
 * both arrays given, words enough for max_n, and chunks counting all the words. */
bool kvt_gpu_selbits_fit(kvt_gpu_selbits bits, uint32_t max_n);

/* Bytes of the bits of n_items items for max_n tokens (a multiple of 256). */
size_t kvt_gpu_selbits_bytes(size_t n_items, uint32_t max_n);

/* The bits laid out at base (device, 256-byte aligned, kvt_gpu_selbits_bytes long). */
kvt_gpu_selbits kvt_gpu_selbits_at(void *base, size_t n_items, uint32_t max_n);

/*
 * The first half of kvt_gpu_topp_union: the union's bits of every (sequence, KV head) into `bits`
 * (made for at least max_n tokens; item s n_kv_heads + h). Same arguments otherwise, and clamps:
 * device [2] or NULL, to which each query head whose selection the budget clamped adds one
 * (clamps[0]: cut to bmax, clamped -1; clamps[1]: raised to bmin, +1), as kvt_stats counts
 * budget_max_hits and budget_min_hits. Returns 0, -EINVAL or -EIO. Asynchronous,
 * allocation-free.
 */
int kvt_gpu_topp_union_bits(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
			    const float *scores, size_t ld, const uint32_t *n_tokens,
			    uint32_t max_n, const kvt_gpu_topp *topp, kvt_gpu_selbits bits,
			    unsigned long long *clamps, void *stream);

/*
 * The second half: the positions of n_items items of `bits` (as kvt_gpu_selbits_at lays them out,
 * or a view starting at a later item) in ascending order into sel[i * sel_ld ..] and their counts
 * into sel_n[i]. sel_ld >= the largest count (32 * words always is). Returns 0, -EINVAL or
 * -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_selbits_list(uint32_t n_items, kvt_gpu_selbits bits, uint32_t *sel, size_t sel_ld,
			 uint32_t *sel_n, void *stream);

/*
 * The clamps and per-chunk counts of bits whose masks are marked (k_union_mark's other outputs):
 * for kvt_gpu_topp_select. topp: the threshold's output; clamps as for kvt_gpu_topp_union_bits.
 * Returns 0, -EINVAL or -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_selbits_count(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
			  const kvt_gpu_topp *topp, kvt_gpu_selbits bits, unsigned long long *clamps,
			  void *stream);

/*
 * The selection's hysteresis (kvt_config.keep_weight, doc/hysteresis.md) as kvt_gpu_topp_select
 * takes it: the tokens whose bit is set in their item's mask (item s n_kv_heads + h; bit t % 32 of
 * word mask[item * words + t / 32], tokens past 32 words none) rank by their score plus bonus
 * (float addition, as the CPU's keys), while the mass each counts stays its score's. The masses are
 * reckoned from the largest key, so the tolerance's Z and 2^-40 units are those of the keys' max.
 */
typedef struct kvt_gpu_keep {
	const uint32_t *mask; /* device [items][words], or NULL: no token is favored */
	uint32_t words;
	float bonus; /* finite, >= 0 */
} kvt_gpu_keep;

/*
 * kvt_gpu_topp_threshold then kvt_gpu_topp_union_bits, with the same results (out, bits, clamps),
 * but the union marked by the threshold's candidate pass instead of a pass of its own over the
 * scores: the final cut's bin is known once the histogram has been walked (the Top-p boundary's,
 * or the clamp's when the counts show it applies), so that pass ORs in the bits of every token of
 * an earlier bin as it lists the boundary bins' candidates, and each segment's last block adds
 * those of the candidates its cut marks (of the whole segment when the list overflowed). The
 * scores are read twice after the scan instead of three times. Arguments as for the two calls;
 * bits need no initial contents (they are zeroed first). keep: host struct or NULL; with a mask,
 * every segment ranks by its item's keys (kvt_gpu_keep): thresh, the clamp and cut are then keys'
 * (key(s) of kvt_gpu_topp.cut is the token's key), and stats and ring must be NULL (the scan
 * gathers them over scores, not keys; pass 1 gathers them over the keys). Returns 0, -EINVAL or
 * -EIO. Asynchronous, allocation-free, capturable.
 */
int kvt_gpu_topp_select(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
			const float *scores, size_t ld, const uint32_t *n_tokens, uint32_t max_n,
			float scale, float p, uint32_t bmin, uint32_t bmax,
			const kvt_gpu_segstats *stats, const kvt_gpu_bins *ring, kvt_gpu_topp *out,
			kvt_gpu_selbits bits, const kvt_gpu_keep *keep, unsigned long long *clamps,
			void *scratch, size_t scratch_bytes, unsigned long long *err, void *stream);

#ifdef __cplusplus
}
#endif

#endif
