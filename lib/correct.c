/* SPDX-License-Identifier: MIT */
/*
 * Score correction from exact logits (kvt_config.correction_steps, doc/rescoring.md): a control
 * variate that spends no byte beyond what a step reads anyway.
 *
 * The estimate of <q, k> errs by <e_k, x>, where x = P^T (q - c_q) is the query's rotated residual
 * and e_k a fixed vector of key k (its 1-bit code's error): linear in x. A decode step attends its
 * selected tokens exactly, so for each of them it learns the error of that step's estimate,
 * delta = exact - estimate = -<e_k, x_s>. A later step with query x_t expects the error
 * <e_k, x_t>, whose best linear prediction from delta (e_k isotropic) is
 * -beta delta with beta = <x_t, x_s> / <x_s, x_s>; so the later step scores k as
 * estimate + beta delta. Consecutive queries of a head are alike, so beta is near 1 and the tokens
 * that mattered recently are scored almost exactly: what Top-p on a 1-bit estimate gets wrong at
 * its worst steps (a peaked head's heavy key under- or over-estimated by a few logits).
 *
 * Per (sequence, layer, KV head) a ring of correction_steps + 1 entries, one per step that
 * attended: the index positions of the indexed tokens it attended, their delta per query head of
 * the group, and the group's x. A step applies the entries of the last correction_steps steps,
 * the most recent one for each token. The extra slot means that recording never overwrites an entry
 * that is still in use, so a step that fails part way loses none; what it recorded carries its
 * selection number, which counts only once a step with that number succeeds, and that step either
 * records over it (kvt_attend) or empties its slot (kvt_select).
 *
 * Every sum runs in a fixed order (j ascending, float for the logit as the estimate's terms,
 * double for beta), so the corrected scores are a function of the inputs alone.
 */
#include <math.h>
#include <string.h>

#include "half.h"
#include "internal.h"

struct kvt_corr_entry {
	uint64_t step;   /* the selection number that attended; 0: empty */
	uint32_t n, cap; /* tokens recorded, room */
	uint32_t *pos;   /* [cap] index positions */
	float *delta;    /* [cap, G] exact logit minus estimate, per query head of the group */
	float *x;        /* [G, d] the queries' rotated residuals */
};

static uint32_t ring_len(const kvt_cache *c)
{
	return c->cfg.correction_steps + 1;
}

void kvt_corr_free(kvt_cache *c, struct kvt_layer *l)
{
	if (!l->corr)
		return;
	const size_t n = (size_t)c->cfg.n_kv_heads * ring_len(c);
	for (size_t i = 0; i < n; i++) {
		kvt_mem_free(KVT_MEM_HOST, l->corr[i].pos, 0);
		kvt_mem_free(KVT_MEM_HOST, l->corr[i].delta, 0);
		kvt_mem_free(KVT_MEM_HOST, l->corr[i].x, 0);
	}
	kvt_mem_free(KVT_MEM_HOST, l->corr, 0);
	l->corr = NULL;
}

void kvt_corr_forget(kvt_cache *c, struct kvt_layer *l)
{
	if (!l->corr)
		return;
	const size_t n = (size_t)c->cfg.n_kv_heads * ring_len(c);
	for (size_t i = 0; i < n; i++) {
		l->corr[i].step = 0;
		l->corr[i].n = 0;
	}
}

void kvt_corr_commit(kvt_cache *c, struct kvt_layer *l, bool recorded)
{
	const uint32_t RL = ring_len(c);
	const uint64_t now = ++l->corr_step;
	if (recorded || !l->corr)
		return;
	/* a selection that read no rows: what a failed step left in its slot must not count */
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		l->corr[(size_t)h * RL + now % RL].step = 0;
		l->corr[(size_t)h * RL + now % RL].n = 0;
	}
}

void kvt_corr_apply(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g, uint32_t ni,
		    uint64_t now, const float *x, float *scores, float *scratch)
{
	const uint32_t R = c->cfg.correction_steps, RL = ring_len(c), d = c->d, G = c->group;
	if (!R || !l->corr || !ni)
		return;
	bool any = false;
	/* oldest first: a later entry overwrites an earlier one's correction of the same token */
	for (uint32_t age = R; age >= 1; age--) {
		if (now <= age)
			continue;
		const struct kvt_corr_entry *e = &l->corr[(size_t)h * RL + (now - age) % RL];
		if (e->step != now - age || !e->n)
			continue;
		const float *xs = e->x + (size_t)g * d;
		double xy = 0.0, yy = 0.0;
		for (uint32_t j = 0; j < d; j++) {
			xy += (double)x[j] * xs[j];
			yy += (double)xs[j] * xs[j];
		}
		if (!(yy > 0.0))
			continue;
		if (!any) {
			memset(scratch, 0, sizeof *scratch * ni);
			any = true;
		}
		const double beta = xy / yy;
		for (uint32_t k = 0; k < e->n; k++)
			if (e->pos[k] < ni)
				scratch[e->pos[k]] = (float)(beta * e->delta[(size_t)k * G + g]);
	}
	if (!any)
		return;
	for (uint32_t t = 0; t < ni; t++) {
		const float s = scores[t] + scratch[t];
		scores[t] = isfinite(s) ? s : scores[t];
	}
}

