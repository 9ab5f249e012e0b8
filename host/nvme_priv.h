/* SPDX-License-Identifier: MIT */
/*
 * Internals of the NVMe store shared by nvme_store.c (open, close, queries), nvme_engine.c (the
 * I/O engine), nvme_write.c (writes, frees), nvme_read.c (reads) and nvme_hcache.c (the header
 * cache). Never included outside host/nvme_*.c. Only built with liburing.
 */
#ifndef KVT_NVME_PRIV_H
#define KVT_NVME_PRIV_H

#include <liburing.h>
#include <stdint.h>
#include <sys/types.h>

#include "nvme_space.h"
#include "nvme_store.h"

struct nv_file {
	int fd;           /* open and flock'ed (exclusive) while the store lives */
	int created;      /* this store created the file: removed at close unless kept */
	int is_blk;       /* a block device (zeroed by BLKZEROOUT, never removed) */
	dev_t dev;        /* the file, to remove only it and not whatever the path names later */
	ino_t ino;
	uint64_t bytes; /* usable: the configured size rounded down to the alignment */
	struct kvt_space space;
	char *path;
	size_t path_bytes;
};

/* One piece of I/O: a range of one block inside one bounce slot. */
struct op {
	uint64_t file_off; /* where the piece starts in the file */
	uint64_t t_submit, seqno;
	uint64_t stage;     /* offset of the piece in the arena */
	uint32_t req;       /* owning block */
	uint32_t len, done; /* done stays a multiple of the alignment */
	uint32_t slot;
	uint16_t file;
	uint8_t tries;
};

/* One block being moved. For reads, which parts of it were staged where. */
struct req {
	uint32_t idx, slot0, n_slots, ops_left;
	uint32_t hr, c0, c1; /* header range [0, hr) staged at 0; payload chunks [c0, c1) */
	uint64_t ds, de;     /* block range [ds, de) holding those chunks, staged at hr */
	int merged;          /* the two ranges touch: one range [0, de) staged at 0 */
	int cached;          /* the header came from the header cache: only [ds, de) is read */
};

/*
 * The header cache: verified block headers, so direct serving of a block read before needs only
 * the sectors of its chunks (one I/O, no header sector). An entry is keyed by where the block is
 * (file, offset, bytes) and the full identity it was verified against; a chunk read under a cached
 * header is still checked against that header's CRC table, so a changed or stale payload is still
 * refused. Entries go on kvt_nvme_free and on a write at the offset (the space is reused), and
 * when any read of the block fails verification (the block is suspect). Clock eviction.
 */
#define KVT_HC_ENTRIES 4096u
#define KVT_HC_BUCKETS 8192u /* power of two, twice the entries: short chains */
/*
 * Headers up to this size (payloads up to 1024 chunks, 4 MiB) are cached, each in its own buffer:
 * at most 4096 x 4160 bytes, 0.1% of the 16 GiB of such blocks the entries cover.
 */
#define KVT_HC_HDR_MAX (KVT_NVME_HDR_FIXED + 4096u)
#define KVT_HC_NONE UINT32_MAX

struct hc_ent {
	uint64_t offset;
	struct kvt_nvme_block_id id;
	uint32_t file, bytes, hb; /* hb == 0: the entry is free */
	uint32_t next;            /* next entry of the same bucket, or KVT_HC_NONE */
	uint32_t cap;             /* bytes at hdr (kept when the entry is reused) */
	unsigned char *hdr;
	uint8_t ref;              /* clock bit: used since the hand last passed */
};

struct cqe_copy {
	uint64_t data;
	int res;
};

