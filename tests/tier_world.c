/* SPDX-License-Identifier: MIT */
/* The world of the NVMe tier tests (tier_world.h). */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_world.h"

void w_open(struct world *w, const char *name, kvt_config cfg, uint32_t n_files,
		   uint64_t file_bytes, uint32_t nseq, uint32_t cap, uint64_t seed, int mirror)
{
	memset(w, 0, sizeof *w);
	snprintf(w->name, sizeof w->name, "%s (seed 0x%llx)", name, (unsigned long long)seed);
	t_rng_seed(&w->rng, seed);
	for (int i = 0; i < TT_MAX_FILES; i++)
		w->fd[i] = -1;
	if (n_files) {
		tt_make_files(&w->f, n_files, file_bytes);
		cfg.n_nvme = n_files;
		cfg.nvme_paths = w->f.ptrs;
		cfg.nvme_bytes = w->f.bytes;
	}
	w->cfg = cfg;
	int rc = kvt_cache_create(&cfg, &w->c);
	for (uint32_t i = 0; i < n_files && rc == 0; i++)
		w->fd[i] = open(w->f.paths[i], O_RDWR | O_CLOEXEC);
	tt_unlink(&w->f); /* the cache and w->fd hold them from here on */
	T_CHECK(rc == 0, "%s: kvt_cache_create got %d (%s: %s), wanted 0", w->name, rc,
		kvt_strerror(rc), kvt_last_error(NULL));
	for (uint32_t i = 0; i < n_files; i++)
		T_CHECK(w->fd[i] >= 0, "%s: open %s: %s", w->name, w->f.paths[i], strerror(errno));
	if (mirror) {
		kvt_config m = cfg;
		m.n_nvme = 0;
		m.nvme_paths = NULL;
		m.nvme_bytes = NULL;
		m.spill_policy = KVT_SPILL_NONE;
		m.host_bytes = (uint64_t)1 << 30;
		w->mirror = t_create(&m);
	}
	w->nseq = nseq;
	w->cap = cap;
	w->nkv = cfg.n_kv_heads;
	w->nq = cfg.n_q_heads;
	w->layers = cfg.n_layers;
	w->d = cfg.head_dim;
	T_CHECK(nseq <= MAXS && w->layers <= MAXL && w->nkv <= MAXKV && w->nq <= MAXQ,
		"%s: shape out of the test's bounds", w->name);
	size_t row = (size_t)w->nkv * w->d;
	for (uint32_t s = 0; s < nseq; s++) {
		rc = kvt_seq_open(w->c, &w->seqs[s]);
		T_CHECK(rc == 0, "%s: kvt_seq_open got %d (%s)", w->name, rc, kvt_last_error(w->c));
		if (w->mirror)
			T_CHECK(kvt_seq_open(w->mirror, &w->mseqs[s]) == 0, "%s: mirror seq_open", w->name);
		for (uint32_t l = 0; l < w->layers; l++) {
			w->k[s][l] = (uint16_t *)t_alloc(2 * row * cap);
			w->v[s][l] = (uint16_t *)t_alloc(2 * row * cap);
		}
	}
	w->gk = (uint16_t *)t_alloc(2 * row * cap);
	w->gv = (uint16_t *)t_alloc(2 * row * cap);
	w->kb = (uint16_t *)t_alloc(2 * row * MAXS);
	w->vb = (uint16_t *)t_alloc(2 * row * MAXS);
	w->q = (uint16_t *)t_alloc(2 * (size_t)w->nq * w->d);
	w->counts = (int32_t *)t_alloc(sizeof(int32_t) * w->nkv);
	w->pos = (int32_t *)t_alloc(sizeof(int32_t) * w->nkv * cap);
	w->out = (float *)t_alloc(sizeof(float) * w->nq * w->d);
	w->mout = (float *)t_alloc(sizeof(float) * w->nq * w->d);
}

