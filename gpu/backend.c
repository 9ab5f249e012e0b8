/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: set-up and tear-down of a cache's device state, the entry of every call (the
 * cache's device current, errors the kernels recorded), statistics, and the table of verbs that
 * lib/pipeline.c calls. What lives where and which file holds which verb: cuda_backend.h.
 *
 * Errors the kernels find (a non-finite score) are recorded in an error word on the device, copied
 * to a pinned mirror at the end of each call, and reported by the next call on the cache, or by
 * kvt_select / kvt_gather / kvt_get_stats, which synchronize. A spilled sequence is restored by the
 * pipeline before a step reads it (the kernels read the host tier only), and the device is drained
 * (quiesce) before the NVMe tier moves blocks of the host tier.
 */
#include <stdio.h>
#include <string.h>

#include "cuda_backend.h"

#define ERR_HOST_BYTES 4096u
/* Mirror slots of the error word: each call that queues kernels ends by copying the word into the
 * next slot (ERR_PENDING until the copy lands), so a check finds the first call whose copy shows
 * an error: the word is sticky (the first error wins until a check clears it), so every slot
 * before that call's read 0. */
#define GPU_ERR_SLOTS 64u /* and one more past them for steps captured into graphs */
#define ERR_PENDING (~0ull)

#define ERR_GONE (UINT32_MAX - 1)

/* The sequence of batch entry `entry` of the call that copied into `slot`; ERR_GONE when that
 * sequence was closed or truncated back past the step since (its error went with it); UINT32_MAX
 * when the call cannot be told (no batch, a reused slot, a cache with captured steps: a graph's
 * replay raises between eager calls, so the first slot that shows it need not be its call). */
static uint32_t err_seq(kvt_cache *c, struct gpu_cache *b, uint32_t slot, uint32_t entry)
{
	const struct gpu_err_call *r = &b->err_calls[slot];
	if (b->err_lost || b->err_graphs || r->n == UINT32_MAX || entry >= r->n)
		return UINT32_MAX;
	const uint32_t s =
		kvt_seq_of_uid(c, r->layer, b->err_uids[(size_t)slot * c->cfg.max_seqs + entry]);
	return s == UINT32_MAX ? ERR_GONE : s;
}

/* What each range check means (errword.h's sites; item and value as each names them). */
static const char *const site_text[KVT_GPU_SITE_COUNT] = {
	[KVT_GPU_SITE_INDEX_JOB] = "the index build: a job's token count (value) above what the "
				   "launch was sized for (item: job)",
	[KVT_GPU_SITE_INDEX_CAP] = "the index build: a job's end (value) past its index's capacity "
				   "(item: job)",
	[KVT_GPU_SITE_SCORE_N] = "the scan: a sequence's indexed count (value) above the launch's "
				 "bound or its index's capacity (item: sequence x KV head)",
	[KVT_GPU_SITE_SELECT_N] = "the Top-p threshold: a segment's token count (value) above the "
				  "launch's bound (item: sequence x query head)",
	[KVT_GPU_SITE_LOOKUP_ROWS] = "the hot-cache lookup: an item's rows, sinks + selected + "
				     "window (value), above the launch's max_rows (item: "
				     "sequence x KV head)",
	[KVT_GPU_SITE_LOOKUP_BLOCK] = "the hot-cache lookup: a selected row (value: position) "
				      "whose host block is missing (item: sequence x KV head)",
	[KVT_GPU_SITE_FILL_BLOCK] = "the fill: a row of a spilled block (value: position) that was "
				    "not staged (item: sequence x KV head)",
	[KVT_GPU_SITE_STORE_BLOCK] = "the store of new rows: a row (value: position) whose host "
				     "block is missing (item: KV head)",
	[KVT_GPU_SITE_ATTEND_ROWS] = "the attention: an item's rows (value) above the launch's "
				     "max_rows (item: sequence x KV head)",
	[KVT_GPU_SITE_STAGE_BLOCK] = "kvt_extend's staging: a row of a spilled or missing block "
				     "(item: KV head, value: position)",
};

