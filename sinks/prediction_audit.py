"""What the audit says of predictions (issue 44): whether each pre-failure verdict came true, and
what checkpoint-aligned migrations saved and cost in goodput.

**A verdict, not an incident.** A verdict about a GPU of node X becomes one predicted incident per
job running on X (streams/migration.py). They are one prediction: the incidents of one (node, rule,
first_seen) are scored once, together.

**Its fate** (`fate`, with the fact behind it in `basis`), the first that holds:

- true, `repair hand-off`: the repair hand-off found the fault. The health check before a return to
  service (trainmedic/ops/return_to_service.py, a node_returns row naming one of its incidents) failed,
  or an operator labelled one of its incidents `confirmed` (`trainmedic recommendations label`);
- true, `failure followed`: the failure came. A reactive incident of the same category about X, of
  severity error or critical, within `window_s` after the prediction. A warning does not count: the
  GPU-health detector reads the same pending row remap as the pre-failure rule and raises its own;
- false, `returned healthy`: X went back to service with no fault found (a health check passed, or
  it was resumed), and no failure followed within the window;
- false, `no failure in window`: nothing acted on it (monitor mode: no action of any of its
  incidents) and the window passed without the failure. An acted prediction never counts false by
  the window alone: a migrated job and a drained GPU no longer give the failure the chance to come;
- pending otherwise.

The window is the policy's `readiness.expire_after_h`, the window in which readiness already lets
the facts confirm a recommendation (a later failure of the same job on the same node). No lead time
is published for any rule of the pre-failure catalog (docs/prediction.md, "Lead times: none cited"),
so none gives a better one; readiness's scores are what will.

**Saved by migration** (bench/predictive.py's accounting, on branch `leadtimes`): a reactive fault
loses the work since the last checkpoint, the detection time and one restart; a migration at a
checkpoint loses one restart only. So a migration that reached `requeued` saved
gpus x (work since the previous checkpoint + detection). The audit has no time of the job's previous
checkpoint, but that checkpoint was written before the migration was decided (`checkpoint_before`), so
the work from the decision to the requeue is the part we know of: a lower bound. Detection is the model's
`detection_s` (30 s: trainmedic's reactive path as the repeat-fault benchmark measured it). The cost of
false predictions: the node-hours a predictive drain held a node whose prediction counted false.
"""

from __future__ import annotations

import time
from typing import Any

from sinks.audit import AuditStore
from sinks.audit_queries import CHILD_SKEW_S, GOODPUT_GPUS_PER_NODE

#: The reactive path's detection time (bench/predictive.py's PredictiveConfig.detection_s reads it), an assumption
#: from the repeat-fault benchmark's measured first detections (1.16 s for an Xid, 31.88 s for a dead rank).
DETECTION_S = 30.0
#: The facts behind a fate, in the order they are tried.
BASES = ("repair hand-off", "failure followed", "returned healthy", "no failure in window", "pending")
# A join with no match gives the other side's defaults (0, ''), which the conditions read as "none".
SETTINGS = " SETTINGS join_use_nulls = 0"
# Every read's cluster filter, `{in_cluster}` in the SQL: one cluster's rows, or every cluster's
# (`every`: trainmedic audit --all-clusters).
_IN_CLUSTER = "({every:Bool} OR cluster = {c:String})"


