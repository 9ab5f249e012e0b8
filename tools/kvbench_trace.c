/* SPDX-License-Identifier: MIT */
/*
 * `kvbench --trace DIR`: replay a trace captured from a real model (doc/trace-format.md) through
 * kvtier and compare every decode step with exact attention over the whole context.
 *
 * Layers are independent in kvtier (each has its own rotation, centroids, index, window and hot
 * cache), so the replay runs one layer at a time, prefill then every decode step, with one
 * sequence that it closes before the next layer: only one layer of the trace is in memory, and a
 * subset of layers (--layers) gives the same figures as a full run. The cache keeps the trace's
 * layer count, so layer L always gets the rotation it gets in a runtime.
 *
 * The reference is computed in double precision from the values the library received (the trace
 * rounded to the cache's dtype), with the trace's attention scale.
 */
#include "kvtier.h"
#include "cudart.h"
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TP "kvbench: --trace: "

enum { H2D = CUDART_H2D, D2H = CUDART_D2H };

typedef struct topts {
	const char *dir, *layers;
	float p;
	uint32_t backend, dtype, sinks, window, flush, budget_min, budget_max, chunk;
	uint64_t seed;
	bool json, quiet;
} topts;


typedef struct tbuf {
	void *host, *dev;
} tbuf;

/* Sums over decode steps of one (layer, query head), and of one (layer, KV head). */
typedef struct hacc {
	double recall_sum, recall_min, err2, full2;
	uint64_t n;
} hacc;

typedef struct kacc {
	double budget_sum;
	uint64_t n;
} kacc;

typedef struct rp {
	topts o;
	trace_meta m;
	kvt_cache *cache;
	cudart cu;
	bool on_dev, tty;
	const char *backend;
	uint32_t d, group, cap, chunk, seq;
	uint32_t len, n_idx; /* the sequence of the current layer: tokens, indexed tokens */
	double scale;
	bool *sel; /* [n_layers] layers to replay */
	uint32_t n_sel;
	tbuf q, k, v, out, pos;
	int32_t *counts;      /* [n_kv_heads] */
	float *K, *V;	      /* rounded truth of the layer [n_kv_heads, cap, d] */
	float *Q;	      /* rounded decode queries of the layer [S, n_q_heads, d] */
	double *prob;	      /* [cap] */
	hacc *heads;	      /* [n_layers, n_q_heads] */
	kacc *kvs;	      /* [n_layers, n_kv_heads] */
	uint64_t done, total; /* progress: prefill chunks and decode steps */
	int last_decile;
	char err[1024];
} rp;

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static int
fail(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "kvbench: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return 1;
}

static int lib_fail(const rp *r, int64_t rc, const char *what)
{
	const char *detail = kvt_last_error(r->cache);
	return fail("%s failed: %s (%" PRId64 "): %s", what, kvt_strerror((int)rc), rc,
		    detail && *detail ? detail : "(the library gave no detail)");
}

/* ---- options -------------------------------------------------------------------------------- */

static void usage(FILE *f, const topts *o)
{
	fprintf(f,
		"usage: kvbench --trace DIR [options]\n"
		"Replays a trace (doc/trace-format.md) through kvtier; reports recall, budget and\n"
		"output error per layer and query head against exact attention.\n"
		"  --trace DIR        the trace directory (meta.json and layer*.npy)\n"
		"  --p X              Top-p mass in (0, 1] (default %g)\n"
		"  --backend B        cpu, cuda or auto (default auto)\n"
		"  --dtype T          f16 or bf16: what the cache stores (default f16)\n"
		"  --layers LIST      layers to replay, e.g. 0,3,8-11 (default all)\n"
		"  --sinks N          kvt_config.n_sink (default %u)\n"
		"  --window N         kvt_config.window (default %u)\n"
		"  --flush N          kvt_config.flush_batch (default %u)\n"
		"  --budget-min N     kvt_config.budget_min (default %u)\n"
		"  --budget-max N     kvt_config.budget_max, 0: no cap (default %u)\n"
		"  --chunk N          prefill chunk in tokens (default %u)\n"
		"  --seed N           kvt_config.seed (default %" PRIu64 ")\n"
		"  --json             one JSON object on stdout\n"
		"  --quiet            no progress, no per-head table\n"
		"  --help             this text\n",
		(double)o->p, o->sinks, o->window, o->flush, o->budget_min, o->budget_max, o->chunk,
		o->seed);
}

static int parse_u64(const char *flag, const char *val, uint64_t max, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long x = strtoull(val, &end, 10);
	if (!*val || *end || errno || val[0] == '-' || x > max) {
		fprintf(stderr, TP "%s: '%s' is not an integer in [0, %" PRIu64 "]\n", flag, val,
			max);
		return -1;
	}
	*out = x;
	return 0;
}

