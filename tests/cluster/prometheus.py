"""A real Prometheus server (the Debian `prometheus` binary, `make prometheus`) that scrapes the cluster's pods.

It scrapes, every second, the container ports named `metrics` or `http` of the pods labelled pat.dev/job; each
series gets the target labels namespace, pod, pat_job and pat_role (from the pod labels pat.dev/job and
pat.dev/role), besides Prometheus' own job ("pat") and instance (pod IP:port). It also scrapes the port `metrics`
of the operator pods the chart installs (job "pat-operator", labels namespace and pod).

Debian builds Prometheus without Kubernetes discovery (its NEWS: "Kubernetes support has been completely removed"),
so PodDiscovery stands in for kubernetes_sd_configs (role: pod): an HTTP service discovery endpoint in the test
process that lists the pods through the API server and labels each container port as that role does. The
relabelling is what a kubernetes_sd_configs job would use, unchanged.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.cluster.controlplane import free_port
from tests.tiers import require

# Discovery's meta labels of the pod labels pat.dev/job and pat.dev/role (`.` and `/` become `_`).
JOB, ROLE = "__meta_kubernetes_pod_label_pat_dev_job", "__meta_kubernetes_pod_label_pat_dev_role"
OPERATOR = "__meta_kubernetes_pod_label_app_kubernetes_io_name"  # the chart's operator pods: pat-operator


def _label_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pods: list[dict]) -> list[dict]:
    """Target groups as kubernetes_sd_configs (role: pod) makes them: one per container port of a pod with an IP
    (it also makes a portless target per pod without ports, which the relabelling here drops anyway)."""
    groups = []
    for pod in pods:
        meta, ip = pod["metadata"], pod["status"].get("podIP")
        if not ip:  # not started yet: nothing to scrape
            continue
        labels = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
                  "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_phase": pod["status"].get("phase", ""),
                  "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", ""),
                  **{f"__meta_kubernetes_pod_label_{_label_name(k)}": v for k, v in meta.get("labels", {}).items()}}
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **labels, "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")}})
    return groups


def installed(tool: str) -> str:
    """The path of `prometheus` or `promtool`; where it is missing, the test fails naming what installs it (the
    tests never skip)."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: `make prometheus` installs it (Debian's prometheus package)",
                    pytrace=False)
    return path


