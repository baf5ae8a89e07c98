"""GRPO's maths against hand-computed values."""

import math

import pytest
import torch

from pat_workers.trainer.grpo import group_advantages, mismatch_sums, policy_loss, tis_weights


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # Group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5. Group 2: all equal -> 0.
    scaled = group_advantages(rewards, group_size=4)
    assert torch.allclose(scaled, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))
    unscaled = group_advantages(rewards, group_size=4, scale_by_std=False)
    assert torch.allclose(unscaled, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    # Prompt-major: the same rewards grouped in pairs give other advantages.
    assert not torch.allclose(group_advantages(rewards, group_size=2)[:4], scaled[:4])


def test_group_advantages_refuses_a_partial_group():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), group_size=4)


def lengths_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def test_aggregations_by_hand():
    # At ratio 1 the per-token loss is -A. Row 0: A=1 on 1 token; row 1: A=-2 on 3 tokens.
    mask = lengths_mask([1, 3], 4)
    logprobs = torch.zeros(2, 4)
    advantages = torch.tensor([1.0, -2.0])

    def loss(**kw):
        return policy_loss(logprobs, logprobs, advantages, mask, clip_ratio=0.2, **kw)[0].item()

    assert loss(aggregation="token-mean") == pytest.approx((-1 + 2 * 3) / 4)
    assert loss(aggregation="seq-mean-token-mean") == pytest.approx((-1 + 2) / 2)
    assert loss(aggregation="seq-mean-token-sum-norm", max_response_tokens=8) == pytest.approx((-1 + 6) / (2 * 8))
    # A part of a larger batch (10 tokens in 5 sequences) gets its share of that batch's loss.
    assert loss(aggregation="token-mean", totals=(10.0, 5.0)) == pytest.approx(5 / 10)
    assert loss(aggregation="seq-mean-token-mean", totals=(10.0, 5.0)) == pytest.approx((-1 + 2) / 5)
    assert loss(aggregation="seq-mean-token-sum-norm", max_response_tokens=8, totals=(10.0, 5.0)) == \
        pytest.approx(5 / (5 * 8))
    with pytest.raises(ValueError, match="max_response_tokens"):
        loss(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        loss(aggregation="sum")


def test_clipping_by_hand():
    # Both tokens have ratio 1.5. A=+1: the clipped term (1.2) wins, no gradient. A=-1: the unclipped one wins.
    old = torch.zeros(2, 1)
    logprobs = torch.full((2, 1), math.log(1.5), requires_grad=True)
    loss, stats = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=torch.bool),
                              clip_ratio=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx(1.5)
    assert stats["loss"] == stats["pg_loss"] == pytest.approx(loss.item())
    loss.backward()
    assert logprobs.grad[0, 0] == 0  # clipped: no push beyond 1 + clip_ratio
    assert logprobs.grad[1, 0] == pytest.approx(1.5 / 2)  # d/dlogp of A * exp(logp - old) / 2 tokens


def test_kl_penalty_by_hand():
    mask = torch.ones(1, 2, dtype=torch.bool)
    logprobs, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -0.5]])
    k3 = math.exp(0.5) - 0.5 - 1  # second token; the first has ref == new -> 0
    loss, stats = policy_loss(logprobs, logprobs, torch.zeros(1), mask, clip_ratio=0.2, ref_logprobs=ref,
                              kl_coef=0.1)
    assert stats["kl"] == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.1 * k3 / 2)
    assert stats["pg_loss"] == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs, torch.zeros(1), mask, clip_ratio=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(logprobs, logprobs[:, :1], torch.zeros(1), mask, clip_ratio=0.2)


def test_tis_weights_are_the_truncated_ratio_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    # pi_old / pi_engine = 2, 0.5, 9 -> capped at 3
    assert torch.allclose(tis_weights(old, engine, cap=3.0), torch.tensor([[2.0, 0.5, 3.0]]))


def test_token_weights_scale_each_tokens_policy_term():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    args = dict(old_logprobs=logprobs.detach(), advantages=torch.tensor([1.0]), mask=mask, clip_ratio=0.2)
    plain, _ = policy_loss(logprobs, **args)
    weighted, _ = policy_loss(logprobs, **args, token_weights=torch.tensor([[2.0, 0.5]]))
    # ratio 1 at every token: the loss is -mean(A * w)
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-(2.0 + 0.5) / 2)
    (grad,) = torch.autograd.grad(weighted, logprobs)
    assert torch.allclose(grad, torch.tensor([[-1.0, -0.25]]))  # d/dlogp of -A w r / 2 at r = 1


def test_mismatch_sums_by_hand_over_the_masked_tokens():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    engine = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[True, True, False]])  # the third token is padding: its huge gap must not count
    sums = mismatch_sums(trainer, engine, mask)
    k3 = math.exp(0.5) - 0.5 - 1  # d = trainer - engine = 0.5 at the first token, 0 at the second
    assert sums == pytest.approx({"abs_sum": 0.5, "abs_max": 0.5, "k3_sum": k3})
    assert mismatch_sums(trainer, trainer, mask) == {"abs_sum": 0.0, "abs_max": 0.0, "k3_sum": 0.0}
