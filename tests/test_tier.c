/* SPDX-License-Identifier: MIT */
/*
 * The NVMe tier of the cache through the public API (suite nvme), on scratch files of the local disk
 * ($KVT_TEST_DIR, else the current directory):
 *   - round trips of random K/V through kvt_seq_spill, direct serving and kvt_seq_restore, byte for
 *     byte (gather with p = 1) and bit for bit (attention against a mirror cache that never spills),
 *     with decoding going on while a sequence is spilled;
 *   - capacity-driven automatic spills (KVT_SPILL_LRU), and -ENOSPC without them;
 *   - -ENOSPC on spill when the files are full, the host copy intact;
 *   - -EOPNOTSUPP without an NVMe tier, and the configuration errors of the NVMe fields;
 *   - single-bit corruption of a written block (header, chunk CRCs, payload, padding): -EBADMSG that
 *     names the block, from direct serving and from restore, nothing unverified cached or served;
 *   - a block cache too small for a selection: -ENOSPC naming nvme_cache_bytes.
 * Exits 77 (skip) where the kernel refuses io_uring or the build has no liburing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "common.h"

#include "tier_util.h"

enum { D = 64, MAXS = 6, MAXL = 3, MAXKV = 4, MAXQ = 8 };
#define ROW_BYTES ((uint64_t)2 * D * 2)                 /* K then V of one token, 2-byte elements */
#define BLOCK_BYTES ((uint64_t)KVT_BLOCK_TOKENS * ROW_BYTES) /* one host-tier block */

/* One cache under test, every row given to it, and a mirror cache without an NVMe tier. */
struct world {
	char name[192];
	kvt_config cfg;
	kvt_cache *c, *mirror;
	tt_files f;
	int fd[TT_MAX_FILES]; /* the scratch files, opened here before they are unlinked */
	uint32_t nseq, seqs[MAXS], mseqs[MAXS];
	uint32_t cap, nkv, nq, layers, d;
	uint16_t *k[MAXS][MAXL], *v[MAXS][MAXL]; /* [cap, nkv, D] in dtype */
	uint32_t n[MAXS][MAXL];
	uint32_t spilled[MAXS][MAXL]; /* full blocks per KV head moved to NVMe, by this test's count */
	t_rng rng;
	uint16_t *gk, *gv, *q, *kb, *vb;
	int32_t *counts, *pos;
	float *out, *mout;
	kvt_stats before; /* the cache's stats just before the last w_prefill call */
};

