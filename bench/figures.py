"""The figures and verdicts of each benchmark's own report, for the common results format (bench/results.py).

One function per benchmark, named after it, from the report dict the benchmark writes (PREFIX.json)
to a Summary: parameters, figures (one number and its unit each, `where` saying which part of the
run), verdicts (each target or check). Pure functions of the report, so the converted reports of
earlier runs and new runs give the same figures, and tests can check a result's figures against its
own details. No project imports beyond bench/ (bench/fuzz.py loads this before instrumenting).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from bench.results import Label, Summary

PCT_OF_CORE = "% of a core"


def _pct(fraction: float | None) -> float | None:
    """A fraction (0.5804) as the percent figure (58.04)."""
    return None if fraction is None else round(100 * fraction, 2)


def _pctl(xs: list[float], q: float) -> float:
    """bench.pipeline.pctl: linear interpolation between the closest ranks."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(values: Iterable[float | None]) -> dict[str, float] | None:
    """p50 / p95 / max as bench.pipeline.dist rounds them; None for no values."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {
        "n": len(xs),
        "p50": round(_pctl(xs, 0.5), 3),
        "p95": round(_pctl(xs, 0.95), 3),
        "max": round(max(xs), 3),
        "mean": round(statistics.fmean(xs), 3),
    }


def _get(d: Mapping[str, Any] | None, *keys: str) -> Any:
    cur: Any = d
    for k in keys:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(k)
    return cur


def _machine_cpu(cpu_pct: Mapping[str, float]) -> float | None:
    """All processes of the run, in % of one core: the bench process, the broker, the workers, the rest."""
    workers = cpu_pct.get("workers")
    if workers is None:
        workers = sum(v for k, v in cpu_pct.items() if k == "worker" or k.startswith("worker-"))
    parts = [cpu_pct.get("main"), cpu_pct.get("broker"), workers, cpu_pct.get("other processes")]
    if any(p is None for p in parts[:2]):
        return None
    return round(sum(p for p in parts if p is not None), 1)


# --- the scale scenario: bench.pipeline's search and bench.scale_points -----------------------------------


def scale_row(s: Summary, row: Mapping[str, Any], **where: Label) -> None:
    """One scale point: a row of bench.pipeline's scale search or of bench.scale_points."""
    cpu = row.get("cpu_pct") or _get(row, "resources", "cpu_pct") or {}
    central = row.get("central_cpu_pct") or _get(row, "resources", "central_cpu_pct")
    s.verdict("sustained", bool(row.get("sustained")), str(row.get("why", "")), **where)
    s.figure("detection p50", _get(row, "detection_s", "p50"), "s", **where)
    s.figure("detection p95", _get(row, "detection_s", "p95"), "s", **where)
    s.figure("lag max", row.get("lag_max_s"), "s", **where)
    s.figure("input events", row.get("input_events_per_s"), "events/s", **where)
    s.figure(
        "GPUs per central core",
        row.get("gpus_per_central_core"),
        "GPUs/core",
        "GPUs / (streams workers + broker + sinks) CPU, in cores",
        **where,
    )
    s.figure("central pipeline CPU", central, PCT_OF_CORE, **where)
    workers = cpu.get("workers", cpu.get("worker"))
    s.figure("streams worker CPU", workers, PCT_OF_CORE, "all streams workers together", **where)
    s.figure("broker CPU", cpu.get("broker"), PCT_OF_CORE, **where)
    s.figure("simulator CPU", cpu.get("main/sim-cluster"), PCT_OF_CORE, **where)
    s.figure("all processes CPU", _machine_cpu(cpu) if cpu else None, PCT_OF_CORE, **where)


# --- the benchmarks ---------------------------------------------------------------------------------------


