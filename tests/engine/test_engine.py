"""Continuous batching on one rank: requests join and leave between steps; each one's tokens are what it
would get alone."""

import pytest

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingParams

from .conftest import fresh, make_requests


class OneRankPool:
    """The pool of a one-rank pod: every group is the rank itself, so there is nothing to communicate."""

    rank, world = 0, 1

    def get(self, ranks):
        assert tuple(ranks) == (0,)
        return SoloCommunicator(0)


@pytest.fixture(scope="module")
def model(model_dir):
    return Transformer(*load_model(model_dir))


def drain(engine: Engine, arrivals: dict[int, list[Request]]) -> tuple[dict[str, Request], list[tuple[int, int]]]:
    done, shapes, step = {}, [], 0
    while engine.has_work() or any(s >= step for s in arrivals):
        engine.add(arrivals.get(step, []))
        stats = engine.step()
        shapes.append((stats.batch, len(engine.waiting)))
        done.update((r.id, r) for r in stats.finished)
        step += 1
    return done, shapes


def test_requests_join_and_leave_between_steps(model):
    requests = make_requests(8)
    alone = {}
    for r in fresh(requests):
        alone.update(drain(Engine(model, OneRankPool(), max_batch=8, max_seq=192), {0: [r]})[0])
    together = fresh(requests)
    engine = Engine(model, OneRankPool(), max_batch=3, max_seq=192)  # 3 slots: the rest queue
    done, shapes = drain(engine, {0: together[:5], 4: together[5:7], 11: together[7:]})
    assert sorted(done) == sorted(alone)
    assert max(b for b, _ in shapes) == 3 and max(w for _, w in shapes) >= 2, shapes
    for rid, r in alone.items():
        assert done[rid].output == r.output and done[rid].finish_reason == r.finish_reason
        assert max(abs(a - b) for a, b in zip(done[rid].logprobs, r.logprobs)) < 1e-4


def test_stop_tokens_eos_and_limits(model):
    engine = Engine(model, OneRankPool(), max_batch=4, max_seq=40)
    probe = Request("probe", [256, 1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    first = drain(engine, {0: [probe]})[0]["probe"].output
    stop = Request("stop", [256, 1, 2, 3], SamplingParams(max_tokens=6, stop_token_ids=(first[2],)))
    cap = Request("cap", [256, 1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    done = drain(engine, {0: [stop, cap]})[0]
    assert done["stop"].output == first[:3] and done["stop"].finish_reason == "stop"
    assert done["cap"].finish_reason == "length" and len(done["cap"].prompt) + len(done["cap"].output) == 40
    # EOS ends a request unless ignore_eos: make the second greedy token the model's EOS.
    engine.eos_ids = frozenset({first[1]})
    eos = Request("eos", [256, 1, 2, 3], SamplingParams(max_tokens=6))
    ignored = Request("ignored", [256, 1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    done = drain(engine, {0: [eos, ignored]})[0]
    assert done["eos"].output == first[:2] and done["eos"].finish_reason == "stop"
    assert done["ignored"].output == first and done["ignored"].finish_reason == "length"
