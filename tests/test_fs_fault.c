/* SPDX-License-Identifier: MIT */
/*
 * Faults at the file-system and io_uring set-up calls of the NVMe tier (host/sysio.h): at
 * kvt_cache_create with an NVMe tier of two files, each wrapped call (open, fstat, ftruncate,
 * fallocate, statx, io_uring_setup, buffer and file registration) is made to fail in turn, N = 1,
 * 2, ... until no call is left to fail, with each of several errno values. Every run must:
 *   - end in success (where the store has a fallback: buffered I/O when O_DIRECT is refused, no
 *     preallocation without fallocate, another alignment source without statx, plain I/O without
 *     registration, a second io_uring_setup without COOP_TASKRUN) or in a documented error
 *     (-EIO, -ENOSPC, -ENOMEM, -EOPNOTSUPP, -EINVAL) whose text names the call, and the file's path
 *     for the per-file calls; ENOSPC from ftruncate or fallocate must read -ENOSPC;
 *   - leak nothing: kvt_mem_live() and the descriptors in /proc/self/fd as before;
 *   - leave the directory as it was: no file appears, the caller's files stay.
 * With --fresh the files do not exist before the create (the library creates them), and a failed
 * create must also remove what it created (issue 11, defect 6).
 *
 * Also: a FIFO as the NVMe file is refused (-EINVAL naming it); io_uring denied by a seccomp
 * filter (ENOSYS and EPERM from io_uring_setup, in a forked child with no_new_privs) must give
 * -EOPNOTSUPP and a text that names io_uring; and where the machine lets us attach a loop device
 * with 4096-byte logical sectors, a cache on it must spill its rows and restore them verified, and
 * asking for more bytes than the device holds must be refused naming it (skipped with the reason
 * where no loop device can be attached).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/loop.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "host/sysio.h"
#include "nvme_util.h"

#define NFILES 2
#define FILE_BYTES ((uint64_t)4 << 20)

static int fresh; /* --fresh: the library creates the files */

static kvt_config fs_config(const char *const *paths, const uint64_t *bytes, uint32_t n)
{
	kvt_config cfg = t_config(1, 2, 1, 64, KVT_DTYPE_F16);
	cfg.host_bytes = (uint64_t)8 << 20;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = bytes;
	cfg.n_nvme = n;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	cfg.nvme_queue_depth = 4;
	return cfg;
}

/*
 * The scratch directory in use (empty: none), removed by remove_dir, and also on every way out of a
 * test that skips it: a failed check (the tests' teardown), exit, and SIGINT, SIGTERM or SIGHUP.
 */
static char scratch[4096];
/* Every name a test creates in its scratch directory (what the signal handler unlinks). */
static const char *const scratch_names[] = {"store", "store-0", "store-1", "backing", "fifo"};
static pid_t scratch_owner; /* a forked child never removes its parent's directory */

/* Async-signal-safe: only unlink and rmdir of names known in advance. */
static void drop_scratch_names(void)
{
	char p[4200];
	if (!scratch[0] || getpid() != scratch_owner)
		return;
	for (size_t i = 0; i < sizeof scratch_names / sizeof scratch_names[0]; i++) {
		size_t n = strlen(scratch), m = strlen(scratch_names[i]);
		memcpy(p, scratch, n);
		p[n] = '/';
		memcpy(p + n + 1, scratch_names[i], m + 1);
		unlink(p);
	}
	rmdir(scratch);
}

static void on_signal(int sig)
{
	drop_scratch_names();
	signal(sig, SIG_DFL);
	raise(sig);
}

/* A private scratch directory under nv_dir(), so that the directory listing is ours alone. */
static void make_dir(char *dir, size_t n)
{
	snprintf(dir, n, "%s/kvt-fs-fault-XXXXXX", nv_dir());
	T_CHECK(mkdtemp(dir) != NULL, "mkdtemp %s: %s", dir, strerror(errno));
	snprintf(scratch, sizeof scratch, "%s", dir);
	scratch_owner = getpid();
}

