"""Shared fixtures of the engine tests: a tiny model, a request set, and its single-process reference."""

import pytest

from pat_workers.engine.engine import Request
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.rank import EngineOptions
from pat_workers.engine.tiny import fresh, make_tiny_model, mixed_requests
from tests.tiers import starts

# CPU: the comparisons are between CPU runs (a GPU, where present, would be a different numeric path).
OPTIONS = EngineOptions(max_batch=8, max_seq=192, profile_batches=(1, 4), device="cpu")


def make_requests(n: int = 12, seed: int = 0) -> list[Request]:
    return mixed_requests(n, seed)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", preset="test", seed=1)


@pytest.fixture(scope="session")
@starts("slow")
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
