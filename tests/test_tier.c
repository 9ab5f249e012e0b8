/* SPDX-License-Identifier: MIT */
/*
 * The NVMe tier of the cache through the public API (suite nvme), on scratch files of the local disk
 * ($KVT_TEST_DIR, else the current directory):
 *   - round trips of random K/V through kvt_seq_spill, direct serving and kvt_seq_restore, byte for
 *     byte (gather with p = 1) and bit for bit (attention against a mirror cache that never spills),
 *     with decoding going on while a sequence is spilled;
 *   - capacity-driven automatic spills (KVT_SPILL_LRU), and -ENOSPC without them;
 *   - -ENOSPC on spill when the files are full, the host copy intact;
 *   - -EOPNOTSUPP without an NVMe tier, and the configuration errors of the NVMe fields.
 * Corruption, a too-small block cache and stale generations: test_tier_integrity.c; the world both
 * drive: tier_world.h.
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_world.h"

/* qd: the tier's queue depth; slot: the bounce slot size the library must give the store for it,
 * read back from the store's status (0: not checked). Returns the read I/Os of the whole run. */
static uint64_t round_trip(const char *name, uint32_t layers, uint32_t nq, uint32_t nkv,
			   uint32_t d, uint32_t dtype, uint32_t n_files, uint64_t seed, uint32_t qd,
			   uint32_t slot)
{
	enum { NS = 3 };
	static const uint32_t chunks[NS][2] = {{700, 400}, {300, 900}, {1000, 60}};
	kvt_config cfg = t_config(layers, nq, nkv, d, dtype);
	cfg.p = 1.0f;
	cfg.nvme_queue_depth = qd;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	w_open(w, name, cfg, n_files, (uint64_t)64 << 20, NS, 2600, seed, 1);
	if (slot) {
		char want[64];
		snprintf(want, sizeof want, "bounce %u x %u bytes", 2 * qd, slot);
		const char *got = kvt_nvme_status(w->c->nvme);
		T_CHECK(strstr(got, want) != NULL, "%s: the store's status is '%s', wanted '%s'",
			w->name, got, want);
	}
	for (uint32_t s = 0; s < NS; s++) {
		w_prefill_ok(w, s, chunks[s][0]);
		w_prefill_ok(w, s, chunks[s][1]);
	}
	w_append_all(w, 40);
	w_check_all(w, "before any spill");
	size_t per = (size_t)nq * d;
	float *ref = (float *)t_alloc(sizeof(float) * NS * MAXL * per);
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++) {
			w_check_attend(w, s, l, NULL, "before any spill");
			memcpy(ref + ((size_t)s * MAXL + l) * per, w->out, sizeof(float) * per);
		}
	kvt_stats st0 = t_stats(w->c);
	T_CHECK(st0.nvme_bytes_used == 0 && st0.nvme_bytes_capacity > 0,
		"%s: before spilling nvme_bytes_used got %llu (wanted 0), capacity %llu (wanted > 0)",
		w->name, (unsigned long long)st0.nvme_bytes_used,
		(unsigned long long)st0.nvme_bytes_capacity);
	/* the selection of seq 0 layer 0 is made while it is on the host, and gathered after */
	int rc = w_gather(w, 0, 0);
	w_expect(w, 0, 0, rc, "selected before the spill");
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(w_spill_due(w, s) > 0, "%s: seq %u has nothing to spill", w->name, s);
		w_spill_ok(w, s, "first spill");
		w_spill_ok(w, s, "second spill (nothing left)");
	}
	/* direct serving: rows read through the block cache */
	kvt_stats a = t_stats(w->c);
	w_expect(w, 0, 0, w_gather_again(w, 0, 0), "selected before the spill, gathered after");
	w_check_all(w, "spilled, first gather");
	kvt_stats b = t_stats(w->c);
	T_CHECK(b.nvme_cache_misses > a.nvme_cache_misses && b.nvme_reads > a.nvme_reads &&
			b.nvme_bytes_read > a.nvme_bytes_read,
		"%s: direct serving: cache misses %llu -> %llu, reads %llu -> %llu, wanted both to rise",
		w->name, (unsigned long long)a.nvme_cache_misses,
		(unsigned long long)b.nvme_cache_misses, (unsigned long long)a.nvme_reads,
		(unsigned long long)b.nvme_reads);
	uint64_t chunks_spilled = 0;
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++)
			chunks_spilled += (uint64_t)w->spilled[s][l] * nkv *
					  (w_block_bytes(w) / KVT_NVME_CHUNK);
	T_CHECK(b.nvme_cache_misses - a.nvme_cache_misses == chunks_spilled,
		"%s: first gather of everything: cache misses rose by %llu, wanted %llu (each 4 KiB "
		"chunk of every spilled block once)",
		w->name, (unsigned long long)(b.nvme_cache_misses - a.nvme_cache_misses),
		(unsigned long long)chunks_spilled);
	w_check_all(w, "spilled, second gather");
	kvt_stats c2 = t_stats(w->c);
	T_CHECK(c2.nvme_cache_hits - b.nvme_cache_hits == chunks_spilled &&
			c2.nvme_cache_misses == b.nvme_cache_misses,
		"%s: second gather: cache hits rose by %llu (wanted %llu), misses %llu -> %llu (wanted "
		"none: the 64 MiB cache holds every chunk)",
		w->name, (unsigned long long)(c2.nvme_cache_hits - b.nvme_cache_hits),
		(unsigned long long)chunks_spilled, (unsigned long long)b.nvme_cache_misses,
		(unsigned long long)c2.nvme_cache_misses);
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++)
			w_check_attend(w, s, l, ref + ((size_t)s * MAXL + l) * per, "spilled");
	for (uint32_t l = 0; l < layers; l++)
		w_check_attend_batch(w, l, "spilled");
	/* a prefill chunk on a spilled sequence grows its block table (spill table included) */
	uint32_t cap0 = w_layer(w, 0, 0)->blk_cap;
	w_prefill_ok(w, 0, 1000);
	T_CHECK(w_layer(w, 0, 0)->blk_cap > cap0, "%s: the block table did not grow (%u blocks)",
		w->name, cap0);
	w_check_all(w, "spilled, after a prefill that grew the block table");
	/* decoding goes on: appends with flushes make more blocks full and spillable */
	for (int round = 0; round < 6; round++) {
		w_append_all(w, 50);
		for (uint32_t s = 0; s < NS; s++)
			for (uint32_t l = 0; l < layers; l++)
				w_check_attend(w, s, l, NULL, "decoding while spilled");
	}
	w_check_all(w, "spilled, after 300 appends");
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(w_spill_due(w, s) > 0, "%s: seq %u: the appends made no new block spillable",
			w->name, s);
		w_spill_ok(w, s, "spill after appends");
	}
	w_check_all(w, "spilled twice");
	for (uint32_t l = 0; l < layers; l++)
		w_check_attend_batch(w, l, "spilled twice");
	for (uint32_t s = 0; s < NS; s++) {
		w_restore_ok(w, s, "restore");
		w_restore_ok(w, s, "second restore (nothing left)");
		for (uint32_t l = 0; l < layers; l++) {
			w_check(w, s, l, "restored");
			w_check_attend(w, s, l, NULL, "restored");
		}
	}
	kvt_stats e = t_stats(w->c), m = t_stats(w->mirror);
	T_CHECK(e.host_bytes_used == m.host_bytes_used && e.nvme_bytes_used == 0,
		"%s: after restoring everything host_bytes_used got %llu (wanted %llu as the cache that "
		"never spilled), nvme_bytes_used got %llu (wanted 0)",
		w->name, (unsigned long long)e.host_bytes_used, (unsigned long long)m.host_bytes_used,
		(unsigned long long)e.nvme_bytes_used);
	T_CHECK(e.spills == 2 * NS && e.restores == NS && e.auto_spills == 0,
		"%s: counters spills %llu restores %llu auto_spills %llu, wanted %d %d 0", w->name,
		(unsigned long long)e.spills, (unsigned long long)e.restores,
		(unsigned long long)e.auto_spills, 2 * NS, NS);
	/* and once more: spill, serve, close a spilled sequence (its NVMe space comes back) */
	w_spill_ok(w, 0, "spill after restore");
	w_check_all(w, "spilled again after restore");
	T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "%s: close spilled seq", w->name);
	kvt_stats f = t_stats(w->c);
	T_CHECK(f.nvme_bytes_used == 0, "%s: closing the spilled sequence left nvme_bytes_used %llu, "
		"wanted 0", w->name, (unsigned long long)f.nvme_bytes_used);
	print_message("%s: %llu bytes written, %llu read, %llu reads, cache hits %llu misses %llu\n",
		      w->name, (unsigned long long)f.nvme_bytes_written,
		      (unsigned long long)f.nvme_bytes_read, (unsigned long long)f.nvme_reads,
		      (unsigned long long)f.nvme_cache_hits, (unsigned long long)f.nvme_cache_misses);
	free(ref);
	char wname[sizeof w->name];
	memcpy(wname, w->name, sizeof wname);
	w_close(w);
	free(w);
	TT_CHECK_RELEASED(wname, live, fds);
	return f.nvme_reads;
}

