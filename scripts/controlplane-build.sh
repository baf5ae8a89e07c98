#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2 from Debian 12's source package
# into a cache outside the repository, once: no registry reachable here ships those binaries (see
# ../shared/notes/infra.md). Prints the folder that holds them (with etcd beside them) on its last line.
#
#   scripts/controlplane-build.sh           build if missing
#   KUBEBUILDER_ASSETS=DIR ...              use binaries that already exist there (envtest's convention)
set -euo pipefail

VERSION=1.20.5+really1.20.2-1.1+deb12u1
CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}
OUT=$CACHE/k8s-v1.20.2
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() { for b in "${BINARIES[@]}" etcd; do [ -x "$1/$b" ] || return 1; done; }

if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
    have_all "$KUBEBUILDER_ASSETS" || { echo "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks one of ${BINARIES[*]} etcd" >&2; exit 1; }
    echo "$KUBEBUILDER_ASSETS"; exit 0
fi
if have_all "$OUT"; then echo "$OUT"; exit 0; fi

"$(dirname "$0")/apt-install.sh" golang-go rsync etcd-server golang-github-modern-go-reflect2-dev

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pat-k8s-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# A private apt configuration that adds deb-src lines; the system's sources stay as they are.
mkdir -p lists/partial
cat > sources.list <<EOF
deb-src http://deb.debian.org/debian bookworm main
deb-src http://deb.debian.org/debian-security bookworm-security main
EOF
APT=(-o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/nonexistent
     -o Dir::State::Lists="$WORK/lists" -o APT::Sandbox::User=root)
echo "fetching the kubernetes $VERSION source package" >&2
apt-get "${APT[@]}" update -q >&2
apt-get "${APT[@]}" source --download-only "kubernetes=$VERSION" >&2
mkdir src
tar -xzf kubernetes_*.orig.tar.gz -C src --strip-components=1
cd src
# The vendored reflect2 v1.0.1 crashes the apiserver built with Go >= 1.18 on the first custom-object create
# (UnsafeMapType.UnsafeIterate). v1.0.2 fixed it; Debian packages v1.0.2's source, which we vendor instead.
rm -f vendor/github.com/modern-go/reflect2/*.go
cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go vendor/github.com/modern-go/reflect2/
echo "building ${BINARIES[*]} (6-10 minutes on 2 cores)" >&2
WHAT=""; for b in "${BINARIES[@]}"; do WHAT="$WHAT cmd/$b"; done
CGO_ENABLED=0 make WHAT="${WHAT# }" GOFLAGS=-mod=vendor >&2
mkdir -p "$OUT.tmp"
for b in "${BINARIES[@]}"; do cp "_output/bin/$b" "$OUT.tmp/"; done
ln -sf "$(command -v etcd)" "$OUT.tmp/etcd"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT"
