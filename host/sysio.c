/* SPDX-License-Identifier: MIT */
/* The fail-Nth seam of the store's file-system and io_uring set-up calls (sysio.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvt_config.h"
#include "sysio.h"

static atomic_uint_fast64_t fail_at, attempts;
static atomic_int fail_errno, fired_call;

static const char *const call_name[KVT_SYS_NCALLS] = {
	"none",  "open",           "fstat",         "ftruncate",  "fallocate",
	"statx", "io_uring_setup", "io_uring_register_buffers", "io_uring_register_files",
};

const char *kvt_sys_call_name(enum kvt_sys_call call)
{
	return (unsigned)call < KVT_SYS_NCALLS ? call_name[call] : "?";
}

/* Counts an attempt of `call`; the errno to fail it with when the injected failure is due, or 0. */
static int inject(enum kvt_sys_call call)
{
	uint64_t n = atomic_fetch_add(&attempts, 1) + 1;
	uint64_t target = atomic_load(&fail_at);
	if (!target || n != target)
		return 0;
	atomic_store(&fired_call, (int)call);
	return atomic_load(&fail_errno);
}

void kvt_sys_fail_at(uint64_t n, int err)
{
	atomic_store(&attempts, 0);
	atomic_store(&fired_call, KVT_SYS_NONE);
	atomic_store(&fail_errno, err > 0 ? err : EIO);
	atomic_store(&fail_at, n);
}

uint64_t kvt_sys_attempts(void)
{
	return atomic_load(&attempts);
}

enum kvt_sys_call kvt_sys_fired_call(void)
{
	return (enum kvt_sys_call)atomic_load(&fired_call);
}

#define INJECT_ERRNO(call)                                                                         \
	do {                                                                                       \
		int e_ = inject(call);                                                             \
		if (e_) {                                                                          \
			errno = e_;                                                                \
			return -1;                                                                 \
		}                                                                                  \
	} while (0)

int kvt_sys_open(const char *path, int flags, mode_t mode)
{
	INJECT_ERRNO(KVT_SYS_OPEN);
	return open(path, flags, mode);
}

int kvt_sys_fstat(int fd, struct stat *sb)
{
	INJECT_ERRNO(KVT_SYS_FSTAT);
	return fstat(fd, sb);
}

int kvt_sys_ftruncate(int fd, off_t bytes)
{
	INJECT_ERRNO(KVT_SYS_FTRUNCATE);
	return ftruncate(fd, bytes);
}

int kvt_sys_fallocate(int fd, int mode, off_t offset, off_t bytes)
{
	INJECT_ERRNO(KVT_SYS_FALLOCATE);
	return fallocate(fd, mode, offset, bytes);
}

int kvt_sys_statx_fd(int fd, unsigned int mask, void *sx)
{
	INJECT_ERRNO(KVT_SYS_STATX);
	return statx(fd, "", AT_EMPTY_PATH, mask, (struct statx *)sx);
}

#if KVT_HAVE_LIBURING
int kvt_sys_uring_init(unsigned entries, struct io_uring *ring, struct io_uring_params *p)
{
	int e = inject(KVT_SYS_URING_SETUP);
	return e ? -e : io_uring_queue_init_params(entries, ring, p);
}

int kvt_sys_uring_register_buffers(struct io_uring *ring, const struct iovec *iov, unsigned n)
{
	int e = inject(KVT_SYS_URING_REG_BUFFERS);
	return e ? -e : io_uring_register_buffers(ring, iov, n);
}

int kvt_sys_uring_register_files(struct io_uring *ring, const int *fds, unsigned n)
{
	int e = inject(KVT_SYS_URING_REG_FILES);
	return e ? -e : io_uring_register_files(ring, fds, n);
}
#endif
