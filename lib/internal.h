/* SPDX-License-Identifier: MIT */
/* Internal interfaces shared by lib/, host/, gpu/ and the tests. Never installed. */
#ifndef KVT_INTERNAL_H
#define KVT_INTERNAL_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"
#include "kvt_config.h"
#include "../host/alloc.h"
#include "../host/err.h"
#include "../host/extent.h"
#include "../host/nvme_store.h"
#include "constants.h"
#include "kernels.h"

/* ---- errors (lib/error.c) ---------------------------------------------------------------- */

/* Record the detail of an error on `c` (or on the calling thread when c is NULL) and return `code`;
 * counts the failed call in kvt_stats.errors. */
int kvt_seterr(kvt_cache *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Rewrite the detail of an error already set on c (by kvt_seterr, so already counted: one failed
 * call counts once however often its text is wrapped; the entry it names stays) and return
 * `code`. */
int kvt_err_wrap(kvt_cache *c, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* The error just set (rc, from kvt_seterr) concerns entry i of the failing call's batch. */
int kvt_err_entry(kvt_cache *c, uint32_t i, int rc);
#define KVT_ERR_TEXT 512
/* Around a verb whose own errors do not decide the call's result (a clean-up after a failure, a
 * best-effort sync after a success): between kvt_err_mute(c, true) and kvt_err_mute(c, false),
 * kvt_seterr, kvt_err_wrap and kvt_err_entry record nothing on c (text, entry, count), so the
 * call's error stands as it was. */
void kvt_err_mute(kvt_cache *c, bool on);

#define KVT_RETURN_IF(cond, c, err, ...)                                                            \
	do {                                                                                       \
		if (cond)                                                                          \
			return kvt_seterr((c), (err), __VA_ARGS__);                                \
	} while (0)

#define KVT_TRY(expr)                                                                              \
	do {                                                                                       \
		int kvt_try_rc_ = (expr);                                                          \
		if (kvt_try_rc_ < 0)                                                               \
			return kvt_try_rc_;                                                        \
	} while (0)

/* ---- state ------------------------------------------------------------------------------ */

/*
 * A run of prefill chunks with no append between them: lengths [from, to), the index count at
 * `from`. Consecutive chunks index what one chunk of their total would (the prefill target only
 * grows), so a run and the append rule between runs give the index count of every length the
 * layer went through: what kvt_seq_truncate goes back to (lib/lifecycle.c).
 */
struct kvt_run {
	uint32_t from, to, ni;
};

/* Per (sequence, layer). Token positions: [0, n_sink) sinks, then the index covers
 * [n_sink, n_sink + n_indexed), and the window is the rest up to n_tokens. */
struct kvt_layer {
	uint32_t n_tokens;
	uint32_t n_indexed;
	bool centroids;     /* frozen */
	uint32_t cent_keep; /* the frozen centroids hold for lengths >= cent_keep (the event that froze
			       them, a prefill chunk or the first flush, is part of such a prefix) */
	struct kvt_run *runs; /* [runs_cap] prefill runs, oldest first */
	uint32_t n_runs, runs_cap;
	float *c_k;         /* [n_kv_heads, d] */
	float *c_q;         /* [n_kv_heads, d] */
	uint32_t idx_cap;   /* tokens of index storage per KV head */
	uint32_t *codes;    /* [n_kv_heads, idx_cap, d/32] */
	uint16_t *sigma;    /* [n_kv_heads, idx_cap] fp16 */
	uint16_t *beta;     /* [n_kv_heads, idx_cap] fp16 */
	uint32_t blk_cap;   /* host-tier blocks per KV head the table can hold */
	uint32_t n_blocks;  /* blocks per KV head in use */
	void **blocks;      /* [n_kv_heads, blk_cap] */
	uint64_t blocks_gen; /* bumped when an existing entry of `blocks` changes (spill, restore) */
	uint64_t spill_gen;  /* blocks_gen + 1 when `spilled` was computed, 0: not computed */
	bool spilled;        /* a block of [0, n_blocks) is on NVMe */
	/* selection of the last kvt_select / kvt_attend, with the lengths it was made at */
	uint64_t sel_epoch; /* 0: none */
	uint32_t sel_tokens, sel_indexed;
	uint32_t *sel;      /* [n_kv_heads, idx_cap] index positions (not token positions); with
			       keep_weight, then [n_kv_heads, idx_cap] stamps: the keep_step that
			       last selected each index position, 0: none (kvt_sel_slots) */
	uint32_t *sel_n;    /* [n_kv_heads] */
	uint32_t keep_step; /* with keep_weight: kvt_select / kvt_attend calls that succeeded */
	struct kvt_spill *spill; /* [n_kv_heads, blk_cap] where blocks are on NVMe, or NULL */
	uint64_t seq_uid;   /* the owning sequence's uid (NVMe block identity, block cache key) */
	uint64_t bc_round;  /* the block cache's round of its last step or gather (lib/bcache.c) */
	uint32_t index;     /* this layer's number */
	void *dev;          /* backend-owned per-layer state */
	/* score corrections (lib/correct.c): [n_kv_heads, correction_steps + 1] entries, or NULL */
	struct kvt_corr_entry *corr;
	uint64_t corr_step; /* selections made on this layer that succeeded (kvt_attend, kvt_select) */
};

/* A host-tier block that lives on NVMe: blocks[i] is NULL and loc.bytes != 0. `uid` is the
 * seq_uid of the layer that wrote it (the block's identity on disk; a forked sequence shares it). */
struct kvt_spill {
	struct kvt_nvme_loc loc;
	uint64_t gen;
	uint64_t uid;
};

struct kvt_seq {
	bool open;
	uint64_t uid;       /* never reused, unlike the slot number */
	uint64_t last_use;
	struct kvt_layer *layers; /* [n_layers] */
	/* kvt_seq_status: 0, or the error a backend found in a step after the call returned (the
	 * CUDA kernels'), with its text; batch calls naming the sequence fail until a truncation */
	int status;
	char *status_text; /* [KVT_STATUS_TEXT] when status != 0, else NULL */
	/* KVT_PIN_*: held in the host tier by the call running (kvt_pipe_resident), never the
	 * victim of an automatic spill nor a holder whose shared blocks one moves */
	uint8_t pinned;
};

enum { KVT_PIN_NONE, KVT_PIN_HOLD, KVT_PIN_RESTORE /* held, and to be restored */ };

#define KVT_STATUS_TEXT 256u

/*
 * The LRU clock (which sequence an automatic spill takes first) as a call found it. A call stamps
 * the sequences it uses once its arguments are checked (so that its own automatic spills never
 * take them), and puts their stamps back if it fails: a failed call changes nothing, the spill
 * order included. The clock itself only moves on.
 */
struct kvt_lru_mark {
	uint64_t call_start;
};

/* Stamp the n sequences of seqs that take part (all, or those with new rows in cu), saving their
 * stamps in c->lru_saved; kvt_lru_done puts them back when rc is a failure, and returns rc. */
void kvt_lru_use(kvt_cache *c, struct kvt_lru_mark *m, uint32_t n, const uint32_t *seqs,
		 const uint32_t *cu);
int64_t kvt_lru_done(kvt_cache *c, const struct kvt_lru_mark *m, uint32_t n, const uint32_t *seqs,
		     int64_t rc);
/* The open sequence `seq` (else -ENOENT naming it); a layer below n_layers (else -EINVAL); a
 * sequence not in error (else its status' code and text). */
int kvt_seq_lookup(kvt_cache *c, uint32_t seq, struct kvt_seq **out);
int kvt_check_layer(kvt_cache *c, uint32_t layer);
int kvt_seq_check_status(kvt_cache *c, uint32_t seq, const struct kvt_seq *s);
/* Once a sequence was put in error since the last look (status_new): the first of ls whose
 * sequence is in error fails, naming its entry when batch. 0 otherwise. */
int kvt_layers_check_status(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls, bool batch);
/* Put sequence slot `seq` in error (kvt_seq_status): the first error sticks. With a graph
 * reservation it drains the device (quiesce), so never call it while a stream is being captured
 * (the backend's check calls it after synchronizing). Returns 0. */
int kvt_seq_set_status(kvt_cache *c, uint32_t seq, int rc, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* The open sequence slot whose layer `layer` carries seq_uid `uid`, or UINT32_MAX. */
uint32_t kvt_seq_of_uid(const kvt_cache *c, uint32_t layer, uint64_t uid);

struct kvt_backend_ops;

/* ---- kvt_graph_reserve's records (lib/graph.c) ------------------------------------------------ */

/* After a call that returned rc (a failure too: what a record names may have moved before it) on
 * the n sequences `seqs` on `layer` (-1: every layer): when a reservation keeps device records,
 * refresh theirs on `stream`; seqs NULL: every sequence id on every layer (after a spill or
 * restore, which may move blocks other sequences share), complete when it returns. A record that
 * cannot be made reads as no sequence (graph slots naming it pad and report). Returns rc. */
int kvt_graph_touch(kvt_cache *c, uint32_t n, const uint32_t *seqs, int layer, void *stream,
		    int64_t rc);
/* kvt_graph_touch of sequence `seq` on every layer, with no stream, its records in place when it
 * returns (a replay on a non-blocking stream does not wait for the legacy stream). What the wait
 * meets is dropped: the call's error state stands. */
void kvt_graph_touch_now(kvt_cache *c, uint32_t seq);
/* The error of a graph step's slot the device could not serve (cause: KVT_SLOT_*,
 * lib/constants.h), as kvt_seterr: -EINVAL; padded: the slot was skipped (CUDA), else
 * the call wrote nothing (cpu). */
int kvt_graph_slot_error(kvt_cache *c, uint32_t layer, uint32_t slot, uint32_t cause,
			 bool padded);
void kvt_graph_fini(kvt_cache *c);

/* ---- row layouts of the _at calls (lib/rows_layout.c) ------------------------------------------ */

/* A checked kvt_rows_layout, strides in elements: token i, KV head h at element
 * slot(i) * slot_stride + h * head_stride (slot NULL: slot(i) = i). */
struct kvt_rows_map {
	const int64_t *slot;
	uint64_t slot_stride, head_stride;
};

/* The element offset of token i's KV head h, or -1: the token is skipped. */
static inline int64_t kvt_rows_at(const struct kvt_rows_map *m, uint32_t i, uint32_t h)
{
	int64_t s = m->slot ? m->slot[i] : (int64_t)i;
	return s < 0 ? -1 : s * (int64_t)m->slot_stride + (int64_t)(h * m->head_stride);
}

/* Check `lo` for n tokens (writing: no skipped slot; reading: no repeated one), naming `call` in
 * the error; fill *m. Returns 1 when the layout is the dense one (read and write as without it),
 * 0 otherwise, or -EINVAL, -ENOMEM, -EOPNOTSUPP (a backend without read_rows_at). */
int kvt_rows_map_check(kvt_cache *c, const char *call, const kvt_rows_layout *lo, uint32_t n,
		       bool write, struct kvt_rows_map *m);
/* The n tokens of k and v placed by m, gathered into *dense ([2][n, n_kv_heads, head_dim]: K then
 * V), *bytes long (for kvt_mem_free). -ENOMEM. */
int kvt_rows_gather(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, const void *k,
		    const void *v, void **dense, size_t *bytes);

/* ---- strided q, k, v and out of the compute calls (lib/io_layout.c) ---------------------------- */

/* A tensor [n, heads, width bytes] as a strided view: row (t, h) at byte t * token_pitch +
 * h * head_pitch, its dense twin's at (t * heads + h) * width. The copy a cudaMemcpy2DAsync per
 * token (or one, when token_pitch = heads * head_pitch) does. */
struct kvt_strided {
	uint32_t n, heads;
	size_t width, token_pitch, head_pitch;
};

/* The tensors of one compute call: set q, k, v, out to the caller's (NULL: not taken), then
 * kvt_io_begin points them at what the dense pipeline reads and writes, and kvt_io_end scatters
 * out into the caller's view. */
struct kvt_io {
	const void *q, *k, *v;
	void *out;
	void *user_out;             /* the caller's out when it is strided, else NULL */
	struct kvt_strided out_view;
};

/*
 * Check that the backend's kernels reach io's tensors (kvt_check_reach) and `lo` for a call of n
 * rows (-EINVAL naming `call`, the field, its value and the limit), then
 * gather each strided input into the cache's scratch (grown: -ENOMEM) through ops->copy_strided
 * (NULL: -EOPNOTSUPP). Changes nothing of the cache but the scratch. A dense layout: no copy.
 */
int kvt_io_begin(kvt_cache *c, const char *call, const kvt_io_layout *lo, uint32_t n,
		 struct kvt_io *io, void *stream);
/* -EINVAL naming `call`, the tensor and why, for the first of ptr[0, n) (names[i]; NULL ones
 * skipped) that the backend's kernels cannot reach (ops->unreachable). Changes nothing.
 * kvt_io_begin checks its tensors so. */
int kvt_check_reach(kvt_cache *c, const char *call, uint32_t n, const char *const names[],
		    const void *const ptr[], void *stream);
/* After the dense call returned rc: a strided out is scattered when rc >= 0. Returns rc, or the
 * copy's error. */
int kvt_io_end(kvt_cache *c, struct kvt_io *io, int rc, void *stream);
void kvt_io_fini(kvt_cache *c);

struct kvt_cache {
	kvt_config cfg;
	uint32_t d, words, group; /* head_dim, d / 32, n_q_heads / n_kv_heads */
	float scale;
	size_t elem;              /* bytes per K/V element */
	size_t row_bytes;         /* K then V of one token of one KV head */
	size_t out_elem;
	const struct kvt_backend_ops *ops;
	void *be;                 /* backend-owned cache state */
	struct kvt_mem mem;       /* allocation context: the device and pin hooks of this cache */
	float *rot;               /* [n_layers, d, d] */
	struct kvt_seq *seqs;     /* [max_seqs] */
	struct kvt_layer **batch; /* [max_seqs], the layers of the batch being served */
	uint32_t *batch_tokens;   /* [max_seqs], their token counts after an append */
	uint64_t *lru_saved;      /* [max_seqs], the stamps a call put on its batch (lib/api.c) */
	uint32_t *sel_counts;     /* [max_seqs, n_kv_heads], selected counts of a step or gather;
				     the index counts of a Top-p extend's entries */
	struct kvt_store_job *store_jobs; /* [max_seqs] */
	struct kvt_index_job *index_jobs; /* [max_seqs] */
	struct kvt_extents host;
	struct kvt_pool pool;     /* hold on the shared host pool (kvt_config.host_pool), or none */
	struct kvt_share *share;  /* holders of blocks shared by forked sequences (lib/share.c) */
	kvt_stats st;
	uint64_t clock;           /* use counter for LRU and selection epochs */
	uint64_t call_start;      /* clock value of the current call's first sequence */
	uint64_t next_uid;
	/* NVMe tier (lib/nvme_tier.c) */
	struct kvt_nvme *nvme;    /* NULL: no NVMe tier */
	struct kvt_bcache *bc;    /* block cache of direct serving */
	uint64_t next_gen;        /* generation of the next NVMe block written */
	struct kvt_nvme_rows *reqs; /* [block cache slots] read requests of one direct-serving call */
	/* scratch of the CPU pipeline, grown with the largest layer so that decode never allocates */
	uint32_t scratch_cap;     /* indexed tokens the scratch serves */
	float *scores;            /* [scratch_cap] */
	float *work;              /* [rows_cap]: threshold scratch, then token positions */
	uint8_t *mask;            /* [scratch_cap] */
	uint32_t rows_cap;        /* row pointers: sinks + scratch_cap + window + flush_batch */
	const void **rows;        /* [rows_cap] */
	uint8_t *cand;            /* [2][scratch_cap] with rescore_p: a query head's candidates, then
				     their union over the group (NULL without) */
	int32_t *cand_pos;        /* [scratch_cap] with rescore_p: the candidates' token positions */
	float *keys;              /* [3 scratch_cap] with keep_weight: the selection's keys, then the
				     keyed threshold's scratch (NULL without) */
	void *io_scratch;         /* dense copies of the strided tensors of the _at calls */
	size_t io_scratch_bytes;
	/* kvt_graph_reserve (lib/graph.c): its bounds (graph_slots == 0: none), and the sequence ids
	 * of a run of valid slots (the cpu path) */
	uint32_t graph_slots, graph_tokens;
	uint32_t *graph_ids;      /* [graph_slots] */
	float *corr_logits;       /* a KV head's attended logits for the score corrections */
	size_t corr_logits_n;
	struct kvt_corr_ls *corr_ls; /* the corrections' prediction state (lib/correct.c), or NULL */
	char err[KVT_ERR_TEXT];
	int32_t err_entry; /* kvt_last_error_entry: the failed batch call's entry, or -1 */
	uint32_t err_mute; /* kvt_err_mute depth: > 0, errors are not recorded */
	bool status_new;   /* a sequence was put in error since the last batch checked for it */
};

/* Halves of a layer's sel: 2 with keep_weight (the current selection, then the stamps of the
 * selections it favors), else 1. */
static inline uint32_t kvt_sel_slots(const kvt_cache *c)
{
	return c->cfg.keep_weight != 0.0f ? 2u : 1u;
}

/* Address of the host-tier row of token `pos` of KV head `h`. */
static inline void *kvt_row(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t pos)
{
	return (char *)l->blocks[(size_t)h * l->blk_cap + pos / KVT_BLOCK_TOKENS] +
	       (size_t)(pos % KVT_BLOCK_TOKENS) * c->row_bytes;
}

/* Sinks among the first n_tokens positions. */
static inline uint32_t kvt_sinks_of(const kvt_cache *c, uint32_t n_tokens)
{
	return n_tokens < c->cfg.n_sink ? n_tokens : c->cfg.n_sink;
}

/* Indexed tokens a layer holding n_tokens has after a prefill (all but sinks and window). */
static inline uint32_t kvt_prefill_target(const kvt_cache *c, uint32_t n_tokens)
{
	uint64_t keep = (uint64_t)c->cfg.n_sink + c->cfg.window;
	return n_tokens > keep ? (uint32_t)(n_tokens - keep) : 0;
}

/* Window tokens currently held (positions past sinks and index). */
static inline uint32_t kvt_window_count(const kvt_cache *c, const struct kvt_layer *l)
{
	return l->n_tokens - kvt_sinks_of(c, l->n_tokens) - l->n_indexed;
}

/* ---- the backend table ------------------------------------------------------------------- */

/*
 * The pipeline (lib/pipeline.c) decides everything both backends share: the window and flush rule,
 * prefill targets, which index positions come from stored tokens and which from a chunk, token and
 * index counters, selection epochs, and where a sequence's rows must be before a step (residency).
 * A backend only executes device verbs on the state it owns, in the order the pipeline calls them,
 * and never calls back into tier policy (lib/nvme_tier.c).
 */

/* Rows [first, first + n) of one layer, from k and v ([n, n_kv_heads, head_dim], backend memory). */
struct kvt_store_job {
	struct kvt_layer *l;
	const void *k, *v;
	uint32_t first, n;
	uint32_t window_from; /* positions >= window_from are window tokens after the call */
};

/* Index positions [from, to) of one layer (token positions n_sink + from ...). keys: the keys of
 * position `from` onwards, [to - from, n_kv_heads, head_dim] (a prefill chunk), or NULL: tokens
 * stored before this call (the host tier, or the CUDA backend's window ring). */
struct kvt_index_job {
	struct kvt_layer *l;
	uint32_t from, to;
	const void *keys;
};

struct kvt_backend_ops {
	const char *name;
	/* Whether `device` is usable here (no cache needed): 0 and its PCI bus id (n bytes, for NUMA
	 * placement), or -ENODEV with the reason in *why; NULL: no device to probe (CPU). */
	int (*probe)(int device, char *busid, size_t n, struct kvt_err *why);
	/* The ordinal of the device with PCI bus id `busid`, or -ENODEV with the reason. */
	int (*find_device)(const char *busid, int32_t *device, struct kvt_err *why);
	/* Device memory and pinning of host pages for the caches of a usable device; NULL: none. */
	const struct kvt_mem_hooks *mem_hooks;
	int (*init)(kvt_cache *c);
	void (*fini)(kvt_cache *c);
	/* Release backend state of one layer of a closing sequence. */
	void (*layer_fini)(kvt_cache *c, struct kvt_layer *l);
	/* First verb of every call: the cache's device current, and errors it recorded since.
	 * stream: the call's (NULL when it has none); while it is being captured into a graph the
	 * verb may neither block nor clear what it found (a pending error fails the call, and is
	 * reported again by the next call outside the capture). */
	int (*enter)(kvt_cache *c, void *stream);
	/* Whether the call may block the host and allocate now (a stream being captured may not). */
	int (*may_block)(kvt_cache *c, void *stream, const char *what);
	/* The first of p[0, n) (NULL ones skipped) that the kernels cannot reach, and why in *why
	 * (a short phrase); n where they reach all or the backend cannot tell. NULL: every pointer
	 * is taken. CUDA: pageable host memory on a device without pageable memory access; nothing
	 * is asked while `stream` is being captured. */
	uint32_t (*unreachable)(kvt_cache *c, uint32_t n, const void *const p[], const char **why,
				void *stream);
	/* -EINVAL naming a non-finite element of x [rows, heads, head_dim]; NULL: not checked. */
	int (*check_finite)(kvt_cache *c, const char *name, const void *x, uint32_t rows,
			    uint32_t heads);
	/* Room for `index_tokens` indexed tokens per KV head on l and for `staged` keys of a chunk
	 * to be indexed by this call. All or nothing. */
	int (*reserve)(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t index_tokens,
		       uint32_t staged, void *stream);
	/* Freeze l's centroids: from k and q ([n, heads, head_dim], q may be NULL) of a prefill chunk,
	 * or, with k == NULL, from the n oldest window tokens of a layer that indexed nothing yet. */
	int (*centroids)(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
			 const void *k, uint32_t n, void *stream);
	/* Store rows (host blocks reserved by the pipeline). */
	int (*store)(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_store_job *jobs,
		     void *stream);
	/* Build index entries. before_store: the next store of this call overwrites what the jobs
	 * read, so the build is ordered before it; else it may run behind the call. */
	int (*index)(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const struct kvt_index_job *jobs,
		     bool before_store, void *stream);
	/* Last verb of a prefill or append that enqueued device work (reports its errors to the next
	 * call); NULL: nothing to do. */
	int (*end)(kvt_cache *c, void *stream);
	/* Score, select (into the layer's selection) and, when out != NULL, attend. With sel_n
	 * (host [n_seqs, n_kv_heads]) the selected counts are returned on the host. */
	int (*step)(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		    const void *q, void *out, uint32_t *sel_n, void *stream);
	/* Selected counts of the current selections, host [n_seqs, n_kv_heads]. */
	int (*counts)(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      uint32_t *sel_n, void *stream);
	/* Copy the selected rows (counts already checked against max_tokens). */
	int (*gather)(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      uint32_t max_tokens, int32_t *pos, void *k_out, void *v_out, void *stream);
	/* Bring c->st up to date (layer < 0) or fill the counters of one layer; NULL: nothing kept
	 * outside c->st. */
	int (*stats)(kvt_cache *c, int layer, kvt_layer_stats *out);
	/* Wait until no queued device work reads or writes the host tier (before the NVMe tier moves
	 * blocks under it); NULL: nothing queued, ever. */
	int (*quiesce)(kvt_cache *c);
	/* l is about to hold n_tokens tokens, ni of them indexed (fewer than now: kvt_seq_truncate);
	 * the host-tier rows of its new window are resident. Runs before l changes, so that a failure
	 * leaves it as it was. NULL: the backend keeps no window of its own. */
	int (*truncate)(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t ni,
			uint32_t n_tokens, void *stream);
	/* A verb of l's call failed after the backend wrote its own copy of l's window past what l
	 * holds (a chunk's store writes the ring slots of its new window tokens, which may be those
	 * of window tokens l still holds): bring that copy back to l as it is. Runs once queued
	 * device work is drained (quiesce); l's window rows are resident (a block holding a
	 * window token is never spilled). NULL: the backend keeps no window of its own. */
	int (*rewind)(kvt_cache *c, struct kvt_layer *l, void *stream);
	/* Give `to` (a fresh layer of a forked sequence, its host state already copied) the backend
	 * state of `from`, copied on the device. All or nothing. NULL: none to copy. */
	int (*fork)(kvt_cache *c, struct kvt_layer *from, struct kvt_layer *to, uint32_t layer,
		    void *stream);
	/* Copy rows [from, to) of l (resident in the host tier, or served from NVMe by a backend that
	 * serves spilled rows) into k and v, [to - from, n_kv_heads, head_dim] in backend memory. */
	int (*read_rows)(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
			 void *v, void *stream);
	/* Causal attention of the chunks of an extend: entry i's queries (rows cu[i] .. cu[i + 1] of q
	 * and out, [total, n_q_heads, head_dim]) are tokens ls[i]->n_tokens onwards, already stored
	 * and indexed (not yet counted in n_tokens, n_indexed); query j attends positions
	 * [0, ls[i]->n_tokens + j], rows of spilled blocks included. indexed NULL: all of them; else
	 * (KVT_EXTEND_TOPP) indexed[i] is entry i's index count with its chunk in, and query j attends
	 * the sinks and window among those positions and its group's Top-p selection of the indexed
	 * ones (only when extend_topp). Counts rows_fetched and, with indexed, the selection
	 * counters of a step; the pipeline counts steps and candidates. Entries with no queries are skipped. NULL: not supported (the
	 * pipeline refuses kvt_extend with -EOPNOTSUPP before anything changes). */
	int (*extend)(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      const uint32_t *cu, const uint32_t *indexed, const void *q, void *out,
		      void *stream);
	/* read_rows, each token's rows placed by m (lib/rows_layout.c). NULL: the _at calls refuse
	 * any layout but the dense one (-EOPNOTSUPP). */
	int (*read_rows_at)(kvt_cache *c, struct kvt_layer *l, uint32_t from, uint32_t to, void *k,
			    void *v, const struct kvt_rows_map *m, void *stream);
	/* n tokens' rows placed by m in k and v gathered into dense [n, n_kv_heads, head_dim] buffers
	 * of the backend's tensor memory, owned by the cache and valid until its next call (*dk,
	 * *dv), for kvt_seq_write_rows_at. NULL: the host gathers them (kvt_rows_gather). */
	int (*gather_rows)(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, const void *k,
			   const void *v, void **dk, void **dv, void *stream);
	/* Copy between a dense tensor and a strided view of it (lib/io_layout.c): to_view, dense src
	 * into the view dst; else the view src into dense dst. Both in the backend's tensor memory.
	 * NULL: the compute calls' _at forms refuse any layout but the dense one (-EOPNOTSUPP). */
	int (*copy_strided)(kvt_cache *c, void *dst, const void *src, const struct kvt_strided *s,
			    bool to_view, void *stream);
	/* kvt_graph_reserve's device side (max_slots 0: drop it), the refresh of the device records
	 * of sequence `seq` (layer -1: every layer) after a call changed it, and kvt_attend_graph
	 * reading its batch on the device. NULL: the records are not needed, and kvt_attend_graph
	 * reads the batch on the host (lib/graph.c) */
	int (*graph_reserve)(kvt_cache *c, uint32_t max_slots, uint32_t max_tokens, void *stream);
	int (*graph_publish)(kvt_cache *c, uint32_t n, const uint32_t *seqs, int layer,
			     void *stream);
	int (*attend_graph)(kvt_cache *c, uint32_t layer, const kvt_graph_batch *b, const void *q,
			    void *out, void *stream);
	/* the compute calls' tensors are device memory: the dense copies of strided ones are made in
	 * device memory too (lib/io_layout.c) */
	bool device_tensors;
	/* extend serves KVT_EXTEND_TOPP (else the pipeline refuses it before anything changes) */
	bool extend_topp;
	/* read_rows reads rows of spilled blocks itself (through kvt_rows_get); false: the pipeline
	 * restores the sequence first */
	bool read_rows_spilled;
};

extern const struct kvt_backend_ops kvt_cpu_backend;
/* Defined in gpu/ when the CUDA backend is built, NULL otherwise (lib/backend.c). */
extern const struct kvt_backend_ops *const kvt_cuda_backend_ops;

/* ---- the pipeline (lib/pipeline.c): arguments checked by lib/api.c ------------------------ */

int kvt_pipe_prefill(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
		     const void *k, const void *v, uint32_t n, void *stream);
int kvt_pipe_append(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		    const void *k, const void *v, void *stream);
/* out == NULL: select only; returns the largest per-KV-head token count. */
int kvt_pipe_step(kvt_cache *c, uint32_t layer, uint32_t n_seqs,
		  struct kvt_layer *const *ls, const void *q, void *out, void *stream);
/* kvt_extend: cu [n_seqs + 1] checked (ascending from 0); entries may be empty; seqs the ids of
 * ls (for restores). */
int kvt_pipe_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		    struct kvt_layer *const *ls, const uint32_t *cu, const void *q, const void *k,
		    const void *v, void *out, uint32_t flags, void *stream);
int kvt_pipe_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		    struct kvt_layer *const *ls, uint32_t max_tokens, int32_t *counts, int32_t *pos,
		    void *k_out, void *v_out, void *stream);

/* ---- the lifecycle of a sequence (lib/lifecycle.c): arguments checked by lib/api.c ---------- */

/* Drop the last n tokens of every layer of s (each holds at least n). */
int kvt_pipe_truncate(kvt_cache *c, struct kvt_seq *s, uint32_t slot, uint32_t n, void *stream);
/* Make child (a free slot) a copy of parent sharing its full blocks. */
int kvt_pipe_fork(kvt_cache *c, struct kvt_seq *parent, struct kvt_seq *child, void *stream);
/* Restore the spilled sequences among seqs[i] with cu[i + 1] > cu[i] when the backend reads only
 * the host tier (!ops->read_rows_spilled): all of them resident, or an error. Checked first
 * (-ENOSPC, nothing restored) that they fit at once; their restores never spill a sequence of the
 * batch. kvt_extend's batch, and kvt_seq_read_rows' one sequence where its range has a spilled
 * block. */
int kvt_pipe_resident(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *cu,
		      uint32_t layer, void *stream);
/* m NULL: dense rows (ops->read_rows), else placed by m (ops->read_rows_at, which must exist). */
int kvt_pipe_read_rows(kvt_cache *c, struct kvt_seq *s, uint32_t slot, uint32_t layer,
		       uint32_t from, uint32_t to, void *k, void *v, const struct kvt_rows_map *m,
		       void *stream);

/* ---- blocks shared by forked sequences (lib/share.c) ------------------------------------------ */

/* Keys naming a block: a host-tier block, an NVMe copy. */
uint64_t kvt_share_host_key(const void *block);
uint64_t kvt_share_nvme_key(const struct kvt_nvme_loc *loc);
/* Room for `more` newly shared blocks, so that kvt_share_add cannot fail. -ENOMEM. */
int kvt_share_reserve(kvt_cache *c, uint32_t more);
/* One more holder of key (a block held once becomes held twice). */
void kvt_share_add(kvt_cache *c, uint64_t key);
/* One holder lets go of key: the holders left; 0: it was the last, the caller frees the block. */
uint32_t kvt_share_drop(kvt_cache *c, uint64_t key);
/* Holders of key (1 when it is not shared). */
uint32_t kvt_share_holders(const kvt_cache *c, uint64_t key);
/* A shared block moved (spill, restore): its holders now under `to`. */
void kvt_share_rekey(kvt_cache *c, uint64_t from, uint64_t to);
void kvt_share_fini(kvt_cache *c);

/* ---- one (sequence, layer) (lib/layer.c) ---------------------------------------------------- */

/* Grow l's index, centroid and selection storage (and the cache scratch) to hold `tokens`
 * indexed tokens per KV head. All or nothing; -ENOMEM. */
int kvt_layer_reserve_index(kvt_cache *c, struct kvt_layer *l, uint32_t tokens);
/*
 * Give each of n layers the host-tier blocks to hold new_tokens[i] tokens. All or nothing over the
 * n layers: -ENOSPC (text names bytes needed, free and the capacity) or -ENOMEM.
 */
int kvt_layers_grow_rows(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls,
			 const uint32_t *new_tokens);
/* Give back the blocks of n layers beyond their tokens (the rows a failed call grew). */
void kvt_layers_ungrow(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls);
/* What a host-tier-full error adds when the cache draws on a host pool (" and of host pool NAME:
 * USED of TOTAL bytes used by the caches sharing it, MINE by this one"), else "": into buf[n]
 * (KVT_POOL_NOTE bytes hold it), which it returns. */
#define KVT_POOL_NOTE 192
const char *kvt_pool_note(const kvt_cache *c, char *buf, size_t n);
/* Let go of l's blocks [keep, n_blocks) per KV head, host-tier or NVMe (a shared block is freed by
 * its last holder). */
void kvt_layer_drop_blocks(kvt_cache *c, struct kvt_layer *l, uint32_t keep);
/* Room for the prefill run a chunk starting at l->n_tokens opens. -ENOMEM. */
int kvt_layer_reserve_run(kvt_cache *c, struct kvt_layer *l);
/* A prefill chunk took l from `first` to `total` tokens, ni indexed before it. */
void kvt_layer_note_run(struct kvt_layer *l, uint32_t first, uint32_t total, uint32_t ni);
/* Whether a block of l's rows is on NVMe (cached per blocks_gen). */
bool kvt_layer_spilled(const kvt_cache *c, struct kvt_layer *l);
/* Whether a block holding rows [from, to) of l (from < to <= l's tokens) is on NVMe. */
bool kvt_range_spilled(const kvt_cache *c, const struct kvt_layer *l, uint32_t from, uint32_t to);
/* Free everything a layer holds. */
void kvt_layer_free(kvt_cache *c, struct kvt_layer *l);

/*
 * Read a caller's configuration (any size the ABI accepts, doc/abi.md), resolve every default and
 * explicit zero (KVT_NONE), and validate the result into *out (size = sizeof(kvt_config)). The text
 * (on the thread, kvt_last_error(NULL)) names the field, its value and the limit. 0 or -EINVAL.
 */
int kvt_config_load(const kvt_config *cfg, kvt_config *out);

/*
 * Output structs that grow (lib/error.c). kvt_out_size_check: -EINVAL (recorded on c, or on the
 * thread when c is NULL) naming `what`, the size and `min` when size < min. kvt_out_fill: copy
 * `src` (src_size bytes, beginning with its own size field) into the caller's struct `dst` up to
 * dst's size, zeroing what lies past src_size, keeping dst->size, touching nothing past it.
 */
int kvt_out_size_check(kvt_cache *c, const char *what, size_t size, size_t min);
void kvt_out_fill(void *dst, const void *src, size_t src_size);

/* ---- score corrections from exact logits (lib/correct.c) ------------------------------------ */

/* How many query heads kvt_corr_predict takes together (the group's G, or 1 when G > 32), 0 when
 * layer l has no corrections to apply; kvt_corr_queries: where those heads' prepared queries go
 * first (gn of them), which the caller then scores with. */
uint32_t kvt_corr_heads(const kvt_cache *c, const struct kvt_layer *l);
kvt_qcode *kvt_corr_queries(kvt_cache *c);
/* Predict, for query heads g0 .. g0 + gn - 1 of KV head h (prepared in kvt_corr_queries)
 * at selection number `now`, each token's estimate error from what the last correction_steps
 * selections measured (lib/correct.c), for index positions below ni; kvt_corr_apply then adds
 * head g's to its scores (nothing unless this is what was predicted last). Allocates nothing
 * (kvt_corr_reserve). */
void kvt_corr_predict(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g0,
		      uint32_t gn, uint32_t ni, uint64_t now);
void kvt_corr_apply(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g, uint32_t ni,
		    uint64_t now, float *scores);
/* Room for kvt_corr_predict over up to `tokens` index positions (nothing when corrections are off).
 * -ENOMEM, nothing changed. */
int kvt_corr_reserve(kvt_cache *c, uint32_t tokens);
/* Room for the logits of G queries over n attended rows (G x n floats), or NULL when corrections
 * are off. -ENOMEM (in *rc). */
float *kvt_corr_logits(kvt_cache *c, uint32_t n, int *rc);
/* Record, for selection number `now`, what attending KV head h's n rows (sinks, the selection
 * l->sel, window, in that order) with the group's queries g0 .. g0 + gn showed (qf: those queries
 * as floats, gn x d; logits [G, n] as the attention computed them, rows g0 .. g0 + gn filled):
 * each selected token's exact logit minus its estimate, per query head. Called for the chunks of
 * a group in order from g0 = 0 (which empties the entry and makes its room); the entry counts
 * once the last chunk is in. -ENOMEM. */
int kvt_corr_record(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t h, uint64_t now,
		    uint32_t g0, uint32_t gn, const float *qf, uint32_t n, const float *logits);
void kvt_corr_fini(kvt_cache *c);
/* A selection of the layer succeeded: the next one counts from it. `recorded`: it attended (every
 * KV head recorded); else (kvt_select) its slot is emptied, so that what a failed step recorded
 * there never counts. */
void kvt_corr_commit(kvt_cache *c, struct kvt_layer *l, bool recorded);
/* Forget every correction of the layer (its index changed under them: a truncate). */
void kvt_corr_forget(kvt_cache *c, struct kvt_layer *l);
void kvt_corr_free(kvt_cache *c, struct kvt_layer *l);

/* ---- the NVMe tier (lib/nvme_tier.c) ------------------------------------------------------- */

int kvt_tier_init(kvt_cache *c);
void kvt_tier_fini(kvt_cache *c);
/*
 * Spill least recently used sequences (idle ones first, never `keep` nor a pinned one) until
 * `bytes` of host tier are free (KVT_SPILL_LRU). Checked first: -ENOSPC without spilling anything
 * when all candidates together cannot free enough; a spill that fails after others undoes them
 * (kvt_tier_undo). Errors: -ENOSPC, the spill's errors.
 */
int kvt_tier_make_room(kvt_cache *c, uint64_t bytes, const struct kvt_seq *keep);
/* Where the automatic spills of a call begin, so that a call failing later can undo them. */
struct kvt_tier_mark {
	uint64_t gen, spills, auto_spills;
};
void kvt_tier_mark(const kvt_cache *c, struct kvt_tier_mark *m);
/*
 * A call failed with rc after automatic spills since m: read their victims back into the host tier
 * and restore the spill counters, keeping rc and its detail text. Returns rc; if a read back fails
 * too, its victim stays spilled (readable from NVMe) and the text says so.
 */
int kvt_tier_undo(kvt_cache *c, const struct kvt_tier_mark *m, int rc);
/* Spill s's full indexed blocks; a block shared with `keep` (or not spillable in another holder)
 * stays, a shared one moves for all its holders. */
int64_t kvt_tier_spill(kvt_cache *c, struct kvt_seq *s, uint32_t slot, const struct kvt_seq *keep);
int64_t kvt_tier_restore(kvt_cache *c, struct kvt_seq *s, uint32_t slot);
/*
 * Whether kvt_tier_restore of each sequence pinned KVT_PIN_RESTORE can succeed one after the other
 * (the call's other sequences pinned KVT_PIN_HOLD): their spilled blocks (one shared by several
 * counted once) within the free host tier plus, under KVT_SPILL_LRU, what spilling the unpinned
 * sequences would free. Changes nothing; -ENOSPC naming `what`, the bytes and host_bytes when not.
 */
int kvt_tier_room_for(kvt_cache *c, const char *what);
/* Free the NVMe copies of a layer's spilled blocks (those no other sequence holds). */
void kvt_tier_drop(kvt_cache *c, struct kvt_layer *l);
/* The identity block b of KV head h of l has on NVMe as written (sp: its entry of l->spill; a forked
 * sequence reads the identity its parent wrote). */
struct kvt_nvme_block_id kvt_tier_block_id(const kvt_cache *c, const struct kvt_layer *l,
					   uint32_t h, uint32_t b, const struct kvt_spill *sp);

/* ---- direct serving through the block cache (lib/bcache.c) ------------------------------------ */

/* The block cache of nvme_cache_bytes and the read requests of one call; -ENOMEM. */
int kvt_bcache_init(kvt_cache *c);
void kvt_bcache_fini(kvt_cache *c);
/* Forget the cached chunks read by the n consecutive layers ls (one layer, or a sequence's all):
 * their rows are back in the host tier or gone, so the slots are free at once rather than aged
 * out. One pass over the cache. */
void kvt_bcache_drop(kvt_cache *c, const struct kvt_layer *ls, uint32_t n);
/*
 * A step or gather is about to read the rows of these n (sequence, layer)s: when one of them was
 * read in the current round already, the next round (decode step) begins. The block cache keeps the
 * chunks the previous round used ahead of those read in this one (lib/bcache.c). Called by the
 * pipeline for every backend; nothing without an NVMe tier.
 */
void kvt_rows_round(kvt_cache *c, uint32_t n, struct kvt_layer *const *ls);
/* The same for the one entry `at` of l's tables (nothing when it is not spilled). */
void kvt_tier_drop_block(kvt_cache *c, struct kvt_layer *l, size_t at);
/*
 * Row pointers for n ascending token positions of KV head h: host-tier rows directly, spilled rows
 * through the block cache (read and verified from NVMe on a miss). The pointers stay valid until the
 * next call into the block cache (kvt_rows_get or the prefetch); a call never evicts a chunk it
 * needs itself. Errors: the NVMe read's (-EIO, -EBADMSG, ...), -ENOSPC (one call needs more
 * chunks than the block cache holds: nvme_cache_bytes). On error nothing is lost: the chunks the
 * call could not read are forgotten, every other cached chunk stays valid.
 */
int kvt_rows_get(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t n,
		 const int32_t *pos, const void **rows);
/*
 * The prefetch of a step: every chunk of spilled rows that the step's kvt_rows_get calls will miss
 * read in one kvt_nvme_read_rows submission (queue depth filled), before those calls.
 *   kvt_rows_prefetch_begin(c)             a new plan (the pins of the previous one expire);
 *   kvt_rows_prefetch_add(c, l, h, n, pos) the rows one later kvt_rows_get(c, l, h, n, pos) reads:
 *                                          chunks cached now are pinned (kept until that call uses
 *                                          them), the others planned (at most one per slot);
 *   kvt_rows_prefetch(c)                   read the planned chunks, pinned too.
 * No kvt_rows_get between begin and kvt_rows_prefetch (the plan lives in the read requests). Only
 * what fits is read: slots that are unused, stale, read in this round and not reused, or held by
 * chunks of a planned (sequence, layer, KV head) that the plan does not need; never chunks the
 * previous round used, so the prefetch evicts no more than kvt_rows_get would. The rest is read by
 * kvt_rows_get as before. A pin is a preference, not a lock: kvt_rows_get takes a pinned slot
 * before failing, so no call fails with -ENOSPC that would succeed without the prefetch.
 * Chunks read ahead count as misses, and their first use as no hit. kvt_rows_prefetch returns 0 or
 * the read's error (the chunks of the failed read are forgotten, nothing else changes; the
 * following kvt_rows_get calls would read them again). Nothing without an NVMe tier.
 */
void kvt_rows_prefetch_begin(kvt_cache *c);
void kvt_rows_prefetch_add(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t n,
			   const int32_t *pos);
int kvt_rows_prefetch(kvt_cache *c);
/*
 * kvt_rows_prefetch, running idle's work while its reads are in flight (host/nvme_store.h's
 * contract: idle must not call the NVMe store). The work may call kvt_rows_get for rows that
 * kvt_rows_ready finds ready: those calls read nothing, and take nothing the prefetch reads.
 */
struct kvt_nvme_idle;
int kvt_rows_prefetch_idle(kvt_cache *c, const struct kvt_nvme_idle *idle);
/*
 * rc, after a failed prefetch of the step of n_seqs sequences ls[]: when the failure was one
 * request's (a block refused), the batch entry whose rows it read is named (kvt_err_entry);
 * a failure of the whole read (an I/O error) names none.
 */
int kvt_rows_blame(kvt_cache *c, int rc, uint32_t n_seqs, struct kvt_layer *const *ls);
/* Whether kvt_rows_get can serve position pos of KV head h without a read: a host-tier row, or a
 * cached chunk that the running prefetch is not reading. */
bool kvt_rows_ready(const kvt_cache *c, const struct kvt_layer *l, uint32_t h, int32_t pos);
/* Rows of one KV head in a 4 KiB chunk of a spilled block: the block cache's unit, which one
 * kvt_rows_get of a run of rows in it serves. */
static inline uint32_t kvt_rows_per_chunk(const kvt_cache *c)
{
	return KVT_NVME_CHUNK / (uint32_t)c->row_bytes;
}

/* Monotonic nanoseconds. */
uint64_t kvt_now_ns(void);

#endif /* KVT_INTERNAL_H */
