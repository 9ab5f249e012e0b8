/* SPDX-License-Identifier: MIT */
/*
 * Top-p selection without sorting, in three passes (two after a scan that gathered the
 * statistics) after a kernel that zeroes the scratch's state, over all (sequence, query head)
 * segments,
 * each segment split into chunks of SEL_CHUNK scores, one block per chunk (or several chunks per
 * block, so that all segments together take about four blocks per multiprocessor):
 *
 *   1. k_stats: max, min, finiteness; skipped when the scan gathered them (kvt_gpu_score's stats),
 *      so that on a decode step the scores are read twice, not three times.
 *   2. k_hist: every block derives the segment's start from the statistics (the trivial cases end
 *      there), then a histogram of count and probability mass over SEL_BINS bins of equal width in
 *      (max - s) * scale (a log-mass scale: bin 0 holds the largest scores), spanning the scores'
 *      range or the top SEL_SPAN_NATS nats, whatever is less. Its last block picks the bin holding
 *      the Top-p boundary, and the bins holding the bmin-th and bmax-th largest (the clamp).
 *      Given the scan's ring (kvt_gpu_score's bins), a pass before it (k_ring, one block a
 *      segment) decides the segments the ring serves from it (hist_from_ring; doc/selection.md
 *      has when), whose blocks here then leave without streaming; this pass's grid is then wider
 *      (SEL_RING_MIN_BLOCKS), so that the segments it declines stream on more of the device.
 *   3. k_cand: the scores of those (at most three) bins are appended to the segment's candidate
 *      list; the last block resolves the threshold, and the clamp, in shared memory: the
 *      candidates sorted by rank up to SEL_RANK of them, or past that a radix select (three
 *      levels on the score's key, two more on positions among ties). When the bins hold more
 *      than SEL_CAND candidates, it runs the same select over the whole segment instead:
 *      slower, the same result. For kvt_gpu_topp_select it also marks the union of each query
 *      group's sets (select.cuh's bits): the tokens of the bins before the final cut's (fbin,
 *      which pass 2 derives) as it lists the candidates, then the candidates the resolved cut
 *      marks, so that no later pass reads the scores again.
 *
 * In every pass blocks build shared-memory histograms and add their nonzero bins into the
 * segment's with integer atomics; the last block of a segment to finish (a counter in the
 * segment's state) reads them and decides. Integer sums make the result independent of block
 * order, so a run is reproducible.
 *
 * Files: select_common.cuh (what the passes share), this file (passes 1 and 2, the launcher),
 * select_resolve.cu (pass 3).
 *
 * The mass. The CPU's term of a score s is exp((double)(s - max) * scale), summed in double. Here
 * the term is computed in float (term(): the product split exactly by an FMA, expf, one rounding;
 * relative error below 2^-21) and truncated to a multiple of 2^-40 (each term loses under 2^-40),
 * and the truncated terms are summed exactly as integers: n < 2^24 terms of at most 2^40 units fit
 * 64 bits. Counts and ranks are exact. So the mass M~(S) of any set of tokens is within
 * E = 2^-21 M(S) + |S| 2^-40 of its exact value M(S), the total Z~ within 2^-21 Z + n 2^-40 of Z.
 * A bin is chosen where f(mass above) < target <= f(mass above + bin), f the monotone conversion
 * to double and target = p * f(total); refining a bin re-partitions exactly the same integers, so
 * the last level yields the set {tokens t: M~(scores > s_t) < p Z~}. The exact set is {t:
 * M(scores > s_t) < p Z}; a token in one and not the other has |M(> s_t) - p Z| <= 2 E plus the
 * double roundings, below tol = 2^-19 Z + n 2^-38 (the bound doc/selection.md states and
 * test_gpu_kernels asserts, against sums in long double), and the set covers at least p Z - tol.
 * The double exp and the 128-bit sums of 2^-80 units this replaced made the set equal to the
 * CPU's but cost half of the threshold's time.
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
	/* the list: max_n / 8 candidates, within [SEL_CAND_MIN, SEL_CAND] and at most max_n, so
	 * that it stays at most half the scores' bytes past 16K tokens */
	uint32_t cap = max_n / 8;
	cap = cap < SEL_CAND_MIN ? SEL_CAND_MIN : cap > SEL_CAND ? SEL_CAND : cap;
	s.cand_cap = cap < max_n ? cap : max_n;
	s.st = (seg_state *)(p + off);
	off += align256(segs * sizeof(seg_state));
	s.hcnt = (uint32_t *)(p + off);
	off += align256(segs * SEL_BINS * sizeof(uint32_t));
	s.hhi = (unsigned long long *)(p + off);
	off += align256(segs * SEL_BINS * 8);
	s.zero_bytes = off; /* the state and the histograms: zeroed by k_zero in every call */
	s.stats = (kvt_gpu_segstats *)(p + off);
	off += align256(segs * sizeof(kvt_gpu_segstats));
	s.zero_all = off; /* and the statistics, when the threshold gathers them itself */
	s.cand = (u64 *)(p + off);
	off += align256(segs * s.cand_cap * 8);
	s.bytes = off;
	return s;
}


