#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Every error code the library can return has a kvt_strerror text and is listed in kvtier.h.

Scans the C and CUDA sources under lib/, host/ and gpu/ for negative errno constants (-EXXX) with
comments removed and comparisons (== -EXXX, != -EXXX: codes received from the kernel, not returned)
left out, so a code added to any source later is found without a list kept by hand. Then checks:
  1. each code found is listed in the convention block at the top of lib/kvtier.h;
  2. each code of the convention block has a text of its own from kvt_strerror (the helper
     abi_strerror_dump prints what the shared library answers);
  3. kvt_strerror has a text for no code the convention block leaves out.
Usage: abi_strerror.py SOURCE_ROOT ABI_STRERROR_DUMP
"""
import errno
import os
import re
import subprocess
import sys

CODE = re.compile(r"-(E[A-Z0-9]+)\b")
COMPARED = re.compile(r"[=!]=\s*-E[A-Z0-9]+\b")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def source_codes(root):
    found = {}
    for d in ("lib", "host", "gpu"):
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                # the header is what is checked, and lib/error.c's table is what answers
                if not f.endswith((".c", ".h", ".cu", ".cuh")) or f in ("kvtier.h", "error.c"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    text = COMPARED.sub("", COMMENT.sub("", fh.read()))
                for name in CODE.findall(text):
                    found.setdefault(name, os.path.relpath(path, root))
    return found


def header_codes(root):
    with open(os.path.join(root, "lib", "kvtier.h"), encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("Conventions, for every function below")
    block = text[start:text.index("*/", start)]
    return set(CODE.findall(block))


def main():
    root, dump = sys.argv[1], sys.argv[2]
    out = subprocess.run([dump], check=True, capture_output=True, text=True).stdout
    texts = {}
    for line in out.splitlines():
        key, text = line.split("\t", 1)
        if key != "unknown":
            texts[int(key)] = text
    value = {name: -getattr(errno, name) for name in dir(errno) if name.startswith("E")}
    src, hdr = source_codes(root), header_codes(root)
    fail = 0
    for name, where in sorted(src.items()):
        if name not in value:
            print(f"{name} ({where}): not an errno name of this platform")
            fail = 1
        elif name not in hdr:
            print(f"-{name} ({where}): returned but not in kvtier.h's convention block")
            fail = 1
    for name in sorted(hdr):
        if name not in value:
            print(f"-{name} in kvtier.h: not an errno name of this platform")
            fail = 1
        elif value[name] not in texts:
            print(f"-{name} in kvtier.h: kvt_strerror got the fallback text, wanted one of its own")
            fail = 1
    listed = {value[n] for n in hdr if n in value}
    for code in sorted(set(texts) - listed - {0}):
        print(f"kvt_strerror({code}) = \"{texts[code]}\": a text for a code kvtier.h does not list")
        fail = 1
    print(f"abi_strerror: {len(src)} codes in the sources ({' '.join(sorted(src))}), "
          f"{len(hdr)} in the header, {len(texts) - 1} with a text")
    return fail


if __name__ == "__main__":
    sys.exit(main())
