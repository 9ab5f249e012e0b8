/* SPDX-License-Identifier: MIT */
/*
 * The GPU's Top-p selection against the exact definition and the CPU's (part of test_gpu_kernels,
 * whose main runs it): on each configuration the threshold with the scan's statistics given equals
 * the one that gathers them; every segment's set lies within the tolerance gpu/select.cuh states of
 * the exact set (masses in long double) and, where its count is the CPU's, its threshold is the
 * CPU's; the clamp follows the count; the union of each KV head's group is the GPU's marks, in
 * order, also listed from a view of the bits; non-finite scores raise the error word.
 */
#include <math.h>

#include "gpu_kernels.h"

/* ---- Top-p selection --------------------------------------------------------------------- */

/* Segments checked, and those whose set equals the CPU's double-precision one. */
uint32_t g_segs, g_exact;

/* A token's key (what the order is by) and score (what its mass is). */
typedef struct {
	float k, s;
} kpair;

static int kpair_desc(const void *a, const void *b)
{
	const float x = ((const kpair *)a)->k, y = ((const kpair *)b)->k;
	return x < y ? 1 : x > y ? -1 : 0;
}

/* hk: the keys (kvt_gpu_keep: the scores with a bonus where a bit is set; the CPU's threshold then
 * kvt_topp_threshold_keyed), laid out as hs, or NULL: the scores. sorted[] holds the keys, cum[]
 * their scores' terms, from the largest key (as the GPU reckons them). */
seg_ref *refs_make(uint32_t S, uint32_t Hq, const uint32_t *n, const float *hs,
			  const float *hk, size_t ld, float scale, float p, uint32_t max_n)
{
	seg_ref *r = (seg_ref *)t_alloc(sizeof(seg_ref) * S * Hq);
	float *scr_h = (float *)t_alloc(4 * (2 * (size_t)max_n + 1));
	for (uint32_t g = 0; g < S * Hq; g++) {
		const float *x = hs + (size_t)g * ld, *k = hk ? hk + (size_t)g * ld : x;
		const uint32_t m = n[g / Hq];
		uint32_t b = 0;
		r[g].thr = 0.0f;
		r[g].cnt = hk ? kvt_topp_threshold_keyed(x, k, m, scale, p, scr_h, &r[g].thr, &b)
			      : kvt_topp_threshold(x, m, scale, p, scr_h, &r[g].thr, &b);
		r[g].sorted = NULL;
		r[g].cum = NULL;
		if (m == 0 || p >= 1.0f)
			continue;
		kpair *kp = (kpair *)t_alloc(sizeof(kpair) * m);
		for (uint32_t t = 0; t < m; t++)
			kp[t] = (kpair){k[t], x[t]};
		qsort(kp, m, sizeof *kp, kpair_desc);
		r[g].sorted = (float *)t_alloc(4 * (size_t)m);
		r[g].cum = (long double *)t_alloc(sizeof(long double) * (m + 1));
		const float mx = kp[0].k;
		r[g].cum[0] = 0.0L;
		for (uint32_t t = 0; t < m; t++) {
			r[g].sorted[t] = kp[t].k;
			r[g].cum[t + 1] = r[g].cum[t] +
				expl((long double)((double)(kp[t].s - mx) * (double)scale));
		}
		free(kp);
	}
	free(scr_h);
	return r;
}

void refs_free(seg_ref *r, uint32_t segs)
{
	for (uint32_t g = 0; g < segs; g++) {
		free(r[g].sorted);
		free(r[g].cum);
	}
	free(r);
}

/*
 * The GPU's threshold of one segment against the exact definition, as gpu/select.cuh states it:
 * a token is in the Top-p set iff the mass of the scores strictly above its own is < p Z; the GPU's
 * set (scores >= thresh) may differ only in tokens where that mass lies within
 * tol = 2^-19 Z + n 2^-38 of p Z, and covers at least p Z - tol; its count is the tokens at or
 * above its threshold, and the clamp follows kvt_topp_mark's rule from that count. Masses in long
 * double over the sorted terms of the reference r (the test's own error is far below tol). Where
 * the count equals the CPU's, the threshold must too. Returns whether it does.
 */