static void test_round_trip(void **state)
{
	(void)state;
	tt_skip_unless_available();
	round_trip("round trip f16 d=64 3 layers GQA 4/2, 1 file", 3, 4, 2, 64, KVT_DTYPE_F16, 1,
		   0x71e40001u, 8, 1u << 20);
	round_trip("round trip bf16 d=64 2 layers MHA 4/4, 3 files", 2, 4, 4, 64, KVT_DTYPE_BF16, 3,
		   0x71e40002u, 8, 0);
	round_trip("round trip f16 d=128 1 layer GQA 8/2, 2 files", 1, 8, 2, 128, KVT_DTYPE_F16, 2,
		   0x71e40003u, 8, 0);
	const uint64_t reads8 = round_trip("round trip bf16 d=256 1 layer GQA 2/1, 1 file", 1, 2, 1,
					   256, KVT_DTYPE_BF16, 1, 0x71e40004u, 8, 0);
	/* deep queues: the pool stays near 64 MiB, so slots of 256 KiB + 4 KiB at qd 128, where a
	 * d = 256 block (256 KiB of rows and its header) fits one slot whole, and of 64 KiB + 4 KiB at
	 * qd 1024, where a d = 128 block spans two */
	const uint64_t reads128 = round_trip("round trip bf16 d=256 1 layer GQA 2/1, 1 file, qd 128",
					     1, 2, 1, 256, KVT_DTYPE_BF16, 1, 0x71e40005u, 128,
					     (256u << 10) + 4096);
	T_CHECK(reads128 == reads8, "d=256 at qd 128 took %llu read I/Os, wanted %llu as at qd 8: a "
		"block that fits one slot is read in the same pieces", (unsigned long long)reads128,
		(unsigned long long)reads8);
	round_trip("round trip f16 d=128 2 layers GQA 4/2, 2 files, qd 1024", 2, 4, 2, 128,
		   KVT_DTYPE_F16, 2, 0x71e40006u, 1024, (64u << 10) + 4096);
}

