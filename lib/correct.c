/* SPDX-License-Identifier: MIT */
/*
 * Score correction from exact logits (kvt_config.correction_steps, doc/rescoring.md): a control
 * variate that spends no byte beyond what a step reads anyway.
 *
 * The estimate of <q, k> errs by <e_k, x>, where x = P^T (q - c_q) is the query's rotated residual
 * and e_k a fixed vector of key k (its 1-bit code's error): linear in x. A decode step attends its
 * selected tokens exactly, so for each of them it learns the error of that step's estimate for
 * every query head of the group: delta = exact - estimate = -<e_k, x_s,g'>, one measurement of
 * e_k along each query x_s,g'. A later step with query x predicts the error of its own estimate,
 * -<e_k, x>, from the measurements of k it remembers: the least-squares weights w of x on the
 * measured queries X (ridge LS_RIDGE relative to each one's squared norm), (X^T X + r diag) w =
 * X^T x, and the score estimate + w . deltas. With one measurement this is the old rule,
 * estimate + beta delta with beta = <x, x_s> / <x_s, x_s>, shrunk by 1 / (1 + LS_RIDGE); with
 * several (a token attended at several remembered steps, by every query head of the group) the
 * parts of the queries that persist from step to step are measured several times and the fresh
 * parts average out. A token's measurements are those of the LS_MAX / G most recent remembered
 * steps that attended it (all G query heads of each; with G > LS_MAX, only the query head's own).
 *
 * Per (sequence, layer, KV head) a ring of correction_steps + 1 entries, one per step that
 * attended: the index positions of the indexed tokens it attended, their delta per query head of
 * the group, and the group's x. A step applies the entries of the last correction_steps steps;
 * their position lists are ascending (the selection's order). The extra slot means that recording never overwrites an entry
 * that is still in use, so a step that fails part way loses none; what it recorded carries its
 * selection number, which counts only once a step with that number succeeds, and that step either
 * records over it (kvt_attend) or empties its slot (kvt_select).
 *
 * Every sum runs in a fixed order (j ascending, float for the logit as the estimate's terms; double
 * for the products of queries, the Cholesky factor, the solves and the prediction, each over its
 * measurements in order: steps most recent first, query heads ascending; the prediction's terms in
 * four running sums by index mod 4, added as (s0 + s1) + (s2 + s3)), so the corrected scores are a
 * function of the inputs alone. The products, factors and weights are computed once per
 * (KV head, selection) and reused by every token whose measurements are the same steps.
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

/* What kvt_corr_apply prepared no longer holds: a ring changed. */
static void ls_invalidate(kvt_cache *c);

void kvt_corr_free(kvt_cache *c, struct kvt_layer *l)
{
	ls_invalidate(c);
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
	ls_invalidate(c);
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
	ls_invalidate(c);
	if (recorded || !l->corr)
		return;
	/* a selection that read no rows: what a failed step left in its slot must not count */
	for (uint32_t h = 0; h < c->cfg.n_kv_heads; h++) {
		l->corr[(size_t)h * RL + now % RL].step = 0;
		l->corr[(size_t)h * RL + now % RL].n = 0;
	}
}

/* tests/test_correction.c builds this file again with smaller limits (one measurement a step, the
 * per-token path past LS_KEYS, products past LS_GRAM_MAX made each time) */
#ifdef KVT_TEST_LS_MAX
#define LS_MAX KVT_TEST_LS_MAX
#define LS_KEYS KVT_TEST_LS_KEYS
#define LS_GRAM_MAX KVT_TEST_LS_GRAM
#else
#define LS_MAX 32u         /* measurements one prediction uses at most */
#define LS_KEYS 256u       /* step sets whose factors a preparation keeps (more: made per token) */
#define LS_GRAM_MAX 256u   /* measurements whose pairwise products a preparation keeps */
#endif
#define LS_RIDGE 0.1       /* added to each measurement's squared norm, relative to it */
#define LS_HASH 1024u      /* slots of the step sets' table (a power of two, > 2 LS_KEYS) */
#define LS_NONE UINT32_MAX

/*
 * The prediction's state for one (layer, KV head) at one selection (and, with one measurement a
 * step, one query head), made by kvt_corr_predict for the group's query heads together (each one
 * alone when G > LS_MAX) and added by kvt_corr_apply to each head's scores; allocated by
 * kvt_corr_reserve, so a step never allocates.
 * A measurement is (entry a, query head r of the step): index a * mps + r.
 */