static int parse_u32(const char *flag, const char *val, uint32_t *out)
{
	uint64_t x;
	if (parse_u64(flag, val, UINT32_MAX, &x) < 0)
		return -1;
	*out = (uint32_t)x;
	return 0;
}

/* "0,3,8-11": syntax only here; the range is checked against the trace. */
static int parse_layers(rp *r)
{
	const char *s = r->o.layers;
	r->n_sel = 0;
	for (;;) {
		char *end;
		errno = 0;
		unsigned long a = strtoul(s, &end, 10), b = a;
		if (end == s || *s == '-' || *s == '+' || errno)
			goto bad;
		s = end;
		if (*s == '-') {
			s++;
			b = strtoul(s, &end, 10);
			if (end == s || *s == '-' || *s == '+' || errno || b < a)
				goto bad;
			s = end;
		}
		if (b >= r->m.n_layers) {
			fprintf(stderr,
				TP "--layers: layer %lu, but the trace has %u layers (0 to %u)\n",
				b, r->m.n_layers, r->m.n_layers - 1);
			return -1;
		}
		for (unsigned long l = a; l <= b; l++) {
			r->n_sel += !r->sel[l];
			r->sel[l] = true;
		}
		if (!*s)
			return 0;
		if (*s++ != ',')
			goto bad;
	}
bad:
	fprintf(stderr, TP "--layers: '%s' is not a list like 0,3,8-11\n", r->o.layers);
	return -1;
}

/* Returns 0 to run, 1 after --help, -1 on a bad option. */
static int parse_opts(int argc, char **argv, topts *o)
{
	*o = (topts){.p = KVT_DEFAULT_P,
		     .backend = KVT_BACKEND_AUTO,
		     .dtype = KVT_DTYPE_F16,
		     .sinks = KVT_DEFAULT_N_SINK,
		     .window = KVT_DEFAULT_WINDOW,
		     .flush = KVT_DEFAULT_FLUSH_BATCH,
		     .budget_min = KVT_DEFAULT_BUDGET_MIN,
		     .budget_max = 0,
		     .chunk = 4096,
		     .seed = KVT_DEFAULT_SEED};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *val = NULL, *eq = strchr(a, '=');
		char flag[32];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout, o);
			return 1;
		}
		if (!strcmp(a, "--json") || !strcmp(a, "--quiet")) {
			o->json |= a[2] == 'j';
			o->quiet |= a[2] == 'q';
			continue;
		}
		if (strncmp(a, "--", 2) || (eq && (size_t)(eq - a) >= sizeof(flag))) {
			fprintf(stderr,
				TP "unknown argument '%s' (see kvbench --trace DIR --help)\n", a);
			return -1;
		}
		size_t fl = eq ? (size_t)(eq - a) : strlen(a);
		snprintf(flag, sizeof(flag), "%.*s",
			 (int)(fl < sizeof(flag) ? fl : sizeof(flag) - 1), a);
		static const char *const known[] = {"--trace",	    "--p",	"--backend",
						    "--dtype",	    "--layers", "--sinks",
						    "--window",	    "--flush",	"--budget-min",
						    "--budget-max", "--chunk",	"--seed"};
		size_t k = 0;
		while (k < sizeof(known) / sizeof(known[0]) &&
		       (fl != strlen(known[k]) || strncmp(a, known[k], fl)))
			k++;
		if (k == sizeof(known) / sizeof(known[0])) {
			fprintf(stderr, TP "unknown option '%s' (see kvbench --trace DIR --help)\n",
				a);
			return -1;
		}
		if (eq) {
			val = eq + 1;
		} else if (i + 1 < argc) {
			val = argv[++i];
		} else {
			fprintf(stderr, TP "%s needs a value\n", flag);
			return -1;
		}
		int rc = 0;
		uint64_t x;
		switch (k) {
		case 0:
			o->dir = val;
			break;
		case 1: {
			char *end;
			o->p = strtof(val, &end);
			if (!*val || *end || !(o->p > 0.0f && o->p <= 1.0f)) {
				fprintf(stderr, TP "--p: '%s' is not a number in (0, 1]\n", val);
				rc = -1;
			}
			break;
		}
		case 2:
			o->backend = !strcmp(val, "cpu")    ? KVT_BACKEND_CPU
				     : !strcmp(val, "cuda") ? KVT_BACKEND_CUDA
				     : !strcmp(val, "auto") ? KVT_BACKEND_AUTO
							    : 99;
			if (o->backend == 99) {
				fprintf(stderr, TP "--backend: '%s', want cpu, cuda or auto\n",
					val);
				rc = -1;
			}
			break;
		case 3:
			o->dtype = !strcmp(val, "f16")	  ? KVT_DTYPE_F16
				   : !strcmp(val, "bf16") ? KVT_DTYPE_BF16
							  : 0;
			if (!o->dtype) {
				fprintf(stderr, TP "--dtype: '%s', want f16 or bf16\n", val);
				rc = -1;
			}
			break;
		case 4:
			o->layers = val;
			break;
		case 5:
			rc = parse_u32(flag, val, &o->sinks);
			break;
		case 6:
			rc = parse_u32(flag, val, &o->window);
			break;
		case 7:
			rc = parse_u32(flag, val, &o->flush);
			break;
		case 8:
			rc = parse_u32(flag, val, &o->budget_min);
			break;
		case 9:
			rc = parse_u32(flag, val, &o->budget_max);
			break;
		case 10:
			rc = parse_u32(flag, val, &o->chunk);
			if (!rc && !o->chunk) {
				fprintf(stderr, TP "--chunk: must be at least 1\n");
				rc = -1;
			}
			break;
		default:
			rc = parse_u64(flag, val, UINT64_MAX, &x);
			o->seed = x;
			break;
		}
		if (rc < 0)
			return -1;
	}
	if (!o->dir) {
		fprintf(stderr, TP "no trace directory: give --trace DIR\n");
		return -1;
	}
	return 0;
}

