"""The audit sink: every anomaly, incident, decision, action, result and dead
letter lands in ClickHouse (chDB embedded, or a server by URL).

Inserts are batched; offsets are committed only after the insert succeeded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import clickhouse_connect
import orjson
from clickhouse_connect.driver.client import Client
from confluent_kafka import Consumer, KafkaError, Message

from schemas.clients import consumer_config
from schemas.codec import DecodeError, decode
from schemas.events import Action, ActionResult, Anomaly, DeadLetter, Decision, Event, Incident
from schemas.topics import ACTION_RESULTS, ACTIONS, ANOMALIES, DEADLETTER, DECISIONS, INCIDENTS, Topic

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


class AuditStore:
    """A ClickHouse client (chDB or server) plus the audit schema. Thread-safe."""

    def __init__(self, url: str, database: str = "trainmedic") -> None:
        if not database.replace("_", "").isalnum():
            raise AuditStoreError(f"database name {database!r}: letters, digits and _ only")
        self.url = url
        self.database = database
        try:
            self.client: Client = clickhouse_connect.get_client(dsn=url)
        except Exception as exc:
            raise AuditStoreError(f"cannot open ClickHouse at {url}: {exc}") from None
        self._lock = threading.Lock()

    @classmethod
    def embedded(cls, data_dir: Path, database: str = "trainmedic") -> AuditStore:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"chdb://{data_dir.resolve()}", database)

    def migrate(self) -> None:
        for path in sorted(DDL_DIR.glob("*.sql")):
            for stmt in path.read_text().replace("{db}", self.database).split(";"):
                body = "\n".join(line for line in stmt.splitlines() if not line.strip().startswith("--")).strip()
                if body:
                    with self._lock:
                        self.client.command(body)

    def insert(self, table: str, rows: Sequence[list[Any]], columns: list[str]) -> None:
        with self._lock:
            self.client.insert(f"{self.database}.{table}", rows, column_names=columns)

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run a query; `{db}` in the SQL names the audit database."""
        with self._lock:
            res = self.client.query(sql.replace("{db}", self.database), parameters=parameters or {})
        return [dict(zip(res.column_names, row, strict=False)) for row in res.result_rows]

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
                # The streams dead-letter bad input; a bad record here is a bug: log it, keep going.
                self.undecodable += 1
                log.error("audit: skipped undecodable %s record at offset %s: %s", msg.topic(), msg.offset(), exc)
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
