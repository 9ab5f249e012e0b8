/* SPDX-License-Identifier: MIT */
/*
 * CPU index scan: INT4 x binary scoring of n tokens of one KV head (kvt_score), as bytes of index read
 * per second, against a peer measured in the same run: a read-only pass over the same bytes (the
 * memory bandwidth this one core gets). Prints the median of repeated runs and the ratio.
 *   cpu_scan [tokens] [head_dim] [repeats]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bench.h"
#include "half.h"
#include "internal.h"

int main(int argc, char **argv)
{
	uint32_t n = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 0) : 1u << 20;
	uint32_t d = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 0) : 128;
	int reps = argc > 3 ? atoi(argv[3]) : 9;
	if (n == 0 || (d != 64 && d != 128 && d != 256) || reps < 1 || reps > 1000) {
		fprintf(stderr, "usage: cpu_scan [tokens >= 1] [head_dim 64|128|256] [repeats 1..1000]\n");
		return 2;
	}
	size_t words = d / 32, code_bytes = (size_t)n * words * 4;
	uint32_t *codes = malloc(code_bytes);
	uint16_t *sigma = malloc(n * 2u), *beta = malloc(n * 2u);
	float *scores = malloc(n * 4u), *rot = malloc(sizeof(float) * d * d);
	float q[KVT_MAX_HEAD_DIM], zero[KVT_MAX_HEAD_DIM] = { 0 };
	uint64_t *t = malloc(sizeof *t * (size_t)reps);
	kvt_qcode qc;
	if (!codes || !sigma || !beta || !scores || !rot || !t || kvt_rotation_generate(1, 0, d, rot)) {
		fprintf(stderr, "cpu_scan: out of memory\n");
		return 1;
	}
	for (size_t i = 0; i < (size_t)n * words; i++)
		codes[i] = (uint32_t)bench_next();
	for (uint32_t i = 0; i < n; i++) {
		sigma[i] = kvt_f32_to_f16(1.0f + (float)(bench_next() % 1000) / 1000.0f);
		beta[i] = kvt_f32_to_f16((float)(bench_next() % 1000) / 1000.0f);
	}
	for (uint32_t j = 0; j < d; j++)
		q[j] = (float)(bench_next() % 2001) / 1000.0f - 1.0f;
	kvt_query_prepare(d, rot, zero, zero, q, &qc);
	const size_t bytes = code_bytes + 4u * n; /* codes + sigma + beta */
	volatile uint64_t sink = 0;
	for (int r = 0; r < reps; r++) {
		uint64_t t0 = kvt_now_ns();
		uint64_t acc = 0;
		const uint64_t *p = (const uint64_t *)codes;
		for (size_t i = 0; i < code_bytes / 8; i++)
			acc += p[i];
		for (uint32_t i = 0; i < n; i++)
			acc += sigma[i] + beta[i];
		sink += acc;
		t[r] = kvt_now_ns() - t0;
	}
	double read_gbs = (double)bytes / (double)bench_median(t, (size_t)reps);
	for (int r = 0; r < reps; r++) {
		uint64_t t0 = kvt_now_ns();
		kvt_score(d, &qc, n, codes, sigma, beta, scores);
		t[r] = kvt_now_ns() - t0;
		sink += (uint64_t)scores[r % n];
	}
	uint64_t med = bench_median(t, (size_t)reps);
	double scan_gbs = (double)bytes / (double)med;
	printf("cpu_scan: %u tokens x D=%u, one KV head, one core, median of %d\n", n, d, reps);
	printf("  score:     %8.3f ms  %7.2f GB/s of index  %7.1f M tokens/s\n", (double)med / 1e6,
	       scan_gbs, (double)n / ((double)med / 1e3));
	printf("  read peer: %7.2f GB/s (sum over the same bytes)\n", read_gbs);
	printf("  ratio:     %.2f of the read peer\n", scan_gbs / read_gbs);
	free(codes);
	free(sigma);
	free(beta);
	free(scores);
	free(rot);
	free(t);
	return sink == 42 ? 3 : 0;
}