def pipeline(doc: Mapping[str, Any]) -> Summary:
    """bench.pipeline: the fault scenario (latency, accuracy, status quo) and the scale search."""
    m = doc["main"]
    c, ov = m["cluster"], m["overall"]
    scale = doc.get("scale") or {}
    s = Summary(
        parameters={
            "command": doc.get("command"),
            "quick": bool(doc.get("quick")),
            "nodes": c.get("nodes"),
            "gpus": c.get("gpus"),
            "jobs": c.get("jobs"),
            "transport": c.get("transport"),
            "seed": c.get("seed"),
            "gpu_summary_every_s": doc.get("gpu_summary_every_s"),
            "scale_nodes": [r["nodes"] for r in scale.get("rows", [])],
            "scale_seconds": scale.get("seconds"),
            "status_quo_assumptions": m.get("assumptions"),
        }
    )
    s.figure("faults injected", ov.get("injected"), "count")
    s.figure("faults detected", ov.get("detected"), "count")
    s.figure("detection p50", _get(ov, "detection_s", "p50"), "s", "first fault signal written -> incident published")
    s.figure("detection p95", _get(ov, "detection_s", "p95"), "s")
    detected = [o for o in m.get("outcomes", []) if o.get("detected")]
    explicit = [o for o in detected if o["kind"] not in ("hang", "straggler", "nccl_dead_rank")]
    silent = [o for o in detected if o not in explicit]
    for label, group in (("explicit faults", explicit), ("faults found by their effect", silent)):
        d = _dist(o.get("detection_s") for o in group)
        s.figure(f"detection p50, {label}", _get(d, "p50"), "s")
        s.figure(f"detection p95, {label}", _get(d, "p95"), "s")
    s.figure("action p50", _get(ov, "action_s", "p50"), "s", "incident -> effect verified")
    s.figure("action p95", _get(ov, "action_s", "p95"), "s")
    s.figure("running again p50", _get(ov, "running_again_s", "p50"), "s", "fault -> job running again")
    s.figure("category accuracy", _pct(ov.get("category_accuracy")), "%")
    s.figure("culprit accuracy", _pct(ov.get("culprit_accuracy")), "%")
    s.figure("action accuracy", _pct(ov.get("action_accuracy")), "%")
    s.figure("GPU-hours lost per fault p50", _get(ov, "gpu_h_per_fault", "p50"), "GPU-h")
    s.figure(
        "status quo detection p50", _get(ov, "baseline", "detect_s", "p50"), "s", "the same faults without trainmedic"
    )
    s.figure("status quo GPU-hours lost per fault p50", _get(ov, "baseline", "gpu_h_per_fault", "p50"), "GPU-h")
    s.figure("incidents on healthy jobs", len(m.get("false_incidents", [])), "count")
    s.figure("actions on healthy jobs", len(m.get("actions_on_healthy_jobs", [])), "count")
    s.figure("innocent nodes drained", len(m.get("innocent_drains", [])), "count")
    s.figure("lag max", _get(m, "lag", "max_s"), "s", "probe records, publish -> consumed")
    cpu = _get(m, "resources", "cpu_pct") or {}
    s.figure("streams worker CPU", cpu.get("worker"), PCT_OF_CORE)
    s.figure("broker CPU", cpu.get("broker"), PCT_OF_CORE)
    s.figure("input events", _get(m, "throughput", "input_events_per_s"), "events/s")
    for kind, k in (m.get("by_kind") or {}).items():
        s.figure("injected", k.get("injected"), "count", fault=kind)
        s.figure("detection p50", _get(k, "detection_s", "p50"), "s", fault=kind)
        s.figure("detection p95", _get(k, "detection_s", "p95"), "s", fault=kind)
        s.figure("action p50", _get(k, "action_s", "p50"), "s", fault=kind)
        s.figure("category accuracy", _pct(k.get("category_accuracy")), "%", fault=kind)
        s.figure("culprit accuracy", _pct(k.get("culprit_accuracy")), "%", fault=kind)
        s.figure("status quo detection p50", _get(k, "baseline", "detect_s", "p50"), "s", fault=kind)
    injected = ov.get("injected", 0) - (ov.get("skipped") or 0)
    s.verdict("every injected fault detected", ov.get("detected") == injected, f"{ov.get('detected')} of {injected}")
    s.verdict(
        "no incident or action on a healthy job",
        not m.get("false_incidents") and not m.get("actions_on_healthy_jobs"),
        f"{len(m.get('false_incidents', []))} incidents, {len(m.get('actions_on_healthy_jobs', []))} actions",
    )
    s.verdict("no innocent node drained", not m.get("innocent_drains"), f"{len(m.get('innocent_drains', []))} drained")
    for row in scale.get("rows", []):
        scale_row(s, row, nodes=row["nodes"])
    if scale.get("rows"):
        s.figure("largest sustained", scale.get("largest_sustained_nodes"), "nodes", "of the scale search")
        s.figure("first not sustained", scale.get("first_failing_nodes"), "nodes", "of the scale search")
    return s


