"""Communicators for the tensor-parallel ranks of one pod.

Each rank is one process driving one device, and all ranks of a pod share a host. On CUDA the TP
collectives go through NCCL process groups. On CPU, gloo costs 1-2 ms per collective (loopback TCP
plus its worker threads), which dwarfs the tens of microseconds of a decode step's matmuls, while an
all-reduce through a shared-memory segment costs ~10 us. So CPU ranks use ShmCommunicator on the hot
path (on x86-64, whose memory ordering it relies on) and keep the gloo group as a fallback.

Failures: on CPU a collective that meets a dead or late peer raises CommError, and the ranks fall back to
TP=1 inside the pod. On NCCL a failed communicator cannot be trusted (a peer may be stuck in the kernel),
so the rank fails instead: the pod exits non-zero and the operator restarts the gang.

CommunicatorPool builds every TP group of the power-of-two hierarchy once, at start-up:
torch.distributed.new_group is collective over the whole world, so groups cannot be created later
when only some ranks change their parallelism.

Ranks are identified by global rank; `index` is a rank's position within its group.
"""

from __future__ import annotations

import datetime
import math
import mmap
import os
import pickle
import platform
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from pat_operator.layout import tp_degrees

__all__ = [
    "CommError",
    "Communicator",
    "CommunicatorPool",
    "ShmCommunicator",
    "SoloCommunicator",
    "TorchCommunicator",
    "measure_link_bandwidth",
    "nccl_env",
    "process_group_options",
    "shm_supported",
]


BACKENDS = ("shm", "gloo", "nccl")


class CommError(RuntimeError):
    """A collective failed: a peer died or did not arrive in time."""

    def __init__(self, message: str, dead_ranks: frozenset[int] = frozenset()):
        super().__init__(message)
        self.dead_ranks: frozenset[int] = frozenset(dead_ranks)

    def __reduce__(self):
        # Keep dead_ranks when the error is pickled across processes.
        return type(self), (str(self), self.dead_ranks)


class Communicator(Protocol):
    """Collectives over one group of ranks; every member calls the same ops in the same order."""

    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int: ...

    @property
    def index(self) -> int: ...

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def all_gather_object(self, obj: Any) -> list: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_to_all(self, sends: list[torch.Tensor | None]) -> list[torch.Tensor | None]: ...

    def barrier(self) -> None: ...


# Wire codes for dtypes in all_to_all metadata.
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODE[dtype]
    except KeyError:
        raise TypeError(f"all_to_all does not support dtype {dtype}") from None


def _pid_alive(pid: int) -> bool:
    """Whether a process of this host (same PID namespace) is alive; zombies count as dead."""
    if pid <= 0:  # not known yet
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The command name in parentheses may contain spaces; the state follows the last ')'.
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def _dead_among(pids: Mapping[int, int], ranks: Sequence[int]) -> frozenset[int]:
    return frozenset(r for r in ranks if r in pids and not _pid_alive(pids[r]))


class _Members:
    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = tuple(int(r) for r in ranks)
        if list(self.ranks) != sorted(set(self.ranks)) or not self.ranks:
            raise ValueError(f"group ranks must be distinct and ascending, got {ranks}")
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not a member of group {self.ranks}")
        self.rank = rank
        self._index = self.ranks.index(rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        return self._index

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self.ranks}, rank={self.rank})"


