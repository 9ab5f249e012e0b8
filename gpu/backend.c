/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: the pipeline of DESIGN.md on the GPU, on the launchers of the .cuh files of gpu/.
 *
 * Where things live. Full K/V rows stay in the host tier (pinned, mapped host memory: the kernels
 * read and write it directly). Per (sequence, layer) the device holds the index in the CPU layout,
 * the centroids, a block table mirroring the host one, and the window ring (the last W..W+B tokens,
 * W + 2B slots). Per layer it holds a hot-token cache, the selection of the last step, the index
 * jobs of the last flush and an event marking the end of the last index build. Per cache: the
 * rotations, per-step scratch (grown at a new batch or context size, never in a steady state), and a
 * staging buffer for prefill keys.
 *
 * Streams. Everything runs on the caller's stream except index builds of prefill chunks and window
 * flushes, which run on a low-priority stream of the cache, so a runtime's own prefill attention
 * overlaps them. The next call on that layer makes the caller's stream wait for the build on the
 * device (cudaStreamWaitEvent), never on the host. Prefill keys are copied to the staging buffer
 * first, so the caller may reuse its buffers in stream order as with any stream-ordered call.
 *
 * The decode step (kvt_attend) enqueues kernels, kernel-parameter uploads and one small
 * device-to-pinned copy of the error word: no allocation once the scratch fits, no host
 * synchronization, so it can be captured in a CUDA graph after one warm-up step at the same shape.
 * A sequence spilled to NVMe is restored by the step that attends it (the kernels read the host
 * tier only), and the device is drained before the NVMe tier moves blocks of the host tier.
 * Errors the kernels find (a non-finite score) are recorded in an error word on the device and
 * reported by the next call on the cache, or by kvt_select / kvt_gather / kvt_get_stats, which
 * synchronize.
 */
#include <cuda_runtime.h>
#include <string.h>

#include "../lib/internal.h"
#include "attend.cuh"
#include "fetch.cuh"
#include "index.cuh"
#include "score.cuh"
#include "select.cuh"

