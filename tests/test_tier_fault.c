/* SPDX-License-Identifier: MIT */
/*
 * I/O faults under the NVMe tier of the cache (suite fault). The store's completion shim rewrites the
 * result of the N-th io_uring completion (-EIO, -EAGAIN, -ECANCELED, -ENOSPC, a short count, zero
 * bytes) for N = 1, 2, ... until a run of the script
 *     spill -> gather of every layer (direct serving) -> restore -> gather of every layer
 * no longer reaches the N-th completion. Each run uses a fresh cache and checks:
 *   - the call that met the fault returns what nvme_store.h documents: -EAGAIN is retried and a short
 *     transfer continued (the call succeeds); any other error is returned as is, zero bytes as -EIO;
 *     every other call succeeds;
 *   - after a failure (hook removed) the sequence reads back from wherever its valid copy is, byte
 *     for byte (never unverified or garbage rows): a failed spill keeps the host copy (host and NVMe
 *     bytes in use unchanged), a failed restore keeps the NVMe copy (likewise), a failed direct
 *     read leaves the sequence spilled; and a retry of the failed call succeeds;
 *   - nothing leaks: kvt_mem_live() and the open descriptors of the process are the same before the
 *     cache is created and after it is destroyed.
 * Then the same script with completions handled in seeded random order (kvt_nvme_set_cqe_shuffle),
 * without and with a failed completion; and the script with the N-th allocation failed instead
 * (test_alloc_faults: store open, block cache, spill, the row reads of direct serving, restore;
 * in test_tier_fault_alloc.c, with the LRU undo tests). Shared: tier_fault.h.
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_fault.h"

/* Per-step tallies over a loop. */
enum step { S_SPILL, S_GATHER, S_RESTORE, S_GATHER_HOST, S_STEPS };
static const char *const step_name[S_STEPS] = {"spill", "direct gather", "restore",
					       "gather after restore"};

struct tally {
	uint64_t fired[S_STEPS], failed[S_STEPS];
	uint64_t reordered, ios; /* the store's counters, summed over runs */
};

/*
 * The call of `step` returned rc; fired: the rewrite happened in it. Checks the outcome against the
 * kind; returns whether the call failed (then the caller checks the state and retries).
 */
static int judge(struct run *r, struct hook_state *h, enum step step, int64_t rc, int fired,
		 struct tally *t)
{
	int want = fired ? kind_rc[h->kind] : 0;
	if (fired && h->orig < 0)
		want = h->orig; /* the device failed by itself: its error is the answer */
	t->fired[step] += fired;
	if (want == 0) {
		T_CHECK(rc >= 0, "%s: %s met no fault that it should fail on (rewrite %s of completion "
			"%llu, fired here: %d, result was %d), but got %lld (%s: %s)", r->name,
			step_name[step], kind_name[h->kind], (unsigned long long)h->n, fired, h->orig,
			(long long)rc, kvt_strerror((int)rc), kvt_last_error(r->c));
		return 0;
	}
	T_CHECK(rc == want, "%s: %s met completion %llu rewritten from %d to %s: got %lld (%s: %s), "
		"wanted %d (%s)", r->name, step_name[step], (unsigned long long)h->n, h->orig,
		kind_name[h->kind], (long long)rc, kvt_strerror((int)rc), kvt_last_error(r->c), want,
		kvt_strerror(want));
	T_CHECK(kvt_last_error(r->c)[0] != 0, "%s: %s failed with no detail text", r->name,
		step_name[step]);
	t->failed[step]++;
	return 1;
}

/*
 * One run of the script with the hook rewriting completion n (n = 0: no hook), completions
 * shuffled with `shuffle` (0: arrival order), queue depth qd. Returns whether the hook was reached.
 */
static int script(const char *what, enum kind kind, uint64_t n, uint64_t shuffle, uint32_t qd,
		  struct tally *t)
{
	struct run run, *r = &run;
	char name[160];
	snprintf(name, sizeof name, "%s: %s at completion %llu%s", what, kind_name[kind],
		 (unsigned long long)n, shuffle ? " (shuffled)" : "");
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	run_open(r, name, qd);
	struct hook_state h = {.n = n, .kind = kind};
	if (shuffle)
		kvt_nvme_set_cqe_shuffle(r->c->nvme, shuffle);
	if (n)
		kvt_nvme_set_cqe_hook(r->c->nvme, hook, &h);
	int fired0;
	int64_t rc;

