/* SPDX-License-Identifier: MIT */
/*
 * NVMe store throughput against the disk's own ceiling, measured in the same run on the same file:
 *   restore: whole 1 MiB blocks read in order through kvt_nvme_read_blocks (verified in the
 *            bounce buffer, copied out, as kvt_tier_restore reads them) into host-tier memory,
 *            against a raw io_uring loop of 1 MiB O_DIRECT reads over the same offsets into the
 *            same kind of memory;
 *   random:  4 KiB blocks read in random order through kvt_nvme_read_blocks, against raw 4 KiB
 *            random reads of the same offsets;
 *   rows:    direct serving of one 4 KiB chunk of rows out of the 1 MiB blocks through
 *            kvt_nvme_read_rows (only the chunk's sectors under a cached header), against the raw
 *            4 KiB figure.
 * Both sides keep the same queue depth in flight. The store and raw phases alternate (two rounds
 * of each) so drift of the device affects both alike. Prints figure, raw figure and ratio.
 *
 * Usage: nvme_bench [--file PATH] [--size BYTES] [--qd N] [--seconds S]
 *   defaults: ./kvt-nvme-bench.dat, 256 MiB, queue depth 16, 2 s per figure (about 10 s in all).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "host/nvme_store.h"
#include "host/alloc.h"

#define MIB ((uint64_t)1 << 20)

/* The detail of a failed store call (every call passes &bench_err). */
static struct kvt_err bench_err;
#define ROW_BYTES 512u
#define ROUNDS 4 /* head_dim 128, 2 bytes per element, K and V */

/* CPU seconds (user + system) this process has used. */
static double cpu_s(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
	       (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static void die(const char *what, int rc, const char *detail)
{
	fprintf(stderr, "nvme_bench: %s: %s (%d): %s\n", what, strerror(-rc), rc, detail);
	exit(1);
}

/* The largest block of ROW_BYTES rows whose on-disk size is at most `disk` bytes. */
static struct kvt_nvme_block_id block_fitting(struct kvt_nvme *st, uint64_t disk)
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
static void fill(struct kvt_nvme *st, uint32_t n, struct kvt_nvme_block_id shape,
		 struct kvt_nvme_loc *locs, struct kvt_nvme_block_id *ids)
{
	size_t pb = kvt_nvme_payload_bytes(&shape);
	unsigned char *payload = malloc(pb);
	uint64_t s = 1;
	for (size_t i = 0; i < pb; i++)
		payload[i] = (unsigned char)rng_next(&s);
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
			die("write", rc, bench_err.msg);
		i += k;
	}
	free(payload);
}

/*
 * The ceiling: `xfer`-byte O_DIRECT reads through io_uring with registered buffers and a registered
 * file, qd in flight, at offs[0..n) in order (random: indices drawn at random). Returns reads done.
 */
static uint64_t raw_loop(const char *path, uint32_t qd, uint32_t xfer, const uint64_t *offs,
			 uint32_t n, int random, double seconds, double *elapsed)
{
	int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
	if (fd < 0)
		fd = open(path, O_RDONLY | O_CLOEXEC); /* the store fell back to buffered too */
	struct io_uring ring;
	int rc = io_uring_queue_init(qd, &ring, 0);
	if (fd < 0 || rc < 0)
		die("raw loop setup", fd < 0 ? -errno : rc, path);
	/* the same kind of memory as the store's bounce pool, so both get the same page size */
	unsigned char *buf = kvt_mem_alloc(KVT_MEM_PAGES, (size_t)qd * xfer);
	if (!buf)
		die("raw loop buffers", -ENOMEM, "out of memory");
	struct iovec *iov = calloc(qd, sizeof *iov);
	for (uint32_t i = 0; i < qd; i++)
		iov[i] = (struct iovec){buf + (size_t)i * xfer, xfer};
	int fixed = io_uring_register_buffers(&ring, iov, qd) == 0;
	int ffile = io_uring_register_files(&ring, &fd, 1) == 0;
	uint64_t done = 0, next = 0, s = 7;
	uint32_t inflight = 0, n_free = qd, *free_slots = calloc(qd, sizeof *free_slots);
	for (uint32_t i = 0; i < qd; i++)
		free_slots[i] = i;
	double t0 = now_s(), stop = t0 + seconds;
	int running = 1;
	while (running || inflight) {
		for (; running && n_free; inflight++) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
			uint32_t idx =
				random ? (uint32_t)(rng_next(&s) % n) : (uint32_t)(next++ % n);
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
			die("raw submit", rc, path);
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&ring, head, cqe)
		{
			if (cqe->res != (int)xfer)
				die("raw read", cqe->res < 0 ? cqe->res : -EIO,
				    "short or failed read");
			free_slots[n_free++] = (uint32_t)io_uring_cqe_get_data64(cqe);
			seen++;
		}
		io_uring_cq_advance(&ring, seen);
		inflight -= seen;
		done += seen;
		if (now_s() >= stop)
			running = 0;
	}
	free(free_slots);
	*elapsed = now_s() - t0;
	io_uring_queue_exit(&ring);
	close(fd);
	free(iov);
	kvt_mem_free(KVT_MEM_PAGES, buf, (size_t)qd * xfer);
	return done;
}

