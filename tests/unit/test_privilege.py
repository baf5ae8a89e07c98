"""A job's own pod fields cannot give its pods access to their node: `pat validate` (and the operator, through the
same api.privileged_fields) refuses hostPath volumes, naming each field and the fix, unless privileged pods are
allowed; the rest of what Pod Security's baseline level forbids a job cannot express at all."""

import copy
from pathlib import Path

import pytest
import yaml

from pat_operator import builders
from pat_operator.api import JobSpecError, parse_job, privileged_fields, require_unprivileged
from pat_workers.cli import main as pat

ROOT = Path(__file__).parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
HOST = {"hostPath": {"path": "/var/lib/data"}}
MOUNT = [{"name": "data", "mountPath": "/data"}]


def doc(**spec_edits) -> dict:
    d = copy.deepcopy(EXAMPLE)
    d["spec"]["placement"] = "separate"
    for key, value in spec_edits.items():
        d["spec"][key] = {**d["spec"].get(key, {}), **value}
    return d


@pytest.mark.parametrize("edits, fields", [
    ({"generator": {"volumes": [{"name": "data", **HOST}], "volumeMounts": MOUNT}},
     ["spec.generator.volumes[0].hostPath"]),
    ({"trainer": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "data", **HOST}], "volumeMounts": MOUNT}},
     ["spec.trainer.volumes[1].hostPath"]),
    ({"model": {"tiny": None, "path": "/models/m", "volume": HOST}}, ["spec.model.volume.hostPath"]),
    ({"checkpoint": {"volume": HOST}}, ["spec.checkpoint.volume.hostPath"]),
    # an API server before 1.23 decoded JSON keys case-insensitively: HostPath was a hostPath there
    ({"generator": {"volumes": [{"name": "data", "HostPath": {"path": "/"}}], "volumeMounts": MOUNT}},
     ["spec.generator.volumes[0].HostPath"]),
    ({"generator": {"volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": MOUNT},  # negative control
      "checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "run"}}}}, []),
])
def test_privileged_fields_names_every_host_path(edits, fields):
    assert privileged_fields(parse_job(doc(**edits)).spec) == fields


def test_a_colocated_job_reports_the_trainer_volumes_its_pods_mount():
    d = doc(trainer={"volumes": [{"name": "data", **HOST}], "volumeMounts": MOUNT})
    d["spec"]["placement"] = "colocated"
    d["spec"]["trainer"] = {k: v for k, v in d["spec"]["trainer"].items() if k in ("volumes", "volumeMounts")}
    j = parse_job(d)
    assert privileged_fields(j.spec) == ["spec.trainer.volumes[0].hostPath"]
    (pod,) = [builders.pod(j, "u", role, i, 0) for role, i in builders.expected_pods(j)]
    assert {"name": "data", **HOST} in pod["spec"]["volumes"]  # what it would have given


def test_the_error_names_the_field_and_both_fixes():
    j = parse_job(doc(generator={"volumes": [{"name": "data", **HOST}], "volumeMounts": MOUNT}))
    with pytest.raises(JobSpecError) as e:
        require_unprivileged(j.spec, "job.yaml")
    message = str(e.value)
    assert message.startswith("job.yaml is invalid:\n  spec.generator.volumes[0].hostPath: a hostPath volume")
    assert "pat validate --allow-privileged-pods" in message and "jobPods.allowPrivileged" in message


def write(tmp_path: Path, d: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_pat_validate_refuses_a_host_path_unless_privileged_pods_are_allowed(tmp_path, capsys):
    path = write(tmp_path, doc(generator={"volumes": [{"name": "data", **HOST}], "volumeMounts": MOUNT}))
    assert pat(["validate", path]) == 2
    assert "spec.generator.volumes[0].hostPath: a hostPath volume" in capsys.readouterr().err
    assert pat(["validate", "--allow-privileged-pods", path]) == 0
    assert capsys.readouterr().out == f"RLHFJob {EXAMPLE['metadata']['name']}: valid\n"


def test_pat_validate_accepts_an_empty_dir(tmp_path, capsys):
    path = write(tmp_path, doc(generator={"volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": MOUNT}))
    assert pat(["validate", path]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("template, field", [
    ({"securityContext": {"privileged": True}}, "securityContext"),
    ({"hostNetwork": True}, "hostNetwork"),
    ({"hostPID": True}, "hostPID"),
    ({"hostIPC": True}, "hostIPC"),
])
def test_the_rest_of_what_baseline_forbids_cannot_be_set(template, field):
    with pytest.raises(JobSpecError, match=rf"spec.generator.{field}: unknown field"):
        parse_job(doc(generator=template))


def test_the_builders_pods_ask_for_no_privilege():
    d = doc()
    d["metadata"]["namespace"] = "team"
    j = parse_job(d)
    for role, i in builders.expected_pods(j):
        pod = builders.pod(j, "u", role, i, 0)["spec"]
        assert not {"hostNetwork", "hostPID", "hostIPC"} & pod.keys()
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
            assert not any("hostPort" in p for p in c.get("ports", []))
