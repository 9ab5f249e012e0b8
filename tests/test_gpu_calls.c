/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's calls around the decode step, through the public interface, against the CPU
 * backend or the dense call (gpu_pair.h):
 * - lifecycle: a sequence that decoded drafted tokens (two flushes) and was truncated back attends
 *   bit for bit like a fresh one fed only the kept tokens, decoding on (the window ring refilled
 *   from the host tier); a fork attends like its parent, then like a fresh sequence fed its own
 *   tokens while the parent decodes others (the mirror copied on the device); read_rows gives the
 *   rows written;
 * - strided: the _at calls with strided q, k, v and out in three layouts (and one sequence) give
 *   the CPU's dense results and the dense call's bit for bit, writing nothing outside out's rows;
 * - unsupported: what the CUDA backend refuses (score corrections, keep_steps > 1, graphs with
 *   keep_weight) is refused with -EOPNOTSUPP;
 * - extend: kvt_extend's exact attention against the CPU backend's, in one range and in many, and
 *   under allocation faults (each changes nothing); with Top-p per query row, against the CPU's;
 * - rescore: the second selection stage against the CPU's.
 * Exits 77 (skipped) when no CUDA device is present.
 */
#include "gpu_pair.h"

/* Append token pos of workload sequence `src` to seq s of the GPU cache on every layer; the query of
 * the last layer stays in dq. */
static void gpu_append(struct pair *p, uint32_t s, uint32_t src, uint32_t pos)
{
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		make(p, src, layer, pos, 1, (int32_t)pos);
		upload(p, 1);
		OK(p->gpu, kvt_append(p->gpu, layer, 1, &s, p->dk, p->dv, NULL));
	}
}

/* Seqs a and b of the GPU cache attend the query in dq on every layer bit for bit alike. */
static void gpu_same(struct pair *p, uint32_t a, uint32_t b, const char *what, uint32_t step)
{
	const size_t ob = sizeof(float) * HQ * D;
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		OK(p->gpu, kvt_attend(p->gpu, layer, 1, &a, p->dq, p->dout, NULL));
		CU(cudaMemcpy(p->out_c, p->dout, ob, cudaMemcpyDeviceToHost));
		OK(p->gpu, kvt_attend(p->gpu, layer, 1, &b, p->dq, p->dout, NULL));
		CU(cudaMemcpy(p->out_g, p->dout, ob, cudaMemcpyDeviceToHost));
		T_CHECK(!memcmp(p->out_c, p->out_g, ob), "%s, step %u, layer %u: seq %u attends "
			"differently from seq %u (first output %.9g, wanted %.9g)", what, step, layer, a, b,
			p->out_c[0], p->out_g[0]);
	}
}

static void test_lifecycle(void **state)
{
	(void)state;
	struct pair p;
	const uint32_t ctx = 1024, cut = ctx / 3;
	pair_init(&p, ctx, 96, 64u << 20);
	const uint32_t a = p.sg[0];
	uint32_t b, kid;
	/* b: sequence 0's tokens again, in the same two chunks */
	OK(p.gpu, kvt_seq_open(p.gpu, &b));
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		const uint32_t from[2] = {0, cut}, n[2] = {cut, ctx - cut};
		for (int part = 0; part < 2; part++) {
			make(&p, 0, layer, from[part], n[part], -1);
			upload(&p, n[part]);
			OK(p.gpu, kvt_prefill(p.gpu, b, layer, p.dq, p.dk, p.dv, n[part], NULL));
		}
	}
	/* a drafts 40 tokens of another sequence (window 32, flush batch 16: two flushes), drops them */
	for (uint32_t t = 0; t < 40; t++)
		gpu_append(&p, a, 1, ctx + t);
	OK(p.gpu, kvt_seq_truncate(p.gpu, a, 40, NULL));
	for (uint32_t t = 0; t < 24; t++) {
		gpu_append(&p, a, 0, ctx + t);
		gpu_append(&p, b, 0, ctx + t);
		gpu_same(&p, a, b, "truncated against fresh", t);
	}
	/* the fork attends as its parent; then it takes sequence 0's tokens on (like b), the parent
	 * sequence 1's */
	OK(p.gpu, kvt_seq_fork(p.gpu, a, &kid, NULL));
	gpu_same(&p, kid, a, "fork against parent", 0);
	for (uint32_t t = 24; t < 60; t++) {
		gpu_append(&p, a, 1, ctx + t);
		gpu_append(&p, kid, 0, ctx + t);
		gpu_append(&p, b, 0, ctx + t);
		gpu_same(&p, kid, b, "fork against fresh", t);
	}
	OK(p.gpu, kvt_seq_close(p.gpu, a));
	gpu_same(&p, kid, b, "fork after its parent closed", 60);
	/* rows [0, ctx) of b back, dense [ctx][HKV][D] */
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		int rc = kvt_seq_read_rows(p.gpu, b, layer, 0, ctx, p.dk, p.dv, NULL);
		T_CHECK(rc == (int)ctx, "read_rows layer %u: %d (%s)", layer, rc, kvt_last_error(p.gpu));
		CU(cudaMemcpy(p.hk, p.dk, (size_t)ctx * HKV * D * 2, cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(p.hv, p.dv, (size_t)ctx * HKV * D * 2, cudaMemcpyDeviceToHost));
		for (uint32_t t = 0; t < ctx; t++)
			for (uint32_t h = 0; h < HKV; h++) {
				const size_t at = ((size_t)t * HKV + h) * D;
				T_CHECK(!memcmp(p.hk + at, p.rows_k + row_at(&p, layer, 0, h, t), D * 2) &&
					!memcmp(p.hv + at, p.rows_v + row_at(&p, layer, 0, h, t), D * 2),
					"read_rows layer %u token %u head %u differs from the row written",
					layer, t, h);
			}
	}
	pair_fini(&p);
}