/* Names in dir, sorted into one string (for comparing listings). */
static void listing(const char *dir, char *out, size_t n)
{
	char names[16][256];
	int k = 0;
	DIR *d = opendir(dir);
	T_CHECK(d != NULL, "opendir %s: %s", dir, strerror(errno));
	for (struct dirent *e; (e = readdir(d)) && k < 16;)
		if (e->d_name[0] != '.')
			snprintf(names[k++], sizeof names[0], "%s", e->d_name);
	closedir(d);
	qsort(names, (size_t)k, sizeof names[0], (int (*)(const void *, const void *))strcmp);
	size_t used = 0;
	out[0] = 0;
	for (int i = 0; i < k; i++)
		used += (size_t)snprintf(out + used, n - used, "%s ", names[i]);
}

static void remove_dir(const char *dir)
{
	DIR *d = opendir(dir);
	char p[4096];
	if (d) {
		for (struct dirent *e; (e = readdir(d));)
			if (e->d_name[0] != '.') {
				snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
				unlink(p);
			}
		closedir(d);
	}
	rmdir(dir);
	if (!strcmp(dir, scratch))
		scratch[0] = 0;
}

/* After every test, whether it passed or a check failed half way. */
static int teardown(void **state)
{
	(void)state;
	if (scratch[0])
		remove_dir(scratch);
	return 0;
}

/* What a failure of `call` with errno `e` may return, and must return where it is not a choice. */
static int rc_allowed(enum kvt_sys_call call, int e, int rc)
{
	if (rc != -EIO && rc != -ENOSPC && rc != -ENOMEM && rc != -EOPNOTSUPP && rc != -EINVAL &&
	    rc != -EMFILE && rc != -ENFILE)
		return 0;
	/* issue 11, defect 5: running out of descriptors is said so, not "no io_uring" */
	if ((call == KVT_SYS_OPEN || call == KVT_SYS_URING_SETUP) && e == EMFILE)
		return rc == -EMFILE;
	if ((call == KVT_SYS_FTRUNCATE || call == KVT_SYS_FALLOCATE) && e == ENOSPC)
		return rc == -ENOSPC;
	if (call == KVT_SYS_URING_SETUP && e == ENOMEM)
		return rc == -ENOMEM;
	return 1;
}

/* The word the error text must contain for a failure of `call`. */
static const char *call_word(enum kvt_sys_call call)
{
	return call == KVT_SYS_URING_SETUP ? "io_uring" : kvt_sys_call_name(call);
}

static const int errnos[] = {EIO, ENOSPC, ENOMEM, EINVAL, EOPNOTSUPP, EACCES, EMFILE};

/*
 * One create with wrapped call n failing with errno e. Returns the call that failed (KVT_SYS_NONE
 * when n is past the last call); fails the test on any broken property.
 */
