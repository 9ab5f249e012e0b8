/* SPDX-License-Identifier: MIT */
/*
 * The second selection stage on the GPU (rescore.cuh): one thread per (query head, index position)
 * tests the candidate rule, and each candidate's thread reads its key (16 bytes at a time, from the
 * hot cache or over PCIe) and forms the exact logit in the CPU's order. Candidates are a few
 * percent of the tokens, so most threads only read their score. Keys read over PCIe (the K half of
 * a row, 2 d bytes) count in the layer's PCIe bytes.
 */
#include "common.cuh"
#include "fetch_rows.cuh"
#include "rescore.cuh"

#define RS_THREADS 256u

template <int D, int DT>
static __global__ void __launch_bounds__(RS_THREADS)
	k_rescore(uint32_t hq, uint32_t hkv, const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot,
		  const void *q, const kvt_gpu_topp *topp, float *scores, size_t ld)
{
	constexpr uint32_t row_bytes = 4 * D;
	__shared__ float qs[D];
	const uint32_t seg = blockIdx.y, s = seg / hq, j = seg % hq, h = j / (hq / hkv);
	const kvt_gpu_topp o = topp[seg];
	if (!o.marked)
		return;
	const kvt_gpu_fetch_seq f = seqs[s];
	for (uint32_t e = threadIdx.x; e < D; e += RS_THREADS)
		qs[e] = kvt_d_load<DT>(q, (size_t)seg * D + e);
	__syncthreads();
	float *row = scores + (size_t)seg * ld;
	unsigned long long host_reads = 0; /* keys read over PCIe: the layer's PCIe counter */
	for (uint32_t t = blockIdx.x * RS_THREADS + threadIdx.x; t < f.n_indexed;
	     t += gridDim.x * RS_THREADS) {
		const float x = row[t];
		if (((unsigned long long)kvt_d_fkey(x) << 32 | (0xffffffffu - t)) < o.cut)
			continue;
		const uint32_t at = f.n_sink + t; /* token position */
		const long long slot = hot_slot(hot, f.uid, h, at);
		const char *k = slot >= 0 ? (const char *)hot.rows + (size_t)slot * row_bytes
					  : host_row(f.blocks, f.blk_cap, h, at, row_bytes);
		if (!k)
			continue; /* a spilled block: the estimate stays */
		host_reads += slot < 0;
		float e = 0.0f;
#pragma unroll 4
		for (int c = 0; c < D / 8; c++) {
			float kf[8];
			kvt_d_unpack8<DT>(((const uint4 *)k)[c], kf);
#pragma unroll
			for (int i = 0; i < 8; i++)
				e = __fadd_rn(e, __fmul_rn(qs[8 * c + i], kf[i]));
		}
		if (isfinite(e))
			row[t] = e;
	}
	/* every lane reaches here (the loop's bound is the block's): warp sums, one add each */
	for (int o = 16; o; o >>= 1)
		host_reads += __shfl_xor_sync(0xffffffffu, host_reads, o);
	if ((threadIdx.x & 31) == 0 && host_reads && hot.counters)
		atomicAdd(&hot.counters[KVT_GPU_CNT_PCIE], host_reads * (D * 2));
}

template <int D, int DT>
static int launch(uint32_t n_seqs, uint32_t hq, uint32_t hkv, const kvt_gpu_fetch_seq *seqs,
		  kvt_gpu_hot hot, const void *q, const kvt_gpu_topp *topp, float *scores,
		  size_t ld, uint32_t max_n, cudaStream_t s)
{
	const uint32_t blocks = (max_n + RS_THREADS - 1) / RS_THREADS;
	const dim3 grid(blocks < 64 ? blocks : 64, n_seqs * hq);
	k_rescore<D, DT><<<grid, RS_THREADS, 0, s>>>(hq, hkv, seqs, hot, q, topp, scores, ld);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_rescore(uint32_t d, uint32_t dtype, uint32_t n_seqs, uint32_t n_q_heads,
			       uint32_t n_kv_heads, const kvt_gpu_fetch_seq *seqs,
			       kvt_gpu_hot hot, const void *q, const kvt_gpu_topp *topp,
			       float *scores, size_t ld, uint32_t max_n, void *stream)
{
	if (!seqs || !q || !topp || !scores || n_kv_heads == 0 || n_q_heads % n_kv_heads ||
	    max_n > ld || (uint64_t)n_seqs * n_q_heads > 65535)
		return -EINVAL;
	if (n_seqs == 0 || max_n == 0)
		return 0;
	cudaStream_t s = KVT_STREAM(stream);
	KVT_DISPATCH_HEAD_DIM(d, D, KVT_DISPATCH_DTYPE(dtype, DT, {
		return launch<D, DT>(n_seqs, n_q_heads, n_kv_heads, seqs, hot, q, topp, scores, ld,
				     max_n, s);
	}));
}

static __global__ void __launch_bounds__(RS_THREADS)
	k_rescore_count(kvt_gpu_selbits cand, kvt_gpu_selbits sel, unsigned long long *counters)
{
	const uint32_t item = blockIdx.y;
	unsigned long long c = 0, u = 0;
	for (uint32_t w = blockIdx.x * RS_THREADS + threadIdx.x; w < cand.words;
	     w += gridDim.x * RS_THREADS) {
		const uint32_t a = cand.mask[(size_t)item * cand.words + w],
			       b = sel.mask[(size_t)item * sel.words + w];
		c += (unsigned long long)__popc(a);
		u += (unsigned long long)__popc(a & ~b);
	}
	for (int o = 16; o; o >>= 1) {
		c += __shfl_xor_sync(0xffffffffu, c, o);
		u += __shfl_xor_sync(0xffffffffu, u, o);
	}
	if ((threadIdx.x & 31) == 0) {
		if (c)
			atomicAdd(&counters[0], c);
		if (u)
			atomicAdd(&counters[1], u);
	}
}

extern "C" int kvt_gpu_rescore_count(uint32_t n_items, kvt_gpu_selbits cand,
				     kvt_gpu_selbits sel, unsigned long long *counters,
				     void *stream)
{
	if (!cand.mask || !sel.mask || !counters || cand.words > sel.words || n_items > 65535)
		return -EINVAL;
	if (n_items == 0 || cand.words == 0)
		return 0;
	const uint32_t blocks = (cand.words + RS_THREADS - 1) / RS_THREADS;
	const dim3 grid(blocks < 16 ? blocks : 16, n_items);
	k_rescore_count<<<grid, RS_THREADS, 0, KVT_STREAM(stream)>>>(cand, sel, counters);
	KVT_CU_LAUNCHED();
	return 0;
}
