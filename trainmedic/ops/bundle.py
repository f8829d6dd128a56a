"""An incident's evidence bundle: what a repair hand-off needs, in one .tar.gz.

`build_bundle` reads one incident from the audit trail (its row, decisions, approvals,
actions, results and guardrail trips), the log and kernel lines around it, the
scheduler's view of the culprit node and the job, and - from the broker, when one is
given - the GPU samples of the culprit node that the `gpu.samples` topic still retains
around the fault. Whatever could not be included is said in `Bundle.gaps`, one
sentence each (a source that did not answer, samples no longer retained, rows past
the audit's TTL, a section with nothing in it); one missing source never fails the
bundle. `write_bundle` writes it as a reproducible .tar.gz (docs/bundle.md).

Windows (seconds, around the incident): the audit reads cover
[first_signal_time - window_s, incident time + window_s]; the GPU samples cover
[first_signal_time - window_s, incident time + 60 s], on the samples' own time.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import math
import os
import re
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import KafkaException, TopicPartition

from bus.consume import group_consumer, read_records
from schemas.codec import DecodeError, decode
from schemas.errors import NotFound, Unavailable, UsageError
from schemas.events import GpuSample
from schemas.masking import mask
from schemas.printable import printable
from schemas.topics import GPU_SAMPLES
from sinks.audit import AuditStore
from sinks.audit_queries import CHILD_SKEW_S, jsonable

log = logging.getLogger("trainmedic.ops.bundle")

FORMAT = "trainmedic-incident-bundle"
FORMAT_VERSION = 1
SUFFIX = ".tar.gz"
GPU_AFTER_S = 60.0  # GPU samples are read up to this long after the incident was published
FILE_MODE = 0o644

# Archive members in order: name -> what it holds (the manifest says the same).
FILES: dict[str, str] = {
    "README.txt": "a summary for people: what happened, the culprit, what trainmedic did, what is missing",
    "manifest.json": "this list, row counts, the windows read and the gaps",
    "incident.json": "the incident row of the audit (evidence parsed from its JSON)",
    "decisions.json": "the incident's decisions, approvals, actions, action results and guardrail trips",
    "job_log.txt": "the job's log lines: the incident's job_log evidence and the job's anomalies in the window",
    "kernel.txt": "kernel lines: the incident's kernel evidence and the culprit node's kernel anomalies in the window",
    "scheduler.json": "the scheduler's events of the culprit node and of the job: the last one before the window and those in it",
    "gpu_samples.jsonl": "the culprit node's GPU samples retained on gpu.samples in the GPU window, one event per line",
}
DECISION_PARTS = ("decisions", "approvals", "actions", "action_results", "guardrail_trips")
SECTIONS = ("incident", *DECISION_PARTS, "job_log", "kernel", "scheduler", "gpu_samples")
# Which sections each member is made of (README.txt and manifest.json are made of all).
FILE_SECTIONS: dict[str, tuple[str, ...]] = {
    "incident.json": ("incident",),
    "decisions.json": DECISION_PARTS,
    "job_log.txt": ("job_log",),
    "kernel.txt": ("kernel",),
    "scheduler.json": ("scheduler",),
    "gpu_samples.jsonl": ("gpu_samples",),
}
LINE_COLUMNS = ("time", "node", "rank", "source", "signature", "role", "from", "line")

_TIME = "toDateTime64({%s:Float64}, 3, 'UTC')"
_TTL_DAYS = re.compile(r"toIntervalDay\((\d+)\)")


class BundleError(UsageError):
    """A bundle cannot be written as asked: a bad file name, or a file already there."""


def iso(t: float) -> str:
    """ISO 8601 UTC, as the audit's query results give times (sinks.audit_queries.jsonable)."""
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


