"""Version skew between the operator (or trainer) and a generator pod: each side ignores the fields it does not know.
An older pod's replies (fields added since missing, one since removed present) are read by this operator's client;
a newer operator's requests (a field this pod does not know) are taken by a real pod (server.py, access_pod). The
negative control: the same payloads fail against the models as they were, extra="forbid"."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from pydantic import ConfigDict, ValidationError

from pat_operator.podapi import BatchStatus, PodState, RegroupAck, RegroupPlan, RolloutBatch, RolloutRequest, Sampling
from pat_operator.podclient import PodClient

from .conftest import CONTROL_TOKEN

# As a pod of an earlier release answers: PodState before engine (vLLM pods) and memory, weights, memory_bytes
# (sleep) were added; RegroupAck before seconds and error. kv_blocks_free, migrated, queued_at and finish_detail
# stand for fields a later release removed.
OLD_REPLIES = {
    "/v1/state": {"ready": True, "layout": [1, 1], "epoch": 3, "policy_version": 2, "batch_id": "b", "batch_done": True,
                  "controller": "operator", "world": 2, "weight_receivers": 2, "dtype": "float32",
                  "groups": [{"ranks": [0], "tp": 1, "running": 0, "waiting": 0, "kv_blocks_free": 7},
                             {"ranks": [1], "tp": 1, "running": 0, "waiting": 0, "kv_blocks_free": 9}],
                  "kv_blocks_free": 16},
    "/v1/regroup": {"applied_epoch": 4, "layout": [2], "outcome": "applied", "requests": {"kv": 3}, "migrated": 3},
    "/v1/rollouts/b": {"batch_id": "b", "done": True, "total": 1, "finished": 1, "queued_at": 0.5,
                       "completions": [{"id": "r", "token_ids": [5, 6], "logprobs": [-0.1, -0.2], "policy_version": 2,
                                        "finish_reason": "length", "finish_detail": "max_tokens"}]},
}
MODELS = {"/v1/state": PodState, "/v1/regroup": RegroupAck, "/v1/rollouts/b": BatchStatus}


def _strict(model):
    """The model as the protocol's were before: unknown fields refused (at its top level)."""
    return type(f"Strict{model.__name__}", (model,), {"model_config": ConfigDict(extra="forbid")})


async def _read_old_pod() -> tuple[PodState, RegroupAck, BatchStatus]:
    async def reply(request: web.Request) -> web.Response:
        return web.json_response(OLD_REPLIES[request.path])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", reply)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session:
            client = PodClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "t", session)
            return (await client.state(), await client.regroup(RegroupPlan(epoch=4, layout=[2])),
                    await client.wait("b"))
    finally:
        await runner.cleanup()


def test_the_operator_reads_an_older_pods_replies():
    state, ack, status = asyncio.run(_read_old_pod())
    assert (state.layout, state.epoch, state.policy_version, state.weight_receivers) == ([1, 1], 3, 2, 2)
    assert (state.engine, state.memory, state.weights, state.memory_bytes) == ("pat", "held", "held", [])  # defaults
    assert "kv_blocks_free" not in state.model_dump() and "kv_blocks_free" not in state.groups[0].model_dump()
    assert (ack.applied_epoch, ack.outcome, ack.requests, ack.seconds, ack.error) == (4, "applied", {"kv": 3}, 0.0,
                                                                                      None)
    assert status.done and status.completions[0].token_ids == [5, 6] and status.completions[0].text is None


@pytest.mark.parametrize("path", sorted(OLD_REPLIES))
def test_negative_control_forbidding_models_refuse_the_older_pods_replies(path):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        _strict(MODELS[path]).model_validate(OLD_REPLIES[path])
    MODELS[path].model_validate(OLD_REPLIES[path])  # the models as they are


# A newer operator's requests: a field added to each level of a rollout batch, and to a regroup plan.
class NewerSampling(Sampling):
    min_p: float = 0.05


class NewerRolloutRequest(RolloutRequest):
    sampling: NewerSampling = NewerSampling()
    priority: int = 1


class NewerRolloutBatch(RolloutBatch):
    requests: list[NewerRolloutRequest]
    deadline_seconds: float = 30.0


class NewerRegroupPlan(RegroupPlan):
    reason: str = "tail: one group left"


def _newer_batch(batch_id: str, version: int) -> NewerRolloutBatch:
    return NewerRolloutBatch(batch_id=batch_id, policy_version=version, requests=[NewerRolloutRequest(
        id="n-0", prompt_token_ids=[256, 4], sampling=NewerSampling(max_tokens=6, ignore_eos=True))])


async def _send_newer(url: str) -> tuple[PodState, BatchStatus, RegroupAck]:
    async with aiohttp.ClientSession() as session:
        client = PodClient(url, CONTROL_TOKEN, session)
        before = await client.state()
        await client.submit(_newer_batch("newer", before.policy_version))
        done = await client.wait("newer", poll_seconds=10)
        ack = await client.regroup(NewerRegroupPlan(epoch=before.epoch + 1, layout=[1]))
        return before, done, ack


def test_a_pod_takes_a_newer_operators_requests(access_pod):
    before, done, ack = asyncio.run(_send_newer(access_pod.url))
    assert done.done and len(done.completions[0].token_ids) == 6  # sampling.max_tokens was read beside min_p
    assert ack.applied_epoch == before.epoch + 1


def test_negative_control_forbidding_models_refuse_a_newer_operators_requests():
    for strict, payload in ((_strict(RolloutBatch), _newer_batch("newer", 0).model_dump()),
                            (_strict(RegroupPlan), NewerRegroupPlan(epoch=2, layout=[1]).model_dump())):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            strict.model_validate(payload)