/* ---- 2. capacity-driven spills ------------------------------------------------------------ */

enum { CAP_SEQS = 5, CAP_TOKENS = 2000 };

/* Fill sequence s: two prefill chunks on every layer and 20 appends (2000 tokens). Returns the first
 * failing rc (with *layer and *what set) or 0. */
static int cap_fill(struct world *w, uint32_t s, uint32_t *layer, const char **what)
{
	static const uint32_t chunk[2] = {1200, 780};
	for (int ci = 0; ci < 2; ci++)
		for (uint32_t l = 0; l < w->layers; l++) {
			int rc = w_prefill(w, s, l, chunk[ci]);
			if (rc < 0) {
				*layer = l;
				*what = ci ? "second prefill chunk" : "first prefill chunk";
				return rc;
			}
		}
	for (int t = 0; t < 20; t++)
		w_append_ok(w, 1, &s);
	return 0;
}

static kvt_config cap_config(uint32_t policy)
{
	kvt_config cfg = t_config(2, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	/* a sequence takes 2 layers x 2 heads x 8 blocks = 32 blocks: room for two and a bit */
	cfg.host_bytes = 68 * BLOCK_BYTES;
	cfg.spill_policy = policy;
	return cfg;
}

static void test_auto_spill_lru(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "LRU spills, 5 sequences of 2000 tokens in 68 host blocks", cap_config(KVT_SPILL_LRU),
	       1, (uint64_t)32 << 20, CAP_SEQS, CAP_TOKENS + 10, 0x71e40010u, 0);
	uint64_t cap = w->cfg.host_bytes;
	for (uint32_t s = 0; s < CAP_SEQS; s++) {
		uint32_t layer = 0;
		const char *what = "";
		int rc = cap_fill(w, s, &layer, &what);
		T_CHECK(rc == 0, "%s: filling seq %u, %s of layer %u: got %d (%s: %s), wanted 0 (LRU "
			"spills make room)", w->name, s, what, layer, rc, kvt_strerror(rc),
			kvt_last_error(w->c));
		kvt_stats st = t_stats(w->c);
		T_CHECK(st.host_bytes_used <= cap, "%s: host_bytes_used %llu over capacity %llu",
			w->name, (unsigned long long)st.host_bytes_used, (unsigned long long)cap);
	}
	kvt_stats st = t_stats(w->c);
	T_CHECK(st.auto_spills > 0 && st.spills >= st.auto_spills,
		"%s: auto_spills got %llu (spills %llu), wanted > 0", w->name,
		(unsigned long long)st.auto_spills, (unsigned long long)st.spills);
	T_CHECK(w_blocks_on_nvme(w, 0) > 0, "%s: the least recently used seq 0 was not spilled",
		w->name);
	w_check_all(w, "after the fill (direct serving)");
	/* restore the first sequence: room is made by spilling others */
	uint32_t on = w_blocks_on_nvme(w, 0);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_restore(w->c, w->seqs[0]);
	T_CHECK(got == (int64_t)on * (int64_t)BLOCK_BYTES,
		"%s: restore of seq 0 got %lld (%s), wanted %llu bytes (%u blocks)", w->name,
		(long long)got, got < 0 ? kvt_last_error(w->c) : "bytes",
		(unsigned long long)(on * BLOCK_BYTES), on);
	kvt_stats b = t_stats(w->c);
	T_CHECK(w_blocks_on_nvme(w, 0) == 0 && b.host_bytes_used <= cap && b.restores == a.restores + 1,
		"%s: after restore seq 0 has %u blocks on NVMe (wanted 0), host_bytes_used %llu of "
		"%llu, restores %llu", w->name, w_blocks_on_nvme(w, 0),
		(unsigned long long)b.host_bytes_used, (unsigned long long)cap,
		(unsigned long long)b.restores);
	print_message("%s: %llu auto spills during the fill, %llu more for the restore\n", w->name,
		      (unsigned long long)a.auto_spills,
		      (unsigned long long)(b.auto_spills - a.auto_spills));
	w_check_all(w, "after restoring seq 0");
	/* decoding goes on over all five, spilled or not */
	w_append_all(w, 10);
	w_check_all(w, "after appends to all five");
	w_close(w);
	free(w);
}

