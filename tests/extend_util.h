/* SPDX-License-Identifier: MIT */
/*
 * The kvt_extend tests' shape, token streams and calls (extend_util.c), shared by test_extend.c
 * (exact attention, varlen batches, bad arguments, faults, NVMe) and test_extend_topp.c (Top-p
 * per query row). Sequence s of a cache (opened in order, so its id is s) takes its tokens from
 * stream s, token i at position i, on every layer.
 */
#ifndef KVT_TEST_EXTEND_UTIL_H
#define KVT_TEST_EXTEND_UTIL_H

#include "common.h"
#include "tier_util.h"

enum { L = 2, HQ = 4, HKV = 2, D = 64, NS = 4, MAXT = 1024, LAYER = 1 };
#define KROW (HKV * D)
#define QROW (HQ * D)

extern uint16_t g_q[NS][MAXT * QROW], g_k[NS][MAXT * KROW], g_v[NS][MAXT * KROW];
/* a batch's rows packed [total, heads, D] */
extern uint16_t g_bq[NS * MAXT * QROW], g_bk[NS * MAXT * KROW], g_bv[NS * MAXT * KROW];
extern uint32_t g_dtype;

void make_streams(uint32_t dtype, uint64_t seed);
kvt_config config(uint32_t dtype, uint32_t out_dtype, float p);
/* A cache with NS sequences open (ids 0 .. NS - 1). */
kvt_cache *make_cache(const kvt_config *cfg);
uint32_t len_of(kvt_cache *c, uint32_t s);
size_t out_bytes(const kvt_cache *c, uint32_t rows);
/* kvt_extend of entry i = sequence seqs[i], n[i] tokens of its stream from its length. */
int extend_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
		 void *out, uint32_t flags);
void extend_ok_flags(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
		     void *out, uint32_t flags);
void extend_ok(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, const uint32_t *n,
	       void *out);
/* The same chunk of sequence s through kvt_prefill. */
void prefill(kvt_cache *c, uint32_t s, uint32_t n);
/* One decode step of sequences seqs: the next token of each stream appended, then attended. */
void decode(kvt_cache *c, uint32_t n_seqs, const uint32_t *seqs, void *out);
/* Decode steps of all NS sequences on a and b: their outputs bit for bit equal. */
void same_decode(kvt_cache *a, kvt_cache *b, uint32_t steps, const char *what);
/* Layer LAYER of sequence s in a and b: lengths, index (entries, centroids, runs), rows equal. */
void same_layer(kvt_cache *a, kvt_cache *b, uint32_t s, const char *what);

#endif
