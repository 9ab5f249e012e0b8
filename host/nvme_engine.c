/* SPDX-License-Identifier: MIT */
/*
 * The I/O engine of the NVMe store, which the write calls (nvme_write.c) and the read calls
 * (nvme_read.c) run.
 *
 * One call (a write or a read of n blocks) runs a small engine: a block is admitted when enough
 * adjacent bounce slots are free, broken into pieces that each stay inside one registered slot, and
 * the pieces are submitted with at most queue_depth in flight. Completions are handled in whatever
 * order they come; a block is finished (written, or verified and copied out) when its last piece
 * completes, and its slots go back to the pool. After the first error nothing new is submitted or
 * delivered, but the call still waits for every I/O in flight, because until then the kernel owns
 * the bounce memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvt_config.h"

#if KVT_HAVE_LIBURING
#include "alloc.h"
#include "nvme_priv.h"

/* Per I/O: -EAGAIN retries, and short transfers that made no aligned progress. */
#define MAX_TRIES 8u
/* A submission refused with -EAGAIN/-EBUSY is retried this many times, 1 ms apart. */
#define MAX_BUSY 1000
/*
 * A gap between a row read's header and its rows up to this size is read rather than skipped: one
 * I/O instead of two. On the H200 machine's virtio disk (80 K IOPS, 1.9 GB/s) a second 4 KiB I/O
 * costs 12.5 us and 16 KiB of extra transfer 8.6 us.
 */
#define BRIDGE_BYTES ((uint64_t)16 << 10)

