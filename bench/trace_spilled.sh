#!/bin/bash
# Decode straight from NVMe on a trained model's queries (#14): trains the small model
# (tools/python/scripts/train_small.py), captures a trace of it (tools/capture_trace.py), then
# replays the trace with kvbench on the CUDA backend twice per hot-cache size, the rows in host
# memory and spilled to NVMe after each layer's prefill, and prints one line per pair: step time,
# the spilled step over the host step, hot-cache hits, NVMe bytes and read I/Os per step, PCIe
# bytes per step, and the disk floor (the reads at the rate of a raw io_uring loop measured first,
# bench/nvme_read) with the spilled step's extra time over it. Synthetic workloads share 95 % of a
# step's selection with the next; a trained model's queries about half, so this is the figure a
# runtime sees.
# Needs torch and transformers (the GPU machine). Usage, from the repository root:
#   bash bench/trace_spilled.sh BUILD_DIR [--minutes M] [--context C] [--prefill T] [--decode S]
#        [--gpu-caches auto,6M,...] [--nvme-qd N] [--nvme-cache N] [--work DIR]
# --context is the context the model trains at (default 8192; --prefill defaults to it).
# --nvme-cache is the block cache (kvbench's; default the library's 64 MiB, which holds a whole
# layer of an 8K trace, so that only first touches reach the disk; a layer of a 32K trace is
# 32 MiB, of which the 6 layers then do not fit). The work directory (default $TMPDIR or /tmp,
# then kvt-trace-spilled) must take O_DIRECT; the model and the trace are kept there per context
# and length, and reused.
set -eu
[ $# -ge 1 ] || { sed -n 2,19p "$0"; exit 2; }
b=$1; shift
minutes=2; context=8192; prefill=; decode=64; caches=auto,6M,12M,24M; qd=32; ncache=
work=${TMPDIR:-/tmp}/kvt-trace-spilled
while [ $# -gt 0 ]; do
	[ $# -ge 2 ] || { echo "trace_spilled: $1 needs a value" >&2; exit 2; }
	case $1 in
	--minutes) minutes=$2 ;; --context) context=$2 ;; --prefill) prefill=$2 ;;
	--decode) decode=$2 ;;
	--gpu-caches) caches=$2 ;; --nvme-qd) qd=$2 ;; --nvme-cache) ncache=$2 ;; --work) work=$2 ;;
	*) echo "trace_spilled: unknown option $1" >&2; exit 2 ;;
	esac
	shift 2
done
prefill=${prefill:-$context}
kvbench=$b/tools/kvbench
[ -x "$kvbench" ] || { echo "trace_spilled: no $kvbench (build first)" >&2; exit 1; }
mkdir -p "$work"
model=$work/model-$context trace=$work/trace-$context-$prefill-$decode
if [ ! -f "$model/config.json" ]; then
	echo "training the small model at context $context for $minutes minutes" >&2
	# the same tokens per training step at every context (8 sequences of 8K)
	batch=$(( 65536 / context > 0 ? 65536 / context : 1 ))
	python3 tools/python/scripts/train_small.py --out "$model" --minutes "$minutes" \
		--context "$context" --batch "$batch" >"$work/train.log"
fi
if [ ! -f "$trace/meta.json" ]; then
	rm -rf "$trace"
	echo "capturing $prefill + $decode tokens" >&2
	python3 tools/capture_trace.py --model "$model" --prefill "$prefill" --decode "$decode" \
		--device cuda "$trace" >"$work/capture.log" 2>&1
fi
# the disk's own limit, as bench/gpu_spilled measures it: a raw io_uring loop of 4 KiB O_DIRECT
# random reads at the tier's queue depth, in the work directory (nvme_read's first figures)
kiops=$("$b/bench/nvme_read" --file "$work/raw.dat" --qd "$qd" --runs 3 --seconds 1 2>/dev/null |
	awk '/^  raw io_uring, O_DIRECT/ {
		for (i = 2; i <= NF; i++) if ($i == "K" && $(i + 1) == "IOPS") print $(i - 1) }')
rm -f "$work/raw.dat"
echo "disk limit: raw io_uring loop of 4 KiB O_DIRECT random reads at queue depth $qd:" \
	"${kiops:-unknown} K IOPS (floor_ms: a step's reads at that rate)"
row() { # hot cache, host json, spilled json, K IOPS: one line of the table
	python3 - "$@" <<'PY'
import json, sys
c, h, s = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
kiops = float(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else float("nan")
def f(d, k):
    v = d.get(k)
    return float("nan") if v is None else v
reads = f(s, "nvme_reads_per_step")
floor = reads / kiops if kiops > 0 else float("nan")  # ms: reads / (K IOPS x 1000) x 1000
extra = f(s, "step_ms") - f(h, "step_ms")
print("%-8s %10.4f %10.4f %8.2f %8.4f %8.4f %12.0f %10.1f %12.0f %9.3f %8.2f %8.4f %8.4f" % (
    c, f(h, "step_ms"), f(s, "step_ms"), f(s, "step_ms") / f(h, "step_ms"), f(h, "hot_hit_rate"),
    f(s, "hot_hit_rate"), f(s, "nvme_bytes_per_step"), reads, f(s, "pcie_bytes_per_step"),
    floor, extra / floor if floor > 0 else float("nan"), f(s, "recall_p5"), f(s, "recall_mean")))
PY
}
printf '%-8s %10s %10s %8s %8s %8s %12s %10s %12s %9s %8s %8s %8s\n' gpu_cache host_ms spilled_ms \
	ratio host_hit sp_hit nvme_B/step reads/step pcie_B/step floor_ms xtra/flr p5 recall
IFS=, read -ra list <<<"$caches"
for c in "${list[@]}"; do
	rm -f "$work"/kv.img
	"$kvbench" --trace "$trace" --backend cuda --gpu-cache "$c" --json --quiet >"$work/host.json"
	"$kvbench" --trace "$trace" --backend cuda --gpu-cache "$c" --json --quiet \
		--nvme "$work/kv.img" --nvme-qd "$qd" ${ncache:+--nvme-cache "$ncache"} >"$work/spilled.json"
	rm -f "$work"/kv.img
	row "$c" "$work/host.json" "$work/spilled.json" "$kiops"
done
