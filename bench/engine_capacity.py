"""What the paged KV cache buys, on this CPU: for one KV budget and bench/tail.py's lognormal lengths, the
sequences the engine keeps running against the maxSeq slots the same bytes would hold (one slot per sequence), the
decode tokens/s at the batch each reaches, sampling's share of a decode step at batch 64 over 32K tokens, and what
one long row costs a batch of short ones (mixed_over_uniform_step: 16 rows at contexts [4096, 64 x 15] over 16 rows
at 316 each, the same KV tokens; paged attention that reads each row's own blocks keeps it near 1).

Prints a table and, last, one JSON line. Not a test: it measures.
  python bench/engine_capacity.py            # 128 sequences, cap 512, budget = 8 maxSeq slots of the bench model
  python bench/engine_capacity.py --quick    # seconds: small model, cap and batch
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingParams, sample
from pat_workers.engine.tiny import PRESETS, make_tiny_model
from pat_workers.sim.lengths import lognormal_lengths

PROMPT_TOKENS = 16  # bench/tail.py's
SAMPLING_BATCH, SAMPLING_VOCAB = 64, 32768
MIXED, UNIFORM = [4096] + [64] * 15, [316] * 16  # the same 5,056 KV tokens
HOST_ROWS = (1, 32, 128)


class OneRankPool:
    """The pool of a one-rank pod: every group is the rank itself, so there is nothing to communicate."""

    rank, world = 0, 1

    def get(self, ranks):
        return SoloCommunicator(0)


def cached_model(models: Path, preset: str, seed: int, **overrides) -> Transformer:
    """A random model of `preset`, built once under `models` (the same folder names as bench/tail.py's)."""
    suffix = "".join(f"-{k.split('_')[0]}{v}" for k, v in sorted(overrides.items()))
    path = models / f"{preset}{suffix}-llama-seed{seed}"
    if not (path / "config.json").is_file():
        make_tiny_model(path, family="llama", preset=preset, seed=seed, **overrides)
    return Transformer(*load_model(path))


def requests(lengths: list[int], seed: int) -> list[Request]:
    """bench/tail.py's requests: distinct prompts, each run to its target length."""
    rng = random.Random(seed)
    return [Request(f"seq-{i}", [256] + [rng.randrange(256) for _ in range(PROMPT_TOKENS - 1)],
                    SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]


def run_capacity(model: Transformer, lengths: list[int], kv_blocks: int, block_size: int, max_seq: int, seed: int
                 ) -> dict:
    """Runs the batch through an engine whose only limit is its blocks; what each step decoded."""
    engine = Engine(model, OneRankPool(), max_batch=len(lengths), max_seq=max_seq, kv_blocks=kv_blocks,
                    block_size=block_size)
    engine.add(requests(lengths, seed))
    batches, contexts, preempted, prefilled, started = [], [], 0, 0, time.perf_counter()
    while engine.has_work():
        stats = engine.step()
        preempted += stats.preempted
        prefilled += stats.prefill_tokens
        if engine.waiting:  # the pool, not the queue, held the batch back: the steady state it sustains
            batches.append(stats.batch)
            contexts += [r.context_len for r in engine.running]
    return {"batches": batches, "contexts": sorted(contexts), "preempted": preempted,
            "seconds": time.perf_counter() - started,
            "recomputed": prefilled - PROMPT_TOKENS * len(lengths)}  # what was prefilled beyond each prompt once


def fluid_limit(lengths: list[int], kv_blocks: int, block_size: int) -> float:
    """Little's law for a pool kept full: sequences running = tokens decoded per step, and the pool's tokens are
    the block-tokens a sequence holds, summed over its decode steps, per token decoded."""
    held = sum(-(-(PROMPT_TOKENS + t) // block_size) * block_size for n in lengths for t in range(1, n + 1))
    return (kv_blocks - 1) * block_size * sum(lengths) / held


def quantiles(values: list[int], n: int) -> list[int]:
    """n values spread like `values` (sorted): a batch whose contexts look like the steady state's."""
    return [values[int((i + 0.5) * len(values) / n)] for i in range(n)]


def decode_engine(model: Transformer, contexts: list[int], block_size: int, max_seq: int, max_batch: int,
                  **params) -> Engine:
    """An engine whose rows are mid-decode at these contexts: blocks granted, nothing to prefill (the cache holds
    zeros, which costs the same as keys)."""
    # Blocks for these rows only: the default sizes the pool for max_batch rows of max_seq tokens.
    engine = Engine(model, OneRankPool(), max_batch=max_batch, max_seq=max_seq, block_size=block_size,
                    kv_blocks=len(contexts) * -(-max_seq // block_size) + 1)
    for i, c in enumerate(contexts):
        r = Request(f"r{i}", [256] * (c - 1), SamplingParams(max_tokens=max_seq, ignore_eos=True, seed=i, **params),
                    output=[1], cached=c - 1)  # the last token is the next step's input
        engine.tables[r.id] = [engine.kv.allocate(engine.blocks_for(r.cached + 1))]  # one rank: one head group
        engine.running.append(r)
    engine.step()  # the rows join the engine's device batch
    return engine


def fastest(*fns, repeats: int) -> list[float]:
    """Each fn's fastest of `repeats` calls, the calls interleaved: this CPU is shared, so the minimum is the
    least disturbed run, and interleaving exposes every fn to the same disturbances."""
    for fn in fns:
        fn()  # warm-up: allocator, first-call paths
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def step_seconds(model: Transformer, batches: list[tuple[list[int], int]], block_size: int, max_seq: int,
                 repeats: int) -> list[float]:
    """Seconds of a whole engine step (host bookkeeping and padding to the batch bucket included) for each
    (contexts, max_batch), the engines' steps interleaved."""
    engines = [decode_engine(model, [min(c, max_seq - repeats - 3) for c in contexts],  # none may finish meanwhile
                             block_size, max_seq, max_batch, temperature=1.0) for contexts, max_batch in batches]
    return fastest(*(e.step for e in engines), repeats=repeats)


def host_seconds(model: Transformer, contexts: list[int], block_size: int, max_seq: int, repeats: int) -> float:
    """A whole engine step's host part: its time less that of the device step inside it (forward and sampling, run
    synchronously on this CPU), the least of `repeats` steps. What is left is the scheduling, the block bookkeeping,
    the device batch's updates and taking in the tokens: on a GPU, the time the device would wait each step."""
    engine = decode_engine(model, contexts, block_size, max_seq, len(contexts), temperature=1.0)
    device_step, device = engine._device_step, []

    def timed(inputs):
        start = time.perf_counter()
        out = device_step(inputs)
        device.append(time.perf_counter() - start)
        return out
    engine._device_step = timed
    host = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - start - device[-1])
    return min(host)


def sampling_share(model: Transformer, contexts: list[int], block_size: int, max_seq: int, repeats: int,
                   **params) -> tuple[float, float]:
    """(decode step seconds, sample seconds): forward + sampling on the device vs sampling alone, same inputs."""
    engine = decode_engine(model, contexts, block_size, max_seq, len(contexts), temperature=1.0, **params)
    inputs = engine.decode_inputs()
    *_, batch, steps = inputs
    logits = 4 * torch.randn(len(contexts), model.cfg.vocab_size)  # the tiny models' logit scale
    step, alone = fastest(lambda: engine._decode(*inputs), lambda: sample(logits, batch, steps), repeats=repeats)
    return step, alone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the test model, a small cap and batch: seconds")
    ap.add_argument("--requests", type=int, default=128, help="sequences (the first 32 are bench/tail.py's batch)")
    ap.add_argument("--cap", type=int, default=512, help="response length cap (tokens)")
    ap.add_argument("--budget", type=int, help="KV bytes (default: 8 maxSeq slots of --preset, float32)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS), help="the model timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=12, help="timed steps; the fastest counts")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "pat" / "models")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.cap, args.preset, args.repeats = 32, 96, "test", 3
    lengths = lognormal_lengths(args.requests, args.cap, args.seed)
    max_seq = PROMPT_TOKENS + args.cap
    model = cached_model(args.models, args.preset, args.seed)
    cfg, element = model.cfg, model.dtype.itemsize
    token_bytes = cfg.kv_bytes_per_token(element)
    budget = args.budget or 8 * max_seq * token_bytes
    slots = budget // (max_seq * token_bytes)
    kv_blocks = budget // PagedKV.block_bytes(cfg, args.block_size, cfg.num_kv_heads, element) + 1  # + scratch
    print(f"model: {args.preset} (hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x "
          f"{cfg.head_dim}, vocab {cfg.vocab_size}), float32, {torch.get_num_threads()} threads; "
          f"KV {token_bytes} B/token; load average {os.getloadavg()[0]:.2f} (the timings share the CPU)")
    print(f"budget: {budget / 2**20:.1f} MiB = {slots} slots of maxSeq {max_seq} = {kv_blocks - 1} blocks of "
          f"{args.block_size} (+1 scratch)")
    print(f"batch: {len(lengths)} sequences, prompt {PROMPT_TOKENS}, lengths min {min(lengths)} / mean "
          f"{sum(lengths) / len(lengths):.0f} / max {max(lengths)} (lognormal, cap {args.cap}), ignore_eos",
          flush=True)

    # Admission and preemption count blocks, and with ignore_eos no token ends a request early: the schedule is
    # the same on any model with the budget's blocks, so it runs on the test model, in seconds (the decode rates
    # below are the timed model's).
    scheduler = model if args.preset == "test" else cached_model(args.models, "test", args.seed)
    cap = run_capacity(scheduler, lengths, kv_blocks, args.block_size, max_seq, args.seed)
    if not cap["batches"]:
        raise SystemExit("the queue never waited: raise --requests or lower --budget")
    peak, mean, median = max(cap["batches"]), statistics.mean(cap["batches"]), statistics.median(cap["batches"])
    limit = fluid_limit(lengths, kv_blocks, args.block_size)
    context = statistics.mean(cap["contexts"])

    # Each at the max_batch its engine would run with: the slots' count, the paged run's (its rows padded to the
    # next power of two, as the engine does).
    paged = round(mean)
    step_slots, step_paged = step_seconds(model, [(quantiles(cap["contexts"], slots), slots),
                                                  (quantiles(cap["contexts"], paged), len(lengths))],
                                          args.block_size, max_seq, args.repeats)
    tps_slots, tps_paged = slots / step_slots, paged / step_paged

    host = {n: host_seconds(model, [316] * n, args.block_size, max_seq=512, repeats=args.repeats)
            for n in HOST_ROWS}
    mixed, uniform = step_seconds(model, [(MIXED, len(MIXED)), (UNIFORM, len(UNIFORM))], args.block_size,
                                  max(MIXED) + args.repeats + 3, args.repeats)

    big = cached_model(args.models, args.preset, args.seed, vocab_size=SAMPLING_VOCAB)
    rows = quantiles(cap["contexts"], SAMPLING_BATCH)
    step_t, sample_t = sampling_share(big, rows, args.block_size, max_seq, args.repeats)
    step_p, sample_p = sampling_share(big, rows, args.block_size, max_seq, args.repeats, top_p=0.9)

    print(f"\ncapacity (scheduler {cap['seconds']:.1f} s, {len(cap['batches'])} steps with a waiting queue; "
          f"{cap['preempted']} preemptions, {cap['recomputed']} tokens recomputed = "
          f"{cap['recomputed'] / sum(lengths):.1%} of those generated)")
    print(f"  maxSeq slots            {slots:7d}")
    print(f"  paged, peak             {peak:7d}")
    print(f"  paged, mean             {mean:7.1f}   {mean / slots:.2f}x the slots (target >= 4x); "
          f"mean context {context:.0f} tokens")
    print(f"  paged, median           {median:7.1f}   {median / slots:.2f}x")
    print(f"  paged, fluid limit      {limit:7.1f}   {limit / slots:.2f}x (Little's law for a pool kept full)")
    print(f"\ndecode, {args.preset} model, whole engine steps at the steady state's contexts "
          f"(fastest of {args.repeats})")
    print(f"  {'':22s} {'batch':>7s} {'step ms':>8s} {'tokens/s':>9s}")
    print(f"  {'maxSeq slots':22s} {slots:7d} {1e3 * step_slots:8.1f} {tps_slots:9.1f}")
    print(f"  {'paged (mean batch)':22s} {paged:7d} {1e3 * step_paged:8.1f} {tps_paged:9.1f}")
    print("\nhost time of a decode step (engine step less its device step alone, 316 tokens per row): " + ", ".join(
        f"{n} rows {1e3 * host[n]:.2f} ms" for n in HOST_ROWS))
    print(f"\none long row among short ones, {args.preset} model, whole engine steps (fastest of {args.repeats})")
    print(f"  {'contexts [4096, 64 x 15]':26s} {1e3 * mixed:8.1f} ms")
    print(f"  {'contexts [316 x 16]':26s} {1e3 * uniform:8.1f} ms   mixed / uniform {mixed / uniform:.2f} "
          f"(target <= 1.3)")
    print(f"\nsampling, {args.preset} model with vocab {SAMPLING_VOCAB}, batch {SAMPLING_BATCH} "
          f"(forward + sample vs sample alone, fastest of {args.repeats})")
    print(f"  {'':22s} {'step ms':>8s} {'sample ms':>9s} {'share':>7s}")
    print(f"  {'temperature 1':22s} {1e3 * step_t:8.1f} {1e3 * sample_t:9.2f} {sample_t / step_t:7.1%}"
          f"   (target <= 5%)")
    print(f"  {'+ top_p 0.9 (sort)':22s} {1e3 * step_p:8.1f} {1e3 * sample_p:9.2f} {sample_p / step_p:7.1%}")

    print(json.dumps({
        "slots_sequences": slots, "paged_sequences_peak": peak, "paged_sequences_mean": round(mean, 2),
        "paged_sequences_median": median, "paged_sequences_fluid_limit": round(limit, 2),
        "capacity_ratio": round(mean / slots, 3),
        "preemptions": cap["preempted"], "recomputed_tokens": cap["recomputed"], "mean_context": round(context, 1),
        "tokens_per_s_slots": round(tps_slots, 2), "tokens_per_s_paged": round(tps_paged, 2),
        "step_ms_slots": round(1e3 * step_slots, 2), "step_ms_paged": round(1e3 * step_paged, 2),
        "mixed_over_uniform_step": round(mixed / uniform, 3), "step_ms_mixed": round(1e3 * mixed, 2),
        "step_ms_uniform": round(1e3 * uniform, 2),
        **{f"host_ms_{n}_rows": round(1e3 * host[n], 3) for n in HOST_ROWS},
        "sampling_share": round(sample_t / step_t, 4), "sampling_share_top_p": round(sample_p / step_p, 4),
        "budget_bytes": budget, "block_size": args.block_size, "max_seq": max_seq, "preset": args.preset,
        "requests": len(lengths), "cap": args.cap, "sampling_batch": SAMPLING_BATCH,
        "sampling_vocab": SAMPLING_VOCAB, "repeats": args.repeats, "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
