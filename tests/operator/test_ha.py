"""The operator's life cycle on the real control plane: leader election on a coordination.k8s.io Lease (the rules
against the real API server; two replicas with the leader killed mid-job; the same two without a Lease, which both
act), the token key kept in a Secret, and an uninstall that leaves no finalizer behind."""

from __future__ import annotations

import base64
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from pat_operator.leader import LeaderElector, LeaseSettings
from pat_operator.main import FINALIZER
from tests.cluster.controlplane import write_kubeconfig
from tests.cluster.helm import CHART, Helm

from .conftest import SERVE, SLEEP, Jobs, job_doc, phase
from .harness import SYSTEM_NAMESPACE, TOKEN_KEY_SECRET, OperatorProcess

pytestmark = pytest.mark.cluster

RECONCILES = 'pat_operator_reconciles_total{result="ok"}'
# Short enough for a test, in the proportions the operator requires (duration > deadline > 1.2 x retry period).
QUICK = {"lease_duration": 3, "renew_deadline": 2, "retry_period": 0.5}


def _elector(api: kubernetes.client.ApiClient, namespace: str, name: str, identity: str) -> LeaderElector:
    return LeaderElector(api, LeaseSettings(namespace=namespace, name=name, identity=identity, **QUICK))


def _lease(api: kubernetes.client.ApiClient, namespace: str, name: str) -> kubernetes.client.V1LeaseSpec:
    return kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(name, namespace).spec


def _until(ok, what: str, timeout: float) -> float:
    """Waits until ok(); returns the seconds it took."""
    started = time.monotonic()
    while not ok():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_held_lease_is_taken_only_once_it_has_expired(cluster, namespace):
    with cluster.api_client() as api:
        a, b = (_elector(api, namespace, "held", who) for who in ("a", "b"))
        assert a.try_acquire_or_renew()  # creates the Lease
        first = _lease(api, namespace, "held")
        assert (first.holder_identity, first.lease_transitions, first.lease_duration_seconds) == ("a", 0, 3)
        assert not b.try_acquire_or_renew(), "b took a Lease that a holds and renews"
        assert a.try_acquire_or_renew()  # a renewal: the renewTime moves, the acquireTime stays
        renewed = _lease(api, namespace, "held")
        assert renewed.renew_time > first.renew_time and renewed.acquire_time == first.acquire_time
        # b counts the duration from when it saw the record change (its own clock), not from the renewTime.
        assert not b.try_acquire_or_renew()
        time.sleep(QUICK["lease_duration"] + 0.3)
        assert b.try_acquire_or_renew(), "b could not take a Lease not renewed for its duration"
        taken = _lease(api, namespace, "held")
        assert (taken.holder_identity, taken.lease_transitions) == ("b", 1)
        assert taken.acquire_time > renewed.acquire_time
        assert not a.try_acquire_or_renew(), "a took back a Lease that b holds"


def test_of_two_candidates_for_a_free_lease_the_second_writer_gets_a_conflict(cluster, namespace):
    with cluster.api_client() as api:
        a, b = (_elector(api, namespace, "race", who) for who in ("a", "b"))
        assert a.try_acquire_or_renew()
        a.release()  # free: no holder, a duration of 1 s
        free = _lease(api, namespace, "race")
        assert (free.holder_identity, free.lease_duration_seconds) == (None, 1)
        seen_by_a, seen_by_b = a.observe(), b.observe()  # both see it free, at the same resourceVersion
        assert b.claim(seen_by_b)
        assert not a.claim(seen_by_a), "a overwrote b's claim: the write did not name the resourceVersion it read"
        assert _lease(api, namespace, "race").holder_identity == "b"


