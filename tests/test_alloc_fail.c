/* SPDX-License-Identifier: MIT */
/*
 * Allocation failures: for N = 1, 2, ... fail the N-th allocation of a whole script (create, open,
 * chunked prefill, appends across flushes, attend, the graph step's reservation and a
 * kvt_attend_graph, select + gather, close, destroy) until a run
 * completes without the failure firing. Every call must succeed or return -ENOMEM; a failed call
 * changes nothing (lengths and stats as before) and its retry succeeds; the final outputs equal
 * those of a run without failures bit for bit; nothing leaks.
 */
#include "common.h"

enum { LAYERS = 2, NQ = 4, NKV = 2, D = 64, SEQS = 2, APPENDS = 12, MAXTOK = 400 };
static const uint32_t chunk0[2] = {40, 300}; /* sequence 0: the second chunk grows the index */
static const uint32_t chunk1 = 25;

struct outputs {
	float out[LAYERS][SEQS * NQ * D];
	float graph[SEQS * NQ * D]; /* kvt_attend_graph of layer 0's query: equal to out[0] */
	int32_t counts[SEQS * NKV];
	int32_t pos[SEQS * NKV * MAXTOK];
	int total;
};

struct inputs {
	uint16_t *k, *v, *q; /* enough for the largest chunk */
};

/* What must not change when a call fails. */
struct state {
	int64_t len[SEQS][LAYERS];
	uint64_t tokens, host_used, seqs_open, indexed;
};

static void observe(kvt_cache *c, const uint32_t *seqs, uint32_t nseqs, struct state *s)
{
	memset(s, 0, sizeof *s);
	for (uint32_t i = 0; i < nseqs; i++)
		for (uint32_t l = 0; l < LAYERS; l++)
			s->len[i][l] = kvt_seq_length(c, seqs[i], l);
	kvt_stats st = t_stats(c);
	s->tokens = st.tokens;
	s->host_used = st.host_bytes_used;
	s->seqs_open = st.seqs_open;
	s->indexed = st.tokens_indexed;
}

struct iter {
	uint64_t n;      /* the allocation made to fail, 0 for none */
	int fired;       /* the injected failure fired (and was reported or absorbed) */
	int enomem;      /* calls that returned -ENOMEM */
	kvt_cache *c;
	uint32_t seqs[SEQS], nseqs;
};

/*
 * Run one call; on -ENOMEM check that nothing changed, turn injection off and retry once. Any other
 * failure, or a failed retry, fails the test.
 */
#define STEP(it, what, expr)                                                                       \
	do {                                                                                       \
		struct state before_, after_;                                                      \
		observe((it)->c, (it)->seqs, (it)->nseqs, &before_);                               \
		const uint64_t errors_ = t_stats((it)->c).errors;                                  \
		int rc_ = (expr);                                                                  \
		const uint64_t counted_ = t_stats((it)->c).errors - errors_;                      \
		T_CHECK(counted_ == (rc_ < 0), "N=%llu %s: returned %d and counted %llu errors "  \
			"in kvt_stats.errors, wanted %d (\"%s\")", (unsigned long long)(it)->n,     \
			what, rc_, (unsigned long long)counted_, rc_ < 0, kvt_last_error((it)->c));  \
		if (rc_ == -ENOMEM) {                                                              \
			(it)->enomem++;                                                            \
			observe((it)->c, (it)->seqs, (it)->nseqs, &after_);                        \
			T_CHECK(memcmp(&before_, &after_, sizeof before_) == 0,                   \
				"N=%llu %s: failed with -ENOMEM but changed the state (tokens %llu "  \
				"-> %llu, host bytes %llu -> %llu, indexed %llu -> %llu)",            \
				(unsigned long long)(it)->n, what,                                 \
				(unsigned long long)before_.tokens,                                \
				(unsigned long long)after_.tokens,                                 \
				(unsigned long long)before_.host_used,                             \
				(unsigned long long)after_.host_used,                              \
				(unsigned long long)before_.indexed,                               \
				(unsigned long long)after_.indexed);                               \
			(it)->fired |= kvt_mem_fired();                                            \
			kvt_mem_fail_at(0);                                                        \
			rc_ = (expr);                                                              \
		}                                                                                  \
		T_CHECK(rc_ >= 0, "N=%llu %s: got %d (%s: %s), wanted success or -ENOMEM",        \
			(unsigned long long)(it)->n, what, rc_, kvt_strerror(rc_),                 \
			kvt_last_error((it)->c));                                                  \
	} while (0)

