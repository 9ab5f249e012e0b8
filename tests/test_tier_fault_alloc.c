/* SPDX-License-Identifier: MIT */
/*
 * The NVMe tier's allocation faults and the LRU undo (suite fault; part of test_tier_fault, whose
 * main runs these): the script with the N-th allocation failed (store open, block cache, spill, the
 * row reads of direct serving, restore), automatic spills under failing allocations, and a call
 * that fails under KVT_SPILL_LRU giving back what it spilled (issue 11, defect 3).
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_fault.h"

/* What a call that failed for want of memory must leave as it was (errors: one more). */
struct tier_state {
	uint64_t host_used, nvme_used, tokens, errors;
	uint32_t on_nvme;
};

static void tier_observe(struct run *r, struct tier_state *o)
{
	kvt_stats st = t_stats(r->c);
	uint32_t spilled = r->c->seqs[r->seq].open ? on_nvme(r) : 0;
	memset(o, 0, sizeof *o); /* the padding too: states are compared with memcmp */
	o->host_used = st.host_bytes_used;
	o->nvme_used = st.nvme_bytes_used;
	o->tokens = st.tokens;
	o->errors = st.errors;
	o->on_nvme = spilled;
}

/* One run of the allocation-fault loop: the allocation failed, and what it met. */
struct afail {
	uint64_t n;
	int fired;  /* the injected failure fired (returned as -ENOMEM or absorbed) */
	int enomem; /* calls that returned -ENOMEM */
};

/*
 * Run a call with injection on, its result into rc; on -ENOMEM check that the state is unchanged,
 * turn injection off and run it again.
 */
#define UNDER_FAULT(r, a, what, rc, expr)                                                           \
	do {                                                                                        \
		struct tier_state b_, f_;                                                           \
		const bool had_ = (r)->c != NULL;                                                   \
		if (had_)                                                                           \
			tier_observe((r), &b_);                                                     \
		int64_t rc_ = (expr);                                                               \
		if (rc_ >= 0 && had_) {                                                             \
			tier_observe((r), &f_);                                                     \
			T_CHECK(f_.errors == b_.errors, "N=%llu %s: succeeded but counted %llu "     \
				"errors in kvt_stats.errors (%s)", (unsigned long long)(a)->n, what, \
				(unsigned long long)(f_.errors - b_.errors), kvt_last_error((r)->c));\
		}                                                                                   \
		if (rc_ == -ENOMEM) {                                                               \
			(a)->enomem++;                                                              \
			(a)->fired |= kvt_mem_fired();                                              \
			kvt_mem_fail_at(0);                                                         \
			if (had_) {                                                                 \
				tier_observe((r), &f_);                                             \
				T_CHECK(f_.errors == b_.errors + 1, "N=%llu %s: one failed call "    \
					"counted %llu times in kvt_stats.errors (%s)",               \
					(unsigned long long)(a)->n, what,                            \
					(unsigned long long)(f_.errors - b_.errors),                 \
					kvt_last_error((r)->c));                                     \
				f_.errors = b_.errors;                                              \
				T_CHECK(memcmp(&b_, &f_, sizeof b_) == 0,                           \
					"N=%llu %s: -ENOMEM (%s) changed host bytes %llu -> %llu, "  \
					"NVMe bytes %llu -> %llu, blocks on NVMe %u -> %u",           \
					(unsigned long long)(a)->n, what, kvt_last_error((r)->c),    \
					(unsigned long long)b_.host_used,                            \
					(unsigned long long)f_.host_used,                            \
					(unsigned long long)b_.nvme_used,                            \
					(unsigned long long)f_.nvme_used, b_.on_nvme, f_.on_nvme);   \
			}                                                                           \
			rc_ = (expr);                                                               \
		}                                                                                   \
		(rc) = rc_;                                                                         \
	} while (0)

/* The create of run_open_cfg under injection: -ENOMEM is retried, anything else fails the test. */
static void afail_create(struct run *r, struct afail *a)
{
	char name[64];
	snprintf(name, sizeof name, "allocation %llu", (unsigned long long)a->n);
	const kvt_config cfg = run_config(r, name, 8, (uint64_t)64 << 20, KVT_SPILL_NONE);
	int64_t rc;
	UNDER_FAULT(r, a, "create", rc, kvt_cache_create(&cfg, &r->c));
	tt_unlink(&r->f);
	T_CHECK(rc == 0, "%s: create got %lld (%s), wanted 0 or -ENOMEM then 0", r->name,
		(long long)rc, kvt_last_error(NULL));
	UNDER_FAULT(r, a, "seq_open", rc, kvt_seq_open(r->c, &r->seq));
	T_CHECK(rc == 0, "%s: seq_open got %lld (%s)", r->name, (long long)rc, kvt_last_error(r->c));
	r->sk = &g_k;
	r->sv = &g_v;
}

