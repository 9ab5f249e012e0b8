/* SPDX-License-Identifier: MIT */
/*
 * The tiers of kvbench's cache and the --capacity experiment. Host-tier sizes are whole blocks
 * (KB_BLOCK_TOKENS tokens of one layer and KV head, K then V, 2 bytes per element), the unit in
 * which the library allocates rows and spills them.
 *
 * --capacity runs four phases over sequences whose K/V is about three times the host tier:
 *   fill             prefill the sequences one after another; with --spill lru the cache spills
 *                    the older ones itself when the host tier is full
 *   decode_spilled   decode every sequence together: the spilled ones are served from NVMe
 *   restore          kvt_seq_restore of the least recently used sequence (the cache spills others
 *                    to make room)
 *   decode_restored  decode every sequence together again
 */
#include "kvbench.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t block_bytes(const kb_run *b)
{
	return (uint64_t)KB_BLOCK_TOKENS * 2 * b->d * 2;
}

static uint64_t blocks_for(uint64_t tokens)
{
	return (tokens + KB_BLOCK_TOKENS - 1) / KB_BLOCK_TOKENS;
}

/* Host-tier bytes of one sequence holding `tokens` tokens on every layer. */
static uint64_t seq_bytes(const kb_run *b, uint64_t tokens)
{
	return blocks_for(tokens) * b->o.layers * b->o.kv_heads * block_bytes(b);
}

uint64_t tier_kv_bytes(const kb_run *b)
{
	return b->o.seqs * seq_bytes(b, b->cap);
}

/*
 * Host bytes a spilled sequence keeps: only blocks whose tokens are all sinks or indexed are
 * spilled, so per layer and KV head the window (up to window + flush - 1 tokens not yet indexed)
 * and the block it starts in stay.
 */
static uint64_t resident_bytes(const kb_run *b)
{
	uint64_t blocks = blocks_for((uint64_t)b->o.window + b->o.flush) + 1;
	return blocks * b->o.layers * b->o.kv_heads * block_bytes(b);
}

static uint64_t host_default(const kb_run *b)
{
	const opts *o = &b->o;
	if (!o->capacity)
		return host_bytes_ample(b->cap, (uint64_t)o->seqs * o->layers, o->kv_heads,
					o->head_dim);
	/*
	 * A third of the K/V, so that most of it must live on NVMe; but at least one whole sequence
	 * next to what the others keep when spilled, since a prefill cannot spill the sequence it
	 * fills and a restored sequence comes back whole.
	 */
	uint64_t third = (tier_kv_bytes(b) + 2) / 3;
	uint64_t least = seq_bytes(b, b->cap) + (o->seqs - 1) * resident_bytes(b);
	uint64_t host = third > least ? third : least;
	return (host + block_bytes(b) - 1) / block_bytes(b) * block_bytes(b);
}

/* Every sequence's K/V at once, over the files. */
static uint64_t nvme_default(const kb_run *b)
{
	return nvme_bytes_ample(tier_kv_bytes(b), b->o.n_nvme);
}

uint64_t tier_sizes(kb_run *b)
{
	const opts *o = &b->o;
	if (o->nvme_own && access(KB_NVME_DEFAULT, F_OK) == 0)
		fail(KB_NVME_DEFAULT " exists in the current directory",
		     "kvbench does not overwrite it: remove it or give --nvme");
	for (uint32_t i = 0; i < o->n_nvme; i++)
		b->nvme_sizes[i] = o->nvme_bytes ? o->nvme_bytes : nvme_default(b);
	return o->host_bytes ? o->host_bytes : host_default(b);
}

void tier_created(const void *ctx)
{
	const opts *o = ctx;
	/* The cache keeps its descriptor: the space stays usable until kvt_cache_destroy. */
	if (o->nvme_own && unlink(KB_NVME_DEFAULT) != 0 && errno != ENOENT)
		fprintf(stderr, "kvbench: cannot remove %s: %s\n", KB_NVME_DEFAULT, strerror(errno));
}

/* ---- making room ------------------------------------------------------------------------- */

static void snap(kb_run *b, kvt_stats *st)
{
	st->size = sizeof(*st);
	int rc = kvt_get_stats(b->cache, st);
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_get_stats");
}

static uint64_t host_free(kb_run *b)
{
	kvt_stats st;
	snap(b, &st);
	return st.host_bytes_capacity - st.host_bytes_used;
}

static void spill_seq(kb_run *b, uint32_t s)
{
	uint64_t t = now_ns();
	int64_t rc = kvt_seq_spill(b->cache, b->ids[s]);
	b->ns_lib += now_ns() - t;
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_seq_spill");
}

/* Spill the least recently used sequences other than `keep` (an index into ids, or UINT32_MAX)
 * until `need` bytes of the host tier are free. */
