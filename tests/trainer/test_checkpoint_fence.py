"""Checkpoint writes fenced by gang attempt: a trainer of attempt 1 that still runs after attempt 2 has started (cut off
from the operator) writes no checkpoint over attempt 2's, neither a save it begins nor one it had begun; attempt 2's
saves work. Negative control: a trainer that claims nothing (no PAT_ATTEMPT, or an older release) fences nothing."""

import pytest
import torch

from pat_workers.trainer import checkpoint
from tests.engine.multiproc import run_ranks
from tests.trainer.test_checkpoint import full, gated_writes, sharded_model


def attempts(rank, world, root, newer_claims):
    """Attempt 1 saves, attempt 2 starts (claiming root when `newer_claims`), then attempt 1 saves again, once with a
    save it begins after attempt 2 started and once with one it began before; then attempt 2 saves."""
    model, optimizer = sharded_model(world, seed=1)
    old = checkpoint.Checkpointer(root, keep=5, attempt=1)
    old.save(5, model, optimizer, state={"by": 1})
    old.wait()
    gate = root / "gate"
    with gated_writes(gate):
        old.save(10, model, optimizer, state={"by": 1})  # begun by attempt 1, written after attempt 2 started
        new = checkpoint.Checkpointer(root, keep=5, attempt=2 if newer_claims else None)
        gate.touch()
        refused = []
        try:
            old.wait()
        except checkpoint.StaleAttempt as e:
            refused.append(str(e))
    try:
        old.save(15, model, optimizer, state={"by": 1})  # begun after attempt 2 started
        old.wait()
    except checkpoint.StaleAttempt as e:
        refused.append(str(e))
    after_old = sorted(p.name for p in root.iterdir() if p.name.startswith("iter-"))
    new.save(20, model, optimizer, state={"by": 2})
    new.wait()
    return {"refused": refused, "after_old": after_old, "latest": checkpoint.latest(root).name,
            "by": {p.name: torch.load(p / checkpoint.STATE_FILE, weights_only=True)["by"]
                   for p in root.iterdir() if p.name.startswith("iter-")}}


@pytest.mark.slow
def test_an_older_attempt_writes_no_checkpoint_once_a_newer_one_started(tmp_path):
    (out,) = run_ranks(attempts, 1, tmp_path, True, timeout=120)
    assert len(out["refused"]) == 2, out
    for message, iteration in zip(out["refused"], (10, 15)):
        assert f"checkpoint of iteration {iteration} refused" in message and "attempt 2" in message, message
        assert "not this trainer's (attempt 1)" in message, message
    assert out["after_old"] == ["iter-000005"]  # attempt 1's only checkpoint is the one from before attempt 2
    assert out["latest"] == "iter-000020" and out["by"] == {"iter-000005": 1, "iter-000020": 2}


@pytest.mark.slow
def test_without_a_claim_saves_go_on_as_before(tmp_path):
    (out,) = run_ranks(attempts, 1, tmp_path, False, timeout=120)  # the second trainer claims nothing
    assert out["refused"] == [] and out["after_old"] == ["iter-000005", "iter-000010", "iter-000015"]
    assert out["by"] == {"iter-000005": 1, "iter-000010": 1, "iter-000015": 1, "iter-000020": 2}


def unclaimed(rank, world, root):
    checkpoint.Checkpointer(root, keep=1)
    return sorted(p.name for p in root.iterdir())


@pytest.mark.slow
def test_no_attempt_no_claim(tmp_path):
    assert run_ranks(unclaimed, 1, tmp_path, timeout=60) == [[]]


@pytest.mark.parametrize("content", [None, "{not json"])
def test_a_missing_or_broken_claim_refuses(tmp_path, content):
    fence = checkpoint.Fence.take(tmp_path, 3)
    fence.check("a save")
    owner = tmp_path / checkpoint.OWNER_FILE
    owner.unlink() if content is None else owner.write_text(content)
    with pytest.raises(checkpoint.StaleAttempt, match=r"a save refused: .* holds no claim .*attempt 3"):
        fence.check("a save")


def fenced_on_two_ranks(rank, world, root):
    model, optimizer = sharded_model(world, seed=1)
    checkpointer = checkpoint.Checkpointer(root, keep=1, attempt=7)
    checkpointer.save(5, model, optimizer, state={"by": 7})
    checkpointer.wait()
    fresh, fresh_optimizer = sharded_model(world, seed=2)
    loaded = checkpoint.load(checkpoint.latest(root), fresh, fresh_optimizer)
    return {"claim": checkpointer.fence.claim, "by": loaded["by"], "equal": all(
        torch.equal(a, b) for a, b in zip(full(model).values(), full(fresh).values()))}


@pytest.mark.slow
def test_every_rank_writes_into_the_claims_folder(tmp_path):
    """Rank 0 claims, and every rank writes its shards into that claim's temp folder: a whole checkpoint."""
    first, second = run_ranks(fenced_on_two_ranks, 2, tmp_path, timeout=120)
    assert first["claim"] == second["claim"] and first["by"] == 7 and first["equal"] and second["equal"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.OWNER_FILE, "iter-000005"]
