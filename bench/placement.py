"""spec.placement side by side: the same RLHF job on the same 2 CPU cores, colocated against separate, each rank
pinned to a core of its own (workers/pat_workers/affinity.py), which stands for a GPU.

- colocated: one pod with 2 "devices" (generator.ranksPerPod 2, so 2 trainer ranks, FSDP2): engine rank r and
  trainer rank r both on core r (PAT_ENGINE_CPUS=0,1, PAT_TRAINER_CPUS=0,1). Both cores generate (two TP=1
  replicas), the engines release their KV pools, both cores train, the weights are handed over inside the pod.
- separate: one generator pod with one engine rank on core 0 (PAT_ENGINE_CPUS=0) and one trainer pod with one
  rank on core 1 (PAT_TRAINER_CPUS=1). Synchronous RL: core 1 idles while core 0 generates, then core 0 idles
  while core 1 trains, then the weights go over the weight-sync link.

The job is examples/local.yaml's (the demo-wide tiny model, the synthetic arithmetic task whose longTail fixes
every response's length, so both variants generate and train exactly the same tokens; same seeds), with adaptive
TP off (the layout is not what differs: colocated runs 2 x TP1, separate 1 x TP1), 64 prompts x 4 samples, at most
2048 tokens per micro-batch, checkpoints only at the end. Both gangs start one after the other (each measures its
start-up alone), then take turns an iteration at a time (`pat run --baseline`'s turns: only one of them works at
any moment, iteration k of both back to back, the order rotated every iteration), so that the host's drift hits
both alike. Per-iteration seconds are each trainer's metrics.jsonl rows (row["seconds"]); the first iteration is
warm-up and left out; "iteration" is the sum of the phases without the checkpoint (only the last one checkpoints).
While the runs go, /proc tells how busy the host is with work not theirs, per iteration: the ratio is also given
over the pairs of iterations where neither saw more than QUIET cores of it.

What this CPU can show: what an idle device costs. Separate leaves one core idle in every phase; colocated keeps
both busy, at the price of the switch (engines to sleep and back) and of 2-rank FSDP.
What it cannot show, and which way it errs:
- Generation: the two cores share one memory bus and last-level cache, and a decode step of this model reads all
  of its weights (~45 MB) at any batch here, so two replicas at half the batch each take about as long as one at
  the whole batch (two GPUs have twice the HBM bandwidth of one). The long-tail responses (to the cap) also set the
  phase's length on any number of replicas.
- Training: FSDP2's all-gathers and reduce-scatters go over gloo on shared memory, ~0.1 s per 45 MB here, three of
  them per micro-batch (NVLink: well under a millisecond); separate's single trainer rank has no collectives.
  Both err against colocated.
- Memory: a colocated device's engine and trainer take turns on one core, as they would time-slicing one GPU, but
  they share no device memory: the engines' released and held bytes (resident memory on CPU) are their own
  accounting, not a device that could not fit both roles; releasing frees host memory nobody waits for.
- Noise: the host is shared with other work; single iterations differ by 10-20% when it is quiet, far more when
  not, and busy neighbours cost colocated more (both of its cores step in lock-step; separate leaves one idle).

Prints a table per variant and, last, one JSON line (colocated_over_separate_iteration: target <= 0.8).
  python bench/placement.py            # 8 iterations each: ~3.5 minutes on 2 quiet cores
  python bench/placement.py --quick    # 3 iterations each: ~2 minutes
  python bench/placement.py --out DIR  # keeps the run folders (metrics, logs) and placement.json in DIR
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from pat_operator.api import parse_job
from pat_workers.affinity import ENGINE_CPUS, TRAINER_CPUS
from pat_workers.launcher import LocalRun, interleave, prepare_model
from pat_workers.report import read_jsonl
from pat_workers.turns import Turns

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "local.yaml"
TICKS = os.sysconf("SC_CLK_TCK")
QUIET = 0.25  # cores busy with other work below which the host counts as quiet
PHASES = ("generate", "reward", "switch", "train", "sync", "checkpoint")
# name: (the spec's changes, the env that pins its ranks)
VARIANTS = {
    "colocated": ({"placement": "colocated", "generator": {"ranksPerPod": 2}},
                  {ENGINE_CPUS: "0,1", TRAINER_CPUS: "0,1"}),
    "separate": ({"placement": "separate", "generator": {"ranksPerPod": 1},
                  "trainer": {"replicas": 1, "gpusPerPod": 0, "ranksPerPod": 1}},
                 {ENGINE_CPUS: "0", TRAINER_CPUS: "1"}),
}


def base_doc(args: argparse.Namespace) -> dict:
    """examples/local.yaml with adaptive TP off, checkpoints only at the end, this bench's size."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["algorithm"].update(iterations=args.iterations, promptsPerIteration=args.prompts,
                             maxResponseTokens=args.max_tokens, maxTokensPerMicroBatch=args.micro_tokens,
                             seed=args.seed)
    spec["generator"]["adaptiveTP"] = {"enabled": False}
    # Every engine rank can hold all of the batch at once: the one rank of separate no less than each of colocated's.
    spec["generator"]["maxBatch"] = args.prompts * spec["algorithm"]["samplesPerPrompt"]
    spec["generator"]["maxSeq"] = args.max_tokens + 16
    spec["checkpoint"] = {"everyIterations": 1000, "keep": 1}
    return doc


