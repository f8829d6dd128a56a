"""Goodput accounting (#20 item 5) on the real chDB: the incident_goodput and job_goodput views
(sinks/ddl/016_goodput.sql, replaced by 021_goodput_outages.sql), sinks.audit_queries.goodput,
`trainmedic audit goodput` and the console's GET /api/goodput.

One audit with every case, inserted twice (Kafka redelivers; FINAL counts each event once):

- job 9001, 4 nodes (32 GPUs), three attempts: the first progressed, then two incidents each ended an
  attempt and neither restart made progress. Incident 0 is running again at the scheduler's RUNNING
  report of attempt 2 (queued 600 s after the requeue), incident 1 at attempt 3's start (no RUNNING
  report of it in the audit).
- job 9002, 2 nodes: its incident stopped it; it never ran again (no GPU-hours lost counted, said so),
  and it never reported progress (no ratio).
- job 9003, 1 node: an incident and scheduler reports but no attempt recorded (rows from before
  job_attempts): running again at its first RUNNING report after the fault.
- job 9005: one attempt still running whose restart's cause record shares the attempt's start time
  (the tie the latest-record rule must break towards the cause: it says the attempt progressed).

A second audit (`outage_events`) holds the two over-counts of 016 that 021 removes:

- job 9101, 4 nodes: a kernel Xid incident and a hang incident of one outage (the hang's requeue was
  skipped: the Xid's had already stopped the job), then a second outage: charged 8 + 4 GPU-hours,
  the outage of both to the Xid incident, whose fault came first (016: 8 + 7.82 + 4).
- job 9102, 2 nodes: a recommendation only (monitor mode) on a job that kept running; a person
  requeued it two hours later (016 charged the two hours: 32.4 GPU-hours).
- job 9103, 1 node: a drain only on a job that kept running to completion (016: "not running again").
- job 9104, 1 node: three requeues; the second's outage (fault -> its next attempt RUNNING) began
  before the first's ended and outlasts it: one outage from the first fault to the second's running
  again; the third fault at that very instant starts an outage of its own.

Every expected number is computed here by hand from the times below, not read back.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas.events import Action, ActionResult, Decision, Event, JobAttempt, SchedEvent
from sinks import audit_queries as q
from sinks.audit import DDL_DIR, AuditStore, load_migrations, split_sql
from tests.conftest import new_database_name
from tests.integration.test_audit import incident_events, insert_events
from trainmedic.ops.replay import GPUS_PER_NODE

# Two days ago, on the hour: whole seconds, so every difference is exact in milliseconds.
T0 = (int(time.time()) // 3600 - 48) * 3600
GPN = q.GOODPUT_ASSUMPTIONS["gpus_per_node"]


def at(offset: float) -> datetime:
    return datetime.fromtimestamp(T0 + offset, tz=UTC)


def attempt(
    job: str,
    n: int,
    started: float,
    *,
    record: float | None = None,
    ended: float | None = None,
    progressed: bool | None = None,
    cause: str | None = None,
    excluded: tuple[str, ...] = (),
    end_reason: str | None = None,
    steps: tuple[int | None, int | None] = (None, None),
) -> JobAttempt:
    """One record of attempt n of job's lineage (offsets from T0), as streams/lineage.py publishes it."""
    when = T0 + (record if record is not None else ended if ended is not None else started)
    # Ids that sort open < cause < end: the sort key (event_time, event_id) reads a tie in that order,
    # so only the latest-record rule, not the id, can pick the cause record of job 9005.
    state = "3-end" if ended is not None else "2-cause" if cause else "1-open"
    return JobAttempt(
        event_id=f"att-{job}-{n}-{state}",
        event_time=when,
        lineage_id=f"lin-{job}",
        job_id=job,
        first_seen=T0,
        attempt=n,
        restart_count=n - 1,
        started_at=T0 + started,
        ended_at=None if ended is None else T0 + ended,
        end_reason=end_reason,
        cause_incident_id=cause,
        cause_category="gpu_hardware" if cause else None,
        cause_node=None,
        excluded_nodes=list(excluded),
        start_step=steps[0],
        max_step=steps[1],
        progressed=progressed,
    )


def running(job: str, offset: float, nodes: list[str]) -> SchedEvent:
    return SchedEvent(
        event_id=f"sched-{job}-{offset}",
        event_time=T0 + offset,
        kind="job",
        job_id=job,
        state="RUNNING",
        nodes=nodes,
        partition="gpu",
    )