static void w_open(struct world *w, const char *name, kvt_config cfg, uint32_t n_files,
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
static uint64_t w_block_bytes(const struct world *w)
{
	return (uint64_t)KVT_BLOCK_TOKENS * 2 * w->d * 2;
}

static void w_close(struct world *w)
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

static struct kvt_layer *w_layer(const struct world *w, uint32_t s, uint32_t l)
{
	return &w->c->seqs[w->seqs[s]].layers[l];
}

/* Random K/V rows (never all zero: K ~ N(0.3, 1), V ~ N(-0.2, 1)) for tokens [at, at + n). */
static void w_rows(struct world *w, uint32_t s, uint32_t l, uint32_t at, uint32_t n)
{
	size_t row = (size_t)w->nkv * w->d;
	T_CHECK(at + n <= w->cap, "%s: seq %u layer %u: %u tokens exceed the test's cap %u", w->name, s,
		l, at + n, w->cap);
	t_fill(&w->rng, w->cfg.dtype, n * row, 0.3, 1.0, w->k[s][l] + at * row, NULL);
	t_fill(&w->rng, w->cfg.dtype, n * row, -0.2, 1.0, w->v[s][l] + at * row, NULL);
}

/* Prefill n tokens of world sequence s on layer l; the mirror gets the same. Returns the rc. */
static int w_prefill(struct world *w, uint32_t s, uint32_t l, uint32_t n)
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

static void w_prefill_ok(struct world *w, uint32_t s, uint32_t n)
{
	for (uint32_t l = 0; l < w->layers; l++) {
		int rc = w_prefill(w, s, l, n);
		T_CHECK(rc == 0, "%s: prefill of %u tokens, seq %u layer %u: got %d (%s: %s), wanted 0",
			w->name, n, s, l, rc, kvt_strerror(rc), kvt_last_error(w->c));
	}
}

/* One decode token for each of the ns world sequences in idx[] on every layer (one batch). */
static void w_append_ok(struct world *w, uint32_t ns, const uint32_t *idx)
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

static void w_append_all(struct world *w, uint32_t tokens)
{
	uint32_t idx[MAXS];
	for (uint32_t s = 0; s < w->nseq; s++)
		idx[s] = s;
	for (uint32_t t = 0; t < tokens; t++)
		w_append_ok(w, w->nseq, idx);
}

/* kvt_select (p = 1: every position) then kvt_gather of (s, l) into gk/gv/pos; the rc of gather. */
static int w_gather(struct world *w, uint32_t s, uint32_t l)
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
static void w_expect(struct world *w, uint32_t s, uint32_t l, int rc, const char *what)
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

static void w_check(struct world *w, uint32_t s, uint32_t l, const char *what)
{
	w_expect(w, s, l, w_gather(w, s, l), what);
}

static void w_check_all(struct world *w, const char *what)
{
	for (uint32_t s = 0; s < w->nseq; s++)
		for (uint32_t l = 0; l < w->layers; l++)
			w_check(w, s, l, what);
}

/* The query of (s, l): the same every time, so that outputs can be compared across calls. */
static void w_query(struct world *w, uint32_t s, uint32_t l)
{
	t_rng r;
	t_rng_seed(&r, w->rng.seed * 31 + s * 8 + l + 1);
	t_fill(&r, w->cfg.dtype, (size_t)w->nq * w->d, 0.1, 1.0, w->q, NULL);
}

/* kvt_attend of (s, l) into w->out; the rc. */
static int w_attend(struct world *w, uint32_t s, uint32_t l)
{
	w_query(w, s, l);
	return kvt_attend(w->c, l, 1, &w->seqs[s], w->q, w->out, NULL);
}

/* Attention of (s, l) is bit for bit the mirror's (and ref's when given). */
static void w_check_attend(struct world *w, uint32_t s, uint32_t l, const float *ref,
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
static uint32_t w_full_blocks(const struct world *w, uint32_t s, uint32_t l)
{
	const struct kvt_layer *L = w_layer(w, s, l);
	uint32_t n = w->n[s][l], front = n < w->cfg.n_sink ? n : w->cfg.n_sink;
	T_CHECK(L->n_tokens == n && front + L->n_indexed <= n,
		"%s seq %u layer %u: internal length %u indexed %u, wanted length %u", w->name, s, l,
		L->n_tokens, L->n_indexed, n);
	return (front + L->n_indexed) / KVT_BLOCK_TOKENS;
}

/* Bytes kvt_seq_spill(s) must move now, by the test's count of what it spilled before. */
static int64_t w_spill_due(const struct world *w, uint32_t s)
{
	int64_t b = 0;
	for (uint32_t l = 0; l < w->layers; l++)
		b += (int64_t)(w_full_blocks(w, s, l) - w->spilled[s][l]) * w->nkv * (int64_t)w_block_bytes(w);
	return b;
}

/* Bytes kvt_seq_restore(s) must move: every block the test spilled. */
static int64_t w_restore_due(const struct world *w, uint32_t s)
{
	int64_t b = 0;
	for (uint32_t l = 0; l < w->layers; l++)
		b += (int64_t)w->spilled[s][l] * w->nkv * (int64_t)w_block_bytes(w);
	return b;
}

/* Blocks of s on NVMe according to the cache's own table (NULL host pointer, loc.bytes set). */
static uint32_t w_blocks_on_nvme(const struct world *w, uint32_t s)
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
static void w_spill_ok(struct world *w, uint32_t s, const char *what)
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
static void w_restore_ok(struct world *w, uint32_t s, const char *what)
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
static int w_gather_again(struct world *w, uint32_t s, uint32_t l)
{
	uint32_t n = w->n[s][l];
	memset(w->gk, 0xa5, 2 * (size_t)w->nkv * n * w->d);
	memset(w->gv, 0x5a, 2 * (size_t)w->nkv * n * w->d);
	return kvt_gather(w->c, l, 1, &w->seqs[s], n, w->counts, w->pos, w->gk, w->gv, NULL);
}

/* kvt_attend of every sequence in one batch on layer l, bit for bit the mirror's batch. */
static void w_check_attend_batch(struct world *w, uint32_t l, const char *what)
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

static void round_trip(const char *name, uint32_t layers, uint32_t nq, uint32_t nkv, uint32_t d,
		       uint32_t dtype, uint32_t n_files, uint64_t seed)
{
	enum { NS = 3 };
	static const uint32_t chunks[NS][2] = {{700, 400}, {300, 900}, {1000, 60}};
	kvt_config cfg = t_config(layers, nq, nkv, d, dtype);
	cfg.p = 1.0f;
	cfg.nvme_queue_depth = 8;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	int64_t live = kvt_mem_live();
	int fds = tt_fd_count();
	w_open(w, name, cfg, n_files, (uint64_t)64 << 20, NS, 2600, seed, 1);
	for (uint32_t s = 0; s < NS; s++) {
		w_prefill_ok(w, s, chunks[s][0]);
		w_prefill_ok(w, s, chunks[s][1]);
	}
	w_append_all(w, 40);
	w_check_all(w, "before any spill");
	size_t per = (size_t)nq * d;
	float *ref = (float *)t_alloc(sizeof(float) * NS * MAXL * per);
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++) {
			w_check_attend(w, s, l, NULL, "before any spill");
			memcpy(ref + ((size_t)s * MAXL + l) * per, w->out, sizeof(float) * per);
		}
	kvt_stats st0 = t_stats(w->c);
	T_CHECK(st0.nvme_bytes_used == 0 && st0.nvme_bytes_capacity > 0,
		"%s: before spilling nvme_bytes_used got %llu (wanted 0), capacity %llu (wanted > 0)",
		w->name, (unsigned long long)st0.nvme_bytes_used,
		(unsigned long long)st0.nvme_bytes_capacity);
	/* the selection of seq 0 layer 0 is made while it is on the host, and gathered after */
	int rc = w_gather(w, 0, 0);
	w_expect(w, 0, 0, rc, "selected before the spill");
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(w_spill_due(w, s) > 0, "%s: seq %u has nothing to spill", w->name, s);
		w_spill_ok(w, s, "first spill");
		w_spill_ok(w, s, "second spill (nothing left)");
	}
	/* direct serving: rows read through the block cache */
	kvt_stats a = t_stats(w->c);
	w_expect(w, 0, 0, w_gather_again(w, 0, 0), "selected before the spill, gathered after");
	w_check_all(w, "spilled, first gather");
	kvt_stats b = t_stats(w->c);
	T_CHECK(b.nvme_cache_misses > a.nvme_cache_misses && b.nvme_reads > a.nvme_reads &&
			b.nvme_bytes_read > a.nvme_bytes_read,
		"%s: direct serving: cache misses %llu -> %llu, reads %llu -> %llu, wanted both to rise",
		w->name, (unsigned long long)a.nvme_cache_misses,
		(unsigned long long)b.nvme_cache_misses, (unsigned long long)a.nvme_reads,
		(unsigned long long)b.nvme_reads);
	uint64_t chunks_spilled = 0;
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++)
			chunks_spilled += (uint64_t)w->spilled[s][l] * nkv *
					  (w_block_bytes(w) / KVT_NVME_CHUNK);
	T_CHECK(b.nvme_cache_misses - a.nvme_cache_misses == chunks_spilled,
		"%s: first gather of everything: cache misses rose by %llu, wanted %llu (each 4 KiB "
		"chunk of every spilled block once)",
		w->name, (unsigned long long)(b.nvme_cache_misses - a.nvme_cache_misses),
		(unsigned long long)chunks_spilled);
	w_check_all(w, "spilled, second gather");
	kvt_stats c2 = t_stats(w->c);
	T_CHECK(c2.nvme_cache_hits - b.nvme_cache_hits == chunks_spilled &&
			c2.nvme_cache_misses == b.nvme_cache_misses,
		"%s: second gather: cache hits rose by %llu (wanted %llu), misses %llu -> %llu (wanted "
		"none: the 64 MiB cache holds every chunk)",
		w->name, (unsigned long long)(c2.nvme_cache_hits - b.nvme_cache_hits),
		(unsigned long long)chunks_spilled, (unsigned long long)b.nvme_cache_misses,
		(unsigned long long)c2.nvme_cache_misses);
	for (uint32_t s = 0; s < NS; s++)
		for (uint32_t l = 0; l < layers; l++)
			w_check_attend(w, s, l, ref + ((size_t)s * MAXL + l) * per, "spilled");
	for (uint32_t l = 0; l < layers; l++)
		w_check_attend_batch(w, l, "spilled");
	/* a prefill chunk on a spilled sequence grows its block table (spill table included) */
	uint32_t cap0 = w_layer(w, 0, 0)->blk_cap;
	w_prefill_ok(w, 0, 1000);
	T_CHECK(w_layer(w, 0, 0)->blk_cap > cap0, "%s: the block table did not grow (%u blocks)",
		w->name, cap0);
	w_check_all(w, "spilled, after a prefill that grew the block table");
	/* decoding goes on: appends with flushes make more blocks full and spillable */
	for (int round = 0; round < 6; round++) {
		w_append_all(w, 50);
		for (uint32_t s = 0; s < NS; s++)
			for (uint32_t l = 0; l < layers; l++)
				w_check_attend(w, s, l, NULL, "decoding while spilled");
	}
	w_check_all(w, "spilled, after 300 appends");
	for (uint32_t s = 0; s < NS; s++) {
		T_CHECK(w_spill_due(w, s) > 0, "%s: seq %u: the appends made no new block spillable",
			w->name, s);
		w_spill_ok(w, s, "spill after appends");
	}
	w_check_all(w, "spilled twice");
	for (uint32_t l = 0; l < layers; l++)
		w_check_attend_batch(w, l, "spilled twice");
	for (uint32_t s = 0; s < NS; s++) {
		w_restore_ok(w, s, "restore");
		w_restore_ok(w, s, "second restore (nothing left)");
		for (uint32_t l = 0; l < layers; l++) {
			w_check(w, s, l, "restored");
			w_check_attend(w, s, l, NULL, "restored");
		}
	}
	kvt_stats e = t_stats(w->c), m = t_stats(w->mirror);
	T_CHECK(e.host_bytes_used == m.host_bytes_used && e.nvme_bytes_used == 0,
		"%s: after restoring everything host_bytes_used got %llu (wanted %llu as the cache that "
		"never spilled), nvme_bytes_used got %llu (wanted 0)",
		w->name, (unsigned long long)e.host_bytes_used, (unsigned long long)m.host_bytes_used,
		(unsigned long long)e.nvme_bytes_used);
	T_CHECK(e.spills == 2 * NS && e.restores == NS && e.auto_spills == 0,
		"%s: counters spills %llu restores %llu auto_spills %llu, wanted %d %d 0", w->name,
		(unsigned long long)e.spills, (unsigned long long)e.restores,
		(unsigned long long)e.auto_spills, 2 * NS, NS);
	/* and once more: spill, serve, close a spilled sequence (its NVMe space comes back) */
	w_spill_ok(w, 0, "spill after restore");
	w_check_all(w, "spilled again after restore");
	T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "%s: close spilled seq", w->name);
	kvt_stats f = t_stats(w->c);
	T_CHECK(f.nvme_bytes_used == 0, "%s: closing the spilled sequence left nvme_bytes_used %llu, "
		"wanted 0", w->name, (unsigned long long)f.nvme_bytes_used);
	print_message("%s: %llu bytes written, %llu read, %llu reads, cache hits %llu misses %llu\n",
		      w->name, (unsigned long long)f.nvme_bytes_written,
		      (unsigned long long)f.nvme_bytes_read, (unsigned long long)f.nvme_reads,
		      (unsigned long long)f.nvme_cache_hits, (unsigned long long)f.nvme_cache_misses);
	free(ref);
	char wname[sizeof w->name];
	memcpy(wname, w->name, sizeof wname);
	w_close(w);
	free(w);
	TT_CHECK_RELEASED(wname, live, fds);
}

