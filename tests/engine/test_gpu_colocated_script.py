"""make gpu-check's colocated part (bench/gpu_colocated.py) runs here on CPU (--smoke) through the code it runs on a
GPU: an engine rank sleeps at both levels, takes new weights from a trainer rank's process through the in-pod
hand-over, and wakes, round after round; and its check of the handed-over tensors can fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pat_workers.revision import ENGINE_REVISION

ROOT = Path(__file__).parents[2]
SCRIPT = "bench/gpu_colocated.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-colocated") / "colocated.json"
    # --timeout: the watchdog's, above the default 90 s, which a loaded 2-core machine compiling FlexAttention reaches
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out), "--timeout", "240"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result == json.loads(done.stdout.strip().splitlines()[-1])  # the file is what it printed last
    return result


@pytest.mark.slow
def test_smoke_hands_the_weights_over_and_level_2_gives_them_back(smoke):
    assert smoke["smoke"] is True and smoke["failed"] == [] and smoke["trainer_exitcode"] == 0
    assert smoke["engine"] == ENGINE_REVISION and smoke["commit"]  # what it measured: this engine at this commit
    for section in ("model", "sleep", "handover", "rounds"):
        assert smoke[section]["status"] == "done", smoke[section]
    weights, sleep = smoke["model"]["weights_bytes"], smoke["sleep"]
    # Level 2 gives back the weights beside what level 1 does (the resident set's drops, from awake each time)
    assert sleep["level2_drop"] - sleep["level1_drop"] >= 0.9 * weights, sleep
    handover = smoke["handover"]
    assert handover["mismatched"] == [] and handover["pass"] is True
    assert handover["greedy_equal_fresh_engine"] is True and handover["greedy_changed"] is True
    assert handover["round_s"] > 0 and handover["peak_above_asleep"] > 0
    rounds = smoke["rounds"]
    assert rounds["mismatched"] == 0 and rounds["pass"] is True
    assert len(rounds["awake_bytes"]) == len(rounds["handover_s"]) == rounds["rounds"] == 10


@pytest.mark.slow
def test_without_a_gpu_it_refuses_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "colocated.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # none, on a GPU machine too
    assert done.returncode == 2 and "no CUDA device here" in done.stderr
    assert not (tmp_path / "colocated.json").exists()


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # as running the script does: it imports gpu_engine beside it
    try:
        import gpu_colocated
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_colocated


def test_the_check_of_handed_over_tensors_finds_a_changed_value_a_moved_row_and_another_version(bench):
    """The negative control of the hand-over's check: it passes the replica the sender makes, and names the tensors
    of one whose values differ, even where their sum does not (two rows swapped)."""
    shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,), "lm_head.weight": (8, 4)}
    cpu = torch.device("cpu")
    sent = {name: bench.replica_tensor(name, shape, 3, cpu, torch.float32) for name, shape in shapes.items()}
    assert bench.mismatched(sent, shapes, 3) == []
    changed = dict(sent, **{"model.norm.weight": sent["model.norm.weight"].clone()})
    changed["model.norm.weight"][1] += 1e-3
    assert bench.mismatched(changed, shapes, 3) == ["model.norm.weight"]
    moved = dict(sent, **{"lm_head.weight": sent["lm_head.weight"][[1, 0, *range(2, 8)]]})
    assert torch.allclose(moved["lm_head.weight"].sum(), sent["lm_head.weight"].sum())  # a sum would miss it
    assert bench.mismatched(moved, shapes, 3) == ["lm_head.weight"]
    assert bench.mismatched(sent, shapes, 4) == sorted(shapes)  # another version's replica
    # A view of another shape (the engine's fused q/k/v) compares in the order the receiver fills it
    viewed = {name: t.view(2, -1, *t.shape[1:]) if t.dim() == 2 else t for name, t in sent.items()}
    assert bench.mismatched(viewed, shapes, 3) == []
