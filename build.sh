#!/bin/sh
# kvtier's one entry point on a fresh Debian machine: installs the Debian packages that are missing
# (with sudo when not root), configures and builds in ./build, then runs what was asked.
#   ./build.sh bench [kvbench flags]   build, then run tools/kvbench (its built-in default without flags)
#   ./build.sh test                    build, then run every test suite that can run on this machine
set -eu
cd "$(dirname "$0")"

pkgs="meson ninja-build pkg-config gcc g++ libc6-dev libcmocka-dev liburing-dev libhwloc-dev libnuma-dev python3"
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
	set +e
	meson test -C build --print-errorlogs "$@" | tee "$log"
	rc=$?
	set -e
	ok=$(sed -n 's/^Ok: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	fail=$(sed -n 's/^Fail: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	timeout=$(sed -n 's/^Timeout: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	skip=$(sed -n 's/^Skipped: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	echo "tests: ${ok:-0} passed, $(( ${fail:-0} + ${timeout:-0} )) failed, ${skip:-0} skipped"
	exit $rc
	;;
*)
	echo "usage: $0 bench [kvbench flags] | test [meson test flags]" >&2
	exit 2
	;;
esac
