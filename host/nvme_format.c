/* SPDX-License-Identifier: MIT */
/*
 * Encoding and verification of NVMe blocks. Fields are stored little-endian through explicit
 * helpers so the format does not depend on struct layout or host byte order.
 */
#include <endian.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "crc32c.h"
#include "nvme_format.h"

/* Byte offsets of the header fields (doc/nvme-format.md has the same table). */
enum {
	OFF_MAGIC = 0,
	OFF_VERSION = 4,
	OFF_FLAGS = 6,
	OFF_HDR_BYTES = 8,
	OFF_CRC = 12,
	OFF_SEQ = 16,
	OFF_GEN = 24,
	OFF_FIRST = 32,
	OFF_NTOK = 40,
	OFF_LAYER = 44,
	OFF_HEAD = 48,
	OFF_DIM = 52,
	OFF_PAYLOAD = 56,
	OFF_CHUNK = 60,
	OFF_STORE = 64,
	OFF_TABLE = 72,
};

static void put16(unsigned char *p, uint16_t v)
{
	v = htole16(v);
	memcpy(p, &v, 2);
}

static void put32(unsigned char *p, uint32_t v)
{
	v = htole32(v);
	memcpy(p, &v, 4);
}

static void put64(unsigned char *p, uint64_t v)
{
	v = htole64(v);
	memcpy(p, &v, 8);
}

static uint16_t get16(const unsigned char *p)
{
	uint16_t v;
	memcpy(&v, p, 2);
	return le16toh(v);
}

static uint32_t get32(const unsigned char *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return le32toh(v);
}

static uint64_t get64(const unsigned char *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return le64toh(v);
}

uint32_t kvt_nvme_payload_bytes(const struct kvt_nvme_block_id *id)
{
	uint64_t b = (uint64_t)id->n_tokens * id->head_dim * 4u;
	return b == 0 || b > KVT_NVME_MAX_PAYLOAD ? 0 : (uint32_t)b;
}

uint32_t kvt_nvme_header_bytes(uint32_t payload_bytes)
{
	uint32_t chunks =
		(uint32_t)(((uint64_t)payload_bytes + KVT_NVME_CHUNK - 1) / KVT_NVME_CHUNK);
	return KVT_NVME_HDR_FIXED + 4u * chunks;
}

uint32_t kvt_nvme_data_offset(uint32_t payload_bytes, uint32_t align)
{
	return (kvt_nvme_header_bytes(payload_bytes) + align - 1) & ~(align - 1);
}

uint64_t kvt_nvme_disk_bytes(const struct kvt_nvme_block_id *id, uint32_t align)
{
	uint32_t p = kvt_nvme_payload_bytes(id);
	if (!p || !align || (align & (align - 1)))
		return 0;
	uint64_t raw = (uint64_t)kvt_nvme_data_offset(p, align) + p;
	return (raw + align - 1) & ~(uint64_t)(align - 1);
}

/* The header CRC: over the header bytes with the CRC field read as zero. */
static uint32_t header_crc(const unsigned char *hdr, uint32_t hdr_bytes)
{
	static const unsigned char zero[4];
	uint32_t c = kvt_crc32c(0, hdr, OFF_CRC);
	c = kvt_crc32c(c, zero, 4);
	return kvt_crc32c(c, hdr + OFF_CRC + 4, hdr_bytes - OFF_CRC - 4);
}

/*
 * The CRCs of payload chunks [c, c + k) of a payload of p bytes, chunk c at `at`, into crc[0..k).
 * Whole chunks go four at a time through kvt_crc32c_chunks; a short last chunk alone.
 */
static void chunk_crcs(const unsigned char *at, uint32_t p, uint32_t c, uint32_t k, uint32_t *crc)
{
	uint32_t whole = (uint64_t)(c + k) * KVT_NVME_CHUNK > p ? k - 1 : k;
	kvt_crc32c_chunks(at, KVT_NVME_CHUNK, whole, crc);
	if (whole < k)
		crc[whole] = kvt_crc32c(0, at + (size_t)whole * KVT_NVME_CHUNK,
					p - (c + whole) * KVT_NVME_CHUNK);
}

void kvt_nvme_encode(const struct kvt_nvme_block_id *id, uint64_t store, const void *payload,
		     void *dst, size_t disk_bytes, uint32_t align)
{
	unsigned char *h = dst;
	uint32_t p = kvt_nvme_payload_bytes(id), hb = kvt_nvme_header_bytes(p),
		 d = kvt_nvme_data_offset(p, align);
	unsigned char *data = h + d;

	memcpy(h + OFF_MAGIC, KVT_NVME_MAGIC, 4);
	put16(h + OFF_VERSION, (uint16_t)KVT_NVME_VERSION);
	put16(h + OFF_FLAGS, id->flags);
	put32(h + OFF_HDR_BYTES, hb);
	put32(h + OFF_CRC, 0);
	put64(h + OFF_SEQ, id->seq);
	put64(h + OFF_GEN, id->generation);
	put64(h + OFF_FIRST, id->first_token);
	put32(h + OFF_NTOK, id->n_tokens);
	put32(h + OFF_LAYER, id->layer);
	put32(h + OFF_HEAD, id->kv_head);
	put32(h + OFF_DIM, id->head_dim);
	put32(h + OFF_PAYLOAD, p);
	put32(h + OFF_CHUNK, KVT_NVME_CHUNK);
	put64(h + OFF_STORE, store);
	memcpy(data, payload, p);
	for (uint32_t c = 0, n = (p + KVT_NVME_CHUNK - 1) / KVT_NVME_CHUNK; c < n;) {
		uint32_t crc[64], k = n - c < 64 ? n - c : 64;
		chunk_crcs(data + (size_t)c * KVT_NVME_CHUNK, p, c, k, crc);
		for (uint32_t j = 0; j < k; j++)
			put32(h + OFF_TABLE + 4u * (c + j), crc[j]);
		c += k;
	}
	memset(h + hb, 0, d - hb);
	memset(data + p, 0, disk_bytes - d - p);
	put32(h + OFF_CRC, header_crc(h, hb));
}

