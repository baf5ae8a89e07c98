"""Regroups of a pod over HTTP: plans from the operator (controller=operator) and the pod's own planner
(controller=pod) merging in the tail of a long-tailed batch; outputs equal the single-process reference."""

import re
import time

from .conftest import long_tailed, mismatched


def _applied_regroups(pod) -> float:
    return pod.metrics().get(("pat_generator_regroups_total", (("outcome", "applied"),)), 0.0)


def test_operator_plan_applies_mid_batch(operator_pod, reference):
    pod = operator_pod
    epoch = pod.state()["epoch"] + 1  # start the batch at 2 x TP1, whatever an earlier test left
    assert pod.ok("POST", "/v1/regroup", {"epoch": epoch, "layout": [1, 1]})["layout"] == [1, 1]
    requests = long_tailed(8, long=200, tag="op")
    tokens = pod.metrics()[("pat_generator_tokens_total", ())]
    pod.submit("op", requests)
    while pod.metrics()[("pat_generator_tokens_total", ())] < tokens + 20:  # both replicas are decoding
        time.sleep(0.005)
    ack = pod.ok("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": [2], "from_epoch": epoch})
    assert {k: ack[k] for k in ("applied_epoch", "layout", "outcome", "error")} == {
        "applied_epoch": epoch + 1, "layout": [2], "outcome": "applied", "error": None}
    assert 0 < sum(ack["requests"].values()) <= 8 and ack["seconds"] > 0  # the decoding ones moved (KV or recompute)
    state = pod.state()
    assert (state["layout"], state["epoch"], state["groups"][0]["ranks"], state["groups"][0]["tp"]) == (
        [2], epoch + 1, [0, 1], 2)
    assert not state["batch_done"], "the batch ended before the regroup: make it longer"
    assert mismatched(pod.finish("op"), reference(requests)) == []
    assert pod.ok("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": [2]}) == ack  # a retry is acknowledged
    assert pod.ok("POST", "/v1/regroup", {"epoch": epoch + 1, "layout": [1, 1]}) == ack  # ... whatever it says
    status, reply = pod.call("POST", "/v1/regroup", {"epoch": epoch, "layout": [1, 1]})
    assert status == 409 and f"not newer than the applied epoch {epoch + 1}" in reply["error"], reply
    # A plan made for an epoch the pod has left (e.g. the last batch's tail) is refused, not applied.
    status, reply = pod.call("POST", "/v1/regroup", {"epoch": epoch + 2, "layout": [1, 1], "from_epoch": epoch})
    assert status == 409 and f"made for epoch {epoch}, the pod is at epoch {epoch + 1}" in reply["error"], reply
    assert pod.state()["layout"] == [2]
    metrics = pod.metrics()
    assert metrics[("pat_generator_layout_epoch", ())] == epoch + 1
    assert metrics[("pat_generator_tp_size", (("group", "0-1"),))] == 2


def test_pod_mode_refuses_plans(planning_pod):
    before = planning_pod.state()
    status, reply = planning_pod.call("POST", "/v1/regroup", {"epoch": before["epoch"] + 1, "layout": [2]})
    assert status == 409 and "adaptiveTP.controller" in reply["error"], reply
    assert planning_pod.state()["epoch"] == before["epoch"]


def test_a_fixed_layout_generates_every_batch_in_its_groups_and_refuses_plans(fixed_pod, reference):
    pod = fixed_pod
    assert (pod.state()["layout"], pod.state()["epoch"]) == ([2], 0)
    for batch in ("fixed-0", "fixed-1"):
        requests = long_tailed(6, long=60, tag=batch)
        pod.submit(batch, requests)
        seen = set()
        while not (state := pod.state())["batch_done"]:
            seen.add(tuple(state["layout"]))
        assert seen <= {(2,)} and mismatched(pod.finish(batch), reference(requests)) == []
    status, reply = pod.call("POST", "/v1/regroup", {"epoch": 1, "layout": [1, 1]})
    assert status == 409 and "fixed layout [2] (generator.tensorParallelSize=2" in reply["error"], reply
    state = pod.state()
    assert (state["layout"], state["epoch"], state["groups"][0]["tp"]) == ([2], 0, 2)
    assert pod.metrics()[("pat_generator_tp_size", (("group", "0-1"),))] == 2


