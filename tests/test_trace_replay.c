/* SPDX-License-Identifier: MIT */
/*
 * `kvbench --trace` end to end (part of test_trace, whose main runs these): a small trace replayed
 * on the CPU backend (recall 1 at p = 1), a corrupted one failing with the file's name, counts that
 * would overflow refused, valid JSON whatever the bytes of the trace's name, and a sweep over the
 * selection's options whose points are the single replays' and whose methods are compared with
 * the p-sweep.
 */
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "trace_testutil.h"

/* ---- the replay ----------------------------------------------------------------------------- */

static double jnum(const trace_json *j, const trace_json_node *o, const char *key)
{
	const trace_json_node *x = trace_json_get(j, o, key);
	T_CHECK(x && x->type == TJ_NUMBER, "the JSON has no number '%s'", key);
	return x->num;
}

void test_replay(void **state)
{
	(void)state;
	tdir t;
	char *out, *errs;
	trace_json j;
	make_trace(&t, TRACE_F16, 2, 300, 24, 3);
	char *argv[] = {"kvbench", "--trace", t.path,	 "--backend", "cpu", "--p",
			"1",	   "--json",  "--quiet", "--window",  "16",  "--flush",
			"8",	   "--sinks", "4",	 "--chunk",   "128", NULL};
	int rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 1: exit %d, stderr: %s", rc, errs);
	t_json_stdout("--json output", out, &j);
	const trace_json_node *root = &j.nodes[1];
	double rmin = jnum(&j, root, "recall_min"), bud = jnum(&j, root, "budget_mean"),
	       oe = jnum(&j, root, "output_error");
	T_CHECK(rmin > 1 - 1e-5, "p = 1: recall_min got %.9f, want 1", rmin);
	T_CHECK(bud == 1.0, "p = 1: budget_mean got %.9f, want 1", bud);
	T_CHECK(oe < 1e-4, "p = 1: output_error got %g, want < 1e-4", oe);
	const trace_json_node *layers = trace_json_get(&j, root, "layers");
	T_CHECK(layers && layers->count == 2, "want 2 layers in the JSON");
	const trace_json_node *l0 = &j.nodes[layers->child],
			      *heads = trace_json_get(&j, l0, "heads");
	T_CHECK(heads && heads->count == 4, "want 4 heads in layer 0");
	T_CHECK(errs[0] == 0, "--quiet: stderr not empty: %s", errs);
	/* the percentiles of one head: with 24 steps the 1st is the minimum (nearest rank), the 5th
	 * the second lowest, so at least the minimum and at most the largest recall, 1 */
	const trace_json_node *h0 = &j.nodes[heads->child];
	double p5 = jnum(&j, h0, "recall_p5"), p1 = jnum(&j, h0, "recall_p1"),
	       hmin = jnum(&j, h0, "recall_min");
	T_CHECK(p1 == hmin && p5 >= hmin && p5 <= 1 + 1e-6,
		"head 0: recall_p1 %.9g (want the minimum %.9g), recall_p5 %.9g (want in [min, 1])",
		p1, hmin, p5);
	free(out);
	free(errs);

	/* the same replay with each layer's sequence spilled to an NVMe file after its prefill: the
	 * decode steps read their rows from the file, and every figure is the same */
	char img[] = "/tmp/kvt_trace_nvme_XXXXXX";
	int fd = mkstemp(img);
	T_CHECK(fd >= 0, "mkstemp failed");
	close(fd);
	unlink(img); /* the library creates and sizes the file */
	char *argv_nv[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--p", "1", "--json",
			   "--quiet", "--window", "16", "--flush", "8", "--sinks", "4", "--chunk",
			   "128", "--nvme", img, NULL};
	char *out_nv, *errs_nv;
	rc = t_kvbench(argv_nv, NULL, &out_nv, &errs_nv);
	unlink(img);
	if (rc != 0 && strstr(errs_nv, "(-95)")) {
		printf("# --nvme replay skipped: no NVMe tier in this build or kernel\n");
	} else {
		trace_json jn;
		T_CHECK(rc == 0, "replay with --nvme: exit %d, stderr: %s", rc, errs_nv);
		t_json_stdout("--nvme --json output", out_nv, &jn);
		static const char *const same[] = {"recall_mean", "recall_min", "budget_mean",
						   "output_error", "recall_p5_worst_head"};
		for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++)
			T_CHECK(jnum(&jn, &jn.nodes[1], same[i]) == jnum(&j, root, same[i]),
				"--nvme: %s got %.9g, want %.9g as without", same[i],
				jnum(&jn, &jn.nodes[1], same[i]), jnum(&j, root, same[i]));
		double nb = jnum(&jn, &jn.nodes[1], "nvme_bytes_per_step");
		T_CHECK(nb > 0, "--nvme: nvme_bytes_per_step got %g, want > 0", nb);
		T_CHECK(jnum(&j, root, "nvme_bytes_per_step") == 0,
			"no NVMe tier: nvme_bytes_per_step got %g, want 0",
			jnum(&j, root, "nvme_bytes_per_step"));
		/* read I/Os: at least one per 1 MiB block read in pieces of at most a block, and
		 * none without the tier */
		const double nr = jnum(&jn, &jn.nodes[1], "nvme_reads_per_step");
		T_CHECK(nr > 0 && nr >= nb / (1 << 20), "--nvme: nvme_reads_per_step got %g for %g "
			"bytes per step", nr, nb);
		T_CHECK(jnum(&j, root, "nvme_reads_per_step") == 0,
			"no NVMe tier: nvme_reads_per_step got %g, want 0",
			jnum(&j, root, "nvme_reads_per_step"));
		trace_json_free(&jn);
	}
	free(out_nv);
	free(errs_nv);
	trace_json_free(&j);

	/* p = 0.5 on one layer: a subset, recall below 1, budget below 1; the text table */
	char *argv2[] = {"kvbench", "--trace",	t.path, "--backend=cpu", "--p=0.5", "--layers",
			 "1",	    "--window", "16",	"--budget-min",	 "0",	    NULL};
	rc = t_kvbench(argv2, NULL, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 0.5: exit %d, stderr: %s", rc, errs);
	T_CHECK(strstr(out, "recall mean") && strstr(out, "budget_mean"), "text output: %s", out);
	free(out);
	free(errs);
	char *argv3[] = {"kvbench", "--trace",	    t.path,	"--backend", "cpu",
			 "--p",	    "0.5",	    "--layers", "1",	     "--window",
			 "16",	    "--budget-min", "0",	"--json",    NULL};
	rc = t_kvbench(argv3, NULL, &out, &errs);
	T_CHECK(rc == 0, "replay at p = 0.5 --json: exit %d, stderr: %s", rc, errs);
	t_json_stdout("--json", out, &j);
	double rm = jnum(&j, &j.nodes[1], "recall_mean");
	bud = jnum(&j, &j.nodes[1], "budget_mean");
	/* the 1-bit estimate of random vectors is rough: recall may fall short of p, but some mass
	 * is found with part of the budget */
	T_CHECK(rm > 0.1 && rm < 1 && bud > 0 && bud < 1,
		"p = 0.5: recall_mean %g (want in (0.1, 1)), budget_mean %g (want in (0, 1))", rm,
		bud);
	T_CHECK(jnum(&j, &j.nodes[1], "layers_replayed") == 1, "--layers 1: want one layer");
	/* the simulated hot cache: a step reads part of the rows; hit rates in [0, 1], never lower
	 * in a larger cache on these queries */
	const trace_json_node *hs = trace_json_get(&j, &j.nodes[1], "hot_sim");
	T_CHECK(hs, "--json: no hot_sim");
	const double dem = jnum(&j, hs, "demand_share");
	const trace_json_node *hr = trace_json_get(&j, hs, "hit_rate");
	T_CHECK(dem > 0 && dem < 1 && hr && hr->count == KB_HOT_SIZES,
		"hot_sim: demand_share %g (want in (0, 1)), %u hit rates (want %d)", dem,
		hr ? hr->count : 0, KB_HOT_SIZES);
	double prev = 0.0;
	for (uint32_t c = hr->child; c; c = j.nodes[c].next) {
		const double x = j.nodes[c].num;
		T_CHECK(j.nodes[c].type == TJ_NUMBER && x >= prev && x <= 1.0,
			"hot_sim: hit rate %g after %g (want non-decreasing, at most 1)", x, prev);
		prev = x;
	}
	/* the offline optimum: non-decreasing in the size, at least the rule's */
	const trace_json_node *ho = trace_json_get(&j, hs, "optimum_hit_rate");
	T_CHECK(ho && ho->count == KB_HOT_SIZES, "hot_sim: want %d optimum_hit_rate",
		KB_HOT_SIZES);
	prev = 0.0;
	for (uint32_t co = ho->child, cr = hr->child; co;
	     co = j.nodes[co].next, cr = j.nodes[cr].next) {
		const double o = j.nodes[co].num, r = j.nodes[cr].num;
		T_CHECK(j.nodes[co].type == TJ_NUMBER && o >= prev && o <= 1.0 && r <= o,
			"hot_sim: optimum %g after %g, the rule %g (want the optimum "
			"non-decreasing, at most 1, at least the rule's)", o, prev, r);
		prev = o;
	}
	/* the self-sized one: some share of the rows (it grows at the first step), a rate */
	const trace_json_node *ss = trace_json_get(&j, hs, "self_sized");
	T_CHECK(ss, "hot_sim: no self_sized");
	const double ssh = jnum(&j, ss, "share"), ssr = jnum(&j, ss, "hit_rate");
	T_CHECK(ssh > 0 && ssh <= 1 && ssr >= 0 && ssr <= 1,
		"hot_sim.self_sized: share %g (want in (0, 1]), hit_rate %g (want in [0, 1])", ssh,
		ssr);
	/* on demand alone: never larger than with the misses counted too */
	const trace_json_node *dm = trace_json_get(&j, ss, "demand_only");
	T_CHECK(dm, "hot_sim.self_sized: no demand_only");
	const double dsh = jnum(&j, dm, "share"), dsr = jnum(&j, dm, "hit_rate");
	T_CHECK(dsh > 0 && dsh <= ssh && dsr >= 0 && dsr <= 1,
		"hot_sim.self_sized.demand_only: share %g (want in (0, %g]), hit_rate %g (want in "
		"[0, 1])", dsh, ssh, dsr);
	trace_json_free(&j);
	free(out);
	free(errs);

	/* bad options: exit 2 naming the option */
	static const char *bad_opts[][3] = {{"--frobnicate", NULL, "--frobnicate"},
					    {"--p", "1.5", "--p"},
					    {"--backend", "tpu", "tpu"},
					    {"--layers", "7", "--layers"},
					    {"--layers", "1-0", "--layers"},
					    {"--window", "-3", "--window"},
					    {"stray", NULL, "stray"}};
	for (size_t i = 0; i < sizeof(bad_opts) / sizeof(bad_opts[0]); i++) {
		char *av[] = {"kvbench",
			      "--trace",
			      t.path,
			      (char *)bad_opts[i][0],
			      (char *)bad_opts[i][1],
			      NULL};
		rc = t_kvbench(av, NULL, &out, &errs);
		T_CHECK(rc == 2 && strstr(errs, bad_opts[i][2]),
			"option %s %s: exit %d, stderr '%s', want 2 naming '%s'", bad_opts[i][0],
			bad_opts[i][1] ? bad_opts[i][1] : "", rc, errs, bad_opts[i][2]);
		free(out);
		free(errs);
	}
	char *av_none[] = {"kvbench", "--json", "--trace", NULL};
	rc = t_kvbench(av_none, NULL, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--trace"), "no trace directory: exit %d, '%s'", rc, errs);
	free(out);
	free(errs);
	/* an option of the synthetic runs: refused, naming it */
	char *av_shape[] = {"kvbench", "--trace", t.path, "--context", "100", NULL};
	rc = t_kvbench(av_shape, NULL, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--context"), "--trace with --context: exit %d, '%s'", rc,
		errs);
	free(out);
	free(errs);

	/* a corrupted file: exit 1, the file named */
	poke(&t, "layer1.decode.k.npy", -1, 0x7e);
	rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer1.decode.k.npy") && strstr(errs, "NaN"),
		"corrupted trace: exit %d, stderr '%s', want 1 naming layer1.decode.k.npy", rc,
		errs);
	free(out);
	free(errs);
	truncate_file(&t, "layer0.prefill.q.npy", 1);
	rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer0.prefill.q.npy"),
		"truncated trace: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	remove_trace(&t);
}

