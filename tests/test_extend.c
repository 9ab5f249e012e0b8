/* SPDX-License-Identifier: MIT */
/*
 * kvt_extend on the CPU backend: several new tokens per sequence attending everything stored before
 * them. Against a double-precision reference for every query row; the stored state bit for bit that
 * of kvt_prefill of the same chunks, and the outputs bit for bit those of appending the tokens one
 * at a time and attending at p = 1; a varlen batch (an empty entry included) equal to the entries
 * extended alone; bad arguments refused by name with nothing changed; allocation faults that leave
 * every sequence as it was. With KVT_EXTEND_TOPP (Top-p per query row): each entry's last row bit
 * for bit kvt_attend of its query (also with score corrections recorded by earlier decode steps,
 * which change the rows against a twin without them), p = 1 equal to exact attention, every row
 * equal to an oracle
 * built from one-token prefills and kvt_attend (with its selection counters), and later tokens of
 * the chunk masked out of an earlier row's selection. With --nvme: a spilled sequence, its rows
 * read from NVMe, equal to the same sequence unspilled (exact and Top-p).
 */
#include "common.h"
#include "tier_util.h"

enum { L = 2, HQ = 4, HKV = 2, D = 64, NS = 4, MAXT = 1024, LAYER = 1 };
#define KROW (HKV * D)
#define QROW (HQ * D)

/* Token streams: sequence s of a cache (opened in order, so its id is s) takes its tokens from
 * stream s, token i at position i, on every layer. */
static uint16_t g_q[NS][MAXT * QROW], g_k[NS][MAXT * KROW], g_v[NS][MAXT * KROW];
/* a batch's rows packed [total, heads, D] */
static uint16_t g_bq[NS * MAXT * QROW], g_bk[NS * MAXT * KROW], g_bv[NS * MAXT * KROW];
static uint32_t g_dtype;

static void make_streams(uint32_t dtype, uint64_t seed)
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

static kvt_config config(uint32_t dtype, uint32_t out_dtype, float p)
{
	kvt_config cfg = t_config(L, HQ, HKV, D, dtype);
	cfg.out_dtype = out_dtype;
	cfg.p = p;
	return cfg;
}

/* A cache with NS sequences open (ids 0 .. NS - 1). */
static kvt_cache *make_cache(const kvt_config *cfg)
{
	kvt_cache *c = t_create(cfg);
	for (uint32_t s = 0; s < NS; s++) {
		uint32_t id = UINT32_MAX;
		T_CHECK(kvt_seq_open(c, &id) == 0 && id == s, "seq_open: got %u, wanted %u", id, s);
	}
	return c;
}

static uint32_t len_of(kvt_cache *c, uint32_t s)
{
	int64_t n = kvt_seq_length(c, s, LAYER);
	T_CHECK(n >= 0, "kvt_seq_length(%u): %s", s, kvt_last_error(c));
	return (uint32_t)n;
}

static size_t out_bytes(const kvt_cache *c, uint32_t rows)
{
	return (size_t)rows * QROW * c->out_elem;
}

/* kvt_extend of entry i = sequence seqs[i], n[i] tokens of its stream from its length. */
static int extend_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
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

static void extend_ok_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs,
			    const uint32_t *n, void *out, uint32_t flags)
{
	int rc = extend_flags(c, n_seqs, seqs, n, out, flags);
	T_CHECK(rc == 0, "kvt_extend (flags 0x%x): got %d (%s), wanted 0", flags, rc,
		kvt_last_error(c));
}

static void extend_ok(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
		      void *out)
{
	extend_ok_flags(c, n_seqs, seqs, n, out, 0);
}

/* The same chunk of sequence s through kvt_prefill. */
static void prefill(kvt_cache *c, uint32_t s, uint32_t n)
{
	const uint32_t from = len_of(c, s);
	int rc = kvt_prefill(c, s, LAYER, g_q[s] + (size_t)from * QROW, g_k[s] + (size_t)from * KROW,
			     g_v[s] + (size_t)from * KROW, n, NULL);
	T_CHECK(rc == 0, "kvt_prefill seq %u: %s", s, kvt_last_error(c));
}

/* One decode step of sequences seqs: the next token of each stream appended, then attended. */
static void decode(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, void *out)
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

/* Decode steps of all NS sequences on a and b: their outputs bit for bit equal. */
static void same_decode(kvt_cache *a, kvt_cache *b, uint32_t steps, const char *what)
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

/* Layer LAYER of sequence s in a and b: lengths, index (entries, centroids, runs), rows equal. */
static void same_layer(kvt_cache *a, kvt_cache *b, uint32_t s, const char *what)
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

/* ---- (1) every query row against a double-precision reference ----------------------------- */

