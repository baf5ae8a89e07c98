"""Continuous batching on one rank: requests join and leave between steps; each one's tokens are what it
would get alone."""

import dataclasses
import os

import pytest

from pat_workers.engine.batch import DecodeBatch
from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import mixed_requests

from .conftest import fresh, make_requests, mismatches


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


def test_a_full_pool_preempts_the_newest_and_recomputes_it(model):
    """A pool of one max_seq sequence (12 blocks of 16 tokens + scratch) for 8 requests: the newest are preempted
    back to the queue and re-prefilled later, and every request still gets the tokens it gets alone."""
    requests = [Request(r.id, r.prompt, dataclasses.replace(r.params, max_tokens=60 + 5 * i))
                for i, r in enumerate(make_requests(8))]
    alone = {}
    for r in fresh(requests):
        alone.update(drain(Engine(model, OneRankPool(), max_batch=8, max_seq=192), {0: [r]})[0])
    engine = Engine(model, OneRankPool(), max_batch=8, max_seq=192, kv_blocks=13)
    preempted, done = 0, {}
    engine.add(fresh(requests))
    while engine.has_work():
        stats = engine.step()
        preempted += stats.preempted
        done.update((r.id, r) for r in stats.finished)
        assert engine.kv.free_blocks >= 0 and engine.kv.refs[0] == 1
    assert preempted > 0
    assert not mismatches(alone, done)
    assert engine.kv.free_blocks == 12 and not engine.tables  # every block came back


def rebuilt(engine: Engine) -> DecodeBatch:
    """The device batch built at once from the engine's request lists: what the kept one must equal."""
    batch = DecodeBatch(engine.capacity, engine.head_groups, engine.blocks_per_seq, engine.kv.block_size,
                        engine.model.cfg.vocab_size, engine.model.device)
    batch.add(engine.running, engine.tables)
    return batch


def test_the_device_batch_changes_in_place_and_equals_one_built_from_the_requests(model, monkeypatch):
    """Rows join (sharing a prompt), grow into new blocks, finish and are preempted: after every step the kept
    batch, padding slots included, is the one the request lists give. A step looks at a row on the host only when
    it joins or its next position starts a block."""
    requests = [Request(r.id, r.prompt, dataclasses.replace(r.params, max_tokens=30 + 7 * i, temperature=1.0,
                                                            top_k=8 * (i % 3), seed=i))
                for i, r in enumerate(make_requests(8))]
    requests += [Request(f"share{k}", requests[0].prompt, SamplingParams(max_tokens=20, seed=k)) for k in range(2)]
    engine = Engine(model, OneRankPool(), max_batch=6, max_seq=192, kv_blocks=13)
    looked_at = []
    writable = engine._writable
    monkeypatch.setattr(engine, "_writable", lambda r: looked_at.append((r.id, r.cached)) or writable(r))
    engine.add(requests[:4])
    steps = preempted = looks = rows = 0
    while engine.has_work():
        if steps == 3:
            engine.add(requests[4:])
        looked_at.clear()
        before = {r.id: r.cached for r in engine.running if r.cached}
        stats = engine.step()
        steps, preempted = steps + 1, preempted + stats.preempted
        kept, fresh_batch = engine._batch, rebuilt(engine)
        assert [r.id for r in kept.rows] == [r.id for r in engine.running]
        for a, b in zip((*kept._device(), kept.cached), (*fresh_batch._device(), fresh_batch.cached)):
            assert a.equal(b), steps
        assert kept._needs == fresh_batch._needs
        # Rows already decoding are looked at only at a block boundary.
        assert all(c % 16 == 0 for rid, c in looked_at if rid in before), (steps, looked_at)
        looks, rows = looks + len(looked_at), rows + stats.batch
    assert steps > 30 and preempted > 0 and looks < rows / 5, (looks, rows)


def test_too_small_a_pool_is_refused(model):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_seq=192"):
        Engine(model, OneRankPool(), max_batch=8, max_seq=192, kv_blocks=12)


