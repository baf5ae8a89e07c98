"""A generator pod restarted alone while the trainer runs (as the operator restarts a failed generator pod: same
address, a fresh process with the initial weights and no batch): real processes, a trainer pod of 2 ranks
(torch.distributed.run) and 2 generator pods of 1 engine rank each, over real HTTP and gloo.

One pod is killed (SIGKILL, its whole process group) in the middle of its part of a batch and started again on the
same port: the trainer waits for it, gives it the batch's weights in a weight round of its own, and sends it its part
again. The other is killed once a later batch is generated, while the trainer trains: the weight round after training
waits for it, and goes to both pods in a group formed anew. The run equals an uninterrupted one: every
token and log-probability of every iteration (so no request lost or taken twice, and the restarted pods generated
with the trainer's weights) and the final weights, bitwise. Negative control: a pod that is not restarted within
--generator-restart-timeout fails the trainer, with an error naming the pod; so does, for a trainer restarted alone,
a pod that holds a newer policy than it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from pat_operator.api import RLHFJob
from pat_operator.commands import generator_args, trainer_args
from pat_workers.launcher import prepare
from pat_workers.ports import free_port

from ..runs import ROOT, final_weights, rollouts, rows

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

EXAMPLE = ROOT / "examples" / "local.yaml"
ITERATIONS = 4
PROMPTS, SAMPLES = 8, 4


def job() -> RLHFJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["placement"] = "separate"
    spec["model"]["tiny"]["preset"] = "demo"
    spec["dataset"]["synthetic"]["longTail"] = 1.0  # every response runs to the cap: a batch lasts long enough to kill
    spec["algorithm"].update(iterations=ITERATIONS, promptsPerIteration=PROMPTS, samplesPerPrompt=SAMPLES,
                             maxResponseTokens=48)
    spec["generator"].update(replicas=2, ranksPerPod=1, maxBatch=16, maxSeq=96)
    spec["generator"]["adaptiveTP"]["enabled"] = False
    spec["trainer"]["ranksPerPod"] = 2
    spec["checkpoint"] = {"everyIterations": ITERATIONS, "keep": 1}
    return RLHFJob.model_validate(doc)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """job.yaml, token and the tiny model, shared by the runs."""
    folder = tmp_path_factory.mktemp("prepared")
    prepare(job(), folder)
    return folder


class Gang:
    """The generator pods (each a process group of its own, as a container) and the trainer pod of one run."""

    def __init__(self, prepared: Path, run_dir: Path, restart_timeout: float):
        self.prepared, self.run_dir = prepared, run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True)
        self.spec = job().spec
        self.token = (prepared / "token").read_text().strip()
        self.ports = [free_port() for _ in range(self.spec.generator.replicas)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.generators = [self._generator(i) for i in range(len(self.ports))]
        argv = trainer_args(self.spec, str(prepared / "job.yaml"), str(prepared / "model"), str(run_dir), self.urls,
                            "127.0.0.1", 0, "127.0.0.1", free_port(), token_file=str(prepared / "token"))
        self.trainer_argv = [*argv, "--generator-restart-timeout", str(restart_timeout)]
        self.trainer = self._spawn("trainer", self.trainer_argv)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "a")
        return subprocess.Popen([sys.executable, "-m", "pat_workers.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)

    def _generator(self, i: int) -> subprocess.Popen:
        spec = self.spec.model_copy(update={"generator": self.spec.generator.model_copy(
            update={"port": self.ports[i]})})
        return self._spawn(f"generator-{i}", generator_args(spec, str(self.prepared / "model"), "127.0.0.1",
                                                            str(self.prepared / "token")))

    def state(self, i: int) -> dict | None:
        request = urllib.request.Request(self.urls[i] + "/v1/state", headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            return None

    def kill_when(self, i: int, ready: Callable[[], bool], timeout: float = 300) -> None:
        """SIGKILL to generator pod i's process group as soon as `ready()`."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.trainer.poll() is None, self.log("trainer")
            assert time.monotonic() < deadline, f"generator {i}: the moment to kill it never came"
            time.sleep(0.005)
        os.killpg(self.generators[i].pid, signal.SIGKILL)
        self.generators[i].wait()

    def restart(self, i: int) -> None:
        self.generators[i] = self._generator(i)

    def finish(self, timeout: float = 600) -> int:
        return self.trainer.wait(timeout)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def stop(self) -> None:
        for p in (self.trainer, *self.generators):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


    def generating(self, i: int, iteration: int) -> Callable[[], bool]:
        """Whether generator pod i is generating its part of the batch of `iteration`."""
        def now() -> bool:
            state = self.state(i)
            return state is not None and state["batch_id"] == f"iter-{iteration}" and not state["batch_done"]
        return now

    def generated(self, iteration: int) -> Callable[[], bool]:
        """Whether the trainer has every completion of `iteration` (it writes them before it trains)."""
        return (self.run_dir / "rollouts" / f"iter-{iteration:04d}.json").exists