/* float32 trace with a value float16 cannot hold: named, and bf16 replays it */
void test_replay_overflow(void **state)
{
	(void)state;
	tdir t;
	char err[ERRLEN], p[256], *out, *errs;
	make_trace(&t, TRACE_F32, 1, 40, 4, 9);
	trace_layer tl;
	T_CHECK(trace_load_layer(t.path, &t.m, 0, &tl, err, sizeof(err)) == 0, "%s", err);
	tl.prefill_v[5] = 1e6f;
	T_CHECK(trace_write_layer(t.path, &t.m, 0, &tl, err, sizeof(err)) == 0, "%s", err);
	trace_layer_free(&tl);
	char *argv[] = {"kvbench", "--trace", t.path,	  "--backend", "cpu",
			"--quiet", "--json",  "--window", "8",	       NULL};
	int rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rc == 1 && strstr(errs, "layer0.prefill.v.npy") && strstr(errs, "bf16"),
		"overflow: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	char *argv2[] = {"kvbench", "--trace",	t.path, "--backend", "cpu",  "--quiet",
			 "--json",  "--window", "8",	"--dtype",   "bf16", NULL};
	rc = t_kvbench(argv2, NULL, &out, &errs);
	T_CHECK(rc == 0, "bf16: exit %d, stderr '%s'", rc, errs);
	free(out);
	free(errs);
	path_of(&t, "meta.json", p, sizeof(p));
	remove_trace(&t);
}


