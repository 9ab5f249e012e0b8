/* SPDX-License-Identifier: MIT */
/*
 * Model-based random-operation test (RocksDB's db_stress): random sequences of open, close,
 * prefill, append, attend, select and gather, spill and restore, fork, truncate, extend (a varlen
 * batch of 1-3 sequences with 0-5 new tokens each), read_rows (a random range) and write_rows (a few
 * rows at the end) run on a tiered cache T (CPU backend, an NVMe tier) and on a reference R of the
 * same configuration without NVMe and with ample host memory. Every other pair of seeds runs T with
 * KVT_SPILL_LRU and a host tier of HOST_BLOCKS blocks, too small for the seed's sequences: calls
 * spill others to NVMe on their own (automatic spills, undone when the call fails). Every third
 * seed corrects its scores from exact logits (correction_steps 1-8, on both caches). The tier does
 * not change the math, so every result must match bit for bit: return codes, sequence ids,
 * lengths, attention and extend outputs, selection sizes, gathered counts, positions and rows, rows
 * read. At p = 1 every indexed token is selected, so attention must also equal exact
 * attention over every token the model holds, computed here in double precision, and every gather
 * holds every token.
 *
 * Faults are injected into T's calls only: the Nth allocation (kvt_mem_fail_at) or the Nth io_uring
 * completion rewritten to an error or a short count (the hook of tests/test_tier_fault.c). A call
 * that fails with an injected fault must return a documented code and change nothing: R does not
 * run that call, T's spill, restore and automatic-spill counts and its host and NVMe bytes are as
 * before it, and every later result (and an attend over every sequence right after the failure)
 * must still match R's. A call of a KVT_SPILL_LRU seed that needs more host tier than spilling can
 * free is refused (-ENOSPC, "host tier") and is judged alike. A call that recovers from the fault (a
 * resubmitted short read) must give R's result. At the end of each seed, with every sequence
 * closed, no host or NVMe bytes may be left in use; at the end nothing may leak (allocations,
 * descriptors).
 *
 * Usage: test_model [--long] [--seeds N] [--seed S] [--steps N]. Default: a CI-sized run (suite
 * unit, 32 seeds); --long runs 250 seeds (suite slow). KVT_MODEL_SEEDS sets the seed count too.
 * A failure prints the seed and step, and --seed S --steps N replays it.
 */
#include <unistd.h>

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
#ifndef HOST_BLOCKS
#define HOST_BLOCKS 20 /* KVT_SPILL_LRU seeds: host-tier blocks (256 tokens of a KV head, 64 KiB) */
#endif

enum op {
	OP_OPEN, OP_CLOSE, OP_PREFILL, OP_APPEND, OP_ATTEND, OP_SELECT, OP_SPILL, OP_RESTORE,
	OP_FORK, OP_TRUNCATE, OP_EXTEND, OP_READ, OP_WRITE, OP_NOPS
};
static const char *const op_name[OP_NOPS] = {
	"open",	 "close", "prefill",  "append", "attend",    "select",	   "spill",
	"restore", "fork",  "truncate", "extend", "read_rows", "write_rows"};

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

struct model {
	t_rng r;
	uint32_t dtype;
	float p;
	kvt_cache *t, *ref;
	int lru;		/* T spills automatically (KVT_SPILL_LRU) from a small host tier */
	struct tstate pre;	/* T's counters before the call under a fault (arm) */
	nv_files f;
	struct mseq s[MAXS];
	uint64_t seed, step;
	/* counts for the summary */
	uint64_t ops[OP_NOPS], faults_fired, faults_failed, faults_recovered, exact_checks;
	uint64_t host_full; /* calls refused by the small host tier of a KVT_SPILL_LRU seed */
};

static int g_fail; /* a mismatch was found: stop the seed */
static int g_all;  /* batches take every open sequence (the check after a failed call) */

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

/* ---- injected faults ------------------------------------------------------------------------ */

enum fkind { F_NONE, F_MEM, F_EIO, F_ECANCELED, F_ENOSPC, F_EAGAIN, F_SHORT, F_NKINDS };
static const char *const fkind_name[F_NKINDS] = {"none",     "allocation", "-EIO",  "-ECANCELED",
						 "-ENOSPC",  "-EAGAIN",    "short"};

struct fault {
	enum fkind kind;
	uint64_t n;
	int fired;
};

static int cqe_hook(void *ctx, uint64_t nth, int res)
{
	struct fault *f = (struct fault *)ctx;
	if (nth != f->n || f->fired || res < 0)
		return res;
	f->fired = 1;
	switch (f->kind) {
	case F_EIO: return -EIO;
	case F_ECANCELED: return -ECANCELED;
	case F_ENOSPC: return -ENOSPC;
	case F_EAGAIN: return -EAGAIN;
	case F_SHORT: return res > 1 ? res / 2 : res;
	default: return res;
	}
}

