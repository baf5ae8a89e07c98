"""The images, checked without a Docker engine: the Dockerfile has a target per image repository the project names
(the repository's last path segment), pins every base to an exact version, runs its final stages as the numeric
non-root user the pods run as, keeps torch out of the operator image and compilers out of the final stages (but
for the C compiler and Python headers that Triton needs at run time in the vLLM image), and every command the pods
and the chart run is a console script of the package (installed in this venv).

The checks are small functions over text, so that the negative controls below can feed them broken input."""

from __future__ import annotations

import importlib
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml

from pat_operator import builders
from pat_operator.api import VLLM_WORKER_IMAGE, PodTemplate, parse_job

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CHART = ROOT / "charts" / "pat-operator"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPERATOR_COMMAND = ["pat-operator"]  # what the chart's Deployment runs when its template cannot be read


# -- the Dockerfile as data ---------------------------------------------------------------------------------
@dataclass
class Stage:
    name: str | None
    base: str  # the FROM image, with the global ARGs' defaults filled in
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) per instruction: comments dropped, continuation lines joined."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or (not s and not buf):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


def stages(text: str) -> list[Stage]:
    args: dict[str, str] = {}
    out: list[Stage] = []
    for word, rest in instructions(text):
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            out.append(Stage(name, _expand(parts[0], args)))
        elif out:
            out[-1].instructions.append((word, rest))
        elif word == "ARG":  # before the first FROM: the defaults FROM lines may use
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip("\"'")
    return out


def global_args(text: str) -> dict[str, str]:
    args = {}
    for word, rest in instructions(text):
        if word == "FROM":
            break
        if word == "ARG":
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip("\"'")
    return args


def stage(text: str, name: str) -> Stage | None:
    return next((s for s in stages(text) if s.name == name), None)


def image_target(image: str) -> str:
    """ghcr.io/pat-rlhf/pat-worker:0.1.0 -> pat-worker: the Dockerfile target that builds the repository."""
    last = image.split("@")[0].rsplit("/", 1)[-1]
    return last.split(":")[0]


def missing_targets(text: str, targets: set[str]) -> list[str]:
    names = {s.name for s in stages(text)}
    return [f"no stage `FROM ... AS {t}`" for t in sorted(targets - names)]


EXACT_TAG = re.compile(r"^v?\d+\.\d+\.\d+")  # 3.11.11-slim-bookworm, 12.8.1-base-ubuntu24.04


def unpinned_bases(text: str) -> list[str]:
    """Bases that are not an earlier stage nor pinned: a digest, or a tag starting with major.minor.patch."""
    problems, names = [], set()
    for s in stages(text):
        if s.base not in names:
            ref = s.base
            tag = ref.rsplit("/", 1)[-1].partition(":")[2]
            if "$" in ref:
                problems.append(f"{ref}: an ARG without a default")
            elif "@sha256:" not in ref and not EXACT_TAG.match(tag):
                problems.append(f"{ref}: pin an exact version (not {tag or 'no tag'})")
        names.add(s.name)
    return problems


def user_problems(text: str, target: str) -> list[str]:
    s = stage(text, target)
    if s is None:
        return [f"no stage {target}"]
    users = s.args("USER")
    if not users:
        return [f"{target}: no USER (it would run as root)"]
    uid, _, gid = users[-1].partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        return [f"{target}: USER {users[-1]} is not numeric; runAsNonRoot can only verify a numeric user"]
    if int(uid) == 0 or (gid and int(gid) == 0):
        return [f"{target}: USER {users[-1]} is root"]
    return []


def user_of(text: str, target: str) -> int:
    return int(stage(text, target).args("USER")[-1].partition(":")[0])


def closure(text: str, target: str) -> list[Stage]:
    """The target and every stage it is built FROM or COPYs --from, transitively."""
    by_name = {s.name: s for s in stages(text) if s.name}
    seen, todo = [], [target]
    while todo:
        s = by_name.get(todo.pop())
        if s is None or s in seen:
            continue
        seen.append(s)
        todo.append(s.base)
        todo += [m[1] for rest in s.args("COPY") if (m := re.search(r"--from=(\S+)", rest))]
    return seen


TORCH = re.compile(r"\btorch\b|\[[^\]]*\bworkers\b[^\]]*\]")


