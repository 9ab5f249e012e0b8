/* SPDX-License-Identifier: MIT */
/*
 * kvt_probe (what this build and machine offer) and kvt_footprint_of (what a configuration needs
 * per tier). Neither creates a cache. The footprint restates how lib/layer.c, lib/api.c, host/ and
 * gpu/backend.c size their allocations; tests/test_abi.c checks it against a live cache's host tier.
 */
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "internal.h"
#include "../host/nvme_format.h"

/* ---- kvt_probe ------------------------------------------------------------------------- */

/* The NVMe tier's I/O alignment assumed for sizes: 4 KiB, the logical block of NVMe drives. */
#define NVME_ALIGN 4096u

static void probe_cuda(kvt_probe_info *p)
{
	const struct kvt_backend_ops *cuda = kvt_cuda_backend_ops;
	p->cuda_built = cuda != NULL;
	for (int i = 0; cuda && i < KVT_PROBE_MAX_DEVICES; i++) {
		char busid[sizeof p->cuda_busid[0]] = "";
		if (cuda->probe(i, busid, sizeof busid, NULL) < 0)
			break;
		memcpy(p->cuda_busid[i], busid, sizeof busid);
		p->cuda_devices++;
	}
}

/* The value of `key` (a "Key:   123 kB" line) in /proc/meminfo, in bytes when it has a unit. */
static uint64_t meminfo(const char *key)
{
	FILE *f = fopen("/proc/meminfo", "r");
	char line[256];
	uint64_t v = 0;
	size_t n = strlen(key);
	while (f && fgets(line, sizeof line, f)) {
		unsigned long long x = 0;
		char unit[8] = "";
		if (strncmp(line, key, n) || line[n] != ':')
			continue;
		if (sscanf(line + n + 1, "%llu %7s", &x, unit) >= 1)
			v = !strcmp(unit, "kB") ? (uint64_t)x << 10 : (uint64_t)x;
		break;
	}
	if (f)
		fclose(f);
	return v;
}

/* The bracketed choice of a /sys "always [madvise] never" file into out ("" when unreadable). */
static void bracketed(const char *path, char *out, size_t n)
{
	FILE *f = fopen(path, "r");
	char line[256] = "";
	out[0] = 0;
	if (!f)
		return;
	if (fgets(line, sizeof line, f)) {
		char *a = strchr(line, '['), *b = a ? strchr(a, ']') : NULL;
		if (a && b && (size_t)(b - a - 1) < n)
			snprintf(out, n, "%.*s", (int)(b - a - 1), a + 1);
	}
	fclose(f);
}

static uint32_t numa_nodes(void)
{
	char path[64];
	uint32_t n = 0;
	for (int i = 0; i < 4096; i++) {
		snprintf(path, sizeof path, "/sys/devices/system/node/node%d/meminfo", i);
		FILE *f = fopen(path, "r");
		if (!f)
			break;
		fclose(f);
		n++;
	}
	return n ? n : 1;
}

static uint64_t rlim(rlim_t v)
{
	return v == RLIM_INFINITY ? UINT64_MAX : (uint64_t)v;
}

KVT_API int kvt_probe(kvt_probe_info *info)
{
	KVT_RETURN_IF(!info, NULL, -EINVAL, "info is NULL");
	KVT_TRY(kvt_out_size_check(NULL, "info", info->size, KVT_PROBE_INFO_SIZE_VER0));
	kvt_probe_info p = {.size = sizeof p};
	probe_cuda(&p);
	p.io_uring_built = KVT_HAVE_LIBURING;
	p.io_uring_usable = kvt_nvme_available(NULL) > 0;
	p.hwloc_built = KVT_HAVE_HWLOC;
	p.numa_built = KVT_HAVE_NUMA;
	p.numa_nodes = numa_nodes();
	bracketed("/sys/kernel/mm/transparent_hugepage/enabled", p.thp_mode, sizeof p.thp_mode);
	p.hugepage_bytes = meminfo("Hugepagesize");
	p.hugepages_total = meminfo("HugePages_Total");
	p.hugepages_free = meminfo("HugePages_Free");
	struct rlimit r;
	if (getrlimit(RLIMIT_MEMLOCK, &r) == 0) {
		p.memlock_soft = rlim(r.rlim_cur);
		p.memlock_hard = rlim(r.rlim_max);
	}
	p.host_memory_bytes = meminfo("MemTotal");
	p.host_available_bytes = meminfo("MemAvailable");
	kvt_out_fill(info, &p, sizeof p);
	return 0;
}

/* ---- kvt_footprint_of ------------------------------------------------------------------ */