/*
 * What the CUDA backend does not offer yet is refused by name and changes nothing: score
 * corrections at create, a strided kvt_io_layout, kvt_extend with or without Top-p; a dense
 * kvt_io_layout runs as the plain call, bit for bit.
 */
/* A strided view of the fp16 rows [n][heads][D] of dense host memory h: token t, head j at element
 * t * ts + j * hs of a device buffer of `elems` elements, everything else poisoned. */
static void *view_of(const uint16_t *h, uint32_t n, uint32_t heads, uint64_t ts, uint64_t hs,
		     size_t elems)
{
	uint16_t *d = NULL;
	CU(cudaMalloc((void **)&d, elems * 2));
	CU(cudaMemset(d, 0xff, elems * 2));
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t j = 0; j < heads; j++)
			CU(cudaMemcpy(d + t * ts + j * hs, h + ((size_t)t * heads + j) * D, D * 2,
				      cudaMemcpyHostToDevice));
	return d;
}

/* The rows of a strided float out view back into dense host memory; false when an element outside
 * the rows was written (the poison changed). */
static bool rows_of(const float *d, uint32_t n, uint32_t heads, uint64_t ts, uint64_t hs,
		    size_t elems, float *out)
{
	uint32_t *all = malloc(elems * 4);
	uint8_t *mine = calloc(elems, 1);
	CU(cudaMemcpy(all, d, elems * 4, cudaMemcpyDeviceToHost));
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t j = 0; j < heads; j++) {
			memcpy(out + ((size_t)t * heads + j) * D, all + t * ts + j * hs, D * 4);
			memset(mine + t * ts + j * hs, 1, D);
		}
	bool clean = true;
	for (size_t i = 0; i < elems; i++)
		clean &= mine[i] || all[i] == 0xffffffffu;
	free(all);
	free(mine);
	return clean;
}

/* One strided layout of a step's tensors: q/out and k/v views (elements), and their extents. */
struct lay {
	const char *name;
	uint64_t qts, qhs, kts, khs;
};

/*
 * Strided tensors on the CUDA backend, three layouts in turn (each takes another copy shape): rows
 * 2 D apart (head stride 2 D); head-major, as a [B, H, T, D] transpose (token stride D, head stride
 * n D); a fused qkv projection split three ways (token stride (HQ + 2 HKV) D, head stride D: a
 * token's heads contiguous). Appends and attends through kvt_append_at / kvt_attend_at give the
 * CPU's dense results, an attend gives bit for bit what the dense call gives, and nothing of the
 * out view outside its rows is written; then a one-sequence attend (n = 1).
 */
static void test_strided(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 1024, 6, 64u << 20);
	const uint32_t F = HQ + 2 * HKV;
	const struct lay lays[3] = {
		{"head stride 2D", 2 * HQ * D, 2 * D, 2 * HKV * D, 2 * D},
		{"head-major", D, NSEQ * D, D, NSEQ * D},
		{"fused qkv", (uint64_t)F * D, D, (uint64_t)F * D, D},
	};
	const size_t orows = (size_t)NSEQ * HQ, ob = sizeof(float) * orows * D;
	float *dense = malloc(ob);
	double worst = 0.0;
	for (uint32_t step = 0; step < 6; step++)
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			const struct lay *y = &lays[step % 3];
			kvt_io_layout lo = {.size = sizeof lo};
			lo.q = lo.out = (kvt_io_view){y->qts, y->qhs};
			lo.k = lo.v = (kvt_io_view){y->kts, y->khs};
			const size_t qe = (NSEQ - 1) * y->qts + (HQ - 1) * y->qhs + D,
				     ke = (NSEQ - 1) * y->kts + (HKV - 1) * y->khs + D;
			decode_inputs(&p, layer, step);
			void *sk = view_of(p.hk, NSEQ, HKV, y->kts, y->khs, ke);
			void *sv = view_of(p.hv, NSEQ, HKV, y->kts, y->khs, ke);
			void *sq = view_of(p.hq, NSEQ, HQ, y->qts, y->qhs, qe);
			float *so = NULL;
			CU(cudaMalloc((void **)&so, qe * 4));
			CU(cudaMemset(so, 0xff, qe * 4));
			OK(p.cpu, kvt_append(p.cpu, layer, NSEQ, p.sc, p.hk, p.hv, NULL));
			OK(p.gpu, kvt_append_at(p.gpu, layer, NSEQ, p.sg, sk, sv, &lo, NULL));
			OK(p.cpu, kvt_attend(p.cpu, layer, NSEQ, p.sc, p.hq, p.out_c, NULL));
			OK(p.gpu, kvt_attend_at(p.gpu, layer, NSEQ, p.sg, sq, so, &lo, NULL));
			T_CHECK(rows_of(so, NSEQ, HQ, y->qts, y->qhs, qe, p.out_g),
				"%s, step %u layer %u: out written outside its rows", y->name, step,
				layer);
			for (uint32_t hd = 0; hd < orows; hd++) {
				double num = 0, den = 0;
				for (uint32_t j = 0; j < D; j++) {
					const double x = p.out_c[hd * D + j], z = p.out_g[hd * D + j];
					num += (x - z) * (x - z);
					den += x * x;
				}
				const double rel = sqrt(num / (den > 0 ? den : 1));
				worst = rel > worst ? rel : worst;
				T_CHECK(rel <= 1e-3, "%s, step %u layer %u head %u: strided GPU vs dense "
					"CPU relative error %g", y->name, step, layer, hd, rel);
			}
			OK(p.gpu, kvt_attend(p.gpu, layer, NSEQ, p.sg, p.dq, p.dout, NULL));
			CU(cudaMemcpy(dense, p.dout, ob, cudaMemcpyDeviceToHost));
			T_CHECK(!memcmp(dense, p.out_g, ob), "%s, step %u layer %u: the strided "
				"attend's output differs from the dense one's", y->name, step, layer);
			cudaFree(sk);
			cudaFree(sv);
			cudaFree(sq);
			cudaFree(so);
		}
	/* one sequence (n = 1): its heads 2 D apart, copied as rows of one head */
	{
		const uint32_t a = p.sg[0];
		kvt_io_layout lo = {.size = sizeof lo};
		lo.q.head_stride = lo.out.head_stride = 2 * D;
		const size_t qe = (HQ - 1) * 2 * D + D, one = sizeof(float) * HQ * D;
		void *sq = view_of(p.hq, 1, HQ, 0, 2 * D, qe);
		float *so = NULL;
		CU(cudaMalloc((void **)&so, qe * 4));
		CU(cudaMemset(so, 0xff, qe * 4));
		OK(p.gpu, kvt_attend_at(p.gpu, 0, 1, &a, sq, so, &lo, NULL));
		T_CHECK(rows_of(so, 1, HQ, 0, 2 * D, qe, p.out_g), "n = 1: out written outside its rows");
		OK(p.gpu, kvt_attend(p.gpu, 0, 1, &a, p.dq, p.dout, NULL));
		CU(cudaMemcpy(dense, p.dout, one, cudaMemcpyDeviceToHost));
		T_CHECK(!memcmp(dense, p.out_g, one), "n = 1: the strided attend differs from the dense");
		cudaFree(sq);
		cudaFree(so);
	}
	printf("strided: 6 steps x %u layers in three layouts through kvt_append_at / "
	       "kvt_attend_at, then n = 1; worst error against the CPU %.3g\n", LAYERS, worst);
	free(dense);
	pair_fini(&p);
}

