"""The dashboards: every ClickHouse panel query runs on chDB against the migrated audit schema,
shows the chosen cluster's rows only, no URL parameter can break out of its SQL, and every
metric the Prometheus dashboard reads is one trainmedic exports, filtered by cluster and instance.

Grafana does not run here; its two rewriting steps are reproduced instead:

1. Grafana (frontend) interpolates the dashboard's declared variables: `$name`, `${name}`,
   `${name:format}` and `[[name]]` become the variable's value, which a textbox, custom or
   query variable takes from the URL (`?var-name=...`, any value: scenes keeps one that is not
   among the options). The ClickHouse plugin formats a single value as it is (no quoting:
   CHDatasource.format), and Grafana's `singlequote` and `sqlstring` formats escape the quote
   but not the backslash, which ClickHouse's string literals honour: `\'` closes the literal.
   The audit dashboard's one value variable, `cluster`, therefore lands in SQL only as
   `${cluster:percentencode}` (RFC 3986 unreserved characters and %XX, nothing else) inside
   `decodeURLComponent('...')`. The SQL names no database: the plugin's connection uses the data
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
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from schemas.events import Event, JobAttempt, SchedEvent
from schemas.ids import DEFAULT_CLUSTER
from sinks import audit_queries as q
from sinks.audit import AuditStore
from tests.conftest import REPO, new_database_name
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
# Breaks out of a singlequote- or sqlstring-formatted literal in ClickHouse (the backslash escapes the quote).
BACKSLASH_HOSTILE = "\\') OR 1=1 --"
CLUSTER_VARIABLE = "cluster"
# The audit panels' cluster filter: every table read's WHERE starts with it.
CLUSTER_FILTER = "has(splitByChar(',', trim(BOTH '{}' FROM decodeURLComponent('${cluster:percentencode}'))), cluster)"
WEST = "gpu-west"


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


def _in_range(col: str, table: str) -> str:
    return f"SELECT {col} FROM {table} FINAL WHERE {CLUSTER_FILTER} AND $__timeFilter(event_time)"


def goodput_incidents_sql() -> str:
    child = f"{CLUSTER_FILTER} AND event_time >= $__fromTime"
    jobs = _in_range("job_id", "incidents")
    return q.incident_goodput_sql(
        where_i=f"{CLUSTER_FILTER} AND $__timeFilter(event_time)",
        where_r=f"{child} AND incident_id IN ({_in_range('incident_id', 'incidents')})",
        where_a=f"{child} AND job_id IN ({jobs})",
        where_s=f"{child} AND job_id IN ({jobs})",
    ).replace("{db}.", "")


def goodput_jobs_sql() -> str:
    jobs = _in_range("job_id", "incidents")
    attempted = _in_range("job_id", "job_attempts")
    return q.job_goodput_sql(
        where_a=f"{CLUSTER_FILTER} AND (job_id IN ({jobs}) OR job_id IN ({attempted}))",
        incidents=f"({goodput_incidents_sql()})",
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


_VARIABLE_REF = re.compile(r"\$\{(?P<braced>\w+)(?::(?P<format>\w+))?\}|\[\[(?P<old>\w+)\]\]|\$(?P<bare>\w+)")


def _ref_name(m: re.Match[str]) -> str:
    return m.group("braced") or m.group("old") or m.group("bare")


def _format(values: list[str], multi: bool, fmt: str | None) -> str:
    """Grafana's formatters (grafana/scenes, variables/interpolation/formatRegistry.ts) for the
    formats a panel may use; no format: the ClickHouse plugin's own (CHDatasource.format)."""
    if fmt == "percentencode":
        # encodeURIComponentStrict: everything but RFC 3986's unreserved characters as %XX.
        text = "{" + ",".join(values) + "}" if multi else values[0]
        return urllib.parse.quote(text, safe="")
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "sqlstring":
        return ",".join("'" + v.replace("'", "''").replace('"', '\\"') + "'" for v in values)
    assert fmt is None, f"a variable format this emulation does not know: {fmt}"
    return "'" + "','".join(values) + "'" if multi else values[0]


