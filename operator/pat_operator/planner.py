"""When to regroup, and into which layout: a pure function of the groups' loads and a step-latency profile.

The profile T(tp, batch) is what the engine measured at start. Within a rollout batch the planner only merges
(a split would move requests away from the ranks that hold their caches for no gain in the tail); the pod
returns to TP=1 at the batch boundary. This is the step-time part of PAT's predictor; the length predictor,
regroup-cost amortisation and cooldown come with the runtime planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import product

from .layout import Group, Layout, groups

Profile = Mapping[int, Mapping[int, float]]  # tp -> batch -> seconds per decode step


def step_seconds(profile: Profile, tp: int, batch: int) -> float:
    """T(tp, batch), interpolated linearly between measured batch sizes (0 at batch 0, extrapolated above)."""
    if batch <= 0:
        return 0.0
    points = sorted(profile[tp].items())
    if batch <= points[0][0]:
        return points[0][1] * batch / points[0][0]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    if len(points) == 1:
        return points[0][1] * batch / points[0][0]
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) / (b1 - b0) * (batch - b1)


def coarsenings(layout: Sequence[int], tp_sizes: Sequence[int]) -> list[Layout]:
    """Every layout whose groups are unions of the current groups (the current one included)."""
    current = set(groups(layout))
    world = sum(layout)

    def block(start: int, size: int) -> list[Layout]:
        if tuple(range(start, start + size)) in current:
            return [(size,)]
        half = size // 2
        options = [a + b for a, b in product(block(start, half), block(start + half, half))]
        return options + [(size,)] if size in tp_sizes else options

    top = world & -world  # the largest power of two dividing the world: no group spans two such blocks
    return [sum(choice, ()) for choice in product(*(block(s, top) for s in range(0, world, top)))]


def predicted_step(layout: Sequence[int], loads: Mapping[Group, int], profile: Profile) -> float:
    """The slowest group's step time: the pod's generation ends with its slowest replica."""
    worst = 0.0
    for g in groups(layout):
        batch = sum(n for h, n in loads.items() if set(h) <= set(g))
        worst = max(worst, step_seconds(profile, len(g), batch))
    return worst


def plan(layout: Sequence[int], loads: Mapping[Group, int], profile: Profile, tp_sizes: Sequence[int],
         min_gain: float = 0.1) -> Layout | None:
    """The merge that minimises the predicted step time, if it beats the current one by `min_gain` (a
    fraction); None to stay. `loads` are the unfinished requests of the current groups."""
    if sum(loads.values()) == 0:
        return None
    current = predicted_step(layout, loads, profile)
    best = min(coarsenings(layout, [t for t in tp_sizes if t in profile]),
               key=lambda c: (predicted_step(c, loads, profile), -len(c)))  # ties: smaller groups
    if predicted_step(best, loads, profile) < current * (1 - min_gain):
        return best
    return None
