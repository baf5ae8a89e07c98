"""Adaptive TP on a vLLM generator pod against the same pod at each fixed layout, on the same long-tailed batch.

Three vLLM pods (`python -m pat_workers.generator --engine vllm`, 2 ranks on CPU), one after another, each through
the pod API as the trainer drives it:
  vllm pod 2xTP1      --tensor-parallel-size 1: two vLLM engines of TP=1
  vllm pod TP2        --tensor-parallel-size 2: one vLLM engine of TP=2 over both cores
  vllm pod adaptive   --tp-sizes 1,2 (controller pod): the three engines, the start-up profile, and the pod's planner,
                      which picks each batch's start layout and merges its tail (requests re-prefilled)
Each run starts a fresh pod and gives it a warm-up batch (the adaptive pod's planner learns the lengths from it, as
from an earlier iteration), then one timed batch of bench/tail.py's requests (lognormal lengths, 16-token prompts,
greedy, ignore_eos); --repeats runs per layout, the order reversed each time. A batch's seconds run from
POST /v1/rollouts to the pod reporting it done.

Prints each run and, last, one JSON line: `vllm_adaptive_over_vllm_best` (adaptive's median seconds over the faster
fixed layout's; target <= 1.03: on this CPU TP=2 wins at every batch size, so adaptive must start there and match
it) and the layouts' seconds. bench/engines.py adds these keys to its own last line. Not a test: it measures. About
8 minutes on 2 cores (six pods' starts, the adaptive ones' profiles).
  python bench/vllm_adaptive.py [--batch 32] [--cap 512] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pat_workers.engine.tiny import PRESETS
from pat_workers.sim.lengths import lognormal_lengths
from tail import model_and_options, requests
from weight_sync import Pod, vllm_python

LAYOUTS = {"vllm pod 2xTP1": ("--tensor-parallel-size", "1"), "vllm pod TP2": ("--tensor-parallel-size", "2"),
           "vllm pod adaptive": ("--tp-sizes", "1,2", "--controller", "pod")}


def run_batch(pod: Pod, batch_id: str, payload: list[dict]) -> tuple[float, dict]:
    """Seconds from submitting the batch to the pod reporting it done, and the pod's state then."""
    version = pod.wait(lambda s: s["ready"])["policy_version"]
    started = time.perf_counter()
    status, reply = pod.call("POST", "/v1/rollouts", {"batch_id": batch_id, "policy_version": version,
                                                      "requests": payload})
    if status != 202:
        raise RuntimeError(f"POST /v1/rollouts: {status} {reply}")
    while not reply.get("done"):
        status, reply = pod.call("GET", f"/v1/rollouts/{batch_id}?wait=30")
        if status != 200:
            raise RuntimeError(f"GET /v1/rollouts/{batch_id}: {status} {reply}")
    seconds = time.perf_counter() - started
    lengths = [len(c["token_ids"]) for c in reply["completions"]]
    if lengths != [r["sampling"]["max_tokens"] for r in payload]:
        raise RuntimeError(f"{batch_id}: lengths {lengths} differ from the requests' max_tokens")
    return seconds, pod.call("GET", "/v1/state")[1]


def measure(model_dir: Path, python: str, lengths: list[int], seed: int, repeats: int) -> dict:
    payload = [{"id": r.id, "prompt_token_ids": r.prompt, "sampling": {"max_tokens": r.params.max_tokens,
                                                                       "ignore_eos": True}}
               for r in requests(lengths, seed)]
    max_seq = len(payload[0]["prompt_token_ids"]) + max(lengths) + 1
    runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="pat-vllm-adaptive-") as scratch:
        for repeat in range(repeats):  # a fresh pod per run; the order reversed each repeat: drift favours no one
            for name, args in (LAYOUTS.items() if repeat % 2 == 0 else reversed(LAYOUTS.items())):
                tmp = Path(tempfile.mkdtemp(prefix="v-", dir=scratch))  # short: the engines' socket paths
                pod = Pod("vllm", model_dir, tmp, python, tmp / "pod.log", *args, max_seq=max_seq)
                try:
                    _, before = run_batch(pod, "warm-up", payload)
                    seconds, after = run_batch(pod, "timed", payload)
                finally:
                    pod.stop()
                runs[name].append(seconds)
                print(f"  {name}: {seconds:.2f} s; layout {before['layout']} after the warm-up batch, "
                      f"{after['layout']} at the end (epoch {before['epoch']} -> {after['epoch']})", flush=True)
    seconds = {name: statistics.median(rs) for name, rs in runs.items()}
    best = min(("vllm pod 2xTP1", "vllm pod TP2"), key=seconds.__getitem__)
    return {"vllm_adaptive_over_vllm_best": round(seconds["vllm pod adaptive"] / seconds[best], 4),
            "vllm_pod_best_fixed": best,
            "vllm_pod_layouts": {name: {"seconds": round(seconds[name], 3), "runs": [round(s, 3) for s in rs]}
                                 for name, rs in runs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=int, default=512, help="response length cap (tokens)")
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm-python", default=os.environ.get("PAT_VLLM_PYTHON"))
    args = ap.parse_args()
    lengths = lognormal_lengths(args.batch, args.cap, args.seed)
    model_dir, _, _ = model_and_options(args.preset, args.seed, None, lengths, 2)
    print(f"model: {args.preset}; batch: {len(lengths)} sequences, lengths {min(lengths)}-{max(lengths)} "
          f"(mean {sum(lengths) / len(lengths):.0f}); load average {os.getloadavg()[0]:.2f}", flush=True)
    print(json.dumps(measure(model_dir, vllm_python(args.vllm_python), lengths, args.seed, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
