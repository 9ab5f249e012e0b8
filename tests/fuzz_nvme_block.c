/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target of the NVMe block decoder (host/nvme_format.c): arbitrary bytes as what a read
 * brought back from disk, checked by kvt_nvme_verify against an expected identity. Byte 0 picks
 * the mode (its value mod 3), the next 24 bytes the expected identity, the I/O alignment and the
 * chunk range read.
 *   mode 0: the rest of the input is the block image as read (cut or zero-filled to the size
 *     the identity gives). Properties: verify returns 0 or -EBADMSG, a refusal says why, it reads
 *     nothing outside the header, chunk, padding ranges it is given (each its own exact-size
 *     allocation), and a block accepted whole is exactly what kvt_nvme_encode writes for its
 *     payload: no byte of an accepted block escapes the checks.
 *   modes 1 and 2: a valid block of that identity with the input's byte changes applied (byte flips
 *     at positions, or the input xored over the image). Properties: accepted when no byte changed,
 *     refused with -EBADMSG when any byte of the header, padding or chunks read changed (every
 *     byte of a block is covered by a CRC, an identity field or the zero-padding check).
 * Built with -DKVT_LIBFUZZER and -fsanitize=fuzzer it is a libFuzzer target; otherwise main()
 * (fuzz_replay.h) replays tests/fuzz_corpus/nvme_block/ under meson test.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/nvme_format.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The store id every block of this harness carries (the store's random id, format version 3). */
#define FUZZ_STORE 0x6b7674666a7a7a31ull

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "fuzz_nvme_block: %s: ", #cond);                           \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, "\n");                                                     \
			abort();                                                                   \
		}                                                                                  \
	} while (0)

static uint32_t rd32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Copy n bytes of src (zero past src_n) into a fresh allocation of exactly n bytes. */
static unsigned char *exact(const unsigned char *src, size_t src_n, size_t n)
{
	unsigned char *b = malloc(n ? n : 1);
	if (!b)
		abort();
	memset(b, 0, n);
	if (src_n)
		memcpy(b, src, src_n < n ? src_n : n);
	return b;
}

struct geom {
	struct kvt_nvme_block_id id;
	uint32_t align, p, hb, d, nchunks, c0, c1;
	uint64_t disk;
};

/* The identity and geometry the 24 bytes after the mode byte ask for (payload at most 64 KiB). */
static void geometry(const uint8_t *b, struct geom *g)
{
	memset(g, 0, sizeof *g);
	g->id.seq = rd32(b) % 8;
	g->id.generation = b[4] % 4;
	g->id.first_token = rd32(b + 5) % 100000;
	g->id.n_tokens = 1 + b[9] % 64;
	g->id.layer = b[10] % 4;
	g->id.kv_head = b[11] % 4;
	g->id.head_dim = 1 + (uint32_t)(b[12] | b[13] << 8) % 256;
	g->id.flags = (uint16_t)(b[14] % 3);
	g->align = 512u << (b[15] % 4);
	g->p = kvt_nvme_payload_bytes(&g->id);
	g->hb = kvt_nvme_header_bytes(g->p);
	g->d = kvt_nvme_data_offset(g->p, g->align);
	g->disk = kvt_nvme_disk_bytes(&g->id, g->align);
	g->nchunks = (g->p + KVT_NVME_CHUNK - 1) / KVT_NVME_CHUNK;
	g->c0 = b[16] % (g->nchunks + 1);
	g->c1 = g->c0 + b[17] % (g->nchunks - g->c0 + 1);
	if (b[18] & 1) { /* the whole block, most of the time */
		g->c0 = 0;
		g->c1 = g->nchunks;
	}
}

/* Verify the image img (disk bytes) as read: each range in its own exact allocation. */
static int verify_image(const struct geom *g, const unsigned char *img, int with_pad,
			struct kvt_err *why)
{
	uint32_t lo = g->c0 * KVT_NVME_CHUNK < g->p ? g->c0 * KVT_NVME_CHUNK : g->p;
	uint32_t hi = g->c1 * KVT_NVME_CHUNK < g->p ? g->c1 * KVT_NVME_CHUNK : g->p;
	uint32_t tail = (uint32_t)(g->disk - g->d - g->p);
	unsigned char *hdr = exact(img, g->hb, g->hb);
	unsigned char *dat = exact(img + g->d + lo, hi - lo, hi - lo);
	unsigned char *hpad = exact(img + g->hb, g->d - g->hb, g->d - g->hb);
	unsigned char *pad = exact(img + g->d + g->p, tail, tail);
	struct kvt_nvme_view v = {hdr, dat, g->c0, g->c1, with_pad ? pad : NULL,
				  with_pad ? tail : 0, with_pad ? hpad : NULL,
				  with_pad ? g->d - g->hb : 0};
	memset(why, 0, sizeof *why);
	int rc = kvt_nvme_verify(&v, &g->id, FUZZ_STORE, why);
	free(hdr);
	free(dat);
	free(hpad);
	free(pad);
	return rc;
}