#define BAD(...) kvt_err_set(why, -EBADMSG, __VA_ARGS__)

/* The identity fields, each compared; the first mismatch is named. */
static int check_id(const unsigned char *h, const struct kvt_nvme_block_id *e,
		    struct kvt_err *why)
{
	const struct {
		const char *name;
		uint64_t got, want;
	} f[] = {
		{"seq", get64(h + OFF_SEQ), e->seq},
		{"layer", get32(h + OFF_LAYER), e->layer},
		{"kv_head", get32(h + OFF_HEAD), e->kv_head},
		{"first_token", get64(h + OFF_FIRST), e->first_token},
		{"n_tokens", get32(h + OFF_NTOK), e->n_tokens},
		{"head_dim", get32(h + OFF_DIM), e->head_dim},
		{"flags", get16(h + OFF_FLAGS), e->flags},
		{"generation", get64(h + OFF_GEN), e->generation},
	};
	for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
		if (f[i].got != f[i].want)
			return BAD("%s mismatch: got %" PRIu64 ", wanted %" PRIu64, f[i].name,
				   f[i].got, f[i].want);
	return 0;
}

/* Padding must be zero: a flipped bit there is refused like one anywhere else in the block. */
static int check_zero(const unsigned char *pad, uint32_t bytes, const char *where,
		      struct kvt_err *why)
{
	/* All zero: the first byte is, and each byte equals the next (one vectorized memcmp). */
	if (pad && bytes && (pad[0] || memcmp(pad, pad + 1, bytes - 1) != 0))
		for (uint32_t i = 0; i < bytes; i++)
			if (pad[i])
				return BAD("padding byte %u %s is 0x%02x, wanted 0", i, where,
					   pad[i]);
	return 0;
}

int kvt_nvme_verify(const struct kvt_nvme_view *v, const struct kvt_nvme_block_id *expect,
		    uint64_t store, struct kvt_err *why)
{
	const unsigned char *h = v->hdr;
	uint32_t p = kvt_nvme_payload_bytes(expect), hb = kvt_nvme_header_bytes(p);

	if (memcmp(h + OFF_MAGIC, KVT_NVME_MAGIC, 4) != 0)
		return BAD("bad magic %02x%02x%02x%02x, wanted \"KVTB\"", h[0], h[1], h[2], h[3]);
	if (get16(h + OFF_VERSION) != KVT_NVME_VERSION)
		return BAD("format version %u, wanted %u", get16(h + OFF_VERSION),
			   KVT_NVME_VERSION);
	if (get32(h + OFF_HDR_BYTES) != hb || get32(h + OFF_PAYLOAD) != p ||
	    get32(h + OFF_CHUNK) != KVT_NVME_CHUNK)
		return BAD("sizes: header %u, payload %u, chunk %u bytes; wanted %u, %u, %u",
			   get32(h + OFF_HDR_BYTES), get32(h + OFF_PAYLOAD), get32(h + OFF_CHUNK),
			   hb, p, KVT_NVME_CHUNK);
	/* Sizes agree, so the header is hb bytes: check its CRC before trusting any field. */
	uint32_t got = get32(h + OFF_CRC), want = header_crc(h, hb);
	if (got != want)
		return BAD("header crc32c 0x%08x, computed 0x%08x", got, want);
	/*
	 * Before the identity: sequence ids and generations start alike in every store, so only this
	 * tells a block of another store on the same file (or of a dead one before it) from our own.
	 */
	if (get64(h + OFF_STORE) != store)
		return BAD("store id 0x%016" PRIx64 ", wanted 0x%016" PRIx64
			   " (a block of another store, or of an earlier one on this file)",
			   get64(h + OFF_STORE), store);
	int rc = check_id(h, expect, why);
	if (rc)
		return rc;
	for (uint32_t c = v->c0; c < v->c1;) {
		uint32_t crc[64], k = v->c1 - c < 64 ? v->c1 - c : 64;
		chunk_crcs(v->data + (size_t)(c - v->c0) * KVT_NVME_CHUNK, p, c, k, crc);
		for (uint32_t j = 0; j < k; j++, c++) {
			uint32_t off = c * KVT_NVME_CHUNK,
				 len = p - off < KVT_NVME_CHUNK ? p - off : KVT_NVME_CHUNK;
			uint32_t cg = get32(h + OFF_TABLE + 4u * c);
			if (cg != crc[j])
				return BAD("payload chunk %u (bytes %u..%u) crc32c 0x%08x, "
					   "computed 0x%08x",
					   c, off, off + len, cg, crc[j]);
		}
	}
	rc = check_zero(v->hpad, v->hpad_bytes, "after the header", why);
	return rc ? rc : check_zero(v->pad, v->pad_bytes, "after the payload", why);
}