def test_a_leader_that_finds_its_lease_taken_stops_at_once(cluster, namespace):
    with cluster.api_client() as api:
        leader = _elector(api, namespace, "stolen", "leader")
        assert leader.try_acquire_or_renew()
        lost: queue.Queue = queue.Queue()
        leader.keep(on_lost=lost.put)
        try:
            time.sleep(1.5)
            assert lost.empty(), lost.get()  # renewing: it goes on leading
            leases = kubernetes.client.CoordinationV1Api(api)
            lease = leases.read_namespaced_lease("stolen", namespace)
            lease.spec.holder_identity = "thief"
            leases.replace_namespaced_lease("stolen", namespace, lease)
            assert "held by thief" in lost.get(timeout=2 * QUICK["retry_period"] + 1)
        finally:
            leader.release()
        assert _lease(api, namespace, "stolen").holder_identity == "thief", "release() freed another's Lease"


class Partition:
    """A TCP relay to the API server that can be cut: then it forwards nothing and connections hang, as across a
    network partition (the API server itself, shared by the session's tests, stays up)."""

    def __init__(self, server: str):
        host, port = server.removeprefix("https://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut = threading.Event()
        self.held: list[socket.socket] = []  # connections made while cut: kept open, never answered
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                self.held.append(client)
                continue
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                if not self.cut.is_set():
                    dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            s.close()

    def close(self) -> None:
        self.listener.close()
        for s in self.held:
            s.close()


def test_a_leader_cut_off_from_the_api_server_stops_before_its_lease_expires(cluster, namespace, tmp_path):
    """The renew deadline (2 s) is shorter than the lease duration (3 s): the leader stops acting before a standby
    may take the Lease, even though no answer ever comes (every request has a timeout)."""
    partition = Partition(cluster.server)
    kubeconfig = write_kubeconfig(tmp_path / "partitioned", partition.url, cluster.ca_file, cluster.admin_token)
    try:
        with kubernetes.config.new_client_from_config(str(kubeconfig)) as api:
            leader = _elector(api, namespace, "cut", "leader")
            assert leader.try_acquire_or_renew()
            lost: queue.Queue = queue.Queue()
            leader.keep(on_lost=lambda why: lost.put((time.monotonic(), why)))
            time.sleep(1.5)
            assert lost.empty(), lost.get()  # negative control: connected, it renews and goes on leading
            partition.cut.set()
            cut = time.monotonic()
            stopped, why = lost.get(timeout=10)
            assert "not renewed within the renew deadline" in why, why
            # It renewed last before the cut; a standby could take the Lease no sooner than a duration after that.
            assert stopped - cut < QUICK["lease_duration"], f"stopped {stopped - cut:.1f} s after the cut"
    finally:
        partition.close()


def _pods(jobs, name: str) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in jobs.pods(name)}


def test_the_standby_takes_over_a_job_when_the_leader_is_killed_and_creates_no_pod_twice(jobs, operator, tmp_path):
    assert operator.leading()
    standby = OperatorProcess(operator.kubeconfig, tmp_path / "standby", *operator.extra)
    standby.key_file.write_text(operator.key_file.read_text())  # replicas share the token key
    standby.start(lead=False)
    try:
        jobs.create(job_doc("ha", SLEEP, SERVE))
        job = jobs.wait("ha", phase("Running"), "Running")
        assert operator.value(RECONCILES) > 0
        assert standby.value(RECONCILES) == 0, "the standby acts while the leader holds the Lease"
        assert "stands by: the lease pat-system/pat-operator is held by " + operator.identity in standby.log()
        pods = _pods(jobs, "ha")
        assert len(pods) == 2

        operator.kill()  # SIGKILL: the Lease is not released, the standby waits for it to expire
        killed = time.monotonic()
        jobs.patch_spec("ha", {"runPolicy": {"backoffLimit": 5}})  # the next generation: only a leader observes it
        after = jobs.wait("ha", lambda j: j["status"].get("observedGeneration") == job["metadata"]["generation"] + 1,
                          "the spec change observed by the new leader", timeout=30, explain=standby.log)
        took_over = time.monotonic() - killed
        print(f"\nthe standby took over {took_over:.1f} s after the leader was killed (lease duration 15 s)")
        assert standby.leading() and standby.value(RECONCILES) > 0
        assert after["status"]["phase"] == "Running"
        assert _pods(jobs, "ha") == pods, "the new leader replaced or duplicated the job's pods"
        assert standby.value("pat_operator_pods_created_total") == 0

        # A leader stopped cleanly releases the Lease: the standby takes over in about a retry period (2 s), not a
        # lease duration (15 s).
        operator.start(lead=False)
        stopping = time.monotonic()
        standby.stop()
        _until(operator.leading, "the restarted replica leading", 10)
        print(f"after a clean stop (SIGTERM) the other replica led {time.monotonic() - stopping:.1f} s later")
        assert "released the lease" in standby.log()
    finally:
        standby.stop()
        if operator.proc is None:
            operator.start()
        _until(operator.leading, "the session's operator leading again", 30)


