/* SPDX-License-Identifier: MIT */
/*
 * The strided q, k, v and out of the compute calls' _at forms (kvt_prefill_at, kvt_append_at,
 * kvt_attend_at, kvt_extend_at): a kvt_io_layout checked once here, then one mechanism for every
 * call. A layout that resolves to the dense placement costs nothing: the caller's pointers go
 * through. Any other gathers each strided input into a dense scratch of the cache through the
 * backend's copy_strided, runs the dense pipeline on it, and scatters the dense out into the
 * caller's view afterwards. The pipeline and the kernels only ever see dense tensors, so a strided
 * call gives bit for bit what the dense call gives on the same values, and a backend supports
 * strides by supplying one copy (cudaMemcpy2DAsync on a device), not a variant of every kernel.
 *
 * The scratch lives where the backend's tensors do: heap memory on the CPU backend, device memory
 * (through the cache's allocation hooks) on a backend with device_tensors; scratch_grow is the one
 * place that knows.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

#define IO_LAYOUT_MIN_SIZE (offsetof(kvt_io_layout, out) + sizeof(kvt_io_view))
#define IO_ALIGN 64u

enum { IO_Q, IO_K, IO_V, IO_OUT, IO_N };
static const char *const io_name[IO_N] = {"q", "k", "v", "out"};

/* One view with its defaults applied, checked for n rows of `heads` heads of `elem`-byte elements:
 * *s in bytes; *dense when every (token, head) row lies where the dense tensor has it. */
static int view_check(kvt_cache *c, const char *call, const char *name, const kvt_io_view *v,
		      uint32_t n, uint32_t heads, size_t elem, struct kvt_strided *s, bool *dense)
{
	const uint64_t d = c->d, H = heads, lim = (uint64_t)PTRDIFF_MAX / elem;
	const uint64_t hs = v->head_stride ? v->head_stride : d;
	KVT_RETURN_IF(hs < d || hs > lim / H, c, -EINVAL,
		      "%s: layout->%s.head_stride = %llu, must be 0 or in [head_dim = %llu, %llu]",
		      call, name, (unsigned long long)v->head_stride, (unsigned long long)d,
		      (unsigned long long)(lim / H));
	const uint64_t span = (H - 1) * hs + d; /* elements of one token's rows, token-major */
	const uint64_t ts = v->token_stride ? v->token_stride : H * hs;
	/* head-major: the n rows of one head fit below the next head */
	const bool head_major = ts >= d && (n == 1 || ts <= (hs - d) / (n - 1));
	/* (one row: head-major takes any token_stride >= head_dim, so only that can fail) */
	KVT_RETURN_IF(ts < span && !head_major && n == 1, c, -EINVAL,
		      "%s: layout->%s.token_stride = %llu, must be 0 or >= head_dim = %llu (one row)",
		      call, name, (unsigned long long)v->token_stride, (unsigned long long)d);
	KVT_RETURN_IF(ts < span && !head_major, c, -EINVAL,
		      "%s: layout->%s.token_stride = %llu with head_stride = %llu: rows of two "
		      "tokens overlap; must be 0 or >= (heads - 1) * head_stride + head_dim = %llu "
		      "(token-major), or in [head_dim = %llu, (head_stride - head_dim) / (n - 1) = "
		      "%llu] for n = %u rows (head-major)", call, name,
		      (unsigned long long)v->token_stride, (unsigned long long)hs,
		      (unsigned long long)span, (unsigned long long)d,
		      (unsigned long long)((hs - d) / (n - 1)), n);
	KVT_RETURN_IF(n > 1 && ts > (lim - span) / (n - 1), c, -EINVAL,
		      "%s: layout->%s.token_stride = %llu%s with head_stride = %llu%s: %u rows "
		      "reach past %llu elements (the ptrdiff_t range); with this head_stride the "
		      "token_stride must be at most %llu", call, name, (unsigned long long)ts,
		      v->token_stride ? "" : " (0: the default)", (unsigned long long)hs,
		      v->head_stride ? "" : " (0: the default)", n, (unsigned long long)lim,
		      (unsigned long long)((lim - span) / (n - 1)));
	*s = (struct kvt_strided){.n = n, .heads = heads, .width = d * elem,
				  .token_pitch = ts * elem, .head_pitch = hs * elem};
	*dense = (n == 1 || ts == H * d) && (H == 1 || hs == d);
	return 0;
}

/* Bytes of tensor i's dense copy, rounded up so that the next one stays aligned. */
static size_t dense_bytes(const struct kvt_strided *s)
{
	size_t b = (size_t)s->n * s->heads * s->width;
	return (b + IO_ALIGN - 1) / IO_ALIGN * IO_ALIGN;
}

static void scratch_free(kvt_cache *c, void *p, size_t bytes)
{
	if (c->ops->device_tensors)
		kvt_mem_device_free(&c->mem, p, bytes);
	else
		kvt_mem_free(KVT_MEM_HOST, p, bytes);
}

/* The scratch of at least `bytes`, in the memory the backend's tensors live in; the old one is
 * kept on failure (its contents are not). On a device, growing synchronizes it (work queued may
 * still read the old scratch), so it is refused while `stream` is captured into a graph. */
