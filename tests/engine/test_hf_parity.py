"""The engine's forward equals transformers' own forward on tiny models that transformers saved."""

import pytest
import torch
import transformers  # a test dependency: make test installs it

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer

DIMS = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**DIMS, rope_theta=500000.0, attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen3": lambda: transformers.Qwen3Config(**DIMS, head_dim=16, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**DIMS),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_equal_transformers(tmp_path, family):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).float().eval()
    # transformers initialises biases and norms to constants; randomise them so that they are exercised.
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "expected a sharded checkpoint"

    cfg, weights = load_model(tmp_path, torch.float32)
    assert cfg == ModelConfig.from_dir(tmp_path)
    model, comm = Transformer(cfg, weights), SoloCommunicator(0)
    shard = model.shard(1, 0)
    tokens = torch.randint(0, DIMS["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits[0]  # [T, vocab]
        kv = PagedKV(cfg, 17, 4, cfg.num_kv_heads, torch.float32)  # blocks of 4 tokens: 40 tokens span 10
        table = kv.tables_for(1, 64, 1).flip(-1)  # blocks out of order, as a paged cache hands them out
        # Prefill the first 30 tokens in one pass, then decode the rest one at a time through the cache.
        got = [model.forward(shard, comm, kv, tokens[:, :30], torch.tensor([0]), table[..., :8])[0]]
        for pos in range(30, 40):
            got.append(model.forward(shard, comm, kv, tokens[:, pos:pos + 1], torch.tensor([pos]),
                                     table[..., :pos // 4 + 1])[0])
        # A wider table (what a CUDA graph of a larger context bucket reads) changes nothing: the mask hides the rest.
        static = model.forward(shard, comm, kv, tokens[:, 39:40], torch.tensor([39]), table)[0]
    diff = max((g - e).abs().max().item() for g, e in zip(got, [expected[29], *expected[30:]]))
    assert diff < 1e-4, f"{family}: max |engine - transformers| = {diff}"
    assert (static - expected[39]).abs().max().item() < 1e-4
    # Negative control: a perturbed weight must break the comparison.
    weights["model.layers.1.mlp.down_proj.weight"].mul_(3.0)
    with torch.no_grad():
        kv.reset()
        bad = model.forward(shard, comm, kv, tokens[:, :30], torch.tensor([0]), kv.tables_for(1, 32, 1))[0]
    assert (bad - expected[29]).abs().max().item() > 1e-3
