/* SPDX-License-Identifier: MIT */
/*
 * The hot-token cache's memory (gpu/fetch.cuh has its policy): one device allocation per layer,
 * either fixed at set-up (gpu_cache_bytes given: split evenly over the layers) or self-sized
 * (gpu_cache_bytes 0, the default): each layer's cache starts empty and grows, between steps, by
 * the rule of gpu/hotsize.h (twice a step's rows; twice its size when, full, it misses more than an
 * eighth of them; never past the rows of its contexts, which it follows an eighth at a time)
 * within its share of gpu_cache_max_bytes (default: a quarter of the device memory free at set-up)
 * and half of the memory free at the time. It never shrinks.
 *
 * The measure never synchronizes: the layer's fetch counters (hits, misses, selected tokens) are
 * copied to pinned memory before and after an eager step, the second copy behind an event; a later
 * step of the layer reads it if the event has completed (else a later one does). Its demand (the
 * selected tokens) is that one step's; its hits and misses run from the end of the last measure
 * read to its own end, so they include the fetches of kvt_gather between kvt_select steps (a
 * select fetches nothing; the gather of its selection follows it) and of any steps left unmeasured
 * while a measure was pending. After a growth the next measure starts at its own step, so misses
 * that filled the old cache never count against the new one's empty ways. A growth allocates the
 * larger cache, moves the rows the old one held into it and frees the old one, with device
 * synchronizations, so it happens a few times over a sequence's life (each at least 1.5x the
 * last, or an eighth more where the contexts' rows cut it short). The first step of a layer
 * captured into a CUDA graph freezes that layer's cache for good (a growth would free memory the
 * graph's kernels keep reading): size it with eager steps first.
 */
#include "cuda_backend.h"
#include "hotsize.h"

/* The fetch counters a measure copies: the first HOT_SNAP_W of a layer's (fetch.cuh). */
#define HOT_SNAP_W (KVT_GPU_CNT_SELECTED + 1)
_Static_assert(KVT_GPU_CNT_HITS < HOT_SNAP_W && KVT_GPU_CNT_MISSES < HOT_SNAP_W,
	       "a measure copies the hit and miss counters");

static size_t way_bytes(const kvt_cache *c)
{
	return c->row_bytes + KVT_GPU_HOT_TAG_BYTES;
}

/* Point a layer's cache at mem (sets sets, zeroed: every way empty). mem is cudaMalloc's (256-byte
 * aligned), so each set's tags are 64-byte and its epochs 16-byte aligned (row_bytes % 16 == 0):
 * the kernels read a set's as whole 16-byte words (fetch_rows.cuh, fetch.cu). */
static void lay_out(const kvt_cache *c, kvt_gpu_hot *h, void *mem, uint64_t sets)
{
	const uint64_t slots = sets * KVT_GPU_HOT_WAYS;
	h->sets = (uint32_t)sets;
	h->tag_hi = sets ? (unsigned long long *)mem : NULL;
	h->tag_lo = sets ? h->tag_hi + slots : NULL;
	h->rows = sets ? (void *)(h->tag_lo + slots) : NULL;
	h->last_use = sets ? (uint32_t *)((char *)h->rows + slots * c->row_bytes) : NULL;
}

/* Wait for the device, then move the rows of the layer's cache into `to` (kvt_gpu_hot_move), wait
 * for that. */
static int move_rows(kvt_cache *c, const struct gpu_layer *y, kvt_gpu_hot to)
{
	cudaError_t e = cudaDeviceSynchronize(); /* the old cache may still be read or written */
	if (e == cudaSuccess) {
		const int rc = kvt_gpu_hot_move(y->hot, to, (uint32_t)c->row_bytes, NULL);
		e = rc < 0 ? cudaGetLastError() : cudaDeviceSynchronize();
		if (rc < 0 && e == cudaSuccess)
			return kvt_seterr(c, rc, "moving the hot cache's rows: %s",
					  kvt_strerror(rc));
	}
	if (e != cudaSuccess)
		return kvt_seterr(c, -EIO, "moving the hot cache's rows into a larger one: %s",
				  cudaGetErrorString(e));
	return 0;
}

/* A cache of `sets` sets for the layer. quiet: a growth, where no device memory is not an error
 * (-ENOMEM returned, nothing recorded, the old cache kept); the old cache's rows move into the new
 * one, and on any failure the old cache stays as it was. */