/* ---- the scratch's zeroing ---------------------------------------------------------------- */

/* Zeroes n16 16-byte words. When the caller gave the statistics, the next kernel is pass 2, a
 * programmatic dependent: it may start at once, and waits for this one only before its first
 * global atomic. */
static __global__ void __launch_bounds__(SEL_THREADS)
	k_zero(uint4 *p, size_t n16, uint32_t *mask, size_t mask_words)
{
	KVT_PDL_TRIGGER();
	const size_t i0 = (size_t)blockIdx.x * SEL_THREADS + threadIdx.x,
		     step = (size_t)gridDim.x * SEL_THREADS;
	for (size_t i = i0; i < n16; i += step)
		p[i] = make_uint4(0, 0, 0, 0);
	for (size_t i = i0; i < mask_words; i += step) /* the union's bits, which pass 3 ORs into */
		mask[i] = 0;
}

/* ---- pass 1: max, min, finiteness (when the scan did not gather them) ------------------ */

/* KEEP: of the keys (kvt_gpu_keep), the largest of which the masses are reckoned from. */
template <bool KEEP>
static __global__ void __launch_bounds__(SEL_THREADS)
	k_stats(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t max_n, uint32_t hq,
		kvt_gpu_segstats *stats, kvt_gpu_keep keep, uint32_t group)
{
	const uint32_t seg = blockIdx.y, seq = seg / hq;
	const uint32_t n = n_tok[seq], nn = n > max_n ? 0 : n;
	const keep_row kr = keep_of(keep, seg, group);
	uint32_t kmax = 0, nmin = 0, bad = 0;
	each_of_block(scores + (size_t)seg * ld, nn, [&](uint32_t i, float f) {
		if (i < nn)
			kvt_d_stat(KEEP ? keep_key(kr, i, f) : f, i, &kmax, &nmin, &bad);
	});
	kvt_d_stat_flush(kmax, nmin, bad, 1, stats + seg);
}

/* Whether a segment is trivial: no token, a count out of range, a non-finite score (bad), or
 * p >= 1 unclamped (seg_begin finalizes it). */
static __device__ bool seg_trivial(uint32_t n, uint32_t max_n, uint32_t bad, float p,
				   uint32_t bmin, uint32_t bmax)
{
	int clamped = 0;
	if (p >= 1.0f && n <= max_n)
		clamp_want(n, n, bmin, bmax, &clamped); /* everything, unless bmax cuts it */
	return n > max_n || n == 0 || bad || (p >= 1.0f && !clamped);
}

/*
 * A segment's start, as every block of pass 2 sees it (each computes the same from the same
 * statistics): the trivial cases (no token, a non-finite score, a count out of range, p >= 1
 * unclamped) are finalized by block 0 and return false; otherwise *inv_w gets the bins' scale:
 * bins over [max - span, max], span the range or SEL_SPAN_NATS / scale, the lesser (0: one bin).
 */
