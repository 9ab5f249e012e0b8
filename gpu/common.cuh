/* SPDX-License-Identifier: MIT */
/*
 * What every kernel file of gpu/ shares: checked CUDA calls that map failures to -EIO, the dispatch
 * of runtime sizes to template arguments, the error word kernels raise instead of trapping, and
 * fp16/bf16 conversions that reproduce lib/half.h bit for bit (integer ports, so NaN payloads and
 * subnormals come out as the CPU twin writes them). C++ only: included by the .cu files, never by
 * C code. Of the library it takes the public header (kvt_dtype) and lib/constants.h, not
 * lib/internal.h.
 */
#ifndef KVT_GPU_COMMON_CUH
#define KVT_GPU_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>

#include "constants.h"
#include "errword.h"
#include "kvtier.h"

/* Return -EIO from the enclosing launcher when a CUDA call fails. */
#define KVT_CU(expr)                                                                               \
	do {                                                                                       \
		if ((expr) != cudaSuccess)                                                         \
			return -EIO;                                                               \
	} while (0)

/* After every launch: a bad configuration or a sticky error from earlier work surfaces here. */
#define KVT_CU_LAUNCHED() KVT_CU(cudaGetLastError())

#define KVT_STREAM(s) ((cudaStream_t)(s))

/*
 * Whether the gather's grids widen: k_fill near 16384 blocks instead of 4096, k_attend at least 32
 * chunks an item instead of 16, once the batch's items (sequences x KV heads) times the rows an
 * item may hold (the launch's bound, the context when nothing caps the selection) reach
 * KVT_WIDE_ROWS. On the H200 (doc/cuda-backend.md) the wide grids took gather + attend from 1441
 * to 1330 us at 1M x 8 and a batch-16 layer of 128K from 0.80 to 0.76 ms, and made gather +
 * attend 8 % slower at 128K x 8 and 22 % at 128K x 1, where a warp of k_fill then has about one
 * row. Compile-time, for an A/B: 0 widens every launch.
 */
#ifndef KVT_WIDE_ROWS
#define KVT_WIDE_ROWS (1ull << 24)
#endif
static inline bool kvt_wide_grid(uint32_t n_items, uint32_t max_rows)
{
	return (uint64_t)n_items * max_rows >= KVT_WIDE_ROWS;
}

/*
 * Programmatic dependent launch (Hopper). kvt_launch_dependent launches k (when `dependent`;
 * otherwise in plain stream order) as a dependent of the stream's previous kernel: k's blocks may be scheduled once every block of that kernel has
 * executed KVT_PDL_TRIGGER() (or left), so k must execute KVT_PDL_WAIT() before it reads or
 * writes anything that kernel, or a kernel still running before it, touches: past the wait, the
 * previous kernel has finished and its writes are visible. Every block of k executes the wait
 * before it ends, even one with nothing to do, so that k's end implies the end of every kernel
 * before it (the wait covers only the previous kernel). Both are no-ops in a kernel launched the
 * plain way, and below sm_90. Capturable in a CUDA graph.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVT_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;")
#define KVT_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define KVT_PDL_TRIGGER() ((void)0)
#define KVT_PDL_WAIT() ((void)0)
#endif

template <class... P, class... A>
static cudaError_t kvt_launch_dependent(void (*k)(P...), dim3 grid, uint32_t threads,
					cudaStream_t s, bool dependent, A... args)
{
	cudaLaunchAttribute attr;
	attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
	attr.val.programmaticStreamSerializationAllowed = 1;
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = grid;
	cfg.blockDim = dim3(threads);
	cfg.stream = s;
	cfg.attrs = &attr;
	cfg.numAttrs = dependent ? 1 : 0; /* false: a plain launch in stream order */
	return cudaLaunchKernelEx(&cfg, k, args...);
}

/*
 * Runtime sizes to template arguments (as FlashInfer's DISPATCH_HEAD_DIM): the statements after
 * NAME run with NAME a constexpr int equal to the value, one copy per supported value; any other
 * value returns -EOPNOTSUPP from the enclosing launcher. The statements usually return; when they
 * do not, control goes on after the dispatch. Dispatches nest:
 *     KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE(dtype, DT, return launch<D, DT>(a)));
 */
#define KVT_DISPATCH_CASE(value, NAME, ...)                                                        \
	case value: {                                                                              \
		constexpr int NAME = value;                                                        \
		__VA_ARGS__;                                                                       \
	} break;

/* A switch over the KVT_DISPATCH_CASEs given whose default returns -EOPNOTSUPP. */
#define KVT_DISPATCH(value, ...)                                                                   \
	switch (value) {                                                                           \
		__VA_ARGS__                                                                        \
	default:                                                                                   \
		return -EOPNOTSUPP;                                                                \
	}

/* Head dim d: 64, 128 or 256. */
#define KVT_DISPATCH_HEAD_DIM(d, D, ...)                                                           \
	KVT_DISPATCH(d, KVT_DISPATCH_CASE(64, D, __VA_ARGS__)                                      \
				KVT_DISPATCH_CASE(128, D, __VA_ARGS__)                             \
				KVT_DISPATCH_CASE(256, D, __VA_ARGS__))

