"""`pat manifests`: every object the operator would create for a job, from the operator's own builders."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pat_workers.cli import main as pat

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_example_prints_its_objects(example, capsys):
    assert pat(["manifests", str(example), "--namespace", "team-a"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    job = yaml.safe_load(example.read_text())
    name, spec = job["metadata"]["name"], job["spec"]
    kinds = [o["kind"] for o in objects]
    assert kinds[:3] == ["ConfigMap", "Secret", "Service"]
    pods = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
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