/* The script; returns 0 when it ran to the end, 1 when cache creation failed (nothing to do). */
static int script(struct iter *it, const struct inputs *in, struct outputs *o)
{
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 0.7f;
	cfg.budget_min = 2;
	cfg.budget_max = 100;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	if (rc == -ENOMEM) {
		it->enomem++;
		it->fired |= kvt_mem_fired();
		T_CHECK(c == NULL, "N=%llu create: failed but wrote *out", (unsigned long long)it->n);
		return 1;
	}
	T_CHECK(rc == 0, "N=%llu create: got %d (%s), wanted 0 or -ENOMEM",
		(unsigned long long)it->n, rc, kvt_last_error(NULL));
	it->c = c;
	it->nseqs = 0;
	for (uint32_t s = 0; s < SEQS; s++) {
		STEP(it, "seq_open", kvt_seq_open(c, &it->seqs[s]));
		it->nseqs++;
	}
	size_t kvn = (size_t)NKV * D, qn = (size_t)NQ * D;
	uint32_t off = 0;
	for (int ch = 0; ch < 2; ch++) {
		for (uint32_t l = 0; l < LAYERS; l++)
			STEP(it, ch ? "prefill chunk 2" : "prefill chunk 1",
			     kvt_prefill(c, it->seqs[0], l, l ? NULL : in->q + off * qn, in->k + off * kvn,
					 in->v + off * kvn, chunk0[ch], NULL));
		off += chunk0[ch];
	}
	for (uint32_t l = 0; l < LAYERS; l++)
		STEP(it, "prefill seq 1",
		     kvt_prefill(c, it->seqs[1], l, in->q, in->k + kvn, in->v, chunk1, NULL));
	for (uint32_t a = 0; a < APPENDS; a++)
		for (uint32_t l = 0; l < LAYERS; l++)
			STEP(it, "append",
			     kvt_append(c, l, SEQS, it->seqs, in->k + (a * 2 + l) * kvn,
					in->v + (a * 3 + l) * kvn, NULL));
	for (uint32_t l = 0; l < LAYERS; l++)
		STEP(it, "attend",
		     kvt_attend(c, l, SEQS, it->seqs, in->q + (l + 1) * SEQS * qn, o->out[l], NULL));
	/* the graph step's reservation and a step over slots naming both sequences */
	STEP(it, "graph_reserve", kvt_graph_reserve(c, SEQS, MAXTOK, NULL));
	const int32_t slots[SEQS] = {(int32_t)it->seqs[0], (int32_t)it->seqs[1]};
	const kvt_graph_batch gb = {.n_slots = SEQS, .seqs = slots};
	STEP(it, "attend_graph", kvt_attend_graph(c, 0, &gb, in->q + SEQS * qn, o->graph, NULL));
	int mx = 0;
	STEP(it, "select", (mx = kvt_select(c, 1, SEQS, it->seqs, in->q + 7 * qn, NULL)));
	T_CHECK(mx <= MAXTOK, "select got %d, more than %d", mx, MAXTOK);
	STEP(it, "gather",
	     (o->total = kvt_gather(c, 1, SEQS, it->seqs, MAXTOK, o->counts, o->pos, NULL, NULL,
				    NULL)));
	STEP(it, "seq_close", kvt_seq_close(c, it->seqs[1]));
	it->nseqs = 1;
	kvt_stats st = t_stats(c);
	T_CHECK(st.flushes > 0, "N=%llu: flushes got 0, wanted > 0", (unsigned long long)it->n);
	kvt_cache_destroy(c);
	it->c = NULL;
	return 0;
}

