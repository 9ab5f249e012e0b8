/* SPDX-License-Identifier: MIT */
/*
 * Faults of the NVMe store. The completion shim rewrites the Nth completion (-EIO, -EAGAIN once or
 * forever, -ECANCELED, -ENOSPC, a short count, a sub-sector count once or forever, 0) for
 * N = 1, 2, ... until it no longer fires, through writes, whole-block reads and row reads, with
 * completions in arrival order and shuffled: every run ends in success or the error documented for
 * that rewrite, a failed write reports no block written and uses no space, a read never delivers a
 * byte that is not the verified block (outputs are poisoned first), and the blocks stay readable.
 * Then allocation failures through open, and single-bit flips anywhere in written blocks, which
 * must all be detected. Leaks are checked through kvt_mem_live and /proc/self/fd.
 */
#include "nvme_util.h"

enum fault_kind {
	F_EIO,
	F_EAGAIN_ONCE,
	F_EAGAIN_FOREVER,
	F_ECANCELED,
	F_ENOSPC,
	F_SHORT_HALF,
	F_SHORT_TINY_ONCE,
	F_SHORT_TINY_FOREVER,
	F_ZERO,
	F_KINDS
};

static const struct {
	const char *name;
	int want; /* the call's result once the fault fired */
} kinds[F_KINDS] = {
	[F_EIO] = {"-EIO", -EIO},
	[F_EAGAIN_ONCE] = {"-EAGAIN once", 0},
	[F_EAGAIN_FOREVER] = {"-EAGAIN forever", -EIO},
	[F_ECANCELED] = {"-ECANCELED", -ECANCELED},
	[F_ENOSPC] = {"-ENOSPC", -ENOSPC},
	[F_SHORT_HALF] = {"short (half)", 0},
	[F_SHORT_TINY_ONCE] = {"short (1 byte) once", 0},
	[F_SHORT_TINY_FOREVER] = {"short (1 byte) forever", -EIO},
	[F_ZERO] = {"zero-length", -EIO},
};

struct fault {
	enum fault_kind kind;
	uint64_t n;
	int fired;
};

static int fault_hook(void *ctx, uint64_t nth, int res)
{
	struct fault *f = ctx;
	int forever = f->kind == F_EAGAIN_FOREVER || f->kind == F_SHORT_TINY_FOREVER;
	if (nth != f->n && !(forever && nth > f->n))
		return res;
	if (res <= 0)
		return res; /* rewrite only real completions: a fault per run, not two */
	f->fired = 1;
	switch (f->kind) {
	case F_EIO: return -EIO;
	case F_EAGAIN_ONCE:
	case F_EAGAIN_FOREVER: return -EAGAIN;
	case F_ECANCELED: return -ECANCELED;
	case F_ENOSPC: return -ENOSPC;
	case F_SHORT_HALF: return res / 2 ? res / 2 : res;
	case F_SHORT_TINY_ONCE:
	case F_SHORT_TINY_FOREVER: return res > 1 ? 1 : res;
	default: return 0;
	}
}

#define NB 12

struct fixture {
	struct kvt_nvme *st;
	nv_files files;
	struct kvt_nvme_block blocks[NB];
	struct kvt_nvme_block_id ids[NB];
	struct kvt_nvme_loc locs[NB];
	unsigned char *payload[NB];
	uint32_t bytes[NB];
};

/*
 * Blocks of 1..90 rows of 128 elements (512 B .. 45 KiB) with a 16 KiB bounce slot and queue depth
 * 6: some blocks span three slots, so pieces of one block complete in any order among others'.
 */
static void fixture_open(struct fixture *x, uint64_t seed)
{
	memset(x, 0, sizeof *x);
	x->st = nv_open(&x->files, nv_dir(), 2, 8 << 20, 6, 16 << 10);
	t_rng r;
	t_rng_seed(&r, seed);
	for (int i = 0; i < NB; i++) {
		x->ids[i] = nv_id(&r, 1 + t_below(&r, 90), 128);
		x->ids[i].seq = (uint64_t)i;
		x->bytes[i] = kvt_nvme_payload_bytes(&x->ids[i]);
		x->payload[i] = nv_random_payload(&r, x->bytes[i]);
		x->blocks[i].id = x->ids[i];
		x->blocks[i].payload = x->payload[i];
	}
}

