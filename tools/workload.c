/* SPDX-License-Identifier: MIT */
/* The synthetic workload of kvbench; the model it follows is described in workload.h. */
#include "workload.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define WL_SINKS 4u     /* tokens that carry the sink direction */
#define WL_FREQS 16u    /* recency rotation frequencies (M): enough that echoes stay small */
#define WL_REC_P0 32.0   /* shortest recency period, tokens */
#define WL_REC_PMAX 65536.0 /* longest recency period, tokens */
#define WL_MAX_DIM 512u /* rank D/8 fits WL_MAX_RANK */
#define WL_MAX_RANK (WL_MAX_DIM / 8u)
#define WL_ISO2 0.15    /* share of the key content variance that is isotropic (eta^2) */
#define WL_KMEAN 2.0    /* norm of the key mean, in units of sqrt(D) */
#define WL_QMEAN 1.5    /* norm of the shared query mean, in units of sqrt(D) */
#define WL_QDEV 0.25    /* norm of a head's own query-mean deviation, in units of sqrt(D) */
#define WL_SINKAMP 2.0  /* norm of token 0's sink component, in units of sqrt(D) */
#define WL_PERSIST 0.5  /* share of a query's content variance that persists across positions */

static const float wl_sink_weight[WL_SINKS] = {1.0f, 0.5f, 0.35f, 0.25f};

/* Stream kinds: every random quantity has its own stream so vectors are independent. */
enum { S_FRAME = 1, S_KMEAN, S_QDEV, S_PERM_TAU, S_PERM_SINK, S_KEY, S_VAL, S_QHEAD, S_QPOS,
       S_HITTER, S_NEEDLE };

struct wl {
	wl_params p;
	uint32_t d, group, rank, n_frame;
	double omega[WL_FREQS];
	double *rec_cs; /* [context + steps, WL_FREQS, 2]: cos, sin of omega_m t, computed once */
	float *c;      /* [rank] content spectrum */
	float lambda;  /* query content normalizer */
	float eta;     /* isotropic key noise amplitude */
	float a_r, a_rk, a_u, nu, needle_k, sink_amp;
	float *frame;  /* [n_layers, n_kv_heads, n_frame, d] orthonormal (as far as d allows) */
	float *kmean;  /* [n_layers, n_kv_heads, d] */
	float *qmean;  /* [n_layers, n_q_heads, d] */
	float *tau;    /* [n_layers, n_q_heads] */
	float *sink;   /* [n_layers, n_q_heads] */
};

/* ---- random numbers ---------------------------------------------------------------------- */

typedef struct rng {
	uint64_t s[4];
} rng;

static uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t splitmix64(uint64_t *x)
{
	*x += 0x9e3779b97f4a7c15ull;
	return mix64(*x);
}

/* A 64-bit key naming one random quantity; distinct fields give unrelated keys. */
static uint64_t wl_key(const wl *w, uint64_t kind, uint64_t a, uint64_t b, uint64_t c, uint64_t e)
{
	uint64_t f[5] = {kind, a, b, c, e};
	uint64_t h = mix64(w->p.seed ^ 0x6b7662656e6368ull);
	for (int i = 0; i < 5; i++)
		h = mix64(h ^ (f[i] + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)));
	return h;
}