/* ---- device buffers ------------------------------------------------------------------------- */

static int cuda_open(rp *r)
{
	const char *why = NULL;
	if (cudart_open(&r->cu, &why))
		return fail("the cache runs on CUDA but libcudart could not be used: %s", why);
	r->on_dev = true;
	return 0;
}

static int buf_alloc(rp *r, tbuf *x, size_t bytes)
{
	x->host = calloc(1, bytes);
	x->dev = x->host;
	if (!x->host)
		return fail("out of memory for a %zu-byte buffer", bytes);
	if (r->on_dev && r->cu.malloc_(&x->dev, bytes)) {
		x->dev = NULL;
		return fail("cudaMalloc of %zu bytes failed", bytes);
	}
	return 0;
}

static void buf_free(rp *r, tbuf *x)
{
	if (r->on_dev && x->dev)
		r->cu.free_(x->dev);
	free(x->host);
	x->host = x->dev = NULL;
}

static int buf_sync(rp *r, tbuf *x, size_t bytes, int dir)
{
	if (!r->on_dev)
		return 0;
	int rc = dir == H2D ? r->cu.memcpy_(x->dev, x->host, bytes, H2D)
			    : r->cu.memcpy_(x->host, x->dev, bytes, D2H);
	return rc ? fail("cudaMemcpy %s failed (error %d)",
			 dir == H2D ? "to device" : "from device", rc)
		  : 0;
}

static int dev_sync(rp *r)
{
	if (r->cu.sync_ && r->cu.sync_())
		return fail("cudaDeviceSynchronize failed: the device reported an error");
	return 0;
}

/* ---- progress ------------------------------------------------------------------------------- */

static void progress(rp *r, uint32_t layer)
{
	if (r->o.quiet)
		return;
	r->done++;
	int pct = (int)(r->done * 100 / r->total);
	if (r->tty) {
		if (r->done == r->total)
			fprintf(stderr, "\r\033[K");
		else
			fprintf(stderr, "\rkvbench: trace layer %u %3d%% (%" PRIu64 "/%" PRIu64 ")",
				layer, pct, r->done, r->total);
		fflush(stderr);
	} else if (pct / 10 > r->last_decile) {
		r->last_decile = pct / 10;
		fprintf(stderr, "kvbench: trace %d%%\n", pct);
	}
}

/* ---- one layer ------------------------------------------------------------------------------ */

static uint16_t to_bits(const rp *r, float x)
{
	return r->o.dtype == KVT_DTYPE_BF16 ? trace_f32_to_bf16(x) : trace_f32_to_f16(x);
}

static float from_bits(const rp *r, uint16_t h)
{
	return r->o.dtype == KVT_DTYPE_BF16 ? trace_bf16_to_f32(h) : trace_f16_to_f32(h);
}

/* Round n rows of `heads` vectors into the staging buffer and (when truth is not NULL) into the
 * truth [heads, cap, d] at token t0; a value the cache's dtype cannot hold is an error. */