def goodput_events() -> list[Event]:
    nodes1 = ["gpu11", "gpu11-peer1", "gpu11-peer2", "gpu11-peer3"]  # incident_events' job_nodes
    events: list[Event] = []
    # job 9001
    events += [
        attempt("9001", 1, 0),
        attempt("9001", 1, 0, cause="inc-9001-0"),  # policy's restart order, before the job ends
        attempt("9001", 1, 0, ended=3600, progressed=True, cause="inc-9001-0", steps=(None, 1000)),
        attempt("9001", 2, 3600, excluded=("gpu11",), steps=(1000, None)),
        attempt("9001", 2, 3600, ended=7200, progressed=False, cause="inc-9001-1", excluded=("gpu11",)),
        attempt("9001", 3, 7200, excluded=("gpu11", "gpu12")),
        attempt("9001", 3, 7200, ended=9000, progressed=False, end_reason="completed", excluded=("gpu11", "gpu12")),
        running("9001", 0, nodes1),  # attempt 1: before both faults
        running("9001", 4200, nodes1),  # attempt 2, 600 s after its requeue
    ]
    events += incident_events(0, T0 + 3300, job="9001", node="gpu11", detect_s=10, act_s=30, job_nodes=4)
    events += incident_events(1, T0 + 6750, job="9001", node="gpu12", detect_s=5, act_s=60, job_nodes=4)
    # job 9002: stopped, never ran again, never reported progress
    events += [
        attempt("9002", 1, 1000),
        attempt("9002", 1, 1000, ended=2000, cause="inc-9002-0", end_reason="cancelled"),
    ]
    events += incident_events(0, T0 + 1900, job="9002", node="gpu21", detect_s=2, act_s=50, job_nodes=2, action="stop")
    # job 9003: no attempt recorded, the scheduler's reports only
    events += incident_events(0, T0 + 500, job="9003", node="gpu31", detect_s=1, act_s=None, job_nodes=1)
    events += [running("9003", 100, ["gpu31"]), running("9003", 2300, ["gpu31"])]
    # job 9005: running; the cause record ties with the open record's time
    events += [
        attempt("9005", 1, 8000),
        attempt("9005", 1, 8000, record=8000, cause="inc-elsewhere", progressed=True),
    ]
    return events


# incident -> (job, gpus, fault, detected, acted, running again, from where) as offsets from T0
INCIDENTS: dict[str, tuple[str, int, float, float, float | None, float | None, str | None]] = {
    "inc-9001-0": ("9001", 4 * 8, 3300, 3310, 3340, 4200, "next attempt RUNNING"),
    "inc-9001-1": ("9001", 4 * 8, 6750, 6755, 6815, 7200, "next attempt start"),
    "inc-9002-0": ("9002", 2 * 8, 1900, 1902, 1952, None, None),
    "inc-9003-0": ("9003", 1 * 8, 500, 501, None, 2300, "RUNNING after the fault"),
}


def expected_incident(iid: str) -> dict[str, Any]:
    job, gpus, fault, detected, acted, again, source = INCIDENTS[iid]
    recover = None if again is None else again - fault
    return {
        "incident_id": iid,
        "job_id": job,
        "gpus": gpus,
        "fault_at": at(fault),
        "detected_at": at(detected),
        "acted_at": None if acted is None else at(acted),
        "running_again_at": None if again is None else at(again),
        "running_again_from": source,
        "time_to_detect_s": detected - fault,
        "time_to_act_s": None if acted is None else acted - detected,
        "time_to_recover_s": recover,
        "gpu_hours_lost": None if recover is None else gpus * recover / 3600,
    }


# 9001: 8.0 + 4.0 GPU-hours; wall 0 -> 9000 s; productive: attempt 1 (3600 s); no progress: 3600 + 1800 s.
JOBS: dict[str, dict[str, Any]] = {
    "9001": {
        "lineages": 1,
        "attempts": 3,
        "restarts": 2,
        "attempts_running": 0,
        "attempts_progressed": 1,
        "attempts_no_progress": 2,
        "attempts_unknown": 0,
        "first_started_at": at(0),
        "last_ended_at": at(9000),
        "wall_s": 9000.0,
        "productive_s": 3600.0,
        "unproductive_s": 5400.0,
        "unknown_s": 0.0,
        "effective_ratio": 3600 / 9000,
        "incidents": 2,
        "incidents_not_running_again": 0,
        "gpu_hours_lost": 32 * 900 / 3600 + 32 * 450 / 3600,
    },
    "9002": {
        "lineages": 1,
        "attempts": 1,
        "restarts": 0,
        "attempts_running": 0,
        "attempts_progressed": 0,
        "attempts_no_progress": 0,
        "attempts_unknown": 1,
        "first_started_at": at(1000),
        "last_ended_at": at(2000),
        "wall_s": 1000.0,
        "productive_s": 0.0,
        "unproductive_s": 0.0,
        "unknown_s": 1000.0,
        "effective_ratio": None,
        "incidents": 1,
        "incidents_not_running_again": 1,
        "gpu_hours_lost": 0.0,
    },
    "9003": {
        "lineages": 0,
        "attempts": 0,
        "restarts": 0,
        "attempts_running": 0,
        "attempts_progressed": 0,
        "attempts_no_progress": 0,
        "attempts_unknown": 0,
        "first_started_at": None,
        "last_ended_at": None,
        "wall_s": None,
        "productive_s": None,
        "unproductive_s": None,
        "unknown_s": None,
        "effective_ratio": None,
        "incidents": 1,
        "incidents_not_running_again": 0,
        "gpu_hours_lost": 8 * 1800 / 3600,
    },
}
NOW_DEPENDENT = {"wall_s", "productive_s"}  # job 9005's running attempt counts until now


