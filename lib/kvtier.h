/* SPDX-License-Identifier: MIT */
/*
 * kvtier: tiered K/V storage with a compact on-device index for long-context decoding.
 *
 * Full-precision K/V rows live in a host tier (pinned host memory). A compact index of every key
 * (1-bit rotated codes plus two fp16 scalars, D/8 + 4 bytes per token per KV head) estimates each
 * token's attention score without bias; at each decode step the smallest set of tokens that covers
 * probability mass p (Top-p) is selected, and exact attention runs over sinks + selected + window.
 *
 * Conventions, for every function below:
 * - Return value: 0 (or a non-negative count) on success, a negative errno value on failure. The
 *   codes, each with a kvt_strerror() text (tests/abi_strerror.py checks that every code the sources
 *   return is listed here and has one):
 *   -EINVAL bad argument, -ENOMEM allocation failed, -ENOSPC a configured capacity would be exceeded,
 *   -EOPNOTSUPP feature not built or not available, -ENODEV no GPU, -EIO device or I/O failure,
 *   -ENOENT unknown sequence, -EBADMSG an NVMe block failed verification, -E2BIG more tokens than
 *   the CUDA selection handles or than a graph reservation's bounds, -EMFILE / -ENFILE out of file descriptors (process / system) for
 *   the NVMe tier; and codes an NVMe I/O completion itself reports, passed on (-EBUSY also when an
 *   NVMe file is held by another cache):
 *   -ECANCELED, -EAGAIN, -EINTR, -EBUSY, -ETIMEDOUT, -ENODATA, -ENOLINK, -EREMOTEIO, -EILSEQ,
 *   -EBADE, -ETIME, -EFBIG, -EROFS, -EBADF, -EFAULT, -EOVERFLOW, -ENXIO. kvt_last_error() gives the detail.
 * - A call that fails changes nothing that the caller can observe (except the last-error text and the
 *   error counter in kvt_stats, which it raises by one), unless its comment says otherwise. A call
 *   that succeeds leaves the counter as it was.
 * - Pointers to tensors are host pointers for the CPU backend and device pointers for the CUDA
 *   backend (managed and pinned host memory serve too, the latter read over PCIe). The CUDA backend
 *   refuses pageable host memory where the device cannot read it: -EINVAL naming the call and the
 *   tensor, nothing changed (not checked inside a stream capture; a pointer into freed memory or
 *   another process's stays the caller's to get right). Tensors are dense, row-major, in the
 *   cache's dtype unless stated otherwise.
 * - Streams are `void *` (a cudaStream_t for the CUDA backend, ignored by the CPU backend).
 * - Thread safety: calls on one cache must be serialized by the caller. Distinct caches may be used
 *   from distinct threads concurrently.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVT_BUILDING) && defined(__GNUC__)
#define KVT_API __attribute__((visibility("default")))
#else
#define KVT_API
#endif

#define KVT_VERSION_MAJOR 0
#define KVT_VERSION_MINOR 1
#define KVT_VERSION_PATCH 0
#define KVT_VERSION_NUMBER (KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH)

/* Element types of K, V, queries and outputs. */
typedef enum kvt_dtype {
	KVT_DTYPE_DEFAULT = 0, /* only for kvt_config.out_dtype: same as kvt_config.dtype */
	KVT_DTYPE_F16 = 1,     /* IEEE binary16 */
	KVT_DTYPE_BF16 = 2,    /* bfloat16 */
	KVT_DTYPE_F32 = 3      /* only for kvt_config.out_dtype */
} kvt_dtype;

/* What a cache does when the host tier cannot hold new rows. */
typedef enum kvt_spill_policy {
	KVT_SPILL_NONE = 0, /* the call returns -ENOSPC */
	KVT_SPILL_LRU = 1   /* spill least recently used sequences to NVMe first: idle ones, then
			       the indexed blocks of the call's own sequences */
} kvt_spill_policy;

/*
 * kvt_config.nvme_flags (doc/data-at-rest.md). Whatever the flags, each NVMe file is held by one
 * cache at a time (a second cache on it fails with -EBUSY), files the cache creates are mode 0600,
 * and the rows of a closed sequence, or of a destroyed cache, are zeroed in the files.
 */
typedef enum kvt_nvme_flags {
	KVT_NVME_KEEP_FILES = 1u << 0 /* leave the files the cache created in place at destroy
					  (zeroed), e.g. to keep their space reserved */
} kvt_nvme_flags;

typedef enum kvt_backend_kind {
	KVT_BACKEND_AUTO = 0, /* CUDA when built and a GPU is present, else CPU */
	KVT_BACKEND_CPU = 1,
	KVT_BACKEND_CUDA = 2
} kvt_backend_kind;

/*
 * Explicit zero. In every kvt_config field 0 means "the default", so a field added by a later
 * version defaults itself in an older caller's struct. Where the value zero is also meaningful
 * (no sinks, no window, no budget floor, no hot cache, seed 0), ask for it with KVT_NONE (32-bit
 * fields) or KVT_NONE64 (64-bit fields). KVT_EXACT(x) and KVT_EXACT64(x) pass a value through,
 * turning 0 into the explicit zero: `cfg.n_sink = KVT_EXACT(user_sinks)`.
 */
#define KVT_NONE ((uint32_t)0xffffffffu)
#define KVT_NONE64 ((uint64_t)0xffffffffffffffffull)
#define KVT_EXACT(x) ((uint32_t)(x) != 0 ? (uint32_t)(x) : KVT_NONE)
#define KVT_EXACT64(x) ((uint64_t)(x) != 0 ? (uint64_t)(x) : KVT_NONE64)

/* The defaults that a 0 in kvt_config stands for (for tools that show them). */
#define KVT_DEFAULT_HOST_BYTES ((uint64_t)1 << 30)
#define KVT_DEFAULT_NVME_CACHE_BYTES ((uint64_t)64 << 20)
#define KVT_DEFAULT_MAX_SEQS 256u
#define KVT_DEFAULT_NVME_QUEUE_DEPTH 32u
#define KVT_DEFAULT_P 0.9f
#define KVT_DEFAULT_N_SINK 4u
#define KVT_DEFAULT_WINDOW 64u
#define KVT_DEFAULT_FLUSH_BATCH 64u
#define KVT_DEFAULT_BUDGET_MIN 64u
#define KVT_DEFAULT_SEED ((uint64_t)0x6b767469u)

