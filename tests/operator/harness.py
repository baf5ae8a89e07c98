"""Installs what the chart installs (CRDs, peering object, ServiceAccount, the chart's RBAC rules) into a real API
server and runs `pat-operator` as a subprocess with only that ServiceAccount's token. Used by the operator tests
and, through local_stack(), by the benchmarks under bench/."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from pat_operator import crd
from tests.cluster.controlplane import free_port

ROOT = Path(__file__).parents[2]
RULES = ROOT / "charts" / "pat-operator" / "files" / "operator-rules.yaml"
PEERING_CRDS = ROOT / "crds" / "kopf-peering.yaml"
SYSTEM_NAMESPACE = "pat-system"
SERVICE_ACCOUNT = "pat-operator"
PEERING = "pat-operator"


def _create(fn, *args) -> None:
    try:
        fn(*args)
    except ApiException as e:
        if e.status != 409:
            raise


def install(api: kubernetes.client.ApiClient) -> None:
    """CRDs, the peering object and the operator's ServiceAccount with the chart's ClusterRole; idempotent."""
    ext = kubernetes.client.ApiextensionsV1Api(api)
    for doc in [crd.manifest(), *yaml.safe_load_all(PEERING_CRDS.read_text())]:
        _create(ext.create_custom_resource_definition, doc)
    for name in (crd.manifest()["metadata"]["name"], "clusterkopfpeerings.kopf.dev"):
        _wait(lambda: any(c.type == "Established" and c.status == "True"
                          for c in ext.read_custom_resource_definition(name).status.conditions or []), f"CRD {name}")
    custom = kubernetes.client.CustomObjectsApi(api)
    _create(custom.create_cluster_custom_object, "kopf.dev", "v1", "clusterkopfpeerings",
            {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}})
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    _create(core.create_namespace, {"metadata": {"name": SYSTEM_NAMESPACE}})
    _create(core.create_namespaced_service_account, SYSTEM_NAMESPACE, {"metadata": {"name": SERVICE_ACCOUNT}})
    _create(rbac.create_cluster_role, {"metadata": {"name": SERVICE_ACCOUNT},
                                       "rules": yaml.safe_load(RULES.read_text())})
    _create(rbac.create_cluster_role_binding, {
        "metadata": {"name": SERVICE_ACCOUNT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": SERVICE_ACCOUNT},
        "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": SYSTEM_NAMESPACE}]})


def _wait(ok, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.2)


class OperatorProcess:
    """`pat-operator` as a subprocess, authenticated as its ServiceAccount. `prelude`: Python run before main(),
    e.g. to stand in for another release of the operator."""

    def __init__(self, kubeconfig: str, workdir: Path, *extra: str, prelude: str = ""):
        self.kubeconfig, self.workdir, self.extra, self.prelude = kubeconfig, workdir, list(extra), prelude
        workdir.mkdir(parents=True, exist_ok=True)
        self.key_file = workdir / "token-key"
        if not self.key_file.exists():
            self.key_file.write_text(secrets.token_hex(32))
        self.metrics_port, self.liveness_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_file(self) -> Path:
        return self.workdir / f"operator.{self.starts}.log"

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        self.starts += 1
        entry = ["-c", f"{self.prelude}\nimport sys\nfrom pat_operator.main import main\nsys.exit(main(sys.argv[1:]))"
                 ] if self.prelude else ["-m", "pat_operator.main"]
        argv = [sys.executable, *entry, "--kubeconfig", self.kubeconfig, "--token-key-file",
                str(self.key_file), "--metrics-port", str(self.metrics_port), "--liveness-port",
                str(self.liveness_port), "--bind", "127.0.0.1", "--peering", PEERING, *self.extra]
        self.proc = subprocess.Popen(argv, stdout=open(self.log_file, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.live():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pat-operator did not start:\n{self.log()}")
            time.sleep(0.2)
        return self

    def live(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def value(self, series: str, metrics: str | None = None) -> float:
        """One sample of /metrics (now, or of an earlier `metrics()` text), e.g. 'x_total{result="ok"}'; 0 if absent."""
        text = self.metrics() if metrics is None else metrics
        return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")),
                    0.0)

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def local_stack(tmp: Path, *operator_args: str, prometheus: bool = False) -> Iterator[tuple]:
    """Outside pytest (the benchmarks): the control plane, the process kubelet, the installed operator running
    with `operator_args`, and optionally a Prometheus scraping the pods. Yields (cluster, operator, prometheus)."""
    from tests.cluster.controlplane import cluster_from_env
    from tests.cluster.fixtures import Cluster
    from tests.cluster.kubelet import ProcessKubelet
    from tests.cluster.prometheus import PrometheusServer

    plane = cluster_from_env().start()
    kubelet = ProcessKubelet(plane.kubeconfig, root=tmp / "kubelet").start()
    operator = server = None
    try:
        cluster = Cluster(plane, kubelet, tmp)
        install(cluster.api_client())
        kubeconfig = cluster.kubeconfig_for_token(cluster.token_for(SYSTEM_NAMESPACE, SERVICE_ACCOUNT))
        operator = OperatorProcess(kubeconfig, tmp / "operator", *operator_args).start()
        if prometheus:
            (tmp / "prometheus").mkdir(exist_ok=True)
            server = PrometheusServer(cluster.server, cluster.admin_token, tmp / "prometheus",
                                      cluster.ca_file or None).start()
        yield cluster, operator, server
    finally:
        for part in (server, operator):
            if part is not None:
                part.stop()
        kubelet.stop()
        plane.stop()