/* A CUDA runtime call that must succeed, else -EIO naming it. */
#define CU(c, expr)                                                                                \
	do {                                                                                       \
		cudaError_t e_ = (expr);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return kvt_seterr((c), -EIO, "%s: %s", #expr, cudaGetErrorString(e_));     \
	} while (0)
/* A launcher of gpu/ that must return 0. */
#define LAUNCH(c, expr)                                                                            \
	do {                                                                                       \
		int r_ = (expr);                                                                   \
		if (r_ < 0)                                                                        \
			return kvt_seterr((c), r_, "%s: %s", #expr, kvt_strerror(r_));             \
	} while (0)

/* Per (sequence, layer). */
struct gl {
	uint32_t cap;           /* index tokens per KV head */
	uint32_t *codes;        /* [H][cap][d/32] */
	uint16_t *sigma, *beta; /* [H][cap] */
	float *cent;            /* [2][H][d]: c_k, then c_q */
	void *ring;             /* [H][wcap][row] */
	uint32_t wcap;
	void **blk;             /* [H][blk_cap] */
	uint32_t blk_cap, blk_n; /* table capacity and blocks per head uploaded */
	uint64_t blk_gen;
	bool spilled;           /* a block of [0, blk_n) is on NVMe */
	uint64_t sel_stamp;     /* which selection of the layer holds this sequence's */
	uint32_t sel_slot;
};

/* Per layer number. */
struct glay {
	kvt_gpu_hot hot;
	uint32_t epoch;
	cudaEvent_t indexed;    /* end of the last index build of this layer */
	bool pending;           /* recorded since the last wait on `waited` */
	void *waited;           /* the stream that waited (NULL is a stream too: the default one) */
	uint64_t stamp;         /* of the last selection made */
	uint32_t *sel;          /* [seqs][H][sel_ld] */
	uint32_t *sel_n;        /* [seqs][H] */
	size_t sel_bytes;
	size_t sel_ld;
	void *jobs;             /* index jobs and views of one build, device */
	uint64_t steps, selected;
};

/* Stage times: CUDA events around the stages of a step or an index build, read back (and added to
 * the ns_* counters of kvt_stats) once complete, at the latest by kvt_get_stats. */
#define TIMING_SETS 64
enum { T_NONE, T_STEP, T_INDEX, T_STORE };
struct tset {
	cudaEvent_t ev[4]; /* step: start, scored, selected, attended; index and store: start, end */
	int kind;
};

struct gbe {
	cudaStream_t idx;
	float *rot;                   /* [L][d][d] */
	unsigned long long *err;      /* device error word */
	unsigned long long *err_host; /* pinned mirror, written by each step */
	struct glay *lay;             /* [L] */
	unsigned long long *counters; /* [L][KVT_GPU_CNT_N] device */
	unsigned long long *cnt_host; /* [L][KVT_GPU_CNT_N] */
	void *arena;                  /* per-step scratch */
	size_t arena_bytes;
	void *staging;                /* prefill keys */
	size_t staging_bytes;
	cudaEvent_t staging_ev, ready;
	bool staging_pending;
	void *hot_mem;
	size_t hot_bytes;
	uint64_t stamp;
	void *host;                   /* host scratch for descriptors, max_seqs entries */
	size_t jobs_bytes;
	struct tset t[TIMING_SETS];
	uint32_t t_next;
};

/* The per-step scratch of a batch, carved from the arena. */
struct step {
	kvt_gpu_index_view *views;
	uint32_t *ntok;
	const float **cq, **ck;
	kvt_gpu_fetch_seq *fetch;
	size_t desc_bytes;
	kvt_gpu_qcode *qc;
	float *scores;
	kvt_gpu_topp *topp;
	void *sscratch;
	size_t sbytes;
	const void **rows;
	kvt_gpu_rows *items;
	int32_t *pos;
	void *ascratch;
	size_t abytes;
	size_t bytes;
};

static size_t up(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

static struct step carve(const kvt_cache *c, char *base, uint32_t n, uint32_t ld, uint32_t max_rows)
{
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads;
	struct step s;
	size_t o = 0;
#define PIECE(field, type, count)                                                                  \
	do {                                                                                       \
		s.field = (type)(base ? base + o : NULL);                                          \
		o += up((size_t)(count));                                                          \
	} while (0)
	/* the descriptors first, in one piece, so that one upload per step carries them; pointer
	 * arrays stay 8-byte aligned (views are 24 bytes, ntok is padded) */
	size_t at = sizeof(kvt_gpu_index_view) * n;
	s.views = (kvt_gpu_index_view *)base;
	s.ntok = (uint32_t *)(base ? base + at : NULL);
	at += (sizeof(uint32_t) * n + 7) & ~(size_t)7;
	s.cq = (const float **)(base ? base + at : NULL);
	at += sizeof(void *) * n;
	s.ck = (const float **)(base ? base + at : NULL);
	at += sizeof(void *) * n;
	s.fetch = (kvt_gpu_fetch_seq *)(base ? base + at : NULL);
	at += sizeof(kvt_gpu_fetch_seq) * n;
	s.desc_bytes = at;
	o = up(at);
	PIECE(qc, kvt_gpu_qcode *, sizeof(kvt_gpu_qcode) * n * Hq);
	PIECE(scores, float *, sizeof(float) * n * Hq * ld);
	PIECE(topp, kvt_gpu_topp *, sizeof(kvt_gpu_topp) * n * Hq);
	s.sbytes = kvt_gpu_select_scratch_bytes(n, Hq, H, ld);
	PIECE(sscratch, void *, s.sbytes);
	PIECE(rows, const void **, sizeof(void *) * n * H * max_rows);
	PIECE(items, kvt_gpu_rows *, sizeof(kvt_gpu_rows) * n * H);
	PIECE(pos, int32_t *, sizeof(int32_t) * n * H * max_rows);
	s.abytes = kvt_gpu_attend_scratch_bytes(n, Hq, H, c->d, max_rows);
	PIECE(ascratch, void *, s.abytes);
#undef PIECE
	s.bytes = o;
	return s;
}

static inline struct gbe *BE(const kvt_cache *c)
{
	return (struct gbe *)c->be;
}

static uint64_t ns_between(cudaEvent_t a, cudaEvent_t b)
{
	float ms = 0.0f;
	return cudaEventElapsedTime(&ms, a, b) == cudaSuccess && ms > 0 ? (uint64_t)(ms * 1e6) : 0;
}

/* Add a completed set's stage times to the counters. */
static void harvest(kvt_cache *c, struct tset *t)
{
	if (t->kind == T_STEP) {
		c->st.ns_score += ns_between(t->ev[0], t->ev[1]);
		c->st.ns_select += ns_between(t->ev[1], t->ev[2]);
		c->st.ns_attend += ns_between(t->ev[2], t->ev[3]);
	} else if (t->kind == T_INDEX) {
		c->st.ns_index += ns_between(t->ev[0], t->ev[1]);
	} else if (t->kind == T_STORE) {
		c->st.ns_store += ns_between(t->ev[0], t->ev[1]);
	}
	t->kind = T_NONE;
}

/* A free set of events for a new step or build, or NULL: none free (the step goes untimed), or
 * the stream is being captured (events recorded into a graph cannot be timed). */
static struct tset *timing(kvt_cache *c, void *stream, int kind)
{
	struct gbe *b = (struct gbe *)c->be;
	enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	if (cudaStreamIsCapturing((cudaStream_t)stream, &st) != cudaSuccess ||
	    st != cudaStreamCaptureStatusNone || !b->t[0].ev[0])
		return NULL;
	struct tset *t = &b->t[b->t_next];
	if (t->kind != T_NONE) {
		if (cudaEventQuery(t->ev[t->kind == T_STEP ? 3 : 1]) != cudaSuccess)
			return NULL;
		harvest(c, t);
	}
	b->t_next = (b->t_next + 1) % TIMING_SETS;
	t->kind = kind;
	return t;
}

static void mark(struct tset *t, int i, void *stream)
{
	if (t)
		cudaEventRecord(t->ev[i], (cudaStream_t)stream);
}

/* Whether `stream` is being captured into a graph (allocations must not happen then). */
static int no_capture(kvt_cache *c, void *stream, const char *what)
{
	enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	CU(c, cudaStreamIsCapturing((cudaStream_t)stream, &st));
	KVT_RETURN_IF(st != cudaStreamCaptureStatusNone, c, -EINVAL,
		      "%s needs device memory while the stream is being captured: run one step of "
		      "the same batch and context size before capturing",
		      what);
	return 0;
}

static void dfree(void *p)
{
	kvt_mem_free(KVT_MEM_DEVICE, p, 0);
}

/* Zeroed device memory. */
static int dalloc(kvt_cache *c, void **p, size_t bytes, const char *what)
{
	*p = kvt_mem_alloc(KVT_MEM_DEVICE, bytes ? bytes : 1);
	KVT_RETURN_IF(!*p, c, -ENOMEM, "out of device memory allocating %zu bytes for %s", bytes,
		      what);
	if (cudaMemset(*p, 0, bytes) != cudaSuccess) {
		dfree(*p);
		*p = NULL;
		return kvt_seterr(c, -EIO, "cudaMemset of %s failed", what);
	}
	return 0;
}

/* Grow a device buffer to `need` bytes (contents not kept). */
static int grow(kvt_cache *c, void **p, size_t *have, size_t need, void *stream, const char *what)
{
	if (need <= *have && *p)
		return 0;
	KVT_TRY(no_capture(c, stream, what));
	size_t want = need + need / 4;
	void *q = NULL;
	KVT_TRY(dalloc(c, &q, want, what));
	CU(c, cudaDeviceSynchronize()); /* the old buffer may still be read */
	dfree(*p);
	*p = q;
	*have = want;
	return 0;
}

/* Make `stream` wait for the last index build of `layer`. */
static int wait_index(kvt_cache *c, uint32_t layer, void *stream)
{
	struct glay *y = &BE(c)->lay[layer];
	if (y->pending) {
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, y->indexed, 0));
		y->waited = stream;
		y->pending = false;
	} else if (y->waited != stream) {
		/* another stream than the one that waited: it must wait too */
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, y->indexed, 0));
		y->waited = stream;
	}
	return 0;
}

/* An error the kernels recorded since the last check. */
static int check_err(kvt_cache *c)
{
	struct gbe *b = BE(c);
	unsigned long long w = *(volatile unsigned long long *)b->err_host;
	if (!w)
		return 0;
	*b->err_host = 0;
	cudaMemset(b->err, 0, sizeof *b->err);
	uint32_t code = KVT_GPU_ERR_CODE(w), where = KVT_GPU_ERR_WHERE(w), idx = KVT_GPU_ERR_INDEX(w);
	if (code == KVT_GPU_ERR_NONFINITE)
		return kvt_seterr(c, -EINVAL,
				  "an earlier step met a non-finite estimated score (batch entry %u, "
				  "query head %u, indexed token %u): a non-finite query or key, or a "
				  "key whose sigma or beta overflowed fp16; that step's selection "
				  "was empty",
				  where / c->cfg.n_q_heads, where % c->cfg.n_q_heads, idx);
	return kvt_seterr(c, -EIO,
			  "an earlier GPU step reported error %u (item %u, value %u): a count or "
			  "position beyond what the launch was sized for",
			  code, where, idx);
}