static enum kvt_sys_call one_create(uint64_t n, int e, uint32_t *failed, uint32_t *recovered)
{
	char dir[4096], paths[NFILES][4200], before[1024], after[1024], name[96];
	const char *ptrs[NFILES];
	uint64_t bytes[NFILES];
	make_dir(dir, sizeof dir);
	for (int i = 0; i < NFILES; i++) {
		snprintf(paths[i], sizeof paths[i], "%s/store-%d", dir, i);
		ptrs[i] = paths[i];
		bytes[i] = FILE_BYTES;
		if (!fresh) {
			int fd = open(paths[i], O_RDWR | O_CREAT | O_CLOEXEC, 0600);
			T_CHECK(fd >= 0, "create %s: %s", paths[i], strerror(errno));
			close(fd);
		}
	}
	listing(dir, before, sizeof before);
	kvt_config cfg = fs_config(ptrs, bytes, NFILES);
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	kvt_cache *c = NULL;
	kvt_sys_fail_at(n, e);
	int rc = kvt_cache_create(&cfg, &c);
	enum kvt_sys_call call = kvt_sys_fired_call();
	kvt_sys_fail_at(0, 0);
	char msg[1024];
	snprintf(msg, sizeof msg, "%s", kvt_last_error(NULL));
	snprintf(name, sizeof name, "call %llu (%s) failing with %s", (unsigned long long)n,
		 kvt_sys_call_name(call), strerrorname_np(e));
	if (rc == 0) {
		T_CHECK(c != NULL, "%s: create returned 0 without a cache", name);
		/* the fallback must leave a working tier: one block of rows out and back */
		uint32_t s;
		T_CHECK(kvt_seq_open(c, &s) == 0, "%s: kvt_seq_open failed", name);
		enum { T = 300 };
		static uint16_t k[T * 64], v[T * 64];
		t_rng r;
		t_rng_seed(&r, n * 131 + (uint64_t)e);
		t_fill(&r, KVT_DTYPE_F16, T * 64, 0, 1, k, NULL);
		t_fill(&r, KVT_DTYPE_F16, T * 64, 0, 1, v, NULL);
		T_CHECK(kvt_prefill(c, s, 0, NULL, k, v, T, NULL) == 0, "%s: prefill: %s", name,
			kvt_last_error(c));
		int64_t out = kvt_seq_spill(c, s), back = kvt_seq_restore(c, s);
		T_CHECK(out > 0 && back == out, "%s: spill got %lld, restore got %lld, wanted equal and "
			"> 0 (%s)", name, (long long)out, (long long)back, kvt_last_error(c));
		kvt_cache_destroy(c);
		if (call != KVT_SYS_NONE)
			++*recovered;
	} else {
		T_CHECK(call != KVT_SYS_NONE, "create failed with no injected failure: got %d (%s)",
			rc, msg);
		T_CHECK(rc_allowed(call, e, rc), "%s: got %d (%s: %s), not the documented error", name,
			rc, kvt_strerror(rc), msg);
		T_CHECK(strstr(msg, call_word(call)) != NULL, "%s: the text does not name the call: "
			"got \"%s\", wanted it to contain \"%s\"", name, msg, call_word(call));
		if (call != KVT_SYS_URING_SETUP && call != KVT_SYS_URING_REG_BUFFERS &&
		    call != KVT_SYS_URING_REG_FILES)
			T_CHECK(strstr(msg, "/store-") != NULL, "%s: the text does not name the path: "
				"got \"%s\"", name, msg);
		T_CHECK(strstr(msg, strerror(e)) != NULL, "%s: the text does not give the cause: got "
			"\"%s\", wanted it to contain \"%s\"", name, msg, strerror(e));
		++*failed;
	}
	T_CHECK(kvt_mem_live() == live, "%s: live allocations got %lld, wanted %lld", name,
		(long long)kvt_mem_live(), (long long)live);
	T_CHECK(t_fd_count() == fds, "%s: open descriptors got %d, wanted %d", name, t_fd_count(),
		fds);
	listing(dir, after, sizeof after);
	remove_dir(dir);
	T_CHECK(rc == 0 || strcmp(before, after) == 0, "%s: files in the directory got \"%s\", wanted "
		"\"%s\" as before the create", name, after, before);
	return call;
}

