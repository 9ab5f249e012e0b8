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


def _paged_round_trip(c, dev):
    """read_rows_paged into a runtime's paged torch buffers (slots shuffled, padded slot and head
    strides, -1 skipping a token) gives read_rows' rows in their slots and leaves everything else
    as it was; write_rows_paged from those slots gives a sequence whose rows are read_rows'."""
    g = torch.Generator(device=dev).manual_seed(9)
    k = torch.randn(60, 2, 64, generator=g, device=dev, dtype=torch.float16)
    v = torch.randn(60, 2, 64, generator=g, device=dev, dtype=torch.float16)
    s = c.open()
    c.prefill(s, 0, None, k, v)
    big = torch.full((2, 64, 3, 80), 7.0, device=dev, dtype=torch.float16)
    kc, vc = big[0, :, :2, :64], big[1, :, :2, :64]   # slot stride 240, head stride 80
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:30]
    slots[4] = -1
    c.read_rows_paged(s, 0, 10, 40, kc, vc, slots)
    rk, rv = c.read_rows(s, 0, 10, 40)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot], torch.as_tensor(rk[i], device=dev))
            assert torch.equal(vc[slot], torch.as_tensor(rv[i], device=dev))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((kc[untouched.to(dev)] == 7).all()) and bool((big[:, :, 2] == 7).all())
    t = c.open()
    keep = slots[slots >= 0]
    c.write_rows_paged(t, 0, kc, vc, keep)
    wk, wv = c.read_rows(t, 0, 0, len(keep))
    assert torch.equal(torch.as_tensor(wk, device=dev), kc[keep.to(dev)])
    assert torch.equal(torch.as_tensor(wv, device=dev), vc[keep.to(dev)])


def test_cpu_paged_tensors():
    with kvtier.Cache(backend="cpu", p=1.0, **SHAPE) as c:
        _paged_round_trip(c, torch.device("cpu"))


def test_cuda_paged_tensors():
    with _cuda_cache(p=1.0) as c:
        _paged_round_trip(c, torch.device("cuda", 0))
        with pytest.raises(kvtier.Error, match="the cuda backend takes torch tensors"):
            z = np.zeros((4, 2, 64), np.float16)
            c.read_rows_paged(c.open(), 0, 0, 1, z, z, [0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_extend_matches_full_attention(dtype):
    """kvt_extend on the CUDA backend: two sequences of 300 and 40 prefilled tokens get
    chunks of 70 and 5 rows in one call; each query row's output equals full causal attention over
    the rows up to its own (float32 in torch) within the precision of the dtype; so does the same
    call with Top-p per query row (at p = 1 each row's selection is every indexed token before it)."""
    with _cuda_cache(p=1.0, dtype=dtype) as c:
        dev, dt = torch.device("cuda", 0), getattr(torch, dtype)
        g = torch.Generator(device=dev).manual_seed(5)
        hq, hkv, d = SHAPE["n_q_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]
        pre, new = [300, 40], [70, 5]
        rows = [(torch.randn(pre[i] + new[i], h, d, device=dev, generator=g) * sc).to(dt)
                for i in range(2) for h, sc in ((hq, 2.0), (hkv, 2.0), (hkv, 1.0))]
        seqs = [c.open(), c.open()]
        for i, s in enumerate(seqs):
            q, k, v = rows[3 * i: 3 * i + 3]
            c.prefill(s, 0, q[:pre[i]].contiguous(), k[:pre[i]].contiguous(),
                      v[:pre[i]].contiguous())
        cat = lambda j: torch.cat([rows[3 * i + j][pre[i]:] for i in range(2)])  # noqa: E731
        twins = [c.open(), c.open()]
        for i, s in enumerate(twins):
            q, k, v = rows[3 * i: 3 * i + 3]
            c.prefill(s, 0, q[:pre[i]].contiguous(), k[:pre[i]].contiguous(),
                      v[:pre[i]].contiguous())
        out = c.extend(0, seqs, new, cat(0), cat(1), cat(2))
        outp = c.extend(0, twins, new, cat(0), cat(1), cat(2), top_p=True)
        for ss in (seqs, twins):
            assert [c.length(s, 0) for s in ss] == [p + n for p, n in zip(pre, new)]
        for o in (out, outp):
            at = 0
            for i in range(2):
                q, k, v = (x.float() for x in rows[3 * i: 3 * i + 3])
                n, t = new[i], pre[i] + new[i]
                s = (q[pre[i]:].transpose(0, 1) @ k.repeat_interleave(hq // hkv, 1)
                     .permute(1, 2, 0)) * d ** -0.5
                s = s.masked_fill(~torch.ones(n, t, dtype=torch.bool, device=dev).tril(t - n),
                                  float("-inf"))
                ref = (s.softmax(-1) @ v.repeat_interleave(hq // hkv, 1).transpose(0, 1))
                err = (o[at:at + n].float() - ref.transpose(0, 1)).abs().max().item()
                assert err < (1e-2 if dtype == "float16" else 4e-2), (o is outp, i, err)
                at += n
