#!/bin/sh
# Bounded fuzzing on a fresh Debian or Ubuntu machine: installs what is
# missing (clang, libFuzzer, the build dependencies), builds the libFuzzer
# harnesses of fuzz/ in _build-fuzz (clang, ASan + UBSan, libFuzzer coverage
# of libmoe's sources), runs each harness for SECONDS on a scratch copy of
# its seed corpus, and prints per harness the executions done and the
# crashes found. Exits non-zero if any crash (or leak, OOM, timeout) was
# found; the inputs are left in _build-fuzz/fuzz-runs/<target>/artifacts/.
#
#   tools/fuzz.sh [SECONDS_PER_HARNESS [TARGET…]]     (default: 60, all targets)
#
# FUZZ_JOBS harnesses run at a time (default: the number of CPUs); each runs
# libFuzzer in fork mode (-fork=1, crashes ignored and counted), so one known
# crash does not stop the rest of the run. See fuzz/README.md.
set -eu
cd "$(dirname "$0")/.."
root=$(pwd)

seconds=${1:-60}
[ $# -gt 0 ] && shift
targets=${*:-safetensors index config plugin generation_config}
jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}
build=_build-fuzz

# ---- what it needs -------------------------------------------------------
tools/install-deps.sh
if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
apt_install() {
  echo "Installing: $*" >&2
  [ -n "${apt_updated:-}" ] || { $sudo apt-get update -qq; apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
command -v clang >/dev/null 2>&1 || apt_install clang
libfuzzer_links() {
  probe=$(mktemp -d)
  printf 'int LLVMFuzzerTestOneInput (const char *d, unsigned long n) { return 0; }\n' > "$probe/probe.c"
  clang -fsanitize=fuzzer,address,undefined "$probe/probe.c" -o "$probe/probe" >/dev/null 2>&1
  ok=$?
  rm -rf "$probe"
  return $ok
}
if ! libfuzzer_links; then
  # Debian 12 splits compiler-rt (libclang_rt.fuzzer, .asan…) into
  # libclang-rt-N-dev; older releases ship it in libclang-common-N-dev
  major=$(clang -dumpversion | cut -d. -f1)
  for p in "libclang-rt-$major-dev" "libclang-common-$major-dev"; do
    if apt-cache show "$p" >/dev/null 2>&1; then apt_install "$p"; break; fi
  done
  libfuzzer_links || { echo "fuzz: clang $major cannot link -fsanitize=fuzzer" >&2; exit 1; }
fi

# ---- build ---------------------------------------------------------------
options="-Dfuzzing=true -Dcuda=disabled -Db_sanitize=address,undefined -Dintrospection=disabled -Dtests=false -Dexamples=false"
if [ -f "$build/build.ninja" ]; then
  # shellcheck disable=SC2086
  meson configure "$build" $options >/dev/null
else
  # shellcheck disable=SC2086
  CC=clang meson setup "$build" $options >/dev/null
fi
binaries=""
for t in $targets; do binaries="$binaries fuzz-$t"; done
# shellcheck disable=SC2086
meson compile -C "$build" $binaries >/dev/null

# ---- run -----------------------------------------------------------------
runs="$root/$build/fuzz-runs"
rm -rf "$runs"
mkdir -p "$runs"

run_one() {
  t=$1
  dir="$runs/$t"
  mkdir -p "$dir/corpus" "$dir/artifacts" "$dir/tmp"
  cp fuzz/corpus/"$t"/* "$dir/corpus/"
  dict=""
  [ -f "fuzz/dict/$t.dict" ] && dict="-dict=$root/fuzz/dict/$t.dict"
  # the scratch copy of the corpus grows; the repository's stays as it is
  (cd "$dir" && \
   TMPDIR="$dir/tmp" G_SLICE=always-malloc G_DEBUG=gc-friendly MOE_FUZZ_SOURCE_ROOT="$root" \
   ASAN_OPTIONS="detect_leaks=1:malloc_context_size=30:handle_abort=1" \
   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
   timeout $((seconds + 120)) "$root/$build/fuzz/fuzz-$t" \
     -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
     -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
     $dict -artifact_prefix="$dir/artifacts/" "$dir/corpus" > "$dir/log" 2>&1) || true
}

echo "fuzzing: $seconds s per harness, $jobs at a time: $targets"
running=0
for t in $targets; do
  run_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait; running=0; fi
done
wait

# ---- report --------------------------------------------------------------
total=0
for t in $targets; do
  dir="$runs/$t"
  # fork mode's status lines: "#EXECS: cov: … oom/timeout/crash: O/T/C time: …"
  stat=$(grep -E '^#[0-9]+: ' "$dir/log" | tail -n 1)
  execs=$(printf '%s' "$stat" | sed -n 's/^#\([0-9]*\):.*/\1/p')
  otc=$(printf '%s' "$stat" | sed -n 's/.*oom\/timeout\/crash: \([0-9]*\/[0-9]*\/[0-9]*\).*/\1/p')
  found=$(find "$dir/artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'oom-*' -o -name 'timeout-*' \) | wc -l)
  if [ -z "$execs" ]; then
    # no status line: the harness failed to start
    echo "fuzz-$t: did not run; the end of $dir/log:"
    tail -n 20 "$dir/log" | sed 's/^/    /'
    found=$((found + 1))
  else
    printf 'fuzz-%s: %s executions, %s crashes found (oom/timeout/crash %s)\n' "$t" "$execs" "$found" "${otc:-?}"
  fi
  if [ "$found" -gt 0 ]; then
    # what went wrong, most frequent first (fork mode echoes the "ERROR:"
    # and "runtime error:" lines of each crashed job)
    grep -h -E '(^ERROR: fuzz: |^==[0-9]+== ?ERROR: |runtime error: )' "$dir/log" \
      | grep -v -E 'ABRT on unknown address|libFuzzer: deadly signal' \
      | sed -e 's/==[0-9]*==/==/' -e 's/(process:[0-9]*): //' -e 's/ [0-9][0-9]:[0-9][0-9]:[0-9.]*://' \
            -e 's/ (pc 0x.*//' -e 's/ 0x[0-9a-f]*//g' | cut -c1-220 \
      | sort | uniq -c | sort -rn | head -n 8 | sed 's/^/    /'
    find "$dir/artifacts" -type f | sort | head -n 5 | sed 's/^/    input: /'
  fi
  total=$((total + found))
done

if [ "$total" -gt 0 ]; then
  echo "fuzzing: $total crashes found; reproduce one with $build/fuzz/fuzz-TARGET INPUT"
  echo "  (ASAN_OPTIONS=fast_unwind_on_malloc=0 for whole leak stacks), triage, and save it under"
  echo "  tests/fuzz-regressions/TARGET/ so the test suite replays it"
  exit 1
fi
echo "fuzzing: no crashes"
