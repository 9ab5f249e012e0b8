/* SPDX-License-Identifier: MIT */
/*
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of the NVMe block format.
 * Chosen over CRC-32 because x86 computes it in one instruction per 8 bytes (SSE4.2), so verifying
 * every byte read from disk costs a fraction of the read itself. Like zlib's crc32, the value is
 * pre- and post-inverted inside, so a running checksum is continued by passing the previous result:
 * kvt_crc32c(kvt_crc32c(0, a, na), b, nb) == kvt_crc32c(0, a ++ b, na + nb).
 *
 * Check value: kvt_crc32c(0, "123456789", 9) == 0xE3069283.
 * Thread safety: all functions may be called from any thread at any time.
 */
#ifndef KVT_CRC32C_H
#define KVT_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of n bytes at p continued from crc (0 to start); the fastest implementation present. */
uint32_t kvt_crc32c(uint32_t crc, const void *p, size_t n);

/*
 * CRC-32C of each of n_chunks consecutive chunks of chunk_bytes at p, each started from 0, into
 * out[0..n_chunks). Four chunks go through the instruction side by side, hiding its 3-cycle
 * latency: about four times the rate of one kvt_crc32c stream, which is what lets a single thread
 * verify blocks as fast as a disk delivers them.
 */
void kvt_crc32c_chunks(const void *p, size_t chunk_bytes, size_t n_chunks, uint32_t *out);

/* The table-driven software version (slicing by 8), for tests and CPUs without SSE4.2. */
uint32_t kvt_crc32c_sw(uint32_t crc, const void *p, size_t n);

/*
 * The SSE4.2 implementation, or -1 when this CPU (or this build's target) lacks the instruction:
 * then *out is left alone. Returns 0 with the CRC in *out otherwise. For tests that compare the
 * two.
 */
int kvt_crc32c_hw(uint32_t crc, const void *p, size_t n, uint32_t *out);

/* Which implementation kvt_crc32c uses: "sse4.2" or "software". */
const char *kvt_crc32c_impl(void);

#endif
