# SPDX-License-Identifier: MIT
"""The ctypes mirror against lib/kvtier.h and the loaded library: field names in header order,
first-release sizes, version."""

import ctypes
import os
import re

import pytest

import kvtier
from kvtier import _abi

from conftest import HEADER, header_text


def header_fields(text, name):
    """Field names of `typedef struct name { ... } name;` in declaration order."""
    body = re.search(r"typedef struct %s \{(.*?)\n\} %s;" % (name, name), text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        decl = re.sub(r"\[[^\]]*\]", "", decl)  # array bounds
        head, *rest = decl.split(",")
        names.append(re.findall(r"\**\s*(\w+)\s*$", head)[0])
        names += [r.strip().lstrip("*").strip() for r in rest]
    return names


@pytest.mark.skipif(not os.path.exists(HEADER), reason="lib/kvtier.h not beside the package")
@pytest.mark.parametrize("name", sorted(_abi.STRUCTS))
def test_mirror_fields_match_header(name):
    want = header_fields(header_text(), name)
    got = [f[0] for f in _abi.STRUCTS[name]._fields_]
    assert got == want, "%s: mirror %s, header %s" % (name, got, want)


@pytest.mark.skipif(not os.path.exists(HEADER), reason="lib/kvtier.h not beside the package")
def test_graph_batch_mirror_matches_header():
    """kvt_graph_batch has no size field (later versions add calls): its mirror must follow the
    header field for field."""
    want = header_fields(header_text(), "kvt_graph_batch")
    assert [f[0] for f in _abi.KvtGraphBatch._fields_] == want


@pytest.mark.skipif(not os.path.exists(HEADER), reason="lib/kvtier.h not beside the package")
def test_mirror_version_matches_header():
    with open(HEADER, encoding="utf-8") as f:
        text = f.read()
    for part in ("MAJOR", "MINOR", "PATCH"):
        want = int(re.search(r"#define KVT_VERSION_%s (\d+)" % part, text).group(1))
        assert getattr(_abi, "VERSION_" + part) == want, part


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="sizes written for LP64")
def test_sizes_lp64():
    # doc/abi.md: kvt_config is 200 bytes on LP64 (192 through rescore_p, then keep_weight),
    # its first release 136
    assert ctypes.sizeof(_abi.KvtConfig) == 200
    assert _abi.SIZE_VER0[_abi.KvtConfig] == 136
    for st in _abi.STRUCTS.values():
        assert ctypes.sizeof(st) >= _abi.SIZE_VER0[st], st.__name__
    # the output structs end with their first release's last field, or past it by what was
    # added since (kvt_stats: the second selection stage's two counters, scan_hist_hits;
    # kvt_capacity: nvme_block_bytes)
    grown = {_abi.KvtStats: 24, _abi.KvtCapacity: 8}
    for st in (_abi.KvtStats, _abi.KvtLayerStats, _abi.KvtProbeInfo, _abi.KvtFootprint,
               _abi.KvtCapacity):
        assert ctypes.sizeof(st) == _abi.SIZE_VER0[st] + grown.get(st, 0), st.__name__


def test_version():
    assert kvtier.version() == "%d.%d.%d" % (_abi.VERSION_MAJOR, _abi.VERSION_MINOR,
                                           _abi.VERSION_PATCH)
    assert kvtier.version_number() == kvtier.ABI_VERSION_NUMBER


def test_library_below_first_release_size_refused():
    # the library's own size rule, seen through the mirror: one byte short of VER0 is -EINVAL
    info = _abi.KvtProbeInfo()
    info.size = _abi.SIZE_VER0[_abi.KvtProbeInfo] - 1
    assert _abi.lib().kvt_probe(ctypes.byref(info)) == -22


def test_load_error_names_where_it_looked(monkeypatch, tmp_path):
    missing = str(tmp_path / "libkvtier-missing.so")
    monkeypatch.setenv("KVTIER_LIBRARY", missing)
    monkeypatch.setattr(_abi.ctypes.util, "find_library", lambda name: None)
    real = _abi.ctypes.CDLL

    def no_system(path, *a, **kw):
        if path == "libkvtier.so.0":
            raise OSError("not on the loader path (test)")
        return real(path, *a, **kw)

    monkeypatch.setattr(_abi.ctypes, "CDLL", no_system)
    with pytest.raises(kvtier.LoadError) as ei:
        _abi.load()
    text = str(ei.value)
    assert missing in text and "libkvtier.so.0" in text and "KVTIER_LIBRARY" in text
