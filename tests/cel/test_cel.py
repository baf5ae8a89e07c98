"""The CRD's CEL rules (x-kubernetes-validations, written by operator/pat_operator/crd.py) and its OpenAPI checks, run
by a real Kubernetes 1.36 API server (k8s.io/apiextensions-apiserver, see conftest.py), not by a model of one.

- the server accepts the CRD (every rule compiles and fits the CEL cost budget); a rule that does not compile or
  costs too much makes it refuse the CRD (negative controls, on a copy under another group);
- every rule of the generated CRD, enumerated from the schema, has an accepting and a refusing case, the refusal
  naming the rule's node and message: a new rule without cases fails here;
- only spec.runPolicy may change on an update (replace and merge patch), each immutable field refused by its rule;
- the invalid manifests marked `# crd:` in tests/unit/invalid/ are refused with that text, the others accepted
  (the operator refuses those); the examples, and what the models write back, are accepted unchanged.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pat_operator import api, crd
from pat_operator.api import JobSpecError, RLHFJobStatus, parse_job

from .conftest import Invalid, Jobs

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "tests" / "unit" / "invalid").glob("*.yaml"))
DELETE = object()  # in an edit: remove the field


def openapi_schema() -> dict:
    return crd.manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@dataclass(frozen=True)
class Rule:
    path: str  # the node that carries it, as the server names it in errors ("<nil>" for the root)
    rule: str
    message: str

    @property
    def transition(self) -> bool:  # an update-only rule: CEL skips oldSelf rules on create
        return "oldSelf" in self.rule

    @property
    def refusal(self) -> str:
        """How the server reports this rule failing."""
        return f"{self.path}: Invalid value: {self.message}"

    def __str__(self) -> str:
        return f"{self.path}: {self.message[:60]}"


def schema_rules() -> list[Rule]:
    """Every x-kubernetes-validations rule of the generated CRD."""
    out: list[Rule] = []

    def walk(node: dict, path: str) -> None:
        out.extend(Rule(path or "<nil>", r["rule"], r["message"]) for r in node.get("x-kubernetes-validations", []))
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}" if path else name)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[*]")

    walk(openapi_schema(), "")
    return out


RULES = schema_rules()


def example(base: str = "local", **metadata: Any) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / f"{base}.yaml").read_text())
    doc["metadata"].update(metadata)
    return doc


def edited(doc: dict, edits: dict[str, Any]) -> dict:
    """A copy of doc with each dotted path ("spec.generator.ranksPerPod") set, or removed for DELETE."""
    doc = copy.deepcopy(doc)
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = doc
        for name in parents:
            node = node.setdefault(name, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return doc


# --- the CRD itself ----------------------------------------------------------------------------------------------

def test_the_server_accepts_the_crd_with_every_rule(crd_server):
    stored = crd_server.crds[crd.NAME]
    conditions = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conditions["Established"] == conditions["NamesAccepted"] == "True"
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == openapi_schema()  # nothing dropped
    assert len(RULES) >= 30 and len({(r.path, r.message) for r in RULES}) == len(RULES)


def negative_control_crd(extra_rule: dict[str, str] | None = None, grid: bool = False) -> dict:
    """The CRD under another group (its name must change with it), plus what makes it wrong."""
    manifest = crd.manifest()
    manifest["metadata"]["name"] = f"{crd.PLURAL}.cel-negative.{api.GROUP}"
    manifest["spec"]["group"] = f"cel-negative.{api.GROUP}"
    spec = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    if grid:  # a list of lists without maxItems: the server prices a rule over it at the largest request possible
        spec["properties"]["grid"] = {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}
    if extra_rule:
        spec["x-kubernetes-validations"].append(extra_rule)
    return manifest


def create_crd(crd_server, manifest: dict) -> str | None:
    """None if the server would create the CRD (dry run), else its 422 message."""
    try:
        client.ApiextensionsV1Api(crd_server.api_client()).create_custom_resource_definition(
            manifest, dry_run="All", _preload_content=False)
    except client.ApiException as e:
        assert e.status == 422, e
        return json.loads(e.body)["message"]
    return None


def test_a_rule_that_does_not_compile_makes_the_crd_refused(crd_server):
    assert create_crd(crd_server, negative_control_crd()) is None  # the copy alone is fine
    refused = create_crd(crd_server, negative_control_crd({"rule": "self.modle == oldSelf.modle", "message": "m"}))
    assert refused and "compilation failed" in refused and "undefined field 'modle'" in refused, refused


def test_a_rule_too_costly_for_the_budget_makes_the_crd_refused(crd_server):
    cheap = {"rule": "!has(self.grid) || size(self.grid) < 3", "message": "m"}
    assert create_crd(crd_server, negative_control_crd(cheap, grid=True)) is None
    costly = {"rule": "!has(self.grid) || self.grid.all(r, r.all(x, self.grid.all(q, q.exists(y, y == x))))",
              "message": "m"}
    refused = create_crd(crd_server, negative_control_crd(costly, grid=True))
    assert refused and "estimated rule cost exceeds budget" in refused, refused


# --- each rule: an accepting and a refusing case -----------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A rule's cases: `good` passes it at its boundary, `bad` fails it; both are edits of an example."""
    path: str
    message: str  # the start of the rule's message
    bad: dict[str, Any]
    good: dict[str, Any]
    base: str = "local"  # examples/<base>.yaml: local (pat engine, CPU, 2 ranks per generator pod) or vllm
    also: dict[str, Any] = field(default_factory=dict)  # applied to both

    def matches(self, rule: Rule) -> bool:
        return rule.path == self.path and rule.message.startswith(self.message)


