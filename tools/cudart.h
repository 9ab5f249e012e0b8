/* SPDX-License-Identifier: MIT */
/*
 * The CUDA runtime for the tools, found at run time with dlopen: kvbench needs no CUDA header and
 * runs where no CUDA is installed; with the CUDA backend its "device" buffers come from here.
 */
#ifndef KVBENCH_CUDART_H
#define KVBENCH_CUDART_H

#include <stddef.h>

enum { CUDART_H2D = 1, CUDART_D2H = 2 }; /* cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost */

typedef struct cudart {
	void *lib;
	int (*malloc_)(void **, size_t);
	int (*free_)(void *);
	int (*memcpy_)(void *, const void *, size_t, int);
	int (*sync_)(void); /* cudaDeviceSynchronize: the library's calls are asynchronous */
} cudart;

/* Load libcudart (.so, .so.12, .so.13) and its four functions. Returns 0, or -1 with *why naming
 * what failed (static or dlerror text). */
int cudart_open(cudart *cu, const char **why);
/* Unload; a zeroed or failed cudart is accepted. */
void cudart_close(cudart *cu);

#endif
