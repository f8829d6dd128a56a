"""Each audit table is declared once (sinks/audit_schema.py): the migrated database matches
the declarations, the sink's rows come from them, TTL settings reach the DDL and are
checked, and the Replicated DDL passes ClickHouse's own parser. Real chDB."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from schemas.topics import ALL_TOPICS
from sinks.audit import TABLES, AuditStore, AuditStoreError
from sinks.audit_schema import (
    BY_NAME,
    DECLARED,
    READ_WINDOWS_DAYS,
    AuditSchemaError,
    LayoutSettings,
    check_settings,
)
from tests.integration.test_audit import incident_events, insert_events, operator_events
from trainmedic.settings import Settings, SettingsError, audit_layout


@pytest.fixture
def migrated(chdb_url: str, database: str) -> Iterator[AuditStore]:
    store = AuditStore(chdb_url, database, LayoutSettings(raw_ttl_days=120, record_ttl_days=400))
    store.migrate()
    try:
        yield store
    finally:
        store.close()


def test_every_table_matches_its_one_declaration(migrated: AuditStore) -> None:
    for table in BY_NAME.values():
        cols = migrated.query(
            "SELECT name, type, default_expression, compression_codec FROM system.columns "
            "WHERE database = {d:String} AND table = {t:String} ORDER BY position",
            {"d": migrated.database, "t": table.name},
        )
        assert [(c["name"], c["type"]) for c in cols] == [(c.name, c.type) for c in table.columns], table.name
        for col, decl in zip(cols, table.columns, strict=True):
            assert col["default_expression"] == (decl.default or ""), (table.name, decl.name)
            assert col["compression_codec"] == (f"CODEC({decl.codec})" if decl.codec else ""), (table.name, decl.name)
        (info,) = migrated.query(
            "SELECT sorting_key, partition_key, engine, engine_full FROM system.tables "
            "WHERE database = {d:String} AND name = {t:String}",
            {"d": migrated.database, "t": table.name},
        )
        assert info["sorting_key"] == ", ".join(table.order_by)
        assert info["partition_key"] == "toYYYYMM(event_time)"
        assert info["engine"] == "ReplacingMergeTree"
        assert f"index_granularity = {table.granularity}" in info["engine_full"]
        indexes = migrated.query(
            "SELECT name FROM system.data_skipping_indices WHERE database = {d:String} AND table = {t:String}",
            {"d": migrated.database, "t": table.name},
        )
        assert sorted(i["name"] for i in indexes) == sorted(ix.split()[0] for ix in table.indexes)
        assert migrated.layout_matches(table)


def test_sink_rows_come_from_the_declarations() -> None:
    assert set(TABLES) == set(DECLARED)
    for topic, (t, name, _, cols) in TABLES.items():
        assert t.name == topic and name == DECLARED[topic].name and cols == DECLARED[topic].column_names
    assert {t.topic.name for t in DECLARED.values()} <= {t.name for t in ALL_TOPICS}
    for table in DECLARED.values():
        assert table.order_by[-1] == table.id_column


def test_keys_are_non_null_with_an_empty_default() -> None:
    for table in BY_NAME.values():
        if table.name == "mode_changes":
            continue  # NULL there means "every partition/category", a value of its own
        for c in table.columns:
            if c.name in ("job_id", "node", "partition", "category", "culprit_node"):
                assert "Nullable" not in c.type and c.default == "''", (table.name, c.name)
                if c.name != "job_id":
                    assert c.type == "LowCardinality(String)", (table.name, c.name)


def test_ttl_settings_reach_the_ddl_and_follow_changes(chdb_url: str, database: str, migrated: AuditStore) -> None:
    def ttl_of(name: str) -> str:
        ddl = migrated.query(f"SHOW CREATE TABLE {{db}}.{name}")[0]["statement"]
        m = re.search(r"TTL (.+)", ddl)
        return m.group(1) if m else ""

    assert ttl_of("anomalies") == "toDateTime(event_time) + toIntervalDay(120)"
    assert ttl_of("sched_events") == "toDateTime(event_time) + toIntervalDay(120)"
    assert ttl_of("incidents") == "toDateTime(event_time) + toIntervalDay(400)"
    assert ttl_of("mode_changes") == ""  # the durable record of autonomy never expires
    # A later start with other settings: MODIFY TTL, no rebuild, a second start changes nothing.
    again = AuditStore(chdb_url, database, LayoutSettings(raw_ttl_days=95, record_ttl_days=0))
    assert again.migrate() == []
    assert ttl_of("anomalies") == "toDateTime(event_time) + toIntervalDay(95)"
    assert ttl_of("incidents") == ""
    assert again.apply_retention(again.layout()) == []


def test_retention_shorter_than_a_reading_window_is_refused_at_start(chdb_url: str, database: str) -> None:
    longest_raw = max(READ_WINDOWS_DAYS["raw"].values())
    with pytest.raises(AuditSchemaError, match=r"TRAINMEDIC_AUDIT_RAW_TTL_DAYS=30 is shorter than the 90 days"):
        check_settings(LayoutSettings(raw_ttl_days=30))
    with pytest.raises(AuditSchemaError, match="keeps raw events longer"):
        check_settings(LayoutSettings(raw_ttl_days=800, record_ttl_days=400))
    with pytest.raises(SettingsError, match="audit_raw_ttl_days"):
        Settings.load(None, audit_raw_ttl_days="ninety")
    assert audit_layout(Settings.load(None, audit_raw_ttl_days=str(longest_raw))).raw_ttl_days == longest_raw
    store = AuditStore(chdb_url, database, LayoutSettings(raw_ttl_days=7))
    try:
        with pytest.raises(AuditStoreError, match="shorter than"):
            store.migrate()
        names = store.query("SELECT name FROM system.tables WHERE database = {d:String}", {"d": database})
        assert names == []  # refused before anything was created
    finally:
        store.close()


def test_replicated_ddl_passes_clickhouses_parser(migrated: AuditStore) -> None:
    """ON CLUSTER and Replicated* are only parsed here (chDB has no Keeper), never executed."""
    settings = LayoutSettings(cluster="prod_cluster")
    for table in BY_NAME.values():
        ddl = table.ddl("trainmedic", settings)
        assert " ON CLUSTER prod_cluster " in ddl and "ReplicatedReplacingMergeTree(" in ddl
        (row,) = migrated.query("SELECT formatQuery({q:String}) AS f", {"q": ddl})
        assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}', '{replica}')" in row["f"]
    with pytest.raises(AuditStoreError, match="chDB has no Keeper"):
        AuditStore(migrated.url, migrated.database, settings).layout()


def test_redelivered_events_appear_once_on_the_new_layout(migrated: AuditStore) -> None:
    from sinks import audit_queries as q

    t0 = time.time() - 600
    events = incident_events(0, t0, job="j9", node="n9") + operator_events(t0, "j9", 0, "n9")
    insert_events(migrated, events)
    insert_events(migrated, events)
    assert [i["incident_id"] for i in q.incidents(migrated)] == ["inc-j9-0"]
    timeline = q.job_timeline(migrated, "j9")["timeline"]
    assert len(timeline) == len({(e["kind"], e["id"]) for e in timeline}) == 7
    node = q.node_history(migrated, "n9")
    assert node["incidents_blamed"] == 1 and [a["anomalies"] for a in node["anomalies"]] == [1]
    assert q.latency(migrated)["overall"]["incidents"] == 1
