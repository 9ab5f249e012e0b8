/* SPDX-License-Identifier: MIT */
/*
 * The decode step of one layer replayed from a captured CUDA graph (kvt_attend_graph) against the
 * same step made by an eager kvt_attend, in the same run, on the same cache (32 query / 8 KV heads,
 * head_dim 128, fp16, the Llama-3.1-8B shape), at batch 1, 8 and 64. Each timed step first appends
 * one token to every sequence (eager, untimed), then times with CUDA events, after warm-up, the
 * eager kvt_attend, then the graph's replay (the slot and length buffers written before it,
 * untimed): the ratio replay / eager is what a runtime gains from the graph (the launches the
 * host no longer issues). The replay's outputs are compared with the eager step's, bit for bit.
 * Last, the eager step without the reservation (laid out by its batch, not by the bounds): the
 * ratio reserved / unreserved is what the reserved layout costs.
 * Usage: gpu_graph [--steps N] (default 30 timed after 5 of warm-up).
 */
#include <cstdint>
#include <cstring>

#include "gpu_bench.cuh"
#include "kvtier.h"

static __global__ void k_fill(uint16_t *x, size_t n, uint64_t seed)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		/* fp16 in about [-1, 1): sign, exponent 14 or less, random mantissa */
		const uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
		x[i] = (uint16_t)((h & 0x8000u) | (((h >> 16) % 15u) << 10) | (h & 0x3ffu));
	}
}

static void fill(void *x, size_t n, uint64_t seed, cudaStream_t st)
{
	k_fill<<<256, 256, 0, st>>>((uint16_t *)x, n, seed);
	CK(cudaGetLastError());
}

enum { HQ = 32, HKV = 8, D = 128 };

