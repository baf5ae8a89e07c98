"""The gang's life cycle on a real API server: stand-in worker commands (the state machine does not need real
workers; tests/operator/test_workers.py runs the real ones)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from pat_operator import builders
from pat_operator.api import parse_job
from tests.cluster.kubelet import POD_NETWORK

from .conftest import SERVE, SLEEP, job_doc, phase
from .harness import SERVICE_ACCOUNT, SYSTEM_NAMESPACE, OperatorProcess

pytestmark = pytest.mark.cluster


def test_a_job_with_the_longest_valid_name_runs(jobs):
    """63 characters: <job>-generator-0 would be a 73-character hostname, which the API server refuses; the pods'
    hostnames are shortened with a hash of the whole name, and the gang runs."""
    name = "long-" + "x" * 58
    jobs.create(job_doc(name, SLEEP, SERVE))
    jobs.wait(name, phase("Running"), "Running")
    hostnames = [p.spec.hostname for p in jobs.pods(name)]
    assert len(hostnames) == 2 and all(len(h) <= 63 for h in hostnames), hostnames


def unscoped_pod_reads(audit_log, user: str) -> list[str]:
    """The pod lists and watches of `user` in the API server's audit log that do not select the jobs' pods."""
    reads = [json.loads(line) for line in audit_log.read_text().splitlines()]
    reads = [r for r in reads if r["user"]["username"] == user and r["objectRef"].get("resource") == "pods"]
    assert reads, f"{user} never listed or watched pods"
    return [r["requestURI"] for r in reads
            if "labelSelector=pat.dev%2Fjob" not in r["requestURI"].replace("/", "%2F")]


def test_the_api_server_sends_the_operator_only_the_jobs_pods(jobs, cluster, operator):
    """kopf's handler filters work on the client: the operator's label selector has the API server send only the
    pods of jobs, not every pod of the cluster."""
    jobs.create(job_doc("scoped", SLEEP, SERVE))
    jobs.wait("scoped", phase("Running"), "Running")
    user = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{SERVICE_ACCOUNT}"
    assert unscoped_pod_reads(cluster.plane.audit_log, user) == []
    # Negative control: an unselected list with the operator's own token is seen.
    token = cluster.token_for(SYSTEM_NAMESPACE, SERVICE_ACCOUNT)
    with kubernetes.config.new_client_from_config(cluster.kubeconfig_for_token(token)) as api:
        kubernetes.client.CoreV1Api(api).list_namespaced_pod(jobs.namespace, _preload_content=False)
    deadline = time.monotonic() + 10  # the entry is written once the response is complete, not before
    while not (unscoped := unscoped_pod_reads(cluster.plane.audit_log, user)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert unscoped == [f"/api/v1/namespaces/{jobs.namespace}/pods"]


# The next release, as far as a running job can tell: a default changed.
UPGRADE = """
from pat_operator import api
api.Algorithm.model_fields["clip_ratio"].default = 0.3
for model in (api.Algorithm, api.RLHFJobSpec, api.RLHFJob):
    model.model_rebuild(force=True)
