"""The brake always works: with a broken policy file the operator API keeps the last good
policy, switches to monitor, judges autonomy as under the last good policy, and names the
broken file as degraded in /api/health and the console's status (no database or broker: fakes)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from bus.publish import Publisher
from schemas.events import ModeChange
from sinks.audit import AuditStore
from streams.policy import DEFAULT_POLICY
from trainmedic.web.api import PENDING, create_api

TOKEN = "operator-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GOOD = DEFAULT_POLICY.read_text()
BAD_CATEGORY = GOOD.replace("\nactions:\n", "\nactions:\n  gpu_hardwre: stop\n", 1)
BAD_LINE = GOOD.split("\nactions:\n", 1)[0].count("\n") + 3  # the line after `actions:`


class FakeStore:
    """An empty audit: readiness finds no decided recommendation."""

    def query(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return []


class FakePublisher:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def publish(self, topic: object, event: Any) -> None:
        self.sent.append(event)

    def publish_sync(self, topic: object, event: Any, timeout_s: float = 30.0) -> int:
        self.sent.append(event)
        return 0

    def flush(self, timeout: float = 10.0) -> int:
        return 0


def _rewrite(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # changed, even within one timestamp tick


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    return path


def _client(tmp_path: Path, policy: Path, publisher: FakePublisher) -> Iterator[TestClient]:
    store = FakeStore()
    app = create_api(
        store,  # type: ignore[arg-type]
        publisher,  # type: ignore[arg-type]
        TOKEN,
        object(),  # type: ignore[arg-type]  # no node is listed or resumed here
        policy,
        tmp_path / "modes.yaml",
        health=lambda: {"ok": True, "components": {}},
    )
    try:
        with TestClient(app) as client:
            yield client
    finally:
        PENDING.release(store)  # type: ignore[arg-type]


@pytest.fixture
def publisher() -> FakePublisher:
    return FakePublisher()


@pytest.fixture
def client(tmp_path: Path, policy: Path, publisher: FakePublisher) -> Iterator[TestClient]:
    yield from _client(tmp_path, policy, publisher)


def _monitor(client: TestClient, **scope: str) -> Any:
    return client.post("/api/modes", headers=AUTH, json={"mode": "monitor", "operator": "alice", **scope})


def test_a_broken_file_leaves_modes_readiness_and_the_brake_working(
    client: TestClient, policy: Path, tmp_path: Path, publisher: FakePublisher
) -> None:
    _rewrite(policy, BAD_CATEGORY)
    where = f"{policy}: line {BAD_LINE}: field 'actions.gpu_hardwre': unknown category"
    modes = client.get("/api/modes", headers=AUTH)
    assert modes.status_code == 200 and modes.json()["mode"] == "monitor"  # the last good policy's
    assert where in modes.json()["policy_error"]
    assert client.get("/api/readiness", headers=AUTH).status_code == 200
    for scope in ({}, {"partition": "gpu"}, {"category": "gpu_hardware"}):
        answer = _monitor(client, **scope)
        assert answer.status_code == 200, answer.text
        assert answer.json()["new_mode"] == "monitor" and where in answer.json()["policy_error"]
    overlay = yaml.safe_load((tmp_path / "modes.yaml").read_text())
    assert overlay == {
        "mode": "monitor",
        "categories": {"gpu_hardware": "monitor"},
        "partitions": {"gpu": {"mode": "monitor"}},
    }
    assert [e.new_mode for e in publisher.sent if isinstance(e, ModeChange)] == ["monitor"] * 3


def test_health_names_the_broken_file_as_degraded_until_it_is_fixed(client: TestClient, policy: Path) -> None:
    assert client.get("/api/health").json() == {"ok": True, "components": {}}
    _rewrite(policy, BAD_CATEGORY)
    health = client.get("/api/health")
    assert health.status_code == 200  # still serving: a 503 would take the brake off a load balancer
    problem = health.json()["degraded"]["policy"]
    assert f"{policy}: line {BAD_LINE}:" in problem and "stays in force" in problem
    assert health.json()["ok"] is True
    status = client.get("/api/console/status", headers=AUTH).json()
    assert status["stack"]["degraded"]["policy"] == problem  # what the console's banner shows
    _rewrite(policy, GOOD)
    assert "degraded" not in client.get("/api/health").json()


def test_autonomy_with_a_broken_file_is_judged_under_the_last_good_policy(
    client: TestClient, policy: Path, publisher: FakePublisher
) -> None:
    # The broken file would lower the bar to 1 sample; the last good policy's 10 stand.
    _rewrite(policy, BAD_CATEGORY.replace("min_samples: 10", "min_samples: 1"))
    body = {"mode": "autonomous", "category": "gpu_hardware", "operator": "alice"}
    refused = client.post("/api/modes", headers=AUTH, json=body)
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "too few samples: 0 decided, need 10" in detail
    assert "the policy file failed to load" in detail and "unknown category" in detail
    assert [e.outcome for e in publisher.sent if isinstance(e, ModeChange)] == ["refused"]
    forced = client.post("/api/modes", headers=AUTH, json={**body, "force": True})
    assert forced.status_code == 200 and forced.json()["old_mode"] == "monitor"
    assert "unknown category" in forced.json()["policy_error"]


def test_monitor_works_when_no_policy_was_ever_valid(tmp_path: Path, publisher: FakePublisher) -> None:
    policy = tmp_path / "policy.yaml"
    _rewrite(policy, BAD_CATEGORY)
    for client in _client(tmp_path, policy, publisher):
        answer = _monitor(client, partition="gpu")
        assert answer.status_code == 200, answer.text
        assert answer.json()["old_mode"] is None and "only a switch to monitor" in answer.json()["policy_error"]
        assert yaml.safe_load((tmp_path / "modes.yaml").read_text()) == {"partitions": {"gpu": {"mode": "monitor"}}}
        for method, path, body in [
            ("GET", "/api/modes", None),
            ("GET", "/api/readiness", None),
            ("POST", "/api/modes", {"mode": "autonomous", "operator": "alice", "force": True}),
        ]:
            refused = client.request(method, path, headers=AUTH, json=body)
            assert refused.status_code == 503 and "no valid policy has been loaded" in refused.json()["detail"]
        assert "only a switch to monitor" in client.get("/api/health").json()["degraded"]["policy"]


def test_fakes_match_what_create_api_uses() -> None:
    """The fakes stand in for these; a renamed method would make the tests above pass vacuously."""
    for cls, fake in ((AuditStore, FakeStore), (Publisher, FakePublisher)):
        for name in vars(fake):
            if not name.startswith("_"):
                assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