def quantile(values: list[float], p: float) -> float:
    """quantileExactInclusive: linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = p * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


@pytest.fixture(scope="module")
def store(chdb_url: str) -> Iterator[AuditStore]:
    # Read only by its tests: seeded once per module and worker.
    s = AuditStore(chdb_url, new_database_name())
    s.migrate()
    events = goodput_events()
    insert_events(s, events)
    insert_events(s, events)  # redelivery: every event twice
    try:
        yield s
    finally:
        s.close()


def by(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {r[key]: r for r in rows}


def check_job_9005(row: dict[str, Any]) -> None:
    """The running attempt that progressed: productive all along (ratio 1), until now."""
    elapsed = time.time() - (T0 + 8000)
    assert row["attempts_running"] == 1 and row["attempts_progressed"] == 1 and row["attempts_unknown"] == 0
    assert row["last_ended_at"] is None and row["first_started_at"] == at(8000)
    assert row["productive_s"] == row["wall_s"] and elapsed - 120 < row["wall_s"] <= elapsed + 1
    assert row["effective_ratio"] == 1.0 and row["unproductive_s"] == 0.0 and row["unknown_s"] == 0.0
    assert row["incidents"] == 0 and row["gpu_hours_lost"] == 0.0


def test_goodput_views_count_each_incident_and_job_exactly(store: AuditStore) -> None:
    assert GPN == GPUS_PER_NODE == 8  # the one convention: gpu_hours_saved, replay, goodput
    rows = by(q._rows(store, "SELECT * FROM {db}.incident_goodput"), "incident_id")
    assert set(rows) == set(INCIDENTS)
    for iid in INCIDENTS:
        got = rows[iid]
        assert {k: got[k] for k in expected_incident(iid)} == expected_incident(iid), iid
    assert rows["inc-9001-0"]["gpu_hours_lost"] == 8.0 and rows["inc-9001-1"]["gpu_hours_lost"] == 4.0
    assert rows["inc-9001-0"]["culprit_node"] == "gpu11" and rows["inc-9001-0"]["category"] == "gpu_hardware"
    # Each of 9001's incidents stopped the job (a verified drain_and_requeue) and is an outage of its own;
    # 9003's requeue has no result, but the job ran again; 9002 was stopped and is still down.
    assert {i: (r["lost_basis"], r["charged_to"], r["stop_evidence"]) for i, r in rows.items()} == {
        "inc-9001-0": ("outage", "inc-9001-0", "stopping action done"),
        "inc-9001-1": ("outage", "inc-9001-1", "stopping action done"),
        "inc-9002-0": ("still down", "inc-9002-0", "stopping action done"),
        "inc-9003-0": ("outage", "inc-9003-0", "stopping action without a result, ran again"),
    }
    # Never running again: no loss counted (not 0, not "until now").
    assert rows["inc-9002-0"]["running_again_at"] is None and rows["inc-9002-0"]["gpu_hours_lost"] is None

    jobs = by(q._rows(store, "SELECT * FROM {db}.job_goodput"), "job_id")
    assert set(jobs) == {"9001", "9002", "9003", "9005"}
    for job, want in JOBS.items():
        assert {k: jobs[job][k] for k in want} == want, job
    check_job_9005(jobs["9005"])


def test_the_views_are_the_queries_sql(store: AuditStore) -> None:
    """021's views (the latest of the goodput views) and goodput()'s bounded reads are one text: every
    filter "1" gives the view."""
    (migration,) = DDL_DIR.glob("021_*.sql")
    statements = split_sql(migration.read_text())

    def norm(sql: str) -> str:
        return " ".join(sql.split())

    assert [norm(s) for s in statements] == [
        norm("CREATE OR REPLACE VIEW {db}.incident_goodput AS " + q.incident_goodput_sql()),
        norm("CREATE OR REPLACE VIEW {db}.job_goodput AS " + q.job_goodput_sql()),
    ]


def test_goodput_totals_and_rows(store: AuditStore) -> None:
    data = q.goodput(store, since=timedelta(days=7))
    fleet = data["fleet"]
    expected = [expected_incident(i) for i in INCIDENTS]
    lost = [e["gpu_hours_lost"] for e in expected if e["gpu_hours_lost"] is not None]
    assert (fleet["incidents"], fleet["incidents_running_again"], fleet["incidents_not_running_again"]) == (4, 3, 1)
    assert (fleet["outages"], fleet["incidents_kept_running"], fleet["incidents_no_job"]) == (3, 0, 0)
    assert fleet["gpu_hours_lost"] == sum(lost) == 16.0
    for m in ("time_to_detect", "time_to_act", "time_to_recover"):
        values = [e[f"{m}_s"] for e in expected if e[f"{m}_s"] is not None]
        assert fleet[f"{m}_mean"] == pytest.approx(sum(values) / len(values), rel=1e-12), m
        assert fleet[f"{m}_p50"] == pytest.approx(quantile(values, 0.5), rel=1e-12), m
        assert fleet[f"{m}_p95"] == pytest.approx(quantile(values, 0.95), rel=1e-12), m
    assert (fleet["time_to_detect_p50"], fleet["time_to_act_p50"], fleet["time_to_recover_p50"]) == (3.5, 50.0, 900.0)
    # Jobs: 9001 (ratio 0.4) and 9005 (running, progressed: 1.0) have a ratio, summed over their judged time.
    jobs = by(data["jobs"], "job_id")
    w5 = jobs["9005"]["wall_s"]
    assert (fleet["jobs"], fleet["jobs_with_ratio"], fleet["restarts"]) == (4, 2, 2)
    # (each read takes its own `now`: 9005's wall time differs by the time between them)
    assert fleet["effective_ratio"] == pytest.approx((3600 + w5) / (9000 + w5), rel=1e-5)
    # The same rows as the views, worst job first; incidents newest first.
    assert [r["job_id"] for r in data["jobs"]] == ["9001", "9003", "9005", "9002"]
    assert [r["incident_id"] for r in data["incidents"]] == ["inc-9001-1", "inc-9001-0", "inc-9002-0", "inc-9003-0"]
    views = by(q._rows(store, "SELECT * FROM {db}.incident_goodput"), "incident_id")
    assert by(data["incidents"], "incident_id") == views
    view_jobs = by(q._rows(store, "SELECT * FROM {db}.job_goodput"), "job_id")
    for job in JOBS:
        assert jobs[job] == view_jobs[job], job
    check_job_9005(jobs["9005"])
    assert data["assumptions"]["gpus_per_node"] == 8
    json.dumps(q.jsonable(data))  # JSON-ready


def test_goodput_window_limit_and_job(store: AuditStore) -> None:
    # The last 30 hours: T0 (48 h ago) and everything after it is outside: nothing.
    recent = q.goodput(store, since=timedelta(hours=30))
    assert recent["fleet"]["incidents"] == 0 and recent["fleet"]["gpu_hours_lost"] == 0.0
    assert recent["fleet"]["time_to_detect_p50"] is None and recent["fleet"]["effective_ratio"] is None
    assert recent["jobs"] == [] and recent["incidents"] == []
    one = q.goodput(store, since=timedelta(days=7), job="9001")
    assert [r["incident_id"] for r in one["incidents"]] == ["inc-9001-1", "inc-9001-0"]
    assert [r["job_id"] for r in one["jobs"]] == ["9001"] and one["fleet"]["gpu_hours_lost"] == 12.0
    assert one["fleet"]["effective_ratio"] == 0.4
    limited = q.goodput(store, since=timedelta(days=7), limit=1)
    assert len(limited["jobs"]) == len(limited["incidents"]) == 1 and limited["fleet"]["incidents"] == 4
    assert q.goodput(store, job="9002")["jobs"][0]["incidents_not_running_again"] == 1


def test_cli_goodput(store: AuditStore, chdb_url: str) -> None:
    from typer.testing import CliRunner

    from trainmedic.cli.audit import audit_app

    base = ["goodput", "--clickhouse", chdb_url, "--database", store.database]
    wide = {"COLUMNS": "250"}  # rich's width: every table cell on one line
    result = CliRunner().invoke(audit_app, [*base, "--since", "7d"], env=wide)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "goodput, fleet, last 7d: 4 incident(s): 16.0 GPU-hours lost in 3 outage(s)" in out
    assert "1 not running again" in out
    assert "effective training time" in out
    for line in ("9001", "9002", "9003", "inc-9001-0", "inc-9002-0"):
        assert line in out, line
    # The incident that never ran again says so instead of a number.
    (row,) = [ln for ln in out.splitlines() if "inc-9002-0" in ln]
    assert "not running again" in row
    as_json = CliRunner().invoke(audit_app, [*base, "--job", "9001", "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    assert data["fleet"]["gpu_hours_lost"] == 12.0 and [j["job_id"] for j in data["jobs"]] == ["9001"]
    assert data["jobs"][0]["effective_ratio"] == 0.4
    assert data["incidents"][0]["running_again_at"] == at(7200).isoformat()
    bad = CliRunner().invoke(audit_app, [*base, "--since", "forever"])
    assert bad.exit_code == 2 and "--since" in bad.output


def test_console_goodput_route(store: AuditStore) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from trainmedic.web.console.routes import console_router

    app = FastAPI()
    app.include_router(console_router(store, "tok", None))
    with TestClient(app) as client:
        assert client.get("/api/goodput").status_code == 401
        assert client.get("/api/goodput", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = client.get("/api/goodput", params={"since": "7d"}, headers={"Authorization": "Bearer tok"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["fleet"]["incidents"] == 4 and body["fleet"]["gpu_hours_lost"] == 16.0
        assert [j["job_id"] for j in body["jobs"]][:2] == ["9001", "9003"]
        assert body["jobs"][0]["effective_ratio"] == 0.4
        never = next(i for i in body["incidents"] if i["incident_id"] == "inc-9002-0")
        assert never["running_again_at"] is None and never["gpu_hours_lost"] is None
        assert body["since"] == "7d"
        bad = client.get("/api/goodput", params={"since": "7x"}, headers={"Authorization": "Bearer tok"})
        assert bad.status_code == 422


# --- the over-counts of 016: one outage charged once, only an incident that stopped its job ------------


def recommendation_only(events: list[Event]) -> list[Event]:
    """An incident's events in monitor mode: the decision recommends, no action is taken."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Decision):
            out.append(e.model_copy(update={"mode": "monitor", "executed": False}))
        elif not isinstance(e, Action | ActionResult):
            out.append(e)
    return out


