/* SPDX-License-Identifier: MIT */
/*
 * Moving K/V rows on the GPU: writing new rows to the host tier and the window ring, the centroids
 * of a first chunk, the hot-token cache in front of the host tier, and the zero-copy gather that
 * turns a selection into the row lists kvt_gpu_attend reads. C and C++.
 *
 * Rows. A row is K then V of one token of one KV head, d elements each (row_bytes = 4 d for fp16 and
 * bf16). The host tier keeps rows in blocks of KVT_BLOCK_TOKENS tokens per KV head; the block table
 * of a (sequence, layer) is a device array [n_kv_heads][blk_cap] of the blocks' addresses as the GPU
 * sees them (pinned, mapped host memory, read and written directly over PCIe). The window ring of a
 * (sequence, layer) is device memory [n_kv_heads][wcap][row]: index position i (token position
 * n_sink + i) lives in slot i % wcap.
 *
 * The hot cache of a layer is set associative (KVT_GPU_HOT_WAYS ways): a row of (sequence uid, KV
 * head h, position p) may live only in set (mix(uid, h) + p) % sets, so neighbouring tokens spread
 * over neighbouring sets. A decode step runs two kernels: the lookup marks every hit as used in this
 * step's epoch; the fill then gives each miss the least recently used way of its set that no hit or
 * earlier fill of the same step holds (claimed with a compare-and-swap on its epoch), copies the row
 * there from the host tier and points the attention at the copy. A miss whose set has no free way
 * is read by the attention straight from the host tier. Each row read from the host tier crosses
 * PCIe once per step, however it is served.
 *
 * Runs and gaps. A warp reads one 512-byte row (D 128, fp16) and all rows of a step are in flight
 * together, so neighbouring selected rows leave as neighbouring requests; nothing is bridged. On the
 * H200 machine (bench/gpu_gather) a plain zero-copy reader moved 97 M scattered 512-byte rows per
 * second (50.8 GB/s, the link's useful peak), not the 31 M segments/s DESIGN.md assumed, so a
 * segment costs no more than the bytes of one row: bridging gaps of up to 4 rows added 18-52 % more
 * rows and lowered useful throughput by the same share. Bridging pays only where a segment costs
 * more than the gap's bytes (rows of 128 bytes, or a link with a lower request rate); measure
 * first with bench/gpu_gather.
 */
#ifndef KVT_GPU_FETCH_CUH
#define KVT_GPU_FETCH_CUH

#include <stddef.h>
#include <stdint.h>

#include "attend.cuh"
#include "errword.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes a kernel-parameter upload carries per launch (kvt_gpu_upload). */
#define KVT_GPU_UPLOAD_CHUNK 3072u

/* Counters of one layer's fetches, in device memory (indices into kvt_gpu_hot.counters). */
enum {
	KVT_GPU_CNT_HITS = 0,     /* sink and selected rows served from the hot cache */
	KVT_GPU_CNT_MISSES = 1,   /* rows read from the host tier */
	KVT_GPU_CNT_PCIE = 2,     /* bytes read from the host tier */
	KVT_GPU_CNT_SELECTED = 3, /* indexed tokens selected, summed over KV heads */
	KVT_GPU_CNT_ROWS = 4,     /* rows attended (sinks + selected + window) */
	KVT_GPU_CNT_RESCORED = 5, /* the second stage's candidates (union per KV head) */
	KVT_GPU_CNT_RESCORED_UNSEL = 6, /* of them, not selected by the step */
	KVT_GPU_CNT_BMAX = 7,     /* query-head selections cut to budget_max */
	KVT_GPU_CNT_BMIN = 8,     /* query-head selections raised to budget_min */
	KVT_GPU_CNT_SCANHIST = 9, /* Top-p thresholds decided from the scan's histogram */
	KVT_GPU_CNT_N = 10
};

/* The hot cache of one layer (device memory; sets == 0: no cache, every row read from host). */
typedef struct kvt_gpu_hot {
	unsigned long long *tag_hi; /* [sets * WAYS]: uid of the row's sequence, 0 = empty way */
	unsigned long long *tag_lo; /* [sets * WAYS]: KV head << 32 | token position */
	uint32_t *last_use;         /* [sets * WAYS]: epoch of the last step that used the way */
	void *rows;                 /* [sets * WAYS][row_bytes] */
	unsigned long long *counters; /* [KVT_GPU_CNT_N], added to by every fetch */
	uint32_t sets;
	uint32_t flags;             /* KVT_GPU_HOT_NO_STEP: not a step (a re-gather): leave the
				       selected and rows counters alone */
	const uint32_t *epoch;      /* device word holding the step's epoch (bumped on the device
				       before the fetch, so a replayed graph gets a new one each
				       time), or NULL: the epoch argument of the launch */
} kvt_gpu_hot;