bool check_window(const char *what, uint32_t seg, const seg_ref *r, uint32_t n, float p,
			 uint32_t bmin, uint32_t bmax, const kvt_gpu_topp *o, int *bad)
{
	if (n == 0 || p >= 1.0f) {
		T_SOFT(bad, (int)o->count == r->cnt && (n == 0 || o->thresh == r->thr),
		       "%s segment %u: count %u/%d thresh %.9g/%.9g (got/wanted)", what, seg,
		       o->count, r->cnt, (double)o->thresh, (double)r->thr);
	} else {
		const float *sorted = r->sorted;
		const long double Z = r->cum[n], pz = (long double)p * Z,
				  tol = Z * 0x1p-19L + n * 0x1p-38L;
		uint32_t ge = 0, outside = 0;
		long double covered = 0.0L;
		for (uint32_t i = 0; i < n;) {
			uint32_t j = i;
			while (j < n && sorted[j] == sorted[i])
				j++;
			const long double above = r->cum[i];
			const bool exact_in = above < pz, gpu_in = sorted[i] >= o->thresh;
			if (gpu_in) {
				ge = j;
				covered = r->cum[j];
			}
			if (exact_in != gpu_in && fabsl(above - pz) > tol)
				outside++;
			i = j;
		}
		T_SOFT(bad, outside == 0 && o->count == ge && covered >= pz - tol,
		       "%s segment %u (n %u, seed %llu): %u values differ from the exact set outside "
		       "the window; count %u, tokens >= thresh %u; covered %.12Lg of p Z %.12Lg (tol "
		       "%.3Lg)",
		       what, seg, n, (unsigned long long)g_seed, outside, o->count, ge, covered, pz,
		       tol);
	}
	int clamped = 0;
	uint32_t want = o->count;
	if (bmax && want > bmax) {
		want = bmax;
		clamped = -1;
	} else if (want < bmin) {
		want = bmin < n ? bmin : n;
		clamped = want > o->count ? 1 : 0;
	}
	T_SOFT(bad, o->marked == want && o->clamped == clamped,
	       "%s segment %u: marked %u clamped %d from count %u, wanted %u %d", what, seg,
	       o->marked, o->clamped, o->count, want, clamped);
	if ((int)o->count != r->cnt)
		return false;
	T_SOFT(bad, o->thresh == r->thr, "%s segment %u: the CPU's count %u, thresh %.9g/%.9g",
	       what, seg, o->count, (double)o->thresh, (double)r->thr);
	return true;
}

/* Segments given the scan's ring, those whose span it covers, and those it served at the
 * default limit and at KVT_BINS_SERVE_MAX. */
static uint32_t g_ring_segs, g_ring_span, g_ring_served[2];

/* The threshold given the ring (host slots hc, hd) served at most `limit` candidates, against
 * the segments' references. */
