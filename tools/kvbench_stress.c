/* SPDX-License-Identifier: MIT */
/*
 * --stress SECONDS: the fetch path under load, every fetched row verified. Each mode runs for the
 * given time on a cache of its own, prefilled like the standard run; a step is, on every layer,
 * kvt_select with fresh queries of every sequence in one batch and kvt_gather of the selected rows
 * (positions, K and V), each row compared bit for bit with what kvbench gave the library
 * (kvbench_verify.c). A mismatch or a library error fails the run (exit 1) naming the row or call.
 *   many         every sequence at once (--seqs, 16 when 1 is given), the workload's queries
 *   adversarial  random queries, so nothing is reused from one step to the next, and selections at
 *                their largest: p = 1 with budget_min = budget_max = --stress-budget
 *   qd           every sequence spilled to NVMe, served directly, at queue depths 1, 4, 16, 64, 256,
 *                through a 4 MiB block cache (unless --nvme-cache is given) so the files are read
 *   spill        decode (append, select, gather) mixed with kvt_seq_spill and kvt_seq_restore
 * The report gives, per mode, sustained figures (rows and bytes per second inside the library,
 * over the whole time) and the step latency's median and p99.
 */
#include "kvbench.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct sres {
	char name[32];
	uint64_t steps, rows, bytes, ns_lib, ns_wall;
	double p50_ms, p99_ms;
	uint64_t pcie, nvme_read, spills, restores;
} sres;

typedef struct sctx {
	kb_run *b;
	uint32_t *spilled_upto; /* [seqs * layers] tokens below which rows are on NVMe */
	uint16_t *row;          /* [d] scratch */
} sctx;

static void truth_bits(void *ctx, uint32_t s, uint32_t l, uint32_t h, uint32_t pos, uint16_t *k,
		       uint16_t *v)
{
	const kb_run *b = ((sctx *)ctx)->b;
	const float *K = truth(b, b->K, s, l, h) + (size_t)pos * b->d;
	const float *V = truth(b, b->V, s, l, h) + (size_t)pos * b->d;
	for (uint32_t i = 0; i < b->d; i++) {
		k[i] = to_bits(b, K[i]);
		v[i] = to_bits(b, V[i]);
	}
}

static const char *tier_of(void *ctx, uint32_t s, uint32_t l, uint32_t h, uint32_t pos)
{
	const sctx *c = ctx;
	const kb_run *b = c->b;
	size_t sl = (size_t)s * b->o.layers + l;
	(void)h;
	if (pos < c->spilled_upto[sl])
		return "nvme";
	if (b->dev.on_dev)
		return pos >= rule_sinks(&b->o, b->len[sl]) + b->n_idx[sl] ? "device window"
								     : "host or hot cache";
	return "host";
}

static int cmp_u64(const void *x, const void *y)
{
	uint64_t a = *(const uint64_t *)x, c = *(const uint64_t *)y;
	return (a > c) - (a < c);
}

/* Queries of every sequence for one step: the workload's decode queries at the sequence's next
 * position, or (random) Gaussian ones of norm about 3 sqrt(D), new every step. */
static void make_queries(kb_run *b, uint32_t l, uint32_t step, bool random, uint64_t *rs)
{
	const uint32_t d = b->d, QH = b->o.q_heads, G = b->group;
	uint16_t *qb = b->q.host;
	for (uint32_t s = 0; s < b->o.seqs; s++)
		for (uint32_t h = 0; h < b->o.kv_heads; h++) {
			if (random) {
				for (uint32_t i = 0; i < G * d; i++) {
					*rs ^= *rs << 13;
					*rs ^= *rs >> 7;
					*rs ^= *rs << 17;
					double u = ((*rs >> 11) + 0.5) * 0x1p-53;
					b->qtmp[i] = (float)(6.0 * (u - 0.5) * 1.7320508);
				}
			} else {
				uint32_t pos = b->len[(size_t)s * b->o.layers + l];
				wl_token(b->w, s, l, h, pos, (int32_t)(step % b->o.steps), NULL, NULL,
					 b->qtmp, NULL);
			}
			for (uint32_t g = 0; g < G; g++)
				for (uint32_t i = 0; i < d; i++)
					qb[((size_t)s * QH + h * G + g) * d + i] =
						to_bits(b, b->qtmp[(size_t)g * d + i]);
		}
	buf_sync(&b->dev, &b->q, (size_t)b->o.seqs * QH * d * 2, KB_H2D);
}