def torch_in(text: str, target: str) -> list[str]:
    """RUN lines (or bases) of the target's closure that bring in torch or the workers extra."""
    found = []
    for s in closure(text, target):
        if "torch" in s.base:
            found.append(f"{s.name}: FROM {s.base}")
        found += [f"{s.name}: RUN {rest}" for rest in s.args("RUN") if TORCH.search(rest)]
    return found


BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|ninja-build|python3?(\.\d+)?-dev|"
                         r"cuda-nvcc|cuda-toolkit[-\w]*|nvidia-cuda-toolkit)\b")


# What a final stage may install of BUILD_TOOLS: in the worker images, what torch.compile builds its kernels with at
# run time (the compiled FlexAttention; vLLM compiles its model at start): Triton's launchers a C compiler and the
# Python headers, inductor's CPU kernels a C++ compiler (TORCH_BACKEND=cpu only). The operator image: nothing.
JIT_TOOLS = dict.fromkeys(["pat-worker", "pat-worker-vllm"], frozenset({"gcc", "python3-dev", "g++"}))


def build_tools_in(text: str, target: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """Compilers installed in a final stage (but those `allowed`), or a base that ships them (-devel CUDA, a
    non-slim python)."""
    s = stage(text, target)
    found = [f"{target}: RUN {rest}" for rest in s.args("RUN")
             if any(m[0] not in allowed for m in BUILD_TOOLS.finditer(rest))]
    repo, _, tag = s.base.rsplit("/", 1)[-1].partition(":")
    if "devel" in tag or (repo == "python" and "slim" not in tag and "alpine" not in tag):
        found.append(f"{target}: FROM {s.base} ships compilers")
    return found


def path_problems(text: str, target: str) -> list[str]:
    """The console scripts resolve: ENV PATH starts with a bin folder that the stage copies in."""
    s = stage(text, target)
    paths = [m[1] for rest in s.args("ENV") if (m := re.search(r"\bPATH=\"?([^:\"\s]+)", rest))]
    if not paths:
        return [f"{target}: no ENV PATH with the venv's bin"]
    copied = [rest.split()[-1] for rest in s.args("COPY")]
    if not any(PurePosixPath(paths[-1]).is_relative_to(dest) for dest in copied):
        return [f"{target}: PATH starts with {paths[-1]}, which no COPY brings in ({copied})"]
    return []


# -- commands and image names -------------------------------------------------------------------------------
def chart_command(deployment: str) -> list[str] | None:
    """The operator container's command in the chart's Deployment template: `command: [...]` or a block list."""
    lines = deployment.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)command:\s*(.*)$", line)
        if not m:
            continue
        if m[2].strip():
            return yaml.safe_load(m[2])
        items = []
        for nxt in lines[i + 1:]:
            if not (item := re.match(r"^\s*-\s*(.+)$", nxt)):
                break
            items.append(yaml.safe_load(item[1]))
        return items
    return None


def operator_command() -> list[str]:
    deployment = CHART / "templates" / "deployment.yaml"
    if deployment.is_file() and (command := chart_command(deployment.read_text())):
        return command
    values = CHART / "values.yaml"
    if values.is_file() and (command := (yaml.safe_load(values.read_text()) or {}).get("command")):
        return command
    return OPERATOR_COMMAND


def scripts_missing(commands: set[str], scripts: dict[str, str]) -> list[str]:
    return [f"{c}: not in [project.scripts] ({sorted(scripts)})" for c in sorted(commands - set(scripts))]


def not_installed(commands: set[str], bindir: Path) -> list[str]:
    return [f"{c}: not in {bindir}" for c in sorted(commands) if not os.access(bindir / c, os.X_OK)]


