"""Training checkpoints with torch.distributed.checkpoint (DCP): root/iter-000010/ holds the sharded model and
optimizer (each rank writes its own shards, plus DCP's .metadata) and state.pt (iteration, RNG states, sampler
cursor, extra: the same on every rank, written by rank 0).

Every rank writes into one temporary folder in root; when all have finished, rank 0 fsyncs it and renames it
into place: a crash leaves either a whole checkpoint or none (plus a temp folder that latest() ignores and the
next save deletes). DCP reshards on load, so a checkpoint written by N ranks resumes on M. With several
trainer pods, root must be storage every pod sees (a ReadWriteMany volume).

The trainer saves with a Checkpointer: training waits only while each rank copies its shards to CPU memory;
the files are written, and the folder renamed, in the background. save() writes the same folder and returns
once it is in place.

Fenced by gang attempt: a Checkpointer given its attempt (env PAT_ATTEMPT, which the operator and `pat run` set)
claims root when the trainer starts, writing root/attempt.json (atomically replaced), and rank 0 checks the claim is
still its own before each step that changes root (clearing leftovers, the rename, pruning). A trainer of an older
attempt that still runs (cut off from the operator, which has started the next one) then writes no checkpoint over
the new attempt's: its save fails with StaleAttempt. The newest trainer to start holds root; a trainer started by
hand (no PAT_ATTEMPT), or of an older release, claims nothing and checks nothing.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import socket
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_FILE = "state.pt"
TEMP_PREFIX = ".tmp-"
OWNER_FILE = "attempt.json"  # the claim of the gang attempt that holds root
_CHECKPOINT_NAME = re.compile(r"iter-(\d+)")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too: their entries (the rename) must reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StaleAttempt(RuntimeError):
    """A newer gang attempt holds the checkpoint folder: this trainer's checkpoint is not written."""


@dataclass(frozen=True)
class Fence:
    """Rank 0's claim on root for its gang attempt (see the module's docstring)."""
    root: Path
    attempt: int
    claim: str  # this trainer's own: attempts restart from 0 in a job created again, or a `pat run` run again

    @classmethod
    def take(cls, root: Path, attempt: int) -> Fence:
        """Claims root for this trainer, replacing any earlier trainer's claim."""
        fence = cls(root, attempt, secrets.token_hex(8))
        root.mkdir(parents=True, exist_ok=True)
        temp = root / f".{OWNER_FILE}.{fence.claim}"
        pod = os.environ.get("POD_NAME") or socket.gethostname()  # a pod's hostname is the same in every attempt
        temp.write_text(json.dumps({"attempt": attempt, "claim": fence.claim, "pod": pod}))
        _fsync(temp)
        os.replace(temp, root / OWNER_FILE)
        _fsync(root)
        return fence

    def check(self, what: str) -> None:
        """Raises StaleAttempt, naming `what` is refused, unless root's claim is still this trainer's."""
        try:
            owner = json.loads((self.root / OWNER_FILE).read_text())
        except (OSError, ValueError) as e:
            owner = {"error": str(e)}
        if owner.get("claim") == self.claim:
            return
        holder = (f"the claim of attempt {owner['attempt']} (pod {owner.get('pod')})" if "attempt" in owner else
                  f"no claim ({owner.get('error')})")
        raise StaleAttempt(f"{what} refused: {self.root / OWNER_FILE} holds {holder}, not this trainer's (attempt "
                           f"{self.attempt}): a newer gang attempt has started, and this one writes no checkpoint over "
                           f"its checkpoints")


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(iteration, path) of the complete checkpoints in root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_NAME.fullmatch(p.name))]
    return sorted(found)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes and reads: views of this rank's shards, no copies."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _paths(root: Path, iteration: int, fence: Fence | None = None) -> tuple[Path, Path]:
    """The checkpoint of `iteration` and the temp folder it is written into: the fenced trainer's own, so that an
    older attempt's write still under way never writes into it."""
    name = f"iter-{iteration:06d}"
    return root / name, root / (TEMP_PREFIX + name + (f".{fence.claim}" if fence else ""))


