/* SPDX-License-Identifier: MIT */
/*
 * Exact attention: kvt_attention against a double-precision reference on random fp16 and bf16
 * rows, the library's fp16/bf16 conversions against the tests' own, and kvt_attend through the
 * public API with p = 1 (every token selected) against full attention over all tokens.
 */
#include "common.h"
#include "half.h"
#include "half_vec.h"

static const uint32_t dims[3] = {64, 128, 256};
static const uint32_t dtypes[2] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};

/* ---- conversions ------------------------------------------------------------------------- */

static void test_half_conversions(void **state)
{
	(void)state;
	for (uint32_t h = 0; h < 65536; h++) {
		float a = kvt_f16_to_f32((uint16_t)h), b = t_h2f((uint16_t)h);
		T_CHECK(t_fbits(a) == t_fbits(b) || (isnan(a) && isnan(b)),
			"f16 0x%04x -> f32: got 0x%08x, wanted 0x%08x", h, t_fbits(a), t_fbits(b));
		a = kvt_bf16_to_f32((uint16_t)h);
		b = t_bf2f((uint16_t)h);
		T_CHECK(t_fbits(a) == t_fbits(b), "bf16 0x%04x -> f32: got 0x%08x, wanted 0x%08x", h,
			t_fbits(a), t_fbits(b));
	}
	/* the four-lane conversion the attention pass uses, lane for lane the scalar one's bits, on
	 * every value (nan payloads included) and every lane position */
	uint16_t all[65536 + 3];
	for (uint32_t h = 0; h < 65536 + 3; h++)
		all[h] = (uint16_t)(h * 40503u); /* a permutation: special values meet normal ones */
	for (uint32_t i = 0; i < 65536; i++)
		for (int ti = 0; ti < 2; ti++) {
			const kvt_v4f v = kvt_load4(all, i, dtypes[ti]);
			for (uint32_t e = 0; e < 4; e++)
				T_CHECK(t_fbits(v[e]) == t_fbits(kvt_load(all, i + e, dtypes[ti])),
					"%s 0x%04x in lane %u of four: got 0x%08x, wanted 0x%08x",
					t_dtype_name(dtypes[ti]), all[i + e], e, t_fbits(v[e]),
					t_fbits(kvt_load(all, i + e, dtypes[ti])));
		}
	/* every fp16 value and the midpoints between neighbours round trip / round to even */
	t_rng rng;
	t_rng_seed(&rng, 0x4a1f);
	for (uint32_t i = 0; i < 400000; i++) {
		uint32_t u;
		if (i < 65536) { /* midpoints between fp16 neighbours: ties */
			float lo = t_h2f((uint16_t)i), hi = t_h2f((uint16_t)(i + 1));
			if (!isfinite(lo) || !isfinite(hi) || (i & 0x7fff) == 0x7bff)
				continue;
			u = t_fbits((float)(((double)lo + hi) / 2));
		} else {
			u = (uint32_t)t_next(&rng);
			if (i & 1) /* exponents from fp16 subnormals to overflow */
				u = (u & 0x807fffffu) | ((100u + t_below(&rng, 48)) << 23);
		}
		float f = t_bitsf(u);
		if (isnan(f))
			continue;
		uint16_t a = kvt_f32_to_f16(f), b = t_f2h(f);
		T_CHECK(a == b, "f32 %.9g (0x%08x) -> f16: got 0x%04x, wanted 0x%04x (seed 0x%llx)",
			(double)f, u, a, b, (unsigned long long)rng.seed);
		a = kvt_f32_to_bf16(f);
		b = t_f2bf(f);
		T_CHECK(a == b, "f32 %.9g (0x%08x) -> bf16: got 0x%04x, wanted 0x%04x", (double)f, u,
			a, b);
	}
}

/* ---- kvt_attention ------------------------------------------------------------------------ */

