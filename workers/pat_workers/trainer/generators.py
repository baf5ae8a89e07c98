"""The trainer's rank 0 and a generator pod that goes away: the operator may restart a failed generator pod alone (same
address, a fresh process that holds the initial weights, policy version 0, and no batch) while the trainer goes on.

To the trainer such a pod stops answering, or answers that it no longer knows the batch it was generating (404), or
that it is starting (not ready, 503). `until_back` waits for it, up to the restart timeout for each time it goes
away, and then retries the work; the loop gives the pod back the weights and the requests it lost (loop.Trainer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from pat_operator.podapi import PodState
from pat_operator.podclient import PodClient, PodError

from ..weightsync import WeightSyncError

T = TypeVar("T")
RETRY_SECONDS = 1.0
# What a pod that is away, starting or restarted answers: its batch unknown (404), busy with what an abandoned call
# started (409), starting or stopping (503), a proxy's or PodClient.wait_version's timeout (502, 504).
LOST_STATUSES = frozenset({404, 409, 502, 503, 504})


class GeneratorLost(RuntimeError):
    """A generator pod the trainer cannot get back: it did not come back within the restart timeout (or the trainer
    does not wait: timeout 0), or it holds a newer policy than the trainer (which restarted without it)."""


def lost(error: BaseException) -> bool:
    """Whether `error` is what a pod that went away, or came back restarted, looks like from the trainer."""
    if isinstance(error, PodError):
        return error.status in LOST_STATUSES
    return isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError))


def round_lost(error: BaseException) -> bool:
    """Whether a failed weight round is explained by a member that went away during it: a lost pod, or the group's
    transport or store failing (torch raises RuntimeError, DistError among them). A round the receivers refused
    (another model or dtype) or a request the pod rejects as malformed is not."""
    if isinstance(error, (WeightSyncError, PodError)):
        return lost(error)
    return lost(error) or isinstance(error, RuntimeError)


def lost_error(pod: str, why: str, timeout: float) -> GeneratorLost:
    """The error that ends the trainer when generator pod `pod` (its URL, or several) does not come back."""
    if timeout <= 0:
        return GeneratorLost(f"generator pod {pod} failed ({why}); the trainer waits for no restarted generator pod "
                             f"(--generator-restart-timeout 0)")
    return GeneratorLost(f"generator pod {pod} did not come back within {timeout:.0f} s "
                         f"(--generator-restart-timeout): {why}")


async def until_back(client: PodClient, work: Callable[[PodState], Awaitable[T]], timeout: float) -> T:
    """work(state) once the pod answers ready, retried while it fails as a lost pod does (lost()). The pod has
    `timeout` seconds from the first failure to come back (its first ready answer after being away or not ready,
    which starts a new clock); past them, or at once with timeout 0, GeneratorLost names it."""
    since: float | None = None  # when the pod began failing
    away = False  # it has not answered ready since
    while True:
        answered = False
        try:
            state = await client.state()
            if not state.ready:
                raise PodError(client.base_url, 503, "not ready: its engines are loading the model")
            answered = True
            if away:  # back: its next failure starts a new clock
                since, away = None, False
            return await work(state)
        except Exception as error:
            if not lost(error):
                raise
            away = away or not answered
            now = time.monotonic()
            if since is None:
                since = now
                if timeout > 0:
                    print(f"generator pod {client.base_url}: {error}; waiting up to {timeout:.0f} s for it to come "
                          f"back", flush=True)
            if now - since >= timeout:
                raise lost_error(client.base_url, str(error), timeout) from error
        await asyncio.sleep(RETRY_SECONDS)


async def ready_state(client: PodClient, timeout: float) -> PodState:
    """The pod's state once it answers ready (until_back)."""
    async def state(s: PodState) -> PodState:
        return s
    return await until_back(client, state, timeout)