/* Every entry point: the cache's device current on this thread (runtimes switch devices), then
 * any error the kernels recorded since the last call. */
static int enter(kvt_cache *c)
{
	int cur = -1;
	if (cudaGetDevice(&cur) != cudaSuccess || cur != c->cfg.device)
		CU(c, cudaSetDevice(c->cfg.device));
	return check_err(c);
}

/* Queue the copy of the error word to its pinned mirror, read by the next check_err. */
static int err_copy(kvt_cache *c, void *stream)
{
	struct gbe *b = BE(c);
	CU(c, cudaMemcpyAsync(b->err_host, b->err, sizeof *b->err, cudaMemcpyDeviceToHost,
			      (cudaStream_t)stream));
	return 0;
}

/* ---- per (sequence, layer) state --------------------------------------------------------- */

static void gl_free(struct gl *g)
{
	if (!g)
		return;
	dfree(g->codes);
	dfree(g->sigma);
	dfree(g->beta);
	dfree(g->cent);
	dfree(g->ring);
	dfree(g->blk);
	kvt_mem_free(KVT_MEM_HOST, g, 0);
}

static void cu_layer_fini(kvt_cache *c, struct kvt_layer *l)
{
	(void)c;
	if (!l->dev)
		return;
	cudaDeviceSynchronize(); /* kernels may still read it */
	gl_free(l->dev);
	l->dev = NULL;
}

static int gl_get(kvt_cache *c, struct kvt_layer *l, struct gl **out)
{
	if (!l->dev) {
		const uint32_t H = c->cfg.n_kv_heads;
		struct gl *g = kvt_mem_alloc(KVT_MEM_HOST, sizeof *g);
		KVT_RETURN_IF(!g, c, -ENOMEM, "out of memory for a layer's GPU state");
		g->wcap = c->cfg.window + 2 * c->cfg.flush_batch;
		int rc = dalloc(c, (void **)&g->cent, sizeof(float) * 2 * H * c->d, "centroids");
		if (rc == 0)
			rc = dalloc(c, &g->ring, (size_t)H * g->wcap * c->row_bytes, "the window ring");
		if (rc < 0) {
			gl_free(g);
			return rc;
		}
		l->dev = g;
	}
	*out = l->dev;
	return 0;
}

/* Grow the device index of l to hold `tokens` per KV head, keeping what it holds. */
static int gl_reserve(kvt_cache *c, struct kvt_layer *l, struct gl *g, uint32_t layer,
		      uint32_t tokens, void *stream)
{
	if (tokens <= g->cap && g->codes)
		return 0;
	KVT_TRY(no_capture(c, stream, "growing the index"));
	const uint32_t H = c->cfg.n_kv_heads, W = c->words;
	uint32_t cap = g->cap ? g->cap * 2 : 1024;
	cap = cap < tokens ? tokens : cap;
	void *codes = NULL, *sigma = NULL, *beta = NULL;
	int rc = dalloc(c, &codes, sizeof(uint32_t) * W * H * cap, "the index codes");
	if (rc == 0)
		rc = dalloc(c, &sigma, sizeof(uint16_t) * H * cap, "the index sigma");
	if (rc == 0)
		rc = dalloc(c, &beta, sizeof(uint16_t) * H * cap, "the index beta");
	if (rc < 0) {
		dfree(codes);
		dfree(sigma);
		dfree(beta);
		return rc;
	}
	KVT_TRY(wait_index(c, layer, stream));
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	if (g->codes && l->n_indexed) {
		enum cudaMemcpyKind k = cudaMemcpyDeviceToDevice;
		const size_t ni = l->n_indexed;
		CU(c, cudaMemcpy2D(codes, sizeof(uint32_t) * W * cap, g->codes,
				   sizeof(uint32_t) * W * g->cap, sizeof(uint32_t) * W * ni, H, k));
		CU(c, cudaMemcpy2D(sigma, 2 * cap, g->sigma, 2 * (size_t)g->cap, 2 * ni, H, k));
		CU(c, cudaMemcpy2D(beta, 2 * cap, g->beta, 2 * (size_t)g->cap, 2 * ni, H, k));
	}
	dfree(g->codes);
	dfree(g->sigma);
	dfree(g->beta);
	g->codes = codes;
	g->sigma = sigma;
	g->beta = beta;
	g->cap = cap;
	return 0;
}

/* Bring the device block table of l up to date with the host one. */
static int blk_sync(kvt_cache *c, struct kvt_layer *l, struct gl *g, void *stream)
{
	const uint32_t H = c->cfg.n_kv_heads;
	if (g->blk && g->blk_cap == l->blk_cap && g->blk_gen == l->blocks_gen) {
		if (l->n_blocks <= g->blk_n)
			return 0;
		/* new blocks at the end: upload just those, in stream order */
		for (uint32_t h = 0; h < H; h++) {
			size_t at = (size_t)h * l->blk_cap + g->blk_n;
			LAUNCH(c, kvt_gpu_upload(g->blk + at, l->blocks + at,
						 sizeof(void *) * (l->n_blocks - g->blk_n), stream));
		}
		g->blk_n = l->n_blocks;
		return 0;
	}
	KVT_TRY(no_capture(c, stream, "a new block table"));
	CU(c, cudaStreamSynchronize((cudaStream_t)stream));
	if (g->blk_cap != l->blk_cap || !g->blk) {
		void *t = NULL;
		KVT_TRY(dalloc(c, &t, sizeof(void *) * H * l->blk_cap, "a block table"));
		CU(c, cudaDeviceSynchronize());
		dfree(g->blk);
		g->blk = t;
		g->blk_cap = l->blk_cap;
	}
	CU(c, cudaMemcpy(g->blk, l->blocks, sizeof(void *) * H * l->blk_cap,
			 cudaMemcpyHostToDevice));
	g->spilled = false;
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t b = 0; b < l->n_blocks; b++)
			g->spilled |= !l->blocks[(size_t)h * l->blk_cap + b];
	g->blk_n = l->n_blocks;
	g->blk_gen = l->blocks_gen;
	return 0;
}

static kvt_gpu_index_view view_of(const struct gl *g)
{
	return (kvt_gpu_index_view){g->codes, g->sigma, g->beta, g->cap, 0};
}

