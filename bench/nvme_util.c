/* SPDX-License-Identifier: MIT */
/* The NVMe benchmarks' shared clock, generator, block writer and read loops (nvme_util.h). */
#define _GNU_SOURCE
#include "nvme_util.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "host/alloc.h"

const char *bench_name = "bench";
struct kvt_err bench_err;

double bench_now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t bench_rng(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

_Noreturn void bench_die(const char *what, int rc, const char *detail)
{
	fprintf(stderr, "%s: %s: %s (%d): %s\n", bench_name, what, strerror(-rc), rc, detail);
	exit(1);
}

/* The largest block of ROW_BYTES rows whose on-disk size is at most `disk` bytes. */
struct kvt_nvme_block_id bench_block_fitting(struct kvt_nvme *st, uint64_t disk)
{
	struct kvt_nvme_block_id id;
	memset(&id, 0, sizeof id);
	id.head_dim = ROW_BYTES / 4;
	id.generation = 1;
	for (id.n_tokens = (uint32_t)(disk / ROW_BYTES); id.n_tokens > 1; id.n_tokens--)
		if (kvt_nvme_block_bytes(st, &id) <= disk)
			break;
	return id;
}

/* Write n blocks shaped like `shape` (seq = index) in batches; locs and ids receive them. */
void bench_fill(struct kvt_nvme *st, uint32_t n, struct kvt_nvme_block_id shape,
		struct kvt_nvme_loc *locs, struct kvt_nvme_block_id *ids)
{
	size_t pb = kvt_nvme_payload_bytes(&shape);
	unsigned char *payload = malloc(pb);
	uint64_t s = 1;
	for (size_t i = 0; i < pb; i++)
		payload[i] = (unsigned char)bench_rng(&s);
	struct kvt_nvme_block b[256];
	for (uint32_t i = 0; i < n;) {
		uint32_t k = n - i < 256 ? n - i : 256;
		for (uint32_t j = 0; j < k; j++) {
			ids[i + j] = shape;
			ids[i + j].seq = i + j;
			b[j].id = ids[i + j];
			b[j].payload = payload;
		}
		int rc = kvt_nvme_write_blocks(st, k, b, locs + i, &bench_err);
		if (rc)
			bench_die("write", rc, bench_err.msg);
		i += k;
	}
	free(payload);
}

/*
 * The ceiling: `xfer`-byte O_DIRECT reads through io_uring with registered buffers and a registered
 * file, qd in flight, at offs[0..n) in order (random: indices drawn at random). Returns reads done.
 */
uint64_t bench_raw_loop(const char *path, uint32_t qd, uint32_t xfer, const uint64_t *offs,
			 uint32_t n, int random, double seconds, double *elapsed)
{
	int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
	if (fd < 0)
		fd = open(path, O_RDONLY | O_CLOEXEC); /* the store fell back to buffered too */
	struct io_uring ring;
	int rc = io_uring_queue_init(qd, &ring, 0);
	if (fd < 0 || rc < 0)
		bench_die("raw loop setup", fd < 0 ? -errno : rc, path);
	/* the same kind of memory as the store's bounce pool, so both get the same page size */
	unsigned char *buf = kvt_mem_alloc(KVT_MEM_PAGES, (size_t)qd * xfer);
	if (!buf)
		bench_die("raw loop buffers", -ENOMEM, "out of memory");
	struct iovec *iov = calloc(qd, sizeof *iov);
	for (uint32_t i = 0; i < qd; i++)
		iov[i] = (struct iovec){buf + (size_t)i * xfer, xfer};
	int fixed = io_uring_register_buffers(&ring, iov, qd) == 0;
	int ffile = io_uring_register_files(&ring, &fd, 1) == 0;
	uint64_t done = 0, next = 0, s = 7;
	uint32_t inflight = 0, n_free = qd, *free_slots = calloc(qd, sizeof *free_slots);
	for (uint32_t i = 0; i < qd; i++)
		free_slots[i] = i;
	double t0 = bench_now_s(), stop = t0 + seconds;
	int running = 1;
	while (running || inflight) {
		for (; running && n_free; inflight++) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
			uint32_t idx =
				random ? (uint32_t)(bench_rng(&s) % n) : (uint32_t)(next++ % n);
			uint32_t slot = free_slots[--n_free];
			unsigned char *b = buf + (size_t)slot * xfer;
			int f = ffile ? 0 : fd;
			if (fixed)
				io_uring_prep_read_fixed(sqe, f, b, xfer, offs[idx], (int)slot);
			else
				io_uring_prep_read(sqe, f, b, xfer, offs[idx]);
			if (ffile)
				sqe->flags |= IOSQE_FIXED_FILE;
			io_uring_sqe_set_data64(sqe, slot);
		}
		struct io_uring_cqe *cqe;
		rc = io_uring_submit_and_wait(&ring, 1);
		if (rc < 0 && rc != -EINTR)
			bench_die("raw submit", rc, path);
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&ring, head, cqe)
		{
			if (cqe->res != (int)xfer)
				bench_die("raw read", cqe->res < 0 ? cqe->res : -EIO,
				    "short or failed read");
			free_slots[n_free++] = (uint32_t)io_uring_cqe_get_data64(cqe);
			seen++;
		}
		io_uring_cq_advance(&ring, seen);
		inflight -= seen;
		done += seen;
		if (bench_now_s() >= stop)
			running = 0;
	}
	free(free_slots);
	*elapsed = bench_now_s() - t0;
	io_uring_queue_exit(&ring);
	close(fd);
	free(iov);
	kvt_mem_free(KVT_MEM_PAGES, buf, (size_t)qd * xfer);
	return done;
}

