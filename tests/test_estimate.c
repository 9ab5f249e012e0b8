/* SPDX-License-Identifier: MIT */
/*
 * The estimator of DESIGN.md: rotations (orthogonal, deterministic, golden bits), the index entry
 * of a key (codes, sigma, beta), the prepared query, the INT4 bit-plane score against its float
 * forms, and the statistical claims: unbiased over random rotations, spread shrinking as 1/sqrt(d).
 */
#include "common.h"

static const uint32_t dims[3] = {64, 128, 256};

/* fp16 rounding of a value v computed in float: at most half an fp16 ulp (<= 2^-11 |v|) plus the
 * float error of computing v (`err`), and 2^-25 absolute for the subnormal range. */
static double f16_tol(double v, double err)
{
	return fabs(v) * 0x1p-11 + err + 0x1p-25;
}

static float *rotation(uint64_t seed, uint32_t layer, uint32_t d)
{
	float *rot = (float *)t_alloc(sizeof(float) * d * d);
	int rc = kvt_rotation_generate(seed, layer, d, rot);
	T_CHECK(rc == 0, "kvt_rotation_generate(seed %llu, layer %u, d %u) got %d, wanted 0",
		(unsigned long long)seed, layer, d, rc);
	return rot;
}

/* ---- rotations --------------------------------------------------------------------------- */

static void test_rotation_orthogonal(void **state)
{
	(void)state;
	const uint64_t seeds[2] = {1, 0x6b767469u};
	for (int di = 0; di < 3; di++)
		for (int si = 0; si < 2; si++)
			for (uint32_t layer = 0; layer < 4; layer += 3) {
				uint32_t d = dims[di];
				float *rot = rotation(seeds[si], layer, d);
				double worst = 0;
				uint32_t wi = 0, wj = 0;
				for (uint32_t i = 0; i < d; i++)
					for (uint32_t j = 0; j < d; j++) {
						double s = 0, t = 0;
						for (uint32_t k = 0; k < d; k++) {
							s += (double)rot[i * d + k] * rot[j * d + k];
							t += (double)rot[k * d + i] * rot[k * d + j];
						}
						double e = fmax(fabs(s - (i == j)), fabs(t - (i == j)));
						if (e > worst) {
							worst = e;
							wi = i;
							wj = j;
						}
					}
				T_CHECK(worst <= 1e-5,
					"d=%u seed=%llu layer=%u: |R R^T - I| at (%u,%u) got %.3g, "
					"wanted <= 1e-5",
					d, (unsigned long long)seeds[si], layer, wi, wj, worst);
				free(rot);
			}
}

static void test_rotation_determinism(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++) {
		uint32_t d = dims[di];
		size_t bytes = sizeof(float) * d * d;
		float *a = rotation(7, 2, d), *b = rotation(7, 2, d);
		float *s = rotation(8, 2, d), *l = rotation(7, 3, d);
		T_CHECK(memcmp(a, b, bytes) == 0, "d=%u: seed 7 layer 2 generated twice differs", d);
		size_t same_s = 0, same_l = 0;
		for (size_t i = 0; i < (size_t)d * d; i++) {
			same_s += a[i] == s[i];
			same_l += a[i] == l[i];
		}
		T_CHECK(same_s < (size_t)d, "d=%u: seed 7 vs seed 8: %zu of %u entries equal, wanted < %u",
			d, same_s, d * d, d);
		T_CHECK(same_l < (size_t)d,
			"d=%u: layer 2 vs layer 3: %zu of %u entries equal, wanted < %u", d, same_l,
			d * d, d);
		free(a);
		free(b);
		free(s);
		free(l);
	}

	/*
	 * Golden bits: FNV-1a 64 over the little-endian bytes of the float bit patterns of
	 * kvt_rotation_generate(seed 1, layer 0, d 64), computed on x86-64 with this library. The
	 * generator uses only correctly rounded operations without contraction, so every IEEE-754
	 * platform must produce exactly these bits: CPU and GPU share one index.
	 */
	const uint64_t golden = 0xd7bb94890c596aa2ull;
	float *g = rotation(1, 0, 64);
	uint32_t *w = (uint32_t *)t_alloc(sizeof(uint32_t) * 64 * 64);
	for (size_t i = 0; i < 64 * 64; i++)
		w[i] = t_fbits(g[i]);
	uint64_t h = t_fnv1a_words(w, 64 * 64);
	T_CHECK(h == golden,
		"rotation(seed 1, layer 0, d 64): FNV-1a got 0x%016llx, wanted 0x%016llx "
		"(R[0][0..1] = %.9g %.9g)",
		(unsigned long long)h, (unsigned long long)golden, (double)g[0], (double)g[1]);
	free(g);
	free(w);
}

/* ---- one index entry and one prepared query against the formulas of DESIGN.md ------------- */