def scale_points(doc: Mapping[str, Any]) -> Summary:
    """bench.scale_points: the invocation's parameters and one row per point, in the order given."""
    s = Summary(parameters={k: v for k, v in doc.items() if k != "rows"})
    for i, row in enumerate(doc.get("rows", []), 1):
        where: dict[str, Label] = {"point": i, "nodes": row["nodes"], "workers": row["workers"]}
        if row.get("gpu_summary_every_s"):
            where["summary_every_s"] = row["gpu_summary_every_s"]
        scale_row(s, row, **where)
    return s


def catchup(doc: Mapping[str, Any]) -> Summary:
    """bench.catchup: a preloaded backlog drained by 1, 2, ... workers."""
    pre = doc.get("preload") or {}
    s = Summary(
        parameters={"command": doc.get("command"), "quick": bool(doc.get("quick")), **(doc.get("config") or {})}
    )
    s.figure("backlog records", pre.get("total"), "count")
    s.figure("broker peak RSS", doc.get("broker_peak_rss_mb"), "MB")
    one = next((r for r in doc.get("runs", []) if r.get("workers") == 1 and r.get("events_per_s")), None)
    for r in doc.get("runs", []):
        w = r["workers"]
        s.verdict("drained", bool(r.get("drained")), r.get("error", "")[-300:] if r.get("error") else "", workers=w)
        incidents = sum((r.get("incidents") or {}).values())
        if "incidents" in r:
            s.verdict(
                "no incident on the healthy backlog",
                incidents == 0,
                ", ".join(f"{k} {v}" for k, v in r["incidents"].items()),
                workers=w,
            )
            s.figure("incidents", incidents, "count", "every one a false alarm: the backlog holds no fault", workers=w)
        s.figure("drain rate", r.get("events_per_s"), "events/s", workers=w)
        s.figure("drain time", r.get("drain_s"), "s", workers=w)
        s.figure("drain from the first record", r.get("drain_from_first_record_s"), "s", workers=w)
        if one and r.get("events_per_s"):
            s.figure("speed-up over 1 worker", round(r["events_per_s"] / one["events_per_s"], 2), "x", workers=w)
        s.figure("machine busy during drain", r.get("machine_busy_pct_during_drain"), "% of the machine", workers=w)
        s.figure("broker CPU during drain", _get(r, "broker", "cpu_pct_of_core_during_drain"), PCT_OF_CORE, workers=w)
        for pw in r.get("per_worker", []):
            at: dict[str, Label] = {"workers": w, "worker": pw["index"]}
            s.figure("drain rate", pw.get("events_per_s"), "events/s", **at)
            s.figure("CPU during drain", pw.get("cpu_pct_of_core_during_drain"), PCT_OF_CORE, **at)
            s.figure("gpu.samples partitions", len(_get(pw, "partitions", "gpu.samples") or []), "count", **at)
            s.figure("peak RSS", pw.get("peak_rss_mb"), "MB", **at)
    return s


