#!/bin/sh
# The whole test suite on a fresh Debian machine: install what is missing,
# build, run every suite, and print "N passed, N failed, N skipped".
#   tools/test.sh [meson test options…]
set -eu
cd "$(dirname "$0")/.."
tools/install-deps.sh
[ -f _build/build.ninja ] || meson setup _build >/dev/null
meson compile -C _build >/dev/null
status=0
meson test -C _build --print-errorlogs "$@" || status=$?
python3 tools/test-summary.py _build/meson-logs/testlog.json || status=1
exit $status
