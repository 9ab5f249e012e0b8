/* SPDX-License-Identifier: MIT */
/*
 * Multi-token causal attention over staged rows (extend.cuh).
 *
 * k_stage copies a range of a sequence's rows from the host tier into dense K and V buffers, 16
 * bytes per lane, many rows in flight (the reads cross PCIe).
 *
 * k_extend: a block of 4 warps takes 64 query rows, the (query row, query head) pairs of one KV head
 * laid out row-major (pair r: query row r / G, head r % G), so the query heads of a group share
 * every K and V tile, and walks the staged keys 64 at a time up to its last row's position. Each
 * warp owns 16 pairs: S = Q K^T on the tensor cores (16 x 16 x 16 fragments, fp32 accumulation)
 * into shared memory; two lanes per pair mask, scale and take the online softmax step in fp32,
 * rescale the pair's output row (kept in shared memory, where its layout is known) and write the
 * probabilities in the input dtype; O += P V on the tensor cores. The state (maximum, sum, output)
 * carries over ranges through global memory.
 */
#include <mma.h>

#include "common.cuh"
#include "extend.cuh"

using namespace nvcuda;

#define EX_THREADS 128
#define EX_WARPS 4
#define EX_TILE KVT_GPU_EXTEND_TILE /* pairs per block */
#define EX_KEYS 64u                 /* keys per step */
#define ST_THREADS 256

static_assert(EX_WARPS * 16 == EX_TILE, "a warp per 16 pairs");

/* ---- staging ----------------------------------------------------------------------------- */

static __global__ void __launch_bounds__(ST_THREADS)
	k_stage(uint32_t lanes_per_half, void *const *blocks, uint32_t blk_cap, uint32_t row_bytes,
		uint32_t from, uint32_t to, uint4 *k, uint4 *v, size_t cap, unsigned long long *err)
{
	const uint32_t h = blockIdx.y, per_row = 2 * lanes_per_half;
	const uint64_t n = (uint64_t)(to - from) * per_row;
	for (uint64_t i = (uint64_t)blockIdx.x * ST_THREADS + threadIdx.x; i < n;
	     i += (uint64_t)gridDim.x * ST_THREADS) {
		const uint32_t r = (uint32_t)(i / per_row), e = (uint32_t)(i % per_row);
		const uint32_t pos = from + r;
		const char *b = (const char *)blocks[(size_t)h * blk_cap + pos / KVT_BLOCK_TOKENS];
		uint4 x = make_uint4(0, 0, 0, 0);
		if (b)
			x = *(const uint4 *)(b + (size_t)(pos % KVT_BLOCK_TOKENS) * row_bytes + 16 * e);
		else if (e == 0)
			kvt_d_range(err, KVT_GPU_SITE_STAGE_BLOCK, h, pos);
		const size_t at = ((size_t)h * cap + r) * lanes_per_half;
		if (e < lanes_per_half)
			k[at + e] = x;
		else
			v[at + e - lanes_per_half] = x;
	}
}

extern "C" int kvt_gpu_stage_rows(uint32_t d, uint32_t n_kv_heads, void *const *blocks,
				  uint32_t blk_cap, uint32_t row_bytes, uint32_t from, uint32_t to,
				  void *k, void *v, size_t cap, uint32_t max_blocks,
				  unsigned long long *err, void *stream)
{
	if (!blocks || !k || !v || d % 8 || row_bytes < 4 * d || row_bytes % 16 || to < from ||
	    cap < to - from || n_kv_heads == 0 || n_kv_heads > 65535 || ((uintptr_t)k & 15) ||
	    ((uintptr_t)v & 15))
		return -EINVAL;
	if (to == from)
		return 0;
	const uint64_t work = (uint64_t)(to - from) * (d / 4);
	uint64_t blocks_x = (work + ST_THREADS - 1) / ST_THREADS;
	const uint32_t most = max_blocks ? max_blocks : 1024;
	if (blocks_x > most)
		blocks_x = most;
	k_stage<<<dim3((uint32_t)blocks_x, n_kv_heads), ST_THREADS, 0, KVT_STREAM(stream)>>>(
		d / 8, blocks, blk_cap, row_bytes, from, to, (uint4 *)k, (uint4 *)v, cap, err);
	KVT_CU_LAUNCHED();
	return 0;
}

