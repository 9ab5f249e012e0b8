/* SPDX-License-Identifier: MIT */
/*
 * A host-memory budget shared by the caches of one host: a named pool of bytes in POSIX shared
 * memory (/dev/shm/kvtier.<name>), so that the caches of several processes (one per GPU of a
 * tensor-parallel run) or of one process draw their host tiers from one limit and no cache can
 * starve the others. A cache charges the pool for the host-tier extents it maps (the memory it
 * really holds) and gives the bytes back when it is destroyed.
 *
 * Each cache holds a slot (its pid and its bytes); the pool's total use is the sum of the slots.
 * A process that died without destroying its caches leaves slots behind: the next charge that
 * finds the pool short reclaims the slots of processes that no longer exist or are dead zombies
 * not yet reaped (their /proc/<pid>/stat gone, in state Z or X, or showing another start time: the
 * pid reused), so a crash loses no budget. A holder whose /proc/<pid>/stat cannot be read for
 * another reason (no descriptor left) is taken as alive: its share is never given away from under
 * it. The pool object stays in /dev/shm after its last user; a later cache reuses it (with its
 * total), `rm /dev/shm/kvtier.<name>` removes it.
 */
#ifndef KVT_POOL_H
#define KVT_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"

/* Caches that may hold a slot of one pool at once. */
#define KVT_POOL_SLOTS 256u

struct kvt_pool_map;

/* One cache's hold on a pool. */
struct kvt_pool {
	struct kvt_pool_map *map; /* the shared mapping; NULL: no pool */
	uint32_t slot;
	char name[64];
};

/*
 * Attach to the pool `name` (1..48 characters of [A-Za-z0-9._-]), creating it with `total` bytes
 * when it does not exist. total 0: the pool must exist already. A pool that exists keeps its total;
 * a nonzero `total` that differs is -EINVAL naming both. Errors: -EINVAL (name, total), -ENOSPC (all
 * KVT_POOL_SLOTS slots held by live processes), -EAGAIN (another process is creating the pool and
 * did not finish in a second), or the errno of shm_open, ftruncate or mmap.
 */
int kvt_pool_attach(struct kvt_pool *p, const char *name, uint64_t total, struct kvt_err *err);
/* Whether `name` is a pool name: 1 to 48 characters of [A-Za-z0-9._-] (kvt_config.host_pool). */
bool kvt_pool_name_ok(const char *name);
/* Give back every byte this hold charged and release the slot. p->map NULL: nothing. */
void kvt_pool_detach(struct kvt_pool *p);
/* Charge `bytes` to the pool (p or p->map NULL: no pool, 0): -ENOSPC naming the pool, its total and use when they do not fit
 * (after reclaiming the slots of dead processes). */
int kvt_pool_charge(struct kvt_pool *p, uint64_t bytes, struct kvt_err *err);
/* Give back `bytes` charged by this hold (an extent that could not be mapped after all). */
void kvt_pool_uncharge(struct kvt_pool *p, uint64_t bytes);
/* Give back the bytes of the slots of dead processes now (kvt_pool_charge does it when short). */
void kvt_pool_reclaim(const struct kvt_pool *p);
/* Bytes the pool could still charge now (UINT64_MAX without a pool). */
uint64_t kvt_pool_available(const struct kvt_pool *p);
/* The pool's total and use, and this hold's bytes (zeros without a pool). */
void kvt_pool_usage(const struct kvt_pool *p, uint64_t *total, uint64_t *used, uint64_t *mine);

#endif
