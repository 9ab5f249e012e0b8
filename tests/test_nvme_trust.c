/* SPDX-License-Identifier: MIT */
/*
 * Who may read and write an NVMe file of the tier (suite nvme), each case a regression test of
 * issue #11:
 *   - two caches in one process, and two processes, on one path: the second create fails with
 *     -EBUSY naming the path (and the holder's pid), the first keeps its rows;
 *   - a block written by another store (same identity, same offset) is refused with -EBADMSG
 *     naming the store id, never served; a file left by a killed process is reused, its old
 *     blocks refused, new ones served;
 *   - running out of descriptors at create is -EMFILE (a resource), never -EOPNOTSUPP;
 *   - a failed create removes the files it created and no other; destroy removes them unless
 *     KVT_NVME_KEEP_FILES; created files are mode 0600;
 *   - a closed sequence's spilled blocks, and a destroyed cache's, are zeroed on disk and cannot
 *     be read as that sequence again.
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

#include "tier_util.h"

enum { D = 64, TOKENS = 600 }; /* 2 full blocks per head spill, the rest stays in the window */

/* K then V of every token of one layer and head, fp16, [TOKENS, D] each, from a seed. */
struct rows {
	uint16_t k[TOKENS * D], v[TOKENS * D];
};

static void make_rows(struct rows *r, uint64_t seed)
{
	t_rng g;
	t_rng_seed(&g, seed);
	t_fill(&g, KVT_DTYPE_F16, TOKENS * D, 0.3, 1.0, r->k, NULL);
	t_fill(&g, KVT_DTYPE_F16, TOKENS * D, -0.2, 1.0, r->v, NULL);
}

static kvt_config tier_config(const char *const *paths, const uint64_t *bytes, uint32_t n)
{
	kvt_config cfg = t_config(1, 1, 1, D, KVT_DTYPE_F16);
	cfg.n_nvme = n;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = bytes;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	return cfg;
}

/* Open a sequence, prefill rows, spill it; returns the sequence. */
static uint32_t fill_and_spill(kvt_cache *c, const struct rows *r, const char *what)
{
	uint32_t s;
	int rc = kvt_seq_open(c, &s);
	T_CHECK(rc == 0, "%s: kvt_seq_open got %d (%s), wanted 0", what, rc, kvt_last_error(c));
	rc = kvt_prefill(c, s, 0, NULL, r->k, r->v, TOKENS, NULL);
	T_CHECK(rc == 0, "%s: kvt_prefill got %d (%s), wanted 0", what, rc, kvt_last_error(c));
	int64_t m = kvt_seq_spill(c, s);
	T_CHECK(m > 0, "%s: kvt_seq_spill got %lld (%s), wanted > 0", what, (long long)m,
		kvt_last_error(c));
	return s;
}

/*
 * Restore s and compare its host rows with r: the first token that differs, -1 when none does,
 * -2 when the restore fails (its code and text printed). No cmocka check: forked children use it.
 */
static long restore_and_compare(kvt_cache *c, uint32_t s, const struct rows *r, const char *what)
{
	int64_t m = kvt_seq_restore(c, s);
	if (m <= 0) {
		print_message("%s: kvt_seq_restore got %lld (%s), wanted > 0\n", what, (long long)m,
			      kvt_last_error(c));
		return -2;
	}
	const struct kvt_layer *l = &c->seqs[s].layers[0];
	for (uint32_t t = 0; t < 2 * KVT_BLOCK_TOKENS; t++) {
		const uint16_t *row = (const uint16_t *)l->blocks[t / KVT_BLOCK_TOKENS] +
				      (size_t)(t % KVT_BLOCK_TOKENS) * 2 * D;
		if (memcmp(row, r->k + (size_t)t * D, 2 * D) ||
		    memcmp(row + D, r->v + (size_t)t * D, 2 * D))
			return (long)t;
	}
	return -1;
}

static void scratch_path(char *buf, size_t n, const char *tag)
{
	snprintf(buf, n, "%s/kvt-trust-%s-%d", nv_dir(), tag, (int)getpid());
	unlink(buf);
}

/* ---- one file, one store --------------------------------------------------------------------- */