def interpolate(
    sql: str,
    declared: dict[str, dict[str, Any]],
    url: dict[str, str | list[str]],
    options: dict[str, list[str]] | None = None,
) -> str:
    """What Grafana's frontend makes of a panel's SQL: each reference to a declared variable
    becomes its formatted value, a URL `var-NAME` value (or values) first, else the saved current
    one; All (`$__all`) is every option a query variable found (`options`). A datasource variable
    is resolved to a data source, not text, and never lands in SQL. Undeclared names and `$__`
    macros are left alone."""

    def value(m: re.Match[str]) -> str:
        name = _ref_name(m)
        var = declared.get(name)
        if name.startswith("__") or var is None or var["type"] == "datasource":
            return m.group(0)
        given = url.get(f"var-{name}", var.get("current", {}).get("value", ""))
        values = given if isinstance(given, list) else [given]
        if values == ["$__all"]:
            values = (options or {}).get(name, [])
        multi = bool(var.get("multi")) or len(values) != 1
        return _format([str(v) for v in values], multi, m.group("format"))

    return _VARIABLE_REF.sub(value, sql)


def panel_sql(sql: str, path: Path, clusters: list[str], frm: float, to: float, interval_s: int = 60) -> str:
    """A panel's SQL as the plugin sends it with `clusters` chosen in the Cluster variable."""
    return expand_grafana(interpolate(sql, _variables(path), {"var-cluster": clusters}), {}, frm, to, interval_s)


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
        variables = _variables(path)
        assert list(variables) == [CH_VARIABLE, CLUSTER_VARIABLE]
        variable = variables[CH_VARIABLE]
        assert (variable["name"], variable["type"], variable["query"]) == (CH_VARIABLE, "datasource", PLUGIN)
        assert variable["current"]["value"] == DATASOURCE_UID
        # The cluster variable lists the audit's clusters through the same data source; All by default.
        cluster = variables[CLUSTER_VARIABLE]
        assert (cluster["type"], cluster["datasource"]) == ("query", CH_DATASOURCE)
        assert cluster["multi"] and cluster["includeAll"] and cluster["current"]["value"] == ["$__all"]
        assert "allValue" not in cluster  # All is the options themselves, never a raw text in SQL


def test_no_url_parameter_reaches_a_panels_sql(audited: AuditStore) -> None:
    """No URL value reaches a panel's SQL as SQL: the one value variable arrives percent-encoded
    inside a string literal, and the hostile values, run in chDB, select nothing."""
    # The old shape (a textbox `database` pasted into FROM) let `?var-database=` rewrite the
    # query; the interpolation below is the one that shows it.
    textbox = {"database": {"name": "database", "type": "textbox", "current": {"value": "trainmedic"}}}
    assert HOSTILE in interpolate("SELECT 1 FROM ${database}.x", textbox, {"var-database": HOSTILE})
    now = time.time()
    _use(audited)
    for path in CH_DASHBOARDS:
        declared = _variables(path)
        assert {n: v["type"] for n, v in declared.items()} == {CH_VARIABLE: "datasource", CLUSTER_VARIABLE: "query"}
        for _, p in panels([path]):
            for t in p["targets"]:
                sql = t["rawSql"]
                # The only reference: the cluster, percent-encoded, inside decodeURLComponent's literal.
                refs = {(_ref_name(m), m.group(0)) for m in _VARIABLE_REF.finditer(sql)}
                assert {r for r in refs if not r[0].startswith("__")} == {
                    (CLUSTER_VARIABLE, "${cluster:percentencode}")
                }, p["title"]
                assert sql.count("${cluster:percentencode}") == sql.count(
                    "decodeURLComponent('${cluster:percentencode}')"
                )
                for hostile in (HOSTILE, BACKSLASH_HOSTILE, "'", "\\"):
                    # Every variable a URL could set, and the old one, set to a hostile value.
                    url: dict[str, str | list[str]] = {f"var-{name}": hostile for name in [*declared, "database"]}
                    text = interpolate(sql, declared, url)
                    assert text.count("'") == sql.count("'") and text.count("\\") == sql.count("\\"), p["title"]
                    assert len(hostile) == 1 or hostile not in text, p["title"]
                    result = audited.client.query(expand_grafana(text, {}, now - 6 * 3600, now + 60, 60))
                    # No cluster is called that: counts of nothing, or no rows at all.
                    assert all(not any(v not in (0, None) for v in row) for row in result.result_rows), (
                        p["title"],
                        hostile,
                        result.result_rows,
                    )


