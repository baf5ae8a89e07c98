"""Regroups on 4 CPU ranks (float32) give the tokens and log-probabilities of a single process at TP=1."""

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from pat_operator.layout import LayoutError, groups
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.engine import Request
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.metrics import group_label
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import make_tiny_model

from .conftest import OPTIONS, fresh, make_requests, mismatches

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

TRANSITIONS = {"1->2": ((1, 1, 1, 1), (2, 2)), "2->4": ((2, 2), (4,)), "1->4": ((1, 1, 1, 1), (4,)),
               "4->1": ((4,), (1, 1, 1, 1))}  # a split: each new TP=1 replica gathers all heads of its share
POINTS = ("before-first-step", "mid-way", "replica-drained")
CASES = [(t, p) for t in sorted(TRANSITIONS) for p in POINTS if not (t == "4->1" and p == "replica-drained")]


@pytest.fixture(scope="module")
def gen4(model_dir):
    with LocalGenerator(model_dir, 4, OPTIONS) as gen:
        yield gen


def regroup_once(start, target, point):
    """A policy that applies `target` once, at `point` of the batch."""
    steps, applied = [], []

    def policy(gen):
        if applied:
            return None
        loads = gen.loads()
        if point == "before-first-step" or (point == "mid-way" and len(steps) >= 12) or (
                point == "replica-drained" and min(loads.values()) == 0 < max(loads.values())):
            applied.append(target)
            return target
        return None

    return policy, steps.append


def run_with_regroup(gen, start, target, point, migration, requests=None):
    gen.regroup(start)  # back to the batch's starting layout (from whatever the last case left)
    policy, on_step = regroup_once(start, target, point)
    return gen.run(fresh(requests or make_requests()), policy=policy, on_step=on_step, migration=migration)


@pytest.mark.parametrize("migration", ["kv", "recompute"])
@pytest.mark.parametrize("transition,point", CASES)
def test_regroup_matches_single_process(gen4, reference, transition, point, migration):
    start, target = TRANSITIONS[transition]
    result = run_with_regroup(gen4, start, target, point, migration)
    assert [(r.old, r.new) for r in result.regroups] == [(start, target)], "the regroup did not happen once"
    reports = result.regroups[0].reports
    assert {r.outcome for r in reports} == {"applied"}, reports
    moved = sum(r.modes.get(migration, 0) for r in reports)
    other = sum(r.modes.get(m, 0) for r in reports for m in ("kv", "recompute") if m != migration)
    assert other == 0
    if point != "before-first-step":  # requests were decoding: they crossed over in the forced mode
        assert moved > 0
    for r in reports:  # blocks move in place, in rounds: never a second cache, at most ~10% of the pool beside it
        assert r.kv_buffer_bytes <= 0.1 * r.kv_pool_bytes, r
        if migration == "kv" and moved and r.kv_bytes:
            assert r.kv_buffer_bytes > 0
    assert gen4.layout == target
    assert mismatches(reference, result.completions) == []
    # Every block came back: each group's cache is empty once its last request finished.
    assert [gen4.metrics.kv_usage.labels(group_label(g))._value.get() for g in groups(target)] == [0] * len(target)


def test_auto_mode_and_metrics(gen4, reference):
    result = run_with_regroup(gen4, (1, 1, 1, 1), (4,), "mid-way", None)
    assert mismatches(reference, result.completions) == []
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(gen4.metrics.registry).decode())
               for s in family.samples}
    assert metrics[("pat_generator_tp_size", (("group", "0-3"),))] == 4
    assert metrics[("pat_generator_regroups_total", (("outcome", "applied"),))] >= 1
    assert metrics[("pat_generator_regroup_requests_total", (("mode", "kv"),))] > 0
    assert metrics[("pat_generator_regroup_requests_total", (("mode", "recompute"),))] > 0
    assert metrics[("pat_generator_step_seconds_count", (("tp", "4"),))] > 0
    assert metrics[("pat_generator_tokens_total", ())] >= sum(len(c.output) for c in result.completions.values())
    # auto: the measured costs chose a mode per request
    modes = {m for r in result.regroups[0].reports for m, n in r.modes.items() if n}
    assert modes <= {"kv", "recompute"} and modes


def grouped_requests(distinct: bool = False) -> list[Request]:
    """4 prompts x 4 samples (GRPO's G), sample 0 greedy and the others seeded; requests alternate between two TP=1
    replicas, so each holds 2 samples of every prompt. distinct: every sample gets a prompt of its own, as long."""
    out = []
    for p, length in enumerate((40, 70, 25, 90)):
        for s in range(4):
            prompt = [256] + [(37 * p + 11 * j + (5 * s if distinct else 0)) % 250 for j in range(length - 1)]
            params = SamplingParams(max_tokens=40, ignore_eos=True, seed=10 * p + s, temperature=0.9 if s else 0.0,
                                    top_p=0.95)
            out.append(Request(f"p{p}-s{s}", prompt, params))
    return out


