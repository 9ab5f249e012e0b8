#!/bin/bash
# A/B of GPU tests and benchmarks between source trees in one device call (bench/h200_check.sh is
# the whole check of one tree). It checks what it can before it spends device time: every
# variant's sed must change its file and every program must be a target of the build. Then it
# builds the trees in parallel, runs each test once per tree and each benchmark ROUNDS times,
# alternating the trees within a round, and prints each run's lines that match GREP, prefixed by
# the tree's name. Summary in $OUT/ab.txt (or ./ab-out), one log per tree and program in
# $OUT/ab-logs.tgz, and the printed lines collated by bench/ab_table.py in $OUT/ab-table.txt (every
# figure that differs between runs, trees side by side, with each tree's change from the first
# tree's; printed at the end too): three files, whatever the number of runs.
#
# Trees, in order (the first is the baseline the others are read against):
#   --tree NAME=DIR                 a source tree: `.` (the working tree) or a copy of a ref,
#                                   made before the call: git archive REF | tar -x -C scratch/REF
#   --tree NAME=BASE@FILE@SEDEXPR   tree BASE (named before) with one sed expression applied to
#                                   FILE, e.g. gb2=new@gpu/attend.cu@'s/^#define AT_MAX_GB 8 /#define AT_MAX_GB 2 /'
# Programs: --test NAME (tests/NAME, once per tree), --bench 'NAME ARGS' (bench/NAME ARGS, each
# round). --rounds R (default 2), --grep REGEX (default: lines with "us" or "ms" figures),
# --dry (set up, check and build only: runs without a GPU), --timeout S (per run, default 300).
# --suite S (a meson suite, e.g. gpu: once per tree, after the tests) builds every target of each
# tree; otherwise only the named programs are built, in $AB_DIR/build/NAME (default /tmp/ab), plus
# each --build TARGET (e.g. bench/gpu_scan: built on every tree, not run, for commands after the
# A/B); running anything else on a tree afterwards needs `ninja -C /tmp/ab/build/NAME` first.
# Usage, on the GPU machine, from the repository root:
#   source .offline-deps/env.sh && bash bench/gpu_ab.sh --tree main=scratch/main --tree new=. \
#       --test test_gpu_kernels --bench 'gpu_decode --contexts 131072 --batches 8'
set -u
out=${OUT:-ab-out}; mkdir -p "$out"
work=${AB_DIR:-/tmp/ab}; rm -rf "$work/logs"; mkdir -p "$work/src" "$work/build" "$work/logs"
rounds=2; grep_re='[0-9.]+ (us|ms)'; dry=0; tmo=300
names=(); tests=(); benches=(); suites=(); extra=()
declare -A dir
die() { echo "gpu_ab: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
	case $1 in
	--tree)
		[ $# -ge 2 ] || die "--tree needs NAME=DIR or NAME=BASE@FILE@SEDEXPR"
		spec=$2; shift 2
		name=${spec%%=*}; rest=${spec#*=}
		[[ $name =~ ^[A-Za-z0-9_-]+$ && $spec == *=* ]] || die "bad tree name in '$spec'"
		[ -z "${dir[$name]:-}" ] || die "tree $name given twice"
		if [[ $rest == *@*@* ]]; then
			base=${rest%%@*}; r2=${rest#*@}; file=${r2%%@*}; expr=${r2#*@}
			[ -n "${dir[$base]:-}" ] || die "tree $name: base tree '$base' not named before it"
			[ -f "${dir[$base]}/$file" ] || die "tree $name: no file $file in tree $base"
			d=$work/src/$name; rm -rf "$d"; mkdir -p "$d"
			for p in meson.build meson_options.txt lib gpu host tools tests bench; do
				[ -e "${dir[$base]}/$p" ] && cp -r "${dir[$base]}/$p" "$d/"
			done
			sed -i -e "$expr" "$d/$file" || die "tree $name: sed '$expr' failed"
			cmp -s "${dir[$base]}/$file" "$d/$file" && die "tree $name: sed '$expr' changed nothing in $file"
			dir[$name]=$d
		else
			[ -f "$rest/meson.build" ] || die "tree $name: no meson.build in '$rest'"
			dir[$name]=$(cd "$rest" && pwd)
		fi
		names+=("$name") ;;
	--test) [ $# -ge 2 ] || die "--test needs a name"; tests+=("$2"); shift 2 ;;
	--bench) [ $# -ge 2 ] || die "--bench needs 'NAME ARGS'"; benches+=("$2"); shift 2 ;;
	--suite) [ $# -ge 2 ] || die "--suite needs a meson suite"; suites+=("$2"); shift 2 ;;
	--build) [ $# -ge 2 ] || die "--build needs a target (bench/NAME, tests/NAME)"; extra+=("$2"); shift 2 ;;
	--rounds) rounds=$2; shift 2; [[ $rounds =~ ^[1-9][0-9]*$ ]] || die "--rounds $rounds: not a count" ;;
	--grep) grep_re=$2; shift 2 ;;
	--timeout) tmo=$2; shift 2; [[ $tmo =~ ^[1-9][0-9]*$ ]] || die "--timeout $tmo: not seconds" ;;
	--dry) dry=1; shift ;;
	*) die "unknown argument '$1' (see the header of bench/gpu_ab.sh)" ;;
	esac
