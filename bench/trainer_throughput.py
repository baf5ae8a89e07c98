"""Training tokens per second of packed, token-balanced micro-batches against the padded round robin they replace.

Two CPU ranks (gloo, one core each, FSDP2 through the trainer's own sharded_policy, float32, AdamW) train one
mini-batch of long-tailed sequences: 32-token prompts and responses drawn Pareto-like (mean about a quarter of the
cap, a few at the cap), maxTokensPerMicroBatch 4 x the longest sequence. Variants, each on its own copy of the
bench model, taking turns in one process group (the order reversed every repeat, so drift favours no one):
  padded       the algorithm before packing, which the library no longer has (kept here, minimal, as the
               baseline): rank r takes every world-th sequence, micro-batches of right-padded rows (rows x longest
               row within the budget, longest first), causal SDPA over each row, the engine's pi_old
  packed       loop.train_iteration with oldLogprobs engine: the same work but packed and balanced by tokens
  recompute    loop.train_iteration with oldLogprobs trainer (the default): packed, plus the no-grad forward
               that recomputes pi_old (for information: its cost)
Tokens per second: the mini-batch's prompt + response tokens over the seconds from a barrier before the step to
one after it (the slower rank's). The first repeat is warm-up.

Prints each repeat's seconds and, last, one JSON line: packed_balanced_over_padded_tokens_per_s (target >= 1.3).
Not a test: it measures. About 8 minutes on 2 cores.
  python bench/trainer_throughput.py           # model bench (~95M parameters), 32 sequences, cap 512, 3 repeats
  python bench/trainer_throughput.py --quick   # the test model, 8 sequences, cap 64, ~20 s (the script's test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import MethodType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from pat_operator.api import Algorithm
from pat_workers.engine.model import rms_norm, rope_tables
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer import grpo
from pat_workers.trainer.loop import Rollout, _pad, adamw, train_iteration
from pat_workers.trainer.policy import Policy, ResponseLogprobs, sharded_policy, token_logprobs

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.engine.multiproc import run_ranks  # noqa: E402

VARIANTS = ("padded", "packed", "recompute")
PROMPT_TOKENS = 32


def long_tailed_rollouts(count: int, cap: int, vocab: int, seed: int = 0) -> list[Rollout]:
    """Random tokens; response lengths min(cap, s / u), u uniform: Pareto with alpha 1, s = cap / 14 for a mean of
    about a quarter of the cap (s (1 + ln(cap / s)) = 0.26 cap), a share 1/14 at the cap; advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    scale = cap / 14
    lengths = [min(cap, max(1, round(scale / u))) for u in (1 - torch.rand(count, generator=g)).tolist()]
    return [Rollout(torch.randint(vocab, (PROMPT_TOKENS,), generator=g).tolist(),
                    torch.randint(vocab, (n,), generator=g).tolist(), [-6.0] * n, float(i % 2), 1.0 if i % 2 else -1.0)
            for i, n in enumerate(lengths)]


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def padded_forward(self: Policy, tokens: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor
                   ) -> ResponseLogprobs:
    """Policy.forward before packing: rows [B, L] of prompt + response tokens, right-padded."""
    cfg, (b, length) = self.config, tokens.shape
    x = self.model.embed_tokens.weight[tokens]
    cos, sin = rope_tables(cfg, length, tokens.device, x.dtype)
    for block in self.blocks:
        x = block(x, cos[:, None], sin[:, None], causal)
    hidden = rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps)
    offsets = torch.arange(int(response_lens.max()))
    mask = offsets < response_lens[:, None]
    positions = (prompt_lens[:, None] + offsets).clamp(max=length - 1)
    rows = torch.arange(b)[:, None]
    head = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
    chosen, entropy = token_logprobs(hidden[rows, positions - 1][mask], head, tokens[rows, positions][mask])
    logprobs = torch.zeros(mask.shape, dtype=chosen.dtype).masked_scatter(mask, chosen)
    return ResponseLogprobs(logprobs, mask, torch.zeros_like(logprobs).masked_scatter(mask, entropy))