/* The units and one sequence's host-tier and NVMe bytes. */
static void footprint_rows(const kvt_config *c, uint64_t n_tokens, kvt_footprint *f)
{
	const uint64_t kl = (uint64_t)c->n_kv_heads * c->n_layers;
	f->row_bytes = 4ull * c->head_dim; /* K then V, 2 bytes per element (lib/api.c row_bytes) */
	f->block_bytes = KVT_BLOCK_TOKENS * f->row_bytes;
	struct kvt_nvme_block_id id = {.n_tokens = KVT_BLOCK_TOKENS, .head_dim = c->head_dim};
	f->nvme_block_bytes = kvt_nvme_disk_bytes(&id, NVME_ALIGN);
	f->index_token_bytes = ((uint64_t)c->head_dim / 8 + 4) * kl;
	const uint64_t front = (uint64_t)c->n_sink + c->window;
	f->index_tokens = n_tokens > front ? n_tokens - front : 0;
	f->seq_blocks = (n_tokens + KVT_BLOCK_TOKENS - 1) / KVT_BLOCK_TOKENS * kl;
	f->host_bytes = f->seq_blocks * f->block_bytes;
	f->nvme_bytes = f->seq_blocks * f->nvme_block_bytes;
}

/* What the CUDA backend allocates in device memory for one sequence and once per cache. */
static void footprint_hbm(const kvt_config *c, uint64_t n_tokens, kvt_footprint *f)
{
	const uint64_t kl = (uint64_t)c->n_kv_heads * c->n_layers, d = c->head_dim;
	f->hbm_index_bytes = f->index_tokens * f->index_token_bytes;
	f->hbm_centroid_bytes = 2 * sizeof(float) * d * kl;
	f->hbm_window_bytes = ((uint64_t)c->window + 2ull * c->flush_batch) * f->row_bytes * kl;
	/* gpu/select.cuh's kvt_gpu_selbits: a bit per token, a count per KVT_GPU_SEL_CHUNK tokens (at
	 * least one), and the selected count */
	const uint64_t n = f->index_tokens,
		       chunks = n ? (n + KVT_GPU_SEL_CHUNK - 1) / KVT_GPU_SEL_CHUNK : 1;
	f->hbm_selection_bytes = sizeof(uint32_t) * ((n + 31) / 32 + chunks + 1) * kl;
	uint64_t blocks = (n_tokens + KVT_BLOCK_TOKENS - 1) / KVT_BLOCK_TOKENS;
	blocks = blocks > KVT_TABLE_MIN_BLOCKS ? blocks : KVT_TABLE_MIN_BLOCKS;
	f->hbm_block_table_bytes = sizeof(void *) * blocks * kl;
	f->hbm_seq_bytes = f->hbm_index_bytes + f->hbm_centroid_bytes + f->hbm_window_bytes +
			   f->hbm_selection_bytes + f->hbm_block_table_bytes;
	f->hbm_rotation_bytes = sizeof(float) * d * d * c->n_layers;
	const uint64_t way = f->row_bytes + KVT_GPU_HOT_TAG_BYTES;
	/* fixed: as allocated; self-sized: at its bound when one is given, else not counted */
	const uint64_t hot = c->gpu_cache_bytes == KVT_NONE64 ? 0
			     : c->gpu_cache_bytes           ? c->gpu_cache_bytes
							    : c->gpu_cache_max_bytes;
	const uint64_t sets = hot / c->n_layers / (way * KVT_GPU_HOT_WAYS);
	f->hbm_hot_rows = sets * KVT_GPU_HOT_WAYS * c->n_layers;
	f->hbm_hot_bytes = f->hbm_hot_rows * way;
	f->hbm_cache_bytes = f->hbm_rotation_bytes + f->hbm_hot_bytes;
}

KVT_API int kvt_footprint_of(const kvt_config *cfg, uint64_t n_tokens, kvt_footprint *out)
{
	KVT_RETURN_IF(!out, NULL, -EINVAL, "out is NULL");
	KVT_TRY(kvt_out_size_check(NULL, "out", out->size, KVT_FOOTPRINT_SIZE_VER0));
	KVT_RETURN_IF(n_tokens > INT32_MAX, NULL, -EINVAL,
		      "n_tokens = %llu, must be <= %d (the most a sequence holds)",
		      (unsigned long long)n_tokens, INT32_MAX);
	kvt_config c;
	KVT_TRY(kvt_config_load(cfg, &c));
	kvt_footprint f = {.size = sizeof f};
	footprint_rows(&c, n_tokens, &f);
	footprint_hbm(&c, n_tokens, &f);
	kvt_out_fill(out, &f, sizeof f);
	return 0;
}
