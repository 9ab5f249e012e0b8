/* SPDX-License-Identifier: MIT */
/*
 * The corpus replayer shared by the fuzz targets fuzz_api.c and fuzz_nvme_block.c: without
 * -DKVT_LIBFUZZER, main() runs every file given on the command line (and every file in a directory
 * given) through LLVMFuzzerTestOneInput, the entry point libFuzzer calls, so `meson test` replays
 * the seed corpus under tests/fuzz_corpus/<name>/ with the same code and the same property checks.
 * Each input is copied into an allocation of its exact size, so a sanitizer sees any read past it.
 * The target defines FUZZ_NAME. A broken property aborts, as it does under libFuzzer.
 */
#ifndef KVT_FUZZ_REPLAY_H
#define KVT_FUZZ_REPLAY_H

#ifndef KVT_LIBFUZZER
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int replay_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	struct stat st;
	if (!f || fstat(fileno(f), &st)) {
		fprintf(stderr, "%s: cannot open %s\n", FUZZ_NAME, path);
		if (f)
			fclose(f);
		return 1;
	}
	size_t n = (size_t)st.st_size;
	uint8_t *b = malloc(n ? n : 1);
	if (!b || fread(b, 1, n, f) != n) {
		fprintf(stderr, "%s: cannot read %s\n", FUZZ_NAME, path);
		free(b);
		fclose(f);
		return 1;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(b, n);
	free(b);
	return 0;
}

int main(int argc, char **argv)
{
	int passed = 0, failed = 0;
	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
			DIR *d = opendir(argv[i]);
			for (struct dirent *e; d && (e = readdir(d));) {
				char p[4096];
				if (e->d_name[0] == '.')
					continue;
				snprintf(p, sizeof p, "%s/%s", argv[i], e->d_name);
				int rc = replay_file(p);
				failed += rc;
				passed += !rc;
			}
			if (d)
				closedir(d);
		} else {
			int rc = replay_file(argv[i]);
			failed += rc;
			passed += !rc;
		}
	}
	printf("%s: %d inputs replayed, %d unreadable\n", FUZZ_NAME, passed, failed);
	return failed || !passed;
}
#endif

#endif
