"""What the pods get besides their workers: a /dev/shm of the pod template's shmSize in every pod, scratch folders
sized from what the workers write into them and an ephemeral-storage request of their sum (the user's value wins),
the gang schedulers' objects and labels (Kueue, Volcano, scheduler-plugins' coscheduling), the job's NetworkPolicy,
and job names whose children Kubernetes accepts. Pure builders here; tests/operator/test_children.py has the API
server create what they build."""

import inspect
import json
import os
from pathlib import Path

import pytest
import yaml
from kubernetes.utils import parse_quantity

from pat_operator import builders, scratch
from pat_operator.api import JobSpecError, parse_job
from pat_operator.fit import tiny_shape
from pat_operator.layout import tp_degrees

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
UID = "0b5c4cf0-3d6e-4a8e-9a53-0d3f1c1b2a10"


def job(placement: str = "separate", name: str | None = None, **spec_edits):
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["spec"]["placement"] = placement
    doc["metadata"].update(namespace="team", **({"name": name} if name else {}))
    for key, value in spec_edits.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return parse_job(doc)


def pods(j) -> list[dict]:
    return [builders.pod(j, UID, role, i, 0) for role, i in builders.expected_pods(j)]


def volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def requests(pod: dict) -> dict:
    return pod["spec"]["containers"][0]["resources"].get("requests", {})


def every_pod() -> list[dict]:
    """Every pod of every example, and of the local one in both placements: trainer, generator, worker."""
    out = [job("separate"), job("colocated")]
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["namespace"] = "team"
        out.append(parse_job(doc))
    return [p for j in out for p in pods(j)]


# --- /dev/shm ----------------------------------------------------------------------------------------------------

