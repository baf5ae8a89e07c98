"""The model shape, read from a Hugging Face ``config.json`` (Llama-3, Qwen2, Qwen3 families)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pat_operator.fit import ModelShape
from pat_operator.layout import tp_degrees

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class ConfigError(ValueError):
    """A config.json this engine cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type={model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        # transformers >= 5 writes rope_parameters (theta inside); older versions rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported; supported: default, linear, llama3"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        shape = ModelShape.from_hf(hf, model_type)  # the families' biases and norms, as pat plan counts them
        return cls(
            model_type=model_type,
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_layers=shape.layers,
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=shape.tied_embeddings,
            qkv_bias=shape.qkv_bias,
            o_bias=shape.o_bias,
            mlp_bias=shape.mlp_bias,
            qk_norm=shape.qk_norm,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"{file}: not found; a model directory holds config.json and *.safetensors")
        return cls.from_hf(json.loads(file.read_text()))

    def tp_sizes(self, world: int) -> list[int]:
        """TP degrees this model can run at in a pod of `world` ranks: powers of two dividing the world, the
        KV heads and the MLP width."""
        return [t for t in tp_degrees(world) if self.num_kv_heads % t == 0 and self.intermediate_size % t == 0]

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
