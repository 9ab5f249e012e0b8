/* SPDX-License-Identifier: MIT */
/* Shared by the cache-level NVMe tests (tier_world.c and its tests, test_tier_fault.c). */
#ifndef KVT_TEST_TIER_UTIL_H
#define KVT_TEST_TIER_UTIL_H

#include "nvme_util.h"

/* Scratch files, descriptor counts and the skip come from the NVMe store tests' helpers. */
typedef nv_files tt_files;

static inline void tt_make_files(tt_files *f, uint32_t n, uint64_t bytes)
{
	nv_make_files(f, nv_dir(), n, bytes);
}

#define TT_MAX_FILES NV_MAX_FILES
#define tt_dir nv_dir
#define tt_unlink nv_unlink
#define tt_skip_unless_available nv_skip_unless_available

/* After kvt_cache_destroy: as many allocations and descriptors live as before the case (a macro, so
 * that a failure names the case's line). */
#define TT_CHECK_RELEASED(name, live, fds)                                                         \
	T_CHECK(kvt_mem_live() == (live) && t_fd_count() == (fds),                                 \
		"%s: after destroy live allocations %lld (wanted %lld), descriptors %d (wanted %d)",  \
		(name), (long long)kvt_mem_live(), (long long)(live), t_fd_count(), (fds))

#endif
