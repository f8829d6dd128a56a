"""Optional Slurm backend that talks to slurmctld through pyslurm (libslurm) instead of the CLI.

UNTESTED on this project's machines: pyslurm has no release for Slurm 22.05
(the version of the local test cluster), so this module has never run against
a real pyslurm or slurmctld here. Only its import without pyslurm, the refusal
to start without it, the version checks and its signature against
``SchedulerBackend`` are tested (tests/unit/test_pyslurm_backend.py).

Targets the pyslurm API introduced in 23.2 (pyslurm 23.2.x to 25.x; a pyslurm
X.Y only works with Slurm X.Y, so Slurm 23.02 or newer):

* ``pyslurm.Node(name).modify(pyslurm.Node(state="DRAIN", reason=...))``,
  ``state="RESUME"``, ``pyslurm.Node.load(name)``, ``pyslurm.Nodes.load()``;
  ``Node.state`` is libslurm's complete state string (``IDLE+DRAIN``).
* ``pyslurm.Job.load(id)``, ``pyslurm.Job(id).requeue(hold=...)``, ``.cancel()``,
  ``.hold()``, ``.release()``, ``.modify(pyslurm.JobSubmitDescription(...))``
  with ``excluded_nodes`` / ``comment``.
* ``pyslurm.RPCError`` (``.errno``, ``.msg``), ``pyslurm.version()``,
  ``pyslurm.utils.nodelist_from_range_str`` (libslurm's hostlist expander).

pyslurm's version must name the same Slurm major release as ``scontrol
--version`` (or the ``slurm_version`` argument); a mismatch is refused.

Checked (stored copies, not the live site) against the PySlurm/pyslurm
repository's reference pages, which the https://pyslurm.github.io docs are
built from: docs/reference/node.md,
job.md, jobsubmitdescription.md, exceptions.md and utilities.md, and the code
they render: pyslurm/core/node.pyx, pyslurm/core/job/job.pyx,
pyslurm/core/job/submission.pyx, pyslurm/core/error.pyx,
pyslurm/utils/helpers.pyx, pyslurm/xcollections.pyx, pyslurm/version.py.

Semantics are those of ``SlurmCliBackend`` (same validation, same requeue
sequence, same state normalisation, ``JobNotFoundError`` for unknown jobs), so
the executor cannot tell the two apart. libslurm reads ``SLURM_CONF`` from this
process's environment when pyslurm is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sinks.backends.base import BackendError, JobState, NodeState, refuse_node_action, refuse_relabel

# The private helpers are shared on purpose: the two backends must normalise
# Slurm's placeholders, counters and hold markers identically.
from sinks.backends.slurm_cli import (
    JobNotFoundError,
    _held,
    _opt_str,
    _to_int,
    validate_job_id,
    validate_node_name,
    validate_reason,
)
from slurmio.runners import LocalRunner, SlurmCommandError

__all__ = ["PyslurmBackend", "check_versions", "slurm_major"]

INSTALL_HINT = "pip install 'trainmedic[pyslurm]'; it must match the site's Slurm major version"
# slurm/slurm_errno.h; RPCError.msg is "Invalid job id specified".
_ESLURM_INVALID_JOB_ID = 2017
_NO_SUCH_JOB = "invalid job id specified"
_VERSION_RE = re.compile(r"(\d+)\.(\d+)")
_PROBE_TIMEOUT_S = 10.0
_MIN_SLURM = (23, 2)  # the first Slurm with a pyslurm release of the Node/Job object API
# The 23.2+ object API this module calls; older pyslurm only has the dict API.
_REQUIRED_API = ("Node", "Nodes", "Job", "JobSubmitDescription", "RPCError")

_T = TypeVar("_T")


# --------------------------------------------------------------------- versions
def slurm_major(text: str) -> tuple[int, int]:
    """Return the (major, minor) release of a Slurm or pyslurm version string.

    Slurm writes ``22.05.8`` (``scontrol --version`` prints ``slurm 22.05.8``);
    pyslurm drops the zero, ``24.5.1``: both give (major, minor) of the release.
    """
    match = _VERSION_RE.search(text)
    if match is None:
        raise ValueError(f"no version number in {text!r}")
    return int(match.group(1)), int(match.group(2))


def check_versions(pyslurm_version: str, slurm_version: str) -> None:
    """Raise BackendError unless pyslurm is the release made for that Slurm major version."""
    try:
        ours, theirs = slurm_major(pyslurm_version), slurm_major(slurm_version)
    except ValueError as exc:
        raise BackendError(f"pyslurm version check: {exc}") from exc
    if theirs < _MIN_SLURM:
        raise BackendError(
            f"the local Slurm is {slurm_version.strip()}: pyslurm's Node/Job API (pyslurm 23.2+) needs "
            "Slurm 23.02 or newer; use the slurm-cli or slurm-ssh backend"
        )
    if ours != theirs:
        raise BackendError(
            f"pyslurm {pyslurm_version} is for Slurm {ours[0]}.{ours[1]:02d}, but the local Slurm is "
            f"{slurm_version.strip()}: install the pyslurm {theirs[0]}.{theirs[1]}.x release ({INSTALL_HINT})"
        )


def _local_slurm_version() -> str:
    # 22.05's scontrol loads slurm.conf even for --version, so use the same
    # environment hygiene (and SLURM_CONF) as the CLI backend.
    hint = "pass slurm_version='XX.YY' to PyslurmBackend"
    try:
        out = LocalRunner()(["scontrol", "--version"], _PROBE_TIMEOUT_S)
    except SlurmCommandError as exc:  # slurmio's runner: the message names the command and its exit
        raise BackendError(f"cannot determine the local Slurm version: {exc}; {hint}") from exc
    if _VERSION_RE.search(out) is None:
        raise BackendError(
            f"cannot determine the local Slurm version: scontrol --version printed {out.strip()[:200]!r}; {hint}"
        )
    return out.strip()


def _import_pyslurm() -> Any:
    try:
        return importlib.import_module("pyslurm")
    except ModuleNotFoundError as exc:
        if exc.name == "pyslurm":
            raise BackendError(f"pyslurm is not installed ({INSTALL_HINT})") from exc
        raise BackendError(f"pyslurm could not be imported: {exc} ({INSTALL_HINT})") from exc
    except (ImportError, OSError) as exc:
        # Typically libslurm.so.NN of another Slurm major than pyslurm was built for.
        raise BackendError(f"pyslurm could not be imported: {exc} ({INSTALL_HINT})") from exc


# --------------------------------------------------------------------- backend
class PyslurmBackend:
    """SchedulerBackend on top of pyslurm's Node/Job API (pyslurm 23.2+)."""

    name = "pyslurm"

    def __init__(self, *, slurm_version: str | None = None) -> None:
        """Import pyslurm and refuse a pyslurm that does not match the local Slurm.

        ``slurm_version`` is the site's Slurm version (``24.05.1``); by default it
        is read from ``scontrol --version``.
        """
        ps = _import_pyslurm()
        version_fn = getattr(ps, "version", None)
        pyslurm_version = str(version_fn() if callable(version_fn) else getattr(ps, "__version__", ""))
        check_versions(pyslurm_version, slurm_version or _local_slurm_version())
        missing = [n for n in _REQUIRED_API if not hasattr(ps, n)]
        if missing or not hasattr(ps.Node, "load") or not hasattr(ps.Nodes, "load"):
            raise BackendError(
                f"pyslurm {pyslurm_version} lacks the 23.2+ API (pyslurm.Node.load, pyslurm.Job, ...; "
                f"missing {', '.join(missing) or 'Node.load/Nodes.load'}): {INSTALL_HINT}"
            )
        self._ps: Any = ps
        errors = [ps.RPCError]
        # Newer releases document a PyslurmError next to RPCError; catch it where present.
        base_error = getattr(ps, "PyslurmError", None)
        if isinstance(base_error, type) and issubclass(base_error, Exception):
            errors.append(base_error)
        self._errors: tuple[type[BaseException], ...] = tuple(errors)
        self._expand: Callable[[str], Any] = _find_expander(ps)
        self.pyslurm_version = pyslurm_version

    # ---- plumbing
    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except self._errors as exc:
            raise BackendError(f"pyslurm {what}: {_describe(exc)}") from exc

    def _job(self, job_id: str) -> Any:
        return self._ps.Job(int(job_id))

    # ---- nodes
    def drain_node(self, node: str, reason: str, *, node_failed: bool = False) -> None:
        validate_node_name(node)
        validate_reason(reason)
        # The same refusals as every backend; reservations are not read through pyslurm yet.
        refuse_node_action("drain", self.node_state(node), None, node_failed=node_failed)
        changes = self._ps.Node(state="DRAIN", reason=reason)
        self._call(f"drain node {node} (reason {reason!r})", lambda: self._ps.Node(node).modify(changes))

    def resume_node(self, node: str) -> None:
        validate_node_name(node)
        changes = self._ps.Node(state="RESUME")
        self._call(f"resume node {node}", lambda: self._ps.Node(node).modify(changes))

    def reboot_node(self, node: str, reason: str) -> str:
        # Not read through pyslurm yet: refused, nothing sent (the node stays drained).
        raise BackendError(f"not rebooting {node}: the pyslurm backend does not reboot nodes; use the CLI backend")

    def relabel_node(self, node: str, reason: str) -> None:
        validate_node_name(node)
        validate_reason(reason)
        refuse_relabel(node, self.node_state(node))
        changes = self._ps.Node(state="DRAIN", reason=reason)
        self._call(f"relabel node {node} (reason {reason!r})", lambda: self._ps.Node(node).modify(changes))

    def node_state(self, node: str) -> NodeState:
        validate_node_name(node)
        loaded = self._call(f"Node.load({node!r})", lambda: self._ps.Node.load(node))
        state = _node_view(loaded)
        # pyslurm's own comment: an unknown name has been seen to return another node.
        if state.name != node:
            raise BackendError(f"pyslurm Node.load({node!r}): no such node (got {state.name!r})")
        return state

    def list_nodes(self) -> list[NodeState]:
        nodes = self._call("Nodes.load()", lambda: self._ps.Nodes.load())
        # Nodes has been a list in some releases and a dict-like collection (values()
        # are the nodes, iteration gives names) in others: accept both.
        items = nodes.values() if hasattr(nodes, "values") else nodes
        return [_node_view(n) for n in items]

    def annotate_job(self, job_id: str, note: str) -> None:
        job_id = validate_job_id(job_id)
        validate_reason(note)
        changes = self._ps.JobSubmitDescription(comment=note)
        self._call(f"set comment of job {job_id}", lambda: self._job(job_id).modify(changes))

    # ---- jobs
    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        job_id = validate_job_id(job_id)
        excluded = [validate_node_name(n) for n in exclude_nodes]
        current = self.job_state(job_id)
        # Keep nodes excluded earlier: a recovery should never re-admit a bad node.
        merged = list(dict.fromkeys([*current.excluded_nodes, *excluded]))
        if current.state == "PENDING":
            # Not started (or already requeued): it is queued; only narrow its nodes.
            if excluded:
                self._set_excluded(job_id, merged)
            return
        if not excluded:
            self._call(f"requeue job {job_id}", lambda: self._job(job_id).requeue())
            return
        # WHY: Slurm rejects ExcNodeList on running jobs (22.05 at least), so requeue
        # held first, as the CLI backend does. The hold closes the window where the
        # job could restart before the update.
        was_held = current.extra.get("priority") == "0"
        self._call(f"requeue job {job_id} held", lambda: self._job(job_id).requeue(hold=True))
        try:
            self._set_excluded(job_id, merged)
        except BackendError:
            if not was_held:  # best effort; the update error is what gets reported
                with contextlib.suppress(BackendError):
                    self.release_job(job_id)
            raise
        if not was_held:
            self.release_job(job_id)

    def _set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        text = ",".join(nodes)
        changes = self._ps.JobSubmitDescription(excluded_nodes=text)
        self._call(f"set excluded nodes of job {job_id} to {text}", lambda: self._job(job_id).modify(changes))

    def cancel_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # pyslurm's cancel() (SIGKILL) ignores unknown job ids like scancel, so make
        # sure the job exists first (afterwards would race with MinJobAge purging it).
        self.job_state(job_id)
        self._call(f"cancel job {job_id}", lambda: self._job(job_id).cancel())

    def signal_job(self, job_id: str, signal: str) -> None:
        # Not read through pyslurm yet: refused, nothing sent (the migration waits for the job's own save).
        raise BackendError(
            f"not signalling job {job_id}: the pyslurm backend does not send signals; use the CLI backend"
        )

    def hold_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        # A hold only applies to pending jobs; a running one must be requeued held to stop it.
        if self.job_state(job_id).state in ("RUNNING", "CONFIGURING", "SUSPENDED"):
            self._call(f"requeue job {job_id} held", lambda: self._job(job_id).requeue(hold=True))
        else:
            self._call(f"hold job {job_id}", lambda: self._job(job_id).hold())

    def release_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        self._call(f"release job {job_id}", lambda: self._job(job_id).release())

    def job_state(self, job_id: str) -> JobState:
        job_id = validate_job_id(job_id)
        try:
            job = self._ps.Job.load(int(job_id))
        except self._errors as exc:
            if _is_no_such_job(exc):
                raise JobNotFoundError(
                    f"job {job_id} does not exist: pyslurm Job.load({job_id}): {_describe(exc)}"
                ) from exc
            raise BackendError(f"pyslurm Job.load({job_id}): {_describe(exc)}") from exc
        extra = {
            key: str(value)
            for key, value in (
                ("state_reason", job.state_reason),
                ("priority", job.priority),
                ("batch_host", job.batch_host),
                ("required_nodes", job.required_nodes),
            )
            if value is not None
        }
        return JobState(
            job_id=job_id,
            state=str(job.state or "UNKNOWN").upper(),
            nodes=self.expand_hostlist(job.allocated_nodes),
            excluded_nodes=self.expand_hostlist(job.excluded_nodes),
            partition=_opt_str(job.partition),
            name=_opt_str(job.name),
            restart_count=_to_int(job.requeue_count),
            comment=_opt_str(job.comment),
            held=_held(extra),
            extra=extra,
        )

    # ---- parsing helpers
    def expand_hostlist(self, nodelist: str | None) -> tuple[str, ...]:
        """Expand a Slurm hostlist like ``gpu[01-03],cpu1`` to node names (libslurm's expander)."""
        text = _opt_str(nodelist)
        if text is None:
            return ()
        if "[" not in text:
            return tuple(n for n in text.split(",") if n)
        names = self._call(f"expand hostlist {text}", lambda: self._expand(text))
        if not names:  # pyslurm returns [] or None when libslurm cannot parse it
            raise BackendError(f"pyslurm nodelist_from_range_str({text!r}): cannot expand")
        return tuple(str(n) for n in names)


