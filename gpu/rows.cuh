/* SPDX-License-Identifier: MIT */
/*
 * Rows of a runtime's paged or strided K/V buffer to and from dense ones, on the device
 * (kvt_seq_read_rows_at and kvt_seq_write_rows_at on the CUDA backend): token i's K/V of KV head h
 * lies at element slot(i) * slot_stride + h * head_stride of the placed buffers, and at
 * (i * n_kv_heads + h) * d of the dense ones. The twin is lib/rows_layout.c (kvt_rows_gather) and
 * cpu_read_rows_at. C and C++.
 */
#ifndef KVT_GPU_ROWS_CUH
#define KVT_GPU_ROWS_CUH

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * n tokens' rows between dense [n, n_kv_heads, d] buffers (dk, dv) and placed ones (pk, pv),
 * elements of 2 bytes: to_placed scatters dense into placed (a token whose slot is negative is
 * skipped), else it gathers placed into dense.
 *   slots: device [n] slot of each token, or NULL (token i in slot i: a strided view)
 *   slot_stride, head_stride: in elements, as struct kvt_rows_map has them
 * 16-byte moves when every address and stride allows, else 2-byte ones. Returns 0, -EINVAL or
 * -EIO. Asynchronous, allocation-free.
 */
int kvt_gpu_rows_place(uint32_t d, uint32_t n_kv_heads, uint32_t n, const int64_t *slots,
		       uint64_t slot_stride, uint64_t head_stride, void *pk, void *pv, void *dk,
		       void *dv, int to_placed, void *stream);

#ifdef __cplusplus
}
#endif

#endif
