/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend and tensors its kernels cannot reach (suite gpu): pageable host memory passed
 * where a device pointer belongs. Where the device cannot read pageable memory (no HMM or ATS), a
 * kvt_prefill, kvt_append, kvt_attend, kvt_extend, kvt_seq_read_rows and kvt_gather given such a
 * tensor return -EINVAL naming the call, the tensor and "pageable host memory", with nothing
 * changed, and the cache (and the process's CUDA context) serves the next call: before the check,
 * the kernel's illegal address poisoned the context for good. Pinned host memory is accepted, and
 * an attention written into it equals the one written into device memory, bit for bit. Where the
 * device reads pageable memory, the same calls must succeed instead. Exits 77 (skipped) when no
 * CUDA device is present.
 */
#include "gpu_pair.h"

enum { T0 = 512, EXT = 4 };

/* A call given pageable host memory: -EINVAL naming the tensor where the device cannot read it,
 * else served. */
static void refused(kvt_cache *c, int pageable, const char *what, int rc, const char *needle)
{
	const char *msg = kvt_last_error(c);
	if (pageable) {
		T_CHECK(rc >= 0, "%s on a device that reads pageable memory: %d (%s)", what, rc,
			msg);
		return;
	}
	T_CHECK(rc == -EINVAL && strstr(msg, needle) && strstr(msg, "pageable host memory"),
		"%s: got %d \"%s\", wanted -EINVAL naming \"%s\" and pageable host memory", what,
		rc, msg, needle);
}

static void test_reach(void **state)
{
	(void)state;
	kvt_config cfg = t_config(1, HQ, HKV, D, KVT_DTYPE_F16);
	cfg.backend = KVT_BACKEND_CUDA;
	kvt_cache *c = NULL;
	OK(NULL, kvt_cache_create(&cfg, &c));
	int pageable = 0;
	CU(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0));
	/* hk: T0 + 16 rows, room for kvt_gather's k_out where it is served */
	const size_t kvn = (size_t)(T0 + 16) * HKV * D, qn = (size_t)EXT * HQ * D;
	uint16_t *hk = malloc(2 * kvn), *hq = malloc(2 * qn);
	float *hout = malloc(sizeof(float) * qn), *pinned = NULL, *dout = NULL;
	void *dk = NULL, *dq = NULL;
	T_CHECK(hk && hq && hout, "out of host memory");
	t_rng rng;
	t_rng_seed(&rng, 31);
	t_fill(&rng, KVT_DTYPE_F16, kvn, 0.5, 1.0, hk, NULL);
	t_fill(&rng, KVT_DTYPE_F16, qn, 0.0, 1.0, hq, NULL);
	CU(cudaMalloc(&dk, 2 * kvn));
	CU(cudaMalloc(&dq, 2 * qn));
	CU(cudaMalloc((void **)&dout, sizeof(float) * qn));
	CU(cudaMallocHost((void **)&pinned, sizeof(float) * qn));
	CU(cudaMemcpy(dk, hk, 2 * kvn, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(dq, hq, 2 * qn, cudaMemcpyHostToDevice));
	uint32_t seq;
	OK(c, kvt_seq_open(c, &seq));
	OK(c, kvt_prefill(c, seq, 0, NULL, dk, dk, T0, NULL));
	const uint32_t cu[2] = {0, EXT};
	int32_t counts[HKV], *dpos = NULL;
	CU(cudaMalloc((void **)&dpos, sizeof(int32_t) * HKV * (T0 + 16)));
	refused(c, pageable, "kvt_prefill", kvt_prefill(c, seq, 0, NULL, hk, dk, 8, NULL),
		"kvt_prefill_at: k = ");
	refused(c, pageable, "kvt_append", kvt_append(c, 0, 1, &seq, dk, hk, NULL),
		"kvt_append_at: v = ");
	refused(c, pageable, "kvt_attend", kvt_attend(c, 0, 1, &seq, dq, hout, NULL),
		"kvt_attend_at: out = ");
	refused(c, pageable, "kvt_extend", kvt_extend(c, 0, 1, &seq, cu, hq, dk, dk, dout, 0, NULL),
		"kvt_extend_at: q = ");
	refused(c, pageable, "kvt_seq_read_rows", kvt_seq_read_rows(c, seq, 0, 0, 8, dk, hk, NULL),
		"kvt_seq_read_rows: v = ");
	OK(c, kvt_select(c, 0, 1, &seq, dq, NULL));
	refused(c, pageable, "kvt_gather",
		kvt_gather(c, 0, 1, &seq, T0 + 16, counts, dpos, hk, dk, NULL),
		"kvt_gather: k_out = ");
	if (!pageable)
		T_CHECK(kvt_seq_length(c, seq, 0) == T0,
			"length %lld after the refusals, wanted %d",
			(long long)kvt_seq_length(c, seq, 0), T0);
	/* the context is healthy: an attention into device memory, then into pinned host memory */
	OK(c, kvt_attend(c, 0, 1, &seq, dq, dout, NULL));
	CU(cudaMemcpy(hout, dout, sizeof(float) * HQ * D, cudaMemcpyDeviceToHost));
	OK(c, kvt_attend(c, 0, 1, &seq, dq, pinned, NULL));
	CU(cudaDeviceSynchronize());
	T_CHECK(!memcmp(hout, pinned, sizeof(float) * HQ * D),
		"an attention into pinned host memory differs from the one into device memory");
	print_message("pageable memory access %d: %s\n", pageable,
		      pageable ? "pageable pointers served" : "6 calls refused, context healthy");
	kvt_cache_destroy(c);
	CU(cudaFree(dk));
	CU(cudaFree(dq));
	CU(cudaFree(dout));
	CU(cudaFree(dpos));
	CU(cudaFreeHost(pinned));
	free(hk);
	free(hq);
	free(hout);
}

int main(void)
{
	if (!gpu_tests_start())
		return 77;
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_reach)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
