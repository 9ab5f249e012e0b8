#!/bin/sh
# kvtier's one entry point on a fresh Debian machine: installs the Debian packages that are missing
# (with sudo when not root), configures and builds in ./build, then runs what was asked.
#   ./build.sh bench [kvbench flags]   build, then run tools/kvbench (its built-in default without flags)
#   ./build.sh test                    build, then run every test suite that can run on this machine
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

if [ ! -f build/build.ninja ]; then
	# CI builds treat warnings as errors (Meson's built-in werror option)
	werror=false
	[ "${CI:-}" = true ] && werror=true
	meson setup build --buildtype=debugoptimized -Dwerror=$werror
fi
meson compile -C build

what=${1:-test}
[ $# -gt 0 ] && shift
case "$what" in
bench)
	exec ./build/tools/kvbench "$@"
	;;
test)
	log=build/meson-logs/test-summary.txt
	# the meson test `python` runs pytest, which writes this report: its tests are counted one
	# by one below, in place of the one meson test
	junit=build/meson-logs/pytest-kvtier.xml
	rm -f "$junit"
	set +e
	meson test -C build --print-errorlogs "$@" | tee "$log"
	rc=$?
	set -e
	ok=$(sed -n 's/^Ok: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	fail=$(sed -n 's/^Fail: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	timeout=$(sed -n 's/^Timeout: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	skip=$(sed -n 's/^Skipped: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	ok=${ok:-0} fail=$(( ${fail:-0} + ${timeout:-0} )) skip=${skip:-0}
	if [ -f "$junit" ]; then
		attr() { sed -n "s/.*<testsuite [^>]*\b$1=\"\([0-9]*\)\".*/\1/p" "$junit" | head -n 1; }
		py_all=$(attr tests) py_fail=$(( $(attr failures) + $(attr errors) )) py_skip=$(attr skipped)
		py_ok=$(( py_all - py_fail - py_skip ))
		echo "python tests (pytest): $py_ok passed, $py_fail failed, $py_skip skipped"
		if [ "$py_fail" -gt 0 ]; then fail=$(( fail - 1 )); else ok=$(( ok - 1 )); fi
		ok=$(( ok + py_ok )) fail=$(( fail + py_fail )) skip=$(( skip + py_skip ))
	fi
	echo "tests: $ok passed, $fail failed, $skip skipped"
	exit $rc
	;;
*)
	echo "usage: $0 bench [kvbench flags] | test [meson test flags]" >&2
	exit 2
	;;
esac
