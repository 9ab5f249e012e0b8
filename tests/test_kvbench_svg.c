/* SPDX-License-Identifier: MIT */
/*
 * kvbench's SVG plots (tools/kvbench_svg.c) are well-formed: written from a few sweep results,
 * every element opened is closed in order, and each file has one <svg> root.
 */
/* before common.h: cmocka defines a fail() macro, kvbench.h declares a function of that name */
#include "kvbench.h"

#include "common.h"

/* Balanced tags: a stack of names; comments, the XML declaration and self-closing tags skipped. */
static int check_file(const char *path, char *why, size_t n)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return snprintf(why, n, "cannot open"), -1;
	static char text[1 << 20];
	size_t len = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[len] = 0;
	char stack[64][32];
	int depth = 0, roots = 0;
	for (char *p = text; (p = strchr(p, '<')); p++) {
		char *end = strchr(p, '>');
		if (!end)
			return snprintf(why, n, "unterminated tag"), -1;
		if (p[1] == '?' || p[1] == '!')
			continue;
		bool close = p[1] == '/', self = end[-1] == '/';
		char name[32];
		sscanf(p + 1 + close, "%31[a-zA-Z0-9]", name);
		if (close) {
			if (!depth || strcmp(stack[depth - 1], name))
				return snprintf(why, n, "</%s> closes %s", name,
						depth ? stack[depth - 1] : "nothing"), -1;
			depth--;
		} else if (!self) {
			if (depth == 64)
				return snprintf(why, n, "too deep"), -1;
			roots += depth == 0;
			snprintf(stack[depth++], 32, "%s", name);
		}
		if (strchr(p + 1, '<') && strchr(p + 1, '<') < end)
			return snprintf(why, n, "'<' inside a tag"), -1;
	}
	if (depth || roots != 1)
		return snprintf(why, n, "depth %d at the end, %d roots", depth, roots), -1;
	return 0;
}

static void test_svg_balanced(void **state)
{
	(void)state;
	kb_result r[4];
	memset(r, 0, sizeof(r));
	for (int i = 0; i < 4; i++) {
		r[i].context = 2048u << (i % 2);
		r[i].seqs = 1;
		r[i].p = 0.8f + 0.05f * i;
		r[i].topk = i == 3 ? 128 : 0;
		r[i].budget = 0.2 + 0.1 * i;
		r[i].recall = 0.9 + 0.02 * i;
		for (int k = 0; k < KB_N_BASE; k++) {
			r[i].base_budget[k] = r[i].budget + 0.01 * k;
			r[i].base_recall[k] = r[i].recall - 0.02 * k;
		}
		for (int s = 0; s < 5; s++)
			r[i].stage_ms[s] = 1.0 + s + i;
		r[i].plan.kvt_seqs = 300 + i;
		r[i].plan.full_seqs = 16;
	}
	char names[3][512] = {"svgtest-recall.svg", "svgtest-stages.svg", "svgtest-capacity.svg"};
	T_CHECK(svg_write_all("svgtest.csv", r, 4, names) == 0, "svg_write_all failed");
	for (int i = 0; i < 3; i++) {
		char why[128] = "";
		int rc = check_file(names[i], why, sizeof why);
		T_CHECK(rc == 0, "%s: not well-formed: %s", names[i], why);
		remove(names[i]);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_svg_balanced)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
