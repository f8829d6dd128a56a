"""Which consumers fetch promptly: those on a fault's path (the executor, the lease, read-backs);
the ones that only record or follow fetch less often, because every fetch loop costs the
embedded broker CPU whether data arrives or not (bus/config.py)."""

from __future__ import annotations

from typing import Any, cast

import bus.consume
import sinks.audit
from bus.config import BACKGROUND_FETCH_WAIT_MS, PROMPT_FETCH_WAIT_MS, consumer_config


class _Recorded:
    configs: list[dict[str, Any]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        _Recorded.configs.append(config)


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
