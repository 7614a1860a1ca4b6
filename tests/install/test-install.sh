#!/bin/sh
# test-install.sh: install this build of libmoe into a temporary directory,
# check the installed layout, build examples/plugin-skeleton against the
# installed libmoe-1.pc, install it under its own prefix, and run experts
# fixtures through it with the installed libmoe.
#
#   test-install.sh build_root=DIR source_root=DIR prefix=DIR libdir=DIR \
#                   includedir=DIR datadir=DIR version=X.Y.Z build_gir=true|false \
#                   meson=PROG ninja=PROG pkg_config=PROG python_gi=PROG -- CC…
#
# (tests/install/meson.build passes these; an empty PROG means not found.)
# Exits 77 (skipped) only when a tool it needs is missing. Set
# MOE_TEST_KEEP_TMP=1 to keep the temporary directory for a look.
#
# SPDX-License-Identifier: LGPL-2.1-or-later
set -eu

build_root='' source_root='' prefix='' libdir='' includedir='' datadir='' version=''
build_gir=false meson='' ninja='' pkg_config='' python_gi=''
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; break ;;
    build_root=*|source_root=*|prefix=*|libdir=*|includedir=*|datadir=*|version=*|\
    build_gir=*|meson=*|ninja=*|pkg_config=*|python_gi=*)
      eval "${1%%=*}=\${1#*=}" ;;
    *) echo "$0: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# the rest is the C compiler command, as meson runs it (maybe "ccache cc")
