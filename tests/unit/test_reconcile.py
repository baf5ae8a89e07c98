"""The RLHFJob state machine (pure): each rule, step by step, with the time and the pods given by hand."""

from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from pat_operator import api, builders
from pat_operator.api import parse_job
from pat_operator.reconcile import (SPEC_HASH_PREFIX, Observed, PodView, Settings, classify, decide, needs_write,
                                     pod_view, restart_backoff)

EXAMPLE = Path(__file__).parents[2] / "examples" / "local.yaml"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SETTINGS = Settings(restart_backoff_seconds=10, restart_backoff_max_seconds=60)
KEY = b"k" * 16


def body(**run_policy) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["placement"] = "separate"  # trainer and generator pods (colocated: test_colocated_*)
    doc["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    doc["spec"]["generator"]["replicas"] = 2
    doc["spec"]["runPolicy"].update(run_policy)
    return doc


def pods_of(decision, phase="Running", ready=True) -> list[PodView]:
    return [pod_view({**p, "spec": {**p["spec"], "nodeName": "n1"},
                      "status": {"phase": phase, "podIP": "127.0.0.9",
                                 "conditions": [{"type": "Ready", "status": str(ready)}],
                                 "containerStatuses": [{"name": "x", "state": {"running": {}}}]}})
            for p in decision.create_pods]


def slots(names) -> list[str]:
    """Pod names without their per-attempt suffix: <job>-<role>-<index>."""
    return [n.rsplit("-", 1)[0] for n in names]


def created(d) -> list[str]:
    return slots(p["metadata"]["name"] for p in d.create_pods)


def step(doc: dict, pods: list[PodView], t: datetime, **kw):
    d = decide(Observed(doc, pods, t, KEY, **kw), SETTINGS)
    doc["status"] = d.status  # as if the status patch were applied
    return d


def reasons(d) -> list[str]:
    return [e.reason for e in d.events]


def cond(d, kind: str) -> dict:
    return next(c for c in d.status["conditions"] if c["type"] == kind)


def test_creates_the_gang_then_runs_when_all_are_ready():
    doc = body()
    d = step(doc, [], T0)
    assert created(d) == ["arithmetic-grpo-trainer-0", "arithmetic-grpo-generator-0", "arithmetic-grpo-generator-1"]
    assert {m["kind"] for m in d.ensure} == {"ConfigMap", "Secret", "Service"}
    assert d.status["phase"] == "Pending" and d.status["startTime"] == "2026-01-01T00:00:00Z"
    pods = pods_of(d, ready=False)
    d = step(doc, pods, T0 + timedelta(seconds=1))
    assert d.create_pods == [] and d.status["phase"] == "Pending"
    assert cond(d, "Running")["message"] == "0 of 3 pods ready"
    d = step(doc, pods_of(decide(Observed(body(), [], T0, KEY)))[:2] + pods[2:], T0 + timedelta(seconds=2))
    assert cond(d, "Running")["message"] == "2 of 3 pods ready"
    d = step(doc, pods_of(decide(Observed(body(), [], T0, KEY))), T0 + timedelta(seconds=3), iteration=4)
    assert d.status["phase"] == "Running" and d.status["iteration"] == 4 and "Running" in reasons(d)
    # Level-based: the same observation again changes nothing and posts nothing.
    again = step(doc, pods_of(decide(Observed(body(), [], T0, KEY))), T0 + timedelta(seconds=4), iteration=4)
    assert again.status == d.status and again.events == [] and again.create_pods == []


def test_a_failed_pod_restarts_the_whole_gang_after_a_backoff_then_fails_past_the_limit():
    doc = body(backoffLimit=1)
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    failed = gang[0].__class__(**{**gang[0].__dict__, "phase": "Failed", "ready": False,
                                  "failure": "container trainer exited with code 137"})
    d = step(doc, [failed, *gang[1:]], T0 + timedelta(seconds=5))
    assert d.status["restarts"] == 1 and d.status["phase"] == "Restarting"
    assert sorted(d.delete_pods) == sorted(p.name for p in gang) and "GangRestart" in reasons(d)
    assert "exited with code 137" in cond(d, "Restarting")["message"]
    # The old attempt's pods still exist (terminating): nothing new yet.
    deleting = [p.__class__(**{**p.__dict__, "deletion": T0 + timedelta(seconds=35)}) for p in gang]
    d = step(doc, deleting, T0 + timedelta(seconds=6))
    assert d.create_pods == [] and d.delete_pods == []
    # Gone, but the backoff (10 s after the restart) has not passed.
    d = step(doc, [], T0 + timedelta(seconds=8))
    assert d.create_pods == [] and 6.9 < d.wake_after <= 7.0
    d = step(doc, [], T0 + timedelta(seconds=15))
    assert {p["metadata"]["labels"][builders.LABEL_ATTEMPT] for p in d.create_pods} == {"1"}
    second = pods_of(d)
    d = step(doc, second, T0 + timedelta(seconds=16))
    assert d.status["phase"] == "Running" and cond(d, "Restarting")["status"] == "False"
    # A pod deleted from under the running gang is a failure too; this one exceeds backoffLimit=1.
    d = step(doc, second[1:], T0 + timedelta(seconds=20))
    assert d.status["phase"] == "Failed" and cond(d, "Failed")["reason"] == "BackoffLimitExceeded"
    assert "gone: it was deleted" in cond(d, "Failed")["message"] and d.status["completionTime"]
    # Sticky: with every pod gone, nothing is created again.
    for t in (30, 3600):
        d = step(doc, [], T0 + timedelta(seconds=t))
        assert d.create_pods == [] and d.ensure == [] and d.status["phase"] == "Failed"


def test_a_pod_stuck_terminating_past_the_timeout_is_force_deleted_and_the_next_attempt_starts():
    doc = body(podDeletionTimeoutSeconds=120)
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    d = step(doc, gang[1:], T0 + timedelta(seconds=5))  # the trainer was evicted from a lost node
    assert d.status["restarts"] == 1
    # Its deletion (grace period over at T0 + 35 s) is never confirmed: no kubelet on that node.
    stuck = [p.__class__(**{**p.__dict__, "deletion": T0 + timedelta(seconds=35)}) for p in gang]
    d = step(doc, stuck, T0 + timedelta(seconds=60))
    assert d.force_delete_pods == [] and d.wake_after == 1.0  # the restart polls; the timeout (95 s away) is later
    d = step(doc, stuck[:1], T0 + timedelta(seconds=35 + 119))
    assert d.force_delete_pods == [] and d.create_pods == []
    d = step(doc, stuck[:1], T0 + timedelta(seconds=35 + 120))
    assert d.force_delete_pods == [stuck[0].name] and d.create_pods == [] and "PodForceDeleted" not in reasons(d)
    # Seen again before it is gone (the watch lags): the delete is repeated (a 404 if it took), nothing posted.
    d = step(doc, stuck[:1], T0 + timedelta(seconds=35 + 120.5))
    assert d.force_delete_pods == [stuck[0].name] and d.events == [] and d.create_pods == []
    d = step(doc, [], T0 + timedelta(seconds=35 + 121))
    assert {p["metadata"]["labels"][builders.LABEL_ATTEMPT] for p in d.create_pods} == {"1"}
    # Gone: PodForceDeleted, once.
    assert [e.message for e in d.events if e.reason == "PodForceDeleted"] == [
        f"pod {stuck[0].name} was still Terminating 120 s after its grace period ended (runPolicy."
        "podDeletionTimeoutSeconds=120): its node is likely lost; force-deleted from the API server, its processes "
        "may still run there until the node is back"]
    assert "PodForceDeleted" not in reasons(step(doc, [], T0 + timedelta(seconds=35 + 122)))


def test_a_finalizer_that_holds_a_force_deleted_pod_is_reported_once_and_the_next_attempt_starts():
    doc = body(podDeletionTimeoutSeconds=60)
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    d = step(doc, gang[1:], T0 + timedelta(seconds=5))  # the trainer's node is lost
    stuck = [p.__class__(**{**p.__dict__, "deletion": T0 + timedelta(seconds=30)}) for p in gang[:1]]
    d = step(doc, stuck, T0 + timedelta(seconds=100))
    assert d.force_delete_pods == [stuck[0].name] and d.create_pods == []
    held = [p.__class__(**{**p.__dict__, "finalizers": ("kueue.x-k8s.io/managed",)}) for p in stuck]
    d = step(doc, held, T0 + timedelta(seconds=101))
    assert reasons(d) == ["PodHeldByFinalizer"] and "kueue.x-k8s.io/managed" in d.events[0].message
    assert d.force_delete_pods == [] and {p["metadata"]["labels"][builders.LABEL_ATTEMPT] for p in d.create_pods} \
        == {"1"}  # the next attempt's pods have their own names: the held pod does not block them
    d = step(doc, held, T0 + timedelta(seconds=102))
    assert d.events == [] and d.force_delete_pods == []  # reported once, not fought
    # Negative control: without the finalizer a pod seen again is force-deleted again (the last call did not take).
    doc["status"]["forceDeleted"][0]["held"] = False
    assert step(doc, stuck, T0 + timedelta(seconds=103)).force_delete_pods == [stuck[0].name]


def test_the_wake_up_comes_when_a_terminating_pod_is_due():
    doc = body(podDeletionTimeoutSeconds=60)
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    doc["spec"]["runPolicy"]["suspend"] = True
    step(doc, gang, T0 + timedelta(seconds=1))
    doc["status"]["phase"] = "Failed"  # terminal: nothing else wakes the job
    doc["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "X", "message": "x",
                                        "lastTransitionTime": "2026-01-01T00:00:01Z"})
    stuck = [gang[0].__class__(**{**gang[0].__dict__, "deletion": T0 + timedelta(seconds=31)})]
    d = step(doc, stuck, T0 + timedelta(seconds=41))
    assert d.wake_after == 50 and d.force_delete_pods == []


