/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target of the public API's call sequences on the CPU backend: the first bytes of the input
 * choose a small cache configuration (layers, heads, head_dim, dtypes, window, sinks, flush batch,
 * p, budgets, sequences, a host tier small enough to fill, correction_steps from the first byte's
 * high bits), the rest a sequence of at most 64 calls (open, close, prefill, append, attend, select
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
 * code of the header's list, with a kvt_last_error text when it fails; a layout the header's rules
 * refuse is refused; a call that fails changes no sequence's length on any layer, and one that
 * succeeds changes exactly the lengths it should (prefill, append, extend and write_rows add their
 * rows, truncate by n gives length - n on every layer, a fork's child gets the parent's lengths and
 * seqs_open grows by one); read_rows returns to - from, a failed read writes nothing of k and v,
 * a read through a layout writes the dense read's rows into the slots named and nothing else;
 * rows written read back bit for bit; an out view gets nothing outside its (token, head) rows,
 * and nothing at all from a failed call when it is not dense; a gather's counts fit max_tokens,
 * sum to its return value, and give ascending positions within the sequence; after
 * kvt_cache_destroy no allocation is live.
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

#include "host/alloc.h"
#include "kvtier.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "fuzz_api: %s: ", #cond);                                  \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, "\n");                                                     \
			abort();                                                                   \
		}                                                                                  \
	} while (0)

#define MAXS 4
#define MAXT 48

struct in {
	const uint8_t *p;
	size_t n, at;
};

static uint8_t byte(struct in *in)
{
	return in->at < in->n ? in->p[in->at++] : 0;
}

struct fz {
	kvt_cache *c;
	kvt_config cfg;
	uint32_t esz, osz; /* bytes per element of K/V/q and of the output */
	uint32_t ids[8];   /* ids handed out (open or closed) and a few never handed out */
	uint32_t n_ids;
	uint64_t rng;
};

static int documented(int64_t rc)
{
	return rc == -EINVAL || rc == -ENOMEM || rc == -ENOSPC || rc == -EOPNOTSUPP ||
	       rc == -ENOENT || rc == -E2BIG;
}

static void check_rc(struct fz *z, const char *call, int64_t rc)
{
	if (rc >= 0)
		return;
	CHECK(documented(rc), "%s returned %lld (%s), not a code of the header's list", call,
	      (long long)rc, kvt_strerror((int)rc));
	const char *m = kvt_last_error(z->c);
	CHECK(m && m[0], "%s returned %lld without a kvt_last_error text", call, (long long)rc);
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
static void *values(struct fz *z, size_t n, uint8_t mode)
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

static uint32_t pick_seq(struct fz *z, struct in *in)
{
	uint8_t b = byte(in);
	return z->n_ids && b < 200 ? z->ids[b % z->n_ids] : b;
}

static int64_t length(struct fz *z, uint32_t seq, uint32_t layer)
{
	return kvt_seq_length(z->c, seq, layer);
}

static void do_prefill(struct fz *z, struct in *in)
{
	uint32_t seq = pick_seq(z, in), layer = byte(in) % (z->cfg.n_layers + 1);
	uint32_t n = byte(in) % (MAXT + 1);
	uint8_t mode = byte(in), with_q = byte(in) & 1;
	size_t kvn = (size_t)(n ? n : 1) * z->cfg.n_kv_heads * z->cfg.head_dim;
	void *q = with_q ? values(z, (size_t)(n ? n : 1) * z->cfg.n_q_heads * z->cfg.head_dim, mode)
			 : NULL;
	void *k = values(z, kvn, mode), *v = values(z, kvn, 0);
	int64_t before = length(z, seq, layer);
	int rc = kvt_prefill(z->c, seq, layer, q, k, v, n, NULL);
	check_rc(z, "kvt_prefill", rc);
	if (rc < 0)
		CHECK(length(z, seq, layer) == before, "a failed prefill (%d) changed the length of %u "
		      "on layer %u from %lld to %lld", rc, seq, layer, (long long)before,
		      (long long)length(z, seq, layer));
	free(q);
	free(k);
	free(v);
}

/* A batch of 1..4 sequence ids (duplicates and unknown ids possible). */
static uint32_t batch(struct fz *z, struct in *in, uint32_t *seqs)
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
	int rc = kvt_append(z->c, layer, n, seqs, k, v, NULL);
	check_rc(z, "kvt_append", rc);
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
		check_rc(z, "kvt_attend", kvt_attend(z->c, layer, n, seqs, q, out, NULL));
		free(out);
		free(q);
		return;
	}
	int rc = kvt_select(z->c, layer, n, seqs, q, NULL);
	check_rc(z, "kvt_select", rc);
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
	int g = kvt_gather(z->c, layer, n, seqs, mt, counts, pos, k, v, NULL);
	check_rc(z, "kvt_gather", g);
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
		check_rc(z, "kvt_get_layer_stats",
			 kvt_get_layer_stats(z->c, (uint32_t)(b >> 1) % (z->cfg.n_layers + 1), &ls));
	} else {
		kvt_stats st;
		memset(&st, 0, sizeof st);
		st.size = sizeof st;
		check_rc(z, "kvt_get_stats", kvt_get_stats(z->c, &st));
	}
}