static void fixture_close(struct fixture *x)
{
	kvt_nvme_close(x->st);
	for (int i = 0; i < NB; i++)
		free(x->payload[i]);
}

static uint64_t used_bytes(struct kvt_nvme *st)
{
	struct kvt_nvme_stats s;
	kvt_nvme_get_stats(st, &s);
	return s.bytes_used;
}

/* The fault loop over writes, each run all or nothing. Returns the runs where it fired. */
static int write_loop(struct fixture *x, enum fault_kind k, uint64_t shuffle)
{
	int fired_runs = 0;
	for (uint64_t n = 1;; n++) {
		struct fault f = {k, n, 0};
		uint64_t used0 = used_bytes(x->st);
		kvt_nvme_set_cqe_shuffle(x->st, shuffle);
		kvt_nvme_set_cqe_hook(x->st, fault_hook, &f);
		int rc = kvt_nvme_write_blocks(x->st, NB, x->blocks, x->locs, &nv_err);
		kvt_nvme_set_cqe_hook(x->st, NULL, NULL);
		kvt_nvme_set_cqe_shuffle(x->st, 0);
		int want = f.fired ? kinds[k].want : 0;
		T_CHECK(rc == want, "write, %s at completion %llu%s: got %d (%s), wanted %d",
			kinds[k].name, (unsigned long long)n, shuffle ? " (shuffled)" : "", rc,
			rc ? nv_err.msg : "", want);
		if (rc) {
			for (int i = 0; i < NB; i++)
				T_CHECK(x->locs[i].bytes == 0,
					"failed write (%s, N %llu) reports block %d "
					"written",
					kinds[k].name, (unsigned long long)n, i);
			T_CHECK(used_bytes(x->st) == used0,
				"failed write (%s, N %llu): %llu bytes used, "
				"were %llu",
				kinds[k].name, (unsigned long long)n,
				(unsigned long long)used_bytes(x->st), (unsigned long long)used0);
		} else {
			kvt_nvme_free(x->st, NB, x->locs);
		}
		if (!f.fired)
			break;
		fired_runs++;
	}
	return fired_runs;
}

/* Each output is the poison or the block's payload, in full; with rc == 0, the payload. */
static void check_outputs(struct fixture *x, void **outs, const uint32_t *off, const uint32_t *len,
			  int rc, const char *what, uint64_t n)
{
	for (int i = 0; i < NB; i++) {
		const unsigned char *o = outs[i];
		int intact = 1, correct = memcmp(o, x->payload[i] + off[i], len[i]) == 0;
		for (uint32_t j = 0; j < len[i] && intact; j++)
			intact = o[j] == 0xa5;
		T_CHECK(correct || (rc && intact), "%s, N %llu, rc %d: output of block %d is %s",
			what, (unsigned long long)n, rc, i,
			intact ? "untouched" : "neither poison nor the block");
		memset(outs[i], 0xa5, len[i]);
	}
}

