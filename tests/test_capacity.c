/* SPDX-License-Identifier: MIT */
/*
 * The scheduler-facing calls (kvt_get_capacity, kvt_seq_bytes): the per-token and per-block figures
 * follow from the shape, the free bytes fall by exactly what a prefill takes, a spill moves a
 * sequence's bytes from the host tier to NVMe (and its NVMe bytes are those the files lose, a
 * block's nvme_block_bytes each), and bad
 * arguments are refused by name.
 */
#include "common.h"
#include "tier_util.h"

enum { L = 2, HQ = 4, HKV = 2, D = 64, T = 600 };

static kvt_capacity capacity(kvt_cache *c)
{
	kvt_capacity k = {.size = sizeof k};
	T_CHECK(kvt_get_capacity(c, &k) == 0, "kvt_get_capacity: %s", kvt_last_error(c));
	return k;
}

static void prefill(kvt_cache *c, uint32_t seq)
{
	t_rng r;
	t_rng_seed(&r, 11 + seq);
	uint16_t *k = t_alloc(2ull * T * HKV * D), *v = t_alloc(2ull * T * HKV * D);
	for (size_t i = 0; i < (size_t)T * HKV * D; i++) {
		k[i] = t_f2h((float)t_normal(&r));
		v[i] = t_f2h((float)t_normal(&r));
	}
	for (uint32_t l = 0; l < L; l++)
		T_CHECK(kvt_prefill(c, seq, l, NULL, k, v, T, NULL) == 0, "prefill layer %u: %s", l,
			kvt_last_error(c));
	free(k);
	free(v);
}

/* Host-tier bytes of one sequence of T tokens: whole blocks per layer and KV head. */
static uint64_t seq_host_bytes(const kvt_capacity *k)
{
	return (T + k->block_tokens - 1) / k->block_tokens * k->block_bytes * HKV * L;
}

static void test_figures(void **state)
{
	(void)state;
	kvt_config cfg = t_config(L, HQ, HKV, D, KVT_DTYPE_F16);
	kvt_cache *c = t_create(&cfg);
	kvt_capacity k = capacity(c);
	const uint64_t row = 4ull * D; /* K and V of one token of one KV head, fp16 */
	T_CHECK(k.block_tokens == 256 && k.block_bytes == 256 * row,
		"block: got %llu tokens of %llu bytes, wanted 256 of %llu", (unsigned long long)k.block_tokens,
		(unsigned long long)k.block_bytes, (unsigned long long)(256 * row));
	T_CHECK(k.row_bytes_per_token == row * HKV * L &&
			k.index_bytes_per_token == (D / 8 + 4) * HKV * L,
		"per token: got rows %llu, index %llu, wanted %llu and %llu",
		(unsigned long long)k.row_bytes_per_token, (unsigned long long)k.index_bytes_per_token,
		(unsigned long long)(row * HKV * L), (unsigned long long)((D / 8 + 4) * HKV * L));
	T_CHECK(k.host_bytes_free == cfg.host_bytes && k.host_bytes_capacity == cfg.host_bytes &&
			k.nvme_bytes_capacity == 0 && k.nvme_block_bytes == 0 && k.seqs_open == 0 &&
			k.max_seqs == cfg.max_seqs,
		"empty cache: free %llu of %llu, nvme %llu (blocks of %llu), seqs %u of %u",
		(unsigned long long)k.host_bytes_free, (unsigned long long)k.host_bytes_capacity,
		(unsigned long long)k.nvme_bytes_capacity, (unsigned long long)k.nvme_block_bytes,
		k.seqs_open, k.max_seqs);
	uint32_t s;
	T_CHECK(kvt_seq_open(c, &s) == 0, "seq_open");
	prefill(c, s);
	uint64_t host = 1, nvme = 1;
	T_CHECK(kvt_seq_bytes(c, s, &host, &nvme) == 0, "kvt_seq_bytes: %s", kvt_last_error(c));
	T_CHECK(host == seq_host_bytes(&k) && nvme == 0, "seq bytes: got host %llu nvme %llu, wanted "
		"%llu and 0", (unsigned long long)host, (unsigned long long)nvme,
		(unsigned long long)seq_host_bytes(&k));
	kvt_capacity after = capacity(c);
	T_CHECK(after.host_bytes_free == k.host_bytes_free - host && after.seqs_open == 1,
		"after the prefill: free %llu, wanted %llu; seqs %u", (unsigned long long)after.host_bytes_free,
		(unsigned long long)(k.host_bytes_free - host), after.seqs_open);
	kvt_cache_destroy(c);
}