/* One appended token per sequence on layer l, kept in the truth (spill mode). */
static void append_tokens(kb_run *b, uint32_t l, uint32_t step)
{
	const uint32_t d = b->d, KV = b->o.kv_heads;
	uint16_t *kb = b->k.host, *vb = b->v.host;
	for (uint32_t s = 0; s < b->o.seqs; s++) {
		size_t sl = (size_t)s * b->o.layers + l;
		uint32_t pos = b->len[sl];
		for (uint32_t h = 0; h < KV; h++) {
			float *kt = truth(b, b->K, s, l, h) + (size_t)pos * d;
			float *vt = truth(b, b->V, s, l, h) + (size_t)pos * d;
			wl_token(b->w, s, l, h, pos, (int32_t)(step % b->o.steps), kt, vt, b->qtmp,
				 NULL);
			for (uint32_t i = 0; i < d; i++) {
				uint16_t *kk = kb + ((size_t)s * KV + h) * d, *vv = vb + ((size_t)s * KV + h) * d;
				kk[i] = to_bits(b, kt[i]);
				kt[i] = from_bits(b, kk[i]);
				vv[i] = to_bits(b, vt[i]);
				vt[i] = from_bits(b, vv[i]);
			}
		}
	}
	buf_sync(&b->dev, &b->k, (size_t)b->o.seqs * KV * d * 2, KB_H2D);
	buf_sync(&b->dev, &b->v, (size_t)b->o.seqs * KV * d * 2, KB_H2D);
	int rc = kvt_append(b->cache, l, b->o.seqs, b->ids, b->k.dev, b->v.dev, NULL);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_append");
	for (uint32_t s = 0; s < b->o.seqs; s++)
		run_rule_append(b, (size_t)s * b->o.layers + l);
}

/* Spill (or, when spilled, restore) sequence s, recording which rows now live on NVMe. */
static void spill_or_restore(kb_run *b, sctx *c, uint32_t s, bool *spilled)
{
	int64_t rc;
	if (!spilled[s]) {
		rc = kvt_seq_spill(b->cache, b->ids[s]);
		if (rc < 0)
			lib_fail(b->cache, rc, "kvt_seq_spill");
		for (uint32_t l = 0; l < b->o.layers; l++) {
			size_t sl = (size_t)s * b->o.layers + l;
			uint32_t done = rule_sinks(&b->o, b->len[sl]) + b->n_idx[sl];
			c->spilled_upto[sl] = done / KB_BLOCK_TOKENS * KB_BLOCK_TOKENS;
		}
	} else {
		rc = kvt_seq_restore(b->cache, b->ids[s]);
		if (rc < 0)
			lib_fail(b->cache, rc, "kvt_seq_restore");
		for (uint32_t l = 0; l < b->o.layers; l++)
			c->spilled_upto[(size_t)s * b->o.layers + l] = 0;
	}
	spilled[s] = !spilled[s];
}

static void snapshot(kb_run *b, kvt_stats *st)
{
	st->size = sizeof(*st);
	int rc = kvt_get_stats(b->cache, st);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
}

