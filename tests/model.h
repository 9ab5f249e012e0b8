/* SPDX-License-Identifier: MIT */
/*
 * What the files of test_model share (test_model.c, which holds the injected faults, the two
 * caches, the run of a seed and main; model_ops.c, the operations): the shape, the model of the
 * sequences, the check that stops a seed, and the fault an operation arms around its call to T.
 */
#ifndef KVT_TESTS_MODEL_H
#define KVT_TESTS_MODEL_H

#include "common.h"
#include "host/nvme_store.h"
#include "nvme_util.h"

#define NL 2
#define NQ 4
#define NKV 2
#define D 64
#define MAXS 4
#define CAP 2000 /* tokens per sequence and layer the model keeps */
#define ROW (NKV * D)
#define QROW (NQ * D)

enum op {
	OP_OPEN, OP_CLOSE, OP_PREFILL, OP_APPEND, OP_ATTEND, OP_SELECT, OP_SPILL, OP_RESTORE,
	OP_FORK, OP_TRUNCATE, OP_EXTEND, OP_READ, OP_WRITE, OP_NOPS
};

/* The operations' names, for messages and the summary. */
extern const char *const op_name[OP_NOPS];

/* Counters of the tiered cache that a failed call must leave as they were. */
struct tstate {
	uint64_t spills, restores, auto_spills, host_bytes_used, nvme_bytes_used;
};

/* A sequence as the model sees it: its rows per layer, decoded (for the exact attention). */
struct mseq {
	int open;
	uint32_t id;
	uint32_t len[NL];
	float *k[NL], *v[NL]; /* [CAP, NKV, D] */
};

/* The tiered cache T, the reference R, the model of their sequences, and the seed's counts. */
struct model {
	t_rng r;
	uint32_t dtype;
	float p;
	kvt_cache *t, *ref;
	int lru;		/* T spills automatically (KVT_SPILL_LRU) from a small host tier */
	int restore_first;	/* T restores spilled sequences before extend and read_rows read
				   them (the CUDA backend's way: ops->read_rows_spilled off) */
	bool forked;		/* a fork was tried: host blocks may be shared since (t_accounts) */
	struct tstate pre;	/* T's counters before the call under a fault (arm) */
	nv_files f;
	struct mseq s[MAXS];
	uint64_t seed, step;
	/* counts for the summary */
	uint64_t ops[OP_NOPS], faults_fired, faults_failed, faults_recovered, exact_checks;
	uint64_t host_full; /* calls refused by the small host tier of a KVT_SPILL_LRU seed */
	uint64_t restores_kept; /* failed calls of a restoring seed that kept their restores */
	uint64_t victims_stayed; /* failed calls whose undo left a victim spilled */
};

extern int g_fail; /* a mismatch was found: stop the seed */
extern int g_all;  /* batches take every open sequence (the check after a failed call) */

#define M_CHECK(m, cond, ...)                                                                      \
	do {                                                                                       \
		if (!(cond) && !g_fail) {                                                          \
			print_error("%s:%d: seed %llu step %llu: check failed: %s\n    ", __FILE__,    \
				    __LINE__, (unsigned long long)(m)->seed,                       \
				    (unsigned long long)(m)->step, #cond);                         \
			print_error(__VA_ARGS__);                                                  \
			print_error("\n    replay: test_model --seed %llu --steps %llu\n",          \
				    (unsigned long long)(m)->seed,                                 \
				    (unsigned long long)(m)->step + 1);                            \
			g_fail = 1;                                                                \
		}                                                                                  \
	} while (0)

enum fkind { F_NONE, F_MEM, F_EIO, F_ECANCELED, F_ENOSPC, F_EAGAIN, F_SHORT, F_NKINDS };

/* The fault injected into one call to T: its kind, the Nth allocation or completion it rewrites,
 * and whether it fired. */
struct fault {
	enum fkind kind;
	uint64_t n;
	int fired;
};

/* Before a call to T: its counters noted (m->pre) and, a quarter of the time, a random fault
 * armed. */
void arm(struct model *m, struct fault *f);

/* After the call: the fault taken away, counted when it fired. */
void disarm(struct model *m, struct fault *f);

/* Judge T's result under fault f. Returns 1 when R must run the call too (no fault reached, or T
 * recovered), 0 when T failed as documented (R skips the call: it must be as if never made). */
int judge(struct model *m, const struct fault *f, enum op op, int64_t rc);

/* The operations (model_ops.c): each draws its arguments, makes its call on T (most under an
 * armed fault) and, unless it is T's alone or judge says otherwise, on R, and compares the results
 * and the model. The buffers are the caller's scratch space (struct bufs of test_model.c). */

/* A random open sequence's slot, or -1. */
int pick_open(struct model *m);

void op_open(struct model *m);
void op_close(struct model *m);
void op_prefill(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v);
void op_append(struct model *m, uint16_t *k, uint16_t *v);
void op_attend(struct model *m, uint16_t *q, float *qd, float *ot, float *orf);
void op_select(struct model *m, uint16_t *q, uint16_t *kt, uint16_t *vt, uint16_t *kr,
	       uint16_t *vr, int32_t *pt, int32_t *pr);
/* Spill (op OP_SPILL) or restore (OP_RESTORE) a random open sequence of T. */
void op_tier(struct model *m, enum op op);
void op_fork(struct model *m);
void op_truncate(struct model *m);
void op_extend(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v, float *ot, float *orf);
void op_read(struct model *m, uint16_t *kt, uint16_t *vt, uint16_t *kr, uint16_t *vr);
void op_write(struct model *m, uint16_t *k, uint16_t *v);

#endif
