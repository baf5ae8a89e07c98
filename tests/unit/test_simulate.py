"""pat simulate: hand-computed small cases, the real planner inside it, the command and its errors."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pat_operator import planner
from pat_operator.api import parse_job
from pat_operator.fit import GPU, GPUS, SHAPES, ModelShape
from pat_workers.cli import main as pat
from pat_workers.revision import ENGINE_REVISION
from pat_workers.sim import command, placement
from pat_workers.sim import simulate as sim
from pat_workers.sim.lengths import deepscaler_lengths, with_cap_share
from pat_workers.sim.report import compare, headline, summary
from pat_workers.sim.hardware import (ENGINE_PROFILE, Efficiency, EngineCosts, Measured, OtherEngine, Roofline,
                                      SimError, hardware, shard_profile)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = 16
# A pair of ranks whose TP=2 group decodes faster than a TP=1 replica at every batch size.
DECODE = {1: {1: 0.010, 2: 0.012}, 2: {1: 0.004, 2: 0.005}}
PREFILL = {1: (0.002, 1e-5), 2: (0.001, 1e-5)}  # a + b * tokens
COSTS = Measured(EngineCosts(1e9, 0.0, PREFILL, DECODE, {}), kv_bytes_per_token=1000)  # no context term
# ... and one where two TP=1 replicas beat a TP=2 group at batch 8 (4 each), while TP=2 wins at batch 1: the tail.
TAIL = Measured(EngineCosts(1e9, 0.0, PREFILL, {1: {1: 0.010, 8: 0.012}, 2: {1: 0.006, 8: 0.016}}, {}), 1000)
BATCH = [200] + [20] * 7  # one long response, on replica 0 with 3 short ones


def scenario(lengths, world=2, max_batch=8, tp_sizes=(1, 2), margin=0.1, prior=None, **kw) -> sim.Scenario:
    return sim.Scenario(tuple(lengths), PROMPT, max(lengths), world, max_batch, tp_sizes,
                        tuple(prior or lengths), margin=margin, **kw)


def test_two_requests_on_a_pair_fixed_tp1_and_tp2_by_hand():
    s = scenario([10, 4])
    # TP1: a replica each. The long one: prefill 0.002 + 16e-5 s (its first token), then 9 steps at T1(1).
    assert sim.fixed(s, COSTS, 1).seconds == pytest.approx(0.00216 + 9 * 0.010)
    # TP2: one group. Prefill of both (0.001 + 32e-5 s), 3 steps at T2(2) until the short one is done, 6 at T2(1).
    assert sim.fixed(s, COSTS, 2).seconds == pytest.approx(0.00132 + 3 * 0.005 + 6 * 0.004)


def test_a_context_term_by_hand():
    # The table is measured at 64 tokens per sequence; each KV token short of that makes a step 0.1 ms faster.
    costs = Measured(EngineCosts(1e9, 0.0, PREFILL, DECODE, {1: 1e-4}, decode_context=64), kv_bytes_per_token=1000)
    # One request of 10 tokens: prefill samples the first, then 9 steps holding 17, 18, ..., 25 KV tokens.
    assert sim.fixed(scenario([10], world=1, tp_sizes=(1,)), costs, 1).seconds == pytest.approx(
        0.00216 + 9 * 0.010 + 1e-4 * (sum(range(17, 26)) - 9 * 64))


def test_the_pod_merges_when_one_request_is_left():
    s = scenario(BATCH)
    result = sim.pod_planner(s, TAIL)
    assert result.start_layout == (1, 1)  # the bulk: replicas
    (at, old, new, took), = result.regroups
    shorts_done = 0.002 + 4 * PROMPT * 1e-5 + 19 * TAIL.decode(1, 4)[0]
    assert (old, new) == ((1, 1), (2,)) and at >= shorts_done  # no merge before the short ones finished
    # The regroup: the fixed cost plus moving the long request's KV (context x 1000 B at 1 GB/s; cheaper than
    # re-prefilling it at TP2, 0.001 s + 1e-5 s per token), after at most one step of waiting for the barrier.
    move = planner.REGROUP_FIXED_SECONDS + (PROMPT + 200) * 1000 / 1e9
    assert move - 1e-4 < took < move + 0.010
    assert result.seconds < min(sim.fixed(s, TAIL, tp).seconds for tp in (1, 2))
    # Negative control: a margin the gain never beats keeps the TP1 replicas throughout: fixed TP1 exactly.
    never = sim.pod_planner(scenario(BATCH, margin=1e9), TAIL)
    assert never.regroups == [] and never.seconds == sim.fixed(s, TAIL, 1).seconds


def test_a_vllm_pod_moves_a_request_by_re_prefilling_it_and_its_engines_keep_every_layouts_weights():
    """engine vllm: the same merge pays the long request's re-prefill at TP2 (0.001 s + 1e-5 s per context token)
    where this engine moved its KV; and on a GPU model every layout's weights stay beside each group's KV cache."""
    s, vllm = scenario(BATCH), sim.adaptive_pod(scenario(BATCH), TAIL, "vllm")[0]
    assert (s.kv_moves, vllm.kv_moves, sim.adaptive_pod(s, TAIL, "pat")) == (True, False, (s, TAIL))
    (_, _, new, moved), = sim.pod_planner(s, TAIL).regroups
    (_, _, new_vllm, prefilled), = sim.pod_planner(vllm, TAIL).regroups
    assert new == new_vllm == (2,)
    prefill = planner.REGROUP_FIXED_SECONDS + 0.001 + (PROMPT + 200) * 1e-5
    assert prefill - 1e-4 < prefilled < prefill + 0.010 and prefilled > moved
    h200 = hardware("H200", SHAPES["llama-3.1-8b"], Efficiency())
    _, every = sim.adaptive_pod(replace(s, tp_sizes=(1, 2, 4, 8)), h200, "vllm")
    weights = SHAPES["llama-3.1-8b"].params * 2
    for tp in (1, 2, 4, 8):  # the other sizes' shards (1/t of the weights each) take KV tokens away
        others = sum(weights / t for t in (1, 2, 4, 8) if t != tp)
        assert every.kv_capacity(tp) == pytest.approx(h200.kv_capacity(tp) - others // h200._kv_bytes_per_rank(tp),
                                                      abs=1)


def test_a_cap_share_puts_that_share_of_the_drawn_responses_at_the_cap():
    drawn = deepscaler_lengths(1000, 8192, 0)
    capped = with_cap_share(drawn, 8192, 0.125, 0)
    changed = [i for i, (a, b) in enumerate(zip(drawn, capped)) if a != b]
    assert sum(n == 8192 for n in capped) - sum(n == 8192 for n in drawn) == len(changed) <= 125
    assert sum(n == 8192 for n in capped) >= 125 and all(capped[i] == 8192 for i in changed)
    assert with_cap_share(drawn, 8192, 0.125, 0) == capped and with_cap_share(drawn, 8192, 0.0, 0) == drawn


def test_the_pod_policy_calls_the_planner_as_the_coordinator_does(monkeypatch):
    calls = []
    real = planner.plan

    def counted(*args, **kwargs):
        calls.append(kwargs.get("at_boundary", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", counted)
    result = sim.pod_planner(scenario(BATCH, plan_seconds=0.0), TAIL)  # plans not spaced out: due() alone
    # start_batch, then decide() whenever due; it calls plan() unless in flight or cooling down.
    assert calls[0] is True and not any(calls[1:]) and len(calls) <= result.plans
    # Due once a request finished, else every 16 decode steps: the long request alone runs ~180 steps.
    assert 180 // 16 <= result.plans <= len(calls) + 4 and result.plans < 200


def test_the_operator_policy_plans_every_query_interval_from_group_means(monkeypatch):
    seen = []
    real = sim.operator_decide

    def recorded(metrics, tp_sizes, margin):
        seen.append(metrics)
        return real(metrics, tp_sizes, margin)

    monkeypatch.setattr(sim, "operator_decide", recorded)
    s = scenario(BATCH, query_interval=0.1, cooldown_seconds=0.0)
    result = sim.operator_planner(s, TAIL)
    assert [len(r) for r in seen[0].running.values()] == [4, 4]  # four requests per replica, at their means
    assert len({r for reqs in seen[0].running.values() for r in reqs}) == 1  # all alike: one (context, generated)
    assert result.plans == len(seen) and result.regroups[0][1:3] == ((1, 1), (2,))
    assert result.seconds < sim.fixed(s, TAIL, 1).seconds


def test_kv_capacity_queues_and_preempts_requests():
    # One TP1 replica that holds one sequence at a time: the two run one after the other, each with its prefill.
    one_slot = scenario([10, 4], world=1, max_batch=1, tp_sizes=(1,))
    assert sim.fixed(one_slot, COSTS, 1).seconds == pytest.approx(0.00216 + 9 * 0.010 + 0.00216 + 3 * 0.010)
    # A KV cache of 40 tokens: both prompts fit (16 + 16), 17 + 17 after their prefill; 3 steps later it is full
    # (40), so the newer one is preempted with 4 tokens. The older one alone: 6 more steps. Then the newer one is
    # re-prefilled (16 + 4 tokens) and generates its 6 others.
    small = Measured(COSTS.costs, 1000, kv_tokens=40)
    s = scenario([10, 10], world=1, tp_sizes=(1,))
    expected = (0.002 + 32e-5 + 3 * 0.012) + 6 * 0.010 + (0.002 + 20e-5 + 6 * 0.010)
    assert sim.fixed(s, small, 1).seconds == pytest.approx(expected)
    assert sim.fixed(s, COSTS, 1).seconds == pytest.approx(0.00232 + 9 * 0.012)  # negative control: no limit
    # The roofline's KV capacity: memory less the weight shard, over the KV bytes per rank and token.
    shape = ModelShape("toy", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    gpu = GPU("toy", memory_bytes=shape.params * 2 + 52 * shape.kv_bytes_per_token(), hbm_bytes_per_s=1e12,
              bf16_flops=1e15, link_bytes_per_s=1e11, link_latency_s=1e-5, source="test")
    costs = Roofline(gpu, shape, Efficiency(memory_reserve=0.0))
    assert costs.kv_capacity(1) == 52 and costs.kv_capacity(2) > 2 * 52  # a TP2 rank holds half of each token
    pod = sim.Pod(sim.Scenario((10, 10, 10), PROMPT, 10, 1, 8, (1,), (10,)), costs, (1,))
    assert [len(g.running) for g in pod.groups.values()] == [2] and [len(g.queue) for g in pod.groups.values()] == [1]


def test_roofline_decode_by_hand():
    shape = ModelShape("toy", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    gpu = GPU("toy", memory_bytes=1e9, hbm_bytes_per_s=1e12, bf16_flops=1e15, link_bytes_per_s=1e11,
              link_latency_s=1e-5, source="test")
    costs = Roofline(gpu, shape, Efficiency(1.0, 1.0, 1.0, 0.0, 0.0))
    base, per_context = costs.decode(2, 4)
    allreduce = 2 * 2 * (1e-5 + 2 * 1 / 2 * 4 * 64 * 2 / 1e11)
    weights = shape.matmul_params * 2 / 2 / 1e12  # memory-bound at batch 4
    assert base == pytest.approx(allreduce + weights)
    assert per_context == pytest.approx(2 * 2 * 1 * 16 * 2 / 1e12)  # one KV head per rank of a TP2 group
    assert costs.decode(1, 4)[1] == pytest.approx(2 * per_context)


def test_the_oracle_is_not_worse_than_the_planners_here():
    for lengths in (BATCH, [400, 40, 40, 40], [300, 250, 30, 20, 10, 5] * 3):
        s = scenario(lengths)
        best = sim.oracle(s, TAIL).seconds
        assert best <= sim.pod_planner(s, TAIL).seconds + 1e-9
        assert best <= sim.operator_planner(s, TAIL).seconds + 1e-9
        assert best <= min(sim.fixed(s, TAIL, tp).seconds for tp in (1, 2)) + 1e-9


def test_the_summary_against_verls_default_layout():
    s = scenario(BATCH)
    results = compare(s, TAIL)
    seconds = {r.policy: r.seconds for r in results}
    out = summary(results, s, "planner (pod)", 1.0, {}, verl_tp=1)
    assert out["verl_default"] == "fixed TP1"
    assert out["iteration_reduction_vs_verl_default"] == pytest.approx(
        1 - (seconds["planner (pod)"] + 1.0) / (seconds["fixed TP1"] + 1.0), abs=1e-4)
    assert "vs verl's default (fixed TP1)" in headline(out)
    # No such layout on this pod: the keys say so, and the headline leaves it out.
    out = summary(results, s, "planner (pod)", 1.0, {}, verl_tp=4)
    assert out["verl_default"] is None and out["generation_reduction_vs_verl_default"] is None
    assert "verl" not in headline(out)


REDUCTIONS = ("generation_reduction_vs_best_fixed", "iteration_reduction_vs_best_fixed",
              "generation_reduction_vs_verl_default", "iteration_reduction_vs_verl_default", "planner_over_oracle")


def run_pat(argv, capsys):
    code = pat(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def h200_shards() -> dict:
    """One rank's shard per TP size as make gpu-check times them (seconds; made up, not measured)."""
    step = lambda tp, batch, context: 0.002 + 0.014 / tp + batch * 2e-5 + batch * context * 6e-8 / tp  # noqa: E731
    return {"decode": {str(t): {str(c): {str(b): step(t, b, c) for b in (1, 4, 16, 64, 128)} for c in (512, 2048)}
                       for t in (1, 2, 4, 8)},
            "prefill": {str(t): {str(n): 0.01 + n * 2e-5 / t for n in (512, 2048)} for t in (1, 2, 4, 8)}}


