"""Weight sync: the trainer's rank 0 broadcasts new policy weights to every generator rank of the job.

The broadcast runs in a process group of its own, never the ranks' default group: trainer rank 0 hosts a
TCPStore, and every member builds the group stateless from it (PrefixStore + ProcessGroupGloo/NCCL), so a pod's
in-pod communicators are untouched and its ranks join only when the first weight update arrives (then the group
is cached). Weight-group rank 0 is the trainer; generator rank r of a pod is its rank_offset + r.

The trainer forms a new group when its members change (a generator pod restarted alone joins with the initial
weights; the old group has a dead member), possibly at the same address (a fixed port). Each group's store holds a
group id of its own: a receiver connects afresh at every round, and when the id differs from its group's, it leaves
that group for the new one.

One round (one `send`, one `receive` on every generator rank):
  1. each receiver publishes its dtype under the round's keys; the sender waits for all and agrees on one;
  2. the sender publishes the manifest: version, dtype, every tensor's name and shape in sorted(name) order;
  3. each receiver checks the manifest against its replica, and one all-reduce of the refusals decides: if any
     rank refuses, every rank stops before a byte moves (WeightSyncError, nothing changed);
  4. the tensors are broadcast from rank 0 in sorted(name) order, in buckets of consecutive tensors of at most
     the manifest's bucket_bytes (one broadcast per bucket; a tensor larger than that goes alone, straight into
     the receivers' tensor), and copied into the receivers' tensors in place (TP shards are views of them, so
     every layout sees the new weights). The sender streams: it takes each full tensor from an iterator (the
     trainer gathers them one at a time from its FSDP shards) and holds at most one bucket.
A failure inside step 4 (a peer died mid-transfer) leaves the receivers' weights half-updated: it is raised as
is, and the pod must restart. A receiver whose group or store fails in steps 1-3 (a member died before any tensor
moved, and the trainer gave the group up) raises WeightSyncError instead, its weights unchanged, and leaves the
group: the trainer sends the round again in a new one.

Placement colocated hands the weights over inside the pod instead, through the device (DeviceSender / DeviceReceiver):
each trainer rank passes the full tensors it gathers anyway to the engine rank on its own device, through one
staging buffer shared once per round (CUDA IPC on GPUs, shared memory on CPU: torch.multiprocessing's tensor
sharing), over an abstract Unix socket of the pod's network namespace. No weight-sync group, no network, and no
second replica: the staging buffer holds one bucket. The same manifest check and refusal vote come first.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import secrets
import time
from multiprocessing.connection import Client, Connection, Listener
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing

STORE_PREFIX = "pat-weights/"
GROUP_KEY = "group"  # the store's group id: a receiver whose group has another id joins the store's group anew
BACKENDS = ("gloo", "nccl")
BUCKET_BYTES = 256 << 20
# The in-pod hand-over's staging buffer, held only during a round: a small part of any model (the 45 MB demo model
# goes in 2 buckets), and a bucket costs one round trip over a Unix socket (tens of microseconds).
HANDOVER_BUCKET_BYTES = 32 << 20


class WeightSyncError(RuntimeError):
    """A round refused before any tensor moved: the receivers' weights are unchanged."""


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight-sync address {address!r}: use host:port")
    return host, int(port)