/* Random vector of norm `norm`. */
static void rand_dir(t_rng *r, uint32_t d, double norm, double *v)
{
	double n2 = 0;
	for (uint32_t i = 0; i < d; i++) {
		v[i] = t_normal(r);
		n2 += v[i] * v[i];
	}
	for (uint32_t i = 0; i < d; i++)
		v[i] *= norm / sqrt(n2);
}

/* Checks the entry (code, sigma, beta) of key k against double-precision formulas. */
static void check_entry(const char *what, uint32_t d, const float *rot, const float *c_k,
			const float *c_q, const float *k, const uint32_t *code, uint16_t sigma,
			uint16_t beta)
{
	double r[KVT_MAX_HEAD_DIM], y[KVT_MAX_HEAD_DIM], n2 = 0, l1 = 0, b = 0, babs = 0;
	for (uint32_t i = 0; i < d; i++) {
		r[i] = (double)k[i] - c_k[i];
		n2 += r[i] * r[i];
		b += (double)c_q[i] * k[i];
		babs += fabs((double)c_q[i] * k[i]);
	}
	double n = sqrt(n2);
	for (uint32_t j = 0; j < d; j++) {
		double s = 0;
		for (uint32_t i = 0; i < d; i++)
			s += (double)rot[j * d + i] * r[i];
		y[j] = s / n;
		l1 += fabs(y[j]);
	}
	for (uint32_t j = 0; j < d; j++) {
		if (fabs(y[j]) < 1e-5) /* the sign of a float sum this close to 0 is not defined */
			continue;
		unsigned got = (code[j / 32] >> (j % 32)) & 1u, want = y[j] > 0;
		T_CHECK(got == want, "%s d=%u: code bit %u (word %u bit %u) got %u, wanted %u (y=%.6g)",
			what, d, j, j / 32, j % 32, got, want, y[j]);
	}
	double sig = n / (l1 / sqrt((double)d)), gs = t_h2f(sigma), gb = t_h2f(beta);
	T_CHECK(fabs(gs - sig) <= f16_tol(sig, 1e-5 * sig),
		"%s d=%u: sigma got %.8g (fp16 0x%04x), wanted %.8g rounded to fp16", what, d, gs,
		sigma, sig);
	T_CHECK(fabs(gb - b) <= f16_tol(b, 1e-5 * babs),
		"%s d=%u: beta got %.8g (fp16 0x%04x), wanted %.8g rounded to fp16", what, d, gb, beta,
		b);
}

/* fp16, saturated as the index stores sigma and beta (lib/estimate.c's f16_sat) */
static uint16_t f16_sat_ref(float f)
{
	uint16_t h = t_f2h(f);
	if ((h & 0x7fffu) > 0x7c00u)
		return 0;
	return (h & 0x7fffu) == 0x7c00u ? (uint16_t)((h & 0x8000u) | 0x7bffu) : h;
}

/*
 * The entry's bits by the float rule the GPU twin reproduces (every sum in index order, in float,
 * without contraction: y[j] over i ascending, ||r||^2, ||y||_1 and <c_q, k> over their index), written
 * out here key by key against the library's build of four keys at a time.
 */
static void check_entry_bits(const char *what, uint32_t d, const float *rot, const float *c_k,
			     const float *c_q, const float *k, const uint32_t *code, uint16_t sigma,
			     uint16_t beta)
{
	float r[KVT_MAX_HEAD_DIM], n2 = 0.0f, l1 = 0.0f, b = 0.0f;
	uint32_t want[KVT_MAX_WORDS] = {0};
	for (uint32_t i = 0; i < d; i++) {
		r[i] = k[i] - c_k[i];
		n2 += r[i] * r[i];
	}
	for (uint32_t j = 0; j < d; j++) {
		float y = 0.0f;
		for (uint32_t i = 0; i < d; i++)
			y += rot[j * d + i] * r[i];
		want[j / 32] |= (uint32_t)(y > 0.0f) << (j % 32);
		l1 += fabsf(y);
	}
	for (uint32_t i = 0; i < d; i++)
		b += c_q[i] * k[i];
	const float s = l1 > 0.0f ? n2 / l1 * sqrtf((float)d) : 0.0f;
	T_CHECK(!memcmp(code, want, d / 8) && sigma == f16_sat_ref(s) && beta == f16_sat_ref(b),
		"%s d=%u: the entry differs from the float rule (sigma 0x%04x, wanted 0x%04x; beta "
		"0x%04x, wanted 0x%04x)", what, d, sigma, f16_sat_ref(s), beta, f16_sat_ref(b));
}