/* Select and gather every layer under injection; the rows must be the rows given. */
static void afail_gather_all(struct run *r, struct afail *a, const char *what)
{
	for (int l = 0; l < LAYERS; l++) {
		int64_t rc;
		UNDER_FAULT(r, a, "select", rc, kvt_select(r->c, (uint32_t)l, 1, &r->seq, g_q, NULL));
		T_CHECK(rc == TOKENS, "%s %s: select layer %d got %lld (%s)", r->name, what, l,
			(long long)rc, kvt_last_error(r->c));
		UNDER_FAULT(r, a, what, rc, do_gather(r, l));
		expect_rows(r, l, (int)rc, what);
	}
}

/* One run of the script with the n-th allocation failing; returns whether it fired. */
static int afail_script(struct afail *a)
{
	struct run run, *r = &run;
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	kvt_mem_fail_at(a->n);
	afail_create(r, a);
	int64_t rc;
	for (int l = 0; l < LAYERS; l++) {
		/* the two chunks of prefill_layer, each a call of its own */
		UNDER_FAULT(r, a, "prefill", rc,
			    kvt_prefill(r->c, r->seq, (uint32_t)l, NULL, g_k[l], g_v[l], FIRST, NULL));
		T_CHECK(rc == 0, "%s: prefill layer %d got %lld (%s)", r->name, l, (long long)rc,
			kvt_last_error(r->c));
		UNDER_FAULT(r, a, "prefill", rc,
			    kvt_prefill(r->c, r->seq, (uint32_t)l, NULL, g_k[l] + FIRST * NKV * D,
					g_v[l] + FIRST * NKV * D, TOKENS - FIRST, NULL));
		T_CHECK(rc == 0, "%s: prefill layer %d got %lld (%s)", r->name, l, (long long)rc,
			kvt_last_error(r->c));
	}
	UNDER_FAULT(r, a, "spill", rc, kvt_seq_spill(r->c, r->seq));
	T_CHECK(rc == DUE && on_nvme(r) == SPILL_BLOCKS, "%s: spill got %lld (%s), %u blocks on NVMe; "
		"wanted %lld, %d", r->name, (long long)rc, kvt_last_error(r->c), on_nvme(r),
		(long long)DUE, SPILL_BLOCKS);
	afail_gather_all(r, a, "direct gather");
	UNDER_FAULT(r, a, "restore", rc, kvt_seq_restore(r->c, r->seq));
	T_CHECK(rc == DUE && on_nvme(r) == 0, "%s: restore got %lld (%s), %u blocks on NVMe; wanted "
		"%lld, 0", r->name, (long long)rc, kvt_last_error(r->c), on_nvme(r), (long long)DUE);
	afail_gather_all(r, a, "gather after restore");
	kvt_cache_destroy(r->c);
	a->fired |= kvt_mem_fired();
	kvt_mem_fail_at(0);
	TT_CHECK_RELEASED(r->name, live, fds);
	return a->fired;
}

/*
 * Allocation failures through the NVMe tier: for N = 1, 2, ... the N-th allocation of the script
 *     create (store open: files, ring, bounce pool, free lists; block cache) -> prefill -> spill
 *     -> direct gather of every layer (row reads: header prefetch, header cache) -> restore
 *     -> gather of every layer
 * fails, until a run no longer reaches it. Every call succeeds or returns -ENOMEM, and a failed
 * call changes nothing and succeeds when retried without the fault; a failure the store absorbs
 * (the header prefetch and the header cache are optimizations) still delivers the right rows.
 * The rows gathered are the rows given, byte for byte; nothing leaks.
 */