def outage_events() -> list[Event]:
    events: list[Event] = []
    # job 9101: Xid at 1000 (requeue verified 1040), the hang it caused seen from 1020 (detected at 1320,
    # after the requeue: its own requeue skipped); RUNNING again at 1900. Another Xid at 3000, RUNNING 3450.
    n1 = ["gpu61", "gpu61-peer1", "gpu61-peer2", "gpu61-peer3"]
    events += [
        attempt("9101", 1, 0),
        attempt("9101", 1, 0, record=1010, cause="inc-9101-0"),
        attempt("9101", 1, 0, ended=1040, progressed=True, cause="inc-9101-0", steps=(None, 500)),
        attempt("9101", 2, 1040, excluded=("gpu61",), steps=(500, None)),
        attempt("9101", 2, 1040, record=3010, cause="inc-9101-2", excluded=("gpu61",)),
        attempt("9101", 2, 1040, ended=3030, progressed=True, cause="inc-9101-2", excluded=("gpu61",)),
        attempt("9101", 3, 3030, excluded=("gpu61", "gpu62")),
        running("9101", 0, n1),
        running("9101", 1900, n1),
        running("9101", 3450, n1),
    ]
    events += incident_events(0, T0 + 1000, job="9101", node="gpu61", detect_s=10, act_s=30, job_nodes=4)
    events += incident_events(
        1,
        T0 + 1020,
        job="9101",
        node="gpu61",
        category="hang",
        detect_s=300,
        act_s=5,
        job_nodes=4,
        action="requeue",
        status="skipped",
    )
    events += incident_events(2, T0 + 3000, job="9101", node="gpu62", detect_s=10, act_s=30, job_nodes=4)
    # job 9102: a recommendation at 2000 (monitor mode); the job ran on; a person requeued it at 9200.
    events += [
        attempt("9102", 1, 0),
        attempt("9102", 1, 0, ended=9200, progressed=True, end_reason="requeued (Slurm restart count 1)"),
        attempt("9102", 2, 9200),
        running("9102", 0, ["gpu71", "gpu71-peer1"]),
        running("9102", 9290, ["gpu71", "gpu71-peer1"]),
    ]
    events += recommendation_only(
        incident_events(0, T0 + 2000, job="9102", node="gpu71", detect_s=5, act_s=None, job_nodes=2)
    )
    # job 9103: a drain only (verified at 1522) at 1500; the job ran on and completed at 6000.
    events += [
        attempt("9103", 1, 0),
        attempt("9103", 1, 0, ended=6000, progressed=True, end_reason="completed"),
        running("9103", 0, ["gpu81"]),
    ]
    events += incident_events(0, T0 + 1500, job="9103", node="gpu81", detect_s=2, act_s=20, job_nodes=1, action="drain")
    # job 9104: requeues verified at 1010, 1500 and 2000; RUNNING in attempts 2, 3 and 4 at 1450, 1900, 2350.
    for n, (start, end) in enumerate([(0, 1010), (1010, 1500), (1500, 2000)], start=1):
        cause = f"inc-9104-{n - 1}"
        events += [attempt("9104", n, start), attempt("9104", n, start, ended=end, progressed=False, cause=cause)]
    events += [attempt("9104", 4, 2000)]
    events += [running("9104", t, ["gpu91"]) for t in (0, 1450, 1900, 2350)]
    for n, (fault, act_s) in enumerate([(1000, 5), (1200, 290), (1900, 95)]):
        events += incident_events(
            n, T0 + fault, job="9104", node="gpu91", detect_s=5 if n != 1 else 10, act_s=act_s, job_nodes=1
        )
    return events


