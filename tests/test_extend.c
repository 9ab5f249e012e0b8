/* SPDX-License-Identifier: MIT */
/*
 * kvt_extend on the CPU backend: several new tokens per sequence attending everything stored before
 * them. Against a double-precision reference for every query row; the stored state bit for bit that
 * of kvt_prefill of the same chunks, and the outputs bit for bit those of appending the tokens one
 * at a time and attending at p = 1; a varlen batch (an empty entry included) equal to the entries
 * extended alone; bad arguments refused by name with nothing changed; allocation faults that leave
 * every sequence as it was. With --nvme: a spilled sequence, its rows read from NVMe, equal to the
 * same sequence unspilled (exact and Top-p); and the CUDA backend's way on the CPU's kernels
 * (ops->read_rows_spilled off): spilled entries restored first, equal to the unspilled, and a batch
 * that cannot be in the host tier at once refused with -ENOSPC before anything moved, each entry
 * alone then served.
 * Top-p per query row: test_extend_topp.c.
 */
#include "extend_util.h"

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

/* ---- (5) a backend that reads only the host tier: spilled entries restored first ------------- */

static uint64_t nvme_of(kvt_cache *c, uint32_t s)
{
	uint64_t host = 0, nvme = 0;
	T_CHECK(kvt_seq_bytes(c, s, &host, &nvme) == 0, "kvt_seq_bytes: %s", kvt_last_error(c));
	return nvme;
}

/* An untiered cache *b and a tiered one *a (host_bytes, one NVMe file, restoring first), each
 * with NS sequences open and the streams of `seed`. */
static void restoring_pair(uint64_t seed, uint64_t host_bytes, bool lru, kvt_cache **a,
			   kvt_cache **b)
{
	tt_files f;
	tt_make_files(&f, 1, 64ull << 20);
	make_streams(KVT_DTYPE_F16, seed);
	kvt_config cfg = config(KVT_DTYPE_F16, KVT_DTYPE_F32, 0);
	*b = make_cache(&cfg);
	cfg.n_nvme = 1;
	cfg.nvme_paths = (const char *const *)f.ptrs;
	cfg.nvme_bytes = f.bytes;
	cfg.host_bytes = host_bytes;
	cfg.spill_policy = lru ? KVT_SPILL_LRU : cfg.spill_policy;
	*a = make_cache(&cfg);
	tt_unlink(&f);
	t_restore_first(*a);
}

/* host_bytes: the tiered cache's; its sequences 0 and 1 spilled, then one kvt_extend of both;
 * with `idle`, sequence 2 holds 700 resident tokens the restores must spill. */
