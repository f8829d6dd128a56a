"""Issue 40 item 5: a record written before node names were checked (a culprit node carrying a newline
and ANSI escapes) prints escaped, one line per record, through the operator API and `recommendations
list`, and through the audit CLI; the API refuses such a node where one comes in (resume), and an
approval of such a record is refused, not a 500. Real chDB audit, real HTTP API, the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schemas.events import Decision, Event, Incident
from sinks.audit import TABLES, AuditStore
from streams.policy import DEFAULT_POLICY
from tests.conftest import REPO
from trainmedic.cli.main import app
from trainmedic.stack.broker import free_port
from trainmedic.web.api import PENDING, ApiServer, create_api

FORGED = "gpu01\n\x1b[31mdec-forged  2025-01-01T00:00:00  job 666      gpu_hardware\x1b[0m"
SHOWN = "gpu01\\n\\x1b[31mdec-forged  2025-01-01T00:00:00  job 666      gpu_hardware\\x1b[0m"
TOKEN = "names-operator-token-0123456789"
JOB = "4242"


def forged_records(now: float) -> list[Event]:
    """An incident and its recommendation naming FORGED, as an audit holds them when they were written
    before the events checked node names: made valid, then changed without validation."""
    incident = Incident(
        event_id="inc-forged",
        event_time=now,
        incident_id="inc-forged",
        job_id=JOB,
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu01",
        job_nodes=["gpu01", "gpu02"],
        confidence=0.9,
        explanation="Xid 79 on the culprit",
        evidence=[],
        anomaly_ids=[],
        first_signal_time=now - 1,
    ).model_copy(update={"culprit_node": FORGED, "job_nodes": ["gpu02", FORGED]})
    decision = Decision(
        event_id="dec-forged",
        event_time=now,
        decision_id="dec-forged",
        incident_id="inc-forged",
        job_id=JOB,
        category="gpu_hardware",
        culprit_node="gpu01",
        action="drain_and_requeue",
        mode="monitor",
        executed=False,
        rule="actions.gpu_hardware=drain_and_requeue",
        reason="synthetic",
        first_signal_time=now - 1,
        incident_time=now,
    ).model_copy(update={"culprit_node": FORGED})
    return [incident, decision]


def insert(store: AuditStore, events: list[Event]) -> None:
    """Through the audit sink's own row mapping (TABLES), as AuditSink writes."""
    by_type = {topic.event_type: (table, to_row, cols) for topic, table, to_row, cols in TABLES.values()}
    for event in events:
        table, to_row, cols = by_type[type(event)]
        store.insert(table, [to_row(event)], cols)


class _Publisher:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def publish(self, topic: object, event: Any) -> None:
        self.sent.append(event)

    def flush(self, timeout: float = 10.0) -> int:
        return 0


@dataclass
class Api:
    url: str
    publisher: _Publisher


@pytest.fixture
def api(chdb_url: str, database: str, tmp_path: Path) -> Iterator[Api]:
    store = AuditStore(chdb_url, database)
    store.migrate()
    insert(store, forged_records(time.time()))
    policy = tmp_path / "policy.yaml"
    shutil.copy(DEFAULT_POLICY, policy)
    publisher = _Publisher()
    app_ = create_api(
        store,
        publisher,  # type: ignore[arg-type]
        TOKEN,
        object(),  # type: ignore[arg-type]  # no scheduler: nothing here may reach one
        policy,
        tmp_path / "modes.yaml",
    )
    server = ApiServer(app_, "127.0.0.1", free_port()).start()
    try:
        yield Api(server.url, publisher)
    finally:
        server.stop()
        PENDING.release(store)
        store.close()


def _call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_recommendations_list_prints_a_forged_record_escaped_on_one_line(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, rows = _call(api.url, "GET", "/api/recommendations")
    assert status == 200 and [r["culprit_node"] for r in rows] == [FORGED]  # JSON carries it as it is

    monkeypatch.setenv("TRAINMEDIC_TOKEN", TOKEN)
    result = CliRunner().invoke(app, ["recommendations", "list", "--api", api.url, "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1, lines  # the newline forged no second row
    assert lines[0].startswith("dec-forged ") and f"culprit {SHOWN}" in lines[0]
    assert "\x1b" not in result.stdout

    # --json is JSON: the values stay exact, escaped by JSON itself.
    as_json = CliRunner().invoke(
        app, ["recommendations", "list", "--api", api.url, "--data-dir", str(tmp_path), "--json"]
    )
    assert json.loads(as_json.stdout)[0]["culprit_node"] == FORGED and "\x1b" not in as_json.stdout


def test_a_forged_record_cannot_be_approved_and_no_node_is_resumed(api: Api) -> None:
    status, body = _call(api.url, "POST", "/api/recommendations/dec-forged/approve", {"operator": "alice"})
    assert status == 409 and "culprit_node" in body["detail"], body
    assert api.publisher.sent == []  # neither an approval nor an action went to Kafka

    node = urllib.parse.quote("gpu01\n\x1b[31mx", safe="")
    status, body = _call(api.url, "POST", f"/api/nodes/{node}/resume", {"operator": "alice"})
    assert status == 422, body
    assert body["detail"].startswith("invalid node name 'gpu01\\n\\x1b[31mx'"), body


SEED = """
import sys, time
from pathlib import Path
from sinks.audit import AuditStore
from tests.integration.test_node_names import forged_records, insert
folder, database = sys.argv[1:3]
store = AuditStore.embedded(Path(folder), database)
store.migrate()
insert(store, forged_records(time.time()))
store.close()
"""


def test_the_audit_cli_prints_forged_records_escaped(tmp_path: Path) -> None:
    """The audit CLI opens its own chDB folder: a subprocess seeds it, another reads it."""
    database = "names"
    seed = subprocess.run(
        [sys.executable, "-c", SEED, str(tmp_path / "chdb"), database],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        check=False,
    )
    assert seed.returncode == 0, seed.stderr

    def audit(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "trainmedic.cli.audit", *args, "--data-dir", str(tmp_path), "--database", database],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=REPO,
            check=False,
            env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout, proc.stdout
        return proc.stdout

    incidents = audit("incidents", "--since", "1h")
    rows = [line for line in incidents.splitlines() if line.startswith("│")]
    assert len(rows) == 1 and SHOWN in rows[0], incidents  # one record, one line

    timeline = audit("job", JOB)
    assert f"culprit {SHOWN}" in timeline, timeline
    assert not any(line.lstrip("│ ").startswith("dec-forged") for line in timeline.splitlines()), timeline