/* What a range error's site names, or `otherwise` (another code, or a site without a text). */
static const char *site_of(unsigned long long w, const char *otherwise)
{
	const uint32_t site = KVT_GPU_ERR_SITE(w);
	return KVT_GPU_ERR_CODE(w) == KVT_GPU_ERR_RANGE && site < KVT_GPU_SITE_COUNT &&
			       site_text[site]
		       ? site_text[site]
		       : otherwise;
}

/* An error the kernels recorded, in the first slot (in the order the calls were made) whose copy
 * has landed and is not 0: a non-finite score of a batch entry puts that entry's sequence in
 * error and the check succeeds; anything else fails it. Slots whose copy has not landed yet are
 * read by a later check. Reading an error out synchronizes the device, which a stream being
 * captured forbids (the capture would be invalidated, and the error lost with it): with
 * `capture` set and `stream` being captured, a recorded error fails the call and stays where it
 * is, for the next check outside the capture. */
static int check_err(kvt_cache *c, bool capture, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	volatile unsigned long long *m = b->err_host;
	unsigned long long w = 0;
	uint32_t slot = 0;
	for (; b->err_seen < b->err_issued; b->err_seen++) {
		slot = (uint32_t)(b->err_seen % GPU_ERR_SLOTS);
		w = m[slot];
		if (w)
			break;
	}
	if (b->err_seen == b->err_issued)
		b->err_lost = false; /* every slot read: none can be mistaken for another any more */
	bool graph = false;
	if ((!w || w == ERR_PENDING) && b->err_graphs && m[GPU_ERR_SLOTS]) {
		/* what a graph replay's copy found, when no eager call has copied it since */
		w = m[GPU_ERR_SLOTS];
		graph = true;
	}
	if (!w || w == ERR_PENDING)
		return 0;
	if (capture && gpu_capturing(stream)) {
		const uint32_t code = KVT_GPU_ERR_CODE(w), where = KVT_GPU_ERR_WHERE(w),
			       idx = KVT_GPU_ERR_INDEX(w);
		char what[320];
		if (code == KVT_GPU_ERR_SLOT)
			snprintf(what, sizeof what, "slot %u of a graph step on layer %u could not "
				 "be served", idx, where & 0xffffu);
		else if (code == KVT_GPU_ERR_NONFINITE)
			snprintf(what, sizeof what, "a non-finite estimated score (segment %u, "
				 "indexed token %u)", where, idx);
		else
			snprintf(what, sizeof what, "error %u (item %u, value %u) in %s", code, where,
				 idx, site_of(w, "a launch"));
		return kvt_seterr(c, -EIO,
				  "an earlier GPU step reported %s, which cannot be read out while the "
				  "stream is being captured (that synchronizes the device): this call "
				  "captured nothing, and the next call outside the capture reports it",
				  what);
	}
	/* every copy queued lands, then the word starts again from 0 */
	const bool synced = cudaDeviceSynchronize() == cudaSuccess;
	cudaMemset(b->err, 0, sizeof *b->err);
	cudaDeviceSynchronize();
	const uint32_t code = KVT_GPU_ERR_CODE(w), where = KVT_GPU_ERR_WHERE(w);
	const uint32_t idx = KVT_GPU_ERR_INDEX(w), Hq = c->cfg.n_q_heads;
	const uint32_t seq = code == KVT_GPU_ERR_NONFINITE && !graph
				     ? err_seq(c, b, slot, where / Hq)
				     : UINT32_MAX;
	const uint32_t layer = graph ? 0 : b->err_calls[slot].layer;
	b->err_seen = b->err_issued;
	b->err_lost = false;
	m[GPU_ERR_SLOTS] = 0; /* a later replay copies afresh */
	if (!synced)
		return kvt_seterr(c, -EIO, "the device failed: %s",
				  cudaGetErrorString(cudaGetLastError()));
	if (seq == ERR_GONE)
		return 0;
	if (seq != UINT32_MAX)
		return kvt_seq_set_status(c, seq, -EINVAL,
			"a step on layer %u met a non-finite estimated score (query head %u, indexed "
			"token %u): the query is not finite or too large for the estimate, or the "
			"sequence's centroids are not finite (a non-finite key or query in its first "
			"prefill chunk); that step's selection for it was empty",
			layer, where % Hq, idx);
	if (code == KVT_GPU_ERR_NONFINITE)
		return kvt_seterr(c, -EINVAL,
				  "an earlier step met a non-finite estimated score (batch entry %u, "
				  "query head %u, indexed token %u): that query is not finite or too "
				  "large for the estimate, or the sequence's centroids are not finite "
				  "(a non-finite key or query in its first prefill chunk); not a key's "
				  "index entry, which is stored saturated at the fp16 maximum 65504; "
				  "that step's selection was empty",
				  where / Hq, where % Hq, idx);
	if (code == KVT_GPU_ERR_SLOT)
		return kvt_err_entry(c, idx, kvt_graph_slot_error(c, where & 0xffffu, idx,
								       where >> 16, true));
	return kvt_seterr(c, -EIO,
			  "an earlier GPU step reported error %u (item %u, value %u): %s",
			  code, where, idx,
			  site_of(w, "a count or position beyond what the launch was sized for"));
}