/*
 * Cache configuration. Initialize with KVT_CONFIG_INIT (size set, every other field 0 = its
 * default), then set the model shape and what differs from the defaults.
 *
 * Sizes (doc/abi.md). `size` is sizeof(kvt_config) of the header the caller was built with. Any
 * size from KVT_CONFIG_SIZE_VER0 to sizeof(kvt_config) is accepted: fields past `size` are not read
 * and take their defaults. A size larger than this library's sizeof(kvt_config) (a caller built
 * against a later version) is accepted when every byte past sizeof(kvt_config) is zero, i.e. the
 * caller left the fields this library does not know at their defaults. `pad0` to `pad3` must be
 * zero. Anything else is -EINVAL naming the size and the limits.
 */
typedef struct kvt_config {
	size_t size;          /* sizeof(kvt_config) */
	/* model shape */
	uint32_t n_layers;    /* required, in [1, 4096] */
	uint32_t n_q_heads;   /* required: query heads, in [1, 4096], a multiple of n_kv_heads (GQA;
				 equal for MHA) */
	uint32_t n_kv_heads;  /* required, in [1, 1024] */
	uint32_t head_dim;    /* required: 64, 128 or 256 */
	uint32_t dtype;       /* kvt_dtype of K, V and queries: F16 or BF16; 0 (default): F16 */
	uint32_t out_dtype;   /* kvt_dtype of attention outputs: F16, BF16, F32; 0 (default): dtype */
	/* backend */
	uint32_t backend;     /* kvt_backend_kind; 0 (default): AUTO */
	int32_t device;       /* CUDA device ordinal, >= 0; default 0 */
	/* tiers */
	uint64_t host_bytes;  /* capacity of the host tier for K/V rows; 0 (default): 1 GiB */
	const char *const *nvme_paths; /* [n_nvme] files (created and sized) for the NVMe tier; no
					  path given twice */
	const uint64_t *nvme_bytes;    /* [n_nvme] bytes of each file to use, in [4096, 2^63) */
	uint64_t nvme_cache_bytes;     /* host memory caching blocks read for direct serving, >= 1 MiB
					  when n_nvme > 0, <= 1 TiB; 0 (default): 64 MiB. Size it to
					  the 4 KiB chunks one decode step reads from spilled
					  sequences (every layer, sequence and KV head; a chunk
					  holds 4096 / (4 head_dim) rows): then steps reuse what
					  they share; 1.5 x that lets a step's misses be read
					  ahead in one submission; smaller keeps a part
					  (doc/data-path.md, "Sizing") */
	uint32_t max_seqs;    /* sequences open at once, <= 65536; 0 (default): 256 */
	uint32_t n_nvme;      /* files of the NVMe tier, at most 64; 0 (default): no NVMe tier */
	uint32_t nvme_queue_depth; /* NVMe I/Os in flight, <= 1024; 0 (default): 32. Its bounce
				      pool (pinned where the memlock limit allows) is 2 x depth
				      slots: 1 MiB each up to 32 (at most 64 MiB), deeper the
				      largest power of two >= 64 KiB keeping the pool within 64 MiB,
				      plus 4 KiB for a block's header (66 MiB at 128, 136 MiB at
				      1024). Direct serving's 4 KiB reads reach a drive's rate only
				      at depth: on the H200 machine's disk 128 matched a raw
				      io_uring loop where 32 gave 0.87 of it */
	uint32_t spill_policy;     /* kvt_spill_policy; 0 (default): KVT_SPILL_NONE */
	/* selection */
	float p;              /* Top-p mass in (0, 1]; 0 (default): 0.9 */
	float scale;          /* attention scale, finite, >= 0; 0 (default): 1/sqrt(head_dim) */
	uint32_t n_sink;      /* first tokens always attended, never indexed, <= 65536;
				 0 (default): 4; KVT_NONE: no sinks */
	uint32_t window;      /* last tokens always attended (W), <= 65536; 0 (default): 64;
				 KVT_NONE: no window */
	uint32_t flush_batch; /* decode tokens indexed per flush (B), <= 65536; 0 (default): 64 */
	uint32_t budget_min;  /* min indexed tokens selected per query head per step; 0 (default): 64:
				 the 1-bit estimate can rank a peaked head's one dominant token below
				 others, and a small floor of top estimates recovers it cheaply;
				 KVT_NONE: no floor */
	uint32_t budget_max;  /* max per query head per step, >= budget_min; 0 (default) or KVT_NONE:
				 no cap */
	uint32_t pad0;        /* must be zero (explicit padding) */
	uint64_t seed;        /* seeds the per-layer rotations; 0 (default): 0x6b767469; KVT_NONE64:
				 seed 0 (so seed 2^64 - 1 cannot be asked for) */
	uint64_t gpu_cache_bytes; /* CUDA backend: the hot-token cache. 0 (default): self-sized, each
				     layer's growing between steps to about twice the rows a step of
				     that layer reads (selected rows and sinks of the batch), and
				     doubling while, full, it misses more than an eighth of them,
				     within the rows of its contexts (followed by an eighth at a
				     time) and gpu_cache_max_bytes; never shrunk
				     (doc/cuda-backend.md).
				     A value <= 1 TiB: that much device memory from the start, split
				     evenly over the layers, never resized. KVT_NONE64: no hot cache
				     (every selected row is read from the host tier each step) */
	uint32_t nvme_flags;  /* kvt_nvme_flags; 0 (default): files the cache created are removed at
				 kvt_cache_destroy (and by a failed kvt_cache_create) */
	uint32_t pad1;        /* must be zero (explicit padding) */
	/* several caches on one host */
	const char *device_busid; /* CUDA device by PCI bus id ("0000:3b:00.0"), or NULL (default):
				     by `device`; the cache's `device` then reads as the ordinal */
	const char *host_pool;    /* name of a host-memory budget shared by the caches of this host
				     (1..48 of [A-Za-z0-9._-]; POSIX shared memory, this user only), or
				     NULL (default): none. Every cache naming it draws its host tier
				     from it as well as from host_bytes (doc/multi-gpu.md) */
	uint64_t host_pool_bytes; /* the pool's size when this cache creates it; 0: it must exist; a
				     different size than the existing pool's is -EINVAL */
	uint32_t correction_steps; /* CPU backend: score corrections from exact logits (doc/rescoring.md):
				      a token attended in some of the last correction_steps decode
				      steps gets the least-squares prediction of its estimate's error
				      from the errors those steps measured; in [0, 64]; 0 (default):
				      off. The CUDA backend refuses a nonzero value (-EOPNOTSUPP), and
				      so does AUTO where it picks CUDA: ask for the CPU backend */
	uint32_t pad2;        /* must be zero (explicit padding) */
	uint64_t gpu_cache_max_bytes; /* CUDA backend, self-sized hot cache: the most it takes, all
					 layers together (each layer at most its n_layers-th part),
					 <= 1 TiB; 0 (default): a quarter of the device memory free
					 at kvt_cache_create. A growth also leaves half of the memory
					 then free. Must be 0 when gpu_cache_bytes fixes a size
					 (with KVT_NONE64, no cache, it is ignored) */
	float rescore_p;      /* a second stage of the selection (doc/rescoring.md): the tokens of
				 each query head's Top-p(rescore_p) on the estimate are scored
				 exactly from their keys (the K half of their rows is read), then
				 Top-p(p) runs on those exact logits and the others' estimates;
				 0 (default): off, else in (p, 1]. The CUDA backend reads the keys
				 from its hot cache or the host tier; a spilled row keeps its
				 estimate there (the CPU backend reads it from NVMe) */
	uint32_t pad3;        /* must be zero (explicit padding); the reserved words are used up:
				 later fields go past the end (doc/abi.md) */
	float keep_weight;    /* the selection's hysteresis (doc/hysteresis.md): Top-p ranks the
				 indexed tokens its KV head selected at one of the layer's last
				 keep_steps kvt_attend or kvt_select calls that succeeded as if
				 their estimated probability were (1 + keep_weight) times larger
				 (their mass counts as it is), so consecutive steps share more rows
				 and fewer cross PCIe; 0 (default): off, else finite in (0, 1e6].
				 Forgotten by kvt_seq_truncate, copied by kvt_seq_fork. CUDA
				 backend: the last step's selection only, and only where that step's
				 batch included the sequence (a step of another batch on the layer
				 in between, or one that failed, leaves it nothing to favor);
				 kvt_graph_reserve (so kvt_attend_graph, which needs its
				 reservation) and kvt_extend's Top-p rows refuse it (-EOPNOTSUPP) */
	uint32_t keep_steps;  /* with keep_weight: how many of the layer's last steps it favors the
				 selections of, <= 64; 0 (default): 1. Must be 0 without it. The
				 CUDA backend refuses more than 1 (-EOPNOTSUPP) */
} kvt_config;

