"""The one way the operator's asyncio code calls the Kubernetes API (`call`), its client (`api_client`), and the
Events it posts (`EventRecorder`, aggregated as client-go aggregates them).

`call` runs a blocking kubernetes-client call in a thread with a request timeout, and retries what may pass: 429,
5xx and every urllib3 error (a refused or dropped connection, a timeout), with exponential backoff and full jitter,
waiting at least what a Retry-After asks. Other answers (404, 409, 422, ...) raise the client's ApiException at once,
unchanged: the callers act on them. What still fails when the retry time is up raises KubeError, which names the
call ("deleting pod ns/name: ...").

Retries that succeed after a write was applied show as the API's own answers: a re-sent create finds its object
(409), a re-sent delete finds none (404); the callers already take both as done.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import random
import socket
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.retry import retry_after_seconds

T = TypeVar("T")

REQUEST_TIMEOUT = (5, 30)  # seconds: (connect, read) of one request
RETRY_SECONDS = 30.0  # no retry starts later than this after the first attempt
BACKOFF_SECONDS = (0.2, 5.0)  # the first retry's backoff ceiling, doubling up to the second

log = logging.getLogger("pat_operator.kube")


class KubeError(Exception):
    """A call that failed on every attempt: `what` names it, `cause` is the last ApiException or urllib3 error."""

    def __init__(self, what: str, cause: Exception, attempts: int, seconds: float):
        super().__init__(f"{what}: {describe(cause)} ({attempts} attempt{'s' * (attempts != 1)} in {seconds:.1f} s)")
        self.what, self.cause = what, cause

    @property
    def status(self) -> int | None:
        """The last answer's HTTP status; None when the API server did not answer."""
        return self.cause.status if isinstance(self.cause, ApiException) else None


def describe(error: Exception) -> str:
    """An API error as a person reads it: the HTTP status and the API server's message."""
    if isinstance(error, ApiException):
        try:
            message = json.loads(error.body).get("message")
        except (TypeError, ValueError, AttributeError):
            message = None
        return f"HTTP {error.status}: {message or error.reason}"
    return f"{type(error).__name__}: {error}"


def retriable(error: Exception) -> bool:
    """Whether an attempt that raised `error` may succeed later: 429, 5xx, no answer at all."""
    if isinstance(error, ApiException):
        return not 400 <= (error.status or 0) < 500 or error.status == 429
    return isinstance(error, urllib3.exceptions.HTTPError)