#define KVT_GPU_HOT_NO_STEP 1u

/* One (sequence, layer) of a fetch (device memory, one per batch entry). */
typedef struct kvt_gpu_fetch_seq {
	void *const *blocks;   /* [n_kv_heads][blk_cap] host-tier blocks as the device sees them */
	const uint32_t *sel;   /* [n_kv_heads][sel_ld] selected index positions, ascending */
	const uint32_t *sel_n; /* [n_kv_heads] */
	const void *ring;      /* [n_kv_heads][wcap][row] window ring */
	unsigned long long uid; /* the sequence's uid (> 0), part of the hot-cache tag */
	uint64_t sel_ld;
	uint32_t blk_cap, wcap;
	uint32_t n_sink;       /* sinks attended: positions [0, n_sink) */
	uint32_t n_indexed;    /* index positions [0, n_indexed) are in the index */
	uint32_t n_tokens;     /* the window is positions [n_sink + n_indexed, n_tokens) */
	uint32_t flags;        /* KVT_GPU_FETCH_SPILLED */
} kvt_gpu_fetch_seq;

/*
 * Some blocks of the sequence are on NVMe (their table entries are NULL): the lookup leaves their
 * missed rows NULL instead of reporting them, and the host, between the lookup and the fill, reads
 * them into pinned memory and writes each one's address with bit 0 set (KVT_GPU_ROW_STAGED) into
 * `rows`; the fill treats such a row as a miss read from that address (gpu/spilled.c).
 */
#define KVT_GPU_FETCH_SPILLED 1u
#define KVT_GPU_ROW_STAGED 1u

/*
 * The rows of every (sequence, KV head) item: sinks, then the selected tokens, then the window, in
 * ascending position order, as the CPU backend's row list.
 *   seqs:  device [n_seqs]; hot: the layer's cache (by value); epoch: this step's, > every earlier
 *          epoch given for this cache
 *   rows:  device [n_seqs * n_kv_heads][max_rows] row pointers (out)
 *   items: device [n_seqs * n_kv_heads] (out): rows = the item's slice of `rows`, n = its count
 *   pos:   device [n_seqs * n_kv_heads][max_rows] int32 token positions (out), or NULL
 *   err:   device error word or NULL: KVT_GPU_ERR_RANGE when an item's count exceeds max_rows
 *          (where = item; its n is set to 0), or a position's block is missing (NULL)
 * Returns 0, -EINVAL (NULL pointers, shapes, row_bytes not a multiple of 16) or -EIO.
 * Asynchronous, allocation-free, no host synchronization.
 */
int kvt_gpu_fetch(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
		  const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
		  const void **rows, kvt_gpu_rows *items, uint32_t max_rows, int32_t *pos,
		  unsigned long long *err, void *stream);

/*
 * kvt_gpu_fetch in its two halves, for a host step between them (KVT_GPU_FETCH_SPILLED): the
 * lookup writes items, positions (pos may be NULL) and the hits' rows, every miss NULL; the fill
 * serves the misses (a NULL row of a spilled block that the host did not stage is reported as
 * KVT_GPU_ERR_RANGE and pointed at the ring, never read). Same arguments, same returns.
 */
int kvt_gpu_fetch_lookup(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
			 const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
			 const void **rows, kvt_gpu_rows *items, uint32_t max_rows, int32_t *pos,
			 unsigned long long *err, void *stream);

/* A row of a spilled sequence that the lookup missed and whose block table entry is NULL. */
typedef struct kvt_gpu_spill_miss {
	uint32_t item;     /* sequence x n_kv_heads + KV head */
	uint32_t k;        /* the row's index in the item's rows */
	int32_t pos;       /* its token position */
	uint32_t reserved; /* 0 */
} kvt_gpu_spill_miss;

/*
 * Where kvt_gpu_fetch_lookup_spilled lists those rows, so that the host learns them from a count
 * and a short list instead of every item's rows and positions: count is a device word the caller
 * zeroes before the lookup (it may end above cap: entries past cap are dropped), miss holds cap
 * entries in pinned, mapped host memory, written in no fixed order.
 */
typedef struct kvt_gpu_spill_list {
	uint32_t *count;
	kvt_gpu_spill_miss *miss;
	uint32_t cap;
} kvt_gpu_spill_list;

/* kvt_gpu_fetch_lookup that also lists the misses of spilled blocks in `list`. */
int kvt_gpu_fetch_lookup_spilled(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
				 const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
				 const void **rows, kvt_gpu_rows *items, uint32_t max_rows,
				 int32_t *pos, kvt_gpu_spill_list list, unsigned long long *err,
				 void *stream);

