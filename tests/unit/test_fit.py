"""Will it fit? pat_operator.fit's estimate by hand for Llama-3.1-8B, its parameter counts against real weights, the
check's messages and fixes, `pat plan` / `pat validate` on a job that does not fit and the same job that does, and
the trainer's start-up check."""

import json
from pathlib import Path

import pytest
import yaml

from pat_operator import fit
from pat_operator.api import Generator, parse_job
from pat_workers.cli import main as pat
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.engine import PREFILL_TOKENS_PER_FORWARD
from pat_workers.engine.rank import EngineOptions
from pat_workers import weightsync
from pat_workers.engine.tiny import random_weights

ROOT = Path(__file__).parents[2]
LLAMA = fit.SHAPES["llama-3.1-8b"]
GIB, MIB = 1 << 30, 1 << 20
H100 = fit.GPUS["H100-SXM"].memory_bytes


def job(name: str = "llama-3.1-8b.yaml", **edits) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    for path, value in edits.items():
        *parents, leaf = path.split(".")
        node = doc["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return doc


# The Llama example as it was before placement: 2 generator pods and a trainer pod, of 8 H100s each.
SEPARATE = {"placement": "separate", "generator.replicas": 2, "trainer.replicas": 1, "trainer.gpusPerPod": 8,
            "trainer.nodeSelector": {fit.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}


def spec(**edits):
    """The Llama example separate (SEPARATE), with these edits."""
    return parse_job(job(**{**SEPARATE, **edits})).spec


def colocated(**edits):
    """The Llama example as it is: colocated, 3 pods of 8 H100s."""
    return parse_job(job(**edits)).spec


def small_batch(**edits):
    """The example with 16 sequences per replica: a KV cache that maxBatch caps, not memory."""
    return spec(**{"generator.maxBatch": 16, **edits})


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
    """The example on an H100: the weights; working memory, the fp32 logits of maxBatch x 8 rows (TP=8) x 3 and a
    forward's activations over maxSeq tokens (profiling runs in the cache); then the KV cache at maxBatch's cap,
    16 x 9216 tokens in blocks of 16 tokens x 128 KiB, with a regroup's 8% beside it."""
    weights, logits = 2 * 8_030_261_248, 3 * 4 * 16 * 8 * 128256
    working = 9216 * 200_832 + logits
    m = fit.generator_memory(small_batch(), LLAMA, H100)
    assert m.terms == (("weights (bfloat16, the whole model)", weights),
                       ("working memory (a forward of 9216 tokens)", working),
                       ("KV cache (16 x 9216 tokens)", 16 * 576 * 2 * MIB),
                       ("regroup: KV in flight (8% of the cache)", 0.08 * 18 * GIB))
    # memoryUtilization (0.9) of the H100 less the weights and the working memory: room for 45 sequences.
    room = int((0.9 * H100 - weights - working) / (2 * MIB * 1.08))
    assert fit.kv_blocks(small_batch(), LLAMA, H100) == (16 * 576, room) and room // 576 == 45
    # At 0.4 the cache takes the rest: 12 sequences of maxSeq, fewer than maxBatch.
    low = small_batch(**{"generator.memoryUtilization": 0.4})
    blocks = int((0.4 * H100 - weights - working) / (2 * MIB * 1.08))
    assert fit.kv_blocks(low, LLAMA, H100) == (blocks, blocks) and blocks // 576 == 12
    assert fit.generator_memory(low, LLAMA, H100).terms[2] == ("KV cache (12 x 9216 tokens)", blocks * 2 * MIB)
    assert fit.generator_memory(low, LLAMA, H100).total <= 0.4 * H100
    # One rank: no regroup (nothing in flight), 16 rows.
    alone = fit.generator_memory(small_batch(**{"generator.gpusPerPod": 1}), LLAMA, H100)
    assert alone.terms[1:] == (("working memory (a forward of 9216 tokens)", 9216 * 200_832 + logits / 8),
                               ("KV cache (16 x 9216 tokens)", 18 * GIB))
    # No GPU known: the cap.
    assert fit.generator_memory(small_batch(), LLAMA).terms[2] == ("KV cache (at most 16 x 9216 tokens)", 18 * GIB)


def test_the_estimate_and_the_spec_follow_the_engine():
    options = EngineOptions()
    assert (fit.PREFILL_TOKENS, fit.BLOCK_SIZE) == (PREFILL_TOKENS_PER_FORWARD, options.block_size)
    assert Generator.model_fields["memory_utilization"].default == options.memory_utilization


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


def test_a_generator_without_room_for_one_sequence_names_memory_utilization():
    """The least an engine rank needs: its weights, working memory and the KV cache of one sequence of maxSeq."""
    s = small_batch(**{"generator.memoryUtilization": 0.2})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message == ("spec.generator.memoryUtilization: a generator rank of llama-3.1-8b needs 18.1 GiB per GPU "
                       "(weights, working memory and the KV cache of one sequence of maxSeq=9216 tokens) with "
                       "memoryUtilization=0.2, more than the 15.9 GiB it may use of an H100-SXM's 79.6 GiB; with "
                       "memoryUtilization=0.23: 18.1 GiB of 18.3 GiB")
    assert fit.problems(small_batch(**{"generator.memoryUtilization": 0.23}), LLAMA, fit.role_gpus(s)) == []
    # float32 weights on one GPU: bfloat16 fits too, and a shorter maxSeq where the spec allows one.
    s = small_batch(**{"generator.memoryUtilization": 0.42, "generator.gpusPerPod": 1, "model.dtype": "float32",
                "algorithm.maxResponseTokens": 1024, "reward.overlongBuffer": 512})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message.endswith("with memoryUtilization=0.45: 35.4 GiB of 35.8 GiB; also fits: model.dtype=bfloat16 "
                            "(17.8 GiB), generator.maxSeq=5888 (33.4 GiB)")


def test_max_seq_beyond_the_models_positions():
    s = spec(**{"generator.maxSeq": 131073, "algorithm.maxTokensPerMicroBatch": 131073})
    assert fit.problems(s, LLAMA, {}) == [("spec.generator.maxSeq: generator.maxSeq=131073 is beyond the model's "
                                           "max_position_embeddings=131072; lower generator.maxSeq to 131072 or less")]
    assert fit.problems(spec(), fit.SHAPES["qwen3-14b"], {}) == []  # 9216 of 40960
    assert fit.ModelShape.from_hf({**fit.hf_config("llama", **fit.PRESETS["test"]), "max_position_embeddings": None},
                                  "x").max_positions is None  # not said: not checked


def test_a_fixed_tp_size_the_models_heads_do_not_split_over_names_the_field_and_the_sizes_they_allow(tmp_path,
                                                                                                      capsys):
    """The test preset has 4 KV heads: a pod of 8 ranks may run fixed TP=1, 2 or 4, not 8; pat validate says so."""
    doc = job("local.yaml", **{"generator.ranksPerPod": 8, "generator.tensorParallelSize": 8,
                               "generator.adaptiveTP": {"enabled": False}})
    doc["spec"]["model"]["tiny"]["preset"] = "test"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    code, out, err = run(capsys, "validate", str(tmp_path / "job.yaml"))
    assert (code, out) == (2, "") and err == (
        f"{tmp_path / 'job.yaml'} does not fit:\n  spec.generator.tensorParallelSize: tiny llama test splits over TP "
        f"sizes that divide its 4 KV heads and 160-wide MLP (and the 8 ranks per pod): generator.tensorParallelSize=8 "
        f"is not one of them; use one of [1, 2, 4]\n")
    doc["spec"]["generator"]["tensorParallelSize"] = 4
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    assert run(capsys, "validate", str(tmp_path / "job.yaml"))[:2] == (0, "RLHFJob arithmetic-grpo: valid\n")
    assert fit.problems(parse_job(doc).spec, fit.tiny_shape("demo-vllm"), {}) == [  # 2 KV heads
        "spec.generator.tensorParallelSize: tiny llama demo-vllm splits over TP sizes that divide its 2 KV heads and "
        "352-wide MLP (and the 8 ranks per pod): generator.tensorParallelSize=4 is not one of them; use one of [1, 2]"]


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
    """The trainer's check at start: MemAvailable over the host's ranks (here the tiny demo's need per rank). Its
    own need with role trainer; by default in a colocated job (local.yaml) the device's, both ranks in both phases."""
    s = parse_job(yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())).spec
    shape = fit.tiny_shape("demo")
    need = fit.trainer_memory(s, shape).total
    assert fit.check_free(s, shape, free_bytes=need / 0.9 + 1, role="trainer") is None
    message = fit.check_free(s, shape, free_bytes=need, role="trainer", device="cpu")
    assert message.startswith(f"spec.algorithm.maxTokensPerMicroBatch: a trainer rank of tiny llama demo needs "
                              f"{fit.gib(need)} per rank with maxTokensPerMicroBatch="
                              f"{s.algorithm.max_tokens_per_micro_batch}, more than the "
                              f"{fit.gib(need * 0.9)} usable of the {fit.gib(need)} free on cpu (10% kept free)")
    assert s.placement == "colocated"
    # Enough for the trainer rank alone, which is what the train phase holds (the engine asleep, its weights released
    # too), not for the engine's weights and KV cache beside the trainer's states.
    generate, train, handover = fit.budgets(s, shape, "colocated", need / 0.9 + 1)
    assert train.fits and handover.fits and not generate.fits
    assert train.need == need
    message = fit.check_free(s, shape, free_bytes=need / 0.9 + 1, device="cpu")
    assert message.startswith("spec.")
    assert (f"a rank of colocated tiny llama demo (a trainer rank and an engine rank) needs {fit.gib(generate.need)} "
            f"to generate (the trainer's states ") in message
    assert "to train" not in message.split("; with ")[0]  # a phase that fits is not named a problem
    assert fit.check_free(s, shape, free_bytes=max(generate.need, train.need) / 0.9 + 1) is None


def run(capsys, *argv) -> tuple[int, str, str]:
    code = pat(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pat_plan_and_validate_refuse_a_job_that_does_not_fit_and_accept_it_on_more_gpus(tmp_path, capsys):
    """A tiny preset of Llama-3.1-8B's shape: pat validate knows the shape too, and the node label names the GPU."""
    doc = job("local.yaml", placement="separate")
    h100 = {fit.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}
    doc["spec"]["model"] = {"tiny": {"preset": "llama-8b"}, "dtype": "bfloat16"}
    doc["spec"]["generator"] = {"gpusPerPod": 2, "maxSeq": doc["spec"]["generator"]["maxSeq"], "nodeSelector": h100}
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


def separate_example(tmp_path: Path) -> Path:
    (tmp_path / "separate.yaml").write_text(yaml.safe_dump(job(**SEPARATE)))
    return tmp_path / "separate.yaml"


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
    config = fit.hf_config("qwen3", **fit.PRESETS["bench"])  # max_position_embeddings 8192: below maxSeq
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", str(separate_example(tmp_path)), "--model-config", str(tmp_path / "config.json"), "--gpu", "L40S"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.endswith("does not fit:\n  spec.generator.maxSeq: generator.maxSeq=9216 is beyond the "
                                      "model's max_position_embeddings=8192; lower generator.maxSeq to 8192 or less\n")
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    code, out, _ = run(capsys, *argv)
    assert code == 0 and f"{fit.tiny_shape('bench', 'qwen3').params:,} parameters" in out
    assert "on an L40S: 40.5 GiB usable of 45.0 GiB (10% kept free)" in out
    assert "on an L40S: 40.5 GiB usable of 45.0 GiB (memoryUtilization=0.9)" in out


def test_pat_plan_says_how_many_sequences_the_kv_cache_holds(capsys, tmp_path):
    example = separate_example(tmp_path)
    code, out, _ = run(capsys, "plan", str(example), "--model", "llama-3.1-8b")
    assert code == 0 and out.splitlines()[-3:] == [
        "  total                                           71.7 GiB  fits",
        ("  KV cache per GPU: 406,048 tokens, 44 concurrent sequences of maxSeq=9216 (all that memoryUtilization "
         "leaves room for; maxBatch=128)"),
        ("colocated on the same 24 GPUs (3 pods x 8) would fit: 39 sequences of maxSeq per GPU's KV cache while "
         "generating; train 18.0 GiB of 71.7 GiB, hand-over 20.2 GiB of 71.7 GiB")]
    capped = tmp_path / "capped.yaml"
    capped.write_text(example.read_text().replace("maxBatch: 128", "maxBatch: 16"))
    code, out, _ = run(capsys, "plan", str(capped), "--model", "llama-3.1-8b")
    assert code == 0 and ("KV cache per GPU: 147,456 tokens, 16 concurrent sequences of maxSeq=9216 (maxBatch; "
                          "memoryUtilization leaves room for 45)\n") in out


def test_pat_plan_on_a_colocated_job_prints_both_phases(capsys):
    """The example as it is: one H100 of the 3 colocated pods, resident (the trainer's states), each phase's working
    set (the engine's weights in generating and the hand-over), each phase against its limit, the KV cache and the
    placement's verdict."""
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "llama-3.1-8b.yaml"), "--model", "llama-3.1-8b")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1] == ("colocated: 3 pods x 8 GPUs, each GPU a trainer rank (FSDP2 over 24, micro-batches of 16384 "
                        "tokens) and an engine rank")
    assert "    AdamW moments (fp32, 1/24)                           2.5 GiB" in lines
    assert "    engine weights (bfloat16, the whole model)          15.0 GiB" in lines
    assert lines[-6:] == [
        "  resident                                               5.0 GiB",
        "  generate: resident + its working set                  71.7 GiB of 71.7 GiB  fits",
        "  train: resident + its working set                     18.0 GiB of 71.7 GiB  fits",
        "  hand-over: resident + its working set                 20.2 GiB of 71.7 GiB  fits",
        ("  KV cache per GPU: 368,240 tokens, 39 concurrent sequences of maxSeq=9216 (all that memoryUtilization "
         "leaves room for; maxBatch=128)"),
        "colocated fits"]


