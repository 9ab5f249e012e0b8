/* SPDX-License-Identifier: MIT */
/*
 * Exact attention over gathered rows (split over chunks of rows, then merged).
 *
 * A row group of d/8 lanes reads one row with one 16-byte load of K and one of V per lane, so a
 * warp covers 4, 2 or 1 rows (d 64, 128, 256) with fully used 512-byte transactions, and each lane
 * keeps the 8 output dimensions it loads. Several rows per group are loaded before any is used:
 * rows read over PCIe from mapped host memory take microseconds, and only many requests in flight
 * hide that. Query heads of the group (up to 8 per block, more through grid.z) share every load.
 * A block first reads its chunk's row addresses all at once into shared memory, so that a row
 * costs one memory latency, not two (its address, then its bytes). A group's partial dots are
 * reduce-scattered over its lanes, so each lane finishes a few dots and computes their weights,
 * which it then hands to the others; logits are in base 2, an exponential one ex2.approx.
 */
#include "attend.cuh"
#include "common.cuh"
#include "graph.cuh"

#define AT_THREADS 256
#define AT_CHUNK 64u /* rows per block and sweep: a decode step's few thousand rows per item
			  * then spread over tens of blocks per item, not a handful */
#ifndef AT_UNROLL /* compile-time, for an A/B */
#define AT_UNROLL 4   /* rows per group in flight */
#endif
/* compile-time, for an A/B: blocks per multiprocessor the registers are held to (unset: the
 * compiler's choice, 128 registers at d 128 and four query heads per block, so two blocks) */
#ifdef AT_MIN_BLOCKS
#define AT_BOUNDS __launch_bounds__(AT_THREADS, AT_MIN_BLOCKS)
#else
#define AT_BOUNDS __launch_bounds__(AT_THREADS)
#endif
#define AT_MAX_CHUNKS 2048u /* chunks_of's largest (k_merge keeps their maxima in shared memory) */
#define AT_MERGE_AHEAD 32u  /* chunks whose partials k_merge loads before using any: a decode
			     * step's item has about a hundred */
#ifndef AT_GRID_BLOCKS
#define AT_GRID_BLOCKS 512u /* chunks_of keeps an attention launch near this many blocks: at
			    * 128K x 1 on the H200, 512 took gather + attend from 68 to 57 us
			    * against 2048 (fewer, fuller blocks; the same rows) */
#endif
#ifndef AT_MAX_GB /* compile-time, for an A/B: fewer heads a block, fewer registers, more loads */
#define AT_MAX_GB 8 /* query heads a block at most (dispatch_group) */
#endif
#ifndef AT_MERGE_SLICES
#define AT_MERGE_SLICES 4 /* groups of D threads that k_merge splits an item's chunks among: with
			   * 512 blocks, 4 took gather + attend from 57 to 52 us against 1 */
#endif

/* 2^x in one instruction (ex2.approx: relative error about 2^-22; -inf gives 0). Results below
 * 2^-126 flush to 0, which sums whose largest weight is 1 cannot see. */
static __device__ __forceinline__ float ex2(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
	return y;
}

/* c ? x : y on values: a plain ?: between two elements of a register array may become a select
 * of their addresses, which puts the array in local memory */
static __device__ __forceinline__ float pick(bool c, float x, float y)
{
	float r;
	asm("{ .reg .pred p; setp.ne.b32 p, %3, 0; selp.f32 %0, %1, %2, p; }"
	    : "=f"(r)
	    : "f"(x), "f"(y), "r"((int)c));
	return r;
}

/*
 * The reduce-scatter of N dots over a row group's lanes, from the level of c dots a lane and
 * partner distance o down to `stop` dots a lane: each level keeps the half of the dots that the
 * lane bit o names and adds the partner's copy of that half. N - stop shuffles in all, where
 * summing every dot in every lane takes N log2(lanes). Lane li ends with the dots from
 * (li / o_last) * stop on, o_last the last level's distance.
 */
