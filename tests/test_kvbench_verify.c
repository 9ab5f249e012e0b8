/* SPDX-License-Identifier: MIT */
/*
 * kvbench's stress verifier (tools/kvbench_verify.c) against a real cache: a clean gather verifies
 * every row; after one byte of one host-tier row is flipped underneath the library (through the
 * internal kvt_row), the verifier reports exactly that row: sequence, layer, KV head, position,
 * K or V, and the tier.
 */
#include "common.h"

#include "kvbench_verify.h"

enum { D = 64, KV = 2, QH = 4, N = 600 };

typedef struct truth_ctx {
	uint16_t *k, *v; /* [N, KV, D] */
} truth_ctx;

static void truth(void *ctx, uint32_t s, uint32_t l, uint32_t h, uint32_t pos, uint16_t *k,
		  uint16_t *v)
{
	const truth_ctx *t = ctx;
	(void)s;
	(void)l;
	memcpy(k, t->k + ((size_t)pos * KV + h) * D, D * 2);
	memcpy(v, t->v + ((size_t)pos * KV + h) * D, D * 2);
}

static const char *tier(void *ctx, uint32_t s, uint32_t l, uint32_t h, uint32_t pos)
{
	(void)ctx, (void)s, (void)l, (void)h, (void)pos;
	return "host";
}

/* Select (p = 1: every indexed token), gather and verify; returns the verifier's result. */
static int64_t select_verify(kvt_cache *c, uint32_t id, const uint16_t *q, truth_ctx *tc,
			     kb_mismatch *bad)
{
	int m = kvt_select(c, 0, 1, &id, q, NULL);
	T_CHECK(m > 0, "kvt_select: got %d (%s)", m, kvt_last_error(c));
	int32_t counts[KV], *pos = t_alloc((size_t)KV * m * 4);
	uint16_t *ko = t_alloc((size_t)KV * m * D * 2), *vo = t_alloc((size_t)KV * m * D * 2);
	int rc = kvt_gather(c, 0, 1, &id, (uint32_t)m, counts, pos, ko, vo, NULL);
	T_CHECK(rc == KV * N, "kvt_gather: got %d, wanted %d (every token)", rc, KV * N);
	uint16_t scratch[2 * D];
	uint32_t sidx = 0, len = N;
	kb_verifier v = {.kv_heads = KV, .d = D, .truth = truth, .tier = tier, .ctx = tc,
			 .scratch = scratch};
	int64_t r = kb_verify_gather(&v, 0, 1, &sidx, &len, (uint32_t)m, counts, pos, ko, vo, bad);
	free(pos);
	free(ko);
	free(vo);
	return r;
}

static void test_corrupt_row(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, QH, KV, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	kvt_cache *c = t_create(&cfg);
	uint32_t id;
	T_CHECK(kvt_seq_open(c, &id) == 0, "kvt_seq_open");
	t_rng r;
	t_rng_seed(&r, 5);
	truth_ctx tc = {t_alloc((size_t)N * KV * D * 2), t_alloc((size_t)N * KV * D * 2)};
	uint16_t q[QH * D];
	t_fill(&r, KVT_DTYPE_F16, (size_t)N * KV * D, 0, 1, tc.k, NULL);
	t_fill(&r, KVT_DTYPE_F16, (size_t)N * KV * D, 0, 1, tc.v, NULL);
	t_fill(&r, KVT_DTYPE_F16, QH * D, 0, 1, q, NULL);
	int rc = kvt_prefill(c, id, 0, NULL, tc.k, tc.v, N, NULL);
	T_CHECK(rc == 0, "kvt_prefill: got %d (%s)", rc, kvt_last_error(c));

	kb_mismatch bad;
	int64_t ok = select_verify(c, id, q, &tc, &bad);
	T_CHECK(ok == KV * N, "clean cache: verified %lld rows, wanted %d", (long long)ok, KV * N);

	/* one bit of element 5 of the V half of (KV head 1, position 300) in the host tier */
	const uint32_t h = 1, p = 300, e = 5;
	struct kvt_layer *L = &c->seqs[id].layers[0];
	uint8_t *row = kvt_row(c, L, h, p);
	row[(D + e) * 2] ^= 0x01;
	ok = select_verify(c, id, q, &tc, &bad);
	char msg[256];
	kb_mismatch_text(&bad, msg, sizeof msg);
	T_CHECK(ok == -1, "corrupted row: verifier returned %lld, wanted -1", (long long)ok);
	T_CHECK(bad.seq == 0 && bad.layer == 0 && bad.kv_head == h && bad.pos == (int32_t)p &&
			bad.part == 1 && bad.elem == e,
		"corrupted row: the verifier named '%s', wanted sequence 0, layer 0, KV head %u, "
		"position %u, V[%u]", msg, h, p, e);
	T_CHECK(strstr(msg, "position 300 (host): V[5]") != NULL, "message '%s'", msg);
	T_CHECK(bad.got == (uint16_t)(bad.want ^ 0x01), "got 0x%04x, want 0x%04x", bad.got,
		bad.want);
	free(tc.k);
	free(tc.v);
	kvt_cache_destroy(c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_corrupt_row)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