static int round_rows(rp *r, const float *src, uint32_t n, uint32_t heads, uint16_t *dst,
		      float *truth, uint32_t t0, uint32_t layer, unsigned arr, uint32_t row0)
{
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t h = 0; h < heads; h++)
			for (uint32_t i = 0; i < r->d; i++) {
				size_t at = ((size_t)t * heads + h) * r->d + i;
				uint16_t b = to_bits(r, src[at]);
				float f = from_bits(r, b);
				if (!isfinite(f)) {
					char nm[64];
					trace_file_name(layer, arr, nm, sizeof(nm));
					return fail("%s/%s: data: %g (%s %u, head %u, dim %u) "
						    "overflows "
						    "%s; replay with --dtype bf16",
						    r->o.dir, nm, (double)src[at],
						    arr >= 3 ? "step" : "token", row0 + t, h, i,
						    r->o.dtype == KVT_DTYPE_BF16 ? "bfloat16"
										 : "float16");
				}
				dst[at] = b;
				if (truth)
					truth[((size_t)h * r->cap + t0 + t) * r->d + i] = f;
			}
	return 0;
}

/* Positions must ascend, stay below len, and include every sink and window token. */
static int check_positions(const rp *r, const int32_t *p, int32_t cnt, uint32_t lo, uint32_t hi,
			   uint32_t layer, uint32_t kvh)
{
	uint32_t must = 0;
	if (cnt < 0 || (uint32_t)cnt > r->len)
		return fail("kvt_gather: layer %u KV head %u: count %d, length %u", layer, kvh, cnt,
			    r->len);
	for (int32_t i = 0; i < cnt; i++) {
		if (p[i] < 0 || (uint32_t)p[i] >= r->len || (i && p[i] <= p[i - 1]))
			return fail(
				"kvt_gather: layer %u KV head %u: position %d at %d of %d (length "
				"%u): out of range or not ascending",
				layer, kvh, p[i], i, cnt, r->len);
		must += (uint32_t)p[i] < lo || (uint32_t)p[i] >= hi;
	}
	if (must != r->len - (hi - lo))
		return fail("kvt_gather: layer %u KV head %u: %u of the %u sink and window tokens "
			    "(length %u, indexed [%u, %u))",
			    layer, kvh, must, r->len - (hi - lo), r->len, lo, hi);
	return 0;
}

static double dot(const float *a, const float *b, uint32_t d)
{
	double s = 0;
	for (uint32_t i = 0; i < d; i++)
		s += (double)a[i] * b[i];
	return s;
}

/* One decode step of one layer after kvt_attend + kvt_gather: exact softmax over all tokens. */
static int evaluate(rp *r, uint32_t layer, uint32_t step)
{
	const trace_meta *m = &r->m;
	uint32_t lo = r->len < r->o.sinks ? r->len : r->o.sinks, hi = lo + r->n_idx;
	const float *out = r->out.host;
	for (uint32_t h = 0; h < m->n_kv_heads; h++) {
		const int32_t *p = (const int32_t *)r->pos.host + (size_t)h * r->len;
		int32_t cnt = r->counts[h];
		const float *K = r->K + (size_t)h * r->cap * r->d,
			    *V = r->V + (size_t)h * r->cap * r->d;
		if (check_positions(r, p, cnt, lo, hi, layer, h))
			return 1;
		for (uint32_t g = 0; g < r->group; g++) {
			uint32_t qh = h * r->group + g;
			const float *q = r->Q + ((size_t)step * m->n_q_heads + qh) * r->d;
			const float *o = out + (size_t)qh * r->d;
			double mx = -INFINITY, z = 0, rec = 0, e2 = 0, f2 = 0,
			       full[TRACE_MAX_HEAD_DIM];
			for (uint32_t t = 0; t < r->len; t++) {
				r->prob[t] = r->scale * dot(q, K + (size_t)t * r->d, r->d);
				mx = r->prob[t] > mx ? r->prob[t] : mx;
			}
			for (uint32_t t = 0; t < r->len; t++)
				z += r->prob[t] = exp(r->prob[t] - mx);
			memset(full, 0, r->d * sizeof(double));
			for (uint32_t t = 0; t < r->len; t++) {
				double w = r->prob[t] /= z;
				for (uint32_t i = 0; i < r->d; i++)
					full[i] += w * V[(size_t)t * r->d + i];
			}
			for (int32_t i = 0; i < cnt; i++)
				rec += r->prob[p[i]];
			for (uint32_t i = 0; i < r->d; i++) {
				double e = o[i] - full[i];
				e2 += e * e;
				f2 += full[i] * full[i];
			}
			hacc *a = &r->heads[(size_t)layer * m->n_q_heads + qh];
			a->recall_sum += rec;
			a->recall_min = rec < a->recall_min ? rec : a->recall_min;
			a->err2 += e2;
			a->full2 += f2;
			a->n++;
		}
		if (r->n_idx) {
			uint32_t sel = 0;
			for (int32_t i = 0; i < cnt; i++)
				sel += (uint32_t)p[i] >= lo && (uint32_t)p[i] < hi;
			kacc *k = &r->kvs[(size_t)layer * m->n_kv_heads + h];
			k->budget_sum += (double)sel / r->n_idx;
			k->n++;
		}
	}
	return 0;
}

