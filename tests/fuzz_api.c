/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target of the public API's call sequences on the CPU backend: the first bytes of the input
 * choose a small cache configuration (layers, heads, head_dim, dtypes, window, sinks, flush batch,
 * p, budgets, sequences, a host tier small enough to fill, correction_steps from the first byte's
 * high bits, keep_weight and keep_steps from the head_dim byte's, rescore_p from the p byte's,
 * allocation faults and an NVMe tier with or without KVT_SPILL_LRU from the host tier byte's, and
 * with that tier, for a quarter of the inputs, the CUDA backend's restore-first way with spilled
 * rows on the CPU's kernels from the dtype byte's), the
 * rest a sequence of at most 64 calls (open, close, prefill, append, attend, select
 * and gather, length, stats, layer stats, spill and restore, truncate, fork, read_rows and
 * write_rows with or without a kvt_rows_layout, extend with or without a kvt_io_layout, and the
 * _at forms of prefill, append, attend and select) with bounded sizes, sequence ids and layers
 * that may be wrong, and keys, values and queries that may be zero, large, or hold a NaN or an
 * infinity. Row layouts have slot mappings (identity, reversed, random, with -1, repeated, negative
 * and out-of-range slots) and strides (default, padded, below the minimum, past the address
 * range); io layouts have dense, fused-qkv-like and transposed (head-major) views, and wrong ones
 * (strides below the minimum, rows that overlap, extents past ptrdiff_t), sizes and flags.
 *
 * Properties: no crash and no access outside the caller's buffers (each an allocation of the exact
 * size the header gives for the strides used: the extent of a strided view, of the largest slot
 * of a mapping; layout structs allocated at the size they claim); every call returns success or a
 * code of the header's list, with a kvt_last_error text when it fails, and a kvt_last_error_entry
 * of -1 or an entry of its batch (for -ENOENT, one that is not open); a layout the header's rules
 * refuse is refused; every call counts one error in kvt_stats.errors when it fails and none when it
 * succeeds; a call that fails changes no sequence's length on any layer, nor the host and NVMe
 * tiers' use (unless it counted a spill: victims an undo could not read back; or, restoring
 * first, it kept the restores it made), and one that succeeds changes exactly the lengths it
 * should (prefill, append, extend and write_rows add their rows, truncate by n gives length - n
 * on every layer, a fork's child gets the parent's lengths and seqs_open grows by one);
 * read_rows returns to - from, a failed read writes nothing of k and v (but for an NVMe read's
 * failure, which may leave them partly written with the rows' bytes only), a read through a layout
 * writes the dense read's rows into the slots named and nothing else; rows written read back bit
 * for bit; an out view gets nothing outside its (token, head) rows, and nothing at all from a
 * failed call when it is not dense; a gather's counts fit max_tokens, sum to its return value,
 * and give ascending positions within the sequence; after every call the accounts agree with the
 * lengths (harness.h's t_accounts: kvt_get_capacity's open sequences and host and NVMe use, the
 * same as kvt_get_stats's, are what the open sequences' kvt_seq_bytes hold; each holds a block
 * per started block_tokens of each layer and KV head, in the host tier or on NVMe, within the
 * sizes kvt_footprint_of gives); after
 * kvt_cache_destroy no allocation and no descriptor is live. With faults on (a configuration
 * byte's bits), an op byte may make the next call's n-th allocation fail (n <= 32), or with an
 * NVMe tier the n-th I/O completion from then on (-EIO, n <= 16): each call must keep every
 * property above, whether it fails or not (with an NVMe tier any code of the header's list is
 * accepted).
 *

 * fuzz_api.c holds the configuration, the input bytes, the basic calls (open, close, prefill,
 * append, attend, select and gather, length, stats, spill and restore), the helpers the other
 * files share and the entry point; fuzz_api_lifecycle.c truncate, fork and the row transfer;
 * fuzz_api_io.c the io layouts, the _at forms and extend (fuzz_api.h declares what they share).
 *
 * Built with -DKVT_LIBFUZZER and -fsanitize=fuzzer it is a libFuzzer target; otherwise main()
 * (fuzz_replay.h) replays tests/fuzz_corpus/api/ under meson test.
 */

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "fuzz_api.h"
#include "host/alloc.h"
#include "host/nvme_store.h" /* kvt_nvme_available, kvt_nvme_set_cqe_hook */
#include "lib/constants.h"   /* KVT_MAX_KEEP_STEPS */
#include "lib/internal.h"    /* the cache's store, for the completion hook */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

uint8_t byte(struct in *in)
{
	return in->at < in->n ? in->p[in->at++] : 0;
}

/* The codes a call may return: without an NVMe tier the argument and capacity codes; with one,
 * any of the header's list (an I/O completion's own code is passed on). */
static int documented(const struct fz *z, int64_t rc)
{
	if (z->cfg.n_nvme)
		return strcmp(kvt_strerror((int)rc), "unknown error code") != 0;
	return rc == -EINVAL || rc == -ENOMEM || rc == -ENOSPC || rc == -EOPNOTSUPP ||
	       rc == -ENOENT || rc == -E2BIG;
}

/* Abort unless rc is success or a code of the header's list with a kvt_last_error text. */
static void check_rc(struct fz *z, const char *call, int64_t rc)
{
	if (rc >= 0)
		return;
	CHECK(documented(z, rc), "%s returned %lld (%s), not a code of the header's list", call,
	      (long long)rc, kvt_strerror((int)rc));
	const char *m = kvt_last_error(z->c);
	CHECK(m && m[0], "%s returned %lld without a kvt_last_error text", call, (long long)rc);
}

static kvt_stats stats_now(struct fz *z)
{
	kvt_stats st = {.size = sizeof st};
	CHECK(kvt_get_stats(z->c, &st) == 0, "kvt_get_stats failed: %s", kvt_last_error(z->c));
	return st;
}

/* The completion shim: the io_fail_at-th completion since it was armed fails with -EIO. */
static int io_fault(void *ctx, uint64_t nth, int res)
{
	struct fz *z = ctx;
	if (nth != z->io_fail_at || res < 0)
		return res;
	z->io_fired = true;
	return -EIO;
}

/* Arm the n-th NVMe completion from now to fail, in whichever later call makes it. */
static void arm_io_fault(struct fz *z, uint64_t n)
{
	z->io_fail_at = n;
	z->io_fired = false;
	kvt_nvme_set_cqe_hook(z->c->nvme, io_fault, z);
}

uint64_t call_begin(struct fz *z)
{
	z->before = stats_now(z);
	kvt_mem_fail_at(z->fail_at);
	return z->before.errors;
}

int64_t check_call(struct fz *z, const char *call, uint64_t errors0, int64_t rc)
{
	kvt_mem_fail_at(0);
	z->fail_at = 0;
	if (z->io_fired) {
		kvt_nvme_set_cqe_hook(z->c->nvme, NULL, NULL);
		z->io_fail_at = 0;
		z->io_fired = false;
	}
	check_rc(z, call, rc);
	/* the entry a failed call names is one of its batch's, or none (a runtime takes seqs[entry]
	 * out of the batch and calls again: kvtier.h) */
	const int entry = kvt_last_error_entry(z->c);
	const uint32_t batch_n = z->batch_n, *batch = z->batch;
	fz_batch(z, NULL, 0);
	CHECK(rc >= 0 || (entry >= -1 && entry < (int)batch_n), "%s failed (%lld, \"%s\") naming "
	      "entry %d of a batch of %u", call, (long long)rc, kvt_last_error(z->c), entry,
	      batch_n);
	const kvt_stats st = stats_now(z), *b = &z->before;
	const uint64_t counted = st.errors - errors0;
	CHECK(counted == (rc < 0), "%s returned %lld and counted %llu errors in kvt_stats.errors, "
	      "wanted %d (\"%s\")", call, (long long)rc, (unsigned long long)counted, rc < 0,
	      rc < 0 ? kvt_last_error(z->c) : "");
	/* a restore-first cache's failed kvt_extend or kvt_seq_read_rows keeps the restores it made
	 * (kvtier.h) */
	CHECK(rc >= 0 || st.spills != b->spills ||
		      (z->restore_first && st.restores != b->restores) ||
		      (st.host_bytes_used == b->host_bytes_used &&
		       st.nvme_bytes_used == b->nvme_bytes_used),
	      "%s failed (%lld, \"%s\") and moved rows: host tier %llu -> %llu bytes, NVMe tier "
	      "%llu -> %llu", call, (long long)rc, kvt_last_error(z->c),
	      (unsigned long long)b->host_bytes_used, (unsigned long long)st.host_bytes_used,
	      (unsigned long long)b->nvme_bytes_used, (unsigned long long)st.nvme_bytes_used);
	/* -ENOENT is "no such sequence": the entry it names is one (asked last: a failed length
	 * counts an error of its own) */
	CHECK(rc != -ENOENT || entry < 0 || !batch || length(z, batch[entry], 0) < 0,
	      "%s failed with -ENOENT naming entry %d, sequence %u, which is open", call, entry,
	      batch && entry >= 0 ? batch[entry] : 0);
	return rc;
}

/* Truncating conversions (any rounding will do for fuzz inputs). */
static uint16_t to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return (uint16_t)(u >> 16);
}

static uint16_t to_f16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint32_t sign = (u >> 16) & 0x8000u, e = (u >> 23) & 0xffu;
	if (e < 113) /* below fp16's normal range: zero */
		return (uint16_t)sign;
	if (e > 142) /* above it: the largest finite value */
		return (uint16_t)(sign | 0x7bffu);
	return (uint16_t)(sign | (e - 112) << 10 | (u >> 13 & 0x3ffu));
}

