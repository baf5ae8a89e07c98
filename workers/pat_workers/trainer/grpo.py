"""GRPO's maths as pure functions: group-relative advantages, the clipped policy loss, entropy.

Shapes: N sequences (prompt-major: the G samples of a prompt are consecutive), T response tokens per row
(right-padded; `mask` is True at real response tokens).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# exp() of a log-ratio beyond this overflows float32 long before it means anything.
MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A = r - mean(group), divided by std(group) + eps when `scale_by_std` (GRPO; Dr. GRPO turns it off).

    The std is the unbiased one (divisor G - 1), as in TRL's and verl's GRPO, so that hyperparameters tuned
    there carry over; a group of equal rewards gets advantage 0 either way.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size} (G samples per "
                         f"prompt, prompt-major); got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO compares samples of one prompt; use at least 2")
    groups = rewards.float().view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str,
               max_response_tokens: int | None = None, totals: tuple[float, float] | None = None) -> torch.Tensor:
    """One scalar from per-token values [N, T]:
    token-mean: sum / token count;
    seq-mean-token-mean: the mean over sequences of each sequence's token mean;
    seq-mean-token-sum-norm (Dr. GRPO): sum / (N * max_response_tokens), no length bias.
    The counts are `totals` = (tokens, sequences) when given (see policy_loss), else this batch's own."""
    mask = mask.to(per_token.dtype)
    tokens, sequences = totals or (mask.sum().clamp(min=1), per_token.shape[0])
    if aggregation == "token-mean":
        return (per_token * mask).sum() / tokens
    if aggregation == "seq-mean-token-mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / sequences
    if aggregation == "seq-mean-token-sum-norm":
        if max_response_tokens is None:
            raise ValueError("aggregation='seq-mean-token-sum-norm' divides by N * max_response_tokens; pass "
                             "max_response_tokens (algorithm.maxResponseTokens)")
        return (per_token * mask).sum() / (sequences * max_response_tokens)
    raise ValueError(f"aggregation={aggregation!r} is unknown; use one of {AGGREGATIONS}")


def tis_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al., 2025): per token min(pi_old / pi_engine, cap), the weight that
    corrects a rollout sampled by the engine for the trainer's own pi_old. No gradient flows through it."""
    log_ratio = (old_logprobs - engine_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap).detach()


def mismatch_sums(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
                  ) -> dict[str, float]:
    """How far the engine's sampled-token log-probabilities are from the trainer's, over the masked tokens: the sum
    of |d|, the largest |d| and the sum of k3 = exp(d) - d - 1, with d = trainer - engine: on tokens the engine
    sampled, k3 is an unbiased, non-negative estimate of KL(engine || trainer). Sums, so that micro-batches and
    ranks add up; divide by the token count for means."""
    d = (trainer_logprobs - engine_logprobs)[mask.bool()].double()
    k3 = torch.exp(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) - d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) - 1
    return {"abs_sum": d.abs().sum().item(), "abs_max": d.abs().max().item() if d.numel() else 0.0,
            "k3_sum": k3.sum().item()}


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_ratio: float, ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0, aggregation: str = "token-mean", max_response_tokens: int | None = None,
                totals: tuple[float, float] | None = None, token_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token, max(-A r, -A clip(r, 1-c, 1+c)) with r = exp(logprobs - old), times
    `token_weights` when given (tis_weights), plus kl_coef * k3 (exp(ref - new) - (ref - new) - 1, an unbiased,
    non-negative KL(new || ref) estimate) when kl_coef > 0, aggregated over the masked tokens. `advantages` is [N]
    (one per sequence) or [N, T].

    A batch that is one part of a larger one (a micro-batch on one rank) passes the whole batch's totals =
    (response tokens, sequences): its loss is then its share, and the parts' losses (and gradients) sum to the
    whole batch's, whichever way it was split.

    Returns the loss and float stats: loss, pg_loss, kl (token mean of k3; 0 without ref_logprobs),
    clip_fraction (share of tokens where the clipped term won), ratio_mean.
    """
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the frozen reference policy's log-probabilities "
                         "of the response tokens); pass them or set kl_coef=0")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                    ("token_weights", token_weights)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must match logprobs {tuple(logprobs.shape)}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    pg_per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        pg_per_token = pg_per_token * token_weights
    per_token = pg_per_token
    kl_per_token = None
    if ref_logprobs is not None:
        log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl_per_token = torch.exp(log_ratio) - log_ratio - 1
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_per_token
    loss = _aggregate(per_token, mask, aggregation, max_response_tokens, totals)
    with torch.no_grad():
        stats = {
            "loss": loss.item(),
            "pg_loss": _aggregate(pg_per_token, mask, aggregation, max_response_tokens, totals).item(),
            "kl": 0.0 if kl_per_token is None else _masked_mean(kl_per_token, mask).item(),
            "clip_fraction": _masked_mean((clipped > unclipped).float(), mask).item(),
            "ratio_mean": _masked_mean(ratio, mask).item(),
        }
    return loss, stats