/* Row j of a chunk of sequence s begun at `first`, against the reference over [0, first + j]. */
static void check_row(const float *out, uint32_t s, uint32_t first, uint32_t j, float scale,
		      const char *what)
{
	const uint32_t P = first + j, G = HQ / HKV;
	float *kf = t_alloc(4ull * (P + 1) * D), *vf = t_alloc(4ull * (P + 1) * D), q[D];
	const float **kp = t_alloc(sizeof(float *) * (P + 1)), **vp = t_alloc(sizeof(float *) * (P + 1));
	double ref[D], mag[D];
	for (uint32_t qh = 0; qh < HQ; qh++) {
		const uint32_t h = qh / G;
		for (uint32_t t = 0; t <= P; t++) {
			for (uint32_t e = 0; e < D; e++) {
				kf[(size_t)t * D + e] = t_dec(g_dtype, g_k[s][((size_t)t * HKV + h) * D + e]);
				vf[(size_t)t * D + e] = t_dec(g_dtype, g_v[s][((size_t)t * HKV + h) * D + e]);
			}
			kp[t] = kf + (size_t)t * D;
			vp[t] = vf + (size_t)t * D;
		}
		for (uint32_t e = 0; e < D; e++)
			q[e] = t_dec(g_dtype, g_q[s][((size_t)P * HQ + qh) * D + e]);
		t_ref_attention(D, scale, q, P + 1, kp, vp, ref, mag);
		const float *o = out + ((size_t)j * HQ + qh) * D;
		for (uint32_t e = 0; e < D; e++)
			T_CHECK(fabs(o[e] - ref[e]) <= 1e-5 * mag[e],
				"%s: position %u (chunk row %u), query head %u, out[%u] got %.9g, wanted "
				"%.9g (rel err %.3g of sum p|v| = %.6g, wanted < 1e-5)",
				what, P, j, qh, e, (double)o[e], ref[e], fabs(o[e] - ref[e]) / mag[e],
				mag[e]);
	}
	free(kf);
	free(vf);
	free(kp);
	free(vp);
}

static void test_reference(void **state)
{
	(void)state;
	/* the first chunk (centroids), one token, a chunk across the window, sinks and a block end */
	static const uint32_t chunks[][3] = {{37, 1, 50}, {3, 300, 5}};
	for (uint32_t ci = 0; ci < 2; ci++) {
		make_streams(KVT_DTYPE_F16, 0xe7e0 + ci);
		kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
		kvt_cache *c = make_cache(&cfg);
		for (uint32_t k = 0; k < 3; k++) {
			const uint32_t s = 1, n = chunks[ci][k], first = len_of(c, s);
			float *out = t_alloc(out_bytes(c, n));
			char what[64];
			extend_ok(c, 1, &s, &n, out);
			T_CHECK(len_of(c, s) == first + n, "length after the chunk: got %u, wanted %u",
				len_of(c, s), first + n);
			snprintf(what, sizeof what, "chunks %u/%u/%u, chunk %u", chunks[ci][0],
				 chunks[ci][1], chunks[ci][2], k);
			for (uint32_t j = 0; j < n; j++)
				check_row(out, s, first, j, c->scale, what);
			free(out);
		}
		kvt_cache_destroy(c);
	}
}

/* ---- (2) the stored state of kvt_prefill, the outputs of appends attended at p = 1 --------- */

static void test_twins(void **state)
{
	(void)state;
	static const uint32_t chunks[] = {37, 1, 50, 290, 2};
	static const uint32_t dtypes[][2] = {{KVT_DTYPE_F16, KVT_DTYPE_F32},
					     {KVT_DTYPE_BF16, KVT_DTYPE_BF16}};
	for (uint32_t di = 0; di < 2; di++) {
		make_streams(dtypes[di][0], 0x7a1 + di);
		kvt_config cfg = config(dtypes[di][0], dtypes[di][1], 0);
		kvt_config full = config(dtypes[di][0], dtypes[di][1], 1.0f);
		kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg), *c = make_cache(&full);
		const uint32_t s = 2;
		for (uint32_t k = 0; k < sizeof chunks / sizeof *chunks; k++) {
			const uint32_t n = chunks[k], first = len_of(a, s);
			uint8_t *oa = t_alloc(out_bytes(a, n)), *oc = t_alloc(out_bytes(a, n));
			extend_ok(a, 1, &s, &n, oa);
			prefill(b, s, n);
			for (uint32_t j = 0; j < n; j++)
				decode(c, 1, &s, oc + out_bytes(a, j));
			for (uint32_t j = 0; j < n; j++)
				T_CHECK(!memcmp(oa + out_bytes(a, j), oc + out_bytes(a, j), out_bytes(a, 1)),
					"%s: chunk %u, position %u: extend's output differs from append "
					"+ attend at p = 1", t_dtype_name(dtypes[di][0]), k, first + j);
			same_layer(a, b, s, "extend vs prefill");
			kvt_stats sa = t_stats(a), sb = t_stats(b);
			T_CHECK(sa.tokens == sb.tokens && sa.tokens_indexed == sb.tokens_indexed,
				"stats: tokens %llu/%llu, indexed %llu/%llu", (unsigned long long)sa.tokens,
				(unsigned long long)sb.tokens, (unsigned long long)sa.tokens_indexed,
				(unsigned long long)sb.tokens_indexed);
			free(oa);
			free(oc);
		}
		same_decode(a, b, 30, "extend vs prefill");
		same_layer(a, b, s, "extend vs prefill, after decoding");
		kvt_cache_destroy(a);
		kvt_cache_destroy(b);
		kvt_cache_destroy(c);
	}
}

/* ---- (3) a varlen batch equals its entries extended alone ----------------------------------- */

