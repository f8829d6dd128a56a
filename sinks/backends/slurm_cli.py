"""Slurm backend that drives the Slurm command-line tools (scontrol, squeue, ...).

Commands are argv lists run without a shell. Where they run is decided by a
slurmio ``Runner`` (``(argv, timeout) -> stdout``, raising SlurmCommandError):
``LocalRunner`` runs them on this machine with an explicit environment; the
SSH runner (sinks/backends/slurm_ssh.py) runs them on a login node. Every
user-supplied value is validated before any command is built, so a bad node
name or job id never reaches a process.

All Slurm output is read through slurmio, so the backend works the same on
every data parser from 22.05 (v0.0.38) to 24.11 (v0.0.42); both ends are
tested against real clusters (infra/slurm/start.sh, start-2411.sh).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

from schemas.errors import NotFound
from schemas.ids import check_node_name
from sinks.backends.base import BackendError, JobState, NodeState, NotPermitted, refuse_node_action, refuse_relabel
from slurmio.hostlist import HostlistError
from slurmio.hostlist import expand_hostlist as _expand_hostlist
from slurmio.nodes import in_force, read_all_nodes
from slurmio.records import JobInfo, NodeInfo
from slurmio.reservations import maintenance_nodes, read_reservations
from slurmio.runners import LocalRunner, Runner, SlurmCommandError
from slurmio.scontrol import is_no_such_job, parse_scontrol_line, show_job, show_node
from slurmio.squeue import read_jobs
from slurmio.versions import DataParser, known_versions

#: The runner protocol the backend takes (slurmio's; kept under its old name).
CommandRunner = Runner

__all__ = [
    "CommandRunner",
    "JobNotFoundError",
    "LocalRunner",
    "SlurmCliBackend",
    "parse_scontrol_line",
    "validate_job_id",
    "validate_node_name",
    "validate_reason",
]

_JOB_ID_RE = re.compile(r"[0-9]{1,12}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_EMPTY = ("", "(null)", "None", "N/A")
# `scontrol show job -o` works on every version: the form to use before any JSON told us the version.
_TEXT_FORM = known_versions()["v0.0.38"]


class JobNotFoundError(NotFound, BackendError):
    """The scheduler does not know the job (never existed or already purged)."""


# --------------------------------------------------------------------- validation
def validate_node_name(node: str) -> str:
    """Return ``node`` if it is a plain Slurm node name (schemas.ids' grammar), else raise ValueError."""
    return check_node_name(node)


_SIGNAL_RE = re.compile(r"(B:)?(USR[12])")


def _user_signal(signal: str) -> tuple[bool, str]:
    """(batch shell only, signal name) of USR1, USR2, B:USR1 or B:USR2; BackendError for anything else:
    a signal a job does not handle ends it."""
    m = _SIGNAL_RE.fullmatch(signal)
    if m is None:
        raise BackendError(f"not sending {signal!r}: only USR1, USR2, B:USR1 or B:USR2 ask a job for a checkpoint")
    return bool(m.group(1)), m.group(2)


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` as a string of digits, else raise ValueError."""
    text = str(job_id) if isinstance(job_id, int) and not isinstance(job_id, bool) else job_id
    if not isinstance(text, str) or _JOB_ID_RE.fullmatch(text) is None:
        raise ValueError(f"invalid job id {job_id!r}: digits only")
    return text


def validate_reason(reason: str) -> str:
    """Return ``reason`` if it is non-empty and has no newline/control characters."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"invalid reason {reason!r}: must be a non-empty string")
    if _CONTROL_RE.search(reason):
        raise ValueError(f"invalid reason {reason!r}: contains newline or control characters")
    return reason


# --------------------------------------------------------------------- backend
class SlurmCliBackend:
    """SchedulerBackend on top of scontrol / squeue / sinfo / scancel."""

    name = "slurm-cli"

    def __init__(
        self,
        runner: CommandRunner | None = None,
        *,
        slurm_conf: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if runner is not None and slurm_conf is not None:
            raise ValueError("pass slurm_conf to the runner, not together with a custom runner")
        self._run_cmd: Runner = runner if runner is not None else LocalRunner(slurm_conf)
        self.timeout = timeout
        self.parser: DataParser | None = None  # the cluster's data parser, from the last JSON read

    # ---- plumbing
    def _raw(self, argv: Sequence[str]) -> str:
        """Run one command; SlurmCommandError (exit code and stderr included) passes through."""
        return self._run_cmd(argv, self.timeout)

    def _run(self, argv: Sequence[str]) -> str:
        try:
            return self._raw(argv)
        except SlurmCommandError as exc:
            _raise_backend_error(exc)

    # ---- nodes
    def drain_node(self, node: str, reason: str, *, node_failed: bool = False) -> None:
        """Drain the node; ActionRefused (nothing run) for a node in maintenance, drained or down."""
        validate_node_name(node)
        validate_reason(reason)
        state = self.node_state(node)
        refuse_node_action("drain", state, self.maintenance_reservation(node), node_failed=node_failed)
        self._run(
            [
                "scontrol",
                "update",
                f"NodeName={node}",
                "State=DRAIN",
                f"Reason={reason}",
            ]
        )

    def resume_node(self, node: str) -> None:
        validate_node_name(node)
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    def reboot_node(self, node: str, reason: str) -> str:
        validate_node_name(node)
        validate_reason(reason)
        refuse_relabel(node, self.node_state(node))
        base = ["scontrol", "reboot", "ASAP"]
        try:
            self._run([*base, "nextstate=DRAIN", f"reason={reason}", node])
            return "DRAIN"
        except BackendError as exc:
            # 22.05 knows DOWN and RESUME only ("Invalid state: DRAIN"): DOWN keeps it out too.
            if "Invalid state" not in str(exc):
                raise
        self._run([*base, "nextstate=DOWN", f"reason={reason}", node])
        return "DOWN"

    def relabel_node(self, node: str, reason: str) -> None:
        validate_node_name(node)
        validate_reason(reason)
        refuse_relabel(node, self.node_state(node))
        self._run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def node_state(self, node: str) -> NodeState:
        validate_node_name(node)
        # One node from scontrol (JSON on 23.11+, -o text before), never from 23.02+'s sinfo
        # --json: it groups nodes by state and gives the whole group ONE reason.
        try:
            found = show_node(self._run_cmd, node, self.timeout, self.parser or _TEXT_FORM)
        except SlurmCommandError as exc:
            _raise_backend_error(exc)
        if found is None:
            raise BackendError(f"scontrol show node: no such node {node!r}")
        return _node_state(in_force(found))

    def maintenance_reservation(self, node: str) -> str | None:
        """The active MAINT reservation holding the node, if any (BackendError when unreadable)."""
        try:
            return maintenance_nodes(read_reservations(self._run_cmd, self.timeout)).get(validate_node_name(node))
        except SlurmCommandError as exc:
            _raise_backend_error(exc)

    def list_nodes(self) -> list[NodeState]:
        try:
            self.parser, nodes = read_all_nodes(self._run_cmd, self.timeout, self.parser)
        except SlurmCommandError as exc:  # also a shape slurmio does not know (SlurmFormatError)
            _raise_backend_error(exc)
        return [_node_state(n) for n in nodes.values()]

    def annotate_job(self, job_id: str, note: str) -> None:
        self._run(["scontrol", "update", f"JobId={validate_job_id(job_id)}", f"Comment={validate_reason(note)}"])

    # ---- jobs
    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        job_id = validate_job_id(job_id)
        excluded = [validate_node_name(n) for n in exclude_nodes]
        current = self.job_state(job_id)
        # Keep nodes excluded earlier: a recovery should never re-admit a bad node.
        merged = list(dict.fromkeys([*current.excluded_nodes, *excluded]))
        update = [
            "scontrol",
            "update",
            f"JobId={job_id}",
            f"ExcNodeList={','.join(merged)}",
        ]
        if current.state == "PENDING":
            # Not started (or already requeued): it is queued; only narrow its nodes.
            if excluded:
                self._run(update)
            return
        if not excluded:
            self._run(["scontrol", "requeue", job_id])
            return
        # WHY: 22.05 rejects ExcNodeList on running jobs, so requeue (held) first.
        # The hold closes the window where it could restart before the update.
        was_held = current.extra.get("priority") == "0"
        self._run(["scontrol", "requeuehold", job_id])
        try:
            self._run(update)
        except BackendError:
            if not was_held:  # best effort; the update error is what gets reported
                with contextlib.suppress(SlurmCommandError, BackendError):
                    self._raw(["scontrol", "release", job_id])
            raise
        if not was_held:
            self._run(["scontrol", "release", job_id])

    def cancel_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # scancel exits 0 for unknown jobs, so make sure the job exists first
        # (checking only afterwards would race with MinJobAge purging it).
        self.job_state(job_id)
        self._run(["scancel", job_id])

    def signal_job(self, job_id: str, signal: str) -> None:
        job_id = validate_job_id(job_id)
        batch, name = _user_signal(signal)
        self.job_state(job_id)  # scancel exits 0 for unknown jobs too
        # --batch: the batch shell only (sbatch --signal=B:SIG); otherwise the job's steps, scancel's default.
        self._run(["scancel", f"--signal={name}", *(["--batch"] if batch else []), job_id])

    def hold_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # `scontrol hold` only holds pending jobs; a running one must be requeued held to stop it.
        running = self.job_state(job_id).state in ("RUNNING", "CONFIGURING", "SUSPENDED")
        self._run(["scontrol", "requeuehold" if running else "hold", job_id])

    def release_job(self, job_id: str) -> None:
        self._run(["scontrol", "release", validate_job_id(job_id)])

    def job_state(self, job_id: str) -> JobState:
        job_id = validate_job_id(job_id)
        try:
            # --states=all: 23.02+ answer a finished job's id with "Invalid job id" without it.
            doc = read_jobs(self._raw(["squeue", "--json", "--states=all", "--jobs", job_id]))
        except SlurmCommandError as exc:
            if isinstance(exc, BackendError) or not is_no_such_job(exc):
                _raise_backend_error(exc)
        else:
            self.parser = doc.parser
            # 22.05's `squeue --json` ignores --jobs and lists every job: the lookup filters.
            if job_id in doc.jobs:
                return self._job_state(doc.jobs[job_id])
        try:
            found = show_job(self._run_cmd, job_id, self.timeout, self.parser or _TEXT_FORM)
        except SlurmCommandError as exc:
            _raise_backend_error(exc)
        if found is None:
            raise JobNotFoundError(f"job {job_id} does not exist (squeue and scontrol do not know it)")
        return self._job_state(found)

    # ---- parsing helpers
    def expand_hostlist(self, nodelist: str | None) -> tuple[str, ...]:
        """Expand a Slurm hostlist like ``gpu[01-03],cpu1`` to node names (slurmio.hostlist)."""
        try:
            return tuple(_expand_hostlist(nodelist))
        except HostlistError as exc:
            raise BackendError(str(exc)) from exc

    def _job_state(self, job: JobInfo) -> JobState:
        extra = {
            k: str(v)
            for k, v in (
                ("state_reason", job.state_reason),
                ("priority", job.priority),
                ("batch_host", job.batch_host),
                ("required_nodes", job.required_nodes or None),
            )
            if v is not None
        }
        return JobState(
            job_id=job.job_id,
            state=job.state,
            nodes=self.expand_hostlist(job.nodes),
            excluded_nodes=self.expand_hostlist(job.excluded_nodes),
            partition=job.partition,
            name=job.name,
            restart_count=job.restart_cnt,
            comment=job.comment,
            held=job.held,
            extra=extra,
        )


# --------------------------------------------------------------------- module helpers
def _held(extra: Mapping[str, str]) -> bool:
    # A held job has priority 0 and a JobHeld* reason (requeuehold sets JobHeldAdmin).
    return extra.get("priority") == "0" or extra.get("state_reason", "").startswith("JobHeld")


# What slurmctld answers a user without the rights for a call (22.05 and 24.11).
_NOT_PERMITTED = ("Invalid user id", "Access/permission denied")


def _raise_backend_error(exc: SlurmCommandError) -> NoReturn:
    # The SSH runner's transport errors (SshHostKeyError, ...) are BackendErrors already: keep their type.
    if isinstance(exc, BackendError):
        raise exc
    said = f"{exc.stderr}\n{exc.stdout}"
    if any(p in said for p in _NOT_PERMITTED):
        raise NotPermitted(
            f"{exc} -- Slurm refused this to the user the backend runs as: draining or resuming a node "
            "needs AdminLevel=Administrator (or root/SlurmUser), requeue/hold/release/cancel of another "
            "user's job AdminLevel=Operator (docs/slurm.md)"
        ) from exc
    raise BackendError(str(exc)) from exc


def _node_state(node: NodeInfo) -> NodeState:
    return NodeState(
        name=node.name,
        state=node.state,
        flags=node.flags,
        reason=node.reason,
        partitions=node.partitions,
        reason_user=node.reason_user,
        reason_time=node.reason_time,
    )


def _opt_str(value: object) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return None if text in _EMPTY else text


def _to_int(value: object) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0
