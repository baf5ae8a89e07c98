"""Two DDP trainer ranks, each on half of a batch, take the same step as one process on the whole batch."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pat_workers.trainer.grpo import group_advantages, policy_loss
from pat_workers.trainer.policy import Policy, response_logprobs
from tests.engine.multiproc import run_ranks

LEARNING_RATE = 0.5


def make_batch(model_dir):
    """8 responses (2 prompts x G=4) of unequal lengths, so that the ranks' halves hold unequal token counts."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (8, 12), generator=g)
    prompt_lens = torch.tensor([3, 3, 3, 3, 4, 4, 4, 4])
    response_lens = torch.tensor([2, 8, 5, 1, 8, 7, 8, 6])
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]), group_size=4)
    with torch.no_grad():
        current = response_logprobs(Policy(model_dir), tokens, prompt_lens, response_lens).logprobs
    # Rollout and reference log-probabilities a little off the current policy: ratios clip, the KL is non-zero.
    old = current + 0.3 * torch.randn(current.shape, generator=g)
    ref = current + 0.1 * torch.randn(current.shape, generator=g)
    return tokens, prompt_lens, response_lens, advantages, old, ref


def step(model, policy, batch, token_normalizer=None):
    """One GRPO step (plain SGD, so that weights differ exactly as gradients do) through `model`."""
    tokens, prompt_lens, response_lens, advantages, old, ref = batch
    out = response_logprobs(model, tokens, prompt_lens, response_lens)
    loss, _ = policy_loss(out.logprobs, old, advantages, out.mask, clip_ratio=0.2, ref_logprobs=ref, kl_coef=0.1,
                          token_normalizer=token_normalizer)
    loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= LEARNING_RATE * p.grad
            p.grad = None
    return {name: t.clone() for name, t in policy.named_weights().items()}


def ddp_rank(rank, world, model_dir, batch):
    """This rank's weights after a step with DDP's gradient all-reduce, and after one without (no_sync)."""
    half = slice(rank * 8 // world, (rank + 1) * 8 // world)
    shard = tuple(t[half] for t in batch)
    # token-mean over the whole batch: each rank divides by the mean token count per rank (DDP averages).
    tokens_total = torch.tensor(float(shard[2].sum()))
    dist.all_reduce(tokens_total)
    policy = Policy(model_dir)
    initial = {name: t.clone() for name, t in policy.named_weights().items()}
    model = DistributedDataParallel(policy)
    synced = step(model, policy, shard, token_normalizer=tokens_total.item() / world)
    policy.load_weights(initial)
    with model.no_sync():
        unsynced = step(model, policy, shard, token_normalizer=tokens_total.item() / world)
    return synced, unsynced


def test_ddp_step_equals_a_single_process_step(model_dir):
    batch = make_batch(model_dir)
    policy = Policy(model_dir)
    single = step(policy, policy, batch)
    (synced0, unsynced0), (synced1, _) = run_ranks(ddp_rank, 2, model_dir, batch, timeout=60)
    for name, expected in single.items():
        assert torch.allclose(synced0[name], expected, atol=1e-6), name
        assert torch.equal(synced0[name], synced1[name]), name
    # Negative control: without the gradient all-reduce a rank's step is not the whole batch's.
    assert max((unsynced0[n] - single[n]).abs().max().item() for n in single) > 1e-3