void test_alloc_faults(void **state)
{
	(void)state;
	struct afail a = {0};
	uint64_t runs = 0, enomem = 0, absorbed = 0;
	for (a.n = 1; a.n < 100000; a.n++) {
		int e0 = a.enomem = 0;
		a.fired = 0;
		if (!afail_script(&a))
			break;
		runs++;
		enomem += a.enomem > e0;
		absorbed += a.enomem == 0;
	}
	print_message("tier allocation faults: allocations 1..%llu failed in turn, %llu returned "
		      "-ENOMEM (and succeeded on retry), %llu absorbed\n",
		      (unsigned long long)runs, (unsigned long long)enomem,
		      (unsigned long long)absorbed);
	T_CHECK(runs >= 40 && absorbed > 0,
		"allocations failed got %llu (wanted >= 40), absorbed %llu (wanted > 0: the header "
		"cache and prefetch)", (unsigned long long)runs, (unsigned long long)absorbed);
}

/*
 * Allocation failures inside an automatic spill: as test_auto_spill_faults, B's second layer needs
 * A's blocks spilled first, but now the N-th allocation of that prefill fails (spill tables, block
 * lists, the store's free lists, B's own index and blocks). The prefill returns -ENOMEM with B's
 * layer unchanged and A on the host (a spill done before the failure is read back, the spill
 * counters as before), or succeeds; A reads back byte for byte; the retry succeeds; nothing leaks.
 */
void test_auto_spill_alloc_faults(void **state)
{
	(void)state;
	uint64_t n = 1, failed = 0;
	for (; n < 1000; n++) {
		struct run run, *r = &run;
		char name[160];
		snprintf(name, sizeof name, "auto spill in a prefill: allocation %llu failed",
			 (unsigned long long)n);
		int64_t live = kvt_mem_live();
		int fds = t_fd_count();
		run_open_cfg(r, name, 8, 12 * BLOCK_BYTES, KVT_SPILL_LRU);
		uint32_t b = 0;
		T_CHECK(kvt_seq_open(r->c, &b) == 0, "%s: seq_open", name);
		int rc = prefill_layer(r, b, 0, &g_k2, &g_v2);
		T_CHECK(rc == 0, "%s: prefill of B's layer 0 got %d (%s)", name, rc, kvt_last_error(r->c));
		kvt_stats a = t_stats(r->c);
		kvt_mem_fail_at(n);
		rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		T_CHECK(rc == 0 || rc == -ENOMEM, "%s: prefill got %d (%s), wanted 0 or -ENOMEM", name,
			rc, kvt_last_error(r->c));
		if (rc) {
			failed++;
			kvt_stats f = t_stats(r->c);
			int64_t len = kvt_seq_length(r->c, b, 1);
			T_CHECK(len == 0 && f.tokens == a.tokens && f.errors == a.errors + 1,
				"%s: the failed prefill changed B: layer 1 length %lld (wanted 0), tokens "
				"%llu -> %llu, errors %llu -> %llu (wanted +1: one failed call; \"%s\")",
				name, (long long)len, (unsigned long long)a.tokens,
				(unsigned long long)f.tokens, (unsigned long long)a.errors,
				(unsigned long long)f.errors, kvt_last_error(r->c));
			T_CHECK(on_nvme(r) == 0 && f.spills == a.spills &&
					f.auto_spills == a.auto_spills &&
					f.nvme_bytes_used == a.nvme_bytes_used,
				"%s: the failed prefill left A's blocks on NVMe %u (wanted 0), spills %llu "
				"-> %llu, auto_spills %llu -> %llu, nvme_bytes_used %llu -> %llu (wanted "
				"unchanged)", name, on_nvme(r), (unsigned long long)a.spills,
				(unsigned long long)f.spills, (unsigned long long)a.auto_spills,
				(unsigned long long)f.auto_spills, (unsigned long long)a.nvme_bytes_used,
				(unsigned long long)f.nvme_bytes_used);
			check_all_layers(r, "A after the failed prefill");
			rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
			T_CHECK(rc == 0, "%s: retried prefill got %d (%s)", name, rc, kvt_last_error(r->c));
		}
		T_CHECK(on_nvme(r) == SPILL_BLOCKS, "%s: A's blocks on NVMe %u, wanted %d", name,
			on_nvme(r), SPILL_BLOCKS);
		check_a_spilled_then_b(r, b);
		kvt_cache_destroy(r->c);
		TT_CHECK_RELEASED(name, live, fds);
		if (!fired)
			break;
	}
	print_message("auto spill: allocations 1..%llu of the prefill failed in turn, %llu prefills "
		      "returned -ENOMEM\n", (unsigned long long)(n - 1), (unsigned long long)failed);
	T_CHECK(n - 1 >= 8 && failed > 0, "auto spill: %llu allocations failed (wanted >= 8), %llu "
		"prefills failed (wanted > 0)", (unsigned long long)(n - 1), (unsigned long long)failed);
}