@dataclass
class Bundle:
    """One incident's evidence. `sections` hold JSON-ready rows (times as ISO 8601 UTC), by SECTIONS name."""

    incident_id: str
    created_at: float
    cluster: str
    window: dict[str, str]  # audit_start/audit_end (audit reads), gpu_start/gpu_end (GPU samples)
    sections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)

    @property
    def incident(self) -> dict[str, Any]:
        return self.sections["incident"][0]

    def counts(self) -> dict[str, int]:
        return {name: len(self.sections.get(name, [])) for name in SECTIONS}

    def manifest(self) -> dict[str, Any]:
        counts = self.counts()
        inc = self.incident
        files = []
        for name, holds in FILES.items():
            entry: dict[str, Any] = {"name": name, "holds": holds}
            if name in FILE_SECTIONS:
                parts = FILE_SECTIONS[name]
                entry["rows"] = sum(counts[p] for p in parts)
                if len(parts) > 1:
                    entry["parts"] = {p: counts[p] for p in parts}
            files.append(entry)
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "incident_id": self.incident_id,
            "created_at": iso(self.created_at),
            "cluster": self.cluster,
            "job_id": inc.get("job_id") or None,
            "culprit_node": inc.get("culprit_node") or None,
            "category": inc.get("category"),
            "window": self.window,
            "files": files,
            "counts": counts,
            "gaps": list(self.gaps),
        }


# --- reading ------------------------------------------------------------------------


