"""The suite's two tiers beside the whole (docs/testing.md).

A test is marked `cluster` when it needs a real service (the control plane and its process kubelet, Prometheus, the
1.36 CRD server) and `slow` when it starts worker processes (engine ranks, generator or vLLM pods, trainer ranks,
`pat run`); `make test-fast` runs the tests marked neither. The fixtures that start these carry their tier
(`@starts`) and pass it on to every test that uses them, directly or through another fixture; a module whose tests
start processes themselves says so with `pytestmark`. So that the marks stay exact, a test marked neither fails
where it would start one: at `require`, at any multiprocessing child (the engine's and trainers' ranks), and at a
worker command or a benchmark run as a subprocess (WORKER_COMMANDS)."""

from __future__ import annotations

import multiprocessing.process
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest

TIERS = {"cluster": "needs the real control plane, Prometheus or the CRD server",
         "slow": "starts worker processes (engine ranks, pods, vLLM, trainer ranks, pat run)"}
F = TypeVar("F", bound=Callable)
# What a subprocess of this interpreter runs that makes worker processes: `-m` modules, `pat` subcommands, scripts.
WORKER_COMMANDS = {"pat_workers.generator", "pat_workers.trainer", "torch.distributed.run", "run", "generator",
                   "trainer", "colocated"}


def starts(tier: str) -> Callable[[F], F]:
    """Marks a fixture function (under its @pytest.fixture) as starting what puts its users in `tier`."""
    assert tier in TIERS, tier

    def mark(fn: F) -> F:
        fn.pat_tier = tier  # type: ignore[attr-defined]
        return fn
    return mark


def mark_by_fixtures(item: pytest.Item) -> None:
    """Adds the tier of every fixture the test uses (transitively) that carries one."""
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for tier in {getattr(d.func, "pat_tier", None) for d in defs} - {None}:
            if not item.get_closest_marker(tier):
                item.add_marker(tier)


_unmarked: pytest.Item | None = None  # the running test, while it is marked with no tier


def require(tier: str, what: str) -> None:
    """Called where `what` starts: fails the running test if it is marked with no tier (make test-fast would run it
    without what it needs)."""
    if _unmarked is not None:
        pytest.fail(f"{_unmarked.nodeid} starts {what} but is not marked `{tier}` ({TIERS[tier]}): give it the "
                    f"mark (pytestmark, or @starts on the fixture that starts it; tests/tiers.py)", pytrace=False)


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or _unmarked is None:
        return
    argv = [str(a) for a in args[1] or ()] if isinstance(args[1], (list, tuple)) else [str(args[1])]
    if argv[:1] != [sys.executable]:
        return
    module = argv[2:3] if argv[1:2] == ["-m"] else []
    command = argv[3:4] if module == ["pat_workers.cli"] else module
    if WORKER_COMMANDS.intersection(command) or argv[1:2] and argv[1].startswith("bench/"):
        require("slow", f"`{' '.join(argv[1:4])}`")


sys.addaudithook(_audit)


@contextmanager
def guarded(item: pytest.Item) -> Iterator[None]:
    """Around a test's setup, call and teardown (its module's and session's fixtures included)."""
    global _unmarked
    if any(item.get_closest_marker(tier) for tier in TIERS):
        yield
        return
    start = multiprocessing.process.BaseProcess.start

    def refused(process: multiprocessing.process.BaseProcess) -> None:
        require("slow", f"a process ({process.name})")
        start(process)

    multiprocessing.process.BaseProcess.start = refused  # type: ignore[method-assign]
    _unmarked = item
    try:
        yield
    finally:
        _unmarked = None
        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