int gpu_check_err(kvt_cache *c)
{
	return check_err(c, false, NULL);
}

/* Every entry point: the cache's device current on this thread (runtimes switch devices), then
 * any error the kernels recorded since the last call (left in place while `stream` is being
 * captured). */
static int cu_enter(kvt_cache *c, void *stream)
{
	int cur = -1;
	if (cudaGetDevice(&cur) != cudaSuccess || cur != c->cfg.device)
		CU(c, cudaSetDevice(c->cfg.device));
	return check_err(c, true, stream);
}

int gpu_err_copy_batch(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
		       struct kvt_layer *const *ls, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	if (gpu_capturing(stream)) {
		/* a graph replays this copy whenever it runs: into a slot no check reads, and from
		 * now on errors are not put on sequences (err_seq) */
		b->err_graphs = true;
		LAUNCH(c, kvt_gpu_store_words(b->err, b->err_host + GPU_ERR_SLOTS, 1, stream));
		return 0;
	}
	const uint32_t slot = (uint32_t)(b->err_issued % GPU_ERR_SLOTS);
	if (b->err_issued - b->err_seen >= GPU_ERR_SLOTS)
		b->err_lost = true; /* that slot's call can no longer be told apart */
	b->err_calls[slot] = (struct gpu_err_call){.layer = layer, .n = ls ? n_seqs : UINT32_MAX};
	for (uint32_t i = 0; ls && i < n_seqs; i++)
		b->err_uids[(size_t)slot * c->cfg.max_seqs + i] = ls[i]->seq_uid;
	((volatile unsigned long long *)b->err_host)[slot] = ERR_PENDING;
	LAUNCH(c, kvt_gpu_store_words(b->err, b->err_host + slot, 1, stream));
	b->err_issued++;
	return 0;
}

/* Queue the copy of the error word to its next mirror slot, read by a later check. */
int gpu_err_copy(kvt_cache *c, void *stream)
{
	return gpu_err_copy_batch(c, 0, 0, NULL, stream);
}

static int cu_end(kvt_cache *c, void *stream)
{
	return gpu_err_copy(c, stream);
}

static int cu_may_block(kvt_cache *c, void *stream, const char *what)
{
	return gpu_no_capture(c, stream, what);
}

static int cu_quiesce(kvt_cache *c)
{
	CU(c, cudaDeviceSynchronize());
	return 0;
}

static void cu_layer_fini(kvt_cache *c, struct kvt_layer *l)
{
	if (!l->dev)
		return;
	cudaDeviceSynchronize(); /* kernels may still read it */
	gpu_mirror_free(c, l->dev);
	l->dev = NULL;
}

/* ---- stats, set-up and tear-down --------------------------------------------------------- */

