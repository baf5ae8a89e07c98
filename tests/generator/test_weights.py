"""Weight sync: this test process is the trainer's rank 0 (WeightSender) and broadcasts new weights to the
pod's two ranks through a real gloo group; the pod then generates what the new weights generate."""

import json
import multiprocessing as mp
import time

import pytest
import torch

from pat_workers.engine.loader import load_weights
from pat_workers.engine.tiny import random_weights
from pat_workers.weightsync import WeightReceiver, WeightSender, WeightSyncError, buckets

from .conftest import MODEL_SEED, Reference, long_tailed, mismatched


def send(sender: WeightSender, weights: dict[str, torch.Tensor], version: int, **kwargs) -> None:
    sender.send({name: t.shape for name, t in weights.items()}, sorted(weights.items()), version, **kwargs)


def test_buckets_group_consecutive_tensors_within_the_limit():
    tensors = [["a", [2, 2]], ["b", [3]], ["c", [10]], ["d", [1]], ["e", [1]]]
    assert buckets(tensors, itemsize=4, limit=32) == [[0, 1], [2], [3, 4]]  # c (40 bytes) goes alone
    assert buckets(tensors, itemsize=2, limit=1 << 20) == [[0, 1, 2, 3, 4]]


def _wait_version(pod, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while pod.state()["policy_version"] != version:
        assert time.monotonic() < deadline, f"policy_version is not {version} after {timeout} s: {pod.state()}"
        time.sleep(0.02)


def test_weight_update_changes_what_the_pod_generates(operator_pod, model_dir, reference):
    pod = operator_pod
    old_weights = load_weights(model_dir, torch.float32)
    new_weights = random_weights(json.loads((model_dir / "config.json").read_text()), seed=MODEL_SEED + 1)
    requests = long_tailed(6, long=30, tag="w")
    old_reference, new_reference = reference(requests), Reference(model_dir, new_weights)(requests)
    v = pod.state()["policy_version"]
    sender = WeightSender("127.0.0.1:0", world=3)
    update = {"address": sender.address, "world": 3, "rank_offset": 1, "backend": "gloo"}
    try:
        state = pod.ok("POST", "/v1/weights", {**update, "version": v + 1}, 202)
        assert state["policy_version"] == v  # not before every rank holds the new weights
        for method, path, body in (("POST", "/v1/rollouts", {"batch_id": "early", "policy_version": v,
                                                              "requests": requests}),
                                   ("POST", "/v1/regroup", {"epoch": state["epoch"] + 1, "layout": [2]}),
                                   ("POST", "/v1/weights", {**update, "version": v + 2})):
            status, reply = pod.call(method, path, body)
            assert status == 409 and f"receiving the weights of version {v + 1}" in reply["error"], (path, reply)
        send(sender, new_weights, v + 1, bucket_bytes=64 << 10)  # many buckets, some of one tensor
        _wait_version(pod, v + 1)
        assert pod.metrics()[("pat_generator_policy_version", ())] == v + 1

        completions = pod.generate("new", requests, v + 1)
        assert mismatched(completions, new_reference) == []
        assert all(c["policy_version"] == v + 1 for c in completions)
        assert len(mismatched(completions, old_reference)) == len(requests)  # negative control
        status, reply = pod.call("POST", "/v1/rollouts", {"batch_id": "stale", "policy_version": v,
                                                          "requests": requests})
        assert status == 409 and f"the pod holds version {v + 1}" in reply["error"], reply
        status, reply = pod.call("POST", "/v1/weights", {**update, "version": v + 1})
        assert status == 409 and "not newer" in reply["error"], reply

        # A round the receivers refuse (a tensor is missing) moves nothing: the pod keeps version v + 1.
        pod.ok("POST", "/v1/weights", {**update, "version": v + 2}, 202)
        partial = {k: t for k, t in old_weights.items() if k != "lm_head.weight"}
        with pytest.raises(WeightSyncError, match=r"missing \['lm_head.weight'\]"):
            send(sender, partial, v + 2)
        pod.submit_after_weights("x", requests[:1], v + 1)
        pod.finish("x")
        assert pod.state()["policy_version"] == v + 1

        # The same cached group carries the next round: the original weights come back.
        pod.ok("POST", "/v1/weights", {**update, "version": v + 2}, 202)
        send(sender, old_weights, v + 2)
        _wait_version(pod, v + 2)
        assert mismatched(pod.generate("old-again", requests, v + 2), old_reference) == []
    finally:
        sender.close()


def _receive_in_bfloat16(address: str, results) -> None:
    weights = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, 2, dtype=torch.bfloat16)}
    receiver = WeightReceiver(address, world=2, rank=1)
    try:
        receiver.receive(weights, version=2)  # the sender's round carries version 1
        refused = None
    except WeightSyncError as e:
        refused = str(e)
    untouched = all(not t.any() for t in weights.values())
    receiver.receive(weights, version=1)
    results.put((refused, untouched, {name: t.float() for name, t in weights.items()}))


@pytest.mark.slow
def test_sender_casts_to_the_receivers_dtype_and_a_refused_round_moves_nothing():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sender = WeightSender("127.0.0.1:0", world=2)
    receiver = ctx.Process(target=_receive_in_bfloat16, args=(sender.address, results), daemon=True)
    receiver.start()
    try:
        weights = {"a": torch.tensor([1.0, 2.5, 1 / 3]), "b": torch.randn(2, 2, requires_grad=True)}
        with pytest.raises(WeightSyncError, match="the trainer sent version 1, this pod expects version 2"):
            send(sender, weights, 1)
        send(sender, weights, 1)
        refused, untouched, received = results.get(timeout=60)
    finally:
        sender.close()
        receiver.join(10)
    assert "expects version 2" in refused and untouched
    for name, t in weights.items():
        assert torch.equal(received[name], t.detach().to(torch.bfloat16).float()), name
    assert not torch.equal(received["a"], weights["a"])  # 1/3 is not a bfloat16: the values were cast
