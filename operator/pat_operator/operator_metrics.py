"""The operator's own Prometheus metrics (names from metric_names).

Every label value the operator uses is set up front (at 0), so that each series exists from the operator's
first scrape: a counter with labels has no series until .labels() is called, and a dashboard panel or an alert
on it would show "no data" until the first event instead of 0.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from . import metric_names as names
from .api import PHASES
from .podapi import RegroupAck

RECONCILE_RESULTS = ("ok", "error")
API_VERBS = ("create", "delete", "patch")
# What a pod acknowledges (RegroupAck.outcome), and what the operator concludes itself: the pod moved on (409),
# or no attempt got an answer.
REGROUP_PLAN_OUTCOMES = (*typing.get_args(RegroupAck.model_fields["outcome"].annotation), "superseded", "failed")
REGROUP_ATTEMPT_RESULTS = ("ok", "error")
# PrometheusError's reasons (prometheus.query) and the autoscaler's own when the answer has nothing usable.
PROMETHEUS_ERROR_REASONS = ("PrometheusUnreachable", "PrometheusAuthFailed", "QueryFailed", "StaleMetrics", "NoData")


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
        for metric, values in ((self.reconciles, RECONCILE_RESULTS), (self.jobs, PHASES),
                               (self.api_errors, API_VERBS), (self.regroup_plans, REGROUP_PLAN_OUTCOMES),
                               (self.regroup_attempts, REGROUP_ATTEMPT_RESULTS),
                               (self.prometheus_errors, PROMETHEUS_ERROR_REASONS)):
            for value in values:
                metric.labels(value)
