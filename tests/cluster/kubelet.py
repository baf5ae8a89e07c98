"""A test kubelet: the pods bound to its Node run as local processes (no container runtime, no images).

    python -m tests.cluster.kubelet --kubeconfig F [--node pat-node-0] [--gpus 16]

What a pod gets, and what differs from a real node:
- The host is the image: `image` is ignored and the command runs with the directory of sys.executable (the
  project's venv) first on PATH. A container without `command` cannot run (there is no image entrypoint).
- Each container runs in its own mount and UTS namespace (tests/cluster/podexec.py): volumes are bind mounts,
  /etc/hosts is the kubelet's one hosts file (read-only), the hostname is spec.hostname or the pod name,
  readOnlyRootFilesystem remounts / read-only there. The network is the host's: each pod gets its own
  loopback address 127.0.0.N, so servers must bind their pod IP (status.podIP), not 0.0.0.0, to share a port.
- Headless-service DNS is the hosts file: `hostname.subdomain[.namespace[.svc[.cluster.local]]]` and the pod
  name resolve to the pod IP from admission (before the process starts) until the pod ends.
- restartPolicy Never, OnFailure and Always (a Deployment's pods): an ended container is started again after
  the real kubelet's back-off (10 s, doubling, at most 5 min; waiting reason CrashLoopBackOff), restartCount counts.
- The ServiceAccount token, as the real kubelet's projected kube-api-access volume (unless the pod sets
  automountServiceAccountToken: false): a token bound to the pod (TokenRequest), ca.crt and namespace under
  /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT naming the API server, so
  in-cluster clients work unchanged and act with only their ServiceAccount's RBAC.
- Volumes: emptyDir (medium Memory: a tmpfs), hostPath, configMap, secret, downwardAPI, persistentVolumeClaim
  (a directory per namespace/claim under the kubelet root; the kubelet also binds pending claims of no or an
  unknown StorageClass to a PersistentVolume of its own, or the scheduler would never place their pods).
- Probes: readiness and liveness, httpGet/tcpSocket/exec. No resource limits, no OOM kills, no image pulls.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import heapq
import http.client
import itertools
import json
import logging
import os
import pwd
import re
import resource
import select
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import kubernetes
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.cluster.podexec import mount, umount

log = logging.getLogger("pat.kubelet")

PODEXEC = Path(__file__).with_name("podexec.py")
SMP = "application/strategic-merge-patch+json"  # the client's default Content-Type for a dict body is JSON Patch
MERGE = "application/merge-patch+json"
MAX_GRACE_SECONDS = 10  # cap on terminationGracePeriodSeconds, so deleting a pod never stalls a test long
FORCED_GRACE_SECONDS = 2  # for pods deleted outright (grace 0), as the real kubelet's minimum
RETRY_SECONDS = 2.0  # a container that cannot be configured yet (missing Secret, ...) is retried this often
HEARTBEAT_SECONDS = 10
LEASE_SECONDS = 40
START_TIMEOUT_SECONDS = 10  # an exec that has not happened by then counts as started
BACKOFF_SECONDS, BACKOFF_MAX_SECONDS = 10.0, 300.0  # the real kubelet's container restart back-off
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_ACCOUNT_VOLUME = "kube-api-access.token"  # its folder under the pod's volumes (a dot: no volume name)
TOKEN_SECONDS = 3600


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined name is replaced, $$ is a literal $, anything else stays as is."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append(text[i:i + 2])
            i += 2
    return "".join(out)


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError): retried, as the real kubelet does."""


class WorkQueue:
    """client-go's work queue: a key is queued at most once and never handled by two workers at the same time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._closed = False

    def add(self, key: str) -> None:
        with self._cv:
            if key in self._dirty or self._closed:
                return
            self._dirty.add(key)
            if key not in self._processing:
                self._queue.append(key)
                self._cv.notify()

    def get(self) -> str | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            key = self._queue.popleft()
            self._dirty.discard(key)
            self._processing.add(key)
            return key

    def done(self, key: str) -> None:
        with self._cv:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class Timers:
    """One thread that calls short functions (enqueue, submit) at their time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kubelet-timers", daemon=True)
        self._thread.start()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), fn))
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                fn = heapq.heappop(self._heap)[2]
            try:
                fn()
            except Exception:
                log.exception("timer callback failed")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()


class Reaper:
    """One thread that learns of every container exit through pidfds (no thread, no polling per process)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[subprocess.Popen, Callable[[int], None]]] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._loop, name="kubelet-reaper", daemon=True)
        self._thread.start()

    def watch(self, process: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        fd = os.pidfd_open(process.pid)  # works for a process that already exited: nobody else reaps ours
        with self._lock:
            self._entries[fd] = (process, on_exit)
        self._epoll.register(fd, select.EPOLLIN)

    def _loop(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():
                if fd == self._wake_r:
                    return
                with self._lock:
                    process, on_exit = self._entries.pop(fd)
                self._epoll.unregister(fd)
                os.close(fd)
                # Kill what the container left behind while its exited leader (a zombie) still holds the group id.
                _killpg(process.pid, signal.SIGKILL)
                process.wait()
                try:
                    on_exit(process.returncode)
                except Exception:
                    log.exception("exit callback failed")

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join()
        for fd in list(self._entries):
            os.close(fd)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._epoll.close()


def _shutdown(response: object) -> None:
    """Unblock a thread reading a streaming response (closing it from another thread can deadlock in ssl)."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Container:
    spec: dict
    init: bool
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # the container's own variables, for exec probes
    identity: tuple[int | None, int, list[int]] = (None, 0, [])  # uid (None: root), gid, supplementary groups
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    ready: bool = False
    restarts: int = 0
    last_state: dict | None = None  # the terminated state before the last restart
    start_after: float = 0.0  # monotonic time of the next (re)start: the restart back-off

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class Volume:
    path: Path
    readonly: bool  # configMap, secret and downwardAPI volumes are read-only whatever the mount says