/* Index jobs over index positions [from, to) held in g's window ring (two jobs when it wraps). */
static uint32_t ring_jobs(const kvt_cache *c, const struct gl *g, uint32_t view, uint32_t from,
			  uint32_t to, kvt_gpu_index_job *jobs)
{
	uint32_t n = 0;
	const uint64_t re = c->row_bytes / c->elem; /* elements per row */
	while (from < to) {
		uint32_t slot = from % g->wcap, len = to - from;
		len = len < g->wcap - slot ? len : g->wcap - slot;
		jobs[n++] = (kvt_gpu_index_job){(const char *)g->ring + (size_t)slot * c->row_bytes,
						re,
						re * g->wcap,
						g->cent,
						g->cent + c->cfg.n_kv_heads * c->d,
						view,
						from,
						len,
						0};
		from += len;
	}
	return n;
}

/* Upload index jobs (and views after them) to the layer's job area, then build on `on`. */
static int index_jobs(kvt_cache *c, uint32_t layer, uint32_t n_jobs, const kvt_gpu_index_job *jobs,
		      uint32_t n_views, const kvt_gpu_index_view *views, uint32_t max_n, void *stream,
		      bool low_priority)
{
	struct gbe *b = BE(c);
	struct glay *y = &b->lay[layer];
	if (n_jobs == 0)
		return 0;
	const size_t jb = sizeof *jobs * n_jobs, vb = sizeof *views * n_views;
	kvt_gpu_index_job *dj = y->jobs;
	kvt_gpu_index_view *dv = (kvt_gpu_index_view *)((char *)y->jobs + up(jb));
	KVT_RETURN_IF(up(jb) + vb > b->jobs_bytes, c, -EINVAL, "%u index jobs exceed the job area",
		      n_jobs);
	LAUNCH(c, kvt_gpu_upload(dj, jobs, jb, stream));
	LAUNCH(c, kvt_gpu_upload(dv, views, vb, stream));
	void *on = stream;
	if (low_priority) {
		CU(c, cudaEventRecord(b->ready, (cudaStream_t)stream));
		CU(c, cudaStreamWaitEvent(b->idx, b->ready, 0));
		on = b->idx;
	}
	struct tset *t = timing(c, on, T_INDEX);
	mark(t, 0, on);
	LAUNCH(c, kvt_gpu_index_build(c->d, c->cfg.dtype, c->cfg.n_kv_heads,
				      b->rot + (size_t)layer * c->d * c->d, n_jobs, dj, max_n, dv,
				      b->err, on));
	mark(t, 1, on);
	if (low_priority) {
		CU(c, cudaEventRecord(y->indexed, b->idx));
		y->pending = true;
	}
	return 0;
}

/* ---- prefill and append ------------------------------------------------------------------ */

static int cu_prefill(kvt_cache *c, struct kvt_layer *l, uint32_t layer, const void *q,
		      const void *k, const void *v, uint32_t n, void *stream)
{
	struct gbe *b = BE(c);
	struct gl *g;
	const uint32_t S = c->cfg.n_sink, H = c->cfg.n_kv_heads, d = c->d;
	const size_t tok_bytes = (size_t)H * d * c->elem;
	uint32_t first = l->n_tokens, total = first + n, ni0 = l->n_indexed;
	uint32_t target = kvt_prefill_target(c, total);
	target = target > ni0 ? target : ni0;
	/* index positions [ni0, r1) come from the ring, [c0, target) from this chunk */
	const uint32_t r1 = first > S ? (first - S < target ? first - S : target) : 0;
	const uint32_t c0 = (first > S ? first : S) - S;
	const uint32_t from_chunk = target > c0 ? target - c0 : 0;
	KVT_TRY(enter(c));
	KVT_TRY(gl_get(c, l, &g));
	KVT_TRY(gl_reserve(c, l, g, layer, target, stream));
	if (from_chunk) {
		if (b->staging_pending)
			CU(c, cudaStreamWaitEvent((cudaStream_t)stream, b->staging_ev, 0));
		KVT_TRY(grow(c, &b->staging, &b->staging_bytes, tok_bytes * from_chunk, stream,
			     "prefill staging"));
	}
	KVT_TRY(kvt_layers_grow_rows(c, 1, &l, &total));
	KVT_TRY(blk_sync(c, l, g, stream));
	KVT_TRY(wait_index(c, layer, stream));
	cudaStream_t s = (cudaStream_t)stream;
	if (!l->centroids)
		LAUNCH(c, kvt_gpu_centroids(d, c->cfg.dtype, H, c->group, k, (uint64_t)H * d, d, q, n,
					    g->cent, g->cent + (size_t)H * d, stream));
	/* the old window's tokens first (the store below overwrites ring slots) */
	kvt_gpu_index_job jobs[3];
	kvt_gpu_index_view view = view_of(g);
	uint32_t nr = ring_jobs(c, g, 0, ni0, r1, jobs);
	KVT_TRY(index_jobs(c, layer, nr, jobs, 1, &view, c->cfg.window + 2 * c->cfg.flush_batch,
			   stream, false));
	if (from_chunk) {
		const size_t t0 = (size_t)c0 + S - first;
		CU(c, cudaMemcpyAsync(b->staging, (const char *)k + t0 * tok_bytes,
				      from_chunk * tok_bytes, cudaMemcpyDeviceToDevice, s));
	}
	kvt_gpu_store_job sj = {k, v, (void *const *)g->blk, g->ring, (uint64_t)H * d, g->blk_cap,
				g->wcap, first, n, S + target, S};
	struct tset *ts = timing(c, stream, T_STORE);
	mark(ts, 0, stream);
	LAUNCH(c, kvt_gpu_store_rows(d, H, 1, &sj, n, b->err, stream));
	mark(ts, 1, stream);
	if (from_chunk) {
		/* the chunk's keys from staging, on the low-priority stream; the layer's next call
		 * waits for it on the device */
		jobs[0] = (kvt_gpu_index_job){b->staging, (uint64_t)H * d, d, g->cent,
					      g->cent + (size_t)H * d, 0, c0, from_chunk, 0};
		KVT_TRY(index_jobs(c, layer, 1, jobs, 1, &view, from_chunk, stream, true));
		CU(c, cudaEventRecord(b->staging_ev, b->idx));
		b->staging_pending = true;
	}
	KVT_TRY(err_copy(c, stream));
	l->centroids = true;
	l->n_tokens = total;
	c->st.tokens += n;
	c->st.tokens_indexed += target - ni0;
	l->n_indexed = target;
	l->sel_epoch = 0;
	return 0;
}

