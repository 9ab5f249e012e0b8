/* SPDX-License-Identifier: MIT */
/*
 * Part of the fuzz target fuzz_api (fuzz_api.c describes it and holds its entry point): the io
 * layouts and the calls that take them. kvt_io_layout views (dense, fused-qkv-like, transposed, and
 * wrong ones), kvt_prefill_at, kvt_append_at, kvt_attend_at and kvt_select_at, and kvt_extend with
 * or without a layout: a layout the header refuses is refused, lengths change as they should, an
 * out view gets nothing outside its (token, head) rows, and nothing from a failed call when it is
 * not dense.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_api.h"

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

void do_compute_at(struct fz *z, struct in *in)
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
	fz_batch(z, which ? seqs : NULL, which ? n : 0);
	const uint64_t errors0 = call_begin(z);
	int rc = which == 0 ? kvt_prefill_at(z->c, seq, layer, io.t[0], io.t[1], io.t[2], n, io.plo,
					     NULL)
		 : which == 1 ? kvt_append_at(z->c, layer, n, seqs, io.t[1], io.t[2], io.plo, NULL)
		 : which == 2 ? kvt_attend_at(z->c, layer, n, seqs, io.t[0], io.t[3], io.plo, NULL)
			      : kvt_select_at(z->c, layer, n, seqs, io.t[0], io.plo, NULL);
	check_call(z, name[which], errors0, rc);
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

void do_extend(struct fz *z, struct in *in)
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
	fz_batch(z, seqs, n);
	const uint64_t errors0 = call_begin(z);
	int rc = at & 1 ? kvt_extend_at(z->c, layer, n, seqs, cu, io.t[0], io.t[1], io.t[2], io.t[3],
					flags, io.plo, NULL)
			: kvt_extend(z->c, layer, n, seqs, cu, io.t[0], io.t[1], io.t[2], io.t[3],
				     flags, NULL);
	check_call(z, call, errors0, rc);
	CHECK(rc <= 0, "%s returned %d", call, rc);
	if (!io.ok)
		CHECK(rc < 0, "%s accepted a layout the header refuses (returned %d)", call, rc);
	for (uint32_t i = 0; rc == 0 && i < n; i++)
		grow(z, &want, seqs[i], layer, cu[i + 1] - cu[i]);
	expect(z, &want, call, rc);
	check_out(z, &io, total, call, rc);
	free_io(&io);
}

/*
 * kvt_graph_reserve (odd first byte: any bounds, some refused) or kvt_attend_graph over slots
 * holding a batch's ids with padded slots between them (by seqs < 0 or by valid 0, lengths given
 * right, wrong or not at all): it changes no length; when it succeeds the padded rows keep their
 * bytes and each valid row equals kvt_attend's row of its sequence, bit for bit (when kvt_attend
 * of the valid slots succeeds too, without score corrections, which learn from every step).
 */
void do_attend_graph(struct fz *z, struct in *in)
{
	const uint8_t b = byte(in);
	if (b & 1) {
		const uint32_t slots = (b >> 1) % 9, tokens = (uint32_t)byte(in) * 8;
		(void)FZ_CALL(z, "kvt_graph_reserve", kvt_graph_reserve(z->c, slots, tokens, NULL));
		return;
	}
	uint32_t seqs[MAXS];
	const uint32_t layer = byte(in) % (z->cfg.n_layers + 1), n = batch(z, in, seqs);
	const uint8_t pads = byte(in), how = byte(in);
	int32_t ids[2 * MAXS], lens[2 * MAXS];
	uint8_t valid[2 * MAXS];
	uint32_t ns = 0, at[MAXS];
	for (uint32_t i = 0; i < n; i++) {
		if (pads >> i & 1) { /* a padded slot before this one */
			ids[ns] = how & 1 ? -1 : (int32_t)seqs[i];
			valid[ns] = 0;
			lens[ns++] = 0;
		}
		at[i] = ns;
		ids[ns] = (int32_t)seqs[i];
		valid[ns] = 1 + (how >> 4) % 3;
		const int64_t len = length(z, seqs[i], layer < z->cfg.n_layers ? layer : 0);
		lens[ns++] = (int32_t)len + ((how >> 2 & 3) == 3 && i == 0);
	}
	const kvt_graph_batch gb = {.n_slots = ns, .seqs = ids,
				    .lengths = how >> 2 & 1 ? lens : NULL,
				    .valid = how & 2 ? valid : NULL};
	if (!(how & 2))
		for (uint32_t i = 0; i < ns; i++)
			if (!valid[i])
				ids[i] = -1; /* without valid[], only seqs < 0 pads */
	const size_t qrow = (size_t)z->cfg.n_q_heads * z->cfg.head_dim, orow = qrow * z->osz;
	void *q = values(z, ns * qrow, how & 64 ? how : 0);
	uint8_t *out = malloc(ns * orow), *ref = malloc(n * orow);
	void *qv = malloc(n * qrow * z->esz);
	if (!out || !ref || !qv)
		abort();
	memset(out, 0xa5, ns * orow);
	struct snap before, after;
	snap(z, &before);
	fz_batch(z, NULL, ns); /* its ids are int32_t slots */
	const int rc = (int)FZ_CALL(z, "kvt_attend_graph", kvt_attend_graph(z->c, layer, &gb, q, out,
									       NULL));
	snap(z, &after);
	expect(z, &before, "kvt_attend_graph", rc);
	if (rc == 0) {
		for (uint32_t i = 0; i < n; i++)
			memcpy((char *)qv + i * qrow * z->esz, (char *)q + at[i] * qrow * z->esz,
			       qrow * z->esz);
		for (uint32_t s = 0, i = 0; s < ns; s++) {
			if (i < n && at[i] == s) {
				i++;
				continue;
			}
			for (size_t k = 0; k < orow; k++)
				CHECK(out[s * orow + k] == 0xa5, "kvt_attend_graph wrote padded slot %u",
				      s);
		}
		/* score corrections (correction_steps) learn from each step, and the hysteresis
		 * (keep_weight) favors the last: a second step of the same query may select
		 * otherwise */
		if (z->cfg.correction_steps == 0 && z->cfg.keep_weight == 0.0f &&
		    kvt_attend(z->c, layer, n, seqs, qv, ref, NULL) == 0)
			for (uint32_t i = 0; i < n; i++)
				CHECK(!memcmp(out + at[i] * orow, ref + i * orow, orow),
				      "kvt_attend_graph's slot %u differs from kvt_attend's entry %u",
				      at[i], i);
	}
	free(q);
	free(qv);
	free(out);
	free(ref);
}
