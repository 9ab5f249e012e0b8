# SPDX-License-Identifier: MIT
"""Strided numpy views through kvt_prefill_at, kvt_append_at, kvt_attend_at, kvt_select_at and
kvt_extend_at on the CPU backend: a fused qkv projection split three ways and [B, H, T, D]
transposes are passed as they are (no copy in Python) and give, bit for bit, what contiguous copies
of them give; a strided out is written in its rows only. numpy only."""

import errno
import os

import numpy as np
import pytest

import kvtier
from kvtier import _abi

from conftest import HEADER, SHAPE, rand
from test_abi import header_fields

HQ, HKV, D = SHAPE["n_q_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]


def fused(rng, n):
    """q, k, v as the three views of one [n, HQ + 2 HKV, D] projection (not contiguous)."""
    qkv = rand(rng, n, HQ + 2 * HKV, D)
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    return q, k, v


def transposed(rng, n, heads):
    """A [n, heads, D] view of a [heads, n, D] array (the [B, H, T, D] layout)."""
    return rand(rng, heads, n, D).transpose(1, 0, 2)


def dense(*xs):
    return [None if x is None else np.ascontiguousarray(x) for x in xs]


def padded_out(n, dtype):
    """An out view with a gap after each head row, and the whole buffer (NaN bits elsewhere)."""
    buf = np.full((n, HQ, D + 8), np.nan, dtype=dtype)
    return buf[:, :, :D], buf


def test_strided_views_equal_contiguous_copies(rng):
    with kvtier.Cache(backend="cpu", p=0.9, out_dtype="float32", **SHAPE) as a, \
            kvtier.Cache(backend="cpu", p=0.9, out_dtype="float32", **SHAPE) as b:
        sa, sb = [a.open() for _ in range(3)], [b.open() for _ in range(3)]
        for layer in range(SHAPE["n_layers"]):
            for i, n in enumerate((200, 60, 7)):
                q, k, v = fused(rng, n) if i != 1 else \
                    (transposed(rng, n, HQ), transposed(rng, n, HKV), transposed(rng, n, HKV))
                a.prefill(sa[i], layer, q, k, v)
                b.prefill(sb[i], layer, *dense(q, k, v))
        for step in range(12):
            _, k, v = fused(rng, 3)
            a.append(step % 2, sa, k, v)
            b.append(step % 2, sb, *dense(k, v))
        for layer in range(SHAPE["n_layers"]):
            q = transposed(rng, 3, HQ)
            out, buf = padded_out(3, np.float32)
            assert a.attend(layer, sa, q, out=out) is out
            want = b.attend(layer, sb, np.ascontiguousarray(q))
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), layer
            assert np.isnan(buf[:, :, D:]).all(), "attend wrote outside out's rows"
        q = transposed(rng, 3, HQ)
        assert a.select(0, sa, q) == b.select(0, sb, np.ascontiguousarray(q))
        ga, gb = a.gather(0, sa, 1024, kv=False), b.gather(0, sb, 1024, kv=False)
        assert ga.total == gb.total and np.array_equal(ga.counts, gb.counts)
        for i in range(len(sa)):
            for h in range(HKV):
                c = ga.counts[i, h]
                assert np.array_equal(ga.pos[i, h, :c], gb.pos[i, h, :c]), (i, h)
        q, k, v = fused(rng, 9)
        out, buf = padded_out(9, np.float32)
        a.extend(1, sa, [4, 0, 5], q, k, v, out=out)
        want = b.extend(1, sb, [4, 0, 5], *dense(q, k, v))
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
        assert np.isnan(buf[:, :, D:]).all(), "extend wrote outside out's rows"
        for x, y in zip(sa, sb):
            for layer in range(SHAPE["n_layers"]):
                assert a.length(x, layer) == b.length(y, layer)
                ka, va = a.read_rows(x, layer, 0, a.length(x, layer))
                kb, vb = b.read_rows(y, layer, 0, b.length(y, layer))
                assert np.array_equal(ka.view(np.uint16), kb.view(np.uint16))
                assert np.array_equal(va.view(np.uint16), vb.view(np.uint16))


def test_views_refused_or_checked(cache, rng):
    s = cache.open()
    q, k, v = rand(rng, 8, HQ, D), rand(rng, 8, HKV, D), rand(rng, 8, HKV, D)
    with pytest.raises(kvtier.Error, match="k: not C-contiguous") as ei:
        cache.prefill(s, 0, q, k[::-1], v)  # a negative token stride: refused before C
    assert ei.value.code == -errno.EINVAL
    heads_overlap = np.lib.stride_tricks.as_strided(k, strides=(2 * D, 2 * D, 2))
    with pytest.raises(kvtier.Error, match=r"layout->k\.token_stride") as ei:
        cache.prefill(s, 0, q, heads_overlap, v)  # rows that overlap: C names the field
    assert ei.value.code == -errno.EINVAL
    assert cache.length(s, 0) == 0, "a refused call stored nothing"


@pytest.mark.skipif(not os.path.exists(HEADER), reason="lib/kvtier.h not beside the package")
@pytest.mark.parametrize("name,mirror", [("kvt_io_view", _abi.KvtIoView),
                                         ("kvt_io_layout", _abi.KvtIoLayout)])
def test_mirror_fields_match_header(name, mirror):
    with open(HEADER, encoding="utf-8") as f:
        want = header_fields(f.read(), name)
    assert [f[0] for f in mirror._fields_] == want
