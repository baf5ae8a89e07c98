"""How a mini-batch's sequences are split across the trainer ranks and into micro-batches, by tokens.

Pure functions of the sequences' lengths (prompt + response tokens): every rank computes the same plan, so that each
knows its own share and how many micro-batches the others run (FSDP2 pairs the ranks' collectives, pass by pass).
"""

from __future__ import annotations

import heapq


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups of nearly equal sums, each group's indices ascending: longest first,
    each to the group with the smallest sum so far (LPT). The largest sum is within one sequence of the optimum: the
    group that ends largest was the smallest (at most the mean, so at most the optimum) when it took its last
    sequence. Karmarkar-Karp (verl's balance_batch) often lands closer but guarantees no more, in more code. Ties
    go to the earlier sequence and the lower group: the same groups on every rank."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [(0, g) for g in range(parts)]  # already a heap
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, g = heapq.heappop(sums)
        groups[g].append(i)
        heapq.heappush(sums, (total + lengths[i], g))
    return [sorted(group) for group in groups]


def first_fit_decreasing(lengths: list[int], parts: int, budget: int) -> list[list[int]] | None:
    """Indices of `lengths` in `parts` groups of at most `budget` each (a longer sequence alone): longest first, each
    to the first group it fits in; None if one fits nowhere. Packs tighter than balanced_partition, which spreads."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = next((g for g in range(parts) if not groups[g] or sums[g] + lengths[i] <= budget), None)
        if g is None:
            return None
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(group) for group in groups]


def micro_batch_plan(lengths: list[int], world: int, budget: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (lists of indices into `lengths`): the sequences split across the ranks by tokens
    (balanced_partition), then each rank's share into the same number of micro-batches (FSDP pairs the ranks'
    passes) of at most `budget` tokens each (a sequence longer than the budget alone: the spec keeps
    maxTokensPerMicroBatch >= generator.maxSeq), balanced where that fits, else packed (first_fit_decreasing), the
    largest first on every rank so that the passes paired up are alike. The number is the fewest, from the bound
    max over ranks of ceil(tokens / budget), at which one of the two fits every rank's share (the fewest that any
    split fits is bin packing, NP-hard; first-fit decreasing needs at most 11/9 of it + 2/3). An empty
    micro-batch is a zero-weight pass."""
    shares = balanced_partition(lengths, world)
    count = max(-(-sum(lengths[i] for i in share) // budget) for share in shares)
    while True:  # at the most sequences a rank holds, one each, the balanced split fits
        splits = [_split([lengths[i] for i in share], count, budget) for share in shares]
        if all(split is not None for split in splits):
            return [[[share[j] for j in part] for part in split] for share, split in zip(shares, splits)]
        count += 1


def _split(lengths: list[int], parts: int, budget: int) -> list[list[int]] | None:
    tokens = lambda group: sum(lengths[i] for i in group)  # noqa: E731
    for groups in (balanced_partition(lengths, parts), first_fit_decreasing(lengths, parts, budget)):
        if groups is not None and all(len(group) <= 1 or tokens(group) <= budget for group in groups):
            return sorted(groups, key=lambda group: -tokens(group))
    return None
