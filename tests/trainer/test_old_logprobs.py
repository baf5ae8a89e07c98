"""pi_old: with algorithm.oldLogprobs trainer (the default) the trainer recomputes it before the first step, equal to
the engine's log-probabilities under the same weights; the engine's then change no step unless they weigh the loss
(rolloutCorrection tis), and train_iteration measures them against the trainer's (logprob_diff_*, logprob_kl)."""

import pytest
import torch

from pat_operator.api import Algorithm
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.rank import EngineOptions
from pat_workers.engine.tiny import fresh, make_tiny_model, mixed_requests
from pat_workers.trainer.batching import micro_batch_plan
from pat_workers.trainer.grpo import group_advantages, tis_weights
from pat_workers.trainer.loop import Rollout, old_logprobs, train_iteration
from pat_workers.trainer.policy import Policy
from tests.engine.multiproc import run_ranks
from tests.trainer.test_fsdp import TOLERANCE, max_difference, train_rank

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

CPU = torch.device("cpu")
ALGORITHM = dict(mini_batches=2, learning_rate=1.0, clip_ratio=0.2, max_tokens_per_micro_batch=40)
MISMATCH = ("logprob_diff_mean", "logprob_diff_max", "logprob_kl")


@pytest.fixture(scope="module")
def engine_rollouts(model_dir) -> list[Rollout]:
    """12 responses the engine generated (half greedy, half sampled at temperature 0.9 with top-p / top-k), with
    its log-probabilities; advantages of 2 groups of 6."""
    with LocalGenerator(model_dir, 1, EngineOptions(max_batch=8, max_seq=192, profile_batches=(1, 4),
                                                    device="cpu")) as gen:
        done = gen.run(fresh(mixed_requests(12, longest=40))).completions
    requests = [done[f"req-{i}"] for i in range(12)]
    rewards = torch.tensor([float(i % 3 == 0) for i in range(12)])
    return [Rollout(r.prompt, r.output, r.logprobs, float(reward), advantage)
            for r, reward, advantage in zip(requests, rewards, group_advantages(rewards, 6).tolist())]


def rollouts(model_dir, perturbation: float = 0.0, seed: int = 0) -> tuple[list[Rollout], list[torch.Tensor]]:
    """8 rollouts (2 prompts x G=4; one response of 1 token) whose engine log-probabilities are the policy's own,
    each scored alone, plus `perturbation` x N(0, 1) noise; and the noise added to each."""
    g = torch.Generator().manual_seed(seed)
    policy = Policy(model_dir)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    out, noises = [], []
    for i, advantage in enumerate(group_advantages(rewards, 4).tolist()):
        prompt = torch.randint(0, 300, (2 + i % 4,), generator=g).tolist()
        response = torch.randint(0, 300, (1 if i == 5 else 3 + (7 * i) % 13,), generator=g).tolist()
        with torch.no_grad():
            exact = policy(torch.tensor(prompt + response), torch.tensor([len(prompt)]),
                           torch.tensor([len(response)])).logprobs[0]
        noise = perturbation * torch.randn(len(response), generator=torch.Generator().manual_seed(100 + i))
        out.append(Rollout(prompt, response, (exact + noise).tolist(), float(rewards[i]), advantage))
        noises.append(noise)
    return out, noises


def train(model_dir, batch: list[Rollout], **algorithm):
    """One train_iteration by one process from the model's weights: its stats, the weights and the last gradients.
    SGD: AdamW's first step is +-lr wherever a gradient is ~0, a sign float rounding decides; SGD's moves with it."""
    torch.manual_seed(0)
    policy = Policy(model_dir)
    alg = Algorithm(**{**ALGORITHM, **algorithm})
    stats = train_iteration(policy, None, torch.optim.SGD(policy.parameters(), lr=alg.learning_rate), batch, alg,
                            0, 1, CPU)
    return (stats, {n: p.detach().clone() for n, p in policy.named_parameters()},
            {n: p.grad.clone() for n, p in policy.named_parameters()})


