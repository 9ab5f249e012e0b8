/* SPDX-License-Identifier: MIT */
/*
 * The NVMe store's hold on its files, and what it leaves on them (doc/data-at-rest.md):
 *   - a file is opened, created 0600 when missing (and then remembered as created by the store),
 *     and locked with flock(LOCK_EX | LOCK_NB) before anything else touches it, so a second store
 *     on the same file, in this process or another, is refused with -EBUSY naming the path and the
 *     holder's pid (from /proc/locks) instead of both writing blocks at the same offsets;
 *   - a file that is not new may hold a dead store's blocks (a killed process keeps no lock): its
 *     contents are discarded at open where the file system can punch holes, and in any case every
 *     block carries the random id of the store that wrote it (kvt_nv_store_id), which no later
 *     store shares;
 *   - freed blocks are zeroed (kvt_nvme_discard: closed sequences', restored ones, a failed
 *     write's), and at close the blocks still in use are zeroed too, then a created file is removed
 *     unless the caller keeps it;
 *   - running out of descriptors is -EMFILE / -ENFILE, a resource, not a missing feature.
 * Only built with liburing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "sysio.h"
#include "kvt_config.h"

#if KVT_HAVE_LIBURING
#include "nvme_priv.h"

/* errno of a failed open or io_uring set-up as a code: descriptors and memory are resources. */
int kvt_nv_errno_code(int e)
{
	return e == EMFILE ? -EMFILE : e == ENFILE ? -ENFILE : e == ENOMEM ? -ENOMEM : -EIO;
}

const char *kvt_nv_errno_hint(int e)
{
	return e == EMFILE   ? " (out of file descriptors: raise RLIMIT_NOFILE, ulimit -n)"
	       : e == ENFILE ? " (the system is out of file descriptors: fs.file-max)"
			     : "";
}

uint64_t kvt_nv_store_id(void)
{
	uint64_t id = 0;
	/* Never block: before the entropy pool is ready a mix of clock, pid and address is enough
	 * to tell this store from the one before it on the file, which is all the id is for. */
	if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		id = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 44) ^
		     (uint64_t)(uintptr_t)&id;
		id *= 0x9e3779b97f4a7c15ull;
	}
	return id;
}

/* The pid holding a flock on the file (dev, ino) according to /proc/locks, or 0. */
static int lock_holder(dev_t dev, ino_t ino)
{
	FILE *f = fopen("/proc/locks", "re");
	if (!f)
		return 0;
	char line[256], kind[16];
	int pid = 0;
	while (!pid && fgets(line, sizeof line, f)) {
		unsigned maj, min;
		unsigned long long in;
		int p;
		/* "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters have "->" before FLOCK */
		if (sscanf(line, "%*d: %15s %*s %*s %d %x:%x:%llu", kind, &p, &maj, &min, &in) == 5 &&
		    !strcmp(kind, "FLOCK") && maj == major(dev) && min == minor(dev) &&
		    in == (unsigned long long)ino && p > 0)
			pid = p;
	}
	fclose(f);
	return pid;
}

/* Whether pid is a live process: it exists (or is another user's) and has not exited. A process
 * that has exited but is not yet reaped (a zombie) still answers kill(pid, 0); its files, the lock
 * among them, are being released, so it counts as dead. */
static bool pid_alive(int pid)
{
	if (kill(pid, 0) != 0 && errno == ESRCH)
		return false;
	char path[32], buf[512];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return true;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	const char *end = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold ')' or spaces */
	return !end || end[1] != ' ' || (end[2] != 'Z' && end[2] != 'X');
}

/*
 * flock(LOCK_EX | LOCK_NB), waiting up to 2 s while the holder is not a live process: a dead
 * process's io_uring is torn down asynchronously, and its registered files (with the lock) are
 * released some milliseconds after its exit. Once the dead holder is reaped, /proc/locks shows
 * its pid as 0 (no such pid in this namespace), which is also how a holder in another pid
 * namespace shows: both are waited for, as is a holder that has exited but is not yet reaped (a
 * zombie), and a holder still there after 2 s is refused. A live holder this process can see is
 * refused at once.
 */
static int lock_file(int fd, const struct stat *sb)
{
	for (int tries = 0;; tries++) {
		if (flock(fd, LOCK_EX | LOCK_NB) == 0)
			return 0;
		if (errno != EWOULDBLOCK || tries == 200)
			return -1;
		int pid = lock_holder(sb->st_dev, sb->st_ino);
		if (pid > 0 && pid_alive(pid)) {
			errno = EWOULDBLOCK;
			return -1;
		}
		nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
	}
}

/* Open path, creating it (0600) when missing; *created says which. -1 with errno on failure. */
static int open_or_create(const char *path, int *created)
{
	for (int tries = 0; tries < 8; tries++) {
		int fd = kvt_sys_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		if (fd >= 0) {
			*created = 1;
			return fd;
		}
		if (errno != EEXIST)
			return -1;
		fd = kvt_sys_open(path, O_RDWR | O_CLOEXEC, 0);
		if (fd >= 0 || errno != ENOENT) {
			*created = 0;
			return fd;
		}
		/* removed between the two opens: create it after all */
	}
	errno = EBUSY;
	return -1;
}

