"""The cached helm v3 and the kubectl beside it (scripts/helm-fetch.sh), each run with its own config, cache and
data folders: for the chart's tests and `make cluster`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "pat-operator"


class Helm:
    def __init__(self, home: Path, kubeconfig: str | None = None):
        fetched = subprocess.run(["scripts/helm-fetch.sh"], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PY": sys.executable})
        if fetched.returncode != 0:
            raise RuntimeError(f"scripts/helm-fetch.sh failed:\n{fetched.stderr}")
        self.bin = Path(fetched.stdout.strip().splitlines()[-1])
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}
        if kubeconfig:
            self.env["KUBECONFIG"] = kubeconfig

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run("helm", *args, check=check)

    def kubectl(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return self._run("kubectl", *args, stdin=stdin)

    def _run(self, tool: str, *args: str, check: bool = True, stdin: str = "") -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.bin / tool), *args], capture_output=True, text=True, env=self.env,
                              input=stdin, timeout=300)
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def template(self, *args: str, namespace: str = "pat-system") -> list[dict]:
        return [d for d in yaml.safe_load_all(self("template", "rel", str(CHART), "-n", namespace, *args).stdout)
                if d]
