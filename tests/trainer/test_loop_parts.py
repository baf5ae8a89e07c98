"""The GRPO loop's pure parts: sampling seeds, batch packing, the trainer's Prometheus metrics."""

import torch
from prometheus_client import generate_latest

from pat_operator import metric_names as names
from pat_workers.trainer.loop import Rollout, TrainerMetrics, _pack, sample_seed


def test_sample_seeds_are_fixed_by_position_and_distinct():
    seeds = {sample_seed(0, it, p, g) for it in range(1, 4) for p in range(16) for g in range(8)}
    assert len(seeds) == 3 * 16 * 8
    assert sample_seed(0, 2, 5, 3) == sample_seed(0, 2, 5, 3) != sample_seed(1, 2, 5, 3)


def test_pack_right_pads_prompt_and_response():
    rollouts = [Rollout([1, 2], [3], [-0.1], 1.0, 0.5), Rollout([4], [5, 6, 7], [-0.2] * 3, 0.0, -0.5)]
    tokens, prompt_lens, response_lens = _pack(rollouts, torch.device("cpu"))
    assert tokens.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert prompt_lens.tolist() == [2, 1] and response_lens.tolist() == [1, 3]


def test_trainer_metrics_export_the_contract_names():
    metrics = TrainerMetrics("127.0.0.1", port=0)
    metrics.record({"iteration": 3, "seconds": {"generate": 1.5, "train": 0.5}, "reward_mean": 0.25,
                    "reward_std": 0.1, "response_tokens_mean": 12.0, "loss": -0.2, "kl": 0.0, "entropy": 2.0,
                    "policy_version": 3})
    text = generate_latest(metrics.registry).decode()
    assert f"{names.TRAINER_ITERATION} 3.0" in text
    assert f'{names.TRAINER_PHASE_SECONDS}{{phase="generate"}} 1.5' in text
    assert f"{names.TRAINER_REWARD_MEAN} 0.25" in text and f"{names.TRAINER_ENTROPY} 2.0" in text