/*
 * A decode batch of every sequence on a full host tier: no sequence is idle, so KVT_SPILL_LRU must
 * take the batch's own indexed blocks (which an append never writes) instead of failing.
 */
static void test_lru_whole_batch(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	kvt_config cfg = cap_config(KVT_SPILL_LRU);
	/* 3 sequences x 2 layers x 2 heads x 2 blocks: the tier is full after the prefills */
	cfg.host_bytes = 24 * BLOCK_BYTES;
	w_open(w, "LRU with every sequence in the batch", cfg, 1, (uint64_t)32 << 20, 3, 600,
	       0x71e40012u, 0);
	for (uint32_t s = 0; s < 3; s++)
		w_prefill_ok(w, s, 2 * KVT_BLOCK_TOKENS);
	kvt_stats a = t_stats(w->c);
	T_CHECK(a.host_bytes_used == cfg.host_bytes && a.auto_spills == 0,
		"%s: after the prefills host_bytes_used %llu (wanted %llu), auto_spills %llu (wanted 0)",
		w->name, (unsigned long long)a.host_bytes_used, (unsigned long long)cfg.host_bytes,
		(unsigned long long)a.auto_spills);
	w_append_all(w, 1); /* every sequence needs a new block per layer and head */
	kvt_stats b = t_stats(w->c);
	T_CHECK(b.auto_spills >= 2 && b.host_bytes_used <= cfg.host_bytes,
		"%s: auto_spills got %llu (wanted >= 2), host_bytes_used %llu of %llu", w->name,
		(unsigned long long)b.auto_spills, (unsigned long long)b.host_bytes_used,
		(unsigned long long)cfg.host_bytes);
	w_check_all(w, "after the batch append that spilled its own sequences");
	w_close(w);
	free(w);
}

