/* SPDX-License-Identifier: MIT */
/*
 * Index build, the twin of kvt_index_build. Bit equality with the CPU dictates the arithmetic:
 * every product and sum is an explicit round-to-nearest intrinsic (nvcc would otherwise contract
 * a * b + c into an FMA), and every float sum runs in the CPU's order: y[j] over i increasing, and
 * ||r||^2, ||y||_1 and <c_q, k> sequentially by one thread per token. The d x d matvec dominates
 * the cost, and it parallelizes over (token, j) without changing any single sum's order.
 */
#include "common.cuh"
#include "index.cuh"

#define IB_TOKENS 16 /* tokens per block */
#define IB_THREADS 256

/* sigma and beta saturated as kvt_index_build's f16_sat does (lib/estimate.c): +-65504 beyond the
 * fp16 range, 0 for a NaN, so that an index entry is always finite. */
static __device__ __forceinline__ uint16_t f16_sat(float f)
{
	const uint16_t h = kvt_d_f32_to_f16(f);
	if ((h & 0x7fffu) > 0x7c00u)
		return 0;
	return (h & 0x7fffu) == 0x7c00u ? (uint16_t)((h & 0x8000u) | 0x7bffu) : h;
}

template <int D, int DT>
static __global__ void __launch_bounds__(IB_THREADS)
	k_index_build(const float *__restrict__ rot, uint32_t n_kv, const kvt_gpu_index_job *jobs,
		      uint32_t max_n, const kvt_gpu_index_view *views, unsigned long long *err)
{
	constexpr int W = D / 32;
	constexpr int ROWS = IB_THREADS / D;             /* thread rows over tokens: 4, 2, 1 */
	constexpr int PER = IB_TOKENS / ROWS;            /* tokens per thread in the matvec */
	__shared__ __align__(16) float ks[IB_TOKENS][D]; /* keys, later y = R r */
	__shared__ __align__(16) float rs[IB_TOKENS][D]; /* residuals r = k - c_k */
	__shared__ float n2s[IB_TOKENS];
	__shared__ bool nonzero[IB_TOKENS];

	const uint32_t ji = blockIdx.y / n_kv, h = blockIdx.y % n_kv, tid = threadIdx.x;
	const kvt_gpu_index_job job = jobs[ji];
	const uint32_t t0 = blockIdx.x * IB_TOKENS;
	if (job.n > max_n) {
		if (blockIdx.x == 0 && h == 0 && tid == 0)
			kvt_d_range(err, KVT_GPU_SITE_INDEX_JOB, ji, job.n);
		return;
	}
	if (t0 >= job.n)
		return;
	const kvt_gpu_index_view v = views[job.view];
	if ((uint64_t)job.first + job.n > v.cap) {
		if (blockIdx.x == 0 && h == 0 && tid == 0)
			kvt_d_range(err, KVT_GPU_SITE_INDEX_CAP, ji, job.first + job.n);
		return;
	}
	const uint32_t nt = min((uint32_t)IB_TOKENS, job.n - t0);
	const float *ck = job.c_k + (size_t)h * D, *cq = job.c_q + (size_t)h * D;

	for (uint32_t e = tid; e < IB_TOKENS * D; e += IB_THREADS) {
		uint32_t t = e / D, i = e % D;
		float k = 0.0f, r = 0.0f;
		if (t < nt) {
			k = kvt_d_load<DT>(job.keys, (size_t)(t0 + t) * job.token_stride +
							     (size_t)h * job.head_stride + i);
			r = __fsub_rn(k, ck[i]);
		}
		ks[t][i] = k;
		rs[t][i] = r;
	}
	__syncthreads();

	/* index entry of token 0 of the block */
	const size_t at = (size_t)h * v.cap + job.first + t0;
	/* the serial sums, in warps 0 and 1 so that they run beside each other */
	if (tid < nt) {
		float s = 0.0f;
		for (int i = 0; i < D; i++)
			s = __fadd_rn(s, __fmul_rn(rs[tid][i], rs[tid][i]));
		n2s[tid] = s;
	} else if (tid >= 32 && tid - 32 < nt) {
		const uint32_t t = tid - 32;
		float s = 0.0f;
		for (int i = 0; i < D; i++)
			s = __fadd_rn(s, __fmul_rn(cq[i], ks[t][i]));
		v.beta[at + t] = f16_sat(s);
	}

	/* y[t][j] = sum over i increasing of rot[j][i] * r[t][i] */
	const uint32_t j = tid % D, row = tid / D;
	float acc[PER];
#pragma unroll
	for (int k = 0; k < PER; k++)
		acc[k] = 0.0f;
	const float4 *rj = (const float4 *)(rot + (size_t)j * D);
	for (int i4 = 0; i4 < D / 4; i4++) {
		const float4 a = __ldg(rj + i4);
#pragma unroll
		for (int k = 0; k < PER; k++) {
			const float4 r = *(const float4 *)&rs[row + ROWS * k][4 * i4];
			acc[k] = __fadd_rn(acc[k], __fmul_rn(a.x, r.x));
			acc[k] = __fadd_rn(acc[k], __fmul_rn(a.y, r.y));
			acc[k] = __fadd_rn(acc[k], __fmul_rn(a.z, r.z));
			acc[k] = __fadd_rn(acc[k], __fmul_rn(a.w, r.w));
		}
	}
	__syncthreads(); /* beta has read the keys: ks becomes y */
#pragma unroll
	for (int k = 0; k < PER; k++)
		ks[row + ROWS * k][j] = acc[k];
	__syncthreads();

	if (tid < nt) {
		float l1 = 0.0f;
		for (int i = 0; i < D; i++)
			l1 = __fadd_rn(l1, fabsf(ks[tid][i]));
		const bool nz = l1 > 0.0f;
		const float s =
			nz ? __fmul_rn(__fdiv_rn(n2s[tid], l1), __fsqrt_rn((float)D)) : 0.0f;
		v.sigma[at + tid] = f16_sat(s);
		nonzero[tid] = nz;
	}
	__syncthreads();

	const uint32_t warp = tid / 32, lane = tid % 32;
	for (uint32_t e = warp; e < nt * W; e += IB_THREADS / 32) {
		const uint32_t t = e / W, w = e % W;
		const uint32_t bits = __ballot_sync(0xffffffffu, ks[t][32 * w + lane] > 0.0f);
		if (lane == 0)
			v.codes[(at + t) * W + w] = nonzero[t] ? bits : 0u;
	}
}

