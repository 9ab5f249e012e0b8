/* SPDX-License-Identifier: MIT */
/*
 * The on-disk block format of the NVMe tier (doc/nvme-format.md is the specification): a header
 * with the block's identity and a CRC-32C per 4 KiB chunk of payload, the payload of K/V rows, and
 * zero padding to the file's I/O alignment. Pure functions over memory, no I/O, so the format can
 * be encoded, checked and tested apart from io_uring.
 *
 * Thread safety: every function is reentrant.
 */
#ifndef KVT_NVME_FORMAT_H
#define KVT_NVME_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#define KVT_NVME_MAGIC "KVTB"
#define KVT_NVME_VERSION 3u
/* Bytes of the fixed part of the header (with the store id); the chunk CRC table follows it. */
#define KVT_NVME_HDR_FIXED 72u
/* Payload bytes covered by one chunk CRC: the unit direct serving verifies on its own. */
#define KVT_NVME_CHUNK 4096u
/* Largest payload of one block (keeps every size of the format within 32 bits). */
#define KVT_NVME_MAX_PAYLOAD ((uint32_t)1 << 30)

/*
 * Who a block belongs to. Written into the header and checked on every read, so a block of another
 * sequence, layer, head, token range or an older generation of the same tokens is never served.
 * Payload: n_tokens rows, row t = K then V of token first_token + t of this KV head, head_dim
 * elements each, 2 bytes per element: n_tokens * head_dim * 4 bytes.
 */
struct kvt_nvme_block_id {
	uint64_t seq;         /* sequence id */
	uint64_t generation;  /* bumped by the owner whenever these tokens' K/V are rewritten */
	uint64_t first_token; /* position of row 0 in the sequence */
	uint32_t n_tokens;    /* rows, >= 1 */
	uint32_t layer;
	uint32_t kv_head;
	uint32_t head_dim; /* elements per K (and per V) row, >= 1 */
	uint16_t flags;    /* the owner's (dtype, say); stored and checked, not interpreted */
};

/* Payload bytes (n_tokens * head_dim * 4), or 0 when zero or over KVT_NVME_MAX_PAYLOAD. */
uint32_t kvt_nvme_payload_bytes(const struct kvt_nvme_block_id *id);
/* Header bytes for a payload: 72 + 4 per started 4 KiB chunk. */
uint32_t kvt_nvme_header_bytes(uint32_t payload_bytes);
/*
 * Where the payload starts in a block: the header rounded up to `align` (a power of two), so the
 * payload, and each 4 KiB chunk of it when align <= 4096, is read by O_DIRECT on its own sectors.
 */
uint32_t kvt_nvme_data_offset(uint32_t payload_bytes, uint32_t align);
/* On-disk bytes: data offset + payload rounded up to `align` (a power of two); 0 if bad. */
uint64_t kvt_nvme_disk_bytes(const struct kvt_nvme_block_id *id, uint32_t align);

/*
 * Write the whole on-disk image of a block into dst (disk_bytes long, as kvt_nvme_disk_bytes gave):
 * header with the writing store's random id `store`, chunk CRCs and header CRC, zero header padding up to kvt_nvme_data_offset(align),
 * payload copied from `payload`, zero tail padding.
 */
void kvt_nvme_encode(const struct kvt_nvme_block_id *id, uint64_t store, const void *payload,
		     void *dst, size_t disk_bytes, uint32_t align);

/*
 * What was read of one block: the whole header (kvt_nvme_header_bytes long) at hdr; the payload
 * bytes of chunks [c0, c1) at data (data[0] is payload byte c0 * 4096; the last chunk of the
 * payload may be short); when pad is not NULL, the pad_bytes of padding after the payload; and,
 * when hpad is not NULL, the hpad_bytes of padding between the header and the payload.
 */
struct kvt_nvme_view {
	const unsigned char *hdr;
	const unsigned char *data;
	uint32_t c0, c1;
	const unsigned char *pad;
	uint32_t pad_bytes;
	const unsigned char *hpad;
	uint32_t hpad_bytes;
};

/*
 * Check a block read from disk against what the caller expects, in this order: magic, version,
 * sizes, header CRC, store id (the reading store's `store`: a block another store wrote, on a
 * shared or reused file, is refused even when its identity and checksums are right), identity (seq, layer, head, tokens, head_dim, flags), generation, the CRC of
 * every chunk in the view, zero padding (header padding, then tail padding). Returns 0, or -EBADMSG with the failed check and the got
 * and wanted values in why.
 */
int kvt_nvme_verify(const struct kvt_nvme_view *v, const struct kvt_nvme_block_id *expect,
		    uint64_t store, struct kvt_err *why);

#endif
