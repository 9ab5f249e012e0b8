/* SPDX-License-Identifier: MIT */
/*
 * CRC-32C. The hardware path feeds 8 bytes per crc32 instruction; the software path is slicing by 8
 * (eight 256-entry tables, one load per input byte but eight bytes per dependent step), about
 * 1 GB/s, so a machine without SSE4.2 still verifies faster than a virtio disk reads.
 */
#include <pthread.h>
#include <string.h>

#include "crc32c.h"

#if defined(__x86_64__) || defined(__i386__)
#define KVT_CRC_X86 1
#include <nmmintrin.h>
#else
#define KVT_CRC_X86 0
#endif

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (POLY & (0u - (c & 1u)));
		table[0][i] = c;
	}
	/* table[k][i]: the CRC of byte i followed by k zero bytes, so 8 bytes fold in one step. */
	for (uint32_t i = 0; i < 256; i++)
		for (int k = 1; k < 8; k++)
			table[k][i] = (table[k - 1][i] >> 8) ^ table[0][table[k - 1][i] & 0xffu];
}

uint32_t kvt_crc32c_sw(uint32_t crc, const void *p, size_t n)
{
	const unsigned char *b = p;
	uint32_t c = ~crc;
	pthread_once(&table_once, table_init);
	for (; n && ((uintptr_t)b & 7u); n--)
		c = (c >> 8) ^ table[0][(c ^ *b++) & 0xffu];
	for (; n >= 8; n -= 8, b += 8) {
		uint32_t lo, hi;
		memcpy(&lo, b, 4);
		memcpy(&hi, b + 4, 4);
		lo ^= c; /* the format is little-endian and so is every host this code is built for
			  */
		c = table[7][lo & 0xffu] ^ table[6][(lo >> 8) & 0xffu] ^
		    table[5][(lo >> 16) & 0xffu] ^ table[4][lo >> 24] ^ table[3][hi & 0xffu] ^
		    table[2][(hi >> 8) & 0xffu] ^ table[1][(hi >> 16) & 0xffu] ^ table[0][hi >> 24];
	}
	while (n--)
		c = (c >> 8) ^ table[0][(c ^ *b++) & 0xffu];
	return ~c;
}

#if KVT_CRC_X86
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t c = ~crc;
	for (; n && ((uintptr_t)b & 7u); n--)
		c = _mm_crc32_u8((uint32_t)c, *b++);
	for (; n >= 8; n -= 8, b += 8) {
		uint64_t w;
		memcpy(&w, b, 8);
		c = _mm_crc32_u64(c, w);
	}
	while (n--)
		c = _mm_crc32_u8((uint32_t)c, *b++);
	return ~(uint32_t)c;
}

/* Four independent streams of n bytes each (n a multiple of 8), interleaved. */
__attribute__((target("sse4.2"))) static void crc_sse42_x4(const unsigned char *p, size_t stride,
							   size_t n, uint32_t *out)
{
	uint64_t c0 = 0xffffffffu, c1 = c0, c2 = c0, c3 = c0;
	const unsigned char *p1 = p + stride, *p2 = p1 + stride, *p3 = p2 + stride;
	for (size_t i = 0; i < n; i += 8) {
		uint64_t w0, w1, w2, w3;
		memcpy(&w0, p + i, 8);
		memcpy(&w1, p1 + i, 8);
		memcpy(&w2, p2 + i, 8);
		memcpy(&w3, p3 + i, 8);
		c0 = _mm_crc32_u64(c0, w0);
		c1 = _mm_crc32_u64(c1, w1);
		c2 = _mm_crc32_u64(c2, w2);
		c3 = _mm_crc32_u64(c3, w3);
	}
	out[0] = ~(uint32_t)c0;
	out[1] = ~(uint32_t)c1;
	out[2] = ~(uint32_t)c2;
	out[3] = ~(uint32_t)c3;
}

static int have_sse42(void)
{
	/* __builtin_cpu_supports reads what __builtin_cpu_init fills in (idempotent). */
	__builtin_cpu_init();
	return __builtin_cpu_supports("sse4.2");
}
#endif

int kvt_crc32c_hw(uint32_t crc, const void *p, size_t n, uint32_t *out)
{
#if KVT_CRC_X86
	if (have_sse42()) {
		*out = crc_sse42(crc, p, n);
		return 0;
	}
#else
	(void)crc;
	(void)p;
	(void)n;
	(void)out;
#endif
	return -1;
}

uint32_t kvt_crc32c(uint32_t crc, const void *p, size_t n)
{
#if KVT_CRC_X86
	if (have_sse42())
		return crc_sse42(crc, p, n);
#endif
	return kvt_crc32c_sw(crc, p, n);
}

void kvt_crc32c_chunks(const void *p, size_t chunk_bytes, size_t n_chunks, uint32_t *out)
{
	const unsigned char *b = p;
	size_t i = 0;
#if KVT_CRC_X86
	if (have_sse42() && chunk_bytes % 8 == 0)
		for (; i + 4 <= n_chunks; i += 4)
			crc_sse42_x4(b + i * chunk_bytes, chunk_bytes, chunk_bytes, out + i);
#endif
	for (; i < n_chunks; i++)
		out[i] = kvt_crc32c(0, b + i * chunk_bytes, chunk_bytes);
}

const char *kvt_crc32c_impl(void)
{
#if KVT_CRC_X86
	if (have_sse42())
		return "sse4.2";
#endif
	return "software";
}
