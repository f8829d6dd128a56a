"""Slurm backend that drives the Slurm command-line tools (scontrol, squeue, ...).

Commands are argv lists run without a shell. Where they run is decided by a
``CommandRunner``: ``LocalRunner`` runs them on this machine with an explicit
environment; an SSH runner (same call signature) can be plugged in later to run
them on a login node. Every user-supplied value is validated before any command
is built, so a bad node name or job id never reaches a process.

Checked against Slurm 22.05 (openapi v0.0.38 JSON from ``sinfo``/``squeue``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sinks.backends.base import BackendError, JobState, NodeState

__all__ = [
    "CommandResult",
    "CommandRunner",
    "JobNotFoundError",
    "LocalRunner",
    "SlurmCliBackend",
    "validate_job_id",
    "validate_node_name",
    "validate_reason",
]

_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_JOB_ID_RE = re.compile(r"[0-9]{1,12}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_NO_SUCH_JOB = "invalid job id specified"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_EMPTY = ("", "(null)", "None", "N/A")


class JobNotFoundError(BackendError):
    """The scheduler does not know the job (never existed or already purged)."""


# --------------------------------------------------------------------- validation
def validate_node_name(node: str) -> str:
    """Return ``node`` if it is a plain Slurm node name, else raise ValueError."""
    if not isinstance(node, str) or _NODE_RE.fullmatch(node) is None:
        raise ValueError(f"invalid node name {node!r}: must match {_NODE_RE.pattern}")
    return node


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


# --------------------------------------------------------------------- transport
@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs one argv (never through a shell) and returns its result.

    Raises BackendError only when the command could not be run at all
    (missing binary, timeout, transport failure); a non-zero exit is returned.
    """

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult: ...


class LocalRunner:
    """Runs commands on this machine with ``subprocess.run(shell=False)``.

    The child gets an explicit, minimal environment (PATH, LC_ALL=C, HOME and
    SLURM_CONF) so stray SLURM_* variables of the caller cannot change what the
    commands do.
    """

    def __init__(
        self,
        slurm_conf: str | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        env: dict[str, str] = {
            "PATH": os.environ.get("PATH") or _DEFAULT_PATH,
            "LC_ALL": "C",
            "HOME": os.environ.get("HOME", "/"),
        }
        conf = slurm_conf if slurm_conf is not None else os.environ.get("SLURM_CONF")
        if conf:
            env["SLURM_CONF"] = conf
        if extra_env:
            env.update(extra_env)
        self.env: Mapping[str, str] = env

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        args = [str(a) for a in argv]
        try:
            proc = subprocess.run(
                args,
                shell=False,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=dict(self.env),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise BackendError(f"{shlex.join(args)} timed out after {timeout:g}s") from exc
        except OSError as exc:
            raise BackendError(f"{shlex.join(args)} could not be run: {exc}") from exc
        return CommandResult(tuple(args), proc.returncode, proc.stdout, proc.stderr)


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
        self._run_cmd: CommandRunner = runner if runner is not None else LocalRunner(slurm_conf)
        self.timeout = timeout

    # ---- plumbing
    def _exec(self, argv: Sequence[str]) -> CommandResult:
        return self._run_cmd(argv, self.timeout)

    def _run(self, argv: Sequence[str]) -> CommandResult:
        res = self._exec(argv)
        if res.returncode != 0:
            raise _error(res)
        return res

    # ---- nodes
    def drain_node(self, node: str, reason: str) -> None:
        validate_node_name(node)
        validate_reason(reason)
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

    def node_state(self, node: str) -> NodeState:
        validate_node_name(node)
        # 22.05's `sinfo --json` ignores -n, so filter here.
        for state in self.list_nodes():
            if state.name == node:
                return state
        raise BackendError(f"sinfo --json: no such node {node!r}")

    def list_nodes(self) -> list[NodeState]:
        data = _load_json(self._run(["sinfo", "--json"]))
        return [_node_from_json(e) for e in data.get("nodes") or [] if isinstance(e, dict)]

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
                self._exec(["scontrol", "release", job_id])
            raise
        if not was_held:
            self._run(["scontrol", "release", job_id])

    def cancel_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # scancel exits 0 for unknown jobs, so make sure the job exists first
        # (checking only afterwards would race with MinJobAge purging it).
        self.job_state(job_id)
        self._run(["scancel", job_id])

    def hold_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # `scontrol hold` only holds pending jobs; a running one must be requeued held to stop it.
        running = self.job_state(job_id).state in ("RUNNING", "CONFIGURING", "SUSPENDED")
        self._run(["scontrol", "requeuehold" if running else "hold", job_id])

    def release_job(self, job_id: str) -> None:
        self._run(["scontrol", "release", validate_job_id(job_id)])

    def job_state(self, job_id: str) -> JobState:
        job_id = validate_job_id(job_id)
        res = self._exec(["squeue", "--json", "--jobs", job_id])
        if res.returncode == 0:
            # 22.05's `squeue --json` ignores --jobs and lists every job: filter here.
            for entry in _load_json(res).get("jobs") or []:
                if isinstance(entry, dict) and str(entry.get("job_id")) == job_id:
                    return self._job_from_json(job_id, entry)
        elif _NO_SUCH_JOB not in res.stderr.lower():
            raise _error(res)
        return self._job_from_scontrol(job_id)

    # ---- parsing helpers
    def expand_hostlist(self, nodelist: str | None) -> tuple[str, ...]:
        """Expand a Slurm hostlist like ``gpu[01-03],cpu1`` to node names."""
        if nodelist is None or nodelist.strip() in _EMPTY:
            return ()
        text = nodelist.strip()
        if "[" not in text:
            return tuple(n for n in text.split(",") if n)
        out = self._run(["scontrol", "show", "hostnames", text]).stdout
        return tuple(line.strip() for line in out.splitlines() if line.strip())

    def _job_from_json(self, job_id: str, entry: Mapping[str, Any]) -> JobState:
        extra = {
            k: str(entry[k])
            for k in ("state_reason", "priority", "batch_host", "required_nodes")
            if entry.get(k) is not None
        }
        return JobState(
            job_id=job_id,
            state=str(entry.get("job_state") or "UNKNOWN").upper(),
            nodes=self.expand_hostlist(_opt_str(entry.get("nodes"))),
            excluded_nodes=self.expand_hostlist(_opt_str(entry.get("excluded_nodes"))),
            partition=_opt_str(entry.get("partition")),
            name=_opt_str(entry.get("name")),
            restart_count=_to_int(entry.get("restart_cnt")),
            comment=_opt_str(entry.get("comment")),
            held=_held(extra),
            extra=extra,
        )

    def _job_from_scontrol(self, job_id: str) -> JobState:
        res = self._exec(["scontrol", "show", "job", "-o", job_id])
        if res.returncode != 0:
            if _NO_SUCH_JOB in res.stderr.lower():
                raise JobNotFoundError(f"job {job_id} does not exist: {_describe(res)}")
            raise _error(res)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("JobId=")), "")
        fields = parse_scontrol_line(line)
        if fields.get("JobId") != job_id:
            raise JobNotFoundError(f"job {job_id} does not exist: {_describe(res)}")
        state = fields.get("JobState", "UNKNOWN").upper()
        names = {
            "Reason": "state_reason",
            "Priority": "priority",
            "BatchHost": "batch_host",
            "ReqNodeList": "required_nodes",
        }
        extra = {ours: fields[theirs] for theirs, ours in names.items() if theirs in fields}
        return JobState(
            job_id=job_id,
            state=state,
            nodes=self.expand_hostlist(fields.get("NodeList")),
            excluded_nodes=self.expand_hostlist(fields.get("ExcNodeList")),
            partition=_opt_str(fields.get("Partition")),
            name=_opt_str(fields.get("JobName")),
            restart_count=_to_int(fields.get("Restarts")),
            comment=_opt_str(fields.get("Comment")),
            held=_held(extra),
            extra=extra,
        )


