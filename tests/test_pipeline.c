/* SPDX-License-Identifier: MIT */
/*
 * The per-step pipeline through the public API, checked on the internal state: chunked prefill
 * and hundreds of lazy-flush decode steps keep sinks + index + window covering every token once,
 * every index entry is the one kvt_index_build gives for the key at its position, centroids freeze
 * at the first chunk, p = 1 gathers every position, and with p < 1 a KV head gathers the union of
 * its query heads' Top-p sets (recomputed here with the internal functions).
 *
 * Run with --long for the slow suite (more steps, every head_dim).
 */
#include "common.h"

enum { MAX_SEQS = 2, LAYERS = 2 };

struct run {
	char name[160]; /* the case and its seed, printed by every failing check */
	kvt_config cfg;
	kvt_cache *c;
	uint32_t nseq, seqs[MAX_SEQS];
	uint32_t cap; /* tokens of history per (seq, layer) */
	/* every K/V row given, [cap, n_kv, d] in dtype, and the tokens given so far */
	uint16_t *k[MAX_SEQS][LAYERS], *v[MAX_SEQS][LAYERS];
	uint32_t n[MAX_SEQS][LAYERS];
	uint32_t indexed[MAX_SEQS][LAYERS]; /* index entries already checked */
	float *ck[MAX_SEQS][LAYERS], *cq[MAX_SEQS][LAYERS]; /* centroids after the first chunk */
	t_rng rng;
};

static struct kvt_layer *lay(const struct run *r, int s, uint32_t layer)
{
	return &r->c->seqs[r->seqs[s]].layers[layer];
}

static void run_init(struct run *r, const char *name, kvt_config cfg, uint32_t nseq, uint32_t cap,
		     uint64_t seed)
{
	memset(r, 0, sizeof *r);
	snprintf(r->name, sizeof r->name, "%s (seed 0x%llx)", name, (unsigned long long)seed);
	r->cfg = cfg;
	r->c = t_create(&cfg);
	r->nseq = nseq;
	r->cap = cap;
	t_rng_seed(&r->rng, seed);
	size_t row = (size_t)cfg.n_kv_heads * cfg.head_dim;
	for (uint32_t s = 0; s < nseq; s++) {
		int rc = kvt_seq_open(r->c, &r->seqs[s]);
		T_CHECK(rc == 0, "%s: kvt_seq_open got %d (%s)", r->name, rc, kvt_last_error(r->c));
		for (uint32_t l = 0; l < LAYERS; l++) {
			r->k[s][l] = (uint16_t *)t_alloc(2 * row * cap);
			r->v[s][l] = (uint16_t *)t_alloc(2 * row * cap);
			r->ck[s][l] = (float *)t_alloc(4 * row);
			r->cq[s][l] = (float *)t_alloc(4 * row);
		}
	}
	/* the cache's rotations are the seeded ones */
	uint32_t d = cfg.head_dim;
	float *rot = (float *)t_alloc(sizeof(float) * d * d);
	for (uint32_t l = 0; l < LAYERS; l++) {
		T_CHECK(kvt_rotation_generate(cfg.seed, l, d, rot) == 0, "kvt_rotation_generate");
		T_CHECK(memcmp(rot, r->c->rot + (size_t)l * d * d, sizeof(float) * d * d) == 0,
			"%s: cache rotation of layer %u differs from kvt_rotation_generate(seed, %u)",
			r->name, l, l);
	}
	free(rot);
}

static void run_fini(struct run *r)
{
	kvt_cache_destroy(r->c);
	for (uint32_t s = 0; s < r->nseq; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			free(r->k[s][l]);
			free(r->v[s][l]);
			free(r->ck[s][l]);
			free(r->cq[s][l]);
		}
}

/* Index entry i of (s, layer), every KV head: the stored row is the key given at position
 * n_sink + i, and (code, sigma, beta) is what kvt_index_build makes of it. */
