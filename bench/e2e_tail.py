"""Operator-driven adaptive TP end to end, side by side: the long-tail RLHFJob of tests/operator/tailjob.py runs
twice on the local control plane (real API server, process kubelet, real Prometheus scraping every second, the
operator planning from it) -- adaptive TP off, then on with controller=operator -- and prints the generation time
of each iteration, their ratio, and the delay from the tail threshold being crossed to the regroup being applied.

The tail threshold: the first moment in a batch at which one engine rank has nothing left to decode while the
other still decodes (from then on merging them pays on this CPU). The bench polls the pod's /v1/state at 5 Hz
(with the job's token) to see when that happens and when the pod's layout changes; the delay is everything in
between: the scrape, the operator's query, the plan and its POST, the pod's step boundary. When the operator
merges before the tail (with 8 long responses on one rank a TP=2 group of both ranks' 16 beats two TP=1 groups
of 8 on this CPU already), the delay is counted from the batch's first sample instead: an upper bound.

  python bench/e2e_tail.py [--long 400] [--longs 8] [--iterations 3]

Last line: one JSON object with generation_ratio (adaptive / fixed, all iterations) and regroup_delay_seconds
(the largest over the iterations). Targets: generation_ratio <= 0.75, regroup_delay_seconds <= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import kubernetes

sys.path.insert(0, str(Path(__file__).parents[1]))

from pat_operator.builders import LABEL_INDEX, LABEL_JOB, LABEL_ROLE, job_token  # noqa: E402
from pat_operator.podclient import PodClient  # noqa: E402
from tests.operator.harness import local_stack  # noqa: E402
from tests.operator.tailjob import claim, tail_job, write_dataset  # noqa: E402

NAMESPACE = "tail"
NICE = 10
POLL_SECONDS = 0.2  # slow enough not to steal the ranks' cores, fine enough for a 3 s target


async def watch_pod(url: str, token: str, until: asyncio.Event) -> list[tuple[float, str | None, list[int], list]]:
    """(time, batch id or None between batches, layout, [(running, waiting) per group]) every POLL_SECONDS until
    `until` is set."""
    timeline = []
    async with aiohttp.ClientSession() as session:
        client = PodClient(url, token, session)
        while not until.is_set():
            try:
                s = await client.state()
                timeline.append((time.time(), None if s.batch_done else s.batch_id, s.layout,
                                 [(g.running, g.waiting) for g in s.groups]))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # not up yet, or gone
            await asyncio.sleep(POLL_SECONDS)
    return timeline


def regroup_delays(timeline) -> dict[str, tuple[float, str]]:
    """Per batch: (seconds, since what) until the first sample in a merged layout, counted from the first sample
    with an idle rank beside a busy one (all TP=1: "tail"), or, when the operator merged before the tail, from
    the last sample before the batch ("start": merging paid from then at the latest, so this bounds the delay)."""
    first: dict[str, float] = {}
    crossed: dict[str, float] = {}
    delays: dict[str, tuple[float, str]] = {}
    before = timeline[0][0] if timeline else 0.0
    for t, batch, layout, groups in timeline:
        if batch is None:
            before = t
            continue
        first.setdefault(batch, before)
        if batch in delays:
            continue
        loads = [r + w for r, w in groups]
        if any(size > 1 for size in layout):
            delays[batch] = (t - crossed[batch], "tail") if batch in crossed else (t - first[batch], "start")
        elif batch not in crossed and min(loads) == 0 < max(loads):
            crossed[batch] = t
    return delays


def deprioritise(cluster, operator, prometheus) -> list[str]:
    """Nice 10 for the control plane, the operator and Prometheus. On a cluster they run on other nodes and the
    generator pod has its cores to itself; here they share its 2 cores, and a TP group stalls whenever either of
    its ranks is preempted (a lone TP=1 rank beside an idle core is not). The pods and this process (the process
    kubelet, the bench's polling) keep their priority. Returns what was reniced."""
    parts = [(c.name, c.process.pid) for c in getattr(cluster.plane, "components", [])]
    parts += [("pat-operator", operator.proc.pid), ("prometheus", prometheus.pid)]
    for _, pid in parts:
        for task in os.listdir(f"/proc/{pid}/task"):  # Linux nices threads one by one (Go runtimes have many)
            os.setpriority(os.PRIO_PROCESS, int(task), NICE)
    return [name for name, _ in parts]


def layout_changes(timeline) -> dict[str, str]:
    """Per batch: its layouts in order, each with the second (from the batch's first sample) it was first seen."""
    first: dict[str, float] = {}
    changes: dict[str, list[str]] = {}
    last: dict[str, list[int]] = {}
    for t, batch, layout, _ in timeline:
        if batch is None:
            continue
        first.setdefault(batch, t)
        if last.get(batch) != layout:
            last[batch] = layout
            changes.setdefault(batch, []).append(f"{'+'.join(map(str, layout))} at {t - first[batch]:.1f} s")
    return {batch: " -> ".join(steps) for batch, steps in changes.items()}


def run_job(cluster, operator, data_dir: Path, name: str, args: argparse.Namespace, prometheus_url: str | None,
            adaptive: bool) -> tuple[list[float], dict[str, float]]:
    """The job's generation seconds per iteration (from the trainer's metrics.jsonl) and regroup delays."""
    api = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    core.create_namespaced_persistent_volume_claim(NAMESPACE, claim(name))
    iterations = args.iterations
    doc = tail_job(name, data_dir, args.long, enabled=adaptive, prometheus_url=prometheus_url, iterations=iterations,
                   longs=args.longs)
    job = custom.create_namespaced_custom_object("pat.dev", "v1alpha1", NAMESPACE, "rlhfjobs", doc)
    token = job_token(operator.key_file.read_text().strip().encode(), job["metadata"]["uid"])

    async def run() -> list:
        done = asyncio.Event()
        watcher = None
        started = time.monotonic()
        while True:
            job = await asyncio.to_thread(custom.get_namespaced_custom_object, "pat.dev", "v1alpha1", NAMESPACE,
                                          "rlhfjobs", name)
            status = job.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            if watcher is None:
                # the generator pod by its labels: its name carries a per-attempt suffix
                pods = (await asyncio.to_thread(core.list_namespaced_pod, NAMESPACE, label_selector=(
                    f"{LABEL_JOB}={name},{LABEL_ROLE}=generator,{LABEL_INDEX}=0"))).items
                if pods and pods[0].status.pod_ip:
                    watcher = asyncio.create_task(watch_pod(f"http://{pods[0].status.pod_ip}:8000", token, done))
            print(f"  {name}: {time.monotonic() - started:5.0f} s  {status.get('phase', 'Pending'):9s} iteration "
                  f"{status.get('iteration', 0)}/{iterations}  TP {status.get('tp', '-')}", flush=True)
            await asyncio.sleep(2)
        done.set()
        if status["phase"] != "Succeeded":
            raise RuntimeError(f"{name}: {status}")
        return await watcher if watcher else []

    timeline = asyncio.run(run())
    run_dir = cluster.kubelet.claim_dir(NAMESPACE, f"{name}-run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for batch, changes in layout_changes(timeline).items():
        print(f"  {name} {batch}: {changes}")
    return [row["seconds"]["generate"] for row in rows], regroup_delays(timeline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=400, help="tokens of each long response (the tail)")
    ap.add_argument("--longs", type=int, default=8, choices=range(1, 9), metavar="1..8",
                    help="long responses per iteration, all on one engine rank (8 fill its batch)")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pat-e2e-tail-"))
    data_dir = tmp / "data"
    tmp.chmod(0o755)
    write_dataset(data_dir, args.long, args.longs)
    for path in (data_dir, *data_dir.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the pods run as a non-root user
    try:
        # the dataset is a hostPath volume under tmp
        with local_stack(tmp, "--allow-host-path", str(tmp), prometheus=True) as (cluster, operator, prometheus):
            kubernetes.client.CoreV1Api(cluster.api_client()).create_namespace({"metadata": {"name": NAMESPACE}})
            print(f"nice {NICE}: {', '.join(deprioritise(cluster, operator, prometheus))}", flush=True)
            fixed, _ = run_job(cluster, operator, data_dir, "fixed", args, None, adaptive=False)
            adaptive, delays = run_job(cluster, operator, data_dir, "adaptive", args, prometheus.url, adaptive=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'iteration':>9} {'fixed TP=1 (s)':>15} {'adaptive (s)':>13} {'ratio':>6}")
    for i, (f, a) in enumerate(zip(fixed, adaptive), 1):
        print(f"{i:>9} {f:>15.2f} {a:>13.2f} {a / f:>6.3f}")
    ratio = sum(adaptive) / sum(fixed)
    print(f"{'all':>9} {sum(fixed):>15.2f} {sum(adaptive):>13.2f} {ratio:>6.3f}")
    print("regroup delay (tail threshold -> applied), per batch: " +
          (", ".join(f"{b} {d:.2f} s (from the {since})" for b, (d, since) in sorted(delays.items()))
           or "no regroup seen"))
    print(json.dumps({"iterations": args.iterations, "long_tokens": args.long, "long_responses": args.longs,
                      "fixed_generate_seconds": [round(x, 3) for x in fixed],
                      "adaptive_generate_seconds": [round(x, 3) for x in adaptive],
                      "generation_ratio": round(ratio, 3),
                      "regroup_delay_seconds": round(max(d for d, _ in delays.values()), 3) if delays else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