static int cu_append(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		     const void *k, const void *v, void *stream)
{
	struct gbe *b = BE(c);
	const uint32_t W = c->cfg.window, B = c->cfg.flush_batch, H = c->cfg.n_kv_heads, d = c->d;
	const uint32_t S = c->cfg.n_sink;
	uint32_t *total = c->batch_tokens;
	KVT_TRY(enter(c));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		struct gl *g;
		total[i] = l->n_tokens + 1;
		uint32_t win = total[i] - kvt_sinks_of(c, total[i]) - l->n_indexed;
		KVT_TRY(gl_get(c, l, &g));
		KVT_TRY(gl_reserve(c, l, g, layer, l->n_indexed + (win >= W + B ? B : 0), stream));
	}
	KVT_TRY(kvt_layers_grow_rows(c, n_seqs, ls, total));
	for (uint32_t i = 0; i < n_seqs; i++)
		KVT_TRY(blk_sync(c, ls[i], ls[i]->dev, stream));
	KVT_TRY(wait_index(c, layer, stream));
	kvt_gpu_store_job *sj = b->host;
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct gl *g = ls[i]->dev;
		const size_t at = (size_t)i * H * d * c->elem;
		sj[i] = (kvt_gpu_store_job){(const char *)k + at, (const char *)v + at,
					    (void *const *)g->blk, g->ring, (uint64_t)H * d, g->blk_cap,
					    g->wcap, ls[i]->n_tokens, 1, S, S};
	}
	struct tset *ts = timing(c, stream, T_STORE);
	mark(ts, 0, stream);
	LAUNCH(c, kvt_gpu_store_rows(d, H, n_seqs, sj, 1, b->err, stream));
	mark(ts, 1, stream);
	/* lazy flushes: the oldest B window tokens of each full window join the index */
	kvt_gpu_index_job *jobs = b->host;
	kvt_gpu_index_view *views = (kvt_gpu_index_view *)(jobs + 2 * n_seqs);
	uint32_t nj = 0, nv = 0;
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		struct gl *g = l->dev;
		if (total[i] - kvt_sinks_of(c, total[i]) - l->n_indexed < W + B)
			continue;
		if (!l->centroids)
			LAUNCH(c, kvt_gpu_centroids(d, c->cfg.dtype, H, c->group, g->ring,
						    c->row_bytes / c->elem,
						    (uint64_t)g->wcap * (c->row_bytes / c->elem), NULL,
						    B, g->cent, g->cent + (size_t)H * d, stream));
		views[nv] = view_of(g);
		nj += ring_jobs(c, g, nv++, l->n_indexed, l->n_indexed + B, jobs + nj);
	}
	KVT_TRY(index_jobs(c, layer, nj, jobs, nv, views, B, stream, true));
	KVT_TRY(err_copy(c, stream));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		l->n_tokens = total[i];
		c->st.tokens++;
		l->sel_epoch = 0;
		if (total[i] - kvt_sinks_of(c, total[i]) - l->n_indexed < W + B)
			continue;
		l->centroids = true;
		l->n_indexed += B;
		c->st.tokens_indexed += B;
		c->st.flushes++;
	}
	return 0;
}

/* Restore the sequence that owns layer state l from the NVMe tier. */
static int restore_of(kvt_cache *c, const struct kvt_layer *l)
{
	for (uint32_t s = 0; s < c->cfg.max_seqs; s++)
		if (c->seqs[s].open && c->seqs[s].uid == l->seq_uid) {
			int64_t rc = kvt_tier_restore(c, &c->seqs[s], s);
			return rc < 0 ? (int)rc : 0;
		}
	return kvt_seterr(c, -ENOENT, "no open sequence owns a layer of the batch");
}

/* Make every sequence of the batch host-resident, with current block tables on the device: the
 * kernels read the host tier only, so a spilled sequence is restored first. */
static int resident(kvt_cache *c, uint32_t n_seqs, struct kvt_layer *const *ls, void *stream)
{
	bool restored = false;
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct gl *g;
		KVT_TRY(gl_get(c, ls[i], &g));
		KVT_TRY(blk_sync(c, ls[i], g, stream));
		if (g->spilled) {
			KVT_TRY(no_capture(c, stream, "restoring a spilled sequence"));
			KVT_TRY(restore_of(c, ls[i]));
			KVT_TRY(blk_sync(c, ls[i], g, stream));
			restored = true;
		}
	}
	/* a restore may have spilled another sequence of the batch to make room */
	for (uint32_t i = 0; restored && i < n_seqs; i++) {
		KVT_TRY(blk_sync(c, ls[i], ls[i]->dev, stream));
		KVT_RETURN_IF(((struct gl *)ls[i]->dev)->spilled, c, -ENOSPC,
			      "seqs[%u] and other sequences of the batch cannot all be in the host tier "
			      "at once (host_bytes = %llu): a smaller batch or more host memory",
			      i, (unsigned long long)c->cfg.host_bytes);
	}
	return 0;
}

static int cu_quiesce(kvt_cache *c)
{
	CU(c, cudaDeviceSynchronize());
	return 0;
}

/* ---- a decode step ----------------------------------------------------------------------- */

/* Rows of the longest (sequence, KV head) item the batch may attend, and the largest index. */
static void bounds(const kvt_cache *c, uint32_t n_seqs, struct kvt_layer *const *ls, bool at_sel,
		   uint32_t *max_ni, uint32_t *max_rows)
{
	const uint64_t bmax = c->cfg.budget_max;
	*max_ni = *max_rows = 0;
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		uint32_t nt = at_sel ? l->sel_tokens : l->n_tokens;
		uint32_t ni = at_sel ? l->sel_indexed : l->n_indexed;
		uint64_t sel = ni;
		if (bmax && (uint64_t)c->group * bmax < sel)
			sel = (uint64_t)c->group * bmax;
		uint32_t rows = nt - ni + (uint32_t)sel; /* sinks + window + selected */
		*max_ni = ni > *max_ni ? ni : *max_ni;
		*max_rows = rows > *max_rows ? rows : *max_rows;
	}
}

