"""`trainmedic audit ...` and `trainmedic audit db ...`: read the audit trail, manage its schema.

The queries live in sinks/audit_queries.py (plain dicts, shared with the
console); this module only opens the store and formats. Runs standalone too:
`python -m trainmedic.cli.audit incidents --since 7d`.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Optional, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from schemas.errors import ConfigError, NotFound, Unavailable
from schemas.ids import CLUSTER_RE, check_node_name
from schemas.printable import printable
from schemas.vocab import CATEGORIES
from sinks import audit_queries as q
from sinks.audit import AuditStore, ChdbFolderLocked, chdb_folder
from sinks.prediction_audit import DETECTION_S, migration_goodput
from trainmedic.cli.base import new_app, settings
from trainmedic.limits import bounded_since
from trainmedic.settings import audit_layout, clickhouse_dsn

audit_app = new_app(help="Query the audit trail: incidents, a job's timeline, a node's history, latency, exports.")
db_app = new_app(help="The audit database schema (migrations).")
audit_app.add_typer(db_app, name="db")


def _parse_since(value: str | timedelta) -> timedelta:
    if isinstance(value, timedelta):
        return value
    try:
        return bounded_since(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


DataDir = Annotated[
    Path,
    typer.Option(
        "--data-dir",
        help="trainmedic's data folder: the audit is chDB in DATA_DIR/chdb (`trainmedic up`: var, the demo: var/demo).",
    ),
]
ClickHouse = Annotated[
    Optional[str],
    typer.Option("--clickhouse", help="ClickHouse server URL (http://user:pw@host:8123) instead of chDB."),
]
Database = Annotated[str, typer.Option("--database", help="Audit database name.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
Since = Annotated[
    Optional[timedelta],
    typer.Option("--since", parser=_parse_since, metavar="DURATION", help="Only the last DURATION: 30m, 24h, 7d."),
]
ClusterOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cluster",
        metavar="NAME",
        help="Only this cluster's rows, where clusters share the database (default: the cluster setting).",
    ),
]
AllClusters = Annotated[bool, typer.Option("--all-clusters", help="Rows of every cluster in the database.")]


def _cluster(cluster: str | None, all_clusters: bool) -> str | None:
    """The cluster a query reads (None: every one): job ids and node names repeat across clusters."""
    if all_clusters:
        if cluster is not None:
            raise typer.BadParameter("give --cluster or --all-clusters, not both", param_hint="'--cluster'")
        return None
    name = cluster if cluster is not None else settings().cluster
    if not CLUSTER_RE.match(name):
        raise typer.BadParameter(
            f"{printable(name)!r}: a cluster name is lowercase letters, digits and -", param_hint="'--cluster'"
        )
    return name


def _for_cluster(scope: str | None) -> str:
    # An empty answer may be the wrong cluster (the default is this installation's own): say which was read.
    return "" if scope is None else f" for cluster {scope} (--cluster NAME, or --all-clusters)"


def open_store(data_dir: Path, clickhouse: str | None, database: str) -> AuditStore:
    """The audit store the options name; raises, saying what is wrong."""
    s = settings(clickhouse_url=clickhouse)
    clickhouse, layout = clickhouse_dsn(s), audit_layout(s)
    if clickhouse:
        url = clickhouse
    else:
        folder = (data_dir / "chdb").resolve()
        if not folder.is_dir():
            raise ConfigError(
                f"no audit at {folder}: nothing ran with --data-dir {data_dir} "
                "(`trainmedic up` writes var, `trainmedic demo` var/demo), or pass --clickhouse URL"
            )
        url = f"chdb://{folder}"
    try:
        return AuditStore(url, database, layout)
    except ChdbFolderLocked as exc:
        raise Unavailable(
            f"{exc}. Stop it first, or query a ClickHouse server with --clickhouse URL; "
            "queries through the running process are not available yet"
        ) from None


def audit_behind(data_dir: Path, timeout_s: float = 5.0) -> str | None:
    """What the `trainmedic up` running on DATA_DIR says of its audit's inserts (/api/health,
    `degraded.audit`: failing, so the audit lacks the events since); None when none runs there,
    it serves no API, does not answer, or its inserts succeed. Its health needs no token."""
    try:
        info = json.loads((data_dir / "runtime.json").read_text())
        url = str(info["api_url"]).rstrip("/") + "/api/health"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    from trainmedic.cli.client import ClientError, tls_context

    try:
        context = tls_context(settings().ca_bundle) if url.startswith("https:") else None
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            report = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503: a part is down; the body is the same report
        try:
            report = json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError, ClientError):
        return None
    problem = report.get("degraded", {}).get("audit") if isinstance(report, dict) else None
    return str(problem) if problem else None


@contextlib.contextmanager
def _store(data_dir: Path, clickhouse: str | None, database: str, check: bool = True) -> Iterator[AuditStore]:
    if check and (problem := audit_behind(data_dir)) is not None:
        # As the API answers (503): a listing now would lack every event since, and read as "nothing happened".
        raise Unavailable(f"the audit is behind (trainmedic up on {data_dir} says): {problem}")
    store = open_store(data_dir, clickhouse, database)
    # Imported once a store is open (clickhouse-connect is there then): the node image's CLI loads this module.
    from clickhouse_connect.driver.exceptions import ClickHouseError

    try:
        if check:
            q.check_schema(store)
        yield store
    except ClickHouseError as exc:
        raise Unavailable(f"{store.where}, database {database}: {exc}") from None
    finally:
        store.close()


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(q.jsonable(data), indent=2))


def _fmt(value: Any) -> str:
    """A value of the audit as one line of text: control characters escaped (schemas.printable), so
    a newline or ANSI escape in a record, even one written before names were checked, forges nothing."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple):
        return ",".join(_fmt(v) for v in value)
    return printable(value)


