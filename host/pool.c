/* SPDX-License-Identifier: MIT */
/* The shared host-memory pool of the caches of one host (pool.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define POOL_MAGIC 0x6b7674706f6f6c31ull /* "kvtpool1" */

struct pool_slot {
	_Atomic int32_t pid;    /* 0: free; -1: being reclaimed */
	uint32_t pad;
	_Atomic uint64_t start; /* the holder's start time (/proc/<pid>/stat), against pid reuse */
	_Atomic uint64_t bytes;
};

struct kvt_pool_map {
	_Atomic uint64_t magic; /* stored last by the creator */
	uint64_t total;
	_Atomic uint64_t used;  /* sum of the slots' bytes */
	struct pool_slot slots[KVT_POOL_SLOTS];
};

/* start_of's answer when it cannot tell (no descriptor left, /proc unreadable): the holder is
 * taken as alive, so that its share is never given away from under it. */
#define START_UNKNOWN UINT64_MAX

/* Start time of process pid in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 when the
 * process does not exist or is dead: a zombie (state Z, or X) keeps its /proc entry until its
 * parent reaps it, but its memory, which its share paid for, is gone. START_UNKNOWN when the file
 * cannot be read for another reason. */
static uint64_t start_of(int32_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ESRCH ? 0 : START_UNKNOWN;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	const int e = errno;
	close(fd);
	if (n < 0 && e == ESRCH) /* it exited between the open and the read */
		return 0;
	if (n <= 0)
		return START_UNKNOWN;
	buf[n] = 0;
	/* the command name may hold spaces and parentheses: count fields after the last ')' */
	const char *p = strrchr(buf, ')');
	if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X')) /* field 3, the state */
		return 0;
	unsigned long long v = 0;
	for (int field = 2; p && *p; p++)
		if (*p == ' ' && ++field == 22)
			return sscanf(p + 1, "%llu", &v) == 1 ? v : 0;
	return 0;
}

/* Give back the slots of processes that no longer exist (or whose pid now names another). */
static void reclaim(struct kvt_pool_map *m)
{
	for (uint32_t i = 0; i < KVT_POOL_SLOTS; i++) {
		struct pool_slot *s = &m->slots[i];
		int32_t pid = atomic_load(&s->pid);
		if (pid <= 0) /* free, or being claimed or reclaimed */
			continue;
		const uint64_t start = start_of(pid);
		if (start == START_UNKNOWN || start == atomic_load(&s->start))
			continue;
		if (!atomic_compare_exchange_strong(&s->pid, &pid, -1))
			continue;
		atomic_fetch_sub(&m->used, atomic_exchange(&s->bytes, 0));
		atomic_store(&s->pid, 0);
	}
}

static int claim(struct kvt_pool *p, struct kvt_err *err)
{
	struct kvt_pool_map *m = p->map;
	const int32_t me = (int32_t)getpid();
	const uint64_t start = start_of(me);
	if (start == START_UNKNOWN || start == 0)
		return kvt_err_set(err, errno == EMFILE || errno == ENFILE ? -errno : -EIO,
				   "host pool %s: cannot read this process's start time from "
				   "/proc/self/stat (%s), which marks its share as its own",
				   p->name, strerror(errno));
	for (int pass = 0; pass < 2; pass++) {
		for (uint32_t i = 0; i < KVT_POOL_SLOTS; i++) {
			int32_t free_pid = 0;
			struct pool_slot *s = &m->slots[i];
			/* -1 while the slot is filled in: reclaim skips it until pid says whose */
			if (!atomic_compare_exchange_strong(&s->pid, &free_pid, -1))
				continue;
			atomic_store(&s->start, start);
			atomic_store(&s->bytes, 0);
			atomic_store(&s->pid, me);
			p->slot = i;
			return 0;
		}
		reclaim(m);
	}
	return kvt_err_set(err, -ENOSPC, "host pool %s: all %u slots are held by live caches",
			   p->name, KVT_POOL_SLOTS);
}

bool kvt_pool_name_ok(const char *name)
{
	size_t n = strlen(name);
	if (n == 0 || n > 48)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
		      (name[i] >= '0' && name[i] <= '9') || strchr("._-", name[i])))
			return false;
	return true;
}

static void nap_ms(long ms)
{
	struct timespec t = {0, ms * 1000000L};
	nanosleep(&t, NULL);
}

