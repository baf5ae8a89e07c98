"""The planner: hand-computed cases with tiny profiles and a response cap of 4 tokens.

Under the uniform prior over 1..4 a fresh request runs its k-th next step with probability (4 - k) / 4, so a
group's expected batch n(k) over its next steps is its fresh requests times 1, .75, .5, .25; one at generated 2
runs with 1, .5. Every case below sums T(tp, n(k)) over those steps by hand.
"""

import json
import math

import pytest

from pat_operator.planner import (Controller, Decision, LengthPredictor, Profile, RegroupCosts, coarsenings,
                                  plan)

# T1(n) = n below 1, then 1 + 0.5 (n - 1); T2(n) = 0.4 n, then 0.4 + 0.2 (n - 1); T4(n) = 0.3 n, 0.3 + 0.1 (n - 1).
PROFILE = {1: {1: 1.0, 4: 2.5}, 2: {1: 0.4, 4: 1.0}, 4: {1: 0.3, 8: 1.0}}
# A regroup: 0.1 s, plus per request min(0.01 s per context token, 0.2 s + 0.01 s per token): 0.1 s at 10 tokens.
COSTS = RegroupCosts(fixed_seconds=0.1, kv_seconds_per_token=0.01, prefill={t: (0.2, 0.01) for t in (1, 2, 4)})
FRESH = (10, 0)  # (context tokens, generated tokens)


def decide(layout, running, tp_sizes=(1, 2, 4), costs=COSTS, margin=0.1, **kwargs) -> Decision:
    return plan(layout, running, Profile(PROFILE), LengthPredictor(4), costs, tp_sizes, margin, **kwargs)


def assert_decision(d: Decision, layout, stay, best, cost, reason):
    assert (d.layout, d.stay_seconds, d.best_seconds, d.cost_seconds) == (layout, pytest.approx(stay),
                                                                          pytest.approx(best), pytest.approx(cost))
    assert d.reason.startswith(reason), d.reason


# -- the length predictor -----------------------------------------------------------------------------------

def test_predictor_prior_is_uniform():
    p = LengthPredictor(4)  # L uniform in 1..4: P(L > x) = (4 - x) / 4
    assert [p.survival(0, k) for k in range(5)] == [1, 0.75, 0.5, 0.25, 0]
    assert p.survival(2, 1) == 0.5  # P(L > 3 | L > 2) = (1/4) / (2/4)
    assert p.expected_remaining(0) == 2.5  # E[L] = (1 + 2 + 3 + 4) / 4
    assert p.expected_remaining(2) == 1.5  # L in {3, 4}: 1 or 2 more
    assert p.expected_remaining(4) == 0 and p.expected_remaining(9) == 0  # at or past the cap nothing remains


def test_predictor_after_observations():
    # Observed 2, 2, 4 plus one uniform pseudo-response: P(L > x) = (#observed > x + (4 - x) / 4) / 4, i.e.
    # 4 P(L > x) * 4 = 16, 15, 6, 5, 0 for x = 0..4.
    p = LengthPredictor(4)
    p.observe([2, 2, 4])
    assert p.survival(0, 1) == 15 / 16 and p.survival(0, 2) == 6 / 16 and p.survival(2, 1) == 5 / 6
    assert p.expected_remaining(0) == pytest.approx((16 + 15 + 6 + 5) / 16)  # (2 + 2 + 4 + 2.5) / 4
    assert p.expected_remaining(2) == pytest.approx((6 + 5) / 6)  # the 4 (2 more), and the pseudo-response's half
    assert LengthPredictor(4, prior=[2, 2, 4]).survival(0, 2) == 6 / 16  # a prior is observations in advance


def test_predictor_beyond_every_observation_is_uniform_up_to_the_cap():
    p = LengthPredictor(4)
    p.observe([1, 1])  # scaled P(L > x): 12, 3, 2, 1, 0
    assert p.survival(1, 1) == 2 / 3 and p.expected_remaining(1) == pytest.approx(2.0)  # uniform in 2..4


def test_predictor_window_cap_and_prior_replacement():
    p = LengthPredictor(4, prior=[4, 4, 4], window=2)
    p.observe([])  # a batch that finished nothing changes nothing
    assert p.survival(0, 3) == (3 * 4 + 1) / (3 * 4 + 4)
    p.observe([9])  # cut at the cap: counts as 4; the prior is gone
    assert p.survival(0, 3) == (4 + 1) / (4 + 4)
    p.observe([1, 1])  # the window keeps the last 2: the 9 is gone too
    assert p.survival(0, 1) == 3 / 12
    with pytest.raises(ValueError, match="negative"):
        p.observe([3, -1])
    with pytest.raises(ValueError, match="generated=-1"):
        p.survival(-1, 0)
    with pytest.raises(ValueError, match="max_tokens=0"):
        LengthPredictor(0)