	/* spill */
	kvt_stats a = t_stats(r->c);
	fired0 = h.fired;
	rc = kvt_seq_spill(r->c, r->seq);
	if (judge(r, &h, S_SPILL, rc, h.fired != fired0, t)) {
		kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
		kvt_stats b = t_stats(r->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				on_nvme(r) == 0 && b.spills == a.spills,
			"%s: the failed spill changed host_bytes_used %llu -> %llu, nvme_bytes_used %llu "
			"-> %llu, blocks on NVMe %u (wanted 0)", r->name,
			(unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
			(unsigned long long)a.nvme_bytes_used, (unsigned long long)b.nvme_bytes_used,
			on_nvme(r));
		check_all_layers(r, "after the failed spill (host copy)");
		rc = kvt_seq_spill(r->c, r->seq);
		T_CHECK(rc == DUE, "%s: retried spill got %lld (%s), wanted %lld", r->name,
			(long long)rc, rc < 0 ? kvt_last_error(r->c) : "bytes", (long long)DUE);
	} else {
		T_CHECK(rc == DUE, "%s: spill got %lld, wanted %lld bytes", r->name, (long long)rc,
			(long long)DUE);
	}
	kvt_stats b = t_stats(r->c);
	T_CHECK(a.host_bytes_used - b.host_bytes_used == (uint64_t)DUE && on_nvme(r) == SPILL_BLOCKS,
		"%s: after the spill host_bytes_used %llu -> %llu (wanted a drop of %lld), %u blocks on "
		"NVMe (wanted %d)", r->name, (unsigned long long)a.host_bytes_used,
		(unsigned long long)b.host_bytes_used, (long long)DUE, on_nvme(r), SPILL_BLOCKS);

	/* direct serving, layer by layer */
	for (int l = 0; l < LAYERS; l++) {
		do_select(r, l);
		fired0 = h.fired;
		rc = do_gather(r, l);
		if (judge(r, &h, S_GATHER, rc, h.fired != fired0, t)) {
			kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
			T_CHECK(on_nvme(r) == SPILL_BLOCKS, "%s: the failed direct read moved blocks",
				r->name);
			/* the retry of the same call, the selection kept */
			expect_rows(r, l, do_gather(r, l), "retried direct gather");
		} else {
			expect_rows(r, l, (int)rc, "direct gather");
		}
	}

	/* restore */
	a = t_stats(r->c);
	fired0 = h.fired;
	rc = kvt_seq_restore(r->c, r->seq);
	if (judge(r, &h, S_RESTORE, rc, h.fired != fired0, t)) {
		kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
		b = t_stats(r->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				on_nvme(r) == SPILL_BLOCKS && b.restores == a.restores,
			"%s: the failed restore changed host_bytes_used %llu -> %llu, nvme_bytes_used "
			"%llu -> %llu, blocks on NVMe %u (wanted %d)", r->name,
			(unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
			(unsigned long long)a.nvme_bytes_used, (unsigned long long)b.nvme_bytes_used,
			on_nvme(r), SPILL_BLOCKS);
		check_all_layers(r, "after the failed restore (NVMe copy)");
		rc = kvt_seq_restore(r->c, r->seq);
		T_CHECK(rc == DUE, "%s: retried restore got %lld (%s), wanted %lld", r->name,
			(long long)rc, rc < 0 ? kvt_last_error(r->c) : "bytes", (long long)DUE);
	} else {
		T_CHECK(rc == DUE, "%s: restore got %lld, wanted %lld bytes", r->name, (long long)rc,
			(long long)DUE);
	}
	b = t_stats(r->c);
	T_CHECK(b.host_bytes_used - a.host_bytes_used == (uint64_t)DUE && on_nvme(r) == 0 &&
			b.nvme_bytes_used == 0,
		"%s: after the restore host_bytes_used %llu -> %llu (wanted a rise of %lld), %u blocks "
		"on NVMe (wanted 0), nvme_bytes_used %llu (wanted 0)", r->name,
		(unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
		(long long)DUE, on_nvme(r), (unsigned long long)b.nvme_bytes_used);

	/* from the host again: no I/O, so no completion to fail */
	for (int l = 0; l < LAYERS; l++) {
		do_select(r, l);
		fired0 = h.fired;
		rc = do_gather(r, l);
		judge(r, &h, S_GATHER_HOST, rc, h.fired != fired0, t);
		expect_rows(r, l, (int)rc, "gather after restore");
	}
	struct kvt_nvme_stats ns;
	kvt_nvme_get_stats(r->c->nvme, &ns);
	t->reordered += ns.reordered;
	t->ios += ns.read_ios + ns.write_ios;
	int fired = h.fired;
	kvt_cache_destroy(r->c);
	T_CHECK(kvt_mem_live() == live, "%s: live allocations got %lld after destroy, wanted %lld",
		name, (long long)kvt_mem_live(), (long long)live);
	T_CHECK(t_fd_count() == fds, "%s: open descriptors got %d after destroy, wanted %d", name,
		t_fd_count(), fds);
	return fired;
}

/* Every completion of the script failed in turn with one kind of rewrite. */
static void fail_each(enum kind kind, uint64_t shuffle)
{
	struct tally t;
	memset(&t, 0, sizeof t);
	uint64_t n = 1;
	for (; n < 100000; n++)
		if (!script("completion shim", kind, n, shuffle, 8, &t))
			break;
	print_message("%s%s: completions 1..%llu rewritten; fired in spill %llu, direct gather %llu, "
		      "restore %llu; failed calls %llu, %llu, %llu\n",
		      kind_name[kind], shuffle ? " (shuffled)" : "", (unsigned long long)(n - 1),
		      (unsigned long long)t.fired[S_SPILL], (unsigned long long)t.fired[S_GATHER],
		      (unsigned long long)t.fired[S_RESTORE], (unsigned long long)t.failed[S_SPILL],
		      (unsigned long long)t.failed[S_GATHER], (unsigned long long)t.failed[S_RESTORE]);
	T_CHECK(t.fired[S_SPILL] >= SPILL_BLOCKS && t.fired[S_GATHER] >= SPILL_BLOCKS * CHUNKS_PER_BLOCK &&
			t.fired[S_RESTORE] >= SPILL_BLOCKS && t.fired[S_GATHER_HOST] == 0,
		"%s: rewrites reached spill %llu times (wanted >= %d), direct gather %llu (wanted >= "
		"%d), restore %llu (wanted >= %d), gather from the host %llu (wanted 0)",
		kind_name[kind], (unsigned long long)t.fired[S_SPILL], SPILL_BLOCKS,
		(unsigned long long)t.fired[S_GATHER], SPILL_BLOCKS * CHUNKS_PER_BLOCK, (unsigned long long)t.fired[S_RESTORE],
		SPILL_BLOCKS, (unsigned long long)t.fired[S_GATHER_HOST]);
	if (kind_rc[kind] != 0)
		T_CHECK(t.failed[S_SPILL] == t.fired[S_SPILL] && t.failed[S_GATHER] == t.fired[S_GATHER] &&
				t.failed[S_RESTORE] == t.fired[S_RESTORE],
			"%s: every rewrite should fail its call", kind_name[kind]);
}

static void test_fail_eio(void **state)
{
	(void)state;
	fail_each(K_EIO, 0);
}

static void test_fail_eagain(void **state)
{
	(void)state;
	fail_each(K_EAGAIN, 0);
}

static void test_fail_ecanceled(void **state)
{
	(void)state;
	fail_each(K_ECANCELED, 0);
}

static void test_fail_enospc(void **state)
{
	(void)state;
	fail_each(K_ENOSPC, 0);
}

static void test_fail_short(void **state)
{
	(void)state;
	fail_each(K_SHORT, 0);
}

static void test_fail_zero(void **state)
{
	(void)state;
	fail_each(K_ZERO, 0);
}

/* Completions in seeded random order: the same bytes, and errors handled the same way. Queue
 * depths 8, 32 and 1024 (2048 bounce slots of 68 KiB, each holding one of these blocks: 64 KiB of
 * rows and the header), where hundreds of reads complete in one reap and are shuffled together. */
static void test_shuffled(void **state)
{
	(void)state;
	struct tally t;
	memset(&t, 0, sizeof t);
	for (uint64_t seed = 1; seed <= 6; seed++)
		script("shuffled completions", K_EIO, 0, 0x5eed0000u + seed,
		       seed % 3 == 0 ? 1024 : seed % 2 ? 8 : 32, &t);
	print_message("shuffled: %llu of %llu completions handled out of submission order\n",
		      (unsigned long long)t.reordered, (unsigned long long)t.ios);
	T_CHECK(t.reordered > 0, "shuffled: no completion was reordered (%llu I/Os)",
		(unsigned long long)t.ios);
	fail_each(K_EIO, 0x5eed1234u);
}

/*
 * An LRU spill that makes room for a prefill meets the fault: sequence A (8 host blocks) and B share
 * a host tier of 12 blocks, so B's second layer needs A's 4 full blocks spilled first. Each
 * completion of that spill is rewritten in turn: the prefill returns the I/O error and changes
 * nothing (B's layer empty, A whole on the host, no NVMe space held), and its retry succeeds.
 */
static void test_auto_spill_faults(void **state)
{
	(void)state;
	for (int kind = 0; kind < K_KINDS; kind++) {
		uint64_t n = 1, failed = 0;
		for (; n < 1000; n++) {
			struct run run, *r = &run;
			char name[160];
			snprintf(name, sizeof name, "auto spill in a prefill: %s at completion %llu",
				 kind_name[kind], (unsigned long long)n);
			int64_t live = kvt_mem_live();
			int fds = t_fd_count();
			run_open_cfg(r, name, 8, 12 * BLOCK_BYTES, KVT_SPILL_LRU);
			uint32_t b = 0;
			T_CHECK(kvt_seq_open(r->c, &b) == 0, "%s: seq_open", name);
			int rc = prefill_layer(r, b, 0, &g_k2, &g_v2);
			T_CHECK(rc == 0 && on_nvme(r) == 0, "%s: prefill of B's layer 0 got %d (%s), %u "
				"blocks of A on NVMe (wanted 0)", name, rc, kvt_last_error(r->c), on_nvme(r));
			struct hook_state h = {.n = n, .kind = (enum kind)kind};
			kvt_nvme_set_cqe_hook(r->c->nvme, hook, &h);
			kvt_stats a = t_stats(r->c);
			rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
			kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
			int want = h.fired ? kind_rc[kind] : 0;
			if (h.fired && h.orig < 0)
				want = h.orig;
			if (want == 0) {
				T_CHECK(rc == 0, "%s: prefill got %d (%s: %s), wanted 0", name, rc,
					kvt_strerror(rc), kvt_last_error(r->c));
			} else {
				T_CHECK(rc == want, "%s: prefill got %d (%s: %s), wanted %d", name, rc,
					kvt_strerror(rc), kvt_last_error(r->c), want);
				failed++;
				kvt_stats f = t_stats(r->c);
				int64_t len = kvt_seq_length(r->c, b, 1);
				T_CHECK(len == 0 && f.host_bytes_used == a.host_bytes_used &&
						f.tokens == a.tokens && f.nvme_bytes_used == 0 &&
						f.auto_spills == 0 && on_nvme(r) == 0 &&
						f.errors == a.errors + 1,
					"%s: the failed prefill changed: B layer 1 length %lld (wanted 0), "
					"host_bytes_used %llu -> %llu, tokens %llu -> %llu, nvme_bytes_used "
					"%llu, auto_spills %llu, A's blocks on NVMe %u (wanted 0 0 0), "
					"errors %llu -> %llu (wanted +1: one failed call)", name,
					(long long)len, (unsigned long long)a.host_bytes_used,
					(unsigned long long)f.host_bytes_used, (unsigned long long)a.tokens,
					(unsigned long long)f.tokens, (unsigned long long)f.nvme_bytes_used,
					(unsigned long long)f.auto_spills, on_nvme(r),
					(unsigned long long)a.errors, (unsigned long long)f.errors);
				check_all_layers(r, "A after the failed auto spill (host copy)");
				rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
				T_CHECK(rc == 0, "%s: retried prefill got %d (%s)", name, rc,
					kvt_last_error(r->c));
			}
			kvt_stats f = t_stats(r->c);
			T_CHECK(f.auto_spills == 1 && on_nvme(r) == SPILL_BLOCKS,
				"%s: after the prefill auto_spills %llu (wanted 1), A's blocks on NVMe %u "
				"(wanted %d)", name, (unsigned long long)f.auto_spills, on_nvme(r),
				SPILL_BLOCKS);
			check_a_spilled_then_b(r, b);
			kvt_cache_destroy(r->c);
			TT_CHECK_RELEASED(name, live, fds);
			if (!h.fired)
				break;
		}
		print_message("auto spill, %s: completions 1..%llu of the spill rewritten, %llu "
			      "prefills failed\n", kind_name[kind], (unsigned long long)(n - 1),
			      (unsigned long long)failed);
		T_CHECK(n - 1 >= SPILL_BLOCKS, "auto spill, %s: %llu completions, wanted >= %d",
			kind_name[kind], (unsigned long long)(n - 1), SPILL_BLOCKS);
		T_CHECK(kind_rc[kind] == 0 ? failed == 0 : failed == n - 1,
			"auto spill, %s: %llu of %llu rewrites failed the prefill", kind_name[kind],
			(unsigned long long)failed, (unsigned long long)(n - 1));
	}
}

static int setup(void **state)
{
	(void)state;
	tt_skip_unless_available();
	make_data(0x7a17f001u);
	return 0;
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_fail_eio),      cmocka_unit_test(test_fail_eagain),
		cmocka_unit_test(test_fail_ecanceled), cmocka_unit_test(test_fail_enospc),
		cmocka_unit_test(test_fail_short),    cmocka_unit_test(test_fail_zero),
		cmocka_unit_test(test_shuffled),     cmocka_unit_test(test_auto_spill_faults),
		cmocka_unit_test(test_alloc_faults),   cmocka_unit_test(test_auto_spill_alloc_faults),
		cmocka_unit_test(test_lru_failed_call_unspills),
		cmocka_unit_test(test_lru_undo_read_fails),
		cmocka_unit_test(test_lru_no_room_spills_nothing),
	};
	return cmocka_run_group_tests(tests, setup, NULL);
}
