/* SPDX-License-Identifier: MIT */
/*
 * The host tier: fixed-size blocks of K/V rows carved from large extents of page-aligned memory,
 * placed on the NUMA node closest to the GPU and pinned when a GPU backend is active, under a
 * configured capacity.
 */
#ifndef KVT_EXTENT_H
#define KVT_EXTENT_H

#include <stddef.h>
#include <stdint.h>

#include "alloc.h"
#include "err.h"
#include "pool.h"

struct kvt_extent;

struct kvt_extents {
	uint64_t capacity;        /* bytes of blocks that may be handed out */
	uint64_t used;            /* bytes of blocks handed out */
	uint64_t mapped;          /* bytes of extents mapped, <= capacity */
	size_t block_bytes;       /* one block */
	size_t extent_bytes;      /* one extent (a multiple of block_bytes) */
	int node;                 /* NUMA node the extents are bound to, -1 for none */
	int pinned;               /* extents registered for device access (mem pins) */
	const struct kvt_mem *mem; /* the owning cache's allocation context: its pin hooks */
	struct kvt_pool *pool;    /* a host budget shared with other caches (charged per extent
				     mapped), or NULL */
	char placement[128];      /* how the node was chosen, for logs and kvbench */
	struct kvt_extent *extents;
	void **free_blocks;       /* stack of free blocks */
	size_t n_free, free_cap;
};

/*
 * Prepare a tier of `capacity` bytes in blocks of `block_bytes`. `pci_busid` names the GPU the tier
 * serves ("0000:3b:00.0") or is NULL; the NUMA node closest to it is chosen with hwloc when built,
 * otherwise the node of the calling CPU (libnuma), otherwise none. Extents are pinned through
 * `mem` (kept, not copied: it must outlive x; NULL pins nothing). Allocates nothing yet.
 * Errors: -EINVAL (x NULL, capacity or block_bytes 0).
 */
int kvt_extents_init(struct kvt_extents *x, uint64_t capacity, size_t block_bytes,
		     const char *pci_busid, const struct kvt_mem *mem, struct kvt_err *err);
/* Free every extent. Blocks still handed out become invalid. */
void kvt_extents_fini(struct kvt_extents *x);
/*
 * Take n blocks into out[0..n). All or nothing: -ENOSPC when used + n * block_bytes > capacity
 * (nothing taken), -ENOMEM when an extent cannot be allocated, bound or pinned (nothing taken).
 */
int kvt_extents_take(struct kvt_extents *x, uint32_t n, void **out, struct kvt_err *err);
/* Return n blocks. */
void kvt_extents_give(struct kvt_extents *x, uint32_t n, void *const *blocks);
/* Bytes still available: free blocks of the mapped extents, plus what may still be mapped under
 * the capacity and the shared pool's budget, in whole blocks. */
uint64_t kvt_extents_free_bytes(const struct kvt_extents *x);

#endif