def engine_profile(engine: str | None = ENGINE_REVISION, gpu: str = "H200", model: str = "llama-3.1-8b") -> dict:
    """A profile as make gpu-check writes it (bench/gpu_engine.py), of made-up shard timings."""
    profile = shard_profile(h200_shards(), Roofline(GPUS[gpu], SHAPES[model]), "made up for a test")
    stamp = {"commit": "0123abc", "gpu": gpu, "model": model, "dtype": "bfloat16"}
    return ({"engine": engine} if engine else {}) | stamp | profile


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A repository root for pat simulate's preset, without bench/results/gpu-check-engine-profile.json."""
    monkeypatch.setattr(command, "ROOT", tmp_path / "repo")
    (tmp_path / "repo" / ENGINE_PROFILE).parent.mkdir(parents=True)
    return tmp_path / "repo" / ENGINE_PROFILE


def test_the_command_on_a_job_and_a_preset(tmp_path, capsys, checkout):
    checkout.write_text(json.dumps(engine_profile()))
    code, out, _ = run_pat([str(ROOT / "examples" / "local.yaml"), "--out", str(tmp_path / "job")], capsys)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["simulated"] is True and result["planner"] == "planner (pod)" and result["world"] == 2
    assert set(result["policies"]) == {"fixed TP1", "fixed TP2", "planner (pod)", "planner (operator)", "oracle"}
    assert all(Path(p).is_file() for p in result["plots"])
    assert result["verl_default"] == "fixed TP2" and isinstance(result["holdout_error"], float)  # the H200 GPU model
    code, out, _ = run_pat(["--preset", "paper-llama8b", "--cap", "2048", "--out", str(tmp_path / "p")], capsys)
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["best_fixed"] in result["policies"] and result["verl_default"] == "fixed TP2"
    assert 0 < result["holdout_error"] < 0.2 and result["hardware"].startswith("GPU model: H200")
    # ... and the same batch on the engine's measured H200 step costs (make gpu-check's profile), beside
    profile = result["engine_profile"]
    assert profile["hardware"].startswith("measured: made up for a test") and "holdout_error" not in profile
    for costs in (result, profile):
        for key in REDUCTIONS:
            assert isinstance(costs[key], float), key
        verl, planner = (costs["policies"][costs[k]]["generation_seconds"] for k in ("verl_default", "planner"))
        assert costs["generation_reduction_vs_verl_default"] == pytest.approx(1 - planner / verl, abs=1e-4)
    assert result["responses"] == 1024 and result["response_cap"] == 2048 and "fixed TP8" in result["policies"]
    assert "vs verl's default (fixed TP2)" in out


