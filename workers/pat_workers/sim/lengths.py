"""Response lengths of a rollout batch: drawn (DeepScaleR-like), from a JSON list, or as an earlier run recorded."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from .hardware import SimError

# DeepScaleR trained at 8K, then 16K, then 24K tokens of response, with mean lengths of ~3.5-5.5K as the cap grew.
DEEPSCALER_MEAN_TOKENS = {8192: 3500, 16384: 5500}


def lognormal_lengths(n: int, cap: int, seed: int, mean_fraction: float = 0.4, sigma: float = 0.8) -> list[int]:
    """DeepScaleR-like: mean ~40% of the cap, a long right tail clipped at the cap."""
    rng = random.Random(seed)
    mu = math.log(mean_fraction * cap) - sigma**2 / 2
    return [max(4, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def deepscaler_lengths(n: int, cap: int, seed: int) -> list[int]:
    """Lognormal (sigma 0.8) with DeepScaleR's mean at that cap before clipping (40% of other caps)."""
    return lognormal_lengths(n, cap, seed, DEEPSCALER_MEAN_TOKENS.get(cap, 0.4 * cap) / cap)


def with_cap_share(lengths: list[int], cap: int, share: float, seed: int) -> list[int]:
    """`lengths` with round(share x n) of them, drawn, at the cap: responses truncated there, as reasoning RL has
    many of early on and whenever the cap is tight (the PAT paper's long tail)."""
    rng = random.Random(seed)
    at_cap = set(rng.sample(range(len(lengths)), round(share * len(lengths))))
    return [cap if i in at_cap else n for i, n in enumerate(lengths)]


def read_lengths(path: Path) -> list[int]:
    """A JSON list of lengths, or a run folder of `pat run` (its rollouts/iter-*.json: every response's tokens)."""
    if path.is_dir():
        files = sorted((path / "rollouts").glob("iter-*.json"))
        if not files:
            raise SimError(f"--lengths {path}: no rollouts/iter-*.json in that run folder; give a run folder of `pat "
                           f"run` or a JSON list of response lengths")
        return [len(r["tokens"]) for f in files for r in json.loads(f.read_text())]
    try:
        lengths = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SimError(f"--lengths {path}: {e}; give a JSON list of response lengths (tokens)") from None
    if not isinstance(lengths, list) or not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
        raise SimError(f"--lengths {path}: expected a non-empty JSON list of integers >= 1 (response lengths)")
    return lengths