static void test_index_entry(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++) {
		/* 43 keys: ten blocks of the four the build rotates together and three more */
		uint32_t d = dims[di], words = d / 32, n = 43, stride = d + 3;
		t_rng rng;
		t_rng_seed(&rng, 0x1de0u + d);
		float *rot = rotation(3, 1, d);
		float *keys = (float *)t_alloc(sizeof(float) * n * stride);
		float c_k[KVT_MAX_HEAD_DIM], c_q[KVT_MAX_HEAD_DIM];
		for (uint32_t i = 0; i < d; i++) {
			c_k[i] = (float)(0.3 + 0.5 * t_normal(&rng));
			c_q[i] = (float)(-0.2 + 0.4 * t_normal(&rng));
		}
		for (uint32_t t = 0; t < n; t++)
			for (uint32_t i = 0; i < stride; i++)
				keys[t * stride + i] =
					i < d ? (float)(c_k[i] + (0.2 + t * 0.1) * t_normal(&rng))
					      : NAN; /* padding the library must not read */
		uint32_t *codes = (uint32_t *)t_alloc(sizeof(uint32_t) * n * words);
		uint16_t *sig = (uint16_t *)t_alloc(2 * n), *bet = (uint16_t *)t_alloc(2 * n);
		kvt_index_build(d, rot, c_k, c_q, n, keys, stride, codes, sig, bet);
		for (uint32_t t = 0; t < n; t++) {
			char what[64];
			snprintf(what, sizeof what, "key %u of a batch (seed 0x%llx)", t,
				 (unsigned long long)rng.seed);
			check_entry(what, d, rot, c_k, c_q, keys + t * stride, codes + t * words,
				    sig[t], bet[t]);
			check_entry_bits(what, d, rot, c_k, c_q, keys + t * stride, codes + t * words,
					 sig[t], bet[t]);
			/* one key at a time gives the same bits as the batch */
			uint32_t c1[KVT_MAX_WORDS];
			uint16_t s1, b1;
			kvt_index_build(d, rot, c_k, c_q, 1, keys + t * stride, stride, c1, &s1, &b1);
			T_CHECK(memcmp(c1, codes + t * words, 4 * words) == 0 && s1 == sig[t] &&
					b1 == bet[t],
				"%s d=%u: single build differs from batch build (sigma 0x%04x vs "
				"0x%04x)",
				what, d, s1, sig[t]);
		}
		/* beta and sigma in fp16's subnormal range (below 2^-14 = 6.1e-5): a key whose
		 * <c_q, k> is about 3e-5, and one within 1e-6 of the centroid */
		{
			double cq2 = 0, b = 0;
			float kb[KVT_MAX_HEAD_DIM], ks[KVT_MAX_HEAD_DIM];
			for (uint32_t i = 0; i < d; i++) {
				cq2 += (double)c_q[i] * c_q[i];
				b += (double)c_q[i] * keys[i];
			}
			for (uint32_t i = 0; i < d; i++) {
				kb[i] = (float)(keys[i] - (b - 3e-5) / cq2 * c_q[i]);
				ks[i] = c_k[i] + (float)(1e-6 * t_normal(&rng));
			}
			uint32_t cb[KVT_MAX_WORDS];
			uint16_t sb, bb;
			kvt_index_build(d, rot, c_k, c_q, 1, kb, d, cb, &sb, &bb);
			check_entry("key with beta ~ 3e-5 (fp16 subnormal)", d, rot, c_k, c_q, kb, cb, sb,
				    bb);
			kvt_index_build(d, rot, c_k, c_q, 1, ks, d, cb, &sb, &bb);
			check_entry("key 1e-6 from the centroid (sigma fp16 subnormal)", d, rot, c_k, c_q,
				    ks, cb, sb, bb);
		}
		/* a key equal to the centroid: code 0, sigma 0 */
		uint32_t c0[KVT_MAX_WORDS];
		uint16_t s0, b0;
		memset(c0, 0xa5, sizeof c0);
		kvt_index_build(d, rot, c_k, c_q, 1, c_k, d, c0, &s0, &b0);
		uint32_t any = 0;
		for (uint32_t w = 0; w < words; w++)
			any |= c0[w];
		T_CHECK(any == 0 && t_h2f(s0) == 0.0f,
			"d=%u zero residual: code OR got 0x%08x, sigma got %g, wanted 0 and 0", d, any,
			(double)t_h2f(s0));
		free(rot);
		free(keys);
		free(codes);
		free(sig);
		free(bet);
	}
}