static void test_spilled(void **state)
{
	(void)state;
	tt_skip_unless_available();
	tt_files f;
	tt_make_files(&f, 1, 64ull << 20);
	kvt_config cfg = t_config(L, HQ, HKV, D, KVT_DTYPE_F16);
	cfg.nvme_paths = (const char *const *)f.ptrs;
	cfg.nvme_bytes = f.bytes;
	cfg.n_nvme = 1;
	cfg.nvme_cache_bytes = 1ull << 20;
	kvt_cache *c = t_create(&cfg);
	uint32_t s;
	T_CHECK(kvt_seq_open(c, &s) == 0, "seq_open");
	prefill(c, s);
	kvt_capacity before = capacity(c);
	uint64_t host0, host1, nvme1;
	T_CHECK(kvt_seq_bytes(c, s, &host0, NULL) == 0, "kvt_seq_bytes");
	const int64_t moved = kvt_seq_spill(c, s);
	T_CHECK(moved > 0, "spill: %s", kvt_last_error(c));
	kvt_capacity after = capacity(c);
	T_CHECK(kvt_seq_bytes(c, s, &host1, &nvme1) == 0, "kvt_seq_bytes after the spill");
	T_CHECK(host1 < host0 && nvme1 > 0 && after.host_bytes_free - before.host_bytes_free ==
			host0 - host1 && before.nvme_bytes_free - after.nvme_bytes_free == nvme1,
		"spill: host %llu -> %llu, nvme 0 -> %llu; free host %llu -> %llu, free nvme %llu -> %llu",
		(unsigned long long)host0, (unsigned long long)host1, (unsigned long long)nvme1,
		(unsigned long long)before.host_bytes_free, (unsigned long long)after.host_bytes_free,
		(unsigned long long)before.nvme_bytes_free, (unsigned long long)after.nvme_bytes_free);
	/* a spilled block takes nvme_block_bytes in the files: header, checksums and payload at
	 * the files' alignment, more than the payload and less than the payload plus a page */
	const uint64_t blocks = (uint64_t)moved / after.block_bytes;
	T_CHECK(after.nvme_block_bytes == before.nvme_block_bytes &&
			after.nvme_block_bytes > after.block_bytes &&
			after.nvme_block_bytes <= after.block_bytes + 8192 &&
			nvme1 == blocks * after.nvme_block_bytes,
		"%llu blocks spilled of %llu bytes each: nvme %llu, wanted %llu",
		(unsigned long long)blocks, (unsigned long long)after.nvme_block_bytes,
		(unsigned long long)nvme1, (unsigned long long)(blocks * after.nvme_block_bytes));
	kvt_cache_destroy(c);
	tt_unlink(&f);
}

static void test_refusals(void **state)
{
	(void)state;
	kvt_config cfg = t_config(L, HQ, HKV, D, KVT_DTYPE_F16);
	kvt_cache *c = t_create(&cfg);
	kvt_capacity k = {.size = KVT_CAPACITY_SIZE_VER0 - 1};
	int rc = kvt_get_capacity(c, &k);
	T_CHECK(rc == -EINVAL && strstr(kvt_last_error(c), "size"),
		"a size below VER0: got %d (%s), wanted -EINVAL naming the size", rc, kvt_last_error(c));
	rc = kvt_get_capacity(NULL, &k);
	T_CHECK(rc == -EINVAL, "NULL cache: got %d", rc);
	rc = kvt_get_capacity(c, NULL);
	T_CHECK(rc == -EINVAL && strstr(kvt_last_error(c), "cap"), "NULL cap: got %d (%s)", rc,
		kvt_last_error(c));
	rc = kvt_seq_bytes(c, 3, NULL, NULL);
	T_CHECK(rc == -ENOENT && strstr(kvt_last_error(c), "seq = 3"),
		"a sequence not open: got %d (%s), wanted -ENOENT naming it", rc, kvt_last_error(c));
	kvt_cache_destroy(c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_figures),
		cmocka_unit_test(test_spilled),
		cmocka_unit_test(test_refusals),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
