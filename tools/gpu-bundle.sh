#!/bin/sh
# gpu-bundle.sh: build libmoe with CUDA (in _build-gpu) and pack what the GPU
# machine needs into _gpu/bundle.tar.xz: libmoe, the plugins, the GPU tests,
# the CPU experts test, the benchmarks and the moe CLI, plus every shared
# library they link that the GPU machine lacks (GLib, GObject, GIO, GModule,
# json-glib, OpenBLAS and theirs; not libc, the C++ runtime or CUDA's, which
# it has). tools/gpu-run.sh unpacks and runs it there:
#
#   tools/gpu-bundle.sh
#   (on the GPU machine, with _gpu carried)  tools/gpu-run.sh test
#
# --candidate NAME builds this tree but keeps only its cuda plugin
# (stripped, xz: ~4.3 MB), as _gpu/candidate-NAME.so.xz (its commit in
# _gpu/candidate-NAME.commit), and the programs that link the kernels
# themselves rather than load the plugin (test-cuda-attention,
# test-cuda-rope, test-cuda-sampling, test-cuda-quantize,
# moe-bench-attention: ~2.3 MB) as _gpu/candidate-NAME.bin.tar.xz, beside
# the bundle already there: several
# changes (branches) tested and timed in one call (tools/gpu-run.sh test
# NAME, compare, attention-compare). A new bundle drops the candidates, but
# the baseline:
#
# --keep-baseline first keeps the cuda plugin of the bundle already there
# as the candidate "baseline", for tools/gpu-run.sh compare: the code
# before a change timed beside the code after it, in one call.
#
# SPDX-License-Identifier: LGPL-2.1-or-later
set -eu
cd "$(dirname "$0")/.."

candidate=
case "${1:-}" in
  --candidate)
    candidate=${2:?--candidate NAME}
    case "$candidate" in *[!A-Za-z0-9_-]*) echo "a candidate's NAME is letters, digits, - and _" >&2; exit 2 ;; esac
    [ -f _gpu/bundle.tar.xz ] || { echo "no _gpu/bundle.tar.xz to add a candidate to" >&2; exit 1 ; } ;;
esac

# the programs that link the kernels themselves (not the plugin), by
# their paths in the build; the bundle has them in bin/
KERNEL_PROGRAMS="tests/gpu/test-cuda-attention tests/gpu/test-cuda-rope tests/gpu/test-cuda-sampling
  tests/gpu/test-cuda-quantize tools/moe-bench-attention"

# keep_plugin SO NAME COMMIT PROGRAM…: SO stripped and compressed as
# candidate NAME, with the programs (KERNEL_PROGRAMS' paths)
keep_plugin () {
  plugin=$(mktemp)
  strip -o "$plugin" "$1"
  xz -9e -c "$plugin" > "_gpu/candidate-$2.so.xz"
  rm -f "$plugin"
  name=$2 commit=$3
  shift 3
  bins=$(mktemp -d)
  mkdir "$bins/bin"
  for b in "$@"; do strip -o "$bins/bin/$(basename "$b")" "$b"; done
  tar -C "$bins" -cJf "_gpu/candidate-$name.bin.tar.xz" bin
  rm -rf "$bins"
  echo "$commit" > "_gpu/candidate-$name.commit"
  echo "_gpu/candidate-$name.so.xz (and .bin.tar.xz): the cuda plugin (and kernel programs) of commit $commit"
}

if [ "${1:-}" = --keep-baseline ]; then
  [ -f _gpu/bundle.tar.xz ] || { echo "no _gpu/bundle.tar.xz to keep a baseline of" >&2; exit 1; }
  base=$(mktemp -d)
  tar -C "$base" -xJf _gpu/bundle.tar.xz moe-gpu/plugins/libmoe-cuda.so \
    $(for b in $KERNEL_PROGRAMS; do echo "moe-gpu/bin/${b##*/}"; done)
  keep_plugin "$base/moe-gpu/plugins/libmoe-cuda.so" baseline "$(cat _gpu/commit 2>/dev/null || echo '?')" \
    $(for b in $KERNEL_PROGRAMS; do echo "$base/moe-gpu/bin/${b##*/}"; done)
  rm -rf "$base"
fi

build=_build-gpu
# Hopper's machine code alone: the H200 runs nothing else (a third of the
# compile time, and a plugin small enough that candidates fit in a call)
if [ -f "$build/build.ninja" ]; then
  meson setup --reconfigure "$build" -Dgpu_archs=90 >/dev/null
else
  meson setup "$build" -Dcuda=enabled -Dintrospection=disabled -Dexamples=false -Dbuildtype=debugoptimized \
    -Dgpu_archs=90 >/dev/null
fi
ninja -C "$build" > "$build/bundle-ninja.log" 2>&1 || { tail -40 "$build/bundle-ninja.log" >&2; exit 1; }
commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +)"

if [ -n "$candidate" ]; then
  keep_plugin "$build/plugins/cuda/libmoe-cuda.so" "$candidate" "$commit" \
    $(for b in $KERNEL_PROGRAMS; do echo "$build/$b"; done)
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage="$tmp/moe-gpu"
mkdir -p "$stage/lib" "$stage/plugins" "$stage/bin"
cp -L "$build/libmoe/libmoe-1.so.0" "$stage/lib/"
for p in eager batched_mm grouped_mm deepgemm sonicmoe deepgemm_megamoe cuda; do
  cp "$build/plugins/$p/libmoe-$p.so" "$build/plugins/$p/$p.plugin" "$stage/plugins/"
done
cp "$build/tests/gpu/test-cuda-experts" "$build/tests/gpu/test-cuda-model" "$build/tests/gpu/test-cuda-attention" \
   "$build/tests/gpu/test-cuda-rope" "$build/tests/gpu/test-cuda-sampling" "$build/tests/gpu/test-cuda-quantize" \
   "$build/tests/c/test-experts" \
   "$build/tools/moe-bench-cuda-experts" "$build/tools/moe-bench-attention" "$build/tools/moe-bench-model" "$build/cli/moe" "$stage/bin/"

for f in "$stage"/lib/* "$stage"/plugins/*.so "$stage"/bin/*; do ldd "$f"; done |
  awk '/=> \// { print $3 }' | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libmoe-1)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done

mkdir -p _gpu
# a new bundle starts a new set of candidates (the baseline stays)
for c in _gpu/candidate-*; do
  case "$c" in _gpu/candidate-baseline.*) ;; *) rm -f "$c" ;; esac
done
tar -C "$tmp" -cJf _gpu/bundle.tar.xz moe-gpu
# "+": with changes not committed
echo "$commit" > _gpu/commit
echo "_gpu/bundle.tar.xz: $(du -h _gpu/bundle.tar.xz | cut -f1), commit $(cat _gpu/commit)"
