/* SPDX-License-Identifier: MIT */
/*
 * keep_weight (the selection's hysteresis, doc/hysteresis.md) on the CUDA backend against the CPU
 * backend, through the public interface on kvbench's workload (gpu_pair.h): both caches with
 * keep_weight 8, the batch stepped as one kvt_select and one kvt_attend per token and layer, each
 * step favoring the selection of the step before. At every step the selected positions of every
 * (sequence, KV head) equal the CPU's and the outputs lie within 1e-3 of its; midway each
 * sequence is truncated by a token (both backends forget what they favored) and later sequence 0
 * is forked in place of sequence 1 (the child favors its parent's last selection on both). A
 * step's selection depends on the one before, so a set that differs (the GPU's threshold may, by
 * the tolerance gpu/select.cuh states) parts the histories: the comparison stops there, printing
 * it. The same steps without keep_weight select otherwise, and keep fewer of the last step's
 * tokens than with it. A plain kvt_attend captured into a CUDA graph with the weight replays as
 * its eager twin steps, bit for bit. Exits 77 (skipped) when no CUDA device is present.
 */
#include "gpu_pair.h"

enum { T_MAX = 4096 + 96 };

/* Selected positions of the batch on both backends (kvt_select, then kvt_gather), and the count
 * of GPU sets that differ from the CPU's; *kept: GPU positions also in prev (the step before). */
static uint32_t select_both(struct pair *p, uint32_t layer, int32_t *cnt_c, int32_t *pos_c,
			    int32_t *cnt_g, int32_t *pos_g, int32_t *dpos, const int32_t *prev_n,
			    const int32_t *prev, uint64_t *kept)
{
	OK(p->cpu, kvt_select(p->cpu, layer, NSEQ, p->sc, p->hq, NULL));
	OK(p->gpu, kvt_select(p->gpu, layer, NSEQ, p->sg, p->dq, NULL));
	OK(p->cpu, kvt_gather(p->cpu, layer, NSEQ, p->sc, T_MAX, cnt_c, pos_c, NULL, NULL, NULL));
	OK(p->gpu, kvt_gather(p->gpu, layer, NSEQ, p->sg, T_MAX, cnt_g, dpos, NULL, NULL, NULL));
	CU(cudaMemcpy(pos_g, dpos, sizeof(int32_t) * NSEQ * HKV * T_MAX, cudaMemcpyDeviceToHost));
	uint32_t differ = 0;
	for (uint32_t it = 0; it < NSEQ * HKV; it++) {
		bool sub;
		const size_t at = (size_t)it * T_MAX;
		differ += pos_diff(pos_c + at, cnt_c[it], pos_g + at, cnt_g[it], &sub) != 0;
		if (prev) /* shared with the step before: the union minus the difference, halved */
			*kept += (cnt_g[it] + prev_n[it] -
				  pos_diff(prev + at, prev_n[it], pos_g + at, cnt_g[it], &sub)) / 2;
	}
	return differ;
}

/* A run's GPU sets, per step, layer and item: what another run's are compared with. */
struct record {
	int32_t *n, *pos; /* [steps][LAYERS][NSEQ * HKV] counts, [..][T_MAX] positions */
	uint32_t filled;  /* steps x layers recorded */
};

/*
 * The steps on a pair with keep_weight w: the twin check of every step until the sets part, the
 * truncation midway and the fork at three quarters. Returns the GPU's positions kept from the
 * step before (summed over steps, layers and items); the GPU's sets are recorded into rec, or,
 * with rec NULL, compared with cmp's: *differ counts the sets that differ.
 */
