/* SPDX-License-Identifier: MIT */
/*
 * kvt_gpu_topp_select ranking by keys (kvt_gpu_keep: keep_weight's selection hysteresis) against
 * the exact keyed definition and the CPU's kvt_topp_threshold_keyed (part of test_gpu_kernels,
 * whose main runs it; the references and the window check are test_gpu_select.c's).
 */
#include <math.h>

#include "gpu_kernels.h"

/* ---- keys: the selection's hysteresis (kvt_gpu_keep) ------------------------------------- */

/* kvt_gpu_topp_select by keys on one configuration (the scores hs, their keys hk, the mask hm of
 * Hkv items a sequence, `words` each): each segment against the exact keyed definition and the
 * CPU's, and the union's bits against the GPU's marks of the keys by its cuts. */
static void check_keep(const char *what, uint32_t S, uint32_t Hq, uint32_t Hkv, const uint32_t *n,
		       uint32_t max_n, const float *hs, const float *hk, const uint32_t *hm,
		       uint32_t words, float bonus, size_t ld, float scale, float p,
		       uint32_t bmin, uint32_t bmax, int *bad)
{
	const uint32_t segs = S * Hq;
	const size_t items = (size_t)S * Hkv, bb = kvt_gpu_selbits_bytes(items, max_n);
	float *ds = (float *)dcopy(hs, 4 * (size_t)segs * ld);
	void *dn = dcopy(n, 4 * S), *dm = dcopy(hm, 4 * items * words);
	const size_t sb = kvt_gpu_select_scratch_bytes(S, Hq, Hkv, max_n);
	void *scr = dpoison(sb), *bm = dpoison(bb);
	const kvt_gpu_selbits bits = kvt_gpu_selbits_at(bm, items, max_n);
	const kvt_gpu_keep keep = {(const uint32_t *)dm, words, bonus};
	kvt_gpu_topp *dout = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * segs);
	uint32_t *dsel = (uint32_t *)dpoison(4 * items * max_n);
	uint32_t *dseln = (uint32_t *)dpoison(4 * items);
	unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
	CU(cudaMemset(derr, 0, 8));
	int rc = kvt_gpu_topp_select(S, Hq, Hkv, ds, ld, (const uint32_t *)dn, max_n, scale, p,
				     bmin, bmax, NULL, NULL, dout, bits, &keep, NULL, scr, sb, derr,
				     NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_topp_select with keys: %d", what, rc);
	rc = kvt_gpu_selbits_list((uint32_t)items, bits, dsel, max_n, dseln, NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_selbits_list %d", what, rc);
	kvt_gpu_topp *out = (kvt_gpu_topp *)t_alloc(sizeof(kvt_gpu_topp) * segs);
	uint32_t *sel = (uint32_t *)t_alloc(4 * items * max_n);
	uint32_t *seln = (uint32_t *)t_alloc(4 * items);
	fetch(out, dout, sizeof(kvt_gpu_topp) * segs);
	fetch(sel, dsel, 4 * items * max_n);
	fetch(seln, dseln, 4 * items);
	fetch(&herr, derr, 8);
	T_SOFT(bad, herr == 0, "%s: error word 0x%llx", what, herr);
	seg_ref *refs = refs_make(S, Hq, n, hs, hk, ld, scale, p, max_n);
	check_segments(what, S, Hq, Hkv, n, max_n, hk, ld, refs, p, bmin, bmax, out, sel, seln,
		       bad);
	refs_free(refs, segs);
	free(out);
	free(sel);
	free(seln);
	cudaFree(ds);
	cudaFree(dn);
	cudaFree(dm);
	cudaFree(scr);
	cudaFree(bm);
	cudaFree(dout);
	cudaFree(dsel);
	cudaFree(dseln);
	cudaFree(derr);
}

/*
 * kvt_gpu_topp_select ranking by keys (kvt_gpu_keep, keep_weight's): on each configuration (score
 * distributions, masks of a tenth and of half of the tokens, weights 2 and 8, p and budgets) every
 * segment's set lies within the stated tolerance of the exact keyed set (keys ordered, scores
 * massed, from the largest key) and, where its count is kvt_topp_threshold_keyed's, so is its
 * threshold; the clamp goes by key; the union's bits are the GPU's marks of the keys. An all-zero
 * mask gives the unkeyed call's outputs and bits; keys with the scan's statistics or ring, or a
 * negative or non-finite bonus, are refused.
 */
/* Mask bits of density `dens` for every item (past n too, which must be ignored), and the keys
 * they give the scores hs: hk = hs with bonus added where a segment's item has the bit. */
static void make_keys(t_rng *rng, float dens, float bonus, uint32_t S, uint32_t Hq, uint32_t Hkv,
		      const uint32_t *n, size_t ld, uint32_t words, const float *hs, float *hk,
		      uint32_t *hm)
{
	for (size_t w = 0; w < (size_t)S * Hkv * words; w++) {
		uint32_t x = 0;
		for (int b = 0; b < 32; b++)
			x |= (t_unif(rng) < dens ? 1u : 0u) << b;
		hm[w] = x;
	}
	memcpy(hk, hs, 4 * (size_t)S * Hq * ld);
	for (uint32_t seg = 0; seg < S * Hq; seg++) {
		const uint32_t *row = hm + (size_t)(seg / (Hq / Hkv)) * words;
		for (uint32_t t = 0; t < n[seg / Hq]; t++)
			if (row[t / 32] >> (t % 32) & 1u)
				hk[(size_t)seg * ld + t] += bonus;
	}
}

void test_select_keep(void **state)
{
	(void)state;
	enum { S = 3, HQ = 8, HKV = 2 };
	const uint32_t n[S] = {1, 20000, 3001}, max_n = 20000, words = (max_n + 31) / 32;
	const size_t ld = 20000, items = (size_t)S * HKV, all = (size_t)S * HQ * ld;
	const float ps[3] = {0.5f, 0.9f, 0.999f}, ws[2] = {2.0f, 8.0f}, dens[2] = {0.1f, 0.5f};
	const uint32_t budgets[3][2] = {{0, 0}, {0, 40}, {700, 900}};
	float *hs = (float *)t_alloc(4 * all), *hk = (float *)t_alloc(4 * all);
	uint32_t *hm = (uint32_t *)t_alloc(4 * items * words);
	int bad = 0, cases = 0;
	const uint32_t segs0 = g_segs;
	for (int kind = 0; kind < D_NDIST; kind++) {
		if (kind == D_ONEHOT || (g_quick && kind != D_NORMAL && kind != D_UNIFORM))
			continue;
		t_rng rng;
		seeded(&rng, 500 + kind);
		memset(hs, 0xff, 4 * all);
		for (uint32_t g = 0; g < S * HQ; g++)
			t_scores(&rng, (enum t_dist)kind, n[g / HQ], hs + (size_t)g * ld);
		const float scale = kind == D_WIDE ? 1.0f : 0.0883883476f;
		for (int c = 0; c < 4; c++) {
			const int di = c / 2, wi = c % 2;
			if (g_quick && wi == 0)
				continue;
			const float bonus = logf(1.0f + ws[wi]) / scale;
			make_keys(&rng, dens[di], bonus, S, HQ, HKV, n, ld, words, hs, hk, hm);
			for (int pb = 0; pb < 9; pb++) {
				const int pi = pb / 3, bi = pb % 3;
				if (g_quick && bi == 1)
					continue;
				char what[128];
				snprintf(what, sizeof what,
					 "keys %s density %g w %g p=%g budget [%u, %u]",
					 t_dist_name[kind], (double)dens[di], (double)ws[wi],
					 (double)ps[pi], budgets[bi][0], budgets[bi][1]);
				check_keep(what, S, HQ, HKV, n, max_n, hs, hk, hm, words, bonus, ld,
					   scale, ps[pi], budgets[bi][0], budgets[bi][1], &bad);
				cases++;
				T_CHECK(bad == 0, "%d differences", bad);
			}
		}
	}
	/* an all-zero mask: the unkeyed call's outputs and bits, byte for byte */
	{
		t_rng rng;
		seeded(&rng, 600);
		for (uint32_t g = 0; g < S * HQ; g++)
			t_scores(&rng, D_NORMAL, n[g / HQ], hs + (size_t)g * ld);
		memset(hm, 0, 4 * items * words);
		float *ds = (float *)dcopy(hs, 4 * all);
		void *dn = dcopy(n, 4 * S), *dm = dcopy(hm, 4 * items * words);
		const size_t sb = kvt_gpu_select_scratch_bytes(S, HQ, HKV, max_n),
			     bb = kvt_gpu_selbits_bytes(items, max_n);
		void *scr = dpoison(sb), *bm1 = dpoison(bb), *bm2 = dpoison(bb);
		const kvt_gpu_selbits b1 = kvt_gpu_selbits_at(bm1, items, max_n),
				      b2 = kvt_gpu_selbits_at(bm2, items, max_n);
		kvt_gpu_topp *d1 = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * S * HQ),
			     *d2 = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * S * HQ);
		const kvt_gpu_keep zero = {(const uint32_t *)dm, words, 3.0f};
		const uint32_t *dnn = (const uint32_t *)dn;
		const float sc = 0.088f, p9 = 0.9f;
		T_CHECK(kvt_gpu_topp_select(S, HQ, HKV, ds, ld, dnn, max_n, sc, p9, 0, 0, NULL, NULL,
					    d1, b1, NULL, NULL, scr, sb, NULL, NULL) == 0 &&
				kvt_gpu_topp_select(S, HQ, HKV, ds, ld, dnn, max_n, sc, p9, 0, 0,
						    NULL, NULL, d2, b2, &zero, NULL, scr, sb, NULL,
						    NULL) == 0,
			"select with and without an all-zero mask");
		kvt_gpu_topp o1[S * HQ], o2[S * HQ];
		uint32_t *h1 = (uint32_t *)t_alloc(bb), *h2 = (uint32_t *)t_alloc(bb);
		fetch(o1, d1, sizeof o1);
		fetch(o2, d2, sizeof o2);
		fetch(h1, bm1, bb);
		fetch(h2, bm2, bb);
		T_CHECK(!memcmp(o1, o2, sizeof o1) && !memcmp(h1, h2, bb),
			"an all-zero mask changes the selection");
		/* refused before anything is launched */
		void *dst = dpoison(sizeof(kvt_gpu_segstats) * S * HQ);
		const kvt_gpu_keep neg = {(const uint32_t *)dm, words, -1.0f},
				   nan_ = {(const uint32_t *)dm, words, NAN};
		T_CHECK(kvt_gpu_topp_select(S, HQ, HKV, ds, ld, dnn, max_n, sc, p9, 0, 0, dst, NULL,
					    d2, b2, &zero, NULL, scr, sb, NULL, NULL) == -EINVAL,
			"keys with the scan's statistics");
		T_CHECK(kvt_gpu_topp_select(S, HQ, HKV, ds, ld, dnn, max_n, sc, p9, 0, 0, NULL, NULL,
					    d2, b2, &neg, NULL, scr, sb, NULL, NULL) == -EINVAL &&
				kvt_gpu_topp_select(S, HQ, HKV, ds, ld, dnn, max_n, sc, p9, 0, 0,
						    NULL, NULL, d2, b2, &nan_, NULL, scr, sb, NULL,
						    NULL) == -EINVAL,
			"a negative or NaN bonus");
		free(h1);
		free(h2);
		cudaFree(dst);
		cudaFree(ds);
		cudaFree(dn);
		cudaFree(dm);
		cudaFree(scr);
		cudaFree(bm1);
		cudaFree(bm2);
		cudaFree(d1);
		cudaFree(d2);
	}
	printf("select by keys: %d configurations, %u segments checked within the tolerance\n",
	       cases, g_segs - segs0);
	free(hs);
	free(hk);
	free(hm);
}
