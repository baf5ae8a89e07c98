"""The policies side by side: iteration latency (generation + training), the table, PNG plots and one JSON object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pat_operator.fit import GPU, ModelShape
from pat_operator.layout import describe

from ..report import save_figure
from .hardware import StepCosts
from .simulate import POLICIES, Result, Scenario, adaptive_pod, fixed

FLOPS_PER_PARAM_TOKEN = 8  # policy forward + backward (6) and one more forward for the old/reference logprobs (2)


@dataclass(frozen=True)
class Trainer:
    """Training time is modelled, not simulated: FLOPs at a stated MFU (an assumption) on the trainer's GPUs."""
    gpu: GPU
    gpus: int
    mfu: float = 0.4

    def seconds(self, shape: ModelShape, tokens: int) -> float:
        return FLOPS_PER_PARAM_TOKEN * shape.params * tokens / (self.gpus * self.gpu.bf16_flops * self.mfu)

    def describe(self) -> str:
        return (f"{FLOPS_PER_PARAM_TOKEN} x params x tokens at {self.mfu:.0%} MFU on {self.gpus} x {self.gpu.name} "
                f"(assumed)")


def compare(scenario: Scenario, costs: StepCosts, engine: str = "pat") -> list[Result]:
    """Every fixed TP size, then the planner as the pod and as the operator run it, then the oracle, on pods of
    `engine` (simulate.adaptive_pod)."""
    adaptive = adaptive_pod(scenario, costs, engine)
    return [fixed(scenario, costs, tp) for tp in scenario.tp_sizes] + [policy(*adaptive)
                                                                        for policy in POLICIES.values()]


def summary(results: list[Result], scenario: Scenario, planner_policy: str, train_seconds: float,
            about: dict[str, Any], verl_tp: int | None) -> dict[str, Any]:
    """The JSON object: per policy its times, and the planner (`planner_policy`) against the best fixed layout,
    verl's default rollout layout (fixed TP `verl_tp`; None: no such layout here) and the oracle."""
    by_name = {r.policy: r for r in results}
    best = min((r for r in results if r.policy.startswith("fixed")), key=lambda r: r.seconds)
    verl = by_name.get(f"fixed TP{verl_tp}")
    ours, oracle = by_name[planner_policy], by_name["oracle"]

    def reduction(base: Result | None, extra: float = 0.0) -> float | None:
        return None if base is None else round(1 - (ours.seconds + extra) / (base.seconds + extra), 4)

    return {
        "simulated": True, **about,
        "responses": len(scenario.lengths), "world": scenario.world,
        "mean_response_tokens": round(sum(scenario.lengths) / len(scenario.lengths), 1),
        "response_cap": scenario.max_tokens, "train_seconds": round(train_seconds, 3),
        "policies": {r.policy: {"generation_seconds": round(r.seconds, 3),
                                "iteration_seconds": round(r.seconds + train_seconds, 3),
                                "regroups": [[describe(old), describe(new), round(at, 3), round(took, 4)]
                                             for at, old, new, took in r.regroups],
                                "start_layout": describe(r.start_layout), "plans": r.plans} for r in results},
        "best_fixed": best.policy, "verl_default": verl.policy if verl else None, "planner": planner_policy,
        "generation_reduction_vs_best_fixed": reduction(best),
        "iteration_reduction_vs_best_fixed": reduction(best, train_seconds),
        "generation_reduction_vs_verl_default": reduction(verl),
        "iteration_reduction_vs_verl_default": reduction(verl, train_seconds),
        "planner_over_oracle": round(ours.seconds / oracle.seconds, 4),
        "generation_reduction_vs": {r.policy: reduction(r) for r in results if r.policy.startswith("fixed")},
    }


def headline(result: dict[str, Any]) -> str:
    """One line: the planner against the best fixed layout, verl's default and the oracle (a negative reduction:
    the planner took longer)."""
    line = (f"the planner ({result['planner']}) vs the best fixed layout ({result['best_fixed']}): reduces "
            f"generation by {result['generation_reduction_vs_best_fixed']:+.1%}, iteration by "
            f"{result['iteration_reduction_vs_best_fixed']:+.1%}")
    if result["verl_default"] is not None:
        line += (f"; vs verl's default ({result['verl_default']}): generation by "
                 f"{result['generation_reduction_vs_verl_default']:+.1%}, iteration by "
                 f"{result['iteration_reduction_vs_verl_default']:+.1%}")
    return line + f"; planner / oracle {result['planner_over_oracle']:.3f}"


def table(results: list[Result], train_seconds: float) -> str:
    best = min(r.seconds for r in results if r.policy.startswith("fixed"))
    head = f"{'policy':20s} {'generation s':>12s} {'iteration s':>12s} {'regroups':>8s} {'vs best fixed':>13s}  layouts"
    lines = [head, "-" * len(head)]
    for r in results:
        layouts = " -> ".join([describe(r.start_layout)] + [describe(new) for _, _, new, _ in r.regroups])
        lines.append(f"{r.policy:20s} {r.seconds:12.2f} {r.seconds + train_seconds:12.2f} {len(r.regroups):8d} "
                     f"{r.seconds / best:13.3f}  {layouts}")
    return "\n".join(lines)


def plots(results: list[Result], total: int, train_seconds: float, out: Path) -> list[str]:
    """timeline.png: unfinished requests and the largest TP group over time; latency.png: the iteration's parts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for r in results:
        unfinished = r.unfinished(total)
        axes[0].step([t for t, _ in unfinished], [n for _, n in unfinished], where="post", label=r.policy)
        layouts = r.layouts() + [(r.seconds, r.layouts()[-1][1])]
        axes[1].step([t for t, _ in layouts], [max(layout) for _, layout in layouts], where="post", label=r.policy)
    axes[0].set_ylabel("unfinished sequences")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("largest TP group")
    axes[1].set_xlabel("simulated seconds since the batch started")
    fig.suptitle("Simulated rollout batch: sequences left and TP layout over time, per policy")
    written = [save_figure(fig, out / "timeline.png")]

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r.policy for r in results]
    regroup = [sum(took for *_, took in r.regroups) for r in results]
    ax.barh(names, [r.seconds - g for r, g in zip(results, regroup)], label="generation")
    ax.barh(names, regroup, left=[r.seconds - g for r, g in zip(results, regroup)], label="regroups")
    ax.barh(names, [train_seconds] * len(results), left=[r.seconds for r in results], label="training (modelled)")
    ax.set_xlabel("simulated seconds per iteration")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    return written + [save_figure(fig, out / "latency.png")]
