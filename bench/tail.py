"""One long-tailed rollout batch, side by side on the same ranks: fixed DP (world x TP1), fixed TP=world,
adaptive (the planner picks the starting layout at the batch boundary and merges groups during the batch,
from the measured step profile), and tail-only (starts at DP; the planner acts only once at most a quarter of
the batch is left, which isolates a regroup of long sequences in the tail).

Prints a table and, last, one JSON line. Not a test: it measures.
  python bench/tail.py            # cap 512 tokens, 32 sequences, 2 ranks
  python bench/tail.py --quick    # under a minute
  python bench/tail.py --lengths lengths.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from pat_operator import planner
from pat_operator.layout import Layout, describe, uniform
from pat_workers.engine.engine import Request
from pat_workers.engine.generator import LocalGenerator, RunResult, StepRecord
from pat_workers.engine.rank import EngineOptions
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import PRESETS, make_tiny_model
from pat_workers.sim.lengths import lognormal_lengths

PROMPT_TOKENS = 16
REGROUP_FIXED_SECONDS = 0.02  # barrier + commit + bookkeeping of a regroup on local ranks, beyond moving KV


def requests(lengths: list[int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"seq-{i}", [256] + [rng.randrange(256) for _ in range(PROMPT_TOKENS - 1)],
                    SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]


def tail_seconds(result: RunResult, total: int) -> float:
    """Time from the moment half of the sequences have finished to the end of the batch."""
    done = 0
    for step in result.steps:
        done += step.finished
        if done * 2 >= total:
            return result.seconds - step.time
    return 0.0


class Planned:
    """The planner as the pod's coordinator runs it during one batch: a Controller asked after every step, the
    profile refined from the decode steps it sees.

    The generator reports counts per group, not each request's progress: every request of the batch is submitted
    at once and a group adds one token per request per step, so a request's generated tokens are taken to be
    the steps its group's first rank has run in this batch.
    """

    def __init__(self, gen: LocalGenerator, profile: planner.Profile, predictor: planner.LengthPredictor,
                 costs: planner.RegroupCosts, margin: float, tail: float = math.inf):
        self.profile, self.predictor, self.costs = profile, predictor, costs
        self.controller = planner.Controller(gen.tp_sizes, margin)
        self.steps = [0] * gen.world  # decode steps each rank has run in this batch
        self.tail = tail  # act only once at most this many requests are left

    def on_step(self, step: StepRecord) -> None:
        if step.batch:
            for rank in step.group:
                self.steps[rank] += 1
            self.controller.step()  # a step of any group counts toward the cooldown
        if step.batch and not step.prefill_tokens:  # the guard and the profile's refinement see decode steps
            self.controller.observe(step.group, step.batch, step.seconds, step.context, self.profile)

    def __call__(self, g: LocalGenerator) -> Layout | None:
        loads = g.loads()
        if sum(loads.values()) > self.tail:
            return None
        running = {grp: [(PROMPT_TOKENS + self.steps[grp[0]], self.steps[grp[0]])] * n for grp, n in loads.items()}
        decision = self.controller.decide(g.layout, running, self.profile, self.predictor, self.costs)
        if decision.layout:
            self.controller.regrouped()  # run() applies it before the next step
        return decision.layout


def model_and_options(preset: str, seed: int, model_dir: Path | None, lengths: list[int], world: int
                      ) -> tuple[Path, dict, EngineOptions]:
    """The model (a cached random one of `preset` unless model_dir), its config.json, and the engine options of
    the benchmark: a replica holds its share of the batch at once."""
    model_dir = model_dir or Path.home() / ".cache" / "pat" / "models" / f"{preset}-llama-seed{seed}"
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, family="llama", preset=preset, seed=seed)
    per_replica = math.ceil(len(lengths) / world)
    options = EngineOptions(max_batch=per_replica, max_seq=PROMPT_TOKENS + max(lengths) + 1,
                            profile_batches=tuple(sorted({1, 2, 4, 8, 16, 32, per_replica, len(lengths)})))
    return model_dir, json.loads((model_dir / "config.json").read_text()), options


def planner_inputs(gen: LocalGenerator, lengths: list[int], min_gain: float
                   ) -> tuple[planner.Profile, planner.LengthPredictor, planner.RegroupCosts, Layout]:
    """The planner's inputs from the ranks' measured costs, and the layout it starts the batch in."""
    profile = planner.Profile.measured(gen.costs)  # refined online by every planned run
    # The batch's own lengths stand in for earlier iterations' (RLHF length distributions drift slowly).
    predictor = planner.LengthPredictor(max(lengths))
    predictor.observe(lengths)
    element_size = 2 if gen.options.dtype in ("bfloat16", "float16") else 4
    costs = planner.RegroupCosts.measured(REGROUP_FIXED_SECONDS, gen.config.kv_bytes_per_token(element_size),
                                          gen.costs.link_bytes_per_s, gen.costs.prefill)
    # At the batch boundary the planner also picks the layout the batch starts in, from its size.
    first = planner.Controller(gen.tp_sizes, min_gain).start_batch(
        gen.world, [PROMPT_TOKENS] * len(lengths), profile, predictor, costs).layout or uniform(gen.world)
    return profile, predictor, costs, first


def run_alternating(gen: LocalGenerator, configs: list[tuple[str, Layout, float | None]], repeats: int,
                    batch: Callable[[], list[Request]], planner_args: tuple) -> dict[str, list[RunResult]]:
    """Each config (name, the layout it starts in, plan once at most this many requests are left, None: never)
    runs a fresh batch() `repeats` times, in alternating order so that drift over time favours no one."""
    runs: dict[str, list[RunResult]] = defaultdict(list)
    for repeat in range(repeats):
        for name, start, tail in configs if repeat % 2 == 0 else configs[::-1]:
            gen.regroup(start)  # at the batch boundary: no requests, nothing to move
            policy = Planned(gen, *planner_args, tail) if tail is not None else None
            runs[name].append(gen.run(batch(), policy=policy, on_step=policy.on_step if policy else None))
            print(f"  {name:9s} {runs[name][-1].seconds:7.2f} s {describe(start)} "
                  f"{' '.join('-> ' + describe(r.new) for r in runs[name][-1].regroups)}", flush=True)
    return runs


def medians(runs: dict[str, list[RunResult]]) -> dict[str, RunResult]:
    """Per config, the run with the median generation time."""
    return {name: sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for name, rs in runs.items()}


def decode_steps(results: Iterable[RunResult]) -> dict[tuple[int, int], list[StepRecord]]:
    """The decode steps (no prefill in them) by (TP, batch rounded down to a power of two)."""
    by_shape: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
    for r in results:
        for s in r.steps:
            if s.batch and not s.prefill_tokens:
                by_shape[(len(s.group), 2 ** int(math.log2(s.batch)))].append(s)
    return by_shape


def mismatched_tokens(a: RunResult, b: RunResult) -> int:
    count = 0
    for rid, ca in a.completions.items():
        cb = b.completions[rid].output
        count += sum(x != y for x, y in zip(ca.output, cb)) + abs(len(ca.output) - len(cb))
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small batch and cap: finishes in under a minute")
    ap.add_argument("--lengths", type=Path, help="JSON list of target response lengths (overrides --batch/--cap)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=int, default=512, help="response length cap (tokens)")
    ap.add_argument("--world", type=int, default=2, help="ranks (CPU cores)")
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each layout, in alternating order")
    ap.add_argument("--min-gain", type=float, default=0.1,
                    help="planner margin: required predicted gain, a fraction of the remaining generation time")
    ap.add_argument("--model-dir", type=Path, help="default: a cached random model of --preset")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.cap, args.repeats = 16, 96, 1
    lengths = json.loads(args.lengths.read_text()) if args.lengths else lognormal_lengths(args.batch, args.cap,
                                                                                         args.seed)
    model_dir, cfg, options = model_and_options(args.preset, args.seed, args.model_dir, lengths, args.world)
    print(f"model: {args.preset} (hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
          f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} "
          f"KV heads, vocab {cfg['vocab_size']}), float32, {args.world} ranks x 1 thread")
    print(f"batch: {len(lengths)} sequences, lengths min {min(lengths)} / mean {sum(lengths) / len(lengths):.0f} "
          f"/ max {max(lengths)} tokens, greedy, ignore_eos", flush=True)

    started = time.perf_counter()
    with LocalGenerator(model_dir, args.world, options) as gen:
        print(f"ranks up and profiled in {time.perf_counter() - started:.1f} s; link "
              f"{gen.costs.link_bytes_per_s / 1e9:.2f} GB/s", flush=True)
        dp, tp = uniform(args.world), uniform(args.world, args.world)

        profile, predictor, costs, first = planner_inputs(gen, lengths, args.min_gain)
        print(f"planner: the batch starts at layout {first}", flush=True)

        # (name, starting layout, plan once at most this many requests are left; None: never). Tail-only is
        # PAT's trigger alone: act once at most a quarter of the batch is left.
        configs = [("fixed DP", dp, None), ("fixed TP", tp, None), ("adaptive", first, math.inf),
                   ("tail-only", dp, len(lengths) / 4)]
        runs = run_alternating(gen, configs, args.repeats, lambda: requests(lengths, args.seed),
                               (profile, predictor, costs, args.min_gain))
    results = medians(runs)
    means = {name: sum(r.seconds for r in rs) / len(rs) for name, rs in runs.items()}

    print(f"\n{'layout':10s} {'gen s':>8s} {'mean s':>8s} {'tail s':>8s} {'regroups':>8s} {'regroup s':>9s}"
          f"   (the median of {args.repeats} run(s); mean over all)")
    for name, r in results.items():
        print(f"{name:10s} {r.seconds:8.2f} {means[name]:8.2f} {tail_seconds(r, len(lengths)):8.2f} "
              f"{len(r.regroups):8d} {sum(x.seconds for x in r.regroups):9.3f}")
    by_shape = decode_steps(r for rs in runs.values() for r in rs)
    print("\ndecode step latency, ms (mean over steps without prefill), by TP and batch size (bucket = lower "
          "power of two):")
    buckets = sorted({b for _, b in by_shape})
    print("tp \\ batch " + "".join(f"{b:>8d}" for b in buckets))
    for t in sorted({t for t, _ in by_shape}):
        cells = [by_shape.get((t, b)) for b in buckets]
        print(f"{t:<11d}" + "".join(f"{1e3 * sum(s.seconds for s in c) / len(c):8.1f}" if c else f"{'-':>8s}"
                                    for c in cells))
    modes: dict[str, list[float]] = defaultdict(list)
    for rec in (rec for name in ("adaptive", "tail-only") for rec in results[name].regroups):
        print(f"\nregroup at {rec.time:.2f} s: {rec.old} -> {rec.new}")
        for rep in rec.reports:
            print(f"  rank {rep.rank} group {rep.group}: {rep.outcome}, requests {rep.modes}, "
                  f"seconds {{{', '.join(f'{k}: {v:.4f}' for k, v in rep.seconds.items())}}}, sent {rep.kv_bytes} B")
            for mode, seconds in rep.seconds.items():
                modes[mode].append(seconds)
    reference = runs["fixed DP"][0]
    summary = {
        "adaptive_over_fixed_dp": round(means["adaptive"] / means["fixed DP"], 4),
        "adaptive_over_fixed_tp": round(means["adaptive"] / means["fixed TP"], 4),
        "adaptive_over_best_fixed": round(means["adaptive"] / min(means["fixed DP"], means["fixed TP"]), 4),
        "regroup_fraction": round(max(sum(x.seconds for x in r.regroups) / r.seconds
                                      for r in runs["adaptive"] + runs["tail-only"]), 5),
        "adaptive_start_layout": list(first),
        "token_mismatches": max(mismatched_tokens(r, reference) for r in runs["adaptive"] + runs["tail-only"]),
        "tail_only_over_fixed_dp": round(means["tail-only"] / means["fixed DP"], 4),
        "fixed_tp_token_mismatches": max(mismatched_tokens(r, reference) for r in runs["fixed TP"]),
        "generation_seconds": {k: [round(r.seconds, 3) for r in rs] for k, rs in runs.items()},
        "tail_seconds": {k: round(tail_seconds(v, len(lengths)), 3) for k, v in results.items()},
        "regroup_seconds_by_mode": {k: round(sum(v), 4) for k, v in modes.items()},
        "regroups": {name: [[list(r.old), list(r.new), round(r.time, 3)] for r in results[name].regroups]
                     for name in ("adaptive", "tail-only")},
        "batch": len(lengths), "cap": max(lengths), "world": args.world, "preset": args.preset,
        "repeats": args.repeats,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
