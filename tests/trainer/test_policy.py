"""The policy computes with the engine's model: its log-probabilities are the engine's, its gradients reach every
weight, the chunked loss equals the full one without ever holding [tokens, vocab], and activation checkpointing
changes no gradient."""

import math

import pytest
import torch
import torch.nn.functional as F

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer import policy as policy_module
from pat_workers.trainer.grpo import policy_loss
from pat_workers.trainer.policy import Policy, token_logprobs


def prefill_logprobs(model_dir, row: torch.Tensor) -> torch.Tensor:
    """The inference path: the engine's prefill of each prefix of `row`; log p of the next token of each."""
    cfg, weights = load_model(model_dir)
    model = Transformer(cfg, weights)
    shard, comm = model.shard(1, 0), SoloCommunicator(0)
    out = []
    for end in range(1, len(row)):
        kv = PagedKV(cfg, 2 + end // 16, 16, cfg.num_kv_heads, torch.float32)
        logits = model.forward(shard, comm, kv, row[None, :end], torch.tensor([0]), kv.tables_for(1, end, 1))[0]
        out.append(torch.log_softmax(logits, -1)[row[end]])
    return torch.stack(out)


def score(policy, tokens, prompt_lens, response_lens):
    return policy(tokens, torch.as_tensor(prompt_lens), torch.as_tensor(response_lens))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logprobs_equal_the_engine_prefill(tmp_path, family):
    model_dir = make_tiny_model(tmp_path, family=family, seed=2)
    policy = Policy(model_dir)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = score(policy, tokens, [1, 1], [9, 9]).logprobs
        # A right-padded row gives the same log-probabilities at its real positions.
        padded = score(policy, torch.cat([tokens[:1, :6], torch.full((1, 4), 258)], dim=1), [1], [5]).logprobs
    for row in range(2):
        assert (logprobs[row] - prefill_logprobs(model_dir, tokens[row])).abs().max().item() < 1e-5
    assert (padded[0] - logprobs[0, :5]).abs().max().item() < 1e-5
    # Negative control: another model's differ.
    other = Policy(make_tiny_model(tmp_path / "other", family=family, seed=3))
    with torch.no_grad():
        assert (score(other, tokens, [1, 1], [9, 9]).logprobs - logprobs).abs().max().item() > 1e-2


def batch(vocab: int = 300):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 9), generator=g)
    return tokens, torch.tensor([3, 2, 4]), torch.tensor([5, 7, 2])


def test_response_logprobs_pick_the_next_token_probability(model_dir):
    policy = Policy(model_dir)
    tokens, prompt_lens, response_lens = batch()
    out = policy(tokens, prompt_lens, response_lens)
    assert out.logprobs.shape == out.mask.shape == out.entropy.shape == (3, 7)
    assert out.mask.sum(1).tolist() == [5, 7, 2]
    assert (out.logprobs[~out.mask] == 0).all() and (out.logprobs[out.mask] < 0).all()
    # Row 2's response tokens are tokens[2, 4:6]: scoring the row with a longer prompt gives the same values.
    with torch.no_grad():
        shifted = score(policy, tokens[2:], [5], [1]).logprobs
    assert shifted[0, 0].item() == pytest.approx(out.logprobs[2, 1].item(), abs=1e-5)
    entropy = out.entropy[out.mask]
    assert (entropy > 0).all() and (entropy <= math.log(policy.config.vocab_size) + 1e-5).all()
    assert not out.entropy.requires_grad and (out.entropy[~out.mask] == 0).all()
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        score(policy, tokens, [3, 2, 4], [5, 8, 2])  # 2 + 8 > 9
    with pytest.raises(ValueError, match="one entry per row"):
        score(policy, tokens, [3, 2], [5, 7])


def test_gradients_reach_every_weight(model_dir):
    policy = Policy(model_dir)
    tokens, prompt_lens, response_lens = batch()
    out = policy(tokens, prompt_lens, response_lens)
    loss, _ = policy_loss(out.logprobs, out.logprobs.detach(), torch.tensor([1.0, -0.5, 2.0]), out.mask,
                          clip_ratio=0.2)
    loss.backward()
    names = [name for name, _ in policy.named_parameters()]
    assert names == sorted(load_model(model_dir)[1])  # Hugging Face names
    for name, p in policy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0 and p.grad.isfinite().all(), name
    frozen = Policy(model_dir).requires_grad_(False)
    assert not frozen(tokens, prompt_lens, response_lens).logprobs.requires_grad


def test_gradient_matches_finite_differences(model_dir, monkeypatch):
    """Autograd through the policy's forward against a float64 central difference."""
    # The model normalises in float32 (as transformers does), whose rounding would swamp the difference.
    monkeypatch.setattr(policy_module, "rms_norm", lambda x, weight, eps: weight * x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + eps))
    policy = Policy(model_dir, dtype=torch.float64)
    tokens, prompt_lens, response_lens = batch()

    def objective():
        return policy(tokens, prompt_lens, response_lens).logprobs.sum()

    objective().backward()
    params = dict(policy.named_parameters())
    direction = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype)
                 for name, p in params.items()}
    analytic = sum((p.grad * direction[name]).sum() for name, p in params.items()).item()
    eps, initial = 1e-6, {name: p.detach().clone() for name, p in params.items()}
    values = []
    for sign in (1, -1):
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(initial[name] + sign * eps * direction[name])
            values.append(objective().item())
    numeric = (values[0] - values[1]) / (2 * eps)
    assert numeric == pytest.approx(analytic, rel=1e-6)


def test_chunked_logprobs_equal_the_full_computation_and_never_hold_all_logits():
    g = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 50, 16, 97
    hidden = torch.randn(tokens, hidden_size, generator=g, requires_grad=True)
    head = torch.randn(vocab, hidden_size, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    weights = torch.randn(tokens, generator=g)  # a loss that weighs every token differently

    full = torch.log_softmax(F.linear(hidden, head), -1)
    expected = full.gather(-1, targets[:, None])[:, 0]
    expected_entropy = -(full.exp() * full).sum(-1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (hidden, head))

    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chosen, entropy = token_logprobs(hidden, head, targets, chunk=8)
    grads = torch.autograd.grad((chosen * weights).sum(), (hidden, head))
    assert (chosen - expected).abs().max().item() < 1e-5
    assert (entropy - expected_entropy).abs().max().item() < 1e-5 and not entropy.requires_grad
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max().item() < 1e-5
    # What autograd keeps between forward and backward: the inputs, never a chunk's logits (8 x vocab), let
    # alone all of them (tokens x vocab).
    assert max(saved) == vocab * hidden_size
    # Negative control: computed whole, the log-softmax of every token is kept.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        torch.log_softmax(F.linear(hidden, head), -1)
    assert max(saved) == tokens * vocab


def test_activation_checkpointing_changes_no_gradient(model_dir):
    grads = []
    for checkpointing in (False, True):
        policy = Policy(model_dir, checkpointing=checkpointing)
        tokens, prompt_lens, response_lens = batch()
        policy(tokens, prompt_lens, response_lens).logprobs.sum().backward()
        grads.append({name: p.grad for name, p in policy.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
