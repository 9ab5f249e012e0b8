/* SPDX-License-Identifier: MIT */
/*
 * Model-based random-operation test (RocksDB's db_stress): random sequences of open, close,
 * prefill, append, attend, select and gather, spill and restore, fork, truncate, extend (a varlen
 * batch of 1-3 sequences with 0-5 new tokens each), read_rows (a random range) and write_rows (a few
 * rows at the end) run on a tiered cache T (CPU backend, an NVMe tier) and on a reference R of the
 * same configuration without NVMe and with ample host memory. Every other pair of seeds runs T with
 * KVT_SPILL_LRU and a host tier of HOST_BLOCKS blocks, too small for the seed's sequences: calls
 * spill others to NVMe on their own (automatic spills, undone when the call fails). Every other
 * run of four seeds gives T the CUDA backend's way with spilled rows (ops->read_rows_spilled
 * off, on the CPU's kernels): extend and read_rows restore a spilled sequence first. Every third
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
 * before it (but the restores, and what they spilled, of a restoring seed's extend or read_rows,
 * and an automatic spill's victim whose read-back in the undo meets the fault too, which kvtier.h
 * says stay), and every later result (and an attend over every sequence right
 * after the failure)
 * must still match R's. After every call the accounts of both caches agree with the lengths
 * (harness.h's t_accounts: kvt_get_capacity, kvt_seq_bytes, kvt_get_stats, kvt_footprint_of's
 * block sizes). A call of a KVT_SPILL_LRU seed that needs more host tier than spilling can
 * free is refused (-ENOSPC, "host tier") and is judged alike. A call that recovers from the fault (a
 * resubmitted short read) must give R's result. At the end of each seed, with every sequence
 * closed, no host or NVMe bytes may be left in use; at the end nothing may leak (allocations,
 * descriptors).
 *
 * This file holds the injected faults, the two caches, the run of a seed and main; model_ops.c
 * holds the operations (model.h declares what they share).
 *
 * Usage: test_model [--long] [--seeds N] [--seed S] [--steps N]. Default: a CI-sized run (suite
 * unit, 32 seeds); --long runs 250 seeds (suite slow). KVT_MODEL_SEEDS sets the seed count too.
 * A failure prints the seed and step, and --seed S --steps N replays it.
 */
#include <unistd.h>

#include "model.h"

#ifndef HOST_BLOCKS
#define HOST_BLOCKS 20 /* KVT_SPILL_LRU seeds: host-tier blocks (256 tokens of a KV head, 64 KiB) */
#endif

const char *const op_name[OP_NOPS] = {
	"open",	 "close", "prefill",  "append", "attend",    "select",	   "spill",
	"restore", "fork",  "truncate", "extend", "read_rows", "write_rows"};

int g_fail; /* a mismatch was found: stop the seed */
int g_all;  /* batches take every open sequence (the check after a failed call) */

/* ---- injected faults ------------------------------------------------------------------------ */

static const char *const fkind_name[F_NKINDS] = {"none",     "allocation", "-EIO",  "-ECANCELED",
						 "-ENOSPC",  "-EAGAIN",    "short"};

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

void arm(struct model *m, struct fault *f)
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

