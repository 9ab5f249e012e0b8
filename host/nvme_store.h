/* SPDX-License-Identifier: MIT */
/*
 * The NVMe block store: checksummed blocks of K/V rows in one or more files, written and read
 * through io_uring with O_DIRECT, registered bounce buffers and registered files.
 *
 * Space: each file is a run of alignment-sized units handed out first fit from a sorted list of
 * free extents; blocks go to the files in turn, so several files on several disks share the load.
 * A block lives where kvt_nvme_write_blocks put it until kvt_nvme_free; nothing survives
 * kvt_nvme_close (the files are a cache, not a database: no superblock, no fsync).
 *
 * Ownership (doc/data-at-rest.md): a store holds each of its files exclusively (flock) from open
 * to close, so a second store on a file is refused; every block carries the store's random id, so
 * a block written by any other store (a dead process's on a reused file) is refused on read;
 * files the store created (mode 0600) are removed at close unless KVT_NVME_KEEP, and what
 * stays on a kept or caller-provided file is zeroed: a block by kvt_nvme_discard, the blocks still
 * in use at close.
 *
 * I/O: every block passes through a bounce pool of 2 x queue_depth slots of bounce_bytes, pinned
 * and registered with the kernel; a block larger than one slot takes several adjacent slots and is
 * moved in one I/O per slot. Up to queue_depth I/Os are in flight; the second half of the slots
 * lets blocks be verified and copied out while the device's queue stays full. A short transfer is
 * continued from where it stopped (re-aligned), -EAGAIN is retried up to 8 times per I/O, any other
 * error ends the call after every I/O in flight has completed, so no buffer is reused while the
 * kernel still owns it.
 *
 * Integrity: a block is checked in full (header CRC, identity, generation, the CRC of each 4 KiB
 * chunk read, zero padding) in the bounce buffer before one byte of it reaches the caller. Row reads
 * of a block whose header was verified before take the header from a cache of 4096 headers (keyed
 * by the loc and the full identity, dropped on free, rewrite and any failed check) and read only the
 * chunks' sectors; the chunks are still checked against that header's CRC table.
 *
 * Built without liburing, every function returns -EOPNOTSUPP ("built without liburing").
 * Thread safety: calls on one store are serialized by the caller; different stores are independent.
 * Errors: 0 or a negative errno; every call that can fail takes a struct kvt_err * (host/err.h,
 * NULL allowed) that receives the detail (which file, offset, block, value) of its failure.
 */
#ifndef KVT_NVME_STORE_H
#define KVT_NVME_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "nvme_format.h"

struct kvt_nvme;

#define KVT_NVME_MAX_FILES 64u
#define KVT_NVME_MAX_QD 1024u
#define KVT_NVME_DEFAULT_QD 32u
#define KVT_NVME_DEFAULT_BOUNCE ((uint32_t)1 << 20)

/* Config flags. */
enum {
	/*
	 * Use the page cache instead of O_DIRECT: where direct I/O is slow or broken, and in tests
	 * of the path taken automatically when O_DIRECT is refused.
	 */
	KVT_NVME_BUFFERED = 1u << 0,
	/* Leave the files this store created in place at close (zeroed where blocks were). */
	KVT_NVME_KEEP = 1u << 1,
};

struct kvt_nvme_config {
	const char *const *paths; /* n_files paths: created (0600) when missing, resized to bytes[i] */
	const uint64_t *bytes;    /* capacity of each file; rounded down to the I/O alignment */
	uint32_t n_files;         /* 1 .. KVT_NVME_MAX_FILES */
	uint32_t queue_depth;     /* I/Os in flight (bounce slots: twice that), 1 .. 1024; 0 = 32 */
	uint32_t bounce_bytes;    /* one slot, rounded up to the alignment, <= 1 GiB; 0 = 1 MiB */
	uint32_t flags;           /* KVT_NVME_* flags, 0 for none */
};

/* Where a block is: what kvt_nvme_write_blocks returns and the reads and kvt_nvme_free take. */
struct kvt_nvme_loc {
	uint64_t offset; /* byte offset in the file, a multiple of the alignment */
	uint32_t file;   /* index into the config's paths */
	uint32_t bytes;  /* bytes on disk (kvt_nvme_block_bytes); 0 marks "not written" */
};