_ACCURACY = (
    ("cases", "cases", "count"),
    ("category accuracy", "category_accuracy", "%"),
    ("action accuracy", "action_accuracy", "%"),
    ("culprit right where named", "culprit_named_correct", "count"),
    ("culprit named cases", "culprit_named_cases", "count"),
    ("actions on healthy logs", "false_actions_on_healthy", "count"),
    ("healthy cases", "healthy_cases", "count"),
    ("failures called healthy", "failures_called_healthy", "count"),
    ("failure cases", "failure_cases", "count"),
    ("verdict unknown", "diagnosed_unknown", "count"),
)


def _accuracy_summary(s: Summary, summary: Mapping[str, Any], **where: Label) -> None:
    for name, key, unit in _ACCURACY:
        value = summary.get(key)
        s.figure(name, _pct(value) if unit == "%" else value, unit, **where)


def accuracy(doc: Mapping[str, Any]) -> Summary:
    """bench.accuracy: each split, each collection batch of it, and dev's leave-one-source-out."""
    targets = doc.get("targets") or {}
    s = Summary(parameters={"split": doc.get("split"), "targets": targets})
    for split, res in (doc.get("splits") or {}).items():
        summary = res["summary"]
        _accuracy_summary(s, summary, split=split, subset="all")
        for key, target in targets.items():
            value = summary.get(key)
            if value is None:
                continue
            at_most = key in ("false_actions_on_healthy", "failures_called_healthy_rate")
            s.verdict(
                f"{key} {'<=' if at_most else '>='} {target}",
                value <= target if at_most else value >= target,
                f"{value}",
                split=split,
            )
        loso = _get(res, "leave_one_source_out", "summary")
        if loso:
            _accuracy_summary(s, loso, split=split, subset="leave-one-source-out")
        for batch, b in (res.get("batches") or {}).items():
            _accuracy_summary(s, b, split=split, subset=f"batch {batch}")
    return s


def audit(doc: Mapping[str, Any]) -> Summary:
    """bench.audit: operator and Grafana queries on the old and the new layout, at fleet scale."""
    s = Summary(
        parameters={
            k: doc.get(k) for k in ("scale", "sizes", "nodes", "days", "runs", "before_ref") if doc.get(k) is not None
        }
    )
    for layout in ("before", "after"):
        part = doc.get(layout) or {}
        for q, v in (part.get("queries") or {}).items():
            s.figure("p50", v.get("p50_s"), "s", layout=layout, query=q)
            s.figure("p95", v.get("p95_s"), "s", layout=layout, query=q)
        s.figure("ingest", part.get("ingest_rows_per_s"), "rows/s", "anomaly rows through the sink", layout=layout)
        for t, v in (part.get("tables") or {}).items():
            s.figure("bytes per row", v.get("bytes_per_row"), "B", layout=layout, table=t)
    for name, v in (doc.get("dedup") or {}).items():
        s.figure("p50", v.get("p50_s"), "s", read=name)
        s.figure("p95", v.get("p95_s"), "s", read=name)
    s.figure("migration", _get(doc, "migration", "seconds"), "s")
    after = _get(doc, "after", "queries") or {}
    if after:
        slowest = max(after, key=lambda q: after[q]["p95_s"])
        s.verdict(
            "every query p95 under 1 s (after)",
            after[slowest]["p95_s"] < 1.0,
            f"slowest: {slowest} {after[slowest]['p95_s']} s",
        )
    return s


