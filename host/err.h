/* SPDX-License-Identifier: MIT */
/*
 * The one way host/ reports the detail of a failure: every host/ function that can fail takes a
 * `struct kvt_err *` (NULL when the caller wants only the code) and, when it returns a negative
 * code, has written there what failed, with the value and the limit. lib/ forwards the text into
 * kvt_last_error with kvt_seterr(c, rc, "<what lib/ was doing>: %s", e.msg). Nothing is kept in the
 * objects, so a failed call on one store never overwrites the detail of another caller's failure.
 */
#ifndef KVT_ERR_H
#define KVT_ERR_H

#include <stdarg.h>
#include <stdint.h>

struct kvt_err {
	char msg[512];
	int64_t item; /* the call's item at fault (a request's index), -1 when none is known; every
			 kvt_err_set resets it, the caller that knows the item sets it after */
};

/* Write the detail (printf format) into e, unless e is NULL, and return code. */
int kvt_err_set(struct kvt_err *e, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
int kvt_err_setv(struct kvt_err *e, int code, const char *fmt, va_list ap)
	__attribute__((format(printf, 3, 0)));

#endif
