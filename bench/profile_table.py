#!/usr/bin/env python3
"""One row per profiled kernel from ncu's `--csv --page details` output (bench/gpu_profile.sh):
duration in us, then the metrics below. Lines that are not ncu's CSV (the program's own output,
mixed into the same stream) are printed first, unchanged. Usage: profile_table.py PROFILE.csv"""
import csv
import sys

# (column, ncu's metric name): the first name a kernel has is taken
COLUMNS = [
    ("us", "Duration"),
    ("dram%", "DRAM Throughput"),
    ("sm%", "Compute (SM) Throughput"),
    ("issue%", "One or More Eligible"),
    ("cyc/inst", "Warp Cycles Per Issued Instruction"),
    ("occ%", "Achieved Occupancy"),
    ("theo%", "Theoretical Occupancy"),
    ("regs", "Registers Per Thread"),
    ("grid", "Grid Size"),
    ("waves", "Waves Per SM"),
]
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "s": 1e6, "second": 1e6}


def main(path):
    header, rows, other = None, [], []
    with open(path, newline="") as f:
        for line in f:
            if line.startswith('"ID"'):
                header = next(csv.reader([line]))
            elif header and line.startswith('"') and line[1:2].isdigit():
                rows.append(dict(zip(header, next(csv.reader([line])))))
            else:
                other.append(line.rstrip("\n"))
    for line in other:
        print(line)
    if not rows:
        sys.exit("profile_table: no ncu rows in %s" % path)
    kernels = {}  # ID -> (name, {metric: value})
    for r in rows:
        name = r["Kernel Name"].split("(")[0].split("<")[0].split(" ")[-1]
        k = kernels.setdefault(r["ID"], (name, {}))
        v, unit = r["Metric Value"].replace(",", ""), r.get("Metric Unit", "")
        try:
            x = float(v)
        except ValueError:
            continue
        if r["Metric Name"] == "Duration":
            x *= TO_US.get(unit, float("nan"))
        k[1].setdefault(r["Metric Name"], x)
    print("%-28s" % "kernel" + "".join("%10s" % c for c, _ in COLUMNS))
    total = 0.0
    for _, (name, m) in sorted(kernels.items(), key=lambda kv: int(kv[0])):
        total += m.get("Duration", 0.0)
        cells = []
        for c, metric in COLUMNS:
            x = m.get(metric)
            cells.append("%10s" % ("-" if x is None else "%.1f" % x if x % 1 else "%d" % x))
        print("%-28s" % name[:28] + "".join(cells))
    print("%-28s%10.1f (sum of the durations above)" % ("total", total))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__))
