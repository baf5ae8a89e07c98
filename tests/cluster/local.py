"""`make cluster`: the local cluster for a person to try the operator on, as on a real cluster.

    python -m tests.cluster.local [--no-operator] [--gpus N]

Starts the control plane (v1.20.2), the process kubelet (node pat-node-0), a Prometheus scraping the pods, and
the operator installed by the Helm chart (a pod of its own, with the chart's RBAC), then prints the lines to
export and waits; Ctrl-C (or SIGTERM) stops everything and removes it. Then, in another shell:

    kubectl apply -f examples/local.yaml
    kubectl get rlhfjobs -w
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run by path: the repository's root on sys.path, as with -m
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.controlplane import cluster_from_env  # noqa: E402
from tests.cluster.helm import CHART, Helm  # noqa: E402
from tests.cluster.kubelet import ProcessKubelet  # noqa: E402
from tests.cluster.prometheus import PrometheusServer  # noqa: E402

RELEASE, NAMESPACE = "pat", "pat-system"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-operator", action="store_true", help="no Helm release (run pat-operator yourself)")
    ap.add_argument("--gpus", type=int, default=16, help="nvidia.com/gpu the node offers (the pods run on CPU)")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell's background job starts with it ignored
        signal.signal(sig, lambda *_: stop.set())
    root = Path(tempfile.mkdtemp(prefix="pat-cluster-"))
    started = time.monotonic()
    plane = cluster_from_env().start()
    kubelet = prometheus = None
    try:
        kubelet = ProcessKubelet(plane.kubeconfig, gpus=args.gpus, root=root / "kubelet").start()
        print(f"# control plane up in {plane.startup_seconds:.1f} s ({plane.server}); node {kubelet.node_name}, "
              f"pod logs under {kubelet.root}/logs", flush=True)
        (root / "prometheus").mkdir()
        prometheus = PrometheusServer(plane.server, plane.admin_token, root / "prometheus",
                                      plane.ca_file or None).start()
        print(f"# Prometheus {prometheus.url} scrapes the jobs' pods", flush=True)
        helm = Helm(root / "helm", plane.kubeconfig)
        if not args.no_operator:
            helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--wait", "--timeout", "3m",
                 "--set", f"prometheusURL={prometheus.url}")
            print(f"# the operator runs: helm release {RELEASE} in {NAMESPACE} "
                  f"(ready {time.monotonic() - started:.0f} s after the start)", flush=True)
        print(f"export KUBECONFIG={plane.kubeconfig}\n"
              f"export PATH={helm.bin}:$PATH  # kubectl 1.33 and helm 3.18, if you have none\n"
              f"# then: kubectl apply -f examples/local.yaml; kubectl get rlhfjobs -w   (Ctrl-C here stops all)",
              flush=True)
        stop.wait()
        print("# stopping", flush=True)
    finally:
        for part in (prometheus, kubelet, plane):
            if part is not None:
                part.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
