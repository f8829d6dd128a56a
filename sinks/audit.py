"""The audit sink: every anomaly, incident, decision, action, result, approval,
mode change, guardrail trip and dead letter lands in ClickHouse (chDB embedded,
or a server by URL).

Inserts are batched; offsets are committed only after the insert succeeded.
The schema is a numbered series of migrations in infra/clickhouse/; applied
versions are recorded in `schema_migrations`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import clickhouse_connect
import orjson
from clickhouse_connect.driver.client import Client
from confluent_kafka import Consumer, KafkaError, Message

from schemas.clients import consumer_config
from schemas.codec import DecodeError, decode
from schemas.deadletter import make_dead_letter
from schemas.events import (
    Action,
    ActionResult,
    Anomaly,
    Approval,
    DeadLetter,
    Decision,
    Event,
    GuardrailTrip,
    Incident,
    ModeChange,
    NodeReturn,
    SchedEvent,
)
from schemas.topics import (
    ACTION_RESULTS,
    ACTIONS,
    ANOMALIES,
    APPROVALS,
    DEADLETTER,
    DECISIONS,
    GUARDRAIL_TRIPS,
    INCIDENTS,
    MODE_CHANGES,
    NODE_RETURNS,
    SCHED_EVENTS,
    Topic,
)

log = logging.getLogger("trainmedic.audit")

DDL_DIR = Path(__file__).resolve().parent.parent / "infra" / "clickhouse"


def _ts(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


def _anomaly(e: Anomaly) -> list[Any]:
    return [
        e.event_id,
        _ts(e.event_time),
        _ts(e.produced_at),
        e.detector,
        e.signature,
        e.category,
        e.severity,
        e.role,
        e.source,
        e.job_id,
        e.node,
        e.rank,
        e.partition,
        e.line,
        e.meaning,
    ]


def _incident(e: Incident) -> list[Any]:
    evidence = orjson.dumps([ev.model_dump(mode="json") for ev in e.evidence]).decode()
    return [
        e.incident_id,
        _ts(e.event_time),
        _ts(e.first_signal_time),
        e.job_id,
        e.partition,
        e.job_nodes,
        e.category,
        e.severity,
        e.culprit_node,
        e.culprit_rank,
        e.confidence,
        e.recommended_action,
        e.explanation,
        evidence,
        e.anomaly_ids,
        round(e.event_time - e.first_signal_time, 3),
        e.job_name,
        e.user,
        e.account,
    ]


def _decision(e: Decision) -> list[Any]:
    return [
        e.decision_id,
        _ts(e.event_time),
        e.incident_id,
        e.job_id,
        e.partition,
        e.category,
        e.culprit_node,
        e.action,
        e.mode,
        "action" if e.executed else "recommendation",
        e.rule,
        e.reason,
        _ts(e.first_signal_time),
        _ts(e.incident_time),
    ]


def _action(e: Action) -> list[Any]:
    return [
        e.action_id,
        _ts(e.event_time),
        e.decision_id,
        e.incident_id,
        e.job_id,
        e.node,
        e.partition,
        e.action,
        e.reason,
        e.requested_by,
        _ts(e.incident_time),
    ]


def _result(e: ActionResult) -> list[Any]:
    latency = round(e.verified_at - e.incident_time, 3) if e.verified_at else None
    return [
        e.action_id,
        _ts(e.event_time),
        e.incident_id,
        e.job_id,
        e.node,
        e.action,
        e.status,
        e.backend,
        e.steps,
        e.error,
        _ts(e.started_at),
        _ts(e.verified_at),
        _ts(e.incident_time),
        _ts(e.first_signal_time),
        latency,
    ]


def _approval(e: Approval) -> list[Any]:
    return [
        e.approval_id,
        _ts(e.event_time),
        e.decision_id,
        e.incident_id,
        e.job_id,
        e.partition,
        e.category,
        e.action,
        e.verdict,
        e.reason,
        e.comment,
        e.operator,
    ]


def _mode_change(e: ModeChange) -> list[Any]:
    return [
        e.event_id,
        _ts(e.event_time),
        e.partition,
        e.category,
        e.old_mode,
        e.new_mode,
        e.operator,
        e.reason,
        e.forced,
        e.outcome,
        e.readiness,
    ]


def _sched(e: SchedEvent) -> list[Any]:
    return [
        e.event_id,
        _ts(e.event_time),
        e.kind,
        e.job_id,
        e.node,
        e.state,
        e.previous_state,
        e.nodes,
        e.partition,
        e.reason,
        e.flags,
        e.job_name,
        e.user,
        e.account,
    ]


def _node_return(e: NodeReturn) -> list[Any]:
    return [e.event_id, _ts(e.event_time), e.node, e.incident_id, e.drain_reason, e.operator, e.comment]


def _guardrail_trip(e: GuardrailTrip) -> list[Any]:
    return [
        e.event_id,
        _ts(e.event_time),
        e.guardrail,
        e.action_id,
        e.incident_id,
        e.job_id,
        e.node,
        e.partition,
        e.action,
        e.detail,
    ]


def _dead(e: DeadLetter) -> list[Any]:
    return [
        e.event_id,
        _ts(e.event_time),
        e.component,
        e.original_topic,
        e.original_partition,
        e.original_offset,
        e.reason,
        e.payload_b64,
    ]


_Row = Callable[[Any], list[Any]]
TABLES: dict[str, tuple[Topic, str, _Row, list[str]]] = {
    ANOMALIES.name: (
        ANOMALIES,
        "anomalies",
        _anomaly,
        [
            "event_id",
            "event_time",
            "produced_at",
            "detector",
            "signature",
            "category",
            "severity",
            "role",
            "source",
            "job_id",
            "node",
            "rank",
            "partition",
            "line",
            "meaning",
        ],
    ),
    INCIDENTS.name: (
        INCIDENTS,
        "incidents",
        _incident,
        [
            "incident_id",
            "event_time",
            "first_signal_time",
            "job_id",
            "partition",
            "job_nodes",
            "category",
            "severity",
            "culprit_node",
            "culprit_rank",
            "confidence",
            "recommended_action",
            "explanation",
            "evidence",
            "anomaly_ids",
            "detection_latency_s",
            "job_name",
            "user",
            "account",
        ],
    ),
    DECISIONS.name: (
        DECISIONS,
        "decisions",
        _decision,
        [
            "decision_id",
            "event_time",
            "incident_id",
            "job_id",
            "partition",
            "category",
            "culprit_node",
            "action",
            "mode",
            "kind",
            "rule",
            "reason",
            "first_signal_time",
            "incident_time",
        ],
    ),
    ACTIONS.name: (
        ACTIONS,
        "actions",
        _action,
        [
            "action_id",
            "event_time",
            "decision_id",
            "incident_id",
            "job_id",
            "node",
            "partition",
            "action",
            "reason",
            "requested_by",
            "incident_time",
        ],
    ),
    ACTION_RESULTS.name: (
        ACTION_RESULTS,
        "action_results",
        _result,
        [
            "action_id",
            "event_time",
            "incident_id",
            "job_id",
            "node",
            "action",
            "status",
            "backend",
            "steps",
            "error",
            "started_at",
            "verified_at",
            "incident_time",
            "first_signal_time",
            "action_latency_s",
        ],
    ),
    APPROVALS.name: (
        APPROVALS,
        "approvals",
        _approval,
        [
            "approval_id",
            "event_time",
            "decision_id",
            "incident_id",
            "job_id",
            "partition",
            "category",
            "action",
            "verdict",
            "reason",
            "comment",
            "operator",
        ],
    ),
    MODE_CHANGES.name: (
        MODE_CHANGES,
        "mode_changes",
        _mode_change,
        [
            "event_id",
            "event_time",
            "partition",
            "category",
            "old_mode",
            "new_mode",
            "operator",
            "reason",
            "forced",
            "outcome",
            "readiness",
        ],
    ),
    SCHED_EVENTS.name: (
        SCHED_EVENTS,
        "sched_events",
        _sched,
        [
            "event_id",
            "event_time",
            "kind",
            "job_id",
            "node",
            "state",
            "previous_state",
            "nodes",
            "partition",
            "reason",
            "flags",
            "job_name",
            "user",
            "account",
        ],
    ),
    NODE_RETURNS.name: (
        NODE_RETURNS,
        "node_returns",
        _node_return,
        ["event_id", "event_time", "node", "incident_id", "drain_reason", "operator", "comment"],
    ),
    GUARDRAIL_TRIPS.name: (
        GUARDRAIL_TRIPS,
        "guardrail_trips",
        _guardrail_trip,
        [
            "event_id",
            "event_time",
            "guardrail",
            "action_id",
            "incident_id",
            "job_id",
            "node",
            "partition",
            "action",
            "detail",
        ],
    ),
    DEADLETTER.name: (
        DEADLETTER,
        "dead_letters",
        _dead,
        [
            "event_id",
            "event_time",
            "component",
            "original_topic",
            "original_partition",
            "original_offset",
            "reason",
            "payload_b64",
        ],
    ),
}


class AuditStoreError(RuntimeError):
    pass


class ChdbFolderLocked(AuditStoreError):
    """Another process owns the chDB folder (chDB allows one process per folder)."""

    def __init__(self, folder: Path, holder: str) -> None:
        self.folder = folder
        self.holder = holder
        super().__init__(
            f"the chDB folder {folder} is locked by {holder} (a running `trainmedic up`?): "
            "chDB lets one process at a time open a folder"
        )


def chdb_folder(url: str) -> Path | None:
    """The folder of a `chdb://` URL, None for a server URL."""
    if not url.startswith("chdb://"):
        return None
    return Path(url.removeprefix("chdb://").split("?", 1)[0])


def chdb_folder_holder(folder: Path) -> str | None:
    """Who holds a chDB folder: 'PID n' (from its status file) or None when it is free.

    chDB takes an exclusive flock on `status` for as long as the process lives and
    writes the owner's PID into it. Probing the lock first turns chDB's generic
    "Error initializing EmbeddedServer" into a message that names the owner.
    """
    try:
        fd = os.open(folder / "status", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            m = re.search(r"PID: (\d+)", (folder / "status").read_text(errors="replace"))
            return f"PID {m.group(1)}" if m else "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# --- migrations ---------------------------------------------------------------------

MIGRATION_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")

# The ledger itself predates every numbered migration, so it is created outside them.
# ReplacingMergeTree by version: two processes migrating one server at once both
# record a version, and the ledger still holds it once (the DDL is idempotent).
_BOOTSTRAP = (
    "CREATE DATABASE IF NOT EXISTS {db}",
    """CREATE TABLE IF NOT EXISTS {db}.schema_migrations (
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY version""",
)


def split_sql(text: str) -> list[str]:
    """The statements of a SQL script: `;` outside quotes ends one, `--` comments are dropped."""
    statements: list[str] = []
    buf: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(text):
                buf.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
            buf.append(ch)
        elif text.startswith("--", i):
            i = text.find("\n", i)
            if i < 0:
                break
            buf.append("\n")
        elif ch == ";":
            statements.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        i += 1
    statements.append("".join(buf))
    return [body for stmt in statements if (body := "\n".join(x.rstrip() for x in stmt.strip().splitlines()).strip())]


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path
    checksum: str  # sha256 of the file as written, before `{db}` is replaced

    def statements(self, database: str) -> list[str]:
        return split_sql(self.path.read_text().replace("{db}", database))


def load_migrations(ddl_dir: Path = DDL_DIR) -> list[Migration]:
    """The numbered migrations NNN_name.sql of a folder, in version order."""
    found: dict[int, Migration] = {}
    for path in sorted(ddl_dir.glob("*.sql")):
        m = MIGRATION_NAME.match(path.name)
        if not m:
            raise AuditStoreError(f"{path}: migration files are named NNN_name.sql (lower case, digits, _)")
        version = int(m.group(1))
        if version in found:
            raise AuditStoreError(f"{path}: version {version} is also {found[version].path.name}")
        found[version] = Migration(version, m.group(2), path, hashlib.sha256(path.read_bytes()).hexdigest())
    return [found[v] for v in sorted(found)]


class AuditStore:
    """A ClickHouse client (chDB or server) plus the audit schema. Thread-safe."""

    def __init__(self, url: str, database: str = "trainmedic") -> None:
        if not database.replace("_", "").isalnum():
            raise AuditStoreError(f"database name {database!r}: letters, digits and _ only")
        self.url = url
        self.database = database
        folder = chdb_folder(url)
        if folder is not None and (holder := chdb_folder_holder(folder)) and holder != f"PID {os.getpid()}":
            raise ChdbFolderLocked(folder, holder)
        try:
            self.client: Client = clickhouse_connect.get_client(dsn=url)
        except Exception as exc:
            if "already initialized" in str(exc):
                raise AuditStoreError(
                    f"cannot open {url}: this process has another chDB folder open, and chDB allows one per process"
                ) from None
            raise AuditStoreError(f"cannot open ClickHouse at {url}: {exc}") from None
        self._lock = threading.Lock()

    @classmethod
    def embedded(cls, data_dir: Path, database: str = "trainmedic") -> AuditStore:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"chdb://{data_dir.resolve()}", database)

    def _command(self, sql: str) -> None:
        with self._lock:
            self.client.command(sql)

    def applied_migrations(self) -> dict[int, dict[str, Any]]:
        """version -> ledger row; empty when the ledger does not exist yet."""
        exists = self.query(
            "SELECT count() AS n FROM system.tables WHERE database = {d:String} AND name = 'schema_migrations'",
            {"d": self.database},
        )[0]["n"]
        if not exists:
            return {}
        rows = self.query("SELECT version, name, checksum, applied_at FROM {db}.schema_migrations FINAL")
        return {int(r["version"]): r for r in rows}

    def migrate(self, ddl_dir: Path = DDL_DIR) -> list[Migration]:
        """Apply the migrations the ledger lacks, in order; return those applied.

        A database made before the ledger existed (001 applied, nothing recorded)
        is brought up to date too: every migration is written to be idempotent
        (IF NOT EXISTS, OR REPLACE), so rerunning 001 there changes nothing.
        """
        migrations = load_migrations(ddl_dir)
        for stmt in _BOOTSTRAP:
            self._command(stmt.replace("{db}", self.database))
        applied = self.applied_migrations()
        known = {m.version for m in migrations}
        if newer := sorted(v for v in applied if v not in known):
            log.warning("audit database %s has migrations %s that this trainmedic does not know", self.database, newer)
        done: list[Migration] = []
        for m in migrations:
            if m.version in applied:
                if applied[m.version]["checksum"] != m.checksum:
                    # Editing an applied migration does not reapply it: the change belongs in a new file.
                    log.warning("migration %s was edited after it was applied to %s", m.path.name, self.database)
                continue
            for stmt in m.statements(self.database):
                self._command(stmt)
            self.insert(
                "schema_migrations",
                [[m.version, m.name, m.checksum, datetime.now(tz=UTC)]],
                ["version", "name", "checksum", "applied_at"],
            )
            log.info("audit database %s: applied migration %s", self.database, m.path.name)
            done.append(m)
        return done

    def migration_status(self, ddl_dir: Path = DDL_DIR) -> list[dict[str, Any]]:
        """Every migration known to the code or the database, applied or pending."""
        applied = self.applied_migrations()
        out: list[dict[str, Any]] = []
        for m in load_migrations(ddl_dir):
            row = applied.pop(m.version, None)
            out.append(
                {
                    "version": m.version,
                    "name": m.name,
                    "state": "pending" if row is None else "applied",
                    "applied_at": row["applied_at"] if row else None,
                    "edited_since": bool(row and row["checksum"] != m.checksum),
                }
            )
        for version, row in sorted(applied.items()):
            out.append(
                {
                    "version": version,
                    "name": row["name"],
                    "state": "unknown to this trainmedic",
                    "applied_at": row["applied_at"],
                    "edited_since": False,
                }
            )
        return out

    def insert(self, table: str, rows: Sequence[list[Any]], columns: list[str]) -> None:
        with self._lock:
            self.client.insert(f"{self.database}.{table}", rows, column_names=columns)

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run a query; `{db}` in the SQL names the audit database."""
        with self._lock:
            res = self.client.query(sql.replace("{db}", self.database), parameters=parameters or {})
        return [dict(zip(res.column_names, row, strict=False)) for row in res.result_rows]

    def write_raw(self, sql: str, fmt: str, dest: BinaryIO, parameters: dict[str, Any] | None = None) -> None:
        """Stream a query's result in a ClickHouse output format (CSVWithNames, Parquet, ...) into dest."""
        with self._lock:
            stream = self.client.raw_stream(sql.replace("{db}", self.database), parameters=parameters or {}, fmt=fmt)
            for chunk in stream:
                dest.write(chunk)

    def close(self) -> None:
        with self._lock:
            self.client.close()


class AuditSink:
    """Consumer group over the decision topics, batching rows into the audit store."""

    def __init__(
        self,
        bootstrap: str,
        store: AuditStore,
        group: str = "trainmedic-audit",
        batch_max: int = 2000,
        batch_wait_s: float = 0.5,
    ) -> None:
        self.store = store
        self.batch_max = batch_max
        self.batch_wait_s = batch_wait_s
        self._consumer = Consumer(consumer_config(bootstrap, group, "trainmedic-audit"))
        self.stop_event = threading.Event()
        self.inserted: dict[str, int] = defaultdict(int)
        self.undecodable = 0

    def _rows(self, msgs: list[Message]) -> dict[str, list[list[Any]]]:
        rows: dict[str, list[list[Any]]] = defaultdict(list)
        for msg in msgs:
            topic, table, to_row, _ = TABLES[msg.topic() or ""]
            try:
                event: Event = decode(topic.event_type, msg.value() or b"")
            except DecodeError as exc:
                # Not the event it claims to be: kept as a dead letter, with the reason, instead.
                self.undecodable += 1
                log.error("audit: undecodable %s record at offset %s: %s", msg.topic(), msg.offset(), exc)
                letter = make_dead_letter(
                    "sinks.audit", msg.topic() or "", msg.partition(), msg.offset(), str(exc), msg.value()
                )
                rows["dead_letters"].append(_dead(letter))
                continue
            rows[table].append(to_row(event))
        return rows

    def _insert_with_retry(self, rows: dict[str, list[list[Any]]]) -> None:
        delay = 0.5
        while True:
            try:
                for table, table_rows in rows.items():
                    columns = next(cols for _, t, _, cols in TABLES.values() if t == table)
                    self.store.insert(table, table_rows, columns)
                    self.inserted[table] += len(table_rows)
                return
            except Exception as exc:  # any storage failure: back off and retry, offsets stay uncommitted
                if self.stop_event.is_set():
                    raise
                log.error("audit insert failed, retrying in %.1f s: %s", delay, exc)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def run(self) -> None:
        self._consumer.subscribe(list(TABLES))
        try:
            while not self.stop_event.is_set():
                batch: list[Message] = []
                deadline = time.monotonic() + self.batch_wait_s
                while len(batch) < self.batch_max and time.monotonic() < deadline:
                    msgs = self._consumer.consume(num_messages=self.batch_max - len(batch), timeout=0.1)
                    for m in msgs:
                        if (err := m.error()) is not None:
                            if err.code() != KafkaError._PARTITION_EOF:
                                log.warning("audit consumer error: %s", err)
                            continue
                        batch.append(m)
                if not batch:
                    continue
                self._insert_with_retry(self._rows(batch))
                self._consumer.commit(asynchronous=False)
        finally:
            self._consumer.close()