def test_pat_validate_refuses_a_max_seq_beyond_the_models_positions(tmp_path, capsys):
    """model.path's config.json is here: pat validate reads its max_position_embeddings."""
    (tmp_path / "config.json").write_text(json.dumps(fit.hf_config("llama", **fit.PRESETS["test"],
                                                                   max_position_embeddings=32768)))
    doc = job("local.yaml", **{"generator.maxSeq": 40000, "algorithm.maxTokensPerMicroBatch": 40000})
    doc["spec"]["model"] = {"path": str(tmp_path)}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    code, out, err = run(capsys, "validate", str(tmp_path / "job.yaml"))
    assert (code, out) == (2, "") and err == (f"{tmp_path / 'job.yaml'} does not fit:\n  spec.generator.maxSeq: "
                                              f"generator.maxSeq=40000 is beyond the model's max_position_embeddings="
                                              f"32768; lower generator.maxSeq to 32768 or less\n")
    doc["spec"]["generator"]["maxSeq"] = 32768
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    assert run(capsys, "validate", str(tmp_path / "job.yaml"))[:2] == (0, "RLHFJob arithmetic-grpo: valid\n")


# --- placement colocated -----------------------------------------------------------------------------------------

P = 8_030_261_248  # Llama-3.1-8B's parameters