static void test_fail_each_call(void **state)
{
	(void)state;
	uint32_t seen[KVT_SYS_NCALLS] = {0}, failed = 0, recovered = 0, runs = 0;
	uint64_t n = 1;
	for (;; n++) {
		enum kvt_sys_call call = KVT_SYS_NONE;
		for (size_t i = 0; i < sizeof errnos / sizeof errnos[0]; i++) {
			enum kvt_sys_call got = one_create(n, errnos[i], &failed, &recovered);
			runs++;
			/* the calls before n are the same whatever n fails with */
			T_CHECK(i == 0 || got == call, "call %llu: got %s with %s, %s before",
				(unsigned long long)n, kvt_sys_call_name(got),
				strerrorname_np(errnos[i]), kvt_sys_call_name(call));
			call = got;
		}
		if (call == KVT_SYS_NONE)
			break;
		seen[call]++;
	}
	print_message("%s files: %llu wrapped calls failed in turn with %zu errno values: %u runs, "
		      "%u failed as documented, %u recovered; calls reached:", fresh ? "fresh" : "existing",
		      (unsigned long long)(n - 1), sizeof errnos / sizeof errnos[0], runs, failed,
		      recovered);
	for (int k = 1; k < KVT_SYS_NCALLS; k++)
		print_message(" %s %u", kvt_sys_call_name((enum kvt_sys_call)k), seen[k]);
	print_message("\n");
	/* every wrapped call must have been reached (statx where the C library has STATX_DIOALIGN) */
	for (int k = 1; k < KVT_SYS_NCALLS; k++) {
#ifndef STATX_DIOALIGN
		if (k == KVT_SYS_STATX)
			continue;
#endif
		T_CHECK(seen[k] > 0, "the wrapped call %s was never reached (got 0 times, wanted > 0)",
			kvt_sys_call_name((enum kvt_sys_call)k));
	}
}

/* ---- io_uring denied by seccomp ------------------------------------------------------------- */

#if defined(__x86_64__)
#define ARCH_NR AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH_NR AUDIT_ARCH_AARCH64
#endif

#if defined(ARCH_NR) && defined(__NR_io_uring_setup)
/* In the child: deny io_uring_setup with errno e, allow everything else. */
static int deny_io_uring(int e)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH_NR, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((unsigned)e & SECCOMP_RET_DATA)),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
		return -errno;
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
		return -errno;
	return 0;
}

/* The child's body: 0 when the create failed as wanted, else a code naming what went wrong. */
static int seccomp_child(int e, const char *path)
{
	int rc = deny_io_uring(e);
	if (rc) {
		printf("seccomp %s: cannot install the filter: %s\n", strerrorname_np(e),
		       strerror(-rc));
		return 3;
	}
	const char *ptrs[1] = {path};
	uint64_t bytes[1] = {FILE_BYTES};
	kvt_config cfg = fs_config(ptrs, bytes, 1);
	kvt_cache *c = NULL;
	rc = kvt_cache_create(&cfg, &c);
	const char *msg = kvt_last_error(NULL);
	printf("seccomp %s: kvt_cache_create got %d (%s): %s\n", strerrorname_np(e), rc,
	       kvt_strerror(rc), msg);
	if (rc != -EOPNOTSUPP) {
		printf("  wanted %d (-EOPNOTSUPP)\n", -EOPNOTSUPP);
		kvt_cache_destroy(c);
		return 1;
	}
	if (!strstr(msg, "io_uring") || !strstr(msg, strerror(e))) {
		printf("  wanted a text naming io_uring and \"%s\"\n", strerror(e));
		return 2;
	}
	struct kvt_err why;
	if (kvt_nvme_available(&why)) {
		printf("  kvt_nvme_available got 1, wanted 0 under the filter\n");
		return 4;
	}
	return 0;
}
#endif

static void test_seccomp_denied(void **state)
{
	(void)state;
#if defined(ARCH_NR) && defined(__NR_io_uring_setup)
	static const int denied[] = {ENOSYS, EPERM};
	for (size_t i = 0; i < 2; i++) {
		char dir[4096], path[4200];
		make_dir(dir, sizeof dir);
		snprintf(path, sizeof path, "%s/store", dir);
		fflush(stdout);
		pid_t pid = fork();
		T_CHECK(pid >= 0, "fork: %s", strerror(errno));
		if (pid == 0) {
			int code = seccomp_child(denied[i], path);
			fflush(stdout);
			_exit(code);
		}
		int status = 0;
		T_CHECK(waitpid(pid, &status, 0) == pid, "waitpid: %s", strerror(errno));
		remove_dir(dir);
		T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
			"io_uring_setup denied with %s by seccomp: the child got status 0x%x, wanted "
			"exit 0 (its output above says why)", strerrorname_np(denied[i]), status);
	}
#else
	print_message("SKIP seccomp case: no seccomp architecture number for this machine\n");
#endif
}

