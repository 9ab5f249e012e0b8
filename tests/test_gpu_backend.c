/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend through the public interface, against the CPU backend on kvbench's workload
 * (tools/workload.c: sinks, recency, heavy hitters, needles; fp16):
 * - pipeline: two sequences prefilled in two chunks each (the second chunk indexes the first one's
 *   window from the ring), then many decode steps with lazy flushes; at every step the selected
 *   token positions of every (sequence, KV head) lie between those of two CPU caches at p - delta
 *   and p + delta, delta = 2^-19 + n 2^-38 >= tol / Z (the scores are bit-equal; the GPU's mass
 *   sums may move the boundary by the tokens whose cumulative mass lies within the tolerance
 *   gpu/select.cuh states, and Top-p sets, the clamp and the union grow with p); the sets that
 *   differ from the CPU's at p are counted and printed; the attention outputs are within 1e-3
 *   relative error (L2 per query head) of the CPU's;
 * - graph: kvt_attend captured into a CUDA graph and replayed gives the eager call's output bit
 *   for bit, with a fixed and with the self-sized hot cache (frozen by the capture);
 * - spilled: a sequence spilled to NVMe is attended and gathered in place (issue 14): nothing is
 *   restored, the selected rows are read from the disk, the output equals the one before the spill
 *   and the gathered rows the written ones; each completion of the step failed in turn fails it
 *   with -EIO and the next step is exact (in a build with liburing, which the NVMe tier needs);
 * - bad key: a NaN key in a sequence's first chunk fails none of the batches it joins;
 * - LRU undo: an append whose device verb fails after the host tier made room by spilling another
 *   sequence gives the grown blocks back and reads the victim back (issue 11, defect 3): every
 *   injected failure changes nothing, and the final outputs equal a fault-free twin's bit for bit;
 * Exits 77 (skipped) when no CUDA device is present.
 */
#include "gpu_pair.h"

