"""`trainmedic diagnose --job ID`: diagnose a Slurm job from what Slurm knows about it.

The job's StdOut/StdErr paths, node list and task count are read through slurmio
(``scontrol show job --json`` on 23.11+, ``scontrol show job -o`` on 22.05, the form chosen
from the data parser of the cluster's ``squeue --json``), the node list is expanded, and those
files go to `trainmedic.ops.diagnose.diagnose_paths` with the node list and ranks per node, so a
culprit rank is resolved to its node. It works for a finished job as long as slurmctld still
knows it (MinJobAge). An unknown job, a job without output files, or files this host cannot
read are refused with `DiagnoseError` naming what is wrong.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.records import JobInfo
from slurmio.runners import LocalRunner, Runner, SlurmCommandError
from slurmio.scontrol import is_no_such_job, show_job
from slurmio.squeue import SQUEUE_ALL, read_jobs
from trainmedic.ops.diagnose import DiagnoseError, OfflineSettings, diagnose_paths

__all__ = ["SlurmJob", "diagnose_job", "read_job"]

_JOB_ID = re.compile(r"[0-9]{1,12}")
_NO_FILE = ("/dev/null",)


@dataclass(frozen=True)
class SlurmJob:
    """What diagnosis needs of a job, as slurmctld reports it."""

    job_id: str
    state: str
    nodelist: str  # Slurm hostlist text, as scontrol prints it
    nodes: tuple[str, ...]
    ranks_per_node: int | None  # tasks / nodes when they divide evenly; else the log may say
    paths: tuple[Path, ...]  # StdOut, then StdErr when it is another file
    slurm: str  # the data parser (and release) that answered

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "nodelist": self.nodelist,
            "nodes": list(self.nodes),
            "ranks_per_node": self.ranks_per_node,
            "paths": [str(p) for p in self.paths],
            "slurm": self.slurm,
        }


def read_job(job_id: str, runner: Runner, timeout: float = 30.0) -> SlurmJob:
    """The job's files and placement through slurmio; DiagnoseError if Slurm cannot say."""
    if not _JOB_ID.fullmatch(job_id):
        raise DiagnoseError(f"--job {job_id!r}: a Slurm job id is digits only")
    try:
        # The cluster's data parser picks scontrol's form (22.05 squeue --json lists the whole queue).
        parser = read_jobs(runner([*SQUEUE_ALL, "--jobs", job_id], timeout), "squeue --json").parser
        job = show_job(runner, job_id, timeout, parser)
    except SlurmCommandError as exc:  # SlurmFormatError too
        if is_no_such_job(exc):
            job = None
        else:
            raise DiagnoseError(f"job {job_id}: Slurm could not be asked: {exc}") from None
    if job is None:
        raise DiagnoseError(
            f"job {job_id} is not known to slurmctld (never existed, or finished longer ago than MinJobAge)"
        )
    return _describe(job, f"data parser {parser.version}" + (f", Slurm {parser.release}" if parser.release else ""))


def _describe(job: JobInfo, slurm: str) -> SlurmJob:
    try:
        nodes = tuple(expand_hostlist(job.nodes))
    except HostlistError as exc:
        raise DiagnoseError(f"job {job.job_id}: node list {job.nodes!r}: {exc}") from None
    paths = tuple(dict.fromkeys(Path(p) for p in (job.std_out, job.std_err) if p and p not in _NO_FILE))
    if not paths:
        raise DiagnoseError(f"job {job.job_id} ({job.state}) has no output file (StdOut/StdErr unset or /dev/null)")
    for p in paths:
        if "%" in p.name or "%" in str(p.parent):
            raise DiagnoseError(f"job {job.job_id}: Slurm gave an unexpanded output pattern {str(p)!r}")
    unreadable = [f"{p} ({_why_unreadable(p)})" for p in paths if _why_unreadable(p)]
    if unreadable:
        raise DiagnoseError(
            f"job {job.job_id}: cannot read its output {', '.join(unreadable)}; run diagnose where the files are "
            f"(a shared filesystem, or the batch host {job.batch_host or '?'})"
        )
    tasks = job.tasks
    rpn = tasks // len(nodes) if tasks and nodes and tasks % len(nodes) == 0 else None
    return SlurmJob(job.job_id, job.state, job.nodes, nodes, rpn, paths, slurm)


def _why_unreadable(path: Path) -> str | None:
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a regular file"
    if not os.access(path, os.R_OK):
        return "permission denied"
    return None


def diagnose_job(
    job_id: str,
    *,
    extra_paths: Sequence[str | Path] = (),
    slurm_conf: str | None = None,
    runner: Runner | None = None,
    ranks_per_node: int | None = None,
    distribution: str = "block",
    settings: OfflineSettings | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Diagnose the job's output (plus `extra_paths`, e.g. kernel logs) with its node list.

    `ranks_per_node` overrides the job's tasks / nodes. The report gets a ``job`` entry.
    """
    job = read_job(job_id, runner or LocalRunner(slurm_conf), timeout)
    report = diagnose_paths(
        [*job.paths, *extra_paths],
        nodelist=job.nodelist or None,
        ranks_per_node=ranks_per_node if ranks_per_node is not None else job.ranks_per_node,
        distribution=distribution,
        settings=settings,
    )
    report["job"] = job.as_dict()
    return report
