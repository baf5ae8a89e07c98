"""What the builders make for a job, sent to the real API server (tests/cluster, server-side dry-run creates): every
child of every job name the CRD accepts is accepted (the ConfigMap, Secret, Service, pods, PodGroups and the
NetworkPolicy), names the CRD refuses would make children the server refuses, and the coscheduling PodGroup and
the NetworkPolicy come back as built (the server prunes a field its schema lacks, so a wrong one would show).
No operator runs: these are the builders' objects, created as the operator creates them."""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from pat_operator import builders
from pat_operator.api import Metadata, parse_job

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).parents[2]
COSCHEDULING_CRD = Path(__file__).parent / "crds" / "podgroups.scheduling.x-k8s.io.yaml"
# Volcano's, as a stand-in with no schema (tests/operator/test_gang.py makes the same): only its name matters here.
VOLCANO_CRD = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "metadata": {"name": "podgroups.scheduling.volcano.sh"},
               "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
                        "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
                        "versions": [{"name": "v1beta1", "served": True, "storage": True, "schema": {
                            "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
PEERS = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
          "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
         {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pat-system"}}})
# A sample of the names the CRD and the models accept: the shortest, the longest, digits and hyphens inside.
NAMES = ["a", "x" * 63, "a-" * 31 + "b", "z9" * 31 + "q", "llama-3-1-8b-grpo-math", "m0-0-0"]


@pytest.fixture(scope="module")
def api(cluster):
    with cluster.api_client() as client:
        ext = kubernetes.client.ApiextensionsV1Api(client)
        for crd in (yaml.safe_load(COSCHEDULING_CRD.read_text()), VOLCANO_CRD):
            try:
                ext.create_custom_resource_definition(crd)
            except ApiException as e:
                if e.status != 409:  # made by another test of this session
                    raise
            name, deadline = crd["metadata"]["name"], time.monotonic() + 30
            while not any(c.type == "Established" and c.status == "True"
                          for c in ext.read_custom_resource_definition(name).status.conditions or []):
                assert time.monotonic() < deadline, f"{name} not Established"
                time.sleep(0.2)
        yield client


@pytest.fixture
def ns(api, namespace) -> str:
    """The test namespace, once its default ServiceAccount exists (the admission of a pod looks it up)."""
    core, deadline = kubernetes.client.CoreV1Api(api), time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return namespace
        except ApiException as e:
            assert e.status == 404 and time.monotonic() < deadline, e
            time.sleep(0.2)


def dry_run(api, namespace: str, manifest: dict) -> dict:
    """The object as the API server would store it, or ApiException (422 for an invalid one)."""
    resource = DynamicClient(api).resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
    return resource.create(body=manifest, namespace=namespace, dry_run="All").to_dict()


def job(name: str, namespace: str, placement: str, scheduling: dict, **run_policy):
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(placement=placement, scheduling=scheduling)
    doc["spec"]["runPolicy"].update(run_policy)
    doc["spec"]["generator"]["replicas"] = 2
    if placement == "colocated":  # the trainer runs in the generator pods, with their pod fields
        del doc["spec"]["trainer"]
    return parse_job(doc)


def children(j, uid: str) -> list[dict]:
    """Everything the builders make for a job: job_objects, every pod of an attempt, the NetworkPolicy."""
    return (builders.job_objects(j, uid, b"k" * 32) + [builders.network_policy(j, uid, PEERS)]
            + [builders.pod(j, uid, role, i, 7) for role, i in builders.expected_pods(j)])


GANGS = [("separate", {"gangScheduler": "coscheduling", "schedulerName": "scheduler-plugins-scheduler"}),
         ("colocated", {"schedulerName": "volcano", "queueName": "team-a"})]


@pytest.mark.parametrize("name", NAMES)
def test_every_child_of_a_valid_job_name_is_accepted(api, ns, name):
    uid = str(uuid.uuid4())
    kinds = []
    for placement, scheduling in GANGS:
        for manifest in children(job(name, ns, placement, scheduling), uid):
            stored = dry_run(api, ns, manifest)
            assert stored["metadata"]["name"] == manifest["metadata"]["name"]
            kinds.append(manifest["kind"])
    assert set(kinds) == {"ConfigMap", "Secret", "Service", "Pod", "PodGroup", "NetworkPolicy"}
    assert kinds.count("PodGroup") == 2  # coscheduling's and Volcano's


@pytest.mark.parametrize("name, kinds", [("grpo.v2", {"Service", "Pod"}), ("3d-grpo", {"Service"})])
def test_the_names_the_crd_refuses_would_make_children_the_server_refuses(api, ns, name, kinds):
    """The negative control: past the models' rule (forced in), the server refuses the Service (a DNS-1035 label:
    no dot, a letter first) and, for a dot, the pods (their subdomain and hostname are DNS labels), naming the field;
    the rest (DNS subdomains) it accepts."""
    good = job("grpo", ns, *GANGS[0])
    forced = good.model_copy(update={"metadata": Metadata.model_construct(name=name, namespace=ns)})
    refused = {}
    for manifest in children(forced, str(uuid.uuid4())):
        try:
            dry_run(api, ns, manifest)
        except ApiException as e:
            assert e.status == 422, e
            refused.setdefault(manifest["kind"], e.body)
    assert set(refused) == kinds, refused
    assert "metadata.name" in refused["Service"] and ("Pod" not in kinds or "spec.subdomain" in refused["Pod"])


def test_the_coscheduling_podgroup_is_stored_as_built(api, ns):
    """Through CUSTOM_RESOURCES, as the operator creates it: the server's schema (scheduler-plugins') keeps every field
    the builder writes; a misspelled one is pruned (negative control)."""
    j = job("cosched", ns, "separate", {"gangScheduler": "coscheduling"}, schedulingTimeoutSeconds=90)
    uid = str(uuid.uuid4())
    (group,) = [o for o in builders.job_objects(j, uid, b"k" * 32) if o["kind"] == "PodGroup"]
    custom = kubernetes.client.CustomObjectsApi(api)
    g, version, plural = builders.CUSTOM_RESOURCES[(group["apiVersion"], group["kind"])]

    def stored(manifest: dict) -> dict:
        return custom.create_namespaced_custom_object(g, version, ns, plural, manifest, dry_run="All")

    out = stored(group)
    assert out["spec"] == group["spec"] == {"minMember": 3, "scheduleTimeoutSeconds": 90}
    assert out["metadata"]["ownerReferences"][0]["uid"] == uid
    misspelled = copy.deepcopy(group)
    misspelled["spec"]["minMembers"] = misspelled["spec"].pop("minMember")
    assert stored(misspelled)["spec"] == {"scheduleTimeoutSeconds": 90}


def test_the_network_policy_is_stored_as_built_and_validated(api, ns):
    j = job("netpol", ns, "separate", {})
    policy = builders.network_policy(j, str(uuid.uuid4()), PEERS)
    assert dry_run(api, ns, policy)["spec"] == policy["spec"]
    # Negative control: the server validates the peers it is given (an ipBlock beside a podSelector is refused).
    bad = builders.network_policy(j, str(uuid.uuid4()), ({"ipBlock": {"cidr": "10.0.0.0/8"}, **PEERS[0]},))
    with pytest.raises(ApiException) as e:
        dry_run(api, ns, bad)
    assert e.value.status == 422 and "ingress[1].from[0]" in e.value.body