/* One mode (qd: one queue depth) for `seconds`. */
static void run_mode(const opts *o, const char *mode, uint32_t qd, double seconds, sres *r)
{
	bool adv = !strcmp(mode, "adversarial"), nv = !strcmp(mode, "qd"),
	     mix = !strcmp(mode, "spill");
	kb_run *b = xcalloc(1, sizeof(*b));
	b->o = *o;
	b->o.point = true;
	b->o.quiet = true;
	b->o.baselines = false;
	b->o.steps = 256; /* appends the spill mode may make; then it only selects */
	if (!strcmp(mode, "many") && b->o.seqs == 1)
		b->o.seqs = 16;
	if (adv) {
		b->o.p = 1.0f;
		b->o.rescore = 0.0f; /* nothing to rescore at p = 1 (and refused there) */
		b->o.budget_min = b->o.budget_max = o->stress_budget;
	}
	if ((nv || mix) && !b->o.n_nvme) {
		b->o.nvme_paths[0] = KB_NVME_DEFAULT;
		b->o.n_nvme = 1;
		b->o.nvme_own = true;
	}
	if (nv) {
		b->o.nvme_qd = qd;
		/* a block cache smaller than the spilled rows, so each step reads from the files
		 * (with the default 64 MiB every depth soon read the same bytes from the cache) */
		if (o->nvme_cache == KVT_DEFAULT_NVME_CACHE_BYTES)
			b->o.nvme_cache = 4ull << 20;
	}
	setup(b);
	prefill_all(b);
	const uint32_t S = b->o.seqs, KV = b->o.kv_heads, d = b->d;
	buf kout, vout;
	size_t rows_max = (size_t)S * KV * b->cap;
	buf_alloc(&b->dev, &kout, rows_max * d * 2);
	buf_alloc(&b->dev, &vout, rows_max * d * 2);
	sctx c = {.b = b, .spilled_upto = xcalloc((size_t)S * b->o.layers, sizeof(uint32_t))};
	kb_verifier v = {.kv_heads = KV, .d = d, .truth = truth_bits, .tier = tier_of, .ctx = &c,
			 .scratch = xcalloc(2 * d, sizeof(uint16_t))};
	bool *spilled = xcalloc(S, sizeof(bool));
	uint32_t *sidx = xcalloc(S, sizeof(uint32_t)), *lens = xcalloc(S, sizeof(uint32_t));
	for (uint32_t s = 0; s < S; s++)
		sidx[s] = s;
	if (nv)
		for (uint32_t s = 0; s < S; s++)
			spill_or_restore(b, &c, s, spilled);
	size_t lat_cap = 1024;
	uint64_t *lat = xcalloc(lat_cap, sizeof(uint64_t)), rs = 0x9e3779b97f4a7c15ull ^ o->seed;
	kvt_stats st0, st1;
	snapshot(b, &st0);
	*r = (sres){0};
	snprintf(r->name, sizeof r->name, nv ? "%s=%u" : "%s", mode, qd);
	uint64_t t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9);
	for (uint32_t step = 0; now_ns() < end; step++) {
		uint64_t ns = 0;
		if (mix && step % 4 == 3)
			spill_or_restore(b, &c, (step / 4) % S, spilled);
		for (uint32_t l = 0; l < b->o.layers; l++) {
			if (mix && b->len[l] < b->cap)
				append_tokens(b, l, step);
			make_queries(b, l, step, adv, &rs);
			uint64_t t = now_ns();
			int rc = kvt_select(b->cache, l, S, b->ids, b->q.dev, NULL);
			if (rc < 0)
				lib_fail(b->cache, rc, "kvt_select");
			uint32_t m = (uint32_t)rc;
			int64_t n = kvt_gather(b->cache, l, S, b->ids, m, b->counts, b->pos.dev,
					       kout.dev, vout.dev, NULL);
			if (n < 0)
				lib_fail(b->cache, n, "kvt_gather");
			dev_sync(&b->dev);
			ns += now_ns() - t;
			buf_sync(&b->dev, &b->pos, (size_t)S * KV * m * sizeof(int32_t), KB_D2H);
			buf_sync(&b->dev, &kout, (size_t)S * KV * m * d * 2, KB_D2H);
			buf_sync(&b->dev, &vout, (size_t)S * KV * m * d * 2, KB_D2H);
			for (uint32_t s = 0; s < S; s++)
				lens[s] = b->len[(size_t)s * b->o.layers + l];
			kb_mismatch bad;
			int64_t ok = kb_verify_gather(&v, l, S, sidx, lens, m, b->counts, b->pos.host,
						      kout.host, vout.host, &bad);
			if (ok < 0) {
				char msg[256];
				kb_mismatch_text(&bad, msg, sizeof msg);
				fprintf(stderr, "kvbench: stress %s, step %u: a fetched row differs from "
					"the row given to the library: %s\n", r->name, step, msg);
				exit(1);
			}
			if (ok != n) {
				fprintf(stderr, "kvbench: stress %s: kvt_gather reported %" PRId64
					" rows, its counts hold %" PRId64 "\n", r->name, n, ok);
				exit(1);
			}
			r->rows += (uint64_t)ok;
		}
		if (r->steps == lat_cap) {
			lat = realloc(lat, 2 * lat_cap * sizeof(uint64_t));
			if (!lat)
				fail("out of memory", "stress latencies");
			lat_cap *= 2;
		}
		lat[r->steps++] = ns;
		r->ns_lib += ns;
	}
	r->ns_wall = now_ns() - t0;
	snapshot(b, &st1);
	r->bytes = r->rows * 4ull * d;
	qsort(lat, r->steps, sizeof(uint64_t), cmp_u64);
	r->p50_ms = r->steps ? lat[r->steps / 2] / 1e6 : NAN;
	r->p99_ms = r->steps ? lat[(size_t)ceil(0.99 * r->steps) - 1] / 1e6 : NAN;
	r->pcie = st1.pcie_bytes - st0.pcie_bytes;
	r->nvme_read = st1.nvme_bytes_read - st0.nvme_bytes_read;
	r->spills = st1.spills - st0.spills;
	r->restores = st1.restores - st0.restores;
	buf_free(&b->dev, &kout);
	buf_free(&b->dev, &vout);
	void *p[] = {c.spilled_upto, v.scratch, spilled, sidx, lens, lat};
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
	teardown(b);
	free(b);
}

