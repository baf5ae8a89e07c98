"""Layouts: pure functions, hand-computed cases (the planner's are in test_planner.py)."""

import pytest

from pat_operator import layout


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