static void check_entry(const struct run *r, int s, uint32_t layer, uint32_t i)
{
	const kvt_cache *c = r->c;
	const struct kvt_layer *l = lay(r, s, layer);
	uint32_t d = c->d, words = c->words, nkv = r->cfg.n_kv_heads, pos = r->cfg.n_sink + i;
	for (uint32_t h = 0; h < nkv; h++) {
		const uint16_t *row = (const uint16_t *)kvt_row(c, l, h, pos);
		const uint16_t *wk = r->k[s][layer] + ((size_t)pos * nkv + h) * d;
		const uint16_t *wv = r->v[s][layer] + ((size_t)pos * nkv + h) * d;
		T_CHECK(memcmp(row, wk, 2 * d) == 0 && memcmp(row + d, wv, 2 * d) == 0,
			"%s seq %d layer %u kv head %u: host row of position %u (index entry %u) is not "
			"the K/V given (K[0] got 0x%04x, wanted 0x%04x)",
			r->name, s, layer, h, pos, i, row[0], wk[0]);
		float key[KVT_MAX_HEAD_DIM];
		for (uint32_t j = 0; j < d; j++)
			key[j] = t_dec(r->cfg.dtype, wk[j]);
		uint32_t code[KVT_MAX_WORDS];
		uint16_t sg, bt;
		kvt_index_build(d, c->rot + (size_t)layer * d * d, l->c_k + (size_t)h * d,
				l->c_q + (size_t)h * d, 1, key, d, code, &sg, &bt);
		size_t e = (size_t)h * l->idx_cap + i;
		T_CHECK(memcmp(code, l->codes + e * words, 4 * words) == 0 && sg == l->sigma[e] &&
				bt == l->beta[e],
			"%s seq %d layer %u kv head %u index entry %u (position %u): got code[0] 0x%08x "
			"sigma 0x%04x beta 0x%04x, wanted 0x%08x 0x%04x 0x%04x",
			r->name, s, layer, h, i, pos, l->codes[e * words], l->sigma[e], l->beta[e],
			code[0], sg, bt);
	}
}

/* The coverage invariants of (s, layer) after a call, and the entries indexed since last time. */
static void check_layer(struct run *r, int s, uint32_t layer, const char *when)
{
	const struct kvt_layer *l = lay(r, s, layer);
	uint32_t n = r->n[s][layer], S = r->cfg.n_sink, W = r->cfg.window, B = r->cfg.flush_batch;
	int64_t len = kvt_seq_length(r->c, r->seqs[s], layer);
	T_CHECK(len == n && l->n_tokens == n, "%s %s seq %d layer %u: length got %lld (internal %u), "
		"wanted %u", r->name, when, s, layer, (long long)len, l->n_tokens, n);
	uint32_t front = n < S ? n : S, wc = kvt_window_count(r->c, l);
	T_CHECK(front + l->n_indexed + wc == n && l->n_indexed <= n - front,
		"%s %s seq %d layer %u: sinks %u + indexed %u + window %u, wanted %u tokens", r->name,
		when, s, layer, front, l->n_indexed, wc, n);
	uint32_t wmin = n - front < W ? n - front : W;
	T_CHECK(wc >= wmin && wc < W + B,
		"%s %s seq %d layer %u (%u tokens): window holds %u, wanted in [%u, %u)", r->name,
		when, s, layer, n, wc, wmin, W + B);
	T_CHECK(l->n_indexed >= r->indexed[s][layer],
		"%s %s seq %d layer %u: indexed went from %u to %u", r->name, when, s, layer,
		r->indexed[s][layer], l->n_indexed);
	if (l->n_indexed > 0)
		T_CHECK(l->centroids, "%s %s seq %d layer %u: tokens indexed, centroids not frozen",
			r->name, when, s, layer);
	for (uint32_t i = r->indexed[s][layer]; i < l->n_indexed; i++)
		check_entry(r, s, layer, i);
	r->indexed[s][layer] = l->n_indexed;
	if (l->centroids) {
		size_t bytes = sizeof(float) * r->cfg.n_kv_heads * r->cfg.head_dim;
		T_CHECK(memcmp(l->c_k, r->ck[s][layer], bytes) == 0 &&
				memcmp(l->c_q, r->cq[s][layer], bytes) == 0,
			"%s %s seq %d layer %u: centroids changed after the first chunk (c_k[0] got "
			"%.9g, wanted %.9g)",
			r->name, when, s, layer, (double)l->c_k[0], (double)r->ck[s][layer][0]);
	}
}

