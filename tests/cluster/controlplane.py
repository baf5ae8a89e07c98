"""A real Kubernetes v1.20.2 control plane on loopback: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

No kubelet and no container runtime: tests.cluster.kubelet.ProcessKubelet runs the pods as local processes.

For a person: `make cluster` (tests/cluster/local.py) runs one with a kubelet, Prometheus and the operator.

The binaries come from $KUBEBUILDER_ASSETS or scripts/controlplane-build.sh (which builds them once into a cache).
$PAT_TEST_KUBECONFIG names an existing cluster to use instead (kind, minikube, a real one): see cluster_from_env.
This module needs only the standard library (attach_existing needs PyYAML, a project dependency).
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Self
from pathlib import Path

from pat_workers.ports import free_port
from tests.tiers import require

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "controlplane-build.sh"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
# The API server's audit log keeps what service accounts list and watch (with the query string): the tests read it
# to see what the operator asks the server for. Everything else is not logged.
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], "rules": [
    {"level": "Metadata", "userGroups": ["system:serviceaccounts"], "verbs": ["list", "watch"]},
    {"level": "None"}]}


def built(script: Path) -> Path:
    """The folder a build script prints on its last line: it builds once into its cache (minutes) and fails loudly
    when it cannot; so does this, for the tests never skip without the binaries."""
    result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed with exit code {result.returncode} (its stderr is above)")
    return Path(result.stdout.strip().splitlines()[-1])


def write_kubeconfig(path: Path, server: str, ca_file: str | None, token: str, user: str = "admin") -> Path:
    """JSON is YAML: every kubeconfig reader (kubectl, client-go, the Python client) accepts it."""
    cluster: dict = {"server": server}
    if ca_file:
        cluster["certificate-authority"] = str(ca_file)
    else:
        cluster["insecure-skip-tls-verify"] = True
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "pat",
        "clusters": [{"name": "pat", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "pat", "context": {"cluster": "pat", "user": user}}],
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)
    return path


@dataclass
class Component:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class LocalServers:
    """Server processes in a temp dir on loopback, etcd first: start() (or `with`) runs them, stop() kills them and
    removes the dir. A subclass names its build script and starts its servers in _start()."""

    NAME: ClassVar[str]  # of the temp dir and the logs
    BUILD_SCRIPT: ClassVar[Path]

    bin_dir: Path | None = None  # default: the build script's cache
    keep_dir: bool = False  # leave the temp dir (logs, data) behind after stop, for debugging
    root: Path = field(init=False)
    server: str = field(init=False, default="")
    kubeconfig: str = field(init=False, default="")
    startup_seconds: float = field(init=False, default=0.0)
    components: list[Component] = field(init=False, default_factory=list)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> Self:
        require("cluster", f"the {self.NAME}")
        bin_dir = self.bin_dir or built(self.BUILD_SCRIPT)
        started = time.monotonic()
        self.root = Path(tempfile.mkdtemp(prefix=f"pat-{self.NAME}-"))
        atexit.register(self.stop)  # a test process that dies of an exception leaves no servers behind
        try:
            self._start(bin_dir, started + timeout)
        except BaseException:
            sys.stderr.write(self.describe_logs())
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _start(self, bin_dir: Path, deadline: float) -> None:
        raise NotImplementedError

    def _spawn_etcd(self, bin_dir: Path) -> str:
        """etcd on two free ports; returns its client URL."""
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self._spawn("etcd", [
            str(bin_dir / "etcd"), "--data-dir", str(self.root / "etcd"), "--unsafe-no-fsync", "--log-level=warn",
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
        ])
        return client

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # own process group: stop() signals its children too
        self.components.append(Component(name, process, log))

    def _request(self, path: str) -> tuple[urllib.request.Request, ssl.SSLContext] | None:
        """An authenticated GET of the API server's path, once its credentials exist."""
        raise NotImplementedError

    def _get(self, path: str) -> int:
        if (request := self._request(path)) is None:
            return 0
        try:
            with urllib.request.urlopen(request[0], context=request[1], timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ssl.SSLError):
            return 0

    def _wait(self, deadline: float, what: str, ok: Callable[[], bool]) -> None:
        while not ok():
            for c in self.components:
                if c.process.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with code {c.process.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def describe_logs(self) -> str:
        lines = [f"{self.NAME} logs under {getattr(self, 'root', '?')}:"]
        for c in self.components:
            tail = c.log.read_text(errors="replace").splitlines()[-15:] if c.log.exists() else []
            lines.append(f"--- {c.name} ({c.log}), last lines:")
            lines.extend(tail)
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        atexit.unregister(self.stop)
        # etcd last: an apiserver that loses it first stalls its shutdown.
        clients = [c for c in self.components if c.name != "etcd"]
        for group in (clients, [c for c in self.components if c.name == "etcd"]):
            for c in group:
                _signal_group(c.process, signal.SIGTERM)
            for c in group:
                try:
                    c.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _signal_group(c.process, signal.SIGKILL)
                    c.process.wait()
        self.components.clear()
        if not self.keep_dir and getattr(self, "root", None):
            shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class ControlPlane(LocalServers):
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2."""

    NAME: ClassVar[str] = "controlplane"
    BUILD_SCRIPT: ClassVar[Path] = BUILD_SCRIPT

    admin_token: str = field(init=False, default="")
    ca_file: str = field(init=False, default="")

    @property
    def audit_log(self) -> Path:
        """JSON lines, one per list or watch of a service account (AUDIT_POLICY)."""
        return self.root / "audit.log"

    def _start(self, bin_dir: Path, deadline: float) -> None:
        root = self.root
        api_port = free_port()
        self.admin_token = secrets.token_hex(16)
        (root / "tokens.csv").write_text(f"{self.admin_token},admin,admin,system:masters\n")
        sa_key = root / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)

        etcd = self._spawn_etcd(bin_dir)
        cert_dir = root / "certs"
        (root / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        self._spawn("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", "--insecure-port=0", f"--cert-dir={cert_dir}",
            f"--token-auth-file={root / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            "--service-cluster-ip-range=10.96.0.0/16", "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
            # The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints validation rejects.
            "--endpoint-reconciler-type=none",
            f"--audit-policy-file={root / 'audit-policy.json'}", f"--audit-log-path={self.audit_log}",
        ])
        self.server = f"https://127.0.0.1:{api_port}"
        # The apiserver writes a self-signed serving cert (valid for 127.0.0.1) followed by its CA into one file.
        self.ca_file = str(cert_dir / "apiserver.crt")
        self._wait(deadline, "kube-apiserver /readyz", lambda: self._get("/readyz") == 200)
        self.kubeconfig = str(write_kubeconfig(root / "admin.kubeconfig", self.server, self.ca_file, self.admin_token))

        self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
            "--use-service-account-credentials=false",
            f"--service-account-private-key-file={sa_key}", f"--root-ca-file={self.ca_file}",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])
        self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])
        # The controller-manager is working once it has made the default ServiceAccount (namespaces need it).
        self._wait(deadline, "the controller-manager's default ServiceAccount",
                   lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default") == 200)

    def _request(self, path: str) -> tuple[urllib.request.Request, ssl.SSLContext] | None:
        if not Path(self.ca_file).exists():  # the apiserver writes it as it starts
            return None
        return (urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"}),
                ssl.create_default_context(cafile=self.ca_file))


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class ExistingCluster:
    """The cluster of an existing kubeconfig; stop() leaves it alone. admin_token is empty for certificate users."""

    kubeconfig: str
    server: str = ""
    ca_file: str = ""
    admin_token: str = ""
    startup_seconds: float = 0.0
    _written_ca: bool = False  # ca_file is a temp file this object wrote from certificate-authority-data

    def __post_init__(self) -> None:
        import yaml  # only this path reads YAML kubeconfigs

        config = yaml.safe_load(Path(self.kubeconfig).read_text())
        context_name = config.get("current-context")
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next((u["user"] for u in config.get("users", []) if u["name"] == context.get("user")), {})
        self.server = cluster["server"]
        self.admin_token = user.get("token", "")
        if "certificate-authority-data" in cluster:
            fd, path = tempfile.mkstemp(prefix="pat-cluster-ca-", suffix=".crt")
            os.write(fd, base64.b64decode(cluster["certificate-authority-data"]))
            os.close(fd)
            self.ca_file, self._written_ca = path, True
        elif "certificate-authority" in cluster:
            self.ca_file = str(Path(self.kubeconfig).parent / cluster["certificate-authority"])

    def start(self) -> ExistingCluster:
        return self

    def stop(self) -> None:
        if self._written_ca:
            os.unlink(self.ca_file)


def cluster_from_env() -> ControlPlane | ExistingCluster:
    """The cluster $PAT_TEST_KUBECONFIG names, or a fresh local control plane (not started yet)."""
    path = os.environ.get("PAT_TEST_KUBECONFIG")
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"PAT_TEST_KUBECONFIG={path} is not a file")
        return ExistingCluster(path)
    return ControlPlane()
