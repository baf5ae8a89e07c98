"""The direction of imports is the architecture: the control plane never pulls in torch."""

import pkgutil
import subprocess
import sys

import pat_operator


def imports_torch(modules: list[str]) -> bool:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def test_operator_package_never_imports_torch():
    modules = ["pat_operator"] + [f"pat_operator.{m.name}" for m in pkgutil.iter_modules(pat_operator.__path__)]
    assert len(modules) > 3
    assert not imports_torch(modules)
    assert imports_torch(["pat_workers.engine"])  # the check can fail: the workers do import it


def test_the_simulator_never_imports_torch():
    assert not imports_torch(["pat_workers.sim", "pat_workers.sim.command", "pat_workers.sim.report"])
