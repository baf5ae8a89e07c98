"""Adaptive TP driven by the operator (adaptiveTP.controller = operator): Prometheus -> planner -> the pod's
coordinator.

Every queryInterval one Autoscaler per job reads its generator pods' metrics from Prometheus, asks the planner
(the same plan() the pods run with controller=pod) for each pod that is generating, and sends a plan
{epoch, layout, from_epoch} to the pod, retrying with backoff. At most one plan is in flight per pod, and none
is sent within cooldownSeconds of the last regroup. A plan carries the epoch it was made for, so a plan that
arrives after the pod moved on (its batch ended and it went back to TP=1) is refused, not applied to the new
batch. What it finds goes into the job's status through the job's daemon (the only status writer): the
generators' desired/applied epochs, the MetricsAvailable condition and the pods with a plan in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import aiohttp

from . import planner
from .api import Generator, GeneratorPodStatus
from .layout import describe
from .operator_metrics import OperatorMetrics
from .podapi import RegroupAck, RegroupPlan
from .podclient import PodClient, PodError, http_url
from .prometheus import PodMetrics, PrometheusAuth, PrometheusError, pod_metrics, query, selectors
from .reconcile import MetricsState, stamp

log = logging.getLogger("pat_operator.autoscaler")


@dataclass(frozen=True)
class AutoscaleSettings:
    max_age_seconds: float = 5.0  # a pod scraped longer ago than this is stale: not planned for
    attempts: int = 4  # POSTs of one plan before it is marked failed
    retry_seconds: float = 0.25  # before the 2nd attempt; doubling after each
    ack_timeout_seconds: float = 10.0  # one POST (the pod applies the plan at its next step boundary)
    query_timeout_seconds: float = 2.0


def decide(m: PodMetrics, tp_sizes: Sequence[int], margin: float) -> planner.Decision:
    """The planner's decision for one pod from its scraped metrics (pure)."""
    if not m.batch_open or not m.unfinished:
        return planner.Decision(None, 0.0, 0.0, 0.0, "stay: no batch is generating")
    predictor = planner.LengthPredictor(m.max_tokens, prior=m.lengths)
    allowed = [t for t in tp_sizes if t in m.profile.tp_sizes]
    return planner.plan(m.layout, m.running, m.profile, predictor, m.costs, allowed, margin)


@dataclass
class _Pod:
    desired_epoch: int = 0
    in_flight: asyncio.Task | None = None
    last_regroup: float = -1e9  # monotonic


