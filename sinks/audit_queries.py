"""Questions asked of the audit trail, answered as plain dicts.

The `trainmedic audit` CLI formats these; the console can serve them as they
are. Every query reads the views of infra/clickhouse/003_views.sql or tables
with FINAL, so counts are exact under redelivery. Times come back as
timezone-aware UTC datetimes; `jsonable` turns a result into JSON-ready data.
"""

from __future__ import annotations

import math
import os
import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

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
}
RELATIONS: dict[str, str | None] = {**BASE_TABLES, **VIEWS}

# The assumptions behind gpu_hours_saved (infra/clickhouse/003_views.sql, docs/audit.md).
GPU_HOURS_ASSUMPTIONS = {
    "gpus_per_node": 8,
    "nccl_watchdog_s": 600,
    "manual_response_s": 1800,
    "formula": "gpus * (baseline_s - ours_s) / 3600; gpus = job nodes * 8; baseline_s = 600 + 1800; "
    "ours_s = first fault signal -> action verified",
}

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class AuditQueryError(RuntimeError):
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
            f"no database {store.database!r} in {store.url}: nothing was audited there yet, "
            f"or --database names another one (found: {', '.join(others) or 'none'})"
        )
    names = {
        r["name"]
        for r in _rows(store, "SELECT name FROM system.tables WHERE database = {d:String}", {"d": store.database})
    }
    if missing := sorted(set(RELATIONS) - names):
        raise AuditQueryError(
            f"the audit schema of {store.database!r} in {store.url} predates this trainmedic "
            f"(missing {', '.join(missing)}): run `trainmedic db migrate` with the same options"
        )


_INCIDENT_COLUMNS = """incident_id, detected_at, first_signal_time, job_id, partition, job_nodes, category, severity,
    culprit_node, confidence, recommended_action, decision_kind, decision_action, decision_mode, verdict,
    actions, actions_done, actions_failed, guardrail_trips, verified_at,
    detection_latency_s, action_latency_s, recovery_s"""


def incidents(
    store: AuditStore, since: timedelta | None = None, category: str | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    """Incidents, newest first, with their decision, verdict and outcome."""
    if category is not None and category not in CATEGORIES:
        raise AuditQueryError(f"category {category!r}: expected one of {', '.join(CATEGORIES)}")
    where = ["1"]
    params: dict[str, Any] = {"limit": limit}
    if (cut := _cutoff(since)) is not None:
        where.append("detected_at >= toDateTime64({since:Float64}, 3, 'UTC')")
        params["since"] = cut
    if category is not None:
        where.append("category = {category:String}")
        params["category"] = category
    return _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM {{db}}.incident_summary WHERE {' AND '.join(where)} "
        "ORDER BY detected_at DESC, incident_id LIMIT {limit:UInt32}",
        params,
    )


def incidents_per_day(store: AuditStore, since: timedelta | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {}
    where = "1"
    if (cut := _cutoff(since)) is not None:
        where = "day >= toDate(toDateTime64({since:Float64}, 3, 'UTC'))"
        params["since"] = cut
    return _rows(store, f"SELECT * FROM {{db}}.incidents_daily WHERE {where} ORDER BY day, category", params)


def job_timeline(store: AuditStore, job_id: str) -> dict[str, Any]:
    """Everything that happened to a job: its incidents, and one list of events in order.

    Each timeline item has a `kind`: anomaly, incident, decision, approval,
    guardrail_trip, action, action_result. Ties in time keep pipeline order.
    """
    timeline = _rows(
        store, "SELECT * FROM {db}.timeline WHERE job_id = {j:String} ORDER BY time, stage, id", {"j": job_id}
    )
    incs = _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM {{db}}.incident_summary WHERE job_id = {{j:String}} ORDER BY detected_at",
        {"j": job_id},
    )
    restarts = _rows(store, "SELECT * FROM {db}.job_restarts WHERE job_id = {j:String}", {"j": job_id})
    return {
        "job_id": job_id,
        "incidents": incs,
        "restarts": restarts[0]["restarts"] if restarts else 0,
        "timeline": timeline,
    }


def node_history(store: AuditStore, node: str, limit: int = 1000) -> dict[str, Any]:
    """A node's record: incidents it was blamed for, actions on it, the anomalies seen on it."""
    summary = _rows(store, "SELECT * FROM {db}.repeat_offenders WHERE node = {n:String}", {"n": node})
    incs = _rows(
        store,
        f"SELECT {_INCIDENT_COLUMNS} FROM {{db}}.incident_summary WHERE culprit_node = {{n:String}} "
        "ORDER BY detected_at DESC LIMIT {limit:UInt32}",
        {"n": node, "limit": limit},
    )
    events = _rows(
        store,
        "SELECT * FROM {db}.timeline WHERE node = {n:String} AND kind != 'anomaly' "
        "ORDER BY time DESC, stage DESC LIMIT {limit:UInt32}",
        {"n": node, "limit": limit},
    )
    anomalies = _rows(
        store,
        "SELECT signature, role, count() AS anomalies, max(event_time) AS last_seen "
        "FROM {db}.anomalies FINAL WHERE node = {n:String} GROUP BY signature, role ORDER BY anomalies DESC",
        {"n": node},
    )
    return {
        "node": node,
        "incidents_blamed": summary[0]["incidents"] if summary else 0,
        "first_seen": summary[0]["first_seen"] if summary else None,
        "last_seen": summary[0]["last_seen"] if summary else None,
        "incidents": incs,
        "events": events,
        "anomalies": anomalies,
    }


def latency(store: AuditStore) -> dict[str, Any]:
    """p50/p95/p99 of detection, action and recovery latency, overall and per category."""
    rows = _rows(store, "SELECT * FROM {db}.latency_percentiles")
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
