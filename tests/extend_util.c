/* SPDX-License-Identifier: MIT */
/*
 * The kvt_extend tests' token streams and calls (extend_util.h).
 */
#include "extend_util.h"

uint16_t g_q[NS][MAXT * QROW], g_k[NS][MAXT * KROW], g_v[NS][MAXT * KROW];
uint16_t g_bq[NS * MAXT * QROW], g_bk[NS * MAXT * KROW], g_bv[NS * MAXT * KROW];
uint32_t g_dtype;

void make_streams(uint32_t dtype, uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	g_dtype = dtype;
	/* queries of sd 2: scaled scores of sd about 2, a softmax neither flat nor one-hot */
	for (uint32_t s = 0; s < NS; s++) {
		t_fill(&r, dtype, (size_t)MAXT * QROW, 0.3, 2.0, g_q[s], NULL);
		t_fill(&r, dtype, (size_t)MAXT * KROW, 0.1, 1.0, g_k[s], NULL);
		t_fill(&r, dtype, (size_t)MAXT * KROW, -0.2, 1.0, g_v[s], NULL);
	}
}

kvt_config config(uint32_t dtype, uint32_t out_dtype, float p)
{
	kvt_config cfg = t_config(L, HQ, HKV, D, dtype);
	cfg.out_dtype = out_dtype;
	cfg.p = p;
	return cfg;
}

kvt_cache *make_cache(const kvt_config *cfg)
{
	kvt_cache *c = t_create(cfg);
	for (uint32_t s = 0; s < NS; s++) {
		uint32_t id = UINT32_MAX;
		T_CHECK(kvt_seq_open(c, &id) == 0 && id == s, "seq_open: got %u, wanted %u", id, s);
	}
	return c;
}

uint32_t len_of(kvt_cache *c, uint32_t s)
{
	int64_t n = kvt_seq_length(c, s, LAYER);
	T_CHECK(n >= 0, "kvt_seq_length(%u): %s", s, kvt_last_error(c));
	return (uint32_t)n;
}

size_t out_bytes(const kvt_cache *c, uint32_t rows)
{
	return (size_t)rows * QROW * c->out_elem;
}

int extend_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
		 void *out, uint32_t flags)
{
	uint32_t cu[NS + 1] = {0};
	for (uint32_t i = 0; i < n_seqs; i++) {
		const uint32_t s = seqs[i], from = len_of(c, s);
		T_CHECK(from + n[i] <= MAXT, "stream %u too short for %u + %u", s, from, n[i]);
		memcpy(g_bq + (size_t)cu[i] * QROW, g_q[s] + (size_t)from * QROW, 2ull * n[i] * QROW);
		memcpy(g_bk + (size_t)cu[i] * KROW, g_k[s] + (size_t)from * KROW, 2ull * n[i] * KROW);
		memcpy(g_bv + (size_t)cu[i] * KROW, g_v[s] + (size_t)from * KROW, 2ull * n[i] * KROW);
		cu[i + 1] = cu[i] + n[i];
	}
	return kvt_extend(c, LAYER, n_seqs, seqs, cu, g_bq, g_bk, g_bv, out, flags, NULL);
}

void extend_ok_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
		     void *out, uint32_t flags)
{
	int rc = extend_flags(c, n_seqs, seqs, n, out, flags);
	T_CHECK(rc == 0, "kvt_extend (flags 0x%x): got %d (%s), wanted 0", flags, rc,
		kvt_last_error(c));
}

void extend_ok(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
	       void *out)
{
	extend_ok_flags(c, n_seqs, seqs, n, out, 0);
}

void prefill(kvt_cache *c, uint32_t s, uint32_t n)
{
	const uint32_t from = len_of(c, s);
	int rc = kvt_prefill(c, s, LAYER, g_q[s] + (size_t)from * QROW, g_k[s] + (size_t)from * KROW,
			     g_v[s] + (size_t)from * KROW, n, NULL);
	T_CHECK(rc == 0, "kvt_prefill seq %u: %s", s, kvt_last_error(c));
}