GPU = api.GPU_RESOURCE
# Generator pods on GPUs, colocated: examples/local.yaml's trainer (gpusPerPod: 0, for placement separate) goes.
ON_GPUS = {"spec.trainer": DELETE}
CASES = [
    Case("<nil>", "metadata.name: use a DNS label",  # a DNS subdomain passes the server's own name check
         bad={"metadata.name": "job.v1"}, good={"metadata.name": "job-v1"}),
    Case("<nil>", "metadata.name: use a DNS label",  # 64 characters, still a valid subdomain
         bad={"metadata.name": "a" * 64}, good={"metadata.name": "a" * 63}),
    Case("<nil>", "metadata.name: use a DNS label",  # a DNS label, but the job's Service's name starts with a letter
         bad={"metadata.name": "3d-grpo"}, good={"metadata.name": "d3-grpo"}),
    Case("spec.model", "set exactly one of model.path",
         bad={"spec.model.path": "/models/llama"}, good={"spec.model": {"path": "/models/llama"}}),
    Case("spec.model", "set exactly one of model.path",
         bad={"spec.model": {"dtype": "float32"}}, good={"spec.model": {"tiny": {}, "dtype": "float32"}}),
    Case("spec.dataset", "set exactly one of dataset.path",
         bad={"spec.dataset.path": "/data/train.jsonl"}, good={"spec.dataset": {"path": "/data/train.jsonl"}}),
    Case("spec.dataset", "set exactly one of dataset.path",
         bad={"spec.dataset": {"promptField": "q"}}, good={"spec.dataset": {"promptField": "q", "synthetic": {}}}),
    Case("spec.dataset", "dataset.promptTemplate must contain {prompt}",
         bad={"spec.dataset.promptTemplate": "Q: {question}"}, good={"spec.dataset.promptTemplate": "Q: {prompt}"}),
    Case("spec.dataset", "dataset.path: name it *.jsonl or *.parquet",
         bad={"spec.dataset": {"path": "/data/train.csv"}},
         good={"spec.dataset": {"path": "/data/train.csv", "format": "jsonl"}}),
    Case("spec.dataset", "dataset.path: name it *.jsonl or *.parquet",
         bad={"spec.dataset": {"path": "/data/train.csv", "format": "auto"}},
         good={"spec.dataset": {"path": "/data/train.parquet", "format": "auto"}}),
    Case("spec.reward", "reward.function: use math or a plugin",
         bad={"spec.reward.function": "mymodule.score"}, good={"spec.reward.function": "mymodule:score"}),
    Case("spec.algorithm", "algorithm.rolloutCorrection: tis weighs",
         bad={"spec.algorithm": {"rolloutCorrection": "tis", "oldLogprobs": "engine"}},
         good={"spec.algorithm": {"rolloutCorrection": "tis", "oldLogprobs": "trainer"}}),
    Case("spec.trainer", "trainer.ranksPerPod must equal gpusPerPod",
         bad={"spec.trainer": {"gpusPerPod": 2, "ranksPerPod": 1}},
         good={"spec.trainer": {"gpusPerPod": 2, "ranksPerPod": 2}}, also={"spec.placement": "separate"}),
    Case("spec.trainer", "trainer.ranksPerPod must equal gpusPerPod",  # gpusPerPod's default is 1
         bad={"spec.trainer": {"ranksPerPod": 2}}, good={"spec.trainer": {"ranksPerPod": 1}},
         also={"spec.placement": "separate"}),
    *[Case(f"spec.{pod}.resources", f"resources.{kind}: do not set {GPU} here",
           bad={f"spec.{pod}.resources": {kind: {GPU: 1, "cpu": "1"}}},
           good={f"spec.{pod}.resources": {kind: {"cpu": "1", "nvidia.com/mig-1g.10gb": 1}}})
      for pod in ("trainer", "generator") for kind in ("requests", "limits")],
    Case("spec.generator", "generator.gpusPerPod=0 needs generator.ranksPerPod",
         bad={"spec.generator.ranksPerPod": DELETE}, good={"spec.generator.ranksPerPod": 1},
         also={"spec.generator.adaptiveTP.enabled": False}),
    Case("spec.generator", "generator.ranksPerPod must equal gpusPerPod",
         bad={"spec.generator.gpusPerPod": 4, "spec.generator.ranksPerPod": 2},
         good={"spec.generator.gpusPerPod": 2, "spec.generator.ranksPerPod": 2}, also=ON_GPUS),
    Case("spec.generator", "generator.ranksPerPod: use a power of two",
         bad={"spec.generator.ranksPerPod": 3}, good={"spec.generator.ranksPerPod": 4},
         also={"spec.generator.adaptiveTP.enabled": False}),
    Case("spec.generator", "generator.gpusPerPod: use a power of two",
         bad={"spec.generator.gpusPerPod": 6}, good={"spec.generator.gpusPerPod": 8},
         also={**ON_GPUS, "spec.generator.ranksPerPod": DELETE}),
    Case("spec.generator", "generator.adaptiveTP.tpSizes: use powers of two dividing the ranks per pod",
         bad={"spec.generator.adaptiveTP.tpSizes": [1, 4]}, good={"spec.generator.adaptiveTP.tpSizes": [1, 2]}),
    Case("spec.generator", "generator.adaptiveTP.tpSizes: use powers of two dividing the ranks per pod",
         bad={"spec.generator.gpusPerPod": 4, "spec.generator.adaptiveTP.tpSizes": [1, 2, 4, 8]},
         good={"spec.generator.gpusPerPod": 8, "spec.generator.adaptiveTP.tpSizes": [1, 2, 4, 8]},
         also={**ON_GPUS, "spec.generator.ranksPerPod": DELETE}),
    Case("spec.generator", "generator.vllm.tensorParallelSize must divide the ranks per pod", base="vllm",
         bad={"spec.generator.vllm.tensorParallelSize": 4}, good={"spec.generator.vllm.tensorParallelSize": 2}),
    Case("spec.generator", "generator.tensorParallelSize: use a power of two dividing the ranks per pod",
         bad={"spec.generator.tensorParallelSize": 4}, good={"spec.generator.tensorParallelSize": 2},
         also={"spec.generator.adaptiveTP": {"enabled": False}}),
    Case("spec.generator", "generator.tensorParallelSize: use a power of two dividing the ranks per pod",
         bad={"spec.generator.gpusPerPod": 4, "spec.generator.tensorParallelSize": 8},
         good={"spec.generator.gpusPerPod": 8, "spec.generator.tensorParallelSize": 8},
         also={**ON_GPUS, "spec.generator.ranksPerPod": DELETE, "spec.generator.adaptiveTP": {"enabled": False}}),
    Case("spec.generator", "generator.compileStep is engine pat's", base="vllm",
         bad={"spec.generator.compileStep": True}, good={"spec.generator.compileStep": False}),
    Case("spec.generator", "generator.tensorParallelSize is engine pat's fixed layout", base="vllm",
         bad={"spec.generator.tensorParallelSize": 2}, good={"spec.generator.tensorParallelSize": 1}),
    Case("spec.generator", "generator.tensorParallelSize above 1 fixes the layout",
         bad={"spec.generator.tensorParallelSize": 2},  # the example's adaptiveTP.enabled: true
         good={"spec.generator.tensorParallelSize": 2, "spec.generator.adaptiveTP": {"enabled": False}}),
    Case("spec.generator", "generator.tensorParallelSize above 1 fixes the layout",
         bad={"spec.generator.tensorParallelSize": 2, "spec.generator.adaptiveTP": DELETE},  # on by default
         good={"spec.generator.tensorParallelSize": 1, "spec.generator.adaptiveTP": DELETE}),
    Case("spec.generator", "generator.vllm.maxModelLen is below generator.maxSeq", base="vllm",
         bad={"spec.generator.vllm.maxModelLen": 127}, good={"spec.generator.vllm.maxModelLen": 128}),
    Case("spec.generator", "generator.adaptiveTP.enabled with engine vllm runs on CPU only", base="vllm",
         bad={"spec.generator.adaptiveTP": {"enabled": True}, "spec.generator.gpusPerPod": 2,
              "spec.generator.ranksPerPod": DELETE},
         good={"spec.generator.adaptiveTP": {"enabled": False}, "spec.generator.gpusPerPod": 2,
               "spec.generator.ranksPerPod": DELETE}),
    Case("spec.generator", "generator.vllm.tensorParallelSize with adaptive TP: the pod's base layout", base="vllm",
         bad={"spec.generator.adaptiveTP": {"enabled": True, "controller": "operator"},
              "spec.generator.vllm.tensorParallelSize": 2},
         good={"spec.generator.adaptiveTP": {"enabled": True, "controller": "operator"},
               "spec.generator.vllm.tensorParallelSize": 1}),
    Case("spec.generator.adaptiveTP", "generator.adaptiveTP.tpSizes must include 1",
         bad={"spec.generator.adaptiveTP.tpSizes": [2]}, good={"spec.generator.adaptiveTP.tpSizes": [1]}),
    Case("spec.generator.adaptiveTP", "generator.adaptiveTP.tpSizes: use powers of two (1, 2, 4, ...)",
         bad={"spec.generator.adaptiveTP.tpSizes": [1, 3]}, good={"spec.generator.adaptiveTP.tpSizes": [1, 2]},
         also={**ON_GPUS, "spec.generator.ranksPerPod": DELETE, "spec.generator.gpusPerPod": 4}),
    Case("spec", "reward.overlongBuffer must be below algorithm.maxResponseTokens",
         bad={"spec.reward.overlongBuffer": 64}, good={"spec.reward.overlongBuffer": 63},
         also={"spec.algorithm.maxResponseTokens": 64}),
    Case("spec", "algorithm.maxResponseTokens leaves no room for the prompt",
         bad={"spec.algorithm.maxResponseTokens": 128}, good={"spec.algorithm.maxResponseTokens": 127},
         also={"spec.generator.maxSeq": 128}),
    Case("spec", "the responses per iteration",
         bad={"spec.algorithm.promptsPerIteration": 1}, good={"spec.algorithm.promptsPerIteration": 2},
         also={"spec.algorithm.samplesPerPrompt": 2, "spec.placement": "separate",
               "spec.trainer": {"replicas": 2, "gpusPerPod": 0}}),
    Case("spec", "spec.placement: colocated with generator.engine: vllm", base="vllm",
         bad={"spec.placement": "colocated"}, good={"spec.placement": "separate"}),
    # Colocated (examples/local.yaml), a trainer pod field that is set must be the generator's.
    *[Case("spec", f"spec.placement: colocated runs both roles in the generator pods: trainer.{name} differs",
           bad={f"spec.trainer.{name}": bad}, good={f"spec.trainer.{name}": good})
      for name, bad, good in (("replicas", 2, 1), ("gpusPerPod", 1, 0), ("ranksPerPod", 1, 2),
                              ("image", "example.com/other:1", api.Generator.model_fields["image"].default),
                              ("imagePullPolicy", "Always", "IfNotPresent"))],
    Case("spec", "algorithm.maxTokensPerMicroBatch is below one whole sequence",
         bad={"spec.algorithm.maxTokensPerMicroBatch": 127}, good={"spec.algorithm.maxTokensPerMicroBatch": 128},
         also={"spec.generator.maxSeq": 128, "spec.algorithm.maxResponseTokens": 64}),
    Case("spec.scheduling", "scheduling.gangScheduler places the pods as a gang, and scheduling.gang is false",
         bad={"spec.scheduling": {"gang": False, "gangScheduler": "volcano"}},
         good={"spec.scheduling": {"gang": True, "gangScheduler": "volcano"}}),
    Case("spec.scheduling", "scheduling.gangScheduler=kueue needs scheduling.queueName",
         bad={"spec.scheduling": {"gangScheduler": "kueue"}},
         good={"spec.scheduling": {"gangScheduler": "kueue", "queueName": "team-a"}}),
    Case("spec.scheduling", "scheduling.queueName is a Kueue or Volcano queue, and gangScheduler=coscheduling",
         bad={"spec.scheduling": {"gangScheduler": "coscheduling", "queueName": "team-a"}},
         good={"spec.scheduling": {"gangScheduler": "volcano", "queueName": "team-a"}}),
    Case("spec.scheduling", "scheduling.schedulerName=volcano ignores scheduler-plugins' PodGroup",
         bad={"spec.scheduling": {"gangScheduler": "coscheduling", "schedulerName": "volcano"}},
         good={"spec.scheduling": {"gangScheduler": "coscheduling", "schedulerName": "scheduler-plugins-scheduler"}}),
]