static void test_attention_kernel(void **state)
{
	(void)state;
	const uint32_t ns[] = {1, 2, 7, 100, 1500};
	const float scales[] = {0, 0.3f}; /* 0: 1/sqrt(d) */
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 2; ti++)
			for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
				for (int si = 0; si < 2; si++) {
					uint32_t d = dims[di], dt = dtypes[ti], n = ns[ni];
					float scale = scales[si] ? scales[si] : 1.0f / sqrtf((float)d);
					uint64_t seed = 0xa77e0000u + di * 1000 + ti * 100 + ni * 10 + si;
					t_rng rng;
					t_rng_seed(&rng, seed);
					uint16_t *rows = (uint16_t *)t_alloc(2 * 2 * (size_t)d * n);
					float *kf = (float *)t_alloc(4 * (size_t)d * n);
					float *vf = (float *)t_alloc(4 * (size_t)d * n);
					const void **rp = (const void **)t_alloc(sizeof(void *) * n);
					const float **kp = (const float **)t_alloc(sizeof(float *) * n);
					const float **vp = (const float **)t_alloc(sizeof(float *) * n);
					float q[KVT_MAX_HEAD_DIM], out[KVT_MAX_HEAD_DIM];
					double ref[KVT_MAX_HEAD_DIM], mag[KVT_MAX_HEAD_DIM];
					/* scaled scores of std about 2 so the softmax is neither flat nor one-hot */
					double qsd = 2.0 / (scale * sqrt((double)d));
					for (uint32_t j = 0; j < d; j++)
						q[j] = (float)(qsd * t_normal(&rng));
					/* rows stored in reverse order of memory to catch indexing by i */
					for (uint32_t i = 0; i < n; i++) {
						uint16_t *row = rows + (size_t)(n - 1 - i) * 2 * d;
						t_fill(&rng, dt, d, 0.1, 1.0, row, kf + (size_t)i * d);
						t_fill(&rng, dt, d, -0.2, 1.0, row + d, vf + (size_t)i * d);
						rp[i] = row;
						kp[i] = kf + (size_t)i * d;
						vp[i] = vf + (size_t)i * d;
					}
					for (uint32_t j = 0; j < d; j++)
						out[j] = NAN;
					kvt_attention(d, dt, scale, q, n, rp, out);
					t_ref_attention(d, scale, q, n, kp, vp, ref, mag);
					for (uint32_t j = 0; j < d; j++)
						T_CHECK(fabs(out[j] - ref[j]) <= 1e-5 * mag[j],
							"d=%u %s n=%u scale=%g seed 0x%llx: out[%u] got "
							"%.9g, wanted %.9g (rel err %.3g of sum p|v| = %.6g, "
							"wanted < 1e-5)",
							d, t_dtype_name(dt), n, (double)scale,
							(unsigned long long)seed, j, (double)out[j], ref[j],
							fabs(out[j] - ref[j]) / mag[j], mag[j]);
					free(rows);
					free(kf);
					free(vf);
					free(rp);
					free(kp);
					free(vp);
				}
}

/* kvt_attention_group: every query of the group (11, so two passes) gets, bit for bit, what
 * kvt_attention gives it alone. */
static void test_attention_group(void **state)
{
	(void)state;
	enum { G = 11, N = 300 };
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 2; ti++) {
			const uint32_t d = dims[di], dt = dtypes[ti];
			const float scale = 1.0f / sqrtf((float)d);
			t_rng rng;
			t_rng_seed(&rng, 0x67700000u + di * 10 + ti);
			uint16_t *rows = (uint16_t *)t_alloc(2 * 2 * (size_t)d * N);
			float *scratch = (float *)t_alloc(4 * 2 * (size_t)d * N);
			const void **rp = (const void **)t_alloc(sizeof(void *) * N);
			float *q = (float *)t_alloc(4 * (size_t)G * d),
			      *got = (float *)t_alloc(4 * (size_t)G * d), want[KVT_MAX_HEAD_DIM];
			for (uint32_t i = 0; i < N; i++) {
				uint16_t *row = rows + (size_t)i * 2 * d;
				t_fill(&rng, dt, 2 * d, 0.0, 1.0, row, scratch + (size_t)i * 2 * d);
				rp[i] = row;
			}
			for (uint32_t j = 0; j < G * d; j++)
				q[j] = (float)(2.0 * t_normal(&rng));
			kvt_attention_group(d, dt, scale, G, q, N, rp, got, NULL);
			for (uint32_t g = 0; g < G; g++) {
				kvt_attention(d, dt, scale, q + (size_t)g * d, N, rp, want);
				T_CHECK(!memcmp(got + (size_t)g * d, want, 4 * d),
					"d=%u %s: query %u of the group differs from kvt_attention alone",
					d, t_dtype_name(dt), g);
			}
			free(rows);
			free(scratch);
			free(rp);
			free(q);
			free(got);
		}
}

/* ---- the row-by-row rule ------------------------------------------------------------------ */

/*
 * The pass written out row by row and query by query, with the tests' own conversions: the rule
 * lib/attention.c documents (each query's logit a float sum over j ascending, the running maximum,
 * sum and accumulators updated row by row), which the CUDA backend's twins and the score
 * corrections rely on.
 */