static int alloc_sets(kvt_cache *c, struct gpu_layer *y, uint64_t sets, bool quiet)
{
	const size_t bytes = (size_t)(sets * KVT_GPU_HOT_WAYS * way_bytes(c));
	void *mem = NULL;
	if (quiet) {
		mem = kvt_mem_device_alloc(&c->mem, bytes);
		if (!mem) {
			(void)cudaGetLastError(); /* not sticky: the step's launches must not see it */
			return -ENOMEM;
		}
		const int rc = gpu_dzero(c, mem, bytes, "the hot-token cache");
		if (rc < 0) {
			gpu_dfree(c, mem);
			return rc;
		}
	} else {
		KVT_TRY(gpu_dalloc(c, &mem, bytes, "the hot-token cache"));
	}
	kvt_gpu_hot to = y->hot; /* the counters and the epoch stay */
	lay_out(c, &to, mem, sets);
	if (y->hot_mem) {
		const int rc = move_rows(c, y, to);
		if (rc < 0) {
			gpu_dfree(c, mem);
			return rc;
		}
		gpu_dfree(c, y->hot_mem);
	}
	y->hot_mem = mem;
	y->hot_bytes = bytes;
	y->hot = to;
	return 0;
}

int gpu_hot_init(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t L = c->cfg.n_layers;
	const uint64_t want = c->cfg.gpu_cache_bytes;
	if (want == KVT_NONE64)
		return 0;
	if (want) { /* fixed: split evenly, whole sets of KVT_GPU_HOT_WAYS ways */
		const uint64_t sets = want / L / (way_bytes(c) * KVT_GPU_HOT_WAYS);
		for (uint32_t i = 0; sets && i < L; i++)
			KVT_TRY(alloc_sets(c, &b->lay[i], sets, false));
		return 0;
	}
	b->hot_auto = true;
	uint64_t cap = c->cfg.gpu_cache_max_bytes;
	if (!cap) {
		size_t free_b = 0, total = 0;
		CU(c, cudaMemGetInfo(&free_b, &total));
		cap = free_b / KVT_GPU_HOT_AUTO_SHARE;
	}
	b->hot_cap_layer = cap / L;
	KVT_TRY(gpu_pinned_alloc(c, (void **)&b->hot_snap, 2 * HOT_SNAP_W * sizeof(uint64_t) * L,
				 "the hot cache's measures"));
	for (uint32_t i = 0; i < L; i++)
		CU(c, cudaEventCreateWithFlags(&b->lay[i].snap_ev, cudaEventDisableTiming));
	return 0;
}

void gpu_hot_fini(kvt_cache *c)
{
	struct gpu_cache *b = gpu_of(c);
	for (uint32_t i = 0; b->lay && i < c->cfg.n_layers; i++) {
		struct gpu_layer *y = &b->lay[i];
		gpu_dfree(c, y->hot_mem);
		if (y->snap_ev)
			cudaEventDestroy(y->snap_ev);
	}
	gpu_pinned_free(c, b->hot_snap, 2 * HOT_SNAP_W * sizeof(uint64_t) * c->cfg.n_layers);
}

/* The layer's measure slot i (0: before a step, 1: after it): HOT_SNAP_W pinned words. */
static uint64_t *snap_slot(const struct gpu_cache *b, uint32_t layer, int i)
{
	return b->hot_snap + (2 * (size_t)layer + (size_t)i) * HOT_SNAP_W;
}

/* Queue the copy of the layer's fetch counters into its measure slot i. */
static int snap(kvt_cache *c, uint32_t layer, int i, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	LAUNCH(c, kvt_gpu_store_words(b->counters + (size_t)layer * KVT_GPU_CNT_N,
				      (unsigned long long *)snap_slot(b, layer, i), HOT_SNAP_W,
				      stream));
	return 0;
}

/* The rows of the layer's contexts: every open sequence's tokens on each KV head. The walk stops
 * at the last open slot: a runtime may ask for many more slots (max_seqs) than it keeps open. */
static uint64_t served_rows(const kvt_cache *c, uint32_t layer)
{
	uint64_t n = 0, seen = 0;
	for (uint32_t s = 0; s < c->cfg.max_seqs && seen < c->st.seqs_open; s++)
		if (c->seqs[s].open) {
			n += c->seqs[s].layers[layer].n_tokens;
			seen++;
		}
	return n * c->cfg.n_kv_heads;
}