static void test_round_trip(void **state)
{
	(void)state;
	tt_skip_unless_available();
	round_trip("round trip f16 d=64 3 layers GQA 4/2, 1 file", 3, 4, 2, 64, KVT_DTYPE_F16, 1,
		   0x71e40001u);
	round_trip("round trip bf16 d=64 2 layers MHA 4/4, 3 files", 2, 4, 4, 64, KVT_DTYPE_BF16, 3,
		   0x71e40002u);
	round_trip("round trip f16 d=128 1 layer GQA 8/2, 2 files", 1, 8, 2, 128, KVT_DTYPE_F16, 2,
		   0x71e40003u);
	round_trip("round trip bf16 d=256 1 layer GQA 2/1, 1 file", 1, 2, 1, 256, KVT_DTYPE_BF16, 1,
		   0x71e40004u);
}

/* ---- 2. capacity-driven spills ------------------------------------------------------------ */

enum { CAP_SEQS = 5, CAP_TOKENS = 2000 };

/* Fill sequence s: two prefill chunks on every layer and 20 appends (2000 tokens). Returns the first
 * failing rc (with *layer and *what set) or 0. */
static int cap_fill(struct world *w, uint32_t s, uint32_t *layer, const char **what)
{
	static const uint32_t chunk[2] = {1200, 780};
	for (int ci = 0; ci < 2; ci++)
		for (uint32_t l = 0; l < w->layers; l++) {
			int rc = w_prefill(w, s, l, chunk[ci]);
			if (rc < 0) {
				*layer = l;
				*what = ci ? "second prefill chunk" : "first prefill chunk";
				return rc;
			}
		}
	for (int t = 0; t < 20; t++)
		w_append_ok(w, 1, &s);
	return 0;
}

static kvt_config cap_config(uint32_t policy)
{
	kvt_config cfg = t_config(2, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	/* a sequence takes 2 layers x 2 heads x 8 blocks = 32 blocks: room for two and a bit */
	cfg.host_bytes = 68 * BLOCK_BYTES;
	cfg.spill_policy = policy;
	return cfg;
}

static void test_auto_spill_lru(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "LRU spills, 5 sequences of 2000 tokens in 68 host blocks", cap_config(KVT_SPILL_LRU),
	       1, (uint64_t)32 << 20, CAP_SEQS, CAP_TOKENS + 10, 0x71e40010u, 0);
	uint64_t cap = w->cfg.host_bytes;
	for (uint32_t s = 0; s < CAP_SEQS; s++) {
		uint32_t layer = 0;
		const char *what = "";
		int rc = cap_fill(w, s, &layer, &what);
		T_CHECK(rc == 0, "%s: filling seq %u, %s of layer %u: got %d (%s: %s), wanted 0 (LRU "
			"spills make room)", w->name, s, what, layer, rc, kvt_strerror(rc),
			kvt_last_error(w->c));
		kvt_stats st = t_stats(w->c);
		T_CHECK(st.host_bytes_used <= cap, "%s: host_bytes_used %llu over capacity %llu",
			w->name, (unsigned long long)st.host_bytes_used, (unsigned long long)cap);
	}
	kvt_stats st = t_stats(w->c);
	T_CHECK(st.auto_spills > 0 && st.spills >= st.auto_spills,
		"%s: auto_spills got %llu (spills %llu), wanted > 0", w->name,
		(unsigned long long)st.auto_spills, (unsigned long long)st.spills);
	T_CHECK(w_blocks_on_nvme(w, 0) > 0, "%s: the least recently used seq 0 was not spilled",
		w->name);
	w_check_all(w, "after the fill (direct serving)");
	/* restore the first sequence: room is made by spilling others */
	uint32_t on = w_blocks_on_nvme(w, 0);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_restore(w->c, w->seqs[0]);
	T_CHECK(got == (int64_t)on * (int64_t)BLOCK_BYTES,
		"%s: restore of seq 0 got %lld (%s), wanted %llu bytes (%u blocks)", w->name,
		(long long)got, got < 0 ? kvt_last_error(w->c) : "bytes",
		(unsigned long long)(on * BLOCK_BYTES), on);
	kvt_stats b = t_stats(w->c);
	T_CHECK(w_blocks_on_nvme(w, 0) == 0 && b.host_bytes_used <= cap && b.restores == a.restores + 1,
		"%s: after restore seq 0 has %u blocks on NVMe (wanted 0), host_bytes_used %llu of "
		"%llu, restores %llu", w->name, w_blocks_on_nvme(w, 0),
		(unsigned long long)b.host_bytes_used, (unsigned long long)cap,
		(unsigned long long)b.restores);
	print_message("%s: %llu auto spills during the fill, %llu more for the restore\n", w->name,
		      (unsigned long long)a.auto_spills,
		      (unsigned long long)(b.auto_spills - a.auto_spills));
	w_check_all(w, "after restoring seq 0");
	/* decoding goes on over all five, spilled or not */
	w_append_all(w, 10);
	w_check_all(w, "after appends to all five");
	w_close(w);
	free(w);
}

