"""Tiny random-weight models in the Hugging Face format, built from a fixed seed.

No model hub is reachable here, so tests, benchmarks and the demo build their models with this and load
them back through the real loader. The weights are scaled so that each layer keeps its activations at unit
scale and the logits are peaked (std ~4): greedy decoding then rarely meets a near-tie, which makes
token-for-token comparisons between parallel layouts meaningful. The `demo` preset instead starts near-uniform
(logit std ~0.1), so that RL can explore every token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pat_operator.fit import PRESETS, hf_config
from .engine import Request
from .loader import save_weights
from .sampling import SamplingParams

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")

# The logit scale of the random weights: the std of the logits at initialisation (lm_head's gain).
PEAKED_LM_HEAD_GAIN = 4.0

def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer without merges: 256 byte tokens, the specials, reserved ids up to vocab_size."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    pad_vocab(tokenizer, vocab_size)
    return tokenizer


def pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Adds reserved special tokens until the tokenizer has `vocab_size` ids, one per row of the embedding, so
    that every id the model can sample decodes (to nothing, as a special token)."""
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {size} tokens; raise vocab_size")
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - size)])


def random_weights(cfg: dict[str, Any], seed: int, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32,
                   lm_head_gain: float = PEAKED_LM_HEAD_GAIN) -> dict[str, torch.Tensor]:
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
    if not cfg.get("tie_word_embeddings"):  # tied: the embedding is the head, as Hugging Face writes it
        w["lm_head.weight"] = linear(vocab, h, gain=lm_head_gain)
    return w


def make_tiny_model(path: str | Path, *, family: str = "llama", preset: str = "test", seed: int = 0,
                    shards: int = 1, tokenizer: Tokenizer | None = None, **overrides: Any) -> Path:
    """Writes config.json, safetensors weights and tokenizer.json of a random model into `path`.

    `tokenizer` (e.g. one trained on the dataset) replaces the byte-level one; it must hold SPECIAL_TOKENS. The
    vocabulary is then its size rounded up to a multiple of 8 (reserved tokens fill the rest). Either way
    config.json's bos/eos ids are the tokenizer's.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dims = {**PRESETS[preset], **overrides}
    lm_head_gain = dims.pop("lm_head_gain", PEAKED_LM_HEAD_GAIN)
    if tokenizer is None:
        tokenizer = byte_level_tokenizer(dims["vocab_size"])
    else:
        if "vocab_size" in overrides:
            raise ValueError("vocab_size comes from the tokenizer; pass either vocab_size or tokenizer")
        tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: padding must not change the caller's
        pad_vocab(tokenizer, -(-tokenizer.get_vocab_size() // 8) * 8)
        dims["vocab_size"] = tokenizer.get_vocab_size()
    bos, eos = (tokenizer.token_to_id(name) for name in SPECIAL_TOKENS[:2])
    if bos is None or eos is None:
        raise ValueError(f"the tokenizer lacks {SPECIAL_TOKENS[:2]}; train it with these special tokens")
    cfg = hf_config(family, bos_token_id=bos, eos_token_id=eos, **dims)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_weights(path, random_weights(cfg, seed, lm_head_gain=lm_head_gain), shards=shards)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def mixed_requests(n: int = 12, seed: int = 0, longest: int = 100) -> list[Request]:
    """Requests for the engine's equivalence checks (tests, bench/gpu_engine.py): mixed lengths (so that replicas run
    dry at different times) and one long tail of `longest` tokens (so that a replica that ran dry still has a peer
    decoding when a coordinator a few events behind reacts); half greedy, half sampled, some with top-k."""
    out = []
    for i in range(n):
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=longest if i == n - 1 else 8 + (i * 7) % 40, ignore_eos=True,
                                seed=seed * 1000 + i, temperature=0.9 if sampled else 0.0,
                                top_p=0.95 if sampled else 1.0, top_k=50 if i % 4 == 3 else 0)
        out.append(Request(f"req-{i}", [256] + [(37 * i + 11 * j) % 250 for j in range(3 + i % 5)], params))
    return out


def fresh(requests: list[Request]) -> list[Request]:
    """The same requests, nothing generated yet."""
    return [Request(r.id, list(r.prompt), r.params) for r in requests]