/* An accepted whole block must be exactly what kvt_nvme_encode writes for its payload. */
static void check_canonical(const struct geom *g, const unsigned char *img)
{
	if (g->c0 != 0 || g->c1 != g->nchunks)
		return;
	unsigned char *want = exact(NULL, 0, g->disk);
	kvt_nvme_encode(&g->id, FUZZ_STORE, img + g->d, want, g->disk, g->align);
	size_t at = 0;
	while (at < g->disk && want[at] == img[at])
		at++;
	CHECK(at == g->disk, "an accepted block differs from its encoding at byte %zu of %llu: got "
	      "0x%02x, encoding 0x%02x", at, (unsigned long long)g->disk, img[at], want[at]);
	free(want);
}

static void raw_mode(const struct geom *g, const uint8_t *rest, size_t n)
{
	unsigned char *img = exact(rest, n, g->disk);
	struct kvt_err why;
	int rc = verify_image(g, img, 1, &why);
	CHECK(rc == 0 || rc == -EBADMSG, "verify returned %d, wanted 0 or -EBADMSG", rc);
	CHECK(rc == 0 || why.msg[0], "a refusal without a reason");
	if (rc == 0)
		check_canonical(g, img);
	free(img);
}

/*
 * A valid block, then changed: mode 1 takes its payload from the input and applies the input's
 * (4-byte position, 1-byte xor) pairs after it; mode 2 takes a payload of a repeated input byte and
 * xors the rest of the input onto the image from its start.
 */
static void changed_mode(const struct geom *g, int mode, const uint8_t *rest, size_t n)
{
	size_t pn = mode == 1 ? (n < g->p ? n : g->p) : 0;
	unsigned char *payload = exact(rest, pn, g->p);
	if (mode == 2)
		memset(payload, n ? rest[0] : 0x5a, g->p);
	unsigned char *img = exact(NULL, 0, g->disk), *orig = exact(NULL, 0, g->disk);
	kvt_nvme_encode(&g->id, FUZZ_STORE, payload, img, g->disk, g->align);
	struct kvt_err why;
	int rc = verify_image(g, img, 1, &why);
	CHECK(rc == 0, "a freshly encoded block (payload %u, align %u) was refused: %s", g->p,
	      g->align, why.msg);
	memcpy(orig, img, g->disk);
	if (mode == 1) {
		for (size_t at = pn; at + 5 <= n; at += 5)
			img[rd32(rest + at) % g->disk] ^= rest[at + 4];
	} else {
		for (size_t at = 1; at < n && at - 1 < g->disk; at++)
			img[at - 1] ^= rest[at];
	}
	/* a payload byte outside the chunks read is not the verifier's to see */
	uint64_t lo = g->d + (uint64_t)g->c0 * KVT_NVME_CHUNK;
	uint64_t hi = g->d + (uint64_t)g->c1 * KVT_NVME_CHUNK;
	int changed = 0, in_view = 0;
	for (uint64_t pos = 0; pos < g->disk; pos++) {
		if (img[pos] == orig[pos])
			continue;
		changed = 1;
		in_view |= pos < g->d || pos >= g->d + g->p || (pos >= lo && pos < hi);
	}
	rc = verify_image(g, img, 1, &why);
	if (!changed)
		CHECK(rc == 0, "an unchanged block was refused: %s", why.msg);
	else if (in_view)
		CHECK(rc == -EBADMSG, "a block with changed bytes in the range read was accepted "
		      "(payload %u, align %u, chunks %u..%u)", g->p, g->align, g->c0, g->c1);
	if (rc == 0)
		check_canonical(g, img);
	free(payload);
	free(img);
	free(orig);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 25)
		return 0;
	struct geom g;
	geometry(data + 1, &g);
	CHECK(g.p && g.disk, "geometry of a valid identity: payload %u, disk %llu", g.p,
	      (unsigned long long)g.disk);
	if (data[0] % 3 == 0)
		raw_mode(&g, data + 25, size - 25);
	else
		changed_mode(&g, data[0] % 3, data + 25, size - 25);
	return 0;
}

#define FUZZ_NAME "fuzz_nvme_block"
#include "fuzz_replay.h"
