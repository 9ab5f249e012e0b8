/* SPDX-License-Identifier: MIT */
/*
 * Part of the fuzz target fuzz_api (fuzz_api.c describes it and holds its entry point): the
 * lifecycle calls and the row transfer. kvt_seq_truncate and kvt_seq_fork against the lengths they
 * should leave; kvt_seq_read_rows and kvt_seq_write_rows, plain or through a kvt_rows_layout (slot
 * mappings and strides, right and wrong), over ranges around a sequence's length: a layout the
 * header refuses is refused, a failed read writes nothing, a read through a layout writes the dense
 * read's rows into the slots named and nothing else, rows written read back bit for bit.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

void do_truncate(struct fz *z, struct in *in)
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
	int rc = (int)FZ_CALL(z, "kvt_seq_truncate", kvt_seq_truncate(z->c, seq, n, NULL));
	CHECK(rc <= 0, "kvt_seq_truncate returned %d", rc);
	if (rc == 0)
		grow(z, &want, seq, UINT32_MAX, -(int64_t)n);
	expect(z, &want, "kvt_seq_truncate", rc);
}

void do_fork(struct fz *z, struct in *in)
{
	uint32_t parent = pick_seq(z, in), child = UINT32_MAX;
	uint8_t b = byte(in);
	struct snap want;
	snap(z, &want);
	kvt_stats st = {.size = sizeof st};
	CHECK(kvt_get_stats(z->c, &st) == 0, "kvt_get_stats failed");
	uint64_t open = st.seqs_open;
	z->forked = true;
	int rc = (int)FZ_CALL(z, "kvt_seq_fork",
			      kvt_seq_fork(z->c, parent, b % 32 == 0 ? NULL : &child, NULL));
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
static uint32_t rnd(struct fz *z)
{
	z->rng ^= z->rng << 13;
	z->rng ^= z->rng >> 7;
	z->rng ^= z->rng << 17;
	return (uint32_t)(z->rng >> 32);
}

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

/* What a row-range action reads from the input first: the sequence, layer and range, the call's
 * form (how; a write also the values' mode), and the layout of its n rows. */
struct rows_call {
	uint32_t seq, layer, from, to, n;
	uint8_t how, mode;
	struct rows r;
};

/* The start of do_read_rows and do_write_rows; 0 (nothing held) when the layout spans more
 * than EXT_CAP elements. */
static int rows_call(struct fz *z, struct in *in, int write, struct rows_call *a)
{
	a->seq = pick_seq(z, in);
	a->layer = byte(in) % (z->cfg.n_layers + 1);
	pick_range(z, in, a->seq, a->layer, write, &a->from, &a->to);
	a->how = byte(in);
	a->mode = write ? byte(in) : 0;
	/* the buffers stay small: a longer range (a sequence of the NVMe mode's larger chunks) reads
	 * its first 4096 rows */
	if (a->to > a->from && a->to - a->from > 4096)
		a->to = a->from + 4096;
	a->n = a->to > a->from ? a->to - a->from : 0;
	gen_rows(z, in, a->n, write, &a->r);
	plain_rows(z, a->how, a->n, &a->r);
	if (a->r.ok && a->r.ext > EXT_CAP) {
		free(a->r.map);
		return 0;
	}
	return 1;
}

/* a's range read into k and v: kvt_seq_read_rows_at through lo when a.how asks, else the dense
 * call */
static int read_as(struct fz *z, const struct rows_call *a, void *k, void *v, void *lo)
{
	if (a->how & 1)
		return kvt_seq_read_rows_at(z->c, a->seq, a->layer, a->from, a->to, k, v, lo, NULL);
	return kvt_seq_read_rows(z->c, a->seq, a->layer, a->from, a->to, k, v, NULL);
}

void do_read_rows(struct fz *z, struct in *in)
{
	struct rows_call a;
	if (!rows_call(z, in, 0, &a))
		return;
	const uint32_t seq = a.seq, layer = a.layer, from = a.from, to = a.to, n = a.n;
	const uint8_t how = a.how;
	struct rows r = a.r;
	const size_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads, row = d * z->esz;
	size_t bytes = r.ok ? (size_t)r.ext * z->esz : 2;
	uint8_t *k = patterned(bytes), *v = patterned(bytes);
	void *lo = how & 1 && !r.null ? sized(&r.lo, sizeof r.lo, r.lo.size) : NULL;
	struct snap want;
	snap(z, &want);
	const uint64_t errors0 = call_begin(z);
	int rc = read_as(z, &a, k, v, lo);
	const char *call = how & 1 ? "kvt_seq_read_rows_at" : "kvt_seq_read_rows";
	check_call(z, call, errors0, rc);
	expect(z, &want, call, rc);
	if (how & 1 && !r.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", call, rc);
	if (rc >= 0)
		CHECK(rc == (int)(to - from) && to > from, "%s [%u, %u) returned %d", call, from,
		      to, rc);
	if (rc < 0 && z->cfg.n_nvme && rc != -EINVAL && rc != -ENOENT) {
		/* an NVMe read's failure may leave k and v partly written, but only with the rows'
		 * bytes (kvtier_lifecycle.h: the CPU backend copies block by block): the same read
		 * again, its fault spent, gives them (where it fails too, there is nothing to
		 * compare with) */
		uint8_t *k2 = patterned(bytes), *v2 = patterned(bytes);
		int rc2 = read_as(z, &a, k2, v2, lo);
		for (size_t i = 0; rc2 >= 0 && i < bytes; i++)
			CHECK((k[i] == PAT || k[i] == k2[i]) && (v[i] == PAT || v[i] == v2[i]),
			      "failed %s (%d) wrote byte %zu, and not the rows' bytes", call, rc,
			      i);
		free(k2);
		free(v2);
	} else if (rc < 0) {
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

void do_write_rows(struct fz *z, struct in *in)
{
	struct rows_call a;
	if (!rows_call(z, in, 1, &a))
		return;
	const uint32_t seq = a.seq, layer = a.layer, from = a.from, to = a.to, n = a.n;
	const uint8_t how = a.how, mode = a.mode;
	struct rows r = a.r;
	const size_t d = z->cfg.head_dim, H = z->cfg.n_kv_heads, row = d * z->esz;
	size_t elems = r.ok ? (size_t)r.ext : 1;
	uint8_t *k = values(z, elems, mode), *v = values(z, elems, 0);
	void *lo = how & 1 && !r.null ? sized(&r.lo, sizeof r.lo, r.lo.size) : NULL;
	struct snap want;
	snap(z, &want);
	const uint64_t errors0 = call_begin(z);
	int rc = how & 1 ? kvt_seq_write_rows_at(z->c, seq, layer, from, to, k, v, lo, NULL)
			 : kvt_seq_write_rows(z->c, seq, layer, from, to, k, v, NULL);
	const char *call = how & 1 ? "kvt_seq_write_rows_at" : "kvt_seq_write_rows";
	check_call(z, call, errors0, rc);
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