/* ---- a device of 4096-byte logical sectors -------------------------------------------------- */

/* Attach `file` to a free loop device with 4096-byte sectors; its path in dev, or -errno. */
static int loop_attach_once(const char *file, char *dev, size_t n, int *dev_fd, char *why,
			    size_t wn)
{
	int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
	if (ctl < 0) {
		snprintf(why, wn, "open /dev/loop-control: %s", strerror(errno));
		return -errno;
	}
	int nr = ioctl(ctl, LOOP_CTL_GET_FREE);
	close(ctl);
	if (nr < 0) {
		snprintf(why, wn, "LOOP_CTL_GET_FREE: %s", strerror(errno));
		return -errno;
	}
	snprintf(dev, n, "/dev/loop%d", nr);
	int fd = open(dev, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		snprintf(why, wn, "open %s: %s", dev, strerror(errno));
		return -errno;
	}
	int back = open(file, O_RDWR | O_CLOEXEC);
	struct loop_config lc;
	memset(&lc, 0, sizeof lc);
	lc.fd = (uint32_t)back;
	lc.block_size = 4096;
	lc.info.lo_flags = LO_FLAGS_AUTOCLEAR;
	int rc = back < 0 ? -1 : ioctl(fd, LOOP_CONFIGURE, &lc);
	int e = errno;
	if (back >= 0)
		close(back);
	if (rc != 0) {
		snprintf(why, wn, "LOOP_CONFIGURE %s (4096-byte sectors): %s", dev, strerror(e));
		close(fd);
		return -e;
	}
	*dev_fd = fd;
	return 0;
}

/* Another process may take the free device between the query and the attach: try again. */
static int loop_attach(const char *file, char *dev, size_t n, int *dev_fd, char *why, size_t wn)
{
	int rc = -EBUSY;
	for (int i = 0; i < 5 && rc == -EBUSY; i++)
		rc = loop_attach_once(file, dev, n, dev_fd, why, wn);
	return rc;
}