def broker_history(doc: Mapping[str, Any]) -> Summary:
    """bench.broker_history: the embedded broker's CPU per fetch as its stored history grows."""
    f, soak = doc.get("fetch_cost") or {}, doc.get("soak") or {}
    s = Summary(parameters={"soak_partitions": soak.get("partitions"), "soak_rate": soak.get("rate")})
    s.figure("broker CPU per stored batch per fetch", f.get("us_per_stored_batch"), "us")
    s.figure("memory per stored batch", f.get("kb_per_stored_batch"), "KB")
    for r in f.get("rows", []):
        s.figure("broker CPU per fetch", r.get("broker_cpu_ms_per_fetch"), "ms", stored_batches=r["stored_batches"])
        s.figure("broker RSS", r.get("rss_mb"), "MB", stored_batches=r["stored_batches"])
    for r in soak.get("rows", []):
        at: dict[str, Label] = {"soak_t_s": r["t_s"]}
        s.figure("stored batches", r.get("stored_batches"), "count", **at)
        s.figure("broker CPU", r.get("broker_cpu_pct"), PCT_OF_CORE, **at)
        s.figure("produce -> read p95", r.get("delay_p95_ms"), "ms", **at)
        s.figure("broker RSS", r.get("rss_mb"), "MB", **at)
    return s


def detectors(doc: Mapping[str, Any]) -> Summary:
    """bench.detectors: the progress parser's and the hang and straggler detectors' throughput."""
    p, h, st = doc.get("parser") or {}, doc.get("hang") or {}, doc.get("straggler") or {}
    targets = doc.get("targets") or {}
    s = Summary(
        parameters={
            "lines_per_measurement": doc.get("lines_per_measurement"),
            "targets": targets,
            "hang_jobs": h.get("jobs"),
            "straggler_nodes": st.get("nodes"),
        }
    )
    for label, prefix in (("built-in", "builtin"), ("built-in + 2 custom", "with_2_custom_patterns")):
        s.figure(
            "progress lines",
            p.get(f"{prefix}_matching_lines_per_s"),
            "lines/s",
            detector="progress parser",
            patterns=label,
        )
        s.figure(
            "non-progress lines",
            p.get(f"{prefix}_non_matching_lines_per_s"),
            "lines/s",
            detector="progress parser",
            patterns=label,
        )
    s.figure("progress samples", h.get("progress_samples_per_s"), "samples/s", detector="hang")
    s.figure("GPU samples", h.get("gpu_samples_per_s"), "samples/s", detector="hang")
    s.figure("jobs checked", h.get("jobs_checked_per_s"), "jobs/s", detector="hang")
    s.figure("progress samples", st.get("progress_samples_per_s"), "samples/s", detector="straggler")
    s.figure("GPU samples", st.get("gpu_samples_per_s"), "samples/s", detector="straggler")
    s.figure(
        "check, full window",
        st.get("check_ms_full_window"),
        "ms",
        f"one {st.get('nodes')}-node job",
        detector="straggler",
    )
    s.figure("check, full window, 256 nodes", st.get("check_ms_full_window_256_nodes"), "ms", detector="straggler")
    target = targets.get("parser_non_matching_lines_per_s")
    value = p.get("builtin_non_matching_lines_per_s")
    if target is not None and value is not None:
        s.verdict(f"progress parser >= {target:,.0f} non-progress lines/s", value >= target, f"{value:,} lines/s")
    return s


def fuzz(doc: Mapping[str, Any]) -> Summary:
    """bench.fuzz: coverage-guided fuzzing of the log and kernel-line parsers."""
    s = Summary(
        parameters={"command": doc.get("command"), "atheris": doc.get("atheris"), **(doc.get("settings") or {})}
    )
    s.figure("findings", doc.get("findings"), "count")
    for name, t in (doc.get("targets") or {}).items():
        s.verdict("no finding", t.get("result") == "ok", str(t.get("result")), target=name)
        s.figure("runs", t.get("runs"), "count", target=name)
        s.figure("time", t.get("seconds"), "s", target=name)
        s.figure("executions", t.get("execs_per_s"), "execs/s", target=name)
        s.figure("coverage edges", t.get("coverage_edges"), "count", target=name)
        s.figure("features", t.get("features"), "count", target=name)
        s.figure("peak RSS", t.get("peak_rss_mb"), "MB", target=name)
    return s


