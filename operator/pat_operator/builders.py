"""Pure builders of what the operator creates for an RLHFJob: manifests as plain dicts, from the validated job.

Everything a job owns carries an ownerReference to it (the garbage collector removes it with the job) and the
job's labels. Pods of one attempt (a gang restart makes a new attempt) share an attempt label, so a pod of an
earlier attempt is never mistaken for a current one.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import yaml
from kubernetes.utils import parse_quantity

from . import commands, scratch
from .api import API_VERSION, GPU_RESOURCE, KIND, PodTemplate, RLHFJob

LABEL_JOB = "pat.dev/job"
LABEL_ROLE = "pat.dev/role"
LABEL_INDEX = "pat.dev/index"
LABEL_ATTEMPT = "pat.dev/attempt"
LABEL_INCARNATION = "pat.dev/incarnation"  # a generator pod restarted alone within an attempt: its count
ROLES = ("trainer", "generator")
WORKER = "worker"  # the role of a colocated job's pods: both roles in one pod

SPEC_FILE = "/etc/pat/job.yaml"
WORK_DIR = "/var/lib/pat/work"  # the tiny model is built here by the init container
TRAINER_METRICS_PORT = 9100
MASTER_PORT = 29500
RUN_AS = 1000  # the images' non-root user
VOLCANO_PODGROUP = ("scheduling.volcano.sh", "v1beta1", "podgroups")
COSCHEDULING_PODGROUP = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")  # scheduler-plugins' coscheduling
# The custom resources the operator creates, by (apiVersion, kind): (group, version, plural) for CustomObjectsApi.
CUSTOM_RESOURCES = {(f"{group}/{version}", "PodGroup"): (group, version, plural)
                    for group, version, plural in (VOLCANO_PODGROUP, COSCHEDULING_PODGROUP)}
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
VOLCANO_GROUP = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP = "scheduling.x-k8s.io/pod-group"  # the pod label that names its coscheduling PodGroup

Manifest = dict[str, Any]


def job_token(key: bytes, uid: str, purpose: str = "control") -> str:
    """The job's bearer token for `purpose`: derived from the operator's key and the job's uid, so the operator never
    needs to read a Secret back (its RBAC can create Secrets but not read any). control: every endpoint of the pods
    (the operator and the trainer); inference: rollouts only."""
    message = f"pat-job-token/{uid}" if purpose == "control" else f"pat-job-token/{uid}/{purpose}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def uid_suffix(uid: str) -> str:
    """5 hex characters of the job's uid: in every child's name, so that a job deleted and re-created under the same
    name never takes the old one's objects (still there until the garbage collector removes them) for its own."""
    return hashlib.sha256(uid.encode()).hexdigest()[:5]


def names(job: RLHFJob, uid: str) -> dict[str, str]:
    n, h = job.metadata.name, uid_suffix(uid)
    # The Service names the pods' subdomain: a DNS label.
    return {"spec": f"{n}-spec-{h}", "token": f"{n}-token-{h}", "service": fit_label(f"{n}-{h}"),
            "podgroup": f"{n}-{h}"}


DNS_LABEL_MAX = 63  # a hostname, a label value


def fit_label(name: str, limit: int = DNS_LABEL_MAX) -> str:
    """`name`, or when longer than `limit` its start and a stable hash of the whole (`<start>-<8 hex>`): a valid
    DNS label or label value for any valid job name (one of 63 characters makes `<job>-generator-0` 73)."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:limit - 9].rstrip('-.')}-{digest}"


def pod_name(job: RLHFJob, uid: str, role: str, index: int, attempt: int, incarnation: int = 0) -> str:
    """The pod's name (a DNS subdomain: up to 253 characters, so the job's whole name fits), unique per job uid,
    attempt and incarnation: the next attempt never waits for a name still held (Terminating, a finalizer), nor
    takes an old pod for its own."""
    digest = hashlib.sha256(f"{uid}/{attempt}/{incarnation}".encode()).hexdigest()[:5]
    return f"{job.metadata.name}-{role}-{index}-{digest}"


def pod_hostname(job: RLHFJob, role: str, index: int) -> str:
    """The pod's hostname, a DNS label, the same for every attempt: `<job>-<role>-<index>`, shortened when longer
    than 63 characters."""
    return fit_label(f"{job.metadata.name}-{role}-{index}")


def pod_host(job: RLHFJob, uid: str, role: str, index: int) -> str:
    """The pod's DNS name through the job's headless Service: stable across attempts and a generator's restarts."""
    return f"{pod_hostname(job, role, index)}.{names(job, uid)['service']}.{job.metadata.namespace}.svc"


