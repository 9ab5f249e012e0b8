/* SPDX-License-Identifier: MIT */
/*
 * What the NVMe benchmarks (nvme_bench, nvme_read) share: the clock, a seeded generator, blocks
 * written through the store, the store's read loop and the raw io_uring loop that is its ceiling.
 * Each loop keeps its queue depth in flight for a given time and returns the reads done.
 */
#ifndef KVT_BENCH_NVME_UTIL_H
#define KVT_BENCH_NVME_UTIL_H

#include <stdint.h>

#include "host/nvme_store.h"

#define MIB ((uint64_t)1 << 20)
#define ROW_BYTES 512u /* head_dim 128, 2 bytes per element, K and V */

/* The benchmark's name in error messages, and the detail of a failed store call. */
extern const char *bench_name;
extern struct kvt_err bench_err;

double bench_now_s(void);
uint64_t bench_rng(uint64_t *s);
/* Print what failed, strerror(-rc) and the detail, and exit 1. */
__attribute__((noreturn)) void bench_die(const char *what, int rc, const char *detail);

/* The largest block of ROW_BYTES rows whose on-disk size is at most `disk` bytes. */
struct kvt_nvme_block_id bench_block_fitting(struct kvt_nvme *st, uint64_t disk);
/* Write n blocks shaped like `shape` (seq = index) in batches; locs and ids receive them. */
void bench_fill(struct kvt_nvme *st, uint32_t n, struct kvt_nvme_block_id shape,
		struct kvt_nvme_loc *locs, struct kvt_nvme_block_id *ids);

/*
 * The ceiling: `xfer`-byte O_DIRECT reads of `path` (buffered where O_DIRECT is refused, as the
 * store falls back) through io_uring with registered buffers and a registered file, qd in flight,
 * at offs[0..n) in order (random: indices drawn at random), for `seconds`. *elapsed receives the
 * time taken; returns reads done.
 */
uint64_t bench_raw_loop(const char *path, uint32_t qd, uint32_t xfer, const uint64_t *offs,
			uint32_t n, int random, double seconds, double *elapsed);

/*
 * The store's side: calls of `batch` reads of blocks drawn from locs/ids[0..n) (in order, or at
 * random): whole blocks through kvt_nvme_read_blocks, or (rows) one 4 KiB chunk of 8 rows at a
 * random chunk boundary through kvt_nvme_read_rows, into a ring of 64 page-aligned outputs at `out`
 * (64 x the rounded-up output size). Returns reads done.
 */
uint64_t bench_store_loop(struct kvt_nvme *st, const struct kvt_nvme_loc *locs,
			  const struct kvt_nvme_block_id *ids, uint32_t n, int random, int rows,
			  uint32_t batch, double seconds, double *elapsed, unsigned char *out);
#define BENCH_N_OUT 64

#endif