def test_grafanas_quoting_formats_do_not_hold_in_clickhouse(audited: AuditStore) -> None:
    """Why the cluster is percent-encoded: Grafana's singlequote and sqlstring formats leave the
    backslash alone, and in ClickHouse a backslash escapes the closing quote, so a URL value ends
    the literal and adds its own condition. The same value, percent-encoded, matches nothing."""
    _use(audited)
    declared = {CLUSTER_VARIABLE: {"name": CLUSTER_VARIABLE, "type": "query", "multi": True}}
    url: dict[str, str | list[str]] = {"var-cluster": [BACKSLASH_HOSTILE]}
    for fmt in ("singlequote", "sqlstring"):
        sql = interpolate(f"SELECT count() FROM incidents FINAL WHERE cluster IN (${{cluster:{fmt}}})", declared, url)
        assert audited.client.query(sql).result_rows[0][0] > 0, (fmt, sql)  # every incident: injected
    safe = interpolate(f"SELECT count() FROM incidents FINAL WHERE {CLUSTER_FILTER}", declared, url)
    assert audited.client.query(safe).result_rows == [(0,)]
    chosen = interpolate(
        f"SELECT count() FROM incidents FINAL WHERE {CLUSTER_FILTER}", declared, {"var-cluster": [DEFAULT_CLUSTER]}
    )
    assert audited.client.query(chosen).result_rows[0][0] > 0


