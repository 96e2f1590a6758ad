#!/usr/bin/env bash
# Build the native quantizers of git revision REV (default HEAD~1) and of the working tree with refitd's
# flags, then time their kernels interleaved (bench/native_ab.c). Prints ratios against memcpy.
set -euo pipefail
rev=${1:-HEAD~1}
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-O3 -march=native -ffp-contract=off -fno-fast-math -fPIC -shared)
mkdir -p "$tmp/old"
for f in $(git -C "$root" ls-tree --name-only "$rev" sidecar/numerics/native/); do
    case $f in *.c | *.h) git -C "$root" show "$rev:$f" >"$tmp/old/$(basename "$f")" ;; esac
done
cc "${flags[@]}" -o "$tmp/old.so" "$tmp"/old/*.c
cc "${flags[@]}" -o "$tmp/new.so" "$root"/sidecar/numerics/native/*.c
cc -O2 -o "$tmp/native_ab" "$root/bench/native_ab.c" -ldl -lpthread -lm
echo "old = $rev, new = working tree ($(git -C "$root" rev-parse --short HEAD)); $(uptime)"
cd "$tmp" && ./native_ab ./old.so ./new.so
