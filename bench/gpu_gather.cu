/* SPDX-License-Identifier: MIT */
/*
 * The zero-copy fetch path against its ceiling. A host tier of pinned, mapped host memory (2 GiB:
 * 4 sequences x 128K tokens x 8 KV heads, rows of 512 B = K + V of head dim 128 in fp16, blocks of
 * 256 rows per KV head placed in scattered order, the block tables built on the device) is read by
 * kvt_gpu_fetch + kvt_gpu_rows_copy into device memory, for selection patterns of about 2% of the
 * tokens: random positions, clustered runs of 8-32 tokens, and runs of 8-32 with holes (60% of
 * each run's tokens), each as selected and with gap bridging (gaps of <= 4 rows between selected
 * rows fetched too). Useful GB/s = bytes of the selected rows (before bridging) / time.
 * The ceiling: a plain kernel of this file that reads exactly the same row segments (maximal runs of
 * rows adjacent in host memory) into device memory and does nothing else, the better of one warp
 * per segment (4 rows in flight) and one warp per row; ratio = fetch path / ceiling (goal >= 0.9).
 * Also: the same fetch with a hot cache (cold: emptied before each run; warm: every row a hit), and
 * the contiguous cudaMemcpy H2D rate of the same memory as the link's peak. CUDA-event medians of
 * 20 runs after 3 of warm-up; every output checked against the host rows once.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

extern "C" {
#include "internal.h"
}
#include "gpu/fetch.cuh"

#include "gpu_bench.cuh"

enum { D = 128, HKV = 8, NS = 4, N = 131072, ROW = 4 * D, REPS = 20, WCAP = 64 };
static const uint32_t BLK = KVT_BLOCK_TOKENS, BLK_CAP = N / KVT_BLOCK_TOKENS,
		      N_BLOCKS = NS * HKV * (N / KVT_BLOCK_TOKENS);
static const size_t BLK_BYTES = (size_t)KVT_BLOCK_TOKENS * ROW;
/* Logical block (seq, head, block) -> physical block: an odd multiplier mod a power of two is a
 * bijection, and it puts neighbouring blocks far apart, as a long-running allocator would. */
static const uint32_t PERM_MUL = 5171, PERM_ADD = 1234;

static __host__ __device__ uint32_t phys_block(uint32_t logical)
{
	return (logical * PERM_MUL + PERM_ADD) % N_BLOCKS;
}

static __global__ void build_tables(void **tables, char *base)
{
	const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < N_BLOCKS)
		tables[i] = base + (size_t)phys_block(i) * BLK_BYTES;
}

/* A run of rows adjacent in host memory, and where it goes in the dense output. */
struct segment {
	const char *src;
	uint32_t dst_row, n;
};

/* One warp per segment (grid-stride), U rows of 512 B in flight per warp. */
template <int U>
static __global__ void __launch_bounds__(256)
	k_ceiling_seg(const segment *segs, uint32_t n_segs, char *dst)
{
	const uint32_t lane = threadIdx.x & 31;
	for (uint32_t w = (blockIdx.x * blockDim.x + threadIdx.x) / 32; w < n_segs;
	     w += gridDim.x * blockDim.x / 32) {
		const segment s = segs[w];
		for (uint32_t r = 0; r < s.n; r += U) {
			uint4 x[U];
#pragma unroll
			for (int u = 0; u < U; u++)
				if (r + u < s.n)
					x[u] = ((const uint4 *)(s.src + (size_t)(r + u) * ROW))[lane];
#pragma unroll
			for (int u = 0; u < U; u++)
				if (r + u < s.n)
					((uint4 *)(dst + (size_t)(s.dst_row + r + u) * ROW))[lane] = x[u];
		}
	}
}

/* One warp per row of the same segments (rows of a segment go to neighbouring warps). */
static __global__ void __launch_bounds__(256)
	k_ceiling_row(const char *const *src, const uint32_t *dst_row, uint32_t n_rows, char *dst)
{
	const uint32_t lane = threadIdx.x & 31;
	for (uint32_t w = (blockIdx.x * blockDim.x + threadIdx.x) / 32; w < n_rows;
	     w += gridDim.x * blockDim.x / 32)
		((uint4 *)(dst + (size_t)dst_row[w] * ROW))[lane] = ((const uint4 *)src[w])[lane];
}

struct pattern {
	const char *name;
	std::vector<uint32_t> sel[NS][HKV]; /* index positions, ascending */
	size_t selected = 0;                /* rows before bridging */
};

