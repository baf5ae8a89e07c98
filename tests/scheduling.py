"""How `make test` spreads the suite over two pytest-xdist workers (`-n 2 --dist loadgroup`; docs/testing.md).

A worker takes whole modules, so that a module's fixtures start once, or a family of modules that share session
fixtures (FAMILIES). The heaviest go first, by the seconds per module of a whole run (DURATIONS_FILE), so that the
many short modules fill in at the end and the workers finish together. On two cores, two groups that each keep more
than a core busy only slow each other down (and stretch the waits inside them): while one worker runs such a group,
the other takes the next group that waits more than it computes (CpuAwareScheduling).

A worker starts the services its tests need for itself (control plane, kubelet, Prometheus, the operator, the CRD
server): the kubelets' node networks are allotted under a lock (tests/cluster/kubelet.py), so two clusters run side
by side on one machine, and neither worker's tests see the other's pods.

DURATIONS_FILE is written by `python -m tests.scheduling LOG...` from the JSON lines of tests/durations.py (a run of
`pytest -p tests.durations`); a group missing from it is taken as heavy and goes first."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

DURATIONS_FILE = Path(__file__).with_name("durations.json")
# Modules that share session-scoped processes: one worker runs them all, so that these start once.
FAMILIES = {"tests/generator/": "generator pods"}
HEAVY_CORES = 1.2  # a group whose tests kept more than this many cores busy, on average, computes more than it waits


def group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return next((family for prefix, family in FAMILIES.items() if module.startswith(prefix)), module)


def measured() -> dict[str, dict[str, float]]:
    """{group: {"seconds": wall seconds of its tests, "cores": their CPU seconds (the machine's) per wall second}}."""
    return json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}


def order_for_workers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --dist loadgroup (xdist's workers collect, and hand the tests over in this order): groups heaviest
    first."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers by --dist loadgroup
        return
    seconds = {group: m["seconds"] for group, m in measured().items()}
    first_seen = {group: i for i, group in enumerate(dict.fromkeys(group_of(item.nodeid) for item in items))}
    items.sort(key=lambda item: (-seconds.get(group_of(item.nodeid), float("inf")), first_seen[group_of(item.nodeid)]))


class CpuAwareScheduling(LoadGroupScheduling):
    """--dist loadgroup with our groups (group_of: no xdist_group marks, which xdist 3.8 under pytest 9 does not
    apply), in the order collected; a worker about to take a CPU-heavy group while the other runs one takes the first
    light group in the queue instead (none left: the heavy one)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.light = {group for group, m in measured().items() if m["cores"] < HEAVY_CORES}

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        busy = any(scope not in self.light for other, work in self.assigned_work.items() if other is not node
                   for scope, tests in work.items() if not all(tests.values()))
        if busy and (light := next((scope for scope in self.workqueue if scope in self.light), None)):
            self.workqueue.move_to_end(light, last=False)
        super()._assign_work_unit(node)


def durations(lines: list[str]) -> dict[str, dict[str, float]]:
    """The groups' seconds and cores from tests/durations.py's lines."""
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for row in map(json.loads, lines):
        wall[group_of(row["id"])] += row["wall"]
        cpu[group_of(row["id"])] += row["cpu"]
    return {group: {"seconds": round(wall[group], 1), "cores": round(cpu[group] / max(wall[group], 1e-3), 2)}
            for group in sorted(wall, key=lambda g: -wall[g])}


if __name__ == "__main__":  # python -m tests.scheduling FILE...: the JSON lines of a whole run without xdist
    groups = durations([x for f in sys.argv[1:] for x in Path(f).read_text().splitlines() if x])
    DURATIONS_FILE.write_text("{\n" + ",\n".join(f" {json.dumps(g)}: {json.dumps(m)}" for g, m in groups.items())
                              + "\n}\n")