def test_the_command_with_vllm_pods_keeps_the_fixed_layouts_and_runs_the_adaptive_ones_on_vllms_terms(tmp_path,
                                                                                                       capsys):
    runs = {}
    for engine in ("pat", "vllm"):
        code, out, _ = run_pat(["--preset", "paper-llama8b", "--cap", "1024", "--cap-share", "0.125", "--engine",
                                engine, "--out", str(tmp_path / engine)], capsys)
        assert code == 0, out
        runs[engine] = json.loads(out.strip().splitlines()[-1])
        assert runs[engine]["engine"] == engine and ("engine: vllm (adaptive: one engine per group" in out) == (
            engine == "vllm")
    pat_run, vllm_run = runs["pat"], runs["vllm"]
    for tp in (1, 2, 4, 8):  # a fixed layout's vLLM pod runs only its own engines
        assert vllm_run["policies"][f"fixed TP{tp}"] == pat_run["policies"][f"fixed TP{tp}"]
    assert vllm_run["policies"]["oracle"] != pat_run["policies"]["oracle"]  # the adaptive pod's terms differ
    assert "engine_profile" not in vllm_run or vllm_run["engine_profile"] is None  # that profile is this engine's
    assert all(isinstance(vllm_run[key], float) for key in REDUCTIONS)