/*
 * rows[miss[i].item * max_rows + miss[i].k] = addr[i] for i < n where addr[i] != 0 (the host's
 * staged rows, tagged KVT_GPU_ROW_STAGED); miss and addr may be mapped host memory. Returns 0,
 * -EINVAL or -EIO.
 */
int kvt_gpu_spill_scatter(const kvt_gpu_spill_miss *miss, const uint64_t *addr, uint32_t n,
			  const void **rows, uint32_t max_rows, void *stream);
int kvt_gpu_fetch_fill(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
		       const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
		       const void **rows, const kvt_gpu_rows *items, uint32_t max_rows,
		       unsigned long long *err, void *stream);

/*
 * Copy the rows of n_items items into dense outputs: K of row t of item i to
 * k_out[(i * ld + t) * d ...], V likewise (elements of 2 bytes); positions to pos_out[i * ld + t]
 * when both pos_out and pos are given. k_out and v_out may both be NULL (positions only).
 * Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_rows_copy(uint32_t d, uint32_t n_items, const kvt_gpu_rows *items, uint32_t max_rows,
		      const int32_t *pos, void *k_out, void *v_out, int32_t *pos_out, uint32_t ld,
		      void *stream);

/* New rows of one (sequence, layer): a prefill chunk, or one decode token (host memory, by value). */
typedef struct kvt_gpu_store_job {
	const void *k, *v;    /* device: element e of token t, KV head h at t * stride + h * d + e */
	void *const *blocks;  /* device block table [n_kv_heads][blk_cap] */
	void *ring;           /* device window ring or NULL */
	uint64_t stride;      /* elements between tokens */
	uint32_t blk_cap, wcap;
	uint32_t first;       /* position of token 0 */
	uint32_t n;           /* tokens, <= max_n of the launch */
	uint32_t ring_from;   /* tokens at positions >= ring_from also go to the ring */
	uint32_t n_sink;
} kvt_gpu_store_job;

/*
 * Write the rows of n_jobs jobs to the host tier (through the block tables) and, from ring_from on,
 * to the window rings. `jobs` is a host array, passed to the kernels by value (no staging memory, so
 * a CUDA graph that captures the call replays the same jobs). Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_store_rows(uint32_t d, uint32_t n_kv_heads, uint32_t n_jobs,
		       const kvt_gpu_store_job *jobs, uint32_t max_n, unsigned long long *err,
		       void *stream);

/*
 * The centroids of a first chunk, the twin of the CPU backend's set_centroids: c_k[h][j] is the mean
 * of key element j of head h over n tokens (element j of token t at keys[t * tok_stride + h *
 * head_stride + j]), c_q[h][j] the mean over the tokens and the query group of q ([n][n_kv_heads *
 * group][d]), or 0 when q is NULL; both summed in double in the CPU's order, so bit-equal.
 * dtype: F16 or BF16. Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_centroids(uint32_t d, uint32_t dtype, uint32_t n_kv_heads, uint32_t group,
		      const void *keys, uint64_t tok_stride, uint64_t head_stride, const void *q,
		      uint32_t n, float *c_k, float *c_q, void *stream);

/*
 * Copy `bytes` from host memory `src` to device memory `dst` through kernel parameters
 * (KVT_GPU_UPLOAD_CHUNK bytes per launch): src may be reused as soon as the call returns, and a
 * captured graph replays the bytes it was captured with. For the small descriptors of a step.
 * Returns 0, -EINVAL or -EIO.
 */
int kvt_gpu_upload(void *dst, const void *src, size_t bytes, void *stream);
/* kvt_gpu_upload that also adds 1 to the device word *bump (NULL: none) before the bytes land. */
int kvt_gpu_upload_bump(void *dst, const void *src, size_t bytes, uint32_t *bump, void *stream);
/*
 * The rows of the hot cache `from` moved into `to` (zeroed, at least as many sets), each to its set
 * of `to` with its tags and epoch; the few whose set of `to` fills up are dropped. Neither cache
 * may be read or written by other work meanwhile. Returns 0, -EINVAL (to smaller than from or
 * without sets, a NULL array of a cache with sets, row_bytes not a multiple of 16) or -EIO.
 * Asynchronous.
 */
int kvt_gpu_hot_move(kvt_gpu_hot from, kvt_gpu_hot to, uint32_t row_bytes, void *stream);

/*
 * The n 64-bit device words at src stored into dst, pinned host memory mapped for the device, by a
 * one-thread kernel in stream order: what a D2H cudaMemcpyAsync of the 8n bytes does, without
 * starting the copy engine between two kernels of a step (the error word's mirror slots, the hot
 * cache's counter snapshots). Returns 0, -EINVAL (a NULL pointer, n 0) or -EIO.
 */
int kvt_gpu_store_words(const unsigned long long *src, unsigned long long *dst, uint32_t n,
			void *stream);

#ifdef __cplusplus
}
#endif

#endif
