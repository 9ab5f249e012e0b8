/* SPDX-License-Identifier: MIT */
/*
 * The integrity of the NVMe tier through the public API (suite nvme), on scratch files of the local
 * disk ($KVT_TEST_DIR, else the current directory), with test_tier.c's world (tier_world.h):
 *   - single-bit corruption of a written block (header, chunk CRCs, payload, padding): -EBADMSG that
 *     names the block, from direct serving and from restore, nothing unverified cached or served;
 *   - a block cache too small for a selection: -ENOSPC naming nvme_cache_bytes;
 *   - a stale block generation is refused.
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_world.h"

/* ---- corruption ------------------------------------------------------------------------- */

/* Flip bit `bit` of the byte at `off` of file `fi` (through the page cache, then synced). */
static void flip_bit(struct world *w, uint32_t fi, uint64_t off, int bit)
{
	unsigned char b;
	int fd = w->fd[fi];
	T_CHECK(pread(fd, &b, 1, (off_t)off) == 1, "%s: pread of file %u @ %llu: %s", w->name, fi,
		(unsigned long long)off, strerror(errno));
	b ^= (unsigned char)(1u << bit);
	T_CHECK(pwrite(fd, &b, 1, (off_t)off) == 1, "%s: pwrite: %s", w->name, strerror(errno));
	T_CHECK(fdatasync(fd) == 0, "%s: fdatasync: %s", w->name, strerror(errno));
}

struct flip {
	const char *where;
	uint32_t layer, head, block;
	int region; /* 0: header at `at`, 1: payload at `at`, 2: padding (tail, else header's) at `at` */
	uint32_t at;
	int bit;
};