def expected_pods(job: RLHFJob) -> list[tuple[str, int]]:
    s = job.spec
    if s.placement == "colocated":
        return [(WORKER, i) for i in range(s.generator.replicas)]
    return [("trainer", i) for i in range(s.trainer.replicas)] + [("generator", i) for i in range(s.generator.replicas)]


def serves(pod_role: str, role: str) -> bool:
    """Whether a pod of role label `pod_role` runs `role` (trainer or generator): a colocated pod runs both."""
    return pod_role in (role, WORKER)


def labels(job: RLHFJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pat", "app.kubernetes.io/managed-by": "pat-operator",
            "app.kubernetes.io/instance": job.metadata.name, LABEL_JOB: job.metadata.name}


def owner(job: RLHFJob, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.metadata.name, "uid": uid, "controller": True,
            "blockOwnerDeletion": True}


def _meta(job: RLHFJob, uid: str, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": job.metadata.namespace, "labels": {**labels(job), **(extra_labels or {})},
            "ownerReferences": [owner(job, uid)]}


def spec_configmap(job: RLHFJob, uid: str) -> Manifest:
    """The validated job with every default filled in: what the workers read (and what the operator acts on)."""
    doc = job.model_dump(by_alias=True, exclude_none=True, exclude={"status"})
    doc["metadata"] = {"name": job.metadata.name, "namespace": job.metadata.namespace}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, uid, names(job, uid)["spec"]),
            "data": {"job.yaml": yaml.safe_dump(doc, sort_keys=False)}}


def token_secret(job: RLHFJob, uid: str, key: bytes) -> Manifest:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(job, uid, names(job, uid)["token"]),
            "stringData": {"token": job_token(key, uid), "inference-token": job_token(key, uid, "inference")}}


