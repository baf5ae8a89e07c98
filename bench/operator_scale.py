"""How the operator copes with many jobs, and how often it writes a busy job's status, on the local control plane
(real API server, scheduler, process kubelet). Last line: one JSON object.

  python bench/operator_scale.py [--jobs 100] [--foreign-pods 1000]

N RLHFJobs (1 trainer + 2 generator pods each, stand-in commands) created at once, beside M unrelated pods of another
namespace (Pending: their node selector matches no node; ~4 KB each, as real pods are) that the operator must not
receive: the time until every job is Running (all its pods ready) and the operator's peak RSS.
Targets: all_running_seconds <= 60, operator_rss_mb <= 150.

  python bench/operator_scale.py --busy [--iterations 4]

One busy job: the long-tailed job of tests/operator/tailjob.py with real workers and the operator's adaptive TP
(a real Prometheus scraping every second), watched from start to finish. Every status write is one MODIFIED event
whose status differs; each is classified by what changed: a layout (status.generators), a phase or condition, or
the trainer's iteration alone. Target: status_writes_per_minute <= layout_and_phase_writes_per_minute +
2 (the iteration alone is written at most every 30 s; queue depths stay in Prometheus).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).parents[1]))

from tests.operator.conftest import SERVE, SLEEP, job_doc  # noqa: E402
from tests.operator.harness import local_stack  # noqa: E402
from tests.operator.tailjob import TAIL, claim, tail_job, write_dataset  # noqa: E402

NAMESPACE, FOREIGN = "scale", "foreign"


def foreign_pod(i: int) -> dict:
    return {"metadata": {"name": f"foreign-{i:04d}", "labels": {"app": "foreign", "shard": str(i % 10)},
                         "annotations": {"bench.pat.dev/padding": "x" * 4000}},
            "spec": {"nodeSelector": {"bench.pat.dev/no-such-node": "true"},
                     "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "infinity"]}]}}


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def status_writes(events) -> list[tuple[float, str]]:
    """(time, what changed) of each status write among the job's watch events: "layout" (a generator pod's layout or
    regroup count), "phase" (the phase, a condition or a counter), or "iteration" (the trainer's progress alone)."""
    writes, last = [], None
    for t, job in events:
        status = job.get("status") or {}
        if last is not None and status != last:
            changed = {k for k in set(status) | set(last) if status.get(k) != last.get(k)}
            kind = ("layout" if changed & {"generators", "tp"} else "iteration" if changed == {"iteration"}
                    else "phase")
            writes.append((t, kind))
        last = status
    return writes


def busy(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pat-busy-"))
    tmp.chmod(0o755)
    data_dir = tmp / "data"
    write_dataset(data_dir, TAIL, 8)
    for path in (data_dir, *data_dir.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the pods run as a non-root user
    try:
        with local_stack(tmp, "--allow-host-path", str(tmp), prometheus=True) as (cluster, _, prometheus):
            api = cluster.api_client()
            core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            core.create_namespaced_persistent_volume_claim(NAMESPACE, claim("busy"))
            custom.create_namespaced_custom_object("pat.dev", "v1alpha1", NAMESPACE, "rlhfjobs", tail_job(
                "busy", data_dir, TAIL, prometheus_url=prometheus.url, iterations=args.iterations, longs=8))
            events, started = [], time.monotonic()
            watch = kubernetes.watch.Watch()
            for event in watch.stream(custom.list_namespaced_custom_object, "pat.dev", "v1alpha1", NAMESPACE,
                                      "rlhfjobs", field_selector="metadata.name=busy", timeout_seconds=900):
                events.append((time.monotonic() - started, event["object"]))
                status = event["object"].get("status") or {}
                print(f"  {events[-1][0]:6.1f} s: {status.get('phase', 'Pending'):10s} iteration "
                      f"{status.get('iteration', 0)}  TP {status.get('tp', '-')}", flush=True)
                if status.get("phase") in ("Succeeded", "Failed"):
                    watch.stop()
            if status.get("phase") != "Succeeded":
                raise RuntimeError(f"the busy job ended {status.get('phase')}: {status}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    writes = status_writes(events)
    minutes = (writes[-1][0] - writes[0][0]) / 60 if len(writes) > 1 else 1.0
    count = {kind: sum(k == kind for _, k in writes) for kind in ("layout", "phase", "iteration")}
    print(f"{len(writes)} status writes in {minutes:.1f} min: {count['layout']} with a layout change, "
          f"{count['phase']} with a phase or condition change, {count['iteration']} of the iteration alone")
    return {"busy_minutes": round(minutes, 2), "status_writes": len(writes), **{f"{k}_writes": v
                                                                              for k, v in count.items()},
            "status_writes_per_minute": round(len(writes) / minutes, 2),
            "layout_and_phase_writes_per_minute": round((count["layout"] + count["phase"]) / minutes, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--foreign-pods", type=int, default=1000)
    ap.add_argument("--busy", action="store_true", help="one busy job's status writes instead")
    ap.add_argument("--iterations", type=int, default=4, help="--busy: the job's iterations")
    args = ap.parse_args()
    if args.busy:
        print(json.dumps(busy(args)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="pat-scale-"))
    with local_stack(tmp) as (cluster, operator, _):
        api = cluster.api_client()
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        core.create_namespace({"metadata": {"name": FOREIGN}})
        for i in range(args.foreign_pods):
            core.create_namespaced_pod(FOREIGN, foreign_pod(i), _preload_content=False)
        print(f"control plane up in {cluster.plane.startup_seconds:.1f} s; {args.foreign_pods} foreign pods; "
              f"creating {args.jobs} jobs ({3 * args.jobs} pods)", flush=True)
        started = time.monotonic()
        for i in range(args.jobs):
            custom.create_namespaced_custom_object("pat.dev", "v1alpha1", NAMESPACE, "rlhfjobs",
                                                   job_doc(f"job-{i:03d}", SLEEP, SERVE))
        created = time.monotonic() - started
        running = 0
        while running < args.jobs:
            time.sleep(0.5)
            items = custom.list_namespaced_custom_object("pat.dev", "v1alpha1", NAMESPACE, "rlhfjobs")["items"]
            running = sum((j.get("status") or {}).get("phase") == "Running" for j in items)
            elapsed = time.monotonic() - started
            print(f"  {elapsed:6.1f} s: {running}/{args.jobs} Running", flush=True)
            if elapsed > 600:
                raise TimeoutError(f"only {running} of {args.jobs} jobs Running after 600 s")
        all_running = time.monotonic() - started
        rss = peak_rss_mb(operator.proc.pid)
        print(f"{args.jobs} jobs created in {created:.1f} s; all Running after {all_running:.1f} s; "
              f"operator peak RSS {rss:.0f} MB")
        print(json.dumps({"jobs": args.jobs, "pods": 3 * args.jobs, "foreign_pods": args.foreign_pods,
                          "create_seconds": round(created, 2),
                          "all_running_seconds": round(all_running, 2), "operator_rss_mb": round(rss, 1)}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
