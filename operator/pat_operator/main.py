"""`pat-operator`: the RLHFJob operator (kopf), with Lease-based leader election, a liveness endpoint and Prometheus
metrics.

  pat-operator [--namespace NS ...] [--operator-namespace NS] [--token-key-secret NAME | --token-key-file F] ...
  pat-operator remove-finalizers [--stop-deployment NAME] [--namespace NS ...] [--operator-namespace NS] ...

Watches every namespace unless --namespace is given. Of several replicas only the holder of the Lease
--leader-election-lease (in --operator-namespace) runs kopf; the others stand by (serving /healthz and /metrics)
until it is free or expired. A leader that cannot renew the Lease within --renew-deadline-seconds exits at once; one
stopped with SIGTERM releases it, so a standby takes over within --retry-period-seconds.

The token key (secret bytes, the same for every replica) signs the per-job tokens. --token-key-secret reads it from
a Secret in --operator-namespace, creating the Secret once with a random key; --token-key-file reads a file (a
mounted Secret). Without a key the operator refuses to start: a random one would make the pods' tokens unknown to
the next operator process.

`remove-finalizers` takes kopf's finalizer off every RLHFJob, for an uninstall (the chart's pre-delete hook runs it):
kopf puts it on each job because the job's daemon must be stopped before the job is gone (kopf.daemon always
requires a finalizer; kopf offers no daemon without one), and with no operator left it would hold every deleted job
in Terminating. It first stops the operator (--stop-deployment: scaled to 0, its pods gone) and takes the Lease, so
no operator adds the finalizer again.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.server
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server

from . import builders, handlers, kube, prometheus, version  # handlers: registers them
from .api import GROUP, VERSION
from .autoscaler import AutoscaleSettings
from .leader import API_ERRORS, LeaderElector, LeaseSettings, identity
from .operator_metrics import OperatorMetrics
from .podclient import http_url
from .reconcile import Settings

LEASE = "pat-operator"
TOKEN_KEY = "token-key"  # the key of the token-key Secret's data
TOKEN_KEY_BYTES = 48
MIN_TOKEN_KEY_BYTES = 16
FINALIZER = kopf.OperatorSettings().persistence.finalizer  # kopf's, put on every job that has a daemon
PEER_EXAMPLE = '{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}'

log = logging.getLogger("pat_operator")


class ConfigError(Exception):
    """A flag or what it names is unusable: the message names the flag and the fix (exit code 2)."""


def _common_flags() -> argparse.ArgumentParser:
    """The flags of both commands: what to watch, how to log in, the Lease."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces "
                    "(repeatable); default: all")
    ap.add_argument("--kubeconfig", help="default: in-cluster service account, else $KUBECONFIG / ~/.kube/config")
    ap.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE"),
                    help="the namespace of the Lease and of the token-key Secret (default: env POD_NAMESPACE)")
    ap.add_argument("--leader-election-lease", default=LEASE, help="the coordination.k8s.io Lease of which the "
                    "holder acts; '' for no leader election (then run one replica only)")
    ap.add_argument("--lease-duration-seconds", type=int, default=15,
                    help="a standby takes the Lease once it has not been renewed for this long")
    ap.add_argument("--renew-deadline-seconds", type=float, default=10.0,
                    help="the leader exits when it could not renew the Lease for this long")
    ap.add_argument("--retry-period-seconds", type=float, default=2.0, help="how often the Lease is renewed or tried")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--version", action="version", version=f"pat-operator {version()}")
    return ap


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pat-operator", parents=[_common_flags()],
                                 description="the RLHFJob operator; `pat-operator remove-finalizers --help`: before "
                                             "an uninstall")
    ap.add_argument("--token-key-secret", help="the Secret (key `token-key`) in --operator-namespace that holds the "
                    "token key; created with a random key when missing. Wins over --token-key-file")
    ap.add_argument("--token-key-file", default=os.environ.get("PAT_TOKEN_KEY_FILE", "/etc/pat-operator/token-key"),
                    help="secret bytes that the per-job tokens are derived from (env PAT_TOKEN_KEY_FILE)")
    ap.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics (0: off)")
    ap.add_argument("--liveness-port", type=int, default=8081, help="/healthz (0: off)")
    ap.add_argument("--bind", default="0.0.0.0", help="address of the metrics and liveness endpoints")
    ap.add_argument("--restart-backoff-seconds", type=float, default=10.0,
                    help="wait before the first gang restart; doubled for each next one")
    ap.add_argument("--restart-backoff-max-seconds", type=float, default=300.0)
    ap.add_argument("--prometheus-url", help="Prometheus for adaptiveTP.controller=operator jobs that name none, "
                    "e.g. http://prometheus-server.monitoring:9090")
    ap.add_argument("--prometheus-bearer-token-file", help="sent as 'Authorization: Bearer', read again for every "
                    "query (projected tokens rotate)")
    ap.add_argument("--prometheus-ca-file", help="PEM CA bundle that verifies an https Prometheus")
    ap.add_argument("--prometheus-header", type=prometheus.header_flag, action="append", default=[],
                    metavar="NAME=VALUE", help="a header sent with every query (repeatable), e.g. X-Scope-OrgID=a")
    ap.add_argument("--allow-privileged-pods", action="store_true", help="accept hostPath volumes, privileged "
                    "containers, host network/PID/IPC and added capabilities in a job's pod fields")
    ap.add_argument("--allow-host-path", action="append", default=[], metavar="DIR", type=_absolute,
                    help="accept hostPath volumes under this node directory (repeatable), e.g. a dataset disk")
    ap.add_argument("--network-policy", action="store_true", help="create a NetworkPolicy per job: the workers' "
                    "ports only from the job's own pods and --network-policy-from")
    ap.add_argument("--network-policy-from", action="append", default=[], metavar="JSON", help="a NetworkPolicyPeer "
                    f"that may reach the job pods' HTTP ports (repeatable), e.g. '{PEER_EXAMPLE}'")
    ap.add_argument("--metrics-max-age-seconds", type=float, default=5.0,
                    help="samples scraped longer ago than this are stale: never acted on")
    ap.add_argument("--regroup-attempts", type=int, default=4, help="POSTs of a regroup plan before it fails")
    ap.add_argument("--regroup-timeout-seconds", type=float, default=10.0, help="the longest one POST of a plan "
                    "waits for the pod's acknowledgement")
    return ap.parse_args(argv)


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"{path!r} is not an absolute path")
    return path