/* Elements of n values in the cache's dtype: normal-ish, large, zero, or with one NaN/infinity. */
void *values(struct fz *z, size_t n, uint8_t mode)
{
	uint16_t *b = malloc(n * 2);
	if (!b)
		abort();
	for (size_t i = 0; i < n; i++) {
		z->rng ^= z->rng << 13;
		z->rng ^= z->rng >> 7;
		z->rng ^= z->rng << 17;
		float f = (float)((int)(z->rng % 2001) - 1000) / 400.0f;
		if (mode % 4 == 1)
			f *= 4000.0f;
		else if (mode % 4 == 2)
			f = 0;
		b[i] = z->cfg.dtype == KVT_DTYPE_BF16 ? to_bf16(f) : to_f16(f);
	}
	if (mode % 4 == 3 && n)
		b[z->rng % n] = z->cfg.dtype == KVT_DTYPE_BF16 ? (mode & 4 ? 0x7fc0 : 0x7f80)
							       : (mode & 4 ? 0x7e00 : 0x7c00);
	return b;
}

uint32_t pick_seq(struct fz *z, struct in *in)
{
	uint8_t b = byte(in);
	return z->n_ids && b < 200 ? z->ids[b % z->n_ids] : b;
}

int64_t length(struct fz *z, uint32_t seq, uint32_t layer)
{
	return kvt_seq_length(z->c, seq, layer);
}

