#!/bin/sh
# Installs what building and testing libmoe needs on Debian or Ubuntu, if it
# is missing. Run as root, or with sudo available.
set -eu

packages="meson ninja-build pkg-config gcc libc6-dev libglib2.0-dev libjson-glib-dev \
gobject-introspection libgirepository1.0-dev gir1.2-glib-2.0 gjs python3 python3-gi \
libopenblas-dev"

missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
echo "Installing:$missing" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
