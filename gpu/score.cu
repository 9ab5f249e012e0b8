/* SPDX-License-Identifier: MIT */
/*
 * Query preparation and the INT4 x binary scan.
 *
 * The scan computes <b, u> (code bits times the 4-bit quantized query) and popcount(b) for every
 * token and every query head of the group with 8-bit integer tensor-core MMAs instead of bit-plane
 * popcounts: with 4 query heads per KV head the popcount form needs 68 POPC per token, which runs
 * at a quarter of the integer rate and would make the scan compute-bound at about a third of memory
 * speed. As an MMA, tokens are the rows of A (16 per warp tile), the k dimension is the d
 * coordinates, and the columns of B hold the group's queries in the even columns, four per n-tile,
 * and all ones in column 7 of the first, so one m16n8k32 product yields <b, u_q> and popcount(b),
 * and each lane of a quad finds one query's results for its two rows (no idle lanes in the
 * epilogue, which is most of the instructions).
 *
 * The order of coordinates along k is free as long as A and B agree, and it is chosen so that
 * expanding code bits into the bytes of A costs one AND per register: at k-step s, lane t of a quad
 * masks code word word(t, s) with 0x01010101 << sh (sh = shift(t, s) < 4) for a0 and the same
 * word shifted right by 4 (once per tile) for a2, so byte i of a0 holds bit sh + 8 i as 0 or 2^sh
 * and byte i of a2 bit sh + 4 + 8 i likewise. B carries u * 2^(4 - sh) at those coordinates (at
 * most 240: u8), so every product is 16 * bit * u and the accumulators hold 16 <b, u> and
 * 16 popcount(b) exactly. kvt_gpu_query_prepare lays u out in this order (kvt_gpu_qcode.frag).
 *
 * The float epilogue then repeats kvt_score's operations in its order with round-to-nearest
 * intrinsics (no contraction), which makes every score bit-equal to the CPU's.
 */
#include <cuda_fp16.h>

#include "common.cuh"
#include "scanbins.h"
#include "score.cuh"
#include "segstats.cuh"

/*
 * The coordinate order along k: at k-step s, lane t of a quad works on code word word(t, s) at bit
 * offset shift(t, s); bytes i of a0 and a2 are coordinates 32 word + shift + 8 i and
 * 32 word + shift + 4 + 8 i. Over the quad's lanes and the d/32 k-steps every coordinate comes once.
 */
template <int D>
static __device__ __forceinline__ uint32_t lane_word(uint32_t t, int s)
{
	return D == 64 ? t >> 1 : D == 128 ? t : 2 * t + (uint32_t)(s >> 2);
}

template <int D>
static __device__ __forceinline__ uint32_t lane_shift(uint32_t t, int s)
{
	return D == 64 ? (t & 1u) + 2u * (uint32_t)s : D == 128 ? (uint32_t)s : (uint32_t)(s & 3);
}

/* ---- query preparation ------------------------------------------------------------------- */

/* The reduction step of lo (CMP <) or hi (CMP >) as the CPU's walk from coordinate 0 finds them:
 * (v, i) takes (ov, oi) when ov is beyond v, or equal to it at a lower coordinate. A macro, so that
 * each use compiles as the comparison written out did. */
#define KEEP_FIRST(CMP, v, i, ov, oi)                                                              \
	do {                                                                                       \
		if ((ov) CMP (v) || ((ov) == (v) && (oi) < (i))) {                                 \
			v = ov;                                                                    \
			i = oi;                                                                    \
		}                                                                                  \
	} while (0)