/* Make room for a step's scratch and its selection, and upload its descriptors. */
static int step_setup(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		      bool at_sel, void *stream, struct step *s, uint32_t *max_ni, uint32_t *max_rows)
{
	struct gbe *b = BE(c);
	struct glay *y = &b->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads;
	bounds(c, n_seqs, ls, at_sel, max_ni, max_rows);
	KVT_RETURN_IF(*max_ni > KVT_GPU_SELECT_MAX_N, c, -E2BIG,
		      "a sequence has %u indexed tokens on layer %u; the CUDA backend selects among at "
		      "most %u",
		      *max_ni, layer, KVT_GPU_SELECT_MAX_N);
	const uint32_t ld = (*max_ni + 3) & ~3u;
	*s = carve(c, NULL, n_seqs, ld ? ld : 4, *max_rows ? *max_rows : 1);
	KVT_TRY(grow(c, &b->arena, &b->arena_bytes, s->bytes, stream, "step scratch"));
	*s = carve(c, b->arena, n_seqs, ld ? ld : 4, *max_rows ? *max_rows : 1);
	if (!at_sel) {
		size_t need = sizeof(uint32_t) * n_seqs * H * ((size_t)(ld ? ld : 4) + 1);
		KVT_TRY(grow(c, (void **)&y->sel, &y->sel_bytes, need, stream, "the selection"));
		y->sel_ld = ld ? ld : 4;
		y->sel_n = y->sel + (size_t)n_seqs * H * y->sel_ld;
	}
	/* descriptors, in host scratch laid out as on the device */
	char *h = b->host;
	kvt_gpu_index_view *views = (kvt_gpu_index_view *)h;
	uint32_t *ntok = (uint32_t *)(h + ((char *)s->ntok - (char *)s->views));
	const float **cq = (const float **)(h + ((char *)s->cq - (char *)s->views));
	const float **ck = (const float **)(h + ((char *)s->ck - (char *)s->views));
	kvt_gpu_fetch_seq *f = (kvt_gpu_fetch_seq *)(h + ((char *)s->fetch - (char *)s->views));
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct kvt_layer *l = ls[i];
		const struct gl *g = l->dev;
		uint32_t nt = at_sel ? l->sel_tokens : l->n_tokens;
		uint32_t ni = at_sel ? l->sel_indexed : l->n_indexed;
		views[i] = view_of(g);
		ntok[i] = ni;
		ck[i] = g->cent;
		cq[i] = g->cent + (size_t)H * c->d;
		uint32_t slot = at_sel ? g->sel_slot : i;
		f[i] = (kvt_gpu_fetch_seq){(void *const *)g->blk,
					   y->sel + (size_t)slot * H * y->sel_ld,
					   y->sel_n + (size_t)slot * H,
					   g->ring,
					   l->seq_uid,
					   y->sel_ld,
					   g->blk_cap,
					   g->wcap,
					   kvt_sinks_of(c, nt),
					   ni,
					   nt,
					   0};
	}
	LAUNCH(c, kvt_gpu_upload(s->views, h, s->desc_bytes, stream));
	return 0;
}

static int cu_attend(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		     const void *q, void *out, void *stream)
{
	struct gbe *b = BE(c);
	struct glay *y = &b->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads, Hq = c->cfg.n_q_heads, d = c->d;
	cudaStream_t cs = (cudaStream_t)stream;
	KVT_TRY(enter(c));
	KVT_TRY(resident(c, n_seqs, ls, stream));
	/* the layer's selection buffer is regrown or rewritten from here: no earlier selection in it
	 * stays readable, and a failure below leaves none half made */
	y->stamp = ++b->stamp;
	for (uint32_t i = 0; i < n_seqs; i++)
		ls[i]->sel_epoch = 0;
	struct step s;
	uint32_t max_ni, max_rows;
	KVT_TRY(step_setup(c, layer, n_seqs, ls, false, stream, &s, &max_ni, &max_rows));
	KVT_TRY(wait_index(c, layer, stream));
	const size_t ld = y->sel_ld;
	struct tset *t = timing(c, stream, T_STEP);
	mark(t, 0, stream);
	if (max_ni) {
		LAUNCH(c, kvt_gpu_query_prepare(d, c->cfg.dtype, n_seqs, Hq, H,
						b->rot + (size_t)layer * d * d, q, s.cq, s.ck, s.qc,
						stream));
		LAUNCH(c, kvt_gpu_score(d, n_seqs, Hq, H, s.qc, s.views, s.ntok, max_ni, s.scores,
					ld, b->err, stream));
		mark(t, 1, stream);
		LAUNCH(c, kvt_gpu_topp_threshold(n_seqs, Hq, s.scores, ld, s.ntok, max_ni, c->scale,
						 c->cfg.p, c->cfg.budget_min, c->cfg.budget_max,
						 s.topp, s.sscratch, s.sbytes, b->err, stream));
		LAUNCH(c, kvt_gpu_topp_union(n_seqs, Hq, H, s.scores, ld, s.ntok, max_ni, s.topp,
					     y->sel, ld, y->sel_n, s.sscratch, s.sbytes, stream));
	} else {
		mark(t, 1, stream);
		CU(c, cudaMemsetAsync(y->sel_n, 0, sizeof(uint32_t) * n_seqs * H, cs));
	}
	mark(t, 2, stream);
	if (out) {
		kvt_gpu_hot hot = y->hot;
		hot.counters = b->counters + (size_t)layer * KVT_GPU_CNT_N;
		LAUNCH(c, kvt_gpu_fetch((uint32_t)c->row_bytes, n_seqs, H, s.fetch, hot, ++y->epoch,
					s.rows, s.items, max_rows, NULL, b->err, stream));
		LAUNCH(c, kvt_gpu_attend(d, c->cfg.dtype, c->cfg.out_dtype, n_seqs, Hq, H, c->scale,
					 q, s.items, max_rows, out, s.ascratch, s.abytes, b->err,
					 stream));
	}
	mark(t, 3, stream);
	KVT_TRY(err_copy(c, stream));
	for (uint32_t i = 0; i < n_seqs; i++) {
		struct kvt_layer *l = ls[i];
		struct gl *g = l->dev;
		l->sel_epoch = ++c->clock;
		l->sel_tokens = l->n_tokens;
		l->sel_indexed = l->n_indexed;
		g->sel_stamp = y->stamp;
		g->sel_slot = i;
		c->st.steps++;
		c->st.candidate_tokens += (uint64_t)l->n_indexed * H;
	}
	y->steps += n_seqs;
	if (out)
		return 0;
	/* kvt_select: the caller needs the largest count now */
	uint32_t *sel_n = b->host;
	CU(c, cudaMemcpyAsync(sel_n, y->sel_n, sizeof(uint32_t) * n_seqs * H,
			      cudaMemcpyDeviceToHost, cs));
	CU(c, cudaStreamSynchronize(cs));
	int rc = check_err(c);
	if (rc < 0) {
		for (uint32_t i = 0; i < n_seqs; i++)
			ls[i]->sel_epoch = 0;
		return rc;
	}
	uint32_t most = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			const struct kvt_layer *l = ls[i];
			uint32_t m = sel_n[(size_t)i * H + h];
			uint32_t n = kvt_sinks_of(c, l->n_tokens) + m + kvt_window_count(c, l);
			most = n > most ? n : most;
			y->selected += m;
		}
	return (int)most;
}

