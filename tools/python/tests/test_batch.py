# SPDX-License-Identifier: MIT
"""kvtier.hf's batch bookkeeping without torch (kvtier._batch, CPU backend): the row plans of
reorder_cache / batch_repeat_interleave / batch_select_indices, forks that follow their source
rows and roll back on failure, and crop's length rule (transformers' DynamicLayer.crop)."""

import errno

import numpy as np
import pytest

import kvtier
from kvtier import _batch

from conftest import SHAPE, rand

D, HQ, HKV, L = SHAPE["head_dim"], SHAPE["n_q_heads"], SHAPE["n_kv_heads"], SHAPE["n_layers"]


def test_as_rows_and_plan():
    assert _batch.as_rows([2, 0, 0], 3) == [2, 0, 0]
    assert _batch.as_rows(np.array([1, -1]), 3) == [1, 2]          # negative from the end
    assert _batch.as_rows(np.int64(1), 3) == [1]
    assert _batch.as_rows(np.array([True, False, True]), 3) == [0, 2]
    assert _batch.as_rows(range(2), 3) == [0, 1]
    with pytest.raises(IndexError, match="row 3 of a batch of 3"):
        _batch.as_rows([0, 3], 3)
    with pytest.raises(IndexError, match="boolean mask of 2"):
        _batch.as_rows(np.array([True, False]), 3)
    with pytest.raises(ValueError, match="2-D"):
        _batch.as_rows(np.zeros((2, 2), dtype=np.int64), 3)
    with pytest.raises(TypeError):
        _batch.as_rows([0.5], 3)

    p = _batch.plan([2, 0, 0], 3)                  # beam search: row 1 dropped, row 0 doubled
    assert p.sources == [2, 0, 0] and p.forks == [2] and p.close == [1] and not p.identity
    p = _batch.plan([0, 0, 0], 3)                  # the first step of beam search
    assert p.forks == [1, 2] and p.close == [1, 2]
    assert _batch.plan([0, 1, 2], 3).identity
    p = _batch.plan([1, 0], 2)                      # a permutation: no kvtier call
    assert not p.identity and not p.forks and not p.close
    p = _batch.plan([1], 3)                         # batch_select_indices
    assert p.forks == [] and p.close == [0, 2]
    with pytest.raises(ValueError, match="empty batch"):
        _batch.plan([], 3)

    assert _batch.repeat_rows(2, 3) == [0, 0, 0, 1, 1, 1]
    assert _batch.repeat_rows(0, 3) == []
    p = _batch.plan(_batch.repeat_rows(2, 2), 2)
    assert p.forks == [1, 3] and p.close == []
    with pytest.raises(ValueError, match="repeats = 0"):
        _batch.repeat_rows(2, 0)


@pytest.mark.parametrize("current, arg, want", [
    (10, 5, 5), (10, 10, None), (10, 12, None), (10, 0, 0),
    (10, -3, 7), (10, -10, 0), (10, -12, 0), (0, 4, None), (0, -1, None)])
def test_crop_target(current, arg, want):
    """As transformers' DynamicLayer.crop: a negative max_length drops that many tokens."""
    assert _batch.crop_target(current, arg) == want
    assert _batch.crop_target(current, np.int64(arg)) == want


def _filled(rng, c, n, tokens=40):
    """n sequences with distinct K/V on every layer; returns them and their rows."""
    seqs, rows = [], []
    for _ in range(n):
        s = c.open()
        k, v = rand(rng, tokens, HKV, D), rand(rng, tokens, HKV, D)
        for layer in range(L):
            c.prefill(s, layer, None, k, v)
        seqs.append(s)
        rows.append((k, v))
    return seqs, rows


def test_fork_rows_follow_their_sources(rng):
    with kvtier.Cache(backend="cpu", p=1.0, max_seqs=8, **SHAPE) as c:
        seqs, rows = _filled(rng, c, 3)
        q = rand(rng, 1, HQ, D)
        want = [[c.attend(layer, s, q) for layer in range(L)] for s in seqs]
        p = _batch.plan([2, 0, 0], 3)
        new, old = _batch.fork_rows(c, seqs, p)
        assert new[0] is seqs[2] and new[1] is seqs[0] and new[2] is not seqs[0]
        assert old == [seqs[1]] and c.stats().seqs_open == 4
        _batch.close_all(old)
        assert seqs[1].closed and c.stats().seqs_open == 3
        for i, src in enumerate(p.sources):
            for layer in range(L):
                assert np.array_equal(c.attend(layer, new[i], q), want[src][layer])
                rk, rv = c.read_rows(new[i], layer, 0, 40)
                assert np.array_equal(rk, rows[src][0]) and np.array_equal(rv, rows[src][1])
        # the fork and its source go on independently: each equals a sequence built alone
        a, b = rand(rng, 1, HKV, D), rand(rng, 1, HKV, D)
        ref_a, ref_b = c.open(), c.open()
        for ref, tok in ((ref_a, a), (ref_b, b)):
            for layer in range(L):
                c.prefill(ref, layer, None, *rows[0])
                c.append(layer, ref, tok, tok)
        for layer in range(L):
            c.append(layer, [new[1], new[2]], np.concatenate([a, b]), np.concatenate([a, b]))
        for layer in range(L):
            assert np.array_equal(c.attend(layer, new[1], q), c.attend(layer, ref_a, q))
            assert np.array_equal(c.attend(layer, new[2], q), c.attend(layer, ref_b, q))


@pytest.mark.parametrize("max_seqs, rows_", [(3, [0, 0, 1]), (4, [0, 0, 0])],
                         ids=["first-fork-fails", "second-fork-fails"])
def test_fork_rows_roll_back(rng, max_seqs, rows_):
    """A fork refused (max_seqs) closes the forks made: the batch and the cache as they were."""
    with kvtier.Cache(backend="cpu", p=1.0, max_seqs=max_seqs, **SHAPE) as c:
        seqs, _ = _filled(rng, c, 3)
        before = c.stats()
        with pytest.raises(kvtier.Error) as e:
            _batch.fork_rows(c, seqs, _batch.plan(rows_, 3))
        assert e.value.code == -errno.ENOSPC
        assert c.stats().seqs_open == 3 and c.stats().tokens == before.tokens
        assert not any(s.closed for s in seqs)
        assert [s.length(1) for s in seqs] == [40, 40, 40]


def test_truncate_rows(rng):
    with kvtier.Cache(backend="cpu", p=1.0, **SHAPE) as c:
        seqs, _ = _filled(rng, c, 2)
        assert _batch.truncate_rows(c, seqs, 15) == 2
        assert [s.length(layer) for s in seqs for layer in range(L)] == [25] * 4
        short = c.open()
        for layer in range(L):
            c.prefill(short, layer, None, rand(rng, 5, HKV, D), rand(rng, 5, HKV, D))
        with pytest.raises(kvtier.Error) as e:
            _batch.truncate_rows(c, [seqs[0], short], 10)
        assert e.value.rows_done == 1 and e.value.code == -errno.EINVAL
        assert seqs[0].length(0) == 15 and short.length(0) == 5
