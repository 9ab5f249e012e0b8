/* SPDX-License-Identifier: MIT */
/*
 * The scan's first histogram (kvt_gpu_score's bins, gpu/scanbins.h; part of test_gpu_kernels,
 * whose main runs it): on random indexes, for every head dim, groups of one and four query heads
 * and scales from a fraction of a nat to far past the binned domain, the scan with bins writes the
 * same scores and statistics as without, and its counts and sums of D equal the CPU twin's
 * (kvt_bins_of over the scores the GPU wrote), slot for slot. Non-finite scores and scores past
 * the domain are left out on both sides. One configuration has enough (sequence, KV head) items
 * that each scan block would bin more than KVT_BINS_BLOCK_TOKENS tokens in one wave, so the
 * launcher's extra blocks are what keep the shared sums exact. Bad arguments are refused.
 */
#include <math.h>

#include "gpu_kernels.h"

/* A sequence's random index of n tokens for each of hkv KV heads, as the views' layout holds it:
 * codes of random bits, sigma in [0.5, 1.5) and beta in [-1, 1) as fp16, with a NaN beta (KV head
 * 0, token 77) and an infinite sigma (KV head 1, token 200) where n allows. */
static kvt_gpu_index_view make_view(t_rng *r, uint32_t d, uint32_t hkv, uint32_t n)
{
	const size_t words = (size_t)hkv * n * (d / 32), toks = (size_t)hkv * n;
	uint32_t *codes = (uint32_t *)t_alloc(4 * words);
	uint16_t *sig = (uint16_t *)t_alloc(2 * toks), *bet = (uint16_t *)t_alloc(2 * toks);
	for (size_t i = 0; i < words; i++)
		codes[i] = (uint32_t)t_next(r);
	for (size_t i = 0; i < toks; i++) {
		sig[i] = t_f2h((float)t_range(r, 0.5, 1.5));
		bet[i] = t_f2h((float)t_range(r, -1.0, 1.0));
	}
	if (n > 300) {
		bet[77] = 0x7e00;
		sig[n + 200] = 0x7c00;
	}
	kvt_gpu_index_view v = {(uint32_t *)dcopy(codes, 4 * words),
				(uint16_t *)dcopy(sig, 2 * toks),
				(uint16_t *)dcopy(bet, 2 * toks), n, 0};
	free(codes);
	free(sig);
	free(bet);
	return v;
}

static void free_view(kvt_gpu_index_view *v)
{
	cudaFree(v->codes);
	cudaFree(v->sigma);
	cudaFree(v->beta);
}

/* Scores binned and left out, over the run, and the slots compared. */
static uint64_t g_binned, g_left, g_slots;