/*
 * The smallest kvt_config size accepted: the fields of the first release (0.1), `size` through
 * `gpu_cache_bytes` (136 bytes on LP64). A caller may stop there; the later fields read as zero.
 */
#define KVT_CONFIG_SIZE_VER0 (offsetof(kvt_config, gpu_cache_bytes) + sizeof(uint64_t))

/*
 * `kvt_config cfg = KVT_CONFIG_INIT;`: size set, everything else 0. Written with a designator in C
 * (and as a value-initialized copy in C++, which has designators only from C++20) because a
 * positional `{ sizeof(kvt_config) }` draws -Wmissing-field-initializers under -Wextra.
 */
#ifdef __cplusplus
#define KVT_CONFIG_INIT                                                                            \
	([]() -> kvt_config {                                                                      \
		kvt_config kvt_c_ = kvt_config();                                                  \
		kvt_c_.size = sizeof(kvt_config);                                                  \
		return kvt_c_;                                                                     \
	}())
#else
#define KVT_CONFIG_INIT { .size = sizeof(kvt_config) }
#endif

/*
 * Output structs (kvt_stats, kvt_layer_stats, kvt_probe_info, kvt_footprint) start with `size`, set
 * by the caller to the sizeof of the header it was built with. The library fills the fields that
 * fit in `size` and leaves every byte past `size` untouched; a size larger than the library's own
 * struct (a caller built against a later version) gets the fields this library knows and zeros up to
 * `size`. A size below the struct's KVT_*_SIZE_VER0 (its first release's size) is -EINVAL. `size`
 * itself is left as the caller set it.
 */