/* ---- the lifecycle calls, the row transfer and the _at forms --------------------------------- */

#define SNAP_IDS 16 /* ids 0..15: every id a cache of max_seqs <= 4 hands out, and a few others */

/* The length of every id on every layer (a negative code for an id not open). */
struct snap {
	int64_t len[SNAP_IDS][2];
};

static void snap(struct fz *z, struct snap *s)
{
	for (uint32_t i = 0; i < SNAP_IDS; i++)
		for (uint32_t l = 0; l < z->cfg.n_layers; l++)
			s->len[i][l] = length(z, i, l);
}

/* Every length as `want` says, or abort naming the call, its return and the first difference. */
static void expect(struct fz *z, const struct snap *want, const char *call, int64_t rc)
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
static void grow(struct fz *z, struct snap *s, uint32_t seq, uint32_t layer, int64_t delta)
{
	for (uint32_t l = 0; seq < SNAP_IDS && l < z->cfg.n_layers; l++)
		if (layer == UINT32_MAX || l == layer)
			s->len[seq][l] += delta;
}

static uint32_t rnd(struct fz *z)
{
	z->rng ^= z->rng << 13;
	z->rng ^= z->rng >> 7;
	z->rng ^= z->rng << 17;
	return (uint32_t)(z->rng >> 32);
}

/* Bytes set to a pattern, to see which the library wrote. */
#define PAT 0xa5

static void *patterned(size_t bytes)
{
	void *p = malloc(bytes);
	if (!p)
		abort();
	memset(p, PAT, bytes);
	return p;
}

/* A copy of a struct in an allocation of exactly the `size` it claims (at least its size field,
 * zeros past the struct), so that a read past what the size covers is seen. */
static void *sized(const void *s, size_t have, uint32_t size)
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
static uint32_t pick_size(uint8_t b, uint32_t own)
{
	return b % 32 == 0 ? own - 1 : b % 32 == 1 ? 0 : b % 32 == 2 ? own + 8 : own;
}

static void do_truncate(struct fz *z, struct in *in)
{
	uint32_t seq = pick_seq(z, in);
	uint8_t b = byte(in);
	int64_t lo = INT64_MAX, hi = 0;
	for (uint32_t l = 0; l < z->cfg.n_layers; l++) {
		int64_t n = length(z, seq, l);
		lo = n < lo ? n : lo;
		hi = n > hi ? n : hi;
	}
	lo = lo < 0 ? 0 : lo;
	uint32_t n = b % 4 == 0 ? b / 4 % 8 : b % 4 == 1 ? (uint32_t)lo : b % 4 == 2 ? (uint32_t)hi + b / 128
		   : b & 4 ? UINT32_MAX : (uint32_t)lo - b / 8 % 4;
	struct snap want;
	snap(z, &want);
	int rc = kvt_seq_truncate(z->c, seq, n, NULL);
	check_rc(z, "kvt_seq_truncate", rc);
	CHECK(rc <= 0, "kvt_seq_truncate returned %d", rc);
	if (rc == 0)
		grow(z, &want, seq, UINT32_MAX, -(int64_t)n);
	expect(z, &want, "kvt_seq_truncate", rc);
}

static void do_fork(struct fz *z, struct in *in)
{
	uint32_t parent = pick_seq(z, in), child = UINT32_MAX;
	uint8_t b = byte(in);
	struct snap want;
	snap(z, &want);
	kvt_stats st = {.size = sizeof st};
	CHECK(kvt_get_stats(z->c, &st) == 0, "kvt_get_stats failed");
	uint64_t open = st.seqs_open;
	int rc = kvt_seq_fork(z->c, parent, b % 32 == 0 ? NULL : &child, NULL);
	check_rc(z, "kvt_seq_fork", rc);
	CHECK(rc <= 0, "kvt_seq_fork returned %d", rc);
	if (b % 32 == 0)
		CHECK(rc < 0, "kvt_seq_fork with a NULL child returned %d", rc);
	if (rc == 0) {
		CHECK(child < SNAP_IDS && child != parent && want.len[child][0] < 0,
		      "kvt_seq_fork of %u gave child %u (length %lld on layer 0 before)", parent,
		      child, child < SNAP_IDS ? (long long)want.len[child][0] : 0ll);
		for (uint32_t l = 0; l < z->cfg.n_layers; l++)
			want.len[child][l] = want.len[parent][l];
		int seen = 0;
		for (uint32_t i = 0; i < z->n_ids; i++)
			seen |= z->ids[i] == child;
		if (!seen && z->n_ids < 8)
			z->ids[z->n_ids++] = child;
	}
	expect(z, &want, "kvt_seq_fork", rc);
	CHECK(kvt_get_stats(z->c, &st) == 0, "kvt_get_stats failed");
	CHECK(st.seqs_open == open + (rc == 0), "kvt_seq_fork returned %d, seqs_open %llu -> %llu",
	      rc, (unsigned long long)open, (unsigned long long)st.seqs_open);
}