template <int N, int c, int o, int stop>
static __device__ __forceinline__ void reduce_scatter(float (&v)[N], uint32_t li)
{
	if constexpr (c > stop) {
		const bool up = li & o;
#pragma unroll
		for (int k = 0; k < c / 2; k++) {
			const float send = pick(up, v[k], v[k + c / 2]),
				    keep = pick(up, v[k + c / 2], v[k]);
			v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
		}
		reduce_scatter<N, c / 2, o / 2, stop>(v, li);
	}
}

static __device__ __forceinline__ const char *row_ptr(const kvt_gpu_rows &it, uint32_t i)
{
	if (it.rows)
		return (const char *)it.rows[i];
	return (const char *)it.base + (uint64_t)(it.pos ? it.pos[i] : i) * it.stride;
}

template <int D, int DT, int GB>
static __global__ void AT_BOUNDS
	k_attend(const void *q, const kvt_gpu_rows *items, uint32_t hq, uint32_t hkv, float scale,
		 uint32_t max_rows, uint32_t chunks, float *part, unsigned long long *err)
{
	constexpr int LPR = D / 8, GROUPS = AT_THREADS / LPR;
	/* A sweep gives a row group J dots, (query head, row), each split over the group's LPR
	 * lanes. A reduce-scatter leaves each lane C whole dots, the same in SPAN lanes; a lane's
	 * dots cover HPL heads, PH rows of each. */
	constexpr int U = AT_UNROLL, J = U * GB, K = J < LPR ? J : LPR, C = J / K, SPAN = LPR / K;
	constexpr int PH = C < U ? C : U, HPL = C / PH;
	static_assert((U & (U - 1)) == 0 && (LPR & (LPR - 1)) == 0, "powers of two");
	constexpr int HB = GB < 4 ? GB : 4; /* query heads merged at once at the end: 32 KB */
	__shared__ float sm_m[HB][GROUPS], sm_l[HB][GROUPS];
	__shared__ float sm_acc[HB][GROUPS][D];
	__shared__ const char *rp[AT_CHUNK]; /* the chunk's row addresses, loaded by all at once */
	const uint32_t item = blockIdx.y, seq = item / hkv, h = item % hkv, G = hq / hkv;
	const uint32_t g0 = blockIdx.z * GB, ng = min((uint32_t)GB, G - g0);
	const uint32_t tid = threadIdx.x, grp = tid / LPR, li = tid % LPR, blk = li / SPAN;
	/* the merge (a programmatic dependent launch) may be scheduled once every block has
	 * started; it waits for this kernel's end before it reads */
	KVT_PDL_TRIGGER();
	const kvt_gpu_rows it = items[item];
	uint32_t n = it.n;
	if (it.reserved & KVT_GPU_ROWS_SKIP)
		return; /* a padded slot of a graph step: its output is left as it was */
	if (n > max_rows) {
		if (blockIdx.x == 0 && blockIdx.z == 0 && tid == 0)
			kvt_d_range(err, KVT_GPU_SITE_ATTEND_ROWS, item, n);
		n = 0;
	}
	if (blockIdx.x * AT_CHUNK >= n)
		return; /* the merge reads only the blocks that hold rows */

	/* the query times scale log2(e): logits, maxima and the partials' M in base 2 */
	float qv[GB][8], m[GB], l[GB], acc[GB][8];
	const float qs = scale * 1.44269504088896341f;
#pragma unroll
	for (int g = 0; g < GB; g++) {
		const size_t at = ((size_t)seq * hq + (size_t)h * G + g0 + g) * D + 8 * li;
		if ((uint32_t)g < ng)
			kvt_d_unpack8<DT>(*(const uint4 *)((const uint16_t *)q + at), qv[g]);
		else
#pragma unroll
			for (int e = 0; e < 8; e++)
				qv[g][e] = 0.0f;
#pragma unroll
		for (int e = 0; e < 8; e++)
			qv[g][e] *= qs;
		m[g] = -INFINITY;
		l[g] = 0.0f;
#pragma unroll
		for (int e = 0; e < 8; e++)
			acc[g][e] = 0.0f;
	}

	/* chunks blockIdx.x, + gridDim.x, ...: a block's running maximum spans all of them */
	for (uint32_t r0 = blockIdx.x * AT_CHUNK; r0 < n; r0 += gridDim.x * AT_CHUNK) {
	const uint32_t r1 = min(r0 + AT_CHUNK, n);
	__syncthreads(); /* the last chunk's addresses are read */
	for (uint32_t i = tid; i < r1 - r0; i += AT_THREADS)
		rp[i] = row_ptr(it, r0 + i);
	__syncthreads();
	/* the bound is uniform over the warp: the shuffles below need every lane */
	for (uint32_t r = r0 + grp, base = r0; base < r1;
	     r += GROUPS * U, base += GROUPS * U) {
		uint4 kb[U], vb[U];
#pragma unroll
		for (int u = 0; u < U; u++) {
			const uint32_t rr = r + u * GROUPS;
			if (rr < r1) {
				const char *p = rp[rr - r0];
				kb[u] = *(const uint4 *)(p + 16 * li);
				vb[u] = *(const uint4 *)(p + 2 * D + 16 * li);
			} else {
				kb[u] = vb[u] = make_uint4(0, 0, 0, 0);
			}
		}
		/* v[g * U + u]: head g's partial dot with row r + u * GROUPS, over this lane's 8
		 * dimensions; then the reduce-scatter, the row group's maxima and weights */
		float v[J];
#pragma unroll
		for (int u = 0; u < U; u++) {
			float kf[8];
			kvt_d_unpack8<DT>(kb[u], kf);
#pragma unroll
			for (int g = 0; g < GB; g++) {
				float dot = 0.0f;
#pragma unroll
				for (int e = 0; e < 8; e++)
					dot = fmaf(qv[g][e], kf[e], dot);
				v[g * U + u] = dot;
			}
		}
		reduce_scatter<J, J, LPR / 2, C>(v, li);
#pragma unroll
		for (int o = SPAN / 2; o; o /= 2)
#pragma unroll
			for (int k = 0; k < C; k++)
				v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
		/* the lane's dots are j = blk * C + k: head j / U, row j % U */
		float mx[HPL];
#pragma unroll
		for (int k = 0; k < C; k++)
			if (r + (blk * C + k) % U * GROUPS >= r1)
				v[k] = -INFINITY;
#pragma unroll
		for (int hh = 0; hh < HPL; hh++) {
			float x = -INFINITY;
#pragma unroll
			for (int k = hh * PH; k < (hh + 1) * PH; k++)
				x = fmaxf(x, v[k]);
#pragma unroll
			for (int o = SPAN; o < SPAN * (U / PH); o *= 2) /* the head's other rows */
				x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
			mx[hh] = x;
		}
#pragma unroll
		for (int g = 0; g < GB; g++) {
			const float xg = __shfl_sync(0xffffffffu, mx[(g * U % C) / PH],
						     (g * U / C) * SPAN, LPR);
			const float mn = fmaxf(m[g], xg);
			if (mn == -INFINITY)
				continue;
			const float corr = ex2(m[g] - mn);
			l[g] *= corr;
#pragma unroll
			for (int e = 0; e < 8; e++)
				acc[g][e] *= corr;
			m[g] = mn;
		}
		/* one weight a dot, in the lane that holds it (-inf: 0); m is -inf only where every
		 * dot of the head so far is */
		float w[C];
#pragma unroll
		for (int k = 0; k < C; k++) {
			const uint32_t gk = (blk * C + k) / U;
			float mg = m[0];
#pragma unroll
			for (int g = 1; g < GB; g++)
				mg = pick(gk == (uint32_t)g, m[g], mg);
			w[k] = ex2(v[k] - (mg == -INFINITY ? 0.0f : mg));
		}
#pragma unroll
		for (int u = 0; u < U; u++) {
			float vf[8];
			kvt_d_unpack8<DT>(vb[u], vf);
#pragma unroll
			for (int g = 0; g < GB; g++) {
				const int j = g * U + u;
				const float wj =
					__shfl_sync(0xffffffffu, w[j % C], (j / C) * SPAN, LPR);
				l[g] += wj;
#pragma unroll
				for (int e = 0; e < 8; e++)
					acc[g][e] = fmaf(wj, vf[e], acc[g][e]);
			}
		}
	}
	}

	/* merge the row groups of the block, HB query heads at a time (the partials of a head take
	 * GROUPS x D = 2048 floats of shared memory at any D): one barrier a batch of heads, and
	 * every thread merges (head, dimension) pairs */
#pragma unroll
	for (int gb = 0; gb < GB; gb += HB) {
		if ((uint32_t)gb >= ng)
			break;
#pragma unroll
		for (int hb = 0; hb < HB; hb++) {
			if (li == 0) {
				sm_m[hb][grp] = m[gb + hb];
				sm_l[hb][grp] = l[gb + hb];
			}
#pragma unroll
			for (int e = 0; e < 8; e++)
				sm_acc[hb][grp][8 * li + e] = acc[gb + hb][e];
		}
		__syncthreads();
		for (uint32_t o = tid; o < HB * D; o += AT_THREADS) {
			const uint32_t hb = o / D, dd = o % D, g = gb + hb;
			if (g >= ng)
				break; /* o only grows */
			float M = -INFINITY;
			for (int k = 0; k < GROUPS; k++)
				M = fmaxf(M, sm_m[hb][k]);
			float L = 0.0f, a = 0.0f;
			for (int k = 0; k < GROUPS; k++) {
				if (sm_m[hb][k] == -INFINITY)
					continue;
				const float f = ex2(sm_m[hb][k] - M);
				L = fmaf(f, sm_l[hb][k], L);
				a = fmaf(f, sm_acc[hb][k][dd], a);
			}
			float *dst = part +
				     (((size_t)item * chunks + blockIdx.x) * G + g0 + g) * (D + 2);
			dst[2 + dd] = a;
			if (dd == 0) {
				dst[0] = M;
				dst[1] = L;
			}
		}
		if (gb + HB < GB)
			__syncthreads(); /* the next batch reuses the shared partials */
	}
}

