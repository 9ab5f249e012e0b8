/* SPDX-License-Identifier: MIT */
/* libcudart at run time (cudart.h). */
#include <dlfcn.h>
#include <string.h>

#include "cudart.h"

int cudart_open(cudart *cu, const char **why)
{
	static const char *const names[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
	for (size_t i = 0; i < sizeof names / sizeof names[0] && !cu->lib; i++)
		cu->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!cu->lib) {
		const char *e = dlerror();
		*why = e ? e : "libcudart.so not found";
		return -1;
	}
	*(void **)&cu->malloc_ = dlsym(cu->lib, "cudaMalloc");
	*(void **)&cu->free_ = dlsym(cu->lib, "cudaFree");
	*(void **)&cu->memcpy_ = dlsym(cu->lib, "cudaMemcpy");
	*(void **)&cu->sync_ = dlsym(cu->lib, "cudaDeviceSynchronize");
	*(void **)&cu->event_create_ = dlsym(cu->lib, "cudaEventCreate");
	*(void **)&cu->event_record_ = dlsym(cu->lib, "cudaEventRecord");
	*(void **)&cu->event_sync_ = dlsym(cu->lib, "cudaEventSynchronize");
	*(void **)&cu->event_elapsed_ = dlsym(cu->lib, "cudaEventElapsedTime");
	*(void **)&cu->event_destroy_ = dlsym(cu->lib, "cudaEventDestroy");
	if (!cu->event_create_ || !cu->event_record_ || !cu->event_sync_ || !cu->event_elapsed_ ||
	    !cu->event_destroy_)
		cu->event_create_ = NULL; /* device time is then not measured */
	if (!cu->malloc_ || !cu->free_ || !cu->memcpy_ || !cu->sync_) {
		*why = "cudaMalloc, cudaFree, cudaMemcpy or cudaDeviceSynchronize missing";
		cudart_close(cu);
		return -1;
	}
	return 0;
}

void cudart_close(cudart *cu)
{
	if (cu->lib)
		dlclose(cu->lib);
	memset(cu, 0, sizeof *cu);
}