static void test_fail_nth_allocation(void **state)
{
	(void)state;
	struct inputs in;
	size_t kvn = (size_t)MAXTOK * NKV * D, qn = (size_t)MAXTOK * NQ * D;
	in.k = (uint16_t *)t_alloc(2 * kvn);
	in.v = (uint16_t *)t_alloc(2 * kvn);
	in.q = (uint16_t *)t_alloc(2 * qn);
	t_rng rng;
	t_rng_seed(&rng, 0xfa11);
	t_fill(&rng, KVT_DTYPE_F16, kvn, 0.5, 1, in.k, NULL);
	t_fill(&rng, KVT_DTYPE_F16, kvn, 0, 1, in.v, NULL);
	t_fill(&rng, KVT_DTYPE_F16, qn, 0, 1, in.q, NULL);
	struct outputs *ref = (struct outputs *)t_alloc(sizeof *ref);
	struct outputs *got = (struct outputs *)t_alloc(sizeof *got);

	/* the reference run, counting the allocations it makes */
	int64_t live0 = kvt_mem_live();
	struct iter it = {0};
	kvt_mem_fail_at(0);
	T_CHECK(script(&it, &in, ref) == 0 && it.enomem == 0, "reference run failed");
	uint64_t allocs = kvt_mem_attempts();
	T_CHECK(kvt_mem_live() == live0, "reference run leaked: live %lld, wanted %lld",
		(long long)kvt_mem_live(), (long long)live0);
	T_CHECK(allocs >= 24, "the script made %llu allocations, wanted at least a few dozen",
		(unsigned long long)allocs);

	uint64_t n;
	int completed = 0;
	for (n = 1; n < 100000; n++) {
		memset(&it, 0, sizeof it);
		it.n = n;
		memset(got, 0xff, sizeof *got);
		int64_t live = kvt_mem_live();
		kvt_mem_fail_at(n);
		int r = script(&it, &in, got);
		it.fired |= kvt_mem_fired();
		kvt_mem_fail_at(0);
		T_CHECK(kvt_mem_live() == live,
			"N=%llu: live allocations got %lld after the script, wanted %lld (a leak after "
			"%d -ENOMEM)",
			(unsigned long long)n, (long long)kvt_mem_live(), (long long)live, it.enomem);
		if (r == 0) {
			completed++;
			for (int l = 0; l < LAYERS; l++)
				for (size_t i = 0; i < SEQS * NQ * D; i++)
					T_CHECK(t_fbits(got->out[l][i]) == t_fbits(ref->out[l][i]),
						"N=%llu: attend layer %d out[%zu] got %.9g, wanted %.9g as "
						"without failures",
						(unsigned long long)n, l, i, (double)got->out[l][i],
						(double)ref->out[l][i]);
			T_CHECK(!memcmp(got->graph, got->out[0], sizeof got->graph),
				"N=%llu: kvt_attend_graph differs from kvt_attend",
				(unsigned long long)n);
			T_CHECK(got->total == ref->total &&
					memcmp(got->counts, ref->counts, sizeof got->counts) == 0,
				"N=%llu: gather total got %d, wanted %d", (unsigned long long)n,
				got->total, ref->total);
			/* pos is [seq, kv head, MAXTOK]: compare each pair's first counts[] slots */
			for (int sh = 0; sh < SEQS * NKV; sh++)
				for (int i = 0; i < ref->counts[sh]; i++)
					T_CHECK(got->pos[sh * MAXTOK + i] == ref->pos[sh * MAXTOK + i],
						"N=%llu: gathered position %d of (seq, kv head) %d got %d, "
						"wanted %d",
						(unsigned long long)n, i, sh, got->pos[sh * MAXTOK + i],
						ref->pos[sh * MAXTOK + i]);
		}
		if (!it.fired) {
			T_CHECK(it.enomem == 0, "N=%llu: %d calls returned -ENOMEM without an injected "
				"failure", (unsigned long long)n, it.enomem);
			break;
		}
	}
	print_message("fault injection: %llu allocations failed in turn, %d runs completed\n",
		      (unsigned long long)(n - 1), completed);
	T_CHECK(n - 1 >= 24 && n - 1 >= allocs,
		"allocations exercised got %llu, wanted >= 24 and >= the %llu of the reference run",
		(unsigned long long)(n - 1), (unsigned long long)allocs);
	T_CHECK(kvt_mem_live() == live0, "live allocations at the end got %lld, wanted %lld",
		(long long)kvt_mem_live(), (long long)live0);
	free(in.k);
	free(in.v);
	free(in.q);
	free(ref);
	free(got);
}

