"""What a run did: the per-iteration table, summary.json and PNG plots, from the run folder's records.

Inputs: metrics.jsonl (one row per trainer iteration), timeline.jsonl (the pods' state polled by the launcher:
layout and running requests over time), rollouts/iter-*.json (token ids per response); with --baseline, the same
of the job run at fixed layouts beside it (fixed-tp1/, and fixed-tp<N>/ for the largest TP the model allows),
shown beside: adaptive against fixed TP=1 and against the best fixed layout (the one that generated fastest).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pat_operator import metric_names as names
from pat_operator.api import RLHFJob

PHASES = names.TRAINER_PHASES


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written while we read
            pass
    return rows


def learning(rows: list[dict], key: str = "reward_mean") -> dict:
    """Mean reward (`key`) of the last k iterations against the first k, with the difference in standard errors
    (z: the spread of the per-iteration means as the noise); and the trend over every iteration, the least-squares
    slope per iteration in its standard errors (trend_t, n - 2 degrees of freedom: above 3, a chance under 0.5% as
    noise for 20 iterations). The trend uses every iteration, so it tells learning from luck where 2 x k are few
    and the last ones spread widely (a policy that improves spreads its rewards)."""
    k = max(2, len(rows) // 4)
    if len(rows) < 2 * k or len(rows) < 3:
        return {"iterations_compared": 0}
    ys = [r[key] for r in rows]
    first, last = ys[:k], ys[-k:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
    se = math.sqrt(var(first) / k + var(last) / k) or 1e-12
    n, mx, my = len(ys), (len(ys) - 1) / 2, mean(ys)
    sxx = sum((x - mx) ** 2 for x in range(n))
    slope = sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in enumerate(ys)) / (n - 2)
    return {"iterations_compared": k, "first_reward_mean": mean(first), "last_reward_mean": mean(last),
            "gain": mean(last) - mean(first), "z": (mean(last) - mean(first)) / se,
            "slope": slope, "trend_t": slope / (math.sqrt(residual / sxx) or 1e-12)}


def rollout_mismatch(rows: list[dict]) -> dict | None:
    """The engine's log-probabilities against the trainer's over a run: the iterations' mean |delta| and KL
    averaged, the largest |delta| of any; None for a run without the trainer's measurements."""
    rows = [r for r in rows if "logprob_diff_max" in r]
    if not rows:
        return None
    return {"logprob_diff_mean": sum(r["logprob_diff_mean"] for r in rows) / len(rows),
            "logprob_diff_max": max(r["logprob_diff_max"] for r in rows),
            "logprob_kl": sum(r["logprob_kl"] for r in rows) / len(rows)}


def layout_time(timeline: list[dict]) -> dict:
    """Seconds each pod spent in each layout while it had requests, and its regroups (epoch changes)."""
    out: dict[str, dict] = {}
    by_pod: dict[int, list[dict]] = {}
    for row in timeline:
        by_pod.setdefault(row["pod"], []).append(row)
    for pod, rows in by_pod.items():
        seconds: dict[str, float] = {}
        regroups = 0
        for a, b in zip(rows, rows[1:]):
            if a["attempt"] != b["attempt"]:
                continue
            regroups += b["epoch"] != a["epoch"]
            if sum(g["running"] + g["waiting"] for g in a["groups"]):
                key = str(tuple(a["layout"]))
                seconds[key] = seconds.get(key, 0.0) + b["time"] - a["time"]
        out[str(pod)] = {"busy_seconds_by_layout": seconds, "regroups_seen": regroups}
    return out


