#!/bin/sh
# make gpu-check: bench/gpu_check.py (one trainer step on one GPU; docs/trainer-memory.md) with the project's venv,
# or on a bare GPU machine (Python with torch, no network) with its python3 and the wheels carried in .whl/.
set -e
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pat-site .whl/*.whl
  fi
  export PYTHONPATH="/tmp/pat-site:operator:workers${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONUNBUFFERED=1 exec "$PY" bench/gpu_check.py "$@"