def _show(value: Any) -> str:
    """`_fmt`, for a line Rich reads markup in: a '[' of the value is text, not a style."""
    return escape(_fmt(value))


def _table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> Table:
    # Text cells: Rich reads no markup in them; _fmt escaped their control characters.
    table = Table(title=Text(printable(title)), title_justify="left")
    for _, header in columns:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(Text(_fmt(row.get(key))) for key, _ in columns))
    return table


_INCIDENT_COLUMNS = (
    ("detected_at", "detected (UTC)"),
    ("incident_id", "incident"),
    ("job_id", "job"),
    ("category", "category"),
    ("culprit_node", "culprit"),
    ("outcome", "decision -> outcome"),
    ("detection_latency_s", "detect s"),
    ("action_latency_s", "act s"),
)


def _with_outcome(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Incident rows plus one readable 'outcome' cell: what was decided and what came of it."""
    out = []
    for r in rows:
        decided = f"{r['decision_action'] or '?'} ({r['decision_kind'] or 'no decision'})"
        if r["actions_done"]:
            result = "done"
        elif r["actions_failed"]:
            result = "failed"
        elif r["guardrail_trips"]:
            result = "stopped by guardrail"
        elif r["verdict"]:
            result = str(r["verdict"])
        else:
            result = "pending" if r["decision_kind"] == "action" else "-"
        out.append({**r, "outcome": f"{decided} -> {result}"})
    return out


@audit_app.command()
def incidents(
    since: Since = timedelta(hours=24),
    category: Annotated[Optional[str], typer.Option(help=f"Only this category: {', '.join(CATEGORIES)}.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 100,
    cluster: ClusterOpt = None,
    all_clusters: AllClusters = False,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Incidents of the last --since (24h), newest first."""
    if category is not None and category not in CATEGORIES:
        raise typer.BadParameter(f"{category!r}: expected one of {', '.join(CATEGORIES)}", param_hint="'--category'")
    scope = _cluster(cluster, all_clusters)
    with _store(data_dir, clickhouse, database) as store:
        rows = q.incidents(store, since=since, category=category, limit=limit, cluster=scope)
    if as_json:
        _print_json(rows)
        return
    Console().print(_table(f"{len(rows)} incident(s)", _with_outcome(rows), _INCIDENT_COLUMNS))


@audit_app.command()
def incident(
    incident_id: Annotated[str, typer.Argument(metavar="ID", help="Incident id (inc-...).")],
    bundle: Annotated[
        Optional[Path],
        typer.Option(help="Write its evidence bundle to this FILE.tar.gz (docs/bundle.md) for the repair hand-off."),
    ] = None,
    bootstrap: Annotated[
        Optional[str],
        typer.Option(help="Kafka, for the GPU samples the topics still hold (default: the setting bootstrap)."),
    ] = None,
    window_s: Annotated[float, typer.Option(min=1.0, help="Seconds of evidence around the fault.")] = 300.0,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """One incident: what was found, decided and done - and with --bundle, its evidence bundle."""
    from trainmedic.ops.bundle import build_bundle, write_bundle

    address = settings(bootstrap=bootstrap).bootstrap
    with _store(data_dir, clickhouse, database) as store:
        built = build_bundle(store, incident_id, address or None, window_s=window_s)
    if bundle is not None:
        written = write_bundle(built, bundle)
        counts = ", ".join(f"{k} {v}" for k, v in built.counts().items())
        typer.echo(f"{written}: {counts}")
        for gap in built.gaps:
            typer.echo(f"  gap: {printable(gap)}")
        return
    if as_json:
        _print_json(built.manifest())
        return
    from trainmedic.ops.bundle import readme

    typer.echo(readme(built))


_ATTEMPT_COLUMNS = (
    ("lineage", "lineage"),
    ("attempt", "#"),
    ("restart_count", "Slurm restarts"),
    ("started_at", "started (UTC)"),
    ("ended", "ended"),
    ("cause", "ended by"),
    ("excluded", "excluded so far"),
    ("progress", "progress"),
)


def _attempt_rows(attempts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for a in attempts:
        verdict = {True: "made progress", False: "NO progress", None: "-"}[a["progressed"]]
        steps = f"step {_fmt(a['start_step'])} -> {_fmt(a['max_step'])}"
        ckpt = f", checkpoint after {_fmt(a['start_checkpoint'])}" if a["new_checkpoint"] else ""
        cause = a["cause_incident_id"]
        out.append(
            {
                "lineage": a["lineage_id"],
                "attempt": a["attempt"],
                "restart_count": a["restart_count"],
                "started_at": a["started_at"],
                "ended": f"{_fmt(a['ended_at'])} {a['end_reason'] or ''}".strip() if a["ended_at"] else "running",
                "cause": f"{cause} {a['cause_category']} on {_fmt(a['cause_node'])}" if cause else "-",
                "excluded": ",".join(a["excluded_nodes"]) or "-",
                "progress": f"{verdict} ({steps}{ckpt})",
            }
        )
    return out


def migration_line(m: dict[str, Any]) -> str:
    """A migration in one line: a pending one says what it waits for and until when."""
    where = f"{_show(m['node'])} GPU {_show(m['gpu'])} ({_show(m['rule'])})"
    before = m["checkpoint_before"]
    if m["state"] == "waiting":
        wanted = f"checkpoint {before + 1} or later" if before is not None else "its first completed checkpoint"
        return (
            f"migration {_show(m['migration_id'])}: PENDING - {where} drained, waiting for {wanted}, "
            f"deadline {_show(m['deadline'])} (cancel: trainmedic migrations cancel JOBID)"
        )
    return f"migration {_show(m['migration_id'])}: {_show(m['state'])} - {where}: {_show(m['detail'])}"


@audit_app.command()
def job(
    job_id: Annotated[str, typer.Argument(metavar="JOBID", help="Scheduler job id.")],
    cluster: ClusterOpt = None,
    all_clusters: AllClusters = False,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """A job's full timeline: anomalies, incident, decision, approvals, action, result, in time order."""
    scope = _cluster(cluster, all_clusters)
    with _store(data_dir, clickhouse, database) as store:
        data = q.job_timeline(store, job_id, cluster=scope)
    if not data["timeline"]:
        raise NotFound(f"job {job_id}: nothing in the audit database {database!r}{_for_cluster(scope)}")
    if as_json:
        _print_json(data)
        return
    console = Console()
    for inc in data["incidents"]:
        kind = "  (predicted)" if inc.get("kind") == "predicted" else ""
        console.print(
            f"[bold]{_show(inc['incident_id'])}[/]{kind}  {_show(inc['category'])}  culprit {_show(inc['culprit_node'])}  "
            f"decision {_show(inc['decision_action'])} ({_show(inc['decision_kind'])})  "
            f"detection {_show(inc['detection_latency_s'])} s  action {_show(inc['action_latency_s'])} s"
        )
    console.print(f"restarts by trainmedic: {_show(data['restarts'])}")
    if data["attempts"]:
        console.print(_table("attempts (lineage across restarts)", _attempt_rows(data["attempts"]), _ATTEMPT_COLUMNS))
    for m in data["migrations"]:
        console.print(migration_line(m))
    console.print(
        _table(
            f"job {job_id}: {len(data['timeline'])} event(s)",
            data["timeline"],
            (("time", "time (UTC)"), ("kind", "kind"), ("node", "node"), ("summary", "what")),
        )
    )


@audit_app.command()
def node(
    name: Annotated[str, typer.Argument(metavar="NODE", help="Node name.")],
    cluster: ClusterOpt = None,
    all_clusters: AllClusters = False,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """A node's history: incidents it was blamed for, actions taken on it, anomalies seen on it, returns to service."""
    check_node_name(name)  # exit 2 naming it, escaped: no node is called that
    scope = _cluster(cluster, all_clusters)
    with _store(data_dir, clickhouse, database) as store:
        data = q.node_history(store, name, cluster=scope)
    if not (data["incidents"] or data["events"] or data["anomalies"] or data["returns"]):
        raise NotFound(f"node {name}: nothing in the audit database {database!r}{_for_cluster(scope)}")
    if as_json:
        _print_json(data)
        return
    console = Console()
    console.print(
        f"[bold]{_show(name)}[/]: culprit of {_show(data['incidents_blamed'])} incident(s), "
        f"first {_show(data['first_seen'])}, last {_show(data['last_seen'])}"
    )
    console.print(_table("incidents", _with_outcome(data["incidents"]), _INCIDENT_COLUMNS))
    console.print(
        _table(
            "events on this node",
            data["events"],
            (("time", "time (UTC)"), ("kind", "kind"), ("job_id", "job"), ("summary", "what")),
        )
    )
    console.print(
        _table(
            "anomalies seen on this node",
            data["anomalies"],
            (("signature", "signature"), ("role", "role"), ("anomalies", "count"), ("last_seen", "last (UTC)")),
        )
    )
    console.print(
        _table(
            "returns to service (by an operator, or trainmedic-auto: the automatic path)",
            data["returns"],
            (
                ("time", "time (UTC)"),
                ("outcome", "outcome"),
                ("operator", "by"),
                ("incident_id", "drained for"),
                ("check_passed", "check passed"),
                ("detail", "why"),
            ),
        )
    )


@audit_app.command()
def latency(
    cluster: ClusterOpt = None,
    all_clusters: AllClusters = False,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """p50/p95/p99 of detection latency (first signal -> incident) and action latency (incident -> verified)."""
    scope = _cluster(cluster, all_clusters)
    with _store(data_dir, clickhouse, database) as store:
        data = q.latency(store, cluster=scope)
    if as_json:
        _print_json(data)
        return
    rows = ([data["overall"]] if data["overall"] else []) + data["by_category"]
    cols = [("category", "category"), ("incidents", "incidents")]
    cols += [(f"detection_{p}", f"detect {p}") for p in ("p50", "p95", "p99")]
    cols += [("actions_verified", "verified")] + [(f"action_{p}", f"act {p}") for p in ("p50", "p95", "p99")]
    Console().print(_table("latency, seconds", rows, cols))


def _span(window: timedelta) -> str:
    """A --since window as it was typed: 7d, 24h, 30m."""
    seconds = int(window.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _hours(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f} h"


# What an incident that charged no outage shows instead of a running-again time (lost_basis).
# 'within outage': it did not stop its job, which another incident's outage had stopped (charged_to).
_NOT_AN_OUTAGE = {
    "still down": "not running again",
    "job kept running": "job kept running",
    "within outage": "within outage (job already down)",
    "no job": "no job",
}


def _goodput_incident_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        basis = r["lost_basis"]
        if basis == "outage":
            again = f"{_fmt(r['running_again_at'])} ({r['running_again_from']})"
        else:
            again = _NOT_AN_OUTAGE.get(basis, basis)
        lost = "-" if r["gpu_hours_lost"] is None else f"{r['gpu_hours_lost']:.2f}"
        if r["charged_to"] is not None and r["charged_to"] != r["incident_id"]:
            lost += f" (outage of {r['charged_to']})"
        out.append({**r, "again": again, "lost": lost})
    return out


def _goodput_job_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        ratio = r["effective_ratio"]
        incidents = f"{r['incidents'] or 0}"
        notes = [
            f"{n} {what}"
            for n, what in (
                (r["incidents_not_running_again"], "not running again"),
                (r["incidents_kept_running"], "kept running"),
            )
            if n
        ]
        if notes:
            incidents += f" ({', '.join(notes)})"
        progress = "-"
        if r["attempts"]:
            progress = (
                f"{r['attempts_progressed']} progressed, {r['attempts_no_progress']} none, "
                f"{r['attempts_unknown']} unknown"
            )
        out.append(
            {
                **r,
                "incidents_text": incidents,
                "lost": f"{r['gpu_hours_lost']:.2f}",
                "wall": _hours(r["wall_s"]) + (" (running)" if r["attempts_running"] else ""),
                "productive": _hours(r["productive_s"]),
                "progress": progress,
                "ratio": "-" if ratio is None else f"{ratio:.1%}",
            }
        )
    return out


def _print_saved(console: Console, saved: dict[str, Any]) -> None:
    """Saved by migration, beside the GPU-hours lost (sinks/prediction_audit.py)."""
    console.print(
        f"saved by migration: {saved['gpu_hours_saved']:.1f} GPU-hours in {saved['migrations_requeued']} "
        "migration(s) requeued at a checkpoint (at least: the job's GPUs x (the work from the decision to the requeue + "
        f"{DETECTION_S:g} s detection)); predictive drains of predictions counted false: "
        f"{saved['false_drain_node_hours']:.1f} node-hours on {saved['false_predictions_drained']} node(s)"
    )
    if saved["migrations"]:
        console.print(
            _table(
                "migrations requeued at a checkpoint",
                [{**m, "saved": f"{m['gpu_hours_saved']:.2f}"} for m in saved["migrations"]],
                (
                    ("job_id", "job"),
                    ("node", "off node"),
                    ("rule", "rule"),
                    ("decided_at", "decided (UTC)"),
                    ("requeued_at", "requeued (UTC)"),
                    ("checkpoint_step", "at checkpoint"),
                    ("gpus", "GPUs"),
                    ("saved", "GPU-h saved"),
                ),
            )
        )


@audit_app.command()
def goodput(
    since: Since = timedelta(days=7),
    job: Annotated[Optional[str], typer.Option("--job", metavar="JOBID", help="Only this job.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many jobs and incidents listed.")] = 20,
    cluster: ClusterOpt = None,
    all_clusters: AllClusters = False,
    policy: Annotated[
        Optional[Path],
        typer.Option(help="Policy whose readiness.expire_after_h scores predictions (default: the built-in one)."),
    ] = None,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """GPU-hours lost per outage (fault -> running again, each outage once, only incidents that stopped
    their job), time to detect / act / recover, each job's effective training time across its
    restarts, and what checkpoint-aligned migrations saved (docs/audit.md, "Goodput")."""
    from streams.policy import load_policy

    scope = _cluster(cluster, all_clusters)
    window_s = load_policy(policy).readiness.expire_after_h * 3600
    with _store(data_dir, clickhouse, database) as store:
        data = q.goodput(store, since=since, job=job, limit=limit, cluster=scope)
        since_s = None if since is None else datetime.now().timestamp() - since.total_seconds()
        data["saved_by_migration"] = migration_goodput(store, since_s, window_s, scope, job=job)
    if as_json:
        _print_json(data)
        return
    f = data["fleet"]
    console = Console()
    who = f"job {_show(job)}" if job else "fleet"
    window = f"last {_span(since)}" if since is not None else "all time"
    gpn = data["assumptions"]["gpus_per_node"]
    console.print(
        f"[bold]goodput, {who}, {window}[/]: {f['incidents']} incident(s): {f['gpu_hours_lost']:.1f} GPU-hours lost "
        f"in {f['outages']} outage(s) (fault -> running again, overlapping ones merged and charged once, "
        f"{gpn} GPUs per node); {f['incidents_running_again']} running again, "
        f"{f['incidents_not_running_again']} not running again (no loss counted for those), "
        f"{f['incidents_kept_running']} did not stop their job (0)"
        + (
            f", {f['incidents_within_outage']} within another's outage (0, no recovery)"
            if f["incidents_within_outage"]
            else ""
        )
        + (f", {f['incidents_no_job']} without a job" if f["incidents_no_job"] else "")
    )
    _print_saved(console, data["saved_by_migration"])
    ratio = f["effective_ratio"]
    console.print(
        f"{f['jobs']} job(s), {f['restarts'] or 0} restart(s); effective training time "
        + (
            "- (no job reported progress)"
            if ratio is None
            else f"{ratio:.1%} ({f['jobs_with_ratio']} job(s) reporting progress)"
        )
    )
    stages = [
        {
            "stage": name,
            "mean": f[f"{key}_mean"],
            "p50": f[f"{key}_p50"],
            "p95": f[f"{key}_p95"],
        }
        for name, key in (
            ("detect (fault -> incident)", "time_to_detect"),
            ("act (incident -> action verified)", "time_to_act"),
            ("recover (fault -> running again)", "time_to_recover"),
        )
    ]
    console.print(
        _table("time to, seconds", stages, (("stage", "stage"), ("mean", "mean"), ("p50", "p50"), ("p95", "p95")))
    )
    console.print(
        _table(
            "jobs, most GPU-hours lost first",
            _goodput_job_rows(data["jobs"]),
            (
                ("job_id", "job"),
                ("attempts", "attempts"),
                ("restarts", "restarts"),
                ("incidents_text", "incidents"),
                ("lost", "GPU-h lost"),
                ("wall", "wall"),
                ("productive", "productive"),
                ("progress", "attempts' progress"),
                ("ratio", "effective"),
            ),
        )
    )
    console.print(
        _table(
            "incidents, newest first",
            _goodput_incident_rows(data["incidents"]),
            (
                ("incident_id", "incident"),
                ("job_id", "job"),
                ("category", "category"),
                ("culprit_node", "culprit"),
                ("gpus", "GPUs"),
                ("fault_at", "fault (UTC)"),
                ("time_to_detect_s", "detect s"),
                ("time_to_act_s", "act s"),
                ("time_to_recover_s", "recover s"),
                ("again", "running again (UTC)"),
                ("lost", "GPU-h lost"),
            ),
        )
    )


@audit_app.command()
def export(
    table: Annotated[str, typer.Option("--table", help="Table or view: " + ", ".join(sorted(q.RELATIONS)) + ".")],
    out: Annotated[Path, typer.Option("--out", help="File to write.")],
    fmt: Annotated[str, typer.Option("--format", help="csv (with a header row) or parquet.")] = "csv",
    since: Since = None,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Write a table or view (deduplicated) to CSV or Parquet."""
    if fmt not in q.EXPORT_FORMATS:
        raise typer.BadParameter(f"{fmt!r}: expected one of {', '.join(q.EXPORT_FORMATS)}", param_hint="'--format'")
    if table not in q.RELATIONS:
        raise typer.BadParameter(f"{table!r}: expected one of {', '.join(sorted(q.RELATIONS))}", param_hint="'--table'")
    if since is not None and q.RELATIONS[table] is None:
        raise typer.BadParameter(f"{table} has no time column to filter on", param_hint="'--since'")
    with _store(data_dir, clickhouse, database) as store:
        result = q.export(store, table, cast(q.ExportFormat, fmt), out, since=since)
    if as_json:
        _print_json(result)
        return
    typer.echo(f"exported {result['rows']} row(s) of {table} to {out} ({fmt}, {result['bytes']} bytes)")


@db_app.command()
def migrate(
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
) -> None:
    """Create or upgrade the audit schema (sinks/ddl/NNN_*.sql); running it again changes nothing."""
    if not clickhouse_dsn(settings(clickhouse_url=clickhouse)):
        (data_dir / "chdb").mkdir(parents=True, exist_ok=True)
    with _store(data_dir, clickhouse, database, check=False) as store:
        applied = store.migrate()
        where = chdb_folder(store.url) or store.where
    if applied:
        typer.echo(f"{database} in {where}: applied " + ", ".join(m.path.name for m in applied))
    else:
        typer.echo(f"{database} in {where}: up to date")


@db_app.command()
def status(
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Which migrations are applied and which are pending."""
    with _store(data_dir, clickhouse, database, check=False) as store:
        rows = store.migration_status()
    if as_json:
        _print_json(rows)
        return
    cols = (("version", "version"), ("name", "name"), ("state", "state"), ("applied_at", "applied (UTC)"))
    Console().print(_table(f"audit schema of {database}", rows, cols))


if __name__ == "__main__":
    audit_app(prog_name="trainmedic audit")