def _begin(root: Path, iteration: int, state: dict[str, Any], keep: int, fence: Fence | None = None) -> Path:
    """Every rank, before writing a checkpoint: rank 0 deletes crash leftovers and writes state.pt into a new temp
    folder. Returns the temp folder."""
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just written (checkpoint.keep >= 1)")
    _, temp = _paths(root, iteration, fence)
    if dist.get_rank() == 0:
        if fence is not None:  # the leftovers may be the newer attempt's checkpoint being written
            fence.check(f"checkpoint of iteration {iteration}")
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(TEMP_PREFIX + "*"):  # one writer group at a time: these are crash leftovers
            shutil.rmtree(leftover)
        temp.mkdir()
        torch.save({"iteration": iteration, **state}, temp / STATE_FILE)
    dist.barrier()  # no rank writes into a folder that rank 0 is still clearing
    return temp


def _complete(root: Path, iteration: int, keep: int, fence: Fence | None = None) -> None:
    """Rank 0, once DCP has written every rank's shards (fsynced) and then its .metadata: moves the temp folder
    into place and deletes all but the newest `keep` checkpoints."""
    final, temp = _paths(root, iteration, fence)
    if fence is not None:
        fence.check(f"checkpoint of iteration {iteration}")
    _fsync(temp / STATE_FILE)
    _fsync(temp)
    if final.exists():  # written before by a run that restarted from an older checkpoint: replace it whole
        shutil.rmtree(final)
    os.replace(temp, final)
    _fsync(root)
    for _, old in _checkpoints(root)[:-keep]:
        shutil.rmtree(old)


def save(root: str | Path, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         state: dict[str, Any], keep: int) -> Path:
    """Writes root/iter-{iteration:06d} atomically, deletes all but the newest `keep` checkpoints and returns once
    the new one is in place. Every rank calls it (a collective). `state` holds plain Python values and tensors
    (load() unpickles nothing else)."""
    root = Path(root)
    temp = _begin(root, iteration, state, keep)
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=temp)  # on rank 0 it returns after every rank's write
    if dist.get_rank() == 0:
        _complete(root, iteration, keep)
    dist.barrier()
    return _paths(root, iteration)[0]


class Checkpointer:
    """Writes the checkpoints of root in the background. save() returns once every rank has copied its shards to
    CPU memory (the next optimizer step may then change them); a thread writes the files and, on rank 0, moves the
    folder into place once every rank's are written: until then latest() returns the checkpoint before. Every rank
    makes the same calls in the same order; one save at a time (save() first waits for the one before)."""

    def __init__(self, root: str | Path, keep: int, attempt: int | None = None):
        """`attempt`: the gang attempt this trainer belongs to, which claims root (Fence); None: no fence."""
        self.root, self.keep = Path(root), keep
        # DCP's collectives run in the writing thread while training's run in this one: a group of their own keeps
        # them apart. Gloo: async_save needs a CPU backend (what it writes is in CPU memory by then).
        self.group = dist.new_group(backend="gloo")
        self.completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending: Future[None] | None = None
        self.fence: Fence | None = None
        if attempt is not None:  # rank 0 claims; every rank writes into the claim's temp folders
            box = [Fence.take(self.root, attempt) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)  # claimed before any rank looks for `latest`
            self.fence = box[0]

    def save(self, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             state: dict[str, Any]) -> None:
        """Starts writing root/iter-{iteration:06d}. `state` as save()'s: written before this returns."""
        self.wait()
        temp = _begin(self.root, iteration, state, self.keep, self.fence)
        # The default stager copies every tensor to CPU memory before async_save returns.
        written = dcp.async_save(_sharded_state(model, optimizer), checkpoint_id=temp, process_group=self.group)
        self.pending = self.completer.submit(self._finish, written, iteration)

    def _finish(self, written: Future, iteration: int) -> None:
        written.result()  # on rank 0: every rank's shards and the .metadata are written
        if dist.get_rank() == 0:
            _complete(self.root, iteration, self.keep, self.fence)

    def wait(self) -> None:
        """Returns once the checkpoint being written is in place (at once if none is); raises what failed. Every
        rank calls it (a collective)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()
        dist.barrier()  # rank 0 renames: in place for every rank once it has


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint in root (temp folders are ignored), or None."""
    found = _checkpoints(Path(root))
    return found[-1][1] if found else None


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Loads the sharded model and optimizer into `model` and `optimizer` (every rank; any world size) and
    returns the state dict saved with them (iteration, ...)."""
    path = Path(path)
    sharded = _sharded_state(model, optimizer)
    dcp.load(sharded, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint by Hugging Face name, in one process (no process group)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    weights = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if key.startswith("model.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    return weights


def rng_state() -> dict[str, Any]:
    """The states of Python's random, torch's CPU generator and, when present, every CUDA device's."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