static struct tstate tstate_of(struct model *m)
{
	kvt_stats st = {.size = sizeof st};
	int rc = kvt_get_stats(m->t, &st);
	M_CHECK(m, rc == 0, "kvt_get_stats: got %d (%s)", rc, kvt_last_error(m->t));
	return (struct tstate){st.spills, st.restores, st.auto_spills, st.host_bytes_used,
			       st.nvme_bytes_used};
}

static void arm(struct model *m, struct fault *f)
{
	m->pre = tstate_of(m);
	f->fired = 0;
	f->kind = F_NONE;
	if (t_unif(&m->r) >= 0.25)
		return;
	f->kind = (enum fkind)(1 + t_below(&m->r, F_NKINDS - 1));
	if (f->kind == F_MEM) {
		f->n = 1 + t_below(&m->r, 6);
		kvt_mem_fail_at(f->n);
	} else {
		f->n = 1 + t_below(&m->r, 8);
		kvt_nvme_set_cqe_hook(m->t->nvme, cqe_hook, f);
	}
}

static void disarm(struct model *m, struct fault *f)
{
	if (f->kind == F_MEM) {
		f->fired = kvt_mem_fired();
		kvt_mem_fail_at(0);
	} else if (f->kind != F_NONE) {
		kvt_nvme_set_cqe_hook(m->t->nvme, NULL, NULL);
	}
	m->faults_fired += f->fired != 0;
}

/* The codes a call may return when the fault `f` hit it (kvtier.h's lists). */
static int documented(const struct fault *f, int64_t rc)
{
	if (f->kind == F_MEM)
		return rc == -ENOMEM;
	return rc == -EIO || rc == -ECANCELED || rc == -ENOSPC || rc == -EAGAIN || rc == -EBADMSG;
}

/*
 * Judge T's result under fault f. Returns 1 when R must run the call too (no fault reached, or T
 * recovered), 0 when T failed as documented (R skips the call: it must be as if never made).
 */
static int judge(struct model *m, const struct fault *f, enum op op, int64_t rc)
{
	/* the small host tier of a KVT_SPILL_LRU seed may not hold what one call needs beside the
	 * blocks that cannot spill (tail blocks not indexed yet): refused, as if never made */
	int full = m->lru && !f->fired && rc == -ENOSPC && strstr(kvt_last_error(m->t), "host tier");
	if (!full && (!f->fired || rc >= 0)) {
		m->faults_recovered += f->fired && rc >= 0;
		return 1;
	}
	M_CHECK(m, full || documented(f, rc), "%s under an injected %s fault (n %llu): got %lld (%s: %s), "
		"not a documented code", op_name[op], fkind_name[f->kind], (unsigned long long)f->n,
		(long long)rc, kvt_strerror((int)rc), kvt_last_error(m->t));
	/* nothing changed: no spill or restore left counted (automatic spills undone), no block */
	struct tstate a = tstate_of(m), b = m->pre;
	M_CHECK(m, !memcmp(&a, &b, sizeof a), "%s failed under an injected %s fault (n %llu) but "
		"changed the tiered cache: spills %llu -> %llu, restores %llu -> %llu, auto spills "
		"%llu -> %llu, host bytes %llu -> %llu, NVMe bytes %llu -> %llu", op_name[op],
		fkind_name[f->kind], (unsigned long long)f->n, (unsigned long long)b.spills,
		(unsigned long long)a.spills, (unsigned long long)b.restores,
		(unsigned long long)a.restores, (unsigned long long)b.auto_spills,
		(unsigned long long)a.auto_spills, (unsigned long long)b.host_bytes_used,
		(unsigned long long)a.host_bytes_used, (unsigned long long)b.nvme_bytes_used,
		(unsigned long long)a.nvme_bytes_used);
	if (full)
		m->host_full++;
	else
		m->faults_failed++;
	return 0;
}

/* ---- the caches ------------------------------------------------------------------------------ */

static kvt_config base_config(uint32_t dtype, float p, uint32_t correction)
{
	kvt_config cfg = t_config(NL, NQ, NKV, D, dtype);
	cfg.max_seqs = MAXS;
	cfg.host_bytes = (uint64_t)64 << 20;
	cfg.p = p;
	cfg.budget_min = 8;
	cfg.flush_batch = 8;
	cfg.window = 16;
	cfg.n_sink = 4;
	cfg.correction_steps = correction;
	return cfg;
}