def _query(store: AuditStore, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = jsonable(store.query(sql, params))
    return out


def _ts(value: Any) -> float:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return float(value)


def _load_incident(store: AuditStore, incident_id: str) -> tuple[dict[str, Any], float, float]:
    """The incident row (JSON-ready, evidence parsed), its first signal and publication times."""
    rows = store.query(
        "SELECT * FROM {db}.incidents FINAL WHERE incident_id = {i:String} ORDER BY event_time DESC LIMIT 1",
        {"i": incident_id},
    )
    if not rows:
        raise NotFound(f"no incident {incident_id!r} in the audit database {store.database!r} ({store.where})")
    raw = rows[0]
    first, published = _ts(raw["first_signal_time"]), _ts(raw["event_time"])
    row: dict[str, Any] = jsonable(raw)
    with contextlib.suppress(orjson.JSONDecodeError):  # else kept as the stored text
        row["evidence"] = orjson.loads(row.get("evidence") or "[]")
    return row, first, published


def _evidence(incident: dict[str, Any], source: str, node: str | None = None) -> list[dict[str, Any]]:
    evidence = incident.get("evidence")
    if not isinstance(evidence, list):
        return []
    return [
        {
            "time": float(ev["time"]),
            "node": ev.get("node") or "",
            "rank": ev.get("rank"),
            "source": ev.get("source"),
            "signature": ev.get("signature"),
            "role": ev.get("role"),
            "from": "evidence",
            "line": ev.get("line", ""),
        }
        for ev in evidence
        if isinstance(ev, dict) and ev.get("source") == source and (node is None or ev.get("node") == node)
    ]


def _anomaly_lines(store: AuditStore, where: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    rows = store.query(
        "SELECT event_time, node, rank, source, signature, role, line, event_id, detector, severity, category, "
        f"job_id, meaning FROM {{db}}.anomalies FINAL WHERE {where} AND cluster = {{c:String}} "
        f"AND event_time >= {_TIME % 'start'} AND event_time <= {_TIME % 'end'} ORDER BY event_time, event_id",
        params,
    )
    out = []
    for r in rows:
        t = _ts(r.pop("event_time"))
        out.append({"time": t, **{k: r[k] for k in ("node", "rank", "source", "signature", "role")}, "from": "anomaly"})
        out[-1].update(jsonable(r))
    return out


def _merge_lines(evidence: list[dict[str, Any]], anomalies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evidence and anomaly rows in time order, times as ISO 8601; an evidence line that is
    also an anomaly row (same node and line, same millisecond) is one row, from "evidence+anomaly"."""
    out = list(anomalies)
    for ev in evidence:
        twin = next(
            (
                a
                for a in anomalies
                if a["from"] == "anomaly"
                and (a["node"] or "") == ev["node"]
                and a["line"] == ev["line"]
                and abs(a["time"] - ev["time"]) < 0.002
            ),
            None,
        )
        if twin is not None:
            twin["from"] = "evidence+anomaly"
        else:
            out.append(ev)
    out.sort(key=lambda r: (r["time"], r["node"] or "", r["line"]))
    return [{**r, "time": iso(r["time"])} for r in out]


def _ttl_days(store: AuditStore, table: str) -> int | None:
    """The TTL in days the audit table really has (None: none, or unknown)."""
    rows = store.query(
        "SELECT create_table_query FROM system.tables WHERE database = {d:String} AND name = {t:String}",
        {"d": store.database, "t": table},
    )
    m = _TTL_DAYS.search(rows[0]["create_table_query"]) if rows else None
    return int(m.group(1)) if m else None


def _expired(store: AuditStore, table: str, start: float, now: float) -> str | None:
    """A gap sentence when part of the window is older than the table's TTL."""
    with contextlib.suppress(Exception):
        days = _ttl_days(store, table)
        if days and start < now - days * 86400:
            return (
                f"{table}: rows older than {days} days are dropped (audit TTL): nothing before "
                f"{iso(now - days * 86400)} is kept; the window began {iso(start)}"
            )
    return None


def _scheduler(
    store: AuditStore, kind: str, column: str, value: str, cluster: str, start: float, end: float
) -> list[dict[str, Any]]:
    params = {"v": value, "c": cluster, "start": start, "end": end}
    where = f"kind = '{kind}' AND {column} = {{v:String}} AND cluster = {{c:String}}"
    before = _query(
        store,
        f"SELECT 'before' AS seen, * FROM {{db}}.sched_events FINAL WHERE {where} "
        f"AND event_time < {_TIME % 'start'} ORDER BY event_time DESC, event_id DESC LIMIT 1",
        params,
    )
    during = _query(
        store,
        f"SELECT 'window' AS seen, * FROM {{db}}.sched_events FINAL WHERE {where} "
        f"AND event_time >= {_TIME % 'start'} AND event_time <= {_TIME % 'end'} ORDER BY event_time, event_id",
        params,
    )
    return before + during


def _murmur2_partition(key: bytes, partitions: int) -> int | None:
    """Where the producers' murmur2 partitioner (bus/config.py) puts a key; None without aiokafka."""
    try:
        from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]
    except ImportError:
        return None
    return int((murmur2(key) & 0x7FFFFFFF) % partitions)


def _oldest_retained(bootstrap: str, topic: str, key: bytes, timeout_s: float) -> dict[str, Any] | None:
    """The oldest record still on the partition `key` goes to (all partitions when that cannot be known).

    {"partition", "low", "high", "time"}: `low` is the low watermark (records before it were
    deleted), `time` the oldest record's timestamp (None when the partition holds nothing).
    None when the topic is missing.
    """
    consumer = group_consumer(bootstrap, f"trainmedic-bundle-{uuid.uuid4().hex[:8]}", "trainmedic-bundle")
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s)
        if topic not in meta.topics or meta.topics[topic].error is not None:
            return None
        partitions = sorted(meta.topics[topic].partitions)
        own = _murmur2_partition(key, len(partitions))
        found: list[dict[str, Any]] = []
        for p in [own] if own is not None else partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            entry: dict[str, Any] = {"partition": p, "low": low, "high": high, "time": None}
            if low < high:
                consumer.assign([TopicPartition(topic, p, low)])
                deadline = time.monotonic() + timeout_s
                while entry["time"] is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"reading the oldest record of {topic} partition {p}")
                    msg = consumer.poll(0.5)
                    if msg is None or msg.error() is not None:
                        continue
                    ts_type, ts_ms = msg.timestamp()
                    entry["time"] = ts_ms / 1000.0 if ts_type and ts_ms > 0 else None
                    if entry["time"] is None:
                        break  # a record without a timestamp: its age is unknown
                consumer.unassign()
            found.append(entry)
        if own is not None:
            return found[0]
        # Unknown partition: the oldest record anywhere (nothing before it is retained at all).
        with_time = [e for e in found if e["time"] is not None]
        return min(with_time, key=lambda e: e["time"]) if with_time else found[0] if found else None
    finally:
        consumer.close()