static __device__ bool seg_begin(const kvt_gpu_segstats *gs, uint32_t seg, uint32_t n,
				 uint32_t max_n, float scale, float p, uint32_t bmin, uint32_t bmax,
				 kvt_gpu_topp *o, unsigned long long *err, float *inv_w)
{
	const uint32_t kmax = __ldcg(&gs->max_key), nmin = __ldcg(&gs->nmin_key),
		       bad = __ldcg(&gs->bad);
	const bool first = blockIdx.x == 0 && threadIdx.x == 0;
	const float lo = kvt_d_keyf(~nmin), hi = kvt_d_keyf(kmax);
	if (seg_trivial(n, max_n, bad, p, bmin, bmax)) {
		if (!first)
			return false;
		if (n > max_n)
			kvt_d_range(err, KVT_GPU_SITE_SELECT_N, seg, n);
		else if (n && bad)
			kvt_d_raise(err, KVT_GPU_ERR_NONFINITE, seg, 0xffffffffu - bad);
		const bool all = n && n <= max_n && !bad;
		o->thresh = all ? lo : 0.0f;
		o->count = o->marked = all ? n : 0;
		o->clamped = 0;
		o->cut = all ? (unsigned long long)kvt_d_fkey(lo) << 32 : ~0ull;
		return false;
	}
	const float span = fminf(__fsub_rn(hi, lo), __fdiv_rn(SEL_SPAN_NATS, scale));
	const float inv = __fdiv_rn((float)SEL_BINS, span);
	*inv_w = span > 0.0f && isfinite(inv) ? inv : 0.0f;
	return true;
}

/* ---- pass 2: the log-mass histogram and its boundary bins -------------------------------- */

/* A segment's decisions from its histogram, as thread 0 writes them into its state. */
struct hist_decision {
	uint32_t bin[NEEDS], above[NEEDS], total, fbin;
	u64 acc;
	double target;
};

/*
 * The decisions from a segment's histogram, each thread holding its SEL_BINS / SEL_THREADS
 * consecutive bins in registers (the decisions walk them without touching shared memory): the
 * boundary bins of each need, and the candidates they hold (returned to every thread). Thread 0's
 * *d holds what decision_write writes.
 */
static __device__ __forceinline__ uint32_t decide_hist(const uint32_t (&rc)[8], const u64 (&rm)[8],
						       uint32_t n, float p, uint32_t bmin,
						       uint32_t bmax, hist_decision *d)
{
	__shared__ uint32_t total_s;
	const bool mass = p < 1.0f;
	auto get = [&](uint32_t, uint32_t k, uint32_t *c, u64 *m) {
		*c = rc[k];
		*m = rm[k];
	};
	uint32_t cnt[NEEDS] = {0, 0, 0};
	for (int k = 0; k < NEEDS; k++) {
		d->bin[k] = SEL_NONE;
		d->above[k] = 0;
	}
	d->acc = 0;
	d->target = 0.0;
	if (mass) {
		const pick w = decide<SEL_BINS, true>(get, 0, 0, -1.0, p, 0);
		d->bin[NEED_MASS] = w.j;
		d->above[NEED_MASS] = w.above;
		cnt[NEED_MASS] = w.cnt;
		d->acc = w.acc;
		d->target = (double)p * mass_d(w.total);
	}
	/* the clamp's boundary, should the Top-p count fall outside [bmin, bmax] */
	const uint32_t rank[NEEDS] = {0, bmin < n ? bmin : n, bmax < n ? bmax : 0};
	for (int k = NEED_MIN; k < NEEDS; k++) {
		if (!rank[k])
			continue;
		const pick w = decide<SEL_BINS, false>(get, 0, 0, 0.0, p, rank[k]);
		d->bin[k] = w.j;
		d->above[k] = w.above;
		cnt[k] = w.cnt;
	}
	if (threadIdx.x == 0) {
		uint32_t total = 0;
		for (int k = 0; k < NEEDS; k++) {
			bool again = false;
			for (int e = 0; e < k; e++)
				again |= d->bin[e] == d->bin[k];
			total += d->bin[k] != SEL_NONE && !again ? cnt[k] : 0;
		}
		d->total = total;
		/* the bin of the final cut: the Top-p boundary's, unless the counts above it already
		 * show the clamp applies (bmin's rank in a later bin: raised; bmax's in an earlier one:
		 * cut, which clamp_want checks last), then the clamp's rank's bin. The union marks
		 * every token of an earlier bin without waiting for the resolution (k_cand) */
		uint32_t f = d->bin[NEED_MAX];
		if (mass) {
			f = d->bin[NEED_MASS];
			if (d->bin[NEED_MIN] != SEL_NONE && d->bin[NEED_MIN] > f)
				f = d->bin[NEED_MIN];
			if (d->bin[NEED_MAX] != SEL_NONE && d->bin[NEED_MAX] < f)
				f = d->bin[NEED_MAX];
		}
		d->fbin = f == SEL_NONE ? 0 : f; /* none cannot happen here; 0 leaves all to the cut */
		total_s = total;
	}
	__syncthreads();
	return total_s;
}

