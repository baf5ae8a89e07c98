"""A fixed layout (generator.tensorParallelSize with adaptive TP off): the ranks start in its groups and stay."""

import pytest

from pat_operator.layout import LayoutError
from pat_workers.engine.generator import LocalGenerator

from .conftest import OPTIONS, fresh, make_requests, mismatches


def test_a_fixed_layout_starts_in_its_groups_and_stays(model_dir, reference):
    """LocalGenerator(layout=(2,)) on 2 CPU ranks: every step runs on the TP=2 group, no regroup happens, and the
    tokens are the single process's. A layout the model's heads do not allow is refused before any rank starts."""
    with LocalGenerator(model_dir, 2, OPTIONS, layout=(2,)) as gen:
        assert gen.layout == gen.start_layout == (2,) and gen.loads() == {(0, 1): 0}
        result = gen.run(fresh(make_requests()))
        assert gen.layout == (2,) and gen.epoch == 0
    assert result.steps and {r.group for r in result.steps} == {(0, 1)}
    assert result.regroups == []
    assert mismatches(reference, result.completions) == []
    with pytest.raises(LayoutError, match=r"TP=8 is not allowed here; allowed: \[1, 2, 4\]"):
        LocalGenerator(model_dir, 8, OPTIONS, layout=(8,))  # the test preset's 4 KV heads
