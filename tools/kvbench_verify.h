/* SPDX-License-Identifier: MIT */
/*
 * The row verifier of kvbench --stress: every K/V row that kvt_gather returned is compared, bit for
 * bit, with the row the bench gave the library (regenerated or kept by the caller), and the first
 * mismatch is named: sequence, layer, KV head, position, K or V, element, and the tier the row was
 * read from. Uses only the public header, so a test can link it beside the internal library and
 * corrupt a host-tier row underneath it.
 */
#ifndef KVBENCH_VERIFY_H
#define KVBENCH_VERIFY_H

#include <stddef.h>
#include <stdint.h>

typedef struct kb_mismatch {
	uint32_t seq, layer, kv_head; /* seq: the caller's index of the sequence */
	int32_t pos;
	int part;                     /* 0 K, 1 V, -1 the position itself is out of range */
	uint32_t elem;
	uint16_t got, want;
	const char *tier;
} kb_mismatch;

/* The true K and V bits ([d] each) of token pos of (sequence s, layer, KV head kvh). */
typedef void (*kb_truth_fn)(void *ctx, uint32_t s, uint32_t layer, uint32_t kvh, uint32_t pos,
			    uint16_t *k, uint16_t *v);
/* Where that row lives now ("host", "nvme", ...), for the message. */
typedef const char *(*kb_tier_fn)(void *ctx, uint32_t s, uint32_t layer, uint32_t kvh,
				  uint32_t pos);

typedef struct kb_verifier {
	uint32_t kv_heads, d;
	kb_truth_fn truth;
	kb_tier_fn tier;
	void *ctx;
	uint16_t *scratch;            /* [2 d] */
} kb_verifier;

/*
 * Check what one kvt_gather returned for n sequences on `layer`:
 *   sidx [n] the caller's sequence indexes (given to truth and tier), len [n] their lengths
 *   counts [n, kv_heads], pos [n, kv_heads, max_tokens], k_out/v_out [n, kv_heads, max_tokens, d]
 * (host copies). Returns the rows verified, or -1 with *bad set to the first bad row.
 */
int64_t kb_verify_gather(const kb_verifier *v, uint32_t layer, uint32_t n, const uint32_t *sidx,
			 const uint32_t *len, uint32_t max_tokens, const int32_t *counts,
			 const int32_t *pos, const uint16_t *k_out, const uint16_t *v_out,
			 kb_mismatch *bad);

/* "sequence 3, layer 0, KV head 5, position 1234 (host): V[17] is 0x3c01, wanted 0x3c00". */
void kb_mismatch_text(const kb_mismatch *m, char *out, size_t n);

#endif /* KVBENCH_VERIFY_H */
