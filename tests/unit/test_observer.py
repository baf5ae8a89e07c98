"""The operator's observer of generator pods (an in-process pod serving /v1/state): it takes each pod's layout and
epoch, and a restarted operator, seeded from the job's status, keeps what only the operator knew (the regroups
count, the last regroup's time, the plan epoch)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from pat_operator.handlers import _Observer
from pat_operator.podapi import GroupState, PodState
from pat_workers.ports import free_port

POD = "job-generator-0"
STATUS = {"generators": [{"pod": POD, "layout": [2], "desiredEpoch": 4, "appliedEpoch": 4, "regroups": 3,
                          "lastRegroupTime": "2026-12-03T10:00:00Z"}]}


async def _observe(status: dict | None) -> dict:
    state = PodState(ready=True, layout=[1, 1], epoch=5, policy_version=0, controller="operator", world=2,
                     weight_receivers=2,
                     dtype="float32", groups=[GroupState(ranks=[r], tp=1, running=0, waiting=0) for r in (0, 1)])

    async def serve(_: web.Request) -> web.Response:
        return web.json_response(state.model_dump())

    app = web.Application()
    app.add_routes([web.get("/v1/state", serve)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            observer = _Observer(SimpleNamespace(session=session), "token", status)
            await observer._generator(SimpleNamespace(name=POD, ip="127.0.0.1"), {"generator": {"port": port}})
            return observer.generators[POD].model_dump(by_alias=True)
    finally:
        await runner.cleanup()


def test_a_restarted_operator_keeps_counting_from_the_status():
    seen = asyncio.run(_observe(STATUS))
    assert seen["layout"] == [1, 1] and seen["appliedEpoch"] == 5  # what the pod says now
    assert seen["regroups"] == 3 and seen["desiredEpoch"] == 4 and seen["lastRegroupTime"]  # what the status kept


def test_without_a_status_the_observer_starts_from_zero():  # the negative control: the seeding is what keeps it
    seen = asyncio.run(_observe(None))
    assert seen["regroups"] == 0 and seen["lastRegroupTime"] is None and seen["appliedEpoch"] == 5
