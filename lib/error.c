/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* Detail of the last failed kvt_cache_create, per thread: there is no cache to hold it yet. */
static _Thread_local char create_err[KVT_ERR_TEXT];

__attribute__((format(printf, 3, 0)))
static void set_text(kvt_cache *c, bool count, const char *fmt, va_list ap)
{
	if (c && c->err_mute)
		return;
	char *buf = c ? c->err : create_err;
	size_t cap = c ? sizeof c->err : sizeof create_err;
	vsnprintf(buf, cap, fmt, ap);
	if (c && count) {
		c->st.errors++;
		c->err_entry = -1;
	}
}

int kvt_seterr(kvt_cache *c, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	set_text(c, true, fmt, ap);
	va_end(ap);
	return code;
}

int kvt_err_wrap(kvt_cache *c, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	set_text(c, false, fmt, ap);
	va_end(ap);
	return code;
}

void kvt_err_mute(kvt_cache *c, bool on)
{
	c->err_mute += on ? 1u : (uint32_t)-1;
}

int kvt_err_entry(kvt_cache *c, uint32_t i, int rc)
{
	if (!c->err_mute)
		c->err_entry = (int32_t)i;
	return rc;
}

KVT_API int kvt_last_error_entry(const kvt_cache *cache)
{
	return cache ? cache->err_entry : -1;
}

KVT_API const char *kvt_last_error(const kvt_cache *cache)
{
	return cache ? cache->err : create_err;
}

/* Every code of the header's convention block. tests/abi_strerror.py checks that the sources
 * return no code missing here and that this table and the header list the same codes. */
static const struct {
	int code;
	const char *text;
} texts[] = {
	{0, "success"},
	{-EINVAL, "invalid argument"},
	{-ENOMEM, "out of memory"},
	{-ENOSPC, "capacity exceeded"},
	{-EOPNOTSUPP, "feature not built or not available"},
	{-ENODEV, "no GPU device"},
	{-EIO, "device or I/O failure"},
	{-EBADMSG, "checksum or header mismatch"},
	{-ENOENT, "no such sequence"},
	{-E2BIG, "more tokens than the selection handles"},
	{-EMFILE, "out of file descriptors in this process (RLIMIT_NOFILE)"},
	{-ENFILE, "out of file descriptors in the system"},
	/* what an NVMe I/O completion may report, passed on with the file and offset as detail */
	{-ECANCELED, "I/O canceled"},
	{-EAGAIN, "I/O resources temporarily unavailable"},
	{-EINTR, "I/O interrupted"},
	{-EBUSY, "I/O device busy, or NVMe file held by another cache"},
	{-ETIMEDOUT, "I/O timed out"},
	{-ETIME, "I/O exceeded its time limit"},
	{-ENODATA, "medium error on the NVMe device"},
	{-ENOLINK, "transport error reaching the NVMe device"},
	{-EREMOTEIO, "NVMe target error"},
	{-EILSEQ, "NVMe data protection error"},
	{-EBADE, "NVMe reservation conflict"},
	{-EFBIG, "NVMe file too large"},
	{-EROFS, "NVMe file system read-only"},
	{-EBADF, "bad NVMe file descriptor"},
	{-EFAULT, "bad I/O buffer address"},
	{-EOVERFLOW, "I/O offset overflow"},
	{-ENXIO, "NVMe device gone"},
};

KVT_API const char *kvt_strerror(int code)
{
	for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
		if (texts[i].code == code)
			return texts[i].text;
	return "unknown error code";
}

int kvt_out_size_check(kvt_cache *c, const char *what, size_t size, size_t min)
{
	KVT_RETURN_IF(size < min, c, -EINVAL,
		      "%s->size = %zu, must be >= %zu (the first release's size; set it to sizeof of "
		      "the struct)", what, size, min);
	return 0;
}

void kvt_out_fill(void *dst, const void *src, size_t src_size)
{
	size_t size;
	memcpy(&size, dst, sizeof size);
	const size_t n = size < src_size ? size : src_size;
	memcpy((char *)dst + sizeof size, (const char *)src + sizeof size, n - sizeof size);
	if (size > src_size)
		memset((char *)dst + src_size, 0, size - src_size);
}

KVT_API unsigned kvt_version_number(void)
{
	return KVT_VERSION_NUMBER;
}

#define KVT_STR2(x) #x
#define KVT_STR(x) KVT_STR2(x)

KVT_API const char *kvt_version_string(void)
{
	return KVT_STR(KVT_VERSION_MAJOR) "." KVT_STR(KVT_VERSION_MINOR) "." KVT_STR(KVT_VERSION_PATCH);
}

uint64_t kvt_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