def test_the_sweep_runs_the_grid_and_reports_each_fixed_layouts_worst_and_best_against_the_planner(capsys):
    code, out, _ = run_pat(["--preset", "paper-llama8b", "--cap", "1024", "--sweep"], capsys)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    points = result["sweep"]
    grid = {(p["cap_share"], p["floor_scale"], p["step_cpu_seconds"]) for p in points}
    assert len(points) == len(grid) == 4 * 3 * 2
    assert {share for share, _, _ in grid} == set(command.SWEEP_CAP_SHARES)
    for layout in ("fixed TP1", "fixed TP2", "fixed TP4", "fixed TP8"):
        ratios = [p["fixed_over_planner"][layout] for p in points]
        assert (result["fixed_worst_over_planner"][layout], result["fixed_best_over_planner"][layout]) == (
            max(ratios), min(ratios))
        assert f"{layout}: worst {max(ratios):.3f}, best {min(ratios):.3f}" in out
    assert result["planner_worst_over_best_fixed"] == pytest.approx(
        max(1 / min(p["fixed_over_planner"].values()) for p in points), abs=1e-4)
    # The terms vary the costs: a doubled per-layer floor or a per-step CPU time makes every batch slower.
    by = {(p["cap_share"], p["floor_scale"], p["step_cpu_seconds"]): p["planner_seconds"] for p in points}
    assert by[(0.0, 2.0, 0.0)] > by[(0.0, 1.0, 0.0)] > by[(0.0, 0.5, 0.0)] and by[(0.0, 1.0, 0.0025)] > by[
        (0.0, 1.0, 0.0)]


