/* SPDX-License-Identifier: MIT */
/*
 * Host-tier extents. Blocks are carved from large page-aligned extents (64 MiB, or less under a small
 * capacity) so the tier costs few mappings and few pin registrations; each extent is bound to the
 * NUMA node closest to the GPU before any page is touched, then pinned for device access.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "kvt_config.h"
#include "extent.h"

#if KVT_HAVE_HWLOC
#include <hwloc.h>
#endif
#if KVT_HAVE_NUMA
#include <numa.h>
#endif

#define EXTENT_BYTES ((size_t)64 << 20)

struct kvt_extent {
	struct kvt_extent *next;
	void *base;
	size_t bytes;
};

/* The NUMA node closest to the GPU with PCI bus id `busid`, or -1; `why` says how it was chosen. */
static int pick_node(const char *busid, char *why, size_t n)
{
	snprintf(why, n, "no NUMA placement (first touch)");
#if KVT_HAVE_HWLOC
	if (busid) {
		hwloc_topology_t topo;
		int node = -1;
		if (hwloc_topology_init(&topo) == 0) {
			hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
			if (hwloc_topology_load(topo) == 0) {
				hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo, busid);
				hwloc_obj_t anc = dev ? hwloc_get_non_io_ancestor_obj(topo, dev) : NULL;
				if (anc && anc->nodeset)
					node = hwloc_bitmap_first(anc->nodeset);
			}
			hwloc_topology_destroy(topo);
		}
		if (node >= 0) {
			snprintf(why, n, "hwloc: NUMA node %d is closest to GPU %s", node, busid);
			return node;
		}
	}
#else
	(void)busid;
#endif
#if KVT_HAVE_NUMA
	if (numa_available() >= 0 && numa_num_configured_nodes() > 1) {
		int cpu = sched_getcpu(), node = cpu >= 0 ? numa_node_of_cpu(cpu) : -1;
		if (node >= 0) {
			snprintf(why, n, "libnuma: NUMA node %d of the creating CPU", node);
			return node;
		}
	}
#endif
	return -1;
}

int kvt_extents_init(struct kvt_extents *x, uint64_t capacity, size_t block_bytes,
		     const char *pci_busid, const struct kvt_mem *mem, struct kvt_err *err)
{
	if (!x || !capacity || !block_bytes)
		return kvt_err_set(err, -EINVAL,
				   "host tier of capacity %llu in blocks of %zu bytes: need a tier, "
				   "capacity >= 1 and block_bytes >= 1",
				   (unsigned long long)capacity, block_bytes);
	memset(x, 0, sizeof *x);
	x->capacity = capacity;
	x->block_bytes = block_bytes;
	uint64_t blocks = capacity / block_bytes, per = EXTENT_BYTES / block_bytes;
	per = per ? per : 1;
	per = blocks && blocks < per ? blocks : per;
	x->extent_bytes = per * block_bytes;
	x->node = pick_node(pci_busid, x->placement, sizeof x->placement);
	x->mem = mem;
	x->pinned = kvt_mem_can_pin(mem);
	return 0;
}

void kvt_extents_fini(struct kvt_extents *x)
{
	while (x->extents) {
		struct kvt_extent *e = x->extents;
		x->extents = e->next;
		kvt_mem_unpin(x->mem, e->base, e->bytes);
		kvt_mem_free(KVT_MEM_PAGES, e->base, e->bytes);
		kvt_mem_free(KVT_MEM_HOST, e, sizeof *e);
	}
	kvt_mem_free(KVT_MEM_HOST, x->free_blocks, 0);
	x->free_blocks = NULL;
	x->n_free = x->free_cap = 0;
	x->used = x->mapped = 0;
}