/* A prefill that fails with -ENOMEM leaves the sequence as it was, and a retry succeeds. */
static void test_failed_prefill_retry(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, 2, 2, 128, KVT_DTYPE_BF16);
	kvt_cache *c = t_create(&cfg);
	uint32_t s;
	T_CHECK(kvt_seq_open(c, &s) == 0, "seq_open");
	size_t kvn = (size_t)600 * 2 * 128;
	uint16_t *k = (uint16_t *)t_alloc(2 * kvn), *v = (uint16_t *)t_alloc(2 * kvn);
	t_rng rng;
	t_rng_seed(&rng, 0x7e7);
	t_fill(&rng, KVT_DTYPE_BF16, kvn, 0.2, 1, k, NULL);
	t_fill(&rng, KVT_DTYPE_BF16, kvn, 0, 1, v, NULL);
	T_CHECK(kvt_prefill(c, s, 0, NULL, k, v, 20, NULL) == 0, "first chunk: %s", kvt_last_error(c));
	int failures = 0;
	/* the second chunk grows index, blocks and scratch: fail each of its allocations in turn */
	for (uint64_t n = 1; n < 1000; n++) {
		kvt_mem_fail_at(n);
		int rc = kvt_prefill(c, s, 0, NULL, k + 20 * 256, v + 20 * 256, 580, NULL);
		kvt_mem_fail_at(0);
		if (rc == 0)
			break;
		T_CHECK(rc == -ENOMEM, "N=%llu: prefill got %d (%s), wanted -ENOMEM",
			(unsigned long long)n, rc, kvt_last_error(c));
		failures++;
		int64_t len = kvt_seq_length(c, s, 0);
		T_CHECK(len == 20, "N=%llu: after the failed prefill length got %lld, wanted 20",
			(unsigned long long)n, (long long)len);
		T_CHECK(c->seqs[s].layers[0].n_indexed == 0,
			"N=%llu: after the failed prefill indexed got %u, wanted 0",
			(unsigned long long)n, c->seqs[s].layers[0].n_indexed);
	}
	T_CHECK(failures > 0, "no allocation of the second chunk could be failed");
	T_CHECK(kvt_seq_length(c, s, 0) == 600, "length after the successful retry got %lld, wanted 600",
		(long long)kvt_seq_length(c, s, 0));
	kvt_cache_destroy(c);
	free(k);
	free(v);
}

/*
 * Growths whose first part fits in the mapped extent and whose next part needs a new one: when
 * mapping it fails, what was already served goes back (layer.c), so the host tier's use is as before
 * the call. 3 KV heads of head_dim 256: a block is 256 KiB, an extent 256 blocks.
 */
enum { XH = 3, XD = 256, XBLK = 1 << 18 };

struct grow_call {
	kvt_cache *c;
	uint32_t seqs[2], n;   /* the sequences the call grows (layer 0) */
	const uint16_t *k, *v; /* one token per sequence */
	bool append;           /* kvt_append of both, else kvt_prefill of seqs[0] */
};

static int grow_once(const struct grow_call *g)
{
	return g->append ? kvt_append(g->c, 0, g->n, g->seqs, g->k, g->v, NULL)
			 : kvt_prefill(g->c, g->seqs[0], 0, NULL, g->k, g->v, 1, NULL);
}

/* Fail each allocation of the call in turn until it succeeds; each failure changes nothing and is
 * counted once. Returns the host-tier bytes in use after the success. */
