"""Shards are views of the replica: switching TP copies no weight."""

import pytest

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
                    if t is not None:
                        assert t.untyped_storage().data_ptr() in storages, f"{name} at TP={tp} is a copy"
        # Together the shards cover every query row and every MLP column exactly once.
        assert sum(s.layers[0].wq.shape[0] for s in shards) == weights["model.layers.0.self_attn.q_proj.weight"].shape[0]
        assert sum(s.layers[0].w_down.shape[1] for s in shards) == cfg.intermediate_size
        assert [s.kv_head_start for s in shards] == [i * cfg.num_kv_heads // tp for i in range(tp)]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model.shard(8, 0)
