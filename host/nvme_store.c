/* SPDX-License-Identifier: MIT */
/*
 * The NVMe block store: opening the files (size, preallocation, DIO alignment, O_DIRECT or the
 * buffered fallback), the ring and the registered bounce pool, and the queries. The I/O engine is
 * in nvme_engine.c, the calls in nvme_write.c and nvme_read.c, the header cache in nvme_hcache.c;
 * nvme_store.h states the contract, doc/nvme-format.md the bytes on disk.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvt_config.h"
#include "alloc.h"
#include "crc32c.h"
#include "nvme_store.h"
#include "sysio.h"

#if KVT_HAVE_LIBURING
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/sysmacros.h>

#include "nvme_priv.h"

/* Each registered buffer must stay under the kernel's 1 GiB limit per iovec. */
#define MAX_BOUNCE ((uint32_t)1 << 30)
#define MAX_POOL ((uint64_t)16 << 30)

static uint64_t round_up(uint64_t x, uint32_t a)
{
	return (x + a - 1) & ~(uint64_t)(a - 1);
}

/* ---- open and close ------------------------------------------------------------------------ */

/* The block size of the device holding st_dev: BLKSSZGET on its node, else sysfs; 0 if unknown. */
static uint32_t device_block_size(dev_t dev)
{
	char path[96];
	int v = 0;
	snprintf(path, sizeof path, "/dev/block/%u:%u", major(dev), minor(dev));
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (ioctl(fd, BLKSSZGET, &v) != 0)
			v = 0;
		close(fd);
		if (v > 0)
			return (uint32_t)v;
	}
	/* A partition has no queue/ of its own: its disk's is one level up. */
	for (int up = 0; up < 2; up++) {
		snprintf(path, sizeof path, "/sys/dev/block/%u:%u/%squeue/logical_block_size",
			 major(dev), minor(dev), up ? "../" : "");
		FILE *f = fopen(path, "re");
		if (!f)
			continue;
		int ok = fscanf(f, "%d", &v) == 1 && v > 0;
		fclose(f);
		if (ok)
			return (uint32_t)v;
	}
	return 0;
}