# The Xid + hang outage of 9101 once (1000 -> 1900), then its second outage (3000 -> 3450), 32 GPUs.
OUTAGE_9101 = 32 * (1900 - 1000) / 3600 + 32 * (3450 - 3000) / 3600
# What 016 charged: the hang incident again (1020 -> 1900), and 9102 from its recommendation to the
# RUNNING report after the person's requeue (16 GPUs x 7290 s).
OLD_9101 = OUTAGE_9101 + 32 * (1900 - 1020) / 3600
OLD_9102 = 16 * (9290 - 2000) / 3600
# 9104: 1000 -> 1450 and 1200 -> 1900 are one outage (1000 -> 1900); 1900 -> 2350 touches it: another.
OUTAGE_9104 = 8 * (1900 - 1000) / 3600 + 8 * (2350 - 1900) / 3600
OLD_9104 = 8 * ((1450 - 1000) + (1900 - 1200) + (2350 - 1900)) / 3600


@pytest.fixture(scope="module")
def outage_store(chdb_url: str) -> Iterator[AuditStore]:
    # Read only by its tests: seeded once per module and worker.
    s = AuditStore(chdb_url, new_database_name())
    s.migrate()
    events = outage_events()
    insert_events(s, events)
    insert_events(s, events)  # redelivered
    try:
        yield s
    finally:
        s.close()