@pytest.mark.parametrize("argv,message", [
    (["--preset", "paper-gpt5"], "known: paper-llama8b, paper-qwen14b"),
    (["--preset", "paper-llama8b", "--hardware", "TPU"],
     "not a built-in GPU (A100-40GB, A100-80GB, H100-PCIe, H100-SXM, H200, L40S)"),
    (["--preset", "paper-llama8b", "--model", "gpt2"], "--model 'gpt2' is unknown; known: llama-3.1-8b"),
    ([str(ROOT / "examples" / "llama-3.1-8b.yaml")], "pass --model-config /models/Llama-3.1-8B-Instruct/config.json"),
    ([], "give a job YAML or --preset NAME"),
    (["--preset", "paper-llama8b", "--cap-share", "1.5"], "--cap-share=1.5: give a share in [0, 1]"),
    (["--preset", "paper-llama8b", "--cap-share", "0.1", "--lengths", "x.json"], "(not with --lengths"),
    (["--preset", "paper-llama8b", "--cap-share", "0.1", "--sweep"], "nor with --sweep, which varies it"),
])
def test_bad_input_names_the_flag_and_the_fix(argv, message, capsys):
    code, _, err = run_pat(argv, capsys)
    assert code == 2 and message in err, err


def test_no_guard_reaches_the_pods_controller():
    for argv in (["--preset", "paper-llama8b"], [str(ROOT / "examples" / "local.yaml")]):
        for flags, guard in (([], True), (["--no-guard"], False)):
            args = command.parser().parse_args(argv + flags)
            setup = (command._from_preset if args.preset else command._from_job)(args, Efficiency())
            assert setup.scenario.guard is guard


def test_the_command_takes_a_measured_profile(tmp_path, capsys):
    profile = {"engine": ENGINE_REVISION, "commit": "0123abc", "link_bytes_per_s": 1e9, "link_latency_s": 0.0,
               "prefill": {t: list(ab) for t, ab in PREFILL.items()},
               "decode": {t: row for t, row in TAIL.costs.decode.items()}, "dtype": "float32", "source": "a test"}
    (tmp_path / "cpu.json").write_text(json.dumps(profile))
    code, out, _ = run_pat([str(ROOT / "examples" / "local.yaml"), "--hardware", str(tmp_path / "cpu.json"),
                            "--out", str(tmp_path)], capsys)
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["hardware"].startswith("measured: a test") and result["holdout_error"] is None
    # In this profile a TP2 step of the whole batch costs more than a TP1 step of half of it: replicas win.
    times = {name: p["generation_seconds"] for name, p in result["policies"].items()}
    algorithm = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())["spec"]["algorithm"]
    assert times["fixed TP1"] < times["fixed TP2"]
    assert result["responses"] == algorithm["promptsPerIteration"] * algorithm["samplesPerPrompt"]
    # A measured profile has no GPU model terms to vary: --sweep says so.
    code, _, err = run_pat([str(ROOT / "examples" / "local.yaml"), "--hardware", str(tmp_path / "cpu.json"),
                            "--sweep"], capsys)
    assert code == 2 and "--sweep varies the GPU model's terms: give a GPU (--hardware NAME)" in err, err


def test_bad_files_name_the_flag(tmp_path, capsys):
    (tmp_path / "lengths.json").write_text('{"a": 1}')
    code, _, err = run_pat(["--preset", "paper-llama8b", "--lengths", str(tmp_path / "lengths.json")], capsys)
    assert code == 2 and "--lengths" in err and "JSON list of integers" in err
    (tmp_path / "gpu.json").write_text('{"name": "x"}')
    with pytest.raises(SimError, match="--hardware .*gpu.json"):
        hardware(str(tmp_path / "gpu.json"), ModelShape("toy", 64, 128, 2, 4, 2, 16, 100), Efficiency())


def test_the_engines_costs_round_trip_through_json():
    code = ("import json; from pat_workers.engine.costs import Costs; "
            "print(json.dumps(Costs(2e9, 1e-4, {1: (0.01, 1e-4)}, {1: {1: 0.02, 4: 0.03}}, {1: 1e-6})"
            ".to_json('float32', 'cpu')))")
    d = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    costs = Measured(EngineCosts.from_json(d, "test"), kv_bytes_per_token=1)
    # Interpolated through planner.Profile, measured at 64 tokens per sequence: (at 0 tokens, per KV token)
    assert costs.decode(1, 2) == (pytest.approx(0.02 + 0.01 / 3 - 2 * 64e-6), 1e-6)
    assert planner.Profile.from_json(d).step_seconds(1, 2, 2 * 64 + 1000) == pytest.approx(0.02 + 0.01 / 3 + 1e-3)
    assert costs.prefill_seconds(1, [100]) == pytest.approx(0.02) and costs.kv_capacity(1) == math.inf


def test_lengths_from_a_file_or_an_earlier_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "rollouts" / "iter-0001.json").write_text(json.dumps([{"id": "0.0", "tokens": [1] * 300},
                                                                 {"id": "0.1", "tokens": [1] * 20}]))
    (tmp_path / "lengths.json").write_text(json.dumps([300, 20]))
    for source in (run, tmp_path / "lengths.json"):
        code, out, _ = run_pat(["--preset", "paper-llama8b", "--lengths", str(source), "--out", str(tmp_path)], capsys)
        result = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and result["responses"] == 2 and result["mean_response_tokens"] == 160


def test_an_engine_profile_is_its_measured_shards_plus_modelled_all_reduces():
    shards, roofline = h200_shards(), Roofline(GPUS["H200"], SHAPES["llama-3.1-8b"])
    costs = Measured(EngineCosts.from_json(engine_profile(), "test"), SHAPES["llama-3.1-8b"].kv_bytes_per_token())
    step = lambda tp, batch, context: costs.decode(tp, batch)[0] + costs.decode(tp, batch)[1] * batch * context  # noqa: E731
    # Both measured contexts come back at the largest batch, the all-reduces of its tokens added; TP=1 has none.
    for tp, context in ((1, 512), (1, 2048), (8, 512), (8, 2048)):
        measured = shards["decode"][str(tp)][str(context)]["128"]
        assert step(tp, 128, context) == pytest.approx(measured + roofline.allreduce_seconds(tp, 128))
    assert roofline.allreduce_seconds(1, 128) == 0 < roofline.allreduce_seconds(8, 1)
    assert costs.prefill_seconds(2, [512]) == pytest.approx(0.01 + 512 * 1e-5 + roofline.allreduce_seconds(2, 512))


@pytest.mark.parametrize("engine,measured", [("contiguous-0", "engine revision 'contiguous-0' at commit 0123abc"),
                                             (None, 'no "engine" field')])
