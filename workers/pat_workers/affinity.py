"""Ranks pinned to CPU cores, where a core stands for a GPU (bench/placement.py): engine rank r of a pod runs on
core PAT_ENGINE_CPUS[r], trainer local rank r on core PAT_TRAINER_CPUS[r], each with one thread. Unset (the
default), nothing is pinned."""

from __future__ import annotations

import os

import torch

ENGINE_CPUS = "PAT_ENGINE_CPUS"
TRAINER_CPUS = "PAT_TRAINER_CPUS"


def pin(variable: str, rank: int) -> None:
    """Pins this process to the rank's core of the comma-separated list in env `variable`, if it is set."""
    cores = os.environ.get(variable)
    if not cores:
        return
    os.sched_setaffinity(0, {int(cores.split(",")[rank])})
    torch.set_num_threads(1)