class SoloCommunicator(_Members):
    """A group of one: every op is the identity."""

    def __init__(self, rank: int):
        super().__init__((rank,), rank)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_to_all(self, sends: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if len(sends) != 1:
            raise ValueError(f"all_to_all needs one entry per member (1), got {len(sends)}")
        return [sends[0]]

    def barrier(self) -> None:
        return None


_CACHE_LINE = 64
_SPINS = 300  # polls before yielding the core: most collectives complete within them
_YIELD_FOR = 0.005  # seconds of sched_yield polling before napping, so long waits free the core
# Naps then double from _NAP to _NAP_MAX: an idle TP=2 group's follower (waiting for its leader's next command, which
# comes every 50 ms) took 13% of a core instead of 28% with fixed 50 us naps; a wait past 5 ms ends <= 2 ms late.
_NAP, _NAP_MAX = 50e-6, 2e-3
_LIVENESS_PERIOD = 0.05


def shm_supported(machine: str) -> bool:
    """Whether ShmCommunicator's protocol holds on a CPU named `machine` (platform.machine()): it needs x86-64's
    total store order, see the class docstring. Elsewhere (e.g. aarch64) stores and loads need fences it lacks."""
    return machine.lower() in ("x86_64", "amd64")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _shm_candidates() -> list[str]:
    # /dev/shm is RAM-backed; a MAP_SHARED file elsewhere is just as coherent, only backed by the page cache.
    return ["/dev/shm", tempfile.gettempdir()]


def _create_dir(nbytes: int) -> str:
    # tmpfs accepts a sparse file larger than its free space and SIGBUSes on the first write past it.
    for d in _shm_candidates():
        try:
            st = os.statvfs(d)
        except OSError:
            continue
        if os.access(d, os.W_OK) and st.f_bavail * st.f_frsize >= nbytes:
            return d
    raise OSError(f"no directory among {_shm_candidates()} has {nbytes} bytes free for a shared-memory segment")


def _copy_window(parts: Sequence[torch.Tensor], start: int, dst: torch.Tensor) -> None:
    """dst[:] = bytes [start, start + len(dst)) of the concatenation of parts (uint8), clipped at its end."""
    end = start + dst.numel()
    pos = 0
    for p in parts:
        lo, hi = max(start, pos), min(end, pos + p.numel())
        if lo < hi:
            dst[lo - start:hi - start].copy_(p[lo - pos:hi - pos])
        pos += p.numel()
        if pos >= end:
            break


class ShmCommunicator(_Members):
    """Collectives between processes of one host through one shared-memory segment per group.

    Layout: a control area (per member an int64 sequence flag on its own cache line, then the members'
    pids) followed by two data buffers of `capacity` bytes per member. Every op is a series of steps,
    and step s (counted from 1 by a per-communicator sequence number that advances identically on all
    members) uses buffer s % 2: a member writes its own buffer, sets its flag to s, waits until every
    flag is >= s, then reads the others' buffers. One flag per step is enough: a member can write
    buffer s % 2 again only in step s + 2, which needs every flag >= s + 1, and a member sets flag s + 1
    only after it finished reading step s. Plain loads and stores, no fences: this relies on x86-64's
    total store order, which keeps stores in program order (data, then flag), loads in program order
    (flag, then data), and loads before later stores (reading step s, then flag s + 1). Weaker CPUs
    reorder all three, so the constructor refuses them (shm_supported). Payloads larger than `capacity`
    take several steps.

    The lowest rank of the group creates the segment; the others may construct only after it did
    (CommunicatorPool.build orders this with world barriers). The creator unlinks the file once all
    members mapped it (`unlink`, or at `close`).
    """

    def __init__(self, ranks: Sequence[int], rank: int, *, prefix: str, capacity: int = 8 << 20,
                 timeout: float = 60.0):
        super().__init__(ranks, rank)
        if not shm_supported(platform.machine()):
            raise ValueError(f"the shared-memory communicator relies on x86-64 memory ordering, and this CPU is "
                             f"{platform.machine()}: use comm_backend gloo (--comm-backend gloo)")
        if capacity < 4096:
            raise ValueError(f"capacity must be at least 4096 bytes, got {capacity}")
        self.capacity = _round_up(capacity, _CACHE_LINE)
        self.timeout = float(timeout)
        self.device = torch.device("cpu")
        self.name = f"{prefix}.{'_'.join(map(str, self.ranks))}"
        n = self.size
        ctrl = _round_up(n * _CACHE_LINE + n * 8, mmap.PAGESIZE)
        nbytes = ctrl + 2 * n * self.capacity
        self._creator = self.index == 0
        if self._creator:
            self.path = os.path.join(_create_dir(nbytes), self.name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            except OSError:
                os.close(fd)
                os.unlink(self.path)
                raise
        else:
            paths = [os.path.join(d, self.name) for d in _shm_candidates()]
            self.path = next((p for p in paths if os.path.exists(p)), None)
            if self.path is None:
                raise FileNotFoundError(f"shared-memory segment {self.name} not found in {_shm_candidates()}; "
                                        f"rank {self.ranks[0]} must create it first")
            fd = os.open(self.path, os.O_RDWR)
            size = os.fstat(fd).st_size
            if size != nbytes:
                os.close(fd)
                raise ValueError(f"{self.path} has {size} bytes, expected {nbytes}: members disagree on capacity")
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._unlinked = not self._creator
        # A memoryview reads one int64 in ~0.1 us, a numpy view in ~1 us; flags are polled in a tight loop.
        self._ctl: memoryview | None = memoryview(self._mm)[:ctrl].cast("q")
        words = _CACHE_LINE // 8
        self._flag_at = tuple(j * words for j in range(n))
        self._pid_at = tuple(n * words + j for j in range(n))
        self._ctl[self._pid_at[self.index]] = os.getpid()
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=ctrl, count=2 * n * self.capacity)
        cap = self.capacity
        self._bufs = [[data[(2 * j + p) * cap:(2 * j + p + 1) * cap] for p in (0, 1)] for j in range(n)]
        self._views: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        self._seq = 0
        self._failure: CommError | None = None

    # -- stepping -------------------------------------------------------------------------------

    def _step(self) -> int:
        """Start the next step; returns its buffer parity."""
        if self._mm is None:
            raise ValueError(f"{self!r} is closed")
        if self._failure is not None:
            raise CommError(f"{self!r} is unusable after an earlier failure: {self._failure}",
                            self._failure.dead_ranks)
        self._seq += 1
        return self._seq & 1

    def _publish(self) -> None:
        """Mark this member's buffer of the current step as written, and wait for every member's."""
        seq, ctl = self._seq, self._ctl
        ctl[self._flag_at[self._index]] = seq
        # Flags only grow, so waiting for each member in turn waits for all.
        for j, at in enumerate(self._flag_at):
            if ctl[at] < seq:
                self._wait(j, seq)

    def _wait(self, j: int, seq: int) -> None:
        ctl, at = self._ctl, self._flag_at[j]
        for _ in range(_SPINS):
            if ctl[at] >= seq:
                return
        start = checked = time.monotonic()
        nap = _NAP
        while ctl[at] < seq:
            now = time.monotonic()
            if now - checked >= _LIVENESS_PERIOD:
                checked = now
                self._check_peers(seq, now - start)
            if now - start < _YIELD_FOR:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, _NAP_MAX)

    def _check_peers(self, seq: int, waited: float) -> None:
        ctl = self._ctl
        late = [j for j in range(self.size) if ctl[self._flag_at[j]] < seq]
        dead = frozenset(self.ranks[j] for j in late if not _pid_alive(ctl[self._pid_at[j]]))
        if dead:
            self._failure = CommError(f"ranks {sorted(dead)} of group {self.ranks} died", dead)
        elif waited >= self.timeout:
            self._failure = CommError(f"rank {self.rank} timed out after {waited:.1f} s waiting for ranks "
                                      f"{[self.ranks[j] for j in late]} of group {self.ranks}")
        if self._failure is not None:
            raise self._failure

    def _typed_views(self, dtype: torch.dtype, k: int) -> list[list[torch.Tensor]]:
        """Per member, per parity, the first k elements of its buffer as dtype. Cached: decode steps
        repeat the same few shapes, and slicing costs about as much as copying 16 KiB."""
        views = self._views.get((dtype, k))
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            nbytes = k * dtype.itemsize
            views = self._views[dtype, k] = [[b[:nbytes].view(dtype) for b in pair] for pair in self._bufs]
        return views

    # -- tensor collectives ---------------------------------------------------------------------

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        _require_cpu(t)
        out = t if t.is_contiguous() else t.contiguous()
        flat = out.view(-1)
        me = self._index
        step = self.capacity // t.element_size()
        for lo in range(0, flat.numel(), step):
            chunk = flat if flat.numel() <= step else flat[lo:lo + step]
            views = self._typed_views(t.dtype, chunk.numel())
            par = self._step()
            views[me][par].copy_(chunk)
            self._publish()
            # Every member sums the same buffers in member order: bitwise identical results.
            if len(views) == 1:
                chunk.copy_(views[0][par])
                continue
            torch.add(views[0][par], views[1][par], out=chunk)
            for v in views[2:]:
                chunk.add_(v[par])
        if out is not t:
            t.copy_(out)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        _require_cpu(t)
        src = t.contiguous().view(-1)
        outs = [torch.empty(t.shape, dtype=t.dtype) for _ in self.ranks]
        flats = [o.view(-1) for o in outs]
        step = self.capacity // t.element_size()
        for lo in range(0, src.numel(), step):
            k = min(step, src.numel() - lo)
            views = self._typed_views(t.dtype, k)
            par = self._step()
            views[self._index][par].copy_(src[lo:lo + k])
            self._publish()
            for f, v in zip(flats, views):
                f[lo:lo + k].copy_(v[par])
        return outs

    # -- byte-stream exchange (objects, all_to_all) ---------------------------------------------

    def _exchange(self, header: Sequence[int], parts: Sequence[torch.Tensor],
                  plan: Callable[[list[list[int]]], list[tuple[int, torch.Tensor] | None]]) -> None:
        """Every member publishes a byte stream, the concatenation of `parts` (1-D uint8), behind a
        fixed-length int64 header. plan(rows) sees every member's row [stream length, *header] and returns
        per member None or (offset, out): out (uint8) receives bytes [offset, offset + len(out)) of that
        member's stream. The first step carries the headers and the start of the streams."""
        cap = self.capacity
        head = 8 * (len(header) + 1)
        if head > cap // 2:
            raise ValueError(f"header of {len(header)} words does not fit a {cap}-byte buffer")
        total = sum(p.numel() for p in parts)
        par = self._step()
        own = self._bufs[self._index]
        own[par][:head].view(torch.int64).copy_(torch.tensor([total, *header], dtype=torch.int64))
        _copy_window(parts, 0, own[par][head:])
        self._publish()
        rows = torch.stack([b[par][:head].view(torch.int64) for b in self._bufs]).tolist()
        targets = plan(rows)
        first = cap - head
        steps = 1 + math.ceil(max(0, max(r[0] for r in rows) - first) / cap)
        for k in range(steps):
            if k == 0:
                start, lo = 0, head
            else:
                start, lo = first + (k - 1) * cap, 0
                par = self._step()
                _copy_window(parts, start, own[par])
                self._publish()
            end = start + cap - lo
            for b, target in zip(self._bufs, targets):
                if target is None:
                    continue
                offset, out = target
                a, z = max(start, offset), min(end, offset + out.numel())
                if a < z:
                    out[a - offset:z - offset].copy_(b[par][lo + a - start:lo + z - start])

    def all_gather_object(self, obj: Any) -> list:
        payload = _pickle(obj)
        outs: list[torch.Tensor] = []

        def plan(rows):
            outs.extend(torch.empty(r[0], dtype=torch.uint8) for r in rows)
            return [(0, o) for o in outs]

        self._exchange([], [payload], plan)
        return [pickle.loads(o.numpy()) for o in outs]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not 0 <= src < self.size:
            raise ValueError(f"src must be a member index in [0, {self.size}), got {src}")
        if self._index == src:
            self._exchange([], [_pickle(obj)], lambda rows: [None] * self.size)
            return obj
        box: list[torch.Tensor] = []

        def plan(rows):
            box.append(torch.empty(rows[src][0], dtype=torch.uint8))
            return [(0, box[0]) if j == src else None for j in range(self.size)]

        self._exchange([], [], plan)
        return pickle.loads(box[0].numpy())

    def all_to_all(self, sends: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if len(sends) != self.size:
            raise ValueError(f"all_to_all needs one entry per member ({self.size}), got {len(sends)}")
        header: list[int] = []
        parts: list[torch.Tensor] = []
        for i, t in enumerate(sends):
            if t is None or i == self._index:  # our own entry is returned as-is, not sent
                header += [-1, 0]
                continue
            _require_cpu(t)
            header += [t.numel(), _dtype_code(t.dtype)]
            parts.append(t.contiguous().view(-1).view(torch.uint8))
        received: list[torch.Tensor | None] = [None] * self.size
        received[self._index] = sends[self._index]
        me = self._index

        def plan(rows):
            targets: list[tuple[int, torch.Tensor] | None] = []
            for j, row in enumerate(rows):
                meta = row[1:]
                numel, code = meta[2 * me], meta[2 * me + 1]
                if j == me or numel < 0:
                    targets.append(None)
                    continue
                # Our part starts after what j sends to lower members.
                offset = sum(meta[2 * i] * _DTYPES[meta[2 * i + 1]].itemsize for i in range(me) if meta[2 * i] > 0)
                received[j] = torch.empty(numel, dtype=_DTYPES[code])
                targets.append((offset, received[j].view(torch.uint8)))
            return targets

        self._exchange(header, parts, plan)
        return received

    def barrier(self) -> None:
        self._step()
        self._publish()

    # -- lifetime -------------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the segment's file (creator only; a no-op elsewhere). Mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self._mm is None:
            return
        self.unlink()
        # mmap.close refuses while views export its buffer.
        self._ctl.release()
        self._ctl = None
        self._bufs = []
        self._views.clear()
        self._mm.close()
        self._mm = None


def _require_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"ShmCommunicator handles CPU tensors only, got one on {t.device}")


