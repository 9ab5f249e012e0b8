/* SPDX-License-Identifier: MIT */
/*
 * What the fault tests of the NVMe tier share (test_tier_fault.c, which holds main and the
 * completion faults, and test_tier_fault_alloc.c): the shape, the rows given, one run's cache and
 * the calls and checks of the script.
 */
#ifndef KVT_TESTS_TIER_FAULT_H
#define KVT_TESTS_TIER_FAULT_H

#include "common.h"

#include "tier_util.h"

enum { D = 64, LAYERS = 2, NKV = 2, NQ = 4, TOKENS = 300, FIRST = 180, SPILL_BLOCKS = LAYERS * NKV };
/* 4 KiB chunks of one block: the least number of direct-serving reads of the script */
#define CHUNKS_PER_BLOCK (KVT_BLOCK_TOKENS * 2 * D * 2 / KVT_NVME_CHUNK)
#define ROW_BYTES ((uint64_t)2 * D * 2)
#define BLOCK_BYTES ((uint64_t)KVT_BLOCK_TOKENS * ROW_BYTES)
#define DUE ((int64_t)SPILL_BLOCKS * (int64_t)BLOCK_BYTES)

/* The rows given, [TOKENS, NKV, D] per layer, and gather buffers. */
typedef uint16_t rows_t[LAYERS][TOKENS * NKV * D];
extern rows_t g_k, g_v, g_k2, g_v2; /* two sequences' rows */
extern uint16_t g_gk[NKV * TOKENS * D], g_gv[NKV * TOKENS * D], g_q[NQ * D];
extern int32_t g_counts[NKV], g_pos[NKV * TOKENS];

/* One run: the cache, its sequence, and the case's name for messages. */
struct run {
	char name[160];
	kvt_cache *c;
	uint32_t seq;          /* the sequence checked */
	rows_t *sk, *sv;       /* its rows */
	tt_files f;
};

void make_data(uint64_t seed);

int prefill_layer(struct run *r, uint32_t seq, int l, rows_t *k, rows_t *v);

/* The run's configuration (r cleared, named): p = 1, queue depth qd (0: the library's), a 1 MiB
 * block cache, host_bytes of host tier, spill policy, and two fresh 4 MiB NVMe files the caller
 * unlinks (tt_unlink) once the cache is created. */
kvt_config run_config(struct run *r, const char *name, uint32_t qd, uint64_t host_bytes,
		      uint32_t policy);

/* A fresh cache with one sequence of TOKENS tokens on every layer. */
void run_open_cfg(struct run *r, const char *name, uint32_t qd, uint64_t host_bytes,
		  uint32_t policy);

void run_open(struct run *r, const char *name, uint32_t qd);

/* Blocks of the sequence whose valid copy is on NVMe (the cache's table). */
uint32_t on_nvme(const struct run *r);

int do_select(struct run *r, int l);

int do_gather(struct run *r, int l);

/* The gathered rows of layer l are every position, byte for byte the rows given. */
void expect_rows(struct run *r, int l, int rc, const char *what);

void check_all_layers(struct run *r, const char *what);

/* After an automatic spill: every layer of the run's sequence A (spilled, served in place), then of
 * sequence b, whose rows are g_k2 / g_v2 (the run now checks b). */
void check_a_spilled_then_b(struct run *r, uint32_t b);

/* The rewrites of a completion's result, and what the call meeting each returns (nvme_store.h): 0
 * where the store recovers. */
enum kind { K_EIO, K_EAGAIN, K_ECANCELED, K_ENOSPC, K_SHORT, K_ZERO, K_KINDS };
extern const char *const kind_name[K_KINDS];
extern const int kind_rc[K_KINDS];

struct hook_state {
	uint64_t n;      /* the completion to rewrite */
	enum kind kind;
	int fired, orig; /* whether it was reached, and the result it replaced */
};

/* The completion shim (kvt_nvme_set_cqe_hook): rewrites completion ctx->n as ctx->kind says. */
int hook(void *ctx, uint64_t nth, int res);

/* test_tier_fault_alloc.c */
void test_alloc_faults(void **state);
void test_auto_spill_alloc_faults(void **state);
void test_lru_failed_call_unspills(void **state);
void test_lru_undo_read_fails(void **state);
void test_lru_no_room_spills_nothing(void **state);

#endif
