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
	/* Events, for device time (NULL when this libcudart lacks one: then there is none).
	 * cudaEvent_t is a pointer; a NULL stream is the legacy default stream, which the library's
	 * calls given a NULL stream run on. */
	int (*event_create_)(void **);
	int (*event_record_)(void *, void *);
	int (*event_sync_)(void *);
	int (*event_elapsed_)(float *, void *, void *);
	int (*event_destroy_)(void *);
} cudart;

/* Load libcudart (.so, .so.12, .so.13) and its four functions. Returns 0, or -1 with *why naming
 * what failed (static or dlerror text). */
int cudart_open(cudart *cu, const char **why);
/* Unload; a zeroed or failed cudart is accepted. */
void cudart_close(cudart *cu);

#endif
