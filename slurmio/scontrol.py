"""``scontrol show job|node``: JSON where the version has it (23.11+), ``-o`` text where not (22.05).

`show_job` / `show_node` pick the form from the cluster's data parser
(dataparsers.yaml ``scontrol_json``), which a caller learns from any JSON
document of that cluster (e.g. its last ``squeue --json``), and return the
same `JobInfo` / `NodeInfo` either way.

The text form is one ``Key=value`` line per record; values may contain spaces
(Reason=, Comment=, paths), so a value runs up to the next `` Key=``. Its
times are local-time text, so a JobInfo from text has no times.
"""

from __future__ import annotations

import re

from slurmio.records import ExitStatus, JobInfo, NodeInfo
from slurmio.runners import Runner, SlurmCommandError
from slurmio.sinfo import read_nodes
from slurmio.squeue import read_jobs
from slurmio.versions import DataParser, SlurmFormatError, vocabulary

__all__ = [
    "NO_SUCH_JOB",
    "is_no_such_job",
    "job_from_text",
    "node_from_text",
    "parse_scontrol_line",
    "show_job",
    "show_node",
]

#: What scontrol/squeue print for a job slurmctld does not know (never existed or purged).
NO_SUCH_JOB = "invalid job id specified"
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")
_EMPTY = ("", "(null)", "None", "N/A", "none")
_JOB_ID_RE = re.compile(r"[0-9]{1,12}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse_scontrol_line(line: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` line -> Key -> value.

    The text form has no quoting: a value runs until the next " Key=". A job's owner writes
    some values (JobName, Comment), so "JobName=x NodeList=gpu06" would plant a second
    NodeList; a key seen twice is refused (SlurmFormatError), never resolved either way.
    """
    fields: dict[str, str] = {}
    matches = list(_KEY_RE.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        key = m.group(1)
        if key in fields:
            raise SlurmFormatError(
                f"scontrol show -o: field {key} appears twice (a value carrying ' {key}=' text?): line refused"
            )
        fields[key] = line[m.end() : end].strip()
    return fields


def is_no_such_job(exc: SlurmCommandError) -> bool:
    return NO_SUCH_JOB in (exc.stderr or str(exc)).lower()


def _opt(value: str | None) -> str | None:
    if value is None:
        return None
    text = value.strip()
    return None if text in _EMPTY else text


def _int(value: str | None, what: str, key: str) -> int | None:
    text = _opt(value)
    if text is None:
        return None
    if not text.isdigit():
        raise SlurmFormatError(f"{what}: field {key}: expected digits, got {text[:40]!r}")
    return int(text)


def job_from_text(line: str, what: str = "scontrol show job -o") -> JobInfo:
    f = parse_scontrol_line(line)
    job_id = f.get("JobId", "")
    if not _JOB_ID_RE.fullmatch(job_id):
        raise SlurmFormatError(f"{what}: field JobId: expected a job id, got {job_id[:40]!r}")
    state = (f.get("JobState") or "").upper()
    if not state:
        raise SlurmFormatError(f"{what}: field JobState: missing for job {job_id}")
    base = state if state in vocabulary().job_base_states else ""
    exit_status = None
    if (code := _opt(f.get("ExitCode"))) is not None:
        rc, _, sig = code.partition(":")
        if not (rc.isdigit() and sig.isdigit()):
            raise SlurmFormatError(f"{what}: field ExitCode: expected RC:SIGNAL, got {code[:40]!r}")
        exit_status = ExitStatus(return_code=int(rc), signal=int(sig) or None)
    user = _opt(f.get("UserId"))
    return JobInfo(
        job_id=job_id,
        state=state,
        base_state=base,
        state_flags=() if base else (state,),
        restart_cnt=_int(f.get("Restarts"), what, "Restarts") or 0,
        nodes=_opt(f.get("NodeList")) or "",
        excluded_nodes=_opt(f.get("ExcNodeList")) or "",
        required_nodes=_opt(f.get("ReqNodeList")) or "",
        partition=_opt(f.get("Partition")),
        name=_opt(f.get("JobName")),
        user=user.split("(", 1)[0] if user else None,  # "root(0)"
        account=_opt(f.get("Account")),
        comment=_opt(f.get("Comment")),
        state_reason=_opt(f.get("Reason")),
        priority=_int(f.get("Priority"), what, "Priority"),
        batch_host=_opt(f.get("BatchHost")),
        tasks=_int(f.get("NumTasks"), what, "NumTasks"),
        std_out=_opt(f.get("StdOut")),
        std_err=_opt(f.get("StdErr")),
        exit=exit_status,
    )


_REASON_TAIL = re.compile(r"\s*\[([^@\]]*)@([^\]]*)\]$")


def node_from_text(line: str, what: str = "scontrol show node -o") -> NodeInfo:
    f = parse_scontrol_line(line)
    name = f.get("NodeName", "")
    if not _NODE_RE.fullmatch(name):
        raise SlurmFormatError(f"{what}: field NodeName: expected a node name, got {name[:40]!r}")
    words = [w for w in (f.get("State") or "").upper().split("+") if w]
    bases = [w for w in words if w in vocabulary().node_base_states]
    if len(bases) != 1:
        raise SlurmFormatError(f"{what}: field State of {name}: expected one base state, got {words!r}")
    reason = _opt(f.get("Reason"))
    user = None
    if reason and (m := _REASON_TAIL.search(reason)):
        # "Reason=xid 79 [root@2026-12-01T20:27:20]": who set it, and when (local time text).
        user, reason = m.group(1) or None, reason[: m.start()].strip() or None
    return NodeInfo(
        name=name,
        state=bases[0],
        flags=tuple(sorted(set(words) - {bases[0]})),
        reason=reason,
        reason_user=user,
        partitions=tuple(p for p in (_opt(f.get("Partitions")) or "").split(",") if p),
    )


def show_job(runner: Runner, job_id: str, timeout: float, parser: DataParser) -> JobInfo | None:
    """The job as scontrol sees it; None when slurmctld does not know it."""
    if not _JOB_ID_RE.fullmatch(job_id):
        raise ValueError(f"invalid job id {job_id!r}: digits only")
    if parser.scontrol_json:
        argv = ["scontrol", "show", "job", "--json", job_id]
        try:
            doc = read_jobs(runner(argv, timeout), "scontrol show job --json")
        except SlurmCommandError as exc:
            if is_no_such_job(exc):
                return None
            raise
        # 24.11 answers an unknown id with an empty list and exit 0.
        return doc.jobs.get(job_id)
    try:
        out = runner(["scontrol", "show", "job", "-o", job_id], timeout)
    except SlurmCommandError as exc:
        if is_no_such_job(exc):
            return None
        raise
    for line in out.splitlines():
        if line.startswith(f"JobId={job_id} "):
            return job_from_text(line)
    return None


def show_node(runner: Runner, node: str, timeout: float, parser: DataParser) -> NodeInfo | None:
    """The node as scontrol sees it; None when slurmctld does not know it."""
    if not _NODE_RE.fullmatch(node):
        raise ValueError(f"invalid node name {node!r}")
    if parser.scontrol_json:
        doc = read_nodes(runner(["scontrol", "show", "node", "--json", node], timeout))
        return doc.nodes.get(node)
    out = runner(["scontrol", "show", "node", "-o", node], timeout)
    for line in out.splitlines():
        if line.startswith(f"NodeName={node} "):
            return node_from_text(line)
    return None
