/* SPDX-License-Identifier: MIT */
/*
 * Every public function with each bad argument, table-driven: the documented code, a detail text
 * that names the offending field and value, and no observable change (stats, sequence lengths,
 * allocations); the error counter counts each failure once. Also kvt_strerror, the version and
 * kvt_cache_destroy(NULL).
 */
#include <ctype.h>

#include "common.h"

#define D 64
#define NKV 2
#define NQ 4
#define LAYERS 2
#define BUF_TOKENS 300

/* Case-insensitive: does `text` contain one of the '|'-separated alternatives of `needle`? */
static int contains_any(const char *text, const char *needle)
{
	char alt[64];
	while (*needle) {
		size_t n = strcspn(needle, "|");
		snprintf(alt, sizeof alt, "%.*s", (int)n, needle);
		for (const char *t = text; *t; t++) {
			size_t i = 0;
			while (alt[i] && t[i] && tolower((unsigned char)t[i]) == tolower((unsigned char)alt[i]))
				i++;
			if (!alt[i])
				return 1;
		}
		needle += n + (needle[n] == '|');
	}
	return 0;
}

/* ---- cache creation -------------------------------------------------------------------- */

struct create_case {
	const char *name;
	int want;
	const char *needle[3];
	void (*edit)(kvt_config *cfg);
	int null_cfg, null_out;
};

#define EDIT(fn, stmt)                                                                             \
	static void fn(kvt_config *cfg)                                                            \
	{                                                                                          \
		stmt;                                                                              \
	}
EDIT(e_none, (void)cfg)
EDIT(e_size0, cfg->size = 0)
EDIT(e_size_small, cfg->size = KVT_CONFIG_SIZE_VER0 - 8)
EDIT(e_pad3, cfg->pad3 = 1)
EDIT(e_resc_low, (cfg->p = 0.9f, cfg->rescore_p = 0.5f))
EDIT(e_resc_high, cfg->rescore_p = 1.5f)
EDIT(e_hotmax, cfg->gpu_cache_max_bytes = (2ull << 40))
EDIT(e_hotboth, (cfg->gpu_cache_bytes = 1ull << 30, cfg->gpu_cache_max_bytes = 1ull << 31))
EDIT(e_hotbig, cfg->gpu_cache_bytes = (1ull << 40) + 1)
EDIT(e_pad2, cfg->pad2 = 3)
EDIT(e_corr65, cfg->correction_steps = 65)
EDIT(e_layers0, cfg->n_layers = 0)
EDIT(e_q0, cfg->n_q_heads = 0)
EDIT(e_kv0, cfg->n_kv_heads = 0)
EDIT(e_gqa, (cfg->n_q_heads = 6, cfg->n_kv_heads = 4))
EDIT(e_hd0, cfg->head_dim = 0)
EDIT(e_hd32, cfg->head_dim = 32)
EDIT(e_hd96, cfg->head_dim = 96)
EDIT(e_hd100, cfg->head_dim = 100)
EDIT(e_hd512, cfg->head_dim = 512)
EDIT(e_dt32, cfg->dtype = KVT_DTYPE_F32)
EDIT(e_dt9, cfg->dtype = 9)
EDIT(e_odt7, cfg->out_dtype = 7)
EDIT(e_be3, cfg->backend = 3)
EDIT(e_seqs_big, cfg->max_seqs = 65537)
EDIT(e_pneg, cfg->p = -0.1f)
EDIT(e_pbig, cfg->p = 1.5f)
EDIT(e_pnan, cfg->p = NAN)
EDIT(e_scnan, cfg->scale = NAN)
EDIT(e_scinf, cfg->scale = INFINITY)
EDIT(e_fb_big, cfg->flush_batch = 65537)
EDIT(e_budget, (cfg->budget_min = 10, cfg->budget_max = 5))
#if !KVT_HAVE_CUDA_BACKEND
EDIT(e_cuda, cfg->backend = KVT_BACKEND_CUDA)
#endif

static kvt_config base_config(void)
{
	kvt_config cfg = t_config(LAYERS, NQ, NKV, D, KVT_DTYPE_F16);
	cfg.max_seqs = 3;
	cfg.p = 1.0f;
	return cfg;
}

