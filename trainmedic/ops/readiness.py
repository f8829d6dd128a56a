"""Autonomy readiness: score monitor-mode recommendations from the audit trail.

Each recommendation's fate is one of:
  approved / rejected   an operator answered it (trainmedic recommendations approve / reject, console);
  confirmed             a label after the fact (trainmedic recommendations label ... confirmed), or the
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

Predictions (issue 44) are scored apart, one row per pre-failure rule (category
``predicted: RULE``, every partition together), from the facts, since a migrated GPU no
longer gets the chance to fail: true when the repair hand-off finds the fault or the
failure follows, false when the node returns healthy or, left unacted in monitor mode,
the window (``expire_after_h``) passes without the failure (sinks/prediction_audit.py).
Their precision is true / (true + false); a reactive category's rows never count them.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from schemas.ids import current_cluster
from schemas.vocab import CATEGORIES, NEVER_ACTS
from sinks.audit import AuditStore
from sinks.audit_queries import CHILD_SKEW_S, summary_sql
from sinks.prediction_audit import prediction_tallies
from streams.policy import Policy, ReadinessSettings

MISS_LOOKBACK_S = 3600.0
#: The category of a rule's prediction scores: "predicted: row_remap_pending".
PREDICTED_PREFIX = "predicted: "
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
    open: int = 0  # a prediction's: pending
    refuted: int = 0  # predictions only: counted false
    bases: dict[str, int] = field(default_factory=dict)  # predictions only: the facts behind their fates
    misses: int = 0
    detection_p50_s: float | None = None
    action_p50_s: float | None = None
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    verdict: str = "not_yet"  # ready | not_yet | never
    missing: list[str] = field(default_factory=list)

    @property
    def decided(self) -> int:
        return self.approved + self.rejected + self.confirmed + self.refuted

    @property
    def precision(self) -> float | None:
        return (self.approved + self.confirmed) / self.decided if self.decided else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decided": self.decided, "precision": self.precision}

    def summary(self) -> str:
        p = "-" if self.precision is None else f"{self.precision:.0%}"
        why = f" ({'; '.join(self.missing)})" if self.missing else ""
        return f"{self.verdict}{why}: {self.decided} decided, precision {p}"


# Reactive incidents whose decision was a recommendation, from the window's decisions (time sort
# key). Predicted incidents are scored apart (sinks/prediction_audit.py): an operator's answer to a
# prediction says nothing of whether the GPU would have failed.
_RECOMMENDED = (
    "kind = 'reactive' AND incident_id IN (SELECT incident_id FROM {db}.decisions FINAL WHERE kind = 'recommendation' "
    # This cluster's only: clusters may share the audit, and readiness gates this cluster's autonomy.
    "AND cluster = {c:String} "
    f"AND event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000}))"
)

# Recommendations the facts confirmed: a later incident of the same job on the same culprit
# within the expiry window. One join over the window's incidents.
_CONFIRMED = (
    "SELECT r.incident_id FROM ("
    "SELECT incident_id, job_id, culprit_node, toUnixTimestamp64Milli(event_time) AS ms "
    "FROM {db}.incidents FINAL WHERE event_time >= fromUnixTimestamp64Milli({t:Int64}) "
    f"AND cluster = {{c:String}} AND job_id != '' AND culprit_node != '' AND {_RECOMMENDED}) AS r "
    "INNER JOIN (SELECT job_id, culprit_node, toUnixTimestamp64Milli(event_time) AS ms "
    "FROM {db}.incidents FINAL WHERE event_time >= fromUnixTimestamp64Milli({t:Int64}) "
    "AND cluster = {c:String} AND job_id != '' AND culprit_node != '' AND kind = 'reactive') AS l "
    "ON l.job_id = r.job_id AND l.culprit_node = r.culprit_node "
    "WHERE l.ms > r.ms AND l.ms <= r.ms + {expire:Int64}"
)

# The operator's last reason for each rejection in the window.
_REJECT_REASONS = (
    "SELECT incident_id, argMax(reason, event_time) AS reason FROM {db}.approvals FINAL "
    "WHERE verdict = 'rejected' AND event_time >= fromUnixTimestamp64Milli({t:Int64}) GROUP BY incident_id"
)


def _tallies(store: AuditStore, since_s: float, now: float, expire_s: float) -> list[dict[str, Any]]:
    """Each recommendation's fate, counted per (category, partition) and per category, in ClickHouse:
    at fleet scale the window holds ~100k recommendations, too many to turn into Python rows."""
    since = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}}) AND {_RECOMMENDED}"
    child = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000})"
    fate = (
        "multiIf(s.verdict = 'approved', 'approved', s.verdict = 'rejected', 'rejected', "
        f"s.verdict = 'confirmed' OR s.incident_id IN ({_CONFIRMED}), 'confirmed', "
        "{now:Int64} - toUnixTimestamp64Milli(s.detected_at) > {expire:Int64}, 'expired', 'open')"
    )
    return store.query(
        "SELECT category, grouping(partition) AS every_partition, partition, count() AS recommendations, "
        "countIf(fate = 'approved') AS approved, countIf(fate = 'rejected') AS rejected, "
        "countIf(fate = 'confirmed') AS confirmed, countIf(fate = 'expired') AS expired, "
        "countIf(fate = 'open') AS open, "
        # The interpolating median: statistics.median's value, also for an even count.
        "quantileExactInclusive(0.5)(detection_latency_s) AS detection_p50_s, "
        "quantileExactInclusive(0.5)(action_latency_s) AS action_p50_s, "
        "sumMapIf([reason], [toUInt64(1)], fate = 'rejected') AS rejected_reasons FROM ("
        "SELECT s.category AS category, ifNull(s.partition, '') AS partition, "
        "s.detection_latency_s AS detection_latency_s, s.action_latency_s AS action_latency_s, "
        f"{fate} AS fate, if(rr.reason = '', 'other', rr.reason) AS reason "
        f"FROM ({summary_sql(since, child)}) AS s LEFT JOIN ({_REJECT_REASONS}) AS rr ON rr.incident_id = s.incident_id "
        "WHERE s.decision_kind = 'recommendation') "
        "GROUP BY GROUPING SETS ((category, partition), (category))",
        {"t": int(since_s * 1000), "now": int(now * 1000), "expire": int(expire_s * 1000), "c": current_cluster()},
    )


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
        "WHERE kind = 'node' AND cluster = {c:String} AND has(flags, 'DRAIN') "
        "AND event_time >= fromUnixTimestamp64Milli({t:Int64}) "
        "AND NOT startsWith(ifNull(reason, ''), 'trainmedic ') AND NOT has(flags, 'MAINTENANCE') "
        "AND NOT arrayExists(p -> match(lower(ifNull(reason, '')), p), {maint:Array(String)}) "
        "GROUP BY node, partition, ifNull(reason, '')) AS d "
        "ASOF LEFT JOIN (SELECT culprit_node, toUnixTimestamp64Milli(event_time) AS ms FROM {db}.incidents FINAL "
        "WHERE culprit_node != '' AND cluster = {c:String} "
        "AND event_time >= fromUnixTimestamp64Milli({t:Int64} - {look:Int64})) AS o "
        "ON d.node = o.culprit_node AND d.ms >= o.ms GROUP BY partition SETTINGS join_use_nulls = 0",
        {
            "t": int(since_s * 1000),
            "look": int(MISS_LOOKBACK_S * 1000),
            "maint": [glob_regex(p) for p in patterns],
            "c": current_cluster(),
        },
    )
    return {(r["partition"] or None): int(r["misses"]) for r in rows if r["misses"]}


def readiness(store: AuditStore, policy: Policy, since_s: float, now: float | None = None) -> list[Score]:
    """One Score per (category, None) and per (category, partition) seen, for every category."""
    now = time.time() if now is None else now
    scores: dict[tuple[str, str | None], Score] = {}
    for c in CATEGORIES:
        if c not in NEVER_ACTS:  # healthy and unknown never act: no autonomy to earn
            scores[(c, None)] = Score(c, None)
    for row in _tallies(store, since_s, now, policy.readiness.expire_after_h * 3600):
        partition = None if row["every_partition"] else row["partition"]
        if not row["every_partition"] and not partition:
            continue  # incidents without a partition count only in the category's whole
        keys, counts = row["rejected_reasons"]
        scores[(row["category"], partition)] = Score(
            row["category"],
            partition,
            recommendations=int(row["recommendations"]),
            approved=int(row["approved"]),
            rejected=int(row["rejected"]),
            confirmed=int(row["confirmed"]),
            expired=int(row["expired"]),
            open=int(row["open"]),
            detection_p50_s=_float_or_none(row["detection_p50_s"]),
            action_p50_s=_float_or_none(row["action_p50_s"]),
            rejected_reasons={str(k): int(n) for k, n in zip(keys, counts, strict=True)},
        )
    try:
        misses = _misses(store, since_s, maintenance_reasons(policy))
    except Exception:  # no scheduler events recorded (no Slurm producer running): misses unknown
        misses = {}
    window_s = policy.readiness.expire_after_h * 3600
    for row in prediction_tallies(store, since_s, window_s, current_cluster(), now):
        keys, counts = row["bases"]
        cat = f"{PREDICTED_PREFIX}{row['rule']}"
        scores[(cat, None)] = Score(
            cat,
            None,
            recommendations=int(row["predictions"]),
            confirmed=int(row["true_"]),
            refuted=int(row["false_"]),
            open=int(row["pending"]),
            bases={str(k): int(n) for k, n in zip(keys, counts, strict=True)},
        )
    for s in scores.values():
        if s.partition is not None:
            s.misses = misses.get(s.partition, 0)
        elif s.category == "node":
            s.misses = sum(misses.values())  # drains by people are node-level faults we did not report
        _judge(s, policy)
    return sorted(scores.values(), key=lambda s: (s.category, s.partition or ""))


def _float_or_none(v: Any) -> float | None:
    # No latency at all in the group: NULL, or NaN where ClickHouse gives one.
    return None if v is None or v != v else float(v)


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