template <int D, int DT>
static int launch(uint32_t n_kv, const float *rot, uint32_t n_jobs, const kvt_gpu_index_job *jobs,
		  uint32_t max_n, const kvt_gpu_index_view *views, unsigned long long *err,
		  cudaStream_t s)
{
	dim3 grid((max_n + IB_TOKENS - 1) / IB_TOKENS, n_jobs * n_kv);
	k_index_build<D, DT><<<grid, IB_THREADS, 0, s>>>(rot, n_kv, jobs, max_n, views, err);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_index_build(uint32_t d, uint32_t dtype, uint32_t n_kv_heads,
				   const float *rot, uint32_t n_jobs, const kvt_gpu_index_job *jobs,
				   uint32_t max_n, const kvt_gpu_index_view *views,
				   unsigned long long *err, void *stream)
{
	if (!rot || !jobs || !views || n_kv_heads == 0)
		return -EINVAL;
	if ((uint64_t)n_jobs * n_kv_heads > 65535)
		return -EINVAL;
	if (!kvt_is_pow2_dim(d) ||
	    (dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16 && dtype != KVT_DTYPE_F32))
		return -EOPNOTSUPP;
	if (n_jobs == 0 || max_n == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE_OR_F32(dtype, DT, {
		return launch<D, DT>(n_kv_heads, rot, n_jobs, jobs, max_n, views, err, s);
	}));
}
