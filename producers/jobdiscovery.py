"""Find running jobs' output files from Slurm and follow them.

One `squeue --json` per poll lists RUNNING jobs (or, node-local, the Slurm
producer's events on the bus: producers.placements); each new job is looked up once
with `scontrol show job` (``--json`` on 23.11+, ``-o`` text on 22.05, chosen
from the squeue document's data parser) for its StdOut/StdErr paths (expanded
by Slurm, unlike 22.05 squeue's patterns), node list and task count. A tailer
then follows those files until the job leaves RUNNING. Restarted (requeued)
jobs are followed again with their new allocation. All Slurm output is read
through slurmio, so 22.05 to 24.11 give the same result.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.metrics import POLL_FAILURES
from producers.position import FilePosition, PositionStore
from slurmio.hostlist import expand_hostlist
from slurmio.runners import LocalRunner, Runner, SlurmCommandError
from slurmio.scontrol import parse_scontrol_line, show_job
from slurmio.squeue import read_jobs
from slurmio.versions import DataParser

log = logging.getLogger("trainmedic.jobdiscovery")

#: `scontrol show job -o` line -> fields; slurmio's one text parser.
parse_scontrol_job = parse_scontrol_line


@dataclass(frozen=True)
class JobFiles:
    job_id: str
    restarts: int
    nodes: tuple[str, ...]
    partition: str | None
    ranks_per_node: int | None
    paths: tuple[Path, ...]


class JobDiscovery:
    """Keeps one JobLogProducer per running job whose output files this host can read."""

    def __init__(
        self,
        publisher: Publisher,
        runner: Runner | None = None,
        only_node: str | None = None,
        timeout_s: float = 30.0,
        tailer_factory: Callable[[JobFiles], JobLogProducer] | None = None,
        positions: PositionStore | None = None,
    ) -> None:
        self.publisher = publisher
        self.runner = runner or LocalRunner()
        self.only_node = only_node  # follow only jobs with a rank on this node (the batch host's files)
        self.timeout_s = timeout_s
        self.tailers: dict[tuple[str, int], JobLogProducer] = {}
        self.errors = 0
        self.list_errors = 0  # of them, listings of the running jobs (the loop's readiness)
        self.last_error: str | None = None
        self.tailer_errors = 0
        self.positions = positions
        self._factory = tailer_factory or self._tailer
        self._parser: DataParser | None = None  # the cluster's data parser, from the last squeue
        # Where RUNNING jobs come from: squeue each poll, or (producers.placements) the bus.
        self._placements: Callable[[], dict[str, int]] = self.running_jobs

    def _tailer(self, job: JobFiles) -> JobLogProducer:
        resume: dict[Path, FilePosition] = {}
        if self.positions is not None:
            for path in job.paths:
                pos = self.positions.file(f"job:{job.job_id}:{path}")
                if pos is not None:
                    resume[path] = pos
        return JobLogProducer(
            self.publisher,
            job.job_id,
            list(job.paths),
            JobLayout(job.nodes, job.ranks_per_node),
            partition=job.partition,
            from_start=True,
            resume=resume,
        )

    def follow_placements(self, source: Callable[[], dict[str, int]]) -> None:
        """Take RUNNING jobs from `source` (producers.placements.BusPlacements) instead of squeue;
        the source may call back `running_jobs` for its resyncs."""
        self._placements = source

    def running(self) -> dict[str, int]:
        """RUNNING job id -> restart count (or generation), from the configured source."""
        return self._placements()

    def current_positions(self) -> dict[str, FilePosition]:
        out: dict[str, FilePosition] = {}
        for tailer in self.tailers.values():
            out.update(tailer.positions())
        return out

    def running_jobs(self) -> dict[str, int]:
        """RUNNING job id -> restart count."""
        # A node-local discoverer asks about its own node only. Slurm 22.05's --json ignores
        # the filter (the whole queue comes back), so the node check below stays.
        argv = ["squeue", "--json", "--nodelist", self.only_node] if self.only_node else ["squeue", "--json"]
        doc = read_jobs(self.runner(argv, self.timeout_s), "squeue --json")
        self._parser = doc.parser
        out = {}
        for j in doc.jobs.values():
            if j.state != "RUNNING":
                continue
            if self.only_node and self.only_node not in expand_hostlist(j.nodes):
                continue
            out[j.job_id] = j.restart_cnt
        return out

    def describe(self, job_id: str, restarts: int) -> JobFiles:
        if self._parser is None:  # describe() before any squeue: learn the version first
            self.running_jobs()
        assert self._parser is not None
        job = show_job(self.runner, job_id, self.timeout_s, self._parser)
        if job is None:
            raise ValueError(f"job {job_id} is no longer known to slurmctld")
        nodes = tuple(expand_hostlist(job.nodes))
        paths = tuple(dict.fromkeys(Path(p) for p in (job.std_out, job.std_err) if p and p != "/dev/null"))
        tasks = job.tasks
        rpn = tasks // len(nodes) if tasks and nodes and tasks % len(nodes) == 0 else None
        return JobFiles(job_id, restarts, nodes, job.partition, rpn, paths)

    def poll_once(self) -> int:
        """Discover new jobs, drop finished ones, publish new lines; returns lines published."""
        try:
            running = self.running()
        except (SlurmCommandError, ValueError) as exc:  # SlurmFormatError is both
            self.errors += 1
            self.list_errors += 1
            self.last_error = f"listing running jobs failed: {exc}"
            POLL_FAILURES.labels("logs", "list").inc()
            log.warning("job discovery: listing running jobs failed: %s", exc)
            running = {jid: r for (jid, r) in self.tailers}  # keep following what we have
        for key in [k for k in self.tailers if running.get(k[0]) != k[1]]:
            gone = self.tailers.pop(key)
            gone.close()
            if self.positions is not None and key[0] not in running:
                self.positions.forget(list(gone.positions()))
        for job_id, restarts in running.items():
            if (job_id, restarts) in self.tailers:
                continue
            try:
                job = self.describe(job_id, restarts)
            except (SlurmCommandError, ValueError) as exc:
                self.errors += 1
                POLL_FAILURES.labels("logs", "describe").inc()
                log.warning("job discovery: cannot describe job %s: %s", job_id, exc)
                continue
            if not job.paths:
                continue
            self.tailers[(job_id, restarts)] = self._factory(job)
            log.info("following job %s (restart %d): %s", job_id, restarts, ", ".join(map(str, job.paths)))
        return sum(self._poll_tailer(key, t) for key, t in list(self.tailers.items()))

    def _poll_tailer(self, key: tuple[str, int], tailer: JobLogProducer) -> int:
        """One job's failure is logged and counted; it never stops the others' monitoring."""
        try:
            return tailer.poll_once()
        except Exception:  # noqa: BLE001 - isolate any one job's bad input
            self.tailer_errors += 1
            POLL_FAILURES.labels("logs", "tailer").inc()
            log.exception("job discovery: following job %s (restart %d) failed; other jobs go on", *key)
            return 0

    def run(self, stop_event: threading.Event, interval_s: float = 1.0) -> None:
        while not stop_event.is_set():
            self.poll_once()
            stop_event.wait(interval_s)
        for t in self.tailers.values():
            t.close()