/* The prepared query against R (q - c_q) in double and its INT4 quantization. */
static void check_query(const char *what, uint32_t d, const float *rot, const float *c_q,
			const float *c_k, const float *q, const kvt_qcode *qc)
{
	double r[KVT_MAX_HEAD_DIM], qn = 0, qck = 0, qckabs = 0;
	for (uint32_t i = 0; i < d; i++) {
		r[i] = (double)q[i] - c_q[i];
		qn += r[i] * r[i];
		qck += r[i] * c_k[i];
		qckabs += fabs(r[i] * c_k[i]);
	}
	qn = sqrt(qn);
	T_CHECK(fabs(qc->qc_ck - qck) <= 1e-5 * qckabs + 1e-30,
		"%s d=%u: qc_ck got %.8g, wanted %.8g", what, d, (double)qc->qc_ck, qck);
	float lo = qc->x[0], hi = qc->x[0];
	uint32_t sum = 0;
	for (uint32_t j = 0; j < d; j++) {
		double x = 0;
		for (uint32_t i = 0; i < d; i++)
			x += (double)rot[j * d + i] * r[i];
		T_CHECK(fabs(qc->x[j] - x) <= 1e-5 * qn, "%s d=%u: x[%u] got %.8g, wanted %.8g", what,
			d, j, (double)qc->x[j], x);
		lo = fminf(lo, qc->x[j]);
		hi = fmaxf(hi, qc->x[j]);
	}
	T_CHECK(qc->x_l == lo, "%s d=%u: x_l got %.9g, wanted min x = %.9g", what, d,
		(double)qc->x_l, (double)lo);
	double dl = ((double)hi - lo) / 15;
	T_CHECK(fabs(qc->delta - dl) <= 1e-6 * dl, "%s d=%u: delta got %.9g, wanted %.9g", what, d,
		(double)qc->delta, dl);
	for (uint32_t j = 0; j < d; j++) {
		double t = ((double)qc->x[j] - qc->x_l) / qc->delta;
		T_CHECK(qc->u[j] <= 15 && fabs(qc->u[j] - t) <= 0.5 + 1e-4,
			"%s d=%u: u[%u] got %u, wanted round(%.6f)", what, d, j, qc->u[j], t);
		for (uint32_t p = 0; p < 4; p++) {
			unsigned got = (qc->planes[p][j / 32] >> (j % 32)) & 1u;
			T_CHECK(got == ((qc->u[j] >> p) & 1u),
				"%s d=%u: plane %u bit %u got %u, wanted bit %u of u=%u", what, d, p,
				j, got, p, qc->u[j]);
		}
		sum += qc->u[j];
	}
	T_CHECK(qc->sum_u == (float)sum, "%s d=%u: sum_u got %g, wanted %u", what, d,
		(double)qc->sum_u, sum);
}

/* INT4 score vs the float forms; returns the INT4 score. */
static float check_score(const char *what, uint32_t d, const kvt_qcode *qc, const uint32_t *code,
			 uint16_t sigma, uint16_t beta)
{
	double isd = 1 / sqrt((double)d), s = t_h2f(sigma), b = t_h2f(beta);
	double eq = 0, ex = 0, mq = 0, mx = 0;
	for (uint32_t j = 0; j < d; j++) {
		double sign = ((code[j / 32] >> (j % 32)) & 1u) ? 1 : -1;
		double xq = (double)qc->delta * qc->u[j] + qc->x_l;
		eq += sign * xq * isd;
		ex += sign * qc->x[j] * isd;
		mq += (fabs((double)qc->delta * qc->u[j]) + fabs(qc->x_l)) * isd;
		mx += fabs(qc->x[j]) * isd;
	}
	/* magnitude of the terms the float evaluation adds up */
	double tq = s * (mq + (double)qc->delta * qc->sum_u * isd + d * fabs(qc->x_l) * isd) +
		    fabs(b) + fabs(qc->qc_ck);
	double tx = s * mx + fabs(b) + fabs(qc->qc_ck);
	float got;
	kvt_score(d, qc, 1, code, &sigma, &beta, &got);
	float fq = kvt_score_float(d, qc, true, code, sigma, beta);
	float fx = kvt_score_float(d, qc, false, code, sigma, beta);
	double want_q = s * eq + b + qc->qc_ck, want_x = s * ex + b + qc->qc_ck;
	T_CHECK(fabs(got - fq) <= 1e-5 * tq, "%s d=%u: kvt_score got %.9g, score_float(quantized) %.9g, "
		"wanted equal within %.3g",
		what, d, (double)got, (double)fq, 1e-5 * tq);
	T_CHECK(fabs(fq - want_q) <= 1e-5 * tq, "%s d=%u: score_float(quantized) got %.9g, wanted %.9g",
		what, d, (double)fq, want_q);
	T_CHECK(fabs(fx - want_x) <= 1e-5 * tx, "%s d=%u: score_float(unquantized) got %.9g, wanted %.9g",
		what, d, (double)fx, want_x);
	/* each coordinate of x is within delta/2 of delta * u + x_l */
	double bound = s * sqrt((double)d) * qc->delta / 2 * (1 + 1e-4) + 1e-5 * (tq + tx);
	T_CHECK(fabs((double)fx - got) <= bound,
		"%s d=%u: |score_float(unquantized) - kvt_score| got %.6g (%.9g vs %.9g), wanted <= "
		"sigma sqrt(d) delta/2 = %.6g",
		what, d, fabs((double)fx - got), (double)fx, (double)got, bound);
	return got;
}