/*
 * A refused call, and one that changes nothing, leave the spill order as it was: a kvt_attend of
 * the least recently used sequence refused for a non-finite query, or a kvt_seq_truncate of it by
 * 0 tokens, does not make it recently used, so the next automatic spill still takes it (before,
 * the refused call's stamp moved the spill to the next sequence, and so did the truncate's).
 */
static void test_lru_no_use(void **state)
{
	(void)state;
	tt_skip_unless_available();
	static const char *const calls[2] = {"an attend refused for a NaN query",
					     "a truncate by 0 tokens"};
	for (int i = 0; i < 2; i++) {
		struct world *w = (struct world *)t_alloc(sizeof *w);
		kvt_config cfg = cap_config(KVT_SPILL_LRU);
		cfg.host_bytes = 24 * BLOCK_BYTES; /* full after the three prefills */
		w_open(w, "LRU order after a call that is no use", cfg, 1, (uint64_t)32 << 20, 3,
		       600, 0x71e40014u, 0);
		for (uint32_t s = 0; s < 3; s++)
			w_prefill_ok(w, s, 2 * KVT_BLOCK_TOKENS);
		int rc, want;
		if (i == 0) {
			w_query(w, 0, 0);
			w->q[3] = t_enc(cfg.dtype, NAN);
			rc = kvt_attend(w->c, 0, 1, &w->seqs[0], w->q, w->out, NULL);
			want = -EINVAL;
		} else {
			rc = kvt_seq_truncate(w->c, w->seqs[0], 0, NULL);
			want = 0;
		}
		T_CHECK(rc == want, "%s: %s got %d (%s), wanted %d", w->name, calls[i], rc,
			kvt_last_error(w->c), want);
		const uint32_t idx[1] = {2};
		w_append_ok(w, 1, idx); /* sequence 2 needs a new block per layer and head: a spill */
		T_CHECK(w_blocks_on_nvme(w, 0) > 0 && w_blocks_on_nvme(w, 1) == 0,
			"%s: after %s the automatic spill took %u blocks of sequence 0 and %u of "
			"sequence 1; wanted sequence 0, the least recently used (that call is no use)",
			w->name, calls[i], w_blocks_on_nvme(w, 0), w_blocks_on_nvme(w, 1));
		w_check_all(w, calls[i]);
		w_close(w);
		free(w);
	}
}

/*
 * Restoring a sequence never spills that same sequence to make room: with only its own indexed
 * blocks left to spill, the restore fails with -ENOSPC and nothing changes.
 */
static void test_restore_keeps_itself(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	kvt_config cfg = cap_config(KVT_SPILL_LRU);
	cfg.host_bytes = 8 * BLOCK_BYTES; /* 2 layers x 2 heads x 2 blocks */
	w_open(w, "restore with only its own blocks to spill", cfg, 1, (uint64_t)32 << 20, 1,
	       3 * KVT_BLOCK_TOKENS, 0x71e40013u, 0);
	w_prefill_ok(w, 0, 2 * KVT_BLOCK_TOKENS);
	w_spill_ok(w, 0, "spill of the first block of every layer and head");
	/* the host tier fills again, and the second blocks become fully indexed (spillable) */
	w_append_all(w, KVT_BLOCK_TOKENS);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_restore(w->c, w->seqs[0]);
	kvt_stats b = t_stats(w->c);
	T_CHECK(got == -ENOSPC, "%s: restore got %lld (%s), wanted -ENOSPC", w->name, (long long)got,
		got < 0 ? kvt_last_error(w->c) : "bytes");
	T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
			a.spills == b.spills,
		"%s: the failed restore changed host %llu -> %llu, NVMe %llu -> %llu, spills %llu -> "
		"%llu", w->name, (unsigned long long)a.host_bytes_used,
		(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
		(unsigned long long)b.nvme_bytes_used, (unsigned long long)a.spills,
		(unsigned long long)b.spills);
	w_check_all(w, "after the refused restore");
	w_close(w);
	free(w);
}

