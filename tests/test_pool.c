/* SPDX-License-Identifier: MIT */
/*
 * The shared host pool (kvt_config.host_pool, host/pool.c): caches of one process and of two
 * processes draw their host tiers from one budget; a cache that would pass it fails with -ENOSPC
 * naming the pool and changes nothing; the bytes come back at destroy, and those of a process that
 * died without destroying its cache come back to the next cache that needs them; a bad name, a size
 * that disagrees with the existing pool and a pool that does not exist are refused by name.
 * Extents here are as large as the 2 MiB host tier (32 blocks of 64 KiB: head_dim 64, 1 KV head).
 */
#include "common.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1ull << 20)
#define BLOCK_TOKENS 256u /* KVT_BLOCK_TOKENS: one 64 KiB block of this shape */

static char pool_name[64];

static void pool_unlink(void)
{
	char shm[80];
	snprintf(shm, sizeof shm, "/kvtier.%s", pool_name);
	shm_unlink(shm);
}

static kvt_config pool_config(uint64_t pool_bytes)
{
	kvt_config cfg = t_config(1, 1, 1, 64, KVT_DTYPE_F16);
	cfg.host_bytes = 2 * MIB;
	cfg.host_pool = pool_name;
	cfg.host_pool_bytes = pool_bytes;
	return cfg;
}

/* Prefill `tokens` random tokens into a new sequence of c; returns kvt_prefill's code. */
static int fill(kvt_cache *c, uint32_t tokens, uint64_t seed)
{
	t_rng r;
	t_rng_seed(&r, seed);
	uint16_t *k = t_alloc(sizeof *k * tokens * 64), *v = t_alloc(sizeof *v * tokens * 64);
	for (size_t i = 0; i < (size_t)tokens * 64; i++) {
		k[i] = t_f2h((float)t_normal(&r));
		v[i] = t_f2h((float)t_normal(&r));
	}
	uint32_t s;
	int rc = kvt_seq_open(c, &s);
	if (rc == 0)
		rc = kvt_prefill(c, s, 0, NULL, k, v, tokens, NULL);
	free(k);
	free(v);
	return rc;
}

static kvt_stats stats_of(kvt_cache *c)
{
	kvt_stats st = {.size = sizeof st};
	T_CHECK(kvt_get_stats(c, &st) == 0, "kvt_get_stats: %s", kvt_last_error(c));
	return st;
}

static void test_two_caches(void **state)
{
	(void)state;
	kvt_config cfg = pool_config(3 * MIB);
	kvt_cache *a = t_create(&cfg);
	cfg.host_pool_bytes = 0; /* the pool exists: its size is taken */
	kvt_cache *b = t_create(&cfg);
	T_CHECK(fill(a, 24 * BLOCK_TOKENS, 1) == 0, "a's prefill: %s", kvt_last_error(a));
	kvt_stats sa = stats_of(a);
	T_CHECK(sa.host_pool_bytes == 3 * MIB && sa.host_pool_used == 2 * MIB &&
			sa.host_pool_mine == 2 * MIB,
		"a's stats: pool %llu used %llu mine %llu, wanted 3 MiB, 2 MiB, 2 MiB",
		(unsigned long long)sa.host_pool_bytes, (unsigned long long)sa.host_pool_used,
		(unsigned long long)sa.host_pool_mine);
	/* b has 2 MiB of its own, but only 1 MiB is left in the pool */
	int rc = fill(b, 24 * BLOCK_TOKENS, 2);
	T_CHECK(rc == -ENOSPC && strstr(kvt_last_error(b), "host pool") &&
			strstr(kvt_last_error(b), pool_name),
		"b's prefill past the pool: got %d (%s), wanted -ENOSPC naming host pool %s", rc,
		kvt_last_error(b), pool_name);
	kvt_stats sb = stats_of(b);
	T_CHECK(sb.tokens == 0 && sb.host_bytes_used == 0,
		"b after the failed prefill: %llu tokens, %llu host bytes used, wanted none",
		(unsigned long long)sb.tokens, (unsigned long long)sb.host_bytes_used);
	T_CHECK(fill(b, 16 * BLOCK_TOKENS, 3) == 0, "b's prefill within the pool: %s",
		kvt_last_error(b));
	kvt_cache_destroy(a);
	sb = stats_of(b);
	T_CHECK(sb.host_pool_used == sb.host_pool_mine && sb.host_pool_mine == MIB,
		"after a's destroy: pool used %llu, b's %llu, wanted 1 MiB both",
		(unsigned long long)sb.host_pool_used, (unsigned long long)sb.host_pool_mine);
	T_CHECK(fill(b, 8 * BLOCK_TOKENS, 4) == 0, "b's prefill after a's destroy: %s",
		kvt_last_error(b));
	kvt_cache_destroy(b);
	pool_unlink();
}

/*
 * A live cache's share stays charged when /proc cannot be read: with every descriptor in use a
 * reclaim (here from kvt_get_capacity, and from a charge that finds the pool short) cannot tell
 * whether a holder lives, and leaves it be. Before, the unreadable /proc/<pid>/stat meant "gone":
 * a's 2 MiB were uncharged while a still held them, and b could take them again.
 */