static int scratch_grow(kvt_cache *c, const char *call, size_t bytes, void *stream)
{
	if (bytes <= c->io_scratch_bytes)
		return 0;
	bytes += bytes / 4; /* headroom: a batch that grows by one does not regrow it each call */
	const bool dev = c->ops->device_tensors;
	if (dev && c->ops->may_block)
		KVT_TRY(c->ops->may_block(c, stream, "growing the dense copies of strided tensors"));
	void *p = dev ? kvt_mem_device_alloc(&c->mem, bytes) : kvt_mem_alloc(KVT_MEM_HOST, bytes);
	KVT_RETURN_IF(!p, c, -ENOMEM, "%s: out of %s memory for the dense copies of strided tensors "
		      "(%zu bytes)", call, dev ? "device" : "host", bytes);
	if (c->io_scratch && dev && c->ops->quiesce) {
		int rc = c->ops->quiesce(c);
		if (rc < 0) {
			scratch_free(c, p, bytes);
			return rc;
		}
	}
	scratch_free(c, c->io_scratch, c->io_scratch_bytes);
	c->io_scratch = p;
	c->io_scratch_bytes = bytes;
	return 0;
}

static int layout_check(kvt_cache *c, const char *call, const kvt_io_layout *lo, uint32_t n,
			void *const ptr[IO_N], struct kvt_strided s[IO_N], bool strided[IO_N])
{
	KVT_RETURN_IF(lo->size < IO_LAYOUT_MIN_SIZE, c, -EINVAL,
		      "%s: layout->size = %u, must be >= %zu", call, lo->size, IO_LAYOUT_MIN_SIZE);
	KVT_RETURN_IF(lo->flags, c, -EINVAL, "%s: layout->flags = 0x%x, no flag is defined", call,
		      lo->flags);
	const kvt_io_view *view[IO_N] = {&lo->q, &lo->k, &lo->v, &lo->out};
	for (int i = 0; i < IO_N; i++) {
		const bool kv = i == IO_K || i == IO_V;
		bool dense = true;
		if (ptr[i])
			KVT_TRY(view_check(c, call, io_name[i], view[i], n,
					   kv ? c->cfg.n_kv_heads : c->cfg.n_q_heads,
					   i == IO_OUT ? c->out_elem : c->elem, &s[i], &dense));
		strided[i] = !dense;
	}
	return 0;
}

int kvt_check_reach(kvt_cache *c, const char *call, uint32_t n, const char *const names[],
		    const void *const ptr[], void *stream)
{
	const char *why = NULL;
	const uint32_t i = c->ops->unreachable ? c->ops->unreachable(c, n, ptr, &why, stream) : n;
	KVT_RETURN_IF(i < n, c, -EINVAL,
		      "%s: %s = %p is %s, which the %s backend's kernels cannot reach: pass device "
		      "memory, managed memory or pinned host memory", call, names[i], ptr[i], why,
		      c->ops->name);
	return 0;
}

int kvt_io_begin(kvt_cache *c, const char *call, const kvt_io_layout *lo, uint32_t n,
		 struct kvt_io *io, void *stream)
{
	void *ptr[IO_N] = {(void *)io->q, (void *)io->k, (void *)io->v, io->out};
	struct kvt_strided s[IO_N];
	bool strided[IO_N];
	io->user_out = NULL;
	KVT_TRY(kvt_check_reach(c, call, IO_N, io_name, (const void *const *)ptr, stream));
	if (!lo)
		return 0;
	KVT_TRY(layout_check(c, call, lo, n, ptr, s, strided));
	size_t bytes = 0;
	for (int i = 0; i < IO_N; i++)
		bytes += strided[i] ? dense_bytes(&s[i]) : 0;
	if (!bytes)
		return 0;
	KVT_RETURN_IF(!c->ops->copy_strided, c, -EOPNOTSUPP,
		      "%s: no strided copy on the %s backend yet (layout->%s is not dense): pass "
		      "dense tensors or a NULL layout", call, c->ops->name,
		      io_name[strided[IO_Q] ? IO_Q : strided[IO_K] ? IO_K : strided[IO_V] ? IO_V
										 : IO_OUT]);
	/* the cache's device current before its scratch is made or filled (the call's enter comes
	 * later, in the pipeline) */
	if (c->ops->enter)
		KVT_TRY(c->ops->enter(c, stream));
	KVT_TRY(scratch_grow(c, call, bytes, stream));
	char *at = c->io_scratch;
	for (int i = 0; i < IO_N; i++) {
		if (!strided[i])
			continue;
		if (i == IO_OUT) {
			io->user_out = io->out;
			io->out_view = s[i];
			io->out = at;
		} else {
			KVT_TRY(c->ops->copy_strided(c, at, ptr[i], &s[i], false, stream));
			*(i == IO_Q ? &io->q : i == IO_K ? &io->k : &io->v) = at;
		}
		at += dense_bytes(&s[i]);
	}
	return 0;
}

int kvt_io_end(kvt_cache *c, struct kvt_io *io, int rc, void *stream)
{
	if (rc < 0 || !io->user_out)
		return rc;
	int crc = c->ops->copy_strided(c, io->user_out, io->out, &io->out_view, true, stream);
	return crc < 0 ? crc : rc;
}

void kvt_io_fini(kvt_cache *c)
{
	if (c->io_scratch && c->ops->device_tensors) {
		/* on the cache's device: queued work may still read it */
		if (c->ops->enter)
			(void)c->ops->enter(c, NULL);
		if (c->ops->quiesce)
			(void)c->ops->quiesce(c);
	}
	scratch_free(c, c->io_scratch, c->io_scratch_bytes);
	c->io_scratch = NULL;
	c->io_scratch_bytes = 0;
}