static void check_stats(struct run *r, const char *when)
{
	kvt_stats st = t_stats(r->c);
	uint64_t tokens = 0, indexed = 0;
	for (uint32_t s = 0; s < r->nseq; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			tokens += r->n[s][l];
			indexed += lay(r, (int)s, l)->n_indexed;
		}
	T_CHECK(st.tokens == tokens && st.tokens_indexed == indexed,
		"%s %s: stats tokens %llu indexed %llu, wanted %llu and %llu", r->name, when,
		(unsigned long long)st.tokens, (unsigned long long)st.tokens_indexed,
		(unsigned long long)tokens, (unsigned long long)indexed);
}

/* One prefill chunk of n tokens of (s, layer); queries given when with_q. */
static void prefill(struct run *r, int s, uint32_t layer, uint32_t n, int with_q)
{
	const kvt_config *cfg = &r->cfg;
	uint32_t d = cfg->head_dim, nkv = cfg->n_kv_heads, nq = cfg->n_q_heads, dt = cfg->dtype;
	size_t row = (size_t)nkv * d, qrow = (size_t)nq * d;
	T_CHECK(r->n[s][layer] + n <= r->cap, "%s: history too small", r->name);
	uint16_t *k = r->k[s][layer] + r->n[s][layer] * row, *v = r->v[s][layer] + r->n[s][layer] * row;
	uint16_t *q = (uint16_t *)t_alloc(2 * qrow * n);
	/* keys off-centre so that the centroid matters */
	t_fill(&r->rng, dt, n * row, 0.7, 1.0, k, NULL);
	t_fill(&r->rng, dt, n * row, 0.0, 1.0, v, NULL);
	t_fill(&r->rng, dt, n * qrow, -0.4, 1.2, q, NULL);
	int first = r->n[s][layer] == 0;
	int rc = kvt_prefill(r->c, r->seqs[s], layer, with_q ? q : NULL, k, v, n, NULL);
	T_CHECK(rc == 0, "%s seq %d layer %u: kvt_prefill of %u got %d (%s)", r->name, s, layer, n,
		rc, kvt_last_error(r->c));
	r->n[s][layer] += n;
	const struct kvt_layer *l = lay(r, s, layer);
	T_CHECK(l->centroids && l->c_k && l->c_q,
		"%s seq %d layer %u: centroids not fixed by the first chunk (frozen %d)", r->name, s,
		layer, (int)l->centroids);
	if (first) { /* the centroids are the means of this chunk */
		uint32_t group = nq / nkv;
		for (uint32_t h = 0; h < nkv; h++)
			for (uint32_t j = 0; j < d; j++) {
				double mk = 0, ak = 0, mq = 0, aq = 0;
				for (uint32_t t = 0; t < n; t++) {
					double x = t_dec(dt, k[(t * nkv + h) * d + j]);
					mk += x / n;
					ak += fabs(x) / n;
					for (uint32_t g = 0; g < group && with_q; g++) {
						double y = t_dec(dt, q[(t * nq + h * group + g) * d + j]);
						mq += y / (n * group);
						aq += fabs(y) / (n * group);
					}
				}
				double gk = l->c_k[h * d + j], gq = l->c_q[h * d + j];
				T_CHECK(fabs(gk - mk) <= 1e-5 * ak + 1e-7,
					"%s seq %d layer %u kv head %u: c_k[%u] got %.9g, wanted the "
					"mean of the first chunk %.9g",
					r->name, s, layer, h, j, gk, mk);
				T_CHECK(with_q ? fabs(gq - mq) <= 1e-5 * aq + 1e-7 : gq == 0.0,
					"%s seq %d layer %u kv head %u: c_q[%u] got %.9g, wanted %.9g "
					"(%s)",
					r->name, s, layer, h, j, gq, mq,
					with_q ? "mean of the group's queries" : "zero: no queries");
			}
		memcpy(r->ck[s][layer], l->c_k, sizeof(float) * nkv * d);
		memcpy(r->cq[s][layer], l->c_q, sizeof(float) * nkv * d);
	}
	/* a prefill indexes everything but sinks and the last `window` tokens */
	uint32_t tot = r->n[s][layer], keep = cfg->n_sink + cfg->window;
	uint32_t want = tot > keep ? tot - keep : 0;
	T_CHECK(l->n_indexed == want, "%s seq %d layer %u after a prefill to %u tokens: indexed %u, "
		"wanted %u", r->name, s, layer, tot, l->n_indexed, want);
	check_layer(r, s, layer, "prefill");
	free(q);
}