/* Thread 0: the decisions into the segment's state, for pass 3. */
static __device__ __forceinline__ void decision_write(seg_state *st, const hist_decision &d,
						      uint32_t cand_cap)
{
	for (int k = 0; k < NEEDS; k++) {
		st->bin[k] = d.bin[k];
		st->above[k] = d.above[k];
	}
	st->acc = d.acc;
	st->target = d.target;
	st->listed = d.total <= cand_cap;
	st->fbin = d.fbin;
	st->ncand = 0;
	st->done = 0;
	st->phase = PH_CAND;
}

/*
 * The histogram's last block: the segment's histogram read as whole 16-byte words, then the
 * decisions. Out of line, so that its registers do not weigh on the streaming pass before it.
 */
static __device__ __noinline__ void hist_decide(seg_state *st, const uint32_t *gc,
						const unsigned long long *gh, uint32_t n, float p,
						uint32_t bmin, uint32_t bmax, uint32_t cand_cap)
{
	constexpr uint32_t per = SEL_BINS / SEL_THREADS;
	static_assert(per == 8, "two uint4 of counts and four pairs of masses per thread");
	const uint32_t tid = threadIdx.x;
	const uint4 *c4 = (const uint4 *)(gc + tid * per); /* 16-byte aligned: carve */
	const ulonglong2 *m2 = (const ulonglong2 *)(gh + tid * per);
	const uint4 ca = __ldcg(c4), cb = __ldcg(c4 + 1);
	const uint32_t rc[per] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
	u64 rm[per] = {0, 0, 0, 0, 0, 0, 0, 0};
	if (p < 1.0f) {
#pragma unroll
		for (uint32_t q = 0; q < per / 2; q++) {
			const ulonglong2 v = __ldcg(m2 + q);
			rm[2 * q] = v.x;
			rm[2 * q + 1] = v.y;
		}
	}
	SEL_T(6);
	hist_decision d;
	decide_hist(rc, rm, n, p, bmin, bmax, &d);
	if (tid == 0)
		decision_write(st, d, cand_cap);
}

/*
 * The histogram from the scan's ring (scanring.h), for a segment whose scores span less than its
 * KVT_BINS slots (64 nats at 1/32 nat): k_ring's one block of the segment converts the slots from
 * the max's bin on into bins 0 to SEL_BINS - 1 (counts, and masses in 2^-40 units of
 * e^(max scale)) and decides. The ring serves when the boundary bins hold at most ring.serve_max
 * candidates (by default SEL_RANK, so that the resolution ranks them, its cheapest way; flat
 * scores fill its bins of 1/32 nat: 3.7K at the cut of 128K normal scores, whose radix resolution
 * costs more than streaming them in the pass's own, finer bins; doc/selection.md): its thread 0
 * then writes the decisions once the scratch is zeroed, and true is returned; otherwise the segment
 * takes pass 2's own bins. Pass 3 clears the slots (ring_clear).
 */