/* Whether this build and kernel have an NVMe tier: a throwaway cache on a small file; if not, why
 * (into why[n]). */
static bool nvme_available(char *why, size_t n)
{
	static const char path[] = "kvbench-probe.img";
	if (access(path, F_OK) == 0) {
		snprintf(why, n, "%s, the file kvbench probes for an NVMe tier with, exists in the "
			 "current directory and kvbench does not overwrite it: remove it or give "
			 "--nvme", path);
		return false;
	}
	const char *paths[1] = {path};
	uint64_t bytes[1] = {16ull << 20};
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = cfg.n_q_heads = cfg.n_kv_heads = 1;
	cfg.head_dim = 64;
	cfg.backend = KVT_BACKEND_CPU;
	cfg.host_bytes = 1ull << 20;
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = bytes;
	cfg.n_nvme = 1;
	cfg.nvme_cache_bytes = 1ull << 20;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	unlink(path);
	kvt_cache_destroy(c);
	if (rc < 0)
		snprintf(why, n, "no NVMe tier here (%s: %s)", kvt_strerror(rc),
			 kvt_last_error(NULL));
	return rc == 0;
}

static void print_res(const sres *r)
{
	double s = (double)r->ns_lib / 1e9;
	printf("%-16s %7" PRIu64 " %11" PRIu64 " %11.0f %9.1f %8.3f %8.3f %9.1f %9.1f %6" PRIu64
	       "/%-6" PRIu64 "\n", r->name, r->steps, r->rows, s > 0 ? r->rows / s : 0.0,
	       s > 0 ? r->bytes / s / 1048576.0 : 0.0, r->p50_ms, r->p99_ms, r->pcie / 1048576.0,
	       r->nvme_read / 1048576.0, r->spills, r->restores);
}

