/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's state and the functions its files share (C, never included by .cu files).
 *
 * Where things live. Full K/V rows stay in the host tier (pinned, mapped host memory: the kernels
 * read and write it directly). Per (sequence, layer) the device holds a mirror (struct
 * gpu_seq_layer): the index in the CPU layout, the centroids, a block table mirroring the host one,
 * and the window ring (the last W..W+B tokens, W + 2B slots). Per layer number (struct gpu_layer):
 * a hot-token cache, the selection of the last step (as bits), the index jobs of the last flush
 * and an event marking the end of the last index build. Per cache (struct gpu_cache): the rotations, per-step
 * scratch (grown at a new batch or context size, never in a steady state), and a staging buffer for
 * prefill keys.
 *
 * Streams. Everything runs on the caller's stream except index builds of prefill chunks and window
 * flushes, which run on a low-priority stream of the cache, so a runtime's own prefill attention
 * overlaps them. The next call on that layer makes the caller's stream wait for the build on the
 * device (cudaStreamWaitEvent), never on the host. Prefill keys are copied to the staging buffer
 * first, so the caller may reuse its buffers in stream order as with any stream-ordered call.
 *
 * The files: backend.c (set-up, tear-down, entry, errors, stats, the verb table), timing.c (CUDA
 * event sets timing the stages), devmem.c (device buffers), hot.c (the hot cache's memory), mirror.c (the per (sequence, layer)
 * mirror), store.c (reserve, centroids, store, index: the verbs of prefill and append), step.c (the
 * verbs of a decode step and a gather), life.c (truncate, fork, row ranges), extend.c (kvt_extend). The pipeline that
 * calls them is lib/pipeline.c (lib/lifecycle.c for life.c's).
 */
#ifndef KVT_GPU_CUDA_BACKEND_H
#define KVT_GPU_CUDA_BACKEND_H

#include <cuda_runtime.h>

#include "../lib/internal.h"
#include "attend.cuh"
#include "fetch.cuh"
#include "index.cuh"
#include "score.cuh"
#include "rescore.cuh"
#include "select.cuh"
#include "graph.cuh"

/* A CUDA runtime call that must succeed, else -EIO naming it. */
#define CU(c, expr)                                                                                \
	do {                                                                                       \
		cudaError_t e_ = (expr);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return kvt_seterr((c), -EIO, "%s: %s", #expr, cudaGetErrorString(e_));     \
	} while (0)
/* A launcher of gpu/ that must return 0. */
#define LAUNCH(c, expr)                                                                            \
	do {                                                                                       \
		int r_ = (expr);                                                                   \
		if (r_ < 0)                                                                        \
			return kvt_seterr((c), r_, "%s: %s", #expr, kvt_strerror(r_));             \
	} while (0)

/* The device mirror of one (sequence, layer): kvt_layer.dev. */
struct gpu_seq_layer {
	uint32_t cap;           /* index tokens per KV head */
	uint32_t *codes;        /* [H][cap][d/32] */
	uint16_t *sigma, *beta; /* [H][cap] */
	float *cent;            /* [2][H][d]: c_k, then c_q */
	void *ring;             /* [H][wcap][row] */
	uint32_t wcap;
	void **blk;             /* [H][blk_cap] */
	uint32_t blk_cap, blk_n; /* table capacity and blocks per head uploaded */
	uint64_t blk_gen;
	uint64_t sel_stamp;     /* which selection of the layer holds this sequence's */
	uint32_t sel_slot;
	/* keep_weight: the selection its next step favors (doc/hysteresis.md), as sel_stamp and
	 * sel_slot name one: its own last, a forked parent's, or none (0) after kvt_seq_truncate */
	uint64_t keep_stamp;
	uint32_t keep_slot;
};

/* Per layer number. */
struct gpu_layer {
	kvt_gpu_hot hot;
	cudaEvent_t indexed;    /* end of the last index build of this layer */
	bool pending;           /* recorded since the last wait on `waited` */
	void *waited;           /* the stream that waited (NULL is a stream too: the default one) */
	uint64_t stamp;         /* of the last selection made */
	kvt_gpu_selbits bits;   /* the last selection, as bits (item slot H + h); its list of
				   positions is step scratch, rebuilt from the bits by a gather */
	uint32_t *sel_n;        /* [seqs][H]: its counts */
	void *sel_mem;          /* bits and counts, one allocation */
	size_t sel_bytes;
	void *keep_mem;         /* keep_weight: a step's copy of the selections it favors */
	size_t keep_bytes;
	void *g_sel_mem;        /* kvt_attend_graph's selection, laid out as sel_mem (a replay
				   never writes over the selection kvt_gather reads) */
	size_t g_sel_bytes;
	void *jobs;             /* index jobs and views of one build, device */
	uint64_t steps, selected;
	/* the hot cache's memory and, self-sized (hot.c), the measure of one step: the fetch
	 * counters copied before and after it (the second behind snap_ev), the selections the host
	 * counted in it and its batch size */
	void *hot_mem;
	size_t hot_bytes;
	cudaEvent_t snap_ev;
	bool measuring, snap_pending;
	bool hot_frozen;        /* a step was captured: the cache is never replaced */
	uint64_t snap_host_sel;
	uint32_t snap_seqs;
	uint64_t hot_to_fill;   /* empty ways left before misses may grow it (gpu/hotsize.h) */
	/* the hit and miss counters at the end of the last measure read (valid: have_last), where
	 * the next measure's hits and misses start, so the gathers between steps count */
	uint64_t last_hits, last_misses;
	bool have_last;
};

/* Stage times: CUDA events around the stages of a step or an index build, read back (and added to
 * the ns_* counters of kvt_stats) once complete, at the latest by kvt_get_stats. */
#define GPU_TIMING_SETS 64
enum gpu_timing_kind { T_NONE, T_STEP, T_INDEX, T_STORE };
struct gpu_timing {
	cudaEvent_t ev[4]; /* step: start, scored, selected, attended; index and store: start, end */
	int kind;
};

/* The backend state of a cache: kvt_cache.be. */
struct gpu_cache {
	cudaStream_t idx;
	float *rot;                   /* [L][d][d] */
	unsigned long long *err;      /* device error word */
	unsigned long long *err_host; /* pinned mirrors: one slot per call that copies the word */
	/* which call copied the word into each mirror slot (backend.c): its layer and the seq_uid
	 * of each batch entry, n = UINT32_MAX when it had no batch */
	struct gpu_err_call {
		uint32_t layer, n;
	} *err_calls;
	uint64_t *err_uids;                /* [GPU_ERR_SLOTS][max_seqs] */
	uint64_t err_issued, err_seen;     /* slots queued, slots read (both counting up) */
	bool err_lost;                     /* a slot was reused before it was read */
	bool err_graphs;                   /* a step was captured: errors name no sequence */
	struct gpu_layer *lay;        /* [L] */
	unsigned long long *counters; /* [L][KVT_GPU_CNT_N] device */
	unsigned long long *cnt_host; /* [L][KVT_GPU_CNT_N] */
	void *arena;                  /* per-step scratch */
	size_t arena_bytes;
	void *staging;                /* prefill keys */
	size_t staging_bytes;
	cudaEvent_t staging_ev, ready;
	bool staging_pending;
	bool hot_auto;                /* the hot cache sizes itself (hot.c) */
	bool pageable_access;         /* the device reads pageable host memory (runtime.c) */
	uint64_t hot_cap_layer;       /* its bound per layer, bytes */
	uint64_t *hot_snap;           /* [L][2][HOT_SNAP_W] pinned: a layer's fetch counters before
					 and after a step (hot.c) */
	uint64_t stamp;
	void *host;                   /* host scratch for descriptors, max_seqs entries */
	size_t jobs_bytes;
	struct gpu_timing t[GPU_TIMING_SETS];
	uint32_t t_next;
	/* rows of spilled blocks served in place (spilled.c): the list of a step's misses (pinned,
	 * mapped; its count on the device) and the staged rows, reused once the last step that read
	 * them is done (sp_ev); host scratch to plan the reads */
	void *sp_meta, *sp_rows, *sp_host;
	size_t sp_meta_bytes, sp_rows_bytes, sp_host_bytes;
	uint32_t *sp_count;
	uint32_t sp_cap; /* the list made for the coming serve, 0: none */
	cudaEvent_t sp_ev;
	bool sp_pending, sp_used;
	/* kvt_extend (extend.c): the staged rows of a range and the query rows' running state, and
	 * what it read from the host tier */
	void *ext_mem;
	size_t ext_bytes;
	uint64_t ext_rows, ext_bytes_read;
	cudaStream_t ext_side;  /* stages range r + 1 while the caller's stream attends range r */
	cudaEvent_t ext_ev[5];  /* the entry's start, staged[2], free[2] (per staging buffer) */
	size_t l2_bytes;           /* the device's L2 cache (step.c: when the scan bins) */
	uint32_t ext_stage_blocks; /* per KV head, of that staging: about one per SM in all */
	/* kvt_seq_read_rows_at / write_rows_at (life.c): dense rows and the slot mapping */
	void *rows_mem;
	size_t rows_bytes;
	uint32_t *epochs;             /* [L] device: each layer's hot-cache epoch, bumped on the
					 device by each step's descriptors (a replay gets its own) */
	/* kvt_graph_reserve (graph.c): a record of every (layer, sequence id) on the device, the
	 * zero centroids of a padded slot, the reserved bounds (g_slots == 0: none) */
	void *g_table;                /* kvt_gpu_graph_row [L][max_seqs] */
	float *g_zero;                /* [2][n_kv_heads][d] */
	uint32_t g_slots, g_tokens;
};

static inline struct gpu_cache *gpu_of(const kvt_cache *c)
{
	return (struct gpu_cache *)c->be;
}

/* Rounded up to 256 bytes: pieces of one allocation stay aligned. */
static inline size_t gpu_up(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

/* timing.c */
void gpu_harvest(kvt_cache *c, struct gpu_timing *t);
struct gpu_timing *gpu_timing(kvt_cache *c, void *stream, int kind);
void gpu_mark(struct gpu_timing *t, int i, void *stream);

/* spilled.c: before the lookup of a fetch, the list its misses of spilled blocks go to (count
 * NULL: no sequence of the batch is spilled); between the lookup and the fill, read those rows
 * through the NVMe tier into pinned staging and point the rows at them; then, after the kernels
 * that read them, gpu_spilled_done. */
int gpu_spilled_list(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		     uint32_t max_rows, void *stream, kvt_gpu_spill_list *out);
int gpu_serve_spilled(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const void **rows, uint32_t max_rows, void *stream);
int gpu_spilled_done(kvt_cache *c, void *stream);

/* hot.c: the hot cache's memory, fixed or self-sized (around each step of a layer) */
int gpu_hot_init(kvt_cache *c);
void gpu_hot_fini(kvt_cache *c);
int gpu_hot_before_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs, void *stream);
int gpu_hot_after_step(kvt_cache *c, uint32_t layer, void *stream);

/* devmem.c */
/* Host pages pinned (and mapped) through the cache's allocation context: *p, or -ENOMEM naming
 * `what`; freed (NULL accepted) with the same size. */
int gpu_pinned_alloc(kvt_cache *c, void **p, size_t bytes, const char *what);
void gpu_pinned_free(kvt_cache *c, void *p, size_t bytes);
/* Whether `stream` is being captured into a graph (true when that cannot be told). */
bool gpu_capturing(void *stream);
/* -EINVAL with the text `why` when `stream` is being captured into a graph. */
int gpu_refuse_capture(kvt_cache *c, void *stream, const char *why);
/* The same for `what`, which needs device memory. */
int gpu_no_capture(kvt_cache *c, void *stream, const char *what);
void gpu_dfree(kvt_cache *c, void *p);
int gpu_dalloc(kvt_cache *c, void **p, size_t bytes, const char *what);
/* Zero device memory and settle it (below): gpu_dalloc's zeroing, for memory allocated otherwise. */
int gpu_dzero(kvt_cache *c, void *p, size_t bytes, const char *what);
/* Wait for the work the synchronous calls put on the legacy default stream: a cudaMemset of device
 * memory, or a cudaMemcpy from pageable memory (which returns once the bytes are staged, not
 * landed), may still be in flight when they return, and kernels on a caller's non-blocking stream
 * are not ordered after them. gpu_dalloc's zeroing is settled. */
int gpu_settle(kvt_cache *c, const char *what);
int gpu_grow(kvt_cache *c, void **p, size_t *have, size_t need, void *stream, const char *what);
/* Make `stream` wait for the last index build of `layer`. */
int gpu_wait_index(kvt_cache *c, uint32_t layer, void *stream);

/* mirror.c */
void gpu_mirror_free(kvt_cache *c, struct gpu_seq_layer *g);
int gpu_mirror_get(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer **out);
int gpu_mirror_reserve(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer *g, uint32_t layer,
		       uint32_t tokens, void *stream);
int gpu_mirror_sync_blocks(kvt_cache *c, struct kvt_layer *l, struct gpu_seq_layer *g,
			   void *stream);
/* The first ni index entries per KV head of `from` into `to` (its capacity reserved), on stream. */
int gpu_mirror_copy_index(kvt_cache *c, const struct gpu_seq_layer *from, uint32_t ni,
			  struct gpu_seq_layer *to, void *stream);
kvt_gpu_index_view gpu_mirror_view(const struct gpu_seq_layer *g);
/* The fetch descriptor of l's mirror g at these lengths, less the selection's place (sel, sel_n,
 * sel_ld), which the caller sets. */
kvt_gpu_fetch_seq gpu_mirror_fetch(const kvt_cache *c, struct kvt_layer *l,
				   const struct gpu_seq_layer *g, uint32_t n_tokens, uint32_t n_indexed);

/* runtime.c: the probe and memory hooks of the backend table */
int gpu_probe(int device, char *busid, size_t n, struct kvt_err *why);
int gpu_find_device(const char *busid, int32_t *device, struct kvt_err *why);
extern const struct kvt_mem_hooks gpu_mem_hooks;
/* ops->unreachable: the first of p[0, n) that is pageable host memory where the device cannot
 * read it ("pageable host memory"); n while `stream` is being captured, where the runtime cannot
 * tell, and for any other memory */
uint32_t gpu_unreachable(kvt_cache *c, uint32_t n, const void *const p[], const char **why,
			 void *stream);

/* backend.c */
int gpu_check_err(kvt_cache *c);
int gpu_err_copy(kvt_cache *c, void *stream);
/* gpu_err_copy for a call over a batch on `layer`: an error a kernel raises for a batch entry is
 * then put on that entry's sequence (kvt_seq_status) by the next check instead of failing it. */
int gpu_err_copy_batch(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
		       struct kvt_layer *const *ls, void *stream);

/* store.c: verbs of prefill and append */
int gpu_reserve(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t index_tokens,
		uint32_t staged, void *stream);
int gpu_centroids(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q, const void *k,
		  uint32_t n, void *stream);
int gpu_store(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_store_job *jobs,
	      void *stream);
int gpu_index(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_index_job *jobs,
	      bool before_store, void *stream);

/* step.c: verbs of a decode step and a gather; the host scratch a step's descriptors need */
size_t gpu_step_host_bytes(const kvt_cache *c, uint32_t n_seqs);
/* Grow the step scratch and every layer's selection for max_slots sequences of max_tokens. */
int gpu_step_reserve(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens, void *stream);
int gpu_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	     const void *q, void *out, uint32_t *sel_n, void *stream);
/* gpu_step, the error word's copy left to the caller when !copy_err (several steps, one copy) */
int gpu_step_copy(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		  const void *q, void *out, uint32_t *sel_n, bool copy_err, void *stream);
/* A step's checks and scratch (for n_seqs with at most max_ni index tokens and max_rows rows
 * per item) made ahead, so that the steps of a call fail before the first one runs. */
int gpu_step_prepare(kvt_cache *c, uint32_t layer, uint32_t n_seqs, uint32_t max_ni,
		     uint32_t max_rows, void *stream);
int gpu_counts(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       uint32_t *sel_n, void *stream);
int gpu_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       uint32_t max_tokens, int32_t *pos, void *k_out, void *v_out, void *stream);

/* life.c: verbs of truncate, fork and row ranges */
int gpu_truncate(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t ni, uint32_t n_tokens,
		 void *stream);
int gpu_rewind(kvt_cache *c, struct kvt_layer *l, void *stream);
int gpu_fork(kvt_cache *c, struct kvt_layer *from, struct kvt_layer *to, uint32_t layer,
	     void *stream);
int gpu_read_rows(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k, void *v,
		  void *stream);
int gpu_read_rows_at(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
		     void *v, const struct kvt_rows_map *m, void *stream);
int gpu_gather_rows(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, const void *k,
		    const void *v, void **dk, void **dv, void *stream);

/* graph.c: kvt_graph_reserve, the records it keeps (refreshed through graph_publish) and the
 * reserved geometry every step within it uses (max_ni, max_rows: the bounds of index tokens and
 * rows per item; split: the batch size the attention's split is laid out for) */
int gpu_graph_reserve(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens, void *stream);
int gpu_graph_publish(kvt_cache *c, uint32_t n, const uint32_t *seqs, int layer, void *stream);
void gpu_graph_fini(kvt_cache *c);
bool gpu_graph_geometry(const kvt_cache *c, uint32_t n_seqs, uint32_t *max_ni, uint32_t *max_rows,
			uint32_t *split);
/* step.c: kvt_attend_graph's step */
int gpu_attend_graph(kvt_cache *c, uint32_t layer, const kvt_graph_batch *gb, const void *q,
		     void *out, void *stream);

/* extend.c: kvt_extend's causal attention over the stored rows (exact, or Top-p per row); the
 * bound on its staging buffer (256 MiB) */
extern uint64_t gpu_extend_stage_bytes;
extern uint32_t gpu_extend_one_range, gpu_extend_overlap_q;
int gpu_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       const uint32_t *cu, const uint32_t *indexed, const void *q, void *out, void *stream);

#endif /* KVT_GPU_CUDA_BACKEND_H */