def test_backoff_doubles_up_to_the_cap():
    assert [restart_backoff(n, SETTINGS) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


def test_success_when_the_trainers_exit_zero_deletes_the_generators_and_ttl_deletes_the_job():
    doc = body(ttlSecondsAfterFinished=30)
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    done = [p.__class__(**{**p.__dict__, "phase": "Succeeded", "ready": False}) if p.role == "trainer" else p
            for p in gang]
    d = step(doc, done, T0 + timedelta(seconds=10))
    assert d.status["phase"] == "Succeeded" and "Succeeded" in reasons(d)
    assert sorted(slots(d.delete_pods)) == ["arithmetic-grpo-generator-0", "arithmetic-grpo-generator-1"]
    d = step(doc, done[:1], T0 + timedelta(seconds=20))
    assert d.create_pods == [] and not d.delete_job and d.wake_after == 20
    d = step(doc, done[:1], T0 + timedelta(seconds=40))
    assert d.delete_job and "TTLExpired" in reasons(d) and d.status["phase"] == "Succeeded"


def test_suspend_deletes_the_pods_keeps_the_status_and_resume_waits_for_them_to_go():
    doc = body()
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0, iteration=3)
    doc["spec"]["runPolicy"]["suspend"] = True
    d = step(doc, gang, T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Suspended" and sorted(d.delete_pods) == sorted(p.name for p in gang)
    assert d.status["iteration"] == 3 and d.status["restarts"] == 0
    d = step(doc, [], T0 + timedelta(seconds=6))
    assert d.create_pods == [] and d.status["phase"] == "Suspended"
    doc["spec"]["runPolicy"]["suspend"] = False
    d = step(doc, gang[:1], T0 + timedelta(seconds=7))  # one still terminating
    assert d.create_pods == [] and d.status["phase"] == "Suspended"
    d = step(doc, [], T0 + timedelta(seconds=8))
    assert len(d.create_pods) == 3 and "Resumed" in reasons(d) and d.status["restarts"] == 0
    assert d.status["startTime"] == "2026-01-01T00:00:08Z"  # the deadline counts from the resume


def test_active_deadline_fails_the_job():
    doc = body(activeDeadlineSeconds=60)
    gang = pods_of(step(doc, [], T0))
    d = step(doc, gang, T0 + timedelta(seconds=30))
    assert d.wake_after == 30 and d.status["phase"] == "Running"
    d = step(doc, gang, T0 + timedelta(seconds=61))
    assert d.status["phase"] == "Failed" and cond(d, "Failed")["reason"] == "DeadlineExceeded"
    assert sorted(d.delete_pods) == sorted(p.name for p in gang)


def test_an_invalid_spec_fails_naming_the_field_and_creates_nothing():
    doc = body()
    doc["spec"]["generator"]["adaptiveTP"]["tpSizes"] = [1, 3]
    d = step(doc, [], T0)
    assert d.create_pods == [] and d.ensure == [] and d.status["phase"] == "Failed"
    assert cond(d, "Failed")["reason"] == "InvalidSpec" and "tpSizes" in cond(d, "Failed")["message"]
    # Negative control: the same job, valid, creates its pods.
    assert len(decide(Observed(body(), [], T0, KEY)).create_pods) == 3


def test_a_tiny_model_too_large_for_its_gpus_fails_naming_the_field_and_creates_nothing():
    """The operator knows a tiny preset's shape and the GPU of a nodeSelector: Llama-3.1-8B's shape with AdamW
    does not fit one 80 GB GPU (pat_operator.fit)."""
    def job(trainer_gpus: int) -> dict:
        doc = body()
        h100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        doc["spec"]["model"] = {"tiny": {"preset": "llama-8b"}, "dtype": "bfloat16"}
        doc["spec"]["trainer"] = {"gpusPerPod": trainer_gpus, "nodeSelector": h100}
        doc["spec"]["generator"].update(gpusPerPod=2, nodeSelector=h100)
        del doc["spec"]["generator"]["ranksPerPod"]
        return doc

    d = step(job(1), [], T0)
    assert d.create_pods == [] and d.ensure == [] and d.status["phase"] == "Failed"
    failed = cond(d, "Failed")
    assert failed["reason"] == "InvalidSpec" and failed["message"].startswith("ns/arithmetic-grpo does not fit:")
    assert "spec.trainer.gpusPerPod: a trainer rank of tiny llama llama-8b needs" in failed["message"]
    # Negative control: on 8 GPUs it fits, and the pods are created.
    assert len(decide(Observed(job(8), [], T0, KEY)).create_pods) == 3


def test_refused_creations_show_in_a_condition():
    doc = body()
    step(doc, [], T0)
    d = step(doc, [], T0 + timedelta(seconds=1), errors=("creating Pod x: exceeded quota",))
    assert cond(d, "Created") == {**cond(d, "Created"), "status": "False", "reason": "CreateFailed"}
    assert "exceeded quota" in cond(d, "Created")["message"] and "CreateFailed" in reasons(d)


def test_pods_of_an_earlier_attempt_are_deleted_before_anything_is_created():
    doc = body()
    gang = pods_of(step(doc, [], T0))
    doc["status"]["attempt"] = 2
    d = step(doc, gang, T0 + timedelta(seconds=1))
    assert d.create_pods == [] and sorted(d.delete_pods) == sorted(p.name for p in gang)


def test_pod_view_reads_exit_codes_and_readiness():
    pod = {"metadata": {"name": "j-trainer-0-abcde", "labels": {builders.LABEL_ROLE: "trainer", builders.LABEL_INDEX: "0",
                                                          builders.LABEL_ATTEMPT: "2"}},
           "status": {"phase": "Failed", "containerStatuses": [
               {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]}}
    v = pod_view(pod)
    assert (v.role, v.index, v.attempt, v.started, v.ready) == ("trainer", 0, 2, True, False)
    assert v.failure == "container trainer exited with code 137 (Error)"
    # A log tail as the termination message (FallbackToLogsOnError): its last line says why.
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "Traceback ...\n  x\nValueError: bad\n"
    assert pod_view(pod).failure == "container trainer exited with code 137 (Error) (ValueError: bad)"


def test_an_operator_release_with_other_defaults_keeps_running_jobs(monkeypatch):
    """The spec hash covers what the user wrote: a new default (here generator.memoryUtilization's) leaves it alone,
    and a hash an older operator took over its defaults is taken over rather than failing the job."""
    doc = body()
    gang = pods_of(step(doc, [], T0))
    written = step(doc, gang, T0).status["specHash"]
    assert written.startswith(SPEC_HASH_PREFIX)
    full = parse_job(doc).spec.model_dump()  # what a hash over the defaults would cover
    field = api.Generator.model_fields["memory_utilization"]
    monkeypatch.setattr(field, "default", 0.5)
    for model in (api.Generator, api.RLHFJobSpec, api.RLHFJob):
        model.model_rebuild(force=True)
    try:
        assert parse_job(doc).spec.generator.memory_utilization == 0.5  # the release's new default applies
        assert parse_job(doc).spec.model_dump() != full  # so a hash over the defaults would have failed the job
        d = step(doc, gang, T0 + timedelta(seconds=1))
        assert d.status["phase"] == "Running" and d.status["specHash"] == written
    finally:
        monkeypatch.undo()
        for model in (api.Generator, api.RLHFJobSpec, api.RLHFJob):
            model.model_rebuild(force=True)
    doc["status"]["specHash"] = "0123456789abcdef"  # an older operator's hash, over its own defaults
    d = step(doc, gang, T0 + timedelta(seconds=2))
    assert d.status["phase"] == "Running" and d.status["specHash"] == written


def test_changing_an_immutable_field_fails_the_job_but_run_policy_may_change():
    doc = body()
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    doc["spec"]["runPolicy"]["backoffLimit"] = 7  # mutable
    assert step(doc, gang, T0 + timedelta(seconds=1)).status["phase"] == "Running"
    doc["spec"]["algorithm"]["learningRate"] = 0.1
    d = step(doc, gang, T0 + timedelta(seconds=2))
    assert d.status["phase"] == "Failed" and cond(d, "Failed")["reason"] == "ImmutableFieldChanged"
    assert sorted(d.delete_pods) == sorted(p.name for p in gang)


def test_a_colocated_job_runs_worker_pods_and_succeeds_when_they_exit_zero():
    doc = body()
    doc["spec"]["placement"] = "colocated"
    del doc["spec"]["trainer"]  # the generator pods' shape
    d = step(doc, [], T0)
    assert created(d) == ["arithmetic-grpo-worker-0", "arithmetic-grpo-worker-1"]
    assert d.status["placement"] == "colocated"
    gang = pods_of(d)
    d = step(doc, gang, T0 + timedelta(seconds=1))
    assert d.status["phase"] == "Running" and slots(g["pod"] for g in d.status["generators"]) == \
        ["arithmetic-grpo-worker-0", "arithmetic-grpo-worker-1"]
    done = [p.__class__(**{**p.__dict__, "phase": "Succeeded", "ready": False}) for p in gang]
    # every pod holds trainer ranks: the job succeeds once all of them have exited 0, and one done first is no failure
    d = step(doc, done[:1] + gang[1:], T0 + timedelta(seconds=2))
    assert d.status["phase"] != "Succeeded" and d.create_pods == d.delete_pods == [] and d.status["restarts"] == 0
    assert step(doc, done, T0 + timedelta(seconds=3)).status["phase"] == "Succeeded"


def test_a_job_that_ran_before_placement_existed_stays_separate():
    """A job created without spec.placement keeps the placement it started with: one an older operator ran (a
    specHash, no status.placement) stays separate; one started colocated stays colocated."""
    doc = body()
    del doc["spec"]["placement"], doc["spec"]["trainer"]["gpusPerPod"]  # trainer: {replicas: 1}, generator: 2
    doc["spec"]["trainer"]["gpusPerPod"] = 0
    doc["status"] = {"specHash": "0123456789abcdef"}  # an older operator's
    d = step(doc, [], T0)
    assert created(d) == ["arithmetic-grpo-trainer-0", "arithmetic-grpo-generator-0", "arithmetic-grpo-generator-1"]
    assert d.status["placement"] == "separate" and d.status["phase"] != "Failed"
    fresh = body()  # negative control: a new job without spec.placement is colocated
    del fresh["spec"]["placement"], fresh["spec"]["trainer"]
    d = step(fresh, [], T0)
    assert d.status["placement"] == "colocated" and len(d.create_pods) == 2
    assert len(step(fresh, pods_of(d), T0).create_pods) == 0  # and stays so once its status says it


def failed(p: PodView, code: int = 1, **kw) -> PodView:
    return p.__class__(**{**p.__dict__, "phase": "Failed", "ready": False, "exit_codes": ((p.role, code),),
                          "failure": f"container {p.role} exited with code {code}", **kw})


def running_gang(doc: dict) -> list[PodView]:
    gang = pods_of(step(doc, [], T0))
    step(doc, gang, T0)
    return gang


def test_a_disrupted_pod_restarts_the_gang_without_using_the_backoff_limit():
    doc = body(backoffLimit=0)
    gang = running_gang(doc)
    evicted = failed(gang[0], 143, conditions=gang[0].conditions + (("DisruptionTarget", "True"),),
                     failure="disrupted (EvictionByEvictionAPI: drained)")
    d = step(doc, [evicted, *gang[1:]], T0 + timedelta(seconds=5))
    assert (d.status["phase"], d.status["restarts"], d.status["disruptions"], d.status["attempt"]) == \
        ("Restarting", 0, 1, 1)
    assert cond(d, "Restarting")["reason"] == "Disruption"
    restart = next(e.message for e in d.events if e.reason == "GangRestart")
    assert "disruption 1 (not counted against runPolicy.backoffLimit)" in restart and "drained" in restart
    d = step(doc, [], T0 + timedelta(seconds=16))
    assert {p["metadata"]["labels"][builders.LABEL_ATTEMPT] for p in d.create_pods} == {"1"}
    # Negative control: the same exit without the condition counts, and backoffLimit=0 fails the job.
    doc = body(backoffLimit=0)
    gang = running_gang(doc)
    d = step(doc, [failed(gang[0], 143), *gang[1:]], T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Failed" and cond(d, "Failed")["reason"] == "BackoffLimitExceeded"


def test_a_kubelet_eviction_on_an_older_cluster_is_a_disruption_too():
    pod = {"metadata": {"name": "j-trainer-0-abcde", "labels": {}},
           "status": {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}}
    v = pod_view(pod)
    assert ("DisruptionTarget", "True") in v.conditions and "low on resource" in v.failure
    assert classify(v, api.PodFailurePolicy()).action == "Ignore"


def test_the_configuration_exit_code_fails_the_job_at_once():
    doc = body(backoffLimit=5)
    gang = running_gang(doc)
    d = step(doc, [failed(gang[0], 2), *gang[1:]], T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Failed" and cond(d, "Failed")["reason"] == "PodFailurePolicy"
    assert "exited with code 2" in cond(d, "Failed")["message"] and "built-in podFailurePolicy rule: FailJob" in \
        cond(d, "Failed")["message"] and d.status.get("restarts", 0) == 0
    # Negative control: exit 1 is retried.
    doc = body(backoffLimit=5)
    gang = running_gang(doc)
    assert step(doc, [failed(gang[0], 1), *gang[1:]], T0 + timedelta(seconds=5)).status["restarts"] == 1


def test_user_rules_come_first():
    doc = body(backoffLimit=0, podFailurePolicy={"rules": [
        {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [137]}},
        {"action": "Count", "onExitCodes": {"containerName": "trainer", "values": [2]}}]})
    gang = running_gang(doc)
    d = step(doc, [failed(gang[0], 137), *gang[1:]], T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Restarting" and d.status["disruptions"] == 1 and d.status.get("restarts", 0) == 0
    doc = body(backoffLimit=1, podFailurePolicy={"rules": [
        {"action": "Count", "onExitCodes": {"containerName": "trainer", "values": [2]}}]})
    gang = running_gang(doc)
    d = step(doc, [failed(gang[0], 2), *gang[1:]], T0 + timedelta(seconds=5))  # the user's Count beats FailJob
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1
    # NotIn: any exit code but the listed ones fails the job.
    doc = body(backoffLimit=3, podFailurePolicy={"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1, 137]}}]})
    gang = running_gang(doc)
    assert step(doc, [failed(gang[0], 137), *gang[1:]], T0 + timedelta(seconds=5)).status["phase"] == "Restarting"
    gang = running_gang(doc := body(backoffLimit=3, podFailurePolicy=doc["spec"]["runPolicy"]["podFailurePolicy"]))
    assert step(doc, [failed(gang[0], 3), *gang[1:]], T0 + timedelta(seconds=5)).status["phase"] == "Failed"


def test_a_pod_failure_rule_needs_exactly_one_match():
    doc = body(podFailurePolicy={"rules": [{"action": "Ignore"}]})
    d = step(doc, [], T0)
    assert cond(d, "Failed")["reason"] == "InvalidSpec" and "onExitCodes or onPodConditions" in \
        cond(d, "Failed")["message"]


def test_a_failed_generator_restarts_alone_while_the_trainer_runs():
    doc = body(backoffLimit=3)
    gang = running_gang(doc)
    trainer, gen0, gen1 = gang
    d = step(doc, [trainer, failed(gen0, 137), gen1], T0 + timedelta(seconds=5))
    assert d.delete_pods == [gen0.name] and d.create_pods == [] and "GeneratorRestart" in reasons(d)
    assert "GangRestart" not in reasons(d) and d.status["restarts"] == 1 and d.status.get("attempt", 0) == 0
    assert d.status["incarnations"] == {"generator-0": 1} and d.status["phase"] == "Restarting"
    gone = [trainer, gen1]
    d = step(doc, gone, T0 + timedelta(seconds=6))  # the backoff (10 s) has not passed; no failure for the gap
    assert d.create_pods == [] and d.delete_pods == [] and d.status["restarts"] == 1
    d = step(doc, gone, T0 + timedelta(seconds=16))
    assert created(d) == ["arithmetic-grpo-generator-0"] and d.create_pods[0]["metadata"]["name"] != gen0.name
    new = pods_of(d)
    assert new[0].incarnation == 1 and d.create_pods[0]["spec"]["hostname"] == "arithmetic-grpo-generator-0"
    d = step(doc, [trainer, new[0], gen1], T0 + timedelta(seconds=17))
    assert d.status["phase"] == "Running" and cond(d, "Restarting")["status"] == "False"
    # Negative control: with the trainer not running (still Pending), the gang restarts as one.
    doc = body()
    gang = pods_of(step(doc, [], T0), phase="Pending", ready=False)
    step(doc, gang, T0)
    d = step(doc, [gang[0], failed(gang[1], 137), gang[2]], T0 + timedelta(seconds=5))
    assert "GangRestart" in reasons(d) and sorted(d.delete_pods) == sorted(p.name for p in gang)


def test_pods_of_an_older_job_of_the_same_name_are_not_ours():
    """Deleted and re-created under the same name: the old job's pods (terminating, or held) are neither adopted nor
    counted as failures nor deleted (the garbage collector's job); the new job creates its own, named apart."""
    old = body()
    old["metadata"]["uid"] = "uid-old"
    old_gang = pods_of(step(old, [], T0))
    dying = [p.__class__(**{**p.__dict__, "deletion": T0 + timedelta(seconds=30)}) for p in old_gang]
    doc = body()
    d = step(doc, dying, T0 + timedelta(seconds=1))
    assert len(d.create_pods) == 3 and d.delete_pods == [] and d.status.get("restarts", 0) == 0
    assert not {p["metadata"]["name"] for p in d.create_pods} & {p.name for p in old_gang}
    assert {m["metadata"]["name"] for m in d.ensure}.isdisjoint(
        {m["metadata"]["name"] for m in step(old, [], T0).ensure})
    new = pods_of(d)
    d = step(doc, [*dying, *new], T0 + timedelta(seconds=2))
    assert d.status["phase"] == "Running" and d.delete_pods == []


def test_a_gang_not_scheduled_in_time_releases_its_pods_and_tries_again_later():
    doc = body(schedulingTimeoutSeconds=60, backoffLimit=0)
    d = step(doc, [], T0)
    pending = [p.__class__(**{**p.__dict__, "scheduled": False, "phase": "Pending", "ready": False,
                              "started": False}) for p in pods_of(d)]
    placed = [p.__class__(**{**p.__dict__, "scheduled": True}) for p in pending[:2]]
    d = step(doc, placed + pending[2:], T0 + timedelta(seconds=30))
    assert cond(d, "Scheduled")["status"] == "False" and 29 < d.wake_after <= 30
    d = step(doc, placed + pending[2:], T0 + timedelta(seconds=61))
    assert d.status["schedulingTimeouts"] == 1 and d.status["attempt"] == 1 and d.status.get("restarts", 0) == 0
    assert cond(d, "Scheduled")["reason"] == "SchedulingTimeout" and pending[2].name in cond(d, "Scheduled")["message"]
    assert sorted(d.delete_pods) == sorted(p.name for p in pending) and "SchedulingTimeout" in reasons(d)
    d = step(doc, [], T0 + timedelta(seconds=65))
    assert d.create_pods == [] and 5 < d.wake_after <= 6  # the backoff
    d = step(doc, [], T0 + timedelta(seconds=72))
    assert {p["metadata"]["labels"][builders.LABEL_ATTEMPT] for p in d.create_pods} == {"1"}
    # Negative control: all scheduled, nothing is released however long it takes to start.
    doc = body(schedulingTimeoutSeconds=60)
    d = step(doc, [], T0)
    slow = [p.__class__(**{**p.__dict__, "phase": "Pending", "ready": False}) for p in pods_of(d)]
    d = step(doc, slow, T0 + timedelta(seconds=600))
    assert d.delete_pods == [] and cond(d, "Scheduled")["status"] == "True"


def test_the_status_is_written_on_changes_and_the_iteration_alone_at_most_every_30_s():
    old = {"phase": "Running", "iteration": 3, "generators": [{"pod": "g", "layout": [1, 1]}]}
    assert not needs_write(old, dict(old), 0)
    assert not needs_write(old, {**old, "iteration": 4}, 10)
    assert needs_write(old, {**old, "iteration": 4}, 31)
    assert needs_write(old, {**old, "iteration": 4, "generators": [{"pod": "g", "layout": [2]}]}, 1)
    assert needs_write(old, {**old, "phase": "Restarting"}, 0)


def test_a_host_path_volume_is_refused_unless_the_operator_allows_it():
    doc = body()
    doc["spec"]["generator"]["volumes"] = [{"name": "host", "hostPath": {"path": "/etc"}}]
    d = step(doc, [], T0)
    assert d.create_pods == [] and d.ensure == [] and cond(d, "Failed")["reason"] == "InvalidSpec"
    assert "spec.generator.volumes[0].hostPath" in cond(d, "Failed")["message"]
    assert "--allow-privileged-pods" in cond(d, "Failed")["message"]
    allowed = decide(Observed(body() | {"spec": doc["spec"]}, [], T0, KEY), Settings(allow_privileged_pods=True))
    assert len(allowed.create_pods) == 3  # negative control: the operator's flag lets it through


def test_a_per_job_network_policy_when_the_operator_is_asked_for_one():
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pat-system"}}}
    d = decide(Observed(body(), [], T0, KEY), Settings(network_policy_from=(peer,)))
    (policy,) = [m for m in d.ensure if m["kind"] == "NetworkPolicy"]
    assert peer in [f for rule in policy["spec"]["ingress"] for f in rule["from"]]
    assert "NetworkPolicy" not in {m["kind"] for m in decide(Observed(body(), [], T0, KEY)).ensure}


def test_a_host_path_under_an_allowed_directory_passes_and_nothing_escapes_it():
    def job(path: str) -> dict:
        doc = body()
        doc["spec"]["trainer"]["volumes"] = [{"name": "data", "hostPath": {"path": path}}]
        return doc

    allowed = Settings(allowed_host_paths=("/mnt/datasets",))
    assert len(decide(Observed(job("/mnt/datasets/gsm8k"), [], T0, KEY), allowed).create_pods) == 3
    for path in ("/mnt/datasets/../../etc", "/mnt/datasets-other", "/etc", "relative"):
        d = decide(Observed(job(path), [], T0, KEY), allowed)
        assert d.create_pods == [] and "spec.trainer.volumes[0].hostPath" in cond(d, "Failed")["message"], path