void decode(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, void *out)
{
	for (uint32_t i = 0; i < n_seqs; i++) {
		const uint32_t s = seqs[i], at = len_of(c, s);
		memcpy(g_bq + (size_t)i * QROW, g_q[s] + (size_t)at * QROW, 2ull * QROW);
		memcpy(g_bk + (size_t)i * KROW, g_k[s] + (size_t)at * KROW, 2ull * KROW);
		memcpy(g_bv + (size_t)i * KROW, g_v[s] + (size_t)at * KROW, 2ull * KROW);
	}
	T_CHECK(kvt_append(c, LAYER, n_seqs, seqs, g_bk, g_bv, NULL) == 0, "kvt_append: %s",
		kvt_last_error(c));
	T_CHECK(kvt_attend(c, LAYER, n_seqs, seqs, g_bq, out, NULL) == 0, "kvt_attend: %s",
		kvt_last_error(c));
}

void same_decode(kvt_cache *a, kvt_cache *b, uint32_t steps, const char *what)
{
	static const uint32_t all[NS] = {0, 1, 2, 3};
	uint8_t *oa = t_alloc(out_bytes(a, NS)), *ob = t_alloc(out_bytes(b, NS));
	for (uint32_t t = 0; t < steps; t++) {
		decode(a, NS, all, oa);
		decode(b, NS, all, ob);
		T_CHECK(!memcmp(oa, ob, out_bytes(a, NS)), "%s: decode step %u after: outputs differ",
			what, t);
	}
	free(oa);
	free(ob);
}

void same_layer(kvt_cache *a, kvt_cache *b, uint32_t s, const char *what)
{
	const struct kvt_layer *x = &a->seqs[s].layers[LAYER], *y = &b->seqs[s].layers[LAYER];
	T_CHECK(x->n_tokens == y->n_tokens && x->n_indexed == y->n_indexed &&
			x->centroids == y->centroids && x->n_runs == y->n_runs,
		"%s seq %u: tokens %u/%u, indexed %u/%u, centroids %d/%d, runs %u/%u (got/wanted)",
		what, s, x->n_tokens, y->n_tokens, x->n_indexed, y->n_indexed, x->centroids,
		y->centroids, x->n_runs, y->n_runs);
	T_CHECK(!x->n_runs || !memcmp(x->runs, y->runs, sizeof *x->runs * x->n_runs),
		"%s seq %u: prefill runs differ", what, s);
	if (x->centroids)
		T_CHECK(!memcmp(x->c_k, y->c_k, sizeof(float) * HKV * D) &&
				!memcmp(x->c_q, y->c_q, sizeof(float) * HKV * D),
			"%s seq %u: centroids differ", what, s);
	for (uint32_t h = 0; h < HKV; h++) {
		const size_t ax = (size_t)h * x->idx_cap, ay = (size_t)h * y->idx_cap;
		T_CHECK(!x->n_indexed || /* no index arrays yet: nothing to compare (NULL) */
				(!memcmp(x->codes + ax * a->words, y->codes + ay * b->words,
					 4ull * a->words * x->n_indexed) &&
				 !memcmp(x->sigma + ax, y->sigma + ay, 2ull * x->n_indexed) &&
				 !memcmp(x->beta + ax, y->beta + ay, 2ull * x->n_indexed)),
			"%s seq %u KV head %u: index entries differ", what, s, h);
	}
	if (!x->n_tokens)
		return;
	uint16_t *k = t_alloc(4ull * x->n_tokens * KROW), *v = k + (size_t)x->n_tokens * KROW;
	T_CHECK(kvt_seq_read_rows(a, s, LAYER, 0, x->n_tokens, k, v, NULL) == (int)x->n_tokens,
		"read_rows: %s", kvt_last_error(a));
	T_CHECK(!memcmp(k, g_k[s], 2ull * x->n_tokens * KROW) &&
			!memcmp(v, g_v[s], 2ull * x->n_tokens * KROW),
		"%s seq %u: stored rows are not the stream's", what, s);
	free(k);
}
