/* SPDX-License-Identifier: MIT */
/*
 * kvt_extend on the CUDA backend. Exact attention (flags 0): per entry, the sequence's rows up to
 * its last query row are staged from the host tier into device buffers a range at a time, and
 * each range is attended by all of the entry's query rows
 * (gpu/extend.cu); their running state carries over ranges. A long chunk over more than 8192 rows
 * goes through three ranges or more, the staging of each (on a side stream) overlapping the
 * attention of the one before (on the caller's). The chunk's own rows were stored by the pipeline
 * just before, in stream order. Nothing is synchronized unless a buffer grows (refused under graph
 * capture). Spilled sequences were restored by lib/api.c first (read_rows_spilled is false).
 * KVT_EXTEND_TOPP: each query row a decode step of its own (extend_topp).
 */
#include "cuda_backend.h"
#include "extend.cuh"

/* The staging buffers' bound, both together: rows of a longer sequence go through them in
 * several ranges (a variable so that a test can make the ranges small). */
uint64_t gpu_extend_stage_bytes = 256ull << 20;

/* A chunk of at least gpu_extend_overlap_q query rows over more than gpu_extend_one_range rows goes
 * through ranges of a quarter of them (at least half the latter, at most what one of two buffers
 * holds), the staging of range r + 1 on a side stream overlapping the attention of range r. A
 * shorter chunk has little attention to hide the staging behind (on the H200 overlapping cost 4-7 %
 * at 16 query rows, since the side stream's staging takes few SMs): its rows are staged on the
 * caller's stream by the whole device, in one range when they fit the bound. */
uint32_t gpu_extend_one_range = 8192, gpu_extend_overlap_q = 256; /* variables for the tests */

static bool overlapped(uint32_t total, uint32_t nq)
{
	return total > gpu_extend_one_range && nq >= gpu_extend_overlap_q;
}

/* Positions staged per range for nq query rows over a sequence of `total` rows (a multiple of the
 * kernel's 64 keys unless it is all of them). */
static uint32_t range_rows(const kvt_cache *c, uint32_t total, uint32_t nq)
{
	const bool two = overlapped(total, nq);
	const uint64_t per = 2ull * c->cfg.n_kv_heads * c->d * c->elem;
	uint64_t cap = gpu_extend_stage_bytes / (two ? 2 : 1) / per;
	cap = cap < 64 ? 64 : cap & ~63ull;
	uint64_t r = total;
	if (two) {
		r = (((uint64_t)total + 3) / 4 + 63) & ~63ull;
		r = r < gpu_extend_one_range / 2 ? gpu_extend_one_range / 2 : r;
	}
	return r <= cap ? (uint32_t)r : (uint32_t)cap;
}

/* The ranges of one entry, each staged into one of `bufs` buffers in turn and attended on the
 * caller's stream. With two buffers the staging runs on the side stream: a buffer is staged again
 * once the attention two ranges back is done with it; the side stream starts after everything the
 * caller's stream holds (the chunk's rows just stored, the previous entry's attention), and the
 * caller's stream waits for each staging, so the call stays stream-ordered (and capturable: fork
 * and join by events). */
static int attend_ranges(kvt_cache *c, const struct gpu_seq_layer *g, uint32_t total, uint32_t R,
			 uint32_t bufs, char *buf, size_t half, const char *qi, uint32_t nq,
			 uint32_t first, float *st, float *pt, size_t part, char *oi, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads, d = c->d;
	const bool side = bufs == 2;
	cudaStream_t ms = (cudaStream_t)stream, ss = side ? b->ext_side : ms;
	if (side) {
		CU(c, cudaEventRecord(b->ext_ev[0], ms));
		CU(c, cudaStreamWaitEvent(ss, b->ext_ev[0], 0));
	}
	uint32_t r = 0;
	for (uint32_t r0 = 0; r0 < total; r0 += R, r++) {
		const uint32_t r1 = total - r0 < R ? total : r0 + R, i = r % bufs;
		char *kb = buf + (size_t)i * 2 * half, *vb = kb + half;
		if (side && r >= 2)
			CU(c, cudaStreamWaitEvent(ss, b->ext_ev[3 + i], 0));
		LAUNCH(c, kvt_gpu_stage_rows(d, H, (void *const *)g->blk, g->blk_cap,
					     (uint32_t)c->row_bytes, r0, r1, kb, vb, R,
					     side ? b->ext_stage_blocks : 0, b->err, ss));
		if (side) {
			CU(c, cudaEventRecord(b->ext_ev[1 + i], ss));
			CU(c, cudaStreamWaitEvent(ms, b->ext_ev[1 + i], 0));
		}
		LAUNCH(c, kvt_gpu_extend_attend(d, c->cfg.dtype, c->cfg.out_dtype, Hq, H, c->scale, qi,
						nq, first, kb, vb, R, r0, r1, st, r0 == 0,
						r1 == total, oi, pt, part, stream));
		if (side)
			CU(c, cudaEventRecord(b->ext_ev[3 + i], ms));
	}
	return 0;
}

/*
 * KVT_EXTEND_TOPP: each query row of a chunk is a decode step of its own (gpu_step over its one
 * sequence) at the lengths the row sees, as the cpu backend's topp_row: the tokens up to its
 * position P, of which the first min(P + 1 - sinks, indexed[i]) are the indexed ones it scores
 * (the chunk's index built, waited for on the device) and the rest, the window's, are in the ring
 * (the chunk's store wrote the sequence's last tokens there). The last row of a chunk then sees
 * what kvt_attend of its query sees once the chunk is in. Steps are queued on `stream` in row
 * order; the layer keeps the last row's selection as its last (the pipeline drops the
 * sequences' selections when the chunk is committed).
 */