def test_without_leader_election_two_replicas_both_act(jobs, operator, tmp_path):
    """The negative control of the test above: with --leader-election-lease '' both replicas reconcile the same
    job, as the Lease prevents."""
    jobs.create(job_doc("both", SLEEP, SERVE))
    jobs.wait("both", phase("Running"), "Running")
    replicas = [OperatorProcess(operator.kubeconfig, tmp_path / name, *operator.extra, "--namespace", jobs.namespace,
                                lease="") for name in ("one", "two")]
    try:
        for replica in replicas:
            replica.key_file.write_text(operator.key_file.read_text())
            replica.start()
        _until(lambda: all(r.value(RECONCILES) > 0 for r in replicas), "both replicas reconciling", 30)
    finally:
        for replica in replicas:
            replica.stop()


def test_the_token_key_secret_is_made_once_and_kept(cluster, operator, tmp_path):
    """--token-key-secret: the first replica makes the Secret, later ones read the same key. (They stand by: the
    session's operator holds the Lease.)"""
    with cluster.api_client() as api:
        core = kubernetes.client.CoreV1Api(api)
        try:
            core.delete_namespaced_secret(TOKEN_KEY_SECRET, SYSTEM_NAMESPACE)
        except ApiException as e:
            if e.status != 404:
                raise
        keys = []
        for name in ("first", "second"):
            replica = OperatorProcess(operator.kubeconfig, tmp_path / name, "--token-key-secret", TOKEN_KEY_SECRET)
            replica.key_file.unlink()  # the Secret wins over the file: none here
            replica.start(lead=False)
            replica.stop()
            secret = core.read_namespaced_secret(TOKEN_KEY_SECRET, SYSTEM_NAMESPACE)
            keys.append((base64.b64decode(secret.data["token-key"]), secret.metadata.resource_version))
            assert ("created the token-key Secret" in replica.log()) == (name == "first"), replica.log()
        assert len(keys[0][0]) == 48 and keys[0] == keys[1]