def _query(store: AuditStore, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    return store.query(sql.replace("{in_cluster}", _IN_CLUSTER), params)


_CHILD = f"event_time >= fromUnixTimestamp64Milli({{t:Int64}} - {CHILD_SKEW_S * 1000})"
# The predicted incidents of the window, and the verdict each belongs to.
_PREDICTED = (
    "SELECT incident_id, culprit_node AS node, category, "
    "replaceOne(JSONExtractString(evidence, 1, 'signature'), 'prefailure_', '') AS rule, "
    "toUnixTimestamp64Milli(first_signal_time) AS first_ms, toUnixTimestamp64Milli(event_time) AS ms "
    "FROM {db}.incidents FINAL WHERE kind = 'predicted' AND culprit_node != '' AND {in_cluster} "
    "AND event_time >= fromUnixTimestamp64Milli({t:Int64})"
)
_IDS = "SELECT incident_id FROM {db}.incidents FINAL WHERE kind = 'predicted' AND {in_cluster} AND " + (
    "event_time >= fromUnixTimestamp64Milli({t:Int64})"
)


def fates_sql() -> str:
    """One row per verdict of the window: node, category, rule, first_ms, ms (its first incident), ids
    (its incidents), fate (true, false, pending) and basis. Parameters: t (window start, ms), now (ms),
    window (ms), c (cluster). The statement reading it ends with `SETTINGS`."""
    child = f"{_CHILD} AND {{in_cluster}} AND incident_id IN ({_IDS})"
    per_incident = (
        "SELECT p.*, "
        f"p.incident_id IN (SELECT incident_id FROM {{db}}.approvals FINAL WHERE {child} "
        "GROUP BY incident_id HAVING argMax(verdict, event_time) = 'confirmed') AS labelled, "
        f"p.incident_id IN (SELECT assumeNotNull(incident_id) FROM {{db}}.node_returns FINAL WHERE {child} "
        "AND check_passed IS NOT NULL AND NOT assumeNotNull(check_passed)) AS fault_found, "
        f"p.incident_id IN (SELECT assumeNotNull(incident_id) FROM {{db}}.node_returns FINAL WHERE {child} "
        "AND (ifNull(check_passed, false) OR outcome = 'resumed')) AS returned, "
        f"p.incident_id IN (SELECT incident_id FROM {{db}}.actions FINAL WHERE {child}) AS acted "
        f"FROM ({_PREDICTED}) AS p"
    )
    verdicts = (
        "SELECT node, category, rule, first_ms, min(ms) AS ms, groupArray(incident_id) AS ids, "
        "max(labelled OR fault_found) AS found, max(returned) AS returned, max(acted) AS acted "
        f"FROM ({per_incident}) GROUP BY node, category, rule, first_ms"
    )
    # The failures that follow: reactive incidents of X, error or critical, joined on the node and
    # filtered to the window after each verdict (join_use_nulls = 0: no match gives f.ms = 0).
    failures = (
        "SELECT culprit_node AS node, category, toUnixTimestamp64Milli(event_time) AS ms FROM {db}.incidents FINAL "
        "WHERE kind = 'reactive' AND severity IN ('error', 'critical') AND culprit_node != '' "
        "AND {in_cluster} AND event_time >= fromUnixTimestamp64Milli({t:Int64})"
    )
    followed = (
        "SELECT v.node AS node, v.category AS category, v.rule AS rule, v.first_ms AS first_ms, any(v.ms) AS ms, "
        "any(v.ids) AS ids, any(v.found) AS found, any(v.returned) AS returned, any(v.acted) AS acted, "
        "countIf(f.ms > v.ms AND f.ms <= v.ms + {window:Int64}) > 0 AS failed "
        f"FROM ({verdicts}) AS v LEFT JOIN ({failures}) AS f ON f.node = v.node AND f.category = v.category "
        "GROUP BY v.node, v.category, v.rule, v.first_ms"
    )
    basis = (
        "multiIf(found, 'repair hand-off', failed, 'failure followed', returned, 'returned healthy', "
        "NOT acted AND {now:Int64} > ms + {window:Int64}, 'no failure in window', 'pending')"
    )
    return (
        "SELECT *, multiIf(basis IN ('repair hand-off', 'failure followed'), 'true', basis = 'pending', 'pending', "
        f"'false') AS fate FROM (SELECT *, {basis} AS basis FROM ({followed}))"
    )


def _params(since_s: float, now: float, window_s: float, cluster: str | None) -> dict[str, Any]:
    """Query parameters; cluster None: every cluster."""
    return {
        "t": int(since_s * 1000),
        "now": int(now * 1000),
        "window": int(window_s * 1000),
        "c": cluster or "",
        "every": cluster is None,
    }


def prediction_fates(
    store: AuditStore, since_s: float, window_s: float, cluster: str | None, now: float | None = None
) -> list[dict[str, Any]]:
    """Each verdict of the window with its fate, oldest first (`fates_sql`)."""
    now = time.time() if now is None else now
    return _query(
        store,
        f"SELECT node, category, rule, ms, ids, fate, basis FROM ({fates_sql()}) ORDER BY ms, node, rule{SETTINGS}",
        _params(since_s, now, window_s, cluster),
    )


def prediction_tallies(
    store: AuditStore, since_s: float, window_s: float, cluster: str | None, now: float | None = None
) -> list[dict[str, Any]]:
    """Per rule: predictions (verdicts), true, false, pending, and how many of each basis."""
    now = time.time() if now is None else now
    return _query(
        store,
        "SELECT rule, count() AS predictions, countIf(fate = 'true') AS true_, countIf(fate = 'false') AS false_, "
        "countIf(fate = 'pending') AS pending, sumMap([basis], [toUInt64(1)]) AS bases "
        f"FROM ({fates_sql()}) GROUP BY rule ORDER BY rule{SETTINGS}",
        _params(since_s, now, window_s, cluster),
    )


def migration_goodput(
    store: AuditStore,
    since_s: float | None,
    window_s: float,
    cluster: str | None,
    job: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Saved by migration, beside goodput's GPU-hours lost: each migration of the window that reached
    `requeued`, with the GPU-hours a reactive failure would have lost (a lower bound, module docstring),
    and the node-hours predictive drains held nodes whose prediction counted false."""
    now = time.time() if now is None else now
    since_s = 0.0 if since_s is None else since_s
    params = {**_params(since_s, now, window_s, cluster), "gpn": GOODPUT_GPUS_PER_NODE, "det": DETECTION_S}
    job_where = ""
    if job is not None:
        job_where = " AND job_id = {job:String}"
        params["job"] = job
    rows = _query(
        store,
        "SELECT m.migration_id AS migration_id, m.job AS job_id, m.node AS node, m.rule AS rule, "
        "m.decided_at AS decided_at, m.requeued_at AS requeued_at, m.checkpoint_before AS checkpoint_before, "
        "m.checkpoint_step AS checkpoint_step, toUInt32(length(i.job_nodes)) * {gpn:UInt32} AS gpus, "
        "greatest(toUnixTimestamp64Milli(m.requeued_at) - toUnixTimestamp64Milli(m.decided_at), 0) / 1000.0 "
        "AS work_s, {det:Float64} AS detection_s, gpus * (work_s + detection_s) / 3600.0 AS gpu_hours_saved "
        "FROM (SELECT migration_id, any(incident_id) AS incident_id, any(job_id) AS job, any(node) AS node, "
        "any(rule) AS rule, min(decided_at) AS decided_at, minIf(event_time, state = 'requeued') AS requeued_at, "
        "any(checkpoint_before) AS checkpoint_before, maxIf(checkpoint_step, state = 'requeued') AS checkpoint_step "
        "FROM {db}.migrations FINAL WHERE {in_cluster} AND event_time >= fromUnixTimestamp64Milli({t:Int64})"
        f"{job_where} GROUP BY migration_id HAVING countIf(state = 'requeued') > 0) AS m "
        "LEFT JOIN (SELECT incident_id, job_nodes FROM {db}.incidents FINAL WHERE {in_cluster} "
        "AND incident_id IN (SELECT incident_id FROM {db}.migrations FINAL WHERE {in_cluster} "
        "AND event_time >= fromUnixTimestamp64Milli({t:Int64}))) AS i ON i.incident_id = m.incident_id "
        f"ORDER BY requeued_at{SETTINGS}",
        params,
    )
    drains = _false_drains(store, params, job_where)
    return {
        "migrations_requeued": len(rows),
        "gpu_hours_saved": sum(float(r["gpu_hours_saved"]) for r in rows),
        "false_predictions_drained": len(drains),
        "false_drain_node_hours": sum(float(d["node_hours"]) for d in drains),
        "migrations": rows,
        "false_drains": drains,
        "assumptions": {
            "saved": "per migration that reached requeued: gpus x (work from the decision to the requeue + "
            f"detection {DETECTION_S:g} s) / 3600, as bench/predictive.py counts a reactive fault's loss less a "
            "migration's (the restart is in both); a lower bound: the work between the previous checkpoint and "
            "the decision is not in the audit",
            "false_drain": "per prediction counted false whose predictive drain was done: its node drained (the "
            "drain verified) until it returned to service",
            "window_s": window_s,
        },
    }


def _false_drains(store: AuditStore, params: dict[str, Any], job_where: str = "") -> list[dict[str, Any]]:
    """Predictions counted false that drained their node (for the job of `job_where`, if any): how long
    the node was out for them."""
    child = f"{_CHILD} AND {{in_cluster}} AND incident_id IN ({_IDS})"
    return _query(
        store,
        "SELECT v.node AS node, v.rule AS rule, v.first_ms AS first_ms, any(v.basis) AS basis, "
        "min(d.at_ms) AS drained_ms, "
        "minIf(r.at_ms, r.at_ms >= d.at_ms) AS returned_ms, "
        "(if(returned_ms = 0, {now:Int64}, returned_ms) - drained_ms) / 3600000.0 AS node_hours "
        "FROM (SELECT node, rule, first_ms, basis, arrayJoin(ids) AS incident_id "
        f"FROM ({fates_sql()}) WHERE fate = 'false') AS v "
        "INNER JOIN (SELECT incident_id, toUnixTimestamp64Milli(coalesce(verified_at, event_time)) AS at_ms "
        f"FROM {{db}}.action_results FINAL WHERE {child} AND status = 'done' AND startsWith(action, 'drain')"
        f"{job_where}) AS d "
        "ON d.incident_id = v.incident_id "
        "LEFT JOIN (SELECT assumeNotNull(incident_id) AS incident_id, toUnixTimestamp64Milli(event_time) AS at_ms "
        f"FROM {{db}}.node_returns FINAL WHERE {child} AND (ifNull(check_passed, false) OR outcome = 'resumed')) AS r "
        f"ON r.incident_id = v.incident_id GROUP BY v.node, v.rule, v.first_ms ORDER BY drained_ms{SETTINGS}",
        params,
    )