def producers(doc: Mapping[str, Any]) -> Summary:
    """bench.producers: the GPU producers' CPU and memory, the job-log tailer's throughput."""
    targets = doc.get("targets") or {}
    s = Summary(
        parameters={
            "seconds": doc.get("seconds"),
            "interval_s": doc.get("interval_s"),
            "gpus": doc.get("gpus"),
            "tail_lines": doc.get("tail_lines"),
            "nvml_source": doc.get("nvml_source"),
            "targets": targets,
        }
    )
    for name, g in (doc.get("gpu_producers") or {}).items():
        s.figure(
            "CPU",
            g.get("cpu_pct_one_core"),
            PCT_OF_CORE,
            f"{g.get('gpus')} GPUs every {g.get('interval_s')} s",
            producer=name,
        )
        s.figure("RSS", g.get("rss_mb"), "MB", producer=name)
        s.figure("peak RSS", g.get("peak_rss_mb"), "MB", producer=name)
        s.figure("errors", g.get("errors"), "count", producer=name)
        s.verdict(
            f"CPU <= {targets.get('gpu_cpu_pct')} % of a core, RSS <= {targets.get('gpu_rss_mb')} MB",
            bool(g.get("meets_targets")),
            f"{g.get('cpu_pct_one_core')} %, {g.get('rss_mb')} MB",
            producer=name,
        )
    t = doc.get("tailer") or {}
    if t:
        s.figure("lines", t.get("lines_per_s"), "lines/s", "to the broker, acks=all", producer="job-log tailer")
        s.figure("undelivered", t.get("undelivered"), "count", producer="job-log tailer")
        s.verdict(
            f">= {targets.get('tailer_lines_per_s', 0):,.0f} lines/s",
            bool(t.get("meets_target")),
            f"{t.get('lines_per_s'):,} lines/s",
            producer="job-log tailer",
        )
    return s


def reliability(doc: Mapping[str, Any]) -> Summary:
    """bench.reliability: the fault-injection tests of tests/reliability/ and what each measured."""
    s = Summary(parameters={"outage_s": doc.get("outage_s")})
    s.verdict("every fault-injection test passed", bool(doc.get("passed")), str(doc.get("pytest", "")))
    s.figure("run time", doc.get("seconds"), "s")
    for r in doc.get("rows", []):
        at: dict[str, Label] = {"fault": r["fault"], "found_in": str(r.get("where", ""))}
        s.figure("events sent", r.get("sent"), "count", **at)
        s.figure("events found", r.get("landed"), "count", **at)
        s.figure("duplicates", r.get("duplicates"), "count", **at)
        s.figure("actions expected", r.get("actions_expected"), "count", **at)
        s.figure("actions taken", r.get("actions_taken"), "count", **at)
    return s