/* from and to around the sequence's length on the layer: mostly a range it holds (or, to write,
 * the one after it), sometimes empty, reversed, or past the end. */
static void pick_range(struct fz *z, struct in *in, uint32_t seq, uint32_t layer, int write,
		       uint32_t *from, uint32_t *to)
{
	int64_t len = length(z, seq, layer);
	uint32_t L = len > 0 ? (uint32_t)len : 0;
	uint8_t a = byte(in), b = byte(in);
	if (write) {
		*from = a % 8 == 0 ? L + 1 : a % 8 == 1 && L ? L - 1 : a % 8 == 2 ? 0 : L;
		*to = b % 16 == 0 ? *from : b % 16 == 1 ? *from - 1 : *from + 1 + b % (MAXT / 2);
	} else {
		*from = L ? a % (L + 1) : a % 2;
		*to = b % 16 == 0 ? *from : b % 16 == 1 ? *from - 1 : b % 16 == 2 ? L + 1 + b / 64
		      : b % 16 < 8 ? L : *from + 1 + b % (L > *from ? L - *from : 1);
	}
}

/* A kvt_rows_layout for n tokens (NULL: the dense call), and whether the header's rules accept it:
 * then *ext receives the elements of k (and of v) it reaches. */
struct rows {
	kvt_rows_layout lo;
	int64_t *map;
	int null, ok;
	uint64_t ext;
};

static void gen_rows(struct fz *z, struct in *in, uint32_t n, int write, struct rows *r)
{
	const uint64_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads, lim = (uint64_t)PTRDIFF_MAX / z->esz;
	uint8_t kind = byte(in), bh = byte(in), bs = byte(in), bm = byte(in);
	memset(r, 0, sizeof *r);
	r->lo.size = sizeof r->lo;
	r->null = kind % 8 == 0;
	if (kind % 8 >= 2) {
		r->lo.size = pick_size(kind / 8, sizeof r->lo);
		r->lo.flags = kind / 8 % 32 == 3 ? 1u << (bh % 32) : 0;
		static const uint64_t hs_add[] = {0, 0, 8, 1, 64};
		r->lo.head_stride = bh % 16 < 5 ? (bh % 16 ? d + hs_add[bh % 16] : 0)
				    : bh % 16 < 13 ? d : bh % 16 == 13 ? d - 1
				    : bh % 16 == 14 ? lim / H + 1 : UINT64_MAX;
		uint64_t hs = r->lo.head_stride ? r->lo.head_stride : d;
		uint64_t span = hs <= lim / H ? (H - 1) * hs + d : 0;
		r->lo.slot_stride = bs % 16 < 4 ? 0 : bs % 16 < 7 ? span + (bs % 16 - 4) * 8
				    : bs % 16 < 12 ? span * (1 + bs % 16 - 7)
				    : bs % 16 == 12 && span ? span - 1 : bs % 16 == 13 ? lim + 1
				    : bs % 16 == 14 ? lim : UINT64_MAX;
		if (bm % 8 >= 3 && n) {
			r->map = malloc(n * sizeof *r->map);
			if (!r->map)
				abort();
			uint64_t ss = r->lo.slot_stride ? r->lo.slot_stride : H * hs;
			int64_t max_slot = span && ss >= span && ss <= lim ? (int64_t)((lim - span) / ss)
									   : INT64_MAX - 1;
			for (uint32_t i = 0; i < n; i++) {
				uint32_t t = rnd(z);
				int64_t s = bm % 8 == 3 ? i : bm % 8 == 4 ? n - 1 - i
					    : bm % 8 == 5 ? (int64_t)(t % (n + 4))
					    : bm % 8 == 6 ? i + bm / 8 : (int64_t)i;
				if (bm % 8 == 7) /* identity with a few odd slots */
					switch (t % 24) {
					case 0: s = -1; break;
					case 1: s = i ? r->map[i - 1] : 0; break;
					case 2: s = -2; break;
					case 3: s = max_slot + 1; break;
					case 4: s = INT64_MAX; break;
					case 5: s = INT64_MIN; break;
					case 6: s = n + t % 8; break;
					}
				r->map[i] = s;
			}
			r->lo.slot_mapping = r->map;
		}
	}
	if (r->null) {
		r->ok = 1;
		r->ext = (uint64_t)n * H * d;
		return;
	}
	/* the rules of kvt_rows_layout */
	uint64_t hs = r->lo.head_stride ? r->lo.head_stride : d;
	r->ok = (r->lo.size >= sizeof r->lo && !r->lo.flags && hs >= d && hs <= lim / H);
	if (!r->ok)
		return;
	uint64_t span = (H - 1) * hs + d, ss = r->lo.slot_stride ? r->lo.slot_stride : H * hs;
	r->ok = (ss >= span && ss <= lim);
	if (!r->ok)
		return;
	int64_t max_slot = (int64_t)((lim - span) / ss), top = -1;
	for (uint32_t i = 0; i < n; i++) {
		int64_t s = r->map ? r->map[i] : (int64_t)i;
		if (s < (write ? 0 : -1) || s > max_slot)
			r->ok = 0;
		for (uint32_t j = 0; r->map && !write && s >= 0 && j < i; j++)
			if (r->map[j] == s)
				r->ok = 0;
		top = s > top ? s : top;
	}
	if (r->ok && top >= 0)
		r->ext = (uint64_t)top * ss + span;
}