/* ---- attention --------------------------------------------------------------------------- */

template <int DT> struct ex_type;
template <> struct ex_type<KVT_DTYPE_F16> {
	typedef __half T;
	static __device__ __forceinline__ T of(float x) { return __float2half_rn(x); }
};
template <> struct ex_type<KVT_DTYPE_BF16> {
	typedef __nv_bfloat16 T;
	static __device__ __forceinline__ T of(float x) { return __float2bfloat16_rn(x); }
};

/* Shared memory of a block: Q, K and V tiles in the input type, then per warp S (fp32), P (input
 * type) and the output rows (fp32). Rows are padded by 16 bytes so that the fragments' rows fall
 * in different banks (a 256-byte stride would put all 16 in the same ones). */
template <int D> struct ex_ld {
	static constexpr uint32_t X = D + 8;        /* Q, K, V: elements */
	static constexpr uint32_t S = EX_KEYS + 4;  /* S: floats */
	static constexpr uint32_t P = EX_KEYS + 8;  /* P: elements */
	static constexpr uint32_t O = D + 4;        /* O: floats */
};

template <int D>
static constexpr size_t ex_smem()
{
	return (size_t)3 * EX_TILE * ex_ld<D>::X * 2 + (size_t)EX_WARPS * 16 * ex_ld<D>::S * 4 +
	       (size_t)EX_WARPS * 16 * ex_ld<D>::P * 2 + (size_t)EX_WARPS * 16 * ex_ld<D>::O * 4;
}