/* The fault loop over reads of the blocks written in x->locs: whole, or row ranges (rows). */
static int read_loop(struct fixture *x, enum fault_kind k, uint64_t shuffle, int rows)
{
	void *outs[NB];
	uint32_t off[NB], len[NB];
	struct kvt_nvme_rows q[NB];
	t_rng r;
	t_rng_seed(&r, 77);
	for (int i = 0; i < NB; i++) {
		uint32_t nt = x->ids[i].n_tokens, a = rows ? t_below(&r, nt) : 0;
		uint32_t e = rows ? a + 1 + t_below(&r, nt - a) : nt;
		off[i] = a * 512;
		len[i] = (e - a) * 512;
		outs[i] = NULL;
		T_CHECK(posix_memalign(&outs[i], 4096, len[i]) == 0, "no memory for output %d", i);
		memset(outs[i], 0xa5, len[i]);
		q[i] = (struct kvt_nvme_rows){x->locs[i], x->ids[i], a, e, outs[i]};
	}
	int fired_runs = 0;
	const char *what = rows ? "row read" : "read";
	for (uint64_t n = 1;; n++) {
		struct fault f = {k, n, 0};
		kvt_nvme_set_cqe_shuffle(x->st, shuffle);
		kvt_nvme_set_cqe_hook(x->st, fault_hook, &f);
		int rc = rows ? kvt_nvme_read_rows(x->st, NB, q, &nv_err)
			      : kvt_nvme_read_blocks(x->st, NB, x->locs, x->ids, outs, &nv_err);
		kvt_nvme_set_cqe_hook(x->st, NULL, NULL);
		kvt_nvme_set_cqe_shuffle(x->st, 0);
		int want = f.fired ? kinds[k].want : 0;
		T_CHECK(rc == want, "%s, %s at completion %llu%s: got %d (%s), wanted %d", what,
			kinds[k].name, (unsigned long long)n, shuffle ? " (shuffled)" : "", rc,
			rc ? nv_err.msg : "", want);
		check_outputs(x, outs, off, len, rc, what, n);
		if (!f.fired)
			break;
		fired_runs++;
	}
	/* Whatever failed, the blocks are still there and whole. */
	int rc = kvt_nvme_read_rows(x->st, NB, q, &nv_err);
	T_CHECK(rc == 0, "clean %s after the %s loop: got %d (%s)", what, kinds[k].name, rc,
		nv_err.msg);
	check_outputs(x, outs, off, len, 0, what, 0);
	for (int i = 0; i < NB; i++)
		free(outs[i]);
	return fired_runs;
}

static void test_completion_faults(void **state)
{
	(void)state;
	int64_t live0 = kvt_mem_live();
	int fds0 = t_fd_count();
	struct fixture x;
	fixture_open(&x, 2024);
	for (int shuffled = 0; shuffled < 2; shuffled++)
		for (int k = 0; k < F_KINDS; k++) {
			uint64_t seed = shuffled ? 0x9e3779b97f4a7c15ull + (uint64_t)k : 0;
			int w = write_loop(&x, (enum fault_kind)k, seed);
			int rc = kvt_nvme_write_blocks(x.st, NB, x.blocks, x.locs, &nv_err);
			T_CHECK(rc == 0, "setup write: %d (%s)", rc, nv_err.msg);
			int rd = read_loop(&x, (enum fault_kind)k, seed, 0);
			int rr = read_loop(&x, (enum fault_kind)k, seed, 1);
			kvt_nvme_free(x.st, NB, x.locs);
			printf("%-24s %s: fault fired in %d write, %d read, %d row-read runs\n",
			       kinds[k].name, shuffled ? "shuffled" : "in order", w, rd, rr);
			T_CHECK(w >= NB && rd >= NB && rr > 0,
				"%s: the loops covered too few completions", kinds[k].name);
		}
	struct kvt_nvme_stats s;
	kvt_nvme_get_stats(x.st, &s);
	printf("stats: %llu short I/Os continued, %llu -EAGAIN retries, %llu out-of-order "
	       "completions, "
	       "%llu calls ended by I/O errors, %llu bytes used\n",
	       (unsigned long long)s.short_ios, (unsigned long long)s.retries,
	       (unsigned long long)s.reordered, (unsigned long long)s.io_errors,
	       (unsigned long long)s.bytes_used);
	T_CHECK(s.reordered > 0 && s.bytes_used == 0 && s.bad_frees == 0,
		"reordered %llu (wanted > 0), used %llu, bad frees %llu",
		(unsigned long long)s.reordered, (unsigned long long)s.bytes_used,
		(unsigned long long)s.bad_frees);
	fixture_close(&x);
	T_CHECK(kvt_mem_live() == live0 && t_fd_count() == fds0,
		"leak: live %lld (was %lld), fds %d "
		"(were %d)",
		(long long)kvt_mem_live(), (long long)live0, t_fd_count(), fds0);
}

/*
 * Fail the Nth allocation through open, a write, a read and row reads (header prefetch, header
 * cache): -ENOMEM or success, the payload on success, and no leak.
 */
