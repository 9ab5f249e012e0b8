/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <string.h>

#include "alloc.h"
#include "nvme_space.h"

int kvt_space_init(struct kvt_space *s, uint64_t capacity)
{
	memset(s, 0, sizeof *s);
	s->ext = kvt_mem_alloc(KVT_MEM_HOST, 4 * sizeof *s->ext);
	if (!s->ext)
		return -ENOMEM;
	s->cap = 4;
	s->capacity = s->free = capacity;
	if (capacity) {
		s->ext[0].off = 0;
		s->ext[0].len = capacity;
		s->n = 1;
	}
	return 0;
}

void kvt_space_fini(struct kvt_space *s)
{
	kvt_mem_free(KVT_MEM_HOST, s->ext, (size_t)s->cap * sizeof *s->ext);
	memset(s, 0, sizeof *s);
}

int kvt_space_reserve(struct kvt_space *s)
{
	/* After one more allocation and any number of frees: at most live + 2 extents. */
	uint64_t need = s->live + 2;
	if (need <= s->cap)
		return 0;
	if (need > UINT32_MAX / 2)
		return -ENOMEM;
	uint32_t cap = s->cap * 2 > need ? s->cap * 2 : (uint32_t)need;
	void *p = kvt_mem_realloc(s->ext, (size_t)s->cap * sizeof *s->ext,
				  (size_t)cap * sizeof *s->ext);
	if (!p)
		return -ENOMEM;
	s->ext = p;
	s->cap = cap;
	return 0;
}

int kvt_space_alloc(struct kvt_space *s, uint64_t len, uint64_t *off)
{
	for (uint32_t i = 0; i < s->n; i++) {
		struct kvt_space_ext *e = &s->ext[i];
		if (e->len < len)
			continue;
		/* Take the front, so the rest stays one extent and nothing is inserted. */
		*off = e->off;
		e->off += len;
		e->len -= len;
		if (!e->len) {
			memmove(e, e + 1, (size_t)(s->n - i - 1) * sizeof *e);
			s->n--;
		}
		s->live++;
		s->free -= len;
		return 0;
	}
	return -ENOSPC;
}

int kvt_space_free(struct kvt_space *s, uint64_t off, uint64_t len)
{
	if (!len || off > s->capacity || len > s->capacity - off || !s->live)
		return -EINVAL;
	/* i: the first extent starting after off. */
	uint32_t lo = 0, hi = s->n;
	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;
		if (s->ext[mid].off > off)
			hi = mid;
		else
			lo = mid + 1;
	}
	uint32_t i = lo;
	struct kvt_space_ext *prev = i ? &s->ext[i - 1] : NULL,
			     *next = i < s->n ? &s->ext[i] : NULL;
	if ((prev && prev->off + prev->len > off) || (next && off + len > next->off))
		return -EINVAL;
	int join_prev = prev && prev->off + prev->len == off,
	    join_next = next && off + len == next->off;
	if (join_prev && join_next) {
		prev->len += len + next->len;
		memmove(next, next + 1, (size_t)(s->n - i - 1) * sizeof *next);
		s->n--;
	} else if (join_prev) {
		prev->len += len;
	} else if (join_next) {
		next->off = off;
		next->len += len;
	} else {
		/* Room is sure: live - 1 blocks left separate at most live <= cap extents. */
		memmove(&s->ext[i + 1], &s->ext[i], (size_t)(s->n - i) * sizeof *s->ext);
		s->ext[i].off = off;
		s->ext[i].len = len;
		s->n++;
	}
	s->live--;
	s->free += len;
	return 0;
}

uint64_t kvt_space_largest(const struct kvt_space *s)
{
	uint64_t m = 0;
	for (uint32_t i = 0; i < s->n; i++)
		if (s->ext[i].len > m)
			m = s->ext[i].len;
	return m;
}