static void test_two_caches_one_path(void **state)
{
	(void)state;
	tt_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "two-caches");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)8 << 20};
	kvt_config cfg = tier_config(paths, bytes, 1);
	struct rows *ra = t_alloc(sizeof *ra), *rb = t_alloc(sizeof *rb);
	make_rows(ra, 1);
	make_rows(rb, 2);
	kvt_cache *a = t_create(&cfg);
	uint32_t sa = fill_and_spill(a, ra, "cache A");
	kvt_cache *b = NULL;
	int rc = kvt_cache_create(&cfg, &b);
	const char *msg = kvt_last_error(NULL);
	char pid[32];
	snprintf(pid, sizeof pid, "pid %d", (int)getpid());
	print_message("second cache on %s: %d (%s)\n", path, rc, msg);
	if (rc == 0) /* today's defect: both run; show what A gets back */
		fill_and_spill(b, rb, "cache B");
	long bad = restore_and_compare(a, sa, ra, "cache A after B");
	kvt_cache_destroy(b);
	kvt_cache_destroy(a);
	unlink(path);
	T_CHECK(rc == -EBUSY && strstr(msg, path) && strstr(msg, pid),
		"second cache on one path: got %d (\"%s\"), wanted -EBUSY naming %s and %s", rc, msg,
		path, pid);
	T_CHECK(bad == -1, "cache A after cache B used its file: got %s %ld, wanted its own rows",
		bad == -2 ? "a failed restore" : "other rows from token", bad);
	free(ra);
	free(rb);
}

/* Two processes: the child holds the file; the parent's create must be refused by name. */
static void test_two_processes_one_path(void **state)
{
	(void)state;
	tt_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "two-procs");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)8 << 20};
	kvt_config cfg = tier_config(paths, bytes, 1);
	int up[2], down[2];
	T_CHECK(pipe(up) == 0 && pipe(down) == 0, "pipe: %s", strerror(errno));
	pid_t child = fork();
	T_CHECK(child >= 0, "fork: %s", strerror(errno));
	if (child == 0) {
		/* The child: hold the file with a spilled sequence until the parent is done. */
		struct rows *r = malloc(sizeof *r);
		kvt_cache *c = NULL;
		char ok = 'n';
		if (r && kvt_cache_create(&cfg, &c) == 0) {
			make_rows(r, 3);
			uint32_t s;
			if (kvt_seq_open(c, &s) == 0 &&
			    kvt_prefill(c, s, 0, NULL, r->k, r->v, TOKENS, NULL) == 0 &&
			    kvt_seq_spill(c, s) > 0)
				ok = restore_and_compare(c, s, r, "child") == -1 ? 'y' : 'n';
			if (ok == 'y' && kvt_seq_spill(c, s) <= 0)
				ok = 'n';
		}
		(void)!write(up[1], &ok, 1);
		char go;
		(void)!read(down[0], &go, 1);
		/* after the parent tried: the child's rows must still be its own */
		int fine = ok == 'y' && c && restore_and_compare(c, 0, r, "child after parent") == -1;
		kvt_cache_destroy(c);
		_exit(fine ? 0 : 1);
	}
	char ok = 0;
	T_CHECK(read(up[0], &ok, 1) == 1 && ok == 'y', "child could not spill (got '%c')", ok);
	struct rows *r = t_alloc(sizeof *r);
	make_rows(r, 4);
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	char msg[512];
	snprintf(msg, sizeof msg, "%s", kvt_last_error(NULL));
	if (rc == 0) /* today's defect: the parent spills over the child's blocks */
		fill_and_spill(c, r, "parent");
	kvt_cache_destroy(c);
	(void)!write(down[1], "g", 1);
	int status = 0;
	waitpid(child, &status, 0);
	unlink(path);
	char pid[32];
	snprintf(pid, sizeof pid, "pid %d", (int)child);
	print_message("parent's cache on the child's file: %d (%s)\n", rc, msg);
	T_CHECK(rc == -EBUSY && strstr(msg, path) && strstr(msg, pid),
		"a second process on one path: got %d (\"%s\"), wanted -EBUSY naming %s and %s", rc,
		msg, path, pid);
	T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		"the child's rows after the parent's attempt: got exit status 0x%x, wanted 0 (its own "
		"rows back)", status);
	free(r);
	close(up[0]);
	close(up[1]);
	close(down[0]);
	close(down[1]);
}