# -- the step-time profile ----------------------------------------------------------------------------------

def test_profile_interpolates_and_extrapolates():
    p = Profile({1: {1: 0.040, 8: 0.060, 16: 0.080}, 2: {4: 0.08}, 4: {1: 0.05, 2: 0.04}})
    assert p.tp_sizes == [1, 2, 4]
    assert p.step_seconds(1, 0) == 0
    assert p.step_seconds(1, 0.5) == pytest.approx(0.020)  # below the first point: proportional
    assert p.step_seconds(1, 8) == pytest.approx(0.060)
    assert p.step_seconds(1, 12) == pytest.approx(0.070)  # halfway between 8 and 16
    assert p.step_seconds(1, 24) == pytest.approx(0.100)  # along the last segment
    assert p.step_seconds(2, 8) == pytest.approx(0.16)  # one point: proportional
    assert p.step_seconds(4, 4) == pytest.approx(0.04)  # a last segment sloping down is not followed
    with pytest.raises(ValueError, match="no TP=8"):
        p.step_seconds(8, 1)
    for bad in ({}, {1: {}}, {1: {0: 0.1}}, {1: {1: 0.0}}):
        with pytest.raises(ValueError, match="profile"):
            Profile(bad)


def test_profile_observe_moves_toward_observations_but_bounded():
    p = Profile({1: {1: 0.040, 8: 0.060}})
    p.observe(1, 8, 0.090)  # 1.5x the prediction: the point moves 10% of the way, to 0.060 * 1.05
    assert p.step_seconds(1, 8) == pytest.approx(0.063) and p.step_seconds(1, 1) == pytest.approx(0.040)
    p.observe(1, 1, 4.0)  # an outlier (100x) counts as 2x: 0.040 * 1.1, not 0.4
    assert p.step_seconds(1, 1) == pytest.approx(0.044)
    p.observe(1, 3, 0.024)  # nearest to batch 1; under half of T(3) = 0.044 + 0.019 * 2/7: counts as half
    assert p.step_seconds(1, 1) == pytest.approx(0.044 * 0.95)
    for _ in range(200):
        p.observe(1, 8, 0.050)
    assert p.step_seconds(1, 8) == pytest.approx(0.050, rel=1e-3)
    with pytest.raises(ValueError, match="seconds > 0"):
        p.observe(1, 8, 0.0)

    p.observe(1, 8, 0.2, at_once=True)  # the guard's correction: all the way, uncapped, where it was measured
    assert p.step_seconds(1, 8) == pytest.approx(0.2) and p.step_seconds(1, 1) == pytest.approx(0.044 * 0.95)


def test_profile_corrected_at_once_predicts_the_step_exactly():
    p = Profile({1: {1: 0.3}, 2: {1: 0.4, 4: 1.0, 8: 1.4}}, kv_seconds={2: 0.001}, decode_context=10)
    # T2(2) = 0.6 from the table, + 0.1 s for 100 KV tokens beyond the measured context: the table's part is 1.4 s
    p.observe(2, 2, 1.5, context=2 * 10 + 100, at_once=True)
    assert p.step_seconds(2, 2, 2 * 10 + 100) == pytest.approx(1.5)
    # batches 1 and 4, which T2(2) is drawn from, are scaled by 1.4 / 0.6; batch 8 and TP1 are left as they were
    assert p.step_seconds(2, 1) == pytest.approx(0.4 * 1.4 / 0.6) and p.step_seconds(2, 4) == pytest.approx(1.4 / 0.6)
    assert p.step_seconds(2, 8) == 1.4 and p.step_seconds(1, 1) == 0.3
    p.observe(2, 16, 2.8, at_once=True)  # beyond the table: the last two points, whose line extrapolates it
    assert p.step_seconds(2, 16) == pytest.approx(2.8) and p.step_seconds(2, 1) == pytest.approx(0.4 * 1.4 / 0.6)


def test_profile_json_round_trip():
    p = Profile({2: {8: 0.04, 1: 0.025}, 1: {1: 0.04}}, kv_seconds={2: 1e-6}, decode_context=64)
    text = json.dumps(p.to_json())
    assert json.loads(text) == {"decode": {"1": {"1": 0.04}, "2": {"1": 0.025, "8": 0.04}}, "decode_context": 64,
                                "kv_seconds": {"1": 0.0, "2": 1e-6}}
    assert Profile.from_json(json.loads(text)).to_json() == p.to_json()
    with pytest.raises(ValueError, match="integer keys"):
        Profile.from_json({"decode": {"two": {"1": 0.1}}})
    with pytest.raises(ValueError, match="KeyError"):
        Profile.from_json({"1": {"1": 0.1}})  # a bare table: say what is expected
    with pytest.raises(ValueError, match="kv_seconds"):
        Profile({1: {1: 0.1}}, kv_seconds={1: -1e-6})