template <int D, int DT>
static __global__ void __launch_bounds__(D)
	k_prepare(const float *__restrict__ rot, const void *q, const float *const *c_q,
		  const float *const *c_k, uint32_t hq, uint32_t group, kvt_gpu_qcode *out)
{
	constexpr int W = D / 32, S = D / 32;
	__shared__ __align__(16) float rs[D];
	__shared__ float xs[D];
	__shared__ uint8_t us[D];
	__shared__ float cks[D];
	__shared__ float lo_s, delta_s;
	__shared__ float red_v[2][D / 32];
	__shared__ uint32_t red_i[2][D / 32];
	__shared__ uint32_t pl[4][W];
	const uint32_t sq = blockIdx.x, seq = sq / hq, kvh = (sq % hq) / group, j = threadIdx.x;
	const float *cq = c_q[seq] + (size_t)kvh * D, *ck = c_k[seq] + (size_t)kvh * D;
	kvt_gpu_qcode *o = out + sq;

	rs[j] = __fsub_rn(kvt_d_load<DT>(q, (size_t)sq * D + j), cq[j]);
	cks[j] = ck[j];
	__syncthreads();
	float x = 0.0f; /* x[j] = sum over i increasing of rot[j][i] r[i], as rotate() */
	const float4 *rj = (const float4 *)(rot + (size_t)j * D);
#pragma unroll 16
	for (int i4 = 0; i4 < D / 4; i4++) {
		const float4 a = __ldg(rj + i4), r = *(const float4 *)&rs[4 * i4];
		x = __fadd_rn(x, __fmul_rn(a.x, r.x));
		x = __fadd_rn(x, __fmul_rn(a.y, r.y));
		x = __fadd_rn(x, __fmul_rn(a.z, r.z));
		x = __fadd_rn(x, __fmul_rn(a.w, r.w));
	}
	xs[j] = x;
	/*
	 * lo and hi as the CPU's walk from coordinate 0 finds them (lib/estimate.c): the first
	 * coordinate holding the least (greatest) value, so that a tie of -0 and +0 resolves the same,
	 * and NaN coordinates past the first passed over (all NaN when the first is). A reduction
	 * over (value, coordinate) that prefers the lower coordinate among equal values gives that.
	 */
	{
		const bool nan = x != x;
		float vl = nan ? INFINITY : x, vh = nan ? -INFINITY : x;
		uint32_t il = j, ih = j;
#pragma unroll
		for (int o = 16; o; o >>= 1) {
			const float ol = __shfl_xor_sync(0xffffffffu, vl, o),
				    oh = __shfl_xor_sync(0xffffffffu, vh, o);
			const uint32_t oil = __shfl_xor_sync(0xffffffffu, il, o),
				       oih = __shfl_xor_sync(0xffffffffu, ih, o);
			KEEP_FIRST(<, vl, il, ol, oil);
			KEEP_FIRST(>, vh, ih, oh, oih);
		}
		if (j % 32 == 0) {
			red_v[0][j / 32] = vl;
			red_i[0][j / 32] = il;
			red_v[1][j / 32] = vh;
			red_i[1][j / 32] = ih;
		}
	}
	__syncthreads();
	if (j == 0) {
		float lo = red_v[0][0], hi = red_v[1][0];
		uint32_t il = red_i[0][0], ih = red_i[1][0];
		for (int w = 1; w < D / 32; w++) {
			KEEP_FIRST(<, lo, il, red_v[0][w], red_i[0][w]);
			KEEP_FIRST(>, hi, ih, red_v[1][w], red_i[1][w]);
		}
		/* the coordinates' own values: +-inf above may stand for a NaN of coordinate 0 */
		lo = xs[0] != xs[0] ? xs[0] : xs[il];
		hi = xs[0] != xs[0] ? xs[0] : xs[ih];
		lo_s = lo;
		delta_s = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
	} else if (j == 32) {
		float s = 0.0f;
		for (int i = 0; i < D; i++)
			s = __fadd_rn(s, __fmul_rn(rs[i], cks[i]));
		/* saturated as lib/estimate.c's twin does (KVT_QC_CK_MAX) */
		o->qc_ck = s != s ? 0.0f : s > KVT_QC_CK_MAX ? KVT_QC_CK_MAX
			   : s < -KVT_QC_CK_MAX ? -KVT_QC_CK_MAX : s;
	}
	__syncthreads();
	const float lo = lo_s, delta = delta_s;
	const float t = delta > 0.0f ? __fdiv_rn(__fsub_rn(x, lo), delta) : 0.0f;
	const float f = floorf(__fadd_rn(t, 0.5f));
	const uint32_t u = f < 0.0f ? 0u : f > 15.0f ? 15u : (uint32_t)f;
	us[j] = (uint8_t)u;
#pragma unroll
	for (int p = 0; p < 4; p++) {
		const uint32_t bits = __ballot_sync(0xffffffffu, (u >> p) & 1u);
		if (j % 32 == 0)
			pl[p][j / 32] = bits;
	}
	__syncthreads();
	if (j < 32)
		o->planes[j / 8][j % 8] = j % 8 < W ? pl[j / 8][j % 8] : 0u;
	if (j < 64) { /* frag[s][t][h]: the four bytes of operand B that lane t of a quad holds */
		const uint32_t s = j / 8, t = (j / 2) % 4, hh = j % 2;
		uint32_t v = 0;
		if ((int)s < S) {
			const uint32_t sh = lane_shift<D>(t, (int)s), w = lane_word<D>(t, (int)s);
			for (uint32_t i = 0; i < 4; i++)
				v |= ((uint32_t)us[32 * w + sh + 4 * hh + 8 * i] << (4 - sh))
				     << (8 * i);
		}
		o->frag[s][t][hh] = v;
	}
	if (j == 0) {
		uint32_t sum = 0; /* sum of u, exactly, from the planes */
		for (int p = 0; p < 4; p++)
			for (int w = 0; w < W; w++)
				sum += (uint32_t)__popc(pl[p][w]) << p;
		const float sum_u = (float)sum, isd = __fdiv_rn(1.0f, __fsqrt_rn((float)D));
		o->x_l = lo;
		o->delta = delta;
		o->sum_u = sum_u;
		o->d = D;
		o->A = __fmul_rn(__fmul_rn(2.0f, delta), isd);
		o->B = __fmul_rn(__fmul_rn(2.0f, lo), isd);
		o->C = __fmul_rn(__fsub_rn(__fmul_rn(-delta, sum_u), __fmul_rn((float)D, lo)), isd);
	}
}