static void test_unsupported(void **state)
{
	(void)state;
	kvt_config cfg = config(64u << 20);
	cfg.backend = KVT_BACKEND_CUDA;
	cfg.correction_steps = 4;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	T_CHECK(rc == -EOPNOTSUPP && !c && strstr(kvt_last_error(NULL), "correction_steps"),
		"correction_steps on CUDA: got %d (%s), wanted -EOPNOTSUPP naming it", rc,
		kvt_last_error(NULL));
	/* keep_weight favors the last step's selection only; a captured step keeps none */
	cfg.correction_steps = 0;
	cfg.keep_weight = 8.0f;
	cfg.keep_steps = 2;
	rc = kvt_cache_create(&cfg, &c);
	T_CHECK(rc == -EOPNOTSUPP && !c && strstr(kvt_last_error(NULL), "keep_steps"),
		"keep_steps 2 on CUDA: got %d (%s), wanted -EOPNOTSUPP naming it", rc,
		kvt_last_error(NULL));
	cfg.keep_steps = 1;
	OK(NULL, kvt_cache_create(&cfg, &c));
	rc = kvt_graph_reserve(c, 2, 4096, NULL);
	T_CHECK(rc == -EOPNOTSUPP && strstr(kvt_last_error(c), "keep_weight"),
		"kvt_graph_reserve with keep_weight: got %d (%s), wanted -EOPNOTSUPP naming it", rc,
		kvt_last_error(c));
	kvt_cache_destroy(c);
	struct pair p;
	pair_init(&p, 512, 8, 64u << 20);
	const uint32_t a = p.sg[0];
	const size_t ob = sizeof(float) * HQ * D;
	make(&p, 0, 0, 512, 1, 0);
	upload(&p, 1);
	OK(p.gpu, kvt_attend(p.gpu, 0, 1, &a, p.dq, p.dout, NULL));
	CU(cudaMemcpy(p.out_c, p.dout, ob, cudaMemcpyDeviceToHost));
	kvt_io_layout dense = {.size = sizeof dense};
	OK(p.gpu, kvt_attend_at(p.gpu, 0, 1, &a, p.dq, p.dout, &dense, NULL));
	CU(cudaMemcpy(p.out_g, p.dout, ob, cudaMemcpyDeviceToHost));
	T_CHECK(!memcmp(p.out_c, p.out_g, ob), "a dense kvt_io_layout changed kvt_attend's output");
	pair_fini(&p);
}

/* extend.c's bound on its staging buffer (lowered to make many ranges) and the thresholds of its
 * overlapped ranges */
extern uint64_t gpu_extend_stage_bytes;
extern uint32_t gpu_extend_one_range, gpu_extend_overlap_q;

/* A batch of kvt_extend chunks of both sequences: host rows for the CPU cache, device copies for
 * the CUDA one, and both backends' outputs; room for `most` rows in all. */
struct chunk {
	uint16_t *q, *k, *v;
	float *oc, *og;
	void *dq, *dk, *dv, *dout;
	uint32_t cu[NSEQ + 1];
};

enum { QROW = HQ * D, KROW = HKV * D };