/* ---- blocks of another store ----------------------------------------------------------------- */

/* Write one block of identity id in st; return its loc. */
static struct kvt_nvme_loc put_block(struct kvt_nvme *st, const struct kvt_nvme_block_id *id,
				     const void *payload)
{
	struct kvt_nvme_block b = {*id, payload};
	struct kvt_nvme_loc loc;
	int rc = kvt_nvme_write_blocks(st, 1, &b, &loc, &nv_err);
	T_CHECK(rc == 0, "kvt_nvme_write_blocks: got %d (%s), wanted 0", rc, nv_err.msg);
	return loc;
}

/*
 * A block of another store at the very offset and with the very identity this store wrote there
 * (the image of issue #11's repro, which no lock can rule out once a file is reused) is refused.
 */
static void test_foreign_block(void **state)
{
	(void)state;
	nv_skip_unless_available();
	nv_files fa, fb;
	int fda = -1, fdb = -1;
	struct kvt_nvme *a = nv_open_ex(&fa, nv_dir(), 1, (uint64_t)4 << 20, 4, 0, 0, &fda);
	struct kvt_nvme *b = nv_open_ex(&fb, nv_dir(), 1, (uint64_t)4 << 20, 4, 0, 0, &fdb);
	t_rng g;
	t_rng_seed(&g, 0x5707e1d);
	struct kvt_nvme_block_id id = nv_id(&g, 256, D);
	uint32_t p = kvt_nvme_payload_bytes(&id);
	unsigned char *pa = nv_random_payload(&g, p), *pb = nv_random_payload(&g, p),
		      *out = t_alloc(p);
	struct kvt_nvme_loc la = put_block(a, &id, pa), lb = put_block(b, &id, pb);
	T_CHECK(la.offset == lb.offset && la.bytes == lb.bytes,
		"both stores' first block: got offsets %llu and %llu, wanted equal",
		(unsigned long long)la.offset, (unsigned long long)lb.offset);
	unsigned char *img = t_alloc(la.bytes);
	T_CHECK(pread(fda, img, la.bytes, (off_t)la.offset) == (ssize_t)la.bytes &&
			pwrite(fdb, img, la.bytes, (off_t)lb.offset) == (ssize_t)la.bytes &&
			fdatasync(fdb) == 0,
		"copying A's block over B's: %s", strerror(errno));
	void *outs[1] = {out};
	int rc = kvt_nvme_read_blocks(b, 1, &lb, &id, outs, &nv_err);
	print_message("store B reading store A's block: %d (%s)\n", rc, nv_err.msg);
	T_CHECK(rc == -EBADMSG && strstr(nv_err.msg, "store"),
		"store B reading store A's image: got %d (\"%s\"%s), wanted -EBADMSG naming the store",
		rc, nv_err.msg, rc == 0 && !memcmp(out, pa, p) ? ", A's rows served" : "");
	struct kvt_nvme_rows q = {lb, id, 3, 9, out};
	rc = kvt_nvme_read_rows(b, 1, &q, &nv_err);
	T_CHECK(rc == -EBADMSG && strstr(nv_err.msg, "store"),
		"store B reading rows of store A's image: got %d (\"%s\"), wanted -EBADMSG naming the "
		"store", rc, nv_err.msg);
	kvt_nvme_close(a);
	kvt_nvme_close(b);
	close(fda);
	close(fdb);
	free(img);
	free(pa);
	free(pb);
	free(out);
}

/*
 * A child process that opens a store on cfg's file, writes blk into it when given (its place in
 * *loc, zero without a block), tells the parent, and is killed while it holds the file: no close,
 * so the kernel drops the lock when the process is gone. Returns its pid, not yet waited for.
 */
