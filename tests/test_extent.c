/* SPDX-License-Identifier: MIT */
/*
 * The host-tier extent allocator (host/extent.c): capacity enforcement, all-or-nothing takes under
 * injected allocation failures, distinct writable blocks across extents, reuse after give, and the
 * `used` accounting.
 */
#include "common.h"

#define BB ((size_t)64 << 10)

/* The detail of the last failed extents call. */
static struct kvt_err ext_err;

static int cmp_ptr(const void *a, const void *b)
{
	uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
	return (x > y) - (x < y);
}

/* Blocks pairwise disjoint: sorted, each starts at least block_bytes after the previous. */
static void check_disjoint(const char *what, void **blocks, size_t n, size_t bb)
{
	void **s = (void **)t_alloc(sizeof(void *) * (n ? n : 1));
	memcpy(s, blocks, sizeof(void *) * n);
	qsort(s, n, sizeof *s, cmp_ptr);
	for (size_t i = 0; i < n; i++) {
		T_CHECK(s[i] != NULL, "%s: block %zu is NULL", what, i);
		if (i)
			T_CHECK((uintptr_t)s[i] - (uintptr_t)s[i - 1] >= bb,
				"%s: blocks %p and %p overlap (%zu bytes apart, block %zu)", what,
				s[i - 1], s[i], (size_t)((uintptr_t)s[i] - (uintptr_t)s[i - 1]), bb);
	}
	free(s);
}

/* Stamp a block's first and last 8 bytes with its tag; check them later. */
static void stamp(void *b, size_t bb, uint64_t tag)
{
	memcpy(b, &tag, 8);
	memcpy((char *)b + bb - 8, &tag, 8);
}

static void check_stamp(const char *what, const void *b, size_t bb, uint64_t tag)
{
	uint64_t x, y;
	memcpy(&x, b, 8);
	memcpy(&y, (const char *)b + bb - 8, 8);
	T_CHECK(x == tag && y == tag, "%s: block %p stamps got 0x%llx 0x%llx, wanted 0x%llx", what, b,
		(unsigned long long)x, (unsigned long long)y, (unsigned long long)tag);
}

static void test_capacity_and_reuse(void **state)
{
	(void)state;
	int64_t live0 = kvt_mem_live();
	struct kvt_extents x;
	const uint64_t cap = 10 * BB + 100;
	int rc = kvt_extents_init(&x, cap, BB, NULL, NULL, &ext_err);
	T_CHECK(rc == 0, "init got %d", rc);
	T_CHECK(x.capacity == cap && x.used == 0 && x.block_bytes == BB,
		"after init: capacity %llu used %llu block %zu, wanted %llu 0 %zu",
		(unsigned long long)x.capacity, (unsigned long long)x.used, x.block_bytes,
		(unsigned long long)cap, BB);
	T_CHECK(x.extent_bytes >= BB && x.extent_bytes % BB == 0,
		"extent_bytes %zu, wanted a positive multiple of %zu", x.extent_bytes, BB);
	T_CHECK(kvt_extents_free_bytes(&x) == cap, "free bytes got %llu, wanted %llu",
		(unsigned long long)kvt_extents_free_bytes(&x), (unsigned long long)cap);

	void *b[12], *sentinel = (void *)&x;
	rc = kvt_extents_take(&x, 4, b, &ext_err);
	T_CHECK(rc == 0 && x.used == 4 * BB, "take 4: got %d used %llu, wanted 0 and %zu", rc,
		(unsigned long long)x.used, 4 * BB);
	for (int i = 0; i < 4; i++)
		stamp(b[i], BB, 0x1000u + (uint64_t)i);
	/* 4 + 7 > 10: refused, nothing taken, out untouched */
	for (int i = 4; i < 12; i++)
		b[i] = sentinel;
	rc = kvt_extents_take(&x, 7, b + 4, &ext_err);
	T_CHECK(rc == -ENOSPC && strstr(ext_err.msg, "free of capacity"),
		"take 7 over capacity: got %d (%s), wanted %d naming the bytes free and the capacity",
		rc, ext_err.msg, -ENOSPC);
	T_CHECK(x.used == 4 * BB, "after a refused take: used %llu, wanted %zu",
		(unsigned long long)x.used, 4 * BB);
	for (int i = 4; i < 11; i++)
		T_CHECK(b[i] == sentinel, "refused take wrote out[%d]", i - 4);
	rc = kvt_extents_take(&x, 6, b + 4, &ext_err);
	T_CHECK(rc == 0 && x.used == 10 * BB, "take 6 up to capacity: got %d used %llu, wanted 0 %zu",
		rc, (unsigned long long)x.used, 10 * BB);
	T_CHECK(kvt_extents_free_bytes(&x) == 100, "free bytes got %llu, wanted 100",
		(unsigned long long)kvt_extents_free_bytes(&x));
	for (int i = 4; i < 10; i++)
		stamp(b[i], BB, 0x1000u + (uint64_t)i);
	check_disjoint("10 blocks", b, 10, BB);
	rc = kvt_extents_take(&x, 1, b + 10, &ext_err);
	T_CHECK(rc == -ENOSPC && b[10] == sentinel, "take 1 when full: got %d, wanted %d", rc, -ENOSPC);
	for (int i = 0; i < 10; i++)
		check_stamp("after filling", b[i], BB, 0x1000u + (uint64_t)i);

	/* give three back; the next take of three reuses exactly those */
	void *given[3] = {b[1], b[5], b[8]};
	kvt_extents_give(&x, 3, given);
	T_CHECK(x.used == 7 * BB, "after give 3: used %llu, wanted %zu", (unsigned long long)x.used,
		7 * BB);
	void *again[3];
	rc = kvt_extents_take(&x, 3, again, &ext_err);
	T_CHECK(rc == 0 && x.used == 10 * BB, "take 3 after give: got %d used %llu", rc,
		(unsigned long long)x.used);
	qsort(given, 3, sizeof *given, cmp_ptr);
	qsort(again, 3, sizeof *again, cmp_ptr);
	for (int i = 0; i < 3; i++)
		T_CHECK(again[i] == given[i], "reuse: block %d got %p, wanted %p (one given back)", i,
			again[i], given[i]);
	for (int i = 0; i < 10; i++)
		if (i != 1 && i != 5 && i != 8)
			check_stamp("after give and take", b[i], BB, 0x1000u + (uint64_t)i);
	kvt_extents_give(&x, 10, b);
	T_CHECK(x.used == 0, "after giving all: used %llu, wanted 0", (unsigned long long)x.used);
	kvt_extents_fini(&x);
	T_CHECK(kvt_mem_live() == live0, "after fini: live allocations %lld, wanted %lld",
		(long long)kvt_mem_live(), (long long)live0);
}

