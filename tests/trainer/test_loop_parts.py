"""The GRPO loop's parts: sampling seeds, batch packing, the start-up fit check, the trainer's
Prometheus metrics, when training is deterministic."""

import pytest
import torch
from prometheus_client import generate_latest

from pat_operator import metric_names as names
from pat_operator.api import parse_job
from pat_operator.fit import FitError
from pat_workers.trainer.loop import (Rollout, TrainerMetrics, _pack, check_device_memory, deterministic_training,
                                     sample_seed)


def test_sample_seeds_are_fixed_by_position_and_distinct():
    seeds = {sample_seed(0, it, p, g) for it in range(1, 4) for p in range(16) for g in range(8)}
    assert len(seeds) == 3 * 16 * 8
    assert sample_seed(0, 2, 5, 3) == sample_seed(0, 2, 5, 3) != sample_seed(1, 2, 5, 3)


def test_pack_concatenates_prompts_and_responses_into_one_row():
    rollouts = [Rollout([1, 2], [3], [-0.1], 1.0, 0.5), Rollout([4], [5, 6, 7], [-0.2] * 3, 0.0, -0.5)]
    tokens, prompt_lens, response_lens = _pack(rollouts, torch.device("cpu"))
    assert tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]  # no padding
    assert prompt_lens.tolist() == [2, 1] and response_lens.tolist() == [1, 3]


def test_trainer_metrics_export_the_contract_names():
    metrics = TrainerMetrics("127.0.0.1", port=0)
    metrics.record({"iteration": 3, "seconds": {"generate": 1.5, "train": 0.5}, "reward_mean": 0.25,
                    "reward_std": 0.1, "response_tokens_mean": 12.0, "loss": -0.2, "kl": 0.0, "entropy": 2.0,
                    "policy_version": 3, "logprob_diff_mean": 0.01, "logprob_diff_max": 0.5, "logprob_kl": 0.002,
                    "reward_failures": 2})
    text = generate_latest(metrics.registry).decode()
    assert f"{names.TRAINER_REWARD_FAILURES}_total 2.0" in text
    assert f"{names.TRAINER_ROLLOUT_LOGPROB_DIFF_MAX} 0.5" in text and f"{names.TRAINER_ROLLOUT_KL} 0.002" in text
    assert f"{names.TRAINER_ITERATION} 3.0" in text
    assert f'{names.TRAINER_PHASE_SECONDS}{{phase="generate"}} 1.5' in text
    assert f"{names.TRAINER_REWARD_MEAN} 0.25" in text and f"{names.TRAINER_ENTROPY} 2.0" in text


def test_the_trainer_fails_fast_when_a_rank_cannot_fit(model_dir, tmp_path):
    """The start-up check: the same estimate as `pat plan`, against this host's free memory."""
    job = parse_job({"apiVersion": "pat.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "big"},
                     "spec": {"placement": "separate", "model": {"path": str(model_dir)},
                              "dataset": {"synthetic": {}}, "trainer": {"gpusPerPod": 0},
                              "algorithm": {"maxTokensPerMicroBatch": 1 << 40}}})
    with pytest.raises(FitError, match=r"spec\.algorithm\.maxTokensPerMicroBatch: .* needs .* with "
                                       r"maxTokensPerMicroBatch=1099511627776"):
        check_device_memory(job.spec, model_dir, torch.device("cpu"))
    # Negative control: the default budget fits.
    fits = job.spec.model_copy(update={"algorithm": job.spec.algorithm.model_copy(
        update={"max_tokens_per_micro_batch": 16384})})
    check_device_memory(fits, model_dir, torch.device("cpu"))


def test_deterministic_algorithms_by_default_on_cpu_only_unless_the_spec_says():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert deterministic_training(None, cpu) and not deterministic_training(None, gpu)
    assert deterministic_training(True, gpu) and not deterministic_training(False, cpu)
