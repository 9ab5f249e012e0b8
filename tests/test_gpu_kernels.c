/* SPDX-License-Identifier: MIT */
/*
 * The GPU kernels of gpu/ against their CPU twins in lib/, on fresh random inputs (the seed is
 * printed; KVT_TEST_SEED=n repeats a run), with every output buffer poisoned (0xff bytes) before the
 * launch so that an element the kernel failed to write cannot pass:
 * - index build: codes, sigma and beta bit-equal to kvt_index_build, neighbours untouched;
 * - query preparation and scan: bit-equal to kvt_query_prepare and kvt_score;
 * - Top-p (test_gpu_select.c): the threshold within its stated tolerance of the exact set, the
 *   clamp and marked sets by its cut, the group union compacted in order; non-finite scores raise
 *   the error word;
 * - attention: within 1e-3 of kvt_attention (the largest error seen is printed), rows from device
 *   memory and from mapped pinned host memory.
 * - the list of a spilled fetch's misses (test_gpu_spill_list.c): exactly the missed rows of NULL
 *   blocks of the spilled sequences, scattered where staged, then served by the fill;
 * - the scan's first histogram (test_gpu_bins.c): counts and sums equal to the CPU twin's.
 * Exits 77 (skipped) when no CUDA device is present.
 */
#include <cuda_runtime.h>
#include <time.h>
#include <unistd.h>

#include "gpu_kernels.h"
#include "gpu/attend.cuh"
#include "gpu/index.cuh"

uint64_t g_seed;
int g_quick;

/* Device memory filled with 0xff bytes (NaN floats, fp16 NaN, all-ones words). */
void *dpoison(size_t bytes)
{
	void *p = NULL;
	CU(cudaMalloc(&p, bytes ? bytes : 1));
	CU(cudaMemset(p, 0xff, bytes ? bytes : 1));
	return p;
}

void *dcopy(const void *h, size_t bytes)
{
	void *p = dpoison(bytes);
	CU(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice));
	return p;
}

