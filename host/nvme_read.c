/* SPDX-License-Identifier: MIT */
/*
 * The read calls of the NVMe store (whole blocks and row ranges, through the bounce buffer):
 * argument checks and the header prefetch of direct serving, then the engine of nvme_engine.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_config.h"

#if KVT_HAVE_LIBURING
#include "alloc.h"
#include "nvme_priv.h"

/* A request must name a block of the store that matches its identity, and rows inside it. */
static int check_read(struct kvt_nvme *st, uint32_t i, const struct kvt_nvme_rows *q,
		      struct kvt_err *err)
{
	const struct kvt_nvme_loc *l = &q->loc;
	uint64_t disk = kvt_nvme_disk_bytes(&q->expect, st->align);
	const char *bad = NULL;
	struct req r;
	if (!disk || disk != l->bytes)
		bad = "the loc's size does not match the identity's";
	else if (l->file >= st->n_files || (l->offset & (st->align - 1)) ||
		 l->offset > st->files[l->file].bytes ||
		 l->bytes > st->files[l->file].bytes - l->offset)
		bad = "the loc is not an aligned range inside one of the files";
	else if (q->row_begin >= q->row_end || q->row_end > q->expect.n_tokens || !q->out)
		bad = "the rows are empty or past the block, or out is NULL";
	else if (kvt_nv_read_geometry(st, q, &r, 0) > (uint64_t)st->n_slots * st->bounce)
		bad = "it needs more staging than the bounce pool holds";
	if (!bad)
		return 0;
	char name[256];
	kvt_nv_name_block(st, l, &q->expect, name, sizeof name);
	return kvt_err_set(err, -EINVAL,
			       "read %u (%s, rows [%u, %u), out %p): %s; the identity "
			       "needs %" PRIu64 " bytes on disk, bounce pool %u x %u",
			       i, name, q->row_begin, q->row_end, q->out, bad, disk, st->n_slots,
			       st->bounce);
}

struct at_loc {
	uint64_t offset;
	uint32_t file, i;
};

static int cmp_at_loc(const void *pa, const void *pb)
{
	const struct at_loc *a = pa, *b = pb;
	if (a->file != b->file)
		return a->file < b->file ? -1 : 1;
	if (a->offset != b->offset)
		return a->offset < b->offset ? -1 : 1;
	return a->i < b->i ? -1 : a->i > b->i;
}

/*
 * Direct serving asks for several chunks of one block in one call, and a header read with the
 * first of them would land in the cache only after the others were planned: each would read the
 * header again. So the headers of blocks asked for twice or more and not cached are read first,
 * one I/O each, verified and cached; then every chunk is one I/O. Only an optimization: without
 * memory for the list it is skipped. A header refused here fails the call as the row read would.
 */
static int prefetch_headers(struct kvt_nvme *st, const struct kvt_call *c)
{
	struct at_loc *a = kvt_mem_alloc(KVT_MEM_HOST, (size_t)c->n * sizeof *a);
	uint32_t *pick = kvt_mem_alloc(KVT_MEM_HOST, (size_t)c->n * sizeof *pick);
	uint32_t m = 0, k = 0;
	for (uint32_t i = 0; a && pick && i < c->n; i++) {
		const struct kvt_nvme_rows *q = &c->rows[i];
		uint32_t hb = kvt_nvme_header_bytes(kvt_nvme_payload_bytes(&q->expect));
		if (hb <= KVT_HC_HDR_MAX && !kvt_hc_find(st, &q->loc, &q->expect, hb))
			a[m++] = (struct at_loc){q->loc.offset, q->loc.file, i};
	}
	if (m > 1)
		qsort(a, m, sizeof *a, cmp_at_loc);
	for (uint32_t j = 0; j + 1 < m; j++)
		if (a[j].file == a[j + 1].file && a[j].offset == a[j + 1].offset &&
		    (j == 0 || a[j - 1].file != a[j].file || a[j - 1].offset != a[j].offset))
			pick[k++] = a[j].i; /* the first request of a run of two or more */
	int rc = 0;
	if (k) {
		struct kvt_call h = {.hdr_only = 1, .n = k, .rows = c->rows, .map = pick,
				     .err = c->err};
		rc = kvt_nv_run_call(st, &h);
	}
	kvt_mem_free(KVT_MEM_HOST, a, (size_t)c->n * sizeof *a);
	kvt_mem_free(KVT_MEM_HOST, pick, (size_t)c->n * sizeof *pick);
	return rc;
}

static int run_read(struct kvt_nvme *st, struct kvt_call *c)
{
	int rc = kvt_nv_usable(st, c->err);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < c->n; i++) {
		struct kvt_nvme_rows q;
		kvt_nv_call_rows(c, i, &q);
		rc = check_read(st, i, &q, c->err);
		if (rc)
			return rc;
	}
	if (c->rows && c->n > 1) {
		rc = prefetch_headers(st, c);
		if (rc)
			return rc;
	}
	return c->n ? kvt_nv_run_call(st, c) : 0;
}

int kvt_nvme_read_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs,
			 const struct kvt_nvme_block_id *expect, void *const *payload_out,
			 struct kvt_err *err)
{
	if (st && n && (!locs || !expect || !payload_out))
		return kvt_err_set(err, -EINVAL,
				       "locs, expect and payload_out must not be NULL");
	struct kvt_call c = {.n = n, .rlocs = locs, .expect = expect, .outs = payload_out,
			     .err = err};
	return run_read(st, &c);
}

int kvt_nvme_read_rows_idle(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
			    const struct kvt_nvme_idle *idle, struct kvt_err *err)
{
	if (st && n && !reqs)
		return kvt_err_set(err, -EINVAL, "reqs must not be NULL");
	struct kvt_call c = {.n = n, .rows = reqs, .err = err, .idle = idle};
	return run_read(st, &c);
}

int kvt_nvme_read_rows(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_rows *reqs,
		       struct kvt_err *err)
{
	return kvt_nvme_read_rows_idle(st, n, reqs, NULL, err);
}

#endif
