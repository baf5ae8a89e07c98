"""The cluster fixtures (real control plane + process kubelet) start only when a test asks for them; the tiers
(tests/tiers.py) mark the tests that use them; under xdist, tests/scheduling.py groups and orders the tests."""

import pytest

from tests.scheduling import order_for_workers
from tests.tiers import TIERS, guarded, mark_by_fixtures

pytest_plugins = ["tests.cluster.fixtures", "pytester"]


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark_by_fixtures(item)
    order_for_workers(config, items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with guarded(item):
        yield


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") == "loadgroup":
        from tests.scheduling import CpuAwareScheduling

        return CpuAwareScheduling(config, log)
    return None