/* ---- unbiasedness and spread over random rotations -------------------------------------- */

#define N_PAIRS 8

/*
 * For d, N_PAIRS (q, k) pairs with ||c_q|| = ||c_k|| = 1, ||q - c_q|| = 4, ||k - c_k|| = 2 and
 * cos(q - c_q, k - c_k) = 0.3, scored under n_rot rotations of distinct seeds. Checks every
 * entry, query and score on the way; returns the pooled std of the error.
 */
static double estimator_spread(uint32_t d, uint32_t n_rot)
{
	const uint64_t seed = 0xe57u * 1000 + d;
	t_rng rng;
	t_rng_seed(&rng, seed);
	float q[N_PAIRS][KVT_MAX_HEAD_DIM], k[N_PAIRS][KVT_MAX_HEAD_DIM];
	float c_q[KVT_MAX_HEAD_DIM], c_k[KVT_MAX_HEAD_DIM];
	double qk[N_PAIRS], sum[N_PAIRS] = {0}, sum2[N_PAIRS] = {0};
	double a[KVT_MAX_HEAD_DIM], b[KVT_MAX_HEAD_DIM], w[KVT_MAX_HEAD_DIM];
	rand_dir(&rng, d, 1, a);
	rand_dir(&rng, d, 1, b);
	for (uint32_t i = 0; i < d; i++) {
		c_q[i] = (float)a[i];
		c_k[i] = (float)b[i];
	}
	for (int p = 0; p < N_PAIRS; p++) {
		rand_dir(&rng, d, 1, a);
		rand_dir(&rng, d, 1, w);
		double proj = 0, wn = 0;
		for (uint32_t i = 0; i < d; i++)
			proj += a[i] * w[i];
		for (uint32_t i = 0; i < d; i++) {
			w[i] -= proj * a[i];
			wn += w[i] * w[i];
		}
		qk[p] = 0;
		for (uint32_t i = 0; i < d; i++) {
			q[p][i] = (float)(c_q[i] + 4 * a[i]);
			k[p][i] = (float)(c_k[i] + 2 * (0.3 * a[i] + sqrt(1 - 0.09) * w[i] / sqrt(wn)));
			qk[p] += (double)q[p][i] * k[p][i];
		}
	}
	float *rot = (float *)t_alloc(sizeof(float) * d * d);
	for (uint32_t t = 0; t < n_rot; t++) {
		uint64_t rseed = 0x5eed0000ull + t;
		int rc = kvt_rotation_generate(rseed, 0, d, rot);
		T_CHECK(rc == 0, "kvt_rotation_generate(seed 0x%llx, 0, %u) got %d", (unsigned long long)rseed,
			d, rc);
		for (int p = 0; p < N_PAIRS; p++) {
			char what[96];
			snprintf(what, sizeof what, "pair %d rotation seed 0x%llx (inputs seed 0x%llx)",
				 p, (unsigned long long)rseed, (unsigned long long)seed);
			uint32_t code[KVT_MAX_WORDS];
			uint16_t sg, bt;
			kvt_qcode qc;
			kvt_index_build(d, rot, c_k, c_q, 1, k[p], d, code, &sg, &bt);
			kvt_query_prepare(d, rot, c_q, c_k, q[p], &qc);
			if (t < 8) { /* the formulas, on a few rotations (they are slow in double) */
				check_entry(what, d, rot, c_k, c_q, k[p], code, sg, bt);
				check_query(what, d, rot, c_q, c_k, q[p], &qc);
			}
			float s = check_score(what, d, &qc, code, sg, bt);
			/* beta's fp16 rounding is the same for every rotation: a known constant, not
			 * part of the estimator's error */
			double cqk = 0;
			for (uint32_t i = 0; i < d; i++)
				cqk += (double)c_q[i] * k[p][i];
			double e = (double)s - qk[p] - ((double)t_h2f(bt) - cqk);
			sum[p] += e;
			sum2[p] += e * e;
		}
	}
	free(rot);
	double var_pool = 0, mean_pool = 0;
	for (int p = 0; p < N_PAIRS; p++) {
		double mean = sum[p] / n_rot, var = (sum2[p] - n_rot * mean * mean) / (n_rot - 1);
		double se = sqrt(var / n_rot);
		T_CHECK(fabs(mean) <= 4 * se,
			"d=%u pair %d (seed 0x%llx): mean error got %.5g, wanted within 4 SE = %.5g "
			"of 0 (<q,k> = %.5g, std %.5g)",
			d, p, (unsigned long long)seed, mean, 4 * se, qk[p], sqrt(var));
		var_pool += var / N_PAIRS;
		mean_pool += mean / N_PAIRS;
	}
	double se_pool = sqrt(var_pool / (n_rot * N_PAIRS));
	T_CHECK(fabs(mean_pool) <= 3 * se_pool,
		"d=%u (seed 0x%llx): mean error over %d pairs x %u rotations got %.5g, wanted within "
		"3 SE = %.5g of 0",
		d, (unsigned long long)seed, N_PAIRS, n_rot, mean_pool, 3 * se_pool);
	print_message("d=%u: mean error %.5f (3 SE %.5f), std %.5f\n", d, mean_pool, 3 * se_pool,
		      sqrt(var_pool));
	return sqrt(var_pool);
}