def test_profile_context_term():
    # Measured at 64 tokens per sequence; each KV token beyond costs 2 ms more per step, each one short 2 ms less.
    p = Profile({1: {1: 0.1, 8: 0.2}}, kv_seconds={1: 0.002}, decode_context=64)
    assert p.step_seconds(1, 8) == p.step_seconds(1, 8, 8 * 64) == pytest.approx(0.2)
    assert p.step_seconds(1, 8, 8 * 64 + 25) == pytest.approx(0.25)
    assert p.step_seconds(1, 1, 39) == pytest.approx(0.05)
    assert p.step_seconds(1, 1, 0) == 0.0  # never negative
    # A step observed at a long context is what the KV term predicts: the table stays as it is.
    p.observe(1, 8, 0.25, context=8 * 64 + 25)
    assert p.step_seconds(1, 8) == pytest.approx(0.2)
    p.observe(1, 8, 0.25)  # at the measured context it is 25% slower: the point moves 2.5%
    assert p.step_seconds(1, 8) == pytest.approx(0.205)


def test_predictor_sums_the_kv_held_by_the_running():
    # Uniform prior over 1..4; one fresh request with a 10-token prompt runs steps 0..3 with probability
    # 1, .75, .5, .25, holding 10, 11, 12, 13 tokens then: expected KV held 10 + 8.25 + 6 + 3.25 = 27.5 in all.
    p = LengthPredictor(4)
    running, held = p.running_sums({0: (1, 10)}, width=2, segments=2)
    assert running == pytest.approx([1.75, 0.75]) and held == pytest.approx(27.5)
    # Two at generated 2 (prompts 10 and 20) run steps 0, 1 with probability 1, .5, holding 12 + 22, then 13 + 23.
    running, held = p.running_sums({2: (2, 30)}, width=1, segments=3)
    assert running == pytest.approx([2, 1, 0]) and held == pytest.approx(34 + 18)


def test_regroup_cost_is_the_cheaper_of_moving_and_recomputing():
    costs = RegroupCosts(0.1, 0.001, {2: (0.05, 0.0005)})
    assert costs.request_seconds(2, 20) == pytest.approx(0.02)  # KV: 0.02 < re-prefill 0.06
    assert costs.request_seconds(2, 200) == pytest.approx(0.15)  # re-prefill: 0.15 < KV 0.2
    assert costs.request_seconds(4, 200) == pytest.approx(0.2)  # no prefill measured at TP=4: KV only
    assert costs.request_seconds(2, 0) == 0  # a waiting request moves for free
    vllm = RegroupCosts(0.1, math.inf, {2: (0.05, 0.0005)})  # engine vllm: no KV moves, re-prefill only
    assert vllm.request_seconds(2, 200) == pytest.approx(0.15) and vllm.request_seconds(2, 0) == 0
    with pytest.raises(ValueError, match="fixed_seconds=-1"):
        RegroupCosts(-1, 0.0, {})


# -- plan ---------------------------------------------------------------------------------------------------

def test_coarsenings_only_merge():
    assert coarsenings((1, 1, 1, 1), [1, 2, 4]) == [(1, 1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 2), (4,)]
    assert coarsenings((2, 1, 1), [1, 2, 4]) == [(2, 1, 1), (2, 2), (4,)]
    assert coarsenings((2, 1, 1), [1, 2]) == [(2, 1, 1), (2, 2)]
    assert coarsenings((4,), [1, 2, 4]) == [(4,)]


# Rank 0: a fresh request (n = 1, .75, .5, .25); rank 1: one at generated 2 (n = 1, .5).
TAIL = {(0,): [FRESH], (1,): [(12, 2)]}


def test_plan_merges_in_the_tail():
    # Stay: rank 0 takes T1 = n: 1 + .75 + .5 + .25 = 2.5 s (rank 1: 1.5 s). Merged: n = 2, 1.25, .5, .25 at
    # TP2: 0.6 + 0.45 + 0.2 + 0.1 = 1.35 s; regroup 0.1 + 0.1 + 0.12 (KV of 10 and 12 tokens) = 0.32 s.
    assert_decision(decide((1, 1), TAIL), (2,), 2.5, 1.35, 0.32, "merge (1, 1)->(2,): 2.5 s -> 1.35 s + 0.32 s")


def test_plan_stays_when_the_regroup_costs_more_than_it_gains():
    costly = RegroupCosts(1.0, 0.01, COSTS.prefill)  # regroup 1.22 s: 1.35 + 1.22 > 2.5
    assert_decision(decide((1, 1), TAIL, costs=costly), None, 2.5, 1.35, 1.22, "stay: the regroup cost eats")


