/* SPDX-License-Identifier: MIT */
/* What the GPU micro-benchmarks share: checked calls, a device hash for fills, the median. */
#ifndef KVT_BENCH_GPU_BENCH_CUH
#define KVT_BENCH_GPU_BENCH_CUH

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

/* A CUDA call that must succeed: a benchmark has nothing to measure after a failure. */
#define CK(x)                                                                                      \
	do {                                                                                       \
		cudaError_t e_ = (x);                                                              \
		if (e_ != cudaSuccess) {                                                           \
			fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                  \
				cudaGetErrorString(e_));                                           \
			exit(1);                                                                   \
		}                                                                                  \
	} while (0)
/* A kvtier launcher that must return 0. */
#define RC(x)                                                                                      \
	do {                                                                                       \
		int r_ = (x);                                                                      \
		if (r_ != 0) {                                                                     \
			fprintf(stderr, "%s:%d %s returned %d\n", __FILE__, __LINE__, #x, r_);     \
			exit(1);                                                                   \
		}                                                                                  \
	} while (0)

/* splitmix64's finalizer: fills that depend on the index alone, never zeros in practice. */
static __device__ uint32_t hash32(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return (uint32_t)(x ^ (x >> 33));
}

static float median(std::vector<float> v)
{
	std::sort(v.begin(), v.end());
	return v[v.size() / 2];
}

#endif