/* Counters since kvt_cache_create. */
typedef struct kvt_stats {
	size_t size;                  /* set by the caller: sizeof(kvt_stats) */
	const char *backend;          /* "cpu" or "cuda"; static storage */
	uint64_t seqs_open;
	uint64_t tokens;              /* tokens held, summed over open sequences and layers */
	uint64_t tokens_indexed;      /* of which covered by the index */
	uint64_t host_bytes_used;     /* host-tier bytes allocated for K/V rows */
	uint64_t host_bytes_capacity; /* kvt_config.host_bytes */
	const char *host_placement;   /* how the host tier's NUMA node was chosen (valid while the
					 cache lives) */
	int32_t host_numa_node;       /* -1: left to first touch */
	uint32_t host_pinned;         /* 1 when host-tier extents are pinned for a GPU */
	uint64_t index_bytes;         /* bytes of codes + sigma + beta in use */
	uint64_t index_bytes_per_token_head; /* head_dim / 8 + 4 */
	uint64_t steps;               /* kvt_attend / kvt_select calls x sequences x layers, and
					 query rows of kvt_extend with KVT_EXTEND_TOPP */
	uint64_t selected_tokens;     /* indexed tokens selected, summed over steps and KV heads */
	uint64_t candidate_tokens;    /* indexed tokens scored, summed over steps and KV heads */
	uint64_t budget_max_hits;     /* query-head selections cut by budget_max */
	uint64_t budget_min_hits;     /* query-head selections raised to budget_min */
	uint64_t flushes;             /* lazy window flushes */
	uint64_t rows_fetched;        /* K/V rows read from the host tier for attention or gather
					 (kvt_seq_read_rows's not counted) */
	uint64_t bytes_fetched;
	uint64_t hot_hits;            /* sink and selected rows served from the device hot cache (CUDA) */
	uint64_t hot_misses;          /* sink and selected rows read from the host tier (CUDA) */
	uint64_t pcie_bytes;          /* bytes of rows read from the host tier over PCIe (CUDA) */
	uint64_t errors;              /* calls that returned an error, each once */
	/* NVMe tier */
	uint64_t spills, restores;    /* spills and restores that moved data: kvt_seq_spill and
					 KVT_SPILL_LRU's (also in auto_spills); kvt_seq_restore and
					 a kvt_seq_truncate into spilled blocks */
	uint64_t auto_spills;         /* sequences spilled by KVT_SPILL_LRU */
	uint64_t nvme_bytes_used, nvme_bytes_capacity;
	uint64_t nvme_bytes_written, nvme_bytes_read; /* moved to and from the files */
	uint64_t nvme_reads;          /* read I/Os, direct serving and restores */
	uint64_t nvme_ios;            /* all I/Os completed, retries and continuations included */
	uint64_t nvme_lat_ns_sum;     /* per I/O, submission to completion: mean = sum / nvme_ios */
	uint64_t nvme_lat_ns_max;
	uint64_t nvme_cache_hits;     /* 4 KiB payload chunks served from the block cache */
	uint64_t nvme_cache_misses;   /* chunks read from NVMe for direct serving */
	uint64_t ns_nvme;             /* wall-clock nanoseconds in NVMe I/O */
	/* wall-clock nanoseconds spent per stage (a failed call's time included) */
	uint64_t ns_index;            /* rotation, codes, sigma, beta (prefill and flushes) */
	uint64_t ns_store;            /* writing rows to the host tier */
	uint64_t ns_score;            /* query quantization and bit-plane scoring */
	uint64_t ns_select;           /* softmax statistics, Top-p threshold, union */
	uint64_t ns_attend;           /* gather and exact attention */
	/* placement and the shared host budget */
	int32_t device;               /* CUDA device ordinal the cache runs on (-1: CPU backend) */
	uint32_t pad0;
	uint64_t host_pool_bytes;     /* the shared host pool's size (kvt_config.host_pool), 0: none */
	uint64_t host_pool_used;      /* bytes of it charged by all the caches sharing it */
	uint64_t host_pool_mine;      /* of which by this cache (the extents it mapped) */
	/* the second selection stage (kvt_config.rescore_p), summed over steps and KV heads */
	uint64_t rescored_tokens;     /* indexed tokens whose key it read: the union over the query
					 group of each head's candidates */
	uint64_t rescored_unselected; /* of those, the ones the step did not select: rows whose K half
					 was read but not their V (the stage's extra reads) */
	uint64_t scan_hist_hits;      /* query-head Top-p thresholds decided from the histogram the
					 scan built (CUDA, with scores past the L2 cache:
					 doc/selection.md) instead of a pass over the scores; with
					 rescore_p, those of the first stage */
} kvt_stats;

/* The size of the first release's kvt_stats: the smallest kvt_get_stats accepts. */
#define KVT_STATS_SIZE_VER0 (offsetof(kvt_stats, host_pool_mine) + sizeof(uint64_t))

typedef struct kvt_cache kvt_cache;

/*
 * Create a cache. `cfg` must start from KVT_CONFIG_INIT; it is read up to cfg->size (the size rule of
 * kvt_config) and the cache keeps a copy with every default resolved. On success *out receives the
 * cache and 0 is returned; on failure *out is untouched and kvt_last_error(NULL) gives the detail on
 * this thread. Errors: -EINVAL (NULL pointer, a size outside the rule or a nonzero byte past this
 * library's struct, a pad field set, any field out of range: the text names it),
 * -ENOMEM, -EOPNOTSUPP (CUDA backend requested, or device_busid given, but CUDA not built), -ENODEV
 * (CUDA requested, no GPU), -EBUSY (an NVMe file held by another cache: nvme_flags), the errors of
 * opening, sizing and registering the NVMe files (-EIO for a path in a missing directory, say),
 * and those of attaching host_pool (-ENOSPC, -EAGAIN or shm_open's: doc/multi-gpu.md).
 * Thread safety: may be called from any thread.
 */
KVT_API int kvt_cache_create(const kvt_config *cfg, kvt_cache **out);

/* Destroy a cache and every sequence in it. NULL is accepted. */
KVT_API void kvt_cache_destroy(kvt_cache *cache);

/*
 * Open a sequence (one request's context). On success *seq receives its id (a small integer that is
 * reused after kvt_seq_close). Errors: -EINVAL (NULL), -ENOSPC (max_seqs open), -ENOMEM.
 */
KVT_API int kvt_seq_open(kvt_cache *cache, uint32_t *seq);

/* Close a sequence and free its host rows and index. Errors: -EINVAL, -ENOENT (not open). */
KVT_API int kvt_seq_close(kvt_cache *cache, uint32_t seq);

/*
 * Move the K/V rows of `seq` from the host tier to the NVMe tier: every full host-tier block (256
 * tokens of one layer and KV head) whose tokens are all sinks or indexed is written through io_uring,
 * checksummed, and its host memory freed once every write has completed. The window and the partial
 * last block of each layer and head stay in host memory, so decoding goes on; the sequence can still
 * be attended: the rows it selects are read from NVMe (direct serving, through a host block cache of
 * nvme_cache_bytes). Returns the bytes of rows moved (0 when nothing was left to move). All or
 * nothing: on failure the host copy is intact and no NVMe space is held.
 * Errors: -EINVAL, -ENOENT, -EOPNOTSUPP (no NVMe tier configured, or built without liburing),
 * -ENOSPC (the NVMe files are full), -EIO (or another I/O error), -ENOMEM.
 */
KVT_API int64_t kvt_seq_spill(kvt_cache *cache, uint32_t seq);

