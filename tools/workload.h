/* SPDX-License-Identifier: MIT */
/*
 * A synthetic long-context attention workload for kvbench: keys, values and queries of every layer,
 * head and token, shaped like those of a real decoder (post-RoPE), deterministic from one seed.
 *
 * Why synthetic: a bench must run anywhere without model weights, and every property that decides
 * how well Top-p selection from a 1-bit index works must be present and named. Each vector is a sum
 * of components, each modelling one property of real attention. Sizes below are given in logits
 * (units of q.k / sqrt(D)) so they read the same for every head dimension D.
 *
 * Per layer and KV head h the generator draws an orthonormal frame (Gram-Schmidt of Gaussian
 * vectors): a key subspace B of rank r = max(4, D/8), 2M recency directions, one topic direction
 * per query head of the group, a sink direction, a query-mean direction and one direction per
 * needle. Per query head j (member g of the group of KV head h):
 *
 *   key of token t     k_t = mean_k                                   large shared offset
 *                          + B (c * z_t) + eta * e_t                  low-rank content + iso noise
 *                          + a_rk * rho(t)                            recency (rotating)
 *                          + [t < 4]  w_t * S * s                     attention sinks
 *                          + [t a heavy hitter] H_t * u_topic(t)      sparse heavy hitters
 *                          + [t a needle]  N * n_i                    retrieval needles
 *   value              v_t ~ N(0, I)
 *   query at position t, decode step s (s = -1 for prefill queries)
 *                      q   = mean_q + kappa_j * s + d_j               query mean offset, sink affinity
 *                          + tau_j * (B (c * zeta) / lambda + a_u * u_g + a_r * rho(t))
 *                          + [needle i queried by head j at step s]  nu * n_i
 *
 * - Mean offsets: mean_k has norm 2 sqrt(D) in a random direction, larger than the content (norm
 *   about sqrt(D)), as post-RoPE keys have; mean_q (norm 1.5 sqrt(D), orthogonal to B) is shared by
 *   the group, d_j (norm 0.25 sqrt(D)) makes each head's mean differ a little. The mean terms change
 *   every logit of a query by the same amount except through the isotropic noise e_t, which gives
 *   each token a static importance of about 0.6 logits seen by every head.
 * - Content: z_t ~ N(0, I_r) with spectrum c_i^2 proportional to 1 / (1 + i), summing to
 *   (1 - eta^2) D; eta^2 = 0.15 of the key variance is isotropic. Real keys are close to low rank,
 *   and queries live where keys vary; zeta mixes a per-(sequence, head) part that persists across
 *   positions (weight 1/2 in variance) with a fresh part, so consecutive queries of a head favour
 *   mostly the same tokens. lambda normalizes the content logit to a standard deviation of tau_j.
 * - Sharpness: tau_j runs log-evenly from tau_min to tau_max over the query heads of a layer, in an
 *   order shuffled by the seed so that each group mixes peaked and diffuse heads. A head with tau
 *   near 2.5 puts most of its mass on a few dozen tokens; one near 0.5 spreads it over most of the
 *   context.
 * - Sinks: the first 4 tokens carry the sink direction, weights w = 1, 0.5, 0.35, 0.25; head j sees
 *   token 0 with a bonus of sink_j logits, spread from sink_min to sink_max over heads (its own
 *   shuffled order). The bonus does not grow with the context, so sinks matter less at 128K than 4K.
 * - Recency: rho(t) = M^-1/2 sum_m (cos(w_m t) e_2m + sin(w_m t) e_2m+1) with M = 8 periods
 *   8, 32, ..., 131072 tokens, so <rho(t_q), rho(t)> = mean_m cos(w_m (t_q - t)): a RoPE-like decay
 *   worth `recency` * tau_j logits at distance 0, about half that at a few hundred tokens, near
 *   zero beyond tens of thousands.
 * - Heavy hitters: a fraction `hitter_frac` of the tokens of each (sequence, layer, KV head) carry one
 *   of the group's topic directions; the query head of that topic gives them
 *   tau_j * (hitter_bonus + hitter_spread * |N(0,1)|) extra logits. Other heads do not see them, so
 *   the KV head's union of Top-p sets is wider than any one head's set, as with real GQA.
 * - Needles: `n_needles` tokens per (sequence, layer, KV head) inside the prefill context carry a
 *   direction of their own, and exactly one (decode step, query head of the group) pair asks for
 *   each with `needle_bonus` logits (not scaled by tau): a retrieval that only that query needs.
 *
 * Amplitudes are split between the query side and the key side in proportion to their other
 * content, which keeps ||q - c_q|| * ||k - c_k|| (what bounds any key-compression error) as small as
 * the logit it produces allows. Everything is a function of (seed, sequence, layer, head, position,
 * step): vectors can be produced in any order, more than once, and always agree. Random numbers come
 * from splitmix64-seeded xoshiro256** streams and Box-Muller; results are bit-identical for a seed
 * on one platform (libm's log, sin and cos may differ in the last bit across C libraries).
 */
