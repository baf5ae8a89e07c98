"""Installs what the chart installs (the CRD, ServiceAccount, the chart's RBAC rules and the Role for the Lease and
the token-key Secret) into a real API server and runs `pat-operator` as a subprocess with only that ServiceAccount's
token, with leader election on one Lease in pat-system. Used by the operator tests and, through local_stack(), by the
benchmarks under bench/."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
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
SYSTEM_NAMESPACE = "pat-system"
SERVICE_ACCOUNT = "pat-operator"
LEASE = "pat-operator"  # of every OperatorProcess unless it names another: one of them acts at a time
TOKEN_KEY_SECRET = "pat-operator-token-key"


def _create(fn, *args) -> None:
    try:
        fn(*args)
    except ApiException as e:
        if e.status != 409:
            raise


def install(api: kubernetes.client.ApiClient) -> None:
    """The CRD and the operator's ServiceAccount with the chart's ClusterRole, and in pat-system the chart's Role for
    the Lease and the token-key Secret; idempotent."""
    ext = kubernetes.client.ApiextensionsV1Api(api)
    _create(ext.create_custom_resource_definition, crd.manifest())
    name = crd.manifest()["metadata"]["name"]
    _wait(lambda: any(c.type == "Established" and c.status == "True"
                      for c in ext.read_custom_resource_definition(name).status.conditions or []), f"CRD {name}")
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    _create(core.create_namespace, {"metadata": {"name": SYSTEM_NAMESPACE}})
    _create(core.create_namespaced_service_account, SYSTEM_NAMESPACE, {"metadata": {"name": SERVICE_ACCOUNT}})
    subjects = [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": SYSTEM_NAMESPACE}]
    _create(rbac.create_cluster_role, {"metadata": {"name": SERVICE_ACCOUNT},
                                       "rules": yaml.safe_load(RULES.read_text())})
    _create(rbac.create_cluster_role_binding, {
        "metadata": {"name": SERVICE_ACCOUNT}, "subjects": subjects,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": SERVICE_ACCOUNT}})
    own = f"{SERVICE_ACCOUNT}-self"  # as the chart's templates/rbac.yaml: create cannot be limited to a name
    _create(rbac.create_namespaced_role, SYSTEM_NAMESPACE, {"metadata": {"name": own}, "rules": [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [LEASE],
         "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [TOKEN_KEY_SECRET], "verbs": ["get"]}]})
    _create(rbac.create_namespaced_role_binding, SYSTEM_NAMESPACE, {
        "metadata": {"name": own}, "subjects": subjects,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": own}})


def _wait(ok, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.2)


class OperatorProcess:
    """`pat-operator` as a subprocess, authenticated as its ServiceAccount, competing for the Lease `lease` in
    pat-system ('' for no leader election); its holderIdentity is `<workdir name>-<pid>`. `prelude`: Python run
    before main(), e.g. to stand in for another release of the operator. `supervised`: started again whenever it
    exits on its own, as its Deployment's kubelet would (a leader that misses its renew deadline on a starved API
    server exits by design); not after stop() or kill()."""

    running: set[OperatorProcess] = set()  # of this process (a pytest worker): those started and not stopped

    def __init__(self, kubeconfig: str, workdir: Path, *extra: str, prelude: str = "", lease: str = LEASE,
                 supervised: bool = False):
        self.kubeconfig, self.workdir, self.extra, self.prelude = kubeconfig, workdir, list(extra), prelude
        self.lease, self.supervised = lease, supervised
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

    @property
    def identity(self) -> str:
        return f"{self.workdir.name}-{self.proc.pid}" if self.proc else ""

    def start(self, timeout: float = 60.0, lead: bool = True) -> OperatorProcess:
        """Starts it and waits until it is live, and unless `lead` is False until it holds the Lease (it acts)."""
        self.starts += 1
        entry = ["-c", f"{self.prelude}\nimport sys\nfrom pat_operator.main import main\nsys.exit(main(sys.argv[1:]))"
                 ] if self.prelude else ["-m", "pat_operator.main"]
        argv = [sys.executable, *entry, "--kubeconfig", self.kubeconfig, "--token-key-file",
                str(self.key_file), "--metrics-port", str(self.metrics_port), "--liveness-port",
                str(self.liveness_port), "--bind", "127.0.0.1", "--operator-namespace", SYSTEM_NAMESPACE,
                "--leader-election-lease", self.lease, *self.extra]
        self.proc = subprocess.Popen(argv, stdout=open(self.log_file, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "POD_NAME": self.workdir.name},
                                     start_new_session=True)
        OperatorProcess.running.add(self)
        if self.supervised:
            threading.Thread(target=self._supervise, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not (self.live() and (not lead or self.leading())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pat-operator did not {'start' if self.live() else 'lead'} (Lease held by "
                                   f"{self.holder()!r}):\n{self.log()}")
            time.sleep(0.2)
        return self

    def _supervise(self, proc: subprocess.Popen) -> None:
        proc.wait()
        time.sleep(1.0)  # stop() and kill() clear self.proc once the process is gone
        if self.proc is proc:
            print(f"pat-operator {self.workdir.name} exited with {proc.returncode}: started again",
                  file=sys.stderr, flush=True)
            self.start(lead=False)

    def holder(self) -> str | None:
        """The holderIdentity of its Lease, read with its own credentials (None: no Lease)."""
        with kubernetes.config.new_client_from_config(self.kubeconfig) as api:
            try:
                lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(
                    self.lease, SYSTEM_NAMESPACE, _request_timeout=10)
            except ApiException as e:
                if e.status == 404:
                    return None
                raise
        return lease.spec.holder_identity or ""

    def leading(self) -> bool:
        """Whether it acts: it holds the Lease, or runs without leader election."""
        return self.proc is not None and self.proc.poll() is None and (not self.lease or
                                                                        self.holder() == self.identity)

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
        OperatorProcess.running.discard(self)

    def kill(self) -> None:
        """SIGKILL, as a node lost or an OOM would: no cleanup, the Lease is not released."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        OperatorProcess.running.discard(self)

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def alone() -> Iterator[None]:
    """No OperatorProcess of this process runs in the block (a test whose own operator watches the whole cluster:
    another would reconcile its jobs too); those stopped for it are started again after."""
    paused = list(OperatorProcess.running)
    for operator in paused:
        operator.stop()
    try:
        yield
    finally:
        for operator in paused:
            operator.start()


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