static pid_t killed_holder(const struct kvt_nvme_config *cfg, const struct kvt_nvme_block *blk,
			   struct kvt_nvme_loc *loc)
{
	int up[2];
	T_CHECK(pipe(up) == 0, "pipe: %s", strerror(errno));
	pid_t child = fork();
	T_CHECK(child >= 0, "fork: %s", strerror(errno));
	if (child == 0) {
		struct kvt_nvme *st = NULL;
		struct kvt_nvme_loc at = {0, 0, 0};
		int rc = kvt_nvme_open(cfg, &st, NULL);
		if (rc == 0 && blk)
			kvt_nvme_write_blocks(st, 1, blk, &at, NULL);
		(void)!write(up[1], &rc, sizeof rc);
		(void)!write(up[1], &at, sizeof at);
		raise(SIGKILL);
		_exit(1);
	}
	int rc = -1;
	T_CHECK(read(up[0], &rc, sizeof rc) == sizeof rc && rc == 0 &&
			read(up[0], loc, sizeof *loc) == sizeof *loc,
		"the child could not open %s: %d", cfg->paths[0], rc);
	close(up[0]);
	close(up[1]);
	return child;
}

/*
 * A process killed while it holds a file: the kernel releases its lock, and the next store reuses
 * the file. The dead store's blocks are refused (another store id), new blocks work.
 */
static void test_killed_leftover(void **state)
{
	(void)state;
	nv_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "killed");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)4 << 20};
	struct kvt_nvme_config cfg = {paths, bytes, 1, 4, 0, 0};
	t_rng g;
	t_rng_seed(&g, 0xdead5eed);
	struct kvt_nvme_block_id id = nv_id(&g, 256, D);
	uint32_t p = kvt_nvme_payload_bytes(&id);
	unsigned char *old = nv_random_payload(&g, p), *fresh = nv_random_payload(&g, p),
		      *out = t_alloc(p);
	const struct kvt_nvme_block blk = {id, old};
	struct kvt_nvme_loc loc;
	pid_t child = killed_holder(&cfg, &blk, &loc);
	T_CHECK(loc.bytes, "the child wrote no block");
	int status = 0;
	waitpid(child, &status, 0);
	T_CHECK(WIFSIGNALED(status), "child: got status 0x%x, wanted killed", status);
	struct kvt_nvme *st = NULL;
	int rc = kvt_nvme_open(&cfg, &st, &nv_err);
	T_CHECK(rc == 0, "reopening %s after its holder was killed: got %d (%s), wanted 0", path, rc,
		nv_err.msg);
	void *outs[1] = {out};
	rc = kvt_nvme_read_blocks(st, 1, &loc, &id, outs, &nv_err);
	print_message("the dead store's block read by its successor: %d (%s)\n", rc, nv_err.msg);
	T_CHECK(rc == -EBADMSG, "the dead store's block: got %d (\"%s\"%s), wanted -EBADMSG", rc,
		nv_err.msg, rc == 0 && !memcmp(out, old, p) ? ", its rows served" : "");
	struct kvt_nvme_loc nl = put_block(st, &id, fresh);
	rc = kvt_nvme_read_blocks(st, 1, &nl, &id, outs, &nv_err);
	T_CHECK(rc == 0 && !memcmp(out, fresh, p),
		"a new block in the reused file: got %d (%s), rows %s; wanted 0 and its rows", rc,
		nv_err.msg, memcmp(out, fresh, p) ? "differ" : "equal");
	kvt_nvme_close(st);
	unlink(path);
	free(old);
	free(fresh);
	free(out);
}

/*
 * A holder killed but not yet reaped (a zombie: kill(pid, 0) still succeeds) releases its lock a
 * few milliseconds after its exit, as a reaped one does: create waits for it instead of refusing
 * at once (it used to refuse with -EBUSY "locked by pid" every time).
 */