void fetch(void *h, const void *d, size_t bytes)
{
	CU(cudaDeviceSynchronize());
	CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

void seeded(t_rng *r, uint64_t salt)
{
	t_rng_seed(r, g_seed ^ (salt * 0x9e3779b97f4a7c15ull));
}

float *rotation(uint32_t d)
{
	float *rot = (float *)t_alloc(sizeof(float) * d * d);
	int rc = kvt_rotation_generate(g_seed, 3, d, rot);
	T_CHECK(rc == 0, "kvt_rotation_generate: %d", rc);
	return rot;
}

void fill_f(t_rng *r, float *x, size_t n, double mean, double sd)
{
	for (size_t i = 0; i < n; i++)
		x[i] = (float)(mean + sd * t_normal(r));
}

const uint32_t dims[3] = {64, 128, 256};

/* The selection's order key of a score (-0 taken as +0) above the complement of its position, as
 * the GPU's cut reads it. */
uint64_t sel_key(float x, uint32_t t)
{
	uint32_t u;
	x += 0.0f;
	memcpy(&u, &x, 4);
	u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
	return (uint64_t)u << 32 | (0xffffffffu - t);
}

kvt_gpu_segstats host_segstats(const float *x, uint32_t n)
{
	kvt_gpu_segstats w = {0, 0, 0, 0};
	for (uint32_t t = 0; t < n; t++) {
		if (!isfinite(x[t])) {
			if (!w.bad)
				w.bad = 0xffffffffu - t;
			continue;
		}
		const uint32_t k = (uint32_t)(sel_key(x[t], 0) >> 32);
		w.max_key = k > w.max_key ? k : w.max_key;
		w.nmin_key = ~k > w.nmin_key ? ~k : w.nmin_key;
	}
	return w;
}

/* ---- index build ------------------------------------------------------------------------- */

static void test_index_build(void **state)
{
	(void)state;
	const uint32_t H = 3, dts[3] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_F32};
	/* job 0: [n][H][d] keys into view 0 from 0; job 1: heads strided apart, into view 1 from 5 */
	const uint32_t nj[2] = {37, 100}, first[2] = {0, 5}, cap[2] = {40, 120};
	for (int di = 0; di < 3; di++)
		for (int ti = 0; ti < 3; ti++) {
			const uint32_t d = dims[di], W = d / 32, dt = dts[ti];
			const size_t esz = dt == KVT_DTYPE_F32 ? 4 : 2;
			t_rng rng;
			seeded(&rng, 100 + di * 3 + ti);
			float *rot = rotation(d), *ck = (float *)t_alloc(4 * H * d),
			      *cq = (float *)t_alloc(4 * H * d);
			fill_f(&rng, ck, H * d, 0.2, 0.3);
			fill_f(&rng, cq, H * d, -0.1, 0.5);
			kvt_gpu_index_view hv[2];
			kvt_gpu_index_job hj[2];
			void *kh[2], *kd[2];
			float *kf[2];
			uint64_t tstride[2] = {(uint64_t)H * d, d},
				 hstride[2] = {d, (uint64_t)nj[1] * d};
			for (int j = 0; j < 2; j++) {
				const size_t ne = (size_t)nj[j] * H * d;
				kh[j] = t_alloc(ne * esz);
				kf[j] = (float *)t_alloc(ne * 4);
				for (size_t i = 0; i < ne; i++) {
					float f = (float)(0.2 + t_normal(&rng));
					/* keys beyond fp16's sigma and beta: rows near the fp16 maximum,
					 * and (bf16, f32) rows of +-3e38 whose residual overflows float;
					 * both backends store them saturated (+-65504, NaN as 0) */
					if (i / d % 7 == 3)
						f = fmaxf(-60000.0f, fminf(60000.0f, f * 30000.0f));
					if (i / d % 7 == 5 && dt != KVT_DTYPE_F16)
						f = t_below(&rng, 2) ? 3.0e38f : -3.0e38f;
					if (dt == KVT_DTYPE_F32)
						((float *)kh[j])[i] = kf[j][i] = f;
					else
						kf[j][i] = t_dec(dt, ((uint16_t *)kh[j])[i] =
									     t_enc(dt, f));
				}
				kd[j] = dcopy(kh[j], ne * esz);
				hv[j].codes = (uint32_t *)dpoison(4 * (size_t)H * cap[j] * W);
				hv[j].sigma = (uint16_t *)dpoison(2 * (size_t)H * cap[j]);
				hv[j].beta = (uint16_t *)dpoison(2 * (size_t)H * cap[j]);
				hv[j].cap = cap[j];
				hv[j].reserved = 0;
			}
			/* a key equal to its centroid: zero residual, code 0 and sigma 0 */
			memcpy(ck, kf[0], 4 * d);
			float *dck = (float *)dcopy(ck, 4 * H * d),
			      *dcq = (float *)dcopy(cq, 4 * H * d);
			for (int j = 0; j < 2; j++)
				hj[j] = (kvt_gpu_index_job){kd[j],    tstride[j], hstride[j],
							    dck,      dcq,        (uint32_t)j,
							    first[j], nj[j],      0};
			float *drot = (float *)dcopy(rot, 4 * (size_t)d * d);
			void *djobs = dcopy(hj, sizeof hj), *dviews = dcopy(hv, sizeof hv);
			unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
			CU(cudaMemset(derr, 0, 8));
			int rc = kvt_gpu_index_build(
				d, dt, H, drot, 2, (const kvt_gpu_index_job *)djobs, 128,
				(const kvt_gpu_index_view *)dviews, derr, NULL);
			T_CHECK(rc == 0, "kvt_gpu_index_build d=%u %s: %d", d, t_dtype_name(dt),
				rc);
			fetch(&herr, derr, 8);
			T_CHECK(herr == 0, "error word 0x%llx", herr);
			for (int j = 0; j < 2; j++) {
				const size_t ne = (size_t)H * cap[j];
				uint32_t *codes = (uint32_t *)t_alloc(4 * ne * W);
				uint16_t *sig = (uint16_t *)t_alloc(2 * ne),
					 *bet = (uint16_t *)t_alloc(2 * ne);
				fetch(codes, hv[j].codes, 4 * ne * W);
				fetch(sig, hv[j].sigma, 2 * ne);
				fetch(bet, hv[j].beta, 2 * ne);
				int bad = 0;
				for (uint32_t h = 0; h < H; h++)
					for (uint32_t p = 0; p < cap[j]; p++) {
						const size_t at = (size_t)h * cap[j] + p;
						if (p < first[j] || p >= first[j] + nj[j]) {
							T_SOFT(&bad,
							       sig[at] == 0xffff &&
								       bet[at] == 0xffff &&
								       codes[at * W] == 0xffffffffu,
							       "d=%u job %d head %u position %u outside the job was "
							       "written",
							       d, j, h, p);
							continue;
						}
						const uint32_t t = p - first[j];
						uint32_t wc[8];
						uint16_t ws, wb;
						kvt_index_build(d, rot, ck + h * d, cq + h * d, 1,
								kf[j] + t * tstride[j] +
									h * hstride[j],
								d, wc, &ws, &wb);
						T_SOFT(&bad,
						       memcmp(wc, codes + at * W, 4 * W) == 0 &&
							       ws == sig[at] && wb == bet[at],
						       "d=%u %s job %d head %u token %u (seed %llu): code[0] got "
						       "0x%08x wanted 0x%08x, sigma got 0x%04x wanted 0x%04x, beta got "
						       "0x%04x wanted 0x%04x",
						       d, t_dtype_name(dt), j, h, t,
						       (unsigned long long)g_seed, codes[at * W],
						       wc[0], sig[at], ws, bet[at], wb);
						T_SOFT(&bad,
						       (sig[at] & 0x7c00u) != 0x7c00u &&
							       (bet[at] & 0x7c00u) != 0x7c00u,
						       "d=%u %s job %d head %u token %u: sigma 0x%04x beta "
						       "0x%04x, wanted finite (saturated)", d,
						       t_dtype_name(dt), j, h, t, sig[at], bet[at]);
						if (j == 0 && h == 0 && t == 0)
							T_SOFT(&bad, ws == 0 && wc[0] == 0,
							       "zero residual: sigma 0x%04x code 0x%08x",
							       ws, wc[0]);
						if (bad > 5)
							fail();
					}
				T_CHECK(bad == 0, "%d index entries differ", bad);
				free(codes);
				free(sig);
				free(bet);
				cudaFree(hv[j].codes);
				cudaFree(hv[j].sigma);
				cudaFree(hv[j].beta);
				cudaFree(kd[j]);
				free(kh[j]);
				free(kf[j]);
			}
			/* a job past its view's capacity is refused on the device, writing nothing */
			hj[0].first = cap[0] - 2;
			CU(cudaMemcpy(djobs, hj, sizeof hj, cudaMemcpyHostToDevice));
			rc = kvt_gpu_index_build(d, dt, H, drot, 1,
						 (const kvt_gpu_index_job *)djobs, 128,
						 (const kvt_gpu_index_view *)dviews, derr, NULL);
			fetch(&herr, derr, 8);
			T_CHECK(rc == 0 && KVT_GPU_ERR_CODE(herr) == KVT_GPU_ERR_RANGE &&
					KVT_GPU_ERR_SITE(herr) == KVT_GPU_SITE_INDEX_CAP &&
					KVT_GPU_ERR_WHERE(herr) == 0,
				"job past capacity: rc %d, error word 0x%llx", rc, herr);
			cudaFree(drot);
			cudaFree(djobs);
			cudaFree(dviews);
			cudaFree(derr);
			cudaFree(dck);
			cudaFree(dcq);
			free(rot);
			free(ck);
			free(cq);
		}
}

