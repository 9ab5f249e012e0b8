/* SPDX-License-Identifier: MIT */
/*
 * The CUDA runtime as the library needs it outside the kernels: finding the device and its PCI bus
 * id (for NUMA placement), whether the kernels can reach a caller's tensor, and the pinning and
 * device-memory hooks a cache's allocation context takes (the probe, unreachable and mem_hooks
 * slots of the backend table).
 */
#include "cuda_backend.h"

int gpu_probe(int device, char *busid, size_t n, struct kvt_err *why)
{
	int count = 0;
	cudaError_t e = cudaGetDeviceCount(&count);
	if (e != cudaSuccess)
		return kvt_err_set(why, -ENODEV, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
	if (device >= count)
		return kvt_err_set(why, -ENODEV, "device = %d but %d CUDA device(s) present", device,
				   count);
	e = cudaDeviceGetPCIBusId(busid, (int)n, device);
	if (e != cudaSuccess)
		return kvt_err_set(why, -ENODEV, "cudaDeviceGetPCIBusId: %s", cudaGetErrorString(e));
	return 0;
}

int gpu_find_device(const char *busid, int32_t *device, struct kvt_err *why)
{
	int d = -1;
	cudaError_t e = cudaDeviceGetByPCIBusId(&d, busid);
	if (e != cudaSuccess)
		return kvt_err_set(why, -ENODEV, "no CUDA device with that bus id (%s)",
				   cudaGetErrorString(e));
	*device = d;
	return 0;
}

static void *device_alloc(size_t bytes)
{
	void *p = NULL;
	return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static void device_free(void *p)
{
	cudaFree(p);
}

static int pin(void *p, size_t bytes)
{
	/* mapped, so kernels can read the host tier directly (zero-copy gather) */
	return cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) ==
			       cudaSuccess
		       ? 0
		       : -ENOMEM;
}

static void unpin(void *p)
{
	cudaHostUnregister(p);
}

uint32_t gpu_unreachable(kvt_cache *c, uint32_t n, const void *const p[], const char **why,
			 void *stream)
{
	const struct gpu_cache *b = c->be;
	enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	if (b->pageable_access)
		return n;
	/* not asked inside a capture: which runtime calls a capture tolerates is not ours to bet
	 * on */
	if (cudaStreamIsCapturing((cudaStream_t)stream, &st) != cudaSuccess) {
		(void)cudaGetLastError(); /* not sticky: the next launch must not see it */
		return n;
	}
	if (st != cudaStreamCaptureStatusNone)
		return n;
	for (uint32_t i = 0; i < n; i++) {
		struct cudaPointerAttributes a;
		if (!p[i])
			continue;
		if (cudaPointerGetAttributes(&a, p[i]) != cudaSuccess) {
			(void)cudaGetLastError();
			continue;
		}
		/* refused only where the runtime gives no device address for it: memory it does not
		 * know and cannot map (another allocator's device memory keeps its own address) */
		if (a.type == cudaMemoryTypeUnregistered && !a.devicePointer) {
			*why = "pageable host memory";
			return i;
		}
	}
	return n;
}

const struct kvt_mem_hooks gpu_mem_hooks = {
	.device_alloc = device_alloc,
	.device_free = device_free,
	.pin = pin,
	.unpin = unpin,
};
