"""What production clusters do to a job's pods, on the real control plane with stand-in workers: disruptions that
are not failures, exit codes that no retry can fix, a generator restarted alone, a job deleted and re-created at
once, a pod held by another controller's finalizer, host paths the operator refuses."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import SERVE, SLEEP, condition, job_doc, phase

pytestmark = pytest.mark.cluster

EXIT_2 = ["python", "-c", "import sys; print('pat: spec.x: bad', file=sys.stderr); sys.exit(2)"]


def kill(cluster, jobs, name: str, role: str) -> None:
    for pid in cluster.kubelet.pids(jobs.namespace, jobs.pod(name, role)):
        os.kill(pid, signal.SIGKILL)


def disrupt(jobs, pod: str) -> None:
    """What an eviction (a drain, a preemption) does on Kubernetes >= 1.26: a DisruptionTarget condition, then the
    delete. The v1.20 server here does not set the condition itself."""
    jobs.core.patch_namespaced_pod_status(pod, jobs.namespace, {"status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
         "message": "Eviction API: evicting"}]}})
    jobs.core.delete_namespaced_pod(pod, jobs.namespace)


def test_an_evicted_pod_restarts_the_gang_without_using_the_backoff_limit(jobs):
    jobs.create(job_doc("evicted", SLEEP, SERVE, backoffLimit=0))
    jobs.wait("evicted", phase("Running"), "Running")
    disrupt(jobs, jobs.pod("evicted", "trainer"))
    job = jobs.wait("evicted", lambda j: j["status"].get("disruptions") == 1 and phase("Running")(j),
                    "restarted after the disruption", timeout=90)
    assert job["status"]["restarts"] == 0 and job["status"]["attempt"] == 1
    restart = [e for e in jobs.events("evicted") if e.startswith("GangRestart")]
    assert len(restart) == 1 and "not counted against runPolicy.backoffLimit" in restart[0]
    assert "EvictionByEvictionAPI" in restart[0]
    # Negative control: the same delete without the condition is a failure, and backoffLimit=0 ends the job.
    jobs.core.delete_namespaced_pod(jobs.pod("evicted", "trainer"), jobs.namespace)
    job = jobs.wait("evicted", phase("Failed"), "Failed", timeout=60)
    assert condition(job, "Failed")["reason"] == "BackoffLimitExceeded"


def test_the_workers_configuration_exit_code_fails_the_job_at_once(jobs):
    jobs.create(job_doc("misconfigured", EXIT_2, SERVE, backoffLimit=3))
    job = jobs.wait("misconfigured", phase("Failed"), "Failed", timeout=60)
    failed = condition(job, "Failed")
    assert failed["reason"] == "PodFailurePolicy" and "exited with code 2" in failed["message"]
    assert "spec.x: bad" in failed["message"] and job["status"]["restarts"] == 0
    # Negative control: a user rule can count it like any failure instead.
    doc = job_doc("counted", EXIT_2, SERVE, backoffLimit=1,
                  podFailurePolicy={"rules": [{"action": "Count", "onExitCodes": {"values": [2]}}]})
    jobs.create(doc)
    job = jobs.wait("counted", phase("Failed"), "Failed", timeout=90)
    assert condition(job, "Failed")["reason"] == "BackoffLimitExceeded" and job["status"]["restarts"] == 1


def test_a_killed_generator_restarts_alone_while_the_trainer_runs(jobs, cluster):
    jobs.create(job_doc("alone", SLEEP, SERVE, backoffLimit=2))
    jobs.wait("alone", phase("Running"), "Running")
    before = {p.spec.hostname: p for p in jobs.pods("alone")}
    kill(cluster, jobs, "alone", "generator")
    job = jobs.wait("alone", lambda j: j["status"].get("incarnations") == {"generator-0": 1} and phase("Running")(j),
                    "the generator restarted", timeout=90)
    after = {p.spec.hostname: p for p in jobs.pods("alone") if p.metadata.deletion_timestamp is None
             and p.status.phase == "Running"}
    assert after["alone-trainer-0"].metadata.uid == before["alone-trainer-0"].metadata.uid  # untouched
    generator = after["alone-generator-0"]
    assert generator.metadata.name != before["alone-generator-0"].metadata.name
    assert generator.metadata.labels["pat.dev/incarnation"] == "1" and job["status"]["restarts"] == 1
    events = jobs.events("alone")
    assert [e for e in events if e.startswith("GeneratorRestart")] and not [e for e in events
                                                                           if e.startswith("GangRestart")]
    # Negative control: the trainer's failure restarts the whole gang.
    kill(cluster, jobs, "alone", "trainer")
    jobs.wait("alone", lambda j: j["status"].get("attempt") == 1 and phase("Running")(j), "the gang restarted",
              timeout=90)
    assert generator.metadata.uid not in {p.metadata.uid for p in jobs.pods("alone")
                                          if p.metadata.deletion_timestamp is None}


def test_a_job_deleted_and_recreated_at_once_starts_cleanly(jobs):
    first = jobs.create(job_doc("again", SLEEP, SERVE))["metadata"]["uid"]
    jobs.wait("again", phase("Running"), "Running")
    jobs.delete("again")  # kubectl delete --wait=false: its children go with the garbage collector, later
    second = None
    deadline = time.monotonic() + 30
    while second is None:  # the old object goes once kopf's daemon has stopped
        try:
            second = jobs.create(job_doc("again", SLEEP, SERVE))["metadata"]["uid"]
        except Exception as e:  # 409 while the old one is still there
            assert "AlreadyExists" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.1)
    job = jobs.wait("again", lambda j: j["metadata"]["uid"] == second and phase("Running")(j), "the new job runs",
                    timeout=90)
    assert (job["status"]["restarts"], job["status"].get("disruptions", 0), job["status"]["attempt"]) == (0, 0, 0)
    live = [p for p in jobs.pods("again") if p.metadata.deletion_timestamp is None]
    assert {p.metadata.owner_references[0].uid for p in live} == {second} and len(live) == 2
    assert first != second


def test_a_pod_held_by_a_finalizer_is_reported_once_and_the_next_attempt_starts(jobs):
    jobs.create(job_doc("held", SLEEP, SERVE, podDeletionTimeoutSeconds=1))
    jobs.wait("held", phase("Running"), "Running")
    pod = jobs.pod("held", "trainer")
    jobs.core.patch_namespaced_pod(pod, jobs.namespace, {"metadata": {"finalizers": ["example.com/hold"]}})
    try:
        jobs.core.delete_namespaced_pod(pod, jobs.namespace, grace_period_seconds=1)
        jobs.wait("held", lambda j: j["status"].get("attempt") == 1 and phase("Running")(j),
                  "the next attempt runs beside the held pod", timeout=90)
        time.sleep(5)  # several resyncs: the held pod is not fought
        events = jobs.events("held")
        held = [e for e in events if e.startswith("PodHeldByFinalizer")]
        assert len(held) == 1 and "example.com/hold" in held[0] and pod in held[0], events
        assert jobs.core.read_namespaced_pod(pod, jobs.namespace).metadata.deletion_timestamp
        assert not [e for e in events if e.startswith("PodForceDeleted")]  # not gone yet: not said
    finally:
        jobs.core.patch_namespaced_pod(pod, jobs.namespace, {"metadata": {"finalizers": None}})
    jobs.wait("held", lambda j: any(e.startswith("PodForceDeleted") and pod in e for e in jobs.events("held")),
              "PodForceDeleted once the pod is gone")
    assert [e.split(":")[0] for e in jobs.events("held")].count("PodForceDeleted") == 1


def test_a_host_path_outside_the_allowed_directories_is_refused_naming_the_field(jobs):
    doc = job_doc("hostpath", SLEEP, SERVE)
    doc["spec"]["generator"]["volumes"] = [{"name": "etc", "hostPath": {"path": "/etc"}}]
    doc["spec"]["generator"]["volumeMounts"] = [{"name": "etc", "mountPath": "/host-etc"}]
    jobs.create(doc)
    job = jobs.wait("hostpath", phase("Failed"), "Failed")
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.generator.volumes[0].hostPath" in failed["message"]
    assert jobs.pods("hostpath") == []
    # Negative control: under the directory the test operator allows (--allow-host-path /tmp), it runs.
    doc = job_doc("tmppath", SLEEP, SERVE)
    doc["spec"]["generator"]["volumes"] = [{"name": "tmp", "hostPath": {"path": "/tmp"}}]
    doc["spec"]["generator"]["volumeMounts"] = [{"name": "tmp", "mountPath": "/host-tmp"}]
    jobs.create(doc)
    jobs.wait("tmppath", phase("Running"), "Running")
