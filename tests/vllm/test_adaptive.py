"""Adaptive TP across vLLM engines in one pod (`--tp-sizes 1,2 --controller operator`): the pod runs an engine per
group of each layout (two of TP=1, one of TP=2), and an operator's plan moves the running requests between them
mid-batch: each is stopped and resubmitted on the new group's engine as its prompt plus its tokens so far."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pat_operator.autoscaler import decide
from pat_operator.prometheus import pod_metrics
from pat_workers.engine.loader import load_weights
from pat_workers.weightsync import WeightSender
from tests.generator.conftest import Reference, mismatched, rollout
from tests.unit.test_autoscale_inputs import sample, scraped

from ..procs import children
from .conftest import start_pod
from .test_pod import TOL, policy_logprobs

LONG = 250  # tokens per request (the most the model length leaves): seconds of decoding on 2 cores
# How long the pod may go without one more token before a test gives up: no fixed deadline for a batch's first
# tokens, which on a fresh machine wait on vLLM's and inductor's first compiles (and on a loaded host, on the CPU).
STALL_SECONDS = 120


@pytest.fixture(scope="module")
def adaptive_pod(vllm_model, vllm_env, tmp_path_factory):
    pod = start_pod("vllm-adaptive", vllm_model, tmp_path_factory.mktemp("logs"),
                    {"PAT_JOB_TOKEN": "test-job-token", **vllm_env}, "--tp-sizes", "1,2", "--controller", "operator")
    try:
        pod.wait_ready(timeout=400)
        yield pod
    finally:
        pod.stop()


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    return [d for c in children(pid) for d in (c, *descendants(c))]


def batch(tag: str, n: int = 4) -> list[dict]:
    """n requests of LONG sampled tokens each (ignore_eos), distinct prompts, seeded."""
    return [rollout(f"{tag}-{i}", [256, 3 + i, 17, 40 + i], LONG, temperature=1.0, seed=i) for i in range(n)]


def regroup_mid_batch(pod, tag: str, *layouts: list[int]) -> tuple[dict, list[dict]]:
    """Submits a batch (which starts in the base layout [1, 1]), plans `layouts` one after the other, each for the
    epoch the pod is at, once every request has generated some tokens (the pod's per-group
    pat_generator_running_generated_tokens), and returns the last acknowledgement and the completions."""
    requests = batch(tag)
    pod.submit(tag, requests)
    assert pod.state()["layout"] == [1, 1]
    until_generating(pod, lambda metrics: sum(v for (name, _), v in metrics.items()
                                              if name == "pat_generator_running_generated_tokens") >= 8 * len(requests))
    for layout in layouts:
        epoch = pod.state()["epoch"]
        ack = pod.ok("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": layout, "from_epoch": epoch})
    completions = pod.finish(tag)
    assert [c["id"] for c in completions] == [r["id"] for r in requests]
    return ack, completions


def until_generating(pod, done: Callable[[dict], bool]) -> None:
    """Waits until done(the pod's /metrics), as long as the pod keeps generating: it fails after STALL_SECONDS
    without a new token (in the running requests' counts, or the finished ones')."""
    counted = ("pat_generator_running_generated_tokens", "pat_generator_tokens_total")
    last, since = -1.0, time.monotonic()
    while not done(metrics := pod.metrics()):
        tokens = sum(v for (name, _), v in metrics.items() if name in counted)
        if tokens != last:
            last, since = tokens, time.monotonic()
        assert pod.proc.poll() is None, f"the pod exited {pod.proc.returncode}"
        assert time.monotonic() - since < STALL_SECONDS, f"no token in {STALL_SECONDS} s: {metrics}"
        time.sleep(0.05)


def assert_complete_and_the_policys(model, completions: list[dict], lengths: list[int] | None = None) -> None:
    """Every request has all its tokens (LONG, or `lengths`), once (no duplicates, none lost across a move), and
    each token's log-probability, from whichever engine sampled it, is the trainer's."""
    for c, i, n in zip(completions, range(len(completions)), lengths or [LONG] * len(completions)):
        assert len(c["token_ids"]) == len(c["logprobs"]) == n and c["finish_reason"] == "length", c["id"]
        prompt = [256, 3 + i, 17, 40 + i]
        expected = policy_logprobs(model, prompt + c["token_ids"])[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(c["logprobs"]), expected, atol=TOL), c["id"]


def test_a_plan_mid_batch_moves_the_running_requests_to_the_merged_engine_and_back(adaptive_pod, vllm_model):
    state = adaptive_pod.state()
    assert (state["layout"], state["epoch"], state["controller"]) == ([1, 1], 0, "operator")
    assert state["weight_receivers"] == 4  # every worker of the three engines: 2 x TP=1 + 1 x TP=2

    ack, completions = regroup_mid_batch(adaptive_pod, "merge", [2])
    assert ack["outcome"] == "applied" and ack["layout"] == [2], ack
    assert ack["requests"]["recompute"] == 4, ack  # none can have ended: 32 of their 1000 tokens were out
    assert_complete_and_the_policys(vllm_model, completions)
    state = adaptive_pod.state()
    assert (state["layout"], state["epoch"]) == ([2], 1)
    assert [g["ranks"] for g in state["groups"]] == [[0, 1]]
    metrics = adaptive_pod.metrics()
    assert metrics[("pat_generator_regroups_total", (("outcome", "applied"),))] == 1
    assert metrics[("pat_generator_regroup_requests_total", (("mode", "recompute"),))] == 4
    assert metrics[("pat_generator_layout_epoch", ())] == 1

    # The next batch starts at [1, 1] again (epoch 2); a split deals the TP=2 engine's requests over the two TP=1
    # engines.
    ack, completions = regroup_mid_batch(adaptive_pod, "split", [2], [1, 1])
    assert ack["outcome"] == "applied" and ack["applied_epoch"] == 4 and ack["requests"]["recompute"] == 4, ack
    assert_complete_and_the_policys(vllm_model, completions)
    # A plan made for another epoch is refused, and a retry of the last one is acknowledged again.
    status, reply = adaptive_pod.call("POST", "/v1/regroup", {"epoch": 5, "layout": [2], "from_epoch": 3})
    assert status == 409 and "from_epoch" in reply["error"], reply
    assert adaptive_pod.ok("POST", "/v1/regroup", {"epoch": 4, "layout": [1, 1]}) == ack
    status, reply = adaptive_pod.call("POST", "/v1/regroup", {"epoch": 5, "layout": [4]})
    assert status == 422 and "layout" in reply["error"], reply


def test_the_pod_exports_what_the_operators_planner_needs(adaptive_pod):
    """The start-up profile of both TP sizes, the re-prefill cost of a move (no KV moves: infinite per token) and
    the open batch's groups, read as the operator reads them from Prometheus, make a plan: during a batch of long
    requests on this CPU (where a TP=2 engine outruns two TP=1 engines at every batch size), a merge."""
    requests = batch("plan")
    adaptive_pod.submit("plan", requests)
    try:
        def exported(metrics: dict) -> bool:
            nonlocal m
            series = [sample(name, value, "p", **dict(labels)) for (name, labels), value in metrics.items()]
            m = pod_metrics(series, scraped("p"), max_age=5)[0]["p"]
            return m.unfinished == 4 and all(generated >= 8 for g in m.running.values() for _, generated in g)

        m = None
        until_generating(adaptive_pod, exported)
        assert m.layout == (1, 1) and m.batch_open and m.max_tokens == LONG and m.unfinished == 4
        assert m.profile.tp_sizes == [1, 2] and m.costs.kv_seconds_per_token == math.inf
        for tp in (1, 2):
            steps = [m.profile.step_seconds(tp, b) for b in (1, 4, 16)]
            assert 0 < steps[0] <= steps[-1] < 1, (tp, steps)
            seconds, per_token = m.costs.prefill[tp]
            assert 0 <= seconds < 1 and 0 <= per_token < 0.01, m.costs
        decision = decide(m, [1, 2], margin=0.1)
        if m.profile.step_seconds(2, 4) < 0.8 * m.profile.step_seconds(1, 2):
            assert decision.layout == (2,), decision.reason
        # The negative control: without TP=2 among the sizes a plan may use, nothing to merge into.
        assert decide(m, [1], margin=0.1).layout is None
    finally:
        adaptive_pod.finish("plan")


def test_weights_reach_every_engine_of_every_layout(adaptive_pod, vllm_model):
    """Every worker of the three engines is a member of the weight-sync group (4 of them, each TP=2 worker after the
    TP=1 engines'): after one round both layouts generate what the new weights give (greedy, against this project's
    engine), which before it they did not."""
    old = load_weights(vllm_model, torch.float32)
    g = torch.Generator().manual_seed(11)
    new = {name: w + 0.5 * w.std() * torch.randn(w.shape, generator=g) for name, w in old.items()}
    requests = [rollout(f"w-{i}", [256, 9 + i, 33], 32) for i in range(2)]
    reference = Reference(vllm_model, new)(requests)
    state = adaptive_pod.state()
    version, world = state["policy_version"], 1 + state["weight_receivers"]
    assert mismatched(adaptive_pod.generate("w-before", requests, version), reference, TOL) == ["w-0", "w-1"]
    sender = WeightSender("127.0.0.1:0", world=world)
    try:
        send(adaptive_pod, sender, new, version + 1)
        for layout in ([1, 1], [2]):  # a batch starts at [1, 1]; a plan moves it to TP=2 at its first tokens
            adaptive_pod.submit(f"w-tp{max(layout)}", requests, version + 1)
            if layout == [2]:
                epoch = adaptive_pod.state()["epoch"]
                ack = adaptive_pod.ok("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": layout})
                assert ack["outcome"] == "applied", ack
            done = adaptive_pod.finish(f"w-tp{max(layout)}")
            assert not mismatched(done, reference, TOL), (layout, done)
        send(adaptive_pod, sender, old, version + 2)  # the model's own again, for the tests after this one
    finally:
        sender.close()


def send(pod, sender: WeightSender, weights: dict[str, torch.Tensor], version: int) -> None:
    pod.ok("POST", "/v1/weights", {"version": version, "address": sender.address, "world": sender.world,
                                   "rank_offset": 1}, 202)
    sender.send({n: w.shape for n, w in weights.items()}, iter(sorted(weights.items())), version)
    deadline = time.monotonic() + 60
    while pod.state()["policy_version"] != version:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_move_to_an_engine_that_died_falls_back_and_loses_no_request(adaptive_pod, vllm_model):
    """The TP=2 engine is killed (SIGKILL, with its workers): the pod keeps serving on the TP=1 engines it uses, a
    plan that needs the dead engine falls back before moving anything, and the batch completes where it was."""
    tp2 = [pid for pid in children(adaptive_pod.proc.pid) if
           "--tensor-parallel-size" in argv(pid) and argv(pid)[argv(pid).index("--tensor-parallel-size") + 1] == "2"]
    assert len(tp2) == 1
    for pid in [tp2[0], *descendants(tp2[0])]:
        os.kill(pid, signal.SIGKILL)
    ack, completions = regroup_mid_batch(adaptive_pod, "dead", [2])
    assert ack["outcome"] == "fallback" and ack["layout"] == [1, 1] and not ack["requests"], ack
    assert "ranks [[0, 1]]" in ack["error"], ack
    assert_complete_and_the_policys(vllm_model, completions)
    assert adaptive_pod.call("GET", "/healthz")[0] == 200


# A decode profile in which a TP=2 engine wins with one sequence and loses with more (as on a GPU), so that the pod's
# planner starts a batch of several on the TP=1 engines and merges its tail: the decisions follow from it, whatever
# this CPU's own step times.
TAIL_PROFILE = {"decode": {"1": {"1": 0.010, "4": 0.011, "16": 0.014}, "2": {"1": 0.006, "4": 0.0125, "16": 0.03}},
                "decode_context": 24, "kv_seconds": {"1": 0.0, "2": 0.0}}


@pytest.fixture(scope="module")
def planning_pod(vllm_model, vllm_env, tmp_path_factory):
    """A vLLM pod that plans its own regroups (controller pod) from TAIL_PROFILE."""
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.write_text(json.dumps(TAIL_PROFILE))
    pod = start_pod("vllm-planning", vllm_model, tmp_path_factory.mktemp("logs"),
                    {"PAT_JOB_TOKEN": "test-job-token", **vllm_env}, "--tp-sizes", "1,2", "--profile", str(profile))
    try:
        pod.wait_ready(timeout=400)
        yield pod
    finally:
        pod.stop()


def test_the_pod_starts_a_batch_in_the_layout_predicted_fastest_and_merges_its_tail(planning_pod, vllm_model):
    """Four requests, one long: they start on the two TP=1 engines (two each decode faster there); once short ones
    end, the pod moves what still runs to the TP=2 engine. A batch of one request starts on TP=2 at once.
    Every request keeps its tokens and the policy's log-probabilities; an operator's plan is refused."""
    state = planning_pod.state()
    assert (state["layout"], state["controller"]) == ([1, 1], "pod")
    requests = [rollout(f"tail-{i}", [256, 3 + i, 17, 40 + i], LONG if i == 0 else 16, temperature=1.0, seed=i)
                for i in range(4)]
    planning_pod.submit("tail", requests)
    assert planning_pod.state()["layout"] == [1, 1]
    completions = planning_pod.finish("tail")
    assert [len(c["token_ids"]) for c in completions] == [LONG, 16, 16, 16]
    assert_complete_and_the_policys(vllm_model, completions[:1], [LONG])
    state, metrics = planning_pod.state(), planning_pod.metrics()
    assert state["layout"] == [2], state  # the tail's merge, kept until the next batch
    assert metrics[("pat_generator_regroups_total", (("outcome", "applied"),))] == 1
    # Moved: those still running once the plan paid, the long one among them, not all four (the first short one
    # to end lets it pay; how many others are left then depends on this CPU's speed).
    assert 1 <= metrics[("pat_generator_regroup_requests_total", (("mode", "recompute"),))] <= 3

    planning_pod.submit("one", requests[:1])
    assert planning_pod.state()["layout"] == [2]  # predicted fastest for a lone sequence, from its start
    (done,) = planning_pod.finish("one")
    assert len(done["token_ids"]) == LONG
    status, reply = planning_pod.call("POST", "/v1/regroup", {"epoch": 99, "layout": [1, 1]})
    assert status == 409 and "plans its own regroups" in reply["error"], reply