def test_plan_stays_when_the_gain_is_under_the_margin():
    # Gain 2.5 - 1.35 = 1.15 s (0.83 s after the regroup), under 50% of 2.5 s.
    assert_decision(decide((1, 1), TAIL, margin=0.5), None, 2.5, 1.35, 0.32, "stay: the gain is under the 50%")
    # At 40% the merge itself would pass (1.15 s > 1 s) but not once it is paid for (0.83 s).
    assert decide((1, 1), TAIL, margin=0.4).reason.startswith("stay: the regroup cost eats the gain")


def test_the_kv_held_can_tip_a_merge():
    # At a 40% margin TAIL stays (above). Reading KV: 0.05 s per token per step at TP1, 0.01 s at TP2 (measured at
    # 0 tokens per sequence). Rank 0's request holds 10, 11, 12, 13 tokens with probability 1, .75, .5, .25 (27.5
    # in all), rank 1's 12, 13 with 1, .5 (18.5): stay 2.5 + 0.05 * 27.5 = 3.875 s; merged 1.35 + 0.01 * 46 =
    # 1.81 s, + 0.32 s regroup: a gain of 1.745 s, over 40% of 3.875 s.
    profile = Profile(PROFILE, kv_seconds={1: 0.05, 2: 0.01, 4: 0.01}, decode_context=0)
    d = plan((1, 1), TAIL, profile, LengthPredictor(4), COSTS, (1, 2, 4), margin=0.4)
    assert_decision(d, (2,), 3.875, 1.81, 0.32, "merge (1, 1)->(2,)")


def test_plan_stays_when_merging_is_slower():
    # Bulk: 4 fresh per rank, TP1: n = 4, 3, 2, 1 -> 2.5 + 2 + 1.5 + 1 = 7 s. With a TP2 that costs 0.8 s per
    # request (T2(n) = 0.8 n), one group with n = 8, 6, 4, 2 takes 16 s, plus 0.9 s to regroup.
    slow = Profile({1: PROFILE[1], 2: {1: 0.8, 4: 3.2}})
    d = plan((1, 1), {(0,): [FRESH] * 4, (1,): [FRESH] * 4}, slow, LengthPredictor(4), COSTS, [1, 2])
    assert_decision(d, None, 7.0, 16.0, 0.9, "stay: the gain is under the 10% margin")


def test_plan_does_nothing_when_nothing_runs_or_nothing_is_larger():
    assert_decision(decide((1, 1), {}), None, 0, 0, 0, "stay: nothing running")
    assert_decision(decide((1, 1), {(0,): [], (1,): []}), None, 0, 0, 0, "stay: nothing running")
    # Already one group of the largest size: 3 fresh at TP4, n = 3, 2.25, 1.5, .75: .5 + .425 + .35 + .225.
    assert_decision(decide((4,), {(0, 1, 2, 3): [FRESH] * 3}), None, 1.5, 1.5, 0, "stay: no merge of (4,)")
    assert decide((2, 2), {(0, 1): [FRESH]}, tp_sizes=[1, 2]).reason.startswith("stay: no merge of (2, 2)")


def test_plan_picks_the_fastest_merge_by_hand():
    # Ranks 0 and 1: 4 fresh each (7 s at TP1), rank 2: 1 fresh (2.5 s), rank 3: none. Stay: 7 s.
    # (1,1,2): 7 s + 0.2 s. (2,1,1) and (2,2): T2 with n = 8, 6, 4, 2 is 4.8 s, + 0.1 + 8 * 0.1 s regroup.
    # (4,): n = 9, 6.75, 4.5, 2.25 at TP4: 1.1 + 0.875 + 0.65 + 0.425 = 3.05 s, + 0.1 + 9 * 0.1 s.
    running = {(0,): [FRESH] * 4, (1,): [FRESH] * 4, (2,): [FRESH]}
    assert_decision(decide((1, 1, 1, 1), running), (4,), 7.0, 3.05, 1.0, "merge (1, 1, 1, 1)->(4,)")
    # Without TP4, (2,1,1) and (2,2) tie at 4.8 + 0.9 s: the smaller groups win.
    assert_decision(decide((1, 1, 1, 1), running, tp_sizes=[1, 2]), (2, 1, 1), 7.0, 4.8, 0.9,
                    "merge (1, 1, 1, 1)->(2, 1, 1)")