static __device__ __noinline__ bool hist_from_ring(kvt_gpu_bins ring, uint32_t seg,
						   seg_state *st, uint32_t max_key,
						   uint32_t nmin_key, float scale, uint32_t n, float p,
						   uint32_t bmin, uint32_t bmax, uint32_t cand_cap)
{
	static_assert(SEL_BINS == KVT_BINS && SEL_BINS / SEL_THREADS == 8, "a slot a bin");
	const float mx = kvt_d_keyf(max_key);
	const int32_t bm = kvt_bins_bin(mx, scale);
	const double f = kvt_bins_exp_small(kvt_bins_offset(mx, scale, bm));
	const uint32_t *rcnt = ring.count + (size_t)seg * KVT_BINS;
	const unsigned long long *rd = ring.dsum + (size_t)seg * KVT_BINS;
	uint32_t rc[8];
	u64 rm[8];
#pragma unroll
	for (uint32_t q = 0; q < 8; q++) {
		const uint32_t j = threadIdx.x * 8 + q;
		const uint32_t slot = (uint32_t)(bm + (int32_t)j) & (KVT_BINS - 1);
		const uint32_t k = __ldcg(rcnt + slot);
		rc[q] = k;
		rm[q] = k && p < 1.0f ? kvt_bins_mass(k, __ldcg(rd + slot), kvt_bins_power(j), f) : 0;
	}
	hist_decision d;
	const uint32_t limit = ring.serve_max ? ring.serve_max : KVT_BINS_SERVE_DEFAULT;
	if (decide_hist(rc, rm, n, p, bmin, bmax, &d) > limit)
		return false;
	KVT_PDL_WAIT(); /* the state is zeroed */
	if (threadIdx.x == 0) {
		st->max_key = max_key;
		st->nmin_key = nmin_key;
		st->inv_w = -scale; /* k_cand's lbin: the ring's bins */
		decision_write(st, d, cand_cap);
		if (ring.served)
			atomicAdd(ring.served, 1ull);
	}
	return true;
}

/*
 * The ring's pass (with the scan's ring only, between the zeroing and pass 2): one block a
 * segment (blockIdx.y) decides from the ring whether it serves the segment, and if so writes the
 * decisions into the state (hist_from_ring), where pass 2's blocks find them (phase PH_CAND) and
 * leave. Trivial segments, and those the ring cannot hold, are left to pass 2. Deciding once per
 * segment, not in every block of pass 2, is what lets pass 2's grid be wider with the ring
 * (SEL_RING_MIN_BLOCKS), so that the segments the ring declines stream on more of the device.
 */
static __global__ void __launch_bounds__(SEL_THREADS)
	k_ring(const uint32_t *n_tok, uint32_t max_n, uint32_t hq, float scale, float p,
	       uint32_t bmin, uint32_t bmax, const kvt_gpu_segstats *stats, sel_scratch sc)
{
	KVT_PDL_TRIGGER();
	const uint32_t seg = blockIdx.y, n = n_tok[seg / hq];
	const uint32_t kmax = __ldcg(&stats[seg].max_key), nk = __ldcg(&stats[seg].nmin_key);
	if (!seg_trivial(n, max_n, __ldcg(&stats[seg].bad), p, bmin, bmax) &&
	    kvt_bins_serves(kvt_d_keyf(kmax), kvt_d_keyf(~nk), scale) && /* every score binned */
	    hist_from_ring(sc.ring, seg, sc.st + seg, kmax, nk, scale, n, p, bmin, bmax,
			   sc.cand_cap))
		return; /* hist_from_ring waited before it wrote */
	KVT_PDL_WAIT(); /* even here: this pass ends only after the zeroing (common.cuh) */
}