/* One decode token for every sequence on every layer. */
static void append_all(struct run *r, int step)
{
	const kvt_config *cfg = &r->cfg;
	size_t row = (size_t)cfg->n_kv_heads * cfg->head_dim;
	uint16_t *k = (uint16_t *)t_alloc(2 * row * r->nseq), *v = (uint16_t *)t_alloc(2 * row * r->nseq);
	for (uint32_t l = 0; l < LAYERS; l++) {
		t_fill(&r->rng, cfg->dtype, row * r->nseq, 0.7, 1.0, k, NULL);
		t_fill(&r->rng, cfg->dtype, row * r->nseq, 0.0, 1.0, v, NULL);
		int rc = kvt_append(r->c, l, r->nseq, r->seqs, k, v, NULL);
		T_CHECK(rc == 0, "%s step %d layer %u: kvt_append got %d (%s)", r->name, step, l, rc,
			kvt_last_error(r->c));
		for (uint32_t s = 0; s < r->nseq; s++) {
			T_CHECK(r->n[s][l] < r->cap, "%s: history too small", r->name);
			memcpy(r->k[s][l] + r->n[s][l] * row, k + s * row, 2 * row);
			memcpy(r->v[s][l] + r->n[s][l] * row, v + s * row, 2 * row);
			r->n[s][l]++;
			char when[48];
			snprintf(when, sizeof when, "append step %d", step);
			check_layer(r, (int)s, l, when);
		}
	}
	free(k);
	free(v);
}

/*
 * kvt_select then kvt_gather on `layer`, and the same through kvt_attend: the positions of every
 * (sequence, KV head) must be sinks + the union over its query heads of the Top-p sets recomputed
 * from the index + window; rows are the K/V given; the attention output is exact attention over
 * exactly those rows; the stats count the selection.
 */
