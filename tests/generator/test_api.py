"""The pod's HTTP API: authentication, rollouts equal to a single-process reference, and rejections that name
the field or the conflict and change nothing."""

from .conftest import TOKEN, long_tailed, mismatched, rollout

PROTECTED = [("POST", "/v1/rollouts"), ("GET", "/v1/rollouts/any"), ("POST", "/v1/regroup"),
             ("POST", "/v1/weights"), ("GET", "/v1/state")]


def test_token_is_required_except_on_probes_and_metrics(pods):
    for pod in pods.values():
        for method, path in PROTECTED:
            for token in (None, "wrong-token", TOKEN + "x", ""):
                status, reply = pod.call(method, path, {}, token=token)
                assert status == 401 and "Bearer" in reply["error"], (pod.name, method, path, token, reply)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert pod.call("GET", path, token=None)[0] == 200, path
        assert pod.state()["controller"] == ("operator" if pod.name == "operator" else "pod")


def test_rollouts_equal_the_reference(operator_pod, reference):
    pod = operator_pod
    probe = rollout("probe", "stop here", 12, ignore_eos=False)
    stop_token = reference([probe])["probe"].output[3]
    requests = long_tailed(6, long=40, tag="eq") + [
        {**probe, "id": "stops", "sampling": {**probe["sampling"], "stop_token_ids": [stop_token]}},
        rollout("sampled", [256, 5, 6, 7], 20, temperature=0.9, top_p=0.95, top_k=50, seed=7),
        rollout("sampled-text", "sampled text", 20, temperature=1.2, seed=8),
    ]
    version = pod.state()["policy_version"]
    completions = pod.generate("equal", requests, version)
    want = reference(requests)
    assert mismatched(completions, want) == []
    by_id = {c["id"]: c for c in completions}
    assert by_id["stops"]["finish_reason"] == "stop" and by_id["stops"]["token_ids"][-1] == stop_token
    assert {c["finish_reason"] for c in completions if c["id"] != "stops"} == {"length"}
    assert all(c["policy_version"] == version for c in completions)
    assert by_id["eq-0"]["text"] == reference.tokenizer.decode(want["eq-0"].output)
    state = pod.state()
    assert state["batch_id"] == "equal" and state["batch_done"]


