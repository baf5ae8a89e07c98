"""A test kubelet: the pods bound to its Node run as local processes, from the project's images or from the host.

    python -m tests.cluster.kubelet --kubeconfig F [--node pat-node-0] [--gpus 16]

What a pod gets, and what differs from a real node:
- An image of this machine's buildah store (`localhost/...`: scripts/images.sh builds the project's) is run as a
  container runtime runs it (tests/cluster/images.py): its root filesystem under an overlay of the container's own,
  chrooted; its Env under the container's; its USER unless runAsUser says otherwise; its Entrypoint and Cmd where
  the container sets no command or args. Such an image missing from the store is ErrImageNeverPull (nothing pulls).
- Any other image is ignored: the host is the image, and the command runs with the directory of sys.executable (the
  project's venv) first on PATH. A container without `command` cannot run (there is no image entrypoint).
- Each container runs in its own mount and UTS namespace (tests/cluster/podexec.py): volumes are bind mounts,
  /etc/hosts is the kubelet's hosts file (read-only), the hostname is spec.hostname or the pod name,
  readOnlyRootFilesystem remounts / read-only there.
- The network is a cluster's (NodeNetwork has the layout): each pod has a network namespace of its own, shared by
  its containers (and joined by exec and exec probes), with its own loopback and one address, its pod IP, from a
  test-only range (198.18.0.0/15, a /22 per node); servers bind 0.0.0.0 as on any node, and pods never collide on a
  port. The node has a namespace of its own too: its IP (status.hostIP) is the pods' gateway. The test machine (the
  tests, the operator, Prometheus) reaches every pod by its pod IP through routes in the root namespace, pods reach
  each other across nodes, and pods reach the machine at 198.18.0.1 (HOST_ADDRESS; not at 127.0.0.1, which is the
  pod's own). Nothing routes pods out of the machine (no NAT); DNS is relayed by the node (resolv.conf names it).
  hostNetwork pods run in the node's namespace. Needs iproute2 (`ip`) and root. Several kubelets (nodes) of one or
  several processes run side by side: each node's block is held by a lock, and a crashed run's namespaces are
  swept when a kubelet starts.
- Headless-service DNS is the hosts file: `hostname.subdomain[.namespace[.svc[.cluster.local]]]` and the pod
  name resolve to the pod IP from admission (before the process starts) until the pod ends; the hosts file of each
  kubelet lists the pods of every kubelet of its process, so pods of one gang on two nodes resolve each other.
- restartPolicy Never, OnFailure and Always (a Deployment's pods): an ended container is started again after
  the real kubelet's back-off (10 s, doubling, at most 5 min; waiting reason CrashLoopBackOff), restartCount counts.
- The ServiceAccount token, as the real kubelet's projected kube-api-access volume (unless the pod sets
  automountServiceAccountToken: false): a token bound to the pod (TokenRequest), ca.crt and namespace under
  /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT naming the `kubernetes` Service
  (10.96.0.1:443, which the apiserver's serving certificate names), so in-cluster clients work unchanged and act with
  only their ServiceAccount's RBAC. With no kube-proxy here, the node relays that address to the API server.
- Volumes: emptyDir (medium Memory: a tmpfs), hostPath, configMap, secret, downwardAPI, persistentVolumeClaim
  (a directory per namespace/claim under the kubelet root; the kubelet also binds pending claims of no or an
  unknown StorageClass to a PersistentVolume of its own, or the scheduler would never place their pods).
- Probes: readiness and liveness, httpGet/tcpSocket/exec (httpGet and tcpSocket from the host, to the pod IP).
  No resource limits, no OOM kills, no image pulls.
- lose() kills a node as a machine dies (see there): its pods' objects stay, deleted ones Terminating for good.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import fcntl
import heapq
import http.client
import ipaddress
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

from tests.cluster.images import Image, ImageError, ImageStore
from tests.cluster.podexec import CLONE_NEWNET, mount, setns, umount

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
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"


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


# ---- the pod network -----------------------------------------------------------------------------------------------

POD_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544's benchmarking range: no real network uses it
HOST_ADDRESS = "198.18.0.1"  # the test machine as nodes and pods reach it (on the root namespace's lo)
NODE_PREFIX = 22  # each node's pod range (1020 pods): block 0 holds HOST_ADDRESS, blocks 1..127 are nodes'
NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps the named namespaces
LOCK_DIR = Path("/run/pat-kubelet")  # block-K.lock: flock-ed for life by the process whose node has block K
DNS_PORT = 53


class NetworkError(Exception):
    pass


def _ip(*args: str, netns: str | None = None, batch: Iterable[str] = (), check: bool = True) -> str:
    """Run iproute2's `ip` (in the named namespace): args, or the batch of commands (stops at the first error)."""
    batch = list(batch)
    argv = ["ip", *(["-n", netns] if netns else []), *(["-batch", "-"] if batch else args)]
    result = subprocess.run(argv, input="".join(f"{c}\n" for c in batch) if batch else None, capture_output=True,
                            text=True)
    if check and result.returncode:
        raise NetworkError(f"{' '.join(argv)}{' <<< ' + '; '.join(batch) if batch else ''}: {result.stderr.strip()}")
    return result.stdout


