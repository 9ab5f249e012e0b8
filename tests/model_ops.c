/* SPDX-License-Identifier: MIT */
/*
 * The operations of test_model (test_model.c describes the test and runs them): open, close,
 * prefill, append, attend (with exact attention at p = 1), select and gather, spill and restore,
 * fork, truncate, extend, read_rows and write_rows: each call made on the tiered cache T (most
 * under an armed fault) and, unless it is T's alone or judge says otherwise, on the reference R,
 * the results compared bit for bit and the model's sequences updated.
 */
#include "model.h"

/* A random open sequence's slot, or -1. */
int pick_open(struct model *m)
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

void op_open(struct model *m)
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

void op_close(struct model *m)
{
	int i = pick_open(m);
	if (i < 0)
		return;
	int rt = kvt_seq_close(m->t, m->s[i].id), rr = kvt_seq_close(m->ref, m->s[i].id);
	M_CHECK(m, rt == 0 && rr == 0, "close %u: tiered got %d, reference got %d, wanted 0",
		m->s[i].id, rt, rr);
	m->s[i].open = 0;
}

void op_prefill(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v)
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

void op_append(struct model *m, uint16_t *k, uint16_t *v)
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

void op_attend(struct model *m, uint16_t *q, float *qd, float *ot, float *orf)
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

void op_select(struct model *m, uint16_t *q, uint16_t *kt, uint16_t *vt, uint16_t *kr,
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

void op_tier(struct model *m, enum op op)
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
void op_fork(struct model *m)
{
	int i = pick_open(m), free_slot = free_slot_of(m);
	if (i < 0)
		return;
	struct fault f;
	uint32_t a = 0, b = 0;
	m->forked = true;
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
void op_truncate(struct model *m)
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
void op_extend(struct model *m, uint16_t *q, uint16_t *k, uint16_t *v, float *ot,
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
void op_read(struct model *m, uint16_t *kt, uint16_t *vt, uint16_t *kr, uint16_t *vr)
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
void op_write(struct model *m, uint16_t *k, uint16_t *v)
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
