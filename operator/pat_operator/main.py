"""`pat-operator`: the RLHFJob operator (kopf), with peering, a liveness endpoint and Prometheus metrics.

  pat-operator [--namespace NS ...] [--token-key-file F] [--metrics-port 8080] [--liveness-port 8081] ...

Watches every namespace unless --namespace is given. The token key (any secret bytes, the same for every replica,
e.g. from a Secret the chart creates) signs the per-job tokens; without one the operator refuses to start, since a
random key would make the pods' tokens unknown to the next operator process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import kopf
import kubernetes
from prometheus_client import start_http_server

from . import builders, handlers  # handlers: registers them
from .autoscaler import AutoscaleSettings
from .operator_metrics import OperatorMetrics
from .reconcile import Settings

PEERING = "pat-operator"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pat-operator", description="the RLHFJob operator")
    ap.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces "
                    "(repeatable); default: all")
    ap.add_argument("--kubeconfig", help="default: in-cluster service account, else $KUBECONFIG / ~/.kube/config")
    ap.add_argument("--token-key-file", default=os.environ.get("PAT_TOKEN_KEY_FILE", "/etc/pat-operator/token-key"),
                    help="secret bytes that the per-job tokens are derived from (env PAT_TOKEN_KEY_FILE)")
    ap.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics (0: off)")
    ap.add_argument("--liveness-port", type=int, default=8081, help="/healthz (0: off)")
    ap.add_argument("--bind", default="0.0.0.0", help="address of the metrics and liveness endpoints")
    ap.add_argument("--peering", default=PEERING, help="the (Cluster)KopfPeering object shared by the replicas; "
                    "'' to run standalone (only ever one replica)")
    ap.add_argument("--priority", type=int, default=0, help="peering priority: of two replicas the higher acts; "
                    "with equal priorities both pause")
    ap.add_argument("--restart-backoff-seconds", type=float, default=10.0,
                    help="wait before the first gang restart; doubled for each next one")
    ap.add_argument("--restart-backoff-max-seconds", type=float, default=300.0)
    ap.add_argument("--prometheus-url", help="Prometheus for adaptiveTP.controller=operator jobs that name none, "
                    "e.g. http://prometheus-server.monitoring:9090")
    ap.add_argument("--metrics-max-age-seconds", type=float, default=5.0,
                    help="samples scraped longer ago than this are stale: never acted on")
    ap.add_argument("--regroup-attempts", type=int, default=4, help="POSTs of a regroup plan before it fails")
    ap.add_argument("--regroup-timeout-seconds", type=float, default=10.0, help="the longest one POST of a plan "
                    "waits for the pod's acknowledgement")
    ap.add_argument("--verbose", "-v", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        token_key = Path(args.token_key_file).read_bytes().strip()
    except OSError as e:
        print(f"pat-operator: --token-key-file {args.token_key_file}: {e.strerror}; give a file of secret bytes "
              f"(the chart mounts one from a Secret)", file=sys.stderr)
        return 2
    if len(token_key) < 16:
        print(f"pat-operator: --token-key-file {args.token_key_file} holds {len(token_key)} bytes; use at least 16",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    api = _api_client(args.kubeconfig)
    metrics = OperatorMetrics()
    memo = kopf.Memo(pat=handlers.Memo(api=api, token_key=token_key, metrics=metrics, settings=Settings(
        restart_backoff_seconds=args.restart_backoff_seconds,
        restart_backoff_max_seconds=args.restart_backoff_max_seconds), prometheus_url=args.prometheus_url,
        autoscale=AutoscaleSettings(max_age_seconds=args.metrics_max_age_seconds, attempts=args.regroup_attempts,
                                    ack_timeout_seconds=args.regroup_timeout_seconds)))

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.peering.clusterwide = not args.namespace
        settings.peering.mandatory = bool(args.peering)
        settings.peering.standalone = not args.peering
        settings.peering.name = args.peering or PEERING
        settings.peering.priority = args.priority
        settings.peering.stealth = True
        # kopf's own bookkeeping goes to annotations: the status is the operator's, written whole.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pat.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="pat.dev")
        settings.posting.reporting_component = "pat-operator"
        # No watching of CRDs and namespaces (nor the RBAC for it): the CRD is installed before the operator, and
        # --namespace names namespaces exactly.
        settings.scanning.disabled = True
        # Only the job's pods, selected by the API server: kopf's handler filters work on the client side, so
        # without this every pod of the cluster would stream into the operator.
        settings.watching.label_selectors["pods"] = builders.LABEL_JOB
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        if args.metrics_port:
            start_http_server(args.metrics_port, addr=args.bind, registry=metrics.registry)

    @kopf.on.login()
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the API client above. In a pod: the client library's in-cluster config, which
        # takes the server from KUBERNETES_SERVICE_HOST/PORT (kopf's own service-account login assumes the DNS
        # name kubernetes.default.svc on port 443). Outside: kopf's kubeconfig login (the client library's reads
        # $KUBECONFIG too early for --kubeconfig).
        if args.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            return kopf.login_via_client(**kwargs)
        return kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup()
    async def close(**_: Any) -> None:
        if memo.pat.session is not None:
            await memo.pat.session.close()

    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(clusterwide=not args.namespace, namespaces=args.namespace, standalone=not args.peering,
             peering_name=args.peering or None, priority=args.priority, liveness_endpoint=liveness, memo=memo)
    return 0


def _api_client(kubeconfig: str | None) -> kubernetes.client.ApiClient:
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
        return kubernetes.client.ApiClient()
    return kubernetes.config.new_client_from_config(config_file=kubeconfig)


if __name__ == "__main__":
    sys.exit(main())
