/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* Detail of the last failed kvt_cache_create, per thread: there is no cache to hold it yet. */
static _Thread_local char create_err[512];

int kvt_seterr(kvt_cache *c, int code, const char *fmt, ...)
{
	char *buf = c ? c->err : create_err;
	size_t cap = c ? sizeof c->err : sizeof create_err;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, cap, fmt, ap);
	va_end(ap);
	if (c)
		c->st.errors++;
	return code;
}

KVT_API const char *kvt_last_error(const kvt_cache *cache)
{
	return cache ? cache->err : create_err;
}

KVT_API const char *kvt_strerror(int code)
{
	switch (code) {
	case 0: return "success";
	case -EINVAL: return "invalid argument";
	case -ENOMEM: return "out of memory";
	case -ENOSPC: return "capacity exceeded";
	case -EOPNOTSUPP: return "feature not built or not available";
	case -ENODEV: return "no GPU device";
	case -EIO: return "device or I/O failure";
	case -EBADMSG: return "checksum or header mismatch";
	case -ENOENT: return "no such sequence";
	default: return "unknown error code";
	}
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