static void check_selection(struct run *r, uint32_t layer, const char *when)
{
	kvt_cache *c = r->c;
	const kvt_config *cfg = &r->cfg;
	uint32_t d = cfg->head_dim, nkv = cfg->n_kv_heads, nq = cfg->n_q_heads, dt = cfg->dtype;
	uint32_t group = nq / nkv, S = cfg->n_sink, ns = r->nseq;
	size_t qrow = (size_t)nq * d;
	uint16_t *q = (uint16_t *)t_alloc(2 * qrow * ns);
	t_fill(&r->rng, dt, qrow * ns, -0.4, 1.2, q, NULL);
	/* expected positions */
	uint32_t *want = (uint32_t *)t_alloc(sizeof(uint32_t) * ns * nkv * r->cap);
	uint32_t wn[MAX_SEQS * 8], wmax = 0;
	uint64_t sel_sum = 0, cand_sum = 0, hits_max = 0, hits_min = 0;
	for (uint32_t s = 0; s < ns; s++) {
		const struct kvt_layer *l = lay(r, (int)s, layer);
		uint32_t n = l->n_tokens, ni = l->n_indexed, front = n < S ? n : S;
		float *scores = (float *)t_alloc(sizeof(float) * (ni + 1));
		float *scr = (float *)t_alloc(sizeof(float) * (ni + 1));
		uint8_t *mask = (uint8_t *)t_alloc(ni + 1);
		for (uint32_t h = 0; h < nkv; h++) {
			memset(mask, 0, ni + 1);
			for (uint32_t g = 0; g < group && ni; g++) {
				float qf[KVT_MAX_HEAD_DIM];
				const uint16_t *qb = q + s * qrow + (size_t)(h * group + g) * d;
				for (uint32_t j = 0; j < d; j++)
					qf[j] = t_dec(dt, qb[j]);
				kvt_qcode qc;
				kvt_query_prepare(d, c->rot + (size_t)layer * d * d, l->c_q + h * d,
						  l->c_k + h * d, qf, &qc);
				size_t e = (size_t)h * l->idx_cap;
				kvt_score(d, &qc, ni, l->codes + e * c->words, l->sigma + e, l->beta + e,
					  scores);
				int clamped = 0;
				uint32_t bad = 0;
				int rc = kvt_topp_mark(scores, NULL, ni, c->scale, cfg->p, cfg->budget_min,
						       cfg->budget_max, scr, mask, &clamped, &bad);
				T_CHECK(rc >= 0, "%s: kvt_topp_mark got %d", r->name, rc);
				hits_max += clamped < 0;
				hits_min += clamped > 0;
			}
			if (cfg->p >= 1.0f && cfg->budget_max == 0)
				for (uint32_t i = 0; i < ni; i++)
					T_CHECK(mask[i], "%s: p = 1 must select index entry %u", r->name, i);
			uint32_t *w = want + ((size_t)s * nkv + h) * r->cap, m = 0;
			for (uint32_t p = 0; p < front; p++)
				w[m++] = p;
			for (uint32_t i = 0; i < ni; i++)
				if (mask[i])
					w[m++] = S + i;
			sel_sum += m - front;
			cand_sum += ni;
			for (uint32_t p = front + ni; p < n; p++)
				w[m++] = p;
			wn[s * nkv + h] = m;
			wmax = m > wmax ? m : wmax;
		}
		free(scores);
		free(scr);
		free(mask);
	}

	kvt_stats st0 = t_stats(c);
	int mx = kvt_select(c, layer, ns, r->seqs, q, NULL);
	T_CHECK(mx == (int)wmax, "%s %s layer %u: kvt_select got %d, wanted max tokens %u (%s)",
		r->name, when, layer, mx, wmax, mx < 0 ? kvt_last_error(c) : "");
	kvt_stats st1 = t_stats(c);
	T_CHECK(st1.steps - st0.steps == ns && st1.selected_tokens - st0.selected_tokens == sel_sum &&
			st1.candidate_tokens - st0.candidate_tokens == cand_sum &&
			st1.budget_max_hits - st0.budget_max_hits == hits_max &&
			st1.budget_min_hits - st0.budget_min_hits == hits_min,
		"%s %s layer %u: stats deltas steps %llu selected %llu candidates %llu max hits %llu "
		"min hits %llu, wanted %u %llu %llu %llu %llu",
		r->name, when, layer, (unsigned long long)(st1.steps - st0.steps),
		(unsigned long long)(st1.selected_tokens - st0.selected_tokens),
		(unsigned long long)(st1.candidate_tokens - st0.candidate_tokens),
		(unsigned long long)(st1.budget_max_hits - st0.budget_max_hits),
		(unsigned long long)(st1.budget_min_hits - st0.budget_min_hits), ns,
		(unsigned long long)sel_sum, (unsigned long long)cand_sum,
		(unsigned long long)hits_max, (unsigned long long)hits_min);

	size_t slots = (size_t)ns * nkv * wmax;
	int32_t counts[MAX_SEQS * 8], *pos = (int32_t *)t_alloc(4 * slots);
	uint16_t *ko = (uint16_t *)t_alloc(2 * slots * d), *vo = (uint16_t *)t_alloc(2 * slots * d);
	float *out = (float *)t_alloc(4 * qrow * ns);
	for (int pass = 0; pass < 2; pass++) {
		const char *how = pass ? "kvt_attend" : "kvt_select";
		if (pass) {
			for (size_t i = 0; i < qrow * ns; i++)
				out[i] = NAN;
			int rc = kvt_attend(c, layer, ns, r->seqs, q, out, NULL);
			T_CHECK(rc == 0, "%s %s layer %u: kvt_attend got %d (%s)", r->name, when, layer,
				rc, kvt_last_error(c));
		}
		for (size_t i = 0; i < slots; i++)
			pos[i] = -7;
		int tot = kvt_gather(c, layer, ns, r->seqs, wmax, counts, pos, ko, vo, NULL);
		int wtot = 0;
		for (uint32_t i = 0; i < ns * nkv; i++)
			wtot += (int)wn[i];
		T_CHECK(tot == wtot, "%s %s layer %u after %s: kvt_gather got %d, wanted %d (%s)",
			r->name, when, layer, how, tot, wtot, tot < 0 ? kvt_last_error(c) : "");
		for (uint32_t s = 0; s < ns; s++)
			for (uint32_t h = 0; h < nkv; h++) {
				size_t sh = (size_t)s * nkv + h;
				const uint32_t *w = want + sh * r->cap;
				T_CHECK(counts[sh] == (int32_t)wn[sh],
					"%s %s layer %u seq %u kv head %u after %s: count got %d, wanted "
					"%u",
					r->name, when, layer, s, h, how, counts[sh], wn[sh]);
				for (uint32_t i = 0; i < wn[sh]; i++) {
					int32_t p = pos[sh * wmax + i];
					T_CHECK(p == (int32_t)w[i],
						"%s %s layer %u seq %u kv head %u after %s: position %u "
						"got %d, wanted %u (union of the query heads' Top-p sets)",
						r->name, when, layer, s, h, how, i, p, w[i]);
					const uint16_t *gk = r->k[s][layer] + ((size_t)p * nkv + h) * d;
					const uint16_t *gv = r->v[s][layer] + ((size_t)p * nkv + h) * d;
					T_CHECK(memcmp(ko + (sh * wmax + i) * d, gk, 2 * d) == 0 &&
							memcmp(vo + (sh * wmax + i) * d, gv, 2 * d) == 0,
						"%s %s layer %u seq %u kv head %u: gathered K/V of position "
						"%d differ from those given",
						r->name, when, layer, s, h, p);
				}
			}
	}
	/* the output of kvt_attend: exact attention over the gathered rows */
	uint32_t n_rows = wmax ? wmax : 1;
	float *kf = (float *)t_alloc(4 * (size_t)n_rows * d), *vf = (float *)t_alloc(4 * (size_t)n_rows * d);
	const float **kp = (const float **)t_alloc(sizeof(float *) * n_rows);
	const float **vp = (const float **)t_alloc(sizeof(float *) * n_rows);
	for (uint32_t s = 0; s < ns; s++)
		for (uint32_t hq = 0; hq < nq; hq++) {
			size_t sh = (size_t)s * nkv + hq / group;
			for (int32_t i = 0; i < counts[sh]; i++) {
				for (uint32_t j = 0; j < d; j++) {
					kf[(size_t)i * d + j] = t_dec(dt, ko[(sh * wmax + i) * d + j]);
					vf[(size_t)i * d + j] = t_dec(dt, vo[(sh * wmax + i) * d + j]);
				}
				kp[i] = kf + (size_t)i * d;
				vp[i] = vf + (size_t)i * d;
			}
			float qf[KVT_MAX_HEAD_DIM];
			double ref[KVT_MAX_HEAD_DIM], mag[KVT_MAX_HEAD_DIM];
			for (uint32_t j = 0; j < d; j++)
				qf[j] = t_dec(dt, q[s * qrow + (size_t)hq * d + j]);
			t_ref_attention(d, c->scale, qf, (uint32_t)counts[sh], kp, vp, ref, mag);
			for (uint32_t j = 0; j < d; j++) {
				double got = out[s * qrow + (size_t)hq * d + j];
				T_CHECK(fabs(got - ref[j]) <= 1e-5 * mag[j],
					"%s %s layer %u seq %u q head %u: attend out[%u] got %.9g, wanted "
					"%.9g over the %d selected rows",
					r->name, when, layer, s, hq, j, got, ref[j], counts[sh]);
			}
		}
	free(kf);
	free(vf);
	free(kp);
	free(vp);
	free(q);
	free(want);
	free(pos);
	free(ko);
	free(vo);
	free(out);
}

