"""Process trees of the processes under test (a pod's ranks are its children or grandchildren)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The live child processes of pid, whichever of its threads started them."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return out