static void test_varlen(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0xba7c);
	kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
	kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg);
	static const uint32_t pre[NS] = {40, 0, 300, 7};
	static const uint32_t seqs[NS] = {2, 0, 3, 1}, n[NS] = {5, 17, 0, 1};
	for (uint32_t s = 0; s < NS; s++)
		for (kvt_cache *c = a; pre[s] && c; c = c == a ? b : NULL)
			prefill(c, s, pre[s]);
	/* the empty entry's selection survives the call */
	const uint32_t idle = 3;
	T_CHECK(kvt_select(a, LAYER, 1, &idle, g_q[idle], NULL) > 0, "select: %s", kvt_last_error(a));
	const uint64_t epoch = a->seqs[idle].layers[LAYER].sel_epoch;
	uint32_t total = 0;
	for (uint32_t i = 0; i < NS; i++)
		total += n[i];
	uint8_t *oa = t_alloc(out_bytes(a, total)), *ob = t_alloc(out_bytes(a, total));
	extend_ok(a, NS, seqs, n, oa);
	for (uint32_t i = 0, row = 0; i < NS; row += n[i], i++)
		if (n[i])
			extend_ok(b, 1, &seqs[i], &n[i], ob + out_bytes(a, row));
	for (uint32_t i = 0, row = 0; i < NS; row += n[i], i++)
		T_CHECK(!memcmp(oa + out_bytes(a, row), ob + out_bytes(a, row), out_bytes(a, n[i])),
			"entry %u (seq %u, %u tokens after %u): batch output differs from alone", i,
			seqs[i], n[i], pre[seqs[i]]);
	T_CHECK(a->seqs[idle].layers[LAYER].sel_epoch == epoch && len_of(a, idle) == pre[idle],
		"the empty entry changed: length %u (wanted %u), selection epoch %llu (wanted %llu)",
		len_of(a, idle), pre[idle],
		(unsigned long long)a->seqs[idle].layers[LAYER].sel_epoch, (unsigned long long)epoch);
	for (uint32_t s = 0; s < NS; s++)
		same_layer(a, b, s, "batch vs alone");
	same_decode(a, b, 12, "batch vs alone");
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/* ---- (5) bad arguments: refused by name, nothing changed ------------------------------------ */

/* What a failed call must leave as it was. */
struct snap {
	uint32_t len[NS][L], indexed[NS][L];
	uint64_t tokens, tokens_indexed, host_used, sel[NS];
};

static void snap_take(kvt_cache *c, struct snap *sn)
{
	memset(sn, 0, sizeof *sn);
	for (uint32_t s = 0; s < NS && c->seqs[s].open; s++) {
		for (uint32_t l = 0; l < L; l++) {
			sn->len[s][l] = c->seqs[s].layers[l].n_tokens;
			sn->indexed[s][l] = c->seqs[s].layers[l].n_indexed;
		}
		sn->sel[s] = c->seqs[s].layers[LAYER].sel_epoch;
	}
	kvt_stats st = t_stats(c);
	sn->tokens = st.tokens;
	sn->tokens_indexed = st.tokens_indexed;
	sn->host_used = st.host_bytes_used;
}

enum { NO_Q = 1, NO_K = 2, NO_V = 4, NO_OUT = 8, NO_CU = 16, NO_SEQS = 32 };

/* One refused call: kvt_extend(c, layer, n_seqs, seqs, cu, ...), the pointers of `drop` NULL. */
struct bad {
	const char *name;
	int want;
	const char *text; /* kvt_last_error must contain it */
	uint32_t layer, n_seqs, flags, drop;
	const uint32_t *seqs, *cu;
};

static void check_bad(kvt_cache *c, const struct bad *b, int rc, const struct snap *s0)
{
	struct snap s1;
	const char *e = kvt_last_error(c);
	T_CHECK(rc == b->want && strstr(e, b->text), "%s: got %d (\"%s\"), wanted %d naming \"%s\"",
		b->name, rc, e, b->want, b->text);
	snap_take(c, &s1);
	T_CHECK(!memcmp(s0, &s1, sizeof s1), "%s: the failed call changed the cache", b->name);
}

static int call_bad(kvt_cache *c, const struct bad *b, uint16_t *q, uint16_t *k, uint16_t *v,
		    float *out)
{
	return kvt_extend(c, b->layer, b->n_seqs, b->drop & NO_SEQS ? NULL : b->seqs,
			  b->drop & NO_CU ? NULL : b->cu, b->drop & NO_Q ? NULL : q,
			  b->drop & NO_K ? NULL : k, b->drop & NO_V ? NULL : v,
			  b->drop & NO_OUT ? NULL : out, b->flags, NULL);
}

static void test_bad_arguments(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0xbad);
	kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
	kvt_cache *c = make_cache(&cfg);
	for (uint32_t s = 0; s < 3; s++)
		prefill(c, s, 20 + 30 * s);
	T_CHECK(kvt_seq_close(c, 3) == 0, "close");
	static const uint32_t seqs[] = {0, 1, 2}, dup[] = {0, 1, 0}, shut[] = {0, 3};
	static const uint32_t cu[] = {0, 2, 5, 6}, cu0[] = {1, 2, 5, 6}, cud[] = {0, 4, 3, 6};
	static const uint32_t cuz[] = {0, 0, 0, 0}, cubig[] = {0, 0x80000000u};