/* The first error of a call wins; what goes wrong while draining is not recorded. */
__attribute__((format(printf, 4, 5))) static void call_fail(struct kvt_nvme *st, struct kvt_call *c,
							    int code, const char *fmt, ...)
{
	if (c->rc)
		return;
	c->rc = code;
	va_list ap;
	va_start(ap, fmt);
	kvt_err_setv(c->err, code, fmt, ap);
	va_end(ap);
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t round_up(uint64_t x, uint32_t a)
{
	return (x + a - 1) & ~(uint64_t)(a - 1);
}

static uint64_t round_down(uint64_t x, uint32_t a)
{
	return x & ~(uint64_t)(a - 1);
}

void kvt_nv_call_rows(const struct kvt_call *c, uint32_t i, struct kvt_nvme_rows *q)
{
	if (c->map)
		i = c->map[i];
	if (c->rows) {
		*q = c->rows[i];
		return;
	}
	q->loc = c->rlocs[i];
	q->expect = c->expect[i];
	q->row_begin = 0;
	q->row_end = c->expect[i].n_tokens;
	q->out = c->outs[i];
}

/* How messages name a block: "path @ offset (+bytes), uid U layer L head H tokens a..b gen G" (U:
 * the id of the sequence that wrote it, kvtier's internal uid, never reused; not a seq slot). */
void kvt_nv_name_block(const struct kvt_nvme *st, const struct kvt_nvme_loc *l,
		       const struct kvt_nvme_block_id *id, char *buf, size_t n)
{
	const char *path = l->file < st->n_files ? st->files[l->file].path : "?";
	snprintf(buf, n,
		 "%s @ %" PRIu64 " (+%u), uid %" PRIu64 " layer %u head %u tokens %" PRIu64
		 "..%" PRIu64 " gen %" PRIu64,
		 path, l->offset, l->bytes, id->seq, id->layer, id->kv_head, id->first_token,
		 id->first_token + id->n_tokens, id->generation);
}

/* ---- geometry of a read ------------------------------------------------------------------- */

/*
 * Which aligned ranges of the block a read of rows [row_begin, row_end) needs: the header, and the
 * 4 KiB chunks covering the rows (so each can be checked against its CRC). Returns the bytes to
 * stage: the two ranges back to back, or one range from the block's start when the gap between
 * them is at most BRIDGE_BYTES.
 */
uint64_t kvt_nv_read_geometry(const struct kvt_nvme *st, const struct kvt_nvme_rows *q,
			      struct req *r, int cached)
{
	uint32_t p = kvt_nvme_payload_bytes(&q->expect), d = kvt_nvme_data_offset(p, st->align);
	uint64_t row = (uint64_t)q->expect.head_dim * 4u;
	r->c0 = (uint32_t)(q->row_begin * row / KVT_NVME_CHUNK);
	r->c1 = (uint32_t)((q->row_end * row + KVT_NVME_CHUNK - 1) / KVT_NVME_CHUNK);
	uint64_t chunk_end =
		(uint64_t)r->c1 * KVT_NVME_CHUNK < p ? (uint64_t)r->c1 * KVT_NVME_CHUNK : p;
	r->hr = d;
	r->ds = round_down(d + (uint64_t)r->c0 * KVT_NVME_CHUNK, st->align);
	r->de = round_up(d + chunk_end, st->align);
	/* A cached header is copied to [0, hr) of the stage, not read: only the chunks are. */
	r->cached = cached;
	r->merged = !cached && r->ds <= r->hr + BRIDGE_BYTES;
	return r->merged ? r->de : r->hr + (r->de - r->ds);
}

/* Where byte `off` of the block sits in the staged copy. */
static uint64_t stage_pos(const struct req *r, uint64_t off)
{
	/* Under a cached header the chunks may start inside the header's sectors (ds < hr). */
	if (r->merged)
		return off;
	return !r->cached && off < r->hr ? off : r->hr + (off - r->ds);
}

/* ---- pools ------------------------------------------------------------------------------- */

static void pools_reset(struct kvt_nvme *st)
{
	for (uint32_t i = 0; i < st->n_ops; i++)
		st->op_free[i] = i;
	st->n_op_free = st->n_ops;
	for (uint32_t i = 0; i < st->n_slots; i++)
		st->req_free[i] = i;
	st->n_req_free = st->n_slots;
	memset(st->slot_used, 0, st->n_slots);
	st->pend_head = st->pend_n = 0;
	st->n_ready = 0;
}

/* First fit of k adjacent free slots; 0 with *first set, or -1 (wait for completions). */
static int slots_take(struct kvt_nvme *st, uint32_t k, uint32_t *first)
{
	for (uint32_t i = 0, run = 0; i < st->n_slots; i++) {
		run = st->slot_used[i] ? 0 : run + 1;
		if (run == k) {
			*first = i + 1 - k;
			memset(&st->slot_used[*first], 1, k);
			return 0;
		}
	}
	return -1;
}

static void pend_push(struct kvt_nvme *st, uint32_t oi)
{
	st->pending[(st->pend_head + st->pend_n++) % st->n_ops] = oi;
}

/* Queue the pieces of block range [boff, boff + len), staged at `soff` of the request's slots. */
static void add_range(struct kvt_nvme *st, struct req *r, uint32_t ri,
		      const struct kvt_nvme_loc *loc, uint64_t boff, uint64_t len, uint64_t soff)
{
	while (len) {
		uint64_t a = (uint64_t)r->slot0 * st->bounce + soff;
		uint64_t room = st->bounce - a % st->bounce;
		uint32_t piece = (uint32_t)(len < room ? len : room);
		uint32_t oi = st->op_free[--st->n_op_free];
		struct op *o = &st->ops[oi];
		memset(o, 0, sizeof *o);
		o->file_off = loc->offset + boff;
		o->stage = a;
		o->req = ri;
		o->len = piece;
		o->slot = (uint32_t)(a / st->bounce);
		o->file = (uint16_t)loc->file;
		r->ops_left++;
		pend_push(st, oi);
		boff += piece;
		soff += piece;
		len -= piece;
	}
}

/*
 * Admit blocks in order while bounce slots are free: stage a write's image (encode) or plan a
 * read's ranges. Piece count is bounded: a block of k slots has at most k + 1 pieces, and the
 * active blocks hold at most n_slots slots, so 2 * n_slots + 2 pieces always suffice.
 */
static void admit(struct kvt_nvme *st, struct kvt_call *c)
{
	while (!c->rc && c->next < c->n && st->n_req_free) {
		uint32_t i = c->next, slot0;
		struct req tmp;
		struct kvt_nvme_rows q;
		uint64_t stage;
		const unsigned char *hdr = NULL;
		memset(&tmp, 0, sizeof tmp);
		if (c->write) {
			stage = c->locs[i].bytes;
		} else if (c->hdr_only) {
			kvt_nv_call_rows(c, i, &q);
			uint32_t hb = kvt_nvme_header_bytes(kvt_nvme_payload_bytes(&q.expect));
			stage = tmp.hr = (uint32_t)round_up(hb, st->align);
		} else {
			kvt_nv_call_rows(c, i, &q);
			/*
			 * Row reads (direct serving) use a cached verified header; block reads
			 * (restore) always read and check the one on disk, and refresh the cache.
			 */
			uint32_t hb = kvt_nvme_header_bytes(kvt_nvme_payload_bytes(&q.expect));
			if (c->rows)
				hdr = kvt_hc_find(st, &q.loc, &q.expect, hb);
			stage = kvt_nv_read_geometry(st, &q, &tmp, hdr != NULL);
			if (hdr && stage > (uint64_t)st->n_slots * st->bounce) {
				hdr = NULL; /* check_read sized the pool for the plain geometry */
				stage = kvt_nv_read_geometry(st, &q, &tmp, 0);
			}
		}
		uint32_t k = (uint32_t)((stage + st->bounce - 1) / st->bounce);
		if (st->n_op_free < k + 1 || slots_take(st, k, &slot0))
			return;
		uint32_t ri = st->req_free[--st->n_req_free];
		struct req *r = &st->reqs[ri];
		*r = tmp;
		r->idx = i;
		r->slot0 = slot0;
		r->n_slots = k;
		if (c->write) {
			kvt_nvme_encode(&c->blocks[i].id, st->store_id, c->blocks[i].payload,
					st->arena + (size_t)slot0 * st->bounce, c->locs[i].bytes,
					st->align);
			add_range(st, r, ri, &c->locs[i], 0, c->locs[i].bytes, 0);
		} else if (c->hdr_only) {
			add_range(st, r, ri, &q.loc, 0, r->hr, 0);
		} else if (hdr) {
			memcpy(st->arena + (size_t)slot0 * st->bounce, hdr,
			       kvt_nvme_header_bytes(kvt_nvme_payload_bytes(&q.expect)));
			add_range(st, r, ri, &q.loc, r->ds, r->de - r->ds, r->hr);
			st->stats.header_cache_hits++;
		} else if (r->merged) {
			add_range(st, r, ri, &q.loc, 0, r->de, 0);
		} else {
			add_range(st, r, ri, &q.loc, 0, r->hr, 0);
			add_range(st, r, ri, &q.loc, r->ds, r->de - r->ds, r->hr);
		}
		c->next++;
	}
}

/* ---- submission and completion ----------------------------------------------------------- */

/* Put pending pieces into SQEs while fewer than queue_depth are in flight. */
static void prepare(struct kvt_nvme *st, struct kvt_call *c)
{
	while (!c->rc && st->pend_n && st->inflight < st->qd) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(&st->ring);
		if (!sqe)
			return; /* cannot happen: the SQ ring has >= qd entries; kept as a guard */
		uint32_t oi = st->pending[st->pend_head];
		st->pend_head = (st->pend_head + 1) % st->n_ops;
		st->pend_n--;
		struct op *o = &st->ops[oi];
		unsigned char *buf = st->arena + o->stage + o->done;
		unsigned len = o->len - o->done;
		uint64_t off = o->file_off + o->done;
		int fd = st->fixed_files ? (int)o->file : st->files[o->file].fd;
		if (c->write && st->fixed_bufs)
			io_uring_prep_write_fixed(sqe, fd, buf, len, off, (int)o->slot);
		else if (c->write)
			io_uring_prep_write(sqe, fd, buf, len, off);
		else if (st->fixed_bufs)
			io_uring_prep_read_fixed(sqe, fd, buf, len, off, (int)o->slot);
		else
			io_uring_prep_read(sqe, fd, buf, len, off);
		if (st->fixed_files)
			sqe->flags |= IOSQE_FIXED_FILE;
		io_uring_sqe_set_data64(sqe, oi);
		o->t_submit = now_ns();
		o->seqno = ++st->seqno;
		st->inflight++;
	}
}

