/* SPDX-License-Identifier: MIT */
/*
 * What the three passes of the Top-p threshold share (select.cu has the design; C++ only,
 * included by select.cu and select_resolve.cu alone): the sizes, a segment's state and the
 * scratch, keys and the fixed-point mass, the chunk iteration, and the block's decision over a
 * histogram. Everything here is static: each file compiles its own copy.
 */
#ifndef KVT_GPU_SELECT_COMMON_CUH
#define KVT_GPU_SELECT_COMMON_CUH

#include "common.cuh"
#include "scanring.h"
#include "score.cuh"
#include "segstats.cuh"
#include "select.cuh"

#include <type_traits>

#define SEL_THREADS 256
/* Compile-time knobs (bench/gpu_ab.sh compares values): the streaming passes' (k_hist, k_cand)
 * resident blocks per multiprocessor that their registers are held to, and the blocks per
 * multiprocessor that all segments of a call take together (sel_blocks). The values measured
 * against these defaults are in doc/cuda-backend.md (SEL_SM_BLOCKS 8 over 4, 16 and
 * SEL_MIN_BLOCKS 3 not kept). */
#ifndef SEL_MIN_BLOCKS
#define SEL_MIN_BLOCKS 4
#endif
#ifndef SEL_SM_BLOCKS
#define SEL_SM_BLOCKS 8
#endif
/* With the scan's ring, pass 2 gives each segment at least this many blocks where it has the
 * chunks: the blocks of the segments the ring serves leave at once (k_ring decided them), so that
 * those it declines stream on more of the device (doc/selection.md) */
#ifndef SEL_RING_MIN_BLOCKS
#define SEL_RING_MIN_BLOCKS 16u
#endif
#define SEL_CHUNK 8192u /* scores per block: 8 float4 per thread */
#define SEL_BINS 2048u  /* log-mass bins, and the mass radix's widest digit */
#define SEL_CNT_BINS 4096u /* the position radix's digit: 12 bits */
/* Bins span at most this many nats below the max: a term below exp(-27.7) is already below the
 * fixed point's unit (2^-40), so the bins past it carry counts only. */
#define SEL_SPAN_NATS 64.0f
/* Candidate list per segment, at most (see carve). A boundary bin holds a few hundred scores at
 * 128K tokens on realistic attention; more (flat scores) take the whole-segment path. */
#define SEL_CAND 16384u
/* The candidate list's least length (but for segments shorter than it): what the scan's ring
 * serves always fits it. */
#define SEL_CAND_MIN 8192u
static_assert(KVT_BINS_SERVE_MAX <= SEL_CAND_MIN, "what the ring serves fits the list");
/* Candidates sorted by rank (each thread counts the larger ones): at a few hundred, one pass over
 * shared memory costs less than a bitonic network's barriers; more take the radix select. */
#define SEL_RANK 512u
static_assert(KVT_BINS_SERVE_DEFAULT == SEL_RANK, "the ring serves by default what is ranked");
#define SEL_MAX_N (KVT_GPU_SELECT_MAX_N + 1) /* positions take 24 bits of a ckey */
#define SEL_NONE 0xffffffffu

typedef unsigned long long u64;

/* The phases of a segment (a segment not in a launch's phase skips it). */
enum { PH_INIT = 0, PH_HIST, PH_CAND, PH_DONE };

/* What the histogram's last block hands to the resolution: one boundary bin per need. */
enum { NEED_MASS, NEED_MIN, NEED_MAX, NEEDS };

struct seg_state {
	uint32_t phase, done;
	uint32_t max_key, nmin_key; /* order-preserving keys of the max and (complemented) min */
	uint32_t bad;               /* 0xffffffff - position of the first non-finite score, or 0 */
	float inv_w;                /* bin(s) = (max - s) * inv_w, clamped to the last bin */
	uint32_t ncand;             /* candidates appended */
	uint32_t listed;            /* whether the bins' candidates fit the list */
	uint32_t bin[NEEDS];        /* the bin of each need, or SEL_NONE */
	uint32_t above[NEEDS];      /* scores in earlier bins (larger) */
	uint32_t fbin;              /* the bin the final cut lies in (the union's: select.cu) */
	uint64_t acc;               /* mass of the bins before bin[NEED_MASS] (unit 2^-40) */
	double target;              /* p * f(total mass) */
};