/* KEEP (never with RING): binned by the keys (kvt_gpu_keep), each massing its score. */
template <bool RING, bool KEEP>
static __global__ void __launch_bounds__(SEL_THREADS, SEL_MIN_BLOCKS)
	k_hist(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t max_n, uint32_t hq,
	       float scale, float p, uint32_t bmin, uint32_t bmax, const kvt_gpu_segstats *stats,
	       sel_scratch sc, kvt_gpu_topp *out, unsigned long long *err, kvt_gpu_keep keep,
	       uint32_t group)
{
	static_assert(!(RING && KEEP), "the ring bins scores, not keys");
	SEL_T(0);
	/* pass 3 (a programmatic dependent launch) may be scheduled once every block of this pass
	 * has started: its blocks take the places of this pass's blocks as they leave, and wait for
	 * this pass to finish before they read what it wrote */
	KVT_PDL_TRIGGER();
	__shared__ uint32_t hc[SEL_BINS], hw[2 * SEL_BINS];
	mhist hm{hw, SEL_BINS};
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x;
	seg_state *st = sc.st + seg;
	const uint32_t n = n_tok[seq];
	float inv_w;
	if (!seg_begin(stats + seg, seg, n, max_n, scale, p, bmin, bmax, out + seg, err, &inv_w)) {
		KVT_PDL_WAIT(); /* even here: this pass ends only after the zeroing (common.cuh) */
		return;
	}
	if (RING) { /* k_ring's decisions: a segment it served is done here */
		KVT_PDL_WAIT();
		if (__ldcg(&st->phase) == PH_CAND)
			return;
	}
	const float mx = kvt_d_keyf(__ldcg(&stats[seg].max_key));
	const bool mass = p < 1.0f;
	const keep_row kr = keep_of(keep, seg, group);
	for (uint32_t b = tid; b < SEL_BINS; b += SEL_THREADS)
	{
		hc[b] = 0;
		hm.zero(b);
	}
	__syncthreads();
	SEL_T(1);
	/* whole chunks of a segment of several bins without the per-score tests */
	each_of_block_split(scores + (size_t)seg * ld, n, inv_w > 0.0f, [&](uint32_t i, float f,
									 auto fast) {
		if (!decltype(fast)::value && i >= n)
			return;
		const uint32_t b = lbin(KEEP ? keep_key(kr, i, f) : f, mx, inv_w, fast);
		atomicAdd(&hc[b], 1u);
		if (mass)
			hm.add(b, f, mx, scale);
	});
	__syncthreads();
	SEL_T(2);
	/* the scratch's zeroing (the kernel before this one) is complete and visible past here */
	KVT_PDL_WAIT();
	uint32_t *gc = sc.hcnt + (size_t)seg * SEL_BINS;
	unsigned long long *gh = sc.hhi + (size_t)seg * SEL_BINS;
	for (uint32_t b = tid; b < SEL_BINS; b += SEL_THREADS) {
		if (!hc[b])
			continue;
		atomicAdd(&gc[b], hc[b]);
		const u64 xh = hm.sum(b);
		if (xh)
			atomicAdd(&gh[b], xh);
	}
	SEL_T(3);
	if (!last_block(st))
		return;
	SEL_T(4);
	if (tid == 0) { /* what pass 3 reads */
		st->max_key = __ldcg(&stats[seg].max_key);
		st->nmin_key = __ldcg(&stats[seg].nmin_key);
		st->inv_w = inv_w;
	}
	hist_decide(st, gc, gh, n, p, bmin, bmax, sc.cand_cap);
	SEL_T(5);
}

#ifdef KVT_SEL_TIMING
SEL_T_HOST(kvt_sel_timing_hist)
#endif

/* ---- launchers --------------------------------------------------------------------------- */

/* The current device's multiprocessors (132 when it cannot say: the launches that follow report
 * their own errors). */
static uint32_t sel_sms(void)
{
	int dev = 0, sms = 132;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
		(void)cudaGetLastError();
		sms = 132;
	}
	return (uint32_t)sms;
}

/* Blocks per segment for the threshold's passes: a chunk each, but no more than about
 * SEL_SM_BLOCKS blocks per multiprocessor over all segments (then each takes several chunks). For
 * pass 2 with the scan's ring (`ring`; k_ring decided the segments it serves, whose blocks leave
 * at once), at least SEL_RING_MIN_BLOCKS where that keeps within four times as many blocks. */
