"""Greedy and temperature / top-k / top-p sampling as one batched computation on the device.

Guarantee (the sample path): a row's token is a pure function of its logits row, its SamplingParams and its step
(the index of the token in its request's output). It never depends on the other rows, the batch size, the padding
or the rank that samples it, so a request keeps its exact sample path across a regroup, a recompute or a restart.

Every row draws by inverse CDF in vocabulary order: cumsum of its (kept) probabilities, then the first token whose
cumulative mass exceeds u * total, with u = uniform(seed, step). That costs O(V) with no sort, and it makes a row's
draw independent of how the other rows are sorted. Top-k / top-p rows only need a probability threshold: the
probability of their k-th token or of the last token of the smallest prefix whose mass reaches top_p, read from
the sorted top `sort_k` probabilities. Those values are the same for any sort_k at least what the row needs, whatever
order topk gives tied tokens, so a filtering row gets the same token whichever other rows set sort_k. Tokens tied
with the threshold stay in.

Everything is float32 tensor ops with no host synchronisation and no per-row Python: the engine captures `sample`
in CUDA graphs and torch.compile(fullgraph=True). The only Python branch is on SamplingBatch.sort_k, static per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MASK32 = 0xFFFFFFFF


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


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as device tensors [B] (built once on the host per step)."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = no limit
    seed: torch.Tensor  # int64
    sort_k: int  # 0: no row filters (no sort at all); else how many top tokens the filtering rows need
    # (max top_k, or the vocabulary size when a row has top_p < 1 without top_k)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device, rows: int | None = None) -> SamplingBatch:
        """The batch for `params`, padded to `rows` rows (a batch bucket) with greedy rows."""
        rows = len(params) if rows is None else rows
        if rows < len(params):
            raise ValueError(f"rows={rows} is fewer than the {len(params)} requests")
        values = [row_values(p, vocab) for p in params] + [row_values(SamplingParams(), vocab)] * (rows - len(params))
        temperature, top_p, top_k, seed, need = zip(*values) if values else ((),) * 5
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            seed=torch.tensor(seed, dtype=torch.int64, device=device),
            sort_k=sort_width(need, vocab),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The per-row tensors in field order: SamplingBatch(*batch.tensors(), sort_k=batch.sort_k) rebuilds it."""
        return self.temperature, self.top_p, self.top_k, self.seed


def row_values(p: SamplingParams, vocab: int) -> tuple[float, float, int, int, int]:
    """A row's (temperature, top_p, top_k, seed) as SamplingBatch holds them, and the sort width it needs."""
    if p.temperature <= 0:  # filters that cannot change a token force no sort: a greedy row's
        p = SamplingParams()
    top_k = p.top_k if p.top_k < vocab else 0  # nor does a top_k of the whole vocabulary
    return p.temperature, p.top_p, top_k, p.seed, top_k or (vocab if p.top_p < 1 else 0)


def sort_width(needs: Sequence[int], vocab: int) -> int:
    """SamplingBatch.sort_k for rows needing these widths: a power of two (at most the vocabulary), since any width a
    row needs or more gives it the same token, and a captured decode step is one graph per width."""
    need = max(needs, default=0)
    return min(1 << (need - 1).bit_length(), vocab) if need else 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values < 2**32 times a multiplier < 2**31 never overflow int64)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """float32 uniform in [0, 1) per element: a counter-based hash of (seed, step) in integer tensor ops.

    Both 32-bit halves of the int64 seed are folded in (negative seeds included); the output has 24-bit resolution,
    so every value is exact in float32 and below 1.
    """
    h = _mix32((seed & MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & MASK32))
    h = _mix32(h ^ (step & MASK32))
    return (h >> 8).to(torch.float32) / float(1 << 24)


def sample(logits: torch.Tensor, batch: SamplingBatch, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-probability under the policy.

    logits [B, V] (any float dtype); steps [B] int64, the index of the token being sampled in its request's output.
    Returns tokens [B] int64 and their log-probabilities [B] float32 at temperature 1 (log_softmax of the raw logits).
    """
    logits = logits.float()
    hot = batch.temperature > 0
    probs = torch.softmax(logits / torch.where(hot, batch.temperature, 1.0)[:, None], dim=-1)
    if batch.sort_k:
        probs = torch.where(probs >= _threshold(probs, batch)[:, None], probs, 0.0)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()  # searchsorted wants contiguous values
    drawn = torch.searchsorted(cdf, uniform(batch.seed, steps)[:, None] * total, right=True)
    # u * total can round up to total: stay on the last token that adds mass (the last kept one).
    drawn = torch.minimum(drawn, torch.searchsorted(cdf, total))[:, 0]
    tokens = torch.where(hot, drawn, logits.argmax(dim=-1))
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def _threshold(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Per row, the least probability a token needs to stay in: 0 for rows without top-k / top-p."""
    top = probs.topk(batch.sort_k, dim=-1, sorted=True).values
    k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=batch.sort_k), batch.sort_k)
    within = torch.arange(batch.sort_k, device=probs.device) < k[:, None]
    top_p = batch.top_p[:, None]
    keep = within & (((top.cumsum(dim=-1) - top) < top_p) | (top_p >= 1))  # smallest prefix whose mass reaches top_p
    least = top.gather(1, keep.sum(dim=-1, keepdim=True) - 1)[:, 0]
    return torch.where((batch.top_k > 0) | (batch.top_p < 1), least, 0.0)
