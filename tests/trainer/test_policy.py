"""The policy computes with the engine's model: its logits are the engine's, its gradients reach every weight."""

import json
import math

import pytest
import torch

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.kv import KVCache
from pat_workers.engine.loader import load_model, load_tokenizer
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer.grpo import policy_loss
from pat_workers.trainer.policy import Policy, response_logprobs


def prefill_logits(model_dir, row: torch.Tensor) -> torch.Tensor:
    """The inference path: the engine's prefill of each prefix of `row`, logits of its last position."""
    cfg, weights = load_model(model_dir)
    model = Transformer(cfg, weights)
    shard, comm = model.shard(1, 0), SoloCommunicator(0)
    out = []
    for end in range(1, len(row) + 1):
        cache = KVCache.allocate(cfg, slots=1, kv_heads=cfg.num_kv_heads, max_seq=end, dtype=torch.float32)
        out.append(model.forward(shard, comm, row[None, :end], torch.tensor([0]), cache.k, cache.v)[0])
    return torch.stack(out)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_at_every_position_equal_the_engine_prefill(tmp_path, family):
    model_dir = make_tiny_model(tmp_path, family=family, seed=2)
    policy = Policy(model_dir)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = policy(tokens)
        # A right-padded row gives the same logits at its real positions.
        padded = policy(torch.cat([tokens[:1, :6], torch.full((1, 4), 258)], dim=1))
    assert logits.shape == (2, 10, policy.config.vocab_size)
    for row in range(2):
        expected = prefill_logits(model_dir, tokens[row])
        assert (logits[row] - expected).abs().max().item() < 1e-5
        assert torch.equal(logits[row].argmax(-1), expected.argmax(-1))  # greedy parity
    assert (padded[0, :6] - logits[0, :6]).abs().max().item() < 1e-5
    # Negative control: another model's logits differ.
    other = Policy(make_tiny_model(tmp_path / "other", family=family, seed=3))
    with torch.no_grad():
        assert (other(tokens) - logits).abs().max().item() > 1e-2


def batch(vocab: int = 300):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 9), generator=g)
    return tokens, torch.tensor([3, 2, 4]), torch.tensor([5, 7, 2])


def test_response_logprobs_pick_the_next_token_probability(model_dir):
    policy = Policy(model_dir)
    tokens, prompt_lens, response_lens = batch()
    out = response_logprobs(policy, tokens, prompt_lens, response_lens)
    assert out.logprobs.shape == out.mask.shape == (3, 7)
    assert out.mask.sum(1).tolist() == [5, 7, 2]
    assert (out.logprobs[~out.mask] == 0).all() and (out.logprobs[out.mask] < 0).all()
    logits = policy(tokens).detach()
    # Row 2's first response token is tokens[2, 4], predicted at position 3; its last is tokens[2, 5].
    for j, position in ((0, 4), (1, 5)):
        expected = torch.log_softmax(logits[2, position - 1], -1)[tokens[2, position]]
        assert out.logprobs[2, j].item() == pytest.approx(expected.item(), abs=1e-6)
    assert 0 < out.entropy.item() <= math.log(policy.config.vocab_size) and not out.entropy.requires_grad
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        response_logprobs(policy, tokens, [3, 2, 4], [5, 8, 2])  # 2 + 8 > 9
    with pytest.raises(ValueError, match="one entry per row"):
        response_logprobs(policy, tokens, [3, 2], [5, 7])


def test_gradients_reach_every_weight(model_dir):
    policy = Policy(model_dir)
    tokens, prompt_lens, response_lens = batch()
    out = response_logprobs(policy, tokens, prompt_lens, response_lens)
    loss, _ = policy_loss(out.logprobs, out.logprobs.detach(), torch.tensor([1.0, -0.5, 2.0]), out.mask,
                          clip_ratio=0.2)
    loss.backward()
    names = [name for name, _ in policy.named_parameters()]
    assert names == sorted(load_model(model_dir)[1])  # Hugging Face names
    for name, p in policy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0 and p.grad.isfinite().all(), name
    frozen = Policy(model_dir).requires_grad_(False)
    assert not response_logprobs(frozen, tokens, prompt_lens, response_lens).logprobs.requires_grad


def test_gradient_matches_finite_differences(model_dir, monkeypatch):
    """Autograd through the engine's forward (its cache writes included) against a float64 central difference."""
    # The engine normalises in float32 (as transformers does), whose rounding would swamp the difference.
    monkeypatch.setattr(Transformer, "rms_norm", lambda self, x, weight: weight * x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))
    policy = Policy(model_dir, dtype=torch.float64)
    tokens, prompt_lens, response_lens = batch()

    def objective():
        return response_logprobs(policy, tokens, prompt_lens, response_lens).logprobs.sum()

    objective().backward()
    direction = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype)
                 for name, p in policy.named_parameters()}
    analytic = sum((p.grad * direction[name]).sum() for name, p in policy.named_parameters()).item()
    eps, initial = 1e-6, {name: t.clone() for name, t in policy.named_weights().items()}
    values = []
    for sign in (1, -1):
        policy.load_weights({name: t + sign * eps * direction[name] for name, t in initial.items()})
        with torch.no_grad():
            values.append(objective().item())
    numeric = (values[0] - values[1]) / (2 * eps)
    assert numeric == pytest.approx(analytic, rel=1e-6)


def test_save_pretrained_is_a_model_dir_the_engine_loads(model_dir, tmp_path):
    policy = Policy(model_dir)
    changed = {name: t + 0.01 for name, t in policy.named_weights().items()}
    policy.load_weights(changed)
    assert list(policy.named_weights()) == sorted(changed)
    saved = policy.save_pretrained(tmp_path / "saved")
    cfg, weights = load_model(saved)
    assert cfg == ModelConfig.from_dir(model_dir)
    assert all(torch.equal(weights[name], changed[name]) for name in changed)
    assert json.loads((saved / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    assert load_tokenizer(saved).to_str() == load_tokenizer(model_dir).to_str()
    tokens = batch()[0]
    with torch.no_grad():
        assert torch.equal(Policy(saved)(tokens), policy(tokens))


def test_load_weights_names_what_does_not_fit(model_dir):
    policy = Policy(model_dir)
    weights = policy.named_weights()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        policy.load_weights({k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="weight model.norm.weight has shape"):
        policy.load_weights({**weights, "model.norm.weight": torch.zeros(3)})