def test_a_profile_of_another_engine_is_refused(tmp_path, capsys, engine, measured):
    """--hardware FILE of another engine revision (or of none: files from before results named one) is refused,
    naming the file, what it measured, the current revision and how to measure it; the current revision's is read."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(engine_profile(engine)))
    with pytest.raises(OtherEngine) as refused:
        hardware(str(path), SHAPES["llama-3.1-8b"], Efficiency())
    message = str(refused.value)
    assert message.startswith(f"--hardware {path} measured ") and measured in message
    assert f"not the current engine ({ENGINE_REVISION!r}): there is no profile of the current engine in it" in message
    assert f"`make gpu-check` on a GPU writes {ENGINE_PROFILE}" in message
    code, _, err = run_pat(["--preset", "paper-llama8b", "--hardware", str(path)], capsys)
    assert code == 2 and message in err
    path.write_text(json.dumps(engine_profile(ENGINE_REVISION)))
    assert hardware(str(path), SHAPES["llama-3.1-8b"], Efficiency()).description.startswith("measured: made up")


def test_the_preset_says_when_it_has_no_profile_of_the_current_engine(checkout):
    """paper-llama8b runs beside make gpu-check's profile of the current engine on an H200, and otherwise says why
    not, naming the file and make gpu-check: absent, of another engine revision, of another GPU."""
    preset, shape = command.PRESETS["paper-llama8b"], SHAPES["llama-3.1-8b"]
    costs, why = command._engine_profile(preset, shape)
    assert costs is None and why == (f"no profile of the current engine on an H200: {ENGINE_PROFILE} is absent; "
                                     f"`make gpu-check` on an H200 writes it (docs/benchmarks.md). Simulated on the "
                                     f"GPU model alone.")
    checkout.write_text(json.dumps(engine_profile("contiguous-0")))
    costs, why = command._engine_profile(preset, shape)
    assert costs is None and why.startswith(f"{ENGINE_PROFILE} measured engine revision 'contiguous-0' at commit "
                                            f"0123abc, not the current engine ({ENGINE_REVISION!r})")
    assert "`make gpu-check` on a GPU writes" in why
    checkout.write_text(json.dumps(engine_profile(gpu="H100-SXM")))
    costs, why = command._engine_profile(preset, shape)
    assert costs is None and "measured llama-3.1-8b on H100-SXM, not this preset's llama-3.1-8b on H200" in why
    checkout.write_text(json.dumps(engine_profile()))
    costs, why = command._engine_profile(preset, shape)
    assert why is None and isinstance(costs, Measured) and sorted(costs.costs.decode) == [1, 2, 4, 8]
    checkout.write_text("{")
    with pytest.raises(SimError, match=f"{ENGINE_PROFILE}: .*`make gpu-check`"):
        command._engine_profile(preset, shape)


def test_no_results_of_the_replaced_engine_are_left():
    """Every results file names the commit it measured, and every engine profile this engine's revision."""
    for path in (ROOT / "bench" / "results").glob("*.json"):
        d = json.loads(path.read_text())
        assert "commit" in d, path
        if "decode" in d:
            hardware(str(path), SHAPES["llama-3.1-8b"], Efficiency())  # OtherEngine if not of this revision


# --- placement: colocated and separate at the same GPU count ------------------------------------------------------

def test_placements_at_the_same_gpus_on_the_paper_preset(tmp_path, capsys, checkout):
    """paper-llama8b's setup (one generator pod, 8 trainer GPUs: separate, as before) against its 16 GPUs colocated:
    2 pods generate half the batch each, all 16 train (half the time), and the switch between phases is added."""
    code, out, _ = run_pat(["--preset", "paper-llama8b", "--placement", "both", "--out", str(tmp_path)], capsys)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    separate, colocated = result["placements"]["separate"], result["placements"]["colocated"]
    planner = result["policies"]["planner (pod)"]
    # Separate is the preset as before (docs/simulate.md: 74.40 s generation, 72.78 s training).
    assert result["placement"] == "separate" and result["train_seconds"] == pytest.approx(72.78, abs=0.005)
    assert separate["generation_seconds"] == planner["generation_seconds"] == pytest.approx(74.40, abs=0.005)
    assert separate["iteration_seconds"] == planner["iteration_seconds"] and separate["switch_seconds"] == 0
    assert (separate["gpus"], colocated["gpus"], colocated["generator_pods"], colocated["trainer_gpus"]) == (16, 16, 2,
                                                                                                           16)
    assert colocated["train_seconds"] == pytest.approx(separate["train_seconds"] / 2, abs=1e-3)
    weights = SHAPES["llama-3.1-8b"].params * 2
    handover = weights * 15 / 16 / placement.NETWORK_BYTES_PER_S + 2 * weights / GPUS["H200"].hbm_bytes_per_s
    assert colocated["switch_seconds"] == pytest.approx(placement.MEMORY_SWITCH_SECONDS + handover, abs=1e-3)
    assert colocated["generation_seconds"] < 0.8 * separate["generation_seconds"]  # 512 responses per pod, not 1024
    ratio = result["colocated_over_separate_iteration"]
    assert ratio == pytest.approx(colocated["iteration_seconds"] / separate["iteration_seconds"], abs=1e-4)
    assert ratio < 0.7 and f"colocated / separate iteration: {ratio:.3f}" in out