/* One block to write: its identity and n_tokens * head_dim * 4 bytes of rows at payload. */
struct kvt_nvme_block {
	struct kvt_nvme_block_id id;
	const void *payload;
};

/*
 * Rows [row_begin, row_end) of one block, to be read into out ((row_end - row_begin) rows of
 * head_dim * 4 bytes, host memory, any alignment). Only the aligned sectors holding the header and
 * the 4 KiB chunks covering those rows are read; each of them is verified.
 */
struct kvt_nvme_rows {
	struct kvt_nvme_loc loc;
	struct kvt_nvme_block_id expect; /* the identity the block was written with */
	uint32_t row_begin, row_end;     /* 0 <= row_begin < row_end <= expect.n_tokens */
	void *out;
};

/* Counters since open (monotonic; the two space figures are current). */
struct kvt_nvme_stats {
	uint64_t blocks_written,
		blocks_read;                /* blocks (or row ranges) delivered by successful I/O */
	uint64_t bytes_written, bytes_read; /* bytes moved to/from the files, padding included */
	uint64_t write_ios, read_ios;       /* I/Os completed, retries and continuations included */
	uint64_t submits;                   /* io_uring_submit calls (system calls) */
	uint64_t short_ios, retries;        /* short transfers continued; -EAGAIN retries */
	uint64_t io_errors;                 /* calls ended by an I/O error */
	uint64_t checksum_failures;         /* blocks refused by kvt_nvme_verify */
	uint64_t reordered;                 /* completions that overtook an earlier submission */
	uint64_t lat_sum_ns, lat_max_ns;    /* per I/O, submission to reaped completion */
	uint64_t bad_frees;                 /* kvt_nvme_free of a range that was not in use */
	uint64_t bytes_used, bytes_free;    /* space now in use / free, over all files */
	uint64_t header_cache_hits; /* row reads that used a cached verified header (no header I/O) */
	uint64_t discard_failures;  /* ranges kvt_nvme_discard or close could not zero */
};

/*
 * Whether the NVMe tier can work here: built with liburing and the kernel accepts
 * io_uring_queue_init. Returns 1, or 0 with the reason in why.
 */
int kvt_nvme_available(struct kvt_err *why);

/*
 * Open (create 0600 when missing, lock, resize, preallocate) the files and set up the ring, the
 * bounce pool and the registrations, under a fresh random store id. Where O_DIRECT is refused
 * (EINVAL: tmpfs), the file is used buffered; where the kernel refuses to register buffers or
 * files, plain reads/writes or plain descriptors are used; kvt_nvme_status says which. A regular
 * file that existed before has its old contents discarded (holes punched) where the file system
 * allows. err receives the detail of a failure; a failed open removes the files it created (and
 * no other).
 * Errors: -EINVAL (a bad config value, named), -EBUSY (a file is held by another store: the path
 * and the holder's pid where /proc/locks tells it), -EMFILE / -ENFILE (out of file descriptors,
 * for the ring or a file), -EOPNOTSUPP (no liburing, or io_uring refused by the kernel), -EIO (a
 * file could not be opened or sized: path and errno text), -ENOSPC (the file system cannot reserve
 * the bytes), -ENOMEM.
 */
int kvt_nvme_open(const struct kvt_nvme_config *cfg, struct kvt_nvme **out, struct kvt_err *err);

/*
 * Close the files and release everything. NULL is accepted. Blocks still in use are zeroed; files
 * the store created are removed (unless KVT_NVME_KEEP), other files are left in place.
 */
void kvt_nvme_close(struct kvt_nvme *st);

/*
 * For an owner whose own set-up failed after kvt_nvme_open: kvt_nvme_close will remove the files
 * the store created even under KVT_NVME_KEEP (a failed create keeps nothing it made). NULL is
 * accepted.
 */
void kvt_nvme_keep_none(struct kvt_nvme *st);

/*
 * Allocate space for and write n blocks, up to queue_depth I/Os in flight; locs_out[i] receives
 * where blocks[i] went. All or nothing: on any error the space of every block of the call is
 * zeroed on disk (kvt_nvme_discard: what was written does not stay) and freed, and every
 * locs_out[i] is zeroed (bytes = 0), so no block is ever reported written that was
 * not written in full. Returns 0 or: -EINVAL (a bad block, named: zero or too many rows, a block
 * larger than the whole bounce pool), -ENOSPC (bytes needed and free), -ENOMEM, an I/O error from a
 * completion (-EIO, -ECANCELED, -ENOSPC, ...) or -EIO (a zero-length transfer, retries exhausted).
 */