def _group(store: dist.Store, rank: int, world: int, backend: str, timeout: datetime.timedelta):
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend {backend!r}: use one of {BACKENDS}")
    store = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("weight-sync backend 'nccl': this torch build has no NCCL; use gloo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def buckets(tensors: list[list], itemsize: int, limit: int) -> list[list[int]]:
    """Indices of the manifest's [name, shape] entries grouped into consecutive buckets of at most `limit` bytes
    (a larger tensor is a bucket of its own). Both ends compute the same grouping from the manifest."""
    out: list[list[int]] = []
    size = limit
    for i, (_, shape) in enumerate(tensors):
        n = math.prod(shape) * itemsize
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _Member:
    """What both ends share: the store, the group, the round counter and the round's collectives."""

    def __init__(self, store: dist.Store | None, rank: int, world: int, backend: str, timeout: float):
        self.store, self.rank, self.world, self.backend = store, rank, world, backend
        self.timeout = datetime.timedelta(seconds=timeout)
        self.group = None  # built at the first round: it waits for every member
        self.round = 0

    def _join(self, store: dist.Store) -> None:
        """Builds this member's group from `store` (it waits for every member); the round count starts again."""
        self.group = _group(store, self.rank, self.world, self.backend, self.timeout)
        self.round = 0

    def _refusals(self, refused: bool) -> int:
        flag = torch.tensor([int(refused)], dtype=torch.int64, device=_device(self.backend))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.group.allreduce([flag], opts).wait()
        return int(flag.item())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Shuts the group down and lets the store go (either end; a member that joins another group closes its old
        one; the sender's store, once freed, stops listening)."""
        if self.group is not None:
            self.group.shutdown()
        self.group = self.store = None


class WeightSender(_Member):
    """Weight-group rank 0 (the trainer's rank 0): hosts the store at `address` (port 0: any free port; see
    .address) and sends every round. The group is built at the first send, once every receiver has joined."""

    def __init__(self, address: str, world: int, backend: str = "gloo", timeout: float = 300.0):
        if world < 2:
            raise ValueError(f"weight-sync world={world}: the trainer plus at least one generator rank")
        host, port = parse_address(address)
        store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
        store.set(GROUP_KEY, secrets.token_hex(8))
        super().__init__(store, 0, world, backend, timeout)
        self.address = f"{host}:{store.port}"

    def _begin(self) -> str:
        if self.group is None:
            self._join(self.store)
        self.round += 1
        return f"round{self.round}/"

    def send(self, shapes: Mapping[str, Sequence[int]], tensors: Iterable[tuple[str, torch.Tensor]],
             version: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        """Broadcasts the full replica: `shapes` names every tensor, `tensors` yields (name, full tensor) in
        sorted-name order, each cast to the receivers' dtype as it is sent."""
        prefix = self._begin()
        receivers = range(1, self.world)
        self.store.wait([f"{prefix}dtype/{r}" for r in receivers], self.timeout)
        dtypes = {self.store.get(f"{prefix}dtype/{r}").decode() for r in receivers}
        manifest = _manifest(shapes, version, sorted(dtypes)[0], bucket_bytes)
        self.store.set(f"{prefix}manifest", json.dumps(manifest))
        refusals = self._refusals(len(dtypes) > 1)
        if refusals:
            reasons = [self.store.get(f"{prefix}refused/{r}").decode() for r in receivers
                       if self.store.check([f"{prefix}refused/{r}"])]
            if len(dtypes) > 1:
                reasons.append(f"the generator ranks hold different dtypes {sorted(dtypes)}; use one dtype per job")
            raise WeightSyncError(f"weight version {version} refused: " + "; ".join(reasons))
        dtype, device = getattr(torch, manifest["dtype"]), _device(self.backend)
        stream = iter(tensors)
        with torch.no_grad():
            for bucket in buckets(manifest["tensors"], dtype.itemsize, bucket_bytes):
                sizes = [math.prod(manifest["tensors"][i][1]) for i in bucket]
                # Each tensor is cast straight into its place in the bucket: one bucket's memory, one copy.
                flat = torch.empty(sum(sizes), dtype=dtype, device=device) if len(bucket) > 1 else None
                for i, part in zip(bucket, flat.split(sizes) if flat is not None else [None]):
                    tensor = _next_announced(stream, manifest["tensors"][i][0])
                    if part is None:
                        flat = tensor.detach().to(device=device, dtype=dtype).contiguous()
                    else:
                        part.copy_(tensor.detach().reshape(-1))
                self._broadcast(flat)


class WeightReceiver(_Member):
    """A generator rank's end: weight-group rank `rank` (the pod's rank_offset + its rank in the pod)."""

    def __init__(self, address: str, world: int, rank: int, backend: str = "gloo", timeout: float = 300.0):
        if not 1 <= rank < world:
            raise ValueError(f"weight-sync rank {rank} is outside 1..{world - 1} (rank 0 is the trainer)")
        parse_address(address)
        super().__init__(None, rank, world, backend, timeout)
        self.address = address
        self.group_id: str | None = None

    def _begin(self) -> str:
        """Connects to the store (a new connection every round: the store may be a new group's at the same
        address) and joins its group unless this member is in it already."""
        store = dist.TCPStore(*parse_address(self.address), None, False, self.timeout)
        # A trainer that sets no group id (an older release) keeps one group per address.
        group_id = store.get(GROUP_KEY).decode() if store.check([GROUP_KEY]) else ""
        if self.group is None or group_id != self.group_id:
            self.close()
            self._join(store)
            self.group_id = group_id
        self.store = store
        self.round += 1
        return f"round{self.round}/"

    def receive(self, weights: dict[str, torch.Tensor], version: int,
                shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Overwrites every tensor of `weights` in place with the sender's; `version` is what this pod was told to
        expect. `shapes`: the tensors' shapes as sent, where they are held as views of another shape (the engine's
        fused weights, Transformer.hf_shapes). Raises WeightSyncError, weights unchanged, when any member refuses
        the round."""
        manifest = self._open(_held(weights, shapes), _dtype_of(weights), version)
        entries = manifest["tensors"]
        with torch.no_grad():
            for bucket in buckets(entries, weights[entries[0][0]].element_size(), manifest["bucket_bytes"]):
                names = [entries[i][0] for i in bucket]
                if len(names) == 1 and weights[names[0]].is_contiguous():  # else through a buffer, as a bucket
                    self._broadcast(weights[names[0]])
                    continue
                flat = torch.empty(sum(weights[n].numel() for n in names), dtype=weights[names[0]].dtype,
                                   device=weights[names[0]].device)
                self._broadcast(flat)
                for name, part in zip(names, flat.split([weights[n].numel() for n in names])):
                    weights[name].copy_(part.view_as(weights[name]))

    def stream(self, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, version: int,
               device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """For a receiver that loads the tensors into a model of its own layout (vLLM's load_weights) rather than
        into tensors of the sent shapes: votes on the round now (`shapes`: every tensor it expects; WeightSyncError
        when any member refuses, before anything is loaded), then returns the tensors as they arrive, (name,
        tensor) in sorted-name order, each a view of its bucket (one bucket held at a time)."""
        manifest = self._open({name: tuple(shape) for name, shape in shapes.items()},
                              str(dtype).removeprefix("torch."), version)
        return self._arrivals(manifest, dtype, device)

    def _arrivals(self, manifest: dict, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        entries = manifest["tensors"]
        for bucket in buckets(entries, dtype.itemsize, manifest["bucket_bytes"]):
            sizes = [math.prod(entries[i][1]) for i in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            self._broadcast(flat)
            for i, part in zip(bucket, flat.split(sizes)):
                yield entries[i][0], part.view(entries[i][1])

    def _open(self, held: Mapping[str, tuple[int, ...]], dtype: str, version: int) -> dict:
        """Steps 1-3 of a round: publishes this member's dtype, checks the manifest against what it holds, and
        votes. Returns the manifest, or raises WeightSyncError when any member refused, or when the group or its
        store failed meanwhile."""
        try:
            prefix = self._begin()
            self.store.set(f"{prefix}dtype/{self.rank}", dtype)
            manifest = json.loads(self.store.get(f"{prefix}manifest"))
            problem = check_manifest(manifest, held, dtype, version)
            if problem:
                self.store.set(f"{prefix}refused/{self.rank}", f"rank {self.rank}: {problem}")
            refusals = self._refusals(problem is not None)
        except RuntimeError as e:  # torch's store and group errors: no tensor has moved
            self.close()
            raise WeightSyncError(f"weight version {version}: the weight-sync group at {self.address} failed before "
                                  f"any weight moved: {e}") from e
        if refusals:
            raise WeightSyncError(problem or f"weight version {manifest['version']} refused by another rank")
        return manifest


def _manifest(shapes: Mapping[str, Sequence[int]], version: int, dtype: str, bucket_bytes: int) -> dict:
    """What a sender announces for a round: every tensor's name and shape, in sorted-name order."""
    return {"version": version, "dtype": dtype, "bucket_bytes": bucket_bytes,
            "tensors": [[name, list(shapes[name])] for name in sorted(shapes)]}


def _next_announced(stream: Iterator[tuple[str, torch.Tensor]], announced: str) -> torch.Tensor:
    name, tensor = next(stream)
    if name != announced:
        raise ValueError(f"weight {name} sent where {announced} was announced: tensors must come in sorted-name order")
    return tensor


def check_manifest(manifest: dict, held: Mapping[str, tuple[int, ...]], dtype: str, version: int) -> str | None:
    """Why a receiver that holds tensors of shapes `held` in `dtype` ("mixed" for several) refuses the round's
    manifest (another version, model or dtype), or None."""
    if manifest["version"] != version:
        return (f"the trainer sent version {manifest['version']}, this pod expects version {version} "
                f"(POST /v1/weights announces the version the next send carries)")
    sent = {name: tuple(shape) for name, shape in manifest["tensors"]}
    if sent.keys() != held.keys():
        return (f"the trainer's tensors differ from this replica's: missing {sorted(held.keys() - sent.keys())}, "
                f"unexpected {sorted(sent.keys() - held.keys())}; both must be the same model")
    wrong = [f"{n} {sent[n]} vs {held[n]}" for n in sorted(sent) if sent[n] != held[n]]
    if wrong:
        return f"tensor shapes differ (sent vs held): {', '.join(wrong[:5])}"
    if dtype != manifest["dtype"]:
        return f"the trainer sends {manifest['dtype']}, this replica holds {dtype}"
    return None


def _held(weights: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]] | None) -> dict:
    """Each held tensor's shape as sent: `shapes` where given (views of another shape), else its own."""
    return {name: tuple((shapes or {}).get(name, t.shape)) for name, t in weights.items()}


def _dtype_of(weights: Mapping[str, torch.Tensor]) -> str:
    dtypes = {str(t.dtype).removeprefix("torch.") for t in weights.values()}
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def handover_address(token: str) -> str:
    """The name of a job's in-pod hand-over sockets (one per device: `-<local rank>` is added), from its token:
    distinct per job where several share a network namespace (`pat run --baseline`)."""
    return "pat-weights-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def _socket(address: str, rank: int) -> str:
    return f"\0{address}-{rank}"  # Linux's abstract namespace: no file to clean up, private to the network namespace


class DeviceSender:
    """A trainer rank's end of the in-pod hand-over (placement colocated): it listens for the engine rank of its
    device (`local_rank`), which connects with the job's token when its pod is told to receive."""

    def __init__(self, address: str, local_rank: int, token: str):
        # A CPU tensor is then shared by the name of its shared-memory file, which an unrelated process (the engine
        # rank) can open; the default passes a file descriptor, which only a child process could receive.
        torch.multiprocessing.set_sharing_strategy("file_system")
        self.address = address
        self.listener = Listener(_socket(address, local_rank), "AF_UNIX", authkey=token.encode())
        self.conn: Connection | None = None

    def send(self, shapes: Mapping[str, Sequence[int]], tensors: Iterable[tuple[str, torch.Tensor]], version: int,
             agree: Callable[[bool], int], bucket_bytes: int = HANDOVER_BUCKET_BYTES) -> None:
        """Hands the full replica to the engine rank, bucket by bucket through a staging buffer of one bucket, shared
        for the round and freed after it. `agree(refused)` counts the refusals of every trainer rank's receiver (an
        all-reduce over the trainer's group): when any refuses, every rank stops before a byte moves
        (WeightSyncError)."""
        if self.conn is None:
            self.conn = self.listener.accept()
        dtype_name = self.conn.recv()
        manifest = _manifest(shapes, version, dtype_name, bucket_bytes)
        self.conn.send(manifest)
        problem = self.conn.recv()
        refusals = agree(problem is not None)
        self.conn.send(not refusals)
        if refusals:
            raise WeightSyncError(f"weight version {version} refused: {problem or 'by another rank'}")
        dtype = getattr(torch, dtype_name)
        groups = buckets(manifest["tensors"], dtype.itemsize, bucket_bytes)
        size = max(sum(math.prod(manifest["tensors"][i][1]) for i in b) for b in groups)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        staging = torch.empty(size, dtype=dtype, device=device)
        if device is None:
            staging.share_memory_()
        self.conn.send(staging)  # a CUDA IPC handle, or the shared-memory file's name
        stream = iter(tensors)
        with torch.no_grad():
            for bucket in groups:
                offset = 0
                for i in bucket:
                    tensor = _next_announced(stream, manifest["tensors"][i][0])
                    n = tensor.numel()
                    staging[offset:offset + n].copy_(tensor.detach().reshape(-1))
                    offset += n
                if device is not None:
                    torch.cuda.current_stream().synchronize()  # written before the receiver reads
                self.conn.send(len(bucket))
                self.conn.recv()  # copied out: the buffer may be written again (the last ack: and freed)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


class DeviceReceiver:
    """An engine rank's end of the in-pod hand-over: connects to the trainer rank of its device (engine rank r of a
    pod to the trainer's local rank r), retrying until it listens."""

    def __init__(self, address: str, rank: int, token: str, timeout: float = 300.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn = Client(_socket(address, rank), "AF_UNIX", authkey=token.encode())
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no trainer rank listens at {address}-{rank} after {timeout:.0f} s: in "
                                       f"placement colocated trainer local rank r shares engine rank r's device")
                time.sleep(0.05)

    def receive(self, weights: dict[str, torch.Tensor], version: int,
                shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """As WeightReceiver.receive: every tensor of `weights` overwritten in place, or WeightSyncError with the
        weights unchanged when a receiver refused."""
        dtype = _dtype_of(weights)
        self.conn.send(dtype)
        manifest = self.conn.recv()
        problem = check_manifest(manifest, _held(weights, shapes), dtype, version)
        self.conn.send(problem)
        if not self.conn.recv():
            raise WeightSyncError(problem or f"weight version {manifest['version']} refused by another rank")
        staging = self.conn.recv()
        entries = manifest["tensors"]
        device = next(iter(weights.values())).device
        with torch.no_grad():
            for bucket in buckets(entries, staging.element_size(), manifest["bucket_bytes"]):
                self.conn.recv()
                offset = 0
                for i in bucket:
                    held = weights[entries[i][0]]
                    held.copy_(staging[offset:offset + held.numel()].view_as(held))
                    offset += held.numel()
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                self.conn.send(True)
        del staging  # the round's buffer: the sender frees it too (torch counts both processes' references)
