"""The policy computes with the engine's model: its log-probabilities are the engine's, its gradients reach every
weight, sequences packed into one row score and train as they do alone, the chunked loss equals the full one without
ever holding [tokens, vocab], and activation checkpointing changes no gradient."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer import policy as policy_module
from pat_workers.trainer.grpo import policy_loss
from pat_workers.trainer.policy import Policy, packed_attention, token_logprobs


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
        logprobs = score(policy, tokens.flatten(), [1, 1], [9, 9]).logprobs  # two sequences in one row
        shorter = score(policy, tokens[0, :6], [1], [5]).logprobs  # a prefix alone: the same at its positions
    for row in range(2):
        assert (logprobs[row] - prefill_logprobs(model_dir, tokens[row])).abs().max().item() < 1e-5
    assert (shorter[0] - logprobs[0, :5]).abs().max().item() < 1e-5
    # Negative control: another model's differ.
    other = Policy(make_tiny_model(tmp_path / "other", family=family, seed=3))
    with torch.no_grad():
        assert (score(other, tokens.flatten(), [1, 1], [9, 9]).logprobs - logprobs).abs().max().item() > 1e-2


def batch(vocab: int = 300):
    """Three sequences of 8, 9 and 6 tokens packed into one row."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (23,), generator=g)
    return tokens, torch.tensor([3, 2, 4]), torch.tensor([5, 7, 2])


def test_response_logprobs_pick_the_next_token_probability(model_dir):
    policy = Policy(model_dir)
    tokens, prompt_lens, response_lens = batch()
    out = policy(tokens, prompt_lens, response_lens)
    assert out.logprobs.shape == out.mask.shape == out.entropy.shape == (3, 7)
    assert out.mask.sum(1).tolist() == [5, 7, 2]
    assert (out.logprobs[~out.mask] == 0).all() and (out.logprobs[out.mask] < 0).all()
    # Sequence 2's response tokens are tokens[21:23]: scoring it alone with a longer prompt gives the same values.
    with torch.no_grad():
        shifted = score(policy, tokens[17:], [5], [1]).logprobs
    assert shifted[0, 0].item() == pytest.approx(out.logprobs[2, 1].item(), abs=1e-5)
    entropy = out.entropy[out.mask]
    assert (entropy > 0).all() and (entropy <= math.log(policy.config.vocab_size) + 1e-5).all()
    assert not out.entropy.requires_grad and (out.entropy[~out.mask] == 0).all()
    with pytest.raises(ValueError, match="add up to the row"):
        score(policy, tokens, [3, 2, 4], [5, 8, 2])  # 24 tokens, not 23
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        score(policy, tokens, [3, 0, 4], [5, 9, 2])
    with pytest.raises(ValueError, match="one entry per sequence"):
        score(policy, tokens, [3, 2], [5, 7, 2])
    with pytest.raises(ValueError, match="one packed row"):
        score(policy, tokens[None], [3, 2, 4], [5, 7, 2])


SEQUENCES = [(3, 5), (2, 1), (5, 0), (1, 9), (4, 3)]  # (prompt, response) tokens: a 1-token and an empty response


def packed_loss(policy, sequences, tokens, old, advantages):
    """The GRPO loss of `sequences` (slices of `tokens`) scored in one packed row, as a share of the whole batch."""
    prompt_lens, response_lens = (torch.tensor(lens) for lens in zip(*sequences))
    out = policy(tokens, prompt_lens, response_lens)
    width = out.logprobs.shape[1]
    totals = (float(sum(r for _, r in SEQUENCES)), float(len(SEQUENCES)))
    return policy_loss(out.logprobs, old[:, :width], advantages, out.mask, clip_ratio=0.2, totals=totals)[0]


def test_packed_sequences_train_as_they_do_one_by_one(model_dir, monkeypatch):
    """The loss and every gradient of a packed micro-batch are the sums of its sequences' computed alone: each
    attends only to itself, its positions from 0."""
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 300, (p + r,), generator=g) for p, r in SEQUENCES]
    old = -torch.rand(len(SEQUENCES), 9, generator=g) * 5  # pi_old of each response token: ratios far from 1
    advantages = torch.randn(len(SEQUENCES), generator=g)

    def loss_and_grads(policy, parts):
        policy.zero_grad()
        loss = sum(packed_loss(policy, [SEQUENCES[i] for i in part], torch.cat([rows[i] for i in part]),
                               old[part], advantages[part]) for part in parts)
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in policy.named_parameters()}

    policy = Policy(model_dir)
    loss, grads = loss_and_grads(policy, [list(range(len(SEQUENCES)))])
    alone_loss, alone_grads = loss_and_grads(policy, [[i] for i in range(len(SEQUENCES))])
    assert loss == pytest.approx(alone_loss, rel=1e-5, abs=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # Negative control: attention across the whole row (no document mask) scores another loss.
    monkeypatch.setattr(policy_module, "packed_attention", lambda lengths, device, flex: lambda q, k, v:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert abs(loss_and_grads(policy, [list(range(len(SEQUENCES)))])[0] - alone_loss) > 1e-3


def test_flex_attention_masks_each_sequence_like_sdpa_does(monkeypatch):
    """The CUDA path (FlexAttention with a document mask over the row padded to FLEX_BLOCK) equals the CPU path
    (causal SDPA per sequence), forward, on CPU: the kernel compiled for static shapes, as inductor's CPU template
    needs (a symbolic length miscompiles there)."""
    monkeypatch.setattr(policy_module, "_flex_attention", torch.compile(flex_attention, dynamic=False))
    g = torch.Generator().manual_seed(0)
    lengths = [8, 1, 30, 11]
    q, k, v = (torch.randn(1, heads, sum(lengths), 16, generator=g) for heads in (8, 4, 4))
    cpu = torch.device("cpu")
    with torch.no_grad():
        flex = packed_attention(lengths, cpu, flex=True)(q, k, v)
        sdpa = packed_attention(lengths, cpu, flex=False)(q, k, v)
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (flex - sdpa).abs().max().item() < 1e-5
    assert (whole - sdpa).abs().max().item() > 1e-2  # negative control: without the mask the sequences mix


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
