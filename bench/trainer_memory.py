"""What FSDP2 leaves on each trainer rank: the bench model trained one step on 1, 2 and 4 CPU ranks (gloo,
float32, AdamW) through the trainer's own sharded_policy and train_iteration, then per rank the bytes of its
parameters, gradients and optimizer states actually held (the local shards of the DTensors), beside the fit
check's estimate of the same terms (pat_operator.fit.trainer_memory) and the process's peak RSS (for
information: it also holds torch itself, and rank 0 reads the whole checkpoint to broadcast it).

Prints a table and, last, one JSON line: state_bytes_per_rank_ratio_4_over_1 (1/4 if sharding is even) and
estimate_error (the largest relative error of the estimate over the world sizes). Not a test: it measures.
  python bench/trainer_memory.py           # model bench (~95M parameters), about a minute on 2 cores
  python bench/trainer_memory.py --quick   # model test, ~25 s (mostly starting the 7 rank processes)
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from pat_operator import fit
from pat_operator.api import RLHFJobSpec
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer.loop import Rollout, adamw, train_iteration
from pat_workers.trainer.policy import sharded_policy

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.engine.multiproc import run_ranks  # noqa: E402

WORLDS = (1, 2, 4)
STATE_TERMS = ("parameters", "gradients", "AdamW moments")  # fit.trainer_memory's labels of the sharded states
MICRO_BATCH_TOKENS = 512


def job_spec(model_dir: Path, world: int, gpus: bool, micro_batch_tokens: int, checkpointing: bool) -> RLHFJobSpec:
    """A job training `model_dir` on `world` ranks of one pod (one per GPU with `gpus`), one optimizer step per
    iteration, no reference policy: what the fit check is given and what train_iteration runs (spec.algorithm)."""
    return RLHFJobSpec.model_validate({
        "placement": "separate",  # the trainer rank alone on its device
        "model": {"path": str(model_dir)}, "dataset": {"synthetic": {}},
        "algorithm": {"miniBatches": 1, "maxTokensPerMicroBatch": micro_batch_tokens,
                      "maxResponseTokens": micro_batch_tokens // 2},
        "trainer": {"gpusPerPod": world if gpus else 0, "ranksPerPod": world, "activationCheckpointing": checkpointing},
        "generator": {"maxSeq": micro_batch_tokens}})


def synthetic_rollouts(count: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int = 0
                       ) -> list[Rollout]:
    """Random token rows; the engine's log-probabilities those of a uniform policy, advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(vocab, (count, prompt_tokens + response_tokens), generator=g).tolist()
    return [Rollout(row[:prompt_tokens], row[prompt_tokens:], [-math.log(vocab)] * response_tokens,
                    float(i % 2), 1.0 if i % 2 else -1.0) for i, row in enumerate(rows)]


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's shards of the parameters, their gradients and every optimizer state tensor."""
    params = list(policy.parameters())
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor))}


def estimated_state_bytes(memory: fit.Memory) -> float:
    """The estimate's parameter, gradient and optimizer terms (on the device or, offloaded, in host memory)."""
    terms = [b for label, b in memory.terms + memory.host if label.startswith(STATE_TERMS)]
    if len(terms) != len(STATE_TERMS):  # fit.py renamed a term: match it here, or this compares the wrong terms
        raise RuntimeError(f"fit.trainer_memory's terms {[label for label, _ in memory.terms + memory.host]} do "
                           f"not hold one of each of {STATE_TERMS}")
    return sum(terms)


def train_rank(rank: int, world: int, model_dir: Path, rollouts: list[Rollout]) -> dict:
    """One training step on this rank; its state bytes and peak RSS."""
    spec = job_spec(model_dir, world, False, MICRO_BATCH_TOKENS, False)
    policy = sharded_policy(model_dir, init_device_mesh("cpu", (world,)), checkpointing=False, bf16=False,
                            cpu_offload=False)
    optimizer = adamw(policy, spec.algorithm, torch.device("cpu"))
    train_iteration(policy, None, optimizer, rollouts, spec.algorithm, rank, world, torch.device("cpu"))
    return {**state_bytes(policy, optimizer), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the test model (~25 s): for the test of this script")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each world size may take")
    args = ap.parse_args()
    preset = "test" if args.quick else "bench"
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), preset=preset)
        shape = fit.read_shape(model_dir / "config.json")
        # 8 sequences of 64 tokens: every rank of 4 gets 2, each rank's share one micro-batch.
        rollouts = synthetic_rollouts(8, 16, 48, shape.vocab)
        print(f"model {preset}: {shape.params / 1e6:.1f}M parameters; bytes per rank after one AdamW step "
              f"(the largest rank)")
        print(f"{'ranks':>5} {'params MiB':>11} {'grads MiB':>10} {'AdamW MiB':>10} {'state MiB':>10} "
              f"{'estimate':>9} {'error':>7} {'peak RSS MiB':>13}", flush=True)
        worlds = {}
        for world in WORLDS:
            ranks = run_ranks(train_rank, world, model_dir, rollouts, timeout=args.timeout)
            largest = max(ranks, key=lambda r: r["parameters"] + r["gradients"] + r["optimizer"])
            measured = largest["parameters"] + largest["gradients"] + largest["optimizer"]
            spec = job_spec(model_dir, world, False, MICRO_BATCH_TOKENS, False)
            estimate = estimated_state_bytes(fit.trainer_memory(spec, shape))
            worlds[world] = {"state_bytes_per_rank": measured, "estimate_bytes": round(estimate),
                             "error": round(abs(estimate - measured) / measured, 4),
                             "state_bytes_ranks": [r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks],
                             "peak_rss_bytes": max(r["peak_rss"] for r in ranks),
                             **{k: largest[k] for k in ("parameters", "gradients", "optimizer")}}
            w = worlds[world]
            print(f"{world:>5} {w['parameters'] / mib:>11.1f} {w['gradients'] / mib:>10.1f} "
                  f"{w['optimizer'] / mib:>10.1f} {measured / mib:>10.1f} {estimate / mib:>9.1f} "
                  f"{w['error']:>7.2%} {w['peak_rss_bytes'] / mib:>13.0f}", flush=True)
    print(json.dumps({
        "state_bytes_per_rank_ratio_4_over_1": round(worlds[4]["state_bytes_per_rank"]
                                                     / worlds[1]["state_bytes_per_rank"], 4),
        "estimate_error": max(w["error"] for w in worlds.values()),
        "preset": preset, "params": shape.params, "worlds": worlds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