def test_trainer_resident_bytes_with_and_without_cpu_offload():
    """What a trainer rank keeps on its GPU between phases: its 1/24 of the fp32 parameters (4), AdamW's moments (8)
    and the reference (4); not the gradients, which training frees; nothing with cpuOffload."""
    assert fit.trainer_resident_bytes(colocated(), LLAMA) == 16 * P / 24
    assert fit.trainer_resident_bytes(colocated(**{"algorithm.klCoef": 0.0}), LLAMA) == 12 * P / 24
    assert fit.trainer_resident_bytes(colocated(**{"trainer.cpuOffload": True}), LLAMA) == 0
    # The states trainer_memory counts, less the gradients; separate too (FSDP2 over the trainer's 8 GPUs).
    sharded = {label: b for label, b in fit.trainer_memory(spec(), LLAMA).terms if label.endswith("(fp32, 1/8)")}
    assert fit.trainer_resident_bytes(spec(), LLAMA) == sum(sharded.values()) - sharded["gradients (fp32, 1/8)"]


def test_a_colocated_gpu_by_phase():
    """One H100 of the example: resident, the trainer's states; generating, the engine's weights, working memory and
    KV cache, which gets what memoryUtilization leaves after the trainer's resident states (39 sequences, 44
    separate); training, the gradients and the trainer's buffers (the engine asleep at level 2 holds nothing); the
    hand-over, the engine's weights again and a weight-sync bucket."""
    s = colocated()
    m = fit.colocated_memory(s, LLAMA, H100)
    resident, weights = 16 * P / 24, 2 * P
    working = 9216 * 200_832 + 3 * 4 * 128 * 8 * 128256
    assert m.resident_bytes == resident
    assert m.generate[0] == ("engine weights (bfloat16, the whole model)", weights)
    room = int((0.9 * H100 - weights - working - resident) / (2 * MIB * 1.08))
    assert fit.kv_blocks(s, LLAMA, H100) == (room, room) and room // 576 == 39
    assert fit.kv_blocks(spec(), LLAMA, H100)[0] // 576 == 44  # negative control: separate, no trainer beside
    assert m.generate[2] == ("engine KV cache (39 x 9216 tokens)", room * 2 * MIB)
    assert m.generate_bytes == pytest.approx(resident + weights + working + 1.08 * room * 2 * MIB)
    assert m.generate_bytes <= 0.9 * H100
    buffers = fit.trainer_memory(s, LLAMA).total - sum(b for label, b in fit.trainer_memory(s, LLAMA).terms
                                                       if "1/24" in label)
    assert m.train_bytes == pytest.approx(resident + 4 * P / 24 + buffers) == fit.trainer_memory(s, LLAMA).total
    assert m.train_bytes / GIB == pytest.approx(18.0, abs=0.05)
    assert m.handover_bytes == resident + weights + 256 * MIB
    assert fit.WEIGHT_SYNC_BUCKET_BYTES == weightsync.BUCKET_BYTES