def headless_service(job: RLHFJob, uid: str) -> Manifest:
    """DNS names for the pods (trainer rendezvous, generator URLs), also before they are ready."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, uid, names(job, uid)["service"]),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LABEL_JOB: job.metadata.name},
                     "ports": [{"name": "generator", "port": job.spec.generator.port},
                               {"name": "metrics", "port": TRAINER_METRICS_PORT}]}}


def network_policy(job: RLHFJob, uid: str, peers: tuple[dict[str, Any], ...]) -> Manifest:
    """Who may connect to the job's pods: the job's own pods on any port (torchrun's rendezvous, the weight-sync
    store, NCCL and gloo, which listen on ports of their choosing), and `peers` (NetworkPolicyPeers: the operator,
    Prometheus) on the generators' HTTP port and the trainer's metrics port only. Ingress only: where the pods may
    connect to (a model hub, a bucket) is the cluster's policy. Named as the Service, which fronts the same pods."""
    own = {"podSelector": {"matchLabels": {LABEL_JOB: job.metadata.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if peers:  # a rule without `from` would admit every source
        ingress.append({"from": list(peers), "ports": [{"protocol": "TCP", "port": port}
                                                       for port in (job.spec.generator.port, TRAINER_METRICS_PORT)]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, uid, names(job, uid)["service"]),
            "spec": {"podSelector": own["podSelector"], "policyTypes": ["Ingress"], "ingress": ingress}}


def job_objects(job: RLHFJob, uid: str, key: bytes) -> list[Manifest]:
    """What the operator keeps for a job besides its pods: the spec ConfigMap, the token Secret, the headless
    Service, and the PodGroup of the gang scheduler (Volcano's or coscheduling's) when one is used."""
    return [m for m in (spec_configmap(job, uid), token_secret(job, uid, key), headless_service(job, uid),
                        volcano_podgroup(job, uid), coscheduling_podgroup(job, uid)) if m]


def volcano_podgroup(job: RLHFJob, uid: str) -> Manifest | None:
    """Volcano's PodGroup: no pod of the gang runs before all can (minMember), in the Volcano queue queueName."""
    sched = job.spec.scheduling
    if "volcano" not in sched.gang_schedulers:
        return None
    group, version, _ = VOLCANO_PODGROUP
    spec: dict[str, Any] = {"minMember": len(expected_pods(job))}
    if sched.queue_name:
        spec["queue"] = sched.queue_name
    if sched.priority_class_name:
        spec["priorityClassName"] = sched.priority_class_name
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": _meta(job, uid, names(job, uid)["podgroup"]),
            "spec": spec}


def coscheduling_podgroup(job: RLHFJob, uid: str) -> Manifest | None:
    """scheduler-plugins' PodGroup (the coscheduling plugin): no pod of the gang is bound to a node before all can be
    (minMember), and pods held at the plugin's Permit stage give their nodes back after scheduleTimeoutSeconds
    (runPolicy.schedulingTimeoutSeconds; the plugin's own default without it)."""
    if "coscheduling" not in job.spec.scheduling.gang_schedulers:
        return None
    group, version, _ = COSCHEDULING_PODGROUP
    spec: dict[str, Any] = {"minMember": len(expected_pods(job))}
    if (timeout := job.spec.run_policy.scheduling_timeout_seconds) is not None:
        spec["scheduleTimeoutSeconds"] = timeout
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup",
            "metadata": _meta(job, uid, _coscheduling_group(job, uid)), "spec": spec}


def _coscheduling_group(job: RLHFJob, uid: str) -> str:
    """The coscheduling PodGroup's name, which its pods' label holds: a label value (63 characters at most)."""
    return fit_label(names(job, uid)["podgroup"])


def pod(job: RLHFJob, uid: str, role: str, index: int, attempt: int, incarnation: int = 0) -> Manifest:
    """One pod of the gang. Non-root, read-only root filesystem, no service-account token: a worker needs no
    Kubernetes API access. A colocated job's pods (role worker) run both roles, with the generator's pod settings and
    the trainer's env and volumes added."""
    spec, name = job.spec, pod_name(job, uid, role, index, attempt, incarnation)
    template: PodTemplate = spec.trainer if role == "trainer" else spec.generator
    extra: list[PodTemplate] = [spec.trainer] if role == WORKER else []
    model_dir = spec.model.path or f"{WORK_DIR}/model"
    run_dir = spec.checkpoint.path
    env = [
        _field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        _secret_env("PAT_JOB_TOKEN", names(job, uid)["token"], "token"),
        _secret_env("PAT_INFERENCE_TOKEN", names(job, uid)["token"], "inference-token"),
        {"name": "PAT_ATTEMPT", "value": str(attempt)},
        {"name": "HOME", "value": "/tmp"},
    ]
    # Scratch on the node's disk, each folder within what its writers explain (scratch.py), unless the user sized
    # the pod's ephemeral storage; the pod requests their sum. /dev/shm is memory: it counts in the memory limit.
    sized = not scratch.user_sized(template)
    scratch_bytes = {"work": scratch.work_bytes(spec), "tmp": int(parse_quantity(template.tmp_size))}
    mounts = [{"name": "spec", "mountPath": "/etc/pat", "readOnly": True},
              {"name": "work", "mountPath": WORK_DIR}, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": names(job, uid)["spec"]}},
        {"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
        # torchrun's ranks and NCCL (trainer), the engine ranks' shared-memory communicators (generator) need more
        # than the runtime's 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(template.shm_size)}}]
    if spec.model.volume is not None:
        mounts.append({"name": "model", "mountPath": spec.model.mount_path, "readOnly": True})
        volumes.append({"name": "model", **spec.model.volume})
    trainer_metrics = TRAINER_METRICS_PORT if index == 0 else 0
    generators = [f"http://{pod_host(job, uid, serving, i)}:{spec.generator.port}"
                  for serving, i in expected_pods(job) if serves(serving, "generator")]
    ports, probe = [], None
    if serves(role, "trainer"):
        if role == WORKER:
            args = commands.colocated_args(spec, SPEC_FILE, model_dir, run_dir, generators, "$(POD_IP)", index,
                                           pod_host(job, uid, WORKER, 0), MASTER_PORT, "0.0.0.0",
                                           metrics_port=trainer_metrics, bind="0.0.0.0")
        else:
            args = commands.trainer_args(spec, SPEC_FILE, model_dir, run_dir, generators, "$(POD_IP)", index,
                                         pod_host(job, uid, "trainer", 0), MASTER_PORT, metrics_port=trainer_metrics,
                                         bind="0.0.0.0")
        if (threads := _threads_per_rank(template, spec.trainer.ranks)) is not None:
            env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
        ports.append({"name": "metrics", "containerPort": TRAINER_METRICS_PORT})
        mounts.append({"name": "run", "mountPath": run_dir})
        volumes.append({"name": "run", **(spec.checkpoint.volume or {"emptyDir": {}})})
        if spec.checkpoint.volume is None:
            scratch_bytes["run"] = scratch.run_bytes(spec)
    if serves(role, "generator"):
        if role != WORKER:
            # All addresses, as on any node: the pod's network namespace holds only its pod IP and its own loopback.
            args = commands.generator_args(spec, model_dir, "0.0.0.0", weights_store=pod_host(job, uid, "trainer", 0))
        ports.append({"name": "http", "containerPort": spec.generator.port})
        probe = {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2, "failureThreshold": 1}
    if sized:
        for volume in volumes:
            if (nbytes := scratch_bytes.get(volume["name"])) is not None and "emptyDir" in volume:
                volume["emptyDir"]["sizeLimit"] = _mib(nbytes)
    for t in (template, *extra):
        env += [e.model_dump(by_alias=True, exclude_none=True) for e in t.env]
        mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in t.volume_mounts]
        volumes += [v for v in t.volumes if v["name"] not in {w["name"] for w in volumes}]
    container: dict[str, Any] = {
        "name": role, "image": template.image, "imagePullPolicy": template.image_pull_policy,
        "command": template.command or ["pat"], "env": env, "ports": ports, "volumeMounts": mounts,
        "resources": _resources(template, sum(filter(None, scratch_bytes.values())) if sized else None),
        "securityContext": _container_security(),
        # A failed worker's last words (its log's tail) become the container's termination message, and so the job's.
        "terminationMessagePolicy": "FallbackToLogsOnError"}
    if template.command is None:
        container["args"] = args
    if probe is not None:
        container["readinessProbe"] = probe
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts the whole gang, never one pod
        "hostname": pod_hostname(job, role, index), "subdomain": names(job, uid)["service"],
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container], "volumes": volumes}
    if spec.model.tiny is not None and template.command is None:
        pod_spec["initContainers"] = [{
            "name": "prepare", "image": template.image, "imagePullPolicy": template.image_pull_policy,
            "command": ["pat"], "args": commands.prepare_args(SPEC_FILE, model_dir),
            "env": [{"name": "HOME", "value": "/tmp"}], "volumeMounts": mounts[:3],
            "securityContext": _container_security(), "terminationMessagePolicy": "FallbackToLogsOnError"}]
    sched = spec.scheduling
    for key, value in (("schedulerName", sched.pod_scheduler_name), ("priorityClassName", sched.priority_class_name)):
        if value:
            pod_spec[key] = value
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations]
    if template.affinity:
        pod_spec["affinity"] = template.affinity
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [r.model_dump() for r in template.image_pull_secrets]
    meta = _meta(job, uid, name, {LABEL_ROLE: role, LABEL_INDEX: str(index), LABEL_ATTEMPT: str(attempt),
                                  LABEL_INCARNATION: str(incarnation)})
    meta.update(_gang_metadata(job, uid, attempt, meta["labels"]))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _gang_metadata(job: RLHFJob, uid: str, attempt: int, pod_labels: dict[str, str]) -> dict[str, Any]:
    """Kueue plain-pod group (labels + total count), Volcano or coscheduling PodGroup membership, when used."""
    sched, annotations = job.spec.scheduling, {}
    if "kueue" in sched.gang_schedulers:
        pod_labels[KUEUE_QUEUE] = sched.queue_name
        pod_labels[KUEUE_GROUP] = fit_label(f"{job.metadata.name}-{uid_suffix(uid)}-{attempt}")
        annotations[KUEUE_TOTAL] = str(len(expected_pods(job)))
    if "volcano" in sched.gang_schedulers:
        annotations[VOLCANO_GROUP] = names(job, uid)["podgroup"]
    if "coscheduling" in sched.gang_schedulers:
        pod_labels[COSCHEDULING_GROUP] = _coscheduling_group(job, uid)
    return {"annotations": annotations} if annotations else {}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resources(template: PodTemplate, scratch_bytes: int | None) -> dict[str, Any]:
    """The user's resources, the GPUs, and an ephemeral-storage request of scratch_bytes (None: none)."""
    requests, limits = dict(template.resources.requests), dict(template.resources.limits)
    if template.gpus_per_pod:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = template.gpus_per_pod
    if scratch_bytes is not None:
        requests["ephemeral-storage"] = _mib(scratch_bytes)
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _mib(nbytes: int) -> str:
    """A quantity of at least nbytes, in whole MiB."""
    return f"{-(-nbytes // (1 << 20))}Mi"


def _threads_per_rank(template: PodTemplate, ranks: int) -> int | None:
    """Torch threads per trainer rank: the pod's CPUs shared by its ranks (torchrun would give each rank one
    thread, or all of the node's cores to a single rank). None: the pod asks for no CPUs."""
    cpus = template.resources.requests.get("cpu", template.resources.limits.get("cpu"))
    return None if cpus is None else max(1, int(parse_quantity(cpus) // ranks))


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