static void test_unbiased_and_spread(void **state)
{
	(void)state;
	/* 400 rotations, but 200 for d = 256 where each takes about 0.1 s to generate */
	const uint32_t rots[3] = {400, 400, 200};
	double sd[3];
	for (int di = 0; di < 3; di++)
		sd[di] = estimator_spread(dims[di], rots[di]);
	/*
	 * The error std is O(||q - c_q|| ||k - c_k|| / sqrt(d)): each doubling of d divides it by
	 * sqrt 2 = 1.414. A pooled std of 1600 or 3200 samples has a relative standard error of
	 * about 1/sqrt(2 * 1600) = 1.8% or less (more with heavier tails), so a ratio is good to 3%;
	 * [1.2, 1.7] is more than 6 of those either side, yet excludes no shrinking (1.0) and 1/d (2.0).
	 */
	for (int di = 0; di < 2; di++) {
		double ratio = sd[di] / sd[di + 1];
		T_CHECK(ratio >= 1.2 && ratio <= 1.7,
			"std(d=%u) / std(d=%u) got %.4f (%.5f / %.5f), wanted in [1.2, 1.7] "
			"(sqrt 2 = 1.414)",
			dims[di], dims[di + 1], ratio, sd[di], sd[di + 1]);
	}
}

/* Scores of many keys and queries of unrelated shapes (outliers, tiny and large norms). */
static void test_score_paths(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++) {
		uint32_t d = dims[di], words = d / 32;
		t_rng rng;
		t_rng_seed(&rng, 0x5c0e0000u + d);
		float *rot = rotation(11, 0, d);
		float c_k[KVT_MAX_HEAD_DIM], c_q[KVT_MAX_HEAD_DIM], key[KVT_MAX_HEAD_DIM],
			q[KVT_MAX_HEAD_DIM];
		for (int trial = 0; trial < 50; trial++) {
			double ks = exp(t_range(&rng, -4, 4)), qs = exp(t_range(&rng, -4, 4));
			for (uint32_t i = 0; i < d; i++) {
				c_k[i] = (float)(0.5 * t_normal(&rng));
				c_q[i] = (float)(0.5 * t_normal(&rng));
				key[i] = (float)(c_k[i] + ks * t_normal(&rng));
				q[i] = (float)(c_q[i] + qs * t_normal(&rng));
			}
			if (trial % 5 == 0) /* an outlier coordinate stretches the INT4 range */
				q[t_below(&rng, d)] += (float)(20 * qs);
			char what[80];
			snprintf(what, sizeof what, "trial %d (seed 0x%llx)", trial,
				 (unsigned long long)rng.seed);
			uint32_t code[KVT_MAX_WORDS];
			uint16_t sg, bt;
			kvt_qcode qc;
			kvt_index_build(d, rot, c_k, c_q, 1, key, d, code, &sg, &bt);
			kvt_query_prepare(d, rot, c_q, c_k, q, &qc);
			check_entry(what, d, rot, c_k, c_q, key, code, sg, bt);
			check_query(what, d, rot, c_q, c_k, q, &qc);
			check_score(what, d, &qc, code, sg, bt);
		}
		/* batch scoring equals one-at-a-time */
		enum { N = 33 };
		float keys[N * KVT_MAX_HEAD_DIM], sc[N];
		uint32_t codes[N * KVT_MAX_WORDS];
		uint16_t sgs[N], bts[N];
		kvt_qcode qc;
		for (uint32_t i = 0; i < N * d; i++)
			keys[i] = (float)t_normal(&rng);
		kvt_index_build(d, rot, c_k, c_q, N, keys, d, codes, sgs, bts);
		kvt_query_prepare(d, rot, c_q, c_k, q, &qc);
		kvt_score(d, &qc, N, codes, sgs, bts, sc);
		for (uint32_t t = 0; t < N; t++) {
			float one;
			kvt_score(d, &qc, 1, codes + t * words, sgs + t, bts + t, &one);
			T_CHECK(one == sc[t], "d=%u: batch score %u got %.9g, single %.9g, wanted equal",
				d, t, (double)sc[t], (double)one);
		}
		free(rot);
	}
}

/* ---- keys beyond the fp16 range (issue 11, defect 2) ----------------------------------------- */

/*
 * sigma and beta saturate at +-65504 (0x7bff) instead of overflowing to fp16 infinity, and a NaN
 * (a residual that overflowed float) stores 0: every index entry is finite, so scores against a
 * finite, moderate query stay finite whatever the key.
 */