def cases_of(rule: Rule) -> list[Case]:
    return [c for c in CASES if c.matches(rule)]


@pytest.mark.parametrize("rule", [r for r in RULES if not r.transition], ids=str)
def test_each_rule_accepts_its_good_case_and_refuses_its_bad_one(jobs: Jobs, rule: Rule):
    cases = cases_of(rule)
    assert cases, f"no Case in tests/cel/test_cel.py for the rule at {rule.path}: {rule.message}"
    for case in cases:
        base = edited(example(case.base), case.also)
        assert jobs.refusal(edited(base, case.good)) is None, case.good
        refused = jobs.refusal(edited(base, case.bad))
        assert refused and rule.refusal in refused, (case.bad, refused)
        assert "were not checked" not in refused  # the schema let it through: CEL decided


def test_every_case_belongs_to_one_rule():
    for case in CASES:
        assert [str(r) for r in RULES if case.matches(r)] != [], f"a Case for no rule: {case.path}: {case.message}"
        assert len([r for r in RULES if case.matches(r)]) == 1, case.message


# --- updates: only runPolicy may change ---------------------------------------------------------------------------

# The new value of each immutable field for an update of examples/local.yaml (DELETE: leave it out).
IMMUTABLE_EDITS: dict[str, Any] = {
    "model": {"tiny": {"family": "llama", "preset": "demo", "seed": 1, "tokenizer": "dataset"}},
    "tokenizer": {"path": "/models/tokenizer"},  # unset before
    "dataset": {"synthetic": {"kind": "arithmetic", "size": 256, "seed": 0, "maxOperand": 9}},
    "reward": DELETE,  # set before
    "algorithm": {**example()["spec"]["algorithm"], "learningRate": 0.01},
    "placement": "separate",
    "trainer": {"replicas": 1, "gpusPerPod": 0, "env": [{"name": "PAT_EXAMPLE", "value": "1"}]},
    "generator": edited(example(), {"spec.generator.adaptiveTP.minGain": 0.5})["spec"]["generator"],
    "checkpoint": {"everyIterations": 5, "keep": 3},
    "scheduling": {"queueName": "team-a"},  # unset before
}
SPEC_FIELDS = {f.alias for f in api.RLHFJobSpec.model_fields.values()}


