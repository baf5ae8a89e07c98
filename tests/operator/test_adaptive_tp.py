"""Adaptive TP end to end on the real control plane, real workers and a real Prometheus: the operator reads the
generator pod's queue depths, regroups it in the long tail, says so in status and events, and the tokens equal
those of the same job with adaptive TP off. The same with controller=pod (no Prometheus at all). And an engine
rank that dies inside an operator-sent regroup: reported, and its generator pod restarts alone."""

from __future__ import annotations

import json

import pytest

from pat_operator import builders
from pat_operator.reconcile import parse_body

from .tailjob import TAIL, rollouts, run_job, tail_job

pytestmark = pytest.mark.cluster


def _conditions(job: dict) -> dict[str, dict]:
    return {c["type"]: c for c in job["status"]["conditions"]}


@pytest.mark.timeout(900)  # three whole jobs back to back: 462 s alone on a slow 2-core host, past 600 in the suite
def test_adaptive_tp_end_to_end(jobs, cluster, prometheus, operator, tail_data):
    claim_dir = lambda name: cluster.kubelet.claim_dir(jobs.namespace, f"{name}-run")  # noqa: E731

    # Adaptive TP off: every rank a TP=1 replica throughout.
    job = run_job(jobs, cluster, tail_job("fixed", tail_data, TAIL, enabled=False))
    assert job["status"]["generators"][0].get("regroups", 0) == 0
    fixed = rollouts(claim_dir("fixed"), 1)

    # The operator plans from Prometheus.
    job = run_job(jobs, cluster, tail_job("op", tail_data, TAIL, prometheus_url=prometheus.url))
    generator = job["status"]["generators"][0]
    assert generator["regroups"] >= 1 and generator["appliedEpoch"] >= generator["desiredEpoch"] >= 1, generator
    assert generator.get("lastRegroupTime")
    conditions = _conditions(job)
    assert conditions["MetricsAvailable"]["status"] == "True", conditions
    assert conditions["Regrouping"]["status"] == "False"  # nothing in flight once done
    events = jobs.events("op")
    regrouped = [e for e in events if e.startswith(f"Regrouped: {generator['pod']}: 1+1 -> 2")]
    assert regrouped and "s in the pod" in regrouped[0], events
    assert not [e for e in events if e.startswith("RegroupFailed")], events
    assert rollouts(claim_dir("op"), 1) == fixed  # greedy: the regroup changes no token
    assert operator.value('pat_operator_regroup_plans_total{outcome="applied"}') >= 1

    # The pod plans for itself: no Prometheus, no MetricsAvailable condition.
    job = run_job(jobs, cluster, tail_job("pod", tail_data, TAIL, controller="pod"))
    assert "MetricsAvailable" not in _conditions(job)
    log = cluster.kubelet.log(jobs.namespace, job["status"]["generators"][0]["pod"], "generator")
    assert "regroup (1, 1) -> (2,)" in log, log[-3000:]
    assert rollouts(claim_dir("pod"), 1) == fixed


def test_a_rank_dying_in_an_operator_regroup_fails_the_plan_and_the_generator_restarts(jobs, cluster, prometheus,
                                                                                       operator, tail_data):
    # Rank 1 exits while the ranks exchange KV for the operator's 1+1 -> 2. Rank 0 falls back to TP=1 with every
    # request; the pod then fails (a dead rank's communicators cannot be trusted again) and, the trainer being
    # healthy, is restarted alone: the trainer sends it its part of the batch again. The failpoint is in the pod's
    # environment, so every incarnation dies the same way: past backoffLimit the job fails.
    doc = tail_job("dies", tail_data, TAIL, prometheus_url=prometheus.url)
    doc["spec"]["runPolicy"]["backoffLimit"] = 1
    doc["spec"]["generator"]["env"] = [{"name": "PAT_FAILPOINTS", "value": "regroup.transfer@1"}]
    # Any predicted gain merges: the test is of the failure, not of the planner's judgement (with the 10% margin,
    # a noisy profile measured on this busy host once kept the operator from planning at all; with no margin, a
    # profile measured on a loaded host once still predicted no gain). So the pod exports an offline profile in
    # which TP=2 is 10x faster at every batch: the operator plans the merge as soon as it sees the batch.
    doc["spec"]["generator"]["adaptiveTP"]["minGain"] = 0.0
    (tail_data / "profile.json").write_text(json.dumps(
        {"decode": {"1": {"1": 0.02, "16": 0.05}, "2": {"1": 0.002, "16": 0.005}}}))
    (tail_data / "profile.json").chmod(0o644)
    doc["spec"]["generator"]["adaptiveTP"]["profile"] = "/data/profile.json"
    job = run_job(jobs, cluster, doc, ends="Failed")
    assert job["status"]["restarts"] == 1 and job["status"].get("attempt", 0) == 0, job["status"]  # no gang restart
    assert next(c for c in job["status"]["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"
    # The generator pod's two incarnations, each of which got the batch and died in the regroup.
    first, second = (builders.pod_name(parse_body(job), job["metadata"]["uid"], "generator", 0, 0, incarnation)
                     for incarnation in (0, 1))
    events = jobs.events("dies")
    for pod in (first, second):
        failed = [e for e in events if e.startswith(f"RegroupFailed: {pod}: 1+1 -> 2")]
        assert failed, (pod, events)  # the ack says "fell back", or the pod was gone before it could answer
        log = cluster.kubelet.log(jobs.namespace, pod, "generator")
        assert "died" in log, log[-3000:]
    assert not [e for e in events if e.startswith("Regrouped")], events
    assert any(e.startswith("GeneratorRestart") and f"restarting {first} alone" in e for e in events), events
    assert not [e for e in events if e.startswith("GangRestart")], events
    assert sum(operator.value(f'pat_operator_regroup_plans_total{{outcome="{o}"}}') for o in ("fallback", "failed"))
