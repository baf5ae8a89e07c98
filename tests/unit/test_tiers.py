"""The tiers' marks are exact (tests/tiers.py): a fixture's tier reaches every test that uses it, through other
fixtures too, and a test marked with no tier that starts a worker process fails naming the mark it lacks."""

import json

from tests.scheduling import durations, group_of

CONFTEST = """
import pytest
from tests.tiers import TIERS, guarded, mark_by_fixtures, starts

def pytest_configure(config):
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")

def pytest_collection_modifyitems(items):
    for item in items:
        mark_by_fixtures(item)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with guarded(item):
        yield

@pytest.fixture(scope="session")
@starts("cluster")
def service():
    return "up"

@pytest.fixture
def client(service):
    return service
"""

PROCESS = """
import multiprocessing, pytest

def child():
    pass

def start():
    process = multiprocessing.get_context("fork").Process(target=child, name="rank-0")
    process.start()
    process.join()
    return process.exitcode
"""


def test_a_fixtures_tier_marks_every_test_that_uses_it(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile("def test_direct(service): pass\n"
                        "def test_through_another(client): pass\n"
                        "def test_neither(): pass\n")
    result = pytester.runpytest("-m", "not cluster", "-v")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.fnmatch_lines(["*test_neither PASSED*"])


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(PROCESS + "\n"
                        "def test_unmarked():\n    start()\n\n"
                        "@pytest.mark.slow\ndef test_marked():\n    assert start() == 0\n")  # the positive control
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_marked PASSED*",
                                 "*test_unmarked starts a process (rank-0) but is not marked `slow`*"])


def test_durations_add_up_per_module_and_per_family():
    lines = [json.dumps({"id": i, "wall": w, "cpu": c}) for i, w, c in [
        ("tests/unit/test_a.py::test_1", 1.0, 0.5), ("tests/unit/test_a.py::test_2[x]", 3.0, 1.5),
        ("tests/generator/test_b.py::test_1", 10.0, 20.0), ("tests/generator/test_c.py::test_1", 10.0, 10.0)]]
    assert group_of("tests/generator/test_b.py::test_1") == group_of("tests/generator/test_c.py::test_9")
    assert durations(lines) == {"generator pods": {"seconds": 20.0, "cores": 1.5},
                                "tests/unit/test_a.py": {"seconds": 4.0, "cores": 0.5}}