def test_provisioning_points_at_the_plugin_and_the_dashboards() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text())
    (source,) = ds["datasources"]
    assert (source["type"], source["uid"]) == (PLUGIN, DATASOURCE_UID)
    assert {"host", "port", "protocol", "username", "defaultDatabase"} <= set(source["jsonData"])
    # TLS to ClickHouse's HTTPS port, the server's certificate verified against the provisioned CA.
    tls = {k: source["jsonData"][k] for k in ("port", "protocol", "secure", "tlsSkipVerify", "tlsAuthWithCACert")}
    assert tls == {"port": 8443, "protocol": "http", "secure": True, "tlsSkipVerify": False, "tlsAuthWithCACert": True}
    assert source["secureJsonData"]["tlsCACert"] == "${TRAINMEDIC_CH_CA_CERT}"
    # Every value Grafana takes from its environment, and the plain-HTTP alternative, are documented.
    text = (GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text()
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "set all five" in comments and len(set(re.findall(r"\$\{(TRAINMEDIC_\w+)\}", text))) == 5
    assert "Plain HTTP instead" in comments and "port 8123, secure false" in comments
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


#: The audits' time: one for the module, so that both audits below hold the same rows of this cluster.
T0 = time.time() - 1800


def _seeded(chdb_url: str, events: list[Event]) -> Iterator[AuditStore]:
    store = AuditStore(chdb_url, new_database_name())
    store.migrate()
    insert_events(store, events)
    try:
        yield store
    finally:
        store.client.command("USE default")  # the chDB session outlives the store
        store.close()


def this_clusters_events(t0: float) -> list[Event]:
    events: list[Event] = []
    for n in range(3):
        events += incident_events(n, t0 + 60 * n, job="1", node="gpu01", detect_s=1.0 + n)
    events += incident_events(0, t0 + 30, job="2", node="gpu02", category="user_code", action="stop", status="failed")
    events += incident_events(1, t0 + 40, job="2", node="gpu03", category="interconnect", action="requeue")
    events += operator_events(t0, "1", 0, "gpu01")
    events += goodput_events(t0)
    return events


# Both audits are read only, seeded once per module and worker (they were seeded per test: 4.8 s each).
@pytest.fixture(scope="module")
def audited(chdb_url: str) -> Iterator[AuditStore]:
    """This cluster's rows alone."""
    yield from _seeded(chdb_url, this_clusters_events(T0))


@pytest.fixture(scope="module")
def audited_both(chdb_url: str) -> Iterator[AuditStore]:
    """The same rows of this cluster, and another cluster's beside them (`west_events`)."""
    yield from _seeded(chdb_url, this_clusters_events(T0) + west_events(T0))


def _use(store: AuditStore) -> AuditStore:
    # The plugin's connection is to the data source's default database: tables go unqualified.
    store.client.command(f"USE {store.database}")
    return store


def west_events(t0: float) -> list[Event]:
    """Another cluster's rows in the same tables, with the same job (1) and node (gpu01) names:
    two incidents, their operator events, a RUNNING report and an attempt of its own job 1."""
    events: list[Event] = incident_events(
        7, t0 + 10, job="1", node="gpu01", category="interconnect", detect_s=7.0, act_s=11.0
    )
    events += incident_events(8, t0 + 70, job="1", node="gpu01", action="stop", status="failed")
    events += operator_events(t0 + 5, "1", 7, "gpu01") + operator_events(t0 + 6, "1", 8, "gpu01")
    events.append(SchedEvent(event_id="sched-w-1-run", event_time=t0 + 12, kind="job", job_id="1", state="RUNNING"))
    events.append(
        JobAttempt(
            event_id="att-w-1-1",
            event_time=t0 + 80,
            lineage_id="lin-w-1",
            job_id="1",
            first_seen=t0 - 900,
            attempt=1,
            restart_count=0,
            started_at=t0 - 900,
            ended_at=t0 + 80,
            cause_incident_id="inc-1-8",
            progressed=True,
        )
    )
    return [e.model_copy(update={"cluster": WEST}) for e in events]


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


@pytest.mark.parametrize(
    "panel", [(path, p) for path in CH_DASHBOARDS for _, p in panels([path])], ids=lambda p: p[1]["title"]
)
def test_panel_query_runs_on_the_audit_schema(
    audited: AuditStore, audited_both: AuditStore, panel: tuple[Path, dict[str, Any]]
) -> None:
    path, p = panel
    now = time.time()
    frm, to = now - 6 * 3600, now + 60

    def rows(store: AuditStore, sql: str) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in _use(store).client.query(sql).result_rows]

    def bag(store: AuditStore, sql: str) -> list[tuple[Any, ...]]:
        # The rows as a multiset: rows a panel orders equal (one time bucket of several categories)
        # may come back in either order, which is not another cluster's doing.
        return sorted(rows(store, sql), key=repr)

    for target in p["targets"]:
        sql = panel_sql(target["rawSql"], path, [DEFAULT_CLUSTER], frm, to)
        result = _use(audited).client.query(sql)
        assert list(result.column_names) == EXPECTED_COLUMNS[p["title"]], sql
        assert result.result_rows, f"{p['title']}: no rows for data inside the time range\n{sql}"
        if target["format"] == 0:
            assert result.column_names[0] == "time"
            assert result.result_rows == sorted(result.result_rows, key=lambda r: r[0])
        alone = bag(audited, sql)
        # Another cluster's rows beside the same ones, with the same job and node names: the chosen
        # cluster's panel does not move, the other cluster's shows its own, and both together differ again.
        assert bag(audited_both, sql) == alone, f"{p['title']}: another cluster's rows changed it\n{sql}"
        west = bag(audited_both, panel_sql(target["rawSql"], path, [WEST], frm, to))
        assert west != alone, f"{p['title']}: the same for both clusters"
        both = bag(audited_both, panel_sql(target["rawSql"], path, [DEFAULT_CLUSTER, WEST], frm, to))
        assert both != alone or p["title"] in SAME_WITH_BOTH, f"{p['title']}: both clusters show one's rows"


# Panels whose rows may look the same with the other cluster added: LIMITed top lists led by this one.
SAME_WITH_BOTH: set[str] = set()


def test_the_cluster_variable_lists_the_audits_clusters(audited_both: AuditStore) -> None:
    audited = _use(audited_both)
    for path in CH_DASHBOARDS:
        variable = _variables(path)[CLUSTER_VARIABLE]
        assert variable["query"] == variable["definition"]
        found = [r[0] for r in audited.client.query(variable["query"]).result_rows]
        assert found == [DEFAULT_CLUSTER, WEST]
        # All: every listed cluster, the same rows as naming both.
        for _, p in panels([path]):
            for t in p["targets"]:
                every = interpolate(t["rawSql"], _variables(path), {}, {CLUSTER_VARIABLE: found})
                named = interpolate(t["rawSql"], _variables(path), {"var-cluster": found})
                assert every == named, p["title"]


