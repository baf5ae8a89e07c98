"""An engine cost profile for `pat simulate --hardware` from one GPU's shard measurements (bench/gpu_decode.py
--shards --out): each TP=t step is the measured step of one rank's shard plus the group's all-reduces, which
need t GPUs and are modelled (two ring all-reduces per layer over NVLink, as the roofline does). So the
simulation runs on the engine's measured step costs -- its per-step overheads and how a step grows with the
batch and the context -- rather than on the roofline's assumed efficiencies.

  python bench/shard_profile.py                    # bench/results/h200-llama8b-shards.json -> ...-engine.json
  pat simulate --preset paper-llama8b --hardware bench/results/h200-llama8b-engine.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pat_operator.fit import GPUS, SHAPES
from pat_workers.sim.hardware import Roofline

RESULTS = Path(__file__).parent / "results"


def engine_profile(shards: dict, roofline: Roofline) -> dict:
    """The Costs.to_json fields: the decode table at the shortest measured context, seconds per KV token from the
    longest (at the largest batch), prefill as a + b * tokens through the two measured lengths."""
    decode, kv_seconds, prefill = {}, {}, {}
    contexts = sorted(shards["decode"]["1"], key=int)
    lo, hi = contexts[0], contexts[-1]
    for tp, by_context in shards["decode"].items():
        t = int(tp)
        decode[tp] = {b: s + roofline.allreduce_seconds(t, int(b)) for b, s in by_context[lo].items()}
        largest = max(by_context[lo], key=int)
        kv_seconds[tp] = (max(by_context[hi][largest] - by_context[lo][largest], 0.0)
                          / (int(largest) * (int(hi) - int(lo))))
        (n0, s0), (n1, s1) = sorted((int(n), s + roofline.allreduce_seconds(t, int(n)))
                                    for n, s in shards["prefill"][tp].items())
        per_token = (s1 - s0) / (n1 - n0)
        prefill[tp] = [max(s0 - per_token * n0, 0.0), per_token]
    gpu = roofline.gpu
    return {"source": f"{shards['device']}: {shards['preset']} shards measured by bench/gpu_decode.py, the TP "
                      f"group's all-reduces modelled over NVLink", "dtype": "bfloat16",
            "link_bytes_per_s": gpu.link_bytes_per_s * roofline.efficiency.link, "link_latency_s": gpu.link_latency_s,
            "prefill": prefill, "decode": decode, "decode_context": int(lo), "kv_seconds": kv_seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=Path, default=RESULTS / "h200-llama8b-shards.json")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS), help="whose NVLink the all-reduces cross")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES), help="the measured model's shape")
    ap.add_argument("--out", type=Path, default=RESULTS / "h200-llama8b-engine.json")
    args = ap.parse_args()
    profile = engine_profile(json.loads(args.shards.read_text()), Roofline(GPUS[args.gpu], SHAPES[args.model]))
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