static void test_saturated_entry(void **state)
{
	(void)state;
	for (int di = 0; di < 3; di++) {
		const uint32_t d = dims[di];
		float *rot = rotation(7, 0, d);
		float c_k[KVT_MAX_HEAD_DIM], c_q[KVT_MAX_HEAD_DIM], key[KVT_MAX_HEAD_DIM],
			q[KVT_MAX_HEAD_DIM];
		t_rng rng;
		t_rng_seed(&rng, 0x5a7u + d);
		/* big: fp16 keys near the fp16 maximum (residual norm ~ 6e4 sqrt(d)); huge: bf16 keys
		 * whose residual overflows float (r = k - c_k = inf); neg: beta towards -inf */
		const struct { const char *name; float k, ck, cq; uint16_t sigma, beta; } cases[] = {
			{"big fp16 keys", 60000.0f, 0.0f, 1.0f, 0x7bffu, 0x7bffu},
			{"big keys, negative beta", 60000.0f, 0.0f, -1.0f, 0x7bffu, 0xfbffu},
			{"bf16 keys overflowing the residual", 3.0e38f, -3.0e38f, 1.0e30f, 0xffffu, 0xffffu},
		};
		for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
			for (uint32_t i = 0; i < d; i++) {
				float sign = t_below(&rng, 2) ? 1.0f : -1.0f;
				c_k[i] = cases[ci].ck * (ci == 2 ? sign : 1.0f);
				key[i] = ci == 2 ? -c_k[i] : cases[ci].k * sign;
				c_q[i] = ci == 2 ? cases[ci].cq : cases[ci].cq * sign;
				q[i] = (float)t_normal(&rng);
			}
			uint32_t code[KVT_MAX_WORDS];
			uint16_t sg = 0x7c00u, bt = 0x7c00u;
			kvt_index_build(d, rot, c_k, c_q, 1, key, d, code, &sg, &bt);
			T_CHECK(isfinite(t_h2f(sg)) && isfinite(t_h2f(bt)),
				"d=%u %s: sigma 0x%04x, beta 0x%04x, wanted both finite", d, cases[ci].name,
				sg, bt);
			T_CHECK(cases[ci].sigma == 0xffffu || sg == cases[ci].sigma,
				"d=%u %s: sigma got 0x%04x, wanted 0x%04x (saturated)", d, cases[ci].name,
				sg, cases[ci].sigma);
			T_CHECK(cases[ci].beta == 0xffffu || bt == cases[ci].beta,
				"d=%u %s: beta got 0x%04x, wanted 0x%04x (saturated)", d, cases[ci].name,
				bt, cases[ci].beta);
			kvt_qcode qc;
			float score;
			const float zero[KVT_MAX_HEAD_DIM] = {0};
			kvt_query_prepare(d, rot, zero, zero, q, &qc);
			kvt_score(d, &qc, 1, code, &sg, &bt, &score);
			T_CHECK(isfinite(score), "d=%u %s: score %g, wanted finite", d, cases[ci].name,
				(double)score);
		}
		free(rot);
	}
}

enum { BIG_D = 128, BIG_NQ = 4, BIG_NKV = 2, BIG_T = 200, BIG_APPENDS = 30 };

/* One sequence's prefill and appends: keys N(0, 1), or (big) +-U(40000, 65000) in fp16. */
static void big_seq(kvt_cache *c, uint32_t seq, uint32_t dtype, double mag, uint64_t seed)
{
	const bool big = mag > 0;
	t_rng r;
	t_rng_seed(&r, seed);
	const size_t row = (size_t)BIG_NKV * BIG_D;
	uint16_t *k = (uint16_t *)t_alloc(2 * row * BIG_T), *v = (uint16_t *)t_alloc(2 * row * BIG_T);
	t_fill(&r, dtype, row * BIG_T, 0, 1, k, NULL);
	t_fill(&r, dtype, row * BIG_T, 0, 1, v, NULL);
	for (size_t i = 0; big && i < row * BIG_T; i++)
		k[i] = t_enc(dtype, (float)(t_range(&r, 0.6 * mag, mag) * (t_below(&r, 2) ? 1 : -1)));
	int rc = kvt_prefill(c, seq, 0, NULL, k, v, BIG_T - BIG_APPENDS, NULL);
	T_CHECK(rc == 0, "prefill of seq %u (%s keys) got %d (%s), wanted 0", seq,
		big ? "big" : "normal", rc, kvt_last_error(c));
	for (uint32_t t = BIG_T - BIG_APPENDS; t < BIG_T; t++) {
		rc = kvt_append(c, 0, 1, &seq, k + t * row, v + t * row, NULL);
		T_CHECK(rc == 0, "append %u of seq %u (%s keys) got %d (%s), wanted 0", t, seq,
			big ? "big" : "normal", rc, kvt_last_error(c));
	}
	free(k);
	free(v);
}

