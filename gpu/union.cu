/* SPDX-License-Identifier: MIT */
/*
 * The union over a KV head's query group of the tokens kvt_gpu_topp_threshold marked, as bits
 * (k_union_mark: a warp reads 1024 scores of every query head of the group and writes 32 words of
 * bits and, per block, the count of its 8192 tokens), and their compaction into ascending positions
 * (k_union_write: each block adds up the counts of the chunks before it, then each warp prefix-sums
 * its words' population counts and writes its words' positions one word at a time, a lane per
 * bit, so that the stores coalesce). The bits are what a layer keeps between steps (select.cuh); the
 * list is per-step scratch. A decode step marks the bits in the threshold's candidate pass instead
 * (kvt_gpu_topp_select, select_resolve.cu) and takes only their counts from here (k_union_count);
 * k_union_mark serves kvt_gpu_topp_union and is what the tests compare that path with.
 */
#include "common.cuh"
#include "score.cuh"
#include "select.cuh"

#define UN_THREADS 256
#define UN_WARP_TOKENS 1024u /* 32 words of 32 tokens */
#define UN_CHUNK KVT_GPU_SEL_CHUNK /* tokens per block */
#ifndef UN_HEADS /* compile-time, for an A/B */
#define UN_HEADS 1u /* query heads whose scores k_union_mark loads at once */
#endif
static_assert(UN_THREADS / 32 * UN_WARP_TOKENS == UN_CHUNK, "a block's warps cover its chunk");

/* The block's chunk count: the set bits of every thread's word (cnt: shared, a word per warp). */
static __device__ __forceinline__ void chunk_count(kvt_gpu_selbits bits, uint32_t item,
						   uint32_t word, uint32_t *cnt)
{
	const uint32_t tid = threadIdx.x;
	uint32_t c = __popc(word);
	for (int o = 16; o; o >>= 1)
		c += __shfl_xor_sync(0xffffffffu, c, o);
	if (tid % 32 == 0)
		cnt[tid / 32] = c;
	__syncthreads();
	if (tid == 0) {
		uint32_t total = 0;
		for (int w = 0; w < UN_THREADS / 32; w++)
			total += cnt[w];
		bits.ccount[(size_t)item * bits.chunks + blockIdx.x] = total;
	}
}

static __global__ void __launch_bounds__(UN_THREADS)
	k_union_mark(const float *scores, size_t ld, const uint32_t *n_tok, uint32_t hq,
		     uint32_t hkv, const kvt_gpu_topp *topp, kvt_gpu_selbits bits,
		     unsigned long long *clamps)
{
	__shared__ unsigned long long cut[KVT_GPU_MAX_GROUP];
	__shared__ uint32_t cnt[UN_THREADS / 32];
	const uint32_t item = blockIdx.y, seq = item / hkv, h = item % hkv, G = hq / hkv;
	const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n = n_tok[seq];
	const size_t seg0 = (size_t)seq * hq + (size_t)h * G;
	for (uint32_t g = tid; g < G; g += UN_THREADS) {
		const kvt_gpu_topp o = topp[seg0 + g];
		cut[g] = o.marked ? o.cut : ~0ull; /* ~0: nothing marked (no real cut has it) */
		if (clamps && blockIdx.x == 0 && o.clamped)
			atomicAdd(&clamps[o.clamped < 0 ? 0 : 1], 1ull);
	}
	__syncthreads();
	const uint32_t t0 = blockIdx.x * UN_CHUNK + warp * UN_WARP_TOKENS;
	/* bit k of sel: token t0 + 32 k + lane; the loads of UN_HEADS heads are issued together (a
	 * block per 8192 tokens leaves few warps per multiprocessor: only loads in flight hide the
	 * memory's latency) */
	uint32_t sel = 0;
	for (uint32_t g0 = 0; g0 < G; g0 += UN_HEADS) {
		float x[UN_HEADS][32];
#pragma unroll
		for (uint32_t e = 0; e < UN_HEADS; e++) {
			const uint32_t g = g0 + e;
			const bool on = g < G && cut[g] != ~0ull; /* ~0: nothing marked */
			const float *row = scores + (seg0 + (on ? g : 0)) * ld;
#pragma unroll
			for (int k = 0; k < 32; k++) {
				const uint32_t t = t0 + 32 * k + lane;
				x[e][k] = on && t < n ? row[t] : 0.0f;
			}
		}
#pragma unroll
		for (uint32_t e = 0; e < UN_HEADS; e++) {
			const uint32_t g = g0 + e;
			if (g >= G || cut[g] == ~0ull)
				continue;
#pragma unroll
			for (int k = 0; k < 32; k++) {
				const uint32_t t = t0 + 32 * k + lane;
				const unsigned long long ck =
					(unsigned long long)kvt_d_fkey(x[e][k]) << 32 | (0xffffffffu - t);
				sel |= (t < n && ck >= cut[g] ? 1u : 0u) << k;
			}
		}
	}
	uint32_t mine = 0;
#pragma unroll
	for (int k = 0; k < 32; k++) {
		const uint32_t w = __ballot_sync(0xffffffffu, (sel >> k) & 1u);
		if (lane == (uint32_t)k)
			mine = w;
	}
	const uint32_t wi = t0 / 32 + lane;
	if (wi < bits.words)
		bits.mask[(size_t)item * bits.words + wi] = mine;
	chunk_count(bits, item, mine, cnt);
}

