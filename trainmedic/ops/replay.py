"""What-if replay: recorded incidents through another policy. Nothing is executed.

Each incident of the period is decided again with the new policy (the same
`decide` the streams worker uses) and its actions are passed through the new
policy's guardrails (the executor's own `Guardrails`, with a scheduler that
knows nothing: the guardrail that needs live cluster state, the partition
share, is judged from the replayed actions alone). The per-job restart budget
is the policy's: the restarts it orders are counted per job as the streams
worker counts them (streams/policy_store.py).

The policy decides from the incident's facts; whether the fault lived on the
culprit's node (`Incident.isolate`) is the incidents table's `isolate` column
(migration 012). Older rows say it by `recommended_action` (drain_and_requeue,
rows from when attribution chose the action) or, failing that, by the recorded
decision, where policy chose drain_and_requeue from that fact.

GPU-hours use the audit's estimate (docs/audit.md): a fault costs
job GPUs x recovery time; the baseline without trainmedic is the NCCL watchdog
(600 s) plus a manual response (1800 s).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from schemas.events import Evidence, Incident
from sinks.audit import AuditStore
from sinks.audit_queries import CHILD_SKEW_S, summary_sql
from sinks.backends.base import JobState, NodeState
from sinks.guardrails import Guardrails, guardrail_settings, requeues_without_drain
from streams.policy import RESTARTS, Policy, decide

GPUS_PER_NODE = 8
BASELINE_RECOVERY_S = 600.0 + 1800.0
DEFAULT_ACTION_S = 10.0  # when the period has no verified action to measure from


class _NoCluster:
    """A scheduler that knows nothing: replay never touches the real one."""

    name = "replay"

    def list_nodes(self) -> list[NodeState]:
        return []

    def job_state(self, job_id: str) -> JobState:
        return JobState(job_id=job_id, state="UNKNOWN")


@dataclass
class Change:
    incident_id: str
    job_id: str | None
    category: str
    culprit_node: str | None
    actual: str  # e.g. "recommendation: drain_and_requeue" / "action: requeue"
    replayed: str
    rule: str
    guardrail: str | None
    gpu_hours: float  # + saved by the new policy, - lost


def _isolate(row: dict[str, Any]) -> bool:
    if row.get("isolate") is not None:  # recorded since migration 012
        return bool(row["isolate"])
    recommended = row.get("recommended_action") or ""
    if recommended:
        return bool(recommended == "drain_and_requeue")
    return bool(row.get("decision_action") == "drain_and_requeue")


def _incident(row: dict[str, Any]) -> Incident:
    return Incident(
        event_id=row["incident_id"],
        incident_id=row["incident_id"],
        event_time=row["event_time"].timestamp(),
        job_id=row["job_id"] or None,  # the table keeps '' for none
        partition=row["partition"] or None,  # the table keeps '' for none
        job_nodes=list(row["job_nodes"]),
        job_name=row.get("job_name"),
        user=row.get("user"),
        account=row.get("account"),
        job_comment=row.get("job_comment"),
        domain=row.get("domain"),
        domain_nodes=list(row.get("domain_nodes") or []),
        category=row["category"],
        severity=row["severity"],
        culprit_node=row["culprit_node"] or None,  # the table keeps '' for none
        culprit_rank=row["culprit_rank"],
        confidence=float(row["confidence"]),
        isolate=_isolate(row),
        explanation=row["explanation"],
        evidence=[Evidence.model_validate(e) for e in orjson.loads(row["evidence"] or "[]")],
        anomaly_ids=list(row["anomaly_ids"]),
        first_signal_time=row["first_signal_time"].timestamp(),
    )


def load_incident(store: AuditStore, incident_id: str) -> Incident | None:
    rows = store.query(
        "SELECT i.*, d.decision_action AS decision_action FROM {db}.incidents AS i FINAL LEFT JOIN ("
        "SELECT incident_id, argMax(action, event_time) AS decision_action FROM {db}.decisions FINAL "
        "WHERE incident_id = {i:String} GROUP BY incident_id) AS d ON d.incident_id = i.incident_id "
        "WHERE i.incident_id = {i:String}",
        {"i": incident_id},
    )
    return _incident(rows[0]) if rows else None


def _load(store: AuditStore, since_s: float) -> list[tuple[Incident, dict[str, Any]]]:
    # The summary of the replayed window only, not the whole incident_summary view.
    since = "event_time >= fromUnixTimestamp64Milli({t:Int64})"
    child = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000})"
    rows = store.query(
        "SELECT i.*, s.decision_kind AS decision_kind, s.decision_action AS decision_action, "
        "s.recovery_s AS recovery_s, s.action_latency_s AS action_latency_s "
        f"FROM {{db}}.incidents AS i FINAL LEFT JOIN ({summary_sql(since, child)}) AS s "
        "ON s.incident_id = i.incident_id WHERE i.event_time >= fromUnixTimestamp64Milli({t:Int64}) "
        "ORDER BY i.event_time",
        {"t": int(since_s * 1000)},
    )
    return [(_incident(r), r) for r in rows]


def replay(store: AuditStore, policy: Policy, since_s: float) -> dict[str, Any]:
    recorded = _load(store, since_s)
    settings = guardrail_settings(policy.guardrails, "the replayed policy")
    rails = Guardrails(lambda: settings, _NoCluster())  # type: ignore[arg-type]
    measured = [float(r["action_latency_s"]) for _, r in recorded if r["action_latency_s"] is not None]
    action_s = statistics.median(measured) if measured else DEFAULT_ACTION_S
    changes: list[Change] = []
    acted_before = acted_after = trips = 0
    window_s = policy.restart_budget.window_h * 3600
    restarts: dict[str, list[float]] = {}  # job id -> when policy ordered a restart of it
    for incident, row in recorded:
        now = incident.event_time
        ordered = [t for t in restarts.get(incident.job_id or "", ()) if now - t <= window_s]
        decision, action = decide(policy, incident, now=now, recent_restarts=len(ordered))
        if action is not None and action.action in RESTARTS and incident.job_id:
            restarts[incident.job_id] = [*ordered, now]
        guardrail = None
        if action is not None:
            trip = rails.check(action, incident.event_time)
            if trip is not None and requeues_without_drain(action, trip):
                # As the executor does: the node stays in service, the job is requeued without it.
                guardrail = f"{trip[0]}: {trip[1]} (the drain alone: the job is requeued without the node)"
                trips += 1
                rails.record(action.model_copy(update={"action": "requeue"}), incident.event_time)
            elif trip is not None:
                guardrail, action = f"{trip[0]}: {trip[1]}", None
                trips += 1
            else:
                rails.record(action, incident.event_time)
        was_action = row["decision_kind"] == "action"
        acted_before += was_action
        acted_after += action is not None
        actual = f"{row['decision_kind'] or 'none'}: {row['decision_action'] or '-'}"
        replayed = f"{'action' if action is not None else 'recommendation'}: {decision.action}"
        if actual == replayed and guardrail is None:
            continue
        gpus = max(1, len(incident.job_nodes)) * GPUS_PER_NODE
        ours = (incident.event_time - incident.first_signal_time) + action_s
        actual_recovery = float(row["recovery_s"]) if row["recovery_s"] is not None else BASELINE_RECOVERY_S
        if action is not None and not was_action:
            hours = gpus * (BASELINE_RECOVERY_S - ours) / 3600
        elif was_action and action is None:
            hours = -gpus * (BASELINE_RECOVERY_S - actual_recovery) / 3600
        else:
            hours = 0.0
        changes.append(
            Change(
                incident.incident_id,
                incident.job_id,
                incident.category,
                incident.culprit_node,
                actual,
                replayed,
                decision.rule,
                guardrail,
                round(hours, 2),
            )
        )
    return {
        "incidents": len(recorded),
        "changed": len(changes),
        "actions_before": acted_before,
        "actions_after": acted_after,
        "guardrail_trips": trips,
        "gpu_hours_delta": round(sum(c.gpu_hours for c in changes), 2),
        "assumptions": {
            "gpus_per_node": GPUS_PER_NODE,
            "baseline_recovery_s": BASELINE_RECOVERY_S,
            "our_action_latency_s": round(action_s, 2),
        },
        "changes": [asdict(c) for c in changes],
    }


def render(report: dict[str, Any]) -> Sequence[str]:
    lines = [
        f"{report['incidents']} incidents replayed: {report['changed']} decisions change; "
        f"actions {report['actions_before']} -> {report['actions_after']}; "
        f"guardrail trips {report['guardrail_trips']}; GPU-hours {report['gpu_hours_delta']:+.1f} "
        "(+ saved by the new policy). Nothing was executed.",
    ]
    for c in report["changes"]:
        lines.append(
            f"  {c['incident_id']}  job {c['job_id'] or '-':8} {c['category']:13} {c['culprit_node'] or '-':8} "
            f"{c['actual']:32} -> {c['replayed']:32} {c['gpu_hours']:+8.1f} GPUh"
            + (f"  [guardrail {c['guardrail']}]" if c["guardrail"] else "")
        )
    return lines