static void ref_feed(uint32_t d, uint32_t dt, float scale, uint32_t g, const float *q,
		     const uint32_t *end, uint32_t first, uint32_t n, const uint16_t *const *rows,
		     float *m, float *l, float *acc, float *logits)
{
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t h = 0; h < g; h++) {
			if (end && first + i >= end[h])
				continue;
			float raw = 0.0f, *a = acc + (size_t)h * d;
			for (uint32_t j = 0; j < d; j++)
				raw += q[(size_t)h * d + j] * (dt == KVT_DTYPE_BF16 ? t_bf2f(rows[i][j])
										   : t_h2f(rows[i][j]));
			float s = raw * scale;
			if (s > m[h]) {
				float f = expf(m[h] - s);
				l[h] *= f;
				for (uint32_t j = 0; j < d; j++)
					a[j] *= f;
				m[h] = s;
			}
			float w = expf(s - m[h]);
			l[h] += w;
			for (uint32_t j = 0; j < d; j++)
				a[j] += w * (dt == KVT_DTYPE_BF16 ? t_bf2f(rows[i][d + j])
								  : t_h2f(rows[i][d + j]));
			if (logits)
				logits[(size_t)h * n + i] = raw;
		}
}

/*
 * kvt_attention_feed (rows in random pieces, queries masked by random ends) and
 * kvt_attention_group (logits kept) against that rule, bit for bit: the running state, the
 * outputs and the logits, for group sizes around the four queries the pass scores together and
 * rows holding zeros, subnormals and signed values of every range the dtypes take.
 */
static void test_attention_rule(void **state)
{
	(void)state;
	enum { N = 150, GMAX = 11 };
	const uint32_t gs[] = {1, 3, 4, 5, 8, 11};
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 2; ti++)
			for (size_t gi = 0; gi < sizeof gs / sizeof *gs; gi++) {
				const uint32_t d = dims[di], dt = dtypes[ti], g = gs[gi];
				const float scale = 1.0f / sqrtf((float)d);
				t_rng rng;
				t_rng_seed(&rng, 0x7a1e0000u + di * 100 + ti * 10 + (uint32_t)gi);
				uint16_t *rows = (uint16_t *)t_alloc(2 * 2 * (size_t)d * N);
				const uint16_t **rp = (const uint16_t **)t_alloc(sizeof(void *) * N);
				float *q = (float *)t_alloc(4 * (size_t)GMAX * d);
				float *acc = (float *)t_alloc(4 * (size_t)GMAX * d);
				float *racc = (float *)t_alloc(4 * (size_t)GMAX * d);
				float *out = (float *)t_alloc(4 * (size_t)GMAX * d);
				float *lg = (float *)t_alloc(4 * (size_t)GMAX * N);
				float *rlg = (float *)t_alloc(4 * (size_t)GMAX * N);
				float m[GMAX], l[GMAX], rm[GMAX], rl[GMAX];
				uint32_t end[GMAX];
				for (uint32_t i = 0; i < N; i++) {
					uint16_t *row = rows + (size_t)i * 2 * d;
					for (uint32_t j = 0; j < 2 * d; j++) {
						const uint32_t pick = t_below(&rng, 16);
						float x = (float)t_normal(&rng);
						if (pick == 0)
							x = 0.0f;
						else if (pick == 1) /* fp16 subnormals, tiny bf16 */
							x *= 1e-6f;
						else if (pick == 2)
							x *= 200.0f;
						row[j] = dt == KVT_DTYPE_BF16 ? t_f2bf(x) : t_f2h(x);
					}
					rp[i] = row;
				}
				for (uint32_t j = 0; j < g * d; j++)
					q[j] = (float)(1.5 * t_normal(&rng));
				const uint32_t first = 1000;
				for (uint32_t h = 0; h < g; h++) /* some end before the rows, some past */
					end[h] = first - 5 + t_below(&rng, N + 10);
				kvt_attention_begin(d, g, m, l, acc);
				kvt_attention_begin(d, g, rm, rl, racc);
				ref_feed(d, dt, scale, g, q, end, first, N, rp, rm, rl, racc, NULL);
				for (uint32_t i = 0; i < N;) {
					const uint32_t piece = 1 + t_below(&rng, N - i < 20 ? N - i : 20);
					kvt_attention_feed(d, dt, scale, g, q, end, first + i, piece,
							   (const void *const *)rp + i, m, l, acc);
					i += piece;
				}
				T_CHECK(!memcmp(m, rm, 4 * g) && !memcmp(l, rl, 4 * g) &&
						!memcmp(acc, racc, 4 * (size_t)g * d),
					"d=%u %s g=%u: the masked pass in pieces differs from the rule",
					d, t_dtype_name(dt), g);
				/* the whole pass with logits kept, against the rule unmasked */
				kvt_attention_group(d, dt, scale, g, q, N, (const void *const *)rp, out,
						    lg);
				kvt_attention_begin(d, g, rm, rl, racc);
				ref_feed(d, dt, scale, g, q, NULL, 0, N, rp, rm, rl, racc, rlg);
				kvt_attention_finish(d, g, rl, racc, racc);
				T_CHECK(!memcmp(out, racc, 4 * (size_t)g * d),
					"d=%u %s g=%u: kvt_attention_group's outputs differ from the rule", d,
					t_dtype_name(dt), g);
				T_CHECK(!memcmp(lg, rlg, 4 * (size_t)g * N),
					"d=%u %s g=%u: kvt_attention_group's logits differ from the rule", d,
					t_dtype_name(dt), g);
				free(rows);
				free(rp);
				free(q);
				free(acc);
				free(racc);
				free(out);
				free(lg);
				free(rlg);
			}
}

