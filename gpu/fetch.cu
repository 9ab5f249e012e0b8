/* SPDX-License-Identifier: MIT */
/*
 * Row movement on the GPU (gpu/fetch.cuh): host-tier and window-ring writes, first-chunk centroids,
 * the hot-token cache and the zero-copy gather. Rows move 16 bytes per lane; one warp per row, so a
 * 512-byte fp16 row of D 128 is one fully used request per warp and many rows are in flight at once.
 */
#include <string.h>

#include "common.cuh"
#include "fetch.cuh"
#include "graph.cuh"
#include "fetch_rows.cuh"

#define FT_THREADS 256u

/* Warp-aggregated add to a 64-bit counter. */
static __device__ __forceinline__ void count(unsigned long long *ctr, unsigned long long v)
{
	for (int o = 16; o; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	if ((threadIdx.x & 31) == 0 && v)
		atomicAdd(ctr, v);
}

/* ---- lookup: positions, hits, window rows ------------------------------------------------- */

/* One miss of a spilled block onto the host's list (few per step: one atomic each). */
static __device__ __forceinline__ void spill_push(const kvt_gpu_spill_list &sp, uint32_t item,
						  uint32_t k, uint32_t at)
{
	const uint32_t i = atomicAdd(sp.count, 1u);
	if (i < sp.cap)
		sp.miss[i] = kvt_gpu_spill_miss{item, k, (int32_t)at, 0};
}

static __global__ void __launch_bounds__(FT_THREADS)
	k_spill_scatter(const kvt_gpu_spill_miss *miss, const uint64_t *addr, uint32_t n,
			const void **rows, uint32_t max_rows)
{
	for (uint32_t i = blockIdx.x * FT_THREADS + threadIdx.x; i < n; i += gridDim.x * FT_THREADS) {
		const uint64_t a = addr[i];
		if (a)
			rows[(size_t)miss[i].item * max_rows + miss[i].k] = (const void *)a;
	}
}

static __global__ void __launch_bounds__(FT_THREADS)
	k_lookup(uint32_t row_bytes, uint32_t hkv, const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot,
		 uint32_t epoch, const void **rows, kvt_gpu_rows *items, uint32_t max_rows,
		 int32_t *pos_out, kvt_gpu_spill_list sp, unsigned long long *err)
{
	const uint32_t item = blockIdx.y, s = item / hkv, h = item % hkv;
	const kvt_gpu_fetch_seq q = seqs[s];
	if (q.flags & KVT_GPU_FETCH_SKIP) { /* a padded slot of a graph step: no rows, no output */
		if (blockIdx.x == 0 && threadIdx.x == 0)
			items[item] = kvt_gpu_rows{.rows = rows + (size_t)item * max_rows, .n = 0,
						   .reserved = KVT_GPU_ROWS_SKIP};
		return;
	}
	if (hot.epoch)
		epoch = *hot.epoch;
	const uint32_t m = q.sel_n[h], S = q.n_sink, win = q.n_tokens - S - q.n_indexed;
	uint32_t n = S + m + win;
	if (n > max_rows) {
		if (blockIdx.x == 0 && threadIdx.x == 0)
			kvt_d_range(err, KVT_GPU_SITE_LOOKUP_ROWS, item, n);
		n = 0;
	}
	if (blockIdx.x == 0 && threadIdx.x == 0) {
		items[item] = kvt_gpu_rows{.rows = rows + (size_t)item * max_rows, .n = n};
		if (hot.counters && !(hot.flags & KVT_GPU_HOT_NO_STEP)) {
			atomicAdd(&hot.counters[KVT_GPU_CNT_SELECTED], (unsigned long long)m);
			atomicAdd(&hot.counters[KVT_GPU_CNT_ROWS], (unsigned long long)n);
		}
	}
	/* rows blockIdx.x * FT_THREADS + tid, then a grid's width further: the bound is uniform
	 * over the block, so the warp-wide count below sees every lane */
	for (uint32_t base = blockIdx.x * FT_THREADS; base < n; base += gridDim.x * FT_THREADS) {
		const uint32_t k = base + threadIdx.x;
		bool hit = false;
		if (k < n) {
			const void *p;
			uint32_t at;
			if (k < S + m) {
				at = k < S ? k : S + q.sel[(size_t)h * q.sel_ld + k - S];
				p = NULL; /* a miss until found: the fill kernel reads the host row */
				const long long slot = hot_slot(hot, q.uid, h, at);
				if (slot >= 0) {
					hot.last_use[slot] = epoch;
					p = (const char *)hot.rows + (size_t)slot * row_bytes;
					hit = true;
				}
				if (!p && !host_row(q.blocks, q.blk_cap, h, at, row_bytes)) {
					if (!(q.flags & KVT_GPU_FETCH_SPILLED))
						kvt_d_range(err, KVT_GPU_SITE_LOOKUP_BLOCK, item, at);
					else if (sp.count) /* the host reads it from NVMe */
						spill_push(sp, item, k, at);
				}
			} else {
				const uint32_t i = q.n_indexed + (k - S - m); /* index position */
				at = S + i;
				p = (const char *)q.ring + ((size_t)h * q.wcap + i % q.wcap) * row_bytes;
			}
			rows[(size_t)item * max_rows + k] = p;
			if (pos_out)
				pos_out[(size_t)item * max_rows + k] = (int32_t)at;
		}
		if (hot.counters)
			count(&hot.counters[KVT_GPU_CNT_HITS], hit);
	}
}

/* ---- fill: misses claim a way, or are read in place --------------------------------------- */

/* Serves row k of the item, a miss (cur: its slot as the lookup left it), with the whole warp: the
 * row from the host tier or its staged copy into a claimed way of the hot cache, or its address
 * for the attention to read in place. Returns whether it counts as a miss (lane 0's value). */
static __device__ __forceinline__ bool fill_row(uint32_t row_bytes, const kvt_gpu_fetch_seq &q,
						const kvt_gpu_hot &hot, uint32_t epoch,
						uint32_t item, uint32_t h, uint32_t k,
						const void **slotp, uintptr_t cur, uint32_t lane,
						unsigned long long *err)
{
	const uint32_t S = q.n_sink;
	const uint32_t at = k < S ? k : S + q.sel[(size_t)h * q.sel_ld + k - S];
	/* a row of a spilled block, staged by the host, or a row of the host tier */
	const char *src = cur ? (const char *)(cur & ~(uintptr_t)KVT_GPU_ROW_STAGED)
			      : host_row(q.blocks, q.blk_cap, h, at, row_bytes);
	if (!src) {
		/* a missing block, reported by the lookup, or a spilled row not staged */
		if (lane == 0) {
			if (q.flags & KVT_GPU_FETCH_SPILLED)
				kvt_d_range(err, KVT_GPU_SITE_FILL_BLOCK, item, at);
			*slotp = q.ring;
		}
		return false;
	}
	if (!hot.sets) {
		/* no cache: the attention reads the row in place */
		if (lane == 0)
			*slotp = src;
		return true;
	}
	/* the PCIe read first, so the claim below overlaps its latency */
	uint4 x[KVT_MAX_HEAD_DIM * 4 / 512];
#pragma unroll
	for (uint32_t i = 0; i < KVT_MAX_HEAD_DIM * 4 / 512; i++)
		if ((i * 32 + lane) * 16 < row_bytes)
			x[i] = *(const uint4 *)(src + (i * 32 + lane) * 16);
	long long claimed = -1;
	if (lane == 0) {
		const uint32_t set = kvt_hot_set(q.uid, h, at, hot.sets);
		for (uint32_t tries = 0; tries < KVT_GPU_HOT_WAYS && claimed < 0; tries++) {
			/* the set's eight epochs in two 16-byte loads from L2 (where the claims'
			 * atomics are), not eight loads one after another */
			static_assert(KVT_GPU_HOT_WAYS == 8, "a set's epochs are two uint4");
			const uint4 *lu =
				(const uint4 *)(hot.last_use + (size_t)set * KVT_GPU_HOT_WAYS);
			const uint4 e0 = __ldcg(lu), e1 = __ldcg(lu + 1);
			const uint32_t eu[KVT_GPU_HOT_WAYS] = {e0.x, e0.y, e0.z, e0.w,
							       e1.x, e1.y, e1.z, e1.w};
			uint32_t best = KVT_GPU_HOT_WAYS, old = 0;
#pragma unroll
			for (uint32_t w = 0; w < KVT_GPU_HOT_WAYS; w++) {
				const uint32_t u = eu[w];
				if (u != epoch && (best == KVT_GPU_HOT_WAYS || u < old)) {
					best = w;
					old = u;
				}
			}
			if (best == KVT_GPU_HOT_WAYS)
				break; /* every way is in use this step */
			const size_t slot = (size_t)set * KVT_GPU_HOT_WAYS + best;
			if (atomicCAS(&hot.last_use[slot], old, epoch) == old)
				claimed = (long long)slot;
		}
	}
	claimed = __shfl_sync(0xffffffffu, claimed, 0);
	if (claimed >= 0) {
		char *dst = (char *)hot.rows + (size_t)claimed * row_bytes;
#pragma unroll
		for (uint32_t i = 0; i < KVT_MAX_HEAD_DIM * 4 / 512; i++)
			if ((i * 32 + lane) * 16 < row_bytes)
				*(uint4 *)(dst + (i * 32 + lane) * 16) = x[i];
		if (lane == 0) {
			hot.tag_hi[claimed] = q.uid;
			hot.tag_lo[claimed] = (unsigned long long)h << 32 | at;
			*slotp = dst;
		}
	} else if (lane == 0) {
		*slotp = src; /* read in place by the attention */
	}
	return true;
}

static __global__ void __launch_bounds__(FT_THREADS)
	k_fill(uint32_t row_bytes, uint32_t hkv, const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot,
	       uint32_t epoch, const void **rows, const kvt_gpu_rows *items, uint32_t max_rows,
	       unsigned long long *err)
{
	const uint32_t item = blockIdx.y, s = item / hkv, h = item % hkv, lane = threadIdx.x & 31;
	const kvt_gpu_fetch_seq q = seqs[s];
	if (hot.epoch)
		epoch = *hot.epoch;
	const uint32_t n = min(items[item].n, q.n_sink + q.sel_n[h]);
	const void **slots = rows + (size_t)item * max_rows;
	uint32_t misses = 0; /* the warp's count, the same in every lane (lane 0 adds it) */
	/* a warp's rows are (warp id) + k * (warps of the item's blocks), as one row a warp would
	 * take them (misses of nearby positions, often together, go to different warps); it tests
	 * 32 of them at once, a lane a row (a hit needs nothing more), then serves their misses one
	 * after another, the whole warp a row (fill_row) */
	const uint32_t W = gridDim.x * (FT_THREADS / 32);
	for (uint64_t k0 = blockIdx.x * (FT_THREADS / 32) + threadIdx.x / 32; k0 < n;
	     k0 += 32ull * W) {
		const uint64_t k = k0 + (uint64_t)lane * W;
		const uintptr_t mine = k < n ? (uintptr_t)slots[k] : 0;
		/* the rows of the span still to serve, a bit a lane */
		uint32_t pending = __ballot_sync(
			0xffffffffu, k < n && (!mine || (mine & KVT_GPU_ROW_STAGED)));
		while (pending) {
			const uint32_t b = (uint32_t)__ffs(pending) - 1u;
			const uint32_t kb = (uint32_t)(k0 + b * W);
			pending &= pending - 1u;
			const uintptr_t cur = (uintptr_t)__shfl_sync(
				0xffffffffu, (unsigned long long)mine, (int)b);
			misses += fill_row(row_bytes, q, hot, epoch, item, h, kb, &slots[kb], cur,
					   lane, err);
		}
	}
	/* one pair of global atomics per block: the counters are one address for the whole grid */
	__shared__ uint32_t block_misses;
	if (threadIdx.x == 0)
		block_misses = 0;
	__syncthreads();
	if (lane == 0 && misses)
		atomicAdd(&block_misses, misses);
	__syncthreads();
	if (threadIdx.x == 0 && block_misses && hot.counters) {
		atomicAdd(&hot.counters[KVT_GPU_CNT_MISSES], (unsigned long long)block_misses);
		atomicAdd(&hot.counters[KVT_GPU_CNT_PCIE],
			  (unsigned long long)block_misses * row_bytes);
	}
}

/* Blocks per item along x: enough for the rows, at most what keeps the grid near `total`. */
static uint32_t grid_x(uint32_t units, uint32_t per_block, uint32_t items, uint32_t total)
{
	const uint32_t need = units ? (units + per_block - 1) / per_block : 1;
	uint32_t cap = items ? total / items : 1;
	cap = cap < 4 ? 4 : cap;
	return need < cap ? need : cap;
}

static int fetch_args(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
		      const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, const void **rows,
		      const kvt_gpu_rows *items)
{
	if (!seqs || !rows || !items || n_kv_heads == 0 || row_bytes == 0 || row_bytes % 16)
		return -EINVAL;
	if (hot.sets && (!hot.tag_hi || !hot.tag_lo || !hot.last_use || !hot.rows))
		return -EINVAL;
	if ((uint64_t)n_seqs * n_kv_heads > 65535)
		return -EINVAL;
	return 0;
}

extern "C" int kvt_gpu_fetch_lookup_spilled(uint32_t row_bytes, uint32_t n_seqs,
					    uint32_t n_kv_heads, const kvt_gpu_fetch_seq *seqs,
					    kvt_gpu_hot hot, uint32_t epoch, const void **rows,
					    kvt_gpu_rows *items, uint32_t max_rows, int32_t *pos,
					    kvt_gpu_spill_list list, unsigned long long *err,
					    void *stream)
{
	int rc = fetch_args(row_bytes, n_seqs, n_kv_heads, seqs, hot, rows, items);
	if (rc < 0 || n_seqs == 0)
		return rc;
	if (list.count && !list.miss && list.cap)
		return -EINVAL;
	const uint32_t n_items = n_seqs * n_kv_heads;
	/* a thread a row, each a chain of two dependent loads (its position, then its set's tags):
	 * near 4096 blocks, so that a thread takes one or two rows at batch 16 x 128K (1024 blocks
	 * took 2.6 % more of the layer there) */
	const dim3 g1(grid_x(max_rows, FT_THREADS, n_items, 4096), n_items);
	k_lookup<<<g1, FT_THREADS, 0, KVT_STREAM(stream)>>>(row_bytes, n_kv_heads, seqs, hot, epoch,
							    rows, items, max_rows, pos, list, err);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_fetch_lookup(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
				    const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
				    const void **rows, kvt_gpu_rows *items, uint32_t max_rows,
				    int32_t *pos, unsigned long long *err, void *stream)
{
	return kvt_gpu_fetch_lookup_spilled(row_bytes, n_seqs, n_kv_heads, seqs, hot, epoch, rows,
					    items, max_rows, pos, kvt_gpu_spill_list{}, err,
					    stream);
}

extern "C" int kvt_gpu_spill_scatter(const kvt_gpu_spill_miss *miss, const uint64_t *addr,
				     uint32_t n, const void **rows, uint32_t max_rows,
				     void *stream)
{
	if (!rows || (n && (!miss || !addr)))
		return -EINVAL;
	if (n == 0)
		return 0;
	const uint32_t blocks = (n + FT_THREADS - 1) / FT_THREADS;
	k_spill_scatter<<<blocks < 64 ? blocks : 64, FT_THREADS, 0, KVT_STREAM(stream)>>>(
		miss, addr, n, rows, max_rows);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_fetch_fill(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
				  const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
				  const void **rows, const kvt_gpu_rows *items, uint32_t max_rows,
				  unsigned long long *err, void *stream)
{
	int rc = fetch_args(row_bytes, n_seqs, n_kv_heads, seqs, hot, rows, items);
	if (rc < 0 || n_seqs == 0)
		return rc;
	const uint32_t n_items = n_seqs * n_kv_heads;
	/* a warp a row as to misses, 32 rows a test: near 16384 blocks where the gather's grids
	 * widen, 4096 below */
	const dim3 g2(grid_x(max_rows, FT_THREADS / 32, n_items,
			     kvt_wide_grid(n_items, max_rows) ? 16384 : 4096),
		      n_items);
	k_fill<<<g2, FT_THREADS, 0, KVT_STREAM(stream)>>>(row_bytes, n_kv_heads, seqs, hot, epoch,
							  rows, items, max_rows, err);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_fetch(uint32_t row_bytes, uint32_t n_seqs, uint32_t n_kv_heads,
			     const kvt_gpu_fetch_seq *seqs, kvt_gpu_hot hot, uint32_t epoch,
			     const void **rows, kvt_gpu_rows *items, uint32_t max_rows, int32_t *pos,
			     unsigned long long *err, void *stream)
{
	int rc = kvt_gpu_fetch_lookup(row_bytes, n_seqs, n_kv_heads, seqs, hot, epoch, rows, items,
				      max_rows, pos, err, stream);
	if (rc < 0)
		return rc;
	return kvt_gpu_fetch_fill(row_bytes, n_seqs, n_kv_heads, seqs, hot, epoch, rows, items,
				  max_rows, err, stream);
}

/* ---- dense copy of gathered rows ------------------------------------------------------------ */

static __global__ void __launch_bounds__(FT_THREADS)
	k_rows_copy(uint32_t d, const kvt_gpu_rows *items, uint32_t max_rows, const int32_t *pos,
		    char *k_out, char *v_out, int32_t *pos_out, uint32_t ld)
{
	const uint32_t item = blockIdx.y, lane = threadIdx.x & 31;
	const kvt_gpu_rows it = items[item];
	const uint32_t n = min(min(it.n, max_rows), ld), half = 2 * d;
	for (uint32_t t = blockIdx.x * (FT_THREADS / 32) + threadIdx.x / 32; t < n;
	     t += gridDim.x * (FT_THREADS / 32)) {
		const char *src = (const char *)it.rows[t];
		const size_t at = ((size_t)item * ld + t) * half;
		/* all of the row in one pass: K lanes and V lanes load together */
		for (uint32_t o = lane * 16; k_out && o < 2 * half; o += 32 * 16) {
			const uint4 x = *(const uint4 *)(src + o);
			*(uint4 *)(o < half ? k_out + at + o : v_out + at + (o - half)) = x;
		}
		if (lane == 0 && pos_out && pos)
			pos_out[(size_t)item * ld + t] = pos[(size_t)item * max_rows + t];
	}
}

extern "C" int kvt_gpu_rows_copy(uint32_t d, uint32_t n_items, const kvt_gpu_rows *items,
				 uint32_t max_rows, const int32_t *pos, void *k_out, void *v_out,
				 int32_t *pos_out, uint32_t ld, void *stream)
{
	if (!items || !k_out != !v_out || (!k_out && !pos_out) || !kvt_is_pow2_dim(d) ||
	    n_items > 65535)
		return -EINVAL;
	if (n_items == 0 || max_rows == 0)
		return 0;
	const dim3 g(grid_x(max_rows < ld ? max_rows : ld, FT_THREADS / 32, n_items, 4096), n_items);
	k_rows_copy<<<g, FT_THREADS, 0, KVT_STREAM(stream)>>>(d, items, max_rows, pos, (char *)k_out,
							       (char *)v_out, pos_out, ld);
	KVT_CU_LAUNCHED();
	return 0;
}

/* ---- new rows: host tier and window ring --------------------------------------------------- */

#define ST_JOBS 24u

struct store_batch {
	uint32_t n;
	kvt_gpu_store_job job[ST_JOBS];
};

static __global__ void __launch_bounds__(FT_THREADS)
	k_store(uint32_t d, uint32_t hkv, const store_batch b, unsigned long long *err)
{
	const kvt_gpu_store_job &j = b.job[blockIdx.z];
	const uint32_t lane = threadIdx.x & 31, h = blockIdx.y;
	const uint32_t t = blockIdx.x * (FT_THREADS / 32) + threadIdx.x / 32;
	if (t >= j.n)
		return;
	const uint32_t pos = j.first + t, half = 2 * d, row_bytes = 2 * half;
	const char *k = (const char *)j.k + ((size_t)t * j.stride + (size_t)h * d) * 2;
	const char *v = (const char *)j.v + ((size_t)t * j.stride + (size_t)h * d) * 2;
	char *dst = host_row(j.blocks, j.blk_cap, h, pos, row_bytes);
	char *ring = j.ring && pos >= j.ring_from
			     ? (char *)j.ring +
				       ((size_t)h * j.wcap + (pos - j.n_sink) % j.wcap) * row_bytes
			     : NULL;
	if (!dst) {
		if (lane == 0)
			kvt_d_range(err, KVT_GPU_SITE_STORE_BLOCK, blockIdx.z, pos);
		return;
	}
	for (uint32_t o = lane * 16; o < row_bytes; o += 32 * 16) {
		const uint4 x = *(const uint4 *)(o < half ? k + o : v + (o - half));
		*(uint4 *)(dst + o) = x;
		if (ring)
			*(uint4 *)(ring + o) = x;
	}
}

extern "C" int kvt_gpu_store_rows(uint32_t d, uint32_t n_kv_heads, uint32_t n_jobs,
				  const kvt_gpu_store_job *jobs, uint32_t max_n,
				  unsigned long long *err, void *stream)
{
	if (!jobs || !kvt_is_pow2_dim(d) || n_kv_heads == 0 || n_kv_heads > 65535)
		return -EINVAL;
	for (uint32_t i = 0; i < n_jobs; i++)
		if (!jobs[i].k || !jobs[i].v || !jobs[i].blocks || jobs[i].n > max_n ||
		    (jobs[i].ring && jobs[i].wcap == 0))
			return -EINVAL;
	if (max_n == 0)
		return 0;
	for (uint32_t i0 = 0; i0 < n_jobs; i0 += ST_JOBS) {
		store_batch b;
		b.n = n_jobs - i0 < ST_JOBS ? n_jobs - i0 : ST_JOBS;
		for (uint32_t i = 0; i < b.n; i++)
			b.job[i] = jobs[i0 + i];
		const dim3 g((max_n + FT_THREADS / 32 - 1) / (FT_THREADS / 32), n_kv_heads, b.n);
		k_store<<<g, FT_THREADS, 0, KVT_STREAM(stream)>>>(d, n_kv_heads, b, err);
		KVT_CU_LAUNCHED();
	}
	return 0;
}

/* ---- centroids ----------------------------------------------------------------------------- */

template <int DT>
static __global__ void k_centroids(uint32_t d, uint32_t hkv, uint32_t G, const void *keys,
				   uint64_t ts, uint64_t hs, const void *q, uint32_t n, float *c_k,
				   float *c_q)
{
	const uint32_t x = blockIdx.x * blockDim.x + threadIdx.x;
	if (x >= hkv * d)
		return;
	const uint32_t h = x / d, j = x % d;
	/* non-finite elements are left out (the CUDA backend does not inspect keys on the host):
	 * one bad key must not make the centroid, and every score of its sequence, non-finite */
	double acc = 0.0;
	uint32_t cnt = 0;
	for (uint32_t t = 0; t < n; t++) {
		const double v = (double)kvt_d_load<DT>(keys, t * ts + h * hs + j);
		if (isfinite(v)) {
			acc = __dadd_rn(acc, v);
			cnt++;
		}
	}
	c_k[x] = cnt ? (float)__ddiv_rn(acc, (double)cnt) : 0.0f;
	acc = 0.0;
	cnt = 0;
	if (q) {
		const size_t hq = (size_t)hkv * G;
		for (uint32_t t = 0; t < n; t++)
			for (uint32_t g = 0; g < G; g++) {
				const double v = (double)kvt_d_load<DT>(
					q, ((size_t)t * hq + h * G + g) * d + j);
				if (isfinite(v)) {
					acc = __dadd_rn(acc, v);
					cnt++;
				}
			}
		c_q[x] = cnt ? (float)__ddiv_rn(acc, (double)cnt) : 0.0f;
	} else {
		c_q[x] = 0.0f;
	}
}

extern "C" int kvt_gpu_centroids(uint32_t d, uint32_t dtype, uint32_t n_kv_heads, uint32_t group,
				 const void *keys, uint64_t tok_stride, uint64_t head_stride,
				 const void *q, uint32_t n, float *c_k, float *c_q, void *stream)
{
	if (!keys || !c_k || !c_q || n == 0 || !kvt_is_pow2_dim(d) || n_kv_heads == 0 || group == 0)
		return -EINVAL;
	if (dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16)
		return -EINVAL; /* before the dispatch, whose default is -EOPNOTSUPP */
	const uint32_t threads = 128, blocks = (n_kv_heads * d + threads - 1) / threads;
	cudaStream_t s = KVT_STREAM(stream);
	KVT_DISPATCH_DTYPE(dtype, DT, {
		k_centroids<DT><<<blocks, threads, 0, s>>>(d, n_kv_heads, group, keys, tok_stride,
							   head_stride, q, n, c_k, c_q);
	});
	KVT_CU_LAUNCHED();
	return 0;
}

/* ---- uploads through kernel parameters ------------------------------------------------------ */

struct upload_blob {
	uint32_t n;
	uint32_t bytes[KVT_GPU_UPLOAD_CHUNK / 4];
};

static __global__ void k_upload(uint32_t *dst, const upload_blob b, uint32_t *bump)
{
	if (bump && threadIdx.x == 0)
		++*bump;
	for (uint32_t i = threadIdx.x; i < b.n; i += blockDim.x)
		dst[i] = b.bytes[i];
}

static __global__ void k_upload_bytes(unsigned char *dst, const upload_blob b, uint32_t *bump)
{
	if (bump && threadIdx.x == 0)
		++*bump;
	const unsigned char *src = (const unsigned char *)b.bytes;
	for (uint32_t i = threadIdx.x; i < b.n; i += blockDim.x)
		dst[i] = src[i];
}

extern "C" int kvt_gpu_upload_bump(void *dst, const void *src, size_t bytes, uint32_t *bump,
				   void *stream)
{
	if (!dst || (!src && bytes))
		return -EINVAL;
	cudaStream_t s = KVT_STREAM(stream);
	const bool words = ((uintptr_t)dst & 3) == 0 && bytes % 4 == 0;
	for (size_t o = 0; o < bytes; o += KVT_GPU_UPLOAD_CHUNK) {
		upload_blob b;
		const size_t nb = bytes - o < KVT_GPU_UPLOAD_CHUNK ? bytes - o : KVT_GPU_UPLOAD_CHUNK;
		memcpy(b.bytes, (const char *)src + o, nb);
		uint32_t *bp = o == 0 ? bump : NULL;
		if (words) {
			b.n = (uint32_t)(nb / 4);
			k_upload<<<1, 256, 0, s>>>((uint32_t *)((char *)dst + o), b, bp);
		} else {
			b.n = (uint32_t)nb;
			k_upload_bytes<<<1, 256, 0, s>>>((unsigned char *)dst + o, b, bp);
		}
		KVT_CU_LAUNCHED();
	}
	return 0;
}

extern "C" int kvt_gpu_upload(void *dst, const void *src, size_t bytes, void *stream)
{
	return kvt_gpu_upload_bump(dst, src, bytes, NULL, stream);
}

/* Every row of the cache `from` into `to` (empty, more sets), one warp a way: the same tags, row
 * and epoch, in the row's set of `to`, the first empty way; a row whose set of `to` is full (eight
 * rows of `from` hashed to it) is dropped, read from the host tier again when next selected. */
static __global__ void k_hot_move(kvt_gpu_hot from, kvt_gpu_hot to, uint32_t row_bytes)
{
	const uint64_t slots = (uint64_t)from.sets * KVT_GPU_HOT_WAYS;
	const uint32_t lane = threadIdx.x & 31;
	const uint64_t warps = (uint64_t)gridDim.x * (blockDim.x / 32);
	for (uint64_t w = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) / 32; w < slots;
	     w += warps) {
		const unsigned long long hi = from.tag_hi[w];
		if (!hi)
			continue; /* an empty way: the same for the whole warp */
		const unsigned long long lo = from.tag_lo[w];
		long long claimed = -1;
		if (lane == 0) {
			const size_t s0 = (size_t)kvt_hot_set(hi, (uint32_t)(lo >> 32), (uint32_t)lo,
							      to.sets) * KVT_GPU_HOT_WAYS;
			for (uint32_t i = 0; i < KVT_GPU_HOT_WAYS && claimed < 0; i++)
				if (atomicCAS(&to.tag_hi[s0 + i], 0ull, hi) == 0ull)
					claimed = (long long)(s0 + i);
		}
		claimed = __shfl_sync(0xffffffffu, claimed, 0);
		if (claimed < 0)
			continue;
		const uint4 *src = (const uint4 *)((const char *)from.rows + w * row_bytes);
		uint4 *dst = (uint4 *)((char *)to.rows + (size_t)claimed * row_bytes);
		for (uint32_t i = lane; i < row_bytes / 16; i += 32)
			dst[i] = src[i];
		if (lane == 0) {
			to.tag_lo[claimed] = lo;
			to.last_use[claimed] = from.last_use[w];
		}
	}
}

extern "C" int kvt_gpu_hot_move(kvt_gpu_hot from, kvt_gpu_hot to, uint32_t row_bytes,
				void *stream)
{
	if (!to.sets || to.sets < from.sets || row_bytes % 16 || !to.tag_hi || !to.tag_lo ||
	    !to.last_use || !to.rows)
		return -EINVAL;
	if (!from.sets)
		return 0;
	if (!from.tag_hi || !from.tag_lo || !from.last_use || !from.rows)
		return -EINVAL;
	const uint64_t warps = (uint64_t)from.sets * KVT_GPU_HOT_WAYS;
	const uint32_t blocks = (uint32_t)((warps + 7) / 8 < 8192 ? (warps + 7) / 8 : 8192);
	k_hot_move<<<blocks, 256, 0, KVT_STREAM(stream)>>>(from, to, row_bytes);
	KVT_CU_LAUNCHED();
	return 0;
}

static __global__ void k_store_words(const unsigned long long *src, unsigned long long *dst,
				     uint32_t n)
{
	/* the kernels before this one have ended, so their writes (atomics) to src are visible */
	volatile unsigned long long *d = dst;
	const volatile unsigned long long *s = src;
	for (uint32_t i = 0; i < n; i++)
		d[i] = s[i];
	__threadfence_system();
}

extern "C" int kvt_gpu_store_words(const unsigned long long *src, unsigned long long *dst,
				   uint32_t n, void *stream)
{
	if (!src || !dst || !n)
		return -EINVAL;
	k_store_words<<<1, 1, 0, KVT_STREAM(stream)>>>(src, dst, n);
	KVT_CU_LAUNCHED();
	return 0;
}