static void model_open(struct model *m, uint64_t seed)
{
	memset(m, 0, sizeof *m);
	m->seed = seed;
	t_rng_seed(&m->r, seed * 0x9e3779b97f4a7c15ull + 1);
	m->dtype = t_below(&m->r, 2) ? KVT_DTYPE_BF16 : KVT_DTYPE_F16;
	m->p = seed % 4 == 3 ? 1.0f : (float)(0.5 + 0.45 * t_unif(&m->r));
	/* every third seed corrects its scores from exact logits (both caches: the same rule) */
	kvt_config cfg = base_config(m->dtype, m->p, seed % 3 == 1 ? 1 + (uint32_t)(seed / 3 % 8) : 0);
	m->ref = t_create(&cfg);
	nv_make_files(&m->f, nv_dir(), 1, (uint64_t)16 << 20);
	cfg.nvme_paths = m->f.ptrs;
	cfg.nvme_bytes = m->f.bytes;
	cfg.n_nvme = 1;
	cfg.nvme_cache_bytes = (uint64_t)2 << 20;
	cfg.nvme_queue_depth = 1 + t_below(&m->r, 8);
	/* every other pair of seeds (p = 1 ones too): KVT_SPILL_LRU and a host tier of HOST_BLOCKS
	 * blocks, below what the sequences of a seed come to hold (about 24-52 blocks at their
	 * peak), so that calls spill others on their own several times a seed; now and then one
	 * call needs more than can be freed (judge: refused, changing nothing) */
	m->lru = seed / 2 % 2 == 1;
	if (m->lru) {
		cfg.spill_policy = KVT_SPILL_LRU;
		cfg.host_bytes = (uint64_t)HOST_BLOCKS << 16;
	}
	m->t = t_create(&cfg);
	nv_unlink(&m->f);
	for (int i = 0; i < MAXS; i++)
		for (int l = 0; l < NL; l++) {
			m->s[i].k[l] = t_alloc(sizeof(float) * CAP * ROW);
			m->s[i].v[l] = t_alloc(sizeof(float) * CAP * ROW);
		}
}

static void model_close(struct model *m)
{
	kvt_cache_destroy(m->t);
	kvt_cache_destroy(m->ref);
	for (int i = 0; i < MAXS; i++)
		for (int l = 0; l < NL; l++) {
			free(m->s[i].k[l]);
			free(m->s[i].v[l]);
		}
}

/* ---- operations ------------------------------------------------------------------------------ */

/* A random open sequence's slot, or -1. */
static int pick_open(struct model *m)
{
	int c[MAXS], n = 0;
	for (int i = 0; i < MAXS; i++)
		if (m->s[i].open)
			c[n++] = i;
	return n ? c[t_below(&m->r, (uint32_t)n)] : -1;
}

/* A random non-empty subset (random order) of the open sequences, as slots; its size. */
static uint32_t pick_batch(struct model *m, int *slots, uint32_t need_tokens, uint32_t layer)
{
	uint32_t n = 0;
	for (int i = 0; i < MAXS; i++)
		if (m->s[i].open && (!need_tokens || m->s[i].len[layer] > 0) &&
		    (g_all || t_below(&m->r, 3)))
			slots[n++] = i;
	for (uint32_t i = n; i > 1; i--) {
		uint32_t j = t_below(&m->r, i);
		int x = slots[i - 1];
		slots[i - 1] = slots[j];
		slots[j] = x;
	}
	return n;
}

/* Rows of n tokens of `width` values: encoded into bits, decoded into dec when not NULL. */
static void rows(struct model *m, uint32_t n, uint32_t width, double mean, uint16_t *bits,
		 float *dec)
{
	t_fill(&m->r, m->dtype, (size_t)n * width, mean, 1.0, bits, dec);
}

/* The lowest model slot not open, or -1 (the library hands out the lowest free id alike). */
static int free_slot_of(const struct model *m)
{
	for (int i = 0; i < MAXS; i++)
		if (!m->s[i].open)
			return i;
	return -1;
}

static void op_open(struct model *m)
{
	int free_slot = free_slot_of(m);
	struct fault f;
	uint32_t a = 0, b = 0;
	arm(m, &f);
	int rt = kvt_seq_open(m->t, &a);
	disarm(m, &f);
	if (!judge(m, &f, OP_OPEN, rt))
		return;
	int rr = kvt_seq_open(m->ref, &b);
	M_CHECK(m, rt == rr && (rt || a == b), "open: tiered got %d (id %u), reference got %d (id %u)",
		rt, a, rr, b);
	M_CHECK(m, (rt == 0) == (free_slot >= 0), "open with %s slot free: got %d",
		free_slot >= 0 ? "a" : "no", rt);
	if (rt == 0 && free_slot >= 0) {
		struct mseq *s = &m->s[free_slot];
		s->open = 1;
		s->id = a;
		memset(s->len, 0, sizeof s->len);
	}
}

static void op_close(struct model *m)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	int rt = kvt_seq_close(m->t, m->s[i].id), rr = kvt_seq_close(m->ref, m->s[i].id);
	M_CHECK(m, rt == 0 && rr == 0, "close %u: tiered got %d, reference got %d, wanted 0",
		m->s[i].id, rt, rr);
	m->s[i].open = 0;
}

static void op_prefill(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	struct mseq *s = &m->s[i];
	uint32_t l = t_below(&m->r, NL);
	uint32_t n = t_below(&m->r, 2) ? 1 + t_below(&m->r, 64) : 100 + t_below(&m->r, 300);
	if (s->len[l] + n > CAP)
		return;
	int with_q = t_below(&m->r, 2);
	if (with_q)
		rows(m, n, QROW, 0.3, q, NULL);
	rows(m, n, ROW, 0.1 * (double)i, k, s->k[l] + (size_t)s->len[l] * ROW);
	rows(m, n, ROW, 0, v, s->v[l] + (size_t)s->len[l] * ROW);
	struct fault f;
	arm(m, &f);
	int rt = kvt_prefill(m->t, s->id, l, with_q ? q : NULL, k, v, n, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_PREFILL, rt))
		return;
	int rr = kvt_prefill(m->ref, s->id, l, with_q ? q : NULL, k, v, n, NULL);
	M_CHECK(m, rt == 0 && rr == 0, "prefill %u tokens of %u on layer %u: tiered got %d (%s), "
		"reference got %d, wanted 0", n, s->id, l, rt, kvt_last_error(m->t), rr);
	if (rt == 0)
		s->len[l] += n;
}