static void test_zombie_holder(void **state)
{
	(void)state;
	nv_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "zombie");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)4 << 20};
	struct kvt_nvme_config cfg = {paths, bytes, 1, 4, 0, 0};
	for (int it = 0; it < 3; it++) {
		struct kvt_nvme_loc loc;
		pid_t child = killed_holder(&cfg, NULL, &loc);
		siginfo_t si;
		T_CHECK(waitid(P_PID, (id_t)child, &si, WEXITED | WNOWAIT) == 0, "waitid: %s",
			strerror(errno));
		struct kvt_nvme *st = NULL;
		int rc = kvt_nvme_open(&cfg, &st, &nv_err);
		waitpid(child, NULL, 0);
		T_CHECK(rc == 0, "round %d: opening %s while its killed holder is not yet reaped: got %d "
			"(%s), wanted 0", it, path, rc, nv_err.msg);
		kvt_nvme_close(st);
	}
	unlink(path);
}

/*
 * Close releases the file at once: the ring's registered files are unregistered before the files
 * are closed, so a store reopened right after close (on the same path) is never -EBUSY.
 */
static void test_reopen_after_close(void **state)
{
	(void)state;
	nv_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "reopen");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)1 << 20};
	struct kvt_nvme_config cfg = {paths, bytes, 1, 4, 0, KVT_NVME_KEEP};
	for (int i = 0; i < 20; i++) {
		struct kvt_nvme *st = NULL;
		int rc = kvt_nvme_open(&cfg, &st, &nv_err);
		kvt_nvme_close(st);
		T_CHECK(rc == 0, "open %d of %s right after the previous close: got %d (%s), wanted 0",
			i, path, rc, nv_err.msg);
	}
	unlink(path);
}

/* ---- out of descriptors ---------------------------------------------------------------------- */

/* The lowest descriptor number not open now (a limit of that many leaves no room for one more). */
static int lowest_free_fd(void)
{
	int fd = dup(0);
	if (fd >= 0)
		close(fd);
	return fd;
}

static void test_fd_exhaustion(void **state)
{
	(void)state;
	tt_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "emfile");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)4 << 20};
	kvt_config cfg = tier_config(paths, bytes, 1);
	kvt_cache *warm = t_create(&cfg); /* whatever create opens for good is open from here on */
	kvt_cache_destroy(warm);
	int base = lowest_free_fd();
	int fails = 0;
	/* Limits from "no descriptor left" up: every create ends in 0 or -EMFILE, named. */
	for (int extra = 0; extra < 4; extra++) {
		int pipefd[2];
		T_CHECK(pipe(pipefd) == 0, "pipe: %s", strerror(errno));
		pid_t child = fork();
		T_CHECK(child >= 0, "fork: %s", strerror(errno));
		if (child == 0) {
			close(pipefd[0]);
			int wfd = fcntl(pipefd[1], F_DUPFD, 1000);
			close(pipefd[1]);
			struct rlimit rl = {(rlim_t)(base + extra), (rlim_t)(base + extra)};
			char res[600];
			kvt_cache *c = NULL;
			if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
				snprintf(res, sizeof res, "setrlimit");
			} else {
				int rc = kvt_cache_create(&cfg, &c);
				snprintf(res, sizeof res, "%d\t%s", rc, rc ? kvt_last_error(NULL) : "");
				kvt_cache_destroy(c);
			}
			(void)!write(wfd, res, strlen(res) + 1);
			_exit(0);
		}
		close(pipefd[1]);
		char res[600] = "";
		ssize_t got = read(pipefd[0], res, sizeof res - 1);
		close(pipefd[0]);
		waitpid(child, NULL, 0);
		T_CHECK(got > 0, "limit %d: the child reported nothing", base + extra);
		int rc = atoi(res);
		const char *msg = strchr(res, '\t') ? strchr(res, '\t') + 1 : res;
		print_message("RLIMIT_NOFILE %d: create %d (%s)\n", base + extra, rc, msg);
		if (rc != 0 && !(rc == -EMFILE && strstr(msg, "descriptor")))
			fails++, print_error("RLIMIT_NOFILE %d: got %d (%s: \"%s\"), wanted 0 or -EMFILE "
					     "naming descriptors\n", base + extra, rc, kvt_strerror(rc), msg);
	}
	unlink(path);
	T_CHECK(fails == 0, "%d of 4 limits gave a wrong code", fails);
	T_CHECK(strcmp(kvt_strerror(-EMFILE), "unknown error code") != 0 &&
			strcmp(kvt_strerror(-ENFILE), "unknown error code") != 0,
		"kvt_strerror(-EMFILE) = \"%s\", (-ENFILE) = \"%s\": wanted texts",
		kvt_strerror(-EMFILE), kvt_strerror(-ENFILE));
}