static void do_prefill(struct fz *z, struct in *in)
{
	uint32_t seq = pick_seq(z, in), layer = byte(in) % (z->cfg.n_layers + 1);
	uint32_t n = byte(in) % (MAXT + 1);
	/* with an NVMe tier, chunks up to 8 x MAXT tokens: only full indexed blocks (256 tokens)
	 * spill, so that spills, LRU victims and reads of spilled rows happen */
	if (z->cfg.n_nvme)
		n *= 8;
	uint8_t mode = byte(in), with_q = byte(in) & 1;
	size_t kvn = (size_t)(n ? n : 1) * z->cfg.n_kv_heads * z->cfg.head_dim;
	void *q = with_q ? values(z, (size_t)(n ? n : 1) * z->cfg.n_q_heads * z->cfg.head_dim, mode)
			 : NULL;
	void *k = values(z, kvn, mode), *v = values(z, kvn, 0);
	int64_t before = length(z, seq, layer);
	int rc = (int)FZ_CALL(z, "kvt_prefill", kvt_prefill(z->c, seq, layer, q, k, v, n, NULL));
	if (rc < 0)
		CHECK(length(z, seq, layer) == before, "a failed prefill (%d) changed the length of %u "
		      "on layer %u from %lld to %lld", rc, seq, layer, (long long)before,
		      (long long)length(z, seq, layer));
	free(q);
	free(k);
	free(v);
}