static void test_pipeline(void **state)
{
	(void)state;
	struct pair p;
	const uint32_t steps = g_quick ? 20 : 120, T = 4096 + steps + 8;
	g_bound_delta = (float)(0x1p-19 + T * 0x1p-38);
	pair_init(&p, 4096, steps, 64u << 20);
	g_bound_delta = 0.0f;
	int32_t *cnt_b = malloc(sizeof(int32_t) * 2 * NSEQ * HKV);
	int32_t *pos_b = malloc(sizeof(int32_t) * 2 * NSEQ * HKV * T);
	int32_t *cnt_c = malloc(sizeof(int32_t) * NSEQ * HKV), *cnt_g = malloc(sizeof(int32_t) * NSEQ * HKV);
	int32_t *pos_c = malloc(sizeof(int32_t) * NSEQ * HKV * T);
	int32_t *pos_g = malloc(sizeof(int32_t) * NSEQ * HKV * T);
	int32_t *dpos;
	CU(cudaMalloc((void **)&dpos, sizeof(int32_t) * NSEQ * HKV * T));
	uint32_t diff_sets = 0, compared = 0, worst_diff = 0, outside = 0;
	double worst = 0.0;
	for (uint32_t step = 0; step < steps; step++)
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			append_both(&p, layer, step);
			int mc = kvt_select(p.cpu, layer, NSEQ, p.sc, p.hq, NULL);
			int mg = kvt_select(p.gpu, layer, NSEQ, p.sg, p.dq, NULL);
			T_CHECK(mc > 0 && mg > 0, "select: cpu %d gpu %d: %s / %s", mc, mg,
				kvt_last_error(p.cpu), kvt_last_error(p.gpu));
			/* every other step the gather takes the batch in reverse: slots out of order,
			 * so the layer's bits are listed one sequence at a time */
			uint32_t rc_[NSEQ], rg_[NSEQ], order[NSEQ];
			const bool rev = step % 2 == 1;
			for (uint32_t i = 0; i < NSEQ; i++) {
				order[i] = rev ? NSEQ - 1 - i : i;
				rc_[i] = p.sc[order[i]];
				rg_[i] = p.sg[order[i]];
			}
			cpu_positions(p.lo, layer, p.sl, p.hq, order, T, cnt_b, pos_b);
			cpu_positions(p.hi, layer, p.sh, p.hq, order, T, cnt_b + NSEQ * HKV,
				pos_b + (size_t)NSEQ * HKV * T);
			OK(p.cpu, kvt_gather(p.cpu, layer, NSEQ, rc_, T, cnt_c, pos_c, NULL, NULL, NULL));
			OK(p.gpu, kvt_gather(p.gpu, layer, NSEQ, rg_, T, cnt_g, dpos, NULL, NULL, NULL));
			CU(cudaMemcpy(pos_g, dpos, sizeof(int32_t) * NSEQ * HKV * T,
				      cudaMemcpyDeviceToHost));
			for (uint32_t it = 0; it < NSEQ * HKV; it++) {
				compared++;
				const int32_t *pg = pos_g + (size_t)it * T;
				bool sub, lo_in, in_hi;
				const uint32_t d = pos_diff(pos_c + (size_t)it * T, cnt_c[it], pg,
							    cnt_g[it], &sub);
				(void)pos_diff(pos_b + (size_t)it * T, cnt_b[it], pg, cnt_g[it], &lo_in);
				(void)pos_diff(pg, cnt_g[it], pos_b + ((size_t)NSEQ * HKV + it) * T,
					       cnt_b[NSEQ * HKV + it], &in_hi);
				if (!lo_in || !in_hi) {
					outside++;
					print_error("step %u layer %u item %u: the GPU's %d tokens are not "
						    "between p - delta's %d and p + delta's %d\n",
						    step, layer, it, cnt_g[it], cnt_b[it],
						    cnt_b[NSEQ * HKV + it]);
				}
				if (d) {
					diff_sets++;
					worst_diff = d > worst_diff ? d : worst_diff;
					print_error("step %u layer %u item %u: cpu %d tokens, gpu %d, "
						    "%u differ\n",
						    step, layer, it, cnt_c[it], cnt_g[it], d);
				}
			}
			attend_both(&p, layer, step, &worst);
		}
	kvt_stats sc = {.size = sizeof sc}, sg = {.size = sizeof sg};
	OK(p.cpu, kvt_get_stats(p.cpu, &sc));
	OK(p.gpu, kvt_get_stats(p.gpu, &sg));
	printf("pipeline: %u of %u selected sets differ (at most %u tokens); worst output error %.3g; "
	       "flushes cpu %llu "
	       "gpu %llu; selected cpu %llu gpu %llu; hot hits %llu misses %llu\n",
	       diff_sets, compared, worst_diff, worst, (unsigned long long)sc.flushes,
	       (unsigned long long)sg.flushes, (unsigned long long)sc.selected_tokens,
	       (unsigned long long)sg.selected_tokens, (unsigned long long)sg.hot_hits,
	       (unsigned long long)sg.hot_misses);
	T_CHECK(outside == 0,
		"%u of %u selected sets outside the window (differing from the CPU's: %u, by up to %u "
		"tokens)",
		outside, compared, diff_sets, worst_diff);
	/* the budget clamps of each query head: the same wherever the sets are (each differing set
	 * may differ in all G of its heads) */
	const uint64_t bmin_d = sc.budget_min_hits > sg.budget_min_hits
					? sc.budget_min_hits - sg.budget_min_hits
					: sg.budget_min_hits - sc.budget_min_hits;
	printf("pipeline: budget_min hits cpu %llu gpu %llu, budget_max hits cpu %llu gpu %llu\n",
	       (unsigned long long)sc.budget_min_hits, (unsigned long long)sg.budget_min_hits,
	       (unsigned long long)sc.budget_max_hits, (unsigned long long)sg.budget_max_hits);
	T_CHECK(bmin_d <= (uint64_t)diff_sets * (HQ / HKV) && sc.budget_max_hits == 0 &&
			sg.budget_max_hits == 0,
		"budget hits: min cpu %llu gpu %llu (%u sets differ), max cpu %llu gpu %llu",
		(unsigned long long)sc.budget_min_hits, (unsigned long long)sg.budget_min_hits,
		diff_sets, (unsigned long long)sc.budget_max_hits,
		(unsigned long long)sg.budget_max_hits);
	T_CHECK(sc.flushes == sg.flushes && sc.flushes > 0, "flushes cpu %llu gpu %llu",
		(unsigned long long)sc.flushes, (unsigned long long)sg.flushes);
	T_CHECK(sc.tokens == sg.tokens && sc.tokens_indexed == sg.tokens_indexed, "token counts");
	T_CHECK(sg.hot_hits > 0, "no hot-cache hit in %u steps", steps);
	free(cnt_c);
	free(cnt_g);
	free(pos_c);
	free(pos_g);
	free(cnt_b);
	free(pos_b);
	cudaFree(dpos);
	pair_fini(&p);
}