struct sel_scratch {
	seg_state *st;
	uint32_t *hcnt;          /* [segs][SEL_BINS] */
	unsigned long long *hhi; /* [segs][SEL_BINS]: sums of the terms, unit 2^-40 */
	kvt_gpu_segstats *stats; /* [segs]: when the caller gives none */
	u64 *cand;               /* [segs][cand_cap]: candidates (see ckey) */
	uint32_t cand_cap;
	kvt_gpu_bins ring; /* the scan's (select.cuh), or count NULL */
	size_t zero_bytes, zero_all; /* from st: through the histograms, through the statistics */
	size_t bytes;
};


/*
 * ---- a profile build's timestamps (-DKVT_SEL_TIMING: bench/gpu_select prints them) ----------
 * When a pass's blocks reached each point, in ns of the global timer: [0] the first block's start,
 * [i] the last block to reach point i. k_hist: 1 state read and histogram zeroed, 2 scores
 * streamed, 3 flushed (block's thread 0), 4 a segment's last block entered, 6 its histogram
 * loaded, 7 the decision's prefix summed, 8 its bin found, 5 decided. k_cand: 1 state read,
 * 2 candidates appended, 4 last block entered, 5 sorted (when the list is sorted; reached on the
 * radix path too), 6 resolved (points 7 and 8 there: the radix path's widest mass levels).
 */

#ifdef KVT_SEL_TIMING
#include <stdio.h>
#include <string.h>
static __device__ unsigned long long sel_t[16]; /* [0]: min entry; others: max over blocks */
static __device__ __forceinline__ unsigned long long sel_now()
{
	unsigned long long t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}
#define SEL_T(i)                                                                                  \
	do {                                                                                      \
		if (threadIdx.x == 0) {                                                           \
			if ((i) == 0)                                                             \
				atomicMin(&sel_t[0], sel_now());                                  \
			else                                                                      \
				atomicMax(&sel_t[i], sel_now());                                  \
		}                                                                                 \
	} while (0)