static void test_create_errors(void **state)
{
	(void)state;
	const struct create_case cases[] = {
		{"cfg NULL", -EINVAL, {"cfg"}, e_none, 1, 0},
		{"out NULL", -EINVAL, {"out"}, e_none, 0, 1},
		{"size 0", -EINVAL, {"size", "0"}, e_size0, 0, 0},
		{"size too small", -EINVAL, {"size"}, e_size_small, 0, 0},
		{"pad3 = 1", -EINVAL, {"pad3", "1"}, e_pad3, 0, 0},
		{"rescore_p below p", -EINVAL, {"rescore_p = 0.5", "p = 0.9"}, e_resc_low, 0, 0},
		{"rescore_p above 1", -EINVAL, {"rescore_p = 1.5", "1]"}, e_resc_high, 0, 0},
		{"gpu_cache_max_bytes 2 TiB", -EINVAL, {"gpu_cache_max_bytes", "2199023255552", "1 TiB"},
		 e_hotmax, 0, 0},
		{"gpu_cache_bytes and gpu_cache_max_bytes", -EINVAL,
		 {"gpu_cache_max_bytes = 2147483648", "gpu_cache_bytes = 1073741824"}, e_hotboth, 0, 0},
		{"gpu_cache_bytes 1 TiB + 1", -EINVAL, {"gpu_cache_bytes", "1099511627777", "1 TiB"},
		 e_hotbig, 0, 0},
		{"pad2 = 3", -EINVAL, {"pad2", "3"}, e_pad2, 0, 0},
		{"correction_steps = 65", -EINVAL, {"correction_steps", "65", "64"}, e_corr65, 0, 0},
		{"n_layers 0", -EINVAL, {"n_layers", "0"}, e_layers0, 0, 0},
		{"n_q_heads 0", -EINVAL, {"n_q_heads"}, e_q0, 0, 0},
		{"n_kv_heads 0", -EINVAL, {"n_kv_heads"}, e_kv0, 0, 0},
		{"6 query heads over 4 KV heads", -EINVAL, {"n_q_heads|n_kv_heads", "6", "4"}, e_gqa, 0, 0},
		{"head_dim 0", -EINVAL, {"head_dim", "0"}, e_hd0, 0, 0},
		{"head_dim 32", -EINVAL, {"head_dim", "32"}, e_hd32, 0, 0},
		{"head_dim 96", -EINVAL, {"head_dim", "96"}, e_hd96, 0, 0},
		{"head_dim 100", -EINVAL, {"head_dim", "100"}, e_hd100, 0, 0},
		{"head_dim 512", -EINVAL, {"head_dim", "512"}, e_hd512, 0, 0},
		{"dtype F32", -EINVAL, {"dtype", "3"}, e_dt32, 0, 0},
		{"dtype 9", -EINVAL, {"dtype", "9"}, e_dt9, 0, 0},
		{"out_dtype 7", -EINVAL, {"out_dtype", "7"}, e_odt7, 0, 0},
		{"backend 3", -EINVAL, {"backend", "3"}, e_be3, 0, 0},
		{"max_seqs 65537", -EINVAL, {"max_seqs", "65537"}, e_seqs_big, 0, 0},
		{"p -0.1", -EINVAL, {"p", "-0.1"}, e_pneg, 0, 0},
		{"p 1.5", -EINVAL, {"p", "1.5"}, e_pbig, 0, 0},
		{"p NaN", -EINVAL, {"p", "nan"}, e_pnan, 0, 0},
		{"scale NaN", -EINVAL, {"scale", "nan"}, e_scnan, 0, 0},
		{"scale inf", -EINVAL, {"scale", "inf"}, e_scinf, 0, 0},
		{"flush_batch 65537", -EINVAL, {"flush_batch", "65537"}, e_fb_big, 0, 0},
		{"budget_min 10 > budget_max 5", -EINVAL, {"budget_min", "10", "5"}, e_budget, 0, 0},
#if !KVT_HAVE_CUDA_BACKEND
		{"CUDA backend not built", -EOPNOTSUPP, {"cuda"}, e_cuda, 0, 0},
#endif
	};
	int nfail = 0;
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
		const struct create_case *t = &cases[i];
		kvt_config cfg = base_config();
		t->edit(&cfg);
		kvt_cache *sentinel = (kvt_cache *)&cfg, *out = sentinel;
		int64_t live = kvt_mem_live();
		int rc = kvt_cache_create(t->null_cfg ? NULL : &cfg, t->null_out ? NULL : &out);
		const char *msg = kvt_last_error(NULL);
		T_SOFT(&nfail, rc == t->want, "create [%s]: got %d (%s), wanted %d (%s); detail \"%s\"",
		       t->name, rc, kvt_strerror(rc), t->want, kvt_strerror(t->want), msg);
		if (rc == 0 && out != sentinel) {
			kvt_cache_destroy(out);
			continue;
		}
		for (int k = 0; k < 3 && t->needle[k]; k++)
			T_SOFT(&nfail, contains_any(msg, t->needle[k]),
			       "create [%s]: detail \"%s\" does not name \"%s\"", t->name, msg,
			       t->needle[k]);
		T_SOFT(&nfail, out == sentinel, "create [%s]: *out was written on failure", t->name);
		T_SOFT(&nfail, kvt_mem_live() == live,
		       "create [%s]: live allocations got %lld after the failure, wanted %lld", t->name,
		       (long long)kvt_mem_live(), (long long)live);
	}
	T_CHECK(nfail == 0, "%d create checks failed (listed above)", nfail);
}

/* ---- calls on a cache -------------------------------------------------------------------- */

struct fx {
	kvt_cache *c, *tiny;
	uint32_t a, b, closed;      /* a: 30 tokens, b: empty, closed: opened then closed */
	uint32_t t, u;              /* tiny: t holds a full block, u is empty */
	uint16_t *k, *v, *q, *bad_k, *bad_q;
	float *out;
	int32_t counts[16], pos[16 * 64];
	uint16_t kout[16 * 64 * D], vout[16 * 64 * D];
	char msg[512]; /* the detail, when a case makes further calls after the failing one */
};

struct call_case {
	const char *name;
	int want;
	const char *needle[3]; /* NULL: the detail is not checked (no cache to hold it) */
	int (*call)(struct fx *f, char *arg, size_t n); /* arg receives a value for the needle "%" */
	int tiny;               /* checks the tiny cache's state */
	int no_cache;           /* called with cache NULL: no state or counter to check */
};

#define CALL(fn, ...)                                                                              \
	static int fn(struct fx *f, char *arg, size_t n)                                           \
	{                                                                                          \
		(void)arg;                                                                         \
		(void)n;                                                                           \
		__VA_ARGS__                                                                        \
	}

