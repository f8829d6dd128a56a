"""The dashboards: every ClickHouse panel query runs on chDB against the migrated audit schema,
no URL parameter can reach its SQL, and every metric the Prometheus dashboard reads is one
trainmedic exports.

Grafana does not run here; its two rewriting steps are reproduced instead:

1. Grafana (frontend) interpolates the dashboard's declared variables: `$name`, `${name}`,
   `${name:format}` and `[[name]]` become the variable's value, which a textbox, custom or
   query variable takes from the URL (`?var-name=...`). The ClickHouse plugin formats a
   single value as it is (no quoting: CHDatasource.format), so a variable in SQL is an
   injection. The audit dashboard therefore declares only its data source variable
   (`DS_CLICKHOUSE`) and names no database in its SQL: the plugin's connection uses the data
   source's default database (provisioned, TRAINMEDIC_CH_DATABASE), as `USE db` does here.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from schemas.events import Event, JobAttempt, SchedEvent
from sinks import audit_queries as q
from sinks.audit import AuditStore
from tests.conftest import REPO
from tests.integration.test_audit import incident_events, insert_events, operator_events
from tests.unit.test_alert_rules import PROMETHEUS_OWN, SCRAPE_TIME_COLLECTORS, exported_metrics, metric_names

GRAFANA = REPO / "infra" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE_UID = "trainmedic-clickhouse"
CH_VARIABLE = "DS_CLICKHOUSE"
PROM_VARIABLE = "DS_PROMETHEUS"
CH_DATASOURCE = {"type": PLUGIN, "uid": "${" + CH_VARIABLE + "}"}
PROM_DATASOURCE = {"type": "prometheus", "uid": "${" + PROM_VARIABLE + "}"}
SERVICE_DASHBOARD = GRAFANA / "dashboards" / "trainmedic-service.json"
HOSTILE = "trainmedic.incidents WHERE 1=0 UNION ALL SELECT name FROM system.users --"


def _variables(path: Path) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}


CH_DASHBOARDS = [p for p in DASHBOARDS if CH_VARIABLE in _variables(p)]
PROM_DASHBOARDS = [p for p in DASHBOARDS if PROM_VARIABLE in _variables(p)]

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
    "GPU-hours lost over time": ["time", "gpu_hours_lost", "incidents_not_running_again"],
    "Time to detect / act / recover": [
        "time",
        "detect_p50",
        "detect_p95",
        "act_p50",
        "act_p95",
        "recover_p50",
        "recover_p95",
    ],
    "Worst jobs by GPU-hours lost": [
        "job_id",
        "gpu_hours_lost",
        "incidents",
        "incidents_not_running_again",
        "restarts",
        "effective_ratio",
    ],
    "Lowest effective training time": [
        "job_id",
        "effective_ratio",
        "productive_h",
        "judged_h",
        "attempts",
        "attempts_no_progress",
        "restarts",
        "gpu_hours_lost",
    ],
}

# The goodput panels read sinks/audit_queries.py's goodput SQL (the text of the 016 views) bounded
# by the time range: incidents detected in it, their children and their jobs' attempts and RUNNING
# reports from its start on (the next attempt starts after the fault), and for the jobs panels the
# jobs with an incident or an attempt record in it, each over its whole lineage.
GOODPUT_PANELS = {
    "GPU-hours lost over time": "incidents",
    "Time to detect / act / recover": "incidents",
    "Worst jobs by GPU-hours lost": "jobs",
    "Lowest effective training time": "jobs",
}
_IN_RANGE = "SELECT {col} FROM {table} FINAL WHERE $__timeFilter(event_time)"


def goodput_incidents_sql() -> str:
    child = "event_time >= $__fromTime"
    jobs = _IN_RANGE.format(col="job_id", table="incidents")
    return q.incident_goodput_sql(
        where_i="$__timeFilter(event_time)",
        where_r=f"{child} AND incident_id IN ({_IN_RANGE.format(col='incident_id', table='incidents')})",
        where_a=f"{child} AND job_id IN ({jobs})",
        where_s=f"{child} AND job_id IN ({jobs})",
    ).replace("{db}.", "")


def goodput_jobs_sql() -> str:
    jobs = _IN_RANGE.format(col="job_id", table="incidents")
    attempted = _IN_RANGE.format(col="job_id", table="job_attempts")
    return q.job_goodput_sql(
        where_a=f"job_id IN ({jobs}) OR job_id IN ({attempted})", incidents=f"({goodput_incidents_sql()})"
    ).replace("{db}.", "")


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


_VARIABLE_REF = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def interpolate(sql: str, declared: dict[str, dict[str, Any]], url: dict[str, str]) -> str:
    """What Grafana's frontend makes of a panel's SQL: each reference to a declared variable
    becomes its value, a URL `var-NAME` value first (a datasource variable is resolved to a data
    source, not text, and never lands in SQL). Undeclared names and `$__` macros are left alone."""

    def value(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        var = declared.get(name)
        if name.startswith("__") or var is None or var["type"] == "datasource":
            return m.group(0)
        return url.get(f"var-{name}", str(var.get("current", {}).get("value", "")))

    return _VARIABLE_REF.sub(value, sql)


def panels(dashboards: list[Path] = CH_DASHBOARDS) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for path in dashboards:
        dash = json.loads(path.read_text())
        stack = list(dash["panels"])
        while stack:
            p = stack.pop(0)
            stack.extend(p.get("panels", []))  # panels inside collapsed rows
            if p.get("type") != "row":
                out.append((path.name, p))
    return out


def test_dashboards_use_the_clickhouse_plugin_in_its_query_shape() -> None:
    assert CH_DASHBOARDS, "no ClickHouse dashboards in infra/grafana/dashboards"
    assert set(CH_DASHBOARDS) | set(PROM_DASHBOARDS) == set(DASHBOARDS), "a dashboard on neither data source variable"
    titles = []
    for name, p in panels():
        titles.append(p["title"])
        assert p["datasource"] == CH_DATASOURCE, (name, p["title"])
        for t in p["targets"]:
            assert t["datasource"] == CH_DATASOURCE
            assert t["editorType"] == "sql" and t["rawSql"].strip()
            # the plugin's Format enum: 0 time series, 1 table; queryType says the same in words
            assert (t["format"], t["queryType"]) in ((0, "timeseries"), (1, "table")), (p["title"], t)
            if p["type"] == "timeseries":
                assert t["format"] == 0, p["title"]
    assert sorted(titles) == sorted(EXPECTED_COLUMNS)
    for path in CH_DASHBOARDS:
        # The data source variable offers the plugin's data sources, the provisioned one first.
        (variable,) = _variables(path).values()
        assert (variable["name"], variable["type"], variable["query"]) == (CH_VARIABLE, "datasource", PLUGIN)
        assert variable["current"]["value"] == DATASOURCE_UID


def test_no_url_parameter_reaches_a_panels_sql() -> None:
    # The old shape (a textbox `database` pasted into FROM) let `?var-database=` rewrite the
    # query; the interpolation below is the one that shows it.
    textbox = {"database": {"name": "database", "type": "textbox", "current": {"value": "trainmedic"}}}
    assert HOSTILE in interpolate("SELECT 1 FROM ${database}.x", textbox, {"var-database": HOSTILE})
    for path in CH_DASHBOARDS:
        declared = _variables(path)
        # Every variable a URL could set, and the old one, set to a hostile value.
        url = {f"var-{name}": HOSTILE for name in [*declared, "database"]}
        assert [v["type"] for v in declared.values()] == ["datasource"], "a variable whose value lands in SQL"
        for _, p in panels([path]):
            for t in p["targets"]:
                sql = t["rawSql"]
                assert interpolate(sql, declared, url) == sql, p["title"]
                # No variable reference at all (only the plugin's $__ macros): nothing to inject into.
                refs = {next(g for g in m.groups() if g) for m in _VARIABLE_REF.finditer(sql)}
                assert {r for r in refs if not r.startswith("__")} == set(), (p["title"], refs)


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
    events += goodput_events(t0)
    insert_events(store, events)
    try:
        yield store
    finally:
        store.client.command("USE default")  # the chDB session outlives the store
        store.close()


def goodput_events(t0: float) -> list[Event]:
    """Job 1's attempts around its three incidents (t0, +60, +120 s): each incident ended one, the
    first progressed; attempt 2 ran again 15 s after its requeue (a RUNNING report), attempt 4 runs."""
    spans = [(-600.0, 5.0, True), (5.0, 65.0, False), (65.0, 125.0, False), (125.0, None, None)]
    out: list[Event] = []
    for n, (start, end, progressed) in enumerate(spans, start=1):
        out.append(
            JobAttempt(
                event_id=f"att-1-{n}",
                event_time=t0 + (end if end is not None else start),
                lineage_id="lin-1",
                job_id="1",
                first_seen=t0 - 600,
                attempt=n,
                restart_count=n - 1,
                started_at=t0 + start,
                ended_at=None if end is None else t0 + end,
                cause_incident_id=None if end is None else f"inc-1-{n - 1}",
                progressed=progressed,
            )
        )
    out.append(SchedEvent(event_id="sched-1-run", event_time=t0 + 20, kind="job", job_id="1", state="RUNNING"))
    return out


@pytest.mark.parametrize("panel", [p for _, p in panels()], ids=lambda p: p["title"])
def test_panel_query_runs_on_the_audit_schema(audited: AuditStore, panel: dict[str, Any]) -> None:
    now = time.time()
    # The plugin's connection is to the data source's default database: tables go unqualified.
    audited.client.command(f"USE {audited.database}")
    for target in panel["targets"]:
        sql = expand_grafana(target["rawSql"], {}, now - 6 * 3600, now + 60, 60)
        result = audited.client.query(sql)
        assert list(result.column_names) == EXPECTED_COLUMNS[panel["title"]], sql
        assert result.result_rows, f"{panel['title']}: no rows for data inside the time range\n{sql}"
        if target["format"] == 0:
            assert result.column_names[0] == "time"
            assert result.result_rows == sorted(result.result_rows, key=lambda r: r[0])


# --- the service dashboard (Prometheus) ---------------------------------------------------------

# What Grafana puts for its own interval variables before Prometheus sees the query.
_GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "6h"}
# The service dashboard shows each of these (issue 16: what an SRE looks at first).
SERVICE_MUST_SHOW = {
    "trainmedic_loop_last_beat_timestamp_seconds",
    "trainmedic_consumer_last_processed_timestamp_seconds",
    "trainmedic_loop_ready",
    "trainmedic_stream_events_total",
    "trainmedic_producer_events_delivered_total",
    "trainmedic_incidents_total",
    "trainmedic_decisions_total",
    "trainmedic_actions_total",
    "trainmedic_guardrail_trips_total",
    "trainmedic_dead_letters_total",
    "trainmedic_audit_insert_failures_total",
    "trainmedic_mode",
    "trainmedic_kill_switch",
    "trainmedic_recommendations_pending",
    "trainmedic_build_info",
}


def promql(expr: str) -> str:
    for name, value in _GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable this test does not know in {expr!r}"
    return expr


def test_service_dashboard_reads_only_metrics_trainmedic_exports() -> None:
    assert PROM_DASHBOARDS == [SERVICE_DASHBOARD]
    (variable,) = _variables(SERVICE_DASHBOARD).values()
    assert (variable["name"], variable["type"], variable["query"]) == (PROM_VARIABLE, "datasource", "prometheus")
    exported = exported_metrics()
    shown: set[str] = set()
    for _, p in panels(PROM_DASHBOARDS):
        assert p["datasource"] == PROM_DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == PROM_DATASOURCE, p["title"]
            names = metric_names(promql(t["expr"]))  # parses it: a syntax error fails here
            assert names, (p["title"], t["expr"])
            for name in names - PROMETHEUS_OWN:
                if name in SCRAPE_TIME_COLLECTORS:
                    assert f'"{name}"' in SCRAPE_TIME_COLLECTORS[name].read_text(), name
                else:
                    assert name in exported, f"{p['title']}: {name} is not a metric trainmedic exports"
            shown |= names
    assert SERVICE_MUST_SHOW - shown == set(), "the service dashboard does not show these"
    # Histogram quantiles read the buckets (the only series a quantile can be taken from).
    assert {"trainmedic_detection_latency_seconds_bucket", "trainmedic_action_latency_seconds_bucket"} <= shown


def test_service_dashboard_check_refuses_a_metric_nobody_exports() -> None:
    assert metric_names(promql("rate(trainmedic_no_such_thing_total[$__rate_interval])")) == {
        "trainmedic_no_such_thing_total"
    }
    assert "trainmedic_no_such_thing_total" not in exported_metrics()
    with pytest.raises(ValueError):
        promql_parser.parse(promql("sum(rate(x[$__rate_interval])"))


def test_goodput_panels_are_the_goodput_queries(audited: AuditStore) -> None:
    """The goodput panels read the audit_queries SQL (one text with the 016 views), and say what
    `trainmedic audit goodput` says for the same window."""
    found = {p["title"]: p for _, p in panels() if p["title"] in GOODPUT_PANELS}
    assert set(found) == set(GOODPUT_PANELS)
    for title, kind in GOODPUT_PANELS.items():
        (target,) = found[title]["targets"]
        body = goodput_incidents_sql() if kind == "incidents" else goodput_jobs_sql()
        assert f"FROM ({body})" in target["rawSql"], f"{title}: not the goodput SQL of sinks/audit_queries.py"
    now = time.time()
    audited.client.command(f"USE {audited.database}")

    def run(title: str) -> list[dict[str, Any]]:
        sql = expand_grafana(found[title]["targets"][0]["rawSql"], {}, now - 6 * 3600, now + 60, 60)
        result = audited.client.query(sql)
        return [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]

    data = q.goodput(audited, since=timedelta(hours=6))
    jobs = {j["job_id"]: j for j in data["jobs"]}
    worst = run("Worst jobs by GPU-hours lost")
    assert [r["job_id"] for r in worst] == [j["job_id"] for j in data["jobs"] if j["incidents"]]
    for r in worst:
        assert r["gpu_hours_lost"] == round(jobs[r["job_id"]]["gpu_hours_lost"], 2)
    # Job 1: incident 0 ran again at the RUNNING report 15 s after attempt 2 began (t0 + 20), the
    # other two at their next attempt's start: 4 nodes x 8 GPUs x (20 + 5 + 5) s.
    assert worst[0]["job_id"] == "1" and worst[0]["gpu_hours_lost"] == round(32 * 30 / 3600, 2)
    (lowest,) = run("Lowest effective training time")
    assert lowest["job_id"] == "1" and lowest["effective_ratio"] == round(jobs["1"]["effective_ratio"], 3)
    assert lowest["effective_ratio"] == round(605 / 725, 3)  # attempt 1 productive; attempt 4 runs (unknown)
    lost = run("GPU-hours lost over time")
    assert sum(r["gpu_hours_lost"] for r in lost) == pytest.approx(data["fleet"]["gpu_hours_lost"])
