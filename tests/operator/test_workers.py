"""A real RLHFJob through the operator: the pods run the real generator and trainer (tiny model built in each
pod's init container; the trainer pod runs 2 ranks through torch.distributed.run), one killed trainer rank fails
its pod, the gang restarts and resumes from its sharded checkpoint, and the job succeeds after its iterations with
the tokens and weights of an uninterrupted run. Both placements: separate trainer and generator pods, and colocated
(one pod whose 2 CPU "devices" each host an engine rank and a trainer rank, weights handed over inside the pod)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from ..procs import children
from ..runs import final_weights, pat, rollouts
from .conftest import job_doc, phase

pytestmark = pytest.mark.cluster
ITERATIONS = 30


def real_job(name: str, placement: str) -> dict:
    doc = job_doc(name, placement=placement, backoffLimit=2)
    spec = doc["spec"]
    spec["model"]["tiny"]["preset"] = "demo"  # the example's demo-wide trains 15x slower: this tests the gang
    spec["algorithm"].update(iterations=ITERATIONS, promptsPerIteration=8, samplesPerPrompt=4, maxResponseTokens=24)
    spec["reward"]["overlongBuffer"] = 4
    spec["generator"].update(maxBatch=16, maxSeq=64)
    spec["trainer"].update(gpusPerPod=0, ranksPerPod=2)
    # A fixed layout: the run is compared token for token with a local one (when a regroup happens depends on time).
    spec["generator"]["adaptiveTP"]["enabled"] = False
    spec["checkpoint"] = {"everyIterations": 1, "keep": 2, "path": "/var/lib/pat/run",
                          "volume": {"persistentVolumeClaim": {"claimName": f"{name}-run"}}}
    return doc


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_real_workers_run_restart_from_a_checkpoint_and_succeed(jobs, cluster, tmp_path, placement):
    generator, trainer = ("generator", "trainer") if placement == "separate" else ("worker",) * 2  # pods' roles
    jobs.create(real_job("grpo", placement))
    job = jobs.wait("grpo", lambda j: "grpo-run" in _running_message(j), "the missing claim named")
    assert "Unschedulable" in _running_message(job)  # why the gang waits, in its status
    jobs.core.create_namespaced_persistent_volume_claim(jobs.namespace, {
        "metadata": {"name": "grpo-run"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    logs = lambda: "\n".join(f"--- {p.metadata.name}\n{cluster.kubelet.log(jobs.namespace, p.metadata.name, c)[-3000:]}"  # noqa: E731
                             for p in jobs.pods("grpo") for c in ("prepare", p.metadata.labels["pat.dev/role"]))
    jobs.wait("grpo", phase("Running"), "Running", timeout=180, explain=logs)
    job = jobs.wait("grpo", lambda j: j["status"].get("iteration", 0) >= 2, "iteration 2", timeout=240, explain=logs)
    layouts = job["status"]["generators"]
    assert layouts[0]["pod"] == jobs.pod("grpo", generator) and sum(layouts[0]["layout"]) == 2  # read from the pod
    # the pod's torch.distributed.run, or `pat colocated`
    (pod,) = cluster.kubelet.pids(jobs.namespace, jobs.pod("grpo", trainer))
    if placement == "colocated":  # its children: the generator and the trainer's torch.distributed.run
        (pod,) = [p for p in children(pod) if b"trainer" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
    ranks = children(pod)
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)  # one rank, not the pod
    jobs.wait("grpo", lambda j: j["status"].get("restarts") == 1, "gang restart", timeout=60, explain=logs)
    job = jobs.wait("grpo", phase("Succeeded"), "Succeeded", timeout=300, explain=logs)
    assert job["status"]["iteration"] == ITERATIONS and job["status"]["restarts"] == 1
    assert job["status"]["attempt"] == 1, job["status"]  # a trainer's failure restarts the whole gang
    trainer_log = cluster.kubelet.log(jobs.namespace, jobs.pod("grpo", trainer), trainer)  # the container: the role
    assert "resumed from iter-" in trainer_log, trainer_log[-2000:]
    # The interrupted run on the cluster equals an uninterrupted `pat run` of the same job on this machine: every
    # token of every iteration, and the final weights (from the sharded checkpoint on the claim), bitwise.
    job_file = tmp_path / "grpo.yaml"
    job_file.write_text(yaml.safe_dump(real_job("grpo", placement)))
    reference = tmp_path / "reference"
    done = pat("run", str(job_file), "--run-dir", str(reference), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    on_cluster = cluster.kubelet.claim_dir(jobs.namespace, "grpo-run")
    assert len(rollouts(on_cluster)) == ITERATIONS and rollouts(on_cluster) == rollouts(reference)
    ref, got = final_weights(reference), final_weights(on_cluster)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def _running_message(job: dict) -> str:
    return next((c["message"] for c in (job.get("status") or {}).get("conditions", []) if c["type"] == "Running"), "")