/*
 * Bring every spilled block of `seq` back into the host tier and free its NVMe space. Each block is
 * verified (header, identity, generation, crc32c) before it is used. Returns the bytes moved.
 * All or nothing: on failure the NVMe copy stays the valid one and no host memory is held.
 * Errors: -EINVAL, -ENOENT, -EOPNOTSUPP, -ENOSPC (host tier full and KVT_SPILL_NONE, or nothing
 * left to spill), -EBADMSG (a block failed verification: the text names it), -EIO, -ENOMEM.
 */
KVT_API int64_t kvt_seq_restore(kvt_cache *cache, uint32_t seq);

/* Tokens held by `seq` on `layer`, or a negative code (-EINVAL, -ENOENT). */
KVT_API int64_t kvt_seq_length(kvt_cache *cache, uint32_t seq, uint32_t layer);

/* The lifecycle of a sequence: truncate, fork, row ranges in and out (kvtier_lifecycle.h). */
#include "kvtier_lifecycle.h"

/*
 * Add one prefill chunk of `seq` on `layer`: stores its K/V rows in the host tier and indexes every
 * token of the chunk except sinks and the last `window` tokens of the sequence. The first chunk of a
 * layer fixes the key centroid (mean of its keys) and the query centroid (mean of its queries over the
 * query group, or zero when q is NULL).
 *   q: [n_tokens, n_q_heads, head_dim] or NULL
 *   k, v: [n_tokens, n_kv_heads, head_dim]
 * Keys must be finite; their magnitude is not limited: an index entry whose sigma or beta would
 * overflow fp16 (a residual norm above about 5e4) is stored saturated at +-65504, so such a key only
 * coarsens its own sequence's estimate and never fails a later step of any batch.
 * Returns 0. Errors: -EINVAL (NULL k/v, n_tokens == 0, layer out of range,
 * non-finite key), -ENOENT, -ENOSPC (host tier full: the text names the bytes needed and free),
 * -ENOMEM; with KVT_SPILL_LRU also the I/O errors of the automatic spill (-EIO, -ECANCELED, ...).
 * A failed call changes nothing: with KVT_SPILL_LRU no sequence is spilled when spilling all the
 * candidates could not make the room, and the victims of a call that fails after spilling are read
 * back (their residency and the spill counters as before). Only a victim whose read-back fails too
 * stays spilled, its NVMe copy valid (the text says so, and the spill counters count it).
 * CUDA backend: asynchronous on `stream`; the chunk is indexed on a low-priority stream of the cache
 * that the layer's next call waits for on the device. Keys are not inspected on the host: a
 * non-finite key gets a finite (meaningless) index entry, and in the first chunk it makes the
 * centroid non-finite, which the sequence's next step reports.
 */
KVT_API int kvt_prefill(kvt_cache *cache, uint32_t seq, uint32_t layer, const void *q,
			const void *k, const void *v, uint32_t n_tokens, void *stream);

/*
 * Append one decode token to each of `n_seqs` sequences on `layer`. When a sequence's window holds
 * window + flush_batch tokens, its oldest flush_batch window tokens are indexed in one batch.
 *   seqs: host array [n_seqs]; k, v: [n_seqs, n_kv_heads, head_dim]
 * All-or-nothing: on failure no sequence changes. Errors: -EINVAL (NULL, n_seqs == 0, duplicate
 * sequence, layer, non-finite key), -ENOENT, -ENOSPC, -ENOMEM, and with KVT_SPILL_LRU the I/O
 * errors of the automatic spill, as kvt_prefill.
 */
KVT_API int kvt_append(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *k, const void *v, void *stream);

/*
 * One decode step of attention on `layer` for `n_seqs` sequences: estimate scores from the index,
 * select per query head the smallest set with mass >= p (clamped to the budget bounds), take the
 * union over each KV head's query group, and compute exact attention over sinks + union + window.
 *   q: [n_seqs, n_q_heads, head_dim] (dtype); out: [n_seqs, n_q_heads, head_dim] (out_dtype)
 * The selection of each sequence is kept, and can be read back with kvt_gather, until the next
 * kvt_select, kvt_attend, kvt_append or kvt_prefill of that sequence on this layer.
 * Returns 0. Errors: -EINVAL (NULL, n_seqs == 0, layer, empty sequence, non-finite query, or a
 * non-finite score: the text names the batch entry and query head, and the query as the cause, since
 * index entries are finite whatever the keys),
 * -ENOENT, -ENOMEM; for a spilled sequence also the NVMe read's errors (-EIO, -EBADMSG naming the
 * block) and -ENOSPC (nvme_cache_bytes too small for the selection). On an error met while
 * selecting or attending (a non-finite score, a failed read) the batch's selections are dropped
 * and `out` may be partly written; one found in the arguments or the query before that leaves
 * both as they were. No counter but `errors` moves either way.
 * CUDA backend: asynchronous on `stream` (no host synchronization, no allocation once a step of
 * the same batch and context size has run, except a growth of the self-sized hot cache, so the
 * call can be captured in a CUDA graph after warm-up steps: doc/cuda-backend.md). Errors
 * the kernels find (a non-finite query or score) are returned by the next call on the cache. A
 * spilled sequence is served in place: the call synchronizes once (the selection comes to the host,
 * the missed rows of spilled blocks are read from NVMe and staged in pinned memory), so it cannot
 * be captured while such a sequence is in the batch (-EINVAL; kvt_seq_restore it first).
 * -E2BIG when a sequence has more than 2^24 - 1 indexed tokens on the layer (the selection's
 * limit), or the batch is beyond the bounds of kvt_graph_reserve (kvtier_graph.h).
 */
KVT_API int kvt_attend(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *q, void *out, void *stream);

/*
 * Split form, step 1: the selection of kvt_attend without the attention. On success returns the
 * largest number of tokens (sinks + selected + window) of any (sequence, KV head) pair, which is the
 * `max_tokens` kvt_gather needs. Errors: as kvt_attend.
 * CUDA backend: waits for `stream` to finish the selection (the count is needed on the host).
 */
KVT_API int kvt_select(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const void *q, void *stream);

