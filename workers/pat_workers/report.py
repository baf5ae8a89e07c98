"""What a run did: the per-iteration table, summary.json and PNG plots, from the run folder's records.

Inputs: metrics.jsonl (one row per trainer iteration), timeline.jsonl (the pods' state polled by the launcher:
layout and running requests over time), rollouts/iter-*.json (token ids per response).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pat_operator.api import RLHFJob

PHASES = ("generate", "reward", "train", "sync", "checkpoint")


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
    """Mean reward (`key`) of the last k iterations against the first k, with the difference in standard errors.

    The standard error uses the spread of the per-iteration means, so that 'z' says how unlikely the gain would
    be as noise between iterations (z > 3: not luck)."""
    k = max(2, len(rows) // 4)
    if len(rows) < 2 * k:
        return {"iterations_compared": 0}
    first = [r[key] for r in rows[:k]]
    last = [r[key] for r in rows[-k:]]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
    se = math.sqrt(var(first) / k + var(last) / k) or 1e-12
    return {"iterations_compared": k, "first_reward_mean": mean(first), "last_reward_mean": mean(last),
            "gain": mean(last) - mean(first), "z": (mean(last) - mean(first)) / se}


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
    drift apart by as much; from then on the policies, and so the response lengths, differ. The like-for-like
    ratio is over the iterations that generated identical tokens (all of them when greedy)."""
    ours = {r["iteration"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    theirs = {r["iteration"]: r for r in read_jsonl(baseline_dir / "metrics.jsonl")}
    responses = mismatched = 0
    same: list[int] = []
    for path in sorted((run_dir / "rollouts").glob("iter-*.json")):
        other = baseline_dir / "rollouts" / path.name
        if not other.exists():
            continue
        theirs_by_id = {r["id"]: r["tokens"] for r in json.loads(other.read_text())}
        differing = sum(theirs_by_id.get(r["id"]) != r["tokens"] for r in json.loads(path.read_text()))
        responses += len(theirs_by_id)
        mismatched += differing
        if not differing:
            same.append(int(path.stem.split("-")[1]))
    gen = lambda rows, its: sum(rows[i]["seconds"]["generate"] for i in its if i in rows)  # noqa: E731
    identical = [i for i in same if i in ours and i in theirs]
    return {"generate_seconds_adaptive": gen(ours, ours), "generate_seconds_fixed": gen(theirs, theirs),
            "identical_iterations": identical,
            "generate_seconds_identical_adaptive": gen(ours, identical),
            "generate_seconds_identical_fixed": gen(theirs, identical),
            "generate_ratio_identical": gen(ours, identical) / gen(theirs, identical) if identical else None,
            "responses_compared": responses, "responses_differing": mismatched,
            "identical_tokens": responses > 0 and mismatched == 0}


def table(rows: list[dict]) -> str:
    head = f"{'iter':>4} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'regroups':>8} {'reward':>7} {'score':>6} " \
           f"{'resp len':>8} {'tok/s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['iteration']:>4} " + " ".join(f"{r['seconds'].get(p, 0.0):>9.2f}" for p in PHASES)
                     + f" {r.get('regroups', 0):>8} {r['reward_mean']:>7.3f} {r['score_mean']:>6.3f}"
                       f" {r['response_tokens_mean']:>8.1f}"
                       f" {r['tokens_per_second']:>7.0f}")
    return "\n".join(lines)


def plots(run_dir: Path, rows: list[dict], timeline: list[dict]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if timeline:
        t0 = timeline[0]["time"]
        pods = sorted({r["pod"] for r in timeline})
        fig, axes = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
        for pod in pods:
            pts = [r for r in timeline if r["pod"] == pod]
            t = [r["time"] - t0 for r in pts]
            axes[0].step(t, [max(r["layout"]) for r in pts], where="post", label=f"pod {pod}: largest TP group")
            axes[0].step(t, [len(r["layout"]) for r in pts], where="post", ls=":", label=f"pod {pod}: replica groups")
            axes[1].step(t, [sum(g["running"] for g in r["groups"]) for r in pts], where="post", label=f"pod {pod}")
        axes[0].set_ylabel("TP layout")
        axes[0].legend(loc="upper right", fontsize=8)
        axes[1].set_ylabel("running requests")
        axes[1].set_xlabel("seconds since start")
        fig.suptitle("Adaptive TP: layout and running requests over time")
        written.append(save_figure(fig, run_dir / "timeline.png"))
    if rows:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        bottom = [0.0] * len(rows)
        its = [r["iteration"] for r in rows]
        for phase in PHASES:
            vals = [r["seconds"].get(phase, 0.0) for r in rows]
            ax.bar(its, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xlabel("iteration")
        ax.set_ylabel("seconds")
        ax.set_title("iteration time by phase")
        ax.legend(fontsize=8)
        ax2.plot(its, [r["reward_mean"] for r in rows], marker="o")
        ax2.set_xlabel("iteration")
        ax2.set_ylabel("mean reward")
        ax2.set_title("reward")
        written.append(save_figure(fig, run_dir / "iterations.png"))
    return written


def save_figure(fig, path: Path) -> str:
    """Writes a matplotlib figure as a PNG (in this project's size) and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write(run_dir: Path, job: RLHFJob, outcome: dict, baseline_dir: Path | None = None) -> Path:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "timeline.jsonl")
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
        "per_iteration": rows,
        "plots": plots(run_dir, rows, timeline),
    }
    if baseline_dir is not None:
        summary["adaptive_vs_fixed"] = compare(run_dir, baseline_dir)
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    print(table(rows))
    for name, lr in (("reward", summary["learning"]), ("score (reward function alone)", summary["learning_score"])):
        if lr.get("iterations_compared"):
            print(f"{name}: first {lr['iterations_compared']} iterations {lr['first_reward_mean']:.3f} -> last "
                  f"{lr['last_reward_mean']:.3f} ({lr['gain']:+.3f}, {lr['z']:.1f} standard errors)")
    busy = {pod: {k: round(v, 2) for k, v in d["busy_seconds_by_layout"].items()}
            for pod, d in summary["layouts"].items()}
    print(f"adaptive TP: {summary['regroups']} regroups; seconds generating per layout: {busy}")
    if baseline_dir is not None:
        c = summary["adaptive_vs_fixed"]
        print(f"generation, adaptive vs fixed TP=1: {c['generate_seconds_adaptive']:.2f} s vs "
              f"{c['generate_seconds_fixed']:.2f} s in all; {c['responses_differing']} of "
              f"{c['responses_compared']} responses differ")
        if c["identical_iterations"]:
            print(f"  like for like (the {len(c['identical_iterations'])} iterations with identical tokens): "
                  f"{c['generate_seconds_identical_adaptive']:.2f} s vs {c['generate_seconds_identical_fixed']:.2f} s"
                  f" (ratio {c['generate_ratio_identical']:.3f})")
    print(f"restarts: {len(outcome['restarts'])}; wall {outcome['seconds']:.1f} s; plots: "
          f"{', '.join(summary['plots'])}")
    return path