def immutable_field(rule: Rule) -> str:
    m = re.fullmatch(r"spec\.(\w+) is immutable: delete and re-create the job", rule.message)
    assert m and rule.path == "spec", rule
    return m[1]


@pytest.mark.parametrize("rule", [r for r in RULES if r.transition], ids=str)
def test_each_immutable_field_refuses_a_change_by_replace_and_patch(jobs: Jobs, rule: Rule):
    name = immutable_field(rule)
    assert name in IMMUTABLE_EDITS, f"no update case in IMMUTABLE_EDITS for {rule.message}"
    stored = jobs.create(example(name=jobs.unique_name(name.lower())), dry_run=False)
    # Accepted: the field sent again as it is, runPolicy changed.
    stored = jobs.replace(edited(stored, {"spec.runPolicy.suspend": True}))
    assert stored["spec"]["runPolicy"]["suspend"] is True
    # Refused: the field changed (or added, or removed), by replace and by merge patch, each naming only this rule.
    value = IMMUTABLE_EDITS[name]
    patch = {"spec": {name: None if value is DELETE else value}}  # null removes a field in a merge patch
    for change in (lambda: jobs.replace(edited(stored, {f"spec.{name}": value})),
                   lambda: jobs.patch(stored["metadata"]["name"], patch)):
        with pytest.raises(Invalid) as e:
            change()
        assert e.value.causes == [f"Invalid value: {rule.message}"], e.value.message
        assert rule.refusal in e.value.message


