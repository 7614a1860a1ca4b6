#!/bin/sh
# gpu-run.sh: on the GPU machine, unpack _gpu/bundle.tar.xz (tools/gpu-bundle.sh)
# into /tmp/moe-gpu and run
#
#   tools/gpu-run.sh test [NAME [TEST…]]
#                                   the gpu suite (tests/gpu) and the CPU
#                                   experts test, with the environment meson
#                                   test gives them; prints "N passed, N failed,
#                                   N skipped" and exits non-zero on a failure;
#                                   NAME: with the cuda plugin of candidate NAME
#                                   (tools/gpu-bundle.sh --candidate NAME;
#                                   "this" for the bundle's own), TEST…: only
#                                   these of the suite (test-cuda-experts …)
#   tools/gpu-run.sh bench [ARGS]   tools/bench-experts-cuda.py ARGS; SIDE=NAME:
#                                   with the cuda plugin of candidate NAME
#   tools/gpu-run.sh attention-bench [ARGS]
#                                   moe-bench-attention ARGS: the two prefill
#                                   flash-attention kernels side by side
#   tools/gpu-run.sh attention-compare [ARGS]
#                                   the same with the baseline's and each
#                                   candidate's kernels, then this bundle's,
#                                   twice (default ARGS: -t 512,2048,8192)
#   tools/gpu-run.sh model-bench [ARGS]
#                                   tools/bench-model-cuda.py ARGS (a whole
#                                   model, beside transformers)
#   tools/gpu-run.sh profile [ARGS]  moe-bench-model ARGS (the model-bench
#                                   checkpoint, --device cuda --dtype bfloat16)
#                                   under Nsight Compute, every kernel timed
#                                   alone: a table of GPU time per kernel
#                                   (tools/ncu-summary.py); run model-bench
#                                   first in the same call; NCU_ARGS: more
#                                   ncu options; PROFILE_MODEL: another
#                                   checkpoint (model-bench --layers 4
#                                   --model-dir DIR writes a short one);
#                                   PROFILE_TAIL=N: also the last N kernels
#                                   in launch order (one step's sequence);
#                                   SIDE=NAME: with candidate NAME's plugin
#   tools/gpu-run.sh stalls REGEX [ARGS]
#                                   moe-bench-model ARGS (default: a decode
#                                   at batch 1, -p 0 -b 1 -s 8 -r 1; the
#                                   checkpoint as profile's) under Nsight
#                                   Compute's stall sampling for the kernels
#                                   named by REGEX (16 launches after 12):
#                                   where their warps wait, SASS line by
#                                   line (tools/ncu-stalls.py); SIDE=NAME as
#                                   profile; NCU_ARGS: more ncu options
#   tools/gpu-run.sh repeat-costs [ARGS]
#                                   moe-bench-model ARGS (default: decode at
#                                   batch 1 and 8, -p 0 -b 1,8 -s 64 -r 3, on
#                                   profile's checkpoint) with each kernel
#                                   named in REPEAT (text of the mangled
#                                   names) launched twice in a row
#                                   (MOE_CUDA_REPEAT), and with none, two
#                                   rounds (ROUNDS=N: N): a table of the
#                                   extra µs a step each repeat costs —
#                                   what the kernel costs where it stands
#                                   in the graph (a layer's kernel: that
#                                   over the layers);
#                                   SIDE=NAME as profile
#   tools/gpu-run.sh profile-experts [ARGS]
#                                   moe-bench-cuda-experts ARGS (default:
#                                   qwen1.5-moe's layer, grouped_mm, T = 2048,
#                                   one batch) under Nsight Compute for each
#                                   side (SIDES, as compare): its grouped
#                                   GEMMs' report (NCU_ARGS: the sections or
#                                   other options; default: speed of light
#                                   and memory workload, 4 launches after 8)
#   tools/gpu-run.sh profile-layer [ARGS]
#                                   moe-bench-cuda-experts ARGS (default as
#                                   profile-experts) under Nsight Compute for
#                                   each side (SIDES, as compare), every
#                                   kernel of the layer timed alone: a table
#                                   of GPU time per kernel, as profile
#                                   (NCU_ARGS: more ncu options)
#   tools/gpu-run.sh compare [ARGS]  moe-bench-model ARGS (default: the
#                                   model-bench checkpoint, bf16, -s 16 -r 2
#                                   -p 2048 -b 1,8) with the baseline's cuda
#                                   plugin (tools/gpu-bundle.sh
#                                   --keep-baseline), each candidate's and
#                                   this bundle's in turn, twice: the same
#                                   machine's figures side by side, then as
#                                   a table (tools/compare-summary.py); run
#                                   model-bench first; SIDES="NAME… [this]":
#                                   only these sides (also attention-compare)
#   tools/gpu-run.sh compare-experts [ARGS]
#                                   the same for moe-bench-cuda-experts ARGS
#                                   (default: qwen1.5-moe's layer, grouped_mm,
#                                   bf16, T = 2048, 16384): tokens a second
#                                   through the layer (T / median call time)
#   tools/gpu-run.sh tiles [ARGS]    moe-bench-cuda-experts ARGS (e.g. -w fp8,
#                                   --skew 1) on grouped_mm with each tile
#                                   shape forced (MOE_CUDA_TILE=wide, pairs,
#                                   tall) and as route picks, two rounds:
#                                   a table of µs a call, the best and what
#                                   route's pick costs over it; TILES="H,I,E,K:T,…
#                                   …": the layers (default Qwen3-30B-A3B,
#                                   Qwen1.5-MoE, Mixtral at 128–1,092 rows
#                                   an expert); SIDE=NAME as profile; each
#                                   run's line also in /tmp/tiles.log (what
#                                   a cut-off run measured)
#   tools/gpu-run.sh sanitize TOOL [TEST] [-p TESTPATH ...]
#                                   a gpu test (test-cuda-experts,
#                                   test-cuda-model, test-cuda-attention,
#                                   test-cuda-rope, test-cuda-sampling or
#                                   test-cuda-quantize)
#                                   under compute-sanitizer
#                                   --tool TOOL (memcheck, racecheck, …)
#
# The machine has CUDA and cuBLAS but no GLib: the bundle carries GLib.
#
# SPDX-License-Identifier: LGPL-2.1-or-later
set -u
cd "$(dirname "$0")/.."

