"""Questions asked of the audit trail, answered as plain dicts.

The `trainmedic audit` CLI formats these; the console can serve them as they
are. The operator queries (incidents, a job, a node, latency) do not read the
views over whole tables: they build the same shapes from bounded reads of the
tables, filtered on their partition and sort keys or bloom-filter indexes
(sinks/audit_schema.py), so a query for one job, one node or the last day reads
that, not the whole history. Every read deduplicates with FINAL (docs/audit.md,
"Deduplication", has the measurement against LIMIT 1 BY), so counts are exact
under redelivery. Several clusters may share one audit database: every query that reads
more than one job or node takes `cluster` (None: all of them) and filters each table it reads
on its `cluster` column (migration 010), so a job id or node name of another cluster never
joins in. Times come back as
timezone-aware UTC datetimes; `jsonable` turns a result into JSON-ready data.
"""

from __future__ import annotations

import math
import os
import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, cast

from schemas.errors import ConfigError
from schemas.vocab import CATEGORIES
from sinks.audit import TABLES, AuditStore

ExportFormat = Literal["csv", "parquet"]
EXPORT_FORMATS: dict[str, str] = {"csv": "CSVWithNames", "parquet": "Parquet"}

# Every table and view that can be exported, with the column --since filters on (None: no time column).
BASE_TABLES: dict[str, str] = {table: "event_time" for _, table, _, _ in TABLES.values()} | {
    "schema_migrations": "applied_at"
}
VIEWS: dict[str, str | None] = {
    "incident_summary": "detected_at",
    "incidents_daily": "day",
    "latency_percentiles": None,
    "repeat_offenders": None,
    "job_restarts": None,
    "gpu_hours_saved": "detected_at",
    "timeline": "time",
    "incident_goodput": "detected_at",
    "job_goodput": None,
}
RELATIONS: dict[str, str | None] = {**BASE_TABLES, **VIEWS}

# The assumptions behind gpu_hours_saved (sinks/ddl/003_views.sql, docs/audit.md).
GPU_HOURS_ASSUMPTIONS = {
    "gpus_per_node": 8,
    "nccl_watchdog_s": 600,
    "manual_response_s": 1800,
    "formula": "gpus * (baseline_s - ours_s) / 3600; gpus = job nodes * 8; baseline_s = 600 + 1800; "
    "ours_s = first fault signal -> action verified",
}

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class AuditQueryError(ConfigError, RuntimeError):
    pass


def parse_since(text: str) -> timedelta:
    """'30m', '24h', '7d' (also s and w) -> timedelta. ValueError says what is expected."""
    m = _DURATION.fullmatch(text.strip().lower())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration: expected a positive number and a unit, like 30m, 24h or 7d")
    try:
        return timedelta(seconds=int(m.group(1)) * _UNIT_S[m.group(2)])
    except OverflowError:
        raise ValueError(f"{text!r} is too long a duration (at most {timedelta.max.days} days)") from None


