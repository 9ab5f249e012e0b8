/* SPDX-License-Identifier: MIT */
/*
 * kvt_attend_graph's kernels: the refresh of the per-sequence records, and the descriptors of a
 * step built from the caller's slot buffers when the step runs (gpu/graph.cuh).
 */
#include <errno.h>
#include <string.h>

#include "common.cuh"
#include "errword.h"
#include "graph.cuh"

/* Rows a publish launch carries as its parameter (about 2.5 KiB of the 4 KiB a launch may pass). */
#define GR_PER_LAUNCH 16u

struct publish_blob {
	uint32_t n;
	uint32_t at[GR_PER_LAUNCH];
	kvt_gpu_graph_row rows[GR_PER_LAUNCH];
};

static __global__ void k_publish(kvt_gpu_graph_row *table, const publish_blob b)
{
	if (threadIdx.x < b.n)
		table[b.at[threadIdx.x]] = b.rows[threadIdx.x];
}

extern "C" int kvt_gpu_graph_publish(kvt_gpu_graph_row *table, uint32_t n, const uint32_t *at,
				     const kvt_gpu_graph_row *rows, void *stream)
{
	if (!table || (n && (!at || !rows)))
		return -EINVAL;
	for (uint32_t o = 0; o < n; o += GR_PER_LAUNCH) {
		publish_blob b;
		b.n = n - o < GR_PER_LAUNCH ? n - o : GR_PER_LAUNCH;
		memcpy(b.at, at + o, sizeof(uint32_t) * b.n);
		memcpy(b.rows, rows + o, sizeof(kvt_gpu_graph_row) * b.n);
		k_publish<<<1, GR_PER_LAUNCH, 0, KVT_STREAM(stream)>>>(table, b);
		KVT_CU_LAUNCHED();
	}
	return 0;
}

#define GD_THREADS 256

static __device__ bool slot_valid(const kvt_gpu_graph_step &st, uint32_t i)
{
	return st.valid ? st.valid[i] != 0 : st.seqs[i] >= 0;
}

static __global__ void __launch_bounds__(GD_THREADS)
	k_desc(const kvt_gpu_graph_step st, uint32_t n_slots, uint32_t hkv, kvt_gpu_index_view *views,
	       uint32_t *ntok, const float **cq, const float **ck, kvt_gpu_fetch_seq *fetch,
	       unsigned long long *err)
{
	if (threadIdx.x == 0 && st.epoch)
		++*st.epoch; /* the step's fetch runs after this kernel, on the same stream */
	for (uint32_t i = threadIdx.x; i < n_slots; i += GD_THREADS) {
		kvt_gpu_fetch_seq f;
		memset(&f, 0, sizeof f);
		f.sel = st.sel + (size_t)i * hkv * st.sel_ld;
		f.sel_n = st.sel_n + (size_t)i * hkv;
		f.sel_ld = st.sel_ld;
		f.flags = KVT_GPU_FETCH_SKIP;
		kvt_gpu_index_view v;
		memset(&v, 0, sizeof v);
		const float *c_k = st.zero, *c_q = st.zero;
		uint32_t ni = 0, cause = 0;
		if (slot_valid(st, i)) {
			const int32_t s = st.seqs[i];
			const kvt_gpu_graph_row *r =
				s >= 0 && (uint32_t)s < st.max_seqs ? &st.table[s] : NULL;
			if (!r || r->n_tokens == 0)
				cause = KVT_SLOT_NOT_OPEN;
			for (uint32_t j = 0; j < i && !cause; j++)
				if (slot_valid(st, j) && st.seqs[j] == s)
					cause = KVT_SLOT_REPEATED;
			if (!cause && st.lengths && (uint32_t)st.lengths[i] != r->n_tokens)
				cause = KVT_SLOT_LENGTH;
			if (!cause && r->n_tokens > st.max_tokens)
				cause = KVT_SLOT_TOO_LONG;
			if (!cause && r->spilled)
				cause = KVT_SLOT_SPILLED;
			if (!cause && r->in_error)
				cause = KVT_SLOT_IN_ERROR;
			if (cause) {
				kvt_d_raise(err, KVT_GPU_ERR_SLOT, (st.layer & 0xffffu) | cause << 16, i);
			} else {
				f = r->f;
				f.sel = st.sel + (size_t)i * hkv * st.sel_ld;
				f.sel_n = st.sel_n + (size_t)i * hkv;
				f.sel_ld = st.sel_ld;
				v = r->view;
				c_k = r->ck;
				c_q = r->cq;
				ni = r->f.n_indexed;
			}
		}
		views[i] = v;
		ntok[i] = ni;
		ck[i] = c_k;
		cq[i] = c_q;
		fetch[i] = f;
	}
}

extern "C" int kvt_gpu_graph_desc(const kvt_gpu_graph_step *st, uint32_t n_slots,
				  uint32_t n_kv_heads, kvt_gpu_index_view *views, uint32_t *ntok,
				  const float **cq, const float **ck, kvt_gpu_fetch_seq *fetch,
				  unsigned long long *err, void *stream)
{
	if (!st || !st->table || !st->seqs || !st->zero || !st->sel || !st->sel_n || !views ||
	    !ntok || !cq || !ck || !fetch || n_slots == 0 || n_kv_heads == 0)
		return -EINVAL;
	k_desc<<<1, GD_THREADS, 0, KVT_STREAM(stream)>>>(*st, n_slots, n_kv_heads, views, ntok, cq,
							 ck, fetch, err);
	KVT_CU_LAUNCHED();
	return 0;
}