static void chunk_init(struct chunk *b, uint32_t most)
{
	b->q = malloc((size_t)most * QROW * 2);
	b->k = malloc((size_t)most * KROW * 2);
	b->v = malloc((size_t)most * KROW * 2);
	b->oc = malloc(sizeof(float) * most * QROW);
	b->og = malloc(sizeof(float) * most * QROW);
	T_CHECK(b->q && b->k && b->v && b->oc && b->og, "malloc");
	CU(cudaMalloc(&b->dq, (size_t)most * QROW * 2));
	CU(cudaMalloc(&b->dk, (size_t)most * KROW * 2));
	CU(cudaMalloc(&b->dv, (size_t)most * KROW * 2));
	CU(cudaMalloc(&b->dout, sizeof(float) * most * QROW));
}

static void chunk_fini(struct chunk *b)
{
	free(b->q);
	free(b->k);
	free(b->v);
	free(b->oc);
	free(b->og);
	cudaFree(b->dq);
	cudaFree(b->dk);
	cudaFree(b->dv);
	cudaFree(b->dout);
}

/* Workload sequence s's tokens [pos[s], pos[s] + n[s]) of `layer`, for each s in turn, into the
 * host rows and their device copies; b->cu their offsets. */
static void chunk_make(struct pair *p, struct chunk *b, uint32_t layer, const uint32_t *pos,
		       const uint32_t *n)
{
	b->cu[0] = 0;
	for (uint32_t s = 0; s < NSEQ; s++) {
		make(p, s, layer, pos[s], n[s], -1);
		memcpy(b->q + (size_t)b->cu[s] * QROW, p->hq, (size_t)n[s] * QROW * 2);
		memcpy(b->k + (size_t)b->cu[s] * KROW, p->hk, (size_t)n[s] * KROW * 2);
		memcpy(b->v + (size_t)b->cu[s] * KROW, p->hv, (size_t)n[s] * KROW * 2);
		b->cu[s + 1] = b->cu[s] + n[s];
	}
	const size_t tot = b->cu[NSEQ];
	CU(cudaMemcpy(b->dq, b->q, tot * QROW * 2, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(b->dk, b->k, tot * KROW * 2, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(b->dv, b->v, tot * KROW * 2, cudaMemcpyHostToDevice));
}

/* The CUDA cache's outputs to the host, and the worst relative L2 error against the CPU's over
 * every (row, query head), which must be at most `bound`; `what` names the call. */
static double chunk_compare(struct chunk *b, double bound, const char *what)
{
	const uint32_t tot = b->cu[NSEQ];
	double worst = 0.0;
	CU(cudaMemcpy(b->og, b->dout, sizeof(float) * tot * QROW, cudaMemcpyDeviceToHost));
	for (uint32_t rh = 0; rh < tot * HQ; rh++) {
		double num = 0, den = 0;
		for (uint32_t j = 0; j < D; j++) {
			const double x = b->oc[(size_t)rh * D + j], y = b->og[(size_t)rh * D + j];
			num += (x - y) * (x - y);
			den += x * x;
		}
		const double rel = sqrt(num / (den > 0 ? den : 1));
		worst = rel > worst ? rel : worst;
		T_CHECK(rel <= bound, "%s, row %u head %u: relative error %g (first output %.6g, the "
			"CPU's %.6g)", what, rh / HQ, rh % HQ, rel, b->og[(size_t)rh * D],
			b->oc[(size_t)rh * D]);
	}
	return worst;
}

/* The chunk on `layer` of both caches (flags 0). */
static void chunk_extend_both(struct pair *p, struct chunk *b, uint32_t layer)
{
	OK(p->cpu, kvt_extend(p->cpu, layer, NSEQ, p->sc, b->cu, b->q, b->k, b->v, b->oc, 0, NULL));
	OK(p->gpu, kvt_extend(p->gpu, layer, NSEQ, p->sg, b->cu, b->dq, b->dk, b->dv, b->dout, 0,
			      NULL));
}

/*
 * kvt_extend (exact) on CUDA against the CPU backend: per layer, a batch of both sequences with
 * chunks of uneven lengths (37 and 130 rows, then 200 and none, then 9 and 64, then 40 and 3), the
 * first round in one staging range (its keys split over blocks: few query rows), the second
 * through ranges of 256 rows (split, merged with the running state), the third through ranges of
 * 64 rows (one block per tile, the state carried over ranges by the kernel), the fourth through
 * four ranges staged on the side stream into two buffers in turn (the overlapped path, its
 * thresholds lowered); the outputs agree within 1e-2 relative per (row, query head): the GPU
 * rounds the probabilities to fp16 before they weight V, as FlashAttention does. Then both caches
 * hold the same lengths, and decode steps on them agree as attend_both requires (the rows and
 * index entries the extends stored).
 */
static void test_extend(void **state)
{
	(void)state;
	struct pair p;
	struct chunk b;
	const uint32_t ctx = 700, chunk[4][NSEQ] = {{37, 130}, {200, 0}, {9, 64}, {40, 3}};
	pair_init(&p, ctx, 400, 64u << 20);
	chunk_init(&b, 330);
	const uint64_t stage0 = gpu_extend_stage_bytes;
	const uint32_t one0 = gpu_extend_one_range, q0 = gpu_extend_overlap_q;
	const uint64_t stage[4] = {stage0, 256u * 2 * HKV * D * 2, 64u * 2 * HKV * D * 2, stage0};
	uint32_t len[NSEQ] = {ctx, ctx};
	double worst = 0.0;
	for (int round = 0; round < 4; round++) {
		gpu_extend_stage_bytes = stage[round];
		gpu_extend_one_range = round == 3 ? 128 : one0; /* ranges of 256 rows, four a sequence */
		gpu_extend_overlap_q = round == 3 ? 1 : q0;
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			char what[64];
			snprintf(what, sizeof what, "round %d layer %u", round, layer);
			chunk_make(&p, &b, layer, len, chunk[round]);
			chunk_extend_both(&p, &b, layer);
			const double w = chunk_compare(&b, 1e-2, what);
			worst = w > worst ? w : worst;
		}
		for (uint32_t s = 0; s < NSEQ; s++)
			len[s] += chunk[round][s];
	}
	gpu_extend_one_range = one0;
	gpu_extend_overlap_q = q0;
	gpu_extend_stage_bytes = stage0;
	for (uint32_t s = 0; s < NSEQ; s++)
		for (uint32_t layer = 0; layer < LAYERS; layer++)
			T_CHECK(kvt_seq_length(p.gpu, p.sg[s], layer) == len[s] &&
					kvt_seq_length(p.cpu, p.sc[s], layer) == len[s],
				"seq %u layer %u: lengths cpu %lld gpu %lld, wanted %u", s, layer,
				(long long)kvt_seq_length(p.cpu, p.sc[s], layer),
				(long long)kvt_seq_length(p.gpu, p.sg[s], layer), len[s]);
	const double dworst = decode_both(&p, 0, 3);
	kvt_stats sg = {.size = sizeof sg};
	OK(p.gpu, kvt_get_stats(p.gpu, &sg));
	printf("extend: 4 rounds x %u layers x %u sequences (one range, ranges of 256, of 64, "
	       "overlapped); "
	       "worst error against the CPU %.3g; decode after it %.3g; rows read %llu\n", LAYERS,
	       NSEQ, worst, dworst, (unsigned long long)sg.rows_fetched);
	chunk_fini(&b);
	pair_fini(&p);
}

/*
 * kvt_extend with KVT_EXTEND_TOPP on CUDA against the CPU backend: chunks of speculative-decoding
 * size (5 and 9 rows, 12 and none) and one longer than the window and a flush (70 rows: the
 * chunk's own tokens indexed, its early rows scoring a prefix of the index with an empty window),
 * on every layer; each row attends its own Top-p
 * selection of the indexed tokens up to it plus the sinks and window up to it, within 1e-2
 * relative per (row, query head) of the CPU's (the threshold's tolerance may move a token); the
 * last row of a chunk equals, bit for bit, a kvt_attend of its query once the chunk is in (the
 * same step); then decode steps agree as attend_both requires.
 */
static void test_extend_topp(void **state)
{
	(void)state;
	struct pair p;
	struct chunk b;
	const uint32_t ctx = 600, chunk[3][NSEQ] = {{5, 9}, {1, 70}, {12, 0}};
	pair_init(&p, ctx, 120, 64u << 20);
	chunk_init(&b, 90);
	uint32_t len[NSEQ] = {ctx, ctx}, attends = 0;
	double worst = 0.0;
	float *last = malloc(sizeof(float) * QROW);
	T_CHECK(last != NULL, "malloc");
	for (int round = 0; round < 3; round++) {
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			char what[64];
			snprintf(what, sizeof what, "Top-p round %d layer %u", round, layer);
			chunk_make(&p, &b, layer, len, chunk[round]);
			OK(p.cpu, kvt_extend(p.cpu, layer, NSEQ, p.sc, b.cu, b.q, b.k, b.v, b.oc,
					     KVT_EXTEND_TOPP, NULL));
			OK(p.gpu, kvt_extend(p.gpu, layer, NSEQ, p.sg, b.cu, b.dq, b.dk, b.dv, b.dout,
					     KVT_EXTEND_TOPP, NULL));
			const double w = chunk_compare(&b, 1e-2, what);
			worst = w > worst ? w : worst;
			/* the last row of sequence 1's chunk, attended again by a decode step */
			const uint32_t r = b.cu[NSEQ] - 1;
			if (chunk[round][1] == 0)
				continue;
			const void *qr = (char *)b.dq + (size_t)r * QROW * 2;
			OK(p.gpu, kvt_attend(p.gpu, layer, 1, &p.sg[1], qr, p.dout, NULL));
			attends++;
			CU(cudaMemcpy(last, p.dout, sizeof(float) * QROW, cudaMemcpyDeviceToHost));
			T_CHECK(!memcmp(last, b.og + (size_t)r * QROW, sizeof(float) * QROW),
				"%s: the chunk's last row differs from kvt_attend of its query", what);
		}
		for (uint32_t s = 0; s < NSEQ; s++)
			len[s] += chunk[round][s];
	}
	kvt_stats sc = {.size = sizeof sc}, sg = {.size = sizeof sg};
	OK(p.cpu, kvt_get_stats(p.cpu, &sc));
	OK(p.gpu, kvt_get_stats(p.gpu, &sg));
	T_CHECK(sc.steps + attends == sg.steps, "steps: cpu %llu, gpu %llu with %u kvt_attend "
		"(a Top-p row counts as a step)", (unsigned long long)sc.steps,
		(unsigned long long)sg.steps, attends);
	const double dworst = decode_both(&p, 0, 3);
	printf("extend Top-p: 3 rounds x %u layers; worst error against the CPU %.3g; last rows "
	       "bit-equal to kvt_attend; decode after it %.3g\n", LAYERS, worst, dworst);
	free(last);
	chunk_fini(&b);
	pair_fini(&p);
}