@dataclass
class PodRun:
    """What the kubelet knows of one admitted pod; `pod` is the latest object from the watch."""

    pod: dict
    ip: str
    dir: Path
    start_time: str
    init: list[Container]
    main: list[Container]
    volumes: dict[str, Volume] | None = None
    tmpfs: list[Path] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # a pod-level (reason, message) that fails the pod
    released: bool = False  # IP and hosts entry given back (the pod ended or is gone)
    terminating: bool = False
    kill_at: float = 0.0
    reported: dict | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # condition -> (status, since)

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def containers(self) -> list[Container]:
        return self.init + self.main


@dataclass
class Probe:
    run: PodRun
    container: Container
    kind: str  # readiness | liveness
    spec: dict
    pid: int  # the process probed: a restarted container gets probes of its own
    successes: int = 0
    failures: int = 0


class ProcessKubelet:
    def __init__(self, kubeconfig: str, node_name: str = "pat-node-0", gpus: int = 16,
                 root: str | Path | None = None, bin_dir: str | Path | None = None, workers: int = 4,
                 labels: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.gpus = gpus
        self._own_root = root is None
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="pat-kubelet-"))
        self.bin_dir = Path(bin_dir) if bin_dir else Path(sys.executable).parent
        self.labels = labels or {}
        self.hosts_file = self.root / "hosts"
        self._workers = workers
        self._lock = threading.RLock()
        self._pods: dict[str, dict] = {}  # uid -> latest pod object bound to this node
        self._runs: dict[str, PodRun] = {}  # uid -> admitted pod
        self._ips: set[str] = set()
        self._queue = WorkQueue()
        self._stopping = threading.Event()
        self._synced = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: set = set()  # open watch responses, shut down by stop()
        # Directories on the way to the Python installation that a non-root container could not enter.
        python = Path(os.path.realpath(sys.executable))
        self._hidden_dirs = sorted({str(d) for p in (python, self.bin_dir) for d in p.parents
                                    if not os.stat(d).st_mode & stat.S_IXOTH}, key=len)
        # What the pods' commands run from (the venv and the project of an editable install): a pod's volume
        # mounted over them (its emptyDir at /tmp over a checkout in /tmp) must not hide them.
        self._host_dirs = sorted({sys.prefix, str(self.bin_dir), str(Path(__file__).resolve().parents[2])}, key=len)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> ProcessKubelet:
        if os.geteuid() != 0:
            raise PermissionError("the process kubelet needs root: mount namespaces, bind mounts, setuid")
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a pidfd and a pipe per container
        for d in ("logs", "pods", "pvc"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("")
        self._write_hosts()
        self.api = kubernetes.config.new_client_from_config(self.kubeconfig)
        self.core = kubernetes.client.CoreV1Api(self.api)
        self._timers = Timers()
        self._reaper = Reaper()
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-probe")
        atexit.register(self.stop)  # the pods' processes are in sessions of their own: kill them at any exit
        self._register_node()
        node_selector = f"spec.nodeName={self.node_name}"
        self._spawn_thread("kubelet-heartbeat", self._heartbeat_loop)
        self._spawn_thread("kubelet-pods", self._informer, "pods",
                           lambda **kw: self.core.list_pod_for_all_namespaces(field_selector=node_selector, **kw),
                           self._on_pod)
        self._spawn_thread("kubelet-claims", self._informer, "persistentvolumeclaims",
                           self.core.list_persistent_volume_claim_for_all_namespaces, self._on_claim)
        for i in range(self._workers):
            self._spawn_thread(f"kubelet-worker-{i}", self._work)
        if not self._synced.wait(timeout):
            self.stop()
            raise TimeoutError(f"the kubelet could not list its pods within {timeout} s")
        return self

    def _spawn_thread(self, name: str, target: Callable, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        """Kill every process this kubelet started; the Node and the pods' API objects stay as they are."""
        atexit.unregister(self.stop)
        self._stopping.set()
        self._queue.close()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            for c in run.containers:
                if c.state == "running":
                    _killpg(c.process.pid, signal.SIGKILL)
        for run in runs:
            for c in run.containers:
                if c.process:
                    c.process.wait()
            for path in run.tmpfs:
                try:
                    umount(str(path))
                except OSError:  # a worker was cleaning the pod up at the same time
                    pass
        self._reaper.close()
        self._timers.close()
        self._probes.shutdown(wait=False, cancel_futures=True)
        for response in list(self._watches):  # unblocks their threads, which then see _stopping
            _shutdown(response)
        for thread in self._threads:
            thread.join(timeout=5)
        self.api.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- test helpers ----------------------------------------------------------------------------------------

    def _run_named(self, namespace: str, pod: str) -> PodRun | None:
        with self._lock:
            return next((r for r in self._runs.values() if r.namespace == namespace and r.name == pod), None)

    def pids(self, namespace: str, pod: str) -> list[int]:
        """The main process ids of the pod's running containers."""
        run = self._run_named(namespace, pod)
        return [c.process.pid for c in run.containers if c.state == "running"] if run else []

    def _termination_message(self, run: PodRun, c: Container) -> str:
        """terminationMessagePolicy FallbackToLogsOnError: a failed container's last 80 log lines, at most 2048
        bytes, as the real kubelet takes them (there is no termination-message file here: policy File gives none)."""
        if c.exit_code == 0 or c.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return ""
        lines = self.log(run.namespace, run.name, c.name).splitlines(keepends=True)[-80:]
        return "".join(lines).encode()[-2048:].decode(errors="ignore")

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.root / "logs" / f"{namespace}_{pod}_{container}.log"

    def log(self, namespace: str, pod: str, container: str) -> str:
        path = self.log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def exec(self, namespace: str, pod: str, container: str, argv: list[str],
             timeout: float = 30.0) -> subprocess.CompletedProcess:
        """kubectl exec: argv inside the running container (its mounts, hostname, user, env and working dir)."""
        run = self._run_named(namespace, pod)
        c = next((c for c in run.containers if c.name == container), None) if run else None
        if c is None or c.state != "running":
            raise RuntimeError(f"container {namespace}/{pod}/{container} is not running")
        return self._exec_in(run, c, argv, timeout)

    # ---- node ------------------------------------------------------------------------------------------------

    def _node_status(self) -> dict:
        amounts = {"cpu": "64", "memory": "256Gi", "pods": "1000", "ephemeral-storage": "1Ti",
                   "nvidia.com/gpu": str(self.gpus)}
        now = _now()
        conditions = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                       "message": "pat process kubelet is posting ready status"}]
        conditions += [{"type": t, "status": "False", "reason": f"KubeletHasNo{t}", "message": ""}
                       for t in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        for c in conditions:
            c.update(lastHeartbeatTime=now, lastTransitionTime=self._node_since)
        uname = os.uname()
        return {
            "capacity": amounts, "allocatable": amounts, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": uname.release,
                         "osImage": "pat process kubelet", "containerRuntimeVersion": "process://0",
                         "kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                         "operatingSystem": "linux", "architecture": "amd64"},
        }

    def _register_node(self) -> None:
        self._node_since = _now()
        labels = {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **self.labels}
        try:
            self.core.create_node({"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": self.node_name, "labels": labels}}, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(self.node_name, {"metadata": {"labels": labels}}, _content_type=MERGE,
                                 _preload_content=False)
        node = json.loads(self.core.patch_node_status(self.node_name, {"status": self._node_status()},
                                                      _content_type=SMP, _preload_content=False).data)
        self._node_uid = node["metadata"]["uid"]
        self._renew_lease()

    def _renew_lease(self) -> None:
        """The node-lifecycle controller takes the node for dead when this lease is not renewed for 40 s."""
        coordination = kubernetes.client.CoordinationV1Api(self.api)
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_now()}
        try:
            coordination.patch_namespaced_lease(self.node_name, "kube-node-lease", {"spec": spec},
                                                _content_type=MERGE, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self._node_uid}
            coordination.create_namespaced_lease("kube-node-lease", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node_name, "ownerReferences": [owner]}, "spec": spec},
                _preload_content=False)

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(HEARTBEAT_SECONDS):
            try:
                self._renew_lease()
                self.core.patch_node_status(self.node_name, {"status": self._node_status()}, _content_type=SMP,
                                            _preload_content=False)
            except Exception as e:
                if not self._stopping.is_set():
                    log.warning("node heartbeat failed: %s", e)

    # ---- watches ---------------------------------------------------------------------------------------------

    def _informer(self, what: str, list_call: Callable, handle: Callable[[str, object], None]) -> None:
        """List, then watch from the list's resourceVersion; list again after each watch (server timeout ~60 s,
        410 Gone, any error), so a missed event is repaired within a minute."""
        while not self._stopping.is_set():
            try:
                listed = json.loads(list_call(_preload_content=False).data)
                handle("SYNC", listed["items"])
                version = listed["metadata"]["resourceVersion"]
                response = list_call(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                     timeout_seconds=60, _preload_content=False, _request_timeout=(10, 90))
                self._watches.add(response)
                try:
                    for line in iter_resp_lines(response):
                        if self._stopping.is_set():
                            return
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # 410 Gone and the like: list again
                            break
                        if event["type"] != "BOOKMARK":
                            handle(event["type"], event["object"])
                finally:
                    self._watches.discard(response)
                    response.release_conn()
            except Exception as e:
                if self._stopping.is_set():
                    return
                log.warning("watching %s failed, listing again: %s", what, e)
                self._stopping.wait(1.0)

    def _on_pod(self, kind: str, obj: object) -> None:
        with self._lock:
            if kind == "SYNC":
                listed = {p["metadata"]["uid"]: p for p in obj}
                keys = set(listed) | set(self._pods) | set(self._runs)
                self._pods = listed
            elif kind == "DELETED":
                keys = {obj["metadata"]["uid"]}
                self._pods.pop(obj["metadata"]["uid"], None)
            else:
                keys = {obj["metadata"]["uid"]}
                self._pods[obj["metadata"]["uid"]] = obj
        for key in keys:
            self._queue.add(key)
        if kind == "SYNC":
            self._synced.set()

    def _on_claim(self, kind: str, obj: object) -> None:
        for claim in obj if kind == "SYNC" else [obj]:
            try:
                if kind == "DELETED":
                    self._release_claim(claim)
                else:
                    self._provision(claim)
            except ApiException as e:
                log.warning("claim %s/%s: %s", claim["metadata"]["namespace"], claim["metadata"]["name"], e)

    def claim_dir(self, namespace: str, claim: str) -> Path:
        return self.root / "pvc" / namespace / claim

    def _provision(self, claim: dict) -> None:
        """Bind a pending claim the cluster cannot bind to a PV of ours (a hostPath, which the pods never see:
        they get claim_dir); the controller-manager's PV binder completes the binding."""
        meta, spec = claim["metadata"], claim["spec"]
        if spec.get("volumeName") or claim.get("status", {}).get("phase") != "Pending":
            return
        storage_class = spec.get("storageClassName") or ""
        if storage_class and self._storage_class_exists(storage_class):
            return  # that class has a provisioner of its own
        path = self.claim_dir(meta["namespace"], meta["name"])
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # as dynamic local provisioners do: any pod user may write
        volume = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"pat-{meta['uid']}", "labels": {"pat.dev/process-kubelet": self.node_name}},
            "spec": {"capacity": {"storage": spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")},
                     "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                     "volumeMode": spec.get("volumeMode", "Filesystem"),
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": storage_class,
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                  "name": meta["name"], "uid": meta["uid"]},
                     "hostPath": {"path": str(path)}},
        }
        try:
            self.core.create_persistent_volume(volume, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise

    def _storage_class_exists(self, name: str) -> bool:
        try:
            kubernetes.client.StorageV1Api(self.api).read_storage_class(name, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def _release_claim(self, claim: dict) -> None:
        try:
            self.core.delete_persistent_volume(f"pat-{claim['metadata']['uid']}", _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise
        shutil.rmtree(self.claim_dir(claim["metadata"]["namespace"], claim["metadata"]["name"]), ignore_errors=True)

    # ---- pod sync --------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (uid := self._queue.get()) is not None:
            try:
                self._sync(uid)
            except Exception:
                if self._stopping.is_set():
                    return
                log.exception("syncing pod %s failed; retrying", uid)
                self._requeue(uid, RETRY_SECONDS)
            finally:
                self._queue.done(uid)

    def _requeue(self, uid: str, delay: float) -> None:
        self._timers.call_later(delay, lambda: self._queue.add(uid))

    def _sync(self, uid: str) -> None:
        with self._lock:
            pod, run = self._pods.get(uid), self._runs.get(uid)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            if run:
                self._terminate(run, pod)
            elif pod is not None:
                self._delete(pod)
            return
        if run is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return  # ended before this kubelet started: nothing to run
            run = self._admit(pod)
        run.pod = pod
        self._advance(run)
        self._report(run)

    def _admit(self, pod: dict) -> PodRun:
        spec = pod["spec"]
        run = PodRun(pod=pod, ip="", dir=self.root / "pods" / pod["metadata"]["uid"], start_time=_now(),
                     init=[Container(c, True) for c in spec.get("initContainers", [])],
                     main=[Container(c, False) for c in spec["containers"]])
        if run.init:
            for c in run.main:
                c.reason = "PodInitializing"
        with self._lock:
            run.ip = self._allocate_ip()
            self._runs[run.uid] = run
            self._write_hosts()  # before any process starts, so pods of one gang resolve each other at once
        return run

    def _advance(self, run: PodRun) -> None:
        """Start what may start now: the volumes, the next init container, then all containers."""
        if run.failure or run.terminating:
            return
        try:
            if run.volumes is None:
                run.volumes = self._prepare_volumes(run)
                for c in run.containers:  # back from an error of an earlier try
                    if c.reason == "CreateContainerConfigError":
                        c.reason = "PodInitializing" if run.init and not c.init else "ContainerCreating"
                        c.message = ""
        except ConfigError as e:
            for c in run.containers:
                c.reason, c.message = "CreateContainerConfigError", str(e)
            self._requeue(run.uid, RETRY_SECONDS)
            return
        for c in run.init:
            if c.state == "terminated" and c.exit_code == 0:
                continue
            if c.state == "waiting":
                self._start_container(run, c)
            return  # running, failed (the pod fails: restartPolicy Never) or still waiting
        for c in run.main:
            if c.state == "waiting":
                if (wait := c.start_after - time.monotonic()) > 0:
                    self._requeue(run.uid, wait)
                else:
                    self._start_container(run, c)

    def _start_container(self, run: PodRun, c: Container) -> None:
        try:
            spec = self._container_spec(run, c)
        except ConfigError as e:
            c.reason, c.message = "CreateContainerConfigError", str(e)
            self._requeue(run.uid, RETRY_SECONDS)
            return
        log_path = self.log_path(run.namespace, run.name, c.name)
        with open(log_path, "ab" if c.restarts else "wb") as out:  # a restart's output follows the last one's
            process, error = self._spawn(spec, self._base_env(run, c) | c.env, out, out)
        now = _now()
        if error is not None:
            c.state, c.reason, c.message, c.exit_code = "terminated", "StartError", error, 128
            c.started_at = c.finished_at = now
            return
        c.process, c.started_at, c.message = process, now, ""
        c.ready = "readinessProbe" not in c.spec
        c.state = "running"
        self._reaper.watch(process, lambda code: self._on_exit(run, c, code))
        for kind in ("readiness", "liveness"):
            if probe := c.spec.get(f"{kind}Probe"):
                self._schedule_probe(Probe(run, c, kind, probe, process.pid), probe.get("initialDelaySeconds", 0))

    def _on_exit(self, run: PodRun, c: Container, returncode: int) -> None:
        with self._lock:
            c.exit_code = 128 - returncode if returncode < 0 else returncode  # a signal N reads as 128+N
            c.finished_at = _now()
            c.reason = "Completed" if c.exit_code == 0 else "Error"
            c.ready = False
            c.state = "terminated"
            c.message = self._termination_message(run, c)
            if self._restarts(run, c):
                c.last_state = self._container_status(c)["state"]
                delay = min(BACKOFF_SECONDS * 2 ** c.restarts, BACKOFF_MAX_SECONDS)
                c.restarts += 1
                c.state, c.reason, c.process = "waiting", "CrashLoopBackOff", None
                c.message = f"back-off {delay:.0f}s restarting failed container={c.name} pod={run.name}"
                c.start_after = time.monotonic() + delay
        self._queue.add(run.uid)

    @staticmethod
    def _restarts(run: PodRun, c: Container) -> bool:
        """Whether an ended container starts again: its pod's restartPolicy (init containers: on failure)."""
        policy = run.pod["spec"].get("restartPolicy", "Always")
        if run.terminating or policy == "Never":
            return False
        return c.exit_code != 0 or (policy == "Always" and not c.init)

    def _terminate(self, run: PodRun, pod: dict | None) -> None:
        """Deletion: SIGTERM, SIGKILL after the grace period, clean up, then delete the object for good."""
        live = [c for c in run.containers if c.state == "running"]
        if not run.terminating:
            run.terminating = True
            if pod is None:
                grace = FORCED_GRACE_SECONDS
            else:
                grace = pod["metadata"].get("deletionGracePeriodSeconds",
                                            pod["spec"].get("terminationGracePeriodSeconds", 30))
            grace = min(grace, MAX_GRACE_SECONDS)
            run.kill_at = time.monotonic() + grace
            for c in live:
                _killpg(c.process.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
            if live:
                self._requeue(run.uid, grace)
        elif live and time.monotonic() >= run.kill_at:
            for c in live:
                _killpg(c.process.pid, signal.SIGKILL)
        if live:
            return  # each exit queues the pod again
        self._release(run)
        while run.tmpfs:  # one by one: a retry after a failure does not unmount twice
            umount(str(run.tmpfs[-1]))
            run.tmpfs.pop()
        shutil.rmtree(run.dir, ignore_errors=True)
        with self._lock:
            self._runs.pop(run.uid, None)
        if pod is not None:
            self._delete(pod)

    def _delete(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            # In the body, not as a query parameter: the server takes the body's (defaulted) grace period then.
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], _preload_content=False,
                                            body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiException as e:
            if e.status not in (404, 409):  # gone already, or a new pod of that name
                raise

    def _release(self, run: PodRun) -> None:
        with self._lock:
            if not run.released:
                run.released = True
                self._ips.discard(run.ip)
                self._write_hosts()

    def _allocate_ip(self) -> str:
        for i in itertools.count(2):
            if i & 0xFF in (0, 0xFF):
                continue
            ip = f"127.{i >> 16 & 0xFF}.{i >> 8 & 0xFF}.{i & 0xFF}"
            if ip not in self._ips:
                self._ips.add(ip)
                return ip
        raise AssertionError("unreachable")

    def _write_hosts(self) -> None:
        """Rewritten in place, never replaced: every pod has this very inode bind-mounted as /etc/hosts."""
        lines = ["# managed by the pat process kubelet", "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost"]
        for run in self._runs.values():
            if run.released:
                continue
            spec, meta = run.pod["spec"], run.pod["metadata"]
            names = []
            if spec.get("hostname") and spec.get("subdomain"):
                short = f"{spec['hostname']}.{spec['subdomain']}"
                namespaced = f"{short}.{meta['namespace']}"
                names = [f"{namespaced}.svc.cluster.local", f"{namespaced}.svc", namespaced, short]
            names += dict.fromkeys(n for n in (spec.get("hostname"), meta["name"]) if n and n not in names)
            lines.append(f"{run.ip}\t{' '.join(names)}")
        data = ("\n".join(lines) + "\n").encode()
        with open(self.hosts_file, "r+b") as f:
            f.write(data)
            f.truncate()

    # ---- status ----------------------------------------------------------------------------------------------

    def _phase(self, run: PodRun) -> str:
        """The real kubelet's getPhase: a container waiting to restart has run, and counts as running."""
        if run.failure or any(c.state == "terminated" and c.exit_code != 0 for c in run.init):
            return "Failed"
        if any(c.state != "terminated" for c in run.init) or any(
                c.state == "waiting" and not c.restarts for c in run.main):
            return "Pending"
        if any(c.state == "running" or c.restarts and c.state == "waiting" for c in run.main):
            return "Running"
        return "Succeeded" if all(c.exit_code == 0 for c in run.main) else "Failed"

    def _condition(self, run: PodRun, kind: str, ok: bool, reason: str = "", message: str = "") -> dict:
        status = "True" if ok else "False"
        if run.transitions.get(kind, ("",))[0] != status:
            run.transitions[kind] = (status, _now())
        condition = {"type": kind, "status": status, "lastProbeTime": None,
                     "lastTransitionTime": run.transitions[kind][1]}
        if not ok:
            condition.update(reason=reason, message=message)
        return condition

    def _container_status(self, c: Container) -> dict:
        status = {"name": c.name, "image": c.spec.get("image", ""), "imageID": "", "restartCount": c.restarts,
                  "ready": c.ready and c.state == "running", "started": c.state == "running"}
        if c.last_state:
            status["lastState"] = c.last_state
        if c.process:
            status["containerID"] = f"process://{c.process.pid}"
        if c.state == "waiting":
            status["state"] = {"waiting": {"reason": c.reason, **({"message": c.message} if c.message else {})}}
        elif c.state == "running":
            status["state"] = {"running": {"startedAt": c.started_at}}
        else:
            terminated = {"exitCode": c.exit_code, "reason": c.reason, "startedAt": c.started_at,
                          "finishedAt": c.finished_at}
            if c.message:
                terminated["message"] = c.message
            status["state"] = {"terminated": terminated}
        return status

    def _status(self, run: PodRun) -> dict:
        phase = self._phase(run)
        initialized = all(c.state == "terminated" and c.exit_code == 0 for c in run.init)
        unready = [c.name for c in run.main if not (c.ready and c.state == "running")]
        done = phase in ("Succeeded", "Failed")
        unready_reason = "PodCompleted" if phase == "Succeeded" else "ContainersNotReady"
        unready_message = f"containers with unready status: [{' '.join(unready)}]"
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": run.ip, "podIPs": [{"ip": run.ip}],
            "startTime": run.start_time,
            "conditions": [
                self._condition(run, "Initialized", initialized, "ContainersNotInitialized",
                                "containers with incomplete status: "
                                f"[{' '.join(c.name for c in run.init if c.state != 'terminated')}]"),
                self._condition(run, "Ready", not unready and not done, unready_reason, unready_message),
                self._condition(run, "ContainersReady", not unready and not done, unready_reason, unready_message),
                self._condition(run, "PodScheduled", True),
            ],
            "containerStatuses": [self._container_status(c) for c in run.main],
        }
        if run.init:
            status["initContainerStatuses"] = [self._container_status(c) for c in run.init]
        if run.failure:
            status["reason"], status["message"] = run.failure
        return status

    def _report(self, run: PodRun) -> None:
        with self._lock:
            status = self._status(run)
        if status["phase"] in ("Succeeded", "Failed"):
            self._release(run)  # nothing of it runs any more: its IP and name are free
        if status == run.reported:
            return
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status}, _content_type=SMP,
                                                  _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return  # deleted meanwhile: the watch tells
            raise
        run.reported = status

    # ---- container setup -------------------------------------------------------------------------------------

    def _container_spec(self, run: PodRun, c: Container) -> dict:
        """The podexec spec of a container; ConfigError where the real kubelet reports CreateContainerConfigError."""
        spec, pod_spec = c.spec, run.pod["spec"]
        pod_security = pod_spec.get("securityContext", {})
        security = {**pod_security, **spec.get("securityContext", {})}
        uid = security.get("runAsUser")
        if security.get("runAsNonRoot") and not uid:
            raise ConfigError("container has runAsNonRoot and image will run as root "
                              f"(pod: \"{run.name}_{run.namespace}({run.uid})\", container: {c.name})")
        c.env = self._container_env(run, spec)
        groups = [g for g in [pod_security.get("fsGroup"), *pod_security.get("supplementalGroups", [])] if g]
        c.identity = (uid, security.get("runAsGroup", 0), groups)
        mounts = [{"source": str(self.hosts_file), "target": "/etc/hosts", "readonly": True}]
        if account := run.volumes.get(SERVICE_ACCOUNT_VOLUME):
            mounts.append({"source": str(account.path), "target": SERVICE_ACCOUNT_DIR, "readonly": True})
        for m in sorted(spec.get("volumeMounts", []), key=lambda m: len(Path(m["mountPath"]).parts)):
            volume = run.volumes.get(m["name"])
            if volume is None:
                raise ConfigError(f'volume "{m["name"]}" is not defined in the pod')
            source = volume.path
            if sub := m.get("subPath") or expand(m.get("subPathExpr", ""), c.env):
                source = volume.path / sub
                if not source.exists():
                    source.mkdir(parents=True)
                    st = volume.path.stat()
                    source.chmod(stat.S_IMODE(st.st_mode))
                    os.chown(source, st.st_uid, st.st_gid)
            mounts.append({"source": str(source), "target": m["mountPath"],
                           "readonly": bool(m.get("readOnly")) or volume.readonly})
        return {
            "argv": [expand(a, c.env) for a in spec.get("command", []) + spec.get("args", [])],
            "workdir": spec.get("workingDir"), "uid": uid, "gid": c.identity[1], "groups": groups,
            "hostname": pod_spec.get("hostname") or run.name,
            "traversable": self._hidden_dirs if uid else [], "host": self._host_dirs,
            "mounts": mounts, "readonly_root": bool(security.get("readOnlyRootFilesystem")),
        }

    def _base_env(self, run: PodRun, c: Container) -> dict[str, str]:
        """What an image would contribute: the container's own variables (PATH too) override it."""
        uid = c.identity[0] or 0
        try:
            home = pwd.getpwuid(uid).pw_dir
        except KeyError:
            home = "/"
        api = urllib.parse.urlsplit(self.api.configuration.host)
        return {"PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
                "HOME": home, "HOSTNAME": run.pod["spec"].get("hostname") or run.name, "LANG": "C.UTF-8",
                # What every pod gets from the `kubernetes` Service (enableServiceLinks or not).
                "KUBERNETES_SERVICE_HOST": api.hostname, "KUBERNETES_SERVICE_PORT": str(api.port or 443)}

    def _spawn(self, spec: dict, env: dict[str, str], stdout: object, stderr: object
               ) -> tuple[subprocess.Popen | None, str | None]:
        """Start podexec; returns once it has exec'd the command (error None) or failed to (its message)."""
        if not spec["argv"]:
            return None, "no command: the pat process kubelet has no image entrypoints"
        read_end, write_end = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(PODEXEC), json.dumps({**spec, "errfd": write_end})],
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, pass_fds=(write_end,),
                start_new_session=True)  # own process group: signals reach everything the container starts
        finally:
            os.close(write_end)
        chunks = []
        poller = select.poll()  # not select(): with hundreds of pods the descriptor numbers pass 1024
        poller.register(read_end, select.POLLIN)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while (left := deadline - time.monotonic()) > 0 and poller.poll(left * 1000):
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_end)
        if chunks:
            process.wait()
            return process, b"".join(chunks).decode(errors="replace")
        return process, None

    def _exec_in(self, run: PodRun, c: Container, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        uid, gid, groups = c.identity
        spec = {"argv": argv, "workdir": c.spec.get("workingDir"), "uid": uid, "gid": gid, "groups": groups,
                "join_pid": c.process.pid}
        process, error = self._spawn(spec, self._base_env(run, c) | c.env, subprocess.PIPE, subprocess.PIPE)
        if error is not None:
            if process:
                process.communicate()
            return subprocess.CompletedProcess(argv, 126, b"", error.encode())
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        return subprocess.CompletedProcess(argv, process.returncode, out, err)

    def _field(self, run: PodRun, path: str) -> str:
        meta = run.pod["metadata"]
        if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
            return meta.get(m[1], {}).get(m[2], "")
        if path in ("metadata.labels", "metadata.annotations"):  # downwardAPI volume files
            return "\n".join(f'{k}="{v}"' for k, v in sorted(meta.get(path.split(".")[1], {}).items()))
        values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "status.podIP": run.ip, "status.podIPs": run.ip, "status.hostIP": "127.0.0.1",
                  "spec.nodeName": self.node_name,
                  "spec.serviceAccountName": run.pod["spec"].get("serviceAccountName") or "default"}
        if path not in values:
            raise ConfigError(f"fieldRef {path} is not supported")
        return values[path]

    def _source(self, namespace: str, kind: str, name: str) -> dict[str, bytes] | None:
        """A Secret's or ConfigMap's keys (None: it does not exist)."""
        try:
            if kind == "Secret":
                obj = json.loads(self.core.read_namespaced_secret(name, namespace, _preload_content=False).data)
                return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            obj = json.loads(self.core.read_namespaced_config_map(name, namespace, _preload_content=False).data)
            return {**{k: v.encode() for k, v in (obj.get("data") or {}).items()},
                    **{k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}}
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _container_env(self, run: PodRun, spec: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in spec.get("envFrom", []):
            kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else (
                "Secret", source["secretRef"])
            data = self._source(run.namespace, kind, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
            for key, value in data.items():
                env[source.get("prefix", "") + key] = value.decode(errors="replace")
        for var in spec.get("env", []):
            name, value_from = var["name"], var.get("valueFrom")
            if value_from is None:
                env[name] = expand(var.get("value", ""), env)  # earlier variables only, as Kubernetes does
            elif "fieldRef" in value_from:
                env[name] = self._field(run, value_from["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in value_from or "configMapKeyRef" in value_from:
                kind, ref = ("Secret", value_from["secretKeyRef"]) if "secretKeyRef" in value_from else (
                    "ConfigMap", value_from["configMapKeyRef"])
                data = self._source(run.namespace, kind, ref["name"])
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found' if data is None else
                                      f"couldn't find key {ref['key']} in {kind} {run.namespace}/{ref['name']}")
                env[name] = data[ref["key"]].decode(errors="replace")
            else:
                raise ConfigError(f"env {name}: valueFrom {sorted(value_from)} is not supported")
        return env

    def _prepare_volumes(self, run: PodRun) -> dict[str, Volume]:
        pod_spec = run.pod["spec"]
        fs_group = pod_spec.get("securityContext", {}).get("fsGroup")
        volumes: dict[str, Volume] = {}
        for v in pod_spec.get("volumes", []):
            name, own = v["name"], run.dir / "volumes" / v["name"]
            if "emptyDir" in v:
                own.mkdir(parents=True, exist_ok=True)
                if v["emptyDir"].get("medium") == "Memory" and own not in run.tmpfs:  # not again on a retry
                    size = v["emptyDir"].get("sizeLimit")
                    mount("tmpfs", str(own), 0, "tmpfs", "mode=0777" + (f",size={_bytes(size)}" if size else ""))
                    run.tmpfs.append(own)
                own.chmod(0o777)  # the real kubelet's emptyDir mode
                volumes[name] = Volume(_give_group(own, fs_group), False)
            elif "hostPath" in v:
                path, kind = Path(v["hostPath"]["path"]), v["hostPath"].get("type", "")
                if kind in ("", "DirectoryOrCreate") and not path.exists():
                    path.mkdir(parents=True)
                elif kind == "FileOrCreate" and not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
                elif kind in ("Directory", "File") and not (path.is_dir() if kind == "Directory" else path.is_file()):
                    raise ConfigError(f"hostPath type check failed: {path} is not a {kind.lower()}")
                volumes[name] = Volume(path, False)
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]
                path = self.claim_dir(run.namespace, claim["claimName"])
                if not path.exists():
                    path.mkdir(parents=True)
                    path.chmod(0o777)
                volumes[name] = Volume(_give_group(path, fs_group), bool(claim.get("readOnly")))
            elif "configMap" in v or "secret" in v:
                kind, source = ("ConfigMap", v["configMap"]) if "configMap" in v else ("Secret", v["secret"])
                source_name = source.get("name") or source.get("secretName")
                data = self._source(run.namespace, kind, source_name)
                if data is None and not source.get("optional"):
                    raise ConfigError(f'{kind.lower()} "{source_name}" not found (volume {name})')
                files = {}
                for item in source.get("items") or [{"key": k, "path": k} for k in (data or {})]:
                    if data is None or item["key"] not in data:
                        if source.get("optional"):
                            continue
                        raise ConfigError(f"{kind.lower()} {source_name} has no key {item['key']} (volume {name})")
                    files[item["path"]] = (data[item["key"]], item.get("mode"))
                volumes[name] = Volume(_write_files(own, files, source.get("defaultMode", 0o644), fs_group), True)
            elif "downwardAPI" in v:
                files = {item["path"]: (self._field(run, item["fieldRef"]["fieldPath"]).encode(), item.get("mode"))
                         for item in v["downwardAPI"].get("items", []) if "fieldRef" in item}
                volumes[name] = Volume(_write_files(own, files, v["downwardAPI"].get("defaultMode", 0o644),
                                                    fs_group), True)
            else:
                kind = next((k for k in v if k != "name"), "?")
                raise ConfigError(f"volume {name}: {kind} volumes are not supported by the pat process kubelet")
        if pod_spec.get("automountServiceAccountToken", True):
            files = {"token": (self._token(run), None), "namespace": (run.namespace.encode(), None),
                     "ca.crt": (Path(self.api.configuration.ssl_ca_cert).read_bytes()
                                if self.api.configuration.ssl_ca_cert else b"", None)}
            volumes[SERVICE_ACCOUNT_VOLUME] = Volume(
                _write_files(run.dir / "volumes" / SERVICE_ACCOUNT_VOLUME, files, 0o644, fs_group), True)
        return volumes

    def _token(self, run: PodRun) -> bytes:
        """A token of the pod's ServiceAccount bound to the pod: it stops working when the pod is deleted.

        Without the ServiceAccount admission (off in the test control plane) a pod that names no account keeps an
        empty serviceAccountName, and the server binds no token to it: that pod's `default` token is unbound."""
        account = run.pod["spec"].get("serviceAccountName")
        spec: dict = {"expirationSeconds": TOKEN_SECONDS}
        if account:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": run.name, "uid": run.uid}
        account = account or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        try:
            response = self.core.create_namespaced_service_account_token(account, run.namespace, request,
                                                                         _preload_content=False)
        except ApiException as e:
            if e.status == 404:  # as the real kubelet: the pod waits for its ServiceAccount
                raise ConfigError(f'serviceaccount "{account}" not found') from e
            raise
        return json.loads(response.data)["status"]["token"].encode()

    # ---- probes ----------------------------------------------------------------------------------------------

    def _schedule_probe(self, probe: Probe, delay: float) -> None:
        self._timers.call_later(delay, lambda: self._stopping.is_set() or self._probes.submit(self._probe, probe))

    def _probe(self, probe: Probe) -> None:
        c, spec = probe.container, probe.spec
        if c.state != "running" or c.process.pid != probe.pid or probe.run.terminating or self._stopping.is_set():
            return
        ok = self._probe_once(probe)
        probe.successes, probe.failures = (probe.successes + 1, 0) if ok else (0, probe.failures + 1)
        failed = probe.failures >= spec.get("failureThreshold", 3)
        if probe.kind == "readiness":
            ready = c.ready
            if ok and probe.successes >= spec.get("successThreshold", 1):
                ready = True
            elif failed:
                ready = False
            if ready != c.ready:
                c.ready = ready
                self._queue.add(probe.run.uid)
        elif failed:  # liveness: the container ends (and restarts, as its restartPolicy says)
            log.info("liveness probe of %s/%s/%s failed: killing it", probe.run.namespace, probe.run.name, c.name)
            _killpg(c.process.pid, signal.SIGKILL)
            return
        self._schedule_probe(probe, max(1, spec.get("periodSeconds", 10)))

    def _probe_once(self, probe: Probe) -> bool:
        spec, run, c = probe.spec, probe.run, probe.container
        timeout = max(1, spec.get("timeoutSeconds", 1))
        try:
            if "exec" in spec:
                return self._exec_in(run, c, spec["exec"]["command"], timeout).returncode == 0
            action = spec.get("httpGet") or spec.get("tcpSocket")
            host, port = action.get("host") or run.ip, action["port"]
            if isinstance(port, str):
                port = next((p["containerPort"] for p in c.spec.get("ports", []) if p.get("name") == port), None)
                if port is None:
                    return False
            if "tcpSocket" in spec:
                socket.create_connection((host, port), timeout=timeout).close()
                return True
            if action.get("scheme", "HTTP").upper() == "HTTPS":
                conn = http.client.HTTPSConnection(host, port, timeout=timeout,
                                                   context=ssl._create_unverified_context())  # as kubelets do
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("GET", action.get("path", "/"),
                             headers={h["name"]: h["value"] for h in action.get("httpHeaders", [])})
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, subprocess.TimeoutExpired):
            return False


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (sizeLimit) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[:-len(suffix)]) * factor)
    return int(quantity)


def _give_group(path: Path, fs_group: int | None) -> Path:
    """fsGroup: the volume belongs to that group, group-writable, and new files inherit the group (setgid)."""
    if fs_group is not None:
        os.chown(path, -1, fs_group)
        path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IRWXG | stat.S_ISGID)
    return path


def _write_files(directory: Path, files: dict[str, tuple[bytes, int | None]], default_mode: int,
                 fs_group: int | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for relative, (content, mode) in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode if mode is not None else default_mode)
        if fs_group is not None:
            os.chown(path, -1, fs_group)
    return directory


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run pods bound to a node as local processes.")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", default="pat-node-0")
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--root", help="kubelet directory (default: a temp dir, removed at exit)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kubelet = ProcessKubelet(args.kubeconfig, node_name=args.node, gpus=args.gpus, root=args.root).start()
    print(f"node {args.node} ready; pod logs under {kubelet.root / 'logs'}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