static void make_room(kb_run *b, uint64_t need, uint32_t keep, const char *what)
{
	for (uint32_t i = 0; i < b->o.seqs && host_free(b) < need; i++)
		if (b->lru[i] != keep)
			spill_seq(b, b->lru[i]);
	uint64_t free_now = host_free(b);
	if (free_now < need) {
		char n[32], f[32], msg[160];
		snprintf(msg, sizeof(msg), "%s need %s of the host tier, %s is free with the other "
			 "sequences spilled: raise --host-bytes", what, fmt_bytes(need, n, sizeof n),
			 fmt_bytes(free_now, f, sizeof f));
		fail("host tier too small", msg);
	}
}

/* New host-tier bytes the next n decode steps' appends take: the blocks every sequence grows by. */
static uint64_t growth_bytes(const kb_run *b, uint32_t n)
{
	uint64_t blocks = 0;
	for (size_t i = 0; i < (size_t)b->o.seqs * b->o.layers; i++)
		blocks += blocks_for((uint64_t)b->len[i] + n) - blocks_for(b->len[i]);
	return blocks * b->o.kv_heads * block_bytes(b);
}

/* The LRU policy spills only sequences outside the call that needs the room, and a decode batch
 * holds every sequence: room for its new blocks must be made before, as a runtime would. */
void tier_room_for_steps(kb_run *b, uint32_t n)
{
	if (b->o.n_nvme)
		make_room(b, growth_bytes(b, n), UINT32_MAX, "the decode steps' new blocks");
}

/* ---- the capacity experiment ------------------------------------------------------------- */

static phase *phase_begin(kb_run *b, kb_phases *ps, const char *name)
{
	phase *ph = &ps->ph[ps->n++];
	*ph = (phase){.name = name, .restored = -1, .ns = now_ns(), .ns_lib = b->ns_lib};
	snap(b, &ph->st0);
	return ph;
}

static void phase_end(kb_run *b, phase *ph)
{
	ph->ns = now_ns() - ph->ns;
	ph->ns_lib = b->ns_lib - ph->ns_lib;
	snap(b, &ph->st1);
	if (b->table)
		print_phase_line(ph);
}

/* One sequence after another. Without the LRU policy the cache would refuse a full host tier, so
 * kvbench spills older sequences itself first. */
static void fill(kb_run *b)
{
	for (uint32_t s = 0; s < b->o.seqs; s++) {
		if (b->o.spill == KVT_SPILL_NONE)
			make_room(b, seq_bytes(b, b->o.context), s, "a sequence's prefill would");
		prefill_seq(b, s);
	}
	check_stats(b, &b->st_prefill, "after the fill");
}

/* The least recently used sequence (kvbench's own record agrees with the library's: both follow
 * the order of the calls). Without the LRU policy a full host tier makes kvt_seq_restore refuse
 * with -ENOSPC and change nothing: kvbench then spills one more sequence and tries again. */
static void restore_lru(kb_run *b, phase *ph)
{
	uint32_t s = b->lru[0], next = 1;
	int64_t rc;
	for (;;) {
		uint64_t t = now_ns();
		rc = kvt_seq_restore(b->cache, b->ids[s]);
		b->ns_lib += now_ns() - t;
		if (rc != -ENOSPC || b->o.spill != KVT_SPILL_NONE || next == b->o.seqs)
			break;
		spill_seq(b, b->lru[next++]);
	}
	if (rc < 0)
		lib_fail(b->cache, rc, "kvt_seq_restore");
	ph->restored = rc;
	ph->restored_seq = s;
	lru_touch(b, s);
}

static void decode_phase(kb_run *b, kb_phases *ps, const char *name, uint32_t first)
{
	phase *ph = phase_begin(b, ps, name);
	ph->step0 = first;
	ph->steps = b->o.steps;
	tier_room_for_steps(b, b->o.steps);
	decode_steps(b, first, b->o.steps);
	phase_end(b, ph);
}

/* A run whose K/V fits in the host tier measures nothing of the NVMe tier: say so. */
static void check_pressure(kb_run *b)
{
	kvt_stats st;
	snap(b, &st);
	if (tier_kv_bytes(b) > st.host_bytes_capacity)
		return;
	char k[32], h[32];
	fprintf(stderr, "kvbench: note: the K/V (%s) fits in the host tier (%s), so nothing has to "
		"spill: raise --context or --seqs, or lower --host-bytes\n",
		fmt_bytes(tier_kv_bytes(b), k, sizeof k), fmt_bytes(st.host_bytes_capacity, h, sizeof h));
}

void capacity_run(kb_run *b, kb_phases *ps)
{
	check_pressure(b);
	if (b->table)
		print_header(b);
	phase *ph = phase_begin(b, ps, "fill");
	fill(b);
	phase_end(b, ph);
	if (b->table)
		print_columns();
	decode_phase(b, ps, "decode_spilled", 0);
	ph = phase_begin(b, ps, "restore");
	restore_lru(b, ph);
	phase_end(b, ph);
	decode_phase(b, ps, "decode_restored", b->o.steps);
	if (b->table)
		print_row(b, -1, &b->all);
}
