/* SPDX-License-Identifier: MIT */
#include <math.h>

#include "internal.h"

#define CHECK(cond, ...) KVT_RETURN_IF(!(cond), NULL, -EINVAL, __VA_ARGS__)

int kvt_config_check(const kvt_config *cfg)
{
	CHECK(cfg, "cfg is NULL");
	CHECK(cfg->size == sizeof(kvt_config),
	      "cfg->size = %zu, expected sizeof(kvt_config) = %zu (initialize with KVT_CONFIG_INIT)",
	      cfg->size, sizeof(kvt_config));
	for (unsigned i = 0; i < sizeof cfg->reserved / sizeof cfg->reserved[0]; i++)
		CHECK(cfg->reserved[i] == 0, "cfg->reserved[%u] = %llu, must be 0", i,
		      (unsigned long long)cfg->reserved[i]);
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
	      "dtype = %u, must be KVT_DTYPE_F16 (1) or KVT_DTYPE_BF16 (2)", cfg->dtype);
	CHECK(cfg->out_dtype <= KVT_DTYPE_F32,
	      "out_dtype = %u, must be DEFAULT (0), F16 (1), BF16 (2) or F32 (3)", cfg->out_dtype);
	CHECK(cfg->backend <= KVT_BACKEND_CUDA, "backend = %u, must be AUTO (0), CPU (1) or CUDA (2)",
	      cfg->backend);
	CHECK(cfg->device >= 0, "device = %d, must be >= 0", cfg->device);
	CHECK(cfg->host_bytes > 0, "host_bytes = 0, must be > 0");
	CHECK(cfg->max_seqs >= 1 && cfg->max_seqs <= 65536, "max_seqs = %u, must be in [1, 65536]",
	      cfg->max_seqs);
	CHECK(cfg->n_nvme <= 64, "n_nvme = %u, must be <= 64", cfg->n_nvme);
	CHECK(cfg->n_nvme == 0 || (cfg->nvme_paths && cfg->nvme_bytes),
	      "n_nvme = %u but nvme_%s is NULL", cfg->n_nvme, cfg->nvme_paths ? "bytes" : "paths");
	for (uint32_t i = 0; i < cfg->n_nvme; i++) {
		CHECK(cfg->nvme_paths[i], "nvme_paths[%u] is NULL", i);
		CHECK(cfg->nvme_bytes[i] > 0, "nvme_bytes[%u] = 0 (%s), must be > 0", i,
		      cfg->nvme_paths[i]);
	}
	CHECK(cfg->n_nvme == 0 || cfg->nvme_cache_bytes >= ((uint64_t)1 << 20),
	      "nvme_cache_bytes = %llu, must be >= 1 MiB with an NVMe tier",
	      (unsigned long long)cfg->nvme_cache_bytes);
	CHECK(cfg->nvme_cache_bytes <= ((uint64_t)1 << 40), "nvme_cache_bytes = %llu, must be <= 1 TiB",
	      (unsigned long long)cfg->nvme_cache_bytes);
	CHECK(cfg->nvme_queue_depth <= 1024, "nvme_queue_depth = %u, must be <= 1024",
	      cfg->nvme_queue_depth);
	CHECK(cfg->spill_policy <= KVT_SPILL_LRU, "spill_policy = %u, must be NONE (0) or LRU (1)",
	      cfg->spill_policy);
	CHECK(cfg->spill_policy == KVT_SPILL_NONE || cfg->n_nvme > 0,
	      "spill_policy = LRU (1) needs an NVMe tier, but n_nvme = 0");
	CHECK(cfg->p > 0.0f && cfg->p <= 1.0f, "p = %g, must be in (0, 1]", (double)cfg->p);
	CHECK(cfg->scale >= 0.0f && isfinite(cfg->scale),
	      "scale = %g, must be finite and >= 0 (0 means 1/sqrt(head_dim))", (double)cfg->scale);
	CHECK(cfg->n_sink <= 65536, "n_sink = %u, must be <= 65536", cfg->n_sink);
	CHECK(cfg->window <= 65536, "window = %u, must be <= 65536", cfg->window);
	CHECK(cfg->flush_batch >= 1 && cfg->flush_batch <= 65536,
	      "flush_batch = %u, must be in [1, 65536]", cfg->flush_batch);
	CHECK(cfg->gpu_cache_bytes <= ((uint64_t)1 << 40), "gpu_cache_bytes = %llu, must be <= 1 TiB",
	      (unsigned long long)cfg->gpu_cache_bytes);
	CHECK(cfg->budget_max == 0 || cfg->budget_min <= cfg->budget_max,
	      "budget_min = %u exceeds budget_max = %u (budget_min defaults to 64; lower it too)",
	      cfg->budget_min, cfg->budget_max);
	return 0;
}
