/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the NVMe store tests (test_nvme.c, test_nvme_fault.c): scratch files on the
 * local disk, random blocks, open-descriptor counting, and the skip when io_uring is refused.
 */
#ifndef KVT_TEST_NVME_UTIL_H
#define KVT_TEST_NVME_UTIL_H

#include <fcntl.h>
#include <unistd.h>

#include "common.h"
#include "harness.h"
#include "host/nvme_store.h"

#define NV_MAX_FILES 4

/* The detail of the last failed store call of a test (every call passes &nv_err). */
static struct kvt_err nv_err __attribute__((unused));

/* Scratch files for one store: created by mkstemp, unlinked as soon as the store holds them. */
typedef struct nv_files {
	char paths[NV_MAX_FILES][4096];
	const char *ptrs[NV_MAX_FILES];
	uint64_t bytes[NV_MAX_FILES];
	uint32_t n;
} nv_files;

/*
 * The directory for scratch files: $KVT_TEST_DIR, else the directory of the test executable (the
 * build tree, whatever the current directory: never the source tree, and on the real disk where
 * /tmp may be tmpfs without O_DIRECT), else $TMPDIR, else /tmp.
 */
static inline const char *nv_dir(void)
{
	static char exe_dir[4096];
	const char *d = getenv("KVT_TEST_DIR");
	if (d && d[0])
		return d;
	if (!exe_dir[0]) {
		ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof exe_dir - 1);
		exe_dir[n > 0 ? n : 0] = 0;
		char *slash = strrchr(exe_dir, '/');
		if (slash && slash != exe_dir)
			*slash = 0;
		else
			exe_dir[0] = 0;
	}
	if (exe_dir[0] && access(exe_dir, W_OK) == 0)
		return exe_dir;
	d = getenv("TMPDIR");
	return d && d[0] ? d : "/tmp";
}

static inline void nv_make_files(nv_files *f, const char *dir, uint32_t n, uint64_t bytes)
{
	memset(f, 0, sizeof *f);
	f->n = n;
	for (uint32_t i = 0; i < n; i++) {
		snprintf(f->paths[i], sizeof f->paths[i], "%s/kvt-nvme-test-XXXXXX", dir);
		int fd = mkstemp(f->paths[i]);
		T_CHECK(fd >= 0, "mkstemp in %s: %s", dir, strerror(errno));
		close(fd);
		f->ptrs[i] = f->paths[i];
		f->bytes[i] = bytes;
	}
}

static inline void nv_unlink(nv_files *f)
{
	for (uint32_t i = 0; i < f->n; i++)
		if (f->paths[i][0])
			unlink(f->paths[i]);
}

/*
 * Open a store over fresh scratch files (unlinked right away) or fail the test with the detail.
 * With keep_fd, the first file is also opened read-write there (before the unlink), for tests that
 * alter the file behind the store's back.
 */
static inline struct kvt_nvme *nv_open_ex(nv_files *f, const char *dir, uint32_t n_files,
					  uint64_t bytes, uint32_t qd, uint32_t bounce,
					  uint32_t flags, int *keep_fd)
{
	nv_make_files(f, dir, n_files, bytes);
	if (keep_fd) {
		*keep_fd = open(f->paths[0], O_RDWR | O_CLOEXEC);
		T_CHECK(*keep_fd >= 0, "open %s: %s", f->paths[0], strerror(errno));
	}
	struct kvt_nvme_config cfg = {f->ptrs, f->bytes, n_files, qd, bounce, flags};
	struct kvt_nvme *st = NULL;
	struct kvt_err err;
	int rc = kvt_nvme_open(&cfg, &st, &err);
	nv_unlink(f);
	T_CHECK(rc == 0 && st,
		"kvt_nvme_open(%u files of %llu bytes, qd %u, bounce %u) in %s: got %d "
		"(%s), wanted 0",
		n_files, (unsigned long long)bytes, qd, bounce, dir, rc, err.msg);
	return st;
}

static inline struct kvt_nvme *nv_open(nv_files *f, const char *dir, uint32_t n_files,
				       uint64_t bytes, uint32_t qd, uint32_t bounce)
{
	return nv_open_ex(f, dir, n_files, bytes, qd, bounce, 0, NULL);
}

/* Exit 77 (meson's skip) when this kernel or build has no io_uring. */
static inline void nv_skip_unless_available(void)
{
	struct kvt_err why;
	if (!kvt_nvme_available(&why)) {
		printf("SKIP: NVMe tier unavailable: %s\n", why.msg);
		exit(77);
	}
}

/* A random identity of a block with n_tokens rows of head_dim. */
static inline struct kvt_nvme_block_id nv_id(t_rng *r, uint32_t n_tokens, uint32_t head_dim)
{
	struct kvt_nvme_block_id id;
	memset(&id, 0, sizeof id);
	id.seq = t_next(r) % 1000;
	id.generation = 1 + t_next(r) % 7;
	id.first_token = t_next(r) % 100000;
	id.n_tokens = n_tokens;
	id.layer = t_below(r, 80);
	id.kv_head = t_below(r, 8);
	id.head_dim = head_dim;
	id.flags = (uint16_t)t_below(r, 2);
	return id;
}

/* n random payload bytes (malloc'd). */
static inline unsigned char *nv_random_payload(t_rng *r, size_t n)
{
	unsigned char *p = (unsigned char *)t_alloc(n);
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		uint64_t x = t_next(r);
		memcpy(p + i, &x, 8);
	}
	for (; i < n; i++)
		p[i] = (unsigned char)t_next(r);
	return p;
}

#endif