def pod_commands(job_file: Path) -> set[tuple[str, str]]:
    """(image, command[0]) of every container and init container the operator creates for the job."""
    doc = yaml.safe_load(job_file.read_text())
    doc["metadata"]["namespace"] = "team"
    job = parse_job(doc)
    out = set()
    for role, index in builders.expected_pods(job):
        spec = builders.pod(job, "uid", role, index, attempt=0)["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            out.add((c["image"], c["command"][0]))
    return out


def repositories(values: object) -> set[str]:
    """Every `repository:` of the chart's values (image, workerImage, ...)."""
    if isinstance(values, dict):
        found = {values["repository"]} if isinstance(values.get("repository"), str) else set()
        return found.union(*(repositories(v) for v in values.values()))
    if isinstance(values, list):
        return set().union(*(repositories(v) for v in values))
    return set()


def chart_images() -> set[str]:
    found = set()
    if (values := CHART / "values.yaml").is_file():
        found |= repositories(yaml.safe_load(values.read_text()))
    if (chart := CHART / "Chart.yaml").is_file():
        listed = (yaml.safe_load(chart.read_text()).get("annotations") or {}).get("artifacthub.io/images")
        found |= {i["image"] for i in yaml.safe_load(listed or "[]")}
    return found


def _dockerignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Go's filepath.Match reads it (plus Docker's **): * and ? stop at /."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out + "$")


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _dockerignore_regex(PurePosixPath(pattern.removeprefix("!").strip("/")).as_posix())
        if any(regex.match(x) for x in prefixes):
            result = not negate
    return result


def context_sources(text: str) -> list[str]:
    """The build-context paths the Dockerfile COPYs (COPY without --from; the last argument is the destination)."""
    out = []
    for s in stages(text):
        for rest in s.args("COPY") + s.args("ADD"):
            words = [w for w in rest.split() if not w.startswith("--")]
            if "--from=" not in rest:
                out += words[:-1]
    return out


def ignore_patterns(text: str) -> list[str]:
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


# -- the checks on the real files ---------------------------------------------------------------------------
TEXT = DOCKERFILE.read_text()
WORKER_IMAGE = PodTemplate.model_fields["image"].default
TARGETS = {image_target(i) for i in {WORKER_IMAGE, VLLM_WORKER_IMAGE, *chart_images()}} | {"pat-operator", "pat-worker",
                                                                                          "pat-worker-vllm"}
SCRIPTS = PYPROJECT["project"]["scripts"]


def test_every_image_repository_is_a_dockerfile_target():
    assert image_target(WORKER_IMAGE) == "pat-worker" and image_target(VLLM_WORKER_IMAGE) == "pat-worker-vllm"
    assert missing_targets(TEXT, TARGETS) == []


def test_every_base_is_pinned_to_an_exact_version():
    assert unpinned_bases(TEXT) == []


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_final_stages_run_as_the_pods_numeric_non_root_user(target):
    assert user_problems(TEXT, target) == []
    assert user_of(TEXT, target) == builders.RUN_AS  # the pods' runAsUser
    if (values := CHART / "values.yaml").is_file():
        run_as = (yaml.safe_load(values.read_text()).get("podSecurityContext") or {}).get("runAsUser")
        assert run_as in (None, user_of(TEXT, "pat-operator"))


def test_the_operator_image_has_no_torch_and_the_worker_image_has_it():
    assert torch_in(TEXT, "pat-operator") == []
    assert torch_in(TEXT, "pat-worker") != []  # the positive control of the same check
    assert torch_in(TEXT, "pat-worker-vllm") != []  # vLLM's torch, and the workers extra beside it


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_final_stages_have_no_compilers_and_put_the_venv_on_path(target):
    assert build_tools_in(TEXT, target, JIT_TOOLS.get(target, frozenset())) == []
    assert path_problems(TEXT, target) == []


def test_image_tags_and_label_are_the_package_version():
    version = PYPROJECT["project"]["version"]
    assert WORKER_IMAGE.rpartition(":")[2] == version
    assert global_args(TEXT).get("VERSION") == version


def test_every_pod_and_chart_command_is_an_installed_console_script():
    pods = set().union(*(pod_commands(p) for p in EXAMPLES))
    assert {image for image, _ in pods} == {WORKER_IMAGE, VLLM_WORKER_IMAGE}  # examples/vllm.yaml's generator
    commands = {command for _, command in pods} | {operator_command()[0]}
    assert commands == {"pat", "pat-operator"}
    assert scripts_missing(commands, SCRIPTS) == []
    assert not_installed(commands, Path(sys.executable).parent) == []
    for command in commands:  # the entry point imports (without torch: `pat validate` needs none)
        module, _, attr = SCRIPTS[command].partition(":")
        assert callable(getattr(importlib.import_module(module), attr))


