/* SPDX-License-Identifier: MIT */
/*
 * The layouts of kvt_seq_read_rows_at and kvt_seq_write_rows_at: a caller's paged K/V buffer
 * through a slot mapping, or a strided view of a dense one, checked once here so that the backends
 * only ever see offsets that lie inside an address range (struct kvt_rows_map).
 *
 * Reading scatters straight from the host tier into the caller's slots (ops->read_rows_at); writing
 * gathers the rows into a dense buffer and hands it to the prefill path of kvt_seq_write_rows, so
 * that one path stores and indexes rows whatever their layout. Repeated slots are refused on read
 * (two tokens would race for one slot, and on a device the winner is not defined) and allowed on
 * write (reading one slot twice is harmless); a skipped slot (-1) is allowed on read only, since a
 * sequence cannot hold a hole.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define LAYOUT_MIN_SIZE (offsetof(kvt_rows_layout, head_stride) + sizeof(uint64_t))

/* The strides of lo with defaults applied, and the largest slot whose rows stay in ptrdiff_t. */
static int strides(kvt_cache *c, const char *call, const kvt_rows_layout *lo,
		   struct kvt_rows_map *m, int64_t *max_slot)
{
	const uint64_t d = c->d, H = c->cfg.n_kv_heads, lim = (uint64_t)PTRDIFF_MAX / c->elem;
	const uint64_t hs = lo->head_stride ? lo->head_stride : d;
	KVT_RETURN_IF(hs < d || hs > lim / H, c, -EINVAL,
		      "%s: layout->head_stride = %llu, must be 0 or in [head_dim = %llu, %llu]", call,
		      (unsigned long long)lo->head_stride, (unsigned long long)d,
		      (unsigned long long)(lim / H));
	const uint64_t span = (H - 1) * hs + d; /* elements of one slot's rows */
	const uint64_t ss = lo->slot_stride ? lo->slot_stride : H * hs;
	KVT_RETURN_IF(ss < span || ss > lim, c, -EINVAL,
		      "%s: layout->slot_stride = %llu, must be 0 or in [%llu, %llu] "
		      "((n_kv_heads - 1) * head_stride + head_dim: slots may not overlap)", call,
		      (unsigned long long)lo->slot_stride, (unsigned long long)span,
		      (unsigned long long)lim);
	m->slot = lo->slot_mapping;
	m->slot_stride = ss;
	m->head_stride = hs;
	*max_slot = (int64_t)((lim - span) / ss);
	return 0;
}

static int by_slot(const void *a, const void *b)
{
	const int64_t *x = a, *y = b;
	return (x[0] > y[0]) - (x[0] < y[0]);
}

/* No two tokens of the mapping on one slot: pairs (slot, token) sorted by slot. */
static int distinct(kvt_cache *c, const char *call, const int64_t *slot, uint32_t n)
{
	const size_t bytes = sizeof(int64_t) * 2 * n;
	int64_t *pair = kvt_mem_alloc(KVT_MEM_HOST, bytes);
	KVT_RETURN_IF(!pair, c, -ENOMEM, "%s: out of memory checking %u slots (%zu bytes)", call, n,
		      bytes);
	uint32_t m = 0;
	for (uint32_t i = 0; i < n; i++)
		if (slot[i] >= 0) {
			pair[2 * m] = slot[i];
			pair[2 * m++ + 1] = i;
		}
	qsort(pair, m, 2 * sizeof *pair, by_slot);
	uint32_t dup = 0;
	while (dup + 1 < m && pair[2 * dup] != pair[2 * dup + 2])
		dup++;
	int rc = 0;
	if (dup + 1 < m) {
		int64_t i = pair[2 * dup + 1], j = pair[2 * dup + 3];
		rc = kvt_seterr(c, -EINVAL, "%s: layout->slot_mapping[%lld] = slot_mapping[%lld] = %lld: "
				"tokens read into one slot", call, (long long)(i < j ? i : j),
				(long long)(i < j ? j : i), (long long)pair[2 * dup]);
	}
	kvt_mem_free(KVT_MEM_HOST, pair, bytes);
	return rc;
}

static int slots(kvt_cache *c, const char *call, const int64_t *slot, uint32_t n, bool write,
		 int64_t max_slot)
{
	const int64_t lo = write ? 0 : -1;
	for (uint32_t i = 0; i < n; i++)
		KVT_RETURN_IF(slot[i] < lo || slot[i] > max_slot, c, -EINVAL,
			      "%s: layout->slot_mapping[%u] = %lld, must be in [%lld, %lld]%s", call, i,
			      (long long)slot[i], (long long)lo, (long long)max_slot,
			      write && slot[i] == -1 ? " (a written token cannot be skipped)" : "");
	return write ? 0 : distinct(c, call, slot, n);
}

int kvt_rows_map_check(kvt_cache *c, const char *call, const kvt_rows_layout *lo, uint32_t n,
		       bool write, struct kvt_rows_map *m)
{
	const uint64_t H = c->cfg.n_kv_heads;
	if (!lo)
		return 1;
	KVT_RETURN_IF(lo->size < LAYOUT_MIN_SIZE, c, -EINVAL,
		      "%s: layout->size = %u, must be >= %zu", call, lo->size, LAYOUT_MIN_SIZE);
	KVT_RETURN_IF(lo->flags, c, -EINVAL, "%s: layout->flags = 0x%x, no flag is defined", call,
		      lo->flags);
	int64_t max_slot = 0;
	KVT_TRY(strides(c, call, lo, m, &max_slot));
	if (lo->slot_mapping)
		KVT_TRY(slots(c, call, lo->slot_mapping, n, write, max_slot));
	else
		KVT_RETURN_IF((int64_t)n - 1 > max_slot, c, -EINVAL,
			      "%s: %u tokens in slots 0..%u at layout->slot_stride = %llu%s pass the "
			      "ptrdiff_t range: the largest slot is %lld", call, n, n - 1,
			      (unsigned long long)m->slot_stride,
			      lo->slot_stride ? "" : " (0: n_kv_heads * head_stride)",
			      (long long)max_slot);
	if (!m->slot && m->head_stride == c->d && m->slot_stride == H * c->d)
		return 1;
	KVT_RETURN_IF(!c->ops->read_rows_at, c, -EOPNOTSUPP,
		      "%s: the %s backend takes dense rows only (layout with a slot mapping or "
		      "strides)", call, c->ops->name);
	return 0;
}

int kvt_rows_gather(kvt_cache *c, const struct kvt_rows_map *m, uint32_t n, const void *k,
		    const void *v, void **dense, size_t *bytes)
{
	const uint32_t H = c->cfg.n_kv_heads;
	const size_t half = c->d * c->elem, one = (size_t)n * H * half;
	char *buf = kvt_mem_alloc(KVT_MEM_HOST, 2 * one);
	KVT_RETURN_IF(!buf, c, -ENOMEM, "out of memory gathering %u tokens' rows (%zu bytes)", n,
		      2 * one);
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t h = 0; h < H; h++) {
			size_t at = (size_t)kvt_rows_at(m, i, h) * c->elem, to = ((size_t)i * H + h) * half;
			memcpy(buf + to, (const char *)k + at, half);
			memcpy(buf + one + to, (const char *)v + at, half);
		}
	*dense = buf;
	*bytes = 2 * one;
	return 0;
}
