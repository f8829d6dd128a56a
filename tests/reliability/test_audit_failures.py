"""Failures of the audit are visible (issue 40): the real broker, the real chDB, `trainmedic up`'s
stack in this process. The audit's disk is made "full" on the store the sink has, as
test_sink_crash.py makes ClickHouse refuse inserts on it: the incidents table gets
`min_free_disk_bytes_to_perform_insert` above any disk, so every insert into it fails with
ClickHouse's own NOT_ENOUGH_SPACE (243), the error of a full disk, until the setting is reset.

What must hold while inserts fail: each failure counted by table and reason, /api/health
degraded (still 200, ok), the audit's read paths (the API, the CLI through it and the audit
CLI) saying the audit is behind instead of answering an empty list; and once inserts succeed
again, all of it clear and the incidents listed."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from schemas.topics import INCIDENTS
from sinks.backends.simulated import SimulatedScheduler
from tests.reliability.harness import incident, produce, wait_until
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

FAILURES = "trainmedic_audit_insert_failures_total"
N_INCIDENTS = 5


@pytest.fixture
def stack(broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(
        StackConfig(
            data_dir=tmp_path,
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


def _failures(reason: str = "disk_full", table: str = "incidents") -> float:
    return REGISTRY.get_sample_value(FAILURES, {"table": table, "reason": reason}) or 0.0


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/health", timeout=10) as r:
        assert r.status == 200  # degraded, not down: the API (and the brake) stay up
        return json.loads(r.read())  # type: ignore[no-any-return]


def _cli(data_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmedic.cli.main", *argv, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_full_audit_disk_is_counted_degrades_health_and_reads_say_the_audit_is_behind(
    stack: Stack, database: str, tmp_path: Path
) -> None:
    assert stack.api is not None and stack.store is not None
    url, token = stack.api.url, (tmp_path / "api-token").read_text().strip()
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert "degraded" not in _health(url)
    assert http.get("/api/incidents").json() == []
    before = {r: _failures(r) for r in ("disk_full", "unavailable", "rejected", "other")}

    stack.store._command(
        f"ALTER TABLE {database}.incidents MODIFY SETTING min_free_disk_bytes_to_perform_insert = {10**18}"
    )
    produce(stack.bootstrap, [(INCIDENTS.name, incident(i, prefix="full")) for i in range(N_INCIDENTS)])

    # Counted, by table and reason (the series existed at 0 before: increase() sees the first).
    wait_until("two failed inserts into incidents counted as disk_full", lambda: _failures() - before["disk_full"] >= 2)
    assert all(_failures(r) == before[r] for r in ("unavailable", "rejected", "other"))

    # Health: degraded, naming the table, the reason and ClickHouse's error; still ok.
    health = _health(url)
    assert health["ok"] is True
    problem = health["degraded"]["audit"]
    assert "inserts into incidents failing since" in problem and "(disk_full," in problem, problem
    assert "NOT_ENOUGH_SPACE" in problem

    # The read paths: a 503 naming it, not an empty list.
    for path in ("/api/incidents", "/api/recommendations"):
        answer = http.get(path)
        assert answer.status_code == 503, (path, answer.text)
        detail = answer.json()["detail"]
        assert detail.startswith("the audit is behind: inserts into incidents failing since") and "disk_full" in detail
        assert answer.headers["Retry-After"]
    listed = _cli(tmp_path, "recommendations", "list", "--json")
    assert listed.returncode == 3 and "the audit is behind" in listed.stderr and "disk_full" in listed.stderr, listed
    audited = _cli(tmp_path, "audit", "incidents", "--json")
    assert audited.returncode == 3, audited
    assert "the audit is behind (trainmedic up on" in audited.stderr and "disk_full" in audited.stderr

    # Space is back: the next retry lands the batch, and both clear.
    stack.store._command(f"ALTER TABLE {database}.incidents RESET SETTING min_free_disk_bytes_to_perform_insert")
    wait_until("the audit caught up", lambda: "degraded" not in _health(url), timeout=60)
    counted = _failures()
    incidents = http.get("/api/incidents")
    assert incidents.status_code == 200, incidents.text
    assert {r["incident_id"] for r in incidents.json()} >= {f"inc-full-{i}" for i in range(N_INCIDENTS)}
    assert http.get("/api/recommendations").status_code == 200
    assert _cli(tmp_path, "recommendations", "list", "--json").returncode == 0
    assert _failures() == counted  # no further failure once inserts succeed
    http.close()
