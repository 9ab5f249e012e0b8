# SPDX-License-Identifier: MIT
"""Integers outside their C parameter's range are refused (-EINVAL, the value named), never
wrapped by ctypes; so are floats, bools and None where an int is wanted, and float slot
mappings. A sequence the Python layer refuses in a batch is named by Error.entry, as C's
refusals are."""

import numpy as np
import pytest

import kvtier

from conftest import SHAPE, rand

U32, U64 = 2**32, 2**64


def refused(fn, *names):
    """fn() raises kvtier.Error -EINVAL whose detail names each of `names`."""
    with pytest.raises(kvtier.Error) as ei:
        fn()
    assert ei.value.name == "EINVAL", ei.value
    for n in names:
        assert n in ei.value.detail, (n, ei.value.detail)
    return ei.value


def filled(cache, rng, n=40):
    s = cache.open()
    for layer in range(cache.n_layers):
        cache.prefill(s, layer, None, rand(rng, n, 2, 64), rand(rng, n, 2, 64))
    return s


@pytest.mark.parametrize("field, value", [
    ("n_sink", -1), ("window", U32 + 5), ("max_seqs", U32 + 3), ("max_seqs", -1),
    ("host_bytes", -1), ("host_bytes", U64 + (64 << 20)), ("seed", -1), ("seed", U64),
    ("keep_steps", U32), ("flush_batch", 1.5), ("device", 2**31), ("nvme_flags", -1),
    ("dtype", True), ("budget_max", -3),
])
def test_config_field_out_of_range(field, value):
    e = refused(lambda: kvtier.Config(**SHAPE, **{field: value}).to_c(),
                "%s = %s" % (field, value))
    assert e.entry is None
    refused(lambda: kvtier.Cache(backend="cpu", **SHAPE, **{field: value}), field)


def test_config_field_limits_accepted():
    c, _ = kvtier.Config(seed=U64 - 1, host_bytes=U64 - 1, window=U32 - 1, device=-1).to_c()
    assert c.seed == U64 - 1 and c.host_bytes == U64 - 1 and c.window == U32 - 1
    assert c.device == -1  # C's to refuse, with its own text
    c, _ = kvtier.Config(seed=np.uint64(7), max_seqs=np.int32(3)).to_c()
    assert c.seed == 7 and c.max_seqs == 3


def test_nvme_sizes_and_footprint_checked(tmp_path):
    refused(lambda: kvtier.Config(nvme_paths=[str(tmp_path / "a")], nvme_bytes=[-1]).to_c(),
            "nvme_bytes[0] = -1")
    cfg = kvtier.Config(backend="cpu", **SHAPE)
    for n in (U64 + 10, -1, None, 2.0):
        refused(lambda: kvtier.footprint(cfg, n), "n_tokens")
    assert kvtier.footprint(cfg, 10) == kvtier.footprint(cfg, np.int64(10))


def test_sequence_calls_out_of_range(cache, rng):
    s = filled(cache, rng)
    refused(lambda: cache.truncate(s, U32 + 3), "n_tokens = %d" % (U32 + 3))
    refused(lambda: s.truncate(2.0), "n_tokens")
    assert s.length(0) == 40 and s.length(1) == 40
    refused(lambda: cache.read_rows(s, 0, U32, U32 + 4), "start = %d" % U32)
    refused(lambda: cache.read_rows(s, 0, 0.5, 3), "start = 0.5")
    refused(lambda: cache.read_rows(s, 0, 0, None), "stop = None")
    refused(lambda: cache.read_rows(s, 0, 5, 3), "[5, 3)")
    k, v = cache.read_rows(s, 0, 0, np.int64(4))
    assert k.shape == (4, 2, 64) and v.shape == (4, 2, 64)
    for name, args in (("max_slots", (U32, 100)), ("max_tokens", (4, -1)),
                       ("max_slots", (True, 8))):
        refused(lambda: cache.graph_reserve(*args), name)


def test_gather_and_extend_out_of_range(cache, rng):
    s = filled(cache, rng)
    cache.select(0, [s], rand(rng, 1, 4, 64))
    for m in (-1, 2.9, None, U32 + 8):
        refused(lambda: cache.gather(0, [s], m), "max_tokens")
    g = cache.gather(0, [s], 40)
    assert g.total == int(g.counts.sum()) > 0
    q, k = rand(rng, 1, 4, 64), rand(rng, 1, 2, 64)
    refused(lambda: cache.extend(0, [s], [U32 + 1], q, k, k), "lengths[0] = %d" % (U32 + 1))
    refused(lambda: cache.extend(0, [s], [1.0], q, k, k), "lengths[0] = 1.0")
    assert s.length(0) == 40


def test_float_slot_mapping_refused(cache, rng):
    s = filled(cache, rng, 20)
    kc, vc = rand(rng, 8, 2, 64), rand(rng, 8, 2, 64)
    refused(lambda: cache.write_rows_paged(s, 0, kc, vc, np.array([1.5])), "slot_mapping",
            "float64")
    refused(lambda: cache.write_rows_paged(s, 0, kc, vc, [0.9, 1.7]), "slot_mapping")
    assert s.length(0) == 20
    refused(lambda: cache.read_rows_paged(s, 0, 0, 2, kc, vc, np.array([0.0, 1.0])),
            "slot_mapping")
    cache.read_rows_paged(s, 0, 0, 2, kc, vc, [3, -1])
    k, _ = cache.read_rows(s, 0, 0, 1)
    assert np.array_equal(kc[3], k[0])


@pytest.mark.parametrize("case", ["closed", "unknown", "duplicate"])
def test_python_refusal_names_its_entry(cache, rng, case):
    a, b, d = filled(cache, rng, 10), filled(cache, rng, 10), filled(cache, rng, 10)
    seqs, want = {"closed": ([a, b, d], 1), "unknown": ([a, d, 99], 2),
                  "duplicate": ([a, d, a], 2)}[case]
    if case == "closed":
        b.close()
    k = rand(rng, 3, 2, 64)
    with pytest.raises(kvtier.Error) as ei:
        cache.append(0, seqs, k, k)
    assert ei.value.entry == want and "seqs[%d]" % want in ei.value.detail
    assert a.length(0) == 10 and d.length(0) == 10  # nothing changed
    keep = [x for i, x in enumerate(seqs) if i != want]
    cache.append(0, keep, k[:2], k[:2])  # the batch without it goes through
    assert a.length(0) == 11 and d.length(0) == 11


def test_c_detail_names_its_function_once(cache, rng):
    s = filled(cache, rng)
    e = refused(lambda: cache.truncate(s, 41), "n_tokens = 41")
    assert e.detail.count("kvt_seq_truncate") == 1, e.detail
