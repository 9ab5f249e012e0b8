/* SPDX-License-Identifier: MIT */
/* What the cmocka tests and the fuzz harnesses share (no cmocka here): open descriptors of this
 * process and what a test runs before it counts them, for leak checks; the CUDA backend's way
 * with spilled rows on the CPU's kernels; the accounts' agreement with the lengths. */
#ifndef KVT_TEST_HARNESS_H
#define KVT_TEST_HARNESS_H

#include <dirent.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

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

/*
 * The accounts a scheduler reads agree with the lengths (fuzz_api and test_model check it after
 * every call): kvt_get_capacity counts the open sequences; each open sequence holds one block per
 * started block_tokens of each layer and KV head, in the host tier or on NVMe, the NVMe ones at
 * most kvt_footprint_of's block (which counts a 4 KiB I/O alignment: the tests' files lie on
 * filesystems aligned to 512 bytes to 4 KiB); each tier's use is what the open sequences hold,
 * each block once (after a fork, `shared`, at most: a block shared with a fork counts in each
 * holder's kvt_seq_bytes); kvt_get_stats reports the same use as kvt_get_capacity. Returns 0, or
 * -1 with what differs in why.
 */
static inline int t_accounts(kvt_cache *c, bool shared, char *why, size_t n)
{
	kvt_capacity cap = {.size = sizeof cap};
	kvt_footprint fp = {.size = sizeof fp};
	kvt_stats st = {.size = sizeof st};
	if (kvt_get_capacity(c, &cap) != 0 || kvt_footprint_of(&c->cfg, 0, &fp) != 0 ||
	    kvt_get_stats(c, &st) != 0) {
		snprintf(why, n, "an accounting call failed: %s", kvt_last_error(c));
		return -1;
	}
	if (cap.host_bytes_free > cap.host_bytes_capacity ||
	    cap.nvme_bytes_free > cap.nvme_bytes_capacity || cap.max_seqs != c->cfg.max_seqs ||
	    !cap.block_tokens || cap.block_bytes != fp.block_bytes ||
	    fp.nvme_block_bytes <= fp.block_bytes) {
		snprintf(why, n, "kvt_get_capacity: host %llu free of %llu, NVMe %llu of %llu, %u "
			 "sequences at most, blocks of %llu (kvt_footprint_of: %llu, NVMe %llu)",
			 (unsigned long long)cap.host_bytes_free,
			 (unsigned long long)cap.host_bytes_capacity,
			 (unsigned long long)cap.nvme_bytes_free,
			 (unsigned long long)cap.nvme_bytes_capacity, cap.max_seqs,
			 (unsigned long long)cap.block_bytes, (unsigned long long)fp.block_bytes,
			 (unsigned long long)fp.nvme_block_bytes);
		return -1;
	}
	uint64_t held = 0, held_nvme = 0;
	uint32_t open = 0;
	for (uint32_t s = 0; s < cap.max_seqs; s++) {
		uint64_t host = 0, nvme = 0, blocks = 0;
		if (kvt_seq_bytes(c, s, &host, &nvme) != 0)
			continue; /* not open */
		open++;
		for (uint32_t l = 0; l < c->cfg.n_layers; l++) {
			const int64_t len = kvt_seq_length(c, s, l);
			if (len < 0) {
				snprintf(why, n, "sequence %u: kvt_seq_bytes answers, its length on "
					 "layer %u is %lld", s, l, (long long)len);
				return -1;
			}
			blocks += ((uint64_t)len + cap.block_tokens - 1) / cap.block_tokens *
				  c->cfg.n_kv_heads;
		}
		const uint64_t in_host = host / cap.block_bytes;
		const uint64_t spilled = blocks - (in_host < blocks ? in_host : blocks);
		if (host % cap.block_bytes || in_host > blocks || (nvme > 0) != (spilled > 0) ||
		    nvme > spilled * fp.nvme_block_bytes || (nvme && !c->cfg.n_nvme)) {
			snprintf(why, n, "sequence %u holds %llu host bytes (blocks of %llu) and "
				 "%llu NVMe bytes (blocks of at most %llu) for %llu blocks", s,
				 (unsigned long long)host, (unsigned long long)cap.block_bytes,
				 (unsigned long long)nvme, (unsigned long long)fp.nvme_block_bytes,
				 (unsigned long long)blocks);
			return -1;
		}
		held += host;
		held_nvme += nvme;
	}
	const uint64_t used = cap.host_bytes_capacity - cap.host_bytes_free;
	const uint64_t used_nvme = cap.nvme_bytes_capacity - cap.nvme_bytes_free;
	if (open != cap.seqs_open || (shared ? used > held : used != held) ||
	    (shared ? used_nvme > held_nvme : used_nvme != held_nvme)) {
		snprintf(why, n, "%u sequences answer kvt_seq_bytes, kvt_get_capacity counts %u "
			 "open; they hold %llu host and %llu NVMe bytes, the tiers use %llu and "
			 "%llu%s", open, cap.seqs_open, (unsigned long long)held,
			 (unsigned long long)held_nvme, (unsigned long long)used,
			 (unsigned long long)used_nvme, shared ? " (after a fork)" : "");
		return -1;
	}
	if (st.seqs_open != cap.seqs_open || st.host_bytes_used != used ||
	    st.host_bytes_capacity != cap.host_bytes_capacity || st.nvme_bytes_used != used_nvme ||
	    st.nvme_bytes_capacity != cap.nvme_bytes_capacity) {
		snprintf(why, n, "kvt_get_stats: %llu open, host %llu of %llu, NVMe %llu of %llu; "
			 "kvt_get_capacity: %u open, host %llu of %llu, NVMe %llu of %llu",
			 (unsigned long long)st.seqs_open, (unsigned long long)st.host_bytes_used,
			 (unsigned long long)st.host_bytes_capacity,
			 (unsigned long long)st.nvme_bytes_used,
			 (unsigned long long)st.nvme_bytes_capacity, cap.seqs_open,
			 (unsigned long long)used, (unsigned long long)cap.host_bytes_capacity,
			 (unsigned long long)used_nvme, (unsigned long long)cap.nvme_bytes_capacity);
		return -1;
	}
	return 0;
}

#endif