static int cu_stats(kvt_cache *c, int layer, kvt_layer_stats *out)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t L = c->cfg.n_layers;
	KVT_TRY(cu_enter(c, NULL));
	CU(c, cudaDeviceSynchronize());
	CU(c, cudaMemcpy(b->cnt_host, b->counters, sizeof(unsigned long long) * L * KVT_GPU_CNT_N,
			 cudaMemcpyDeviceToHost));
	for (uint32_t i = 0; i < GPU_TIMING_SETS; i++)
		gpu_harvest(c, &b->t[i]);
	if (layer >= 0) {
		const unsigned long long *k = b->cnt_host + (size_t)layer * KVT_GPU_CNT_N;
		const struct gpu_layer *y = &b->lay[layer];
		out->steps = y->steps;
		out->hot_hits = k[KVT_GPU_CNT_HITS];
		out->hot_misses = k[KVT_GPU_CNT_MISSES];
		out->pcie_bytes = k[KVT_GPU_CNT_PCIE];
		out->selected_tokens = k[KVT_GPU_CNT_SELECTED] + y->selected;
		out->rows_attended = k[KVT_GPU_CNT_ROWS];
		out->hot_rows = (uint64_t)y->hot.sets * KVT_GPU_HOT_WAYS;
		return gpu_check_err(c);
	}
	uint64_t hits = 0, misses = 0, bytes = 0, sel = 0, rescored = 0, unsel = 0, bmax = 0,
		 bmin = 0, scanhist = 0;
	for (uint32_t i = 0; i < L; i++) {
		const unsigned long long *k = b->cnt_host + (size_t)i * KVT_GPU_CNT_N;
		hits += k[KVT_GPU_CNT_HITS];
		misses += k[KVT_GPU_CNT_MISSES];
		bytes += k[KVT_GPU_CNT_PCIE];
		sel += k[KVT_GPU_CNT_SELECTED] + b->lay[i].selected;
		rescored += k[KVT_GPU_CNT_RESCORED];
		unsel += k[KVT_GPU_CNT_RESCORED_UNSEL];
		bmax += k[KVT_GPU_CNT_BMAX];
		bmin += k[KVT_GPU_CNT_BMIN];
		scanhist += k[KVT_GPU_CNT_SCANHIST];
	}
	c->st.scan_hist_hits = scanhist;
	c->st.budget_max_hits = bmax;
	c->st.budget_min_hits = bmin;
	c->st.rescored_tokens = rescored;
	c->st.rescored_unselected = unsel;
	c->st.hot_hits = hits;
	c->st.hot_misses = misses;
	c->st.rows_fetched = misses + b->ext_rows;
	c->st.bytes_fetched = bytes + b->ext_bytes_read;
	c->st.pcie_bytes = bytes + b->ext_bytes_read;
	c->st.selected_tokens = sel;
	return gpu_check_err(c);
}

static void cu_fini(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	if (!b)
		return;
	cudaDeviceSynchronize();
	gpu_hot_fini(c);
	for (uint32_t i = 0; b->lay && i < c->cfg.n_layers; i++) {
		struct gpu_layer *y = &b->lay[i];
		if (y->indexed)
			cudaEventDestroy(y->indexed);
		gpu_dfree(c, y->sel_mem);
		gpu_dfree(c, y->keep_mem);
		gpu_dfree(c, y->jobs);
	}
	gpu_graph_fini(c); /* before the layers: it frees their graph selections */
	kvt_mem_free(KVT_MEM_HOST, b->lay, 0);
	gpu_dfree(c, b->epochs);
	for (uint32_t i = 0; i < GPU_TIMING_SETS; i++)
		for (int e = 0; e < 4; e++)
			if (b->t[i].ev[e])
				cudaEventDestroy(b->t[i].ev[e]);
	if (b->idx)
		cudaStreamDestroy(b->idx);
	if (b->staging_ev)
		cudaEventDestroy(b->staging_ev);
	if (b->ext_side)
		cudaStreamDestroy(b->ext_side);
	for (int e = 0; e < 5; e++)
		if (b->ext_ev[e])
			cudaEventDestroy(b->ext_ev[e]);
	if (b->ready)
		cudaEventDestroy(b->ready);
	if (b->sp_ev)
		cudaEventDestroy(b->sp_ev);
	gpu_pinned_free(c, b->sp_meta, b->sp_meta_bytes);
	gpu_pinned_free(c, b->sp_rows, b->sp_rows_bytes);
	gpu_dfree(c, b->sp_count);
	kvt_mem_free(KVT_MEM_HOST, b->sp_host, b->sp_host_bytes);
	gpu_pinned_free(c, b->err_host, ERR_HOST_BYTES);
	gpu_dfree(c, b->rot);
	gpu_dfree(c, b->err);
	gpu_dfree(c, b->counters);
	gpu_dfree(c, b->arena);
	gpu_dfree(c, b->staging);
	gpu_dfree(c, b->ext_mem);
	gpu_dfree(c, b->rows_mem);
	kvt_mem_free(KVT_MEM_HOST, b->cnt_host, 0);
	kvt_mem_free(KVT_MEM_HOST, b->err_calls, 0);
	kvt_mem_free(KVT_MEM_HOST, b->err_uids, 0);
	kvt_mem_free(KVT_MEM_HOST, b->host, 0);
	kvt_mem_free(KVT_MEM_HOST, b, 0);
	c->be = NULL;
}

