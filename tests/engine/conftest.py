"""Shared fixtures of the engine tests: a tiny model, a request set, and its single-process reference."""

import pytest

from pat_workers.engine.engine import Request
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.rank import EngineOptions
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import make_tiny_model

# CPU: the comparisons are between CPU runs (a GPU, where present, would be a different numeric path).
OPTIONS = EngineOptions(max_batch=8, max_seq=192, profile_batches=(1, 4), device="cpu")


def make_requests(n: int = 12, seed: int = 0) -> list[Request]:
    """Mixed lengths (so replicas run dry at different times) and one long tail (so that a replica that ran dry
    still has a peer decoding when the coordinator, a few events behind, reacts); half greedy, half sampled."""
    out = []
    for i in range(n):
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=100 if i == n - 1 else 8 + (i * 7) % 40, ignore_eos=True,
                                seed=seed * 1000 + i,
                                temperature=0.9 if sampled else 0.0, top_p=0.95 if sampled else 1.0,
                                top_k=50 if i % 4 == 3 else 0)
        out.append(Request(f"req-{i}", [256] + [(37 * i + 11 * j) % 250 for j in range(3 + i % 5)], params))
    return out


def fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.id, list(r.prompt), r.params) for r in requests]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", preset="test", seed=1)


@pytest.fixture(scope="session")
def reference(model_dir):
    """Completions of make_requests() by one process at TP=1."""
    with LocalGenerator(model_dir, 1, OPTIONS) as gen:
        return gen.run(fresh(make_requests())).completions


def mismatches(reference: dict, completions: dict, atol: float = 1e-4) -> list[str]:
    """Requests whose tokens, finish reason or log-probabilities differ from the reference."""
    bad = []
    for rid, ref in reference.items():
        got = completions[rid]
        if got.output != ref.output or got.finish_reason != ref.finish_reason or any(
                abs(a - b) > atol for a, b in zip(got.logprobs, ref.logprobs)):
            bad.append(rid)
    return bad