void disarm(struct model *m, struct fault *f)
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
int judge(struct model *m, const struct fault *f, enum op op, int64_t rc)
{
	/* the small host tier of a KVT_SPILL_LRU seed may not hold what one call needs beside the
	 * blocks that cannot spill (tail blocks not indexed yet): refused, as if never made (an
	 * injected allocation fault may then hit the undo's read-back: the refusal stays the
	 * call's code) */
	int full = m->lru && (!f->fired || f->kind == F_MEM) && rc == -ENOSPC &&
		   strstr(kvt_last_error(m->t), "host tier");
	if (!full && (!f->fired || rc >= 0)) {
		m->faults_recovered += f->fired && rc >= 0;
		return 1;
	}
	M_CHECK(m, full || documented(f, rc), "%s under an injected %s fault (n %llu): got %lld (%s: %s), "
		"not a documented code", op_name[op], fkind_name[f->kind], (unsigned long long)f->n,
		(long long)rc, kvt_strerror((int)rc), kvt_last_error(m->t));
	/* nothing changed: no spill or restore left counted (automatic spills undone), no block;
	 * but a restoring seed's extend and read_rows keep the restores they made, unless they
	 * were refused up front for a batch the host tier cannot hold at once */
	struct tstate a = tstate_of(m), b = m->pre;
	const int kept = m->restore_first && (op == OP_EXTEND || op == OP_READ) &&
			 a.restores > b.restores &&
			 !strstr(kvt_last_error(m->t), "cannot all be in the host tier");
	m->restores_kept += kept;
	/* kvtier.h: an automatic spill's victim whose read-back in the undo fails too stays spilled
	 * (its NVMe copy valid), and the spill counters count it */
	const int stayed = strstr(kvt_last_error(m->t), "stay spilled") && a.spills > b.spills &&
			   a.spills - b.spills == a.auto_spills - b.auto_spills &&
			   a.restores == b.restores;
	m->victims_stayed += stayed;
	M_CHECK(m, kept || stayed || !memcmp(&a, &b, sizeof a),
		"%s failed under an injected %s fault (n %llu) but changed the tiered cache: spills "
		"%llu -> %llu, restores %llu -> %llu, auto spills %llu -> %llu, host bytes %llu -> "
		"%llu, NVMe bytes %llu -> %llu; its error: %s", op_name[op],
		fkind_name[f->kind], (unsigned long long)f->n, (unsigned long long)b.spills,
		(unsigned long long)a.spills, (unsigned long long)b.restores,
		(unsigned long long)a.restores, (unsigned long long)b.auto_spills,
		(unsigned long long)a.auto_spills, (unsigned long long)b.host_bytes_used,
		(unsigned long long)a.host_bytes_used, (unsigned long long)b.nvme_bytes_used,
		(unsigned long long)a.nvme_bytes_used, kvt_last_error(m->t));
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
	m->restore_first = seed / 4 % 2 == 1;
	if (m->restore_first)
		t_restore_first(m->t);
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
       T_HOST_FULL, T_RESTORING_SEEDS, T_RESTORES, T_RESTORES_KEPT, T_STAYED, T_N };

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
		char why[512];
		M_CHECK(&m, t_accounts(m.t, m.forked, why, sizeof why) == 0, "tiered: %s", why);
		M_CHECK(&m, t_accounts(m.ref, m.forked, why, sizeof why) == 0, "reference: %s", why);
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
	totals[T_RESTORING_SEEDS] += (uint64_t)m.restore_first;
	totals[T_RESTORES] += m.restore_first ? st.restores : 0;
	totals[T_RESTORES_KEPT] += m.restores_kept;
	totals[T_STAYED] += m.victims_stayed;
	model_close(&m);
}

static uint64_t n_seeds = 32, first_seed = 1, n_steps = 300;

static void test_model(void **state)
{
	(void)state;
	struct bufs *b = t_alloc(sizeof *b);
	uint64_t totals[T_N] = {0};
	int64_t live = kvt_mem_live();
	int fds = t_fd_count();
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
		      "refused by the small host tier %llu; restoring seeds %llu, their restores "
		      "%llu, failed calls that kept theirs %llu; undos that left a victim spilled "
		      "%llu\n",
		      (unsigned long long)totals[T_FIRED], (unsigned long long)totals[T_FAILED],
		      (unsigned long long)totals[T_RECOVERED], (unsigned long long)totals[T_EXACT],
		      (unsigned long long)totals[T_LRU_SEEDS], (unsigned long long)totals[T_SPILLS],
		      (unsigned long long)totals[T_AUTO_SPILLS],
		      (unsigned long long)totals[T_HOST_FULL],
		      (unsigned long long)totals[T_RESTORING_SEEDS],
		      (unsigned long long)totals[T_RESTORES],
		      (unsigned long long)totals[T_RESTORES_KEPT],
		      (unsigned long long)totals[T_STAYED]);
	T_CHECK(!g_fail, "a seed did not match the reference (above)");
	T_CHECK(kvt_mem_live() == live, "live allocations got %lld after every seed, wanted %lld",
		(long long)kvt_mem_live(), (long long)live);
	T_CHECK(t_fd_count() == fds, "open descriptors got %d after every seed, wanted %d",
		t_fd_count(), fds);
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
