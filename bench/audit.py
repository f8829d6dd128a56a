"""The audit trail at fleet scale, before and after the production layout, in one run.

    python -m bench.audit [--scale 0.1] [--runs 15] [--dir /tmp/bench-audit]

Builds a 90-day audit of a 5,000-node fleet on chDB with migrations 001-005 (the
old layout: ReplacingMergeTree ORDER BY id, Nullable keys, no partitions), times
the operator queries with the code as it was before (BEFORE_REF), applies the
layout migration (007: new tables, INSERT SELECT, EXCHANGE) to those same rows,
and times the same questions with the current code. At --scale 1: 10 M anomalies,
1 M incidents each with a decision, an action and a result (30 % recommendations
with a verdict, 2 % guardrail trips), 50 M scheduler events; 1 % of anomalies and
incidents are inserted twice (redelivery), so every read must deduplicate.

Rows are made by chDB itself (INSERT ... SELECT FROM numbers()), not Python loops.
Ingest rows/s is measured separately: 200,000 anomaly rows through the sink's own
insert path (clickhouse-connect, one batch per 2,000 rows as the sink batches) into
a fresh table of each layout. Writes bench/results/audit.{md,json} and the result in the common format,
bench/results/audit/<date>-<commit>.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import figures, results
from bench.machine import machine
from sinks.audit import DDL_DIR, TABLES, AuditStore
from sinks.audit_schema import LayoutSettings

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# The last commit with the old layout's queries, readiness and dashboard.
BEFORE_REF = "e6694e1"
FULL = {"anomalies": 10_000_000, "incidents": 1_000_000, "sched_events": 50_000_000}
NODES = 5000
DAYS = 90
DB = "bench"


def _old_module(path: str, name: str) -> ModuleType:
    """A module as it was at BEFORE_REF, loaded beside the current one."""
    src = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{BEFORE_REF}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(src, f"{BEFORE_REF}:{path}", "exec"), mod.__dict__)  # noqa: S102 - our own file at a pinned commit
    return mod


def _old_dashboard() -> dict[str, Any]:
    path = "infra/grafana/dashboards/trainmedic-audit.json"
    out = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{BEFORE_REF}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def _panels(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    stack = list(dash["panels"])
    while stack:
        p = stack.pop(0)
        stack.extend(p.get("panels", []))
        for t in p.get("targets", []):
            out.append((p["title"], t["rawSql"]))
    return out


# --- data ----------------------------------------------------------------------------


def _gen(store: AuditStore, sizes: dict[str, int], t_end: float, old: bool) -> dict[str, float]:
    """Fill the tables; return seconds per table. `old`: NULL for no job/node (the old layout's Nullable)."""
    span = DAYS * 86400.0
    t0 = t_end - span
    n_inc, n_anm, n_sch = sizes["incidents"], sizes["anomalies"], sizes["sched_events"]
    none = "NULL" if old else "''"
    # Attribution chose an action when the old layout was in use; incidents no longer carry one.
    recommended = "'drain_and_requeue'" if old else "''"
    per = max(1, n_anm // n_inc)  # anomalies per incident

    def ts(expr: str) -> str:
        return f"fromUnixTimestamp64Milli(toInt64(({expr}) * 1000), 'UTC')"

    inc_t = f"{t0} + number * {span / n_inc}"
    node = f"concat('node', toString(intHash32(number) % {NODES}))"
    job = "toString(100000 + intDiv(number, 5))"  # ~5 incidents per job, jobs local in time
    cat = "['gpu_hardware','interconnect','hang','storage','user_code','node','numerical','unknown'][1 + cityHash64(number, 7) % 8]"
    kind = "if(cityHash64(number, 3) % 10 < 7, 'action', 'recommendation')"
    stmts = {
        "incidents": f"""INSERT INTO {{db}}.incidents (incident_id, event_time, first_signal_time, job_id, partition,
            job_nodes, category, severity, culprit_node, culprit_rank, confidence, recommended_action, explanation,
            evidence, anomaly_ids, detection_latency_s, job_name, user, account)
            SELECT concat('inc-', toString(number)), {ts(inc_t)}, {ts(f"{inc_t} - 5 - intHash32(number) % 20")},
            {job}, concat('p', toString(cityHash64(number, 2) % 8)),
            arrayMap(k -> concat('node', toString((intHash32(number) + k) % {NODES})), range(4)),
            {cat}, 'critical', {node}, toInt32(intHash32(number) % 32), 0.9, {recommended},
            concat('Xid 79 on ', {node}, ': GPU has fallen off the bus'),
            concat('[{{"source":"kernel","signature":"xid_79","node":"', {node}, '","line":"NVRM: Xid (PCI:0000:1b:00): 79"}}]'),
            arrayMap(k -> concat('anm-', toString(number * {per} + k)), range({per})),
            5 + intHash32(number) % 20, 'train', 'alice', 'ml'
            FROM numbers({n_inc})""",
        "decisions": f"""INSERT INTO {{db}}.decisions (decision_id, event_time, incident_id, job_id, partition, category,
            culprit_node, action, mode, kind, rule, reason, first_signal_time, incident_time)
            SELECT concat('dec-', toString(number)), {ts(f"{inc_t} + 0.01")}, concat('inc-', toString(number)), {job},
            concat('p', toString(cityHash64(number, 2) % 8)), {cat}, {node}, 'drain_and_requeue',
            if({kind} = 'action', 'autonomous', 'monitor'), {kind}, 'actions.gpu_hardware', 'policy', {ts(inc_t)},
            {ts(inc_t)} FROM numbers({n_inc})""",
        "actions": f"""INSERT INTO {{db}}.actions (action_id, event_time, decision_id, incident_id, job_id, node,
            partition, action, reason, requested_by, incident_time)
            SELECT concat('act-', toString(number)), {ts(f"{inc_t} + 0.02")}, concat('dec-', toString(number)),
            concat('inc-', toString(number)), {job}, {node}, concat('p', toString(cityHash64(number, 2) % 8)),
            'drain_and_requeue', 'policy', 'policy', {ts(inc_t)} FROM numbers({n_inc}) WHERE {kind} = 'action'""",
        "action_results": f"""INSERT INTO {{db}}.action_results (action_id, event_time, incident_id, job_id, node,
            action, status, backend, steps, error, started_at, verified_at, incident_time, first_signal_time,
            action_latency_s)
            SELECT concat('act-', toString(number)), {ts(f"{inc_t} + 4")}, concat('inc-', toString(number)), {job},
            {node}, 'drain_and_requeue', if(number % 10 = 0, 'failed', 'done'), 'slurm',
            ['scontrol update nodename=x state=drain', 'scontrol requeue'], if(number % 10 = 0, 'timeout', NULL),
            {ts(f"{inc_t} + 0.03")}, if(number % 10 = 0, NULL, {ts(f"{inc_t} + 4")}), {ts(inc_t)},
            {ts(f"{inc_t} - 5")}, if(number % 10 = 0, NULL, 4.0) FROM numbers({n_inc}) WHERE {kind} = 'action'""",
        "approvals": f"""INSERT INTO {{db}}.approvals (approval_id, event_time, decision_id, incident_id, job_id,
            partition, category, action, verdict, reason, comment, operator)
            SELECT concat('apr-', toString(number)), {ts(f"{inc_t} + 600")}, concat('dec-', toString(number)),
            concat('inc-', toString(number)), {job}, concat('p', toString(cityHash64(number, 2) % 8)), {cat},
            'drain_and_requeue', if(number % 4 = 0, 'rejected', 'approved'), if(number % 4 = 0, 'wrong_node', NULL),
            '', 'bob' FROM numbers({n_inc}) WHERE {kind} = 'recommendation'""",
        "guardrail_trips": f"""INSERT INTO {{db}}.guardrail_trips (event_id, event_time, guardrail, action_id,
            incident_id, job_id, node, partition, action, detail)
            SELECT concat('grd-', toString(number)), {ts(f"{inc_t} + 0.03")}, 'blast_radius',
            concat('act-', toString(number)), concat('inc-', toString(number)), {job}, {node},
            concat('p', toString(cityHash64(number, 2) % 8)), 'drain_and_requeue', '3 drains in the window'
            FROM numbers({n_inc}) WHERE number % 50 = 7""",
        "anomalies": f"""INSERT INTO {{db}}.anomalies (event_id, event_time, produced_at, detector, signature,
            category, severity, role, source, job_id, node, rank, partition, line, meaning)
            SELECT concat('anm-', toString(number)), {ts(f"{t0} + intDiv(number, {per}) * {span / n_inc} - ({per} - number % {per})")},
            {ts(f"{t0} + intDiv(number, {per}) * {span / n_inc}")},
            if(number % {per} = 0, 'xid', 'signatures'), if(number % {per} = 0, 'xid_79', 'nccl_watchdog_timeout'),
            'gpu_hardware', 'critical', if(number % {per} = 0, 'root', 'collateral'),
            if(number % {per} = 0, 'kernel', 'joblog'),
            if(number % {per} = 0, {none}, toString(100000 + intDiv(intDiv(number, {per}), 5))),
            concat('node', toString(intHash32(intDiv(number, {per})) % {NODES})), toInt32(number % 32),
            concat('p', toString(cityHash64(intDiv(number, {per}), 2) % 8)),
            if(number % {per} = 0, 'NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, GPU has fallen off the bus.',
               concat('[rank', toString(number % 32), '] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=',
                      toString(number), ', OpType=ALLREDUCE, NumelIn=1048576) ran for 600000 milliseconds before timing out.')),
            'GPU fell off the bus' FROM numbers({n_anm})""",
        "sched_events": f"""INSERT INTO {{db}}.sched_events (event_id, event_time, kind, job_id, node, state,
            previous_state, nodes, partition, reason, flags, job_name, user, account)
            SELECT concat('sch-', toString(number)), {ts(f"{t0} + number * {span / n_sch}")},
            if(number % 5 = 0, 'node', 'job'),
            if(number % 5 = 0, {none}, toString(100000 + intHash32(number) % 200000)),
            if(number % 5 = 0, concat('node', toString(intHash32(number) % {NODES})), {none}),
            if(number % 5 = 0, if(number % 500 = 0, 'DRAINED', 'IDLE'), 'RUNNING'), 'ALLOCATED',
            if(number % 5 = 0, [], ['node1', 'node2']), concat('p', toString(cityHash64(number, 2) % 8)),
            if(number % 500 = 0, 'admin: bad dimm', NULL), if(number % 500 = 0, ['DRAIN'], []),
            'train', 'alice', 'ml' FROM numbers({n_sch})""",
    }
    took: dict[str, float] = {}
    for table, sql in stmts.items():
        t = time.perf_counter()
        store._command(sql.replace("{db}", store.database))
        took[table] = round(time.perf_counter() - t, 2)
    # Redelivery: 1 % of incidents and anomalies again, same ids and values.
    for table, n in (("incidents", n_inc), ("anomalies", n_anm)):
        dup = stmts[table].replace(f"FROM numbers({n})", f"FROM numbers({max(1, n // 100)})")
        store._command(dup.replace("{db}", store.database))
    return took


def _table_stats(store: AuditStore) -> dict[str, dict[str, float]]:
    rows = store.query(
        "SELECT table, sum(rows) AS rows, sum(bytes_on_disk) AS bytes, count() AS parts FROM system.parts "
        "WHERE database = {d:String} AND active GROUP BY table",
        {"d": store.database},
    )
    return {
        r["table"]: {
            "rows": int(r["rows"]),
            "bytes": int(r["bytes"]),
            "bytes_per_row": round(int(r["bytes"]) / max(1, int(r["rows"])), 1),
        }
        for r in rows
        if not r["table"].startswith(".")
    }


def _ingest(store: AuditStore, rows: int = 200_000) -> float:
    """Rows/s of anomaly rows through the sink's insert path (batches of 2,000) into the current layout."""
    _, table, _, declared = TABLES["anomalies"]
    # The old layout ("before") lacks the columns later migrations added (cluster): insert what it has.
    have = {
        r["name"]
        for r in store.query(
            "SELECT name FROM system.columns WHERE database = {d:String} AND table = {t:String}",
            {"d": store.database, "t": table},
        )
    }
    cols = [c for c in declared if c in have]
    side = f"{table}_ingest"
    store._command(f"DROP TABLE IF EXISTS {store.database}.{side}")
    store._command(f"CREATE TABLE {store.database}.{side} AS {store.database}.{table}")
    now = time.time()
    template = store.query(f"SELECT {', '.join(cols)} FROM {{db}}.{table} LIMIT 2000")
    batch = [[r[c] for c in cols] for r in template]
    t = time.perf_counter()
    done = 0
    while done < rows:
        for i, row in enumerate(batch):
            row[0] = f"ing-{done + i}-{now}"
        store.insert(side, batch, cols)
        done += len(batch)
    rate = done / (time.perf_counter() - t)
    store._command(f"DROP TABLE {store.database}.{side}")
    return round(rate)


# --- timing ---------------------------------------------------------------------------


def _time(fn: Callable[[int], Any], runs: int) -> dict[str, float]:
    fn(0)  # warm: the first read of a table pays for opening its parts
    took = []
    for i in range(runs):
        t = time.perf_counter()
        fn(i + 1)
        took.append(time.perf_counter() - t)
    took.sort()
    return {
        "p50_s": round(statistics.median(took), 4),
        "p95_s": round(took[min(len(took) - 1, int(round(0.95 * (len(took) - 1))))], 4),
    }


def _queries(
    store: AuditStore,
    q: ModuleType,
    readiness: ModuleType,
    dashboard: dict[str, Any],
    sizes: dict[str, int],
    t_end: float,
    runs: int,
) -> dict[str, dict[str, float]]:
    from streams.policy import load_policy
    from tests.integration.test_grafana import expand_grafana

    rng = random.Random(7)
    n_inc = sizes["incidents"]
    jobs = [str(100000 + rng.randrange(n_inc // 5)) for _ in range(runs + 1)]
    nodes = [f"node{rng.randrange(NODES)}" for _ in range(runs + 1)]
    policy = load_policy(None)
    out = {
        "audit job": _time(lambda i: q.job_timeline(store, jobs[i]), runs),
        "audit node": _time(lambda i: q.node_history(store, nodes[i]), runs),
        "audit incidents --since 24h": _time(lambda i: q.incidents(store, since=timedelta(hours=24), limit=100), runs),
        "audit latency": _time(lambda i: q.latency(store), runs),
        "readiness (30 d)": _time(
            lambda i: readiness.readiness(store, policy, since_s=t_end - 30 * 86400, now=t_end), max(3, runs // 3)
        ),
    }
    # The plugin's connection is to the data source's default database: panels name no database.
    # (The dashboard of an earlier revision, "before", still names it: ${database}.)
    store.client.command(f"USE {store.database}")
    for title, sql in _panels(dashboard):
        text = expand_grafana(sql, {"database": store.database}, t_end - 7 * 86400, t_end, 3600)
        out[f"grafana: {title} (7 d)"] = _time(functools.partial(_panel, store, text), runs)
    store.client.command("USE default")
    return out


def _panel(store: AuditStore, sql: str, _: int) -> Any:
    return store.client.query(sql).result_rows


def _param(store: AuditStore, sql: str, values: list[str], i: int) -> Any:
    return store.query(sql, {"v": values[i]})


def _dedup(store: AuditStore, runs: int, sizes: dict[str, int]) -> dict[str, dict[str, float]]:
    """FINAL against LIMIT 1 BY id for the reads the operator queries make, on the new layout."""
    rng = random.Random(11)
    nodes = [f"node{rng.randrange(NODES)}" for _ in range(runs + 1)]
    jobs = [str(100000 + rng.randrange(sizes["incidents"] // 5)) for _ in range(runs + 1)]
    day = "event_time >= now64(3) - INTERVAL 1 DAY"
    cases = {
        "anomalies of a node": ("anomalies", "node = {v:String}", "event_id", nodes),
        "anomalies of a job": ("anomalies", "job_id = {v:String}", "event_id", jobs),
        "incidents of the last day": ("incidents", day, "incident_id", jobs),
        "results of the last day": ("action_results", day, "action_id", jobs),
    }
    out = {}
    for name, (table, where, ident, values) in cases.items():
        final = f"SELECT count() AS n FROM {{db}}.{table} FINAL WHERE {where}"
        by_id = f"SELECT count() AS n FROM (SELECT * FROM {{db}}.{table} WHERE {where} LIMIT 1 BY {ident})"
        out[f"{name}: FINAL"] = _time(functools.partial(_param, store, final, values), runs)
        out[f"{name}: LIMIT 1 BY"] = _time(functools.partial(_param, store, by_id, values), runs)
    return out


def run(scale: float, runs: int, folder: Path) -> dict[str, Any]:
    sizes = {k: max(1000, int(v * scale)) for k, v in FULL.items()}
    t_end = time.time()
    store = AuditStore(f"chdb://{folder}", DB, LayoutSettings())
    old_q = _old_module("sinks/audit_queries.py", "bench_before_audit_queries")
    old_r = _old_module("trainmedic/ops/readiness.py", "bench_before_readiness")
    import sinks.audit_queries as new_q
    import trainmedic.ops.readiness as new_r

    new_dash = json.loads((REPO / "infra" / "grafana" / "dashboards" / "trainmedic-audit.json").read_text())
    with tempfile.TemporaryDirectory() as old_ddl:
        for f in sorted(DDL_DIR.glob("00[1-5]_*.sql")):
            (Path(old_ddl) / f.name).write_text(f.read_text())
        store.migrate(Path(old_ddl))
    print(f"generating {sizes} (old layout) ...", flush=True)
    t = time.perf_counter()
    gen = _gen(store, sizes, t_end, old=True)
    gen_s = time.perf_counter() - t
    total_rows = sum(v["rows"] for v in _table_stats(store).values())
    before: dict[str, Any] = {
        "tables": _table_stats(store),
        "generate_s": gen,
        "generate_rows_per_s": round(total_rows / gen_s),
        "ingest_rows_per_s": _ingest(store),
    }
    print("timing before ...", flush=True)
    before["queries"] = _queries(store, old_q, old_r, _old_dashboard(), sizes, t_end, runs)
    print("migrating ...", flush=True)
    t = time.perf_counter()
    applied = store.migrate()
    migrate_s = round(time.perf_counter() - t, 1)
    after: dict[str, Any] = {"tables": _table_stats(store), "ingest_rows_per_s": _ingest(store)}
    print("timing after ...", flush=True)
    after["queries"] = _queries(store, new_q, new_r, new_dash, sizes, t_end, runs)
    dedup = _dedup(store, runs, sizes)
    kept = {
        t: (before["tables"].get(t, {}).get("rows", 0), after["tables"].get(t, {}).get("rows", 0))
        for t in before["tables"]
    }
    store.close()
    return {
        "machine": machine(),
        "scale": scale,
        "sizes": sizes,
        "nodes": NODES,
        "days": DAYS,
        "runs": runs,
        "before_ref": BEFORE_REF,
        "migration": {"applied": [m.path.name for m in applied], "seconds": migrate_s, "rows_before_after": kept},
        "before": before,
        "after": after,
        "dedup": dedup,
    }


def _md(r: dict[str, Any]) -> str:
    s = r["sizes"]
    lines = [
        "# Audit trail at fleet scale: old layout (before) and production layout (after)",
        "",
        f"`python -m bench.audit --scale {r['scale']} --runs {r['runs']}` on {r['machine']['cores']} cores "
        f"({r['machine']['cpu']}), chDB. {r['days']} days of a {r['nodes']}-node fleet at scale {r['scale']}: "
        f"{s['anomalies']:,} anomalies, {s['incidents']:,} incidents (each with a decision; 70 % with an action "
        f"and a result, 30 % recommendations with a verdict; 2 % guardrail trips), {s['sched_events']:,} "
        "scheduler events; 1 % of anomalies and incidents delivered twice. Before: migrations 001-005 and the "
        f"code of commit {r['before_ref']}. After: {', '.join(r['migration']['applied'])} applied to the same "
        f"rows ({r['migration']['seconds']} s) and the current code. p50/p95 of {r['runs']} runs each "
        "(readiness: a third as many), a different job/node per run.",
        "",
        "| query | before p50 s | before p95 s | after p50 s | after p95 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, b in r["before"]["queries"].items():
        a = r["after"]["queries"].get(name, {})
        lines.append(f"| {name} | {b['p50_s']} | {b['p95_s']} | {a.get('p50_s', '-')} | {a.get('p95_s', '-')} |")
    lines += [
        "",
        "| table | rows before | rows after | bytes/row before | bytes/row after |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, b in sorted(r["before"]["tables"].items()):
        a = r["after"]["tables"].get(t, {})
        lines.append(
            f"| {t} | {b['rows']:,} | {a.get('rows', 0):,} | {b['bytes_per_row']} | {a.get('bytes_per_row', '-')} |"
        )
    lines += [
        "",
        f"Ingest through the sink's insert path (anomaly rows, batches of 2,000): before "
        f"{r['before']['ingest_rows_per_s']:,} rows/s, after {r['after']['ingest_rows_per_s']:,} rows/s. "
        f"Generation in chDB (INSERT SELECT, old layout): {r['before']['generate_rows_per_s']:,} rows/s.",
        "",
        "Rows after the migration count the 1 % redelivered duplicates as the old table held them until "
        "merges collapse them (fewer where merges already did); every read deduplicates. The copy also drops "
        "rows the new layout's TTL has expired: the first minutes of the 90-day span are past the 90-day raw "
        "TTL by the time the migration runs.",
        "",
        "## Deduplication: FINAL against LIMIT 1 BY id (after)",
        "",
        "| read | p50 s | p95 s |",
        "|---|---:|---:|",
    ]
    for name, v in r["dedup"].items():
        lines.append(f"| {name} | {v['p50_s']} | {v['p95_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the full size (1.0: 10 M anomalies ...)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=None, help="chDB folder (default: a temporary one, removed)")
    ap.add_argument("--out", type=Path, default=RESULTS / "audit")
    ap.add_argument("--render", action="store_true", help="only rewrite OUT.md from OUT.json")
    args = ap.parse_args()
    if args.render:
        args.out.with_suffix(".md").write_text(_md(json.loads(args.out.with_suffix(".json").read_text())))
        return
    started = results.now()
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        folder = args.dir or Path(tmp)
        result = run(args.scale, args.runs, folder)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_md(result))
    results.record(
        "audit",
        figures.audit(result),
        root=args.out.parent,
        started=started,
        machine=result["machine"],
        details=result,
        variant=results.variant_name(args.out.name, "audit"),
        report=args.out.with_suffix(".md"),
    )
    print(_md(result))


if __name__ == "__main__":
    main()