/* ---- a failed call under KVT_SPILL_LRU changes nothing (issue 11, defect 3) ------------------ */

/* Blocks of `seq` on NVMe. */
static uint32_t seq_on_nvme(struct run *r, uint32_t seq)
{
	uint32_t keep = r->seq;
	r->seq = seq;
	uint32_t n = on_nvme(r);
	r->seq = keep;
	return n;
}

/* Layer 0 of `seq` reads back byte for byte the rows `k`, `v` given. */
static void check_layer0(struct run *r, uint32_t seq, rows_t *k, rows_t *v, const char *what)
{
	struct run view = *r;
	view.seq = seq;
	view.sk = k;
	view.sv = v;
	do_select(&view, 0);
	expect_rows(&view, 0, do_gather(&view, 0), what);
}

/* The two-victim script's cache (12 host blocks, KVT_SPILL_LRU) and its sequences: A and C
 * with layer 0 of TOKENS tokens (g_k and g_k2), B with layer 0 of g_k2. */
static void open_three(struct run *r, const char *name, uint32_t *a, uint32_t *cs, uint32_t *b)
{
	const kvt_config cfg = run_config(r, name, 8, 12 * BLOCK_BYTES, KVT_SPILL_LRU);
	int rc = kvt_cache_create(&cfg, &r->c);
	tt_unlink(&r->f);
	T_CHECK(rc == 0, "%s: create got %d (%s)", name, rc, kvt_last_error(NULL));
	T_CHECK(kvt_seq_open(r->c, a) == 0 && kvt_seq_open(r->c, cs) == 0 &&
			kvt_seq_open(r->c, b) == 0, "%s: seq_open", name);
	T_CHECK(kvt_prefill(r->c, *a, 0, NULL, g_k[0], g_v[0], TOKENS, NULL) == 0 &&
			kvt_prefill(r->c, *cs, 0, NULL, g_k2[0], g_v2[0], TOKENS, NULL) == 0 &&
			kvt_prefill(r->c, *b, 0, NULL, g_k2[0], g_v2[0], TOKENS, NULL) == 0,
		"%s: prefills of layer 0 (%s)", name, kvt_last_error(r->c));
}

/*
 * Two victims: sequences A and C hold layer 0 only (4 blocks each, 2 of them spillable), B layer 0,
 * in a host tier of 12 blocks; B's layer 1 needs 4 blocks, so the LRU spills A, then C. Each
 * completion of those spills fails in turn (-EIO): the prefill returns -EIO, and afterwards A and C
 * are both on the host again (a fault in C's spill reads A back), the NVMe bytes and the spill
 * counters are as before, and their rows read back byte for byte. The retry spills both.
 */