/*
 * A decode batch of every sequence on a full host tier: no sequence is idle, so KVT_SPILL_LRU must
 * take the batch's own indexed blocks (which an append never writes) instead of failing.
 */
static void test_lru_whole_batch(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	kvt_config cfg = cap_config(KVT_SPILL_LRU);
	/* 3 sequences x 2 layers x 2 heads x 2 blocks: the tier is full after the prefills */
	cfg.host_bytes = 24 * BLOCK_BYTES;
	w_open(w, "LRU with every sequence in the batch", cfg, 1, (uint64_t)32 << 20, 3, 600,
	       0x71e40012u, 0);
	for (uint32_t s = 0; s < 3; s++)
		w_prefill_ok(w, s, 2 * KVT_BLOCK_TOKENS);
	kvt_stats a = t_stats(w->c);
	T_CHECK(a.host_bytes_used == cfg.host_bytes && a.auto_spills == 0,
		"%s: after the prefills host_bytes_used %llu (wanted %llu), auto_spills %llu (wanted 0)",
		w->name, (unsigned long long)a.host_bytes_used, (unsigned long long)cfg.host_bytes,
		(unsigned long long)a.auto_spills);
	w_append_all(w, 1); /* every sequence needs a new block per layer and head */
	kvt_stats b = t_stats(w->c);
	T_CHECK(b.auto_spills >= 2 && b.host_bytes_used <= cfg.host_bytes,
		"%s: auto_spills got %llu (wanted >= 2), host_bytes_used %llu of %llu", w->name,
		(unsigned long long)b.auto_spills, (unsigned long long)b.host_bytes_used,
		(unsigned long long)cfg.host_bytes);
	w_check_all(w, "after the batch append that spilled its own sequences");
	w_close(w);
	free(w);
}

/*
 * A refused call leaves the spill order as it was: a kvt_attend of the least recently used
 * sequence refused for a non-finite query does not make it recently used, so the next automatic
 * spill still takes it (before, the refused call's stamp moved the spill to the next sequence).
 */
static void test_lru_refused_call(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	kvt_config cfg = cap_config(KVT_SPILL_LRU);
	cfg.host_bytes = 24 * BLOCK_BYTES; /* full after the three prefills */
	w_open(w, "LRU order after a refused call", cfg, 1, (uint64_t)32 << 20, 3, 600, 0x71e40014u,
	       0);
	for (uint32_t s = 0; s < 3; s++)
		w_prefill_ok(w, s, 2 * KVT_BLOCK_TOKENS);
	w_query(w, 0, 0);
	w->q[3] = t_enc(cfg.dtype, NAN);
	int rc = kvt_attend(w->c, 0, 1, &w->seqs[0], w->q, w->out, NULL);
	T_CHECK(rc == -EINVAL, "%s: attend with a NaN query got %d (%s), wanted -EINVAL", w->name, rc,
		kvt_last_error(w->c));
	const uint32_t idx[1] = {2};
	w_append_ok(w, 1, idx); /* sequence 2 needs a new block per layer and head: one spill */
	T_CHECK(w_blocks_on_nvme(w, 0) > 0 && w_blocks_on_nvme(w, 1) == 0,
		"%s: the automatic spill took %u blocks of sequence 0 and %u of sequence 1; wanted "
		"sequence 0, the least recently used (the refused attend must not count as a use)",
		w->name, w_blocks_on_nvme(w, 0), w_blocks_on_nvme(w, 1));
	w_check_all(w, "after the refused attend and the automatic spill");
	w_close(w);
	free(w);
}

/*
 * Restoring a sequence never spills that same sequence to make room: with only its own indexed
 * blocks left to spill, the restore fails with -ENOSPC and nothing changes.
 */
static void test_restore_keeps_itself(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	kvt_config cfg = cap_config(KVT_SPILL_LRU);
	cfg.host_bytes = 8 * BLOCK_BYTES; /* 2 layers x 2 heads x 2 blocks */
	w_open(w, "restore with only its own blocks to spill", cfg, 1, (uint64_t)32 << 20, 1,
	       3 * KVT_BLOCK_TOKENS, 0x71e40013u, 0);
	w_prefill_ok(w, 0, 2 * KVT_BLOCK_TOKENS);
	w_spill_ok(w, 0, "spill of the first block of every layer and head");
	/* the host tier fills again, and the second blocks become fully indexed (spillable) */
	w_append_all(w, KVT_BLOCK_TOKENS);
	kvt_stats a = t_stats(w->c);
	int64_t got = kvt_seq_restore(w->c, w->seqs[0]);
	kvt_stats b = t_stats(w->c);
	T_CHECK(got == -ENOSPC, "%s: restore got %lld (%s), wanted -ENOSPC", w->name, (long long)got,
		got < 0 ? kvt_last_error(w->c) : "bytes");
	T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
			a.spills == b.spills,
		"%s: the failed restore changed host %llu -> %llu, NVMe %llu -> %llu, spills %llu -> "
		"%llu", w->name, (unsigned long long)a.host_bytes_used,
		(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
		(unsigned long long)b.nvme_bytes_used, (unsigned long long)a.spills,
		(unsigned long long)b.spills);
	w_check_all(w, "after the refused restore");
	w_close(w);
	free(w);
}