def test_one_outage_is_charged_once_to_its_first_incident(outage_store: AuditStore) -> None:
    jobs = by(q._rows(outage_store, "SELECT * FROM {db}.job_goodput"), "job_id")
    assert jobs["9101"]["gpu_hours_lost"] == OUTAGE_9101 == 12.0
    rows = by(q._rows(outage_store, "SELECT * FROM {db}.incident_goodput"), "incident_id")
    got = {
        i: (r["lost_basis"], r["gpu_hours_lost"], r["charged_to"], r["stop_evidence"], r["time_to_recover_s"])
        for i, r in rows.items()
        if i.startswith("inc-9101")
    }
    assert got == {
        "inc-9101-0": ("outage", 8.0, "inc-9101-0", "stopping action done", 900.0),
        # The hang's fault fell inside the Xid's outage, and the job had stopped before it was published.
        "inc-9101-1": ("outage", 0.0, "inc-9101-0", "job stopped before the incident", 880.0),
        "inc-9101-2": ("outage", 4.0, "inc-9101-2", "stopping action done", 450.0),
    }
    assert rows["inc-9101-1"]["running_again_at"] == at(1900)
    j = jobs["9101"]
    assert (j["incidents"], j["outages"], j["incidents_not_running_again"], j["incidents_kept_running"]) == (3, 2, 0, 0)
    # The fleet counts it once too, and goodput() (bounded reads) says what the views say.
    data = q.goodput(outage_store, since=timedelta(days=7))
    fleet = data["fleet"]
    assert fleet["gpu_hours_lost"] == OUTAGE_9101 + OUTAGE_9104 == 15.0 and fleet["outages"] == 4
    assert (fleet["incidents"], fleet["incidents_running_again"], fleet["incidents_kept_running"]) == (8, 6, 2)
    assert fleet["incidents_not_running_again"] == 0
    assert by(data["incidents"], "incident_id") == rows
    assert q.goodput(outage_store, since=timedelta(days=7), job="9101")["fleet"]["gpu_hours_lost"] == 12.0