/*
 * Sequence 0: three prefill chunks (queries on layer 0 only) then `steps` appends; sequence 1
 * starts with 3 tokens (fewer than the sinks) and grows with it through batched appends.
 */
static void pipeline(const char *name, kvt_config cfg, uint32_t steps, uint32_t check_every,
		     uint64_t seed)
{
	const uint32_t chunks[3] = {40, 37, 50};
	struct run r;
	run_init(&r, name, cfg, 2, 127 + steps + 8, seed);
	for (int ch = 0; ch < 3; ch++)
		for (uint32_t l = 0; l < LAYERS; l++)
			prefill(&r, 0, l, chunks[ch], l == 0);
	for (uint32_t l = 0; l < LAYERS; l++)
		prefill(&r, 1, l, 3, 1);
	check_stats(&r, "after prefill");
	check_selection(&r, 0, "after prefill");
	for (uint32_t step = 0; step < steps; step++) {
		append_all(&r, (int)step);
		if (step % check_every == check_every - 1 || step == steps - 1) {
			char when[40];
			snprintf(when, sizeof when, "after %u appends", step + 1);
			check_stats(&r, when);
			check_selection(&r, step % LAYERS, when);
		}
	}
	/* every entry once more: nothing indexed earlier was overwritten by later flushes */
	for (uint32_t s = 0; s < r.nseq; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			r.indexed[s][l] = 0;
			check_layer(&r, (int)s, l, "at the end");
		}
	kvt_stats st = t_stats(r.c);
	uint64_t wflush = 0;
	for (uint32_t s = 0; s < r.nseq; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			const struct kvt_layer *ly = lay(&r, (int)s, l);
			/* the appended tokens that were indexed came through whole flushes */
			uint32_t pre_idx = s == 0 ? 127 - cfg.n_sink - cfg.window : 0;
			T_CHECK((ly->n_indexed - pre_idx) % cfg.flush_batch == 0,
				"%s seq %u layer %u: %u tokens indexed by flushes, wanted a multiple of "
				"flush_batch %u", name, s, l, ly->n_indexed - pre_idx, cfg.flush_batch);
			wflush += (ly->n_indexed - pre_idx) / cfg.flush_batch;
		}
	T_CHECK(st.flushes == wflush, "%s: stats flushes got %llu, wanted %llu", name,
		(unsigned long long)st.flushes, (unsigned long long)wflush);
	print_message("%s: %llu flushes, %llu of %llu candidates selected, budget hits max %llu "
		      "min %llu\n",
		      name, (unsigned long long)st.flushes, (unsigned long long)st.selected_tokens,
		      (unsigned long long)st.candidate_tokens, (unsigned long long)st.budget_max_hits,
		      (unsigned long long)st.budget_min_hits);
	run_fini(&r);
}