/* Room for n tokens in e (contents not kept). */
static int entry_room(kvt_cache *c, struct kvt_corr_entry *e, uint32_t n)
{
	if (e->cap >= n && e->x)
		return 0;
	const uint32_t cap = n > e->cap ? (n > 2 * e->cap ? n : 2 * e->cap) : e->cap;
	uint32_t *pos = kvt_mem_alloc(KVT_MEM_HOST, sizeof *pos * cap);
	float *delta = kvt_mem_alloc(KVT_MEM_HOST, sizeof *delta * cap * c->group);
	float *x = e->x ? e->x : kvt_mem_alloc(KVT_MEM_HOST, sizeof *x * c->group * c->d);
	if (!pos || !delta || !x) {
		kvt_mem_free(KVT_MEM_HOST, pos, 0);
		kvt_mem_free(KVT_MEM_HOST, delta, 0);
		if (x != e->x)
			kvt_mem_free(KVT_MEM_HOST, x, 0);
		return kvt_seterr(c, -ENOMEM, "out of memory for the score corrections of %u tokens",
				  n);
	}
	kvt_mem_free(KVT_MEM_HOST, e->pos, 0);
	kvt_mem_free(KVT_MEM_HOST, e->delta, 0);
	e->pos = pos;
	e->delta = delta;
	e->x = x;
	e->cap = cap;
	return 0;
}

float *kvt_corr_logits(kvt_cache *c, uint32_t n, int *rc)
{
	const size_t need = (size_t)c->group * n;
	*rc = 0;
	if (!c->cfg.correction_steps)
		return NULL;
	if (need > c->corr_logits_n) {
		float *p = kvt_mem_alloc(KVT_MEM_HOST, sizeof *p * need);
		if (!p) {
			*rc = kvt_seterr(c, -ENOMEM, "out of memory for the logits of %u rows", n);
			return NULL;
		}
		kvt_mem_free(KVT_MEM_HOST, c->corr_logits, 0);
		c->corr_logits = p;
		c->corr_logits_n = need;
	}
	return c->corr_logits;
}

void kvt_corr_fini(kvt_cache *c)
{
	kvt_mem_free(KVT_MEM_HOST, c->corr_logits, 0);
	c->corr_logits = NULL;
	c->corr_logits_n = 0;
}

int kvt_corr_record(kvt_cache *c, struct kvt_layer *l, uint32_t layer, uint32_t h, uint64_t now,
		    uint32_t g0, uint32_t gn, const float *qf, uint32_t n, const float *logits)
{
	const uint32_t R = c->cfg.correction_steps, RL = ring_len(c), d = c->d, G = c->group;
	if (!R)
		return 0;
	if (!l->corr) {
		const size_t bytes = sizeof *l->corr * c->cfg.n_kv_heads * RL;
		l->corr = kvt_mem_alloc(KVT_MEM_HOST, bytes);
		KVT_RETURN_IF(!l->corr, c, -ENOMEM,
			      "out of memory for the score corrections of layer %u (%zu bytes)", layer,
			      bytes);
		memset(l->corr, 0, bytes);
	}
	struct kvt_corr_entry *e = &l->corr[(size_t)h * RL + now % RL];
	const size_t cap = l->idx_cap;
	/* the attended rows are the sinks, then the selection, then the window (positions()) */
	const uint32_t m = l->sel_n[h], first = kvt_sinks_of(c, l->sel_tokens);
	const uint32_t *sel = l->sel + (size_t)h * cap;
	if (g0 == 0) {
		e->step = 0; /* not valid until every query head is filled */
		e->n = 0;
		if (!m)
			return 0;
		KVT_TRY(entry_room(c, e, m));
		memcpy(e->pos, sel, sizeof *sel * m);
	}
	if (!m || first + m > n)
		return 0;
	const float *rot = c->rot + (size_t)layer * d * d;
	for (uint32_t g = g0; g < g0 + gn; g++) {
		kvt_qcode qc;
		kvt_query_prepare(d, rot, l->c_q + (size_t)h * d, l->c_k + (size_t)h * d,
				  qf + (size_t)(g - g0) * d, &qc);
		memcpy(e->x + (size_t)g * d, qc.x, sizeof *qc.x * d);
		for (uint32_t r = 0; r < m; r++) {
			const uint32_t t = sel[r];
			float est;
			kvt_score(d, &qc, 1, l->codes + ((size_t)h * cap + t) * c->words,
				  l->sigma + (size_t)h * cap + t, l->beta + (size_t)h * cap + t, &est);
			const float delta = logits[(size_t)g * n + first + r] - est;
			e->delta[(size_t)r * G + g] = isfinite(delta) ? delta : 0.0f;
		}
	}
	if (g0 + gn == G) {
		e->n = m;
		e->step = now;
	}
	return 0;
}
