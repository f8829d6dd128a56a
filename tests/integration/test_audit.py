"""The audit schema (migrations, tables, views) and `trainmedic audit`, on real chDB.

chDB lets a process open one folder, and a folder be opened by one process.
This test process already uses the session folder (`chdb_url`), so:

- the real stack (real broker, streams worker, executor, audit sink, with the
  simulated scheduler) writes into the session folder, in its own database,
  and the query functions read it there, in process;
- the CLI runs as subprocesses, which need a folder of their own: the test
  exports every audit table of that database to Parquet, a seeding subprocess
  migrates a fresh DATA_DIR/chdb with the same code and loads the files, and
  then the CLI subprocesses query DATA_DIR one after another. The CLI thus
  reads exactly the rows the real stack wrote.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from bus.admin import ensure_topics
from schemas.events import (
    Action,
    ActionResult,
    Anomaly,
    Approval,
    Decision,
    Event,
    GuardrailTrip,
    Incident,
    ModeChange,
)
from sinks import audit_queries as queries
from sinks.audit import DDL_DIR, TABLES, AuditStore, AuditStoreError, load_migrations, split_sql
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import REPO, wait_for
from tests.integration.scenario import NODES, publish_cascade, running_stack
from trainmedic.stack.broker import EmbeddedBroker

VIEWS = set(queries.VIEWS)
AUDIT_TABLES = {table for _, table, _, _ in TABLES.values()}


# --- synthetic events (also used by test_grafana.py) ---------------------------------


def incident_events(
    n: int,
    t0: float,
    *,
    job: str,
    node: str,
    category: str = "gpu_hardware",
    detect_s: float = 2.0,
    act_s: float | None = 3.0,
    job_nodes: int = 4,
    status: str = "done",
    action: str = "drain_and_requeue",
) -> list[Event]:
    """One incident's events as the pipeline would publish them: anomaly, incident, decision, action, result."""
    iid = f"inc-{job}-{n}"
    first = t0
    detected = t0 + detect_s
    nodes = [node] + [f"{node}-peer{i}" for i in range(1, job_nodes)]
    events: list[Event] = [
        Anomaly(
            event_id=f"anm-{job}-{n}",
            event_time=first,
            detector="xid",
            signature="xid_79",
            category=category,  # type: ignore[arg-type]
            severity="critical",
            role="root",
            source="kernel",
            node=node,
        ),
        Incident(
            event_id=iid,
            event_time=detected,
            incident_id=iid,
            job_id=job,
            partition="gpu",
            job_nodes=nodes,
            category=category,  # type: ignore[arg-type]
            severity="critical",
            culprit_node=node,
            confidence=0.9,
            isolate=action == "drain_and_requeue",
            explanation="synthetic",
            evidence=[],
            anomaly_ids=[f"anm-{job}-{n}"],
            first_signal_time=first,
        ),
        Decision(
            event_id=f"dec-{job}-{n}",
            event_time=detected + 0.01,
            decision_id=f"dec-{job}-{n}",
            incident_id=iid,
            job_id=job,
            partition="gpu",
            category=category,  # type: ignore[arg-type]
            culprit_node=node,
            action=action,  # type: ignore[arg-type]
            mode="autonomous",
            executed=True,
            rule=f"actions.{category}={action}",
            reason="synthetic",
            first_signal_time=first,
            incident_time=detected,
        ),
        Action(
            event_id=f"act-{job}-{n}",
            event_time=detected + 0.01,
            action_id=f"act-{job}-{n}",
            decision_id=f"dec-{job}-{n}",
            incident_id=iid,
            job_id=job,
            node=node,
            partition="gpu",
            action=action,  # type: ignore[arg-type]
            reason="synthetic",
            requested_by="policy",
            incident_time=detected,
            first_signal_time=first,
        ),
    ]
    if act_s is not None:
        events.append(
            ActionResult(
                event_id=f"res-{job}-{n}",
                event_time=detected + act_s,
                action_id=f"act-{job}-{n}",
                incident_id=iid,
                job_id=job,
                node=node,
                action=action,  # type: ignore[arg-type]
                status=status,  # type: ignore[arg-type]
                backend="simulated",
                steps=["synthetic"],
                started_at=detected + 0.02,
                verified_at=detected + act_s if status == "done" else None,
                incident_time=detected,
                first_signal_time=first,
            )
        )
    return events