/* One configuration: S sequences of n tokens, hkv KV heads, group G, head dim d. */
static void check_bins(uint32_t d, uint32_t S, uint32_t hkv, uint32_t G, uint32_t n, float scale,
		       uint64_t salt)
{
	const uint32_t hq = hkv * G, segs = S * hq, ld = (n + 3) & ~3u;
	t_rng r;
	seeded(&r, salt);
	float *rot = rotation(d);
	float *cen = (float *)t_alloc(4 * (size_t)hkv * d);
	fill_f(&r, cen, (size_t)hkv * d, 0.0, 0.3);
	uint16_t *qh = (uint16_t *)t_alloc(2 * (size_t)S * hq * d);
	for (size_t i = 0; i < (size_t)S * hq * d; i++)
		qh[i] = t_f2h((float)t_range(&r, -1.0, 1.0));
	kvt_gpu_index_view *hv = (kvt_gpu_index_view *)t_alloc(sizeof(*hv) * S);
	const float **cp = (const float **)t_alloc(sizeof(float *) * S);
	float *dcen = (float *)dcopy(cen, 4 * (size_t)hkv * d);
	for (uint32_t s = 0; s < S; s++) {
		hv[s] = make_view(&r, d, hkv, n);
		cp[s] = dcen;
	}
	uint32_t *hn = (uint32_t *)t_alloc(4 * S);
	for (uint32_t s = 0; s < S; s++)
		hn[s] = n - (s % 2) * (n / 3); /* sequences of different lengths */
	void *dviews = dcopy(hv, sizeof(*hv) * S), *dn = dcopy(hn, 4 * S);
	void *drot = dcopy(rot, 4 * (size_t)d * d), *dq = dcopy(qh, 2 * (size_t)S * hq * d);
	void *dcp = dcopy(cp, sizeof(float *) * S);
	kvt_gpu_qcode *dqc = (kvt_gpu_qcode *)dpoison(sizeof(kvt_gpu_qcode) * segs);
	T_CHECK(kvt_gpu_query_prepare(d, KVT_DTYPE_F16, S, hq, hkv, (const float *)drot, dq,
				      (const float *const *)dcp, (const float *const *)dcp, dqc,
				      NULL) == 0,
		"prepare");

	const size_t nsc = (size_t)segs * ld, nb = (size_t)segs * KVT_BINS;
	float *dsc[2] = {(float *)dpoison(4 * nsc), (float *)dpoison(4 * nsc)};
	kvt_gpu_segstats *dst[2] = {(kvt_gpu_segstats *)dpoison(sizeof(kvt_gpu_segstats) * segs),
				    (kvt_gpu_segstats *)dpoison(sizeof(kvt_gpu_segstats) * segs)};
	kvt_gpu_bins b = {scale, (uint32_t *)dpoison(4 * nb),
			  (unsigned long long *)dpoison(8 * nb), 0, NULL};
	CU(cudaMemset(b.count, 0, 4 * nb));
	CU(cudaMemset(b.dsum, 0, 8 * nb));
	for (int k = 0; k < 2; k++) {
		CU(cudaMemset(dst[k], 0, sizeof(kvt_gpu_segstats) * segs));
		const int rc = kvt_gpu_score(d, S, hq, hkv, dqc, (const kvt_gpu_index_view *)dviews,
					     (const uint32_t *)dn, n, dsc[k], ld, dst[k],
					     k ? &b : NULL, NULL, NULL);
		T_CHECK(rc == 0, "kvt_gpu_score (bins %d): %d", k, rc);
	}
	float *sc[2] = {(float *)t_alloc(4 * nsc), (float *)t_alloc(4 * nsc)};
	kvt_gpu_segstats *st[2] = {(kvt_gpu_segstats *)t_alloc(sizeof(kvt_gpu_segstats) * segs),
				   (kvt_gpu_segstats *)t_alloc(sizeof(kvt_gpu_segstats) * segs)};
	for (int k = 0; k < 2; k++) {
		fetch(sc[k], dsc[k], 4 * nsc);
		fetch(st[k], dst[k], sizeof(kvt_gpu_segstats) * segs);
	}
	T_CHECK(memcmp(sc[0], sc[1], 4 * nsc) == 0 &&
			memcmp(st[0], st[1], sizeof(kvt_gpu_segstats) * segs) == 0,
		"d=%u G=%u n=%u: the scan with bins wrote other scores or statistics", d, G, n);

	uint32_t *gc = (uint32_t *)t_alloc(4 * nb), *wc = (uint32_t *)t_alloc(4 * nb);
	unsigned long long *gd = (unsigned long long *)t_alloc(8 * nb),
			   *wd = (unsigned long long *)t_alloc(8 * nb);
	fetch(gc, b.count, 4 * nb);
	fetch(gd, b.dsum, 8 * nb);
	memset(wc, 0, 4 * nb);
	memset(wd, 0, 8 * nb);
	uint64_t binned = 0, left = 0;
	for (uint32_t g = 0; g < segs; g++) {
		const uint32_t m = hn[g / hq];
		const uint32_t k = kvt_bins_add_host(sc[0] + (size_t)g * ld, m, scale,
						     wc + (size_t)g * KVT_BINS,
						     wd + (size_t)g * KVT_BINS);
		binned += k;
		left += m - k;
	}
	int bad = 0;
	for (size_t i = 0; i < nb; i++) {
		T_SOFT(&bad, gc[i] == wc[i] && gd[i] == wd[i],
		       "d=%u G=%u n=%u scale %g (seed %llu): segment %zu slot %zu: count %u/%u sum "
		       "of D %llu/%llu (got/wanted)",
		       d, G, n, (double)scale, (unsigned long long)g_seed, i / KVT_BINS,
		       i % KVT_BINS, gc[i], wc[i], gd[i], wd[i]);
		if (bad > 5)
			fail();
	}
	T_CHECK(bad == 0, "%d slots differ", bad);
	g_binned += binned;
	g_left += left;
	g_slots += nb;
	if (scale < 10.0f)
		T_CHECK(binned > 0, "d=%u G=%u scale %g: nothing binned", d, G, (double)scale);
	if (scale < 1.0f) /* only the non-finite scores: make_view's two, for G heads each */
		T_CHECK(left == (uint64_t)S * 2 * G, "d=%u G=%u: %llu scores not binned", d, G,
			(unsigned long long)left);

	for (int k = 0; k < 2; k++) {
		cudaFree(dsc[k]);
		cudaFree(dst[k]);
		free(sc[k]);
		free(st[k]);
	}
	cudaFree(b.count);
	cudaFree(b.dsum);
	for (uint32_t s = 0; s < S; s++)
		free_view(&hv[s]);
	cudaFree(dviews);
	cudaFree(dn);
	cudaFree(drot);
	cudaFree(dq);
	cudaFree(dcp);
	cudaFree(dcen);
	cudaFree(dqc);
	free(gc);
	free(wc);
	free(gd);
	free(wd);
	free(hv);
	free(cp);
	free(hn);
	free(qh);
	free(cen);
	free(rot);
}