/*
 * kvbench --json prints valid JSON whatever the bytes: a trace directory whose name is not UTF-8
 * (any bytes but '/' and NUL are a valid Linux name) comes out with U+FFFD in their place, and a
 * meta.json whose model name holds a surrogate is refused, naming the byte offset.
 */
void test_replay_utf8(void **state)
{
	(void)state;
	tdir t;
	char *out, *errs;
	make_trace(&t, TRACE_F16, 1, 40, 2, 9);
	char odd[sizeof t.path + 16];
	snprintf(odd, sizeof odd, "%s-\xff\xc0\xaf-\xc3\xa9", t.path);
	T_CHECK(rename(t.path, odd) == 0, "rename %s failed", t.path);
	char *argv[] = {"kvbench", "--trace", odd,  "--backend", "cpu", "--json",
			"--quiet", "--window", "8", NULL};
	int rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rename(odd, t.path) == 0, "rename back failed");
	size_t n = strlen(out), at = t_utf8_bad_at(out, n);
	T_CHECK(rc == 0 && at == n, "replay from a non-UTF-8 directory name: exit %d, stdout invalid "
		"UTF-8 at byte %zu of %zu (got 0x%02x, wanted none), stderr '%s'", rc, at, n,
		at < n ? (unsigned char)out[at] : 0, errs);
	trace_json j;
	char err[ERRLEN];
	T_CHECK(trace_json_parse(out, n, "stdout", &j, err, sizeof err) == 0, "--json: %s", err);
	const trace_json_node *dir =
		trace_json_get(&j, trace_json_get(&j, &j.nodes[1], "trace"), "dir");
	char want[sizeof odd + 16];
	snprintf(want, sizeof want, "%s-\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd-\xc3\xa9", t.path);
	T_CHECK(dir && dir->type == TJ_STRING && !strcmp(dir->str, want),
		"trace in the JSON: got '%s', wanted '%s'", dir && dir->str ? dir->str : "(none)",
		want);
	trace_json_free(&j);
	free(out);
	free(errs);

	edit_meta(&t, "random", "rand\xed\xa0\x80om");
	trace_meta m;
	rc = trace_open(t.path, &m, err, sizeof err);
	T_CHECK(rc == -EINVAL && strstr(err, "meta.json") && strstr(err, "invalid UTF-8 at byte offset"),
		"meta.json with a surrogate in the model name: rc %d, message '%s', wanted -EINVAL "
		"naming meta.json and the byte offset", rc, err);
	remove_trace(&t);
}

