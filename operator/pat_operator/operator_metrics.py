"""The operator's own Prometheus metrics (names from metric_names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from . import metric_names as names


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter(names.OPERATOR_RECONCILES, "reconciles of RLHFJobs", ["result"], registry=r)
        self.reconcile_seconds = Histogram(names.OPERATOR_RECONCILE_SECONDS, "seconds per reconcile", registry=r,
                                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.pods_created = Counter(names.OPERATOR_PODS_CREATED, "pods created", registry=r)
        self.gang_restarts = Counter(names.OPERATOR_GANG_RESTARTS, "gang restarts", registry=r)
        self.jobs = Gauge(names.OPERATOR_JOBS, "RLHFJobs by phase", ["phase"], registry=r)
        self.api_errors = Counter(names.OPERATOR_API_ERRORS, "Kubernetes API calls refused", ["verb"], registry=r)
        self.regroup_plans = Counter(names.OPERATOR_REGROUP_PLANS, "Regroup plans sent to generator pods, by "
                                     "outcome", ["outcome"], registry=r)
        self.regroup_attempts = Counter(names.OPERATOR_REGROUP_ATTEMPTS, "POSTs of regroup plans", ["result"],
                                        registry=r)
        self.regroup_plan_seconds = Histogram(names.OPERATOR_REGROUP_DELAY_SECONDS, "Seconds from sending a plan "
                                              "to its acknowledgement", registry=r,
                                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.prometheus_errors = Counter(names.OPERATOR_PROMETHEUS_ERRORS, "Prometheus queries that gave nothing "
                                         "usable, by reason", ["reason"], registry=r)
