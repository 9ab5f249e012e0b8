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
 * (test_alloc_faults: store open, block cache, spill, the row reads of direct serving, restore).
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "common.h"

#include "tier_util.h"

enum { D = 64, LAYERS = 2, NKV = 2, NQ = 4, TOKENS = 300, FIRST = 180, SPILL_BLOCKS = LAYERS * NKV };
/* 4 KiB chunks of one block: the least number of direct-serving reads of the script */
#define CHUNKS_PER_BLOCK (KVT_BLOCK_TOKENS * 2 * D * 2 / KVT_NVME_CHUNK)
#define ROW_BYTES ((uint64_t)2 * D * 2)
#define BLOCK_BYTES ((uint64_t)KVT_BLOCK_TOKENS * ROW_BYTES)
#define DUE ((int64_t)SPILL_BLOCKS * (int64_t)BLOCK_BYTES)

/* The rows given, [TOKENS, NKV, D] per layer, and gather buffers. */
typedef uint16_t rows_t[LAYERS][TOKENS * NKV * D];
static rows_t g_k, g_v, g_k2, g_v2; /* two sequences' rows */
static uint16_t g_gk[NKV * TOKENS * D], g_gv[NKV * TOKENS * D], g_q[NQ * D];
static int32_t g_counts[NKV], g_pos[NKV * TOKENS];

