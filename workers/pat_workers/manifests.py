"""What `pat manifests` prints and `pat validate` checks: every object the operator would create for a job, and
where one would be refused by a Kubernetes API server (its OpenAPI schema, strictly: kubernetes-validate's copies)
named as the spec field the user wrote, so a bad pass-through object (an affinity, a volume, an env valueFrom)
is refused before the job is applied, not at pod creation."""

from __future__ import annotations

import re
from typing import Any

from pat_operator import builders
from pat_operator.api import RLHFJob

# Stand-ins for what the API server (the job's uid) and the operator's key (the pods' tokens) make.
UID, KEY = "00000000-0000-0000-0000-000000000000", b"pat manifests: a stand-in for the operator's key"
TOKEN = "<derived by the operator from its key and the job's uid>"
KUBERNETES_VERSION = "1.30.0"  # the oldest release the docs say was tested; a field it lacks is refused


def objects(job: RLHFJob) -> list[dict[str, Any]]:
    """The operator's own builders, at the gang's first attempt."""
    made = builders.job_objects(job, UID, KEY) + [builders.pod(job, UID, role, i, 0)
                                                  for role, i in builders.expected_pods(job)]
    for obj in made:
        if obj["kind"] == "Secret":
            obj["stringData"] = {key: TOKEN for key in obj["stringData"]}
    return made


def kubernetes_errors(job: RLHFJob, version: str = KUBERNETES_VERSION) -> list[str]:
    """One line per object a Kubernetes `version` API server would refuse (its first error): the spec field and
    the schema's complaint."""
    import kubernetes_validate  # 100 MB of schemas: only for this check

    refused: dict[str, list[str]] = {}  # "field: complaint" -> the objects refused for it
    for obj in objects(job):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            continue  # a custom resource (Volcano's PodGroup): its CRD's schema is on the cluster only
        except kubernetes_validate.ValidationError as e:
            refused.setdefault(f"{spec_field(job, obj, list(e.path))}: {e.message}", []).append(
                f"{obj['kind']} {obj['metadata']['name']}")
    return [f"{error} (Kubernetes {version}, in {', '.join(where)})" for error, where in refused.items()]


def kubernetes_version_error(version: str) -> str | None:
    """Why `version` cannot be checked (not a release kubernetes-validate has schemas for), else None."""
    from kubernetes_validate import utils

    if not re.fullmatch(r"1\.\d+(\.\d+)?", version):
        return "give a release like 1.30 or 1.30.0"
    minor = [int(v.split(".")[1]) for v in (utils.all_versions()[0], utils.all_versions()[-1], version)]
    if not minor[0] <= minor[2] <= minor[1]:
        return f"the schemas at hand cover Kubernetes 1.{minor[0]} to 1.{minor[1]}"
    return None


def spec_field(job: RLHFJob, obj: dict[str, Any], path: list[str | int]) -> str:
    """The spec field a pod's part came from where the user wrote it whole (an affinity, a volume, an env entry),
    else the path in the object."""
    def at(parts: list[str | int]) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)

    if obj["kind"] == "Pod" and path[:1] == ["spec"]:
        role = obj["metadata"]["labels"][builders.LABEL_ROLE]
        role = "generator" if role == builders.WORKER else role  # a colocated pod has the generator's settings
        template = getattr(job.spec, role)
        if path[1:2] == ["affinity"]:
            return f"spec.{role}.affinity{at(path[2:])}"
        if path[1:2] == ["volumes"] and len(path) > 2:
            name = obj["spec"]["volumes"][path[2]].get("name")
            mine = [v.get("name") for v in template.volumes]
            if name in mine:
                return f"spec.{role}.volumes[{mine.index(name)}]{at(path[3:])}"
            origin = {"model": "spec.model.volume", "run": "spec.checkpoint.volume"}.get(name)
            if origin:
                return origin + at(path[3:])
        if path[1:2] == ["containers"] and path[3:4] == ["env"] and len(path) > 4:
            name = obj["spec"]["containers"][path[2]]["env"][path[4]].get("name")
            mine = [e.name for e in template.env]
            if name in mine:
                return f"spec.{role}.env[{mine.index(name)}]{at(path[5:])}"
    return f"{obj['kind']} {obj['metadata']['name']}: {at(path).lstrip('.')}"
