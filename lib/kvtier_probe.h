/* SPDX-License-Identifier: MIT */
/*
 * kvtier: what this build and machine offer (kvt_probe) and what a configuration needs
 * (kvt_footprint_of). Part of kvtier.h, which includes it after the statistics; include kvtier.h,
 * not this file. The conventions at the top of kvtier.h hold for every function here.
 */
#ifndef KVTIER_PROBE_H
#define KVTIER_PROBE_H

#ifndef KVTIER_H
#error "include kvtier.h, which includes kvtier_probe.h"
#endif

/* CUDA devices kvt_probe lists at most. */
#define KVT_PROBE_MAX_DEVICES 16

/* Filled by kvt_probe (kvtier.h's output-struct rule). Counts are 0 and texts "" where unknown. */
typedef struct kvt_probe_info {
	size_t size;                /* set by the caller: sizeof(kvt_probe_info) */
	uint32_t cuda_built;        /* 1: this build has the CUDA backend */
	uint32_t cuda_devices;      /* CUDA devices the runtime reports (0 without CUDA or a GPU) */
	char cuda_busid[KVT_PROBE_MAX_DEVICES][16]; /* PCI bus id of device i ("0000:3b:00.0"), the
						   first min(cuda_devices, 16) devices */
	uint32_t io_uring_built;    /* 1: this build has the NVMe tier (liburing) */
	uint32_t io_uring_usable;   /* 1: the kernel lets this process set up an io_uring */
	uint32_t hwloc_built;       /* 1: host-tier placement near the GPU through hwloc */
	uint32_t numa_built;        /* 1: host-tier binding through libnuma */
	uint32_t numa_nodes;        /* NUMA nodes with memory (/sys/devices/system/node), >= 1 */
	uint32_t pad0;
	char thp_mode[16];          /* transparent huge pages: "always", "madvise", "never" or "" */
	uint64_t hugepage_bytes;    /* default hugetlb page size (/proc/meminfo Hugepagesize) */
	uint64_t hugepages_total;   /* hugetlb pages of that size reserved (HugePages_Total) */
	uint64_t hugepages_free;    /* of which free (HugePages_Free) */
	uint64_t memlock_soft;      /* RLIMIT_MEMLOCK, bytes; UINT64_MAX: unlimited */
	uint64_t memlock_hard;
	uint64_t host_memory_bytes; /* physical memory (MemTotal) */
	uint64_t host_available_bytes; /* memory available without swapping (MemAvailable) */
} kvt_probe_info;

/* The size of the first release's kvt_probe_info: the smallest kvt_probe accepts. */
#define KVT_PROBE_INFO_SIZE_VER0 (offsetof(kvt_probe_info, host_available_bytes) + sizeof(uint64_t))

/*
 * Say what this build and machine offer, without creating a cache: backends built, CUDA devices and
 * their PCI bus ids (initializes the CUDA runtime when the backend is built), io_uring, placement
 * libraries, huge pages, the memlock limit. Reads /proc and /sys; a file it cannot read leaves its
 * fields 0. Returns 0. Errors: -EINVAL (NULL, info->size below KVT_PROBE_INFO_SIZE_VER0; detail in
 * kvt_last_error(NULL)). Thread safety: any thread.
 */
KVT_API int kvt_probe(kvt_probe_info *info);

/*
 * What a configuration needs for one sequence of n_tokens tokens (every layer holding n_tokens), by
 * tier, as the library allocates it. Filled by kvt_footprint_of (kvtier.h's output-struct rule).
 * Per-sequence figures grow with the number of sequences; per-cache figures are paid once.
 * HBM is what the CUDA backend takes in device memory; the CPU backend keeps the same index,
 * centroids and rotations in ordinary host memory (not in the host tier), and has no window ring,
 * selection arrays or hot cache on a device.
 */