static void test_no_spill_enospc(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "KVT_SPILL_NONE, 5 sequences of 2000 tokens in 68 host blocks",
	       cap_config(KVT_SPILL_NONE), 1, (uint64_t)32 << 20, CAP_SEQS, CAP_TOKENS, 0x71e40011u, 0);
	int failed = 0;
	for (uint32_t s = 0; s < CAP_SEQS && !failed; s++) {
		uint32_t layer = 0;
		const char *what = "";
		int rc = cap_fill(w, s, &layer, &what);
		if (rc == 0)
			continue;
		failed = 1;
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC, "%s: seq %u %s of layer %u: got %d (%s: %s), wanted -ENOSPC",
			w->name, s, what, layer, rc, kvt_strerror(rc), msg);
		T_CHECK(strstr(msg, "bytes needed") && strstr(msg, "free") && strstr(msg, "host_bytes"),
			"%s: the -ENOSPC text \"%s\" does not name the bytes needed, free and host_bytes",
			w->name, msg);
		print_message("%s: seq %u %s of layer %u: -ENOSPC \"%s\"\n", w->name, s, what, layer,
			      msg);
		/* the failing call changed nothing but the error counter */
		const kvt_stats a = w->before, b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.tokens == b.tokens &&
				a.tokens_indexed == b.tokens_indexed && b.errors == a.errors + 1 &&
				b.auto_spills == 0 && b.spills == 0 && b.nvme_bytes_used == 0,
			"%s: the failed prefill changed host_bytes_used %llu -> %llu, tokens %llu -> "
			"%llu, indexed %llu -> %llu, errors %llu -> %llu (wanted +1); auto_spills %llu "
			"spills %llu nvme_bytes_used %llu (wanted 0)",
			w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.tokens,
			(unsigned long long)b.tokens, (unsigned long long)a.tokens_indexed,
			(unsigned long long)b.tokens_indexed, (unsigned long long)a.errors,
			(unsigned long long)b.errors, (unsigned long long)b.auto_spills,
			(unsigned long long)b.spills, (unsigned long long)b.nvme_bytes_used);
		int64_t len = kvt_seq_length(w->c, w->seqs[s], layer);
		T_CHECK(len == w->n[s][layer], "%s: after the failed prefill seq %u layer %u length got "
			"%lld, wanted %u", w->name, s, layer, (long long)len, w->n[s][layer]);
		/* a retry fails the same way */
		rc = w_prefill(w, s, layer, 780);
		T_CHECK(rc == -ENOSPC, "%s: retried prefill got %d, wanted -ENOSPC", w->name, rc);
	}
	T_CHECK(failed, "%s: the fill never returned -ENOSPC without a spill policy", w->name);
	/* every sequence holds what it was given, all on the host */
	for (uint32_t s = 0; s < CAP_SEQS; s++)
		for (uint32_t l = 0; l < w->layers; l++)
			if (w->n[s][l])
				w_check(w, s, l, "after the -ENOSPC");
	w_close(w);
	free(w);
}

/* ---- 3. NVMe files full --------------------------------------------------------------------- */

