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
 * Usage: nvme_bench [--file PATH] [--size BYTES] [--qd N] [--bounce BYTES] [--seconds S]
 *   defaults: ./kvt-nvme-bench.dat, 256 MiB, queue depth 16, bounce slots of 1 MiB (the store's
 *   default; smaller slots split a block's read into more I/Os), 2 s per figure (about 10 s).
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

#include "host/alloc.h"
#include "nvme_util.h"

#define ROUNDS 4

/* CPU seconds (user + system) this process has used. */
static double cpu_s(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
	       (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}







struct figure {
	double store_ops, store_s, store_cpu, raw_ops, raw_s, raw_cpu;
};

/*
 * Restored payloads land in a ring of 64 buffers: written, never read, here (as a restore into host
 * memory that the GPU reads by DMA). Allocated and touched once, outside every timed loop.
 */
static unsigned char *out_ring;


int main(int argc, char **argv)
{
	bench_name = "nvme_bench";
	const char *path = "./kvt-nvme-bench.dat";
	uint64_t size = 256 * MIB;
	uint32_t qd = 16, bounce = (uint32_t)MIB;
	double seconds = 2;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--file"))
			path = argv[i + 1];
		else if (!strcmp(argv[i], "--size"))
			size = strtoull(argv[i + 1], NULL, 0);
		else if (!strcmp(argv[i], "--qd"))
			qd = (uint32_t)strtoul(argv[i + 1], NULL, 0);
		else if (!strcmp(argv[i], "--bounce"))
			bounce = (uint32_t)strtoul(argv[i + 1], NULL, 0);
		else if (!strcmp(argv[i], "--seconds"))
			seconds = strtod(argv[i + 1], NULL);
		else
			break;
	}
	if (argc % 2 == 0 || size < 16 * MIB || !qd || !bounce || seconds <= 0) {
		fprintf(stderr,
			"usage: %s [--file PATH] [--size BYTES >= 16 MiB] [--qd N] [--bounce BYTES] "
			"[--seconds S]\n",
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
	struct kvt_nvme_config cfg = {paths, &size, 1, qd, bounce, 0};
	struct kvt_nvme *st;
	struct kvt_err err;
	int rc = kvt_nvme_open(&cfg, &st, &err);
	if (rc)
		bench_die("open", rc, err.msg);
	printf("nvme_bench: %s, %llu MiB, queue depth %u, %.1f s per side of each figure\n", path,
	       (unsigned long long)(size / MIB), qd, seconds);
	printf("store: %s\n", kvt_nvme_status(st));

	/* Three quarters of the file in 1 MiB blocks, the rest in 4 KiB blocks. */
	struct kvt_nvme_block_id big = bench_block_fitting(st, MIB), small = bench_block_fitting(st, 4096);
	uint32_t n_big = (uint32_t)(size / 4 * 3 / MIB), n_small = (uint32_t)(size / 4 / 4096) - 64;
	struct kvt_nvme_loc *lb = calloc(n_big, sizeof *lb), *ls = calloc(n_small, sizeof *ls);
	struct kvt_nvme_block_id *ib = calloc(n_big, sizeof *ib), *is = calloc(n_small, sizeof *is);
	uint64_t *ob = calloc(n_big, sizeof *ob), *os = calloc(n_small, sizeof *os);
	bench_fill(st, n_big, big, lb, ib);
	bench_fill(st, n_small, small, ls, is);
	for (uint32_t i = 0; i < n_big; i++)
		ob[i] = lb[i].offset;
	for (uint32_t i = 0; i < n_small; i++)
		os[i] = ls[i].offset;
	if (lb[0].bytes != MIB || ls[0].bytes != 4096)
		bench_die("layout", -EINVAL, "blocks do not take exactly 1 MiB and 4 KiB on disk");
	printf("blocks: %u of %u rows (%u payload bytes, 1 MiB on disk), %u of %u rows (%u payload "
	       "bytes, 4 KiB on disk)\n",
	       n_big, big.n_tokens, kvt_nvme_payload_bytes(&big), n_small, small.n_tokens,
	       kvt_nvme_payload_bytes(&small));

	/* The memory host-tier blocks come from (page-aligned, huge pages where the kernel gives them). */
	out_ring = kvt_mem_alloc(KVT_MEM_PAGES, BENCH_N_OUT * MIB);
	if (!out_ring)
		bench_die("out_ring", -ENOMEM, "out of memory");
	memset(out_ring, 0, BENCH_N_OUT * MIB);
	struct figure f[3];
	memset(f, 0, sizeof f);
	/* Rounds alternate raw and store, so drift of the device (or of neighbours) hits both. */
	for (int round = 0; round < ROUNDS; round++) {
		double t, c, w = seconds / ROUNDS;
		c = cpu_s();
		f[0].raw_ops += (double)bench_raw_loop(path, qd, (uint32_t)MIB, ob, n_big, 0, w, &t);
		f[0].raw_s += t;
		f[0].raw_cpu += cpu_s() - c;
		c = cpu_s();
		f[0].store_ops += (double)bench_store_loop(st, lb, ib, n_big, 0, 0, n_big, w, &t,
							  out_ring);
		f[0].store_s += t;
		f[0].store_cpu += cpu_s() - c;
		c = cpu_s();
		f[1].raw_ops += (double)bench_raw_loop(path, qd, 4096, os, n_small, 1, w, &t);
		f[1].raw_s += t;
		f[1].raw_cpu += cpu_s() - c;
		c = cpu_s();
		f[1].store_ops += (double)bench_store_loop(st, ls, is, n_small, 1, 0, 64 * qd, w,
							  &t, out_ring);
		f[1].store_s += t;
		f[1].store_cpu += cpu_s() - c;
		c = cpu_s();
		f[2].store_ops += (double)bench_store_loop(st, lb, ib, n_big, 1, 1, 64 * qd, w, &t,
							  out_ring);
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
	kvt_mem_free(KVT_MEM_PAGES, out_ring, BENCH_N_OUT * MIB);
	free(lb);
	free(ls);
	free(ib);
	free(is);
	free(ob);
	free(os);
	return 0;
}
