"""make gpu-check's engine part (bench/gpu_engine.py) runs here on CPU (--smoke) through the code it runs on a GPU,
and the test-only way for engine ranks to share one GPU (EngineOptions.device "cuda-shared") keeps the production
rule: a pod with fewer GPUs than ranks fails."""

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pat_operator.fit import tiny_shape
from pat_workers.engine.comm import CommunicatorPool, TorchCommunicator, process_group_options
from pat_workers.engine.rank import EngineOptions, _device
from pat_workers.revision import ENGINE_REVISION
from pat_workers.sim.hardware import measured_profile
from tests.engine.multiproc import run_ranks

ROOT = Path(__file__).parents[2]
SCRIPT = "bench/gpu_engine.py"


def run(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gpu-engine")
    out, profile = folder / "engine.json", folder / "profile.json"
    # --timeout: the watchdog's, above the default 270 s, which a loaded 2-core machine compiling FlexAttention reaches
    done = run("--smoke", "--out", str(out), "--profile-out", str(profile), "--timeout", "450", timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result == json.loads(done.stdout.strip().splitlines()[-1])  # the file is what it printed last
    return result | {"profile_file": json.loads(profile.read_text())}


@pytest.mark.slow
def test_smoke_writes_every_section(smoke):
    assert smoke["smoke"] is True and smoke["failed"] == [] and "error" not in smoke
    assert smoke["engine"] == ENGINE_REVISION and smoke["commit"]  # what it measured: this engine at this commit
    for section in ("bandwidth", "capacity", "model", "decode", "profile", "regroup", "compile"):
        assert smoke[section]["status"] == "done", smoke[section]
    capacity = smoke["capacity"]
    assert capacity["sequences_per_gpu"] > 0 and capacity["limited_by"] in ("maxBatch", "memory")
    for case in ("batch1", "batch128"):
        decode = smoke["decode"][case]
        for mode in ("eager", "captured"):
            assert decode[mode]["step_ms"] > 0 and decode[mode]["roofline_fraction"] > 0
        assert decode["graphs"] >= 1  # the engine's graph path ran (on CPU: the stand-in for CUDA graphs)
        assert {"host_ms", "decode_ms"} <= decode["captured"].keys() and "pass_host" in decode
        assert decode["sdpa_backends"]["MATH"] is True
    assert smoke["compile"]["step_ms"] > 0


@pytest.mark.slow
def test_smoke_writes_an_engine_profile_pat_simulate_reads(smoke):
    profile = smoke["profile_file"]
    # The GPU it measured (here none: no preset takes it for an H200's), the engine's revision, the commit
    assert (profile["engine"], profile["gpu"], profile["dtype"]) == (ENGINE_REVISION, "cpu", "float32")
    assert profile["commit"] == smoke["commit"]
    # One rank's shard per TP size the test model's 4 KV heads allow, at both batches
    assert set(profile["decode"]) == {"1", "2", "4"}
    assert all(set(row) == {"1", "4"} for row in profile["decode"].values())
    costs = measured_profile(profile, tiny_shape("test"), "the smoke profile")  # of this revision: accepted
    assert costs.decode(2, 4)[0] > 0 and costs.prefill_seconds(1, [16]) > 0


@pytest.mark.slow
def test_smoke_regroups_match_and_the_negative_control_is_caught(smoke):
    regroup = smoke["regroup"]
    assert regroup["pass"] is True
    assert len(regroup["cases"]) == 12 and regroup["not_applied"] == 0
    assert {(c["ranks"], c["migration"]) for c in regroup["cases"]} == {(w, m) for w in (2, 4)
                                                                         for m in ("kv", "recompute")}
    assert regroup["mismatches"] == {"vs_fp32": 0, "vs_bf16_single_rank": 0, "vs_fp32_model": 0}
    assert all(c["vs_fp32_model"]["tokens"] > 0 and c["moved"] > 0 for c in regroup["cases"])
    # The checks can fail: a corrupted weight slice on one rank is caught by each of them.
    assert min(regroup["negative_control"]["mismatched"].values()) > 0
    assert regroup["teacher_forcing"]["fp32_oracle_vs_fp32_engine"] < 1e-3
    # TP=1 steps ran in (stand-in) graphs before and after the regroups; TP>1 steps eagerly (gloo: no capture).
    for world in (2, 4):
        graphs = regroup[f"graphs_{world}_ranks"]
        assert graphs["captures"] > 0 and graphs["graph_steps"] > 0 and graphs["eager_steps"] > 0


@pytest.mark.slow
def test_without_a_gpu_it_refuses_and_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = run("--out", str(tmp_path / "engine.json"), timeout=120)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr
    assert not (tmp_path / "engine.json").exists()


@pytest.mark.slow
def test_watchdog_leaves_the_results_and_no_ranks(tmp_path):
    """A run past --timeout ends with what it measured and where it was, and takes its engine ranks down with it:
    rank 1 of the first multi-rank generator stalls in its first regroup (the ranks inherit the script's environment),
    so the watchdog fires while ranks run, however fast the machine."""
    out = tmp_path / "engine.json"
    started = time.monotonic()
    done = run("--smoke", "--out", str(out), "--sections", "capacity", "regroup", "--timeout", "20", timeout=120,
               env={"PAT_FAILPOINTS": "regroup.share@1~600"})
    assert done.returncode == 3 and time.monotonic() - started < 90, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["capacity"]["status"] == "done"
    assert result["error"].startswith("watchdog: --timeout 20 s passed in section regroup")
    assert result["killed"], "the watchdog fired while ranks ran: it kills them"
    deadline = time.monotonic() + 10
    while any(map(_alive, result["killed"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, result["killed"])), "ranks left behind"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # a zombie is dead, only not yet reaped


# -- ranks sharing one GPU (EngineOptions.device "cuda-shared") -------------------------------------------------
@pytest.mark.parametrize("rank", [0, 3])
def test_cuda_shared_puts_every_rank_on_gpu_0(rank):
    assert _device(rank, 4, "cuda-shared", 1) == torch.device("cuda", 0)


def test_cuda_shared_needs_a_gpu_and_the_production_rule_stays():
    with pytest.raises(RuntimeError, match="device='cuda-shared', but the generator pod has no GPU"):
        _device(0, 4, "cuda-shared", 0)
    with pytest.raises(RuntimeError, match=r"1 GPU\(s\) for 4 engine ranks"):  # never silently shared
        _device(0, 4, "cuda", 1)
    with pytest.raises(RuntimeError, match=r"2 GPU\(s\) for 4 engine ranks"):
        _device(0, 4, "auto", 2)


@pytest.mark.parametrize("backend", ["shm", "nccl"])
def test_cuda_shared_communicates_over_gloo_only(backend):
    assert EngineOptions(device="cuda-shared", comm_backend="gloo").device == "cuda-shared"
    with pytest.raises(ValueError, match="ranks sharing a GPU .* use auto or gloo"):
        EngineOptions(device="cuda-shared", comm_backend=backend)


def test_shared_gpu_world_group_is_gloo_with_torchs_default_timeout():
    gpu = torch.device("cuda", 0)
    assert process_group_options(gpu, 7.5, shared=True) == {"backend": "gloo"}  # as on CPU (see its docstring)
    assert process_group_options(gpu, 7.5) == {"backend": "nccl", "timeout": datetime.timedelta(seconds=7.5),
                                               "device_id": gpu}


def _collectives(rank: int, world: int, device: str | None, stage: bool) -> dict:
    # auto: what rank_main asks for (comm_backend auto); gloo on CPU, where auto would take shared memory
    pool = CommunicatorPool.build(rank, world, backend="auto" if device else "gloo", timeout=30.0,
                                  device=torch.device(device) if device else None)
    comm = pool.get((0, 1))
    assert isinstance(comm, TorchCommunicator)
    comm._stage = comm._stage or stage  # on CPU: staging's code path, without the copies a GPU would need
    out = {"backend": pool.backend, "stage": comm._stage, "objects": comm.all_gather_object(rank),
           "broadcast": comm.broadcast_object({"from": rank}, src=1)}
    if device is None:  # tensors on CPU (a GPU-tagged communicator would stage to CUDA memory there is none of)
        t = torch.arange(6.0).view(2, 3).t() * (rank + 1)  # not contiguous
        comm.all_reduce_(t)
        out["sum"] = t.tolist()
        out["gather"] = [x.tolist() for x in comm.all_gather(torch.full((2,), rank, dtype=torch.bfloat16))]
        received = comm.all_to_all([None if i == rank else torch.full((3,), 10 * rank + i) for i in range(world)])
        out["all_to_all"] = [None if x is None else x.tolist() for x in received]
        comm.barrier()
    pool.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [False, True])
def test_gloo_collectives_of_the_engine(stage):
    """Every collective the engine uses, over gloo, through the staging path too."""
    for rank, out in enumerate(run_ranks(_collectives, 2, None, stage, timeout=90)):
        assert out["stage"] is stage and out["backend"] == "gloo"
        assert out["objects"] == [0, 1] and out["broadcast"] == {"from": 1}
        assert out["sum"] == (torch.arange(6.0).view(2, 3).t() * 3).tolist()
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_to_all"] == [None if i == rank else [10 * i + rank] * 3 for i in range(2)]


@pytest.mark.slow
def test_a_gpu_under_a_gloo_world_makes_auto_gloo_and_stages():
    """What a cuda-shared rank builds: gloo communicators (shm handles CPU tensors only) that stage."""
    for rank, out in enumerate(run_ranks(_collectives, 2, "cuda:0", False, timeout=90)):
        assert (out["backend"], out["stage"]) == ("gloo", True)
        assert out["objects"] == [0, 1] and out["broadcast"] == {"from": 1}

