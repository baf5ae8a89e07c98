"""How the operator copes with many jobs: N RLHFJobs (1 trainer + 2 generator pods each, stand-in commands)
created at once on the local control plane (real API server, scheduler, process kubelet), beside M unrelated pods
of another namespace (Pending: their node selector matches no node; ~4 KB each, as real pods are) that the
operator must not receive; prints the time until every job is Running (all its pods ready) and the operator's
peak RSS. Last line: one JSON object.

  python bench/operator_scale.py [--jobs 100] [--foreign-pods 1000]

Targets: all_running_seconds <= 60, operator_rss_mb <= 150.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).parents[1]))

from tests.operator.conftest import SERVE, SLEEP, job_doc  # noqa: E402
from tests.operator.harness import local_stack  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--foreign-pods", type=int, default=1000)
    args = ap.parse_args()
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
