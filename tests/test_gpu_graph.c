/* SPDX-License-Identifier: MIT */
/*
 * kvt_attend_graph on the CUDA backend (suite gpu), through a captured CUDA graph:
 * - replay: one graph per layer, captured once over 4 slots (the two sequences in slots 2 and 0,
 *   slots 1 and 3 padded, one by seqs = -1 and one by valid = 0, their q rows NaN), replayed for
 *   200 decode steps while kvt_append grows the sequences (window flushes every 16 tokens): each
 *   replay's out rows equal, bit for bit, the eager kvt_attend of the same step (itself within
 *   1e-3 of the CPU backend's), the padded rows keep their sentinel, and the replays read the
 *   slot and length buffers the test rewrites before each one;
 * - slot errors: a replay whose lengths buffer is wrong for one slot pads that slot (its out row
 *   untouched, the other slot served); a capture then met by that error fails its call (-EIO,
 *   nothing captured, the capture still valid), and the next call outside it fails with -EINVAL
 *   naming the slot;
 * - bounds: within a reservation a batch beyond its bounds is refused (-E2BIG), not regrown;
 * - faults: kvt_graph_reserve failing at each of its allocations leaves no reservation.
 * Exits 77 (skipped) when no CUDA device is present.
 */
#include "gpu_pair.h"

enum { SLOTS = 4 };

struct slots {
	int32_t seqs[SLOTS], lengths[SLOTS];
	uint8_t valid[SLOTS];
	int32_t *dseqs, *dlengths;
	uint8_t *dvalid;
	uint16_t *dq;  /* [SLOTS][HQ][D] */
	float *dout;   /* [SLOTS][HQ][D] */
	float *out;    /* host copy */
};

static const float SENTINEL = -12345.0f;

