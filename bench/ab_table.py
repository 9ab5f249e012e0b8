#!/usr/bin/env python3
"""Collate bench/gpu_ab.sh's summary (ab.txt) into one table per figure, trees side by side.

gpu_ab.sh prints each run's matching lines prefixed by the tree's name, round after round. Here
the lines are grouped by program, by their text with the numbers taken out, and by how many
times that text came before within the run (the same line for another context or batch), and
every number that differs between runs gets a row: the words before it, then each tree's values
over the rounds and their mean as a change from the first tree's. Numbers equal in every run
(a context, a batch) stay in the group's heading.

    bench/ab_table.py ab.txt    (gpu_ab.sh runs it on the lines it printed: $OUT/ab-table.txt)
"""
import re
import sys
from collections import OrderedDict, defaultdict

NUM = re.compile(r"-?\d+(?:\.\d+)?")


def parse(lines):
    """(trees, groups): groups maps (program, template, occurrence) to {tree: [numbers per run]}
    and keeps the first text of each, in order of appearance."""
    trees, groups, first = [], OrderedDict(), {}
    prog, seen = {}, {}
    for line in lines:
        line = line.rstrip("\n")
        m = re.match(r"gpu_ab: trees (.+?); targets", line)
        if m:
            trees = m.group(1).split()
            continue
        m = re.match(r"(\S+) (.+?): round \d+ rc=", line)
        if m and m.group(1) in trees:
            prog[m.group(1)] = m.group(2)
            seen[m.group(1)] = defaultdict(int)
            continue
        m = re.match(r"  (\S+): (.*)$", line)
        if not m or m.group(1) not in trees or m.group(1) not in prog:
            continue
        tree, text = m.group(1), m.group(2).strip()
        tmpl = NUM.sub("#", text)
        occ = seen[tree][tmpl]
        seen[tree][tmpl] += 1
        key = (prog[tree], tmpl, occ)
        groups.setdefault(key, defaultdict(list))[tree].append([float(x) for x in NUM.findall(text)])
        first.setdefault(key, text)
    return trees, groups, first


def label(text, i):
    """The words before the i-th number of text (to the number before it, at most 32
    characters) and the unit after it."""
    spans = [m.span() for m in NUM.finditer(text)]
    start = spans[i - 1][1] if i else 0
    before = text[start:spans[i][0]].strip(" ,;:(=")[-32:]
    after = text[spans[i][1]:].split()
    unit = after[0].strip(",;:()") if after and not NUM.match(after[0]) else ""
    return ("%s # %s" % (before, unit)).strip()


def fmt(v):
    return ("%.4g" % v) if abs(v) < 1e6 else "%.0f" % v


def table(trees, groups, first):
    out = []
    for key, runs in groups.items():
        prog, tmpl, occ = key
        allruns = [r for t in trees for r in runs.get(t, [])]
        n = len(allruns[0])
        vary = [i for i in range(n) if len({r[i] for r in allruns}) > 1]
        if not vary:
            continue
        head = NUM.sub(lambda m, c=iter(range(n)): "#" if next(c) in vary else m.group(0), first[key])
        out.append("%s%s\n  %s" % (prog, " (#%d)" % (occ + 1) if occ else "", head[:300]))
        base = runs.get(trees[0], [])
        for i in vary:
            cells = []
            for t in trees:
                vals = [r[i] for r in runs.get(t, [])]
                if not vals:
                    cells.append("%s -" % t)
                    continue
                cell = "%s %s" % (t, "/".join(fmt(v) for v in vals))
                if t != trees[0] and base:
                    b = sum(r[i] for r in base) / len(base)
                    m = sum(vals) / len(vals)
                    if b:
                        cell += " (%+.1f%%)" % (100.0 * (m - b) / abs(b))
                cells.append(cell)
            out.append("    %-40s %s" % (label(first[key], i)[:40], " | ".join(cells)))
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    with open(argv[1]) as f:
        trees, groups, first = parse(f)
    if not trees:
        sys.stderr.write("ab_table: no 'gpu_ab: trees' line in %s\n" % argv[1])
        return 1
    print(table(trees, groups, first))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
