# SPDX-License-Identifier: MIT
"""Checking numpy arrays and torch tensors before their pointers are handed to C.

Nothing here copies or converts: an argument that is not exactly what the C function reads (dtype,
shape, device, dense row-major layout, or for the calls taking a kvt_io_layout a numpy or torch
view with contiguous rows) is refused with an Error naming it.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

from . import _abi
from .errors import refuse

DTYPE_I32 = -1  # not a kvt_dtype: int32 positions of kvt_gather
DTYPE_NAMES = {_abi.DTYPE_F16: "float16", _abi.DTYPE_BF16: "bfloat16", _abi.DTYPE_F32: "float32",
               DTYPE_I32: "int32"}


def _torch():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _numpy_dtype_ok(arr: Any, kvt_dtype: int) -> bool:
    import numpy as np
    if kvt_dtype == _abi.DTYPE_F16:
        return arr.dtype == np.float16
    if kvt_dtype == _abi.DTYPE_BF16:  # numpy has no bfloat16: raw bf16 bits in uint16
        return arr.dtype == np.uint16
    return arr.dtype == np.float32


def _torch_dtype_ok(t: Any, kvt_dtype: int) -> bool:
    torch = _torch()
    want = {_abi.DTYPE_F16: torch.float16, _abi.DTYPE_BF16: torch.bfloat16,
            _abi.DTYPE_F32: torch.float32}[kvt_dtype]
    return t.dtype == want


def pointer(name: str, x: Any, shape: Tuple[int, ...], kvt_dtype: int, backend: str,
            device: int, writable: bool = False, strided: bool = False) -> int:
    """The address of `x` after checking it against what C reads.

    Args:
        name: the argument's name, for the error text.
        x: a numpy.ndarray (CPU backend) or a torch.Tensor (CPU tensor for the CPU backend, CUDA
            tensor on the cache's device for the CUDA backend).
        shape: the exact shape wanted.
        kvt_dtype: DTYPE_F16 / DTYPE_BF16 / DTYPE_F32 (numpy: float16 / uint16 bf16 bits /
            float32).
        backend: "cpu" or "cuda".
        device: the CUDA device ordinal of the cache.
        writable: the C function writes into x.
        strided: x may be a strided view with contiguous rows (row_strides,
            torch_row_strides); the caller passes its strides on (strided_pointer).
    """
    if is_torch(x):
        if not _torch_dtype_ok(x, kvt_dtype):
            raise refuse("%s: dtype %s, want torch.%s" % (name, x.dtype, DTYPE_NAMES[kvt_dtype]))
        if tuple(x.shape) != tuple(shape):
            raise refuse("%s: shape %s, want %s" % (name, tuple(x.shape), tuple(shape)))
        if not x.is_contiguous() and (not strided or torch_row_strides(x) is None):
            raise refuse("%s: not contiguous (strides %s)%s: pass a dense row-major tensor "
                         "(.contiguous() copies)"
                         % (name, tuple(x.stride()), ", nor rows of contiguous head_dim elements "
                            "at positive token and head strides" if strided else ""))
        if backend == "cuda":
            if x.device.type != "cuda" or x.device.index != device:
                raise refuse("%s: on device %s, the cache is on cuda:%d"
                             % (name, x.device, device))
        elif x.device.type != "cpu":
            raise refuse("%s: on device %s, the cache's backend is cpu (host pointers)"
                         % (name, x.device))
        if writable and x.requires_grad:
            raise refuse("%s: requires grad; pass a tensor without autograd history" % name)
        return x.data_ptr()
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None and isinstance(x, np.ndarray):
        if backend != "cpu":
            raise refuse("%s: a numpy array (host memory), the cache's backend is %s "
                         "(device pointers: pass torch CUDA tensors)" % (name, backend))
        if not _numpy_dtype_ok(x, kvt_dtype):
            want = {_abi.DTYPE_F16: "float16", _abi.DTYPE_BF16: "uint16 (bfloat16 bits)",
                    _abi.DTYPE_F32: "float32"}[kvt_dtype]
            raise refuse("%s: dtype %s, want %s" % (name, x.dtype, want))
        if tuple(x.shape) != tuple(shape):
            raise refuse("%s: shape %s, want %s" % (name, tuple(x.shape), tuple(shape)))
        if not x.flags.c_contiguous and (not strided or row_strides(x) is None):
            raise refuse("%s: not C-contiguous (strides %s)%s: pass a dense row-major array "
                         "(numpy.ascontiguousarray copies)"
                         % (name, x.strides, ", nor rows of contiguous head_dim elements at "
                            "positive token and head strides" if strided else ""))
        if writable and not x.flags.writeable:
            raise refuse("%s: read-only array" % name)
        return x.ctypes.data
    raise refuse("%s: a %s, want a numpy.ndarray or a torch.Tensor" % (name, type(x).__name__))


def row_strides(x: Any) -> Optional[Tuple[int, int]]:
    """(token_stride, head_stride) in elements of a numpy [n, heads, head_dim] array whose
    head_dim elements are contiguous and whose token and head strides are positive multiples of
    the element size (a dimension of one row or head: 0, the default), else None. The library
    checks the rest (rows that overlap are refused there)."""
    it = x.itemsize
    if x.ndim != 3 or (x.shape[2] > 1 and x.strides[2] != it):
        return None
    out = []
    for n, s in zip(x.shape[:2], x.strides[:2]):
        if n == 1:
            out.append(0)
        elif s <= 0 or s % it:
            return None
        else:
            out.append(s // it)
    return out[0], out[1]


def torch_row_strides(x: Any) -> Optional[Tuple[int, int]]:
    """row_strides for a torch [n, heads, head_dim] tensor (its strides are in elements)."""
    if x.dim() != 3 or (x.shape[2] > 1 and x.stride(2) != 1):
        return None
    out = []
    for n, s in zip(x.shape[:2], x.stride()[:2]):
        if n == 1:
            out.append(0)
        elif s <= 0:
            return None
        else:
            out.append(s)
    return out[0], out[1]


def strided_pointer(name: str, x: Any, shape: Tuple[int, ...], kvt_dtype: int, backend: str,
                    device: int, writable: bool = False) -> Tuple[int, Optional[Tuple[int, int]]]:
    """pointer() for a q, k, v or out of the calls that take a kvt_io_layout: a numpy array may
    also be a strided view whose head_dim elements are contiguous (a fused qkv projection split
    three ways, a [B, H, T, D] transpose), passed as it is, not copied; so may a torch tensor (on
    either backend: the CUDA backend copies strided device tensors with cudaMemcpy2DAsync).
    Returns the address and None (dense) or the (token_stride, head_stride) of its kvt_io_view in
    elements."""
    addr = pointer(name, x, shape, kvt_dtype, backend, device, writable, strided=True)
    if is_torch(x):
        return addr, None if x.is_contiguous() else torch_row_strides(x)
    if x.flags.c_contiguous:
        return addr, None
    return addr, row_strides(x)


def empty_like_kind(ref: Any, shape: Sequence[int], kvt_dtype: int) -> Any:
    """A new uninitialised output of `shape` of the same kind (numpy / torch, device) as `ref`."""
    if is_torch(ref):
        torch = _torch()
        dt = {_abi.DTYPE_F16: torch.float16, _abi.DTYPE_BF16: torch.bfloat16,
              _abi.DTYPE_F32: torch.float32, DTYPE_I32: torch.int32}[kvt_dtype]
        return torch.empty(tuple(shape), dtype=dt, device=ref.device)
    import numpy as np
    dt = {_abi.DTYPE_F16: np.float16, _abi.DTYPE_BF16: np.uint16,
          _abi.DTYPE_F32: np.float32, DTYPE_I32: np.int32}[kvt_dtype]
    return np.empty(tuple(shape), dtype=dt)


def stream_of(xs: Sequence[Any], backend: str) -> Optional[int]:
    """The CUDA stream to pass: torch's current stream on the tensors' device (CUDA backend), else
    NULL."""
    if backend != "cuda":
        return None
    for x in xs:
        if is_torch(x) and x.device.type == "cuda":
            return _torch().cuda.current_stream(x.device).cuda_stream or None
    return None


def slot_pointer(name: str, x: Any, n: Optional[int], kind: str, backend: str,
                 device: int) -> "tuple[int, int]":
    """(address, length) of a kvt_graph_batch buffer: int32 (kind "int32") or uint8 / bool
    (kind "uint8") elements, one dimension, contiguous: a numpy array or CPU tensor for the CPU
    backend, a CUDA tensor on the cache's device for the CUDA backend (read when the step
    runs). n: the length wanted (None: any)."""
    if is_torch(x):
        torch = _torch()
        ok = {"int32": (torch.int32,), "uint8": (torch.uint8, torch.bool)}[kind]
        if x.dtype not in ok:
            raise refuse("%s: dtype %s, want torch.%s" % (name, x.dtype, kind))
        on_cuda = x.device.type == "cuda"
        if on_cuda != (backend == "cuda") or (on_cuda and x.device.index != device):
            raise refuse("%s: on %s, the %s backend reads it %s" % (
                name, x.device, backend,
                "on cuda:%d" % device if backend == "cuda" else "on the host"))
        if x.dim() != 1 or not x.is_contiguous():
            raise refuse("%s: want a contiguous 1-D tensor, got shape %s strides %s"
                         % (name, tuple(x.shape), tuple(x.stride())))
        length, ptr = int(x.shape[0]), x.data_ptr()
    else:
        import numpy as np
        if not isinstance(x, np.ndarray):
            raise refuse("%s: a %s, want a numpy.ndarray or a torch.Tensor"
                         % (name, type(x).__name__))
        if backend != "cpu":
            raise refuse("%s: a numpy array (host memory), the cuda backend reads it on the "
                         "device: pass a torch CUDA tensor" % name)
        ok = {"int32": (np.int32,), "uint8": (np.uint8, np.bool_)}[kind]
        if x.dtype.type not in ok or x.ndim != 1 or not x.flags.c_contiguous:
            raise refuse("%s: want a contiguous 1-D %s array, got %s %s"
                         % (name, kind, x.dtype, x.shape))
        length, ptr = int(x.shape[0]), x.ctypes.data
    if n is not None and length != n:
        raise refuse("%s: %d elements, want %d (one per slot)" % (name, length, n))
    return ptr, length
