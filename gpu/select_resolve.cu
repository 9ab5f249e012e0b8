/* SPDX-License-Identifier: MIT */
/*
 * Pass 3 of the Top-p threshold (select.cu has the design): the scores of the boundary bins pass 2
 * picked are appended to the segment's candidate list, and the segment's last block resolves the
 * exact threshold and clamp among them: ranked in shared memory when they are few, else by a radix
 * select (over the whole segment when the list overflowed).
 */
#include "select_common.cuh"

/* ---- pass 3: candidates, and the exact resolution ---------------------------------------- */

/* Clears a segment's slots of the scan's ring, for the next scan (block 0 of the segment). */
static __device__ void ring_clear(const kvt_gpu_bins &ring, uint32_t seg)
{
	uint4 *c = (uint4 *)(ring.count + (size_t)seg * KVT_BINS);
	ulonglong2 *d = (ulonglong2 *)(ring.dsum + (size_t)seg * KVT_BINS);
	for (uint32_t e = threadIdx.x; e < KVT_BINS / 4; e += SEL_THREADS)
		c[e] = make_uint4(0, 0, 0, 0);
	for (uint32_t e = threadIdx.x; e < KVT_BINS / 2; e += SEL_THREADS)
		d[e] = make_ulonglong2(0, 0);
}

/* Where the resolution reads its scores: the candidate list, or the whole segment; kr: the keys
 * (kvt_gpu_keep), kr.m NULL when they are the scores. */
struct source {
	const u64 *cand;
	uint32_t ncand;
	bool listed;
	const float *s;
	uint32_t n;
	keep_row kr;
};

/* The score a candidate's mass is reckoned from: its key, or with keys the segment's score. */
static __device__ __forceinline__ float cand_score(const source &src, u64 c, float key)
{
	return src.kr.m ? __ldg(src.s + ckey_pos(c)) : key;
}

/* f(ckey, key, score) for each score of the source in this thread's share. */
template <class F>
static __device__ void each_of(const source &src, F f)
{
	if (src.listed) { /* SEL_VEC candidates a thread loaded before any is used, as load_chunk */
		for (uint32_t i0 = threadIdx.x; i0 < src.ncand; i0 += SEL_VEC * SEL_THREADS) {
			u64 c[SEL_VEC];
#pragma unroll
			for (int k = 0; k < SEL_VEC; k++) {
				const uint32_t i = i0 + k * SEL_THREADS;
				c[k] = i < src.ncand ? __ldcg(src.cand + i) : 0;
			}
#pragma unroll
			for (int k = 0; k < SEL_VEC; k++)
				if (i0 + k * SEL_THREADS < src.ncand) {
					const float key = kvt_d_keyf((uint32_t)(c[k] >> 24));
					f(c[k], key, cand_score(src, c[k], key));
				}
		}
		return;
	}
	for (uint32_t c0 = 0; c0 < src.n; c0 += SEL_CHUNK)
		each_in_chunk(src.s, c0, src.n, [&](uint32_t i, float x) {
			if (i < src.n) {
				const float key = keep_key(src.kr, i, x);
				f(ckey(kvt_d_fkey(key), i), key, x);
			}
		});
}

/* The resolution's state, in shared memory: the ckey digits fixed so far and what lies above. */
struct resolve_state {
	u64 prefix;
	uint32_t above, cnt;
	u64 acc;
	double target;
	uint32_t want;
};

/*
 * One level of the in-block radix select: histogram the digit at SHIFT of the candidates of bin
 * `bin` whose higher digits equal the prefix, pick the digit (by mass or by rank), fix it.
 */