/* The library's documented indexing rule (kvtier.h): after a prefill chunk the window holds the
 * last min(W, len - sinks) tokens; an append indexes the oldest B window tokens at W + B. */
static void rule_prefill(rp *r, uint32_t n)
{
	r->len += n;
	uint32_t rest = r->len - (r->len < r->o.sinks ? r->len : r->o.sinks);
	r->n_idx = rest - (rest < r->o.window ? rest : r->o.window);
}

static void rule_append(rp *r)
{
	r->len++;
	uint32_t sinks = r->len < r->o.sinks ? r->len : r->o.sinks;
	if (r->len - sinks - r->n_idx >= r->o.window + r->o.flush)
		r->n_idx += r->o.flush;
}

static int prefill_layer(rp *r, const trace_layer *tl, uint32_t l)
{
	const trace_meta *m = &r->m;
	size_t qr = (size_t)m->n_q_heads * r->d, kr = (size_t)m->n_kv_heads * r->d;
	for (uint32_t t0 = 0; t0 < m->prefill_tokens; t0 += r->chunk) {
		uint32_t n = m->prefill_tokens - t0 < r->chunk ? m->prefill_tokens - t0 : r->chunk;
		if (round_rows(r, tl->prefill_q + t0 * qr, n, m->n_q_heads, r->q.host, NULL, t0, l,
			       0, t0) ||
		    round_rows(r, tl->prefill_k + t0 * kr, n, m->n_kv_heads, r->k.host, r->K, t0, l,
			       1, t0) ||
		    round_rows(r, tl->prefill_v + t0 * kr, n, m->n_kv_heads, r->v.host, r->V, t0, l,
			       2, t0) ||
		    buf_sync(r, &r->q, n * qr * 2, H2D) || buf_sync(r, &r->k, n * kr * 2, H2D) ||
		    buf_sync(r, &r->v, n * kr * 2, H2D))
			return 1;
		int rc = kvt_prefill(r->cache, r->seq, l, r->q.dev, r->k.dev, r->v.dev, n, NULL);
		if (rc < 0)
			return lib_fail(r, rc, "kvt_prefill");
		if (dev_sync(r))
			return 1;
		rule_prefill(r, n);
		progress(r, l);
	}
	return 0;
}

static int decode_layer(rp *r, const trace_layer *tl, uint32_t l)
{
	const trace_meta *m = &r->m;
	size_t qr = (size_t)m->n_q_heads * r->d, kr = (size_t)m->n_kv_heads * r->d;
	uint32_t T = m->prefill_tokens;
	for (uint32_t s = 0; s < m->decode_steps; s++) {
		uint16_t *qb = r->q.host;
		if (round_rows(r, tl->decode_k + s * kr, 1, m->n_kv_heads, r->k.host, r->K, T + s,
			       l, 4, s) ||
		    round_rows(r, tl->decode_v + s * kr, 1, m->n_kv_heads, r->v.host, r->V, T + s,
			       l, 5, s) ||
		    round_rows(r, tl->decode_q + s * qr, 1, m->n_q_heads, qb, NULL, 0, l, 3, s))
			return 1;
		for (size_t i = 0; i < qr; i++)
			r->Q[s * qr + i] = from_bits(r, qb[i]);
		if (buf_sync(r, &r->k, kr * 2, H2D) || buf_sync(r, &r->v, kr * 2, H2D) ||
		    buf_sync(r, &r->q, qr * 2, H2D))
			return 1;
		int rc = kvt_append(r->cache, l, 1, &r->seq, r->k.dev, r->v.dev, NULL);
		if (rc < 0)
			return lib_fail(r, rc, "kvt_append");
		rule_append(r);
		if ((rc = kvt_attend(r->cache, l, 1, &r->seq, r->q.dev, r->out.dev, NULL)) < 0)
			return lib_fail(r, rc, "kvt_attend");
		/* max_tokens = the sequence length is always enough, whatever was selected */
		rc = kvt_gather(r->cache, l, 1, &r->seq, r->len, r->counts, r->pos.dev, NULL, NULL,
				NULL);
		if (rc < 0)
			return lib_fail(r, rc, "kvt_gather");
		if (dev_sync(r) || buf_sync(r, &r->out, qr * sizeof(float), D2H) ||
		    buf_sync(r, &r->pos, (size_t)m->n_kv_heads * r->len * sizeof(int32_t), D2H) ||
		    evaluate(r, l, s))
			return 1;
		progress(r, l);
	}
	return 0;
}

