/* SPDX-License-Identifier: MIT */
/* What the fault tests of the NVMe tier share (tier_fault.h). */
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tier_fault.h"

rows_t g_k, g_v, g_k2, g_v2;
uint16_t g_gk[NKV * TOKENS * D], g_gv[NKV * TOKENS * D], g_q[NQ * D];
int32_t g_counts[NKV], g_pos[NKV * TOKENS];
void make_data(uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	for (int l = 0; l < LAYERS; l++) {
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.3, 1.0, g_k[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, -0.2, 1.0, g_v[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.1, 1.5, g_k2[l], NULL);
		t_fill(&r, KVT_DTYPE_F16, TOKENS * NKV * D, 0.2, 0.5, g_v2[l], NULL);
	}
	t_fill(&r, KVT_DTYPE_F16, NQ * D, 0, 1, g_q, NULL);
}


int prefill_layer(struct run *r, uint32_t seq, int l, rows_t *k, rows_t *v)
{
	int rc = kvt_prefill(r->c, seq, (uint32_t)l, NULL, (*k)[l], (*v)[l], FIRST, NULL);
	if (rc == 0)
		rc = kvt_prefill(r->c, seq, (uint32_t)l, NULL, (*k)[l] + FIRST * NKV * D,
				 (*v)[l] + FIRST * NKV * D, TOKENS - FIRST, NULL);
	return rc;
}

kvt_config run_config(struct run *r, const char *name, uint32_t qd, uint64_t host_bytes,
		      uint32_t policy)
{
	memset(r, 0, sizeof *r);
	snprintf(r->name, sizeof r->name, "%s", name);
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.p = 1.0f;
	cfg.nvme_queue_depth = qd;
	cfg.nvme_cache_bytes = (uint64_t)1 << 20;
	cfg.host_bytes = host_bytes;
	cfg.spill_policy = policy;
	tt_make_files(&r->f, 2, (uint64_t)4 << 20);
	cfg.n_nvme = 2;
	cfg.nvme_paths = r->f.ptrs;
	cfg.nvme_bytes = r->f.bytes;
	return cfg;
}

/* A fresh cache with one sequence of TOKENS tokens on every layer. */
void run_open_cfg(struct run *r, const char *name, uint32_t qd, uint64_t host_bytes,
		  uint32_t policy)
{
	const kvt_config cfg = run_config(r, name, qd, host_bytes, policy);
	int rc = kvt_cache_create(&cfg, &r->c);
	tt_unlink(&r->f);
	T_CHECK(rc == 0, "%s: kvt_cache_create got %d (%s: %s)", r->name, rc, kvt_strerror(rc),
		kvt_last_error(NULL));
	T_CHECK(kvt_seq_open(r->c, &r->seq) == 0, "%s: seq_open", r->name);
	r->sk = &g_k;
	r->sv = &g_v;
	for (int l = 0; l < LAYERS; l++) {
		rc = prefill_layer(r, r->seq, l, &g_k, &g_v);
		T_CHECK(rc == 0, "%s: prefill layer %d got %d (%s)", r->name, l, rc,
			kvt_last_error(r->c));
	}
}

void run_open(struct run *r, const char *name, uint32_t qd)
{
	run_open_cfg(r, name, qd, (uint64_t)64 << 20, KVT_SPILL_NONE);
}

/* Blocks of the sequence whose valid copy is on NVMe (the cache's table). */
uint32_t on_nvme(const struct run *r)
{
	uint32_t n = 0;
	for (int l = 0; l < LAYERS; l++) {
		const struct kvt_layer *L = &r->c->seqs[r->seq].layers[l];
		for (uint32_t h = 0; h < NKV; h++)
			for (uint32_t b = 0; b < L->n_blocks; b++) {
				size_t at = (size_t)h * L->blk_cap + b;
				if (L->blocks[at])
					continue;
				T_CHECK(L->spill && L->spill[at].loc.bytes,
					"%s: layer %d head %u block %u has neither a host block nor an "
					"NVMe location", r->name, l, h, b);
				n++;
			}
	}
	return n;
}

int do_select(struct run *r, int l)
{
	int rc = kvt_select(r->c, (uint32_t)l, 1, &r->seq, g_q, NULL);
	T_CHECK(rc == TOKENS, "%s: select layer %d got %d (%s), wanted %d", r->name, l, rc,
		rc < 0 ? kvt_last_error(r->c) : "tokens", TOKENS);
	return rc;
}

int do_gather(struct run *r, int l)
{
	memset(g_gk, 0xa5, sizeof g_gk);
	memset(g_gv, 0x5a, sizeof g_gv);
	return kvt_gather(r->c, (uint32_t)l, 1, &r->seq, TOKENS, g_counts, g_pos, g_gk, g_gv, NULL);
}

/* The gathered rows of layer l are every position, byte for byte the rows given. */
void expect_rows(struct run *r, int l, int rc, const char *what)
{
	T_CHECK(rc == TOKENS * NKV, "%s %s: gather layer %d got %d (%s), wanted %d", r->name, what, l,
		rc, rc < 0 ? kvt_last_error(r->c) : "tokens", TOKENS * NKV);
	for (uint32_t h = 0; h < NKV; h++) {
		T_CHECK(g_counts[h] == TOKENS, "%s %s layer %d head %u: count %d", r->name, what, l, h,
			g_counts[h]);
		for (uint32_t t = 0; t < TOKENS; t++) {
			const uint16_t *gk = g_gk + ((size_t)h * TOKENS + t) * D;
			const uint16_t *gv = g_gv + ((size_t)h * TOKENS + t) * D;
			const uint16_t *wk = (*r->sk)[l] + ((size_t)t * NKV + h) * D;
			const uint16_t *wv = (*r->sv)[l] + ((size_t)t * NKV + h) * D;
			if (g_pos[h * TOKENS + t] == (int32_t)t && memcmp(gk, wk, 2 * D) == 0 &&
			    memcmp(gv, wv, 2 * D) == 0)
				continue;
			T_CHECK(0, "%s %s layer %d head %u token %u: position %d, K[0] got 0x%04x V[0] "
				"0x%04x, wanted 0x%04x 0x%04x (garbage or unverified rows)", r->name, what,
				l, h, t, g_pos[h * TOKENS + t], gk[0], gv[0], wk[0], wv[0]);
		}
	}
}

void check_all_layers(struct run *r, const char *what)
{
	for (int l = 0; l < LAYERS; l++) {
		do_select(r, l);
		expect_rows(r, l, do_gather(r, l), what);
	}
}

const char *const kind_name[K_KINDS] = {"-EIO", "-EAGAIN", "-ECANCELED", "-ENOSPC", "short count",
				       "zero bytes"};
const int kind_rc[K_KINDS] = {-EIO, 0, -ECANCELED, -ENOSPC, 0, -EIO};

int hook(void *ctx, uint64_t nth, int res)
{
	struct hook_state *h = (struct hook_state *)ctx;
	if (nth != h->n || h->fired)
		return res;
	h->fired = 1;
	h->orig = res;
	if (res < 0)
		return res; /* a real error: leave it */
	switch (h->kind) {
	case K_EIO: return -EIO;
	case K_EAGAIN: return -EAGAIN;
	case K_ECANCELED: return -ECANCELED;
	case K_ENOSPC: return -ENOSPC;
	case K_SHORT: return res > 1 ? res / 2 : res;
	case K_ZERO: return 0;
	default: return res;
	}
}

void check_a_spilled_then_b(struct run *r, uint32_t b)
{
	check_all_layers(r, "A spilled by LRU (direct serving)");
	r->seq = b;
	r->sk = &g_k2;
	r->sv = &g_v2;
	check_all_layers(r, "B");
}
