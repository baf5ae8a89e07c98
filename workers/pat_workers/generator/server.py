"""The generator pod's HTTP API: thin aiohttp handlers over the Coordinator (engine pat); `pod_app` and `serve`
also carry the vLLM pod's (vllm.py).

aiohttp because kopf, the operator's framework, is built on it: the operator's client and the pods share one
maintained async HTTP stack. The payloads are the pydantic models of pat_operator.podapi, whose docstring lists
the endpoints. Every endpoint but /healthz, /readyz and /metrics needs `Authorization: Bearer <token>`: the job's
control token, or for INFERENCE_ENDPOINTS its inference token too (no or an unknown token: 401; the inference token
elsewhere: 403). Errors are JSON {"error": "..."}: 422 for a malformed payload (naming the field's path), 409 for
a request that conflicts with what the pod is doing, 403 for weights from a store not the job's, 404 for an unknown
batch, 503 while the pod starts or stops.
"""

from __future__ import annotations

import asyncio
import hmac
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from pat_operator.podapi import RegroupPlan, RolloutBatch, WeightUpdate
from pat_operator.podclient import http_url

from .errors import Invalid, PodError, WeightStore, check_weight_source

if TYPE_CHECKING:  # the vLLM pod serves through this module without loading the engine's torch code
    from .coordinator import Coordinator

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# What the inference token grants (as METHOD, route): rollouts and their results, nothing that changes the pod.
INFERENCE_ENDPOINTS = (("POST", "/v1/rollouts"), ("GET", "/v1/rollouts/{batch_id}"))
MAX_WAIT_SECONDS = 60.0  # the longest a GET /v1/rollouts/{id}?wait= holds the connection
MAX_BODY_BYTES = 64 << 20  # a rollout batch of thousands of long token-id prompts
SHUTDOWN_SECONDS = 5.0  # what in-flight requests get on SIGTERM


@dataclass(frozen=True)
class Tokens:
    """The job's bearer tokens: `control` grants every endpoint, `inference` (if any) only INFERENCE_ENDPOINTS."""
    control: str
    inference: str | None = None

    def __post_init__(self):
        if self.inference == self.control:
            raise ValueError("the inference token equals the control token: it would grant every endpoint; give "
                             "the job Secret's key inference-token")


def describe(error: ValidationError) -> str:
    """One line per bad field: its path in the payload and what is wrong, e.g.
    'requests.0.sampling.temperature: Input should be greater than or equal to 0'."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors())


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _reply(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


async def _payload(request: web.Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as e:  # malformed JSON included
        raise Invalid(describe(e)) from None


async def _ask(coordinator: Coordinator, command: Callable, *args):
    """Runs a coordinator command on its thread and awaits the result."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    coordinator.post(command, *args, reply=lambda result, error: loop.call_soon_threadsafe(
        _settle, future, result, error))
    return await future


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the client went away, or a long poll timed out
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _wait_seconds(raw: str | None) -> float:
    try:
        wait = float(raw or 0)
    except ValueError:
        raise Invalid(f"wait: {raw!r} is not a number of seconds") from None
    return min(max(wait, 0.0), MAX_WAIT_SECONDS)


