#!/bin/sh
# The C test suites under valgrind memcheck: meson's "valgrind" test setup
# (tests/meson.build), in the normal build. Any memory error or definite
# leak fails the test; children are followed (g_test_trap_subprocess bodies,
# the moe CLI). Python, GJS, install and gpu suites are excluded by the
# setup. Takes a few minutes on 2 cores. See docs/reliability.md.
#   tools/valgrind.sh [meson test options…]
# BUILDDIR=dir selects another configured build directory (default _build).
set -eu
cd "$(dirname "$0")/.."
tools/install-deps.sh
command -v valgrind >/dev/null 2>&1 || {
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  echo "Installing: valgrind" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends valgrind >/dev/null
}
build=${BUILDDIR:-_build}
[ -f "$build/build.ninja" ] || meson setup "$build" >/dev/null
# a build configured before valgrind was installed has no valgrind setup yet
meson test -C "$build" --list --setup=valgrind >/dev/null 2>&1 || meson setup --reconfigure "$build" >/dev/null
meson compile -C "$build" >/dev/null
meson test -C "$build" --setup=valgrind --print-errorlogs "$@"
