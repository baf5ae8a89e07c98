"""The real Prometheus of the tests: it discovers the cluster's pods and scrapes only those labelled pat.dev/job."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from tests.cluster.fixtures import Cluster
from tests.cluster.prometheus import PrometheusServer, installed
from tests.cluster.test_cluster import PYTHON, create_pods, pod_manifest, wait_for, wait_pod

pytestmark = pytest.mark.cluster

METRICS_SERVER = r"""
import http.server, os
BODY = b'# TYPE pat_generator_requests_running gauge\npat_generator_requests_running{group="0-0"} 3\n'
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["IP"], 8080), Metrics).serve_forever()
"""


def metrics_pod(name: str, labels: dict[str, str], port_name: str) -> dict:
    pod = pod_manifest(name, [PYTHON, "-c", METRICS_SERVER], container={
        "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": port_name, "containerPort": 8080}]})
    pod["metadata"]["labels"].update(labels)
    return pod


def dropped_pods(prometheus: PrometheusServer, namespace: str) -> set[str]:
    """The pods of `namespace` that discovery found and relabelling dropped."""
    with urllib.request.urlopen(prometheus.url + "/api/v1/targets?state=dropped", timeout=5) as response:
        targets = json.load(response)["data"]["droppedTargets"]
    return {t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in targets
            if t["discoveredLabels"].get("__meta_kubernetes_namespace") == namespace}


def test_only_labelled_pods_metrics_ports_are_scraped(cluster: Cluster, core, namespace: str,
                                                      prometheus: PrometheusServer):
    create_pods(core, namespace,
                metrics_pod("demo", {"pat.dev/job": "demo", "pat.dev/role": "generator"}, "http"),
                metrics_pod("unlabelled", {}, "http"),  # the same metric, but no pat.dev/job
                metrics_pod("other-port", {"pat.dev/job": "demo"}, "grpc"))
    ips = {name: wait_pod(cluster, core, namespace, name, lambda p: p["status"].get("phase") == "Running",
                          "to run")["status"]["podIP"] for name in ("demo", "unlabelled", "other-port")}

    series = prometheus.wait_for(
        f'pat_generator_requests_running{{namespace="{namespace}", pod="demo", pat_job="demo"}}', timeout=20)
    assert [s["metric"] for s in series] == [{
        "__name__": "pat_generator_requests_running", "group": "0-0", "instance": f"{ips['demo']}:8080",
        "job": "pat", "namespace": namespace, "pod": "demo", "pat_job": "demo", "pat_role": "generator"}]
    assert series[0]["value"][1] == "3"

    # The other two were discovered with it and dropped; two more scrape intervals show nothing of theirs.
    wait_for(lambda: dropped_pods(prometheus, namespace) >= {"unlabelled", "other-port"}, 10,
             "the other two pods among the dropped targets")
    time.sleep(2)
    scraped = prometheus.query(f'pat_generator_requests_running{{namespace="{namespace}"}}')
    assert {s["metric"]["pod"] for s in scraped} == {"demo"}, prometheus.log()


def test_a_paused_prometheus_does_not_answer_until_resumed(prometheus: PrometheusServer):
    prometheus.pause()
    try:
        with pytest.raises(TimeoutError):
            prometheus.query("vector(1)", timeout=1)
    finally:
        prometheus.resume()
    assert prometheus.query("vector(1)")[0]["value"][1] == "1"


def test_bad_queries_raise(prometheus: PrometheusServer):
    with pytest.raises(RuntimeError, match="bad_data"):
        prometheus.query("sum(")


def test_config_passes_promtool(prometheus: PrometheusServer):
    result = subprocess.run([installed("promtool"), "check", "config", str(prometheus.config_file)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
