/* SPDX-License-Identifier: MIT */
/*
 * What the CPU benchmarks (cpu_scan.c, cpu_miss_attend.c) share: a fixed-seed xorshift generator
 * for their data and the median of their repeated timings.
 */
#ifndef KVT_BENCH_CPU_BENCH_H
#define KVT_BENCH_CPU_BENCH_H

#include <stdint.h>
#include <stdlib.h>

/* The next number of a xorshift64 sequence from one fixed seed (the same data every run). */
static inline uint64_t bench_next(void)
{
	static uint64_t rng = 0x9e3779b97f4a7c15ull;
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static inline int bench_cmp_u64(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* The median of t[0..n) (n >= 1), sorting t. */
static inline uint64_t bench_median(uint64_t *t, size_t n)
{
	qsort(t, n, sizeof *t, bench_cmp_u64);
	return t[n / 2];
}

#endif