/* ---- the scan ---------------------------------------------------------------------------- */

#define SC_WARPS 8
/* compile-time, for an A/B; on the H200 (2026-12-03) more tiles in flight lost at every size:
 * 3 or 4 tiles at 3 or 2 blocks per multiprocessor took 165 or 134 us at 1M tokens against 128
 * (doc/selection.md) */
#ifndef SC_TILES
#define SC_TILES 2 /* 16-token tiles per warp per chunk (and as many more in flight) */
#endif
#ifndef SC_MIN_BLOCKS /* resident blocks per multiprocessor the registers are held to (D <= 128) */
#define SC_MIN_BLOCKS 4
#endif
#define SC_TOKENS (SC_WARPS * SC_TILES * 16)
#define SC_MAX_NT ((KVT_GPU_MAX_GROUP + 3) / 4)

static __device__ __forceinline__ void mma_u8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
					      uint32_t a3, uint32_t b0, uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
		     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
		     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* An integer below 2^23 to float, exactly, on the full-rate pipes (I2F runs at a quarter rate). */
static __device__ __forceinline__ float small_u2f(uint32_t v)
{
	return __fsub_rn(__uint_as_float(0x4b000000u | v), 8388608.0f);
}

static __device__ __forceinline__ float h2f(uint32_t h)
{
	return __half2float(__ushort_as_half((uint16_t)h));
}

/*
 * Operand B of n-tile nt for this lane: column 2c is query 4 nt + c, column 7 of n-tile 0 is all
 * ones (popcount of the code), the other odd columns are zero. So lane t of a quad finds query
 * 4 nt + t in its accumulators c[0] and c[2] (rows g and g + 8), and every lane finishes two
 * scores per tile.
 */
