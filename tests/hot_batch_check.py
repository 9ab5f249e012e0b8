#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""kvbench --trace --hot-log and bench/hot_batch agree: a log replayed alone by hot_batch gives
the self-sized cache kvbench's own simulation reports (share of the rows and hit rate), whether
its layer is named by default or by --layer all (a one-layer trace), and a batch of two copies of
it is replayed as two sequences sharing one cache.

    hot_batch_check.py PYTHON DRIFT_TRACE_PY WORKDIR KVBENCH HOT_BATCH
"""
import json
import re
import subprocess
import sys


def main():
    python, drift_trace, work, kvbench, hot_batch = sys.argv[1:6]
    subprocess.run([python, drift_trace, work, '--context', '1024', '--steps', '4', '--second',
                    'zipf:1'], check=True, stdout=subprocess.DEVNULL)
    log = work + '.hotlog'
    out = subprocess.run([kvbench, '--trace', work, '--backend', 'cpu', '--json', '--quiet',
                          '--hot-log', log], check=True, capture_output=True, text=True).stdout
    want = json.loads(out)['hot_sim']['self_sized']
    text = subprocess.run([hot_batch, log, log], check=True, capture_output=True,
                          text=True).stdout
    text += subprocess.run([hot_batch, '--layer', 'all', log], check=True, capture_output=True,
                           text=True).stdout
    line = re.compile(r'^  (sequence 1 alone|sequence 2 alone|batch of 2|batch of 1): .*holds '
                      r'([0-9.]+) % of the rows, hits ([0-9.]+) %', re.M)
    got = {m.group(1): (m.group(2), m.group(3)) for m in line.finditer(text)}
    expect = ('%.1f' % (100 * want['share']), '%.1f' % (100 * want['hit_rate']))
    bad = []
    for name in ('sequence 1 alone', 'sequence 2 alone', 'batch of 1'):
        if got.get(name) != expect:
            bad.append('%s: %s, kvbench says %s' % (name, got.get(name), expect))
    if 'batch of 2' not in got or not 0 < float(got['batch of 2'][0]) <= 100:
        bad.append('no batch line, or a share outside (0, 100]')
    if bad:
        print('hot_batch disagrees with kvbench:\n  ' + '\n  '.join(bad) + '\n' + text)
        return 1
    print('hot_batch alone = kvbench self-sized: %s %% of the rows, %s %% hits' % expect)
    return 0


if __name__ == '__main__':
    sys.exit(main())