def test_rejections_name_the_problem_and_leave_the_running_batch_alone(operator_pod, reference):
    pod = operator_pod
    before = pod.state()
    version = before["policy_version"]
    requests = long_tailed(8, long=400, tag="busy")
    pod.submit("busy", requests, version)
    good = {"batch_id": "other", "policy_version": version, "requests": [rollout("x", [256, 1], 4)]}
    cases = [
        ("POST", "/v1/rollouts", b"{not json", 422, "body: Invalid JSON"),
        ("POST", "/v1/rollouts", {"policy_version": version, "requests": good["requests"]}, 422,
         "batch_id: Field required"),
        ("POST", "/v1/rollouts", {**good, "requests": [rollout("t", "hi", 4, temperature=-1)]}, 422,
         "requests.0.sampling.temperature: Input should be greater than or equal to 0"),
        ("POST", "/v1/rollouts", {**good, "requests": [{"id": "both", "prompt": "a", "prompt_token_ids": [1]}]},
         422, "requests.0: Value error, set exactly one of prompt (text) or prompt_token_ids"),
        # An unknown field is ignored (a newer operator's: podapi's version skew), so the batch is refused as a batch.
        ("POST", "/v1/rollouts", {**good, "requests": [rollout("typo", [1], 4, temprature=1)]}, 409,
         "batch 'busy' is generating"),
        # A request that can never be generated is refused as such while the batch runs: waiting would not help.
        ("POST", "/v1/rollouts", {**good, "requests": [rollout("ok", [256, 1], 4), rollout("far", [256, 320], 4)]},
         422, "request far: prompt token id 320 is outside the vocabulary (0..319)"),
        ("POST", "/v1/rollouts", {**good, "requests": [rollout("ok", [256, 1], 4), rollout("long", [1] * 512, 4)]},
         422, "request long: prompt has 512 tokens; it must have 1 to 511"),
        ("POST", "/v1/rollouts", {**good, "requests": [rollout("longer", [1] * 600, 4)]}, 422,
         "request longer: prompt has 600 tokens"),
        ("POST", "/v1/rollouts", good, 409, "batch 'busy' is generating"),
        # The same ids again (a resent batch): the running batch's conflict, not the engine's refusal of the ids.
        ("POST", "/v1/rollouts", {**good, "requests": requests}, 409, "batch 'busy' is generating"),
        ("POST", "/v1/weights", {"version": version + 1, "address": "127.0.0.1:1", "world": 3, "rank_offset": 1},
         409, "batch 'busy' is generating"),
        ("POST", "/v1/weights", {"version": version + 1, "address": "127.0.0.1:1", "world": 1, "rank_offset": 1},
         422, "world: Input should be greater than or equal to 2"),
        ("POST", "/v1/regroup", {"epoch": before["epoch"] + 1, "layout": [3]}, 422,
         "layout: layout (3,) covers 3 ranks; the pod has 2"),
        ("POST", "/v1/regroup", {"epoch": 0, "layout": [2]}, 422,
         "epoch: Input should be greater than or equal to 1"),
        ("GET", "/v1/rollouts/nope", None, 404, "batch 'nope' is unknown"),
        ("GET", "/v1/rollouts/busy?wait=soon", None, 422, "wait: 'soon' is not a number of seconds"),
    ]
    for method, path, body, status, message in cases:
        got, reply = pod.call(method, path, raw=body) if isinstance(body, bytes) else pod.call(method, path, body)
        assert (got, message in reply.get("error", "")) == (status, True), (path, body, got, reply)
    during = pod.state()
    assert not during["batch_done"] and during["batch_id"] == "busy", "the batch ended before the last rejection"
    assert (during["layout"], during["epoch"], during["policy_version"]) == (
        before["layout"], before["epoch"], before["policy_version"])
    completions = pod.finish("busy")
    assert [c["id"] for c in completions] == [r["id"] for r in requests]  # every request, none of the refused
    assert mismatched(completions, reference(requests)) == []
    # Idle, the same refusal: whole, nothing generated for any request of the batch.
    got, reply = pod.call("POST", "/v1/rollouts", {**good, "requests": [rollout("ok", [256, 1], 4),
                                                                        rollout("far", [256, 320], 4)]})
    assert got == 422 and "prompt token id 320 is outside the vocabulary" in reply["error"], reply
    got, reply = pod.call("POST", "/v1/rollouts", {**good, "requests": [rollout("d", [1], 4), rollout("d", [2], 4)]})
    assert got == 422 and "requests.1.id: 'd' repeats requests.0.id" in reply["error"], reply
    got, reply = pod.call("POST", "/v1/rollouts", {**good, "policy_version": version + 1})
    assert got == 409 and f"the pod holds version {version}" in reply["error"], reply
    assert pod.call("GET", "/v1/rollouts/other")[0] == 404
    assert pod.state()["batch_id"] == "busy"


def test_long_poll_returns_when_the_batch_is_done(operator_pod):
    pod = operator_pod
    pod.submit("poll", [rollout("p", [256, 9], 30)])
    status, reply = pod.call("GET", "/v1/rollouts/poll?wait=30")
    assert status == 200 and reply["done"] and reply["finished"] == reply["total"] == 1
    assert len(reply["completions"][0]["token_ids"]) == 30
    metrics = pod.metrics()
    assert metrics[("pat_generator_batches_total", ())] >= 1
    running = [v for (name, _), v in metrics.items() if name == "pat_generator_requests_running"]
    assert running and sum(running) == 0
