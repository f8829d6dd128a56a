"""The layout migration (sinks/ddl/007_layout.sql) on live tables of the old
layout (migrations 001-005): every row kept, a second run changes nothing, a failure
leaves the old table serving, rows written during the copy are not lost. Real chDB."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from schemas.events import Event
from sinks import audit_queries as q
from sinks.audit import DDL_DIR, REBUILD_SUFFIX, TABLES, AuditStore, AuditStoreError, load_migrations
from sinks.audit_schema import BY_NAME, LayoutSettings
from tests.integration.test_audit import _snapshot, incident_events, operator_events
from tests.integration.test_grafana import DASHBOARDS, expand_grafana, panels


def _old_layout(store: AuditStore, tmp: Path) -> None:
    """Migrations 001-005 only: the tables as released before the layout."""
    for f in DDL_DIR.glob("00[1-5]_*.sql"):
        shutil.copy(f, tmp / f.name)
    assert [m.version for m in store.migrate(tmp)] == [1, 2, 3, 4, 5]


def _insert_old(store: AuditStore, events: list[Event]) -> None:
    """Rows as the old sink wrote them: NULL (not '') for no job, node or partition."""
    by_type = {topic.event_type: (table, to_row, cols) for topic, table, to_row, cols in TABLES.values()}
    keys = {"job_id", "node", "partition", "culprit_node", "category"}
    for event in events:
        table, to_row, cols = by_type[type(event)]
        old = [(c, v) for c, v in zip(cols, to_row(event), strict=True) if not added_after_layout(table, c)]
        row = [None if (c in keys and v == "" and table != "mode_changes") else v for c, v in old]
        store.insert(table, [row], [c for c, _ in old])


def _events(t0: float) -> list[Event]:
    events: list[Event] = []
    for n in range(3):
        events += incident_events(n, t0 + 100 * n, job="41", node="gpu07")
    events += incident_events(0, t0 + 5, job="42", node="gpu08", category="user_code", action="stop", status="failed")
    events += operator_events(t0, "41", 0, "gpu07")
    return events


# Columns added by migrations after the layout (009, 010, 012, 014, 017, 018, 022, 023, 024), by table ("*": every
# table): absent from the old tables, NULL or their default after.
ADDED_AFTER_LAYOUT = {
    "*": {"cluster"},
    "sched_events": {"reason_user", "reason_time", "reservation"},
    "incidents": {"isolate", "job_comment", "domain", "domain_nodes", "domain_failed_nodes", "provenance", "kind"},
    "anomalies": {"provenance"},
    "node_returns": {"outcome", "check", "check_passed", "detail"},
}


def added_after_layout(table: str, column: str) -> bool:
    return column in ADDED_AFTER_LAYOUT["*"] | ADDED_AFTER_LAYOUT.get(table, set())


def _contents(store: AuditStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows, deduplicated, with NULL keys read as '' (what the layout stores)."""
    out = {}
    have = {
        r["name"]
        for r in store.query("SELECT name FROM system.tables WHERE database = {d:String}", {"d": store.database})
    }
    for table in BY_NAME.values():
        if table.name not in have:
            continue  # new since the old layout (action_attempts, health_events, ...): nothing to keep
        # The columns the old layout had (later migrations add some, NULL for the old rows).
        old = {c["name"] for c in store.query(f"DESCRIBE TABLE {{db}}.{table.name}")}
        cols = ", ".join(
            f"ifNull(toString(`{c.name}`), '')" if c.default == "''" else f"toString(`{c.name}`)"
            for c in table.columns
            if c.name in old and not added_after_layout(table.name, c.name)
        )
        rows = store.query(f"SELECT {cols} FROM {{db}}.{table.name} FINAL ORDER BY {table.id_column}")
        out[table.name] = [tuple(r.values()) for r in rows]
    return out


def test_migration_keeps_every_row_and_a_second_run_changes_nothing(
    chdb_url: str, database: str, tmp_path: Path
) -> None:
    store = AuditStore(chdb_url, database, LayoutSettings())
    try:
        _old_layout(store, tmp_path)
        events = _events(time.time() - 3 * 86400)
        _insert_old(store, events)
        _insert_old(store, events[:4])  # a redelivery waiting for a merge
        before = _contents(store)
        assert sum(len(v) for v in before.values()) == len(events)
        assert not store.layout_matches(BY_NAME["anomalies"])

        applied = store.migrate()
        assert [m.version for m in applied] == [m.version for m in load_migrations() if m.version > 5]
        assert _contents(store) == before | {
            "action_attempts": [],
            "health_events": [],
            "job_attempts": [],
            "node_commands": [],
            "migrations": [],
        }
        # Rows from before the cluster name are the default cluster's (migration 010).
        assert store.query("SELECT DISTINCT cluster FROM {db}.incidents") == [{"cluster": "default"}]
        for table in BY_NAME.values():
            assert store.layout_matches(table), table.name
        leftovers = store.query(
            "SELECT name FROM system.tables WHERE database = {d:String} AND name LIKE {p:String}",
            {"d": database, "p": f"%{REBUILD_SUFFIX}"},
        )
        assert leftovers == []
        snapshot = _snapshot(store)
        assert store.migrate() == []
        for table in BY_NAME.values():
            assert store.rebuild(table, store.layout()) is False
        assert _snapshot(store) == snapshot

        # The queries, views and Grafana panels on the migrated rows.
        assert {i["incident_id"] for i in q.incidents(store, since=q.parse_since("7d"))} == {
            "inc-41-0",
            "inc-41-1",
            "inc-41-2",
            "inc-42-0",
        }
        kinds = [e["kind"] for e in q.job_timeline(store, "41")["timeline"] if e["incident_id"] == "inc-41-0"]
        assert kinds == ["anomaly", "incident", "decision", "action", "action_result", "approval", "guardrail_trip"]
        assert q.node_history(store, "gpu07")["incidents_blamed"] == 3
        assert q.latency(store)["overall"]["incidents"] == 4
        for view in q.VIEWS:
            store.query(f"SELECT * FROM {{db}}.{view}")
        assert len(store.query("SELECT * FROM {db}.timeline WHERE job_id = '41'")) == 3 * 5 + 2
        now = time.time()
        assert DASHBOARDS
        # The plugin's connection is to the data source's default database: tables go unqualified.
        store.client.command(f"USE {database}")
        for _, panel in panels():
            for t in panel["targets"]:
                store.client.query(expand_grafana(t["rawSql"], {}, now - 7 * 86400, now, 3600))
    finally:
        store.client.command("USE default")  # the chDB session outlives the store
        store.close()