def test_the_phases_alternate_so_the_larger_one_counts():
    """The example fits because the engine releases its KV cache for training: held through training, the cache
    and the trainer's working set together would be over the usable memory."""
    s = colocated()
    m = fit.colocated_memory(s, LLAMA, H100)
    assert fit.problems(s, LLAMA, fit.role_gpus(s)) == [] and fit.role_gpus(s) == {"colocated": fit.GPUS["H100-SXM"]}
    assert max(m.generate_bytes, m.train_bytes, m.handover_bytes) <= fit.usable(H100)
    not_released = m.resident_bytes + sum(b for _, b in m.generate) + sum(b for _, b in m.train)
    assert not_released > fit.usable(H100)  # 85 GiB of 71.7


def test_a_colocated_job_that_does_not_fit_names_the_field_and_the_numbers_of_each_phase():
    """One pod of 2 GPUs: the trainer's states over 2 ranks are 59.8 GiB a GPU, resident in both phases."""
    s = colocated(**{"generator.replicas": 1, "generator.gpusPerPod": 2})
    (message,) = fit.problems(s, LLAMA, fit.role_gpus(s))
    assert message == (
        "spec.generator.gpusPerPod: with gpusPerPod=2, a GPU of colocated llama-3.1-8b (a trainer rank and an engine "
        "rank) needs 78.1 GiB to generate (the trainer's states 59.8 GiB; the engine's weights 15.0 GiB, its working "
        "memory and the KV cache of one sequence of 9216 tokens 3.3 GiB), more than the 71.7 GiB that "
        "memoryUtilization=0.9 allows of an H100-SXM's 79.6 GiB; and 86.6 GiB to train (the trainer's states "
        "59.8 GiB; gradients, activations and buffers 26.8 GiB), more than the 71.7 GiB usable of an H100-SXM's "
        "79.6 GiB (10% kept free); and 75.0 GiB to hand the weights over (the trainer's states 59.8 GiB; the "
        "engine's weights 15.0 GiB and a bucket in transit), more than the 71.7 GiB usable of an H100-SXM's 79.6 GiB "
        "(10% kept free); with gpusPerPod=4: generate 48.5 GiB of 71.7 GiB, train 49.2 GiB of 71.7 GiB, hand-over "
        "45.1 GiB of 71.7 GiB; also fits: generator.replicas=2 (generate 48.2 GiB of 71.7 GiB, train 49.2 GiB of "
        "71.7 GiB, hand-over 45.1 GiB of 71.7 GiB), trainer.cpuOffload=true (generate 18.3 GiB of 71.7 GiB, train "
        "11.8 GiB of 71.7 GiB, hand-over 15.2 GiB of 71.7 GiB)")
    # The train phase alone: only it is named, and the least change of the micro-batch that fits comes first.
    (message,) = fit.problems(colocated(**{"trainer.activationCheckpointing": False,
                                           "algorithm.maxTokensPerMicroBatch": 16384}), LLAMA, fit.role_gpus(s))
    assert message.startswith("spec.algorithm.maxTokensPerMicroBatch: with maxTokensPerMicroBatch=16384, a GPU of "
                              "colocated llama-3.1-8b (a trainer rank and an engine rank) needs 109.0 GiB to train "
                              "(the trainer's states 5.0 GiB; gradients, activations and buffers 104.0 GiB)")
    assert "to generate" not in message
    assert message.endswith("also fits: trainer.activationCheckpointing=true (generate 24.3 GiB of 71.7 GiB, train "
                            "18.0 GiB of 71.7 GiB, hand-over 20.2 GiB of 71.7 GiB)")