int kvt_nv_file_open(struct nv_file *f, const char *path, int buffered, const char **mode,
		     struct kvt_err *err)
{
	int created = 0;
	f->fd = open_or_create(path, &created);
	if (f->fd < 0)
		return kvt_err_set(err, kvt_nv_errno_code(errno), "open %s: %s%s", path,
				   strerror(errno), kvt_nv_errno_hint(errno));
	struct stat sb;
	if (kvt_sys_fstat(f->fd, &sb) != 0) {
		int rc = kvt_err_set(err, -EIO, "fstat %s: %s", path, strerror(errno));
		/* created a moment ago by this O_EXCL open and not yet used: not left behind */
		if (created)
			unlink(path);
		return rc;
	}
	f->dev = sb.st_dev;
	f->ino = sb.st_ino;
	if (lock_file(f->fd, &sb) != 0) {
		int e = errno, pid = e == EWOULDBLOCK ? lock_holder(sb.st_dev, sb.st_ino) : 0;
		char who[64] = "holder's pid not visible here";
		if (pid == getpid())
			snprintf(who, sizeof who, "locked by this process, pid %d: the same file "
				 "under two paths?", pid);
		else if (pid)
			snprintf(who, sizeof who, "locked by pid %d", pid);
		if (e == EWOULDBLOCK)
			return kvt_err_set(err, -EBUSY,
					   "%s is in use by another kvtier store (%s): one file, one "
					   "store",
					   path, who);
		return kvt_err_set(err, -EIO, "flock %s: %s", path, strerror(e));
	}
	/* Only a file this store created and holds is ever removed by it. */
	f->created = created;
	*mode = buffered ? "buffered (KVT_NVME_BUFFERED)" : "O_DIRECT";
	int fl = fcntl(f->fd, F_GETFL);
	/* Some file systems (FUSE, tmpfs before 6.6) refuse O_DIRECT: go buffered. */
	if (!buffered && (fl < 0 || fcntl(f->fd, F_SETFL, fl | O_DIRECT) != 0))
		*mode = "buffered (O_DIRECT refused: EINVAL)";
	if (!created && S_ISREG(sb.st_mode) && sb.st_size > 0)
		/* A dead store's rows: gone where holes can be punched (its blocks are refused by
		 * store id anyway). */
		(void)fallocate(f->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, sb.st_size);
	return 0;
}

/* Zeros written over [off, off + len) of a file, through the (idle) bounce arena. */
static int zero_by_writing(struct kvt_nvme *st, struct nv_file *f, uint64_t off, uint64_t len)
{
	if (!st->arena)
		return -ENOMEM;
	size_t chunk = st->arena_bytes < ((size_t)1 << 20) ? st->arena_bytes : (size_t)1 << 20;
	memset(st->arena, 0, chunk);
	while (len) {
		size_t n = len < chunk ? (size_t)len : chunk;
		ssize_t w = pwrite(f->fd, st->arena, n, (off_t)off);
		if (w <= 0)
			return w < 0 ? -errno : -EIO;
		off += (uint64_t)w;
		len -= (uint64_t)w;
	}
	return 0;
}

/* Make [off, off + len) read as zeros, keeping its space reserved. 0 or a negative errno. */
static int zero_range(struct kvt_nvme *st, struct nv_file *f, uint64_t off, uint64_t len)
{
	if (f->is_blk) {
		uint64_t r[2] = {off, len};
		if (ioctl(f->fd, BLKZEROOUT, r) == 0)
			return 0;
	} else if (fallocate(f->fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, (off_t)off,
			     (off_t)len) == 0) {
		return 0;
	}
	return zero_by_writing(st, f, off, len);
}

void kvt_nvme_discard(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs)
{
	if (!st || !locs)
		return;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvt_nvme_loc *l = &locs[i];
		if (!l->bytes || l->file >= st->n_files ||
		    l->offset + l->bytes > st->files[l->file].bytes)
			continue;
		kvt_hc_drop(st, l->file, l->offset);
		if (zero_range(st, &st->files[l->file], l->offset, l->bytes) != 0)
			st->stats.discard_failures++;
	}
}

/* Zero what is in use in f (the gaps between its free extents): rows of sequences still open. */
static void zero_in_use(struct kvt_nvme *st, struct nv_file *f)
{
	const struct kvt_space *s = &f->space;
	if (!s->ext || s->free == s->capacity)
		return;
	uint64_t at = 0;
	for (uint32_t i = 0; i <= s->n; i++) {
		uint64_t end = i < s->n ? s->ext[i].off : s->capacity;
		if (end > at && zero_range(st, f, at, end - at) != 0)
			st->stats.discard_failures++;
		if (i < s->n)
			at = s->ext[i].off + s->ext[i].len;
	}
}

void kvt_nv_file_close(struct kvt_nvme *st, struct nv_file *f, int remove)
{
	if (f->fd < 0)
		return;
	struct stat sb;
	/* Remove only the file this store created, and only while the path still names it. */
	if (remove && f->created && f->path && stat(f->path, &sb) == 0 && sb.st_dev == f->dev &&
	    sb.st_ino == f->ino)
		unlink(f->path);
	else
		zero_in_use(st, f);
	close(f->fd); /* drops the lock */
	f->fd = -1;
}

uint64_t kvt_nvme_store_id(const struct kvt_nvme *st)
{
	return st ? st->store_id : 0;
}

#endif