static uint64_t fail_each(const char *name, const struct grow_call *g)
{
	const kvt_stats before = t_stats(g->c);
	int64_t len[2];
	for (uint32_t i = 0; i < g->n; i++)
		len[i] = kvt_seq_length(g->c, g->seqs[i], 0);
	uint64_t failures = 0;
	for (uint64_t n = 1; n < 1000; n++) {
		kvt_mem_fail_at(n);
		int rc = grow_once(g);
		kvt_mem_fail_at(0);
		if (rc == 0)
			break;
		T_CHECK(rc == -ENOMEM, "%s, N=%llu: got %d (%s), wanted -ENOMEM", name,
			(unsigned long long)n, rc, kvt_last_error(g->c));
		failures++;
		const kvt_stats st = t_stats(g->c);
		T_CHECK(st.host_bytes_used == before.host_bytes_used,
			"%s, N=%llu: after the failure the host tier used %llu bytes, wanted %llu",
			name, (unsigned long long)n, (unsigned long long)st.host_bytes_used,
			(unsigned long long)before.host_bytes_used);
		T_CHECK(st.errors == before.errors + failures,
			"%s, N=%llu: errors got %llu, wanted %llu", name, (unsigned long long)n,
			(unsigned long long)st.errors, (unsigned long long)(before.errors + failures));
		for (uint32_t i = 0; i < g->n; i++)
			T_CHECK(kvt_seq_length(g->c, g->seqs[i], 0) == len[i],
				"%s, N=%llu: seq %u's length got %lld, wanted %lld", name,
				(unsigned long long)n, g->seqs[i],
				(long long)kvt_seq_length(g->c, g->seqs[i], 0), (long long)len[i]);
	}
	T_CHECK(failures > 0, "%s: no allocation could be failed", name);
	for (uint32_t i = 0; i < g->n; i++)
		T_CHECK(kvt_seq_length(g->c, g->seqs[i], 0) == len[i] + 1,
			"%s: seq %u's length after the retry got %lld, wanted %lld", name,
			g->seqs[i], (long long)kvt_seq_length(g->c, g->seqs[i], 0),
			(long long)len[i] + 1);
	return t_stats(g->c).host_bytes_used;
}

/* Sequences of full_blocks[i] full blocks per head, then the growth by one token each. */
static void grow_case(const char *name, uint32_t n, const uint32_t *full_blocks, bool append,
		      uint64_t want_after)
{
	kvt_config cfg = t_config(1, XH, XH, XD, KVT_DTYPE_BF16);
	cfg.host_bytes = (uint64_t)80 << 20;
	kvt_cache *c = t_create(&cfg);
	uint32_t most = 0;
	for (uint32_t i = 0; i < n; i++)
		most = full_blocks[i] > most ? full_blocks[i] : most;
	size_t kvn = ((size_t)most * 256 + 2) * XH * XD;
	uint16_t *k = (uint16_t *)t_alloc(2 * kvn), *v = (uint16_t *)t_alloc(2 * kvn);
	t_rng rng;
	t_rng_seed(&rng, 0xe47);
	t_fill(&rng, KVT_DTYPE_BF16, kvn, 0.2, 1, k, NULL);
	t_fill(&rng, KVT_DTYPE_BF16, kvn, 0, 1, v, NULL);
	struct grow_call g = {.c = c, .n = n, .k = k, .v = v, .append = append};
	for (uint32_t i = 0; i < n; i++) {
		T_CHECK(kvt_seq_open(c, &g.seqs[i]) == 0, "%s: seq_open", name);
		T_CHECK(kvt_prefill(c, g.seqs[i], 0, NULL, k + 2 * XH * XD, v + 2 * XH * XD,
				    full_blocks[i] * 256, NULL) == 0,
			"%s: prefill of seq %u: %s", name, i, kvt_last_error(c));
	}
	uint64_t after = fail_each(name, &g);
	T_CHECK(after == want_after, "%s: host tier used %llu bytes after the retry, wanted %llu",
		name, (unsigned long long)after, (unsigned long long)want_after);
	kvt_cache_destroy(c);
	free(k);
	free(v);
}

static void test_grow_across_extents(void **state)
{
	(void)state;
	/* 85 blocks per head leave one block free: head 0 of the next token takes it, head 1 must
	 * map the second extent, and head 0 gives its block back when that fails */
	const uint32_t one[1] = {85};
	grow_case("prefill, the second head maps", 1, one, false, (uint64_t)258 * XBLK);
	/* 42 + 42 blocks per head leave 4: the first sequence's 3 heads fit, the second's head 0
	 * takes the last block and head 1 maps; the first sequence's growth is undone too */
	const uint32_t two[2] = {42, 42};
	grow_case("append of two sequences, the second maps", 2, two, true, (uint64_t)258 * XBLK);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_fail_nth_allocation),
		cmocka_unit_test(test_failed_prefill_retry),
		cmocka_unit_test(test_grow_across_extents),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