static void test_no_spill_enospc(void **state)
{
	(void)state;
	tt_skip_unless_available();
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "KVT_SPILL_NONE, 5 sequences of 2000 tokens in 68 host blocks",
	       cap_config(KVT_SPILL_NONE), 1, (uint64_t)32 << 20, CAP_SEQS, CAP_TOKENS, 0x71e40011u, 0);
	int failed = 0;
	for (uint32_t s = 0; s < CAP_SEQS && !failed; s++) {
		uint32_t layer = 0;
		const char *what = "";
		int rc = cap_fill(w, s, &layer, &what);
		if (rc == 0)
			continue;
		failed = 1;
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC, "%s: seq %u %s of layer %u: got %d (%s: %s), wanted -ENOSPC",
			w->name, s, what, layer, rc, kvt_strerror(rc), msg);
		T_CHECK(strstr(msg, "bytes needed") && strstr(msg, "free") && strstr(msg, "host_bytes"),
			"%s: the -ENOSPC text \"%s\" does not name the bytes needed, free and host_bytes",
			w->name, msg);
		print_message("%s: seq %u %s of layer %u: -ENOSPC \"%s\"\n", w->name, s, what, layer,
			      msg);
		/* the failing call changed nothing but the error counter */
		const kvt_stats a = w->before, b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.tokens == b.tokens &&
				a.tokens_indexed == b.tokens_indexed && b.errors == a.errors + 1 &&
				b.auto_spills == 0 && b.spills == 0 && b.nvme_bytes_used == 0,
			"%s: the failed prefill changed host_bytes_used %llu -> %llu, tokens %llu -> "
			"%llu, indexed %llu -> %llu, errors %llu -> %llu (wanted +1); auto_spills %llu "
			"spills %llu nvme_bytes_used %llu (wanted 0)",
			w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.tokens,
			(unsigned long long)b.tokens, (unsigned long long)a.tokens_indexed,
			(unsigned long long)b.tokens_indexed, (unsigned long long)a.errors,
			(unsigned long long)b.errors, (unsigned long long)b.auto_spills,
			(unsigned long long)b.spills, (unsigned long long)b.nvme_bytes_used);
		int64_t len = kvt_seq_length(w->c, w->seqs[s], layer);
		T_CHECK(len == w->n[s][layer], "%s: after the failed prefill seq %u layer %u length got "
			"%lld, wanted %u", w->name, s, layer, (long long)len, w->n[s][layer]);
		/* a retry fails the same way */
		rc = w_prefill(w, s, layer, 780);
		T_CHECK(rc == -ENOSPC, "%s: retried prefill got %d, wanted -ENOSPC", w->name, rc);
	}
	T_CHECK(failed, "%s: the fill never returned -ENOSPC without a spill policy", w->name);
	/* every sequence holds what it was given, all on the host */
	for (uint32_t s = 0; s < CAP_SEQS; s++)
		for (uint32_t l = 0; l < w->layers; l++)
			if (w->n[s][l])
				w_check(w, s, l, "after the -ENOSPC");
	w_close(w);
	free(w);
}

/* ---- 3. NVMe files full --------------------------------------------------------------------- */

static void test_nvme_full(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	/* 256 KiB: room for three blocks of 64 KiB plus header and padding, at any alignment */
	w_open(w, "NVMe files full (256 KiB)", cfg, 1, (uint64_t)256 << 10, 2, 1200, 0x71e40020u, 0);
	w_prefill_ok(w, 0, 300);  /* 1 full spillable block per head: 2 blocks */
	w_prefill_ok(w, 1, 1100); /* 4 per head: 8 blocks */
	w_spill_ok(w, 0, "small sequence");
	for (int attempt = 0; attempt < 2; attempt++) {
		kvt_stats a = t_stats(w->c);
		int64_t rc = kvt_seq_spill(w->c, w->seqs[1]);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC, "%s attempt %d: spill of 8 blocks got %lld (%s), wanted -ENOSPC",
			w->name, attempt, (long long)rc, msg);
		T_CHECK(strstr(msg, "bytes") && strstr(msg, "free") && strstr(msg, "need"),
			"%s: the -ENOSPC text \"%s\" does not name the bytes needed and free", w->name,
			msg);
		kvt_stats b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				a.spills == b.spills,
			"%s: failed spill changed host_bytes_used %llu -> %llu, nvme_bytes_used %llu -> "
			"%llu, spills %llu -> %llu", w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
			(unsigned long long)b.nvme_bytes_used, (unsigned long long)a.spills,
			(unsigned long long)b.spills);
		T_CHECK(w_blocks_on_nvme(w, 1) == 0, "%s: blocks of the failed spill are marked on NVMe",
			w->name);
		if (attempt == 0)
			print_message("%s: -ENOSPC \"%s\"\n", w->name, msg);
		w_check(w, 1, 0, "after the failed spill");
		if (attempt == 0)
			w_check(w, 0, 0, "the spilled small sequence");
		w_check_attend(w, 1, 0, NULL, "after the failed spill");
		/* closing the small sequence frees its space, still not enough for eight blocks */
		if (attempt == 0) {
			T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "close");
			T_CHECK(t_stats(w->c).nvme_bytes_used == 0, "%s: close left NVMe space in use",
				w->name);
		}
	}
	w_close(w);
	free(w);
}

/* ---- 4. no NVMe tier, and configuration errors -------------------------------------------- */

static void test_no_tier(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "no NVMe tier", cfg, 0, 0, 1, 800, 0x71e40030u, 0);
	w_prefill_ok(w, 0, 700);
	kvt_stats a = t_stats(w->c);
	int64_t rc = kvt_seq_spill(w->c, w->seqs[0]);
	T_CHECK(rc == -EOPNOTSUPP && strstr(kvt_last_error(w->c), "n_nvme"),
		"%s: spill got %lld (\"%s\"), wanted -EOPNOTSUPP naming n_nvme", w->name, (long long)rc,
		kvt_last_error(w->c));
	rc = kvt_seq_restore(w->c, w->seqs[0]);
	T_CHECK(rc == -EOPNOTSUPP && strstr(kvt_last_error(w->c), "n_nvme"),
		"%s: restore got %lld (\"%s\"), wanted -EOPNOTSUPP naming n_nvme", w->name,
		(long long)rc, kvt_last_error(w->c));
	kvt_stats b = t_stats(w->c);
	T_CHECK(a.host_bytes_used == b.host_bytes_used && b.errors == a.errors + 2 &&
			b.nvme_bytes_capacity == 0 && b.spills == 0,
		"%s: host_bytes_used %llu -> %llu, errors %llu -> %llu (wanted +2), nvme capacity %llu",
		w->name, (unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used,
		(unsigned long long)a.errors, (unsigned long long)b.errors,
		(unsigned long long)b.nvme_bytes_capacity);
	w_check(w, 0, 0, "after -EOPNOTSUPP");
	T_CHECK(kvt_seq_spill(w->c, 7) == -ENOENT, "%s: spill of a closed sequence, wanted -ENOENT",
		w->name);
	T_CHECK(kvt_seq_spill(NULL, 0) == -EINVAL && kvt_seq_restore(NULL, 0) == -EINVAL,
		"%s: NULL cache, wanted -EINVAL", w->name);
	w_close(w);
	free(w);
}