/* A batch of 1..4 sequence ids (duplicates and unknown ids possible). */
uint32_t batch(struct fz *z, struct in *in, uint32_t *seqs)
{
	uint32_t n = 1 + byte(in) % MAXS;
	for (uint32_t i = 0; i < n; i++)
		seqs[i] = pick_seq(z, in);
	return n;
}

static void do_append(struct fz *z, struct in *in)
{
	uint32_t seqs[MAXS], layer = byte(in) % (z->cfg.n_layers + 1), n = batch(z, in, seqs);
	uint8_t mode = byte(in);
	size_t kvn = (size_t)n * z->cfg.n_kv_heads * z->cfg.head_dim;
	void *k = values(z, kvn, mode), *v = values(z, kvn, 0);
	int64_t before[MAXS];
	for (uint32_t i = 0; i < n; i++)
		before[i] = length(z, seqs[i], layer);
	fz_batch(z, seqs, n);
	int rc = (int)FZ_CALL(z, "kvt_append", kvt_append(z->c, layer, n, seqs, k, v, NULL));
	for (uint32_t i = 0; rc < 0 && i < n; i++)
		CHECK(length(z, seqs[i], layer) == before[i], "a failed append (%d) changed the length "
		      "of %u on layer %u", rc, seqs[i], layer);
	free(k);
	free(v);
}

static void do_attend(struct fz *z, struct in *in, int split)
{
	uint32_t seqs[MAXS], layer = byte(in) % (z->cfg.n_layers + 1), n = batch(z, in, seqs);
	uint8_t mode = byte(in);
	void *q = values(z, (size_t)n * z->cfg.n_q_heads * z->cfg.head_dim, mode & 3 ? mode : 0);
	if (!split) {
		void *out = malloc((size_t)n * z->cfg.n_q_heads * z->cfg.head_dim * z->osz);
		fz_batch(z, seqs, n);
		(void)FZ_CALL(z, "kvt_attend", kvt_attend(z->c, layer, n, seqs, q, out, NULL));
		free(out);
		free(q);
		return;
	}
	fz_batch(z, seqs, n);
	int rc = (int)FZ_CALL(z, "kvt_select", kvt_select(z->c, layer, n, seqs, q, NULL));
	free(q);
	/* max_tokens: the selection's, or less (must be refused), or more */
	uint8_t how = byte(in);
	uint32_t mt = rc > 0 ? (uint32_t)rc : 1;
	if (how % 4 == 1 && mt > 1)
		mt -= 1 + how / 4 % (mt - 1);
	else if (how % 4 == 2)
		mt += how / 4;
	size_t pairs = (size_t)n * z->cfg.n_kv_heads, rows = pairs * mt * z->cfg.head_dim;
	int32_t *counts = malloc(pairs * sizeof *counts), *pos = NULL;
	void *k = NULL, *v = NULL;
	if (how & 64)
		pos = malloc(pairs * mt * sizeof *pos);
	if (how & 128) {
		k = malloc(rows * z->esz);
		v = malloc(rows * z->esz);
	}
	fz_batch(z, seqs, n);
	int g = (int)FZ_CALL(z, "kvt_gather",
			     kvt_gather(z->c, layer, n, seqs, mt, counts, pos, k, v, NULL));
	if (g >= 0) {
		int64_t sum = 0;
		for (size_t i = 0; i < pairs; i++) {
			CHECK(counts[i] >= 0 && (uint32_t)counts[i] <= mt, "gather count %d of pair "
			      "%zu, max_tokens %u", counts[i], i, mt);
			sum += counts[i];
			int64_t len = length(z, seqs[i / z->cfg.n_kv_heads], layer);
			for (int32_t t = 0; pos && t < counts[i]; t++) {
				int32_t p = pos[i * mt + (size_t)t];
				CHECK(p >= 0 && p < len && (t == 0 || p > pos[i * mt + (size_t)t - 1]),
				      "gather position %d (index %d of pair %zu), length %lld", p, t,
				      i, (long long)len);
			}
		}
		CHECK(sum == g, "gather returned %d, its counts sum to %lld", g, (long long)sum);
	}
	free(counts);
	free(pos);
	free(k);
	free(v);
}