static int cu_gather(kvt_cache *c, uint32_t layer, uint32_t n_seqs, struct kvt_layer *const *ls,
		     uint32_t max_tokens, int32_t *counts, int32_t *pos, void *k_out, void *v_out,
		     void *stream)
{
	struct gbe *b = BE(c);
	struct glay *y = &b->lay[layer];
	const uint32_t H = c->cfg.n_kv_heads;
	cudaStream_t cs = (cudaStream_t)stream;
	KVT_TRY(enter(c));
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct gl *g = ls[i]->dev;
		KVT_RETURN_IF(!g || g->sel_stamp != y->stamp, c, -EINVAL,
			      "seqs[%u]: its selection on layer %u was replaced by a later "
			      "kvt_select or kvt_attend of another batch on that layer",
			      i, layer);
	}
	/* a sequence spilled since its selection is brought back (its rows, not its selection,
	 * moved), and the block tables are current */
	KVT_TRY(resident(c, n_seqs, ls, stream));
	/* counts first: nothing is written when one exceeds max_tokens */
	uint32_t *sel_n = b->host;
	for (uint32_t i = 0; i < n_seqs; i++)
		CU(c, cudaMemcpyAsync(sel_n + (size_t)i * H,
				      y->sel_n + (size_t)((struct gl *)ls[i]->dev)->sel_slot * H,
				      sizeof(uint32_t) * H, cudaMemcpyDeviceToHost, cs));
	CU(c, cudaStreamSynchronize(cs));
	KVT_TRY(enter(c));
	/* sel_n becomes each item's count (sinks + selected + window); counts is written only once
	 * every one fits */
	uint64_t total = 0;
	for (uint32_t i = 0; i < n_seqs; i++)
		for (uint32_t h = 0; h < H; h++) {
			const struct kvt_layer *l = ls[i];
			uint32_t *n = &sel_n[(size_t)i * H + h];
			*n += l->sel_tokens - l->sel_indexed; /* sinks and window */
			KVT_RETURN_IF(*n > max_tokens, c, -EINVAL,
				      "max_tokens = %u is smaller than the %u tokens selected for "
				      "seqs[%u], KV head %u",
				      max_tokens, *n, i, h);
			total += *n;
		}
	for (size_t i = 0; i < (size_t)n_seqs * H; i++)
		counts[i] = (int32_t)sel_n[i];
	if (!pos && !k_out)
		return (int)total;
	struct step s;
	uint32_t max_ni, max_rows;
	KVT_TRY(step_setup(c, layer, n_seqs, ls, true, stream, &s, &max_ni, &max_rows));
	kvt_gpu_hot hot = y->hot;
	hot.counters = b->counters + (size_t)layer * KVT_GPU_CNT_N;
	hot.flags = KVT_GPU_HOT_NO_STEP; /* the selection was counted when it was made */
	LAUNCH(c, kvt_gpu_fetch((uint32_t)c->row_bytes, n_seqs, H, s.fetch, hot, ++y->epoch, s.rows,
				s.items, max_rows, s.pos, b->err, stream));
	LAUNCH(c, kvt_gpu_rows_copy(c->d, n_seqs * H, s.items, max_rows, s.pos, k_out, v_out, pos,
				    max_tokens, stream));
	KVT_TRY(err_copy(c, stream));
	return (int)total;
}

/* ---- stats, set-up and tear-down --------------------------------------------------------- */

static int cu_stats(kvt_cache *c, int layer, kvt_layer_stats *out)
{
	struct gbe *b = BE(c);
	const uint32_t L = c->cfg.n_layers;
	KVT_TRY(enter(c));
	CU(c, cudaDeviceSynchronize());
	CU(c, cudaMemcpy(b->cnt_host, b->counters, sizeof(unsigned long long) * L * KVT_GPU_CNT_N,
			 cudaMemcpyDeviceToHost));
	for (uint32_t i = 0; i < TIMING_SETS; i++)
		harvest(c, &b->t[i]);
	if (layer >= 0) {
		const unsigned long long *k = b->cnt_host + (size_t)layer * KVT_GPU_CNT_N;
		const struct glay *y = &b->lay[layer];
		out->steps = y->steps;
		out->hot_hits = k[KVT_GPU_CNT_HITS];
		out->hot_misses = k[KVT_GPU_CNT_MISSES];
		out->pcie_bytes = k[KVT_GPU_CNT_PCIE];
		out->selected_tokens = k[KVT_GPU_CNT_SELECTED] + y->selected;
		out->rows_attended = k[KVT_GPU_CNT_ROWS];
		out->hot_rows = (uint64_t)y->hot.sets * KVT_GPU_HOT_WAYS;
		return check_err(c);
	}
	uint64_t hits = 0, misses = 0, bytes = 0, sel = 0;
	for (uint32_t i = 0; i < L; i++) {
		const unsigned long long *k = b->cnt_host + (size_t)i * KVT_GPU_CNT_N;
		hits += k[KVT_GPU_CNT_HITS];
		misses += k[KVT_GPU_CNT_MISSES];
		bytes += k[KVT_GPU_CNT_PCIE];
		sel += k[KVT_GPU_CNT_SELECTED] + b->lay[i].selected;
	}
	c->st.hot_hits = hits;
	c->st.hot_misses = misses;
	c->st.pcie_bytes = bytes;
	c->st.rows_fetched = misses;
	c->st.bytes_fetched = bytes;
	c->st.selected_tokens = sel;
	return check_err(c);
}

static void cu_fini(kvt_cache *c)
{
	struct gbe *b = BE(c);
	if (!b)
		return;
	cudaDeviceSynchronize();
	for (uint32_t i = 0; b->lay && i < c->cfg.n_layers; i++) {
		struct glay *y = &b->lay[i];
		if (y->indexed)
			cudaEventDestroy(y->indexed);
		dfree(y->sel);
		dfree(y->jobs);
	}
	kvt_mem_free(KVT_MEM_HOST, b->lay, 0);
	for (uint32_t i = 0; i < TIMING_SETS; i++)
		for (int e = 0; e < 4; e++)
			if (b->t[i].ev[e])
				cudaEventDestroy(b->t[i].ev[e]);
	if (b->idx)
		cudaStreamDestroy(b->idx);
	if (b->staging_ev)
		cudaEventDestroy(b->staging_ev);
	if (b->ready)
		cudaEventDestroy(b->ready);
	if (b->err_host)
		cudaFreeHost(b->err_host);
	dfree(b->rot);
	dfree(b->err);
	dfree(b->counters);
	dfree(b->arena);
	dfree(b->staging);
	dfree(b->hot_mem);
	kvt_mem_free(KVT_MEM_HOST, b->cnt_host, 0);
	kvt_mem_free(KVT_MEM_HOST, b->host, 0);
	kvt_mem_free(KVT_MEM_HOST, b, 0);
	c->be = NULL;
}