/* Bytes of one host-tier block (256 rows of K and V) of this world's head_dim. */
uint64_t w_block_bytes(const struct world *w)
{
	return (uint64_t)KVT_BLOCK_TOKENS * 2 * w->d * 2;
}

void w_close(struct world *w)
{
	kvt_cache_destroy(w->c);
	kvt_cache_destroy(w->mirror);
	for (int i = 0; i < TT_MAX_FILES; i++)
		if (w->fd[i] >= 0)
			close(w->fd[i]);
	for (uint32_t s = 0; s < w->nseq; s++)
		for (uint32_t l = 0; l < w->layers; l++) {
			free(w->k[s][l]);
			free(w->v[s][l]);
		}
	free(w->gk);
	free(w->gv);
	free(w->kb);
	free(w->vb);
	free(w->q);
	free(w->counts);
	free(w->pos);
	free(w->out);
	free(w->mout);
	memset(w, 0, sizeof *w);
}

struct kvt_layer *w_layer(const struct world *w, uint32_t s, uint32_t l)
{
	return &w->c->seqs[w->seqs[s]].layers[l];
}

/* Random K/V rows (never all zero: K ~ N(0.3, 1), V ~ N(-0.2, 1)) for tokens [at, at + n). */
void w_rows(struct world *w, uint32_t s, uint32_t l, uint32_t at, uint32_t n)
{
	size_t row = (size_t)w->nkv * w->d;
	T_CHECK(at + n <= w->cap, "%s: seq %u layer %u: %u tokens exceed the test's cap %u", w->name, s,
		l, at + n, w->cap);
	t_fill(&w->rng, w->cfg.dtype, n * row, 0.3, 1.0, w->k[s][l] + at * row, NULL);
	t_fill(&w->rng, w->cfg.dtype, n * row, -0.2, 1.0, w->v[s][l] + at * row, NULL);
}

/* Prefill n tokens of world sequence s on layer l; the mirror gets the same. Returns the rc. */
int w_prefill(struct world *w, uint32_t s, uint32_t l, uint32_t n)
{
	uint32_t at = w->n[s][l];
	size_t row = (size_t)w->nkv * w->d;
	w_rows(w, s, l, at, n);
	w->before = t_stats(w->c);
	int rc = kvt_prefill(w->c, w->seqs[s], l, NULL, w->k[s][l] + at * row,
			     w->v[s][l] + at * row, n, NULL);
	if (rc == 0 && w->mirror) {
		int m = kvt_prefill(w->mirror, w->mseqs[s], l, NULL, w->k[s][l] + at * row,
				    w->v[s][l] + at * row, n, NULL);
		T_CHECK(m == 0, "%s: mirror prefill got %d (%s)", w->name, m,
			kvt_last_error(w->mirror));
	}
	if (rc == 0)
		w->n[s][l] += n;
	return rc;
}

void w_prefill_ok(struct world *w, uint32_t s, uint32_t n)
{
	for (uint32_t l = 0; l < w->layers; l++) {
		int rc = w_prefill(w, s, l, n);
		T_CHECK(rc == 0, "%s: prefill of %u tokens, seq %u layer %u: got %d (%s: %s), wanted 0",
			w->name, n, s, l, rc, kvt_strerror(rc), kvt_last_error(w->c));
	}
}

