"""A sink child a failed test left running would poll on and hold its chDB folder for the rest
of the session: each test ends with none alive."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.harness import SinkProcess


@pytest.fixture(autouse=True)
def _no_sink_left_running() -> Iterator[None]:
    yield
    SinkProcess.kill_leftovers()