static int cu_init_inner(kvt_cache *c, struct gbe *b)
{
	const uint32_t L = c->cfg.n_layers, H = c->cfg.n_kv_heads, M = c->cfg.max_seqs;
	int attr = 0;
	CU(c, cudaSetDevice(c->cfg.device));
	CU(c, cudaDeviceGetAttribute(&attr, cudaDevAttrCanUseHostPointerForRegisteredMem,
				     c->cfg.device));
	KVT_RETURN_IF(!attr, c, -EOPNOTSUPP,
		      "device %d cannot use host pointers of registered memory: the zero-copy "
		      "host tier needs it",
		      c->cfg.device);
	KVT_RETURN_IF(c->group > KVT_GPU_MAX_GROUP, c, -EOPNOTSUPP,
		      "n_q_heads / n_kv_heads = %u, the CUDA backend serves at most %u", c->group,
		      KVT_GPU_MAX_GROUP);
	KVT_RETURN_IF((uint64_t)M * c->cfg.n_q_heads > 65535, c, -EOPNOTSUPP,
		      "max_seqs * n_q_heads = %llu, the CUDA backend serves at most 65535",
		      (unsigned long long)M * c->cfg.n_q_heads);
	int lo = 0, hi = 0;
	CU(c, cudaDeviceGetStreamPriorityRange(&lo, &hi));
	CU(c, cudaStreamCreateWithPriority(&b->idx, cudaStreamNonBlocking, lo));
	CU(c, cudaEventCreateWithFlags(&b->staging_ev, cudaEventDisableTiming));
	CU(c, cudaEventCreateWithFlags(&b->ready, cudaEventDisableTiming));
	for (uint32_t i = 0; i < TIMING_SETS; i++)
		for (int e = 0; e < 4; e++)
			CU(c, cudaEventCreate(&b->t[i].ev[e]));
	CU(c, cudaHostAlloc((void **)&b->err_host, sizeof *b->err_host, cudaHostAllocDefault));
	*b->err_host = 0;
	const size_t rot = sizeof(float) * L * c->d * c->d;
	KVT_TRY(dalloc(c, (void **)&b->rot, rot, "the rotations"));
	CU(c, cudaMemcpy(b->rot, c->rot, rot, cudaMemcpyHostToDevice));
	KVT_TRY(dalloc(c, (void **)&b->err, sizeof *b->err, "the error word"));
	const size_t cnt = sizeof(unsigned long long) * L * KVT_GPU_CNT_N;
	KVT_TRY(dalloc(c, (void **)&b->counters, cnt, "the counters"));
	b->cnt_host = kvt_mem_alloc(KVT_MEM_HOST, cnt);
	/* host scratch: the largest of a step's descriptors, append's store jobs and index jobs */
	struct step s = carve(c, NULL, M, 4, 1);
	size_t host = s.desc_bytes;
	size_t jobs = sizeof(kvt_gpu_store_job) * M;
	host = host > jobs ? host : jobs;
	jobs = sizeof(kvt_gpu_index_job) * 2 * M + sizeof(kvt_gpu_index_view) * M;
	host = host > jobs ? host : jobs;
	host = host > sizeof(uint32_t) * M * H ? host : sizeof(uint32_t) * M * H;
	b->host = kvt_mem_alloc(KVT_MEM_HOST, host);
	b->lay = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b->lay * L);
	KVT_RETURN_IF(!b->cnt_host || !b->host || !b->lay, c, -ENOMEM,
		      "out of memory for the CUDA backend's host state");
	b->jobs_bytes = up(sizeof(kvt_gpu_index_job) * (2 * M + 2)) +
			sizeof(kvt_gpu_index_view) * (M + 1);
	/* the hot caches: one allocation, split evenly over the layers */
	const size_t way = c->row_bytes + 2 * sizeof(unsigned long long) + sizeof(uint32_t);
	const uint64_t sets = c->cfg.gpu_cache_bytes / L / (way * KVT_GPU_HOT_WAYS);
	const uint64_t slots = sets * KVT_GPU_HOT_WAYS;
	if (sets) {
		b->hot_bytes = (size_t)(slots * way * L);
		KVT_TRY(dalloc(c, &b->hot_mem, b->hot_bytes, "the hot-token cache"));
	}
	char *hm = b->hot_mem;
	for (uint32_t i = 0; i < L; i++) {
		struct glay *y = &b->lay[i];
		CU(c, cudaEventCreateWithFlags(&y->indexed, cudaEventDisableTiming));
		KVT_TRY(dalloc(c, &y->jobs, b->jobs_bytes, "index jobs"));
		if (sets) {
			y->hot.sets = (uint32_t)sets;
			y->hot.tag_hi = (unsigned long long *)hm;
			y->hot.tag_lo = y->hot.tag_hi + slots;
			y->hot.rows = y->hot.tag_lo + slots;
			y->hot.last_use = (uint32_t *)((char *)y->hot.rows + slots * c->row_bytes);
			hm += slots * way;
		}
	}
	return 0;
}

static int cu_init(kvt_cache *c)
{
	/* on failure the cache's teardown calls cu_fini, which takes what was made */
	struct gbe *b = kvt_mem_alloc(KVT_MEM_HOST, sizeof *b);
	KVT_RETURN_IF(!b, c, -ENOMEM, "out of memory for the CUDA backend");
	c->be = b;
	return cu_init_inner(c, b);
}

static int cu_probe(kvt_cache *c)
{
	(void)c;
	return 0;
}

static const struct kvt_backend_ops ops = {
	.name = "cuda",
	.probe = cu_probe,
	.init = cu_init,
	.fini = cu_fini,
	.layer_fini = cu_layer_fini,
	.prefill = cu_prefill,
	.append = cu_append,
	.attend = cu_attend,
	.gather = cu_gather,
	.stats = cu_stats,
	.quiesce = cu_quiesce,
};

const struct kvt_backend_ops *const kvt_cuda_backend_ops = &ops;