/* One decode token for each of the ns world sequences in idx[] on every layer (one batch). */
void w_append_ok(struct world *w, uint32_t ns, const uint32_t *idx)
{
	size_t row = (size_t)w->nkv * w->d;
	uint32_t ids[MAXS], mids[MAXS];
	for (uint32_t l = 0; l < w->layers; l++) {
		for (uint32_t i = 0; i < ns; i++) {
			uint32_t s = idx[i], at = w->n[s][l];
			w_rows(w, s, l, at, 1);
			memcpy(w->kb + i * row, w->k[s][l] + at * row, 2 * row);
			memcpy(w->vb + i * row, w->v[s][l] + at * row, 2 * row);
			ids[i] = w->seqs[s];
			mids[i] = w->mseqs[s];
		}
		int rc = kvt_append(w->c, l, ns, ids, w->kb, w->vb, NULL);
		T_CHECK(rc == 0, "%s: append on layer %u for %u sequences: got %d (%s: %s), wanted 0",
			w->name, l, ns, rc, kvt_strerror(rc), kvt_last_error(w->c));
		if (w->mirror)
			T_CHECK(kvt_append(w->mirror, l, ns, mids, w->kb, w->vb, NULL) == 0,
				"%s: mirror append: %s", w->name, kvt_last_error(w->mirror));
		for (uint32_t i = 0; i < ns; i++)
			w->n[idx[i]][l]++;
	}
}

void w_append_all(struct world *w, uint32_t tokens)
{
	uint32_t idx[MAXS];
	for (uint32_t s = 0; s < w->nseq; s++)
		idx[s] = s;
	for (uint32_t t = 0; t < tokens; t++)
		w_append_ok(w, w->nseq, idx);
}

/* kvt_select (p = 1: every position) then kvt_gather of (s, l) into gk/gv/pos; the rc of gather. */
int w_gather(struct world *w, uint32_t s, uint32_t l)
{
	uint32_t n = w->n[s][l];
	t_fill(&w->rng, w->cfg.dtype, (size_t)w->nq * w->d, 0, 1, w->q, NULL);
	int rc = kvt_select(w->c, l, 1, &w->seqs[s], w->q, NULL);
	if (rc < 0)
		return rc;
	T_CHECK(rc == (int)n, "%s seq %u layer %u: kvt_select with p = 1 got %d tokens, wanted %u",
		w->name, s, l, rc, n);
	memset(w->gk, 0xa5, 2 * (size_t)w->nkv * n * w->d);
	memset(w->gv, 0x5a, 2 * (size_t)w->nkv * n * w->d);
	return kvt_gather(w->c, l, 1, &w->seqs[s], n, w->counts, w->pos, w->gk, w->gv, NULL);
}

/* The gathered rows of (s, l) are every position, in order, byte for byte the rows given. */
void w_expect(struct world *w, uint32_t s, uint32_t l, int rc, const char *what)
{
	uint32_t n = w->n[s][l], H = w->nkv;
	T_CHECK(rc == (int)(n * H), "%s %s seq %u layer %u: kvt_gather got %d (%s: %s), wanted %u",
		w->name, what, s, l, rc, rc < 0 ? kvt_strerror(rc) : "tokens",
		rc < 0 ? kvt_last_error(w->c) : "", n * H);
	for (uint32_t h = 0; h < H; h++) {
		T_CHECK(w->counts[h] == (int32_t)n, "%s %s seq %u layer %u head %u: count got %d, wanted %u",
			w->name, what, s, l, h, w->counts[h], n);
		for (uint32_t t = 0; t < n; t++) {
			T_CHECK(w->pos[(size_t)h * n + t] == (int32_t)t,
				"%s %s seq %u layer %u head %u: position %u got %d, wanted %u", w->name,
				what, s, l, h, t, w->pos[(size_t)h * n + t], t);
			const uint16_t *gk = w->gk + ((size_t)h * n + t) * w->d;
			const uint16_t *gv = w->gv + ((size_t)h * n + t) * w->d;
			const uint16_t *wk = w->k[s][l] + ((size_t)t * H + h) * w->d;
			const uint16_t *wv = w->v[s][l] + ((size_t)t * H + h) * w->d;
			if (memcmp(gk, wk, 2 * w->d) == 0 && memcmp(gv, wv, 2 * w->d) == 0)
				continue;
			uint32_t j = 0;
			while (j < w->d && gk[j] == wk[j] && gv[j] == wv[j])
				j++;
			T_CHECK(0, "%s %s seq %u layer %u head %u token %u element %u: K got 0x%04x V got "
				"0x%04x, wanted K 0x%04x V 0x%04x (block %u, spilled: %s)",
				w->name, what, s, l, h, t, j, gk[j], gv[j], wk[j], wv[j],
				t / KVT_BLOCK_TOKENS,
				w_layer(w, s, l)->blocks[(size_t)h * w_layer(w, s, l)->blk_cap +
							 t / KVT_BLOCK_TOKENS]
					? "no"
					: "yes");
		}
	}
}

