/* SPDX-License-Identifier: MIT */
/*
 * Rows of spilled blocks, served in place by a decode step or a gather of the CUDA backend (issue
 * 14): nothing of the sequence is restored, only the rows the step selected that missed the hot
 * cache cross the disk.
 *
 * Between the two halves of the fetch (gpu/fetch.cuh): the lookup lists, for the sequences with
 * blocks on NVMe (KVT_GPU_FETCH_SPILLED), every selected row that missed the hot cache and whose
 * block table entry is NULL (item, row, position) in pinned, mapped memory, and counts them in a
 * device word; the host copies the count back (one synchronization), sorts the list by item and
 * row, and reads each item's rows of spilled blocks through the NVMe tier's block cache
 * (kvt_rows_get: 4 KiB chunks, crc-verified before use, all of the step's reads planned for one
 * submission first) into pinned, mapped staging; rows of chunks the block cache holds already are
 * staged while the reads run (kvt_rows_prefetch_idle). Their addresses, tagged KVT_GPU_ROW_STAGED,
 * go beside the list, and one kernel writes them into the rows; the fill then treats each as any
 * other miss (a hot-cache way, or read in place by the attention). So only the misses cross PCIe as
 * metadata, not every spilled item's rows and positions. A read that fails fails the step with its
 * code and text; nothing unverified reaches the device; a listed row the host does not stage (a
 * block missing, not spilled) stays NULL and the fill reports it.
 *
 * The step waits for the disk, so it cannot be captured into a CUDA graph: a capture that meets a
 * spilled sequence is refused (restore the sequence first).
 */
#include <stdio.h>
#include <string.h>

#include "cuda_backend.h"

/* Wait until no queued work reads the staging or the metadata buffer. */
static int staging_idle(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	if (b->sp_pending) {
		CU(c, cudaEventSynchronize(b->sp_ev));
		b->sp_pending = false;
	}
	return 0;
}

/* Grow a pinned, mapped host buffer to `need` bytes (contents not kept). */
static int pinned_grow(kvt_cache *c, void **p, size_t *have, size_t need, const char *what)
{
	if (need <= *have && *p)
		return 0;
	size_t want = (need + need / 4 + 4095) & ~(size_t)4095;
	void *q = NULL;
	KVT_TRY(gpu_pinned_alloc(c, &q, want, what));
	gpu_pinned_free(c, *p, *have);
	*p = q;
	*have = want;
	return 0;
}

int gpu_spilled_done(kvt_cache *c, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	if (!b->sp_used)
		return 0;
	b->sp_used = false;
	CU(c, cudaEventRecord(b->sp_ev, (cudaStream_t)stream));
	b->sp_pending = true;
	return 0;
}

/* The metadata buffer: the count's copy, then `cap` misses, then their staged addresses. */
#define SP_HEAD 16u
static kvt_gpu_spill_miss *sp_miss(const struct gpu_cache *b)
{
	return (kvt_gpu_spill_miss *)((char *)b->sp_meta + SP_HEAD);
}

static uint64_t *sp_addr(const struct gpu_cache *b, uint32_t cap)
{
	return (uint64_t *)(sp_miss(b) + cap);
}

