/* SPDX-License-Identifier: MIT */
/*
 * A synthetic long-context attention workload for kvbench: keys, values and queries of every layer,
 * head and token, shaped like those of a real decoder (post-RoPE), deterministic from one seed.
 *
 * Why synthetic: a bench must run anywhere without model weights, and every property that decides
 * how well Top-p selection from a 1-bit key index works must be present and named. Each vector is a
 * sum of components, each modelling one property of real attention. Sizes are given in logits
 * (units of q.k / sqrt(D)) so they read the same for every head dimension D.
 *
 * Per layer and KV head the generator draws an orthonormal frame (Gram-Schmidt of Gaussian vectors):
 * a key subspace B of rank r = max(4, D/8), 2M = 32 recency directions e, one topic direction u_g
 * per query head of the group, a sink direction s, a query-mean direction and one direction n_i per
 * needle. For query head j, member g of the group of KV head h:
 *
 *   key of token t     k_t = mean_k                                   large shared offset
 *                          + B (c * z_t) + eta * e_t                  low-rank content + iso noise
 *                          + a_rk * rho(t)                            recency (rotating)
 *                          + [t < 4]  w_t * S * s                     attention sinks
 *                          + [t a heavy hitter of topic g'] H_t u_g'  sparse heavy hitters
 *                          + [t = needle i]  N * n_i                  retrieval needles
 *   value              v_t ~ N(0, I)
 *   query at position t, decode step s (s = -1 for prefill queries)
 *                      q   = mean_q + kappa_j * s + d_j               query mean offset, sink affinity
 *                          + tau_j * (B (c * zeta) / lambda           content
 *                                     + X0 * u_g                      the head's persistent direction
 *                                     + a_r * rho(t)                  recency
 *                                     + [head j asks needle i at step s] X0 * n_i)
 *
 * - Mean offsets: mean_k has norm 2 sqrt(D) in a random direction, larger than the content (norm
 *   sqrt(D)), as post-RoPE keys have. mean_q (norm 1.5 sqrt(D), orthogonal to the key content) is
 *   shared by the group; d_j (norm 0.25 sqrt(D)) makes each head's mean differ a little. The mean
 *   terms shift all logits of a query alike, except through the isotropic key noise: every token
 *   gets a static importance of about 0.6 logits (std) that all heads see.
 * - Content: z_t ~ N(0, I_r) with spectrum c_i^2 proportional to 1 / (1 + i), summing to
 *   (1 - eta^2) D; eta^2 = 0.15 of the key content variance is isotropic. Real keys are close to low
 *   rank and queries live where keys vary. zeta mixes a per-(sequence, head) part that persists over
 *   positions (half the variance) with a fresh part, so consecutive queries of a head favour mostly
 *   the same tokens. lambda makes the content logit's standard deviation over tokens tau_j.
 * - Sharpness: tau_j runs log-evenly from tau_min to tau_max over the query heads of a layer, in an
 *   order shuffled by the seed, so each group mixes peaked and diffuse heads. tau scales every
 *   directional part of the query (it is an inverse temperature): a head near tau_max puts most of
 *   its mass on a few heavy hitters, one near tau_min spreads it over thousands of tokens.
 * - Sinks: the first 4 tokens carry the sink direction with weights 1, 0.5, 0.35, 0.25; head j sees
 *   token 0 with a bonus of sink_j logits, spread log-evenly from sink_min to sink_max over heads
 *   (its own shuffled order). The bonus does not grow with the context, so sinks matter less at 128K
 *   than at 4K, as in real models.
 * - Recency: rho(t) = M^-1/2 sum_m (cos(w_m t) e_2m + sin(w_m t) e_2m+1), M = 16 periods spaced
 *   geometrically from 32 to 65536 tokens, so <rho(t_q), rho(t)> = mean_m cos(w_m (t_q - t)): a
 *   RoPE-like decay worth `recency` * tau_j logits at distance 0, 0.9 of that at 8 tokens, 0.65 at
 *   64, 0.35 at 512, 0.25 at 1024, then wandering within about +-0.4 (as RoPE's sum of cosines
 *   does). Recent tokens outside the window thus matter.
 * - Heavy hitters: a fraction `hitter_frac` of the tokens of each (sequence, layer, KV head) carry
 *   one of the group's topic directions; the query head of that topic gives such a token
 *   tau_j * (hitter_bonus + hitter_spread * |N(0,1)|) extra logits, the other heads of the group do
 *   not see it: the KV head's union of Top-p sets is wider than any one head's set, as with GQA.
 * - Needles: `n_needles` tokens per (sequence, layer, KV head) in the first 7/8 of the prefill carry
 *   a direction of their own; exactly one (decode step, query head of the group) asks for each, with
 *   tau_j * needle_bonus extra logits: a retrieval that only that query needs. Needle steps are
 *   spread evenly over the decode steps.
 *
 * Amplitudes: a bonus b = <x, y> / sqrt(D) must be split between the query part x and the key part
 * y, and the split matters, since a key-compression error grows with |x| |y|. Recency, present on
 * every key, is split evenly relative to the typical query and key content norms (X0, sqrt(D));
 * topics and needles take a query part as long as the query content (X0) and put the rest on the
 * rare keys that carry them, which makes those keys 2 to 4 times longer than the others.
 *
 * Everything is a function of (seed, sequence, layer, head, position, step): vectors can be made in
 * any order, more than once, and always agree. Random numbers come from splitmix64-seeded
 * xoshiro256** streams and Box-Muller; results are bit-identical for a seed on one platform (libm's
 * log, sin and cos may differ in the last bit across C libraries).
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
	float tau_min, tau_max;   /* per-head sharpness (content logit std), default 0.7 .. 2 */
	float sink_min, sink_max; /* logit bonus of token 0 per head, default 4 .. 11 */
	float recency;            /* logit bonus (x tau) at distance 0, default 5 */
	float hitter_frac;        /* fraction of tokens that are heavy hitters, default 0.004 */
	float hitter_bonus;       /* logit bonus (x tau) of a heavy hitter for its head, default 6 */
	float hitter_spread;      /* plus this times |N(0,1)| (x tau), default 1.5 */
	uint32_t n_needles;       /* per (sequence, layer, KV head), default 4 */
	float needle_bonus;       /* logit bonus (x tau) for the asking query, default 10 */
} wl_params;

typedef struct wl wl;

/* Defaults for everything but the shape, which the caller sets. */
void wl_params_default(wl_params *p);

/* Build the per-layer, per-head frames. Returns 0, -EINVAL (bad shape: n_q_heads not a multiple of
 * n_kv_heads, head_dim not a multiple of 8 or outside 32..512, a zero count, tau or sink bounds reversed) or
 * -ENOMEM. */
int wl_create(const wl_params *p, wl **out);
void wl_destroy(wl *w);

/*
 * Token `pos` of sequence `seq` on `layer`, KV head `kvh` (one call shares the recency vector
 * between the key and the group's queries):
 *   k, v: head_dim floats each, or k = NULL (then v is not written)
 *   q: [group, head_dim] floats, the queries of the group's heads for this position, or NULL
 *   asked: [group], receives the position of the needle each query asks for, or -1; may be NULL
 * `step` is the decode step index (0-based) for decode queries, -1 for prefill queries, which never
 * ask for needles.
 */
void wl_token(const wl *w, uint32_t seq, uint32_t layer, uint32_t kvh, uint32_t pos, int32_t step,
	      float *k, float *v, float *q, int64_t *asked);

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