/* Enough blocks to need several extents: all distinct, writable, and back after give. */
static void test_many_extents(void **state)
{
	(void)state;
	int64_t live0 = kvt_mem_live();
	struct kvt_extents x;
	T_CHECK(kvt_extents_init(&x, (uint64_t)1 << 40, BB, NULL, NULL, &ext_err) == 0, "init");
	size_t per = x.extent_bytes / BB;
	size_t n = 2 * per + 3;
	if (n > 20000) {
		print_message("extent of %zu blocks: testing 20000 blocks in one extent\n", per);
		n = 20000;
	}
	void **b = (void **)t_alloc(sizeof(void *) * n);
	size_t got = 0;
	t_rng rng;
	t_rng_seed(&rng, 0xe7e);
	while (got < n) { /* takes of assorted sizes */
		uint32_t k = 1 + t_below(&rng, 700);
		if (k > n - got)
			k = (uint32_t)(n - got);
		int rc = kvt_extents_take(&x, k, b + got, &ext_err);
		T_CHECK(rc == 0, "take %u after %zu (seed 0x%llx): got %d", k, got,
			(unsigned long long)rng.seed, rc);
		got += k;
		T_CHECK(x.used == got * BB, "used got %llu, wanted %zu", (unsigned long long)x.used,
			got * BB);
	}
	check_disjoint("blocks over several extents", b, n, BB);
	for (size_t i = 0; i < n; i++)
		stamp(b[i], BB, 0xb10c000000ull + i);
	for (size_t i = 0; i < n; i++)
		check_stamp("several extents", b[i], BB, 0xb10c000000ull + i);
	kvt_extents_give(&x, (uint32_t)n, b);
	T_CHECK(x.used == 0, "after give: used %llu", (unsigned long long)x.used);
	/* everything comes back from the free blocks: no new extent */
	int64_t live = kvt_mem_live();
	T_CHECK(kvt_extents_take(&x, (uint32_t)n, b, &ext_err) == 0, "take all again");
	T_CHECK(kvt_mem_live() == live, "retaking given blocks allocated (%lld -> %lld)",
		(long long)live, (long long)kvt_mem_live());
	check_disjoint("retaken", b, n, BB);
	kvt_extents_fini(&x);
	free(b);
	T_CHECK(kvt_mem_live() == live0, "after fini: live %lld, wanted %lld", (long long)kvt_mem_live(),
		(long long)live0);
}

