/* SPDX-License-Identifier: MIT */
/* The backend table: which implementation of the pipeline a cache gets. */
#include "internal.h"

#if !KVT_HAVE_CUDA_BACKEND
/* The slot the CUDA backend (gpu/) fills when it is built. */
const struct kvt_backend_ops *const kvt_cuda_backend_ops = NULL;
#endif
