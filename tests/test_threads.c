/* SPDX-License-Identifier: MIT */
/*
 * Distinct caches are independent (kvtier.h: calls on one cache are serialized by the caller,
 * distinct caches need nothing): two threads, each with its own CPU-backend cache, run prefill,
 * append and attend loops at the same time, and every output is bit for bit the output of the same
 * workload run alone on one thread. The threads start together so that their first calls race
 * (the scoring variant picked at first use, the allocator's counters, the thread-local create
 * error); built with -Db_sanitize=thread this is the test that ThreadSanitizer must pass cleanly.
 */
#include <pthread.h>

#include "common.h"

enum { LAYERS = 2, NQ = 8, NKV = 2, D = 128, SEQS = 2, PREFILL = 160, STEPS = 24, WORKERS = 2 };
#define OUT_PER_STEP ((size_t)SEQS * NQ * D)
#define OUTS ((size_t)STEPS * LAYERS * OUT_PER_STEP)

struct work {
	uint64_t seed;
	float *out; /* [STEPS, LAYERS, SEQS, NQ, D] */
	int rc;     /* 0, or the first failing call's code */
	char what[320];
	pthread_barrier_t *start;
};

#define W_TRY(w, call)                                                                              \
	do {                                                                                        \
		int rc_ = (call);                                                                   \
		if (rc_ < 0) {                                                                      \
			(w)->rc = rc_;                                                              \
			snprintf((w)->what, sizeof (w)->what, "%s: %d (%s)", #call, rc_,            \
				 kvt_last_error(c));                                                \
			goto out;                                                                   \
		}                                                                                   \
	} while (0)

/* One cache, two sequences: a prefill with queries per layer, then STEPS decode steps of append and
 * attend over both sequences on every layer (flushes into the index included). */
static void *run(void *arg)
{
	struct work *w = (struct work *)arg;
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.seed = w->seed;
	kvt_cache *c = NULL;
	uint16_t *q = malloc(2 * (size_t)PREFILL * NQ * D), *k = malloc(2 * (size_t)PREFILL * NKV * D),
		 *v = malloc(2 * (size_t)PREFILL * NKV * D);
	uint32_t seqs[SEQS];
	t_rng r;
	t_rng_seed(&r, w->seed);
	if (w->start)
		pthread_barrier_wait(w->start);
	if (!q || !k || !v) {
		w->rc = -ENOMEM;
		snprintf(w->what, sizeof w->what, "test buffers");
		goto out;
	}
	W_TRY(w, kvt_cache_create(&cfg, &c));
	for (int s = 0; s < SEQS; s++) {
		W_TRY(w, kvt_seq_open(c, &seqs[s]));
		for (uint32_t l = 0; l < LAYERS; l++) {
			for (size_t i = 0; i < (size_t)PREFILL * NQ * D; i++)
				q[i] = t_enc(KVT_DTYPE_F16, (float)t_normal(&r));
			for (size_t i = 0; i < (size_t)PREFILL * NKV * D; i++) {
				k[i] = t_enc(KVT_DTYPE_F16, (float)(0.3 + t_normal(&r)));
				v[i] = t_enc(KVT_DTYPE_F16, (float)t_normal(&r));
			}
			W_TRY(w, kvt_prefill(c, seqs[s], l, q, k, v, PREFILL, NULL));
		}
	}
	for (uint32_t step = 0; step < STEPS; step++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			for (size_t i = 0; i < (size_t)SEQS * NKV * D; i++) {
				k[i] = t_enc(KVT_DTYPE_F16, (float)(0.3 + t_normal(&r)));
				v[i] = t_enc(KVT_DTYPE_F16, (float)t_normal(&r));
			}
			for (size_t i = 0; i < OUT_PER_STEP; i++)
				q[i] = t_enc(KVT_DTYPE_F16, (float)t_normal(&r));
			W_TRY(w, kvt_append(c, l, SEQS, seqs, k, v, NULL));
			W_TRY(w, kvt_attend(c, l, SEQS, seqs, q,
					    w->out + ((size_t)step * LAYERS + l) * OUT_PER_STEP, NULL));
		}
out:
	kvt_cache_destroy(c);
	free(q);
	free(k);
	free(v);
	return NULL;
}

static void test_two_caches(void **state)
{
	(void)state;
	struct work par[WORKERS], one[WORKERS];
	pthread_t th[WORKERS];
	pthread_barrier_t start;
	T_CHECK(pthread_barrier_init(&start, NULL, WORKERS) == 0, "pthread_barrier_init");
	/* the threads first, so that their first calls into the library are the first of the process */
	for (int i = 0; i < WORKERS; i++) {
		par[i] = (struct work){.seed = 0x7423u + (uint64_t)i, .out = t_alloc(4 * OUTS),
				       .start = &start};
		T_CHECK(pthread_create(&th[i], NULL, run, &par[i]) == 0, "pthread_create %d", i);
	}
	for (int i = 0; i < WORKERS; i++)
		T_CHECK(pthread_join(th[i], NULL) == 0, "pthread_join %d", i);
	pthread_barrier_destroy(&start);
	for (int i = 0; i < WORKERS; i++) {
		one[i] = (struct work){.seed = par[i].seed, .out = t_alloc(4 * OUTS)};
		run(&one[i]);
	}
	for (int i = 0; i < WORKERS; i++) {
		T_CHECK(par[i].rc == 0 && one[i].rc == 0,
			"cache %d: in a thread got %d (%s), alone %d (%s); wanted 0 0", i, par[i].rc,
			par[i].what, one[i].rc, one[i].what);
		size_t diff = 0, first = OUTS;
		for (size_t j = 0; j < OUTS; j++)
			if (t_fbits(par[i].out[j]) != t_fbits(one[i].out[j])) {
				first = diff++ ? first : j;
			}
		T_CHECK(diff == 0,
			"cache %d: %zu of %zu outputs differ between the two-thread run and the run "
			"alone; first at %zu (step %zu, layer %zu): got %.9g, wanted %.9g", i, diff,
			OUTS, first, first / (LAYERS * OUT_PER_STEP),
			first / OUT_PER_STEP % LAYERS, (double)par[i].out[first],
			(double)one[i].out[first]);
		free(par[i].out);
		free(one[i].out);
	}
	print_message("two caches on two threads: %d x %zu outputs equal to the single-thread runs\n",
		      WORKERS, OUTS);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_two_caches),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