class _FailingCopy(AuditStore):
    """Fails the copy into the new incidents table, as a full disk or a killed query would."""

    def _command(self, sql: str) -> None:
        if sql.startswith(f"INSERT INTO {self.database}.incidents{REBUILD_SUFFIX}"):
            raise RuntimeError("simulated: no space left on device")
        super()._command(sql)


def test_a_failed_migration_leaves_the_old_table_serving(chdb_url: str, database: str, tmp_path: Path) -> None:
    store = _FailingCopy(chdb_url, database, LayoutSettings())
    try:
        _old_layout(store, tmp_path)
        events = _events(time.time() - 86400)
        _insert_old(store, events)
        with pytest.raises(AuditStoreError, match="the old table still serves"):
            store.migrate()
        assert 7 not in store.applied_migrations()
        assert not store.layout_matches(BY_NAME["incidents"])  # the old table, untouched
        assert store.query("SELECT count() AS n FROM {db}.incidents FINAL")[0]["n"] == 4
        assert (
            store.query(
                "SELECT count() AS n FROM system.tables WHERE database = {d:String} AND name = 'incidents__rebuild'",
                {"d": database},
            )[0]["n"]
            == 0
        )
        # The old queries keep working on it, and a later run (the cause fixed) completes.
        fixed = AuditStore(chdb_url, database, LayoutSettings())
        before = _contents(fixed)
        assert [m.version for m in fixed.migrate()] == [m.version for m in load_migrations() if m.version > 5]
        assert _contents(fixed) == before | {
            "action_attempts": [],
            "health_events": [],
            "job_attempts": [],
            "node_commands": [],
            "migrations": [],
        }
    finally:
        store.close()


def test_rows_written_during_the_copy_are_not_lost(chdb_url: str, database: str, tmp_path: Path) -> None:
    """A writer still on the old table while it is copied: its rows reach the new one."""
    late = incident_events(9, time.time() - 60, job="43", node="gpu09")

    class _WriterDuringCopy(AuditStore):
        def _command(self, sql: str) -> None:
            super()._command(sql)
            if sql.startswith(f"INSERT INTO {self.database}.anomalies{REBUILD_SUFFIX}"):
                _insert_old(self, late[:1])  # lands in the old table after its rows were copied

    store = _WriterDuringCopy(chdb_url, database, LayoutSettings())
    try:
        _old_layout(store, tmp_path)
        _insert_old(store, _events(time.time() - 86400))
        store.migrate()
        ids = {r["event_id"] for r in store.query("SELECT event_id FROM {db}.anomalies FINAL")}
        assert late[0].event_id in ids and len(ids) == 5
    finally:
        store.close()


def test_a_column_the_declaration_lacks_stops_the_rebuild(chdb_url: str, database: str, tmp_path: Path) -> None:
    """Copying only declared columns would drop it: refused, nothing changed."""
    store = AuditStore(chdb_url, database, LayoutSettings())
    try:
        _old_layout(store, tmp_path)
        store._command(f"ALTER TABLE {database}.incidents ADD COLUMN site String DEFAULT 'x'")
        _insert_old(store, _events(time.time() - 86400))
        with pytest.raises(AuditStoreError, match="site that sinks/audit_schema.py does not declare"):
            store.migrate()
        assert not store.layout_matches(BY_NAME["incidents"])
        assert store.query("SELECT count() AS n FROM {db}.incidents FINAL WHERE site = 'x'")[0]["n"] == 4
    finally:
        store.close()


def test_rows_past_the_new_ttl_are_not_copied_and_do_not_fail_the_migration(
    chdb_url: str, database: str, tmp_path: Path
) -> None:
    """An old table holds rows the new layout's TTL has already expired (raw events of 100 days
    with a 90-day raw TTL): the copy drops them, as a merge would, and the migration completes
    instead of reporting them missing forever."""
    store = AuditStore(chdb_url, database, LayoutSettings(raw_ttl_days=90))
    try:
        _old_layout(store, tmp_path)
        old = incident_events(0, time.time() - 100 * 86400, job="51", node="gpu09")
        fresh = _events(time.time() - 86400)
        _insert_old(store, old + fresh)
        store.migrate()
        anomalies = {r["event_id"] for r in store.query("SELECT event_id FROM {db}.anomalies FINAL")}
        assert "anm-51-0" not in anomalies  # past the 90-day raw TTL
        assert {"anm-41-0", "anm-41-1", "anm-41-2", "anm-42-0"} <= anomalies
        # Records keep 730 days: the 100-day-old incident of the same fault is still there.
        assert store.query("SELECT 1 FROM {db}.incidents FINAL WHERE incident_id = 'inc-51-0'")
        assert store.query(
            "SELECT count() AS n FROM system.tables WHERE database = {d:String} AND name LIKE {p:String}",
            {"d": database, "p": f"%{REBUILD_SUFFIX}"},
        ) == [{"n": 0}]
    finally:
        store.close()