def _in_netns(name: str, fn: Callable[[], object]) -> object:
    """fn() in the named network namespace (a socket made there stays there): in a thread of its own, as setns moves
    only the calling thread, and a thread that ends takes its namespace with it whatever happened."""
    out: list = []

    def run() -> None:
        try:
            setns(str(NETNS_DIR / name), CLONE_NEWNET)
            out.append((True, fn()))
        except BaseException as e:
            out.append((False, e))

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _kill_netns(name: str) -> None:
    """SIGKILL the processes in a named namespace (a crashed kubelet's pods), then delete its name."""
    try:
        ns = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
        except OSError:  # gone, or a kernel thread
            continue
        if (st.st_ino, st.st_dev) == (ns.st_ino, ns.st_dev):
            _killpg(int(pid), signal.SIGKILL)  # its own session: the pods' process groups
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    _ip("netns", "del", name, check=False)


def _root_network() -> None:
    """What every node needs of the root namespace: forwarding (pod to pod across nodes), HOST_ADDRESS, and an
    unreachable route for POD_NETWORK, so that an address of no running node fails at once (EHOSTUNREACH) instead of
    leaving through the machine's default route. They stay after the tests: other test sessions' nodes on this
    machine may use them."""
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    if forward.read_text().strip() != "1":
        forward.write_text("1")
    for argv in (["addr", "add", f"{HOST_ADDRESS}/32", "dev", "lo"], ["route", "add", "unreachable", str(POD_NETWORK)]):
        result = subprocess.run(["ip", *argv], capture_output=True, text=True)
        if result.returncode and not re.search("exists|already assigned", result.stderr):  # an earlier run's
            raise NetworkError(f"ip {' '.join(argv)}: {result.stderr.strip()}")