# --------------------------------------------------------------------- module helpers
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")


def _held(extra: Mapping[str, str]) -> bool:
    # A held job has priority 0 and a JobHeld* reason (requeuehold sets JobHeldAdmin).
    return extra.get("priority") == "0" or extra.get("state_reason", "").startswith("JobHeld")


def parse_scontrol_line(line: str) -> dict[str, str]:
    """Parse one ``scontrol show -o`` line into Key -> value.

    Values may contain spaces (Reason=, Command=, paths), so a value runs up to
    the next `` Key=``. The first occurrence of a key wins.
    """
    fields: dict[str, str] = {}
    matches = list(_KEY_RE.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields.setdefault(m.group(1), line[m.end() : end].strip())
    return fields


def _node_from_json(entry: Mapping[str, Any]) -> NodeState:
    raw_state = str(entry.get("state") or "UNKNOWN").upper()
    # Defensive: some versions put flags into the state string ("IDLE+DRAIN").
    base, *inline_flags = raw_state.split("+")
    flags = [str(f).upper() for f in entry.get("state_flags") or []]
    flags.extend(f for f in inline_flags if f and f not in flags)
    reason = entry.get("reason")
    partitions = entry.get("partitions") or []
    return NodeState(
        name=str(entry.get("name")),
        state=base,
        flags=tuple(flags),
        reason=str(reason) if reason else None,
        partitions=tuple(str(p) for p in partitions),
    )


def _load_json(res: CommandResult) -> dict[str, Any]:
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise BackendError(f"{shlex.join(res.argv)}: output is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BackendError(f"{shlex.join(res.argv)}: unexpected JSON {type(data).__name__}")
    errors = data.get("errors") or []
    if errors:
        raise BackendError(f"{shlex.join(res.argv)}: errors {errors!r}")
    return data


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


def _describe(res: CommandResult) -> str:
    err = res.stderr.strip() or res.stdout.strip() or "(no output)"
    return f"{shlex.join(res.argv)} exited {res.returncode}: {err}"


def _error(res: CommandResult) -> BackendError:
    return BackendError(_describe(res))
