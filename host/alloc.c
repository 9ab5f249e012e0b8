/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "alloc.h"

static atomic_uint_fast64_t fail_at, attempts;
static atomic_int fired;
static atomic_int_fast64_t live;

/* Counts an attempt; true when this one must fail. */
static int inject(void)
{
	uint64_t n = atomic_fetch_add(&attempts, 1) + 1;
	uint64_t target = atomic_load(&fail_at);
	if (target && n == target) {
		atomic_store(&fired, 1);
		return 1;
	}
	return 0;
}

void kvt_mem_fail_at(uint64_t n)
{
	atomic_store(&attempts, 0);
	atomic_store(&fired, 0);
	atomic_store(&fail_at, n);
}

uint64_t kvt_mem_attempts(void)
{
	return atomic_load(&attempts);
}

int kvt_mem_fired(void)
{
	return atomic_load(&fired);
}

int64_t kvt_mem_live(void)
{
	return atomic_load(&live);
}

static const struct kvt_mem_hooks *hooks_of(const struct kvt_mem *m)
{
	static const struct kvt_mem_hooks none;
	return m && m->hooks ? m->hooks : &none;
}

int kvt_mem_can_pin(const struct kvt_mem *m)
{
	return hooks_of(m)->pin != NULL;
}

void *kvt_mem_device_alloc(const struct kvt_mem *m, size_t bytes)
{
	const struct kvt_mem_hooks *h = hooks_of(m);
	if (bytes == 0 || !h->device_alloc || inject())
		return NULL;
	void *p = h->device_alloc(bytes);
	if (p)
		atomic_fetch_add(&live, 1);
	return p;
}

void kvt_mem_device_free(const struct kvt_mem *m, void *p, size_t bytes)
{
	(void)bytes;
	const struct kvt_mem_hooks *h = hooks_of(m);
	if (!p)
		return;
	atomic_fetch_sub(&live, 1);
	if (h->device_free)
		h->device_free(p);
}

void *kvt_mem_alloc(enum kvt_mem_kind kind, size_t bytes)
{
	void *p = NULL;
	if (bytes == 0 || inject())
		return NULL;
	switch (kind) {
	case KVT_MEM_HOST:
		p = calloc(1, bytes);
		break;
	case KVT_MEM_PAGES:
		p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			p = NULL;
		else
			madvise(p, bytes, MADV_HUGEPAGE); /* advice only: fewer pages per I/O and pin */
		break;
	default:
		break;
	}
	if (p)
		atomic_fetch_add(&live, 1);
	return p;
}

void kvt_mem_free(enum kvt_mem_kind kind, void *p, size_t bytes)
{
	if (!p)
		return;
	atomic_fetch_sub(&live, 1);
	switch (kind) {
	case KVT_MEM_HOST:
		free(p);
		break;
	case KVT_MEM_PAGES:
		munmap(p, bytes);
		break;
	default:
		break;
	}
}

void *kvt_mem_realloc(void *p, size_t old_bytes, size_t new_bytes)
{
	if (!p)
		return kvt_mem_alloc(KVT_MEM_HOST, new_bytes);
	if (new_bytes == 0 || inject())
		return NULL;
	void *q = realloc(p, new_bytes);
	if (q && new_bytes > old_bytes)
		memset((char *)q + old_bytes, 0, new_bytes - old_bytes);
	return q;
}

int kvt_mem_pin(const struct kvt_mem *m, void *p, size_t bytes)
{
	const struct kvt_mem_hooks *h = hooks_of(m);
	if (inject())
		return -ENOMEM;
	if (h->pin) {
		int rc = h->pin(p, bytes);
		if (rc < 0)
			return rc;
	}
	atomic_fetch_add(&live, 1);
	return 0;
}

void kvt_mem_unpin(const struct kvt_mem *m, void *p, size_t bytes)
{
	(void)bytes;
	const struct kvt_mem_hooks *h = hooks_of(m);
	if (!p)
		return;
	atomic_fetch_sub(&live, 1);
	if (h->unpin)
		h->unpin(p);
}