static uint64_t run(float w, uint32_t steps, struct record *rec, const struct record *cmp,
		    uint32_t *differ)
{
	struct pair p;
	g_keep_weight = w;
	pair_init(&p, 4096, steps, 64u << 20);
	g_keep_weight = 0.0f;
	const size_t items = (size_t)NSEQ * HKV, per = items * T_MAX;
	int32_t *cnt_c = malloc(sizeof(int32_t) * items), *cnt_g = malloc(sizeof(int32_t) * items);
	int32_t *pos_c = malloc(sizeof(int32_t) * per), *pos_g = malloc(sizeof(int32_t) * per);
	int32_t *prev_n = malloc(sizeof(int32_t) * LAYERS * items);
	int32_t *prev = malloc(sizeof(int32_t) * LAYERS * per), *dpos;
	T_CHECK(cnt_c && cnt_g && pos_c && pos_g && prev_n && prev, "malloc");
	CU(cudaMalloc((void **)&dpos, sizeof(int32_t) * per));
	uint64_t kept = 0;
	uint32_t compared = 0;
	bool parted = false;
	double worst = 0.0;
	*differ = 0;
	for (uint32_t step = 0; step < steps && !parted; step++) {
		if (step == steps / 2) /* a token dropped: what each favored is forgotten */
			for (uint32_t s = 0; s < NSEQ; s++) {
				OK(p.cpu, kvt_seq_truncate(p.cpu, p.sc[s], 4096 + step - 1, NULL));
				OK(p.gpu, kvt_seq_truncate(p.gpu, p.sg[s], 4096 + step - 1, NULL));
			}
		if (step == 3 * steps / 4) /* sequence 0's child in place of sequence 1 */
			fork_both(&p, 0, 1);
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			append_both(&p, layer, step);
			const size_t li = (size_t)layer * items;
			const uint32_t d = select_both(&p, layer, cnt_c, pos_c, cnt_g, pos_g, dpos,
						       prev_n + li, step ? prev + li * T_MAX : NULL,
						       &kept);
			if (d) {
				parted = true;
				print_error("keep_weight %g, step %u layer %u: %u of %zu GPU "
					    "sets differ from the CPU's (within the tolerance the "
					    "twins part there)\n",
					    (double)w, step, layer, d, items);
				break;
			}
			const uint32_t k = step * LAYERS + layer;
			if (rec) {
				memcpy(rec->n + (size_t)k * items, cnt_g, sizeof(int32_t) * items);
				memcpy(rec->pos + (size_t)k * per, pos_g, sizeof(int32_t) * per);
				rec->filled = k + 1;
			} else if (k < cmp->filled) {
				for (size_t it = 0; it < items; it++) {
					bool sub;
					const int32_t *c = cmp->pos + (size_t)k * per + it * T_MAX;
					*differ += pos_diff(c, cmp->n[(size_t)k * items + it],
							    pos_g + it * T_MAX, cnt_g[it],
							    &sub) != 0;
				}
			}
			memcpy(prev_n + li, cnt_g, sizeof(int32_t) * items);
			memcpy(prev + li * T_MAX, pos_g, sizeof(int32_t) * per);
			compared++;
			attend_both(&p, layer, step, &worst);
		}
	}
	printf("keep_weight %g: %u of %u steps x layers compared, the GPU's sets equal the "
	       "CPU's%s; worst output error %.3g; %llu positions kept from the step before\n",
	       (double)w, compared, steps * LAYERS, parted ? " until they parted" : "", worst,
	       (unsigned long long)kept);
	free(cnt_c);
	free(cnt_g);
	free(pos_c);
	free(pos_g);
	free(prev_n);
	free(prev);
	cudaFree(dpos);
	pair_fini(&p);
	return kept;
}

