"""Which consumers fetch promptly: those on a fault's path (the executor, the lease, read-backs);
the ones that only record or follow fetch less often, because every fetch loop costs the
embedded broker CPU whether data arrives or not (bus/config.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import bus.consume
import sinks.audit
from bus.config import BACKGROUND_FETCH_WAIT_MS, PROMPT_FETCH_WAIT_MS, consumer_config
from bus.consume import Follower
from streams.modes import ModeState


class _Recorded:
    configs: list[dict[str, Any]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        _Recorded.configs.append(config)

    def list_topics(self, topic: str, timeout: float) -> Any:
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: None})})

    def assign(self, partitions: list[Any]) -> None:
        pass


class _Store:
    def query(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return []


def test_a_consumer_fetches_promptly_unless_it_is_a_background_one() -> None:
    assert consumer_config("k:9092", "g", "c")["fetch.wait.max.ms"] == PROMPT_FETCH_WAIT_MS
    assert consumer_config("k:9092", "g", "c", background=True)["fetch.wait.max.ms"] == BACKGROUND_FETCH_WAIT_MS
    assert PROMPT_FETCH_WAIT_MS < BACKGROUND_FETCH_WAIT_MS


def test_the_audit_sink_is_a_background_consumer_and_a_read_back_is_not(monkeypatch: Any) -> None:
    _Recorded.configs = []
    monkeypatch.setattr(bus.consume, "Consumer", _Recorded)
    sinks.audit.AuditSink("unused:9092", cast(sinks.audit.AuditStore, _Store()))
    bus.consume.group_consumer("unused:9092", "g", "executor-like")
    assert [c["client.id"] for c in _Recorded.configs] == ["trainmedic-audit", "executor-like"]
    assert [c["fetch.wait.max.ms"] for c in _Recorded.configs] == [BACKGROUND_FETCH_WAIT_MS, PROMPT_FETCH_WAIT_MS]


def test_the_mode_follower_is_prompt_and_a_placement_follower_is_not(monkeypatch: Any) -> None:
    """A switch to monitor mode is an operator's brake: its follower must not wait 500 ms."""
    _Recorded.configs = []
    monkeypatch.setattr(bus.consume, "Consumer", _Recorded)
    make = ModeState("unused:9092")._make_follower
    assert make is not None
    make()
    Follower("unused:9092", "sched.events", "trainmedic-placements-gpu01")
    assert [c["fetch.wait.max.ms"] for c in _Recorded.configs] == [PROMPT_FETCH_WAIT_MS, BACKGROUND_FETCH_WAIT_MS]
