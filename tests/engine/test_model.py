"""Shards are views of the replica: switching TP copies no weight."""

import pytest
import torch
import torch.nn.functional as F

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


def test_prepacked_gemms_equal_f_linear_and_are_made_again_after_a_weight_update(tmp_path):
    """CPU steps run their GEMMs on oneDNN-prepacked copies of the weights: the same products as F.linear (within
    float32 rounding), kept per TP shard, and stale after a weight sync until weights_changed()."""
    from pat_workers.engine.model import mlp

    cfg, weights = load_model(make_tiny_model(tmp_path, seed=0))
    model = Transformer(cfg, weights)
    h = torch.randn(2, 8, cfg.hidden_size)  # 16 rows: the prepacked path (one row takes F.linear's GEMV)
    for tp, index in ((1, 0), (2, 1)):
        plain, packed = model.shard(tp, index).layers[0], model.shard(tp, index, prepack=True).layers[0]
        assert packed.packed is not None and plain.packed is None
        torch.testing.assert_close(mlp(packed, h), mlp(plain, h), atol=1e-5, rtol=1e-5)
    assert model.shard(2, 1, prepack=True).layers[0] is packed  # kept, not packed again per call
    down = weights["model.layers.0.mlp.down_proj.weight"]
    down.mul_(2)  # as a weight sync writes: in place
    plain = model.shard(1, 0).layers[0]
    stale = model.shard(1, 0, prepack=True).layers[0]
    assert not torch.allclose(mlp(stale, h), mlp(plain, h), atol=1e-3)  # the check can fail
    model.weights_changed()
    torch.testing.assert_close(mlp(model.shard(1, 0, prepack=True).layers[0], h), mlp(plain, h), atol=1e-5,
                               rtol=1e-5)


def test_paged_decode_attention_reads_each_rows_own_blocks():
    """Rows of different lengths over blocks in any order: the paged kernel equals attention over each row's own
    gathered keys; a row given another position attends to a different set (the check can fail)."""
    from pat_workers.engine.config import ModelConfig
    from pat_workers.engine.kv import PagedKV
    from pat_workers.engine.model import decode_mask, paged_decode_attention

    cfg = ModelConfig("llama", 320, 64, 160, 1, 8, 4, 16)
    bs, heads, rep = 4, 2, 2
    kv = PagedKV(cfg, 40, bs, heads, torch.float32, mask_rows=8)
    keys, values = kv.layer(0)
    g = torch.Generator().manual_seed(0)
    keys.copy_(torch.randn(keys.shape, generator=g))
    values.copy_(torch.randn(values.shape, generator=g))
    tables = torch.tensor([[7, 0, 0, 0], [3, 9, 2, 0], [12, 11, 10, 30], [5, 6, 0, 0]])
    positions = torch.tensor([2, 9, 15, 4])
    q = torch.randn(4, heads * rep, 1, 16, generator=g)
    got = paged_decode_attention(q, keys, values, *vars(decode_mask(kv, tables[:, None], positions)).values())

    def expected(row: int, position: int) -> torch.Tensor:
        slots = (tables[row, :, None] * bs + torch.arange(bs)).flatten()[:position + 1]
        return F.scaled_dot_product_attention(q[row:row + 1], keys[:, slots][None], values[:, slots][None],
                                              enable_gqa=True)[0]
    for row, position in enumerate(positions.tolist()):
        assert torch.allclose(got[row], expected(row, position), atol=1e-5)
    assert not torch.allclose(got[1], expected(1, 5), atol=1e-3)
