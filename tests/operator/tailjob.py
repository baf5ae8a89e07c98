"""An RLHFJob whose rollout batches have a long tail, for the adaptive-TP tests and bench/e2e_tail.py.

Greedy, with exact response lengths from the dataset (lengthField, EOS ignored): per iteration one long response
and 7 short ones, so that once the short ones end one engine rank decodes a single sequence while the other idles
-- the tail that merging the two ranks into one TP=2 group speeds up. The model is the tiny `bench` preset (103M
parameters): on this CPU its decode steps are bound by reading the weights, which TP=2 halves per rank (the
smaller presets are too small to gain from TP). Two long responses, one per rank, would gain nothing here: both
cores are busy either way (on a GPU a lone sequence leaves most of it idle, and TP gains there too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .conftest import job_doc

SHORT = 16


def write_dataset(directory: Path, long: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [[long, SHORT], SHORT, SHORT, SHORT]  # per problem: one length for all samples, or one each
    with (directory / "tail.jsonl").open("w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i), "length": n}) + "\n")


def tail_job(name: str, data_dir: Path, long: int, controller: str = "operator", enabled: bool = True,
             prometheus_url: str | None = None, iterations: int = 2) -> dict[str, Any]:
    doc = job_doc(name, backoffLimit=0)
    spec = doc["spec"]
    spec["model"]["tiny"].update(preset="bench", tokenizer="bytes")
    spec["dataset"] = {"path": "/data/tail.jsonl", "lengthField": "length"}
    spec["algorithm"].update(iterations=iterations, promptsPerIteration=4, samplesPerPrompt=2,
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


def claim(name: str) -> dict[str, Any]:
    return {"metadata": {"name": f"{name}-run"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}


def rollouts(run_dir: Path, iteration: int) -> dict[str, list[int]]:
    """Token ids per response id of one iteration, as the trainer recorded them."""
    return {r["id"]: r["tokens"] for r in json.loads((run_dir / "rollouts" / f"iter-{iteration:04d}.json").read_text())}
