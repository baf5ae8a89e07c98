"""Who may call a pod and where it takes weights from, against a real pod process (access_pod): the inference
token rolls out and nothing else, the control token does everything, and POST /v1/weights takes only the job's
own store (--weights-store, a DNS name resolved when the update comes)."""

import time

import torch

from pat_workers.engine.loader import load_weights
from pat_workers.weightsync import WeightSender, handover_address

from .conftest import CONTROL_TOKEN, INFERENCE_TOKEN, TOKEN, WEIGHTS_STORE, rollout

NEEDS_CONTROL = [("POST", "/v1/regroup", {"epoch": 1, "layout": [1]}),
                 ("POST", "/v1/weights", {"version": 1, "address": "127.0.0.1:1", "world": 2, "rank_offset": 1}),
                 ("POST", "/v1/sleep", None), ("POST", "/v1/wake_up", None), ("GET", "/v1/state", None)]


def _state(pod) -> dict:
    status, state = pod.call("GET", "/v1/state", token=CONTROL_TOKEN)
    assert status == 200, state
    return state


def _roll_out(pod, batch_id: str, token: str) -> list[dict]:
    version = _state(pod)["policy_version"]
    status, reply = pod.call("POST", "/v1/rollouts", {"batch_id": batch_id, "policy_version": version,
                                                      "requests": [rollout(f"{batch_id}-0", [256, 3], 5)]}, token=token)
    assert status == 202, reply
    status, reply = pod.call("GET", f"/v1/rollouts/{batch_id}?wait=30", token=token)
    assert status == 200 and reply["done"], reply
    return reply["completions"]


def test_the_inference_token_rolls_out_and_controls_nothing(access_pod):
    pod = access_pod
    before = _state(pod)
    (completion,) = _roll_out(pod, "by-inference", INFERENCE_TOKEN)
    assert len(completion["token_ids"]) == 5
    for method, path, body in NEEDS_CONTROL:
        status, reply = pod.call(method, path, body, token=INFERENCE_TOKEN)
        assert status == 403 and reply["error"].startswith(f"{method} {path} needs the job's control token"), reply
        assert "the inference token grants only POST /v1/rollouts and GET /v1/rollouts/{batch_id}" in reply["error"]
    after = _state(pod)
    assert (after["epoch"], after["memory"], after["policy_version"]) == (
        before["epoch"], before["memory"], before["policy_version"])  # nothing the 403s asked for happened


def test_the_control_token_does_everything(access_pod):
    pod = access_pod
    assert len(_roll_out(pod, "by-control", CONTROL_TOKEN)[0]["token_ids"]) == 5
    epoch = _state(pod)["epoch"]
    for method, path, body in [("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": [1]}),
                               ("POST", "/v1/sleep", None), ("POST", "/v1/wake_up", None)]:
        status, reply = pod.call(method, path, body, token=CONTROL_TOKEN)
        assert status == 200, (path, reply)
    assert _state(pod)["epoch"] == epoch + 1
    # Past the token to the handler (the weights themselves: test_weights_come_only_from_the_jobs_store).
    status, reply = pod.call("POST", "/v1/weights", {}, token=CONTROL_TOKEN)
    assert status == 422 and "version: Field required" in reply["error"], reply


def test_no_or_an_unknown_token_is_401(access_pod):
    for token in (None, "", "wrong-token", TOKEN, CONTROL_TOKEN + "x", INFERENCE_TOKEN + "x"):
        for method, path, body in [("POST", "/v1/rollouts", {}), ("GET", "/v1/rollouts/any", None), *NEEDS_CONTROL]:
            status, reply = access_pod.call(method, path, body, token=token)
            assert status == 401 and "Bearer" in reply["error"], (token, path, reply)


def _wait_version(pod, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(pod)["policy_version"] != version:
        assert time.monotonic() < deadline, f"policy_version is not {version} after {timeout} s"
        time.sleep(0.02)


def test_weights_come_only_from_the_jobs_store(access_pod, model_dir):
    """127.0.0.2 is a working store on this host (loopback), but not what WEIGHTS_STORE resolves to: refused before
    the pod connects, its version unchanged; the store at 127.0.0.1 (what localhost resolves to) is taken."""
    pod = access_pod
    version = _state(pod)["policy_version"]
    weights = load_weights(model_dir, torch.float32)
    other, own = WeightSender("127.0.0.2:0", world=2), WeightSender("127.0.0.1:0", world=2)
    update = {"version": version + 1, "world": 2, "rank_offset": 1}
    try:
        status, reply = pod.call("POST", "/v1/weights", {**update, "address": other.address}, token=CONTROL_TOKEN)
        assert status == 403, reply
        assert reply["error"].startswith(f"address: {other.address} is not this job's weight-sync store "
                                         f"{WEIGHTS_STORE} (--weights-store): 127.0.0.2 is 127.0.0.2"), reply
        assert _state(pod)["policy_version"] == version
        _roll_out(pod, "after-refusal", INFERENCE_TOKEN)  # not receiving: a batch is taken at once (else 409)
        status, reply = pod.call("POST", "/v1/weights", {"version": version + 1, "transport": "device",
                                                         "address": handover_address("another job's token")},
                                 token=CONTROL_TOKEN)
        assert status == 403 and reply["error"].startswith("address: ") and \
            f"is not this job's in-pod hand-over {handover_address(CONTROL_TOKEN)!r}" in reply["error"], reply

        status, reply = pod.call("POST", "/v1/weights", {**update, "address": own.address}, token=CONTROL_TOKEN)
        assert status == 202, reply
        own.send({name: t.shape for name, t in weights.items()}, sorted(weights.items()), version + 1)
        _wait_version(pod, version + 1)
    finally:
        other.close()
        own.close()
