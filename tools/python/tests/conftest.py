# SPDX-License-Identifier: MIT
"""Shared fixtures: the library under test (KVTIER_LIBRARY, set by the meson test entry) and the
repository root (for the header)."""

import os

import numpy as np
import pytest

import kvtier

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HEADER = os.path.join(ROOT, "lib", "kvtier.h")
# kvtier.h and the part headers it includes (their text, in order, is the public header's)
HEADERS = [HEADER, os.path.join(ROOT, "lib", "kvtier_lifecycle.h"),
           os.path.join(ROOT, "lib", "kvtier_graph.h"), os.path.join(ROOT, "lib", "kvtier_probe.h")]


def header_text():
    """The public header's declarations: kvtier.h and the headers it includes."""
    text = []
    for h in HEADERS:
        with open(h, encoding="utf-8") as f:
            text.append(f.read())
    return "\n".join(text)

# a small GQA shape: 2 layers, 4 query heads over 2 KV heads, head_dim 64
SHAPE = dict(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=64)


@pytest.fixture
def rng():
    return np.random.default_rng(12)


@pytest.fixture
def cache():
    with kvtier.Cache(backend="cpu", p=1.0, **SHAPE) as c:
        yield c


def rand(rng, *shape, dtype=np.float16):
    return rng.standard_normal(shape).astype(dtype)
