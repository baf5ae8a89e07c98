"""The kopf handlers: thin. Each RLHFJob has one daemon that observes (the job, its pods from an in-memory index,
the trainer's progress), calls the pure `reconcile.decide()`, and carries the decision out.

Pod and job events only wake the daemon; it also wakes when the decision says something is due (a backoff, a
deadline, a TTL) and every RESYNC_SECONDS anyway. Only the replica that holds the leader Lease runs kopf (main.py),
so two operator replicas never act on one job.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp
import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from . import builders, kube
from . import metric_names as names
from .api import GROUP, PHASES, VERSION, GeneratorPodStatus, JobSpecError, RLHFJobStatus
from .autoscaler import AutoscaleSettings, Autoscaler
from .operator_metrics import OperatorMetrics
from .podclient import PodClient, PodError, http_url
from .prometheus import PrometheusAuth, PrometheusError, query, queue_depths, queue_queries
from .reconcile import Decision, Event, Observed, Settings, decide, needs_write, parse_body, pod_view, queue_event

PLURAL = "rlhfjobs"
RESYNC_SECONDS = 5.0
OBSERVE_SECONDS = 2.0  # how often the trainer's progress and the generators' layouts are read
STATUS_CATCH_UP_SECONDS = 5.0

log = logging.getLogger("pat_operator")


@dataclass
class Memo:
    """What the operator keeps in memory (kopf's memo): clients, settings and per-job state."""
    api: kubernetes.client.ApiClient
    token_key: bytes
    settings: Settings
    metrics: OperatorMetrics
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    ensured: set[tuple[str, str, str]] = field(default_factory=set)  # (job uid, kind, name) known to exist
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    prometheus_url: str | None = None  # the default for jobs that name none
    prometheus_auth: PrometheusAuth | None = None  # a bearer token, a CA, headers (managed Prometheus, Thanos, Mimir)
    autoscale: AutoscaleSettings = AutoscaleSettings()
    events: kube.EventRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.events = kube.EventRecorder(self.api)


@kopf.index("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
def pods_by_job(namespace: str, labels: dict[str, str], body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict:
    job = labels[builders.LABEL_JOB]
    _wake(memo, namespace, job)
    return {(namespace, job): pod_view(dict(body))}


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, name)


@kopf.on.probe(id="jobs")
def jobs_probe(memo: kopf.Memo, **_: Any) -> int:
    return len(memo.pat.phases)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def run_job(stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, uid: str,
                  pods_by_job: kopf.Index, memo: kopf.Memo, **_: Any) -> None:
    m: Memo = memo.pat
    key = (namespace, name)
    wake = m.wakers.setdefault(key, asyncio.Event())
    token = builders.job_token(m.token_key, uid)
    observer = _Observer(m, token, body.get("status"), _prometheus_url(m, body))
    errors: tuple[str, ...] = ()
    last_write = 0.0
    autoscaler = _autoscaler(m, body, token, observer, wake)
    autoscaling = asyncio.create_task(_autoscale(autoscaler, key, uid, pods_by_job)) if autoscaler else None
    try:
        while not stopped:
            wake.clear()
            started = time.monotonic()
            snapshot = copy.deepcopy(dict(body))
            pods = list(pods_by_job.get(key, []))
            try:
                iteration, generators, queue_events = await observer.observe(
                    snapshot, [p for p in pods if p.owner == uid])
                decision = decide(Observed(snapshot, pods, datetime.now(timezone.utc), m.token_key, iteration,
                                           generators, errors, autoscaler and autoscaler.metrics,
                                           autoscaler.in_flight if autoscaler else (), queue_events), m.settings)
                now = time.monotonic()
                write = needs_write(snapshot.get("status"), decision.status, now - last_write)
                errors = await _carry_out(m, snapshot, decision, write)
                if write:
                    last_write = now
                    await _catch_up(body, snapshot)
                m.metrics.reconciles.labels("ok").inc()
            except (ApiException, kube.KubeError, aiohttp.ClientError, OSError) as e:  # the API server is away
                log.warning("%s/%s: reconcile failed: %s", namespace, name, e)
                m.metrics.reconciles.labels("error").inc()
                decision = None
            m.metrics.reconcile_seconds.observe(time.monotonic() - started)
            if decision is not None:
                if m.phases.get(key) != decision.status["phase"]:  # recount only on a change: O(jobs)
                    m.phases[key] = decision.status["phase"]
                    _count_phases(m)
                if decision.delete_job:
                    return
            resync = OBSERVE_SECONDS if observer.polling else RESYNC_SECONDS
            timeout = min(decision.wake_after or resync, resync) if decision else 1.0
            try:
                await asyncio.wait_for(wake.wait(), timeout=max(timeout, 0.05))
            except asyncio.TimeoutError:
                pass
    finally:
        if autoscaling:
            autoscaling.cancel()
        m.wakers.pop(key, None)
        m.phases.pop(key, None)
        m.ensured -= {ident for ident in m.ensured if ident[0] == uid}
        _count_phases(m)


def _prometheus_url(m: Memo, body: kopf.Body) -> str | None:
    """Where the job's generator metrics are: its adaptiveTP.prometheus.url, else the operator's --prometheus-url."""
    try:
        return parse_body(dict(body)).spec.generator.adaptive_tp.prometheus.url or m.prometheus_url
    except JobSpecError:
        return None  # decide() fails the job


def _autoscaler(m: Memo, body: kopf.Body, token: str, observer: _Observer, wake: asyncio.Event) -> Autoscaler | None:
    """The job's autoscaler, if its adaptive TP is the operator's to drive (the spec is immutable once running)."""
    try:
        job = parse_body(dict(body))
    except JobSpecError:
        return None  # decide() fails the job
    adaptive = job.spec.generator.adaptive_tp
    if not job.spec.generator.adaptive or adaptive.controller != "operator":
        return None
    if m.session is None:
        m.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
    return Autoscaler(
        namespace=body.metadata.namespace, job=body.metadata.name, generator=job.spec.generator, token=token,
        url=adaptive.prometheus.url or m.prometheus_url, session=m.session, generators=observer.generators,
        emit=lambda type_, reason, message: m.events.emit(body, type_, reason, message),
        changed=wake.set, counters=m.metrics, settings=m.autoscale, auth=m.prometheus_auth)


async def _autoscale(autoscaler: Autoscaler, key: tuple[str, str], uid: str, pods_by_job: kopf.Index) -> None:
    interval = autoscaler.generator.adaptive_tp.prometheus.query_interval
    while True:
        started = time.monotonic()
        ready = {p.name: p.ip for p in pods_by_job.get(key, []) if builders.serves(p.role, "generator") and p.ready
                 and p.ip and not p.deleting and p.owner == uid}
        try:
            await autoscaler.tick(ready)
        except Exception:  # a bug must not stop the job's adaptive TP for good: log it, try again
            log.exception("%s/%s: autoscaler round failed", *key)
        await asyncio.sleep(max(interval - (time.monotonic() - started), 0.05))


async def _carry_out(m: Memo, body: dict[str, Any], d: Decision, write_status: bool) -> tuple[str, ...]:
    """Applies a decision (its status only if `write_status`); returns what the API server refused (fed to the next
    decision). Every call goes through kube.call: a timeout, and retries with jitter on 429, 5xx and lost
    connections."""
    meta = body["metadata"]
    namespace, uid, job = meta["namespace"], meta["uid"], meta["name"]
    core = kubernetes.client.CoreV1Api(m.api)
    custom = kubernetes.client.CustomObjectsApi(m.api)
    errors: list[str] = []

    async def create(manifest: dict[str, Any]) -> bool:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if (manifest["apiVersion"], kind) in builders.CUSTOM_RESOURCES:
            group, version, plural = builders.CUSTOM_RESOURCES[(manifest["apiVersion"], kind)]
            fn, args = custom.create_namespaced_custom_object, (group, version, namespace, plural, manifest)
        elif kind == "NetworkPolicy":
            fn, args = kubernetes.client.NetworkingV1Api(m.api).create_namespaced_network_policy, (namespace, manifest)
        else:
            fn, args = getattr(core, f"create_namespaced_{_snake(kind)}"), (namespace, manifest)
        try:
            await kube.call(fn, *args, what=f"creating {kind} {namespace}/{name}")
            return True
        except ApiException as e:
            if e.status == 409:  # it exists already (an earlier reconcile, or before an operator restart)
                return False
            m.metrics.api_errors.labels("create").inc()
            errors.append(f"creating {kind} {name}: {kube.describe(e)}")
            return False

    for manifest in d.ensure:
        ident = (uid, manifest["kind"], manifest["metadata"]["name"])
        if ident not in m.ensured:
            refused = len(errors)
            await create(manifest)
            if len(errors) == refused:
                m.ensured.add(ident)
    created = [p["metadata"]["name"] for p in d.create_pods if await create(p)]
    if created:
        m.metrics.pods_created.inc(len(created))
        await m.events.post(body, "Normal", "CreatedPods", f"created {', '.join(created)}")
    for pod, grace in [(p, None) for p in d.delete_pods] + [(p, 0) for p in d.force_delete_pods]:
        try:
            await kube.call(core.delete_namespaced_pod, pod, namespace, grace_period_seconds=grace,
                            what=f"{'force-' if grace == 0 else ''}deleting pod {namespace}/{pod}")
        except ApiException as e:
            if e.status != 404:
                m.metrics.api_errors.labels("delete").inc()
                errors.append(f"{'force-' if grace == 0 else ''}deleting pod {pod}: {kube.describe(e)}")
    old = body.get("status") or {}
    if write_status:
        patch = {**{k: None for k in old if k not in d.status}, **d.status}
        try:
            await kube.call(custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL, job,
                            {"status": patch}, what=f"writing the status of RLHFJob {namespace}/{job}")
        except (ApiException, kube.KubeError):
            m.metrics.api_errors.labels("patch").inc()
            raise
    for event in d.events:
        if event.reason in ("GangRestart", "GeneratorRestart"):
            m.metrics.gang_restarts.inc()
        await m.events.post(body, event.type, event.reason, event.message)
    if d.delete_job:
        await kube.call(custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, job,
                        what=f"deleting RLHFJob {namespace}/{job}")
    return tuple(errors)


async def _catch_up(body: kopf.Body, snapshot: dict[str, Any]) -> None:
    """After a status write, waits (briefly) until the watch delivers it, so that the next decision starts from
    the status just written rather than the one before it."""
    deadline = time.monotonic() + STATUS_CATCH_UP_SECONDS
    old = snapshot["metadata"].get("resourceVersion")
    while body.get("status") == snapshot.get("status") and body.metadata.get("resourceVersion") == old:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


class _Observer:
    """Reads what only the pods know: the trainer's completed iteration (its /metrics) and each generator pod's
    TP layout and epoch (its /v1/state, with the job's token); and, where a Prometheus is known, each generator
    pod's requests running and waiting. Best effort: a pod that does not answer, or a failed query (counted), is
    skipped, its last known values stay in the status."""

    def __init__(self, m: Memo, token: str, status: dict[str, Any] | None, prometheus_url: str | None = None):
        self.m, self.token, self.prometheus_url = m, token, prometheus_url
        self.last = 0.0
        self.polling = False  # whether the last observation found pods to read
        self.iteration: int | None = None
        # From the status, so that a restarted operator goes on counting regroups where the last one stopped.
        self.generators: dict[str, GeneratorPodStatus] = {
            g.pod: g for g in RLHFJobStatus.model_validate(status or {}).generators}

    async def observe(self, body: dict[str, Any], pods: list) -> tuple[int | None, dict[str, GeneratorPodStatus],
                                                                      tuple[Event, ...]]:
        """The trainer's iteration, the generator pods' status, and the GeneratorQueue events of this observation
        (handed out once)."""
        now = time.monotonic()
        spec = body.get("spec") or {}
        custom = any((spec.get(role) or {}).get("command") for role in builders.ROLES)
        if now - self.last < OBSERVE_SECONDS or custom:  # a custom command need not speak the pat protocol
            return self.iteration, self.generators, ()
        self.last = now
        running = [p for p in pods if p.phase == "Running" and p.ip and not p.deleting]
        self.polling = bool(running)
        if self.m.session is None:
            self.m.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        generators = [p for p in running if builders.serves(p.role, "generator") and p.ready]
        queues = [self._queues(body["metadata"]["namespace"], [p.name for p in generators])] \
            if generators and self.prometheus_url else []
        trainer = [p for p in running if builders.serves(p.role, "trainer") and p.index == 0]
        before = dict(self.generators)
        await asyncio.gather(*(self._trainer(p) for p in trainer),
                             *(self._generator(p, spec) for p in generators), *queues)
        engine = (spec.get("generator") or {}).get("engine", "pat")
        events = tuple(e for pod, g in self.generators.items()
                       if (e := queue_event(before.get(pod) or GeneratorPodStatus(pod=pod), g, engine)))
        return self.iteration, self.generators, events

    async def _trainer(self, pod) -> None:
        try:
            async with self.m.session.get(http_url(pod.ip, builders.TRAINER_METRICS_PORT) + "/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return
        for family in text_string_to_metric_families(text):
            if family.name == names.TRAINER_ITERATION and family.samples:
                self.iteration = int(family.samples[0].value)

    async def _generator(self, pod, spec: dict[str, Any]) -> None:
        port = (spec.get("generator") or {}).get("port", 8000)
        try:
            state = await PodClient(http_url(pod.ip, port), self.token, self.m.session).state()
        except (aiohttp.ClientError, asyncio.TimeoutError, PodError):
            return
        old = self.generators.get(pod.name) or GeneratorPodStatus(pod=pod.name)
        self.generators[pod.name] = old.model_copy(update={"layout": state.layout, "applied_epoch": state.epoch})

    async def _queues(self, namespace: str, pods: list[str]) -> None:
        """The pods' requests running and waiting, from Prometheus (either engine's metrics)."""
        timeout = self.m.autoscale.query_timeout_seconds
        try:
            running, waiting = await asyncio.gather(*(query(self.m.session, self.prometheus_url, q, timeout,
                                                            auth=self.m.prometheus_auth)
                                                      for q in queue_queries(namespace, pods)))
        except PrometheusError as e:
            self.m.metrics.prometheus_errors.labels(e.reason).inc()
            return
        for pod, (r, w) in queue_depths(running, waiting).items():
            if pod in pods:
                old = self.generators.get(pod) or GeneratorPodStatus(pod=pod)
                known = {k: v for k, v in (("running", r), ("waiting", w)) if v is not None}
                self.generators[pod] = old.model_copy(update=known)


def _wake(memo: kopf.Memo, namespace: str, job: str) -> None:
    pat = getattr(memo, "pat", None)
    if pat is not None and (event := pat.wakers.get((namespace, job))) is not None:
        event.set()


def _count_phases(m: Memo) -> None:
    counts: dict[str, int] = {}
    for phase in m.phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in PHASES:
        m.metrics.jobs.labels(phase).set(counts.get(phase, 0))


def _snake(kind: str) -> str:
    return {"ConfigMap": "config_map", "Secret": "secret", "Service": "service", "Pod": "pod"}[kind]