def test_plan_at_a_boundary_splits_when_replicas_are_faster_for_a_big_batch():
    # 16 fresh prompts. TP2 (one group): n = 16, 12, 8, 4 at T2 = 0.6 + 0.12 (n - 1): 2.4 + 1.92 + 1.44 + 0.96
    # = 6.72 s. Two TP1 replicas of 8: n = 8, 6, 4, 2 at T1 = 1 + 0.1 (n - 1): 1.7 + 1.5 + 1.3 + 1.1 = 5.6 s,
    # and a regroup at a boundary costs the fixed 0.1 s only (nothing is cached).
    profile = Profile({1: {1: 1.0, 8: 1.7}, 2: {1: 0.6, 16: 2.4}})
    ctl = Controller([1, 2])
    d = ctl.start_batch(2, [10] * 16, profile, LengthPredictor(4), COSTS, layout=(2,))
    assert_decision(d, (1, 1), 6.72, 5.6, 0.1, "regroup (2,)->(1, 1): 6.72 s -> 5.6 s + 0.1 s")
    d = ctl.start_batch(2, [10] * 16, profile, LengthPredictor(4), COSTS)  # already TP1 replicas: stay
    assert_decision(d, None, 5.6, 6.72, 0.1, "stay: the gain is under")


def test_a_start_whose_requests_could_only_move_by_re_prefilling_takes_the_fastest_layout_without_a_margin():
    # 16 fresh prompts, TP1 replicas 5.6 s as above, TP2 5.4 s (n = 16, 12, 8, 4 at 1.35 s): a gain of 4%, under
    # the 10% margin. This engine's pod starts on the replicas (merging later moves KV cheaply); a pod whose moves
    # re-prefill every running context (vLLM engines: no KV moves, kv_seconds_per_token inf) starts on TP2.
    profile = Profile({1: {1: 1.0, 8: 1.7}, 2: {1: 1.35, 16: 1.35}})
    d = Controller([1, 2]).start_batch(2, [10] * 16, profile, LengthPredictor(4), COSTS)
    assert_decision(d, None, 5.6, 5.4, 0.1, "stay: the gain is under")
    re_prefill = RegroupCosts(fixed_seconds=0.1, kv_seconds_per_token=math.inf, prefill=COSTS.prefill)
    d = Controller([1, 2]).start_batch(2, [10] * 16, profile, LengthPredictor(4), re_prefill)
    assert_decision(d, (2,), 5.6, 5.4, 0.1, "regroup (1, 1)->(2,): 5.6 s -> 5.4 s + 0.1 s")


def test_plan_at_a_boundary_spreads_requests_as_the_pod_submits_them():
    # 5 prompts go over (2,1,1) as 3, 1, 1 (fewest per rank first), however they are keyed. Stay: the TP2
    # group's n = 3, 2.25, 1.5, .75 takes 0.8 + 0.65 + 0.5 + 0.3 = 2.25 s, each TP1 rank's single one 2.5 s.
    # (4,): n = 5, 3.75, 2.5, 1.25 at TP4: 0.7 + 0.575 + 0.45 + 0.325 = 2.05 s, + 0.1 s: gain 0.35 s > 0.25 s.
    # Without TP4: (2,2) gets 3 and 2 (2.25 s and 0.6 + 0.5 + 0.4 + 0.2 = 1.7 s): 2.35 s with the regroup;
    # (1,1,2) and (1,1,1,1) put 2 on rank 0: T1 of n = 2, 1.5, 1, .5 is 1.5 + 1.25 + 1 + .5 = 4.25 s.
    d = decide((2, 1, 1), {(0, 1): [FRESH] * 5}, at_boundary=True)
    assert_decision(d, (4,), 2.5, 2.05, 0.1, "regroup (2, 1, 1)->(4,)")
    d = decide((2, 1, 1), {(0, 1): [FRESH] * 5}, tp_sizes=[1, 2], at_boundary=True)
    assert_decision(d, None, 2.5, 2.25, 0.1, "stay: the gain is under the 10% margin")  # 0.15 s < 0.25 s
    with pytest.raises(ValueError, match="every request is new"):
        decide((2, 1, 1), {(0, 1): [(10, 3)]}, at_boundary=True)


def test_plan_rejects_requests_keyed_by_other_groups():
    with pytest.raises(ValueError, match=r"not groups of layout \(2, 1, 1\)"):
        decide((2, 1, 1), {(0,): [FRESH]})


