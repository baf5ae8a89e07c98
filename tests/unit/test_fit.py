"""Will it fit? pat_operator.fit's estimate by hand for Llama-3.1-8B, its parameter counts against real weights, the
check's messages and fixes, `pat plan` / `pat validate` on a job that does not fit and the same job that does, and
the trainer's start-up check."""

import json
from pathlib import Path

import pytest
import yaml

from pat_operator import fit
from pat_operator.api import parse_job
from pat_workers.cli import main as pat
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.costs import LONG_CONTEXT
from pat_workers.engine.tiny import random_weights

ROOT = Path(__file__).parents[2]
LLAMA = fit.SHAPES["llama-3.1-8b"]
GIB = 1 << 30


def job(name: str = "llama-3.1-8b.yaml", **edits) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    for path, value in edits.items():
        *parents, leaf = path.split(".")
        node = doc["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return doc


def spec(**edits):
    return parse_job(job(**edits)).spec


def test_llama_3_1_8b_by_hand():
    h, kv, inter, vocab = 4096, 8 * 128, 14336, 128256
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; two norms
    assert LLAMA.params == 32 * layer + 2 * vocab * h + h == 8_030_261_248  # untied lm_head, final norm
    assert LLAMA.kv_bytes_per_token(2) == 2 * 32 * kv * 2 == 128 << 10
    # Per token and layer in bf16: two norms (fp32 copy + output), q/out/o_proj input (3 x 32 heads) and k, v
    # (2 x 8 heads) of 128 dims, a fp32 log-sum-exp per head, the MLP's four products, the block's input.
    assert fit.layer_activation_bytes(LLAMA, 2) == 2 * 6 * h + 2 * 128 * (3 * 32 + 2 * 8) + 4 * 32 + 4 * 2 * inter \
        + 2 * h == 200_832


def test_trainer_state_bytes_per_gpu_with_1_and_8_gpus():
    p = 8_030_261_248
    for gpus in (1, 8):
        terms = dict(fit.trainer_memory(spec(**{"trainer.gpusPerPod": gpus}), LLAMA).terms)
        assert terms[f"parameters (fp32, 1/{gpus})"] == terms[f"gradients (fp32, 1/{gpus})"] == 4 * p / gpus
        assert terms[f"AdamW moments (fp32, 1/{gpus})"] == 8 * p / gpus
        assert terms[f"reference policy (fp32, 1/{gpus})"] == 4 * p / gpus  # klCoef 0.001
        # bf16 all-gathers of two blocks and the root (embedding, final norm, lm_head), whatever the sharding.
        assert terms["unsharded: 2 blocks + root (bf16)"] == 2 * (2 * 218_112_000 + 2 * 128256 * 4096 + 4096)
        # Checkpointed: every block's input (16384 x 4096 bf16), one block's whole set, the final norm and rows.
        assert terms["activations (16384 tokens, checkpointed)"] == 16384 * (32 * 2 * 4096 + 200_832 + 8 * 4096)
        assert terms["loss: logits of 1024 tokens (fp32 x 3)"] == 12 * 1024 * 128256
    assert fit.trainer_memory(spec(), LLAMA).total / GIB == pytest.approx(30.5, abs=0.05)
    no_reference = fit.trainer_memory(spec(**{"algorithm.klCoef": 0.0}), LLAMA)
    assert not any(label.startswith("reference") for label, _ in no_reference.terms)


def test_cpu_offload_moves_the_sharded_states_to_the_host():
    on_gpu, offloaded = (fit.trainer_memory(spec(**{"trainer.cpuOffload": o}), LLAMA) for o in (False, True))
    assert offloaded.host == on_gpu.terms[:4] and offloaded.terms == on_gpu.terms[4:]
    assert offloaded.total == pytest.approx(on_gpu.total - 20 * 8_030_261_248 / 8)


def test_generator_bytes_per_gpu():
    m = fit.generator_memory(spec(), LLAMA)
    kv = 16 * 9216 * (128 << 10)
    assert m.terms == (("weights (bfloat16, the whole model)", 2 * 8_030_261_248), ("KV cache (16 x 9216 tokens)", kv),
                       ("regroup: the new layout's KV cache", kv))
    # Without regroups the profiling pass's caches count instead: 16 x 8 sequences of 513 tokens at TP1, then
    # at TP2 (half the heads) before the first is freed.
    fixed = fit.generator_memory(spec(**{"generator.adaptiveTP.enabled": False}), LLAMA)
    assert fixed.terms[2] == ("profiling caches at start", 16 * 8 * 513 * (128 << 10) * 1.5)
    assert fit.PROFILE_POSITIONS == LONG_CONTEXT + 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("preset", ["test", "demo"])
def test_parameter_counts_are_the_engines_weights(family, preset):
    """Qwen2's q/k/v biases and Qwen3's q/k norms (and decoupled head_dim) included, as the engine builds them."""
    shape = fit.tiny_shape(preset, family)
    weights = random_weights(fit.hf_config(family, **fit.PRESETS[preset]), seed=0)
    assert shape.params == sum(w.numel() for w in weights.values())
    assert shape.params != fit.tiny_shape(preset, "llama").params or family == "llama"  # the families differ


def test_the_engine_reads_the_same_shape():
    cfg = dict(fit.hf_config("llama", **fit.PRESETS["test"]), attention_bias=True, mlp_bias=True)
    engine, shape = ModelConfig.from_hf(cfg), fit.ModelShape.from_hf(cfg, "x")
    assert (engine.qkv_bias, engine.o_bias, engine.mlp_bias) == (shape.qkv_bias, shape.o_bias, shape.mlp_bias) \
        == (True, True, True)
    assert shape.layer_params - fit.tiny_shape("test").layer_params == 8 * 8 * 2 + 64 + 2 * 160 + 64


@pytest.mark.parametrize("name", ["H100-SXM", "h100-sxm", "NVIDIA-H100-80GB-HBM3"])
def test_gpus_by_name_or_node_label(name):
    assert fit.gpu(name) is fit.GPUS["H100-SXM"] and fit.GPUS["H100-SXM"].memory_bytes == 81559 << 20


def test_an_unknown_gpu_is_named():
    with pytest.raises(fit.FitError, match="GPU 'NVIDIA-B200' is unknown; use one of A100-40GB"):
        fit.gpu("NVIDIA-B200")
    s = spec(**{"trainer.nodeSelector": {fit.GPU_PRODUCT_LABEL: "NVIDIA-B200"}})
    assert fit.role_gpus(s, lenient=True)["trainer"] is None  # the operator does not refuse what it cannot know


def test_a_job_that_does_not_fit_names_the_field_and_the_least_change_that_fits():
    s = spec(**{"trainer.gpusPerPod": 1})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message == ("spec.trainer.gpusPerPod: a trainer rank of llama-3.1-8b needs 161.4 GiB per GPU with "
                       "gpusPerPod=1, more than the 71.7 GiB usable of an H100-SXM's 79.6 GiB (10% kept free); with "
                       "gpusPerPod=4: 49.2 GiB; also fits: trainer.replicas=3 (61.7 GiB), trainer.cpuOffload=true "
                       "(11.8 GiB)")
    assert fit.problems(spec(), LLAMA, fit.role_gpus(spec())) == []  # negative control: 8 GPUs


def test_the_cheapest_fix_comes_first_and_is_the_least_that_fits():
    """Activations: a smaller micro-batch fits before checkpointing, more GPUs or offloading is suggested."""
    s = spec(**{"trainer.activationCheckpointing": False, "generator.maxSeq": 4096, "algorithm.maxResponseTokens": 2048,
                "reward.overlongBuffer": 512})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message.startswith("spec.algorithm.maxTokensPerMicroBatch: ")
    assert "with maxTokensPerMicroBatch=16384, " in message and "with maxTokensPerMicroBatch=4096: " in message
    assert "also fits: trainer.activationCheckpointing=true" in message
    fixed = s.model_copy(update={"algorithm": s.algorithm.model_copy(update={"max_tokens_per_micro_batch": 4096})})
    doubled = s.model_copy(update={"algorithm": s.algorithm.model_copy(update={"max_tokens_per_micro_batch": 8192})})
    assert fit.problems(fixed, LLAMA, fit.role_gpus(s)) == [] and fit.problems(doubled, LLAMA, fit.role_gpus(s))


def test_a_generator_that_does_not_fit_gets_a_smaller_batch():
    s = spec(**{"generator.maxBatch": 64})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message.startswith("spec.generator.maxBatch: a generator rank of llama-3.1-8b needs 159.0 GiB per GPU with "
                              "maxBatch=64") and "with maxBatch=25: 71.2 GiB" in message


def test_no_single_change_fits():
    """An 8 GiB GPU: the bf16 working set alone (2 blocks + root, one micro-batch of maxSeq, a logits chunk) is
    over its 7.2 GiB usable, whatever the sharding or offloading."""
    small = fit.GPU("8GB", 8 * GIB, 1e12, 1e14, 1e11, 1e-5, "a test")
    (message,) = fit.problems(spec(), LLAMA, {"trainer": small})
    assert message.startswith("spec.trainer.nodeSelector: a trainer rank of llama-3.1-8b needs 30.5 GiB per GPU, "
                              "more than the 7.2 GiB usable of an 8GB's 8.0 GiB (10% kept free), and no single "
                              "change of algorithm.maxTokensPerMicroBatch, ") and message.endswith(
        "trainer.cpuOffload fits; use GPUs with more memory")


def test_the_start_up_check_on_cpu():
    """The trainer's check at start: MemAvailable over the host's ranks (here the tiny demo's 684 MiB per rank)."""
    s = parse_job(yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())).spec
    shape = fit.tiny_shape("demo")
    need = fit.trainer_memory(s, shape).total
    assert fit.check_free(s, shape, free_bytes=need / 0.9 + 1) is None
    message = fit.check_free(s, shape, free_bytes=need, device="cpu")
    assert message.startswith(f"spec.algorithm.maxTokensPerMicroBatch: a trainer rank of tiny llama demo needs "
                              f"{fit.gib(need)} per rank with maxTokensPerMicroBatch=16384, more than the "
                              f"{fit.gib(need * 0.9)} usable of the {fit.gib(need)} free on cpu (10% kept free)")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = pat(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pat_plan_and_validate_refuse_a_job_that_does_not_fit_and_accept_it_on_more_gpus(tmp_path, capsys):
    """A tiny preset of Llama-3.1-8B's shape: pat validate knows the shape too, and the node label names the GPU."""
    doc = job("local.yaml")
    h100 = {fit.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}
    doc["spec"]["model"] = {"tiny": {"preset": "llama-8b"}, "dtype": "bfloat16"}
    doc["spec"]["generator"] = {"gpusPerPod": 2, "maxSeq": 128, "nodeSelector": h100}
    for gpus, code in ((1, 2), (8, 0)):
        doc["spec"]["trainer"] = {"gpusPerPod": gpus, "nodeSelector": h100}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
        planned, out, err = run(capsys, "plan", str(tmp_path / "job.yaml"))
        validated, _, verr = run(capsys, "validate", str(tmp_path / "job.yaml"))
        assert (planned, validated) == (code, code), err + verr
        assert out.splitlines()[0] == "arithmetic-grpo: tiny llama llama-8b, 8,030,261,248 parameters"
        if code:
            assert "job.yaml does not fit:\n  spec.trainer.gpusPerPod: a trainer rank of tiny llama llama-8b" in err
            assert err.split("\n", 1)[1] == verr.split("\n", 1)[1]  # the same message
            assert "DOES NOT FIT" in out
        else:
            assert err == verr == "" and out.count("fits") == 2


def test_pat_plan_names_what_it_lacks(capsys):
    example = str(ROOT / "examples" / "llama-3.1-8b.yaml")
    code, _, err = run(capsys, "plan", example)
    assert code == 2 and err == ("pat plan: model.path='/models/Llama-3.1-8B-Instruct' has no config.json here; pass "
                                 "--model-config /models/Llama-3.1-8B-Instruct/config.json, or --model with one of "
                                 "llama-3.1-8b, qwen3-14b\n")
    code, _, err = run(capsys, "plan", example, "--model", "llama-3.1-8b", "--gpu", "TPU")
    assert code == 2 and err.startswith("pat plan: GPU 'TPU' is unknown") and err.count("\n") == 1
    code, _, err = run(capsys, "plan", example, "--model-config", str(ROOT / "missing.json"))
    assert code == 2 and "missing.json" in err and err.count("\n") == 1


def test_pat_plan_reads_a_config_json_and_the_gpu_flag(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(fit.hf_config("qwen3", **fit.PRESETS["bench"])))
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "llama-3.1-8b.yaml"), "--model-config",
                       str(tmp_path / "config.json"), "--gpu", "L40S")
    assert code == 0 and f"{fit.tiny_shape('bench', 'qwen3').params:,} parameters" in out
    assert out.count("on an L40S: 40.5 GiB usable of 45.0 GiB (10% kept free)") == 2