def compare(run_dir: Path, baseline_dir: Path) -> dict:
    """Adaptive TP against the same job with it off: generation time and whether the tokens are the same.

    Sampled runs agree token for token until a sampled token flips: TP=2 sums in another order, so its
    log-probabilities (which the trainer uses as the old policy's) differ in the last bits, and the weights
    drift apart by as much; from then on the policies, and so the responses, differ. Generation time is compared
    like for like over the iterations whose responses have the same lengths in both runs (the same prompts come
    from the same sampler): the same decode steps at the same batch sizes. That is every iteration when the
    lengths are drawn (dataset.synthetic.longTail) or greedy, and those before the first flip otherwise."""
    ours = {r["iteration"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    theirs = {r["iteration"]: r for r in read_jsonl(baseline_dir / "metrics.jsonl")}
    responses = mismatched = 0
    same_work: list[int] = []
    for path in sorted((run_dir / "rollouts").glob("iter-*.json")):
        other = baseline_dir / "rollouts" / path.name
        if not other.exists():
            continue
        mine = {r["id"]: r["tokens"] for r in json.loads(path.read_text())}
        fixed = {r["id"]: r["tokens"] for r in json.loads(other.read_text())}
        responses += len(fixed)
        mismatched += sum(fixed.get(i) != tokens for i, tokens in mine.items())
        if {i: len(t) for i, t in mine.items()} == {i: len(t) for i, t in fixed.items()}:
            same_work.append(int(path.stem.split("-")[1]))
    gen = lambda rows, its: sum(rows[i]["seconds"]["generate"] for i in its if i in rows)  # noqa: E731
    like = [i for i in same_work if i in ours and i in theirs]
    return {"generate_seconds_adaptive": gen(ours, ours), "generate_seconds_fixed": gen(theirs, theirs),
            "like_for_like_iterations": like,
            "generate_seconds_like_for_like_adaptive": gen(ours, like),
            "generate_seconds_like_for_like_fixed": gen(theirs, like),
            "generate_ratio_like_for_like": gen(ours, like) / gen(theirs, like) if like else None,
            "responses_compared": responses, "responses_differing": mismatched,
            "identical_tokens": responses > 0 and mismatched == 0}


def best_fixed(fixed: Mapping[int, Sequence[dict]]) -> int | None:
    """The fixed layout (its TP size) that generated fastest over the iterations every fixed run completed."""
    common = set.intersection(*({r["iteration"] for r in rows} for rows in fixed.values())) if fixed else set()
    seconds = {tp: sum(r["seconds"]["generate"] for r in rows if r["iteration"] in common)
               for tp, rows in fixed.items()}
    return min(seconds, key=lambda tp: (seconds[tp], tp)) if seconds else None


def table(rows: list[dict], fixed: Mapping[int, Sequence[dict]] | None = None) -> str:
    """One line per iteration; with the fixed layouts' rows (per TP size), their generation seconds beside this
    run's."""
    fixed_generate = {tp: {r["iteration"]: r["seconds"]["generate"] for r in f} for tp, f in (fixed or {}).items()}
    head = f"{'iter':>4} {PHASES[0]:>9}" + "".join(f" {f'fixed TP{tp}':>9}" for tp in fixed_generate) \
        + "".join(f" {p:>9}" for p in PHASES[1:]) + f" {'regroups':>8} {'reward':>7} {'score':>6} " \
        f"{'resp len':>8} {'tok/s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        seconds = [r["seconds"].get(p, 0.0) for p in PHASES]
        beside = [g.get(r["iteration"], math.nan) for g in fixed_generate.values()]
        lines.append(f"{r['iteration']:>4} " + " ".join(f"{v:>9.2f}" for v in seconds[:1] + beside + seconds[1:])
                     + f" {r.get('regroups', 0):>8} {r['reward_mean']:>7.3f} {r['score_mean']:>6.3f}"
                       f" {r['response_tokens_mean']:>8.1f}"
                       f" {r['tokens_per_second']:>7.0f}")
    return "\n".join(lines)


Trace = list[tuple[float, int, tuple[int, ...]]]  # (seconds since the batch's first poll, requests, layout)


def batch_traces(timeline: list[dict]) -> dict[str, dict[int, Trace]]:
    """Per rollout batch (its id, e.g. iter-3) and pod, what the launcher polled while the batch ran: the running
    and waiting requests and the layout, from the batch's first poll to the poll that saw it done (0 requests
    there). A batch that ran again after a restart keeps its last attempt's trace."""
    traces: dict[str, dict[int, Trace]] = {}
    started: dict[tuple[str, int], tuple[int, float]] = {}  # (batch, pod) -> its trace's (attempt, first poll)
    for row in timeline:
        batch, pod = row.get("batch_id"), row["pod"]
        if batch is None:
            continue
        attempt, start = started.get((batch, pod), (None, 0.0))
        if attempt != row["attempt"]:
            if row["batch_done"]:  # the done polls of a batch seen running in another attempt, or not at all
                continue
            started[batch, pod] = attempt, start = row["attempt"], row["time"]
            traces.setdefault(batch, {})[pod] = []
        trace = traces[batch][pod]
        if trace and trace[-1][1] == 0:  # done already: the polls until the next batch
            continue
        requests = 0 if row["batch_done"] else sum(g["running"] + g["waiting"] for g in row["groups"])
        trace.append((row["time"] - start, requests, tuple(row["layout"])))
    return traces


def fixed_style(tp: int) -> dict:
    """How a fixed layout's run is drawn beside the adaptive one: TP=1 grey dashed, larger TP dark dotted."""
    return dict(color="0.55", ls="--") if tp == 1 else dict(color="0.15", ls=":")


def plots(run_dir: Path, rows: list[dict], timeline: list[dict],
          fixed: Mapping[int, tuple[Sequence[dict], Sequence[dict]]] | None = None) -> list[str]:
    """timeline.png and iterations.png; `fixed`: per fixed TP size, its run's (rows, timeline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = fixed or {}
    fixed_rows = {tp: list(f[0]) for tp, f in fixed.items()}
    written = []
    traces = batch_traces(timeline)
    if traces:
        fig = timeline_figure(plt, traces, {tp: batch_traces(list(f[1])) for tp, f in fixed.items()}, rows,
                              fixed_rows)
        written.append(save_figure(fig, run_dir / "timeline.png", top=0.93))
    if rows:
        written.append(save_figure(iterations_figure(plt, rows, fixed_rows), run_dir / "iterations.png"))
    return written


MAX_PANELS = 20  # batches the timeline draws, evenly spaced over the run


def timeline_figure(plt, traces: dict[str, dict[int, Trace]], fixed: Mapping[int, dict[str, dict[int, Trace]]],
                    rows: list[dict], fixed_rows: Mapping[int, list[dict]]):
    """One panel per rollout batch: its requests over the batch on a log scale, so that the tail shows, colored by
    the pod's layout, and the same batch of each fixed layout's run (per TP size) beside it, dashed or dotted."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    batches = list(traces)
    shown = [batches[round(i * (len(batches) - 1) / (MAX_PANELS - 1))] for i in range(MAX_PANELS)] \
        if len(batches) > MAX_PANELS else batches
    generate = {f"iter-{r['iteration']}": r["seconds"]["generate"] for r in rows}  # the trainer's batch ids
    fixed_generate = {tp: {f"iter-{r['iteration']}": r["seconds"]["generate"] for r in f}
                      for tp, f in fixed_rows.items()}
    layouts = sorted({point[2] for b in shown for t in traces[b].values() for point in t}, key=lambda lo: -len(lo))
    colors = {layout: f"C{i}" for i, layout in enumerate(layouts)}
    columns = min(5, len(shown))
    grid_rows = -(-len(shown) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(2.6 * columns, 2.1 * grid_rows + 0.8), sharex=True,
                             sharey=True, squeeze=False)
    most = max(1, *(n for b in shown for t in traces[b].values() for _, n, _ in t))
    ticks = [2 ** i for i in range(most.bit_length())]  # whole requests
    for ax, batch in zip(axes.flat, shown):
        for tp, fixed_traces in fixed.items():
            for trace in fixed_traces.get(batch, {}).values():
                draw_trace(ax, trace, lambda _, tp=tp: dict(**fixed_style(tp), lw=1))
        for trace in traces[batch].values():
            draw_trace(ax, trace, lambda layout: dict(color=colors[layout], lw=1.6))
        beside = ", ".join(f"TP{tp} {g[batch]:.2f}" for tp, g in fixed_generate.items() if batch in g)
        title = batch if batch not in generate else f"{batch}: {generate[batch]:.2f} s" + (
            f" (fixed {beside})" if beside else "")
        ax.set_title(title, fontsize=8 if len(fixed_generate) < 2 else 7)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_yticklabels([str(t) for t in ticks])
        ax.set_ylim(0.8, most * 1.25)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("requests")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the batch")
    handles = [Line2D([], [], color=colors[lo], lw=2, label=f"adaptive TP: {groups_label(lo)}") for lo in layouts]
    handles += [Line2D([], [], **fixed_style(tp), label=f"fixed TP={tp}") for tp in fixed]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.96))
    fig.suptitle("Each rollout batch: requests running or waiting (log scale) and the pod's layout"
                 + (f" ({len(shown)} of {len(batches)} batches)" if len(shown) < len(batches) else ""))
    return fig