template <bool MASS, int SHIFT, int WIDTH, class Tag>
static __device__ void rlevel(Tag tag, const source &src, uint32_t bin, float mx, float inv_w,
			      float scale, uint32_t *smem, resolve_state *rs)
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
	each_of(src, [&](u64 c, float key, float x) {
		if ((c >> top) != (prefix >> top) || lbin(key, mx, inv_w, tag) != bin)
			return;
		const uint32_t d = (uint32_t)(c >> SHIFT) & (bins - 1);
		atomicAdd(&hc[d], 1u);
		if (MASS)
			hm.add(d, x, mx, scale);
	});
	__syncthreads();
	/* digits from the largest down */
	auto get = [&](uint32_t j, uint32_t, uint32_t *c, u64 *m) {
		const uint32_t d = bins - 1 - j;
		*c = hc[d];
		*m = MASS ? hm.sum(d) : 0;
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

/* The want-th largest ckey among the candidates of `bin`: the cut that marks exactly want (tag:
 * lbin's, a checked_tag). */
template <class Tag>
static __device__ u64 rank_cut(Tag tag, const source &src, uint32_t bin, uint32_t above,
			       uint32_t want, float mx, float inv_w, uint32_t *smem,
			       resolve_state *rs)
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
	rlevel<false, 45, 11>(tag, src, bin, mx, inv_w, 0.0f, smem, rs);
	rlevel<false, 34, 11>(tag, src, bin, mx, inv_w, 0.0f, smem, rs);
	rlevel<false, 24, 10>(tag, src, bin, mx, inv_w, 0.0f, smem, rs);
	if (rs->above + rs->cnt == want) /* the ties fit whole */
		return (rs->prefix >> 24) << 32;
	/* lowest positions first */
	rlevel<false, 12, 12>(tag, src, bin, mx, inv_w, 0.0f, smem, rs);
	rlevel<false, 0, 12>(tag, src, bin, mx, inv_w, 0.0f, smem, rs);
	return cut_of(rs->prefix);
}

/* ---- the resolution of a short list: ranked in shared memory ----------------------------- */

/*
 * The m <= SEL_RANK candidates of the list (list[r]: candidate threadIdx.x + r SEL_THREADS, read
 * by the caller) into a[0 .. m) in descending order: a candidate's place is the number of
 * candidates larger than it. ckeys are distinct (the positions differ), so the places are a
 * permutation. The m * m comparisons are spread over the whole block: RANK_PER candidates a
 * thread, in whole warps of `slots` threads, and `parts` such groups, each counting over its share
 * of the list (the shared reads are broadcasts) and adding into place[]. Two candidates a thread
 * compared with the whole list took m shared reads in a row, most of a flat segment's last block
 * (doc/selection.md).
 */
#define RANK_PER 4u
static_assert(SEL_RANK <= SEL_THREADS * RANK_PER, "every candidate has a slot");
static __device__ void rank_sort(u64 *a, const u64 (&list)[SEL_RANK / SEL_THREADS], uint32_t m)
{
	uint32_t *place = (uint32_t *)(a + SEL_RANK); /* a[] has room past the list (resolve) */
	const uint32_t tid = threadIdx.x, /* whole warps of RANK_PER candidates a thread */
		slots = max(32u, ((m + RANK_PER - 1) / RANK_PER + 31) & ~31u),
		parts = SEL_THREADS / slots, slot = tid % slots, part = tid / slots,
		share = (m + parts - 1) / parts;
#pragma unroll
	for (uint32_t r = 0; r < SEL_RANK / SEL_THREADS; r++) {
		const uint32_t i = tid + r * SEL_THREADS;
		if (i < m) {
			a[i] = list[r];
			place[i] = 0;
		}
	}
	__syncthreads();
	if (part < parts) {
		u64 mine[RANK_PER];
		uint32_t above[RANK_PER];
#pragma unroll
		for (uint32_t r = 0; r < RANK_PER; r++) {
			const uint32_t i = slot + r * slots;
			mine[r] = i < m ? a[i] : ~0ull; /* nothing is larger than an empty slot */
			above[r] = 0;
		}
		const uint32_t j1 = min(m, (part + 1) * share);
#pragma unroll 4
		for (uint32_t j = part * share; j < j1; j++) {
			const u64 x = a[j];
#pragma unroll
			for (uint32_t r = 0; r < RANK_PER; r++)
				above[r] += x > mine[r];
		}
#pragma unroll
		for (uint32_t r = 0; r < RANK_PER; r++)
			if (slot + r * slots < m && above[r])
				atomicAdd(&place[slot + r * slots], above[r]);
	}
	__syncthreads();
	u64 v[SEL_RANK / SEL_THREADS];
	uint32_t at[SEL_RANK / SEL_THREADS];
#pragma unroll
	for (uint32_t r = 0; r < SEL_RANK / SEL_THREADS; r++) {
		const uint32_t i = tid + r * SEL_THREADS;
		v[r] = i < m ? a[i] : 0;
		at[r] = i < m ? place[i] : 0;
	}
	__syncthreads();
#pragma unroll
	for (uint32_t r = 0; r < SEL_RANK / SEL_THREADS; r++)
		if (tid + r * SEL_THREADS < m)
			a[at[r]] = v[r];
	__syncthreads();
}