/* The store side of a figure: batches of `batch` reads (whole blocks, or one chunk of rows). */
uint64_t bench_store_loop(struct kvt_nvme *st, const struct kvt_nvme_loc *locs,
			  const struct kvt_nvme_block_id *ids, uint32_t n, int random, int rows,
			  uint32_t batch, double seconds, double *elapsed, unsigned char *out)
{
	size_t pb = rows ? 8 * ROW_BYTES : kvt_nvme_payload_bytes(&ids[0]), n_out = BENCH_N_OUT;
	pb = (pb + 4095) & ~(size_t)4095; /* each output page-aligned, as host-tier blocks are */
	struct kvt_nvme_loc *l = calloc(batch, sizeof *l);
	struct kvt_nvme_block_id *e = calloc(batch, sizeof *e);
	struct kvt_nvme_rows *q = calloc(batch, sizeof *q);
	void **outs = calloc(batch, sizeof *outs);
	uint64_t done = 0, next = 0, s = 11;
	double t0 = bench_now_s(), stop = t0 + seconds;
	while (bench_now_s() < stop) {
		for (uint32_t j = 0; j < batch; j++) {
			uint32_t idx =
				random ? (uint32_t)(bench_rng(&s) % n) : (uint32_t)(next++ % n);
			l[j] = locs[idx];
			e[j] = ids[idx];
			outs[j] = out + (size_t)(j % n_out) * pb;
			if (rows) {
				/* One 4 KiB chunk (8 rows) at a random chunk boundary. */
				uint32_t c = (uint32_t)(bench_rng(&s) % (ids[idx].n_tokens / 8));
				q[j] = (struct kvt_nvme_rows){locs[idx], ids[idx], c * 8, c * 8 + 8,
							      outs[j]};
			}
		}
		int rc = rows ? kvt_nvme_read_rows(st, batch, q, &bench_err)
			      : kvt_nvme_read_blocks(st, batch, l, e, outs, &bench_err);
		if (rc)
			bench_die("store read", rc, bench_err.msg);
		done += batch;
	}
	*elapsed = bench_now_s() - t0;
	free(l);
	free(e);
	free(q);
	free(outs);
	return done;
}
