"""bus.health: what /healthz and /readyz answer, and the series alerts read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from bus import health


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    health.forget_all()
    yield
    health.forget_all()


def _sample(name: str, loop: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"loop": loop})


def test_no_loop_is_live_but_not_ready() -> None:
    assert health.report() == {"live": True, "ready": False, "loops": {}}


def test_a_loop_is_ready_once_it_says_so_and_stuck_once_it_stops_beating() -> None:
    lp = health.loop("t-consumer", stale_after_s=0.05)
    assert not health.report()["ready"] and health.report()["live"]
    lp.beat(processed=3)
    lp.set_ready(True, "consuming")
    assert health.report()["ready"]
    assert _sample("trainmedic_loop_ready", "t-consumer") == 1.0
    assert _sample("trainmedic_consumer_last_processed_timestamp_seconds", "t-consumer")
    import time

    time.sleep(0.1)  # past stale_after_s with no beat: stuck, so neither live nor ready
    rep = health.report()
    assert not rep["live"] and not rep["ready"] and "no beat" in rep["loops"]["t-consumer"]["why"]


def test_a_stopped_loop_leaves_no_series_behind() -> None:
    lp = health.loop("t-once", stale_after_s=60)
    lp.beat(processed=1)
    lp.set_ready(False, "schema behind")
    lp.stop()
    assert "t-once" not in health.report()["loops"]
    for name in (
        "trainmedic_loop_ready",
        "trainmedic_loop_last_beat_timestamp_seconds",
        "trainmedic_consumer_last_processed_timestamp_seconds",
    ):
        assert _sample(name, "t-once") is None  # an alert on "not ready" must not fire for ever
