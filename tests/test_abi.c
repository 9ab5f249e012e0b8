/* SPDX-License-Identifier: MIT */
/*
 * The size rules of the ABI (doc/abi.md): a kvt_config of an older, smaller size is accepted with
 * the rest defaulted; one larger than sizeof only with zero bytes past it; every 0 resolves to the
 * documented default and KVT_NONE / KVT_NONE64 to zero; output structs (kvt_stats,
 * kvt_layer_stats, kvt_probe_info, kvt_footprint) are filled up to the caller's size and nothing
 * past it. kvt_probe against what the build and getrlimit say, kvt_footprint_of against
 * hand-computed figures and a live cache's host tier.
 */
#include <sys/resource.h>

#include "common.h"

#define D 64
#define GiB (1ull << 30)
#define MiB (1ull << 20)

/* The model shape alone, everything else left at 0. */
static kvt_config shape_only(void)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 2;
	cfg.n_q_heads = 4;
	cfg.n_kv_heads = 2;
	cfg.head_dim = D;
	cfg.backend = KVT_BACKEND_CPU;
	return cfg;
}

#define EQ(what, got, want)                                                                        \
	T_CHECK((uint64_t)(got) == (uint64_t)(want), "%s: %s got %llu, wanted %llu", name, what,    \
		(unsigned long long)(got), (unsigned long long)(want))

static void check_defaults(const char *name, const kvt_config *r)
{
	EQ("size", r->size, sizeof(kvt_config));
	EQ("dtype", r->dtype, KVT_DTYPE_F16);
	EQ("out_dtype", r->out_dtype, KVT_DTYPE_F16);
	EQ("host_bytes", r->host_bytes, GiB);
	EQ("nvme_cache_bytes", r->nvme_cache_bytes, 64 * MiB);
	EQ("max_seqs", r->max_seqs, 256);
	EQ("nvme_queue_depth", r->nvme_queue_depth, 32);
	EQ("n_sink", r->n_sink, 4);
	EQ("window", r->window, 64);
	EQ("flush_batch", r->flush_batch, 64);
	EQ("budget_min", r->budget_min, 64);
	EQ("budget_max", r->budget_max, 0);
	EQ("seed", r->seed, 0x6b767469u);
	EQ("gpu_cache_bytes", r->gpu_cache_bytes, 0); /* self-sized: stays 0 */
	EQ("gpu_cache_max_bytes", r->gpu_cache_max_bytes, 0);
	T_CHECK(r->p == 0.9f, "%s: p got %g, wanted 0.9", name, (double)r->p);
	T_CHECK(r->scale == 1.0f / sqrtf((float)D), "%s: scale got %g, wanted 1/sqrt(%d) = %g", name,
		(double)r->scale, D, (double)(1.0f / sqrtf((float)D)));
}

/* Create from *cfg, check the resolved config with `check`, destroy. */
static void create_check(const char *name, const kvt_config *cfg,
			 void (*check)(const char *, const kvt_config *))
{
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(cfg, &c);
	T_CHECK(rc == 0, "%s: kvt_cache_create got %d (%s: %s), wanted 0", name, rc,
		kvt_strerror(rc), kvt_last_error(NULL));
	check(name, &c->cfg);
	kvt_cache_destroy(c);
}

/* Expect -EINVAL and a detail naming each of the needles. */
static void create_fails(const char *name, const kvt_config *cfg, const char *n1, const char *n2)
{
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(cfg, &c);
	const char *msg = kvt_last_error(NULL);
	T_CHECK(rc == -EINVAL && c == NULL, "%s: kvt_cache_create got %d (%s), wanted %d", name, rc,
		msg, -EINVAL);
	T_CHECK(strstr(msg, n1) && (!n2 || strstr(msg, n2)),
		"%s: detail \"%s\" does not name \"%s\" and \"%s\"", name, msg, n1, n2 ? n2 : "");
}

