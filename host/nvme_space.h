/* SPDX-License-Identifier: MIT */
/*
 * Free space of one file of the NVMe store: a sorted array of maximal free extents, handed out
 * first fit. Between two free extents lies at least one block in use, so the array never holds more
 * than (blocks in use + 1) extents; kvt_space_reserve grows it to that bound before an allocation,
 * and kvt_space_free therefore never allocates (and never fails for want of memory).
 *
 * Thread safety: none; the store serializes calls.
 */
#ifndef KVT_NVME_SPACE_H
#define KVT_NVME_SPACE_H

#include <stdint.h>

struct kvt_space_ext {
	uint64_t off, len;
};

struct kvt_space {
	struct kvt_space_ext *ext; /* sorted by offset, disjoint, never adjacent */
	uint32_t n, cap;
	uint64_t live;           /* blocks in use */
	uint64_t capacity, free; /* bytes */
};

/* A space of `capacity` bytes, all free. Returns 0 or -ENOMEM. */
int kvt_space_init(struct kvt_space *s, uint64_t capacity);
void kvt_space_fini(struct kvt_space *s);
/* Room for the extents one more allocation may need: 0 or -ENOMEM (nothing changed). */
int kvt_space_reserve(struct kvt_space *s);
/* First fit of len bytes after kvt_space_reserve: 0 with *off set, or -ENOSPC (nothing changed). */
int kvt_space_alloc(struct kvt_space *s, uint64_t len, uint64_t *off);
/*
 * Give back [off, off + len), coalescing with its neighbours. Returns 0, or -EINVAL (nothing
 * changed) when the range leaves the space or overlaps free space (a double free).
 */
int kvt_space_free(struct kvt_space *s, uint64_t off, uint64_t len);
/* The largest free extent, in bytes (for -ENOSPC messages: fragmentation shows here). */
uint64_t kvt_space_largest(const struct kvt_space *s);

#endif
