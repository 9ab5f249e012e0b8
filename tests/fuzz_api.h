/* SPDX-License-Identifier: MIT */
/*
 * What the files of the fuzz target fuzz_api share (fuzz_api.c, which holds the configuration, the
 * input bytes, the basic calls and the entry point; fuzz_api_lifecycle.c, truncate, fork and the
 * row transfer; fuzz_api_io.c, the io layouts, the _at forms and extend): the check, the input,
 * the target's state, the helpers that make values and buffers, and the length snapshots.
 */
#ifndef KVT_TESTS_FUZZ_API_H
#define KVT_TESTS_FUZZ_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvtier.h"

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "fuzz_api: %s: ", #cond);                                  \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, "\n");                                                     \
			abort();                                                                   \
		}                                                                                  \
	} while (0)

#define MAXS 4
#define MAXT 48

/* The input: its bytes, their number and the next one's offset. */
struct in {
	const uint8_t *p;
	size_t n, at;
};

/* The next input byte, 0 past the end. */
uint8_t byte(struct in *in);

/* The target's state: the cache, its configuration, the ids to pick from, the value generator. */
struct fz {
	kvt_cache *c;
	kvt_config cfg;
	uint32_t esz, osz; /* bytes per element of K/V/q and of the output */
	uint32_t ids[8];   /* ids handed out (open or closed) and a few never handed out */
	uint32_t n_ids;
	uint64_t rng;
	uint64_t fail_at; /* the allocation the next checked call is made to fail (1-based), 0: none */
	uint64_t io_fail_at; /* the NVMe completion (counted from when it was armed) made to fail */
	bool io_fired;       /* and it has failed, in the call now checked */
	bool faults;      /* the configuration turned allocation (and I/O) faults on */
	bool nvme;        /* and asked for an NVMe tier */
	bool restore_first; /* and the CUDA backend's way: kvt_extend and read_rows restore first */
	bool forked;        /* a kvt_seq_fork was tried: host blocks may be shared since */
	const char *nvme_path;
	uint64_t nvme_bytes;
	kvt_stats before; /* kvt_get_stats right before the call now checked */
	/* the batch of the call now checked: its entries (0: a call without one) and its ids (NULL:
	 * none, or not a uint32_t array); set by fz_batch before it, cleared by check_call */
	uint32_t batch_n;
	const uint32_t *batch;
};

/* Right before a library call: its kvt_stats.errors (all of them in z->before), and z->fail_at
 * armed. */
uint64_t call_begin(struct fz *z);
/* Right after it: disarm z->fail_at, and abort unless rc is success or a code of the header's
 * list with a kvt_last_error text, unless a failed call's kvt_last_error_entry is -1 or an entry
 * of its batch (fz_batch; one that is not open where the call returned -ENOENT), unless the call
 * counted one error in kvt_stats.errors when it
 * failed and none when it succeeded (errors0: call_begin's), and unless a failed call left the
 * host and NVMe tiers' use as they were (but where it spilled for good: an undo whose read-back
 * failed; or, restoring first, where it kept its restores); returns rc. */
int64_t check_call(struct fz *z, const char *call, uint64_t errors0, int64_t rc);
/* The batch of the next checked call, for its kvt_last_error_entry check. */
static inline void fz_batch(struct fz *z, const uint32_t *seqs, uint32_t n)
{
	z->batch = seqs;
	z->batch_n = n;
}

/* Make the library call `expr` between call_begin and check_call; its result. */
#define FZ_CALL(z, call, expr)                                                                     \
	__extension__({                                                                            \
		const uint64_t fz_errors0_ = call_begin(z);                                        \
		check_call((z), (call), fz_errors0_, (expr));                                      \
	})

/* Elements of n values in the cache's dtype: normal-ish, large, zero, or with one NaN/infinity. */
void *values(struct fz *z, size_t n, uint8_t mode);

/* A sequence id: mostly one handed out (or never handed out), else any byte. */
uint32_t pick_seq(struct fz *z, struct in *in);

/* kvt_seq_length of seq on layer. */
int64_t length(struct fz *z, uint32_t seq, uint32_t layer);

/* A batch of 1..4 sequence ids (duplicates and unknown ids possible). */
uint32_t batch(struct fz *z, struct in *in, uint32_t *seqs);

#define SNAP_IDS 16 /* ids 0..15: every id a cache of max_seqs <= 4 hands out, and a few others */

/* The length of every id on every layer (a negative code for an id not open). */
struct snap {
	int64_t len[SNAP_IDS][2];
};

/* Every id's length on every layer into s. */
void snap(struct fz *z, struct snap *s);

/* Every length as `want` says, or abort naming the call, its return and the first difference. */
void expect(struct fz *z, const struct snap *want, const char *call, int64_t rc);

/* Add delta to the length of seq on `layer` (all layers when layer is UINT32_MAX). */
void grow(struct fz *z, struct snap *s, uint32_t seq, uint32_t layer, int64_t delta);

/* Bytes set to a pattern, to see which the library wrote. */
#define PAT 0xa5

/* An allocation of `bytes` set to PAT (abort when there is no memory). */
void *patterned(size_t bytes);

/* A copy of a struct in an allocation of exactly the `size` it claims (at least its size field,
 * zeros past the struct), so that a read past what the size covers is seen. */
void *sized(const void *s, size_t have, uint32_t size);

/* A struct size: its own mostly, else too small or larger (zeros past it). */
uint32_t pick_size(uint8_t b, uint32_t own);

#define EXT_CAP ((uint64_t)1 << 22) /* elements: larger valid views are not tried */

/* The lifecycle calls and the row transfer (fuzz_api_lifecycle.c). */
void do_truncate(struct fz *z, struct in *in);
void do_fork(struct fz *z, struct in *in);
void do_read_rows(struct fz *z, struct in *in);
void do_write_rows(struct fz *z, struct in *in);

/* The _at forms of prefill, append, attend and select, and extend (fuzz_api_io.c). */
void do_compute_at(struct fz *z, struct in *in);
void do_extend(struct fz *z, struct in *in);
void do_attend_graph(struct fz *z, struct in *in);

#endif