def _remove_finalizers_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pat-operator remove-finalizers", parents=[_common_flags()],
                                 description=f"take kopf's finalizer ({FINALIZER}) off every RLHFJob once no operator "
                                             "runs, so that deleted jobs and their namespaces are not held")
    ap.add_argument("--stop-deployment", metavar="NAME", help="first scale the operator's Deployment (in "
                    "--operator-namespace) to 0 and wait until its pods are gone")
    ap.add_argument("--wait-seconds", type=float, default=120.0,
                    help="how long to wait for the operator's pods to go and for the Lease")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["remove-finalizers"]:
            return remove_finalizers(_remove_finalizers_args(argv[1:]))
        return operate(_args(argv))
    except ConfigError as e:
        print(f"pat-operator: {e}", file=sys.stderr)
        return 2
    except API_ERRORS as e:  # at start-up, or in remove-finalizers: kopf handles its own
        print(f"pat-operator: the API server: {kube.describe(e)}", file=sys.stderr)
        return 1


def operate(args: argparse.Namespace) -> int:
    settings = Settings(restart_backoff_seconds=args.restart_backoff_seconds,
                        restart_backoff_max_seconds=args.restart_backoff_max_seconds,
                        allow_privileged_pods=args.allow_privileged_pods,
                        allowed_host_paths=tuple(args.allow_host_path),
                        network_policy_from=_network_policy_from(args))
    prometheus_auth = _prometheus_auth(args)
    lease = _lease_settings(args)
    _log(args)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    api = kube.api_client(args.kubeconfig)
    token_key = _token_key(api, args)
    metrics = OperatorMetrics()
    memo = kopf.Memo(pat=handlers.Memo(
        api=api, token_key=token_key, metrics=metrics, settings=settings, prometheus_url=args.prometheus_url,
        prometheus_auth=prometheus_auth,
        autoscale=AutoscaleSettings(max_age_seconds=args.metrics_max_age_seconds, attempts=args.regroup_attempts,
                                    ack_timeout_seconds=args.regroup_timeout_seconds)))
    if args.metrics_port:  # every replica: a standby's counters stay at 0
        start_http_server(args.metrics_port, addr=args.bind, registry=metrics.registry)
    stopping = _stop_on_signals()
    elector = LeaderElector(api, lease) if lease else None
    if elector:
        with _standby_liveness(args.bind, args.liveness_port):
            if not elector.acquire(stopping):
                return 0
        elector.keep(on_lost=_exit_at_once)
    _register_kopf_handlers(args, memo)
    liveness = http_url(args.bind, args.liveness_port) + "/healthz" if args.liveness_port else None
    try:
        asyncio.run(_run_kopf(stopping, clusterwide=not args.namespace, namespaces=args.namespace, standalone=True,
                              liveness_endpoint=liveness, memo=memo))
    finally:
        if elector:
            elector.release()
    return 0