static int run_layer(rp *r, uint32_t l)
{
	trace_layer tl;
	int rc = trace_load_layer(r->o.dir, &r->m, l, &tl, r->err, sizeof(r->err));
	if (rc < 0)
		return fail("trace: %s", r->err);
	if ((rc = kvt_seq_open(r->cache, &r->seq)) < 0) {
		trace_layer_free(&tl);
		return lib_fail(r, rc, "kvt_seq_open");
	}
	r->len = r->n_idx = 0;
	int st = prefill_layer(r, &tl, l);
	if (!st)
		st = decode_layer(r, &tl, l);
	if ((rc = kvt_seq_close(r->cache, r->seq)) < 0 && !st)
		st = lib_fail(r, rc, "kvt_seq_close");
	trace_layer_free(&tl);
	return st;
}

/* ---- setup ---------------------------------------------------------------------------------- */

static int create_cache(rp *r)
{
	const trace_meta *m = &r->m;
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = m->n_layers;
	cfg.n_q_heads = m->n_q_heads;
	cfg.n_kv_heads = m->n_kv_heads;
	cfg.head_dim = m->head_dim;
	cfg.dtype = r->o.dtype;
	cfg.out_dtype = KVT_DTYPE_F32;
	cfg.backend = r->o.backend;
	cfg.max_seqs = 1;
	cfg.p = r->o.p;
	cfg.scale = (float)m->scale;
	cfg.n_sink = KVT_EXACT(r->o.sinks); /* 0 given on the command line means 0 */
	cfg.window = KVT_EXACT(r->o.window);
	cfg.flush_batch = r->o.flush;
	cfg.budget_min = KVT_EXACT(r->o.budget_min);
	cfg.budget_max = r->o.budget_max;
	cfg.seed = KVT_EXACT64(r->o.seed);
	/* one layer of one sequence at a time, in whole 256-token blocks, twice, plus slack */
	uint64_t rows = ((uint64_t)r->cap + 255) / 256 * 256;
	cfg.host_bytes = 2 * rows * m->n_kv_heads * 2 * m->head_dim * 2 + (64ull << 20);
	int rc = kvt_cache_create(&cfg, &r->cache);
	if (rc < 0)
		return lib_fail(r, rc, "kvt_cache_create");
	kvt_stats st = {.size = sizeof(st)};
	if ((rc = kvt_get_stats(r->cache, &st)) < 0)
		return lib_fail(r, rc, "kvt_get_stats");
	r->backend = st.backend ? st.backend : "?";
	if (!strcmp(r->backend, "cuda") && cuda_open(r))
		return 1;
	r->scale = cfg.scale > 0 ? (double)cfg.scale : (double)(1.0f / sqrtf((float)m->head_dim));
	return 0;
}

static int setup(rp *r)
{
	const trace_meta *m = &r->m;
	r->d = m->head_dim;
	r->group = m->n_q_heads / m->n_kv_heads;
	r->cap = m->prefill_tokens + m->decode_steps;
	r->chunk = r->o.chunk < m->prefill_tokens ? r->o.chunk : m->prefill_tokens;
	r->tty = isatty(STDERR_FILENO);
	r->sel = calloc(m->n_layers, sizeof(bool));
	if (!r->sel)
		return fail("out of memory");
	if (r->o.layers) {
		if (parse_layers(r) < 0)
			return 2;
	} else {
		for (uint32_t l = 0; l < m->n_layers; l++)
			r->sel[l] = true;
		r->n_sel = m->n_layers;
	}
	size_t kv = (size_t)m->n_kv_heads * r->cap * r->d;
	r->K = malloc(kv * sizeof(float));
	r->V = malloc(kv * sizeof(float));
	r->Q = malloc((size_t)m->decode_steps * m->n_q_heads * r->d * sizeof(float));
	r->prob = malloc((size_t)r->cap * sizeof(double));
	r->counts = calloc(m->n_kv_heads, sizeof(int32_t));
	r->heads = calloc((size_t)m->n_layers * m->n_q_heads, sizeof(hacc));
	r->kvs = calloc((size_t)m->n_layers * m->n_kv_heads, sizeof(kacc));
	if (!r->K || !r->V || !r->Q || !r->prob || !r->counts || !r->heads || !r->kvs)
		return fail("out of memory for the reference of one layer (%zu floats)", 2 * kv);
	for (size_t i = 0; i < (size_t)m->n_layers * m->n_q_heads; i++)
		r->heads[i].recall_min = INFINITY;
	if (create_cache(r))
		return 1;
	size_t rows = r->chunk;
	if (buf_alloc(r, &r->q, rows * m->n_q_heads * r->d * 2) ||
	    buf_alloc(r, &r->k, rows * m->n_kv_heads * r->d * 2) ||
	    buf_alloc(r, &r->v, rows * m->n_kv_heads * r->d * 2) ||
	    buf_alloc(r, &r->out, (size_t)m->n_q_heads * r->d * sizeof(float)) ||
	    buf_alloc(r, &r->pos, (size_t)m->n_kv_heads * r->cap * sizeof(int32_t)))
		return 1;
	uint64_t chunks = (m->prefill_tokens + r->chunk - 1) / r->chunk;
	r->total = r->n_sel * (chunks + m->decode_steps);
	return 0;
}

