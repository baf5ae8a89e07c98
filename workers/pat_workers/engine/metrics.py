"""The generator's Prometheus metrics (names from the operator's contract), fed from the ranks' events."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pat_operator import metric_names as names

from .regroup import RegroupReport

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REGROUP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def group_label(group: tuple[int, ...]) -> str:
    return f"{group[0]}-{group[-1]}"


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.running = Gauge(names.GENERATOR_REQUESTS_RUNNING, "Requests decoding, per replica group", ["group"], registry=r)
        self.waiting = Gauge(names.GENERATOR_REQUESTS_WAITING, "Requests queued, per replica group", ["group"], registry=r)
        self.tp_size = Gauge(names.GENERATOR_TP_SIZE, "TP size of each replica group", ["group"], registry=r)
        self.tokens = Counter(names.GENERATOR_TOKENS, "Tokens generated", registry=r)
        self.step_seconds = Histogram(names.GENERATOR_STEP_SECONDS, "Decode step latency by TP size", ["tp"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.regroups = Counter(names.GENERATOR_REGROUPS, "Regroups by outcome (applied | fallback)", ["outcome"],
                                registry=r)
        self.regroup_requests = Counter(names.GENERATOR_REGROUP_REQUESTS, "Requests carried through a regroup, by "
                                        "migration mode (kv | recompute)", ["mode"], registry=r)
        self.regroup_seconds = Histogram(names.GENERATOR_REGROUP_SECONDS, "Seconds a regroup spent moving KV, "
                                         "recomputing, and in total", ["mode"], buckets=REGROUP_BUCKETS, registry=r)
        self.epoch = Gauge(names.GENERATOR_LAYOUT_EPOCH, "Epoch of the applied TP layout", registry=r)
        self.policy_version = Gauge(names.GENERATOR_POLICY_VERSION, "Policy version of the weights the ranks hold",
                                    registry=r)
        self.batches = Counter(names.GENERATOR_BATCHES, "Rollout batches completed (the batch boundaries)",
                               registry=r)

    def set_layout(self, groups: list[tuple[int, ...]], epoch: int) -> None:
        for gauge in (self.running, self.waiting, self.tp_size):
            gauge.clear()
        for g in groups:
            self.tp_size.labels(group_label(g)).set(len(g))
            self.running.labels(group_label(g)).set(0)
            self.waiting.labels(group_label(g)).set(0)
        self.epoch.set(epoch)

    def on_step(self, group: tuple[int, ...], batch: int, running: int, waiting: int, seconds: float,
                tokens: int) -> None:
        """batch: sequences the step decoded; running: those still decoding after it."""
        self.running.labels(group_label(group)).set(running)
        self.waiting.labels(group_label(group)).set(waiting)
        self.tokens.inc(tokens)
        if batch:
            self.step_seconds.labels(str(len(group))).observe(seconds)

    def on_regroup(self, reports: list[RegroupReport]) -> None:
        """One observation per changed group (the report of its leader), not per rank."""
        changed = [r for r in reports if r.outcome in ("applied", "fallback")]
        for outcome in {r.outcome for r in changed}:
            self.regroups.labels(outcome).inc()
        for r in changed:
            for mode, count in r.modes.items():
                self.regroup_requests.labels(mode).inc(count)
            for mode in ("kv", "recompute", "total"):
                if mode in r.seconds:
                    self.regroup_seconds.labels(mode).observe(r.seconds[mode])