static void test_config_defaults(void **state)
{
	(void)state;
	kvt_config cfg = shape_only();
	create_check("all zero", &cfg, check_defaults);
}

static void check_none(const char *name, const kvt_config *r)
{
	EQ("n_sink", r->n_sink, 0);
	EQ("window", r->window, 0);
	EQ("budget_min", r->budget_min, 0);
	EQ("budget_max", r->budget_max, 0);
	EQ("seed", r->seed, 0);
	/* 0 is the self-sized cache: none stays KVT_NONE64 */
	EQ("gpu_cache_bytes", r->gpu_cache_bytes, KVT_NONE64);
}

static void check_exact(const char *name, const kvt_config *r)
{
	EQ("n_sink", r->n_sink, 7);
	EQ("window", r->window, 0);
	EQ("seed", r->seed, 0);
	EQ("gpu_cache_bytes", r->gpu_cache_bytes, MiB);
}

static void test_config_explicit_zero(void **state)
{
	(void)state;
	kvt_config cfg = shape_only();
	cfg.n_sink = cfg.window = cfg.budget_min = cfg.budget_max = KVT_NONE;
	cfg.seed = cfg.gpu_cache_bytes = KVT_NONE64;
	create_check("KVT_NONE", &cfg, check_none);
	cfg = shape_only();
	cfg.n_sink = KVT_EXACT(7);
	cfg.window = KVT_EXACT(0);
	cfg.seed = KVT_EXACT64(0);
	cfg.gpu_cache_bytes = KVT_EXACT64(MiB);
	create_check("KVT_EXACT", &cfg, check_exact);
	cfg = shape_only();
	cfg.flush_batch = KVT_NONE; /* no explicit zero: B >= 1 */
	create_fails("flush_batch KVT_NONE", &cfg, "flush_batch", "4294967295");
	cfg = shape_only();
	cfg.pad0 = 3;
	create_fails("pad0 3", &cfg, "pad0", "3");
}

/* A caller built against the first release: size KVT_CONFIG_SIZE_VER0, and whatever its stack holds
 * past that (here 0xab bytes in the reserved tail) is not read. */
static void test_config_old_size(void **state)
{
	(void)state;
	kvt_config cfg = shape_only();
	T_CHECK(KVT_CONFIG_SIZE_VER0 < sizeof(kvt_config) &&
			KVT_CONFIG_SIZE_VER0 == offsetof(kvt_config, nvme_flags),
		"KVT_CONFIG_SIZE_VER0 got %zu, wanted offsetof(nvme_flags) = %zu < sizeof = %zu",
		(size_t)KVT_CONFIG_SIZE_VER0, offsetof(kvt_config, nvme_flags), sizeof(kvt_config));
	cfg.size = KVT_CONFIG_SIZE_VER0;
	memset((char *)&cfg + KVT_CONFIG_SIZE_VER0, 0xab,
	       sizeof(kvt_config) - KVT_CONFIG_SIZE_VER0);
	create_check("size VER0, garbage past it", &cfg, check_defaults);
	cfg.size = KVT_CONFIG_SIZE_VER0 + 8; /* nvme_flags and pad1 now inside the caller's struct */
	create_fails("size VER0 + 8, pad1 set", &cfg, "pad1", NULL);
	cfg.size = KVT_CONFIG_SIZE_VER0 - 8;
	char want[32];
	snprintf(want, sizeof want, "%zu", (size_t)KVT_CONFIG_SIZE_VER0);
	create_fails("size VER0 - 8", &cfg, "size", want);
	cfg.size = 0;
	create_fails("size 0", &cfg, "size = 0", want);
}

