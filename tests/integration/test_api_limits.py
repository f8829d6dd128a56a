"""Bounded input on the operator API of a real Stack: a YAML alias bomb (read-only token) is a
quick 400 while /api/health keeps answering; look-back windows that would overflow are 422;
a token file others may read is refused before anything starts; a flood of refused ingest
requests writes one log line per reason per interval."""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bus.publish import Publisher
from producers.ingest import STATS_KEY, IngestServer, create_app
from sinks.backends.simulated import SimulatedScheduler
from streams.policy import DEFAULT_POLICY
from tests.unit.test_safeyaml import alias_bomb
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig, StackError


@pytest.fixture
def stack(broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(
        StackConfig(
            data_dir=tmp_path / "var",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            api_port=0,
            supervise=True,
        ),
        SimulatedScheduler([]),
    ).start()
    yield s
    s.stop()


def _client(stack: Stack) -> tuple[httpx.Client, dict[str, str]]:
    assert stack.api is not None
    viewer = stack.config.viewer_token_file.read_text().strip()
    return httpx.Client(base_url=stack.api.url, timeout=60), {"Authorization": f"Bearer {viewer}"}


def test_alias_bomb_is_a_400_and_health_keeps_answering(stack: Stack) -> None:
    http, auth = _client(stack)
    bomb = DEFAULT_POLICY.read_text() + "\n" + alias_bomb(levels=9).replace("guardrails:", "bomb:")
    deep = "mode: monitor\nx: " + "[" * 5000 + "]" * 5000 + "\n"
    health: list[int] = []
    stop = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=http.base_url, timeout=10) as h:
            while not stop.is_set():
                health.append(h.get("/api/health").status_code)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with http:
            for _ in range(10):
                r = http.post("/api/replay", json={"policy_yaml": bomb, "since_days": 1}, headers=auth)
                assert r.status_code == 400, r.text
                assert "aliases are not accepted here" in r.json()["detail"]
                assert "lol" not in r.text  # the input is not echoed back
            r = http.post("/api/replay", json={"policy_yaml": deep}, headers=auth)
            assert r.status_code == 400 and "nested deeper than 64 levels" in r.json()["detail"], r.text
            # A sound policy still replays.
            ok = http.post("/api/replay", json={"policy_yaml": DEFAULT_POLICY.read_text()}, headers=auth)
            assert ok.status_code == 200, ok.text
    finally:
        stop.set()
        poller.join(30)
    assert health and set(health) == {200}, health[-20:]


OUT_OF_RANGE = [
    ("GET", "/api/incidents?since=999999999999999w", None),
    ("GET", "/api/incidents?since=3661d", None),
    ("GET", "/api/charts?since=999999999999999w", None),
    ("GET", "/api/readiness?since_days=1e308", None),
    ("GET", "/api/readiness?since_days=inf", None),
    ("GET", "/api/readiness?since_days=-1", None),
    ("POST", "/api/replay", {"policy_yaml": "mode: monitor\n", "since_days": 1e308}),
]


def test_look_back_windows_out_of_range_are_422(stack: Stack) -> None:
    """One stack for every case (each start costs seconds on these machines)."""
    http, auth = _client(stack)
    with http:
        for method, path, body in OUT_OF_RANGE:
            r = http.request(method, path, json=body, headers=auth)
            assert r.status_code == 422, (path, r.status_code, r.text)
        assert http.get("/api/incidents?since=3660d", headers=auth).status_code == 200
        assert http.get("/api/readiness?since_days=3660", headers=auth).status_code == 200


def test_token_file_readable_by_others_is_refused_before_anything_starts(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    data = tmp_path / "var"
    data.mkdir()
    token = data / "api-token"
    token.write_text("x" * 43 + "\n")
    token.chmod(0o644)
    stack = Stack(StackConfig(data_dir=data, bootstrap=broker.bootstrap, api_port=0), SimulatedScheduler([]))
    with pytest.raises(StackError, match=r"api-token: mode 0644 lets other users read or change the token; refused"):
        stack.start()
    assert stack.worker(0) is None and stack.store is None  # refused before start-up work
    assert not (data / "logs").exists()


def test_refused_ingest_requests_log_one_line_per_reason_per_interval(
    broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of bad requests to the real ingest server: one line per reason, with the count."""
    caplog.set_level(logging.DEBUG)
    publisher = Publisher(broker.bootstrap, "test-ingest")
    app = create_app(publisher, secrets.token_urlsafe(24))
    server = IngestServer(app, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(50):
                assert (
                    http.post("/v1/nvsentinel", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
                )
            for _ in range(30):
                assert (
                    http.post("/v1/nvsentinel", content=b"{", headers={"Authorization": "Bearer x"}).status_code == 401
                )
        assert app[STATS_KEY].rejected["unauthorized"] == 80
        lines = [r.getMessage() for r in caplog.records if r.name == "trainmedic.producers.ingest"]
        assert lines == ["ingest /v1/nvsentinel from 127.0.0.1: 401 (missing or wrong bearer token)"], lines
        assert not [r for r in caplog.records if r.name == "aiohttp.access"]
    finally:
        server.stop()
        publisher.flush(10)


def test_refusal_log_reports_the_count_of_the_quiet_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from producers import ingest

    clock = [1000.0]
    monkeypatch.setattr(ingest.time, "monotonic", lambda: clock[0])
    refused = ingest._RefusalLog(every_s=10.0)
    caplog.set_level(logging.INFO, logger="trainmedic.producers.ingest")
    for _ in range(5):
        refused(logging.WARNING, "unauthorized", "401 from %s", "peer")
    refused(logging.INFO, "invalid_json", "400 from %s", "peer")
    clock[0] += 10.0
    refused(logging.WARNING, "unauthorized", "401 from %s", "peer")
    assert [r.getMessage() for r in caplog.records] == [
        "401 from peer",
        "400 from peer",
        "401 from peer (5 refused for unauthorized since the last line)",
    ]
