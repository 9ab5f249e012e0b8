/* SPDX-License-Identifier: MIT */
/*
 * What every kvbench mode shares, so that the synthetic runs (default, --capacity, --plan,
 * --sweep, --stress) and the trace replay report errors, remove what a failed run created, show
 * progress, stage tensors on the device, configure and create their cache, follow the library's
 * window rule and check what kvt_gather returned in one way.
 */
#include "kvbench.h"
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- errors and time ---------------------------------------------------------------------- */

/* A progress line on the terminal that an error message must not be appended to. */
static bool line_shown;

static void clear_line(void)
{
	if (line_shown)
		fprintf(stderr, "\r\033[K");
	line_shown = false;
}

/* What to look at for the errors a configuration causes, in kvbench's terms. */
static const char *hint_for(int64_t rc)
{
	if (rc == -ENOSPC)
		return "kvbench sets host_bytes from --host-bytes, nvme_bytes from --nvme-bytes, "
		       "nvme_cache_bytes from --nvme-cache and spill_policy from --spill";
	if (rc == -EOPNOTSUPP)
		return "a feature this build or kernel lacks: the NVMe tier needs liburing and "
		       "io_uring, --backend cuda a build with the CUDA backend";
	return NULL;
}

_Noreturn void lib_fail(const kvt_cache *c, int64_t rc, const char *what)
{
	const char *detail = kvt_last_error(c), *hint = hint_for(rc);
	clear_line();
	fprintf(stderr, "kvbench: %s failed: %s (%" PRId64 "): %s\n", what, kvt_strerror((int)rc), rc,
		detail && *detail ? detail : "(the library gave no detail)");
	if (hint)
		fprintf(stderr, "kvbench: hint: %s\n", hint);
	exit(1);
}

_Noreturn void fail(const char *what, const char *detail)
{
	clear_line();
	fprintf(stderr, "kvbench: %s: %s\n", what, detail);
	exit(1);
}

void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (!p) {
		clear_line();
		fprintf(stderr, "kvbench: out of memory (%zu x %zu bytes)\n", n, size);
		exit(1);
	}
	return p;
}

/* ---- files a failed run removes ------------------------------------------------------------ */

static char *created_paths[8];
static uint32_t n_created;

void created_files_end(bool keep)
{
	for (uint32_t i = 0; i < n_created; i++) {
		if (!keep)
			unlink(created_paths[i]);
		free(created_paths[i]);
	}
	n_created = 0;
}

/* At exit: every failure ends in exit(1) (or 2) somewhere, and none of them keeps the files. */
static void remove_created(void)
{
	created_files_end(false);
}

void created_file(const char *path)
{
	static bool at_exit;
	if (!at_exit && atexit(remove_created) != 0)
		fail("cannot register the removal of files at exit", path);
	at_exit = true;
	if (n_created == sizeof(created_paths) / sizeof(created_paths[0]) ||
	    !(created_paths[n_created] = strdup(path)))
		fail("too many files to remove at exit, or out of memory", path);
	n_created++;
}

int kb_cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

void low_percentiles(double *v, size_t n, double pct[2])
{
	const double q[2] = {0.05, 0.01};
	if (n)
		qsort(v, n, sizeof(double), kb_cmp_double);
	for (int i = 0; i < 2; i++) {
		double r = ceil(q[i] * (double)n);
		pct[i] = n ? v[r < 1 ? 0 : (size_t)r - 1] : NAN;
	}
}

uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- progress ------------------------------------------------------------------------------ */

void progress(kb_progress *pg, const char *what, uint64_t done, uint64_t total)
{
	if (pg->hook && pg->hook(pg->hook_ctx, what, done, total))
		return;
	if (pg->quiet)
		return;
	int pct = (int)(done * 100 / total);
	if (pg->tty) {
		/* the line goes away when the phase ends: the table and summary follow on stdout */
		if (done == total) {
			clear_line();
		} else {
			fprintf(stderr, "\r\033[Kkvbench: %s %3d%% (%" PRIu64 "/%" PRIu64 ")", what,
				pct, done, total);
			line_shown = true;
		}
		fflush(stderr);
	} else if (pct / 10 > pg->last_decile) {
		/* whole lines only: a pipe or a log never gets a partial one */
		pg->last_decile = done == total ? 0 : pct / 10;
		fprintf(stderr, "kvbench: %s %d%%\n", what, pct);
	}
}