/* A caller built against a later version: a larger struct, accepted while its new fields are 0. */
static void test_config_newer_size(void **state)
{
	(void)state;
	struct {
		kvt_config cfg;
		unsigned char later[24];
	} big;
	memset(&big, 0, sizeof big);
	big.cfg = shape_only();
	big.cfg.size = sizeof big;
	create_check("size sizeof + 24, zero tail", &big.cfg, check_defaults);
	big.later[17] = 1;
	char want[32];
	snprintf(want, sizeof want, "byte %zu", sizeof(kvt_config) + 17);
	create_fails("size sizeof + 24, a tail byte set", &big.cfg, want, "sizeof(kvt_config)");
}

/* Output structs: a poisoned buffer larger than the struct, `size` somewhere inside it. */
#define POISON 0xcd
struct outbuf {
	union {
		kvt_stats st;
		kvt_layer_stats ls;
		kvt_probe_info pi;
		kvt_footprint fp;
	} u;
	unsigned char past[64];
};

static void out_prepare(struct outbuf *b, size_t size)
{
	memset(b, POISON, sizeof *b);
	memcpy(b, &size, sizeof size);
}

/* Bytes [struct_size, size) zero, [size, end) untouched, size field as set. */
static void out_check(const char *name, const struct outbuf *b, size_t struct_size, size_t size)
{
	const unsigned char *p = (const unsigned char *)b;
	size_t got;
	memcpy(&got, p, sizeof got);
	EQ("the size field", got, size);
	for (size_t i = struct_size; i < size; i++)
		T_CHECK(p[i] == 0, "%s: byte %zu past sizeof = %zu got 0x%02x, wanted 0", name, i,
			struct_size, p[i]);
	for (size_t i = size; i < sizeof *b; i++)
		T_CHECK(p[i] == POISON, "%s: byte %zu past size = %zu got 0x%02x, wanted untouched "
			"0x%02x", name, i, size, p[i], POISON);
}

static void test_stats_size(void **state)
{
	(void)state;
	kvt_config cfg = shape_only();
	kvt_cache *c = t_create(&cfg);
	uint32_t seq;
	T_CHECK(kvt_seq_open(c, &seq) == 0, "kvt_seq_open: %s", kvt_last_error(c));
	struct outbuf b;
	const size_t sizes[] = {sizeof(kvt_stats), sizeof(kvt_stats) + 24};
	for (int i = 0; i < 2; i++) {
		const char *name = i ? "kvt_stats, size sizeof + 24" : "kvt_stats, size sizeof";
		out_prepare(&b, sizes[i]);
		T_CHECK(kvt_get_stats(c, &b.u.st) == 0, "%s: %s", name, kvt_last_error(c));
		EQ("seqs_open", b.u.st.seqs_open, 1);
		EQ("host_bytes_capacity", b.u.st.host_bytes_capacity, GiB);
		T_CHECK(b.u.st.backend && !strcmp(b.u.st.backend, "cpu"), "%s: backend got %s", name,
			b.u.st.backend ? b.u.st.backend : "(null)");
		out_check(name, &b, sizeof(kvt_stats), sizes[i]);
	}
	out_prepare(&b, KVT_STATS_SIZE_VER0 - 8);
	int rc = kvt_get_stats(c, &b.u.st);
	char want[32];
	snprintf(want, sizeof want, "%zu", (size_t)KVT_STATS_SIZE_VER0);
	T_CHECK(rc == -EINVAL && strstr(kvt_last_error(c), want),
		"kvt_stats, size VER0 - 8: got %d \"%s\", wanted %d naming the minimum %s", rc,
		kvt_last_error(c), -EINVAL, want);
	out_check("kvt_stats refused", &b, KVT_STATS_SIZE_VER0 - 8, KVT_STATS_SIZE_VER0 - 8);
	out_prepare(&b, sizeof(kvt_layer_stats) + 8);
	T_CHECK(kvt_get_layer_stats(c, 1, &b.u.ls) == 0, "kvt_layer_stats: %s", kvt_last_error(c));
	out_check("kvt_layer_stats, size sizeof + 8", &b, sizeof(kvt_layer_stats),
		  sizeof(kvt_layer_stats) + 8);
	out_prepare(&b, KVT_LAYER_STATS_SIZE_VER0 - 1);
	rc = kvt_get_layer_stats(c, 1, &b.u.ls);
	T_CHECK(rc == -EINVAL, "kvt_layer_stats, size VER0 - 1: got %d, wanted %d", rc, -EINVAL);
	kvt_cache_destroy(c);
}