def repeat_faults(doc: Mapping[str, Any]) -> Summary:
    """bench.repeat_faults: GPU-hours lost to repeat faults with trainmedic and in the status quo."""
    s = Summary(
        parameters={
            "command": doc.get("command"),
            "limit": doc.get("limit"),
            "status_quo_assumptions": doc.get("status_quo_assumptions"),
        }
    )
    for name, ev in (doc.get("scenarios") or {}).items():
        if name == "predictive":
            _predictive(s, ev)
            continue
        tm, sq = ev["trainmedic"], ev.get("status_quo") or {}
        victim = (tm.get("jobs") or {}).get(tm.get("victim")) or {}
        for check, ok in (ev.get("checks") or {}).items():
            s.verdict(check.replace("_", " "), bool(ok), "", scenario=name)
        tc = ev.get("trainmedic_completed")
        if name == "bad_node":
            gpu_h: dict[str, float | None] = {"trainmedic": round(sum(j["gpu_h"] for j in tm["jobs"].values()), 2)}
        elif tc:
            gpu_h = {
                "trainmedic, then Slurm requeues": _get(tc, "auto", "gpu_h"),
                "trainmedic, then a person": _get(tc, "person", "gpu_h"),
            }
        else:
            gpu_h = {"trainmedic": victim.get("gpu_h")}
        for world, value in gpu_h.items():
            s.figure("GPU-hours lost", value, "GPU-h", scenario=name, world=world)
        s.figure("faults", victim.get("faults"), "count", "of the job hit first", scenario=name, world="trainmedic")
        s.figure("restarts", victim.get("restarts"), "count", "of the job hit first", scenario=name, world="trainmedic")
        detection = [d for d in tm.get("detection_s") or [] if d is not None]
        s.figure("first detection", detection[0] if detection else None, "s", scenario=name, world="trainmedic")
        for key, world in (("auto", "status quo: Slurm requeues"), ("person", "status quo: a person restarts")):
            q = sq.get(key) or {}
            s.figure("GPU-hours lost", q.get("gpu_h"), "GPU-h", scenario=name, world=world)
            s.figure("faults", q.get("faults"), "count", scenario=name, world=world)
            s.figure("restarts", q.get("restarts"), "count", scenario=name, world=world)
    return s


def _predictive(s: Summary, ev: Mapping[str, Any]) -> None:
    """bench.repeat_faults' predictive scenario (a model): reactive and migration side by side at the cited
    precisions for every lead time, and the break-even precision per lead time."""
    cited = {c["value"] for c in ev["parameters"]["precisions"].get("cited", [])}
    for check, ok in (ev.get("checks") or {}).items():
        s.verdict(check.replace("_", " "), bool(ok), "", scenario="predictive")
    points = ev.get("points") or []
    if points:
        s.figure("GPU-hours lost", points[0]["reactive_gpu_h"], "GPU-h", scenario="predictive", world="reactive")
    for pt in points:
        if pt["precision"] not in cited:
            continue
        at = {"lead_time_s": pt["lead_time_s"], "precision": pt["precision"]}
        s.figure("GPU-hours lost", pt["migration_gpu_h"], "GPU-h", scenario="predictive", world="migration", **at)
        s.figure(
            "needless drains", pt["needless_drain_node_h"], "node-h", scenario="predictive", world="migration", **at
        )
        s.figure("GPU-hours saved", pt["saved_gpu_h"], "GPU-h", scenario="predictive", world="migration", **at)
    for be in ev.get("break_even") or []:
        at = {"lead_time_s": be["lead_time_s"]}
        s.figure("break-even precision", be["break_even_precision"], "ratio", scenario="predictive", **at)
        s.figure(
            "break-even precision, drains counted",
            be["break_even_precision_with_drains"],
            "ratio",
            scenario="predictive",
            **at,
        )


def slurm_rpc(doc: Mapping[str, Any]) -> Summary:
    """bench.slurm_rpc: slurmctld RPCs of log discovery, extrapolated to 1,024 nodes."""
    s = Summary(parameters={"seconds": doc.get("seconds"), "counts": doc.get("counts")})
    for r in doc.get("results", []):
        for way, e in (r.get("extrapolated") or {}).items():
            at: dict[str, Label] = {"slurm": r["version"], "way": way}
            s.figure("RPCs per call", e.get("rpcs_per_call"), "RPCs", **at)
            s.figure("slurmctld time per call", e.get("ctld_ms_per_call"), "ms", **at)
            s.figure("RPCs at 1,024 nodes", e.get("rpcs_per_s"), "RPC/s", **at)
            s.figure("slurmctld busy at 1,024 nodes", e.get("ctld_busy_s_per_s"), "s/s", **at)
        errors = sum(x.get("errors", 0) for runs in (r.get("modes") or {}).values() for x in runs)
        s.verdict("no discovery call failed", errors == 0, f"{errors} errors", slurm=r["version"])
    return s
