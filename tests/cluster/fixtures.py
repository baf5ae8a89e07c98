"""pytest fixtures for tests against a real Kubernetes control plane whose pods run as local processes.

Load with `pytest_plugins = ["tests.cluster.fixtures"]` in the top-level conftest. Nothing starts until a test
asks for `cluster` (or `namespace`); then, once per session:
- $PAT_TEST_KUBECONFIG set: that cluster is used; otherwise a local v1.20.2 control plane starts.
- a ProcessKubelet registers node pat-node-0 (not with PAT_TEST_NO_KUBELET=1; then cluster.kubelet is None).
A test that needs more nodes asks for `extra_node`, which starts them for that test only.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.cluster.controlplane import ControlPlane, ExistingCluster, cluster_from_env, write_kubeconfig
from tests.cluster.prometheus import PrometheusServer
from tests.tiers import starts

if TYPE_CHECKING:
    import kubernetes

    from tests.cluster.kubelet import ProcessKubelet


@dataclass
class Cluster:
    plane: ControlPlane | ExistingCluster
    kubelet: ProcessKubelet | None
    tmp: Path

    @property
    def kubeconfig(self) -> str:
        return self.plane.kubeconfig

    @property
    def server(self) -> str:
        return self.plane.server

    @property
    def ca_file(self) -> str:
        return self.plane.ca_file

    @property
    def admin_token(self) -> str:
        return self.plane.admin_token

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new admin client (close it, or use it as a context manager)."""
        import kubernetes

        return kubernetes.config.new_client_from_config(self.kubeconfig)

    def token_for(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A bound token of that ServiceAccount (TokenRequest API); waits a little for one the controller makes."""
        import kubernetes

        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": seconds}}
        deadline = time.monotonic() + 10
        with self.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            while True:
                try:
                    response = core.create_namespaced_service_account_token(
                        service_account, namespace, request, _preload_content=False)
                    return json.loads(response.data)["status"]["token"]
                except kubernetes.client.ApiException as e:
                    if e.status != 404 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)  # the namespace's `default` ServiceAccount is made right after the namespace

    def wait_for_garbage_collector(self, api_version: str, kind: str, namespace: str, timeout: float = 60) -> None:
        """Wait until the controller-manager's garbage collector handles ownerReferences to `kind`.

        It looks for new resource types (a CRD just created) only every 30 s, and meanwhile retries the objects
        that refer to one with a growing backoff, so a test deleting a custom object right after creating its
        CRD could wait a minute for the owned objects to go. The probe: a ConfigMap whose owner of that kind
        does not exist, made afresh each second, is deleted as soon as the collector knows the kind."""
        import kubernetes

        deadline = time.monotonic() + timeout
        with self.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            while True:
                name = f"gc-probe-{secrets.token_hex(4)}"
                owner = {"apiVersion": api_version, "kind": kind, "name": name, "uid": str(uuid.uuid4())}
                core.create_namespaced_config_map(namespace, {"metadata": {"name": name, "ownerReferences": [owner]}},
                                                  _preload_content=False)
                probe_deadline = time.monotonic() + 1
                while time.monotonic() < probe_deadline:
                    try:
                        core.read_namespaced_config_map(name, namespace, _preload_content=False)
                    except kubernetes.client.ApiException as e:
                        if e.status == 404:
                            return
                        raise
                    time.sleep(0.05)
                core.delete_namespaced_config_map(name, namespace, _preload_content=False)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the garbage collector did not pick up {kind} ({api_version}) in {timeout} s")

    def kubeconfig_for_token(self, token: str) -> str:
        """A kubeconfig file that authenticates with that token only (for a program under test)."""
        path = self.tmp / f"token-{secrets.token_hex(4)}.kubeconfig"
        return str(write_kubeconfig(path, self.server, self.ca_file, token, user="token"))


@pytest.fixture(scope="session")
@starts("cluster")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    plane = cluster_from_env().start()
    kubelet = None
    try:
        if os.environ.get("PAT_TEST_NO_KUBELET") != "1":
            from tests.cluster.kubelet import ProcessKubelet

            # Under pytest's tmp dir: the pods' logs outlive the session (pytest keeps the last three).
            kubelet = ProcessKubelet(plane.kubeconfig, root=tmp_path_factory.mktemp("kubelet")).start()
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            where = f"; pod logs under {kubelet.root / 'logs'}" if kubelet else ""
            reporter.write_line(f"\ncluster {plane.server} ready in {plane.startup_seconds:.1f} s{where}")
        yield Cluster(plane, kubelet, tmp_path_factory.mktemp("cluster"))
    finally:
        if kubelet:
            kubelet.stop()
        plane.stop()


@pytest.fixture
def extra_node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ProcessKubelet]]:
    """extra_node() starts one more node in the cluster (a ProcessKubelet, node pat-node-1, then pat-node-2, ...; or
    extra_node(name, gpus=..., labels=...)) and returns it. After the test each is stopped and its Node and Lease are
    deleted, so that no later test's pod is scheduled onto it; its pods' objects are left to the `namespace` fixture
    (force-deleted) or the pod garbage collector (pods of a deleted node)."""
    if cluster.kubelet is None:
        pytest.fail("this test starts nodes: it needs the process kubelet, which PAT_TEST_NO_KUBELET=1 turned off",
                    pytrace=False)
    import kubernetes

    from tests.cluster.kubelet import ProcessKubelet

    started: list[ProcessKubelet] = []

    def start(name: str | None = None, **kwargs: object) -> ProcessKubelet:
        name = name or f"pat-node-{len(started) + 1}"
        kubelet = ProcessKubelet(cluster.kubeconfig, node_name=name, root=tmp_path_factory.mktemp(name), **kwargs)
        started.append(kubelet.start())
        return kubelet

    yield start
    with cluster.api_client() as api:
        core, leases = kubernetes.client.CoreV1Api(api), kubernetes.client.CoordinationV1Api(api)
        for kubelet in started:
            kubelet.stop()
            for delete in (lambda: core.delete_node(kubelet.node_name, _preload_content=False),
                           lambda: leases.delete_namespaced_lease(kubelet.node_name, "kube-node-lease",
                                                                  _preload_content=False)):
                try:
                    delete()
                except kubernetes.client.ApiException as e:
                    if e.status != 404:
                        raise


@pytest.fixture(scope="session")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping the cluster's pods labelled pat.dev/job (see tests/cluster/prometheus.py)."""
    if not cluster.admin_token:  # its pod discovery lists the pods of all namespaces
        pytest.fail("Prometheus' pod discovery needs a token of the cluster's admin: PAT_TEST_KUBECONFIG's kubeconfig "
                    "has none", pytrace=False)
    server = PrometheusServer(cluster.server, cluster.admin_token, tmp_path_factory.mktemp("prometheus"),
                              cluster.ca_file or None).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def core(cluster: Cluster) -> Iterator[kubernetes.client.CoreV1Api]:
    """The admin's CoreV1Api, one client per test module."""
    import kubernetes

    with cluster.api_client() as api:
        yield kubernetes.client.CoreV1Api(api)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test; its pods are force-deleted afterwards (so the kubelet kills their
    processes at once) and the namespace is deleted without waiting for it to finish terminating."""
    import kubernetes

    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50].rstrip("-")
    name = f"{name}-{secrets.token_hex(3)}"
    with cluster.api_client() as api:
        core = kubernetes.client.CoreV1Api(api)
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                              _preload_content=False)
        yield name
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0, _preload_content=False)
        core.delete_namespace(name, _preload_content=False)