struct kvt_corr_ls {
	const struct kvt_layer *l; /* what is prepared (l NULL: nothing) */
	uint64_t now;
	uint32_t h, ni, g;
	uint32_t na;                           /* entries that count, most recent first */
	const struct kvt_corr_entry *e[KVT_MAX_CORRECTION_STEPS];
	uint32_t mps, L;                       /* measurements a step, steps a prediction */
	uint32_t M, cap_m;                     /* measurements; room of norm */
	uint32_t gn, gmax;                     /* query heads predicted together, at most */
	double *norm;                          /* [cap_m] squared norms */
	double *rhs;                           /* [gmax][cap_m] products with the queries predicted */
	kvt_qcode *qq;                         /* [gmax] their prepared queries */
	float *pred;                           /* [gmax][cap] their predictions per position */
	double *gram;                          /* [LS_GRAM_MAX^2] pairwise products, NaN: not yet */
	uint32_t nkeys;
	uint64_t key[LS_KEYS];                 /* a step set: bit a for entry a */
	uint32_t kn[LS_KEYS];                  /* its measurements (0: no prediction) */
	uint16_t kidx[LS_KEYS][LS_MAX];        /* which */
	uint8_t kent[LS_KEYS][LS_MAX];         /* their entries */
	uint16_t khead[LS_KEYS][LS_MAX];       /* their query heads */
	double *fac;                           /* [LS_KEYS][LS_MAX^2] Cholesky factors */
	double *w;                             /* [LS_KEYS][LS_MAX][gmax] weights, by head last */
	double *tw;                            /* [LS_MAX][gmax]: a set past LS_KEYS, per token */
	uint32_t slot[LS_HASH];                /* key index + 1, 0: empty */
	double tfac[LS_MAX * LS_MAX], tsol[LS_MAX];
	uint64_t *mask;                        /* [cap] per index position: the entries holding it */
	uint32_t *kid;                         /* [cap] its set's key index, LS_NONE: past LS_KEYS */
	uint32_t cap;
};

static void ls_invalidate(kvt_cache *c)
{
	if (c->corr_ls)
		c->corr_ls->l = NULL;
}

static double dot_d(const float *a, const float *b, uint32_t d)
{
	double s = 0.0;
	for (uint32_t j = 0; j < d; j++)
		s += (double)a[j] * b[j];
	return s;
}

/* The query of measurement i (i < M, so its entry is below na <= KVT_MAX_CORRECTION_STEPS; the
 * clamp only says so to the compiler). */
static const float *ls_x(const kvt_cache *c, const struct kvt_corr_ls *p, uint32_t i)
{
	const uint32_t r = p->mps == 1 ? p->g : i % p->mps, a = i / p->mps;
	return p->e[a < KVT_MAX_CORRECTION_STEPS ? a : 0]->x + (size_t)r * c->d;
}

static double ls_gram(const kvt_cache *c, struct kvt_corr_ls *p, uint32_t i, uint32_t j)
{
	if (i == j)
		return p->norm[i];
	const uint32_t a = i < j ? i : j, b = i < j ? j : i;
	if (b >= LS_GRAM_MAX)
		return dot_d(ls_x(c, p, a), ls_x(c, p, b), c->d);
	double *v = &p->gram[(size_t)a * LS_GRAM_MAX + b];
	if (isnan(*v))
		*v = dot_d(ls_x(c, p, a), ls_x(c, p, b), c->d);
	return *v;
}

/* The measurements of step set `key` (bit a: entry a) in order, into idx; their count. A query
 * whose residual is zero (or not finite) measures nothing and is left out. */
static uint32_t ls_members(const struct kvt_corr_ls *p, uint64_t key, uint16_t *idx, uint8_t *ent,
			   uint16_t *head)
{
	uint32_t n = 0;
	for (uint32_t a = 0; a < p->na; a++)
		if (key >> a & 1)
			for (uint32_t r = 0; r < p->mps; r++) {
				const uint32_t i = a * p->mps + r;
				if (!(p->norm[i] > 0.0 && isfinite(p->norm[i])))
					continue;
				ent[n] = (uint8_t)a;
				head[n] = (uint16_t)(p->mps == 1 ? p->g : r);
				idx[n++] = (uint16_t)i;
			}
	return n;
}

/* Cholesky factor (lower, row-major, n x n) of the ridge Gram of measurements idx; false when it
 * is not positive definite in double (then the set predicts nothing). */