#define SEL_T_HOST(name)                                                                          \
	extern "C" void name(int reset)                                                           \
	{                                                                                         \
		unsigned long long t[16];                                                         \
		if (reset) {                                                                      \
			memset(t, 0, sizeof t);                                                   \
			t[0] = ~0ull;                                                             \
			cudaMemcpyToSymbol(sel_t, t, sizeof t);                                   \
			return;                                                                   \
		}                                                                                 \
		cudaMemcpyFromSymbol(t, sel_t, sizeof t);                                         \
		printf("%s:", #name);                                                             \
		for (int i = 1; i < 16; i++)                                                      \
			if (t[i])                                                                 \
				printf(" t%d %.2f", i, (double)(t[i] - t[0]) * 1e-3);             \
		printf(" us\n");                                                                 \
	}
#else
#define SEL_T(i) ((void)0)
#endif

/* ---- keys and numbers -------------------------------------------------------------------- */

/* A candidate: its key above the complement of its position (56 bits), so that a larger ckey is a
 * larger score or, among equal scores, a lower position: the order kvt_topp_mark takes ties in. */
static __device__ __forceinline__ u64 ckey(uint32_t key, uint32_t pos)
{
	return (u64)key << 24 | ((SEL_MAX_N - 1) - pos);
}

/* The union's cut (select.cuh) of a ckey prefix. */
static __device__ __forceinline__ u64 cut_of(u64 c)
{
	return (c >> 24) << 32 | (0xffffffffu - ((SEL_MAX_N - 1) - (uint32_t)(c & (SEL_MAX_N - 1))));
}

/*
 * The log-mass bin of a score: monotone non-increasing in s (each step rounds monotonically), so
 * bins are ordered like the scores, largest first, and equal scores share one. inv_w > 0: bins of
 * equal width below the max (k_hist's own); inv_w < 0: the scan's ring (scanring.h), bins of
 * 1/KVT_BINS_GRID nat on the absolute grid counted from the max's, at scale -inv_w; 0: one bin.
 * The tag says what the caller knows, at compile time: std::true_type inv_w > 0, ring_tag
 * inv_w < 0, checked_tag<RING> nothing (any of the three, the ring's only when RING: a kernel
 * built without the ring carries no ring code). A tag's value says whether it is a fast one (the
 * scores are all below n: each_quad_of_block_split).
 */
struct ring_tag {
	static constexpr bool value = true;
};

template <bool RING>
struct checked_tag {
	static constexpr bool value = false;
};

static __device__ __forceinline__ uint32_t lbin(float s, float mx, float inv_w, std::true_type)
{
	return (uint32_t)fminf(__fmul_rn(__fsub_rn(mx, s), inv_w), (float)(SEL_BINS - 1));
}

static __device__ __forceinline__ uint32_t lbin(float s, float mx, float inv_w, ring_tag)
{
	return min((uint32_t)(kvt_bins_bin(s, -inv_w) - kvt_bins_bin(mx, -inv_w)), SEL_BINS - 1);
}

template <bool RING>
static __device__ __forceinline__ uint32_t lbin(float s, float mx, float inv_w, checked_tag<RING>)
{
	if (inv_w == 0.0f) /* one bin (then max - s may be infinite, and inf * 0 NaN) */
		return 0;
	if (RING && inv_w < 0.0f)
		return lbin(s, mx, inv_w, ring_tag{});
	return lbin(s, mx, inv_w, std::true_type{});
}

/* A sum of terms (unit 2^-40; n < 2^24 terms of at most 2^40 units stay below 2^64) as a double:
 * one rounding, monotone in x. */
static __device__ __forceinline__ double mass_d(u64 x)
{
	return (double)x * 0x1p-40;
}

/*
 * The mass term exp((s - max) * scale) in float, truncated to a multiple of 2^-40 (select.cu:
 * the error bound). s - max is rounded as the CPU rounds it; its product with scale, exact in the
 * CPU's double, is split exactly into h + l (an FMA), and exp(h + l) = expf(h) (1 + l) to far
 * below a float's rounding, since |l| <= 2^-24 |h|. Terms below 2^-40 (h < -27.7) are 0.
 */
static __device__ __forceinline__ unsigned long long term(float s, float max, float scale)
{
	const float d = __fsub_rn(s, max), h = __fmul_rn(d, scale);
	const float l = __fmaf_rn(d, scale, -h), e = expf(h);
	const unsigned long long t = __float2ull_rz(__fmul_rn(__fmaf_rn(e, l, e), 0x1p40f));
	/* no branch, so that the terms of consecutive scores interleave (a branch cost k_hist's
	 * peaked scores 4 %); h <= 0: at most 1, so that n terms fit 64 bits; the test also catches
	 * an infinite d, whose l is NaN */
	return h >= -28.0f ? (t < (1ull << 40) ? t : 1ull << 40) : 0;
}

/*
 * A 64-bit add into two 32-bit shared words, exact once all adds are done: the low word's carry
 * is read back from its atomic. Shared-memory 64-bit atomics compile to compare-and-swap loops,
 * which stall badly when many lanes hit the same bin.
 */
static __device__ __forceinline__ void smem_add64(uint32_t *lo_w, uint32_t *hi_w, unsigned long long x)
{
	const uint32_t lo = (uint32_t)x, old = atomicAdd(lo_w, lo);
	const uint32_t hi = (uint32_t)(x >> 32) + (old + lo < old ? 1u : 0u);
	if (hi)
		atomicAdd(hi_w, hi);
}

/*
 * A shared histogram of masses: per bin the sum of the terms (unit 2^-40) in two 32-bit words, in
 * separate rows so that lanes on distinct bins hit distinct banks.
 */
struct mhist {
	uint32_t *w; /* [2][bins] */
	uint32_t bins;
	__device__ void zero(uint32_t b)
	{
		w[b] = w[bins + b] = 0;
	}
	__device__ void add(uint32_t b, float s, float mx, float scale)
	{
		const unsigned long long t = term(s, mx, scale);
		if (t)
			smem_add64(w + b, w + bins + b, t);
	}
	__device__ u64 sum(uint32_t b) const
	{
		return (u64)w[bins + b] << 32 | w[b];
	}
};

/*
 * The block's minimum or maximum of one value per thread into a shared word, one atomic per warp:
 * thousands of atomics on one shared word serialize. Every thread of the block calls it.
 */
static __device__ __forceinline__ void block_min_into(uint32_t *w, uint32_t v)
{
	v = __reduce_min_sync(0xffffffffu, v);
	if (threadIdx.x % 32 == 0)
		atomicMin(w, v);
}

static __device__ __forceinline__ void block_max_into(uint32_t *w, uint32_t v)
{
	v = __reduce_max_sync(0xffffffffu, v);
	if (threadIdx.x % 32 == 0)
		atomicMax(w, v);
}

/* ---- the segment's end ------------------------------------------------------------------- */

static __device__ void finalize(seg_state *st, kvt_gpu_topp *o, float thresh, uint32_t count,
				uint32_t marked, int clamped, unsigned long long cut)
{
	o->thresh = thresh;
	o->count = count;
	o->marked = marked;
	o->clamped = clamped;
	o->cut = cut;
	st->phase = PH_DONE;
}

/* kvt_topp_mark's clamp of a Top-p count: the tokens wanted, and the sign of the clamp. */
static __device__ uint32_t clamp_want(uint32_t count, uint32_t n, uint32_t bmin, uint32_t bmax,
				      int *clamped)
{
	*clamped = 0;
	if (bmax && count > bmax) {
		*clamped = -1;
		return bmax;
	}
	if (count < bmin) {
		const uint32_t want = bmin < n ? bmin : n;
		*clamped = want > count ? 1 : 0;
		return want;
	}
	return count;
}

/* Whether this block is the last of its segment's blocks to finish the pass (then it sees the
 * other blocks' atomics). */
static __device__ bool last_block(seg_state *st)
{
	__shared__ bool last;
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence();
		last = atomicAdd(&st->done, 1u) == gridDim.x - 1;
	}
	__syncthreads();
	if (last)
		__threadfence();
	return last;
}