static void test_probe(void **state)
{
	(void)state;
	const char *name = "kvt_probe";
	struct outbuf b;
	out_prepare(&b, sizeof(kvt_probe_info) + 8);
	int rc = kvt_probe(&b.u.pi);
	T_CHECK(rc == 0, "%s: got %d (%s), wanted 0", name, rc, kvt_last_error(NULL));
	out_check(name, &b, sizeof(kvt_probe_info), sizeof(kvt_probe_info) + 8);
	const kvt_probe_info *p = &b.u.pi;
	EQ("cuda_built", p->cuda_built, KVT_HAVE_CUDA_BACKEND);
	EQ("io_uring_built", p->io_uring_built, KVT_HAVE_LIBURING);
	EQ("io_uring_usable", p->io_uring_usable, kvt_nvme_available(NULL) > 0);
	EQ("hwloc_built", p->hwloc_built, KVT_HAVE_HWLOC);
	EQ("numa_built", p->numa_built, KVT_HAVE_NUMA);
	T_CHECK(p->numa_nodes >= 1, "%s: numa_nodes got %u, wanted >= 1", name, p->numa_nodes);
	T_CHECK(p->cuda_devices <= KVT_PROBE_MAX_DEVICES && (p->cuda_built || !p->cuda_devices),
		"%s: cuda_devices got %u (cuda_built %u)", name, p->cuda_devices, p->cuda_built);
	for (uint32_t i = 0; i < p->cuda_devices; i++)
		T_CHECK(strlen(p->cuda_busid[i]) >= 7 && strchr(p->cuda_busid[i], ':'),
			"%s: cuda_busid[%u] got \"%s\", wanted a PCI bus id", name, i,
			p->cuda_busid[i]);
	struct rlimit r;
	T_CHECK(getrlimit(RLIMIT_MEMLOCK, &r) == 0, "getrlimit");
	EQ("memlock_soft", p->memlock_soft,
	   r.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)r.rlim_cur);
	EQ("memlock_hard", p->memlock_hard,
	   r.rlim_max == RLIM_INFINITY ? UINT64_MAX : (uint64_t)r.rlim_max);
	T_CHECK(p->host_memory_bytes > 0 && p->host_available_bytes <= p->host_memory_bytes,
		"%s: host memory got %llu, available %llu", name,
		(unsigned long long)p->host_memory_bytes,
		(unsigned long long)p->host_available_bytes);
	out_prepare(&b, KVT_PROBE_INFO_SIZE_VER0 - 8);
	rc = kvt_probe(&b.u.pi);
	T_CHECK(rc == -EINVAL, "%s, size VER0 - 8: got %d, wanted %d", name, rc, -EINVAL);
	out_check("kvt_probe refused", &b, KVT_PROBE_INFO_SIZE_VER0 - 8,
		  KVT_PROBE_INFO_SIZE_VER0 - 8);
	T_CHECK(kvt_probe(NULL) == -EINVAL, "%s(NULL): wanted %d", name, -EINVAL);
}