int gpu_spilled_list(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		     uint32_t max_rows, void *stream, kvt_gpu_spill_list *out)
{
	struct gpu_cache *b = gpu_of(c);
	uint64_t cap = 0;
	memset(out, 0, sizeof *out);
	b->sp_cap = 0; /* a list whose fetch failed before its serve is void */
	for (uint32_t i = 0; i < n_seqs; i++)
		cap += kvt_layer_spilled(c, ls[i]) ? (uint64_t)c->cfg.n_kv_heads * max_rows : 0;
	if (!cap)
		return 0;
	/* first: the waits, pinning and allocations below are what a capture forbids */
	char capture[192];
	snprintf(capture, sizeof capture,
		 "layer %u: a sequence of the batch has rows on NVMe, which a step reads from the "
		 "disk: it cannot be captured into a graph (kvt_seq_restore it first)",
		 layer);
	KVT_TRY(gpu_refuse_capture(c, stream, capture));
	KVT_RETURN_IF(cap > UINT32_MAX, c, -E2BIG,
		      "%llu rows of spilled sequences in one step, above %u",
		      (unsigned long long)cap, UINT32_MAX);
	if (!b->sp_ev)
		CU(c, cudaEventCreateWithFlags(&b->sp_ev, cudaEventDisableTiming));
	KVT_TRY(staging_idle(c));
	KVT_TRY(pinned_grow(c, &b->sp_meta, &b->sp_meta_bytes,
			    SP_HEAD + cap * (sizeof(kvt_gpu_spill_miss) + sizeof(uint64_t)),
			    "the list of spilled rows"));
	if (!b->sp_count)
		KVT_TRY(gpu_dalloc(c, (void **)&b->sp_count, sizeof(uint32_t),
				   "the count of spilled rows"));
	CU(c, cudaMemsetAsync(b->sp_count, 0, sizeof(uint32_t), (cudaStream_t)stream));
	/* the memset and the lookup write the count and the list: the next list waits for them
	 * (gpu_spilled_done) even if this fetch fails before its serve synchronizes */
	b->sp_used = true;
	b->sp_cap = (uint32_t)cap;
	*out = (kvt_gpu_spill_list){.count = b->sp_count, .miss = sp_miss(b), .cap = (uint32_t)cap};
	return 0;
}

/* One stable counting pass of n misses from src to dst on key(m) < keys (cnt: keys + 1 words). */
#define MISS_PASS(src, dst, n, cnt, keys, KEY)                                                   \
	do {                                                                                      \
		memset(cnt, 0, ((size_t)(keys) + 1) * sizeof *cnt);                               \
		for (uint32_t i_ = 0; i_ < (n); i_++)                                             \
			cnt[(src)[i_].KEY + 1]++;                                                 \
		for (uint32_t k_ = 0; k_ < (keys); k_++)                                          \
			cnt[k_ + 1] += cnt[k_];                                                   \
		for (uint32_t i_ = 0; i_ < (n); i_++)                                             \
			(dst)[cnt[(src)[i_].KEY]++] = (src)[i_];                                  \
	} while (0)

/*
 * The misses by item, then row (each item's rows ascending, as kvt_rows_get takes them): two
 * stable counting passes, by row into tmp and by item back, in O(n + max_rows + items). For the
 * 83 K misses of a gpu_spilled 128K x 8 step (64 MiB hot cache), qsort took 14 ms on the
 * development machine and this 0.2 ms, the same order. An entry beyond the step's items or rows is
 * the device's error: -EIO, nothing read.
 */
static int miss_sort(kvt_cache *c, uint32_t layer, kvt_gpu_spill_miss *m, kvt_gpu_spill_miss *tmp,
		     uint32_t *cnt, uint32_t n, uint32_t items, uint32_t max_rows)
{
	for (uint32_t i = 0; i < n; i++)
		KVT_RETURN_IF(m[i].item >= items || m[i].k >= max_rows, c, -EIO,
			      "layer %u: spilled row %u of the list names item %u row %u, beyond "
			      "the step's %u items of at most %u rows",
			      layer, i, m[i].item, m[i].k, items, max_rows);
	MISS_PASS(m, tmp, n, cnt, max_rows, k);
	MISS_PASS(tmp, m, n, cnt, items, item);
	return 0;
}

/* Whether position `at` of KV head h lies in a block of l that is on NVMe (not merely missing). */
static bool spilled_at(const struct kvt_layer *l, uint32_t h, int32_t at)
{
	const uint32_t blk = (uint32_t)at / KVT_BLOCK_TOKENS;
	return at >= 0 && blk < l->n_blocks && !l->blocks[(size_t)h * l->blk_cap + blk];
}

