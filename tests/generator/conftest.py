"""Generator pods as real processes (`python -m pat_workers.generator`, 2 CPU ranks each) spoken to over real
HTTP on 127.0.0.1, and single-process references of what they must generate.

One pod per controller mode, started once for the session (concurrently) and shared: tests read the pod's
current layout, epoch and policy version from GET /v1/state instead of assuming them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.loader import load_model, load_tokenizer
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import make_tiny_model
from tests.engine.test_engine import OneRankPool
from tests.tiers import require, starts

TOKEN = "test-job-token"
MAX_BATCH, MAX_SEQ = 8, 512
MODEL_SEED = 1
# An offline profile in which TP=2 is 10x faster than TP=1 for one sequence and much slower for many: the pod
# should start a batch at 2 x TP1 and merge into TP2 once a single sequence is left. TP=1 is near what the test
# model's steps take (mostly Python overhead); TP=2 lies, and more so in the planning pods, whose TP=2 steps stall
# 3 ms more (a slow link, SLOW_TP2).
TAIL_PROFILE = {"decode": {"1": {"1": 0.0015, "2": 0.0016, "4": 0.0017, "8": 0.0019, "16": 0.0023},
                           "2": {"1": 0.00015, "2": 0.02, "4": 0.08, "8": 0.3, "16": 1.0}}}  # no context term
SLOW_TP2 = "decode.tp@0~0.003,decode.tp@1~0.003"  # engine/faults.py: both ranks of a TP=2 group, every step


class Pod:
    """One generator pod process and a small synchronous HTTP client for it."""

    def __init__(self, name: str, model_dir: Path, log_dir: Path, *args: str, ranks: int = 2,
                 env: dict[str, str] | None = None):
        require("slow", f"a generator pod ({name})")
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pat_workers.generator", "--model", str(model_dir), "--ranks", str(ranks),
             "--host", "127.0.0.1", "--port", "0", "--max-batch", str(MAX_BATCH), "--max-seq", str(MAX_SEQ),
             "--device", "cpu", *args],
            stdout=subprocess.PIPE, stderr=self.log.open("w"), env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline().decode()
        assert line.startswith("listening on http://"), f"{name}: {line!r}\n{self.log.read_text()}"
        self.url = line.split()[-1]

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.call("GET", "/readyz")[0] != 200:
            assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.name} not ready after {timeout} s"
            time.sleep(0.1)

    def call(self, method: str, path: str, body=None, *, raw: bytes | None = None, token: str | None = TOKEN,
             timeout: float = 60.0) -> tuple[int, dict | str]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def ok(self, method: str, path: str, body=None, status: int = 200) -> dict:
        got, reply = self.call(method, path, body)
        assert got == status, f"{method} {path}: {got} {reply}"
        return reply

    def state(self) -> dict:
        return self.ok("GET", "/v1/state")

    def generate(self, batch_id: str, requests: list[dict], version: int | None = None) -> list[dict]:
        """Submits a batch and returns its completions once done, in request order."""
        self.submit(batch_id, requests, version)
        completions = self.finish(batch_id)
        assert [c["id"] for c in completions] == [r["id"] for r in requests]
        return completions

    def submit_after_weights(self, batch_id: str, requests: list[dict], version: int, timeout: float = 30.0) -> None:
        """Submits a batch as soon as the ranks have ended a weight round (a refused one ends asynchronously: until
        then the pod answers 409)."""
        deadline = time.monotonic() + timeout
        while (status := self.call("POST", "/v1/rollouts", {"batch_id": batch_id, "policy_version": version,
                                                             "requests": requests}))[0] == 409:
            assert time.monotonic() < deadline, f"the weight round never ended: {status[1]}"
            time.sleep(0.02)
        assert status[0] == 202, status

    def submit(self, batch_id: str, requests: list[dict], version: int | None = None) -> dict:
        version = self.state()["policy_version"] if version is None else version
        return self.ok("POST", "/v1/rollouts", {"batch_id": batch_id, "policy_version": version,
                                                "requests": requests}, 202)

    def finish(self, batch_id: str, timeout: float = 120.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not (status := self.ok("GET", f"/v1/rollouts/{batch_id}?wait=10"))["done"]:
            assert time.monotonic() < deadline, f"batch {batch_id} not done after {timeout} s: {status}"
        return status["completions"]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.call("GET", "/metrics", token=None)
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# -- requests and references -------------------------------------------------------------------------------
def rollout(rid: str, prompt: str | list[int], max_tokens: int, **sampling) -> dict:
    """A RolloutRequest payload: text or token ids; greedy and ignore_eos unless `sampling` says otherwise."""
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {"id": rid, key: prompt, "sampling": {"max_tokens": max_tokens, "ignore_eos": True, **sampling}}


def long_tailed(n: int = 8, long: int = 150, tag: str = "r") -> list[dict]:
    """n greedy requests of 6 to 27 tokens and one of `long` tokens; text and token-id prompts alternate."""
    return [rollout(f"{tag}-{i}", f"Q{i}: {i} + {2 * i} =" if i % 2 == 0 else
                    [256] + [(37 * i + 11 * j) % 250 for j in range(3 + i % 5)],
                    long if i == n - 1 else 6 + (i * 7) % 22) for i in range(n)]


class Reference:
    """What the pod must generate, computed here by one engine on one rank (TP=1, float32)."""

    def __init__(self, model_dir: Path, weights: dict | None = None):
        cfg, loaded = load_model(model_dir)
        # The model takes the dict over (its fused weights replace entries): the caller's stays as it was.
        self.model = Transformer(cfg, dict(weights) if weights is not None else loaded)
        self.tokenizer = load_tokenizer(model_dir)

    def __call__(self, payloads: list[dict]) -> dict[str, Request]:
        requests = [Request(p["id"], p.get("prompt_token_ids") or self.tokenizer.encode(p["prompt"]).ids,
                            SamplingParams(**{**p["sampling"], "stop_token_ids": tuple(
                                p["sampling"].get("stop_token_ids", ()))})) for p in payloads]
        engine = Engine(self.model, OneRankPool(), max_batch=len(requests), max_seq=MAX_SEQ)
        engine.add(requests)
        done = {}
        while engine.has_work():
            done.update((r.id, r) for r in engine.step().finished)
        return done


def mismatched(completions: list[dict], reference: dict[str, Request], atol: float = 1e-4) -> list[str]:
    """Ids whose tokens, finish reason or log-probabilities differ from the reference."""
    return [c["id"] for c in completions
            if c["token_ids"] != reference[c["id"]].output or c["finish_reason"] != reference[c["id"]].finish_reason
            or any(abs(a - b) > atol for a, b in zip(c["logprobs"], reference[c["id"]].logprobs))]


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pod-model"), family="llama", preset="test", seed=MODEL_SEED)


@pytest.fixture(scope="session")
@starts("slow")
def pods(model_dir, tmp_path_factory):
    """{"operator": a pod that obeys regroup plans (token in a file), "pod": one that plans with TAIL_PROFILE
    with the guard off (token in PAT_JOB_TOKEN), "guarded": the same with the guard on}, started
    together; each must exit 0 on SIGTERM at the end."""
    tmp = tmp_path_factory.mktemp("pods")
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "profile.json").write_text(json.dumps(TAIL_PROFILE))
    started = {
        "operator": Pod("operator", model_dir, tmp, "--controller", "operator", "--token-file", str(tmp / "token")),
        **{name: Pod(name, model_dir, tmp, "--controller", "pod", "--profile", str(tmp / "profile.json"),
                     "--cooldown-steps", "2", *args, env={"PAT_JOB_TOKEN": TOKEN, "PAT_FAILPOINTS": SLOW_TP2})
           for name, args in (("pod", ["--no-guard"]), ("guarded", []))},
    }
    try:
        for pod in started.values():
            pod.wait_ready()
        yield started
    finally:
        codes = {name: pod.stop() for name, pod in started.items()}
    assert codes == {"operator": 0, "pod": 0, "guarded": 0}, codes


@pytest.fixture(scope="session")
def operator_pod(pods) -> Pod:
    return pods["operator"]


@pytest.fixture(scope="session")
def planning_pod(pods) -> Pod:
    return pods["pod"]


@pytest.fixture(scope="session")
def guarded_pod(pods) -> Pod:
    return pods["guarded"]


@pytest.fixture(scope="session")
@starts("slow")
def fixed_pod(model_dir, tmp_path_factory):
    """A pod of a fixed layout, TP=2 on its 2 ranks (generator.tensorParallelSize: 2, adaptive TP off), started
    only for the tests that use it."""
    pod = Pod("fixed", model_dir, tmp_path_factory.mktemp("fixed-pod"), "--controller", "operator",
              "--tensor-parallel-size", "2", env={"PAT_JOB_TOKEN": TOKEN})
    try:
        pod.wait_ready()
        yield pod
    finally:
        assert pod.stop() == 0


CONTROL_TOKEN, INFERENCE_TOKEN = "control-token", "inference-token"
WEIGHTS_STORE = "localhost"  # a DNS name: the pod resolves it when an update comes (here to 127.0.0.1)


@pytest.fixture(scope="session")
@starts("slow")
def access_pod(model_dir, tmp_path_factory):
    """A one-rank pod with the job's two tokens (control in a file, inference in PAT_INFERENCE_TOKEN) that takes
    weights only from WEIGHTS_STORE, started only for the tests that use it."""
    tmp = tmp_path_factory.mktemp("access-pod")
    (tmp / "token").write_text(CONTROL_TOKEN + "\n")
    pod = Pod("access", model_dir, tmp, "--controller", "operator", "--token-file", str(tmp / "token"),
              "--weights-store", WEIGHTS_STORE, ranks=1, env={"PAT_INFERENCE_TOKEN": INFERENCE_TOKEN})
    try:
        pod.wait_ready()
        yield pod
    finally:
        assert pod.stop() == 0


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)
