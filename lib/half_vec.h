/* SPDX-License-Identifier: MIT */
/*
 * Four-lane float vectors (GNU C vector extensions; SSE2 on x86-64, NEON on arm64) and the fp16 /
 * bf16 conversion four elements at a time, lane for lane the bits of half.h's scalar one. Host C
 * only (lib/attention.c and its test).
 */
#ifndef KVT_HALF_VEC_H
#define KVT_HALF_VEC_H

#include <stdint.h>
#include <string.h>

typedef float kvt_v4f __attribute__((vector_size(16)));
typedef uint32_t kvt_v4u __attribute__((vector_size(16)));
typedef int32_t kvt_v4i __attribute__((vector_size(16)));
typedef uint16_t kvt_v4h __attribute__((vector_size(8)));

/* Lanes a, b, c, e of the eight of x then y (GCC and clang spell the builtin differently). */
#ifdef __clang__
#define KVT_SHUFFLE4(x, y, a, b, c, e) __builtin_shufflevector(x, y, a, b, c, e)
#else
#define KVT_SHUFFLE4(x, y, a, b, c, e) __builtin_shuffle(x, y, (kvt_v4i){a, b, c, e})
#endif

static inline kvt_v4f kvt_v4f_load(const float *p)
{
	kvt_v4f v;
	memcpy(&v, p, sizeof v);
	return v;
}

static inline void kvt_v4f_store(float *p, kvt_v4f v)
{
	memcpy(p, &v, sizeof v);
}

/* Elements i .. i + 3 of a tensor of the given kvt_dtype (1 fp16, 2 bf16), as kvt_load gives each. */
static inline kvt_v4f kvt_load4(const void *base, size_t i, uint32_t dtype)
{
	kvt_v4h h;
	memcpy(&h, (const uint16_t *)base + i, sizeof h);
	const kvt_v4u x = __builtin_convertvector(h, kvt_v4u);
	if (dtype == 2)
		return (kvt_v4f)(x << 16);
	const kvt_v4u sign = (x & 0x8000u) << 16, e = (x >> 10) & 0x1fu;
	const kvt_v4u top = (kvt_v4u)(e == 0x1fu), low = (kvt_v4u)(e == 0u);
	const kvt_v4u either = top | low;
	uint64_t odd[2];
	memcpy(odd, &either, sizeof odd);
	if (!(odd[0] | odd[1])) /* four normal numbers: rebias the exponent 15 -> 127 */
		return (kvt_v4f)(sign | (((x & 0x7fffu) << 13) + 0x38000000u));
	const kvt_v4u man = x & 0x3ffu;
	const kvt_v4u normal = sign | ((e + 112u) << 23) | (man << 13);
	const kvt_v4u special = sign | 0x7f800000u | (man << 13); /* inf or nan */
	/* zero or subnormal: man * 2^-24 is exact in float */
	const kvt_v4f sub = __builtin_convertvector((kvt_v4i)man, kvt_v4f) * (1.0f / 16777216.0f);
	return (kvt_v4f)((top & special) | (low & ((kvt_v4u)sub | sign)) | (~(top | low) & normal));
}

#endif