static void test_nvme_full(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	/* 256 KiB: room for three blocks of 64 KiB plus header and padding, at any alignment */
	w_open(w, "NVMe files full (256 KiB)", cfg, 1, (uint64_t)256 << 10, 2, 1200, 0x71e40020u, 0);
	w_prefill_ok(w, 0, 300);  /* 1 full spillable block per head: 2 blocks */
	w_prefill_ok(w, 1, 1100); /* 4 per head: 8 blocks */
	w_spill_ok(w, 0, "small sequence");
	for (int attempt = 0; attempt < 2; attempt++) {
		kvt_stats a = t_stats(w->c);
		int64_t rc = kvt_seq_spill(w->c, w->seqs[1]);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC, "%s attempt %d: spill of 8 blocks got %lld (%s), wanted -ENOSPC",
			w->name, attempt, (long long)rc, msg);
		T_CHECK(strstr(msg, "bytes") && strstr(msg, "free") && strstr(msg, "need"),
			"%s: the -ENOSPC text \"%s\" does not name the bytes needed and free", w->name,
			msg);
		kvt_stats b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				a.spills == b.spills,
			"%s: failed spill changed host_bytes_used %llu -> %llu, nvme_bytes_used %llu -> "
			"%llu, spills %llu -> %llu", w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
			(unsigned long long)b.nvme_bytes_used, (unsigned long long)a.spills,
			(unsigned long long)b.spills);
		T_CHECK(w_blocks_on_nvme(w, 1) == 0, "%s: blocks of the failed spill are marked on NVMe",
			w->name);
		if (attempt == 0)
			print_message("%s: -ENOSPC \"%s\"\n", w->name, msg);
		w_check(w, 1, 0, "after the failed spill");
		if (attempt == 0)
			w_check(w, 0, 0, "the spilled small sequence");
		w_check_attend(w, 1, 0, NULL, "after the failed spill");
		/* closing the small sequence frees its space, still not enough for eight blocks */
		if (attempt == 0) {
			T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "close");
			T_CHECK(t_stats(w->c).nvme_bytes_used == 0, "%s: close left NVMe space in use",
				w->name);
		}
	}
	w_close(w);
	free(w);
}

/* ---- 4. no NVMe tier, and configuration errors -------------------------------------------- */

static void test_no_tier(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "no NVMe tier", cfg, 0, 0, 1, 800, 0x71e40030u, 0);
	w_prefill_ok(w, 0, 700);
	kvt_stats a = t_stats(w->c);
	int64_t rc = kvt_seq_spill(w->c, w->seqs[0]);
	T_CHECK(rc == -EOPNOTSUPP && strstr(kvt_last_error(w->c), "n_nvme"),
		"%s: spill got %lld (\"%s\"), wanted -EOPNOTSUPP naming n_nvme", w->name, (long long)rc,
		kvt_last_error(w->c));
	rc = kvt_seq_restore(w->c, w->seqs[0]);
	T_CHECK(rc == -EOPNOTSUPP && strstr(kvt_last_error(w->c), "n_nvme"),
		"%s: restore got %lld (\"%s\"), wanted -EOPNOTSUPP naming n_nvme", w->name,
		(long long)rc, kvt_last_error(w->c));
	kvt_stats b = t_stats(w->c);
	T_CHECK(a.host_bytes_used == b.host_bytes_used && b.errors == a.errors + 2 &&
			b.nvme_bytes_capacity == 0 && b.spills == 0,
		"%s: host_bytes_used %llu -> %llu, errors %llu -> %llu (wanted +2), nvme capacity %llu",
		w->name, (unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
		(unsigned long long)a.errors, (unsigned long long)b.errors,
		(unsigned long long)b.nvme_bytes_capacity);
	w_check(w, 0, 0, "after -EOPNOTSUPP");
	T_CHECK(kvt_seq_spill(w->c, 7) == -ENOENT, "%s: spill of a closed sequence, wanted -ENOENT",
		w->name);
	T_CHECK(kvt_seq_spill(NULL, 0) == -EINVAL && kvt_seq_restore(NULL, 0) == -EINVAL,
		"%s: NULL cache, wanted -EINVAL", w->name);
	w_close(w);
	free(w);
}