def draw_trace(ax, trace: Trace, style) -> None:
    """A batch's requests as steps, each segment styled by its layout (style(layout): plot keywords); it ends at
    the poll that saw the batch done (0 requests: off a log scale)."""
    for (t0, n0, layout), (t1, n1, _) in zip(trace, trace[1:]):
        if n0:
            ax.plot([t0, t1, t1], [n0, n0, n1 or n0], solid_capstyle="butt", **style(layout))


def groups_label(layout: tuple[int, ...]) -> str:
    """(2, 1, 1) -> '1 x TP=2 + 2 x TP=1'."""
    return " + ".join(f"{layout.count(tp)} x TP={tp}" for tp in sorted(set(layout), reverse=True))


def iterations_figure(plt, rows: list[dict], fixed_rows: Mapping[int, list[dict]]):
    """Per iteration: seconds by phase; generation seconds against each fixed layout's run; reward and score."""
    from matplotlib.ticker import MaxNLocator

    its = [r["iteration"] for r in rows]
    fig, (phases, generation, reward) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r["seconds"].get(phase, 0.0) for r in rows]
        phases.bar(its, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    phases.set_ylabel("seconds")
    phases.set_title("iteration time by phase", fontsize=10)
    generation.plot(its, [r["seconds"]["generate"] for r in rows], marker="o", label="adaptive TP")
    for tp, f in fixed_rows.items():
        generation.plot([r["iteration"] for r in f], [r["seconds"]["generate"] for r in f], marker="s" if tp == 1
                        else "^", **fixed_style(tp), label=f"fixed TP={tp}")
    generation.set_ylabel("seconds")
    generation.set_ylim(bottom=0)
    generation.set_title("generation", fontsize=10)
    reward.plot(its, [r["score_mean"] for r in rows], marker="o", label="score (reward function)")
    if any(abs(r["reward_mean"] - r["score_mean"]) > 1e-6 for r in rows):  # float32 means: equal up to rounding
        reward.plot(its, [r["reward_mean"] for r in rows], marker=".", label="reward (with length shaping)")
    reward.set_ylabel("mean")
    reward.set_xlabel("iteration")
    reward.set_title("reward", fontsize=10)
    reward.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (phases, generation, reward):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def save_figure(fig, path: Path, top: float = 1.0) -> str:
    """Writes a matplotlib figure as a PNG (in this project's size) and frees it; `top`: the fraction of the height
    left to the axes (above it: a figure legend)."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write(run_dir: Path, job: RLHFJob, outcome: dict, fixed: Mapping[int, tuple[Path, dict]] | None = None,
          turns: list[list[str]] | None = None) -> Path:
    """summary.json, the plots and the printed report of a run; with `fixed` (per TP size, the folder and outcome
    of the same job at that fixed layout), adaptive against fixed TP=1 and against the best fixed layout; `turns`:
    the order the runs took each iteration in."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    fixed = dict(sorted((fixed or {}).items()))
    fixed_runs = {tp: (read_jsonl(d / "metrics.jsonl"), read_jsonl(d / "timeline.jsonl")) for tp, (d, _) in
                  fixed.items()}
    best = best_fixed({tp: f[0] for tp, f in fixed_runs.items()})
    summary = {
        "job": job.metadata.name,
        "run_dir": str(run_dir),
        "wall_seconds": outcome["seconds"],
        "restarts": outcome["restarts"],
        "iterations": len(rows),
        "iterations_by_attempt": {str(a): [r["iteration"] for r in rows if r.get("attempt") == a]
                                  for a in sorted({r.get("attempt", 0) for r in rows})},
        "phase_seconds": {p: sum(r["seconds"].get(p, 0.0) for r in rows) for p in PHASES},
        "regroups": sum(r.get("regroups", 0) for r in rows),
        "adaptive_tp": {**job.spec.generator.adaptive_tp.model_dump(by_alias=True),
                        "enabled": job.spec.generator.adaptive},
        "layouts": layout_time(timeline),
        "learning": learning(rows),
        "learning_score": learning(rows, "score_mean"),  # the reward function alone, without length shaping
        "rollout_mismatch": rollout_mismatch(rows),
        "per_iteration": rows,
        "plots": plots(run_dir, rows, timeline, fixed_runs),
    }
    if fixed:
        summary["fixed_layouts"] = {str(tp): {
            "run_dir": str(d), "wall_seconds": o.get("seconds"), "restarts": o.get("restarts", []),
            "generate_seconds": sum(r["seconds"]["generate"] for r in fixed_runs[tp][0])}
            for tp, (d, o) in fixed.items()}
        summary["best_fixed_tp"] = best
        summary["turns"] = turns
        for key, tp in (("adaptive_vs_fixed_tp1", 1), ("adaptive_vs_best_fixed", best)):
            if tp in fixed:
                summary[key] = {"fixed_tp": tp, **compare(run_dir, fixed[tp][0])}
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    print(table(rows, {tp: f[0] for tp, f in fixed_runs.items()}))
    for name, lr in (("reward", summary["learning"]), ("score (reward function alone)", summary["learning_score"])):
        if lr.get("iterations_compared"):
            print(f"{name}: first {lr['iterations_compared']} iterations {lr['first_reward_mean']:.3f} -> last "
                  f"{lr['last_reward_mean']:.3f} ({lr['gain']:+.3f}, {lr['z']:.1f} standard errors); trend "
                  f"{lr['slope']:+.4f} per iteration ({lr['trend_t']:.1f} standard errors)")
    if (m := summary["rollout_mismatch"]) is not None:
        print(f"engine vs trainer log-probabilities: mean |delta| {m['logprob_diff_mean']:.2e}, max |delta| "
              f"{m['logprob_diff_max']:.2e}, KL {m['logprob_kl']:.2e} (over all iterations)")
    busy = {pod: {k: round(v, 2) for k, v in d["busy_seconds_by_layout"].items()}
            for pod, d in summary["layouts"].items()}
    print(f"adaptive TP: {summary['regroups']} regroups; seconds generating per layout: {busy}")
    wall = f"wall {outcome['seconds']:.1f} s"
    if fixed:
        print("fixed layouts, generation: " + ", ".join(f"TP={tp} {f['generate_seconds']:.2f} s" for tp, f in
                                                        summary["fixed_layouts"].items())
              + f"; the best fixed layout is TP={best}"
              + (" (the runs took turns an iteration at a time, the order rotated every iteration)" if turns else ""))
        if "adaptive_vs_fixed_tp1" in summary:
            print_comparison("fixed TP=1", summary["adaptive_vs_fixed_tp1"])
        print_comparison(f"the best fixed layout (TP={best})", summary["adaptive_vs_best_fixed"])
        wall += " (all runs, side by side)" if turns else ""
    print(f"restarts: {len(outcome['restarts'])}; {wall}; plots: {', '.join(summary['plots'])}")
    return path


def print_comparison(against: str, c: dict) -> None:
    """The printed lines of one compare(): generation in all and like for like, and the tokens."""
    print(f"generation, adaptive vs {against}: {c['generate_seconds_adaptive']:.2f} s vs "
          f"{c['generate_seconds_fixed']:.2f} s in all; {c['responses_differing']} of {c['responses_compared']} "
          f"responses differ")
    if c["like_for_like_iterations"]:
        print(f"  like for like (the {len(c['like_for_like_iterations'])} iterations whose responses have the same "
              f"lengths): {c['generate_seconds_like_for_like_adaptive']:.2f} s vs "
              f"{c['generate_seconds_like_for_like_fixed']:.2f} s (ratio {c['generate_ratio_like_for_like']:.3f})")
