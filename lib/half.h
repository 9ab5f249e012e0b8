/* SPDX-License-Identifier: MIT */
/* fp16 and bf16 conversions, round to nearest even, shared by the CPU backend and the tests. */
#ifndef KVT_HALF_H
#define KVT_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t kvt_f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	return u;
}

static inline float kvt_bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

static inline float kvt_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
	if (exp == 0x1f)
		return kvt_bits_f32(sign | 0x7f800000u | (man << 13));
	if (exp == 0) {
		/* zero or subnormal: man * 2^-24 is exact in float */
		float f = (float)man * (1.0f / 16777216.0f);
		return sign ? -f : f;
	}
	return kvt_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t kvt_f32_to_f16(float f)
{
	uint32_t u = kvt_f32_bits(f), sign = (u >> 16) & 0x8000u, abs = u & 0x7fffffffu;
	if (abs >= 0x7f800000u) /* inf or nan */
		return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
	if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
		return (uint16_t)(sign | 0x7c00u);
	if (abs < 0x38800000u) { /* below the smallest normal: subnormal or zero */
		/* value = man * 2^(e - 150) and the fp16 subnormal unit is 2^-24 */
		uint32_t shift = 126u - (abs >> 23);
		if (shift > 25)
			return (uint16_t)sign;
		uint32_t man = (abs & 0x7fffffu) | 0x800000u;
		uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
		if (rem > mid || (rem == mid && (half & 1u)))
			half++;
		return (uint16_t)(sign | half);
	}
	uint32_t r = abs - 0x38000000u; /* rebias exponent 127 -> 15 */
	uint32_t half = r >> 13, rem = r & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
		half++;
	return (uint16_t)(sign | half);
}

static inline float kvt_bf16_to_f32(uint16_t h)
{
	return kvt_bits_f32((uint32_t)h << 16);
}

static inline uint16_t kvt_f32_to_bf16(float f)
{
	uint32_t u = kvt_f32_bits(f);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

/* Element i of a K/V/query tensor of the given kvt_dtype, as float. */
static inline float kvt_load(const void *base, size_t i, uint32_t dtype)
{
	uint16_t h = ((const uint16_t *)base)[i];
	return dtype == 2 ? kvt_bf16_to_f32(h) : kvt_f16_to_f32(h);
}

#endif
