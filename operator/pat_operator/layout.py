"""TP layouts of one generator pod: how its ranks are grouped into tensor-parallel replicas.

A layout is a tuple of group sizes in rank order, e.g. (2, 1, 1) for ranks {0,1}, {2}, {3}. Every group is a
power of two and aligned (it starts at a multiple of its size), so the groups of any two layouts are either
disjoint or nested: that is what lets a pod build every communicator once at start and reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence

Layout = tuple[int, ...]
Group = tuple[int, ...]


class LayoutError(ValueError):
    """A layout that cannot be applied; the message says why and what would be valid."""


def uniform(world: int, tp: int = 1) -> Layout:
    return (tp,) * (world // tp)


def describe(layout: Sequence[int]) -> str:
    """A layout as people read it: (2, 1, 1) -> '2+1+1'."""
    return "+".join(map(str, layout))


def tp_degrees(world: int) -> list[int]:
    """The group sizes a pod of `world` ranks can have: the powers of two that divide it."""
    return [1 << i for i in range(world.bit_length()) if world % (1 << i) == 0]


def groups(layout: Sequence[int]) -> list[Group]:
    out, start = [], 0
    for size in layout:
        out.append(tuple(range(start, start + size)))
        start += size
    return out


def group_of(layout: Sequence[int], rank: int) -> Group:
    for group in groups(layout):
        if rank in group:
            return group
    raise LayoutError(f"rank {rank} is outside layout {tuple(layout)}")


def validate(layout: Sequence[int], world: int, tp_sizes: Sequence[int] | None = None) -> Layout:
    """Returns the layout as a tuple, or raises LayoutError naming the problem."""
    layout = tuple(int(t) for t in layout)
    if sum(layout) != world:
        raise LayoutError(f"layout {layout} covers {sum(layout)} ranks; the pod has {world}")
    start = 0
    for size in layout:
        if size < 1 or size & (size - 1):
            raise LayoutError(f"layout {layout}: group size {size} is not a power of two")
        if tp_sizes is not None and size not in tp_sizes:
            raise LayoutError(f"layout {layout}: TP={size} is not allowed here; allowed: {sorted(tp_sizes)}")
        if start % size:
            raise LayoutError(f"layout {layout}: the group of size {size} at rank {start} is not aligned "
                              f"(a group of size t must start at a multiple of t)")
        start += size
    return layout


def regions(old: Sequence[int], new: Sequence[int]) -> list[Group]:
    """The blocks of ranks that a change from `old` to `new` touches, each the largest changed group in it.

    Groups present in both layouts are untouched; every other old or new group lies inside exactly one region,
    and the ranks of a region regroup together while the rest of the pod keeps decoding.
    """
    unchanged = set(groups(old)) & set(groups(new))
    changed = [g for g in groups(old) + groups(new) if g not in unchanged]
    maximal = [g for g in changed if not any(set(g) < set(h) for h in changed)]
    return sorted(set(maximal))