/* The dtype of K, V and queries: KVT_DTYPE_F16 or KVT_DTYPE_BF16. */
#define KVT_DISPATCH_DTYPE(dtype, DT, ...)                                                         \
	KVT_DISPATCH(dtype, KVT_DISPATCH_CASE(KVT_DTYPE_F16, DT, __VA_ARGS__)                      \
				    KVT_DISPATCH_CASE(KVT_DTYPE_BF16, DT, __VA_ARGS__))

/* The same or KVT_DTYPE_F32 (keys given as floats to the index build). */
#define KVT_DISPATCH_DTYPE_OR_F32(dtype, DT, ...)                                                  \
	KVT_DISPATCH(dtype, KVT_DISPATCH_CASE(KVT_DTYPE_F16, DT, __VA_ARGS__)                      \
				    KVT_DISPATCH_CASE(KVT_DTYPE_BF16, DT, __VA_ARGS__)             \
				    KVT_DISPATCH_CASE(KVT_DTYPE_F32, DT, __VA_ARGS__))

/* Record the first error of a launch in the caller's error word; later ones keep the first. */
static __device__ __forceinline__ void kvt_d_raise(unsigned long long *err, uint32_t code,
						   uint32_t where, uint32_t index)
{
	if (err)
		atomicCAS(err, 0ull, KVT_GPU_ERR_MAKE(code, where, index));
}

/* A KVT_GPU_ERR_RANGE, with the check that raised it (errword.h's sites). */
static __device__ __forceinline__ void kvt_d_range(unsigned long long *err, uint32_t site,
						   uint32_t where, uint32_t index)
{
	kvt_d_raise(err, KVT_GPU_ERR_RANGE_AT(site), where, index);
}

/* Order-preserving unsigned key of a finite float, -0 taken as +0 (they compare equal on the
 * CPU): the selection orders scores by it (select.cu, union.cu). */
static __device__ __forceinline__ uint32_t kvt_d_fkey(float f)
{
	uint32_t u = __float_as_uint(__fadd_rn(f, 0.0f));
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static __device__ __forceinline__ float kvt_d_keyf(uint32_t k)
{
	return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* ---- fp16 / bf16, ported from lib/half.h -------------------------------------------------- */

static __device__ __forceinline__ float kvt_d_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
	if (exp == 0x1f)
		return __uint_as_float(sign | 0x7f800000u | (man << 13));
	if (exp == 0) {
		float f = __fmul_rn((float)man, 1.0f / 16777216.0f);
		return sign ? -f : f;
	}
	return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static __device__ __forceinline__ uint16_t kvt_d_f32_to_f16(float f)
{
	uint32_t u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, abs = u & 0x7fffffffu;
	if (abs >= 0x7f800000u)
		return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
	if (abs >= 0x477ff000u)
		return (uint16_t)(sign | 0x7c00u);
	if (abs < 0x38800000u) {
		uint32_t shift = 126u - (abs >> 23);
		if (shift > 25)
			return (uint16_t)sign;
		uint32_t man = (abs & 0x7fffffu) | 0x800000u;
		uint32_t half = man >> shift, rem = man & ((1u << shift) - 1),
			 mid = 1u << (shift - 1);
		if (rem > mid || (rem == mid && (half & 1u)))
			half++;
		return (uint16_t)(sign | half);
	}
	uint32_t r = abs - 0x38000000u;
	uint32_t half = r >> 13, rem = r & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
		half++;
	return (uint16_t)(sign | half);
}

static __device__ __forceinline__ float kvt_d_bf16_to_f32(uint16_t h)
{
	return __uint_as_float((uint32_t)h << 16);
}

static __device__ __forceinline__ uint16_t kvt_d_f32_to_bf16(float f)
{
	uint32_t u = __float_as_uint(f);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

/* Element i of an output tensor of kvt_dtype out_dtype (F32, F16 or BF16, rounded to nearest
 * even) set to o. */
static __device__ __forceinline__ void kvt_d_store_out(uint32_t out_dtype, void *out, size_t i,
						      float o)
{
	if (out_dtype == KVT_DTYPE_F32)
		((float *)out)[i] = o;
	else if (out_dtype == KVT_DTYPE_BF16)
		((uint16_t *)out)[i] = kvt_d_f32_to_bf16(o);
	else
		((uint16_t *)out)[i] = kvt_d_f32_to_f16(o);
}

/* Element i of a tensor of kvt_dtype DT (F16, BF16, or F32 where a launcher allows it). */
template <int DT>
static __device__ __forceinline__ float kvt_d_load(const void *base, size_t i)
{
	if (DT == KVT_DTYPE_F32)
		return ((const float *)base)[i];
	uint16_t h = ((const uint16_t *)base)[i];
	return DT == KVT_DTYPE_BF16 ? kvt_d_bf16_to_f32(h) : kvt_d_f16_to_f32(h);
}

/* Eight packed 16-bit elements to floats (exact for every finite value; the attention path). */
template <int DT>
static __device__ __forceinline__ void kvt_d_unpack8(uint4 v, float *f)
{
	const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (DT == KVT_DTYPE_BF16) {
			f[2 * i] = __uint_as_float(w[i] << 16);
			f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
		} else {
			__half2 h = *(const __half2 *)&w[i];
			float2 p = __half22float2(h);
			f[2 * i] = p.x;
			f[2 * i + 1] = p.y;
		}
	}
}

static inline bool kvt_is_pow2_dim(uint32_t d)
{
	return d == 64 || d == 128 || d == 256;
}

#endif