def test_every_pod_has_a_dev_shm_and_every_memory_backed_volume_a_size_limit():
    found = every_pod()
    assert {p["metadata"]["labels"][builders.LABEL_ROLE] for p in found} == {"trainer", "generator", "worker"}
    for pod in found:
        (c,) = pod["spec"]["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"], pod["metadata"]["name"]
        assert volumes(pod)["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        memory = [v for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert memory and all("sizeLimit" in v["emptyDir"] for v in memory)


def test_shm_size_is_set_per_pod_template():
    j = job(trainer={"gpusPerPod": 0, "shmSize": "8Gi"}, generator={"shmSize": "512Mi"})
    sizes = {p["metadata"]["labels"][builders.LABEL_ROLE]: volumes(p)["dshm"]["emptyDir"]["sizeLimit"] for p in pods(j)}
    assert sizes == {"trainer": "8Gi", "generator": "512Mi"}
    # colocated: the generator's, which the trainer's pod fields must equal
    assert {volumes(p)["dshm"]["emptyDir"]["sizeLimit"] for p in pods(job("colocated", generator={"shmSize": "2Gi"}))} \
        == {"2Gi"}
    with pytest.raises(JobSpecError, match=r"trainer.shmSize='8Gi' differs from generator.shmSize='1Gi'"):
        job("colocated", trainer={"shmSize": "8Gi"})


@pytest.mark.parametrize("template, error", [
    ({"shmSize": "2Gi", "resources": {"limits": {"memory": "1Gi"}}},
     "spec.generator: shmSize=2Gi is more than resources.limits.memory=1Gi: /dev/shm's pages count against the "
     "container's memory limit"),
    ({"shmSize": "1GB"}, "spec.generator: shmSize='1GB': use a positive Kubernetes quantity"),
    ({"shmSize": 0}, "spec.generator: shmSize=0: use a positive Kubernetes quantity"),
    ({"tmpSize": "-1Gi"}, "spec.generator: tmpSize='-1Gi': use a positive Kubernetes quantity"),
])
def test_bad_sizes_are_refused_naming_the_field(template, error):
    with pytest.raises(JobSpecError) as e:
        job(generator=template)
    assert error in str(e.value)


def test_a_small_memory_limit_keeps_the_default_shm_size():
    """The default is not refused against a smaller memory limit (the kubelet caps the tmpfs at the limit); the same
    size set explicitly is (negative control)."""
    small = {"resources": {"limits": {"memory": "512Mi"}}}
    assert volumes(pods(job(generator=small))[1])["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"
    with pytest.raises(JobSpecError, match="shmSize=1Gi is more than resources.limits.memory=512Mi"):
        job(generator={**small, "shmSize": "1Gi"})


def test_the_default_shm_holds_the_shared_memory_communicators_of_an_eight_rank_generator_pod(tmp_path):
    """On CPU the engine ranks of a pod talk through one shared-memory segment per TP group (engine/comm.py); the
    segments a pod of 8 ranks creates, as its ranks create them (each group's first rank), fill half the default
    shmSize; those of 16 ranks would not fit it (the bound can fail)."""
    comm = pytest.importorskip("pat_workers.engine.comm")
    if not comm.shm_supported(os.uname().machine):
        pytest.skip("the shared-memory communicator needs x86-64")
    capacity = inspect.signature(comm.CommunicatorPool.build).parameters["capacity"].default

    def segment_bytes(ranks: int) -> int:
        total = 0
        for t in [t for t in tp_degrees(ranks) if t > 1]:
            for i in range(ranks // t):
                block = tuple(range(i * t, (i + 1) * t))
                c = comm.ShmCommunicator(block, block[0], prefix=f"pat-hygiene-{os.getpid()}", capacity=capacity)
                try:
                    total += os.path.getsize(c.path)
                finally:
                    c.close()
        return total

    default = parse_quantity(job().spec.generator.shm_size)
    eight = segment_bytes(8)
    assert 16 << 20 <= eight / 8 / 3 <= 17 << 20  # 16 MiB a rank for each of the TP sizes 2, 4, 8: the docs' figure
    assert eight <= default / 2 and segment_bytes(16) > default


# --- scratch folders and ephemeral storage -------------------------------------------------------------------------

def test_scratch_folders_have_size_limits_and_the_pod_requests_their_sum():
    for pod in pods(job("colocated")) + pods(job("separate")):
        disk = {name: v["emptyDir"]["sizeLimit"] for name, v in volumes(pod).items()
                if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}
        trains = pod["metadata"]["labels"][builders.LABEL_ROLE] != "generator"
        assert set(disk) == ({"work", "tmp", "run"} if trains else {"work", "tmp"})
        total = sum(parse_quantity(q) for q in disk.values())
        assert parse_quantity(requests(pod)["ephemeral-storage"]) == total
        assert disk["tmp"] == "4096Mi"  # tmpSize's default


def test_the_scratch_sizes_follow_what_the_job_writes():
    base = job("colocated")
    bigger = job("colocated", model={"tiny": {"preset": "bench"}}, checkpoint={"keep": 3}, generator={"tmpSize": "8Gi"})
    (small,), (large,) = pods(base), pods(bigger)
    for name in ("work", "tmp", "run"):
        assert parse_quantity(volumes(large)[name]["emptyDir"]["sizeLimit"]) > \
            parse_quantity(volumes(small)[name]["emptyDir"]["sizeLimit"]), name
    # the run folder on a volume: not scratch, not requested
    on_volume = job("colocated", checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}})
    (pod,) = pods(on_volume)
    assert volumes(pod)["run"] == {"name": "run", "persistentVolumeClaim": {"claimName": "ckpt"}}
    run = parse_quantity(volumes(small)["run"]["emptyDir"]["sizeLimit"])
    before, after = (parse_quantity(requests(p)["ephemeral-storage"]) for p in (small, pod))
    assert after == before - run


def test_a_model_on_a_volume_writes_nothing_to_work_and_an_unknown_run_folder_gets_no_limit():
    claim = {"persistentVolumeClaim": {"claimName": "m"}}
    j = job("separate", model={"tiny": None, "path": "/models/m", "volume": claim})
    trainer = pods(j)[0]
    assert volumes(trainer)["work"]["emptyDir"] == {"sizeLimit": f"{scratch.FLOOR >> 20}Mi"}
    assert volumes(trainer)["run"]["emptyDir"] == {}  # the model's size, so its checkpoints', is unknown here
    assert parse_quantity(requests(trainer)["ephemeral-storage"]) == scratch.FLOOR + (4 << 30)


@pytest.mark.parametrize("resources", [{"requests": {"ephemeral-storage": "50Gi"}},
                                       {"limits": {"ephemeral-storage": "80Gi"}}])
def test_the_users_ephemeral_storage_wins(resources):
    (pod,) = pods(job("colocated", generator={"resources": resources}))
    assert pod["spec"]["containers"][0]["resources"] == resources
    assert all(v["emptyDir"] == {} for name, v in volumes(pod).items() if name in ("work", "tmp", "run"))
    assert volumes(pod)["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"  # memory: still bounded


@pytest.mark.parametrize("preset", ["demo", "demo-vllm"])
def test_the_work_folder_holds_the_tiny_model_pat_prepare_writes(tmp_path, preset):
    """The real builder of the init container's model (float32 safetensors): its weights are the estimate's
    TINY_WEIGHT_BYTES a parameter, within 1%, and the folder's sizeLimit holds them."""
    tiny = pytest.importorskip("pat_workers.engine.tiny")
    j = job(model={"tiny": {"preset": preset, "tokenizer": "bytes"}})
    tiny.make_tiny_model(tmp_path / "model", family="llama", preset=preset)
    written = sum(f.stat().st_size for f in (tmp_path / "model").iterdir())
    weights = tiny_shape(preset).params * scratch.TINY_WEIGHT_BYTES
    assert abs((tmp_path / "model" / "model.safetensors").stat().st_size - weights) < 0.01 * weights
    assert written < scratch.work_bytes(j.spec) < 2 * written + scratch.FLOOR


def _checkpoint_bytes(rank: int, world: int, root: str) -> tuple[int, int]:
    """A checkpoint as the trainer writes one (FSDP2-sharded parameters and AdamW's moments, after a step): its
    bytes on disk, and the model's parameters."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pat_workers.trainer import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    path = checkpoint.save(root, 1, model, optimizer, state={"iteration": 1}, keep=1)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return size, sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_a_checkpoint_takes_the_bytes_per_parameter_the_run_folder_is_sized_with(tmp_path):
    pytest.importorskip("torch")
    from tests.engine.multiproc import run_ranks

    ((size, params),) = run_ranks(_checkpoint_bytes, 1, str(tmp_path))
    assert params * scratch.CHECKPOINT_BYTES_PER_PARAM <= size < params * scratch.CHECKPOINT_BYTES_PER_PARAM * 1.02


def test_a_rollout_record_stays_within_its_bytes_per_token():
    """rollouts/iter-N.json as the trainer writes it (trainer/loop.py: _score), at its widest: six-digit token ids,
    log-probabilities whose repr is longest, maxSeq tokens."""
    max_seq, prompt = 512, 64
    record = {"id": "511.15", "prompt": [128255] * prompt, "tokens": [128255] * (max_seq - prompt),
              "logprobs": [-2.2250738585072014e-308] * (max_seq - prompt), "policy_version": 100000,
              "reward": -1.2345678901234567}
    assert len(json.dumps([record, record])) / 2 <= max_seq * scratch.ROLLOUT_BYTES_PER_TOKEN + \
        scratch.ROLLOUT_BYTES_PER_SEQUENCE


# --- gang schedulers -------------------------------------------------------------------------------------------------

def gang_of(j) -> dict:
    """What each gang scheduler sees: the PodGroups, and each pod's schedulerName, gang labels and annotations."""
    objects = [o for o in builders.job_objects(j, UID, b"k" * 32) if o["kind"] == "PodGroup"]
    pod = pods(j)[0]
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if "scheduling" in k or "kueue" in k}
    return {"podgroups": {o["apiVersion"]: o["spec"] for o in objects}, "labels": labels,
            "schedulerName": pod["spec"].get("schedulerName"), "annotations": pod["metadata"].get("annotations", {})}


def test_without_a_gang_scheduler_the_pods_carry_no_gang_metadata():
    assert gang_of(job()) == {"podgroups": {}, "schedulerName": None, "labels": {}, "annotations": {}}


def test_the_gang_scheduler_is_inferred_from_queue_name_and_scheduler_name_as_before():
    kueue = gang_of(job(scheduling={"queueName": "team-a"}))
    assert kueue["podgroups"] == {} and kueue["labels"][builders.KUEUE_QUEUE] == "team-a"
    assert kueue["annotations"] == {builders.KUEUE_TOTAL: "2"}
    volcano = gang_of(job(scheduling={"schedulerName": "volcano", "queueName": "team-a"}))  # both, as before
    assert volcano["podgroups"] == {"scheduling.volcano.sh/v1beta1": {"minMember": 2, "queue": "team-a"}}
    assert builders.KUEUE_QUEUE in volcano["labels"] and builders.VOLCANO_GROUP in volcano["annotations"]


def test_an_explicit_gang_scheduler_is_the_only_one():
    volcano = gang_of(job(scheduling={"gangScheduler": "volcano", "queueName": "research"}))
    assert volcano["schedulerName"] == "volcano"  # its default scheduler name
    assert volcano["podgroups"] == {"scheduling.volcano.sh/v1beta1": {"minMember": 2, "queue": "research"}}
    assert volcano["labels"] == {}  # queueName is Volcano's queue here, not a Kueue LocalQueue


def test_coscheduling_gets_scheduler_plugins_podgroup_and_its_pods_the_label():
    j = job(scheduling={"gangScheduler": "coscheduling", "schedulerName": "scheduler-plugins-scheduler"},
            runPolicy={"schedulingTimeoutSeconds": 120}, generator={"replicas": 3})
    gang = gang_of(j)
    assert gang["podgroups"] == {"scheduling.x-k8s.io/v1alpha1": {"minMember": 4, "scheduleTimeoutSeconds": 120}}
    (group,) = [o for o in builders.job_objects(j, UID, b"k" * 32) if o["kind"] == "PodGroup"]
    assert gang["labels"] == {builders.COSCHEDULING_GROUP: group["metadata"]["name"]}
    assert {p["metadata"]["labels"][builders.COSCHEDULING_GROUP] for p in pods(j)} == {group["metadata"]["name"]}
    assert gang["schedulerName"] == "scheduler-plugins-scheduler" and gang["annotations"] == {}
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID
    assert builders.CUSTOM_RESOURCES[(group["apiVersion"], "PodGroup")] == ("scheduling.x-k8s.io", "v1alpha1",
                                                                           "podgroups")
    untimed = job(scheduling={"gangScheduler": "coscheduling"})  # the plugin's own timeout
    assert gang_of(untimed)["podgroups"] == {"scheduling.x-k8s.io/v1alpha1": {"minMember": 2}}
    assert gang_of(job(scheduling={"gangScheduler": "coscheduling", "gang": True}))["schedulerName"] is None


def test_the_coscheduling_group_label_fits_for_the_longest_job_name():
    j = job(name="g" * 63, scheduling={"gangScheduler": "coscheduling"})
    (group,) = [o for o in builders.job_objects(j, UID, b"k" * 32) if o["kind"] == "PodGroup"]
    assert len(group["metadata"]["name"]) <= 63
    assert pods(j)[0]["metadata"]["labels"][builders.COSCHEDULING_GROUP] == group["metadata"]["name"]


@pytest.mark.parametrize("scheduling, error", [
    ({"gang": False, "gangScheduler": "kueue", "queueName": "q"},
     "scheduling.gangScheduler=kueue places the pods as a gang, and scheduling.gang is false"),
    ({"gangScheduler": "kueue"}, "scheduling.gangScheduler=kueue needs scheduling.queueName"),
    ({"gangScheduler": "coscheduling", "queueName": "q"},
     "scheduling.queueName=q is a Kueue or Volcano queue, and gangScheduler=coscheduling has none"),
    ({"gangScheduler": "coscheduling", "schedulerName": "volcano"},
     "scheduling.schedulerName=volcano ignores scheduler-plugins' PodGroup"),
    ({"gangScheduler": "yunikorn"}, "spec.scheduling.gangScheduler: Input should be 'kueue', 'volcano' or "
                                    "'coscheduling'"),
])
def test_gang_scheduler_combinations_that_cannot_work_are_refused(scheduling, error):
    with pytest.raises(JobSpecError) as e:
        job(scheduling=scheduling)
    assert error in str(e.value)


def test_the_combinations_next_to_the_refused_ones_are_accepted():
    for scheduling in ({"gang": False}, {"gangScheduler": "kueue", "queueName": "q"},
                       {"gangScheduler": "coscheduling", "schedulerName": "scheduler-plugins-scheduler"},
                       {"gangScheduler": "volcano", "schedulerName": "volcano-gpu"}):
        assert job(scheduling=scheduling).spec.scheduling.gang_scheduler == scheduling.get("gangScheduler")


# --- NetworkPolicy ---------------------------------------------------------------------------------------------------

PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pat-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pat-operator"}}}


def test_the_network_policy_admits_the_jobs_pods_everywhere_and_the_peers_on_the_http_ports():
    j = job(generator={"port": 8080})
    policy = builders.network_policy(j, UID, (OPERATOR, PROMETHEUS))
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["metadata"]["ownerReferences"][0]["uid"] == UID
    own = {"matchLabels": {builders.LABEL_JOB: j.metadata.name}}
    http = [{"protocol": "TCP", "port": 8080}, {"protocol": "TCP", "port": builders.TRAINER_METRICS_PORT}]
    assert policy["spec"] == {
        "podSelector": own, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": own}]},  # every port: rendezvous, weight-sync store, NCCL, gloo
                    {"from": [OPERATOR, PROMETHEUS], "ports": http}]}
    # The pods it selects are the job's: every pod the job makes carries the label.
    assert all(p["metadata"]["labels"][builders.LABEL_JOB] == j.metadata.name for p in pods(j))