static void ring_once(const char *what, uint32_t S, uint32_t Hq, const uint32_t *n,
		      uint32_t max_n, const seg_ref *refs, size_t ld, float scale, float p,
		      uint32_t bmin, uint32_t bmax, const float *ds, const void *dn,
		      const void *dst, void *scr, size_t sb, const uint32_t *hc,
		      const unsigned long long *hd, uint32_t limit, uint32_t *served_sum, int *bad)
{
	const uint32_t segs = S * Hq;
	const size_t nb = (size_t)segs * KVT_BINS;
	uint32_t *lc = (uint32_t *)t_alloc(4 * nb);
	unsigned long long *lh = (unsigned long long *)t_alloc(8 * nb);
	unsigned long long *dserved = (unsigned long long *)dpoison(8), hserved = 0;
	CU(cudaMemset(dserved, 0, 8));
	kvt_gpu_bins ring = {scale, (uint32_t *)dcopy(hc, 4 * nb),
			     (unsigned long long *)dcopy(hd, 8 * nb), limit, dserved};
	kvt_gpu_topp *dout = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * segs);
	unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
	CU(cudaMemset(derr, 0, 8));
	const int rc = kvt_gpu_topp_threshold(S, Hq, ds, ld, (const uint32_t *)dn, max_n, scale, p,
					      bmin, bmax, (const kvt_gpu_segstats *)dst, &ring,
					      dout, scr, sb, derr, NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_topp_threshold with the ring (limit %u): %d", what, limit,
		rc);
	uint32_t served = 0;
	T_CHECK(kvt_gpu_topp_ring_served(scr, S, Hq, &served) == 0, "%s: ring_served", what);
	*served_sum += served;
	fetch(&hserved, dserved, 8); /* the device's counter agrees with the segments' states */
	T_SOFT(bad, hserved == served, "%s (ring, limit %u): the counter says %llu served, the "
	       "states %u", what, limit, hserved, served);
	kvt_gpu_topp *out = (kvt_gpu_topp *)t_alloc(sizeof(kvt_gpu_topp) * segs);
	fetch(out, dout, sizeof(kvt_gpu_topp) * segs);
	fetch(&herr, derr, 8);
	fetch(lc, ring.count, 4 * nb);
	fetch(lh, ring.dsum, 8 * nb);
	T_SOFT(bad, herr == 0, "%s (ring): error word 0x%llx", what, herr);
	size_t left = 0;
	for (size_t i = 0; i < nb; i++)
		left += lc[i] != 0 || lh[i] != 0;
	T_SOFT(bad, left == 0, "%s: %zu slots of the ring left nonzero", what, left);
	char w2[128];
	snprintf(w2, sizeof w2, "%s (ring, limit %u)", what, limit);
	for (uint32_t g = 0; g < segs; g++)
		check_window(w2, g, &refs[g], n[g / Hq], p, bmin, bmax, &out[g], bad);
	cudaFree(ring.count);
	cudaFree(ring.dsum);
	cudaFree(dserved);
	cudaFree(dout);
	cudaFree(derr);
	free(out);
	free(lc);
	free(lh);
}

/*
 * The threshold given the scan's ring (kvt_gpu_topp_threshold's ring), built here as the scan
 * builds it (kvt_bins_of, its twin): every segment within the tolerance of the exact set, as
 * without, and the ring left zeroed.
 */
static void check_ring(const char *what, uint32_t S, uint32_t Hq, const uint32_t *n,
		       uint32_t max_n, const float *hs, const seg_ref *refs, size_t ld,
		       float scale, float p, uint32_t bmin, uint32_t bmax, const float *ds,
		       const void *dn, const void *dst, void *scr, size_t sb, int *bad)
{
	const uint32_t segs = S * Hq;
	const size_t nb = (size_t)segs * KVT_BINS;
	uint32_t *hc = (uint32_t *)t_alloc(4 * nb);
	unsigned long long *hd = (unsigned long long *)t_alloc(8 * nb);
	memset(hc, 0, 4 * nb);
	memset(hd, 0, 8 * nb);
	for (uint32_t g = 0; g < segs; g++) {
		const float *x = hs + (size_t)g * ld;
		const uint32_t m = n[g / Hq];
		float mx = m ? x[0] : 0.0f, mn = mx;
		kvt_bins_add_host(x, m, scale, hc + (size_t)g * KVT_BINS, hd + (size_t)g * KVT_BINS);
		for (uint32_t t = 0; t < m; t++) {
			mx = x[t] > mx ? x[t] : mx;
			mn = x[t] < mn ? x[t] : mn;
		}
		g_ring_segs++;
		g_ring_span += m && kvt_bins_serves(mx, mn, scale);
	}
	/* the default limit on the boundary bins' candidates, and the largest */
	const uint32_t limit[2] = {0, KVT_BINS_SERVE_MAX};
	for (int k = 0; k < 2; k++)
		ring_once(what, S, Hq, n, max_n, refs, ld, scale, p, bmin, bmax, ds, dn, dst, scr,
			  sb, hc, hd, limit[k], &g_ring_served[k], bad);
	free(hc);
	free(hd);
}