template <int D>
static __device__ __forceinline__ uint2 b_frag(const kvt_gpu_qcode *q0, uint32_t G, uint32_t nt,
					       int s, uint32_t lane)
{
	const uint32_t col = lane >> 2, t = lane & 3, q = nt * 4 + col / 2;
	if (col == 7 && nt == 0) {
		const uint32_t v = 0x01010101u << (4 - lane_shift<D>(t, s));
		return make_uint2(v, v);
	}
	if (col % 2 == 0 && q < G)
		return make_uint2(q0[q].frag[s][t][0], q0[q].frag[s][t][1]);
	return make_uint2(0, 0);
}

/* One 16-token tile as a lane loads it: its code words of rows g and g + 8, sigma and beta. */
template <int WPL>
struct tile_in {
	uint32_t wa[WPL], wb[WPL];
	uint32_t sa, sb, ba, bb;
};

/* A tile's rows ra and ra + 8, zero past n (FULL: the caller knows both lie below n, and nothing is
 * tested). */
template <int D, int WPL, bool FULL>
static __device__ __forceinline__ void load_tile(tile_in<WPL> &x, const uint32_t *codes,
						 const uint16_t *sig, const uint16_t *bet,
						 uint32_t ra, uint32_t n, uint32_t off)
{
	constexpr int W = D / 32;
	const uint32_t rb = ra + 8;
	const bool ia = FULL || ra < n, ib = FULL || rb < n;
#pragma unroll
	for (int w = 0; w < WPL; w++) {
		x.wa[w] = ia ? __ldg(codes + (size_t)ra * W + off + w) : 0u;
		x.wb[w] = ib ? __ldg(codes + (size_t)rb * W + off + w) : 0u;
	}
	x.sa = ia ? __ldg(sig + ra) : 0u;
	x.sb = ib ? __ldg(sig + rb) : 0u;
	x.ba = ia ? __ldg(bet + ra) : 0u;
	x.bb = ib ? __ldg(bet + rb) : 0u;
}

/* A warp's SC_TILES tiles of the chunk at base, untested when the whole chunk lies below n (a
 * choice uniform over the block). */
template <int D, int WPL>
static __device__ __forceinline__ void load_chunk(tile_in<WPL> (&x)[SC_TILES],
						  const uint32_t *codes, const uint16_t *sig,
						  const uint16_t *bet, uint32_t base, uint32_t row0,
						  uint32_t n, uint32_t off)
{
	if (base + SC_TOKENS <= n) {
#pragma unroll
		for (int k = 0; k < SC_TILES; k++)
			load_tile<D, WPL, true>(x[k], codes, sig, bet, base + row0 + 16 * k, n,
						off);
	} else {
#pragma unroll
		for (int k = 0; k < SC_TILES; k++)
			load_tile<D, WPL, false>(x[k], codes, sig, bet, base + row0 + 16 * k, n,
						 off);
	}
}

/* The scores of one tile for n-tile nt (accumulators c) into out, rows ra and ra + 8, and into
 * the running statistics of their query head (stat(score, row)). */
template <typename Stat>
static __device__ __forceinline__ void finish(const int (&c)[4], const float4 &kq, const float *sg,
					      const float *bt, const float *pbf, float *outq,
					      uint32_t ra, uint32_t n, Stat &&stat)
{
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const uint32_t row = ra + 8 * r;
		if (row >= n)
			continue;
		const float bu = small_u2f((uint32_t)c[2 * r] >> 4);
		const float E =
			__fadd_rn(__fadd_rn(__fmul_rn(kq.x, bu), __fmul_rn(kq.y, pbf[r])), kq.z);
		const float v = __fadd_rn(__fadd_rn(__fmul_rn(sg[r], E), bt[r]), kq.w);
		outq[row] = v;
		stat(v, row);
	}
}

/* Score f into a query head's shared slots (scanbins.h), when it is binned. */
static __device__ __forceinline__ void bin_score(float f, float scale, uint32_t *count,
						 uint32_t *dsum)
{
	uint32_t slot, dv;
	if (kvt_bins_of(f, scale, &slot, &dv)) {
		atomicAdd(&count[slot], 1u);
		atomicAdd(&dsum[slot], dv);
	}
}

/* Bytes of dynamic shared memory the scan's histogram takes (BINS): a count and a sum of D per slot
 * and query head, for four heads (BINS needs ONE). */