@pytest.mark.parametrize("tp_sizes,merge", [([1, 2, 4], (4,)), ([1, 2], (2, 1, 1))])
def test_bucketing_agrees_with_every_step(tp_sizes, merge):
    # A long tail (lengths 100 * 1.03^i, cut at 2000) and mixed progress; 256 segments of 8 steps vs 1970 of 1.
    predictor = LengthPredictor(2000)
    predictor.observe([int(100 * 1.03**i) for i in range(120)])
    profile = Profile({1: {1: 0.020, 8: 0.025, 32: 0.040, 64: 0.070},
                       2: {1: 0.013, 8: 0.016, 32: 0.025, 64: 0.040, 128: 0.070},
                       4: {1: 0.010, 8: 0.012, 32: 0.018, 64: 0.028, 128: 0.045, 256: 0.080}},
                      kv_seconds={1: 4e-6, 2: 2e-6, 4: 1e-6}, decode_context=64)
    costs = RegroupCosts(0.05, 1e-5, {t: (0.01, 1e-4) for t in (1, 2, 4)})
    running = {(0,): [(300, 150)] * 20, (1,): [(1050, 900)] * 5, (2,): [(1650, 1500)] * 2 + [(180, 30)], (3,): []}
    exact = plan((1, 1, 1, 1), running, profile, predictor, costs, tp_sizes, segments=2000)
    bucketed = plan((1, 1, 1, 1), running, profile, predictor, costs, tp_sizes)
    assert exact.layout == bucketed.layout == merge
    for field in ("stay_seconds", "best_seconds", "cost_seconds"):
        assert getattr(bucketed, field) == pytest.approx(getattr(exact, field), rel=0.01)


# -- the controller -----------------------------------------------------------------------------------------

def test_controller_waits_for_the_regroup_and_then_cools_down():
    ctl = Controller([1, 2], cooldown_steps=2)
    args = (Profile(PROFILE), LengthPredictor(4), COSTS)
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    assert_decision(ctl.decide((1, 1), TAIL, *args), None, 0, 0, 0, "in flight")
    ctl.regrouped()
    assert ctl.decide((1, 1), TAIL, *args).reason == "cooldown: 2 more decode step(s) after the last regroup"
    ctl.step()
    assert ctl.decide((1, 1), TAIL, *args).reason.startswith("cooldown: 1 more")
    ctl.step()
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)  # planning again
    ctl.regrouped()
    ctl.start_batch(2, [10], *args)  # a new batch: no cooldown
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)


def test_controller_plans_with_the_regroup_fixed_cost_it_measured():
    # The merge of TAIL is predicted at 0.32 s: 0.1 fixed (the start guess) + 0.22 to reshard the two requests. It
    # took 1.5 s: the fixed part measured is 1.28 s, and the same merge (1.35 + 1.5 s) no longer beats 2.5 s.
    ctl = Controller([1, 2], cooldown_steps=0, guard=False)
    args = (Profile(PROFILE), LengthPredictor(4), COSTS)
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    ctl.regrouped()  # not measured (or failed): the guess stays
    assert ctl.regroup_costs(COSTS) == COSTS
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    ctl.regrouped(1.5)
    assert ctl.regroup_costs(COSTS).fixed_seconds == pytest.approx(1.28)
    assert_decision(ctl.decide((1, 1), TAIL, *args), None, 2.5, 1.35, 1.5, "stay: the regroup cost eats the gain")
    ctl.regrouped(0.0)  # nothing was proposed: nothing to learn from
    ctl.start_batch(2, [10], *args)  # the measurement outlives the batch
    assert ctl.regroup_costs(COSTS).fixed_seconds == pytest.approx(1.28)


def test_controller_is_due_when_a_request_finished_or_after_replan_steps():
    ctl = Controller([1, 2])
    args = (Profile(PROFILE), LengthPredictor(4), COSTS)
    assert ctl.due(2)  # nothing decided yet
    ctl.decide((1, 1), TAIL, *args)
    ctl.regrouped()
    assert not ctl.due(2)  # TAIL holds 2 unfinished requests, as at that decision
    assert ctl.due(1)  # one finished since
    for _ in range(Controller.REPLAN_STEPS - 1):
        ctl.step()
    assert not ctl.due(2)
    ctl.step()
    assert ctl.due(2)
    ctl.start_batch(2, [10], *args)
    assert ctl.due(2)  # a new batch: decide at its first step


# -- the guard: each regroup judged by the steps it delivers ---------------------------------------------------

def run_steps(ctl, profile, group, batch, seconds, n=Controller.GUARD_SKIP + Controller.GUARD_STEPS):
    for _ in range(n):
        ctl.observe(group, batch, seconds, None, profile)
        ctl.step()


def merged(replica_seconds, **controller):
    """A controller (cooldown 0) whose replica of rank 0 ran its steps at replica_seconds, and which then merged the
    TAIL into TP2: (controller, profile, the rest of decide()'s arguments)."""
    profile = Profile(PROFILE)
    ctl = Controller([1, 2], cooldown_steps=0, **controller)
    args = (profile, LengthPredictor(4), COSTS)
    run_steps(ctl, profile, (0,), 1, replica_seconds)
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    ctl.regrouped()
    return ctl, profile, args


