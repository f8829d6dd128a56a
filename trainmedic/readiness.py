"""Autonomy readiness: score monitor-mode recommendations from the audit trail.

Each recommendation's fate is one of:
  approved / rejected   an operator answered it (trainmedic approve / reject, console);
  confirmed             a label after the fact (trainmedic label ... confirmed), or the
                        facts confirmed it: the same job failed again on the same culprit
                        node within `expire_after_h`;
  expired               nobody answered within `expire_after_h`;
  open                  still waiting.
Precision = (approved + confirmed) / decided, decided = approved + rejected + confirmed.
Misses are faults people found before us: nodes drained by someone else (a Slurm
node event with DRAIN whose reason is not ours) with no incident of ours on that
node in the hour before. Planned maintenance is no miss: a node in an active
MAINT reservation (the Slurm producer flags it MAINTENANCE), or a drain reason
matching the maintenance patterns (shell globs, case-insensitive; the policy's
``readiness.maintenance_reasons``). One drain (node, reason) counts once, however
many node events it makes while it lasts.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from schemas.vocab import CATEGORIES, NEVER_ACTS
from sinks.audit import AuditStore
from sinks.audit_queries import CHILD_SKEW_S, summary_sql
from streams.policy import Policy, ReadinessSettings

MISS_LOOKBACK_S = 3600.0
#: Drain reasons of planned work, not faults: the policy's default.
DEFAULT_MAINTENANCE_REASONS = tuple(ReadinessSettings().maintenance_reasons)


def maintenance_reasons(policy: Policy) -> tuple[str, ...]:
    return tuple(policy.readiness.maintenance_reasons)


def glob_regex(pattern: str) -> str:
    """A shell glob (* and ?) as an anchored RE2 regex of the lower-cased glob, for ClickHouse match()."""
    out = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return f"^{out}$"


@dataclass
class Score:
    category: str
    partition: str | None  # None: every partition together
    recommendations: int = 0
    approved: int = 0
    rejected: int = 0
    confirmed: int = 0
    expired: int = 0
    open: int = 0
    misses: int = 0
    detection_p50_s: float | None = None
    action_p50_s: float | None = None
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    verdict: str = "not_yet"  # ready | not_yet | never
    missing: list[str] = field(default_factory=list)

    @property
    def decided(self) -> int:
        return self.approved + self.rejected + self.confirmed

    @property
    def precision(self) -> float | None:
        return (self.approved + self.confirmed) / self.decided if self.decided else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decided": self.decided, "precision": self.precision}

    def summary(self) -> str:
        p = "-" if self.precision is None else f"{self.precision:.0%}"
        why = f" ({'; '.join(self.missing)})" if self.missing else ""
        return f"{self.verdict}{why}: {self.decided} decided, precision {p}"


def _epoch(v: Any) -> float:
    return float(v.timestamp()) if hasattr(v, "timestamp") else float(v)


# Incidents whose decision was a recommendation, from the window's decisions (time sort key).
_RECOMMENDED = (
    "incident_id IN (SELECT incident_id FROM {db}.decisions FINAL WHERE kind = 'recommendation' "
    f"AND event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000}))"
)


def _recommendations(store: AuditStore, since_s: float) -> list[dict[str, Any]]:
    # The incident summary of the window's recommendations only, not the whole view.
    since = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}}) AND {_RECOMMENDED}"
    child = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000})"
    return store.query(
        "SELECT incident_id, detected_at, job_id, partition, category, culprit_node, detection_latency_s, "
        f"action_latency_s, verdict FROM ({summary_sql(since, child)}) WHERE decision_kind = 'recommendation'",
        {"t": int(since_s * 1000)},
    )


def _reject_reasons(store: AuditStore, since_s: float) -> dict[str, str]:
    rows = store.query(
        "SELECT incident_id, argMax(reason, event_time) AS reason FROM {db}.approvals FINAL "
        "WHERE verdict = 'rejected' AND event_time >= fromUnixTimestamp64Milli({t:Int64}) GROUP BY incident_id",
        {"t": int(since_s * 1000)},
    )
    return {r["incident_id"]: r["reason"] or "other" for r in rows}


def _confirmations(store: AuditStore, recs: list[dict[str, Any]], window_s: float) -> set[str]:
    """Recommendations the facts confirmed: a later incident of the same job on the same culprit."""
    if not recs:
        return set()
    # One join in ClickHouse over the window's incidents, instead of every incident into Python.
    window = "event_time >= fromUnixTimestamp64Milli({t:Int64}) AND job_id != '' AND culprit_node != ''"
    rows = store.query(
        "SELECT DISTINCT r.incident_id AS incident_id FROM ("
        "SELECT incident_id, job_id, culprit_node, toUnixTimestamp64Milli(event_time) AS ms "
        f"FROM {{db}}.incidents FINAL WHERE {window} AND {_RECOMMENDED}) AS r "
        f"INNER JOIN (SELECT job_id, culprit_node, toUnixTimestamp64Milli(event_time) AS ms "
        f"FROM {{db}}.incidents FINAL WHERE {window}) AS l "
        "ON l.job_id = r.job_id AND l.culprit_node = r.culprit_node "
        "WHERE l.ms > r.ms AND l.ms <= r.ms + {w:Int64}",
        {"t": int(min(_epoch(r["detected_at"]) for r in recs) * 1000), "w": int(window_s * 1000)},
    )
    return {r["incident_id"] for r in rows} & {r["incident_id"] for r in recs}


def _misses(
    store: AuditStore, since_s: float, patterns: tuple[str, ...] = DEFAULT_MAINTENANCE_REASONS
) -> dict[str | None, int]:
    """Drains by someone else, not planned maintenance, with no incident of ours on that node
    shortly before, per partition."""
    # ASOF JOIN: each drain meets the latest incident of ours on its node at or before it;
    # none (0), or one older than the look-back, makes it a miss. All in ClickHouse.
    rows = store.query(
        "SELECT d.partition AS partition, countIf(o.ms = 0 OR o.ms < d.ms - {look:Int64}) AS misses FROM ("
        "SELECT node, partition, min(toUnixTimestamp64Milli(event_time)) AS ms FROM {db}.sched_events FINAL "
        "WHERE kind = 'node' AND has(flags, 'DRAIN') AND event_time >= fromUnixTimestamp64Milli({t:Int64}) "
        "AND NOT startsWith(ifNull(reason, ''), 'trainmedic ') AND NOT has(flags, 'MAINTENANCE') "
        "AND NOT arrayExists(p -> match(lower(ifNull(reason, '')), p), {maint:Array(String)}) "
        "GROUP BY node, partition, ifNull(reason, '')) AS d "
        "ASOF LEFT JOIN (SELECT culprit_node, toUnixTimestamp64Milli(event_time) AS ms FROM {db}.incidents FINAL "
        "WHERE culprit_node != '' AND event_time >= fromUnixTimestamp64Milli({t:Int64} - {look:Int64})) AS o "
        "ON d.node = o.culprit_node AND d.ms >= o.ms GROUP BY partition SETTINGS join_use_nulls = 0",
        {"t": int(since_s * 1000), "look": int(MISS_LOOKBACK_S * 1000), "maint": [glob_regex(p) for p in patterns]},
    )
    return {(r["partition"] or None): int(r["misses"]) for r in rows if r["misses"]}


def readiness(store: AuditStore, policy: Policy, since_s: float, now: float | None = None) -> list[Score]:
    """One Score per (category, None) and per (category, partition) seen, for every category."""
    now = time.time() if now is None else now
    settings = policy.readiness
    recs = _recommendations(store, since_s)
    reasons = _reject_reasons(store, since_s)
    confirmed = _confirmations(store, recs, settings.expire_after_h * 3600)
    scores: dict[tuple[str, str | None], Score] = {}
    latencies: dict[tuple[str, str | None], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))

    def score(category: str, partition: str | None) -> Score:
        return scores.setdefault((category, partition), Score(category, partition))

    for c in CATEGORIES:
        if c not in NEVER_ACTS:  # healthy and unknown never act: no autonomy to earn
            score(c, None)
    for r in recs:
        keys = [(r["category"], None)] + ([(r["category"], r["partition"])] if r["partition"] else [])
        for key in keys:
            s = score(*key)
            s.recommendations += 1
            verdict = r["verdict"] or None  # the view gives '' when there is none
            if verdict == "approved":
                s.approved += 1
            elif verdict == "rejected":
                s.rejected += 1
                why = reasons.get(r["incident_id"], "other")
                s.rejected_reasons[why] = s.rejected_reasons.get(why, 0) + 1
            elif verdict == "confirmed" or r["incident_id"] in confirmed:
                s.confirmed += 1
            elif now - _epoch(r["detected_at"]) > settings.expire_after_h * 3600:
                s.expired += 1
            else:
                s.open += 1
            if r["detection_latency_s"] is not None:
                latencies[key][0].append(float(r["detection_latency_s"]))
            if r["action_latency_s"] is not None:
                latencies[key][1].append(float(r["action_latency_s"]))
    try:
        misses = _misses(store, since_s, maintenance_reasons(policy))
    except Exception:  # no scheduler events recorded (no Slurm producer running): misses unknown
        misses = {}
    for s in scores.values():
        det, act = latencies.get((s.category, s.partition), ([], []))
        s.detection_p50_s = statistics.median(det) if det else None
        s.action_p50_s = statistics.median(act) if act else None
        if s.partition is not None:
            s.misses = misses.get(s.partition, 0)
        elif s.category == "node":
            s.misses = sum(misses.values())  # drains by people are node-level faults we did not report
        _judge(s, policy)
    return sorted(scores.values(), key=lambda s: (s.category, s.partition or ""))


def _judge(s: Score, policy: Policy) -> None:
    settings = policy.readiness
    if s.category in settings.recommend_only:
        s.verdict, s.missing = "never", ["configured recommend-only (readiness.recommend_only)"]
        return
    missing = []
    if s.decided < settings.min_samples:
        missing.append(f"too few samples: {s.decided} decided, need {settings.min_samples}")
    if s.precision is not None and s.precision < settings.min_precision:
        missing.append(f"precision {s.precision:.0%} below {settings.min_precision:.0%}")
    s.verdict, s.missing = ("ready" if not missing else "not_yet"), missing


def verdict_for(scores: list[Score], category: str | None, partition: str | None) -> tuple[bool, str]:
    """Whether autonomy may be switched on for this scope, and the verdict in words.

    A partition with its own history is judged on it; otherwise on the category
    across partitions. Without a category, every category must be ready.
    """

    def pick(cat: str) -> Score | None:
        exact = next((s for s in scores if s.category == cat and s.partition == partition), None)
        if partition is not None and exact is not None and exact.decided:
            return exact
        return next((s for s in scores if s.category == cat and s.partition is None), None)

    cats = [category] if category else [c for c in CATEGORIES if c not in NEVER_ACTS]
    notes, ok = [], True
    for cat in cats:
        s = pick(cat)
        if s is None:
            ok = False
            notes.append(f"{cat}: no data")
            continue
        ok = ok and s.verdict == "ready"
        notes.append(f"{cat}: {s.summary()}")
    return ok, "; ".join(notes)