/* The slot buffers and q rows of a step: sequence 1 in slot 0, sequence 0 in slot 2. */
static void fill_slots(struct pair *p, struct slots *s, uint32_t layer, bool wrong_length)
{
	const size_t qrow = (size_t)HQ * D;
	s->seqs[0] = (int32_t)p->sg[1];
	s->seqs[1] = -1;
	s->seqs[2] = (int32_t)p->sg[0];
	s->seqs[3] = (int32_t)p->sg[0]; /* a repeat, but padded: never read */
	/* slot 1 padded twice over (seqs < 0, valid 0), slot 3 by valid alone */
	s->valid[0] = s->valid[2] = 1;
	s->valid[1] = s->valid[3] = 0;
	for (uint32_t i = 0; i < SLOTS; i++)
		s->lengths[i] = s->seqs[i] >= 0 ? (int32_t)kvt_seq_length(p->gpu, (uint32_t)s->seqs[i],
									  layer)
						: 0;
	if (wrong_length)
		s->lengths[0]++;
	CU(cudaMemcpy(s->dseqs, s->seqs, sizeof s->seqs, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(s->dlengths, s->lengths, sizeof s->lengths, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(s->dvalid, s->valid, sizeof s->valid, cudaMemcpyHostToDevice));
	/* q: the step's queries of the two sequences (in p->dq, [NSEQ][HQ][D]), NaN elsewhere */
	CU(cudaMemset(s->dq, 0x7e, sizeof(uint16_t) * SLOTS * qrow));
	CU(cudaMemcpy(s->dq, (uint16_t *)p->dq + qrow, sizeof(uint16_t) * qrow,
		      cudaMemcpyDeviceToDevice));
	CU(cudaMemcpy(s->dq + 2 * qrow, p->dq, sizeof(uint16_t) * qrow, cudaMemcpyDeviceToDevice));
	for (size_t i = 0; i < SLOTS * qrow; i++)
		s->out[i] = SENTINEL;
	CU(cudaMemcpy(s->dout, s->out, sizeof(float) * SLOTS * qrow, cudaMemcpyHostToDevice));
}

/* The replay's out rows equal the eager rows of their sequences (in p->out_g); padded slots (and
 * slot 0 when slot0_padded) keep the sentinel. */
static void check_slots(struct pair *p, struct slots *s, uint32_t step, uint32_t layer,
			bool slot0_padded)
{
	const size_t qrow = (size_t)HQ * D;
	CU(cudaMemcpy(s->out, s->dout, sizeof(float) * SLOTS * qrow, cudaMemcpyDeviceToHost));
	const int src[SLOTS] = {slot0_padded ? -1 : 1, -1, 0, -1};
	for (uint32_t i = 0; i < SLOTS; i++) {
		const float *o = s->out + i * qrow;
		if (src[i] < 0) {
			for (size_t j = 0; j < qrow; j++)
				T_CHECK(o[j] == SENTINEL, "step %u layer %u: padded slot %u was written "
					"(element %zu = %g)", step, layer, i, j, o[j]);
			continue;
		}
		const float *e = p->out_g + (size_t)src[i] * qrow;
		size_t diff = 0;
		while (diff < qrow && !memcmp(&o[diff], &e[diff], sizeof *o))
			diff++;
		T_CHECK(diff == qrow, "step %u layer %u: slot %u (seq %d) differs from the eager step at "
			"element %zu: %.9g, eager %.9g", step, layer, i, src[i], diff, o[diff], e[diff]);
	}
}

static void test_replay(void **state)
{
	(void)state;
	const uint32_t steps = g_quick ? 40 : 200;
	struct pair p;
	pair_init(&p, 600, steps + 2, 0); /* the self-sized hot cache: frozen by the capture */
	struct slots s;
	const size_t qrow = (size_t)HQ * D;
	CU(cudaMalloc((void **)&s.dseqs, sizeof s.seqs));
	CU(cudaMalloc((void **)&s.dlengths, sizeof s.lengths));
	CU(cudaMalloc((void **)&s.dvalid, sizeof s.valid));
	CU(cudaMalloc((void **)&s.dq, sizeof(uint16_t) * SLOTS * qrow));
	CU(cudaMalloc((void **)&s.dout, sizeof(float) * SLOTS * qrow));
	s.out = malloc(sizeof(float) * SLOTS * qrow);
	T_CHECK(s.out != NULL, "out of memory");
	cudaStream_t st;
	CU(cudaStreamCreate(&st));
	OK(p.gpu, kvt_graph_reserve(p.gpu, SLOTS, 600 + steps + 64, st));
	const kvt_graph_batch gb = {.n_slots = SLOTS, .seqs = s.dseqs, .lengths = s.dlengths,
				    .valid = s.dvalid};
	cudaGraphExec_t exec[LAYERS];
	double worst = 0;
	for (uint32_t step = 0; step < steps; step++)
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			append_both(&p, layer, step);
			attend_both(&p, layer, step, &worst); /* eager: p.out_g */
			fill_slots(&p, &s, layer, false);
			if (step < 2) {
				/* warm-up calls, eager, at the graph's shape; then the capture */
				OK(p.gpu, kvt_attend_graph(p.gpu, layer, &gb, s.dq, s.dout, st));
				CU(cudaStreamSynchronize(st));
				check_slots(&p, &s, step, layer, false);
				fill_slots(&p, &s, layer, false);
				if (step == 1) {
					cudaGraph_t g;
					CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
					OK(p.gpu, kvt_attend_graph(p.gpu, layer, &gb, s.dq, s.dout, st));
					CU(cudaStreamEndCapture(st, &g));
					CU(cudaGraphInstantiate(&exec[layer], g, 0));
					CU(cudaGraphDestroy(g));
				}
				if (step == 0)
					continue;
			}
			CU(cudaGraphLaunch(exec[layer], st));
			CU(cudaStreamSynchronize(st));
			check_slots(&p, &s, step, layer, false);
		}
	/* a wrong length in slot 0: padded, slot 2 still served, the next call names slot 0 */
	const uint32_t layer = 0;
	append_both(&p, layer, steps);
	attend_both(&p, layer, steps, &worst);
	fill_slots(&p, &s, layer, true);
	CU(cudaGraphLaunch(exec[layer], st));
	CU(cudaStreamSynchronize(st));
	check_slots(&p, &s, steps, layer, true);
	/* that error met by a capture: reading it out would synchronize the device, so the call
	 * fails naming it, captures nothing and leaves the capture valid; the error stays for the
	 * next call outside the capture */
	cudaGraph_t g2;
	CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
	const int crc = kvt_attend_graph(p.gpu, layer, &gb, s.dq, s.dout, st);
	const cudaError_t ce = cudaStreamEndCapture(st, &g2);
	T_CHECK(crc == -EIO && strstr(kvt_last_error(p.gpu), "being captured"),
		"a capture after a replay's error: %d (%s)", crc, kvt_last_error(p.gpu));
	T_CHECK(ce == cudaSuccess, "the capture was invalidated: %s", cudaGetErrorString(ce));
	size_t nodes = 1;
	CU(cudaGraphGetNodes(g2, NULL, &nodes));
	T_CHECK(nodes == 0, "the failed call captured %zu nodes", nodes);
	CU(cudaGraphDestroy(g2));
	int64_t stats_rc = kvt_attend(p.gpu, layer, NSEQ, p.sg, p.dq, p.dout, NULL);
	T_CHECK(stats_rc == -EINVAL && kvt_last_error_entry(p.gpu) == 0 &&
			strstr(kvt_last_error(p.gpu), "slot 0") &&
			strstr(kvt_last_error(p.gpu), "lengths"),
		"the call after a replay with a wrong length: %lld, entry %d (%s)",
		(long long)stats_rc, kvt_last_error_entry(p.gpu), kvt_last_error(p.gpu));
	/* beyond the bounds: refused, the scratch not regrown under the graphs */
	OK(p.gpu, kvt_graph_reserve(p.gpu, 1, 600 + steps + 64, st));
	stats_rc = kvt_attend(p.gpu, layer, NSEQ, p.sg, p.dq, p.dout, NULL);
	T_CHECK(stats_rc == -E2BIG && strstr(kvt_last_error(p.gpu), "kvt_graph_reserve"),
		"a batch of 2 within a reservation of 1 slot: %lld (%s)", (long long)stats_rc,
		kvt_last_error(p.gpu));
	OK(p.gpu, kvt_graph_reserve(p.gpu, 0, 0, st));
	OK(p.gpu, kvt_attend(p.gpu, layer, NSEQ, p.sg, p.dq, p.dout, NULL));
	printf("graph replay: %u steps x %u layers bit-equal to the eager steps (which are within "
	       "%.3g of the CPU backend); a wrong length padded its slot and was reported\n",
	       steps, LAYERS, worst);
	for (uint32_t l = 0; l < LAYERS; l++)
		cudaGraphExecDestroy(exec[l]);
	cudaStreamDestroy(st);
	cudaFree(s.dseqs);
	cudaFree(s.dlengths);
	cudaFree(s.dvalid);
	cudaFree(s.dq);
	cudaFree(s.dout);
	free(s.out);
	pair_fini(&p);
}

/* kvt_graph_reserve under allocation faults (the records, the zero centroids, the step scratch,
 * the records' host copy): each failure returns -ENOMEM and leaves no reservation
 * (kvt_attend_graph refused, steps as before); the call that finally succeeds serves a step equal
 * to the eager one. */
static void test_reserve_faults(void **state)
{
	(void)state;
	struct pair p;
	pair_init(&p, 300, 4, 0);
	const size_t qrow = (size_t)HQ * D;
	int32_t *dseqs;
	float *dout;
	CU(cudaMalloc((void **)&dseqs, sizeof(int32_t) * NSEQ));
	CU(cudaMalloc((void **)&dout, sizeof(float) * NSEQ * qrow));
	const int32_t ids[NSEQ] = {(int32_t)p.sg[0], (int32_t)p.sg[1]};
	CU(cudaMemcpy(dseqs, ids, sizeof ids, cudaMemcpyHostToDevice));
	const kvt_graph_batch gb = {.n_slots = NSEQ, .seqs = dseqs};
	uint32_t failed = 0;
	for (uint64_t f = 1;; f++) {
		T_CHECK(f < 200, "kvt_graph_reserve never succeeded");
		kvt_mem_fail_at(f);
		const int rc = kvt_graph_reserve(p.gpu, NSEQ, 4096, NULL);
		const bool fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc == 0)
			break;
		T_CHECK(fired && rc == -ENOMEM, "fault %llu: %d (%s)", (unsigned long long)f, rc,
			kvt_last_error(p.gpu));
		failed++;
		const int r = kvt_attend_graph(p.gpu, 0, &gb, p.dq, dout, NULL);
		T_CHECK(r == -EINVAL && strstr(kvt_last_error(p.gpu), "kvt_graph_reserve"),
			"fault %llu left a reservation behind: kvt_attend_graph gave %d (%s)",
			(unsigned long long)f, r, kvt_last_error(p.gpu));
		double worst = 0;
		decode_inputs(&p, 0, 0);
		attend_both(&p, 0, 0, &worst); /* steps go on as before */
	}
	T_CHECK(failed > 0, "no failure was injected");
	double worst = 0;
	append_both(&p, 0, 0);
	attend_both(&p, 0, 0, &worst); /* p.out_g: the eager step */
	OK(p.gpu, kvt_attend_graph(p.gpu, 0, &gb, p.dq, dout, NULL));
	float *got = malloc(sizeof(float) * NSEQ * qrow);
	T_CHECK(got != NULL, "out of memory");
	CU(cudaMemcpy(got, dout, sizeof(float) * NSEQ * qrow, cudaMemcpyDeviceToHost));
	T_CHECK(!memcmp(got, p.out_g, sizeof(float) * NSEQ * qrow),
		"after the faults the graph step differs from the eager one");
	printf("graph reserve faults: %u injected failures left no reservation; then the graph step "
	       "equals the eager one\n", failed);
	free(got);
	cudaFree(dseqs);
	cudaFree(dout);
	pair_fini(&p);
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_replay),
		cmocka_unit_test(test_reserve_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