def _gpu_samples(
    bootstrap: str, node: str, cluster: str, start: float, end: float, timeout_s: float, gaps: list[str]
) -> list[dict[str, Any]]:
    topic = GPU_SAMPLES.name
    oldest = _oldest_retained(bootstrap, topic, node.encode(), timeout_s)
    if oldest is None:
        gaps.append(f"{topic}: the topic is not on the broker {bootstrap}; no GPU sample was read")
        return []
    if oldest["time"] is not None and oldest["time"] > start:
        gone = (
            f"; the {oldest['low']} oldest records of partition {oldest['partition']} expired"
            if oldest["low"] > 0
            else "; it is the topic's first record, so older samples may never have been published"
        )
        gaps.append(
            f"{topic}: nothing before {iso(oldest['time'])} is retained (retention); "
            f"the window began {iso(start)}{gone}"
        )
    elif oldest["time"] is None and oldest["high"] > 0 and oldest["low"] >= oldest["high"]:
        gaps.append(
            f"{topic}: nothing of partition {oldest['partition']} (where {node}'s samples go) is retained "
            f"(retention: all {oldest['high']} records expired); the window began {iso(start)}"
        )
    samples: dict[str, GpuSample] = {}
    bad = 0
    needle = orjson.dumps(node)  # the node's name as every encoded sample of it holds it (schemas.codec)
    for _at, value in read_records(bootstrap, topic, start, timeout_s=timeout_s):
        if needle not in value:
            continue  # another node's sample, not worth decoding (the topic holds every node's)
        try:
            sample = decode(GpuSample, value)
        except DecodeError:
            bad += 1
            continue
        if sample.node == node and sample.cluster == cluster and start <= sample.event_time <= end:
            samples[sample.event_id] = sample  # a redelivered record once
    if bad:
        what = "1 record" if bad == 1 else f"{bad} records"
        gaps.append(f"{topic}: {what} naming {node} in the window could not be decoded and were skipped")
    ordered = sorted(samples.values(), key=lambda s: (s.event_time, s.event_id))
    return [s.model_dump(mode="json") for s in ordered]