#define SC_BINS_SMEM (4 * KVT_BINS * 8)

/* ONE: the group fits one n-tile (G <= 4), so operand B and the query constants stay in registers.
 * BINS (with ONE): every score is binned too (scanbins.h), in shared memory, and each block adds
 * its nonzero slots into bins' at its end. */
template <int D, bool ONE, bool BINS>
static __global__ void __launch_bounds__(SC_WARPS * 32, D == 256 ? 2 : SC_MIN_BLOCKS)
	k_score(const kvt_gpu_qcode *qc, const kvt_gpu_index_view *views, const uint32_t *n_tokens,
		uint32_t max_n, uint32_t hq, uint32_t hkv, float *scores, size_t ld,
		kvt_gpu_segstats *stats, unsigned long long *err, kvt_gpu_bins bins)
{
	static_assert(!BINS || ONE, "the histogram is built for groups of at most four heads");
	constexpr int S = D / 32, W = D / 32, WPL = D == 256 ? 2 : 1;
	extern __shared__ uint4 bins_sh[]; /* BINS: [4][KVT_BINS] counts, then [4][KVT_BINS] sums */
	uint32_t *bcount = (uint32_t *)bins_sh, *bsum = bcount + 4 * KVT_BINS;
	__shared__ uint2 bfrag[ONE ? 1 : SC_MAX_NT][ONE ? 1 : S][32];
	__shared__ float4 qk[ONE ? 1 : KVT_GPU_MAX_GROUP];
	/* the block's statistics per query head, merged in shared memory so that a block adds each
	 * head's once to the device's (all blocks of a segment end together, on the same words) */
	__shared__ kvt_gpu_segstats sst[ONE ? 4 : KVT_GPU_MAX_GROUP];
	const uint32_t item = blockIdx.y, seq = item / hkv, h = item % hkv, G = hq / hkv;
	const uint32_t NT = ONE ? 1 : (G + 3) / 4;
	const uint32_t n = n_tokens[seq];
	const kvt_gpu_index_view v = views[seq];
	if (n > max_n || n > v.cap) {
		if (blockIdx.x == 0 && threadIdx.x == 0)
			kvt_d_range(err, KVT_GPU_SITE_SCORE_N, item, n);
		return;
	}
	if (blockIdx.x * SC_TOKENS >= n)
		return;
	const kvt_gpu_qcode *q0 = qc + (size_t)seq * hq + (size_t)h * G;
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2,
		       t = lane & 3;

	uint2 breg[S];
	float4 kreg = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
	if (ONE) {
#pragma unroll
		for (int s = 0; s < S; s++)
			breg[s] = b_frag<D>(q0, G, 0, s, lane);
		if (t < G)
			kreg = make_float4(q0[t].A, q0[t].B, q0[t].C, q0[t].qc_ck);
	} else {
		for (uint32_t e = threadIdx.x; e < NT * S * 32; e += blockDim.x)
			bfrag[e / (32 * S)][(e / 32) % S][e % 32] =
				b_frag<D>(q0, G, e / (32 * S), (int)((e / 32) % S), e % 32);
		for (uint32_t c = threadIdx.x; c < G; c += blockDim.x)
			qk[c] = make_float4(q0[c].A, q0[c].B, q0[c].C, q0[c].qc_ck);
	}
	for (uint32_t c = threadIdx.x; c < (ONE ? 4u : G); c += blockDim.x)
		sst[c] = kvt_gpu_segstats{0, 0, 0, 0};
	if (BINS)
		for (uint32_t e = threadIdx.x; e < SC_BINS_SMEM / 16; e += blockDim.x)
			bins_sh[e] = make_uint4(0, 0, 0, 0);
	__syncthreads();
	kvt_d_frange fr; /* ONE: the range of this lane's query head's scores, q = t */
	uint32_t *const hc = bcount + t * KVT_BINS, *const hs = bsum + t * KVT_BINS; /* its slots */
	uint32_t mask[S];
#pragma unroll
	for (int s = 0; s < S; s++)
		mask[s] = 0x01010101u << lane_shift<D>(t, s);

	const uint32_t *codes = v.codes + (size_t)h * v.cap * W;
	const uint16_t *sig = v.sigma + (size_t)h * v.cap, *bet = v.beta + (size_t)h * v.cap;
	float *out = scores + ((size_t)seq * hq + (size_t)h * G) * ld;
	const uint32_t off = D == 64 ? t >> 1 : D == 128 ? t : 2 * t;
	const uint32_t stride = gridDim.x * SC_TOKENS;

	/* software pipeline: the next chunk's tiles load while this chunk's are computed */
	tile_in<WPL> cur[SC_TILES], nxt[SC_TILES];
	const uint32_t row0 = warp * SC_TILES * 16 + g; /* this lane's first row in a chunk */
	uint32_t base = blockIdx.x * SC_TOKENS;
	load_chunk<D, WPL>(cur, codes, sig, bet, base, row0, n, off);
	for (; base < n; base += stride) {
		load_chunk<D, WPL>(nxt, codes, sig, bet, base + stride, row0, n, off);
#pragma unroll
		for (int k = 0; k < SC_TILES; k++) {
			const tile_in<WPL> &x = cur[k];
			const uint32_t ra = base + row0 + 16 * k;
			const float sg[2] = {h2f(x.sa), h2f(x.sb)}, bt[2] = {h2f(x.ba), h2f(x.bb)};
			uint32_t a4[WPL], b4[WPL];
#pragma unroll
			for (int w = 0; w < WPL; w++) {
				a4[w] = x.wa[w] >> 4;
				b4[w] = x.wb[w] >> 4;
			}
			float pbf[2] = {0.0f, 0.0f};
			for (uint32_t nt = 0; nt < NT; nt++) {
				int c[4] = {0, 0, 0, 0};
#pragma unroll
				for (int s = 0; s < S; s++) {
					const int w = D == 256 ? s >> 2 : 0;
					const uint2 b =
						ONE ? breg[s]
						    : bfrag[ONE ? 0 : nt][ONE ? 0 : s][lane];
					mma_u8(c, x.wa[w] & mask[s], x.wb[w] & mask[s],
					       a4[w] & mask[s], b4[w] & mask[s], b.x, b.y);
				}
				/* column 7, held by the quad's last lane: the popcounts */
				if (nt == 0) {
					const int pa =
						__shfl_sync(0xffffffffu, c[1], (int)(lane | 3u));
					const int pb =
						__shfl_sync(0xffffffffu, c[3], (int)(lane | 3u));
					pbf[0] = small_u2f((uint32_t)pa >> 4);
					pbf[1] = small_u2f((uint32_t)pb >> 4);
				}
				const uint32_t q = nt * 4 + t;
				if (ONE) {
					if (q < G)
						finish(c, kreg, sg, bt, pbf, out + (size_t)q * ld,
						       ra, n, [&](float f, uint32_t) {
							       kvt_d_frange_add(fr, f);
							       if (BINS)
								       bin_score(f, bins.scale, hc,
										 hs);
						       });
				} else {
					uint32_t tst[3] = {0, 0, 0};
					if (q < G)
						finish(c, qk[q], sg, bt, pbf, out + (size_t)q * ld,
						       ra, n, [&](float f, uint32_t row) {
							       kvt_d_stat(f, row, &tst[0], &tst[1],
									  &tst[2]);
						       });
					kvt_d_stat_flush(tst[0], tst[1], tst[2], 4,
							 q < G ? &sst[q] : NULL);
				}
			}
		}
#pragma unroll
		for (int k = 0; k < SC_TILES; k++)
			cur[k] = nxt[k];
	}
	kvt_gpu_segstats *gs = stats ? stats + (size_t)seq * hq + (size_t)h * G : NULL;
	if (ONE) {
		uint32_t st[3] = {0, 0, 0};
		if (t < G && !kvt_d_frange_stat(fr, &st[0], &st[1])) {
			/* a score that is not finite: this lane's rows again, from its own writes
			 * (plain loads: the read-only path need not see this kernel's stores), for
			 * kvt_d_stat's position of the first */
			const float *outq = out + (size_t)t * ld;
			for (uint32_t b = blockIdx.x * SC_TOKENS; b < n; b += stride)
				for (uint32_t r = 0; r < 2 * SC_TILES; r++) {
					const uint32_t row = b + row0 + 8 * r;
					if (row < n)
						kvt_d_stat(outq[row], row, &st[0], &st[1], &st[2]);
				}
		}
		/* lanes 0-3 (t = lane) hold their query head's, after the reduction */
		kvt_d_stat_flush(st[0], st[1], st[2], 4, t < G ? &sst[t] : NULL);
	}
	__syncthreads();
	for (uint32_t c = threadIdx.x; gs && c < G; c += blockDim.x)
		kvt_d_stat_add(sst[c].max_key, sst[c].nmin_key, sst[c].bad, &gs[c]);
	if (BINS) { /* the block's nonzero slots into the segments' */
		const size_t at = ((size_t)seq * hq + (size_t)h * G) * KVT_BINS;
		for (uint32_t e = threadIdx.x; e < G * KVT_BINS; e += blockDim.x) {
			const uint32_t k = bcount[e];
			if (k) {
				atomicAdd(&bins.count[at + e], k);
				atomicAdd(&bins.dsum[at + e], (unsigned long long)bsum[e]);
			}
		}
	}
}