/* ---- query preparation and scan ---------------------------------------------------------- */

/* kvt_score's A, B, C from a CPU-prepared query (-ffp-contract=off: the same roundings). */
static void cpu_abc(uint32_t d, const kvt_qcode *qc, float *A, float *B, float *C)
{
	const float isd = 1.0f / sqrtf((float)d);
	*A = 2.0f * qc->delta * isd;
	*B = 2.0f * qc->x_l * isd;
	*C = (-qc->delta * qc->sum_u - (float)d * qc->x_l) * isd;
}

static void test_prepare_and_score(void **state)
{
	(void)state;
	enum { S = 3 };
	const uint32_t Hkv = 2, groups[3] = {1, 4, 9}, ns[S] = {1, 4099, 1000};
	for (int di = 0; di < 3; di++)
		for (int gi = 0; gi < 3; gi++) {
			const uint32_t d = dims[di], W = d / 32, G = groups[gi], Hq = G * Hkv;
			const uint32_t dt = gi == 1 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16, ld = 4100;
			t_rng rng;
			seeded(&rng, 200 + di * 3 + gi);
			float *rot = rotation(d);
			float *cq = (float *)t_alloc(4 * S * Hkv * d),
			      *ck = (float *)t_alloc(4 * S * Hkv * d);
			fill_f(&rng, cq, S * Hkv * d, 0.1, 0.4);
			fill_f(&rng, ck, S * Hkv * d, -0.2, 0.4);
			uint16_t *qh = (uint16_t *)t_alloc(2 * S * Hq * d);
			float *qf = (float *)t_alloc(4 * S * Hq * d);
			t_fill(&rng, dt, (size_t)S * Hq * d, 0.3, 1.5, qh, qf);
			/* indexes from the CPU, on random keys; one all-zero and one all-ones code */
			kvt_gpu_index_view hv[S];
			uint32_t *codes[S];
			uint16_t *sig[S], *bet[S];
			const float *cqp[S], *ckp[S];
			float *key = (float *)t_alloc(4 * d);
			for (uint32_t s = 0; s < S; s++) {
				const uint32_t cap = ns[s] + 3;
				codes[s] = (uint32_t *)t_alloc(4 * (size_t)Hkv * cap * W);
				sig[s] = (uint16_t *)t_alloc(2 * (size_t)Hkv * cap);
				bet[s] = (uint16_t *)t_alloc(2 * (size_t)Hkv * cap);
				for (uint32_t h = 0; h < Hkv; h++)
					for (uint32_t t = 0; t < ns[s]; t++) {
						const size_t at = (size_t)h * cap + t;
						fill_f(&rng, key, d, 0.0, 1.0 + 0.5 * (t % 3));
						kvt_index_build(d, rot, ck + (s * Hkv + h) * d,
								cq + (s * Hkv + h) * d, 1, key, d,
								codes[s] + at * W, sig[s] + at,
								bet[s] + at);
						if (t == 1 || t == 2)
							memset(codes[s] + at * W, t == 1 ? 0 : 0xff,
							       4 * W);
					}
				/* scores that are not finite, for the statistics' first position:
				 * a NaN beta, an infinite sigma, an infinite beta */
				if (s == 1)
					bet[s][3000] = 0x7e00;
				if (s == 2) {
					sig[s][cap + 600] = 0x7c00;
					bet[s][cap + 200] = 0xfc00;
				}
				hv[s] = (kvt_gpu_index_view){
					(uint32_t *)dcopy(codes[s], 4 * (size_t)Hkv * cap * W),
					(uint16_t *)dcopy(sig[s], 2 * (size_t)Hkv * cap),
					(uint16_t *)dcopy(bet[s], 2 * (size_t)Hkv * cap), cap, 0};
				cqp[s] = (const float *)dcopy(cq + s * Hkv * d, 4 * Hkv * d);
				ckp[s] = (const float *)dcopy(ck + s * Hkv * d, 4 * Hkv * d);
			}
			float *drot = (float *)dcopy(rot, 4 * (size_t)d * d);
			void *dq = dcopy(qh, 2 * (size_t)S * Hq * d);
			void *dcq = dcopy(cqp, sizeof cqp), *dck = dcopy(ckp, sizeof ckp);
			kvt_gpu_qcode *dqc =
				(kvt_gpu_qcode *)dpoison(sizeof(kvt_gpu_qcode) * S * Hq);
			int rc = kvt_gpu_query_prepare(d, dt, S, Hq, Hkv, drot, dq,
						       (const float *const *)dcq,
						       (const float *const *)dck, dqc, NULL);
			T_CHECK(rc == 0, "kvt_gpu_query_prepare: %d", rc);
			kvt_gpu_qcode *gqc =
				(kvt_gpu_qcode *)t_alloc(sizeof(kvt_gpu_qcode) * S * Hq);
			fetch(gqc, dqc, sizeof(kvt_gpu_qcode) * S * Hq);
			kvt_qcode *qc = (kvt_qcode *)t_alloc(sizeof(kvt_qcode) * S * Hq);
			for (uint32_t s = 0; s < S; s++)
				for (uint32_t j = 0; j < Hq; j++) {
					const uint32_t h = j / G, i = s * Hq + j;
					kvt_query_prepare(d, rot, cq + (s * Hkv + h) * d,
							  ck + (s * Hkv + h) * d,
							  qf + (size_t)i * d, &qc[i]);
					float A, B, C;
					cpu_abc(d, &qc[i], &A, &B, &C);
					const kvt_gpu_qcode *g = &gqc[i];
					T_CHECK(t_fbits(g->x_l) == t_fbits(qc[i].x_l) &&
							t_fbits(g->delta) == t_fbits(qc[i].delta) &&
							g->sum_u == qc[i].sum_u &&
							t_fbits(g->qc_ck) == t_fbits(qc[i].qc_ck) &&
							t_fbits(g->A) == t_fbits(A) &&
							t_fbits(g->B) == t_fbits(B) &&
							t_fbits(g->C) == t_fbits(C) && g->d == d &&
							memcmp(g->planes, qc[i].planes,
							       sizeof g->planes) == 0,
						"prepare d=%u seq %u head %u (seed %llu): x_l %.9g/%.9g delta "
						"%.9g/%.9g sum_u %g/%g qc_ck %.9g/%.9g C %.9g/%.9g (got/wanted)",
						d, s, j, (unsigned long long)g_seed, (double)g->x_l,
						(double)qc[i].x_l, (double)g->delta,
						(double)qc[i].delta, (double)g->sum_u,
						(double)qc[i].sum_u, (double)g->qc_ck,
						(double)qc[i].qc_ck, (double)g->C, (double)C);
				}
			const uint32_t hn[S] = {ns[0], ns[1], ns[2]};
			void *dviews = dcopy(hv, sizeof hv), *dn = dcopy(hn, sizeof hn);
			float *dsc = (float *)dpoison(4 * (size_t)S * Hq * ld);
			unsigned long long *derr = (unsigned long long *)dpoison(8), herr = 1;
			CU(cudaMemset(derr, 0, 8));
			kvt_gpu_segstats *dstat = (kvt_gpu_segstats *)dpoison(sizeof(kvt_gpu_segstats) * S * Hq),
					 *gstat = (kvt_gpu_segstats *)t_alloc(sizeof(kvt_gpu_segstats) * S * Hq);
			CU(cudaMemset(dstat, 0, sizeof(kvt_gpu_segstats) * S * Hq));
			rc = kvt_gpu_score(d, S, Hq, Hkv, dqc, (const kvt_gpu_index_view *)dviews,
					   (const uint32_t *)dn, 4099, dsc, ld, dstat, NULL, derr,
					   NULL);
			T_CHECK(rc == 0, "kvt_gpu_score: %d", rc);
			float *gs = (float *)t_alloc(4 * (size_t)S * Hq * ld),
			      *ws = (float *)t_alloc(4 * 4100);
			fetch(gs, dsc, 4 * (size_t)S * Hq * ld);
			fetch(&herr, derr, 8);
			T_CHECK(herr == 0, "score error word 0x%llx", herr);
			fetch(gstat, dstat, sizeof(kvt_gpu_segstats) * S * Hq);
			int bad = 0;
			for (uint32_t s = 0; s < S; s++)
				for (uint32_t j = 0; j < Hq; j++) {
					const uint32_t h = j / G, cap = hv[s].cap;
					kvt_score(d, &qc[s * Hq + j], ns[s],
						  codes[s] + (size_t)h * cap * W,
						  sig[s] + (size_t)h * cap,
						  bet[s] + (size_t)h * cap, ws);
					const float *g = gs + ((size_t)s * Hq + j) * ld;
					for (uint32_t t = 0; t < ld; t++) {
						if (t >= ns[s]) {
							T_SOFT(&bad, t_fbits(g[t]) == 0xffffffffu,
							       "score past n written: seq %u head %u token %u",
							       s, j, t);
							continue;
						}
						T_SOFT(&bad,
						       t_fbits(g[t]) == t_fbits(ws[t]) ||
							       (g[t] != g[t] && ws[t] != ws[t]),
						       "score d=%u G=%u seq %u head %u token %u (seed %llu): got "
						       "%.9g, wanted %.9g",
						       d, G, s, j, t, (unsigned long long)g_seed,
						       (double)g[t], (double)ws[t]);
						if (bad > 5)
							fail();
					}
					/* the statistics the scan gathered for the threshold */
					const kvt_gpu_segstats w = host_segstats(ws, ns[s]);
					const kvt_gpu_segstats *gt = &gstat[s * Hq + j];
					T_SOFT(&bad,
					       gt->max_key == w.max_key && gt->nmin_key == w.nmin_key &&
						       gt->bad == w.bad,
					       "scan statistics d=%u G=%u seq %u head %u: max key 0x%x/0x%x "
					       "min 0x%x/0x%x bad 0x%x/0x%x (got/wanted)",
					       d, G, s, j, gt->max_key, w.max_key, gt->nmin_key,
					       w.nmin_key, gt->bad, w.bad);
				}
			T_CHECK(bad == 0, "%d scores differ", bad);
			cudaFree(dstat);
			free(gstat);
			for (uint32_t s = 0; s < S; s++) {
				cudaFree(hv[s].codes);
				cudaFree(hv[s].sigma);
				cudaFree(hv[s].beta);
				cudaFree((void *)cqp[s]);
				cudaFree((void *)ckp[s]);
				free(codes[s]);
				free(sig[s]);
				free(bet[s]);
			}
			cudaFree(drot);
			cudaFree(dq);
			cudaFree(dcq);
			cudaFree(dck);
			cudaFree(dqc);
			cudaFree(dviews);
			cudaFree(dn);
			cudaFree(dsc);
			cudaFree(derr);
			free(rot);
			free(cq);
			free(ck);
			free(qh);
			free(qf);
			free(key);
			free(gqc);
			free(qc);
			free(gs);
			free(ws);
		}
}