/* Merge the chunks of one (item, query head) and convert to the output type. The chunks' maxima
 * are read by all threads at once into shared memory and their maximum reduced across the block
 * (not walked by every thread). The chunks are then cut into S consecutive slices, one per group
 * of D threads; each thread sums its dimension over its slice's chunks in their order, its loads
 * AT_MERGE_AHEAD / S chunks ahead, at least 8 (a dependent load per chunk made this kernel a
 * chain of memory latencies), and the first group adds the slices' sums in slice order. S = 1 is
 * the sequential merge. Launched as a dependent of k_attend: its blocks are placed while
 * k_attend's last ones run, and wait for its end. */
template <int D, int S>
static __global__ void __launch_bounds__(D * S)
	k_merge(const kvt_gpu_rows *items, uint32_t hq, uint32_t hkv, uint32_t max_rows,
		uint32_t chunks, const float *part, uint32_t out_dtype, void *out)
{
	__shared__ float ms[AT_MAX_CHUNKS];
	const uint32_t item = blockIdx.x / (hq / hkv), g = blockIdx.x % (hq / hkv);
	const uint32_t tid = threadIdx.x, j = tid % D, sl = tid / D;
	const uint32_t G = hq / hkv, seq = item / hkv, h = item % hkv;
	KVT_PDL_WAIT(); /* k_attend's partials are complete and visible past here */
	if (items[item].reserved & KVT_GPU_ROWS_SKIP)
		return;
	const uint32_t n = items[item].n > max_rows ? 0 : items[item].n;
	const uint32_t used = min((n + AT_CHUNK - 1) / AT_CHUNK, chunks);
	const float *p0 = part + ((size_t)item * chunks * G + g) * (D + 2);
	const size_t stride = (size_t)G * (D + 2); /* from one chunk to the next */
	__shared__ float wmax[D * S / 32];
	float M = -INFINITY; /* the maximum over the chunks: any order gives the same value */
	for (uint32_t c = tid; c < used; c += D * S) {
		ms[c] = p0[c * stride];
		M = fmaxf(M, ms[c]);
	}
#pragma unroll
	for (int o = 16; o; o >>= 1)
		M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
	if (tid % 32 == 0)
		wmax[tid / 32] = M;
	__syncthreads();
#pragma unroll
	for (int w = 0; w < D * S / 32; w++)
		M = fmaxf(M, wmax[w]);
	const uint32_t per = (used + S - 1) / S, c_lo = min(sl * per, used),
		       c_hi = min(c_lo + per, used);
	float L = 0.0f, a = 0.0f;
	constexpr uint32_t AHEAD = AT_MERGE_AHEAD / S < 8 ? 8 : AT_MERGE_AHEAD / S;
	for (uint32_t c0 = c_lo; c0 < c_hi; c0 += AHEAD) {
		float lv[AHEAD], av[AHEAD];
#pragma unroll
		for (uint32_t k = 0; k < AHEAD; k++) {
			const bool in = c0 + k < c_hi;
			lv[k] = in ? p0[(c0 + k) * stride + 1] : 0.0f;
			av[k] = in ? p0[(c0 + k) * stride + 2 + j] : 0.0f;
		}
#pragma unroll
		for (uint32_t k = 0; k < AHEAD; k++) {
			if (c0 + k >= c_hi || ms[c0 + k] == -INFINITY)
				continue;
			const float f = ex2(ms[c0 + k] - M);
			L = fmaf(f, lv[k], L);
			a = fmaf(f, av[k], a);
		}
	}
	if (S > 1) {
		__shared__ float sum_l[S][D], sum_a[S][D];
		sum_l[sl][j] = L;
		sum_a[sl][j] = a;
		__syncthreads();
		if (sl)
			return;
		L = a = 0.0f;
#pragma unroll
		for (int k = 0; k < S; k++) {
			L += sum_l[k][j];
			a += sum_a[k][j];
		}
	}
	const float o = L > 0.0f ? a / L : 0.0f;
	kvt_d_store_out(out_dtype, out, ((size_t)seq * hq + (size_t)h * G + g) * D + j, o);
}