/* ---- files the library created --------------------------------------------------------------- */

static int exists(const char *path)
{
	struct stat sb;
	return stat(path, &sb) == 0;
}

static void test_failed_create_cleans_up(void **state)
{
	(void)state;
	tt_skip_unless_available();
	char made[4096], theirs[4096];
	scratch_path(made, sizeof made, "made");
	tt_files f;
	tt_make_files(&f, 1, 0);
	snprintf(theirs, sizeof theirs, "%s", f.paths[0]);
	const char *bad = "/nonexistent-kvtier-dir/file";
	const char *paths[3] = {made, theirs, bad};
	uint64_t bytes[3] = {(uint64_t)4 << 20, (uint64_t)4 << 20, (uint64_t)4 << 20};
	kvt_config cfg = tier_config(paths, bytes, 3);
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	int made_left = exists(made), theirs_left = exists(theirs);
	unlink(made);
	unlink(theirs);
	T_CHECK(rc != 0 && !c, "create with %s: got %d, wanted a failure", bad, rc);
	T_CHECK(!made_left, "failed create: %s, which it created, got left behind, wanted removed",
		made);
	T_CHECK(theirs_left, "failed create: %s, which it did not create, got removed, wanted kept",
		theirs);
	/* the same when the store opened and a later step of the create failed, even with
	 * KVT_NVME_KEEP_FILES: the N-th allocation fails, N = 1, 2, ... until none fires */
	const char *one[1] = {made};
	cfg = tier_config(one, bytes, 1);
	cfg.nvme_flags = KVT_NVME_KEEP_FILES;
	uint64_t n = 1, failed = 0, left = 0;
	int fired = 1, kept = 0;
	for (; fired && n < 4096; n++) {
		kvt_mem_fail_at(n);
		rc = kvt_cache_create(&cfg, &c);
		fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc == 0) {
			kvt_cache_destroy(c);
			kept = exists(made); /* a cache that was made keeps its file */
		} else {
			failed++;
			left += exists(made);
		}
		unlink(made);
	}
	print_message("KVT_NVME_KEEP_FILES: %llu creates failed by an allocation, of %llu tried\n",
		      (unsigned long long)failed, (unsigned long long)(n - 1));
	T_CHECK(!fired && failed > 0 && left == 0 && kept,
		"KVT_NVME_KEEP_FILES, the N-th allocation failed: %llu of %llu failed creates left "
		"%s behind (wanted none); the last create %s it (wanted kept)",
		(unsigned long long)left, (unsigned long long)failed, made,
		kept ? "kept" : "did not keep");
}

/* Nonzero bytes in [off, off + n) of fd, or -1 when it cannot be read. */
static long nonzero_bytes(int fd, uint64_t off, uint64_t n)
{
	unsigned char *buf = t_alloc(n);
	long nz = pread(fd, buf, n, (off_t)off) == (ssize_t)n ? 0 : -1;
	for (uint64_t i = 0; nz >= 0 && i < n; i++)
		nz += buf[i] != 0;
	free(buf);
	return nz;
}