@pytest.fixture(scope="module")
def grouped_reference(model_dir):
    with LocalGenerator(model_dir, 1, OPTIONS) as gen:
        return gen.run(fresh(grouped_requests())).completions


@pytest.fixture(scope="module")
def gen2(model_dir):
    with LocalGenerator(model_dir, 2, OPTIONS) as gen:
        yield gen


def block_bytes(cfg) -> int:
    """Of a KV block on 2 ranks (float32): the largest TP is 2, so a block holds half the KV heads."""
    return PagedKV.block_bytes(cfg, OPTIONS.block_size, cfg.num_kv_heads // 2, 4)


def blocks_held(result, group, requests, shared: bool) -> int:
    """By hand: the blocks (of one head group) that `group`'s requests held when it regrouped, from its last step.
    After a step a running request has cached all its tokens but the last; samples of a prompt admitted together
    share the prompt's full blocks (the partial one was copied on the first write); the rest is each its own."""
    prompt = {r.id: r.prompt for r in requests}
    bs = OPTIONS.block_size
    running = [s for s in result.steps if s.group == group][-1].running
    own = sum(-(-(len(prompt[rid]) + generated - 1) // bs) - len(prompt[rid]) // bs for rid, generated in running)
    full = {rid: len(prompt[rid]) // bs for rid, _ in running}
    if shared:
        full = {tuple(prompt[rid]): n for rid, n in full.items()}
    return own + sum(full.values())


def test_shared_prompts_move_once(gen2, grouped_reference):
    """A 1->2 merge of 4 prompts x 4 samples: a block the samples of a prompt share crosses once, and they share it
    again on the receiving rank: the bytes sent and the free blocks afterwards are the hand counts with sharing,
    and differ from the counts without it, which the same requests with distinct prompts meet instead."""
    block = block_bytes(gen2.config)
    for distinct in (False, True):
        requests = grouped_requests(distinct)
        result = run_with_regroup(gen2, (1, 1), (2,), "mid-way", "kv", requests)
        (report,) = result.regroups[0].reports  # the TP=2 group's leader, rank 0
        assert report.outcome == "applied" and report.modes == {"kv": 16, "recompute": 0}, report
        held = {g: blocks_held(result, g, requests, shared=True) for g in ((0,), (1,))}
        unshared = {g: blocks_held(result, g, requests, shared=False) for g in ((0,), (1,))}
        # Rank 0 keeps the first half of the heads of its requests and sends the second half to rank 1.
        assert report.kv_bytes == held[(0,)] * block
        assert report.kv_free_blocks == report.kv_pool_bytes // block - 1 - held[(0,)] - held[(1,)]
        if distinct:
            assert held == unshared
        else:  # the control: had each sample moved its own copy, the counts would be these
            assert held[(0,)] < unshared[(0,)] and report.kv_bytes != unshared[(0,)] * block
            assert mismatches(grouped_reference, result.completions) == []
        assert gen2.metrics.kv_usage.labels(group_label((0, 1)))._value.get() == 0  # every block came back


@pytest.mark.parametrize("failpoint", [None, "regroup.overcommit"])
def test_small_pool_recomputes_what_does_not_fit(model_dir, grouped_reference, failpoint):
    """A TP=2 group splits into two TP=1 replicas after filling a small pool: each TP=1 replica needs every head of its share and
    its own copy of each prompt, more than its pool holds. The plan migrates what fits and recomputes the rest;
    with its count skipped (failpoint regroup.overcommit) the move runs out of blocks (KVFull) and recomputes the
    requests that found none. Either way every request completes with the single process's tokens."""
    options = dataclasses.replace(OPTIONS, kv_cache_bytes=49 * block_bytes(ModelConfig.from_dir(model_dir)))
    env = {"PAT_FAILPOINTS": f"{failpoint}@0,{failpoint}@1"} if failpoint else None
    with LocalGenerator(model_dir, 2, options, env=env) as gen:
        result = run_with_regroup(gen, (2,), (1, 1), "mid-way", "kv", grouped_requests())
        reports = result.regroups[0].reports
        assert {r.outcome for r in reports} == {"applied"}, reports
        assert sum(r.modes["recompute"] for r in reports) > 0 < sum(r.modes["kv"] for r in reports), reports
        assert mismatches(grouped_reference, result.completions) == []
        assert [gen.metrics.kv_usage.labels(group_label(g))._value.get() for g in ((0,), (1,))] == [0, 0]


def test_gloo_fallback_backend(model_dir, reference):
    """The same regroup with gloo as the communicator (what runs where no shared memory is usable)."""
    options = dataclasses.replace(OPTIONS, comm_backend="gloo")
    with LocalGenerator(model_dir, 2, options) as gen:
        result = run_with_regroup(gen, (1, 1), (2,), "mid-way", "kv")
    assert [(r.old, r.new) for r in result.regroups] == [((1, 1), (2,))]
    assert sum(r.modes.get("kv", 0) for r in result.regroups[0].reports) > 0
    assert mismatches(reference, result.completions) == []


def test_corrupted_shard_is_caught(model_dir, reference):
    """Negative control: rank 3 serves a corrupted slice of q_proj; after it joins every request's group the
    comparison must fail."""
    with LocalGenerator(model_dir, 4, OPTIONS, env={"PAT_FAILPOINTS": "weights.corrupt@3"}) as gen:
        result = run_with_regroup(gen, (1, 1, 1, 1), (4,), "mid-way", "kv")
    bad = mismatches(reference, result.completions)
    assert len(bad) > len(reference) // 4, f"only {bad} differ"


@pytest.mark.parametrize("point", ["regroup.share", "regroup.transfer"])
def test_rank_killed_during_regroup(model_dir, reference, point):
    """Rank 3 dies inside a 1->4 regroup; the survivors fall back to TP=1 and finish every request."""
    with LocalGenerator(model_dir, 4, OPTIONS, env={"PAT_FAILPOINTS": f"{point}@3"}) as gen:
        result = run_with_regroup(gen, (1, 1, 1, 1), (4,), "mid-way", "kv")
        reports = result.regroups[0].reports
        assert sorted(r.rank for r in reports) == [0, 1, 2]
        assert {r.outcome for r in reports} == {"fallback"}
        assert all(r.dead_ranks == [3] for r in reports)
        assert gen.layout == (1, 1, 1, 1) and gen.dead == {3}
        assert gen.loads().keys() == {(0,), (1,), (2,)}
        assert sorted(result.completions) == sorted(reference)
        assert mismatches(reference, result.completions) == []
        fallback = [s for f in text_string_to_metric_families(generate_latest(gen.metrics.registry).decode())
                    for s in f.samples if s.name == "pat_generator_regroups_total"]
        assert sorted((s.labels["outcome"], s.value) for s in fallback) == [("applied", 0.0), ("fallback", 1.0)]


def test_late_rank_times_out_the_regroup(model_dir, reference):
    """Rank 3 is alive but stalls past the communicator timeout inside a 1->4 regroup: every rank falls back
    to TP=1 on its own requests (nobody is dead, so nothing changes hands) and nothing is lost."""
    options = dataclasses.replace(OPTIONS, comm_timeout=2.0)
    with LocalGenerator(model_dir, 4, options, env={"PAT_FAILPOINTS": "regroup.share@3~5"}) as gen:
        result = run_with_regroup(gen, (1, 1, 1, 1), (4,), "mid-way", "kv")
        reports = result.regroups[0].reports
        assert sorted(r.rank for r in reports) == [0, 1, 2, 3]
        assert {r.outcome for r in reports} == {"fallback"} and all(r.dead_ranks == [] for r in reports)
        assert all("timed out" in r.error for r in reports if r.rank != 3)
        assert gen.layout == (1, 1, 1, 1) and not gen.dead
        assert mismatches(reference, result.completions) == []
        # The 4-rank communicator is out of step now: refused with a clear reason; a pair still works
        # (ranks 0-1: rank 3 would stall again).
        with pytest.raises(LayoutError, match=r"communicator of ranks \(0, 1, 2, 3\) failed"):
            gen.regroup((4,))
        result = run_with_regroup(gen, (1, 1, 1, 1), (2, 1, 1), "mid-way", "kv")
        assert {(r.group, r.outcome) for r in result.regroups[0].reports} == {
            ((0, 1), "applied"), ((2,), "unchanged"), ((3,), "unchanged")}
        assert mismatches(reference, result.completions) == []


def test_bad_requests_and_plans_are_refused_with_the_reason(gen4):
    from pat_workers.engine.engine import Request

    gen4.regroup((1, 1, 1, 1))
    for prompt, message in (([], "must have 1 to"), ([5, 99999], "outside the vocabulary"),
                            (list(range(200)), "must have 1 to")):
        with pytest.raises(ValueError, match=message):
            gen4.submit([Request("bad", prompt)])
    for layout, message in (((1, 2, 1), "not aligned"), ((2, 2, 2), "covers 6 ranks"), ((3, 1), "power of two")):
        with pytest.raises(LayoutError, match=message):
            gen4.regroup(layout)
    with pytest.raises(ValueError, match="migration='fast'"):
        gen4.regroup((2, 2), migration="fast")
    assert gen4.layout == (1, 1, 1, 1) and gen4.loads() == dict.fromkeys([(0,), (1,), (2,), (3,)], 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_regroup_exactly(tmp_path, family):
    """Qwen2's sliced q/k/v biases and Qwen3's q/k norms with a decoupled head_dim, through a 1->2 merge."""
    model = make_tiny_model(tmp_path, family=family, preset="test", seed=2)
    with LocalGenerator(model, 1, OPTIONS) as gen:
        expected = gen.run(fresh(make_requests(6))).completions
    with LocalGenerator(model, 2, OPTIONS) as gen:
        result = run_with_regroup(gen, (1, 1), (2,), "mid-way", "kv", make_requests(6))
    assert [(r.old, r.new) for r in result.regroups] == [((1, 1), (2,))]
    assert mismatches(expected, result.completions) == []
