/* SPDX-License-Identifier: MIT */
/*
 * Seeded random rotations, bit-identical on every IEEE-754 platform: the generator is integer-only,
 * the Gaussian transform and the QR use only +, -, *, / and sqrt (all correctly rounded), and the
 * build disables contraction into FMA (-ffp-contract=off). libm's log is not used because its last
 * bit differs between libm versions.
 */
#include <math.h>

#include "internal.h"

static uint64_t splitmix64(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in (-1, 1), exact multiples of 2^-52. */
static double uniform_pm1(uint64_t *s)
{
	return (double)(splitmix64(s) >> 11) * (1.0 / 4503599627370496.0) - 1.0;
}

/* Natural log of x > 0 by range reduction and the atanh series; accurate to about 1 ulp. */
static double det_log(double x)
{
	int e;
	double m = frexp(x, &e); /* exact: x = m * 2^e, m in [0.5, 1) */
	if (m < 0.70710678118654752) {
		m *= 2.0;
		e -= 1;
	}
	double t = (m - 1.0) / (m + 1.0), t2 = t * t, term = t, sum = 0.0;
	for (int k = 1; k < 40; k += 2) {
		sum += term / k;
		term *= t2;
	}
	return (double)e * 0.69314718055994530942 + 2.0 * sum;
}

/* Marsaglia's polar method: two standard normals per accepted pair. */
static void gaussian_fill(uint64_t *s, double *out, size_t n)
{
	size_t i = 0;
	while (i < n) {
		double u = uniform_pm1(s), v = uniform_pm1(s), q = u * u + v * v;
		if (q >= 1.0 || q == 0.0)
			continue;
		double f = sqrt(-2.0 * det_log(q) / q);
		out[i++] = u * f;
		if (i < n)
			out[i++] = v * f;
	}
}

/* a[k.., k..] -= 2 v (v^T a[k.., k..]) for the unit reflector v, by rows so the loops over j vectorize;
 * each dot[j] still sums over i in increasing order. dot: d doubles. */
static void reflect(uint32_t d, uint32_t k, const double *v, double *a, double *dot, uint32_t j0)
{
	for (uint32_t j = j0; j < d; j++)
		dot[j] = 0.0;
	for (uint32_t i = k; i < d; i++)
		for (uint32_t j = j0; j < d; j++)
			dot[j] += v[i] * a[(size_t)i * d + j];
	for (uint32_t i = k; i < d; i++)
		for (uint32_t j = j0; j < d; j++)
			a[(size_t)i * d + j] -= 2.0 * dot[j] * v[i];
}

/*
 * Householder QR of the d x d matrix a (row-major), in place: on return a holds Q * diag(sign R_ii),
 * which is Haar distributed when a is Gaussian. v: d * d doubles for the unit reflectors,
 * sgn and dot: d doubles each.
 */
static void haar_qr(uint32_t d, double *a, double *v, double *sgn, double *dot)
{
	for (uint32_t k = 0; k < d; k++) {
		double *vk = v + (size_t)k * d, norm = 0.0, vn = 0.0;
		for (uint32_t i = k; i < d; i++)
			norm += a[(size_t)i * d + k] * a[(size_t)i * d + k];
		norm = sqrt(norm);
		double alpha = a[(size_t)k * d + k] > 0 ? -norm : norm; /* R_kk, sign chosen for stability */
		for (uint32_t i = 0; i < d; i++)
			vk[i] = i < k ? 0.0 : a[(size_t)i * d + k];
		vk[k] -= alpha;
		for (uint32_t i = k; i < d; i++)
			vn += vk[i] * vk[i];
		double inv = vn > 0.0 ? 1.0 / sqrt(vn) : 0.0;
		for (uint32_t i = k; i < d; i++)
			vk[i] *= inv;
		reflect(d, k, vk, a, dot, k);
		sgn[k] = alpha < 0 ? -1.0 : 1.0;
	}
	/* Q = H_0 H_1 ... H_{d-1}: the reflectors applied to the identity in reverse order */
	for (size_t i = 0; i < (size_t)d * d; i++)
		a[i] = 0.0;
	for (uint32_t i = 0; i < d; i++)
		a[(size_t)i * d + i] = 1.0;
	for (uint32_t k = d; k-- > 0;)
		reflect(d, k, v + (size_t)k * d, a, dot, 0);
	for (uint32_t i = 0; i < d; i++)
		for (uint32_t j = 0; j < d; j++)
			a[(size_t)i * d + j] *= sgn[j];
}

int kvt_rotation_generate(uint64_t seed, uint32_t layer, uint32_t d, float *rot)
{
	size_t n = (size_t)d * d, bytes = sizeof(double) * (2 * n + 2 * d);
	double *a = kvt_mem_alloc(KVT_MEM_HOST, bytes);
	if (!a)
		return -ENOMEM;
	/* one independent stream per (seed, layer) */
	uint64_t s = seed ^ (0xd1b54a32d192ed03ull * ((uint64_t)layer + 1));
	splitmix64(&s);
	gaussian_fill(&s, a, n);
	haar_qr(d, a, a + n, a + 2 * n, a + 2 * n + d);
	/* P = Q; rot = P^T so that y = rot r */
	for (uint32_t i = 0; i < d; i++)
		for (uint32_t j = 0; j < d; j++)
			rot[(size_t)i * d + j] = (float)a[(size_t)j * d + i];
	kvt_mem_free(KVT_MEM_HOST, a, bytes);
	return 0;
}