int kvt_nvme_write_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_block *blocks,
			  struct kvt_nvme_loc *locs_out, struct kvt_err *err);

/*
 * Read n whole blocks into payload_out[i] (kvt_nvme_payload_bytes(&expect[i]) bytes each), each
 * verified against expect[i] in the bounce buffer first. A block's output is written only once that
 * whole block has been read and verified; after the first error no further output is written.
 * Returns 0 or: -EBADMSG (the block is named: file, offset, seq/layer/head/tokens, failed check),
 * -EINVAL (a loc that does not match its expect or lies outside the files), the I/O errors of
 * kvt_nvme_write_blocks. On error, outputs of blocks completed earlier in the call may have been
 * written (each in full, verified); the failing block's and later blocks' are untouched.
 */
int kvt_nvme_read_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs,
			 const struct kvt_nvme_block_id *expect, void *const *payload_out,
			 struct kvt_err *err);

/* Read row ranges of blocks, as kvt_nvme_read_blocks does whole blocks (same errors). */
int kvt_nvme_read_rows(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
		       struct kvt_err *err);

/*
 * The caller's work while reads are in flight: each time the call has filled the device's queue
 * and would wait for a completion, it calls fn(arg) once, until fn returns 0 (done) or the call
 * fails; fn should do a slice of its work (tens of microseconds: the queue drains meanwhile) and
 * return nonzero while work remains. fn must not call the store, nor touch the outputs of the
 * call's requests. What it has not done when the call returns is the caller's to finish.
 */
struct kvt_nvme_idle {
	int (*fn)(void *arg);
	void *arg;
};

/* kvt_nvme_read_rows, running idle's work while the reads are in flight (idle may be NULL). */
int kvt_nvme_read_rows_idle(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
			    const struct kvt_nvme_idle *idle, struct kvt_err *err);

/*
 * Give back the space of n blocks. Entries with bytes == 0 are skipped; a range that is not in use
 * (double free, bad loc) is ignored and counted in bad_frees.
 */
void kvt_nvme_free(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs);

/*
 * Zero the on-disk bytes of n blocks (before kvt_nvme_free of them, when their rows must not stay
 * on disk: a closed sequence's). FALLOC_FL_ZERO_RANGE on files, BLKZEROOUT on block devices, else
 * zeros written; the space stays reserved. Entries with bytes == 0 or outside the files are
 * skipped; a range that cannot be zeroed is counted in discard_failures.
 */
void kvt_nvme_discard(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs);

/* The store's random id, written into every block header (0 for NULL). */
uint64_t kvt_nvme_store_id(const struct kvt_nvme *st);

/* Bytes a block of this identity takes on disk in this store (0 when the identity is invalid). */
uint64_t kvt_nvme_block_bytes(const struct kvt_nvme *st, const struct kvt_nvme_block_id *id);
/* The I/O alignment in bytes (a power of two >= 512). */
uint32_t kvt_nvme_alignment(const struct kvt_nvme *st);
/* How the store runs: alignment and where it came from, direct or buffered, registrations. */
const char *kvt_nvme_status(const struct kvt_nvme *st);
void kvt_nvme_get_stats(const struct kvt_nvme *st, struct kvt_nvme_stats *out);

/*
 * Test shim: every completion's result passes through hook(ctx, nth, res) before the store looks at
 * it; nth counts completions from 1 since the hook was set, and the return value replaces res (an
 * error code, a short count, 0). NULL removes the hook.
 */
void kvt_nvme_set_cqe_hook(struct kvt_nvme *st, int (*hook)(void *ctx, uint64_t nth, int res),
			   void *ctx);
/*
 * Test shim: with seed != 0, the store waits for every I/O in flight before reaping and handles the
 * completions in a seeded random order, so out-of-order completion is exercised on any device.
 * 0 restores arrival order.
 */
void kvt_nvme_set_cqe_shuffle(struct kvt_nvme *st, uint64_t seed);

#endif