static void test_alloc_faults(void **state)
{
	(void)state;
	int64_t live0 = kvt_mem_live();
	int fds0 = t_fd_count();
	int failed = 0;
	for (uint64_t n = 1;; n++) {
		nv_files f;
		nv_make_files(&f, nv_dir(), 2, 1 << 20);
		struct kvt_nvme_config cfg = {f.ptrs, f.bytes, 2, 4, 0, 0};
		struct kvt_nvme *st = NULL;
		struct kvt_err err;
		kvt_mem_fail_at(n);
		int rc = kvt_nvme_open(&cfg, &st, &err);
		nv_unlink(&f);
		if (rc == 0) {
			/* Enough blocks that a free list must grow (allocate) in the write. */
			t_rng r;
			t_rng_seed(&r, n);
			struct kvt_nvme_block b[8];
			struct kvt_nvme_loc l[8];
			unsigned char *p = nv_random_payload(&r, 2048);
			for (int i = 0; i < 8; i++)
				b[i] = (struct kvt_nvme_block){nv_id(&r, 4, 128), p};
			rc = kvt_nvme_write_blocks(st, 8, b, l, &nv_err);
			if (rc == 0) {
				unsigned char out[2048];
				void *outs[1] = {out};
				rc = kvt_nvme_read_blocks(st, 1, l, &b[0].id, outs, &nv_err);
				T_CHECK(rc == 0 && memcmp(out, p, 2048) == 0,
					"read after allocation "
					"fault %llu: %d (%s)",
					(unsigned long long)n, rc, nv_err.msg);
				/*
				 * Two row ranges of a block not read before: the header prefetch and
				 * the header cache allocate, and a failure there is absorbed.
				 */
				unsigned char rows[2][1024];
				struct kvt_nvme_rows q[2] = {{l[1], b[1].id, 0, 2, rows[0]},
							     {l[1], b[1].id, 2, 4, rows[1]}};
				memset(rows, 0xa5, sizeof rows);
				rc = kvt_nvme_read_rows(st, 2, q, &nv_err);
				T_CHECK(rc == 0 && memcmp(rows, p, 2048) == 0,
					"row reads after allocation fault %llu: got %d (%s), wanted 0 "
					"and the payload", (unsigned long long)n, rc, nv_err.msg);
			} else {
				T_CHECK(rc == -ENOMEM && l[0].bytes == 0,
					"write under allocation fault "
					"%llu: got %d (%s), wanted -ENOMEM",
					(unsigned long long)n, rc, nv_err.msg);
			}
			kvt_nvme_close(st);
			free(p);
		} else {
			T_CHECK(rc == -ENOMEM && st == NULL,
				"open under allocation fault %llu: got %d (%s),"
				" wanted -ENOMEM",
				(unsigned long long)n, rc, err.msg);
		}
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		T_CHECK(kvt_mem_live() == live0 && t_fd_count() == fds0,
			"allocation fault %llu: live "
			"%lld (was %lld), fds %d (were %d)",
			(unsigned long long)n, (long long)kvt_mem_live(), (long long)live0,
			t_fd_count(), fds0);
		if (!fired)
			break;
		failed++;
	}
	printf("allocation faults injected: %d\n", failed);
	T_CHECK(failed >= 10, "only %d allocations in open/write/read", failed);
}

/*
 * Flip one bit of a block on disk (through a second, buffered descriptor), read it back whole and
 * read the one row around the flip (direct serving): every flip, in the header, the payload or the
 * padding, must be refused with -EBADMSG by both and the output left untouched; after the flip is
 * undone the block reads clean again.
 */