static void restored_case(uint64_t host_bytes, bool fits, bool idle)
{
	kvt_cache *a, *b;
	restoring_pair(0x5b112, host_bytes, true, &a, &b);
	static const uint32_t seqs[] = {0, 1}, n[] = {45, 3};
	for (kvt_cache *c = a; c; c = c == a ? b : NULL) {
		prefill(c, 0, 700);
		prefill(c, 1, 600);
		if (idle)
			prefill(c, 2, 700);
	}
	/* (in the small tier, seq 1's prefill already spilled seq 0) */
	T_CHECK(kvt_seq_spill(a, 0) >= 0 && kvt_seq_spill(a, 1) >= 0 && nvme_of(a, 0) > 0 &&
			nvme_of(a, 1) > 0,
		"spill: %s", kvt_last_error(a));
	uint8_t *oa = t_alloc(out_bytes(a, 48)), *ob = t_alloc(out_bytes(a, 48));
	if (fits) {
		extend_ok(a, 2, seqs, n, oa);
		extend_ok(b, 2, seqs, n, ob);
		T_CHECK(!memcmp(oa, ob, out_bytes(a, 48)),
			"restored outputs differ from unspilled");
		T_CHECK(t_stats(a).restores == 2 && nvme_of(a, 0) == 0 && nvme_of(a, 1) == 0,
			"both sequences restored: restores %llu, NVMe bytes %llu and %llu",
			(unsigned long long)t_stats(a).restores, (unsigned long long)nvme_of(a, 0),
			(unsigned long long)nvme_of(a, 1));
		T_CHECK(!idle || nvme_of(a, 2) > 0,
			"the idle sequence was not spilled to make room");
	} else {
		/* the batch cannot be in the host tier at once: refused before anything is
		 * restored (restoring seq 1 would have spilled seq 0 again) */
		const kvt_stats st0 = t_stats(a);
		const uint64_t nv0 = nvme_of(a, 0), nv1 = nvme_of(a, 1);
		int rc = extend_flags(a, 2, seqs, n, oa, 0);
		T_CHECK(rc == -ENOSPC &&
				strstr(kvt_last_error(a), "cannot all be in the host tier"),
			"a batch larger than the host tier: got %d (%s), wanted -ENOSPC", rc,
			kvt_last_error(a));
		T_CHECK(len_of(a, 0) == 700 && len_of(a, 1) == 600,
			"the failed call changed a length");
		const kvt_stats st1 = t_stats(a);
		T_CHECK(st1.restores == st0.restores && st1.spills == st0.spills &&
				st1.host_bytes_used == st0.host_bytes_used && nvme_of(a, 0) == nv0 &&
				nvme_of(a, 1) == nv1,
			"the refused call moved rows: restores %llu -> %llu, spills %llu -> %llu, "
			"host tier %llu -> %llu bytes", (unsigned long long)st0.restores,
			(unsigned long long)st1.restores, (unsigned long long)st0.spills,
			(unsigned long long)st1.spills, (unsigned long long)st0.host_bytes_used,
			(unsigned long long)st1.host_bytes_used);
		/* nothing lost: each alone fits, and equals the unspilled sequence */
		for (uint32_t i = 0; i < 2; i++) {
			extend_ok(a, 1, seqs + i, n + i, oa);
			extend_ok(b, 1, seqs + i, n + i, ob);
			T_CHECK(!memcmp(oa, ob, out_bytes(a, n[i])),
				"seq %u alone: restored outputs differ from unspilled", i);
		}
	}
	/* kvt_seq_read_rows of a spilled sequence restores it too */
	T_CHECK(kvt_seq_spill(a, 0) >= 0 && nvme_of(a, 0) > 0, "spill again: %s",
		kvt_last_error(a));
	const uint32_t rows = len_of(a, 0);
	uint16_t *ka = t_alloc(2ull * rows * KROW), *va = t_alloc(2ull * rows * KROW);
	uint16_t *kb = t_alloc(2ull * rows * KROW), *vb = t_alloc(2ull * rows * KROW);
	T_CHECK(kvt_seq_read_rows(a, 0, LAYER, 0, rows, ka, va, NULL) == (int)rows &&
		kvt_seq_read_rows(b, 0, LAYER, 0, rows, kb, vb, NULL) == (int)rows,
		"read_rows: %s", kvt_last_error(a));
	T_CHECK(!memcmp(ka, kb, 2ull * rows * KROW) && !memcmp(va, vb, 2ull * rows * KROW) &&
		nvme_of(a, 0) == 0, "read_rows of a spilled sequence: rows differ or not restored");
	same_decode(a, b, 2, "restored vs unspilled");
	free(ka);
	free(va);
	free(kb);
	free(vb);
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/* A fork and its parent in one batch: the blocks they share were spilled once, and are read back
 * once, so a host tier that holds them once takes the batch. */
static void restored_fork_case(void)
{
	kvt_cache *a, *b;
	restoring_pair(0x5b113, 8ull << 16, false, &a, &b); /* 8 blocks of 64 KiB */
	/* seq 0: 3 blocks per head; its fork (slot 3) shares blocks 0 and 1 and copies block 2 */
	for (kvt_cache *c = a; c; c = c == a ? b : NULL) {
		prefill(c, 0, 700);
		uint32_t kid = 0;
		T_CHECK(kvt_seq_close(c, 3) == 0 && kvt_seq_fork(c, 0, &kid, NULL) == 0 && kid == 3,
			"fork into slot 3: got %u (%s)", kid, kvt_last_error(c));
	}
	T_CHECK(kvt_seq_spill(a, 0) > 0 && nvme_of(a, 3) > 0, "spill of the shared blocks: %s",
		kvt_last_error(a));
	static const uint32_t seqs[] = {0, 3}, n[] = {5, 9};
	uint8_t *oa = t_alloc(out_bytes(a, 14)), *ob = t_alloc(out_bytes(a, 14));
	extend_ok(a, 2, seqs, n, oa);
	extend_ok(b, 2, seqs, n, ob);
	T_CHECK(!memcmp(oa, ob, out_bytes(a, 14)), "fork and parent: restored outputs differ");
	T_CHECK(nvme_of(a, 0) == 0 && nvme_of(a, 3) == 0, "fork and parent not both restored");
	free(oa);
	free(ob);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

/* Rows stored after a spill are in host memory: kvt_seq_read_rows of them needs no restore, where
 * the host tier could not hold the whole sequence; a range with spilled rows is refused then,
 * nothing restored. */
static void restored_tail_case(void)
{
	kvt_cache *a, *b;
	restoring_pair(0x5b114, 6ull << 16, false, &a, &b); /* 6 blocks of 64 KiB */
	for (kvt_cache *c = a; c; c = c == a ? b : NULL)
		prefill(c, 0, 700); /* 2 full blocks and a partial one per KV head */
	T_CHECK(kvt_seq_spill(a, 0) > 0 && nvme_of(a, 0) > 0, "spill: %s", kvt_last_error(a));
	for (kvt_cache *c = a; c; c = c == a ? b : NULL)
		prefill(c, 0, 100); /* rows 700-799: the partial block and a new one; 4 held */
	const kvt_stats st0 = t_stats(a);
	const uint64_t nv0 = nvme_of(a, 0);
	const uint32_t from = 700, to = 800, rows = to - from;
	uint16_t *ka = t_alloc(2ull * 300 * KROW), *va = t_alloc(2ull * 300 * KROW);
	uint16_t *kb = t_alloc(2ull * rows * KROW), *vb = t_alloc(2ull * rows * KROW);
	int rc = kvt_seq_read_rows(a, 0, LAYER, from, to, ka, va, NULL);
	T_CHECK(rc == (int)rows &&
			kvt_seq_read_rows(b, 0, LAYER, from, to, kb, vb, NULL) == (int)rows,
		"read_rows of rows stored after the spill: %d (%s)", rc, kvt_last_error(a));
	T_CHECK(!memcmp(ka, kb, 2ull * rows * KROW) && !memcmp(va, vb, 2ull * rows * KROW),
		"rows stored after the spill read back different");
	const kvt_stats st1 = t_stats(a);
	T_CHECK(st1.restores == st0.restores && nvme_of(a, 0) == nv0 &&
			st1.host_bytes_used == st0.host_bytes_used,
		"a read of host rows restored: restores %llu -> %llu, host tier %llu -> %llu bytes",
		(unsigned long long)st0.restores, (unsigned long long)st1.restores,
		(unsigned long long)st0.host_bytes_used, (unsigned long long)st1.host_bytes_used);
	/* rows 500-799 include block 1's, spilled: restoring needs 4 blocks, 2 are free */
	rc = kvt_seq_read_rows(a, 0, LAYER, 500, to, ka, va, NULL);
	const kvt_stats st2 = t_stats(a);
	T_CHECK(rc == -ENOSPC && strstr(kvt_last_error(a), "cannot all be in the host tier") &&
			st2.restores == st0.restores && nvme_of(a, 0) == nv0 &&
			st2.host_bytes_used == st0.host_bytes_used,
		"a read of spilled rows without room: got %d (%s), restores %llu -> %llu", rc,
		kvt_last_error(a), (unsigned long long)st0.restores,
		(unsigned long long)st2.restores);
	free(ka);
	free(va);
	free(kb);
	free(vb);
	kvt_cache_destroy(a);
	kvt_cache_destroy(b);
}

static void test_restored(void **state)
{
	(void)state;
	tt_skip_unless_available();
	restored_case(64ull << 20, true, false);
	/* 64 KiB blocks (256 tokens x 2 x 64 x 2 bytes): each sequence holds 2 resident blocks
	 * and 4 spilled; 10 blocks hold the resident ones and one sequence's spilled, not both */
	restored_case(10ull << 16, false, false);
	/* 14 blocks: the idle sequence's 6 resident blocks leave 4 free, and spilling its 4 indexed
	 * ones makes room for the batch's 8 */
	restored_case(14ull << 16, true, true);
	restored_fork_case();
	restored_tail_case();
}

int main(int argc, char **argv)
{
	t_warm_runtime();
	if (argc > 1 && !strcmp(argv[1], "--nvme")) {
		const struct CMUnitTest tests[] = {cmocka_unit_test(test_spilled),
						   cmocka_unit_test(test_restored)};
		return cmocka_run_group_tests(tests, NULL, NULL);
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_reference),     cmocka_unit_test(test_twins),
		cmocka_unit_test(test_varlen),        cmocka_unit_test(test_bad_arguments),
		cmocka_unit_test(test_faults),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
