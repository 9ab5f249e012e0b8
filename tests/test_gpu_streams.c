/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's calls on a caller's non-blocking stream (suite gpu), as runtimes and
 * bench/gpu_decode make them; the other GPU tests use the legacy default stream, which is ordered
 * with the synchronous calls the backend makes on it and so hides what is not:
 * - table growth: a sequence prefilled to exactly fill its block table, then one kvt_append (its
 *   block needs a larger table, uploaded anew) and kvt_attend, all on the stream: no error is
 *   reported (the store found its block), and the attention equals the same call's on the legacy
 *   stream, bit for bit. Several trials, each in a fresh sequence, since a missing order shows
 *   only when the copy has not landed yet.
 * - fork: kvt_seq_fork on the stream, then the child attends like its parent, bit for bit (the
 *   mirror's index, centroids and window ring copied). This checks what the copies hold, not their
 *   order: the child's first call makes its device block table, after a device synchronization
 *   that every earlier copy has landed by.
 * Exits 77 (skipped) when no CUDA device is present.
 */
#include "gpu_pair.h"

enum { T_FULL = 65536, CHUNK = 16384, TRIALS = 6 };

struct fixture {
	kvt_cache *c;
	cudaStream_t st;
	uint16_t *hk, *hq; /* host: [CHUNK][HQ][D] random fp16, K and V share it */
	void *dk, *dq, *dout;
	float *out_a, *out_b;
};

static void fx_init(struct fixture *f)
{
	memset(f, 0, sizeof *f);
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	cfg.n_q_heads = HQ;
	cfg.n_kv_heads = HKV;
	cfg.head_dim = D;
	cfg.out_dtype = KVT_DTYPE_F32;
	cfg.backend = KVT_BACKEND_CUDA;
	cfg.max_seqs = 4;
	/* two sequences of a full table plus its growth, rows of fp16 K and V (4 bytes per element
	 * of a head) */
	cfg.host_bytes = (uint64_t)2 * (T_FULL + 512) * HKV * D * 4 + ((uint64_t)64 << 20);
	OK(NULL, kvt_cache_create(&cfg, &f->c));
	CU(cudaStreamCreateWithFlags(&f->st, cudaStreamNonBlocking));
	const size_t n = (size_t)CHUNK * HQ * D;
	f->hk = malloc(2 * n);
	f->hq = malloc(2 * n);
	T_CHECK(f->hk && f->hq, "out of host memory");
	t_rng rng;
	t_rng_seed(&rng, 77);
	t_fill(&rng, KVT_DTYPE_F16, n, 0.0, 1.0, f->hk, NULL);
	t_fill(&rng, KVT_DTYPE_F16, n, 0.0, 1.0, f->hq, NULL);
	CU(cudaMalloc(&f->dk, 2 * n));
	CU(cudaMalloc(&f->dq, 2 * n));
	CU(cudaMalloc(&f->dout, sizeof(float) * HQ * D));
	CU(cudaMemcpy(f->dk, f->hk, 2 * n, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(f->dq, f->hq, 2 * n, cudaMemcpyHostToDevice));
	f->out_a = malloc(sizeof(float) * HQ * D);
	f->out_b = malloc(sizeof(float) * HQ * D);
	T_CHECK(f->out_a && f->out_b, "out of host memory");
}

static void fx_free(struct fixture *f)
{
	kvt_cache_destroy(f->c);
	cudaStreamDestroy(f->st);
	cudaFree(f->dk);
	cudaFree(f->dq);
	cudaFree(f->dout);
	free(f->hk);
	free(f->hq);
	free(f->out_a);
	free(f->out_b);
}

/* A new sequence of T_FULL tokens, prefilled on the stream (K = V = the random rows). */
static uint32_t full_seq(struct fixture *f)
{
	uint32_t s = 0;
	OK(f->c, kvt_seq_open(f->c, &s));
	for (uint32_t at = 0; at < T_FULL; at += CHUNK)
		OK(f->c, kvt_prefill(f->c, s, 0, f->dq, f->dk, f->dk, CHUNK, f->st));
	return s;
}

/* seq s attends query row 0 on `stream` into out (host), the stream then synchronized. */
static void attend_to(struct fixture *f, uint32_t s, cudaStream_t stream, float *out)
{
	OK(f->c, kvt_attend(f->c, 0, 1, &s, f->dq, f->dout, stream));
	CU(cudaMemcpyAsync(out, f->dout, sizeof(float) * HQ * D, cudaMemcpyDeviceToHost, stream));
	CU(cudaStreamSynchronize(stream));
}

static void test_table_growth(void **state)
{
	(void)state;
	struct fixture f;
	fx_init(&f);
	kvt_stats st = {.size = sizeof st};
	for (int t = 0; t < (g_quick ? 2 : TRIALS); t++) {
		const uint32_t s = full_seq(&f);
		const struct kvt_layer *l = &f.c->seqs[s].layers[0];
		CU(cudaStreamSynchronize(f.st));
		OK(f.c, kvt_get_stats(f.c, &st)); /* every earlier error slot read */
		T_CHECK(l->n_blocks == T_FULL / KVT_BLOCK_TOKENS && l->blk_cap == l->n_blocks,
			"trial %d: the prefill left %u of %u table entries used, wanted all %u", t,
			l->n_blocks, l->blk_cap, T_FULL / KVT_BLOCK_TOKENS);
		/* token T_FULL: its block is one past the table, which grows and is uploaded anew */
		OK(f.c, kvt_append(f.c, 0, 1, &s, f.dk, f.dk, f.st));
		T_CHECK(l->blk_cap > T_FULL / KVT_BLOCK_TOKENS,
			"trial %d: the append left the table at %u entries, wanted it grown", t,
			l->blk_cap);
		attend_to(&f, s, f.st, f.out_a);
		const int rc = kvt_get_stats(f.c, &st);
		T_CHECK(rc == 0, "trial %d: the append after the table's growth reported %d: %s", t,
			rc, kvt_last_error(f.c));
		T_CHECK(kvt_seq_length(f.c, s, 0) == T_FULL + 1, "trial %d: length %lld", t,
			(long long)kvt_seq_length(f.c, s, 0));
		attend_to(&f, s, NULL, f.out_b);
		T_CHECK(!memcmp(f.out_a, f.out_b, sizeof(float) * HQ * D),
			"trial %d: attention on the non-blocking stream differs from the legacy one's",
			t);
		OK(f.c, kvt_seq_close(f.c, s));
	}
	fx_free(&f);
}

static void test_fork(void **state)
{
	(void)state;
	struct fixture f;
	fx_init(&f);
	const uint32_t s = full_seq(&f);
	OK(f.c, kvt_append(f.c, 0, 1, &s, f.dk, f.dk, f.st));
	uint32_t child = 0;
	OK(f.c, kvt_seq_fork(f.c, s, &child, f.st));
	attend_to(&f, child, f.st, f.out_b);
	attend_to(&f, s, f.st, f.out_a);
	T_CHECK(!memcmp(f.out_a, f.out_b, sizeof(float) * HQ * D),
		"a child forked on the non-blocking stream attends unlike its parent");
	kvt_stats st = {.size = sizeof st};
	OK(f.c, kvt_get_stats(f.c, &st));
	fx_free(&f);
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_table_growth),
		cmocka_unit_test(test_fork),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
