"""Typed results of slurmio's parsers: the same values whatever Slurm version wrote them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FINISHED_JOB_STATES", "ExitStatus", "JobInfo", "NodeInfo"]

#: Slurm's base states of a job that has ended, in every supported version.
FINISHED_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)


@dataclass(frozen=True)
class ExitStatus:
    """How a job's batch script ended: a return code, or the signal that killed it."""

    return_code: int | None = None
    signal: int | None = None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if status & 0x7F:
            return cls(signal=status & 0x7F)
        return cls(return_code=(status >> 8) & 0xFF)

    @property
    def failed(self) -> bool:
        return bool(self.signal) or bool(self.return_code)

    def text(self) -> str | None:
        """``signal 9`` / ``exit 3``; None for a clean exit or none known."""
        if self.signal:
            return f"signal {self.signal}"
        if self.return_code:
            return f"exit {self.return_code}"
        return None


@dataclass(frozen=True)
class JobInfo:
    """One job from ``squeue --json``, ``scontrol show job --json`` or ``scontrol show job -o``.

    ``state`` is shown as 22.05 shows it (a COMPLETING/REQUEUED/... flag wins
    over the base state), ``base_state`` and ``state_flags`` are the parts.
    Times are epoch seconds, None where Slurm has none (unset or infinite).
    ``nodes``, ``excluded_nodes`` and ``required_nodes`` are hostlist text;
    slurmio.hostlist expands them.
    """

    job_id: str
    state: str
    base_state: str
    state_flags: tuple[str, ...] = ()
    restart_cnt: int = 0
    submit_time: int | None = None
    start_time: int | None = None
    end_time: int | None = None
    suspend_time: int | None = None
    nodes: str = ""
    excluded_nodes: str = ""
    required_nodes: str = ""
    partition: str | None = None
    name: str | None = None
    user: str | None = None
    account: str | None = None
    comment: str | None = None
    state_reason: str | None = None
    priority: int | None = None
    batch_host: str | None = None
    tasks: int | None = None
    std_out: str | None = None
    std_err: str | None = None
    exit: ExitStatus | None = None

    @property
    def held(self) -> bool:
        """Pending with a hold: priority 0 or a JobHeld* reason (requeuehold sets JobHeldAdmin)."""
        return self.priority == 0 or (self.state_reason or "").startswith("JobHeld")


@dataclass(frozen=True)
class NodeInfo:
    """One node from ``sinfo --json``, ``scontrol show node --json`` or ``scontrol show node -o``.

    ``state`` is the base state, upper case (IDLE, MIXED, DOWN, ...); a drained
    idle node is IDLE with flag DRAIN on every version.
    """

    name: str
    state: str
    flags: tuple[str, ...] = ()
    reason: str | None = None
    reason_time: int | None = None
    reason_user: str | None = None
    partitions: tuple[str, ...] = field(default=())

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags
