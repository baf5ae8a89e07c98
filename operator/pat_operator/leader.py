"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's rules (k8s.io/client-go/tools/leaderelection):

- A candidate takes the Lease only when it is free (no holderIdentity) or expired: its record (holder, renewTime,
  ...) has not changed for leaseDurationSeconds as timed by the candidate's own clock since it last saw it change,
  so clocks need not agree. Every write is a replace with the resourceVersion read: of two candidates the second
  gets a 409 and stays a candidate.
- The leader renews every retry period. A renewal that has not succeeded within the renew deadline (shorter than
  the lease duration), or a Lease found held by another, ends the leadership at once (`on_lost`): no one else
  can have taken the Lease before then, so two replicas never act together.
- On a clean shutdown the leader releases the Lease (no holder, leaseDurationSeconds 1): a standby takes over
  within a retry period instead of a lease duration.

Not kubernetes.leaderelection (kubernetes 37) because: its LeaseLock uses the default client, not the operator's;
its calls have no timeout, so a hung renewal outlives the renew deadline while the leader goes on acting; it never
counts leaseTransitions nor releases the Lease; and it runs the leader's work in a thread, where kopf needs the main
thread (signal handlers).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from .kube import describe

log = logging.getLogger("pat_operator.leader")

JITTER = 0.2  # a candidate waits retry_period * (1 + up to this) between tries, as client-go's JitterFactor 1.2
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError)