CALL(c_open_null, { return kvt_seq_open(NULL, &f->a); })
CALL(c_open_seqnull, { return kvt_seq_open(f->c, NULL); })
CALL(c_open_full, {
	uint32_t s, s2 = 12345;
	int rc = kvt_seq_open(f->c, &s); /* the third and last slot */
	if (rc)
		return 1000 + rc;
	rc = kvt_seq_open(f->c, &s2);
	snprintf(f->msg, sizeof f->msg, "%s", kvt_last_error(f->c));
	if (s2 != 12345)
		print_error("seq_open beyond max_seqs wrote *seq = %u\n", s2);
	int rc2 = kvt_seq_close(f->c, s);
	return rc2 ? 2000 + rc2 : rc;
})
CALL(c_close_null, { return kvt_seq_close(NULL, f->a); })
CALL(c_close_closed, {
	snprintf(arg, n, "%u", f->closed);
	return kvt_seq_close(f->c, f->closed);
})
CALL(c_close_unknown, { return kvt_seq_close(f->c, 1000); })
CALL(c_len_null, { return (int)kvt_seq_length(NULL, f->a, 0); })
CALL(c_len_closed, { return (int)kvt_seq_length(f->c, f->closed, 0); })
CALL(c_len_unknown, { return (int)kvt_seq_length(f->c, UINT32_MAX, 0); })
CALL(c_len_layer, { return (int)kvt_seq_length(f->c, f->a, LAYERS); })
CALL(c_pf_null, { return kvt_prefill(NULL, f->a, 0, f->q, f->k, f->v, 1, NULL); })
CALL(c_pf_closed, { return kvt_prefill(f->c, f->closed, 0, f->q, f->k, f->v, 1, NULL); })
CALL(c_pf_unknown, { return kvt_prefill(f->c, 77, 0, f->q, f->k, f->v, 1, NULL); })
CALL(c_pf_layer, { return kvt_prefill(f->c, f->a, LAYERS, f->q, f->k, f->v, 1, NULL); })
CALL(c_pf_layer99, { return kvt_prefill(f->c, f->a, 99, f->q, f->k, f->v, 1, NULL); })
CALL(c_pf_k, { return kvt_prefill(f->c, f->a, 0, f->q, NULL, f->v, 1, NULL); })
CALL(c_pf_v, { return kvt_prefill(f->c, f->a, 0, f->q, f->k, NULL, 1, NULL); })
CALL(c_pf_n0, { return kvt_prefill(f->c, f->a, 0, f->q, f->k, f->v, 0, NULL); })
CALL(c_pf_nonfinite, { return kvt_prefill(f->c, f->a, 1, f->q, f->bad_k, f->v, 3, NULL); })
CALL(c_pf_nonfinite_b, {
	int rc = kvt_prefill(f->c, f->b, 0, NULL, f->bad_k, f->v, 3, NULL);
	if (f->c->seqs[f->b].layers[0].centroids) {
		print_error("a failed first chunk froze the centroids\n");
		return 3000;
	}
	return rc;
})
CALL(c_pf_nospc, { return kvt_prefill(f->tiny, f->t, 0, NULL, f->k, f->v, 1, NULL); })
CALL(c_pf_nospc_new, { return kvt_prefill(f->tiny, f->u, 1, NULL, f->k, f->v, 2, NULL); })
CALL(c_ap_nospc, { return kvt_append(f->tiny, 0, 1, &f->t, f->k, f->v, NULL); })
CALL(c_ap_null, { return kvt_append(NULL, 0, 1, &f->a, f->k, f->v, NULL); })
CALL(c_ap_seqs, { return kvt_append(f->c, 0, 1, NULL, f->k, f->v, NULL); })
CALL(c_ap_k, { return kvt_append(f->c, 0, 1, &f->a, NULL, f->v, NULL); })
CALL(c_ap_v, { return kvt_append(f->c, 0, 1, &f->a, f->k, NULL, NULL); })
CALL(c_ap_n0, { return kvt_append(f->c, 0, 0, &f->a, f->k, f->v, NULL); })
CALL(c_ap_layer, { return kvt_append(f->c, LAYERS, 1, &f->a, f->k, f->v, NULL); })
CALL(c_ap_dup, {
	uint32_t s[3] = {f->b, f->a, f->a};
	snprintf(arg, n, "%u", f->a);
	return kvt_append(f->c, 0, 3, s, f->k, f->v, NULL);
})
CALL(c_ap_unknown, {
	uint32_t s[2] = {f->a, 77};
	return kvt_append(f->c, 0, 2, s, f->k, f->v, NULL);
})
CALL(c_ap_closed, {
	uint32_t s[2] = {f->a, f->closed};
	return kvt_append(f->c, 1, 2, s, f->k, f->v, NULL);
})
CALL(c_ap_nonfinite, {
	uint32_t s[2] = {f->a, f->b};
	return kvt_append(f->c, 0, 2, s, f->bad_k, f->v, NULL); /* the bad key is in b's row */
})
CALL(c_at_null, { return kvt_attend(NULL, 0, 1, &f->a, f->q, f->out, NULL); })
CALL(c_at_seqs, { return kvt_attend(f->c, 0, 1, NULL, f->q, f->out, NULL); })
CALL(c_at_q, { return kvt_attend(f->c, 0, 1, &f->a, NULL, f->out, NULL); })
CALL(c_at_out, { return kvt_attend(f->c, 0, 1, &f->a, f->q, NULL, NULL); })
CALL(c_at_n0, { return kvt_attend(f->c, 0, 0, &f->a, f->q, f->out, NULL); })
CALL(c_at_layer, { return kvt_attend(f->c, LAYERS, 1, &f->a, f->q, f->out, NULL); })
CALL(c_at_unknown, {
	uint32_t s[2] = {f->a, 77};
	return kvt_attend(f->c, 0, 2, s, f->q, f->out, NULL);
})
CALL(c_at_empty, {
	uint32_t s[2] = {f->a, f->b};
	snprintf(arg, n, "%u", f->b);
	return kvt_attend(f->c, 0, 2, s, f->q, f->out, NULL);
})
CALL(c_at_nonfinite, { return kvt_attend(f->c, 0, 1, &f->a, f->bad_q, f->out, NULL); })
CALL(c_sel_null, { return kvt_select(NULL, 0, 1, &f->a, f->q, NULL); })
CALL(c_sel_q, { return kvt_select(f->c, 0, 1, &f->a, NULL, NULL); })
CALL(c_sel_seqs, { return kvt_select(f->c, 0, 1, NULL, f->q, NULL); })
CALL(c_sel_n0, { return kvt_select(f->c, 0, 0, &f->a, f->q, NULL); })
CALL(c_sel_layer, { return kvt_select(f->c, 7, 1, &f->a, f->q, NULL); })
CALL(c_sel_unknown, { return kvt_select(f->c, 0, 1, &f->closed, f->q, NULL); })
CALL(c_sel_empty, {
	snprintf(arg, n, "%u", f->b);
	return kvt_select(f->c, 1, 1, &f->b, f->q, NULL);
})
CALL(c_sel_nonfinite, { return kvt_select(f->c, 0, 1, &f->a, f->bad_q, NULL); })
CALL(c_ga_null, { return kvt_gather(NULL, 0, 1, &f->a, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_counts, { return kvt_gather(f->c, 0, 1, &f->a, 64, NULL, f->pos, NULL, NULL, NULL); })
CALL(c_ga_seqs, { return kvt_gather(f->c, 0, 1, NULL, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_n0, { return kvt_gather(f->c, 0, 0, &f->a, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_layer, { return kvt_gather(f->c, LAYERS, 1, &f->a, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_small, { return kvt_gather(f->c, 0, 1, &f->a, 5, f->counts, f->pos, f->kout, f->vout, NULL); })
CALL(c_ga_before, { return kvt_gather(f->c, 1, 1, &f->a, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_kv, { return kvt_gather(f->c, 0, 1, &f->a, 64, f->counts, f->pos, f->kout, NULL, NULL); })
CALL(c_ga_unknown, { return kvt_gather(f->c, 0, 1, &f->closed, 64, f->counts, f->pos, NULL, NULL, NULL); })
CALL(c_ga_list, {
	uint32_t s[2] = {f->a, f->b};
	return kvt_gather(f->c, 0, 2, s, 64, f->counts, f->pos, NULL, NULL, NULL);
})
CALL(c_st_null, {
	kvt_stats st;
	st.size = sizeof st;
	return kvt_get_stats(NULL, &st);
})
CALL(c_st_stats, { return kvt_get_stats(f->c, NULL); })
CALL(c_st_size, {
	kvt_stats st;
	memset(&st, 0, sizeof st);
	st.size = KVT_STATS_SIZE_VER0 - 8; /* below the smallest size the library accepts */
	return kvt_get_stats(f->c, &st);
})
CALL(c_ls_null, {
	kvt_layer_stats st = {.size = sizeof st};
	return kvt_get_layer_stats(NULL, 0, &st);
})
CALL(c_ls_stats, { return kvt_get_layer_stats(f->c, 0, NULL); })
CALL(c_ls_size, {
	kvt_layer_stats st = {.size = sizeof st - 8};
	return kvt_get_layer_stats(f->c, 0, &st);
})
CALL(c_ls_layer, {
	kvt_layer_stats st = {.size = sizeof st};
	return kvt_get_layer_stats(f->c, LAYERS, &st);
})

static const struct call_case call_cases[] = {
	{"seq_open cache NULL", -EINVAL, {NULL}, c_open_null, 0, 1},
	{"seq_open seq NULL", -EINVAL, {"seq"}, c_open_seqnull, 0, 0},
	{"seq_open beyond max_seqs 3", -ENOSPC, {"max_seqs", "3"}, c_open_full, 0, 0},
	{"seq_close cache NULL", -EINVAL, {NULL}, c_close_null, 0, 1},
	{"seq_close closed sequence", -ENOENT, {"%"}, c_close_closed, 0, 0},
	{"seq_close unknown 1000", -ENOENT, {"1000"}, c_close_unknown, 0, 0},
	{"seq_length cache NULL", -EINVAL, {NULL}, c_len_null, 0, 1},
	{"seq_length closed", -ENOENT, {"seq"}, c_len_closed, 0, 0},
	{"seq_length unknown UINT32_MAX", -ENOENT, {"4294967295"}, c_len_unknown, 0, 0},
	{"seq_length layer 2 of 2", -EINVAL, {"layer", "2"}, c_len_layer, 0, 0},
	{"prefill cache NULL", -EINVAL, {NULL}, c_pf_null, 0, 1},
	{"prefill closed sequence", -ENOENT, {"seq"}, c_pf_closed, 0, 0},
	{"prefill unknown 77", -ENOENT, {"77"}, c_pf_unknown, 0, 0},
	{"prefill layer 2 of 2", -EINVAL, {"layer", "2"}, c_pf_layer, 0, 0},
	{"prefill layer 99", -EINVAL, {"layer", "99"}, c_pf_layer99, 0, 0},
	{"prefill k NULL", -EINVAL, {"k"}, c_pf_k, 0, 0},
	{"prefill v NULL", -EINVAL, {"v"}, c_pf_v, 0, 0},
	{"prefill n_tokens 0", -EINVAL, {"n_tokens"}, c_pf_n0, 0, 0},
	{"prefill non-finite key", -EINVAL, {"finite|inf|nan"}, c_pf_nonfinite, 0, 0},
	{"prefill non-finite key, first chunk", -EINVAL, {"finite|inf|nan"}, c_pf_nonfinite_b, 0, 0},
	{"prefill host tier full", -ENOSPC, {"bytes|host"}, c_pf_nospc, 1, 0},
	{"prefill host tier full, new sequence", -ENOSPC, {"bytes|host"}, c_pf_nospc_new, 1, 0},
	{"append host tier full", -ENOSPC, {"bytes|host"}, c_ap_nospc, 1, 0},
	{"append cache NULL", -EINVAL, {NULL}, c_ap_null, 0, 1},
	{"append seqs NULL", -EINVAL, {"seqs"}, c_ap_seqs, 0, 0},
	{"append k NULL", -EINVAL, {"k"}, c_ap_k, 0, 0},
	{"append v NULL", -EINVAL, {"v"}, c_ap_v, 0, 0},
	{"append n_seqs 0", -EINVAL, {"n_seqs"}, c_ap_n0, 0, 0},
	{"append layer 2 of 2", -EINVAL, {"layer", "2"}, c_ap_layer, 0, 0},
	{"append duplicate sequence", -EINVAL, {"duplicate|twice|more than once", "%"}, c_ap_dup, 0, 0},
	{"append unknown 77 after a good one", -ENOENT, {"77"}, c_ap_unknown, 0, 0},
	{"append closed after a good one", -ENOENT, {"seq"}, c_ap_closed, 0, 0},
	{"append non-finite key", -EINVAL, {"finite|inf|nan"}, c_ap_nonfinite, 0, 0},
	{"attend cache NULL", -EINVAL, {NULL}, c_at_null, 0, 1},
	{"attend seqs NULL", -EINVAL, {"seqs"}, c_at_seqs, 0, 0},
	{"attend q NULL", -EINVAL, {"q"}, c_at_q, 0, 0},
	{"attend out NULL", -EINVAL, {"out"}, c_at_out, 0, 0},
	{"attend n_seqs 0", -EINVAL, {"n_seqs"}, c_at_n0, 0, 0},
	{"attend layer 2 of 2", -EINVAL, {"layer", "2"}, c_at_layer, 0, 0},
	{"attend unknown 77", -ENOENT, {"77"}, c_at_unknown, 0, 0},
	{"attend empty sequence", -EINVAL, {"empty|no tokens", "%"}, c_at_empty, 0, 0},
	{"attend non-finite query", -EINVAL, {"finite|inf|nan"}, c_at_nonfinite, 0, 0},
	{"select cache NULL", -EINVAL, {NULL}, c_sel_null, 0, 1},
	{"select q NULL", -EINVAL, {"q"}, c_sel_q, 0, 0},
	{"select seqs NULL", -EINVAL, {"seqs"}, c_sel_seqs, 0, 0},
	{"select n_seqs 0", -EINVAL, {"n_seqs"}, c_sel_n0, 0, 0},
	{"select layer 7", -EINVAL, {"layer", "7"}, c_sel_layer, 0, 0},
	{"select closed sequence", -ENOENT, {"seq"}, c_sel_unknown, 0, 0},
	{"select empty sequence", -EINVAL, {"empty|no tokens", "%"}, c_sel_empty, 0, 0},
	{"select non-finite query", -EINVAL, {"finite|inf|nan"}, c_sel_nonfinite, 0, 0},
	{"gather cache NULL", -EINVAL, {NULL}, c_ga_null, 0, 1},
	{"gather counts NULL", -EINVAL, {"counts"}, c_ga_counts, 0, 0},
	{"gather seqs NULL", -EINVAL, {"seqs"}, c_ga_seqs, 0, 0},
	{"gather n_seqs 0", -EINVAL, {"n_seqs"}, c_ga_n0, 0, 0},
	{"gather layer 2 of 2", -EINVAL, {"layer", "2"}, c_ga_layer, 0, 0},
	{"gather max_tokens 5 < 30", -EINVAL, {"max_tokens", "5", "30"}, c_ga_small, 0, 0},
	{"gather before any select", -EINVAL, {"select"}, c_ga_before, 0, 0},
	{"gather k_out without v_out", -EINVAL, {"v_out"}, c_ga_kv, 0, 0},
	{"gather closed sequence", -ENOENT, {"seq"}, c_ga_unknown, 0, 0},
	{"gather another sequence list", -EINVAL, {"select"}, c_ga_list, 0, 0},
	{"get_stats cache NULL", -EINVAL, {NULL}, c_st_null, 0, 1},
	{"get_stats stats NULL", -EINVAL, {"stats"}, c_st_stats, 0, 0},
	{"get_stats size wrong", -EINVAL, {"size"}, c_st_size, 0, 0},
	{"get_layer_stats cache NULL", -EINVAL, {NULL}, c_ls_null, 0, 1},
	{"get_layer_stats stats NULL", -EINVAL, {"stats"}, c_ls_stats, 0, 0},
	{"get_layer_stats size wrong", -EINVAL, {"size"}, c_ls_size, 0, 0},
	{"get_layer_stats layer 2 of 2", -EINVAL, {"layer", "2"}, c_ls_layer, 0, 0},
};

/* What a caller can observe of a cache: stats and the lengths of its open sequences. */
struct snap {
	kvt_stats st;
	int64_t len[2][LAYERS];
};

static void snapshot(kvt_cache *c, const uint32_t *seqs, struct snap *s)
{
	for (uint32_t q = 0; q < 2; q++)
		for (uint32_t l = 0; l < LAYERS; l++)
			s->len[q][l] = kvt_seq_length(c, seqs[q], l);
	s->st = t_stats(c);
}

static void prefill_ok(kvt_cache *c, uint32_t seq, uint32_t layer, const struct fx *f, uint32_t n)
{
	int rc = kvt_prefill(c, seq, layer, f->q, f->k, f->v, n, NULL);
	T_CHECK(rc == 0, "fixture: prefill of %u tokens got %d (%s)", n, rc, kvt_last_error(c));
}

static void fixture(struct fx *f)
{
	memset(f, 0, sizeof *f);
	t_rng rng;
	t_rng_seed(&rng, 0xa91);
	size_t kvn = (size_t)BUF_TOKENS * NKV * D, qn = (size_t)BUF_TOKENS * NQ * D;
	f->k = (uint16_t *)t_alloc(2 * kvn);
	f->v = (uint16_t *)t_alloc(2 * kvn);
	f->q = (uint16_t *)t_alloc(2 * qn);
	f->bad_k = (uint16_t *)t_alloc(2 * kvn);
	f->bad_q = (uint16_t *)t_alloc(2 * qn);
	f->out = (float *)t_alloc(4 * qn);
	t_fill(&rng, KVT_DTYPE_F16, kvn, 0.5, 1, f->k, NULL);
	t_fill(&rng, KVT_DTYPE_F16, kvn, 0, 1, f->v, NULL);
	t_fill(&rng, KVT_DTYPE_F16, qn, 0, 1, f->q, NULL);
	memcpy(f->bad_k, f->k, 2 * kvn);
	memcpy(f->bad_q, f->q, 2 * qn);
	f->bad_k[NKV * D + 5] = 0x7c00;      /* +inf in the second token (or sequence) */
	f->bad_k[2 * NKV * D + 1] = 0x7e00;  /* NaN in the third */
	f->bad_q[3 * D + 17] = 0xfc00;       /* -inf in the fourth query head */
	kvt_config cfg = base_config();
	f->c = t_create(&cfg);
	T_CHECK(strcmp(kvt_last_error(f->c), "") == 0, "fresh cache: kvt_last_error got \"%s\", "
		"wanted \"\"", kvt_last_error(f->c));
	uint32_t s[3];
	for (int i = 0; i < 3; i++)
		T_CHECK(kvt_seq_open(f->c, &s[i]) == 0, "fixture: seq_open %d", i);
	f->a = s[0];
	f->b = s[1];
	f->closed = s[2];
	T_CHECK(kvt_seq_close(f->c, f->closed) == 0, "fixture: seq_close");
	for (uint32_t l = 0; l < LAYERS; l++)
		prefill_ok(f->c, f->a, l, f, 30);
	int mx = kvt_select(f->c, 0, 1, &f->a, f->q, NULL);
	T_CHECK(mx == 30, "fixture: select got %d, wanted 30 (p = 1)", mx);
	/* room for one block per KV head: t fills it, then nothing fits */
	cfg.host_bytes = (uint64_t)2 * KVT_BLOCK_TOKENS * 2 * D * 2;
	f->tiny = t_create(&cfg);
	T_CHECK(f->tiny->host.block_bytes == (size_t)KVT_BLOCK_TOKENS * 2 * D * 2,
		"fixture: host block got %zu bytes, wanted %u (the tiny tier holds 2 blocks)",
		f->tiny->host.block_bytes, KVT_BLOCK_TOKENS * 2 * D * 2);
	T_CHECK(kvt_seq_open(f->tiny, &f->t) == 0 && kvt_seq_open(f->tiny, &f->u) == 0,
		"fixture: tiny seq_open");
	prefill_ok(f->tiny, f->t, 0, f, KVT_BLOCK_TOKENS);
}

static void fixture_fini(struct fx *f)
{
	kvt_cache_destroy(f->c);
	kvt_cache_destroy(f->tiny);
	free(f->k);
	free(f->v);
	free(f->q);
	free(f->bad_k);
	free(f->bad_q);
	free(f->out);
}

static void test_call_errors(void **state)
{
	(void)state;
	struct fx *f = (struct fx *)t_alloc(sizeof *f);
	fixture(f);
	int nfail = 0;
	for (size_t i = 0; i < sizeof call_cases / sizeof *call_cases; i++) {
		const struct call_case *t = &call_cases[i];
		kvt_cache *c = t->tiny ? f->tiny : f->c;
		uint32_t open[2] = {t->tiny ? f->t : f->a, t->tiny ? f->u : f->b};
		struct snap before, after;
		snapshot(c, open, &before);
		int64_t live = kvt_mem_live();
		char arg[32] = "";
		f->msg[0] = 0;
		int rc = t->call(f, arg, sizeof arg);
		char msg[512];
		snprintf(msg, sizeof msg, "%s", f->msg[0] ? f->msg : kvt_last_error(c));
		T_SOFT(&nfail, rc == t->want, "[%s]: got %d (%s), wanted %d (%s); detail \"%s\"",
		       t->name, rc, kvt_strerror(rc), t->want, kvt_strerror(t->want), msg);
		for (int k = 0; k < 3 && t->needle[k] && !t->no_cache; k++) {
			const char *nd = strcmp(t->needle[k], "%") ? t->needle[k] : arg;
			T_SOFT(&nfail, contains_any(msg, nd), "[%s]: detail \"%s\" does not name \"%s\"",
			       t->name, msg, nd);
		}
		snapshot(c, open, &after);
		const kvt_stats *x = &before.st, *y = &after.st;
		T_SOFT(&nfail, x->tokens == y->tokens && x->host_bytes_used == y->host_bytes_used &&
				       x->seqs_open == y->seqs_open && x->tokens_indexed == y->tokens_indexed &&
				       x->index_bytes == y->index_bytes && x->steps == y->steps &&
				       x->flushes == y->flushes,
		       "[%s]: stats changed: tokens %llu -> %llu, host_bytes_used %llu -> %llu, "
		       "seqs_open %llu -> %llu, indexed %llu -> %llu, steps %llu -> %llu",
		       t->name, (unsigned long long)x->tokens, (unsigned long long)y->tokens,
		       (unsigned long long)x->host_bytes_used, (unsigned long long)y->host_bytes_used,
		       (unsigned long long)x->seqs_open, (unsigned long long)y->seqs_open,
		       (unsigned long long)x->tokens_indexed, (unsigned long long)y->tokens_indexed,
		       (unsigned long long)x->steps, (unsigned long long)y->steps);
		uint64_t werr = x->errors + (t->no_cache ? 0 : 1);
		T_SOFT(&nfail, y->errors == werr, "[%s]: stats errors got %llu, wanted %llu", t->name,
		       (unsigned long long)y->errors, (unsigned long long)werr);
		for (uint32_t q = 0; q < 2; q++)
			for (uint32_t l = 0; l < LAYERS; l++)
				T_SOFT(&nfail, before.len[q][l] == after.len[q][l],
				       "[%s]: kvt_seq_length(seq %u, layer %u) got %lld, wanted %lld",
				       t->name, open[q], l, (long long)after.len[q][l],
				       (long long)before.len[q][l]);
		if (kvt_mem_live() != live) /* kept storage is not observable, but worth a note */
			print_message("note [%s]: live allocations %lld -> %lld across the failed call\n",
				      t->name, (long long)live, (long long)kvt_mem_live());
	}
	/* still usable: a good append, attend and gather on the main cache */
	uint32_t ab[2] = {f->a, f->b};
	int rc = kvt_append(f->c, 0, 2, ab, f->k, f->v, NULL);
	T_CHECK(rc == 0, "append after the errors got %d (%s)", rc, kvt_last_error(f->c));
	rc = kvt_attend(f->c, 0, 2, ab, f->q, f->out, NULL);
	T_CHECK(rc == 0, "attend after the errors got %d (%s)", rc, kvt_last_error(f->c));
	rc = kvt_gather(f->c, 0, 2, ab, 64, f->counts, f->pos, NULL, NULL, NULL);
	T_CHECK(rc == 2 * (31 + 1), "gather after the errors got %d, wanted %d (%s)", rc,
		2 * (31 + 1), kvt_last_error(f->c));
	T_CHECK(kvt_seq_length(f->c, f->a, 0) == 31 && kvt_seq_length(f->c, f->b, 0) == 1,
		"lengths after the errors got %lld and %lld, wanted 31 and 1",
		(long long)kvt_seq_length(f->c, f->a, 0), (long long)kvt_seq_length(f->c, f->b, 0));
	fixture_fini(f);
	free(f);
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
}

/* A backend whose kernels cannot reach some memory (the CUDA backend: pageable host memory, where
 * the device cannot read it) refuses a tensor there, naming the call, the tensor and why, before
 * anything changes: the cpu backend's ops with an unreachable hook that refuses one buffer. */
static const void *far_mem;
static size_t far_bytes;

static uint32_t far_unreachable(kvt_cache *c, uint32_t n, const void *const p[],
				const char **why, void *stream)
{
	(void)c;
	(void)stream;
	const char *lo = (const char *)far_mem;
	for (uint32_t i = 0; i < n; i++)
		if ((const char *)p[i] >= lo && (const char *)p[i] < lo + far_bytes) {
			*why = "far memory";
			return i;
		}
	return n;
}

struct reach_case {
	const char *name, *needle; /* needle: "<call>: <tensor> = " */
	int (*call)(struct fx *f, const void *far);
};

#define REACH(fn, ...)                                                                             \
	static int fn(struct fx *f, const void *far)                                               \
	{                                                                                          \
		uint32_t ab[2] = {f->a, f->b};                                                     \
		(void)ab;                                                                          \
		__VA_ARGS__                                                                        \
	}
REACH(r_ga_pos, { return kvt_gather(f->c, 0, 1, &f->a, 64, f->counts, (int32_t *)far, NULL,
				     NULL, NULL); })
REACH(r_ga_kout, { return kvt_gather(f->c, 0, 1, &f->a, 64, f->counts, f->pos, (void *)far,
				      f->vout, NULL); })
REACH(r_pf_q, { return kvt_prefill(f->c, f->a, 1, far, f->k, f->v, 4, NULL); })
REACH(r_pf_k, { return kvt_prefill(f->c, f->a, 1, f->q, far, f->v, 4, NULL); })
REACH(r_pf_v, { return kvt_prefill(f->c, f->a, 1, f->q, f->k, far, 4, NULL); })
REACH(r_ap_k, { return kvt_append(f->c, 0, 2, ab, far, f->v, NULL); })
REACH(r_at_q, { return kvt_attend(f->c, 0, 1, &f->a, far, f->out, NULL); })
REACH(r_at_out, { return kvt_attend(f->c, 0, 1, &f->a, f->q, (void *)far, NULL); })
REACH(r_sel_q, { return kvt_select(f->c, 0, 1, &f->a, far, NULL); })
REACH(r_ex_v, {
	const uint32_t cu[3] = {0, 2, 3};
	return kvt_extend(f->c, 0, 2, ab, cu, f->q, f->k, far, f->out, 0, NULL);
})
REACH(r_ex_out, {
	const uint32_t cu[3] = {0, 2, 3};
	return kvt_extend(f->c, 0, 2, ab, cu, f->q, f->k, f->v, (void *)far, 0, NULL);
})
REACH(r_rr_k, { return kvt_seq_read_rows(f->c, f->a, 0, 0, 8, (void *)far, f->kout, NULL); })
REACH(r_wr_v, { return kvt_seq_write_rows(f->c, f->a, 0, 30, 32, f->k, far, NULL); })
REACH(r_ag_q, {
	const int32_t seqs[1] = {(int32_t)f->a};
	const kvt_graph_batch b = {.n_slots = 1, .seqs = seqs};
	return kvt_attend_graph(f->c, 0, &b, far, f->out, NULL);
})
REACH(r_ag_seqs, {
	const kvt_graph_batch b = {.n_slots = 1, .seqs = (const int32_t *)far};
	return kvt_attend_graph(f->c, 0, &b, f->q, f->out, NULL);
})

static const struct reach_case reach_cases[] = {
	{"gather pos", "kvt_gather: pos = ", r_ga_pos},
	{"gather k_out", "kvt_gather: k_out = ", r_ga_kout},
	{"prefill q", "kvt_prefill_at: q = ", r_pf_q},
	{"prefill k", "kvt_prefill_at: k = ", r_pf_k},
	{"prefill v", "kvt_prefill_at: v = ", r_pf_v},
	{"append k", "kvt_append_at: k = ", r_ap_k},
	{"attend q", "kvt_attend_at: q = ", r_at_q},
	{"attend out", "kvt_attend_at: out = ", r_at_out},
	{"select q", "kvt_select_at: q = ", r_sel_q},
	{"extend v", "kvt_extend_at: v = ", r_ex_v},
	{"extend out", "kvt_extend_at: out = ", r_ex_out},
	{"read_rows k", "kvt_seq_read_rows: k = ", r_rr_k},
	{"write_rows v", "kvt_seq_write_rows: v = ", r_wr_v},
	{"attend_graph q", "kvt_attend_graph: q = ", r_ag_q},
	{"attend_graph batch->seqs", "kvt_attend_graph: batch->seqs = ", r_ag_seqs},
};

static void test_unreachable_named(void **state)
{
	(void)state;
	struct fx *f = (struct fx *)t_alloc(sizeof *f);
	fixture(f);
	static struct kvt_backend_ops far_ops;
	far_ops = *f->c->ops;
	far_ops.unreachable = far_unreachable;
	f->c->ops = &far_ops;
	T_CHECK(kvt_graph_reserve(f->c, 2, 64, NULL) == 0, "kvt_graph_reserve: %s",
		kvt_last_error(f->c));
	/* a copy of every input, so that a call the check missed would still run on good data */
	far_bytes = (size_t)BUF_TOKENS * NQ * D * 4;
	void *far = t_alloc(far_bytes);
	memcpy(far, f->q, (size_t)BUF_TOKENS * NQ * D * 2);
	far_mem = far;
	uint32_t open[2] = {f->a, f->b};
	int nfail = 0;
	for (size_t i = 0; i < sizeof reach_cases / sizeof *reach_cases; i++) {
		const struct reach_case *t = &reach_cases[i];
		struct snap before, after;
		snapshot(f->c, open, &before);
		const int rc = t->call(f, far);
		const char *msg = kvt_last_error(f->c);
		snapshot(f->c, open, &after);
		T_SOFT(&nfail, rc == -EINVAL && strstr(msg, t->needle) && strstr(msg, "far memory"),
		       "[%s]: got %d \"%s\", wanted -EINVAL naming \"%s...far memory\"", t->name,
		       rc, msg, t->needle);
		T_SOFT(&nfail, after.st.errors == before.st.errors + 1 &&
				       after.st.tokens == before.st.tokens &&
				       after.st.steps == before.st.steps &&
				       after.st.host_bytes_used == before.st.host_bytes_used,
		       "[%s]: errors %llu -> %llu, tokens %llu -> %llu, steps %llu -> %llu",
		       t->name, (unsigned long long)before.st.errors,
		       (unsigned long long)after.st.errors, (unsigned long long)before.st.tokens,
		       (unsigned long long)after.st.tokens, (unsigned long long)before.st.steps,
		       (unsigned long long)after.st.steps);
		for (uint32_t q = 0; q < 2; q++)
			for (uint32_t l = 0; l < LAYERS; l++)
				T_SOFT(&nfail, before.len[q][l] == after.len[q][l],
				       "[%s]: seq %u layer %u length %lld -> %lld", t->name,
				       open[q], l, (long long)before.len[q][l],
				       (long long)after.len[q][l]);
	}
	/* memory the hook takes is served as before */
	int rc = kvt_gather(f->c, 0, 1, &f->a, 64, f->counts, f->pos, f->kout, f->vout, NULL);
	T_CHECK(rc == 30 * NKV, "gather after the refusals got %d, wanted %d (%s)", rc, 30 * NKV,
		kvt_last_error(f->c));
	rc = kvt_attend(f->c, 0, 1, &f->a, f->q, f->out, NULL);
	T_CHECK(rc == 0, "attend after the refusals got %d (%s)", rc, kvt_last_error(f->c));
	free(far);
	fixture_fini(f);
	free(f);
	T_CHECK(nfail == 0, "%d checks failed (listed above)", nfail);
}

/* The CPU backend names the first element that is not finite, wherever it lies in a long chunk
 * (its check tests blocks of elements on their bits first), in both input dtypes: a NaN and an
 * infinity past the first block, the NaN first. Nothing is stored. */
static void test_nonfinite_named(void **state)
{
	(void)state;
	const uint32_t dtypes[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
	const uint32_t n = 40;
	const size_t kvn = (size_t)n * NKV * D;
	uint16_t *k = (uint16_t *)t_alloc(2 * kvn), *v = (uint16_t *)t_alloc(2 * kvn);
	for (size_t di = 0; di < 2; di++) {
		const uint32_t dt = dtypes[di];
		t_rng rng;
		t_rng_seed(&rng, 5 + di);
		t_fill(&rng, dt, kvn, 0.5, 1, k, NULL);
		t_fill(&rng, dt, kvn, 0, 1, v, NULL);
		/* element 1300 is token 10, KV head 0, element 20; 4000 is past it */
		const uint16_t nan = dt == KVT_DTYPE_BF16 ? 0x7fc0 : 0x7e00;
		const uint16_t inf = dt == KVT_DTYPE_BF16 ? 0x7f80 : 0x7c00;
		k[1300] = nan;
		k[4000] = inf;
		kvt_config cfg = t_config(LAYERS, NQ, NKV, D, dt);
		kvt_cache *c = t_create(&cfg);
		uint32_t seq;
		T_CHECK(kvt_seq_open(c, &seq) == 0, "kvt_seq_open: %s", kvt_last_error(c));
		const int rc = kvt_prefill(c, seq, 0, NULL, k, v, n, NULL);
		const char *msg = kvt_last_error(c);
		T_CHECK(rc == -EINVAL && strstr(msg, "k[10, 0, 20] = nan"),
			"dtype %u: kvt_prefill got %d \"%s\", wanted -EINVAL naming k[10, 0, 20] = nan",
			dt, rc, msg);
		T_CHECK(kvt_seq_length(c, seq, 0) == 0, "dtype %u: %lld tokens stored after the "
			"refusal, wanted 0", dt, (long long)kvt_seq_length(c, seq, 0));
		/* the NaN mended, the infinity is the first */
		k[1300] = k[1301];
		T_CHECK(kvt_prefill(c, seq, 0, NULL, k, v, n, NULL) == -EINVAL &&
				strstr(kvt_last_error(c), "k[31, 0, 32] = inf"),
			"dtype %u: got \"%s\", wanted k[31, 0, 32] = inf", dt, kvt_last_error(c));
		k[4000] = k[4001];
		T_CHECK(kvt_prefill(c, seq, 0, NULL, k, v, n, NULL) == 0, "dtype %u: a finite "
			"chunk refused: %s", dt, kvt_last_error(c));
		kvt_cache_destroy(c);
	}
	free(k);
	free(v);
}

static void test_strerror_version(void **state)
{
	(void)state;
	const int codes[] = {0, -EINVAL, -ENOMEM, -ENOSPC, -EOPNOTSUPP, -ENODEV, -EIO, -ENOENT, -EBADMSG};
	const size_t n = sizeof codes / sizeof *codes;
	const char *unknown = kvt_strerror(-12345);
	T_CHECK(unknown != NULL, "kvt_strerror(-12345) got NULL");
	T_CHECK(kvt_strerror(12345) != NULL && kvt_strerror(INT32_MIN) != NULL,
		"kvt_strerror of a positive or INT32_MIN code got NULL");
	for (size_t i = 0; i < n; i++) {
		const char *s = kvt_strerror(codes[i]);
		T_CHECK(s != NULL && *s, "kvt_strerror(%d) got %s, wanted text", codes[i], s ? "\"\"" : "NULL");
		T_CHECK(strcmp(s, unknown) != 0, "kvt_strerror(%d) got \"%s\", the unknown-code text",
			codes[i], s);
		for (size_t j = 0; j < i; j++)
			T_CHECK(strcmp(s, kvt_strerror(codes[j])) != 0,
				"kvt_strerror(%d) and kvt_strerror(%d) both got \"%s\"", codes[i],
				codes[j], s);
	}
	T_CHECK(kvt_version_number() == KVT_VERSION_NUMBER,
		"kvt_version_number got %u, wanted KVT_VERSION_NUMBER %u", kvt_version_number(),
		(unsigned)KVT_VERSION_NUMBER);
	T_CHECK(KVT_VERSION_NUMBER ==
			KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH,
		"KVT_VERSION_NUMBER %u inconsistent with its parts", (unsigned)KVT_VERSION_NUMBER);
	char want[32];
	snprintf(want, sizeof want, "%d.%d.%d", KVT_VERSION_MAJOR, KVT_VERSION_MINOR,
		 KVT_VERSION_PATCH);
	const char *vs = kvt_version_string();
	T_CHECK(vs && strcmp(vs, want) == 0, "kvt_version_string got \"%s\", wanted \"%s\"",
		vs ? vs : "(null)", want);
	kvt_cache_destroy(NULL);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_create_errors),
		cmocka_unit_test(test_call_errors),
		cmocka_unit_test(test_nonfinite_named),
		cmocka_unit_test(test_unreachable_named),
		cmocka_unit_test(test_strerror_version),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
