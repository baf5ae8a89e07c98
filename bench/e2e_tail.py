"""Operator-driven adaptive TP end to end, side by side: the long-tail RLHFJob of tests/operator/tailjob.py runs
twice on the local control plane (real API server, process kubelet, real Prometheus scraping every second, the
operator planning from it) -- adaptive TP off, then on with controller=operator -- and prints the generation time
of each iteration, their ratio, and the delay from the tail threshold being crossed to the regroup being applied.

The tail threshold: the first moment in a batch at which one engine rank has nothing left to decode while the
other still decodes (from then on merging them pays on this CPU). The bench polls the pod's /v1/state at 20 Hz
(with the job's token) to see when that happens and when the pod's layout changes; the delay is everything in
between: the scrape, the operator's query, the plan and its POST, the pod's step boundary.

  python bench/e2e_tail.py [--long 800] [--iterations 3]

Last line: one JSON object with generation_ratio (adaptive / fixed, all iterations) and regroup_delay_seconds
(the largest over the iterations). Targets: generation_ratio <= 0.75, regroup_delay_seconds <= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import kubernetes

sys.path.insert(0, str(Path(__file__).parents[1]))

from pat_operator.builders import job_token  # noqa: E402
from pat_operator.podclient import PodClient  # noqa: E402
from tests.operator.harness import local_stack  # noqa: E402
from tests.operator.tailjob import claim, tail_job, write_dataset  # noqa: E402

NAMESPACE = "tail"
POLL_SECONDS = 0.05


async def watch_pod(url: str, token: str, until: asyncio.Event) -> list[tuple[float, str | None, list[int], list]]:
    """(time, batch id, layout, [(running, waiting) per group]) at 20 Hz until `until` is set."""
    timeline = []
    async with aiohttp.ClientSession() as session:
        client = PodClient(url, token, session)
        while not until.is_set():
            try:
                s = await client.state()
                if not s.batch_done:
                    timeline.append((time.time(), s.batch_id, s.layout, [(g.running, g.waiting) for g in s.groups]))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # not up yet, or gone
            await asyncio.sleep(POLL_SECONDS)
    return timeline


def regroup_delays(timeline) -> dict[str, float]:
    """Per batch: seconds from the first sample with an idle rank beside a busy one (all TP=1) to the first
    sample in a merged layout."""
    crossed: dict[str, float] = {}
    delays: dict[str, float] = {}
    for t, batch, layout, groups in timeline:
        if batch in delays:
            continue
        loads = [r + w for r, w in groups]
        if batch not in crossed and all(size == 1 for size in layout) and min(loads) == 0 < max(loads):
            crossed[batch] = t
        elif batch in crossed and any(size > 1 for size in layout):
            delays[batch] = t - crossed[batch]
    return delays


def run_job(cluster, operator, data_dir: Path, name: str, long: int, iterations: int, prometheus_url: str | None,
            adaptive: bool) -> tuple[list[float], dict[str, float]]:
    """The job's generation seconds per iteration (from the trainer's metrics.jsonl) and regroup delays."""
    api = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    core.create_namespaced_persistent_volume_claim(NAMESPACE, claim(name))
    doc = tail_job(name, data_dir, long, enabled=adaptive, prometheus_url=prometheus_url, iterations=iterations)
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
                pods = (await asyncio.to_thread(core.list_namespaced_pod, NAMESPACE,
                                                field_selector=f"metadata.name={name}-generator-0")).items
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
    return [row["seconds"]["generate"] for row in rows], regroup_delays(timeline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=800, help="tokens of the long response (the tail)")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pat-e2e-tail-"))
    data_dir = tmp / "data"
    tmp.chmod(0o755)
    write_dataset(data_dir, args.long)
    for path in (data_dir, *data_dir.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the pods run as a non-root user
    try:
        with local_stack(tmp, prometheus=True) as (cluster, operator, prometheus):
            kubernetes.client.CoreV1Api(cluster.api_client()).create_namespace({"metadata": {"name": NAMESPACE}})
            fixed, _ = run_job(cluster, operator, data_dir, "fixed", args.long, args.iterations, None, adaptive=False)
            adaptive, delays = run_job(cluster, operator, data_dir, "adaptive", args.long, args.iterations,
                                       prometheus.url, adaptive=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'iteration':>9} {'fixed TP=1 (s)':>15} {'adaptive (s)':>13} {'ratio':>6}")
    for i, (f, a) in enumerate(zip(fixed, adaptive), 1):
        print(f"{i:>9} {f:>15.2f} {a:>13.2f} {a / f:>6.3f}")
    ratio = sum(adaptive) / sum(fixed)
    print(f"{'all':>9} {sum(fixed):>15.2f} {sum(adaptive):>13.2f} {ratio:>6.3f}")
    print("regroup delay (tail threshold -> applied), per batch: " +
          (", ".join(f"{b} {d:.2f} s" for b, d in sorted(delays.items())) or "no regroup seen"))
    print(json.dumps({"iterations": args.iterations, "long_tokens": args.long,
                      "fixed_generate_seconds": [round(x, 3) for x in fixed],
                      "adaptive_generate_seconds": [round(x, 3) for x in adaptive],
                      "generation_ratio": round(ratio, 3),
                      "regroup_delay_seconds": round(max(delays.values()), 3) if delays else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