static void op_append(struct model *m, uint16_t *k, uint16_t *v)
{
	int slots[MAXS];
	uint32_t l = t_below(&m->r, NL), ids[MAXS];
	uint32_t n = pick_batch(m, slots, 0, l);
	if (!n)
		return;
	for (uint32_t j = 0; j < n; j++) {
		struct mseq *s = &m->s[slots[j]];
		if (s->len[l] + 1 > CAP)
			return;
		ids[j] = s->id;
		rows(m, 1, ROW, 0.1 * slots[j], k + (size_t)j * ROW, s->k[l] + (size_t)s->len[l] * ROW);
		rows(m, 1, ROW, 0, v + (size_t)j * ROW, s->v[l] + (size_t)s->len[l] * ROW);
	}
	struct fault f;
	arm(m, &f);
	int rt = kvt_append(m->t, l, n, ids, k, v, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_APPEND, rt))
		return;
	int rr = kvt_append(m->ref, l, n, ids, k, v, NULL);
	M_CHECK(m, rt == 0 && rr == 0, "append to %u sequences on layer %u: tiered got %d (%s), "
		"reference got %d, wanted 0", n, l, rt, kvt_last_error(m->t), rr);
	if (rt == 0)
		for (uint32_t j = 0; j < n; j++)
			m->s[slots[j]].len[l]++;
}

/* Both output buffers set to NaN, so that an output a call leaves unwritten cannot match. */
static void poison(float *ot, float *orf, size_t n)
{
	memset(ot, 0xff, n * sizeof *ot);
	memset(orf, 0xff, n * sizeof *orf);
}

/* Exact attention of one sequence's queries [NQ, D] over every token the model holds. */
static void exact(const struct model *m, const struct mseq *s, uint32_t l, const float *q,
		  double *out)
{
	uint32_t n = s->len[l];
	double *w = malloc(sizeof(double) * (n ? n : 1));
	double scale = 1.0 / sqrt((double)D);
	for (int h = 0; h < NQ; h++) {
		int g = h / (NQ / NKV);
		double mx = -INFINITY, sum = 0;
		for (uint32_t t = 0; t < n; t++) {
			double dot = 0;
			for (int d = 0; d < D; d++)
				dot += (double)q[h * D + d] * s->k[l][(size_t)t * ROW + g * D + d];
			w[t] = dot * scale;
			mx = w[t] > mx ? w[t] : mx;
		}
		for (uint32_t t = 0; t < n; t++)
			sum += (w[t] = exp(w[t] - mx));
		for (int d = 0; d < D; d++) {
			double acc = 0;
			for (uint32_t t = 0; t < n; t++)
				acc += w[t] * s->v[l][(size_t)t * ROW + g * D + d];
			out[h * D + d] = acc / sum;
		}
	}
	(void)m;
	free(w);
}

static void op_attend(struct model *m, uint16_t *q, float *qd, float *ot, float *orf)
{
	int slots[MAXS];
	uint32_t l = t_below(&m->r, NL), ids[MAXS];
	/* now and then a sequence without tokens on the layer: both must refuse the batch */
	uint32_t n = pick_batch(m, slots, g_all || t_below(&m->r, 8) != 0, l);
	if (!n)
		return;
	for (uint32_t j = 0; j < n; j++)
		ids[j] = m->s[slots[j]].id;
	rows(m, n, QROW, 0.3, q, qd);
	size_t outn = (size_t)n * QROW;
	poison(ot, orf, outn);
	struct fault f;
	arm(m, &f);
	int rt = kvt_attend(m->t, l, n, ids, q, ot, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_ATTEND, rt))
		return;
	int rr = kvt_attend(m->ref, l, n, ids, q, orf, NULL);
	M_CHECK(m, rt == rr, "attend of %u sequences on layer %u: tiered got %d (%s), reference %d "
		"(%s)", n, l, rt, kvt_last_error(m->t), rr, kvt_last_error(m->ref));
	if (rt || rr)
		return;
	for (size_t x = 0; x < outn; x++)
		if (memcmp(&ot[x], &orf[x], sizeof *ot)) {
			M_CHECK(m, 0, "attend of %u sequences on layer %u: output %zu (sequence %u, "
				"head %zu, dim %zu) tiered %.9g, reference %.9g: wanted bit for bit",
				n, l, x, ids[x / QROW], x % QROW / D, x % D, ot[x], orf[x]);
			return;
		}
	if (m->p < 1.0f)
		return;
	double want[QROW];
	for (uint32_t j = 0; j < n; j++) {
		exact(m, &m->s[slots[j]], l, qd + (size_t)j * QROW, want);
		for (int x = 0; x < QROW; x++) {
			double got = ot[(size_t)j * QROW + x];
			if (fabs(got - want[x]) > 2e-3 + 2e-3 * fabs(want[x])) {
				M_CHECK(m, 0, "p = 1 attend, sequence %u (%u tokens) on layer %u, head "
					"%d dim %d: got %.6f, exact %.6f", ids[j],
					m->s[slots[j]].len[l], l, x / D, x % D, got, want[x]);
				return;
			}
		}
		m->exact_checks++;
	}
}