def test_every_spec_field_but_run_policy_has_an_immutability_rule():
    assert {immutable_field(r) for r in RULES if r.transition} == SPEC_FIELDS - {"runPolicy"} == set(IMMUTABLE_EDITS)


def test_run_policy_may_change_and_several_changes_are_refused_together(jobs: Jobs):
    stored = jobs.create(example(name=jobs.unique_name("run-policy")), dry_run=False)
    patched = jobs.patch(stored["metadata"]["name"], {"spec": {"runPolicy": {"suspend": True, "backoffLimit": 5}}})
    assert patched["spec"]["runPolicy"] == {"suspend": True, "backoffLimit": 5}
    replaced = jobs.replace(edited(patched, {"spec.runPolicy": {"backoffLimit": 1}}))
    assert replaced["spec"]["runPolicy"] == {"backoffLimit": 1}
    with pytest.raises(Invalid) as e:
        jobs.replace(edited(replaced, {"spec.algorithm.learningRate": 0.01, "spec.tokenizer": {"path": "/t"},
                                       "spec.runPolicy.suspend": False}))
    assert sorted(e.value.causes) == ["Invalid value: spec.algorithm is immutable: delete and re-create the job",
                                      "Invalid value: spec.tokenizer is immutable: delete and re-create the job"]