template <int D, int DT>
static __global__ void __launch_bounds__(EX_THREADS)
	k_extend(const void *q, uint32_t hq, uint32_t hkv, float scale, uint32_t n_rows,
		 uint32_t first, const void *k, const void *v, size_t cap, uint32_t r0,
		 uint32_t r1, float *state, int first_range, int last_range, uint32_t out_dtype,
		 void *out, float *part, uint32_t span)
{
	typedef typename ex_type<DT>::T T;
	typedef ex_ld<D> LD;
	extern __shared__ __align__(128) unsigned char smem[];
	T *sQ = (T *)smem, *sK = sQ + EX_TILE * LD::X, *sV = sK + EX_KEYS * LD::X;
	float *sS = (float *)(sV + EX_KEYS * LD::X);
	T *sP = (T *)(sS + EX_WARPS * 16 * LD::S);
	float *sO = (float *)(sP + EX_WARPS * 16 * LD::P);
	const uint32_t G = hq / hkv, h = blockIdx.y, tid = threadIdx.x, warp = tid / 32,
		       lane = tid % 32;
	const uint32_t pairs = n_rows * G, tile0 = blockIdx.x * EX_TILE;
	const bool split = gridDim.z > 1; /* this block's share of the keys goes to part */
	constexpr uint32_t V8 = D / 8;    /* 16-byte pieces of a row */

	/* the tile's queries, zeros past the last pair */
	for (uint32_t i = tid; i < EX_TILE * V8; i += EX_THREADS) {
		const uint32_t r = tile0 + i / V8, e = i % V8;
		uint4 x = make_uint4(0, 0, 0, 0);
		if (r < pairs)
			x = ((const uint4 *)q)[(((size_t)(r / G) * hq + h * G + r % G) * D) / 8 + e];
		*(uint4 *)(sQ + (size_t)(i / V8) * LD::X + 8 * e) = x;
	}
	/* this lane's pair and half of the columns */
	const uint32_t pr = lane / 2, half = lane % 2, pair = tile0 + warp * 16 + pr;
	const bool live = pair < pairs;
	const uint32_t P = live ? first + pair / G : 0; /* its last position */
	float *orow = sO + ((size_t)warp * 16 + pr) * LD::O;
	const bool resume = !first_range && !split;
	float m = -INFINITY, l = 0.0f;
	const size_t st = live ? ((size_t)(pair / G) * hq + h * G + pair % G) * (D + 2) : 0;
	if (resume && live) {
		m = state[st];
		l = state[st + 1];
	}
	for (uint32_t c = half * (D / 2); c < (half + 1) * (D / 2); c++)
		orow[c] = resume && live ? state[st + 2 + c] : 0.0f;

	/* keys up to the block's last pair's position, within the range and this block's share */
	const uint32_t last_pair = min(tile0 + EX_TILE, pairs) - 1;
	uint32_t kbeg = r0, kend = min(r1, first + last_pair / G + 1);
	if (split) {
		kbeg = r0 + blockIdx.z * span;
		kend = min(kend, kbeg + span);
	}
	const T *Kh = (const T *)k + (size_t)h * cap * D, *Vh = (const T *)v + (size_t)h * cap * D;
	__syncthreads();

	for (uint32_t kb = kbeg; kb < kend; kb += EX_KEYS) {
		for (uint32_t i = tid; i < EX_KEYS * V8; i += EX_THREADS) {
			const uint32_t r = i / V8, e = i % V8;
			uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
			if (kb + r < kend) {
				const size_t at = ((size_t)(kb - r0 + r) * D) / 8 + e;
				kx = ((const uint4 *)Kh)[at];
				vx = ((const uint4 *)Vh)[at];
			}
			*(uint4 *)(sK + (size_t)r * LD::X + 8 * e) = kx;
			*(uint4 *)(sV + (size_t)r * LD::X + 8 * e) = vx;
		}
		__syncthreads();

		/* S = Q K^T for this warp's 16 pairs */
		float *S = sS + (size_t)warp * 16 * LD::S;
#pragma unroll
		for (int n = 0; n < (int)(EX_KEYS / 16); n++) {
			wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
			wmma::fill_fragment(acc, 0.0f);
#pragma unroll
			for (int kk = 0; kk < D / 16; kk++) {
				wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
				wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
				wmma::load_matrix_sync(a, sQ + (size_t)warp * 16 * LD::X + kk * 16,
						       LD::X);
				wmma::load_matrix_sync(b, sK + (size_t)n * 16 * LD::X + kk * 16, LD::X);
				wmma::mma_sync(acc, a, b, acc);
			}
			wmma::store_matrix_sync(S + n * 16, acc, LD::S, wmma::mem_row_major);
		}
		__syncwarp();

		/* the online softmax step of this lane's pair over its 32 columns */
		const float *srow = S + (size_t)pr * LD::S + half * 32;
		float mx = -INFINITY;
		for (int c = 0; c < 32; c++) {
			const uint32_t kp = kb + half * 32 + c;
			if (live && kp <= P && kp < kend)
				mx = fmaxf(mx, srow[c] * scale);
		}
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
		const float mn = fmaxf(m, mx);
		const float alpha = mn == -INFINITY ? 1.0f : expf(m - mn);
		T *prow = sP + ((size_t)warp * 16 + pr) * LD::P + half * 32;
		float sum = 0.0f;
		for (int c = 0; c < 32; c++) {
			const uint32_t kp = kb + half * 32 + c;
			float w = 0.0f;
			if (live && kp <= P && kp < kend)
				w = expf(srow[c] * scale - mn);
			const T wt = ex_type<DT>::of(w);
			prow[c] = wt;
			sum += (float)wt; /* the sum of the weights V is multiplied by */
		}
		sum += __shfl_xor_sync(0xffffffffu, sum, 1);
		l = l * alpha + sum;
		m = mn;
		if (alpha != 1.0f)
			for (uint32_t c = half * (D / 2); c < (half + 1) * (D / 2); c++)
				orow[c] *= alpha;
		__syncwarp();

		/* O += P V */
		float *O = sO + (size_t)warp * 16 * LD::O;
#pragma unroll
		for (int n = 0; n < D / 16; n++) {
			wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
			wmma::load_matrix_sync(acc, O + n * 16, LD::O, wmma::mem_row_major);
#pragma unroll
			for (int kk = 0; kk < (int)(EX_KEYS / 16); kk++) {
				wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
				wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
				wmma::load_matrix_sync(a, sP + (size_t)warp * 16 * LD::P + kk * 16,
						       LD::P);
				wmma::load_matrix_sync(b, sV + (size_t)kk * 16 * LD::X + n * 16, LD::X);
				wmma::mma_sync(acc, a, b, acc);
			}
			wmma::store_matrix_sync(O + n * 16, acc, LD::O, wmma::mem_row_major);
		}
		__syncthreads(); /* K and V are overwritten next */
	}
	__syncwarp();
	if (!live)
		return;
	if (split || !last_range) {
		float *dst = split ? part + ((size_t)blockIdx.z * n_rows * hq) * (D + 2) + st
				   : state + st;
		if (half == 0) {
			dst[0] = m;
			dst[1] = l;
		}
		for (uint32_t c = half * (D / 2); c < (half + 1) * (D / 2); c++)
			dst[2 + c] = orow[c];
		return;
	}
	const float inv = l > 0.0f ? 1.0f / l : 0.0f;
	const size_t at = ((size_t)(pair / G) * hq + h * G + pair % G) * D;
	for (uint32_t c = half * (D / 2); c < (half + 1) * (D / 2); c++)
		kvt_d_store_out(out_dtype, out, at + c, orow[c] * inv);
}