def operator_events(t0: float, job: str, n: int, node: str) -> list[Event]:
    """An approval, a guardrail trip and a mode change tied to incident n of a job."""
    return [
        Approval(
            event_id=f"apr-{job}-{n}",
            event_time=t0 + 30,
            approval_id=f"apr-{job}-{n}",
            decision_id=f"dec-{job}-{n}",
            incident_id=f"inc-{job}-{n}",
            job_id=job,
            partition="gpu",
            category="gpu_hardware",
            action="drain_and_requeue",
            verdict="rejected",
            reason="wrong_node",
            comment="synthetic",
            operator="alice",
        ),
        GuardrailTrip(
            event_id=f"grd-{job}-{n}",
            event_time=t0 + 31,
            guardrail="blast_radius",
            action_id=f"act-{job}-{n}",
            incident_id=f"inc-{job}-{n}",
            job_id=job,
            node=node,
            partition="gpu",
            action="drain_and_requeue",
            detail="synthetic: 2 drains in the window",
        ),
        ModeChange(
            event_id=f"mode-{job}-{n}",
            event_time=t0 + 32,
            partition="gpu",
            category=None,
            old_mode="monitor",
            new_mode="autonomous",
            operator="bob",
            reason="synthetic",
        ),
    ]


def insert_events(store: AuditStore, events: list[Event]) -> None:
    """Insert through the sink's own row mapping (TABLES), as AuditSink does."""
    by_type = {topic.event_type: (table, to_row, cols) for topic, table, to_row, cols in TABLES.values()}
    for event in events:
        table, to_row, cols = by_type[type(event)]
        store.insert(table, [to_row(event)], cols)


# --- migrations --------------------------------------------------------------------


def _snapshot(store: AuditStore) -> dict[str, Any]:
    names = [
        r["name"]
        for r in store.query(
            "SELECT name FROM system.tables WHERE database = {d:String} ORDER BY name", {"d": store.database}
        )
    ]
    return {
        "create": {n: store.query(f"SHOW CREATE TABLE {{db}}.{n}")[0]["statement"] for n in names},
        # without FINAL: a second ledger row for a version would show here even before a merge
        "ledger": store.query(
            "SELECT version, name, checksum, applied_at FROM {db}.schema_migrations ORDER BY version"
        ),
    }


def test_migrate_twice_changes_nothing(chdb_url: str, database: str) -> None:
    store = AuditStore(chdb_url, database)
    try:
        versions = [m.version for m in load_migrations()]
        assert {1, 2, 3, 4, 5, 7} <= set(versions)
        first = store.migrate()
        assert [m.version for m in first] == versions
        before = _snapshot(store)
        assert set(before["create"]) == AUDIT_TABLES | VIEWS | {"schema_migrations"}
        assert [r["version"] for r in before["ledger"]] == versions
        assert store.migrate() == []
        assert _snapshot(store) == before
        assert [s["state"] for s in store.migration_status()] == ["applied"] * len(versions)
    finally:
        store.close()


def test_migrate_upgrades_a_database_made_before_the_ledger(chdb_url: str, database: str) -> None:
    store = AuditStore(chdb_url, database)
    try:
        # What the previous migrate() did: run 001, record nothing.
        for stmt in split_sql((DDL_DIR / "001_audit.sql").read_text().replace("{db}", database)):
            store.client.command(stmt)
        # Only the columns version 1 had: later migrations add columns to existing tables.
        have = {
            (r["table"], r["name"])
            for r in store.query("SELECT table, name FROM system.columns WHERE database = {d:String}", {"d": database})
        }
        by_type = {topic.event_type: (table, to_row, cols) for topic, table, to_row, cols in TABLES.values()}
        for event in incident_events(1, time.time() - 60, job="77", node="gpu09"):
            table, to_row, cols = by_type[type(event)]
            keep = [i for i, c in enumerate(cols) if (table, c) in have]
            row = to_row(event)
            store.insert(table, [[row[i] for i in keep]], [cols[i] for i in keep])
        assert [m.version for m in store.migrate()] == [m.version for m in load_migrations()]
        assert store.query("SELECT count() AS n FROM {db}.incidents FINAL")[0]["n"] == 1
        assert queries.incidents(store)[0]["job_id"] == "77"
    finally:
        store.close()


def test_migration_files_must_be_numbered_and_unique(tmp_path: Path) -> None:
    (tmp_path / "001_a.sql").write_text("SELECT 1;")
    (tmp_path / "1_b.sql").write_text("SELECT 1;")
    with pytest.raises(AuditStoreError, match="NNN_name.sql"):
        load_migrations(tmp_path)
    (tmp_path / "1_b.sql").unlink()
    (tmp_path / "001_c.sql").write_text("SELECT 1;")
    with pytest.raises(AuditStoreError, match="version 1 is also 001_a.sql"):
        load_migrations(tmp_path)