def test_a_sparse_job_passes_the_guards_on_create_and_update(jobs: Jobs):
    """The rules test only fields that are set, or take the models' defaults for them: a minimal job passes."""
    minimal = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
               "metadata": {"name": jobs.unique_name("minimal")},
               "spec": {"model": {"tiny": {}}, "dataset": {"synthetic": {}}}}
    stored = jobs.create(minimal, dry_run=False)
    assert stored["spec"] == minimal["spec"]  # no defaults in the CRD: the operator applies the models'
    jobs.replace(stored)
    jobs.replace(edited(stored, {"spec.runPolicy": {"suspend": True}}))


# --- the examples, what the models write back, and the OpenAPI checks ----------------------------------------------

def without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return [without_nulls(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_examples_and_what_the_models_write_back_are_accepted_unchanged(jobs: Jobs, path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == api.KIND]
    assert docs
    for doc in docs:
        assert jobs.create(doc)["spec"] == doc["spec"]
        # The full validated spec, every default filled in, as the operator writes it to its ConfigMap.
        full = parse_job(doc).model_dump(by_alias=True, mode="json")
        assert jobs.create(full)["spec"] == without_nulls(full["spec"])  # nulls are unset, as for the models


def test_the_models_status_is_stored_unchanged(jobs: Jobs):
    """status is not preserve-unknown: a field the schema lacked would be pruned silently."""
    stored = jobs.create(example(name=jobs.unique_name("status")), dry_run=False)
    status = RLHFJobStatus.model_validate({
        "phase": "Running", "iteration": 3, "restarts": 1, "tp": "2", "startTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Running", "status": "True", "reason": "PodsReady", "message": "all pods ready",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}],
        "generators": [{"pod": "g-0", "layout": [2], "desiredEpoch": 1, "appliedEpoch": 1, "regroups": 1}],
    }).model_dump(by_alias=True, mode="json", exclude_none=True)
    assert jobs.replace_status({**stored, "status": status})["status"] == status


def test_nulls_are_unset_for_cel_as_for_the_models(jobs: Jobs):
    doc = edited(example(), {"spec.model.path": None})  # pruned: still exactly one of path / tiny
    assert "path" not in jobs.create(doc)["spec"]["model"]


@pytest.mark.parametrize("edit, error", [
    ({"spec.algorithm.learningRate": -1},
     "spec.algorithm.learningRate: Invalid value: -1: spec.algorithm.learningRate in body should be greater than 0"),
    ({"spec.algorithm.iterations": "30"}, 'spec.algorithm.iterations: Invalid value: "string": '
                                          "spec.algorithm.iterations in body must be of type integer"),
    ({"spec.trainer.imagePullPolicy": "always"}, 'spec.trainer.imagePullPolicy: Unsupported value: "always"'),
    ({"spec.generator.adaptiveTP.tpSizes": []},
     "spec.generator.adaptiveTP.tpSizes in body should have at least 1 items"),
    ({"spec.generator.adaptiveTP.tpSizes": [1] * 17},
     "spec.generator.adaptiveTP.tpSizes: Too many: 17: must have at most 16 items"),
    ({"spec.generator.port": 70000}, "spec.generator.port in body should be less than or equal to 65535"),
    ({"spec.scheduling": {"queueName": "Team_A"}}, "spec.scheduling.queueName in body should match"),
    ({"spec.scheduling": {"gangScheduler": "yunikorn"}},
     'spec.scheduling.gangScheduler: Unsupported value: "yunikorn"'),
    ({"spec.trainer.resources": {"limits": {"memory": "4GB"}}},
     "spec.trainer.resources.limits.memory in body should match"),
    ({"spec.generator.env": [{"value": "1"}]}, "spec.generator.env[0].name: Required value"),
    ({"spec.model": DELETE}, "spec.model: Required value"),
])
def test_the_schema_refuses_what_it_can_express(jobs: Jobs, edit, error):
    refused = jobs.refusal(edited(example(), edit))
    assert refused and error in refused, refused


