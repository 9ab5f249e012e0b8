/* SPDX-License-Identifier: MIT */
/*
 * The NVMe tier is optional: where it cannot work (built without liburing, or a kernel that refuses
 * io_uring), asking for it fails with -EOPNOTSUPP and a message that says why, and everything else
 * works. Where the tier does work this checks the other side: the same config creates a cache.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

static void test_tier_optional(void **state)
{
	(void)state;
	struct kvt_err why;
	int available = kvt_nvme_available(&why);
	char path[] = "kvt-optional-XXXXXX";
	int fd = mkstemp(path);
	T_CHECK(fd >= 0, "mkstemp in the working directory failed");
	close(fd);
	const char *paths[1] = { path };
	const uint64_t bytes[1] = { 8u << 20 };
	kvt_config cfg = t_config(1, 4, 2, 64, KVT_DTYPE_F16);
	cfg.nvme_paths = paths;
	cfg.nvme_bytes = bytes;
	cfg.n_nvme = 1;
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(&cfg, &c);
	if (available) {
		T_CHECK(rc == 0, "NVMe tier available (%s) but create returned %d: %s", why.msg, rc,
			kvt_last_error(NULL));
	} else {
		T_CHECK(rc == -EOPNOTSUPP, "NVMe tier unavailable (%s): create returned %d, wanted %d",
			why.msg, rc, -EOPNOTSUPP);
		T_CHECK(strstr(kvt_last_error(NULL), why.msg) != NULL,
			"message \"%s\" does not give the reason \"%s\"", kvt_last_error(NULL), why.msg);
		/* everything else works: the same cache without the tier */
		cfg.n_nvme = 0;
		c = t_create(&cfg);
	}
	uint32_t seq;
	T_CHECK(kvt_seq_open(c, &seq) == 0, "seq_open: %s", kvt_last_error(c));
	if (!available) {
		int64_t r = kvt_seq_spill(c, seq);
		T_CHECK(r == -EOPNOTSUPP, "spill without a tier returned %lld, wanted %d", (long long)r,
			-EOPNOTSUPP);
		T_CHECK(strstr(kvt_last_error(c), "n_nvme") != NULL,
			"spill's message \"%s\" does not name n_nvme", kvt_last_error(c));
	}
	kvt_cache_destroy(c);
	unlink(path);
}

int main(void)
{
	const struct CMUnitTest tests[] = { cmocka_unit_test(test_tier_optional) };
	return cmocka_run_group_tests(tests, NULL, NULL);
}