def test_overlapping_outages_chain_and_touching_ones_do_not(outage_store: AuditStore) -> None:
    rows = by(q._rows(outage_store, "SELECT * FROM {db}.incident_goodput WHERE job_id = '9104'"), "incident_id")
    got = {i: (r["gpu_hours_lost"], r["charged_to"], r["running_again_at"]) for i, r in rows.items()}
    assert got == {
        "inc-9104-0": (2.0, "inc-9104-0", at(1450)),  # the whole 1000 -> 1900
        "inc-9104-1": (0.0, "inc-9104-0", at(1900)),
        "inc-9104-2": (1.0, "inc-9104-2", at(2350)),
    }
    (job,) = q._rows(outage_store, "SELECT * FROM {db}.job_goodput WHERE job_id = '9104'")
    assert (job["gpu_hours_lost"], job["outages"]) == (OUTAGE_9104, 2) and OUTAGE_9104 == 3.0


def test_an_incident_that_did_not_stop_its_job_is_not_charged(outage_store: AuditStore) -> None:
    jobs = by(q._rows(outage_store, "SELECT * FROM {db}.job_goodput"), "job_id")
    assert (jobs["9102"]["gpu_hours_lost"], jobs["9103"]["incidents_not_running_again"]) == (0.0, 0)
    rows = by(q._rows(outage_store, "SELECT * FROM {db}.incident_goodput"), "incident_id")
    for iid in ("inc-9102-0", "inc-9103-0"):
        r = rows[iid]
        assert r["lost_basis"] == "job kept running", iid
        assert r["gpu_hours_lost"] == 0.0 and r["charged_to"] is None and r["stop_evidence"] is None, iid
        assert r["running_again_at"] is None and r["time_to_recover_s"] is None, iid
    assert rows["inc-9103-0"]["acted_at"] == at(1522)  # the drain was carried out: it stops no job
    for job in ("9102", "9103"):
        j = jobs[job]
        assert (j["gpu_hours_lost"], j["incidents_kept_running"], j["incidents_not_running_again"]) == (0.0, 1, 0), job
        assert j["outages"] == 0 and j["incidents"] == 1, job


# --- an incident that did not stop its job, inside another's outage: no recovery of its own ----------


def within_outage_events() -> list[Event]:
    """Job 9105, 4 nodes: a kernel Xid at 1000 stops it (requeue verified at 1040; Slurm reports it
    PENDING), RUNNING again at 1900. A hang whose last progress is at 1100, while the job was already
    down, is published at 1400; its requeue is skipped: it did not stop the job (no stop of its own, no
    attempt ended and no state other than RUNNING reported between its fault and its publication)."""
    nodes = ["gpu95", "gpu95-peer1", "gpu95-peer2", "gpu95-peer3"]
    events: list[Event] = [
        attempt("9105", 1, 0),
        attempt("9105", 1, 0, record=1010, cause="inc-9105-0"),
        attempt("9105", 1, 0, ended=1040, progressed=True, cause="inc-9105-0", steps=(None, 500)),
        attempt("9105", 2, 1040, excluded=("gpu95",), steps=(500, None)),
        running("9105", 0, nodes),
        SchedEvent(
            event_id="sched-9105-pending",
            event_time=T0 + 1040,
            kind="job",
            job_id="9105",
            state="PENDING",
            previous_state="RUNNING",
            nodes=[],
            partition="gpu",
        ),
        running("9105", 1900, nodes),
    ]
    events += incident_events(0, T0 + 1000, job="9105", node="gpu95", detect_s=10, act_s=30, job_nodes=4)
    events += incident_events(
        1,
        T0 + 1100,
        job="9105",
        node="gpu95",
        category="hang",
        detect_s=300,
        act_s=5,
        job_nodes=4,
        action="requeue",
        status="skipped",
    )
    return events


@pytest.fixture(scope="module")
def within_store(chdb_url: str) -> Iterator[AuditStore]:
    # Read only by its tests: seeded once per module and worker.
    s = AuditStore(chdb_url, new_database_name())
    s.migrate()
    events = within_outage_events()
    insert_events(s, events)
    insert_events(s, events)  # redelivered
    try:
        yield s
    finally:
        s.close()