/* ---- launchers --------------------------------------------------------------------------- */

struct at_args {
	uint32_t hq, hkv, n_items, max_rows, chunks;
	float scale;
	const void *q;
	const kvt_gpu_rows *items;
	float *part;
	unsigned long long *err;
	cudaStream_t s;
};

/* Blocks per (item, query-head block): one per chunk of rows up to a cap that keeps the grid near
 * AT_GRID_BLOCKS blocks, so a launch sized for a large bound costs little when few rows come; a
 * block then takes every gridDim.x-th chunk. At least `floor` (chunks_floor). */
static uint32_t chunks_of(uint32_t n_items, uint32_t group, uint32_t max_rows, uint32_t floor)
{
	const uint32_t need = max_rows ? (max_rows + AT_CHUNK - 1) / AT_CHUNK : 1;
	const uint32_t z = group <= 8 ? 1 : (group + 7) / 8;
	const uint64_t per = (uint64_t)n_items * z;
	uint32_t cap = per ? (uint32_t)(AT_GRID_BLOCKS / per) : 1;
	cap = cap < floor ? floor : cap > AT_MAX_CHUNKS ? AT_MAX_CHUNKS : cap;
	return need < cap ? need : cap;
}

/* 16 chunks an item at least, 32 where the gather's grids widen (with AT_GRID_BLOCKS 512, a floor
 * of 32 binds past 16 items, 16 past 32). */