/* The expected contents of a placed buffer of `elems` elements (`fill` everywhere else): the rows
 * of sequence s from position `from` on `layer`, token i at slot map[i] (skipped when -1). */
static void placed_expect(const struct pair *p, uint32_t layer, uint32_t s, uint32_t from,
			  uint32_t n, const int64_t *map, const kvt_rows_layout *lo, size_t elems,
			  uint16_t fill, uint16_t *ek, uint16_t *ev)
{
	for (size_t e = 0; e < elems; e++)
		ek[e] = ev[e] = fill;
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t h = 0; h < HKV && map[i] >= 0; h++) {
			const size_t at = (size_t)map[i] * lo->slot_stride + h * lo->head_stride;
			memcpy(ek + at, p->rows_k + row_at(p, layer, s, h, from + i), 2 * D);
			memcpy(ev + at, p->rows_v + row_at(p, layer, s, h, from + i), 2 * D);
		}
}

/*
 * kvt_seq_read_rows_at and kvt_seq_write_rows_at on CUDA (a dense device scratch and a kernel
 * placing rows): rows [100, 420) of sequence 0 on layer 1 (indexed rows across a block edge)
 * read into a paged device buffer whose slot mapping scatters them and skips every fifth token,
 * once with strides that allow 16-byte moves and once with odd ones (2-byte moves): the buffer
 * equals the rows written, bit for bit, and nothing else of it changed. Then the same buffer is
 * written into a fresh sequence through the mapping with each skip replaced by the slot before it
 * (a repeated slot): read back dense, the sequence holds exactly those rows.
 */
