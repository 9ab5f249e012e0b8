/* SPDX-License-Identifier: MIT */
/*
 * The write and free calls of the NVMe store: space for a call's blocks taken all or nothing over
 * the files in turn, the blocks staged and written by the engine (nvme_engine.c), the space zeroed
 * and given back when the call fails, and frees that drop what the header cache holds for the space.
 */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "kvt_config.h"

#if KVT_HAVE_LIBURING
#include "nvme_priv.h"

/* Space for all n blocks, files taken in turn; all or nothing. */
static int take_space(struct kvt_nvme *st, uint32_t n, struct kvt_nvme_loc *locs,
		      struct kvt_err *err)
{
	uint64_t need = 0, avail = 0, largest = 0;
	for (uint32_t i = 0; i < n; i++)
		need += locs[i].bytes;
	for (uint32_t i = 0; i < n; i++) {
		int rc = -ENOSPC;
		for (uint32_t t = 0; t < st->n_files && rc == -ENOSPC; t++) {
			uint32_t fi = (st->rotor + t) % st->n_files;
			rc = kvt_space_reserve(&st->files[fi].space);
			if (!rc)
				rc = kvt_space_alloc(&st->files[fi].space, locs[i].bytes,
						     &locs[i].offset);
			if (!rc) {
				locs[i].file = fi;
				st->rotor = fi + 1;
			}
		}
		if (rc) {
			for (uint32_t j = 0; j < i; j++)
				kvt_space_free(&st->files[locs[j].file].space, locs[j].offset,
					       locs[j].bytes);
			for (uint32_t f = 0; f < st->n_files; f++) {
				avail += st->files[f].space.free;
				uint64_t l = kvt_space_largest(&st->files[f].space);
				largest = l > largest ? l : largest;
			}
			if (rc == -ENOMEM)
				return kvt_err_set(err, rc,
						       "no memory for the free list (block %u)", i);
			return kvt_err_set(
				err, -ENOSPC,
				"%u blocks need %" PRIu64 " bytes; %" PRIu64
				" bytes free over %u files, largest free extent %" PRIu64
				" (block %u of %u bytes did not fit)",
				n, need, avail, st->n_files, largest, i, locs[i].bytes);
		}
	}
	return 0;
}

int kvt_nvme_write_blocks(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_block *blocks,
			  struct kvt_nvme_loc *locs, struct kvt_err *err)
{
	int rc = kvt_nv_usable(st, err);
	if (rc)
		return rc;
	if (n && (!blocks || !locs))
		return kvt_err_set(err, -EINVAL, "blocks and locs_out must not be NULL");
	if (n)
		memset(locs, 0, (size_t)n * sizeof *locs);
	for (uint32_t i = 0; i < n; i++) {
		const struct kvt_nvme_block_id *id = &blocks[i].id;
		uint64_t disk = kvt_nvme_disk_bytes(id, st->align);
		if (!disk || !blocks[i].payload)
			return kvt_err_set(
				err, -EINVAL,
				"block %u: %u tokens x head_dim %u (payload %p): need 1.. "
				"rows of 1.. elements, at most %u payload bytes",
				i, id->n_tokens, id->head_dim, blocks[i].payload,
				KVT_NVME_MAX_PAYLOAD);
		if (disk > (uint64_t)st->n_slots * st->bounce)
			return kvt_err_set(err, -EINVAL,
					       "block %u takes %" PRIu64
					       " bytes, more than the bounce "
					       "pool of %u x %u bytes",
					       i, disk, st->n_slots, st->bounce);
		locs[i].bytes = (uint32_t)disk;
	}
	rc = take_space(st, n, locs, err);
	if (rc) {
		memset(locs, 0, (size_t)n * sizeof *locs);
		return rc;
	}
	/* The space may have held a block whose header is cached: never trust it again. */
	for (uint32_t i = 0; i < n; i++)
		kvt_hc_drop(st, locs[i].file, locs[i].offset);
	struct kvt_call c = {.write = 1, .n = n, .blocks = blocks, .locs = locs, .err = err};
	rc = n ? kvt_nv_run_call(st, &c) : 0;
	if (rc) {
		/* Nothing of a failed call is reported written: what reached the files zeroed
		 * (any of its blocks may have), space back, locs zeroed. */
		kvt_nvme_discard(st, n, locs);
		for (uint32_t i = 0; i < n; i++)
			kvt_space_free(&st->files[locs[i].file].space, locs[i].offset,
				       locs[i].bytes);
		memset(locs, 0, (size_t)n * sizeof *locs);
		return rc;
	}
	st->stats.blocks_written += n;
	return 0;
}

void kvt_nvme_free(struct kvt_nvme *st, uint32_t n, const struct kvt_nvme_loc *locs)
{
	if (!st || !locs)
		return;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvt_nvme_loc *l = &locs[i];
		if (!l->bytes)
			continue;
		kvt_hc_drop(st, l->file, l->offset); /* the space goes back: its header with it */
		if (l->file >= st->n_files || (l->offset & (st->align - 1)) ||
		    kvt_space_free(&st->files[l->file].space, l->offset, l->bytes))
			st->stats.bad_frees++;
	}
}

#endif