#define SEL_VEC (SEL_CHUNK / (4 * SEL_THREADS)) /* float4 per thread per chunk */

/* A thread's share of a chunk, every load issued before any is used (the passes are otherwise
 * bound by one L2 round trip per float4). */
static __device__ __forceinline__ void load_chunk(float4 (&v)[SEL_VEC], const float *s, uint32_t c0,
						  uint32_t n)
{
#pragma unroll
	for (int k = 0; k < SEL_VEC; k++) {
		const uint32_t i = c0 + 4 * (threadIdx.x + k * SEL_THREADS);
		v[k] = i < n ? *(const float4 *)(s + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
	}
}

/* f(i, x) for each float4 of this thread's share of the chunk: x[e] the score of position i + e
 * (past n: f checks). */
template <class F>
static __device__ __forceinline__ void each_quad_in_chunk(const float *s, uint32_t c0, uint32_t n,
							  F f)
{
	float4 v[SEL_VEC];
	load_chunk(v, s, c0, n);
#pragma unroll
	for (int k = 0; k < SEL_VEC; k++) {
		const float x[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
		f(c0 + 4 * (threadIdx.x + k * SEL_THREADS), x);
	}
}

/* f(position, score) for each score of this thread's share of the chunk. */
template <class F>
static __device__ __forceinline__ void each_in_chunk(const float *s, uint32_t c0, uint32_t n, F f)
{
	each_quad_in_chunk(s, c0, n, [&](uint32_t i, const float (&x)[4]) {
#pragma unroll
		for (int e = 0; e < 4; e++)
			f(i + e, x[e]); /* past n: f checks */
	});
}

/* The same over the chunks of the segment that fall to this block (grid-stride: a segment has at
 * most sel_blocks() blocks, so that the per-block flush of the histograms does not grow with n). */
template <class F>
static __device__ __forceinline__ void each_of_block(const float *s, uint32_t n, F f)
{
	for (uint32_t c0 = blockIdx.x * SEL_CHUNK; c0 < n; c0 += gridDim.x * SEL_CHUNK)
		each_in_chunk(s, c0, n, f);
}

/*
 * The chunks of the segment that fall to this block, as each_quad_in_chunk gives them, with
 * f(i, x, tag), the tag a compile-time constant for lbin: Fast (std::true_type, or ring_tag) for
 * the chunks wholly below n when `many` (a segment of several bins) holds, so that f drops its
 * per-score tests there; Slow (a checked_tag) elsewhere (past n: f checks).
 */
template <class Fast, class Slow, class F>
static __device__ __forceinline__ void each_quad_of_block_split(const float *s, uint32_t n,
								bool many, F f)
{
	for (uint32_t c0 = blockIdx.x * SEL_CHUNK; c0 < n; c0 += gridDim.x * SEL_CHUNK) {
		if (many && c0 + SEL_CHUNK <= n)
			each_quad_in_chunk(s, c0, n, [&](uint32_t i, const float (&x)[4]) {
				f(i, x, Fast{});
			});
		else
			each_quad_in_chunk(s, c0, n, [&](uint32_t i, const float (&x)[4]) {
				f(i, x, Slow{});
			});
	}
}

/* The same score by score: f(position, score, tag), over bins of k_hist's own (inv_w >= 0). */
template <class F>
static __device__ __forceinline__ void each_of_block_split(const float *s, uint32_t n, bool many,
							   F f)
{
	each_quad_of_block_split<std::true_type, checked_tag<false>>(
		s, n, many, [&](uint32_t i, const float (&x)[4], auto tag) {
#pragma unroll
			for (int e = 0; e < 4; e++)
				f(i + e, x[e], tag);
		});
}

/*
 * The union's bits of a thread's four consecutive positions i .. i + 3 (i a multiple of 4, as
 * each_in_chunk gives them; bit e of nib: position i + e) ORed into the item's mask: the eight
 * lanes sharing a 32-bit word combine theirs, and one of them adds the word with an atomic (the
 * query heads of a group mark the same words). Every lane of the warp calls it.
 */
static __device__ __forceinline__ void mark_nibble(uint32_t *mask, uint32_t i, uint32_t nib)
{
	uint32_t w = nib << (i % 32);
	w |= __shfl_xor_sync(0xffffffffu, w, 1);
	w |= __shfl_xor_sync(0xffffffffu, w, 2);
	w |= __shfl_xor_sync(0xffffffffu, w, 4);
	if (threadIdx.x % 8 == 0 && w)
		atomicOr(mask + i / 32, w);
}

/* ---- the selection's hysteresis (kvt_gpu_keep, select.cuh) ------------------------------ */

/* A segment's view of kvt_gpu_keep: its item's row of the mask (NULL: none), and the bonus. */
struct keep_row {
	const uint32_t *m;
	uint32_t words;
	float bonus;
};

static __device__ __forceinline__ keep_row keep_of(const kvt_gpu_keep &k, uint32_t seg,
						   uint32_t group)
{
	return keep_row{k.mask ? k.mask + (size_t)(seg / group) * k.words : nullptr, k.words,
			k.bonus};
}

/* The bits of positions i .. i + 3 (i a multiple of 4) in the low nibble (r.m given). */
static __device__ __forceinline__ uint32_t keep_nib(const keep_row &r, uint32_t i)
{
	return i / 32 < r.words ? (__ldg(r.m + i / 32) >> (i % 32)) & 15u : 0u;
}

/* The key of score x at position i: x + bonus where the bit is set (as the CPU adds it). */
static __device__ __forceinline__ float keep_key(const keep_row &r, uint32_t i, float x)
{
	return r.m && i / 32 < r.words && ((__ldg(r.m + i / 32) >> (i % 32)) & 1u)
		       ? __fadd_rn(x, r.bonus)
		       : x;
}

/* The position a ckey holds. */
static __device__ __forceinline__ uint32_t ckey_pos(u64 c)
{
	return (SEL_MAX_N - 1) - (uint32_t)(c & (SEL_MAX_N - 1));
}

/* ---- the block's decision over a histogram ----------------------------------------------- */

/* Block-wide exclusive prefix over threads in index order of a count and a mass. */
static __device__ void scan_excl(uint32_t &c, u64 &m, uint32_t *tc, u64 *tm)
{
	__shared__ uint32_t wc[SEL_THREADS / 32];
	__shared__ u64 wm[SEL_THREADS / 32];
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	uint32_t ic = c;
	u64 im = m;
#pragma unroll
	for (int o = 1; o < 32; o <<= 1) {
		const uint32_t oc = __shfl_up_sync(0xffffffffu, ic, o);
		const u64 om = __shfl_up_sync(0xffffffffu, im, o);
		if (lane >= (uint32_t)o) {
			ic += oc;
			im += om;
		}
	}
	if (lane == 31) {
		wc[warp] = ic;
		wm[warp] = im;
	}
	__syncthreads();
	uint32_t bc = 0;
	u64 bm = 0;
	for (uint32_t w = 0; w < warp; w++) {
		bc += wc[w];
		bm += wm[w];
	}
	*tc = 0;
	*tm = 0;
	for (uint32_t w = 0; w < SEL_THREADS / 32; w++) {
		*tc += wc[w];
		*tm += wm[w];
	}
	c = bc + ic - c;
	m = bm + im - m;
	__syncthreads();
}

/* The bin a decision picks: j in the walk from the largest scores down. */
struct pick {
	uint32_t j, above, cnt;
	u64 acc;   /* mass before j */
	u64 total; /* mass of all bins (the first level's target comes from it) */
};

/*
 * Walks BINS bins from the largest scores down (get(j, k, &count, &mass): bin j, the k-th of the
 * calling thread's BINS / SEL_THREADS consecutive bins, k a constant once the loops unroll, so
 * that get may read registers) and picks, with `above`
 * scores and `acc` mass before the first: by mass (MASS), the bin where f(acc) < target <=
 * f(acc + its mass), or when rounding left p Z above the total, the last nonempty one (the CPU
 * then takes the smallest value); by count, the bin holding the want-th largest. target < 0: the
 * first level, whose target is p * f(total). Every thread of the block calls it; all get the pick.
 */
template <uint32_t BINS, bool MASS, class Get>
static __device__ __forceinline__ pick decide(Get get, uint32_t above0, u64 acc0,
					      double target, float p, uint32_t want)
{
	constexpr uint32_t per = BINS / SEL_THREADS;
	static_assert(BINS % SEL_THREADS == 0, "the decision gives each thread whole bins");
	__shared__ pick win;
	__shared__ uint32_t last;
	/* bins are read twice rather than held (get may read them from registers) */
	uint32_t c = 0, bc;
	u64 m = 0, bm;
#pragma unroll
	for (uint32_t k = 0; k < per; k++) {
		get(threadIdx.x * per + k, k, &bc, &bm);
		c += bc;
		m += bm;
	}
	if (threadIdx.x == 0) {
		win.j = SEL_NONE;
		last = 0;
	}
	uint32_t tc;
	u64 tm;
	scan_excl(c, m, &tc, &tm); /* also a barrier for win and last */
	if (MASS && BINS == SEL_BINS)
		SEL_T(7);
	if (MASS && target < 0.0)
		target = (double)p * mass_d(acc0 + tm);
	uint32_t above = above0 + c, mylast = 0;
	u64 am = acc0 + m;
#pragma unroll
	for (uint32_t k = 0; k < per; k++) {
		const uint32_t j = threadIdx.x * per + k;
		get(j, k, &bc, &bm);
		bool hit;
		if (MASS)
			hit = bc && mass_d(am) < target && target <= mass_d(am + bm);
		else
			hit = bc && above < want && want <= above + bc;
		if (hit)
			win = pick{.j = j, .above = above, .cnt = bc, .acc = am, .total = tm};
		if (bc)
			mylast = j;
		above += bc;
		am += bm;
	}
	block_max_into(&last, mylast);
	__syncthreads();
	if (MASS && BINS == SEL_BINS)
		SEL_T(8);
	if (win.j == SEL_NONE) { /* only by mass */
		above = above0 + c;
		am = acc0 + m;
#pragma unroll
		for (uint32_t k = 0; k < per; k++) {
			const uint32_t j = threadIdx.x * per + k;
			get(j, k, &bc, &bm);
			if (j == last)
				win = pick{.j = j, .above = above, .cnt = bc, .acc = am,
					   .total = tm};
			above += bc;
			am += bm;
		}
		__syncthreads();
	}
	const pick r = win;
	__syncthreads(); /* before a next decision writes win */
	return r;
}

/* Pass 3 (select_resolve.cu): candidates, then the exact resolution by each segment's last block;
 * with bits.mask, also the union's bits of each group of `group` query heads (kvt_gpu_topp_select),
 * and with keep.mask ranked by the keys (no ring then).
 * Launched by kvt_gpu_topp_threshold after passes 1 and 2. */
cudaError_t kvt_sel_launch_cand(dim3 grid, cudaStream_t s, const float *scores, size_t ld,
				const uint32_t *n_tok, uint32_t hq, float scale, float p,
				uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out,
				kvt_gpu_selbits bits, uint32_t group, kvt_gpu_keep keep);

#endif
