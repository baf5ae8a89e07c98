"""The demo presets start near-uniform; make_tiny_model takes a trained tokenizer and keeps its special ids."""

import json
import math

import pytest
import torch

from pat_operator.api import SyntheticDataset
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.loader import load_tokenizer
from pat_workers.engine.tiny import make_tiny_model
from pat_workers.trainer.data import synthetic_arithmetic, train_tokenizer
from pat_workers.trainer.policy import Policy


def initial_entropy(model_dir) -> float:
    policy = Policy(model_dir)
    tokens = torch.randint(0, policy.config.vocab_size, (4 * 16,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 4 sequences of 16 tokens packed into one row
        return policy(tokens, torch.ones(4, dtype=torch.long), torch.full((4,), 15)).entropy.mean().item()


def test_demo_preset_starts_near_uniform(tmp_path):
    demo = make_tiny_model(tmp_path / "demo", preset="demo")
    cfg = ModelConfig.from_dir(demo)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (128, 4, 8, 4)
    assert "lm_head_gain" not in json.loads((demo / "config.json").read_text())
    uniform = math.log(cfg.vocab_size)
    assert initial_entropy(demo) > 0.99 * uniform
    # Negative control: the test preset's peaked logits (gain 4) are far from uniform; the gain can be overridden.
    assert initial_entropy(make_tiny_model(tmp_path / "test", preset="test")) < 0.8 * uniform
    assert initial_entropy(make_tiny_model(tmp_path / "flat", preset="test", lm_head_gain=0.1)) > 0.99 * uniform


def test_make_runs_preset_is_one_wide_layer_near_uniform(tmp_path):
    wide = make_tiny_model(tmp_path / "wide", preset="demo-wide")
    cfg = ModelConfig.from_dir(wide)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (1024, 1, 16, 4)
    assert initial_entropy(wide) > 0.99 * math.log(cfg.vocab_size)


def test_a_trained_tokenizer_sets_the_vocabulary_and_special_ids(tmp_path):
    texts = [p.prompt + " #### " + p.answer for p in synthetic_arithmetic(SyntheticDataset(size=100))]
    tokenizer = train_tokenizer(texts, vocab_size=43, path=tmp_path / "tok")
    size = tokenizer.get_vocab_size()
    model_dir = make_tiny_model(tmp_path / "model", preset="demo", tokenizer=tokenizer)
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf["vocab_size"] == -(-size // 8) * 8 and hf["vocab_size"] % 8 == 0
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (0, 1) == (tokenizer.token_to_id("<|begin_of_text|>"),
                                                                  tokenizer.token_to_id("<|end_of_text|>"))
    saved = load_tokenizer(model_dir)
    assert saved.get_vocab_size() == hf["vocab_size"]  # reserved tokens fill the rounded-up rows
    assert tokenizer.get_vocab_size() == size  # the caller's tokenizer is left as it was
    assert saved.encode(texts[0]).ids == tokenizer.encode(texts[0]).ids
    assert Policy(model_dir).lm_head.weight.shape[0] == hf["vocab_size"]
    with pytest.raises(ValueError, match="either vocab_size or tokenizer"):
        make_tiny_model(tmp_path / "both", tokenizer=tokenizer, vocab_size=64)


def test_byte_level_default_keeps_its_ids(tmp_path):
    hf = json.loads((make_tiny_model(tmp_path) / "config.json").read_text())
    assert (hf["vocab_size"], hf["bos_token_id"], hf["eos_token_id"]) == (320, 256, 257)