static void teardown(rp *r)
{
	tbuf *b[] = {&r->q, &r->k, &r->v, &r->out, &r->pos};
	for (size_t i = 0; i < 5; i++)
		buf_free(r, b[i]);
	kvt_cache_destroy(r->cache);
	cudart_close(&r->cu);
	free(r->sel);
	free(r->K);
	free(r->V);
	free(r->Q);
	free(r->prob);
	free(r->counts);
	free(r->heads);
	free(r->kvs);
}

/* ---- report --------------------------------------------------------------------------------- */

typedef struct fig {
	double recall_sum, recall_min, budget_sum, err2, full2, err_max;
	uint64_t n, kv_n;
} fig;

static double rel_err(double e2, double f2)
{
	return f2 > 0 ? sqrt(e2 / f2) : sqrt(e2);
}

static void fig_head(fig *f, const hacc *a)
{
	f->recall_sum += a->recall_sum;
	f->recall_min = a->recall_min < f->recall_min ? a->recall_min : f->recall_min;
	f->err2 += a->err2;
	f->full2 += a->full2;
	f->n += a->n;
	double e = rel_err(a->err2, a->full2);
	f->err_max = e > f->err_max ? e : f->err_max;
}

/* Figures of layer l, or of every replayed layer with l = UINT32_MAX. */
static fig figures(const rp *r, uint32_t l)
{
	fig f = {.recall_min = INFINITY};
	for (uint32_t i = 0; i < r->m.n_layers; i++) {
		if (!r->sel[i] || (l != UINT32_MAX && i != l))
			continue;
		for (uint32_t h = 0; h < r->m.n_q_heads; h++)
			fig_head(&f, &r->heads[(size_t)i * r->m.n_q_heads + h]);
		for (uint32_t h = 0; h < r->m.n_kv_heads; h++) {
			f.budget_sum += r->kvs[(size_t)i * r->m.n_kv_heads + h].budget_sum;
			f.kv_n += r->kvs[(size_t)i * r->m.n_kv_heads + h].n;
		}
	}
	return f;
}

static double kv_budget(const rp *r, uint32_t l, uint32_t h)
{
	const kacc *k = &r->kvs[(size_t)l * r->m.n_kv_heads + h];
	return k->n ? k->budget_sum / k->n : 0;
}

static void print_json_fig(const fig *f)
{
	printf("\"recall_mean\": %.6f, \"recall_min\": %.6f, \"budget_mean\": %.6f, "
	       "\"output_error\": %.6g, \"output_error_max\": %.6g",
	       f->n ? f->recall_sum / f->n : 0, f->n ? f->recall_min : 0,
	       f->kv_n ? f->budget_sum / f->kv_n : 0, rel_err(f->err2, f->full2), f->err_max);
}

static void print_json(const rp *r, double wall)
{
	const trace_meta *m = &r->m;
	printf("{\"trace\": {\"dir\": ");
	const char *strs[3] = {r->o.dir, m->model, m->rope};
	for (int k = 0; k < 3; k++) {
		if (k)
			printf(", \"%s\": ", k == 1 ? "model" : "rope");
		putchar('"');
		for (const unsigned char *s = (const unsigned char *)strs[k]; *s; s++)
			if (*s == '"' || *s == '\\')
				printf("\\%c", *s);
			else if (*s < 0x20)
				printf("\\u%04x", *s);
			else
				putchar(*s);
		putchar('"');
	}
	printf(", \"n_layers\": %u, \"n_q_heads\": %u, \"n_kv_heads\": %u, \"head_dim\": %u, "
	       "\"dtype\": \"%s\", \"prefill_tokens\": %u, \"decode_steps\": %u, \"scale\": "
	       "%.9g},\n",
	       m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim,
	       m->dtype == TRACE_F16 ? "float16" : "float32", m->prefill_tokens, m->decode_steps,
	       r->scale);
	printf(" \"config\": {\"backend\": \"%s\", \"dtype\": \"%s\", \"p\": %.6g, \"sinks\": %u, "
	       "\"window\": %u, \"flush\": %u, \"budget_min\": %u, \"budget_max\": %u, \"chunk\": "
	       "%u, "
	       "\"seed\": %" PRIu64 "},\n",
	       r->backend, r->o.dtype == KVT_DTYPE_BF16 ? "bf16" : "f16", (double)r->o.p,
	       r->o.sinks, r->o.window, r->o.flush, r->o.budget_min, r->o.budget_max, r->chunk,
	       r->o.seed);
	printf(" \"layers\": [");
	bool first = true;
	for (uint32_t l = 0; l < m->n_layers; l++) {
		if (!r->sel[l])
			continue;
		fig f = figures(r, l);
		printf("%s\n  {\"layer\": %u, ", first ? "" : ",", l);
		print_json_fig(&f);
		printf(", \"heads\": [");
		for (uint32_t h = 0; h < m->n_q_heads; h++) {
			const hacc *a = &r->heads[(size_t)l * m->n_q_heads + h];
			printf("%s\n   {\"head\": %u, \"kv_head\": %u, \"recall_mean\": %.6f, "
			       "\"recall_min\": %.6f, \"budget_mean\": %.6f, \"output_error\": "
			       "%.6g}",
			       h ? "," : "", h, h / r->group, a->n ? a->recall_sum / a->n : 0,
			       a->n ? a->recall_min : 0, kv_budget(r, l, h / r->group),
			       rel_err(a->err2, a->full2));
		}
		printf("]}");
		first = false;
	}
	fig all = figures(r, UINT32_MAX);
	printf("],\n \"layers_replayed\": %u, ", r->n_sel);
	print_json_fig(&all);
	printf(", \"wall_s\": %.3f}\n", wall);
}