/* The splits of the keys (part) and, unless this is the first range, the state: into the state
 * again, or out. A block per (query row, query head), a thread per dimension. */
static __global__ void k_extend_merge(uint32_t d, uint32_t n_pairs, uint32_t splits,
				      const float *part, float *state, int first_range,
				      int last_range, uint32_t out_dtype, void *out)
{
	const size_t pi = blockIdx.x, w = d + 2;
	const uint32_t c = threadIdx.x;
	float M = -INFINITY, sm = -INFINITY;
	if (!first_range)
		M = sm = state[pi * w];
	for (uint32_t z = 0; z < splits; z++)
		M = fmaxf(M, part[((size_t)z * n_pairs + pi) * w]);
	float L = 0.0f, a = 0.0f;
	if (sm != -INFINITY) {
		const float f = expf(sm - M);
		L = f * state[pi * w + 1];
		a = f * state[pi * w + 2 + c];
	}
	for (uint32_t z = 0; z < splits; z++) {
		const float *p = part + ((size_t)z * n_pairs + pi) * w;
		if (p[0] == -INFINITY)
			continue;
		const float f = expf(p[0] - M);
		L = fmaf(f, p[1], L);
		a = fmaf(f, p[2 + c], a);
	}
	if (last_range) {
		kvt_d_store_out(out_dtype, out, pi * d + c, L > 0.0f ? a / L : 0.0f);
		return;
	}
	__syncthreads(); /* every thread read the state's maximum and sum */
	if (c == 0) {
		state[pi * w] = M;
		state[pi * w + 1] = L;
	}
	state[pi * w + 2 + c] = a;
}

extern "C" size_t kvt_gpu_extend_state_bytes(uint32_t n_rows, uint32_t n_q_heads, uint32_t d)
{
	return (size_t)n_rows * n_q_heads * (d + 2) * sizeof(float);
}

/* Splits of a range's keys: enough blocks for two per multiprocessor when the query tiles alone
 * are fewer, at least 64 keys each, at most 64 splits. */
static uint32_t splits_of(uint32_t n_rows, uint32_t hq, uint32_t hkv, uint32_t keys)
{
	int dev = 0, sms = 132;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
		sms = 132;
	const uint64_t tiles = ((uint64_t)n_rows * (hq / hkv) + EX_TILE - 1) / EX_TILE * hkv;
	const uint64_t want = 2ull * (uint64_t)sms;
	if (tiles == 0 || tiles >= want)
		return 1;
	uint64_t s = (want + tiles - 1) / tiles;
	const uint64_t most = (keys + EX_KEYS - 1) / EX_KEYS;
	s = s < most ? s : most;
	s = s < 64 ? s : 64;
	return s ? (uint32_t)s : 1;
}

extern "C" size_t kvt_gpu_extend_part_bytes(uint32_t n_rows, uint32_t n_q_heads,
					    uint32_t n_kv_heads, uint32_t d, uint32_t keys)
{
	if (n_kv_heads == 0 || n_q_heads % n_kv_heads)
		return 0;
	const uint32_t s = splits_of(n_rows, n_q_heads, n_kv_heads, keys);
	return s > 1 ? (size_t)s * kvt_gpu_extend_state_bytes(n_rows, n_q_heads, d) : 0;
}