static void run(uint32_t batch, uint32_t ctx, int steps)
{
	const int warmup = 5;
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	cfg.n_q_heads = HQ;
	cfg.n_kv_heads = HKV;
	cfg.head_dim = D;
	cfg.dtype = KVT_DTYPE_F16;
	cfg.out_dtype = KVT_DTYPE_F16;
	cfg.backend = KVT_BACKEND_CUDA;
	cfg.max_seqs = batch;
	cfg.host_bytes = ((uint64_t)batch * (ctx + 1024) * HKV * D * 4 + (64u << 20));
	kvt_cache *cache = NULL;
	KVT_MUST(kvt_cache_create(&cfg, &cache));
	cudaStream_t st;
	CK(cudaStreamCreate(&st));
	const uint32_t chunk = 4096;
	const size_t krow = (size_t)HKV * D, qrow = (size_t)HQ * D;
	void *k, *v, *q, *out_e, *out_g;
	CK(cudaMalloc(&k, sizeof(uint16_t) * chunk * krow));
	CK(cudaMalloc(&v, sizeof(uint16_t) * chunk * krow));
	CK(cudaMalloc(&q, sizeof(uint16_t) * (chunk > batch ? chunk : batch) * qrow));
	CK(cudaMalloc(&out_e, sizeof(uint16_t) * batch * qrow));
	CK(cudaMalloc(&out_g, sizeof(uint16_t) * batch * qrow));
	std::vector<uint32_t> seqs(batch);
	for (uint32_t s = 0; s < batch; s++) {
		KVT_MUST(kvt_seq_open(cache, &seqs[s]));
		for (uint32_t at = 0; at < ctx; at += chunk) {
			const uint32_t n = ctx - at < chunk ? ctx - at : chunk;
			fill(k, n * krow, 1000 * s + at + 1, st);
			fill(v, n * krow, 1000 * s + at + 2, st);
			fill(q, n * qrow, 1000 * s + at + 3, st);
			KVT_MUST(kvt_prefill(cache, seqs[s], 0, q, k, v, n, st));
		}
	}
	/* every token the run appends: 3 warm-up steps, then three timed loops */
	KVT_MUST(kvt_graph_reserve(cache, batch, ctx + 3 * (warmup + steps) + 8, st));
	int32_t *dslots, *dlen, *hslots, *hlen;
	CK(cudaMalloc((void **)&dslots, sizeof(int32_t) * batch));
	CK(cudaMalloc((void **)&dlen, sizeof(int32_t) * batch));
	CK(cudaMallocHost((void **)&hslots, sizeof(int32_t) * batch));
	CK(cudaMallocHost((void **)&hlen, sizeof(int32_t) * batch));
	for (uint32_t s = 0; s < batch; s++)
		hslots[s] = (int32_t)seqs[s];
	CK(cudaMemcpy(dslots, hslots, sizeof(int32_t) * batch, cudaMemcpyHostToDevice));
	const kvt_graph_batch gb = {batch, 0, dslots, dlen, NULL};
	auto lengths = [&]() {
		CK(cudaStreamSynchronize(st)); /* the last copy out of hlen has been made */
		for (uint32_t s = 0; s < batch; s++)
			hlen[s] = (int32_t)kvt_seq_length(cache, seqs[s], 0);
		CK(cudaMemcpyAsync(dlen, hlen, sizeof(int32_t) * batch, cudaMemcpyHostToDevice, st));
	};
	auto append = [&](int i) {
		fill(k, batch * krow, 7000 + 2 * i, st);
		fill(v, batch * krow, 7001 + 2 * i, st);
		fill(q, batch * qrow, 9000 + i, st);
		KVT_MUST(kvt_append(cache, 0, batch, seqs.data(), k, v, st));
		lengths();
	};
	/* warm-up at the graph's shape (sizes the hot cache), then the capture */
	for (int i = 0; i < 3; i++) {
		append(i);
		KVT_MUST(kvt_attend(cache, 0, batch, seqs.data(), q, out_e, st));
		KVT_MUST(kvt_attend_graph(cache, 0, &gb, q, out_g, st));
	}
	CK(cudaStreamSynchronize(st));
	cudaGraph_t g;
	cudaGraphExec_t exec;
	CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
	KVT_MUST(kvt_attend_graph(cache, 0, &gb, q, out_g, st));
	CK(cudaStreamEndCapture(st, &g));
	CK(cudaGraphInstantiate(&exec, g, 0));
	std::vector<float> tg;
	std::vector<uint16_t> he(batch * qrow), hg(batch * qrow);
	uint32_t differ = 0;
	cudaEvent_t e0, e1, e2;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaEventCreate(&e2));
	for (int i = 0; i < warmup + steps; i++) {
		append(100 + i);
		KVT_MUST(kvt_attend(cache, 0, batch, seqs.data(), q, out_e, st)); /* the reference */
		CK(cudaStreamSynchronize(st));
		CK(cudaEventRecord(e1, st));
		CK(cudaGraphLaunch(exec, st));
		CK(cudaEventRecord(e2, st));
		CK(cudaEventSynchronize(e2));
		float b;
		CK(cudaEventElapsedTime(&b, e1, e2));
		if (i >= warmup)
			tg.push_back(b);
		CK(cudaMemcpy(he.data(), out_e, sizeof(uint16_t) * he.size(), cudaMemcpyDeviceToHost));
		CK(cudaMemcpy(hg.data(), out_g, sizeof(uint16_t) * hg.size(), cudaMemcpyDeviceToHost));
		differ += memcmp(he.data(), hg.data(), sizeof(uint16_t) * he.size()) != 0;
	}
	/* the eager step timed alone, between the same appends: within the reservation (laid out
	 * by its bounds, as the replay), then without one (laid out by the batch) */
	auto eager = [&](int base) {
		std::vector<float> t;
		for (int i = 0; i < warmup + steps; i++) {
			append(base + i);
			CK(cudaStreamSynchronize(st));
			CK(cudaEventRecord(e0, st));
			KVT_MUST(kvt_attend(cache, 0, batch, seqs.data(), q, out_e, st));
			CK(cudaEventRecord(e1, st));
			CK(cudaEventSynchronize(e1));
			float a;
			CK(cudaEventElapsedTime(&a, e0, e1));
			if (i >= warmup)
				t.push_back(a);
		}
		return median(t);
	};
	const float me = eager(500);
	CK(cudaGraphExecDestroy(exec)); /* the graph reads the reservation's memory */
	exec = NULL;
	KVT_MUST(kvt_graph_reserve(cache, 0, 0, st));
	const float mu = eager(700);
	const float mg = median(tg);
	printf("  batch %2u x %6u tokens: eager %8.3f ms  replay %8.3f ms  replay/eager %.3f  "
	       "outputs differ in %u of %d steps; eager without a reservation %.3f ms (reserved / "
	       "unreserved %.3f)\n",
	       batch, ctx, me, mg, mg / me, differ, warmup + steps, mu, me / mu);
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	CK(cudaEventDestroy(e2));
	CK(cudaGraphDestroy(g));
	CK(cudaFree(dslots));
	CK(cudaFree(dlen));
	CK(cudaFreeHost(hslots));
	CK(cudaFreeHost(hlen));
	CK(cudaFree(k));
	CK(cudaFree(v));
	CK(cudaFree(q));
	CK(cudaFree(out_e));
	CK(cudaFree(out_g));
	CK(cudaStreamDestroy(st));
	kvt_cache_destroy(cache);
}

int main(int argc, char **argv)
{
	cudaDeviceProp prop;
	if (!bench_device("gpu_graph", &prop))
		return 0;
	int steps = 30;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
			steps = atoi(argv[++i]);
		} else {
			fprintf(stderr, "usage: gpu_graph [--steps N]\n");
			return 2;
		}
	}
	if (steps < 1)
		steps = 1;
	printf("gpu_graph: one layer's decode step, eager kvt_attend vs the replay of a captured "
	       "kvt_attend_graph (%s; medians of %d, CUDA events)\n",
	       prop.name, steps);
	run(1, 32768, steps);
	run(8, 32768, steps);
	run(64, 8192, steps);
	return 0;
}
