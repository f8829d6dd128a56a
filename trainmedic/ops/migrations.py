"""An operator's cancel of a pending checkpoint-aligned migration (streams/migration.py): the
streams worker stops waiting (the cancel is a `migrations` record it follows), and the node the
migration drained goes back into service, since the operator judged the prediction wrong."""

from __future__ import annotations

import time
from dataclasses import dataclass

from bus.publish import Publisher
from schemas.errors import Refused
from schemas.events import Migration, NodeReturn
from schemas.ids import stable_id
from schemas.topics import MIGRATIONS, NODE_RETURNS
from sinks.audit import AuditStore
from sinks.audit_queries import job_migrations
from sinks.backends.base import BackendError, SchedulerBackend


class CancelRefused(Refused, RuntimeError):
    """Nothing was cancelled. `status` is what the operator API answers (404 none pending, 503 the
    cancel not recorded, 502 the scheduler refused the resume)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Cancelled:
    migration_id: str
    node: str
    resumed: bool
    detail: str


def cancel_migration(
    backend: SchedulerBackend, store: AuditStore, publisher: Publisher, job_id: str, operator: str, comment: str
) -> Cancelled:
    """Cancel the job's pending migration and resume its node when it is still drained for it."""
    pending = [m for m in job_migrations(store, job_id) if m["state"] == "waiting"]
    if not pending:
        raise CancelRefused(404, f"job {job_id}: no pending migration in the audit")
    m = pending[-1]
    now = time.time()
    node, incident_id = str(m["node"]), str(m["incident_id"])
    cancel = Migration(
        event_id=stable_id("migst", m["migration_id"], "cancelled", operator, now),
        event_time=now,
        migration_id=m["migration_id"],
        incident_id=incident_id,
        decision_id=m["decision_id"],
        job_id=job_id,
        node=node,
        gpu=m["gpu"],
        rule=m["rule"],
        state="cancelled",
        decided_at=m["decided_at"].timestamp(),
        deadline=m["deadline"].timestamp(),
        checkpoint_before=m["checkpoint_before"],
        requested_by=operator,
        detail=(f"cancelled by {operator}: {comment}" if comment else f"cancelled by {operator}")[:4096],
    )
    publisher.publish(MIGRATIONS, cancel)
    if publisher.flush(10):
        raise CancelRefused(503, "Kafka did not confirm the cancel; retry")
    state = backend.node_state(node)
    if not (state.drained and incident_id in (state.reason or "")):
        why = f"{node} is not drained for {incident_id} ({state.reason or state.state}): left as it is"
        return Cancelled(m["migration_id"], node, False, why)
    try:
        backend.resume_node(node)
    except BackendError as exc:
        raise CancelRefused(502, f"migration cancelled, but resuming {node} failed: {exc}") from None
    event = NodeReturn(
        event_id=stable_id("ret", node, state.reason, now),
        event_time=now,
        node=node,
        incident_id=incident_id,
        drain_reason=state.reason or "",
        operator=operator,
        comment=f"migration {m['migration_id']} cancelled" + (f": {comment}" if comment else ""),
        detail="a cancelled migration resumes the node it drained (no health check: the drain was a prediction)",
    )
    publisher.publish(NODE_RETURNS, event)
    publisher.flush(10)
    return Cancelled(m["migration_id"], node, True, f"{node} resumed")