static void test_bit_flips(void **state)
{
	(void)state;
	nv_files f;
	int fd;
	struct kvt_nvme *st = nv_open_ex(&f, nv_dir(), 1, 4 << 20, 8, 0, 0, &fd);
	int rc;
	t_rng r;
	t_rng_seed(&r, 31337);
	enum { NBLK = 4, TRIALS = 3000 };
	const uint32_t rows[NBLK] = {1, 9, 33, 200};
	struct kvt_nvme_block b[NBLK];
	struct kvt_nvme_loc l[NBLK];
	unsigned char *p[NBLK];
	for (int i = 0; i < NBLK; i++) {
		b[i].id = nv_id(&r, rows[i], 128);
		p[i] = nv_random_payload(&r, kvt_nvme_payload_bytes(&b[i].id));
		b[i].payload = p[i];
	}
	rc = kvt_nvme_write_blocks(st, NBLK, b, l, &nv_err);
	T_CHECK(rc == 0, "write: %d (%s)", rc, nv_err.msg);
	unsigned char *out = t_alloc(200 * 512);
	uint32_t detected = 0, in_header = 0, in_payload = 0, in_pad = 0;
	for (int t = 0; t < TRIALS; t++) {
		int i = (int)t_below(&r, NBLK);
		/* The header with its padding, up to the aligned payload: [0, hb). */
		uint32_t pb = kvt_nvme_payload_bytes(&b[i].id),
			 hb = kvt_nvme_data_offset(pb, kvt_nvme_alignment(st));
		/* A third of the flips in the header, which is a small part of the bytes. */
		uint32_t byte = t % 3 ? t_below(&r, l[i].bytes) : t_below(&r, hb),
			 bit = t_below(&r, 8);
		in_header += byte < hb;
		in_payload += byte >= hb && byte < hb + pb;
		in_pad += byte >= hb + pb;
		unsigned char c;
		off_t at = (off_t)(l[i].offset + byte);
		T_CHECK(pread(fd, &c, 1, at) == 1, "pread: %s", strerror(errno));
		c ^= (unsigned char)(1u << bit);
		T_CHECK(pwrite(fd, &c, 1, at) == 1, "pwrite: %s", strerror(errno));
		memset(out, 0xa5, pb);
		void *outs[1] = {out};
		rc = kvt_nvme_read_blocks(st, 1, &l[i], &b[i].id, outs, &nv_err);
		int untouched = 1;
		for (uint32_t j = 0; j < pb && untouched; j++)
			untouched = out[j] == 0xa5;
		/* Direct serving reads one row: the one holding the flipped byte, or the last. */
		uint32_t row = byte < hb        ? t_below(&r, rows[i])
			       : byte < hb + pb ? (byte - hb) / 512
						: rows[i] - 1;
		struct kvt_nvme_rows q = {l[i], b[i].id, row, row + 1, out};
		int rc_rows = kvt_nvme_read_rows(st, 1, &q, &nv_err);
		for (uint32_t j = 0; j < 512 && untouched; j++)
			untouched = out[j] == 0xa5;
		detected += rc == -EBADMSG && rc_rows == -EBADMSG && untouched;
		T_CHECK(rc == -EBADMSG && rc_rows == -EBADMSG && untouched,
			"flip of bit %u of byte %u "
			"of block %d (%u header, %u payload bytes): got %d, row %u read got %d, "
			"output %s",
			bit, byte, i, hb, pb, rc, row, rc_rows,
			untouched ? "untouched" : "written");
		c ^= (unsigned char)(1u << bit);
		T_CHECK(pwrite(fd, &c, 1, at) == 1, "pwrite: %s", strerror(errno));
		rc = kvt_nvme_read_blocks(st, 1, &l[i], &b[i].id, outs, &nv_err);
		T_CHECK(rc == 0 && memcmp(out, p[i], pb) == 0,
			"block %d after undoing the flip: %d (%s)", i, rc, nv_err.msg);
	}
	printf("bit flips detected: %u of %u (%u in headers, %u in payloads, %u in padding); last: "
	       "%s\n",
	       detected, TRIALS, in_header, in_payload, in_pad, nv_err.msg);
	T_CHECK(detected == TRIALS, "detected %u of %u single-bit flips", detected, TRIALS);
	close(fd);
	kvt_nvme_close(st);
	free(out);
	for (int i = 0; i < NBLK; i++)
		free(p[i]);
}

int main(void)
{
	nv_skip_unless_available();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_completion_faults),
		cmocka_unit_test(test_alloc_faults),
		cmocka_unit_test(test_bit_flips),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