/* ---- launchers --------------------------------------------------------------------------- */

template <int D, int DT>
static int prepare(uint32_t blocks, uint32_t hq, uint32_t group, const float *rot, const void *q,
		   const float *const *c_q, const float *const *c_k, kvt_gpu_qcode *out,
		   cudaStream_t s)
{
	k_prepare<D, DT><<<blocks, D, 0, s>>>(rot, q, c_q, c_k, hq, group, out);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_query_prepare(uint32_t d, uint32_t dtype, uint32_t n_seqs,
				     uint32_t n_q_heads, uint32_t n_kv_heads, const float *rot,
				     const void *q, const float *const *c_q,
				     const float *const *c_k, kvt_gpu_qcode *out, void *stream)
{
	if (!rot || !q || !c_q || !c_k || !out || n_kv_heads == 0 || n_q_heads % n_kv_heads)
		return -EINVAL;
	if ((uint64_t)n_seqs * n_q_heads > 0x7fffffffu)
		return -EINVAL;
	if (dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16)
		return -EOPNOTSUPP;
	const uint32_t blocks = n_seqs * n_q_heads, group = n_q_heads / n_kv_heads;
	if (blocks == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE(dtype, DT, {
		return prepare<D, DT>(blocks, n_q_heads, group, rot, q, c_q, c_k, out, s);
	}));
}

template <int D, bool ONE, bool BINS>
static int score_g(uint32_t n_seqs, uint32_t hq, uint32_t hkv, const kvt_gpu_qcode *qc,
		   const kvt_gpu_index_view *views, const uint32_t *n_tokens, uint32_t max_n,
		   float *scores, size_t ld, kvt_gpu_segstats *stats, unsigned long long *err,
		   const kvt_gpu_bins &bins, cudaStream_t s)
{
	/* one wave of resident blocks, each looping over its share of the chunks, so that the
	 * per-block setup (the B fragments) is paid once per block rather than once per chunk */
	/* blocks per SM, computed once per device: the shared memory limit is a context's setting
	 * and the occupancy a device model's (a racing first call computes it twice, and sets the
	 * limit twice; a device past the table computes it every call) */
	enum { OCC_DEVICES = 64 };
	static int occupancy[OCC_DEVICES];
	const int smem = BINS ? SC_BINS_SMEM : 0;
	int dev = 0, sms = 0, per_sm = 0;
	KVT_CU(cudaGetDevice(&dev));
	if (dev >= 0 && dev < OCC_DEVICES)
		per_sm = __atomic_load_n(&occupancy[dev], __ATOMIC_RELAXED);
	KVT_CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	if (per_sm == 0) {
		if (BINS)
			KVT_CU(cudaFuncSetAttribute(k_score<D, ONE, BINS>,
						    cudaFuncAttributeMaxDynamicSharedMemorySize,
						    smem));
		KVT_CU(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_score<D, ONE, BINS>,
								     SC_WARPS * 32, smem));
		if (dev >= 0 && dev < OCC_DEVICES)
			__atomic_store_n(&occupancy[dev], per_sm, __ATOMIC_RELAXED);
	}
	const uint32_t items = n_seqs * hkv, chunks = (max_n + SC_TOKENS - 1) / SC_TOKENS;
	/* blocks per item: as many as fit one wave together, rounded down: the blocks of an item
	 * take its chunks in turn, so all carry about the same work, and a block past the wave
	 * would start only when one ends (rounded up, 64 or 128 items left 48 or 112 blocks for
	 * a second wave on the H200) */
	const uint32_t wave = (uint32_t)(sms * (per_sm > 0 ? per_sm : 1));
	uint32_t fill = wave / items ? wave / items : 1;
	/* the histogram: enough blocks that none bins more than KVT_BINS_BLOCK_TOKENS tokens */
	const uint32_t per_block = KVT_BINS_BLOCK_TOKENS / SC_TOKENS;
	if (BINS && fill < (chunks + per_block - 1) / per_block)
		fill = (chunks + per_block - 1) / per_block;
	const dim3 grid(chunks < fill ? chunks : fill, items);
	k_score<D, ONE, BINS><<<grid, SC_WARPS * 32, smem, s>>>(qc, views, n_tokens, max_n, hq, hkv,
								scores, ld, stats, err, bins);
	KVT_CU_LAUNCHED();
	return 0;
}