static void test_corruption(void **state)
{
	(void)state;
	tt_skip_unless_available();
	static const struct flip flips[] = {
		{"magic", 0, 0, 0, 0, 0, 0},
		{"magic, last byte", 1, 1, 1, 0, 3, 7},
		{"version", 0, 1, 2, 0, 4, 1},
		{"header byte 8", 1, 0, 0, 0, 8, 3},
		{"header byte 17", 0, 0, 1, 0, 17, 5},
		{"header byte 30", 1, 1, 2, 0, 30, 0},
		{"header byte 41", 0, 1, 0, 0, 41, 6},
		{"header byte 52", 1, 0, 1, 0, 52, 2},
		{"header byte 63", 0, 0, 2, 0, 63, 7},
		{"chunk CRC table, first", 1, 1, 0, 0, 64, 4},
		{"chunk CRC table, last", 0, 1, 1, 0, 127, 1},
		{"payload byte 0", 1, 0, 2, 1, 0, 0},
		{"payload chunk 3", 0, 0, 0, 1, 3 * 4096 + 1000, 6},
		{"payload chunk 7, a V element", 1, 1, 1, 1, 7 * 4096 + 200, 3},
		{"payload chunk 11", 0, 1, 2, 1, 11 * 4096 + 4095, 7},
		{"payload last byte", 1, 0, 0, 1, 65535, 5},
		{"padding first byte", 0, 0, 1, 2, 0, 2},
		{"padding last byte", 1, 1, 2, 2, UINT32_MAX, 4},
	};
	int detected_gather = 0, detected_restore = 0, trials = 0;
	for (size_t fi = 0; fi < sizeof flips / sizeof flips[0]; fi++) {
		const struct flip *fl = &flips[fi];
		kvt_config cfg = t_config(2, 4, 2, D, KVT_DTYPE_F16);
		cfg.p = 1.0f;
		struct world *w = (struct world *)t_alloc(sizeof *w);
		char name[128];
		snprintf(name, sizeof name, "corruption \"%s\" layer %u head %u block %u", fl->where,
			 fl->layer, fl->head, fl->block);
		w_open(w, name, cfg, 2, (uint64_t)8 << 20, 2, 800, 0x71e40040u + fi, 0);
		w_prefill_ok(w, 0, 500);
		w_prefill_ok(w, 0, 300); /* 3 full blocks per head and layer */
		w_prefill_ok(w, 1, 600);
		w_spill_ok(w, 0, "before the flip");
		w_spill_ok(w, 1, "the other sequence");
		struct kvt_layer *L = w_layer(w, 0, fl->layer);
		size_t at = (size_t)fl->head * L->blk_cap + fl->block;
		struct kvt_nvme_loc loc = L->spill[at].loc;
		/* Where the payload starts: after the header and its padding. */
		uint32_t hb = kvt_nvme_data_offset((uint32_t)BLOCK_BYTES,
						   kvt_nvme_alignment(w->c->nvme));
		uint64_t off = loc.offset;
		if (fl->region == 0)
			off += fl->at;
		else if (fl->region == 1)
			off += hb + fl->at;
		else {
			/* The tail padding; where the block has none, the header's padding. */
			uint64_t pad = loc.bytes - hb - BLOCK_BYTES,
				 start = hb + (uint64_t)BLOCK_BYTES;
			if (pad == 0) {
				start = kvt_nvme_header_bytes((uint32_t)BLOCK_BYTES);
				pad = hb - start;
			}
			if (pad == 0) {
				print_message("%s: no padding at this alignment, skipped\n", w->name);
				w_close(w);
				free(w);
				continue;
			}
			off += start + (fl->at == UINT32_MAX ? pad - 1 : fl->at);
		}
		T_CHECK(loc.bytes && off < loc.offset + loc.bytes,
			"%s: offset %llu outside the block at %llu (+%u)", w->name,
			(unsigned long long)off, (unsigned long long)loc.offset, loc.bytes);
		trials++;
		flip_bit(w, loc.file, off, fl->bit);
		char want[96];
		snprintf(want, sizeof want, "layer %u head %u tokens %u..%u", fl->layer, fl->head,
			 fl->block * KVT_BLOCK_TOKENS, (fl->block + 1) * KVT_BLOCK_TOKENS);
		/* direct serving refuses it, twice (nothing unverified was cached) */
		for (int again = 0; again < 2; again++) {
			int rc = w_gather(w, 0, fl->layer);
			const char *msg = kvt_last_error(w->c);
			T_CHECK(rc == -EBADMSG && strstr(msg, want),
				"%s gather %d: got %d (\"%s\"), wanted -EBADMSG naming \"%s\"", w->name,
				again, rc, msg, want);
			detected_gather += again == 0;
		}
		int rc = w_attend(w, 0, fl->layer);
		T_CHECK(rc == -EBADMSG, "%s: attend got %d (%s), wanted -EBADMSG", w->name, rc,
			kvt_last_error(w->c));
		/* in a batch, the entry whose rows were refused is named: [the other, this one] */
		const size_t nqd = (size_t)w->nq * w->d;
		uint16_t *q2 = t_alloc(2 * nqd * sizeof *q2);
		float *o2 = t_alloc(2 * nqd * sizeof *o2);
		memcpy(q2, w->q, nqd * sizeof *q2);
		memcpy(q2 + nqd, w->q, nqd * sizeof *q2);
		const uint32_t two[2] = {w->seqs[1], w->seqs[0]};
		rc = kvt_attend(w->c, fl->layer, 2, two, q2, o2, NULL);
		const int entry = kvt_last_error_entry(w->c);
		free(q2);
		free(o2);
		T_CHECK(rc == -EBADMSG && entry == 1, "%s: attend of [the other sequence, this one] "
			"got %d (%s), entry %d; wanted -EBADMSG, entry 1", w->name, rc,
			kvt_last_error(w->c), entry);
		/* the other layer and the other sequence are served */
		w_check(w, 0, 1 - fl->layer, "the layer not flipped");
		w_check(w, 1, fl->layer, "the other sequence");
		/* restore refuses it and takes no host memory */
		kvt_stats a = t_stats(w->c);
		int64_t r64 = kvt_seq_restore(w->c, w->seqs[0]);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(r64 == -EBADMSG && strstr(msg, want),
			"%s: restore got %lld (\"%s\"), wanted -EBADMSG naming \"%s\"", w->name,
			(long long)r64, msg, want);
		detected_restore++;
		kvt_stats b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				b.restores == a.restores,
			"%s: failed restore changed host_bytes_used %llu -> %llu, nvme_bytes_used %llu "
			"-> %llu", w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
			(unsigned long long)b.nvme_bytes_used);
		uint32_t on = w_blocks_on_nvme(w, 0);
		T_CHECK(on == 2 * 2 * 3, "%s: after the failed restore %u blocks on NVMe, wanted 12",
			w->name, on);
		if (fi == 0)
			print_message("%s: restore -EBADMSG \"%s\"\n", w->name, msg);
		/* repaired: served and restored, byte for byte */
		flip_bit(w, loc.file, off, fl->bit);
		w_check(w, 0, fl->layer, "repaired, direct serving");
		w_check(w, 0, 1 - fl->layer, "repaired, direct serving");
		w_restore_ok(w, 0, "repaired");
		w_check(w, 0, 0, "restored");
		w_check(w, 0, 1, "restored");
		/* a new generation in a new place: served right (from the cache or the file) */
		w_spill_ok(w, 0, "spill after restore");
		w_check(w, 0, fl->layer, "spilled again");
		/* slot reuse: a new sequence in the same slot never sees the old one's cached chunks */
		T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "close");
		T_CHECK(kvt_seq_open(w->c, &w->seqs[0]) == 0, "reopen");
		memset(w->n[0], 0, sizeof w->n[0]);
		memset(w->spilled[0], 0, sizeof w->spilled[0]);
		w_prefill_ok(w, 0, 800);
		w_spill_ok(w, 0, "new sequence in a reused slot");
		w_check(w, 0, 0, "new sequence in a reused slot");
		w_check(w, 0, 1, "new sequence in a reused slot");
		w_close(w);
		free(w);
	}
	print_message("corruption: %d single-bit flips, detected by direct serving %d, by restore %d\n",
		      trials, detected_gather, detected_restore);
	T_CHECK(trials >= 17 && detected_gather == trials && detected_restore == trials,
		"flips detected: direct serving %d, restore %d, of %d trials (wanted all)",
		detected_gather, detected_restore, trials);
}