void w_check(struct world *w, uint32_t s, uint32_t l, const char *what)
{
	w_expect(w, s, l, w_gather(w, s, l), what);
}

void w_check_all(struct world *w, const char *what)
{
	for (uint32_t s = 0; s < w->nseq; s++)
		for (uint32_t l = 0; l < w->layers; l++)
			w_check(w, s, l, what);
}

/* The query of (s, l): the same every time, so that outputs can be compared across calls. */
void w_query(struct world *w, uint32_t s, uint32_t l)
{
	t_rng r;
	t_rng_seed(&r, w->rng.seed * 31 + s * 8 + l + 1);
	t_fill(&r, w->cfg.dtype, (size_t)w->nq * w->d, 0.1, 1.0, w->q, NULL);
}

/* kvt_attend of (s, l) into w->out; the rc. */
int w_attend(struct world *w, uint32_t s, uint32_t l)
{
	w_query(w, s, l);
	return kvt_attend(w->c, l, 1, &w->seqs[s], w->q, w->out, NULL);
}

/* Attention of (s, l) is bit for bit the mirror's (and ref's when given). */
void w_check_attend(struct world *w, uint32_t s, uint32_t l, const float *ref,
			   const char *what)
{
	int rc = w_attend(w, s, l);
	T_CHECK(rc == 0, "%s %s seq %u layer %u: kvt_attend got %d (%s: %s), wanted 0", w->name, what,
		s, l, rc, kvt_strerror(rc), kvt_last_error(w->c));
	if (w->mirror) {
		rc = kvt_attend(w->mirror, l, 1, &w->mseqs[s], w->q, w->mout, NULL);
		T_CHECK(rc == 0, "%s: mirror attend: %s", w->name, kvt_last_error(w->mirror));
		for (uint32_t i = 0; i < w->nq * w->d; i++)
			T_CHECK(t_fbits(w->out[i]) == t_fbits(w->mout[i]),
				"%s %s seq %u layer %u: attention out[%u] got %.9g (0x%08x), wanted %.9g "
				"(0x%08x) as the cache that never spills",
				w->name, what, s, l, i, (double)w->out[i], t_fbits(w->out[i]),
				(double)w->mout[i], t_fbits(w->mout[i]));
	}
	for (uint32_t i = 0; ref && i < w->nq * w->d; i++)
		T_CHECK(t_fbits(w->out[i]) == t_fbits(ref[i]),
			"%s %s seq %u layer %u: attention out[%u] got %.9g, wanted %.9g as before the "
			"spill",
			w->name, what, s, l, i, (double)w->out[i], (double)ref[i]);
}

/* Full blocks per KV head of (s, l) whose tokens are all sinks or indexed: what spill moves. */
uint32_t w_full_blocks(const struct world *w, uint32_t s, uint32_t l)
{
	const struct kvt_layer *L = w_layer(w, s, l);
	uint32_t n = w->n[s][l], front = n < w->cfg.n_sink ? n : w->cfg.n_sink;
	T_CHECK(L->n_tokens == n && front + L->n_indexed <= n,
		"%s seq %u layer %u: internal length %u indexed %u, wanted length %u", w->name, s, l,
		L->n_tokens, L->n_indexed, n);
	return (front + L->n_indexed) / KVT_BLOCK_TOKENS;
}