def build_bundle(
    store: AuditStore,
    incident_id: str,
    bootstrap: str | None,
    *,
    window_s: float = 300.0,
    now: float | None = None,
    kafka_timeout_s: float = 30.0,
) -> Bundle:
    """Gather an incident's evidence; NotFound when the audit has no such incident.

    Each source that fails or holds nothing for the incident is a sentence in `gaps`;
    only the incident row itself is required.
    """
    if not (math.isfinite(window_s) and window_s > 0):
        raise UsageError(f"window_s={window_s!r}: expected a positive number of seconds")
    created = time.time() if now is None else now
    incident, first, published = _load_incident(store, incident_id)
    cluster = str(incident.get("cluster") or "default")
    job, node = incident.get("job_id") or "", incident.get("culprit_node") or ""
    start, end = first - window_s, published + window_s
    gpu_start, gpu_end = first - window_s, published + GPU_AFTER_S
    bundle = Bundle(
        incident_id=incident_id,
        created_at=created,
        cluster=cluster,
        window={"audit_start": iso(start), "audit_end": iso(end), "gpu_start": iso(gpu_start), "gpu_end": iso(gpu_end)},
        sections={name: [] for name in SECTIONS},
    )
    bundle.sections["incident"] = [incident]
    gaps = bundle.gaps
    failed: set[str] = set()  # sections whose source did not answer (each has its gap)

    def section(name: str, read: Callable[[], list[dict[str, Any]]]) -> None:
        try:
            bundle.sections[name] = read()
        except Exception as exc:  # one source missing never fails the bundle: it is a gap
            log.warning("bundle of %s: %s not read", incident_id, name, exc_info=True)
            failed.add(name)
            gaps.append(f"{name}: not read from the audit ({type(exc).__name__}: {exc})")

    def children(table: str) -> Callable[[], list[dict[str, Any]]]:
        # Every event of the incident: never earlier than it by more than the allowed clock skew.
        return lambda: _query(
            store,
            f"SELECT * FROM {{db}}.{table} FINAL WHERE incident_id = {{i:String}} "
            f"AND event_time >= toDateTime64({{t:Float64}} - {CHILD_SKEW_S}, 3, 'UTC') ORDER BY event_time",
            {"i": incident_id, "t": published},
        )

    for part in DECISION_PARTS:
        section(part, children(part))

    params = {"c": cluster, "start": start, "end": end}

    def job_log() -> list[dict[str, Any]]:
        own = _evidence(incident, "job_log")
        if not job:
            return _merge_lines(own, [])
        where = "job_id = {j:String} AND source != 'kernel'"
        return _merge_lines(own, _anomaly_lines(store, where, {**params, "j": job}))

    def kernel() -> list[dict[str, Any]]:
        if not node:
            return _merge_lines(_evidence(incident, "kernel"), [])
        where = "node = {n:String} AND source = 'kernel'"
        return _merge_lines(_evidence(incident, "kernel", node), _anomaly_lines(store, where, {**params, "n": node}))

    def scheduler() -> list[dict[str, Any]]:
        rows = _scheduler(store, "node", "node", node, cluster, start, end) if node else []
        return rows + (_scheduler(store, "job", "job_id", job, cluster, start, end) if job else [])

    section("job_log", job_log)
    section("kernel", kernel)
    section("scheduler", scheduler)

    gpu = GPU_SAMPLES.name
    if not node:
        failed.add("gpu_samples")
        gaps.append(f"{gpu}: the incident names no culprit node; no GPU sample was read")
    elif bootstrap is None:
        failed.add("gpu_samples")
        gaps.append(f"{gpu}: no broker was given (bootstrap); the GPU samples of {node} were not read")
    else:
        try:
            bundle.sections["gpu_samples"] = _gpu_samples(
                bootstrap, node, cluster, gpu_start, gpu_end, kafka_timeout_s, gaps
            )
        except (KafkaException, TimeoutError, Unavailable) as exc:
            failed.add("gpu_samples")
            gaps.append(
                f"{gpu}: the broker {bootstrap} could not be read ({type(exc).__name__}: {exc}); "
                f"the GPU samples of {node} were not read"
            )

    # Sections read that hold nothing are said too: the hand-off knows what it lacks.
    for table, name, what in (
        ("anomalies", "job_log", f"no log line of job {job}" if job else "no log line (the incident names no job)"),
        ("anomalies", "kernel", f"no kernel line of {node}" if node else "no kernel line (no culprit node named)"),
        ("sched_events", "scheduler", f"no scheduler event of {node or job or 'the incident'}"),
    ):
        if not bundle.sections[name] and name not in failed:
            ttl = _expired(store, table, start, created)
            gaps.append(f"{name}: {what} in the audit for the window" + (f" ({ttl})" if ttl else ""))
    sched = bundle.sections["scheduler"]
    if node and "scheduler" not in failed and sched and not any(r.get("kind") == "node" for r in sched):
        ttl = _expired(store, "sched_events", start, created)
        gaps.append(f"scheduler: no scheduler event of node {node} in the audit" + (f" ({ttl})" if ttl else ""))
    if node and "gpu_samples" not in failed and not bundle.sections["gpu_samples"]:
        gaps.append(f"{gpu}: no GPU sample of {node} in the window is on the topic")
    return bundle


