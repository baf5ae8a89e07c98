"""Greedy and temperature / top-k / top-p sampling that is a pure function of (logits, seed, step).

The random number of a request's n-th token depends only on its seed and n, never on which rank, batch or TP
group samples it: a request keeps its exact sample path across a regroup, a recompute or a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # benchmarks: run to max_tokens

    def __post_init__(self):
        for name, ok, fix in (
            ("max_tokens", self.max_tokens >= 1, "use 1 or more"),
            ("temperature", self.temperature >= 0, "use 0 (greedy) or a positive value"),
            ("top_p", 0 < self.top_p <= 1, "use a value in (0, 1]"),
            ("top_k", self.top_k >= 0, "use 0 (no limit) or a positive count"),
        ):
            if not ok:
                raise ValueError(f"sampling.{name}={getattr(self, name)!r} is invalid: {fix}")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) for token `step` of a request seeded with `seed` (counter-based)."""
    return (_splitmix64(_splitmix64(seed & MASK64) ^ step) >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> tuple[list[int], list[float]]:
    """Next token and its log-probability under the policy (raw logits, temperature 1) for each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = logprobs.argmax(dim=-1).tolist()
    for row, (p, step) in enumerate(zip(params, steps)):
        if p.temperature > 0:
            tokens[row] = _draw(logits[row].double() / p.temperature, p, uniform(p.seed, step))
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return tokens, chosen.tolist()


def _draw(scaled: torch.Tensor, p: SamplingParams, u: float) -> int:
    probs, order = torch.softmax(scaled, dim=-1).sort(descending=True)
    if p.top_k:
        probs = probs[:p.top_k]
    if p.top_p < 1:
        keep = (probs.cumsum(0) - probs) < p.top_p  # the smallest prefix whose mass reaches top_p
        probs = probs[keep]
    cdf = probs.cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)))
    return int(order[min(index, len(cdf) - 1)])