static void op_select(struct model *m, uint16_t *q, uint16_t *kt, uint16_t *vt, uint16_t *kr,
		      uint16_t *vr, int32_t *pt, int32_t *pr)
{
	int slots[MAXS];
	uint32_t l = t_below(&m->r, NL), ids[MAXS];
	uint32_t n = pick_batch(m, slots, 1, l);
	if (!n)
		return;
	for (uint32_t j = 0; j < n; j++)
		ids[j] = m->s[slots[j]].id;
	rows(m, n, QROW, 0.3, q, NULL);
	struct fault f;
	arm(m, &f);
	int rt = kvt_select(m->t, l, n, ids, q, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_SELECT, rt))
		return;
	int rr = kvt_select(m->ref, l, n, ids, q, NULL);
	M_CHECK(m, rt == rr, "select of %u sequences on layer %u: tiered got %d (%s), reference %d",
		n, l, rt, kvt_last_error(m->t), rr);
	if (rt <= 0 || rt != rr || (uint32_t)rt > CAP)
		return;
	uint32_t mt = (uint32_t)rt;
	int32_t ct[MAXS * NKV], cr[MAXS * NKV];
	arm(m, &f);
	int gt = kvt_gather(m->t, l, n, ids, mt, ct, pt, kt, vt, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_SELECT, gt))
		return;
	int gr = kvt_gather(m->ref, l, n, ids, mt, cr, pr, kr, vr, NULL);
	M_CHECK(m, gt == gr && gt >= 0, "gather of %u sequences on layer %u: tiered got %d (%s), "
		"reference %d", n, l, gt, kvt_last_error(m->t), gr);
	if (gt < 0 || gt != gr)
		return;
	M_CHECK(m, !memcmp(ct, cr, sizeof(int32_t) * n * NKV), "gather counts differ on layer %u "
		"(first pair: tiered %d, reference %d)", l, ct[0], cr[0]);
	for (uint32_t j = 0; j < n * NKV && !g_fail; j++) {
		size_t off = (size_t)j * mt;
		uint32_t c = (uint32_t)ct[j];
		M_CHECK(m, !memcmp(pt + off, pr + off, c * sizeof *pt), "gather positions differ, "
			"sequence %u kv head %u", ids[j / NKV], j % NKV);
		M_CHECK(m, !memcmp(kt + off * D, kr + off * D, (size_t)c * D * 2) &&
			!memcmp(vt + off * D, vr + off * D, (size_t)c * D * 2),
			"gathered rows differ, sequence %u kv head %u", ids[j / NKV], j % NKV);
		if (m->p >= 1.0f)
			M_CHECK(m, c == m->s[slots[j / NKV]].len[l], "p = 1: sequence %u kv head %u "
				"gathered %u tokens, wanted all %u", ids[j / NKV], j % NKV, c,
				m->s[slots[j / NKV]].len[l]);
	}
}

static void op_tier(struct model *m, enum op op)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	struct fault f;
	arm(m, &f);
	int64_t rc = op == OP_SPILL ? kvt_seq_spill(m->t, m->s[i].id)
				   : kvt_seq_restore(m->t, m->s[i].id);
	disarm(m, &f);
	if (!judge(m, &f, op, rc))
		return;
	M_CHECK(m, rc >= 0, "%s of %u: got %lld (%s), wanted >= 0", op_name[op], m->s[i].id,
		(long long)rc, kvt_last_error(m->t));
}

/* Fork a random open sequence into the lowest free slot (refused alike when none is free). */
static void op_fork(struct model *m)
{
	int i = pick_open(m), free_slot = free_slot_of(m);
	if (i < 0)
		return;
	struct fault f;
	uint32_t a = 0, b = 0;
	arm(m, &f);
	int rt = kvt_seq_fork(m->t, m->s[i].id, &a, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_FORK, rt))
		return;
	int rr = kvt_seq_fork(m->ref, m->s[i].id, &b, NULL);
	M_CHECK(m, rt == rr && (rt || a == b), "fork of %u: tiered got %d (id %u, %s), reference %d "
		"(id %u)", m->s[i].id, rt, a, kvt_last_error(m->t), rr, b);
	M_CHECK(m, (rt == 0) == (free_slot >= 0), "fork with %s slot free: got %d",
		free_slot >= 0 ? "a" : "no", rt);
	if (rt || free_slot < 0)
		return;
	struct mseq *c = &m->s[free_slot];
	c->open = 1;
	c->id = a;
	for (int l = 0; l < NL; l++) {
		c->len[l] = m->s[i].len[l];
		memcpy(c->k[l], m->s[i].k[l], sizeof(float) * c->len[l] * ROW);
		memcpy(c->v[l], m->s[i].v[l], sizeof(float) * c->len[l] * ROW);
	}
}