def _utc(value: Any) -> Any:
    # clickhouse-connect returns DateTime64(3, 'UTC') as naive datetimes holding UTC.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    # A quantile of no rows is NaN, which JSON cannot carry: "no value" is None.
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _rows(store: AuditStore, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [{k: _utc(v) for k, v in row.items()} for row in store.query(sql, params)]


def _cutoff(since: timedelta | None, now: datetime | None = None) -> float | None:
    return None if since is None else ((now or datetime.now(tz=UTC)) - since).timestamp()


def jsonable(value: Any) -> Any:
    """A query result as JSON-ready data: datetimes as ISO 8601 UTC strings."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return _utc(value).isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value


def check_schema(store: AuditStore) -> None:
    """Raise AuditQueryError unless the database exists and has every view these queries read."""
    found = _rows(store, "SELECT name FROM system.databases WHERE name = {d:String}", {"d": store.database})
    if not found:
        others = [
            r["name"]
            for r in _rows(store, "SELECT name FROM system.databases ORDER BY name")
            if r["name"] not in ("system", "information_schema", "INFORMATION_SCHEMA", "default")
        ]
        raise AuditQueryError(
            f"no database {store.database!r} in {store.where}: nothing was audited there yet, "
            f"or --database names another one (found: {', '.join(others) or 'none'})"
        )
    names = {
        r["name"]
        for r in _rows(store, "SELECT name FROM system.tables WHERE database = {d:String}", {"d": store.database})
    }
    if missing := sorted(set(RELATIONS) - names):
        raise AuditQueryError(
            f"the audit schema of {store.database!r} in {store.where} predates this trainmedic "
            f"(missing {', '.join(missing)}): run `trainmedic audit db migrate` with the same options"
        )


_INCIDENT_COLUMNS = """incident_id, kind, detected_at, first_signal_time, job_id, partition, job_nodes, category, severity,
    culprit_node, confidence, decision_kind, decision_action, decision_mode, verdict,
    actions, actions_done, actions_failed, guardrail_trips, verified_at,
    detection_latency_s, action_latency_s, recovery_s"""

# Clock skew allowed between an incident and the events that follow it (decision,
# verdict, action, result): they are never earlier than the incident by more.
CHILD_SKEW_S = 3600


def summary_sql(where: str, child_where: str = "1") -> str:
    """incident_summary (sinks/ddl/007_layout.sql) for the incidents matching `where` only,
    less the incident's `recommended_action`: the action is policy's, `decision_action`.

    `where` filters incidents (on event_time, job_id, culprit_node: the sort key and
    bloom filters); the decisions, verdicts, results and trips are read for those
    incidents only (incident_id bloom filters), further bounded by `child_where`
    (e.g. event_time, the sort key's first column), instead of aggregated whole.
    """
    ids = f"SELECT incident_id FROM {{db}}.incidents FINAL WHERE {where}"
    child = f"({child_where}) AND incident_id IN ({ids})"
    return f"""SELECT
    i.incident_id AS incident_id, i.kind AS kind, i.event_time AS detected_at, i.first_signal_time AS first_signal_time,
    nullIf(i.job_id, '') AS job_id, nullIf(i.partition, '') AS partition, i.job_nodes AS job_nodes,
    toUInt32(length(i.job_nodes)) AS job_node_count, i.category AS category, i.severity AS severity,
    nullIf(i.culprit_node, '') AS culprit_node, i.confidence AS confidence,
    i.detection_latency_s AS detection_latency_s,
    d.decision_kind AS decision_kind, d.decision_action AS decision_action, d.decision_mode AS decision_mode,
    ap.verdict AS verdict, ap.verdict_at AS verdict_at, ap.operator AS operator,
    r.actions AS actions, r.actions_done AS actions_done, r.actions_failed AS actions_failed,
    r.verified_at AS verified_at, r.action_latency_s AS action_latency_s,
    if(r.verified_at IS NULL, NULL,
       (toUnixTimestamp64Milli(assumeNotNull(r.verified_at)) - toUnixTimestamp64Milli(i.first_signal_time)) / 1000.0
    ) AS recovery_s,
    g.guardrail_trips AS guardrail_trips
FROM (SELECT * FROM {{db}}.incidents FINAL WHERE {where}) AS i
LEFT JOIN (
    SELECT incident_id, argMax(kind, event_time) AS decision_kind, argMax(action, event_time) AS decision_action,
        argMax(mode, event_time) AS decision_mode
    FROM {{db}}.decisions FINAL WHERE {child} GROUP BY incident_id
) AS d ON d.incident_id = i.incident_id
LEFT JOIN (
    SELECT incident_id, argMax(verdict, event_time) AS verdict, max(event_time) AS verdict_at,
        argMax(operator, event_time) AS operator
    FROM {{db}}.approvals FINAL WHERE {child} GROUP BY incident_id
) AS ap ON ap.incident_id = i.incident_id
LEFT JOIN (
    SELECT incident_id, count() AS actions, countIf(status = 'done') AS actions_done,
        countIf(status = 'failed') AS actions_failed, minIf(verified_at, status = 'done') AS verified_at,
        minIf(action_latency_s, status = 'done') AS action_latency_s
    FROM {{db}}.action_results FINAL WHERE {child} GROUP BY incident_id
) AS r ON r.incident_id = i.incident_id
LEFT JOIN (
    SELECT incident_id, count() AS guardrail_trips FROM {{db}}.guardrail_trips FINAL WHERE {child} GROUP BY incident_id
) AS g ON g.incident_id = i.incident_id"""


SINCE = "toDateTime64({since:Float64}, 3, 'UTC')"
# Every audit table's last column (sinks/audit_schema.py CLUSTER_COLUMN): the cluster a row is about.
CLUSTER = "cluster = {cluster:String}"


def _in_cluster(where: str, cluster: str | None, params: dict[str, Any]) -> str:
    """`where`, and the rows of `cluster` only when one is given (its value bound as a parameter)."""
    if cluster is None:
        return where
    params["cluster"] = cluster
    return f"({where}) AND {CLUSTER}"


CHILD_SINCE = f"event_time >= toDateTime64({{since:Float64}} - {CHILD_SKEW_S}, 3, 'UTC')"


def incidents(
    store: AuditStore,
    since: timedelta | None = None,
    category: str | None = None,
    limit: int = 1000,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """Incidents, newest first, with their decision, verdict and outcome."""
    if category is not None and category not in CATEGORIES:
        raise AuditQueryError(f"category {category!r}: expected one of {', '.join(CATEGORIES)}")
    where, child = ["1"], "1"
    params: dict[str, Any] = {"limit": limit}
    if (cut := _cutoff(since)) is not None:
        where.append(f"event_time >= {SINCE}")
        child = CHILD_SINCE
        params["since"] = cut
    if category is not None:
        where.append("category = {category:String}")
        params["category"] = category
    sql = summary_sql(_in_cluster(" AND ".join(where), cluster, params), _in_cluster(child, cluster, params))
    return _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM ({sql}) ORDER BY detected_at DESC, incident_id LIMIT {{limit:UInt32}}",
        params,
    )


def incidents_per_day(store: AuditStore, since: timedelta | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {}
    where = "1"
    if (cut := _cutoff(since)) is not None:
        where = "day >= toDate(toDateTime64({since:Float64}, 3, 'UTC'))"
        params["since"] = cut
    return _rows(store, f"SELECT * FROM {{db}}.incidents_daily WHERE {where} ORDER BY day, category", params)


TIMELINE_COLUMNS = (
    "time",
    "kind",
    "stage",
    "id",
    "incident_id",
    "job_id",
    "node",
    "partition",
    "category",
    "summary",
    "detail",
)


def timeline_sql(wheres: dict[str, str], incident_where: str) -> str:
    """The `timeline` view's rows for the events each kind's `wheres` entry selects.

    Kinds: anomaly, incident, decision, approval, guardrail_trip, action,
    action_result (a kind left out is not read). Anomalies get the incident that
    lists them, looked up among the incidents `incident_where` selects.
    """
    parts = []
    m = (
        "SELECT anomaly_id, any(incident_id) AS m_incident, any(job_id) AS m_job FROM {db}.incidents FINAL "
        f"ARRAY JOIN anomaly_ids AS anomaly_id WHERE {incident_where} GROUP BY anomaly_id"
    )
    if w := wheres.get("anomaly"):
        parts.append(f"""SELECT a.event_time, 'anomaly', toUInt8(1), a.event_id,
    m.m_incident, nullIf(if(ifNull(a.job_id, '') = '', m.m_job, a.job_id), ''),
    nullIf(a.node, ''), nullIf(a.partition, ''), toString(a.category),
    concat(a.signature, ' (', a.role, ', ', a.severity, ')', if(a.node = '', '', concat(' on ', a.node)),
        if(a.rank IS NULL, '', concat(' rank ', toString(assumeNotNull(a.rank))))),
    a.line
FROM (SELECT * FROM {{db}}.anomalies FINAL WHERE {w}) AS a
LEFT JOIN ({m}) AS m ON m.anomaly_id = a.event_id""")
    if w := wheres.get("incident"):
        parts.append(f"""SELECT event_time, 'incident', toUInt8(2), incident_id, incident_id, nullIf(job_id, ''),
    nullIf(culprit_node, ''), nullIf(partition, ''), toString(category),
    concat(category, ' ', severity, ', culprit ', if(culprit_node = '', '?', culprit_node),
        ', confidence ', toString(round(confidence, 2)), ', detection ', toString(detection_latency_s), ' s'),
    explanation
FROM {{db}}.incidents FINAL WHERE {w}""")
    if w := wheres.get("decision"):
        parts.append(f"""SELECT event_time, 'decision', toUInt8(3), decision_id, incident_id, nullIf(job_id, ''),
    nullIf(culprit_node, ''), nullIf(partition, ''), toString(category),
    concat(kind, ': ', action, ' (mode ', mode, ', rule ', rule, ')'), reason
FROM {{db}}.decisions FINAL WHERE {w}""")
    if w := wheres.get("approval"):
        parts.append(f"""SELECT ap.event_time, 'approval', toUInt8(4), ap.approval_id, ap.incident_id, nullIf(ap.job_id, ''),
    nullIf(dn.culprit_node, ''), nullIf(ap.partition, ''), toString(ap.category),
    concat(ap.verdict, ' ', ap.action, ' by ', ap.operator,
        if(ap.reason IS NULL, '', concat(' (', assumeNotNull(ap.reason), ')'))),
    ap.comment
FROM (SELECT * FROM {{db}}.approvals FINAL WHERE {w}) AS ap
LEFT JOIN (
    SELECT decision_id, any(culprit_node) AS culprit_node FROM {{db}}.decisions FINAL
    WHERE incident_id IN (SELECT incident_id FROM {{db}}.approvals FINAL WHERE {w}) GROUP BY decision_id
) AS dn ON dn.decision_id = ap.decision_id""")
    if w := wheres.get("guardrail_trip"):
        parts.append(f"""SELECT event_time, 'guardrail_trip', toUInt8(5), event_id, incident_id, nullIf(job_id, ''),
    nullIf(node, ''), nullIf(partition, ''), '',
    concat('guardrail ', guardrail, ' stopped ', action, if(node = '', '', concat(' ', node))), detail
FROM {{db}}.guardrail_trips FINAL WHERE {w}""")
    if w := wheres.get("action"):
        parts.append(f"""SELECT event_time, 'action', toUInt8(6), action_id, incident_id, nullIf(job_id, ''),
    nullIf(node, ''), nullIf(partition, ''), '',
    concat(action, if(node = '', '', concat(' ', node)), ' requested by ', requested_by), reason
FROM {{db}}.actions FINAL WHERE {w}""")
    if w := wheres.get("action_result"):
        parts.append(f"""SELECT event_time, 'action_result', toUInt8(7), action_id, incident_id, nullIf(job_id, ''),
    nullIf(node, ''), NULL, '',
    concat(status, ': ', action, if(action_latency_s IS NULL, '',
        concat(', action latency ', toString(assumeNotNull(action_latency_s)), ' s'))),
    concat(arrayStringConcat(steps, '; '), if(error IS NULL, '', concat(' error: ', assumeNotNull(error))))
FROM {{db}}.action_results FINAL WHERE {w}""")
    # UNION ALL takes its column names from the first SELECT, which may be any kind: every part names them.
    # Named t_* inside: an alias equal to a column (node) would shadow it in the part's own summary.
    body = "\nUNION ALL\n".join(_named(p) for p in parts)
    return f"SELECT {', '.join(f't_{c} AS {c}' for c in TIMELINE_COLUMNS)} FROM ({body})"


def _named(part: str) -> str:
    """`SELECT a, b FROM ...` -> `SELECT a AS time, b AS kind FROM ...` (top-level commas only)."""
    head, sep, rest = part.partition("\nFROM ")
    exprs: list[str] = []
    cur: list[str] = []
    depth, quote = 0, False
    for ch in head.removeprefix("SELECT "):
        if ch == "'":
            quote = not quote
        elif not quote and ch in "([":
            depth += 1
        elif not quote and ch in ")]":
            depth -= 1
        if ch == "," and depth == 0 and not quote:
            exprs.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    exprs.append("".join(cur).strip())
    assert len(exprs) == len(TIMELINE_COLUMNS), part
    return "SELECT " + ", ".join(f"{e} AS t_{c}" for e, c in zip(exprs, TIMELINE_COLUMNS, strict=True)) + sep + rest


def job_timeline(store: AuditStore, job_id: str, cluster: str | None = None) -> dict[str, Any]:
    """Everything that happened to a job: its incidents, and one list of events in order.

    Each timeline item has a `kind`: anomaly, incident, decision, approval,
    guardrail_trip, action, action_result. Ties in time keep pipeline order.
    """
    params: dict[str, Any] = {"j": job_id}
    job = _in_cluster("job_id = {j:String}", cluster, params)
    # Kernel anomalies carry no job: those its incidents list, found by node (the sort key's first column).
    # ifNull: the same query serves a table still in the old layout (NULL for no job) mid-migration.
    kernel = _in_cluster(
        f"ifNull(job_id, '') = '' AND node IN (SELECT arrayJoin(job_nodes) FROM {{db}}.incidents FINAL WHERE {job}) "
        f"AND event_id IN (SELECT arrayJoin(anomaly_ids) FROM {{db}}.incidents FINAL WHERE {job})",
        cluster,
        params,
    )
    kinds = ("incident", "decision", "approval", "guardrail_trip", "action", "action_result")
    # Two reads, not one with OR: each uses its own index (bloom filter on job, sort key on node).
    own = timeline_sql({"anomaly": job, **dict.fromkeys(kinds, job)}, job)
    sql = f"{own}\nUNION ALL\n{timeline_sql({'anomaly': kernel}, job)}"
    timeline = _rows(store, f"SELECT * FROM ({sql}) ORDER BY time, stage, id", params)
    incs = _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM ({summary_sql(job, job)}) ORDER BY detected_at",
        params,
    )
    restarts = _rows(
        store,
        "SELECT countIf(status = 'done' AND action IN ('requeue', 'drain_and_requeue')) AS restarts "
        f"FROM {{db}}.action_results FINAL WHERE {job}",
        params,
    )
    return {
        "job_id": job_id,
        "incidents": incs,
        "restarts": restarts[0]["restarts"] if restarts else 0,
        "attempts": job_attempts(store, job_id, cluster),
        "migrations": job_migrations(store, job_id, cluster),
        "timeline": timeline,
    }


def job_attempts(store: AuditStore, job_id: str, cluster: str | None = None) -> list[dict[str, Any]]:
    """The job's attempts (streams/lineage.py), lineage by lineage, each as its latest record says."""
    params: dict[str, Any] = {"j": job_id}
    job = _in_cluster("job_id = {j:String}", cluster, params)
    return _rows(
        store,
        "SELECT lineage_id, first_seen, argMax(job_name, event_time) AS job_name, argMax(user, event_time) AS user, "
        "attempt, argMax(restart_count, event_time) AS restart_count, min(started_at) AS started_at, "
        "argMax(ended_at, event_time) AS ended_at, argMax(end_reason, event_time) AS end_reason, "
        "argMax(cause_incident_id, event_time) AS cause_incident_id, "
        "argMax(cause_category, event_time) AS cause_category, argMax(cause_node, event_time) AS cause_node, "
        "argMax(excluded_nodes, event_time) AS excluded_nodes, argMax(start_step, event_time) AS start_step, "
        "argMax(start_checkpoint, event_time) AS start_checkpoint, argMax(max_step, event_time) AS max_step, "
        "argMax(new_checkpoint, event_time) AS new_checkpoint, argMax(progressed, event_time) AS progressed "
        f"FROM {{db}}.job_attempts FINAL WHERE {job} "
        "GROUP BY lineage_id, first_seen, attempt ORDER BY first_seen, attempt",
        params,
    )


def job_migrations(store: AuditStore, job_id: str, cluster: str | None = None) -> list[dict[str, Any]]:
    """The job's checkpoint-aligned migrations (streams/migration.py), each as its latest row says:
    `state` waiting is a pending one (the node drained, the job not yet requeued)."""
    params: dict[str, Any] = {"j": job_id}
    job = _in_cluster("job_id = {j:String}", cluster, params)
    return _rows(
        store,
        "SELECT migration_id, any(incident_id) AS incident_id, any(decision_id) AS decision_id, any(node) AS node, "
        "any(gpu) AS gpu, any(rule) AS rule, argMax(state, event_time) AS state, min(decided_at) AS decided_at, "
        "any(deadline) AS deadline, any(checkpoint_before) AS checkpoint_before, "
        "argMax(checkpoint_step, event_time) AS checkpoint_step, argMax(requested_by, event_time) AS requested_by, "
        "argMax(detail, event_time) AS detail, max(event_time) AS updated_at "
        f"FROM {{db}}.migrations FINAL WHERE {job} GROUP BY migration_id ORDER BY decided_at",
        params,
    )


def node_history(store: AuditStore, node: str, limit: int = 1000, cluster: str | None = None) -> dict[str, Any]:
    """A node's record: incidents it was blamed for, actions on it, the anomalies seen on it."""
    params: dict[str, Any] = {"n": node, "limit": limit}
    blamed = _in_cluster("culprit_node = {n:String}", cluster, params)
    incs = _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM ({summary_sql(blamed)}) ORDER BY detected_at DESC LIMIT {{limit:UInt32}}",
        params,
    )
    summary = _rows(
        store,
        "SELECT count() AS incidents, min(event_time) AS first_seen, max(event_time) AS last_seen "
        f"FROM {{db}}.incidents FINAL WHERE {blamed}",
        params,
    )
    on_node = _in_cluster("node = {n:String}", cluster, params)
    wheres = {
        "incident": blamed,
        "decision": blamed,
        "approval": _in_cluster(
            f"decision_id IN (SELECT decision_id FROM {{db}}.decisions FINAL WHERE {blamed})", cluster, params
        ),
        "guardrail_trip": on_node,
        "action": on_node,
        "action_result": on_node,
    }
    events = _rows(
        store,
        f"SELECT * FROM ({timeline_sql(wheres, blamed)}) ORDER BY time DESC, stage DESC LIMIT {{limit:UInt32}}",
        params,
    )
    anomalies = _rows(
        store,
        "SELECT signature, role, count() AS anomalies, max(event_time) AS last_seen "
        f"FROM {{db}}.anomalies FINAL WHERE {on_node} GROUP BY signature, role ORDER BY anomalies DESC",
        params,
    )
    # Every verdict on returning it: by an operator (`nodes resume`) or the automatic path (trainmedic-auto).
    returns = _rows(
        store,
        "SELECT event_time AS time, outcome, operator, incident_id, check_passed, detail FROM {db}.node_returns FINAL "
        f"WHERE {on_node} ORDER BY event_time DESC LIMIT {{limit:UInt32}}",
        params,
    )
    n_blamed = int(summary[0]["incidents"]) if summary else 0
    return {
        "node": node,
        "incidents_blamed": n_blamed,
        "first_seen": summary[0]["first_seen"] if n_blamed else None,
        "last_seen": summary[0]["last_seen"] if n_blamed else None,
        "incidents": incs,
        "events": events,
        "anomalies": anomalies,
        "returns": returns,
    }


_LATENCY_INNER = """SELECT i.category AS category, i.detection_latency_s AS detection_latency_s,
    r.action_latency_s AS action_latency_s,
    if(r.verified_at IS NULL, NULL,
       (toUnixTimestamp64Milli(assumeNotNull(r.verified_at)) - toUnixTimestamp64Milli(i.first_signal_time)) / 1000.0
    ) AS recovery_s
FROM (
    SELECT category, incident_id, detection_latency_s, first_signal_time FROM {db}.incidents FINAL WHERE WHERE_I
) AS i
LEFT JOIN (
    SELECT incident_id, minIf(verified_at, status = 'done') AS verified_at,
        minIf(action_latency_s, status = 'done') AS action_latency_s
    FROM {db}.action_results FINAL WHERE WHERE_R GROUP BY incident_id
) AS r ON r.incident_id = i.incident_id"""

_QUANTILES = ", ".join(
    f"quantileExactInclusive({q})({col}) AS {m}_p{p}"
    for m, col in (("detection", "detection_latency_s"), ("action", "action_latency_s"), ("recovery", "recovery_s"))
    for q, p in ((0.5, 50), (0.95, 95), (0.99, 99))
)


def latency(store: AuditStore, since: timedelta | None = None, cluster: str | None = None) -> dict[str, Any]:
    """p50/p95/p99 of detection, action and recovery latency, overall and per category.

    The latency_percentiles view's numbers, from the two tables they need
    (incidents, action_results) instead of the whole incident summary.
    """
    params: dict[str, Any] = {}
    where_i = where_r = "1"
    if (cut := _cutoff(since)) is not None:
        where_i, where_r = f"event_time >= {SINCE}", CHILD_SINCE
        params["since"] = cut
    where_i, where_r = _in_cluster(where_i, cluster, params), _in_cluster(where_r, cluster, params)
    inner = _LATENCY_INNER.replace("WHERE_I", where_i).replace("WHERE_R", where_r)
    stats = f"count() AS incidents, count(action_latency_s) AS actions_verified, {_QUANTILES}"
    rows = _rows(
        store,
        f"SELECT * FROM (SELECT 'all' AS category, 0 AS is_category, {stats} FROM ({inner}) UNION ALL "
        f"SELECT toString(category), 1, {stats} FROM ({inner}) GROUP BY category) "
        "ORDER BY is_category, category SETTINGS join_use_nulls = 1",
        params,
    )
    for r in rows:
        r.pop("is_category", None)
    overall = next((r for r in rows if r["category"] == "all" and r["incidents"]), None)
    return {"overall": overall, "by_category": [r for r in rows if r["category"] != "all"]}


def repeat_offenders(store: AuditStore, limit: int = 20) -> list[dict[str, Any]]:
    return _rows(store, "SELECT * FROM {db}.repeat_offenders LIMIT {limit:UInt32}", {"limit": limit})


def job_restarts(store: AuditStore, limit: int = 100) -> list[dict[str, Any]]:
    return _rows(
        store,
        "SELECT * FROM {db}.job_restarts ORDER BY restarts DESC, job_id LIMIT {limit:UInt32}",
        {"limit": limit},
    )


def gpu_hours_saved(store: AuditStore, since: timedelta | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    where = "1"
    if (cut := _cutoff(since)) is not None:
        where = "detected_at >= toDateTime64({since:Float64}, 3, 'UTC')"
        params["since"] = cut
    row = _rows(
        store,
        f"SELECT count() AS incidents, sum(gpu_hours_saved) AS gpu_hours_saved FROM {{db}}.gpu_hours_saved WHERE {where}",
        params,
    )[0]
    return {**row, "assumptions": GPU_HOURS_ASSUMPTIONS}


def export(
    store: AuditStore, table: str, fmt: ExportFormat, out: Path, since: timedelta | None = None
) -> dict[str, Any]:
    """Write a table or view to a CSV (with header) or Parquet file; return what was written."""
    if table not in RELATIONS:
        raise AuditQueryError(f"table {table!r}: expected one of {', '.join(sorted(RELATIONS))}")
    if fmt not in EXPORT_FORMATS:
        raise AuditQueryError(f"format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    time_col = RELATIONS[table]
    where, params = "1", {}
    if (cut := _cutoff(since)) is not None:
        if time_col is None:
            raise AuditQueryError(f"table {table!r} has no time column to filter with since")
        bound = "toDateTime64({since:Float64}, 3, 'UTC')"
        where = f"{time_col} >= " + (f"toDate({bound})" if time_col == "day" else bound)
        params["since"] = cut
    final = " FINAL" if table in BASE_TABLES else ""
    sql = f"SELECT * FROM {{db}}.{table}{final} WHERE {where}"
    rows = _rows(store, f"SELECT count() AS n FROM ({sql})", params)[0]["n"]
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    # Written aside and renamed, so a failed export never leaves a truncated file under the real name.
    with part.open("wb") as f:
        store.write_raw(sql, EXPORT_FORMATS[fmt], f, params)
    os.replace(part, out)
    return {"table": table, "format": fmt, "rows": rows, "out": str(out), "bytes": out.stat().st_size}


# --- goodput (sinks/ddl/021_goodput_outages.sql, docs/audit.md "Goodput") ------------------------

# What goodput assumes: the audit records a job's nodes, not its GPUs (the same 8 as gpu_hours_saved).
GOODPUT_GPUS_PER_NODE = cast(int, GPU_HOURS_ASSUMPTIONS["gpus_per_node"])
# The actions that stop a job (the attempt ends): an incident charges an outage only when one of them
# was carried out, or the job had stopped by itself (docs/audit.md, "Goodput").
STOPPING_ACTIONS = ("requeue", "stop", "drain_and_requeue", "drain_and_stop")
GOODPUT_ASSUMPTIONS = {
    "gpus_per_node": GOODPUT_GPUS_PER_NODE,
    "fault": "the incident's first_signal_time: the earliest evidence of the fault",
    "running_again": "the first scheduler RUNNING report of the job's next attempt (the first attempt started "
    "after the fault), else that attempt's start, else the first RUNNING report of the job after the fault",
    "job_stopped": "a stopping action of the incident (" + ", ".join(STOPPING_ACTIONS) + ") verified done; or the "
    "job stopped by itself between the fault and the incident (an attempt ended, a scheduler state other than "
    "RUNNING); or a stopping action whose result is not recorded and the job ran again. Otherwise the job kept "
    "running: 0 GPU-hours lost (lost_basis 'job kept running')",
    "outage": "per job, the fault -> running again intervals of the incidents that stopped it, merged where they "
    "overlap: one outage, charged once, to the incident whose fault came first (charged_to); the others 0. An "
    "incident that did not stop the job but whose fault fell inside the outage: 0, no running again and no time "
    "to recover of its own (lost_basis 'within outage', charged_to the outage's incident)",
    "gpu_hours_lost": "the GPUs of the outage's incidents (len(job_nodes) * 8, the largest) * (the outage's last "
    "running again - its first fault) / 3600; none while the job is not running again (lost_basis 'still down')",
    "productive": "the whole duration of each attempt that progressed (a higher step or a new checkpoint)",
    "effective_ratio": "productive / (lineage wall time - time of attempts whose progress is unknown)",
}


def _secs(later: str, earlier: str) -> str:
    """Seconds between two DateTime64(3) expressions, to the millisecond."""
    return f"(toUnixTimestamp64Milli({later}) - toUnixTimestamp64Milli({earlier})) / 1000.0"


_NOW = "now64(3, 'UTC')"


def attempts_sql(where: str) -> str:
    """One row per (job, lineage, attempt) among the job_attempts records `where` selects, as the latest
    record says. Ties in event_time (the record of the restart's cause shares its attempt's start) go to the
    later state: ended, then with a cause. The Nullable values ride in tuples, which argMax never skips."""
    latest = "(event_time, ended_at IS NOT NULL, cause_incident_id IS NOT NULL)"
    return f"""SELECT job_id, lineage_id, attempt, started_at,
        tupleElement(last, 1) AS ended_at, tupleElement(last, 2) AS progressed
    FROM (
        SELECT job_id, lineage_id, attempt, min(started_at) AS started_at,
            argMax(tuple(ended_at, progressed), {latest}) AS last
        FROM {{db}}.job_attempts FINAL
        WHERE job_id != '' AND ({where})
        GROUP BY job_id, lineage_id, attempt
    )"""


_STOPS = "(" + ", ".join(f"'{a}'" for a in STOPPING_ACTIONS) + ")"
# The end of an outage that has not ended (the job not running again): 9999-12-31, in milliseconds.
_NEVER_MS = "toInt64(253402300799999)"
# Per job (an incident without one alone), the incidents by fault; at one instant, those that stopped the job first.
_BY_FAULT = "PARTITION BY job_id, if(job_id IS NULL, incident_id, '') ORDER BY start_ms, kept, incident_id"
_PER_OUTAGE = "PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage"


def incident_goodput_sql(
    where_i: str = "1", where_r: str = "1", where_a: str = "1", where_s: str = "1", gpus_per_node: int = 8
) -> str:
    """The `incident_goodput` view (sinks/ddl/021_goodput_outages.sql) for the incidents `where_i` selects,
    reading their actions and action results, the job attempts and the scheduler's job reports that
    `where_r`, `where_a` and `where_s` select (all "1": the view itself; a test checks that the two are
    the same text).

    `judged`: each incident's fault, running again and whether the job stopped (`stop_evidence`); its
    interval is fault -> running again if the job stopped (-> never while it is not running again), else
    the instant of the fault. `chained`/`outages`: per job, by fault, an interval that starts before the
    furthest end of those before it belongs to their outage (gaps and islands: a running max, then a
    running count of the rows that start a new one). `charged`: each outage's first incident, span and
    GPUs. An incident that did not stop the job (`kept`) never extends an outage nor starts one that has
    another incident, so each outage's first incident stopped the job; a `kept` one inside an outage is
    'within outage': it has no running again and no time to recover (only the incidents that stopped the
    job recover), 0 lost. Window functions only, each CTE read once: `judged` is computed once."""
    return f"""WITH
    faults AS (
        SELECT incident_id, job_id, first_signal_time, event_time FROM {{db}}.incidents FINAL WHERE job_id != '' AND ({where_i})
    ),
    attempts AS (
    {attempts_sql(where_a)}
    ),
    next_attempt AS (
        SELECT f.incident_id AS incident_id, toNullable(min(a.started_at)) AS started_at,
            tupleElement(argMin(tuple(a.ended_at), a.started_at), 1) AS ended_at
        FROM faults AS f
        INNER JOIN attempts AS a ON a.job_id = f.job_id
        WHERE a.started_at > f.first_signal_time
        GROUP BY f.incident_id
    ),
    ended AS (
        SELECT f.incident_id AS incident_id, count() AS attempts_ended
        FROM faults AS f
        INNER JOIN attempts AS a ON a.job_id = f.job_id
        WHERE a.ended_at >= f.first_signal_time AND a.ended_at <= f.event_time
        GROUP BY f.incident_id
    ),
    running AS (
        SELECT f.incident_id AS incident_id,
            minIfOrNull(s.event_time, s.running AND s.event_time > f.first_signal_time) AS after_fault,
            minIfOrNull(
                s.event_time,
                s.running AND n.started_at IS NOT NULL AND s.event_time >= n.started_at AND (n.ended_at IS NULL OR s.event_time <= n.ended_at)
            ) AS in_next_attempt,
            countIf(NOT s.running AND s.event_time >= f.first_signal_time AND s.event_time <= f.event_time) AS left_running
        FROM faults AS f
        INNER JOIN (
            SELECT job_id, event_time, state = 'RUNNING' AS running FROM {{db}}.sched_events FINAL
            WHERE kind = 'job' AND state != 'SNAPSHOT' AND job_id != '' AND ({where_s})
        ) AS s ON s.job_id = f.job_id
        LEFT JOIN next_attempt AS n ON n.incident_id = f.incident_id
        GROUP BY f.incident_id
    ),
    results AS (
        SELECT incident_id, minIf(verified_at, status = 'done') AS acted_at,
            countIf(status = 'done' AND action IN {_STOPS}) AS stops_done,
            countIf(action IN {_STOPS}) AS stop_results
        FROM {{db}}.action_results FINAL WHERE {where_r} GROUP BY incident_id
    ),
    asked AS (
        SELECT incident_id, countIf(action IN {_STOPS}) AS stops_asked
        FROM {{db}}.actions FINAL WHERE {where_r} GROUP BY incident_id
    ),
    judged AS (
        SELECT
            i.incident_id AS incident_id,
            nullIf(i.job_id, '') AS job_id,
            i.category AS category,
            nullIf(i.culprit_node, '') AS culprit_node,
            toUInt32(length(i.job_nodes)) * {gpus_per_node} AS gpus,
            i.first_signal_time AS fault_at,
            i.event_time AS detected_at,
            r.acted_at AS acted_at,
            coalesce(g.in_next_attempt, n.started_at, g.after_fault) AS ran_again_at,
            multiIf(
                g.in_next_attempt IS NOT NULL, 'next attempt RUNNING',
                n.started_at IS NOT NULL, 'next attempt start',
                g.after_fault IS NOT NULL, 'RUNNING after the fault',
                NULL
            ) AS ran_again_from,
            multiIf(
                ifNull(r.stops_done, 0) > 0, 'stopping action done',
                ifNull(e.attempts_ended, 0) + ifNull(g.left_running, 0) > 0, 'job stopped before the incident',
                ifNull(a.stops_asked, 0) > 0 AND ifNull(r.stop_results, 0) = 0 AND ran_again_at IS NOT NULL,
                'stopping action without a result, ran again',
                NULL
            ) AS stop_evidence,
            toUInt8(stop_evidence IS NULL) AS kept,
            toUnixTimestamp64Milli(i.first_signal_time) AS start_ms,
            multiIf(kept = 1, start_ms, ran_again_at IS NULL, {_NEVER_MS}, toUnixTimestamp64Milli(assumeNotNull(ran_again_at))) AS end_ms
        FROM (SELECT * FROM {{db}}.incidents FINAL WHERE {where_i}) AS i
        LEFT JOIN results AS r ON r.incident_id = i.incident_id
        LEFT JOIN asked AS a ON a.incident_id = i.incident_id
        LEFT JOIN next_attempt AS n ON n.incident_id = i.incident_id
        LEFT JOIN running AS g ON g.incident_id = i.incident_id
        LEFT JOIN ended AS e ON e.incident_id = i.incident_id
    ),
    chained AS (
        SELECT *,
            max(end_ms) OVER ({_BY_FAULT} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach_ms,
            row_number() OVER ({_BY_FAULT}) AS n
        FROM judged
    ),
    outages AS (
        SELECT *, sum(toUInt64(n = 1 OR start_ms >= reach_ms)) OVER ({_BY_FAULT} ROWS UNBOUNDED PRECEDING) AS outage
        FROM chained
    ),
    charged AS (
        SELECT *,
            argMin(incident_id, (start_ms, kept, incident_id)) OVER ({_PER_OUTAGE}) AS first_incident,
            countIf(kept = 0) OVER ({_PER_OUTAGE}) AS stopping,
            max(gpus) OVER ({_PER_OUTAGE}) AS outage_gpus,
            min(start_ms) OVER ({_PER_OUTAGE}) AS from_ms,
            max(end_ms) OVER ({_PER_OUTAGE}) AS until_ms
        FROM outages
    )
SELECT
    incident_id,
    job_id,
    category,
    culprit_node,
    gpus,
    fault_at,
    detected_at,
    acted_at,
    multiIf(
        job_id IS NULL, 'no job',
        stopping = 0, 'job kept running',
        kept = 1, 'within outage',
        until_ms = {_NEVER_MS}, 'still down',
        'outage'
    ) AS lost_basis,
    if(lost_basis = 'outage', ran_again_at, NULL) AS running_again_at,
    if(lost_basis = 'outage', ran_again_from, NULL) AS running_again_from,
    {_secs("detected_at", "fault_at")} AS time_to_detect_s,
    if(acted_at IS NULL, NULL, {_secs("assumeNotNull(acted_at)", "detected_at")}) AS time_to_act_s,
    if(running_again_at IS NULL, NULL, {_secs("assumeNotNull(running_again_at)", "fault_at")}) AS time_to_recover_s,
    multiIf(
        lost_basis = 'outage', if(first_incident = incident_id, outage_gpus * ((until_ms - from_ms) / 1000.0) / 3600.0, 0.0),
        lost_basis = 'still down', NULL,
        0.0
    ) AS gpu_hours_lost,
    if(lost_basis IN ('outage', 'still down', 'within outage'), first_incident, NULL) AS charged_to,
    stop_evidence
FROM charged"""


def job_goodput_sql(where_a: str = "1", incidents: str = "{db}.incident_goodput") -> str:
    """The `job_goodput` view (sinks/ddl/021_goodput_outages.sql) for the jobs whose attempt records
    `where_a` selects, with the incidents of `incidents` (a relation with incident_goodput's columns)."""
    judged = "j.attempts_progressed + j.attempts_no_progress"
    return f"""WITH
    attempts AS (
    {attempts_sql(where_a)}
    ),
    lineages AS (
        SELECT job_id, lineage_id,
            count() AS attempts,
            countIf(ifNull(progressed, false)) AS attempts_progressed,
            countIf(NOT ifNull(progressed, true)) AS attempts_no_progress,
            countIf(progressed IS NULL) AS attempts_unknown,
            countIf(ended_at IS NULL) AS attempts_running,
            min(started_at) AS first_started_at,
            max(ifNull(ended_at, {_NOW})) AS until,
            sumIf(duration_s, ifNull(progressed, false)) AS productive_s,
            sumIf(duration_s, NOT ifNull(progressed, true)) AS unproductive_s,
            sumIf(duration_s, progressed IS NULL) AS unknown_s
        FROM (SELECT *, {_secs(f"ifNull(ended_at, {_NOW})", "started_at")} AS duration_s FROM attempts)
        GROUP BY job_id, lineage_id
    ),
    jobs AS (
        SELECT l.job_id AS job_id,
            count() AS lineages,
            sum(l.attempts) AS attempts,
            sum(l.attempts) - count() AS restarts,
            sum(l.attempts_running) AS attempts_running,
            sum(l.attempts_progressed) AS attempts_progressed,
            sum(l.attempts_no_progress) AS attempts_no_progress,
            sum(l.attempts_unknown) AS attempts_unknown,
            toNullable(min(l.first_started_at)) AS first_started_at,
            if(sum(l.attempts_running) > 0, NULL, max(l.until)) AS last_ended_at,
            toNullable(sum({_secs("l.until", "l.first_started_at")})) AS wall_s,
            toNullable(sum(l.productive_s)) AS productive_s,
            toNullable(sum(l.unproductive_s)) AS unproductive_s,
            toNullable(sum(l.unknown_s)) AS unknown_s
        FROM lineages AS l
        GROUP BY l.job_id
    ),
    lost AS (
        SELECT assumeNotNull(job_id) AS job_id, count() AS incidents,
            countIf(lost_basis = 'still down') AS incidents_not_running_again,
            countIf(lost_basis = 'job kept running') AS incidents_kept_running,
            countIf(lost_basis = 'outage' AND charged_to = incident_id) AS outages,
            sum(gpu_hours_lost) AS gpu_hours_lost
        FROM {incidents}
        WHERE job_id IS NOT NULL
        GROUP BY job_id
    )
SELECT
    k.job_id AS job_id,
    j.lineages AS lineages,
    j.attempts AS attempts,
    j.restarts AS restarts,
    j.attempts_running AS attempts_running,
    j.attempts_progressed AS attempts_progressed,
    j.attempts_no_progress AS attempts_no_progress,
    j.attempts_unknown AS attempts_unknown,
    j.first_started_at AS first_started_at,
    j.last_ended_at AS last_ended_at,
    j.wall_s AS wall_s,
    j.productive_s AS productive_s,
    j.unproductive_s AS unproductive_s,
    j.unknown_s AS unknown_s,
    if({judged} = 0 OR j.wall_s - j.unknown_s <= 0, NULL, j.productive_s / (j.wall_s - j.unknown_s)) AS effective_ratio,
    l.incidents AS incidents,
    l.incidents_not_running_again AS incidents_not_running_again,
    ifNull(l.gpu_hours_lost, 0) AS gpu_hours_lost,
    l.incidents_kept_running AS incidents_kept_running,
    l.outages AS outages
FROM (SELECT job_id FROM jobs UNION DISTINCT SELECT job_id FROM lost) AS k
LEFT JOIN jobs AS j ON j.job_id = k.job_id
LEFT JOIN lost AS l ON l.job_id = k.job_id"""


_GOODPUT_STATS = ", ".join(
    [f"avg({m}_s) AS {m}_mean" for m in ("time_to_detect", "time_to_act", "time_to_recover")]
    + [
        f"quantileExactInclusive({q})({m}_s) AS {m}_p{p}"
        for m in ("time_to_detect", "time_to_act", "time_to_recover")
        for q, p in ((0.5, 50), (0.95, 95))
    ]
)


def goodput(
    store: AuditStore,
    since: timedelta | None = None,
    job: str | None = None,
    limit: int = 20,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Goodput of the last `since` (everything: None), for one job or the fleet.

    `fleet`: the window's incidents (GPU-hours lost, the outages they were charged as, how many ran
    again, were not running again, did not stop their job, or did not stop it inside another's outage;
    mean/p50/p95 of the time to detect, act and recover: recovery of the incidents that stopped their
    job only), the jobs and their effective training time ratio (productive time over
    the wall time whose outcome is known, summed over the jobs that have one). `incidents`: the
    window's incidents, newest first; `jobs`: the jobs with an incident or an attempt recorded in the
    window, each over its whole lineage, the most GPU-hours lost first, then the lowest ratio; both at
    most `limit`. The rows are the incident_goodput and job_goodput views' (sinks/ddl/021_goodput_outages.sql)
    from bounded reads: incidents by time, their children and the jobs' attempts and scheduler
    reports through the incident and job bloom filters. Outages are merged among the window's
    incidents: one that began before the window is charged to its first incident inside it.
    """
    params: dict[str, Any] = {"limit": limit}
    where_i, child = ["1"], "1"
    if (cut := _cutoff(since)) is not None:
        where_i.append(f"event_time >= {SINCE}")
        child = CHILD_SINCE
        params["since"] = cut
    if job is not None:
        where_i.append("job_id = {job:String}")
        params["job"] = job
    # The cluster bounds every read, the children's too: a job id of another cluster is another job.
    wi = _in_cluster(" AND ".join(where_i), cluster, params)
    child = _in_cluster(child, cluster, params)
    ids = f"SELECT incident_id FROM {{db}}.incidents FINAL WHERE {wi}"
    inc_jobs = f"SELECT job_id FROM {{db}}.incidents FINAL WHERE {wi}"
    # The next attempt started after the fault, so its records are no older than the window's children.
    inc = incident_goodput_sql(
        where_i=wi,
        where_r=f"{child} AND incident_id IN ({ids})",
        where_a=f"{child} AND job_id IN ({inc_jobs})",
        where_s=f"{child} AND job_id IN ({inc_jobs})",
        gpus_per_node=GOODPUT_GPUS_PER_NODE,
    )
    att_where = [f"event_time >= {SINCE}"] if cut is not None else ["1"]
    if job is not None:
        att_where.append("job_id = {job:String}")
    att_jobs = (
        f"SELECT job_id FROM {{db}}.job_attempts FINAL WHERE {_in_cluster(' AND '.join(att_where), cluster, params)}"
    )
    where_a = _in_cluster(f"job_id IN ({inc_jobs}) OR job_id IN ({att_jobs})", cluster, params)
    jobs_sql = job_goodput_sql(where_a=where_a, incidents=f"({inc})")

    totals = _rows(
        store,
        "SELECT count() AS incidents, countIf(lost_basis = 'outage') AS incidents_running_again, "
        "countIf(lost_basis = 'still down') AS incidents_not_running_again, "
        "countIf(lost_basis = 'job kept running') AS incidents_kept_running, "
        "countIf(lost_basis = 'no job') AS incidents_no_job, "
        "countIf(lost_basis = 'within outage') AS incidents_within_outage, "
        "countIf(lost_basis = 'outage' AND charged_to = incident_id) AS outages, "
        f"sum(gpu_hours_lost) AS gpu_hours_lost, {_GOODPUT_STATS} FROM ({inc})",
        params,
    )[0]
    job_totals = _rows(
        store,
        "SELECT count() AS jobs, sum(restarts) AS restarts, countIf(effective_ratio IS NOT NULL) AS jobs_with_ratio, "
        "sumIf(productive_s, effective_ratio IS NOT NULL) AS productive_s, "
        "sumIf(wall_s - unknown_s, effective_ratio IS NOT NULL) AS judged_s "
        f"FROM ({jobs_sql})",
        params,
    )[0]
    judged = job_totals["judged_s"] or 0.0
    fleet = {
        **totals,
        "gpu_hours_lost": totals["gpu_hours_lost"] or 0.0,
        **job_totals,
        "effective_ratio": (job_totals["productive_s"] or 0.0) / judged if judged > 0 else None,
    }
    incidents_rows = _rows(
        store, f"SELECT * FROM ({inc}) ORDER BY detected_at DESC, incident_id LIMIT {{limit:UInt32}}", params
    )
    job_rows = _rows(
        store,
        f"SELECT * FROM ({jobs_sql}) "
        "ORDER BY gpu_hours_lost DESC, effective_ratio ASC NULLS LAST, job_id LIMIT {limit:UInt32}",
        params,
    )
    return {
        "since_s": None if since is None else since.total_seconds(),
        "job": job,
        "cluster": cluster,
        "fleet": fleet,
        "jobs": job_rows,
        "incidents": incidents_rows,
        "assumptions": GOODPUT_ASSUMPTIONS,
    }
