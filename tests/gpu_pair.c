/* SPDX-License-Identifier: MIT */
/* The pair of caches of the CUDA backend's tests (gpu_pair.h). */
#include "gpu_pair.h"

int g_quick;

bool gpu_tests_start(void)
{
	int count = 0;
	if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
		printf("no CUDA device: skipped\n");
		return false;
	}
	g_quick = getenv("KVT_TEST_QUICK") != NULL;
	return true;
}
size_t row_at(const struct pair *p, uint32_t layer, uint32_t s, uint32_t h, uint32_t pos)
{
	return ((((size_t)layer * NSEQ + s) * HKV + h) * p->max_tokens + pos) * D;
}

/* Tokens [pos, pos + n) of sequence s on layer into hk/hv ([n][HKV][D]) and hq ([n][HQ][D]). */
void make(struct pair *p, uint32_t s, uint32_t layer, uint32_t pos, uint32_t n, int32_t step)
{
	float k[D], v[D], q[(HQ / HKV) * D];
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t h = 0; h < HKV; h++) {
			wl_token(p->w, s, layer, h, pos + t, step, k, v, q, NULL);
			for (uint32_t j = 0; j < D; j++) {
				size_t at = ((size_t)t * HKV + h) * D + j;
				p->hk[at] = t_f2h(k[j]);
				p->hv[at] = t_f2h(v[j]);
				p->rows_k[row_at(p, layer, s, h, pos + t) + j] = p->hk[at];
				p->rows_v[row_at(p, layer, s, h, pos + t) + j] = p->hv[at];
			}
			for (uint32_t g = 0; g < HQ / HKV; g++)
				for (uint32_t j = 0; j < D; j++)
					p->hq[((size_t)t * HQ + h * (HQ / HKV) + g) * D + j] =
						t_f2h(q[g * D + j]);
		}
}