static void test_unreadable_proc(void **state)
{
	(void)state;
	kvt_config cfg = pool_config(2 * MIB); /* a fills it: a reclaim is tried when it is full */
	cfg.host_bytes = 8 * MIB; /* and a could take more than the pool has left */
	kvt_cache *a = t_create(&cfg);
	T_CHECK(fill(a, 24 * BLOCK_TOKENS, 5) == 0, "a's prefill: %s", kvt_last_error(a));
	struct rlimit old, low;
	T_CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0, "getrlimit: %s", strerror(errno));
	low = old;
	low.rlim_cur = old.rlim_cur < 1024 ? old.rlim_cur : 1024; /* so that filling it is quick */
	T_CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0, "setrlimit: %s", strerror(errno));
	int *fds = t_alloc(sizeof *fds * 1024), n = 0, fd;
	while (n < 1024 && (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
		fds[n++] = fd;
	const int e = errno;
	kvt_capacity cap = {.size = sizeof cap};
	const int rc = kvt_get_capacity(a, &cap);
	for (int i = 0; i < n; i++)
		close(fds[i]);
	free(fds);
	T_CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit back: %s", strerror(errno));
	T_CHECK(rc == 0 && (e == EMFILE || e == ENFILE), "kvt_get_capacity with no descriptor left "
		"(%d opened, then %s): %d (%s)", n, strerror(e), rc, kvt_last_error(a));
	kvt_stats sa = stats_of(a);
	T_CHECK(sa.host_pool_used == 2 * MIB && sa.host_pool_mine == 2 * MIB,
		"a's share after a reclaim that could not read /proc: pool used %llu, a's %llu; "
		"wanted 2 MiB both", (unsigned long long)sa.host_pool_used,
		(unsigned long long)sa.host_pool_mine);
	cfg.host_pool_bytes = 0;
	kvt_cache *b = t_create(&cfg);
	const int rb = fill(b, 8 * BLOCK_TOKENS, 6);
	T_CHECK(rb == -ENOSPC, "b's prefill beside a, which fills the pool: got %d (%s), wanted "
		"-ENOSPC", rb, kvt_last_error(b));
	kvt_cache_destroy(b);
	kvt_cache_destroy(a);
	pool_unlink();
}

/* A process that dies holding 2 MiB of the pool gives them back to the next charge that finds the
 * pool short: reaped, and also while it is a zombie its parent has not reaped yet (its memory is
 * gone; before, the zombie's /proc entry kept its share charged until the wait). */
static void test_dead_process(void **state)
{
	(void)state;
	for (int zombie = 0; zombie < 2; zombie++) {
		kvt_config cfg = pool_config(3 * MIB);
		kvt_cache *a = t_create(&cfg);
		pid_t pid = fork();
		T_CHECK(pid >= 0, "fork failed");
		if (pid == 0) {
			kvt_cache *c = NULL;
			if (kvt_cache_create(&cfg, &c) < 0 || fill(c, 24 * BLOCK_TOKENS, 5) < 0)
				_exit(1);
			_exit(0);
		}
		siginfo_t info = {0};
		/* WNOWAIT: the child has exited but stays a zombie until the waitpid below */
		T_CHECK(waitid(P_PID, (id_t)pid, &info, WEXITED | (zombie ? WNOWAIT : 0)) == 0 &&
				info.si_code == CLD_EXITED && info.si_status == 0,
			"child: code %d status %d", info.si_code, info.si_status);
		const char *how = zombie ? "the unreaped (zombie) child" : "the reaped child";
		kvt_stats sa = stats_of(a);
		T_CHECK(sa.host_pool_used == 2 * MIB && sa.host_pool_mine == 0,
			"after %s died: pool used %llu, a's %llu, wanted the child's 2 MiB and 0", how,
			(unsigned long long)sa.host_pool_used, (unsigned long long)sa.host_pool_mine);
		T_CHECK(fill(a, 24 * BLOCK_TOKENS, 6) == 0, "a's prefill needing the bytes of %s: %s",
			how, kvt_last_error(a));
		sa = stats_of(a);
		T_CHECK(sa.host_pool_used == 2 * MIB && sa.host_pool_mine == 2 * MIB,
			"after reclaiming from %s: pool used %llu, a's %llu, wanted 2 MiB both", how,
			(unsigned long long)sa.host_pool_used, (unsigned long long)sa.host_pool_mine);
		if (zombie)
			waitpid(pid, NULL, 0);
		kvt_cache_destroy(a);
		pool_unlink();
	}
}

static void create_fails(const char *what, const kvt_config *cfg, const char *needle)
{
	kvt_cache *c = NULL;
	int rc = kvt_cache_create(cfg, &c);
	T_CHECK(rc == -EINVAL && c == NULL && strstr(kvt_last_error(NULL), needle),
		"%s: got %d (%s), wanted -EINVAL naming %s", what, rc, kvt_last_error(NULL), needle);
}

static void test_refusals(void **state)
{
	(void)state;
	kvt_config cfg = pool_config(0);
	create_fails("a pool that does not exist, no size", &cfg, "does not exist");
	cfg = pool_config(3 * MIB);
	cfg.host_pool = "no/slash";
	create_fails("a bad name", &cfg, "no/slash");
	cfg = pool_config(3 * MIB);
	cfg.host_pool = NULL;
	create_fails("a size without a pool", &cfg, "host_pool_bytes");
	cfg = pool_config(3 * MIB);
	kvt_cache *a = t_create(&cfg);
	cfg.host_pool_bytes = 4 * MIB;
	create_fails("a size that disagrees", &cfg, "3145728");
	kvt_cache_destroy(a);
	pool_unlink();
}

int main(void)
{
	snprintf(pool_name, sizeof pool_name, "test-pool-%d", (int)getpid());
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_refusals),
		cmocka_unit_test(test_two_caches),
		cmocka_unit_test(test_dead_process),
		cmocka_unit_test(test_unreadable_proc),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