/* Bytes kvt_seq_spill(s) must move now, by the test's count of what it spilled before. */
int64_t w_spill_due(const struct world *w, uint32_t s)
{
	int64_t b = 0;
	for (uint32_t l = 0; l < w->layers; l++)
		b += (int64_t)(w_full_blocks(w, s, l) - w->spilled[s][l]) * w->nkv * (int64_t)w_block_bytes(w);
	return b;
}

/* Bytes kvt_seq_restore(s) must move: every block the test spilled. */
int64_t w_restore_due(const struct world *w, uint32_t s)
{
	int64_t b = 0;
	for (uint32_t l = 0; l < w->layers; l++)
		b += (int64_t)w->spilled[s][l] * w->nkv * (int64_t)w_block_bytes(w);
	return b;
}

/* Blocks of s on NVMe according to the cache's own table (NULL host pointer, loc.bytes set). */
uint32_t w_blocks_on_nvme(const struct world *w, uint32_t s)
{
	uint32_t n = 0;
	for (uint32_t l = 0; l < w->layers; l++) {
		const struct kvt_layer *L = w_layer(w, s, l);
		for (uint32_t h = 0; h < w->nkv; h++)
			for (uint32_t b = 0; b < L->n_blocks; b++) {
				size_t at = (size_t)h * L->blk_cap + b;
				if (!L->blocks[at]) {
					T_CHECK(L->spill && L->spill[at].loc.bytes,
						"%s seq %u layer %u head %u block %u: no host block and "
						"no NVMe location", w->name, s, l, h, b);
					n++;
				}
			}
	}
	return n;
}