static void test_rows_at(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 700, 4, 64u << 20);
	const uint32_t from = 100, n = 320, layer = 1, slots = 2 * n;
	int64_t *map = malloc(sizeof(int64_t) * n), *wmap = malloc(sizeof(int64_t) * n);
	T_CHECK(map && wmap, "malloc");
	for (uint32_t i = 0; i < n; i++) {
		map[i] = i % 5 == 4 ? -1 : (int64_t)((i * 7 + 3) % slots); /* 7 is prime to 640 */
		wmap[i] = i % 5 == 4 ? map[i - 1] : map[i];
	}
	const kvt_rows_layout los[2] = {
		{.size = sizeof(kvt_rows_layout), .slot_stride = HKV * D + 64, .head_stride = D + 32},
		{.size = sizeof(kvt_rows_layout), .slot_stride = 2 * (D + 3) + 5, .head_stride = D + 3}};
	for (int t = 0; t < 2; t++) {
		kvt_rows_layout lo = los[t];
		const size_t elems = (size_t)slots * lo.slot_stride, bytes = 2 * elems;
		uint16_t *hk = malloc(bytes), *hv = malloc(bytes), *ek = malloc(bytes),
			 *ev = malloc(bytes);
		void *dk, *dv;
		T_CHECK(hk && hv && ek && ev, "malloc");
		CU(cudaMalloc(&dk, bytes));
		CU(cudaMalloc(&dv, bytes));
		CU(cudaMemset(dk, 0x5a, bytes));
		CU(cudaMemset(dv, 0x5a, bytes));
		lo.slot_mapping = map;
		OK(p.gpu, kvt_seq_read_rows_at(p.gpu, p.sg[0], layer, from, from + n, dk, dv, &lo,
					       NULL));
		CU(cudaMemcpy(hk, dk, bytes, cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(hv, dv, bytes, cudaMemcpyDeviceToHost));
		placed_expect(&p, layer, 0, from, n, map, &lo, elems, 0x5a5a, ek, ev);
		T_CHECK(!memcmp(hk, ek, bytes) && !memcmp(hv, ev, bytes),
			"layout %d: the placed rows differ from those written", t);
		/* back in through the mapping without skips: token i holds the rows of token i - 1
		 * of the read where i was skipped */
		uint32_t seq;
		OK(p.gpu, kvt_seq_open(p.gpu, &seq));
		lo.slot_mapping = wmap;
		OK(p.gpu, kvt_seq_write_rows_at(p.gpu, seq, layer, 0, n, dk, dv, &lo, NULL));
		T_CHECK(kvt_seq_length(p.gpu, seq, layer) == n, "written: %lld tokens, wanted %u",
			(long long)kvt_seq_length(p.gpu, seq, layer), n);
		const size_t dense = (size_t)n * HKV * D * 2;
		OK(p.gpu, kvt_seq_read_rows(p.gpu, seq, layer, 0, n, dk, dv, NULL));
		CU(cudaMemcpy(hk, dk, dense, cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(hv, dv, dense, cudaMemcpyDeviceToHost));
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t h = 0; h < HKV; h++) {
				const uint32_t src = from + (i % 5 == 4 ? i - 1 : i);
				const size_t at = ((size_t)i * HKV + h) * D;
				T_CHECK(!memcmp(hk + at, p.rows_k + row_at(&p, layer, 0, h, src), 2 * D) &&
						!memcmp(hv + at, p.rows_v + row_at(&p, layer, 0, h, src),
							2 * D),
					"layout %d: token %u head %u written through the mapping differs",
					t, i, h);
			}
		OK(p.gpu, kvt_seq_close(p.gpu, seq));
		CU(cudaFree(dk));
		CU(cudaFree(dv));
		free(hk);
		free(hv);
		free(ek);
		free(ev);
	}
	printf("rows_at: %u rows read into and written from a paged device buffer (16-byte and 2-byte "
	       "strides), every fifth slot skipped: bit for bit the rows written\n", n);
	free(map);
	free(wmap);
	pair_fini(&p);
}

/*
 * kvt_seq_status on CUDA: a step whose query of sequence 1 is NaN returns (the kernels record the
 * non-finite score without stopping); once the device has finished it, the next call puts sequence
 * 1 in error and only it: sequence 0 is served, a batch with sequence 1 fails naming entry 1 and
 * changes nothing, and truncating the bad step's token off both caches clears the status, after
 * which the pair decodes in agreement again.
 */