def _pickle(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


class TorchCommunicator(_Members):
    """A torch.distributed process group: gloo on CPU, NCCL on CUDA (set the current device first).

    `pids` (global rank -> pid, same host) lets a failure name the ranks that died.

    `device` other than the group's own (gloo with a GPU: ranks sharing one GPU in tests, EngineOptions.device
    "cuda-shared") stages every tensor through host memory: gloo's send/recv hand raw pointers to its TCP transport,
    which would read GPU memory from the host, and its CUDA support of the other collectives differs between torch
    versions. Such a group cannot be captured in a CUDA graph (the exchange runs on the host); it fails like gloo
    on CPU (CommError: the in-pod fallback), since no NCCL kernel can be stuck."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int], rank: int, *,
                 pids: Mapping[int, int] | None = None, device: torch.device | None = None):
        super().__init__(ranks, rank)
        self.group = group
        self.backend = str(dist.get_backend(group))
        cuda = "nccl" in self.backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = device
        self._stage = device.type != "cpu" and not cuda
        self._pids = dict(pids or {})
        self._zero = torch.zeros(1, device="cpu" if self._stage else self.device)

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """What the process group sends: t (contiguous), or its host copy where this group stages."""
        if self._stage and t.device.type != "cpu":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"group {self.ranks} is gloo with {self.device} tensors: its collectives run on "
                                   f"the host and cannot be captured in a CUDA graph; run this step eagerly")
            return t.cpu().contiguous()
        return t.contiguous()

    def _home(self, t: torch.Tensor) -> torch.Tensor:
        """A received tensor on this communicator's device."""
        return t.to(self.device) if self._stage else t

    def _call(self, what: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CommError:
            raise
        except RuntimeError as e:  # DistBackendError, DistNetworkError and gloo's socket errors alike
            if self.device.type == "cuda" and not self._stage:  # not CommError: no fallback on a communicator in doubt
                raise RuntimeError(f"{what} on NCCL group {self.ranks} failed: {e}; this rank stops, so that the "
                                   f"pod exits and its gang restarts") from e
            raise CommError(f"{what} on group {self.ranks} failed: {e}", self._dead_peers()) from e

    def _dead_peers(self) -> frozenset[int]:
        peers = [r for r in self.ranks if r != self.rank]
        # A dead peer's sockets close slightly before it becomes a zombie: give it a moment.
        deadline = time.monotonic() + 0.2
        while True:
            dead = _dead_among(self._pids, peers)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.01)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._wire(t)
        self._call("all_reduce", dist.all_reduce, buf, group=self.group)
        if buf is not t:
            t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        src = self._wire(t)
        outs = [torch.empty_like(src) for _ in self.ranks]
        self._call("all_gather", dist.all_gather, outs, src, group=self.group)
        return [self._home(o) for o in outs]

    def all_gather_object(self, obj: Any) -> list:
        outs: list = [None] * self.size
        self._call("all_gather_object", dist.all_gather_object, outs, obj, group=self.group)
        return outs

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not 0 <= src < self.size:
            raise ValueError(f"src must be a member index in [0, {self.size}), got {src}")
        box = [obj if self._index == src else None]
        self._call("broadcast_object", dist.broadcast_object_list, box, group=self.group, group_src=src)
        return box[0]

    def all_to_all(self, sends: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        n, me = self.size, self._index
        if len(sends) != n:
            raise ValueError(f"all_to_all needs one entry per member ({n}), got {len(sends)}")
        flat: list[torch.Tensor | None] = [None] * n
        meta = torch.full((n, 2), -1, dtype=torch.int64)
        for i, t in enumerate(sends):
            if t is not None and i != me:
                flat[i] = self._wire(t).view(-1)
                meta[i, 0], meta[i, 1] = t.numel(), _dtype_code(t.dtype)
        wire = torch.device("cpu") if self._stage else self.device
        meta = meta.to(wire)
        got = torch.empty_like(meta)
        self._call("all_to_all (sizes)", dist.all_to_all_single, got, meta, group=self.group)
        received: list[torch.Tensor | None] = [None] * n
        received[me] = sends[me]
        ops = []
        for i, (numel, code) in enumerate(got.tolist()):
            if i == me:
                continue
            if flat[i] is not None and flat[i].numel():
                ops.append(dist.P2POp(dist.isend, flat[i], group=self.group, group_peer=i))
            if numel >= 0:
                received[i] = torch.empty(numel, dtype=_DTYPES[code], device=wire)
                if numel:
                    ops.append(dist.P2POp(dist.irecv, received[i], group=self.group, group_peer=i))
        if ops:
            for work in self._call("all_to_all", dist.batch_isend_irecv, ops):
                self._call("all_to_all", work.wait)
        return [t if i == me or t is None else self._home(t) for i, t in enumerate(received)]

    def barrier(self) -> None:
        self._call("barrier", dist.all_reduce, self._zero, group=self.group)
        if self.device.type == "cuda":  # NCCL ops are asynchronous; a barrier must hold the host too
            self._call("barrier", torch.cuda.synchronize, self.device)


class CommunicatorPool:
    """Every TP group of the power-of-two hierarchy of a world, built once by all ranks together.

    For each power of two t dividing the world size, the blocks of size t are the aligned ranges
    range(i * t, (i + 1) * t). A rank holds communicators for the blocks it belongs to."""

    def __init__(self, rank: int, world: int, backend: str, comms: dict[tuple[int, ...], Communicator],
                 fallbacks: dict[tuple[int, ...], Communicator], pids: dict[int, int],
                 groups: list[dist.ProcessGroup]):
        self._rank = rank
        self._world = world
        self.backend = backend
        self._comms = comms
        self._fallbacks = fallbacks
        self._pids = pids
        self._groups = groups
        self._blocks = {t: [tuple(range(i * t, (i + 1) * t)) for i in range(world // t)] for t in tp_degrees(world)}

    @classmethod
    def build(cls, rank: int, world: int, *, backend: str = "auto", timeout: float = 60.0,
              capacity: int = 8 << 20, device: torch.device | None = None) -> CommunicatorPool:
        """Collective over the world, after torch.distributed.init_process_group. backend: "shm" (CPU;
        shared memory on the hot path, gloo groups as fallback), "gloo", "nccl", or "auto" (nccl when
        CUDA is available and the world group uses it, else shm where shm_supported, else gloo).
        capacity: shm buffer bytes. device: the rank's; a GPU under a gloo world group (ranks sharing one GPU,
        process_group_options(shared=True)) makes auto gloo, with TorchCommunicator staging through the host."""
        if not dist.is_initialized():
            raise RuntimeError("CommunicatorPool.build needs torch.distributed.init_process_group first")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise ValueError(f"rank/world {rank}/{world} disagree with torch.distributed's "
                             f"{dist.get_rank()}/{dist.get_world_size()}")
        if backend == "auto":
            if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
                backend = "nccl"
            elif device is not None and device.type == "cuda":  # shm handles CPU tensors only
                backend = "gloo"
            else:
                backend = "shm" if shm_supported(platform.machine()) else "gloo"
        if backend not in BACKENDS:
            raise ValueError(f"backend must be auto, shm, gloo or nccl, got {backend!r}")
        pid_list: list = [None] * world
        dist.all_gather_object(pid_list, os.getpid())
        pids = dict(enumerate(pid_list))
        blocks = [tuple(range(i * t, (i + 1) * t)) for t in tp_degrees(world) if t > 1 for i in range(world // t)]
        fallbacks: dict[tuple[int, ...], Communicator] = {(rank,): SoloCommunicator(rank)}
        groups = []
        td = datetime.timedelta(seconds=timeout)
        for block in blocks:
            # Collective over the world: every rank creates every group, in the same order.
            group = dist.new_group(list(block), timeout=td, backend="nccl" if backend == "nccl" else "gloo")
            if rank in block:
                groups.append(group)
                fallbacks[block] = TorchCommunicator(group, block, rank, pids=pids, device=device)
        comms = dict(fallbacks)
        if backend == "shm":
            comms.update(_build_shm(rank, world, [b for b in blocks if rank in b], timeout, capacity))
        return cls(rank, world, backend, comms, fallbacks, pids, groups)

    @property
    def world(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sizes(self) -> tuple[int, ...]:
        """The TP sizes of the hierarchy, ascending."""
        return tuple(self._blocks)

    @property
    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def blocks(self, t: int) -> list[tuple[int, ...]]:
        if t not in self._blocks:
            raise ValueError(f"{t} is not a TP size of world {self._world}; sizes are {self.sizes}")
        return list(self._blocks[t])

    def get(self, ranks: Sequence[int]) -> Communicator:
        """The hot-path communicator of a block this rank belongs to."""
        return self._lookup(self._comms, ranks)

    def fallback(self, ranks: Sequence[int]) -> Communicator:
        """The torch.distributed communicator of a block (the same as get unless backend is shm)."""
        return self._lookup(self._fallbacks, ranks)

    def _lookup(self, comms: dict[tuple[int, ...], Communicator], ranks: Sequence[int]) -> Communicator:
        key = tuple(ranks)
        comm = comms.get(key)
        if comm is not None:
            return comm
        if key in self._blocks.get(len(key), ()):
            raise KeyError(f"rank {self._rank} is not a member of block {key}")
        raise KeyError(f"{key} is not a TP block of world {self._world}: blocks are aligned ranges "
                       f"range(i*t, (i+1)*t) for t in {self.sizes}")

    def dead_ranks(self) -> frozenset[int]:
        """Ranks whose processes are gone (all ranks share this host)."""
        return _dead_among(self._pids, [r for r in self._pids if r != self._rank])

    def close(self) -> None:
        for comm in self._comms.values():
            if isinstance(comm, ShmCommunicator):
                comm.close()
        if dist.is_initialized():
            for group in self._groups:
                dist.destroy_process_group(group)
        self._comms, self._fallbacks, self._groups = {}, {}, []


def _build_shm(rank: int, world: int, blocks: list[tuple[int, ...]], timeout: float,
               capacity: int) -> dict[tuple[int, ...], ShmCommunicator]:
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    prefix = f"pat-shm-{token[0]}"  # unique per world: pods and test runs on one host never collide
    comms: dict[tuple[int, ...], ShmCommunicator] = {}

    def phase(creators: bool) -> None:
        error = None
        try:
            for block in blocks:
                if (block[0] == rank) == creators:
                    comms[block] = ShmCommunicator(block, rank, prefix=prefix, capacity=capacity, timeout=timeout)
        except (OSError, ValueError) as e:
            error = f"rank {rank}: {e}"
        # Doubles as the barrier between creating and opening, and fails every rank together.
        errors: list = [None] * world
        dist.all_gather_object(errors, error)
        if any(errors):
            for comm in comms.values():
                comm.close()
            raise CommError("shared-memory setup failed: " + "; ".join(e for e in errors if e))

    phase(creators=True)
    phase(creators=False)
    for comm in comms.values():  # every member has mapped its segments: a crash can no longer leak them
        comm.unlink()
    return comms


def process_group_options(device: torch.device, timeout: float, shared: bool = False) -> dict[str, Any]:
    """init_process_group's backend, timeout and device for a rank driving `device`; timeout: comm_timeout.

    NCCL (GPUs only; the tests check these options on CPU): the world group gets the TP groups' timeout. A
    collective that does not complete within it is caught by torch's watchdog thread, which polls every 100 ms,
    waits for flight-recorder dumps (up to 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 15 s), then aborts the
    process (nccl_env): the pod exits about timeout + 1 min after a peer stalled or died. A watchdog stuck in a
    CUDA call is aborted by its heartbeat monitor after TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s).
    device_id binds the group to this rank's GPU and creates its communicator now, so NCCL set-up errors fail
    the start rather than the first step, and new_group splits it instead of a fresh rendezvous per TP group.

    CPU: gloo with torch's default timeout (30 min). The world group's timeout would also bound the start-up
    rendezvous, which a short comm_timeout (tests use 2 s) must not; CPU ranks handle a late or dead peer in
    the pod, through the TP groups, which get comm_timeout.

    shared (tests only: several ranks on one GPU, EngineOptions.device "cuda-shared"): gloo as on CPU, since NCCL
    refuses two ranks on one device; the communicators then stage GPU tensors through the host."""
    if device.type != "cuda" or shared:
        return {"backend": "gloo"}
    return {"backend": "nccl", "timeout": datetime.timedelta(seconds=timeout), "device_id": device}


def nccl_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to `environ` before the first NCCL group is created (its variables are read then).

    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 makes the watchdog tear the process down on an NCCL error or timeout,
    without ncclCommAbort, which can itself hang on a broken communicator. It is torch 2.13's default, pinned
    because failing fast rests on it; a value the user set (also under its old name NCCL_ASYNC_ERROR_HANDLING)
    is kept. TORCH_NCCL_BLOCKING_WAIT stays off: it would hold the host on every collective (with it set,
    the collective raises after the timeout instead, and TorchCommunicator fails the rank just the same)."""
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in environ or "NCCL_ASYNC_ERROR_HANDLING" in environ:
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def measure_link_bandwidth(comm: Communicator, nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """Bytes per second one member receives in an all_to_all where every member sends nbytes / size
    to every other; the median of `repeats`, then the minimum over members, so all get the same
    number. Collective over comm; inf for a group of one."""
    if comm.size == 1:
        return math.inf
    device = getattr(comm, "device", torch.device("cpu"))
    per_peer = max(1, nbytes // comm.size)
    payload = torch.ones(per_peer, dtype=torch.uint8, device=device)
    sends = [None if i == comm.index else payload for i in range(comm.size)]
    received = per_peer * (comm.size - 1)
    comm.all_to_all(sends)  # warm-up: page faults in fresh buffers, NCCL connection setup
    rates = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        comm.all_to_all(sends)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(received / (time.perf_counter() - start))
    return min(comm.all_gather_object(statistics.median(rates)))