static void test_config_errors(void **state)
{
	(void)state;
	tt_files f;
	tt_make_files(&f, 1, (uint64_t)1 << 20);
	const uint64_t zero[1] = {0}, small[1] = {4095}, two[2] = {f.bytes[0], f.bytes[0]};
	const char *twice[2] = {f.paths[0], f.paths[0]}, *empty[1] = {""};
	const char *const *paths[] = {NULL, f.ptrs, twice, empty};
	const uint64_t *bytes[] = {NULL, f.bytes, zero, small, two};
	struct {
		const char *name, *field;
		uint32_t n_nvme;
		int paths, bytes; /* indices into paths[] and bytes[] */
		uint32_t policy;
		uint64_t cache;
		uint32_t qd;
	} cases[] = {
		{"n_nvme = 1, nvme_paths NULL", "nvme_paths", 1, 0, 1, 0, 64u << 20, 0},
		{"n_nvme = 1, nvme_bytes NULL", "nvme_bytes", 1, 1, 0, 0, 64u << 20, 0},
		{"nvme_bytes[0] = 0", "nvme_bytes[0] = 0", 1, 1, 2, 0, 64u << 20, 0},
		{"nvme_bytes[0] = 4095", "nvme_bytes[0] = 4095", 1, 1, 3, 0, 64u << 20, 0},
		{"a path given twice", "nvme_paths[1]", 2, 2, 4, 0, 64u << 20, 0},
		{"an empty path", "nvme_paths[0] is empty", 1, 3, 1, 0, 64u << 20, 0},
		{"spill_policy LRU without NVMe", "spill_policy", 0, 0, 0, KVT_SPILL_LRU, 64u << 20, 0},
		{"nvme_cache_bytes = 1 MiB - 1", "nvme_cache_bytes", 1, 1, 1, 0, (1u << 20) - 1, 0},
		{"nvme_cache_bytes = 2 TiB", "nvme_cache_bytes", 1, 1, 1, 0, (uint64_t)2 << 40, 0},
		{"nvme_queue_depth = 1025", "nvme_queue_depth", 1, 1, 1, 0, 64u << 20, 1025},
		{"n_nvme = 65", "n_nvme", 65, 1, 1, 0, 64u << 20, 0},
		{"spill_policy = 2", "spill_policy", 1, 1, 1, 2, 64u << 20, 0},
	};
	int nfail = 0;
	int64_t live = kvt_mem_live();
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
		cfg.n_nvme = cases[i].n_nvme;
		cfg.nvme_paths = paths[cases[i].paths];
		cfg.nvme_bytes = bytes[cases[i].bytes];
		cfg.spill_policy = cases[i].policy;
		cfg.nvme_cache_bytes = cases[i].cache;
		cfg.nvme_queue_depth = cases[i].qd;
		kvt_cache *c = NULL;
		int rc = kvt_cache_create(&cfg, &c);
		const char *msg = kvt_last_error(NULL);
		T_SOFT(&nfail, rc == -EINVAL && c == NULL && strstr(msg, cases[i].field),
		       "config case \"%s\": got %d (\"%s\"), wanted -EINVAL naming %s", cases[i].name, rc,
		       msg, cases[i].field);
		if (c)
			kvt_cache_destroy(c);
	}
	/* the smallest valid block cache is accepted */
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.n_nvme = 1;
	cfg.nvme_paths = f.ptrs;
	cfg.nvme_bytes = f.bytes;
	cfg.nvme_cache_bytes = 1u << 20;
	cfg.spill_policy = KVT_SPILL_LRU;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	if (rc == -EOPNOTSUPP) {
		tt_unlink(&f);
		print_message("SKIP the valid case: %s\n", kvt_last_error(NULL));
	} else {
		T_SOFT(&nfail, rc == 0, "config case \"nvme_cache_bytes = 1 MiB, LRU\": got %d (%s), "
		       "wanted 0", rc, kvt_last_error(NULL));
		kvt_cache_destroy(c);
	}
	/* a file that cannot be created: the text names the path */
	const char *bad[1] = {"/nonexistent-dir-kvt/file"};
	cfg.nvme_paths = bad;
	c = NULL;
	rc = kvt_cache_create(&cfg, &c);
	if (rc != -EOPNOTSUPP)
		T_SOFT(&nfail, rc < 0 && c == NULL && strstr(kvt_last_error(NULL), bad[0]),
		       "config case \"unopenable path\": got %d (\"%s\"), wanted an error naming %s", rc,
		       kvt_last_error(NULL), bad[0]);
	tt_unlink(&f);
	T_SOFT(&nfail, kvt_mem_live() == live, "config cases leaked: live allocations %lld, wanted %lld",
	       (long long)kvt_mem_live(), (long long)live);
	T_CHECK(nfail == 0, "%d configuration cases failed", nfail);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_auto_spill_lru),
		cmocka_unit_test(test_lru_whole_batch),
		cmocka_unit_test(test_lru_no_use),
		cmocka_unit_test(test_restore_keeps_itself),
		cmocka_unit_test(test_no_spill_enospc),
		cmocka_unit_test(test_nvme_full),
		cmocka_unit_test(test_no_tier),
		cmocka_unit_test(test_config_errors),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