/*
 * Split form, step 2: copy the tokens chosen by the last kvt_select or kvt_attend on `layer` for
 * these sequences (the same list, in the same order) into caller buffers, in ascending position
 * order (sinks, selected, window).
 *   counts: host [n_seqs, n_kv_heads] int32, receives each pair's token count (required)
 *   pos: [n_seqs, n_kv_heads, max_tokens] int32 token positions, or NULL
 *   k_out, v_out: [n_seqs, n_kv_heads, max_tokens, head_dim] in dtype, or NULL (both or neither)
 * Returns the sum of counts (the tokens copied, when k_out is given). Errors: -EINVAL (NULL
 * counts, max_tokens smaller than a count: the text names both, no selection for this layer and
 * sequence list, k_out without v_out),
 * -ENOENT, and for spilled sequences the errors of kvt_attend's direct serving, after which the
 * output buffers may be partly written (never with unverified bytes).
 * CUDA backend: counts are known when the call returns; the copies into pos, k_out and v_out are
 * queued on `stream`. The rows come from the hot cache, the window ring or the host tier.
 */
KVT_API int kvt_gather(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       uint32_t max_tokens, int32_t *counts, int32_t *pos, void *k_out, void *v_out,
		       void *stream);

/* kvt_extend flags. */
typedef enum kvt_extend_flags {
	KVT_EXTEND_TOPP = 1u << 0 /* each query row attends its Top-p selection (see kvt_extend) */
} kvt_extend_flags;

/*
 * Several new tokens per sequence attending everything stored before them (chunked prefill, a
 * prefix-cache hit, speculative verification), varlen over a batch of `n_seqs` sequences on `layer`.
 * Entry i gets rows cu_seqlens[i] .. cu_seqlens[i + 1] of q, k, v and out as its new tokens, in
 * order; an entry with none (equal bounds) is left untouched. Each entry's tokens are stored and
 * indexed exactly as kvt_prefill(seqs[i], layer, its q, k, v rows) stores and indexes that chunk
 * (the first chunk of a layer fixes the centroids from its keys and queries), and each query row
 * attends causally: the row of position P (the sequence's length before the call plus its offset in
 * the chunk) attends every token of its sequence at positions 0 .. P, the chunk's own rows up to
 * itself included, with exact attention: the scale, GQA groups, fp32 accumulation and out_dtype of
 * kvt_attend, whose output at p = 1 over the same tokens it equals bit for bit on the CPU backend
 * (the CUDA backend: below). Rows of spilled blocks are read from NVMe in place on the CPU backend
 * (nothing is restored); the CUDA backend restores the sequence.
 * With KVT_EXTEND_TOPP in flags each query row attends, instead of every token up to it, what a
 * kvt_attend step would select for it (speculative verification at decode cost): the chunk is
 * stored and indexed first, as above; then for the row of position P, per KV head, the tokens
 * attended are every token at positions <= P that is not indexed (the sinks, and the window with
 * the chunk's recent rows), and the union over the KV head's query group of each query head's
 * Top-p selection among the indexed tokens at positions <= P, with kvt_attend's estimate, p and
 * budget_min / budget_max clamping. Indexed tokens past P are left out of the scoring entirely
 * (they add nothing to the estimated mass), so a later token of the chunk never changes an
 * earlier row. Attention over that set is exact, as kvt_attend's. So the last row of each entry
 * gets, bit for bit, what kvt_attend of the same query row gives right after the call; and at
 * p = 1 (when budget_max is 0 or at least the entry's indexed token count) every row gets what it
 * gets without the flag. The cost per row is that of a decode step (scoring every indexed token
 * up to P, then attending the set). kvt_stats counts each query row of a Top-p call as a step
 * (steps, candidate_tokens, selected_tokens, budget_max_hits, budget_min_hits), and rows_fetched
 * sums the rows each row attended; the selections kept for kvt_gather are dropped as without it.
 *   seqs: host [n_seqs], distinct open sequences
 *   cu_seqlens: host [n_seqs + 1], cu_seqlens[0] = 0, never decreasing; total = cu_seqlens[n_seqs]
 *   q: [total, n_q_heads, head_dim] (dtype); k, v: [total, n_kv_heads, head_dim] (dtype)
 *   out: [total, n_q_heads, head_dim] (out_dtype)
 *   flags: 0 (exact attention) or KVT_EXTEND_TOPP; other bits are -EINVAL
 * The selections of the entries with new tokens are dropped (kvt_gather needs a new kvt_select).
 * Returns 0. All or nothing over the batch: on failure no sequence changed (out may be partly
 * written), except that with KVT_EXTEND_TOPP the entries with new tokens lose their selections,
 * which the call was rewriting (as a failed kvt_attend's batch does); an entry without new tokens
 * keeps its selection. Errors: -EINVAL (NULL pointer, n_seqs == 0 or above max_seqs, layer, flags,
 * cu_seqlens[0] != 0, cu_seqlens decreasing, total 0 or above 2^31 - 1, a sequence twice in the
 * batch, a sequence growing past 2^31 - 1 tokens, non-finite key or query: the text names the
 * value), -ENOENT (a sequence not open), -ENOSPC (host tier full) and -ENOMEM, with KVT_SPILL_LRU
 * the I/O errors of the automatic spill (undone on failure), as kvt_prefill; for spilled rows the
 * NVMe read's errors (-EIO, -EBADMSG naming the block) and -ENOSPC (nvme_cache_bytes smaller than
 * one block of rows).
 * CPU backend: synchronous; the cost is about (stored + new tokens) x new tokens x n_q_heads x
 * head_dim per entry (with KVT_EXTEND_TOPP: a decode step's per new token). CUDA backend:
 * asynchronous on `stream`; each entry's rows (stored and new) cross PCIe once into a device
 * staging buffer of at most 256 MiB (a longer sequence goes through it in ranges, its query rows
 * then keeping a running state of n_q_heads (head_dim + 2) floats each; a chunk too short to fill
 * the GPU splits its keys over blocks, with up to 64 times that state as scratch), then a
 * tensor-core kernel attends them; the buffer grows to the largest call and is kept. The
 * probabilities are rounded to the dtype before they weight V (as FlashAttention does), so
 * outputs agree with the CPU's within the dtype's precision, not bit for bit, and a non-finite
 * value in V reaches the outputs of earlier rows of its 64-row tile too. A spilled sequence is
 * restored once the inputs are checked (kvt_seq_restore's errors; the restore, and sequences it
 * spilled to make room, stay if the call then fails; the restores never spill a sequence of the
 * batch, and -ENOSPC, with nothing restored, when the batch's spilled sequences cannot all be in
 * the host tier at once; -ENOSPC when making room for the new rows spilled one of them);
 * growing the staging buffer synchronizes the device (-EINVAL while `stream` is being captured).
 * With KVT_EXTEND_TOPP each query row is one decode step of kvt_attend's kernels at the lengths
 * the row sees (its selection within the threshold's tolerance of the CPU's; the last row of an
 * entry's chunk bit-equal to kvt_attend of its query once the chunk is in); no staging.
 * Counted in kvt_stats
 * as tokens (and indexed tokens) like kvt_prefill, and as rows_fetched per KV head; not as steps
 * (except with KVT_EXTEND_TOPP, above).
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_extend(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
		       const uint32_t *cu_seqlens, const void *q, const void *k, const void *v,
		       void *out, uint32_t flags, void *stream);

/*
 * Where the rows of one tensor of a compute call lie (kvt_io_layout): token t, head h starts at
 * element t * token_stride + h * head_stride; its head_dim elements are contiguous. Zero in a field
 * means the default: head_stride = head_dim, token_stride = heads * head_stride (heads: n_q_heads
 * for q and out, n_kv_heads for k and v), i.e. dense [n, heads, head_dim]. A fused qkv projection
 * split three ways is token_stride (n_q_heads + 2 n_kv_heads) head_dim; a [B, H, T, D] transpose
 * is token_stride head_dim, head_stride T head_dim. The rows of two (token, head) pairs must not
 * overlap, which the checks make simple: head_stride >= head_dim, and either token-major,
 * token_stride >= (heads - 1) * head_stride + head_dim, or head-major, token_stride >= head_dim and
 * head_stride >= (n - 1) * token_stride + head_dim (n: the call's rows, i.e. n_tokens, n_seqs or
 * cu_seqlens[n_seqs]); the view's extent, (n - 1) * token_stride + (heads - 1) * head_stride +
 * head_dim elements, must lie within PTRDIFF_MAX bytes. Views of distinct tensors may interleave
 * (the three of a fused projection do).
 */