def backoff(error: Exception, retry: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds before retry number `retry` (0 for the first): full jitter over an exponential ceiling, or what the
    answer's Retry-After asks if that is longer."""
    first, most = BACKOFF_SECONDS
    jittered = rng() * min(most, first * 2 ** retry)
    return max(jittered, retry_after_seconds(error) or 0.0)


async def call(fn: Callable[..., T], *args: Any, what: str, within: float = RETRY_SECONDS, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a thread, with `_request_timeout` REQUEST_TIMEOUT unless given, retried as the module
    says for up to `within` seconds. `what` names the call for KubeError: "deleting pod ns/name"."""
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    started = time.monotonic()
    for retry in itertools.count():
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (ApiException, urllib3.exceptions.HTTPError) as e:
            if not retriable(e):
                raise
            elapsed, delay = time.monotonic() - started, backoff(e, retry)
            if elapsed + delay > within:
                raise KubeError(what, e, retry + 1, elapsed) from e
            log.info("%s: %s; retry %d in %.1f s", what, describe(e), retry + 1, delay)
            await asyncio.sleep(delay)


def api_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """The operator's client: the service account's in a pod (unless a kubeconfig is named), else the kubeconfig's
    (None: $KUBECONFIG or ~/.kube/config). urllib3's own retries are off: `call` retries, with a backoff and a bound,
    where urllib3 would retry each attempt again (3 more times by default, each up to the read timeout)."""
    config = kubernetes.client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=config)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    config.retries = False
    return kubernetes.client.ApiClient(config)


# Reasons posted often enough that each message would be an Event of its own (per regroup, per batch): one Event per
# (object, type, reason) counts them, with the latest message.
LATEST_MESSAGE_REASONS = frozenset({"Regrouped", "GeneratorQueue"})
AGGREGATE_SECONDS = 600.0  # a repeat within this of the last one counts on; later, the Event starts a new series
MESSAGE_LIMIT = 1024  # characters (as kopf's events): the rest is cut
CACHE_SIZE = 4096  # Events remembered as last written (client-go's cache size), saving a read per repeat
CONFLICT_ATTEMPTS = 10  # writes of one Event that another process's writes may overtake (a second replica)


def event_name(obj_name: str, key: tuple[str, ...]) -> str:
    """The Event's name: the object's, then a hash of the aggregation key, the same in every operator process."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return f"{obj_name[:253 - 17].rstrip('.-')}.{digest}"  # a DNS subdomain of at most 253 characters


def involved_object(obj: Mapping[str, Any]) -> dict[str, str]:
    """An Event's involvedObject: the object's reference (its resourceVersion when it has one)."""
    meta = obj["metadata"]
    ref = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "namespace": meta["namespace"],
           "uid": meta["uid"]}
    return {**ref, **({"resourceVersion": meta["resourceVersion"]} if meta.get("resourceVersion") else {})}


class EventRecorder:
    """Posts core/v1 Events about namespaced objects. One Event per key, (object uid, type, reason, message), or
    (uid, type, reason) for the reasons in `latest_message_reasons`: a repeat within `window` seconds of the Event's
    lastTimestamp patches it (count + 1, lastTimestamp, message), as kubectl shows it ("x5 over 2m").

    Event names are derived from the key, so a restarted operator or a second replica finds the same Event (its
    create is a 409) and counts on. The posts of one Event take turns in this process; patches carry the
    resourceVersion last seen, so a writer overtaken by another process (409) reads the Event again and retries: no
    repeat is lost. Failures are logged, never raised: an Event is worth less than the reconcile that posts it."""

    def __init__(self, api: kubernetes.client.ApiClient, component: str = "pat-operator",
                 instance: str | None = None, latest_message_reasons: Collection[str] = LATEST_MESSAGE_REASONS,
                 window: float = AGGREGATE_SECONDS):
        self.core = kubernetes.client.CoreV1Api(api)
        self.component, self.instance = component, instance or socket.gethostname()
        self.latest_message_reasons, self.window = frozenset(latest_message_reasons), timedelta(seconds=window)
        self._written: OrderedDict[tuple[str, str], kubernetes.client.V1Event] = OrderedDict()  # (ns, name), LRU
        self._turns: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: set[asyncio.Task] = set()

    def emit(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        """post() in the background, for synchronous callers in the event loop (as kopf.event)."""
        task = asyncio.get_running_loop().create_task(self.post(obj, type, reason, message))
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    async def post(self, obj: Mapping[str, Any], type: str, reason: str, message: str
                   ) -> kubernetes.client.V1Event | None:
        """Records one occurrence; returns the Event as written, None when it could not be (logged)."""
        ref = involved_object(obj)
        message = message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT - 3] + "..."
        key = (ref["uid"], type, reason) + (() if reason in self.latest_message_reasons else (message,))
        namespace, name = ref["namespace"], event_name(ref["name"], key)
        turn = self._turns.get((namespace, name))
        if turn is None:  # kept while a post holds or awaits it
            turn = self._turns[namespace, name] = asyncio.Lock()
        async with turn:
            return await self._record(ref, name, type, reason, message)

    async def _record(self, ref: dict[str, str], name: str, type: str, reason: str, message: str
                      ) -> kubernetes.client.V1Event | None:
        namespace = ref["namespace"]
        where = f"event {namespace}/{name} ({reason})"
        try:
            for _ in range(CONFLICT_ATTEMPTS):
                now = datetime.now(timezone.utc)
                last = self._written.get((namespace, name))
                try:
                    if last is None:
                        event = await call(self.core.create_namespaced_event, namespace,
                                           self._new(ref, name, type, reason, message, now), what=f"creating {where}")
                    else:
                        event = await call(self.core.patch_namespaced_event, name, namespace,
                                           self._repeat(last, message, now), what=f"patching {where}")
                except ApiException as e:
                    if e.status == 409:  # it exists (another process made it), or changed since `last`
                        self._remember(await call(self.core.read_namespaced_event, name, namespace,
                                                  what=f"reading {where}"))
                        continue
                    if e.status == 404 and last is not None:  # expired (the API server's event TTL): make it anew
                        self._written.pop((namespace, name), None)
                        continue
                    raise
                self._remember(event)
                return event
            log.warning("%s: overtaken by other writers %d times; not recorded", where, CONFLICT_ATTEMPTS)
        except (ApiException, KubeError) as e:
            log.warning("%s not recorded: %s: %s", where, message, e if isinstance(e, KubeError) else describe(e))
        return None

    def _new(self, ref: dict[str, str], name: str, type: str, reason: str, message: str, now: datetime) -> dict:
        stamp = _timestamp(now)
        return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": ref["namespace"]},
                "involvedObject": ref, "type": type, "reason": reason, "message": message, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": self.component},
                "reportingComponent": self.component, "reportingInstance": self.instance}

    def _repeat(self, last: kubernetes.client.V1Event, message: str, now: datetime) -> dict:
        """The patch for one more occurrence: counted on within the window, else a new series."""
        stamp = _timestamp(now)
        series = {"count": (last.count or 1) + 1} if last.last_timestamp and now - last.last_timestamp <= self.window \
            else {"count": 1, "firstTimestamp": stamp}
        return {"metadata": {"resourceVersion": last.metadata.resource_version}, "message": message,
                "lastTimestamp": stamp, **series}

    def _remember(self, event: kubernetes.client.V1Event) -> None:
        key = (event.metadata.namespace, event.metadata.name)
        self._written[key] = event
        self._written.move_to_end(key)
        if len(self._written) > CACHE_SIZE:
            self._written.popitem(last=False)


def _timestamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")
