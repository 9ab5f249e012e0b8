/* SPDX-License-Identifier: MIT */
/*
 * kvbench's option parser and what its runs leave behind, through its entry point (kvbench_main,
 * as the executable calls it) in a child process on the CPU backend: values the library would
 * refuse, or that round to something else as a float, or that strtod/strtoull would take with a
 * leading space or '+', exit 2 naming the option; options that need another are refused; files
 * given with --nvme are kept and never overwritten; a failed sweep or replay removes the files it
 * created; the JSON carries the baselines, escapes the sweep's paths and says which stress modes
 * were skipped.
 */
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "trace_testutil.h"

/* The directory the child runs in: a stress probe or a default NVMe file lands there. */
static char work[] = "/tmp/kvt_kbopts_XXXXXX";

/* A small run's options, then up to 8 more (NULL-terminated) into av. */
static void args(char **av, char *const *more)
{
	static char *const small[] = {"kvbench", "--backend", "cpu", "--context", "512",
				      "--steps", "2", "--layers", "1", "--quiet", NULL};
	int n = 0;
	for (int i = 0; small[i]; i++)
		av[n++] = small[i];
	for (int i = 0; more[i]; i++)
		av[n++] = more[i];
	av[n] = NULL;
}

static bool exists(const char *path)
{
	return access(path, F_OK) == 0;
}

/* One refusal: the options after the small run's, and two strings stderr must hold. */
typedef struct refusal {
	char *argv[6];
	const char *want[2];
} refusal;

/* Exit 2 with stderr naming the option and the value, for each case. */
static void test_refused(void **state)
{
	(void)state;
	static const refusal cases[] = {
		/* a value that rounds to 0 as a float: the library would run its default */
		{{"--p", "1e-50"}, {"--p", "(0, 1]"}},
		{{"--rescore", "1e-50"}, {"--rescore", "1e-50"}},
		{{"--keep", "1e-50"}, {"--keep", "1e-50"}},
		/* values the library refuses, refused by name here */
		{{"--rescore", "0.5"}, {"--rescore", "0.5"}},
		{{"--p", "0.95", "--rescore", "0.95"}, {"--rescore", "0.95"}},
		{{"--sinks", "65537"}, {"--sinks", "65536"}},
		{{"--window", "65537"}, {"--window", "65536"}},
		{{"--flush", "65537"}, {"--flush", "65536"}},
		{{"--nvme", "kb-opts.img", "--nvme-bytes", "4095"}, {"--nvme-bytes", "4095"}},
		{{"--gpu-cache", "2T"}, {"--gpu-cache", "2T"}},
		/* leading space or '+' */
		{{"--context", " 600"}, {"--context", " 600"}},
		{{"--context", "+600"}, {"--context", "+600"}},
		{{"--seqs", "+1"}, {"--seqs", "+1"}},
		{{"--seed", " 1"}, {"--seed", " 1"}},
		{{"--p", " 0.5"}, {"--p", " 0.5"}},
		{{"--p", "+0.5"}, {"--p", "+0.5"}},
		{{"--rescore", "+0.95"}, {"--rescore", "+0.95"}},
		{{"--keep", "+1"}, {"--keep", "+1"}},
		{{"--host-bytes", " 80M"}, {"--host-bytes", " 80M"}},
		{{"--host-bytes", "+80M"}, {"--host-bytes", "+80M"}},
		{{"--run-fraction", " 0.5"}, {"--run-fraction", " 0.5"}},
		{{"--sweep", "p=+0.5"}, {"--sweep", "+0.5"}},
		/* the stress mode list */
		{{"--stress", "1", "--stress-mode", ""}, {"--stress-mode", "''"}},
		{{"--stress", "1", "--stress-mode", "many,"}, {"--stress-mode", "many,"}},
		{{"--stress-mode", "many"}, {"--stress-mode", "--stress"}},
		{{"--stress-mode", "bogus"}, {"--stress-mode", "bogus"}},
		/* an option alone, or one that needs another */
		{{"--bogus"}, {"unknown option", "--bogus"}},
		{{"--hot-log", "kb-opts.log"}, {"--hot-log", "--trace"}},
		{{"--sweep", "p=0.9", "--sweep", "p=0.8"}, {"--sweep", "twice"}},
		{{"--csv", "kb-opts.csv"}, {"--csv", "--sweep"}},
		{{"--csv", "kb-opts.csv", "--capacity", "--baselines"}, {"--csv", "--capacity"}},
	};
	int nfail = 0;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const refusal *c = &cases[i];
		char *av[24], *out, *errs;
		args(av, c->argv);
		int rc = t_kvbench(av, work, &out, &errs);
		T_SOFT(&nfail, rc == 2 && strstr(errs, c->want[0]) && strstr(errs, c->want[1]),
		       "case %zu (%s '%s' %s): exit %d, stderr '%s'; want 2 naming '%s' and '%s'", i,
		       c->argv[0], c->argv[1] ? c->argv[1] : "", c->argv[2] ? "..." : "", rc, errs,
		       c->want[0], c->want[1]);
		free(out);
		free(errs);
	}
	T_CHECK(nfail == 0, "%d refusals wrong", nfail);
}

