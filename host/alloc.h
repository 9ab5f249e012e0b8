/* SPDX-License-Identifier: MIT */
/*
 * The one allocator table every allocation of the library goes through, so that tests can fail the
 * Nth allocation and count what is still live.
 */
#ifndef KVT_ALLOC_H
#define KVT_ALLOC_H

#include <stddef.h>
#include <stdint.h>

enum kvt_mem_kind {
	KVT_MEM_HOST = 0,  /* ordinary heap memory (malloc) */
	KVT_MEM_PAGES = 1, /* page-aligned anonymous mapping, not touched (host-tier extents) */
	KVT_MEM_DEVICE = 2, /* device memory, through the hooks the GPU backend installs */
	KVT_MEM_KINDS = 3
};

/* Zeroed memory of `bytes` (> 0) of `kind`, or NULL (allocation failed or injected failure). */
void *kvt_mem_alloc(enum kvt_mem_kind kind, size_t bytes);
/* Release what kvt_mem_alloc returned; `bytes` as passed to it. NULL is accepted. */
void kvt_mem_free(enum kvt_mem_kind kind, void *p, size_t bytes);
/* Grow or shrink a KVT_MEM_HOST block (old contents kept); NULL on failure, p left intact. */
void *kvt_mem_realloc(void *p, size_t old_bytes, size_t new_bytes);

/*
 * Pinning of host pages for device access (cudaHostRegister in the CUDA backend). Counted as an
 * allocation, so it can be made to fail. Without hooks, pin succeeds and does nothing.
 */
int kvt_mem_pin(void *p, size_t bytes);
void kvt_mem_unpin(void *p, size_t bytes);

struct kvt_mem_hooks {
	void *(*device_alloc)(size_t bytes);
	void (*device_free)(void *p);
	int (*pin)(void *p, size_t bytes);
	void (*unpin)(void *p);
};
/* Installed by a GPU backend; NULL restores the defaults. */
void kvt_mem_set_hooks(const struct kvt_mem_hooks *hooks);
/* Whether pinning hooks are installed (so host-tier extents will be pinned). */
int kvt_mem_can_pin(void);

/* Fault injection for tests: fail the n-th allocation or pin from now on (1-based); 0 disables. */
void kvt_mem_fail_at(uint64_t n);
/* Allocations and pins attempted since the last kvt_mem_fail_at. */
uint64_t kvt_mem_attempts(void);
/* Whether the injected failure fired since the last kvt_mem_fail_at. */
int kvt_mem_fired(void);
/* Allocations plus pins now live, over all kinds. */
int64_t kvt_mem_live(void);

#endif