static void do_stats(struct fz *z, struct in *in)
{
	uint8_t b = byte(in);
	if (b & 1) {
		kvt_layer_stats ls;
		memset(&ls, 0, sizeof ls);
		ls.size = sizeof ls;
		(void)FZ_CALL(z, "kvt_get_layer_stats",
			      kvt_get_layer_stats(z->c, (uint32_t)(b >> 1) % (z->cfg.n_layers + 1), &ls));
	} else {
		kvt_stats st;
		memset(&st, 0, sizeof st);
		st.size = sizeof st;
		(void)FZ_CALL(z, "kvt_get_stats", kvt_get_stats(z->c, &st));
	}
}

/* ---- the helpers the lifecycle, row transfer and io calls share ------------------------------ */

void snap(struct fz *z, struct snap *s)
{
	for (uint32_t i = 0; i < SNAP_IDS; i++)
		for (uint32_t l = 0; l < z->cfg.n_layers; l++)
			s->len[i][l] = length(z, i, l);
}

/* Every length as `want` says, or abort naming the call, its return and the first difference. */
void expect(struct fz *z, const struct snap *want, const char *call, int64_t rc)
{
	struct snap now;
	snap(z, &now);
	for (uint32_t i = 0; i < SNAP_IDS; i++)
		for (uint32_t l = 0; l < z->cfg.n_layers; l++)
			CHECK(now.len[i][l] == want->len[i][l], "after %s returned %lld, sequence %u "
			      "has length %lld on layer %u, expected %lld", call, (long long)rc, i,
			      (long long)now.len[i][l], l, (long long)want->len[i][l]);
}

/* Add delta to the length of seq on `layer` (all layers when layer is UINT32_MAX). */
void grow(struct fz *z, struct snap *s, uint32_t seq, uint32_t layer, int64_t delta)
{
	for (uint32_t l = 0; seq < SNAP_IDS && l < z->cfg.n_layers; l++)
		if (layer == UINT32_MAX || l == layer)
			s->len[seq][l] += delta;
}

void *patterned(size_t bytes)
{
	void *p = malloc(bytes);
	if (!p)
		abort();
	memset(p, PAT, bytes);
	return p;
}

/* A copy of a struct in an allocation of exactly the `size` it claims (at least its size field,
 * zeros past the struct), so that a read past what the size covers is seen. */
void *sized(const void *s, size_t have, uint32_t size)
{
	size_t bytes = size < sizeof(uint32_t) ? sizeof(uint32_t) : size;
	uint8_t *p = calloc(1, bytes);
	if (!p)
		abort();
	memcpy(p, s, have < bytes ? have : bytes);
	memcpy(p, &size, sizeof size);
	return p;
}

/* A struct size: its own mostly, else too small or larger (zeros past it). */
uint32_t pick_size(uint8_t b, uint32_t own)
{
	return b % 32 == 0 ? own - 1 : b % 32 == 1 ? 0 : b % 32 == 2 ? own + 8 : own;
}

/* After each step, the accounts agree with the lengths (harness.h's t_accounts). */
static void check_accounts(struct fz *z)
{
	char why[512];
	CHECK(t_accounts(z->c, z->forked, why, sizeof why) == 0, "%s", why);
}