static void test_4k_sectors(void **state)
{
	(void)state;
	char dir[4096], file[4200], dev[64], why[256];
	make_dir(dir, sizeof dir);
	snprintf(file, sizeof file, "%s/backing", dir);
	int bf = open(file, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	T_CHECK(bf >= 0 && ftruncate(bf, (off_t)FILE_BYTES) == 0, "backing file %s: %s", file,
		strerror(errno));
	close(bf);
	int dev_fd = -1;
	if (loop_attach(file, dev, sizeof dev, &dev_fd, why, sizeof why) != 0) {
		print_message("SKIP 4096-byte sector case: no loop device here (%s)\n", why);
		remove_dir(dir);
		return;
	}
	int ss = 0;
	ioctl(dev_fd, BLKSSZGET, &ss);
	const char *ptrs[1] = {dev};
	uint64_t bytes[1] = {FILE_BYTES};
	kvt_config cfg = fs_config(ptrs, bytes, 1);
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	char msg[1024];
	snprintf(msg, sizeof msg, "%s", kvt_last_error(NULL));
	int64_t out = -1, back = -1;
	int same = 0;
	if (rc == 0) {
		uint32_t s;
		enum { T = 600 };
		static uint16_t k[T * 64], v[T * 64];
		t_rng r;
		t_rng_seed(&r, 4096);
		t_fill(&r, KVT_DTYPE_F16, T * 64, 0, 1, k, NULL);
		t_fill(&r, KVT_DTYPE_F16, T * 64, 0, 1, v, NULL);
		if (kvt_seq_open(c, &s) == 0 && kvt_prefill(c, s, 0, NULL, k, v, T, NULL) == 0) {
			out = kvt_seq_spill(c, s);
			/* restore verifies every block (header, identity, crc32c) it reads back */
			back = kvt_seq_restore(c, s);
			same = back == out;
		}
		kvt_cache_destroy(c);
	}
	close(dev_fd); /* autoclear detaches the device */
	print_message("4096-byte sectors on %s (BLKSSZGET %d): create %d, spill %lld, restore %lld\n",
		      dev, ss, rc, (long long)out, (long long)back);
	/* more bytes than the device holds: refused, naming the device */
	uint64_t big[1] = {2 * FILE_BYTES};
	cfg.nvme_bytes = big;
	int rc_big = -1;
	char msg_big[1024] = "";
	if (loop_attach(file, dev, sizeof dev, &dev_fd, why, sizeof why) == 0) {
		c = NULL;
		rc_big = kvt_cache_create(&cfg, &c);
		snprintf(msg_big, sizeof msg_big, "%s", kvt_last_error(NULL));
		kvt_cache_destroy(rc_big == 0 ? c : NULL);
		close(dev_fd);
	}
	remove_dir(dir);
	T_CHECK(ss == 4096, "%s: logical sector size got %d, wanted 4096", dev, ss);
	T_CHECK(rc_big == -EINVAL && strstr(msg_big, dev), "%llu bytes on a device of %llu: got %d "
		"(%s), wanted -EINVAL naming %s", (unsigned long long)big[0],
		(unsigned long long)FILE_BYTES, rc_big, msg_big, dev);
	T_CHECK(rc == 0, "create on %s: got %d (%s), wanted 0", dev, rc, msg);
	T_CHECK(out > 0 && same, "%s: spill got %lld bytes, restore got %lld, wanted equal and > 0",
		dev, (long long)out, (long long)back);
}

/* A FIFO as the NVMe file: refused with -EINVAL naming the path, nothing leaked, FIFO kept. */
static void test_not_a_file(void **state)
{
	(void)state;
	char dir[4096], path[4200];
	make_dir(dir, sizeof dir);
	snprintf(path, sizeof path, "%s/fifo", dir);
	T_CHECK(mkfifo(path, 0600) == 0, "mkfifo %s: %s", path, strerror(errno));
	const char *ptrs[1] = {path};
	uint64_t bytes[1] = {FILE_BYTES};
	kvt_config cfg = fs_config(ptrs, bytes, 1);
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	char msg[1024];
	snprintf(msg, sizeof msg, "%s", kvt_last_error(NULL));
	struct stat st;
	int kept = stat(path, &st) == 0 && S_ISFIFO(st.st_mode);
	remove_dir(dir);
	kvt_cache_destroy(rc == 0 ? c : NULL);
	T_CHECK(rc == -EINVAL, "a FIFO as the NVMe file: got %d (%s), wanted -EINVAL", rc, msg);
	T_CHECK(strstr(msg, path) && strstr(msg, "neither a regular file nor a block device"),
		"a FIFO as the NVMe file: the text \"%s\" does not name the path and the reason",
		msg);
	T_CHECK(kvt_mem_live() == live && t_fd_count() == fds, "a FIFO as the NVMe file: live "
		"allocations %lld (wanted %lld), descriptors %d (wanted %d)",
		(long long)kvt_mem_live(), (long long)live, t_fd_count(), fds);
	T_CHECK(kept, "a FIFO as the NVMe file: the FIFO is gone or changed after the refusal");
}

static int setup(void **state)
{
	(void)state;
	nv_skip_unless_available();
	return 0;
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--fresh")) {
			fresh = 1;
		} else {
			fprintf(stderr, "usage: %s [--fresh]\n", argv[0]);
			return 2;
		}
	}
	t_warm_runtime();
	atexit(drop_scratch_names);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGHUP, on_signal);
	const struct CMUnitTest all[] = {
		cmocka_unit_test_teardown(test_fail_each_call, teardown),
		cmocka_unit_test_teardown(test_seccomp_denied, teardown),
		cmocka_unit_test_teardown(test_not_a_file, teardown),
		cmocka_unit_test_teardown(test_4k_sectors, teardown),
	};
	const struct CMUnitTest only_fresh[] = {
		cmocka_unit_test_teardown(test_fail_each_call, teardown)};
	return fresh ? cmocka_run_group_tests(only_fresh, setup, NULL)
		     : cmocka_run_group_tests(all, setup, NULL);
}
