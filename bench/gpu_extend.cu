/* SPDX-License-Identifier: MIT */
/*
 * kvt_extend on the CUDA backend: a chunk of C new tokens attending causally to N stored ones and
 * to itself (chunked prefill, a prefix hit, speculative verification), Llama-3.1-8B's attention
 * shape (32 query heads, 8 KV heads, head_dim 128, fp16), batch 1, one layer.
 *
 * Per (N, C), medians of CUDA-event timings after warm-up:
 * - the whole call through the public interface (store and index of the chunk, staging of the
 *   N + C rows from the host tier, attention), the sequence truncated back between calls;
 * - its two parts alone on the same shapes: the staging of the rows from pinned host memory
 *   (kvt_gpu_stage_rows), against a cudaMemcpyAsync of the same bytes (the PCIe limit, measured in
 *   the same run), and the attention over rows already in HBM (kvt_gpu_extend_attend), in TFLOP/s
 *   of causal attention (4 d flops per (query head, key) pair).
 * A line "csv,N,C,call_ms,stage_ms,h2d_ms,attend_ms" per shape is for bench/extend_vs_sdpa.py,
 * which measures PyTorch's SDPA with everything in HBM on the same shapes and prints the ratios.
 *
 *   gpu_extend [--contexts 8192,32768,131072] [--chunks 16,512,4096] [--reps 10]
 */
#include <cuda_fp16.h>
#include <string.h>

#include "gpu/extend.cuh"
#include "gpu_bench.cuh"
#include "kvtier.h"
#include "kvtier_lifecycle.h"

enum { HQ = 32, HKV = 8, D = 128, ROW = 4 * D, BLOCK = 256 };

/* fp16 values in [-amp, amp) from a hash of the index */
static __global__ void fill_f16(uint16_t *x, size_t n, uint64_t salt, float amp)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float u = (float)(hash32(i * 0x9e3779b97f4a7c15ull + salt) >> 8) / 16777216.0f;
		x[i] = __half_as_ushort(__float2half_rn(amp * (2.0f * u - 1.0f)));
	}
}

struct shape_ms {
	float call, stage, h2d, attend;
};

/* The whole call: N tokens prefilled, then kvt_extend of C, truncated back before each. */
static float time_call(uint32_t N, uint32_t C, int reps, cudaStream_t st)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	cfg.n_q_heads = HQ;
	cfg.n_kv_heads = HKV;
	cfg.head_dim = D;
	cfg.backend = KVT_BACKEND_CUDA;
	const uint64_t blocks = (N + C + BLOCK - 1) / BLOCK + 2;
	cfg.host_bytes = (uint64_t)HKV * blocks * BLOCK * ROW + ((uint64_t)64 << 20);
	kvt_cache *cache = NULL;
	KVT_MUST(kvt_cache_create(&cfg, &cache));
	uint32_t seq;
	KVT_MUST(kvt_seq_open(cache, &seq));
	const uint32_t most = N > C ? N : C;
	uint16_t *q, *k, *v, *out;
	CK(cudaMalloc((void **)&q, (size_t)most * HQ * D * 2));
	CK(cudaMalloc((void **)&k, (size_t)most * HKV * D * 2));
	CK(cudaMalloc((void **)&v, (size_t)most * HKV * D * 2));
	CK(cudaMalloc((void **)&out, (size_t)C * HQ * D * 2 * 2));
	fill_f16<<<1024, 256, 0, st>>>(q, (size_t)most * HQ * D, 1, 1.0f);
	fill_f16<<<1024, 256, 0, st>>>(k, (size_t)most * HKV * D, 2, 1.0f);
	fill_f16<<<1024, 256, 0, st>>>(v, (size_t)most * HKV * D, 3, 1.0f);
	CK(cudaGetLastError());
	for (uint32_t p0 = 0; p0 < N; p0 += 65536) {
		const uint32_t n = N - p0 < 65536 ? N - p0 : 65536;
		KVT_MUST(kvt_prefill(cache, seq, 0, q, k, v, n, st));
	}
	const uint32_t cu[2] = {0, C};
	const float ms = median_ms(
		st, 3, reps,
		[&](int) { KVT_MUST(kvt_extend(cache, 0, 1, &seq, cu, q, k, v, out, 0, st)); },
		[&](int i) {
			if (i > 0)
				KVT_MUST(kvt_seq_truncate(cache, seq, C, st));
			CK(cudaStreamSynchronize(st));
		});
	CK(cudaStreamSynchronize(st));
	KVT_MUST(kvt_seq_close(cache, seq));
	kvt_cache_destroy(cache);
	CK(cudaFree(q));
	CK(cudaFree(k));
	CK(cudaFree(v));
	CK(cudaFree(out));
	return ms;
}

/* The parts alone: staging from pinned host blocks, the same bytes by cudaMemcpyAsync, and the
 * attention over rows in HBM. */
