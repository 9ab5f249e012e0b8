/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection without sorting, in three launches over all (sequence, query head) segments,
 * each segment split into chunks of SEL_CHUNK scores, one block per chunk (or several chunks per
 * block, so that all segments together take about four blocks per multiprocessor):
 *
 *   1. k_stats: max, min, finiteness.
 *   2. k_hist: a histogram of count and probability mass over SEL_BINS bins of equal width in
 *      (max - s) * scale (a log-mass scale: bin 0 holds the largest scores), spanning the scores'
 *      range or the top SEL_SPAN_NATS nats, whatever is less. Its last block picks the bin holding
 *      the Top-p boundary, and the bins holding the bmin-th and bmax-th largest (the clamp).
 *   3. k_cand: the scores of those (at most three) bins are appended to the segment's candidate
 *      list; the last block resolves the exact threshold, and the clamp, in shared memory by a
 *      radix select over the candidates (three levels on the score's key, two more on positions
 *      among ties). When the bins hold more than SEL_CAND candidates, it runs the same select
 *      over the whole segment instead: slower, the same result.
 *
 * In every pass blocks build shared-memory histograms and add their nonzero bins into the
 * segment's with integer atomics; the last block of a segment to finish (a counter in the
 * segment's state) reads them and decides. Integer sums make the result independent of block
 * order, so a run is reproducible.
 *
 * The mass of a score s is exp((double)(s - max) * scale), the CPU's expression. It is summed in
 * unsigned 128-bit fixed point with unit 2^-80 (terms are at most 1; a term is truncated below
 * 2^-80, so n terms lose under n * 2^-80, far below the double rounding the CPU's own sums carry),
 * carried as two 40-bit halves so that 64-bit sums cannot overflow below 2^24 scores per segment.
 * A bin is chosen where f(mass above) < target <= f(mass above + bin), f the monotone conversion
 * to double and target = p * f(total); refining a bin re-partitions exactly the same terms, so
 * each level finds exactly one such bin, and the last level yields the CPU's definition: the
 * largest score v with mass(> v) < p Z <= mass(>= v).
 */
#include "common.cuh"
#include "score.cuh"
#include "select.cuh"

#define SEL_THREADS 256
#define SEL_CHUNK 8192u /* scores per block: 8 float4 per thread */
#define SEL_BINS 2048u  /* log-mass bins, and the mass radix's widest digit */
#define SEL_CNT_BINS 4096u /* the position radix's digit: 12 bits */
/* Bins span at most this many nats below the max: a term exp(-56.2) is already below the fixed
 * point's unit, so the bins past it carry counts only. */
#define SEL_SPAN_NATS 64.0f
/* Candidate list per segment, at most (see carve). A boundary bin holds a few hundred scores at
 * 128K tokens on realistic attention; more (flat scores) take the whole-segment path. */
#define SEL_CAND 16384u
/* Candidates resolved by sorting them in shared memory; more take the radix select. */
#define SEL_SORT 4096u
#define SEL_MAX_N (KVT_GPU_SELECT_MAX_N + 1) /* positions take 24 bits of a ckey */
#define SEL_NONE 0xffffffffu

typedef unsigned __int128 u128;
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
	uint64_t acc_lo, acc_hi;    /* mass of the bins before bin[NEED_MASS] */
	double target;              /* p * f(total mass) */
};

struct sel_scratch {
	seg_state *st;
	uint32_t *hcnt;          /* [segs][SEL_BINS] */
	unsigned long long *hhi; /* [segs][SEL_BINS]: sums of the 2^-40 halves */
	unsigned long long *hlo; /* [segs][SEL_BINS]: sums of the 2^-80 halves */
	u64 *cand;               /* [segs][cand_cap]: candidates (see ckey) */
	uint32_t cand_cap;
	size_t bytes;
};

