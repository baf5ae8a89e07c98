"""The split of a mini-batch by tokens: across the ranks within one sequence of the best split, then into the same
number of micro-batches on every rank, the fewest that fit the token budget."""

import itertools
import random

import pytest

from pat_workers.trainer.batching import balanced_partition, micro_batch_plan

CASES = [  # hand-made: skewed, long-tailed, equal, fewer sequences than parts, one giant
    [10, 1, 10, 1, 10, 1, 10, 1],
    [512, 40, 33, 31, 30, 29, 20, 18, 17, 16],
    [7] * 9,
    [5, 3],
    [100, 1, 1, 1, 1, 1, 1],
    [8, 7, 6, 5, 4],  # LPT's classic: 2 parts, 17 and 13 where 15 and 15 exist
]


def optimum(lengths: list[int], parts: int) -> int:
    """The smallest largest part over every assignment (brute force)."""
    best = sum(lengths)
    for assignment in itertools.product(range(parts), repeat=len(lengths)):
        sums = [0] * parts
        for length, part in zip(lengths, assignment):
            sums[part] += length
        best = min(best, max(sums))
    return best


def largest(lengths: list[int], groups: list[list[int]]) -> int:
    return max(sum(lengths[i] for i in group) for group in groups)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("lengths", CASES + [[random.Random(s).randint(1, 60) for _ in range(9)] for s in range(4)])
def test_balanced_partition_is_within_one_sequence_of_the_optimum(lengths, parts):
    groups = balanced_partition(lengths, parts)
    assert len(groups) == parts and sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    assert largest(lengths, groups) - optimum(lengths, parts) <= max(lengths)
    assert balanced_partition(list(lengths), parts) == groups  # deterministic


def test_round_robin_misses_the_bound_on_a_skewed_batch():
    # Negative control: the old split (rank r takes every world-th sequence) puts all the long ones on one rank.
    lengths = [10, 1, 10, 1, 10, 1, 10, 1]
    round_robin = [list(range(r, len(lengths), 2)) for r in range(2)]
    assert largest(lengths, round_robin) - optimum(lengths, 2) > max(lengths)
    assert largest(lengths, balanced_partition(lengths, 2)) == optimum(lengths, 2) == 22


def fewest_bins(lengths: list[int], budget: int) -> int:
    """The fewest groups of at most `budget` that hold `lengths`: every placement of each sequence, longest first,
    in a group it fits or a new one (exhaustive)."""
    def fewest(rest: list[int], sums: list[int]) -> int:
        if not rest:
            return len(sums)
        head, tail = rest[0], rest[1:]
        options = [sums[:g] + [s + head] + sums[g + 1:] for g, s in enumerate(sums) if s + head <= budget]
        return min(fewest(tail, option) for option in options + [sums + [head]])
    return fewest(sorted(lengths, reverse=True), [])


def shares_of(plan: list[list[list[int]]]) -> list[list[int]]:
    return [[i for part in parts for i in part] for parts in plan]


@pytest.mark.parametrize("seed", range(30))
def test_micro_batch_plans_are_the_fewest_that_fit(seed):
    rng = random.Random(seed)
    world, budget = rng.choice([1, 2]), rng.choice([10, 16, 25])
    lengths = [rng.randint(1, budget) for _ in range(rng.randint(3, 8 * world))]
    plan = micro_batch_plan(lengths, world, budget)
    assert len(plan) == world and len({len(parts) for parts in plan}) == 1  # FSDP pairs the passes
    assert sorted(i for share in shares_of(plan) for i in share) == list(range(len(lengths)))  # each once
    assert all(sum(lengths[i] for i in part) <= budget for parts in plan for part in parts)
    assert len(plan[0]) == max(fewest_bins([lengths[i] for i in share], budget) for share in shares_of(plan))
    assert micro_batch_plan(list(lengths), world, budget) == plan  # deterministic


@pytest.mark.parametrize("world", [2, 4])
def test_micro_batch_plans_balance_the_ranks_on_a_long_tail(world):
    rng = random.Random(world)
    lengths = [min(100, int(2 + 8 / rng.random() ** 0.8)) for _ in range(37)]
    plan = micro_batch_plan(lengths, world, 100)
    assert all(sum(lengths[i] for i in part) <= 100 for parts in plan for part in parts)
    assert largest(lengths, shares_of(plan)) - max(sum(lengths) / world, max(lengths)) <= max(lengths)
    for parts in plan:  # the largest first on every rank: the passes paired up are alike
        sums = [sum(lengths[i] for i in part) for part in parts]
        assert sums == sorted(sums, reverse=True)


def test_micro_batch_plan_edges():
    assert micro_batch_plan([20, 3], 1, 16) == [[[0], [1]]]  # longer than the budget: alone
    assert micro_batch_plan([5, 3], 4, 16) == [[[0]], [[1]], [[]], [[]]]  # idle ranks run zero-weight passes
    assert micro_batch_plan([], 2, 16) == [[], []]
    # Balanced, 6 + 3 + 3 = 12 overflows; packed first-fit, two fit: [6, 4] and [4, 3, 3].
    assert micro_batch_plan([6, 4, 4, 3, 3], 1, 10) == [[[0, 1], [2, 3, 4]]]
    assert micro_batch_plan([9, 9, 9], 1, 16) == [[[0], [1], [2]]]  # more than tokens / budget: 27 / 16 -> 2
