"""FSDP2 training: 2 and 4 ranks, each on its share of every mini-batch, take the steps one process takes on the
whole batch; token-budget micro-batches, activation checkpointing and CPU offload change nothing; checkpoints
reshard."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from pat_operator.api import Algorithm
from pat_workers.trainer import checkpoint
from pat_workers.trainer.grpo import group_advantages
from pat_workers.trainer.loop import Rollout, adamw, train_iteration
from pat_workers.trainer.policy import Policy, full_weights, sharded_policy
from tests.engine.multiproc import run_ranks

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

ALGORITHM = dict(mini_batches=2, learning_rate=0.01, kl_coef=0.05, clip_ratio=0.2)


def make_rollouts(model_dir, iteration: int) -> list[Rollout]:
    """16 responses (4 prompts x G=4) of unequal lengths, engine log-probabilities a little off the policy's."""
    g = torch.Generator().manual_seed(iteration)
    policy = Policy(model_dir)
    rollouts = []
    rewards = torch.randint(0, 2, (16,), generator=g).float()
    for i, advantage in enumerate(group_advantages(rewards, group_size=4).tolist()):
        prompt = torch.randint(0, 300, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(0, 300, (1 + (5 * i) % 11,), generator=g).tolist()
        with torch.no_grad():
            lp = policy(torch.tensor(prompt + response), torch.tensor([len(prompt)]),
                        torch.tensor([len(response)])).logprobs[0]
        rollouts.append(Rollout(prompt, response, (lp + 0.2 * torch.randn(lp.shape, generator=g)).tolist(),
                                float(rewards[i]), advantage))
    return rollouts


def train_rank(rank, world, model_dir, batches, algorithm, sharded=True, checkpointing=False, save_to=None,
               resume_from=None, cpu_offload=False):
    """The weights after training on `batches` (one iteration each), gathered on every rank."""
    mesh = init_device_mesh("cpu", (world,))
    alg = Algorithm(**algorithm)
    if sharded:
        build = lambda trainable: sharded_policy(model_dir, mesh, checkpointing=checkpointing,  # noqa: E731
                                                 bf16=False, cpu_offload=cpu_offload, trainable=trainable)
        policy, reference = build(True), build(False)
    else:  # each rank alone: no gradient is shared
        policy, reference = Policy(model_dir), Policy(model_dir).requires_grad_(False)
    optimizer = adamw(policy, alg, torch.device("cpu"))
    if resume_from is not None:
        checkpoint.load(resume_from, policy, optimizer)
    stats = [train_iteration(policy, reference, optimizer, rollouts, alg, rank, world, torch.device("cpu"))
             for rollouts in batches]
    if save_to is not None:
        checkpoint.save(save_to, len(batches), policy, optimizer, state={}, keep=1)
    return dict(full_weights(policy)), stats


@pytest.fixture(scope="module")
def batches(model_dir):
    return [make_rollouts(model_dir, i) for i in range(2)]


@pytest.fixture(scope="module")
def single(model_dir, batches):
    (weights, stats), = run_ranks(train_rank, 1, model_dir, batches, ALGORITHM, timeout=120)
    return weights, stats


# Float32 sums in another order differ in the last bits, and Adam's first steps (m / sqrt(v)) magnify them
# where a gradient is near zero: measured ~5e-5 after 4 steps at lr 0.01, where the weights moved by > 1e-2.
TOLERANCE = 2e-4


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_ranks_train_to_the_weights_of_one_process(model_dir, batches, single, world):
    results = run_ranks(train_rank, world, model_dir, batches, ALGORITHM, timeout=180)
    initial = dict(full_weights(Policy(model_dir)))
    assert max_difference(single[0], initial) > 1e-2  # training moved the weights
    for weights, stats in results:
        assert max_difference(weights, single[0]) < TOLERANCE
        for mine, theirs in zip(stats, single[1]):
            assert mine.keys() == theirs.keys()
            assert all(mine[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6) for k in mine), (mine, theirs)
    # Negative control: ranks that do not share their gradients end elsewhere.
    alone = run_ranks(train_rank, 2, model_dir, batches, ALGORITHM, False, timeout=120)
    assert max_difference(alone[0][0], single[0]) > 10 * TOLERANCE


def test_micro_batches_activation_checkpointing_and_offload_change_no_step(model_dir, batches, single):
    # 24 tokens per micro-batch: each rank's share of 36 to 47 packed tokens takes 2 or 3 passes (a rank with
    # fewer runs zero-weight passes: tests/trainer/test_old_logprobs.py). CPUOffloadPolicy runs the optimizer on
    # host copies (on CPU the same memory, so this checks its code path, not a transfer).
    tight = {**ALGORITHM, "max_tokens_per_micro_batch": 24}
    (weights, _), _ = run_ranks(train_rank, 2, model_dir, batches, tight, True, True, None, None, True, timeout=180)
    assert max_difference(weights, single[0]) < TOLERANCE


def test_a_checkpoint_written_by_2_ranks_resumes_on_4(model_dir, batches, single, tmp_path):
    run_ranks(train_rank, 2, model_dir, batches[:1], ALGORITHM, True, False, tmp_path, timeout=120)
    path = checkpoint.latest(tmp_path)
    assert path.name == "iter-000001"
    resumed = run_ranks(train_rank, 4, model_dir, batches[1:], ALGORITHM, True, False, None, path, timeout=180)
    assert max_difference(resumed[0][0], single[0]) < TOLERANCE  # the optimizer's moments came back too
    assert set(checkpoint.load_weights(path)) == set(single[0])
