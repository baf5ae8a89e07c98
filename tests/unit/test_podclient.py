"""The pod client against replies a proxy or a broken pod gives: every one is a PodError with the HTTP status and
what came back, never an exception of the JSON parser (which escaped the autoscaler's plan task: no RegroupFailed)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from pat_operator.podapi import RegroupPlan
from pat_operator.podclient import PodClient, PodError

REPLIES = {
    "/json-error": (409, "application/json", '{"error": "epoch: plan epoch 2 is not newer"}'),
    "/proxy-page": (502, "text/html", "<html><body><h1>502 Bad Gateway</h1></body></html>"),
    "/empty": (503, "text/plain", ""),
    "/not-json-ok": (200, "text/plain", "ok"),
    "/wrong-json-ok": (200, "application/json", '{"applied": true}'),
}


async def _call(path: str) -> PodError:
    async def reply(request: web.Request) -> web.Response:
        status, kind, text = REPLIES["/" + request.path.split("/")[1]]  # the base URL's path, then /v1/regroup
        return web.Response(status=status, text=text, content_type=kind)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", reply)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            client = PodClient(f"http://127.0.0.1:{port}{path}", "t", session)
            with pytest.raises(PodError) as e:
                await client.regroup(RegroupPlan(epoch=2, layout=[2]))
            return e.value
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path, status, message", [
    ("/json-error", 409, "epoch: plan epoch 2 is not newer"),
    ("/proxy-page", 502, "<html><body><h1>502 Bad Gateway</h1></body></html>"),
    ("/empty", 503, "Service Unavailable"),
    ("/not-json-ok", 200, "not a RegroupAck: 'ok'"),
    ("/wrong-json-ok", 200, "not a RegroupAck: '{\"applied\": true}'"),
])
def test_every_error_reply_is_a_pod_error_with_its_status_and_body(path, status, message):
    error = asyncio.run(_call(path))
    assert (error.status, error.message) == (status, message)
