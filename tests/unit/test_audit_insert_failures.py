"""Failures of the audit are visible (issue 40): a failed insert is counted by table and reason
(trainmedic_audit_insert_failures_total), the stack's health names it under `degraded` (still
ok), and the audit's read paths (API list endpoints, `trainmedic audit ...`) answer that the
audit is behind instead of a list that lacks what happened. No broker or database: fakes and
the real exception classes of clickhouse-connect."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError, ProgrammingError
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from typer.testing import CliRunner

import sinks.audit
from sinks.audit import INSERT_FAILURE_REASONS, AuditSink, InsertFailure, insert_failure_reason
from sinks.audit_schema import BY_NAME
from sinks.backends.simulated import SimulatedScheduler
from tests.reliability.harness import anomaly, incident
from tests.unit.test_api_policy_fallback import AUTH, TOKEN, FakePublisher, FakeStore
from trainmedic.stack.runtime import Stack, StackConfig
from trainmedic.web.api import PENDING, create_api

FAILURES = "trainmedic_audit_insert_failures_total"

NOT_ENOUGH_SPACE = (
    "Code: 243. DB::Exception: Could not perform insert. None of the disks in volume 'default' have enough free "
    "space to meet the configured threshold. (NOT_ENOUGH_SPACE)"
)
ENOSPC_WRITE = (
    "Code: 74. DB::ErrnoException: Cannot write to file /var/lib/clickhouse/store/abc/tmp_insert/data.bin, "
    "errno: 28, strerror: No space left on device. (CANNOT_WRITE_TO_FILE_DESCRIPTOR) (version 24.8.4.13)"
)


class _Wrapped(RuntimeError):
    pass


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (DatabaseError(NOT_ENOUGH_SPACE), "disk_full"),  # what chDB 26.9 answers (the integration test's)
        (DatabaseError(ENOSPC_WRITE), "disk_full"),  # a server whose volume filled mid-write
        (OSError(errno.ENOSPC, "No space left on device"), "disk_full"),
        (_raised_from(_Wrapped("insert failed"), OSError(errno.EDQUOT, "Disk quota exceeded")), "disk_full"),
        (
            OperationalError(
                "Error HTTPConnectionPool(host='ch', port=8123): Max retries exceeded (Connection refused) "
                "executing HTTP request attempt 1 (http://ch:8123)"
            ),
            "unavailable",
        ),
        (DatabaseError("Code: 242. DB::Exception: Table is in readonly mode. (TABLE_IS_READ_ONLY)"), "unavailable"),
        (DatabaseError("Code: 252. DB::Exception: Too many parts (300). (TOO_MANY_PARTS)"), "unavailable"),
        (
            DatabaseError("Code: 516. DB::Exception: default: Authentication failed. (AUTHENTICATION_FAILED)"),
            "unavailable",
        ),
        (ConnectionRefusedError(111, "Connection refused"), "unavailable"),
        (TimeoutError("timed out"), "unavailable"),
        (sinks.audit.AuditStoreError("cannot open ClickHouse"), "unavailable"),
        (DatabaseError("Code: 60. DB::Exception: Table audit.incidents does not exist. (UNKNOWN_TABLE)"), "rejected"),
        (
            DatabaseError(
                "Code: 16. DB::Exception: No such column domain in table audit.incidents. (NO_SUCH_COLUMN_IN_TABLE)"
            ),
            "rejected",
        ),
        (ProgrammingError("Unrecognized column 'x' in table incidents"), "rejected"),
        (DataError("Invalid value for UInt32 column"), "rejected"),
        (RuntimeError("something else"), "other"),
        (KeyError("x"), "other"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_the_reason_is_one_of_a_fixed_few_derived_from_the_exception(exc: BaseException, reason: str) -> None:
    assert reason in INSERT_FAILURE_REASONS
    assert insert_failure_reason(exc) == reason


def test_the_reasons_are_the_documented_set() -> None:
    assert INSERT_FAILURE_REASONS == ("disk_full", "unavailable", "rejected", "other")
    for reason in INSERT_FAILURE_REASONS:
        assert f"`{reason}`" in (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()


# --- the sink counts and remembers the failure ---------------------------------------------


class FailingStore:
    """Inserts into `table` fail with `error` `times` times, then succeed; every other table inserts."""

    def __init__(self, table: str, error: Exception, times: int) -> None:
        self.table, self.error, self.times = table, error, times
        self.inserted: dict[str, int] = {}

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return []  # RecentIds reads nothing back

    def insert(self, table: str, rows: list[list[Any]], columns: list[str]) -> None:
        if table == self.table and self.times > 0:
            self.times -= 1
            raise self.error
        self.inserted[table] = self.inserted.get(table, 0) + len(rows)


class _Health:
    def __init__(self) -> None:
        self.ready: list[tuple[bool, str]] = []

    def beat(self, processed: int = 0) -> None:
        pass

    def set_ready(self, ready: bool, why: str = "") -> None:
        self.ready.append((ready, why))


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def sink_with(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(sinks.audit, "group_consumer", lambda *a, **kw: object())

    def make(store: FailingStore) -> tuple[AuditSink, list[InsertFailure | None]]:
        sink = AuditSink("127.0.0.1:1", store)  # type: ignore[arg-type]
        sink._health = _Health()  # type: ignore[assignment]
        seen: list[InsertFailure | None] = []
        # What health and the API see between attempts: the sink sleeps there.
        monkeypatch.setattr(sinks.audit.time, "sleep", lambda s: seen.append(sink.failing))
        return sink, seen

    yield make


def test_failed_inserts_are_counted_by_table_and_reason_and_remembered_until_one_succeeds(sink_with: Any) -> None:
    store = FailingStore("incidents", DatabaseError(NOT_ENOUGH_SPACE), times=3)
    sink, seen = sink_with(store)
    # Every table's series exists from the start, at 0: increase() then sees the first failure.
    assert REGISTRY.get_sample_value(FAILURES, {"table": "incidents", "reason": "disk_full"}) is not None
    before = {r: _sample(FAILURES, table="incidents", reason=r) for r in INSERT_FAILURE_REASONS}
    anomalies_before = _sample(FAILURES, table="anomalies", reason="disk_full")
    rows_before = _sample("trainmedic_audit_rows_total", table="incidents")
    rows = {
        "anomalies": [BY_NAME["anomalies"].row(anomaly(1, "5001", "gpu02", prefix="fail"))],
        "incidents": [BY_NAME["incidents"].row(incident(i, prefix="fail")) for i in range(4)],
    }
    sink._insert_with_retry(rows)

    assert _sample(FAILURES, table="incidents", reason="disk_full") - before["disk_full"] == 3
    assert all(
        _sample(FAILURES, table="incidents", reason=r) == before[r] for r in ("unavailable", "rejected", "other")
    )
    assert _sample(FAILURES, table="anomalies", reason="disk_full") == anomalies_before
    assert _sample("trainmedic_audit_rows_total", table="incidents") - rows_before == 4
    assert store.inserted == {"anomalies": 1, "incidents": 4}  # the anomaly once, though the batch was retried

    assert [f.attempts if f else None for f in seen] == [1, 2, 3]
    first = seen[0]
    assert first is not None and all(f is not None and f.since == first.since for f in seen)
    assert (first.table, first.reason, first.rows_waiting) == ("incidents", "disk_full", 5)
    assert "NOT_ENOUGH_SPACE" in first.error and "\n" not in first.error
    text = first.describe()
    assert "inserts into incidents failing since" in text and "disk_full" in text and "nothing is lost" in text
    assert sink.failing is None  # cleared by the insert that succeeded
    assert sink._health.ready[-1] == (True, "consuming")  # type: ignore[attr-defined]
    assert any(not ok and "disk_full" in why for ok, why in sink._health.ready)  # type: ignore[attr-defined]


# --- the stack's health says it, degraded but ok --------------------------------------------


class _Supervisor:
    def health(self) -> dict[str, Any]:
        return {"ok": True, "components": {"audit-sink": {"state": "up", "restarts": 0, "reason": ""}}}


class _Sink:
    failing: InsertFailure | None = None


def test_the_stack_health_names_failing_inserts_as_degraded_and_stays_ok(tmp_path: Path) -> None:
    stack = Stack(StackConfig(data_dir=tmp_path), SimulatedScheduler([]))
    stack.supervisor = _Supervisor()  # type: ignore[assignment]
    sink = _Sink()
    stack.sink = sink  # type: ignore[assignment]
    assert "degraded" not in stack.health() and stack.audit_problem() is None
    failure = InsertFailure("incidents", "disk_full", "DatabaseError: Code: 243", 1.7e9, 4, 120)
    sink.failing = failure
    health = stack.health()
    assert health["ok"] is True  # still serving: a 503 would take the API (and the brake) off a load balancer
    assert health["degraded"] == {"audit": failure.describe()}
    assert "2023-11-14T22:13:20Z" in health["degraded"]["audit"]
    sink.failing = None
    assert "degraded" not in stack.health()


# --- the API's reads of the audit answer 503 naming it -------------------------------------


class _Problem:
    text: str | None = None

    def __call__(self) -> str | None:
        return self.text


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, _Problem]]:
    from streams.policy import DEFAULT_POLICY

    problem, store = _Problem(), FakeStore()
    app = create_api(
        store,  # type: ignore[arg-type]
        FakePublisher(),  # type: ignore[arg-type]
        TOKEN,
        object(),  # type: ignore[arg-type]
        DEFAULT_POLICY,
        tmp_path / "modes.yaml",
        health=lambda: {"ok": True, "components": {}},
        audit_problem=problem,
    )
    try:
        with TestClient(app) as client:
            yield client, problem
    finally:
        PENDING.release(store)  # type: ignore[arg-type]


AUDIT_READS = [
    "/api/incidents",
    "/api/recommendations",
    "/api/readiness",
    "/api/charts",
    "/api/goodput",
    "/api/jobs/5001/timeline",
    "/api/incidents/inc-1/bundle",
]


def test_reads_of_the_audit_say_it_is_behind_instead_of_an_empty_list(api: tuple[TestClient, _Problem]) -> None:
    client, problem = api
    assert client.get("/api/incidents", headers=AUTH).json() == []  # the empty audit, while it is current
    assert client.get("/api/recommendations", headers=AUTH).json() == []
    problem.text = "inserts into incidents failing since 2026-01-01T00:00:00Z (disk_full, 3 attempt(s)): ..."
    for path in AUDIT_READS:
        answer = client.get(path, headers=AUTH)
        assert answer.status_code == 503, (path, answer.status_code, answer.text)
        assert answer.json()["detail"] == f"the audit is behind: {problem.text}", path
        assert answer.headers["Retry-After"] == "10"
    replay = client.post("/api/replay", headers=AUTH, json={"policy_yaml": "mode: monitor\n"})
    assert replay.status_code == 503
    # A decision the audit may not have recorded yet: not "no such decision".
    approve = client.post("/api/recommendations/dec-x/approve", headers=AUTH, json={"operator": "alice"})
    assert approve.status_code == 503 and "the audit is behind" in approve.json()["detail"]
    # No token, no answer about the audit.
    assert client.get("/api/incidents").status_code == 401
    # What does not read the audit answers as before.
    assert client.get("/api/modes", headers=AUTH).status_code == 200
    assert client.get("/api/health").status_code == 200
    problem.text = None
    assert client.get("/api/incidents", headers=AUTH).json() == []
    assert (
        client.post("/api/recommendations/dec-x/approve", headers=AUTH, json={"operator": "alice"}).status_code == 404
    )


# --- `trainmedic audit ...` asks the running `up` -------------------------------------------


class _Health503(BaseHTTPRequestHandler):
    report: dict[str, Any] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps(self.report).encode()
        self.send_response(200 if self.report.get("ok") else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("ok", [True, False], ids=["degraded", "down-too"])
def test_the_audit_cli_says_the_audit_is_behind(tmp_path: Path, ok: bool) -> None:
    from trainmedic.cli.main import app

    problem = "inserts into incidents failing since 2026-01-01T00:00:00Z (disk_full, 3 attempt(s)): Code: 243"
    _Health503.report = {"ok": ok, "components": {}, "degraded": {"audit": problem}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health503)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "runtime.json").write_text(json.dumps({"api_url": f"http://127.0.0.1:{server.server_port}"}))
        for argv in (["audit", "incidents"], ["audit", "goodput"], ["audit", "job", "5001"]):
            result = CliRunner().invoke(app, [*argv, "--data-dir", str(tmp_path)])
            assert result.exit_code == 3, (argv, result.output)  # UNAVAILABLE, as the API's 503
            assert f"the audit is behind (trainmedic up on {tmp_path} says): {problem}" in result.output
        _Health503.report = {"ok": True, "components": {}}
        current = CliRunner().invoke(app, ["audit", "incidents", "--data-dir", str(tmp_path)])
        assert "behind" not in current.output and f"no audit at {tmp_path.resolve() / 'chdb'}" in current.output
    finally:
        server.shutdown()
        server.server_close()


def test_the_error_shown_is_one_bounded_line_that_keeps_clickhouse_s_error_name() -> None:
    from sinks.audit import _first_line

    long = DatabaseError(NOT_ENOUGH_SPACE.replace("threshold.", "threshold: " + "x" * 400 + ".") + "\nstack trace")
    text = _first_line(long)
    assert len(text) == 300 and text.startswith("DatabaseError: Code: 243.") and text.endswith("... (NOT_ENOUGH_SPACE)")
    assert _first_line(RuntimeError("short\nsecond line")) == "RuntimeError: short"