void upload(struct pair *p, uint32_t n)
{
	CU(cudaMemcpy(p->dk, p->hk, (size_t)n * HKV * D * 2, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(p->dv, p->hv, (size_t)n * HKV * D * 2, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(p->dq, p->hq, (size_t)n * HQ * D * 2, cudaMemcpyHostToDevice));
}

uint64_t g_hot_max;
float g_bound_delta;
float g_p;
float g_rescore_p;
float g_keep_weight;

kvt_config config(uint64_t gpu_cache_bytes)
{
	kvt_config cfg = t_config(LAYERS, HQ, HKV, D, KVT_DTYPE_F16); /* each test sets backend */
	cfg.host_bytes = 256u << 20;
	cfg.max_seqs = 4;
	cfg.window = 32;
	cfg.flush_batch = 16;
	cfg.budget_min = 16;
	cfg.gpu_cache_bytes = gpu_cache_bytes;
	cfg.gpu_cache_max_bytes = g_hot_max;
	if (g_p > 0.0f)
		cfg.p = g_p;
	cfg.rescore_p = g_rescore_p;
	cfg.keep_weight = g_keep_weight;
	return cfg;
}

void pair_init(struct pair *p, uint32_t ctx, uint32_t steps, uint64_t gpu_cache_bytes)
{
	memset(p, 0, sizeof *p);
	wl_params wp;
	wl_params_default(&wp);
	wp.n_layers = LAYERS;
	wp.n_q_heads = HQ;
	wp.n_kv_heads = HKV;
	wp.head_dim = D;
	wp.context = ctx;
	wp.steps = steps;
	wp.seed = 7;
	T_CHECK(wl_create(&wp, &p->w) == 0, "wl_create");
	p->ctx = ctx;
	p->max_tokens = ctx + steps;
	kvt_config cfg = config(gpu_cache_bytes);
	cfg.backend = KVT_BACKEND_CPU;
	OK(NULL, kvt_cache_create(&cfg, &p->cpu));
	cfg.backend = KVT_BACKEND_CUDA;
	OK(NULL, kvt_cache_create(&cfg, &p->gpu));
	if (g_bound_delta > 0.0f) {
		kvt_config b = config(gpu_cache_bytes);
		b.backend = KVT_BACKEND_CPU;
		b.p = cfg.p - g_bound_delta;
		OK(NULL, kvt_cache_create(&b, &p->lo));
		b.p = cfg.p + g_bound_delta;
		OK(NULL, kvt_cache_create(&b, &p->hi));
	}
	for (int s = 0; s < NSEQ; s++) {
		OK(p->cpu, kvt_seq_open(p->cpu, &p->sc[s]));
		OK(p->gpu, kvt_seq_open(p->gpu, &p->sg[s]));
		if (p->lo) {
			OK(p->lo, kvt_seq_open(p->lo, &p->sl[s]));
			OK(p->hi, kvt_seq_open(p->hi, &p->sh[s]));
		}
	}
	const size_t big = (size_t)ctx * HQ * D;
	p->hk = malloc(big * 2);
	p->hv = malloc(big * 2);
	p->hq = malloc(big * 2);
	p->out_c = malloc(sizeof(float) * NSEQ * HQ * D);
	p->out_g = malloc(sizeof(float) * NSEQ * HQ * D);
	const size_t rows = (size_t)LAYERS * NSEQ * HKV * p->max_tokens * D;
	p->rows_k = calloc(rows, 2);
	p->rows_v = calloc(rows, 2);
	T_CHECK(p->hk && p->hv && p->hq && p->out_c && p->out_g && p->rows_k && p->rows_v, "malloc");
	CU(cudaMalloc(&p->dk, big * 2));
	CU(cudaMalloc(&p->dv, big * 2));
	CU(cudaMalloc(&p->dq, big * 2));
	CU(cudaMalloc(&p->dout, sizeof(float) * NSEQ * HQ * D));
	/* two prefill chunks per sequence and layer */
	const uint32_t cut[3] = {0, ctx / 3, ctx};
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		for (uint32_t s = 0; s < NSEQ; s++)
			for (int part = 0; part < 2; part++) {
				uint32_t n = cut[part + 1] - cut[part];
				make(p, s, layer, cut[part], n, -1);
				upload(p, n);
				OK(p->cpu, kvt_prefill(p->cpu, p->sc[s], layer, p->hq, p->hk, p->hv, n,
						       NULL));
				OK(p->gpu, kvt_prefill(p->gpu, p->sg[s], layer, p->dq, p->dk, p->dv, n,
						       NULL));
				if (!p->lo)
					continue;
				OK(p->lo, kvt_prefill(p->lo, p->sl[s], layer, p->hq, p->hk, p->hv, n,
						      NULL));
				OK(p->hi, kvt_prefill(p->hi, p->sh[s], layer, p->hq, p->hk, p->hv, n,
						      NULL));
			}
}

void pair_fini(struct pair *p)
{
	kvt_cache_destroy(p->cpu);
	kvt_cache_destroy(p->gpu);
	kvt_cache_destroy(p->lo);
	kvt_cache_destroy(p->hi);
	wl_destroy(p->w);
	free(p->hk);
	free(p->hv);
	free(p->hq);
	free(p->out_c);
	free(p->out_g);
	free(p->rows_k);
	free(p->rows_v);
	cudaFree(p->dk);
	cudaFree(p->dv);
	cudaFree(p->dq);
	cudaFree(p->dout);
}

/* One decode token for both sequences on `layer`, then the queries of `step` in hq/dq. */
void decode_inputs(struct pair *p, uint32_t layer, uint32_t step)
{
	uint16_t *k = malloc((size_t)NSEQ * HKV * D * 2), *v = malloc((size_t)NSEQ * HKV * D * 2);
	uint16_t *q = malloc((size_t)NSEQ * HQ * D * 2);
	for (uint32_t s = 0; s < NSEQ; s++) {
		make(p, s, layer, p->ctx + step, 1, (int32_t)step);
		memcpy(k + (size_t)s * HKV * D, p->hk, (size_t)HKV * D * 2);
		memcpy(v + (size_t)s * HKV * D, p->hv, (size_t)HKV * D * 2);
		memcpy(q + (size_t)s * HQ * D, p->hq, (size_t)HQ * D * 2);
	}
	memcpy(p->hk, k, (size_t)NSEQ * HKV * D * 2);
	memcpy(p->hv, v, (size_t)NSEQ * HKV * D * 2);
	memcpy(p->hq, q, (size_t)NSEQ * HQ * D * 2);
	upload(p, NSEQ);
	free(k);
	free(v);
	free(q);
}

/* kvt_attend of the decode inputs on both backends; their outputs agree within 1e-3 relative per
 * head (the worst seen in *worst). */
void append_both(struct pair *p, uint32_t layer, uint32_t step)
{
	decode_inputs(p, layer, step);
	OK(p->cpu, kvt_append(p->cpu, layer, NSEQ, p->sc, p->hk, p->hv, NULL));
	OK(p->gpu, kvt_append(p->gpu, layer, NSEQ, p->sg, p->dk, p->dv, NULL));
	if (p->lo) {
		OK(p->lo, kvt_append(p->lo, layer, NSEQ, p->sl, p->hk, p->hv, NULL));
		OK(p->hi, kvt_append(p->hi, layer, NSEQ, p->sh, p->hk, p->hv, NULL));
	}
}

static void fork_one(kvt_cache *c, uint32_t *seqs, uint32_t from, uint32_t gone)
{
	uint32_t child;
	OK(c, kvt_seq_fork(c, seqs[from], &child, NULL));
	OK(c, kvt_seq_close(c, seqs[gone]));
	seqs[gone] = child;
}

void fork_both(struct pair *p, uint32_t from, uint32_t gone)
{
	fork_one(p->cpu, p->sc, from, gone);
	fork_one(p->gpu, p->sg, from, gone);
	if (p->lo) {
		fork_one(p->lo, p->sl, from, gone);
		fork_one(p->hi, p->sh, from, gone);
	}
}

void attend_both(struct pair *p, uint32_t layer, uint32_t step, double *worst)
{
	OK(p->cpu, kvt_attend(p->cpu, layer, NSEQ, p->sc, p->hq, p->out_c, NULL));
	OK(p->gpu, kvt_attend(p->gpu, layer, NSEQ, p->sg, p->dq, p->dout, NULL));
	CU(cudaMemcpy(p->out_g, p->dout, sizeof(float) * NSEQ * HQ * D, cudaMemcpyDeviceToHost));
	for (uint32_t hd = 0; hd < NSEQ * HQ; hd++) {
		double num = 0, den = 0;
		for (uint32_t j = 0; j < D; j++) {
			double a = p->out_c[hd * D + j], b = p->out_g[hd * D + j];
			num += (a - b) * (a - b);
			den += a * a;
		}
		double rel = sqrt(num / (den > 0 ? den : 1));
		*worst = rel > *worst ? rel : *worst;
		T_CHECK(rel <= 1e-3, "step %u layer %u head %u: relative error %g", step, layer, hd,
			rel);
	}
}

double decode_both(struct pair *p, uint32_t from, uint32_t to)
{
	double worst = 0.0;
	for (uint32_t step = from; step < to; step++)
		for (uint32_t layer = 0; layer < LAYERS; layer++) {
			append_both(p, layer, step);
			attend_both(p, layer, step, &worst);
		}
	return worst;
}

/* Tokens in one of two ascending position lists and not in the other; *a_in_b: every one of a's
 * is in b. */
uint32_t pos_diff(const int32_t *a, int32_t na, const int32_t *b, int32_t nb, bool *a_in_b)
{
	uint32_t d = 0;
	int32_t i = 0, j = 0;
	*a_in_b = true;
	while (i < na || j < nb) {
		if (j == nb || (i < na && a[i] < b[j])) {
			*a_in_b = false;
			d++;
			i++;
		} else if (i == na || b[j] < a[i]) {
			d++;
			j++;
		} else {
			i++;
			j++;
		}
	}
	return d;
}

/* The positions kvt_select then kvt_gather give on a CPU cache (counts and pos [NSEQ * HKV][T]). */
void cpu_positions(kvt_cache *c, uint32_t layer, const uint32_t *seqs, const uint16_t *q,
		    const uint32_t *order, uint32_t T, int32_t *cnt, int32_t *pos)
{
	uint32_t s[NSEQ];
	for (uint32_t i = 0; i < NSEQ; i++)
		s[i] = seqs[order[i]];
	OK(c, kvt_select(c, layer, NSEQ, seqs, q, NULL));
	OK(c, kvt_gather(c, layer, NSEQ, s, T, cnt, pos, NULL, NULL, NULL));
}