def test_split_sql_keeps_semicolons_in_strings_and_drops_comments() -> None:
    sql = "-- a; comment\nSELECT 'x;y' AS s; -- trailing; comment\nSELECT 2;\n"
    assert split_sql(sql) == ["SELECT 'x;y' AS s", "SELECT 2"]


# --- views ---------------------------------------------------------------------------


def test_views_count_redelivered_events_once(chdb_url: str, database: str) -> None:
    store = AuditStore(chdb_url, database)
    try:
        store.migrate()
        t0 = time.time() - 3600
        events: list[Event] = []
        # job 1: four gpu_hardware incidents on gpu01 (detection 1..4 s, action 10 s each)
        for n in range(4):
            events += incident_events(n, t0 + 100 * n, job="1", node="gpu01", detect_s=n + 1.0, act_s=10.0)
        # job 2: one user_code stop on gpu02 that failed, one interconnect requeue on gpu03 with no result yet
        events += incident_events(0, t0, job="2", node="gpu02", category="user_code", action="stop", status="failed")
        events += incident_events(
            1, t0 + 50, job="2", node="gpu03", category="interconnect", action="requeue", act_s=None, job_nodes=2
        )
        events += operator_events(t0, "1", 0, "gpu01")
        insert_events(store, events)
        insert_events(store, events)  # redelivery: every event twice

        assert len(queries.incidents(store)) == 6
        daily = queries.incidents_per_day(store)
        assert sum(r["incidents"] for r in daily) == 6

        lat = queries.latency(store)
        overall = lat["overall"]
        assert overall is not None and overall["incidents"] == 6
        gpu = next(r for r in lat["by_category"] if r["category"] == "gpu_hardware")
        # quantileExactInclusive is numpy's "linear": 1,2,3,4 -> p50 2.5, p95 3.85, p99 3.97
        assert (gpu["detection_p50"], gpu["detection_p95"], gpu["detection_p99"]) == pytest.approx((2.5, 3.85, 3.97))
        assert gpu["actions_verified"] == 4 and gpu["action_p50"] == pytest.approx(10.0)
        assert gpu["recovery_p99"] == pytest.approx(10.0 + 3.97)
        inter = next(r for r in lat["by_category"] if r["category"] == "interconnect")
        assert inter["actions_verified"] == 0 and inter["action_p50"] is None

        offenders = queries.repeat_offenders(store)
        assert (offenders[0]["node"], offenders[0]["incidents"], offenders[0]["drains"]) == ("gpu01", 4, 4)
        assert {o["node"] for o in offenders} == {"gpu01", "gpu02", "gpu03"}

        restarts = {r["job_id"]: r for r in queries.job_restarts(store)}
        assert restarts["1"]["restarts"] == 4 and restarts["2"]["restarts"] == 0
        assert restarts["2"]["failed_actions"] == 1

        saved = store.query("SELECT * FROM {db}.gpu_hours_saved WHERE job_id = '1' ORDER BY detected_at")
        assert len(saved) == 4
        # 4 nodes x 8 GPUs x (600 s watchdog + 1800 s manual - (detect + act)) / 3600
        for n, row in enumerate(saved):
            assert row["gpus"] == 32
            assert row["gpu_hours_saved"] == pytest.approx(32 * (2400 - (n + 1.0 + 10.0)) / 3600)
        total = queries.gpu_hours_saved(store)
        assert total["incidents"] == 4 and total["gpu_hours_saved"] == pytest.approx(
            sum(r["gpu_hours_saved"] for r in saved)
        )

        summary = next(r for r in queries.incidents(store) if r["incident_id"] == "inc-1-0")
        assert (summary["verdict"], summary["guardrail_trips"], summary["actions_done"]) == ("rejected", 1, 1)
        kinds = [e["kind"] for e in queries.job_timeline(store, "1")["timeline"] if e["incident_id"] == "inc-1-0"]
        assert kinds == ["anomaly", "incident", "decision", "action", "action_result", "approval", "guardrail_trip"]
    finally:
        store.close()


# --- a real stack run, and the CLI on its rows -------------------------------------------


@dataclass(frozen=True)
class RealRun:
    job: str
    database: str
    chdb_url: str
    data_dir: Path  # DATA_DIR/chdb holds a copy of the run's audit rows, for CLI subprocesses
    timeline: dict[str, Any]  # job_timeline() read in process from the stack's own database