def job_of(doc: dict, variant: str, model: Path):
    """The variant's job on the shared model folder (both variants load the same weights and tokenizer)."""
    doc = copy.deepcopy(doc)
    changes, _ = VARIANTS[variant]
    spec = doc["spec"]
    spec["placement"] = changes["placement"]
    spec["generator"].update(changes["generator"])
    spec["trainer"] = changes.get("trainer", {"replicas": 1, "gpusPerPod": 0})
    spec["model"] = {"path": str(model.resolve())}
    doc["metadata"]["name"] = f"placement-{variant}"
    return parse_job(doc, f"bench/placement.py ({variant})")


def host_busy_seconds() -> float:
    """CPU seconds every core of the host has been busy since boot (all but idle and iowait), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


def wait_quiet(limit: float) -> float:
    """Waits (at most `limit` seconds) until the host keeps less than QUIET cores busy over 2 s; returns the last
    measure (before this bench starts anything, all of it is other work)."""
    deadline = time.monotonic() + limit
    while True:
        b0, t0 = host_busy_seconds(), time.perf_counter()
        time.sleep(2.0)
        busy = (host_busy_seconds() - b0) / (time.perf_counter() - t0)
        if busy < QUIET or time.monotonic() >= deadline:
            return busy


class Monitor(threading.Thread):
    """Samples, twice a second, the host's busy CPU seconds and those of the runs' processes: the pod processes
    LocalRun starts (pids.json of each run folder) and every process started under them (their children, or in
    their sessions, so an orphan stays counted), and this one. other_cores(t0, t1): how many cores work that is
    not the runs' kept busy in between."""

    def __init__(self, pids_files: list[Path]):
        super().__init__(daemon=True)
        self.pids_files, self.mine, self.cpu = pids_files, set(), {}
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), host busy s, runs' s)
        self.done = threading.Event()

    def sample(self) -> None:
        for f in self.pids_files:
            if f.exists():
                self.mine |= set(json.loads(f.read_text()).values())
        procs = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                f = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone
            # f[1], f[3]: the parent and the session; f[11], f[12]: user and system ticks
            procs.append((int(stat.parent.name), int(f[1]), int(f[3]), (int(f[11]) + int(f[12])) / TICKS))
        while True:  # down the tree, a level per pass
            new = {pid for pid, parent, session, _ in procs
                   if pid not in self.mine and (parent in self.mine or session in self.mine)}
            if not new:
                break
            self.mine |= new
        self.cpu.update({pid: cpu for pid, _, _, cpu in procs if pid in self.mine})
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.samples.append((time.time(), host_busy_seconds(),
                             sum(self.cpu.values()) + usage.ru_utime + usage.ru_stime))

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                self.sample()
            except (OSError, ValueError):
                pass  # a pids.json half written

    def stop(self) -> None:
        self.done.set()
        self.join()

    def other_cores(self, t0: float, t1: float) -> float | None:
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return None
        (a, busy0, own0), (b, busy1, own1) = before[-1], after[0]
        return max((busy1 - busy0) - (own1 - own0), 0.0) / (b - a)


