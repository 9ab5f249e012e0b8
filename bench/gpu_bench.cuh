/* SPDX-License-Identifier: MIT */
/* What the GPU micro-benchmarks share: checked calls, a device hash for fills, event timing. */
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

/* A kvtier call that must succeed, on the kvt_cache *cache in scope: else its code and
 * kvt_last_error, and exit. */
#define KVT_MUST(x)                                                                                \
	do {                                                                                       \
		int r_ = (x);                                                                      \
		if (r_ < 0) {                                                                      \
			fprintf(stderr, "%s:%d %s = %d: %s\n", __FILE__, __LINE__, #x, r_,         \
				kvt_last_error(cache));                                            \
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

/* The current device's properties; false (after saying so, naming the benchmark) when there is
 * none: a benchmark then has nothing to measure and exits 0. */
static inline bool bench_device(const char *name, cudaDeviceProp *prop)
{
	int dev = 0;
	if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(prop, dev) != cudaSuccess) {
		printf("%s: no CUDA device\n", name);
		return false;
	}
	return true;
}

/* The NUMA node the current device's PCI function sits on, from sysfs; -1 when unknown. Beside
 * kvt_stats.host_numa_node it tells whether the host tier's rows cross the sockets' link on the
 * way to the GPU (runs on two machines of one kind can differ there). */
static inline int bench_gpu_numa_node(void)
{
	int dev = 0, node = -1;
	char bus[32], path[96];
	if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof bus, dev) !=
							   cudaSuccess)
		return -1;
	for (char *c = bus; *c; c++)
		*c = (char)(*c >= 'A' && *c <= 'F' ? *c - 'A' + 'a' : *c);
	snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", bus);
	FILE *f = fopen(path, "r");
	if (f) {
		if (fscanf(f, "%d", &node) != 1)
			node = -1;
		fclose(f);
	}
	return node;
}

/*
 * The median milliseconds of f(i), enqueued on `st` between two CUDA events, over `runs` timings
 * after `warmup` untimed ones (i counts all of them from 0); pre(i) runs before each, outside the
 * events, and post(i) after the second event is enqueued, before it is waited for.
 */
template <class F, class P, class Q>
static float median_ms(cudaStream_t st, int warmup, int runs, F f, P pre, Q post)
{
	cudaEvent_t e0, e1;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	std::vector<float> t;
	for (int i = 0; i < warmup + runs; i++) {
		pre(i);
		CK(cudaEventRecord(e0, st));
		f(i);
		CK(cudaEventRecord(e1, st));
		post(i);
		CK(cudaEventSynchronize(e1));
		float ms;
		CK(cudaEventElapsedTime(&ms, e0, e1));
		if (i >= warmup)
			t.push_back(ms);
	}
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	return median(t);
}

template <class F, class P>
static float median_ms(cudaStream_t st, int warmup, int runs, F f, P pre)
{
	return median_ms(st, warmup, runs, f, pre, [](int) {});
}

template <class F>
static float median_ms(cudaStream_t st, int warmup, int runs, F f)
{
	return median_ms(st, warmup, runs, f, [](int) {});
}

static __global__ void k_empty(void)
{
}

/* Spins until go[0] is set, or about a second has passed (then sets go[1]: the timing is void). */
static __global__ void k_hold(volatile int *go)
{
	unsigned long long t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	while (!go[0]) {
		__nanosleep(256);
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
		if (t - t0 > 1000000000ull) {
			go[1] = 1;
			return;
		}
	}
}

/*
 * The median milliseconds of f(i) timed alone, as median_ms times it, but with the first event, f
 * and the second event enqueued behind a kernel that holds the stream until the host has enqueued
 * them (nvbench's blocking kernel): the device's time for one call started from an idle queue,
 * without the host's launch latency between the first event and f's first kernel, which
 * median_ms's figure includes. Exits if the hold timed out (the host took over a second).
 */