/* Map, bind and pin an extent of nblocks blocks (bytes) and push them on the free stack. */
static int map_extent(struct kvt_extents *x, size_t nblocks, size_t bytes, struct kvt_err *err)
{
	size_t cap = x->free_cap + nblocks;
	void **stack = kvt_mem_realloc(x->free_blocks, sizeof(void *) * x->free_cap,
				       sizeof(void *) * cap);
	if (!stack)
		return kvt_err_set(err, -ENOMEM, "no memory for a free list of %zu blocks", cap);
	x->free_blocks = stack;
	x->free_cap = cap;
	struct kvt_extent *e = kvt_mem_alloc(KVT_MEM_HOST, sizeof *e);
	void *base = e ? kvt_mem_alloc(KVT_MEM_PAGES, bytes) : NULL;
	if (!base) {
		kvt_mem_free(KVT_MEM_HOST, e, sizeof *e);
		return kvt_err_set(err, -ENOMEM, "mapping an extent of %zu bytes failed", bytes);
	}
#if KVT_HAVE_NUMA
	if (x->node >= 0)
		numa_tonode_memory(base, bytes, x->node);
#endif
	if (kvt_mem_pin(x->mem, base, bytes) < 0) {
		kvt_mem_free(KVT_MEM_PAGES, base, bytes);
		kvt_mem_free(KVT_MEM_HOST, e, sizeof *e);
		return kvt_err_set(err, -ENOMEM, "pinning an extent of %zu bytes failed", bytes);
	}
	*e = (struct kvt_extent){ .next = x->extents, .base = base, .bytes = bytes };
	x->mapped += bytes;
	x->extents = e;
	/* push in reverse so blocks are handed out in address order */
	for (size_t i = nblocks; i-- > 0;)
		x->free_blocks[x->n_free++] = (char *)base + i * x->block_bytes;
	return 0;
}

/* Map one more extent: as large as an extent, the capacity left and the shared pool allow. */
static int grow(struct kvt_extents *x, struct kvt_err *err)
{
	/* the last extent only spans what the capacity still allows, so nothing is pinned in vain */
	uint64_t left_blocks = (x->capacity - x->mapped) / x->block_bytes;
	uint64_t pool_blocks = kvt_pool_available(x->pool) / x->block_bytes;
	size_t nblocks = x->extent_bytes / x->block_bytes;
	if (left_blocks == 0)
		return kvt_err_set(err, -ENOSPC, "all %llu bytes of capacity are mapped",
				   (unsigned long long)x->capacity);
	left_blocks = left_blocks < pool_blocks ? left_blocks : pool_blocks;
	nblocks = left_blocks < nblocks ? (size_t)left_blocks : nblocks;
	nblocks = nblocks ? nblocks : 1; /* the pool is short: its charge below says so */
	size_t bytes = nblocks * x->block_bytes;
	int rc = kvt_pool_charge(x->pool, bytes, err);
	if (rc < 0)
		return rc;
	rc = map_extent(x, nblocks, bytes, err);
	if (rc < 0)
		kvt_pool_uncharge(x->pool, bytes);
	return rc;
}

uint64_t kvt_extents_free_bytes(const struct kvt_extents *x)
{
	if (!x->pool || !x->pool->map)
		return x->capacity - x->used;
	uint64_t unmapped = x->capacity - x->mapped, pool = kvt_pool_available(x->pool);
	if (pool < unmapped) { /* short: what dead processes held counts as free */
		kvt_pool_reclaim(x->pool);
		pool = kvt_pool_available(x->pool);
	}
	unmapped = unmapped < pool ? unmapped : pool;
	return x->mapped - x->used + unmapped / x->block_bytes * x->block_bytes;
}

int kvt_extents_take(struct kvt_extents *x, uint32_t n, void **out, struct kvt_err *err)
{
	if ((uint64_t)n * x->block_bytes > x->capacity - x->used)
		return kvt_err_set(err, -ENOSPC,
				   "%u blocks of %zu bytes need %llu bytes, %llu free of capacity %llu",
				   n, x->block_bytes, (unsigned long long)n * x->block_bytes,
				   (unsigned long long)(x->capacity - x->used),
				   (unsigned long long)x->capacity);
	while (x->n_free < n) {
		int rc = grow(x, err);
		if (rc < 0)
			return rc; /* extents mapped so far stay as free blocks: nothing is taken */
	}
	for (uint32_t i = 0; i < n; i++)
		out[i] = x->free_blocks[--x->n_free];
	x->used += (uint64_t)n * x->block_bytes;
	return 0;
}

void kvt_extents_give(struct kvt_extents *x, uint32_t n, void *const *blocks)
{
	for (uint32_t i = 0; i < n; i++)
		x->free_blocks[x->n_free++] = blocks[i];
	x->used -= (uint64_t)n * x->block_bytes;
}