def test_a_typo_under_spec_is_kept_for_the_operator(jobs: Jobs):
    """spec preserves unknown fields: the models (extra="forbid") refuse the typo instead of a silent default."""
    stored = jobs.create(edited(example(), {"spec.algorithm.clipRatoi": 0.3}))
    assert stored["spec"]["algorithm"]["clipRatoi"] == 0.3


# --- tests/unit/invalid: `# crd: <field>: <what>` -----------------------------------------------------------------

def expectation(path: Path, key: str) -> str | None:
    """The `# key: ...` line of a manifest's leading comments."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return None
        if line.startswith(f"# {key}: "):
            return line.removeprefix(f"# {key}: ").strip()
    return None


def server_pattern(expected: str) -> str:
    """The regular expression of the server's error for a `# crd:` line, `.<field path>: <what>`, where <what> is
    the OpenAPI keyword that fails (enum, pattern, minimum N, maximum N, Required value, must be of type T) or a CEL
    rule's message (the field path is the node that carries the rule; empty for the root)."""
    field_path, _, what = expected.partition(": ")
    node = re.escape(field_path.lstrip(".") or "<nil>")
    value = r"Invalid value: (?:\"[^\"]*\"|[^:,]*): " + node
    keywords = {
        "enum": rf"{node}: Unsupported value: ",
        "pattern": rf"{node}: {value} in body should match '",
        "Required value": rf"{node}: Required value",
    }
    if what in keywords:
        return keywords[what]
    if m := re.fullmatch(r"(minimum|maximum) (\S+)", what):
        relation = "greater" if m[1] == "minimum" else "less"
        return rf"{node}: {value} in body should be {relation} than (or equal to )?{re.escape(m[2])}\b"
    if m := re.fullmatch(r"must be of type (\w+)", what):
        return rf"{node}: {value} in body must be of type {m[1]}"
    return rf"{node}: Invalid value: {re.escape(what)}"


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_the_crd_refuses_the_invalid_manifests_it_can(jobs: Jobs, path: Path):
    """`# crd: <text>`: the API server (schema and CEL) refuses it already; without one, only the operator can (a
    typo, volume names, anything CEL cannot see), and the CRD must let it through to the operator."""
    expected = expectation(path, "crd")
    docs = [d for d in yaml.safe_load_all(path.read_text())
            if d and d.get("kind") == api.KIND and d.get("apiVersion") == f"{api.GROUP}/{api.VERSION}"]
    refusals = [jobs.refusal(d) for d in docs]
    if expected is None:
        assert refusals == [None] * len(docs)
    else:
        pattern = server_pattern(expected)
        assert any(r and re.search(pattern, r) for r in refusals), (pattern, refusals)


def test_every_rule_is_named_by_an_invalid_manifest():
    """Each create-time rule's message appears in some `# crd:` line, so `pat validate`'s corpus covers it too."""
    expected = " ".join(filter(None, (expectation(p, "crd") for p in INVALID)))
    assert [r.message for r in RULES if not r.transition and r.message not in expected] == []


@pytest.mark.parametrize("expected, refusal", [
    (".spec.trainer.imagePullPolicy: enum", 'spec.trainer.imagePullPolicy: Unsupported value: "always": supported'),
    (".spec.algorithm.topP: minimum 0", "spec.algorithm.topP: Invalid value: 0: spec.algorithm.topP in body "
                                        "should be greater than 0"),
    (".spec.algorithm.samplesPerPrompt: minimum 2", "spec.algorithm.samplesPerPrompt: Invalid value: 1: "
                                                    "spec.algorithm.samplesPerPrompt in body should be greater than "
                                                    "or equal to 2"),
    (".spec.x: must be of type integer", 'spec.x: Invalid value: "string": spec.x in body must be of type integer'),
    (": metadata.name: use a DNS label", "<nil>: Invalid value: metadata.name: use a DNS label (lowercase"),
    (".spec.dataset: dataset.path: name it *.jsonl", "spec.dataset: Invalid value: dataset.path: name it *.jsonl"),
])
def test_server_pattern_reads_the_crd_lines(expected, refusal):
    assert re.search(server_pattern(expected), refusal)
    assert not re.search(server_pattern(expected), refusal.replace(".", "_"))  # another field


# --- cross-field rules that count ranks as the models do -----------------------------------------------------------