static void test_config_errors(void **state)
{
	(void)state;
	tt_files f;
	tt_make_files(&f, 1, (uint64_t)1 << 20);
	const uint64_t zero[1] = {0};
	struct {
		const char *name, *field;
		uint32_t n_nvme;
		int paths, bytes; /* 0: NULL, 1: the scratch file's, 2: zero bytes */
		uint32_t policy;
		uint64_t cache;
		uint32_t qd;
	} cases[] = {
		{"n_nvme = 1, nvme_paths NULL", "nvme_paths", 1, 0, 1, 0, 64u << 20, 0},
		{"n_nvme = 1, nvme_bytes NULL", "nvme_bytes", 1, 1, 0, 0, 64u << 20, 0},
		{"nvme_bytes[0] = 0", "nvme_bytes[0]", 1, 1, 2, 0, 64u << 20, 0},
		{"spill_policy LRU without NVMe", "spill_policy", 0, 0, 0, KVT_SPILL_LRU, 64u << 20, 0},
		{"nvme_cache_bytes = 1 MiB - 1", "nvme_cache_bytes", 1, 1, 1, 0, (1u << 20) - 1, 0},
		{"nvme_cache_bytes = 2 TiB", "nvme_cache_bytes", 1, 1, 1, 0, (uint64_t)2 << 40, 0},
		{"nvme_queue_depth = 1025", "nvme_queue_depth", 1, 1, 1, 0, 64u << 20, 1025},
		{"n_nvme = 65", "n_nvme", 65, 1, 1, 0, 64u << 20, 0},
		{"spill_policy = 2", "spill_policy", 1, 1, 1, 2, 64u << 20, 0},
	};
	int nfail = 0;
	int64_t live = kvt_mem_live();
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
		cfg.n_nvme = cases[i].n_nvme;
		cfg.nvme_paths = cases[i].paths ? f.ptrs : NULL;
		cfg.nvme_bytes = cases[i].bytes == 1 ? f.bytes : cases[i].bytes == 2 ? zero : NULL;
		cfg.spill_policy = cases[i].policy;
		cfg.nvme_cache_bytes = cases[i].cache;
		cfg.nvme_queue_depth = cases[i].qd;
		kvt_cache *c = NULL;
		int rc = kvt_cache_create(&cfg, &c);
		const char *msg = kvt_last_error(NULL);
		T_SOFT(&nfail, rc == -EINVAL && c == NULL && strstr(msg, cases[i].field),
		       "config case \"%s\": got %d (\"%s\"), wanted -EINVAL naming %s", cases[i].name, rc,
		       msg, cases[i].field);
		if (c)
			kvt_cache_destroy(c);
	}
	/* the smallest valid block cache is accepted */
	kvt_config cfg = t_config(1, 4, 2, D, KVT_DTYPE_F16);
	cfg.n_nvme = 1;
	cfg.nvme_paths = f.ptrs;
	cfg.nvme_bytes = f.bytes;
	cfg.nvme_cache_bytes = 1u << 20;
	cfg.spill_policy = KVT_SPILL_LRU;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	if (rc == -EOPNOTSUPP) {
		tt_unlink(&f);
		print_message("SKIP the valid case: %s\n", kvt_last_error(NULL));
	} else {
		T_SOFT(&nfail, rc == 0, "config case \"nvme_cache_bytes = 1 MiB, LRU\": got %d (%s), "
		       "wanted 0", rc, kvt_last_error(NULL));
		kvt_cache_destroy(c);
	}
	/* a file that cannot be created: the text names the path */
	const char *bad[1] = {"/nonexistent-dir-kvt/file"};
	cfg.nvme_paths = bad;
	c = NULL;
	rc = kvt_cache_create(&cfg, &c);
	if (rc != -EOPNOTSUPP)
		T_SOFT(&nfail, rc < 0 && c == NULL && strstr(kvt_last_error(NULL), bad[0]),
		       "config case \"unopenable path\": got %d (\"%s\"), wanted an error naming %s", rc,
		       kvt_last_error(NULL), bad[0]);
	tt_unlink(&f);
	T_SOFT(&nfail, kvt_mem_live() == live, "config cases leaked: live allocations %lld, wanted %lld",
	       (long long)kvt_mem_live(), (long long)live);
	T_CHECK(nfail == 0, "%d configuration cases failed", nfail);
}

/* ---- 5. corruption ------------------------------------------------------------------------ */

/* Flip bit `bit` of the byte at `off` of file `fi` (through the page cache, then synced). */
static void flip_bit(struct world *w, uint32_t fi, uint64_t off, int bit)
{
	unsigned char b;
	int fd = w->fd[fi];
	T_CHECK(pread(fd, &b, 1, (off_t)off) == 1, "%s: pread of file %u @ %llu: %s", w->name, fi,
		(unsigned long long)off, strerror(errno));
	b ^= (unsigned char)(1u << bit);
	T_CHECK(pwrite(fd, &b, 1, (off_t)off) == 1, "%s: pwrite: %s", w->name, strerror(errno));
	T_CHECK(fdatasync(fd) == 0, "%s: fdatasync: %s", w->name, strerror(errno));
}

struct flip {
	const char *where;
	uint32_t layer, head, block;
	int region; /* 0: header at `at`, 1: payload at `at`, 2: padding (tail, else header's) at `at` */
	uint32_t at;
	int bit;
};

