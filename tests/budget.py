"""The suite's time budget, held per test (docs/testing.md).

A test whose own time - setup, call and teardown, less what it spent setting up fixtures shared
with other tests (session, package, module or class scope: a Slurm cluster's start, say) and
waiting for a cluster another test holds - is over
`SLOW_LIMIT_S` fails, unless it carries `@pytest.mark.slow(reason="...")`. At most `MAX_SLOW`
tests may carry it, each with its reason, so a slow test is a decision someone wrote down, and the
suite stays within its 20 minutes as it grows.

With `TMTEST_TIMINGS=DIR` set, each test process (each xdist worker) also writes the time
of every test phase and every fixture setup to `DIR/timings-<worker>.json`, which
`python -m tests.timings DIR` turns into the per-file and per-fixture tables of docs/testing.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

# The environment may lower the limit (tests/unit/test_budget.py checks the guard on a short one).
SLOW_LIMIT_S = float(os.environ.get("TMTEST_SLOW_LIMIT_S", "60"))
MAX_SLOW = 10
# Function-scoped fixtures whose setup is waiting for a resource another test holds, not the test's
# own work: the Slurm cluster lock (tests/parallel.py) waits for the other worker's test to end.
WAITING_FIXTURES = frozenset({"_slurm_cluster_lock"})

_SPENT = pytest.StashKey[list[float]]()
_SHARED = pytest.StashKey[list[float]]()
_current: list[pytest.Item] = []
_fixtures: list[tuple[str, str, str, float]] = []  # (fixture, scope, test nodeid, seconds)
_phases: list[tuple[str, str, float, str]] = []  # (test nodeid, phase, seconds, outcome)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"slow(reason): this test may take over {SLOW_LIMIT_S:.0f} s of its own; the reason says why "
        f"(at most {MAX_SLOW} tests)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    for item in slow:
        marker = item.get_closest_marker("slow")
        assert marker is not None
        if not str(marker.kwargs.get("reason", "")).strip():
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs reason='why this test may take longer'")
    if len(slow) > MAX_SLOW:
        raise pytest.UsageError(
            f"{len(slow)} tests are marked slow, at most {MAX_SLOW} may be: " + ", ".join(item.nodeid for item in slow)
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, None]:
    item.stash[_SPENT] = []
    item.stash[_SHARED] = []
    _current.append(item)
    try:
        yield
    finally:
        _current.remove(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, None]:
    t0 = time.monotonic()
    yield
    spent = time.monotonic() - t0
    if _current:
        _fixtures.append((fixturedef.argname, fixturedef.scope, _current[-1].nodeid, spent))
        if fixturedef.scope != "function" or fixturedef.argname in WAITING_FIXTURES:
            _current[-1].stash[_SHARED].append(spent)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    spent = item.stash.get(_SPENT, None)
    if spent is None:
        return
    spent.append(report.duration)
    _phases.append((item.nodeid, report.when, report.duration, report.outcome))
    if report.when != "teardown" or not report.passed or item.get_closest_marker("slow") is not None:
        return
    shared: list[float] = item.stash[_SHARED]
    own = sum(spent) - sum(shared)
    if own > SLOW_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {own:.1f} s of its own (setup + call + teardown, shared fixtures left out), "
            f"over the suite's per-test limit of {SLOW_LIMIT_S:.0f} s: make it wait for events instead of time, "
            f"share its fixed costs, or mark it @pytest.mark.slow(reason=...) (tests/budget.py)"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    folder = os.environ.get("TMTEST_TIMINGS")
    if not folder:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"timings-{worker}.json").write_text(json.dumps({"fixtures": _fixtures, "phases": _phases}))
