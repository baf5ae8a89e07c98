"""The project's images, built by scripts/images.sh (buildah, local Debian bases, the CPU torch and vLLM), run as
pods by the process kubelet from their own root filesystems: what each holds, who it runs as, and that every
command the operator writes into a pod exists in the image that pod names."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess

import pytest

from pat_operator.api import VLLM_WORKER_IMAGE, WORKER_IMAGE
from tests.cluster.fixtures import Cluster
from tests.cluster.images import ROOT, built
from tests.cluster.podexec import in_root
from tests.cluster.test_cluster import (create_pods, logs_of, pod_manifest, read_pod, ready, terminated,
                                        wait_ended, wait_pod)
from tests.unit.test_images import EXAMPLES, image_target, pod_commands

pytestmark = pytest.mark.cluster
VERSION = importlib.metadata.version("pat-rlhf")


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return built()


def image_pod(name: str, image: str, script: str, read_only: bool = True, **container: object) -> dict:
    """A pod as the operator writes them: the image's user (no runAsUser), a read-only root, /tmp an emptyDir."""
    return pod_manifest(name, ["sh", "-c", script], volumes=[{"name": "tmp", "emptyDir": {}}],
                        container={"image": image, "securityContext": {"readOnlyRootFilesystem": read_only},
                                   "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}], **container})


def run_pods(cluster: Cluster, core, namespace: str, pods: dict[str, dict], timeout: float = 120) -> dict[str, str]:
    """Runs the pods side by side; {name: log} once each succeeded."""
    create_pods(core, namespace, *pods.values())
    out = {}
    for name in pods:
        pod = wait_ended(cluster, core, namespace, name, timeout)
        assert pod["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, name)
        out[name] = cluster.kubelet.log(namespace, name, "main")
    return out


def test_each_image_runs_as_uid_1000_on_a_read_only_root_and_says_the_package_version(
        cluster: Cluster, core, namespace: str, images):
    script = ("id -u; id -g; echo $HOME; touch /opt/venv/x 2>/dev/null && echo writable || echo read-only; "
              "touch /tmp/x && echo tmp-ok; {} --version; "
              "python -c 'import importlib.util as u; print(\"torch\", bool(u.find_spec(\"torch\")))'")
    commands = {"pat-operator": "pat-operator", "pat-worker": "pat", "pat-worker-vllm": "pat"}
    logs = run_pods(cluster, core, namespace, {
        target: image_pod(target, images[target], script.format(commands[target])) for target in commands})
    for target, log in logs.items():
        lines = log.split("\n")
        assert lines[:5] == ["1000", "1000", "/tmp", "read-only", "tmp-ok"], (target, log)
        assert lines[5] == f"{commands[target]} {VERSION}", (target, log)
        # The operator image has no torch; the worker images have it (the same check's positive control).
        assert lines[6] == f"torch {target != 'pat-operator'}", (target, log)


def test_the_writable_root_is_the_containers_own(cluster: Cluster, core, namespace: str, images):
    """Without readOnlyRootFilesystem, what a container writes lands in a layer of its own: the next container of
    the same image starts from the image as built."""
    write = image_pod("writer", images["pat-operator"], "echo x > /opt/venv/written && cat /opt/venv/written",
                      read_only=False, securityContext={"runAsUser": 0})
    assert run_pods(cluster, core, namespace, {"writer": write})["writer"] == "x\n"
    look = image_pod("reader", images["pat-operator"], "test -e /opt/venv/written && echo leaked || echo clean")
    assert run_pods(cluster, core, namespace, {"reader": look})["reader"] == "clean\n"


def test_exec_probes_run_in_the_image(cluster: Cluster, core, namespace: str, images):
    """An exec probe joins the container's root: /opt/venv exists in the image, not on this host."""
    assert not os.path.exists("/opt/venv/bin/pat-operator")
    probe = {"exec": {"command": ["test", "-x", "/opt/venv/bin/pat-operator"]}, "periodSeconds": 1}
    create_pods(core, namespace, image_pod("probed", images["pat-operator"], "sleep 60", readinessProbe=probe))
    wait_pod(cluster, core, namespace, "probed", ready, "ready through its exec probe", timeout=60)


def test_every_command_the_operator_writes_exists_in_the_image_its_pod_names(
        cluster: Cluster, core, namespace: str, images):
    """The examples' pods (every role, both engines, init containers) as the operator builds them, with their
    images swapped for the built ones of the same target: each container's command resolves on the image's PATH as
    the pod's user."""
    wanted: dict[str, set[str]] = {}
    for image, command in set().union(*map(pod_commands, EXAMPLES)):
        wanted.setdefault(image_target(image), set()).add(command)
    assert wanted.keys() == {image_target(WORKER_IMAGE), image_target(VLLM_WORKER_IMAGE)}, wanted
    checks = {f"cmd-{target}": image_pod(f"cmd-{target}", images[target], " && ".join(
        f"command -v {shlex.quote(c)}" for c in sorted(commands))) for target, commands in wanted.items()}
    for name, log in run_pods(cluster, core, namespace, checks).items():
        assert len(log.split()) == len(wanted[name[4:]]) and all(p.startswith("/opt/venv/bin/") for p in log.split()), \
            log


def test_a_command_missing_from_the_image_fails_the_pod_with_the_kubelets_message(
        cluster: Cluster, core, namespace: str, images):
    """The negative control of the check above: torch's `torchrun` is in pat-worker, not in the operator image."""
    pod = pod_manifest("no-torchrun", ["torchrun", "--help"], container={"image": images["pat-operator"]})
    create_pods(core, namespace, pod)
    state = terminated(wait_ended(cluster, core, namespace, "no-torchrun"))
    assert state["reason"] == "StartError" and state["exitCode"] == 128, state
    assert state["message"] == 'exec: "torchrun": executable file not found in $PATH', state


def test_an_image_missing_from_the_store_is_err_image_never_pull(cluster: Cluster, core, namespace: str):
    create_pods(core, namespace, pod_manifest("absent", ["true"], container={"image": "localhost/pat-absent:0"}))
    pod = wait_pod(cluster, core, namespace, "absent", lambda p: "containerStatuses" in p["status"], "a status")
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "ErrImageNeverPull" and "localhost/pat-absent:0" in waiting["message"], \
        json.dumps(read_pod(core, namespace, "absent"))


def test_mount_targets_resolve_inside_the_image(tmp_path):
    """An image's /var/run -> /run: a volume at /var/run/secrets lands in the image's /run, not in the host's (what
    a naive join of root and target did: the Service token went missing in the operator's pod)."""
    root = tmp_path / "rootfs"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "var" / "lib").symlink_to("../usr/lib")
    target = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert in_root(str(root), target) == f"{root}/run/secrets/kubernetes.io/serviceaccount"
    assert in_root(str(root), "/var/lib/x") == f"{root}/usr/lib/x"
    assert in_root(str(root), "/../../etc/passwd") == f"{root}/etc/passwd"  # .. stops at the image's root
    assert os.path.realpath(os.path.join(root, target.lstrip("/"))).startswith("/run/")  # the naive join escapes


def test_a_failed_build_names_its_target_stage_and_step(tmp_path, images):
    """scripts/images.sh on a Dockerfile whose operator stage has a failing step (the layers before it cached)."""
    text = (ROOT / "Dockerfile").read_text()
    cmd = 'CMD ["pat-operator", "--help"]'
    assert text.count(cmd) == 1
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace(cmd, "RUN echo a broken step && exit 3\n" + cmd))
    out = subprocess.run([str(ROOT / "scripts/images.sh"), "pat-operator"], capture_output=True, text=True,
                         env={**os.environ, "DOCKERFILE": str(broken)}, timeout=600)
    assert out.returncode == 1, out.stderr
    assert re.search(r"image build failed: target pat-operator, stage pat-operator, \[\d+/\d+\] STEP \d+/\d+: "
                     r"RUN echo a broken step && exit 3\n", out.stderr), out.stderr
    assert images["pat-operator"] in subprocess.run(["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"],
                                                    capture_output=True, text=True).stdout  # the built one stays
