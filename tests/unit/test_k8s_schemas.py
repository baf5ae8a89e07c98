"""Every object the operator creates for every example (`pat manifests`) validates strictly against the
Kubernetes 1.30 and 1.34 OpenAPI schemas (kubernetes-validate's bundled copies): an unknown field, a wrong type or
a bad enum value there would be refused by a real API server at pod creation, after the job was accepted."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pat_workers.cli import main as pat

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
VERSIONS = ("1.30.0", "1.34.0")


def strictly_valid(obj: dict, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def manifests(example: Path, capsys) -> list[dict]:
    assert pat(["manifests", str(example)]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_object_of_every_example_validates_strictly(example, capsys):
    objects = manifests(example, capsys)
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Secret", "Service", "Pod"}
    for obj in objects:
        for version in VERSIONS:
            strictly_valid(obj, version)


@pytest.mark.parametrize("break_it, path", [
    (lambda pod: pod["spec"]["containers"][0].update(bogus=1), "bogus"),
    (lambda pod: pod["spec"]["containers"][0].update(imagePullPolicy=3), "imagePullPolicy"),
    (lambda pod: pod["spec"].update(restartPolicy=["Never"]), "restartPolicy"),
], ids=["unknown-field", "wrong-type", "wrong-type-list"])
def test_the_schemas_refuse_a_broken_pod(break_it, path, capsys):
    """The negative control: the same check fails on a pod one edit away from the operator's."""
    pod = next(o for o in manifests(EXAMPLES[0], capsys) if o["kind"] == "Pod")
    strictly_valid(pod, VERSIONS[0])
    broken = copy.deepcopy(pod)
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError, match=path):
        strictly_valid(broken, VERSIONS[0])