/* The pinned mirror of the error word: one page, through the cache's allocation context. */
static int err_host_alloc(kvt_cache *c, struct gpu_cache *b)
{
	return gpu_pinned_alloc(c, (void **)&b->err_host, ERR_HOST_BYTES,
				"the error word's host mirror");
}

static int cu_init_inner(kvt_cache *c, struct gpu_cache *b)
{
	const uint32_t L = c->cfg.n_layers, H = c->cfg.n_kv_heads, M = c->cfg.max_seqs;
	int attr = 0;
	CU(c, cudaSetDevice(c->cfg.device));
	CU(c, cudaDeviceGetAttribute(&attr, cudaDevAttrCanUseHostPointerForRegisteredMem,
				     c->cfg.device));
	KVT_RETURN_IF(!attr, c, -EOPNOTSUPP,
		      "device %d cannot use host pointers of registered memory: the zero-copy "
		      "host tier needs it",
		      c->cfg.device);
	CU(c, cudaDeviceGetAttribute(&attr, cudaDevAttrPageableMemoryAccess, c->cfg.device));
	b->pageable_access = attr != 0;
	KVT_RETURN_IF(c->cfg.correction_steps, c, -EOPNOTSUPP,
		      "correction_steps = %u: the CUDA backend has no score correction yet (0, "
		      "the default, turns it off)", c->cfg.correction_steps);
	KVT_RETURN_IF(c->cfg.keep_steps > 1, c, -EOPNOTSUPP,
		      "keep_steps = %u: the CUDA backend favors the last step's selection only (0 "
		      "or 1)", c->cfg.keep_steps);
	KVT_RETURN_IF(c->group > KVT_GPU_MAX_GROUP, c, -EOPNOTSUPP,
		      "n_q_heads / n_kv_heads = %u, the CUDA backend serves at most %u", c->group,
		      KVT_GPU_MAX_GROUP);
	KVT_RETURN_IF((uint64_t)M * c->cfg.n_q_heads > 65535, c, -EOPNOTSUPP,
		      "max_seqs * n_q_heads = %llu, the CUDA backend serves at most 65535",
		      (unsigned long long)M * c->cfg.n_q_heads);
	int lo = 0, hi = 0;
	CU(c, cudaDeviceGetStreamPriorityRange(&lo, &hi));
	CU(c, cudaStreamCreateWithPriority(&b->idx, cudaStreamNonBlocking, lo));
	CU(c, cudaEventCreateWithFlags(&b->staging_ev, cudaEventDisableTiming));
	CU(c, cudaEventCreateWithFlags(&b->ready, cudaEventDisableTiming));
	/* kvt_extend's staging overlaps its attention: first to take an SM that frees up, on a
	 * grid of about one block per SM (enough loads in flight for PCIe, few SMs taken) */
	CU(c, cudaStreamCreateWithPriority(&b->ext_side, cudaStreamNonBlocking, hi));
	int dev = 0, sms = 0;
	CU(c, cudaGetDevice(&dev));
	CU(c, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	int l2 = 0;
	CU(c, cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
	b->l2_bytes = (size_t)l2;
	b->ext_stage_blocks = (uint32_t)sms / c->cfg.n_kv_heads ? (uint32_t)sms / c->cfg.n_kv_heads : 1;
	for (int e = 0; e < 5; e++)
		CU(c, cudaEventCreateWithFlags(&b->ext_ev[e], cudaEventDisableTiming));
	for (uint32_t i = 0; i < GPU_TIMING_SETS; i++)
		for (int e = 0; e < 4; e++)
			CU(c, cudaEventCreate(&b->t[i].ev[e]));
	KVT_TRY(err_host_alloc(c, b));
	b->err_calls = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b->err_calls * GPU_ERR_SLOTS);
	b->err_uids = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b->err_uids * GPU_ERR_SLOTS * M);
	KVT_RETURN_IF(!b->err_calls || !b->err_uids, c, -ENOMEM,
		      "out of memory for the CUDA backend's error records (%u calls x %u sequences)",
		      GPU_ERR_SLOTS, M);
	const size_t rot = sizeof(float) * L * c->d * c->d;
	KVT_TRY(gpu_dalloc(c, (void **)&b->rot, rot, "the rotations"));
	CU(c, cudaMemcpy(b->rot, c->rot, rot, cudaMemcpyHostToDevice));
	KVT_TRY(gpu_settle(c, "the rotations' upload"));
	KVT_TRY(gpu_dalloc(c, (void **)&b->err, sizeof *b->err, "the error word"));
	const size_t cnt = sizeof(unsigned long long) * L * KVT_GPU_CNT_N;
	KVT_TRY(gpu_dalloc(c, (void **)&b->counters, cnt, "the counters"));
	KVT_TRY(gpu_dalloc(c, (void **)&b->epochs, sizeof(uint32_t) * L, "the hot-cache epochs"));
	b->cnt_host = kvt_mem_alloc(KVT_MEM_HOST, cnt);
	/* host scratch: the largest of a step's descriptors, append's store jobs and index jobs */
	size_t host = gpu_step_host_bytes(c, M);
	size_t jobs = sizeof(kvt_gpu_store_job) * M;
	host = host > jobs ? host : jobs;
	jobs = sizeof(kvt_gpu_index_job) * 2 * M + sizeof(kvt_gpu_index_view) * M;
	host = host > jobs ? host : jobs;
	host = host > sizeof(uint32_t) * M * H ? host : sizeof(uint32_t) * M * H;
	b->host = kvt_mem_alloc(KVT_MEM_HOST, host);
	b->lay = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b->lay * L);
	KVT_RETURN_IF(!b->cnt_host || !b->host || !b->lay, c, -ENOMEM,
		      "out of memory for the CUDA backend's host state");
	b->jobs_bytes = gpu_up(sizeof(kvt_gpu_index_job) * (2 * M + 2)) +
			sizeof(kvt_gpu_index_view) * (M + 1);
	for (uint32_t i = 0; i < L; i++) {
		struct gpu_layer *y = &b->lay[i];
		CU(c, cudaEventCreateWithFlags(&y->indexed, cudaEventDisableTiming));
		KVT_TRY(gpu_dalloc(c, &y->jobs, b->jobs_bytes, "index jobs"));
	}
	return gpu_hot_init(c);
}

