#!/usr/bin/env bash
# Installs those of the named Debian packages that are missing, one caller at a time (make test runs the builds side
# by side, and dpkg takes one install at a time); apt-get update only when the install fails, for it is slow.
# Options before the names (e.g. --no-install-recommends) go to apt-get install.
set -euo pipefail
opts=() missing=()
for arg in "$@"; do
    case $arg in
        -*) opts+=("$arg") ;;
        *) dpkg-query -W -f='${Status}' "$arg" 2>/dev/null | grep -q "ok installed" || missing+=("$arg") ;;
    esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
exec 9>"${TMPDIR:-/tmp}/pat-apt-install.lock"
flock 9
echo "installing ${missing[*]}" >&2
install() { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${opts[@]}" "${missing[@]}" >&2; }
install || { $SUDO apt-get update -q >&2 && install; } \
    || { echo "apt-install.sh: could not install ${missing[*]} with apt-get" >&2; exit 1; }