def test_an_incident_inside_an_outage_that_did_not_stop_the_job_has_no_recovery(within_store: AuditStore) -> None:
    """The hang belongs to the Xid's outage (charged_to the Xid, 0 lost) but did not stop the job: no
    running again, no time to recover; the job counts one outage and one recovery (fleet and per job)."""
    rows = by(q._rows(within_store, "SELECT * FROM {db}.incident_goodput"), "incident_id")
    got = {
        i: (
            r["lost_basis"],
            r["gpu_hours_lost"],
            r["charged_to"],
            r["stop_evidence"],
            r["running_again_at"],
            r["running_again_from"],
            r["time_to_recover_s"],
        )
        for i, r in rows.items()
    }
    assert got == {
        "inc-9105-0": (
            "outage",
            32 * 900 / 3600,
            "inc-9105-0",
            "stopping action done",
            at(1900),
            "next attempt RUNNING",
            900.0,
        ),
        "inc-9105-1": ("within outage", 0.0, "inc-9105-0", None, None, None, None),
    }
    (job,) = q._rows(within_store, "SELECT * FROM {db}.job_goodput")
    assert (job["job_id"], job["incidents"], job["outages"], job["gpu_hours_lost"]) == ("9105", 2, 1, 8.0)
    assert (job["incidents_not_running_again"], job["incidents_kept_running"]) == (0, 0)
    for data in (q.goodput(within_store, since=timedelta(days=7)), q.goodput(within_store, job="9105")):
        f = data["fleet"]
        assert (f["incidents"], f["outages"], f["incidents_running_again"], f["incidents_within_outage"]) == (
            2,
            1,
            1,
            1,
        )
        assert (f["incidents_not_running_again"], f["incidents_kept_running"], f["gpu_hours_lost"]) == (0, 0, 8.0)
        # One outage, one recovery: the Xid's 900 s, not the hang's 800 s beside it.
        assert (f["time_to_recover_mean"], f["time_to_recover_p50"], f["time_to_recover_p95"]) == (900.0,) * 3
        assert by(data["incidents"], "incident_id") == rows


def test_the_cli_says_an_incident_was_within_an_outage(within_store: AuditStore, chdb_url: str) -> None:
    from typer.testing import CliRunner

    from trainmedic.cli.audit import audit_app

    base = ["goodput", "--clickhouse", chdb_url, "--database", within_store.database, "--since", "7d"]
    result = CliRunner().invoke(audit_app, base, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "2 incident(s): 8.0 GPU-hours lost in 1 outage(s)" in out
    assert "1 running again" in out and "1 within another's outage (0, no recovery)" in out
    (hang,) = [ln for ln in out.splitlines() if "inc-9105-1" in ln]
    assert "within outage (job already down)" in hang and "0.00 (outage of inc-9105-0)" in hang


def test_the_cli_says_what_was_charged(outage_store: AuditStore, chdb_url: str) -> None:
    from typer.testing import CliRunner

    from trainmedic.cli.audit import audit_app

    base = ["goodput", "--clickhouse", chdb_url, "--database", outage_store.database, "--since", "7d"]
    result = CliRunner().invoke(audit_app, base, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "8 incident(s): 15.0 GPU-hours lost in 4 outage(s)" in out
    assert "2 did not stop their job (0)" in out
    (hang,) = [ln for ln in out.splitlines() if "inc-9101-1" in ln]
    assert "0.00 (outage of inc-9101-0)" in hang
    (rec,) = [ln for ln in out.splitlines() if "inc-9102-0" in ln]
    assert "job kept running" in rec and "0.00" in rec


def test_the_016_views_over_count_this_audit(chdb_url: str, database: str, tmp_path: Path) -> None:
    """The same events on the views of 016 (021 not applied) show both over-counts, so the tests above
    test something: the hang incident charged again, the recommendation charged until the requeue, the
    drain-only incident "not running again"."""
    for m in load_migrations():
        if m.version < 21:
            shutil.copy(m.path, tmp_path / m.path.name)
    old = AuditStore(chdb_url, database)
    try:
        old.migrate(tmp_path)
        insert_events(old, outage_events())
        jobs = by(q._rows(old, "SELECT * FROM {db}.job_goodput"), "job_id")
        assert jobs["9101"]["gpu_hours_lost"] == pytest.approx(OLD_9101) and OLD_9101 > 19.8
        assert jobs["9102"]["gpu_hours_lost"] == pytest.approx(OLD_9102) == 32.4
        assert jobs["9103"]["incidents_not_running_again"] == 1
        assert jobs["9104"]["gpu_hours_lost"] == pytest.approx(OLD_9104) and OLD_9104 > 3.5
    finally:
        old.close()