def test_a_fixed_layout_is_refused_where_the_pod_plans_or_the_ranks_do_not_split(model_dir, capsys, monkeypatch):
    from pat_workers.generator.__main__ import main as generator

    monkeypatch.setenv("PAT_JOB_TOKEN", "token")
    args = ["--model", str(model_dir), "--ranks", "2", "--device", "cpu", "--tensor-parallel-size"]
    assert generator([*args, "2", "--controller", "pod"]) == 2
    assert "--tensor-parallel-size=2 is a fixed layout: the pod plans no regroups; use --controller operator" in \
        capsys.readouterr().err
    assert generator([*args, "4", "--controller", "operator"]) == 2
    assert "--tensor-parallel-size=4 must be a power of two dividing --ranks=2" in capsys.readouterr().err


def _batches_logged(pod, tag: str, batches: int, requests) -> list[list[str]]:
    """Runs `batches` batches one after the other; per batch, the regroup and guard lines of the pod's log."""
    lines = []
    for i in range(batches):
        seen = len(pod.log.read_text().splitlines())
        payloads = [{**r, "id": f"{r['id']}-{i}"} for r in requests]
        pod.submit(f"{tag}-{i}", payloads)
        completions = pod.finish(f"{tag}-{i}")
        assert mismatched(completions, {f"{k}-{i}": v for k, v in requests.reference.items()}) == []
        lines.append([line for line in pod.log.read_text().splitlines()[seen:]
                      if "regroup (" in line or "guard:" in line])
    return lines


def test_guard_stops_merging_on_a_profile_that_lies(guarded_pod, reference):
    """TAIL_PROFILE says TP2 is 10x faster for the last sequence; it is not. The first tail merges on its word,
    the guard measures the merged steps and splits back in the same batch; the next batch does not merge. The
    correction is doubted: the batch after that tries TP2 again, and the guard judges it again (lost if it ends
    with one sequence, the one batch size the profile lies about)."""
    requests = Batch(long_tailed(8, long=200, tag="guard"), reference)
    per_batch = _batches_logged(guarded_pod, "guard", 3, requests)
    first, second, third = per_batch
    merged = [i for i, line in enumerate(first) if "regroup (1, 1) -> (2,)" in line and "merge" in line]
    assert len(merged) == 1, per_batch
    assert any("guard: 1+1->2 lost" in line for line in first[merged[0]:]), per_batch
    assert any("regroup (2,) -> (1, 1)" in line and "split back" in line for line in first[merged[0]:]), per_batch
    assert not [line for line in second if "merge (1, 1)" in line], per_batch
    assert "merge (1, 1)->(2,)" in third[0] and "guard: 1+1->2" in third[1], per_batch
    assert guarded_pod.metrics()[("pat_generator_guard_verdicts_total", (("verdict", "lost"),))] >= 1


def test_guard_off_keeps_merging_on_a_profile_that_lies(planning_pod, reference):
    """The negative control: the same profile and batches with the guard off merge in every tail."""
    requests = Batch(long_tailed(8, long=200, tag="trusting"), reference)
    per_batch = _batches_logged(planning_pod, "trusting", 3, requests)
    assert all(any("merge (1, 1)->(2,)" in line for line in b) for b in per_batch), per_batch
    assert not [line for b in per_batch for line in b if "guard:" in line], per_batch


class Batch(list):
    """Rollout payloads with what the single-process reference generates for them."""

    def __init__(self, payloads, reference):
        super().__init__(payloads)
        self.reference = reference(payloads)


def test_pod_mode_merges_in_the_tail(planning_pod, reference):
    """TAIL_PROFILE makes 2 x TP1 the better start for 8 sequences and TP2 10x faster for the last one."""
    pod = planning_pod
    before = _applied_regroups(pod)
    requests = long_tailed(8, long=480, tag="tail")  # a tail long enough that a loaded machine still merges in it
    pod.submit("tail", requests)
    assert pod.state()["layout"] == [1, 1], "the planner should start this batch at 2 x TP1"
    completions = pod.finish("tail")
    assert mismatched(completions, reference(requests)) == []
    state = pod.state()
    assert state["layout"] == [2] and state["groups"] == [{"ranks": [0, 1], "tp": 2, "running": 0, "waiting": 0}]
    assert _applied_regroups(pod) > before
    merges = [line for line in pod.log.read_text().splitlines() if "regroup (1, 1) -> (2,)" in line]
    assert merges and "merge (1, 1)->(2,)" in merges[-1], merges
    unfinished = int(re.search(r"with (\d+) request\(s\) unfinished", merges[-1]).group(1))
    assert unfinished <= len(requests) // 4, f"not in the tail: {merges[-1]}"
