"""Sampling, model config and the loader: pure or single-process pieces."""

import json
import re

import pytest
import torch

from pat_workers.engine.config import ConfigError, ModelConfig
from pat_workers.engine.loader import load_model, load_tokenizer
from pat_workers.engine.sampling import SamplingBatch, SamplingParams, sample, uniform
from pat_workers.engine.tiny import make_tiny_model


def test_uniform_is_a_function_of_seed_and_step():
    steps = torch.arange(2000)
    values = uniform(torch.full((2000,), 7), steps)
    assert values.dtype == torch.float32
    assert torch.equal(values, torch.stack([uniform(torch.tensor(7), s) for s in steps]))
    assert len(set(values.tolist())) >= 1990 and 0 <= values.min() and values.max() < 1
    assert abs(values.mean() - 0.5) < 0.03
    assert (torch.histc(values, bins=10, min=0, max=1) / 2000 - 0.1).abs().max() < 0.03
    assert uniform(torch.tensor(8), torch.tensor(3)) != uniform(torch.tensor(7), torch.tensor(3))


def _sample(logits, params, steps):
    """sample() on host lists: tokens and log-probabilities."""
    batch = SamplingBatch.build(params, logits.shape[-1], logits.device)
    tokens, logprobs = sample(logits, batch, torch.tensor(steps))
    return tokens.tolist(), logprobs.tolist()


def test_sample_greedy_and_seeded():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    tokens, logprobs = _sample(logits, [greedy] * 3, [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist())
    hot = SamplingParams(temperature=1.0, seed=5)
    a = _sample(logits, [hot] * 3, [4, 4, 9])[0]
    assert a == _sample(logits.clone(), [hot] * 3, [4, 4, 9])[0]
    # The empirical distribution of seeded draws follows softmax(logits / T): one row per seed.
    row = logits[0]
    for temperature in (1.0, 0.5):
        draws = _sample(row.expand(3000, 50), [SamplingParams(temperature=temperature, seed=s) for s in range(3000)],
                        [0] * 3000)[0]
        freq = torch.bincount(torch.tensor(draws), minlength=50).float() / 3000
        assert (freq - torch.softmax(row / temperature, -1)).abs().max() < 0.04


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).expand(200, 5)
    top_k = _sample(logits, [SamplingParams(temperature=2.0, top_k=2, seed=s) for s in range(200)], [0] * 200)[0]
    assert set(top_k) == {0, 1}
    top_p = _sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=s) for s in range(200)], [0] * 200)[0]
    assert set(top_p) == {0}
    # Within the support, the draws follow the renormalised distribution.
    row = torch.randn(50, generator=torch.Generator().manual_seed(1))
    draws = _sample(row.expand(3000, 50), [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(3000)],
                    [7] * 3000)[0]
    freq = torch.bincount(torch.tensor(draws), minlength=50).float() / 3000
    expected = torch.zeros(50).scatter(0, row.topk(3).indices, torch.softmax(row.topk(3).values, -1))
    assert (freq - expected).abs().max() < 0.04


@pytest.mark.parametrize("field,value,fix", [("max_tokens", 0, "1 or more"), ("temperature", -1, "greedy"),
                                             ("top_p", 0, "(0, 1]"), ("top_k", -2, "no limit")])
def test_bad_sampling_params_name_the_field(field, value, fix):
    with pytest.raises(ValueError, match=rf"sampling\.{field}=.*{re.escape(fix)}"):
        SamplingParams(**{field: value})


def test_config_errors_name_the_field(tmp_path):
    for patch, field in (({"model_type": "gpt2"}, "model_type"), ({"hidden_act": "gelu"}, "hidden_act"),
                         ({"num_key_value_heads": 3}, "num_key_value_heads"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type")):
        hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **patch}
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_round_trips_through_the_loader(tmp_path, family):
    one = make_tiny_model(tmp_path / "one", family=family, seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", family=family, seed=3, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg1, w1 = load_model(one)
    cfg2, w2 = load_model(sharded)
    assert cfg1 == cfg2 and cfg1.model_type == family and cfg1.qk_norm == (family == "qwen3")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert json.loads((one / "config.json").read_text())["num_key_value_heads"] == cfg1.num_kv_heads
    tok = load_tokenizer(one)
    assert tok.get_vocab_size() == cfg1.vocab_size
    ids = tok.encode("What is 12 + 30? \\boxed{42}").ids
    assert tok.decode(ids) == "What is 12 + 30? \\boxed{42}"
    # Same seed, same weights; another seed, other weights.
    other = make_tiny_model(tmp_path / "other", family=family, seed=4)
    assert not torch.equal(load_model(other)[1]["lm_head.weight"], w1["lm_head.weight"])