def test_the_build_context_holds_what_the_dockerfile_copies_and_not_the_rest():
    patterns = ignore_patterns(DOCKERIGNORE.read_text())
    sources = [PurePosixPath(s).as_posix() for s in context_sources(TEXT)]
    assert sources and [s for s in sources if ignored(s, patterns)] == []
    for heavy in (".venv", ".venv/bin/python", "runs", ".git", "pat_rlhf.egg-info",
                  "operator/pat_operator/__pycache__"):
        assert ignored(heavy, patterns), heavy


# -- negative controls: each check fails on a broken copy ----------------------------------------------------
def unknown_build_args(script: str, text: str) -> list[str]:
    """The --build-arg names a build script passes that the Dockerfile declares nowhere (buildah ignores them)."""
    declared = set(global_args(text)) | {rest.split("=")[0].strip() for s in stages(text) for rest in s.args("ARG")}
    return sorted(set(re.findall(r"--build-arg \"?([A-Z_]+)=", script)) - declared)


def test_every_build_argument_of_the_image_script_is_the_dockerfiles():
    script = (ROOT / "scripts" / "images.sh").read_text()
    assert len(re.findall(r"--build-arg", script)) >= 6
    assert unknown_build_args(script, TEXT) == []
    assert unknown_build_args(script, TEXT.replace("TORCH_BACKEND", "TORCH_FLAVOUR")) == ["TORCH_BACKEND"]


def _broken(old: str, new: str, text: str = TEXT) -> str:
    assert old in text, f"the control's anchor {old!r} is gone from the Dockerfile"
    return text.replace(old, new)


def _append_to(target: str, line: str, text: str = TEXT) -> str:
    """A copy with `line` added as the target stage's last instruction."""
    lines = text.splitlines()
    starts = [i for i, line_ in enumerate(lines) if re.match(rf"FROM \S+ AS {re.escape(target)}$", line_)]
    (start,) = starts
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("FROM ")), len(lines))
    return "\n".join(lines[:end] + [line] + lines[end:])


def test_a_missing_stage_is_reported():
    assert missing_targets(_broken("AS pat-worker\n", "AS worker\n"), TARGETS) == ["no stage `FROM ... AS pat-worker`"]
    assert missing_targets(TEXT, TARGETS | {image_target("ghcr.io/pat-rlhf/pat-sidecar:1")}) != []


@pytest.mark.parametrize("base", ["python:3.11-slim-bookworm", "python:latest", "python", "nvidia/cuda:12",
                                  "nvidia/cuda:12.8-base-ubuntu24.04", "localhost:5000/python", "${UNSET_IMAGE}"])
def test_an_unpinned_base_is_reported(base):
    assert unpinned_bases(_broken("ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm", f"ARG PYTHON_IMAGE={base}")) != []
    assert unpinned_bases(f"FROM {base} AS x\n") != []


def test_pinned_bases_pass():
    for base in ("python:3.11.11-slim-bookworm", "nvidia/cuda:12.8.1-base-ubuntu24.04",
                 "ghcr.io/x/y@sha256:" + "0" * 64, "registry:5000/team/python:3.12.4-slim"):
        assert unpinned_bases(f"FROM {base} AS a\nFROM a AS b\n") == [], base


@pytest.mark.parametrize("user", ["USER root", "USER pat", "USER 0", "USER 1000:0", "USER pat:pat", ""])
def test_a_root_or_named_user_is_reported(user):
    text = _broken("USER 1000:1000\nCMD [\"pat\"]", f"{user}\nCMD [\"pat\"]")
    assert user_problems(text, "pat-worker") != []
    assert user_problems(TEXT, "pat-worker") == []


def test_torch_in_the_operator_image_is_reported():
    assert torch_in(_append_to("pat-operator", "RUN /opt/venv/bin/pip install torch"), "pat-operator") != []
    extra = _broken("/wheels/pat_rlhf-*.whl\n", "'/wheels/pat_rlhf-0.1.0-py3-none-any.whl[workers,test]'\n")
    assert torch_in(extra, "pat-operator") != []
    # Torch through a stage it copies from counts too.
    copied = _broken("COPY --from=operator-venv /opt/venv", "COPY --from=worker-venv /opt/venv")
    assert torch_in(copied, "pat-operator") != []
    assert torch_in(_broken("FROM ${PYTHON_IMAGE} AS pat-operator", "FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-"
                            "runtime AS pat-operator"), "pat-operator") != []


