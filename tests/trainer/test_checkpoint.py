"""Sharded checkpoints (torch.distributed.checkpoint) round-trip model, optimizer and state, are atomic (a crash
leaves none or a whole one) and are pruned to the newest `keep`; the Checkpointer writes them while training goes
on. Resharding onto another world size: tests/trainer/test_fsdp.py."""

import os
import random
import signal
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pat_workers.trainer import checkpoint
from pat_workers.trainer.data import PromptSampler
from tests.engine.multiproc import run_ranks

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)


def sharded_model(world: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model, optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


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


def gated_writes(gate):
    """Every rank's DCP write waits until the file `gate` exists: a write that lasts as long as the test wants."""
    write_data = FileSystemWriter.write_data

    def gated(self, plan, planner):
        while not gate.exists():
            time.sleep(0.01)
        return write_data(self, plan, planner)
    return mock.patch.object(FileSystemWriter, "write_data", gated)


def save_while_training(rank, world, root):
    model, optimizer = sharded_model(world, seed=1)
    checkpointer = checkpoint.Checkpointer(root, keep=2)
    checkpointer.save(5, model, optimizer, state={"at": 5})
    checkpointer.wait()
    gate = root / "gate"
    with gated_writes(gate):
        saved = full(model)
        checkpointer.save(10, model, optimizer, state={"at": 10})  # returns although no rank can have written
        in_flight = checkpoint.latest(root)
        train_step(model, optimizer)  # FSDP's collectives while DCP's run in the writing thread
        dist.barrier()  # every rank has looked before the write may finish
        if rank == 0:
            gate.touch()
        checkpointer.wait()
    fresh, fresh_optimizer = sharded_model(world, seed=2)
    loaded = checkpoint.load(checkpoint.latest(root), fresh, fresh_optimizer)
    return {"in_flight": in_flight, "after": checkpoint.latest(root), "at": loaded["at"],
            "weights": (saved, full(model), full(fresh))}


def test_the_checkpointer_writes_the_state_at_save_while_training_goes_on(tmp_path):
    out, _ = run_ranks(save_while_training, 2, tmp_path, timeout=120)
    assert out["in_flight"] == tmp_path / "iter-000005"  # the one being written counts only once complete
    assert out["after"] == tmp_path / "iter-000010" and out["at"] == 10
    saved, trained, loaded = out["weights"]
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)  # what the model held when save() was called,
    assert all(not torch.equal(saved[n], trained[n]) for n in saved)  # not what the next step made of it


def time_saves(rank, world, root, delay):
    """Seconds each save call takes while the write waits `delay` s for its gate: the Checkpointer's, then save()'s."""
    model, optimizer = sharded_model(world, seed=1)
    checkpointer = checkpoint.Checkpointer(root, keep=2)
    saves = {"background": lambda: checkpointer.save(5, model, optimizer, state={}),
             "synchronous": lambda: checkpoint.save(root, 10, model, optimizer, state={}, keep=2)}
    seconds = {}
    for name, save in saves.items():
        gate = root / f"gate-{name}"
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            threading.Timer(delay, gate.touch).start()
        with gated_writes(gate):
            save()
            seconds[name] = time.perf_counter() - start
            checkpointer.wait()
    return seconds


def test_saving_in_the_background_takes_no_time_of_the_write(tmp_path):
    delay = 1.0
    for seconds in run_ranks(time_saves, 2, tmp_path, delay, timeout=120):
        assert seconds["background"] < delay <= seconds["synchronous"], seconds


def killed_while_writing(rank, world, root):
    model, optimizer = sharded_model(world, seed=1)
    checkpointer = checkpoint.Checkpointer(root, keep=2)
    checkpointer.save(5, model, optimizer, state={"at": 5})
    checkpointer.wait()
    with gated_writes(root / "gate"):  # never opened
        train_step(model, optimizer)
        checkpointer.save(10, model, optimizer, state={"at": 10})
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


def resume(rank, world, root):
    expected = full(sharded_model(world, seed=1)[0])
    model, optimizer = sharded_model(world, seed=2)
    loaded = checkpoint.load(checkpoint.latest(root), model, optimizer)
    weights = full(model)
    checkpoint.save(root, 15, model, optimizer, state={}, keep=2)
    return {"at": loaded["at"], "equal": all(torch.equal(expected[n], weights[n]) for n in expected),
            "names": sorted(p.name for p in root.iterdir())}


def test_a_process_killed_while_writing_leaves_the_checkpoint_before(tmp_path):
    assert run_ranks(killed_while_writing, 2, tmp_path, timeout=120) == [None, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-iter-000010", "iter-000005"]
    assert checkpoint.latest(tmp_path) == tmp_path / "iter-000005"
    out, _ = run_ranks(resume, 2, tmp_path, timeout=120)
    assert out["at"] == 5 and out["equal"]
    assert out["names"] == ["iter-000005", "iter-000015"]  # the next save clears the temp folder
