"""Model shapes by name: the tiny presets' config.json dimensions, and a Hugging Face config.json from them.

Torch-free, so that the simulator (pat_workers.sim) can size a job's tiny model without the engine.
"""

from __future__ import annotations

from typing import Any

# config.json dimensions, plus lm_head_gain where a preset wants another logit scale (not a config.json field).
PRESETS: dict[str, dict[str, Any]] = {
    # For tests: fast, 4 KV heads so that TP 1/2/4 all apply.
    "test": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=320),
    # For the local RLHF demo on a 2-core CPU (synthetic arithmetic): small, and near-uniform at the start.
    "demo": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=320, lm_head_gain=0.1),
    # For the CPU benchmark: compute per step outweighs a shared-memory all-reduce (~10 us).
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=2048),
    # Llama-3.1-8B's shape (random weights), for the GPU benchmark.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}


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