struct figure {
	double store_ops, store_s, store_cpu, raw_ops, raw_s, raw_cpu;
};

/*
 * Restored payloads land in a ring of 64 buffers: written, never read, here (as a restore into host
 * memory that the GPU reads by DMA). Allocated and touched once, outside every timed loop.
 */
#define N_OUT 64
static unsigned char *out_ring;

/* The store side of a figure: batches of `batch` reads (whole blocks, or one chunk of rows). */
static uint64_t store_loop(struct kvt_nvme *st, const struct kvt_nvme_loc *locs,
			   const struct kvt_nvme_block_id *ids, uint32_t n, int random, int rows,
			   uint32_t batch, double seconds, double *elapsed)
{
	size_t pb = rows ? 8 * ROW_BYTES : kvt_nvme_payload_bytes(&ids[0]), n_out = N_OUT;
	pb = (pb + 4095) & ~(size_t)4095; /* each output page-aligned, as host-tier blocks are */
	unsigned char *out = out_ring;
	struct kvt_nvme_loc *l = calloc(batch, sizeof *l);
	struct kvt_nvme_block_id *e = calloc(batch, sizeof *e);
	struct kvt_nvme_rows *q = calloc(batch, sizeof *q);
	void **outs = calloc(batch, sizeof *outs);
	uint64_t done = 0, next = 0, s = 11;
	double t0 = now_s(), stop = t0 + seconds;
	while (now_s() < stop) {
		for (uint32_t j = 0; j < batch; j++) {
			uint32_t idx =
				random ? (uint32_t)(rng_next(&s) % n) : (uint32_t)(next++ % n);
			l[j] = locs[idx];
			e[j] = ids[idx];
			outs[j] = out + (size_t)(j % n_out) * pb;
			if (rows) {
				/* One 4 KiB chunk (8 rows) at a random chunk boundary. */
				uint32_t c = (uint32_t)(rng_next(&s) % (ids[idx].n_tokens / 8));
				q[j] = (struct kvt_nvme_rows){locs[idx], ids[idx], c * 8, c * 8 + 8,
							      outs[j]};
			}
		}
		int rc = rows ? kvt_nvme_read_rows(st, batch, q, &bench_err)
			      : kvt_nvme_read_blocks(st, batch, l, e, outs, &bench_err);
		if (rc)
			die("store read", rc, bench_err.msg);
		done += batch;
	}
	*elapsed = now_s() - t0;
	free(l);
	free(e);
	free(q);
	free(outs);
	return done;
}