class Relays:
    """What kube-proxy and a node-local DNS cache give pods on a real node: there is no kube-proxy here (and no
    netfilter tool to program one), so the node's namespace holds the `kubernetes` Service's cluster IP and a TCP relay
    from it to the API server, and a DNS relay at the node's IP to the machine's resolver (pods have no route out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sockets.update(socks)
            return True

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(socks)
        for s in socks:
            s.close()

    def _thread(self, target: Callable, *args: object) -> None:
        threading.Thread(target=target, args=args, name="kubelet-relay", daemon=True).start()

    def tcp(self, netns: str, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        listener = _in_netns(netns, lambda: socket.create_server(listen, backlog=128))
        self._track(listener)
        self._thread(self._accept, listener, upstream)

    def _accept(self, listener: socket.socket, upstream: tuple[str, int]) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # shut down by close()
                return
            self._thread(self._connect, conn, upstream)

    def _connect(self, conn: socket.socket, upstream: tuple[str, int]) -> None:
        try:
            up = socket.create_connection(upstream, timeout=10)
            up.settimeout(None)
        except OSError as e:
            log.warning("relay to %s:%s: %s", *upstream, e)
            conn.close()
            return
        if not self._track(conn, up):
            self._untrack(conn, up)
            return
        other = threading.Thread(target=self._pipe, args=(conn, up), name="kubelet-relay", daemon=True)
        other.start()
        self._pipe(up, conn)
        other.join()
        self._untrack(conn, up)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def udp(self, netns: str, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        def bind() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(listen)
            sock.settimeout(0.5)  # a UDP socket's recvfrom does not end when another thread shuts it down
            return sock

        sock = _in_netns(netns, bind)
        self._track(sock)
        self._thread(self._datagrams, sock, upstream)

    def _datagrams(self, sock: socket.socket, upstream: tuple[str, int]) -> None:
        while not self._closed:
            try:
                query, peer = sock.recvfrom(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            self._thread(self._ask, sock, query, peer, upstream)

    @staticmethod
    def _ask(sock: socket.socket, query: bytes, peer: tuple[str, int], upstream: tuple[str, int]) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as up:
            up.settimeout(5)
            try:
                up.sendto(query, upstream)
                sock.sendto(up.recv(1 << 16), peer)
            except OSError:
                pass  # the client asks again, as it would of a lost datagram

    def close(self) -> None:
        """Ends the relays and every relayed connection (a dead node's connections break)."""
        with self._lock:
            self._closed = True
            socks = list(self._sockets)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class NodeNetwork:
    """One node's network: its own network namespace, routed from the root namespace, and one per pod behind it.
    Node K has block K of POD_NETWORK (K = 1..127, a /22 each: 198.18.4.0/22, 198.18.8.0/22, ...).

    root namespace (the test machine: the tests, the operator, Prometheus, the API server on 127.0.0.1)
      lo: HOST_ADDRESS 198.18.0.1/32; route unreachable 198.18.0.0/15 (an address of no node fails at once)
      patnK --veth-- "uplink" of namespace pat-nodeK; route block K via the node's IP (src HOST_ADDRESS)
    pat-nodeK (the node's host network; forwarding on)
      lo: the node IP (block K's first address: its InternalIP and the pods' hostIP) and the `kubernetes`
          Service's cluster IP
      default route via HOST_ADDRESS over uplink; route unreachable block K; per pod a veth pvN (N: the pod IP's
      offset in the block) and a /32 route to the pod's IP over it
      relays: cluster IP:443 -> the API server, node IP:53 -> the machine's resolver (see Relays)
    pat-pod-IP (one pod: all its containers)
      lo up; eth0 (the peer of pvN) with the pod IP/32; default route via the node IP

    The block is the node's for as long as its process holds LOCK_DIR/block-K.lock: several nodes (kubelets) of one
    or of several processes never collide, and a block whose lock nobody holds is a crashed run's leftover, swept
    (its processes killed, its namespaces and links deleted) when a kubelet starts."""

    blocks = list(POD_NETWORK.subnets(new_prefix=NODE_PREFIX))

    def __init__(self, service: tuple[str, int], api_server: tuple[str, int]) -> None:
        self.service = service  # the `kubernetes` Service's cluster IP and port
        self.api_server = api_server
        self.block: ipaddress.IPv4Network | None = None
        self._lock_fd: int | None = None
        self._lock = threading.Lock()
        self._pods: set[str] = set()  # allocated pod IPs
        self._next = 0
        self._relays = Relays()

    @property
    def node_ip(self) -> str:
        return str(self.block[1])

    @property
    def netns(self) -> str:
        return f"pat-node{self.blocks.index(self.block)}"

    def start(self) -> NodeNetwork:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        _root_network()
        for k in range(1, len(self.blocks)):
            path = LOCK_DIR / f"block-{k}.lock"
            if self._lock_fd is not None and not path.exists():
                continue  # nothing of a block that was never used can be left
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live node's
                os.close(fd)
                continue
            self._sweep(k, stale=True)
            if self._lock_fd is None:
                self._lock_fd, self.block = fd, self.blocks[k]
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            else:
                os.close(fd)
        if self._lock_fd is None:
            raise NetworkError(f"no free node block in {POD_NETWORK}: {len(self.blocks) - 1} nodes run already")
        try:
            self._setup()
        except BaseException:
            self.stop()
            raise
        return self

    def _sweep(self, k: int, stale: bool = False) -> None:
        block = self.blocks[k]
        for name in sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []:
            if name == f"pat-node{k}" or name.startswith("pat-pod-") and _in_block(name[8:], block):
                if stale:
                    log.info("removing network namespace %s, left by an earlier run", name)
                _kill_netns(name)
        _ip("link", "del", f"patn{k}", check=False)

    def _setup(self) -> None:
        k, node, (service_ip, service_port) = self.blocks.index(self.block), self.netns, self.service
        _ip("netns", "add", node)
        _ip(batch=[f"link add patn{k} type veth peer name uplink netns {node}", f"link set patn{k} up",
                   f"route add {self.block} via {self.node_ip} dev patn{k} onlink src {HOST_ADDRESS}"])
        # The block's addresses that are no pod's are unreachable here: not sent back up to the root namespace.
        _ip(netns=node, batch=["link set lo up", f"addr add {self.node_ip}/32 dev lo",
                               f"addr add {service_ip}/32 dev lo", "link set uplink up",
                               f"route add default via {HOST_ADDRESS} dev uplink onlink",
                               f"route add unreachable {self.block}"])
        _in_netns(node, lambda: Path("/proc/sys/net/ipv4/ip_forward").write_text("1"))
        self._relays.tcp(node, (service_ip, service_port), self.api_server)
        if nameserver := _nameserver():
            self._relays.udp(node, (self.node_ip, DNS_PORT), (nameserver, DNS_PORT))

    def allocate(self) -> str:
        """A free pod IP of the block: the one after the last one given (host-local IPAM's order), so a pod's IP is
        not at once another's."""
        hosts = self.block.num_addresses
        with self._lock:
            for step in range(1, hosts):
                offset = (self._next + step) % hosts
                ip = str(self.block[offset])
                if offset >= 2 and ip.rsplit(".", 1)[1] not in ("0", "255") and ip not in self._pods:
                    self._pods.add(ip)
                    self._next = offset
                    return ip
        raise NetworkError(f"no free pod IP in {self.block}")

    def _names(self, ip: str) -> tuple[str, str]:
        """The pod's namespace and the node's end of its veth."""
        offset = int(ipaddress.IPv4Address(ip)) - int(self.block.network_address)
        return f"pat-pod-{ip}", f"pv{offset}"

    def add_pod(self, ip: str) -> str:
        """The pod's sandbox: its namespace, wired to the node. Returns the namespace's path."""
        name, veth = self._names(ip)
        if (NETNS_DIR / name).exists():  # a try that failed half way
            self.remove_pod(ip, free=False)
        _ip("netns", "add", name)
        wire = [f"link add {veth} type veth peer name eth0 netns {name}", f"link set {veth} up",
                f"route add {ip}/32 dev {veth}"]
        try:
            _ip(netns=self.netns, batch=wire)
        except NetworkError:  # the address's last pod's veth: its namespace is not destroyed yet, or outlived it
            _ip("link", "del", veth, netns=self.netns, check=False)
            _ip(netns=self.netns, batch=wire)
        _ip(netns=name, batch=["link set lo up", f"addr add {ip}/32 dev eth0", "link set eth0 up",
                               f"route add default via {self.node_ip} dev eth0 onlink"])
        return str(NETNS_DIR / name)

    def remove_pod(self, ip: str, free: bool = True) -> None:
        """Delete the pod's namespace (killing what is left in it). The kernel destroys it, its veth and route with
        it, a little later (deleting the veth here would cost ~20 ms, the namespace's name ~2): the address is given
        again only after every other address of the block (allocate), and add_pod deletes a veth still there."""
        _kill_netns(self._names(ip)[0])
        if free:
            self.free(ip)

    def free(self, ip: str) -> None:
        with self._lock:
            self._pods.discard(ip)

    def stop(self) -> None:
        """Removes the pods' namespaces, the node's and its link, and gives the block back."""
        self._relays.close()
        if self._lock_fd is None:
            return
        for ip in list(self._pods):
            self.remove_pod(ip)
        self._sweep(self.blocks.index(self.block))
        os.close(self._lock_fd)
        self._lock_fd = None


def _in_block(text: str, block: ipaddress.IPv4Network = ipaddress.IPv4Network("0.0.0.0/0")) -> bool:
    """Whether `text` is an IPv4 address in `block` (by default: any IPv4 address)."""
    try:
        return ipaddress.IPv4Address(text) in block
    except ValueError:
        return False


def _nameserver() -> str | None:
    """The machine's first IPv4 resolver (/etc/resolv.conf), which the node's DNS relay asks."""
    try:
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and _in_block(parts[1]):
                return parts[1]
    except OSError:
        pass
    return None


_HOSTS_LOCK = threading.Lock()
_HOSTS: dict[int, tuple[Path, list[str]]] = {}  # id(kubelet) -> its hosts file, its pods' lines


def _publish_hosts(kubelet: ProcessKubelet, lines: list[str] | None) -> None:
    """A kubelet's pods' hosts lines (None: it stopped). Pods resolve the pods of every node, as through a cluster's
    DNS: each hosts file of this process lists those of all its kubelets. Rewritten in place, never replaced: every
    pod has its node's file bind-mounted as /etc/hosts."""
    head = ["# managed by the pat process kubelet", "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost"]
    with _HOSTS_LOCK:
        if lines is None:
            _HOSTS.pop(id(kubelet), None)
        else:
            _HOSTS[id(kubelet)] = (kubelet.hosts_file, lines)
        data = ("\n".join(head + [line for _, own in _HOSTS.values() for line in own]) + "\n").encode()
        for path, _ in _HOSTS.values():
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()


# ---- pods ------------------------------------------------------------------------------------------------------

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
    image: Image | None = None  # what it runs from (None: the host)
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
    netns: str | None = None  # the path of its network namespace, once made
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
        self.resolv_file = self.root / "resolv.conf"
        self.network: NodeNetwork | None = None
        self._workers = workers
        self._lock = threading.RLock()
        self._pods: dict[str, dict] = {}  # uid -> latest pod object bound to this node
        self._runs: dict[str, PodRun] = {}  # uid -> admitted pod
        self._queue = WorkQueue()
        self._stopping = threading.Event()
        self._stopped = False
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
        self.images = ImageStore()

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
        api = urllib.parse.urlsplit(self.api.configuration.host)
        self.network = NodeNetwork(self._kubernetes_service(), (api.hostname, api.port or 443)).start()
        self.resolv_file.write_text(f"nameserver {self.network.node_ip}\n")  # the node's DNS relay
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
        """Kill every process this kubelet started and remove the node's network; the Node and the pods' API objects
        stay as they are."""
        if self._stopped:
            return
        self._stopped = True
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
        self.images.close()
        self._probes.shutdown(wait=False, cancel_futures=True)
        for response in list(self._watches):  # unblocks their threads, which then see _stopping
            _shutdown(response)
        for thread in self._threads:
            thread.join(timeout=5)
        _publish_hosts(self, None)
        if self.network:
            self.network.stop()
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

    def lose(self) -> None:
        """The node dies as a machine does: its processes are SIGKILLed, its network (pod IPs, relays) goes, and it
        stops acting on the API server: no heartbeats, no lease renewals, no pod status, no confirmed deletions (a
        pod of it deleted gracefully stays Terminating until it is force-deleted). What the node-lifecycle controller
        would do once it notices (40 s without a lease renewal) is done at once: the node's conditions turn Unknown,
        it gets the taint node.kubernetes.io/unreachable:NoSchedule, and its pods are marked not Ready. The Node and
        its pods' objects stay; stop() after lose() does nothing more."""
        self.stop()
        with kubernetes.config.new_client_from_config(self.kubeconfig) as api:  # the controller's, not the node's
            core = kubernetes.client.CoreV1Api(api)
            node = json.loads(core.read_node(self.node_name, _preload_content=False).data)
            now = _now()
            # Conditions first: with Ready still True, the controller would take the taint off again.
            conditions = [{"type": c["type"], "status": "Unknown", "reason": "NodeStatusUnknown",
                           "message": "Kubelet stopped posting node status.", "lastTransitionTime": now}
                          for c in node["status"].get("conditions", [])]
            core.patch_node_status(self.node_name, {"status": {"conditions": conditions}}, _content_type=SMP,
                                   _preload_content=False)
            taints = [t for t in node["spec"].get("taints") or [] if t["key"] != UNREACHABLE_TAINT]
            core.patch_node(self.node_name, {"spec": {"taints": [*taints, {"key": UNREACHABLE_TAINT,
                                                                           "effect": "NoSchedule"}]}},
                            _content_type=MERGE, _preload_content=False)
            pods = json.loads(core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node_name}",
                                                               _preload_content=False).data)["items"]
            for pod in pods:
                if pod["status"].get("phase") in ("Succeeded", "Failed"):
                    continue
                ready = {"type": "Ready", "status": "False", "lastTransitionTime": now}
                try:
                    core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                                     {"status": {"conditions": [ready]}}, _content_type=SMP,
                                                     _preload_content=False)
                except ApiException as e:
                    if e.status != 404:
                        raise

    # ---- node ------------------------------------------------------------------------------------------------

    def _kubernetes_service(self, timeout: float = 30.0) -> tuple[str, int]:
        """The `kubernetes` Service's cluster IP and port, which in-cluster clients are told to use (the API server
        makes the Service right after it starts)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                service = json.loads(self.core.read_namespaced_service("kubernetes", "default",
                                                                       _preload_content=False).data)
                return service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"]
            except ApiException as e:
                if e.status != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

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
            "addresses": [{"type": "InternalIP", "address": self.network.node_ip},
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
            run.ip = self.network.node_ip if spec.get("hostNetwork") else self.network.allocate()
            self._runs[run.uid] = run
            self._write_hosts()  # before any process starts, so pods of one gang resolve each other at once
        return run

    def _advance(self, run: PodRun) -> None:
        """Start what may start now: the volumes, the next init container, then all containers."""
        if run.failure or run.terminating:
            return
        if run.netns is None:  # the sandbox: a network namespace of its own, or the node's (hostNetwork)
            run.netns = (str(NETNS_DIR / self.network.netns) if run.pod["spec"].get("hostNetwork")
                         else self.network.add_pod(run.ip))
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
        except (ConfigError, ImageError) as e:
            c.reason = "ErrImageNeverPull" if isinstance(e, ImageError) else "CreateContainerConfigError"
            c.message = str(e)
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
            if run.released:
                return
            run.released = True
            self._write_hosts()
        if not run.pod["spec"].get("hostNetwork"):
            if self._stopping.is_set():
                return  # the network goes as a whole
            if run.netns:  # not under the lock: a few `ip` calls
                self.network.remove_pod(run.ip)
            else:
                self.network.free(run.ip)

    def _write_hosts(self) -> None:
        """This node's pods' names; each hosts file of this process lists those of all its nodes (_publish_hosts)."""
        lines = []
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
        _publish_hosts(self, lines)

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
            "phase": phase, "hostIP": self.network.node_ip, "podIP": run.ip, "podIPs": [{"ip": run.ip}],
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
        image = c.image = self.images.get(spec["image"]) if ImageStore.serves(spec.get("image", "")) else None
        uid, gid = security.get("runAsUser"), security.get("runAsGroup")
        if image:  # the image's USER where the pod names none; else the uid's group in the image's /etc/passwd
            user_gid = None
            if uid is None and image.user:
                uid, user_gid = image.identity()
            if gid is None:
                gid = user_gid if user_gid is not None else image.home(uid or 0)[1]
        if security.get("runAsNonRoot") and not uid:
            raise ConfigError("container has runAsNonRoot and image will run as root "
                              f"(pod: \"{run.name}_{run.namespace}({run.uid})\", container: {c.name})")
        c.env = self._container_env(run, spec)
        groups = [g for g in [pod_security.get("fsGroup"), *pod_security.get("supplementalGroups", [])] if g]
        c.identity = (uid or None, gid or 0, groups)
        mounts = [{"source": str(self.hosts_file), "target": "/etc/hosts", "readonly": True},
                  {"source": str(self.resolv_file), "target": "/etc/resolv.conf", "readonly": True}]
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
        command, args = spec.get("command"), spec.get("args")
        if image:  # Kubernetes' rule: a command replaces the Entrypoint and the Cmd; args alone replace the Cmd
            command, args = (command, args) if command else (image.entrypoint, image.cmd if args is None else args)
        common = {"argv": [expand(a, c.env) for a in (command or []) + (args or [])],
                  "workdir": spec.get("workingDir") or (image.workdir if image else None), "uid": c.identity[0],
                  "gid": c.identity[1], "groups": groups, "netns": run.netns, "hostname": self._hostname(run),
                  "mounts": mounts, "readonly_root": bool(security.get("readOnlyRootFilesystem"))}
        if image is None:
            return {**common, "traversable": self._hidden_dirs if uid else [], "host": self._host_dirs}
        layer = run.dir / "containers" / f"{c.name}-{c.restarts}"  # each start a new writable layer, as runtimes'
        for d in ("upper", "work", "root"):
            (layer / d).mkdir(parents=True, exist_ok=True)
        return {**common, "rootfs": {"image": str(image.rootfs), "upper": str(layer / "upper"),
                                     "work": str(layer / "work"), "root": str(layer / "root")}}

    def _hostname(self, run: PodRun) -> str:
        """spec.hostname or the pod's name; a hostNetwork pod has the node's, as it shares the node's UTS namespace."""
        spec = run.pod["spec"]
        return self.node_name if spec.get("hostNetwork") else spec.get("hostname") or run.name

    def _base_env(self, run: PodRun, c: Container) -> dict[str, str]:
        """What the image (or, run from the host, the host) contributes: the container's own variables override it."""
        uid = c.identity[0] or 0
        if c.image:
            image = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "HOME": c.image.home(uid)[0], **c.image.env}
        else:
            try:
                home = pwd.getpwuid(uid).pw_dir
            except KeyError:
                home = "/"
            image = {"PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}", "HOME": home,
                     "LANG": "C.UTF-8"}
        service_ip, service_port = self.network.service
        return {**image, "HOSTNAME": self._hostname(run),
                # What every pod gets from the `kubernetes` Service (enableServiceLinks or not): its cluster IP,
                # which the node relays to the API server (see Relays).
                "KUBERNETES_SERVICE_HOST": service_ip, "KUBERNETES_SERVICE_PORT": str(service_port)}

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
                  "status.podIP": run.ip, "status.podIPs": run.ip, "status.hostIP": self.network.node_ip,
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