static void test_destroy_removes_created(void **state)
{
	(void)state;
	tt_skip_unless_available();
	char path[4096];
	scratch_path(path, sizeof path, "destroy");
	const char *paths[1] = {path};
	uint64_t bytes[1] = {(uint64_t)8 << 20};
	kvt_config cfg = tier_config(paths, bytes, 1);
	mode_t old = umask(0); /* the mode must come from the library, not the umask */
	kvt_cache *c = t_create(&cfg);
	umask(old);
	struct stat sb;
	T_CHECK(stat(path, &sb) == 0 && (sb.st_mode & 07777) == 0600,
		"mode of the created %s: got %04o, wanted 0600", path, (unsigned)(sb.st_mode & 07777));
	struct rows *r = t_alloc(sizeof *r);
	make_rows(r, 5);
	fill_and_spill(c, r, "destroy");
	kvt_cache_destroy(c);
	int left = exists(path);
	unlink(path);
	free(r);
	T_CHECK(!left, "%s after destroy: got still there, wanted removed (created by the cache)",
		path);
	/* asked to keep it: the file stays, 0600, with no row left in it */
	cfg.nvme_flags = KVT_NVME_KEEP_FILES;
	c = t_create(&cfg);
	r = t_alloc(sizeof *r);
	make_rows(r, 7);
	fill_and_spill(c, r, "keep");
	kvt_cache_destroy(c);
	free(r);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	long nz = fd >= 0 ? nonzero_bytes(fd, 0, bytes[0]) : -1;
	int mode = fd >= 0 && fstat(fd, &sb) == 0 ? (int)(sb.st_mode & 07777) : -1;
	if (fd >= 0)
		close(fd);
	unlink(path);
	T_CHECK(fd >= 0 && nz == 0 && mode == 0600,
		"%s after destroy with KVT_NVME_KEEP_FILES: got %s, %ld nonzero bytes, mode %04o; "
		"wanted kept, 0, 0600", path, fd >= 0 ? "kept" : "removed", nz, (unsigned)mode);
	cfg.nvme_flags = 0x6;
	c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	const char *msg = kvt_last_error(NULL);
	T_CHECK(rc == -EINVAL && strstr(msg, "nvme_flags = 0x6") && !exists(path),
		"nvme_flags 0x6: got %d (%s), %s; wanted -EINVAL naming it, no file", rc, msg,
		exists(path) ? "file created" : "no file");
}

/* A cache on one 8 MiB file of the caller's (it exists before create), NVMe queue depth qd (0: the
 * default), and *fd a descriptor of the file to look at what stays on it. */
static kvt_cache *caller_file_cache(tt_files *f, uint32_t qd, int *fd)
{
	tt_make_files(f, 1, (uint64_t)8 << 20);
	kvt_config cfg = tier_config(f->ptrs, f->bytes, 1);
	cfg.nvme_queue_depth = qd;
	kvt_cache *c = t_create(&cfg);
	*fd = open(f->paths[0], O_RDONLY | O_CLOEXEC);
	T_CHECK(*fd >= 0, "open %s: %s", f->paths[0], strerror(errno));
	return c;
}

/*
 * A closed sequence's blocks: zeroed on disk, and their identity (sequence uid, generation, store
 * id) refused at their old place. The cache's destroy zeroes the blocks of sequences still open.
 * The file is the caller's (it existed before create), so it stays, empty of rows.
 */
static void test_closed_seq_discarded(void **state)
{
	(void)state;
	tt_skip_unless_available();
	tt_files f;
	int fd;
	kvt_cache *c = caller_file_cache(&f, 0, &fd);
	struct rows *r = t_alloc(sizeof *r);
	make_rows(r, 6);
	uint32_t s = fill_and_spill(c, r, "closed seq");
	const struct kvt_layer *l = &c->seqs[s].layers[0];
	struct kvt_nvme_loc loc = l->spill[1].loc;
	struct kvt_nvme_block_id id = {.seq = l->seq_uid, .generation = l->spill[1].gen,
				       .first_token = KVT_BLOCK_TOKENS, .n_tokens = KVT_BLOCK_TOKENS,
				       .layer = 0, .kv_head = 0, .head_dim = D,
				       .flags = KVT_DTYPE_F16};
	long before = nonzero_bytes(fd, loc.offset, loc.bytes);
	void *out = t_alloc(kvt_nvme_payload_bytes(&id));
	int rc = kvt_nvme_read_blocks(c->nvme, 1, &loc, &id, &out, &nv_err);
	T_CHECK(before > 0 && rc == 0, "the spilled block @ %llu: got %ld nonzero bytes, read %d "
		"(%s); wanted > 0 and 0", (unsigned long long)loc.offset, before, rc, nv_err.msg);
	T_CHECK(kvt_seq_close(c, s) == 0, "kvt_seq_close: %s", kvt_last_error(c));
	long after = nonzero_bytes(fd, loc.offset, loc.bytes);
	rc = kvt_nvme_read_blocks(c->nvme, 1, &loc, &id, &out, &nv_err);
	print_message("closed sequence's block: %ld nonzero bytes, read as it: %d (%s)\n", after, rc,
		      nv_err.msg);
	T_CHECK(after == 0, "the closed sequence's block @ %llu: got %ld nonzero bytes, wanted 0",
		(unsigned long long)loc.offset, after);
	T_CHECK(rc == -EBADMSG, "reading the closed sequence's block as it: got %d (%s), wanted "
		"-EBADMSG", rc, nv_err.msg);
	fill_and_spill(c, r, "open at destroy");
	kvt_cache_destroy(c);
	struct stat sb;
	T_CHECK(fstat(fd, &sb) == 0, "fstat: %s", strerror(errno));
	long left = nonzero_bytes(fd, 0, (uint64_t)sb.st_size);
	int kept = exists(f.paths[0]);
	tt_unlink(&f);
	close(fd);
	free(out);
	free(r);
	T_CHECK(left == 0, "the caller's file after destroy: got %ld nonzero bytes, wanted 0", left);
	T_CHECK(kept, "%s (not created by the cache) after destroy: got removed, wanted kept",
		f.paths[0]);
}