class PodDiscovery:
    """Serves pod_targets of all the cluster's pods at `url`, listing them afresh on each request."""

    def __init__(self, api_server: str, token: str, ca_file: str | None) -> None:
        context = ssl.create_default_context(cafile=ca_file)  # None: the system's CAs, as for a public cluster
        request = urllib.request.Request(api_server + "/api/v1/pods", headers={"Authorization": f"Bearer {token}"})

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    with urllib.request.urlopen(request, context=context, timeout=5) as response:
                        body = json.dumps(pod_targets(json.load(response)["items"])).encode()
                except OSError as e:  # Prometheus keeps the last targets and logs this
                    self.send_error(502, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def handle(self) -> None:
                try:
                    super().handle()
                except ConnectionError:  # Prometheus gave up on the request: it was stopped or paused
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/pods"
        threading.Thread(target=self._server.serve_forever, name="pod-discovery", daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def scrape_config(discovery_url: str) -> dict:
    copy = lambda source, target: {"source_labels": [source], "target_label": target}  # noqa: E731
    return {
        # scrape_timeout must not exceed the interval, and its default (10 s) does.
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{
            "job_name": "pat",
            "metrics_path": "/metrics",
            "http_sd_configs": [{"url": discovery_url, "refresh_interval": "1s"}],
            "relabel_configs": [
                {"action": "keep", "source_labels": [JOB], "regex": ".+"},
                {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                 "regex": "metrics|http"},
                copy("__meta_kubernetes_namespace", "namespace"),
                copy("__meta_kubernetes_pod_name", "pod"),
                copy(JOB, "pat_job"),
                copy(ROLE, "pat_role"),
            ],
        }, {
            # The operator pods the chart installs, as its ServiceMonitor scrapes them (port `metrics`).
            "job_name": "pat-operator",
            "metrics_path": "/metrics",
            "http_sd_configs": [{"url": discovery_url, "refresh_interval": "1s"}],
            "relabel_configs": [
                {"action": "keep", "source_labels": [OPERATOR], "regex": "pat-operator"},
                {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics"},
                copy("__meta_kubernetes_namespace", "namespace"),
                copy("__meta_kubernetes_pod_name", "pod"),
            ],
        }],
    }


def _reachable_host() -> str:
    """Where pods reach the server too (the chart test's operator pod queries it): the process kubelet's HOST_ADDRESS
    where its network is up on this machine, else 127.0.0.1 (which is a pod's own loopback in the pod)."""
    from tests.cluster.kubelet import HOST_ADDRESS

    with socket.socket() as s:
        try:
            s.bind((HOST_ADDRESS, 0))
            return HOST_ADDRESS
        except OSError:
            return "127.0.0.1"


class PrometheusServer:
    """start() runs it on HOST_ADDRESS (or 127.0.0.1: _reachable_host) with its config, data and log under `root`;
    stop() ends it.

    `token` must let it list pods in all namespaces of the API server."""

    def __init__(self, api_server: str, token: str, root: Path, ca_file: str | None = None,
                 host: str | None = None) -> None:
        self.root = root
        self.host = host or _reachable_host()
        self.config_file = root / "prometheus.yml"
        self._api = (api_server, token, ca_file)
        self._log = root / "prometheus.log"
        self._port = free_port()
        self._discovery: PodDiscovery | None = None
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout: float = 30) -> PrometheusServer:
        require("cluster", "Prometheus")
        installed("prometheus")
        self._discovery = PodDiscovery(*self._api)
        self.config_file.write_text(yaml.safe_dump(scrape_config(self._discovery.url), sort_keys=False))
        with open(self._log, "wb") as log:
            self._process = subprocess.Popen(
                ["prometheus", f"--config.file={self.config_file}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address={self.host}:{self._port}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready in {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:  # not listening yet, or 503 while it starts
            return False

    def query(self, promql: str, timeout: float = 5) -> list:
        """An instant query's data.result; raises on an error answer, and OSError when the server does not answer."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # a bad query is a 400 whose body says why
            body = json.load(e)
        if body["status"] != "success":
            raise RuntimeError(f"query {promql!r} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 20, explain: Callable[[], str] = lambda: "") -> list:
        """The query's result once it is not empty; on a timeout the error shows the scrape targets, `explain()`
        (what the caller knows of the scraped side) and the server's log."""
        deadline = time.monotonic() + timeout
        while not (result := self.query(promql)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result for {promql!r} in {timeout} s; targets:\n{self.targets()}\n"
                                   f"{explain()}\nprometheus log:\n{self.log()}")
            time.sleep(0.2)
        return result

    def targets(self) -> str:
        """One line per active scrape target: its job, pod, health and last error (what a failed wait_for needs)."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=5) as response:
                active = json.load(response)["data"]["activeTargets"]
        except OSError as e:
            return f"(targets unavailable: {e})"
        return "\n".join(f"{t['labels'].get('job')} {t['labels'].get('namespace')}/{t['labels'].get('pod')} "
                         f"{t['scrapeUrl']} {t['health']} {t['lastScrapeDuration']:.3f}s {t['lastError']}"
                         for t in active)

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections are accepted by the kernel but never answered."""
        os.kill(self._process.pid, signal.SIGSTOP)
        # Its threads stop one by one: until all have, a running one may still answer a request.
        tasks = Path(f"/proc/{self._process.pid}/task")
        while not all(stat.read_text().rsplit(")", 1)[1].split()[0] == "T" for stat in tasks.glob("*/stat")):
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self._process.pid, signal.SIGCONT)

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self.resume()  # a stopped process would not act on SIGTERM
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._discovery is not None:
            self._discovery.stop()
            self._discovery = None