def identity() -> str:
    """This process's holderIdentity: the pod's name (the host's outside a pod) and the process id, so that a second
    process in the same pod (`kubectl exec ... pat-operator remove-finalizers`) is not taken for the leader."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0  # seconds a standby waits, after it last saw the record change, to take it
    renew_deadline: float = 10.0  # seconds the leader goes on without a successful renewal before it stops
    retry_period: float = 2.0

    def problem(self) -> str | None:
        """What makes these settings unsafe, or None."""
        if not self.lease_duration > self.renew_deadline > self.retry_period * (1 + JITTER) > 0:
            return (f"lease duration ({self.lease_duration:g} s) > renew deadline ({self.renew_deadline:g} s) > "
                    f"{1 + JITTER:g} x retry period ({self.retry_period:g} s) > 0 must hold")
        return None


class LeaderElector:
    """One candidate for one Lease. observe() and claim() are the two halves of one try (try_acquire_or_renew);
    acquire() tries until this process leads, keep() renews in a thread, release() ends the leadership."""

    def __init__(self, api: kubernetes.client.ApiClient, settings: LeaseSettings):
        self.settings = settings
        self.leases = kubernetes.client.CoordinationV1Api(api)
        self._record: tuple | None = None  # the Lease's spec as last seen, and when it last changed (monotonic)
        self._record_since = 0.0
        self._renewed_at = 0.0  # monotonic start of the last successful write of this process
        self._last_error = "none"  # why the last renewal failed
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def holder(self) -> str:
        """The holderIdentity last seen ('' for a free Lease)."""
        return self._record[0] if self._record else ""

    def observe(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The Lease as the API server has it (None when there is none yet); notes when its record changed."""
        s = self.settings
        try:
            response = self.leases.read_namespaced_lease(s.name, s.namespace, _preload_content=False,
                                                         _request_timeout=timeout or s.renew_deadline)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        lease = json.loads(response.data)
        spec = lease.get("spec") or {}
        record = tuple(spec.get(k) for k in ("holderIdentity", "leaseDurationSeconds", "acquireTime", "renewTime",
                                             "leaseTransitions"))
        if record != self._record:
            self._record, self._record_since = record, time.monotonic()
        return lease

    def claim(self, lease: dict[str, Any] | None, timeout: float | None = None) -> bool:
        """Takes or renews the observed Lease if that is allowed; False when it is held by another and not expired,
        or when another candidate wrote it first (409)."""
        s = self.settings
        now = _micro_time(datetime.now(timezone.utc))
        spec = (lease or {}).get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        expires = self._record_since + (spec.get("leaseDurationSeconds") or 0)
        if holder and holder != s.identity and time.monotonic() < expires:
            return False
        leading = holder == s.identity
        new_spec = {"holderIdentity": s.identity, "leaseDurationSeconds": int(s.lease_duration), "renewTime": now,
                    "acquireTime": spec.get("acquireTime") if leading else now,
                    "leaseTransitions": (spec.get("leaseTransitions") or 0) + (0 if leading or lease is None else 1)}
        try:
            if lease is None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": s.name, "namespace": s.namespace}, "spec": new_spec}
                self.leases.create_namespaced_lease(s.namespace, body, _preload_content=False,
                                                    _request_timeout=timeout or s.renew_deadline)
            else:
                self.leases.replace_namespaced_lease(s.name, s.namespace, {**lease, "spec": {**spec, **new_spec}},
                                                     _preload_content=False,
                                                     _request_timeout=timeout or s.renew_deadline)
        except ApiException as e:
            if e.status == 409:  # another candidate wrote it since we read it
                return False
            raise
        if not leading:
            log.info("%s took the lease %s/%s (from %s)", s.identity, s.namespace, s.name, holder or "no one")
        self._record = (s.identity, new_spec["leaseDurationSeconds"], new_spec["acquireTime"], now,
                        new_spec["leaseTransitions"])
        self._record_since = time.monotonic()
        return True

    def try_acquire_or_renew(self, timeout: float | None = None) -> bool:
        started = time.monotonic()
        lease = self.observe(timeout)
        if not self.claim(lease, None if timeout is None else max(timeout - (time.monotonic() - started), 0.1)):
            return False
        self._renewed_at = started  # the others may count the lease duration from no earlier than this
        return True

    def acquire(self, stop: threading.Event, within: float | None = None) -> bool:
        """Tries every retry period until this process leads (True), `stop` is set or `within` seconds passed
        (False). API errors are logged and tried again."""
        s = self.settings
        deadline = None if within is None else time.monotonic() + within
        reported = None
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    return True
                if self.holder != reported:
                    reported = self.holder
                    log.info("%s stands by: the lease %s/%s is held by %s", s.identity, s.namespace, s.name,
                             self.holder)
            except API_ERRORS as e:
                log.warning("%s: reading or taking the lease %s/%s failed: %s", s.identity, s.namespace, s.name,
                            describe(e))
            if deadline is not None and time.monotonic() >= deadline:
                return False
            stop.wait(s.retry_period * (1 + random.random() * JITTER))
        return False

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renews the Lease in a thread until release(). Calls on_lost(why) once, and stops renewing, when the Lease
        is found held by another, or when no renewal succeeded within the renew deadline: a watchdog thread times
        that, so a request that hangs (a partition; urllib3 retrying within one call) cannot stretch it."""
        self._stopping.clear()
        lock = threading.Lock()

        def lose(why: str) -> None:
            with lock:
                if self._stopping.is_set():
                    return
                self._stopping.set()
            on_lost(why)

        self._threads = [threading.Thread(target=target, args=(lose,), name=name, daemon=True)
                         for target, name in ((self._renew, "lease-renewer"), (self._watch, "lease-watchdog"))]
        for thread in self._threads:
            thread.start()

    def _renew(self, lose: Callable[[str], None]) -> None:
        s = self.settings
        while not self._stopping.wait(s.retry_period):
            try:
                if self.try_acquire_or_renew():
                    continue
                if self.holder != s.identity:
                    lose(f"the lease {s.namespace}/{s.name} is held by {self.holder or 'no one'}")
                    return
                self._last_error = "another writer changed the lease (409)"
            except API_ERRORS as e:
                self._last_error = describe(e)
            log.warning("%s: renewing the lease %s/%s failed: %s", s.identity, s.namespace, s.name, self._last_error)

    def _watch(self, lose: Callable[[str], None]) -> None:
        s = self.settings
        while (left := self._renewed_at + s.renew_deadline - time.monotonic()) > 0:
            if self._stopping.wait(left):
                return
        lose(f"the lease {s.namespace}/{s.name} was not renewed within the renew deadline ({s.renew_deadline:g} s); "
             f"last error: {self._last_error}")

    def release(self) -> None:
        """Stops renewing and, if this process still holds the Lease, frees it (client-go's ReleaseOnCancel)."""
        s = self.settings
        self._stopping.set()
        for thread in self._threads:
            thread.join(self.settings.renew_deadline)  # a renewal in flight ends within its request timeout
        try:
            lease = self.observe()
            if lease is None or self.holder != s.identity:
                return
            now = _micro_time(datetime.now(timezone.utc))
            spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": now,
                    "renewTime": now}
            self.leases.replace_namespaced_lease(s.name, s.namespace, {**lease, "spec": spec},
                                                 _preload_content=False, _request_timeout=s.renew_deadline)
            log.info("%s released the lease %s/%s", s.identity, s.namespace, s.name)
        except API_ERRORS as e:  # the standby takes it once it expires
            log.warning("%s: releasing the lease %s/%s failed: %s", s.identity, s.namespace, s.name, describe(e))


def _micro_time(t: datetime) -> str:
    """A Lease's MicroTime: RFC 3339 with exactly six fractional digits (datetime.isoformat drops them at .0)."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