typedef struct kvt_io_view {
	uint64_t token_stride; /* elements between tokens (rows of the batch); 0: the default */
	uint64_t head_stride;  /* elements between heads of a token; 0: head_dim */
} kvt_io_view;

/*
 * Strided q, k, v and out for kvt_prefill_at, kvt_append_at, kvt_attend_at, kvt_select_at and
 * kvt_extend_at.
 * `{ sizeof(kvt_io_layout) }` (or a NULL pointer) is the dense layout of the plain calls. A view of
 * a tensor the call does not take (kvt_prefill's out, a NULL q) is not read.
 */
typedef struct kvt_io_layout {
	uint32_t size;  /* sizeof(kvt_io_layout): at least up to out */
	uint32_t flags; /* must be 0 */
	kvt_io_view q, k, v, out;
} kvt_io_layout;

/*
 * kvt_prefill, kvt_append, kvt_attend, kvt_select and kvt_extend with their tensors placed as
 * `layout` says
 * (NULL: dense, the same call). A layout whose views all resolve to the dense placement costs
 * nothing; any other is gathered into a dense scratch of the cache (grown as needed, kept until
 * kvt_cache_destroy), the dense call runs on it, and its out is scattered into the caller's view:
 * the outputs and the cache's state are bit for bit those of the dense call on the same values.
 * Nothing of out is written outside its (token, head) rows, and a failed call whose out view is
 * not dense writes nothing of out at all (a dense out is written in place, as by the plain call,
 * which may leave it partly written on failure even when q, k or v are strided).
 * Errors: the plain call's, and -EINVAL for the layout, checked before anything changes (size too
 * small, unknown flags, a stride below its minimum or past the address range: the text names the
 * field, its value and the limit, e.g. "layout->q.head_stride = 64, must be 0 or in [head_dim =
 * 128, ...]"); -ENOMEM (the scratch; nothing changed). On the CUDA backend the scratch is device
 * memory and the copies are cudaMemcpy2DAsync on `stream` (one when a token's heads are
 * contiguous, else one per head or one per token, whichever is fewer; a pitch past the device's
 * 2D-copy limit is copied row by row); growing the scratch synchronizes the device, and is refused
 * (-EINVAL) while `stream` is being captured into a graph: make one call at the largest shape
 * before capturing. A copy that fails is -EIO naming the tensor.
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_prefill_at(kvt_cache *cache, uint32_t seq, uint32_t layer, const void *q,
			   const void *k, const void *v, uint32_t n_tokens,
			   const kvt_io_layout *layout, void *stream);
KVT_API int kvt_append_at(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *k, const void *v, const kvt_io_layout *layout, void *stream);
KVT_API int kvt_attend_at(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *q, void *out, const kvt_io_layout *layout, void *stream);
KVT_API int kvt_select_at(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const void *q, const kvt_io_layout *layout, void *stream);
KVT_API int kvt_extend_at(kvt_cache *cache, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
			  const uint32_t *cu_seqlens, const void *q, const void *k, const void *v,
			  void *out, uint32_t flags, const kvt_io_layout *layout, void *stream);

/* The decode step a CUDA graph replays across steps (kvtier_graph.h). */
#include "kvtier_graph.h"

/*
 * Fill *stats up to stats->size (the output-struct rule above). With the CUDA backend this waits for
 * the device to finish the work already queued (the fetch counters live on the device).
 * Errors: -EINVAL (NULL, stats->size below KVT_STATS_SIZE_VER0: the text names both), -EIO (the
 * device failed). Thread safety: a call on the cache (serialized by the caller).
 */
KVT_API int kvt_get_stats(kvt_cache *cache, kvt_stats *stats);

