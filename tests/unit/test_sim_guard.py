"""The guard in the simulator: a pod whose profile lies about TP=2 loses one regroup's worth of steps with the
guard on, and the whole tail with it off (the same Controller the pod runs, fed what its groups ran)."""

from dataclasses import dataclass

import pytest

from pat_workers.sim import simulate as sim
from pat_workers.sim.hardware import EngineCosts, Measured

from .test_simulate import BATCH, PREFILL, scenario

# What the steps take: a TP=2 step is 20% slower than a TP=1 one at every batch size ...
TRUTH = Measured(EngineCosts(1e9, 0.0, PREFILL, {1: {1: 0.010, 8: 0.012}, 2: {1: 0.012, 8: 0.016}}, {}), 1000)
# ... and what the pod's profile says: TP=2 twice as fast as TP=1 for the last sequences.
LIE = EngineCosts(1e9, 0.0, PREFILL, {1: {1: 0.010, 8: 0.012}, 2: {1: 0.005, 8: 0.016}}, {})


@dataclass(frozen=True)
class Profiled:
    """The truth's steps, with a profiling pass that measured `profiled` instead."""
    truth: Measured
    profiled: EngineCosts

    def engine_costs(self, tp_sizes, batches) -> EngineCosts:
        return self.profiled

    def __getattr__(self, name):
        return getattr(self.truth, name)


def test_a_lying_profile_costs_one_regroup_with_the_guard_and_the_tail_without():
    costs = Profiled(TRUTH, LIE)
    fixed = sim.fixed(scenario(BATCH), TRUTH, 1).seconds
    guarded = sim.pod_planner(scenario(BATCH), costs)
    trusting = sim.pod_planner(scenario(BATCH, guard=False), costs)
    assert [(old, new) for _, old, new, _ in guarded.regroups] == [((1, 1), (2,)), ((2,), (1, 1))]  # split back
    assert [(old, new) for _, old, new, _ in trusting.regroups] == [((1, 1), (2,))]
    assert guarded.seconds <= 1.03 * fixed  # the trial's steps and two regroups
    assert trusting.seconds > 1.15 * fixed  # the negative control: the tail at TP=2, 20% slower per step
    assert sim.pod_planner(scenario(BATCH), TRUTH).seconds == pytest.approx(fixed, rel=0.01)  # no lie: no merge
