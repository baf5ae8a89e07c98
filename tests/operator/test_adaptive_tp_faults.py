"""The operator's adaptive TP when things fail, with a real Prometheus: a generator pod that never acknowledges a
plan (retries, then RegroupFailed; the layout stays), and Prometheus going away (MetricsAvailable=False with the
reason, the job keeps running, and recovers by itself).

The generator pod is a stand-in that serves the metrics of a pod in its long tail (one rank decoding one sequence,
the other idle, a profile in which TP=2 is faster) and hangs on POST /v1/regroup: real scrapes, real plans, a pod
that times out."""

from __future__ import annotations

import pytest

from pat_operator import metric_names as names

from .conftest import SLEEP, condition, job_doc, phase

pytestmark = pytest.mark.cluster

TAIL_METRICS = "\n".join([
    *(f'{names.GENERATOR_TP_SIZE}{{group="{g}"}} 1' for g in ("0-0", "1-1")),
    f'{names.GENERATOR_REQUESTS_RUNNING}{{group="0-0"}} 1', f'{names.GENERATOR_REQUESTS_RUNNING}{{group="1-1"}} 0',
    *(f'{names.GENERATOR_REQUESTS_WAITING}{{group="{g}"}} 0' for g in ("0-0", "1-1")),
    f'{names.GENERATOR_RUNNING_CONTEXT_TOKENS}{{group="0-0"}} 116',
    f'{names.GENERATOR_RUNNING_GENERATED_TOKENS}{{group="0-0"}} 100',
    f"{names.GENERATOR_LAYOUT_EPOCH} 0", f"{names.GENERATOR_BATCH_OPEN} 1", f"{names.GENERATOR_BATCH_MAX_TOKENS} 400",
    f"{names.GENERATOR_BATCHES}_total 0", f'{names.GENERATOR_RESPONSE_TOKENS}_bucket{{le="+Inf"}} 0',
    *(f'{names.GENERATOR_PROFILE_STEP_SECONDS}{{tp="{tp}",batch="{b}"}} {s}'
      for tp, b, s in ((1, 1, 0.04), (1, 8, 0.08), (2, 1, 0.024), (2, 8, 0.05))),
    f"{names.GENERATOR_PROFILE_CONTEXT} 64", *(f'{names.GENERATOR_PROFILE_KV_SECONDS}{{tp="{tp}"}} 0' for tp in (1, 2)),
    f'{names.GENERATOR_REGROUP_COST}{{term="fixed_seconds"}} 0.005',
    f'{names.GENERATOR_REGROUP_COST}{{term="kv_seconds_per_token"}} 1e-6',
    *(f'{names.GENERATOR_PREFILL_COST}{{tp="{tp}",term="{t}"}} {v}'
      for tp in (1, 2) for t, v in (("seconds", 0.01), ("seconds_per_token", 1e-4))), ""])

# Answers GET (readiness, metrics) at once; holds every POST (a plan) for a minute, longer than the operator waits.
HANGING_POD = ["python", "-c", f"""
import http.server as h, os, time
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {TAIL_METRICS!r}.encode()
        self.send_response(200); self.send_header('Content-Type', 'text/plain'); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        time.sleep(60)
    def log_message(self, *a):
        pass
h.ThreadingHTTPServer((os.environ['POD_IP'], 8000), H).serve_forever()
"""]


def test_an_unresponsive_pod_and_an_unreachable_prometheus(jobs, prometheus, operator):
    failed_plans, failed_posts = 'pat_operator_regroup_plans_total{outcome="failed"}', \
        'pat_operator_regroup_attempts_total{result="error"}'
    before = operator.metrics()
    doc = job_doc("faulty", SLEEP, HANGING_POD)
    doc["spec"]["generator"]["adaptiveTP"] = {"controller": "operator", "cooldownSeconds": 30,
                                              "prometheus": {"url": prometheus.url, "queryInterval": 0.5}}
    jobs.create(doc)
    jobs.wait("faulty", phase("Running"), "Running")
    job = jobs.wait("faulty", lambda j: condition(j, "MetricsAvailable").get("status") == "True", "metrics read",
                    timeout=60)
    job = jobs.wait("faulty", lambda j: any(e.startswith("RegroupFailed") for e in jobs.events("faulty")),
                    "the plan failed", timeout=60)
    failed = [e for e in jobs.events("faulty") if e.startswith("RegroupFailed")]
    assert "1+1 -> 2 (epoch 1) not applied after 4 attempt(s): TimeoutError" in failed[0], failed
    generator = job["status"]["generators"][0]
    assert generator["desiredEpoch"] == 1 and generator.get("regroups", 0) == 0, generator
    metrics = operator.metrics()  # one plan, four POSTs; the 30 s cooldown holds the next plan back
    assert operator.value(failed_plans, metrics) - operator.value(failed_plans, before) == 1
    assert operator.value(failed_posts, metrics) - operator.value(failed_posts, before) == 4

    prometheus.pause()
    try:
        job = jobs.wait("faulty", lambda j: condition(j, "MetricsAvailable").get("status") == "False",
                        "metrics unavailable", timeout=30)
        unavailable = condition(job, "MetricsAvailable")
        assert unavailable["reason"] == "PrometheusUnreachable" and "keeping the current TP layouts" in \
            unavailable["message"], unavailable
        assert job["status"]["phase"] == "Running"
        assert any(e.startswith("MetricsUnavailable") for e in jobs.events("faulty"))
    finally:
        prometheus.resume()
    jobs.wait("faulty", lambda j: condition(j, "MetricsAvailable").get("status") == "True", "recovered",
              timeout=30)
    assert operator.value('pat_operator_prometheus_errors_total{reason="PrometheusUnreachable"}') >= 1