void test_lru_failed_call_unspills(void **state)
{
	(void)state;
	uint64_t n = 1, failed = 0;
	for (; n < 1000; n++) {
		struct run run, *r = &run;
		char name[160];
		snprintf(name, sizeof name, "two LRU victims, -EIO at completion %llu",
			 (unsigned long long)n);
		int64_t live = kvt_mem_live();
		int fds = t_fd_count();
		uint32_t a, cs, b;
		open_three(r, name, &a, &cs, &b);
		struct hook_state h = {.n = n, .kind = K_EIO};
		kvt_nvme_set_cqe_hook(r->c->nvme, hook, &h);
		kvt_stats st0 = t_stats(r->c);
		int rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
		kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
		if (rc) {
			T_CHECK(rc == -EIO, "%s: prefill got %d (%s), wanted -EIO", name, rc,
				kvt_last_error(r->c));
			failed++;
			kvt_stats st = t_stats(r->c);
			T_CHECK(seq_on_nvme(r, a) == 0 && seq_on_nvme(r, cs) == 0 &&
					st.spills == st0.spills && st.auto_spills == st0.auto_spills &&
					st.nvme_bytes_used == st0.nvme_bytes_used &&
					st.host_bytes_used == st0.host_bytes_used &&
					st.errors == st0.errors + 1,
				"%s: the failed prefill left: A's blocks on NVMe %u, C's %u (wanted 0 0), "
				"spills %llu -> %llu, auto_spills %llu -> %llu, nvme_bytes_used %llu -> "
				"%llu, host_bytes_used %llu -> %llu (wanted unchanged), errors +%llu "
				"(wanted +1)", name,
				seq_on_nvme(r, a), seq_on_nvme(r, cs), (unsigned long long)st0.spills,
				(unsigned long long)st.spills, (unsigned long long)st0.auto_spills,
				(unsigned long long)st.auto_spills, (unsigned long long)st0.nvme_bytes_used,
				(unsigned long long)st.nvme_bytes_used,
				(unsigned long long)st0.host_bytes_used,
				(unsigned long long)st.host_bytes_used,
				(unsigned long long)(st.errors - st0.errors));
			check_layer0(r, a, &g_k, &g_v, "A after the failed call");
			check_layer0(r, cs, &g_k2, &g_v2, "C after the failed call");
			rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
			T_CHECK(rc == 0, "%s: retried prefill got %d (%s)", name, rc,
				kvt_last_error(r->c));
		}
		kvt_stats st = t_stats(r->c);
		T_CHECK(st.auto_spills == 2 && seq_on_nvme(r, a) == NKV && seq_on_nvme(r, cs) == NKV,
			"%s: after the prefill auto_spills %llu (wanted 2), blocks on NVMe A %u C %u "
			"(wanted %d each)", name, (unsigned long long)st.auto_spills,
			seq_on_nvme(r, a), seq_on_nvme(r, cs), NKV);
		check_layer0(r, a, &g_k, &g_v, "A spilled");
		check_layer0(r, cs, &g_k2, &g_v2, "C spilled");
		kvt_cache_destroy(r->c);
		TT_CHECK_RELEASED(name, live, fds);
		if (!h.fired)
			break;
	}
	print_message("two LRU victims: completions 1..%llu failed in turn, %llu prefills failed "
		      "and changed nothing\n", (unsigned long long)(n - 1), (unsigned long long)failed);
	T_CHECK(failed == n - 1 && failed >= 2 * NKV, "two LRU victims: %llu of %llu faults failed "
		"the prefill, wanted all and >= %d", (unsigned long long)failed,
		(unsigned long long)(n - 1), 2 * NKV);
}

/* A disk that fails every completion from the n-th on (kvt_nvme_set_cqe_hook). */
static int dead_from(void *ctx, uint64_t nth, int res)
{
	struct hook_state *h = (struct hook_state *)ctx;
	if (nth < h->n)
		return res;
	h->fired = 1;
	return res < 0 ? res : -EIO;
}

/*
 * The undo's own failure: the script of test_lru_failed_call_unspills on a disk that dies at
 * completion n. Where it dies during A's spill nothing was spilled; where it dies during C's, the
 * undo cannot read A back either. Then the prefill returns -EIO, counted once, naming both
 * failures; A stays spilled with a valid NVMe copy (and the spill counters count it) and C on the
 * host, and once the disk is back both read back byte for byte and the prefill succeeds.
 */
