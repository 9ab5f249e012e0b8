/* SPDX-License-Identifier: MIT */
/*
 * kvt_config: the size rule (doc/abi.md), the one place where a 0 becomes its default and KVT_NONE
 * becomes zero, and the validation of the resolved values. The cache keeps the resolved config, so
 * nothing else in the library interprets 0 or KVT_NONE.
 */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "../host/pool.h"

#define CHECK(cond, ...) KVT_RETURN_IF(!(cond), NULL, -EINVAL, __VA_ARGS__)

/* Copy the caller's struct of cfg->size bytes into *out (sizeof(kvt_config), zero-filled). */
static int load_sized(const kvt_config *cfg, kvt_config *out)
{
	CHECK(cfg, "cfg is NULL");
	const size_t size = cfg->size, min = KVT_CONFIG_SIZE_VER0;
	CHECK(size >= min, "cfg->size = %zu, must be >= KVT_CONFIG_SIZE_VER0 = %zu (sizeof(kvt_config) "
	      "= %zu here; initialize with KVT_CONFIG_INIT)", size, min, sizeof(kvt_config));
	const unsigned char *tail = (const unsigned char *)cfg;
	for (size_t i = sizeof(kvt_config); i < size; i++)
		CHECK(tail[i] == 0,
		      "cfg->size = %zu is past sizeof(kvt_config) = %zu of this library (%s), and byte "
		      "%zu is %u: a field this version does not know is set",
		      size, sizeof(kvt_config), kvt_version_string(), i, tail[i]);
	memset(out, 0, sizeof *out);
	memcpy(out, cfg, size < sizeof *out ? size : sizeof *out);
	out->size = sizeof *out;
	CHECK(out->pad0 == 0, "cfg->pad0 = %u, must be 0", out->pad0);
	CHECK(out->pad1 == 0, "cfg->pad1 = %u, must be 0", out->pad1);
	CHECK(out->pad2 == 0, "cfg->pad2 = %u, must be 0", out->pad2);
	CHECK(out->pad3 == 0, "cfg->pad3 = %u, must be 0", out->pad3);
	return 0;
}

static uint32_t or32(uint32_t v, uint32_t def)
{
	return v == 0 ? def : v == KVT_NONE ? 0 : v;
}

static uint64_t or64(uint64_t v, uint64_t def)
{
	return v == 0 ? def : v == KVT_NONE64 ? 0 : v;
}

/* Every default of kvtier.h, applied once. Fields without an explicit zero keep KVT_NONE as a
 * value, which the checks below then refuse with its number. */
static void resolve(kvt_config *c)
{
	c->dtype = c->dtype ? c->dtype : KVT_DTYPE_F16;
	c->out_dtype = c->out_dtype ? c->out_dtype : c->dtype;
	c->host_bytes = c->host_bytes ? c->host_bytes : KVT_DEFAULT_HOST_BYTES;
	c->nvme_cache_bytes = c->nvme_cache_bytes ? c->nvme_cache_bytes : KVT_DEFAULT_NVME_CACHE_BYTES;
	c->max_seqs = c->max_seqs ? c->max_seqs : KVT_DEFAULT_MAX_SEQS;
	c->nvme_queue_depth = c->nvme_queue_depth ? c->nvme_queue_depth : KVT_DEFAULT_NVME_QUEUE_DEPTH;
	c->p = c->p != 0.0f ? c->p : KVT_DEFAULT_P;
	if (c->scale == 0.0f && (c->head_dim == 64 || c->head_dim == 128 || c->head_dim == 256))
		c->scale = 1.0f / sqrtf((float)c->head_dim);
	c->n_sink = or32(c->n_sink, KVT_DEFAULT_N_SINK);
	c->window = or32(c->window, KVT_DEFAULT_WINDOW);
	c->flush_batch = c->flush_batch ? c->flush_batch : KVT_DEFAULT_FLUSH_BATCH;
	c->budget_min = or32(c->budget_min, KVT_DEFAULT_BUDGET_MIN);
	c->budget_max = c->budget_max == KVT_NONE ? 0 : c->budget_max;
	c->seed = or64(c->seed, KVT_DEFAULT_SEED);
	/* gpu_cache_bytes and gpu_cache_max_bytes stay as given: 0 is the self-sized cache, and
	 * KVT_NONE64 none */
}