def _register_kopf_handlers(args: argparse.Namespace, memo: kopf.Memo) -> None:
    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
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

    @kopf.on.login()
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the API client. In a pod: the client library's in-cluster config, which takes the
        # server from KUBERNETES_SERVICE_HOST/PORT (kopf's own service-account login assumes the DNS name
        # kubernetes.default.svc on port 443). Outside: kopf's kubeconfig login (the client library's reads
        # $KUBECONFIG too early for --kubeconfig).
        if args.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            return kopf.login_via_client(**kwargs)
        return kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup()
    async def close(**_: Any) -> None:
        if memo.pat.session is not None:
            await memo.pat.session.close()


async def _run_kopf(stopping: threading.Event, **kwargs: Any) -> None:
    """kopf in this (the main) thread's loop. kopf stops on SIGINT/SIGTERM with handlers of its own, installed once
    it runs; these cover the moment before, and a signal that came while this process stood by."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    @kopf.on.cleanup()
    def raise_stop_flag(**_: Any) -> None:  # kopf's shutdown waits for its stop flag's waiter (5 s) unless it is set
        stop.set()

    if not stopping.is_set():
        await kopf.operator(stop_flag=stop, **kwargs)


def _stop_on_signals() -> threading.Event:
    """An Event set by SIGINT/SIGTERM, so that a standby (or remove-finalizers) stops waiting and exits cleanly."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


def _exit_at_once(why: str) -> None:
    """The Lease is lost: exit now, without any cleanup that could still act on a job (kopf would stop its daemons
    gracefully, for seconds; by then another replica may lead)."""
    log.critical("%s: exiting at once, so as never to act without the lease", why)
    os._exit(1)


@contextlib.contextmanager
def _standby_liveness(bind: str, port: int) -> Iterator[None]:
    """/healthz while this replica stands by (kopf serves it once this one leads): a standby is alive."""
    if not port:
        yield
        return

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
            self.wfile.write(b'{"leader": false}\n' if self.path == "/healthz" else b"")

        def log_message(self, *_: Any) -> None:  # the probes every few seconds are not news
            pass

    server = http.server.ThreadingHTTPServer((bind, port), Health)
    thread = threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()  # the port is kopf's next


def _log(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _lease_settings(args: argparse.Namespace) -> LeaseSettings | None:
    """The Lease this process competes for; None without leader election."""
    if not args.leader_election_lease:
        return None
    lease = LeaseSettings(namespace=_operator_namespace(args, "the Lease"), name=args.leader_election_lease,
                          identity=identity(), lease_duration=args.lease_duration_seconds,
                          renew_deadline=args.renew_deadline_seconds, retry_period=args.retry_period_seconds)
    if (problem := lease.problem()) is not None:
        raise ConfigError(f"--lease-duration-seconds, --renew-deadline-seconds, --retry-period-seconds: {problem}")
    return lease


def _operator_namespace(args: argparse.Namespace, what: str) -> str:
    if not args.operator_namespace:
        raise ConfigError(f"--operator-namespace: not given and POD_NAMESPACE is not set; name the namespace of "
                          f"{what} (the operator's own), or give --leader-election-lease '' to run a single replica "
                          f"without leader election")
    return args.operator_namespace


def _network_policy_from(args: argparse.Namespace) -> tuple[dict[str, Any], ...] | None:
    """The NetworkPolicyPeers of --network-policy-from; None without --network-policy (no per-job policy)."""
    if not args.network_policy:
        if args.network_policy_from:
            raise ConfigError("--network-policy-from is given without --network-policy: add --network-policy (no "
                              "per-job NetworkPolicy is made without it)")
        return None
    return tuple(_network_policy_peer(text) for text in args.network_policy_from)


def _network_policy_peer(text: str) -> dict[str, Any]:
    try:
        peer = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--network-policy-from {text!r}: not JSON ({e}); give a NetworkPolicyPeer, e.g. "
                          f"'{PEER_EXAMPLE}'") from None
    valid = isinstance(peer, dict) and all(isinstance(v, dict) for v in peer.values()) and (
        (peer and set(peer) <= {"podSelector", "namespaceSelector"})
        or (set(peer) == {"ipBlock"} and isinstance(peer["ipBlock"].get("cidr"), str)))
    if not valid:
        raise ConfigError(f"--network-policy-from {text!r}: a NetworkPolicyPeer has podSelector and/or "
                          f"namespaceSelector (objects), or only ipBlock with a cidr; e.g. '{PEER_EXAMPLE}'")
    return peer


