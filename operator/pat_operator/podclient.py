"""An async client of the generator pod's HTTP API (podapi.py): the trainer and the operator both use it.

aiohttp: the same stack as kopf and the pod's server. Errors carry the HTTP status and the pod's message: its JSON
"error", else the start of whatever came back (a proxy's error page, an empty body). A reply that is not the
expected payload is a PodError too.
"""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from .podapi import BatchStatus, PodState, RegroupAck, RegroupPlan, RolloutBatch, WeightUpdate

M = TypeVar("M", bound=BaseModel)


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT, with an IPv6 address in brackets (RFC 3986): http://[fd00::5]:8000. Only an IPv6 address
    has a colon (a DNS name or an IPv4 address has none)."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


class PodError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message = status, message


class PodClient:
    def __init__(self, base_url: str, token: str, session: aiohttp.ClientSession):
        self.base_url, self.session = base_url.rstrip("/"), session
        self.headers = {"Authorization": f"Bearer {token}"}

    async def _call(self, method: str, path: str, model: type[M], body: BaseModel | None = None,
                    params: dict | None = None, timeout: float = 120.0) -> M:
        url = self.base_url + path
        async with self.session.request(method, url, headers=self.headers, params=params,
                                        json=body.model_dump() if body else None,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
        try:
            payload = json.loads(text)
        except ValueError:  # a proxy's HTML error page, an empty body
            payload = None
        if resp.status >= 400:
            error = payload.get("error") if isinstance(payload, dict) else None
            raise PodError(url, resp.status, str(error) if error else text.strip()[:200] or resp.reason or "no body")
        try:
            return model.model_validate(payload)
        except ValidationError:
            raise PodError(url, resp.status, f"not a {model.__name__}: {text.strip()[:200]!r}") from None

    async def state(self) -> PodState:
        return await self._call("GET", "/v1/state", PodState, timeout=10)

    async def submit(self, batch: RolloutBatch) -> BatchStatus:
        return await self._call("POST", "/v1/rollouts", BatchStatus, batch)

    async def wait(self, batch_id: str, poll_seconds: float = 30.0) -> BatchStatus:
        """Long-polls until the batch is done."""
        while True:
            status = await self._call("GET", f"/v1/rollouts/{batch_id}", BatchStatus,
                                      params={"wait": str(poll_seconds)}, timeout=poll_seconds + 30)
            if status.done:
                return status

    async def regroup(self, plan: RegroupPlan) -> RegroupAck:
        return await self._call("POST", "/v1/regroup", RegroupAck, plan)

    async def update_weights(self, update: WeightUpdate) -> PodState:
        return await self._call("POST", "/v1/weights", PodState, update)

    async def sleep(self, level: int = 1) -> PodState:
        return await self._call("POST", "/v1/sleep", PodState, params={"level": str(level)})

    async def wake_up(self) -> PodState:
        return await self._call("POST", "/v1/wake_up", PodState)

    async def wait_version(self, version: int, timeout: float = 600.0) -> PodState:
        """Polls the pod's state until every rank holds `version`."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (state := await self.state()).policy_version != version:
            if asyncio.get_running_loop().time() > deadline:
                raise PodError(self.base_url, 504, f"policy version {version} not reached in {timeout:.0f} s "
                                                   f"(pod holds {state.policy_version})")
            await asyncio.sleep(0.05)
        return state
