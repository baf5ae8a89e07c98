"""Failing fast (issue 17): a pod with too few GPUs fails at start, the shared-memory communicator refuses CPUs whose
memory ordering it was not written for, and a failed NCCL collective fails the rank instead of the in-pod fallback.

NCCL needs GPUs, so its path is checked here through the options it is given and, for the fail-fast rule, a gloo
group standing in for it; the NCCL path itself runs on GPU machines only."""

import dataclasses
import datetime
import os

import pytest
import torch

from pat_workers.engine import comm
from pat_workers.engine.comm import (CommError, CommunicatorPool, ShmCommunicator, TorchCommunicator, nccl_env,
                                     process_group_options, shm_supported)
from pat_workers.engine.generator import GeneratorError, LocalGenerator
from pat_workers.engine.rank import _device
from tests.engine.multiproc import run_ranks

from .conftest import OPTIONS

CPU = torch.device("cpu")


@pytest.mark.parametrize("choice, gpus, expected", [
    ("cpu", 0, CPU), ("cpu", 2, CPU), ("cpu", 8, CPU),  # asked for: CPU whatever the pod has
    ("auto", 0, CPU),  # a CPU pod
    ("auto", 4, torch.device("cuda", 3)), ("auto", 8, torch.device("cuda", 3)), ("cuda", 4, torch.device("cuda", 3)),
])
def test_device_per_rank(choice, gpus, expected):
    assert _device(3, 4, choice, gpus) == expected


@pytest.mark.parametrize("choice, gpus, message", [
    ("auto", 2, r"2 GPU\(s\) for 4 engine ranks.*generator.gpusPerPod to 4 or generator.ranksPerPod to 2"),
    ("cuda", 1, r"1 GPU\(s\) for 4 engine ranks.*generator.gpusPerPod to 4 or generator.ranksPerPod to 1"),
    ("cuda", 0, "device='cuda', but the generator pod has no GPU.*generator.gpusPerPod to 4"),
])
def test_too_few_gpus_fail_naming_the_spec_fields(choice, gpus, message):
    with pytest.raises(RuntimeError, match=message):
        _device(0, 4, choice, gpus)


@pytest.mark.slow
def test_pod_without_gpus_fails_at_start(model_dir):
    """The rule above inside real ranks: the generator fails to start with the reason, nothing hangs."""
    gen = LocalGenerator(model_dir, 2, dataclasses.replace(OPTIONS, device="cuda"))
    try:
        with pytest.raises(GeneratorError, match="set generator.gpusPerPod to 2"):
            gen.start(timeout=60)
    finally:
        gen.close()


@pytest.mark.parametrize("machine, ok", [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False),
                                         ("ppc64le", False), ("riscv64", False)])
def test_shm_supported_on_x86_64_only(machine, ok):
    assert shm_supported(machine) is ok


def test_shm_refuses_other_cpus(monkeypatch, tmp_path):
    monkeypatch.setattr(comm.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(comm, "_shm_candidates", lambda: [str(tmp_path)])
    with pytest.raises(ValueError, match=r"this CPU is aarch64: use comm_backend gloo \(--comm-backend gloo\)"):
        ShmCommunicator((0, 1), 0, prefix="pat-shm-test")
    assert os.listdir(tmp_path) == []  # refused before creating its segment


def _build(rank: int, world: int, machine: str | None) -> dict:
    if machine:  # this process only: run_ranks spawns a fresh one per rank
        comm.platform.machine = lambda: machine
    pool = CommunicatorPool.build(rank, world, timeout=30.0)
    pair = pool.get((0, 1))
    out = {"backend": pool.backend, "hot": type(pair).__name__, "sum": pair.all_reduce_(torch.ones(3)).tolist()}
    pool.close()
    try:
        CommunicatorPool.build(rank, world, backend="shm", timeout=30.0).close()
    except CommError as e:
        out["shm"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("machine, backend, hot", [(None, "shm", "ShmCommunicator"),
                                                   ("aarch64", "gloo", "TorchCommunicator")])
def test_auto_backend_follows_the_cpu(machine, backend, hot):
    for out in run_ranks(_build, 2, machine):
        assert (out["backend"], out["hot"], out["sum"]) == (backend, hot, [2.0] * 3)
        if machine:  # every rank fails together, with the fix in the message
            assert "use comm_backend gloo" in out["shm"]
        else:
            assert "shm" not in out


def test_nccl_options_carry_the_timeout():
    gpu = torch.device("cuda", 1)
    assert process_group_options(gpu, 7.5) == {"backend": "nccl", "timeout": datetime.timedelta(seconds=7.5),
                                               "device_id": gpu}
    assert process_group_options(CPU, 7.5) == {"backend": "gloo"}


def test_nccl_async_error_handling_on_unless_set():
    assert nccl_env({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}
    assert nccl_env({"NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}


def _nccl_peer_dies(rank: int, world: int):
    pool = CommunicatorPool.build(rank, world, backend="gloo", timeout=30.0)
    pair = pool.get((0, 1))
    assert isinstance(pair, TorchCommunicator)
    pair.barrier()
    if rank == 1:
        os._exit(1)
    pair.device = torch.device("cuda", 0)  # what a rank on a GPU has: TorchCommunicator takes its NCCL path
    with pytest.raises(RuntimeError) as failure:
        pair.all_reduce_(torch.ones(4))
    return type(failure.value).__name__, str(failure.value)


@pytest.mark.slow
def test_nccl_failure_fails_the_rank():
    """Not CommError, which regroup turns into the in-pod fallback: the rank stops and the pod restarts."""
    (kind, message), _ = run_ranks(_nccl_peer_dies, 2, timeout=60)
    assert kind == "RuntimeError"
    assert "all_reduce on NCCL group (0, 1) failed" in message and "pod exits" in message
