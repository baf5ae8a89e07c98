"""Sharded checkpoints (torch.distributed.checkpoint) round-trip model, optimizer and state, are atomic (a crash
leaves none or a whole one) and are pruned to the newest `keep`. Resharding onto another world size:
tests/trainer/test_fsdp.py."""

import random
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pat_workers.trainer import checkpoint
from pat_workers.trainer.data import PromptSampler
from tests.engine.multiproc import run_ranks


def sharded_model(world: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def round_trip(rank, world, root):
    model, optimizer = sharded_model(world, seed=1)
    sampler = PromptSampler(10, seed=1)
    sampler.next_batch(7)
    random.seed(3)
    torch.manual_seed(3)
    state = {"rng": checkpoint.rng_state(), "sampler": sampler.state_dict(), "history": [1, 2]}
    draws = (random.random(), torch.rand(3))
    path = checkpoint.save(root, 10, model, optimizer, state=state, keep=2)
    fresh, fresh_optimizer = sharded_model(world, seed=2)  # other weights, other moments
    before = full(fresh)
    loaded = checkpoint.load(path, fresh, fresh_optimizer)
    resumed = PromptSampler(10, seed=1)
    resumed.load_state_dict(loaded["sampler"])
    random.random(), torch.rand(3)  # move the generators on
    checkpoint.set_rng_state(loaded["rng"])
    return {"path": path, "iteration": loaded["iteration"], "history": loaded["history"],
            "weights": (full(model), full(fresh), before),
            "moments": [(a["exp_avg"].full_tensor(), b["exp_avg"].full_tensor())
                        for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values())],
            "sampler": (resumed.next_batch(5), sampler.next_batch(5)),
            "draws": (draws, (random.random(), torch.rand(3)))}


def test_round_trip_on_two_ranks(tmp_path):
    out, _ = run_ranks(round_trip, 2, tmp_path, timeout=120)
    assert out["path"] == tmp_path / "iter-000010" and checkpoint.latest(tmp_path) == out["path"]
    assert out["iteration"] == 10 and out["history"] == [1, 2]
    saved, loaded, before = out["weights"]
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    assert any(not torch.equal(saved[n], before[n]) for n in saved)  # the load changed them
    assert all(torch.equal(a, b) for a, b in out["moments"]) and out["moments"]
    assert out["sampler"][0] == out["sampler"][1]
    (first, first_t), (again, again_t) = out["draws"]
    assert first == again and torch.equal(first_t, again_t)
    assert set(checkpoint.load_weights(out["path"])) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert torch.equal(checkpoint.load_weights(out["path"])["1.weight"], saved["1.weight"])


def save_many(rank, world, root, iterations, keep, fail_at=None):
    model, optimizer = sharded_model(world, seed=0)
    for it in iterations:
        if it == fail_at:
            with mock.patch.object(checkpoint.os, "replace", side_effect=OSError("disk full")):
                with pytest.raises(OSError, match="disk full"):
                    checkpoint.save(root, it, model, optimizer, state={}, keep=keep)
            return sorted(p.name for p in root.iterdir())
        checkpoint.save(root, it, model, optimizer, state={"at": it}, keep=keep)
    return sorted(p.name for p in root.iterdir())


def test_a_crash_leaves_no_partial_checkpoint(tmp_path):
    (names,) = run_ranks(save_many, 1, tmp_path, [5, 10], 3, 10, timeout=60)
    # Iteration 10 was written but never renamed into place: a temp folder, which latest() ignores.
    assert names == [".tmp-iter-000010", "iter-000005"] and checkpoint.latest(tmp_path) == tmp_path / "iter-000005"
    (names,) = run_ranks(save_many, 1, tmp_path, [15], 3, timeout=60)  # the next save clears the leftovers
    assert names == ["iter-000005", "iter-000015"]


def test_keep_prunes_the_oldest(tmp_path):
    (names,) = run_ranks(save_many, 1, tmp_path, [5, 10, 15, 100], 2, timeout=60)
    assert names == ["iter-000015", "iter-000100"]
    # Saving an iteration again (a run resumed from an older checkpoint) replaces it whole.
    (names,) = run_ranks(save_many, 1, tmp_path, [15], 2, timeout=60)
    assert names == ["iter-000015", "iter-000100"]
    assert torch.load(tmp_path / "iter-000015" / checkpoint.STATE_FILE, weights_only=True)["at"] == 15
    assert checkpoint.latest(tmp_path / "absent") is None
    with pytest.raises(ValueError, match="keep=0"):
        checkpoint.save(tmp_path, 200, None, None, state={}, keep=0)