/* ---- 6. block cache too small ---------------------------------------------------------------- */

static void test_block_cache_small(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, 64, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20; /* 256 chunks of 4 KiB = 4096 rows of d = 64 */
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "block cache of 1 MiB", cfg, 1, (uint64_t)16 << 20, 2, 5020, 0x71e40050u, 1);
	w_prefill_ok(w, 0, 3000);
	w_prefill_ok(w, 0, 2000); /* 19 full blocks per head: 304 chunks, more than the cache */
	w_prefill_ok(w, 1, 3900); /* 15 per head: 240 chunks, a head fits but not both */
	w_spill_ok(w, 0, "large");
	w_spill_ok(w, 1, "middle");
	/* each head's call fits, so the other head's chunks are evicted between calls */
	for (int pass = 0; pass < 3; pass++) {
		kvt_stats a = t_stats(w->c);
		w_check(w, 1, 0, "a head fits, both do not");
		kvt_stats b = t_stats(w->c);
		T_CHECK(b.nvme_cache_misses > a.nvme_cache_misses,
			"%s pass %d: cache misses %llu -> %llu, wanted a rise (240 + 240 chunks through "
			"256 slots)", w->name, pass, (unsigned long long)a.nvme_cache_misses,
			(unsigned long long)b.nvme_cache_misses);
		w_check_attend(w, 1, 0, NULL, "a head fits, both do not");
	}
	for (int again = 0; again < 2; again++) {
		int rc = w_gather(w, 0, 0);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC && strstr(msg, "nvme_cache_bytes"),
			"%s gather %d: got %d (\"%s\"), wanted -ENOSPC naming nvme_cache_bytes", w->name,
			again, rc, msg);
		if (again == 0)
			print_message("%s: -ENOSPC \"%s\"\n", w->name, msg);
		rc = w_attend(w, 0, 0);
		T_CHECK(rc == -ENOSPC, "%s attend: got %d (%s), wanted -ENOSPC", w->name, rc,
			kvt_last_error(w->c));
		/* the cache is still consistent: the other sequence is served */
		w_check(w, 1, 0, "the other sequence after the -ENOSPC");
	}
	w_restore_ok(w, 0, "large");
	w_check(w, 0, 0, "restored");
	w_check_attend(w, 0, 0, NULL, "restored");
	w_check(w, 1, 0, "the other sequence");
	/* the next steps: appends, then a spill of what became full */
	w_append_all(w, 20);
	w_check(w, 0, 0, "after appends");
	w_check(w, 1, 0, "after appends");
	w_check_attend(w, 1, 0, NULL, "after appends");
	w_close(w);
	free(w);
}