/* ---- kvt_attend with p = 1 against full attention --------------------------------------- */

/* The keys, values and the decoded floats given to one (sequence, layer). */
struct hist {
	uint32_t n;
	float *k, *v; /* [cap, n_kv, d] decoded */
};

static void hist_add(struct hist *h, uint32_t nkv, uint32_t d, uint32_t dt, const uint16_t *k,
		     const uint16_t *v, uint32_t n)
{
	for (size_t i = 0; i < (size_t)n * nkv * d; i++) {
		h->k[(size_t)h->n * nkv * d + i] = t_dec(dt, k[i]);
		h->v[(size_t)h->n * nkv * d + i] = t_dec(dt, v[i]);
	}
	h->n += n;
}

/* Checks out[n_q, d] for one sequence against full attention over every token given so far. */
static void check_full(const char *what, const kvt_config *cfg, const struct hist *h,
		       const uint16_t *q, const float *out)
{
	uint32_t d = cfg->head_dim, nkv = cfg->n_kv_heads, group = cfg->n_q_heads / nkv;
	const float **kp = (const float **)t_alloc(sizeof(float *) * h->n);
	const float **vp = (const float **)t_alloc(sizeof(float *) * h->n);
	double ref[KVT_MAX_HEAD_DIM], mag[KVT_MAX_HEAD_DIM];
	float qf[KVT_MAX_HEAD_DIM];
	for (uint32_t hq = 0; hq < cfg->n_q_heads; hq++) {
		uint32_t hk = hq / group;
		for (uint32_t i = 0; i < h->n; i++) {
			kp[i] = h->k + ((size_t)i * nkv + hk) * d;
			vp[i] = h->v + ((size_t)i * nkv + hk) * d;
		}
		for (uint32_t j = 0; j < d; j++)
			qf[j] = t_dec(cfg->dtype, q[(size_t)hq * d + j]);
		t_ref_attention(d, 1.0 / sqrt((double)d), qf, h->n, kp, vp, ref, mag);
		for (uint32_t j = 0; j < d; j++) {
			double got = out[(size_t)hq * d + j];
			T_CHECK(fabs(got - ref[j]) <= 1e-5 * mag[j],
				"%s tokens=%u q head %u (kv head %u) out[%u]: got %.9g, wanted %.9g "
				"(err %.3g, allowed %.3g)",
				what, h->n, hq, hk, j, got, ref[j], fabs(got - ref[j]), 1e-5 * mag[j]);
		}
	}
	free(kp);
	free(vp);
}

