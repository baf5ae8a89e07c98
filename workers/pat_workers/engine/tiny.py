"""Tiny random-weight models in the Hugging Face format, built from a fixed seed.

No model hub is reachable here, so tests, benchmarks and the demo build their models with this and load
them back through the real loader. The weights are scaled so that each layer keeps its activations at unit
scale and the logits are peaked (std ~4): greedy decoding then rarely meets a near-tie, which makes
token-for-token comparisons between parallel layouts meaningful.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .loader import save_weights

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: fast, 4 KV heads so that TP 1/2/4 all apply.
    "test": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=320),
    # For the CPU benchmark: compute per step outweighs a shared-memory all-reduce (~10 us).
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=2048),
    # Llama-3.1-8B's shape (random weights), for the GPU benchmark.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer without merges: 256 byte tokens, the specials, reserved ids up to vocab_size."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(alphabet) - len(SPECIAL_TOKENS))]
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS) + reserved)
    return tokenizer


def hf_config(family: str, **dims: Any) -> dict[str, Any]:
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"family={family!r}: use llama, qwen2 or qwen3")
    cfg: dict[str, Any] = dict(
        model_type=family, architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                           "qwen3": "Qwen3ForCausalLM"}[family]],
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, torch_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if family == "llama":
        cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 1024}
    if family == "qwen3":
        cfg["head_dim"] = 2 * dims["hidden_size"] // dims["num_attention_heads"]  # Qwen3 decouples head_dim
    cfg.update(dims)
    return cfg


def random_weights(cfg: dict[str, Any], seed: int, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return randn(out_features, in_features) * (gain / math.sqrt(in_features))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * randn(n)

    w = {"model.embed_tokens.weight": randn(vocab, h), "model.norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, heads * d, gain=0.5)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter, gain=0.5)
        if cfg["model_type"] == "qwen2":
            for name, n in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * randn(n)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
    w["lm_head.weight"] = linear(vocab, h, gain=4.0)
    return w


def make_tiny_model(path: str | Path, *, family: str = "llama", preset: str = "test", seed: int = 0,
                    shards: int = 1, **overrides: Any) -> Path:
    """Writes config.json, safetensors weights and tokenizer.json of a random model into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, **{**PRESETS[preset], **overrides})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_weights(path, random_weights(cfg, seed), shards=shards)
    byte_level_tokenizer(cfg["vocab_size"]).save(str(path / "tokenizer.json"))
    return path
