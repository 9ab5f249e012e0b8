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
 * Files: select_common.cuh (what the passes share), this file (passes 1 and 2, the launcher),
 * select_resolve.cu (pass 3).
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
#include "select_common.cuh"

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
	KVT_CU(kvt_sel_launch_cand(grid, s, scores, ld, n_tokens, n_q_heads, scale, p, bmin, bmax,
				   sc, out));
	return 0;
}