static int cu_init(kvt_cache *c)
{
	/* on failure the cache's teardown calls cu_fini, which takes what was made */
	struct gpu_cache *b = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b);
	KVT_RETURN_IF(!b, c, -ENOMEM, "out of memory for the CUDA backend");
	c->be = b;
	return cu_init_inner(c, b);
}

/* One 2D copy of `rows` rows of `width` bytes between the view (rows `vpitch` apart) and the dense
 * tensor (rows `dpitch` apart), as copy_strided's direction says; rows one by one (plain copies)
 * when there is one, or a pitch is past what the device's 2D copy takes. */
static cudaError_t copy_rows(char *view, size_t vpitch, char *dense, size_t dpitch, size_t width,
			     size_t rows, bool to_view, cudaStream_t st)
{
	const size_t max_pitch = (size_t)1 << 31; /* cudaDevAttrMaxPitch on every device so far */
	if (rows > 1 && vpitch < max_pitch && dpitch < max_pitch)
		return to_view ? cudaMemcpy2DAsync(view, vpitch, dense, dpitch, width, rows,
						   cudaMemcpyDefault, st)
			       : cudaMemcpy2DAsync(dense, dpitch, view, vpitch, width, rows,
						   cudaMemcpyDefault, st);
	for (size_t r = 0; r < rows; r++) {
		cudaError_t e = to_view ? cudaMemcpyAsync(view + r * vpitch, dense + r * dpitch, width,
							  cudaMemcpyDefault, st)
					: cudaMemcpyAsync(dense + r * dpitch, view + r * vpitch, width,
							  cudaMemcpyDefault, st);
		if (e != cudaSuccess)
			return e;
	}
	return cudaSuccess;
}