@pytest.mark.parametrize("version", ["1.30.0", "1.34.0"])
def test_the_network_policy_validates_strictly(version):
    """Against Kubernetes' OpenAPI schemas (kubernetes-validate, as tests/unit/test_k8s_schemas.py checks pods);
    the same check refuses a policy one misspelled field away (negative control)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    policy = builders.network_policy(job(), UID, (OPERATOR, PROMETHEUS))
    kubernetes_validate.validate(policy, version, strict=True)
    policy["spec"]["ingress"][1]["ports"][0]["prot"] = "TCP"
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        kubernetes_validate.validate(policy, version, strict=True)


def test_without_peers_only_the_jobs_own_pods_are_admitted():
    """A rule with an empty `from` would admit every source: no peers, no second rule."""
    policy = builders.network_policy(job(), UID, ())
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": policy["spec"]["podSelector"]}]}]


# --- job names ---------------------------------------------------------------------------------------------------

# Names the CRD accepts: DNS labels starting with a letter, up to 63 characters (the CRD's CEL rule and the models).
VALID_NAMES = ["a", "grpo", "a1", "x" * 63, "llama-3-1-8b-grpo-math", "a-" * 31 + "b", "z9" * 31 + "q", "m-0-0"]
INVALID_NAMES = ["grpo.v2", "3d-grpo", "0", "Grpo", "-grpo", "grpo-", "x" * 64, "a_b"]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_names_are_accepted(name):
    assert job(name=name).metadata.name == name


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_names_whose_children_kubernetes_refuses_are_refused_naming_the_rule(name):
    with pytest.raises(JobSpecError) as e:
        job(name=name)
    assert f"metadata.name: {name!r}: use a DNS label that starts with a letter" in str(e.value)
