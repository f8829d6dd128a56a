"""The one interface every scheduler backend implements.

The executor only ever talks to a scheduler through this protocol, so the
Slurm CLI backend, the simulated scheduler of the demo and an optional pyslurm
backend are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class BackendError(RuntimeError):
    """A scheduler call failed; the message names the command and its error."""


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # base state, upper case: IDLE, ALLOCATED, MIXED, DOWN, ...
    flags: tuple[str, ...] = ()  # upper case: DRAIN, NOT_RESPONDING, ...
    reason: str | None = None
    partitions: tuple[str, ...] = ()

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


@runtime_checkable
class SchedulerBackend(Protocol):
    name: str

    def drain_node(self, node: str, reason: str) -> None: ...

    def resume_node(self, node: str) -> None: ...

    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        """Requeue the job so that its next allocation avoids exclude_nodes."""
        ...

    def cancel_job(self, job_id: str) -> None: ...

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