/* Drop the last tokens of a random open sequence: mostly a few (a rejected draft), now and then
 * many, now and then more than a layer holds (refused alike). */
static void op_truncate(struct model *m)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	struct mseq *s = &m->s[i];
	uint32_t least = s->len[0];
	for (int l = 1; l < NL; l++)
		least = s->len[l] < least ? s->len[l] : least;
	uint32_t n = t_below(&m->r, 4) ? t_below(&m->r, 9) : t_below(&m->r, least + 2);
	struct fault f;
	arm(m, &f);
	int rt = kvt_seq_truncate(m->t, s->id, n, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_TRUNCATE, rt))
		return;
	int rr = kvt_seq_truncate(m->ref, s->id, n, NULL);
	M_CHECK(m, rt == rr && (rt == 0) == (n <= least), "truncate %u of %u (least length %u): "
		"tiered got %d (%s), reference %d", n, s->id, least, rt, kvt_last_error(m->t), rr);
	if (rt == 0)
		for (int l = 0; l < NL; l++)
			s->len[l] -= n;
}

/* A varlen batch (kvt_extend) of 1-3 open sequences with 0-5 new tokens each (all 0 now and then:
 * refused alike), every query row attending causally; outputs bit for bit. */
static void op_extend(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v, float *ot,
		      float *orf)
{
	int slots[MAXS];
	uint32_t l = t_below(&m->r, NL), ids[MAXS], cu[MAXS + 1] = {0};
	uint32_t n = pick_batch(m, slots, 0, l), most = 1 + t_below(&m->r, 3);
	n = n < most ? n : most;
	if (!n)
		return;
	for (uint32_t j = 0; j < n; j++) {
		struct mseq *s = &m->s[slots[j]];
		uint32_t c = t_below(&m->r, 6);
		if (s->len[l] + c > CAP)
			return;
		ids[j] = s->id;
		cu[j + 1] = cu[j] + c;
		rows(m, c, ROW, 0.1 * slots[j], k + (size_t)cu[j] * ROW,
		     s->k[l] + (size_t)s->len[l] * ROW);
		rows(m, c, ROW, 0, v + (size_t)cu[j] * ROW, s->v[l] + (size_t)s->len[l] * ROW);
	}
	uint32_t total = cu[n];
	rows(m, total, QROW, 0.3, q, NULL);
	size_t outn = (size_t)total * QROW;
	poison(ot, orf, outn);
	struct fault f;
	arm(m, &f);
	int rt = kvt_extend(m->t, l, n, ids, cu, q, k, v, ot, 0, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_EXTEND, rt))
		return;
	int rr = kvt_extend(m->ref, l, n, ids, cu, q, k, v, orf, 0, NULL);
	M_CHECK(m, rt == rr && (rt == 0) == (total > 0), "extend of %u sequences (%u new tokens) on "
		"layer %u: tiered got %d (%s), reference %d (%s)", n, total, l, rt,
		kvt_last_error(m->t), rr, kvt_last_error(m->ref));
	if (rt || rr)
		return;
	for (uint32_t j = 0; j < n; j++)
		m->s[slots[j]].len[l] += cu[j + 1] - cu[j];
	for (size_t x = 0; x < outn; x++)
		if (memcmp(&ot[x], &orf[x], sizeof *ot)) {
			M_CHECK(m, 0, "extend of %u sequences on layer %u: output %zu (row %zu, head "
				"%zu, dim %zu) tiered %.9g, reference %.9g: wanted bit for bit", n, l,
				x, x / QROW, x % QROW / D, x % D, ot[x], orf[x]);
			return;
		}
}

/* The rows of a random range of a random sequence and layer (now and then past its length:
 * refused alike), spilled rows read from NVMe: bit for bit with the reference's. */
static void op_read(struct model *m, uint16_t *kt, uint16_t *vt, uint16_t *kr, uint16_t *vr)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	struct mseq *s = &m->s[i];
	uint32_t l = t_below(&m->r, NL), len = s->len[l];
	uint32_t from = t_below(&m->r, len + 1), to = from + 1 + t_below(&m->r, len - from + 1);
	if (t_below(&m->r, 10) && to > len) /* mostly a valid range */
		to = len;
	int valid = to > from && to <= len;
	size_t bytes = (size_t)(to - from) * ROW * 2;
	struct fault f;
	arm(m, &f);
	int rt = kvt_seq_read_rows(m->t, s->id, l, from, to, kt, vt, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_READ, rt))
		return;
	int rr = kvt_seq_read_rows(m->ref, s->id, l, from, to, kr, vr, NULL);
	M_CHECK(m, rt == rr && (valid ? rt == (int)(to - from) : rt == -EINVAL), "read_rows "
		"[%u, %u) of %u (%u tokens) on layer %u: tiered got %d (%s), reference %d (%s)", from,
		to, s->id, len, l, rt, kvt_last_error(m->t), rr, kvt_last_error(m->ref));
	if (rt != rr || rt <= 0)
		return;
	M_CHECK(m, !memcmp(kt, kr, bytes) && !memcmp(vt, vr, bytes), "read_rows [%u, %u) of %u on "
		"layer %u: rows differ from the reference's", from, to, s->id, l);
}