def test_a_token_key_secret_the_operator_may_not_read_stops_it_naming_the_flag_and_the_rbac(operator):
    done = subprocess.run([sys.executable, "-m", "pat_operator.main", "--kubeconfig", operator.kubeconfig,
                           "--operator-namespace", SYSTEM_NAMESPACE, "--token-key-secret", "not-granted",
                           "--metrics-port", "0", "--liveness-port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--token-key-secret not-granted: the API server refused to get the Secret pat-system/not-granted" \
           in done.stderr and "needs get on secrets named not-granted" in done.stderr, done.stderr


def _finalizers(jobs, name: str) -> list[str]:
    return jobs.get(name)["metadata"].get("finalizers") or []


def test_uninstall_leaves_no_finalizer(jobs, operator):
    """kopf puts its finalizer on every job (its daemon must stop before the job goes). `pat-operator
    remove-finalizers` (the chart's pre-delete hook) takes it off once no operator runs; a job deleted then goes at
    once."""
    jobs.create(job_doc("kept", SLEEP, SERVE))
    jobs.wait("kept", phase("Running"), "Running")
    assert FINALIZER in _finalizers(jobs, "kept")
    command = [sys.executable, "-m", "pat_operator.main", "remove-finalizers", "--kubeconfig", operator.kubeconfig,
               "--operator-namespace", SYSTEM_NAMESPACE, "--namespace", jobs.namespace]
    # While an operator leads, it refuses: that operator would put the finalizer back.
    busy = subprocess.run([*command, "--wait-seconds", "3"], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1 and f"is held by {operator.identity}" in busy.stderr, busy.stderr
    assert FINALIZER in _finalizers(jobs, "kept")

    operator.stop()  # as the hook's --stop-deployment does, or `helm uninstall` deleting the Deployment
    try:
        # Negative control: kopf's finalizer with no operator to remove it holds a deleted job in Terminating.
        held = job_doc("held", SLEEP, SERVE)
        held["metadata"]["finalizers"] = [FINALIZER]
        jobs.create(held)
        jobs.delete("held")
        time.sleep(3)
        assert jobs.get("held")["metadata"].get("deletionTimestamp"), "the held job is not Terminating"

        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"{jobs.namespace}/held" in done.stdout and f"{jobs.namespace}/kept" in done.stdout, done.stdout
        _until(lambda: not jobs.exists("held"), "the held job gone once its finalizer is off", 10)
        assert _finalizers(jobs, "kept") == []
        jobs.delete("kept")
        _until(lambda: not jobs.exists("kept"), "the job deleted with no operator", 10)
    finally:
        operator.start()


@pytest.mark.timeout(600)
def test_helm_uninstall_takes_the_finalizers_off_through_its_pre_delete_hook(cluster, namespace, operator, tmp_path):
    """The chart's two replicas run a job; `helm uninstall` runs the hook (pat-operator remove-finalizers
    --stop-deployment) before it deletes the release: the job keeps no finalizer, and deleting it needs no operator."""
    helm = Helm(tmp_path, cluster.kubeconfig)
    system = f"pat-hook-{secrets.token_hex(3)}"
    operator.stop()  # it watches every namespace: it would put the finalizer back
    try:
        with cluster.api_client() as api:
            helm("install", "rel", str(CHART), "-n", system, "--create-namespace", "--wait", "--timeout", "3m",
                 "--set-string", "listenAddress=$(POD_IP)", "--set", f"watchNamespaces={{{namespace}}}",
                 "--set", "restartBackoffSeconds=1")
            jobs = Jobs(api, namespace)
            jobs.create(job_doc("charted", SLEEP, SERVE))
            jobs.wait("charted", phase("Running"), "Running under the chart's operator")
            assert FINALIZER in _finalizers(jobs, "charted")
            uninstalled = helm("uninstall", "rel", "-n", system, "--wait", "--timeout", "3m", check=False)
            assert uninstalled.returncode == 0, uninstalled.stderr + "\n".join(
                cluster.kubelet.log(system, p.metadata.name, "remove-finalizers") for p in
                kubernetes.client.CoreV1Api(api).list_namespaced_pod(system, label_selector="job-name").items)
            assert _finalizers(jobs, "charted") == []
            assert not kubernetes.client.AppsV1Api(api).list_namespaced_deployment(system).items
            jobs.delete("charted")
            _until(lambda: not jobs.exists("charted"), "the job deleted after the uninstall", 10)
    finally:
        helm("uninstall", "rel", "-n", system, "--wait", check=False)
        operator.start()


def test_remove_finalizers_names_a_missing_operator_namespace(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pat_operator.main", "remove-finalizers", "--kubeconfig",
                           str(tmp_path / "none")], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "POD_NAMESPACE"})
    assert done.returncode == 2 and "--operator-namespace: not given" in done.stderr, done.stderr