static void time_parts(uint32_t N, uint32_t C, int reps, cudaStream_t st, shape_ms *r)
{
	const uint32_t total = N + C, nblk = (total + BLOCK - 1) / BLOCK;
	const size_t host_bytes = (size_t)HKV * nblk * BLOCK * ROW;
	char *host, *host_dev;
	CK(cudaHostAlloc((void **)&host, host_bytes, cudaHostAllocMapped));
	memset(host, 0x11, host_bytes);
	CK(cudaHostGetDevicePointer((void **)&host_dev, host, 0));
	std::vector<void *> table((size_t)HKV * nblk);
	for (uint32_t h = 0; h < HKV; h++)
		for (uint32_t b = 0; b < nblk; b++)
			table[(size_t)h * nblk + b] = host_dev + ((size_t)h * nblk + b) * BLOCK * ROW;
	void **dtable, *k, *v, *copy, *q, *out;
	unsigned long long *err;
	const size_t half = (size_t)HKV * total * D * 2;
	CK(cudaMalloc((void **)&dtable, sizeof(void *) * table.size()));
	CK(cudaMemcpy(dtable, table.data(), sizeof(void *) * table.size(), cudaMemcpyHostToDevice));
	CK(cudaMalloc(&k, half));
	CK(cudaMalloc(&v, half));
	CK(cudaMalloc(&copy, 2 * half));
	CK(cudaMalloc(&q, (size_t)C * HQ * D * 2));
	CK(cudaMalloc(&out, (size_t)C * HQ * D * 2));
	CK(cudaMalloc((void **)&err, sizeof *err));
	CK(cudaMemset(err, 0, sizeof *err));
	fill_f16<<<1024, 256, 0, st>>>((uint16_t *)k, half / 2, 4, 1.0f);
	fill_f16<<<1024, 256, 0, st>>>((uint16_t *)v, half / 2, 5, 1.0f);
	fill_f16<<<1024, 256, 0, st>>>((uint16_t *)q, (size_t)C * HQ * D, 6, 1.0f);
	CK(cudaGetLastError());
	r->stage = median_ms(st, 3, reps, [&](int) {
		RC(kvt_gpu_stage_rows(D, HKV, dtable, nblk, ROW, 0, total, k, v, total, 0, err, st));
	});
	r->h2d = median_ms(st, 3, reps, [&](int) {
		CK(cudaMemcpyAsync(copy, host, 2 * half, cudaMemcpyHostToDevice, st));
	});
	/* the staged rows were overwritten by the host's constant bytes: refill them for the
	 * attention, whose timing depends on nothing but the shapes */
	fill_f16<<<1024, 256, 0, st>>>((uint16_t *)k, half / 2, 4, 1.0f);
	fill_f16<<<1024, 256, 0, st>>>((uint16_t *)v, half / 2, 5, 1.0f);
	const size_t part_bytes = kvt_gpu_extend_part_bytes(C, HQ, HKV, D, total);
	float *part = NULL;
	if (part_bytes)
		CK(cudaMalloc((void **)&part, part_bytes));
	r->attend = median_ms(st, 3, reps, [&](int) {
		RC(kvt_gpu_extend_attend(D, KVT_DTYPE_F16, KVT_DTYPE_F16, HQ, HKV, 0.08838834764f, q,
					 C, N, k, v, total, 0, total, NULL, 1, 1, out, part,
					 part_bytes, st));
	});
	CK(cudaFree(part));
	unsigned long long e = 0;
	CK(cudaMemcpy(&e, err, sizeof e, cudaMemcpyDeviceToHost));
	if (e)
		fprintf(stderr, "gpu_extend: the staging raised error word 0x%llx\n", e);
	CK(cudaFreeHost(host));
	CK(cudaFree(dtable));
	CK(cudaFree(k));
	CK(cudaFree(v));
	CK(cudaFree(copy));
	CK(cudaFree(q));
	CK(cudaFree(out));
	CK(cudaFree(err));
}

int main(int argc, char **argv)
{
	std::vector<uint32_t> contexts = {8192, 32768, 131072}, chunks = {16, 512, 4096};
	int reps = 10;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--contexts") && i + 1 < argc)
			contexts = parse_u32_list("--contexts", argv[++i]);
		else if (!strcmp(argv[i], "--chunks") && i + 1 < argc)
			chunks = parse_u32_list("--chunks", argv[++i]);
		else if (!strcmp(argv[i], "--reps") && i + 1 < argc && atoi(argv[i + 1]) > 0)
			reps = atoi(argv[++i]);
		else {
			fprintf(stderr, "usage: gpu_extend [--contexts N,..] [--chunks C,..] "
					"[--reps R]\n");
			return 2;
		}
	}
	cudaDeviceProp prop;
	if (!bench_device("gpu_extend", &prop))
		return 0;
	cudaStream_t st;
	CK(cudaStreamCreate(&st));
	printf("gpu_extend on %s: %d query heads, %d KV heads, head_dim %d, fp16, batch 1, medians "
	       "of %d\n", prop.name, HQ, HKV, D, reps);
	for (uint32_t N : contexts)
		for (uint32_t C : chunks) {
			shape_ms r;
			time_parts(N, C, reps, st, &r);
			r.call = time_call(N, C, reps, st);
			const double bytes = (double)(N + C) * HKV * ROW;
			double pairs = 0; /* (query row, key) pairs of the causal mask */
			for (uint32_t j = 0; j < C; j++)
				pairs += N + j + 1.0;
			const double flops = pairs * HQ * 4.0 * D;
			printf("N %7u C %5u: kvt_extend %8.3f ms | staging %8.3f ms = %6.1f GB/s, "
			       "%.2f of cudaMemcpy H2D (%6.1f GB/s) | attention in HBM %8.3f ms = "
			       "%6.1f TFLOP/s | call / (staging + attention) %.2f\n",
			       N, C, r.call, r.stage, bytes / (r.stage * 1e-3) / 1e9, r.h2d / r.stage,
			       bytes / (r.h2d * 1e-3) / 1e9, r.attend, flops / (r.attend * 1e-3) / 1e12,
			       r.call / (r.stage + r.attend));
			printf("csv,%u,%u,%.4f,%.4f,%.4f,%.4f\n", N, C, r.call, r.stage, r.h2d, r.attend);
			fflush(stdout);
		}
	CK(cudaStreamDestroy(st));
	return 0;
}