/* Fail each allocation a take makes in turn: -ENOMEM takes nothing, a retry succeeds. */
static void test_take_enomem(void **state)
{
	(void)state;
	int64_t live0 = kvt_mem_live();
	uint64_t n;
	int failures = 0;
	for (n = 1; n < 1000; n++) {
		struct kvt_extents x;
		T_CHECK(kvt_extents_init(&x, (uint64_t)1 << 40, BB, NULL, NULL, &ext_err) == 0, "init");
		size_t per = x.extent_bytes / BB;
		uint32_t want = (uint32_t)(per > 3000 ? 3000 : 2 * per + 1);
		void *first[2];
		T_CHECK(kvt_extents_take(&x, 2, first, &ext_err) == 0, "N=%llu: warm-up take",
			(unsigned long long)n);
		void **b = (void **)t_alloc(sizeof(void *) * want);
		for (uint32_t i = 0; i < want; i++)
			b[i] = first;
		kvt_mem_fail_at(n);
		int rc = kvt_extents_take(&x, want, b, &ext_err);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc == -ENOMEM) {
			failures++;
			T_CHECK(x.used == 2 * BB, "N=%llu: failed take changed used to %llu, wanted %zu",
				(unsigned long long)n, (unsigned long long)x.used, 2 * BB);
			for (uint32_t i = 0; i < want; i++)
				T_CHECK(b[i] == first, "N=%llu: failed take wrote out[%u]",
					(unsigned long long)n, i);
			rc = kvt_extents_take(&x, want, b, &ext_err);
			T_CHECK(rc == 0, "N=%llu: retry got %d", (unsigned long long)n, rc);
		} else {
			T_CHECK(rc == 0, "N=%llu: take got %d, wanted 0 or -ENOMEM", (unsigned long long)n,
				rc);
		}
		T_CHECK(x.used == (2 + (uint64_t)want) * BB, "N=%llu: used got %llu, wanted %llu",
			(unsigned long long)n, (unsigned long long)x.used,
			(unsigned long long)((2 + want) * BB));
		void **all = (void **)t_alloc(sizeof(void *) * (want + 2));
		memcpy(all, b, sizeof(void *) * want);
		all[want] = first[0];
		all[want + 1] = first[1];
		check_disjoint("after injected failure", all, want + 2, BB);
		for (uint32_t i = 0; i < want + 2; i++)
			stamp(all[i], BB, i);
		kvt_extents_fini(&x);
		free(b);
		free(all);
		T_CHECK(kvt_mem_live() == live0, "N=%llu: after fini live %lld, wanted %lld",
			(unsigned long long)n, (long long)kvt_mem_live(), (long long)live0);
		if (!fired)
			break;
	}
	T_CHECK(failures >= 2, "injected failures that made take fail: %d, wanted >= 2 (N up to %llu)",
		failures, (unsigned long long)n);
}

/* Pin hooks that count what they pinned, so a test sees which context pinned what. */
static int pins_live;
static int count_pin(void *p, size_t bytes)
{
	(void)p;
	(void)bytes;
	pins_live++;
	return 0;
}

static void count_unpin(void *p)
{
	(void)p;
	pins_live--;
}

/* "Device" memory from the heap: the context's device hooks, seen from a test. */
static void *heap_device_alloc(size_t bytes)
{
	return malloc(bytes);
}

/*
 * Two tiers of one process under different allocation contexts (a cache with pin hooks, a cache
 * without): only the first pins, each extent once, and releasing one leaves the other's pins.
 */
static void test_contexts(void **state)
{
	(void)state;
	static const struct kvt_mem_hooks pinning = {.pin = count_pin, .unpin = count_unpin,
						     .device_alloc = heap_device_alloc,
						     .device_free = free};
	const struct kvt_mem gpu = {&pinning}, cpu = {NULL};
	int64_t live0 = kvt_mem_live();
	struct kvt_extents a, b;
	void *ba[3], *bb[3];
	T_CHECK(kvt_extents_init(&a, 4 * BB, BB, NULL, &gpu, &ext_err) == 0 &&
			kvt_extents_init(&b, 4 * BB, BB, NULL, &cpu, &ext_err) == 0,
		"init: %s", ext_err.msg);
	T_CHECK(a.pinned == 1 && b.pinned == 0, "pinned got %d and %d, wanted 1 and 0", a.pinned,
		b.pinned);
	T_CHECK(kvt_extents_take(&a, 3, ba, &ext_err) == 0 && kvt_extents_take(&b, 3, bb, &ext_err) == 0,
		"take: %s", ext_err.msg);
	T_CHECK(pins_live == 1, "pins after both tiers grew got %d, wanted 1 (the pinning tier's "
		"one extent)", pins_live);
	kvt_extents_fini(&b);
	T_CHECK(pins_live == 1, "pins after the unpinned tier's fini got %d, wanted 1", pins_live);
	kvt_extents_fini(&a);
	T_CHECK(pins_live == 0 && kvt_mem_live() == live0,
		"after both fini: pins %d, live %lld; wanted 0 and %lld", pins_live,
		(long long)kvt_mem_live(), (long long)live0);
	/* device memory only where the context has device hooks, counted as live like the rest */
	void *d = kvt_mem_device_alloc(&gpu, 256), *none = kvt_mem_device_alloc(&cpu, 256);
	T_CHECK(d && !none && kvt_mem_live() == live0 + 1,
		"device alloc: got %p and %p, live %lld; wanted memory, NULL and %lld", d, none,
		(long long)kvt_mem_live(), (long long)live0 + 1);
	kvt_mem_device_free(&gpu, d, 256);
	T_CHECK(kvt_mem_live() == live0, "after device free: live %lld, wanted %lld",
		(long long)kvt_mem_live(), (long long)live0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_capacity_and_reuse),
		cmocka_unit_test(test_many_extents),
		cmocka_unit_test(test_take_enomem),
		cmocka_unit_test(test_contexts),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
