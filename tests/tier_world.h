/* SPDX-License-Identifier: MIT */
/*
 * The world of the NVMe tier tests (test_tier.c, test_tier_integrity.c): one cache under test with
 * an NVMe tier, every row given to it, and a mirror cache without one; the helpers that drive both
 * and check what comes back.
 */
#ifndef KVT_TESTS_TIER_WORLD_H
#define KVT_TESTS_TIER_WORLD_H

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

void w_open(struct world *w, const char *name, kvt_config cfg, uint32_t n_files,
	    uint64_t file_bytes, uint32_t nseq, uint32_t cap, uint64_t seed, int mirror);

/* Bytes of one host-tier block (256 rows of K and V) of this world's head_dim. */
uint64_t w_block_bytes(const struct world *w);

void w_close(struct world *w);

struct kvt_layer *w_layer(const struct world *w, uint32_t s, uint32_t l);

/* Random K/V rows (never all zero: K ~ N(0.3, 1), V ~ N(-0.2, 1)) for tokens [at, at + n). */
void w_rows(struct world *w, uint32_t s, uint32_t l, uint32_t at, uint32_t n);

/* Prefill n tokens of world sequence s on layer l; the mirror gets the same. Returns the rc. */
int w_prefill(struct world *w, uint32_t s, uint32_t l, uint32_t n);

void w_prefill_ok(struct world *w, uint32_t s, uint32_t n);

/* One decode token for each of the ns world sequences in idx[] on every layer (one batch). */
void w_append_ok(struct world *w, uint32_t ns, const uint32_t *idx);

void w_append_all(struct world *w, uint32_t tokens);

/* kvt_select (p = 1: every position) then kvt_gather of (s, l) into gk/gv/pos; the rc of gather. */
int w_gather(struct world *w, uint32_t s, uint32_t l);

/* The gathered rows of (s, l) are every position, in order, byte for byte the rows given. */
void w_expect(struct world *w, uint32_t s, uint32_t l, int rc, const char *what);

void w_check(struct world *w, uint32_t s, uint32_t l, const char *what);

void w_check_all(struct world *w, const char *what);

/* The query of (s, l): the same every time, so that outputs can be compared across calls. */
void w_query(struct world *w, uint32_t s, uint32_t l);

/* kvt_attend of (s, l) into w->out; the rc. */
int w_attend(struct world *w, uint32_t s, uint32_t l);

/* Attention of (s, l) is bit for bit the mirror's (and ref's when given). */
void w_check_attend(struct world *w, uint32_t s, uint32_t l, const float *ref,
			   const char *what);

/* Full blocks per KV head of (s, l) whose tokens are all sinks or indexed: what spill moves. */
uint32_t w_full_blocks(const struct world *w, uint32_t s, uint32_t l);

/* Bytes kvt_seq_spill(s) must move now, by the test's count of what it spilled before. */
int64_t w_spill_due(const struct world *w, uint32_t s);

/* Bytes kvt_seq_restore(s) must move: every block the test spilled. */
int64_t w_restore_due(const struct world *w, uint32_t s);

/* Blocks of s on NVMe according to the cache's own table (NULL host pointer, loc.bytes set). */
uint32_t w_blocks_on_nvme(const struct world *w, uint32_t s);

/* kvt_seq_spill(s) moving exactly what is due, with the stats following. */
void w_spill_ok(struct world *w, uint32_t s, const char *what);

/* kvt_seq_restore(s) moving back everything, with the stats following. */
void w_restore_ok(struct world *w, uint32_t s, const char *what);

/* kvt_gather of (s, l) with the selection already made (no kvt_select first); the rc. */
int w_gather_again(struct world *w, uint32_t s, uint32_t l);

/* kvt_attend of every sequence in one batch on layer l, bit for bit the mirror's batch. */
void w_check_attend_batch(struct world *w, uint32_t l, const char *what);

#endif