#define GOOD LAYER, 3, 0
	static const struct bad table[] = {
		{"q NULL", -EINVAL, "q is NULL", GOOD, NO_Q, seqs, cu},
		{"k NULL", -EINVAL, "k is NULL", GOOD, NO_K, seqs, cu},
		{"v NULL", -EINVAL, "v is NULL", GOOD, NO_V, seqs, cu},
		{"out NULL", -EINVAL, "out is NULL", GOOD, NO_OUT, seqs, cu},
		{"cu NULL", -EINVAL, "cu_seqlens is NULL", GOOD, NO_CU, seqs, cu},
		{"seqs NULL", -EINVAL, "seqs is NULL", GOOD, NO_SEQS, seqs, cu},
		{"flags", -EINVAL, "flags = 0x4", LAYER, 3, 4, 0, seqs, cu},
		{"flags past Top-p", -EINVAL, "flags = 0x80000001, unknown bits 0x80000000", LAYER, 3,
		 0x80000001u, 0, seqs, cu},
		{"layer", -EINVAL, "layer = 2", L, 3, 0, 0, seqs, cu},
		{"n_seqs 0", -EINVAL, "n_seqs = 0", LAYER, 0, 0, 0, seqs, cu},
		{"n_seqs big", -EINVAL, "n_seqs = 9", LAYER, 9, 0, 0, seqs, cu},
		{"cu[0]", -EINVAL, "cu_seqlens[0] = 1", GOOD, 0, seqs, cu0},
		{"cu decreasing", -EINVAL, "cu_seqlens[2] = 3 is below cu_seqlens[1] = 4", GOOD, 0,
		 seqs, cud},
		{"total 0", -EINVAL, "total 0", GOOD, 0, seqs, cuz},
		{"total big", -EINVAL, "cu_seqlens[1] = 2147483648", LAYER, 1, 0, 0, seqs, cubig},
		{"twice", -EINVAL, "seqs[0] = seqs[2] = 0", GOOD, 0, dup, cu},
		{"not open", -ENOENT, "seq = 3", LAYER, 2, 0, 0, shut, cu},
	};
#undef GOOD
	const struct bad good = {"", 0, "", LAYER, 3, 0, 0, seqs, cu};
	uint16_t *q = calloc(6, 2 * QROW), *k = calloc(6, 2 * KROW), *v = calloc(6, 2 * KROW);
	float *out = calloc(6, 4 * QROW);
	struct snap s0;
	snap_take(c, &s0);
	T_CHECK(kvt_extend(NULL, LAYER, 3, seqs, cu, q, k, v, out, 0, NULL) == -EINVAL &&
			strstr(kvt_last_error(NULL), "cache is NULL"),
		"NULL cache: %s", kvt_last_error(NULL));
	for (size_t i = 0; i < sizeof table / sizeof *table; i++)
		check_bad(c, &table[i], call_bad(c, &table[i], q, k, v, out), &s0);
	/* too long: seq 1 made to look full for the call */
	const struct bad too_long = {"too long", -EINVAL,
				     "seqs[1] = 1: 3 new tokens would grow layer 1 past", LAYER, 3, 0,
				     0, seqs, cu};
	c->seqs[1].layers[LAYER].n_tokens = INT32_MAX - 1;
	int rc = call_bad(c, &too_long, q, k, v, out);
	c->seqs[1].layers[LAYER].n_tokens = s0.len[1][LAYER];
	check_bad(c, &too_long, rc, &s0);
	k[(size_t)4 * KROW + D + 3] = 0x7c00; /* +inf: row 4, KV head 1, element 3 */
	const struct bad key = {"non-finite key", -EINVAL, "k[4, 1, 3] = inf", LAYER, 3, 0, 0, seqs,
				cu};
	check_bad(c, &key, call_bad(c, &key, q, k, v, out), &s0);
	k[(size_t)4 * KROW + D + 3] = 0;
	q[(size_t)5 * QROW + 2 * D + 7] = 0x7e00; /* NaN: row 5, query head 2, element 7 */
	const struct bad query = {"non-finite query", -EINVAL, "q[5, 2, 7] = nan", LAYER, 3, 0, 0,
				  seqs, cu};
	check_bad(c, &query, call_bad(c, &query, q, k, v, out), &s0);
	q[(size_t)5 * QROW + 2 * D + 7] = 0;
	/* a backend without the verb, with and without Top-p; one without Top-p per query row (the
	 * CUDA backend) */
	const struct bad cuda[] = {{"no backend verb", -EOPNOTSUPP,
				    "backend has no multi-token attention", LAYER, 3, 0, 0, seqs,
				    cu},
				   {"no backend verb, Top-p", -EOPNOTSUPP,
				    "backend has no multi-token attention", LAYER, 3,
				    KVT_EXTEND_TOPP, 0, seqs, cu},
				   {"no Top-p per row", -EOPNOTSUPP,
				    "Top-p per query row is the cpu backend's", LAYER, 3,
				    KVT_EXTEND_TOPP, 0, seqs, cu}};
	struct kvt_backend_ops no_extend = *c->ops, no_topp = *c->ops;
	const struct kvt_backend_ops *ops = c->ops;
	no_extend.extend = NULL;
	no_topp.extend_topp = false;
	for (uint32_t i = 0; i < 3; i++) {
		c->ops = i < 2 ? &no_extend : &no_topp;
		rc = call_bad(c, &cuda[i], q, k, v, out);
		c->ops = ops;
		check_bad(c, &cuda[i], rc, &s0);
	}
	T_CHECK(call_bad(c, &good, q, k, v, out) == 0, "the good call after them: %s",
		kvt_last_error(c));
	free(q);
	free(k);
	free(v);
	free(out);
	kvt_cache_destroy(c);
}

