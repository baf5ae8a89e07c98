#!/bin/sh
# make gpu-check: one GPU, at most 8 minutes, results in bench/results/ (GPU_CHECK_OUT=DIR to change):
#   bench/gpu_check.py   one trainer step of a 1.5B model (docs/trainer-memory.md): gpu-check-trainer.json
#   bench/gpu_colocated.py  an engine rank's two sleep levels, the in-pod weight hand-over (CUDA IPC) from a trainer
#                        rank's process, ten sleep/hand-over/wake rounds (placement colocated): gpu-check-colocated.json
#   bench/gpu_engine.py  the engine's serving path and regroups on the GPU (docs/benchmarks.md): gpu-check-engine.json,
#                        and pat simulate's engine profile of this GPU: gpu-check-engine-profile.json
# Every file names the commit it measured ("commit": git's HEAD, or $PAT_COMMIT where the tree has no .git), the
# engine's files also the engine's revision ("engine": pat_workers.revision.ENGINE_REVISION).
# Each has a watchdog inside (it writes what it measured) and a timeout outside; the colocated part runs after the
# trainer's, and the engine gets what both left of the budget (GPU_CHECK_SECONDS, 470). Arguments go to
# bench/gpu_check.py, as before (--out FILE).
# With the project's venv, or on a bare GPU machine (Python with torch, no network) with its python3 and the wheels
# carried in .whl/ (pydantic: the engine needs nothing more).
set -u
start=$(date +%s)
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pat-site .whl/*.whl || exit 1
  fi
  export PYTHONPATH="/tmp/pat-site:operator:workers${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
out=${GPU_CHECK_OUT:-bench/results}
budget=${GPU_CHECK_SECONDS:-470}
trainer=${GPU_CHECK_TRAINER_SECONDS:-200}
colocated=${GPU_CHECK_COLOCATED_SECONDS:-90}

# timeout -k: a part stuck past its own watchdog is killed with everything it started (its process group).
timeout -k 10 $((trainer + 10)) "$PY" bench/gpu_check.py --timeout "$trainer" --out "$out/gpu-check-trainer.json" "$@"
trainer_rc=$?
timeout -k 10 $((colocated + 10)) "$PY" bench/gpu_colocated.py --timeout "$colocated" \
  --out "$out/gpu-check-colocated.json"
colocated_rc=$?
engine=$((budget - ($(date +%s) - start) - 20))
if [ "$engine" -lt 120 ]; then
  echo "gpu-check: only $engine s left of $budget s for bench/gpu_engine.py (it needs 120 or more)" >&2
  engine_rc=1
else
  timeout -k 10 $((engine + 10)) "$PY" bench/gpu_engine.py --timeout "$engine" --out "$out/gpu-check-engine.json" \
    --profile-out "$out/gpu-check-engine-profile.json"
  engine_rc=$?
fi
echo "gpu-check: trainer exit $trainer_rc, colocated exit $colocated_rc, engine exit $engine_rc," \
  "$(($(date +%s) - start)) s; results in $out/"
[ "$trainer_rc" -eq 0 ] && [ "$colocated_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ]
