"""Weight sync into a generator pod of each engine, for the same model through the same kind of group.

Starts one generator pod of each engine (`python -m pat_workers.generator`, 2 ranks on CPU: this engine's two
ranks, or two vLLM engines of TP=1 whose workers join the group through the pod's worker extension) and, each
round, does what the trainer's rank 0 does: hosts a weight-sync group (pat_workers.weightsync.WeightSender, gloo),
tells the pod (POST /v1/weights), sends the model's weights perturbed, and waits until the pod reports the new
version. A round's seconds run from the POST to that report. Meanwhile a thread samples the bytes of the files in
the vLLM pod's scratch directory (pat-vllm-* under the TMPDIR it gets) and keeps the peak.

Prints each round and, last, one JSON line: `vllm_weight_sync_seconds` and `pat_weight_sync_seconds` (medians),
`vllm_weight_sync_over_pat` (target <= 1.5) and `vllm_weight_sync_disk_bytes` (target 0). bench/engines.py adds
them to its own last line. Not a test: it measures. About 90 s on 2 cores (most of it vLLM's start).
  python bench/weight_sync.py [--preset bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from pat_workers.engine.loader import load_weights
from pat_workers.engine.tiny import PRESETS
from pat_workers.weightsync import WeightSender
from tail import model_and_options

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-weight-sync"
RANKS = 2


def vllm_python(given: str | None) -> str:
    """The vLLM venv's interpreter: `given`, else scripts/vllm-venv.sh's (built once, cached)."""
    if given:
        return given
    out = subprocess.run([str(ROOT / "scripts" / "vllm-venv.sh")], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


class Pod:
    """A generator pod (`python -m pat_workers.generator`) of `engine` on 2 CPU ranks; `args`: further flags."""

    def __init__(self, engine: str, model_dir: Path, tmp: Path, python: str, log: Path, *args: str,
                 max_seq: int = 256):
        engine_args = (["--engine", "vllm", "--max-model-len", str(max_seq), "--enforce-eager"] if engine == "vllm"
                       else ["--max-batch", "8", "--max-seq", str(max_seq)])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pat_workers.generator", "--model", str(model_dir), "--ranks", str(RANKS),
             "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *engine_args, *args], stdout=subprocess.PIPE,
            stderr=log.open("w"), env={**os.environ, "PAT_JOB_TOKEN": TOKEN, "PAT_VLLM_PYTHON": python,
                                       "TMPDIR": str(tmp)})
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening on http://"):
            raise RuntimeError(f"{engine} pod did not start: {line!r}; see {log}")
        self.url = line.split()[-1]

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, method=method, data=None if body is None else
                                         json.dumps(body).encode(), headers={"Authorization": f"Bearer {TOKEN}",
                                                                             "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError:
            return 0, {}

    def wait(self, until, timeout: float = 600.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status, state = self.call("GET", "/v1/state")
            if status == 200 and until(state):
                return state
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pod at {self.url}: exited or timed out ({status} {state})")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def disk_bytes(tmp: Path) -> int:
    return sum(p.stat().st_size for p in tmp.glob("pat-vllm-*/**/*") if p.is_file() and not p.is_symlink())


def rounds_of(pod: Pod, weights: dict[str, torch.Tensor], rounds: int, seed: int) -> list[float]:
    """Seconds of each round, from POST /v1/weights to the pod holding the version."""
    state = pod.wait(lambda s: s["ready"])
    world = 1 + state["weight_receivers"]
    sender = WeightSender("127.0.0.1:0", world)
    shapes = {name: w.shape for name, w in weights.items()}
    g = torch.Generator().manual_seed(seed)
    seconds = []
    try:
        for r in range(rounds):
            version = state["policy_version"] + 1
            sent = {name: w + 1e-3 * torch.randn(w.shape, generator=g) for name, w in weights.items()}
            start = time.perf_counter()
            status, reply = pod.call("POST", "/v1/weights", {"version": version, "address": sender.address,
                                                             "world": world, "rank_offset": 1})
            if status != 202:
                raise RuntimeError(f"POST /v1/weights: {status} {reply}")
            sender.send(shapes, iter(sorted(sent.items())), version)
            state = pod.wait(lambda s: s["policy_version"] == version)
            seconds.append(time.perf_counter() - start)
    finally:
        sender.close()
    return seconds


def measure(model_dir: Path, python: str, rounds: int, seed: int = 0) -> dict:
    weights = load_weights(model_dir, torch.float32)
    size = sum(w.numel() * w.element_size() for w in weights.values())
    results: dict[str, list[float]] = {}
    peak = 0
    with tempfile.TemporaryDirectory(prefix="pat-weight-sync-") as scratch:
        for engine in ("pat", "vllm"):
            tmp = Path(scratch) / engine
            tmp.mkdir()
            pod = Pod(engine, model_dir, tmp, python, Path(scratch) / f"{engine}.log")
            stop = threading.Event()

            def sample():
                nonlocal peak
                while not stop.wait(0.05):
                    peak = max(peak, disk_bytes(tmp))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                results[engine] = rounds_of(pod, weights, rounds, seed)
            finally:
                stop.set()
                sampler.join()
                peak = max(peak, disk_bytes(tmp))  # the pat pod has no pat-vllm-* directory: 0
                pod.stop()
            print(f"  {engine}: {len(weights)} tensors, {size / 2**20:.0f} MiB, rounds "
                  f"{' '.join(f'{s:.2f}' for s in results[engine])} s", flush=True)
    pat_s, vllm_s = (statistics.median(results[e]) for e in ("pat", "vllm"))
    return {"pat_weight_sync_seconds": round(pat_s, 3), "vllm_weight_sync_seconds": round(vllm_s, 3),
            "vllm_weight_sync_over_pat": round(vllm_s / pat_s, 3), "vllm_weight_sync_disk_bytes": peak,
            "weight_sync_bytes": size, "weight_sync_rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=os.environ.get("PAT_VLLM_PYTHON"))
    args = ap.parse_args()
    model_dir, _, _ = model_and_options(args.preset, args.seed, None, [16], RANKS)
    print(json.dumps(measure(model_dir, vllm_python(args.vllm_python), args.rounds, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