/*
 * A step captured into a CUDA graph replays bit for bit what the eager step gives, with a fixed hot
 * cache and with the self-sized one; the latter is frozen by the capture: eager steps after it do
 * not grow it (a growth would free memory the graph reads), and the graph still replays right.
 * Then a replay with a NaN query: the next call reports it, naming no entry, once.
 */
static void test_graph(void **state)
{
	(void)state;
	for (int self_sized = 0; self_sized < 2; self_sized++) {
		struct pair p;
		pair_init(&p, 3000, 8, self_sized ? 0 : 64u << 20);
		cudaStream_t st;
		CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
		const size_t ob = sizeof(float) * NSEQ * HQ * D;
		float *eager = malloc(ob);
		decode_inputs(&p, 0, 0);
		OK(p.gpu, kvt_append(p.gpu, 0, NSEQ, p.sg, p.dk, p.dv, st));
		/* warm-up at this shape (the self-sized cache grows in its first steps), then the
		 * eager reference */
		for (int w = 0; w < (self_sized ? 4 : 1); w++) {
			OK(p.gpu, kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, st));
			CU(cudaStreamSynchronize(st));
		}
		OK(p.gpu, kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, st));
		CU(cudaStreamSynchronize(st));
		CU(cudaMemcpy(eager, p.dout, ob, cudaMemcpyDeviceToHost));
		CU(cudaMemset(p.dout, 0xff, ob));
		kvt_layer_stats l0 = {.size = sizeof l0}, l1 = {.size = sizeof l1};
		OK(p.gpu, kvt_get_layer_stats(p.gpu, 0, &l0));
		cudaGraph_t graph;
		cudaGraphExec_t exec;
		CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
		int rc = kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, st);
		CU(cudaStreamEndCapture(st, &graph));
		T_CHECK(rc == 0, "kvt_attend while capturing: %d: %s", rc, kvt_last_error(p.gpu));
		CU(cudaGraphInstantiate(&exec, graph, 0));
		for (int rep = 0; rep < 6; rep++) {
			if (rep == 3) /* eager steps between replays: the cache must not move */
				for (int e = 0; e < 3; e++) {
					OK(p.gpu, kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, st));
					CU(cudaStreamSynchronize(st));
				}
			CU(cudaMemset(p.dout, 0xff, ob));
			CU(cudaGraphLaunch(exec, st));
			CU(cudaStreamSynchronize(st));
			CU(cudaMemcpy(p.out_g, p.dout, ob, cudaMemcpyDeviceToHost));
			T_CHECK(!memcmp(p.out_g, eager, ob), "%s cache: replay %d differs from the "
				"eager step", self_sized ? "self-sized" : "fixed", rep);
		}
		OK(p.gpu, kvt_get_layer_stats(p.gpu, 0, &l1));
		T_CHECK(l1.hot_rows == l0.hot_rows && l0.hot_rows > 0,
			"%s cache: %llu rows at capture, %llu after replays and eager steps",
			self_sized ? "self-sized" : "fixed", (unsigned long long)l0.hot_rows,
			(unsigned long long)l1.hot_rows);
		/* a replay whose query of sequence 1 is NaN: the next call reports it (a cache with
		 * captured steps names no sequence: replays raise between eager calls), then goes on */
		uint16_t nan = 0x7e00;
		CU(cudaMemcpy((uint16_t *)p.dq + (size_t)HQ * D + 5, &nan, 2, cudaMemcpyHostToDevice));
		CU(cudaGraphLaunch(exec, st));
		CU(cudaStreamSynchronize(st));
		kvt_stats sts = {.size = sizeof sts};
		rc = kvt_get_stats(p.gpu, &sts);
		T_CHECK(rc == -EINVAL && strstr(kvt_last_error(p.gpu), "non-finite") &&
				kvt_last_error_entry(p.gpu) == -1,
			"%s cache: after a NaN replay got %d (%s), entry %d", self_sized ? "self-sized" :
			"fixed", rc, kvt_last_error(p.gpu), kvt_last_error_entry(p.gpu));
		OK(p.gpu, kvt_get_stats(p.gpu, &sts)); /* reported once */
		cudaGraphExecDestroy(exec);
		cudaGraphDestroy(graph);
		cudaStreamDestroy(st);
		free(eager);
		pair_fini(&p);
	}
}

