/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target of the trace parsers (tools/trace.c): every input goes through the .npy parser, the
 * JSON parser and the meta.json checks. The properties: no crash, no read outside the input, no
 * leak, and an error always comes with a message.
 *
 * Built with -DKVT_LIBFUZZER and -fsanitize=fuzzer (clang) it is a libFuzzer target. Otherwise a
 * main() replays files and directories given on the command line through the same entry point,
 * which is how `meson test` runs the corpus in tests/fuzz_corpus/trace/. There, seeds named ok-*
 * must parse as a .npy file or as meta.json, and seeds named bad-* must be rejected by both.
 */
#include "trace.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Bit 0: the .npy parser accepted the input; bit 1: the meta.json checks accepted it. */
static int parse_all(const uint8_t *data, size_t size)
{
	char err[512];
	int ok = 0;
	trace_npy x;
	err[0] = 0;
	if (trace_npy_parse(data, size, "fuzz.npy", &x, err, sizeof(err)) == 0) {
		/* touch every byte the parser says is data */
		const uint8_t *p = x.data;
		size_t n = (size_t)x.count * (x.dtype == TRACE_F16 ? 2 : 4);
		volatile uint8_t sum = 0;
		for (size_t i = 0; i < n; i++)
			sum = (uint8_t)(sum + p[i]);
		ok |= 1;
	} else if (!err[0]) {
		abort();
	}
	trace_json j;
	err[0] = 0;
	if (trace_json_parse((const char *)data, size, "fuzz.json", &j, err, sizeof(err)) == 0)
		trace_json_free(&j);
	else if (!err[0])
		abort();
	trace_meta m;
	err[0] = 0;
	if (trace_meta_parse((const char *)data, size, "meta.json", &m, err, sizeof(err)) == 0)
		ok |= 2;
	else if (!err[0])
		abort();
	return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	parse_all(data, size);
	return 0;
}

#ifndef KVT_LIBFUZZER
static int failed, passed;

static void run_file(const char *path, const char *base)
{
	FILE *f = fopen(path, "rb");
	struct stat st;
	if (!f || fstat(fileno(f), &st)) {
		fprintf(stderr, "fuzz_trace: cannot open %s\n", path);
		failed++;
		if (f)
			fclose(f);
		return;
	}
	size_t n = (size_t)st.st_size;
	/* an exact-size allocation, so that a sanitizer sees any read past the end */
	uint8_t *b = malloc(n ? n : 1);
	if (!b || fread(b, 1, n, f) != n) {
		fprintf(stderr, "fuzz_trace: cannot read %s\n", path);
		failed++;
		free(b);
		fclose(f);
		return;
	}
	fclose(f);
	int ok = parse_all(b, n);
	LLVMFuzzerTestOneInput(b, n);
	free(b);
	if ((!strncmp(base, "ok-", 3) && !ok) || (!strncmp(base, "bad-", 4) && ok)) {
		fprintf(stderr, "fuzz_trace: %s: %s, want %s\n", path, ok ? "accepted" : "rejected",
			ok ? "rejected" : "accepted");
		failed++;
	} else {
		passed++;
	}
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
			DIR *d = opendir(argv[i]);
			struct dirent *e;
			while (d && (e = readdir(d))) {
				char p[4096];
				if (e->d_name[0] == '.')
					continue;
				snprintf(p, sizeof(p), "%s/%s", argv[i], e->d_name);
				run_file(p, e->d_name);
			}
			if (d)
				closedir(d);
		} else {
			const char *base = strrchr(argv[i], '/');
			run_file(argv[i], base ? base + 1 : argv[i]);
		}
	}
	printf("%d passed, %d failed\n", passed, failed);
	return failed || !passed;
}
#endif