@pytest.mark.parametrize("bad", ["RUN apt-get update && apt-get install -y build-essential",
                                 "RUN apt-get install -y --no-install-recommends gcc python3-dev",
                                 "RUN apt-get install -y cuda-nvcc-12-8"])
def test_compilers_in_a_final_stage_are_reported(bad):
    assert build_tools_in(TEXT, "pat-operator") == []
    assert build_tools_in(_append_to("pat-operator", bad), "pat-operator") != []


@pytest.mark.parametrize("target", sorted(JIT_TOOLS))
def test_the_worker_images_may_have_only_what_torch_compile_builds_with(target):
    assert build_tools_in(TEXT, target) != []  # gcc and python3-dev are there: the allowance is what passes them
    for bad in ("RUN apt-get install -y build-essential", "RUN apt-get install -y --no-install-recommends cmake",
                "RUN apt-get install -y cuda-nvcc-12-8"):
        assert build_tools_in(_append_to(target, bad), target, JIT_TOOLS[target]) != [], bad
    assert build_tools_in(TEXT, "pat-operator", JIT_TOOLS[target]) == []  # and the operator image has none


def test_a_base_with_compilers_is_reported():
    devel = _broken("ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04", "ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-"
                    "devel-ubuntu24.04")
    assert build_tools_in(devel, "pat-worker") != []
    full = _broken("ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm", "ARG PYTHON_IMAGE=python:3.11.11-bookworm")
    assert build_tools_in(full, "pat-operator") != []


def test_a_path_without_the_venv_is_reported():
    assert path_problems(_broken('ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1\n'
                                 "USER 1000:1000\nCMD [\"pat\"]", "USER 1000:1000\nCMD [\"pat\"]"), "pat-worker") != []
    moved = _broken("COPY --from=worker-venv /opt/venv /opt/venv", "COPY --from=worker-venv /opt/venv /venv")
    assert path_problems(moved, "pat-worker") != []


def test_a_command_that_is_no_console_script_is_reported(tmp_path):
    assert scripts_missing({"pat", "pat-trainer"}, SCRIPTS) == [f"pat-trainer: not in [project.scripts] "
                                                                f"({sorted(SCRIPTS)})"]
    (tmp_path / "pat").write_text("#!/bin/sh\n")
    (tmp_path / "pat").chmod(0o755)
    (tmp_path / "pat-operator").write_text("not executable\n")
    assert not_installed({"pat", "pat-operator"}, tmp_path) == [f"pat-operator: not in {tmp_path}"]


def test_a_custom_pod_command_is_seen(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["spec"]["generator"]["command"] = ["pat-generator", "--debug"]
    doc["spec"]["placement"] = "separate"  # each role its own image
    doc["spec"]["trainer"]["image"] = "ghcr.io/pat-rlhf/pat-trainer:0.1.0"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    pods = pod_commands(tmp_path / "job.yaml")
    assert ("ghcr.io/pat-rlhf/pat-worker:0.1.0", "pat-generator") in pods
    assert scripts_missing({c for _, c in pods}, SCRIPTS) != []
    assert missing_targets(TEXT, {image_target(i) for i, _ in pods}) == ["no stage `FROM ... AS pat-trainer`"]


@pytest.mark.parametrize(("template", "command"), [
    ('        - name: operator\n          command: ["pat-operator"]\n          args: [--verbose]\n', ["pat-operator"]),
    ("          command:\n            - pat-operator\n            - --verbose\n          args: []\n",
     ["pat-operator", "--verbose"]),
    ("          args: [--verbose]\n", None),
])
def test_the_chart_command_is_read_from_either_list_form(template, command):
    assert chart_command(template) == command


def test_an_ignored_source_is_reported():
    patterns = ["*", "!pyproject.toml", "!README.md", "!operator"]
    assert ignored("workers", patterns) and not ignored("operator/pat_operator/api.py", patterns)
    assert ignored("operator/x/__pycache__", patterns + ["**/__pycache__"])
    assert not ignored(".venv", ["*", "!.venv"])
    assert ignored("docs/a.md", ["docs/*.md"]) and not ignored("docs/x/a.md", ["docs/*.md"])  # * stops at /