def padded_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Groups whose right-padded rows hold at most `budget` tokens (rows x longest row): longest first, each group
    filled while it fits."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_train_iteration(model: Policy, optimizer: torch.optim.Optimizer, rollouts: list[Rollout],
                           alg: Algorithm, rank: int, world: int) -> None:
    """train_iteration before packing, one mini-batch, no reference, no stats: round robin over the ranks, padded
    micro-batches, zero-weight passes for a rank with fewer."""
    shares = [rollouts[r::world] for r in range(world)]
    plans = [padded_micro_batches([len(x.prompt) + len(x.response) for x in share], alg.max_tokens_per_micro_batch)
             for share in shares]
    mine, plan = shares[rank], plans[rank] + [[]] * (max(map(len, plans)) - len(plans[rank]))
    totals = (float(sum(len(x.response) for x in rollouts)), float(len(rollouts)))
    optimizer.zero_grad(set_to_none=True)
    for part in plan:
        chunk = [mine[j] for j in part] or mine[:1]
        width = max(len(x.prompt) + len(x.response) for x in chunk)
        tokens = torch.tensor([x.prompt + x.response + [0] * (width - len(x.prompt) - len(x.response))
                               for x in chunk])
        prompt_lens, response_lens = (torch.tensor([len(x.prompt) for x in chunk]),
                                      torch.tensor([len(x.response) for x in chunk]))
        out = model(tokens, prompt_lens, response_lens)
        old = _pad([x.logprobs for x in chunk], out.logprobs.shape[1], torch.device("cpu"))
        loss, _ = grpo.policy_loss(out.logprobs, old, torch.tensor([x.advantage for x in chunk]), out.mask,
                                   clip_ratio=alg.clip_ratio, totals=totals)
        (loss * (world if part else 0.0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), alg.grad_clip)
    optimizer.step()


def rank_main(rank: int, world: int, model_dir: Path, rollouts: list[Rollout], budget: int, repeats: int
              ) -> dict[str, list[float]]:
    """Every variant's seconds per repeat (the first is warm-up), measured between barriers."""
    mesh, cpu = init_device_mesh("cpu", (world,)), torch.device("cpu")
    algs = {v: Algorithm(mini_batches=1, max_tokens_per_micro_batch=budget,
                         old_logprobs="trainer" if v == "recompute" else "engine") for v in VARIANTS}
    policies = {v: sharded_policy(model_dir, mesh, checkpointing=False, bf16=False, cpu_offload=False)
                for v in VARIANTS}
    policies["padded"].forward = MethodType(padded_forward, policies["padded"])  # FSDP2's hooks still wrap it
    optimizers = {v: adamw(policies[v], algs[v], cpu) for v in VARIANTS}
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats + 1):
        for v in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            t = time.perf_counter()
            if v == "padded":
                padded_train_iteration(policies[v], optimizers[v], rollouts, algs[v], rank, world)
            else:
                train_iteration(policies[v], None, optimizers[v], rollouts, algs[v], rank, world, cpu)
            dist.barrier()
            seconds[v].append(time.perf_counter() - t)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the test model, 8 short sequences: for the script's test")
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats per variant (after one warm-up)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds the ranks may take")
    args = ap.parse_args()
    preset, count, cap = ("test", 8, 64) if args.quick else ("bench", 32, 512)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), preset=preset)
        rollouts = long_tailed_rollouts(count, cap, Policy(model_dir, device="meta").config.vocab_size)
        budget = 4 * (PROMPT_TOKENS + cap)
        lengths = [len(r.response) for r in rollouts]
        tokens = sum(len(r.prompt) + len(r.response) for r in rollouts)
        print(f"model {preset}, 2 ranks; {count} sequences: responses mean {statistics.mean(lengths):.0f}, "
              f"{lengths.count(cap)} at the cap {cap}; {tokens} tokens; maxTokensPerMicroBatch {budget}", flush=True)
        ranks = run_ranks(rank_main, 2, model_dir, rollouts, budget, args.repeats, timeout=args.timeout)
    seconds = {v: [max(r[v][i] for r in ranks) for i in range(args.repeats + 1)] for v in VARIANTS}
    for i in range(1, args.repeats + 1):
        print(f"repeat {i}: " + ", ".join(f"{v} {seconds[v][i]:.2f} s ({tokens / seconds[v][i]:.0f} tokens/s)"
                                          for v in VARIANTS), flush=True)
    per_s = {v: tokens / statistics.median(seconds[v][1:]) for v in VARIANTS}
    print(json.dumps({
        "packed_balanced_over_padded_tokens_per_s": round(per_s["packed"] / per_s["padded"], 3),
        "recompute_over_padded_tokens_per_s": round(per_s["recompute"] / per_s["padded"], 3),
        **{f"{v}_tokens_per_s": round(per_s[v], 1) for v in VARIANTS},
        "seconds": {v: [round(s, 3) for s in seconds[v]] for v in VARIANTS},
        "preset": preset, "sequences": count, "cap": cap, "tokens": tokens, "response_tokens_mean": statistics.mean(
            lengths), "at_cap": lengths.count(cap), "max_tokens_per_micro_batch": budget, "ranks": 2}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