/*
 * A stale block: the image of an older generation of the same tokens, written back where the current
 * one lives (a lost write, say), is refused by direct serving and by restore (-EBADMSG), and served
 * again once the current image is back.
 */
static void test_stale_generation(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, 64, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "stale generation", cfg, 1, (uint64_t)8 << 20, 1, 800, 0x71e40060u, 0);
	w_prefill_ok(w, 0, 800); /* 3 full blocks per head */
	w_spill_ok(w, 0, "generation 1");
	struct kvt_layer *L = w_layer(w, 0, 0);
	const size_t at = (size_t)1 * L->blk_cap + 2; /* head 1, block 2 */
	struct kvt_nvme_loc old = L->spill[at].loc;
	uint64_t old_gen = L->spill[at].gen;
	unsigned char *img_old = (unsigned char *)t_alloc(old.bytes);
	T_CHECK(pread(w->fd[old.file], img_old, old.bytes, (off_t)old.offset) == (ssize_t)old.bytes,
		"%s: pread: %s", w->name, strerror(errno));
	w_restore_ok(w, 0, "generation 1");
	w_spill_ok(w, 0, "generation 2");
	L = w_layer(w, 0, 0);
	struct kvt_nvme_loc cur = L->spill[at].loc;
	T_CHECK(L->spill[at].gen != old_gen && cur.bytes == old.bytes,
		"%s: the new spill has generation %llu (old %llu), %u bytes (old %u)", w->name,
		(unsigned long long)L->spill[at].gen, (unsigned long long)old_gen, cur.bytes, old.bytes);
	unsigned char *img_cur = (unsigned char *)t_alloc(cur.bytes);
	T_CHECK(pread(w->fd[cur.file], img_cur, cur.bytes, (off_t)cur.offset) == (ssize_t)cur.bytes,
		"%s: pread: %s", w->name, strerror(errno));
	T_CHECK(pwrite(w->fd[cur.file], img_old, old.bytes, (off_t)cur.offset) == (ssize_t)old.bytes &&
			fdatasync(w->fd[cur.file]) == 0,
		"%s: pwrite: %s", w->name, strerror(errno));
	print_message("%s: generation %llu image written over generation %llu at file %u @ %llu\n",
		      w->name, (unsigned long long)old_gen, (unsigned long long)L->spill[at].gen,
		      cur.file, (unsigned long long)cur.offset);
	int rc = w_gather(w, 0, 0);
	const char *msg = kvt_last_error(w->c);
	T_CHECK(rc == -EBADMSG && strstr(msg, "head 1 tokens 512..768"),
		"%s: gather got %d (\"%s\"), wanted -EBADMSG naming head 1 tokens 512..768", w->name, rc,
		msg);
	print_message("%s: gather -EBADMSG \"%s\"\n", w->name, msg);
	kvt_stats a = t_stats(w->c);
	int64_t r64 = kvt_seq_restore(w->c, w->seqs[0]);
	kvt_stats b = t_stats(w->c);
	T_CHECK(r64 == -EBADMSG && a.host_bytes_used == b.host_bytes_used,
		"%s: restore got %lld (\"%s\"), host_bytes_used %llu -> %llu; wanted -EBADMSG and no "
		"change", w->name, (long long)r64, kvt_last_error(w->c),
		(unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used);
	T_CHECK(pwrite(w->fd[cur.file], img_cur, cur.bytes, (off_t)cur.offset) == (ssize_t)cur.bytes &&
			fdatasync(w->fd[cur.file]) == 0,
		"%s: pwrite: %s", w->name, strerror(errno));
	w_check(w, 0, 0, "current generation back");
	w_restore_ok(w, 0, "current generation back");
	w_check(w, 0, 0, "restored");
	free(img_old);
	free(img_cur);
	w_close(w);
	free(w);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_corruption),
		cmocka_unit_test(test_block_cache_small),
		cmocka_unit_test(test_stale_generation),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