void test_scan_bins(void **state)
{
	(void)state;
	/* scales: a few nats over the segment, tens of nats (the ring wraps), past the domain */
	const float scales[3] = {0.0884f, 3.0f, 300.0f};
	for (int di = 0; di < 3; di++)
		for (uint32_t G = 1; G <= 4; G += 3)
			for (int si = 0; si < 3; si++)
				check_bins(dims[di], 2, 2, G, 5003, scales[si],
					   (uint64_t)(700 + 9 * di + 3 * G + si));
	/* 256 items of 70K tokens: one wave would give each block 137 chunks, 35K tokens */
	if (!g_quick)
		check_bins(128, 32, 8, 1, 70000, 0.0884f, 777);
	printf("scan bins: %llu slots equal to the CPU twin's; %llu scores binned, %llu left out "
	       "(seed %llu)\n",
	       (unsigned long long)g_slots, (unsigned long long)g_binned,
	       (unsigned long long)g_left, (unsigned long long)g_seed);
}

void test_scan_bins_arguments(void **state)
{
	(void)state;
	void *p = (void *)16;
	kvt_gpu_bins b = {0.1f, (uint32_t *)p, (unsigned long long *)p, 0, NULL};
	const float bad_scales[4] = {0.0f, -1.0f, NAN, INFINITY};
	for (int i = 0; i < 4; i++) {
		b.scale = bad_scales[i];
		T_CHECK(kvt_gpu_score(128, 1, 4, 2, p, p, p, 8, p, 8, NULL, &b, NULL, NULL) ==
				-EINVAL,
			"bins scale %g", (double)bad_scales[i]);
	}
	b.scale = 0.1f;
	b.count = NULL;
	T_CHECK(kvt_gpu_score(128, 1, 4, 2, p, p, p, 8, p, 8, NULL, &b, NULL, NULL) == -EINVAL,
		"bins without counts");
	b.count = (uint32_t *)p;
	b.dsum = NULL;
	T_CHECK(kvt_gpu_score(128, 1, 4, 2, p, p, p, 8, p, 8, NULL, &b, NULL, NULL) == -EINVAL,
		"bins without sums");
	b.dsum = (unsigned long long *)p;
	T_CHECK(kvt_gpu_score(128, 1, 10, 2, p, p, p, 8, p, 8, NULL, &b, NULL, NULL) ==
			-EOPNOTSUPP,
		"bins with a group of 5");
}
