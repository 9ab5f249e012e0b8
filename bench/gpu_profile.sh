#!/bin/bash
# A per-kernel profile of one benchmark under Nsight Compute, one launch of each kernel: its
# duration, DRAM and SM throughput, issue slots busy, warp cycles per issued instruction, achieved
# and theoretical occupancy, registers and grid. The clocks are left alone (--clock-control none,
# as the device library's METHOD.md asks), but ncu still runs kernels one at a time, so kernels
# that overlap in a step (programmatic dependent launch, graph replay) take longer here than there.
# Usage, on the GPU machine, from the repository root, after a build in BUILD (default /tmp/b):
#   source .offline-deps/env.sh && bash bench/gpu_profile.sh [--nth N] 'gpu_decode --contexts 131072 --batches 16'
# --nth N profiles each kernel's N-th launch (default 3: after two warm-up launches). Writes
# $OUT/profile.csv (ncu's raw details) and prints the table (bench/profile_table.py).
set -u
out=${OUT:-profile-out}; mkdir -p "$out"
b=${BUILD:-/tmp/b}; nth=3
die() { echo "gpu_profile: $*" >&2; exit 2; }
[ "${1:-}" = --nth ] && { nth=$2; shift 2; }
[[ $nth =~ ^[1-9][0-9]*$ ]] || die "--nth $nth: not a launch count"
[ $# -eq 1 ] || die "one program with its arguments, quoted (see the header)"
read -r prog args <<<"$1"
[ -x "$b/bench/$prog" ] || die "no bench/$prog in the build $b"
command -v ncu >/dev/null || die "ncu is not on the PATH"
# shellcheck disable=SC2086
ncu --clock-control none --kernel-id "::regex:.:$nth" \
	--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
	--section WarpStateStats --csv --page details "$b/bench/$prog" $args >"$out/profile.csv" \
	2>"$out/profile.err" || { tail -20 "$out/profile.err"; die "ncu failed"; }
python3 "$(dirname "$0")/profile_table.py" "$out/profile.csv"