void check_segments(const char *what, uint32_t S, uint32_t Hq, uint32_t Hkv, const uint32_t *n,
		    uint32_t max_n, const float *hk, size_t ld, const seg_ref *refs, float p,
		    uint32_t bmin, uint32_t bmax, const kvt_gpu_topp *out, const uint32_t *sel,
		    const uint32_t *seln, int *bad)
{
	const uint32_t G = Hq / Hkv;
	uint8_t *mask = (uint8_t *)t_alloc(max_n + 1);
	for (uint32_t s = 0; s < S; s++)
		for (uint32_t h = 0; h < Hkv; h++) {
			memset(mask, 0, max_n + 1);
			for (uint32_t g = 0; g < G; g++) {
				const uint32_t seg = s * Hq + h * G + g;
				const float *x = hk + (size_t)seg * ld;
				const kvt_gpu_topp *o = &out[seg];
				if (check_window(what, seg, &refs[seg], n[s], p, bmin, bmax, o, bad))
					g_exact++;
				g_segs++;
				/* the union's expected set: the GPU's marks by its cut */
				uint32_t mk = 0;
				for (uint32_t t = 0; o->marked && t < n[s]; t++)
					if (sel_key(x[t], t) >= o->cut) {
						mask[t] = 1;
						mk++;
					}
				T_SOFT(bad, mk == o->marked,
				       "%s segment %u: the cut marks %u tokens, marked says %u", what,
				       seg, mk, o->marked);
			}
			uint32_t m = 0, first_diff = UINT32_MAX;
			const uint32_t *gsel = sel + ((size_t)s * Hkv + h) * max_n;
			for (uint32_t t = 0; t < n[s]; t++)
				if (mask[t]) {
					if (first_diff == UINT32_MAX &&
					    (m >= seln[s * Hkv + h] || gsel[m] != t))
						first_diff = m;
					m++;
				}
			T_SOFT(bad, seln[s * Hkv + h] == m && first_diff == UINT32_MAX,
			       "%s seq %u KV head %u: union of %u tokens, got %u, first difference at "
			       "entry %u",
			       what, s, h, m, seln[s * Hkv + h], first_diff);
		}
	free(mask);
}

