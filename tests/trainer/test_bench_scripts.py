"""The trainer's benchmark scripts run end to end here: bench/gpu_check.py's code path on CPU (--smoke),
bench/trainer_memory.py on the test model (--quick), whose sharding it measures, and bench/trainer_throughput.py
(--quick); and the engine's
bench/engine_capacity.py (--quick); and bench/placement.py on a job of a few tokens (both placements, one steady
iteration each)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)

ROOT = Path(__file__).parents[2]


def run_script(*args: str, timeout: float) -> dict:
    """The script's last stdout line (one JSON object), after it exits 0."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gpu_check_smoke_trains_a_step_and_writes_only_where_asked(tmp_path):
    results = ROOT / "bench" / "results"
    listing = lambda: {p.name: p.stat().st_mtime_ns for p in results.glob("*")}  # noqa: E731 (none: no folder)
    before = listing()
    out = tmp_path / "check.json"
    result = run_script("bench/gpu_check.py", "--smoke", "--out", str(out), timeout=120)
    assert json.loads(out.read_text()) == result
    assert listing() == before  # on CPU: nothing in bench/results
    assert "error" not in result and result["smoke"] is True and result["commit"]  # the commit it measured
    assert len(result["step_seconds"]) == 3 and result["model_flops"] > 0 and result["mfu"] >= 0
    assert result["estimate_bytes"] > result["estimate_state_bytes"] > 0
    # The states measured are the estimate's: fp32 parameters, gradients and AdamW's two moments (+ its step counts).
    assert sum(result["state_bytes"].values()) == pytest.approx(result["estimate_state_bytes"], rel=1e-3)
    assert result["state_bytes"]["gradients"] == result["state_bytes"]["parameters"] == 4 * result["params"]


def test_trainer_memory_quick_measures_the_shards():
    result = run_script("bench/trainer_memory.py", "--quick", timeout=300)
    worlds, params = result["worlds"], result["params"]
    assert set(worlds) == {"1", "2", "4"}
    for world, w in worlds.items():
        # Every rank holds 1/world of the 16 bytes per parameter (AdamW's step counts add a few bytes); one rank
        # holds all of them: what the ratio is measured against.
        assert all(b == pytest.approx(16 * params / int(world), rel=1e-3) for b in w["state_bytes_ranks"])
        assert w["state_bytes_per_rank"] == max(w["state_bytes_ranks"]) and w["peak_rss_bytes"] > 0
    assert result["state_bytes_per_rank_ratio_4_over_1"] < 0.5
    assert result["estimate_error"] <= 0.15


def test_engine_capacity_quick_measures_the_paged_cache(tmp_path):
    result = run_script("bench/engine_capacity.py", "--quick", "--models", str(tmp_path), timeout=120)
    # The default budget is 8 maxSeq slots; the same bytes as blocks keep more of the lognormal batch running. The
    # schedule counts blocks only, so these hold exactly.
    assert result["slots_sequences"] == 8 and result["budget_bytes"] == 8 * result["max_seq"] * 512  # test model
    assert result["paged_sequences_peak"] >= result["paged_sequences_mean"] > result["slots_sequences"]
    assert result["capacity_ratio"] == pytest.approx(result["paged_sequences_mean"] / 8, abs=1e-3)
    assert result["recomputed_tokens"] >= 0 and result["preemptions"] >= 0
    # Timings only exist: the quick model's step is mostly sampling, and a shared CPU can even invert the two.
    assert result["tokens_per_s_paged"] > 0 and result["tokens_per_s_slots"] > 0
    assert result["sampling_share"] > 0 and result["sampling_share_top_p"] > 0


def test_placement_smoke_runs_both_placements(tmp_path):
    # The smallest job that runs both placements end to end, taking turns (2 iterations, the first is warm-up): the
    # timings are noise here, the fields and where they come from are what is checked.
    result = run_script("bench/placement.py", "--iterations", "2", "--prompts", "4", "--max-tokens", "16",
                        "--micro-tokens", "512", "--quiet-wait", "0", "--out", str(tmp_path), timeout=240)
    assert json.loads((tmp_path / "placement.json").read_text()) == result
    assert result["restarts"] == {"colocated": 0, "separate": 0}
    assert [it for it, _, _ in result["iteration_pairs"]] == [2] and result["pairs"] == 1
    for variant in ("colocated", "separate"):
        assert result[f"{variant}_generate_seconds"] > 0 and result[f"{variant}_train_seconds"] > 0
        assert len(result["other_cores"][variant]) == 1
    (_, colocated, separate), = result["iteration_pairs"]
    assert result["colocated_over_separate_iteration"] == pytest.approx(colocated / separate, rel=1e-2)
    assert result["colocated_switch_seconds_per_iteration"] > 0
    # The engines hand their KV pools back while the trainer trains, and take them again.
    assert result["colocated_engine_memory_held_bytes"] > result["colocated_engine_memory_released_bytes"] > 0


def test_trainer_throughput_quick_runs_every_variant():
    result = run_script("bench/trainer_throughput.py", "--quick", "--repeats", "1", timeout=240)
    # Timings only exist here: the test model's steps are too short to tell the variants apart.
    for variant in ("padded", "packed", "recompute"):
        assert result[f"{variant}_tokens_per_s"] > 0 and len(result["seconds"][variant]) == 2  # warm-up + 1
    assert result["packed_balanced_over_padded_tokens_per_s"] == pytest.approx(
        result["packed_tokens_per_s"] / result["padded_tokens_per_s"], rel=1e-2)
    assert result["ranks"] == 2 and result["tokens"] > result["sequences"] * 32  # the prompts and the responses
