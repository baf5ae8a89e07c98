"""Layouts and the planner: pure functions, hand-computed cases."""

import pytest

from pat_operator import layout, planner

# A profile with the shape measured on CPUs and GPUs: flat in batch (memory-bound), TP2 ~0.6x TP1 per step.
PROFILE = {1: {1: 0.040, 8: 0.060, 16: 0.080}, 2: {1: 0.025, 8: 0.040, 16: 0.050, 32: 0.070},
           4: {1: 0.020, 8: 0.030, 32: 0.045, 64: 0.070}}


def test_groups_and_validate():
    assert layout.groups((2, 1, 1)) == [(0, 1), (2,), (3,)]
    assert layout.group_of((2, 1, 1), 3) == (3,)
    assert layout.tp_degrees(8) == [1, 2, 4, 8] and layout.tp_degrees(6) == [1, 2] and layout.tp_degrees(1) == [1]
    assert layout.validate([4], 4) == (4,)
    for bad, message in (((1, 2, 1), "not aligned"), ((3, 1), "power of two"), ((2, 1), "covers 3 ranks"),
                         ((4,), "not allowed")):
        with pytest.raises(layout.LayoutError, match=message):
            layout.validate(bad, 4 if bad != (2, 1) else 4, tp_sizes=[1, 2] if bad == (4,) else None)


@pytest.mark.parametrize("old,new,expected", [
    ((1, 1, 1, 1), (2, 1, 1), [(0, 1)]),
    ((1, 1, 1, 1), (4,), [(0, 1, 2, 3)]),
    ((2, 2), (4,), [(0, 1, 2, 3)]),
    ((2, 1, 1), (1, 1, 2), [(0, 1), (2, 3)]),
    ((4,), (1, 1, 1, 1), [(0, 1, 2, 3)]),
    ((2, 2), (2, 2), []),
])
def test_regions(old, new, expected):
    assert layout.regions(old, new) == expected


def test_step_seconds_interpolates():
    assert planner.step_seconds(PROFILE, 1, 0) == 0
    assert planner.step_seconds(PROFILE, 1, 8) == pytest.approx(0.060)
    assert planner.step_seconds(PROFILE, 1, 12) == pytest.approx(0.070)  # halfway between 8 and 16
    assert planner.step_seconds(PROFILE, 1, 24) == pytest.approx(0.100)  # extrapolated along the last segment


def test_coarsenings_only_merge():
    assert planner.coarsenings((1, 1, 1, 1), [1, 2, 4]) == [(1, 1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 2), (4,)]
    assert planner.coarsenings((2, 1, 1), [1, 2, 4]) == [(2, 1, 1), (2, 2), (4,)]
    assert planner.coarsenings((2, 1, 1), [1, 2]) == [(2, 1, 1), (2, 2)]
    assert planner.coarsenings((4,), [1, 2, 4]) == [(4,)]


def test_plan_merges_in_the_tail():
    # Tail: 1 + 2 + 0 + 1 sequences; TP1 steps take 40-45 ms, one TP4 group of 4 takes 24 ms.
    loads = {(0,): 1, (1,): 2, (2,): 0, (3,): 1}
    assert planner.plan((1, 1, 1, 1), loads, PROFILE, [1, 2, 4]) == (4,)


def test_plan_does_nothing_when_gain_is_small_or_nothing_runs():
    # Bulk: 16 per replica at TP1 (80 ms) vs 32 per TP2 pair (70 ms): 12.5% gain, under a 20% margin.
    bulk = {(0,): 16, (1,): 16, (2,): 16, (3,): 16}
    assert planner.plan((1, 1, 1, 1), bulk, PROFILE, [1, 2], min_gain=0.2) is None
    assert planner.plan((1, 1, 1, 1), bulk, PROFILE, [1, 2], min_gain=0.1) == (2, 2)
    assert planner.plan((1, 1, 1, 1), dict.fromkeys(bulk, 0), PROFILE, [1, 2, 4]) is None
    assert planner.plan((4,), {(0, 1, 2, 3): 3}, PROFILE, [1, 2, 4]) is None  # nothing larger to merge into


def test_plan_picks_the_fastest_merge_by_hand():
    # Ranks 0-1 hold one sequence each, ranks 2-3 sixteen: now max(T1(1), T1(16)) = 80 ms.
    # (1,1,2): max(40, T2(32) = 70) = 70; (2,2): max(T2(2) ~ 27, 70) = 70; (4,): T4(34) = 45 + 25 * 2/32 ms.
    loads = {(0,): 1, (1,): 1, (2,): 16, (3,): 16}
    assert planner.predicted_step((1, 1, 1, 1), loads, PROFILE) == pytest.approx(0.080)
    assert planner.predicted_step((2, 2), loads, PROFILE) == pytest.approx(0.070)
    assert planner.plan((1, 1, 1, 1), loads, PROFILE, [1, 2, 4]) == (4,)
    assert planner.predicted_step((4,), loads, PROFILE) == pytest.approx(0.0465625)
    assert planner.plan((1, 1, 1, 1), loads, PROFILE, [1, 2]) == (1, 1, 2)  # ties go to smaller groups