/* The plain call (how & 1 clear) takes no layout: the one generated is dropped. */
static void plain_rows(struct fz *z, uint8_t how, uint32_t n, struct rows *r)
{
	if (how & 1)
		return;
	free(r->map);
	r->map = NULL;
	r->null = r->ok = 1;
	r->ext = (uint64_t)n * z->cfg.n_kv_heads * z->cfg.head_dim;
}

/* Element offset of token i, head h under layout r (which is valid). */
static uint64_t rows_at(struct fz *z, const struct rows *r, uint32_t i, uint32_t h)
{
	const uint64_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads;
	uint64_t hs = r->null || !r->lo.head_stride ? d : r->lo.head_stride;
	uint64_t ss = r->null || !r->lo.slot_stride ? H * hs : r->lo.slot_stride;
	int64_t s = r->map ? r->map[i] : (int64_t)i;
	return (uint64_t)s * ss + h * hs;
}

#define EXT_CAP ((uint64_t)1 << 22) /* elements: larger valid views are not tried */

static void do_read_rows(struct fz *z, struct in *in)
{
	uint32_t seq = pick_seq(z, in), layer = byte(in) % (z->cfg.n_layers + 1), from, to;
	pick_range(z, in, seq, layer, 0, &from, &to);
	uint8_t how = byte(in);
	uint32_t n = to > from && to - from <= 4096 ? to - from : 0;
	struct rows r;
	gen_rows(z, in, n, 0, &r);
	plain_rows(z, how, n, &r);
	const size_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads, row = d * z->esz;
	if (r.ok && r.ext > EXT_CAP) {
		free(r.map);
		return;
	}
	size_t bytes = r.ok ? (size_t)r.ext * z->esz : 2;
	uint8_t *k = patterned(bytes), *v = patterned(bytes);
	void *lo = how & 1 && !r.null ? sized(&r.lo, sizeof r.lo, r.lo.size) : NULL;
	struct snap want;
	snap(z, &want);
	int rc = how & 1 ? kvt_seq_read_rows_at(z->c, seq, layer, from, to, k, v, lo, NULL)
			 : kvt_seq_read_rows(z->c, seq, layer, from, to, k, v, NULL);
	const char *call = how & 1 ? "kvt_seq_read_rows_at" : "kvt_seq_read_rows";
	check_rc(z, call, rc);
	expect(z, &want, call, rc);
	if (how & 1 && !r.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", call, rc);
	if (rc >= 0)
		CHECK(rc == (int)(to - from) && to > from, "%s [%u, %u) returned %d", call, from,
		      to, rc);
	if (rc < 0) {
		for (size_t i = 0; i < bytes; i++)
			CHECK(k[i] == PAT && v[i] == PAT, "failed %s (%d) wrote byte %zu", call, rc, i);
	} else if (how & 1 && !r.null) {
		/* the slots named hold the dense call's rows, every other byte is as it was */
		uint8_t *dk = malloc((size_t)n * H * row), *dv = malloc((size_t)n * H * row);
		uint8_t *mask = calloc(1, bytes ? bytes : 1);
		if (!dk || !dv || !mask)
			abort();
		int rc2 = kvt_seq_read_rows(z->c, seq, layer, from, to, dk, dv, NULL);
		CHECK(rc2 == rc, "kvt_seq_read_rows after %s: %d, %d", call, rc2, rc);
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t h = 0; r.map && r.map[i] < 0 ? 0 : h < H; h++) {
				size_t at = (size_t)rows_at(z, &r, i, h) * z->esz;
				size_t src = ((size_t)i * H + h) * row;
				CHECK(!memcmp(k + at, dk + src, row) && !memcmp(v + at, dv + src, row),
				      "%s: token %u head %u differs from kvt_seq_read_rows's", call,
				      i, h);
				memset(mask + at, 1, row);
			}
		for (size_t i = 0; i < bytes; i++)
			CHECK(mask[i] || (k[i] == PAT && v[i] == PAT), "%s wrote byte %zu outside "
			      "the slots and heads named", call, i);
		free(dk);
		free(dv);
		free(mask);
	}
	free(lo);
	free(k);
	free(v);
	free(r.map);
}

