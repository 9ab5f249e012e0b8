/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection without sorting.
 *
 * Every pass is one launch over all (sequence, query head) segments, each split into chunks of
 * SEL_CHUNK scores, one block per chunk. Blocks build shared-memory histograms, add their nonzero
 * bins into the segment's global histogram with integer atomics, and the last block of a segment to
 * finish (a counter in the segment's state) reads the histogram, decides, and prepares the next
 * pass. Integer sums make the result independent of block order, so a run is reproducible.
 *
 * The mass of a score s is exp((double)(s - max) * scale), the CPU's expression. It is summed in
 * unsigned 128-bit fixed point with unit 2^-80 (terms are at most 1; a term is truncated below
 * 2^-80, so n terms lose under n * 2^-80, far below the double rounding the CPU's own sums carry),
 * carried as two 40-bit halves so that 64-bit atomics cannot overflow below 2^24 scores per
 * segment. A bin is chosen where f(mass above) < target <= f(mass above + bin), f the monotone
 * conversion to double and target = p * f(total); refining a bin re-partitions exactly the same
 * terms, so each level finds exactly one such bin, and the last level yields the CPU's definition:
 * the largest score v with mass(> v) < p Z <= mass(>= v).
 */
#include "common.cuh"
#include "score.cuh"
#include "select.cuh"

#define SEL_THREADS 256
#define SEL_CHUNK 8192u /* scores per block: 8 float4 per thread */
#define SEL_CNT_BINS 4096u
#define SEL_MASS_BINS 2048u
/* Equal-width intervals of the first mass level. Only a pruning step (the key radix after it is
 * exact whatever interval it keeps), so few: every block adds each nonzero bin of its chunk to the
 * segment's histogram with three global atomics, and with 2048 intervals, nearly all of them
 * nonzero, those atomics were most of the pass. */
#define SEL_M0_BINS 256u
#define SEL_MAX_N (1u << 24)

typedef unsigned __int128 u128;

/* The phases of a segment, one launch each (a segment not in a launch's phase skips it). */
enum {
	PH_INIT = 0,
	/* mass histogram over equal-width score intervals */
	PH_M0,
	/* mass radix over the score keys within the chosen interval */
	PH_M1,
	PH_M2,
	PH_M3,
	/* count radix (budget clamp) over the score keys */
	PH_C0,
	PH_C1,
	PH_C2,
	/* count radix over positions among tied scores */
	PH_P0,
	PH_P1,
	PH_DONE
};

struct seg_state {
	uint32_t phase, done;
	uint32_t max_key, nmin_key; /* order-preserving keys of the max and (complemented) min */
	uint32_t bad;               /* 0xffffffff - position of the first non-finite score, or 0 */
	uint32_t prefix, pprefix;   /* digits fixed so far: score key, position key */
	uint32_t above;             /* elements above the candidate range */
	uint32_t want;              /* rank sought by the count radix */
	uint32_t count, marked;
	int32_t clamped;
	float thresh;
	uint32_t b0;                       /* the interval chosen by PH_M0 */
	float smin, inv_w;                 /* intervals: bin = (s - smin) * inv_w */
	unsigned long long acc_lo, acc_hi; /* mass above the candidate range */
	double target;
};

struct sel_scratch {
	seg_state *st;
	uint32_t *hcnt;          /* [segs][SEL_CNT_BINS] */
	unsigned long long *hhi; /* [segs][SEL_MASS_BINS]: sums of the 2^-40 halves */
	unsigned long long *hlo; /* [segs][SEL_MASS_BINS]: sums of the 2^-80 halves */
	uint32_t *mask;          /* [items][mwords]: union bitmaps */
	uint32_t *ccount;        /* [items][uchunks]: selected per union chunk */
	size_t bytes;
};

static size_t align256(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

static sel_scratch carve(void *base, uint32_t n_seqs, uint32_t hq, uint32_t hkv, uint32_t max_n)
{
	const size_t segs = (size_t)n_seqs * hq, items = (size_t)n_seqs * hkv;
	const size_t mwords = ((size_t)max_n + 31) / 32,
		     uchunks = ((size_t)max_n + SEL_CHUNK - 1) / SEL_CHUNK;
	sel_scratch s;
	char *p = (char *)base;
	size_t off = 0;
	s.st = (seg_state *)(p + off);
	off += align256(segs * sizeof(seg_state));
	s.hcnt = (uint32_t *)(p + off);
	off += align256(segs * SEL_CNT_BINS * sizeof(uint32_t));
	s.hhi = (unsigned long long *)(p + off);
	off += align256(segs * SEL_MASS_BINS * 8);
	s.hlo = (unsigned long long *)(p + off);
	off += align256(segs * SEL_MASS_BINS * 8);
	s.mask = (uint32_t *)(p + off);
	off += align256(items * mwords * 4);
	s.ccount = (uint32_t *)(p + off);
	off += align256(items * uchunks * 4);
	s.bytes = off;
	return s;
}

/* ---- keys and numbers -------------------------------------------------------------------- */

/* Order-preserving unsigned key of a finite float, -0 taken as +0 (they compare equal on the CPU). */
static __device__ __forceinline__ uint32_t fkey(float f)
{
	uint32_t u = __float_as_uint(__fadd_rn(f, 0.0f));
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static __device__ __forceinline__ float keyf(uint32_t k)
{
	return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/*
 * The first mass level bins scores by value over [min, max] in equal intervals rather than by
 * their top key bits: key bins are an octave wide over a quarter, so a normal spread of scores
 * piles into a dozen of them and the histogram atomics serialize; equal intervals spread them.
 * Monotone in s (each step rounds monotonically), so the bins are ordered like the scores.
 */
static __device__ __forceinline__ uint32_t lbin(float s, float smin, float inv_w)
{
	if (!(inv_w > 0.0f))
		return 0;
	return (uint32_t)fminf(__fmul_rn(__fsub_rn(s, smin), inv_w), (float)(SEL_M0_BINS - 1));
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

/* ---- the segment's end ------------------------------------------------------------------- */

static __device__ void finalize(seg_state *st, kvt_gpu_topp *o, unsigned long long cut)
{
	o->thresh = st->thresh;
	o->count = st->count;
	o->marked = st->marked;
	o->clamped = st->clamped;
	o->cut = cut;
	st->phase = PH_DONE;
}

/* kvt_topp_mark's clamp: finish here, or go on to find the want-th largest. */
static __device__ void finish_topp(seg_state *st, kvt_gpu_topp *o, float thresh, uint32_t count,
				   uint32_t n, uint32_t bmin, uint32_t bmax)
{
	uint32_t want = count;
	int clamped = 0;
	if (bmax && want > bmax) {
		want = bmax;
		clamped = -1;
	} else if (want < bmin) {
		want = bmin < n ? bmin : n;
		clamped = want > count ? 1 : 0;
	}
	st->thresh = thresh;
	st->count = count;
	st->marked = want;
	st->clamped = clamped;
	if (!clamped) {
		finalize(st, o, (unsigned long long)fkey(thresh) << 32);
		return;
	}
	st->want = want;
	st->above = 0;
	st->prefix = 0;
	st->phase = PH_C0;
}

static __device__ void select_nothing(seg_state *st, kvt_gpu_topp *o)
{
	st->thresh = 0.0f;
	st->count = st->marked = 0;
	st->clamped = 0;
	finalize(st, o, ~0ull);
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

/*
 * A 64-bit add into two 32-bit shared words, exact once all adds are done: the low word's carry
 * is read back from its atomic. Shared-memory 64-bit atomics compile to compare-and-swap loops,
 * which stall badly when many lanes hit the same bin.
 */
static __device__ __forceinline__ void smem_add64(uint32_t *w, unsigned long long x)
{
	const uint32_t lo = (uint32_t)x, old = atomicAdd(&w[0], lo);
	const uint32_t hi = (uint32_t)(x >> 32) + (old + lo < old ? 1u : 0u);
	if (hi)
		atomicAdd(&w[1], hi);
}

/* ---- pass 1: max, min, finiteness -------------------------------------------------------- */

static __global__ void __launch_bounds__(SEL_THREADS)
	k_stats(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t max_n, uint32_t hq,
		float p, uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out,
		unsigned long long *err)
{
	__shared__ uint32_t red[3][SEL_THREADS / 32];
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x;
	seg_state *st = sc.st + seg;
	const uint32_t n = n_tok[seq], nn = n > max_n ? 0 : n;
	const float *s = scores + (size_t)seg * ld;

	/* the histograms start at zero; each level's last block leaves them at zero again */
	for (uint32_t e = blockIdx.x * SEL_THREADS + tid; e < SEL_CNT_BINS;
	     e += gridDim.x * SEL_THREADS) {
		sc.hcnt[(size_t)seg * SEL_CNT_BINS + e] = 0;
		if (e < SEL_MASS_BINS)
			sc.hhi[(size_t)seg * SEL_MASS_BINS + e] =
				sc.hlo[(size_t)seg * SEL_MASS_BINS + e] = 0;
	}
	uint32_t kmax = 0, nmin = 0, bad = 0;
	const uint32_t c0 = blockIdx.x * SEL_CHUNK;
	float4 v[SEL_VEC];
	load_chunk(v, s, c0, nn);
#pragma unroll
	for (int k = 0; k < SEL_VEC; k++) {
		const uint32_t i = c0 + 4 * (tid + k * SEL_THREADS);
		const float f[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
		for (int e = 0; e < 4; e++) {
			if (i + e >= nn)
				break;
			if (!isfinite(f[e])) {
				bad = max(bad, 0xffffffffu - (i + e));
				continue;
			}
			const uint32_t key = fkey(f[e]);
			kmax = max(kmax, key);
			nmin = max(nmin, ~key);
		}
	}
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
	if (n > max_n) {
		kvt_d_raise(err, KVT_GPU_ERR_RANGE, seg, n);
		select_nothing(st, o);
	} else if (n == 0) {
		select_nothing(st, o);
	} else if (__ldcg(&st->bad)) {
		kvt_d_raise(err, KVT_GPU_ERR_NONFINITE, seg, 0xffffffffu - __ldcg(&st->bad));
		select_nothing(st, o);
	} else if (p >= 1.0f) {
		finish_topp(st, o, keyf(~__ldcg(&st->nmin_key)), n, n, bmin, bmax);
	} else {
		const float lo = keyf(~__ldcg(&st->nmin_key)), hi = keyf(__ldcg(&st->max_key));
		const float inv = __fdiv_rn((float)SEL_M0_BINS, __fsub_rn(hi, lo));
		st->smin = lo;
		st->inv_w = hi > lo && isfinite(inv) ? inv : 0.0f; /* 0: one bin */
		st->prefix = 0;
		st->acc_lo = st->acc_hi = 0;
		st->above = 0;
		st->phase = PH_M0;
	}
}

/* ---- the radix levels -------------------------------------------------------------------- */

static constexpr int digit_shift(bool linear, bool pos, int r)
{
	if (linear)
		return 0;
	if (pos)
		return r == 0 ? 12 : 0;
	return r == 0 ? 21 : r == 1 ? 10 : 0;
}

template <int PH>
struct level {
	static constexpr bool mass = PH <= PH_M3, pos = PH >= PH_P0, linear = PH == PH_M0;
	/* radix level: score keys by bits 21..31, 10..20, 0..9; position keys (24 bits) 12..23, 0..11 */
	static constexpr int r = mass ? PH - PH_M1 : pos ? PH - PH_P0 : PH - PH_C0;
	static constexpr int width = linear ? 8 : pos ? 12 : r == 2 ? 10 : 11;
	static constexpr int shift = digit_shift(linear, pos, r);
	static constexpr int top = linear ? 32 : shift + width; /* bits above the digit are fixed */
	static constexpr uint32_t bins = 1u << width;
	static constexpr bool last = pos ? r == 1 : r == 2;
	static_assert(!linear || bins == SEL_M0_BINS, "the first level's bins are the intervals");
	static_assert(bins >= SEL_THREADS, "the decision gives each thread at least one bin");
};

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

template <int PH>
static __global__ void __launch_bounds__(SEL_THREADS)
	k_level(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq, float scale,
		float p, uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out)
{
	typedef level<PH> L;
	__shared__ uint32_t hc[L::bins];
	__shared__ uint32_t hh[L::mass ? L::bins : 1][2], hl[L::mass ? L::bins : 1][2];
	__shared__ uint32_t win, low, win_above, win_cnt;
	__shared__ u128 win_mass;
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x;
	seg_state *st = sc.st + seg;
	if (__ldcg(&st->phase) != PH)
		return;
	const uint32_t n = n_tok[seq], prefix = __ldcg(&st->prefix), pprefix = __ldcg(&st->pprefix);
	const float mx = keyf(__ldcg(&st->max_key)), smin = __ldcg(&st->smin),
		    inv_w = __ldcg(&st->inv_w);
	const uint32_t b0 = __ldcg(&st->b0);
	const float *s = scores + (size_t)seg * ld;
	for (uint32_t b = tid; b < L::bins; b += SEL_THREADS) {
		hc[b] = 0;
		if (L::mass)
			hh[b][0] = hh[b][1] = hl[b][0] = hl[b][1] = 0;
	}
	const uint32_t c0 = blockIdx.x * SEL_CHUNK;
	float4 v[SEL_VEC];
	load_chunk(v, s, c0, n);
	__syncthreads();

#pragma unroll
	for (int kk = 0; kk < SEL_VEC; kk++) {
		const uint32_t i = c0 + 4 * (tid + kk * SEL_THREADS);
		const float f[4] = {v[kk].x, v[kk].y, v[kk].z, v[kk].w};
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const uint32_t pos = i + e, k = fkey(f[e]);
			if (pos >= n)
				break;
			uint32_t digit;
			if (L::pos) {
				const uint32_t pk = (SEL_MAX_N - 1) - pos;
				if (k != prefix ||
				    (pk >> (L::top & 31)) != (pprefix >> (L::top & 31)))
					continue;
				digit = (pk >> L::shift) & (L::bins - 1);
			} else if (L::linear) {
				digit = lbin(f[e], smin, inv_w);
			} else {
				if (L::mass && lbin(f[e], smin, inv_w) != b0)
					continue;
				if (L::top < 32 &&
				    (k >> (L::top & 31)) != (prefix >> (L::top & 31)))
					continue;
				digit = (k >> L::shift) & (L::bins - 1);
			}
			atomicAdd(&hc[digit], 1u);
			if (L::mass) {
				unsigned long long th, tl;
				term(f[e], mx, scale, &th, &tl);
				if (th)
					smem_add64(hh[digit], th);
				if (tl)
					smem_add64(hl[digit], tl);
			}
		}
	}
	__syncthreads();
	for (uint32_t b = tid; b < L::bins; b += SEL_THREADS) {
		if (!hc[b])
			continue;
		atomicAdd(&sc.hcnt[(size_t)seg * SEL_CNT_BINS + b], hc[b]);
		if (L::mass) {
			const unsigned long long xh = (unsigned long long)hh[b][1] << 32 | hh[b][0];
			const unsigned long long xl = (unsigned long long)hl[b][1] << 32 | hl[b][0];
			if (xh)
				atomicAdd(&sc.hhi[(size_t)seg * SEL_MASS_BINS + b], xh);
			if (xl)
				atomicAdd(&sc.hlo[(size_t)seg * SEL_MASS_BINS + b], xl);
		}
	}
	if (!last_block(st))
		return;

	/* The decision. Thread i owns bins top - i * per .. top - (i + 1) * per + 1, descending. */
	constexpr uint32_t per = L::bins / SEL_THREADS;
	uint32_t *gc = sc.hcnt + (size_t)seg * SEL_CNT_BINS;
	unsigned long long *gh = sc.hhi + (size_t)seg * SEL_MASS_BINS,
			   *gl = sc.hlo + (size_t)seg * SEL_MASS_BINS;
	uint32_t bc[per];
	u128 bm[per];
	uint32_t c = 0;
	u128 m = 0;
#pragma unroll
	for (uint32_t k = 0; k < per; k++) {
		const uint32_t b = L::bins - 1 - (tid * per + k);
		bc[k] = __ldcg(gc + b);
		bm[k] = L::mass ? mk128(__ldcg(gh + b), __ldcg(gl + b)) : 0;
		c += bc[k];
		m += bm[k];
	}
	if (tid == 0) {
		win = 0xffffffffu;
		low = 0xffffffffu;
	}
	uint32_t tc;
	u128 tm;
	scan_excl(c, m, &tc, &tm); /* also a barrier for win and low */
	const uint32_t want = __ldcg(&st->want);
	double target = 0.0;
	if (L::mass) {
		if (L::linear && tid == 0)
			st->target = (double)p * mass_d(tm);
		target = L::linear ? (double)p * mass_d(tm) : __ldcg(&st->target);
	}
	const u128 acc0 = (u128)__ldcg(&st->acc_hi) << 64 | __ldcg(&st->acc_lo);
	uint32_t above = __ldcg(&st->above) + c;
	u128 am = acc0 + m;
#pragma unroll
	for (uint32_t k = 0; k < per; k++) {
		const uint32_t b = L::bins - 1 - (tid * per + k);
		bool hit;
		if (L::mass)
			hit = bc[k] && mass_d(am) < target && target <= mass_d(am + bm[k]);
		else
			hit = bc[k] && above < want && want <= above + bc[k];
		if (hit) {
			win = b;
			win_above = above;
			win_cnt = bc[k];
			win_mass = am;
		}
		if (bc[k])
			atomicMin(&low, b);
		above += bc[k];
		am += bm[k];
	}
	__syncthreads();
	if (win == 0xffffffffu) {
		/* only when rounding left p * Z above the total: the CPU then takes the smallest value */
		above = __ldcg(&st->above) + c;
		am = acc0 + m;
		for (uint32_t k = 0; k < per; k++) {
			const uint32_t b = L::bins - 1 - (tid * per + k);
			if (b == low) {
				win = b;
				win_above = above;
				win_cnt = bc[k];
				win_mass = am;
			}
			above += bc[k];
			am += bm[k];
		}
		__syncthreads();
	}
	/* leave the histogram zeroed for the next level */
	for (uint32_t b = tid; b < L::bins; b += SEL_THREADS) {
		gc[b] = 0;
		if (L::mass)
			gh[b] = gl[b] = 0;
	}
	if (tid != 0)
		return;
	st->done = 0;
	kvt_gpu_topp *o = out + seg;
	const uint32_t b = win;
	if (L::pos) {
		const uint32_t pp = pprefix | (b << L::shift);
		st->pprefix = pp;
		st->above = win_above;
		if (L::last)
			finalize(st, o,
				 (unsigned long long)prefix << 32 |
					 (0xffffffffu - ((SEL_MAX_N - 1) - pp)));
		else
			st->phase = PH + 1;
		return;
	}
	if (L::linear)
		st->b0 = b;
	const uint32_t key = L::linear ? 0 : prefix | (b << L::shift);
	st->prefix = key;
	st->above = win_above;
	if (L::mass) {
		st->acc_hi = (unsigned long long)(win_mass >> 64);
		st->acc_lo = (unsigned long long)win_mass;
	}
	if (!L::last) {
		st->phase = PH + 1;
	} else if (L::mass) {
		finish_topp(st, o, keyf(key), win_above + win_cnt, n, bmin, bmax);
	} else if (win_above + win_cnt == want) {
		finalize(st, o, (unsigned long long)key << 32); /* the ties fit whole */
	} else {
		st->want = want - win_above; /* the lowest positions among the ties */
		st->above = 0;
		st->pprefix = 0;
		st->phase = PH_P0;
	}
}

/* ---- union over the query group and compaction ------------------------------------------- */

#define UN_WARP_TOKENS 1024u /* 32 words of 32 tokens */

static __global__ void __launch_bounds__(SEL_THREADS)
	k_union_mark(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq,
		     uint32_t hkv, const kvt_gpu_topp *topp, sel_scratch sc, uint32_t mwords)
{
	__shared__ unsigned long long cut[KVT_GPU_MAX_GROUP];
	__shared__ uint32_t cnt[SEL_THREADS / 32];
	const uint32_t item = blockIdx.y, seq = item / hkv, h = item % hkv, G = hq / hkv;
	const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n = n_tok[seq];
	const size_t seg0 = (size_t)seq * hq + (size_t)h * G;
	for (uint32_t g = tid; g < G; g += SEL_THREADS) {
		const kvt_gpu_topp o = topp[seg0 + g];
		cut[g] = o.marked ? o.cut : ~0ull; /* ~0: nothing marked (no real cut has it) */
	}
	__syncthreads();
	const uint32_t t0 = blockIdx.x * SEL_CHUNK + warp * UN_WARP_TOKENS;
	/* bit k of sel: token t0 + 32 k + lane; each head's 32 loads are issued together */
	uint32_t sel = 0;
	for (uint32_t g = 0; g < G; g++) {
		if (cut[g] == ~0ull)
			continue;
		const float *row = scores + (seg0 + g) * ld;
		float x[32];
#pragma unroll
		for (int k = 0; k < 32; k++) {
			const uint32_t t = t0 + 32 * k + lane;
			x[k] = t < n ? row[t] : 0.0f;
		}
#pragma unroll
		for (int k = 0; k < 32; k++) {
			const uint32_t t = t0 + 32 * k + lane;
			const unsigned long long ck =
				(unsigned long long)fkey(x[k]) << 32 | (0xffffffffu - t);
			sel |= (t < n && ck >= cut[g] ? 1u : 0u) << k;
		}
	}
	uint32_t mine = 0;
#pragma unroll
	for (int k = 0; k < 32; k++) {
		const uint32_t w = __ballot_sync(0xffffffffu, (sel >> k) & 1u);
		if (lane == (uint32_t)k)
			mine = w;
	}
	const uint32_t wi = t0 / 32 + lane;
	if (wi < mwords)
		sc.mask[(size_t)item * mwords + wi] = mine;
	uint32_t c = __popc(mine);
	for (int o = 16; o; o >>= 1)
		c += __shfl_xor_sync(0xffffffffu, c, o);
	if (lane == 0)
		cnt[warp] = c;
	__syncthreads();
	if (tid == 0) {
		uint32_t total = 0;
		for (int w = 0; w < SEL_THREADS / 32; w++)
			total += cnt[w];
		sc.ccount[(size_t)item * gridDim.x + blockIdx.x] = total;
	}
}

static __global__ void __launch_bounds__(SEL_THREADS)
	k_union_write(const uint32_t *n_tok, uint32_t hkv, sel_scratch sc, uint32_t mwords,
		      uint32_t *sel, size_t sel_ld, uint32_t *sel_n)
{
	__shared__ uint32_t wsum[SEL_THREADS / 32];
	__shared__ uint32_t before;
	const uint32_t item = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
	(void)n_tok;
	(void)hkv;
	/* selected tokens of the earlier chunks */
	uint32_t b = 0;
	for (uint32_t c = tid; c < blockIdx.x; c += SEL_THREADS)
		b += sc.ccount[(size_t)item * gridDim.x + c];
	for (int o = 16; o; o >>= 1)
		b += __shfl_xor_sync(0xffffffffu, b, o);
	if (lane == 0)
		wsum[warp] = b;
	__syncthreads();
	if (tid == 0) {
		uint32_t t = 0;
		for (int w = 0; w < SEL_THREADS / 32; w++)
			t += wsum[w];
		before = t;
	}
	__syncthreads();
	const uint32_t wi = blockIdx.x * (SEL_CHUNK / 32) + tid;
	const uint32_t word = wi < mwords ? sc.mask[(size_t)item * mwords + wi] : 0u;
	uint32_t c = __popc(word), inc = c;
	for (int o = 1; o < 32; o <<= 1) {
		const uint32_t v = __shfl_up_sync(0xffffffffu, inc, o);
		if (lane >= (uint32_t)o)
			inc += v;
	}
	if (lane == 31)
		wsum[warp] = inc;
	__syncthreads();
	uint32_t off = before + inc - c;
	for (uint32_t w = 0; w < warp; w++)
		off += wsum[w];
	uint32_t *dst = sel + (size_t)item * sel_ld;
	for (uint32_t bits = word; bits; bits &= bits - 1)
		dst[off++] = wi * 32 + (uint32_t)__ffs(bits) - 1;
	if (blockIdx.x == gridDim.x - 1 && tid == SEL_THREADS - 1)
		sel_n[item] = off;
}

/* ---- launchers --------------------------------------------------------------------------- */

extern "C" size_t kvt_gpu_select_scratch_bytes(uint32_t n_seqs, uint32_t n_q_heads,
					       uint32_t n_kv_heads, uint32_t max_n)
{
	return carve(NULL, n_seqs, n_q_heads, n_kv_heads, max_n).bytes;
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
	if (ld % 4 || max_n > ld || max_n > SEL_MAX_N || !aligned16(scores) || !aligned16(scratch))
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
	const dim3 grid(max_n ? (max_n + SEL_CHUNK - 1) / SEL_CHUNK : 1, segs);
	k_stats<<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, max_n, n_q_heads, p, bmin, bmax,
					     sc, out, err);
	KVT_CU_LAUNCHED();
#define LEVEL(ph)                                                                                  \
	do {                                                                                       \
		k_level<ph><<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, n_q_heads, scale,   \
							 p, bmin, bmax, sc, out);                  \
		KVT_CU_LAUNCHED();                                                                 \
	} while (0)
	LEVEL(PH_M0);
	LEVEL(PH_M1);
	LEVEL(PH_M2);
	LEVEL(PH_M3);
	if (bmin || bmax) {
		LEVEL(PH_C0);
		LEVEL(PH_C1);
		LEVEL(PH_C2);
		LEVEL(PH_P0);
		LEVEL(PH_P1);
	}
#undef LEVEL
	return 0;
}

extern "C" int kvt_gpu_topp_union(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				  const float *scores, size_t ld, const uint32_t *n_tokens,
				  uint32_t max_n, const kvt_gpu_topp *topp, uint32_t *sel,
				  size_t sel_ld, uint32_t *sel_n, void *scratch,
				  size_t scratch_bytes, void *stream)
{
	if (!scores || !n_tokens || !topp || !sel || !sel_n || !scratch || n_kv_heads == 0 ||
	    n_q_heads % n_kv_heads || n_q_heads / n_kv_heads > KVT_GPU_MAX_GROUP)
		return -EINVAL;
	if (ld % 4 || max_n > ld || max_n > SEL_MAX_N || sel_ld < max_n || !aligned16(scratch))
		return -EINVAL;
	if ((uint64_t)n_seqs * n_q_heads > 65535)
		return -EINVAL;
	const sel_scratch sc = carve(scratch, n_seqs, n_q_heads, n_kv_heads, max_n);
	if (scratch_bytes < sc.bytes)
		return -EINVAL;
	if (n_seqs == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	const uint32_t mwords = (max_n + 31) / 32;
	const dim3 grid(max_n ? (max_n + SEL_CHUNK - 1) / SEL_CHUNK : 1, n_seqs * n_kv_heads);
	k_union_mark<<<grid, SEL_THREADS, 0, s>>>(scores, ld, n_tokens, n_q_heads, n_kv_heads, topp,
						  sc, mwords);
	KVT_CU_LAUNCHED();
	k_union_write<<<grid, SEL_THREADS, 0, s>>>(n_tokens, n_kv_heads, sc, mwords, sel, sel_ld,
						   sel_n);
	KVT_CU_LAUNCHED();
	return 0;
}