/* The index of the first candidate of bin b in the sorted list (a bin's candidates are adjacent). */
template <class Tag>
static __device__ uint32_t first_of(Tag tag, const u64 *a, uint32_t m, uint32_t b, float mx,
				    float inv_w)
{
	__shared__ uint32_t lo;
	if (threadIdx.x == 0)
		lo = SEL_NONE;
	__syncthreads();
	uint32_t mine = SEL_NONE;
	for (uint32_t i = threadIdx.x; i < m; i += SEL_THREADS)
		if (lbin(kvt_d_keyf((uint32_t)(a[i] >> 24)), mx, inv_w, tag) == b &&
		    mine == SEL_NONE)
			mine = i;
	block_min_into(&lo, mine);
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
template <class Tag>
static __device__ uint32_t mass_sorted(Tag tag, const source &src, const u64 *a, uint32_t m,
				       uint32_t b, float mx, float inv_w, float scale, u64 acc,
				       double target, uint32_t *ge)
{
	__shared__ uint32_t istar, hi, end;
	const uint32_t E = (m + SEL_THREADS - 1) / SEL_THREADS, i0 = threadIdx.x * E,
		       i1 = min(i0 + E, m);
	const uint32_t lo = first_of(tag, a, m, b, mx, inv_w);
	if (threadIdx.x == 0) {
		istar = SEL_NONE;
		hi = end = 0;
	}
	auto mass_of = [&](uint32_t i, u64 *t) {
		const float x = kvt_d_keyf((uint32_t)(a[i] >> 24));
		if (lbin(x, mx, inv_w, tag) != b)
			return false;
		*t = term(cand_score(src, a[i], x), mx, scale);
		return true;
	};
	uint32_t c = 0, tc;
	u64 run = 0, t, tm;
	for (uint32_t i = i0; i < i1; i++)
		if (mass_of(i, &t))
			run += t;
	scan_excl(c, run, &tc, &tm); /* also the barrier for istar, hi, end */
	run += acc;
	uint32_t my_hi = 0, my_star = SEL_NONE;
	for (uint32_t i = i0; i < i1; i++)
		if (mass_of(i, &t)) {
			run += t;
			my_hi = i;
			if (mass_d(run) >= target) {
				my_star = i;
				break;
			}
		}
	block_max_into(&hi, my_hi);
	block_min_into(&istar, my_star);
	__syncthreads();
	const uint32_t key = (uint32_t)(a[istar != SEL_NONE ? istar : hi] >> 24);
	uint32_t my_end = 0;
	for (uint32_t i = threadIdx.x; i < m; i += SEL_THREADS)
		if ((uint32_t)(a[i] >> 24) == key)
			my_end = i;
	block_max_into(&end, my_end);
	__syncthreads();
	*ge = end - lo + 1;
	__syncthreads();
	return key;
}

/*
 * The last block's exact resolution of a segment: the Top-p value in bin[NEED_MASS], then the
 * clamp, over the segment's bins (the scan's ring's only when RING). Out of line, so that its
 * registers do not weigh on the streaming pass before it.
 */
template <bool RING>
static __device__ __noinline__ void resolve(seg_state *st, const float *s, uint32_t n,
					    const u64 *cand, uint32_t cand_cap, float scale, float p,
					    uint32_t bmin, uint32_t bmax, kvt_gpu_topp *out,
					    keep_row kr)
{
	/* the ranked list (SEL_RANK, then its places), or rlevel's histograms: up to SEL_CNT_BINS
	 * counts, or SEL_BINS counts and two words of mass for each */
	__shared__ u64 smem64[3 * SEL_BINS / 2];
	static_assert(SEL_RANK * 3 / 2 <= 3 * SEL_BINS / 2 && SEL_CNT_BINS <= 3 * SEL_BINS,
		      "shared fits");
	__shared__ resolve_state rs;
	uint32_t *smem = (uint32_t *)smem64;
	const uint32_t tid = threadIdx.x;
	const checked_tag<RING> tag;
	const float mx = kvt_d_keyf(__ldcg(&st->max_key)), inv_w = __ldcg(&st->inv_w);
	const uint32_t b0 = __ldcg(&st->bin[NEED_MASS]);
	const bool listed = __ldcg(&st->listed);
	const uint32_t m = __ldcg(&st->ncand);
	/* read with the state, not after it (two round trips to L2 in a row on the segment's last
	 * block): the mass decision's, and the head of the list, as far as the list's room goes
	 * (what lies past m is not used, nor any of it when the list is not ranked: two loads a
	 * thread, once a segment, cheaper than waiting for `listed` and m first) */
	const u64 acc = __ldcg(&st->acc);
	const double target = __ldcg(&st->target);
	const uint32_t above_mass = __ldcg(&st->above[NEED_MASS]);
	u64 list[SEL_RANK / SEL_THREADS];
#pragma unroll
	for (uint32_t r = 0; r < SEL_RANK / SEL_THREADS; r++) {
		const uint32_t i = tid + r * SEL_THREADS;
		list[r] = i < cand_cap ? __ldcg(cand + i) : 0;
	}
	const source src = {.cand = cand, .ncand = m, .listed = listed, .s = s, .n = n, .kr = kr};
	float thresh = kvt_d_keyf(~__ldcg(&st->nmin_key));
	uint32_t count = n;
	u64 *a = smem64;
	/* a few candidates are ranked; more take the radix levels, which took half the time of a
	 * bitonic sort of 3.7K (doc/selection.md) */
	const bool sorted = listed && m <= SEL_RANK;
	if (sorted)
		rank_sort(a, list, m);
	SEL_T(5);
	if (p < 1.0f && sorted) {
		uint32_t ge;
		const uint32_t key =
			mass_sorted(tag, src, a, m, b0, mx, inv_w, scale, acc, target, &ge);
		thresh = kvt_d_keyf(key);
		count = above_mass + ge;
	} else if (p < 1.0f) {
		if (tid == 0) {
			rs.prefix = 0;
			rs.above = above_mass;
			rs.acc = acc;
			rs.target = target;
			rs.want = 0;
		}
		__syncthreads();
		rlevel<true, 45, 11>(tag, src, b0, mx, inv_w, scale, smem, &rs);
		rlevel<true, 34, 11>(tag, src, b0, mx, inv_w, scale, smem, &rs);
		rlevel<true, 24, 10>(tag, src, b0, mx, inv_w, scale, smem, &rs);
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
			cut = cut_of(a[first_of(tag, a, m, bw, mx, inv_w) + (want - above) - 1]);
		else
			cut = rank_cut(tag, src, bw, above, want, mx, inv_w, smem, &rs);
	}
	if (tid == 0) {
		st->done = 0;
		finalize(st, out, thresh, count, want, clamped, cut);
	}
}

/*
 * The union's bits of the segment's tokens that the cut marks, once it is resolved (out->cut,
 * written by this block's thread 0): among the candidates, or over the whole segment when the list
 * overflowed (the tokens of earlier bins were marked while the candidates were listed, or here).
 */
static __device__ __noinline__ void mark_cut(const seg_state *st, const float *s, uint32_t n,
					     const u64 *cand, const kvt_gpu_topp *out,
					     uint32_t *mask, keep_row kr)
{
	__syncthreads(); /* thread 0's finalize is visible to the block past here */
	if (!out->marked)
		return;
	const u64 cut = out->cut;
	if (__ldcg(&st->listed)) {
		const uint32_t m = __ldcg(&st->ncand);
		for (uint32_t i = threadIdx.x; i < m; i += SEL_THREADS) {
			const u64 c = __ldcg(cand + i);
			const uint32_t pos = ckey_pos(c);
			if (((c >> 24) << 32 | (0xffffffffu - pos)) >= cut)
				atomicOr(mask + pos / 32, 1u << pos % 32);
		}
		return;
	}
	for (uint32_t c0 = 0; c0 < n; c0 += SEL_CHUNK)
		each_quad_in_chunk(s, c0, n, [&](uint32_t i, const float (&x)[4]) {
			uint32_t nib = 0;
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const float key = keep_key(kr, i + e, x[e]);
				const u64 c = (u64)kvt_d_fkey(key) << 32 | (0xffffffffu - (i + e));
				nib |= (i + e < n && c >= cut ? 1u : 0u) << e;
			}
			mark_nibble(mask, i, nib);
		});
}

