/* SPDX-License-Identifier: MIT */
/*
 * The CUDA runtime as the library needs it outside the kernels: finding the device and its PCI bus
 * id (for NUMA placement), and the pinning and device-memory hooks of the allocator table.
 */
#include <cuda_runtime.h>
#include <stdio.h>

#include "../lib/internal.h"

int kvt_gpu_probe(int device, char *busid, size_t n, char *why, size_t whyn)
{
	int count = 0;
	cudaError_t e = cudaGetDeviceCount(&count);
	if (e != cudaSuccess) {
		snprintf(why, whyn, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
		return -ENODEV;
	}
	if (device >= count) {
		snprintf(why, whyn, "device = %d but %d CUDA device(s) present", device, count);
		return -ENODEV;
	}
	e = cudaDeviceGetPCIBusId(busid, (int)n, device);
	if (e != cudaSuccess) {
		snprintf(why, whyn, "cudaDeviceGetPCIBusId: %s", cudaGetErrorString(e));
		return -ENODEV;
	}
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

static const struct kvt_mem_hooks hooks = {
	.device_alloc = device_alloc,
	.device_free = device_free,
	.pin = pin,
	.unpin = unpin,
};

const struct kvt_mem_hooks *kvt_gpu_mem_hooks(void)
{
	return &hooks;
}
