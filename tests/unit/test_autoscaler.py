"""The Autoscaler's rounds over HTTP (in-process servers for Prometheus' query API and a pod's /v1/regroup): a
plan is sent once per tail with the epoch it was made for; 5xx answers are retried, a pod that fell back is
reported, a superseded plan (409) is dropped quietly, Prometheus errors become the MetricsAvailable state."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from pat_operator.api import Generator
from pat_operator.autoscaler import AutoscaleSettings, Autoscaler
from pat_operator.operator_metrics import OperatorMetrics
from pat_workers.ports import free_port

from .test_autoscale_inputs import pod_series, scraped

POD = "job-generator-0"


async def _round(pod_answers: list[tuple[int, dict]], prometheus_status: int = 200, ticks: int = 1):
    """Runs `ticks` rounds against a Prometheus serving a pod in its tail and a pod answering `pod_answers` in
    turn; returns (plans received, events, autoscaler)."""
    plans, events = [], []

    async def query(request: web.Request) -> web.Response:
        if prometheus_status != 200:
            return web.json_response({"status": "error", "error": "overloaded"}, status=prometheus_status)
        data = scraped(POD, age=0) if request.query["query"].startswith("time() - timestamp(") else pod_series(POD)
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": data}})

    async def regroup(request: web.Request) -> web.Response:
        plans.append(await request.json())
        status, body = pod_answers[min(len(plans), len(pod_answers)) - 1]
        return web.json_response(body, status=status)

    app = web.Application()
    app.add_routes([web.get("/api/v1/query", query), web.post("/v1/regroup", regroup)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    generator = Generator.model_validate({"gpusPerPod": 0, "ranksPerPod": 2, "port": port,
                                          "adaptiveTP": {"controller": "operator", "cooldownSeconds": 0}})
    try:
        async with aiohttp.ClientSession() as session:
            a = Autoscaler("ns", "job", generator, "token", f"http://127.0.0.1:{port}", session, {},
                           lambda *e: events.append(e), lambda: None, OperatorMetrics(),
                           AutoscaleSettings(max_age_seconds=1e12, retry_seconds=0.01))
            for _ in range(ticks):
                await a.tick({POD: "127.0.0.1"})
                await asyncio.gather(*(p.in_flight for p in a.pods.values() if p.in_flight))
    finally:
        await runner.cleanup()
    return plans, events, a


def ack(outcome: str, layout: list[int], **extra) -> tuple[int, dict]:
    return 200, {"applied_epoch": 4, "layout": layout, "outcome": outcome, **extra}


def test_a_plan_is_retried_on_5xx_and_its_status_recorded():
    plans, events, a = asyncio.run(_round([(503, {"error": "busy"}), ack("applied", [2], requests={"kv": 1},
                                                                         seconds=0.01)]))
    assert plans == [{"epoch": 4, "layout": [2], "from_epoch": 3}] * 2  # epoch 3 in the metrics -> plan 4
    assert [e[1] for e in events] == ["Regrouped"] and "1+1 -> 2 (epoch 4); moved 1 by kv" in events[0][2]
    status = a.generators[POD]
    assert (status.desired_epoch, status.applied_epoch, status.regroups, status.layout) == (4, 4, 1, [2])
    assert a.metrics.status == "True" and a.in_flight == ()


def test_fallback_is_reported_and_superseded_plans_are_dropped():
    _, events, a = asyncio.run(_round([ack("fallback", [1, 1], error="rank 1 died")]))
    assert events[0][:2] == ("Warning", "RegroupFailed") and "fell back to 1+1: rank 1 died" in events[0][2]
    assert a.generators[POD].regroups == 0
    plans, events, _ = asyncio.run(_round([(409, {"error": "from_epoch: the pod moved on"})]))
    assert len(plans) == 1 and events == []  # not retried, not an error for people


def test_refused_plans_fail_at_once_and_unanswered_ones_after_every_attempt():
    plans, events, _ = asyncio.run(_round([(422, {"error": "layout: no"})]))
    assert len(plans) == 1 and "after 1 attempt(s): HTTP 422: layout: no" in events[0][2]
    plans, events, _ = asyncio.run(_round([(500, {"error": "boom"})]))
    assert len(plans) == AutoscaleSettings().attempts and "after 4 attempt(s): HTTP 500: boom" in events[0][2]


@pytest.mark.parametrize("status", [500, 400])
def test_prometheus_errors_keep_the_layout(status):
    plans, events, a = asyncio.run(_round([ack("applied", [2])], prometheus_status=status))
    assert plans == [] and events == []
    assert (a.metrics.status, a.metrics.reason) == ("False", "QueryFailed") and "overloaded" in a.metrics.message