/* ---- attention --------------------------------------------------------------------------- */

static double g_attn_worst;

static void check_attend(uint32_t d, uint32_t dt, uint32_t G, uint32_t out_dt, int mode, int *bad)
{
	const uint32_t S = 2, Hkv = 2, Hq = G * Hkv, items = S * Hkv, rows_per = 900;
	const uint32_t ns[4] = {0, 1, 300, 777}, max_rows = 800;
	const size_t row_bytes = 4 * (size_t)d;
	t_rng rng;
	seeded(&rng, 500 + d + dt * 7 + G * 13 + out_dt * 17 + (uint32_t)mode * 19);
	/* all rows of all items in one pool; mode 0: device + pointers, 1: mapped host + positions,
	 * 2: device contiguous */
	uint16_t *pool = NULL;
	CU(cudaHostAlloc((void **)&pool, row_bytes * items * rows_per, cudaHostAllocMapped));
	t_fill(&rng, dt, (size_t)2 * d * items * rows_per, 0.0, 1.0, pool, NULL);
	void *dpool = mode == 1 ? (void *)pool : dcopy(pool, row_bytes * items * rows_per);
	uint16_t *q = (uint16_t *)t_alloc(2 * (size_t)S * Hq * d);
	t_fill(&rng, dt, (size_t)S * Hq * d, 0.0, 1.0, q, NULL);
	kvt_gpu_rows it[4];
	uint32_t *pos[4];
	const void **hptr = (const void **)t_alloc(sizeof(void *) * rows_per);
	void *dptr[4] = {NULL, NULL, NULL, NULL}, *dpos[4] = {NULL, NULL, NULL, NULL};
	for (uint32_t i = 0; i < items; i++) {
		pos[i] = (uint32_t *)t_alloc(4 * rows_per);
		for (uint32_t r = 0; r < ns[i]; r++)
			pos[i][r] = mode == 2 ? r : t_below(&rng, rows_per);
		const char *base = (const char *)dpool + row_bytes * rows_per * i;
		memset(&it[i], 0, sizeof it[i]);
		it[i].n = ns[i];
		if (mode == 0) {
			for (uint32_t r = 0; r < ns[i]; r++)
				hptr[r] = base + row_bytes * pos[i][r];
			dptr[i] = dcopy(hptr, sizeof(void *) * (ns[i] ? ns[i] : 1));
			it[i].rows = (const void *const *)dptr[i];
		} else {
			it[i].base = base;
			it[i].stride = row_bytes;
			if (mode == 1) {
				dpos[i] = dcopy(pos[i], 4 * (ns[i] ? ns[i] : 1));
				it[i].pos = (const uint32_t *)dpos[i];
			}
		}
	}
	const size_t osz = out_dt == KVT_DTYPE_F32 ? 4 : 2,
		     sb = kvt_gpu_attend_scratch_bytes(S, Hq, Hkv, d, max_rows);
	void *dq = dcopy(q, 2 * (size_t)S * Hq * d), *dit = dcopy(it, sizeof it),
	     *scr = dpoison(sb);
	void *dout = dpoison(osz * S * Hq * d), *hout = t_alloc(osz * S * Hq * d);
	const float scale = 1.0f / sqrtf((float)d);
	const double out_ulp = out_dt == KVT_DTYPE_BF16  ? 0x1p-8
			       : out_dt == KVT_DTYPE_F16 ? 0x1p-11
							 : 0.0;
	int rc = kvt_gpu_attend(d, dt, out_dt, S, Hq, Hkv, scale, dq, (const kvt_gpu_rows *)dit,
				max_rows, dout, scr, sb, NULL, NULL);
	T_CHECK(rc == 0, "kvt_gpu_attend d=%u: %d", d, rc);
	fetch(hout, dout, osz * S * Hq * d);
	/* the same launch again gives the same bits: no race, no read of unsettled memory */
	void *dout2 = dpoison(osz * S * Hq * d), *hout2 = t_alloc(osz * S * Hq * d);
	rc = kvt_gpu_attend(d, dt, out_dt, S, Hq, Hkv, scale, dq, (const kvt_gpu_rows *)dit,
			    max_rows, dout2, scr, sb, NULL, NULL);
	fetch(hout2, dout2, osz * S * Hq * d);
	const int same = memcmp(hout, hout2, osz * S * Hq * d) == 0;
	if (mode == 2) {
		/* split as for larger batches (a graph's launch): 16 chunks an item (narrow grids),
		 * 32 (wide) and, unsplit, 64, from one scratch sized for this batch at that bound */
		const uint32_t big = 4096, splits[2] = {1024, 4096};
		const size_t sb2 = kvt_gpu_attend_scratch_bytes(S, Hq, Hkv, d, big);
		void *scr2 = dpoison(sb2), *dout4 = dpoison(osz * S * Hq * d);
		void *hout4 = t_alloc(osz * S * Hq * d);
		for (int k = 0; k < 2; k++) {
			rc = kvt_gpu_attend_split(d, dt, out_dt, S, Hq, Hkv, scale, dq,
						  (const kvt_gpu_rows *)dit, big, splits[k], dout4,
						  scr2, sb2, NULL, NULL);
			fetch(hout4, dout4, osz * S * Hq * d);
			double mx = 0, diff = 0;
			for (size_t e = 0; e < (size_t)S * Hq * d; e++) {
				const double a = out_dt == KVT_DTYPE_F32
							 ? ((float *)hout)[e]
							 : t_dec(out_dt, ((uint16_t *)hout)[e]),
					     b = out_dt == KVT_DTYPE_F32
							 ? ((float *)hout4)[e]
							 : t_dec(out_dt, ((uint16_t *)hout4)[e]);
				mx = fmax(mx, fabs(a));
				diff = fmax(diff, fabs(a - b) - 2 * out_ulp * fabs(a));
			}
			T_SOFT(bad, rc == 0 && diff <= 1e-5 * mx,
			       "attention d=%u G=%u split as for %u sequences: rc %d, difference %.3g "
			       "beyond output rounding (largest output %.3g)",
			       d, G, splits[k], rc, diff, mx);
		}
		cudaFree(scr2);
		cudaFree(dout4);
		free(hout4);
	}
	if (mode == 0) {
		/* a bound below the last item's rows: that item's outputs are zeros and the error word
		 * names the check; the others come out as before (same chunks, same merge) */
		unsigned long long *derr = NULL, herr = 0;
		CU(cudaMalloc((void **)&derr, 8));
		CU(cudaMemset(derr, 0, 8));
		void *dout3 = dpoison(osz * S * Hq * d), *hout3 = t_alloc(osz * S * Hq * d);
		rc = kvt_gpu_attend(d, dt, out_dt, S, Hq, Hkv, scale, dq, (const kvt_gpu_rows *)dit,
				    ns[3] - 1, dout3, scr, sb, derr, NULL);
		fetch(hout3, dout3, osz * S * Hq * d);
		fetch(&herr, derr, 8);
		const size_t last = (size_t)(items - 1) / Hkv * Hq + (items - 1) % Hkv * G;
		int zeros = 1;
		for (size_t k = last * d * osz; k < (last + G) * d * osz; k++)
			zeros &= ((const unsigned char *)hout3)[k] == 0;
		T_SOFT(bad,
		       rc == 0 && zeros && !memcmp(hout3, hout, last * d * osz) &&
			       KVT_GPU_ERR_CODE(herr) == KVT_GPU_ERR_RANGE &&
			       KVT_GPU_ERR_SITE(herr) == KVT_GPU_SITE_ATTEND_ROWS &&
			       KVT_GPU_ERR_WHERE(herr) == items - 1 &&
			       KVT_GPU_ERR_INDEX(herr) == ns[3],
		       "attention d=%u G=%u past max_rows: rc %d, zeros %d, error word 0x%llx", d, G,
		       rc, zeros, herr);
		cudaFree(derr);
		cudaFree(dout3);
		free(hout3);
	}
	float *qf = (float *)t_alloc(4 * d), *want = (float *)t_alloc(4 * d);
	float *kf = (float *)t_alloc(4 * (size_t)d * rows_per),
	      *vf = (float *)t_alloc(4 * (size_t)d * rows_per);
	const float **kr = (const float **)t_alloc(sizeof(float *) * rows_per);
	const float **vr = (const float **)t_alloc(sizeof(float *) * rows_per);
	double *ref = (double *)t_alloc(8 * d), worst = 0, worst_gpu_ref = 0, worst_cpu_ref = 0;
	for (uint32_t i = 0; i < items; i++) {
		const char *hbase = (const char *)pool + row_bytes * rows_per * i;
		for (uint32_t r = 0; r < ns[i]; r++) {
			const uint16_t *row = (const uint16_t *)(hbase + row_bytes * pos[i][r]);
			hptr[r] = row;
			for (uint32_t j = 0; j < d; j++) {
				kf[(size_t)r * d + j] = t_dec(dt, row[j]);
				vf[(size_t)r * d + j] = t_dec(dt, row[d + j]);
			}
			kr[r] = kf + (size_t)r * d;
			vr[r] = vf + (size_t)r * d;
		}
		for (uint32_t g = 0; g < G; g++) {
			const size_t at = ((size_t)(i / Hkv) * Hq + (i % Hkv) * G + g) * d;
			for (uint32_t j = 0; j < d; j++)
				qf[j] = t_dec(dt, q[at + j]);
			kvt_attention(d, dt, scale, qf, ns[i], hptr, want);
			t_ref_attention(d, scale, qf, ns[i], kr, vr, ref, NULL);
			double mx = 0, err = 0, eg = 0, ec = 0;
			for (uint32_t j = 0; j < d; j++) {
				const float got =
					out_dt == KVT_DTYPE_F32
						? ((float *)hout)[at + j]
						: t_dec(out_dt, ((uint16_t *)hout)[at + j]);
				T_CHECK(isfinite(got),
					"attention d=%u item %u head %u dim %u not written "
					"or not finite: %g",
					d, i, g, j, (double)got);
				mx = fmax(mx, fabs(want[j]));
				/* beyond the rounding to the output type (half an ulp, relative) */
				err = fmax(err,
					   fabs((double)got - want[j]) - fabs(want[j]) * out_ulp);
				eg = fmax(eg, fabs((double)got - (ns[i] ? ref[j] : 0)));
				ec = fmax(ec, fabs((double)want[j] - (ns[i] ? ref[j] : 0)));
			}
			worst = fmax(worst, mx > 0 ? err / mx : err);
			worst_gpu_ref = fmax(worst_gpu_ref, mx > 0 ? eg / mx : eg);
			worst_cpu_ref = fmax(worst_cpu_ref, mx > 0 ? ec / mx : ec);
		}
	}
	printf("attention d=%u %s G=%u out %s rows %s: relative error %.3g against kvt_attention%s "
	       "(against double: GPU %.3g, CPU %.3g)%s\n",
	       d, t_dtype_name(dt), G, out_dt == KVT_DTYPE_F32 ? "f32" : t_dtype_name(out_dt),
	       mode == 0   ? "device, pointers"
	       : mode == 1 ? "mapped host, positions"
			   : "device, contiguous",
	       worst, out_ulp > 0 ? " beyond output rounding" : "", worst_gpu_ref, worst_cpu_ref,
	       same ? "" : "; DIFFERS BETWEEN TWO RUNS");
	if (out_dt == KVT_DTYPE_F32)
		g_attn_worst = fmax(g_attn_worst, worst);
	T_SOFT(bad, same && worst <= 1e-3,
	       "attention d=%u %s G=%u mode %d (seed %llu): relative error %.3g, repeatable %d", d,
	       t_dtype_name(dt), G, mode, (unsigned long long)g_seed, worst, same);
	cudaFree(dout2);
	free(hout2);
	free(kf);
	free(vf);
	free(kr);
	free(vr);
	free(ref);
	for (uint32_t i = 0; i < items; i++) {
		free(pos[i]);
		cudaFree(dptr[i]);
		cudaFree(dpos[i]);
	}
	if (mode != 1)
		cudaFree(dpool);
	cudaFreeHost(pool);
	cudaFree(dq);
	cudaFree(dit);
	cudaFree(scr);
	cudaFree(dout);
	free(hout);
	free(hptr);
	free(q);
	free(qf);
	free(want);
}