def _prometheus_auth(args: argparse.Namespace) -> prometheus.PrometheusAuth:
    """Checked now, so that a wrong path fails the start (naming the flag), not every query later."""
    try:
        auth = prometheus.PrometheusAuth(bearer_token_file=args.prometheus_bearer_token_file,
                                         ca_file=args.prometheus_ca_file, headers=dict(args.prometheus_header))
        auth.request_headers()
        auth.ssl_context()
    except (ValueError, prometheus.PrometheusError) as e:
        raise ConfigError(str(e)) from None
    return auth


def _token_key(api: kubernetes.client.ApiClient, args: argparse.Namespace) -> bytes:
    if args.token_key_secret:
        namespace = _operator_namespace(args, "the token-key Secret")
        return _checked_key(_secret_token_key(api, namespace, args.token_key_secret),
                            f"--token-key-secret {args.token_key_secret} (Secret {namespace}/{args.token_key_secret}, "
                            f"key {TOKEN_KEY})")
    try:
        raw = Path(args.token_key_file).read_bytes()
    except OSError as e:
        raise ConfigError(f"--token-key-file {args.token_key_file}: {e.strerror}; give a file of secret bytes (a "
                          f"mounted Secret), or --token-key-secret NAME") from None
    return _checked_key(raw, f"--token-key-file {args.token_key_file}")


def _checked_key(raw: bytes, source: str) -> bytes:
    key = raw.strip()  # a file written with a trailing newline; the same bytes from either flag
    if len(key) < MIN_TOKEN_KEY_BYTES:
        raise ConfigError(f"{source} holds {len(key)} bytes; use at least {MIN_TOKEN_KEY_BYTES}")
    return key


