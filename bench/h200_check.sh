#!/bin/bash
# The whole GPU check of the CUDA backend in one device call: build, the gpu and unit suites,
# compute-sanitizer memcheck and racecheck on the gpu tests, then (with --bench) the GPU
# benchmarks (gpu_decode and gpu_throughput also with --drift 0.5, gpu_throughput there also
# eager with and without keep_weight 8; gpu_extend through
# bench/extend_vs_sdpa.py, which adds PyTorch SDPA's times when torch is there), nvme_read,
# cpu_miss_attend and gpu_spilled. Logs go to $OUT (or ./h200-out): summary.txt and one log per
# stage, six files at most. The build directory is $BUILD (default /tmp/b), configured once.
# $SANITIZE_TESTS names the gpu tests the sanitizers run (default all eight; racecheck of
# test_gpu_backend alone takes about 210 s, so a call that must stay under 600 s may leave it
# out). Usage, on the GPU machine, from the repository root:
#   source .offline-deps/env.sh && bash bench/h200_check.sh [--bench] [--no-sanitize]
set -u
out=${OUT:-h200-out}; mkdir -p "$out"
b=${BUILD:-/tmp/b}
bench=0; sanitize=1
for a in "$@"; do
	case $a in --bench) bench=1 ;; --no-sanitize) sanitize=0 ;; *) echo "unknown $a"; exit 2 ;; esac
done
rc=0
step() { # log, name, command...: run, append to $out/log.log, remember a failure
	local l=$1 n=$2; shift 2
	local t0
	t0=$(date +%s)
	echo "=== $n" >>"$out/$l.log"
	"$@" >>"$out/$l.log" 2>&1; local r=$?
	echo "$n: rc=$r ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
	[ $r -eq 0 ] || rc=1
	return $r
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/summary.txt" 2>&1
{ git log --oneline -1 && git status --short | head -20; } >>"$out/summary.txt" 2>&1
[ -d "$b" ] || meson setup "$b" -Dcuda=enabled >"$out/setup.log" 2>&1 || { echo setup failed; tail -30 "$out/setup.log"; exit 1; }
step build build ninja -C "$b" || { tail -40 "$out/build.log"; exit 1; }
step tests tests meson test -C "$b" --no-rebuild --suite gpu --suite unit --print-errorlogs
if [ $sanitize = 1 ]; then
	for tool in memcheck racecheck; do
		for t in ${SANITIZE_TESTS:-test_gpu_kernels test_gpu_backend test_gpu_hot test_gpu_calls test_gpu_graph test_gpu_streams test_gpu_keep test_gpu_reach}; do
			KVT_TEST_QUICK=1 step sanitizer "$tool $t" compute-sanitizer --tool $tool --error-exitcode 9 "$b/tests/$t"
			tail -2 "$out/sanitizer.log" >>"$out/summary.txt"
		done
	done
fi
if [ $bench = 1 ]; then
	for x in gpu_scan gpu_select gpu_gather gpu_decode gpu_throughput gpu_graph; do
		step bench "$x" "$b/bench/$x"
	done
	# the same decode and throughput on queries whose selection drifts from step to step, as a
	# trained model's does (doc/cuda-backend.md: there the step is bound by PCIe)
	for x in gpu_decode gpu_throughput; do
		step bench "$x --drift 0.5" "$b/bench/$x" --drift 0.5
	done
	# the selection's hysteresis on the same queries (eager steps: graphs refuse it), against
	# the eager steps without it (doc/hysteresis.md)
	step bench "gpu_throughput --drift 0.5 --graph 0" "$b/bench/gpu_throughput" --drift 0.5 --graph 0
	step bench "gpu_throughput --drift 0.5 --keep 8" "$b/bench/gpu_throughput" --drift 0.5 --keep 8
	# the NVMe path: the disk's own ceiling, then decode straight from NVMe against host memory
	# (scratch files in $TMPDIR, else /tmp: O_DIRECT, so no tmpfs)
	step bench nvme_read "$b/bench/nvme_read"
	# the host attending the misses itself instead of sending their rows over PCIe (decision (c)
	# of doc/cuda-backend.md): how fast this host's cores would dispose of them
	step bench cpu_miss_attend "$b/bench/cpu_miss_attend"
	step bench gpu_spilled "$b/bench/gpu_spilled" --nvme-cache-mib 256 --gpu-cache-mibs 64,256
	step bench extend_vs_sdpa python3 bench/extend_vs_sdpa.py "$b/bench/gpu_extend"
fi
cat "$out/summary.txt"
exit $rc
