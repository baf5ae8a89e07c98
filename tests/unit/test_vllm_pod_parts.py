"""The vLLM pod's pure parts: the engines' command lines and environments, the streamed completion and its
resumption after a move, how requests are dealt to engines, the merged metrics, the failure message taken from
vLLM's output, and the version check."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pat_operator.podapi import RolloutRequest, Sampling
from pat_workers.generator.vllm import (Sequence, VllmConfig, _Families, absorb, completion, deal, engine_command,
                                        engine_env, last_error, relabel, request_body, version_problem)


def test_cpu_engines_bind_their_ranks_to_disjoint_cores_and_gpu_engines_get_their_devices():
    two_tp1 = VllmConfig("/m", ranks=2, tp=1)
    assert [engine_env(two_tp1, (i,), "k", {}, [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)] == ["0", "1"]
    tp2 = VllmConfig("/m", ranks=2, tp=2)
    assert engine_env(tp2, (0, 1), "k", {}, [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    wide = VllmConfig("/m", ranks=4, tp=2)
    cpus = list(range(8, 16))
    assert [engine_env(wide, g, "k", {}, cpus)["VLLM_CPU_OMP_THREADS_BIND"] for g in wide.slots] == ["8-9|10-11",
                                                                                                  "12-13|14-15"]
    # Fewer cores than ranks: shared round robin, never an empty binding.
    assert [engine_env(wide, g, "k", {}, [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] for g in wide.slots] == ["0|1", "0|1"]
    env = engine_env(two_tp1, (0,), "key", {"VLLM_CPU_KVCACHE_SPACE": "4", "HOME": "/h"}, [0, 1])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["HOME"] == "/h"  # the pod's own settings win
    assert env["VLLM_API_KEY"] == "key" and env["VLLM_SERVER_DEV_MODE"] == "1"
    gpus = VllmConfig("/m", ranks=4, tp=2, device="cuda")
    assert [engine_env(gpus, g, "k", {}, [0])["CUDA_VISIBLE_DEVICES"] for g in gpus.slots] == ["0,1", "2,3"]
    assert engine_env(gpus, (2, 3), "k", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, [0])["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_the_engine_command_listens_on_its_socket_and_carries_the_users_flags_last():
    config = VllmConfig("/models/m", ranks=2, tp=2, max_model_len=1024, dtype="bfloat16", device="cuda",
                        gpu_memory_utilization=0.8, enforce_eager=True, extra_args=("--max-num-seqs=64",),
                        python="/venv/bin/python")
    argv = engine_command(config, "/run/e0.sock", 2)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert flags["--uds"] == "/run/e0.sock" and flags["--tensor-parallel-size"] == "2"
    assert flags["--gpu-memory-utilization"] == "0.8" and flags["--max-model-len"] == "1024"
    assert "--port" not in argv and "--host" not in argv and "--api-key" not in argv  # no TCP, key in the env
    assert argv[-2:] == ["--enforce-eager", "--max-num-seqs=64"]


def test_a_rollout_request_streams_into_a_completion_and_resumes_after_a_move_from_its_tokens():
    request = RolloutRequest(id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=4, temperature=0.7,
                             top_k=5, seed=9, stop_token_ids=[7]))
    seq = Sequence(request)
    body = request_body(seq)
    assert body["prompt"] == [1, 2, 3] and body["top_k"] == 5 and body["seed"] == 9 and body["max_tokens"] == 4
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["stop_token_ids"] == [7] and body["stream"]
    assert "top_k" not in request_body(Sequence(RolloutRequest(id="r", prompt="hi")))  # 0: no top-k
    absorb(seq, {"choices": [{"text": "a", "token_ids": [4], "prompt_token_ids": [1, 2, 3], "finish_reason": None,
                              "logprobs": {"token_logprobs": [-0.5]}}]})
    # Moved after one token: the prompt and that token are the prompt, 3 tokens remain, the seed is derived.
    moved = request_body(seq)
    assert (moved["prompt"], moved["max_tokens"]) == ([1, 2, 3, 4], 3)
    assert moved["seed"] not in (9, None) and moved["seed"] == request_body(seq)["seed"]  # reproducible
    absorb(seq, {"choices": [{"text": "b", "token_ids": [7], "finish_reason": "stop",
                              "logprobs": {"token_logprobs": [-1.5]}}]})
    c = completion(seq, 3)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.policy_version, c.text) == ([4, 7], [-0.5, -1.5], "stop",
                                                                                     3, None)
    seq.finish_reason = "length"
    text = Sequence(RolloutRequest(id="t", prompt="hi"), text="ab", finish_reason="length")
    assert completion(text, 0).text == "ab" and completion(text, 0).finish_reason == "length"
    with pytest.raises(ValueError, match="before the prompt's token ids"):  # the pod fails, naming it
        absorb(Sequence(request), {"choices": [{"text": "a", "token_ids": [4], "finish_reason": None}]})
    other = Sequence(RolloutRequest(id="u", prompt_token_ids=[1], sampling=Sampling(seed=10)), prompt_ids=[1],
                     tokens=[5])
    assert request_body(other)["seed"] != moved["seed"]  # another request's seed resumes elsewhere


ENGINE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} %d
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="policy"} %d
"""