static void do_write_rows(struct fz *z, struct in *in)
{
	uint32_t seq = pick_seq(z, in), layer = byte(in) % (z->cfg.n_layers + 1), from, to;
	pick_range(z, in, seq, layer, 1, &from, &to);
	uint8_t how = byte(in), mode = byte(in);
	uint32_t n = to > from && to - from <= 4096 ? to - from : 0;
	struct rows r;
	gen_rows(z, in, n, 1, &r);
	plain_rows(z, how, n, &r);
	const size_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads, row = d * z->esz;
	if (r.ok && r.ext > EXT_CAP) {
		free(r.map);
		return;
	}
	size_t elems = r.ok ? (size_t)r.ext : 1;
	uint8_t *k = values(z, elems, mode), *v = values(z, elems, 0);
	void *lo = how & 1 && !r.null ? sized(&r.lo, sizeof r.lo, r.lo.size) : NULL;
	struct snap want;
	snap(z, &want);
	int rc = how & 1 ? kvt_seq_write_rows_at(z->c, seq, layer, from, to, k, v, lo, NULL)
			 : kvt_seq_write_rows(z->c, seq, layer, from, to, k, v, NULL);
	const char *call = how & 1 ? "kvt_seq_write_rows_at" : "kvt_seq_write_rows";
	check_rc(z, call, rc);
	if (how & 1 && !r.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", call, rc);
	if (rc >= 0) {
		CHECK(rc == (int)(to - from) && to > from, "%s [%u, %u) returned %d", call, from,
		      to, rc);
		grow(z, &want, seq, layer, n);
	}
	expect(z, &want, call, rc);
	if (rc > 0) {
		/* the rows read back are the rows written */
		uint8_t *dk = malloc((size_t)n * H * row), *dv = malloc((size_t)n * H * row);
		if (!dk || !dv)
			abort();
		int rc2 = kvt_seq_read_rows(z->c, seq, layer, from, to, dk, dv, NULL);
		CHECK(rc2 == rc, "kvt_seq_read_rows after %s: %d, %d", call, rc2, rc);
		struct rows dense = {.null = 1};
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t h = 0; h < H; h++) {
				size_t at = (size_t)rows_at(z, how & 1 && !r.null ? &r : &dense, i, h) *
					    z->esz, dst = ((size_t)i * H + h) * row;
				CHECK(!memcmp(k + at, dk + dst, row) && !memcmp(v + at, dv + dst, row),
				      "%s: token %u head %u reads back different", call, i, h);
			}
		free(dk);
		free(dv);
	}
	free(lo);
	free(k);
	free(v);
	free(r.map);
}

/* One view of a kvt_io_layout for n rows of `heads` heads: dense, fused-qkv-like, transposed, or
 * wrong (strides below the minimum, rows that overlap, past the address range). */