if [ -z "$build_root" ] || [ -z "$source_root" ] || [ -z "$prefix" ] || [ $# -eq 0 ]; then
  echo "usage: $0 build_root=… source_root=… prefix=… libdir=… includedir=… datadir=… version=… build_gir=… meson=… ninja=… pkg_config=… python_gi=… -- CC…" >&2
  exit 2
fi

skip () { echo "SKIP: $*"; exit 77; }
fail () { echo "FAIL: $*" >&2; exit 1; }
step () { echo; echo "== $*"; }

have () { [ -n "$1" ] && command -v "$1" >/dev/null 2>&1; }
have "$pkg_config" || skip "no pkg-config"
have "$1" || skip "no C compiler ($*)"
have "$meson" || skip "no meson program to build the skeleton"
have "$ninja" || skip "no ninja program to build the skeleton"
cc_cmd=$*

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-install-test.XXXXXX")
cleanup () {
  if [ "${MOE_TEST_KEEP_TMP:-}" = 1 ]; then
    echo "kept $tmp"
  else
    rm -rf "$tmp"
  fi
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM

# Nothing from the build tree or the caller may leak into what is checked
# below: the installed libmoe, its pkg-config file and its plugins only.
unset GI_TYPELIB_PATH PKG_CONFIG_LIBDIR PKG_CONFIG_SYSROOT_DIR MOE_BACKEND || true
export PKG_CONFIG="$pkg_config"

# --- 1. install ------------------------------------------------------------

step "meson install -C $build_root --destdir $tmp/dest"
# Builds whatever the tests' own dependencies left out, then installs every
# installable file of this build under the destdir.
"$meson" install -C "$build_root" --destdir "$tmp/dest" --quiet \
  || fail "meson install failed"

dest=$tmp/dest
# meson passes every option as an absolute path or one relative to prefix;
# a destdir install puts an absolute path P at $dest/P.
in_dest () {
  case $1 in
    /*) echo "$dest$1" ;;
    *) echo "$dest$prefix/$1" ;;
  esac
}
P=$dest$prefix
L=$(in_dest "$libdir")
I=$(in_dest "$includedir")
D=$(in_dest "$datadir")
plugins=$L/libmoe-1/plugins

# --- 2. the installed layout -----------------------------------------------

step "installed layout under $P"
need () {
  [ -e "$1" ] || fail "not installed: ${1#"$dest"}"
  echo "  ${1#"$dest"}"
}
for h in libmoe.h moe-plugin.h moe-cpu-kernels.h moe-version.h moe-version-macros.h \
         moe-enum-types.h moe-experts-backend.h moe-plugin-registry.h; do
  need "$I/libmoe-1/$h"
done
need "$L/libmoe-1.so"
need "$L/libmoe-1.so.0"
need "$L/pkgconfig/libmoe-1.pc"
for p in eager batched_mm grouped_mm deepgemm sonicmoe deepgemm_megamoe; do
  need "$plugins/$p.plugin"
  need "$plugins/libmoe-$p.so"
done
if [ "$build_gir" = true ]; then
  need "$L/girepository-1.0/Moe-1.typelib"
  need "$D/gir-1.0/Moe-1.gir"
else
  echo "  (introspection not built: no Moe-1.typelib / Moe-1.gir expected)"
fi
# private headers stay private
for h in moe-private.h moe-plugin-info-private.h config.h; do
  [ ! -e "$I/libmoe-1/$h" ] || fail "private header installed: $h"
done

pc=$L/pkgconfig/libmoe-1.pc
# shellcheck disable=SC2016 # a literal ${libdir}
grep -q '^pluginsdir=\${libdir}/libmoe-1/plugins$' "$pc" \
  || fail "libmoe-1.pc lacks pluginsdir=\${libdir}/libmoe-1/plugins"
grep -q '^plugin_abi=1$' "$pc" || fail "libmoe-1.pc lacks plugin_abi=1"
# nothing installed may point back into the build or source tree
if grep -qF -e "$build_root" -e "$source_root" "$pc"; then
  fail "libmoe-1.pc mentions the build or source tree"
fi
if command -v readelf >/dev/null 2>&1; then
  for so in "$L/libmoe-1.so.0" "$plugins"/libmoe-*.so; do
    if readelf -d "$so" | grep -E 'R(UN)?PATH' | grep -qF -e "$build_root" -e "$source_root"; then
      fail "$so keeps an rpath into the build tree"
    fi
  done
fi

# --- 3. pkg-config for the installed copy ----------------------------------

# libmoe-1.pc says prefix=$prefix, where nothing is installed yet. Neither
# of pkg-config's own relocation switches fits: --define-prefix guesses the
# prefix by dropping two directories (pkgconfig and lib) from the .pc
# file's, which is wrong for a multiarch libdir such as
# lib/x86_64-linux-gnu, and PKG_CONFIG_SYSROOT_DIR (like --define-variable)
# would move GLib's paths too. So write a copy of the file whose absolute
# paths are moved into the destdir, as the install itself moved them.
step "pkg-config against the installed libmoe-1.pc"
pcdir=$tmp/pkgconfig
mkdir -p "$pcdir"
sed -E "s|^([A-Za-z_][A-Za-z0-9_.]*)=/|\\1=$dest/|" "$pc" > "$pcdir/libmoe-1.pc"
export PKG_CONFIG_PATH="$pcdir"

pc_var () { "$pkg_config" --variable="$1" libmoe-1; }
[ "$(pc_var prefix)" = "$P" ] || fail "pkg-config prefix is $(pc_var prefix), not $P"
[ "$(pc_var libdir)" = "$L" ] || fail "pkg-config libdir is $(pc_var libdir), not $L"
[ "$(pc_var pluginsdir)" = "$plugins" ] || fail "pkg-config pluginsdir is $(pc_var pluginsdir), not $plugins"
[ "$(pc_var plugin_abi)" = 1 ] || fail "pkg-config plugin_abi is $(pc_var plugin_abi)"
[ "$("$pkg_config" --modversion libmoe-1)" = "$version" ] || fail "libmoe-1.pc is not version $version"
cflags=$("$pkg_config" --cflags libmoe-1) || fail "pkg-config --cflags libmoe-1"
libs=$("$pkg_config" --libs libmoe-1) || fail "pkg-config --libs libmoe-1"
echo "  cflags: $cflags"
echo "  libs:   $libs"
case " $cflags " in *" -I$I/libmoe-1 "*) ;; *) fail "cflags lack -I$I/libmoe-1" ;; esac

# --- 4. build and install the skeleton plugin ------------------------------

step "examples/plugin-skeleton against the installed libmoe"
skel_prefix=$tmp/skeleton-prefix
# The skeleton installs into pluginsdir redefined under its own prefix.
skel_plugins=$skel_prefix/lib/libmoe-1/plugins
CC=$cc_cmd "$meson" setup "$tmp/skeleton-build" "$source_root/examples/plugin-skeleton" \
  --prefix "$skel_prefix" --libdir lib -Dpkg_config_path="$pcdir" -Dwerror=true \
  || fail "meson setup of the skeleton failed"
"$ninja" -C "$tmp/skeleton-build" || fail "the skeleton does not build"
"$meson" install -C "$tmp/skeleton-build" --quiet || fail "the skeleton does not install"
for f in skeleton.plugin libmoe-skeleton.so; do
  [ -e "$skel_plugins/$f" ] || fail "the skeleton did not install $skel_plugins/$f"
  echo "  ${skel_plugins#"$tmp"/}/$f"
done
if [ -n "$(find "$P" -name '*skeleton*' -print -quit)" ]; then
  fail "the skeleton installed into libmoe's prefix instead of its own"
fi

# --- 5. a forward through it -----------------------------------------------

step "a forward through the skeleton with the installed libmoe"
# shellcheck disable=SC2086 # cflags, libs and cc_cmd are word lists
$cc_cmd -std=gnu11 -Wall -Werror=implicit-function-declaration -o "$tmp/forward" \
  "$source_root/tests/install/forward.c" $cflags $libs -lm \
  || $cc_cmd -std=gnu11 -Wall -Werror=implicit-function-declaration -o "$tmp/forward" \
       "$source_root/tests/install/forward.c" $cflags $libs -lm -ldl \
  || fail "forward.c does not build against the installed headers"

data=${MOE_TEST_DATA:-$source_root/tests/data}
# Only the installed libmoe and plugins: LD_LIBRARY_PATH and the plugin path
# are replaced, not extended, and the installed default plugin directory
# (under the real prefix) is not searched.
run_installed () {
  env LD_LIBRARY_PATH="$L" \
      MOE_PLUGIN_PATH="$skel_plugins:$plugins" \
      MOE_PLUGIN_SYSTEM_PATH= \
      "$@"
}
run_installed "$tmp/forward" "$L" "$skel_plugins" \
  "$data/experts/silu_concat.safetensors" \
  "$data/experts/silu_sentinel.safetensors" \
  || fail "the forward through the installed libmoe failed"

# --- 6. the installed typelib, when there is one and PyGObject ------------

if [ "$build_gir" = true ]; then
  step "the installed Moe-1.typelib"
  if [ -n "$python_gi" ]; then
    run_installed env GI_TYPELIB_PATH="$L/girepository-1.0" "$python_gi" -c '
import os, sys, gi
gi.require_version("GIRepository", "2.0")
gi.require_version("Moe", "1")
from gi.repository import GIRepository, Moe
typelib = GIRepository.Repository.get_default().get_typelib_path("Moe")
names = Moe.PluginRegistry.get_default().list_backends()
print("  typelib:", typelib)
print("  backends from Python:", ", ".join(names))
ok = os.path.dirname(os.path.realpath(typelib)) == os.path.realpath(os.environ["GI_TYPELIB_PATH"])
sys.exit(0 if ok and "skeleton" in names else 1)
' || fail "the installed typelib does not work"
  else
    echo "  (no PyGObject: not checked)"
  fi
fi

echo
echo "PASS: installed libmoe $version, built and ran the skeleton plugin"
