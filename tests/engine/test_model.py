"""Shards are views of the replica: switching TP copies no weight."""

import pytest
import torch

from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import make_tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_shards_are_views_that_tile_the_replica(tmp_path, family):
    cfg, weights = load_model(make_tiny_model(tmp_path, family=family, seed=0))
    model = Transformer(cfg, weights)
    storages = {t.untyped_storage().data_ptr() for t in weights.values()}
    for tp in (1, 2, 4):
        shards = [model.shard(tp, i) for i in range(tp)]
        for shard in shards:
            for layer in shard.layers:
                for name, t in vars(layer).items():
                    if isinstance(t, torch.Tensor):
                        assert t.untyped_storage().data_ptr() in storages, f"{name} at TP={tp} is a copy"
                # The fused rows of a shard are one contiguous slice at every TP size: one GEMM, no gather.
                assert layer.wqkv.is_contiguous() and layer.w_gate_up.is_contiguous()
        # Together the shards cover every q, k and v row and every MLP column exactly once.
        qkv_rows = sum(weights[f"model.layers.0.self_attn.{n}_proj.weight"].flatten(0, -2).shape[0] for n in "qkv")
        assert sum(s.layers[0].wqkv.shape[0] for s in shards) == qkv_rows
        assert sum(s.layers[0].w_down.shape[1] for s in shards) == cfg.intermediate_size
        assert [s.kv_head_start for s in shards] == [i * cfg.num_kv_heads // tp for i in range(tp)]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model.shard(8, 0)


def test_weight_updates_write_through_the_fused_layout(tmp_path):
    """A weight sync copies into the Hugging Face names: they are views of the fused tensors, so a shard sees it."""
    cfg, weights = load_model(make_tiny_model(tmp_path, seed=0))
    model = Transformer(cfg, weights)
    shard = model.shard(2, 1)
    before = shard.layers[1].wqkv.clone()
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    k.copy_(torch.ones(k.numel()).view_as(k))  # as weightsync writes: part.view_as(weights[name])
    changed = (shard.layers[1].wqkv != before).any(-1)
    # Rank 1 of TP=2 holds the second half of the KV heads: exactly those k rows changed, nothing else.
    hq, hkv, d = cfg.num_heads // model.chunks, cfg.num_kv_heads // model.chunks, cfg.head_dim
    chunk = (hq + 2 * hkv) * d
    expected = torch.zeros(shard.layers[1].wqkv.shape[0], dtype=torch.bool).view(-1, chunk)
    expected[:, hq * d:(hq + hkv) * d] = True
    assert torch.equal(changed, expected.flatten())
    assert (shard.layers[1].wqkv[changed] == 1).all()
