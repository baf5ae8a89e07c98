"""`pytest -p tests.durations --durations-out FILE`: each test's wall seconds and the CPU seconds the whole machine
spent meanwhile (/proc/stat: the test's processes, its pods and services), a JSON line per test. Run without xdist, so
that each line is one test's; `python -m tests.scheduling FILE` turns them into tests/durations.json."""

from __future__ import annotations

import json
import os
import time

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """The machine's CPU seconds not idle (guest time is in user and nice already, so it is left out)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-out", help="append each test's wall and CPU seconds to this file (JSON lines)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    out = item.config.getoption("durations_out")
    start, busy = time.monotonic(), busy_seconds()
    yield
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "wall": round(time.monotonic() - start, 3),
                                "cpu": round(busy_seconds() - busy, 2)}) + "\n")