static void test_attend(void **state)
{
	(void)state;
	const uint32_t dts[2] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
	int bad = 0;
	for (int di = g_quick ? 1 : 0; di < (g_quick ? 2 : 3); di++)
		for (int ti = 0; ti < 2; ti++)
			for (int mode = 0; mode < 3; mode++)
				check_attend(dims[di], dts[ti], 4, KVT_DTYPE_F32, mode, &bad);
	const uint32_t groups[4] = {1, 2, 3, 12};
	for (int gi = 0; gi < 4; gi++)
		check_attend(128, KVT_DTYPE_F16, groups[gi], KVT_DTYPE_F32, gi % 3, &bad);
	check_attend(128, KVT_DTYPE_BF16, 4, KVT_DTYPE_BF16, 1, &bad);
	check_attend(64, KVT_DTYPE_F16, 4, KVT_DTYPE_F16, 0, &bad);
	printf("attention: largest relative error against kvt_attention %.3g (seed %llu)\n",
	       g_attn_worst, (unsigned long long)g_seed);
	T_CHECK(bad == 0, "%d attention configurations failed", bad);
}

/* ---- argument checks --------------------------------------------------------------------- */

static void test_arguments(void **state)
{
	(void)state;
	void *p = dpoison(1 << 20);
	T_CHECK(kvt_gpu_index_build(96, KVT_DTYPE_F16, 1, p, 1, p, 1, p, NULL, NULL) == -EOPNOTSUPP,
		"index build d=96");
	T_CHECK(kvt_gpu_index_build(128, 7, 1, p, 1, p, 1, p, NULL, NULL) == -EOPNOTSUPP,
		"dtype 7");
	T_CHECK(kvt_gpu_index_build(128, KVT_DTYPE_F16, 0, p, 1, p, 1, p, NULL, NULL) == -EINVAL,
		"H 0");
	T_CHECK(kvt_gpu_query_prepare(128, KVT_DTYPE_F32, 1, 4, 2, p, p, p, p, p, NULL) ==
			-EOPNOTSUPP,
		"prepare f32");
	T_CHECK(kvt_gpu_query_prepare(128, KVT_DTYPE_F16, 1, 5, 2, p, p, p, p, p, NULL) == -EINVAL,
		"prepare 5 heads over 2");
	T_CHECK(kvt_gpu_score(80, 1, 4, 2, p, p, p, 8, p, 8, NULL, NULL, NULL, NULL) == -EOPNOTSUPP,
		"score d=80");
	T_CHECK(kvt_gpu_score(128, 1, 4, 2, p, p, p, 8, p, 6, NULL, NULL, NULL, NULL) == -EINVAL,
		"score ld 6");
	T_CHECK(kvt_gpu_score(128, 1, 128, 1, p, p, p, 8, p, 8, NULL, NULL, NULL, NULL) == -EINVAL,
		"group 128");
	T_CHECK(kvt_gpu_topp_threshold(1, 4, p, 8, p, 8, 0.0f, 0.9f, 0, 0, NULL, NULL, p, p, 1 << 20,
				       NULL, NULL) == -EINVAL,
		"scale 0");
	T_CHECK(kvt_gpu_topp_threshold(1, 4, p, 8, p, 8, 1.0f, 0.0f, 0, 0, NULL, NULL, p, p, 1 << 20,
				       NULL, NULL) == -EINVAL,
		"p 0");
	T_CHECK(kvt_gpu_topp_threshold(1, 4, p, 8, p, 8, 1.0f, 0.9f, 0, 0, NULL, NULL, p, p, 16, NULL,
				       NULL) == -EINVAL,
		"scratch too small");
	T_CHECK(kvt_gpu_topp_threshold(1, 4, (const float *)((char *)p + 4), 8, p, 8, 1.0f, 0.9f, 0,
				       0, NULL, NULL, p, p, 1 << 20, NULL, NULL) == -EINVAL,
		"unaligned scores");
	{ /* a ring without statistics, at another scale, or serving past KVT_BINS_SERVE_MAX */
		const kvt_gpu_bins r[3] = {{1.0f, p, p, 0, NULL}, {2.0f, p, p, 0, NULL},
					   {1.0f, p, p, KVT_BINS_SERVE_MAX + 1, NULL}};
		for (int k = 0; k < 3; k++)
			T_CHECK(kvt_gpu_topp_threshold(1, 4, p, 8, p, 8, 1.0f, 0.9f, 0, 0,
						       k ? p : NULL, &r[k], p, p, 1 << 20, NULL,
						       NULL) == -EINVAL,
				"ring %d", k);
	}
	T_CHECK(kvt_gpu_topp_union(1, 4, 2, p, 8, p, 8, p, p, 4, p, p, 1 << 20, NULL) == -EINVAL,
		"sel_ld below max_n");
	{
		kvt_gpu_selbits bits = kvt_gpu_selbits_at(p, 2, 8);
		T_CHECK(bits.words == 1 && bits.chunks == 1, "bits for 8 tokens: %u words, %u chunks",
			bits.words, bits.chunks);
		T_CHECK(kvt_gpu_topp_union_bits(1, 4, 2, p, 40, p, 40, p, bits, NULL, NULL) == -EINVAL,
			"bits made for fewer tokens than max_n");
		T_CHECK(kvt_gpu_topp_union_bits(1, 4, 3, p, 8, p, 8, p, bits, NULL, NULL) == -EINVAL,
			"query heads not a multiple of KV heads");
		kvt_gpu_selbits none = bits;
		none.mask = NULL;
		T_CHECK(kvt_gpu_topp_union_bits(1, 4, 2, p, 8, p, 8, p, none, NULL, NULL) == -EINVAL,
			"NULL mask");
		T_CHECK(kvt_gpu_selbits_list(2, none, p, 8, p, NULL) == -EINVAL, "list: NULL mask");
		kvt_gpu_selbits wide = bits;
		wide.words = 257; /* more than one chunk of 8192 tokens holds */
		T_CHECK(kvt_gpu_selbits_list(2, wide, p, 8, p, NULL) == -EINVAL,
			"list: words beyond the chunks");
		T_CHECK(kvt_gpu_selbits_list(65536, bits, p, 8, p, NULL) == -EINVAL,
			"list: 65536 items");
		/* the fused call refuses what either half would, before it launches anything */
		T_CHECK(kvt_gpu_topp_select(1, 4, 2, p, 8, p, 8, 1.0f, 0.9f, 0, 0, NULL, NULL, p, none, NULL,
					    NULL, p, 1 << 20, NULL, NULL) == -EINVAL,
			"select: NULL mask");
		T_CHECK(kvt_gpu_topp_select(1, 4, 2, p, 40, p, 40, 1.0f, 0.9f, 0, 0, NULL, NULL, p, bits,
					    NULL, NULL, p, 1 << 20, NULL, NULL) == -EINVAL,
			"select: bits made for fewer tokens than max_n");
		T_CHECK(kvt_gpu_topp_select(1, 4, 2, p, 8, p, 8, 1.0f, 0.9f, 0, 0, NULL, NULL, p, wide, NULL,
					    NULL, p, 1 << 20, NULL, NULL) == -EINVAL,
			"select: words beyond the chunks");
		T_CHECK(kvt_gpu_topp_select(1, 4, 3, p, 8, p, 8, 1.0f, 0.9f, 0, 0, NULL, NULL, p, bits, NULL,
					    NULL, p, 1 << 20, NULL, NULL) == -EINVAL,
			"select: query heads not a multiple of KV heads");
		T_CHECK(kvt_gpu_topp_select(1, 4, 2, p, 8, p, 8, 0.0f, 0.9f, 0, 0, NULL, NULL, p, bits, NULL,
					    NULL, p, 1 << 20, NULL, NULL) == -EINVAL,
			"select: scale 0");
		CU(cudaDeviceSynchronize());
	}
	T_CHECK(kvt_gpu_topp_threshold(1, 4, p, 1u << 24, p, 1u << 24, 1.0f, 0.9f, 0, 0, NULL, NULL, p,
				       p, 1 << 20, NULL, NULL) == -EINVAL,
		"max_n 2^24");
	T_CHECK(kvt_gpu_attend(128, KVT_DTYPE_F32, KVT_DTYPE_F32, 1, 4, 2, 1.0f, p, p, 8, p, p,
			       1 << 20, NULL, NULL) == -EOPNOTSUPP,
		"attend f32 rows");
	T_CHECK(kvt_gpu_attend(512, KVT_DTYPE_F16, KVT_DTYPE_F32, 1, 4, 2, 1.0f, p, p, 8, p, p,
			       1 << 20, NULL, NULL) == -EOPNOTSUPP,
		"attend d=512");
	T_CHECK(kvt_gpu_attend(128, KVT_DTYPE_F16, KVT_DTYPE_F32, 1, 4, 2, 1.0f, p, p, 8, p, p, 8,
			       NULL, NULL) == -EINVAL,
		"attend scratch too small");
	cudaFree(p);
}

int main(void)
{
	int count = 0;
	if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
		printf("no CUDA device: skipped\n");
		return 77;
	}
	g_quick = getenv("KVT_TEST_QUICK") != NULL;
	const char *env = getenv("KVT_TEST_SEED");
	g_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
	printf("seed %llu (KVT_TEST_SEED repeats it)\n", (unsigned long long)g_seed);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_arguments),         cmocka_unit_test(test_index_build),
		cmocka_unit_test(test_prepare_and_score), cmocka_unit_test(test_select),
		cmocka_unit_test(test_select_nonfinite),  cmocka_unit_test(test_select_keep),
		cmocka_unit_test(test_attend),
		cmocka_unit_test(test_spill_arguments),   cmocka_unit_test(test_spill_list),
		cmocka_unit_test(test_scan_bins),
		cmocka_unit_test(test_scan_bins_arguments),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