/*
 * Staging the listed rows, chunk by chunk: a run is the consecutive entries of one item in one
 * 4 KiB chunk, which one kvt_rows_get call serves (so a chunk's hit is counted once, as by one call
 * per item). While the prefetch reads, stage_some stages the runs whose chunks are cached already
 * (most of a step's, at a few reads per hundred rows) and defers the others; after it, the deferred
 * runs and those not reached are staged.
 */
struct stage_work {
	kvt_cache *c;
	struct kvt_layer *const *ls;
	const kvt_gpu_spill_miss *miss;
	const int32_t *pos;
	const uint32_t *ent;
	uint64_t *addr;
	char *stage;
	const void **got;
	uint32_t *defer;
	uint32_t H, per_chunk, total, next, n_defer;
	int rc; /* the first failed kvt_rows_get, with its sequence and text */
	uint32_t rc_seq;
	char why[sizeof ((kvt_cache *)0)->err];
};

/* The end of the run that starts at entry t0. */
static uint32_t run_end(const struct stage_work *w, uint32_t t0)
{
	const uint32_t item = w->miss[w->ent[t0]].item,
		       at = (uint32_t)w->pos[t0] / w->per_chunk; /* the chunk's number in the head */
	uint32_t t = t0 + 1;
	while (t < w->total && w->miss[w->ent[t]].item == item &&
	       (uint32_t)w->pos[t] / w->per_chunk == at)
		t++;
	return t;
}

/* Stage the run [t0, t1): its rows read from the block cache, copied, their addresses listed. */
static int stage_run(struct stage_work *w, uint32_t t0, uint32_t t1)
{
	const uint32_t item = w->miss[w->ent[t0]].item, seq = item / w->H;
	const size_t rb = w->c->row_bytes;
	int rc = kvt_rows_get(w->c, w->ls[seq], item % w->H, t1 - t0, w->pos + t0, w->got);
	if (rc < 0) {
		w->rc = rc;
		w->rc_seq = seq;
		snprintf(w->why, sizeof w->why, "%s", w->c->err);
		return rc;
	}
	for (uint32_t t = t0; t < t1; t++) {
		char *row = w->stage + (size_t)t * rb;
		memcpy(row, w->got[t - t0], rb);
		w->addr[w->ent[t]] = (uintptr_t)row | KVT_GPU_ROW_STAGED;
	}
	return 0;
}

/* kvt_nvme_idle's work: up to 32 runs past the cursor, each staged if ready, else deferred. */
static int stage_some(void *arg)
{
	struct stage_work *w = arg;
	for (int k = 0; k < 32 && w->next < w->total; k++) {
		const uint32_t t0 = w->next, t1 = run_end(w, t0);
		const uint32_t item = w->miss[w->ent[t0]].item;
		if (!kvt_rows_ready(w->c, w->ls[item / w->H], item % w->H, w->pos[t0]))
			w->defer[w->n_defer++] = t0;
		else if (stage_run(w, t0, t1) < 0)
			return 0;
		w->next = t1;
	}
	return w->next < w->total;
}