/* ---- (6) allocation faults over a batch extend ---------------------------------------------- */

/* Three sequences with history; the batch grows each by blocks and index. */
static kvt_cache *fault_cache(void)
{
	kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
	kvt_cache *c = make_cache(&cfg);
	prefill(c, 0, 30);
	prefill(c, 1, 250);
	prefill(c, 2, 3);
	return c;
}

static void faults(uint32_t flags)
{
	make_streams(KVT_DTYPE_F16, 0xfa17);
	const uint32_t seqs[] = {1, 3, 0, 2}, n[] = {300, 0, 40, 270};
	const uint32_t total = 610;
	const int64_t live0 = kvt_mem_live();
	uint64_t fault = 1;
	for (;; fault++) {
		kvt_cache *c = fault_cache(), *twin = fault_cache();
		uint8_t *oc = t_alloc(out_bytes(c, total)), *ot = t_alloc(out_bytes(c, total));
		struct snap s0, s1;
		snap_take(c, &s0);
		kvt_mem_fail_at(fault);
		int rc = extend_flags(c, 4, seqs, n, oc, flags);
		int fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
		if (rc < 0) {
			T_CHECK(fired && (rc == -ENOMEM || rc == -ENOSPC) && *kvt_last_error(c),
				"fault %llu: got %d (%s), fired %d", (unsigned long long)fault, rc,
				kvt_last_error(c), fired);
			snap_take(c, &s1);
			T_CHECK(!memcmp(&s0, &s1, sizeof s0), "fault %llu: the failed call changed the "
				"cache (tokens %llu -> %llu, host %llu -> %llu)", (unsigned long long)fault,
				(unsigned long long)s0.tokens, (unsigned long long)s1.tokens,
				(unsigned long long)s0.host_used, (unsigned long long)s1.host_used);
			for (uint32_t s = 0; s < NS; s++)
				same_layer(c, twin, s, "after a fault, vs the untouched twin");
			/* the same call again, now without a fault, and what follows */
			extend_ok_flags(c, 4, seqs, n, oc, flags);
		} else {
			T_CHECK(!fired, "fault %llu fired but the call succeeded", (unsigned long long)fault);
		}
		extend_ok_flags(twin, 4, seqs, n, ot, flags);
		T_CHECK(!memcmp(oc, ot, out_bytes(c, total)), "fault %llu: outputs differ from the twin",
			(unsigned long long)fault);
		same_decode(c, twin, 3, "after a fault");
		free(oc);
		free(ot);
		kvt_cache_destroy(c);
		kvt_cache_destroy(twin);
		T_CHECK(kvt_mem_live() == live0, "fault %llu: live allocations %lld, wanted %lld",
			(unsigned long long)fault, (long long)kvt_mem_live(), (long long)live0);
		if (!fired)
			break;
	}
	print_message("batch extend (flags 0x%x): %llu allocation faults, each left every sequence "
		      "as it was\n", flags, (unsigned long long)(fault - 1));
}

static void test_faults(void **state)
{
	(void)state;
	faults(0);
	faults(KVT_EXTEND_TOPP);
}

/* ---- (7) Top-p per query row (KVT_EXTEND_TOPP) --------------------------------------------- */

static kvt_config topp_config(uint32_t dtype, float p, uint32_t window, uint32_t bmin,
			      uint32_t bmax)
{
	kvt_config cfg = config(dtype, dtype == KVT_DTYPE_F16 ? KVT_DTYPE_F32 : dtype, p);
	cfg.window = window;
	cfg.budget_min = bmin;
	cfg.budget_max = bmax;
	return cfg;
}

/* The selection counters of kvt_stats. */
struct sel_stats {
	uint64_t steps, candidates, selected, max_hits, min_hits, rows;
};

static struct sel_stats sel_stats(kvt_cache *c)
{
	kvt_stats st = t_stats(c);
	return (struct sel_stats){st.steps, st.candidate_tokens, st.selected_tokens,
				  st.budget_max_hits, st.budget_min_hits, st.rows_fetched};
}

static struct sel_stats sel_delta(struct sel_stats a, struct sel_stats b)
{
	return (struct sel_stats){b.steps - a.steps, b.candidates - a.candidates,
				  b.selected - a.selected, b.max_hits - a.max_hits,
				  b.min_hits - a.min_hits, b.rows - a.rows};
}