def _secret_token_key(api: kubernetes.client.ApiClient, namespace: str, name: str) -> bytes:
    """The Secret's key; the Secret is made (random bytes) when missing. Of replicas starting together one creates
    it; the others' create is a 409, and they read the winner's."""
    core = kubernetes.client.CoreV1Api(api)
    verb = "get"
    try:
        try:
            secret = core.read_namespaced_secret(name, namespace, _request_timeout=kube.REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != 404:
                raise
            verb = "create"
            try:
                secret = core.create_namespaced_secret(namespace, {
                    "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "pat-operator"}},
                    "type": "Opaque", "data": {TOKEN_KEY: base64.b64encode(secrets.token_bytes(TOKEN_KEY_BYTES))
                                               .decode()}}, _request_timeout=kube.REQUEST_TIMEOUT)
                log.info("created the token-key Secret %s/%s", namespace, name)
            except ApiException as e:
                if e.status != 409:
                    raise
                verb = "get"
                secret = core.read_namespaced_secret(name, namespace, _request_timeout=kube.REQUEST_TIMEOUT)
    except ApiException as e:
        if e.status in (401, 403):
            raise ConfigError(f"--token-key-secret {name}: the API server refused to {verb} the Secret "
                              f"{namespace}/{name} ({kube.describe(e)}); the operator's ServiceAccount needs get on "
                              f"secrets named {name} and create on secrets in {namespace} (a Role there; the chart "
                              f"makes it)") from None
        raise
    data = (secret.data or {}).get(TOKEN_KEY)
    if data is None:
        raise ConfigError(f"--token-key-secret {name}: the Secret {namespace}/{name} has no key {TOKEN_KEY!r} (it has "
                          f"{sorted(secret.data or {})}); add one of at least {MIN_TOKEN_KEY_BYTES} random bytes, or "
                          f"name another Secret")
    return base64.b64decode(data)


def remove_finalizers(args: argparse.Namespace) -> int:
    lease = _lease_settings(args)
    _log(args)
    api = kube.api_client(args.kubeconfig)
    stopping = _stop_on_signals()
    if args.stop_deployment:
        _stop_deployment(api, _operator_namespace(args, "the Deployment"), args.stop_deployment, args.wait_seconds)
    elector = LeaderElector(api, lease) if lease else None
    if elector:
        if not elector.acquire(stopping, within=args.wait_seconds):
            print(f"pat-operator remove-finalizers: the lease {lease.namespace}/{lease.name} is held by "
                  f"{elector.holder or 'no one'}: an operator still runs, and would put its finalizer back; stop it "
                  f"first (--stop-deployment DEPLOYMENT scales it to 0)", file=sys.stderr)
            return 1
        elector.keep(on_lost=_exit_at_once)
    try:
        removed = _remove_finalizer(api, args.namespace, FINALIZER)
    finally:
        if elector:
            elector.release()
    print(f"removed {FINALIZER} from {len(removed)} RLHFJob(s){': ' if removed else ''}{', '.join(removed)}")
    return 0


def _stop_deployment(api: kubernetes.client.ApiClient, namespace: str, name: str, within: float) -> None:
    """Scales the Deployment to 0 and waits until none of its pods is left (a standby that has not seen its SIGTERM
    yet could otherwise take the Lease after us)."""
    apps, core = kubernetes.client.AppsV1Api(api), kubernetes.client.CoreV1Api(api)
    apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 0}},
                                           _request_timeout=kube.REQUEST_TIMEOUT)
    labels = apps.read_namespaced_deployment(name, namespace, _request_timeout=kube.REQUEST_TIMEOUT
                                             ).spec.selector.match_labels or {}
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    deadline = time.monotonic() + within
    while pods := [p for p in core.list_namespaced_pod(namespace, label_selector=selector,
                                                        _request_timeout=kube.REQUEST_TIMEOUT).items
                   if any(r.kind == "ReplicaSet" and r.name.startswith(f"{name}-")  # the Deployment's own
                          for r in p.metadata.owner_references or [])]:
        if time.monotonic() > deadline:
            raise ConfigError(f"--stop-deployment {name}: pods {[p.metadata.name for p in pods]} still there after "
                              f"{within:g} s (--wait-seconds)")
        time.sleep(1)
    print(f"scaled deployment {namespace}/{name} to 0; its pods are gone")


def _remove_finalizer(api: kubernetes.client.ApiClient, namespaces: list[str], finalizer: str) -> list[str]:
    """Takes `finalizer` off every RLHFJob (of `namespaces`, or all); returns the jobs' namespace/name."""
    custom = kubernetes.client.CustomObjectsApi(api)
    listed = [custom.list_namespaced_custom_object(GROUP, VERSION, ns, handlers.PLURAL,
                                                   _request_timeout=kube.REQUEST_TIMEOUT) for ns in namespaces] \
        if namespaces else [custom.list_cluster_custom_object(GROUP, VERSION, handlers.PLURAL,
                                                              _request_timeout=kube.REQUEST_TIMEOUT)]
    return [f"{job['metadata']['namespace']}/{job['metadata']['name']}" for jobs in listed for job in jobs["items"]
            if _take_off(custom, job["metadata"], finalizer)]


def _take_off(custom: kubernetes.client.CustomObjectsApi, meta: dict[str, Any], finalizer: str) -> bool:
    """Whether `finalizer` was taken off the job. Each patch names the resourceVersion it was computed from: a job
    changed meanwhile (409) is read again."""
    namespace, name = meta["namespace"], meta["name"]
    try:
        while finalizer in (meta.get("finalizers") or []):
            patch = {"metadata": {"resourceVersion": meta["resourceVersion"],
                                  "finalizers": [f for f in meta["finalizers"] if f != finalizer]}}
            try:
                custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, handlers.PLURAL, name, patch,
                                                      _request_timeout=kube.REQUEST_TIMEOUT)
                return True
            except ApiException as e:
                if e.status != 409:
                    raise
            meta = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, handlers.PLURAL, name,
                                                       _request_timeout=kube.REQUEST_TIMEOUT)["metadata"]
    except ApiException as e:
        if e.status != 404:  # deleted meanwhile
            raise
    return False

if __name__ == "__main__":
    sys.exit(main())