static bool ls_factor(const kvt_cache *c, struct kvt_corr_ls *p, const uint16_t *idx, uint32_t n,
		      double *f)
{
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t j = 0; j <= i; j++) {
			double s = ls_gram(c, p, idx[i], idx[j]);
			if (i == j)
				s += LS_RIDGE * p->norm[idx[i]];
			for (uint32_t k = 0; k < j; k++)
				s -= f[i * LS_MAX + k] * f[j * LS_MAX + k];
			if (i == j) {
				if (!(s > 0.0))
					return false;
				f[i * LS_MAX + i] = sqrt(s);
			} else {
				f[i * LS_MAX + j] = s / f[j * LS_MAX + j];
			}
		}
	return true;
}

/* w = (L L^T)^-1 rhs[idx] */
static void ls_solve(const double *rhs, const double *f, const uint16_t *idx, uint32_t n,
		     double *w)
{
	for (uint32_t i = 0; i < n; i++) {
		double s = rhs[idx[i]];
		for (uint32_t k = 0; k < i; k++)
			s -= f[i * LS_MAX + k] * w[k];
		w[i] = s / f[i * LS_MAX + i];
	}
	for (uint32_t i = n; i-- > 0;) {
		double s = w[i];
		for (uint32_t k = i + 1; k < n; k++)
			s -= f[k * LS_MAX + i] * w[k];
		w[i] = s / f[i * LS_MAX + i];
	}
}

/* The first L entries (the most recent steps) of a position's set. */
static uint64_t ls_key(uint64_t m, uint32_t L)
{
	uint64_t k = 0;
	for (uint32_t n = 0; m && n < L; n++) {
		const uint64_t low = m & -m;
		k |= low;
		m ^= low;
	}
	return k;
}

/* Prepare the prediction of (l, h) at selection `now` for positions below ni (query head g when
 * a step has one measurement). */
static void ls_prepare(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g,
		       uint32_t ni, uint64_t now)
{
	struct kvt_corr_ls *p = c->corr_ls;
	const uint32_t R = c->cfg.correction_steps, RL = ring_len(c), G = c->group;
	*p = (struct kvt_corr_ls){.l = l, .now = now, .h = h, .ni = ni, .g = g, .norm = p->norm,
				  .rhs = p->rhs, .gram = p->gram, .fac = p->fac, .mask = p->mask,
				  .kid = p->kid, .cap = p->cap, .cap_m = p->cap_m, .gmax = p->gmax,
				  .qq = p->qq, .pred = p->pred, .w = p->w, .tw = p->tw};
	for (uint32_t age = 1; age <= R; age++) {
		if (now <= age)
			break;
		const struct kvt_corr_entry *e = &l->corr[(size_t)h * RL + (now - age) % RL];
		if (e->step == now - age && e->n)
			p->e[p->na++] = e;
	}
	p->mps = G <= LS_MAX ? G : 1;
	p->L = LS_MAX / p->mps;
	p->M = p->na * p->mps;
	for (uint32_t i = 0; i < p->M; i++) {
		const float *x = ls_x(c, p, i);
		p->norm[i] = dot_d(x, x, c->d);
	}
	const uint32_t gm = p->M < LS_GRAM_MAX ? p->M : LS_GRAM_MAX;
	for (uint32_t i = 0; i < gm; i++)
		for (uint32_t j = i + 1; j < gm; j++)
			p->gram[(size_t)i * LS_GRAM_MAX + j] = NAN;
	memset(p->mask, 0, sizeof *p->mask * ni);
	for (uint32_t a = 0; a < p->na; a++)
		for (uint32_t k = 0; k < p->e[a]->n; k++)
			if (p->e[a]->pos[k] < ni)
				p->mask[p->e[a]->pos[k]] |= 1ull << a;
	for (uint32_t t = 0; t < ni; t++) {
		if (!p->mask[t])
			continue;
		const uint64_t key = ls_key(p->mask[t], p->L);
		uint32_t s = (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 40) & (LS_HASH - 1);
		while (p->slot[s] && p->key[p->slot[s] - 1] != key)
			s = (s + 1) & (LS_HASH - 1);
		if (p->slot[s]) {
			p->kid[t] = p->slot[s] - 1;
			continue;
		}
		if (p->nkeys == LS_KEYS) {
			p->kid[t] = LS_NONE;
			continue;
		}
		const uint32_t k = p->nkeys++;
		p->slot[s] = k + 1;
		p->key[k] = key;
		p->kn[k] = ls_members(p, key, p->kidx[k], p->kent[k], p->khead[k]);
		if (!ls_factor(c, p, p->kidx[k], p->kn[k], p->fac + (size_t)k * LS_MAX * LS_MAX))
			p->kn[k] = 0;
		p->kid[t] = k;
	}
}