/* ---- a sweep over the selection's options ---------------------------------------------------- */

/* --trace with --sweep p=...,rescore=...: six points, each with the figures of the single replay
 * at its options (checked for one plain and one second-stage point), plain points whose budget in
 * bytes is their budget, and the three second-stage points against the p-sweep (two of them
 * inside its budgets at least: the third may lie past its largest; budget_min 0, so that the
 * short trace's budgets are the selection's, not the floor's). A shape axis is refused. */
void test_replay_sweep(void **state)
{
	(void)state;
	tdir t;
	char *out, *errs;
	trace_json j;
	make_trace(&t, TRACE_F16, 2, 300, 24, 3);
	char *argv[] = {"kvbench", "--trace", t.path,	  "--backend",	      "cpu",
			"--json",  "--quiet", "--window", "16",		      "--flush",
			"8",	   "--sinks", "4",	  "--chunk",	      "128",
			"--budget-min", "0",  "--sweep",  "p=0.5,0.7,0.9", "--sweep",
			"rescore=0,0.95", NULL};
	int rc = t_kvbench(argv, NULL, &out, &errs);
	T_CHECK(rc == 0, "trace sweep: exit %d, stderr: %s", rc, errs);
	t_json_stdout("--json output", out, &j);
	const trace_json_node *pts = trace_json_get(&j, &j.nodes[1], "points"),
			      *vs = trace_json_get(&j, &j.nodes[1], "vs_p_sweep");
	T_CHECK(pts && pts->count == 6 && vs && vs->count == 3,
		"want 6 points and 3 compared, got %u and %u", pts ? pts->count : 0,
		vs ? vs->count : 0);
	double p5[6], bud[6];
	uint32_t i = 0, inside = 0;
	for (uint32_t c = pts->child; c; c = j.nodes[c].next, i++) {
		p5[i] = jnum(&j, &j.nodes[c], "recall_p5");
		bud[i] = jnum(&j, &j.nodes[c], "budget_mean");
		if (jnum(&j, &j.nodes[c], "rescore") == 0)
			T_CHECK(jnum(&j, &j.nodes[c], "budget_bytes") == bud[i],
				"point %u: a plain point's bytes budget %g, its budget %g", i,
				jnum(&j, &j.nodes[c], "budget_bytes"), bud[i]);
	}
	for (uint32_t c = vs->child; c; c = j.nodes[c].next) {
		const trace_json_node *x = trace_json_get(&j, &j.nodes[c], "sweep_p5_at_rows");
		inside += x && x->type == TJ_NUMBER;
	}
	T_CHECK(inside >= 2, "want at least 2 methods inside the sweep's budgets, got %u", inside);
	free(out);
	free(errs);
	trace_json_free(&j);
	/* points 1 (p 0.7) and 4 (p 0.7, rescore 0.95): the single replays' figures */
	static char *const single[2][4] = {{"--p", "0.7", "--rescore", "0"},
					   {"--p", "0.7", "--rescore", "0.95"}};
	for (int k = 0; k < 2; k++) {
		char *av[] = {"kvbench",    "--trace",	  t.path,	"--backend", "cpu",
			      "--json",	    "--quiet",	  "--window",	"16",	     "--flush",
			      "8",	    "--sinks",	  "4",		"--chunk",   "128",
			      "--budget-min", "0",	  single[k][0], single[k][1], single[k][2],
			      single[k][3], NULL};
		rc = t_kvbench(av, NULL, &out, &errs);
		T_CHECK(rc == 0, "single replay: exit %d, stderr: %s", rc, errs);
		t_json_stdout("--json", out, &j);
		const uint32_t at = k ? 4 : 1;
		T_CHECK(jnum(&j, &j.nodes[1], "recall_p5") == p5[at] &&
				jnum(&j, &j.nodes[1], "budget_mean") == bud[at],
			"p 0.7 rescore %s: the sweep's point has p5 %.9g budget %.9g, the single "
			"replay %.9g and %.9g",
			single[k][3], p5[at], bud[at], jnum(&j, &j.nodes[1], "recall_p5"),
			jnum(&j, &j.nodes[1], "budget_mean"));
		trace_json_free(&j);
		free(out);
		free(errs);
	}
	/* crossed axes with a pair the second stage refuses (rescore 0.95 at p 0.95): that point is
	 * left out, saying so, and the others run */
	char *av_cross[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--json", "--quiet",
			    "--window", "16", "--flush", "8", "--sinks", "4", "--chunk", "128",
			    "--sweep", "p=0.5,0.95", "--sweep", "rescore=0,0.95", NULL};
	rc = t_kvbench(av_cross, NULL, &out, &errs);
	T_CHECK(rc == 0 && strstr(errs, "p 0.95, rescore 0.95 left out"),
		"crossed axes with a refused pair: exit %d, stderr '%s'", rc, errs);
	t_json_stdout("--json", out, &j);
	pts = trace_json_get(&j, &j.nodes[1], "points");
	T_CHECK(pts && pts->count == 3, "crossed axes: want 3 points, got %u",
		pts ? pts->count : 0);
	trace_json_free(&j);
	free(out);
	free(errs);
	/* the selection's hysteresis as an axis: its points carry keep and the simulated misses,
	 * and each is compared at equal misses too */
	char *av_keep[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--json", "--quiet",
			   "--window", "16", "--flush", "8", "--sinks", "4", "--chunk", "128",
			   "--budget-min", "0", "--sweep", "p=0.5,0.7,0.9", "--sweep", "keep=0,8",
			   NULL};
	rc = t_kvbench(av_keep, NULL, &out, &errs);
	T_CHECK(rc == 0, "keep sweep: exit %d, stderr: %s", rc, errs);
	t_json_stdout("--json", out, &j);
	pts = trace_json_get(&j, &j.nodes[1], "points");
	vs = trace_json_get(&j, &j.nodes[1], "vs_p_sweep");
	T_CHECK(pts && pts->count == 6 && vs && vs->count == 3,
		"keep sweep: want 6 points and 3 compared, got %u and %u", pts ? pts->count : 0,
		vs ? vs->count : 0);
	for (uint32_t c = pts->child; c; c = j.nodes[c].next) {
		const double m = jnum(&j, &j.nodes[c], "misses");
		T_CHECK(m >= 0 && m <= 1, "keep sweep: a point's misses %g", m);
	}
	for (uint32_t c = vs->child; c; c = j.nodes[c].next)
		T_CHECK(jnum(&j, &j.nodes[c], "keep") == 8 &&
				trace_json_get(&j, &j.nodes[c], "sweep_p5_at_misses"),
			"keep sweep: a compared point without keep 8 or sweep_p5_at_misses");
	trace_json_free(&j);
	free(out);
	free(errs);
	char *av_bad[] = {"kvbench", "--trace", t.path, "--sweep", "context=100,200", NULL};
	rc = t_kvbench(av_bad, NULL, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "the axes are the selection's"),
		"--trace with a shape axis: exit %d, '%s'", rc, errs);
	free(out);
	free(errs);
	remove_trace(&t);
}
