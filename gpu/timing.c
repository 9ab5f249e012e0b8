/* SPDX-License-Identifier: MIT */
/*
 * Stage timing of the CUDA backend: a pool of CUDA event sets recorded around the stages of a step,
 * an index build or a store, harvested into the ns_* counters of kvt_stats once complete. A set is
 * reused only after its last event completed; a step finds none free (or its stream is being
 * captured, where events cannot be timed) and goes untimed rather than waiting.
 */
#include "cuda_backend.h"

static uint64_t ns_between(cudaEvent_t a, cudaEvent_t b)
{
	float ms = 0.0f;
	return cudaEventElapsedTime(&ms, a, b) == cudaSuccess && ms > 0 ? (uint64_t)(ms * 1e6) : 0;
}

void gpu_harvest(kvt_cache *c, struct gpu_timing *t)
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

struct gpu_timing *gpu_timing(kvt_cache *c, void *stream, int kind)
{
	struct gpu_cache *b = gpu_of(c);
	if (gpu_capturing(stream) || !b->t[0].ev[0])
		return NULL;
	struct gpu_timing *t = &b->t[b->t_next];
	if (t->kind != T_NONE) {
		if (cudaEventQuery(t->ev[t->kind == T_STEP ? 3 : 1]) != cudaSuccess)
			return NULL;
		gpu_harvest(c, t);
	}
	b->t_next = (b->t_next + 1) % GPU_TIMING_SETS;
	t->kind = kind;
	return t;
}

void gpu_mark(struct gpu_timing *t, int i, void *stream)
{
	if (t)
		cudaEventRecord(t->ev[i], (cudaStream_t)stream);
}