def test_guard_splits_back_a_merge_that_lied_and_raises_the_margin():
    # The profile says a TP2 step of 2 takes 0.6 s; it takes 2 s. Corrected, the row is scaled by 2 / 0.6: T2(1) =
    # 4/3. Staying merged, n = 2, 2/3, 1/3 takes 2 + 4/3 s; split back, rank 0's request (n = 1, 2/3, 1/3) 2 s at
    # T1, + 0.23 s to reshard rank 1's (0.1 + 0.13 s).
    profile = Profile(PROFILE)
    ctl = Controller([1, 2], cooldown_steps=0)
    args = (profile, LengthPredictor(4), COSTS)
    run_steps(ctl, profile, (0,), 1, 1.0)
    run_steps(ctl, profile, (1,), 1, 1.0)
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    ctl.regrouped()
    merged = {(0, 1): [(11, 1), (13, 3)]}
    assert ctl.decide((2,), merged, *args).reason.startswith("on trial")
    run_steps(ctl, profile, (0, 1), 2, 2.0)
    assert profile.step_seconds(2, 2) == pytest.approx(2.0)  # corrected at once
    assert profile.step_seconds(1, 1) == pytest.approx(1.0)  # measured as predicted: unchanged
    assert ctl.due(2) and not ctl.verdicts
    back = ctl.decide((2,), merged, *args)
    assert_decision(back, (1, 1), 2 + 4 / 3, 2.0, 0.23, "split back (2,)->(1, 1)")
    assert len(ctl.verdicts) == 1 and ctl.verdicts[0].lost
    assert ctl.verdicts[0].line.startswith("guard: 1+1->2 lost: a step of 2 takes 2000 ms (predicted 600); split")
    assert ctl.effective_margin == pytest.approx(0.1 + Controller.GUARD_RAISE)  # for the rest of this batch
    ctl.regrouped()
    assert ctl.decide((1, 1), TAIL, *args).layout is None  # the corrected profile: no more merges
    ctl.start_batch(2, [10], *args)
    assert ctl.effective_margin == pytest.approx(0.1)
    assert ctl.decide((1, 1), TAIL, *args).layout is None  # the next batch neither: the profile says no


def test_guard_takes_a_lost_correction_back_later_and_backs_off_while_the_size_keeps_losing():
    # A disturbed trial (TP2 steps at 2 s, predicted 0.6) must not keep TP2 out for the rest of the job: after
    # DOUBT_BATCHES batch starts the correction is taken back and the pod merges again; a second loss in a row
    # doubles the wait, and a merge that holds ends the doubt.
    profile = Profile(PROFILE)
    ctl = Controller([1, 2], cooldown_steps=0)
    args = (profile, LengthPredictor(4), COSTS)
    merged = {(0, 1): [(11, 1), (13, 3)]}

    def lose_a_merge():
        assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
        ctl.regrouped()
        run_steps(ctl, profile, (0, 1), 2, 2.0)
        assert ctl.decide((2,), merged, *args).layout == (1, 1) and ctl.verdicts[-1].lost
        ctl.regrouped()

    run_steps(ctl, profile, (0,), 1, 1.0)
    lose_a_merge()
    assert profile.step_seconds(2, 2) == pytest.approx(2.0)
    for wait in (Controller.DOUBT_BATCHES, 2 * Controller.DOUBT_BATCHES):
        for _ in range(wait - 1):
            ctl.start_batch(2, [10], *args, layout=(1, 1))
            assert profile.step_seconds(2, 2) == pytest.approx(2.0)  # still doubted
            assert ctl.decide((1, 1), TAIL, *args).layout is None
        ctl.start_batch(2, [10], *args, layout=(1, 1))
        assert profile.step_seconds(2, 2) == pytest.approx(0.6)  # taken back: the profile as before the trial
        lose_a_merge()  # the second time, the wait doubles
    for _ in range(4 * Controller.DOUBT_BATCHES):
        ctl.start_batch(2, [10], *args, layout=(1, 1))
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)
    ctl.regrouped()
    run_steps(ctl, profile, (0, 1), 2, 0.5)
    assert ctl.decide((2,), merged, *args).layout is None and not ctl.verdicts[-1].lost
    for _ in range(8):  # held: its correction stays, whatever batches follow
        ctl.start_batch(2, [10], *args, layout=(2,))
    assert profile.step_seconds(2, 2) == pytest.approx(0.5)


def test_guard_does_not_judge_a_group_by_its_first_step():
    # A merged group's first step warms up (here 10 s); the next GUARD_STEPS deliver what was predicted.
    ctl, profile, args = merged(1.0)
    run_steps(ctl, profile, (0, 1), 2, 10.0, n=Controller.GUARD_SKIP)
    run_steps(ctl, profile, (0, 1), 2, 0.6, n=Controller.GUARD_STEPS - 1)
    assert not ctl.due(2)  # GUARD_STEPS steps after the skipped ones, not yet
    run_steps(ctl, profile, (0, 1), 2, 0.6, n=1)
    assert ctl.decide((2,), {(0, 1): [(11, 1), (13, 3)]}, *args).layout is None
    assert not ctl.verdicts[-1].lost and profile.step_seconds(2, 2) == pytest.approx(0.6)