/* One configuration of the threshold and union against the CPU on the same scores. */
static void check_select(const char *what, uint32_t S, uint32_t Hq, uint32_t Hkv, const uint32_t *n,
			 uint32_t max_n, const float *hs, size_t ld, float scale, float p,
			 uint32_t bmin, uint32_t bmax, int *bad)
{
	const uint32_t segs = S * Hq;
	float *ds = (float *)dcopy(hs, 4 * (size_t)segs * ld);
	void *dn = dcopy(n, 4 * S);
	const size_t sb = kvt_gpu_select_scratch_bytes(S, Hq, Hkv, max_n);
	/* the scratch needs no initial contents: here every word 2, small counts and states as an
	 * earlier call with other shapes may leave them (the threshold's state word 2 is a segment
	 * waiting for its candidates) */
	uint32_t *hscr = (uint32_t *)t_alloc(sb);
	for (size_t w = 0; w < sb / 4; w++)
		hscr[w] = 2;
	void *scr = dcopy(hscr, sb);
	free(hscr);
	kvt_gpu_topp *dout = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * segs);
	uint32_t *dsel = (uint32_t *)dpoison(4 * (size_t)S * Hkv * max_n),
		 *dseln = (uint32_t *)dpoison(4 * S * Hkv);
	unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
	CU(cudaMemset(derr, 0, 8));
	/* first with the statistics given, as the scan gathers them, then gathering them itself:
	 * the same result */
	kvt_gpu_segstats *hst = (kvt_gpu_segstats *)t_alloc(sizeof(kvt_gpu_segstats) * segs);
	for (uint32_t g = 0; g < segs; g++)
		hst[g] = host_segstats(hs + (size_t)g * ld, n[g / Hq]);
	void *dst = dcopy(hst, sizeof(kvt_gpu_segstats) * segs);
	kvt_gpu_topp *given = (kvt_gpu_topp *)t_alloc(sizeof(kvt_gpu_topp) * segs);
	int rc = kvt_gpu_topp_threshold(S, Hq, ds, ld, (const uint32_t *)dn, max_n, scale, p, bmin,
					bmax, (const kvt_gpu_segstats *)dst, NULL, dout, scr, sb, derr,
					NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_topp_threshold %d", what, rc);
	fetch(given, dout, sizeof(kvt_gpu_topp) * segs);
	seg_ref *refs = refs_make(S, Hq, n, hs, NULL, ld, scale, p, max_n);
	check_ring(what, S, Hq, n, max_n, hs, refs, ld, scale, p, bmin, bmax, ds, dn, dst, scr, sb,
		   bad);
	rc = kvt_gpu_topp_threshold(S, Hq, ds, ld, (const uint32_t *)dn, max_n, scale, p, bmin,
				    bmax, NULL, NULL, dout, scr, sb, derr, NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_topp_threshold %d", what, rc);
	rc = kvt_gpu_topp_union(S, Hq, Hkv, ds, ld, (const uint32_t *)dn, max_n, dout, dsel, max_n,
				dseln, scr, sb, NULL);
	T_CHECK(rc == 0, "%s: kvt_gpu_topp_union %d", what, rc);
	kvt_gpu_topp *out = (kvt_gpu_topp *)t_alloc(sizeof(kvt_gpu_topp) * segs);
	uint32_t *sel = (uint32_t *)t_alloc(4 * (size_t)S * Hkv * max_n),
		 *seln = (uint32_t *)t_alloc(4 * S * Hkv);
	fetch(out, dout, sizeof(kvt_gpu_topp) * segs);
	fetch(sel, dsel, 4 * (size_t)S * Hkv * max_n);
	fetch(seln, dseln, 4 * S * Hkv);
	fetch(&herr, derr, 8);
	T_SOFT(bad, herr == 0, "%s: error word 0x%llx", what, herr);
	T_SOFT(bad, !memcmp(given, out, sizeof(kvt_gpu_topp) * segs),
	       "%s: the threshold with the scan's statistics differs from the one gathering them",
	       what);
	check_segments(what, S, Hq, Hkv, n, max_n, hs, ld, refs, p, bmin, bmax, out, sel, seln,
		       bad);
	/* the union's bits alone, listed again from a view that starts at the second item: what a
	 * gather of a later run of a step's slots does; the same positions and counts; and the
	 * clamps it counts, those of the segments' outputs */
	const size_t items = (size_t)S * Hkv;
	if (items > 1 && max_n) {
		void *bm = dpoison(kvt_gpu_selbits_bytes(items, max_n));
		kvt_gpu_selbits bits = kvt_gpu_selbits_at(bm, items, max_n);
		unsigned long long *dcl = NULL, cl[2], want[2] = {0, 0};
		CU(cudaMalloc((void **)&dcl, sizeof cl));
		CU(cudaMemset(dcl, 0, sizeof cl));
		rc = kvt_gpu_topp_union_bits(S, Hq, Hkv, ds, ld, (const uint32_t *)dn, max_n, dout,
					     bits, dcl, NULL);
		T_CHECK(rc == 0, "%s: kvt_gpu_topp_union_bits %d", what, rc);
		fetch(cl, dcl, sizeof cl);
		for (uint32_t seg = 0; seg < segs; seg++)
			if (out[seg].clamped)
				want[out[seg].clamped < 0 ? 0 : 1]++;
		T_SOFT(bad, cl[0] == want[0] && cl[1] == want[1],
		       "%s: the union counted %llu cuts to bmax and %llu raises to bmin, the outputs "
		       "hold %llu and %llu", what, cl[0], cl[1], want[0], want[1]);
		cudaFree(dcl);
		bits.mask += bits.words;
		bits.ccount += bits.chunks;
		uint32_t *dsel2 = (uint32_t *)dpoison(4 * (items - 1) * max_n),
			 *dseln2 = (uint32_t *)dpoison(4 * (items - 1));
		rc = kvt_gpu_selbits_list((uint32_t)(items - 1), bits, dsel2, max_n, dseln2, NULL);
		T_CHECK(rc == 0, "%s: kvt_gpu_selbits_list %d", what, rc);
		uint32_t *sel2 = (uint32_t *)t_alloc(4 * (items - 1) * max_n),
			 *seln2 = (uint32_t *)t_alloc(4 * (items - 1));
		fetch(sel2, dsel2, 4 * (items - 1) * max_n);
		fetch(seln2, dseln2, 4 * (items - 1));
		for (size_t it = 1; it < items; it++)
			T_SOFT(bad,
			       seln2[it - 1] == seln[it] &&
				       !memcmp(sel2 + (it - 1) * max_n, sel + it * max_n,
					       4 * (size_t)seln[it]),
			       "%s item %zu listed from a view of the bits: %u tokens, the union %u",
			       what, it, seln2[it - 1], seln[it]);
		free(sel2);
		free(seln2);
		cudaFree(bm);
		cudaFree(dsel2);
		cudaFree(dseln2);
	}
	/* the threshold and the union in one call (the union marked by the candidate pass): the
	 * same outputs, and bit for bit the same bits, chunk counts and clamps as the two calls */
	if (max_n) {
		const size_t bb = kvt_gpu_selbits_bytes(items, max_n);
		void *bm1 = dpoison(bb), *bm2 = dpoison(bb);
		const kvt_gpu_selbits b1 = kvt_gpu_selbits_at(bm1, items, max_n),
				      b2 = kvt_gpu_selbits_at(bm2, items, max_n);
		unsigned long long *dcl = NULL, cl[4];
		CU(cudaMalloc((void **)&dcl, sizeof cl));
		CU(cudaMemset(dcl, 0, sizeof cl));
		kvt_gpu_topp *dout2 = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * segs);
		rc = kvt_gpu_topp_union_bits(S, Hq, Hkv, ds, ld, (const uint32_t *)dn, max_n, dout,
					     b1, dcl, NULL);
		T_CHECK(rc == 0, "%s: kvt_gpu_topp_union_bits %d", what, rc);
		rc = kvt_gpu_topp_select(S, Hq, Hkv, ds, ld, (const uint32_t *)dn, max_n, scale, p,
					 bmin, bmax, (const kvt_gpu_segstats *)dst, NULL, dout2, b2,
					 NULL, dcl + 2, scr, sb, derr, NULL);
		T_CHECK(rc == 0, "%s: kvt_gpu_topp_select %d", what, rc);
		kvt_gpu_topp *out2 = (kvt_gpu_topp *)t_alloc(sizeof(kvt_gpu_topp) * segs);
		uint32_t *h1 = (uint32_t *)t_alloc(bb), *h2 = (uint32_t *)t_alloc(bb);
		fetch(out2, dout2, sizeof(kvt_gpu_topp) * segs);
		fetch(h1, bm1, bb);
		fetch(h2, bm2, bb);
		fetch(cl, dcl, sizeof cl);
		fetch(&herr, derr, 8);
		T_SOFT(bad, herr == 0, "%s: kvt_gpu_topp_select's error word 0x%llx", what, herr);
		T_SOFT(bad, !memcmp(out2, out, sizeof(kvt_gpu_topp) * segs),
		       "%s: kvt_gpu_topp_select's threshold differs from kvt_gpu_topp_threshold's",
		       what);
		const size_t mw = items * b1.words, cw = items * b1.chunks;
		size_t dm = SIZE_MAX, dc = SIZE_MAX;
		for (size_t w = 0; w < mw && dm == SIZE_MAX; w++)
			if (h1[w] != h2[w])
				dm = w;
		const uint32_t *c1 = (const uint32_t *)((char *)h1 + ((char *)b1.ccount - (char *)bm1)),
			       *c2 = (const uint32_t *)((char *)h2 + ((char *)b2.ccount - (char *)bm2));
		for (size_t w = 0; w < cw && dc == SIZE_MAX; w++)
			if (c1[w] != c2[w])
				dc = w;
		T_SOFT(bad, dm == SIZE_MAX && dc == SIZE_MAX,
		       "%s: kvt_gpu_topp_select's union bits differ from k_union_mark's (first mask "
		       "word %lld: 0x%08x against 0x%08x; first chunk count %lld; -1: none)",
		       what, dm == SIZE_MAX ? -1ll : (long long)dm, dm == SIZE_MAX ? 0 : h2[dm],
		       dm == SIZE_MAX ? 0 : h1[dm], dc == SIZE_MAX ? -1ll : (long long)dc);
		T_SOFT(bad, cl[2] == cl[0] && cl[3] == cl[1],
		       "%s: kvt_gpu_topp_select counted %llu / %llu clamps, the union %llu / %llu",
		       what, cl[2], cl[3], cl[0], cl[1]);
		free(out2);
		free(h1);
		free(h2);
		cudaFree(dcl);
		cudaFree(dout2);
		cudaFree(bm1);
		cudaFree(bm2);
	}
	refs_free(refs, segs);
	free(hst);
	free(given);
	cudaFree(dst);
	free(out);
	free(sel);
	free(seln);
	cudaFree(ds);
	cudaFree(dn);
	cudaFree(scr);
	cudaFree(dout);
	cudaFree(dsel);
	cudaFree(dseln);
	cudaFree(derr);
}