int main(int argc, char **argv)
{
	const char *path = "./kvt-nvme-bench.dat";
	uint64_t size = 256 * MIB;
	uint32_t qd = 16;
	double seconds = 2;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--file"))
			path = argv[i + 1];
		else if (!strcmp(argv[i], "--size"))
			size = strtoull(argv[i + 1], NULL, 0);
		else if (!strcmp(argv[i], "--qd"))
			qd = (uint32_t)strtoul(argv[i + 1], NULL, 0);
		else if (!strcmp(argv[i], "--seconds"))
			seconds = strtod(argv[i + 1], NULL);
		else
			break;
	}
	if (argc % 2 == 0 || size < 16 * MIB || !qd || seconds <= 0) {
		fprintf(stderr,
			"usage: %s [--file PATH] [--size BYTES >= 16 MiB] [--qd N] [--seconds S]\n",
			argv[0]);
		return 2;
	}
	struct kvt_err why;
	if (!kvt_nvme_available(&why)) {
		printf("nvme_bench: skipped: %s\n", why.msg);
		return 77;
	}
	/* A file this run creates is removed at the end; one given is left in place. */
	int created = access(path, F_OK) != 0;
	const char *paths[1] = {path};
	struct kvt_nvme_config cfg = {paths, &size, 1, qd, (uint32_t)MIB, 0};
	struct kvt_nvme *st;
	struct kvt_err err;
	int rc = kvt_nvme_open(&cfg, &st, &err);
	if (rc)
		die("open", rc, err.msg);
	printf("nvme_bench: %s, %llu MiB, queue depth %u, %.1f s per side of each figure\n", path,
	       (unsigned long long)(size / MIB), qd, seconds);
	printf("store: %s\n", kvt_nvme_status(st));

	/* Three quarters of the file in 1 MiB blocks, the rest in 4 KiB blocks. */
	struct kvt_nvme_block_id big = block_fitting(st, MIB), small = block_fitting(st, 4096);
	uint32_t n_big = (uint32_t)(size / 4 * 3 / MIB), n_small = (uint32_t)(size / 4 / 4096) - 64;
	struct kvt_nvme_loc *lb = calloc(n_big, sizeof *lb), *ls = calloc(n_small, sizeof *ls);
	struct kvt_nvme_block_id *ib = calloc(n_big, sizeof *ib), *is = calloc(n_small, sizeof *is);
	uint64_t *ob = calloc(n_big, sizeof *ob), *os = calloc(n_small, sizeof *os);
	fill(st, n_big, big, lb, ib);
	fill(st, n_small, small, ls, is);
	for (uint32_t i = 0; i < n_big; i++)
		ob[i] = lb[i].offset;
	for (uint32_t i = 0; i < n_small; i++)
		os[i] = ls[i].offset;
	if (lb[0].bytes != MIB || ls[0].bytes != 4096)
		die("layout", -EINVAL, "blocks do not take exactly 1 MiB and 4 KiB on disk");
	printf("blocks: %u of %u rows (%u payload bytes, 1 MiB on disk), %u of %u rows (%u payload "
	       "bytes, 4 KiB on disk)\n",
	       n_big, big.n_tokens, kvt_nvme_payload_bytes(&big), n_small, small.n_tokens,
	       kvt_nvme_payload_bytes(&small));

	/* The memory host-tier blocks come from (page-aligned, huge pages where the kernel gives them). */
	out_ring = kvt_mem_alloc(KVT_MEM_PAGES, N_OUT * MIB);
	if (!out_ring)
		die("out_ring", -ENOMEM, "out of memory");
	memset(out_ring, 0, N_OUT * MIB);
	struct figure f[3];
	memset(f, 0, sizeof f);
	/* Rounds alternate raw and store, so drift of the device (or of neighbours) hits both. */
	for (int round = 0; round < ROUNDS; round++) {
		double t, c, w = seconds / ROUNDS;
		c = cpu_s();
		f[0].raw_ops += (double)raw_loop(path, qd, (uint32_t)MIB, ob, n_big, 0, w, &t);
		f[0].raw_s += t;
		f[0].raw_cpu += cpu_s() - c;
		c = cpu_s();
		f[0].store_ops += (double)store_loop(st, lb, ib, n_big, 0, 0, n_big, w, &t);
		f[0].store_s += t;
		f[0].store_cpu += cpu_s() - c;
		c = cpu_s();
		f[1].raw_ops += (double)raw_loop(path, qd, 4096, os, n_small, 1, w, &t);
		f[1].raw_s += t;
		f[1].raw_cpu += cpu_s() - c;
		c = cpu_s();
		f[1].store_ops += (double)store_loop(st, ls, is, n_small, 1, 0, 64 * qd, w, &t);
		f[1].store_s += t;
		f[1].store_cpu += cpu_s() - c;
		c = cpu_s();
		f[2].store_ops += (double)store_loop(st, lb, ib, n_big, 1, 1, 64 * qd, w, &t);
		f[2].store_s += t;
		f[2].store_cpu += cpu_s() - c;
	}
	double sb = f[0].store_ops / f[0].store_s, rb = f[0].raw_ops / f[0].raw_s;
	printf("restore, 1 MiB blocks, %u per call: store %.3f GB/s (%.3f GB/s of payload), raw "
	       "io_uring %.3f GB/s, ratio %.3f\n",
	       n_big, sb * (double)MIB / 1e9, sb * kvt_nvme_payload_bytes(&big) / 1e9,
	       rb * (double)MIB / 1e9, sb / rb);
	double si = f[1].store_ops / f[1].store_s, ri = f[1].raw_ops / f[1].raw_s;
	printf("random read, 4 KiB blocks, %u per call: store %.1f K IOPS, raw io_uring %.1f K "
	       "IOPS, "
	       "ratio %.3f\n",
	       64 * qd, si / 1e3, ri / 1e3, si / ri);
	double sr = f[2].store_ops / f[2].store_s;
	printf("direct serving, 8 rows (4 KiB) of a 1 MiB block, chunk reads, cached headers: store %.1f "
	       "K "
	       "reads/s, ratio to raw 4 KiB IOPS %.3f\n",
	       sr / 1e3, sr / ri);
	printf("CPU per MiB restored: store %.0f us, raw %.0f us; per 4 KiB read: store %.1f us, "
	       "raw "
	       "%.1f us\n",
	       f[0].store_cpu / f[0].store_ops * 1e6, f[0].raw_cpu / f[0].raw_ops * 1e6,
	       f[1].store_cpu / f[1].store_ops * 1e6, f[1].raw_cpu / f[1].raw_ops * 1e6);
	struct kvt_nvme_stats s;
	kvt_nvme_get_stats(st, &s);
	printf("store I/O latency: mean %.1f us, max %.1f us over %llu I/Os; %llu submits\n",
	       (double)s.lat_sum_ns / 1e3 / (double)(s.read_ios + s.write_ios), s.lat_max_ns / 1e3,
	       (unsigned long long)(s.read_ios + s.write_ios), (unsigned long long)s.submits);
	kvt_nvme_close(st);
	if (created)
		unlink(path);
	kvt_mem_free(KVT_MEM_PAGES, out_ring, N_OUT * MIB);
	free(lb);
	free(ls);
	free(ib);
	free(is);
	free(ob);
	free(os);
	return 0;
}