def test_generator_pods_restarted_alone_lose_nothing(prepared, tmp_path):
    reference = Gang(prepared, tmp_path / "reference", restart_timeout=120)
    try:
        assert reference.finish() == 0, reference.log("trainer")[-3000:]
    finally:
        reference.stop()

    gang = Gang(prepared, tmp_path / "restarted", restart_timeout=120)
    try:
        gang.kill_when(1, gang.generating(1, 2))
        time.sleep(1)  # the trainer finds it gone
        gang.restart(1)
        gang.kill_when(0, gang.generated(3))
        gang.restart(0)
        assert gang.finish() == 0, gang.log("trainer")[-3000:]
        held = [gang.state(i)["policy_version"] for i in range(2)]
    finally:
        gang.stop()
    trainer = gang.log("trainer")
    assert f"generator pod {gang.urls[1]}" in trainer and "waiting up to 120 s for it to come back" in trainer
    assert f"iteration 2: generator pod(s) {gang.urls[1]} restarted: they take the weights of version 1" in trainer
    assert f"generator pod {gang.urls[0]}" in trainer and "iteration 3:" not in trainer  # found at the weight round
    assert held == [ITERATIONS, ITERATIONS]  # the restarted pods hold the trainer's last weights
    batch = rollouts(gang.run_dir)["iter-0002.json"]
    assert sorted(r["id"] for r in batch) == sorted({r["id"] for r in batch}) and len(batch) == PROMPTS * SAMPLES
    # Every token and log-probability of every iteration, and the final weights, as without the restarts.
    assert rollouts(gang.run_dir) == rollouts(reference.run_dir) and len(rollouts(gang.run_dir)) == ITERATIONS
    ref, got = final_weights(reference.run_dir), final_weights(gang.run_dir)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_generator_pod_not_back_in_time_fails_the_trainer_naming_it(prepared, tmp_path):
    """And a trainer started again alone (no checkpoint yet: it starts from iteration 0) refuses the pod that still
    holds the first trainer's weights, naming it."""
    gang = Gang(prepared, tmp_path / "run", restart_timeout=2)
    try:
        gang.kill_when(1, gang.generating(1, 2))
        code = gang.finish(timeout=120)
        gang.restart(1)
        gang.trainer = gang._spawn("trainer-again", gang.trainer_argv)
        again = gang.finish(timeout=300)
    finally:
        gang.stop()
    trainer = gang.log("trainer")
    assert code != 0
    assert (f"pat trainer: generator pod {gang.urls[1]} did not come back within 2 s (--generator-restart-timeout)"
            in trainer), trainer[-3000:]
    assert [r["iteration"] for r in rows(gang.run_dir)] == [1]
    assert again != 0 and (f"pat trainer: generator pod(s) {gang.urls[0]} (1) hold a newer policy version than the "
                           f"trainer's 0" in gang.log("trainer-again")), gang.log("trainer-again")[-3000:]