static void step(struct fz *z, struct in *in)
{
	/* the op byte's quotient by 17, which picks no op: with faults on, 8..15 make the next
	 * checked call fail its n-th allocation, and with an NVMe tier 4..7 the n-th I/O completion
	 * from now fail, in whichever call makes it */
	static const uint8_t nth[8] = {1, 2, 3, 4, 6, 10, 16, 32};
	const uint8_t ob = byte(in), op = ob % 17, q = ob / 17;
	if (z->faults && q >= 8)
		z->fail_at = nth[q - 8];
	else if (z->faults && z->cfg.n_nvme && q >= 4)
		arm_io_fault(z, nth[(q - 4) * 2]);
	uint32_t s, layer;
	int rc;
	switch (op) {
	case 0:
		rc = (int)FZ_CALL(z, "kvt_seq_open", kvt_seq_open(z->c, &s));
		if (rc == 0 && z->n_ids < 8)
			z->ids[z->n_ids++] = s;
		break;
	case 1:
		s = pick_seq(z, in);
		(void)FZ_CALL(z, "kvt_seq_close", kvt_seq_close(z->c, s));
		break;
	case 2: case 3:
		do_prefill(z, in);
		break;
	case 4:
		do_append(z, in);
		break;
	case 5:
		do_attend(z, in, 0);
		break;
	case 6:
		do_attend(z, in, 1);
		break;
	case 7:
		s = pick_seq(z, in);
		layer = byte(in) % (z->cfg.n_layers + 1);
		(void)FZ_CALL(z, "kvt_seq_length", length(z, s, layer));
		break;
	case 8:
		do_stats(z, in);
		break;
	case 9:
		s = pick_seq(z, in);
		(void)FZ_CALL(z, "kvt_seq_spill", kvt_seq_spill(z->c, s));
		(void)FZ_CALL(z, "kvt_seq_restore", kvt_seq_restore(z->c, s));
		break;
	case 10:
		do_truncate(z, in);
		break;
	case 11:
		do_fork(z, in);
		break;
	case 12:
		do_read_rows(z, in);
		break;
	case 13:
		do_write_rows(z, in);
		break;
	case 14:
		do_extend(z, in);
		break;
	case 16:
		do_attend_graph(z, in);
		break;
	default:
		do_compute_at(z, in);
		break;
	}
}

/* The configuration the first 12 bytes ask for: always a valid one. */
static void configure(struct fz *z, struct in *in)
{
	static const uint32_t windows[] = {KVT_NONE, 4, 16, 64};
	static const uint32_t sinks[] = {KVT_NONE, 1, 4, 4};
	static const float ps[] = {0.5f, 0.9f, 1.0f, 0.99f};
	static const uint32_t bmin[] = {KVT_NONE, 2, 8, 64};
	kvt_config c = KVT_CONFIG_INIT;
	c.backend = KVT_BACKEND_CPU;
	/* few layers and mostly head_dim 64: each layer's seeded rotation costs O(head_dim^3) */
	uint8_t b0 = byte(in);
	c.n_layers = 1 + b0 % 2;
	/* correction_steps from the bits of the first byte that n_layers leaves: 0 for a quarter,
	 * mostly 1..8, sometimes up to 64 */
	uint32_t cs = b0 >> 1;
	c.correction_steps = cs < 32 ? 0 : cs < 112 ? 1 + (cs - 32) % 8 : 64 - (127 - cs) * 4;
	c.n_kv_heads = 1 + byte(in) % 2;
	c.n_q_heads = c.n_kv_heads * (1 + byte(in) % 2);
	/* the selection's hysteresis from the bits of the head_dim byte that head_dim leaves: off
	 * for half, else keep_weight 0.5, 2, 8 or 32 over keep_steps 0 (1), 1, 2 or the most */
	const uint8_t hb = byte(in);
	c.head_dim = hb % 8 == 7 ? 128 : 64;
	static const float kw[4] = {0.5f, 2.0f, 8.0f, 32.0f};
	static const uint32_t ks[4] = {0, 1, 2, KVT_MAX_KEEP_STEPS};
	c.keep_weight = hb >> 7 ? kw[(hb >> 3) & 3] : 0.0f;
	c.keep_steps = c.keep_weight != 0.0f ? ks[(hb >> 5) & 3] : 0;
	/* with an NVMe tier, the bits of the dtype byte that the dtype leaves ask for the
	 * restore-first way for a quarter of the inputs (none of the NVMe seeds before it had 0
	 * there) */
	const uint8_t db = byte(in);
	c.dtype = db & 1 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16;
	z->restore_first = ((db >> 1) & 3) == 0;
	uint8_t o = byte(in) % 3;
	c.out_dtype = o == 0 ? KVT_DTYPE_F32 : o == 1 ? KVT_DTYPE_F16 : KVT_DTYPE_BF16;
	c.window = windows[byte(in) % 4];
	c.n_sink = sinks[byte(in) % 4];
	c.flush_batch = 1 + byte(in) % 8;
	/* the second stage from the bits of the p byte that p leaves: off for three quarters, else
	 * rescore_p halfway between p and 1 (off at p = 1, where it has nothing to do) */
	const uint8_t pb = byte(in);
	c.p = ps[pb % 4];
	c.rescore_p = ((pb >> 2) & 3) != 0 || c.p >= 1.0f ? 0.0f : c.p + (1.0f - c.p) / 2;
	uint8_t b = byte(in);
	c.budget_min = bmin[b % 4];
	c.budget_max = b & 4 ? 96 : 0;
	c.max_seqs = 1 + (b >> 3) % MAXS;
	/* 256 KiB .. 4 MiB of host tier; the byte's high nibble turns on allocation (and I/O)
	 * faults and an NVMe tier of one 4 MiB file with or without KVT_SPILL_LRU (setup_nvme);
	 * none of the seeds before these existed had 5..9 or 12 there */
	enum { F = 1, N = 2, L = 4 };
	static const uint8_t mode[16] = {0, 0, 0, 0, 0, N, N | L, N | F, N | L | F, N | L | F,
					 0, 0, N | L, F, F, F};
	const uint8_t tb = byte(in);
	c.host_bytes = (uint64_t)(1 + tb % 16) << 18;
	z->faults = mode[tb >> 4] & F;
	z->nvme = mode[tb >> 4] & N;
	c.spill_policy = mode[tb >> 4] & L ? KVT_SPILL_LRU : KVT_SPILL_NONE;
	z->cfg = c;
	z->esz = 2;
	z->osz = c.out_dtype == KVT_DTYPE_F32 ? 4 : 2;
}

