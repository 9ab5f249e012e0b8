# SPDX-License-Identifier: MIT
"""The Python objects over the CPU backend with numpy: an exact round trip at p = 1, refusals
before C, errors, counters, the split form, spill/restore, probe and footprint."""

import dataclasses
import errno

import numpy as np
import pytest

import kvtier

from conftest import SHAPE, rand


def attention(q, k, v, scale):
    """Exact softmax attention of one step in float64. q: [Hq, D]; k, v: [T, Hkv, D] -> [Hq, D]."""
    hq, hkv = q.shape[0], k.shape[1]
    out = np.empty(q.shape, dtype=np.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv), :].astype(np.float64)
        vh = v[:, h // (hq // hkv), :].astype(np.float64)
        s = kh @ q[h].astype(np.float64) * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ vh
    return out


def test_round_trip_matches_exact_attention_at_p1(cache, rng):
    t0, steps, d = 300, 140, SHAPE["head_dim"]   # 140 appends cross two lazy flushes (W + B = 128)
    hq, hkv = SHAPE["n_q_heads"], SHAPE["n_kv_heads"]
    seqs = [cache.open(), cache.open()]
    ks = [rand(rng, t0, hkv, d) for _ in seqs]
    vs = [rand(rng, t0, hkv, d) for _ in seqs]
    for layer in range(SHAPE["n_layers"]):
        for s, k, v in zip(seqs, ks, vs):
            cache.prefill(s, layer, rand(rng, t0, hq, d), k, v)
    worst = 0.0
    for step in range(steps):
        k1, v1 = rand(rng, 2, hkv, d), rand(rng, 2, hkv, d)
        q1 = rand(rng, 2, hq, d)
        for layer in range(SHAPE["n_layers"]):
            cache.append(layer, seqs, k1, v1)
            out = cache.attend(layer, seqs, q1)
            assert out.dtype == np.float16 and out.shape == (2, hq, d)
        for i in range(2):
            ks[i] = np.concatenate([ks[i], k1[i:i + 1]])
            vs[i] = np.concatenate([vs[i], v1[i:i + 1]])
            want = attention(q1[i], ks[i], vs[i], d ** -0.5)
            worst = max(worst, float(np.abs(out[i].astype(np.float64) - want).max()))
    assert worst < 4e-3, "max |kvtier - exact| = %g at p = 1, want < 4e-3 (fp16 output)" % worst
    assert cache.length(seqs[0], 1) == t0 + steps
    st = cache.stats()
    assert st.flushes > 0
    assert st.selected_tokens == st.candidate_tokens, "p = 1 selects every indexed token"


def test_float32_output(rng):
    with kvtier.Cache(backend="cpu", p=1.0, out_dtype="float32", **SHAPE) as c:
        s = c.open()
        q, k, v = rand(rng, 80, 4, 64), rand(rng, 80, 2, 64), rand(rng, 80, 2, 64)
        c.prefill(s, 0, q, k, v)
        out = c.attend(0, [s], q[-1:])
        assert out.dtype == np.float32
        want = attention(q[-1], k, v, 64 ** -0.5)
        assert np.abs(out[0] - want).max() < 1e-3


def test_refusals_before_c(cache, rng):
    s = cache.open()
    q, k, v = rand(rng, 8, 4, 64), rand(rng, 8, 2, 64), rand(rng, 8, 2, 64)
    cases = [
        ("k: dtype float32", lambda: cache.prefill(s, 0, q, k.astype(np.float32), v)),
        ("v: shape (8, 4, 64), want (8, 2, 64)", lambda: cache.prefill(s, 0, q, k, q)),
        ("q: shape (8, 4, 32)", lambda: cache.prefill(s, 0, q[:, :, :32], k, v)),
        ("k: not C-contiguous", lambda: cache.prefill(
            s, 0, q, np.asfortranarray(k), v)),
        ("q: a list", lambda: cache.prefill(s, 0, q.tolist(), k, v)),
        ("layer = 2, must be in [0, 2)", lambda: cache.prefill(s, 2, q, k, v)),
        ("out: read-only", lambda: cache.attend(0, [s], q[:1], out=np.broadcast_to(
            np.zeros((1, 4, 64), np.float16), (1, 4, 64)))),
        ("a sequence appears twice", lambda: cache.append(0, [s, s], k[:2], v[:2])),
    ]
    for want, call in cases:
        with pytest.raises(kvtier.Error) as ei:
            call()
        assert ei.value.code == -errno.EINVAL and ei.value.name == "EINVAL", want
        assert want in str(ei.value), "got %r, want %r in it" % (str(ei.value), want)
    assert cache.length(s, 0) == 0, "a refused call stored nothing"
    assert cache.stats().errors == 0, "refusals never reached C"


def test_closed_sequence_refused(cache, rng):
    s = cache.open()
    s.close()
    s.close()  # twice is a no-op
    other = cache.open()  # may reuse s's id: s must still be refused
    k, v = rand(rng, 4, 2, 64), rand(rng, 4, 2, 64)
    with pytest.raises(kvtier.Error) as ei:
        cache.prefill(s, 0, None, k, v)
    assert ei.value.errno == errno.ENOENT and "sequence %d is closed" % s.id in ei.value.detail
    cache.prefill(other, 0, None, k, v)
    assert other.length(0) == 4
    with pytest.raises(kvtier.Error) as ei:
        cache.length(12345)
    assert ei.value.name == "ENOENT"


def test_status_of_a_healthy_sequence(cache, rng):
    """kvt_seq_status: the CPU backend refuses bad inputs at the call, so its sequences are never
    in error; a closed one is refused."""
    s = cache.open()
    cache.prefill(s, 0, None, rand(rng, 4, 2, 64), rand(rng, 4, 2, 64))
    assert s.status() == (0, "") == cache.status(s)
    s.close()
    with pytest.raises(kvtier.Error):
        cache.status(s)


def test_error_from_c_carries_code_text_and_detail(cache):
    s = cache.open()
    with pytest.raises(kvtier.Error) as ei:
        cache.attend(0, [s], np.zeros((1, 4, 64), np.float16))  # empty sequence
    e = ei.value
    assert e.code == -errno.EINVAL and e.errno == errno.EINVAL and e.name == "EINVAL"
    assert e.strerror == kvtier.strerror(-errno.EINVAL) and e.strerror
    assert e.detail and e.detail in str(e)
    assert e.entry == 0  # the empty sequence is entry 0 of the batch
    assert cache.stats().errors == 1


def test_error_names_the_batch_entry(cache, rng):
    a, b, c = cache.open(), cache.open(), cache.open()
    for s in (a, b, c):
        cache.prefill(s, 0, None, rand(rng, 40, 2, 64), rand(rng, 40, 2, 64))
    q = rand(rng, 3, 4, 64)
    q[2, 1, 5] = np.inf
    with pytest.raises(kvtier.Error) as ei:
        cache.attend(0, [a, b, c], q)
    assert ei.value.entry == 2 and "not finite" in ei.value.detail
    cache.attend(0, [a, b], q[:2])  # the batch without that entry: nothing was changed
    with pytest.raises(kvtier.Error) as ei:
        cache.attend(7, [a, b], q[:2])  # a bad layer concerns no entry
    assert ei.value.entry is None


def test_config_errors_and_explicit_zero():
    with pytest.raises(kvtier.Error) as ei:
        kvtier.Cache(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=48, backend="cpu")
    assert ei.value.name == "EINVAL" and "head_dim" in ei.value.detail
    with pytest.raises(kvtier.Error) as ei:
        kvtier.Config(dtype="int8").to_c()
    assert "dtype = 'int8'" in str(ei.value)
    c, _ = kvtier.Config(n_sink=0, window=None, seed=0, gpu_cache_bytes=0, p=None).to_c()
    assert c.n_sink == kvtier.NONE and c.window == 0 and c.seed == kvtier.NONE64
    assert c.gpu_cache_bytes == kvtier.NONE64 and c.p == 0.0


def test_no_sinks_no_window_all_indexed(rng):
    with kvtier.Cache(backend="cpu", n_sink=0, window=0, **SHAPE) as c:
        s = c.open()
        c.prefill(s, 0, None, rand(rng, 100, 2, 64), rand(rng, 100, 2, 64))
        assert c.stats().tokens_indexed == 100


def test_stats_dataclass(cache, rng):
    st = cache.stats()
    assert dataclasses.is_dataclass(st) and st.backend == "cpu" and st.seqs_open == 0
    assert st.index_bytes_per_token_head == 64 // 8 + 4
    s = cache.open()
    cache.prefill(s, 0, None, rand(rng, 200, 2, 64), rand(rng, 200, 2, 64))
    st = cache.stats()
    assert st.seqs_open == 1 and st.tokens == 200 and st.tokens_indexed == 200 - 4 - 64
    ls = cache.layer_stats(1)
    assert dataclasses.is_dataclass(ls) and ls.steps == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.tokens = 0


def test_capacity_and_seq_bytes(cache, rng):
    k0 = cache.capacity()
    assert dataclasses.is_dataclass(k0) and k0.seqs_open == 0
    assert k0.block_tokens == 256 and k0.block_bytes == 256 * 4 * 64
    assert k0.host_bytes_free == k0.host_bytes_capacity and k0.nvme_bytes_capacity == 0
    s = cache.open()
    cache.prefill(s, 0, None, rand(rng, 300, 2, 64), rand(rng, 300, 2, 64))
    host, nvme = cache.seq_bytes(s)
    assert host == 2 * k0.block_bytes * 2 and nvme == 0  # 2 blocks per KV head, 2 heads, 1 layer
    assert cache.capacity().host_bytes_free == k0.host_bytes_free - host
    s.close()
    with pytest.raises(kvtier.Error) as e:
        cache.seq_bytes(s)
    assert e.value.errno == errno.ENOENT


def test_select_and_gather(cache, rng):
    s = cache.open()
    q, k, v = rand(rng, 150, 4, 64), rand(rng, 150, 2, 64), rand(rng, 150, 2, 64)
    cache.prefill(s, 0, q, k, v)
    m = cache.select(0, [s], q[-1:])
    assert m == 150  # p = 1: every token
    g = cache.gather(0, [s], m)
    assert g.total == 300 and g.counts.tolist() == [[150, 150]]
    assert g.pos.dtype == np.int32 and g.pos[0, 1].tolist() == list(range(150))
    assert np.array_equal(g.k[0, 1], k[:, 1]) and np.array_equal(g.v[0, 0], v[:, 0])
    with pytest.raises(kvtier.Error) as ei:
        cache.gather(0, [s], m - 1)
    assert ei.value.name == "EINVAL"


def test_cache_context_manager_closes(rng):
    with kvtier.Cache(backend="cpu", **SHAPE) as c:
        s = c.open()
    assert c.closed and s.closed
    with pytest.raises(kvtier.Error, match="cache is closed"):
        c.open()


def test_spill_without_nvme_tier(cache):
    s = cache.open()
    with pytest.raises(kvtier.Error) as ei:
        s.spill()
    assert ei.value.name == "EOPNOTSUPP" and ei.value.errno == errno.EOPNOTSUPP


def test_spill_restore(tmp_path, rng):
    info = kvtier.probe()
    if not info.io_uring_built:
        pytest.skip("this libkvtier was built without liburing (no NVMe tier)")
    if not info.io_uring_usable:
        pytest.skip("the kernel refuses io_uring to this process")
    path = str(tmp_path / "tier.img")
    try:
        c = kvtier.Cache(backend="cpu", p=1.0, nvme_paths=[path], nvme_bytes=[64 << 20],
                         **SHAPE)
    except kvtier.Error as e:
        if e.name in ("EOPNOTSUPP", "EINVAL") and "O_DIRECT" in e.detail:
            pytest.skip("file system of %s: %s" % (tmp_path, e.detail))
        raise
    with c:
        s = c.open()
        t = 700
        q, k, v = rand(rng, t, 4, 64), rand(rng, t, 2, 64), rand(rng, t, 2, 64)
        for layer in range(2):
            c.prefill(s, layer, q, k, v)
        before = c.attend(0, [s], q[-1:])
        moved = s.spill()
        assert moved > 0 and c.stats().spills == 1
        served = c.attend(0, [s], q[-1:])           # direct serving from NVMe
        assert np.array_equal(served, before)
        assert s.restore() == moved and c.stats().restores == 1
        assert np.array_equal(c.attend(0, [s], q[-1:]), before)


def test_probe_and_footprint():
    info = kvtier.probe()
    assert dataclasses.is_dataclass(info) and info.numa_nodes >= 1
    assert isinstance(info.thp_mode, str) and len(info.cuda_busid) == min(info.cuda_devices, 16)
    fp = kvtier.footprint(kvtier.Config(**SHAPE), 1000)
    assert fp.row_bytes == 4 * 64
    assert fp.index_tokens == 1000 - 4 - 64
    assert fp.index_token_bytes == (64 // 8 + 4) * 2 * 2
    assert fp.hbm_index_bytes == fp.index_tokens * fp.index_token_bytes
    with pytest.raises(kvtier.Error) as ei:
        kvtier.footprint(dict(SHAPE, n_q_heads=3), 10)
    assert ei.value.name == "EINVAL" and "n_q_heads" in ei.value.detail


def test_truncate_fork_rows(rng):
    """truncate then the same tokens again attends as a fresh sequence; a fork attends as its
    parent; read_rows gives the rows written; write_rows equals a prefill without queries."""
    d, hq, hkv = SHAPE["head_dim"], SHAPE["n_q_heads"], SHAPE["n_kv_heads"]
    with kvtier.Cache(backend="cpu", p=0.9, **SHAPE) as c:
        a, b = c.open(), c.open()
        k, v = rand(rng, 300, hkv, d), rand(rng, 300, hkv, d)
        for layer in range(SHAPE["n_layers"]):
            c.prefill(a, layer, None, k, v)
            c.write_rows(b, layer, k, v)
        draft = rand(rng, 40, hkv, d)
        for t in range(40):
            for layer in range(SHAPE["n_layers"]):
                c.append(layer, a, draft[t:t + 1], draft[t:t + 1])
        a.truncate(40)
        q = rand(rng, 1, hq, d)
        kid = a.fork()
        assert kid.length(1) == 300
        for layer in range(SHAPE["n_layers"]):
            want = c.attend(layer, b, q)
            assert np.array_equal(c.attend(layer, a, q), want)
            assert np.array_equal(c.attend(layer, kid, q), want)
            rk, rv = c.read_rows(kid, layer, 10, 290)
            assert np.array_equal(rk, k[10:290]) and np.array_equal(rv, v[10:290])
        with pytest.raises(kvtier.Error) as e:
            a.truncate(301)
        assert e.value.code == -errno.EINVAL and "301" in e.value.detail


def test_paged_rows_round_trip(cache, rng):
    """read_rows_paged / write_rows_paged through a shuffled slot mapping: the rows read equal
    read_rows', and rows written from the paged buffer give the sequence read_rows' rows."""
    s = cache.open()
    k, v = rand(rng, 50, 2, 64), rand(rng, 50, 2, 64)
    cache.prefill(s, 0, None, k, v)
    dk, dv = cache.read_rows(s, 0, 10, 40)
    slots = rng.permutation(64)[:30]
    kc = np.zeros((64, 2, 64), np.float16)
    vc = np.zeros((64, 2, 64), np.float16)
    cache.read_rows_paged(s, 0, 10, 40, kc, vc, slots)
    assert np.array_equal(kc[slots], dk) and np.array_equal(vc[slots], dv)
    untouched = np.setdiff1d(np.arange(64), slots)
    assert not kc[untouched].any() and not vc[untouched].any()
    t = cache.open()
    cache.write_rows_paged(t, 0, kc, vc, slots)
    assert t.length(0) == 30
    tk, tv = cache.read_rows(t, 0, 0, 30)
    assert np.array_equal(tk, dk) and np.array_equal(tv, dv)
    with pytest.raises(kvtier.Error) as ei:  # a slot past the buffer: refused before C
        cache.read_rows_paged(s, 0, 0, 2, kc, vc, [3, 64])
    assert "n_slots = 64" in ei.value.detail
    with pytest.raises(kvtier.Error) as ei:  # two tokens on one slot: refused by C
        cache.read_rows_paged(s, 0, 0, 2, kc, vc, [3, 3])
    assert ei.value.errno == errno.EINVAL


def test_attend_graph_reads_its_slots(cache, rng):
    """attend_graph over slot buffers (numpy on the CPU backend): valid slots equal attend's rows
    bit for bit, padded slots (seqs < 0, or valid 0) keep their out rows, a wrong length fails
    naming the slot before anything is written, and the buffers are checked before C."""
    a, b = cache.open(), cache.open()
    for s, n in ((a, 90), (b, 150)):
        cache.prefill(s, 0, None, rand(rng, n, 2, 64), rand(rng, n, 2, 64))
    q = rand(rng, 4, 4, 64)
    ref = cache.attend(0, [b, a], np.ascontiguousarray(q[[0, 2]]))
    out = np.full((4, 4, 64), 3.0, dtype=ref.dtype)
    seqs = np.array([b.id, -1, a.id, 7], dtype=np.int32)
    valid = np.array([1, 0, 1, 0], dtype=np.uint8)
    with pytest.raises(kvtier.Error) as ei:
        cache.attend_graph(0, seqs, q, out, valid=valid)  # no reservation yet
    assert ei.value.code == -errno.EINVAL and "kvt_graph_reserve" in ei.value.detail
    cache.graph_reserve(4, 1024)
    for lengths in (None, np.array([150, 0, 90, 0], dtype=np.int32)):
        got = out.copy()
        cache.attend_graph(0, seqs, q, got, lengths=lengths, valid=valid)
        assert np.array_equal(got[[0, 2]], ref) and (got[[1, 3]] == 3.0).all()
    got = out.copy()
    with pytest.raises(kvtier.Error) as ei:
        cache.attend_graph(0, seqs, q, got, lengths=np.array([151, 0, 90, 0], dtype=np.int32),
                           valid=valid)
    assert ei.value.entry == 0 and "slot 0" in ei.value.detail and (got == 3.0).all()
    with pytest.raises(kvtier.Error):
        cache.attend_graph(0, seqs.astype(np.int64), q, got)  # not int32: refused before C
    with pytest.raises(kvtier.Error):
        cache.attend_graph(0, seqs, q, got, valid=valid[:3])   # one per slot
    cache.graph_reserve(0, 0)
