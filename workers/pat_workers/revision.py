"""What a results file measured: this engine's revision and the commit it was run at.

Every file a GPU script writes under bench/results/ carries "commit", and every measurement of the engine "engine":
ENGINE_REVISION as it was when measured. `pat simulate` (sim/hardware.py) refuses an engine profile of another
revision, so that a change to the engine's step makes its old numbers unusable rather than silently wrong.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

# Bump it with every change to what a step of the engine costs (attention, the compiled or captured step, the batch it
# keeps on the device): results of the earlier revision stop counting. "paged-flex-1": paged KV read in place by
# FlexAttention with a block mask, fused q/k/v and gate/up GEMMs (commit b6f9343). Before it (no "engine" field in
# results): a contiguous cache, then paged blocks gathered into dense tensors for SDPA; none of those is read.
ENGINE_REVISION = "paged-flex-1"
COMMIT_ENV = "PAT_COMMIT"  # names the commit where the tree has no .git (a copy on a GPU machine)
ROOT = Path(__file__).resolve().parents[2]


def commit(root: Path = ROOT) -> str:
    """$PAT_COMMIT, else the checkout's HEAD ("+dirty" when tracked files differ from it), else a note saying neither
    was there."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        head = None
    if head is None or head.returncode != 0:
        return f"unknown: no git checkout at {root} (set {COMMIT_ENV})"
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def stamp(data: dict[str, Any], engine: bool = True) -> dict[str, Any]:
    """`data` with "commit" (and, for a measurement of the engine, "engine") first."""
    return {**({"engine": ENGINE_REVISION} if engine else {}), "commit": commit(), **data}
