"""A weight-sync group formed anew at the same address (the trainer replaces its group when a generator pod restarted;
with a fixed --weight-port the new store listens where the old one did): a receiver that keeps its WeightReceiver (as
a pod's engine rank does, per address) follows the store's new group id into the new group. Negative control: senders
that set no group id (an older trainer) leave the receiver in the old group, whose store is gone; that round fails
before any tensor moved, as a WeightSyncError with the receiver's weights unchanged (the pod lives on)."""

import multiprocessing as mp

import pytest
import torch

from pat_workers.ports import free_port
from pat_workers.weightsync import GROUP_KEY, WeightReceiver, WeightSender, WeightSyncError

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

TIMEOUT = 5.0


def _receive_rounds(address: str, versions, results) -> None:
    """Joins a round for each version put in `versions` (as a pod does on POST /v1/weights, which the trainer sends
    once the round's group exists), until None."""
    receiver = WeightReceiver(address, world=2, rank=1, timeout=TIMEOUT)  # kept for every round, as a pod keeps it
    weights = {"w": torch.zeros(3)}
    for version in iter(versions.get, None):
        try:
            receiver.receive(weights, version)
            results.put(("received", weights["w"].tolist()))
        except WeightSyncError as e:
            results.put((str(e), weights["w"].tolist()))


@pytest.mark.parametrize("group_ids", [True, False])
def test_a_receiver_follows_a_group_formed_anew_at_the_same_address(group_ids):
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    versions, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receive_rounds, args=(address, versions, results), daemon=True)
    receiver.start()
    outcomes, sent = [], []
    try:
        for version, values in ((1, [1.0, 2.0, 3.0]), (2, [4.0, 5.0, 6.0])):
            sender = WeightSender(address, world=2, timeout=TIMEOUT)
            if not group_ids:
                sender.store.delete_key(GROUP_KEY)
            versions.put(version)
            try:
                sender.send({"w": (3,)}, [("w", torch.tensor(values))], version)
                sent.append(version)
            except RuntimeError:  # the receiver never joined this group
                pass
            outcomes.append(results.get(timeout=60))
            sender.close()  # the next sender's store listens at the same port
    finally:
        versions.put(None)
        receiver.join(30)
    assert outcomes[0] == ("received", [1.0, 2.0, 3.0])
    if group_ids:
        assert sent == [1, 2] and outcomes[1] == ("received", [4.0, 5.0, 6.0])
    else:
        why, held = outcomes[1]
        assert sent == [1] and held == [1.0, 2.0, 3.0], outcomes  # nothing moved
        assert f"the weight-sync group at {address} failed before any weight moved" in why, why
