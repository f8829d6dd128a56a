"""Jobs from ``squeue --json`` (and the same ``jobs`` documents of ``scontrol show job --json``
and slurmrestd), for data parser versions v0.0.38 (22.05) to v0.0.42 (24.11).

On 22.05 ``squeue --json`` ignores its filters (``--jobs``, ``--states``,
``--nodelist``) and lists every job, finished ones included; 23.02+ honour
them and, by default, list only pending and running jobs. Callers that need
finished states pass ``--states=all`` (`SQUEUE_ALL`); callers that filter
still check each record themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurmio.fields import Fields
from slurmio.records import JobInfo
from slurmio.versions import DataParser, SlurmFormatError, detect, load_document, vocabulary

__all__ = ["SQUEUE_ALL", "JobsDocument", "parse_job", "parse_jobs", "read_jobs"]

#: Every job slurmctld still holds, finished ones too (23.02+ hide them by default).
SQUEUE_ALL = ("squeue", "--json", "--states=all")


@dataclass(frozen=True)
class JobsDocument:
    parser: DataParser
    jobs: dict[str, JobInfo]


def read_jobs(text: str | bytes, what: str = "squeue --json") -> JobsDocument:
    """Decode and parse one ``jobs`` document."""
    return parse_jobs(load_document(text, what), what)


def parse_jobs(doc: Mapping[str, Any], what: str = "squeue --json") -> JobsDocument:
    parser = detect(doc, what)
    raw = doc.get("jobs")
    if not isinstance(raw, list):
        raise SlurmFormatError(f"{what} (data parser {parser.version}): no 'jobs' list")
    jobs: dict[str, JobInfo] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise SlurmFormatError(f"{what} (data parser {parser.version}): jobs[{i}] is not an object")
        job = parse_job(Fields(entry, parser, what, f"jobs[{i}]"))
        jobs[job.job_id] = job
    return JobsDocument(parser, jobs)


def parse_job(f: Fields) -> JobInfo:
    p = f.parser
    job_id = f.required("job_id")
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise f.fail("job_id", "an integer", job_id)
    base, flags, shown = _job_state(f)
    return JobInfo(
        job_id=str(job_id),
        state=shown,
        base_state=base,
        state_flags=flags,
        restart_cnt=f.integer("restart_cnt") or 0,
        submit_time=f.number("submit_time", p.job_times),
        start_time=f.number("start_time", p.job_times),
        end_time=f.number("end_time", p.job_times),
        suspend_time=f.number("suspend_time", p.job_times),
        nodes=f.text("nodes") or "",
        excluded_nodes=f.text("excluded_nodes") or "",
        required_nodes=f.text("required_nodes") or "",
        partition=f.text("partition"),
        name=f.text("name"),
        user=f.text("user_name"),
        account=f.text("account"),
        comment=f.text("comment"),
        state_reason=f.text("state_reason"),
        priority=f.number("priority", p.job_counts),
        batch_host=f.text("batch_host"),
        tasks=f.number("tasks", p.job_counts),
        std_out=f.text("standard_output"),
        std_err=f.text("standard_error"),
        exit=f.exit_status("exit_code", p.exit_code),
    )


def _job_state(f: Fields) -> tuple[str, tuple[str, ...], str]:
    words = f.state_words("job_state", f.parser.job_state)
    vocab = vocabulary()
    if f.parser.job_state == "string":
        # 22.05/23.02 print one word: a base state, or the flag job_state_string() shows first.
        (word,) = words[:1]
        base = word if word in vocab.job_base_states else ""
        return base, () if base else (word,), word
    base_words = [w for w in words if w in vocab.job_base_states]
    if len(base_words) != 1:
        raise f.fail("job_state", f"exactly one base state of {sorted(vocab.job_base_states)}", list(words))
    flags = tuple(w for w in words if w != base_words[0])
    shown = next((flag for flag in vocab.job_shown_flags if flag in flags), base_words[0])
    return base_words[0], flags, shown