/*
 * Pass 3. UNION: also the union's bits (mask: the item's, zeroed by k_zero): every token of a bin
 * before the final cut's (fbin) as the scores stream, the candidates the cut marks after the
 * resolution, and all tokens of a segment that marks all without a resolution.
 */
template <bool UNION, bool RING, bool KEEP>
static __global__ void __launch_bounds__(SEL_THREADS, SEL_MIN_BLOCKS)
	k_cand(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq, float scale,
	       float p, uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out,
	       kvt_gpu_selbits bits, uint32_t group, kvt_gpu_keep keep)
{
	static_assert(!(RING && KEEP), "the ring bins scores, not keys");
	SEL_T(0);
	const uint32_t seg = blockIdx.y, seq = seg / hq, tid = threadIdx.x, lane = tid % 32;
	seg_state *st = sc.st + seg;
	/* launched as pass 2's programmatic dependent: this block may have started while pass 2's
	 * last blocks decide; wait until pass 2 has finished and its writes are visible */
	KVT_PDL_WAIT();
	if (RING && blockIdx.x == 0) /* pass 2 has read the scan's ring: clear it */
		ring_clear(sc.ring, seg);
	const uint32_t n = n_tok[seq];
	const float *s = scores + (size_t)seg * ld;
	uint32_t *mask = UNION ? bits.mask + (size_t)(seg / group) * bits.words : NULL;
	if (__ldcg(&st->phase) != PH_CAND) {
		/* finalized by pass 2: nothing marked, or all n (never more than max_n) */
		if (UNION && __ldcg(&out[seg].marked))
			for (uint32_t c0 = blockIdx.x * SEL_CHUNK; c0 < n;
			     c0 += gridDim.x * SEL_CHUNK)
#pragma unroll
				for (int k = 0; k < SEL_VEC; k++) {
					const uint32_t i = c0 + 4 * (tid + k * SEL_THREADS);
					const uint32_t nib = i + 4 <= n ? 15u
							     : i < n    ? (1u << (n - i)) - 1
									: 0u;
					mark_nibble(mask, i, nib);
				}
		return;
	}
	const float mx = kvt_d_keyf(__ldcg(&st->max_key)), inv_w = __ldcg(&st->inv_w);
	const keep_row kr = KEEP ? keep_of(keep, seg, group) : keep_row{nullptr, 0, 0.0f};
	const uint32_t b0 = __ldcg(&st->bin[0]), b1 = __ldcg(&st->bin[1]), b2 = __ldcg(&st->bin[2]);
	const uint32_t fbin = UNION ? __ldcg(&st->fbin) : 0;
	const bool listed = __ldcg(&st->listed);
	u64 *cand = sc.cand + (size_t)seg * sc.cand_cap;
	SEL_T(1);
	/* a float4's four scores: the union's nibble of the tokens before the final cut's bin, and
	 * the boundary bins' scores appended to the list (past n and with one bin, when not fast,
	 * each score is tested; a warp whose quads hold no candidate skips the votes) */
	auto quad = [&](uint32_t i0, const float (&x0)[4], auto fast) {
		constexpr bool F = decltype(fast)::value;
		uint32_t nib = 0;
		bool in[4], any = false;
		/* with keys, each score's key (the bits of the quad's four positions in one word) */
		float x[4] = {x0[0], x0[1], x0[2], x0[3]};
		if (KEEP) {
			const uint32_t kn = (F || i0 < n) ? keep_nib(kr, i0) : 0u;
#pragma unroll
			for (int e = 0; e < 4; e++)
				x[e] = (kn >> e) & 1u ? __fadd_rn(x0[e], kr.bonus) : x0[e];
		}
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const uint32_t i = i0 + e;
			const uint32_t b = lbin(x[e], mx, inv_w, fast);
			nib |= (UNION && (F || i < n) && b < fbin ? 1u : 0u) << e;
			in[e] = (F || i < n) && (b == b0 || b == b1 || b == b2);
			any |= in[e];
		}
		if (__any_sync(0xffffffffu, any))
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const uint32_t vote = __ballot_sync(0xffffffffu, in[e]);
				if (!vote)
					continue;
				const int first = __ffs(vote) - 1;
				uint32_t base = 0;
				if (lane == (uint32_t)first)
					base = atomicAdd(&st->ncand, (uint32_t)__popc(vote));
				base = __shfl_sync(0xffffffffu, base, first);
				if (in[e])
					cand[base + __popc(vote & ((1u << lane) - 1))] =
						ckey(kvt_d_fkey(x[e]), i0 + e);
			}
		if (UNION)
			mark_nibble(mask, i0, nib);
	};
	if (RING && listed && inv_w < 0.0f) /* the scan's ring's bins (k_hist's hist_from_ring) */
		each_quad_of_block_split<ring_tag, checked_tag<true>>(s, n, true, quad);
	else if (listed) /* k_hist's own bins */
		each_quad_of_block_split<std::true_type, checked_tag<false>>(s, n, inv_w > 0.0f,
									       quad);
	SEL_T(2);
	if (!last_block(st))
		return;
	SEL_T(4);
	resolve<RING>(st, s, n, cand, sc.cand_cap, scale, p, bmin, bmax, out + seg, kr);
	if (UNION)
		mark_cut(st, s, n, cand, out + seg, mask, kr);
	SEL_T(6);
}

#ifdef KVT_SEL_TIMING
SEL_T_HOST(kvt_sel_timing_cand)
#endif

cudaError_t kvt_sel_launch_cand(dim3 grid, cudaStream_t s, const float *scores, size_t ld,
				const uint32_t *n_tok, uint32_t hq, float scale, float p,
				uint32_t bmin, uint32_t bmax, sel_scratch sc, kvt_gpu_topp *out,
				kvt_gpu_selbits bits, uint32_t group, kvt_gpu_keep keep)
{
	/* k_cand's blocks are scheduled as pass 2's blocks leave (pass 2 allows it from its start),
	 * hiding this launch's latency behind pass 2's decisions */
	auto k = keep.mask   ? (bits.mask ? k_cand<true, false, true> : k_cand<false, false, true>)
		 : bits.mask ? (sc.ring.count ? k_cand<true, true, false>
					      : k_cand<true, false, false>)
			     : (sc.ring.count ? k_cand<false, true, false>
					      : k_cand<false, false, false>);
	return kvt_launch_dependent(k, grid, SEL_THREADS, s, true, scores, ld, n_tok, hq, scale, p,
				    bmin, bmax, sc, out, bits, group, keep);
}
