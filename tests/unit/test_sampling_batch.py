"""Batched sampling: mixed rows in one computation, row independence, the counter-based uniform, capturability."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pat_workers.engine import sampling
from pat_workers.engine.sampling import SamplingBatch, SamplingParams, sample, uniform

VOCAB = 64
MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.7, seed=3),
    SamplingParams(temperature=0.6, top_k=12, top_p=0.9, seed=4),
    SamplingParams(top_k=3, top_p=0.5),  # greedy: its filters force no sort
    SamplingParams(temperature=2.0, top_k=VOCAB + 10, seed=2**40 + 7),  # top_k past the vocabulary: no filter
    SamplingParams(temperature=1.0, top_k=1, seed=-5),
]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    # Rounded to one decimal so that rows have ties, also at the top-k and top-p cut-offs.
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2).round(decimals=1)


def test_build_pads_with_greedy_rows_and_sizes_the_sort():
    batch = SamplingBatch.build(MIXED, VOCAB, "cpu", rows=10)
    assert batch.temperature.dtype == batch.top_p.dtype == torch.float32
    assert batch.top_k.dtype == batch.seed.dtype == torch.int64
    assert batch.temperature[8:].tolist() == [0, 0] and batch.top_k[8:].tolist() == [0, 0]
    assert batch.top_k.tolist()[5:7] == [0, 0] and batch.top_p[5] == 1  # greedy and past-vocabulary filters dropped
    assert batch.sort_k == VOCAB  # the top_p row without top_k needs the whole vocabulary
    no_top_p = [p for p in MIXED if not (p.top_p < 1 and p.top_k == 0)]
    assert SamplingBatch.build(no_top_p, VOCAB, "cpu").sort_k == 16  # top_k 12, rounded up: one graph per width
    assert SamplingBatch.build(MIXED[:2] + MIXED[5:7], VOCAB, "cpu").sort_k == 0
    with pytest.raises(ValueError, match="rows=2"):
        SamplingBatch.build(MIXED, VOCAB, "cpu", rows=2)


def test_mixed_batch_samples_every_kind_of_row_at_once():
    logits = _logits(len(MIXED)).to(torch.bfloat16)
    full = logits.float()
    for step in range(20):
        steps = torch.full((len(MIXED),), step)
        tokens, logprobs = sample(logits, SamplingBatch.build(MIXED, VOCAB, "cpu"), steps)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert torch.allclose(logprobs, torch.log_softmax(full, -1).gather(1, tokens[:, None])[:, 0])
        assert tokens[0] == full[0].argmax() and tokens[5] == full[5].argmax() and tokens[7] == full[7].argmax()
        assert full[2, tokens[2]] >= full[2].topk(5).values[-1]
        probs = torch.softmax(full[3] / 1.3, -1).sort(descending=True).values
        cut = probs[int(((probs.cumsum(0) - probs) < 0.7).sum()) - 1]  # the least kept probability
        assert torch.softmax(full[3] / 1.3, -1)[tokens[3]] >= cut
        assert full[4, tokens[4]] >= full[4].topk(12).values[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("whole_vocabulary", [True, False])  # sort_k 64 with the top_p-only row, else 12
def test_each_row_sampled_alone_equals_the_row_in_a_mixed_batch(seed, whole_vocabulary):
    mixed = MIXED if whole_vocabulary else MIXED[:3] + MIXED[4:]
    logits = _logits(len(mixed), seed)
    params = [dataclasses.replace(p, seed=p.seed + 100 * seed) for p in mixed]
    steps = torch.arange(len(mixed)) * 7 + seed
    batch = SamplingBatch.build(params, VOCAB, "cpu", rows=16)
    padded = torch.cat([logits, _logits(16 - len(mixed), 99)])
    tokens, logprobs = sample(padded, batch, torch.cat([steps, torch.zeros(16 - len(mixed), dtype=torch.long)]))
    for row, p in enumerate(params):
        alone = SamplingBatch.build([p], VOCAB, "cpu")
        for one in (alone, dataclasses.replace(alone, sort_k=VOCAB) if alone.sort_k else alone):  # any sort_k it needs
            token, logprob = sample(logits[row:row + 1], one, steps[row:row + 1])
            assert token[0] == tokens[row] and torch.allclose(logprob[0], logprobs[row])


@pytest.mark.parametrize("u,expected", [(0.0, [0, 1, 0]), (1.0, [1, 3, 2])])
def test_the_draw_stays_within_the_kept_tokens_at_both_ends(monkeypatch, u, expected):
    # u = 1 is past uniform's range: u * total == total, as it can be after rounding, lands on the last kept token.
    monkeypatch.setattr(sampling, "uniform", lambda seed, step: torch.full(seed.shape, u))
    logits = torch.tensor([[0.0, 0.0, -torch.inf, -torch.inf], [-1.0, 3.0, 0.0, 2.0], [3.0, -1.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.9)]
    tokens = sample(logits, SamplingBatch.build(params, 4, "cpu"), torch.zeros(3, dtype=torch.long))[0]
    assert tokens.tolist() == expected


def test_uniform_folds_in_wide_and_negative_seeds():
    seeds = torch.tensor([5, 2**32 + 5, 2**40 + 5, -5, -1, -(2**63), 2**63 - 1])
    values = uniform(seeds, torch.full_like(seeds, 11))
    assert values.dtype == torch.float32 and 0 <= values.min() and values.max() < 1
    assert len(set(values.tolist())) == len(seeds)
    assert torch.equal(values, torch.stack([uniform(s, torch.tensor(11)) for s in seeds]))
    by_seed = uniform(torch.arange(2000) * (2**32 + 1) - 2**62, torch.tensor(0))  # seeds over the whole range
    assert len(set(by_seed.tolist())) >= 1990 and abs(by_seed.mean() - 0.5) < 0.03


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.dtypes = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        self.dtypes.update(t.dtype for t in (out if isinstance(out, (tuple, list)) else [out])
                           if isinstance(t, torch.Tensor))
        return out


def test_sample_stays_on_the_device_in_float32():
    batch = SamplingBatch.build(MIXED, VOCAB, "cpu")
    with _Recorder() as rec:
        sample(_logits(len(MIXED)).half(), batch, torch.arange(len(MIXED)))
    assert torch.float64 not in rec.dtypes
    assert not rec.ops & {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2"}


def test_compiled_sample_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True)
    logits = _logits(len(MIXED), 5)
    for params in (MIXED, MIXED[:2]):  # with and without the sort
        batch = SamplingBatch.build(params, VOCAB, "cpu")
        steps = torch.arange(len(params)) + 3
        tokens, logprobs = compiled(logits[:len(params)], batch, steps)
        eager = sample(logits[:len(params)], batch, steps)
        assert torch.equal(tokens, eager[0]) and torch.allclose(logprobs, eager[1])