/*
 * Llama-3.1-8B attention (32 layers, 8 KV heads, D = 128), one sequence of 32768 tokens, library
 * defaults (4 sinks, window 64, flush 64, hot cache 256 MiB). Rows of 4 * 128 = 512 B.
 *   index: (128/8 + 4) * 8 * 32 = 5120 B per token; 32768 - 4 - 64 = 32700 indexed tokens
 *   centroids 2 * 4 * 128 * 256 = 262144; window ring (64 + 2 * 64) * 512 * 256 = 25165824;
 *   selection 4 * (32700 + 1) * 256 = 33485824; block table 8 * 128 blocks * 256 = 262144
 *   host: 128 blocks of 131072 B per layer and head, 32768 blocks = 4 GiB; NVMe: 64 + 4 * 32
 *   header bytes rounded to 4096, plus 131072 = 135168 B a block
 *   rotations 4 * 128 * 128 * 32 = 2097152; hot cache fixed at 256 MiB: a way is 512 + 8 + 8 + 4 =
 *   532 B, sets per layer 268435456 / 32 / (532 * 8) = 1971, rows 1971 * 8 * 32 = 504576, bytes
 *   504576 * 532 = 268434432; the self-sized cache counts its bound when given (the same for
 *   256 MiB), else nothing
 */
static void test_footprint_llama(void **state)
{
	(void)state;
	const char *name = "llama8b-32K";
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 32;
	cfg.n_q_heads = 32;
	cfg.n_kv_heads = 8;
	cfg.head_dim = 128;
	cfg.gpu_cache_bytes = 256 * MiB;
	kvt_footprint f = {.size = sizeof f};
	int rc = kvt_footprint_of(&cfg, 32768, &f);
	T_CHECK(rc == 0, "%s: got %d (%s)", name, rc, kvt_last_error(NULL));
	EQ("row_bytes", f.row_bytes, 512);
	EQ("block_bytes", f.block_bytes, 131072);
	EQ("nvme_block_bytes", f.nvme_block_bytes, 135168);
	EQ("index_token_bytes", f.index_token_bytes, 5120);
	EQ("index_tokens", f.index_tokens, 32700);
	EQ("seq_blocks", f.seq_blocks, 32768);
	EQ("host_bytes", f.host_bytes, 4 * GiB);
	EQ("nvme_bytes", f.nvme_bytes, 32768ull * 135168);
	EQ("hbm_index_bytes", f.hbm_index_bytes, 32700ull * 5120);
	EQ("hbm_centroid_bytes", f.hbm_centroid_bytes, 262144);
	EQ("hbm_window_bytes", f.hbm_window_bytes, 25165824);
	EQ("hbm_selection_bytes", f.hbm_selection_bytes, 4ull * (1022 + 4 + 1) * 256);
	EQ("hbm_block_table_bytes", f.hbm_block_table_bytes, 262144);
	EQ("hbm_seq_bytes", f.hbm_seq_bytes,
	   32700ull * 5120 + 262144 + 25165824 + 4ull * (1022 + 4 + 1) * 256 + 262144);
	EQ("hbm_rotation_bytes", f.hbm_rotation_bytes, 2097152);
	EQ("hbm_hot_rows", f.hbm_hot_rows, 504576);
	EQ("hbm_hot_bytes", f.hbm_hot_bytes, 268434432);
	EQ("hbm_cache_bytes", f.hbm_cache_bytes, 2097152 + 268434432);
	/* short: nothing indexed, the selection at its smallest (a chunk count and the count), the
	 * table at 4 */
	rc = kvt_footprint_of(&cfg, 10, &f);
	T_CHECK(rc == 0, "%s, 10 tokens: got %d", name, rc);
	EQ("index_tokens (10)", f.index_tokens, 0);
	EQ("hbm_selection_bytes (10)", f.hbm_selection_bytes, 4 * 2 * 256);
	EQ("hbm_block_table_bytes (10)", f.hbm_block_table_bytes, 8 * 4 * 256);
	EQ("seq_blocks (10)", f.seq_blocks, 256);
	cfg.gpu_cache_bytes = 0;
	cfg.gpu_cache_max_bytes = 256 * MiB;
	T_CHECK(kvt_footprint_of(&cfg, 10, &f) == 0, "%s, self-sized within 256 MiB", name);
	EQ("hbm_hot_bytes (self-sized, bound)", f.hbm_hot_bytes, 268434432);
	cfg.gpu_cache_max_bytes = 0;
	T_CHECK(kvt_footprint_of(&cfg, 10, &f) == 0, "%s, self-sized", name);
	EQ("hbm_hot_bytes (self-sized)", f.hbm_hot_bytes, 0);
	cfg.gpu_cache_bytes = KVT_NONE64;
	T_CHECK(kvt_footprint_of(&cfg, 10, &f) == 0, "%s, no hot cache", name);
	EQ("hbm_hot_bytes (none)", f.hbm_hot_bytes, 0);
	rc = kvt_footprint_of(&cfg, (uint64_t)INT32_MAX + 1, &f);
	T_CHECK(rc == -EINVAL && strstr(kvt_last_error(NULL), "n_tokens"),
		"%s, 2^31 tokens: got %d \"%s\", wanted %d", name, rc, kvt_last_error(NULL), -EINVAL);
	/* a host pool name kvt_cache_create refuses is refused here too, without attaching */
	static const char *const bad_pools[] = {"", "a/b",
						"a-name-longer-than-the-forty-eight-characters-allowed"};
	for (int i = 0; i < 3; i++) {
		cfg.host_pool = bad_pools[i];
		rc = kvt_footprint_of(&cfg, 10, &f);
		T_CHECK(rc == -EINVAL && strstr(kvt_last_error(NULL), "host_pool"),
			"%s, host_pool \"%s\": got %d \"%s\", wanted %d", name, bad_pools[i], rc,
			kvt_last_error(NULL), -EINVAL);
	}
	cfg.host_pool = NULL;
	cfg.head_dim = 96;
	rc = kvt_footprint_of(&cfg, 10, &f);
	T_CHECK(rc == -EINVAL && strstr(kvt_last_error(NULL), "head_dim"),
		"%s, head_dim 96: got %d \"%s\", wanted %d", name, rc, kvt_last_error(NULL), -EINVAL);
}

