/* SPDX-License-Identifier: MIT */
/*
 * The file-system and io_uring set-up calls of the NVMe store, behind one fail-Nth seam, so that
 * tests can make each of them fail in turn (open, fstat, ftruncate, fallocate, statx, io_uring
 * set-up and registration) as kvt_mem_fail_at does for allocations. Each wrapper behaves exactly
 * like the call it wraps (same return convention, errno set the same way) unless the injected
 * failure is due: then the call is not made, and it fails with the injected errno. Always compiled
 * in; disarmed it costs one atomic increment and one load per call, and these calls run only when a
 * store is opened. The counters are process-global (tests), like the allocator's.
 */
#ifndef KVT_SYSIO_H
#define KVT_SYSIO_H

#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

/* The wrapped calls, for kvt_sys_fired_call and the tests' messages. */
enum kvt_sys_call {
	KVT_SYS_NONE = 0,
	KVT_SYS_OPEN,
	KVT_SYS_FSTAT,
	KVT_SYS_FTRUNCATE,
	KVT_SYS_FALLOCATE,
	KVT_SYS_STATX,
	KVT_SYS_URING_SETUP,
	KVT_SYS_URING_REG_BUFFERS,
	KVT_SYS_URING_REG_FILES,
	KVT_SYS_NCALLS
};

/* The call's name ("open", "io_uring_setup", ...). */
const char *kvt_sys_call_name(enum kvt_sys_call call);

/* Fail the n-th wrapped call from now on (1-based) with errno `err` (> 0); n = 0 disables. */
void kvt_sys_fail_at(uint64_t n, int err);
/* Wrapped calls attempted since the last kvt_sys_fail_at. */
uint64_t kvt_sys_attempts(void);
/* The call the injected failure hit since the last kvt_sys_fail_at, or KVT_SYS_NONE. */
enum kvt_sys_call kvt_sys_fired_call(void);

int kvt_sys_open(const char *path, int flags, mode_t mode);
int kvt_sys_fstat(int fd, struct stat *sb);
int kvt_sys_ftruncate(int fd, off_t bytes);
int kvt_sys_fallocate(int fd, int mode, off_t offset, off_t bytes);
/* statx(fd, "", AT_EMPTY_PATH, mask, sx); sx is a struct statx. */
int kvt_sys_statx_fd(int fd, unsigned int mask, void *sx);

#if KVT_HAVE_LIBURING
#include <liburing.h>
/* liburing's calls: 0 or a negative errno, as liburing returns them. */
int kvt_sys_uring_init(unsigned entries, struct io_uring *ring, struct io_uring_params *p);
int kvt_sys_uring_register_buffers(struct io_uring *ring, const struct iovec *iov, unsigned n);
int kvt_sys_uring_register_files(struct io_uring *ring, const int *fds, unsigned n);
#endif

#endif