int stress_main(opts *o)
{
	static const char *const all[] = {"many", "adversarial", "qd", "spill"};
	static const uint32_t qds[] = {1, 4, 16, 64, 256};
	bool want[4] = {false};
	char *list = strdup(o->stress_modes);
	if (!list)
		fail("out of memory", "--stress-mode");
	for (char *p = strtok(list, ","); p; p = strtok(NULL, ",")) {
		bool known = !strcmp(p, "all");
		for (int i = 0; i < 4; i++) {
			want[i] |= known && !strcmp(p, "all");
			if (!strcmp(p, all[i]))
				want[i] = known = true;
		}
		if (!known) {
			fprintf(stderr, "kvbench: --stress-mode: invalid value '%s' (expected many, "
				"adversarial, qd, spill or all)\n", p);
			exit(2);
		}
	}
	free(list);
	/* the modes that need an NVMe tier, skipped where there is none: said on stderr (stdout may
	 * be JSON), and in the JSON */
	char why[512] = "";
	bool skipped[4] = {false};
	if ((want[2] || want[3]) && !o->n_nvme && !nvme_available(why, sizeof why)) {
		const bool both = want[2] && want[3];
		fprintf(stderr, "kvbench: stress: mode%s %s skipped: %s\n", both ? "s" : "",
			both ? "qd and spill" : want[2] ? "qd" : "spill", why);
		skipped[2] = want[2];
		skipped[3] = want[3];
		want[2] = want[3] = false;
	}
	if (!o->json)
		printf("kvbench stress: %u s per mode; %u layers, context %u, %u query heads, %u KV "
		       "heads, head_dim %u; every fetched row verified\n", o->stress_s, o->layers,
		       o->context, o->q_heads, o->kv_heads, o->head_dim);
	sres res[8];
	uint32_t n = 0;
	if (!o->json)
		printf("mode               steps        rows      rows/s     MiB/s  p50 ms   p99 ms"
		       "  PCIe MiB  NVMe MiB spills/restores\n");
	for (int m = 0; m < 4; m++) {
		if (!want[m])
			continue;
		uint32_t k = m == 2 ? 5 : 1;
		for (uint32_t j = 0; j < k; j++) {
			if (!o->quiet)
				fprintf(stderr, "kvbench: stress %s%s...\n", all[m], m == 2 ? " (sweep)" : "");
			run_mode(o, all[m], qds[j], m == 2 ? o->stress_s / 5.0 : o->stress_s, &res[n]);
			if (!o->json) {
				print_res(&res[n]);
				fflush(stdout);
			}
			n++;
		}
	}
	if (o->json) {
		printf("{\"stress\": [");
		for (uint32_t i = 0; i < n; i++) {
			const sres *r = &res[i];
			double s = (double)r->ns_lib / 1e9;
			printf("%s{\"mode\": \"%s\", \"steps\": %" PRIu64 ", \"rows_verified\": %" PRIu64
			       ", \"rows_per_s\": %.6g, \"bytes_per_s\": %.6g, \"step_ms_p50\": %.6g, "
			       "\"step_ms_p99\": %.6g, \"wall_s\": %.6g, \"library_s\": %.6g, "
			       "\"pcie_bytes\": %" PRIu64 ", \"nvme_bytes_read\": %" PRIu64
			       ", \"spills\": %" PRIu64 ", \"restores\": %" PRIu64 "}",
			       i ? ", " : "", r->name, r->steps, r->rows, s > 0 ? r->rows / s : 0,
			       s > 0 ? r->bytes / s : 0, r->p50_ms, r->p99_ms, r->ns_wall / 1e9, s,
			       r->pcie, r->nvme_read, r->spills, r->restores);
		}
		printf("], \"mismatches\": 0");
		for (int k = 0; k < 2; k++) {
			printf(k ? ", \"modes_skipped\": [" : ", \"modes_run\": [");
			for (int m = 0, c = 0; m < 4; m++)
				if (k ? skipped[m] : want[m])
					printf("%s\"%s\"", c++ ? ", " : "", all[m]);
			printf("]");
		}
		printf(", \"skipped_because\": ");
		if (why[0])
			jstr(why);
		else
			printf("null");
		printf("}\n");
	} else {
		printf("all rows verified: no mismatch, no error\n");
	}
	opts_free(o);
	return 0;
}