static uint32_t sel_blocks(uint32_t max_n, uint32_t segs, uint32_t sms, bool ring)
{
	const uint32_t chunks = max_n ? (max_n + SEL_CHUNK - 1) / SEL_CHUNK : 1;
	uint32_t cap = sms * SEL_SM_BLOCKS / segs;
	const uint32_t most = sms * SEL_SM_BLOCKS * 4 / segs;
	if (ring)
		cap = std::max(cap, std::min(SEL_RING_MIN_BLOCKS, most));
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

extern "C" int kvt_gpu_topp_ring_served(const void *scratch, uint32_t n_seqs, uint32_t n_q_heads,
					uint32_t *served)
{
	if (!scratch || !served)
		return -EINVAL;
	const size_t segs = (size_t)n_seqs * n_q_heads;
	seg_state *st = (seg_state *)malloc(segs * sizeof(seg_state) + 1);
	if (!st)
		return -ENOMEM;
	/* the segment states lie at the scratch's start (carve) */
	const cudaError_t e = cudaMemcpy(st, scratch, segs * sizeof(seg_state),
					 cudaMemcpyDeviceToHost);
	uint32_t k = 0;
	for (size_t i = 0; e == cudaSuccess && i < segs; i++)
		k += st[i].phase != PH_INIT && st[i].inv_w < 0.0f;
	free(st);
	if (e != cudaSuccess)
		return -EIO;
	*served = k;
	return 0;
}

static bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

/* The threshold, and the union's bits when bits.mask is given (kvt_gpu_topp_select). */
static int topp(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads, const float *scores,
		size_t ld, const uint32_t *n_tokens, uint32_t max_n, float scale, float p,
		uint32_t bmin, uint32_t bmax, const kvt_gpu_segstats *stats, const kvt_gpu_bins *ring,
		kvt_gpu_topp *out, kvt_gpu_selbits bits, const kvt_gpu_keep *keep, void *scratch,
		size_t scratch_bytes, unsigned long long *err, void *stream)
{
	if (!scores || !n_tokens || !out || !scratch || n_q_heads == 0)
		return -EINVAL;
	/* the keys' statistics are pass 1's: the scan's (and its ring) are the scores' */
	const kvt_gpu_keep kp = keep && keep->mask ? *keep : kvt_gpu_keep{};
	if (kp.mask && (stats || ring || !(kp.bonus >= 0.0f) || !isfinite(kp.bonus)))
		return -EINVAL;
	if (ld % 4 || max_n > ld || max_n > KVT_GPU_SELECT_MAX_N || !aligned16(scores) || !aligned16(scratch))
		return -EINVAL;
	if (!(scale > 0.0f) || !isfinite(scale) || !(p > 0.0f))
		return -EINVAL;
	if ((uint64_t)n_seqs * n_q_heads > 65535)
		return -EINVAL;
	/* the ring: the scan's, at this scale, with its statistics */
	if (ring && (!ring->count || !ring->dsum || ring->scale != scale || !stats ||
		     ring->serve_max > KVT_BINS_SERVE_MAX || !aligned16(ring->count) ||
		     !aligned16(ring->dsum)))
		return -EINVAL;
	sel_scratch sc = carve(scratch, n_seqs, n_q_heads, 1, max_n);
	sc.ring = ring ? *ring : kvt_gpu_bins{}; /* count NULL: no ring */
	if (scratch_bytes < sc.bytes)
		return -EINVAL;
	if (n_seqs == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	const uint32_t segs = n_seqs * n_q_heads;
	/* the state and the histograms, and the statistics when this call gathers them (pass 1
	 * then runs between, in plain stream order); and the union's bits */
	const size_t z16 = (stats ? sc.zero_bytes : sc.zero_all) / 16,
		     mw = bits.mask ? (size_t)n_seqs * n_kv_heads * bits.words : 0,
		     zw = std::max(z16, mw);
	const uint32_t zb = (uint32_t)std::min<size_t>((zw + SEL_THREADS - 1) / SEL_THREADS, 1024);
	k_zero<<<zb, SEL_THREADS, 0, s>>>((uint4 *)sc.st, z16, bits.mask, mw);
	KVT_CU_LAUNCHED();
	/* pass 2's grid is wider with the ring (k_ring decided the segments it serves, whose blocks
	 * leave at once); pass 3 streams every segment, so its grid stays balanced without */
	const uint32_t sms = sel_sms();
	const dim3 grid(sel_blocks(max_n, segs, sms, false), segs),
		hgrid(sel_blocks(max_n, segs, sms, sc.ring.count != NULL), segs);
	const uint32_t group = n_q_heads / n_kv_heads;
	if (!stats) {
		(kp.mask ? k_stats<true> : k_stats<false>)<<<grid, SEL_THREADS, 0, s>>>(
			scores, ld, n_tokens, max_n, n_q_heads, sc.stats, kp, group);
		KVT_CU_LAUNCHED();
	}
	/* with the caller's statistics, pass 2 streams its scores while the zeroing runs: it reads
	 * no scratch before its griddepcontrol.wait, and the statistics come from the caller's
	 * kernels; after pass 1 it reads pass 1's statistics from its start, so plain stream order.
	 * With the ring (which comes with statistics), the ring's pass between them decides first,
	 * and pass 2 waits for it before it streams */
	if (sc.ring.count)
		KVT_CU(kvt_launch_dependent(k_ring, dim3(1, segs), SEL_THREADS, s, true, n_tokens,
					    max_n, n_q_heads, scale, p, bmin, bmax, stats, sc));
	auto hist = sc.ring.count ? k_hist<true, false> : kp.mask ? k_hist<false, true>
								   : k_hist<false, false>;
	KVT_CU(kvt_launch_dependent(hist, hgrid, SEL_THREADS, s, stats != NULL, scores, ld,
				    n_tokens, max_n, n_q_heads, scale, p, bmin, bmax,
				    stats ? stats : sc.stats, sc, out, err, kp, group));
	KVT_CU(kvt_sel_launch_cand(grid, s, scores, ld, n_tokens, n_q_heads, scale, p, bmin, bmax,
				   sc, out, bits, group, kp));
	return 0;
}

extern "C" int kvt_gpu_topp_threshold(uint32_t n_seqs, uint32_t n_q_heads, const float *scores,
				      size_t ld, const uint32_t *n_tokens, uint32_t max_n,
				      float scale, float p, uint32_t bmin, uint32_t bmax,
				      const kvt_gpu_segstats *stats, const kvt_gpu_bins *ring,
				      kvt_gpu_topp *out, void *scratch, size_t scratch_bytes,
				      unsigned long long *err, void *stream)
{
	const kvt_gpu_selbits none = {};
	return topp(n_seqs, n_q_heads, 1, scores, ld, n_tokens, max_n, scale, p, bmin, bmax, stats,
		    ring, out, none, NULL, scratch, scratch_bytes, err, stream);
}

extern "C" int kvt_gpu_topp_select(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				   const float *scores, size_t ld, const uint32_t *n_tokens,
				   uint32_t max_n, float scale, float p, uint32_t bmin,
				   uint32_t bmax, const kvt_gpu_segstats *stats,
				   const kvt_gpu_bins *ring, kvt_gpu_topp *out, kvt_gpu_selbits bits,
				   const kvt_gpu_keep *keep, unsigned long long *clamps,
				   void *scratch, size_t scratch_bytes, unsigned long long *err,
				   void *stream)
{
	/* all of kvt_gpu_selbits_count's checks too: nothing is launched unless all can be */
	if (!kvt_gpu_selbits_fit(bits, max_n) || n_kv_heads == 0 || n_q_heads % n_kv_heads ||
	    n_q_heads / n_kv_heads > KVT_GPU_MAX_GROUP)
		return -EINVAL;
	const int rc = topp(n_seqs, n_q_heads, n_kv_heads, scores, ld, n_tokens, max_n, scale, p,
			    bmin, bmax, stats, ring, out, bits, keep, scratch, scratch_bytes, err,
			    stream);
	if (rc < 0 || n_seqs == 0)
		return rc;
	return kvt_gpu_selbits_count(n_seqs, n_q_heads, n_kv_heads, out, bits, clamps, stream);
}
