# SPDX-License-Identifier: MIT
"""torch tensors: CPU tensors with the CPU backend; CUDA tensors with the CUDA backend (on the
current stream). Skips where torch, a CUDA build of libkvtier or a GPU is missing."""

import errno

import numpy as np
import pytest

import kvtier

from conftest import SHAPE

torch = pytest.importorskip("torch", reason="torch is not installed")


def test_cpu_tensors_round_trip():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(90, 4, 64, generator=g).half()
    k = torch.randn(90, 2, 64, generator=g).half()
    v = torch.randn(90, 2, 64, generator=g).half()
    with kvtier.Cache(backend="cpu", p=1.0, **SHAPE) as c:
        s = c.open()
        c.prefill(s, 0, q, k, v)
        out = c.attend(0, [s], q[-1:].contiguous())
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[-1:].transpose(0, 1).float(), k.repeat_interleave(2, 1).transpose(0, 1).float(),
            v.repeat_interleave(2, 1).transpose(0, 1).float()).transpose(0, 1)
        assert (out.float() - ref).abs().max().item() < 4e-3
        with pytest.raises(kvtier.Error, match="not contiguous") as ei:
            c.prefill(s, 0, q, torch.randn(90, 64, 2, generator=g).half().transpose(1, 2), v)
        assert ei.value.errno == errno.EINVAL
        with pytest.raises(kvtier.Error, match="dtype torch.bfloat16"):
            c.prefill(s, 0, q, k.bfloat16(), v)


def _cuda_cache(**kw):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    if not kvtier.probe().cuda_built:
        pytest.skip("this libkvtier was built without the CUDA backend")
    return kvtier.Cache(backend="cuda", **SHAPE, **kw)


def test_cuda_tensors_round_trip():
    with _cuda_cache(p=1.0, dtype="bfloat16") as c:
        dev = torch.device("cuda", 0)
        q = torch.randn(300, 4, 64, device=dev, dtype=torch.bfloat16)
        k = torch.randn(300, 2, 64, device=dev, dtype=torch.bfloat16)
        v = torch.randn(300, 2, 64, device=dev, dtype=torch.bfloat16)
        s = c.open()
        c.prefill(s, 0, q, k, v)
        out = c.attend(0, [s], q[-1:].contiguous())
        assert out.device == dev and out.dtype == torch.bfloat16
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[-1:].transpose(0, 1).float(), k.repeat_interleave(2, 1).transpose(0, 1).float(),
            v.repeat_interleave(2, 1).transpose(0, 1).float()).transpose(0, 1)
        assert (out.float() - ref).abs().max().item() < 2e-2
        with pytest.raises(kvtier.Error, match="the cache is on cuda:0"):
            c.prefill(s, 0, q.cpu(), k.cpu(), v.cpu())
        with pytest.raises(kvtier.Error, match="numpy array"):
            c.prefill(s, 0, None, np.zeros((1, 2, 64), np.uint16), np.zeros((1, 2, 64), np.uint16))


def _strided_round_trip(c, dev):
    """A fused qkv projection split three ways and a [B, H, T, D] transpose, as torch views (no
    copy), give bit for bit what contiguous copies give, in a second cache of the same config."""
    g = torch.Generator(device=dev).manual_seed(5)
    dt = torch.float16
    qkv = torch.randn(120, 8, 64, generator=g, device=dev, dtype=dt)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert not (q.is_contiguous() or k.is_contiguous())
    s = [c[0].open() for _ in range(2)]
    t = [c[1].open() for _ in range(2)]
    for i in range(2):
        c[0].prefill(s[i], 0, q, k, v)
        c[1].prefill(t[i], 0, q.contiguous(), k.contiguous(), v.contiguous())
    qt = torch.randn(4, 2, 64, generator=g, device=dev, dtype=dt).transpose(0, 1)
    assert not qt.is_contiguous()
    a = c[0].attend(0, s, qt)
    b = c[1].attend(0, t, qt.contiguous())
    assert torch.equal(a, b)


def test_cpu_strided_tensors():
    with kvtier.Cache(backend="cpu", p=0.9, **SHAPE) as a, \
            kvtier.Cache(backend="cpu", p=0.9, **SHAPE) as b:
        _strided_round_trip((a, b), torch.device("cpu"))


def test_cuda_strided_tensors():
    with _cuda_cache(p=0.9) as a, _cuda_cache(p=0.9) as b:
        _strided_round_trip((a, b), torch.device("cuda", 0))
