#!/bin/sh
# The main job on a fresh Debian machine: install what is missing, build,
# and run the shipped demo model's experts through every backend.
#   tools/demo.sh [moe options…]
set -eu
caller=$PWD   # checkpoint paths on the command line are the caller's
cd "$(dirname "$0")/.."
tools/install-deps.sh
[ -f _build/build.ninja ] || meson setup _build >/dev/null
meson compile -C _build >/dev/null
exec meson devenv -C _build --workdir "$caller" moe "$@"
