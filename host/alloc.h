/* SPDX-License-Identifier: MIT */
/*
 * The one allocator table every allocation of the library goes through, so that tests can fail the
 * Nth allocation and count what is still live. It sits below lib/ and host/ and includes neither.
 *
 * Heap and page memory need nothing but the C library and the kernel: kvt_mem_alloc. Device memory
 * and pinning belong to a backend, so they go through an allocation context (struct kvt_mem) that
 * each cache owns with the hooks of its backend: two caches of different backends in one process
 * share no hook state. The fault-injection counter and the live count are process-global (tests).
 */
#ifndef KVT_ALLOC_H
#define KVT_ALLOC_H

#include <stddef.h>
#include <stdint.h>

enum kvt_mem_kind {
	KVT_MEM_HOST = 0,  /* ordinary heap memory (malloc) */
	KVT_MEM_PAGES = 1, /* page-aligned anonymous mapping, not touched (host-tier extents) */
};

/*
 * Memory of `bytes` (> 0) of `kind`, zeroed, or NULL (allocation failed or injected failure).
 * Device memory is kvt_mem_device_alloc's, through the hooks of a cache's context.
 */
void *kvt_mem_alloc(enum kvt_mem_kind kind, size_t bytes);
/* Release what kvt_mem_alloc returned; `bytes` as passed to it. NULL is accepted. */
void kvt_mem_free(enum kvt_mem_kind kind, void *p, size_t bytes);
/* Grow or shrink a KVT_MEM_HOST block (old contents kept); NULL on failure, p left intact. */
void *kvt_mem_realloc(void *p, size_t old_bytes, size_t new_bytes);

/* What a backend brings: device memory and pinning of host pages (the CUDA runtime's). */
struct kvt_mem_hooks {
	void *(*device_alloc)(size_t bytes);
	void (*device_free)(void *p);
	int (*pin)(void *p, size_t bytes);
	void (*unpin)(void *p);
};

/*
 * An allocation context: the hooks of one cache's backend (kvt_cache.mem), handed to whatever
 * allocates device memory or pins host pages for that cache (host/extent.c, the GPU backend).
 * Zeroed, or a NULL context: no device memory, and pinning succeeds without doing anything.
 */
struct kvt_mem {
	const struct kvt_mem_hooks *hooks;
};

/* Device memory of `bytes` (> 0, not zeroed) through m's hooks, or NULL (none, failed, injected). */
void *kvt_mem_device_alloc(const struct kvt_mem *m, size_t bytes);
/* Release what kvt_mem_device_alloc(m, bytes) returned. NULL is accepted. */
void kvt_mem_device_free(const struct kvt_mem *m, void *p, size_t bytes);
/*
 * Pin host pages for device access (cudaHostRegister in the CUDA backend). Counted as an
 * allocation, so it can be made to fail (-ENOMEM). Without pin hooks it succeeds and does nothing.
 */
int kvt_mem_pin(const struct kvt_mem *m, void *p, size_t bytes);
void kvt_mem_unpin(const struct kvt_mem *m, void *p, size_t bytes);
/* Whether m pins (so host-tier extents allocated under it are registered for device access). */
int kvt_mem_can_pin(const struct kvt_mem *m);

/* Fault injection for tests: fail the n-th allocation or pin from now on (1-based); 0 disables. */
void kvt_mem_fail_at(uint64_t n);
/* Allocations and pins attempted since the last kvt_mem_fail_at. */
uint64_t kvt_mem_attempts(void);
/* Whether the injected failure fired since the last kvt_mem_fail_at. */
int kvt_mem_fired(void);
/* Allocations plus pins now live, over all kinds. */
int64_t kvt_mem_live(void);

#endif