static void attend_full_case(uint32_t nq, uint32_t nkv, uint32_t d, uint32_t dt)
{
	enum { LAYERS = 2, SEQS = 2, STEPS = 14, CAP = 200 };
	const uint32_t chunks[SEQS][2] = {{70, 0}, {30, 19}}; /* B: two prefill chunks */
	kvt_config cfg = t_config(LAYERS, nq, nkv, d, dt);
	cfg.p = 1.0f;
	cfg.budget_max = 0;
	char what[128];
	snprintf(what, sizeof what, "%s q_heads=%u kv_heads=%u d=%u", t_dtype_name(dt), nq, nkv, d);
	kvt_cache *c = t_create(&cfg);
	t_rng rng;
	t_rng_seed(&rng, 0xa11u * 1000 + nq * 100 + d + dt);
	uint32_t seqs[SEQS];
	struct hist h[SEQS][LAYERS];
	size_t kvn = (size_t)nkv * d, qn = (size_t)nq * d;
	uint16_t *k = (uint16_t *)t_alloc(2 * CAP * kvn), *v = (uint16_t *)t_alloc(2 * CAP * kvn);
	uint16_t *q = (uint16_t *)t_alloc(2 * CAP * qn);
	float *out = (float *)t_alloc(4 * SEQS * qn);
	for (int s = 0; s < SEQS; s++) {
		int rc = kvt_seq_open(c, &seqs[s]);
		T_CHECK(rc == 0, "%s: kvt_seq_open got %d (%s)", what, rc, kvt_last_error(c));
		for (int l = 0; l < LAYERS; l++) {
			h[s][l].n = 0;
			h[s][l].k = (float *)t_alloc(4 * CAP * kvn);
			h[s][l].v = (float *)t_alloc(4 * CAP * kvn);
			for (int ch = 0; ch < 2 && chunks[s][ch]; ch++) {
				uint32_t n = chunks[s][ch];
				t_fill(&rng, dt, n * kvn, 0.3, 1.0, k, NULL);
				t_fill(&rng, dt, n * kvn, 0.0, 1.0, v, NULL);
				t_fill(&rng, dt, n * qn, 0.1, 1.5, q, NULL);
				rc = kvt_prefill(c, seqs[s], (uint32_t)l, l ? q : NULL, k, v, n, NULL);
				T_CHECK(rc == 0, "%s seq %d layer %d chunk %d: kvt_prefill got %d (%s)",
					what, s, l, ch, rc, kvt_last_error(c));
				hist_add(&h[s][l], nkv, d, dt, k, v, n);
			}
		}
	}
	for (int step = 0; step < STEPS; step++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			t_fill(&rng, dt, SEQS * kvn, 0.3, 1.0, k, NULL);
			t_fill(&rng, dt, SEQS * kvn, 0.0, 1.0, v, NULL);
			int rc = kvt_append(c, l, SEQS, seqs, k, v, NULL);
			T_CHECK(rc == 0, "%s step %d layer %u: kvt_append got %d (%s)", what, step, l, rc,
				kvt_last_error(c));
			for (int s = 0; s < SEQS; s++)
				hist_add(&h[s][l], nkv, d, dt, k + s * kvn, v + s * kvn, 1);
			if (step % 3 != 2 && step != STEPS - 1)
				continue;
			t_fill(&rng, dt, SEQS * qn, 0.1, 1.5, q, NULL);
			for (size_t i = 0; i < SEQS * qn; i++)
				out[i] = NAN;
			rc = kvt_attend(c, l, SEQS, seqs, q, out, NULL);
			T_CHECK(rc == 0, "%s step %d layer %u: kvt_attend got %d (%s)", what, step, l, rc,
				kvt_last_error(c));
			for (int s = 0; s < SEQS; s++) {
				char w2[192];
				snprintf(w2, sizeof w2, "%s step %d layer %u seq %d (seed 0x%llx)", what,
					 step, l, s, (unsigned long long)rng.seed);
				T_CHECK(kvt_seq_length(c, seqs[s], l) == h[s][l].n,
					"%s: kvt_seq_length got %lld, wanted %u", w2,
					(long long)kvt_seq_length(c, seqs[s], l), h[s][l].n);
				check_full(w2, &cfg, &h[s][l], q + s * qn, out + s * qn);
			}
		}
	kvt_stats st = t_stats(c);
	T_CHECK(st.flushes > 0, "%s: flushes got %llu, wanted > 0 (appends crossed a flush)", what,
		(unsigned long long)st.flushes);
	kvt_cache_destroy(c);
	for (int s = 0; s < SEQS; s++)
		for (int l = 0; l < LAYERS; l++) {
			free(h[s][l].k);
			free(h[s][l].v);
		}
	free(k);
	free(v);
	free(q);
	free(out);
}

static void test_attend_full_mha(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 2; ti++)
			attend_full_case(2, 2, dims[di], dtypes[ti]);
}

static void test_attend_full_gqa(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 2; ti++)
			attend_full_case(8, 2, dims[di], dtypes[ti]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_half_conversions),
		cmocka_unit_test(test_attention_kernel),
		cmocka_unit_test(test_attention_group),
		cmocka_unit_test(test_attention_rule),
		cmocka_unit_test(test_attend_full_mha),
		cmocka_unit_test(test_attend_full_gqa),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