static int check_shape(const kvt_config *cfg)
{
	CHECK(cfg->n_layers >= 1 && cfg->n_layers <= 4096, "n_layers = %u, must be in [1, 4096]",
	      cfg->n_layers);
	CHECK(cfg->n_kv_heads >= 1 && cfg->n_kv_heads <= 1024, "n_kv_heads = %u, must be in [1, 1024]",
	      cfg->n_kv_heads);
	CHECK(cfg->n_q_heads >= 1 && cfg->n_q_heads <= 4096, "n_q_heads = %u, must be in [1, 4096]",
	      cfg->n_q_heads);
	CHECK(cfg->n_q_heads % cfg->n_kv_heads == 0,
	      "n_q_heads = %u is not a multiple of n_kv_heads = %u", cfg->n_q_heads, cfg->n_kv_heads);
	CHECK(cfg->head_dim == 64 || cfg->head_dim == 128 || cfg->head_dim == 256,
	      "head_dim = %u, must be 64, 128 or 256", cfg->head_dim);
	CHECK(cfg->dtype == KVT_DTYPE_F16 || cfg->dtype == KVT_DTYPE_BF16,
	      "dtype = %u, must be 0 (default: F16), KVT_DTYPE_F16 (1) or KVT_DTYPE_BF16 (2)",
	      cfg->dtype);
	CHECK(cfg->out_dtype <= KVT_DTYPE_F32,
	      "out_dtype = %u, must be DEFAULT (0), F16 (1), BF16 (2) or F32 (3)", cfg->out_dtype);
	CHECK(cfg->backend <= KVT_BACKEND_CUDA, "backend = %u, must be AUTO (0), CPU (1) or CUDA (2)",
	      cfg->backend);
	CHECK(cfg->device >= 0, "device = %d, must be >= 0", cfg->device);
	return 0;
}

static int check_tiers(const kvt_config *cfg)
{
	CHECK(cfg->max_seqs <= 65536, "max_seqs = %u, must be in [1, 65536] (0: 256)", cfg->max_seqs);
	CHECK(cfg->n_nvme <= 64, "n_nvme = %u, must be <= 64", cfg->n_nvme);
	CHECK(cfg->n_nvme == 0 || (cfg->nvme_paths && cfg->nvme_bytes),
	      "n_nvme = %u but nvme_%s is NULL", cfg->n_nvme, cfg->nvme_paths ? "bytes" : "paths");
	for (uint32_t i = 0; i < cfg->n_nvme; i++) {
		CHECK(cfg->nvme_paths[i] && cfg->nvme_paths[i][0], "nvme_paths[%u] is %s", i,
		      cfg->nvme_paths[i] ? "empty" : "NULL");
		CHECK(cfg->nvme_bytes[i] >= 4096 && cfg->nvme_bytes[i] <= (uint64_t)INT64_MAX,
		      "nvme_bytes[%u] = %llu (%s), must be in [4096, 2^63)", i,
		      (unsigned long long)cfg->nvme_bytes[i], cfg->nvme_paths[i]);
		for (uint32_t j = 0; j < i; j++)
			CHECK(strcmp(cfg->nvme_paths[i], cfg->nvme_paths[j]) != 0,
			      "nvme_paths[%u] = %s is nvme_paths[%u] again: one file, one store", i,
			      cfg->nvme_paths[i], j);
	}
	CHECK(cfg->n_nvme == 0 || cfg->nvme_cache_bytes >= ((uint64_t)1 << 20),
	      "nvme_cache_bytes = %llu, must be >= 1 MiB with an NVMe tier",
	      (unsigned long long)cfg->nvme_cache_bytes);
	CHECK(cfg->nvme_cache_bytes <= ((uint64_t)1 << 40), "nvme_cache_bytes = %llu, must be <= 1 TiB",
	      (unsigned long long)cfg->nvme_cache_bytes);
	CHECK(!(cfg->nvme_flags & ~(uint32_t)KVT_NVME_KEEP_FILES),
	      "nvme_flags = 0x%x: unknown bits 0x%x (known: KVT_NVME_KEEP_FILES 0x%x)",
	      cfg->nvme_flags, cfg->nvme_flags & ~(uint32_t)KVT_NVME_KEEP_FILES,
	      (unsigned)KVT_NVME_KEEP_FILES);
	CHECK(cfg->nvme_queue_depth <= 1024, "nvme_queue_depth = %u, must be <= 1024",
	      cfg->nvme_queue_depth);
	CHECK(cfg->spill_policy <= KVT_SPILL_LRU, "spill_policy = %u, must be NONE (0) or LRU (1)",
	      cfg->spill_policy);
	CHECK(cfg->spill_policy == KVT_SPILL_NONE || cfg->n_nvme > 0,
	      "spill_policy = LRU (1) needs an NVMe tier, but n_nvme = 0");
	CHECK(!cfg->host_pool || kvt_pool_name_ok(cfg->host_pool),
	      "host_pool = \"%.64s\": must be 1 to 48 characters of [A-Za-z0-9._-]", cfg->host_pool);
	CHECK(cfg->host_pool || cfg->host_pool_bytes == 0,
	      "host_pool_bytes = %llu but host_pool is NULL", (unsigned long long)cfg->host_pool_bytes);
	CHECK(cfg->gpu_cache_bytes <= ((uint64_t)1 << 40) || cfg->gpu_cache_bytes == KVT_NONE64,
	      "gpu_cache_bytes = %llu, must be <= 1 TiB (0: self-sized, KVT_NONE64: no hot cache)",
	      (unsigned long long)cfg->gpu_cache_bytes);
	CHECK(cfg->gpu_cache_max_bytes <= ((uint64_t)1 << 40),
	      "gpu_cache_max_bytes = %llu, must be <= 1 TiB (0: a quarter of the free device "
	      "memory)",
	      (unsigned long long)cfg->gpu_cache_max_bytes);
	CHECK(cfg->gpu_cache_bytes == 0 || cfg->gpu_cache_bytes == KVT_NONE64 ||
		      cfg->gpu_cache_max_bytes == 0,
	      "gpu_cache_max_bytes = %llu bounds the self-sized hot cache, but gpu_cache_bytes = "
	      "%llu fixes its size: give one of them",
	      (unsigned long long)cfg->gpu_cache_max_bytes,
	      (unsigned long long)cfg->gpu_cache_bytes);
	return 0;
}