#if KVT_HAVE_LIBURING
/* A spilled sequence is restored by the step that attends it, and attends as before. */
/* The completion hook of the NVMe store: fail the n-th completion with -EIO. */
static int fail_nth(void *ctx, uint64_t nth, int res)
{
	struct { uint64_t n, seen; } *h = ctx;
	h->seen = nth > h->seen ? nth : h->seen;
	return nth == h->n && res >= 0 ? -EIO : res;
}

static void test_spilled(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 2048, 4, 64u << 20);
	kvt_cache_destroy(p.gpu);
	const char *paths[] = {"test_gpu_backend_spill.img"};
	const uint64_t sizes[] = {64u << 20};
	/* no hot cache: every selected row of a spilled block is read from the disk (with one, the
	 * rows the step before the spill cached would be served from it) */
	kvt_config cfg = config(KVT_NONE64);
	cfg.backend = KVT_BACKEND_CUDA;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = sizes;
	cfg.n_nvme = 1;
	OK(NULL, kvt_cache_create(&cfg, &p.gpu));
	uint32_t s;
	OK(p.gpu, kvt_seq_open(p.gpu, &s));
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		make(&p, 0, layer, 0, 2048, -1);
		upload(&p, 2048);
		OK(p.gpu, kvt_prefill(p.gpu, s, layer, p.dq, p.dk, p.dv, 2048, NULL));
	}
	const size_t ob = sizeof(float) * HQ * D;
	float *before = malloc(ob);
	make(&p, 0, 1, 2048, 1, 0); /* a query of layer 1 in dq */
	upload(&p, 1);
	OK(p.gpu, kvt_attend(p.gpu, 1, 1, &s, p.dq, p.dout, NULL));
	CU(cudaMemcpy(before, p.dout, ob, cudaMemcpyDeviceToHost));
	int64_t moved = kvt_seq_spill(p.gpu, s);
	T_CHECK(moved > 0, "kvt_seq_spill = %lld: %s", (long long)moved, kvt_last_error(p.gpu));
	CU(cudaMemset(p.dout, 0xff, ob));
	OK(p.gpu, kvt_attend(p.gpu, 1, 1, &s, p.dq, p.dout, NULL));
	CU(cudaMemcpy(p.out_g, p.dout, ob, cudaMemcpyDeviceToHost));
	kvt_stats st = {.size = sizeof st};
	OK(p.gpu, kvt_get_stats(p.gpu, &st));
	uint64_t host = 0, nvme = 0;
	OK(p.gpu, kvt_seq_bytes(p.gpu, s, &host, &nvme));
	printf("spilled: %lld bytes moved, %llu restores, %llu chunks read, %llu bytes still on NVMe\n",
	       (long long)moved, (unsigned long long)st.restores,
	       (unsigned long long)st.nvme_cache_misses, (unsigned long long)nvme);
	/* served in place: nothing restored, the selected rows read from the disk */
	T_CHECK(st.restores == 0 && nvme > 0, "restores = %llu, %llu bytes on NVMe",
		(unsigned long long)st.restores, (unsigned long long)nvme);
	T_CHECK(st.nvme_cache_misses > 0, "no chunk was read from NVMe");
	T_CHECK(!memcmp(before, p.out_g, ob), "output of the spilled sequence differs");
	/* the gather of that selection: the rows that were written */
	enum { MAXT = 2100 };
	int32_t counts[HKV], *pos = malloc(sizeof(int32_t) * HKV * MAXT);
	void *dpos, *gk, *gv;
	CU(cudaMalloc(&dpos, sizeof(int32_t) * HKV * MAXT));
	CU(cudaMalloc(&gk, (size_t)HKV * MAXT * D * 2));
	CU(cudaMalloc(&gv, (size_t)HKV * MAXT * D * 2));
	uint16_t *hk = malloc((size_t)HKV * MAXT * D * 2), *hv = malloc((size_t)HKV * MAXT * D * 2);
	OK(p.gpu, kvt_gather(p.gpu, 1, 1, &s, MAXT, counts, dpos, gk, gv, NULL));
	CU(cudaMemcpy(pos, dpos, sizeof(int32_t) * HKV * MAXT, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(hk, gk, (size_t)HKV * MAXT * D * 2, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(hv, gv, (size_t)HKV * MAXT * D * 2, cudaMemcpyDeviceToHost));
	for (uint32_t h = 0; h < HKV; h++)
		for (int32_t t = 0; t < counts[h]; t++) {
			const int32_t at = pos[h * MAXT + t];
			const size_t o = ((size_t)h * MAXT + t) * D;
			/* pair's rows of layer 1, sequence 0 (make() recorded them) */
			T_CHECK(!memcmp(hk + o, p.rows_k + row_at(&p, 1, 0, h, (uint32_t)at), D * 2) &&
					!memcmp(hv + o, p.rows_v + row_at(&p, 1, 0, h, (uint32_t)at), D * 2),
				"gathered row %d of KV head %u (position %d) differs", t, h, at);
		}
	/* kvt_seq_read_rows of the spilled sequence: its range has spilled rows, so the backend
	 * restores it first (lib/lifecycle.c), and the rows are the ones written */
	const size_t rb = (size_t)2048 * HKV * D * 2;
	void *rk, *rv;
	uint16_t *xk = malloc(rb), *xv = malloc(rb);
	CU(cudaMalloc(&rk, rb));
	CU(cudaMalloc(&rv, rb));
	OK(p.gpu, kvt_seq_read_rows(p.gpu, s, 1, 0, 2048, rk, rv, NULL));
	CU(cudaMemcpy(xk, rk, rb, cudaMemcpyDeviceToHost));
	CU(cudaMemcpy(xv, rv, rb, cudaMemcpyDeviceToHost));
	for (uint32_t t = 0; t < 2048; t++)
		for (uint32_t h = 0; h < HKV; h++) {
			const size_t at = ((size_t)t * HKV + h) * D, w = row_at(&p, 1, 0, h, t);
			T_CHECK(!memcmp(xk + at, p.rows_k + w, D * 2) &&
					!memcmp(xv + at, p.rows_v + w, D * 2),
				"read_rows of the spilled sequence: row %u of KV head %u "
				"differs", t, h);
		}
	OK(p.gpu, kvt_get_stats(p.gpu, &st));
	T_CHECK(st.restores == 1, "read_rows of the spilled sequence: %llu restores, wanted 1",
		(unsigned long long)st.restores);
	CU(cudaFree(rk));
	CU(cudaFree(rv));
	free(xk);
	free(xv);
	/* a failed or corrupt read fails the step with the block named, delivers nothing, and the
	 * sequence attends as before once the fault is gone: every completion of a cold step */
	uint32_t failed = 0;
	for (uint64_t n = 1; n < 64; n++) {
		struct { uint64_t n, seen; } h = {n, 0};
		kvt_cache_destroy(p.gpu);
		OK(NULL, kvt_cache_create(&cfg, &p.gpu));
		OK(p.gpu, kvt_seq_open(p.gpu, &s));
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			make(&p, 0, layer, 0, 2048, -1);
			upload(&p, 2048);
			OK(p.gpu, kvt_prefill(p.gpu, s, layer, p.dq, p.dk, p.dv, 2048, NULL));
		}
		make(&p, 0, 1, 2048, 1, 0);
		upload(&p, 1);
		T_CHECK(kvt_seq_spill(p.gpu, s) > 0, "spill: %s", kvt_last_error(p.gpu));
		kvt_nvme_set_cqe_hook(p.gpu->nvme, fail_nth, &h);
		int rc = kvt_attend(p.gpu, 1, 1, &s, p.dq, p.dout, NULL);
		kvt_nvme_set_cqe_hook(p.gpu->nvme, NULL, NULL);
		if (h.seen < n) {
			T_CHECK(rc == 0, "no fault, yet attend = %d (%s)", rc, kvt_last_error(p.gpu));
			break; /* the step has fewer completions: all were failed in turn */
		}
		T_CHECK(rc == -EIO, "completion %llu failed: attend = %d (%s)", (unsigned long long)n,
			rc, kvt_last_error(p.gpu));
		/* the read's file and offset: the block */
		T_CHECK(strstr(kvt_last_error(p.gpu), "direct serving") &&
				strstr(kvt_last_error(p.gpu), "@"),
			"the text names no block: %s", kvt_last_error(p.gpu));
		failed++;
		OK(p.gpu, kvt_attend(p.gpu, 1, 1, &s, p.dq, p.dout, NULL));
		CU(cudaMemcpy(p.out_g, p.dout, ob, cudaMemcpyDeviceToHost));
		T_CHECK(!memcmp(before, p.out_g, ob), "completion %llu failed: the next step differs",
			(unsigned long long)n);
	}
	printf("spilled: %u completions failed in turn, each step refused, the next one exact\n",
	       failed);
	T_CHECK(failed > 0, "no completion was failed");
	free(pos);
	free(hk);
	free(hv);
	CU(cudaFree(dpos));
	CU(cudaFree(gk));
	CU(cudaFree(gv));
	free(before);
	pair_fini(&p);
	remove(paths[0]);
}

