/* SPDX-License-Identifier: MIT */
/*
 * Device buffers of the CUDA backend, all through the library's allocator table (so the fault loops
 * reach them): zeroed allocation, growth that never happens while a stream is being captured into a
 * graph, and the wait of a stream for a layer's last index build.
 */
#include <stdio.h>

#include "cuda_backend.h"

bool gpu_capturing(void *stream)
{
	enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	if (cudaStreamIsCapturing((cudaStream_t)stream, &st) != cudaSuccess) {
		(void)cudaGetLastError();
		return true; /* unknown: do nothing that a capture forbids */
	}
	return st != cudaStreamCaptureStatusNone;
}

int gpu_refuse_capture(kvt_cache *c, void *stream, const char *why)
{
	enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	CU(c, cudaStreamIsCapturing((cudaStream_t)stream, &st));
	KVT_RETURN_IF(st != cudaStreamCaptureStatusNone, c, -EINVAL, "%s", why);
	return 0;
}

int gpu_no_capture(kvt_cache *c, void *stream, const char *what)
{
	char why[256];
	snprintf(why, sizeof why,
		 "%s needs device memory while the stream is being captured: run one step of the "
		 "same batch and context size before capturing",
		 what);
	return gpu_refuse_capture(c, stream, why);
}

void gpu_dfree(kvt_cache *c, void *p)
{
	kvt_mem_device_free(&c->mem, p, 0);
}

int gpu_settle(kvt_cache *c, const char *what)
{
	const cudaError_t e = cudaStreamSynchronize(0);
	KVT_RETURN_IF(e != cudaSuccess, c, -EIO, "waiting for %s on the default stream: %s", what,
		      cudaGetErrorString(e));
	return 0;
}

int gpu_dzero(kvt_cache *c, void *p, size_t bytes, const char *what)
{
	if (cudaMemset(p, 0, bytes) != cudaSuccess)
		return kvt_seterr(c, -EIO, "cudaMemset of %s failed", what);
	return gpu_settle(c, what);
}

int gpu_dalloc(kvt_cache *c, void **p, size_t bytes, const char *what)
{
	*p = kvt_mem_device_alloc(&c->mem, bytes ? bytes : 1);
	if (!*p)
		(void)cudaGetLastError(); /* not sticky: a later launch must not report it */
	KVT_RETURN_IF(!*p, c, -ENOMEM, "out of device memory allocating %zu bytes for %s", bytes,
		      what);
	const int rc = gpu_dzero(c, *p, bytes, what);
	if (rc < 0) {
		gpu_dfree(c, *p);
		*p = NULL;
	}
	return rc;
}

int gpu_pinned_alloc(kvt_cache *c, void **p, size_t bytes, const char *what)
{
	void *q = kvt_mem_alloc(KVT_MEM_PAGES, bytes);
	KVT_RETURN_IF(!q, c, -ENOMEM, "out of host memory for %s (%zu bytes)", what, bytes);
	if (kvt_mem_pin(&c->mem, q, bytes) < 0) {
		kvt_mem_free(KVT_MEM_PAGES, q, bytes);
		return kvt_seterr(c, -ENOMEM, "pinning %zu bytes of host memory for %s failed", bytes,
				  what);
	}
	*p = q;
	return 0;
}

void gpu_pinned_free(kvt_cache *c, void *p, size_t bytes)
{
	if (!p)
		return;
	kvt_mem_unpin(&c->mem, p, bytes);
	kvt_mem_free(KVT_MEM_PAGES, p, bytes);
}

/* Grow a device buffer to `need` bytes (contents not kept). */
int gpu_grow(kvt_cache *c, void **p, size_t *have, size_t need, void *stream, const char *what)
{
	if (need <= *have && *p)
		return 0;
	KVT_TRY(gpu_no_capture(c, stream, what));
	size_t want = need + need / 4;
	void *q = NULL;
	KVT_TRY(gpu_dalloc(c, &q, want, what));
	CU(c, cudaDeviceSynchronize()); /* the old buffer may still be read */
	gpu_dfree(c, *p);
	*p = q;
	*have = want;
	return 0;
}

int gpu_wait_index(kvt_cache *c, uint32_t layer, void *stream)
{
	struct gpu_layer *y = &gpu_of(c)->lay[layer];
	if (y->pending) {
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, y->indexed, 0));
		y->waited = stream;
		y->pending = false;
	} else if (y->waited != stream) {
		/* another stream than the one that waited: it must wait too */
		CU(c, cudaStreamWaitEvent((cudaStream_t)stream, y->indexed, 0));
		y->waited = stream;
	}
	return 0;
}