def test_placements_of_a_job_at_its_gpu_count(tmp_path, capsys):
    """The Llama example, colocated on 3 pods of 8 H100s, against 2 generator pods and a trainer pod of the same."""
    code, out, _ = run_pat([str(ROOT / "examples" / "llama-3.1-8b.yaml"), "--model", "llama-3.1-8b", "--placement",
                            "both", "--out", str(tmp_path)], capsys)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    separate, colocated = result["placements"]["separate"], result["placements"]["colocated"]
    assert result["placement"] == "colocated" and result["gpus"] == 24 and "placements at 24 GPUs" in out
    assert (separate["generator_pods"], separate["trainer_gpus"], colocated["generator_pods"]) == (2, 8, 3)
    assert separate["train_seconds"] == pytest.approx(3 * colocated["train_seconds"], abs=1e-3)  # the same tokens
    assert colocated["generation_seconds"] < separate["generation_seconds"]  # 352 responses per pod, not 512
    assert result["colocated_over_separate_iteration"] < 0.7
    assert result["switch_seconds"] == colocated["switch_seconds"] > placement.MEMORY_SWITCH_SECONDS


def test_colocated_gpus_keep_the_trainers_states_beside_the_kv_cache():
    """The trainer rank's resident states take their part of a colocated GPU: less KV cache in the GPU model."""
    shape = ModelShape("toy", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    gpu = GPU("toy", memory_bytes=shape.params * 2 + 52 * shape.kv_bytes_per_token(), hbm_bytes_per_s=1e12,
              bf16_flops=1e15, link_bytes_per_s=1e11, link_latency_s=1e-5, source="test")
    alone = Roofline(gpu, shape, Efficiency(memory_reserve=0.0))
    beside = Roofline(gpu, shape, Efficiency(memory_reserve=0.0), reserved_bytes=20 * shape.kv_bytes_per_token())
    assert (alone.kv_capacity(1), beside.kv_capacity(1)) == (52, 32)
    # A separate job's GPUs colocated: the trainer's states over all 24 GPUs (fit.trainer_resident_bytes).
    doc = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b.yaml").read_text())
    doc["spec"].update(placement="separate")
    doc["spec"]["generator"]["replicas"] = 2
    doc["spec"]["trainer"].update(replicas=1, gpusPerPod=8)
    placements, none = placement.job_placements(parse_job(doc).spec, SHAPES["llama-3.1-8b"])
    assert none == {} and placements["separate"] == placement.Placement("separate", 2, 8, 8)
    resident = 16 * SHAPES["llama-3.1-8b"].params / 24  # fp32 parameters, AdamW's moments, the reference
    assert placements["colocated"] == placement.Placement("colocated", 3, 8, 24, resident)
    # Within one pod the hand-over is over NVLink, not the network.
    one_pod = placement.Placement("colocated", 1, 8, 8)
    weights = SHAPES["llama-3.1-8b"].params * 2
    assert placement.handover_seconds(SHAPES["llama-3.1-8b"], GPUS["H200"], one_pod) == pytest.approx(
        weights * 7 / 8 / (0.8 * GPUS["H200"].link_bytes_per_s) + 2 * weights / GPUS["H200"].hbm_bytes_per_s)


def test_a_placement_without_a_split_at_the_gpu_count_is_refused(capsys):
    """local.yaml is one colocated pod: separate needs a trainer pod and a generator pod."""
    code, _, err = run_pat([str(ROOT / "examples" / "local.yaml"), "--placement", "separate"], capsys)
    assert code == 2 and err == ("pat simulate: --placement separate: one pod has no separate split of its GPUs (a "
                                 "trainer pod and a generator pod take two); use --placement colocated\n")