/* A CUDA cache with an NVMe file and LRU spills, its host tier 32 blocks (4 MiB): sequences a and
 * b prefilled with 1024 tokens on both layers fill it. */
static kvt_cache *lru_cache(const char *path, struct pair *p, uint32_t *a, uint32_t *b)
{
	static const char *paths[1];
	static uint64_t sizes[1] = {64u << 20};
	paths[0] = path;
	kvt_config cfg = config(0);
	cfg.backend = KVT_BACKEND_CUDA;
	cfg.host_bytes = 32u * 256 * 4 * D; /* 32 blocks of 256 fp16 rows of K and V */
	cfg.spill_policy = KVT_SPILL_LRU;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = sizes;
	cfg.n_nvme = 1;
	kvt_cache *c = NULL;
	OK(NULL, kvt_cache_create(&cfg, &c));
	OK(c, kvt_seq_open(c, a));
	OK(c, kvt_seq_open(c, b));
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		for (uint32_t s = 0; s < 2; s++) {
			make(p, s, layer, 0, 1024, -1);
			upload(p, 1024);
			OK(c, kvt_prefill(c, s ? *b : *a, layer, p->dq, p->dk, p->dv, 1024, NULL));
		}
	return c;
}

static void test_lru_undo(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 1024, 2, 0);
	const char *pf = "test_gpu_backend_lru.img", *pr = "test_gpu_backend_lru_ref.img";
	uint32_t a, b, ra, rb;
	kvt_cache *c = lru_cache(pf, &p, &a, &b), *ref = lru_cache(pr, &p, &ra, &rb);
	kvt_capacity cap0 = {.size = sizeof cap0}, cap = {.size = sizeof cap};
	OK(c, kvt_get_capacity(c, &cap0));
	make(&p, 1, 0, 1024, 1, 0); /* b's token 1024 on layer 0: two new blocks, so a spills */
	upload(&p, 1);
	uint32_t failed = 0;
	for (uint64_t k = 1;; k++) {
		T_CHECK(k < 500, "the append never succeeded");
		kvt_mem_fail_at(k);
		int rc = kvt_append(c, 0, 1, &b, p.dk, p.dv, NULL);
		bool fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc == 0)
			break;
		T_CHECK(fired, "append failed (%d: %s) with no fault injected", rc, kvt_last_error(c));
		failed++;
		kvt_stats st = {.size = sizeof st};
		OK(c, kvt_get_stats(c, &st));
		uint64_t host = 0, nvme = 0;
		OK(c, kvt_seq_bytes(c, a, &host, &nvme));
		OK(c, kvt_get_capacity(c, &cap));
		T_CHECK(st.spills == 0 && nvme == 0,
			"fault %llu (%s): seq a left spilled (spills %llu, %llu bytes on NVMe)",
			(unsigned long long)k, kvt_last_error(c), (unsigned long long)st.spills,
			(unsigned long long)nvme);
		T_CHECK(cap.host_bytes_free == cap0.host_bytes_free,
			"fault %llu (%s): %llu host bytes free, %llu before the call",
			(unsigned long long)k, kvt_last_error(c),
			(unsigned long long)cap.host_bytes_free,
			(unsigned long long)cap0.host_bytes_free);
		T_CHECK(kvt_seq_length(c, b, 0) == 1024, "fault %llu: b has %lld tokens",
			(unsigned long long)k, (long long)kvt_seq_length(c, b, 0));
	}
	OK(ref, kvt_append(ref, 0, 1, &rb, p.dk, p.dv, NULL));
	printf("lru undo: %u injected failures changed nothing\n", failed);
	T_CHECK(failed > 0, "no failure was injected");
	/* both sequences attend as the fault-free twin's */
	const size_t ob = sizeof(float) * HQ * D;
	float *mine = malloc(ob), *theirs = malloc(ob);
	for (uint32_t s = 0; s < 2; s++) {
		make(&p, s, 0, 1025, 1, 1);
		upload(&p, 1);
		uint32_t sq = s ? b : a, rq = s ? rb : ra;
		OK(c, kvt_attend(c, 0, 1, &sq, p.dq, p.dout, NULL));
		CU(cudaMemcpy(mine, p.dout, ob, cudaMemcpyDeviceToHost));
		OK(ref, kvt_attend(ref, 0, 1, &rq, p.dq, p.dout, NULL));
		CU(cudaMemcpy(theirs, p.dout, ob, cudaMemcpyDeviceToHost));
		T_CHECK(!memcmp(mine, theirs, ob), "seq %u attends differently from the twin's", s);
	}
	free(mine);
	free(theirs);
	kvt_cache_destroy(c);
	kvt_cache_destroy(ref);
	pair_fini(&p);
	remove(pf);
	remove(pr);
}
#endif