#ifndef KVBENCH_WORKLOAD_H
#define KVBENCH_WORKLOAD_H

#include <stdint.h>

/* Shape and knobs. Fill with wl_params_default(), then change what is needed. */
typedef struct wl_params {
	uint32_t n_layers, n_q_heads, n_kv_heads, head_dim;
	uint32_t context;     /* prefill tokens per sequence; needles are placed inside it */
	uint32_t steps;       /* decode steps; needle queries are spread over them */
	uint64_t seed;
	float tau_min, tau_max;   /* per-head sharpness (content logit std), default 0.5 .. 2.5 */
	float sink_min, sink_max; /* logit bonus of token 0 per head, default 3 .. 9 */
	float recency;            /* logit bonus (x tau) at distance 0, default 1.5 */
	float hitter_frac;        /* fraction of tokens that are heavy hitters, default 0.004 */
	float hitter_bonus;       /* logit bonus (x tau) of a heavy hitter for its head, default 3 */
	float hitter_spread;      /* plus this times |N(0,1)|, default 2 */
	uint32_t n_needles;       /* per (sequence, layer, KV head), default 4 */
	float needle_bonus;       /* logits, default 12 */
} wl_params;

typedef struct wl wl;

/* Defaults for everything but the shape, which the caller sets. */
void wl_params_default(wl_params *p);

/* Build the per-layer, per-head frames. Returns 0, -EINVAL (bad shape: n_q_heads not a multiple of
 * n_kv_heads, head_dim not a multiple of 8 or outside 32..512, a zero count, tau or sink bounds reversed) or
 * -ENOMEM. */
int wl_create(const wl_params *p, wl **out);
void wl_destroy(wl *w);

/* Key and value (head_dim floats each) of token `pos` of sequence `seq` on `layer`, KV head `kvh`. */
void wl_kv(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t pos, float *k,
	   float *v);

/* Query (head_dim floats) of query head `qh` for the token at `pos`; `step` is the decode step
 * index (0-based) for decode queries, -1 for prefill queries (which never ask for needles). */
void wl_query(const wl *w, uint32_t seq, uint32_t layer, uint32_t qh, uint32_t pos, int32_t step,
	      float *q);

/* Sharpness tau_j and token-0 sink bonus of query head `qh` on `layer`. */
float wl_head_tau(const wl *w, uint32_t layer, uint32_t qh);
float wl_head_sink(const wl *w, uint32_t layer, uint32_t qh);

/* Round-to-nearest-even conversions between float and IEEE binary16 / bfloat16 bit patterns.
 * Overflow rounds to infinity, NaN stays NaN (quiet), binary16 subnormals are exact. */
uint16_t wl_f32_to_f16(float f);
float wl_f16_to_f32(uint16_t h);
uint16_t wl_f32_to_bf16(float f);
float wl_bf16_to_f32(uint16_t h);

#endif /* KVBENCH_WORKLOAD_H */