int gpu_serve_spilled(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const void **rows, uint32_t max_rows, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t rb = c->row_bytes;
	if (!b->sp_cap)
		return 0; /* no spilled sequence: no list was made */
	const uint32_t cap = b->sp_cap;
	b->sp_cap = 0;
	uint32_t *count = (uint32_t *)b->sp_meta;
	CU(c, cudaMemcpyAsync(count, b->sp_count, sizeof(uint32_t), cudaMemcpyDeviceToHost,
			      (cudaStream_t)stream));
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	KVT_TRY(gpu_check_err(c)); /* the lookup's range errors first */
	const uint32_t n = *count;
	KVT_RETURN_IF(n > cap, c, -EIO, "layer %u: %u rows of spilled blocks listed, above the %u "
		      "the list holds", layer, n, cap);
	if (!n)
		return 0;
	kvt_gpu_spill_miss *miss = sp_miss(b);
	uint64_t *addr = sp_addr(b, cap);
	/* host scratch: one run's row pointers, the sort's copy of the list and its counts (a count
	 * per row or item, whichever is more), then the positions to read (per item, contiguous),
	 * their list entries and the runs deferred */
	const uint32_t items = n_seqs * H, keys = (max_rows > items ? max_rows : items) + 1;
	const size_t hb = (size_t)max_rows * sizeof(void *) + (size_t)n * sizeof *miss +
			  (size_t)keys * sizeof(uint32_t) +
			  (size_t)n * (sizeof(int32_t) + 2 * sizeof(uint32_t));
	if (hb > b->sp_host_bytes) {
		void *q = kvt_mem_alloc(KVT_MEM_HOST, hb);
		KVT_RETURN_IF(!q, c, -ENOMEM, "%zu bytes of host scratch for spilled rows", hb);
		kvt_mem_free(KVT_MEM_HOST, b->sp_host, b->sp_host_bytes);
		b->sp_host = q;
		b->sp_host_bytes = hb;
	}
	const void **got = (const void **)b->sp_host;
	kvt_gpu_spill_miss *tmp = (kvt_gpu_spill_miss *)(got + max_rows);
	uint32_t *cnt = (uint32_t *)(tmp + n);
	int32_t *pos = (int32_t *)(cnt + keys);
	uint32_t *ent = (uint32_t *)(pos + n), *defer = ent + n;
	KVT_TRY(miss_sort(c, layer, miss, tmp, cnt, n, items, max_rows));
	/* one pass: each item's rows in spilled blocks, planned for one read submission */
	uint32_t total = 0;
	kvt_rows_prefetch_begin(c);
	for (uint32_t i = 0; i < n;) {
		const uint32_t item = miss[i].item, first = total;
		const struct kvt_layer *l = ls[item / H];
		for (; i < n && miss[i].item == item; i++) {
			addr[i] = 0;
			if (spilled_at(l, item % H, miss[i].pos)) {
				pos[total] = miss[i].pos;
				ent[total++] = i;
			}
		}
		if (total > first)
			kvt_rows_prefetch_add(c, l, item % H, total - first, pos + first);
	}
	KVT_TRY(pinned_grow(c, &b->sp_rows, &b->sp_rows_bytes, total ? total * rb : 1,
			    "staged rows of spilled blocks"));
	/* the rows of cached chunks staged while the others are read, then the rest */
	struct stage_work w = {.c = c, .ls = ls, .miss = miss, .pos = pos, .ent = ent,
			       .addr = addr, .stage = b->sp_rows, .got = got, .defer = defer,
			       .H = H, .per_chunk = kvt_rows_per_chunk(c), .total = total};
	const struct kvt_nvme_idle idle = {stage_some, &w};
	const int prc = kvt_rows_prefetch_idle(c, &idle);
	if (prc < 0)
		return kvt_rows_blame(c, prc, n_seqs, ls);
	for (uint32_t d = 0; !w.rc && d < w.n_defer; d++)
		stage_run(&w, w.defer[d], run_end(&w, w.defer[d]));
	while (!w.rc && w.next < total) {
		const uint32_t t1 = run_end(&w, w.next);
		stage_run(&w, w.next, t1);
		w.next = t1;
	}
	if (w.rc < 0)
		return kvt_err_entry(c, w.rc_seq,
				     kvt_err_wrap(c, w.rc, "seqs[%u]: %s", w.rc_seq, w.why));
	b->sp_used = true; /* the scatter reads the list, the fill and attention the rows */
	LAUNCH(c, kvt_gpu_spill_scatter(miss, addr, n, rows, max_rows, stream));
	return 0;
}