void test_select(void **state)
{
	(void)state;
	const uint32_t S = 3, Hq = 8, Hkv = 2, n[3] = {1, 20000, 3001}, max_n = 20000;
	const size_t ld = 20000;
	const float ps[5] = {1e-6f, 0.5f, 0.9f, 0.999f, 1.0f};
	const uint32_t budgets[4][2] = {{0, 0}, {5, 0}, {0, 40}, {700, 900}};
	float *hs = (float *)t_alloc(4 * (size_t)S * Hq * ld);
	int bad = 0, cases = 0;
	for (int kind = 0; kind < D_NDIST; kind++) {
		/* uniform scores overflow the candidate list: the whole-segment resolution */
		if (g_quick && kind != D_NORMAL && kind != D_TIED && kind != D_UNIFORM)
			continue;
		t_rng rng;
		seeded(&rng, 300 + kind);
		memset(hs, 0xff, 4 * (size_t)S * Hq * ld); /* past n: NaN, which must be ignored */
		for (uint32_t s = 0; s < S; s++)
			for (uint32_t j = 0; j < Hq; j++)
				t_scores(&rng, (enum t_dist)(j % 3 == 2 ? D_TIED : kind), n[s],
				    hs + ((size_t)s * Hq + j) * ld);
		for (int pi = g_quick ? 2 : 0; pi < 5; pi += g_quick ? 2 : 1)
			for (int bi = 0; bi < 4; bi += g_quick ? 3 : 1) {
				char what[96];
				const float scale = kind == D_WIDE ? 1.0f : 0.0883883476f;
				snprintf(what, sizeof what, "%s p=%g budget [%u, %u]",
					 t_dist_name[kind], (double)ps[pi], budgets[bi][0],
					 budgets[bi][1]);
				check_select(what, S, Hq, Hkv, n, max_n, hs, ld, scale, ps[pi],
					     budgets[bi][0], budgets[bi][1], &bad);
				cases++;
				T_CHECK(bad == 0, "%d differences", bad);
			}
	}
	free(hs);
	/* many segments of many chunks: each block of the threshold takes several chunks */
	{
		enum { S2 = 8, H2 = 8, N2 = 70000 };
		uint32_t n2[S2];
		float *h2 = (float *)t_alloc(4 * (size_t)S2 * H2 * N2);
		t_rng rng;
		seeded(&rng, 399);
		for (uint32_t s = 0; s < S2; s++) {
			n2[s] = N2 - 1000 * s;
			for (uint32_t j = 0; j < H2; j++)
				t_scores(&rng, j % 3 == 2 ? D_TIED : D_NORMAL, n2[s],
				    h2 + ((size_t)s * H2 + j) * N2);
		}
		check_select("strided p=0.9", S2, H2, 2, n2, N2, h2, N2, 0.0883883476f, 0.9f, 0,
			     0, &bad);
		check_select("strided p=0.5 budget [700, 900]", S2, H2, 2, n2, N2, h2, N2,
			     0.0883883476f, 0.5f, 700, 900, &bad);
		cases += 2;
		T_CHECK(bad == 0, "%d differences", bad);
		free(h2);
	}
	printf("selection: %d configurations within the window of the exact sets; %u of %u "
	       "segments equal to the CPU's double sums (seed %llu); with the scan's ring too, "
	       "which covered the span of %u of %u segments and served %u (%u at its limit %u)\n",
	       cases, g_exact, g_segs, (unsigned long long)g_seed, g_ring_span, g_ring_segs,
	       g_ring_served[0], g_ring_served[1], KVT_BINS_SERVE_MAX);
	/* both ways of a ring's segment are taken: served, and declined for full boundary bins;
	 * the larger limit serves more */
	T_CHECK(g_ring_served[0] > 0 && g_ring_served[0] < g_ring_served[1] &&
			g_ring_served[1] < g_ring_span,
		"the ring served %u and %u of %u", g_ring_served[0], g_ring_served[1],
		g_ring_span);
}

