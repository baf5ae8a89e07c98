"""An RLHFJob with generator.engine: vllm under the operator, on the real control plane with the process kubelet
and a real Prometheus: the generator pod runs two real vLLM engines (TP=1 each), the trainer syncs its weights to
them over the network every iteration, the job's status shows the pod's queue from vLLM's own metrics, and a
vLLM pod killed mid-run restarts the gang, which resumes from its checkpoint and succeeds."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pat_workers.engine.tiny import make_tiny_model
from tests.vllm.conftest import VLLM_MODEL, vllm_python
from tests.vllm.test_adaptive import TAIL_PROFILE
from tests.vllm.test_pod import policy_logprobs

from .conftest import job_doc, phase
from .tailjob import SHORT, TAIL, claim, rollouts, run_job, tail_job

pytestmark = pytest.mark.cluster
ITERATIONS = 3
# vLLM's log-probabilities against the trainer's, under the same weights: the mean |difference| per token that
# the trainer logs as logprob_diff_mean. Measured ~1e-5 (float32); weights one GRPO step apart differ by ~100x this.
GAP_TOL = 2e-3


@pytest.fixture
def model_dir():
    """The policy (a random Llama vLLM's CPU kernels take), readable by the pods' non-root user."""
    path = Path(tempfile.mkdtemp(prefix="pat-vllm-model-"))
    path.chmod(0o755)
    make_tiny_model(path, seed=3, **VLLM_MODEL)
    for f in path.iterdir():
        f.chmod(0o644)
    yield path
    shutil.rmtree(path)


def vllm_job(name: str, model: Path, vllm_python: str, prometheus_url: str) -> dict:
    doc = job_doc(name, backoffLimit=2)
    spec = doc["spec"]
    spec["model"] = {"path": "/models", "volume": {"hostPath": {"path": str(model)}}, "mountPath": "/models"}
    del spec["dataset"]["synthetic"]["longTail"]  # responses run until EOS: batches long enough to see the queue
    spec["reward"]["overlongBuffer"] = 16  # rewards that vary with length: advantages in every group move the weights
    spec["algorithm"].update(iterations=ITERATIONS, promptsPerIteration=8, samplesPerPrompt=4, maxResponseTokens=48,
                             learningRate=0.01)
    spec["generator"] = {
        "replicas": 1, "gpusPerPod": 0, "ranksPerPod": 2, "maxSeq": 128, "engine": "vllm",
        "vllm": {"tensorParallelSize": 1, "maxModelLen": 128, "enforceEager": True},
        "env": [{"name": "PAT_VLLM_PYTHON", "value": vllm_python}],
        "adaptiveTP": {"prometheus": {"url": prometheus_url, "queryInterval": 1.0}}}
    spec["checkpoint"] = {"everyIterations": 1, "keep": 2, "path": "/var/lib/pat/run",
                          "volume": {"persistentVolumeClaim": {"claimName": f"{name}-run"}}}
    return doc


def test_a_vllm_job_syncs_weights_every_iteration_resumes_after_a_pod_kill_and_succeeds(
        jobs, cluster, prometheus, model_dir):
    name = "vllm"
    jobs.core.create_namespaced_persistent_volume_claim(jobs.namespace, claim(name))
    jobs.create(vllm_job(name, model_dir, vllm_python(), prometheus.url))

    def logs() -> str:
        return "\n".join(f"--- {p.metadata.name}\n{cluster.kubelet.log(jobs.namespace, p.metadata.name, c)[-3000:]}"
                         for p in jobs.pods(name) for c in (p.metadata.labels["pat.dev/role"],))

    # The queue of the vLLM pod, in the job's status, from vllm:num_requests_* in Prometheus.
    job = jobs.wait(name, lambda j: any(g.get("running") is not None and g.get("waiting") is not None
                                        for g in (j.get("status") or {}).get("generators", [])),
                    "the generator's queue in status", timeout=300, explain=logs)
    _dev_endpoints_are_refused_from_another_pod(jobs, cluster, name)
    # A user's load through the pod's OpenAI API (behind the job token), one call after another until the event
    # comes, keeps vLLM busy long enough for the 1 s scrapes and the operator's 2 s observations to see it (one
    # call, or the trainer's own batches, may take under a second here).
    stop, served = threading.Event(), []
    load = threading.Thread(target=_openai_load, args=(jobs, name, stop, served))
    load.start()
    try:
        jobs.wait(name, lambda j: any(e.startswith(f"GeneratorQueue: pod {name}-generator-0: ") and
                                      "vllm:num_requests" in e for e in jobs.events(name)),
                  "a GeneratorQueue event from vLLM's series", timeout=120,
                  explain=lambda: f"{jobs.events(name)}; {len(served)} load call(s) served")
    finally:
        stop.set()
        load.join()
    assert served, "no load call was served"
    job = jobs.wait(name, lambda j: j["status"].get("iteration", 0) >= 1, "iteration 1", timeout=240, explain=logs)
    # Kill the vLLM pod (its pod API process and with it the engines) while iteration 2 runs.
    (pid,) = cluster.kubelet.pids(jobs.namespace, f"{name}-generator-0")
    os.kill(pid, signal.SIGKILL)
    jobs.wait(name, lambda j: j["status"].get("restarts") == 1, "gang restart", timeout=120, explain=logs)
    job = jobs.wait(name, phase("Succeeded"), "Succeeded", timeout=420, explain=logs)
    assert job["status"]["iteration"] == ITERATIONS and job["status"]["restarts"] == 1
    trainer_log = cluster.kubelet.log(jobs.namespace, f"{name}-trainer-0", "trainer")
    assert "resumed from iter-" in trainer_log, trainer_log[-2000:]

    run = cluster.kubelet.claim_dir(jobs.namespace, f"{name}-run")
    rows = {r["iteration"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(1, ITERATIONS + 1)), rows
    for it, row in rows.items():  # vLLM generated with the weights the trainer held: synced every iteration
        assert row["logprob_diff_mean"] < GAP_TOL, (it, row)
    # The negative control: the last iteration's rollouts scored with the initial weights (a vLLM that missed the
    # syncs) are far from what vLLM reported, so a missed sync could not pass the check above.
    last = json.loads((run / "rollouts" / f"iter-{ITERATIONS:04d}.json").read_text())
    assert {r["policy_version"] for r in last} == {ITERATIONS - 1}
    stale = [(policy_logprobs(model_dir, r["prompt"] + r["tokens"])[len(r["prompt"]) - 1:]
              - torch.tensor(r["logprobs"])).abs().mean() for r in last[:8]]
    assert sum(stale) / len(stale) > 10 * GAP_TOL, stale


def test_the_operator_regroups_a_vllm_job_in_its_tail(jobs, cluster, prometheus, tail_data):
    """engine vllm with adaptiveTP (controller operator, tpSizes [1, 2]): the pod runs two TP=1 engines and one
    TP=2 engine over its two ranks, and the operator, reading the pod's profile and queue from Prometheus, moves
    the batch's long response to the TP=2 engine once the short ones end. Every response keeps its exact length:
    none lost or duplicated by the move. The decode profile is given (adaptiveTP.profile: TP=2 faster with one
    sequence, as it is for the `bench` model here), so that the plan does not hang on a start-up measurement taken
    while the trainer pod loads beside it; tests/vllm measures and exports one."""
    name = "vllm-tail"
    (tail_data / "profile.json").write_text(json.dumps(TAIL_PROFILE))
    (tail_data / "profile.json").chmod(0o644)
    doc = tail_job(name, tail_data, TAIL, prometheus_url=prometheus.url)
    g = doc["spec"]["generator"]
    del g["maxBatch"]  # engine pat's
    g["adaptiveTP"].update(tpSizes=[1, 2], profile="/data/profile.json")
    g.update(engine="vllm", vllm={"enforceEager": True}, env=[{"name": "PAT_VLLM_PYTHON", "value": vllm_python()}])
    job = run_job(jobs, cluster, doc, timeout=480)
    generator = job["status"]["generators"][0]
    assert generator["regroups"] >= 1 and generator["appliedEpoch"] >= 1, generator
    events = jobs.events(name)
    assert [e for e in events if e.startswith(f"Regrouped: {name}-generator-0: 1+1 -> 2")], events
    assert not [e for e in events if e.startswith("RegroupFailed")], events
    run = cluster.kubelet.claim_dir(jobs.namespace, f"{name}-run")
    for iteration in (1, 2):
        lengths = sorted(len(tokens) for tokens in rollouts(run, iteration).values())
        assert lengths == [SHORT] * 7 + [TAIL], (iteration, lengths)


def test_a_model_vllm_cannot_load_fails_the_job_with_vllms_own_message(jobs, cluster, prometheus, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    name = "vllm-bad"
    jobs.core.create_namespaced_persistent_volume_claim(jobs.namespace, claim(name))
    doc = vllm_job(name, model_dir, vllm_python(), prometheus.url)
    doc["spec"]["runPolicy"]["backoffLimit"] = 0
    jobs.create(doc)
    job = jobs.wait(name, phase("Failed"), "Failed", timeout=240)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded", failed
    # The generator pod's last words, through its termination message: vLLM's own error, not just an exit code.
    assert (f"{name}-generator-0: container generator exited with code 1 (Error) (pat generator: vLLM engine 0 "
            f"exited with code 1: ") in failed["message"], failed
    assert "Model architectures ['NoSuchModelForCausalLM'] are not supported" in failed["message"], failed


def _openai_load(jobs, name: str, stop: threading.Event, served: list[float]) -> None:
    """128 prompts of 120 tokens each per /v1/completions call through the generator pod's proxy, call after call
    until `stop`; each served call's seconds go to `served`."""
    token = base64.b64decode(jobs.core.read_namespaced_secret(f"{name}-token", jobs.namespace).data["token"]).decode()
    generator = next(p for p in jobs.pods(name) if p.metadata.name == f"{name}-generator-0")
    body = {"model": "policy", "prompt": [[256] + [(7 * i + j) % 250 for j in range(7)] for i in range(128)],
            "max_tokens": 120, "ignore_eos": True, "temperature": 1.0}
    request = urllib.request.Request(f"http://{generator.status.pod_ip}:8000/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                  "Authorization": f"Bearer {token}"})
    while not stop.is_set():
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=300) as response:
            assert len(json.loads(response.read())["choices"]) == 128
        served.append(time.monotonic() - started)


PROBE = """
import json, os, socket, sys, urllib.error, urllib.request
def post(url, token=None):
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + token} if token else {})}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, b"{}", headers), timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code
engine = socket.socket(socket.AF_UNIX)
try:
    engine.connect(sys.argv[2])
    reached = "connected"
except OSError as e:
    reached = type(e).__name__
print(json.dumps([post(sys.argv[1]), post(sys.argv[1], os.environ["PAT_JOB_TOKEN"]), reached]))
"""


def _dev_endpoints_are_refused_from_another_pod(jobs, cluster, name: str) -> None:
    """From the trainer pod: vLLM's collective_rpc through the generator pod's port is refused without the job's
    token and absent with it, and the vLLM server's own socket (in the generator pod's /tmp) does not exist there."""
    generator = next(p for p in jobs.pods(name) if p.metadata.name == f"{name}-generator-0")
    (pid,) = cluster.kubelet.pids(jobs.namespace, generator.metadata.name)
    engine = int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0])
    argv = open(f"/proc/{engine}/cmdline").read().split("\0")
    socket_path = argv[argv.index("--uds") + 1]
    out = cluster.kubelet.exec(jobs.namespace, f"{name}-trainer-0", "trainer", [
        "python", "-c", PROBE, f"http://{generator.status.pod_ip}:8000/collective_rpc", socket_path])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [401, 404, "FileNotFoundError"], out.stdout
