/* SPDX-License-Identifier: MIT */
/* Open descriptors of this process, for leak checks (no cmocka: the fuzz harnesses use it too). */
#ifndef KVT_TEST_FD_COUNT_H
#define KVT_TEST_FD_COUNT_H

#include <dirent.h>

static inline int t_fd_count(void)
{
	DIR *d = opendir("/proc/self/fd");
	int n = 0;
	if (!d)
		return -1;
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n - 1; /* the descriptor of the listing itself */
}

#endif
