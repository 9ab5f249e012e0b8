/* SPDX-License-Identifier: MIT */
/* The row verifier of kvbench --stress (kvbench_verify.h). */
#include "kvbench_verify.h"

#include <stdio.h>

static int first_diff(const uint16_t *got, const uint16_t *want, uint32_t d)
{
	for (uint32_t i = 0; i < d; i++)
		if (got[i] != want[i])
			return (int)i;
	return -1;
}

int64_t kb_verify_gather(const kb_verifier *v, uint32_t layer, uint32_t n, const uint32_t *sidx,
			 const uint32_t *len, uint32_t max_tokens, const int32_t *counts,
			 const int32_t *pos, const uint16_t *k_out, const uint16_t *v_out,
			 kb_mismatch *bad)
{
	const uint32_t d = v->d;
	uint16_t *tk = v->scratch, *tv = v->scratch + d;
	int64_t rows = 0;
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t h = 0; h < v->kv_heads; h++) {
			size_t pair = (size_t)s * v->kv_heads + h;
			for (int32_t i = 0; i < counts[pair]; i++) {
				size_t at = pair * max_tokens + (size_t)i;
				int32_t p = pos[at];
				*bad = (kb_mismatch){.seq = sidx[s], .layer = layer, .kv_head = h,
						     .pos = p, .part = -1, .tier = "?"};
				if (p < 0 || (uint32_t)p >= len[s] || (uint32_t)i >= max_tokens)
					return -1;
				bad->tier = v->tier ? v->tier(v->ctx, sidx[s], layer, h, (uint32_t)p)
						    : "?";
				v->truth(v->ctx, sidx[s], layer, h, (uint32_t)p, tk, tv);
				const uint16_t *gk = k_out + at * d, *gv = v_out + at * d;
				int e = first_diff(gk, tk, d);
				bad->part = 0;
				if (e < 0) {
					e = first_diff(gv, tv, d);
					bad->part = 1;
					gk = gv;
					tk = tv;
				}
				if (e >= 0) {
					bad->elem = (uint32_t)e;
					bad->got = gk[e];
					bad->want = tk[e];
					return -1;
				}
				tk = v->scratch;
				tv = v->scratch + d;
				rows++;
			}
		}
	return rows;
}

void kb_mismatch_text(const kb_mismatch *m, char *out, size_t n)
{
	if (m->part < 0)
		snprintf(out, n, "sequence %u, layer %u, KV head %u: position %d out of range", m->seq,
			 m->layer, m->kv_head, m->pos);
	else
		snprintf(out, n, "sequence %u, layer %u, KV head %u, position %d (%s): %s[%u] is 0x%04x, "
			 "wanted 0x%04x", m->seq, m->layer, m->kv_head, m->pos, m->tier,
			 m->part ? "V" : "K", m->elem, m->got, m->want);
}