def test_the_engines_series_merge_into_one_exposition_labelled_by_engine():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(relabel([ENGINE % (3, 100), ENGINE % (5, 40), ""])))
    text = generate_latest(registry).decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, not one per engine
    samples = {(s.name, s.labels["engine"]): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples == {("vllm:num_requests_running", "0"): 3, ("vllm:num_requests_running", "1"): 5,
                       ("vllm:generation_tokens_total", "0"): 100, ("vllm:generation_tokens_total", "1"): 40}


def test_the_failure_message_is_vllms_last_error_with_its_reason():
    output = ["INFO starting\n", "Traceback (most recent call last):\n", "  File x\n",
              "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n",
              "  Value error, Model architectures ['X'] are not supported for now. " + "y" * 1000 + "\n",
              "    For further information visit https://errors.pydantic.dev\n", "\n"]
    message = last_error(output)
    assert message.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
                              "Value error, Model architectures ['X'] are not supported")
    assert "further information" not in message and len(message) < 700
    assert last_error(["a\n", "killed\n"]) == "killed" and last_error([]) == "(no output)"


def test_a_vllm_older_than_the_worker_extension_path_or_none_at_all_is_refused_naming_the_version():
    assert version_problem("0.32.0", "/venv/bin/python") is None
    assert version_problem("0.33.1+cpu", "/venv/bin/python") is None
    assert version_problem("1.0.0", "/venv/bin/python") is None
    old = version_problem("0.8.5.post1", "/venv/bin/python")
    assert "vLLM 0.8.5.post1 at /venv/bin/python is older than 0.32" in old and "--worker-extension-cls" in old
    assert "no vLLM installed for /usr/bin/python3" in version_problem(None, "/usr/bin/python3")


def test_a_prompts_requests_go_to_one_engine_and_prompts_balance_the_engines():
    def request(i: int, prompt: list[int] | str) -> RolloutRequest:
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        return RolloutRequest(id=f"r{i}", **{key: prompt}, sampling=Sampling(max_tokens=4, seed=i))

    grpo = [request(4 * p + s, [p + 1, 7, 7]) for p in range(3) for s in range(4)]  # 3 prompts x G=4
    assert deal(grpo, 2) == [0] * 4 + [1] * 4 + [0] * 4
    assert deal(grpo, 3) == [0] * 4 + [1] * 4 + [2] * 4
    interleaved = [grpo[4 * p + s] for s in range(4) for p in range(3)]  # samples before prompts
    assert deal(interleaved, 2) == [0, 1, 0] * 4
    assert deal([request(0, [1]), request(1, [2]), request(2, [2]), request(3, [2])], 2) == [1, 0, 0, 0]
    assert deal([request(0, "a b"), request(1, "a b"), request(2, [5]), request(3, "c")], 2) == [0, 0, 1, 1]