static void gen_view(struct fz *z, uint8_t b, uint32_t n, uint32_t heads, size_t elem,
		     kvt_io_view *v)
{
	const uint64_t d = z->cfg.head_dim, lim = (uint64_t)PTRDIFF_MAX / elem;
	const uint64_t fused = (uint64_t)(z->cfg.n_q_heads + 2 * z->cfg.n_kv_heads) * d;
	const uint64_t pad = b / 16 % 4 * 8;
	memset(v, 0, sizeof *v);
	switch (b % 16) {
	case 0: case 1: case 2: break; /* dense by default */
	case 3: v->token_stride = heads * d; v->head_stride = d; break;
	case 4: case 5: v->token_stride = fused + pad; break;
	case 6: v->token_stride = fused; v->head_stride = d + pad; break;
	case 7: case 8: /* [heads, n, d], head-major */
		v->token_stride = d + pad;
		v->head_stride = (uint64_t)(n ? n - 1 : 0) * v->token_stride + d + b / 64 * 8;
		break;
	case 9: v->head_stride = d + pad + 8; break; /* token-major, gaps between heads */
	case 10: v->head_stride = d - 1; break;
	case 11: v->token_stride = (heads - 1) * d + d - 1; break; /* overlapping rows (or d - 1) */
	case 12: v->token_stride = d; v->head_stride = (uint64_t)(n ? n - 1 : 0) * d + d - 1; break;
	case 13: v->token_stride = b & 16 ? lim : UINT64_MAX; break;
	case 14: v->head_stride = b & 16 ? lim / heads + 1 : lim / heads; break;
	default: v->token_stride = b & 16 ? lim / 2 : (lim - d) / (n > 1 ? n - 1 : 1) + 1; break;
	}
}

/* Whether the header accepts view v for n rows; *ext receives its extent in elements, *dense
 * whether every row lies where the dense tensor has it. */
static int view_ok(struct fz *z, const kvt_io_view *v, uint32_t n, uint32_t heads, size_t elem,
		   uint64_t *ext, int *dense)
{
	const uint64_t d = z->cfg.head_dim, H = heads, lim = (uint64_t)PTRDIFF_MAX / elem;
	uint64_t hs = v->head_stride ? v->head_stride : d;
	if (hs < d || hs > lim / H)
		return 0;
	uint64_t span = (H - 1) * hs + d, ts = v->token_stride ? v->token_stride : H * hs;
	/* head-major: (n - 1) token_stride + head_dim <= head_stride */
	int head_major = ts >= d && (n <= 1 || ts <= (hs - d) / (n - 1));
	if (ts < span && !head_major)
		return 0;
	if (n > 1 && ts > (lim - span) / (n - 1)) /* the extent past ptrdiff_t */
		return 0;
	*ext = (uint64_t)(n ? n - 1 : 0) * ts + span;
	*dense = (n <= 1 || ts == H * d) && (H == 1 || hs == d);
	return 1;
}

/* Which tensors a call takes. */
enum { T_Q = 1, T_K = 2, T_V = 4, T_OUT = 8 };

struct io {
	kvt_io_layout lo;
	void *plo;         /* what the call gets: NULL, or a copy of lo of its claimed size */
	int ok;            /* the header accepts the layout for the tensors the call takes */
	uint64_t ext[4];   /* elements of each tensor's allocation */
	int dense_out;
	void *t[4];        /* q, k, v, out */
};

static void gen_io(struct fz *z, struct in *in, uint32_t n, unsigned takes, uint8_t mode,
		   struct io *io)
{
	const uint32_t hq = z->cfg.n_q_heads, hk = z->cfg.n_kv_heads, d = z->cfg.head_dim;
	uint8_t kind = byte(in);
	memset(io, 0, sizeof *io);
	io->lo.size = sizeof io->lo;
	int null = kind % 4 == 0;
	if (kind % 4 >= 2) {
		io->lo.size = pick_size(kind / 4, sizeof io->lo);
		io->lo.flags = kind / 4 % 32 == 3 ? 1u << (kind % 32) : 0;
		kvt_io_view *v[4] = {&io->lo.q, &io->lo.k, &io->lo.v, &io->lo.out};
		for (int i = 0; i < 4; i++)
			gen_view(z, byte(in), n, i == 1 || i == 2 ? hk : hq, i == 3 ? z->osz : z->esz,
				 v[i]);
	}
	io->plo = null ? NULL : sized(&io->lo, sizeof io->lo, io->lo.size);
	io->ok = null || (io->lo.size >= sizeof io->lo && !io->lo.flags);
	io->dense_out = 1;
	const kvt_io_view *v[4] = {&io->lo.q, &io->lo.k, &io->lo.v, &io->lo.out};
	for (int i = 0; i < 4; i++) {
		uint32_t heads = i == 1 || i == 2 ? hk : hq;
		size_t elem = i == 3 ? z->osz : z->esz;
		int dense = 1;
		io->ext[i] = (uint64_t)n * heads * d;
		if (!null && io->ok && (takes >> i & 1) &&
		    !view_ok(z, v[i], n, heads, elem, &io->ext[i], &dense))
			io->ok = 0;
		if (i == 3)
			io->dense_out = dense;
	}
	for (int i = 0; i < 4; i++) {
		uint64_t e = io->ok && io->ext[i] <= EXT_CAP ? io->ext[i] : 1;
		if (!(takes >> i & 1))
			io->t[i] = NULL;
		else if (i == 3)
			io->t[i] = patterned(e * z->osz);
		else
			io->t[i] = values(z, e, i == 2 ? 0 : mode);
	}
}