/* Submit what is prepared and wait for `want` completions: 0, or -1 with the store broken. */
static int enter(struct kvt_nvme *st, struct kvt_call *c, unsigned want)
{
	for (int busy = 0;;) {
		int r = io_uring_submit_and_wait(&st->ring, want);
		st->stats.submits++;
		if (r >= 0 || r == -EINTR || r == -ETIME)
			return 0;
		if ((r == -EAGAIN || r == -EBUSY) && io_uring_cq_ready(&st->ring))
			return 0;
		if ((r == -EAGAIN || r == -EBUSY) && ++busy < MAX_BUSY) {
			/* The kernel is short of request memory or the CQ is full: wait. */
			struct timespec ms = {0, 1000000};
			nanosleep(&ms, NULL);
			continue;
		}
		/*
		 * The SQ ring may hold entries the kernel never took, so in-flight accounting is
		 * lost: the store refuses further calls (closing it is still safe).
		 */
		st->broken = 1;
		call_fail(st, c, -EIO, "io_uring_submit_and_wait: %s; the store is out of service",
			  strerror(-r));
		return -1;
	}
}

static const char *dir(const struct kvt_call *c)
{
	return c->write ? "write" : "read";
}

/* Handle one completion of piece oi with (possibly rewritten) result res. */
static void complete(struct kvt_nvme *st, struct kvt_call *c, uint32_t oi, int res, uint64_t now)
{
	struct op *o = &st->ops[oi];
	struct nv_file *f = &st->files[o->file];
	uint64_t lat = now - o->t_submit;
	st->inflight--;
	st->stats.lat_sum_ns += lat;
	if (lat > st->stats.lat_max_ns)
		st->stats.lat_max_ns = lat;
	if (o->seqno < st->max_reaped)
		st->stats.reordered++;
	else
		st->max_reaped = o->seqno;
	*(c->write ? &st->stats.write_ios : &st->stats.read_ios) += 1;
	if (st->hook)
		res = st->hook(st->hook_ctx, ++st->hook_nth, res);
	if (c->rc)
		return; /* draining after an error: the piece is given up either way */
	uint32_t left = o->len - o->done;
	uint64_t at = o->file_off + o->done;
	if (res == -EAGAIN || res == -EINTR) {
		if (++o->tries > MAX_TRIES) {
			call_fail(st, c, -EIO, "%s of %u bytes at %s @ %" PRIu64 ": %s %u times",
				  dir(c), left, f->path, at, strerror(-res), MAX_TRIES + 1);
			return;
		}
		st->stats.retries++;
		pend_push(st, oi);
		return;
	}
	if (res < 0) {
		call_fail(st, c, res, "%s of %u bytes at %s @ %" PRIu64 ": %s", dir(c), left,
			  f->path, at, strerror(-res));
		return;
	}
	if (res == 0) {
		call_fail(st, c, -EIO, "%s of %u bytes at %s @ %" PRIu64 " moved 0 bytes", dir(c),
			  left, f->path, at);
		return;
	}
	if ((uint32_t)res > left) {
		call_fail(st, c, -EIO, "%s at %s @ %" PRIu64 " reports %d bytes, %u were asked",
			  dir(c), f->path, at, res, left);
		return;
	}
	*(c->write ? &st->stats.bytes_written : &st->stats.bytes_read) += (uint64_t)res;
	if ((uint32_t)res < left) {
		/* Go on from the last aligned byte: O_DIRECT wants aligned offsets. */
		uint32_t done = (uint32_t)round_down(o->done + (uint32_t)res, st->align);
		st->stats.short_ios++;
		if (done == o->done && ++o->tries > MAX_TRIES) {
			call_fail(st, c, -EIO,
				  "%s at %s @ %" PRIu64 ": %u short transfers without progress",
				  dir(c), f->path, at, MAX_TRIES + 1);
			return;
		}
		o->done = done;
		pend_push(st, oi);
		return;
	}
	o->done = o->len;
	uint32_t ri = o->req;
	st->op_free[st->n_op_free++] = oi;
	if (--st->reqs[ri].ops_left == 0)
		st->ready[st->n_ready++] = ri;
}

