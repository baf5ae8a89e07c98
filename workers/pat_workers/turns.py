"""Turns: jobs that run side by side, one iteration at a time, in an order the launcher sets (`pat run --baseline`).

The variants of a comparison (adaptive TP, fixed TP=1, the other fixed layout) run as whole jobs at once, each with
its own pods and trainer, but only one of them runs an iteration at any time: before iteration k, each trainer's
rank 0 says so (`<name>.waiting` holds k) and waits until the launcher's `turn` file names it with an iteration of k
or more. Iteration k of every variant thus runs back to back, under the same conditions of the host, and the
launcher changes the order from one iteration to the next. The files are written whole (a rename), so a reader
never sees half of one.

A trainer that resumes from a checkpoint runs the iterations it redoes within its current turn, and waits for the
next one after that: `<name>.waiting` above k tells the launcher that the job is past iteration k.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "PAT_TURNS"  # "<folder>:<name>" in a trainer's environment: it waits for its turns there
POLL_S = 0.02


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


class Turn:
    """A trainer's side: wait for the turn of each iteration."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = Path(folder), name

    @classmethod
    def from_env(cls) -> Turn | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        folder, name = value.rsplit(":", 1)
        return cls(Path(folder), name)

    def wait(self, iteration: int) -> None:
        _write(self.folder / f"{self.name}.waiting", str(iteration))
        while True:
            turn = (_read(self.folder / "turn") or "").split()
            if len(turn) == 2 and turn[0] == self.name and int(turn[1]) >= iteration:
                return
            time.sleep(POLL_S)


class Turns:
    """The launcher's side: whose turn it is, and how far each job is."""

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names = Path(folder), list(names)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.iterdir():  # of an earlier run into the same folder
            stale.unlink()

    def env(self, name: str) -> dict[str, str]:
        return {ENV: f"{self.folder.resolve()}:{name}"}

    def waiting(self, name: str) -> int | None:
        """The iteration the job's trainer waits to start (None: it has not reached its first)."""
        text = _read(self.folder / f"{name}.waiting")
        return int(text) if text else None

    def grant(self, name: str, iteration: int) -> None:
        _write(self.folder / "turn", f"{name} {iteration}")

    def order(self, iteration: int) -> list[str]:
        """The order of iteration `iteration` (from 1): rotated by one each iteration, so that each job runs
        first, in the middle and last equally often."""
        shift = (iteration - 1) % len(self.names)
        return self.names[shift:] + self.names[:shift]
