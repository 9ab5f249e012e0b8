#!/bin/sh
# SPDX-License-Identifier: MIT
# The shared library exports exactly the functions the public header declares with KVT_API: every
# defined dynamic symbol of libkvtier.so is one of them, each of them is exported, and each carries
# a version node of lib/kvtier.map. Catches a glob in the version script, an internal symbol made
# visible (target_clones makes an exported ifunc and its resolver), and a declaration without a
# definition.
# Usage: abi_symbols.sh LIBKVTIER.SO KVTIER.H [PART.H ...] (kvtier.h and the headers it includes)
set -eu
lib=$1
shift
header="$*"
tmp=${TMPDIR:-/tmp}/kvt-abi-symbols.$$
trap 'rm -f "$tmp".*' EXIT

# declared: the name before the first '(' of each line that starts with KVT_API
# shellcheck disable=SC2086
sed -n 's/^KVT_API [^(]*[^a-z0-9_]\(kvt_[a-z0-9_]*\)(.*/\1/p' $header | sort -u >"$tmp.want"
# exported: defined dynamic symbols, without the version suffix; the version nodes themselves are
# absolute symbols (type A) and are left out
nm -D --defined-only "$lib" | awk '$2 != "A" { print $3 }' | sed 's/@.*//' | sort -u >"$tmp.got"
nm -D --defined-only "$lib" | awk '$2 != "A" { print $3 }' | grep -v '@@*KVTIER_' |
	sed 's/@.*//' | sort -u >"$tmp.unversioned" || true

n_want=$(wc -l <"$tmp.want")
n_got=$(wc -l <"$tmp.got")
fail=0
if [ "$n_want" -eq 0 ]; then
	echo "abi_symbols: no KVT_API declaration found in $header"
	exit 1
fi
extra=$(comm -13 "$tmp.want" "$tmp.got")
missing=$(comm -23 "$tmp.want" "$tmp.got")
if [ -n "$extra" ]; then
	echo "abi_symbols: exported but not declared with KVT_API in kvtier.h:" $extra
	fail=1
fi
if [ -n "$missing" ]; then
	echo "abi_symbols: declared with KVT_API but not exported:" $missing
	fail=1
fi
if [ -s "$tmp.unversioned" ]; then
	echo "abi_symbols: exported without a KVTIER_ version node:" $(cat "$tmp.unversioned")
	fail=1
fi
echo "abi_symbols: got $n_got exported symbols, wanted the $n_want declared ones"
exit $fail