/* A read block has all its pieces: verify it in the bounce buffer, then copy the rows out. */
static void deliver(struct kvt_nvme *st, struct kvt_call *c, const struct req *r)
{
	struct kvt_nvme_rows q;
	kvt_nv_call_rows(c, r->idx, &q);
	const unsigned char *stage = st->arena + (size_t)r->slot0 * st->bounce;
	uint32_t p = kvt_nvme_payload_bytes(&q.expect), hb = kvt_nvme_header_bytes(p), d = r->hr;
	uint64_t row = (uint64_t)q.expect.head_dim * 4u;
	struct kvt_nvme_view v = {.hdr = stage, .c0 = r->c0, .c1 = r->c1};
	v.data = stage + stage_pos(r, d + (uint64_t)r->c0 * KVT_NVME_CHUNK);
	if (!r->cached) {
		/* Read from disk with the header (a cached header was checked when it was put). */
		v.hpad = stage + hb;
		v.hpad_bytes = d - hb;
	}
	if (c->hdr_only) {
		v.data = stage; /* no chunks (c0 == c1 == 0), no tail padding: the header alone */
	} else if (r->de == q.loc.bytes) {
		v.pad = stage + stage_pos(r, (uint64_t)d + p);
		v.pad_bytes = q.loc.bytes - d - p;
	}
	struct kvt_err why;
	char name[256];
	if (kvt_nvme_verify(&v, &q.expect, st->store_id, &why)) {
		st->stats.checksum_failures++;
		kvt_hc_drop(st, q.loc.file, q.loc.offset); /* the block is suspect: read it whole */
		kvt_nv_name_block(st, &q.loc, &q.expect, name, sizeof name);
		const uint32_t item = c->map ? c->map[r->idx] : r->idx;
		const int first = !c->rc;
		call_fail(st, c, -EBADMSG, "block %u (%s) refused: %s", item, name, why.msg);
		if (first && c->err)
			c->err->item = item; /* the block is this request's alone */
		return;
	}
	if (!r->cached)
		kvt_hc_put(st, &q.loc, &q.expect, stage, hb);
	if (c->hdr_only)
		return;
	st->stats.blocks_read++;
	memcpy(q.out, v.data + (q.row_begin * row - (uint64_t)r->c0 * KVT_NVME_CHUNK),
	       (q.row_end - q.row_begin) * row);
}

