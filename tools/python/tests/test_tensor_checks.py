# SPDX-License-Identifier: MIT
"""The checks of torch tensors (dtype, shape, layout, device, autograd, stream) without torch: a
stand-in module with just the attributes kvtier reads is put in sys.modules for each test."""

import sys
import types

import pytest

import kvtier
from kvtier import _abi, _tensor


class FakeDevice:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index

    def __str__(self):
        return self.type if self.index is None else "%s:%d" % (self.type, self.index)


def fake_torch():
    t = types.ModuleType("torch")
    t.float16, t.bfloat16, t.float32, t.int32 = "torch.float16", "torch.bfloat16", \
        "torch.float32", "torch.int32"

    class Tensor:
        def __init__(self, shape, dtype, device=FakeDevice("cpu"), contiguous=True,
                     requires_grad=False):
            self.shape, self.dtype, self.device = tuple(shape), dtype, device
            self._contiguous, self.requires_grad = contiguous, requires_grad

        def is_contiguous(self):
            return self._contiguous

        def stride(self):
            return (1,) * len(self.shape)

        def data_ptr(self):
            return 0x1000

    class Stream:
        cuda_stream = 0xABC

    t.Tensor = Tensor
    t.cuda = types.SimpleNamespace(current_stream=lambda device: Stream())
    return t


@pytest.fixture
def torch(monkeypatch):
    t = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", t)
    return t


def check(x, shape=(2, 4, 64), dtype=_abi.DTYPE_BF16, backend="cuda", writable=False):
    return _tensor.pointer("q", x, shape, dtype, backend, 0, writable)


def test_cuda_tensor_accepted_with_its_stream(torch):
    x = torch.Tensor((2, 4, 64), torch.bfloat16, FakeDevice("cuda", 0))
    assert check(x) == 0x1000
    assert _tensor.stream_of([x], "cuda") == 0xABC
    assert _tensor.stream_of([x], "cpu") is None


@pytest.mark.parametrize("kw, want", [
    (dict(dtype="torch.float16"), "q: dtype torch.float16, want torch.bfloat16"),
    (dict(shape=(2, 4, 32)), "q: shape (2, 4, 32), want (2, 4, 64)"),
    (dict(contiguous=False), "q: not contiguous"),
    (dict(device=FakeDevice("cuda", 1)), "q: on device cuda:1, the cache is on cuda:0"),
    (dict(device=FakeDevice("cpu")), "q: on device cpu, the cache is on cuda:0"),
])
def test_cuda_tensor_refusals(torch, kw, want):
    args = dict(shape=(2, 4, 64), dtype=torch.bfloat16, device=FakeDevice("cuda", 0))
    args.update(kw)
    with pytest.raises(kvtier.Error) as ei:
        check(torch.Tensor(**args))
    assert ei.value.name == "EINVAL" and want in ei.value.detail


def test_cpu_backend_refuses_device_tensor(torch):
    x = torch.Tensor((2, 4, 64), torch.float16, FakeDevice("cuda", 0))
    with pytest.raises(kvtier.Error, match="the cache's backend is cpu"):
        check(x, dtype=_abi.DTYPE_F16, backend="cpu")


def test_output_with_autograd_refused(torch):
    x = torch.Tensor((2, 4, 64), torch.bfloat16, FakeDevice("cuda", 0), requires_grad=True)
    with pytest.raises(kvtier.Error, match="requires grad"):
        check(x, writable=True)