static size_t align256(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

static sel_scratch carve(void *base, uint32_t n_seqs, uint32_t hq, uint32_t hkv, uint32_t max_n)
{
	(void)hkv;
	const size_t segs = (size_t)n_seqs * hq;
	sel_scratch s;
	char *p = (char *)base;
	size_t off = 0;
	/* the list: max_n / 8 candidates, within [2 SEL_SORT, SEL_CAND] and at most max_n, so that it
	 * stays at most half the scores' bytes past 16K tokens */
	uint32_t cap = max_n / 8;
	cap = cap < 2 * SEL_SORT ? 2 * SEL_SORT : cap > SEL_CAND ? SEL_CAND : cap;
	s.cand_cap = cap < max_n ? cap : max_n;
	s.st = (seg_state *)(p + off);
	off += align256(segs * sizeof(seg_state));
	s.hcnt = (uint32_t *)(p + off);
	off += align256(segs * SEL_BINS * sizeof(uint32_t));
	s.hhi = (unsigned long long *)(p + off);
	off += align256(segs * SEL_BINS * 8);
	s.hlo = (unsigned long long *)(p + off);
	off += align256(segs * SEL_BINS * 8);
	s.cand = (u64 *)(p + off);
	off += align256(segs * s.cand_cap * 8);
	s.bytes = off;
	return s;
}

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
 * bins are ordered like the scores, largest first, and equal scores share one.
 */
static __device__ __forceinline__ uint32_t lbin(float s, float mx, float inv_w)
{
	if (!(inv_w > 0.0f)) /* one bin (then max - s may be infinite, and inf * 0 NaN) */
		return 0;
	return (uint32_t)fminf(__fmul_rn(__fsub_rn(mx, s), inv_w), (float)(SEL_BINS - 1));
}

static __device__ __forceinline__ double mass_d(u128 x)
{
	/* exact high part (< 2^53) plus the rounded low part, then one rounding: monotone in x */
	const double hi = (double)(unsigned long long)(x >> 64), lo = (double)(unsigned long long)x;
	return (hi * 18446744073709551616.0 + lo) * 0x1p-80;
}

static __device__ __forceinline__ u128 mk128(unsigned long long hi40, unsigned long long lo40)
{
	return ((u128)hi40 << 40) + lo40;
}

/* The CPU's mass term, split into its 2^-40 and 2^-80 parts (truncated below 2^-80). */
static __device__ __forceinline__ void term(float s, float max, float scale, unsigned long long *hi,
					    unsigned long long *lo)
{
	const double x = (double)__fsub_rn(s, max) * (double)scale;
	*hi = *lo = 0;
	if (x < -56.2) /* exp(x) < 2^-81: below the unit */
		return;
	const double t = exp(x) * 0x1p40, h = floor(t);
	*hi = (unsigned long long)h;
	*lo = (unsigned long long)((t - h) * 0x1p40);
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
 * A shared histogram of masses: per bin the sums of the terms' 2^-40 and 2^-80 halves, each in
 * two 32-bit words, the four words in separate rows so that lanes on distinct bins hit distinct
 * banks.
 */
struct mhist {
	uint32_t *w; /* [4][bins] */
	uint32_t bins;
	__device__ void zero(uint32_t b)
	{
		w[b] = w[bins + b] = w[2 * bins + b] = w[3 * bins + b] = 0;
	}
	__device__ void add(uint32_t b, float s, float mx, float scale)
	{
		unsigned long long th, tl;
		term(s, mx, scale, &th, &tl);
		if (th)
			smem_add64(w + b, w + bins + b, th);
		if (tl)
			smem_add64(w + 2 * bins + b, w + 3 * bins + b, tl);
	}
	__device__ u64 hi(uint32_t b) const
	{
		return (u64)w[bins + b] << 32 | w[b];
	}
	__device__ u64 lo(uint32_t b) const
	{
		return (u64)w[3 * bins + b] << 32 | w[2 * bins + b];
	}
};

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

/* f(position, score) for each score of this thread's share of the chunk. */
template <class F>
static __device__ __forceinline__ void each_in_chunk(const float *s, uint32_t c0, uint32_t n, F f)
{
	float4 v[SEL_VEC];
	load_chunk(v, s, c0, n);
#pragma unroll
	for (int k = 0; k < SEL_VEC; k++) {
		const uint32_t i = c0 + 4 * (threadIdx.x + k * SEL_THREADS);
		const float x[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
		for (int e = 0; e < 4; e++)
			f(i + e, x[e]); /* past n: f checks */
	}
}

/* The same over the chunks of the segment that fall to this block (grid-stride: a segment has at
 * most sel_blocks() blocks, so that the per-block flush of the histograms does not grow with n). */
template <class F>
static __device__ __forceinline__ void each_of_block(const float *s, uint32_t n, F f)
{
	for (uint32_t c0 = blockIdx.x * SEL_CHUNK; c0 < n; c0 += gridDim.x * SEL_CHUNK)
		each_in_chunk(s, c0, n, f);
}

/* ---- the block's decision over a histogram ----------------------------------------------- */

/* Block-wide exclusive prefix over threads in index order of a count and a 128-bit mass. */
static __device__ void scan_excl(uint32_t &c, u128 &m, uint32_t *tc, u128 *tm)
{
	__shared__ uint32_t wc[SEL_THREADS / 32];
	__shared__ u128 wm[SEL_THREADS / 32];
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	uint32_t ic = c;
	u128 im = m;
	for (int o = 1; o < 32; o <<= 1) {
		const uint32_t oc = __shfl_up_sync(0xffffffffu, ic, o);
		const unsigned long long mh =
			__shfl_up_sync(0xffffffffu, (unsigned long long)(im >> 64), o);
		const unsigned long long ml =
			__shfl_up_sync(0xffffffffu, (unsigned long long)im, o);
		if (lane >= (uint32_t)o) {
			ic += oc;
			im += ((u128)mh << 64) | ml;
		}
	}
	if (lane == 31) {
		wc[warp] = ic;
		wm[warp] = im;
	}
	__syncthreads();
	uint32_t bc = 0;
	u128 bm = 0;
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
	u128 acc;   /* mass before j */
	u128 total; /* mass of all bins (the first level's target comes from it) */
};

/*
 * Walks BINS bins from the largest scores down (get(j, &count, &mass)) and picks, with `above`
 * scores and `acc` mass before the first: by mass (MASS), the bin where f(acc) < target <=
 * f(acc + its mass), or when rounding left p Z above the total, the last nonempty one (the CPU
 * then takes the smallest value); by count, the bin holding the want-th largest. target < 0: the
 * first level, whose target is p * f(total). Every thread of the block calls it; all get the pick.
 */
template <uint32_t BINS, bool MASS, class Get>
static __device__ pick decide(Get get, uint32_t above0, u128 acc0, double target, float p,
			      uint32_t want)
{
	constexpr uint32_t per = BINS / SEL_THREADS;
	static_assert(BINS % SEL_THREADS == 0, "the decision gives each thread whole bins");
	__shared__ pick win;
	__shared__ uint32_t last;
	/* bins are read twice rather than held: the kernels' streaming passes want few registers */
	uint32_t c = 0, bc;
	u128 m = 0, bm;
#pragma unroll 1
	for (uint32_t k = 0; k < per; k++) {
		get(threadIdx.x * per + k, &bc, &bm);
		c += bc;
		m += bm;
	}
	if (threadIdx.x == 0) {
		win.j = SEL_NONE;
		last = 0;
	}
	uint32_t tc;
	u128 tm;
	scan_excl(c, m, &tc, &tm); /* also a barrier for win and last */
	if (MASS && target < 0.0)
		target = (double)p * mass_d(acc0 + tm);
	uint32_t above = above0 + c;
	u128 am = acc0 + m;
#pragma unroll 1
	for (uint32_t k = 0; k < per; k++) {
		const uint32_t j = threadIdx.x * per + k;
		get(j, &bc, &bm);
		bool hit;
		if (MASS)
			hit = bc && mass_d(am) < target && target <= mass_d(am + bm);
		else
			hit = bc && above < want && want <= above + bc;
		if (hit)
			win = pick{.j = j, .above = above, .cnt = bc, .acc = am, .total = tm};
		if (bc)
			atomicMax(&last, j);
		above += bc;
		am += bm;
	}
	__syncthreads();
	if (win.j == SEL_NONE) { /* only by mass */
		above = above0 + c;
		am = acc0 + m;
#pragma unroll 1
		for (uint32_t k = 0; k < per; k++) {
			const uint32_t j = threadIdx.x * per + k;
			get(j, &bc, &bm);
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

/* ---- pass 1: max, min, finiteness -------------------------------------------------------- */

static __global__ void __launch_bounds__(SEL_THREADS)
	k_stats(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t max_n, uint32_t hq,
		float scale, float p, uint32_t bmin, uint32_t bmax, sel_scratch sc,
		kvt_gpu_topp *out, unsigned long long *err)
{
	__shared__ uint32_t red[3][SEL_THREADS / 32];
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x;
	seg_state *st = sc.st + seg;
	const uint32_t n = n_tok[seq], nn = n > max_n ? 0 : n;
	const float *s = scores + (size_t)seg * ld;

	/* the histogram starts at zero */
	for (uint32_t e = blockIdx.x * SEL_THREADS + tid; e < SEL_BINS;
	     e += gridDim.x * SEL_THREADS) {
		const size_t b = (size_t)seg * SEL_BINS + e;
		sc.hcnt[b] = 0;
		sc.hhi[b] = sc.hlo[b] = 0;
	}
	uint32_t kmax = 0, nmin = 0, bad = 0;
	each_of_block(s, nn, [&](uint32_t i, float f) {
		if (i >= nn)
			return;
		if (!isfinite(f)) {
			bad = max(bad, 0xffffffffu - i);
			return;
		}
		const uint32_t key = kvt_d_fkey(f);
		kmax = max(kmax, key);
		nmin = max(nmin, ~key);
	});
	for (int o = 16; o; o >>= 1) {
		kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
		nmin = max(nmin, __shfl_xor_sync(0xffffffffu, nmin, o));
		bad = max(bad, __shfl_xor_sync(0xffffffffu, bad, o));
	}
	if (tid % 32 == 0) {
		red[0][tid / 32] = kmax;
		red[1][tid / 32] = nmin;
		red[2][tid / 32] = bad;
	}
	__syncthreads();
	if (tid == 0) {
		for (int w = 1; w < SEL_THREADS / 32; w++) {
			kmax = max(kmax, red[0][w]);
			nmin = max(nmin, red[1][w]);
			bad = max(bad, red[2][w]);
		}
		if (kmax)
			atomicMax(&st->max_key, kmax);
		if (nmin)
			atomicMax(&st->nmin_key, nmin);
		if (bad)
			atomicMax(&st->bad, bad);
	}
	if (!last_block(st) || tid != 0)
		return;
	st->done = 0;
	kvt_gpu_topp *o = out + seg;
	const float lo = kvt_d_keyf(~__ldcg(&st->nmin_key)), hi = kvt_d_keyf(__ldcg(&st->max_key));
	int clamped = 0;
	if (p >= 1.0f && n <= max_n)
		clamp_want(n, n, bmin, bmax, &clamped); /* everything, unless bmax cuts it */
	if (n > max_n) {
		kvt_d_raise(err, KVT_GPU_ERR_RANGE, seg, n);
		finalize(st, o, 0.0f, 0, 0, 0, ~0ull);
	} else if (n == 0) {
		finalize(st, o, 0.0f, 0, 0, 0, ~0ull);
	} else if (__ldcg(&st->bad)) {
		kvt_d_raise(err, KVT_GPU_ERR_NONFINITE, seg, 0xffffffffu - __ldcg(&st->bad));
		finalize(st, o, 0.0f, 0, 0, 0, ~0ull);
	} else if (p >= 1.0f && !clamped) {
		finalize(st, o, lo, n, n, 0, (unsigned long long)kvt_d_fkey(lo) << 32);
	} else {
		/* bins over [max - span, max], span the range or SEL_SPAN_NATS, the lesser */
		const float span = fminf(__fsub_rn(hi, lo), __fdiv_rn(SEL_SPAN_NATS, scale));
		const float inv = __fdiv_rn((float)SEL_BINS, span);
		st->inv_w = span > 0.0f && isfinite(inv) ? inv : 0.0f; /* 0: one bin */
		st->phase = PH_HIST;
	}
}

/* ---- pass 2: the log-mass histogram and its boundary bins -------------------------------- */

/*
 * The histogram's last block: the segment's histogram into shared memory, then the boundary bins.
 * Out of line, so that its registers do not weigh on the streaming pass before it.
 */
static __device__ __noinline__ void hist_decide(seg_state *st, const uint32_t *gc,
						const unsigned long long *gh,
						const unsigned long long *gl, uint32_t *hc,
						uint32_t *hw, uint32_t n, float p, uint32_t bmin,
						uint32_t bmax, uint32_t cand_cap)
{
	const uint32_t tid = threadIdx.x;
	const bool mass = p < 1.0f;
	const mhist hm{hw, SEL_BINS};
	/* the segment's histogram into shared memory, every load in flight at once (the decisions
	 * read each bin twice, and L2 round trips one after the other cost more than the pass) */
#pragma unroll
	for (uint32_t k = 0; k < SEL_BINS / SEL_THREADS; k++) {
		const uint32_t b = tid + k * SEL_THREADS;
		const uint32_t c = __ldcg(gc + b);
		const u64 xh = mass ? __ldcg(gh + b) : 0, xl = mass ? __ldcg(gl + b) : 0;
		hc[b] = c;
		hw[b] = (uint32_t)xh;
		hw[SEL_BINS + b] = (uint32_t)(xh >> 32);
		hw[2 * SEL_BINS + b] = (uint32_t)xl;
		hw[3 * SEL_BINS + b] = (uint32_t)(xl >> 32);
	}
	__syncthreads();
	/* the decisions; bin j holds the j-th largest band of scores */
	auto get = [&](uint32_t j, uint32_t *c, u128 *m) {
		*c = hc[j];
		*m = mk128(hm.hi(j), hm.lo(j));
	};
	uint32_t bin[NEEDS] = {SEL_NONE, SEL_NONE, SEL_NONE}, above[NEEDS] = {0, 0, 0},
		 cnt[NEEDS] = {0, 0, 0};
	if (mass) {
		const pick w = decide<SEL_BINS, true>(get, 0, 0, -1.0, p, 0);
		bin[NEED_MASS] = w.j;
		above[NEED_MASS] = w.above;
		cnt[NEED_MASS] = w.cnt;
		if (tid == 0) {
			st->acc_hi = (u64)(w.acc >> 64);
			st->acc_lo = (u64)w.acc;
			st->target = (double)p * mass_d(w.total);
		}
	}
	/* the clamp's boundary, should the Top-p count fall outside [bmin, bmax] */
	const uint32_t rank[NEEDS] = {0, bmin < n ? bmin : n, bmax < n ? bmax : 0};
	for (int k = NEED_MIN; k < NEEDS; k++) {
		if (!rank[k])
			continue;
		const pick w = decide<SEL_BINS, false>(get, 0, 0, 0.0, p, rank[k]);
		bin[k] = w.j;
		above[k] = w.above;
		cnt[k] = w.cnt;
	}
	if (tid != 0)
		return;
	uint32_t total = 0;
	for (int k = 0; k < NEEDS; k++) {
		st->bin[k] = bin[k];
		st->above[k] = above[k];
		bool again = false;
		for (int e = 0; e < k; e++)
			again |= bin[e] == bin[k];
		total += bin[k] != SEL_NONE && !again ? cnt[k] : 0;
	}
	st->listed = total <= cand_cap;
	st->ncand = 0;
	st->done = 0;
	st->phase = PH_CAND;
}

static __global__ void __launch_bounds__(SEL_THREADS, 4)
	k_hist(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq, float scale,
	       float p, uint32_t bmin, uint32_t bmax, sel_scratch sc)
{
	__shared__ uint32_t hc[SEL_BINS], hw[4 * SEL_BINS];
	mhist hm{hw, SEL_BINS};
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x;
	seg_state *st = sc.st + seg;
	if (__ldcg(&st->phase) != PH_HIST)
		return;
	const uint32_t n = n_tok[seq];
	const float mx = kvt_d_keyf(__ldcg(&st->max_key)), inv_w = __ldcg(&st->inv_w);
	const bool mass = p < 1.0f;
	for (uint32_t b = tid; b < SEL_BINS; b += SEL_THREADS)
	{
		hc[b] = 0;
		hm.zero(b);
	}
	__syncthreads();
	each_of_block(scores + (size_t)seg * ld, n, [&](uint32_t i, float f) {
		if (i >= n)
			return;
		const uint32_t b = lbin(f, mx, inv_w);
		atomicAdd(&hc[b], 1u);
		if (mass)
			hm.add(b, f, mx, scale);
	});
	__syncthreads();
	uint32_t *gc = sc.hcnt + (size_t)seg * SEL_BINS;
	unsigned long long *gh = sc.hhi + (size_t)seg * SEL_BINS, *gl = sc.hlo + (size_t)seg * SEL_BINS;
	for (uint32_t b = tid; b < SEL_BINS; b += SEL_THREADS) {
		if (!hc[b])
			continue;
		atomicAdd(&gc[b], hc[b]);
		const u64 xh = hm.hi(b), xl = hm.lo(b);
		if (xh)
			atomicAdd(&gh[b], xh);
		if (xl)
			atomicAdd(&gl[b], xl);
	}
	if (!last_block(st))
		return;

	hist_decide(st, gc, gh, gl, hc, hw, n, p, bmin, bmax, sc.cand_cap);
}

/* ---- pass 3: candidates, and the exact resolution ---------------------------------------- */

/* Where the resolution reads its scores: the candidate list, or the whole segment. */
struct source {
	const u64 *cand;
	uint32_t ncand;
	bool listed;
	const float *s;
	uint32_t n;
};

/* f(ckey, score) for each score of the source in this thread's share. */
template <class F>
static __device__ void each_of(const source &src, F f)
{
	if (src.listed) {
		for (uint32_t i = threadIdx.x; i < src.ncand; i += SEL_THREADS) {
			const u64 c = __ldcg(src.cand + i);
			f(c, kvt_d_keyf((uint32_t)(c >> 24)));
		}
		return;
	}
	for (uint32_t c0 = 0; c0 < src.n; c0 += SEL_CHUNK)
		each_in_chunk(src.s, c0, src.n, [&](uint32_t i, float x) {
			if (i < src.n)
				f(ckey(kvt_d_fkey(x), i), x);
		});
}

/* The resolution's state, in shared memory: the ckey digits fixed so far and what lies above. */
struct resolve_state {
	u64 prefix;
	uint32_t above, cnt;
	u128 acc;
	double target;
	uint32_t want;
};

/*
 * One level of the in-block radix select: histogram the digit at SHIFT of the candidates of bin
 * `bin` whose higher digits equal the prefix, pick the digit (by mass or by rank), fix it.
 */
template <bool MASS, int SHIFT, int WIDTH>
static __device__ void rlevel(const source &src, uint32_t bin, float mx, float inv_w, float scale,
			      uint32_t *smem, resolve_state *rs)
{
	constexpr uint32_t bins = 1u << WIDTH;
	constexpr int top = SHIFT + WIDTH;
	static_assert(MASS ? bins <= SEL_BINS : bins <= SEL_CNT_BINS, "digits fit the histogram");
	/* counts of up to SEL_CNT_BINS digits; masses (of at most SEL_BINS) after the first SEL_BINS */
	uint32_t *hc = smem;
	mhist hm{smem + SEL_BINS, bins};
	const u64 prefix = rs->prefix;
	for (uint32_t b = threadIdx.x; b < bins; b += SEL_THREADS) {
		hc[b] = 0;
		if (MASS)
			hm.zero(b);
	}
	__syncthreads();
	each_of(src, [&](u64 c, float x) {
		if ((c >> top) != (prefix >> top) || lbin(x, mx, inv_w) != bin)
			return;
		const uint32_t d = (uint32_t)(c >> SHIFT) & (bins - 1);
		atomicAdd(&hc[d], 1u);
		if (MASS)
			hm.add(d, x, mx, scale);
	});
	__syncthreads();
	/* digits from the largest down */
	auto get = [&](uint32_t j, uint32_t *c, u128 *m) {
		const uint32_t d = bins - 1 - j;
		*c = hc[d];
		*m = MASS ? mk128(hm.hi(d), hm.lo(d)) : 0;
	};
	const pick w = decide<bins, MASS>(get, rs->above, rs->acc, rs->target, 1.0f, rs->want);
	if (threadIdx.x == 0) {
		rs->prefix = prefix | (u64)(bins - 1 - w.j) << SHIFT;
		rs->above = w.above;
		rs->cnt = w.cnt;
		rs->acc = w.acc;
	}
	__syncthreads();
}

/* The want-th largest ckey among the candidates of `bin`: the cut that marks exactly want. */
static __device__ u64 rank_cut(const source &src, uint32_t bin, uint32_t above, uint32_t want,
			       float mx, float inv_w, uint32_t *smem, resolve_state *rs)
{
	__syncthreads(); /* every thread has read what the mass levels left in rs */
	if (threadIdx.x == 0) {
		rs->prefix = 0;
		rs->above = above;
		rs->acc = 0;
		rs->target = 0.0;
		rs->want = want;
	}
	__syncthreads();
	rlevel<false, 45, 11>(src, bin, mx, inv_w, 0.0f, smem, rs);
	rlevel<false, 34, 11>(src, bin, mx, inv_w, 0.0f, smem, rs);
	rlevel<false, 24, 10>(src, bin, mx, inv_w, 0.0f, smem, rs);
	if (rs->above + rs->cnt == want) /* the ties fit whole */
		return (rs->prefix >> 24) << 32;
	rlevel<false, 12, 12>(src, bin, mx, inv_w, 0.0f, smem, rs); /* lowest positions first */
	rlevel<false, 0, 12>(src, bin, mx, inv_w, 0.0f, smem, rs);
	return cut_of(rs->prefix);
}

/* ---- the resolution of a short list: sorted in shared memory ----------------------------- */

static __device__ void sort_desc(u64 *a, uint32_t P) /* bitonic, P a power of two */
{
	for (uint32_t k = 2; k <= P; k <<= 1)
		for (uint32_t j = k >> 1; j > 0; j >>= 1) {
			for (uint32_t i = threadIdx.x; i < P; i += SEL_THREADS) {
				const uint32_t l = i ^ j;
				if (l > i) {
					const u64 x = a[i], y = a[l];
					if ((i & k) == 0 ? x < y : x > y) {
						a[i] = y;
						a[l] = x;
					}
				}
			}
			__syncthreads();
		}
}

/* The index of the first candidate of bin b in the sorted list (a bin's candidates are adjacent). */
static __device__ uint32_t first_of(const u64 *a, uint32_t m, uint32_t b, float mx, float inv_w)
{
	__shared__ uint32_t lo;
	if (threadIdx.x == 0)
		lo = SEL_NONE;
	__syncthreads();
	for (uint32_t i = threadIdx.x; i < m; i += SEL_THREADS)
		if (lbin(kvt_d_keyf((uint32_t)(a[i] >> 24)), mx, inv_w) == b)
			atomicMin(&lo, i);
	__syncthreads();
	const uint32_t r = lo;
	__syncthreads();
	return r;
}

/*
 * The Top-p value among the sorted candidates of bin b, with `acc` the mass of the larger bins:
 * the first candidate i where f(acc + mass of b's candidates up to i) reaches the target gives it
 * (every larger value's mass, ties included, ends before i, and the bin's decision guarantees
 * f(acc) < target); when rounding left the target above the total, the bin's last (smallest).
 * Returns its key; *ge is the number of b's candidates at or above it.
 */
static __device__ uint32_t mass_sorted(const u64 *a, uint32_t m, uint32_t b, float mx, float inv_w,
				       float scale, u128 acc, double target, uint32_t *ge)
{
	__shared__ uint32_t istar, hi, end;
	const uint32_t E = (m + SEL_THREADS - 1) / SEL_THREADS, i0 = threadIdx.x * E,
		       i1 = min(i0 + E, m);
	const uint32_t lo = first_of(a, m, b, mx, inv_w);
	if (threadIdx.x == 0) {
		istar = SEL_NONE;
		hi = end = 0;
	}
	auto mass_of = [&](uint32_t i, u128 *t) {
		const float x = kvt_d_keyf((uint32_t)(a[i] >> 24));
		if (lbin(x, mx, inv_w) != b)
			return false;
		unsigned long long th, tl;
		term(x, mx, scale, &th, &tl);
		*t = mk128(th, tl);
		return true;
	};
	uint32_t c = 0, tc;
	u128 run = 0, t, tm;
	for (uint32_t i = i0; i < i1; i++)
		if (mass_of(i, &t))
			run += t;
	scan_excl(c, run, &tc, &tm); /* also the barrier for istar, hi, end */
	run += acc;
	for (uint32_t i = i0; i < i1; i++)
		if (mass_of(i, &t)) {
			run += t;
			atomicMax(&hi, i);
			if (mass_d(run) >= target) {
				atomicMin(&istar, i);
				break;
			}
		}
	__syncthreads();
	const uint32_t key = (uint32_t)(a[istar != SEL_NONE ? istar : hi] >> 24);
	for (uint32_t i = threadIdx.x; i < m; i += SEL_THREADS)
		if ((uint32_t)(a[i] >> 24) == key)
			atomicMax(&end, i);
	__syncthreads();
	*ge = end - lo + 1;
	__syncthreads();
	return key;
}

/*
 * The last block's exact resolution of a segment: the Top-p value in bin[NEED_MASS], then the
 * clamp. Out of line, so that its registers do not weigh on the streaming pass before it.
 */
static __device__ __noinline__ void resolve(seg_state *st, const float *s, uint32_t n,
					    const u64 *cand, float scale, float p, uint32_t bmin,
					    uint32_t bmax, kvt_gpu_topp *out)
{
	__shared__ u64 smem64[5 * SEL_BINS / 2]; /* the sorted list, or rlevel's histograms */
	__shared__ resolve_state rs;
	uint32_t *smem = (uint32_t *)smem64;
	const uint32_t tid = threadIdx.x;
	const float mx = kvt_d_keyf(__ldcg(&st->max_key)), inv_w = __ldcg(&st->inv_w);
	const uint32_t b0 = __ldcg(&st->bin[NEED_MASS]);
	const bool listed = __ldcg(&st->listed);
	const uint32_t m = __ldcg(&st->ncand);
	const source src = {.cand = cand, .ncand = m, .listed = listed, .s = s, .n = n};
	float thresh = kvt_d_keyf(~__ldcg(&st->nmin_key));
	uint32_t count = n;
	u64 *a = smem64;
	const bool sorted = listed && m <= SEL_SORT;
	if (sorted) {
		uint32_t P = 1;
		while (P < m)
			P <<= 1;
		for (uint32_t i = tid; i < P; i += SEL_THREADS)
			a[i] = i < m ? __ldcg(cand + i) : 0; /* 0: below every candidate */
		__syncthreads();
		sort_desc(a, P);
	}
	if (p < 1.0f && sorted) {
		uint32_t ge;
		const uint32_t key = mass_sorted(
			a, m, b0, mx, inv_w, scale,
			(u128)__ldcg(&st->acc_hi) << 64 | __ldcg(&st->acc_lo), __ldcg(&st->target), &ge);
		thresh = kvt_d_keyf(key);
		count = __ldcg(&st->above[NEED_MASS]) + ge;
	} else if (p < 1.0f) {
		if (tid == 0) {
			rs.prefix = 0;
			rs.above = __ldcg(&st->above[NEED_MASS]);
			rs.acc = (u128)__ldcg(&st->acc_hi) << 64 | __ldcg(&st->acc_lo);
			rs.target = __ldcg(&st->target);
			rs.want = 0;
		}
		__syncthreads();
		rlevel<true, 45, 11>(src, b0, mx, inv_w, scale, smem, &rs);
		rlevel<true, 34, 11>(src, b0, mx, inv_w, scale, smem, &rs);
		rlevel<true, 24, 10>(src, b0, mx, inv_w, scale, smem, &rs);
		thresh = kvt_d_keyf((uint32_t)(rs.prefix >> 24));
		count = rs.above + rs.cnt;
	}
	int clamped;
	const uint32_t want = clamp_want(count, n, bmin, bmax, &clamped);
	u64 cut = (u64)kvt_d_fkey(thresh) << 32;
	if (clamped) {
		const int k = clamped > 0 ? NEED_MIN : NEED_MAX;
		const uint32_t bw = __ldcg(&st->bin[k]), above = __ldcg(&st->above[k]);
		if (sorted) /* the want-th largest: its bin's (want - above)-th */
			cut = cut_of(a[first_of(a, m, bw, mx, inv_w) + (want - above) - 1]);
		else
			cut = rank_cut(src, bw, above, want, mx, inv_w, smem, &rs);
	}
	if (tid == 0) {
		st->done = 0;
		finalize(st, out, thresh, count, want, clamped, cut);
	}
}

static __global__ void __launch_bounds__(SEL_THREADS, 4)
	k_cand(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq, float scale,
	       float p, uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out)
{
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x, lane = tid % 32;
	seg_state *st = sc.st + seg;
	if (__ldcg(&st->phase) != PH_CAND)
		return;
	const uint32_t n = n_tok[seq];
	const float mx = kvt_d_keyf(__ldcg(&st->max_key)), inv_w = __ldcg(&st->inv_w);
	const uint32_t b0 = __ldcg(&st->bin[0]), b1 = __ldcg(&st->bin[1]), b2 = __ldcg(&st->bin[2]);
	const bool listed = __ldcg(&st->listed);
	const float *s = scores + (size_t)seg * ld;
	u64 *cand = sc.cand + (size_t)seg * sc.cand_cap;
	if (listed)
		each_of_block(s, n, [&](uint32_t i, float f) {
			uint32_t b = lbin(f, mx, inv_w);
			const bool in = i < n && (b == b0 || b == b1 || b == b2);
			const uint32_t vote = __ballot_sync(0xffffffffu, in);
			if (!vote)
				return;
			uint32_t base = 0;
			if (lane == (uint32_t)__ffs(vote) - 1)
				base = atomicAdd(&st->ncand, (uint32_t)__popc(vote));
			base = __shfl_sync(0xffffffffu, base, __ffs(vote) - 1);
			if (in)
				cand[base + __popc(vote & ((1u << lane) - 1))] = ckey(kvt_d_fkey(f), i);
		});
	if (!last_block(st))
		return;

	resolve(st, s, n, cand, scale, p, bmin, bmax, out + seg);
}

/* ---- launchers --------------------------------------------------------------------------- */

/* Blocks per segment for the threshold's passes: a chunk each, but no more than about four
 * blocks per multiprocessor over all segments (then each takes several chunks). */
static uint32_t sel_blocks(uint32_t max_n, uint32_t segs)
{
	const uint32_t chunks = max_n ? (max_n + SEL_CHUNK - 1) / SEL_CHUNK : 1;
	int dev = 0, sms = 132;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
		(void)cudaGetLastError(); /* the launches that follow report their own errors */
		sms = 132;
	}
	const uint32_t cap = (uint32_t)sms * 4 / segs;
	return chunks < cap ? chunks : cap ? cap : 1;
}

extern "C" size_t kvt_gpu_select_scratch_bytes(uint32_t n_seqs, uint32_t n_q_heads,
					       uint32_t n_kv_heads, uint32_t max_n)
{
	/* kvt_gpu_topp_union keeps its bits at the start of the same scratch, after the threshold */
	const size_t t = carve(NULL, n_seqs, n_q_heads, n_kv_heads, max_n).bytes,
		     u = kvt_gpu_selbits_bytes((size_t)n_seqs * n_kv_heads, max_n);
	return t > u ? t : u;
}

static bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

extern "C" int kvt_gpu_topp_threshold(uint32_t n_seqs, uint32_t n_q_heads, const float *scores,
				      size_t ld, const uint32_t *n_tokens, uint32_t max_n,
				      float scale, float p, uint32_t bmin, uint32_t bmax,
				      kvt_gpu_topp *out, void *scratch, size_t scratch_bytes,
				      unsigned long long *err, void *stream)
{
	if (!scores || !n_tokens || !out || !scratch || n_q_heads == 0)
		return -EINVAL;
	if (ld % 4 || max_n > ld || max_n > KVT_GPU_SELECT_MAX_N || !aligned16(scores) || !aligned16(scratch))
		return -EINVAL;
	if (!(scale > 0.0f) || !isfinite(scale) || !(p > 0.0f))
		return -EINVAL;
	if ((uint64_t)n_seqs * n_q_heads > 65535)
		return -EINVAL;
	const sel_scratch sc = carve(scratch, n_seqs, n_q_heads, 1, max_n);
	if (scratch_bytes < sc.bytes)
		return -EINVAL;
	if (n_seqs == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	const uint32_t segs = n_seqs * n_q_heads;
	KVT_CU(cudaMemsetAsync(sc.st, 0, segs * sizeof(seg_state), s));
	const dim3 grid(sel_blocks(max_n, segs), segs);
	k_stats<<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, max_n, n_q_heads, scale, p, bmin,
					     bmax, sc, out, err);
	KVT_CU_LAUNCHED();
	k_hist<<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, n_q_heads, scale, p, bmin, bmax,
					    sc);
	KVT_CU_LAUNCHED();
	k_cand<<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, n_q_heads, scale, p, bmin, bmax,
					    sc, out);
	KVT_CU_LAUNCHED();
	return 0;
}