SEED = """
import sys
from pathlib import Path
from sinks.audit import AuditStore
folder, database, export_dir = sys.argv[1:4]
store = AuditStore.embedded(Path(folder), database)
store.migrate()
for f in sorted(Path(export_dir).glob("*.parquet")):
    store.client.raw_insert(f"{database}.{f.stem}", insert_block=f.read_bytes(), fmt="Parquet")
store.close()
"""


def _complete(store: AuditStore, job: str) -> dict[str, Any] | None:
    data = queries.job_timeline(store, job)
    kinds = {e["kind"] for e in data["timeline"]}
    if not {"anomaly", "incident", "decision", "action", "action_result"} <= kinds:
        return None
    # the incident's own anomalies (the Xid one has no job id of its own) must all be in too
    ids = {e["id"] for e in data["timeline"] if e["kind"] == "anomaly"}
    wanted = store.query("SELECT anomaly_ids FROM {db}.incidents FINAL WHERE job_id = {j:String}", {"j": job})
    return data if all(set(r["anomaly_ids"]) <= ids for r in wanted) else None


@pytest.fixture(scope="module")
def real_run(chdb_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRun]:
    work = tmp_path_factory.mktemp("audit-run")
    database = f"audit{os.getpid()}"
    broker = EmbeddedBroker().start()
    try:
        ensure_topics(broker.bootstrap)
        sched = SimulatedScheduler(NODES + ["gpu05"], requeue_delay_s=0.5)
        job = sched.submit("train", 4)
        with running_stack(broker.bootstrap, chdb_url, database, sched, "autonomous", work) as stack:
            assert stack.store is not None
            store = stack.store
            publish_cascade(broker.bootstrap, work, job, NODES, culprit="gpu02")
            wait_for(f"job {job}'s whole timeline in the audit", lambda: _complete(store, job), timeout=90)
    finally:
        broker.stop(grace_s=0)
    # Read and export once the stack has stopped, so both see the same rows.
    store = AuditStore(chdb_url, database)
    try:
        timeline = queries.job_timeline(store, job)
        for table in sorted(AUDIT_TABLES):
            queries.export(store, table, "parquet", work / "export" / f"{table}.parquet")
    finally:
        store.close()
    data_dir = work / "data"
    seed = subprocess.run(
        [sys.executable, "-c", SEED, str(data_dir / "chdb"), database, str(work / "export")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert seed.returncode == 0, seed.stderr
    yield RealRun(job, database, chdb_url, data_dir, timeline)


def cli(run: RealRun, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmedic.cli.audit",
            *args,
            "--data-dir",
            str(run.data_dir),
            "--database",
            run.database,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def flat(text: str) -> str:
    """Error text without rich's box and line wrapping, for substring checks."""
    return " ".join(text.replace("│", " ").split())


def cli_json(run: RealRun, *args: str) -> Any:
    proc = cli(run, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_real_run_timeline_is_complete_and_ordered(real_run: RealRun) -> None:
    data = real_run.timeline
    items = data["timeline"]
    assert [i["job_id"] for i in items] == [real_run.job] * len(items)
    assert items[0]["kind"] == "anomaly"
    assert [(i["time"], i["stage"]) for i in items] == sorted((i["time"], i["stage"]) for i in items)
    assert [i["kind"] for i in items if i["kind"] != "anomaly"] == ["incident", "decision", "action", "action_result"]
    xid = [i for i in items if i["kind"] == "anomaly" and i["summary"].startswith("xid_79")]
    assert len(xid) == 1 and xid[0]["node"] == "gpu02"  # joined to the job through the incident
    assert {i["summary"].split(" ")[0] for i in items if i["kind"] == "anomaly"} == {"xid_79", "nccl_watchdog_timeout"}
    (inc,) = data["incidents"]
    assert (inc["category"], inc["culprit_node"], inc["decision_action"], inc["actions_done"]) == (
        "gpu_hardware",
        "gpu02",
        "drain_and_requeue",
        1,
    )
    assert data["restarts"] == 1
    result = items[-1]
    assert result["kind"] == "action_result" and result["summary"].startswith("done: drain_and_requeue")


def test_cli_job_json_is_the_full_ordered_timeline(real_run: RealRun) -> None:
    out = cli_json(real_run, "job", real_run.job)
    assert out == queries.jsonable(real_run.timeline)
    kinds = [i["kind"] for i in out["timeline"]]
    assert kinds.index("incident") < kinds.index("decision") < kinds.index("action") < kinds.index("action_result")


def test_cli_incidents_and_latency(real_run: RealRun) -> None:
    (inc,) = real_run.timeline["incidents"]
    rows = cli_json(real_run, "incidents", "--since", "24h")
    assert [r["incident_id"] for r in rows] == [inc["incident_id"]]
    assert cli_json(real_run, "incidents", "--since", "7d", "--category", "gpu_hardware")[0]["job_id"] == real_run.job
    assert cli_json(real_run, "incidents", "--category", "hang") == []

    lat = cli_json(real_run, "latency")
    overall = lat["overall"]
    assert overall["incidents"] == 1 and overall["actions_verified"] == 1
    for p in ("p50", "p95", "p99"):
        assert math.isclose(overall[f"detection_{p}"], inc["detection_latency_s"])
        assert math.isclose(overall[f"action_{p}"], inc["action_latency_s"])
    assert [r["category"] for r in lat["by_category"]] == ["gpu_hardware"]

    table = cli(real_run, "incidents", "--since", "30m")
    assert table.returncode == 0 and inc["incident_id"][:8] in table.stdout


def test_cli_node_history(real_run: RealRun) -> None:
    out = cli_json(real_run, "node", "gpu02")
    assert out["incidents_blamed"] == 1
    assert {e["kind"] for e in out["events"]} >= {"incident", "action", "action_result"}
    assert [a["signature"] for a in out["anomalies"]] == ["xid_79"]
    assert cli(real_run, "node", "no-such-node").returncode == 1


def test_cli_export_csv_and_parquet(real_run: RealRun, tmp_path: Path) -> None:
    csv_out, pq_out = tmp_path / "incidents.csv", tmp_path / "timeline.parquet"
    assert cli(real_run, "export", "--format", "csv", "--table", "incidents", "--out", str(csv_out)).returncode == 0
    frame = pd.read_csv(csv_out)
    cols = next(c for _, t, _, c in TABLES.values() if t == "incidents")
    assert list(frame.columns) == cols
    assert frame["job_id"].astype(str).tolist() == [real_run.job]

    out = cli_json(
        real_run, "export", "--format", "parquet", "--table", "timeline", "--since", "1h", "--out", str(pq_out)
    )
    table = pq.read_table(pq_out)
    assert out["rows"] == table.num_rows == len(real_run.timeline["timeline"])
    assert table.column_names[:4] == ["time", "kind", "stage", "id"]
    assert sorted(table.column("kind").to_pylist()) == sorted(i["kind"] for i in real_run.timeline["timeline"])

    bad = cli(real_run, "export", "--table", "latency_percentiles", "--since", "1h", "--out", str(tmp_path / "x.csv"))
    assert bad.returncode == 2 and "--since" in flat(bad.stderr)
    bad = cli(real_run, "export", "--table", "nope", "--out", str(tmp_path / "x.csv"))
    assert bad.returncode == 2 and "--table" in flat(bad.stderr)


def test_cli_rejects_a_bad_since_naming_the_option(real_run: RealRun, tmp_path: Path) -> None:
    out = str(tmp_path / "x.csv")
    for args in (
        ("incidents", "--since", "bogus"),
        ("incidents", "--since", "0h"),
        ("export", "--since", "5x", "--table", "incidents", "--out", out),
    ):
        proc = cli(real_run, *args)
        assert proc.returncode == 2, proc.stderr
        assert "--since" in flat(proc.stderr) and "30m, 24h or 7d" in flat(proc.stderr), proc.stderr


def test_cli_says_when_another_process_holds_the_chdb_folder(real_run: RealRun) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from sinks.audit import AuditStore; "
            f"s = AuditStore('chdb://{real_run.data_dir / 'chdb'}', {real_run.database!r}); s.query('SELECT 1'); "
            "print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        proc = cli(real_run, "latency")
        assert proc.returncode == 3  # the audit store is unavailable while another process holds it
        assert f"locked by PID {holder.pid}" in flat(proc.stderr) and "trainmedic up" in flat(proc.stderr)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    assert cli(real_run, "latency").returncode == 0  # free again once the holder is gone


def test_cli_missing_audit_and_database(real_run: RealRun, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainmedic.cli.audit", "latency", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 2 and "no audit at" in flat(proc.stderr)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmedic.cli.audit",
            "latency",
            "--data-dir",
            str(real_run.data_dir),
            "--database",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 2 and "no database 'nope'" in flat(proc.stderr) and real_run.database in proc.stderr