static void test_seq_status(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 700, 4, 64u << 20);
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		append_both(&p, layer, 0);
	decode_inputs(&p, 0, 0);
	p.hq[(size_t)HQ * D + 5] = 0x7e00; /* a NaN in sequence 1's query */
	CU(cudaMemcpy(p.dq, p.hq, sizeof(uint16_t) * NSEQ * HQ * D, cudaMemcpyHostToDevice));
	OK(p.gpu, kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, NULL));
	CU(cudaDeviceSynchronize());
	int st = 1;
	char text[256];
	OK(p.gpu, kvt_seq_status(p.gpu, p.sg[1], &st, text, sizeof text));
	T_CHECK(st == -EINVAL && strstr(text, "non-finite"), "seq 1: status %d (%s)", st, text);
	OK(p.gpu, kvt_seq_status(p.gpu, p.sg[0], &st, text, sizeof text));
	T_CHECK(st == 0 && !*text, "seq 0: status %d (%s)", st, text);
	int rc = kvt_attend(p.gpu, 0, NSEQ, p.sg, p.dq, p.dout, NULL);
	T_CHECK(rc == -EINVAL && kvt_last_error_entry(p.gpu) == 1, "a batch with seq 1: %d, entry "
		"%d (%s)", rc, kvt_last_error_entry(p.gpu), kvt_last_error(p.gpu));
	OK(p.gpu, kvt_attend(p.gpu, 0, 1, p.sg, p.dq, p.dout, NULL)); /* seq 0 alone */
	CU(cudaDeviceSynchronize());
	OK(p.gpu, kvt_seq_status(p.gpu, p.sg[0], &st, text, sizeof text));
	T_CHECK(st == 0, "seq 0 after its own step: status %d (%s)", st, text);
	for (uint32_t s = 0; s < NSEQ; s++) {
		OK(p.cpu, kvt_seq_truncate(p.cpu, p.sc[s], 1, NULL));
		OK(p.gpu, kvt_seq_truncate(p.gpu, p.sg[s], 1, NULL));
	}
	OK(p.gpu, kvt_seq_status(p.gpu, p.sg[1], &st, text, sizeof text));
	T_CHECK(st == 0, "seq 1 after the truncation: status %d (%s)", st, text);
	const double worst = decode_both(&p, 1, 3);
	printf("seq status: a NaN query put its sequence alone in error; after the truncation the "
	       "pair agrees within %.3g\n", worst);
	pair_fini(&p);
}

/*
 * kvt_extend on CUDA under allocation faults: the n-th allocation or pin of the call fails, for n
 * = 1, 2, ... until the call succeeds (the first call grows the staging buffer, the chunk's host
 * rows and the mirror's index); each failure leaves both sequences' lengths and the host tier's
 * free bytes as they were, and the call that finally succeeds gives the CPU backend's outputs
 * (within 1e-2, as test_extend), after which decode steps agree as attend_both requires.
 */
static void test_extend_faults(void **state)
{
	(void)state;
	struct pair p;
	struct chunk b;
	const uint32_t ctx = 700, n[NSEQ] = {37, 130}, pos[NSEQ] = {ctx, ctx};
	pair_init(&p, ctx, 200, 64u << 20);
	chunk_init(&b, n[0] + n[1]);
	chunk_make(&p, &b, 0, pos, n);
	kvt_capacity cap0 = {.size = sizeof cap0}, cap = {.size = sizeof cap};
	OK(p.gpu, kvt_get_capacity(p.gpu, &cap0));
	uint32_t failed = 0;
	for (uint64_t f = 1;; f++) {
		T_CHECK(f < 500, "the extend never succeeded");
		kvt_mem_fail_at(f);
		int rc = kvt_extend(p.gpu, 0, NSEQ, p.sg, b.cu, b.dq, b.dk, b.dv, b.dout, 0, NULL);
		const bool fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc == 0)
			break;
		T_CHECK(fired, "extend failed (%d: %s) with no fault injected", rc,
			kvt_last_error(p.gpu));
		failed++;
		OK(p.gpu, kvt_get_capacity(p.gpu, &cap));
		T_CHECK(cap.host_bytes_free == cap0.host_bytes_free,
			"fault %llu (%s): %llu host bytes free, %llu before the call",
			(unsigned long long)f, kvt_last_error(p.gpu),
			(unsigned long long)cap.host_bytes_free,
			(unsigned long long)cap0.host_bytes_free);
		for (uint32_t s = 0; s < NSEQ; s++)
			T_CHECK(kvt_seq_length(p.gpu, p.sg[s], 0) == ctx,
				"fault %llu (%s): seq %u holds %lld tokens, %u before the call",
				(unsigned long long)f, kvt_last_error(p.gpu), s,
				(long long)kvt_seq_length(p.gpu, p.sg[s], 0), ctx);
	}
	T_CHECK(failed > 0, "no failure was injected");
	OK(p.cpu, kvt_extend(p.cpu, 0, NSEQ, p.sc, b.cu, b.q, b.k, b.v, b.oc, 0, NULL));
	const double worst = chunk_compare(&b, 1e-2, "after the faults");
	/* layer 1 takes the same chunk fault-free, so that both layers hold equal lengths */
	chunk_make(&p, &b, 1, pos, n);
	chunk_extend_both(&p, &b, 1);
	const double dworst = decode_both(&p, 0, 2);
	printf("extend faults: %u injected failures changed nothing; then error %.3g against the "
	       "CPU, decode %.3g\n", failed, worst, dworst);
	chunk_fini(&b);
	pair_fini(&p);
}