/* What k_union_mark adds besides the bits, for bits the threshold's candidate pass marked
 * (kvt_gpu_topp_select): each block's count of its chunk's selected tokens, and the clamps. */
static __global__ void __launch_bounds__(UN_THREADS)
	k_union_count(uint32_t hq, uint32_t hkv, const kvt_gpu_topp *topp, kvt_gpu_selbits bits,
		      unsigned long long *clamps)
{
	__shared__ uint32_t cnt[UN_THREADS / 32];
	const uint32_t item = blockIdx.y, tid = threadIdx.x, G = hq / hkv;
	if (clamps && blockIdx.x == 0 && tid < G) {
		const int32_t c = topp[(size_t)(item / hkv) * hq + (item % hkv) * G + tid].clamped;
		if (c)
			atomicAdd(&clamps[c < 0 ? 0 : 1], 1ull);
	}
	const uint32_t wi = blockIdx.x * (UN_CHUNK / 32) + tid;
	const uint32_t word = wi < bits.words ? bits.mask[(size_t)item * bits.words + wi] : 0u;
	chunk_count(bits, item, word, cnt);
}

static __global__ void __launch_bounds__(UN_THREADS)
	k_union_write(kvt_gpu_selbits bits, uint32_t *sel, size_t sel_ld, uint32_t *sel_n)
{
	__shared__ uint32_t wsum[UN_THREADS / 32];
	__shared__ uint32_t before;
	const uint32_t item = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
	/* selected tokens of the earlier chunks */
	uint32_t b = 0;
	for (uint32_t c = tid; c < blockIdx.x; c += UN_THREADS)
		b += bits.ccount[(size_t)item * bits.chunks + c];
	for (int o = 16; o; o >>= 1)
		b += __shfl_xor_sync(0xffffffffu, b, o);
	if (lane == 0)
		wsum[warp] = b;
	__syncthreads();
	if (tid == 0) {
		uint32_t t = 0;
		for (int w = 0; w < UN_THREADS / 32; w++)
			t += wsum[w];
		before = t;
	}
	__syncthreads();
	const uint32_t wi = blockIdx.x * (UN_CHUNK / 32) + tid;
	const uint32_t word = wi < bits.words ? bits.mask[(size_t)item * bits.words + wi] : 0u;
	uint32_t c = __popc(word), inc = c;
	for (int o = 1; o < 32; o <<= 1) {
		const uint32_t v = __shfl_up_sync(0xffffffffu, inc, o);
		if (lane >= (uint32_t)o)
			inc += v;
	}
	if (lane == 31)
		wsum[warp] = inc;
	__syncthreads();
	uint32_t off = before + inc - c;
	for (uint32_t w = 0; w < warp; w++)
		off += wsum[w];
	/* the warp writes its 32 words one after another, each word's set bits by the lanes of those
	 * bits, so that a word's positions go out in one coalesced store */
	uint32_t *dst = sel + (size_t)item * sel_ld;
	const uint32_t below = (1u << lane) - 1u, w0 = wi - lane;
	for (int k = 0; k < 32; k++) {
		const uint32_t wk = __shfl_sync(0xffffffffu, word, k);
		const uint32_t ok = __shfl_sync(0xffffffffu, off, k);
		if ((wk >> lane) & 1u)
			dst[ok + __popc(wk & below)] = (w0 + (uint32_t)k) * 32 + lane;
	}
	if (blockIdx.x == gridDim.x - 1 && tid == UN_THREADS - 1)
		sel_n[item] = off + c;
}

/* ---- launchers --------------------------------------------------------------------------- */