struct kvt_nvme {
	struct io_uring ring;
	int ring_ok, fixed_files, fixed_bufs, broken;
	int keep;          /* KVT_NVME_KEEP: created files stay at close */
	uint64_t store_id; /* random, in every block header written, checked on every read */
	uint32_t n_files, qd, align, bounce;
	uint32_t n_slots; /* bounce slots: 2 * qd, so verifying and copying out never starve the
			     queue */
	struct nv_file *files;
	unsigned char *arena;
	size_t arena_bytes;
	uint8_t *slot_used;
	struct op *ops;
	uint32_t n_ops, n_op_free, *op_free;
	uint32_t *pending, pend_head, pend_n; /* FIFO of ops waiting for a submission slot */
	struct req *reqs;
	uint32_t n_req_free, *req_free;
	uint32_t n_ready,
		*ready; /* blocks whose I/O is complete, to be finished after resubmission */
	struct io_uring_cqe **cqp;
	struct cqe_copy *cqes;
	uint32_t inflight, rotor;
	uint64_t seqno, max_reaped;
	int (*hook)(void *ctx, uint64_t nth, int res);
	void *hook_ctx;
	uint64_t hook_nth, shuffle;
	struct hc_ent *hc;
	uint32_t *hc_bucket, hc_hand;
	struct kvt_nvme_stats stats;
	char status[1024];
};

/* One call: a write of blocks, or a read of row ranges given as rows[] or as the three arrays. */
struct kvt_call {
	int write, rc;
	int hdr_only;        /* read only the headers of rows[map[i]], verify and cache them */
	const uint32_t *map; /* hdr_only: the request of rows[] behind entry i */
	uint32_t n, next, done;
	const struct kvt_nvme_block *blocks;
	struct kvt_nvme_loc *locs;
	const struct kvt_nvme_rows *rows;
	const struct kvt_nvme_loc *rlocs;
	const struct kvt_nvme_block_id *expect;
	void *const *outs;
	struct kvt_err *err; /* the caller's: the call's first error is recorded there */
	const struct kvt_nvme_idle *idle; /* the caller's work while reads are in flight, or NULL */
	int idle_more;                    /* idle->fn has not yet said it is done */
};

/* The engine (nvme_engine.c), used by the write and read calls (nvme_write.c, nvme_read.c). */
void kvt_nv_call_rows(const struct kvt_call *c, uint32_t i, struct kvt_nvme_rows *q);
void kvt_nv_name_block(const struct kvt_nvme *st, const struct kvt_nvme_loc *l,
		       const struct kvt_nvme_block_id *id, char *buf, size_t n);
/* Plan a read of q's rows into r (cached: the header comes from the cache); bytes to stage. */
uint64_t kvt_nv_read_geometry(const struct kvt_nvme *st, const struct kvt_nvme_rows *q,
			      struct req *r, int cached);
/* Run a call to its end (every I/O completed): 0 or the first error. */
int kvt_nv_run_call(struct kvt_nvme *st, struct kvt_call *c);
/* 0, or an error (detail in err) when st is NULL or out of service. */
int kvt_nv_usable(struct kvt_nvme *st, struct kvt_err *err);

/* The files (nvme_file.c): open, create, lock; zero and release. */
int kvt_nv_file_open(struct nv_file *f, const char *path, int buffered, const char **mode,
		     struct kvt_err *err);
void kvt_nv_file_close(struct kvt_nvme *st, struct nv_file *f, int remove);
/* A random store id (getrandom; a clock and pid mix where it would block). */
uint64_t kvt_nv_store_id(void);
/* An errno of open or io_uring set-up as a code (-EMFILE, -ENFILE, -ENOMEM, else -EIO) and a hint. */
int kvt_nv_errno_code(int e);
const char *kvt_nv_errno_hint(int e);

/* The header cache (nvme_hcache.c). The verified header of the block at l with identity id (hb
 * bytes), or NULL. */
const unsigned char *kvt_hc_find(struct kvt_nvme *st, const struct kvt_nvme_loc *l,
				 const struct kvt_nvme_block_id *id, uint32_t hb);
/* Remember a header just verified for the block at l with identity id. */
void kvt_hc_put(struct kvt_nvme *st, const struct kvt_nvme_loc *l,
		const struct kvt_nvme_block_id *id, const unsigned char *hdr, uint32_t hb);
/* Forget whatever is cached for a block starting at (file, offset). */
void kvt_hc_drop(struct kvt_nvme *st, uint32_t file, uint64_t offset);

#endif