/* A few rows computed elsewhere appended at the end of a random sequence and layer. */
static void op_write(struct model *m, uint16_t *k, uint16_t *v)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	struct mseq *s = &m->s[i];
	uint32_t l = t_below(&m->r, NL), n = 1 + t_below(&m->r, 8), from = s->len[l];
	if (from + n > CAP)
		return;
	rows(m, n, ROW, 0.1 * (double)i, k, s->k[l] + (size_t)from * ROW);
	rows(m, n, ROW, 0, v, s->v[l] + (size_t)from * ROW);
	struct fault f;
	arm(m, &f);
	int rt = kvt_seq_write_rows(m->t, s->id, l, from, from + n, k, v, NULL);
	disarm(m, &f);
	if (!judge(m, &f, OP_WRITE, rt))
		return;
	int rr = kvt_seq_write_rows(m->ref, s->id, l, from, from + n, k, v, NULL);
	M_CHECK(m, rt == (int)n && rr == (int)n, "write_rows [%u, %u) of %u on layer %u: tiered got "
		"%d (%s), reference %d, wanted %u", from, from + n, s->id, l, rt, kvt_last_error(m->t),
		rr, n);
	if (rt == (int)n)
		s->len[l] += n;
}

/* Lengths of every open sequence on every layer: the model's, T's and R's. */
static void check_lengths(struct model *m)
{
	for (int i = 0; i < MAXS; i++) {
		if (!m->s[i].open)
			continue;
		for (uint32_t l = 0; l < NL; l++) {
			int64_t a = kvt_seq_length(m->t, m->s[i].id, l);
			int64_t b = kvt_seq_length(m->ref, m->s[i].id, l);
			M_CHECK(m, a == b && a == m->s[i].len[l], "length of %u on layer %u: tiered "
				"%lld, reference %lld, model %u", m->s[i].id, l, (long long)a,
				(long long)b, m->s[i].len[l]);
		}
	}
}

/* The summary's counters past the operations. */
enum { T_FIRED = OP_NOPS, T_FAILED, T_RECOVERED, T_EXACT, T_LRU_SEEDS, T_SPILLS, T_AUTO_SPILLS,
       T_HOST_FULL,
       T_N };

struct bufs {
	uint16_t q[400 * QROW], k[400 * ROW], v[400 * ROW];
	float qd[MAXS * QROW], ot[15 * QROW], orf[15 * QROW]; /* 15: extend's most rows */
	uint16_t kt[MAXS * NKV * CAP * D], vt[MAXS * NKV * CAP * D];
	uint16_t kr[MAXS * NKV * CAP * D], vr[MAXS * NKV * CAP * D];
	int32_t pt[MAXS * NKV * CAP], pr[MAXS * NKV * CAP];
};

static void run_seed(uint64_t seed, uint64_t steps, struct bufs *b, uint64_t *totals)
{
	struct model m;
	model_open(&m, seed);
	/* two sequences to start with */
	op_open(&m);
	op_open(&m);
	static const uint32_t weight[OP_NOPS] = {4, 2, 12, 26, 16, 9, 6, 6, 3, 6, 5, 3, 2};
	for (m.step = 0; m.step < steps && !g_fail; m.step++) {
		uint32_t x = t_below(&m.r, 100), op = 0;
		while (x >= weight[op])
			x -= weight[op++];
		uint64_t failed = m.faults_failed + m.host_full;
		switch ((enum op)op) {
		case OP_OPEN: op_open(&m); break;
		case OP_CLOSE: op_close(&m); break;
		case OP_PREFILL: op_prefill(&m, b->q, b->k, b->v); break;
		case OP_APPEND: op_append(&m, b->k, b->v); break;
		case OP_ATTEND: op_attend(&m, b->q, b->qd, b->ot, b->orf); break;
		case OP_SELECT: op_select(&m, b->q, b->kt, b->vt, b->kr, b->vr, b->pt, b->pr); break;
		case OP_FORK: op_fork(&m); break;
		case OP_TRUNCATE: op_truncate(&m); break;
		case OP_EXTEND: op_extend(&m, b->q, b->k, b->v, b->ot, b->orf); break;
		case OP_READ: op_read(&m, b->kt, b->vt, b->kr, b->vr); break;
		case OP_WRITE: op_write(&m, b->k, b->v); break;
		default: op_tier(&m, (enum op)op); break;
		}
		m.ops[op]++;
		check_lengths(&m);
		/* right after a failed call: every layer's attention over every sequence must match */
		if (m.faults_failed + m.host_full != failed) {
			g_all = 1;
			for (int l = 0; l < NL && !g_fail; l++)
				op_attend(&m, b->q, b->qd, b->ot, b->orf);
			g_all = 0;
		}
	}
	struct tstate st = tstate_of(&m);
	/* close everything: no block may be left on either tier */
	while (!g_fail && pick_open(&m) >= 0)
		op_close(&m);
	if (!g_fail) {
		kvt_stats a = {.size = sizeof a}, r = {.size = sizeof r};
		int ra = kvt_get_stats(m.t, &a), rb = kvt_get_stats(m.ref, &r);
		M_CHECK(&m, ra == 0 && rb == 0 && a.host_bytes_used == 0 && a.nvme_bytes_used == 0 &&
			r.host_bytes_used == 0, "every sequence closed: tiered host bytes %llu, NVMe "
			"bytes %llu, reference host bytes %llu; wanted 0", (unsigned long long)
			a.host_bytes_used, (unsigned long long)a.nvme_bytes_used,
			(unsigned long long)r.host_bytes_used);
	}
	for (int o = 0; o < OP_NOPS; o++)
		totals[o] += m.ops[o];
	totals[T_FIRED] += m.faults_fired;
	totals[T_FAILED] += m.faults_failed;
	totals[T_RECOVERED] += m.faults_recovered;
	totals[T_EXACT] += m.exact_checks;
	totals[T_LRU_SEEDS] += (uint64_t)m.lru;
	totals[T_SPILLS] += st.spills;
	totals[T_AUTO_SPILLS] += st.auto_spills;
	totals[T_HOST_FULL] += m.host_full;
	model_close(&m);
}