static int extend_topp(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		       const uint32_t *cu, const uint32_t *indexed, const void *q, void *out,
		       void *stream)
{
	const size_t q_row = (size_t)c->cfg.n_q_heads * c->d * c->elem;
	const size_t out_row = (size_t)c->cfg.n_q_heads * c->d * c->out_elem;
	const uint32_t S = c->cfg.n_sink;
	/* each entry's last row sees the most: its sizes checked and its scratch made before any
	 * step runs, so that a refusal or a failed allocation comes first */
	for (uint32_t i = 0; i < n_seqs; i++)
		if (cu[i + 1] > cu[i])
			KVT_TRY(gpu_step_prepare(c, layer, 1, indexed[i],
						 ls[i]->n_tokens + cu[i + 1] - cu[i], stream));
	int rc = 0;
	uint32_t stepped = 0;
	for (uint32_t i = 0; i < n_seqs && rc == 0; i++) {
		struct kvt_layer *l = ls[i];
		const uint32_t t0 = l->sel_tokens, i0 = l->sel_indexed;
		for (uint32_t j = 0; j < cu[i + 1] - cu[i] && rc == 0; j++) {
			const uint32_t P = l->n_tokens + j, seen = P + 1 > S ? P + 1 - S : 0;
			l->sel_tokens = P + 1;
			l->sel_indexed = seen < indexed[i] ? seen : indexed[i];
			rc = gpu_step_copy(c, layer, 1, &ls[i], (const char *)q + (cu[i] + j) * q_row,
					   (char *)out + (cu[i] + j) * out_row, NULL, false, stream);
			stepped += rc == 0;
		}
		l->sel_tokens = t0;
		l->sel_indexed = i0;
		/* one copy of the error word per entry: a row's error names its sequence */
		if (cu[i + 1] > cu[i]) {
			const int e = gpu_err_copy_batch(c, layer, 1, &ls[i], stream);
			rc = rc < 0 ? rc : e;
		}
	}
	if (rc < 0 && stepped)
		/* the steps put rows of positions the undone chunk held into the hot cache, tagged
		 * by the layer's uid: the layers take new names, as a truncation does */
		for (uint32_t i = 0; i < n_seqs; i++)
			if (cu[i + 1] > cu[i])
				ls[i]->seq_uid = ++c->next_uid;
	return rc;
}

int gpu_extend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
	       const uint32_t *cu, const uint32_t *indexed, const void *q, void *out, void *stream)
{
	struct gpu_cache *b = gpu_of(c);
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads, d = c->d;
	const size_t q_row = (size_t)Hq * d * c->elem;
	const size_t out_row = (size_t)Hq * d * c->out_elem;
	(void)layer;
	uint64_t rows = 0, bytes = 0;
	KVT_RETURN_IF(indexed && c->cfg.keep_weight != 0.0f, c, -EOPNOTSUPP,
		      "keep_weight = %g: the CUDA backend's kvt_extend has no Top-p rows with the "
		      "selection hysteresis yet (each row would favor the row before); extend "
		      "without KVT_EXTEND_TOPP, or attend the rows one by one",
		      (double)c->cfg.keep_weight);
	/* the grow of this call's rows may have spilled one of its own sequences (KVT_SPILL_LRU
	 * picks the batch's last when nothing else is left): refused before any launch, and the
	 * pipeline reads the victims back */
	for (uint32_t i = 0; i < n_seqs; i++)
		KVT_RETURN_IF(cu[i + 1] > cu[i] && kvt_layer_spilled(c, ls[i]), c, -ENOSPC,
			      "entry %u of kvt_extend: rows of its sequence were spilled to make room "
			      "for the batch's new rows (host_bytes = %llu too small for the batch); "
			      "the cuda backend attends only rows in host memory",
			      i, (unsigned long long)c->host.capacity);
	if (indexed)
		return extend_topp(c, layer, n_seqs, ls, cu, indexed, q, out, stream);
	for (uint32_t i = 0; i < n_seqs; i++) {
		const uint32_t nq = cu[i + 1] - cu[i];
		if (!nq)
			continue;
		struct kvt_layer *l = ls[i];
		struct gpu_seq_layer *g;
		KVT_TRY(gpu_mirror_get(c, l, &g));
		KVT_TRY(gpu_mirror_sync_blocks(c, l, g, stream));
		const uint32_t first = l->n_tokens, total = first + nq, R = range_rows(c, total, nq);
		const bool ranges = R < total;
		const uint32_t bufs = overlapped(total, nq) ? 2 : 1;
		const size_t half = gpu_up((size_t)H * R * d * c->elem);
		const size_t state = ranges ? gpu_up(kvt_gpu_extend_state_bytes(nq, Hq, d)) : 0;
		const size_t part = gpu_up(kvt_gpu_extend_part_bytes(nq, Hq, H, d, R));
		KVT_TRY(gpu_grow(c, &b->ext_mem, &b->ext_bytes, bufs * 2 * half + state + part,
				 stream, "the staging buffers of kvt_extend"));
		char *buf = b->ext_mem;
		float *st = ranges ? (float *)(buf + bufs * 2 * half) : NULL;
		float *pt = part ? (float *)(buf + bufs * 2 * half + state) : NULL;
		KVT_TRY(attend_ranges(c, g, total, R, bufs, buf, half,
				      (const char *)q + cu[i] * q_row, nq, first, st, pt, part,
				      (char *)out + cu[i] * out_row, stream));
		rows += (uint64_t)total * H;
		bytes += (uint64_t)total * H * c->row_bytes;
	}
	b->ext_rows += rows; /* counted once every entry is queued */
	b->ext_bytes_read += bytes;
	return gpu_err_copy(c, stream);
}