def test_guard_off_trusts_the_profile_and_keeps_merging():
    # The negative control: the same steps, the guard off.
    ctl, profile, args = merged(1.0, guard=False)
    run_steps(ctl, profile, (0, 1), 2, 1.5)
    assert ctl.verdicts == [] and not ctl.due(2) and profile.step_seconds(2, 2) == pytest.approx(0.6)
    assert ctl.decide((1, 1), TAIL, *args).layout == (2,)  # the next tail merges again


def test_guard_keeps_a_merge_that_delivers():
    ctl, profile, args = merged(1.2)
    run_steps(ctl, profile, (0, 1), 2, 0.7)
    assert ctl.decide((2,), {(0, 1): [(11, 1), (13, 3)]}, *args).layout is None
    assert ctl.verdicts[-1].line.startswith("guard: 1+1->2 held") and not ctl.verdicts[-1].lost
    assert ctl.effective_margin == 0.1
    assert profile.step_seconds(2, 2) == pytest.approx(0.7) and profile.step_seconds(1, 1) == pytest.approx(1.2)


def test_a_batch_start_that_held_is_the_next_boundarys_layout_to_beat():
    # PROFILE starts 2 fresh requests at TP2 (0.6 s a step against 1.0 per replica). In `close` TP2 is within the
    # 10% margin of replicas: n = 2, 1.5, 1, .5 take 0.783 + 0.692 + 0.6 + 0.3 = 2.375 s at TP2, and n = 1, .75,
    # .5, .25 per replica 2.5 s. It keeps TP2 where TP2 started and held, and TP1 replicas elsewhere.
    close = {1: {1: 1.0, 4: 2.5}, 2: {1: 0.6, 4: 1.15}}
    fresh = {(0, 1): [(11, 1)] * 2}

    def started(steps_take):  # a controller whose batch started at TP2 and was judged on steps of this time
        ctl = Controller([1, 2])
        profile = Profile(PROFILE)
        assert ctl.start_batch(2, [10, 10], profile, LengthPredictor(4), COSTS).layout == (2,)
        run_steps(ctl, profile, (0, 1), 2, steps_take)
        ctl.decide((2,), fresh, profile, LengthPredictor(4), COSTS)
        return ctl

    held = started(0.6)
    d = held.start_batch(2, [10, 10], Profile(close), LengthPredictor(4), COSTS)
    assert d.layout == (2,) and d.reason.startswith("stay: the gain is under the 10% margin ((2,)->(1, 1)")
    # The negative controls: no batch before, or one whose TP2 start lost, and the same profile starts replicas.
    assert Controller([1, 2]).start_batch(2, [10, 10], Profile(close), LengthPredictor(4), COSTS).layout is None
    lost = started(1.5)
    assert lost.verdicts[-1].lost
    lost.regrouped()
    assert lost.start_batch(2, [10, 10], Profile(close), LengthPredictor(4), COSTS).layout is None
    # Where replicas win by the margin, the boundary splits the held TP2 start; split groups are not on trial.
    replicas = Profile({1: {1: 1.0, 4: 2.5}, 2: {1: 2.0, 4: 5.0}})
    d = held.start_batch(2, [10, 10], replicas, LengthPredictor(4), COSTS)
    assert d.layout == (1, 1) and d.reason.startswith("regroup (2,)->(1, 1)")
    for group in (0,), (1,):
        run_steps(held, replicas, group, 1, 3.0)
    assert held.decide((1, 1), {(0,): [(11, 1)], (1,): [(11, 1)]}, replicas, LengthPredictor(4), COSTS).layout is None
    assert len(held.verdicts) == 1  # the TP2 start's, none since


def test_guard_judges_a_layout_chosen_at_the_boundary_against_the_prediction():
    # TP2 for 2 fresh requests is predicted at T2(2) = 0.6 s against T1(1) = 1.0 s per replica; it runs 1.5 s.
    profile = Profile(PROFILE)
    ctl = Controller([1, 2])
    args = (profile, LengthPredictor(4), COSTS)
    assert ctl.start_batch(2, [10, 10], *args).layout == (2,)
    run_steps(ctl, profile, (0, 1), 2, 1.5)
    assert ctl.decide((2,), {(0, 1): [(11, 1)] * 2}, *args).layout == (1, 1)
    assert ctl.verdicts[-1].line.startswith("guard: 1+1->2 lost: a step of 2 takes 1500 ms")
