"""The simulator against the engine: bench/tail.py's scenario (one long-tailed batch on 2 CPU ranks), predicted by
`pat simulate`'s event loop from the CPU profile the engine measures at start, then run for real: fixed DP,
fixed TP and adaptive (the planner as bench/tail.py runs it), each --repeats times in alternating order (this VM
varies by 10% between identical runs; the median counts). Prints predicted vs measured generation time per
policy and, last, one JSON line with prediction_error (the largest relative error). Not a test: it measures.

  python bench/sim_vs_real.py                 # 32 sequences, cap 384, 3 runs each (~5 minutes on 2 cores)
  python bench/sim_vs_real.py --quick         # 16 sequences, cap 96, 1 run each
  python bench/sim_vs_real.py --save-profile cpu.json   # then: pat simulate JOB.yaml --hardware cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tail import (PROMPT_TOKENS, REGROUP_FIXED_SECONDS, decode_steps, medians, model_and_options, planner_inputs,
                  requests, run_alternating)

from pat_operator.layout import describe, uniform
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.tiny import PRESETS
from pat_workers.revision import stamp
from pat_workers.sim.hardware import EngineCosts, Measured
from pat_workers.sim.lengths import lognormal_lengths
from pat_workers.sim.simulate import Scenario, fixed, pod_planner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 sequences, cap 96, one run each: about a minute")
    ap.add_argument("--repeats", type=int, default=3, help="real runs of each policy, in alternating order")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=int, default=384, help="response length cap (tokens)")
    ap.add_argument("--world", type=int, default=2, help="ranks (CPU cores)")
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-gain", type=float, default=0.1, help="the planner's margin")
    ap.add_argument("--save-profile", type=Path, help="write the measured CPU profile here (Costs.to_json)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.cap, args.repeats = 16, 96, 1
    lengths = lognormal_lengths(args.batch, args.cap, args.seed)
    model_dir, _, options = model_and_options(args.preset, args.seed, None, lengths, args.world)
    print(f"model: {args.preset}, float32, {args.world} ranks x 1 thread; batch: {len(lengths)} sequences, mean "
          f"{sum(lengths) / len(lengths):.0f} / max {max(lengths)} tokens", flush=True)

    with LocalGenerator(model_dir, args.world, options) as gen:
        profile_json = stamp(gen.costs.to_json(options.dtype, f"{args.preset} on this machine's CPU, {args.world} "
                                               f"ranks"))  # the engine's revision: pat simulate reads no other
        if args.save_profile:
            args.save_profile.write_text(json.dumps(profile_json, indent=2))
        costs = Measured(EngineCosts.from_json(profile_json, "the engine"), gen.config.kv_bytes_per_token(4))
        # The real adaptive run plans after every step (Planned): plan() takes no simulated time here either.
        scenario = Scenario(tuple(lengths), PROMPT_TOKENS, max(lengths), args.world, options.max_batch,
                            tuple(gen.tp_sizes), tuple(lengths), margin=args.min_gain, plan_seconds=0.0,
                            regroup_fixed_seconds=REGROUP_FIXED_SECONDS)
        predicted = {"fixed DP": fixed(scenario, costs, 1), "fixed TP": fixed(scenario, costs, args.world),
                     "adaptive": pod_planner(scenario, costs)}
        for name, r in predicted.items():
            print(f"  predicted {name:9s} {r.seconds:7.2f} s  {describe(r.start_layout)} "
                  f"{' '.join('-> ' + describe(new) for _, _, new, _ in r.regroups)}", flush=True)

        *planner_args, first = planner_inputs(gen, lengths, args.min_gain)
        print(f"measured, {args.repeats} run(s) each (the median counts):", flush=True)
        configs = [("fixed DP", uniform(args.world), None), ("fixed TP", uniform(args.world, args.world), None),
                   ("adaptive", first, math.inf)]
        runs = run_alternating(gen, configs, args.repeats, lambda: requests(lengths, args.seed),
                               (*planner_args, args.min_gain))
    measured = medians(runs)

    errors = {name: predicted[name].seconds / measured[name].seconds - 1 for name in predicted}
    # Where an error comes from: the decode steps the runs took against what the profile measured at start predicts
    # for their batch and context.
    def predicted_step(s) -> float:
        base, per_context = costs.decode(len(s.group), s.batch)
        return base + per_context * s.context

    steps = {f"tp{tp} batch {batch}": [round(1e3 * sum(map(predicted_step, ss)) / len(ss), 1),
                                       round(1e3 * sum(s.seconds for s in ss) / len(ss), 1)]
             for (tp, batch), ss in sorted(decode_steps(r for rs in runs.values() for r in rs).items())}
    print("decode step ms, predicted from the profile measured at start vs taken in the runs: "
          + ", ".join(f"{k}: {a} vs {b}" for k, (a, b) in steps.items()))
    print(f"\n{'policy':10s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s}")
    for name in predicted:
        print(f"{name:10s} {predicted[name].seconds:11.2f} {measured[name].seconds:10.2f} {errors[name]:+7.1%}")
    print(json.dumps({
        "prediction_error": round(max(abs(e) for e in errors.values()), 4),
        "predicted_seconds": {k: round(r.seconds, 3) for k, r in predicted.items()},
        "measured_seconds": {k: round(r.seconds, 3) for k, r in measured.items()},
        "relative_error": {k: round(e, 4) for k, e in errors.items()},
        "regroups": {"predicted": [[describe(o), describe(n), round(t, 3)]
                                   for t, o, n, _ in predicted["adaptive"].regroups],
                     "measured": [[describe(r.old), describe(r.new), round(r.time, 3)]
                                  for r in measured["adaptive"].regroups]},
        "batch": len(lengths), "cap": max(lengths), "world": args.world, "preset": args.preset,
        "repeats": args.repeats,
        "decode_step_ms_profiled_vs_run": steps,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