def pod_app(tokens: Tokens, routes: list[web.RouteDef]) -> web.Application:
    """An app of `routes` behind the pod's error handling and the job's tokens (all but OPEN_PATHS)."""
    control = f"Bearer {tokens.control}".encode()
    inference = f"Bearer {tokens.inference}".encode() if tokens.inference else None

    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except PodError as e:
            return _error(e.status, str(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, e.reason)

    @web.middleware
    async def authenticate(request: web.Request, handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        sent = request.headers.get("Authorization", "").encode()
        # Both compared in constant time, each time: the answer's timing tells nothing about either token.
        is_control = hmac.compare_digest(sent, control)
        is_inference = inference is not None and hmac.compare_digest(sent, inference)
        endpoint = (request.method, getattr(request.match_info.route.resource, "canonical", request.path))
        if is_control or (is_inference and endpoint in INFERENCE_ENDPOINTS):
            return await handler(request)
        if is_inference:
            return _error(403, f"{' '.join(endpoint)} needs the job's control token (its Secret's key token, "
                               f"PAT_JOB_TOKEN); the inference token grants only "
                               f"{' and '.join(' '.join(e) for e in INFERENCE_ENDPOINTS)}")
        return _error(401, "missing or unknown token: send 'Authorization: Bearer <the job's control token>' (or "
                           "its inference token, for rollouts)")

    app = web.Application(middlewares=[errors, authenticate], client_max_size=MAX_BODY_BYTES)
    app.add_routes(routes)
    return app


def make_app(coordinator: Coordinator, tokens: Tokens, store: WeightStore | None = None) -> web.Application:
    """Engine pat's pod API; `store`: the job's weight-sync store, the only one POST /v1/weights takes (None: any)."""
    c = coordinator

    async def submit(request: web.Request) -> web.Response:
        rollouts = await _payload(request, RolloutBatch)
        return _reply(await _ask(c, c.submit, rollouts), 202)

    async def batch_status(request: web.Request) -> web.Response:
        batch_id, wait = request.match_info["batch_id"], _wait_seconds(request.query.get("wait"))
        if wait:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            await _ask(c, c.watch, batch_id, lambda: loop.call_soon_threadsafe(_settle, done))
            try:
                await asyncio.wait_for(done, wait)
            except TimeoutError:
                pass
        return _reply(await _ask(c, c.status, batch_id))

    async def regroup(request: web.Request) -> web.Response:
        plan = await _payload(request, RegroupPlan)
        return _reply(await _ask(c, c.regroup, plan))

    async def weights(request: web.Request) -> web.Response:
        update = await _payload(request, WeightUpdate)
        await check_weight_source(update, store, tokens.control)
        return _reply(await _ask(c, c.update_weights, update), 202)

    async def sleep(request: web.Request) -> web.Response:
        raw = request.query.get("level", "1")
        if not raw.isdigit():
            raise Invalid(f"level: {raw!r} is not a sleep level; use 1 (keep the weights) or 2 (release them too)")
        return _reply(await _ask(c, c.sleep, int(raw)))

    async def wake_up(request: web.Request) -> web.Response:
        return _reply(await _ask(c, c.wake_up))

    async def state(request: web.Request) -> web.Response:
        return _reply(c.state)

    async def healthz(request: web.Request) -> web.Response:
        problem = c.health()
        return _error(503, problem) if problem else web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if c.ready.is_set():
            return web.json_response({"status": "ready"})
        return _error(503, c.failure or "not ready: the engine ranks are loading and profiling the model")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(c.gen.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return pod_app(tokens, [
        web.post("/v1/rollouts", submit), web.get("/v1/rollouts/{batch_id}", batch_status),
        web.post("/v1/regroup", regroup), web.post("/v1/weights", weights), web.post("/v1/sleep", sleep),
        web.post("/v1/wake_up", wake_up), web.get("/v1/state", state), web.get("/healthz", healthz),
        web.get("/readyz", readyz), web.get("/metrics", metrics),
    ])


class Pod(Protocol):
    """What `serve` runs: the Coordinator, or the vLLM pod."""
    failure: str | None

    def start(self, on_exit: Callable[[], None]) -> None: ...

    def stop(self) -> None: ...


async def serve(pod: Pod, app: web.Application, host: str, port: int, announce: Callable[[str], None] = print) -> int:
    """Serves until SIGTERM/SIGINT (then 0) or until the pod fails, e.g. a rank died (then 1; the failure is the
    last line on stderr, which Kubernetes keeps as the container's termination message). Listens first
    (`announce` gets 'listening on http://HOST:PORT', an IPv6 HOST in brackets), then starts the engines: /readyz
    says when they are up."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pod.start(on_exit=lambda: loop.call_soon_threadsafe(stop.set))
    announce(f"listening on {http_url(host, runner.addresses[0][1])}")
    try:
        await stop.wait()
    finally:
        await loop.run_in_executor(None, pod.stop)
        await runner.cleanup()
    if pod.failure:
        print(f"pat generator: {pod.failure}", file=sys.stderr, flush=True)
        return 1
    return 0