void test_select_nonfinite(void **state)
{
	(void)state;
	const uint32_t S = 1, Hq = 4, n[1] = {5000};
	const size_t ld = 5000;
	const float bads[3] = {NAN, INFINITY, -INFINITY};
	float *hs = (float *)t_alloc(4 * (size_t)Hq * ld);
	t_rng rng;
	seeded(&rng, 400);
	/* the threshold gathering the statistics itself, and given them as the scan gathers them
	 * (bad: the first non-finite position, complemented) */
	for (int b = 0; b < 6; b++) {
		const bool given = b >= 3;
		for (uint32_t j = 0; j < Hq; j++)
			t_scores(&rng, D_NORMAL, n[0], hs + (size_t)j * ld);
		const uint32_t at = 17 + 1000 * (uint32_t)(b % 3);
		hs[2 * ld + at] = bads[b % 3];
		kvt_gpu_segstats hst[4];
		for (uint32_t j = 0; j < Hq; j++)
			hst[j] = host_segstats(hs + (size_t)j * ld, n[0]);
		void *dst = dcopy(hst, sizeof hst);
		float *ds = (float *)dcopy(hs, 4 * (size_t)Hq * ld);
		void *dn = dcopy(n, 4);
		const size_t sb = kvt_gpu_select_scratch_bytes(S, Hq, 1, n[0]);
		void *scr = dpoison(sb);
		kvt_gpu_topp *dout = (kvt_gpu_topp *)dpoison(sizeof(kvt_gpu_topp) * Hq), out[4];
		unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 0;
		CU(cudaMemset(derr, 0, 8));
		int rc = kvt_gpu_topp_threshold(S, Hq, ds, ld, (const uint32_t *)dn, n[0], 0.125f,
						0.9f, 0, 0,
						given ? (const kvt_gpu_segstats *)dst : NULL, NULL, dout,
						scr, sb, derr, NULL);
		fetch(&herr, derr, 8);
		fetch(out, dout, sizeof out);
		T_CHECK(rc == 0 && KVT_GPU_ERR_CODE(herr) == KVT_GPU_ERR_NONFINITE &&
				KVT_GPU_ERR_WHERE(herr) == 2 && KVT_GPU_ERR_INDEX(herr) == at &&
				out[2].marked == 0 && out[1].marked > 0,
			"non-finite %g at segment 2 position %u (statistics %s): rc %d, error word "
			"0x%llx, marked %u",
			(double)bads[b % 3], at, given ? "given" : "gathered", rc, herr,
			out[2].marked);
		cudaFree(dst);
		cudaFree(ds);
		cudaFree(dn);
		cudaFree(scr);
		cudaFree(dout);
		cudaFree(derr);
	}
	free(hs);
}