def steady(rows: list[dict]) -> list[dict]:
    """The iterations after the first (warm-up), of the last attempt."""
    rows = [r for r in rows if r["attempt"] == rows[-1]["attempt"]] if rows else []
    return [r for r in rows if r["iteration"] > 1]


def iteration_seconds(row: dict) -> float:
    return sum(v for k, v in row["seconds"].items() if k != "checkpoint")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 iterations")
    ap.add_argument("--iterations", type=int, default=8, help="of each variant; the first is warm-up")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per iteration (x 4 samples each)")
    ap.add_argument("--micro-tokens", type=int, default=2048, help="algorithm.maxTokensPerMicroBatch")
    ap.add_argument("--max-tokens", type=int, default=192, help="algorithm.maxResponseTokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-wait", type=float, default=120,
                    help=f"seconds to wait at the start for other work to keep under {QUIET} cores busy")
    ap.add_argument("--out", type=Path, help="keep the run folders and placement.json here (default: a temporary "
                                             "folder, removed)")
    args = ap.parse_args()
    if args.quick:
        args.iterations = 3
    out = args.out or Path(tempfile.mkdtemp(prefix="pat-placement-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        return measure(args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


def measure(args: argparse.Namespace, out: Path) -> int:
    doc = base_doc(args)
    model = prepare_model(parse_job(doc, str(EXAMPLE)).spec, out / "model", data_dir=out)
    alg = doc["spec"]["algorithm"]
    print(f"job: {EXAMPLE.relative_to(ROOT)} ({doc['spec']['model']['tiny']['preset']} model), adaptive TP off, "
          f"{args.iterations} iterations of {alg['promptsPerIteration']} x {alg['samplesPerPrompt']} responses "
          f"(cap {args.max_tokens}, lengths fixed by the dataset's longTail), micro-batches of <= "
          f"{args.micro_tokens} tokens; 2 cores, 1 thread per rank", flush=True)
    before = wait_quiet(args.quiet_wait)
    print(f"other work on the host at the start: {before:.2f} cores", flush=True)

    names = list(VARIANTS)
    turns = Turns(out / "turns", names)
    dirs = {v: out / v for v in names}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    runs = {v: LocalRun(job_of(doc, v, model), dirs[v], progress=False, env={**VARIANTS[v][1], **turns.env(v)},
                        label=v) for v in names}
    monitor = Monitor([d / "pids.json" for d in dirs.values()])
    monitor.start()
    started = time.perf_counter()
    try:
        outcomes = asyncio.run(interleave(runs, turns))
    finally:
        monitor.stop()
    wall = time.perf_counter() - started

    rows = {v: steady(read_jsonl(dirs[v] / "metrics.jsonl")) for v in names}
    other = {v: [monitor.other_cores(r["time"] - sum(r["seconds"].values()), r["time"]) for r in rows[v]]
             for v in names}
    print(f"\nper iteration (turns in the order {' / '.join(turns.order(1))}, rotated every iteration; other: cores "
          f"busy with work not this bench's):")
    print(f"{'iteration':>9s} {'colocated s':>12s} {'separate s':>11s} {'ratio':>6s} {'other (col, sep)':>17s}")
    pairs = []  # (iteration, colocated s, separate s, quiet)
    by_it = {v: {r["iteration"]: (iteration_seconds(r), o) for r, o in zip(rows[v], other[v])} for v in names}
    show = lambda o: "-" if o is None else f"{o:.2f}"  # noqa: E731
    for it in sorted(set(by_it["colocated"]) & set(by_it["separate"])):
        (c, c_other), (s, s_other) = by_it["colocated"][it], by_it["separate"][it]
        quiet = c_other is not None and s_other is not None and max(c_other, s_other) < QUIET
        pairs.append((it, c, s, quiet))
        print(f"{it:9d} {c:12.2f} {s:11.2f} {c / s:6.3f} {show(c_other):>8s}, {show(s_other):>6s}"
              f"{'' if quiet else '  busy'}")

    means = {v: {p: mean([r["seconds"].get(p, 0.0) for r in rs]) for p in PHASES} for v, rs in rows.items()}
    for v, rs in rows.items():
        means[v]["iteration"] = mean([iteration_seconds(r) for r in rs])
    print(f"\nseconds per iteration, mean over iterations 2..{args.iterations} (iteration = the phases without the "
          f"checkpoint)")
    columns = ("generate", "reward", "switch", "train", "sync", "iteration")
    print(f"{'variant':10s}" + "".join(f"{c:>10s}" for c in columns) + f"{'vs separate':>13s}")
    for v in names:
        print(f"{v:10s}" + "".join(f"{means[v][c]:10.2f}" for c in columns)
              + f"{means[v]['iteration'] / means['separate']['iteration']:13.3f}")
    memory = [r["engine_memory_bytes"] for r in rows["colocated"] if "engine_memory_bytes" in r]
    released = int(statistics.median(m["released"] for m in memory)) if memory else None
    held = int(statistics.median(m["held"] for m in memory)) if memory else None
    if memory:
        print(f"\ncolocated engines' memory (both ranks, resident): {held / 2**20:.1f} MiB awake (held), "
              f"{released / 2**20:.1f} MiB asleep while the trainer trains (released): "
              f"{(held - released) / 2**20:.1f} MiB handed back")

    c, s = means["colocated"], means["separate"]
    quiet = [(ci, si) for _, ci, si, q in pairs if q]
    summary = {
        "colocated_over_separate_iteration": round(c["iteration"] / s["iteration"], 4),
        "colocated_over_separate_iteration_quiet": (round(mean([x for x, _ in quiet]) / mean([y for _, y in quiet]), 4)
                                                    if quiet else None),
        "quiet_pairs": len(quiet), "pairs": len(pairs),
        "colocated_over_separate_iteration_median_pair": (round(statistics.median(ci / si for _, ci, si, _ in pairs),
                                                                4) if pairs else None),
        "colocated_over_separate_generate": round(c["generate"] / s["generate"], 4),
        "colocated_over_separate_train": round(c["train"] / s["train"], 4),
        "colocated_switch_seconds_per_iteration": round(c["switch"], 4),
        "colocated_switch_fraction": round(c["switch"] / c["iteration"], 4) if c["iteration"] else None,
        "colocated_iteration_seconds": round(c["iteration"], 3),
        "separate_iteration_seconds": round(s["iteration"], 3),
        "colocated_generate_seconds": round(c["generate"], 3),
        "separate_generate_seconds": round(s["generate"], 3),
        "colocated_train_seconds": round(c["train"], 3),
        "separate_train_seconds": round(s["train"], 3),
        "colocated_sync_seconds": round(c["sync"], 3),
        "separate_sync_seconds": round(s["sync"], 3),
        "colocated_engine_memory_released_bytes": released,  # engines asleep (metrics.jsonl "released")
        "colocated_engine_memory_held_bytes": held,  # engines awake (metrics.jsonl "held")
        "iteration_pairs": [[it, round(ci, 3), round(si, 3)] for it, ci, si, _ in pairs],
        "other_cores": {v: [None if o is None else round(o, 2) for o in other[v]] for v in names},
        "other_cores_at_start": round(before, 2),
        "restarts": {v: len(o["restarts"]) for v, o in outcomes.items()},
        "wall_seconds": round(wall, 1), "iterations": args.iterations,
        "responses_per_iteration": alg["promptsPerIteration"] * alg["samplesPerPrompt"],
        "max_response_tokens": args.max_tokens, "micro_batch_tokens": args.micro_tokens, "quick": args.quick,
    }
    if args.out is not None:
        (out / "placement.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
