/* SPDX-License-Identifier: MIT */
/*
 * Helper of tests/abi_strerror.py: prints "CODE<TAB>TEXT" for every code in [-4095, 0] to which
 * the shared library's kvt_strerror gives a text of its own, and the fallback text last as
 * "unknown<TAB>TEXT" (read from a positive code, which is never an error code).
 */
#include <stdio.h>
#include <string.h>

#include "kvtier.h"

int main(void)
{
	const char *unknown = kvt_strerror(1);
	for (int code = 0; code >= -4095; code--) {
		const char *t = kvt_strerror(code);
		if (!t)
			return 1;
		if (strcmp(t, unknown))
			printf("%d\t%s\n", code, t);
	}
	printf("unknown\t%s\n", unknown);
	return 0;
}