done
[ ${#names[@]} -ge 1 ] || die "no --tree"
[ $((${#tests[@]} + ${#benches[@]} + ${#suites[@]})) -ge 1 ] || die "no --test, --bench or --suite"
exec > >(tee -a "$out/ab.txt") 2>&1
t0=$(date +%s); el() { echo "$(( $(date +%s) - t0 )) s"; }
targets=()
for t in "${tests[@]}"; do targets+=("tests/$t"); done
for b in "${benches[@]}"; do targets+=("bench/${b%% *}"); done
targets+=("${extra[@]}")
: >"$work/lines.txt" # what ab_table.py collates: the run lines and their matched lines
echo "gpu_ab: trees ${names[*]}; targets ${targets[*]}; suites ${suites[*]:-none}; $rounds rounds" |
	tee -a "$work/lines.txt"

# set up every tree, then check the targets before building anything
pids=()
for n in "${names[@]}"; do
	b=$work/build/$n
	( [ -f "$b/build.ninja" ] || meson setup "$b" "${dir[$n]}" -Dcuda=enabled >"$work/logs/setup_$n.log" 2>&1 ) &
	pids+=($!)
done
fail=0
for i in "${!pids[@]}"; do
	wait "${pids[$i]}" || { echo "setup ${names[$i]} failed:"; tail -20 "$work/logs/setup_${names[$i]}.log"; fail=1; }
done
[ $fail = 0 ] || exit 1
for n in "${names[@]}"; do
	all=$(ninja -C "$work/build/$n" -t targets all 2>/dev/null | cut -d: -f1)
	for t in "${targets[@]}"; do
		grep -qx "$t" <<<"$all" || die "tree $n has no target $t (targets like it: $(grep -E "^${t%%/*}/" <<<"$all" | grep -v '\.p/' | xargs -n1 basename | sort -u | tr '\n' ' '))"
	done
done
pids=()
for n in "${names[@]}"; do
	# every target when a suite runs (ninja builds them all without a target named)
	want=("${targets[@]}"); [ ${#suites[@]} = 0 ] || want=()
	( ninja -C "$work/build/$n" "${want[@]}" >"$work/logs/build_$n.log" 2>&1; r=$?
	  echo "build $n rc=$r ($(el))"; [ $r = 0 ] || tail -30 "$work/logs/build_$n.log"; exit $r ) &
	pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
[ $fail = 0 ] || exit 1
[ $dry = 0 ] || { echo "gpu_ab: --dry: built, nothing run"; exit 0; }

rc=0
for t in "${tests[@]}"; do
	for n in "${names[@]}"; do
		timeout "$tmo" "$work/build/$n/tests/$t" >>"$work/logs/${n}_$t.log" 2>&1; r=$?
		echo "$n $t rc=$r ($(el))"; [ $r = 0 ] || rc=1
	done
done
for s in "${suites[@]}"; do
	for n in "${names[@]}"; do
		log=$work/logs/${n}_suite_$s.log
		timeout "$tmo" meson test -C "$work/build/$n" --no-rebuild --suite "$s" --print-errorlogs \
			>"$log" 2>&1; r=$?
		echo "$n suite $s rc=$r ($(el)): $(grep -E '^(Ok|Fail|Skipped|Timeout):' "$log" |
			tr -s ' ' | tr '\n' ' ')"; [ $r = 0 ] || rc=1
	done
done
for r in $(seq "$rounds"); do
	for b in "${benches[@]}"; do
		prog=${b%% *}; args=; [[ $b == *" "* ]] && args=${b#* }
		for n in "${names[@]}"; do
			log=$work/logs/${n}_$prog.log
			echo "=== round $r: $b" >>"$log"
			start=$(wc -l <"$log")
			# shellcheck disable=SC2086 # the arguments are split on purpose
			timeout "$tmo" "$work/build/$n/bench/$prog" $args >>"$log" 2>&1; x=$?
			echo "$n $b: round $r rc=$x ($(el))" | tee -a "$work/lines.txt"; [ $x = 0 ] || rc=1
			tail -n +"$((start + 1))" "$log" | grep -E -- "$grep_re" | cut -c1-400 |
				sed "s/^/  $n: /" | tee -a "$work/lines.txt"
		done
	done
done
tar czf "$out/ab-logs.tgz" -C "$work" logs
if [ ${#benches[@]} -gt 0 ]; then
	echo "=== collated (bench/ab_table.py)"
	python3 "$(dirname "$0")/ab_table.py" "$work/lines.txt" >"$out/ab-table.txt" 2>&1
	cat "$out/ab-table.txt"
fi
echo "gpu_ab: done ($(el)), rc=$rc"
exit $rc
