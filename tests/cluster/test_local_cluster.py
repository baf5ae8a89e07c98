"""`make cluster` (tests/cluster/local.py) as a person uses it: the printed exports give a kubectl that applies a
job which the chart-installed operator runs; Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest
import yaml

from tests.cluster.helm import ROOT, Helm
from tests.operator.conftest import SERVE, SLEEP, job_doc

pytestmark = pytest.mark.cluster


def test_make_cluster_runs_a_job_applied_with_kubectl_and_stops_on_ctrl_c(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.local"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("export KUBECONFIG=")):
            line = proc.stdout.readline()
            assert line, "make cluster ended before printing KUBECONFIG:\n" + "".join(lines)
            lines.append(line)
        kubeconfig = lines[-1].strip().removeprefix("export KUBECONFIG=")
        kubectl = Helm(tmp_path, kubeconfig).kubectl
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job_doc("by-hand", SLEEP, SERVE)))
        deadline = time.monotonic() + 120
        while (phase := kubectl("get", "rlhfjob", "by-hand", "-o", "jsonpath={.status.phase}").stdout) != "Running":
            assert time.monotonic() < deadline, f"phase {phase!r}; kubectl get pods -A:\n" + \
                kubectl("get", "pods", "-A").stdout
            time.sleep(1)
        server = urllib.parse.urlsplit(yaml.safe_load(open(kubeconfig))["clusters"][0]["cluster"]["server"])
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        assert "# stopping" in proc.stdout.read()
        with pytest.raises(OSError):
            socket.create_connection((server.hostname, server.port), timeout=2).close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