static void test_corruption(void **state)
{
	(void)state;
	tt_skip_unless_available();
	static const struct flip flips[] = {
		{"magic", 0, 0, 0, 0, 0, 0},
		{"magic, last byte", 1, 1, 1, 0, 3, 7},
		{"version", 0, 1, 2, 0, 4, 1},
		{"header byte 8", 1, 0, 0, 0, 8, 3},
		{"header byte 17", 0, 0, 1, 0, 17, 5},
		{"header byte 30", 1, 1, 2, 0, 30, 0},
		{"header byte 41", 0, 1, 0, 0, 41, 6},
		{"header byte 52", 1, 0, 1, 0, 52, 2},
		{"header byte 63", 0, 0, 2, 0, 63, 7},
		{"chunk CRC table, first", 1, 1, 0, 0, 64, 4},
		{"chunk CRC table, last", 0, 1, 1, 0, 127, 1},
		{"payload byte 0", 1, 0, 2, 1, 0, 0},
		{"payload chunk 3", 0, 0, 0, 1, 3 * 4096 + 1000, 6},
		{"payload chunk 7, a V element", 1, 1, 1, 1, 7 * 4096 + 200, 3},
		{"payload chunk 11", 0, 1, 2, 1, 11 * 4096 + 4095, 7},
		{"payload last byte", 1, 0, 0, 1, 65535, 5},
		{"padding first byte", 0, 0, 1, 2, 0, 2},
		{"padding last byte", 1, 1, 2, 2, UINT32_MAX, 4},
	};
	int detected_gather = 0, detected_restore = 0, trials = 0;
	for (size_t fi = 0; fi < sizeof flips / sizeof flips[0]; fi++) {
		const struct flip *fl = &flips[fi];
		kvt_config cfg = t_config(2, 4, 2, D, KVT_DTYPE_F16);
		cfg.p = 1.0f;
		struct world *w = (struct world *)t_alloc(sizeof *w);
		char name[128];
		snprintf(name, sizeof name, "corruption \"%s\" layer %u head %u block %u", fl->where,
			 fl->layer, fl->head, fl->block);
		w_open(w, name, cfg, 2, (uint64_t)8 << 20, 2, 800, 0x71e40040u + fi, 0);
		w_prefill_ok(w, 0, 500);
		w_prefill_ok(w, 0, 300); /* 3 full blocks per head and layer */
		w_prefill_ok(w, 1, 600);
		w_spill_ok(w, 0, "before the flip");
		w_spill_ok(w, 1, "the other sequence");
		struct kvt_layer *L = w_layer(w, 0, fl->layer);
		size_t at = (size_t)fl->head * L->blk_cap + fl->block;
		struct kvt_nvme_loc loc = L->spill[at].loc;
		/* Where the payload starts: after the header and its padding. */
		uint32_t hb = kvt_nvme_data_offset((uint32_t)BLOCK_BYTES,
						   kvt_nvme_alignment(w->c->nvme));
		uint64_t off = loc.offset;
		if (fl->region == 0)
			off += fl->at;
		else if (fl->region == 1)
			off += hb + fl->at;
		else {
			/* The tail padding; where the block has none, the header's padding. */
			uint64_t pad = loc.bytes - hb - BLOCK_BYTES,
				 start = hb + (uint64_t)BLOCK_BYTES;
			if (pad == 0) {
				start = kvt_nvme_header_bytes((uint32_t)BLOCK_BYTES);
				pad = hb - start;
			}
			if (pad == 0) {
				print_message("%s: no padding at this alignment, skipped\n", w->name);
				w_close(w);
				free(w);
				continue;
			}
			off += start + (fl->at == UINT32_MAX ? pad - 1 : fl->at);
		}
		T_CHECK(loc.bytes && off < loc.offset + loc.bytes,
			"%s: offset %llu outside the block at %llu (+%u)", w->name,
			(unsigned long long)off, (unsigned long long)loc.offset, loc.bytes);
		trials++;
		flip_bit(w, loc.file, off, fl->bit);
		char want[96];
		snprintf(want, sizeof want, "layer %u head %u tokens %u..%u", fl->layer, fl->head,
			 fl->block * KVT_BLOCK_TOKENS, (fl->block + 1) * KVT_BLOCK_TOKENS);
		/* direct serving refuses it, twice (nothing unverified was cached) */
		for (int again = 0; again < 2; again++) {
			int rc = w_gather(w, 0, fl->layer);
			const char *msg = kvt_last_error(w->c);
			T_CHECK(rc == -EBADMSG && strstr(msg, want),
				"%s gather %d: got %d (\"%s\"), wanted -EBADMSG naming \"%s\"", w->name,
				again, rc, msg, want);
			detected_gather += again == 0;
		}
		int rc = w_attend(w, 0, fl->layer);
		T_CHECK(rc == -EBADMSG, "%s: attend got %d (%s), wanted -EBADMSG", w->name, rc,
			kvt_last_error(w->c));
		/* the other layer and the other sequence are served */
		w_check(w, 0, 1 - fl->layer, "the layer not flipped");
		w_check(w, 1, fl->layer, "the other sequence");
		/* restore refuses it and takes no host memory */
		kvt_stats a = t_stats(w->c);
		int64_t r64 = kvt_seq_restore(w->c, w->seqs[0]);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(r64 == -EBADMSG && strstr(msg, want),
			"%s: restore got %lld (\"%s\"), wanted -EBADMSG naming \"%s\"", w->name,
			(long long)r64, msg, want);
		detected_restore++;
		kvt_stats b = t_stats(w->c);
		T_CHECK(a.host_bytes_used == b.host_bytes_used && a.nvme_bytes_used == b.nvme_bytes_used &&
				b.restores == a.restores,
			"%s: failed restore changed host_bytes_used %llu -> %llu, nvme_bytes_used %llu "
			"-> %llu", w->name, (unsigned long long)a.host_bytes_used,
			(unsigned long long)b.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
			(unsigned long long)b.nvme_bytes_used);
		uint32_t on = w_blocks_on_nvme(w, 0);
		T_CHECK(on == 2 * 2 * 3, "%s: after the failed restore %u blocks on NVMe, wanted 12",
			w->name, on);
		if (fi == 0)
			print_message("%s: restore -EBADMSG \"%s\"\n", w->name, msg);
		/* repaired: served and restored, byte for byte */
		flip_bit(w, loc.file, off, fl->bit);
		w_check(w, 0, fl->layer, "repaired, direct serving");
		w_check(w, 0, 1 - fl->layer, "repaired, direct serving");
		w_restore_ok(w, 0, "repaired");
		w_check(w, 0, 0, "restored");
		w_check(w, 0, 1, "restored");
		/* a new generation in a new place: served right (from the cache or the file) */
		w_spill_ok(w, 0, "spill after restore");
		w_check(w, 0, fl->layer, "spilled again");
		/* slot reuse: a new sequence in the same slot never sees the old one's cached chunks */
		T_CHECK(kvt_seq_close(w->c, w->seqs[0]) == 0, "close");
		T_CHECK(kvt_seq_open(w->c, &w->seqs[0]) == 0, "reopen");
		memset(w->n[0], 0, sizeof w->n[0]);
		memset(w->spilled[0], 0, sizeof w->spilled[0]);
		w_prefill_ok(w, 0, 800);
		w_spill_ok(w, 0, "new sequence in a reused slot");
		w_check(w, 0, 0, "new sequence in a reused slot");
		w_check(w, 0, 1, "new sequence in a reused slot");
		w_close(w);
		free(w);
	}
	print_message("corruption: %d single-bit flips, detected by direct serving %d, by restore %d\n",
		      trials, detected_gather, detected_restore);
	T_CHECK(trials >= 17 && detected_gather == trials && detected_restore == trials,
		"flips detected: direct serving %d, restore %d, of %d trials (wanted all)",
		detected_gather, detected_restore, trials);
}

/* ---- 6. block cache too small ---------------------------------------------------------------- */

