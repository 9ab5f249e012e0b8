/* SPDX-License-Identifier: MIT */
/*
 * kvtier's side of bench/gpu_decode, gpu_throughput and gpu_spilled: a chunked prefill of
 * generated K/V into n_seqs sequences of one layer through the public API (CUDA backend), one
 * kvt_attend compared with the resident kernel's output on the same query (when given), with an
 * NVMe tier every sequence spilled, then timed decode steps (kvt_append + kvt_attend). Included
 * after gpu_decode_workload.cuh.
 */
#ifndef KVT_BENCH_GPU_DECODE_KVTIER_CUH
#define KVT_BENCH_GPU_DECODE_KVTIER_CUH

#include "constants.h" /* KVT_GPU_HOT_TAG_BYTES */

/* How a kvtier run goes. */
struct kvt_run {
	int steps = 40, warmup = 8;
	uint32_t budget_max = 0;
	long gpu_cache_mib = -1;       /* kvt_config.gpu_cache_bytes in MiB; -1: the library's
					  default (the self-sized cache) */
	uint64_t gpu_cache_max = 0;    /* kvt_config.gpu_cache_max_bytes (0: the library's) */
	const char *nvme_path = NULL;  /* an NVMe tier in this file (created, removed at the end):
					  every sequence is spilled after the prefill, so the steps
					  read their rows from it (bench/gpu_spilled); NULL: none */
	uint64_t nvme_cache_mib = 0;   /* kvt_config.nvme_cache_bytes in MiB (0: the library's) */
	uint32_t nvme_qd = 0;          /* kvt_config.nvme_queue_depth (0: the library's) */
	bool graph = false;            /* after the eager steps, the same steps with kvt_attend_graph
					  captured once and replayed (kvt_append stays eager) */
	float keep_weight = 0.0f;      /* kvt_config.keep_weight (doc/hysteresis.md); graphs refuse
					  it, so the caller turns `graph` off with it */
};

/* The defaults with the graph's replay measured too. */
static inline kvt_run run_with_graph()
{
	kvt_run r;
	r.graph = true;
	return r;
}

/* What the kvtier run of one (context, batch) found; ok == false when the library failed. */
struct kvt_result {
	bool ok = false;
	float ms = 0, wall_ms = 0;
	double mean_wall_ms = 0; /* the mean of the timed steps' wall times (per-step means compare with it) */
	double sel_frac = 0, hit_rate = 0, pcie_per_step = 0, hbm_bytes = 0, err_vs_exact = -1;
	double hot_bytes = 0; /* the hot cache at the end: rows and their tags */
	double ns[5] = {0, 0, 0, 0, 0};
	uint64_t budget_max_hits = 0, flushes = 0;
	double scan_hist = 0; /* of the timed steps' query-head thresholds, those decided from the
			       * scan's histogram (kvt_stats.scan_hist_hits) */
	/* per timed step, with an NVMe tier: bytes and read I/Os from the files, the block cache's
	 * 4 KiB chunk hits over hits + misses, and the hot cache's missed rows' bytes (what the
	 * selection needed from beyond HBM) */
	double nvme_per_step = 0, nvme_reads_per_step = 0, bcache_hit_rate = 0, miss_bytes_per_step = 0;
	double nvme_ms_per_step = 0; /* wall time inside the NVMe reads (kvt_stats ns_nvme) */
	double spilled_bytes = 0; /* moved to NVMe by the spills */
	int host_numa_node = -1;  /* kvt_stats.host_numa_node */
	/* kvt_run.graph: the median step (kvt_append + the replay, CUDA events), and whether the
	 * last replay's output equals an eager kvt_attend's on the same sequences, bit for bit; the
	 * timed replays' hot-cache hit rate and PCIe bytes per step (the cache frozen by the
	 * capture, where the eager steps' figures include its growths) */
	float graph_ms = 0;
	bool graph_same = false;
	double graph_hit_rate = 0, graph_pcie_per_step = 0;
};

