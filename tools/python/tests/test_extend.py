# SPDX-License-Identifier: MIT
"""Cache.extend (kvt_extend) on the CPU backend with numpy: several new tokens per sequence attend
everything stored before them, causally; a varlen batch with an empty entry; bit-equal to
appending the tokens one at a time at p = 1; refusals that change nothing; with top_p, each
sequence's last row bit-equal to attend of its query right after."""

import errno

import numpy as np
import pytest

import kvtier

from conftest import SHAPE, rand

HQ, HKV, D = SHAPE["n_q_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]


def causal(q, k, v, first, scale):
    """float64 reference: q [n, Hq, D] are tokens first .. first + n - 1 over k, v [first + n, Hkv,
    D]; row j attends tokens 0 .. first + j."""
    out = np.empty(q.shape, dtype=np.float64)
    g = q.shape[1] // k.shape[1]
    for j in range(q.shape[0]):
        for h in range(q.shape[1]):
            kh = k[:first + j + 1, h // g].astype(np.float64)
            vh = v[:first + j + 1, h // g].astype(np.float64)
            s = kh @ q[j, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[j, h] = (w / w.sum()) @ vh
    return out


def test_varlen_batch_matches_causal_reference(rng):
    with kvtier.Cache(backend="cpu", out_dtype="float32", **SHAPE) as c:
        seqs = [c.open(), c.open(), c.open()]
        pre = [40, 300, 9]
        ks = [rand(rng, n, HKV, D) for n in pre]
        vs = [rand(rng, n, HKV, D) for n in pre]
        for s, n, k, v in zip(seqs, pre, ks, vs):
            c.prefill(s, 1, rand(rng, n, HQ, D), k, v)
        lengths = [7, 0, 12]
        total = sum(lengths)
        q, k, v = rand(rng, total, HQ, D), rand(rng, total, HKV, D), rand(rng, total, HKV, D)
        out = c.extend(1, seqs, lengths, q, k, v)
        assert out.dtype == np.float32 and out.shape == (total, HQ, D)
        row = 0
        for i, n in enumerate(lengths):
            if n:
                kk = np.concatenate([ks[i], k[row:row + n]])
                vv = np.concatenate([vs[i], v[row:row + n]])
                want = causal(q[row:row + n], kk, vv, pre[i], D ** -0.5)
                assert np.abs(out[row:row + n] - want).max() < 1e-4
            assert c.length(seqs[i], 1) == pre[i] + n
            assert c.length(seqs[i], 0) == 0
            row += n


def test_equals_append_and_attend_at_p1(rng):
    q, k, v = rand(rng, 60, HQ, D), rand(rng, 60, HKV, D), rand(rng, 60, HKV, D)
    with kvtier.Cache(backend="cpu", **SHAPE) as a, \
            kvtier.Cache(backend="cpu", p=1.0, **SHAPE) as b:
        sa, sb = a.open(), b.open()
        got = [a.extend(0, [sa], [n], q[i:i + n], k[i:i + n], v[i:i + n])
               for i, n in ((0, 25), (25, 1), (26, 34))]
        got = np.concatenate(got)
        want = np.empty_like(got)
        for t in range(60):
            b.append(0, [sb], k[t:t + 1], v[t:t + 1])
            want[t:t + 1] = b.attend(0, [sb], q[t:t + 1])
        assert got.tobytes() == want.tobytes()


def test_refusals_change_nothing(cache, rng):
    s = cache.open()
    cache.prefill(s, 0, None, rand(rng, 10, HKV, D), rand(rng, 10, HKV, D))
    q, k, v = rand(rng, 3, HQ, D), rand(rng, 3, HKV, D), rand(rng, 3, HKV, D)
    with pytest.raises(kvtier.Error, match="lengths"):
        cache.extend(0, [s], [1, 2], q, k, v)
    with pytest.raises(kvtier.Error, match="shape"):
        cache.extend(0, [s], [2], q, k, v)
    with pytest.raises(kvtier.Error) as e:
        cache.extend(0, [s], [0], q[:0], k[:0], v[:0])
    assert e.value.code == -errno.EINVAL and "total 0" in str(e.value)
    bad = k.copy()
    bad[1, 1, 5] = np.inf
    with pytest.raises(kvtier.Error, match=r"k\[1, 1, 5\] = inf"):
        cache.extend(0, [s], [3], q, bad, v)
    assert cache.length(s, 0) == 10


def test_top_p_last_row_equals_attend(rng):
    with kvtier.Cache(backend="cpu", out_dtype="float32", budget_min=8, **SHAPE) as c, \
            kvtier.Cache(backend="cpu", out_dtype="float32", budget_min=8, **SHAPE) as e:
        seqs, exact = [c.open(), c.open()], [e.open(), e.open()]
        for s, x, n in zip(seqs, exact, (300, 120)):
            q, k, v = rand(rng, n, HQ, D), rand(rng, n, HKV, D), rand(rng, n, HKV, D)
            c.prefill(s, 1, q, k, v)
            e.prefill(x, 1, q, k, v)
        lengths = [40, 5]
        total = sum(lengths)
        q, k, v = rand(rng, total, HQ, D), rand(rng, total, HKV, D), rand(rng, total, HKV, D)
        steps = c.stats().steps
        out = c.extend(1, seqs, lengths, q, k, v, top_p=True)
        assert c.stats().steps == steps + total  # a Top-p row counts as a step
        last = [lengths[0] - 1, total - 1]
        want = c.attend(1, seqs, q[last])
        assert out[last].tobytes() == want.tobytes()
        # the selection is selective here: some row differs from exact attention
        assert out.tobytes() != e.extend(1, exact, lengths, q, k, v).tobytes()