static void test_block_cache_small(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, 64, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20; /* 256 chunks of 4 KiB = 4096 rows of d = 64 */
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "block cache of 1 MiB", cfg, 1, (uint64_t)16 << 20, 2, 5020, 0x71e40050u, 1);
	w_prefill_ok(w, 0, 3000);
	w_prefill_ok(w, 0, 2000); /* 19 full blocks per head: 304 chunks, more than the cache */
	w_prefill_ok(w, 1, 3900); /* 15 per head: 240 chunks, a head fits but not both */
	w_spill_ok(w, 0, "large");
	w_spill_ok(w, 1, "middle");
	/* each head's call fits, so the other head's chunks are evicted between calls */
	for (int pass = 0; pass < 3; pass++) {
		kvt_stats a = t_stats(w->c);
		w_check(w, 1, 0, "a head fits, both do not");
		kvt_stats b = t_stats(w->c);
		T_CHECK(b.nvme_cache_misses > a.nvme_cache_misses,
			"%s pass %d: cache misses %llu -> %llu, wanted a rise (240 + 240 chunks through "
			"256 slots)", w->name, pass, (unsigned long long)a.nvme_cache_misses,
			(unsigned long long)b.nvme_cache_misses);
		w_check_attend(w, 1, 0, NULL, "a head fits, both do not");
	}
	for (int again = 0; again < 2; again++) {
		int rc = w_gather(w, 0, 0);
		const char *msg = kvt_last_error(w->c);
		T_CHECK(rc == -ENOSPC && strstr(msg, "nvme_cache_bytes"),
			"%s gather %d: got %d (\"%s\"), wanted -ENOSPC naming nvme_cache_bytes", w->name,
			again, rc, msg);
		if (again == 0)
			print_message("%s: -ENOSPC \"%s\"\n", w->name, msg);
		rc = w_attend(w, 0, 0);
		T_CHECK(rc == -ENOSPC, "%s attend: got %d (%s), wanted -ENOSPC", w->name, rc,
			kvt_last_error(w->c));
		/* the cache is still consistent: the other sequence is served */
		w_check(w, 1, 0, "the other sequence after the -ENOSPC");
	}
	w_restore_ok(w, 0, "large");
	w_check(w, 0, 0, "restored");
	w_check_attend(w, 0, 0, NULL, "restored");
	w_check(w, 1, 0, "the other sequence");
	/* the next steps: appends, then a spill of what became full */
	w_append_all(w, 20);
	w_check(w, 0, 0, "after appends");
	w_check(w, 1, 0, "after appends");
	w_check_attend(w, 1, 0, NULL, "after appends");
	w_close(w);
	free(w);
}

/*
 * A stale block: the image of an older generation of the same tokens, written back where the current
 * one lives (a lost write, say), is refused by direct serving and by restore (-EBADMSG), and served
 * again once the current image is back.
 */
static void test_stale_generation(void **state)
{
	(void)state;
	tt_skip_unless_available();
	kvt_config cfg = t_config(1, 4, 2, 64, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	struct world *w = (struct world *)t_alloc(sizeof *w);
	w_open(w, "stale generation", cfg, 1, (uint64_t)8 << 20, 1, 800, 0x71e40060u, 0);
	w_prefill_ok(w, 0, 800); /* 3 full blocks per head */
	w_spill_ok(w, 0, "generation 1");
	struct kvt_layer *L = w_layer(w, 0, 0);
	const size_t at = (size_t)1 * L->blk_cap + 2; /* head 1, block 2 */
	struct kvt_nvme_loc old = L->spill[at].loc;
	uint64_t old_gen = L->spill[at].gen;
	unsigned char *img_old = (unsigned char *)t_alloc(old.bytes);
	T_CHECK(pread(w->fd[old.file], img_old, old.bytes, (off_t)old.offset) == (ssize_t)old.bytes,
		"%s: pread: %s", w->name, strerror(errno));
	w_restore_ok(w, 0, "generation 1");
	w_spill_ok(w, 0, "generation 2");
	L = w_layer(w, 0, 0);
	struct kvt_nvme_loc cur = L->spill[at].loc;
	T_CHECK(L->spill[at].gen != old_gen && cur.bytes == old.bytes,
		"%s: the new spill has generation %llu (old %llu), %u bytes (old %u)", w->name,
		(unsigned long long)L->spill[at].gen, (unsigned long long)old_gen, cur.bytes, old.bytes);
	unsigned char *img_cur = (unsigned char *)t_alloc(cur.bytes);
	T_CHECK(pread(w->fd[cur.file], img_cur, cur.bytes, (off_t)cur.offset) == (ssize_t)cur.bytes,
		"%s: pread: %s", w->name, strerror(errno));
	T_CHECK(pwrite(w->fd[cur.file], img_old, old.bytes, (off_t)cur.offset) == (ssize_t)old.bytes &&
			fdatasync(w->fd[cur.file]) == 0,
		"%s: pwrite: %s", w->name, strerror(errno));
	print_message("%s: generation %llu image written over generation %llu at file %u @ %llu\n",
		      w->name, (unsigned long long)old_gen, (unsigned long long)L->spill[at].gen,
		      cur.file, (unsigned long long)cur.offset);
	int rc = w_gather(w, 0, 0);
	const char *msg = kvt_last_error(w->c);
	T_CHECK(rc == -EBADMSG && strstr(msg, "head 1 tokens 512..768"),
		"%s: gather got %d (\"%s\"), wanted -EBADMSG naming head 1 tokens 512..768", w->name, rc,
		msg);
	print_message("%s: gather -EBADMSG \"%s\"\n", w->name, msg);
	kvt_stats a = t_stats(w->c);
	int64_t r64 = kvt_seq_restore(w->c, w->seqs[0]);
	kvt_stats b = t_stats(w->c);
	T_CHECK(r64 == -EBADMSG && a.host_bytes_used == b.host_bytes_used,
		"%s: restore got %lld (\"%s\"), host_bytes_used %llu -> %llu; wanted -EBADMSG and no "
		"change", w->name, (long long)r64, kvt_last_error(w->c),
		(unsigned long long)a.host_bytes_used, (unsigned long long)b.host_bytes_used);
	T_CHECK(pwrite(w->fd[cur.file], img_cur, cur.bytes, (off_t)cur.offset) == (ssize_t)cur.bytes &&
			fdatasync(w->fd[cur.file]) == 0,
		"%s: pwrite: %s", w->name, strerror(errno));
	w_check(w, 0, 0, "current generation back");
	w_restore_ok(w, 0, "current generation back");
	w_check(w, 0, 0, "restored");
	free(img_old);
	free(img_cur);
	w_close(w);
	free(w);
}

int main(void)
{
	t_warm_runtime();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_auto_spill_lru),
		cmocka_unit_test(test_lru_whole_batch),
		cmocka_unit_test(test_lru_refused_call),
		cmocka_unit_test(test_restore_keeps_itself),
		cmocka_unit_test(test_no_spill_enospc),
		cmocka_unit_test(test_nvme_full),
		cmocka_unit_test(test_no_tier),
		cmocka_unit_test(test_config_errors),
		cmocka_unit_test(test_corruption),
		cmocka_unit_test(test_block_cache_small),
		cmocka_unit_test(test_stale_generation),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