/*
 * A sequence of keys near the fp16 maximum (residual norms ~ 6e5, sigma beyond fp16) is indexed by
 * prefill and by the appends' flushes. Before, every attend of a batch holding it failed with
 * -EINVAL; now the batch attends, the other sequence's output is bit for bit its output attended
 * alone, and every output is finite. The same with bf16 keys near bf16's maximum, whose
 * <q - c_q, c_k> overflowed float (saturated at KVT_QC_CK_MAX now).
 */
static void big_keys_batch(uint32_t dtype, double mag)
{
	kvt_config cfg = t_config(1, BIG_NQ, BIG_NKV, BIG_D, dtype);
	kvt_cache *c = t_create(&cfg);
	uint32_t seqs[2];
	T_CHECK(kvt_seq_open(c, &seqs[0]) == 0 && kvt_seq_open(c, &seqs[1]) == 0, "seq_open");
	big_seq(c, seqs[0], dtype, mag, 0xb16u);
	big_seq(c, seqs[1], dtype, 0, 0x5a11u);
	t_rng r;
	t_rng_seed(&r, 0x9e7u);
	const size_t qn = (size_t)BIG_NQ * BIG_D;
	uint16_t q[2 * BIG_NQ * BIG_D];
	float out[2 * BIG_NQ * BIG_D], alone[BIG_NQ * BIG_D];
	for (int step = 0; step < 3; step++) {
		t_fill(&r, dtype, 2 * qn, 0, 1, q, NULL);
		int rc = kvt_attend(c, 0, 2, seqs, q, out, NULL);
		T_CHECK(rc == 0, "%s keys of %g, step %d: attend of [big-key seq, normal seq] got %d "
			"(%s: %s), wanted 0", t_dtype_name(dtype), mag, step, rc, kvt_strerror(rc),
			kvt_last_error(c));
		rc = kvt_attend(c, 0, 1, &seqs[1], q + qn, alone, NULL);
		T_CHECK(rc == 0, "step %d: attend of the normal seq alone got %d (%s)", step, rc,
			kvt_last_error(c));
		/* the big-key sequence's own output is finite while its exact q.k is (fp16 keys);
		 * bf16 keys near 3e38 overflow its own attention, and only its own */
		for (size_t j = mag < 1e5 ? 0 : qn; j < 2 * qn; j++)
			T_CHECK(isfinite(out[j]), "step %d: out[%zu] = %g, wanted finite", step, j,
				(double)out[j]);
		for (size_t j = 0; j < qn; j++)
			T_CHECK(t_fbits(out[qn + j]) == t_fbits(alone[j]),
				"step %d: normal seq's out[%zu] in the batch got %.9g, alone %.9g, wanted "
				"equal", step, j, (double)out[qn + j], (double)alone[j]);
	}
	kvt_cache_destroy(c);
}

static void test_big_keys_batch(void **state)
{
	(void)state;
	big_keys_batch(KVT_DTYPE_F16, 65000);
	/* bf16 keys near its maximum: <q - c_q, c_k> overflows float unless saturated
	 * (KVT_QC_CK_MAX) */
	big_keys_batch(KVT_DTYPE_BF16, 3e38);
}

/*
 * A query too large for the estimate (bf16 elements of 1e37) fails its attend with an error that
 * names the query, never the key (whose index entry is finite).
 */
static void test_big_query_blamed(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, BIG_NQ, BIG_NKV, BIG_D, KVT_DTYPE_BF16);
	kvt_cache *c = t_create(&cfg);
	uint32_t seq;
	T_CHECK(kvt_seq_open(c, &seq) == 0, "seq_open");
	big_seq(c, seq, KVT_DTYPE_BF16, 0, 0x77u);
	uint16_t q[BIG_NQ * BIG_D];
	float out[BIG_NQ * BIG_D];
	t_rng r;
	t_rng_seed(&r, 0x78u);
	for (size_t j = 0; j < BIG_NQ * BIG_D; j++)
		q[j] = t_f2bf((float)(1e37 * (t_below(&r, 2) ? 1 : -1)));
	int rc = kvt_attend(c, 0, 1, &seq, q, out, NULL);
	const char *e = kvt_last_error(c);
	T_CHECK(rc == -EINVAL && strstr(e, "the query is too large") && !strstr(e, "overflowed fp16"),
		"attend of a 1e37 query got %d (%s), wanted -EINVAL naming the query, not the key", rc,
		e);
	kvt_cache_destroy(c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_rotation_orthogonal),
		cmocka_unit_test(test_rotation_determinism),
		cmocka_unit_test(test_index_entry),
		cmocka_unit_test(test_score_paths),
		cmocka_unit_test(test_unbiased_and_spread),
		cmocka_unit_test(test_saturated_entry),
		cmocka_unit_test(test_big_keys_batch),
		cmocka_unit_test(test_big_query_blamed),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