def test_pat_validate_and_plan_refuse_a_colocated_job_that_does_not_fit(tmp_path, capsys):
    """A tiny preset of Llama-3.1-8B's shape on one colocated pod of H100s, its engines allowed 75% of each: on 2
    GPUs the trainer's states and the engine's weights are too much to generate in (separate they would do), on 8
    they fit."""
    doc = job("local.yaml", placement="colocated")
    doc["spec"]["model"] = {"tiny": {"preset": "llama-8b"}, "dtype": "bfloat16"}
    doc["spec"]["trainer"] = {}
    doc["spec"]["generator"] = {"gpusPerPod": 2, "maxSeq": doc["spec"]["generator"]["maxSeq"],
                                "memoryUtilization": 0.75,
                                "nodeSelector": {fit.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}
    for gpus, code in ((2, 2), (8, 0)):
        doc["spec"]["generator"]["gpusPerPod"] = gpus
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
        planned, out, err = run(capsys, "plan", str(tmp_path / "job.yaml"))
        validated, _, verr = run(capsys, "validate", str(tmp_path / "job.yaml"))
        assert (planned, validated) == (code, code), err + verr
        if code:
            assert ("job.yaml does not fit:\n  spec.generator.memoryUtilization: with memoryUtilization=0.75, a GPU of "
                    "colocated " in err and "; also fits: generator.gpusPerPod=4 (" in err)
            assert err.split("\n", 1)[1] == verr.split("\n", 1)[1]  # the same message
            # Generating beside the trainer's states over 2 ranks is over; each role on GPUs of its own is not.
            assert out.splitlines()[-1] == ("colocated does not fit: generate 60.8 GiB of 59.7 GiB; separate (the "
                                            "trainer on 2 GPUs of its own) would: trainer 63.6 GiB of 71.7 GiB, "
                                            "generator 15.9 GiB of 59.7 GiB")
        else:
            assert err == verr == "" and out.endswith("\ncolocated fits\n")


def test_a_separate_job_as_colocated_on_the_same_gpus():
    """Its 24 GPUs as 3 pods of the generator's 8; GPUs that do not make whole pods, or CPU pods: none."""
    colocated_spec = fit.colocated_equivalent(spec())
    assert colocated_spec.placement == "colocated" and colocated_spec.generator.replicas == 3
    assert colocated_spec.trainer.world_size == 24 and colocated_spec.trainer.replicas == 3
    assert fit.budgets(colocated_spec, LLAMA, "colocated", H100) == fit.budgets(colocated(), LLAMA, "colocated", H100)
    assert fit.colocated_equivalent(spec(**{"trainer.gpusPerPod": 4})) is None  # 20 GPUs: not whole pods of 8
    assert fit.colocated_equivalent(colocated()) is None