uint32_t kvt_corr_heads(const kvt_cache *c, const struct kvt_layer *l)
{
	if (!c->cfg.correction_steps || !l->corr || !c->corr_ls)
		return 0;
	return c->group <= LS_MAX ? c->group : 1;
}

kvt_qcode *kvt_corr_queries(kvt_cache *c)
{
	return c->corr_ls->qq;
}

void kvt_corr_predict(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g0,
		      uint32_t gn, uint32_t ni, uint64_t now)
{
	const uint32_t G = c->group, d = c->d;
	struct kvt_corr_ls *p = c->corr_ls;
	ls_prepare(c, l, h, g0, ni, now);
	p->gn = gn;
	if (!p->na)
		return;
	const uint32_t M = p->M;
	for (uint32_t gg = 0; gg < gn; gg++)
		for (uint32_t i = 0; i < M; i++)
			p->rhs[(size_t)gg * M + i] = dot_d(p->qq[gg].x, ls_x(c, p, i), d);
	for (uint32_t k = 0; k < p->nkeys; k++) {
		const uint32_t n = p->kn[k];
		double *w = p->w + (size_t)k * LS_MAX * p->gmax;
		for (uint32_t gg = 0; n && gg < gn; gg++) {
			ls_solve(p->rhs + (size_t)gg * M, p->fac + (size_t)k * LS_MAX * LS_MAX,
				 p->kidx[k], n, p->tsol);
			for (uint32_t j = 0; j < n; j++)
				w[(size_t)j * gn + gg] = p->tsol[j];
		}
	}
	uint32_t cur[KVT_MAX_CORRECTION_STEPS] = {0}; /* each entry's next position */
	const float *at[KVT_MAX_CORRECTION_STEPS];      /* a token's deltas in each entry */
	double sum[4][LS_MAX];                          /* per head: term j in sum j % 4 */
	for (uint32_t t = 0; t < ni; t++) {
		const uint64_t m = p->mask[t];
		if (!m)
			continue;
		/* position t is next in every entry that holds it (the lists are ascending) */
		for (uint64_t b = m; b; b &= b - 1) {
			const uint32_t a = (uint32_t)__builtin_ctzll(b);
			at[a] = p->e[a]->delta + (size_t)cur[a]++ * G;
		}
		const double *w;
		const uint8_t *ent;
		const uint16_t *head;
		uint32_t n;
		uint16_t idx[LS_MAX], hx[LS_MAX];
		uint8_t ex[LS_MAX];
		if (p->kid[t] != LS_NONE) {
			const uint32_t k = p->kid[t];
			n = p->kn[k];
			w = p->w + (size_t)k * LS_MAX * p->gmax;
			ent = p->kent[k];
			head = p->khead[k];
		} else { /* a set past the kept ones: the same arithmetic, made here */
			n = ls_members(p, ls_key(m, p->L), idx, ex, hx);
			if (n && !ls_factor(c, p, idx, n, p->tfac))
				n = 0;
			for (uint32_t gg = 0; n && gg < gn; gg++) {
				ls_solve(p->rhs + (size_t)gg * M, p->tfac, idx, n, p->tsol);
				for (uint32_t j = 0; j < n; j++)
					p->tw[(size_t)j * gn + gg] = p->tsol[j];
			}
			w = p->tw;
			ent = ex;
			head = hx;
		}
		for (uint32_t r = 0; r < 4; r++)
			for (uint32_t gg = 0; gg < gn; gg++)
				sum[r][gg] = 0.0;
		for (uint32_t j = 0; j < n; j++) {
			const double dl = at[ent[j]][head[j]];
			const double *wj = w + (size_t)j * gn;
			double *sj = sum[j & 3];
			for (uint32_t gg = 0; gg < gn; gg++)
				sj[gg] += wj[gg] * dl;
		}
		for (uint32_t gg = 0; gg < gn; gg++)
			p->pred[(size_t)gg * p->cap + t] =
				(float)((sum[0][gg] + sum[1][gg]) + (sum[2][gg] + sum[3][gg]));
	}
}