static void print_text(const rp *r, double wall)
{
	const trace_meta *m = &r->m;
	printf("trace %s: %s, %u layers (%u replayed), %u query heads, %u KV heads, head dim %u, "
	       "%s, %u prefill tokens, %u decode steps\n",
	       r->o.dir, m->model, m->n_layers, r->n_sel, m->n_q_heads, m->n_kv_heads, m->head_dim,
	       m->dtype == TRACE_F16 ? "float16" : "float32", m->prefill_tokens, m->decode_steps);
	printf("kvtier: %s backend, %s, p %g, sinks %u, window %u, flush %u, budget %u..%u%s, "
	       "scale %.6g\n\n",
	       r->backend, r->o.dtype == KVT_DTYPE_BF16 ? "bf16" : "f16", (double)r->o.p,
	       r->o.sinks, r->o.window, r->o.flush, r->o.budget_min, r->o.budget_max,
	       r->o.budget_max ? "" : " (no cap)", r->scale);
	printf("%6s %6s %4s  %11s %10s %11s %9s\n", "layer", "head", "kv", "recall_mean",
	       "recall_min", "budget_mean", "out_err");
	for (uint32_t l = 0; l < m->n_layers; l++) {
		if (!r->sel[l])
			continue;
		for (uint32_t h = 0; h < m->n_q_heads && !r->o.quiet; h++) {
			const hacc *a = &r->heads[(size_t)l * m->n_q_heads + h];
			printf("%6u %6u %4u  %11.4f %10.4f %11.4f %9.2e\n", l, h, h / r->group,
			       a->n ? a->recall_sum / a->n : 0, a->n ? a->recall_min : 0,
			       kv_budget(r, l, h / r->group), rel_err(a->err2, a->full2));
		}
		fig f = figures(r, l);
		printf("%6u %6s %4s  %11.4f %10.4f %11.4f %9.2e\n", l, "all", "",
		       f.recall_sum / f.n, f.recall_min, f.kv_n ? f.budget_sum / f.kv_n : 0,
		       rel_err(f.err2, f.full2));
	}
	fig all = figures(r, UINT32_MAX);
	printf("\nrecall mean %.4f, min %.4f; budget mean %.4f of the indexed tokens; output "
	       "error %.2e (worst head %.2e); %.1f s\n",
	       all.recall_sum / all.n, all.recall_min, all.kv_n ? all.budget_sum / all.kv_n : 0,
	       rel_err(all.err2, all.full2), all.err_max, wall);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int kvbench_trace_main(int argc, char **argv)
{
	rp r;
	memset(&r, 0, sizeof(r));
	int st = parse_opts(argc, argv, &r.o);
	if (st)
		return st > 0 ? 0 : 2;
	double t0 = now_s();
	if (trace_open(r.o.dir, &r.m, r.err, sizeof(r.err)) < 0)
		return fail("trace: %s", r.err);
	st = setup(&r);
	for (uint32_t l = 0; l < r.m.n_layers && !st; l++)
		if (r.sel[l])
			st = run_layer(&r, l);
	if (!st) {
		fflush(stderr);
		if (r.o.json)
			print_json(&r, now_s() - t0);
		else
			print_text(&r, now_s() - t0);
		fflush(stdout);
	}
	teardown(&r);
	return st;
}