void progress_clear(const kb_progress *pg)
{
	if (pg->tty) {
		fprintf(stderr, "\r\033[K");
		line_shown = false;
	}
}

/* ---- device buffers ------------------------------------------------------------------------ */

void dev_sync(kb_dev *dv)
{
	if (dv->cu.sync_ && dv->cu.sync_())
		fail("cudaDeviceSynchronize failed", "the device reported an error");
}

void buf_alloc(kb_dev *dv, buf *x, size_t bytes)
{
	x->host = xcalloc(1, bytes);
	x->dev = x->host;
	if (dv->on_dev && dv->cu.malloc_(&x->dev, bytes))
		fail("cudaMalloc failed", "staging buffer");
}

void buf_free(kb_dev *dv, buf *x)
{
	if (dv->on_dev && x->dev)
		dv->cu.free_(x->dev);
	free(x->host);
	x->host = x->dev = NULL;
}

void buf_sync(kb_dev *dv, buf *x, size_t bytes, int dir)
{
	if (!dv->on_dev)
		return;
	int rc = dir == KB_H2D ? dv->cu.memcpy_(x->dev, x->host, bytes, KB_H2D)
			       : dv->cu.memcpy_(x->host, x->dev, bytes, KB_D2H);
	if (rc)
		fail("cudaMemcpy failed", dir == KB_H2D ? "to device" : "from device");
}

uint16_t dtype_bits(uint32_t dtype, float x)
{
	return dtype == KVT_DTYPE_BF16 ? wl_f32_to_bf16(x) : wl_f32_to_f16(x);
}

float dtype_float(uint32_t dtype, uint16_t h)
{
	return dtype == KVT_DTYPE_BF16 ? wl_bf16_to_f32(h) : wl_f16_to_f32(h);
}

/* ---- the cache ----------------------------------------------------------------------------- */

void cache_config(const opts *o, const kb_shape *sh, uint64_t host_bytes,
		  const uint64_t *nvme_sizes, kvt_config *cfg)
{
	const kvt_config init = KVT_CONFIG_INIT;
	*cfg = init;
	cfg->n_layers = sh->layers;
	cfg->n_q_heads = sh->q_heads;
	cfg->n_kv_heads = sh->kv_heads;
	cfg->head_dim = sh->head_dim;
	cfg->max_seqs = sh->max_seqs;
	cfg->dtype = o->dtype;
	cfg->out_dtype = KVT_DTYPE_F32;
	cfg->backend = o->backend;
	cfg->p = o->p;
	/* a 0 given on the command line means 0, not the library's default */
	cfg->n_sink = KVT_EXACT(o->sinks);
	cfg->window = KVT_EXACT(o->window);
	cfg->flush_batch = o->flush;
	cfg->budget_min = KVT_EXACT(o->budget_min);
	cfg->budget_max = o->budget_max;
	cfg->correction_steps = o->correction;
	cfg->rescore_p = o->rescore;
	cfg->keep_weight = o->keep;
	cfg->keep_steps = o->keep != 0.0f ? o->keep_steps : 0;
	cfg->seed = KVT_EXACT64(o->seed);
	cfg->gpu_cache_bytes = o->gpu_cache == KB_GPU_CACHE_AUTO ? 0 : KVT_EXACT64(o->gpu_cache);
	cfg->host_bytes = host_bytes;
	if (!o->n_nvme)
		return;
	cfg->nvme_paths = o->nvme_paths;
	cfg->nvme_bytes = nvme_sizes;
	cfg->n_nvme = o->n_nvme;
	cfg->nvme_queue_depth = o->nvme_qd;
	cfg->nvme_cache_bytes = o->nvme_cache;
	cfg->spill_policy = o->spill;
	/* files given with --nvme stay where the user put them (the preset's is removed by
	 * tier_created) */
	cfg->nvme_flags = o->nvme_own ? 0 : KVT_NVME_KEEP_FILES;
}

uint64_t nvme_bytes_ample(uint64_t kv_bytes, uint32_t n_files)
{
	uint64_t all = kv_bytes / 4 * 5 + (16ull << 20);
	uint64_t per = (all + n_files - 1) / n_files;
	return (per + (1ull << 20) - 1) >> 20 << 20;
}