/* The NVMe tier the configuration asked for: one fresh 4 MiB file in $KVT_TEST_DIR, else $TMPDIR,
 * else /tmp (removed once the cache holds it), a 1 MiB block cache. Where io_uring is refused the
 * input runs without the tier. */
static void setup_nvme(struct fz *z, char *path, size_t n)
{
	struct kvt_err why;
	if (!z->nvme || !kvt_nvme_available(&why)) {
		z->cfg.spill_policy = KVT_SPILL_NONE;
		return;
	}
	const char *dir = getenv("KVT_TEST_DIR");
	if (!dir || !dir[0])
		dir = getenv("TMPDIR");
	snprintf(path, n, "%s/kvt-fuzz-api-XXXXXX", dir && dir[0] ? dir : "/tmp");
	const int fd = mkstemp(path);
	CHECK(fd >= 0, "mkstemp(%s): %s", path, strerror(errno));
	close(fd);
	z->nvme_path = path;
	z->nvme_bytes = (uint64_t)4 << 20;
	z->cfg.n_nvme = 1;
	z->cfg.nvme_paths = &z->nvme_path;
	z->cfg.nvme_bytes = &z->nvme_bytes;
	z->cfg.nvme_cache_bytes = (uint64_t)1 << 20;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = {data, size, 0};
	struct fz z;
	char path[4096];
	memset(&z, 0, sizeof z);
	configure(&z, &in);
	z.rng = 0x9e3779b97f4a7c15ull ^ size;
	static int warm; /* the CUDA runtime's descriptors, once open, stay open (harness.h) */
	if (!warm) {
		t_warm_runtime();
		warm = 1;
	}
	int64_t live = kvt_mem_live();
	const int fds = t_fd_count();
	setup_nvme(&z, path, sizeof path);
	int rc = kvt_cache_create(&z.cfg, &z.c);
	if (z.cfg.n_nvme)
		unlink(path);
	CHECK(rc == 0, "kvt_cache_create of a valid configuration: %d (%s)", rc,
	      kvt_last_error(NULL));
	z.restore_first = z.restore_first && z.cfg.n_nvme;
	if (z.restore_first)
		t_restore_first(z.c);
	/* a few ids that were never handed out */
	z.ids[z.n_ids++] = 7;
	for (int i = 0; i < 64 && in.at < in.n; i++) {
		step(&z, &in);
		check_accounts(&z);
	}
	kvt_cache_destroy(z.c);
	CHECK(kvt_mem_live() == live, "live allocations %lld after destroy, %lld before",
	      (long long)kvt_mem_live(), (long long)live);
	CHECK(t_fd_count() == fds, "%d descriptors open after destroy, %d before", t_fd_count(), fds);
	return 0;
}

#define FUZZ_NAME "fuzz_api"
#include "fuzz_replay.h"

