"""The one interface every scheduler backend implements.

The executor only ever talks to a scheduler through this protocol, so the
Slurm CLI backend, the simulated scheduler of the demo and an optional pyslurm
backend are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from schemas.errors import Refused, Unavailable
from schemas.events import incident_in_reason


class BackendError(Unavailable, RuntimeError):
    """A scheduler call failed; the message names the command and its error."""


class ActionRefused(Refused, BackendError):
    """The backend refused before calling the scheduler: nothing was changed; the message says why.

    The executor reports such an action ``skipped`` with this reason, so the
    suppressed action is audited (it is not a failure to retry).
    """


class NotPermitted(Refused, BackendError):
    """Slurm refused the call to the user the backend runs as (its AdminLevel is too low): nothing changed."""


# A node in one of these is out of service for a reason someone else owns: never acted on.
_DOWN_STATES = frozenset({"DOWN", "ERROR", "FUTURE", "UNKNOWN"})
# Base states of a node in service (NOT_RESPONDING may sit on one before Slurm sets it DOWN).
_UP_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "COMPLETING"})
_HANDS_OFF_FLAGS = frozenset(
    {"NOT_RESPONDING", "FAIL", "MAINTENANCE", "REBOOT_ISSUED", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"}
)
# The reason slurmctld gives a node whose slurmd stopped answering (src/slurmctld/ping_nodes.c,
# 22.05 and 24.11: set_node_down_ptr(node_ptr, "Not responding")): Slurm's own, no operator's.
SLURM_NOT_RESPONDING_REASON = "Not responding"


def failed_by_slurm(state: NodeState) -> bool:
    """Slurm itself took the node out because its slurmd stopped answering: NOT_RESPONDING, or
    DOWN with slurmctld's own reason (none set by an operator), and nothing else owns it."""
    others = _HANDS_OFF_FLAGS.difference({"NOT_RESPONDING"}).intersection(state.flags)
    if others or state.drained or state.state not in ("DOWN", *_UP_STATES):
        return False
    if "NOT_RESPONDING" in state.flags:
        return True
    return state.state == "DOWN" and (state.reason or "").strip() == SLURM_NOT_RESPONDING_REASON


def refuse_node_action(
    action: str, state: NodeState, maint_reservation: str | None, *, node_failed: bool = False
) -> None:
    """Raise ActionRefused unless trainmedic may `action` (drain) the node.

    Never acted on: a node in an active MAINT reservation (planned maintenance),
    one already drained (by anyone: their reason is theirs, and a second drain
    would overwrite it), and one down, failing or rebooting. Every backend calls
    this before the scheduler call, with the node's state and reservation read
    just before.

    `node_failed`: the incident's own evidence is Slurm reporting this node DOWN or
    NOT_RESPONDING. A node Slurm failed itself (failed_by_slurm) is then drained after all:
    with ReturnToService, Slurm puts it back in service as soon as its slurmd answers again,
    while the drain keeps it out until a person or its health check clears it. A node an
    operator set DOWN keeps its operator's reason.
    """
    if node_failed and not maint_reservation and failed_by_slurm(state):
        return
    node = state.name
    by = f" by {state.reason_user}" if state.reason_user else ""
    why = f" (reason {state.reason!r}{by})" if state.reason else ""
    if maint_reservation:
        raise ActionRefused(
            f"not {action}ing {node}: it is in maintenance reservation {maint_reservation} (MAINT flag){why}"
        )
    if state.drained:
        raise ActionRefused(f"not {action}ing {node}: it is already drained{why}; trainmedic never overwrites a drain")
    flags = sorted(_HANDS_OFF_FLAGS.intersection(state.flags))
    if state.state in _DOWN_STATES or flags:
        shown = "+".join([state.state, *flags])
        raise ActionRefused(f"not {action}ing {node}: it is {shown}{why}; a node out of service is left alone")


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # base state, upper case: IDLE, ALLOCATED, MIXED, DOWN, ...
    flags: tuple[str, ...] = ()  # upper case: DRAIN, NOT_RESPONDING, ...
    reason: str | None = None
    partitions: tuple[str, ...] = ()
    reason_user: str | None = None  # who set the reason, where Slurm says
    reason_time: float | None = None  # when the reason was set (Unix time), where Slurm says

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state in ("DRAINED", "DRAINING", "DRAIN")


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # upper case: PENDING, RUNNING, REQUEUED, COMPLETED, ...
    nodes: tuple[str, ...] = ()
    excluded_nodes: tuple[str, ...] = ()
    partition: str | None = None
    name: str | None = None
    restart_count: int = 0
    comment: str | None = None
    held: bool = False  # pending with a hold: it will not start until released
    extra: dict[str, str] = field(default_factory=dict)


def refuse_relabel(node: str, state: NodeState) -> None:
    """A relabel is for trainmedic's own drain only (see SchedulerBackend.relabel_node)."""
    if not state.drained or incident_in_reason(state.reason) is None:
        raise ActionRefused(f"not relabelling {node}: it is not drained by trainmedic (reason {state.reason!r})")


@runtime_checkable
class SchedulerBackend(Protocol):
    name: str

    def drain_node(self, node: str, reason: str, *, node_failed: bool = False) -> None:
        """Drain the node (ActionRefused, nothing changed, per refuse_node_action; `node_failed`:
        the incident's evidence is Slurm reporting the node failed)."""
        ...

    def resume_node(self, node: str) -> None: ...

    def reboot_node(self, node: str, reason: str) -> str:
        """Ask for the node's reboot as soon as it is idle, kept out of service after it (Slurm:
        `scontrol reboot ASAP nextstate=DRAIN`, DOWN where the version has no DRAIN); returns that
        next state. Only for a node trainmedic drained (ActionRefused otherwise)."""
        ...

    def relabel_node(self, node: str, reason: str) -> None:
        """Change the reason of a node trainmedic drained (it stays drained). Refused (ActionRefused,
        nothing sent) unless the node is drained under a trainmedic reason: never someone else's."""
        ...

    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        """Requeue the job so that its next allocation avoids exclude_nodes."""
        ...

    def cancel_job(self, job_id: str) -> None: ...

    def signal_job(self, job_id: str, signal: str) -> None:
        """Send the job `signal` (USR1 or USR2: its steps; B:USR1 or B:USR2: its batch shell, as
        sbatch --signal writes it) - only a signal the job declared it handles (schemas/job_settings.py)."""
        ...

    def hold_job(self, job_id: str) -> None: ...

    def release_job(self, job_id: str) -> None: ...

    def annotate_job(self, job_id: str, note: str) -> None:
        """Record a note in the job's own scheduler state (Slurm: its Comment).

        The executor marks a job before acting on it, so that a redelivered action
        can be recognised from the scheduler itself after a crash.
        """
        ...

    def node_state(self, node: str) -> NodeState: ...

    def list_nodes(self) -> list[NodeState]: ...

    def job_state(self, job_id: str) -> JobState: ...