static void test_keep(void **state)
{
	(void)state;
	const uint32_t steps = g_quick ? 12 : 48;
	const size_t sets = (size_t)steps * LAYERS * NSEQ * HKV;
	/* without the weight first (its twin check, truncation and fork hold there too), recording
	 * the GPU's sets */
	struct record rec = {malloc(sizeof(int32_t) * sets), malloc(sizeof(int32_t) * sets * T_MAX),
			     0};
	T_CHECK(rec.n && rec.pos, "malloc");
	uint32_t differ = 0;
	const uint64_t kept0 = run(0.0f, steps, &rec, NULL, &differ);
	const uint64_t kept8 = run(8.0f, steps, NULL, &rec, &differ);
	printf("keep_weight 8 against 0: %u of %u sets differ; positions kept from the step before "
	       "%llu against %llu\n", differ, rec.filled * NSEQ * HKV, (unsigned long long)kept8,
	       (unsigned long long)kept0);
	T_CHECK(differ > 0 && kept8 > kept0,
		"keep_weight 8 made no difference: %u sets differ, kept %llu against %llu", differ,
		(unsigned long long)kept8, (unsigned long long)kept0);
	free(rec.n);
	free(rec.pos);
}

/*
 * A plain kvt_attend captured into a CUDA graph with keep_weight 8 (doc/hysteresis.md: the capture
 * records the copies of what the captured batch's slots favor): each replay favors the selection
 * the replay before it wrote, as an eager step favors its last. Two pairs fed the same tokens; on
 * the first the step is captured after eager warm-up steps and replayed, on the second the same
 * steps run eagerly, with the query changing between steps: every replay's output equals its
 * eager twin's bit for bit.
 */
static void test_keep_captured(void **state)
{
	(void)state;
	struct pair a, b;
	g_keep_weight = 8.0f;
	pair_init(&a, 3000, 16, 64u << 20);
	pair_init(&b, 3000, 16, 64u << 20);
	g_keep_weight = 0.0f;
	cudaStream_t st;
	CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	const size_t ob = sizeof(float) * NSEQ * HQ * D;
	/* one token appended (the captured step replays this length), then warm-up steps on both */
	struct pair *ps[2] = {&a, &b};
	for (int k = 0; k < 2; k++) {
		decode_inputs(ps[k], 0, 0);
		struct pair *q = ps[k];
		OK(q->gpu, kvt_append(q->gpu, 0, NSEQ, q->sg, q->dk, q->dv, st));
		for (int w = 0; w < 3; w++)
			OK(q->gpu, kvt_attend(q->gpu, 0, NSEQ, q->sg, q->dq, q->dout, st));
		CU(cudaStreamSynchronize(st));
	}
	cudaGraph_t graph;
	cudaGraphExec_t exec;
	CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
	int rc = kvt_attend(a.gpu, 0, NSEQ, a.sg, a.dq, a.dout, st);
	CU(cudaStreamEndCapture(st, &graph));
	T_CHECK(rc == 0, "kvt_attend with keep_weight while capturing: %d: %s", rc,
		kvt_last_error(a.gpu));
	CU(cudaGraphInstantiate(&exec, graph, 0));
	for (uint32_t r = 0; r < 6; r++) {
		decode_inputs(&a, 0, r + 1); /* the queries of another step, into the captured dq */
		decode_inputs(&b, 0, r + 1);
		CU(cudaMemset(a.dout, 0xff, ob));
		CU(cudaGraphLaunch(exec, st));
		OK(b.gpu, kvt_attend(b.gpu, 0, NSEQ, b.sg, b.dq, b.dout, st));
		CU(cudaStreamSynchronize(st));
		CU(cudaMemcpy(a.out_g, a.dout, ob, cudaMemcpyDeviceToHost));
		CU(cudaMemcpy(b.out_g, b.dout, ob, cudaMemcpyDeviceToHost));
		T_CHECK(!memcmp(a.out_g, b.out_g, ob),
			"replay %u with keep_weight differs from its eager twin (first output "
			"%.9g, wanted %.9g)", r, a.out_g[0], b.out_g[0]);
	}
	printf("keep_weight 8: 6 replays of a captured kvt_attend equal their eager twin's "
	       "steps\n");
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	cudaStreamDestroy(st);
	pair_fini(&a);
	pair_fini(&b);
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_keep),
		cmocka_unit_test(test_keep_captured),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