/* An injected error on the n-th completion of a write (2: the spill's second block). */
static int fail_second(void *ctx, uint64_t nth, int res)
{
	(void)ctx;
	return nth == 2 ? -EIO : res;
}

/*
 * Space freed while the sequence stays open is zeroed too: a restored sequence's blocks (its rows
 * are in host memory now), and what a spill that failed part way had written.
 */
static void test_freed_space_zeroed(void **state)
{
	(void)state;
	tt_skip_unless_available();
	tt_files f;
	int fd;
	/* queue depth 1: the second block's write completes after the first's */
	kvt_cache *c = caller_file_cache(&f, 1, &fd);
	struct rows *r = t_alloc(sizeof *r);
	make_rows(r, 8);
	uint32_t s = fill_and_spill(c, r, "restored");
	const struct kvt_nvme_loc loc = c->seqs[s].layers[0].spill[1].loc;
	const long before = nonzero_bytes(fd, loc.offset, loc.bytes);
	const long bad = restore_and_compare(c, s, r, "restored");
	const long after = nonzero_bytes(fd, loc.offset, loc.bytes);
	T_CHECK(bad == -1 && before > 0 && after == 0, "restore: rows %s; the block @ %llu had %ld "
		"nonzero bytes, then %ld (wanted the rows back and 0)", bad == -1 ? "back" : "WRONG",
		(unsigned long long)loc.offset, before, after);
	kvt_nvme_set_cqe_hook(c->nvme, fail_second, NULL);
	const int64_t m = kvt_seq_spill(c, s);
	kvt_nvme_set_cqe_hook(c->nvme, NULL, NULL);
	const long written = nonzero_bytes(fd, 0, f.bytes[0]);
	print_message("spill with its 2nd write failed: %lld (%s); %ld nonzero bytes in the file\n",
		      (long long)m, kvt_last_error(c), written);
	T_CHECK(m == -EIO && written == 0, "spill with its second write failed: got %lld, %ld "
		"nonzero bytes in the file; wanted -EIO, 0", (long long)m, written);
	uint64_t nvme = 1;
	T_CHECK(kvt_seq_bytes(c, s, NULL, &nvme) == 0 && nvme == 0,
		"after the failed spill: %llu bytes on NVMe, wanted 0", (unsigned long long)nvme);
	kvt_cache_destroy(c);
	close(fd);
	tt_unlink(&f);
	free(r);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_two_caches_one_path),
		cmocka_unit_test(test_two_processes_one_path),
		cmocka_unit_test(test_foreign_block),
		cmocka_unit_test(test_killed_leftover),
		cmocka_unit_test(test_zombie_holder),
		cmocka_unit_test(test_reopen_after_close),
		cmocka_unit_test(test_fd_exhaustion),
		cmocka_unit_test(test_failed_create_cleans_up),
		cmocka_unit_test(test_destroy_removes_created),
		cmocka_unit_test(test_closed_seq_discarded),
		cmocka_unit_test(test_freed_space_zeroed),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