template <int D, int DT>
static int extend_launch(uint32_t out_dtype, uint32_t hq, uint32_t hkv, float scale,
			 const void *q, uint32_t n_rows, uint32_t first, const void *k,
			 const void *v, size_t cap, uint32_t r0, uint32_t r1, float *state,
			 int first_range, int last_range, void *out, float *part,
			 uint32_t splits, cudaStream_t s)
{
	constexpr size_t bytes = ex_smem<D>();
	int dev = 0, most = 0;
	KVT_CU(cudaGetDevice(&dev));
	KVT_CU(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
	if ((size_t)most < bytes)
		return -EOPNOTSUPP; /* this head_dim's tiles do not fit the device's shared memory */
	KVT_CU(cudaFuncSetAttribute(k_extend<D, DT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				    (int)bytes));
	const uint64_t pairs = (uint64_t)n_rows * (hq / hkv);
	/* keys per split: a multiple of the kernel's step */
	const uint32_t keys = r1 - r0, per = (keys + splits - 1) / splits;
	const uint32_t span = (per + EX_KEYS - 1) / EX_KEYS * EX_KEYS;
	const dim3 grid((uint32_t)((pairs + EX_TILE - 1) / EX_TILE), hkv, splits);
	k_extend<D, DT><<<grid, EX_THREADS, bytes, s>>>(q, hq, hkv, scale, n_rows, first, k, v, cap,
							r0, r1, state, first_range, last_range,
							out_dtype, out, part, span);
	KVT_CU_LAUNCHED();
	if (splits > 1) {
		k_extend_merge<<<n_rows * hq, D, 0, s>>>(D, n_rows * hq, splits, part, state,
							 first_range, last_range, out_dtype, out);
		KVT_CU_LAUNCHED();
	}
	return 0;
}

extern "C" int kvt_gpu_extend_attend(uint32_t d, uint32_t dtype, uint32_t out_dtype,
				     uint32_t n_q_heads, uint32_t n_kv_heads, float scale,
				     const void *q, uint32_t n_rows, uint32_t first, const void *k,
				     const void *v, size_t cap, uint32_t r0, uint32_t r1,
				     float *state, int first_range, int last_range, void *out,
				     float *part, size_t part_bytes, void *stream)
{
	if (!q || !k || !v || !out || n_kv_heads == 0 || n_kv_heads > 65535 ||
	    n_q_heads % n_kv_heads || !isfinite(scale) || r1 < r0 || cap < r1 - r0 ||
	    ((uintptr_t)q & 15) || ((uintptr_t)k & 15) || ((uintptr_t)v & 15) ||
	    (!(first_range && last_range) && (!state || ((uintptr_t)state & 15))))
		return -EINVAL;
	if (!kvt_is_pow2_dim(d) || (dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16) ||
	    (out_dtype != KVT_DTYPE_F32 && out_dtype != KVT_DTYPE_F16 &&
	     out_dtype != KVT_DTYPE_BF16))
		return -EOPNOTSUPP;
	const uint64_t pairs = (uint64_t)n_rows * (n_q_heads / n_kv_heads);
	if ((pairs + EX_TILE - 1) / EX_TILE > 0x7fffffffu ||
	    (uint64_t)n_rows * n_q_heads > 0x7fffffffu)
		return -EINVAL;
	if (n_rows == 0)
		return 0;
	/* the splits the scratch allows: as many as wanted when it holds them, else none */
	uint32_t splits = splits_of(n_rows, n_q_heads, n_kv_heads, r1 - r0);
	if (splits > 1 && (!part || ((uintptr_t)part & 15) ||
			   part_bytes < kvt_gpu_extend_part_bytes(n_rows, n_q_heads, n_kv_heads,
								  d, r1 - r0)))
		splits = 1;
	KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE(dtype, DT, {
		return extend_launch<D, DT>(out_dtype, n_q_heads, n_kv_heads, scale, q, n_rows,
					    first, k, v, cap, r0, r1, state, first_range,
					    last_range, out, part, splits, KVT_STREAM(stream));
	}));
}