/*
 * A non-finite key in a sequence's first chunk (the CUDA backend does not inspect keys on the
 * host) must not fail the batches that sequence joins: its centroid leaves the element out, so every
 * score stays finite, and the other sequence's output in the batch is bit for bit its output alone.
 * Before, the NaN centroid made every score of the sequence NaN and each batch with it failed.
 */
static void test_bad_key_batch(void **state)
{
	(void)state;
	enum { T = 300, STEPS = 3 };
	kvt_config cfg = config(0);
	cfg.backend = KVT_BACKEND_CUDA;
	kvt_cache *c = NULL;
	OK(NULL, kvt_cache_create(&cfg, &c));
	t_rng r;
	t_rng_seed(&r, 0xbad);
	const size_t kv = (size_t)T * HKV * D, qn = (size_t)HQ * D;
	uint16_t *hk = t_alloc(2 * kv), *hv = t_alloc(2 * kv), *hq = t_alloc(2 * 2 * qn);
	void *dk, *dv, *dq, *dout, *dalone;
	CU(cudaMalloc(&dk, 2 * kv));
	CU(cudaMalloc(&dv, 2 * kv));
	CU(cudaMalloc(&dq, 2 * 2 * qn));
	CU(cudaMalloc(&dout, 4 * 2 * qn));
	CU(cudaMalloc(&dalone, 4 * qn));
	uint32_t seqs[2];
	for (int s = 0; s < 2; s++) {
		OK(c, kvt_seq_open(c, &seqs[s]));
		for (size_t i = 0; i < kv; i++) {
			hk[i] = t_f2h((float)t_normal(&r));
			hv[i] = t_f2h((float)t_normal(&r));
		}
		if (s == 0)
			hk[5 * HKV * D + 3] = 0x7e00; /* NaN: token 5, KV head 0, element 3 */
		CU(cudaMemcpy(dk, hk, 2 * kv, cudaMemcpyHostToDevice));
		CU(cudaMemcpy(dv, hv, 2 * kv, cudaMemcpyHostToDevice));
		OK(c, kvt_prefill(c, seqs[s], 0, NULL, dk, dv, T, NULL));
	}
	float *out = t_alloc(4 * 2 * qn), *alone = t_alloc(4 * qn);
	for (int step = 0; step < STEPS; step++) {
		for (size_t i = 0; i < 2 * (size_t)HKV * D; i++) {
			hk[i] = t_f2h((float)t_normal(&r));
			hv[i] = t_f2h((float)t_normal(&r));
		}
		for (size_t i = 0; i < 2 * qn; i++)
			hq[i] = t_f2h((float)t_normal(&r));
		CU(cudaMemcpy(dk, hk, 2 * 2 * HKV * D, cudaMemcpyHostToDevice));
		CU(cudaMemcpy(dv, hv, 2 * 2 * HKV * D, cudaMemcpyHostToDevice));
		CU(cudaMemcpy(dq, hq, 2 * 2 * qn, cudaMemcpyHostToDevice));
		OK(c, kvt_append(c, 0, 2, seqs, dk, dv, NULL));
		int rc = kvt_attend(c, 0, 2, seqs, dq, dout, NULL);
		T_CHECK(rc == 0, "step %d: attend of [bad-key seq, normal seq] got %d (%s)", step, rc,
			kvt_last_error(c));
		rc = kvt_attend(c, 0, 1, &seqs[1], (char *)dq + 2 * qn, dalone, NULL);
		T_CHECK(rc == 0, "step %d: attend of the normal seq alone got %d (%s)", step, rc,
			kvt_last_error(c));
		kvt_stats st = {.size = sizeof st};
		rc = kvt_get_stats(c, &st); /* synchronizes: reports what the kernels found */
		T_CHECK(rc == 0, "step %d: the kernels reported %d (%s)", step, rc, kvt_last_error(c));
		CU(cudaMemcpy(out, dout, 4 * 2 * qn, cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(alone, dalone, 4 * qn, cudaMemcpyDeviceToHost));
		for (size_t j = 0; j < qn; j++)
			T_CHECK(t_fbits(out[qn + j]) == t_fbits(alone[j]),
				"step %d: normal seq's out[%zu] in the batch %.9g, alone %.9g", step, j,
				(double)out[qn + j], (double)alone[j]);
	}
	free(hk);
	free(hv);
	free(hq);
	free(out);
	free(alone);
	CU(cudaFree(dk));
	CU(cudaFree(dv));
	CU(cudaFree(dq));
	CU(cudaFree(dout));
	CU(cudaFree(dalone));
	kvt_cache_destroy(c);
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_pipeline),
		cmocka_unit_test(test_graph),
		cmocka_unit_test(test_bad_key_batch),
#if KVT_HAVE_LIBURING /* the NVMe tier is built with liburing only */
		cmocka_unit_test(test_spilled),
		cmocka_unit_test(test_lru_undo),
#endif
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
