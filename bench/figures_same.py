#!/usr/bin/env python3
"""Compare two `kvbench --json` outputs field by field, ignoring timings, and exit 1 on any difference.

A refactor changes no figure: run kvbench before and after (same flags, same machine) and
    bench/figures_same.py before.json after.json
Timing fields (names with _ms, ms_per, wall_s, stage_ms, ns_, lat_, _s, ...) and file paths are
skipped; a field only in the new output is listed (an addition), and so is any other difference.
"""
import json
import re
import sys

TIMING = re.compile(r"(^ns_|nvme_paths|_ms|ms_per|wall_s|stage_ms|_ns|lat_|_s$|per_s|gbps|seconds|time|_us)",
                    re.I)


def walk(a, b, path, out):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if TIMING.search(k):
                continue
            if k not in a or k not in b:
                out.append("%s/%s: only in %s" % (path, k, "new" if k in b else "old"))
                continue
            walk(a[k], b[k], "%s/%s" % (path, k), out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append("%s: %d entries -> %d" % (path, len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, "%s[%d]" % (path, i), out)
    elif a != b:
        out.append("%s: %r -> %r" % (path, a, b))


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: figures_same.py before.json after.json")
    with open(sys.argv[1]) as f:
        a = json.load(f)
    with open(sys.argv[2]) as f:
        b = json.load(f)
    out = []
    walk(a, b, "", out)
    print("\n".join(out) if out else "identical outside timings")
    sys.exit(1 if any("only in new" not in line for line in out) else 0)


if __name__ == "__main__":
    main()