static void rng_seed(rng *r, uint64_t key)
{
	uint64_t x = key;
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

/* xoshiro256** */
static uint64_t rng_next(rng *r)
{
	uint64_t *s = r->s;
	uint64_t out = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return out;
}

/* Uniform in (0, 1]: never 0, so log() in Box-Muller stays finite. */
static double rng_u01(rng *r)
{
	return (double)((rng_next(r) >> 11) + 1) * 0x1p-53;
}

static void rng_gauss(rng *r, float *out, uint32_t n)
{
	for (uint32_t i = 0; i < n; i += 2) {
		double rad = sqrt(-2.0 * log(rng_u01(r)));
		double ang = 2.0 * M_PI * rng_u01(r);
		out[i] = (float)(rad * cos(ang));
		if (i + 1 < n)
			out[i + 1] = (float)(rad * sin(ang));
	}
}

/* ---- small vector helpers ---------------------------------------------------------------- */

static void axpy(uint32_t d, float a, const float *x, float *y)
{
	for (uint32_t i = 0; i < d; i++)
		y[i] += a * x[i];
}

static double dot(uint32_t d, const float *x, const float *y)
{
	double s = 0;
	for (uint32_t i = 0; i < d; i++)
		s += (double)x[i] * y[i];
	return s;
}

static void scale_to(uint32_t d, float *x, double norm)
{
	double n = sqrt(dot(d, x, x));
	for (uint32_t i = 0; i < d; i++)
		x[i] = (float)(x[i] * (norm / n));
}

/* ---- construction ------------------------------------------------------------------------ */

/* Frame slots of one (layer, KV head). */
static uint32_t f_rec(const wl *w, uint32_t i) { return w->rank + i; }
static uint32_t f_topic(const wl *w, uint32_t g) { return w->rank + 2 * WL_FREQS + g; }
static uint32_t f_sink(const wl *w) { return f_topic(w, w->group); }
static uint32_t f_qmean(const wl *w) { return f_sink(w) + 1; }
static uint32_t f_needle(const wl *w, uint32_t i) { return f_qmean(w) + 1 + i; }

static float *frame_vec(const wl *w, uint32_t layer, uint32_t kvh, uint32_t slot)
{
	size_t idx = ((size_t)layer * w->p.n_kv_heads + kvh) * w->n_frame + slot;
	return w->frame + idx * w->d;
}

/* Gram-Schmidt over Gaussian vectors; once d vectors exist, later ones are only normalized
 * (random unit vectors are nearly orthogonal in high dimension, which is all they need to be). */
static void build_frame(wl *w, uint32_t layer, uint32_t kvh)
{
	for (uint32_t j = 0; j < w->n_frame; j++) {
		float *v = frame_vec(w, layer, kvh, j);
		rng r;
		rng_seed(&r, wl_key(w, S_FRAME, layer, kvh, j, 0));
		rng_gauss(&r, v, w->d);
		for (uint32_t pass = 0; pass < 2 && j < w->d; pass++)
			for (uint32_t i = 0; i < j; i++) {
				const float *u = frame_vec(w, layer, kvh, i);
				axpy(w->d, (float)-dot(w->d, u, v), u, v);
			}
		scale_to(w->d, v, 1.0);
	}
}

/* A seeded permutation of 0..n-1 (Fisher-Yates), so head properties spread without following
 * head order. */
static void permutation(const wl *w, uint64_t kind, uint32_t layer, uint32_t n, uint32_t *perm)
{
	rng r;
	rng_seed(&r, wl_key(w, kind, layer, 0, 0, 0));
	for (uint32_t i = 0; i < n; i++)
		perm[i] = i;
	for (uint32_t i = n - 1; i > 0; i--) {
		uint32_t j = (uint32_t)(rng_next(&r) % (i + 1));
		uint32_t t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
}

/* Log-even spread of [lo, hi] over the heads of a layer, in the order of a seeded permutation. */
static void spread_heads(const wl *w, uint64_t kind, uint32_t layer, float lo, float hi, float *out,
			 uint32_t *perm)
{
	uint32_t n = w->p.n_q_heads;
	permutation(w, kind, layer, n, perm);
	for (uint32_t j = 0; j < n; j++) {
		double f = n > 1 ? (double)perm[j] / (n - 1) : 0.5;
		out[j] = (float)(lo * pow(hi / lo, f));
	}
}

static void build_means(wl *w, uint32_t layer, uint32_t *perm)
{
	uint32_t d = w->d;
	double sd = sqrt((double)d);
	for (uint32_t h = 0; h < w->p.n_kv_heads; h++) {
		float *km = w->kmean + ((size_t)layer * w->p.n_kv_heads + h) * d;
		rng r;
		rng_seed(&r, wl_key(w, S_KMEAN, layer, h, 0, 0));
		rng_gauss(&r, km, d);
		scale_to(d, km, WL_KMEAN * sd);
	}
	float *tau = w->tau + (size_t)layer * w->p.n_q_heads;
	float *sink = w->sink + (size_t)layer * w->p.n_q_heads;
	spread_heads(w, S_PERM_TAU, layer, w->p.tau_min, w->p.tau_max, tau, perm);
	spread_heads(w, S_PERM_SINK, layer, w->p.sink_min, w->p.sink_max, sink, perm);
	for (uint32_t j = 0; j < w->p.n_q_heads; j++) {
		uint32_t h = j / w->group;
		float *qm = w->qmean + ((size_t)layer * w->p.n_q_heads + j) * d;
		rng r;
		rng_seed(&r, wl_key(w, S_QDEV, layer, j, 0, 0));
		rng_gauss(&r, qm, d);
		scale_to(d, qm, WL_QDEV * sd);
		axpy(d, (float)(WL_QMEAN * sd), frame_vec(w, layer, h, f_qmean(w)), qm);
		/* <q, S w_t s> / sqrt(D) = sink_j w_t for token t */
		axpy(d, (float)(sink[j] * sd / w->sink_amp), frame_vec(w, layer, h, f_sink(w)), qm);
	}
}

/* Content spectrum and the amplitudes that turn logit targets into vector norms. The recency bonus
 * b = <x, y> / sqrt(D), on every key, is split as |x| = sqrt(b sqrt(D) X0 / R0) and
 * |y| = sqrt(b sqrt(D) R0 / X0), X0 and R0 being the typical query and key content norms: the split
 * with the smallest |x| |y|, which bounds any key-compression error. */
static void build_scales(wl *w)
{
	uint32_t d = w->d;
	double sd = sqrt((double)d), harm = 0, c2 = 0, c4 = 0;
	for (uint32_t i = 0; i < w->rank; i++)
		harm += 1.0 / (1.0 + i);
	for (uint32_t i = 0; i < w->rank; i++) {
		double ci2 = (1.0 - WL_ISO2) * d / (1.0 + i) / harm;
		w->c[i] = (float)sqrt(ci2);
		c2 += ci2;
		c4 += ci2 * ci2;
	}
	w->eta = (float)sqrt(WL_ISO2);
	w->lambda = (float)(sqrt(c4) / sd);
	double x0 = sqrt(c2) / w->lambda, r0 = sd;
	double pr = w->p.recency * sd, pn = w->p.needle_bonus * sd;
	w->a_r = (float)sqrt(pr * x0 / r0);
	w->a_rk = (float)sqrt(pr * r0 / x0);
	/* The topic and needle parts of a query are as long as its content part; the key side
	 * carries the rest of the bonus. */
	w->a_u = (float)x0;
	w->nu = (float)x0;
	w->needle_k = (float)(pn / x0);
	w->sink_amp = (float)(WL_SINKAMP * sd);
	for (uint32_t m = 0; m < WL_FREQS; m++)
		w->omega[m] = 2.0 * M_PI /
			      (WL_REC_P0 * pow(WL_REC_PMAX / WL_REC_P0, m / (WL_FREQS - 1.0)));
}

void wl_params_default(wl_params *p)
{
	memset(p, 0, sizeof(*p));
	p->seed = 1;
	p->tau_min = 0.7f;
	p->tau_max = 2.0f;
	p->sink_min = 4.0f;
	p->sink_max = 11.0f;
	p->recency = 5.0f;
	p->hitter_frac = 0.004f;
	p->hitter_bonus = 6.0f;
	p->hitter_spread = 1.5f;
	p->n_needles = 4;
	p->needle_bonus = 10.0f;
}

static bool params_ok(const wl_params *p)
{
	return p->n_layers && p->n_q_heads && p->n_kv_heads && p->n_q_heads % p->n_kv_heads == 0 &&
	       p->head_dim >= 32 && p->head_dim <= WL_MAX_DIM && p->head_dim % 8 == 0 &&
	       p->context && p->tau_min > 0 && p->tau_min <= p->tau_max && p->sink_min > 0 &&
	       p->sink_min <= p->sink_max && p->hitter_frac >= 0 && p->hitter_frac <= 1;
}

int wl_create(const wl_params *p, wl **out)
{
	if (!p || !out || !params_ok(p))
		return -EINVAL;
	wl *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	w->p = *p;
	w->d = p->head_dim;
	w->group = p->n_q_heads / p->n_kv_heads;
	w->rank = w->d / 8 > 4 ? w->d / 8 : 4;
	w->n_frame = f_needle(w, p->n_needles);
	size_t kv = (size_t)p->n_layers * p->n_kv_heads, qh = (size_t)p->n_layers * p->n_q_heads;
	w->c = calloc(w->rank, sizeof(float));
	w->frame = calloc(kv * w->n_frame * w->d, sizeof(float));
	w->kmean = calloc(kv * w->d, sizeof(float));
	w->qmean = calloc(qh * w->d, sizeof(float));
	w->tau = calloc(qh, sizeof(float));
	w->sink = calloc(qh, sizeof(float));
	w->rec_cs = calloc(((size_t)p->context + p->steps) * 2 * WL_FREQS, sizeof(double));
	uint32_t *perm = calloc(p->n_q_heads, sizeof(uint32_t));
	if (!w->c || !w->frame || !w->kmean || !w->qmean || !w->tau || !w->sink || !w->rec_cs ||
	    !perm) {
		free(perm);
		wl_destroy(w);
		return -ENOMEM;
	}
	build_scales(w);
	for (size_t t = 0; t < (size_t)p->context + p->steps; t++)
		for (uint32_t m = 0; m < WL_FREQS; m++) {
			w->rec_cs[(t * WL_FREQS + m) * 2] = cos(w->omega[m] * (double)t);
			w->rec_cs[(t * WL_FREQS + m) * 2 + 1] = sin(w->omega[m] * (double)t);
		}
	for (uint32_t l = 0; l < p->n_layers; l++) {
		for (uint32_t h = 0; h < p->n_kv_heads; h++)
			build_frame(w, l, h);
		build_means(w, l, perm);
	}
	free(perm);
	*out = w;
	return 0;
}

void wl_destroy(wl *w)
{
	if (!w)
		return;
	free(w->c);
	free(w->frame);
	free(w->kmean);
	free(w->qmean);
	free(w->tau);
	free(w->sink);
	free(w->rec_cs);
	free(w);
}

/* ---- token properties -------------------------------------------------------------------- */

typedef struct needle {
	uint32_t pos, step, head; /* head: member of the KV head's group that asks */
} needle;

/* Needle i of (seq, layer, kvh): inside the first 7/8 of the context, past the sinks, asked for
 * once, the needles of one KV head spread evenly over the decode steps. false: no such needle. */
static bool needle_at(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t i,
		      needle *n)
{
	uint32_t ctx = w->p.context;
	if (i >= w->p.n_needles || ctx < 8 * WL_SINKS)
		return false;
	uint64_t h = wl_key(w, S_NEEDLE, seq, layer, kvh, i);
	uint32_t span = ctx - ctx / 8 - WL_SINKS;
	uint32_t steps = w->p.steps ? w->p.steps : 1;
	uint32_t slot = steps / w->p.n_needles ? steps / w->p.n_needles : 1;
	n->pos = WL_SINKS + (uint32_t)(h % span);
	h = mix64(h);
	n->step = (uint32_t)((i * (uint64_t)steps / w->p.n_needles + h % slot) % steps);
	h = mix64(h);
	n->head = (uint32_t)(h % w->group);
	if (steps < w->p.n_needles) { /* needles share steps: each its own query head of the step */
		const uint64_t base = wl_key(w, S_NEEDLE, seq, layer, kvh, w->p.n_needles);
		n->step = i % steps;
		n->head = (uint32_t)((base + i / steps) % w->group);
	}
	return true;
}

/* Heavy-hitter status of a token: its topic (query head of the group) and key amplitude, or 0. */
static float hitter_amp(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t pos,
			uint32_t *topic)
{
	if (pos < WL_SINKS)
		return 0.0f;
	uint64_t h = wl_key(w, S_HITTER, seq, layer, kvh, pos);
	if ((double)(h >> 11) * 0x1p-53 >= w->p.hitter_frac)
		return 0.0f;
	rng r;
	rng_seed(&r, h);
	*topic = (uint32_t)(rng_next(&r) % w->group);
	float g[2];
	rng_gauss(&r, g, 2);
	double bonus = w->p.hitter_bonus + w->p.hitter_spread * fabs(g[0]);
	return (float)(bonus * sqrt((double)w->d) / w->a_u);
}

static void rec_phase(const wl *w, uint32_t t, double *cs)
{
	if (t < w->p.context + w->p.steps) {
		memcpy(cs, w->rec_cs + (size_t)t * 2 * WL_FREQS, 2 * WL_FREQS * sizeof(double));
		return;
	}
	for (uint32_t m = 0; m < WL_FREQS; m++) {
		cs[2 * m] = cos(w->omega[m] * t);
		cs[2 * m + 1] = sin(w->omega[m] * t);
	}
}

/* rho(t): the rotating recency vector of a KV head (unit norm), shared by its key and queries. */
static void recency_vec(const wl *w, uint32_t layer, uint32_t kvh, uint32_t t, float *rho)
{
	double cs[2 * WL_FREQS];
	rec_phase(w, t, cs);
	memset(rho, 0, w->d * sizeof(float));
	for (uint32_t i = 0; i < 2 * WL_FREQS; i++)
		axpy(w->d, (float)(cs[i] / sqrt((double)WL_FREQS)), frame_vec(w, layer, kvh, f_rec(w, i)),
		     rho);
}

static void make_kv(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t pos,
		    const float *rho, float *k, float *v)
{
	uint32_t d = w->d;
	float z[WL_MAX_RANK];
	rng r;
	rng_seed(&r, wl_key(w, S_KEY, seq, layer, kvh, pos));
	/* Sinks keep a weaker content part: their attention comes from the sink direction. */
	float content = pos < WL_SINKS ? 0.5f : 1.0f;
	rng_gauss(&r, k, d);
	for (uint32_t i = 0; i < d; i++)
		k[i] *= content * w->eta;
	axpy(d, 1.0f, w->kmean + ((size_t)layer * w->p.n_kv_heads + kvh) * d, k);
	rng_gauss(&r, z, w->rank);
	for (uint32_t i = 0; i < w->rank; i++)
		axpy(d, content * w->c[i] * z[i], frame_vec(w, layer, kvh, i), k);
	axpy(d, w->a_rk, rho, k);
	if (pos < WL_SINKS)
		axpy(d, wl_sink_weight[pos] * w->sink_amp, frame_vec(w, layer, kvh, f_sink(w)), k);
	uint32_t topic = 0;
	float amp = hitter_amp(w, seq, layer, kvh, pos, &topic);
	if (amp > 0)
		axpy(d, amp, frame_vec(w, layer, kvh, f_topic(w, topic)), k);
	needle n;
	for (uint32_t i = 0; needle_at(w, seq, layer, kvh, i, &n); i++)
		if (n.pos == pos)
			axpy(d, w->needle_k, frame_vec(w, layer, kvh, f_needle(w, i)), k);
	rng_seed(&r, wl_key(w, S_VAL, seq, layer, kvh, pos));
	rng_gauss(&r, v, d);
}

static int64_t make_query(const wl *w, uint32_t seq, uint32_t layer, uint32_t qh, uint32_t pos,
			  int32_t step, const float *rho, float *q)
{
	uint32_t d = w->d, kvh = qh / w->group, g = qh % w->group;
	float zh[WL_MAX_RANK], zp[WL_MAX_RANK];
	float tau = wl_head_tau(w, layer, qh);
	rng r;
	rng_seed(&r, wl_key(w, S_QHEAD, seq, layer, qh, 0));
	rng_gauss(&r, zh, w->rank);
	rng_seed(&r, wl_key(w, S_QPOS, seq, layer, qh, pos));
	rng_gauss(&r, zp, w->rank);
	memcpy(q, w->qmean + ((size_t)layer * w->p.n_q_heads + qh) * d, d * sizeof(float));
	float ws = sqrtf((float)WL_PERSIST), wp = sqrtf(1.0f - (float)WL_PERSIST);
	for (uint32_t i = 0; i < w->rank; i++) {
		float zeta = ws * zh[i] + wp * zp[i];
		axpy(d, tau * w->c[i] * zeta / w->lambda, frame_vec(w, layer, kvh, i), q);
	}
	axpy(d, tau * w->a_u, frame_vec(w, layer, kvh, f_topic(w, g)), q);
	axpy(d, tau * w->a_r, rho, q);
	needle n;
	int64_t asked = -1;
	for (uint32_t i = 0; step >= 0 && needle_at(w, seq, layer, kvh, i, &n); i++)
		if (n.step == (uint32_t)step && n.head == g) {
			axpy(d, tau * w->nu, frame_vec(w, layer, kvh, f_needle(w, i)), q);
			asked = n.pos;
		}
	return asked;
}

void wl_token(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t pos, int32_t step,
	      float *k, float *v, float *q, int64_t *asked)
{
	float rho[WL_MAX_DIM];
	recency_vec(w, layer, kvh, pos, rho);
	if (k)
		make_kv(w, seq, layer, kvh, pos, rho, k, v);
	for (uint32_t g = 0; q && g < w->group; g++) {
		int64_t a = make_query(w, seq, layer, kvh * w->group + g, pos, step, rho,
				       q + (size_t)g * w->d);
		if (asked)
			asked[g] = a;
	}
}

float wl_head_tau(const wl *w, uint32_t layer, uint32_t qh)
{
	return w->tau[(size_t)layer * w->p.n_q_heads + qh];
}

float wl_head_sink(const wl *w, uint32_t layer, uint32_t qh)
{
	return w->sink[(size_t)layer * w->p.n_q_heads + qh];
}

/* ---- half-precision conversions ---------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
	uint32_t x;
	memcpy(&x, &f, sizeof(x));
	return x;
}

static float bits_f32(uint32_t x)
{
	float f;
	memcpy(&f, &x, sizeof(f));
	return f;
}

/* Round `m` right by `shift` bits to nearest, ties to even. */
static uint32_t round_shift(uint32_t m, uint32_t shift)
{
	uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
	return q + (rem > half || (rem == half && (q & 1u)));
}

uint16_t wl_f32_to_f16(float f)
{
	uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
	if (a > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
		return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
	if (a >= 0x477ff000u) /* at or past the midpoint between 65504 and 65536: rounds to inf */
		return (uint16_t)(sign | 0x7c00u);
	if (a >= 0x38800000u) /* normal in binary16: rebias, round 23 -> 10 mantissa bits */
		return (uint16_t)(sign | round_shift(a - 0x38000000u, 13));
	/* subnormal in binary16: units of 2^-24; a value of mant * 2^(e - 150) */
	uint32_t e = a >> 23, shift = 126 - e;
	if (shift > 24)
		return (uint16_t)sign;
	uint32_t mant = (a & 0x7fffffu) | (e ? 0x800000u : 0);
	return (uint16_t)(sign | round_shift(mant, shift));
}

float wl_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
	if (e == 0) {
		float f = (float)m * 0x1p-24f;
		return sign ? -f : f;
	}
	if (e == 31)
		return bits_f32(sign | 0x7f800000u | (m << 13));
	return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t wl_f32_to_bf16(float f)
{
	uint32_t x = f32_bits(f);
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40u);
	x += 0x7fffu + ((x >> 16) & 1u);
	return (uint16_t)(x >> 16);
}

float wl_bf16_to_f32(uint16_t h)
{
	return bits_f32((uint32_t)h << 16);
}