print("upgraded: algorithm.clipRatio defaults to", api.Algorithm().clip_ratio, flush=True)
"""


def test_an_operator_upgrade_that_changes_a_default_keeps_the_running_job(jobs, operator):
    jobs.create(job_doc("upgrade", SLEEP, SERVE))
    before = jobs.wait("upgrade", phase("Running"), "Running")
    operator.stop()
    upgraded = OperatorProcess(operator.kubeconfig, operator.workdir / "upgraded", *operator.extra, prelude=UPGRADE)
    try:
        upgraded.start()
        assert "clipRatio defaults to 0.3" in upgraded.log()
        jobs.patch_spec("upgrade", {"runPolicy": {"backoffLimit": 5}})  # generation 2: seen only by the new release
        after = jobs.wait("upgrade", lambda j: j["status"].get("observedGeneration") == 2,
                          "observed by the upgraded operator")
    finally:
        upgraded.stop()
        operator.start()
    assert after["status"]["phase"] == "Running", after["status"]
    assert after["status"]["specHash"] == before["status"]["specHash"]
    assert not any("ImmutableFieldChanged" in e for e in jobs.events("upgrade"))


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_and_the_job_goes_on(jobs, cluster, extra_node):
    node, home = extra_node(), cluster.kubelet.node_name
    jobs.core.patch_node(home, {"spec": {"unschedulable": True}})  # so the gang lands on the node to lose
    try:
        jobs.create(job_doc("lost", SLEEP, SERVE, podDeletionTimeoutSeconds=2))
        jobs.wait("lost", phase("Running"), "Running")
    finally:
        jobs.core.patch_node(home, {"spec": {"unschedulable": False}})
    assert {p.spec.node_name for p in jobs.pods("lost")} == {node.node_name}
    node.lose()
    jobs.core.delete_namespaced_pod(jobs.pod("lost", "trainer"), jobs.namespace)  # an eviction from a lost node
    time.sleep(3)
    assert all(p.metadata.deletion_timestamp for p in jobs.pods("lost")), "no kubelet confirms the deletions"
    # Each stuck pod goes 2 s after its 30 s grace period; the next attempt then runs on the other node.
    jobs.wait("lost", lambda j: j["status"].get("restarts") == 1 and phase("Running")(j), "restarted", timeout=120)
    pods = jobs.pods("lost")
    assert {(p.spec.node_name, p.metadata.labels["pat.dev/attempt"]) for p in pods} == {(home, "1")}
    forced = [e for e in jobs.events("lost") if e.startswith("PodForceDeleted")]
    assert len(forced) == 2 and "runPolicy.podDeletionTimeoutSeconds=2" in forced[0], forced


def test_children_are_owned_labelled_and_the_gang_runs_when_all_are_ready(jobs, cluster):
    created = jobs.create(job_doc("gang", SLEEP, SERVE))
    job = jobs.wait("gang", phase("Running"), "Running")
    uid = created["metadata"]["uid"]
    core = jobs.core
    h = builders.uid_suffix(uid)  # in every child's name: a re-created job never takes the old one's
    for obj in (core.read_namespaced_config_map(f"gang-spec-{h}", jobs.namespace),
                core.read_namespaced_service(f"gang-{h}", jobs.namespace),
                core.read_namespaced_secret(f"gang-token-{h}", jobs.namespace), *jobs.pods("gang")):
        (ref,) = obj.metadata.owner_references
        assert (ref.kind, ref.uid, ref.controller) == ("RLHFJob", uid, True)
        assert obj.metadata.labels["pat.dev/job"] == "gang"
    pods = {p.spec.hostname: p for p in jobs.pods("gang")}
    assert sorted(pods) == ["gang-generator-0", "gang-trainer-0"]
    assert all(p.metadata.name.startswith(f"{p.spec.hostname}-") for p in pods.values())
    assert all(ipaddress.ip_address(p.status.pod_ip) in POD_NETWORK for p in pods.values())
    assert pods["gang-generator-0"].spec.security_context.run_as_user == 1000
    conditions = {c["type"]: c for c in job["status"]["conditions"]}
    assert conditions["Running"]["status"] == "True" and conditions["Running"]["observedGeneration"] == 1
    assert job["status"]["restarts"] == 0 and job["status"]["startTime"]
    assert any(e.startswith("CreatedPods") for e in jobs.events("gang"))


def test_a_killed_pod_restarts_the_gang_and_past_the_backoff_limit_the_job_stays_failed(jobs, cluster):
    jobs.create(job_doc("flaky", SLEEP, SERVE, backoffLimit=1))
    jobs.wait("flaky", phase("Running"), "Running")
    first = {p.spec.hostname: p.metadata.uid for p in jobs.pods("flaky")}
    for pid in cluster.kubelet.pids(jobs.namespace, jobs.pod("flaky", "trainer")):
        os.kill(pid, signal.SIGKILL)
    job = jobs.wait("flaky", lambda j: j["status"].get("restarts") == 1 and phase("Running")(j), "restarted once")
    second = {p.spec.hostname: p.metadata.uid for p in jobs.pods("flaky")}
    assert sorted(second) == sorted(first) and not set(second.values()) & set(first.values())  # the whole gang
    assert all(p.metadata.labels["pat.dev/attempt"] == "1" for p in jobs.pods("flaky"))
    assert any(e.startswith("GangRestart") and "exited with code 137" in e for e in jobs.events("flaky"))
    for pid in cluster.kubelet.pids(jobs.namespace, jobs.pod("flaky", "generator")):
        os.kill(pid, signal.SIGKILL)
    job = jobs.wait("flaky", phase("Failed"), "Failed")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "flaky-generator-0" in failed["message"]
    time.sleep(4)  # longer than the restart backoff: nothing may come back
    assert all(p.status.phase in ("Failed", "Succeeded") or p.metadata.deletion_timestamp
               for p in jobs.pods("flaky"))
    assert jobs.get("flaky")["status"]["phase"] == "Failed" and jobs.get("flaky")["status"]["restarts"] == 1


def test_suspend_deletes_the_pods_keeps_the_status_and_resume_recreates_them(jobs):
    jobs.create(job_doc("pause", SLEEP, SERVE))
    jobs.wait("pause", phase("Running"), "Running")
    before = {p.metadata.uid for p in jobs.pods("pause")}
    jobs.patch_spec("pause", {"runPolicy": {"suspend": True}})
    jobs.wait("pause", lambda j: phase("Suspended")(j) and not jobs.pods("pause"), "Suspended, pods gone")
    jobs.patch_spec("pause", {"runPolicy": {"suspend": False}})
    job = jobs.wait("pause", phase("Running"), "Running again")
    assert job["status"]["restarts"] == 0 and not before & {p.metadata.uid for p in jobs.pods("pause")}
    reasons = [e.split(":")[0] for e in jobs.events("pause")]
    assert "Suspended" in reasons and "Resumed" in reasons


def test_success_keeps_the_trainer_pod_then_ttl_deletes_everything(jobs, cluster):
    cluster.wait_for_garbage_collector("pat.dev/v1alpha1", "RLHFJob", jobs.namespace)
    uid = jobs.create(job_doc("done", ["python", "-c", "print('trained')"], SERVE, ttlSecondsAfterFinished=4))[
        "metadata"]["uid"]
    job = jobs.wait("done", phase("Succeeded"), "Succeeded")
    assert job["status"]["completionTime"]
    jobs.wait("done", lambda j: [p.spec.hostname for p in jobs.pods("done")] == ["done-trainer-0"],
              "generators deleted, the finished trainer kept for its logs")
    deadline = time.monotonic() + 30
    while jobs.exists("done"):
        assert time.monotonic() < deadline, "the TTL did not delete the job"
        time.sleep(0.5)
    _wait_gone(lambda: jobs.pods("done") or _children(jobs, "done", uid), "children garbage-collected")


def test_active_deadline_fails_the_job(jobs):
    jobs.create(job_doc("late", SLEEP, SERVE, activeDeadlineSeconds=3))
    job = jobs.wait("late", phase("Failed"), "Failed", timeout=30)
    assert next(c for c in job["status"]["conditions"] if c["type"] == "Failed")["reason"] == "DeadlineExceeded"
    _wait_gone(lambda: [p for p in jobs.pods("late") if p.status.phase == "Running"], "pods stopped")


def test_delete_garbage_collects_everything_and_leaves_no_finalizer(jobs, cluster):
    cluster.wait_for_garbage_collector("pat.dev/v1alpha1", "RLHFJob", jobs.namespace)
    uid = jobs.create(job_doc("gone", SLEEP, SERVE))["metadata"]["uid"]
    jobs.wait("gone", phase("Running"), "Running")
    assert jobs.get("gone")["metadata"].get("finalizers")  # kopf's, while its daemon runs
    jobs.delete("gone")
    _wait_gone(lambda: jobs.exists("gone"), "the job (its finalizer removed)")
    _wait_gone(lambda: jobs.pods("gone") or _children(jobs, "gone", uid), "children garbage-collected")


def test_operator_restart_mid_job_makes_no_duplicates_and_keeps_the_status(jobs, operator):
    jobs.create(job_doc("steady", SLEEP, SERVE))
    jobs.wait("steady", phase("Running"), "Running")
    pods = {p.metadata.name: p.metadata.uid for p in jobs.pods("steady")}
    status = jobs.get("steady")["status"]
    operator.restart()
    time.sleep(5)  # a full resync interval of the new process
    assert {p.metadata.name: p.metadata.uid for p in jobs.pods("steady")} == pods
    after = jobs.get("steady")["status"]
    assert after["conditions"] == status["conditions"] and after["restarts"] == 0
    # ... and the new process acts: a killed pod is still noticed.
    jobs.patch_spec("steady", {"runPolicy": {"suspend": True}})
    jobs.wait("steady", phase("Suspended"), "Suspended by the restarted operator")


def test_an_invalid_job_is_marked_failed_naming_the_field(jobs):
    doc = job_doc("bad", SLEEP, SERVE)
    doc["spec"]["generator"]["adaptiveTP"]["tpSizes"] = [1, 3]  # the 1.20 server has no CEL to refuse it
    doc["spec"]["algorithm"]["clipRatoi"] = 0.2  # a typo, kept by the schema so that the operator can name it
    jobs.create(doc)
    job = jobs.wait("bad", phase("Failed"), "Failed")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "tpSizes" in failed["message"] and "spec.algorithm.clipRatoi" in failed["message"]
    assert jobs.pods("bad") == [] and any(e.startswith("InvalidSpec") for e in jobs.events("bad"))


def test_volcano_gets_a_podgroup_owned_by_the_job(jobs, cluster):
    ext = kubernetes.client.ApiextensionsV1Api(cluster.api_client())
    try:  # a minimal stand-in for Volcano's CRD: the operator only creates the object
        ext.create_custom_resource_definition({
            "metadata": {"name": "podgroups.scheduling.volcano.sh"},
            "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
                     "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
                     "versions": [{"name": "v1beta1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}})
    except ApiException as e:
        if e.status != 409:
            raise
    doc = job_doc("vc", SLEEP, SERVE)
    doc["spec"]["scheduling"] = {"schedulerName": "volcano"}
    group_name = builders.names(parse_job(doc), jobs.create(doc)["metadata"]["uid"])["podgroup"]
    custom = kubernetes.client.CustomObjectsApi(cluster.api_client())
    deadline = time.monotonic() + 30
    while True:
        try:
            group = custom.get_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", jobs.namespace,
                                                        "podgroups", group_name)
            break
        except ApiException as e:
            assert e.status == 404 and time.monotonic() < deadline, "no PodGroup"
            time.sleep(0.5)
    assert group["spec"]["minMember"] == 2 and group["metadata"]["ownerReferences"][0]["name"] == "vc"
    jobs.wait("vc", lambda j: len(jobs.pods("vc")) == 2, "both pods created")  # created after the PodGroup
    pods = jobs.pods("vc")
    assert all(p.spec.scheduler_name == "volcano" for p in pods)
    assert all(p.metadata.annotations["scheduling.k8s.io/group-name"] == group_name for p in pods)


def test_the_operator_cannot_read_secrets_and_serves_health_and_metrics(cluster, operator, jobs):
    token = cluster.token_for(SYSTEM_NAMESPACE, SERVICE_ACCOUNT)
    as_operator = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(
        str(cluster.kubeconfig_for_token(token))))
    jobs.core.create_namespaced_secret(jobs.namespace, {"metadata": {"name": "someone-elses"},
                                                        "stringData": {"password": "x"}})
    for call in (lambda: as_operator.read_namespaced_secret("someone-elses", jobs.namespace),
                 lambda: as_operator.list_namespaced_secret(jobs.namespace),
                 lambda: as_operator.list_namespaced_config_map(jobs.namespace)):
        with pytest.raises(ApiException) as e:
            call()
        assert e.value.status == 403
    # Negative control: the admin can, so the 403 is the RBAC's doing.
    assert jobs.core.read_namespaced_secret("someone-elses", jobs.namespace).data
    assert operator.live()
    assert operator.value('pat_operator_reconciles_total{result="ok"}') >= 1
    assert operator.value("pat_operator_pods_created_total") >= 1


def _children(jobs, name: str, uid: str) -> list[str]:
    found, h = [], builders.uid_suffix(uid)
    for kind, read in (("configmap", jobs.core.read_namespaced_config_map),
                       ("secret", jobs.core.read_namespaced_secret), ("service", jobs.core.read_namespaced_service)):
        try:
            read(f"{name}-spec-{h}" if kind == "configmap" else f"{name}-token-{h}" if kind == "secret" else
                 f"{name}-{h}", jobs.namespace)
            found.append(kind)
        except ApiException as e:
            if e.status != 404:
                raise
    return found


def _wait_gone(present, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while present():
        assert time.monotonic() < deadline, f"{what}: still there after {timeout:.0f} s"
        time.sleep(0.5)