static void bridge(std::vector<uint32_t> &v, uint32_t max_gap)
{
	std::vector<uint32_t> o;
	for (size_t i = 0; i < v.size(); i++) {
		if (i && v[i] - v[i - 1] - 1 <= max_gap)
			for (uint32_t p = v[i - 1] + 1; p < v[i]; p++)
				o.push_back(p);
		o.push_back(v[i]);
	}
	v.swap(o);
}

/* kind 0: random 2%; 1: runs of 8-32; 2: runs of 8-32 with 60% of their tokens. */
static pattern make_pattern(int kind, const char *name, std::mt19937_64 &rng)
{
	pattern p;
	p.name = name;
	std::uniform_real_distribution<double> u(0.0, 1.0);
	std::uniform_int_distribution<uint32_t> len(8, 32);
	for (int s = 0; s < NS; s++)
		for (int h = 0; h < HKV; h++) {
			std::vector<uint32_t> &v = p.sel[s][h];
			if (kind == 0) {
				for (uint32_t i = 0; i < N; i++)
					if (u(rng) < 0.02)
						v.push_back(i);
			} else {
				/* mean run 20 tokens, covering 20 (or 12) per run: gaps for 2% */
				const double mean_gap = kind == 1 ? 980.0 : 580.0;
				std::geometric_distribution<uint32_t> gap(1.0 / mean_gap);
				for (uint32_t i = gap(rng); i < N;) {
					const uint32_t l = len(rng);
					for (uint32_t j = i; j < std::min<uint32_t>(i + l, N); j++)
						if (kind == 1 || u(rng) < 0.6)
							v.push_back(j);
					i += l + 1 + gap(rng);
				}
			}
			p.selected += v.size();
		}
	return p;
}

/* Everything one (pattern, bridging) needs on the device. */
struct plan {
	uint32_t max_rows = 0, n_segs = 0, n_rows = 0;
	uint32_t *sel = nullptr, *sel_n = nullptr;
	kvt_gpu_fetch_seq *seqs = nullptr;
	segment *segs = nullptr;
	const char **row_src = nullptr;
	uint32_t *row_dst = nullptr;
	std::vector<uint32_t> counts;
};