def test_samples_of_one_prompt_share_its_prefill_and_blocks(model):
    """G samples per prompt: each prompt is prefilled once, its blocks are shared until a sample writes into one
    (copy on write), and every sample gets what it gets with a prefill of its own."""
    prompts = [[256] + [(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((20, 31, 47))]  # 32: a full block
    requests = [Request(f"p{i}-s{k}", p, SamplingParams(max_tokens=12 + 5 * k, temperature=1.0, seed=k, top_k=40 * k))
                for i, p in enumerate(prompts) for k in range(4)]
    alone = {}
    for r in fresh(requests):
        alone.update(drain(Engine(model, OneRankPool(), max_batch=8, max_seq=192), {0: [r]})[0])
    engine = Engine(model, OneRankPool(), max_batch=16, max_seq=192)
    engine.add(fresh(requests))
    stats = engine.step()
    assert stats.prefill_tokens == sum(map(len, prompts))  # once per prompt, not once per sample
    shared = sum(ref > 1 for ref in engine.kv.refs[1:])
    assert shared == sum(len(p) // 16 for p in prompts)  # full prompt blocks stay shared; partial ones were copied
    done = {r.id: r for r in stats.finished}
    while engine.has_work():
        done.update((r.id, r) for r in engine.step().finished)
    assert not mismatches(alone, done)
    assert len({tuple(done[f"p0-s{k}"].output[:12]) for k in range(4)}) == 4  # the seeds differ: so do the samples


def test_decode_step_compiles_as_one_graph_and_equals_eager(model):
    """The decode step (forward over the block tables + sampling) has no graph break and no host sync:
    torch.compile(fullgraph=True) takes it whole (compile_step), and a whole run gives eager mode's tokens and
    log-probabilities as the batch shrinks."""
    requests = make_requests(6)
    eager = drain(Engine(model, OneRankPool(), max_batch=8, max_seq=192), {0: fresh(requests)})[0]
    compiled_engine = Engine(model, OneRankPool(), max_batch=8, max_seq=192, compile_step=True)
    compiled = drain(compiled_engine, {0: fresh(requests)})[0]
    assert compiled_engine.decode_fn is not compiled_engine._decode
    assert mismatches(eager, compiled) == []


def test_kv_budget_is_checked_before_memory_is_taken(model, model_dir):
    """The pool's size comes from the device's memory before the weights are loaded, as pat plan counts it; too
    little for one maxSeq sequence, or a maxSeq beyond the model's positions, is an error naming the spec field."""
    from pat_operator.fit import read_shape
    from pat_workers.engine.rank import EngineOptions, kv_cache_blocks

    cfg, shape, gib = model.cfg, read_shape(model_dir / "config.json"), 1 << 30
    opts = EngineOptions(max_batch=8, max_seq=192)
    block = PagedKV.block_bytes(cfg, 16, cfg.num_kv_heads // 4, 4)
    assert kv_cache_blocks(opts, cfg, shape, 4, 64 * gib, 64 * gib) == 8 * 12 * 4 + 1  # capped at maxBatch sequences
    explicit = dataclasses.replace(opts, kv_cache_bytes=100 * block)
    assert kv_cache_blocks(explicit, cfg, shape, 4, 0, 0) == 101
    with pytest.raises(ValueError, match=r"kv-cache-bytes.*generator.maxSeq=192.*raise --kv-cache-bytes"):
        kv_cache_blocks(dataclasses.replace(opts, kv_cache_bytes=47 * block), cfg, shape, 4, 64 * gib, 64 * gib)
    tight = dataclasses.replace(opts, memory_utilization=0.0001)
    with pytest.raises(ValueError, match=r"generator.memoryUtilization=0.0001 of 1.00 GiB .*raise generator.memory"):
        kv_cache_blocks(tight, cfg, shape, 4, gib, gib)
    with pytest.raises(ValueError, match=r"generator.maxSeq=9000 is beyond the model's max_position_embeddings"):
        kv_cache_blocks(dataclasses.replace(opts, max_seq=9000), cfg, shape, 4, 64 * gib, 64 * gib)


@pytest.mark.slow
def test_a_pod_whose_cache_cannot_hold_a_sequence_fails_at_start(model_dir):
    from pat_workers.engine.generator import GeneratorError, LocalGenerator
    from pat_workers.engine.rank import EngineOptions

    options = EngineOptions(max_batch=4, max_seq=192, kv_cache_bytes=4096, device="cpu", profile_batches=(1,))
    with pytest.raises(GeneratorError, match=r"one sequence of generator.maxSeq=192 tokens needs"):
        LocalGenerator(model_dir, 1, options).start()


@pytest.mark.slow
def test_a_pods_preemptions_and_kv_usage_are_metrics(model, model_dir):
    """A pod whose KV cache holds one maxSeq sequence: the preemptions it makes, and how full its cache is, are
    Prometheus metrics (what a vLLM user reads as num_preemptions and kv_cache_usage)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pat_workers.engine.generator import LocalGenerator
    from pat_workers.engine.rank import EngineOptions

    cfg = model.cfg
    budget = 12 * PagedKV.block_bytes(cfg, 16, cfg.num_kv_heads, 4)  # one rank: a block holds every head
    options = EngineOptions(max_batch=8, max_seq=192, kv_cache_bytes=budget, device="cpu", profile_batches=(1,))
    requests = [Request(r.id, r.prompt, dataclasses.replace(r.params, max_tokens=60 + 5 * i))
                for i, r in enumerate(make_requests(8))]
    usage = []
    with LocalGenerator(model_dir, 1, options) as gen:
        gen.run(fresh(requests), on_step=lambda _: usage.append(gen.metrics.kv_usage.labels("0-0")._value.get()))
        text = generate_latest(gen.metrics.registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["pat_generator_preemptions_total"] > 0
    assert max(usage) > 0.9 and samples['pat_generator_kv_cache_usage'] == 0  # full while it ran, empty at the end


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("release", [True, False])
def test_the_kv_pool_is_given_back_between_batches(model, release):
    """After a batch the engine releases its KV pool (RSS falls by the pool's size) and takes it back before the
    next; ten rounds leave RSS where the first left it and the tokens unchanged. The negative control keeps the
    pool: RSS does not fall."""
    engine = Engine(model, OneRankPool(), max_batch=8, max_seq=192, kv_blocks=24_000)  # a 96 MiB pool
    pool = engine.kv.nbytes
    assert pool > 64 << 20
    requests = mixed_requests(4, longest=12)
    reference = drain(engine, {0: fresh(requests)})[0]
    rss = []
    for _ in range(10 if release else 3):
        if release:
            engine.release_memory()
        low = _rss()
        if release:
            engine.acquire_memory()
        done = drain(engine, {0: fresh(requests)})[0]
        assert {i: r.output for i, r in done.items()} == {i: r.output for i, r in reference.items()}
        rss.append((low, _rss()))
    freed = [high - low for low, high in rss]
    if release:
        assert min(freed) > 0.9 * pool, f"released {min(freed) >> 20} MiB of a {pool >> 20} MiB pool"
        assert rss[-1][1] - rss[0][1] < 16 << 20, f"RSS grew {(rss[-1][1] - rss[0][1]) >> 20} MiB over 10 rounds"
    else:
        assert max(freed) < 0.1 * pool
    with pytest.raises(RuntimeError, match="between batches"):
        engine.add(fresh(make_requests(1)))
        engine.release_memory()
