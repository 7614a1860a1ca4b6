#!/bin/sh
# The C test suites (core, plugins) under AddressSanitizer + UndefinedBehavior-
# Sanitizer, LeakSanitizer included, in a build of their own (_build-asan).
#   tools/sanitize.sh [meson test options…]
#
# Introspection is off there: g-ir-scanner runs an instrumented dumper
# without libasan preloaded, so the Python and GJS suites cannot run. The
# install test is left out too: it links examples/plugin-skeleton and a
# forward program, built without -fsanitize, against the installed
# instrumented libmoe, where the ASan runtime cannot come first (and it is a
# packaging test, not a memory one). See docs/reliability.md.
set -eu
cd "$(dirname "$0")/.."
tools/install-deps.sh
build=_build-asan
[ -f $build/build.ninja ] || \
  meson setup $build -Db_sanitize=address,undefined -Db_lundef=false \
    -Dintrospection=disabled -Dcuda=disabled >/dev/null
meson compile -C $build >/dev/null

# detect_leaks: LeakSanitizer at exit, in g_test_trap_subprocess children too.
# fast_unwind_on_malloc=0: OpenBLAS and GLib have no frame pointers; the slow
#   unwinder gives whole allocation stacks.
# allocator_may_return_null: libmoe allocates tensors with g_try_malloc and
#   reports failure as MOE_ERROR_OUT_OF_MEMORY; ASan would abort instead.
# protect_shadow_gap=0: the CUDA driver maps into the shadow gap (house style,
#   docs/reliability.md); harmless on the CPU.
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=1:fast_unwind_on_malloc=0:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:allocator_may_return_null=1:protect_shadow_gap=0
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
# GSlice's magazines would keep leaked GBytes, GList… reachable (GLib 2.74):
# with plain malloc LeakSanitizer sees them.
G_SLICE=always-malloc
export ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS G_SLICE

# /resources/out-of-memory (test-threads) caps RLIMIT_AS a little above the
# process's size: under ASan the quarantine and redzones use that head room,
# and OpenBLAS 0.3.21 then retries its buffer allocation forever
# (OpenMathLib/OpenBLAS#5289, fixed upstream by #5303). GTest's -s skips that path
# only; every test program here is a GTest one.
meson test -C $build --suite core --suite plugins --print-errorlogs \
  --test-args '-s /resources/out-of-memory' "$@"