static void test_pipeline_p1(void **state)
{
	(void)state;
	kvt_config cfg = t_config(LAYERS, 4, 2, 128, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	pipeline("p=1 f16 d=128 GQA 4/2", cfg, 300, 25, 0x919e0001u);
}

static void test_pipeline_gqa_union(void **state)
{
	(void)state;
	kvt_config cfg = t_config(LAYERS, 8, 2, 64, KVT_DTYPE_BF16);
	cfg.p = 0.6f;
	pipeline("p=0.6 bf16 d=64 GQA 8/2", cfg, 300, 20, 0x919e0002u);
}

static void test_pipeline_budget(void **state)
{
	(void)state;
	kvt_config cfg = t_config(LAYERS, 8, 2, 128, KVT_DTYPE_F16);
	cfg.p = 0.85f;
	cfg.budget_min = 6;
	cfg.budget_max = 20;
	cfg.n_sink = 2;
	cfg.window = 9;
	cfg.flush_batch = 5;
	cfg.scale = 0.25f;
	pipeline("p=0.85 budget [6,20] f16 d=128 GQA 8/2 sinks 2 window 9 batch 5", cfg, 200, 15,
		 0x919e0003u);
}

static void test_pipeline_long(void **state)
{
	(void)state;
	const uint32_t dims[3] = {64, 128, 256};
	for (int di = 0; di < 3; di++) {
		kvt_config cfg = t_config(LAYERS, 8, 2, dims[di], di == 1 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16);
		cfg.p = 0.9f;
		cfg.window = 32;
		cfg.flush_batch = 16;
		char name[64];
		snprintf(name, sizeof name, "long p=0.9 d=%u", dims[di]);
		pipeline(name, cfg, 1500, 150, 0x919e1000u + dims[di]);
	}
}

int main(int argc, char **argv)
{
	const struct CMUnitTest unit[] = {
		cmocka_unit_test(test_pipeline_p1),
		cmocka_unit_test(test_pipeline_gqa_union),
		cmocka_unit_test(test_pipeline_budget),
	};
	const struct CMUnitTest slow[] = {
		cmocka_unit_test(test_pipeline_long),
	};
	if (argc > 1 && strcmp(argv[1], "--long") == 0)
		return cmocka_run_group_tests(slow, NULL, NULL);
	return cmocka_run_group_tests(unit, NULL, NULL);
}
