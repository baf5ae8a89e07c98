"""`pat manifests`: every object the operator would create for a job, from the operator's own builders."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml

from pat_operator.api import load_job
from pat_workers.cli import main as pat
from pat_workers.manifests import objects, spec_field

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_example_prints_its_objects(example, capsys):
    assert pat(["manifests", str(example), "--namespace", "team-a"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    job = yaml.safe_load(example.read_text())
    name, spec = job["metadata"]["name"], job["spec"]
    kinds = [o["kind"] for o in objects]
    assert kinds[:3] == ["ConfigMap", "Secret", "Service"]
    pods = [o["metadata"]["name"].rsplit("-", 1)[0] for o in objects if o["kind"] == "Pod"]  # less the attempt's hash
    if spec.get("placement", "colocated") == "colocated":  # one gang of pods, both roles in each
        assert pods == [f"{name}-worker-{i}" for i in range(spec["generator"].get("replicas", 1))]
    else:
        assert pods == [f"{name}-trainer-{i}" for i in range(spec["trainer"].get("replicas", 1))] + \
            [f"{name}-generator-{i}" for i in range(spec["generator"].get("replicas", 1))]
    assert all(o["metadata"]["namespace"] == "team-a" for o in objects)
    assert all(o["metadata"]["ownerReferences"][0]["name"] == name for o in objects)


def test_an_invalid_job_is_refused_naming_the_field(tmp_path, capsys):
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    doc["spec"]["generator"]["replicas"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert pat(["manifests", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "spec.generator.replicas" in captured.err


@pytest.mark.parametrize("version, error", [
    ("1.20", "cover Kubernetes 1.25 to 1.37"), ("1.100", "cover Kubernetes 1.25"), ("latest", "like 1.30"),
    ("1.34", None), ("1.30.0", None)])
def test_pat_validate_checks_the_objects_against_a_known_release(version, error, capsys):
    with pytest.raises(SystemExit) if error else contextlib.nullcontext():
        assert pat(["validate", "--kubernetes-version", version, str(EXAMPLES[0])]) == 0
    if error:
        assert f"--kubernetes-version {version}: " in (err := capsys.readouterr().err) and error in err, err


def test_a_refusal_outside_what_the_user_wrote_names_the_object_and_its_path():
    job = load_job(str(EXAMPLES[0]))
    pod = next(o for o in objects(job) if o["kind"] == "Pod")
    assert spec_field(job, pod, ["spec", "containers", 0, "bogus"]) == \
        f"Pod {pod['metadata']['name']}: spec.containers[0].bogus"
    role = pod["metadata"]["labels"]["pat.dev/role"]
    assert spec_field(job, pod, ["spec", "affinity", "podAffinity"]) == \
        f"spec.{'generator' if role == 'worker' else role}.affinity.podAffinity"  # a colocated pod: generator's