# --- writing ------------------------------------------------------------------------


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n"


def _lines_text(title: str, rows: list[dict[str, Any]]) -> bytes:
    """Tab-separated, the line itself last and verbatim (split a row on the first 7 tabs)."""
    out = [f"# {title}", "# " + "\t".join(LINE_COLUMNS)]
    for r in rows:
        rank = "-" if r.get("rank") is None else str(r["rank"])
        fields = [
            r["time"],
            r.get("node") or "-",
            rank,
            *(str(r.get(c) or "-") for c in ("source", "signature", "role", "from")),
        ]
        out.append("\t".join([*fields, str(r.get("line") or "")]))
    if not rows:
        out.append("# (none)")
    return ("\n".join(out) + "\n").encode()


def _did(bundle: Bundle) -> list[str]:
    s = bundle.sections
    items: list[tuple[str, str]] = []
    for d in s["decisions"]:
        items.append(
            (
                d["event_time"],
                f"decision ({d.get('kind')}): {d.get('action')}, mode {d.get('mode')}, rule {d.get('rule')}: {d.get('reason')}",
            )
        )
    for a in s["approvals"]:
        items.append(
            (
                a["event_time"],
                f"{a.get('verdict')} {a.get('action')} by {a.get('operator')}"
                + (f" ({a['reason']})" if a.get("reason") else ""),
            )
        )
    for t in s["guardrail_trips"]:
        items.append((t["event_time"], f"guardrail {t.get('guardrail')} stopped {t.get('action')}: {t.get('detail')}"))
    for a in s["actions"]:
        items.append(
            (
                a["event_time"],
                f"action {a.get('action')} {a.get('node') or ''} requested by {a.get('requested_by')}: {a.get('reason')}",
            )
        )
    for r in s["action_results"]:
        steps = "; ".join(r.get("steps") or [])
        extra = f", verified {r['verified_at']}" if r.get("verified_at") else ""
        extra += f", error: {r['error']}" if r.get("error") else ""
        items.append((r["event_time"], f"result {r.get('status')}: {r.get('action')} ({steps}){extra}"))
    items.sort(key=lambda i: i[0])
    return [f"  {t}  {text}" for t, text in items] or ["  nothing recorded: no decision, action or result"]


def _node_view(bundle: Bundle, node: str) -> str:
    rows = [r for r in bundle.sections["scheduler"] if r.get("kind") == "node"]
    if not rows:
        return f"  {node}: no scheduler event in the audit"
    r = rows[-1]
    flags = ",".join(r.get("flags") or []) or "-"
    by = f" by {r['reason_user']}" if r.get("reason_user") else ""
    at = f" at {r['reason_time']}" if r.get("reason_time") else ""
    resv = f", reservation {r['reservation']}" if r.get("reservation") else ""
    return f"  {node} at {r['event_time']}: state {r.get('state')}, flags {flags}, reason {r.get('reason') or '-'}{by}{at}{resv}"


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _rows(n: int | None) -> str:
    return "" if n is None else f"{n} row" if n == 1 else f"{n} rows"


