/* SPDX-License-Identifier: MIT */
/* What the cmocka tests and the fuzz harnesses share (no cmocka here): open descriptors of this
 * process and what a test runs before it counts them, for leak checks; the CUDA backend's way
 * with spilled rows on the CPU's kernels. */
#ifndef KVT_TEST_HARNESS_H
#define KVT_TEST_HARNESS_H

#include <dirent.h>
#include <stdint.h>

#include "internal.h"

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

/*
 * Create one small cache and store a token in it (which maps and, where a GPU is present, pins a
 * host-tier extent), so that what the process keeps open for good afterwards (the CUDA runtime's
 * device descriptors and its context) is open before a test takes its baseline of descriptors.
 */
static inline void t_warm_runtime(void)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	cfg.n_q_heads = 1;
	cfg.n_kv_heads = 1;
	cfg.head_dim = 64;
	cfg.backend = KVT_BACKEND_CPU;
	cfg.host_bytes = 1u << 20;
	kvt_cache *c = NULL;
	uint16_t kv[64];
	uint32_t seq;
	for (int i = 0; i < 64; i++)
		kv[i] = 0x3c00; /* 1.0 */
	if (kvt_cache_create(&cfg, &c) < 0)
		return;
	if (kvt_seq_open(c, &seq) == 0)
		kvt_prefill(c, seq, 0, NULL, kv, kv, 1, NULL);
	kvt_cache_destroy(c);
}

/* Give c the CUDA backend's way with spilled rows on its own (the CPU's) kernels: a copy of its
 * ops with read_rows_spilled off, so that kvt_extend and kvt_seq_read_rows restore spilled
 * sequences first (lib/lifecycle.c's kvt_pipe_resident). One copy per test file. */
static inline void t_restore_first(kvt_cache *c)
{
	static struct kvt_backend_ops restoring;
	restoring = *c->ops;
	restoring.read_rows_spilled = false;
	c->ops = &restoring;
}

#endif