template <int D>
static int score_d(uint32_t n_seqs, uint32_t hq, uint32_t hkv, const kvt_gpu_qcode *qc,
		   const kvt_gpu_index_view *views, const uint32_t *n_tokens, uint32_t max_n,
		   float *scores, size_t ld, kvt_gpu_segstats *stats, unsigned long long *err,
		   const kvt_gpu_bins *bins, cudaStream_t s)
{
	if (bins)
		return score_g<D, true, true>(n_seqs, hq, hkv, qc, views, n_tokens, max_n, scores,
					      ld, stats, err, *bins, s);
	const kvt_gpu_bins none = {}; /* no ring */
	if (hq / hkv <= 4)
		return score_g<D, true, false>(n_seqs, hq, hkv, qc, views, n_tokens, max_n, scores,
					       ld, stats, err, none, s);
	return score_g<D, false, false>(n_seqs, hq, hkv, qc, views, n_tokens, max_n, scores, ld,
					stats, err, none, s);
}

extern "C" int kvt_gpu_score(uint32_t d, uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
			     const kvt_gpu_qcode *qc, const kvt_gpu_index_view *views,
			     const uint32_t *n_tokens, uint32_t max_n, float *scores, size_t ld,
			     kvt_gpu_segstats *stats, const kvt_gpu_bins *bins,
			     unsigned long long *err, void *stream)
{
	if (!qc || !views || !n_tokens || !scores || n_kv_heads == 0 || n_q_heads % n_kv_heads)
		return -EINVAL;
	if (bins && (!bins->count || !bins->dsum || !(bins->scale > 0.0f) ||
		     bins->scale == INFINITY))
		return -EINVAL;
	if (bins && n_q_heads / n_kv_heads > 4)
		return -EOPNOTSUPP;
	if (n_q_heads / n_kv_heads > KVT_GPU_MAX_GROUP || (uint64_t)n_seqs * n_kv_heads > 65535)
		return -EINVAL;
	if (ld % 4 || max_n > ld)
		return -EINVAL;
	if (!kvt_is_pow2_dim(d))
		return -EOPNOTSUPP;
	if (n_seqs == 0 || max_n == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	KVT_DISPATCH_HEAD_DIM(d, D, {
		return score_d<D>(n_seqs, n_q_heads, n_kv_heads, qc, views, n_tokens, max_n, scores,
				  ld, stats, err, bins, s);
	});
}