static void free_io(struct io *io)
{
	for (int i = 0; i < 4; i++)
		free(io->t[i]);
	free(io->plo);
}

/* out after the call: nothing written outside its (token, head) rows, and nothing at all by a
 * failed call whose out view is not dense. */
static void check_out(struct fz *z, const struct io *io, uint32_t n, const char *call, int rc)
{
	if (!io->t[3] || !io->ok || io->ext[3] > EXT_CAP)
		return;
	const uint64_t d = z->cfg.head_dim, H = z->cfg.n_q_heads;
	const kvt_io_view *v = &io->lo.out;
	int lay = io->plo != NULL;
	uint64_t hs = lay && v->head_stride ? v->head_stride : d;
	uint64_t ts = lay && v->token_stride ? v->token_stride : H * hs;
	size_t bytes = (size_t)io->ext[3] * z->osz;
	uint8_t *mask = calloc(1, bytes ? bytes : 1), *o = io->t[3];
	if (!mask)
		abort();
	if (rc >= 0 || io->dense_out)
		for (uint64_t t = 0; t < n; t++)
			for (uint64_t h = 0; h < H; h++)
				memset(mask + (t * ts + h * hs) * z->osz, 1, d * z->osz);
	for (size_t i = 0; i < bytes; i++)
		CHECK(mask[i] || o[i] == PAT, "%s (returned %d) wrote byte %zu of out outside the "
		      "rows it may write", call, rc, i);
	free(mask);
}

static int skip_io(struct io *io)
{
	for (int i = 0; io->ok && i < 4; i++)
		if (io->ext[i] > EXT_CAP)
			return 1;
	return 0;
}

static void do_compute_at(struct fz *z, struct in *in)
{
	uint8_t which = byte(in) % 4, mode = byte(in);
	uint32_t layer = byte(in) % (z->cfg.n_layers + 1), seqs[MAXS], n, seq = 0;
	static const unsigned takes[4] = {T_K | T_V, T_K | T_V, T_Q | T_OUT, T_Q};
	static const char *const name[4] = {"kvt_prefill_at", "kvt_append_at", "kvt_attend_at",
					    "kvt_select_at"};
	if (which == 0) {
		seq = pick_seq(z, in);
		n = byte(in) % (MAXT + 1);
	} else {
		n = batch(z, in, seqs);
	}
	unsigned t = takes[which] | (which == 0 && mode & 8 ? T_Q : 0);
	struct io io;
	gen_io(z, in, n, t, mode, &io);
	if (skip_io(&io)) {
		free_io(&io);
		return;
	}
	struct snap want;
	snap(z, &want);
	int rc = which == 0 ? kvt_prefill_at(z->c, seq, layer, io.t[0], io.t[1], io.t[2], n, io.plo,
					     NULL)
		 : which == 1 ? kvt_append_at(z->c, layer, n, seqs, io.t[1], io.t[2], io.plo, NULL)
		 : which == 2 ? kvt_attend_at(z->c, layer, n, seqs, io.t[0], io.t[3], io.plo, NULL)
			      : kvt_select_at(z->c, layer, n, seqs, io.t[0], io.plo, NULL);
	check_rc(z, name[which], rc);
	if (!io.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", name[which],
		      rc);
	if (rc >= 0 && which == 0)
		grow(z, &want, seq, layer, n);
	for (uint32_t i = 0; rc >= 0 && which == 1 && i < n; i++)
		grow(z, &want, seqs[i], layer, 1);
	expect(z, &want, name[which], rc);
	check_out(z, &io, n, name[which], rc);
	free_io(&io);
}

