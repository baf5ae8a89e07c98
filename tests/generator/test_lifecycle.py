"""A pod's life: not ready (503) while its ranks start, then ready; it exits non-zero when an engine rank dies,
so that its supervisor restarts the gang. (Exit 0 on SIGTERM: the session's pods check it at teardown.)"""

import os
import signal
from pathlib import Path

import pytest

from ..procs import children
from .conftest import TOKEN, Pod

pytestmark = pytest.mark.slow  # worker processes (tests/tiers.py)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_not_ready_while_starting_and_exits_nonzero_when_a_rank_dies(model_dir, tmp_path):
    pod = Pod("one-rank", model_dir, tmp_path, "--controller", "operator", ranks=1, env={"PAT_JOB_TOKEN": TOKEN})
    try:
        status, reply = pod.call("GET", "/readyz", token=None)  # the ranks load and profile for seconds
        assert status == 503 and "not ready" in reply["error"], reply
        status, reply = pod.call("POST", "/v1/rollouts", {"batch_id": "b", "policy_version": 0,
                                                          "requests": [{"id": "a", "prompt": "hi"}]})
        assert status == 503 and "starting" in reply["error"], reply
        state = pod.state()
        assert state["ready"] is False and state["world"] == 1
        pod.wait_ready()
        assert pod.state()["ready"] and pod.call("GET", "/healthz", token=None)[0] == 200
        forkserver = next(p for p in children(pod.proc.pid) if "forkserver" in _cmdline(p))
        (rank,) = children(forkserver)
        os.kill(rank, signal.SIGKILL)
        assert pod.proc.wait(30) == 1
        assert "GeneratorError: rank(s) [0] died" in pod.log.read_text()
    finally:
        pod.stop()