/* Values at the edge that the parser takes (--help stops before anything runs). */
static void test_accepted(void **state)
{
	(void)state;
	static char *const cases[][4] = {
		{"--rescore", "0", "--help", NULL},   {"--rescore", "0.0", "--help", NULL},
		{"--sinks", "65536", "--help", NULL}, {"--nvme-bytes", "4096", "--help", NULL},
		{"--p", "1", "--help", NULL},         {"--keep", "0", "--help", NULL},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char *av[24], *out, *errs;
		args(av, cases[i]);
		int rc = t_kvbench(av, work, &out, &errs);
		T_CHECK(rc == 0, "%s %s: exit %d, stderr '%s'; want 0", cases[i][0], cases[i][1], rc,
			errs);
		free(out);
		free(errs);
	}
}

/* --nvme: a file the run creates is kept; a regular file that holds data is refused. */
static void test_nvme_files(void **state)
{
	(void)state;
	char img[128], *av[24], *out, *errs;
	snprintf(img, sizeof img, "%s/kept.img", work);
	args(av, (char *[]){"--nvme", img, NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	if (rc != 0 && strstr(errs, "(-95)")) {
		printf("# --nvme run skipped: no NVMe tier in this build or kernel\n");
	} else {
		T_CHECK(rc == 0, "--nvme %s: exit %d, stderr '%s'", img, rc, errs);
		T_CHECK(exists(img), "--nvme %s: the file the run created is gone", img);
	}
	free(out);
	free(errs);
	unlink(img);
	write_bytes(img, "precious\n", 9);
	rc = t_kvbench(av, work, &out, &errs);
	size_t n;
	unsigned char *b = read_bytes(img, &n);
	T_CHECK(rc == 2 && strstr(errs, img), "--nvme on a file with data: exit %d, stderr '%s'; "
		"want 2 naming the path", rc, errs);
	T_CHECK(n == 9 && !memcmp(b, "precious\n", 9), "--nvme: the file with data was changed");
	free(b);
	free(out);
	free(errs);
	unlink(img);
}

/* A sweep that fails removes the CSV it created and leaves one that was there; a path whose SVG
 * names would not fit is refused before anything runs; the JSON escapes the paths. */
static void test_sweep_files(void **state)
{
	(void)state;
	char csv[128], *av[24], *out, *errs;
	snprintf(csv, sizeof csv, "%s/fail.csv", work);
	args(av, (char *[]){"--sweep", "p=0.9,0.95", "--host-bytes", "1K", "--csv", csv, NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 1 && !exists(csv), "failed sweep: exit %d (want 1), %s left behind: %s", rc,
		csv, exists(csv) ? "yes" : "no");
	free(out);
	free(errs);
	write_bytes(csv, "old\n", 4);
	rc = t_kvbench(av, work, &out, &errs);
	size_t n;
	unsigned char *b = read_bytes(csv, &n);
	T_CHECK(rc == 1 && n == 4 && !memcmp(b, "old\n", 4),
		"failed sweep: exit %d, a CSV that was there changed (%zu bytes)", rc, n);
	free(b);
	free(out);
	free(errs);
	unlink(csv);

	static char longp[600];
	memset(longp, 'a', sizeof longp - 1);
	memcpy(longp, "/tmp/", 5);
	memcpy(longp + sizeof longp - 5, ".csv", 5);
	args(av, (char *[]){"--sweep", "p=0.9", "--csv", longp, NULL});
	rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--csv"), "--csv of %zu bytes: exit %d, stderr '%.200s'; "
		"want 2 naming --csv", strlen(longp), rc, errs);
	free(out);
	free(errs);

	char dir[128], q[160];
	snprintf(dir, sizeof dir, "%s/q\"d", work);
	T_CHECK(mkdir(dir, 0700) == 0, "mkdir %s failed", dir);
	snprintf(q, sizeof q, "%s/x.csv", dir);
	args(av, (char *[]){"--sweep", "p=0.9", "--csv", q, "--json", NULL});
	rc = t_kvbench(av, work, &out, &errs);
	trace_json j;
	T_CHECK(rc == 0, "sweep --csv '%s' --json: exit %d, stderr '%s'", q, rc, errs);
	t_json_stdout("sweep --csv --json", out, &j);
	const trace_json_node *c = trace_json_get(&j, &j.nodes[1], "csv");
	T_CHECK(c && c->type == TJ_STRING && !strcmp(c->str, q), "\"csv\" got '%s', want '%s'",
		c && c->str ? c->str : "(none)", q);
	trace_json_free(&j);
	free(out);
	free(errs);
	static const char *const suf[] = {"x.csv", "x-recall.svg", "x-stages.svg", "x-capacity.svg"};
	for (size_t i = 0; i < 4; i++) {
		snprintf(q, sizeof q, "%s/%s", dir, suf[i]);
		unlink(q);
	}
	rmdir(dir);
}

/* --baselines --json carries the baselines' figures. */
static void test_baselines_json(void **state)
{
	(void)state;
	char *av[24], *out, *errs;
	args(av, (char *[]){"--baselines", "--json", NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 0, "--baselines --json: exit %d, stderr '%s'", rc, errs);
	trace_json j;
	t_json_stdout("--baselines --json", out, &j);
	const trace_json_node *b = trace_json_get(&j, &j.nodes[1], "baselines");
	T_CHECK(b && b->type == TJ_OBJECT, "--baselines --json: no \"baselines\" object");
	static const char *const keys[] = {"oracle_topp_recall", "oracle_at_budget_budget",
					   "quest_recall", "quest_err"};
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		const trace_json_node *x = trace_json_get(&j, b, keys[i]);
		T_CHECK(x && x->type == TJ_NUMBER && x->num >= 0 && x->num <= 1,
			"baselines.%s: got %s %g, want a number in [0, 1]", keys[i],
			x ? "type" : "nothing", x ? x->num : 0.0);
	}
	trace_json_free(&j);
	free(out);
	free(errs);
}

/* needles_asked of a run of `steps` decode steps (the small shape). */
static double needles_asked(const char *steps)
{
	char *av[24], *out, *errs;
	args(av, (char *[]){"--steps", (char *)steps, "--json", NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 0, "--steps %s --json: exit %d, stderr '%s'", steps, rc, errs);
	trace_json j;
	t_json_stdout("--steps --json", out, &j);
	const trace_json_node *x = trace_json_get(&j, &j.nodes[1], "needles_asked");
	const double n = x && x->type == TJ_NUMBER ? x->num : -1;
	trace_json_free(&j);
	free(out);
	free(errs);
	return n;
}

/*
 * Figures at the edges: a context within sinks + window indexes no token, so the oracle's figures
 * are null in the JSON and "-" in the table, never nan; with fewer decode steps than needles per
 * KV head, every needle is still asked for once.
 */
static void test_edge_figures(void **state)
{
	(void)state;
	char *av[24], *out, *errs;
	args(av, (char *[]){"--context", "50", "--steps", "3", NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 0 && !strstr(out, "nan") && strstr(out, "no token was indexed"),
		"--context 50: exit %d, stdout '%s'; want 0, no nan, the budget line saying why", rc,
		out);
	free(out);
	free(errs);
	args(av, (char *[]){"--context", "50", "--steps", "3", "--json", NULL});
	rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 0, "--context 50 --json: exit %d, stderr '%s'", rc, errs);
	trace_json j;
	t_json_stdout("--context 50 --json", out, &j);
	const trace_json_node *h = trace_json_get(&j, &j.nodes[1], "heads");
	static const char *const keys[] = {"oracle_budget_min", "oracle_budget_median",
					   "oracle_budget_max"};
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		const trace_json_node *x = h ? trace_json_get(&j, h, keys[i]) : NULL;
		T_CHECK(x && x->type == TJ_NULL, "--context 50: heads.%s got %s %g, want null",
			keys[i], x ? "a number" : "nothing", x ? x->num : 0.0);
	}
	trace_json_free(&j);
	free(out);
	free(errs);
	const double four = needles_asked("4");
	for (int s = 1; s < 4; s++) {
		char steps[4] = {(char)('0' + s), 0};
		const double n = needles_asked(steps);
		T_CHECK(four > 0 && n == four, "needles_asked with %d decode steps: got %g, want %g "
			"(4 steps')", s, n, four);
	}
}

/* A stress mode skipped for want of an NVMe tier says so on stderr and in the JSON. */
static void test_stress_skipped(void **state)
{
	(void)state;
	char probe[128], *av[24], *out, *errs;
	snprintf(probe, sizeof probe, "%s/kvbench-probe.img", work);
	write_bytes(probe, "x", 1);
	args(av, (char *[]){"--stress", "1", "--stress-mode", "spill", "--json", NULL});
	int rc = t_kvbench(av, work, &out, &errs);
	unlink(probe);
	T_CHECK(rc == 0 && strstr(errs, "spill"), "stress, spill skipped: exit %d, stderr '%s'; "
		"want 0 and a message naming spill", rc, errs);
	trace_json j;
	t_json_stdout("stress --json", out, &j);
	const trace_json_node *s = trace_json_get(&j, &j.nodes[1], "modes_skipped");
	T_CHECK(s && s->type == TJ_ARRAY && s->count == 1 && !strcmp(j.nodes[s->child].str, "spill"),
		"stress --json: modes_skipped got %u entries, want [\"spill\"]", s ? s->count : 0);
	trace_json_free(&j);
	free(out);
	free(errs);
}

/* A replay that fails at a later layer removes its --hot-log; the text names the cache's sets. */
static void test_trace_files(void **state)
{
	(void)state;
	tdir t;
	make_trace(&t, TRACE_F16, 2, 300, 8, 5);
	char log[128], *out, *errs;
	snprintf(log, sizeof log, "%s/hot.log", work);
	char *av_ok[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--quiet", NULL};
	int rc = t_kvbench(av_ok, work, &out, &errs);
	T_CHECK(rc == 0 && strstr(out, "ways") && !strstr(out, "fully associative"),
		"trace text: exit %d; want the sets of ways named, not 'fully associative':\n%s", rc,
		out);
	free(out);
	free(errs);
	char *av_l[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--quiet", "--layers",
			" 0", NULL};
	rc = t_kvbench(av_l, work, &out, &errs);
	T_CHECK(rc == 2 && strstr(errs, "--layers"), "--layers ' 0': exit %d, stderr '%s'", rc,
		errs);
	free(out);
	free(errs);
	poke(&t, "layer1.decode.k.npy", -1, 0x7e); /* a NaN in layer 1's last key */
	char *av[] = {"kvbench", "--trace", t.path, "--backend", "cpu", "--quiet", "--hot-log", log,
		      NULL};
	rc = t_kvbench(av, work, &out, &errs);
	T_CHECK(rc == 1 && !exists(log), "replay failing at layer 1: exit %d (want 1), hot log %s",
		rc, exists(log) ? "left behind" : "removed");
	free(out);
	free(errs);
	unlink(log);
	remove_trace(&t);
}

static int make_work(void **state)
{
	(void)state;
	return mkdtemp(work) ? 0 : -1;
}

static int remove_work(void **state)
{
	(void)state;
	return rmdir(work);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_refused),	      cmocka_unit_test(test_accepted),
		cmocka_unit_test(test_nvme_files),     cmocka_unit_test(test_sweep_files),
		cmocka_unit_test(test_baselines_json),
		cmocka_unit_test(test_edge_figures), cmocka_unit_test(test_stress_skipped),
		cmocka_unit_test(test_trace_files),
	};
	return cmocka_run_group_tests(tests, make_work, remove_work);
}
