/* SPDX-License-Identifier: MIT */
#include <stdio.h>

#include "err.h"

int kvt_err_setv(struct kvt_err *e, int code, const char *fmt, va_list ap)
{
	if (e) {
		vsnprintf(e->msg, sizeof e->msg, fmt, ap);
		e->item = -1;
	}
	return code;
}

int kvt_err_set(struct kvt_err *e, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	kvt_err_setv(e, code, fmt, ap);
	va_end(ap);
	return code;
}
