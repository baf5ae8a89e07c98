"""Every example RLHFJob passes `pat validate` and fits its GPUs by `pat plan` (the installed console script, as a
user runs it), a broken copy does not, and the GPU examples' pods can reach the files their spec names."""

import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from pat_operator import builders
from pat_operator.api import parse_job

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
PAT = Path(sys.executable).parent / "pat"  # the venv's console script


def pat_validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(PAT), "validate", str(path)], capture_output=True, text=True, timeout=60)


def test_the_examples_are_there():
    names = {p.name for p in EXAMPLES}
    assert {"local.yaml", "llama-3.1-8b.yaml", "qwen3-14b.yaml", "vllm.yaml"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_pat_validate_accepts_the_example(path):
    out = pat_validate(path)
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"RLHFJob {name}: valid", out.stdout


# The built-in shape of each example's model.path (its config.json is not here).
SHAPES = {"llama-3.1-8b.yaml": "llama-3.1-8b", "qwen3-14b.yaml": "qwen3-14b"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_pat_plan_fits_the_example_on_its_gpus(path):
    """Each example fits (pat_operator.fit's estimate) the GPUs its pods select; local.yaml runs on CPU. Separate:
    a verdict per GPU role; colocated: one per phase (generate, train, hand-over) of the pods' GPUs, and the
    placement's."""
    model = ["--model", SHAPES[path.name]] if path.name in SHAPES else []
    out = subprocess.run([str(PAT), "plan", str(path), *model], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    spec = parse_job(yaml.safe_load(path.read_text())).spec
    if spec.placement == "colocated":
        on_gpus = spec.generator.gpus_per_pod > 0
        assert out.stdout.count("  fits\n") == 3 * on_gpus and out.stdout.count("CPU (no GPU") == 1 - on_gpus
        assert ("\ncolocated fits\n" in out.stdout) == on_gpus and "DOES NOT FIT" not in out.stdout
        return
    gpu_roles = sum(template.gpus_per_pod > 0 for template in (spec.trainer, spec.generator))
    assert out.stdout.count("  fits\n") == gpu_roles and out.stdout.count("CPU (no GPU") == 2 - gpu_roles


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda s: s["generator"].update(gpusPerPod=-1), "spec.generator.gpusPerPod: Input should be greater than or "
                                                     "equal to 0"),
    (lambda s: s["generator"].update(gpusPerNode=8), "spec.generator.gpusPerNode: unknown field; did you mean "
                                                     "gpusPerPod?"),
    (lambda s: s["algorithm"].update(maxResponseTokens=16384), "spec: algorithm.maxResponseTokens=16384 leaves no "
                                                               "room for the prompt in generator.maxSeq=9216"),
], ids=["negative-gpus", "unknown-field", "response-longer-than-maxSeq"])
def test_pat_validate_rejects_a_broken_copy_naming_the_field(tmp_path, edit, expected):
    doc = yaml.safe_load((EXAMPLES[0].parent / "llama-3.1-8b.yaml").read_text())
    edit(doc["spec"])
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = pat_validate(broken)
    assert out.returncode != 0 and "valid" not in out.stdout
    assert expected in out.stderr, out.stderr


def _under(path: str, mounts: list[dict]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m["mountPath"]) for m in mounts)


GPU_EXAMPLES = [p for p in EXAMPLES if yaml.safe_load(p.read_text())["spec"]["generator"].get("gpusPerPod", 1) > 0]


def test_the_cpu_examples_are_the_local_ones():
    assert {p.name for p in EXAMPLES} - {p.name for p in GPU_EXAMPLES} == {"local.yaml", "vllm.yaml"}


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda p: p.name)
def test_gpu_example_pods_mount_what_the_spec_reads(path):
    """What `pat validate` cannot see: the model directory is on the model volume in every pod, the dataset on a
    volume of the trainer (the one that reads it), the run folder on a persistent volume (a restarted gang
    resumes), and each pod asks for all the GPUs of its ranks."""
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["namespace"] = "team"
    job = parse_job(doc)
    s = job.spec
    assert s.model.volume is not None and PurePosixPath(s.model.path).is_relative_to(s.model.mount_path)
    assert s.checkpoint.volume is not None and "persistentVolumeClaim" in s.checkpoint.volume
    assert s.generator.adaptive and s.generator.adaptive_tp.controller == "operator"
    for role, index in builders.expected_pods(job):
        (container,) = builders.pod(job, "uid", role, index, attempt=0)["spec"]["containers"]
        mounts = container["volumeMounts"]
        assert _under(s.model.path, mounts), (role, mounts)
        if role != "generator":  # a trainer pod, or a colocated pod (both roles)
            assert _under(s.dataset.path, mounts), f"the trainer reads {s.dataset.path} but mounts no volume there"
        template = s.trainer if role == "trainer" else s.generator
        assert container["resources"]["limits"]["nvidia.com/gpu"] == template.gpus_per_pod == 8


def test_the_readmes_rlhfjob_passes_pat_validate(tmp_path):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    jobs = [b for b in blocks if "kind: RLHFJob" in b]
    assert jobs, "README.md shows no RLHFJob"
    for i, block in enumerate(jobs):
        (tmp_path / f"readme-{i}.yaml").write_text(block)
        done = pat_validate(tmp_path / f"readme-{i}.yaml")
        assert done.returncode == 0, done.stdout + done.stderr