static plan make_plan(const pattern &pt, bool bridging, void **tables, char *host_base,
		      const void *ring)
{
	plan p;
	std::vector<uint32_t> sel[NS][HKV];
	for (int s = 0; s < NS; s++)
		for (int h = 0; h < HKV; h++) {
			sel[s][h] = pt.sel[s][h];
			if (bridging)
				bridge(sel[s][h], 4);
			p.max_rows = std::max<uint32_t>(p.max_rows, (uint32_t)sel[s][h].size());
		}
	const uint32_t ld = std::max(1u, p.max_rows);
	std::vector<uint32_t> hsel((size_t)NS * HKV * ld, 0), hn(NS * HKV);
	std::vector<segment> segs;
	std::vector<const char *> rsrc;
	std::vector<uint32_t> rdst;
	for (int s = 0; s < NS; s++)
		for (int h = 0; h < HKV; h++) {
			const uint32_t item = s * HKV + h;
			const std::vector<uint32_t> &v = sel[s][h];
			hn[item] = (uint32_t)v.size();
			for (size_t t = 0; t < v.size(); t++) {
				hsel[(size_t)item * ld + t] = v[t];
				const uint32_t logical = item * BLK_CAP + v[t] / BLK;
				const char *src = host_base + (size_t)phys_block(logical) * BLK_BYTES +
						  (size_t)(v[t] % BLK) * ROW;
				const uint32_t dst = item * ld + (uint32_t)t;
				rsrc.push_back(src);
				rdst.push_back(dst);
				if (!segs.empty() && segs.back().src + (size_t)segs.back().n * ROW == src &&
				    segs.back().dst_row + segs.back().n == dst)
					segs.back().n++;
				else
					segs.push_back({src, dst, 1});
			}
		}
	p.counts = hn;
	p.n_segs = (uint32_t)segs.size();
	p.n_rows = (uint32_t)rsrc.size();
	CK(cudaMalloc((void **)&p.sel, hsel.size() * 4));
	CK(cudaMalloc((void **)&p.sel_n, hn.size() * 4));
	CK(cudaMalloc((void **)&p.segs, std::max<size_t>(1, segs.size()) * sizeof(segment)));
	CK(cudaMalloc((void **)&p.row_src, std::max<size_t>(1, rsrc.size()) * sizeof(char *)));
	CK(cudaMalloc((void **)&p.row_dst, std::max<size_t>(1, rdst.size()) * 4));
	CK(cudaMemcpy(p.sel, hsel.data(), hsel.size() * 4, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(p.sel_n, hn.data(), hn.size() * 4, cudaMemcpyHostToDevice));
	CK(cudaMemcpy(p.segs, segs.data(), segs.size() * sizeof(segment), cudaMemcpyHostToDevice));
	CK(cudaMemcpy(p.row_src, rsrc.data(), rsrc.size() * sizeof(char *),
		      cudaMemcpyHostToDevice));
	CK(cudaMemcpy(p.row_dst, rdst.data(), rdst.size() * 4, cudaMemcpyHostToDevice));
	std::vector<kvt_gpu_fetch_seq> fs(NS);
	for (int s = 0; s < NS; s++) {
		kvt_gpu_fetch_seq &f = fs[s];
		memset(&f, 0, sizeof f);
		f.blocks = tables + (size_t)s * HKV * BLK_CAP;
		f.sel = p.sel + (size_t)s * HKV * ld;
		f.sel_n = p.sel_n + (size_t)s * HKV;
		f.ring = ring;
		f.uid = (unsigned long long)s + 1;
		f.sel_ld = ld;
		f.blk_cap = BLK_CAP;
		f.wcap = WCAP;
		f.n_sink = 0;
		f.n_indexed = N;
		f.n_tokens = N; /* no window rows: only the selection crosses PCIe */
	}
	CK(cudaMalloc((void **)&p.seqs, NS * sizeof(kvt_gpu_fetch_seq)));
	CK(cudaMemcpy(p.seqs, fs.data(), NS * sizeof(kvt_gpu_fetch_seq), cudaMemcpyHostToDevice));
	return p;
}

static void drop(plan &p)
{
	for (void *x : {(void *)p.sel, (void *)p.sel_n, (void *)p.seqs, (void *)p.segs,
			(void *)p.row_src, (void *)p.row_dst})
		CK(cudaFree(x));
}

/* Device buffers of the fetch path, sized for the largest plan. */
struct fetch_bufs {
	const void **rows;
	kvt_gpu_rows *items;
	char *k_out, *v_out, *ceil_out;
	unsigned long long *err;
	uint32_t cap; /* max_rows */
};

static void fetch_once(const plan &p, const kvt_gpu_hot &hot, uint32_t epoch, fetch_bufs &b,
		       cudaStream_t st)
{
	RC(kvt_gpu_fetch(ROW, NS, HKV, p.seqs, hot, epoch, b.rows, b.items, p.max_rows, NULL, b.err,
			 st));
	RC(kvt_gpu_rows_copy(D, NS * HKV, b.items, p.max_rows, NULL, b.k_out, b.v_out, NULL,
			     p.max_rows, st));
}

/* Median ms of `fn` enqueued alone between two events; `pre` runs before each, untimed. */
template <class F, class P>
static float time_it(cudaStream_t st, F fn, P pre)
{
	return median_ms(st, 3, REPS, fn, pre);
}

/* Rows of the fetch path's dense outputs (and the ceiling's) that differ from the host rows. */
static size_t check(const plan &p, const fetch_bufs &b, cudaStream_t st, bool ceiling)
{
	const size_t ld = std::max(1u, p.max_rows), items = NS * HKV;
	std::vector<char> k(items * ld * ROW / 2), v(k.size()), c(items * ld * ROW);
	std::vector<const char *> src(p.n_rows);
	std::vector<uint32_t> dst(p.n_rows);
	CK(cudaMemcpyAsync(src.data(), p.row_src, p.n_rows * sizeof(char *), cudaMemcpyDeviceToHost,
			   st));
	CK(cudaMemcpyAsync(dst.data(), p.row_dst, p.n_rows * 4, cudaMemcpyDeviceToHost, st));
	if (ceiling)
		CK(cudaMemcpyAsync(c.data(), b.ceil_out, c.size(), cudaMemcpyDeviceToHost, st));
	else {
		CK(cudaMemcpyAsync(k.data(), b.k_out, k.size(), cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(v.data(), b.v_out, v.size(), cudaMemcpyDeviceToHost, st));
	}
	CK(cudaStreamSynchronize(st));
	size_t bad = 0;
	for (uint32_t r = 0; r < p.n_rows; r++) {
		const char *s = src[r]; /* mapped memory: the host reads it directly */
		const size_t at = dst[r];
		if (ceiling)
			bad += memcmp(c.data() + at * ROW, s, ROW) != 0;
		else
			bad += memcmp(k.data() + at * ROW / 2, s, ROW / 2) != 0 ||
			       memcmp(v.data() + at * ROW / 2, s + ROW / 2, ROW / 2) != 0;
	}
	return bad;
}

int main(void)
{
	cudaDeviceProp prop;
	if (!bench_device("gpu_gather", &prop))
		return 0;
	const int sms = prop.multiProcessorCount;
	cudaStream_t st;
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

	const size_t host_bytes = (size_t)N_BLOCKS * BLK_BYTES;
	char *host;
	CK(cudaHostAlloc((void **)&host, host_bytes, cudaHostAllocMapped));
	{
		uint64_t *w = (uint64_t *)host;
		for (size_t i = 0; i < host_bytes / 8; i++)
			w[i] = i * 0x9e3779b97f4a7c15ull + 1;
	}
	char *host_dev;
	CK(cudaHostGetDevicePointer((void **)&host_dev, host, 0));
	printf("gpu_gather on %s (%d SMs): host tier %.1f GiB pinned + mapped (%u sequences x %u "
	       "tokens x %d KV heads, %d B rows, %u-row blocks in scattered order)\n",
	       prop.name, sms, host_bytes / 1073741824.0, NS, N, HKV, ROW, BLK);

	/* the link's peak: one contiguous copy of 1 GiB of the same memory */
	{
		const size_t bytes = (size_t)1 << 30;
		char *d;
		CK(cudaMalloc((void **)&d, bytes));
		const float ms = time_it(
			st,
			[&](int) {
				CK(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, st));
			},
			[](int) {});
		printf("contiguous cudaMemcpy H2D of 1 GiB of it: %.1f GB/s (the link's peak)\n",
		       bytes / (ms * 1e-3) / 1e9);
		CK(cudaFree(d));
	}

	void **tables;
	CK(cudaMalloc((void **)&tables, (size_t)N_BLOCKS * sizeof(void *)));
	build_tables<<<(N_BLOCKS + 255) / 256, 256, 0, st>>>(tables, host_dev);
	CK(cudaGetLastError());
	void *ring;
	CK(cudaMalloc(&ring, (size_t)HKV * WCAP * ROW));
	CK(cudaMemsetAsync(ring, 0, (size_t)HKV * WCAP * ROW, st));

	std::mt19937_64 rng(42);
	std::vector<pattern> pats;
	pats.push_back(make_pattern(0, "random", rng));
	pats.push_back(make_pattern(1, "clustered", rng));
	pats.push_back(make_pattern(2, "clustered, holes", rng));

	std::vector<plan> plans;
	uint32_t cap = 1;
	for (const pattern &pt : pats)
		for (bool br : {false, true}) {
			plans.push_back(make_plan(pt, br, tables, host_dev, ring));
			cap = std::max(cap, plans.back().max_rows);
		}
	fetch_bufs b;
	b.cap = cap;
	CK(cudaMalloc((void **)&b.rows, (size_t)NS * HKV * cap * sizeof(void *)));
	CK(cudaMalloc((void **)&b.items, (size_t)NS * HKV * sizeof(kvt_gpu_rows)));
	CK(cudaMalloc((void **)&b.k_out, (size_t)NS * HKV * cap * ROW / 2));
	CK(cudaMalloc((void **)&b.v_out, (size_t)NS * HKV * cap * ROW / 2));
	CK(cudaMalloc((void **)&b.ceil_out, (size_t)NS * HKV * cap * ROW));
	CK(cudaMalloc((void **)&b.err, 8));
	CK(cudaMemsetAsync(b.err, 0, 8, st));

	/* a hot cache that holds every pattern's rows: 4 ways x 64K sets x 512 B = 128 MiB */
	kvt_gpu_hot nohot, hot;
	memset(&nohot, 0, sizeof nohot);
	memset(&hot, 0, sizeof hot);
	unsigned long long *counters;
	CK(cudaMalloc((void **)&counters, KVT_GPU_CNT_N * 8));
	nohot.counters = counters;
	hot.counters = counters;
	hot.sets = 65536;
	const size_t slots = (size_t)hot.sets * KVT_GPU_HOT_WAYS;
	CK(cudaMalloc((void **)&hot.tag_hi, slots * 8));
	CK(cudaMalloc((void **)&hot.tag_lo, slots * 8));
	CK(cudaMalloc((void **)&hot.last_use, slots * 4));
	CK(cudaMalloc(&hot.rows, slots * ROW));
	auto empty_cache = [&]() {
		CK(cudaMemsetAsync(hot.tag_hi, 0, slots * 8, st));
		CK(cudaMemsetAsync(hot.tag_lo, 0, slots * 8, st));
		CK(cudaMemsetAsync(hot.last_use, 0, slots * 4, st));
	};

	const int ceil_blocks = sms * 8;
	printf("%-17s %-6s %7s %6s %6s | %9s %9s %6s %9s %9s | %9s %9s %6s | %s\n", "pattern",
	       "bridge", "sel", "rows", "segs", "fetch", "ceiling", "ratio", "Mseg/s", "ceil",
	       "cold$", "warm$", "hit%", "goal >= 0.9");
	uint32_t epoch = 1;
	for (size_t pi = 0; pi < plans.size(); pi++) {
		const pattern &pt = pats[pi / 2];
		const bool br = pi % 2;
		plan &p = plans[pi];
		const double useful = (double)pt.selected * ROW;

		/* the fetch path, no cache: every row read from the host tier */
		const float t_fetch = time_it(
			st, [&](int) { fetch_once(p, nohot, epoch++, b, st); }, [](int) {});
		const size_t bad_fetch = check(p, b, st, false);

		/* the ceiling: the better of the two plain readers */
		const float t_seg = time_it(
			st,
			[&](int) {
				k_ceiling_seg<4><<<ceil_blocks, 256, 0, st>>>(p.segs, p.n_segs,
									     b.ceil_out);
				CK(cudaGetLastError());
			},
			[](int) {});
		const size_t bad_seg = check(p, b, st, true);
		CK(cudaMemsetAsync(b.ceil_out, 0, (size_t)NS * HKV * cap * ROW, st));
		const float t_row = time_it(
			st,
			[&](int) {
				k_ceiling_row<<<ceil_blocks, 256, 0, st>>>(p.row_src, p.row_dst,
									   p.n_rows, b.ceil_out);
				CK(cudaGetLastError());
			},
			[](int) {});
		const size_t bad_row = check(p, b, st, true);
		const float t_ceil = std::min(t_seg, t_row);

		/* with a hot cache: cold (emptied before each run, every row filled) and warm */
		const float t_cold = time_it(
			st, [&](int) { fetch_once(p, hot, epoch++, b, st); },
			[&](int) { empty_cache(); });
		const size_t bad_cold = check(p, b, st, false);
		fetch_once(p, hot, epoch++, b, st);
		CK(cudaMemsetAsync(counters, 0, KVT_GPU_CNT_N * 8, st));
		const float t_warm = time_it(
			st, [&](int) { fetch_once(p, hot, epoch++, b, st); }, [](int) {});
		unsigned long long cnt[KVT_GPU_CNT_N], errw;
		CK(cudaMemcpyAsync(cnt, counters, sizeof cnt, cudaMemcpyDeviceToHost, st));
		CK(cudaMemcpyAsync(&errw, b.err, 8, cudaMemcpyDeviceToHost, st));
		CK(cudaStreamSynchronize(st));
		const size_t bad_warm = check(p, b, st, false);
		const double hit = cnt[KVT_GPU_CNT_HITS] + cnt[KVT_GPU_CNT_MISSES]
					   ? 100.0 * cnt[KVT_GPU_CNT_HITS] /
						     (cnt[KVT_GPU_CNT_HITS] + cnt[KVT_GPU_CNT_MISSES])
					   : 0.0;

		const double gf = useful / (t_fetch * 1e-3) / 1e9, gc = useful / (t_ceil * 1e-3) / 1e9;
		printf("%-17s %-6s %7zu %6u %6u | %6.2f GB/s %6.2f GB/s %5.2f %6.1f %9.1f | %6.2f GB/s "
		       "%6.2f GB/s %5.1f | %s\n",
		       pt.name, br ? "<=4" : "off", pt.selected, p.n_rows, p.n_segs, gf, gc,
		       t_ceil / t_fetch, p.n_segs / (t_fetch * 1e-3) / 1e6,
		       p.n_segs / (t_ceil * 1e-3) / 1e6, useful / (t_cold * 1e-3) / 1e9,
		       useful / (t_warm * 1e-3) / 1e9, hit, t_ceil / t_fetch >= 0.9 ? "met" : "MISSED");
		printf("  times: fetch %.1f us (rows read %.2f GB/s), ceiling %.1f us (warp per segment "
		       "%.1f us, warp per row %.1f us), cached cold %.1f us, warm %.1f us; rows "
		       "checked against the host tier: %zu fetch, %zu / %zu ceiling, %zu cold, %zu "
		       "warm wrong; error word %#llx\n",
		       t_fetch * 1e3, (double)p.n_rows * ROW / (t_fetch * 1e-3) / 1e9, t_ceil * 1e3,
		       t_seg * 1e3, t_row * 1e3, t_cold * 1e3, t_warm * 1e3, bad_fetch, bad_seg,
		       bad_row, bad_cold, bad_warm, errw);
		fflush(stdout);
	}
	for (plan &p : plans)
		drop(p);
	return 0;
}