/* Each entry's last row equals kvt_attend of that query row right after the call, bit for bit. */
static void test_topp_last_row(void **state)
{
	(void)state;
	static const uint32_t pre[NS] = {40, 0, 300, 7};
	static const uint32_t seqs[NS] = {2, 0, 3, 1}, n[NS] = {37, 50, 0, 1};
	const kvt_config cfgs[] = {topp_config(KVT_DTYPE_F16, 0.9f, 16, 8, 0),
				   topp_config(KVT_DTYPE_BF16, 0.5f, 16, KVT_NONE, 24)};
	for (uint32_t ci = 0; ci < 2; ci++) {
		make_streams(cfgs[ci].dtype, 0x709 + ci);
		kvt_cache *a = make_cache(&cfgs[ci]), *b = make_cache(&cfgs[ci]);
		for (uint32_t s = 0; s < NS; s++)
			for (kvt_cache *c = a; pre[s] && c; c = c == a ? b : NULL)
				prefill(c, s, pre[s]);
		uint8_t *oa = t_alloc(out_bytes(a, 88)), *ob = t_alloc(out_bytes(a, 88));
		uint8_t *o2 = t_alloc(out_bytes(a, NS));
		const struct sel_stats s0 = sel_stats(a);
		extend_ok_flags(a, NS, seqs, n, oa, KVT_EXTEND_TOPP);
		const struct sel_stats d = sel_delta(s0, sel_stats(a));
		extend_ok(b, NS, seqs, n, ob);
		T_CHECK(d.steps == 88 && d.selected < d.candidates && memcmp(oa, ob, out_bytes(a, 88)),
			"config %u: Top-p selected %llu of %llu candidates over %llu steps, outputs %s "
			"the exact ones: the test would not tell Top-p from exact", ci,
			(unsigned long long)d.selected, (unsigned long long)d.candidates,
			(unsigned long long)d.steps, memcmp(oa, ob, out_bytes(a, 88)) ? "differ from" : "equal");
		uint32_t last[NS], m = 0, row = 0;
		for (uint32_t i = 0; i < NS; row += n[i], i++) {
			if (!n[i])
				continue;
			const uint32_t s = seqs[i];
			memcpy(g_bq + (size_t)m * QROW, g_q[s] + (size_t)(len_of(a, s) - 1) * QROW,
			       2ull * QROW);
			last[m++] = row + n[i] - 1;
		}
		static const uint32_t busy[] = {2, 0, 1};
		T_CHECK(kvt_attend(a, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(a));
		for (uint32_t i = 0; i < m; i++)
			T_CHECK(!memcmp(oa + out_bytes(a, last[i]), o2 + out_bytes(a, i), out_bytes(a, 1)),
				"config %u, seq %u: the last row (%u) differs from kvt_attend of its query",
				ci, busy[i], last[i]);
		free(oa);
		free(ob);
		free(o2);
		kvt_cache_destroy(a);
		kvt_cache_destroy(b);
	}
}

/* With score corrections on (correction_steps), a Top-p row still selects as the kvt_attend after
 * it does: each entry's last row equals kvt_attend of that query right after the call, bit for
 * bit, after decode steps that recorded corrections; and the corrections changed the outputs
 * (against a twin cache without them). */
static void test_topp_corrected(void **state)
{
	(void)state;
	static const uint32_t all[NS] = {0, 1, 2, 3};
	static const uint32_t seqs[NS] = {2, 0, 3, 1}, n[NS] = {5, 3, 1, 0};
	kvt_config cfg = topp_config(KVT_DTYPE_F16, 0.8f, 16, 8, 0);
	cfg.correction_steps = 4;
	make_streams(cfg.dtype, 0x70c);
	kvt_cache *a = make_cache(&cfg);
	cfg.correction_steps = 0;
	kvt_cache *z = make_cache(&cfg);
	uint8_t *oa = t_alloc(out_bytes(a, 9)), *oz = t_alloc(out_bytes(a, 9));
	uint8_t *o2 = t_alloc(out_bytes(a, NS));
	bool changed = false;
	for (uint32_t s = 0; s < NS; s++) {
		prefill(a, s, 300);
		prefill(z, s, 300);
	}
	for (uint32_t round = 0; round < 3; round++) {
		for (uint32_t k = 0; k < 3; k++) {
			decode(a, NS, all, o2);
			decode(z, NS, all, o2);
		}
		extend_ok_flags(a, NS, seqs, n, oa, KVT_EXTEND_TOPP);
		extend_ok_flags(z, NS, seqs, n, oz, KVT_EXTEND_TOPP);
		changed |= memcmp(oa, oz, out_bytes(a, 9)) != 0;
		uint32_t busy[NS], last[NS], m = 0, row = 0;
		for (uint32_t i = 0; i < NS; row += n[i], i++) {
			if (!n[i])
				continue;
			memcpy(g_bq + (size_t)m * QROW,
			       g_q[seqs[i]] + (size_t)(len_of(a, seqs[i]) - 1) * QROW, 2ull * QROW);
			busy[m] = seqs[i];
			last[m++] = row + n[i] - 1;
		}
		T_CHECK(kvt_attend(a, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(a));
		for (uint32_t i = 0; i < m; i++)
			T_CHECK(!memcmp(oa + out_bytes(a, last[i]), o2 + out_bytes(a, i),
					out_bytes(a, 1)),
				"round %u, seq %u: the last row (%u) differs from kvt_attend of its "
				"query with corrections on", round, busy[i], last[i]);
		/* the twin's corrections-free step, so both stay at the same selection count */
		T_CHECK(kvt_attend(z, LAYER, m, busy, g_bq, o2, NULL) == 0, "attend: %s",
			kvt_last_error(z));
	}
	T_CHECK(changed, "the corrections never changed a Top-p row's output: the test proves "
		"nothing");
	free(oa);
	free(oz);
	free(o2);
	kvt_cache_destroy(a);
	kvt_cache_destroy(z);
}

/* At p = 1 with no budget_max, every indexed token up to a row is selected: the exact outputs. */
static void test_topp_p1(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0x9e1);
	const kvt_config cfg = topp_config(KVT_DTYPE_F16, 1.0f, 16, KVT_DEFAULT_BUDGET_MIN, 0);
	kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg);
	static const uint32_t seqs[3] = {0, 1, 2};
	static const uint32_t chunks[][3] = {{37, 3, 300}, {1, 90, 2}, {200, 0, 17}};
	for (uint32_t k = 0; k < 3; k++) {
		uint32_t total = chunks[k][0] + chunks[k][1] + chunks[k][2];
		uint8_t *oa = t_alloc(out_bytes(a, total)), *ob = t_alloc(out_bytes(a, total));
		extend_ok_flags(a, 3, seqs, chunks[k], oa, KVT_EXTEND_TOPP);
		extend_ok(b, 3, seqs, chunks[k], ob);
		for (uint32_t j = 0; j < total; j++)
			T_CHECK(!memcmp(oa + out_bytes(a, j), ob + out_bytes(a, j), out_bytes(a, 1)),
				"batch %u, row %u: Top-p at p = 1 differs from exact attention", k, j);
		free(oa);
		free(ob);
	}
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/*
 * Every row against an oracle. Without a window every token past the sinks is indexed, so row j
 * of a chunk selects among exactly what a cache holding the tokens up to it has indexed: the same
 * history, the chunk's rows prefilled one at a time and each attended by its query. The selection
 * counters match too (a Top-p row counts as a step).
 */
static void test_topp_oracle(void **state)
{
	(void)state;
	const kvt_config cfgs[] = {topp_config(KVT_DTYPE_F16, 0.9f, KVT_NONE, 8, 0),
				   topp_config(KVT_DTYPE_F16, 0.9f, KVT_NONE, KVT_NONE, 30)};
	const uint32_t s = 1, n = 60;
	for (uint32_t ci = 0; ci < 2; ci++) {
		make_streams(KVT_DTYPE_F16, 0x0ac1e + ci);
		kvt_cache *a = make_cache(&cfgs[ci]), *b = make_cache(&cfgs[ci]);
		prefill(a, s, 200);
		prefill(b, s, 200);
		float *oa = t_alloc(out_bytes(a, n)), ob[QROW];
		const struct sel_stats a0 = sel_stats(a), b0 = sel_stats(b);
		extend_ok_flags(a, 1, &s, &n, oa, KVT_EXTEND_TOPP);
		for (uint32_t j = 0; j < n; j++) {
			prefill(b, s, 1);
			T_CHECK(kvt_attend(b, LAYER, 1, &s, g_q[s] + (size_t)(200 + j) * QROW, ob, NULL) == 0,
				"attend: %s", kvt_last_error(b));
			T_CHECK(!memcmp(oa + (size_t)j * QROW, ob, sizeof ob),
				"config %u, row %u (position %u): Top-p extend differs from the oracle", ci,
				j, 200 + j);
		}
		const struct sel_stats da = sel_delta(a0, sel_stats(a)), db = sel_delta(b0, sel_stats(b));
		T_CHECK(!memcmp(&da, &db, sizeof da) && da.selected < da.candidates &&
				(ci == 0 || da.max_hits > 0),
			"config %u: counters (steps, candidates, selected, max hits, min hits, rows) "
			"got %llu %llu %llu %llu %llu %llu, wanted %llu %llu %llu %llu %llu %llu", ci,
			(unsigned long long)da.steps, (unsigned long long)da.candidates,
			(unsigned long long)da.selected, (unsigned long long)da.max_hits,
			(unsigned long long)da.min_hits, (unsigned long long)da.rows,
			(unsigned long long)db.steps, (unsigned long long)db.candidates,
			(unsigned long long)db.selected, (unsigned long long)db.max_hits,
			(unsigned long long)db.min_hits, (unsigned long long)db.rows);
		free(oa);
		kvt_cache_destroy(a);
		kvt_cache_destroy(b);
	}
}

/*
 * Masking: later tokens of the chunk, indexed, with huge keys aligned with an early row's queries,
 * leave that row and every row before it unchanged (they are not scored for it), while they do
 * change the last row.
 */
static void test_topp_masking(void **state)
{
	(void)state;
	make_streams(KVT_DTYPE_F16, 0x3a5c);
	const kvt_config cfg = topp_config(KVT_DTYPE_F16, 0.9f, 16, 8, 0);
	const uint32_t s = 1, n = 80, j0 = 30, first = 200, G = HQ / HKV;
	kvt_cache *a = make_cache(&cfg), *b = make_cache(&cfg);
	prefill(a, s, first);
	prefill(b, s, first);
	uint8_t *oa = t_alloc(out_bytes(a, n)), *ob = t_alloc(out_bytes(a, n));
	extend_ok_flags(a, 1, &s, &n, oa, KVT_EXTEND_TOPP);
	uint16_t *keep = t_alloc(2ull * n * KROW);
	memcpy(keep, g_k[s] + (size_t)first * KROW, 2ull * n * KROW);
	for (uint32_t j = j0 + 1; j < n; j++)
		for (uint32_t h = 0; h < HKV; h++)
			for (uint32_t e = 0; e < D; e++) {
				float qe = t_dec(g_dtype, g_q[s][((size_t)(first + j0) * HQ + h * G) * D + e]);
				g_k[s][((size_t)(first + j) * HKV + h) * D + e] = t_enc(g_dtype, 8.0f * qe);
			}
	extend_ok_flags(b, 1, &s, &n, ob, KVT_EXTEND_TOPP);
	memcpy(g_k[s] + (size_t)first * KROW, keep, 2ull * n * KROW);
	T_CHECK(b->seqs[s].layers[LAYER].n_indexed > first + j0 + 1 - cfg.n_sink,
		"the huge keys are not indexed (%u indexed): the test would prove nothing",
		b->seqs[s].layers[LAYER].n_indexed);
	for (uint32_t j = 0; j <= j0; j++)
		T_CHECK(!memcmp(oa + out_bytes(a, j), ob + out_bytes(a, j), out_bytes(a, 1)),
			"row %u (position %u): changed by keys at positions > %u", j, first + j,
			first + j0);
	T_CHECK(memcmp(oa + out_bytes(a, n - 1), ob + out_bytes(a, n - 1), out_bytes(a, 1)),
		"the last row did not change: the huge keys had no effect, the test proves nothing");
	free(keep);
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/* ---- (4) a spilled sequence: its rows read from NVMe ---------------------------------------- */

static void test_spilled(void **state)
{
	(void)state;
	tt_skip_unless_available();
	tt_files f;
	tt_make_files(&f, 2, 64ull << 20); /* one file per cache */
	make_streams(KVT_DTYPE_F16, 0x5b111);
	kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
	cfg.n_nvme = 1;
	cfg.nvme_paths = (const char *const *)f.ptrs;
	cfg.nvme_bytes = f.bytes;
	cfg.nvme_cache_bytes = 1u << 20;
	kvt_cache *a = make_cache(&cfg);
	cfg.nvme_paths = (const char *const *)f.ptrs + 1;
	cfg.nvme_bytes = f.bytes + 1;
	kvt_cache *b = make_cache(&cfg);
	static const uint32_t seqs[] = {0, 1}, n[] = {45, 3};
	for (kvt_cache *c = a; c; c = c == a ? b : NULL) {
		prefill(c, 0, 700);
		prefill(c, 1, 600);
	}
	T_CHECK(kvt_seq_spill(a, 0) > 0 && kvt_seq_spill(a, 1) > 0, "spill: %s", kvt_last_error(a));
	uint64_t host = 0, nvme = 0;
	T_CHECK(kvt_seq_bytes(a, 0, &host, &nvme) == 0 && nvme > 0, "seq 0 is not spilled");
	const kvt_stats before = t_stats(a);
	uint8_t *oa = t_alloc(out_bytes(a, 48)), *ob = t_alloc(out_bytes(a, 48));
	for (uint32_t round = 0; round < 4; round++) {
		const uint32_t flags = round & 1 ? KVT_EXTEND_TOPP : 0;
		extend_ok_flags(a, 2, seqs, n, oa, flags);
		extend_ok_flags(b, 2, seqs, n, ob, flags);
		T_CHECK(!memcmp(oa, ob, out_bytes(a, 48)), "round %u (flags 0x%x): spilled outputs "
			"differ from unspilled", round, flags);
	}
	const kvt_stats after = t_stats(a);
	T_CHECK(after.nvme_cache_misses > before.nvme_cache_misses && after.restores == 0,
		"rows were not read from NVMe in place: misses %llu -> %llu, restores %llu",
		(unsigned long long)before.nvme_cache_misses,
		(unsigned long long)after.nvme_cache_misses, (unsigned long long)after.restores);
	T_CHECK(kvt_seq_bytes(a, 0, &host, &nvme) == 0 && nvme > 0, "seq 0 was restored");
	same_decode(a, b, 4, "spilled vs unspilled");
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
	tt_unlink(&f);
}

int main(int argc, char **argv)
{
	t_warm_runtime();
	if (argc > 1 && !strcmp(argv[1], "--nvme")) {
		const struct CMUnitTest tests[] = {cmocka_unit_test(test_spilled)};
		return cmocka_run_group_tests(tests, NULL, NULL);
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_reference),     cmocka_unit_test(test_twins),
		cmocka_unit_test(test_varlen),        cmocka_unit_test(test_bad_arguments),
		cmocka_unit_test(test_faults),        cmocka_unit_test(test_topp_last_row),
		cmocka_unit_test(test_topp_corrected),
		cmocka_unit_test(test_topp_p1),       cmocka_unit_test(test_topp_oracle),
		cmocka_unit_test(test_topp_masking),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