root=/tmp/moe-gpu
# unpacked once for a bundle: a device call runs this script many times,
# and its time is what is short (the stamp: the bundle's checksum)
stamp=$(cksum < _gpu/bundle.tar.xz) || exit 1
if [ "$(cat "$root/.bundle" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$root" /tmp/moe-side-*
  tar -C /tmp -xJf _gpu/bundle.tar.xz || exit 1
  echo "$stamp" > "$root/.bundle"
fi
export LD_LIBRARY_PATH="$root/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOE_PLUGIN_PATH="$root/plugins" MOE_PLUGIN_SYSTEM_PATH= MOE_TEST_DATA="$PWD/tests/data"
export G_DEBUG=gc-friendly MALLOC_CHECK_=2
echo "bundle of commit $(cat _gpu/commit 2>/dev/null || echo '?')"

# side_of SIDE: the folder of SIDE's plugins/ (its cuda plugin) and bin/
# (the programs that link the kernels themselves; the bundle's where a
# candidate has none): "this" (the bundle's) or a candidate's NAME
# ("baseline": --keep-baseline's)
side_of () {
  [ "$1" = this ] && { echo "$root"; return; }
  src=_gpu/candidate-$1.so.xz dir=/tmp/moe-side-$1
  [ -f "$src" ] || { echo "no $src" >&2; return 1; }
  # unpacked once for this candidate file (a new bundle removes the folder)
  cstamp=$(cat "$src" "_gpu/candidate-$1.bin.tar.xz" 2>/dev/null | cksum) || return 1
  if [ "$(cat "$dir/.candidate" 2>/dev/null)" != "$cstamp" ]; then
    rm -rf "$dir" && mkdir -p "$dir" && cp -r "$root/plugins" "$root/bin" "$dir/" &&
      xz -dc "$src" > "$dir/plugins/libmoe-cuda.so" || return 1
    if [ -f "_gpu/candidate-$1.bin.tar.xz" ]; then
      tar -C "$dir" -xJf "_gpu/candidate-$1.bin.tar.xz" || return 1
    fi
    echo "$cstamp" > "$dir/.candidate"
  fi
  echo "$dir"
}

plugins_of () {
  dir=$(side_of "$1") || return 1
  echo "$dir/plugins"
}

# the candidates' names, the baseline first (the comparisons' reference);
# SIDES="NAME…": only these (and "this" only if named there)
candidates () {
  if [ -n "${SIDES:-}" ]; then
    for c in $SIDES; do [ "$c" != this ] && echo "$c"; done
    return
  fi
  [ -f _gpu/candidate-baseline.so.xz ] && echo baseline
  for c in _gpu/candidate-*.so.xz; do
    c=${c#_gpu/candidate-}
    c=${c%.so.xz}
    [ -f "_gpu/candidate-$c.so.xz" ] && [ "$c" != baseline ] && echo "$c"
  done
}

# "this" (the bundle's own side) unless SIDES leaves it out
this_side () {
  case " ${SIDES:-this} " in *" this "*) echo this ;; esac
}

commit_of () {
  if [ "$1" = this ]; then cat _gpu/commit; else cat "_gpu/candidate-$1.commit"; fi 2>/dev/null || echo '?'
}

# Nsight Compute's command line
find_ncu () {
  command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 | grep . ||
    { echo "no ncu on this machine" >&2; return 1; }
}

# kernel_times PLUGINS PROGRAM [ARGS]: every kernel PROGRAM launches timed
# alone by Nsight Compute (the clocks left alone; NCU_ARGS: more options),
# as a table of GPU time per kernel (PROFILE_TAIL=N: also the last N in
# launch order); PLUGINS: the folder of the cuda plugin to run
kernel_times () {
  plugins=$1
  shift
  # shellcheck disable=SC2086 # NCU_ARGS: more ncu options (--launch-skip N …)
  MOE_PLUGIN_PATH=$plugins "$ncu" --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
    --print-units base ${NCU_ARGS:-} "$@" > /tmp/ncu.csv 2> /tmp/ncu.err || { tail -20 /tmp/ncu.err; return 1; }
  python3 tools/ncu-summary.py /tmp/ncu.csv "${PROFILE_TAIL:-0}"
}

# the checkpoint profile and stalls run moe-bench-model on
profile_model=${PROFILE_MODEL:-/tmp/qwen1.5-moe-a2.7b-random}

what=${1:-test}
[ $# -gt 0 ] && shift
case "$what" in
  test)
    side=${1:-this}
    [ $# -gt 0 ] && shift
    tests=${*:-test-cuda-experts test-cuda-model test-cuda-attention test-cuda-rope test-cuda-sampling test-cuda-quantize test-experts}
    dir=$(side_of "$side") || exit 1
    MOE_PLUGIN_PATH=$dir/plugins
    export MOE_PLUGIN_PATH
    prefix=
    [ "$side" = this ] || { prefix=$side-; echo "the cuda plugin of candidate $side ($(commit_of "$side"))"; }
    passed=0 failed=0 skipped=0
    for t in $tests; do
      # a bundle of a tree before the test has none: counted as skipped
      [ -x "$dir/bin/$t" ] || { echo "$t: SKIP (not in this bundle)"; skipped=$((skipped + 1)); continue; }
      "$dir/bin/$t" --tap > "/tmp/$t.log" 2>&1
      rc=$?
      grep -E '^(not )?ok ' "/tmp/$t.log" | grep -v '^ok ' || true
      n_ok=$(grep -c -E '^ok ' "/tmp/$t.log")
      if [ $rc -eq 77 ]; then
        echo "$t: SKIP ($(tail -1 "/tmp/$t.log"))"
        skipped=$((skipped + 1))
      elif [ $rc -eq 0 ]; then
        echo "$t: OK ($n_ok subtests passed)"
        passed=$((passed + 1))
      else
        echo "$t: FAIL (exit $rc)"; tail -30 "/tmp/$t.log"
        failed=$((failed + 1))
      fi
      [ -n "${OUT:-}" ] && cp "/tmp/$t.log" "$OUT/$prefix$t.log"
    done
    echo "$passed passed, $failed failed, $skipped skipped"
    [ $failed -eq 0 ] && [ $passed -gt 0 ]
    ;;
  compare|compare-experts)
    sides=$(candidates)
    [ -n "$sides" ] || { echo "nothing to compare with (tools/gpu-bundle.sh --keep-baseline or --candidate NAME)" >&2; exit 1; }
    if [ "$what" = compare ]; then
      [ $# -gt 0 ] || set -- -m /tmp/qwen1.5-moe-a2.7b-random --device cuda -d bfloat16 -s 16 -r 2 -p 2048 -b 1,8
    else
      [ $# -gt 0 ] || set -- -s 2048,1408,60,4 -t 2048,16384 -b grouped_mm --batches 3
    fi
    for round in 1 2; do
      for side in $sides $(this_side); do
        plugins=$(plugins_of "$side") || exit 1
        echo "== $side ($(commit_of "$side")), round $round"
        if [ "$what" = compare ]; then
          MOE_PLUGIN_PATH=$plugins "$root/bin/moe-bench-model" "$@" | grep -E '^(prefill|decode)' || exit 1
        else
          # a JSON line a (backend, T): as "layer BACKEND T=… tok/s=…"
          MOE_PLUGIN_PATH=$plugins "$root/bin/moe-bench-cuda-experts" "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line) if line.startswith("{") else {}
    if "median_us" in r:
        print("layer %s T=%d tok/s=%.1f" % (r["backend"], r["T"], r["T"] / r["median_us"] * 1e6))' || exit 1
        fi
      done
    done | tee /tmp/compare.log
    python3 tools/compare-summary.py /tmp/compare.log
    ;;
  tiles)
    MOE_PLUGIN_PATH=$(plugins_of "${SIDE:-this}") || exit 1
    echo "the cuda plugin of ${SIDE:-this} ($(commit_of "${SIDE:-this}"))"
    layers=${TILES:-2048,768,128,8:2048,3072,4096,6144,8192,12288,16384 2048,1408,60,4:2048,3072,4096,6144,8192,12288,16384 4096,14336,8,2:512,1024,2048,4096}
    for round in 1 2; do
      for layer in $layers; do
        for tile in wide pairs tall route; do
          # route: the variable unset (route's own choice)
          if [ $tile = route ]; then unset MOE_CUDA_TILE; else MOE_CUDA_TILE=$tile; export MOE_CUDA_TILE; fi
          "$root/bin/moe-bench-cuda-experts" -s "${layer%%:*}" -t "${layer#*:}" -b grouped_mm --batches 3 "$@" |
            sed -n "s/^{.*\"T\": *\([0-9]*\).*\"median_us\": *\([0-9.]*\).*/${layer%%:*} \1 $tile \2/p" || exit 1
        done
      done
    done | tee /tmp/tiles.log | python3 -c '
import sys
from collections import defaultdict
t = defaultdict(list)
for line in sys.stdin:
    layer, T, tile, us = line.split()
    t[(layer, int(T), tile)].append(float(us))
print("| layer | T | wide | pairs | tall | route | route over the best |")
print("|---|---:|---:|---:|---:|---:|---:|")
for layer, T in sorted({(k[0], k[1]) for k in t}, key=lambda k: (k[0], k[1])):
    mean = {x: sum(t[(layer, T, x)]) / len(t[(layer, T, x)]) for x in ("wide", "pairs", "tall", "route") if t[(layer, T, x)]}
    best = min([v for x, v in mean.items() if x != "route"] or [float("nan")])
    cells = ["**%.1f**" % mean[x] if mean.get(x) == best else ("%.1f" % mean[x] if x in mean else "—") for x in ("wide", "pairs", "tall", "route")]
    over = "%+.1f%%" % (100 * (mean["route"] / best - 1)) if "route" in mean and best == best else "—"
    print("| %s | %d | %s | %s |" % (layer, T, " | ".join(cells), over))'
    ;;
  sanitize)
    tool=${1:-memcheck}
    [ $# -gt 0 ] && shift
    test=test-cuda-experts
    case "${1:-}" in test-cuda-*) test=$1; shift ;; esac
    exec compute-sanitizer --tool "$tool" --error-exitcode 3 "$root/bin/$test" "$@"
    ;;
  bench)
    # (exported above: the benchmark's runs inherit it)
    MOE_PLUGIN_PATH=$(plugins_of "${SIDE:-this}") || exit 1
    echo "the cuda plugin of ${SIDE:-this} ($(commit_of "${SIDE:-this}"))"
    PYTHONUNBUFFERED=1 exec python3 tools/bench-experts-cuda.py --libmoe-bench "$root/bin/moe-bench-cuda-experts" "$@"
    ;;
  attention-bench)
    exec "$root/bin/moe-bench-attention" "$@"
    ;;
  attention-compare)
    [ $# -gt 0 ] || set -- -t 512,2048,8192
    for round in 1 2; do
      for side in $(candidates) $(this_side); do
        dir=$(side_of "$side") || exit 1
        echo "== $side ($(commit_of "$side")), round $round"
        "$dir/bin/moe-bench-attention" "$@" | grep -E '^\|' || exit 1
      done
    done
    ;;
  model-bench)
    PYTHONUNBUFFERED=1 exec python3 tools/bench-model-cuda.py --libmoe-bench "$root/bin/moe-bench-model" "$@"
    ;;
  profile-experts|profile-layer)
    ncu=$(find_ncu) || exit 1
    [ $# -gt 0 ] || set -- -s 2048,1408,60,4 -t 2048 -b grouped_mm --batches 1
    for side in $(candidates) $(this_side); do
      dir=$(side_of "$side") || exit 1
      echo "== $side ($(commit_of "$side"))"
      if [ "$what" = profile-layer ]; then
        kernel_times "$dir/plugins" "$dir/bin/moe-bench-cuda-experts" "$@" || exit 1
        continue
      fi
      # shellcheck disable=SC2086 # NCU_ARGS: ncu options, word-split
      MOE_PLUGIN_PATH=$dir/plugins "$ncu" --clock-control none -k regex:grouped_gemm \
        ${NCU_ARGS:---launch-skip 8 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis} \
        "$dir/bin/moe-bench-cuda-experts" "$@" | grep -v '^{' || exit 1
    done
    ;;
  profile)
    ncu=$(find_ncu) || exit 1
    dir=$(side_of "${SIDE:-this}") || exit 1
    kernel_times "$dir/plugins" "$dir/bin/moe-bench-model" -m "$profile_model" --device cuda -d bfloat16 "$@" || exit 1
    ;;
  repeat-costs)
    [ $# -gt 0 ] || set -- -p 0 -b 1,8 -s 64 -r 3
    plugins=$(plugins_of "${SIDE:-this}") || exit 1
    # the decoder's kernels by kind: norms, the plain / gated / adding
    # GEMVs (q/k/v, o, the shared gate and the head; the shared gate/up;
    # the shared down), attention, routing, the routed gate/up, down +
    # combine, argmax
    g=gemv_mma_kernelI13__nv_bfloat16Li1E
    names=${REPEAT:-rms_norm_kernel ${g}Li0E ${g}Li1E ${g}Li2E attention_kernel route_kernel rowwise_mma \
rowwise_down_combine argmax_kernel}
    for round in $(seq "${ROUNDS:-2}"); do
      for name in none $names; do
        if [ "$name" = none ]; then echo "== none (nothing repeated), round $round"; else echo "== $name (repeated), round $round"; fi
        MOE_CUDA_REPEAT=$([ "$name" = none ] || echo "$name") MOE_PLUGIN_PATH=$plugins "$root/bin/moe-bench-model" \
          -m "$profile_model" --device cuda -d bfloat16 "$@" | grep -E '^decode' || exit 1
      done
    done | tee /tmp/repeat.log
    python3 tools/compare-summary.py --extra-us /tmp/repeat.log
    ;;
  stalls)
    ncu=$(find_ncu) || exit 1
    regex=${1:?usage: $0 stalls REGEX [ARGS]}
    shift
    [ $# -gt 0 ] || set -- -p 0 -b 1 -s 8 -r 1
    dir=$(side_of "${SIDE:-this}") || exit 1
    echo "the cuda plugin of ${SIDE:-this} ($(commit_of "${SIDE:-this}"))"
    # shellcheck disable=SC2086 # NCU_ARGS: more ncu options (a short kernel wants more samples:
    # --warp-sampling-interval 0, the finest)
    MOE_PLUGIN_PATH=$dir/plugins "$ncu" --clock-control none -k "regex:$regex" --launch-skip 12 --launch-count 16 \
      --section WarpStateStats --section SourceCounters ${NCU_ARGS:-} -f -o /tmp/stalls \
      "$dir/bin/moe-bench-model" -m "$profile_model" --device cuda -d bfloat16 "$@" > /tmp/stalls.log 2>&1 || { tail -20 /tmp/stalls.log; exit 1; }
    "$ncu" -i /tmp/stalls.ncu-rep --page source --csv --print-source sass > /tmp/stalls.csv || exit 1
    python3 tools/ncu-stalls.py /tmp/stalls.csv
    ;;
  *)
    echo "usage: $0 test | bench [ARGS] | attention-bench [ARGS] | attention-compare [ARGS] | model-bench [ARGS] | profile [ARGS] | stalls REGEX [ARGS] | repeat-costs [ARGS] | profile-experts [ARGS] | profile-layer [ARGS] | compare [ARGS] | compare-experts [ARGS] | sanitize TOOL [-p TESTPATH ...]" >&2; exit 2 ;;
esac