/*
 * A dense tensor to or from a strided view (lib/io_layout.c), in stream order, in as few copies as
 * the view allows: one when a token's heads are contiguous (rows of heads * width bytes) or there
 * is one token (rows of one head), else one per head or one per token, whichever is fewer.
 */
static int cu_copy_strided(kvt_cache *c, void *dst, const void *src, const struct kvt_strided *s,
			   bool to_view, void *stream)
{
	char *view = to_view ? (char *)dst : (char *)src, *dense = to_view ? (char *)src : (char *)dst;
	const cudaStream_t st = (cudaStream_t)stream;
	const size_t w = s->width, H = s->heads, n = s->n, row = H * w;
	cudaError_t e = cudaSuccess;
	if (H == 1 || s->head_pitch == w) /* a token's heads contiguous */
		e = copy_rows(view, s->token_pitch, dense, row, row, n, to_view, st);
	else if (n == 1)
		e = copy_rows(view, s->head_pitch, dense, w, w, H, to_view, st);
	else if (H <= n)
		for (size_t h = 0; h < H && e == cudaSuccess; h++)
			e = copy_rows(view + h * s->head_pitch, s->token_pitch, dense + h * w, row, w,
				      n, to_view, st);
	else
		for (size_t t = 0; t < n && e == cudaSuccess; t++)
			e = copy_rows(view + t * s->token_pitch, s->head_pitch, dense + t * row, w, w,
				      H, to_view, st);
	if (e != cudaSuccess) {
		(void)cudaGetLastError(); /* not sticky: the next launch must not see it */
		return kvt_seterr(c, -EIO, "copying a strided %s (%zu rows of %zu heads): %s",
				  to_view ? "out" : "input", n, H, cudaGetErrorString(e));
	}
	return 0;
}

static const struct kvt_backend_ops ops = {
	.name = "cuda",
	.probe = gpu_probe,
	.find_device = gpu_find_device,
	.mem_hooks = &gpu_mem_hooks,
	.init = cu_init,
	.fini = cu_fini,
	.layer_fini = cu_layer_fini,
	.enter = cu_enter,
	.may_block = cu_may_block,
	.unreachable = gpu_unreachable,
	.reserve = gpu_reserve,
	.centroids = gpu_centroids,
	.store = gpu_store,
	.index = gpu_index,
	.end = cu_end,
	.step = gpu_step,
	.counts = gpu_counts,
	.gather = gpu_gather,
	.stats = cu_stats,
	.quiesce = cu_quiesce,
	.truncate = gpu_truncate,
	.rewind = gpu_rewind,
	.fork = gpu_fork,
	.read_rows = gpu_read_rows,
	.read_rows_at = gpu_read_rows_at,
	.gather_rows = gpu_gather_rows,
	.extend = gpu_extend,
	.extend_topp = true,
	.copy_strided = cu_copy_strided,
	.graph_reserve = gpu_graph_reserve,
	.graph_publish = gpu_graph_publish,
	.attend_graph = gpu_attend_graph,
	.device_tensors = true,
};

const struct kvt_backend_ops *const kvt_cuda_backend_ops = &ops;