/* kvt_seq_spill(s) moving exactly what is due, with the stats following. */
void w_spill_ok(struct world *w, uint32_t s, const char *what)
{
	int64_t due = w_spill_due(w, s);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_spill(w->c, w->seqs[s]);
	T_CHECK(got == due, "%s %s: kvt_seq_spill(seq %u) got %lld (%s), wanted %lld bytes (full "
		"spillable blocks x %llu bytes)", w->name, what, s, (long long)got,
		got < 0 ? kvt_last_error(w->c) : "bytes", (long long)due,
		(unsigned long long)w_block_bytes(w));
	kvt_stats b = t_stats(w->c);
	T_CHECK(a.host_bytes_used - b.host_bytes_used == (uint64_t)due,
		"%s %s seq %u: host_bytes_used went %llu -> %llu, wanted a drop of %lld", w->name, what,
		s, (unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
		(long long)due);
	T_CHECK(due == 0 ? b.nvme_bytes_used == a.nvme_bytes_used
			 : b.nvme_bytes_used >= a.nvme_bytes_used + (uint64_t)due,
		"%s %s seq %u: nvme_bytes_used went %llu -> %llu, wanted a rise of at least %lld",
		w->name, what, s, (unsigned long long)a.nvme_bytes_used,
		(unsigned long long)b.nvme_bytes_used, (long long)due);
	T_CHECK(b.spills == a.spills + (due > 0), "%s %s: spills counter got %llu, wanted %llu",
		w->name, what, (unsigned long long)b.spills,
		(unsigned long long)(a.spills + (due > 0)));
	T_CHECK(b.nvme_bytes_written >= a.nvme_bytes_written + (uint64_t)due,
		"%s %s: nvme_bytes_written got %llu, wanted >= %llu", w->name, what,
		(unsigned long long)b.nvme_bytes_written,
		(unsigned long long)(a.nvme_bytes_written + (uint64_t)due));
	for (uint32_t l = 0; l < w->layers; l++)
		w->spilled[s][l] = w_full_blocks(w, s, l);
	uint32_t on = w_blocks_on_nvme(w, s), want = 0;
	for (uint32_t l = 0; l < w->layers; l++)
		want += w->spilled[s][l] * w->nkv;
	T_CHECK(on == want, "%s %s seq %u: %u blocks on NVMe in the cache's table, wanted %u", w->name,
		what, s, on, want);
}

/* kvt_seq_restore(s) moving back everything, with the stats following. */
void w_restore_ok(struct world *w, uint32_t s, const char *what)
{
	int64_t due = w_restore_due(w, s);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_restore(w->c, w->seqs[s]);
	T_CHECK(got == due, "%s %s: kvt_seq_restore(seq %u) got %lld (%s), wanted %lld bytes", w->name,
		what, s, (long long)got, got < 0 ? kvt_last_error(w->c) : "bytes", (long long)due);
	kvt_stats b = t_stats(w->c);
	T_CHECK(b.host_bytes_used - a.host_bytes_used == (uint64_t)due,
		"%s %s seq %u: host_bytes_used went %llu -> %llu, wanted a rise of %lld", w->name, what,
		s, (unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
		(long long)due);
	T_CHECK(a.nvme_bytes_used - b.nvme_bytes_used >= (uint64_t)due,
		"%s %s seq %u: nvme_bytes_used went %llu -> %llu, wanted a drop of at least %lld",
		w->name, what, s, (unsigned long long)a.nvme_bytes_used,
		(unsigned long long)b.nvme_bytes_used, (long long)due);
	T_CHECK(b.restores == a.restores + (due > 0), "%s %s: restores counter got %llu, wanted %llu",
		w->name, what, (unsigned long long)b.restores,
		(unsigned long long)(a.restores + (due > 0)));
	for (uint32_t l = 0; l < w->layers; l++)
		w->spilled[s][l] = 0;
	T_CHECK(w_blocks_on_nvme(w, s) == 0, "%s %s seq %u: blocks still on NVMe after restore",
		w->name, what, s);
}

/* ---- 1. round trips --------------------------------------------------------------------- */

/* kvt_gather of (s, l) with the selection already made (no kvt_select first); the rc. */
int w_gather_again(struct world *w, uint32_t s, uint32_t l)
{
	uint32_t n = w->n[s][l];
	memset(w->gk, 0xa5, 2 * (size_t)w->nkv * n * w->d);
	memset(w->gv, 0x5a, 2 * (size_t)w->nkv * n * w->d);
	return kvt_gather(w->c, l, 1, &w->seqs[s], n, w->counts, w->pos, w->gk, w->gv, NULL);
}

/* kvt_attend of every sequence in one batch on layer l, bit for bit the mirror's batch. */
void w_check_attend_batch(struct world *w, uint32_t l, const char *what)
{
	size_t per = (size_t)w->nq * w->d;
	uint16_t *q = (uint16_t *)t_alloc(2 * per * w->nseq);
	float *o = (float *)t_alloc(sizeof(float) * per * w->nseq);
	float *mo = (float *)t_alloc(sizeof(float) * per * w->nseq);
	t_fill(&w->rng, w->cfg.dtype, per * w->nseq, 0.1, 1.0, q, NULL);
	int rc = kvt_attend(w->c, l, w->nseq, w->seqs, q, o, NULL);
	T_CHECK(rc == 0, "%s %s: batched attend of %u sequences on layer %u got %d (%s: %s)", w->name,
		what, w->nseq, l, rc, kvt_strerror(rc), kvt_last_error(w->c));
	rc = kvt_attend(w->mirror, l, w->nseq, w->mseqs, q, mo, NULL);
	T_CHECK(rc == 0, "%s: mirror batched attend: %s", w->name, kvt_last_error(w->mirror));
	for (size_t i = 0; i < per * w->nseq; i++)
		T_CHECK(t_fbits(o[i]) == t_fbits(mo[i]),
			"%s %s: batched attend layer %u, sequence %zu out[%zu] got %.9g, wanted %.9g as the "
			"cache that never spills", w->name, what, l, i / per, i % per, (double)o[i],
			(double)mo[i]);
	free(q);
	free(o);
	free(mo);
}

