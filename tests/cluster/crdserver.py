"""A real Kubernetes 1.36 CRD server on loopback: etcd + k8s.io/apiextensions-apiserver, for the CRD's CEL rules.

The 1.20 control plane (controlplane.py) predates CEL (x-kubernetes-validations came in 1.25); this server is the
CRD half of a current API server: CustomResourceDefinitions and custom resources, with Kubernetes' own OpenAPI
validation, pruning, defaulting and CEL (cost estimator included). It has no core API (no namespaces, pods,
discovery for kubectl), so it is reached through the Python client on /apis/<group>/<version>/... paths.

    python -m tests.cluster.crdserver [--crd crds/rlhfjobs.pat.dev.yaml]   run until Ctrl-C (prints a kubeconfig)

The binaries come from scripts/crd-server-build.sh (which builds them once into ~/.cache/pat-rlhf/ and prints
the folder; it fails loudly when they cannot be had). Authentication is a client certificate in the group
system:masters, verified against --client-ca-file; the delegated authorizer lets that group through without
asking anyone, so the --authentication/--authorization kubeconfigs only need to exist (they point nowhere).
"""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tests.cluster.controlplane import LocalServers, free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "crd-server-build.sh"  # fails loudly (and the tests with it) when it cannot build
CRD_FILE = REPO / "crds" / "rlhfjobs.pat.dev.yaml"
# Without these the server refuses every write with "not yet ready to handle request": the admission plugins and
# priority-and-fairness wait on core objects (namespaces, webhooks, flow schemas) that this server does not have.
DISABLED_ADMISSION = ("NamespaceLifecycle,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,"
                      "ValidatingAdmissionPolicy,MutatingAdmissionPolicy")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """ca.crt/key; server.crt/key for 127.0.0.1; client.crt/key with O=system:masters (EC keys: fast)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "7",
             "-subj", "/CN=pat-crd-server-ca")
    for name, subject, ext in (
            ("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
            ("client", "/O=system:masters/CN=pat-admin", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-new", *ec, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
                 "-subj", subject)
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "7", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.crt"))


def write_kubeconfig(path: Path, server: str, certs: Path) -> Path:
    """JSON is YAML: kubeconfig readers accept it."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "pat",
        "clusters": [{"name": "pat", "cluster": {"server": server, "certificate-authority": str(certs / "ca.crt")}}],
        "users": [{"name": "admin", "user": {"client-certificate": str(certs / "client.crt"),
                                             "client-key": str(certs / "client.key")}}],
        "contexts": [{"name": "pat", "context": {"cluster": "pat", "user": "admin"}}],
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)
    return path


@dataclass
class CrdServer(LocalServers):
    """etcd + apiextensions-apiserver 1.36."""

    NAME: ClassVar[str] = "crd-server"
    BUILD_SCRIPT: ClassVar[Path] = BUILD_SCRIPT

    crds: dict[str, dict] = field(init=False, default_factory=dict)  # installed CRDs as stored, by name

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def _start(self, bin_dir: Path, deadline: float) -> None:
        root, certs = self.root, self.root / "certs"
        certs.mkdir()
        make_certs(certs)
        api_port = free_port()
        etcd = self._spawn_etcd(bin_dir)
        # The server wants a 'core' API server for delegated authn/authz and its informers; none exists, and an
        # unreachable one is fine: client certificates are checked locally, system:masters is always allowed.
        nowhere = write_kubeconfig(root / "nowhere.kubeconfig", "https://127.0.0.1:1", certs)
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("apiextensions-apiserver", [
            str(bin_dir / "apiextensions-apiserver"),
            f"--etcd-servers={etcd}",
            "--bind-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={certs / 'server.crt'}", f"--tls-private-key-file={certs / 'server.key'}",
            f"--client-ca-file={certs / 'ca.crt'}", "--authentication-skip-lookup",
            f"--authentication-kubeconfig={nowhere}", f"--authorization-kubeconfig={nowhere}",
            f"--kubeconfig={nowhere}",
            f"--disable-admission-plugins={DISABLED_ADMISSION}", "--enable-priority-and-fairness=false",
        ])
        self.kubeconfig = str(write_kubeconfig(root / "admin.kubeconfig", self.server, certs))
        # /readyz stays 500 here (it waits on the core API's informers): /healthz is the signal.
        self._wait(deadline, "apiextensions-apiserver /healthz", lambda: self._get("/healthz") == 200)

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        context.load_cert_chain(str(self.certs / "client.crt"), str(self.certs / "client.key"))
        return context

    def _request(self, path: str) -> tuple[urllib.request.Request, ssl.SSLContext] | None:
        return urllib.request.Request(self.server + path), self.ssl_context()

    def api_client(self):  # -> kubernetes.client.ApiClient
        from kubernetes import client
        configuration = client.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = str(self.certs / "ca.crt")
        configuration.cert_file = str(self.certs / "client.crt")
        configuration.key_file = str(self.certs / "client.key")
        return client.ApiClient(configuration)

    def install_crd(self, manifest: dict, timeout: float = 30.0) -> dict:
        """Creates the CRD and waits until it is Established (its API served); returns the stored object. A CRD
        the server refuses (a rule that does not compile or costs too much) raises the client's ApiException."""
        from kubernetes import client
        api = client.ApiextensionsV1Api(self.api_client())
        api.create_custom_resource_definition(manifest, _preload_content=False)
        deadline = time.monotonic() + timeout
        while True:
            stored = json.loads(api.read_custom_resource_definition(manifest["metadata"]["name"],
                                                                     _preload_content=False).data)
            conditions = {c["type"]: c for c in (stored.get("status") or {}).get("conditions") or []}
            if conditions.get("Established", {}).get("status") == "True":
                self.crds[manifest["metadata"]["name"]] = stored
                return stored
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {manifest['metadata']['name']} not Established after {timeout} s: "
                                   f"{list(conditions.values())}")
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    import yaml

    ap = argparse.ArgumentParser(prog="python -m tests.cluster.crdserver", description=__doc__.split("\n\n")[0])
    ap.add_argument("--crd", type=Path, default=CRD_FILE, help="CRD file to install (default: %(default)s)")
    ap.add_argument("--no-crd", action="store_true", help="start the server only")
    args = ap.parse_args(argv)
    server = CrdServer(keep_dir=False).start()
    try:
        if not args.no_crd:
            server.install_crd(yaml.safe_load(args.crd.read_text()))
        print(f"CRD server {server.server} up in {server.startup_seconds:.1f} s; logs in {server.root}")
        print(f"export KUBECONFIG={server.kubeconfig}   # Python client only: no discovery for kubectl")
        sys.stdout.flush()
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    main()