@pytest.mark.parametrize("placement, pods, prompts", [
    ("separate", {"spec.trainer": {"gpusPerPod": 0, "ranksPerPod": 4}}, 4),  # ranksPerPod counts on CPU
    ("separate", {"spec.trainer": {"gpusPerPod": 8}}, 8),  # one rank per GPU, replicas left at 1
    ("separate", {"spec.trainer": {"replicas": 2}}, 2),  # gpusPerPod left at 1
    ("separate", {"spec.trainer": {"replicas": 3, "gpusPerPod": 0}}, 3),  # no GPU: one rank per pod
    # colocated: a trainer rank beside each engine rank of every pod, the trainer's fields left out
    ("colocated", {"spec.trainer": DELETE, "spec.generator.replicas": 2, "spec.generator.ranksPerPod": 4}, 8),
    ("colocated", {"spec.trainer": DELETE, "spec.generator.gpusPerPod": 2, "spec.generator.ranksPerPod": DELETE}, 2),
])
def test_the_trainer_world_rule_counts_ranks_as_the_models_do(jobs: Jobs, placement, pods, prompts):
    """prompts x 2 samples >= 2 mini-batches x the trainer ranks: the least number of prompts passes the CEL rule and
    the models, one fewer neither."""
    for n, ok in ((prompts, True), (prompts - 1, False)):
        doc = edited(example(), {"spec.placement": placement, **pods, "spec.algorithm.promptsPerIteration": n,
                                 "spec.algorithm.samplesPerPrompt": 2, "spec.algorithm.miniBatches": 2})
        refused = jobs.refusal(doc)
        assert (refused is None) == ok, (n, refused)
        assert ok or "spec: Invalid value: the responses per iteration" in refused
        try:
            parse_job(doc)
        except JobSpecError as e:
            assert not ok and "trainer ranks" in str(e), e
        else:
            assert ok


@pytest.mark.parametrize("generator, tp, ok", [
    ({"gpusPerPod": 0, "ranksPerPod": 2}, 2, True),
    ({"gpusPerPod": 0, "ranksPerPod": 2}, 4, False),
    ({"gpusPerPod": 4, "ranksPerPod": DELETE}, 4, True),  # one rank per GPU
    ({"gpusPerPod": 4, "ranksPerPod": DELETE}, 8, False),
    ({"gpusPerPod": DELETE, "ranksPerPod": DELETE}, 1, True),  # gpusPerPod's default: 1 GPU, 1 rank
    ({"gpusPerPod": DELETE, "ranksPerPod": DELETE}, 2, False),
])
def test_the_vllm_tp_rule_counts_ranks_as_the_models_do(jobs: Jobs, generator, tp, ok):
    doc = edited(example("vllm"), {f"spec.generator.{k}": v for k, v in generator.items()}
                 | {"spec.generator.vllm.tensorParallelSize": tp})
    refused = jobs.refusal(doc)
    assert (refused is None) is ok, refused
    if ok:
        assert parse_job(doc).spec.generator.vllm.tensor_parallel_size == tp
    else:
        assert "spec.generator: Invalid value: generator.vllm.tensorParallelSize must divide" in refused
        with pytest.raises(JobSpecError, match="generator.vllm.tensorParallelSize"):
            parse_job(doc)


@pytest.mark.parametrize("engine", ["pat", "vllm"])
@pytest.mark.parametrize("enabled", [None, False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_fixed_layout_rules_agree_with_the_models(jobs: Jobs, engine, enabled, tp):
    """generator.tensorParallelSize on a pod of 2 ranks: the CRD refuses exactly what the models refuse."""
    doc = edited(example("vllm" if engine == "vllm" else "local"), {
        "spec.generator.tensorParallelSize": tp,
        "spec.generator.adaptiveTP": {} if enabled is None else {"enabled": enabled}})
    refused = jobs.refusal(doc)
    try:
        parse_job(doc)
    except JobSpecError as e:
        assert refused is not None, e
    else:
        assert refused is None, refused
        assert tp == 1 or (engine, enabled, tp) == ("pat", False, 2)  # a fixed layout: adaptive TP off, engine pat


@pytest.mark.parametrize("engine, enabled", [("pat", None), ("pat", False), ("pat", True), ("vllm", None),
                                             ("vllm", False)])
def test_adaptive_tp_left_out_or_consistent_with_the_engine_is_accepted(jobs: Jobs, engine, enabled):
    doc = edited(example("vllm"), {"spec.generator.engine": engine,
                                   "spec.generator.adaptiveTP": {} if enabled is None else {"enabled": enabled}})
    assert jobs.refusal(doc) is None
    parse_job(doc)


def test_vllm_extra_args_the_pod_does_not_manage_pass(jobs: Jobs):
    doc = edited(example("vllm"), {"spec.generator.vllm.extraArgs": [
        "--max-num-seqs=128", "--enable-prefix-caching", "--kv-cache-dtype=fp8", "--chat-template=a b c"]})
    assert jobs.refusal(doc) is None
    parse_job(doc)
