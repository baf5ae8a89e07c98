"""Training checkpoints: root/iter-000010/ holds model.safetensors (the policy's weights) and state.pt (optimizer,
RNG states, sampler cursor, extra).

A checkpoint is written into a temp dir in root, fsynced, then renamed into place: a crash leaves either a
whole checkpoint or none (plus a temp dir that latest() ignores and the next save() deletes).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..engine.loader import SINGLE_FILE, save_weights

STATE_FILE = "state.pt"
TEMP_PREFIX = ".tmp-"
_CHECKPOINT_NAME = re.compile(r"iter-(\d+)")


@dataclass
class Checkpoint:
    path: Path
    iteration: int
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: dict[str, Any]
    sampler_state: dict[str, Any]
    extra: dict[str, Any]


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


def save(root: str | Path, iteration: int, *, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
         rng: dict[str, Any], sampler_state: dict[str, Any], extra: dict[str, Any], keep: int) -> Path:
    """Writes root/iter-{iteration:06d} atomically and deletes all but the newest `keep` checkpoints. `extra`
    holds plain Python values and tensors (load() unpickles nothing else)."""
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just written (checkpoint.keep >= 1)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter-{iteration:06d}"
    temp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))
    try:
        save_weights(temp, {name: t.detach().cpu() for name, t in weights.items()})
        torch.save({"iteration": iteration, "optimizer": optimizer_state, "rng": rng, "sampler": sampler_state,
                    "extra": extra}, temp / STATE_FILE)
        for file in temp.iterdir():
            _fsync(file)
        _fsync(temp)
        if final.exists():  # written before by a run that restarted from an older checkpoint: move it aside
            os.replace(final, Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root)) / final.name)
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _fsync(root)
    for _, old in _checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for leftover in root.glob(TEMP_PREFIX + "*"):  # one writer (trainer rank 0): these are crash leftovers
        shutil.rmtree(leftover)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint in root (temp dirs are ignored), or None."""
    found = _checkpoints(Path(root))
    return found[-1][1] if found else None


def load(path: str | Path) -> Checkpoint:
    path = Path(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    return Checkpoint(path, state["iteration"], load_file(str(path / SINGLE_FILE)), state["optimizer"],
                      state["rng"], state["sampler"], state["extra"])


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
