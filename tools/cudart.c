/* SPDX-License-Identifier: MIT */
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
