"""An RLHFJob whose rollout batches have a long tail, for the adaptive-TP tests and bench/e2e_tail.py.

Greedy, with exact response lengths from the dataset (lengthField, EOS ignored): per iteration `longs` problems
whose first sample is long and the rest short. The generator deals a batch's requests in order to the least
loaded replica group, so every long response (an even position) lands on the same engine rank: once the short
ones end, that rank decodes the long ones while the other idles -- the tail that merging the two ranks into one
TP=2 group speeds up. The model is the tiny `bench` preset (94M
parameters): on this CPU its decode steps are bound by reading the weights, which TP=2 halves per rank (the
smaller presets are too small to gain from TP). The merge pays more the more long responses the busy rank holds
(measured here: 1 long, TP=2 takes ~0.74x the TP=1 step; 8 long, ~0.62x): one rank alone gets much of the
memory bandwidth, but only one core's arithmetic. Long responses spread over both ranks would gain little: both
cores are busy either way (on a GPU a lone sequence leaves most of it idle, and TP gains there too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .conftest import job_doc

SHORT = 16
TAIL = 400  # tokens of the long responses of the tests' dataset: at TP=1 on this CPU its tail lasts seconds


def problems(longs: int) -> int:
    """Problems per iteration (two samples each): the `longs` ones and short ones up to 4."""
    return max(4, longs)


def write_dataset(directory: Path, long: int, longs: int = 1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # per problem: one length for all samples, or one each
    lengths = [[long, SHORT]] * longs + [SHORT] * (problems(longs) - longs)
    with (directory / "tail.jsonl").open("w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i), "length": n}) + "\n")


def tail_job(name: str, data_dir: Path, long: int, controller: str = "operator", enabled: bool = True,
             prometheus_url: str | None = None, iterations: int = 2, longs: int = 1) -> dict[str, Any]:
    doc = job_doc(name, backoffLimit=0)
    spec = doc["spec"]
    spec["model"]["tiny"].update(preset="bench", tokenizer="bytes")
    spec["dataset"] = {"path": "/data/tail.jsonl", "lengthField": "length"}
    spec["algorithm"].update(iterations=iterations, promptsPerIteration=problems(longs), samplesPerPrompt=2,
                             maxResponseTokens=long, temperature=0.0, miniBatches=1)
    spec["reward"]["overlongBuffer"] = 0
    data = {"volumes": [{"name": "data", "hostPath": {"path": str(data_dir)}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}
    spec["trainer"].update(data)
    adaptive = {"enabled": enabled, "controller": controller, "minGain": 0.1, "cooldownSteps": 4,
                "cooldownSeconds": 1.0}
    if prometheus_url:
        adaptive["prometheus"] = {"url": prometheus_url, "queryInterval": 1.0}
    spec["generator"].update(maxBatch=8, maxSeq=long + 16, adaptiveTP=adaptive, **data)
    spec["checkpoint"] = {"everyIterations": iterations, "keep": 1, "path": "/var/lib/pat/run",
                          "volume": {"persistentVolumeClaim": {"claimName": f"{name}-run"}}}
    return doc


def run_job(jobs, cluster, doc: dict, timeout: float = 420, ends: str = "Succeeded") -> dict:
    """Creates the job and its run claim, waits for it to end, and asserts how it ended."""
    name = doc["metadata"]["name"]
    jobs.core.create_namespaced_persistent_volume_claim(jobs.namespace, claim(name))
    jobs.create(doc)

    def logs() -> str:
        return "\n".join(f"--- {p.metadata.name}\n{cluster.kubelet.log(jobs.namespace, p.metadata.name, c)[-3000:]}"
                         for p in jobs.pods(name) for c in (p.metadata.labels["pat.dev/role"],))
    job = jobs.wait(name, lambda j: (j.get("status") or {}).get("phase") in ("Succeeded", "Failed"), "finished",
                    timeout=timeout, explain=logs)
    assert job["status"]["phase"] == ends, f"{job['status']}\n{logs()}"
    return job


def claim(name: str) -> dict[str, Any]:
    return {"metadata": {"name": f"{name}-run"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}


def rollouts(run_dir: Path, iteration: int) -> dict[str, list[int]]:
    """Token ids per response id of one iteration, as the trainer recorded them."""
    return {r["id"]: r["tokens"] for r in json.loads((run_dir / "rollouts" / f"iter-{iteration:04d}.json").read_text())}