/*
 * The second selection stage (rescore_p) on CUDA against the CPU's. At rescore_p = 1 every indexed
 * token is a candidate and gets its exact logit, bit-equal on both backends, so the selection of
 * every (sequence, KV head) must lie between those of CPU caches at p -/+ delta (the threshold's
 * tolerance, as in test_gpu_backend's pipeline), and both count the same keys read; at
 * rescore_p = 0.95 the candidate sets themselves come from the tolerant threshold, so the steps
 * are compared by their outputs (within 1e-3 of the CPU's) and the sets that differ are counted.
 */
static void test_rescore(void **state)
{
	(void)state;
	const float rps[2] = {1.0f, 0.95f};
	for (int k = 0; k < 2; k++) {
		struct pair p;
		const uint32_t steps = g_quick ? 4 : 16, T = 2048 + steps + 8;
		g_rescore_p = rps[k];
		g_bound_delta = k == 0 ? (float)(0x1p-19 + T * 0x1p-38) : 0.0f;
		pair_init(&p, 2048, steps, 64u << 20);
		g_rescore_p = 0.0f;
		g_bound_delta = 0.0f;
		int32_t *cnt = malloc(sizeof(int32_t) * 4 * NSEQ * HKV);
		int32_t *pos = malloc(sizeof(int32_t) * 4 * NSEQ * HKV * T), *dpos;
		CU(cudaMalloc((void **)&dpos, sizeof(int32_t) * NSEQ * HKV * T));
		const uint32_t order[NSEQ] = {0, 1};
		const size_t I = NSEQ * HKV;
		uint32_t differ = 0, outside = 0, compared = 0;
		double worst = 0.0;
		for (uint32_t step = 0; step < steps; step++)
			for (uint32_t layer = 0; layer < LAYERS; layer++) {
				append_both(&p, layer, step);
				/* 0: CPU at p, 1: CUDA, 2 and 3: CPU at p -/+ delta */
				cpu_positions(p.cpu, layer, p.sc, p.hq, order, T, cnt, pos);
				OK(p.gpu, kvt_select(p.gpu, layer, NSEQ, p.sg, p.dq, NULL));
				OK(p.gpu, kvt_gather(p.gpu, layer, NSEQ, p.sg, T, cnt + I, dpos, NULL,
						     NULL, NULL));
				CU(cudaMemcpy(pos + I * T, dpos, sizeof(int32_t) * I * T,
					      cudaMemcpyDeviceToHost));
				if (p.lo) {
					cpu_positions(p.lo, layer, p.sl, p.hq, order, T, cnt + 2 * I,
						      pos + 2 * I * T);
					cpu_positions(p.hi, layer, p.sh, p.hq, order, T, cnt + 3 * I,
						      pos + 3 * I * T);
				}
				for (size_t it = 0; it < I; it++) {
					const int32_t *pg = pos + (I + it) * T;
					bool sub, lo_in = true, in_hi = true;
					compared++;
					differ += pos_diff(pos + it * T, cnt[it], pg, cnt[I + it], &sub) != 0;
					if (p.lo) {
						(void)pos_diff(pos + (2 * I + it) * T, cnt[2 * I + it], pg,
							       cnt[I + it], &lo_in);
						(void)pos_diff(pg, cnt[I + it], pos + (3 * I + it) * T,
							       cnt[3 * I + it], &in_hi);
					}
					outside += !lo_in || !in_hi;
				}
				attend_both(&p, layer, step, &worst);
			}
		kvt_stats sc = {.size = sizeof sc}, sg = {.size = sizeof sg};
		OK(p.cpu, kvt_get_stats(p.cpu, &sc));
		OK(p.gpu, kvt_get_stats(p.gpu, &sg));
		printf("rescore_p %.2f: %u of %u selected sets differ from the CPU's, %u outside the "
		       "window; keys read cpu %llu gpu %llu (unselected %llu / %llu); worst output "
		       "error %.3g\n",
		       (double)rps[k], differ, compared, outside,
		       (unsigned long long)sc.rescored_tokens, (unsigned long long)sg.rescored_tokens,
		       (unsigned long long)sc.rescored_unselected,
		       (unsigned long long)sg.rescored_unselected, worst);
		T_CHECK(outside == 0, "rescore_p %.2f: %u sets outside the window", (double)rps[k],
			outside);
		T_CHECK(sg.rescored_tokens > 0 && sg.rescored_unselected < sg.rescored_tokens,
			"rescore_p %.2f: the GPU read %llu keys, %llu of them unselected",
			(double)rps[k], (unsigned long long)sg.rescored_tokens,
			(unsigned long long)sg.rescored_unselected);
		if (k == 0)
			T_CHECK(sc.rescored_tokens == sg.rescored_tokens,
				"rescore_p 1: keys read cpu %llu gpu %llu (every indexed token, both)",
				(unsigned long long)sc.rescored_tokens,
				(unsigned long long)sg.rescored_tokens);
		free(cnt);
		free(pos);
		cudaFree(dpos);
		pair_fini(&p);
	}
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_lifecycle),
		cmocka_unit_test(test_unsupported),
		cmocka_unit_test(test_strided),
		cmocka_unit_test(test_rows_at),
		cmocka_unit_test(test_seq_status),
		cmocka_unit_test(test_extend),
		cmocka_unit_test(test_extend_topp),
		cmocka_unit_test(test_extend_faults),
		cmocka_unit_test(test_rescore),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