#define AT_FLOOR_WIDE 32u
static uint32_t chunks_floor(uint32_t n_items, uint32_t max_rows)
{
	return kvt_wide_grid(n_items, max_rows) ? AT_FLOOR_WIDE : 16u;
}

template <int D, int DT, int GB>
static int launch(const at_args &a)
{
	const uint32_t G = a.hq / a.hkv;
	const dim3 grid(a.chunks, a.n_items, (G + GB - 1) / GB);
	k_attend<D, DT, GB><<<grid, AT_THREADS, 0, a.s>>>(a.q, a.items, a.hq, a.hkv, a.scale,
							  a.max_rows, a.chunks, a.part, a.err);
	KVT_CU_LAUNCHED();
	return 0;
}

/* Query heads per block: the group rounded up to a power of two, at most AT_MAX_GB (grid.z covers
 * more). */
template <int D, int DT>
static int dispatch_group(const at_args &a)
{
	const uint32_t G = a.hq / a.hkv;
	if (G == 1 || AT_MAX_GB < 2)
		return launch<D, DT, 1>(a);
	if (G == 2 || AT_MAX_GB < 4)
		return launch<D, DT, 2>(a);
	if (G <= 4 || AT_MAX_GB < 8)
		return launch<D, DT, 4>(a);
	return launch<D, DT, 8>(a);
}