static void finish(struct kvt_nvme *st, struct kvt_call *c, struct req *r, uint32_t ri)
{
	if (!c->write && !c->rc) /* after a failure nothing more is delivered */
		deliver(st, c, r);
	memset(&st->slot_used[r->slot0], 0, r->n_slots);
	st->req_free[st->n_req_free++] = ri;
	c->done++;
}

/* Reap what has completed (everything in flight, shuffled, when the test shim asks for it). */
static void reap(struct kvt_nvme *st, struct kvt_call *c)
{
	if (c->idle_more && !c->rc) {
		/* the device's queue is filled: the caller's work runs while it drains, one slice
		 * at a time (a failed submission here is retried, and reported, by enter) */
		if (io_uring_submit(&st->ring) > 0)
			st->stats.submits++;
		c->idle_more = c->idle->fn(c->idle->arg);
	}
	if (enter(st, c, st->shuffle ? st->inflight : 1))
		return;
	unsigned got = io_uring_peek_batch_cqe(&st->ring, st->cqp, st->qd);
	for (unsigned i = 0; i < got; i++) {
		st->cqes[i].data = io_uring_cqe_get_data64(st->cqp[i]);
		st->cqes[i].res = st->cqp[i]->res;
	}
	io_uring_cq_advance(&st->ring, got);
	for (unsigned i = got; st->shuffle && i > 1; i--) {
		/* Fisher-Yates with xorshift64: the order is a function of the seed alone. */
		uint64_t x = st->shuffle;
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		st->shuffle = x;
		unsigned j = (unsigned)(x % i);
		struct cqe_copy t = st->cqes[i - 1];
		st->cqes[i - 1] = st->cqes[j];
		st->cqes[j] = t;
	}
	uint64_t now = now_ns();
	for (unsigned i = 0; i < got; i++)
		complete(st, c, (uint32_t)st->cqes[i].data, st->cqes[i].res, now);
	/*
	 * Refill the device's queue before the CPU work: verifying and copying out the blocks just
	 * completed takes microseconds per 4 KiB, and a latency-bound device loses that much
	 * throughput for every slot left idle meanwhile. The spare half of the bounce slots holds
	 * the new reads while the completed blocks are still being checked.
	 */
	if (st->n_ready) {
		admit(st, c);
		prepare(st, c);
		if (io_uring_submit(&st->ring) > 0)
			st->stats.submits++;
	}
	for (uint32_t i = 0; i < st->n_ready; i++)
		finish(st, c, &st->reqs[st->ready[i]], st->ready[i]);
	st->n_ready = 0;
}

int kvt_nv_run_call(struct kvt_nvme *st, struct kvt_call *c)
{
	pools_reset(st);
	c->idle_more = c->idle && c->idle->fn;
	for (;;) {
		admit(st, c);
		prepare(st, c);
		if (!st->inflight) {
			/*
			 * Nothing in flight means every slot was free for admit and every pending
			 * piece went to prepare: unless the call is over, that is a stall, never a
			 * wait.
			 */
			if (!c->rc && c->done < c->n)
				call_fail(st, c, -EIO, "internal: block %u cannot be staged",
					  c->next);
			break;
		}
		reap(st, c);
		if (st->broken)
			break; /* pieces in the SQ ring may never complete: nothing to wait for */
	}
	if (c->rc && c->rc != -EBADMSG)
		st->stats.io_errors++;
	return c->rc;
}

/* ---- shared by the calls ------------------------------------------------------------------ */

int kvt_nv_usable(struct kvt_nvme *st, struct kvt_err *err)
{
	if (!st)
		return kvt_err_set(err, -EINVAL, "the store is NULL");
	if (st->broken)
		return kvt_err_set(err, -EIO,
				       "the store is out of service after a failed submission");
	return 0;
}

#endif
