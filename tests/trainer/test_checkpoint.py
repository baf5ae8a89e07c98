"""Checkpoints round-trip, are atomic (a crash leaves none or a whole one) and are pruned to the newest `keep`."""

import random

import pytest
import torch

from pat_workers.trainer import checkpoint
from pat_workers.trainer.data import PromptSampler


def training_state():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sampler = PromptSampler(10, seed=1)
    sampler.next_batch(7)
    return model, optimizer, sampler


def save(root, iteration, keep=3, **overrides):
    model, optimizer, sampler = training_state()
    kwargs = dict(weights=dict(model.named_parameters()), optimizer_state=optimizer.state_dict(),
                  rng=checkpoint.rng_state(), sampler_state=sampler.state_dict(),
                  extra={"reward_mean": 0.5, "history": [1, 2]}, keep=keep)
    return checkpoint.save(root, iteration, **{**kwargs, **overrides})


def test_round_trip(tmp_path):
    model, optimizer, sampler = training_state()
    random.seed(3)
    torch.manual_seed(3)
    rng = checkpoint.rng_state()
    expected_draws = (random.random(), torch.rand(3))
    path = save(tmp_path, 10, weights=dict(model.named_parameters()), optimizer_state=optimizer.state_dict(),
                rng=rng, sampler_state=sampler.state_dict())
    assert path == tmp_path / "iter-000010" and checkpoint.latest(tmp_path) == path

    loaded = checkpoint.load(path)
    assert loaded.iteration == 10 and loaded.extra == {"reward_mean": 0.5, "history": [1, 2]}
    assert all(torch.equal(loaded.weights[n], p.detach()) for n, p in model.named_parameters())
    fresh_model = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    fresh_optimizer.load_state_dict(loaded.optimizer_state)
    exp_avg = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, optimizer.state_dict()["state"][0]["exp_avg"])
    resumed = PromptSampler(10, seed=1)
    resumed.load_state_dict(loaded.sampler_state)
    assert resumed.next_batch(5) == sampler.next_batch(5)
    random.random(), torch.rand(3)  # move the generators on
    checkpoint.set_rng_state(loaded.rng)
    draws = (random.random(), torch.rand(3))
    assert draws[0] == expected_draws[0] and torch.equal(draws[1], expected_draws[1])


def test_a_crash_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    first = save(tmp_path, 5)
    # A process killed mid-write leaves its temp dir behind: latest() ignores it.
    leftover = tmp_path / ".tmp-crashed"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) == first

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 10)
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-crashed", "iter-000005"]
    # The next save clears the leftovers.
    newest = save(tmp_path, 15)
    assert checkpoint.latest(tmp_path) == newest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000005", "iter-000015"]


def test_keep_prunes_the_oldest(tmp_path):
    for iteration in (5, 10, 15, 100):
        save(tmp_path, iteration, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000015", "iter-000100"]
    # Saving an iteration again (a run resumed from an older checkpoint) replaces it whole.
    save(tmp_path, 15, keep=2, extra={"again": True})
    assert checkpoint.load(tmp_path / "iter-000015").extra == {"again": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000015", "iter-000100"]
    assert checkpoint.latest(tmp_path / "absent") is None
    with pytest.raises(ValueError, match="keep=0"):
        save(tmp_path, 200, keep=0)
