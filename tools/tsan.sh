#!/bin/sh
# The threading tests under ThreadSanitizer: a separate build with
# -Db_sanitize=thread (introspection off: the scanner cannot run with it).
#   tools/tsan.sh
set -eu
cd "$(dirname "$0")/.."
tools/install-deps.sh
[ -f _build-tsan/build.ninja ] || \
  meson setup _build-tsan -Db_sanitize=thread -Db_lundef=false -Dintrospection=disabled -Dcuda=disabled >/dev/null
meson compile -C _build-tsan >/dev/null
# GLib's GMutex/GCond sit on futexes ThreadSanitizer cannot see; tests/tsan.supp
# names those library-internal reports, nothing of libmoe's.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
G_SLICE=always-malloc OPENBLAS_NUM_THREADS=1 \
  meson test -C _build-tsan --print-errorlogs threads model "$@"