void test_lru_undo_read_fails(void **state)
{
	(void)state;
	uint64_t n = 1, stayed = 0;
	for (; n < 1000; n++) {
		struct run run, *r = &run;
		char name[160];
		snprintf(name, sizeof name, "two LRU victims, disk dead from completion %llu",
			 (unsigned long long)n);
		int64_t live = kvt_mem_live();
		int fds = t_fd_count();
		uint32_t a, cs, b;
		open_three(r, name, &a, &cs, &b);
		struct hook_state h = {.n = n};
		kvt_nvme_set_cqe_hook(r->c->nvme, dead_from, &h);
		const kvt_stats st0 = t_stats(r->c);
		int rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
		const kvt_stats st = t_stats(r->c);
		kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
		if (!h.fired) {
			T_CHECK(rc == 0, "%s: prefill got %d (%s), wanted 0", name, rc,
				kvt_last_error(r->c));
			kvt_cache_destroy(r->c);
			TT_CHECK_RELEASED(name, live, fds);
			break;
		}
		const char *msg = kvt_last_error(r->c);
		const int undo_failed = strstr(msg, "then reading back seq") != NULL;
		stayed += undo_failed;
		const uint32_t on_a = seq_on_nvme(r, a), on_c = seq_on_nvme(r, cs);
		T_CHECK(rc == -EIO && st.errors == st0.errors + 1 && on_c == 0 &&
				on_a == (undo_failed ? NKV : 0) &&
				kvt_seq_length(r->c, b, 1) == 0,
			"%s: prefill got %d (\"%s\"), errors +%llu, blocks on NVMe A %u C %u, B's "
			"layer 1 length %lld; wanted -EIO, +1, A %d C 0, 0", name, rc, msg,
			(unsigned long long)(st.errors - st0.errors), on_a, on_c,
			(long long)kvt_seq_length(r->c, b, 1), undo_failed ? NKV : 0);
		if (undo_failed)
			T_CHECK(strstr(msg, "automatic spill") && strstr(msg, "stay spilled"),
				"%s: \"%s\" names neither the spill's failure nor A's state", name,
				msg);
		/* the counters count the spill that stays, and only it */
		T_CHECK(st.spills == st0.spills + (uint64_t)undo_failed &&
				st.auto_spills == st0.auto_spills + (uint64_t)undo_failed,
			"%s: spills %llu -> %llu, auto_spills %llu -> %llu, wanted +%d", name,
			(unsigned long long)st0.spills, (unsigned long long)st.spills,
			(unsigned long long)st0.auto_spills, (unsigned long long)st.auto_spills,
			undo_failed);
		check_layer0(r, a, &g_k, &g_v, "A after the failed call (disk back)");
		check_layer0(r, cs, &g_k2, &g_v2, "C after the failed call (disk back)");
		rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
		T_CHECK(rc == 0, "%s: retried prefill got %d (%s)", name, rc, kvt_last_error(r->c));
		check_layer0(r, a, &g_k, &g_v, "A after the retry");
		check_layer0(r, cs, &g_k2, &g_v2, "C after the retry");
		kvt_cache_destroy(r->c);
		TT_CHECK_RELEASED(name, live, fds);
	}
	print_message("two LRU victims, disk dead from completion 1..%llu: in %llu the undo could "
		      "not read A back and left it spilled\n", (unsigned long long)(n - 1),
		      (unsigned long long)stayed);
	T_CHECK(stayed > 0, "the disk died during C's spill in none of %llu runs",
		(unsigned long long)(n - 1));
}

/*
 * Checked before spilling: A (layer 0, 2 spillable blocks) and B (a 180-token layer 0, nothing
 * spillable) in a host tier of 7 blocks leave 1 free; B's 300-token layer 1 needs 4, and spilling A
 * would free only 2 more. The prefill returns -ENOSPC, naming the bytes, and spills nothing.
 */
void test_lru_no_room_spills_nothing(void **state)
{
	(void)state;
	struct run run, *r = &run;
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	const kvt_config cfg =
		run_config(r, "LRU without enough to spill", 0, 7 * BLOCK_BYTES, KVT_SPILL_LRU);
	int rc = kvt_cache_create(&cfg, &r->c);
	tt_unlink(&r->f);
	T_CHECK(rc == 0, "%s: create got %d (%s)", r->name, rc, kvt_last_error(NULL));
	uint32_t a = 0, b = 0;
	T_CHECK(kvt_seq_open(r->c, &a) == 0 && kvt_seq_open(r->c, &b) == 0, "seq_open");
	T_CHECK(kvt_prefill(r->c, a, 0, NULL, g_k[0], g_v[0], TOKENS, NULL) == 0 &&
			kvt_prefill(r->c, b, 0, NULL, g_k2[0], g_v2[0], FIRST, NULL) == 0,
		"%s: prefills of layer 0 (%s)", r->name, kvt_last_error(r->c));
	kvt_stats st0 = t_stats(r->c);
	rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
	kvt_stats st = t_stats(r->c);
	T_CHECK(rc == -ENOSPC && seq_on_nvme(r, a) == 0 && st.spills == st0.spills &&
			st.auto_spills == st0.auto_spills && st.nvme_bytes_used == 0 &&
			st.errors == st0.errors + 1,
		"%s: prefill got %d (%s), A's blocks on NVMe %u, spills %llu -> %llu, auto_spills "
		"%llu -> %llu, nvme_bytes_used %llu, errors +%llu; wanted -ENOSPC, 0, unchanged, 0, "
		"+1", r->name, rc, kvt_last_error(r->c), seq_on_nvme(r, a),
		(unsigned long long)st0.spills, (unsigned long long)st.spills,
		(unsigned long long)st0.auto_spills, (unsigned long long)st.auto_spills,
		(unsigned long long)st.nvme_bytes_used, (unsigned long long)(st.errors - st0.errors));
	check_layer0(r, a, &g_k, &g_v, "A after the refused prefill");
	kvt_cache_destroy(r->c);
	TT_CHECK_RELEASED(r->name, live, fds);
}