def readme(bundle: Bundle) -> str:
    inc, counts = bundle.incident, bundle.counts()
    node, job = inc.get("culprit_node") or "", inc.get("job_id") or ""
    who = ", ".join(f"{k} {inc[k]}" for k in ("job_name", "user", "account") if inc.get(k))
    rank = f" (rank {inc['culprit_rank']})" if inc.get("culprit_rank") is not None else ""
    manifest = bundle.manifest()
    flag = inc.get("isolate")
    isolate = "isolation not recorded" if flag is None else "isolate: yes" if flag else "isolate: no"
    lines = [
        f"trainmedic evidence bundle of incident {bundle.incident_id} (cluster {bundle.cluster})",
        f"made {iso(bundle.created_at)}",
        "",
        "WHAT HAPPENED",
        f"  first signal  {inc.get('first_signal_time')}",
        f"  detected      {inc.get('event_time')} (detection latency {inc.get('detection_latency_s')} s)",
        f"  job           {job or '-'}" + (f" ({who})" if who else "") + f", partition {inc.get('partition') or '-'}",
        f"  job nodes     {', '.join(inc.get('job_nodes') or []) or '-'}",
        f"  category      {inc.get('category')}, severity {inc.get('severity')}, confidence {_num(inc.get('confidence'))}",
        f"  culprit       {node or '(none named)'}{rank}; {isolate}",
        f"  explanation   {inc.get('explanation')}",
        "",
        "WHAT TRAINMEDIC DID",
        *_did(bundle),
        "",
        "THE SCHEDULER'S LAST VIEW OF THE CULPRIT NODE",
        _node_view(bundle, node) if node else "  no culprit node",
        "",
        f"WINDOWS  audit {bundle.window['audit_start']} .. {bundle.window['audit_end']}; "
        f"GPU samples {bundle.window['gpu_start']} .. {bundle.window['gpu_end']}",
        "",
        "FILES",
        *(f"  {f['name']:<18} {_rows(f.get('rows')):<9} {f['holds']}" for f in manifest["files"]),
        "",
        "WHAT IS MISSING",
        *([f"  - {g}" for g in bundle.gaps] or ["  nothing: every source answered and held rows for the incident"]),
        "",
        f"counts: {', '.join(f'{k} {v}' for k, v in counts.items())}",
    ]
    # Each line one line, on a terminal (`audit incident`) and in README.txt: a recorded value's
    # newline or ANSI escape is shown escaped (schemas.printable), never forging a line.
    return "\n".join(map(printable, lines)) + "\n"


def bundle_files(bundle: Bundle) -> dict[str, bytes]:
    """The archive's members, by name, in order."""
    s = bundle.sections
    files = {
        "README.txt": readme(bundle).encode(),
        "manifest.json": _json(bundle.manifest()),
        "incident.json": _json(bundle.incident),
        "decisions.json": _json({p: s[p] for p in DECISION_PARTS}),
        "job_log.txt": _lines_text(f"job {bundle.incident.get('job_id') or '-'}: log lines", s["job_log"]),
        "kernel.txt": _lines_text(f"node {bundle.incident.get('culprit_node') or '-'}: kernel lines", s["kernel"]),
        "scheduler.json": _json(s["scheduler"]),
        "gpu_samples.jsonl": b"".join(orjson.dumps(r) + b"\n" for r in s["gpu_samples"]),
    }
    assert list(files) == list(FILES)
    # The last line of defence: a gap or a row may quote an exception that echoed a DSN or a token.
    return {name: mask(data.decode()).encode() for name, data in files.items()}


def bundle_bytes(bundle: Bundle) -> bytes:
    """The .tar.gz as bytes (for an HTTP response). Members: mode 0644, owner 0, mtime = created_at."""
    mtime = int(bundle.created_at)
    buf = io.BytesIO()
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=mtime) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for name, data in bundle_files(bundle).items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, FILE_MODE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_bundle(bundle: Bundle, path: Path, *, overwrite: bool = False) -> Path:
    """Write the bundle to `path` (.tar.gz) atomically; refuses an existing file unless `overwrite`."""
    path = Path(path)
    if not path.name.endswith(SUFFIX) or path.name == SUFFIX:
        raise BundleError(f"{path}: a bundle is a gzip'd tar; name the file *{SUFFIX}")
    if path.exists() and not overwrite:
        raise BundleError(f"{path} exists: not overwritten (remove it, or choose another name)")
    if path.is_dir():
        raise BundleError(f"{path} is a directory")
    data = bundle_bytes(bundle)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if the name appeared meanwhile: never clobbers
            except FileExistsError:
                raise BundleError(f"{path} exists: not overwritten (remove it, or choose another name)") from None
            except OSError:
                os.replace(tmp, path)  # a filesystem without hard links: the check above stands
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path