/* The DIO alignment of an open file, and where the figure came from (why, n bytes). */
static uint32_t file_alignment(int fd, const struct stat *sb, char *why, size_t n)
{
#ifdef STATX_DIOALIGN
	struct statx sx;
	if (kvt_sys_statx_fd(fd, STATX_DIOALIGN, &sx) == 0 &&
	    (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align) {
		snprintf(why, n, "statx DIOALIGN (memory %u, offset %u)", sx.stx_dio_mem_align,
			 sx.stx_dio_offset_align);
		return sx.stx_dio_offset_align > sx.stx_dio_mem_align ? sx.stx_dio_offset_align
								      : sx.stx_dio_mem_align;
	}
#endif
	int v = 0;
	if (S_ISBLK(sb->st_mode) && ioctl(fd, BLKSSZGET, &v) == 0 && v > 0) {
		snprintf(why, n, "BLKSSZGET on the device");
		return (uint32_t)v;
	}
	uint32_t b = device_block_size(sb->st_dev);
	if (b) {
		snprintf(why, n, "logical block size of device %u:%u", major(sb->st_dev),
			 minor(sb->st_dev));
		return b;
	}
	snprintf(why, n, "no DIO alignment reported, 4096 assumed");
	return 4096;
}

static int open_file(struct kvt_nvme *st, uint32_t i, const char *path, uint64_t bytes,
		     int buffered, uint32_t *align, char *note, size_t note_n, struct kvt_err *err)
{
	struct nv_file *f = &st->files[i];
	f->path_bytes = strlen(path) + 1;
	f->path = kvt_mem_alloc(KVT_MEM_HOST, f->path_bytes);
	if (!f->path)
		return kvt_err_set(err, -ENOMEM, "no memory for the path of file %u", i);
	memcpy(f->path, path, f->path_bytes);
	const char *mode;
	int rc = kvt_nv_file_open(f, path, buffered, &mode, err);
	if (rc)
		return rc;
	struct stat sb;
	if (kvt_sys_fstat(f->fd, &sb) != 0)
		return kvt_err_set(err, -EIO, "fstat %s: %s", path, strerror(errno));
	f->is_blk = S_ISBLK(sb.st_mode);
	const char *prealloc = "preallocated";
	if (S_ISBLK(sb.st_mode)) {
		uint64_t dev_bytes = 0;
		if (ioctl(f->fd, BLKGETSIZE64, &dev_bytes) != 0)
			return kvt_err_set(err, -EIO, "BLKGETSIZE64 %s: %s", path, strerror(errno));
		if (bytes > dev_bytes)
			return kvt_err_set(err, -EINVAL,
				      "bytes[%u] = %" PRIu64 " but block device %s holds %" PRIu64,
				      i, bytes, path, dev_bytes);
		prealloc = "block device";
	} else if (!S_ISREG(sb.st_mode)) {
		return kvt_err_set(err, -EINVAL, "%s is neither a regular file nor a block device", path);
	} else {
		if (kvt_sys_ftruncate(f->fd, (off_t)bytes) != 0)
			return kvt_err_set(err, errno == ENOSPC || errno == EFBIG ? -ENOSPC : -EIO,
				      "ftruncate %s to %" PRIu64 " bytes: %s", path, bytes,
				      strerror(errno));
		/* Reserve the space now, so no write can fail later for want of it. */
		if (kvt_sys_fallocate(f->fd, 0, 0, (off_t)bytes) != 0) {
			if (errno == ENOSPC)
				return kvt_err_set(err, -ENOSPC, "fallocate %s of %" PRIu64 " bytes: %s",
					      path, bytes, strerror(errno));
			if (errno != EOPNOTSUPP)
				return kvt_err_set(err, -EIO, "fallocate %s: %s", path, strerror(errno));
			prealloc = "not preallocated (fallocate unsupported)";
		}
	}
	char why[96];
	uint32_t a = file_alignment(f->fd, &sb, why, sizeof why);
	if (a < 512 || (a & (a - 1)) || a > (1u << 20))
		return kvt_err_set(err, -EINVAL,
			      "%s: DIO alignment %u (%s) is not a power of two in 512..1M", path, a,
			      why);
	if (a > *align)
		*align = a;
	f->bytes = bytes;
	snprintf(note, note_n, "; file %u %s: %s, %s, align %u from %s", i, path, mode, prealloc, a,
		 why);
	return 0;
}

static int check_config(const struct kvt_nvme_config *cfg, struct kvt_err *err)
{
	if (!cfg || !cfg->paths || !cfg->bytes)
		return kvt_err_set(err, -EINVAL, "config, paths and bytes must not be NULL");
	if (cfg->n_files < 1 || cfg->n_files > KVT_NVME_MAX_FILES)
		return kvt_err_set(err, -EINVAL, "n_files = %u, must be 1..%u", cfg->n_files,
			      KVT_NVME_MAX_FILES);
	if (cfg->queue_depth > KVT_NVME_MAX_QD)
		return kvt_err_set(err, -EINVAL, "queue_depth = %u, must be 0 (default %u) .. %u",
			      cfg->queue_depth, KVT_NVME_DEFAULT_QD, KVT_NVME_MAX_QD);
	const uint32_t known = KVT_NVME_BUFFERED | KVT_NVME_KEEP;
	if (cfg->flags & ~known)
		return kvt_err_set(err, -EINVAL, "flags = 0x%x: unknown bits 0x%x", cfg->flags,
			      cfg->flags & ~known);
	if (cfg->bounce_bytes > MAX_BOUNCE)
		return kvt_err_set(err, -EINVAL, "bounce_bytes = %u, must be at most %u",
			      cfg->bounce_bytes, MAX_BOUNCE);
	for (uint32_t i = 0; i < cfg->n_files; i++) {
		if (!cfg->paths[i] || !cfg->paths[i][0])
			return kvt_err_set(err, -EINVAL, "paths[%u] is empty", i);
		if (cfg->bytes[i] < 4096 || cfg->bytes[i] > (uint64_t)INT64_MAX)
			return kvt_err_set(err, -EINVAL,
				      "bytes[%u] = %" PRIu64 " (%s): must be 4096 .. 2^63", i,
				      cfg->bytes[i], cfg->paths[i]);
	}
	return 0;
}

static int setup_ring(struct kvt_nvme *st, struct kvt_err *err)
{
	struct io_uring_params p;
	memset(&p, 0, sizeof p);
	/* Cooperative task running saves an interrupt per completion (kernel >= 5.19). */
	p.flags = IORING_SETUP_COOP_TASKRUN;
	int rc = kvt_sys_uring_init(st->qd, &st->ring, &p);
	if (rc == -EINVAL) {
		memset(&p, 0, sizeof p);
		rc = kvt_sys_uring_init(st->qd, &st->ring, &p);
	}
	/* A lack of descriptors or memory is transient, not a kernel without io_uring. */
	if (rc == -ENOMEM || rc == -EMFILE || rc == -ENFILE)
		return kvt_err_set(err, kvt_nv_errno_code(-rc), "io_uring_queue_init(%u): %s%s", st->qd,
				   strerror(-rc), kvt_nv_errno_hint(-rc));
	if (rc < 0)
		return kvt_err_set(err, -EOPNOTSUPP,
			      "the kernel refuses io_uring (io_uring_setup: %s; see "
			      "/proc/sys/kernel/io_uring_disabled and seccomp filters)",
			      strerror(-rc));
	st->ring_ok = 1;
	return 0;
}

static int alloc_pools(struct kvt_nvme *st, struct kvt_err *err)
{
	/*
	 * Twice as many bounce slots as I/Os in flight: a block's slots stay taken from its read's
	 * completion until it is verified and copied out, and meanwhile the other half keeps the
	 * device's queue full. A block of k slots has at most k + 1 pieces (header and data
	 * ranges).
	 */
	st->n_slots = 2 * st->qd;
	st->n_ops = 2 * st->n_slots + 2;
	st->arena_bytes = (size_t)st->n_slots * st->bounce;
	st->arena = kvt_mem_alloc(KVT_MEM_PAGES, st->arena_bytes);
	st->slot_used = kvt_mem_alloc(KVT_MEM_HOST, st->n_slots);
	st->ops = kvt_mem_alloc(KVT_MEM_HOST, st->n_ops * sizeof *st->ops);
	st->op_free = kvt_mem_alloc(KVT_MEM_HOST, st->n_ops * sizeof *st->op_free);
	st->pending = kvt_mem_alloc(KVT_MEM_HOST, st->n_ops * sizeof *st->pending);
	st->reqs = kvt_mem_alloc(KVT_MEM_HOST, st->n_slots * sizeof *st->reqs);
	st->req_free = kvt_mem_alloc(KVT_MEM_HOST, st->n_slots * sizeof *st->req_free);
	st->ready = kvt_mem_alloc(KVT_MEM_HOST, st->n_slots * sizeof *st->ready);
	st->cqp = kvt_mem_alloc(KVT_MEM_HOST, st->qd * sizeof *st->cqp);
	st->cqes = kvt_mem_alloc(KVT_MEM_HOST, st->qd * sizeof *st->cqes);
	st->hc = kvt_mem_alloc(KVT_MEM_HOST, KVT_HC_ENTRIES * sizeof *st->hc);
	st->hc_bucket = kvt_mem_alloc(KVT_MEM_HOST, KVT_HC_BUCKETS * sizeof *st->hc_bucket);
	if (!st->arena || !st->slot_used || !st->ops || !st->op_free || !st->pending || !st->reqs ||
	    !st->req_free || !st->ready || !st->cqp || !st->cqes || !st->hc || !st->hc_bucket)
		return kvt_err_set(err, -ENOMEM,
			      "no memory for the bounce pool (%u x %u bytes) or its tables",
			      st->n_slots, st->bounce);
	memset(st->hc, 0, KVT_HC_ENTRIES * sizeof *st->hc);
	for (uint32_t i = 0; i < KVT_HC_BUCKETS; i++)
		st->hc_bucket[i] = KVT_HC_NONE;
	return 0;
}

/* Register the bounce slots and files; where the kernel says no, plain I/O does the job. */
static void register_all(struct kvt_nvme *st, char *note, size_t n)
{
	size_t used = 0;
	struct iovec *iov = kvt_mem_alloc(KVT_MEM_HOST, st->n_slots * sizeof *iov);
	int rc = -ENOMEM;
	if (iov) {
		for (uint32_t i = 0; i < st->n_slots; i++) {
			iov[i].iov_base = st->arena + (size_t)i * st->bounce;
			iov[i].iov_len = st->bounce;
		}
		rc = kvt_sys_uring_register_buffers(&st->ring, iov, st->n_slots);
		kvt_mem_free(KVT_MEM_HOST, iov, st->n_slots * sizeof *iov);
	}
	st->fixed_bufs = rc == 0;
	used += (size_t)snprintf(note + used, n - used, "%s",
				 rc == 0 ? "registered" : "unregistered");
	if (rc)
		used += (size_t)snprintf(note + used, n - used, " (%s, RLIMIT_MEMLOCK?)",
					 strerror(-rc));
	int fds[KVT_NVME_MAX_FILES];
	for (uint32_t i = 0; i < st->n_files; i++)
		fds[i] = st->files[i].fd;
	rc = kvt_sys_uring_register_files(&st->ring, fds, st->n_files);
	st->fixed_files = rc == 0;
	snprintf(note + used, n - used, ", files %s%s%s", rc == 0 ? "registered" : "plain (",
		 rc == 0 ? "" : strerror(-rc), rc == 0 ? "" : ")");
}

/* Open every file, then size its free list to the alignment all of them agree on. */
static int open_files(struct kvt_nvme *st, const struct kvt_nvme_config *cfg, char *notes,
		      size_t n, struct kvt_err *err)
{
	int rc = 0;
	size_t nl = 0;
	st->align = 512;
	for (uint32_t i = 0; !rc && i < st->n_files; i++) {
		rc = open_file(st, i, cfg->paths[i], cfg->bytes[i],
			       !!(cfg->flags & KVT_NVME_BUFFERED), &st->align, notes + nl, n - nl,
			       err);
		nl = strlen(notes);
	}
	for (uint32_t i = 0; !rc && i < st->n_files; i++) {
		struct nv_file *f = &st->files[i];
		f->bytes &= ~(uint64_t)(st->align - 1);
		rc = kvt_space_init(&f->space, f->bytes);
		if (rc)
			kvt_err_set(err, rc, "no memory for the free list of %s", f->path);
	}
	return rc;
}

/* One bounce slot: the configured size rounded up to the alignment, under the pool's limits. */
static int size_bounce(struct kvt_nvme *st, const struct kvt_nvme_config *cfg, struct kvt_err *err)
{
	uint64_t b = round_up(cfg->bounce_bytes ? cfg->bounce_bytes : KVT_NVME_DEFAULT_BOUNCE,
			      st->align);
	if (b > MAX_BOUNCE || b * 2 * st->qd > MAX_POOL)
		return kvt_err_set(err, -EINVAL,
				   "bounce pool of %u x %" PRIu64 " bytes exceeds %" PRIu64,
				   2 * st->qd, b, MAX_POOL);
	st->bounce = (uint32_t)b;
	return 0;
}

/* Everything open needs that can fail; st is closed by the caller on error. */
static int open_all(struct kvt_nvme *st, const struct kvt_nvme_config *cfg, char *notes,
		    size_t n, struct kvt_err *err)
{
	st->qd = cfg->queue_depth ? cfg->queue_depth : KVT_NVME_DEFAULT_QD;
	st->files = kvt_mem_alloc(KVT_MEM_HOST, cfg->n_files * sizeof *st->files);
	if (!st->files)
		return kvt_err_set(err, -ENOMEM, "no memory for %u files", cfg->n_files);
	st->n_files = cfg->n_files;
	memset(st->files, 0, cfg->n_files * sizeof *st->files);
	for (uint32_t i = 0; i < st->n_files; i++)
		st->files[i].fd = -1;
	int rc = setup_ring(st, err);
	if (!rc)
		rc = open_files(st, cfg, notes, n, err);
	if (!rc)
		rc = size_bounce(st, cfg, err);
	return rc ? rc : alloc_pools(st, err);
}

int kvt_nvme_open(const struct kvt_nvme_config *cfg, struct kvt_nvme **out, struct kvt_err *err)
{
	if (!out)
		return kvt_err_set(err, -EINVAL, "out must not be NULL");
	*out = NULL;
	int rc = check_config(cfg, err);
	if (rc)
		return rc;
	struct kvt_nvme *st = kvt_mem_alloc(KVT_MEM_HOST, sizeof *st);
	if (!st)
		return kvt_err_set(err, -ENOMEM, "no memory for the store (%zu bytes)", sizeof *st);
	char notes[768] = "";
	rc = open_all(st, cfg, notes, sizeof notes, err);
	if (rc) {
		kvt_nvme_close(st); /* keep == 0: removes the files it created */
		return rc;
	}
	st->keep = !!(cfg->flags & KVT_NVME_KEEP);
	st->store_id = kvt_nv_store_id();
	char reg[160];
	register_all(st, reg, sizeof reg);
	snprintf(st->status, sizeof st->status,
		 "io_uring qd %u, align %u, bounce %u x %u bytes %s, crc32c %s, store id %016" PRIx64
		 "%s", st->qd, st->align, st->n_slots, st->bounce, reg, kvt_crc32c_impl(),
		 st->store_id, notes);
	for (uint32_t i = 0; i < st->n_files; i++)
		st->stats.bytes_free += st->files[i].bytes;
	*out = st;
	return 0;
}

void kvt_nvme_close(struct kvt_nvme *st)
{
	if (!st)
		return;
	/*
	 * Unregister the files first: that drops the ring's references to them now, whereas the
	 * ring's own teardown is asynchronous, and until the last reference goes the file stays
	 * locked against the next store.
	 */
	if (st->ring_ok && st->fixed_files)
		io_uring_unregister_files(&st->ring);
	if (st->ring_ok)
		io_uring_queue_exit(&st->ring); /* drops the buffer registrations too */
	for (uint32_t i = 0; st->files && i < st->n_files; i++) {
		struct nv_file *f = &st->files[i];
		kvt_nv_file_close(st, f, !st->keep);
		kvt_space_fini(&f->space);
		kvt_mem_free(KVT_MEM_HOST, f->path, f->path_bytes);
	}
	kvt_mem_free(KVT_MEM_HOST, st->files, st->n_files * sizeof *st->files);
	kvt_mem_free(KVT_MEM_PAGES, st->arena, st->arena_bytes);
	kvt_mem_free(KVT_MEM_HOST, st->slot_used, st->n_slots);
	kvt_mem_free(KVT_MEM_HOST, st->ops, st->n_ops * sizeof *st->ops);
	kvt_mem_free(KVT_MEM_HOST, st->op_free, st->n_ops * sizeof *st->op_free);
	kvt_mem_free(KVT_MEM_HOST, st->pending, st->n_ops * sizeof *st->pending);
	kvt_mem_free(KVT_MEM_HOST, st->reqs, st->n_slots * sizeof *st->reqs);
	kvt_mem_free(KVT_MEM_HOST, st->req_free, st->n_slots * sizeof *st->req_free);
	kvt_mem_free(KVT_MEM_HOST, st->ready, st->n_slots * sizeof *st->ready);
	kvt_mem_free(KVT_MEM_HOST, st->cqp, st->qd * sizeof *st->cqp);
	kvt_mem_free(KVT_MEM_HOST, st->cqes, st->qd * sizeof *st->cqes);
	for (uint32_t i = 0; st->hc && i < KVT_HC_ENTRIES; i++)
		kvt_mem_free(KVT_MEM_HOST, st->hc[i].hdr, st->hc[i].cap);
	kvt_mem_free(KVT_MEM_HOST, st->hc, KVT_HC_ENTRIES * sizeof *st->hc);
	kvt_mem_free(KVT_MEM_HOST, st->hc_bucket, KVT_HC_BUCKETS * sizeof *st->hc_bucket);
	kvt_mem_free(KVT_MEM_HOST, st, sizeof *st);
}

void kvt_nvme_keep_none(struct kvt_nvme *st)
{
	if (st)
		st->keep = 0;
}

int kvt_nvme_available(struct kvt_err *why)
{
	struct io_uring r;
	int rc = io_uring_queue_init(2, &r, 0);
	if (rc < 0)
		return kvt_err_set(why, 0, "the kernel refuses io_uring (io_uring_setup: %s)",
				   strerror(-rc));
	io_uring_queue_exit(&r);
	return kvt_err_set(why, 1, "io_uring available");
}

uint64_t kvt_nvme_block_bytes(const struct kvt_nvme *st, const struct kvt_nvme_block_id *id)
{
	return st && id ? kvt_nvme_disk_bytes(id, st->align) : 0;
}

uint32_t kvt_nvme_alignment(const struct kvt_nvme *st)
{
	return st ? st->align : 0;
}

const char *kvt_nvme_status(const struct kvt_nvme *st)
{
	return st ? st->status : "no store";
}

void kvt_nvme_get_stats(const struct kvt_nvme *st, struct kvt_nvme_stats *out)
{
	memset(out, 0, sizeof *out);
	if (!st)
		return;
	*out = st->stats;
	out->bytes_used = out->bytes_free = 0;
	for (uint32_t i = 0; i < st->n_files; i++) {
		out->bytes_used += st->files[i].space.capacity - st->files[i].space.free;
		out->bytes_free += st->files[i].space.free;
	}
}

void kvt_nvme_set_cqe_hook(struct kvt_nvme *st, int (*hook)(void *ctx, uint64_t nth, int res),
			   void *ctx)
{
	if (!st)
		return;
	st->hook = hook;
	st->hook_ctx = ctx;
	st->hook_nth = 0;
}

void kvt_nvme_set_cqe_shuffle(struct kvt_nvme *st, uint64_t seed)
{
	if (st)
		st->shuffle = seed;
}

#else /* !KVT_HAVE_LIBURING: the tier is absent and says so; everything else of kvtier works. */

#define NO_URING "built without liburing"

int kvt_nvme_available(struct kvt_err *why)
{
	return kvt_err_set(why, 0, NO_URING);
}

int kvt_nvme_open(const struct kvt_nvme_config *cfg, struct kvt_nvme **out, struct kvt_err *err)
{
	(void)cfg;
	if (out)
		*out = NULL;
	return kvt_err_set(err, -EOPNOTSUPP, NO_URING);
}

void kvt_nvme_close(struct kvt_nvme *st)
{
	(void)st;
}

void kvt_nvme_keep_none(struct kvt_nvme *st)
{
	(void)st;
}

int kvt_nvme_write_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_block *blocks,
			  struct kvt_nvme_loc *locs_out, struct kvt_err *err)
{
	(void)st;
	(void)blocks;
	if (locs_out)
		memset(locs_out, 0, (size_t)n * sizeof *locs_out);
	return kvt_err_set(err, -EOPNOTSUPP, NO_URING);
}