static void do_extend(struct fz *z, struct in *in)
{
	uint32_t seqs[MAXS], layer = byte(in) % (z->cfg.n_layers + 1), n = batch(z, in, seqs);
	uint8_t mode = byte(in), fb = byte(in), at = byte(in);
	uint32_t cu[MAXS + 1] = {0};
	for (uint32_t i = 0; i < n; i++) {
		uint8_t b = byte(in);
		cu[i + 1] = cu[i] + (b % 4 == 0 ? 0 : b % 9);
	}
	if (at % 32 == 1)
		cu[0] = 1;
	else if (at % 32 == 2 && n > 1 && cu[1])
		cu[1] = cu[2] + 1; /* decreasing */
	uint32_t flags = fb % 16 == 0 ? 1u << (1 + fb / 16 % 31) : fb & 1 ? KVT_EXTEND_TOPP : 0;
	uint32_t total = cu[n] < 4096 ? cu[n] : 0;
	struct io io;
	if (at & 1) {
		gen_io(z, in, total, T_Q | T_K | T_V | T_OUT, mode, &io);
	} else { /* the plain call: dense tensors */
		memset(&io, 0, sizeof io);
		io.ok = io.dense_out = 1;
		for (int i = 0; i < 4; i++)
			io.ext[i] = (uint64_t)total * (i == 1 || i == 2 ? z->cfg.n_kv_heads
								 : z->cfg.n_q_heads) * z->cfg.head_dim;
		io.t[0] = values(z, io.ext[0], mode & 3 ? mode : 0);
		io.t[1] = values(z, io.ext[1], mode / 4);
		io.t[2] = values(z, io.ext[2], 0);
		io.t[3] = patterned(io.ext[3] * z->osz);
	}
	if (skip_io(&io)) {
		free_io(&io);
		return;
	}
	struct snap want;
	snap(z, &want);
	const char *call = at & 1 ? "kvt_extend_at" : "kvt_extend";
	int rc = at & 1 ? kvt_extend_at(z->c, layer, n, seqs, cu, io.t[0], io.t[1], io.t[2], io.t[3],
					flags, io.plo, NULL)
			: kvt_extend(z->c, layer, n, seqs, cu, io.t[0], io.t[1], io.t[2], io.t[3],
				     flags, NULL);
	check_rc(z, call, rc);
	CHECK(rc <= 0, "%s returned %d", call, rc);
	if (!io.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", call, rc);
	for (uint32_t i = 0; rc == 0 && i < n; i++)
		grow(z, &want, seqs[i], layer, cu[i + 1] - cu[i]);
	expect(z, &want, call, rc);
	check_out(z, &io, total, call, rc);
	free_io(&io);
}

static void step(struct fz *z, struct in *in)
{
	uint8_t op = byte(in) % 16;
	uint32_t s;
	int rc;
	switch (op) {
	case 0:
		rc = kvt_seq_open(z->c, &s);
		check_rc(z, "kvt_seq_open", rc);
		if (rc == 0 && z->n_ids < 8)
			z->ids[z->n_ids++] = s;
		break;
	case 1:
		check_rc(z, "kvt_seq_close", kvt_seq_close(z->c, pick_seq(z, in)));
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
		check_rc(z, "kvt_seq_length", length(z, s, byte(in) % (z->cfg.n_layers + 1)));
		break;
	case 8:
		do_stats(z, in);
		break;
	case 9:
		s = pick_seq(z, in);
		check_rc(z, "kvt_seq_spill", kvt_seq_spill(z->c, s));
		check_rc(z, "kvt_seq_restore", kvt_seq_restore(z->c, s));
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
	c.head_dim = byte(in) % 8 == 7 ? 128 : 64;
	c.dtype = byte(in) & 1 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16;
	uint8_t o = byte(in) % 3;
	c.out_dtype = o == 0 ? KVT_DTYPE_F32 : o == 1 ? KVT_DTYPE_F16 : KVT_DTYPE_BF16;
	c.window = windows[byte(in) % 4];
	c.n_sink = sinks[byte(in) % 4];
	c.flush_batch = 1 + byte(in) % 8;
	c.p = ps[byte(in) % 4];
	uint8_t b = byte(in);
	c.budget_min = bmin[b % 4];
	c.budget_max = b & 4 ? 96 : 0;
	c.max_seqs = 1 + (b >> 3) % MAXS;
	c.host_bytes = (uint64_t)(1 + byte(in) % 16) << 18; /* 256 KiB .. 4 MiB */
	z->cfg = c;
	z->esz = 2;
	z->osz = c.out_dtype == KVT_DTYPE_F32 ? 4 : 2;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = {data, size, 0};
	struct fz z;
	memset(&z, 0, sizeof z);
	configure(&z, &in);
	z.rng = 0x9e3779b97f4a7c15ull ^ size;
	int64_t live = kvt_mem_live();
	int rc = kvt_cache_create(&z.cfg, &z.c);
	CHECK(rc == 0, "kvt_cache_create of a valid configuration: %d (%s)", rc,
	      kvt_last_error(NULL));
	/* a few ids that were never handed out */
	z.ids[z.n_ids++] = 7;
	for (int i = 0; i < 64 && in.at < in.n; i++)
		step(&z, &in);
	kvt_cache_destroy(z.c);
	CHECK(kvt_mem_live() == live, "live allocations %lld after destroy, %lld before",
	      (long long)kvt_mem_live(), (long long)live);
	return 0;
}

#define FUZZ_NAME "fuzz_api"
#include "fuzz_replay.h"