typedef struct kvt_footprint {
	size_t size;                /* set by the caller: sizeof(kvt_footprint) */
	/* units */
	uint64_t row_bytes;         /* K and V of one token of one KV head: 4 head_dim */
	uint64_t block_bytes;       /* a host-tier block: 256 rows of one layer and KV head */
	uint64_t nvme_block_bytes;  /* the same block in an NVMe file: header, checksums and payload,
				       each 4 KiB aligned (doc/nvme-format.md); a store whose files
				       align to less (512-byte sectors) takes less, one of more
				       takes more: a live cache's kvt_capacity.nvme_block_bytes
				       is its files' own */
	uint64_t index_token_bytes; /* index of one token over every layer and KV head:
				       (head_dim / 8 + 4) n_kv_heads n_layers */
	/* one sequence */
	uint64_t index_tokens;      /* tokens indexed per layer after a prefill of n_tokens:
				       n_tokens - n_sink - window (0 when shorter) */
	uint64_t seq_blocks;        /* host-tier blocks: ceil(n_tokens / 256) n_kv_heads n_layers */
	uint64_t host_bytes;        /* seq_blocks block_bytes: host-tier bytes of its rows */
	uint64_t nvme_bytes;        /* seq_blocks nvme_block_bytes: NVMe bytes with every block spilled
				       (a spill keeps the window's blocks in host memory: an upper
				       bound) */
	uint64_t hbm_index_bytes;   /* index_tokens index_token_bytes: codes, sigma and beta */
	uint64_t hbm_centroid_bytes; /* key and query centroids: 8 head_dim n_kv_heads n_layers */
	uint64_t hbm_window_bytes;  /* the window ring: (window + 2 flush_batch) rows per layer and KV
				       head (a flush reads its oldest B rows while B more arrive) */
	uint64_t hbm_selection_bytes; /* its part of each layer's last selection, kept as bits:
					 4 (ceil(index_tokens / 32) + max(1, ceil(index_tokens /
					 8192)) + 1) n_kv_heads n_layers (a bit per token, a count
					 per 8192 tokens and the count, per KV head and layer) */
	uint64_t hbm_block_table_bytes; /* device copy of its host-tier block table: 8 bytes per block */
	uint64_t hbm_seq_bytes;     /* the five hbm_* figures above together */
	/* once per cache */
	uint64_t hbm_rotation_bytes; /* the per-layer rotations: 4 head_dim^2 n_layers */
	uint64_t hbm_hot_bytes;     /* the hot-token cache as allocated: gpu_cache_bytes rounded down
				       to whole 8-way sets of a row and its tags per layer; for the
				       self-sized cache (gpu_cache_bytes 0) the same of its bound
				       gpu_cache_max_bytes, or 0 when that is left to the device's
				       free memory */
	uint64_t hbm_hot_rows;      /* rows the hot cache holds, all layers together */
	uint64_t hbm_cache_bytes;   /* rotations and hot cache */
} kvt_footprint;

/* The size of the first release's kvt_footprint: the smallest kvt_footprint_of accepts. */
#define KVT_FOOTPRINT_SIZE_VER0 (offsetof(kvt_footprint, hbm_cache_bytes) + sizeof(uint64_t))

/*
 * Fill *out with what `cfg` needs for one sequence of n_tokens tokens, without creating a cache or
 * touching a device. `cfg` is validated and its defaults resolved exactly as kvt_cache_create does
 * (the backend and device are not probed). Not counted: per-step scratch sized by the batch (scores,
 * row lists, threshold histograms), the staging of a prefill chunk, small fixed device state
 * (counters, error word, index-job descriptors), and index storage a CUDA layer keeps beyond its
 * tokens: the device index grows by doubling from 1024 tokens per KV head, so decoding past a
 * prefill can hold up to twice hbm_index_bytes.
 * Returns 0. Errors: -EINVAL (NULL, a bad configuration or size: the text, in kvt_last_error(NULL),
 * names it; n_tokens above 2^31 - 1, the most a sequence holds). Thread safety: any thread.
 */
KVT_API int kvt_footprint_of(const kvt_config *cfg, uint64_t n_tokens, kvt_footprint *out);

#endif /* KVTIER_PROBE_H */
