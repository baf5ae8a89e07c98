"""Placement colocated at the pod: this test process stands for the trainer ranks on the pod's two devices. Weights
are handed over inside the pod (weightsync.DeviceSender, one per device, to the engine rank of that device) with no
weight-sync group; between batches the pod sleeps (its ranks give back their KV pools, at level 2 their weights too)
and wakes up, round after round, without its memory growing."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist

from pat_workers.engine.loader import load_weights
from pat_workers.engine.tiny import make_tiny_model, random_weights
from pat_workers.weightsync import DeviceSender, WeightSyncError, handover_address

from .conftest import MODEL_SEED, TOKEN, Pod, Reference, long_tailed, mismatched
from .test_weights import _wait_version

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

MIB = 1 << 20
POOL_BYTES = 64 * MIB  # each rank's KV pool in the memory test: above glibc's largest mmap threshold


def hand_over(senders: list[DeviceSender], weights: dict[str, torch.Tensor], version: int) -> list[BaseException]:
    """Both devices' trainer ranks hand over at once, as the trainer's ranks do; returns what each raised."""
    errors: list[BaseException] = []

    def one(sender: DeviceSender) -> None:
        try:
            sender.send({n: t.shape for n, t in weights.items()}, sorted(weights.items()), version,
                        agree=lambda refused: int(refused), bucket_bytes=64 << 10)  # many buckets
        except BaseException as e:  # noqa: BLE001 -- reported to the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_weights_handed_over_inside_the_pod_change_what_it_generates_with_no_weight_sync_group(
        operator_pod, model_dir, reference, monkeypatch):
    def no_group(*args, **kwargs):
        raise AssertionError("a weight-sync group was created: the hand-over must not use the network")

    for name in ("TCPStore", "ProcessGroupGloo", "PrefixStore"):  # what a weight-sync group is built from
        monkeypatch.setattr(dist, name, no_group)
    pod, address = operator_pod, handover_address(TOKEN)
    senders = [DeviceSender(address, rank, TOKEN) for rank in range(2)]
    new_weights = random_weights(json.loads((model_dir / "config.json").read_text()), seed=MODEL_SEED + 2)
    requests = long_tailed(6, long=30, tag="colocated")
    new_reference = Reference(model_dir, new_weights)(requests)
    v = pod.state()["policy_version"]
    try:
        # A round for the wrong version is refused by both ranks before a byte moves: the pod keeps its weights.
        pod.ok("POST", "/v1/weights", {"version": v + 1, "transport": "device", "address": address}, 202)
        errors = hand_over(senders, new_weights, v + 2)
        assert len(errors) == 2 and all(isinstance(e, WeightSyncError) for e in errors), errors
        assert "expects version" in str(errors[0])
        pod.submit_after_weights("colocated-old", requests, v)
        old = pod.finish("colocated-old")
        assert pod.state()["policy_version"] == v
        assert mismatched(old, new_reference) != []  # negative control: the old weights generate otherwise

        pod.ok("POST", "/v1/weights", {"version": v + 1, "transport": "device", "address": address}, 202)
        assert hand_over(senders, new_weights, v + 1) == []
        _wait_version(pod, v + 1)
        completions = pod.generate("colocated-new", requests, v + 1)
        assert mismatched(completions, new_reference) == []
    finally:  # the shared pod goes back to the model directory's weights for the tests after this one
        pod.ok("POST", "/v1/weights", {"version": v + 2, "transport": "device", "address": address}, 202)
        assert hand_over(senders, load_weights(model_dir, torch.float32), v + 2) == []
        _wait_version(pod, v + 2)
        for s in senders:
            s.close()
    assert mismatched(pod.generate("colocated-back", requests, v + 2), reference(requests)) == []


@pytest.fixture(scope="module")
def weighty_model_dir(tmp_path_factory):
    """The test preset widened so that each rank's replica (25 MiB) is made of tensors of 1 MiB or more, which the
    ranks allocate with pages of their own (rank._return_freed_memory): releasing them shows in the resident set."""
    return make_tiny_model(tmp_path_factory.mktemp("weighty-model"), family="llama", preset="test", seed=MODEL_SEED,
                           hidden_size=512, intermediate_size=1536)


@pytest.fixture(scope="module")
def sleepy_pod(weighty_model_dir, tmp_path_factory):
    """A pod whose ranks each hold a 64 MiB KV pool (long enough sequences that maxBatch does not cap it)."""
    pod = Pod("sleepy", weighty_model_dir, tmp_path_factory.mktemp("sleepy-pod"), "--controller", "operator",
              "--kv-cache-bytes", str(POOL_BYTES), "--max-seq", "8192", "--max-batch", "16",
              env={"PAT_JOB_TOKEN": TOKEN})
    try:
        pod.wait_ready()
        yield pod
    finally:
        assert pod.stop() == 0


def test_a_sleeping_pod_gives_its_kv_pools_back_and_takes_them_again_round_after_round(sleepy_pod, weighty_model_dir):
    """Ten rounds of generate, sleep, wake up: each sleep gives back (nearly) the whole pool of each rank, as the
    ranks' resident memory shows, and the memory a rank holds awake does not grow. Asleep, the pod takes no batch;
    awake, it generates the same tokens as before."""
    pod = sleepy_pod
    requests = long_tailed(4, long=20, tag="sleep")
    expected = Reference(weighty_model_dir)(requests)
    held, released = [], []
    for i in range(10):
        assert mismatched(pod.generate(f"sleep-{i}", requests, pod.state()["policy_version"]), expected) == []
        asleep = pod.ok("POST", "/v1/sleep")
        assert asleep["memory"] == "released" and len(asleep["memory_bytes"]) == 2
        status, reply = pod.call("POST", "/v1/rollouts", {"batch_id": f"asleep-{i}", "policy_version": 0,
                                                          "requests": requests})
        assert status == 409 and "POST /v1/wake_up" in reply["error"], reply
        awake = pod.ok("POST", "/v1/wake_up")
        assert awake["memory"] == "held"
        released.append(asleep["memory_bytes"])
        held.append(awake["memory_bytes"])
    for rank in range(2):
        freed = [h[rank] - r[rank] for h, r in zip(held, released)]
        assert min(freed) > 0.9 * POOL_BYTES, f"rank {rank} freed {[f >> 20 for f in freed]} MiB"
        growth = max(h[rank] for h in held) - held[0][rank]
        assert growth < 16 * MIB, f"rank {rank}: held memory grew {growth >> 20} MiB over 10 rounds"


def test_a_pod_asleep_at_level_2_gives_its_weights_back_and_wakes_only_once_new_ones_are_handed_over(
        sleepy_pod, weighty_model_dir):
    """Level 1 keeps the weights (the negative control); level 2 gives them back too, as each rank's resident memory
    shows. Until the next version is handed over, the pod refuses to wake up and to regroup; after it, it generates
    what the new weights generate, round after round."""
    pod, address = sleepy_pod, handover_address(TOKEN)
    config = json.loads((weighty_model_dir / "config.json").read_text())
    replica = sum(t.numel() * t.element_size() for t in load_weights(weighty_model_dir, torch.float32).values())
    requests = long_tailed(4, long=20, tag="level-2")
    senders = [DeviceSender(address, rank, TOKEN) for rank in range(2)]
    status, reply = pod.call("POST", "/v1/sleep?level=3")
    assert status == 422 and "level" in reply["error"], reply
    try:
        for i in range(3):
            v = pod.state()["policy_version"]
            pod.generate(f"before-level-2-{i}", requests, v)  # every page of the weights touched
            kept = pod.ok("POST", "/v1/sleep?level=1")
            assert kept["weights"] == "held"
            pod.ok("POST", "/v1/wake_up")
            released = pod.ok("POST", "/v1/sleep?level=2")
            assert released["memory"] == "released" and released["weights"] == "released"
            freed = [a - b for a, b in zip(kept["memory_bytes"], released["memory_bytes"])]
            assert min(freed) > 0.9 * replica, f"level 2 freed {[f >> 20 for f in freed]} MiB of {replica >> 20} MiB"

            status, reply = pod.call("POST", "/v1/wake_up")
            assert status == 409 and "POST /v1/weights" in reply["error"], reply
            status, reply = pod.call("POST", "/v1/regroup", {"layout": [2], "epoch": pod.state()["epoch"] + 1})
            assert status == 409 and "POST /v1/wake_up" in reply["error"], reply

            weights = random_weights(config, seed=MODEL_SEED + 10 + i)
            pod.ok("POST", "/v1/weights", {"version": v + 1, "transport": "device", "address": address}, 202)
            assert hand_over(senders, weights, v + 1) == []
            _wait_version(pod, v + 1)
            assert pod.ok("POST", "/v1/wake_up")["weights"] == "held"
            expected = Reference(weighty_model_dir, weights)(requests)
            assert mismatched(pod.generate(f"after-level-2-{i}", requests, v + 1), expected) == []
    finally:
        for s in senders:
            s.close()