def test_every_audit_table_read_is_filtered_by_the_cluster() -> None:
    for name, p in panels():
        for t in p["targets"]:
            sql = t["rawSql"]
            # Each read's own condition: up to the next SELECT (a subquery's) or the line's end.
            reads = re.findall(r"(?=FROM (\w+) FINAL\s+WHERE ((?:(?!SELECT )[^\n])*))", sql)
            assert reads and len(reads) == sql.count(" FINAL"), (name, p["title"])
            for table, where in reads:
                assert CLUSTER_FILTER in where, (p["title"], table, where)


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


# The service dashboard's own variables with All chosen (their allValue: any value, or none).
_SERVICE_VARIABLES = {"$cluster": ".*", "$instance": ".*"}


def promql(expr: str, variables: dict[str, str] = _SERVICE_VARIABLES) -> str:
    for name, value in {**_GRAFANA_INTERVALS, **variables}.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable this test does not know in {expr!r}"
    return expr


def test_every_service_panel_is_filtered_by_cluster_and_instance() -> None:
    variables = _variables(SERVICE_DASHBOARD)
    assert list(variables) == [PROM_VARIABLE, "cluster", "instance"]
    for name in ("cluster", "instance"):
        v = variables[name]
        assert (v["type"], v["datasource"]) == ("query", PROM_DATASOURCE)
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
        assert v["current"]["value"] == ["$__all"]
    # label_values over the build info every process exports; the instances of the chosen clusters.
    assert variables["cluster"]["query"] == "label_values(trainmedic_build_info, cluster)"
    assert variables["instance"]["query"] == 'label_values(trainmedic_build_info{cluster=~"$cluster"}, instance)'
    marks = {"$cluster": "CLUSTER_CHOSEN", "$instance": "INSTANCE_CHOSEN"}
    for _, p in panels(PROM_DASHBOARDS):
        for t in p["targets"]:
            selectors: list[Any] = []

            def visit(node: Any, found: list[Any] = selectors) -> None:
                if isinstance(node, promql_parser.VectorSelector):
                    found.append(node)

            promql_parser.walk(promql_parser.parse(promql(t["expr"], marks)), visit)  # type: ignore[no-untyped-call]
            assert selectors, p["title"]
            for sel in selectors:
                matchers = {(m.name, m.value) for m in sel.matchers.matchers if m.op == promql_parser.MatchOp.Re}
                assert {("cluster", "CLUSTER_CHOSEN"), ("instance", "INSTANCE_CHOSEN")} <= matchers, (
                    p["title"],
                    t["expr"],
                )


def test_service_dashboard_reads_only_metrics_trainmedic_exports() -> None:
    assert PROM_DASHBOARDS == [SERVICE_DASHBOARD]
    variable = _variables(SERVICE_DASHBOARD)[PROM_VARIABLE]
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


def test_goodput_panels_are_the_goodput_queries(audited_both: AuditStore) -> None:
    """The goodput panels read the audit_queries SQL (one text with the 016 views), and say what
    `trainmedic audit goodput` says for the same window."""
    found = {p["title"]: p for _, p in panels() if p["title"] in GOODPUT_PANELS}
    assert set(found) == set(GOODPUT_PANELS)
    for title, kind in GOODPUT_PANELS.items():
        (target,) = found[title]["targets"]
        body = goodput_incidents_sql() if kind == "incidents" else goodput_jobs_sql()
        assert f"FROM ({body})" in target["rawSql"], f"{title}: not the goodput SQL of sinks/audit_queries.py"
    now = time.time()
    # Another cluster's job 1 ran and stopped in the same window: neither side may count it.
    audited = _use(audited_both)
    dashboard = GRAFANA / "dashboards" / "trainmedic-audit.json"

    def run(title: str) -> list[dict[str, Any]]:
        sql = panel_sql(found[title]["targets"][0]["rawSql"], dashboard, [DEFAULT_CLUSTER], now - 6 * 3600, now + 60)
        result = audited.client.query(sql)
        return [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]

    data = q.goodput(audited, since=timedelta(hours=6), cluster=DEFAULT_CLUSTER)
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