/* The hot cache's hit rate between two reads of a layer's counters (0 when nothing was read). */
static inline double hot_hit_rate(const kvt_layer_stats &a, const kvt_layer_stats &b)
{
	const uint64_t hits = b.hot_hits - a.hot_hits, miss = b.hot_misses - a.hot_misses;
	return hits + miss ? (double)hits / (double)(hits + miss) : 0;
}

#define KVT_OR_FAIL(call)                                                                          \
	do {                                                                                       \
		const int rc_ = (call);                                                            \
		if (rc_ < 0) {                                                                     \
			printf("  kvtier: %s returned %d (%s): %s\n", #call, rc_,                  \
			       kvt_strerror(rc_), kvt_last_error(cache));                          \
			goto out;                                                                  \
		}                                                                                  \
	} while (0)

/*
 * Prefill n tokens into n_seqs sequences, compare one kvt_attend with the resident result on the
 * same query, then time warm-up + steps decode steps (kvt_append + kvt_attend).
 * res_out: the resident kernel's fp32 output for the query of step 0 (the compare), or NULL: no
 * compare (err_vs_exact stays -1).
 */
static kvt_result run_kvtier(const kvt_run &o, const gen_tables &g, uint32_t n_seqs, uint32_t n,
			     const uint16_t *q0, const float *res_out, cudaStream_t st)
{
	kvt_result r;
	kvt_cache *cache = NULL;
	kvt_config cfg = KVT_CONFIG_INIT;
	const uint32_t chunk_max = 65536, total_steps = (uint32_t)(o.warmup + o.steps);
	uint16_t *ck = NULL, *cv = NULL, *cq = NULL, *sk = NULL, *sv = NULL, *sq = NULL, *out = NULL;
	std::vector<uint32_t> seqs(n_seqs);
	std::vector<float> tms, twall;
	kvt_stats s0, s1;
	kvt_layer_stats l0, l1;
	cudaEvent_t e0, e1;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t gexec = NULL;
	int32_t *dslots = NULL, *dlen = NULL;
	uint16_t *outg = NULL, *gq = NULL;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	const size_t step_kv = (size_t)n_seqs * HKV * D, step_q = (size_t)n_seqs * HQ * D;

	cfg.n_layers = 1;
	cfg.n_q_heads = HQ;
	cfg.n_kv_heads = HKV;
	cfg.head_dim = D;
	cfg.backend = KVT_BACKEND_CUDA;
	{
		/* rows of every block the tokens fill, with the decode steps and a spare block */
		const uint64_t blocks = (n + total_steps + 255) / 256 + 1;
		cfg.host_bytes = (uint64_t)n_seqs * HKV * blocks * 256 * ROW;
		cfg.host_bytes += cfg.host_bytes / 32 + ((uint64_t)64 << 20);
	}
	cfg.budget_max = o.budget_max;
	cfg.keep_weight = o.keep_weight;
	const uint64_t nvme_bytes = cfg.host_bytes + cfg.host_bytes / 8 + ((uint64_t)64 << 20);
	if (o.nvme_path) {
		/* 256 rows of payload per block plus its header and checksums, 4 KiB aligned: an
		 * eighth more is room to spare */
		cfg.n_nvme = 1;
		cfg.nvme_paths = &o.nvme_path;
		cfg.nvme_bytes = &nvme_bytes;
		cfg.nvme_cache_bytes = o.nvme_cache_mib << 20;
		cfg.nvme_queue_depth = o.nvme_qd;
	}
	if (o.gpu_cache_mib >= 0)
		cfg.gpu_cache_bytes = KVT_EXACT64((uint64_t)o.gpu_cache_mib << 20); /* 0: none */
	else
		cfg.gpu_cache_max_bytes = o.gpu_cache_max;
	{
		const int rc = kvt_cache_create(&cfg, &cache);
		if (rc < 0) {
			printf("  kvtier: kvt_cache_create returned %d (%s): %s\n", rc,
			       kvt_strerror(rc), kvt_last_error(NULL));
			goto out; /* nothing else made yet: kvt_cache_destroy(NULL), cudaFree(NULL) */
		}
	}
	CK(cudaMalloc((void **)&ck, (size_t)chunk_max * HKV * D * 2));
	CK(cudaMalloc((void **)&cv, (size_t)chunk_max * HKV * D * 2));
	CK(cudaMalloc((void **)&cq, (size_t)chunk_max * HQ * D * 2));
	CK(cudaMalloc((void **)&sk, step_kv * total_steps * 2));
	CK(cudaMalloc((void **)&sv, step_kv * total_steps * 2));
	CK(cudaMalloc((void **)&sq, step_q * total_steps * 2));
	CK(cudaMalloc((void **)&out, step_q * 2));
	for (uint32_t s = 0; s < n_seqs; s++)
		KVT_OR_FAIL(kvt_seq_open(cache, &seqs[s]));

	/* prefill, in chunks of at most 64K tokens */
	{
		const auto t0 = std::chrono::steady_clock::now();
		for (uint32_t s = 0; s < n_seqs; s++)
			for (uint32_t p0 = 0; p0 < n; p0 += chunk_max) {
				const uint32_t c = std::min(chunk_max, n - p0);
				launch_fill_kv(g, ck, cv, s, 1, p0, c, 0, st);
				launch_fill_q(g, cq, c, 0, 1, 1, p0, st);
				KVT_OR_FAIL(kvt_prefill(cache, seqs[s], 0, cq, ck, cv, c, st));
			}
		CK(cudaStreamSynchronize(st));
		const double sec =
			std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
		printf("  kvtier prefill: %u x %u tokens in %.2f s (%.1f M tokens/s, generation "
		       "included)\n",
		       n_seqs, n, sec, n_seqs * (double)n / sec / 1e6);
	}

	/* the same query as the resident run, over the same tokens: how far Top-p is from exact */
	if (res_out) {
		KVT_OR_FAIL(kvt_attend(cache, 0, n_seqs, seqs.data(), q0, out, st));
		std::vector<uint16_t> ho(step_q);
		std::vector<float> hr(step_q);
		CK(cudaMemcpyAsync(ho.data(), out, step_q * 2, cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(hr.data(), res_out, step_q * 4, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));
		std::vector<double> ref(hr.begin(), hr.end());
		std::vector<float> got(step_q);
		for (size_t i = 0; i < step_q; i++)
			got[i] = h2f(ho[i]);
		r.err_vs_exact = rel_error(got.data(), ref.data(), (size_t)n_seqs * HQ);
	}

	/* everything but each sequence's window blocks to NVMe: the steps read their rows there */
	if (o.nvme_path)
		for (uint32_t s = 0; s < n_seqs; s++) {
			const int64_t moved = kvt_seq_spill(cache, seqs[s]);
			if (moved < 0) {
				printf("  kvtier: kvt_seq_spill returned %d (%s): %s\n", (int)moved,
				       kvt_strerror((int)moved), kvt_last_error(cache));
				goto out;
			}
			r.spilled_bytes += (double)moved;
		}

	/* the decode steps' inputs: token n + i of every sequence, the query of step i + 1 */
	for (uint32_t i = 0; i < total_steps; i++) {
		launch_fill_kv(g, sk + i * step_kv, sv + i * step_kv, 0, n_seqs, n + i, 1, 0, st);
		launch_fill_q(g, sq + i * step_q, n_seqs, i + 1, n, 0, 0, st);
	}
	CK(cudaStreamSynchronize(st));

	s0.size = s1.size = sizeof(kvt_stats);
	l0.size = l1.size = sizeof(kvt_layer_stats);
	for (uint32_t i = 0; i < total_steps; i++) {
		if (i == (uint32_t)o.warmup) {
			KVT_OR_FAIL(kvt_get_stats(cache, &s0));
			KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &l0));
		}
		const auto t0 = std::chrono::steady_clock::now();
		CK(cudaEventRecord(e0, st));
		KVT_OR_FAIL(kvt_append(cache, 0, n_seqs, seqs.data(), sk + i * step_kv,
				       sv + i * step_kv, st));
		KVT_OR_FAIL(kvt_attend(cache, 0, n_seqs, seqs.data(), sq + i * step_q, out, st));
		CK(cudaEventRecord(e1, st));
		CK(cudaEventSynchronize(e1));
		const double wall =
			std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
		float ms;
		CK(cudaEventElapsedTime(&ms, e0, e1));
		if (i >= (uint32_t)o.warmup) {
			tms.push_back(ms);
			twall.push_back((float)(wall * 1e3));
		}
	}
	KVT_OR_FAIL(kvt_get_stats(cache, &s1));
	KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &l1));
	{
		const double steps = o.steps;
		r.ms = median(tms);
		r.wall_ms = median(twall);
		r.host_numa_node = s1.host_numa_node;
		for (float w : twall)
			r.mean_wall_ms += w / twall.size();
		const uint64_t cand = s1.candidate_tokens - s0.candidate_tokens;
		r.sel_frac = cand ? (double)(s1.selected_tokens - s0.selected_tokens) / cand : 0;
		const uint64_t miss = l1.hot_misses - l0.hot_misses;
		r.hit_rate = hot_hit_rate(l0, l1);
		r.pcie_per_step = (double)(l1.pcie_bytes - l0.pcie_bytes) / steps;
		r.hot_bytes = (double)l1.hot_rows * (ROW + KVT_GPU_HOT_TAG_BYTES);
		r.hbm_bytes = (double)s1.index_bytes + (double)l1.hot_rows * ROW +
			      (double)n_seqs * HKV * (KVT_DEFAULT_WINDOW + KVT_DEFAULT_FLUSH_BATCH) * ROW;
		r.ns[0] = (double)(s1.ns_index - s0.ns_index) / steps;
		r.ns[1] = (double)(s1.ns_store - s0.ns_store) / steps;
		r.ns[2] = (double)(s1.ns_score - s0.ns_score) / steps;
		r.ns[3] = (double)(s1.ns_select - s0.ns_select) / steps;
		r.ns[4] = (double)(s1.ns_attend - s0.ns_attend) / steps;
		r.budget_max_hits = s1.budget_max_hits - s0.budget_max_hits;
		r.scan_hist = (double)(s1.scan_hist_hits - s0.scan_hist_hits) / (steps * n_seqs * HQ);
		r.flushes = s1.flushes - s0.flushes;
		r.nvme_per_step = (double)(s1.nvme_bytes_read - s0.nvme_bytes_read) / steps;
		r.nvme_reads_per_step = (double)(s1.nvme_reads - s0.nvme_reads) / steps;
		r.nvme_ms_per_step = (double)(s1.ns_nvme - s0.ns_nvme) * 1e-6 / steps;
		const uint64_t ch = s1.nvme_cache_hits - s0.nvme_cache_hits,
			       cm = s1.nvme_cache_misses - s0.nvme_cache_misses;
		r.bcache_hit_rate = ch + cm ? (double)ch / (ch + cm) : 0;
		r.miss_bytes_per_step = (double)miss * ROW / steps;
		r.ok = true;
	}

	/* the same steps with the attention replayed from a graph captured once: reserve bounds for
	 * every token still to come, write each step's lengths before it (untimed, as a runtime
	 * keeps them on the device), then time kvt_append + the replay */
	if (o.graph) {
		KVT_OR_FAIL(kvt_graph_reserve(cache, n_seqs, n + 3 * total_steps + 8, st));
		std::vector<int32_t> hs(n_seqs), hl(n_seqs);
		CK(cudaMalloc((void **)&dslots, sizeof(int32_t) * n_seqs));
		CK(cudaMalloc((void **)&dlen, sizeof(int32_t) * n_seqs));
		CK(cudaMalloc((void **)&outg, step_q * 2));
		CK(cudaMalloc((void **)&gq, step_q * 2)); /* the captured query: each step's copied in */
		for (uint32_t s = 0; s < n_seqs; s++)
			hs[s] = (int32_t)seqs[s];
		/* on st: a cudaMemcpy from pageable memory returns before its bytes land, and the
		 * graph step on the non-blocking st would not wait for them */
		CK(cudaMemcpyAsync(dslots, hs.data(), sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice,
				   st));
		const kvt_graph_batch gb = {n_seqs, 0, dslots, dlen, NULL};
		uint32_t at = 0; /* the step inputs, reused in turn */
		auto next = [&]() { /* the lengths after the coming append; its inputs */
			CK(cudaStreamSynchronize(st));
			for (uint32_t s = 0; s < n_seqs; s++)
				hl[s] = (int32_t)kvt_seq_length(cache, seqs[s], 0) + 1;
			CK(cudaMemcpyAsync(dlen, hl.data(), sizeof(int32_t) * n_seqs,
					   cudaMemcpyHostToDevice, st));
			return at++ % total_steps;
		};
		for (int i = 0; i < o.warmup; i++) { /* sizes the hot cache at the reserved layout */
			const uint32_t k = next();
			KVT_OR_FAIL(kvt_append(cache, 0, n_seqs, seqs.data(), sk + k * step_kv,
					       sv + k * step_kv, st));
			KVT_OR_FAIL(kvt_attend_graph(cache, 0, &gb, sq + k * step_q, outg, st));
		}
		CK(cudaStreamSynchronize(st));
		CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
		KVT_OR_FAIL(kvt_attend_graph(cache, 0, &gb, gq, outg, st));
		CK(cudaStreamEndCapture(st, &graph));
		CK(cudaGraphInstantiate(&gexec, graph, 0));
		std::vector<float> tg;
		kvt_layer_stats g0, g1;
		g0.size = g1.size = sizeof(kvt_layer_stats);
		for (int i = 0; i < o.warmup + o.steps; i++) {
			if (i == o.warmup) /* untimed: the last step has ended */
				KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &g0));
			const uint32_t k = next();
			CK(cudaMemcpyAsync(gq, sq + k * step_q, step_q * 2, cudaMemcpyDeviceToDevice,
					   st));
			CK(cudaEventRecord(e0, st));
			KVT_OR_FAIL(kvt_append(cache, 0, n_seqs, seqs.data(), sk + k * step_kv,
					       sv + k * step_kv, st));
			CK(cudaGraphLaunch(gexec, st));
			CK(cudaEventRecord(e1, st));
			CK(cudaEventSynchronize(e1));
			float ms;
			CK(cudaEventElapsedTime(&ms, e0, e1));
			if (i >= o.warmup)
				tg.push_back(ms);
		}
		r.graph_ms = median(tg);
		KVT_OR_FAIL(kvt_get_layer_stats(cache, 0, &g1));
		r.graph_hit_rate = hot_hit_rate(g0, g1);
		r.graph_pcie_per_step = (double)(g1.pcie_bytes - g0.pcie_bytes) / o.steps;
		/* the last replay against an eager step of the same sequences and query */
		KVT_OR_FAIL(kvt_attend(cache, 0, n_seqs, seqs.data(), gq, out, st));
		std::vector<uint16_t> he(step_q), hg(step_q);
		CK(cudaMemcpyAsync(he.data(), out, step_q * 2, cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(hg.data(), outg, step_q * 2, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));
		r.graph_same = memcmp(he.data(), hg.data(), step_q * 2) == 0;
	}
out:
	CK(cudaStreamSynchronize(st));
	if (gexec)
		CK(cudaGraphExecDestroy(gexec)); /* before the cache: it reads the reservation */
	if (graph)
		CK(cudaGraphDestroy(graph));
	kvt_cache_destroy(cache);
	for (void *p : {(void *)ck, (void *)cv, (void *)cq, (void *)sk, (void *)sv, (void *)sq,
			(void *)out, (void *)dslots, (void *)dlen, (void *)outg, (void *)gq})
		CK(cudaFree(p));
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	return r;
}

#endif
