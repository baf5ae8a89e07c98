"""Training checkpoints with torch.distributed.checkpoint (DCP): root/iter-000010/ holds the sharded model and
optimizer (each rank writes its own shards, plus DCP's .metadata) and state.pt (iteration, RNG states, sampler
cursor, extra: the same on every rank, written by rank 0).

Every rank writes into one temporary folder in root; when all have finished, rank 0 fsyncs it and renames it
into place: a crash leaves either a whole checkpoint or none (plus a temp folder that latest() ignores and the
next save() deletes). DCP reshards on load, so a checkpoint written by N ranks resumes on M. With several
trainer pods, root must be storage every pod sees (a ReadWriteMany volume).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_FILE = "state.pt"
TEMP_PREFIX = ".tmp-"
_CHECKPOINT_NAME = re.compile(r"iter-(\d+)")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too: their entries (the rename) must reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(iteration, path) of the complete checkpoints in root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_NAME.fullmatch(p.name))]
    return sorted(found)


def save(root: str | Path, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         state: dict[str, Any], keep: int) -> Path:
    """Writes root/iter-{iteration:06d} atomically and deletes all but the newest `keep` checkpoints. Every rank
    calls it (a collective). `state` holds plain Python values and tensors (load() unpickles nothing else)."""
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just written (checkpoint.keep >= 1)")
    root, rank = Path(root), dist.get_rank()
    final, temp = root / f"iter-{iteration:06d}", root / f"{TEMP_PREFIX}iter-{iteration:06d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(TEMP_PREFIX + "*"):  # one writer group at a time: these are crash leftovers
            shutil.rmtree(leftover)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temp)  # fsyncs its files
    dist.barrier()  # DCP's .metadata is written once every rank's shards are
    if rank == 0:
        torch.save({"iteration": iteration, **state}, temp / STATE_FILE)
        _fsync(temp / STATE_FILE)
        _fsync(temp)
        if final.exists():  # written before by a run that restarted from an older checkpoint: replace it whole
            shutil.rmtree(final)
        os.replace(temp, final)
        _fsync(root)
        for _, old in _checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint in root (temp folders are ignored), or None."""
    found = _checkpoints(Path(root))
    return found[-1][1] if found else None


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Loads the sharded model and optimizer into `model` and `optimizer` (every rank; any world size) and
    returns the state dict saved with them (iteration, ...)."""
    path = Path(path)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
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
