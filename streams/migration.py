"""Checkpoint-aligned migration (issue 44, deliverable 2): a job moved off a node with a
pre-failure verdict at the job's next completed checkpoint, so the restart loses no steps.

The steps, each in the streams worker that owns the job's partition:

1. a pre-failure verdict about a GPU of node X (streams/detectors/prefailure.py) becomes one
   incident of kind "predicted" per job running on X (`predicted_incident`);
2. policy decides (streams/policy.py `decide_predicted`): drain X at once, the job runs on (Slurm's
   DRAIN takes no new job); a migration then waits (`MigrationBook.begin`);
3. the job's progress (job.progress) shows a completed save beyond the checkpoint it had when the
   migration began (`MigrationBook.checkpoint`: an end line where the framework prints one, as
   streams/lineage.py reads saves): the job is requeued excluding X (`requeue_action`);
4. otherwise the migration ends without a requeue: at the bound (`fell_back`), when X fails first
   (`superseded`: the reactive incident acts), when the job ends (`ended`), or when an operator
   cancels it (`cancelled`; the API resumes X).

Pure logic on JSON-ready dicts: the worker keeps one value per job in a Faust table
(`migrations`, keyed by job id, on the job's partition), so a pending migration survives a restart
of the worker or a move of the partition, however long it waits. A closed migration stays in the
table as a tombstone until the job ends, so that a verdict raised again about the same node (a
restarted detector reading a condition that still holds) does not start another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from schemas.events import Action, Decision, Evidence, Incident, Migration, MigrationState, ProgressBatch
from schemas.ids import stable_id
from schemas.vocab import SEVERITY_RANK, Mode
from streams.detectors.prefailure import PreFailureVerdict
from streams.lineage import completed_save
from streams.placement import Placement

# What each predicted failure is, in an incident's words.
_FAILURE_WORDS = {
    "reset_required": "a GPU reset is required",
    "uncorrectable_ecc": "an uncorrectable ECC error",
    "nvlink_down": "an NVLink going down",
    "fallen_off_bus": "the GPU falling off the bus",
    "slowdown": "a hardware slowdown",
}


def predicted_incident(verdict: PreFailureVerdict, placement: Placement, now: float) -> Incident:
    """The incident of kind "predicted" for one job running on the verdict's node: its GPU
    telemetry's own evidence, so the node may be isolated (policy's provenance gate)."""
    incident_id = stable_id("inc", verdict.event_id, placement.job_id)
    readings = ", ".join(f"{k}={v}" for k, v in sorted(verdict.evidence.items()))
    lead = f"{verdict.lead_time_s:g} s" if verdict.lead_time_s is not None else f"unknown ({verdict.lead_time_note})"
    explanation = (
        f"{verdict.node} GPU {verdict.gpu}: rule {verdict.rule_id} foretells "
        f"{_FAILURE_WORDS.get(verdict.predicts, verdict.predicts)} ({readings}); lead time {lead}; "
        f"confidence {verdict.confidence:.2f} ({verdict.confidence_basis})"
    )
    return Incident(
        event_id=incident_id,
        event_time=now,
        incident_id=incident_id,
        job_id=placement.job_id,
        partition=placement.partition,
        job_nodes=list(placement.nodes),
        job_name=placement.job_name,
        user=placement.user,
        account=placement.account,
        job_comment=placement.comment,
        category="gpu_hardware",
        severity="warning",
        culprit_node=verdict.node,
        culprit_gpu=verdict.gpu,
        confidence=verdict.confidence,
        isolate=True,
        culprit_in_job=True,
        isolatable=True,
        isolation_note=f"{verdict.node} reported the condition itself (its GPU telemetry)",
        provenance="gpu",
        explanation=explanation,
        evidence=[
            Evidence(
                source="gpu",
                provenance="gpu",
                signature=f"prefailure_{verdict.rule_id}",
                node=verdict.node,
                time=verdict.first_seen,
                line=readings[:4096],
                role="root",
                gpu=verdict.gpu,
            )
        ],
        anomaly_ids=[],
        first_signal_time=verdict.first_seen,
        kind="predicted",
    )


def requeue_action(record: dict[str, Any], now: float, step: int | None) -> Action:
    """The migration's second step: the job requeued excluding the drained node, under the policy's
    name (the restart budget counts it, as any restart policy orders)."""
    incident = Incident.model_validate(record["incident"])
    action_id = stable_id("act", incident.incident_id, "requeue")
    saved = f"checkpoint {step}" if step is not None else "a checkpoint"
    return Action(
        event_id=action_id,
        event_time=now,
        action_id=action_id,
        decision_id=record["decision_id"],
        incident_id=incident.incident_id,
        job_id=incident.job_id,
        node=record["node"],
        partition=incident.partition,
        action="requeue",
        reason=f"trainmedic {incident.incident_id}: migrate off {record['node']} after {saved}",
        requested_by="policy",
        incident_time=incident.event_time,
        first_signal_time=incident.first_signal_time,
        node_reported_fault=True,
        exclude_node=True,
    )


def answered_by(record: dict[str, Any], incident: Incident) -> bool:
    """Whether a reactive incident of the job is the condition the pending migration already answers:
    a warning (no failure) about the migration's node, such as gpu_health's own reading of the same
    pending row remap. A failure there (error or critical), or anything about another node, is not:
    the node failed first, and the reactive path acts."""
    return incident.culprit_node == record["node"] and SEVERITY_RANK[incident.severity] < SEVERITY_RANK["error"]


def absorbed_decision(record: dict[str, Any], incident: Incident, mode: Mode, now: float) -> Decision:
    """The decision for a reactive incident a pending migration answers: nothing more is done."""
    decision_id = stable_id("dec", incident.incident_id)
    return Decision(
        event_id=decision_id,
        event_time=now,
        decision_id=decision_id,
        incident_id=incident.incident_id,
        job_id=incident.job_id,
        partition=incident.partition,
        category=incident.category,
        culprit_node=incident.culprit_node,
        culprit_rank=incident.culprit_rank,
        culprit_gpu=incident.culprit_gpu,
        action="none",
        mode=mode,
        executed=False,
        rule=f"prediction: migration {record['migration_id']} of job {incident.job_id} off {record['node']} answers it",
        reason=f"{incident.severity} about {record['node']}, no failure: the job moves at its next checkpoint",
        first_signal_time=incident.first_signal_time,
        incident_time=incident.event_time,
    )


class MigrationBook:
    """Pending migrations per job in `store` (a Faust table in the worker, a dict elsewhere).
    Values are replaced, never changed in place (a table records only what is assigned)."""

    def __init__(self, store: MutableMapping[str, Any] | None = None) -> None:
        self._store: MutableMapping[str, Any] = store if store is not None else {}

    def pending(self, job_id: str | None) -> dict[str, Any] | None:
        value = self._store.get(job_id) if job_id else None
        return dict(value) if value is not None and value.get("state") == "waiting" else None

    def waiting(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for job_id, value in list(self._store.items()):
            if value is not None and value.get("state") == "waiting":
                yield str(job_id), dict(value)

    def seen(self, job_id: str | None, node: str | None) -> bool:
        """A migration of this job off this node was already begun (pending or closed)."""
        value = self._store.get(job_id) if job_id else None
        return value is not None and node in value.get("nodes", [])

    def begin(
        self, incident: Incident, decision: Decision, wait_s: float, checkpoint_before: int | None, now: float
    ) -> Migration | None:
        """Start waiting for the job's next checkpoint; None when this job already migrates (or
        migrated) off this node."""
        job_id, node = incident.job_id, incident.culprit_node
        if not job_id or not node or self.seen(job_id, node) or self.pending(job_id) is not None:
            return None
        previous = self._store.get(job_id) or {}
        rule = next((e.signature.removeprefix("prefailure_") for e in incident.evidence), "")
        record = {
            "migration_id": stable_id("mig", incident.incident_id),
            "incident": incident.model_dump(mode="json"),
            "decision_id": decision.decision_id,
            "node": node,
            "gpu": incident.culprit_gpu,
            "rule": rule,
            "decided_at": now,
            "deadline": now + wait_s,
            "checkpoint_before": checkpoint_before,
            "first_seen": incident.first_signal_time,
            "state": "waiting",
            "nodes": [*previous.get("nodes", []), node],
        }
        self._store[job_id] = record
        return self.event(
            record, "waiting", now, f"{node} drained; waiting for a checkpoint beyond {checkpoint_before}"
        )

    def restore(
        self, states: list[Migration], incidents: list[Incident], keep: Callable[[str], bool] = lambda _: True
    ) -> int:
        """Migrations read back from the topics that the table lacks (a table whose recovery a broker
        cut short: the floor, as the restart budget's): each as its latest state says, a waiting one
        with its deadline. One the table holds, whose incident was not found, or whose job `keep`
        refuses (another worker's: only a job's owner writes its key), is left alone. Returns how
        many were added."""
        by_incident = {i.incident_id: i for i in incidents}
        latest: dict[str, Migration] = {}
        for m in sorted(states, key=lambda m: m.event_time):
            latest[m.migration_id] = m
        added = 0
        for m in sorted(latest.values(), key=lambda m: m.decided_at):
            incident = by_incident.get(m.incident_id)
            if incident is None or not keep(m.job_id) or self.seen(m.job_id, m.node):
                continue
            previous = self._store.get(m.job_id) or {}
            self._store[m.job_id] = {
                "migration_id": m.migration_id,
                "incident": incident.model_dump(mode="json"),
                "decision_id": m.decision_id,
                "node": m.node,
                "gpu": m.gpu,
                "rule": m.rule,
                "decided_at": m.decided_at,
                "deadline": m.deadline,
                "checkpoint_before": m.checkpoint_before,
                "first_seen": incident.first_signal_time,
                "state": m.state,
                "nodes": [*previous.get("nodes", []), m.node],
            }
            added += 1
        return added

    def checkpoint(self, batch: ProgressBatch) -> tuple[dict[str, Any], int | None] | None:
        """The pending migration of the batch's job and the step of the completed save that ends its
        wait (None: a save that states no step), when the batch has one: a save beyond the job's
        checkpoint when the migration began, or, stating no step, one written after the verdict."""
        record = self.pending(batch.job_id)
        if record is None:
            return None
        before = record["checkpoint_before"]
        for s in batch.samples:
            if s.phase != "checkpoint" or not completed_save(s.format):
                continue
            if s.step is not None and (before is None or s.step > before):
                return record, s.step
            if s.step is None and s.ts >= record["first_seen"]:
                return record, None
        return None

    def expired(self, now: float) -> list[str]:
        return [job_id for job_id, record in self.waiting() if now >= float(record["deadline"])]

    def finish(
        self,
        job_id: str,
        state: MigrationState,
        now: float,
        detail: str,
        step: int | None = None,
        by: str = "policy",
    ) -> Migration | None:
        """Close the job's pending migration (None when it has none); the tombstone stays."""
        record = self.pending(job_id)
        if record is None:
            return None
        self._store[job_id] = {**record, "state": state}
        return self.event(record, state, now, detail, step, by)

    def forget(self, job_id: str, now: float) -> Migration | None:
        """The job ended: a pending migration ends with it, and the tombstone goes."""
        closed = self.finish(job_id, "ended", now, "the job ended before a checkpoint was seen")
        self._store.pop(job_id, None)
        return closed

    def incident(self, record: dict[str, Any]) -> Incident:
        return Incident.model_validate(record["incident"])

    @staticmethod
    def event(
        record: dict[str, Any],
        state: MigrationState,
        now: float,
        detail: str,
        step: int | None = None,
        by: str = "policy",
    ) -> Migration:
        incident = record["incident"]
        return Migration(
            event_id=stable_id("migst", record["migration_id"], state, by),
            event_time=max(now, float(record["decided_at"])),
            migration_id=record["migration_id"],
            incident_id=incident["incident_id"],
            decision_id=record["decision_id"],
            job_id=incident["job_id"],
            node=record["node"],
            gpu=record["gpu"],
            rule=record["rule"][:128],
            state=state,
            decided_at=record["decided_at"],
            deadline=record["deadline"],
            checkpoint_before=record["checkpoint_before"],
            checkpoint_step=step,
            requested_by=by,
            detail=detail[:4096],
        )
