#!/bin/sh
# kvtier's one entry point on a fresh Debian machine: installs the Debian packages that are missing
# (with sudo when not root), configures and builds in ./build, then runs what was asked.
#   ./build.sh bench [kvbench flags]   build, then run tools/kvbench (its built-in default without flags)
#   ./build.sh test                    build, then run every test suite that can run on this machine,
#                                      then the unit, fault and nvme suites again in an ASan+UBSan
#                                      build (./build-asan; KVT_ASAN=0 leaves it out)
set -eu
cd "$(dirname "$0")"

pkgs="meson ninja-build pkg-config gcc g++ libc6-dev libcmocka-dev liburing-dev libhwloc-dev libnuma-dev python3 python3-numpy python3-pytest python3-setuptools python3-pip"
missing=""
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "build.sh: installing Debian packages:$missing" >&2
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
	# shellcheck disable=SC2086
	$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null
fi

# CI builds treat warnings as errors (Meson's built-in werror option)
werror=false
[ "${CI:-}" = true ] && werror=true
if [ ! -f build/build.ninja ]; then
	meson setup build --buildtype=debugoptimized -Dwerror=$werror
fi
meson compile -C build

# "tests: N passed, N failed, N skipped" from a meson test log ($1), labelled $2; with a pytest
# JUnit report ($3), its tests count one by one in place of the one meson test that ran them
summary() {
	ok=$(sed -n 's/^Ok: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
	fail=$(sed -n 's/^Fail: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
	xfail=$(sed -n 's/^Expected Fail: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
	timeout=$(sed -n 's/^Timeout: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
	skip=$(sed -n 's/^Skipped: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
	ok=${ok:-0} fail=$(( ${fail:-0} + ${timeout:-0} )) skip=${skip:-0}
	junit_report=${3:-}
	if [ -n "$junit_report" ] && [ -f "$junit_report" ]; then
		attr() { sed -n "s/.*<testsuite [^>]*\b$1=\"\([0-9]*\)\".*/\1/p" "$junit_report" | head -n 1; }
		py_all=$(attr tests) py_fail=$(( $(attr failures) + $(attr errors) )) py_skip=$(attr skipped)
		py_ok=$(( py_all - py_fail - py_skip ))
		echo "python tests (pytest): $py_ok passed, $py_fail failed, $py_skip skipped"
		if [ "$py_fail" -gt 0 ]; then fail=$(( fail - 1 )); else ok=$(( ok - 1 )); fi
		ok=$(( ok + py_ok )) fail=$(( fail + py_fail )) skip=$(( skip + py_skip ))
	fi
	echo "$2: $ok passed, $fail failed, $skip skipped, ${xfail:-0} known defects failing as expected"
}

what=${1:-test}
[ $# -gt 0 ] && shift
case "$what" in
bench)
	exec ./build/tools/kvbench "$@"
	;;
test)
	log=build/meson-logs/test-summary.txt
	# the meson test `python` runs pytest, which writes this report: its tests are counted one
	# by one in the summary, in place of the one meson test
	junit=build/meson-logs/pytest-kvtier.xml
	rm -f "$junit"
	# meson's own status, not tee's (sh has no pipefail)
	( meson test -C build --print-errorlogs "$@"; echo $? >build/meson-logs/test-rc ) | tee "$log"
	rc=$(cat build/meson-logs/test-rc)
	if [ "${KVT_ASAN:-1}" = 0 ]; then
		summary "$log" tests "$junit"
		exit "$rc"
	fi
	# The sanitizer matrix's every-run cell: AddressSanitizer and UndefinedBehaviorSanitizer over
	# the CPU and NVMe suites (no CUDA: the gpu suite runs in ./build). b_lundef=false because
	# sanitized shared objects leave the runtime's symbols to the executable. Warnings are not
	# errors here: ./build holds the code to -Werror, and gcc's flow analysis under
	# -fsanitize=address warns where it does not without (a NULL destination of sprintf after an
	# allocation whose failure ends the test, in tests/test_trace.c).
	if [ ! -f build-asan/build.ninja ]; then
		meson setup build-asan --buildtype=debugoptimized -Dwerror=false -Dcuda=disabled \
			-Db_sanitize=address,undefined -Db_lundef=false
	fi
	meson compile -C build-asan
	alog=build-asan/meson-logs/test-summary.txt
	( ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1} \
	  UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1} \
		meson test -C build-asan --print-errorlogs --timeout-multiplier 3 \
		--suite unit --suite fault --suite nvme; echo $? >build-asan/meson-logs/test-rc ) |
		tee "$alog"
	arc=$(cat build-asan/meson-logs/test-rc)
	summary "$log" tests "$junit"
	summary "$alog" "asan+ubsan tests"
	[ "$rc" -ne 0 ] && exit "$rc"
	exit "$arc"
	;;
*)
	echo "usage: $0 bench [kvbench flags] | test [meson test flags]" >&2
	exit 2
	;;
esac