@pytest.fixture(autouse=True)
def deterministic():
    """CPU embedding backward otherwise sums in a thread-dependent order: identical runs could differ in a bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_recomputed_logprobs_equal_the_engines(model_dir, engine_rollouts):
    policy = Policy(model_dir)
    lengths = [len(r.prompt) + len(r.response) for r in engine_rollouts]
    plan, = micro_batch_plan(lengths, 1, 64)
    assert len(plan) > 1 and max(map(len, plan)) > 1  # several packed micro-batches of several sequences
    old = old_logprobs(policy, engine_rollouts, plan, engine_rollouts[:1], CPU)
    assert sorted(old) == list(range(12))
    for i, r in enumerate(engine_rollouts):
        assert (old[i] - torch.tensor(r.logprobs)).abs().max().item() < 1e-4, i
    stats = train(model_dir, engine_rollouts)[0]
    assert stats["logprob_diff_max"] < 1e-4 and stats["logprob_kl"] < 1e-8
    # Negative control: another model's log-probabilities are far from the engine's.
    other = Policy(make_tiny_model(model_dir.parent / "other", preset="test", seed=6))
    old = old_logprobs(other, engine_rollouts, plan, engine_rollouts[:1], CPU)
    assert max((old[i] - torch.tensor(r.logprobs)).abs().max().item() for i, r in enumerate(engine_rollouts)) > 0.1


def test_recomputed_pi_old_trains_as_the_exact_one_handed_in(model_dir):
    batch, _ = rollouts(model_dir)
    recomputed, handed_in = train(model_dir, batch), train(model_dir, batch, old_logprobs="engine")
    assert recomputed[0]["loss"] == pytest.approx(handed_in[0]["loss"], rel=1e-5)
    assert recomputed[0]["clip_fraction"] > 0  # the second mini-batch's ratios moved: pi_old mattered
    assert max_difference(recomputed[1], handed_in[1]) < 1e-6


def test_engine_logprobs_change_no_step_with_recompute(model_dir):
    exact, perturbed = rollouts(model_dir)[0], rollouts(model_dir, perturbation=0.5)[0]
    a, b = train(model_dir, exact), train(model_dir, perturbed)
    assert {k: v for k, v in a[0].items() if k not in MISMATCH} == {k: v for k, v in b[0].items() if k not in MISMATCH}
    assert all(torch.equal(a[1][n], b[1][n]) and torch.equal(a[2][n], b[2][n]) for n in a[1])
    # Negative control: taken as pi_old, the perturbed log-probabilities change the loss and the step.
    c, d = train(model_dir, exact, old_logprobs="engine"), train(model_dir, perturbed, old_logprobs="engine")
    assert abs(c[0]["loss"] - d[0]["loss"]) > 1e-3 and max_difference(c[1], d[1]) > 1e-4


def test_tis_weighs_each_token_by_the_capped_ratio(model_dir):
    """One mini-batch: the ratio to the recomputed pi_old is 1, so each token's loss is -A x its TIS weight
    min(pi_old / pi_engine, cap) = min(exp(-noise), cap), token-mean over the batch."""
    batch, noises = rollouts(model_dir, perturbation=1.0)
    tis = train(model_dir, batch, mini_batches=1, rollout_correction="tis", tis_cap=2.0)[0]
    weights = [torch.exp(-noise).clamp(max=2.0) for noise in noises]
    assert any((w == 2.0).any() for w in weights) and any((w < 1).any() for w in weights)  # capped and not
    tokens = sum(len(r.response) for r in batch)
    expected = sum(-r.advantage * w.sum().item() for r, w in zip(batch, weights)) / tokens
    assert tis["loss"] == pytest.approx(expected, rel=1e-5)
    for r, noise, w in zip(batch, noises, weights):  # grpo.tis_weights is the same formula
        exact = torch.tensor(r.logprobs) - noise
        assert torch.allclose(tis_weights(exact, torch.tensor(r.logprobs), 2.0), w, rtol=1e-5)
    # Negative control: without the correction every weight is 1.
    plain = train(model_dir, batch, mini_batches=1)[0]
    assert plain["loss"] == pytest.approx(sum(-r.advantage * len(r.response) for r in batch) / tokens, abs=1e-6)
    assert abs(plain["loss"] - tis["loss"]) > 1e-2


def test_mismatch_stats_measure_the_engines_difference(model_dir):
    exact = train(model_dir, rollouts(model_dir)[0])[0]
    assert exact["logprob_diff_max"] < 1e-5 and exact["logprob_kl"] < 1e-10
    batch, noises = rollouts(model_dir, perturbation=0.3)
    noise = torch.cat(noises).double()
    d = -noise  # trainer - engine
    stats = train(model_dir, batch)[0]
    assert stats["logprob_diff_mean"] == pytest.approx(noise.abs().mean().item(), abs=1e-5)
    assert stats["logprob_diff_max"] == pytest.approx(noise.abs().max().item(), abs=1e-5)
    assert stats["logprob_kl"] == pytest.approx((d.exp() - d - 1).mean().item(), abs=1e-5)
    # With the engine's pi_old: measured on the first mini-batch (every 2nd rollout) only, before the step.
    first = torch.cat(noises[0::2]).double()
    engine = train(model_dir, batch, old_logprobs="engine")[0]
    assert engine["logprob_diff_mean"] == pytest.approx(first.abs().mean().item(), abs=1e-5)
    assert engine["logprob_diff_max"] == pytest.approx(first.abs().max().item(), abs=1e-5)


@pytest.mark.parametrize("algorithm", [dict(rollout_correction="tis"), dict(old_logprobs="engine")])
def test_ranks_with_nothing_to_score_pair_up_and_sum_the_stats(model_dir, algorithm):
    """A mini-batch of one rollout on 2 ranks: the other runs zero-weight passes (recompute and training) and the
    stats, the largest difference too, are the one process's."""
    batch = [rollouts(model_dir, perturbation=0.3)[0][:3]]
    alg = {**ALGORITHM, "mini_batches": 3, "learning_rate": 0.01, **algorithm}  # AdamW
    (single, single_stats), = run_ranks(train_rank, 1, model_dir, batch, alg, timeout=120)
    for weights, stats in run_ranks(train_rank, 2, model_dir, batch, alg, timeout=120):
        assert max_difference(weights, single) < TOLERANCE
        assert stats[0].keys() == single_stats[0].keys()
        assert all(stats[0][k] == pytest.approx(single_stats[0][k], rel=1e-4, abs=1e-6) for k in stats[0])