int kvt_nvme_read_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs,
			 const struct kvt_nvme_block_id *expect, void *const *payload_out,
			 struct kvt_err *err)
{
	(void)st;
	(void)n;
	(void)locs;
	(void)expect;
	(void)payload_out;
	return kvt_err_set(err, -EOPNOTSUPP, NO_URING);
}

int kvt_nvme_read_rows(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
		       struct kvt_err *err)
{
	(void)st;
	(void)n;
	(void)reqs;
	return kvt_err_set(err, -EOPNOTSUPP, NO_URING);
}

int kvt_nvme_read_rows_idle(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
			    const struct kvt_nvme_idle *idle, struct kvt_err *err)
{
	(void)idle;
	return kvt_nvme_read_rows(st, n, reqs, err);
}

void kvt_nvme_free(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs)
{
	(void)st;
	(void)n;
	(void)locs;
}

uint64_t kvt_nvme_block_bytes(const struct kvt_nvme *st, const struct kvt_nvme_block_id *id)
{
	(void)st;
	(void)id;
	return 0;
}

uint32_t kvt_nvme_alignment(const struct kvt_nvme *st)
{
	(void)st;
	return 0;
}

const char *kvt_nvme_status(const struct kvt_nvme *st)
{
	(void)st;
	return NO_URING;
}

void kvt_nvme_get_stats(const struct kvt_nvme *st, struct kvt_nvme_stats *out)
{
	(void)st;
	memset(out, 0, sizeof *out);
}

void kvt_nvme_set_cqe_hook(struct kvt_nvme *st, int (*hook)(void *ctx, uint64_t nth, int res),
			   void *ctx)
{
	(void)st;
	(void)hook;
	(void)ctx;
}

void kvt_nvme_set_cqe_shuffle(struct kvt_nvme *st, uint64_t seed)
{
	(void)st;
	(void)seed;
}

void kvt_nvme_discard(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs)
{
	(void)st;
	(void)n;
	(void)locs;
}

uint64_t kvt_nvme_store_id(const struct kvt_nvme *st)
{
	(void)st;
	return 0;
}

#endif