# --------------------------------------------------------------------- module helpers
def _find_expander(ps: Any) -> Callable[[str], Any]:
    for where in ("pyslurm.utils", "pyslurm"):
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        fn = getattr(module, "nodelist_from_range_str", None)
        if callable(fn):
            return fn
    raise BackendError(f"pyslurm {getattr(ps, '__version__', '?')} has no nodelist_from_range_str: {INSTALL_HINT}")


def _node_view(node: Any) -> NodeState:
    # Node.state is libslurm's node_state_string_complete(): base state, then
    # "+"-joined flags (IDLE+DRAIN, DOWN+DRAIN+NOT_RESPONDING), as the CLI
    # backend's sinfo parsing splits them.
    base, *inline_flags = str(node.state or "UNKNOWN").upper().split("+")
    reason = node.reason
    return NodeState(
        name=str(node.name),
        state=base,
        flags=tuple(dict.fromkeys(f for f in inline_flags if f)),
        reason=str(reason) if reason else None,
        partitions=tuple(str(p) for p in node.partitions or []),
    )


def _describe(exc: BaseException) -> str:
    errno = getattr(exc, "errno", None)
    text = str(getattr(exc, "msg", None) or exc) or type(exc).__name__
    return f"{text} (errno {errno})" if isinstance(errno, int) and errno > 0 else text


def _is_no_such_job(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == _ESLURM_INVALID_JOB_ID or _NO_SUCH_JOB in str(exc).lower()
