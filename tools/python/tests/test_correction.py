# SPDX-License-Identifier: MIT
"""Score corrections from exact logits (Config.correction_steps, doc/rescoring.md) through the
package on the CPU backend: the field reaches C (a value past 64 is refused naming it), at p = 1
the outputs are those of a cache without corrections, at p < 1 they change what is selected and
repeat bit for bit in a twin. The second selection stage (Config.rescore_p) likewise: refused at
or below p naming both, counted in the stats, changing the selection. numpy only."""

import errno

import numpy as np
import pytest

import kvtier

from conftest import SHAPE, rand

HQ, HKV, D = SHAPE["n_q_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]


def run(rng_seed, p, correction, steps=6):
    """Outputs of `steps` attends of one query stream after a 600-token prefill."""
    rng = np.random.default_rng(rng_seed)
    k, v = rand(rng, 600, HKV, D), rand(rng, 600, HKV, D)
    base = rng.standard_normal((HQ, D)) * 2.5
    qs = [(base + 0.8 * rng.standard_normal((HQ, D))).astype(np.float16) for _ in range(steps)]
    with kvtier.Cache(backend="cpu", p=p, budget_min=0, out_dtype="float32",
                      correction_steps=correction, **SHAPE) as c:
        s = c.open()
        for layer in range(SHAPE["n_layers"]):
            c.prefill(s, layer, None, k, v)
        outs = [c.attend(0, [s], q[None]) for q in qs]
        return np.stack(outs), c.stats().selected_tokens


def test_refused_past_64():
    with pytest.raises(kvtier.Error, match="correction_steps") as ei:
        kvtier.Cache(backend="cpu", correction_steps=65, **SHAPE)
    assert ei.value.code == -errno.EINVAL


def test_neutral_at_p1():
    a, _ = run(3, 1.0, 0)
    b, _ = run(3, 1.0, 8)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_changes_the_selection_and_repeats():
    a, sel_a = run(4, 0.8, 0)
    b, sel_b = run(4, 0.8, 8)
    c, sel_c = run(4, 0.8, 8)
    assert np.array_equal(b.view(np.uint32), c.view(np.uint32)) and sel_b == sel_c
    assert not np.array_equal(a[1:].view(np.uint32), b[1:].view(np.uint32)), \
        "corrections changed no output after the first step"
    assert np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32)), \
        "the first step has no correction to apply"


def test_rescore():
    with pytest.raises(kvtier.Error, match="rescore_p = 0.5") as ei:
        kvtier.Cache(backend="cpu", p=0.9, rescore_p=0.5, **SHAPE)
    assert ei.value.code == -errno.EINVAL
    rng = np.random.default_rng(5)
    k, v = rand(rng, 600, HKV, D), rand(rng, 600, HKV, D)
    q = (rng.standard_normal((1, HQ, D)) * 2.5).astype(np.float16)
    sel = []
    for rp in (None, 0.97):
        with kvtier.Cache(backend="cpu", p=0.8, budget_min=0, rescore_p=rp, **SHAPE) as c:
            s = c.open()
            for layer in range(SHAPE["n_layers"]):
                c.prefill(s, layer, None, k, v)
            c.attend(0, [s], q)
            st = c.stats()
            assert (st.rescored_tokens > 0) == (rp is not None)
            assert st.rescored_unselected <= st.rescored_tokens
            sel.append(st.selected_tokens)
    assert sel[0] != sel[1]


def test_keep_weight():
    """Config.keep_weight (the selection's hysteresis) reaches the library: a bad value is refused
    by name; on the CPU backend a weight changes the selections of steps after the first."""
    with pytest.raises(kvtier.Error, match="keep_weight = -1") as ei:
        kvtier.Cache(backend="cpu", keep_weight=-1.0, **SHAPE)
    assert ei.value.code == -errno.EINVAL
    rng = np.random.default_rng(6)
    k, v = rand(rng, 600, HKV, D), rand(rng, 600, HKV, D)
    base = rng.standard_normal((1, HQ, D)) * 2.0
    qs = [(base + rng.standard_normal((1, HQ, D)) * 2.0).astype(np.float16) for _ in range(6)]
    sel = []
    for w in (None, 8.0):
        with kvtier.Cache(backend="cpu", p=0.8, budget_min=0, keep_weight=w, **SHAPE) as c:
            s = c.open()
            for layer in range(SHAPE["n_layers"]):
                c.prefill(s, layer, None, k, v)
            for q in qs:
                c.attend(0, [s], q)
            sel.append(c.stats().selected_tokens)
    assert sel[0] != sel[1], "keep_weight changed no selection"


def test_keep_steps():
    """Config.keep_steps reaches the library: without keep_weight it is refused by name."""
    with pytest.raises(kvtier.Error, match="keep_steps = 2") as ei:
        kvtier.Cache(backend="cpu", keep_steps=2, **SHAPE)
    assert ei.value.code == -errno.EINVAL
    with kvtier.Cache(backend="cpu", keep_weight=8.0, keep_steps=4, **SHAPE):
        pass