void kvt_corr_apply(kvt_cache *c, const struct kvt_layer *l, uint32_t h, uint32_t g, uint32_t ni,
		    uint64_t now, float *scores)
{
	const struct kvt_corr_ls *p = c->corr_ls;
	/* only what kvt_corr_predict made for these heads of this (layer, KV head, selection) */
	if (!p || p->l != l || p->h != h || p->ni != ni || p->now != now || !p->na || g < p->g ||
	    g >= p->g + p->gn)
		return;
	const float *pred = p->pred + (size_t)(g - p->g) * p->cap;
	for (uint32_t t = 0; t < ni; t++)
		if (p->mask[t]) {
			const float s = scores[t] + pred[t];
			scores[t] = isfinite(s) ? s : scores[t];
		}
}

/* The prediction's state and every array it holds (NULL accepted). */
static void ls_free(struct kvt_corr_ls *p)
{
	if (!p)
		return;
	kvt_mem_free(KVT_MEM_HOST, p->norm, 0);
	kvt_mem_free(KVT_MEM_HOST, p->rhs, 0);
	kvt_mem_free(KVT_MEM_HOST, p->gram, 0);
	kvt_mem_free(KVT_MEM_HOST, p->fac, 0);
	kvt_mem_free(KVT_MEM_HOST, p->w, 0);
	kvt_mem_free(KVT_MEM_HOST, p->tw, 0);
	kvt_mem_free(KVT_MEM_HOST, p->qq, 0);
	kvt_mem_free(KVT_MEM_HOST, p->mask, 0);
	kvt_mem_free(KVT_MEM_HOST, p->kid, 0);
	kvt_mem_free(KVT_MEM_HOST, p->pred, 0);
	kvt_mem_free(KVT_MEM_HOST, p, 0);
}

int kvt_corr_reserve(kvt_cache *c, uint32_t tokens)
{
	const uint32_t R = c->cfg.correction_steps;
	if (!R)
		return 0;
	struct kvt_corr_ls *p = c->corr_ls;
	if (!p) {
		const uint32_t mps = c->group <= LS_MAX ? c->group : 1;
		const uint32_t cap_m = R * mps, gmax = mps;
		p = kvt_mem_alloc(KVT_MEM_HOST, sizeof *p);
		if (p) {
			*p = (struct kvt_corr_ls){.cap_m = cap_m, .gmax = gmax};
			p->norm = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * cap_m);
			p->rhs = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * cap_m * gmax);
			p->gram = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * LS_GRAM_MAX * LS_GRAM_MAX);
			p->fac = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * LS_KEYS * LS_MAX * LS_MAX);
			p->w = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * LS_KEYS * LS_MAX * gmax);
			p->tw = kvt_mem_alloc(KVT_MEM_HOST, sizeof(double) * LS_MAX * gmax);
			p->qq = kvt_mem_alloc(KVT_MEM_HOST, sizeof(kvt_qcode) * gmax);
		}
		if (!p || !p->norm || !p->rhs || !p->gram || !p->fac || !p->w || !p->tw || !p->qq) {
			ls_free(p);
			return kvt_seterr(c, -ENOMEM, "out of memory for the score corrections' "
					  "prediction");
		}
		c->corr_ls = p;
	}
	if (tokens <= p->cap)
		return 0;
	uint64_t *mask = kvt_mem_alloc(KVT_MEM_HOST, sizeof *mask * tokens);
	uint32_t *kid = kvt_mem_alloc(KVT_MEM_HOST, sizeof *kid * tokens);
	float *pred = kvt_mem_alloc(KVT_MEM_HOST, sizeof *pred * tokens * p->gmax);
	if (!mask || !kid || !pred) {
		kvt_mem_free(KVT_MEM_HOST, mask, 0);
		kvt_mem_free(KVT_MEM_HOST, kid, 0);
		kvt_mem_free(KVT_MEM_HOST, pred, 0);
		return kvt_seterr(c, -ENOMEM, "out of memory for the score corrections of %u tokens",
				  tokens);
	}
	kvt_mem_free(KVT_MEM_HOST, p->mask, 0);
	kvt_mem_free(KVT_MEM_HOST, p->kid, 0);
	kvt_mem_free(KVT_MEM_HOST, p->pred, 0);
	p->mask = mask;
	p->kid = kid;
	p->pred = pred;
	p->cap = tokens;
	p->l = NULL;
	return 0;
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
	ls_free(c->corr_ls);
	c->corr_ls = NULL;
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
	ls_invalidate(c);
	/* the attended rows are the sinks, then the selection, then the window (positions()); the
	 * selection's positions are ascending, as kvt_corr_apply's merge of the entries needs */
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