/* The attention of every (item, query head), then the merge of its chunks. */
template <int D, int DT>
static int attend(const at_args &a, uint32_t out_dtype, void *out)
{
	const int rc = dispatch_group<D, DT>(a);
	if (rc < 0)
		return rc;
	KVT_CU(kvt_launch_dependent(k_merge<D, AT_MERGE_SLICES>, dim3(a.n_items * (a.hq / a.hkv)),
				    D * AT_MERGE_SLICES, a.s, true,
				    a.items, a.hq, a.hkv, a.max_rows, a.chunks, a.part, out_dtype,
				    out));
	return 0;
}

extern "C" size_t kvt_gpu_attend_scratch_bytes(uint32_t n_seqs, uint32_t n_q_heads,
					       uint32_t n_kv_heads, uint32_t d, uint32_t max_rows)
{
	if (n_kv_heads == 0)
		return 0;
	/* the partials of a launch split as for any split_seqs >= n_seqs (a graph's): chunks_of
	 * never grows with the items at a fixed floor, and the largest floor bounds them all */
	return (size_t)n_seqs * n_q_heads *
	       chunks_of(n_seqs * n_kv_heads, n_q_heads / n_kv_heads, max_rows, AT_FLOOR_WIDE) *
	       (d + 2) * sizeof(float);
}

extern "C" int kvt_gpu_attend_split(uint32_t d, uint32_t dtype, uint32_t out_dtype,
				    uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				    float scale, const void *q, const kvt_gpu_rows *items,
				    uint32_t max_rows, uint32_t split_seqs, void *out, void *scratch,
				    size_t scratch_bytes, unsigned long long *err, void *stream)
{
	if (!q || !items || !out || !scratch || n_kv_heads == 0 || n_q_heads % n_kv_heads)
		return -EINVAL;
	if ((uint64_t)n_seqs * n_kv_heads > 65535 || (uint64_t)n_seqs * n_q_heads > 0x7fffffffu ||
	    (uint64_t)split_seqs * n_kv_heads > 65535 ||
	    !isfinite(scale) || ((uintptr_t)q & 15) || ((uintptr_t)scratch & 15))
		return -EINVAL;
	if (!kvt_is_pow2_dim(d) || (dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16) ||
	    (out_dtype != KVT_DTYPE_F32 && out_dtype != KVT_DTYPE_F16 &&
	     out_dtype != KVT_DTYPE_BF16))
		return -EOPNOTSUPP;
	if (scratch_bytes <
	    kvt_gpu_attend_scratch_bytes(n_seqs, n_q_heads, n_kv_heads, d, max_rows))
		return -EINVAL;
	if (n_seqs == 0 || n_q_heads == 0)
		return 0;
	const uint32_t split_items = (split_seqs > n_seqs ? split_seqs : n_seqs) * n_kv_heads;
	const at_args a = {
		.hq = n_q_heads,
		.hkv = n_kv_heads,
		.n_items = n_seqs * n_kv_heads,
		.max_rows = max_rows,
		.chunks = chunks_of(split_items, n_q_heads / n_kv_heads, max_rows,
				    chunks_floor(split_items, max_rows)),
		.scale = scale,
		.q = q,
		.items = items,
		.part = (float *)scratch,
		.err = err,
		.s = KVT_STREAM(stream),
	};
	KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE(dtype, DT, {
		return attend<D, DT>(a, out_dtype, out);
	}));
}

extern "C" int kvt_gpu_attend(uint32_t d, uint32_t dtype, uint32_t out_dtype, uint32_t n_seqs,
			      uint32_t n_q_heads, uint32_t n_kv_heads, float scale, const void *q,
			      const kvt_gpu_rows *items, uint32_t max_rows, void *out,
			      void *scratch, size_t scratch_bytes, unsigned long long *err,
			      void *stream)
{
	return kvt_gpu_attend_split(d, dtype, out_dtype, n_seqs, n_q_heads, n_kv_heads, scale, q,
				    items, max_rows, 0, out, scratch, scratch_bytes, err, stream);
}