/* Fetch counters of one layer since kvt_cache_create (CUDA backend; zeros for the CPU backend). */
typedef struct kvt_layer_stats {
	size_t size;             /* set by the caller: sizeof(kvt_layer_stats) */
	uint64_t steps;          /* sequences attended or selected on this layer */
	uint64_t hot_hits;       /* sink and selected rows served from the hot cache */
	uint64_t hot_misses;     /* sink and selected rows read from the host tier */
	uint64_t pcie_bytes;     /* bytes read from the host tier */
	uint64_t selected_tokens; /* indexed tokens selected, summed over steps and KV heads */
	uint64_t rows_attended;  /* sinks + selected + window, summed over steps and KV heads */
	uint64_t hot_rows;       /* rows the layer's hot cache can hold */
} kvt_layer_stats;

/* The size of the first release's kvt_layer_stats: the smallest kvt_get_layer_stats accepts. */
#define KVT_LAYER_STATS_SIZE_VER0 (offsetof(kvt_layer_stats, hot_rows) + sizeof(uint64_t))

/*
 * Fill *stats with the counters of `layer`, up to stats->size (the output-struct rule above). Waits
 * for the device like kvt_get_stats. Errors: -EINVAL (NULL, stats->size below
 * KVT_LAYER_STATS_SIZE_VER0, layer out of range), -EIO. Thread safety: as kvt_get_stats.
 */
KVT_API int kvt_get_layer_stats(kvt_cache *cache, uint32_t layer, kvt_layer_stats *stats);

/* What a scheduler asks before admitting or growing a request (kvt_get_capacity). */
typedef struct kvt_capacity {
	size_t size;                  /* sizeof(kvt_capacity), set by the caller */
	uint64_t host_bytes_free;     /* host-tier bytes still available to this cache: its own
					 host_bytes and, with a host pool, the pool's share left;
					 whole blocks fit: floor(free / block_bytes) of them */
	uint64_t host_bytes_capacity; /* kvt_config.host_bytes */
	uint64_t nvme_bytes_free;     /* free bytes in the NVMe files, summed (0 without an NVMe
					 tier); a spilled block lies within one file, so what fits
					 is the sum over files of each one's whole blocks */
	uint64_t nvme_bytes_capacity;
	uint64_t block_bytes;         /* the host tier's unit: block_tokens rows of one layer and KV head */
	uint64_t block_tokens;        /* tokens per block */
	uint64_t row_bytes_per_token; /* K/V bytes of one token over all layers and KV heads */
	uint64_t index_bytes_per_token; /* index bytes of one indexed token over all layers and KV heads
					   (the CUDA backend keeps them in HBM) */
	uint32_t seqs_open, max_seqs;
	uint64_t nvme_block_bytes;    /* a spilled block in this cache's NVMe files: header, checksums
					 and payload at the files' own alignment (0 without an NVMe
					 tier); kvt_footprint's nvme_block_bytes assumes 4 KiB */
} kvt_capacity;

/* The size of the first release's kvt_capacity: the smallest kvt_get_capacity accepts. */
#define KVT_CAPACITY_SIZE_VER0 (offsetof(kvt_capacity, max_seqs) + sizeof(uint32_t))

/*
 * Fill *cap (filled up to cap->size, as kvt_get_stats) with what the cache can still take. Never
 * synchronizes or waits for the device: every figure is kept on the host, so a scheduler may ask at
 * every step. A sequence of n tokens needs about ceil(n / block_tokens) * block_bytes per layer and KV
 * head in the host tier (kvt_seq_bytes tells what one holds). Errors: -EINVAL (NULL, size below
 * KVT_CAPACITY_SIZE_VER0). Thread safety: calls on one cache are serialized by the caller.
 */
KVT_API int kvt_get_capacity(kvt_cache *cache, kvt_capacity *cap);

/*
 * The bytes sequence `seq` holds now, over all its layers and KV heads: in the host tier (*host,
 * whole blocks) and on NVMe (*nvme, its spilled blocks with their headers; a block shared with a
 * forked sequence counts in each holder); either pointer may be NULL. Never synchronizes the device. Errors: -EINVAL (cache NULL), -ENOENT (not open).
 */
KVT_API int kvt_seq_bytes(kvt_cache *cache, uint32_t seq, uint64_t *host, uint64_t *nvme);

/* What this build and machine offer, and what a configuration needs (kvtier_probe.h). */
#include "kvtier_probe.h"

/*
 * Static text for a return code: 0, and each negative code of the convention block at the top of
 * this header; "unknown error code" for any other value. Never NULL. Thread safety: any thread.
 */
KVT_API const char *kvt_strerror(int code);

/*
 * Detail of the last error of `cache` (which argument, which value, which limit), or "" when none.
 * With cache == NULL: the detail of the last failed kvt_cache_create, or of the last call made with a
 * NULL cache, on the calling thread.
 * The text stays valid until the next call on the same cache (or thread, for NULL).
 * Thread safety: NULL: any thread, which reads its own text; a cache: as every call on the cache.
 */
KVT_API const char *kvt_last_error(const kvt_cache *cache);

/*
 * Which entry of the failed call's batch (an index into its `seqs`) the last error of `cache`
 * concerns, or -1 when it concerns none in particular (a bad argument of the whole call, the host
 * tier full, an error of a call without a batch, or no error). A failed call changes nothing, so
 * a runtime can take seqs[entry] out of the batch and call again with the others (issue 13's
 * per-sequence status). Set for: a sequence not open or twice in the batch, a length limit, an
 * empty sequence, a non-finite key or query (kvt_append, kvt_attend, kvt_select: the row is the
 * entry; kvt_extend: the entry whose rows hold it), a non-finite score, a read of a spilled
 * sequence's rows that failed, kvt_gather's max_tokens and missing selections, a sequence in
 * error (kvt_seq_status).
 * CUDA backend: errors the kernels find are reported by a later call: one that a step's batch
 * entry caused (a non-finite score) puts that sequence in error (kvt_seq_status); any other fails
 * the later call and names no entry (-1). NULL gives -1.
 * Thread safety: as every call on the cache; NULL: any thread.
 */
KVT_API int kvt_last_error_entry(const kvt_cache *cache);

/* KVT_VERSION_NUMBER of the library actually loaded, and its "MAJOR.MINOR.PATCH" text (static).
 * Thread safety: any thread. */
KVT_API unsigned kvt_version_number(void);
KVT_API const char *kvt_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_H */