static uint64_t n_seeds = 32, first_seed = 1, n_steps = 300;

static void test_model(void **state)
{
	(void)state;
	struct bufs *b = t_alloc(sizeof *b);
	uint64_t totals[T_N] = {0};
	int64_t live = kvt_mem_live();
	int fds = nv_fd_count();
	uint64_t s;
	for (s = first_seed; s < first_seed + n_seeds && !g_fail; s++)
		run_seed(s, n_steps, b, totals);
	free(b);
	print_message("model: %llu seeds x %llu steps; ops:", (unsigned long long)(s - first_seed),
		      (unsigned long long)n_steps);
	for (int o = 0; o < OP_NOPS; o++)
		print_message(" %s %llu", op_name[o], (unsigned long long)totals[o]);
	print_message("; faults fired %llu (failed as documented %llu, recovered %llu); exact p = 1 "
		      "checks %llu; KVT_SPILL_LRU seeds %llu, tiered spills %llu (automatic %llu), calls "
		      "refused by the small host tier %llu\n",
		      (unsigned long long)totals[T_FIRED], (unsigned long long)totals[T_FAILED],
		      (unsigned long long)totals[T_RECOVERED], (unsigned long long)totals[T_EXACT],
		      (unsigned long long)totals[T_LRU_SEEDS], (unsigned long long)totals[T_SPILLS],
		      (unsigned long long)totals[T_AUTO_SPILLS],
		      (unsigned long long)totals[T_HOST_FULL]);
	T_CHECK(!g_fail, "a seed did not match the reference (above)");
	T_CHECK(kvt_mem_live() == live, "live allocations got %lld after every seed, wanted %lld",
		(long long)kvt_mem_live(), (long long)live);
	T_CHECK(nv_fd_count() == fds, "open descriptors got %d after every seed, wanted %d",
		nv_fd_count(), fds);
	T_CHECK(n_seeds < 8 || (totals[T_FAILED] > 0 && totals[T_EXACT] > 0 &&
				totals[T_AUTO_SPILLS] >= 2 * totals[T_LRU_SEEDS]),
		"faults that failed a call got %llu, exact checks %llu, automatic spills %llu in %llu "
		"KVT_SPILL_LRU seeds: wanted > 0, > 0 and >= 2 a seed",
		(unsigned long long)totals[T_FAILED], (unsigned long long)totals[T_EXACT],
		(unsigned long long)totals[T_AUTO_SPILLS], (unsigned long long)totals[T_LRU_SEEDS]);
}

static int setup(void **state)
{
	(void)state;
	nv_skip_unless_available();
	return 0;
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--long")) {
			n_seeds = 250;
		} else if (!strcmp(argv[i], "--seeds") && i + 1 < argc) {
			n_seeds = strtoull(argv[++i], NULL, 0);
		} else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
			first_seed = strtoull(argv[++i], NULL, 0);
			n_seeds = 1;
		} else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
			n_steps = strtoull(argv[++i], NULL, 0);
		} else {
			fprintf(stderr, "usage: %s [--long] [--seeds N] [--seed S] [--steps N]\n",
				argv[0]);
			return 2;
		}
	}
	const char *env = getenv("KVT_MODEL_SEEDS"); /* over --long: for runs longer still */
	if (env && env[0])
		n_seeds = strtoull(env, NULL, 0);
	t_warm_runtime();
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_model)};
	return cmocka_run_group_tests(tests, setup, NULL);
}
