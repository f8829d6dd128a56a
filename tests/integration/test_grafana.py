"""Every Grafana panel query runs on chDB against the migrated audit schema.

Grafana does not run here; its two rewriting steps are reproduced instead:

1. Grafana (frontend) interpolates dashboard variables: `${database}` and
   `$database` become the variable's value. The dashboard's `database` is a
   textbox variable (one value), which Grafana inserts as it is.
2. The plugin (backend, pkg/macros/macros.go of grafana/clickhouse-datasource)
   expands its macros with the panel's time range and interval:
     $__timeFilter(c)    c >= toDateTime(FROM_S) AND c <= toDateTime(TO_S)
     $__timeFilter_ms(c) c >= fromUnixTimestamp64Milli(FROM_MS) AND c <= fromUnixTimestamp64Milli(TO_MS)
     $__dateFilter(c)    c >= toDate('FROM_DAY') AND c <= toDate('TO_DAY')
     $__fromTime, $__toTime         toDateTime(FROM_S), toDateTime(TO_S)
     $__fromTime_ms, $__toTime_ms   fromUnixTimestamp64Milli(FROM_MS), ... (TO_MS)
     $__timeInterval(c)  toStartOfInterval(toDateTime(c), INTERVAL N second)
     $__interval_s       N
   Any other `$__` macro left in a panel fails the test, so a dashboard cannot
   use one this emulation does not know.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from schemas.events import Event
from sinks.audit import AuditStore
from tests.conftest import REPO
from tests.integration.test_audit import incident_events, insert_events, operator_events

GRAFANA = REPO / "infra" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE_UID = "trainmedic-clickhouse"

# Panel title -> the columns its query must return, in order.
EXPECTED_COLUMNS: dict[str, list[str]] = {
    "Incidents": ["incidents"],
    "Actions verified": ["actions_done"],
    "GPU-hours saved (estimate)": ["gpu_hours_saved"],
    "Guardrail trips": ["trips"],
    "Incidents over time by category": ["time", "category", "incidents"],
    "Actions by type and outcome": ["action", "done", "failed", "skipped"],
    "Detection latency p50 / p95 / p99": ["time", "p50", "p95", "p99"],
    "Action latency p50 / p95 / p99": ["time", "p50", "p95", "p99"],
    "Latency percentiles by category": [
        "category",
        "incidents",
        "detection_p50",
        "detection_p95",
        "detection_p99",
        "actions_verified",
        "action_p50",
        "action_p95",
        "action_p99",
    ],
    "Top repeat-offender nodes": ["node", "incidents", "last_seen", "categories", "jobs_hit"],
    "Restarts per job": ["job_id", "restarts", "stops", "failed_actions", "last_action_at"],
    "Guardrail trips over time": ["time", "guardrail", "trips"],
    "Recent guardrail trips": ["event_time", "guardrail", "action", "job_id", "node", "partition", "detail"],
    "Operator verdicts": ["verdict", "reason", "approvals"],
    "Mode changes": ["event_time", "partition", "category", "old_mode", "new_mode", "operator", "forced", "reason"],
}

_MACRO = re.compile(r"\$__(\w+)(?:\(([^()]*)\))?")


def expand_grafana(sql: str, variables: dict[str, str], frm: float, to: float, interval_s: int) -> str:
    """The SQL the plugin sends to ClickHouse for a panel query (see the module docstring)."""
    for name, value in variables.items():
        sql = sql.replace("${" + name + "}", value)
        sql = re.sub(r"\$" + re.escape(name) + r"\b", value, sql)
    f_s, t_s, f_ms, t_ms = int(frm), int(to), int(frm * 1000), int(to * 1000)
    f_day, t_day = time.strftime("%Y-%m-%d", time.gmtime(frm)), time.strftime("%Y-%m-%d", time.gmtime(to))

    def macro(m: re.Match[str]) -> str:
        name, arg = m.group(1), (m.group(2) or "").strip()
        simple = {
            "fromTime": f"toDateTime({f_s})",
            "toTime": f"toDateTime({t_s})",
            "fromTime_ms": f"fromUnixTimestamp64Milli({f_ms})",
            "toTime_ms": f"fromUnixTimestamp64Milli({t_ms})",
            "interval_s": str(max(interval_s, 1)),
        }
        if name in simple:
            return simple[name] + (f"({m.group(2)})" if m.group(2) is not None else "")
        if name == "timeFilter":
            return f"{arg} >= toDateTime({f_s}) AND {arg} <= toDateTime({t_s})"
        if name == "timeFilter_ms":
            return f"{arg} >= fromUnixTimestamp64Milli({f_ms}) AND {arg} <= fromUnixTimestamp64Milli({t_ms})"
        if name == "dateFilter":
            return f"{arg} >= toDate('{f_day}') AND {arg} <= toDate('{t_day}')"
        if name == "timeInterval":
            return f"toStartOfInterval(toDateTime({arg}), INTERVAL {max(interval_s, 1)} second)"
        raise AssertionError(f"panel SQL uses $__{name}, which this emulation of the plugin does not know")

    return _MACRO.sub(macro, sql)


def panels() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        stack = list(dash["panels"])
        while stack:
            p = stack.pop(0)
            stack.extend(p.get("panels", []))  # panels inside collapsed rows
            if p.get("type") != "row":
                out.append((path.name, p))
    return out


def test_dashboards_use_the_clickhouse_plugin_in_its_query_shape() -> None:
    assert DASHBOARDS, "no dashboards in infra/grafana/dashboards"
    titles = []
    for name, p in panels():
        titles.append(p["title"])
        assert p["datasource"] == {"type": PLUGIN, "uid": DATASOURCE_UID}, (name, p["title"])
        for t in p["targets"]:
            assert t["datasource"] == {"type": PLUGIN, "uid": DATASOURCE_UID}
            assert t["editorType"] == "sql" and t["rawSql"].strip()
            # the plugin's Format enum: 0 time series, 1 table; queryType says the same in words
            assert (t["format"], t["queryType"]) in ((0, "timeseries"), (1, "table")), (p["title"], t)
            if p["type"] == "timeseries":
                assert t["format"] == 0, p["title"]
    assert sorted(titles) == sorted(EXPECTED_COLUMNS)
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["database"]["type"] == "textbox" and variables["database"]["query"] == "trainmedic"


def test_provisioning_points_at_the_plugin_and_the_dashboards() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text())
    (source,) = ds["datasources"]
    assert (source["type"], source["uid"]) == (PLUGIN, DATASOURCE_UID)
    assert {"host", "port", "protocol", "username", "defaultDatabase"} <= set(source["jsonData"])
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "trainmedic.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_macro_expansion_matches_the_plugin() -> None:
    sql = "SELECT $__timeInterval(t) AS time FROM ${database}.x WHERE $__timeFilter(t) AND d >= $__fromTime LIMIT $__interval_s"
    assert expand_grafana(sql, {"database": "tm"}, 1000.5, 2000.25, 60) == (
        "SELECT toStartOfInterval(toDateTime(t), INTERVAL 60 second) AS time FROM tm.x "
        "WHERE t >= toDateTime(1000) AND t <= toDateTime(2000) AND d >= toDateTime(1000) LIMIT 60"
    )
    with pytest.raises(AssertionError, match=r"\$__conditionalAll"):
        expand_grafana("SELECT $__conditionalAll(x, $v)", {}, 0, 1, 1)


@pytest.fixture
def audited(chdb_url: str, database: str) -> Iterator[AuditStore]:
    store = AuditStore(chdb_url, database)
    store.migrate()
    t0 = time.time() - 1800
    events: list[Event] = []
    for n in range(3):
        events += incident_events(n, t0 + 60 * n, job="1", node="gpu01", detect_s=1.0 + n)
    events += incident_events(0, t0 + 30, job="2", node="gpu02", category="user_code", action="stop", status="failed")
    events += incident_events(1, t0 + 40, job="2", node="gpu03", category="interconnect", action="requeue")
    events += operator_events(t0, "1", 0, "gpu01")
    insert_events(store, events)
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize("panel", [p for _, p in panels()], ids=lambda p: p["title"])
def test_panel_query_runs_on_the_audit_schema(audited: AuditStore, panel: dict[str, Any]) -> None:
    now = time.time()
    for target in panel["targets"]:
        sql = expand_grafana(target["rawSql"], {"database": audited.database}, now - 6 * 3600, now + 60, 60)
        result = audited.client.query(sql)
        assert list(result.column_names) == EXPECTED_COLUMNS[panel["title"]], sql
        assert result.result_rows, f"{panel['title']}: no rows for data inside the time range\n{sql}"
        if target["format"] == 0:
            assert result.column_names[0] == "time"
            assert result.result_rows == sorted(result.result_rows, key=lambda r: r[0])