template <class F>
static float queued_ms(cudaStream_t st, int warmup, int runs, F f)
{
	volatile int *go;
	int *dgo;
	CK(cudaHostAlloc((void **)&go, 2 * sizeof(int), cudaHostAllocMapped));
	CK(cudaHostGetDevicePointer((void **)&dgo, (void *)go, 0));
	go[1] = 0;
	const float ms = median_ms(
		st, warmup, runs, f,
		[&](int) {
			go[0] = 0;
			k_hold<<<1, 1, 0, st>>>(dgo);
			CK(cudaGetLastError());
		},
		[&](int) { __atomic_store_n((int *)go, 1, __ATOMIC_SEQ_CST); });
	if (go[1]) {
		fprintf(stderr, "queued_ms: a hold timed out before the host had enqueued\n");
		exit(1);
	}
	CK(cudaFreeHost((void *)go));
	return ms;
}

/* `kernels` empty kernels of one block on stream s, the second on as programmatic dependents of
 * the one before (as the library's passes are launched). */
static inline void empty_call(int kernels, cudaStream_t s)
{
	cudaLaunchAttribute attr;
	attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
	attr.val.programmaticStreamSerializationAllowed = 1;
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = dim3(1);
	cfg.blockDim = dim3(32);
	cfg.stream = s;
	cfg.attrs = &attr;
	for (int k = 0; k < kernels; k++) {
		cfg.numAttrs = k > 0;
		CK(cudaLaunchKernelEx(&cfg, k_empty));
	}
}

/*
 * The launch floor of a call that launches `kernels` kernels (empty_call): the median microseconds
 * of one such call timed alone as median_ms times a call (the host's launches included), and per
 * call in a burst of `burst` calls (*per_call_in_burst). What a call's own work adds is its time
 * less this floor.
 */
static inline float launch_floor_us(int kernels, int burst, float *per_call_in_burst)
{
	if (per_call_in_burst)
		*per_call_in_burst = 1000.0f / burst * median_ms(0, 5, 50, [&](int) {
			for (int b = 0; b < burst; b++)
				empty_call(kernels, 0);
		});
	return 1000.0f * median_ms(0, 10, 50, [&](int) { empty_call(kernels, 0); });
}

/*
 * Microseconds per call of `copies` calls captured in one CUDA graph and replayed (median of 20
 * replays after 3): the device's time per call without a host launch each. f(s, i) enqueues call
 * i on stream s.
 */
template <class F>
static float graph_us(int copies, F f)
{
	cudaStream_t s;
	cudaGraph_t g;
	cudaGraphExec_t ge;
	CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
	for (int i = 0; i < copies; i++)
		f(s, i);
	CK(cudaStreamEndCapture(s, &g));
	CK(cudaGraphInstantiate(&ge, g, 0));
	const float ms = median_ms(s, 3, 20, [&](int) { CK(cudaGraphLaunch(ge, s)); });
	CK(cudaGraphExecDestroy(ge));
	CK(cudaGraphDestroy(g));
	CK(cudaStreamDestroy(s));
	return 1000.0f * ms / copies;
}

/* Device-to-device copy bandwidth of cudaMemcpyAsync over 1 GiB, bytes read plus written per second
 * (as bench/gpu_scan.cu counts it), median of 20 copies after 5 of warm-up. */
static inline double d2d_copy_bandwidth(void)
{
	const size_t bytes = (size_t)1 << 30;
	void *a, *b;
	CK(cudaMalloc(&a, bytes));
	CK(cudaMalloc(&b, bytes));
	CK(cudaMemset(a, 0x5a, bytes));
	const float ms = median_ms(0, 5, 20, [&](int) {
		CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
	});
	CK(cudaFree(a));
	CK(cudaFree(b));
	return 2.0 * bytes / (ms * 1e-3);
}

/* "1,8,32768" into numbers; exits on anything else, naming the flag. */
static inline std::vector<uint32_t> parse_u32_list(const char *flag, const char *s)
{
	std::vector<uint32_t> v;
	while (*s) {
		char *end;
		const unsigned long x = strtoul(s, &end, 0);
		if (end == s || x == 0 || x > 0xffffffffu || (*end && *end != ',')) {
			fprintf(stderr, "%s: bad list \"%s\"\n", flag, s);
			exit(2);
		}
		v.push_back((uint32_t)x);
		s = *end ? end + 1 : end;
	}
	return v;
}

#endif
