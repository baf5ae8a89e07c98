"""What a job leaves in its run folder (`pat run`'s, or a trainer pod's checkpoint volume), and `pat` itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pat_workers.trainer import checkpoint
from tests.tiers import require

ROOT = Path(__file__).parents[1]


def pat(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    if args[0] == "run":
        require("slow", "pat run")
    return subprocess.run([sys.executable, "-m", "pat_workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def final_weights(run_dir: Path) -> dict:
    return checkpoint.load_weights(checkpoint.latest(run_dir / "checkpoints"))


def rollouts(run_dir: Path) -> dict[str, list]:
    return {p.name: json.loads(p.read_text()) for p in sorted((run_dir / "rollouts").glob("iter-*.json"))}