/* Grow the layer's cache by gpu/hotsize.h's rule on a measure, within its bounds. */
static int grow(kvt_cache *c, uint32_t layer, uint64_t demand, uint64_t reads, uint64_t misses)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	const uint64_t have = (uint64_t)y->hot.sets * KVT_GPU_HOT_WAYS;
	uint64_t rows =
		kvt_hot_rows_wanted(have, demand, reads, misses, UINT64_MAX, &y->hot_to_fill);
	if (rows == have)
		return 0;
	const uint64_t way = way_bytes(c);
	/* at its share of the bound already: no walk, no need to ask the device (a cache there
	 * whose queries miss wants to grow every step) */
	if ((have + KVT_GPU_HOT_WAYS) * way > b->hot_cap_layer)
		return 0;
	/* the served rows (a walk over the sequences) only where it would grow, in whole sets */
	rows = kvt_hot_within(have, rows,
			      (served_rows(c, layer) + KVT_GPU_HOT_WAYS - 1) / KVT_GPU_HOT_WAYS *
				      KVT_GPU_HOT_WAYS);
	if (rows == have)
		return 0;
	size_t free_b = 0, total = 0;
	CU(c, cudaMemGetInfo(&free_b, &total));
	/* the old cache is freed after the new one is made: both must fit */
	uint64_t limit = b->hot_cap_layer;
	limit = limit < (uint64_t)free_b / 2 ? limit : (uint64_t)free_b / 2;
	if (rows * way > limit)
		rows = limit / way;
	uint64_t sets = rows / KVT_GPU_HOT_WAYS;
	sets = sets < UINT32_MAX ? sets : UINT32_MAX;
	if (sets <= y->hot.sets)
		return 0; /* at its bound */
	const int rc = alloc_sets(c, y, sets, true);
	if (rc == 0)
		y->hot_to_fill = sets * KVT_GPU_HOT_WAYS - have; /* the ways it added */
	return rc == -ENOMEM ? 0 : rc; /* out of memory: the cache stays as it was */
}

/*
 * Before a step of the layer: read the last measure if it has landed (never waiting) and grow on
 * it, then start measuring this step. A step being captured freezes the layer's cache for good: a
 * growth frees memory that a captured graph's kernels keep reading.
 */
int gpu_hot_before_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	if (!b->hot_auto || y->hot_frozen)
		return 0;
	if (gpu_capturing(stream)) {
		y->hot_frozen = true;
		return 0;
	}
	if (y->snap_pending) {
		const cudaError_t q = cudaEventQuery(y->snap_ev);
		if (q == cudaErrorNotReady)
			return 0; /* a later step reads it */
		CU(c, q);
		y->snap_pending = false;
		/* rows the measured step read through the cache: its selected rows (counted on the
		 * device by an attend, on the host by a select) and its batch's sinks; and of the
		 * rows it fetched, those read from the host tier */
		const uint64_t *s0 = snap_slot(b, layer, 0), *s1 = snap_slot(b, layer, 1);
		const uint64_t sel = s1[KVT_GPU_CNT_SELECTED] - s0[KVT_GPU_CNT_SELECTED] +
				     y->snap_host_sel;
		const uint64_t h0 = y->have_last ? y->last_hits : s0[KVT_GPU_CNT_HITS];
		const uint64_t m0 = y->have_last ? y->last_misses : s0[KVT_GPU_CNT_MISSES];
		const uint64_t misses = s1[KVT_GPU_CNT_MISSES] - m0;
		const uint64_t reads = misses + s1[KVT_GPU_CNT_HITS] - h0;
		const uint32_t sets = y->hot.sets;
		y->last_hits = s1[KVT_GPU_CNT_HITS];
		y->last_misses = s1[KVT_GPU_CNT_MISSES];
		y->have_last = true;
		KVT_TRY(grow(c, layer,
			     sel + (uint64_t)c->cfg.n_sink * c->cfg.n_kv_heads * y->snap_seqs, reads,
			     misses));
		if (y->hot.sets != sets)
			y->have_last = false; /* grown: the next measure starts at its own step */
	}
	KVT_TRY(snap(c, layer, 0, stream));
	y->snap_host_sel = y->selected;
	y->snap_seqs = n_seqs;
	y->measuring = true;
	return 0;
}

/* After a step of the layer: end the measure begun before it. */
int gpu_hot_after_step(kvt_cache *c, uint32_t layer, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	struct gpu_layer *y = &b->lay[layer];
	if (!b->hot_auto || !y->measuring)
		return 0;
	y->measuring = false;
	KVT_TRY(snap(c, layer, 1, stream));
	CU(c, cudaEventRecord(y->snap_ev, (cudaStream_t)stream));
	y->snap_host_sel = y->selected - y->snap_host_sel;
	y->snap_pending = true;
	return 0;
}