static int check_selection(const kvt_config *cfg)
{
	CHECK(cfg->p > 0.0f && cfg->p <= 1.0f, "p = %g, must be in (0, 1] (0: 0.9)", (double)cfg->p);
	CHECK(cfg->scale >= 0.0f && isfinite(cfg->scale),
	      "scale = %g, must be finite and >= 0 (0 means 1/sqrt(head_dim))", (double)cfg->scale);
	CHECK(cfg->n_sink <= 65536, "n_sink = %u, must be <= 65536 (KVT_NONE: no sinks)", cfg->n_sink);
	CHECK(cfg->window <= 65536, "window = %u, must be <= 65536 (KVT_NONE: no window)",
	      cfg->window);
	CHECK(cfg->flush_batch <= 65536, "flush_batch = %u, must be in [1, 65536] (0: 64)",
	      cfg->flush_batch);
	CHECK(cfg->correction_steps <= KVT_MAX_CORRECTION_STEPS,
	      "correction_steps = %u, must be in [0, %u] (0: off)", cfg->correction_steps,
	      KVT_MAX_CORRECTION_STEPS);
	CHECK(cfg->rescore_p == 0.0f || (cfg->rescore_p > cfg->p && cfg->rescore_p <= 1.0f),
	      "rescore_p = %g, must be 0 (off) or in (p = %g, 1]", (double)cfg->rescore_p,
	      (double)cfg->p);
	CHECK(cfg->keep_weight == 0.0f || (cfg->keep_weight > 0.0f && cfg->keep_weight <= 1e6f),
	      "keep_weight = %g, must be 0 (off) or finite in (0, 1e6]", (double)cfg->keep_weight);
	CHECK(cfg->keep_steps <= KVT_MAX_KEEP_STEPS,
	      "keep_steps = %u, must be in [0, %u] (0: 1)", cfg->keep_steps, KVT_MAX_KEEP_STEPS);
	CHECK(cfg->keep_steps == 0 || cfg->keep_weight != 0.0f,
	      "keep_steps = %u without keep_weight: it says how many steps keep_weight favors",
	      cfg->keep_steps);
	CHECK(cfg->budget_max == 0 || cfg->budget_min <= cfg->budget_max,
	      "budget_min = %u exceeds budget_max = %u (budget_min defaults to 64; lower it too, "
	      "KVT_NONE for no floor)",
	      cfg->budget_min, cfg->budget_max);
	return 0;
}

int kvt_config_load(const kvt_config *cfg, kvt_config *out)
{
	kvt_config c;
	KVT_TRY(load_sized(cfg, &c));
	resolve(&c);
	KVT_TRY(check_shape(&c));
	KVT_TRY(check_tiers(&c));
	KVT_TRY(check_selection(&c));
	*out = c;
	return 0;
}