static size_t up256(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

static uint32_t words_of(uint32_t max_n)
{
	return (uint32_t)(((uint64_t)max_n + 31) / 32);
}

static uint32_t chunks_of(uint32_t max_n)
{
	return max_n ? (uint32_t)(((uint64_t)max_n + UN_CHUNK - 1) / UN_CHUNK) : 1;
}

extern "C" bool kvt_gpu_selbits_fit(kvt_gpu_selbits bits, uint32_t max_n)
{
	return bits.mask && bits.ccount && bits.words >= words_of(max_n) && bits.chunks &&
	       (uint64_t)bits.chunks * UN_CHUNK >= (uint64_t)bits.words * 32;
}

extern "C" size_t kvt_gpu_selbits_bytes(size_t n_items, uint32_t max_n)
{
	return up256(n_items * words_of(max_n) * 4) + up256(n_items * chunks_of(max_n) * 4);
}

extern "C" kvt_gpu_selbits kvt_gpu_selbits_at(void *base, size_t n_items, uint32_t max_n)
{
	kvt_gpu_selbits b;
	b.words = words_of(max_n);
	b.chunks = chunks_of(max_n);
	b.mask = (uint32_t *)base;
	b.ccount = (uint32_t *)((char *)base + up256(n_items * b.words * 4));
	return b;
}

extern "C" int kvt_gpu_topp_union_bits(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				       const float *scores, size_t ld, const uint32_t *n_tokens,
				       uint32_t max_n, const kvt_gpu_topp *topp,
				       kvt_gpu_selbits bits, unsigned long long *clamps,
				       void *stream)
{
	if (!scores || !n_tokens || !topp || !bits.mask || !bits.ccount || n_kv_heads == 0 ||
	    n_q_heads % n_kv_heads || n_q_heads / n_kv_heads > KVT_GPU_MAX_GROUP)
		return -EINVAL;
	if (ld % 4 || max_n > ld || max_n > KVT_GPU_SELECT_MAX_N || bits.words < words_of(max_n) ||
	    bits.chunks != chunks_of(max_n))
		return -EINVAL;
	if ((uint64_t)n_seqs * n_kv_heads > 65535)
		return -EINVAL;
	if (n_seqs == 0)
		return 0;
	const dim3 grid(chunks_of(max_n), n_seqs * n_kv_heads);
	k_union_mark<<<grid, UN_THREADS, 0, KVT_STREAM(stream)>>>(scores, ld, n_tokens, n_q_heads,
								  n_kv_heads, topp, bits, clamps);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_selbits_count(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				     const kvt_gpu_topp *topp, kvt_gpu_selbits bits,
				     unsigned long long *clamps, void *stream)
{
	if (!topp || !kvt_gpu_selbits_fit(bits, 0) || n_kv_heads == 0 || n_q_heads % n_kv_heads ||
	    n_q_heads / n_kv_heads > KVT_GPU_MAX_GROUP || (uint64_t)n_seqs * n_kv_heads > 65535)
		return -EINVAL;
	if (n_seqs == 0)
		return 0;
	const dim3 grid(bits.chunks, n_seqs * n_kv_heads);
	k_union_count<<<grid, UN_THREADS, 0, KVT_STREAM(stream)>>>(n_q_heads, n_kv_heads, topp,
								   bits, clamps);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_selbits_list(uint32_t n_items, kvt_gpu_selbits bits, uint32_t *sel,
				    size_t sel_ld, uint32_t *sel_n, void *stream)
{
	if (!kvt_gpu_selbits_fit(bits, 0) || !sel || !sel_n || n_items > 65535)
		return -EINVAL;
	if (n_items == 0)
		return 0;
	const dim3 grid(bits.chunks, n_items);
	k_union_write<<<grid, UN_THREADS, 0, KVT_STREAM(stream)>>>(bits, sel, sel_ld, sel_n);
	KVT_CU_LAUNCHED();
	return 0;
}

extern "C" int kvt_gpu_topp_union(uint32_t n_seqs, uint32_t n_q_heads, uint32_t n_kv_heads,
				  const float *scores, size_t ld, const uint32_t *n_tokens,
				  uint32_t max_n, const kvt_gpu_topp *topp, uint32_t *sel,
				  size_t sel_ld, uint32_t *sel_n, void *scratch,
				  size_t scratch_bytes, void *stream)
{
	const size_t items = (size_t)n_seqs * n_kv_heads;
	if (!sel || !sel_n || !scratch || ((uintptr_t)scratch & 3) || sel_ld < max_n ||
	    n_kv_heads == 0 || n_q_heads % n_kv_heads ||
	    scratch_bytes < kvt_gpu_select_scratch_bytes(n_seqs, n_q_heads, n_kv_heads, max_n))
		return -EINVAL;
	const kvt_gpu_selbits bits = kvt_gpu_selbits_at(scratch, items, max_n);
	const int rc = kvt_gpu_topp_union_bits(n_seqs, n_q_heads, n_kv_heads, scores, ld, n_tokens,
					       max_n, topp, bits, NULL, stream);
	if (rc < 0 || n_seqs == 0)
		return rc;
	return kvt_gpu_selbits_list((uint32_t)items, bits, sel, sel_ld, sel_n, stream);
}
