"""Each audit table declared once: its columns (name, ClickHouse type, how an event fills
it), its sort key, skip indexes and retention. The sink's row mapping, the column
list of every insert and the DDL of the current layout all come from here; a test
(tests/unit/test_audit_schema.py) checks the migrated database against it.

Layout (docs/audit.md, "Layout"): every table is a ReplacingMergeTree partitioned
by month of event time, sorted by keys the real queries filter on and ending with
the event's own id (distinct events never collapse; a redelivered one, same id and
same values, does). Job, node, partition and category are non-null with '' for
"none", so they can sit in sort keys and bloom-filter indexes; log lines, evidence
and payloads are ZSTD-compressed; TTL comes from `LayoutSettings`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

from schemas.errors import ConfigError
from schemas.events import ActionResult, Incident
from schemas.topics import (
    ACTION_ATTEMPTS,
    ACTION_RESULTS,
    ACTIONS,
    ANOMALIES,
    APPROVALS,
    DEADLETTER,
    DECISIONS,
    GUARDRAIL_TRIPS,
    HEALTH_EXTERNAL,
    INCIDENTS,
    JOB_ATTEMPTS,
    MIGRATIONS,
    MODE_CHANGES,
    NODE_COMMAND_RESULTS,
    NODE_COMMANDS,
    NODE_RETURNS,
    SCHED_EVENTS,
    Topic,
)

Retention = Literal["raw", "record", "forever"]

# The windows that read each retention class, in days: TTL may never be shorter
# (checked when the sink starts, `check_settings`). Readiness scores 30 days by
# default (trainmedic readiness --since 30d) plus its 24 h expiry and the 1 h miss
# look-back; replay's default is 7 days; `audit node` promises 90 days of raw
# anomalies and a year of incidents blamed on a node. Evidence is copied into the
# incident row itself (incidents.evidence), so it lives as long as the incident.
READ_WINDOWS_DAYS: dict[Retention, dict[str, int]] = {
    "raw": {"readiness misses (sched_events)": 32, "per-node fault history (anomalies)": 90},
    "record": {"readiness": 32, "replay": 7, "per-node fault history (incidents)": 365},
}

# The settings (trainmedic.settings) these come from, named in refusals.
RAW_TTL_ENV = "TRAINMEDIC_AUDIT_RAW_TTL_DAYS"
RECORD_TTL_ENV = "TRAINMEDIC_AUDIT_RECORD_TTL_DAYS"
CLUSTER_ENV = "TRAINMEDIC_AUDIT_CLUSTER"


class AuditSchemaError(ConfigError, ValueError):
    pass


@dataclass(frozen=True)
class LayoutSettings:
    """Retention and replication of the audit tables. 0 days: never expire."""

    raw_ttl_days: int = 90  # anomalies, scheduler events, dead letters
    record_ttl_days: int = 730  # incidents, decisions, approvals, actions, results, trips, returns
    cluster: str | None = None  # ClickHouse cluster: Replicated* engines and ON CLUSTER (never run on chDB)

    def ttl_days(self, retention: Retention) -> int:
        return {"raw": self.raw_ttl_days, "record": self.record_ttl_days, "forever": 0}[retention]


def check_settings(settings: LayoutSettings) -> None:
    """Raise AuditSchemaError when a TTL is shorter than a window that reads its tables."""
    problems = []
    for retention, env in (("raw", RAW_TTL_ENV), ("record", RECORD_TTL_ENV)):
        ttl = settings.ttl_days(retention)  # type: ignore[arg-type]
        for reader, window in READ_WINDOWS_DAYS[retention].items():  # type: ignore[index]
            if ttl and ttl < window:
                problems.append(f"{env}={ttl} is shorter than the {window} days {reader} reads")
    if settings.record_ttl_days and (not settings.raw_ttl_days or settings.raw_ttl_days > settings.record_ttl_days):
        problems.append(
            f"{RAW_TTL_ENV}={settings.raw_ttl_days} keeps raw events longer than {RECORD_TTL_ENV}="
            f"{settings.record_ttl_days} keeps the incidents they explain"
        )
    if settings.cluster is not None and not settings.cluster.replace("_", "").replace("-", "").isalnum():
        problems.append(f"{CLUSTER_ENV}={settings.cluster!r}: letters, digits, - and _ only")
    if problems:
        raise AuditSchemaError("audit retention settings: " + "; ".join(problems))


def _ts(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


# Column value helpers: each takes the event and returns what the column stores.
def _a(attr: str) -> Callable[[Any], Any]:
    return lambda e: getattr(e, attr)


def _s(attr: str) -> Callable[[Any], Any]:
    """A non-null string column: None (no job, no node...) is stored as ''."""
    return lambda e: getattr(e, attr) or ""


def _t(attr: str) -> Callable[[Any], Any]:
    return lambda e: _ts(getattr(e, attr))


T64 = "DateTime64(3, 'UTC')"
LC = "LowCardinality(String)"
ZSTD = "ZSTD(3)"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    value: Callable[[Any], Any]
    default: str | None = None  # DEFAULT expression
    codec: str | None = None  # CODEC(...) body

    def ddl(self) -> str:
        out = f"{self.name} {self.type}"
        if self.default is not None:
            out += f" DEFAULT {self.default}"
        if self.codec is not None:
            out += f" CODEC({self.codec})"
        return out


# The last column of every table (added by migration 010; rows from before it are the default cluster's).
CLUSTER_COLUMN = Column("cluster", LC, _a("cluster"), default="'default'")


def key(name: str, value: Callable[[Any], Any] | None = None, low: bool = True) -> Column:
    """A non-null filter/sort column with '' for none (job ids are too many for LowCardinality)."""
    return Column(name, LC if low else "String", value or _s(name), default="''")


@dataclass(frozen=True)
class Table:
    name: str
    topic: Topic
    id_column: str
    columns: tuple[Column, ...]
    order_by: tuple[str, ...]
    indexes: tuple[str, ...]  # "name expr TYPE t GRANULARITY g"
    retention: Retention
    time_column: str = "event_time"
    # Rows per granule. The record tables are read by time first and by job, node or
    # incident through bloom filters, a few rows scattered over months: smaller
    # granules read less around each (bench/results/audit.md, `audit node`).
    granularity: int = 8192
    column_names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        # Every row says which cluster it is about (schemas.ids): clusters may share one store.
        object.__setattr__(self, "columns", (*self.columns, CLUSTER_COLUMN))
        object.__setattr__(self, "column_names", [c.name for c in self.columns])
        if self.order_by[-1] != self.id_column:
            raise AuditSchemaError(f"{self.name}: the sort key must end with the event id {self.id_column}")

    def row(self, event: Any) -> list[Any]:
        return [c.value(event) for c in self.columns]

    def engine(self, settings: LayoutSettings) -> str:
        if settings.cluster:
            # {uuid}: the path follows the table through RENAME/EXCHANGE (Atomic databases).
            return "ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}', '{replica}')"
        return "ReplacingMergeTree"

    def ttl(self, settings: LayoutSettings) -> str | None:
        days = settings.ttl_days(self.retention)
        return f"toDateTime({self.time_column}) + toIntervalDay({days})" if days else None

    def ddl(self, database: str, settings: LayoutSettings, name: str | None = None) -> str:
        """CREATE TABLE for the declared layout (under another name for a rebuild)."""
        on_cluster = f" ON CLUSTER {settings.cluster}" if settings.cluster else ""
        body = [c.ddl() for c in self.columns] + [f"INDEX {ix}" for ix in self.indexes]
        lines = [
            f"CREATE TABLE IF NOT EXISTS {database}.{name or self.name}{on_cluster} (",
            ",\n".join(f"    {b}" for b in body),
            f") ENGINE = {self.engine(settings)}",
            f"PARTITION BY toYYYYMM({self.time_column})",
            f"ORDER BY ({', '.join(self.order_by)})",
        ]
        if (ttl := self.ttl(settings)) is not None:
            lines.append(f"TTL {ttl}")
        # Whole monthly parts are dropped when they expire, instead of rewritten row by row.
        lines.append(f"SETTINGS ttl_only_drop_parts = 1, index_granularity = {self.granularity}")
        return "\n".join(lines)


def _bf(column: str) -> str:
    return f"{column}_bf {column} TYPE bloom_filter(0.01) GRANULARITY 1"


def _evidence(e: Incident) -> str:
    return orjson.dumps([ev.model_dump(mode="json") for ev in e.evidence]).decode()


def _action_latency(e: ActionResult) -> float | None:
    return round(e.verified_at - e.incident_time, 3) if e.verified_at else None


ANOMALIES_T = Table(
    "anomalies",
    ANOMALIES,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("produced_at", T64, _t("produced_at")),
        Column("detector", LC, _a("detector")),
        Column("signature", LC, _a("signature")),
        key("category"),
        Column("severity", LC, _a("severity")),
        Column("role", LC, _a("role")),
        Column("source", LC, _a("source")),
        # migration 023: who could have written it (schemas/vocab.py Provenance); NULL on older rows
        Column("provenance", "LowCardinality(Nullable(String))", _a("provenance")),
        key("job_id", low=False),
        key("node"),
        Column("rank", "Nullable(Int32)", _a("rank")),
        key("partition"),
        Column("line", "String", _a("line"), codec=ZSTD),
        Column("meaning", "String", _a("meaning"), codec=ZSTD),
    ),
    # A node's history reads by node; kernel anomalies (no job) are found by node too.
    ("node", "event_time", "event_id"),
    (_bf("job_id"),),
    "raw",
)

INCIDENTS_T = Table(
    "incidents",
    INCIDENTS,
    "incident_id",
    (
        Column("incident_id", "String", _a("incident_id")),
        Column("event_time", T64, _t("event_time")),
        Column("first_signal_time", T64, _t("first_signal_time")),
        key("job_id", low=False),
        key("partition"),
        Column("job_nodes", "Array(String)", _a("job_nodes")),
        key("category"),
        Column("severity", LC, _a("severity")),
        key("culprit_node"),
        Column("culprit_rank", "Nullable(Int32)", _a("culprit_rank")),
        Column("confidence", "Float32", _a("confidence")),
        # Kept for the rows written when attribution chose an action; the incident no longer
        # carries one (policy chooses it: the decisions table), so new rows hold ''.
        Column("recommended_action", LC, lambda e: ""),
        # The fact policy's action follows (the fault lives on the culprit's node); NULL on rows from
        # before it was recorded (migration 012), whose recommended_action says it.
        Column("isolate", "Nullable(Bool)", _a("isolate")),
        # migration 023: the strongest provenance among the deciding evidence; NULL on older rows
        Column("provenance", "LowCardinality(Nullable(String))", _a("provenance")),
        Column("explanation", "String", _a("explanation"), codec=ZSTD),
        Column("evidence", "String", _evidence, codec=ZSTD),  # JSON list of {source, signature, node, ...}
        Column("anomaly_ids", "Array(String)", _a("anomaly_ids")),
        Column("detection_latency_s", "Float64", lambda e: round(e.event_time - e.first_signal_time, 3)),
        Column("job_name", "Nullable(String)", _a("job_name")),
        Column("user", "Nullable(String)", _a("user")),
        Column("account", "Nullable(String)", _a("account")),
        Column("job_comment", "Nullable(String)", _a("job_comment")),  # migration 014
        # migration 018: a fleet incident's shared component and its nodes (streams/fleet.py)
        Column("domain", "Nullable(String)", _a("domain")),
        Column("domain_nodes", "Array(String)", _a("domain_nodes")),
        Column("domain_failed_nodes", "Array(String)", _a("domain_failed_nodes")),  # migration 022
        # migration 024: reactive (a fault that happened) or predicted (a pre-failure verdict)
        Column("kind", LC, _a("kind"), default="'reactive'"),
    ),
    ("event_time", "incident_id"),
    (_bf("job_id"), _bf("culprit_node"), _bf("incident_id")),
    "record",
    granularity=1024,
)

DECISIONS_T = Table(
    "decisions",
    DECISIONS,
    "decision_id",
    (
        Column("decision_id", "String", _a("decision_id")),
        Column("event_time", T64, _t("event_time")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("partition"),
        key("category"),
        key("culprit_node"),
        Column("action", LC, _a("action")),
        Column("mode", LC, _a("mode")),
        Column("kind", LC, lambda e: "action" if e.executed else "recommendation"),
        Column("rule", "String", _a("rule")),
        Column("reason", "String", _a("reason"), codec=ZSTD),
        Column("first_signal_time", T64, _t("first_signal_time")),
        Column("incident_time", T64, _t("incident_time")),
    ),
    ("event_time", "decision_id"),
    (_bf("incident_id"), _bf("job_id"), _bf("culprit_node")),
    "record",
    granularity=1024,
)

ACTIONS_T = Table(
    "actions",
    ACTIONS,
    "action_id",
    (
        Column("action_id", "String", _a("action_id")),
        Column("event_time", T64, _t("event_time")),
        Column("decision_id", "String", _a("decision_id")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("node"),
        key("partition"),
        Column("action", LC, _a("action")),
        Column("reason", "String", _a("reason"), codec=ZSTD),
        Column("requested_by", "String", _a("requested_by")),
        Column("incident_time", T64, _t("incident_time")),
    ),
    ("event_time", "action_id"),
    (_bf("incident_id"), _bf("job_id"), _bf("node")),
    "record",
    granularity=1024,
)

ACTION_RESULTS_T = Table(
    "action_results",
    ACTION_RESULTS,
    "action_id",
    (
        Column("action_id", "String", _a("action_id")),
        Column("event_time", T64, _t("event_time")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("node"),
        Column("action", LC, _a("action")),
        Column("status", LC, _a("status")),
        Column("backend", LC, _a("backend")),
        Column("steps", "Array(String)", _a("steps"), codec=ZSTD),
        Column("error", "Nullable(String)", _a("error"), codec=ZSTD),
        Column("started_at", T64, _t("started_at")),
        Column("verified_at", f"Nullable({T64})", _t("verified_at")),
        Column("incident_time", T64, _t("incident_time")),
        Column("first_signal_time", T64, _t("first_signal_time")),
        Column("action_latency_s", "Nullable(Float64)", _action_latency),  # incident published -> verified
    ),
    ("event_time", "action_id"),
    (_bf("incident_id"), _bf("job_id"), _bf("node")),
    "record",
    granularity=1024,
)

APPROVALS_T = Table(
    "approvals",
    APPROVALS,
    "approval_id",
    (
        Column("approval_id", "String", _a("approval_id")),
        Column("event_time", T64, _t("event_time")),
        Column("decision_id", "String", _a("decision_id")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("partition"),
        key("category"),
        Column("action", LC, _a("action")),
        Column("verdict", LC, _a("verdict")),
        Column("reason", "LowCardinality(Nullable(String))", _a("reason")),  # a fixed list (RejectReason)
        Column("comment", "String", _a("comment"), codec=ZSTD),
        Column("operator", "String", _a("operator")),
    ),
    ("event_time", "approval_id"),
    (_bf("incident_id"), _bf("job_id")),
    "record",
    granularity=1024,
)

MODE_CHANGES_T = Table(
    "mode_changes",
    MODE_CHANGES,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        # NULL keeps its meaning here: "every partition" / "every category", not one named ''.
        Column("partition", "Nullable(String)", _a("partition")),
        Column("category", "LowCardinality(Nullable(String))", _a("category")),
        Column("old_mode", "LowCardinality(Nullable(String))", _a("old_mode")),
        Column("new_mode", LC, _a("new_mode")),
        Column("operator", "String", _a("operator")),
        Column("reason", "String", _a("reason")),
        Column("forced", "Bool", _a("forced")),
        Column("outcome", LC, _a("outcome"), default="'applied'"),
        Column("readiness", "String", _a("readiness"), default="''"),
    ),
    ("event_time", "event_id"),
    (),
    "forever",  # the durable record of autonomy: never expires
)

SCHED_EVENTS_T = Table(
    "sched_events",
    SCHED_EVENTS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("kind", LC, _a("kind")),  # 'job' or 'node'
        key("job_id", low=False),
        key("node"),
        Column("state", LC, _a("state")),
        Column("previous_state", "LowCardinality(Nullable(String))", _a("previous_state")),
        Column("nodes", "Array(String)", _a("nodes"), codec=ZSTD),
        key("partition"),
        Column("reason", "Nullable(String)", _a("reason"), codec=ZSTD),
        Column("flags", "Array(String)", _a("flags")),
        Column("job_name", "Nullable(String)", _a("job_name")),
        Column("user", "Nullable(String)", _a("user")),
        Column("account", "Nullable(String)", _a("account")),
        # Who set a node's reason and when (Slurm's), and the MAINT reservation holding it:
        # how an operator tells another remediator's drain, or planned maintenance, from ours.
        Column("reason_user", "LowCardinality(Nullable(String))", _a("reason_user")),
        Column("reason_time", f"Nullable({T64})", _t("reason_time")),
        Column("reservation", "LowCardinality(Nullable(String))", _a("reservation")),
    ),
    # Readiness reads node events of a time window; a node's or job's events via the bloom filters.
    ("kind", "event_time", "event_id"),
    (_bf("node"), _bf("job_id")),
    "raw",
)

NODE_RETURNS_T = Table(
    "node_returns",
    NODE_RETURNS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        key("node"),
        Column("incident_id", "Nullable(String)", _a("incident_id")),
        Column("drain_reason", "String", _a("drain_reason")),
        Column("operator", "String", _a("operator")),
        Column("comment", "String", _a("comment")),
        # migration 017: refused returns, and the health check before each
        Column("outcome", LC, _a("outcome"), default="'resumed'"),
        Column("check", "Nullable(String)", _a("check")),
        Column("check_passed", "Nullable(Bool)", _a("check_passed")),
        Column("detail", "String", _a("detail"), default="''"),
    ),
    ("node", "event_time", "event_id"),
    (),
    "record",
)

GUARDRAIL_TRIPS_T = Table(
    "guardrail_trips",
    GUARDRAIL_TRIPS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("guardrail", LC, _a("guardrail")),
        Column("action_id", "String", _a("action_id")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("node"),
        key("partition"),
        Column("action", LC, _a("action")),
        Column("detail", "String", _a("detail"), codec=ZSTD),
    ),
    ("event_time", "event_id"),
    (_bf("incident_id"), _bf("job_id"), _bf("node")),
    "record",
    granularity=1024,
)

ACTION_ATTEMPTS_T = Table(
    "action_attempts",
    ACTION_ATTEMPTS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("action_id", "String", _a("action_id")),
        Column("incident_id", "String", _a("incident_id")),
        key("job_id", low=False),
        key("node"),
        key("partition"),
        Column("action", LC, _a("action")),
        Column("call", LC, _a("call")),  # the scheduler call about to be made: drain, requeue, cancel, hold
        Column("executor", LC, _a("executor")),
    ),
    ("event_time", "event_id"),
    (_bf("action_id"), _bf("incident_id"), _bf("job_id"), _bf("node")),
    "record",
    granularity=1024,
)

DEAD_LETTERS_T = Table(
    "dead_letters",
    DEADLETTER,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("component", LC, _a("component")),
        Column("original_topic", LC, _a("original_topic")),
        Column("original_partition", "Nullable(Int32)", _a("original_partition")),
        Column("original_offset", "Nullable(Int64)", _a("original_offset")),
        Column("reason", "String", _a("reason"), codec=ZSTD),
        Column("payload_b64", "String", _a("payload_b64"), codec=ZSTD),
    ),
    ("event_time", "event_id"),
    (),
    "raw",
)

HEALTH_EVENTS_T = Table(
    "health_events",
    HEALTH_EXTERNAL,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("produced_at", T64, _t("produced_at")),
        Column("origin", LC, _a("origin")),  # nvsentinel, nvrx
        key("node"),
        Column("check_name", LC, _a("check_name")),
        Column("component", "LowCardinality(Nullable(String))", _a("component")),
        Column("component_ids", "Array(String)", _a("component_ids")),
        Column("error_codes", "Array(String)", _a("error_codes")),
        Column("is_fatal", "Bool", _a("is_fatal")),
        Column("is_healthy", "Bool", _a("is_healthy")),
        Column("recommended_action", "LowCardinality(Nullable(String))", _a("recommended_action")),
        Column("message", "String", _a("message"), codec=ZSTD),
        key("job_id", low=False),
        Column("rank", "Nullable(Int32)", _a("rank")),
    ),
    # As anomalies: a node's history reads by node; an NVRx report of a job by its bloom filter.
    ("node", "event_time", "event_id"),
    (_bf("job_id"),),
    "raw",
)

JOB_ATTEMPTS_T = Table(
    "job_attempts",
    JOB_ATTEMPTS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("lineage_id", "String", _a("lineage_id")),
        key("job_id", low=False),
        Column("job_name", "Nullable(String)", _a("job_name")),
        Column("user", "Nullable(String)", _a("user")),
        Column("first_seen", T64, _t("first_seen")),
        Column("attempt", "UInt32", _a("attempt")),
        Column("restart_count", "UInt32", _a("restart_count")),
        Column("started_at", T64, _t("started_at")),
        Column("ended_at", f"Nullable({T64})", _t("ended_at")),
        Column("end_reason", "Nullable(String)", _a("end_reason")),
        Column("cause_incident_id", "Nullable(String)", _a("cause_incident_id")),
        Column("cause_category", "LowCardinality(Nullable(String))", _a("cause_category")),
        Column("cause_node", "Nullable(String)", _a("cause_node")),
        Column("excluded_nodes", "Array(String)", _a("excluded_nodes")),
        Column("start_step", "Nullable(Int64)", _a("start_step")),
        Column("start_checkpoint", "Nullable(Int64)", _a("start_checkpoint")),
        Column("max_step", "Nullable(Int64)", _a("max_step")),
        Column("new_checkpoint", "Bool", _a("new_checkpoint")),
        Column("progressed", "Nullable(Bool)", _a("progressed")),
    ),
    # A job's lineage reads by job id (bloom filter) over its time; each record is one state of
    # one attempt: the latest per (lineage_id, attempt) is the attempt (sinks/audit_queries.py).
    ("event_time", "event_id"),
    (_bf("job_id"), _bf("lineage_id")),
    "record",
    granularity=1024,
)


def _or(attr: str, absent: Any) -> Callable[[Any], Any]:
    """A column two event types fill: `absent` for the one without the field."""
    return lambda e: getattr(e, attr, absent)


def _t_or_null(attr: str) -> Callable[[Any], Any]:
    return lambda e: _ts(getattr(e, attr, None))


# One table for the executor's commands to the node agents and the agents' results: a command's
# row says `issued`, each result its status, both keyed by the command id and carrying the node,
# the incident and the action. The latest row of a node's commands says where its reset stands
# (`status`, `finished_at`: NULL until a result arrives).
NODE_COMMANDS_T = Table(
    "node_commands",
    NODE_COMMANDS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("command_id", "String", _a("command_id")),
        key("node"),
        Column("kind", LC, _a("kind")),
        Column("gpu", "Nullable(Int32)", _a("gpu")),
        Column("action_id", "String", _a("action_id")),
        Column("incident_id", "String", _a("incident_id")),
        Column("status", LC, _or("status", "issued")),
        Column("reason", "String", _or("reason", ""), codec=ZSTD),
        Column("requested_by", "String", _or("requested_by", "")),
        Column("issued_at", f"Nullable({T64})", _t_or_null("issued_at")),
        Column("detail", "String", _or("detail", ""), codec=ZSTD),
        Column("agent", LC, _or("agent", "")),
        Column("started_at", f"Nullable({T64})", _t_or_null("started_at")),
        Column("finished_at", f"Nullable({T64})", _t_or_null("finished_at")),
    ),
    # Read by node (where does its reset stand), by incident and by command through bloom filters.
    ("node", "event_time", "event_id"),
    (_bf("incident_id"), _bf("command_id")),
    "record",
    granularity=1024,
)

# migration 024: checkpoint-aligned migrations (streams/migration.py), one row per state; the latest
# row of a migration is where it stands (waiting: the node drained, the job not yet requeued).
MIGRATIONS_T = Table(
    "migrations",
    MIGRATIONS,
    "event_id",
    (
        Column("event_id", "String", _a("event_id")),
        Column("event_time", T64, _t("event_time")),
        Column("migration_id", "String", _a("migration_id")),
        Column("incident_id", "String", _a("incident_id")),
        Column("decision_id", "String", _a("decision_id")),
        key("job_id", low=False),
        key("node"),
        Column("gpu", "Nullable(Int32)", _a("gpu")),
        Column("rule", LC, _a("rule")),
        Column("state", LC, _a("state")),
        Column("decided_at", T64, _t("decided_at")),
        Column("deadline", T64, _t("deadline")),
        Column("checkpoint_before", "Nullable(Int64)", _a("checkpoint_before")),
        Column("checkpoint_step", "Nullable(Int64)", _a("checkpoint_step")),
        Column("requested_by", "String", _a("requested_by")),
        Column("detail", "String", _a("detail"), codec=ZSTD),
    ),
    ("event_time", "event_id"),
    (_bf("job_id"), _bf("node"), _bf("migration_id")),
    "record",
    granularity=1024,
)

# Topic name -> table, for every topic the sink audits.
DECLARED: dict[str, Table] = {
    t.topic.name: t
    for t in (
        ANOMALIES_T,
        INCIDENTS_T,
        DECISIONS_T,
        ACTIONS_T,
        ACTION_RESULTS_T,
        ACTION_ATTEMPTS_T,
        APPROVALS_T,
        MODE_CHANGES_T,
        SCHED_EVENTS_T,
        NODE_RETURNS_T,
        GUARDRAIL_TRIPS_T,
        DEAD_LETTERS_T,
        HEALTH_EVENTS_T,
        JOB_ATTEMPTS_T,
        NODE_COMMANDS_T,
        MIGRATIONS_T,
    )
}
# The agents' results land in the commands' table (the `issued` row's columns they lack stay empty).
DECLARED[NODE_COMMAND_RESULTS.name] = NODE_COMMANDS_T
BY_NAME: dict[str, Table] = {t.name: t for t in DECLARED.values()}
