/* SPDX-License-Identifier: MIT */
/* Dense rows to and from a paged or strided K/V buffer (see rows.cuh). */
#include <cuda_runtime.h>
#include <errno.h>

#include "common.cuh"
#include "rows.cuh"

#define ROWS_THREADS 256

/* One element of type T per thread and step: lanes of token i, head blockIdx.y. */
template <typename T>
static __global__ void __launch_bounds__(ROWS_THREADS)
	k_rows_place(uint32_t lanes, uint32_t n, const int64_t *slots, uint64_t slot_stride,
		     uint64_t head_stride, T *pk, T *pv, T *dk, T *dv, int to_placed)
{
	const uint32_t h = blockIdx.y, H = gridDim.y, per = sizeof(T) / 2; /* elements per T */
	const uint64_t total = (uint64_t)n * lanes;
	for (uint64_t x = (uint64_t)blockIdx.x * ROWS_THREADS + threadIdx.x; x < total;
	     x += (uint64_t)gridDim.x * ROWS_THREADS) {
		const uint32_t i = (uint32_t)(x / lanes), e = (uint32_t)(x % lanes);
		const int64_t s = slots ? slots[i] : (int64_t)i;
		if (s < 0)
			continue;
		const size_t at = ((size_t)s * slot_stride + (size_t)h * head_stride) / per + e;
		const size_t dn = ((size_t)i * H + h) * lanes + e;
		if (to_placed) {
			pk[at] = dk[dn];
			pv[at] = dv[dn];
		} else {
			dk[dn] = pk[at];
			dv[dn] = pv[at];
		}
	}
}

template <typename T>
static int launch(uint32_t d, uint32_t H, uint32_t n, const int64_t *slots, uint64_t ss,
		  uint64_t hs, void *pk, void *pv, void *dk, void *dv, int to_placed, void *stream)
{
	const uint32_t lanes = d * 2 / sizeof(T);
	uint64_t blocks = ((uint64_t)n * lanes + ROWS_THREADS - 1) / ROWS_THREADS;
	blocks = blocks > 1024 ? 1024 : blocks;
	k_rows_place<T><<<dim3((uint32_t)blocks, H), ROWS_THREADS, 0, KVT_STREAM(stream)>>>(
		lanes, n, slots, ss, hs, (T *)pk, (T *)pv, (T *)dk, (T *)dv, to_placed);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_rows_place(uint32_t d, uint32_t n_kv_heads, uint32_t n, const int64_t *slots,
				  uint64_t slot_stride, uint64_t head_stride, void *pk, void *pv,
				  void *dk, void *dv, int to_placed, void *stream)
{
	if (!pk || !pv || !dk || !dv || d == 0 || n_kv_heads == 0 || n_kv_heads > 65535 ||
	    head_stride < d || slot_stride < (uint64_t)(n_kv_heads - 1) * head_stride + d)
		return -EINVAL;
	if (n == 0)
		return 0;
	const uintptr_t any = (uintptr_t)pk | (uintptr_t)pv | (uintptr_t)dk | (uintptr_t)dv |
			      (uintptr_t)(slot_stride * 2) | (uintptr_t)(head_stride * 2) |
			      (uintptr_t)(d * 2);
	if (any % 16 == 0)
		return launch<uint4>(d, n_kv_heads, n, slots, slot_stride, head_stride, pk, pv, dk, dv,
				     to_placed, stream);
	return launch<uint16_t>(d, n_kv_heads, n, slots, slot_stride, head_stride, pk, pv, dk, dv,
				to_placed, stream);
}
