"""A vLLM generator pod against its contract: the pod API the trainer and the operator use (token ids and the
policy's log-probabilities out, policy versions, weights over the network), vLLM's own API behind the job's
token, its development endpoints out of reach, its metrics, and vLLM's own error when it cannot load a model."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from pat_workers.engine.loader import load_weights
from pat_workers.trainer.policy import Policy
from pat_workers.weightsync import WeightSender
from tests.generator.conftest import Reference, mismatched, rollout

from .conftest import start_pod

TOL = 2e-3  # vLLM's CPU kernels against the trainer's maths, float32: measured differences are ~1e-5
FIXED = [256, 17, 93, 4, 250, 61, 7, 130, 44, 201, 9, 88]  # tokens whose log-probabilities are compared


def policy_logprobs(model_dir, tokens: list[int], weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under the trainer's policy (the weights given, or the model's)."""
    policy = Policy(model_dir)
    if weights is not None:
        policy.load_state_dict(weights)
    with torch.no_grad():
        out = policy(torch.tensor(tokens), torch.tensor([1]), torch.tensor([len(tokens) - 1]))
    return out.logprobs[0]


def vllm_logprobs(pod, tokens: list[int]) -> torch.Tensor:
    """The same, as vLLM computes them (prompt_logprobs through the pod's OpenAI proxy)."""
    reply = pod.ok("POST", "/v1/completions", {"model": "policy", "prompt": tokens, "max_tokens": 1,
                                               "temperature": 0, "prompt_logprobs": 0})
    entries = reply["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(t)]["logprob"] for entry, t in zip(entries, tokens[1:])])


def test_rollouts_carry_token_ids_and_the_policys_logprobs(vllm_pod, vllm_model):
    requests = [rollout(f"r{i}", [256] + [(31 * i + 7 * j) % 250 for j in range(3 + i)], 5 + 3 * i)
                for i in range(6)] + [rollout("text", "Q: 2 + 3 =", 8)]
    completions = vllm_pod.generate("greedy", requests)
    version = vllm_pod.state()["policy_version"]
    for request, c in zip(requests, completions):
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == request["sampling"]["max_tokens"]
        assert c["policy_version"] == version
        if "prompt_token_ids" not in request:
            assert c["text"] is not None
            continue
        prompt = request["prompt_token_ids"]
        expected = policy_logprobs(vllm_model, prompt + c["token_ids"])[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(c["logprobs"]), expected, atol=TOL), (c, expected)


def test_weights_go_into_every_vllm_worker_through_the_group_and_never_through_a_file(vllm_pod, vllm_model):
    """Each of the pod's 2 vLLM workers (one per engine of TP=1) joins the trainer's group as a member and loads
    the buckets into its model as they arrive: afterwards both engines generate exactly what the trainer's new
    weights give (greedy tokens and log-probabilities, against this project's engine as the reference), which
    before the update they did not (the negative control), and the pod's scratch directory holds no file."""
    version = vllm_pod.state()["policy_version"]
    old = load_weights(vllm_model, torch.float32)
    g = torch.Generator().manual_seed(5)
    new = {name: w + 0.5 * w.std() * torch.randn(w.shape, generator=g) for name, w in old.items()}
    before = vllm_logprobs(vllm_pod, FIXED)
    assert torch.allclose(before, policy_logprobs(vllm_model, FIXED), atol=TOL)
    # One request per engine (the pod deals them round robin), greedy.
    requests = [rollout(f"engine-{i}", FIXED[:5], 8) for i in range(2)]
    reference = Reference(vllm_model, new)(requests)
    assert mismatched(vllm_pod.generate("before-sync", requests, version), reference, TOL) == ["engine-0", "engine-1"]

    world = 1 + vllm_pod.state()["weight_receivers"]
    assert world == 3
    sender = WeightSender("127.0.0.1:0", world=world)
    try:
        vllm_pod.ok("POST", "/v1/weights", {"version": version + 1, "address": sender.address, "world": world,
                                            "rank_offset": 1}, 202)
        sender.send({n: w.shape for n, w in new.items()}, iter(sorted(new.items())), version + 1)
        for _ in range(600):
            if vllm_pod.state()["policy_version"] == version + 1:
                break
            time.sleep(0.1)
    finally:
        sender.close()
    assert vllm_pod.state()["policy_version"] == version + 1
    assert not mismatched(vllm_pod.generate("after-sync", requests, version + 1), reference, TOL)
    after = vllm_logprobs(vllm_pod, FIXED)
    assert torch.allclose(after, policy_logprobs(vllm_model, FIXED, new), atol=TOL), (after, before)
    [scratch] = vllm_pod.tmp.glob("pat-vllm-*")
    files = [p for p in scratch.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not files, files
    # Rollouts carry the version that produced them; a batch for the old version is refused.
    [c] = vllm_pod.generate("version", [rollout("x", FIXED[:4], 3)], version + 1)
    assert c["policy_version"] == version + 1
    status, reply = vllm_pod.call("POST", "/v1/rollouts", {"batch_id": "stale", "policy_version": version,
                                                           "requests": [rollout("y", FIXED[:4], 3)]})
    assert status == 409 and "policy_version" in reply["error"]


def test_vllms_api_needs_the_token_and_its_dev_endpoints_are_out_of_reach(vllm_pod):
    for method, path in (("POST", "/collective_rpc"), ("POST", "/sleep"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models"), ("POST", "/v1/load_lora_adapter")):
        status, reply = vllm_pod.call(method, path, {}, token=None)
        assert status == 401, (path, status, reply)
    # With the token: the OpenAI API answers, the development endpoints are not there at all.
    assert vllm_pod.ok("GET", "/v1/models")["data"][0]["id"] == "policy"
    for path in ("/collective_rpc", "/sleep", "/reset_prefix_cache", "/pause"):
        status, _ = vllm_pod.call("POST", path, {})
        assert status == 404, path
    status, reply = vllm_pod.call("POST", "/v1/regroup", {"epoch": 1, "layout": [2]})
    assert status == 409 and "vLLM" in reply["error"]
    # The vLLM servers listen on Unix sockets in a directory only the pod's user enters, on no TCP port.
    servers = [int(p) for p in open(f"/proc/{vllm_pod.proc.pid}/task/{vllm_pod.proc.pid}/children").read().split()]
    assert len(servers) == 2
    listening = _listening_inodes()
    for pid in servers:
        sockets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert not {f"socket:[{inode}]" for inode in listening} & sockets, f"vLLM server {pid} listens on TCP"
        cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
        socket_dir = os.path.dirname(cmdline[cmdline.index("--uds") + 1])
        assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
        assert "test-job-token" not in " ".join(cmdline)


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    return inodes


def test_metrics_carry_vllms_own_series_per_engine(vllm_pod):
    vllm_pod.generate("for-metrics", [rollout(f"m{i}", [256, i + 1, 2], 6) for i in range(4)])
    deadline = time.monotonic() + 10  # the pod reads its engines' metrics every 0.5 s
    while not all(vllm_pod.metrics().get(("vllm:generation_tokens_total", (("engine", e), ("model_name", "policy"))))
                  for e in ("0", "1")) and time.monotonic() < deadline:
        time.sleep(0.2)
    metrics = vllm_pod.metrics()
    for engine in ("0", "1"):
        labels = (("engine", engine), ("model_name", "policy"))
        assert ("vllm:num_requests_running", labels) in metrics
        assert ("vllm:num_requests_waiting", labels) in metrics
        assert ("vllm:kv_cache_usage_perc", labels) in metrics
        assert metrics[("vllm:generation_tokens_total", labels)] > 0  # both engines served the round robin
    assert metrics[("pat_generator_policy_version", ())] == vllm_pod.state()["policy_version"]


def prefix_cache(pod, until_queries: float = 0.0) -> dict[str, dict[str, float]]:
    """Each engine's vLLM prefix-cache counters, {"queries": {engine: tokens}, "hits": ...}, once their queries add
    up to at least `until_queries` (the pod reads its engines' metrics every 0.5 s)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = pod.metrics()
        counts = {kind: {labels[0][1]: value for (name, labels), value in metrics.items()
                         if name == f"vllm:prefix_cache_{kind}_total"} for kind in ("queries", "hits")}
        if sum(counts["queries"].values()) >= until_queries or time.monotonic() > deadline:
            return counts


def test_a_prompts_samples_go_to_one_engine_whose_prefix_cache_computes_the_prompt_once(vllm_pod):
    """GRPO's G samples of a prompt (each its own seed) all go to one engine: its prefix cache serves the prompt's
    full 128-token block (vLLM's CPU block) to G - 1 of them. The negative control: G prompts that differ in their
    first token hit nothing."""
    block, g = 128, 4
    prompt = [(7 * j) % 250 + 1 for j in range(block + 2)]
    for name, prompts, hits in (("same", [prompt] * g, (g - 1) * block),
                                ("differ", [[200 + i] + prompt[1:] for i in range(g)], 0)):
        before = prefix_cache(vllm_pod)
        queried = sum(before["queries"].values()) + g * len(prompt)
        vllm_pod.generate(f"prefix-{name}", [rollout(f"{name}-{i}", p, 4, temperature=1.0, seed=i)
                                             for i, p in enumerate(prompts)])
        after = prefix_cache(vllm_pod, until_queries=queried)
        gained = {e: after["hits"][e] - before["hits"].get(e, 0) for e in after["hits"]}
        assert sum(gained.values()) == hits, (name, gained)
        if hits:
            assert sorted(gained.values()) == [0, hits], gained  # on one engine


def test_a_model_vllm_cannot_load_fails_the_pod_with_vllms_message(vllm_model, vllm_env, tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    for f in vllm_model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    pod = start_pod("bad-model", bad, tmp_path, {"PAT_JOB_TOKEN": "t", **vllm_env}, ranks=1)
    try:
        assert pod.proc.wait(timeout=240) == 1
    finally:
        pod.stop()
    last = pod.log.read_text().strip().splitlines()[-1]
    assert last.startswith("pat generator: vLLM engine 0 exited with code 1:"), last
    assert "NoSuchModelForCausalLM" in last, last


@pytest.mark.slow
def test_an_interpreter_without_vllm_fails_the_pod_at_start_naming_the_flag(vllm_model):
    """This interpreter has no vLLM: the pod exits 2 before starting anything, saying where vLLM must be."""
    done = subprocess.run([sys.executable, "-m", "pat_workers.generator", "--engine", "vllm", "--model",
                           str(vllm_model), "--ranks", "1", "--port", "0", "--vllm-python", sys.executable],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PAT_JOB_TOKEN": "t"})
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines()[-1] == (
        f"pat generator: no vLLM installed for {sys.executable} (set --vllm-python or PAT_VLLM_PYTHON to the "
        f"interpreter that has it)"), done.stderr