/* Create the pool object or open the one there, and map it. *created says which. */
static int open_map(struct kvt_pool *p, const char *shm, uint64_t total, bool *created,
		    struct kvt_err *err)
{
	int fd = shm_open(shm, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	*created = fd >= 0;
	if (fd < 0 && errno == EEXIST)
		fd = shm_open(shm, O_RDWR | O_CLOEXEC, 0600);
	if (fd < 0)
		return kvt_err_set(err, -errno, "host pool %s: shm_open(%s): %s", p->name, shm,
				   strerror(errno));
	struct stat st = {0};
	int rc = 0;
	if (*created && ftruncate(fd, sizeof *p->map) < 0)
		rc = kvt_err_set(err, -errno, "host pool %s: ftruncate: %s", p->name, strerror(errno));
	/* an opener waits for the creator's ftruncate */
	for (int i = 0; rc == 0 && !*created && i < 100; i++) {
		if (fstat(fd, &st) < 0)
			rc = kvt_err_set(err, -errno, "host pool %s: fstat: %s", p->name,
					 strerror(errno));
		else if ((size_t)st.st_size >= sizeof *p->map)
			break;
		nap_ms(10);
	}
	if (rc == 0 && !*created && (size_t)st.st_size < sizeof *p->map)
		rc = kvt_err_set(err, -EAGAIN, "host pool %s: %s has %lld bytes, not yet %zu", p->name,
				 shm, (long long)st.st_size, sizeof *p->map);
	void *m = rc == 0 ? mmap(NULL, sizeof *p->map, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
			  : MAP_FAILED;
	if (rc == 0 && m == MAP_FAILED)
		rc = kvt_err_set(err, -errno, "host pool %s: mmap: %s", p->name, strerror(errno));
	close(fd);
	if (rc < 0) {
		if (*created)
			shm_unlink(shm);
		return rc;
	}
	p->map = m;
	if (*created) {
		p->map->total = total;
		atomic_store(&p->map->magic, POOL_MAGIC);
	}
	return 0;
}

int kvt_pool_attach(struct kvt_pool *p, const char *name, uint64_t total, struct kvt_err *err)
{
	char shm[64];
	bool created = false;
	*p = (struct kvt_pool){0};
	if (!name || !kvt_pool_name_ok(name))
		return kvt_err_set(err, -EINVAL,
				   "host_pool = \"%s\": must be 1 to 48 characters of [A-Za-z0-9._-]",
				   name ? name : "(null)");
	snprintf(p->name, sizeof p->name, "%s", name);
	snprintf(shm, sizeof shm, "/kvtier.%s", name);
	if (total == 0) {
		int fd = shm_open(shm, O_RDONLY | O_CLOEXEC, 0);
		if (fd < 0)
			return kvt_err_set(err, -EINVAL,
					   "host_pool = \"%s\" does not exist and host_pool_bytes = 0: "
					   "the first cache of a pool gives its size",
					   name);
		close(fd);
	}
	int rc = open_map(p, shm, total, &created, err);
	if (rc < 0)
		return rc;
	for (int i = 0; i < 100 && atomic_load(&p->map->magic) != POOL_MAGIC; i++)
		nap_ms(10);
	if (atomic_load(&p->map->magic) != POOL_MAGIC)
		rc = kvt_err_set(err, -EAGAIN,
				 "host pool %s: /dev/shm%s is not initialized after 1 s (a creator "
				 "that died? remove the file)",
				 name, shm);
	else if (total && p->map->total != total)
		rc = kvt_err_set(err, -EINVAL,
				 "host_pool_bytes = %llu but host pool %s exists with %llu bytes",
				 (unsigned long long)total, name,
				 (unsigned long long)p->map->total);
	if (rc == 0)
		rc = claim(p, err);
	if (rc < 0) {
		munmap(p->map, sizeof *p->map);
		p->map = NULL;
	}
	return rc;
}

void kvt_pool_detach(struct kvt_pool *p)
{
	if (!p || !p->map)
		return;
	struct pool_slot *s = &p->map->slots[p->slot];
	atomic_fetch_sub(&p->map->used, atomic_exchange(&s->bytes, 0));
	atomic_store(&s->pid, 0);
	munmap(p->map, sizeof *p->map);
	p->map = NULL;
}

static int try_charge(struct kvt_pool_map *m, uint64_t bytes)
{
	uint64_t u = atomic_load(&m->used);
	while (u <= m->total && bytes <= m->total - u)
		if (atomic_compare_exchange_weak(&m->used, &u, u + bytes))
			return 1;
	return 0;
}

int kvt_pool_charge(struct kvt_pool *p, uint64_t bytes, struct kvt_err *err)
{
	struct kvt_pool_map *m = p ? p->map : NULL;
	if (!m)
		return 0;
	if (!try_charge(m, bytes)) {
		reclaim(m);
		if (!try_charge(m, bytes))
			return kvt_err_set(err, -ENOSPC,
					   "host pool %s full: %llu bytes needed, %llu of %llu used by "
					   "the caches sharing it",
					   p->name, (unsigned long long)bytes,
					   (unsigned long long)atomic_load(&m->used),
					   (unsigned long long)m->total);
	}
	atomic_fetch_add(&m->slots[p->slot].bytes, bytes);
	return 0;
}

void kvt_pool_uncharge(struct kvt_pool *p, uint64_t bytes)
{
	if (!p || !p->map)
		return;
	atomic_fetch_sub(&p->map->slots[p->slot].bytes, bytes);
	atomic_fetch_sub(&p->map->used, bytes);
}

void kvt_pool_reclaim(const struct kvt_pool *p)
{
	if (p && p->map)
		reclaim(p->map);
}

uint64_t kvt_pool_available(const struct kvt_pool *p)
{
	if (!p || !p->map)
		return UINT64_MAX;
	uint64_t u = atomic_load(&p->map->used);
	return u < p->map->total ? p->map->total - u : 0;
}

void kvt_pool_usage(const struct kvt_pool *p, uint64_t *total, uint64_t *used, uint64_t *mine)
{
	*total = *used = *mine = 0;
	if (!p || !p->map)
		return;
	*total = p->map->total;
	*used = atomic_load(&p->map->used);
	*mine = atomic_load(&p->map->slots[p->slot].bytes);
}