/* The host tier of a live cache after a prefill of n tokens holds what the footprint says. */
static void test_footprint_live(void **state)
{
	(void)state;
	const uint32_t n = 700;
	kvt_config cfg = shape_only();
	cfg.host_bytes = 64 * MiB;
	kvt_cache *c = t_create(&cfg);
	uint32_t seq;
	T_CHECK(kvt_seq_open(c, &seq) == 0, "kvt_seq_open: %s", kvt_last_error(c));
	uint16_t *kv = t_alloc((size_t)n * cfg.n_kv_heads * D * 2);
	t_rng r;
	t_rng_seed(&r, 0xab1);
	t_fill(&r, KVT_DTYPE_F16, (size_t)n * cfg.n_kv_heads * D, 0.0, 1.0, kv, NULL);
	for (uint32_t l = 0; l < cfg.n_layers; l++)
		T_CHECK(kvt_prefill(c, seq, l, NULL, kv, kv, n, NULL) == 0, "kvt_prefill: %s",
			kvt_last_error(c));
	kvt_stats st = t_stats(c);
	kvt_footprint f = {.size = sizeof f};
	T_CHECK(kvt_footprint_of(&cfg, n, &f) == 0, "kvt_footprint_of: %s", kvt_last_error(NULL));
	const char *name = "live, 700 tokens";
	EQ("host_bytes = stats.host_bytes_used", f.host_bytes, st.host_bytes_used);
	EQ("hbm_index_bytes = stats.index_bytes", f.hbm_index_bytes, st.index_bytes);
	EQ("index_tokens * layers = stats.tokens_indexed", f.index_tokens * cfg.n_layers,
	   st.tokens_indexed);
	kvt_cache_destroy(c);
	free(kv);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_config_defaults),
		cmocka_unit_test(test_config_explicit_zero),
		cmocka_unit_test(test_config_old_size),
		cmocka_unit_test(test_config_newer_size),
		cmocka_unit_test(test_stats_size),
		cmocka_unit_test(test_probe),
		cmocka_unit_test(test_footprint_llama),
		cmocka_unit_test(test_footprint_live),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