@dataclass
class Autoscaler:
    namespace: str
    job: str
    generator: Generator
    token: str
    url: str | None  # Prometheus; None: not configured
    session: aiohttp.ClientSession
    generators: dict[str, GeneratorPodStatus]  # shared with the daemon's observer: status per pod name
    emit: Callable[[str, str, str], None]  # (type, reason, message): a Kubernetes event on the job
    changed: Callable[[], None]  # wakes the job's daemon, which writes the status
    counters: OperatorMetrics
    settings: AutoscaleSettings = AutoscaleSettings()
    auth: PrometheusAuth | None = None  # Prometheus' credentials (never sent to the pods)
    metrics: MetricsState | None = None
    pods: dict[str, _Pod] = field(default_factory=dict)

    @property
    def in_flight(self) -> tuple[str, ...]:
        return tuple(sorted(name for name, p in self.pods.items() if p.in_flight and not p.in_flight.done()))

    async def tick(self, ready: dict[str, str]) -> None:
        """One round: ready maps the job's ready generator pods to their IPs."""
        if not ready:
            return
        state = await self._read(ready)
        if state != self.metrics:
            self.metrics = state
            self.changed()

    async def _read(self, ready: dict[str, str]) -> MetricsState:
        if self.url is None:
            return MetricsState("False", "NoPrometheusURL", "set spec.generator.adaptiveTP.prometheus.url or the "
                                "operator's --prometheus-url")
        data_query, age_query = selectors(self.namespace, list(ready))
        timeout = self.settings.query_timeout_seconds
        try:
            series, ages = await asyncio.gather(query(self.session, self.url, data_query, timeout, auth=self.auth),
                                                query(self.session, self.url, age_query, timeout, auth=self.auth))
        except PrometheusError as e:
            self.counters.prometheus_errors.labels(e.reason).inc()
            return MetricsState("False", e.reason, f"{e}; keeping the current TP layouts")
        found, skipped = pod_metrics(series, ages, self.settings.max_age_seconds)
        skipped.update({pod: "no samples" for pod in ready if pod not in found and pod not in skipped})
        for pod, m in found.items():
            self._consider(pod, ready[pod], m)
        why = "; ".join(f"{p}: {w}" for p, w in sorted(skipped.items()))
        if not found:
            reason = "StaleMetrics" if any(w.startswith("stale") for w in skipped.values()) else "NoData"
            self.counters.prometheus_errors.labels(reason).inc()
            return MetricsState("False", reason, f"{why}; keeping the current TP layouts")
        current = f"{len(found)} of {len(ready)} generator pod(s) current"
        return MetricsState("True", "MetricsCurrent", f"{current}; {why}" if why else current)

    def _consider(self, name: str, ip: str, m: PodMetrics) -> None:
        pod = self.pods.setdefault(name, _Pod())
        status = self.generators.get(name) or GeneratorPodStatus(pod=name)
        pod.desired_epoch = max(pod.desired_epoch, status.desired_epoch)  # after an operator restart
        if pod.in_flight and not pod.in_flight.done():
            return
        if time.monotonic() - pod.last_regroup < self.generator.adaptive_tp.cooldown_seconds:
            return
        decision = decide(m, self.generator.tp_sizes, self.generator.adaptive_tp.min_gain)
        if decision.layout is None:
            return
        plan = RegroupPlan(epoch=max(pod.desired_epoch, m.epoch) + 1, layout=list(decision.layout),
                           from_epoch=m.epoch)
        pod.desired_epoch = plan.epoch
        self.generators[name] = status.model_copy(update={"desired_epoch": plan.epoch})
        log.info("%s/%s: plan for %s: epoch %d, %s -> %s with %d unfinished: %s", self.namespace, self.job, name,
                 plan.epoch, m.layout, decision.layout, m.unfinished, decision.reason)
        pod.in_flight = asyncio.create_task(self._send(name, ip, plan, m.layout))
        self.changed()

    async def _send(self, name: str, ip: str, plan: RegroupPlan, old: Sequence[int]) -> None:
        client = PodClient(http_url(ip, self.generator.port), self.token, self.session)
        change = f"{describe(old)} -> {describe(plan.layout)}"
        started, why = time.monotonic(), ""
        for attempt in range(1, self.settings.attempts + 1):
            try:
                ack = await asyncio.wait_for(client.regroup(plan), self.settings.ack_timeout_seconds)
            except PodError as e:
                self.counters.regroup_attempts.labels("error").inc()
                if e.status == 409:  # the pod moved on (a new batch, its own reset): this plan is moot
                    log.info("%s/%s: plan %d for %s superseded: %s", self.namespace, self.job, plan.epoch, name,
                             e.message)
                    self.counters.regroup_plans.labels("superseded").inc()
                    return self.changed()
                why = f"HTTP {e.status}: {e.message}"
                if e.status < 500:  # the pod refuses the plan itself: retrying cannot help
                    break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.counters.regroup_attempts.labels("error").inc()
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                self.counters.regroup_attempts.labels("ok").inc()
                return self._acknowledged(name, plan, ack, change, time.monotonic() - started)
            if attempt < self.settings.attempts:
                await asyncio.sleep(self.settings.retry_seconds * 2 ** (attempt - 1))
        self.counters.regroup_plans.labels("failed").inc()
        self.emit("Warning", "RegroupFailed", f"{name}: {change} (epoch {plan.epoch}) not applied after "
                                              f"{attempt} attempt(s): {why}; the pod keeps its layout")
        self.pods[name].last_regroup = time.monotonic()  # the cooldown spaces out the next try too
        self.changed()

    def _acknowledged(self, name: str, plan: RegroupPlan, ack: RegroupAck, change: str, seconds: float) -> None:
        self.counters.regroup_plans.labels(ack.outcome).inc()
        self.counters.regroup_plan_seconds.observe(seconds)
        old = self.generators.get(name) or GeneratorPodStatus(pod=name)
        update = {"layout": ack.layout, "applied_epoch": ack.applied_epoch}
        moved = ", ".join(f"{n} by {mode}" for mode, n in sorted(ack.requests.items()) if n) or "nothing"
        if ack.outcome == "applied":
            update.update(regroups=old.regroups + 1,
                          last_regroup_time=stamp(datetime.now(timezone.utc)))
            self.emit("Normal", "Regrouped", f"{name}: {change} (epoch {ack.applied_epoch}); moved {moved}; "
                                             f"{ack.seconds:.3f} s in the pod, {seconds:.3f} s acknowledged")
        elif ack.outcome == "fallback":
            self.emit("Warning", "RegroupFailed", f"{name}: {change} (epoch {ack.applied_epoch}) fell back to "
                                                  f"{describe(ack.layout)}: {ack.error}; no request "
                                                  f"was dropped")
        self.generators[name] = old.model_copy(update=update)
        self.pods[name].last_regroup = time.monotonic()
        self.changed()