uint64_t host_bytes_ample(uint64_t cap, uint64_t pairs, uint32_t kv_heads, uint32_t head_dim)
{
	uint64_t rows = (cap + KB_BLOCK_TOKENS - 1) / KB_BLOCK_TOKENS * KB_BLOCK_TOKENS;
	return 2 * rows * pairs * kv_heads * 2 * head_dim * 2 + (64ull << 20);
}

const char *cache_open(const kvt_config *cfg, kvt_cache **cache, kb_dev *dv,
		       void (*created)(const void *ctx), const void *ctx)
{
	int rc = kvt_cache_create(cfg, cache);
	if (created)
		created(ctx);
	if (rc < 0)
		lib_fail(NULL, rc, "kvt_cache_create");
	kvt_stats st = {.size = sizeof(st)};
	if ((rc = kvt_get_stats(*cache, &st)) < 0)
		lib_fail(*cache, rc, "kvt_get_stats");
	if (st.backend && !strcmp(st.backend, "cuda")) {
		const char *why = NULL;
		if (cudart_open(&dv->cu, &why))
			fail("the cache runs on CUDA but libcudart could not be used", why);
		dv->on_dev = true;
	}
	return st.backend ? st.backend : "?";
}

/* ---- the window rule and the gathered positions -------------------------------------------- */

uint32_t rule_sinks(const opts *o, uint32_t len)
{
	return len < o->sinks ? len : o->sinks;
}

void rule_prefill(const opts *o, uint32_t *len, uint32_t *n_idx, uint32_t n)
{
	*len += n;
	uint32_t rest = *len - rule_sinks(o, *len);
	*n_idx = rest - (rest < o->window ? rest : o->window);
}

void rule_append(const opts *o, uint32_t *len, uint32_t *n_idx)
{
	uint32_t l = ++*len;
	if (l - rule_sinks(o, l) - *n_idx >= o->window + o->flush)
		*n_idx += o->flush;
}

uint32_t check_positions(const int32_t *p, int32_t cnt, uint32_t len, uint32_t lo, uint32_t hi,
			 const char *where)
{
	char d[256];
	uint32_t must = 0, sel = 0;
	if (cnt < 0 || (uint32_t)cnt > len) {
		snprintf(d, sizeof d, "%s: count %d, but the sequence holds %u tokens", where, cnt,
			 len);
		fail("kvt_gather", d);
	}
	for (int32_t i = 0; i < cnt; i++) {
		if (p[i] < 0 || (uint32_t)p[i] >= len || (i && p[i] <= p[i - 1])) {
			snprintf(d, sizeof d, "%s: position %d at %d of %d (length %u): out of range "
				 "or not ascending", where, p[i], i, cnt, len);
			fail("kvt_gather", d);
		}
		bool indexed = (uint32_t)p[i] >= lo && (uint32_t)p[i] < hi;
		must += !indexed;
		sel += indexed;
	}
	if (must != len - (hi - lo)) {
		snprintf(d, sizeof d, "%s: %u of the %u sink and window tokens (length %u, indexed "
			 "range [%u, %u))", where, must, len - (hi - lo), len, lo, hi);
		fail("kvt_gather", d);
	}
	return sel;
}

/* ---- JSON ---------------------------------------------------------------------------------- */

/* A JSON string of s: quotes, backslashes and control characters escaped, and every byte that is
 * not part of valid UTF-8 (a path or a trace's model name may hold any bytes) written as U+FFFD,
 * so the output is always valid JSON. */
void jstr(const char *s)
{
	putchar('"');
	for (size_t n = strlen(s); n;) {
		unsigned char c = (unsigned char)*s;
		int len = trace_utf8_len((const unsigned char *)s, n, NULL);
		if (c == '"' || c == '\\')
			printf("\\%c", c);
		else if (c < 0x20)
			printf("\\u%04x", c);
		else if (len)
			fwrite(s, 1, (size_t)len, stdout);
		else
			fputs("\\ufffd", stdout);
		len = len ? len : 1;
		s += len;
		n -= (size_t)len;
	}
	putchar('"');
}