static void make_data(uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	for (int l = 0; l < LAYERS; l++) {
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.3, 1.0, g_k[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, -0.2, 1.0, g_v[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.1, 1.5, g_k2[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.2, 0.5, g_v2[l], NULL);
	}
	t_fill(&r, KVT_DTYPE_F16, NQ * D, 0, 1, g_q, NULL);
}

/* The rewrites of a completion's result. */
enum kind { K_EIO, K_EAGAIN, K_ECANCELED, K_ENOSPC, K_SHORT, K_ZERO, K_KINDS };
static const char *const kind_name[K_KINDS] = {"-EIO", "-EAGAIN", "-ECANCELED", "-ENOSPC",
					       "short count", "zero bytes"};
/* What the call meeting the rewrite returns (nvme_store.h): 0 where the store recovers. */
static const int kind_rc[K_KINDS] = {-EIO, 0, -ECANCELED, -ENOSPC, 0, -EIO};

struct hook_state {
	uint64_t n;      /* the completion to rewrite */
	enum kind kind;
	int fired, orig; /* whether it was reached, and the result it replaced */
};

static int hook(void *ctx, uint64_t nth, int res)
{
	struct hook_state *h = (struct hook_state *)ctx;
	if (nth != h->n || h->fired)
		return res;
	h->fired = 1;
	h->orig = res;
	if (res < 0)
		return res; /* a real error: leave it */
	switch (h->kind) {
	case K_EIO: return -EIO;
	case K_EAGAIN: return -EAGAIN;
	case K_ECANCELED: return -ECANCELED;
	case K_ENOSPC: return -ENOSPC;
	case K_SHORT: return res > 1 ? res / 2 : res;
	case K_ZERO: return 0;
	default: return res;
	}
}

/* One run: the cache, its sequence, and the case's name for messages. */
struct run {
	char name[160];
	kvt_cache *c;
	uint32_t seq;          /* the sequence checked */
	rows_t *sk, *sv;       /* its rows */
	tt_files f;
};

static int prefill_layer(struct run *r, uint32_t seq, int l, rows_t *k, rows_t *v)
{
	int rc = kvt_prefill(r->c, seq, (uint32_t)l, NULL, (*k)[l], (*v)[l], FIRST, NULL);
	if (rc == 0)
		rc = kvt_prefill(r->c, seq, (uint32_t)l, NULL, (*k)[l] + FIRST * NKV * D,
				 (*v)[l] + FIRST * NKV * D, TOKENS - FIRST, NULL);
	return rc;
}

/* A fresh cache with one sequence of TOKENS tokens on every layer. */
static void run_open_cfg(struct run *r, const char *name, uint32_t qd, uint64_t host_bytes,
			 uint32_t policy)
{
	memset(r, 0, sizeof *r);
	snprintf(r->name, sizeof r->name, "%s", name);
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_queue_depth = qd;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	cfg.host_bytes = host_bytes;
	cfg.spill_policy = policy;
	tt_make_files(&r->f, 2, (uint64_t)4 << 20);
	cfg.n_nvme = 2;
	cfg.nvme_paths = r->f.ptrs;
	cfg.nvme_bytes = r->f.bytes;
	int rc = kvt_cache_create(&cfg, &r->c);
	tt_unlink(&r->f);
	T_CHECK(rc == 0, "%s: kvt_cache_create got %d (%s: %s)", r->name, rc, kvt_strerror(rc),
		kvt_last_error(NULL));
	T_CHECK(kvt_seq_open(r->c, &r->seq) == 0, "%s: seq_open", r->name);
	r->sk = &g_k;
	r->sv = &g_v;
	for (int l = 0; l < LAYERS; l++) {
		rc = prefill_layer(r, r->seq, l, &g_k, &g_v);
		T_CHECK(rc == 0, "%s: prefill layer %d got %d (%s)", r->name, l, rc,
			kvt_last_error(r->c));
	}
}

static void run_open(struct run *r, const char *name, uint32_t qd)
{
	run_open_cfg(r, name, qd, (uint64_t)64 << 20, KVT_SPILL_NONE);
}

/* Blocks of the sequence whose valid copy is on NVMe (the cache's table). */
static uint32_t on_nvme(const struct run *r)
{
	uint32_t n = 0;
	for (int l = 0; l < LAYERS; l++) {
		const struct kvt_layer *L = &r->c->seqs[r->seq].layers[l];
		for (uint32_t h = 0; h < NKV; h++)
			for (uint32_t b = 0; b < L->n_blocks; b++) {
				size_t at = (size_t)h * L->blk_cap + b;
				if (L->blocks[at])
					continue;
				T_CHECK(L->spill && L->spill[at].loc.bytes,
					"%s: layer %d head %u block %u has neither a host block nor an "
					"NVMe location", r->name, l, h, b);
				n++;
			}
	}
	return n;
}

static int do_select(struct run *r, int l)
{
	int rc = kvt_select(r->c, (uint32_t)l, 1, &r->seq, g_q, NULL);
	T_CHECK(rc == TOKENS, "%s: select layer %d got %d (%s), wanted %d", r->name, l, rc,
		rc < 0 ? kvt_last_error(r->c) : "tokens", TOKENS);
	return rc;
}

static int do_gather(struct run *r, int l)
{
	memset(g_gk, 0xa5, sizeof g_gk);
	memset(g_gv, 0x5a, sizeof g_gv);
	return kvt_gather(r->c, (uint32_t)l, 1, &r->seq, TOKENS, g_counts, g_pos, g_gk, g_gv, NULL);
}

/* The gathered rows of layer l are every position, byte for byte the rows given. */
static void expect_rows(struct run *r, int l, int rc, const char *what)
{
	T_CHECK(rc == TOKENS * NKV, "%s %s: gather layer %d got %d (%s), wanted %d", r->name, what, l,
		rc, rc < 0 ? kvt_last_error(r->c) : "tokens", TOKENS * NKV);
	for (uint32_t h = 0; h < NKV; h++) {
		T_CHECK(g_counts[h] == TOKENS, "%s %s layer %d head %u: count %d", r->name, what, l, h,
			g_counts[h]);
		for (uint32_t t = 0; t < TOKENS; t++) {
			const uint16_t *gk = g_gk + ((size_t)h * TOKENS + t) * D;
			const uint16_t *gv = g_gv + ((size_t)h * TOKENS + t) * D;
			const uint16_t *wk = (*r->sk)[l] + ((size_t)t * NKV + h) * D;
			const uint16_t *wv = (*r->sv)[l] + ((size_t)t * NKV + h) * D;
			if (g_pos[h * TOKENS + t] == (int32_t)t && memcmp(gk, wk, 2 * D) == 0 &&
			    memcmp(gv, wv, 2 * D) == 0)
				continue;
			T_CHECK(0, "%s %s layer %d head %u token %u: position %d, K[0] got 0x%04x V[0] "
				"0x%04x, wanted 0x%04x 0x%04x (garbage or unverified rows)", r->name, what,
				l, h, t, g_pos[h * TOKENS + t], gk[0], gv[0], wk[0], wv[0]);
		}
	}
}

static void check_all_layers(struct run *r, const char *what)
{
	for (int l = 0; l < LAYERS; l++) {
		do_select(r, l);
		expect_rows(r, l, do_gather(r, l), what);
	}
}

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
	int fds = tt_fd_count();
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
	T_CHECK(tt_fd_count() == fds, "%s: open descriptors got %d after destroy, wanted %d", name,
		tt_fd_count(), fds);
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

/* Completions in seeded random order: the same bytes, and errors handled the same way. */
static void test_shuffled(void **state)
{
	(void)state;
	struct tally t;
	memset(&t, 0, sizeof t);
	for (uint64_t seed = 1; seed <= 6; seed++)
		script("shuffled completions", K_EIO, 0, 0x5eed0000u + seed, seed % 2 ? 8 : 32, &t);
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
			int fds = tt_fd_count();
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
						f.auto_spills == 0 && on_nvme(r) == 0,
					"%s: the failed prefill changed: B layer 1 length %lld (wanted 0), "
					"host_bytes_used %llu -> %llu, tokens %llu -> %llu, nvme_bytes_used "
					"%llu, auto_spills %llu, A's blocks on NVMe %u (wanted 0 0 0)", name,
					(long long)len, (unsigned long long)a.host_bytes_used,
					(unsigned long long)f.host_bytes_used, (unsigned long long)a.tokens,
					(unsigned long long)f.tokens, (unsigned long long)f.nvme_bytes_used,
					(unsigned long long)f.auto_spills, on_nvme(r));
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
			check_all_layers(r, "A spilled by LRU (direct serving)");
			r->seq = b;
			r->sk = &g_k2;
			r->sv = &g_v2;
			check_all_layers(r, "B");
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

/* What a call that failed for want of memory must leave as it was. */
struct tier_state {
	uint64_t host_used, nvme_used, tokens;
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
		if ((r)->c)                                                                         \
			tier_observe((r), &b_);                                                     \
		int64_t rc_ = (expr);                                                               \
		if (rc_ == -ENOMEM) {                                                               \
			(a)->enomem++;                                                              \
			(a)->fired |= kvt_mem_fired();                                              \
			kvt_mem_fail_at(0);                                                         \
			if ((r)->c) {                                                               \
				tier_observe((r), &f_);                                             \
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
	memset(r, 0, sizeof *r);
	snprintf(r->name, sizeof r->name, "allocation %llu", (unsigned long long)a->n);
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_queue_depth = 8;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	cfg.host_bytes = (uint64_t)64 << 20;
	tt_make_files(&r->f, 2, (uint64_t)4 << 20);
	cfg.n_nvme = 2;
	cfg.nvme_paths = r->f.ptrs;
	cfg.nvme_bytes = r->f.bytes;
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
	int fds = tt_fd_count();
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
static void test_alloc_faults(void **state)
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
static void test_auto_spill_alloc_faults(void **state)
{
	(void)state;
	uint64_t n = 1, failed = 0;
	for (; n < 1000; n++) {
		struct run run, *r = &run;
		char name[160];
		snprintf(name, sizeof name, "auto spill in a prefill: allocation %llu failed",
			 (unsigned long long)n);
		int64_t live = kvt_mem_live();
		int fds = tt_fd_count();
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
			T_CHECK(len == 0 && f.tokens == a.tokens, "%s: the failed prefill changed B: layer 1 "
				"length %lld (wanted 0), tokens %llu -> %llu", name, (long long)len,
				(unsigned long long)a.tokens, (unsigned long long)f.tokens);
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
		check_all_layers(r, "A spilled by LRU (direct serving)");
		r->seq = b;
		r->sk = &g_k2;
		r->sv = &g_v2;
		check_all_layers(r, "B");
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

/*
 * Two victims: sequences A and C hold layer 0 only (4 blocks each, 2 of them spillable), B layer 0,
 * in a host tier of 12 blocks; B's layer 1 needs 4 blocks, so the LRU spills A, then C. Each
 * completion of those spills fails in turn (-EIO): the prefill returns -EIO, and afterwards A and C
 * are both on the host again (a fault in C's spill reads A back), the NVMe bytes and the spill
 * counters are as before, and their rows read back byte for byte. The retry spills both.
 */
static void test_lru_failed_call_unspills(void **state)
{
	(void)state;
	uint64_t n = 1, failed = 0;
	for (; n < 1000; n++) {
		struct run run, *r = &run;
		char name[160];
		snprintf(name, sizeof name, "two LRU victims, -EIO at completion %llu",
			 (unsigned long long)n);
		int64_t live = kvt_mem_live();
		int fds = tt_fd_count();
		memset(r, 0, sizeof *r);
		snprintf(r->name, sizeof r->name, "%s", name);
		kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
		cfg.p = 1.0f;
		cfg.nvme_queue_depth = 8;
		cfg.nvme_cache_bytes = (uint64_t)1 << 20;
		cfg.host_bytes = 12 * BLOCK_BYTES;
		cfg.spill_policy = KVT_SPILL_LRU;
		tt_make_files(&r->f, 2, (uint64_t)4 << 20);
		cfg.n_nvme = 2;
		cfg.nvme_paths = r->f.ptrs;
		cfg.nvme_bytes = r->f.bytes;
		int rc = kvt_cache_create(&cfg, &r->c);
		tt_unlink(&r->f);
		T_CHECK(rc == 0, "%s: create got %d (%s)", name, rc, kvt_last_error(NULL));
		uint32_t a = 0, cs = 0, b = 0;
		T_CHECK(kvt_seq_open(r->c, &a) == 0 && kvt_seq_open(r->c, &cs) == 0 &&
				kvt_seq_open(r->c, &b) == 0, "%s: seq_open", name);
		T_CHECK(kvt_prefill(r->c, a, 0, NULL, g_k[0], g_v[0], TOKENS, NULL) == 0 &&
				kvt_prefill(r->c, cs, 0, NULL, g_k2[0], g_v2[0], TOKENS, NULL) == 0 &&
				kvt_prefill(r->c, b, 0, NULL, g_k2[0], g_v2[0], TOKENS, NULL) == 0,
			"%s: prefills of layer 0 (%s)", name, kvt_last_error(r->c));
		struct hook_state h = {.n = n, .kind = K_EIO};
		kvt_nvme_set_cqe_hook(r->c->nvme, hook, &h);
		kvt_stats st0 = t_stats(r->c);
		rc = kvt_prefill(r->c, b, 1, NULL, g_k2[1], g_v2[1], TOKENS, NULL);
		kvt_nvme_set_cqe_hook(r->c->nvme, NULL, NULL);
		if (rc) {
			T_CHECK(rc == -EIO, "%s: prefill got %d (%s), wanted -EIO", name, rc,
				kvt_last_error(r->c));
			failed++;
			kvt_stats st = t_stats(r->c);
			T_CHECK(seq_on_nvme(r, a) == 0 && seq_on_nvme(r, cs) == 0 &&
					st.spills == st0.spills && st.auto_spills == st0.auto_spills &&
					st.nvme_bytes_used == st0.nvme_bytes_used &&
					st.host_bytes_used == st0.host_bytes_used,
				"%s: the failed prefill left: A's blocks on NVMe %u, C's %u (wanted 0 0), "
				"spills %llu -> %llu, auto_spills %llu -> %llu, nvme_bytes_used %llu -> "
				"%llu, host_bytes_used %llu -> %llu (wanted unchanged)", name,
				seq_on_nvme(r, a), seq_on_nvme(r, cs), (unsigned long long)st0.spills,
				(unsigned long long)st.spills, (unsigned long long)st0.auto_spills,
				(unsigned long long)st.auto_spills, (unsigned long long)st0.nvme_bytes_used,
				(unsigned long long)st.nvme_bytes_used,
				(unsigned long long)st0.host_bytes_used,
				(unsigned long long)st.host_bytes_used);
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

/*
 * Checked before spilling: A (layer 0, 2 spillable blocks) and B (a 180-token layer 0, nothing
 * spillable) in a host tier of 7 blocks leave 1 free; B's 300-token layer 1 needs 4, and spilling A
 * would free only 2 more. The prefill returns -ENOSPC, naming the bytes, and spills nothing.
 */
static void test_lru_no_room_spills_nothing(void **state)
{
	(void)state;
	struct run run, *r = &run;
	int64_t live = kvt_mem_live();
	int fds = tt_fd_count();
	memset(r, 0, sizeof *r);
	snprintf(r->name, sizeof r->name, "LRU without enough to spill");
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	cfg.host_bytes = 7 * BLOCK_BYTES;
	cfg.spill_policy = KVT_SPILL_LRU;
	tt_make_files(&r->f, 2, (uint64_t)4 << 20);
	cfg.n_nvme = 2;
	cfg.nvme_paths = r->f.ptrs;
	cfg.nvme_bytes = r->f.bytes;
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
			st.auto_spills == st0.auto_spills && st.nvme_bytes_used == 0,
		"%s: prefill got %d (%s), A's blocks on NVMe %u, spills %llu -> %llu, auto_spills "
		"%llu -> %llu, nvme_bytes_used %llu; wanted -ENOSPC, 0, unchanged, 0", r->name, rc,
		kvt_last_error(r->c), seq_on_nvme(r, a), (unsigned long long)st0.spills,
		(unsigned long long)st.spills, (unsigned long long)st0.auto_spills,
		(unsigned long long)st.auto_spills, (unsigned long long)st.nvme_bytes_used);
	check_layer0(r, a, &g_k, &g_v, "A after the refused prefill");
	kvt_cache_destroy(r->c);
	TT_CHECK_RELEASED(r->name, live, fds);
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
		cmocka_unit_test(test_lru_no_room_spills_nothing),
	};
	return cmocka_run_group_tests(tests, setup, NULL);
}
