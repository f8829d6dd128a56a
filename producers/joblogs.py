"""Job-log tailer: follows a job's output files and publishes batches of lines.

Understands `srun --label` prefixes ("3: ...") and torchrun's "[rank3]:"
prefix, so each line keeps the rank (and, with the job's layout, the node)
that wrote it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from producers.follow import FileFollower
from producers.progress import ProgressParser
from producers.publisher import Publisher
from producers.tracebacks import TracebackGrouper
from schemas.events import LogBatch, LogLine, ProgressBatch
from schemas.ids import stable_id
from schemas.topics import JOB_LOGS, JOB_PROGRESS

_SRUN_LABEL = re.compile(r"^\s*(\d{1,6}): ")
_TORCHRUN_RANK = re.compile(r"^\[(?:rank|default)(\d{1,6})\]:\s?")
MAX_LINES_PER_BATCH = 1000


@dataclass(frozen=True)
class RankedText:
    rank: int | None
    text: str


def split_rank_prefix(line: str) -> RankedText:
    """Strip the launcher's prefixes; the innermost rank wins (torchrun inside srun)."""
    rank: int | None = None
    m = _SRUN_LABEL.match(line)
    if m:
        rank = int(m.group(1))
        line = line[m.end() :]
    m = _TORCHRUN_RANK.match(line)
    if m:
        rank = int(m.group(1))
        line = line[m.end() :]
    return RankedText(rank, line)


@dataclass(frozen=True)
class JobLayout:
    """Where a job's ranks run: block distribution over job_nodes."""

    job_nodes: tuple[str, ...] = ()
    ranks_per_node: int | None = None

    def node_of(self, rank: int | None) -> str | None:
        if rank is None or not self.ranks_per_node or not self.job_nodes:
            return None
        i = rank // self.ranks_per_node
        return self.job_nodes[i] if i < len(self.job_nodes) else None


class JobLogProducer:
    """Follows one job's output files; publishes one LogBatch per file per poll."""

    def __init__(
        self,
        publisher: Publisher,
        job_id: str,
        paths: Sequence[Path],
        layout: JobLayout | None = None,
        partition: str | None = None,
        node_of_path: Mapping[Path, str] | None = None,
        from_start: bool = True,
        progress: ProgressParser | None = None,
    ) -> None:
        self.publisher = publisher
        self.job_id = job_id
        self.layout = layout or JobLayout()
        self.partition = partition
        self.node_of_path = {Path(k): v for k, v in (node_of_path or {}).items()}
        self.followers = [FileFollower(Path(p), from_start=from_start) for p in paths]
        # Progress lines (step, step time, loss) also go out as their own events: the
        # hang and straggler detectors live on them.
        self.progress = progress or ProgressParser()
        self.lines_published = 0
        self.progress_published = 0
        self._groupers: dict[Path, TracebackGrouper] = {}

    def add_path(self, path: Path, node: str | None = None) -> None:
        if node:
            self.node_of_path[Path(path)] = node
        self.followers.append(FileFollower(Path(path)))

    def poll_once(self) -> int:
        now = time.time()
        count = 0
        for follower in self.followers:
            raw = follower.poll()
            grouper = self._groupers.setdefault(follower.path, TracebackGrouper())
            if not raw:
                self._publish(follower.path, grouper.flush(now), now)
                continue
            first = follower.lineno - len(raw) + 1
            path_node = self.node_of_path.get(follower.path)
            lines = []
            for i, text in enumerate(raw):
                r = split_rank_prefix(text)
                lines.append(
                    LogLine(
                        text=r.text,
                        ts=now,
                        rank=r.rank,
                        node=path_node or self.layout.node_of(r.rank),
                        lineno=first + i,
                    )
                )
            grouped = [out for line in lines for out in grouper.feed(line, now)] + grouper.flush(now)
            self._publish(follower.path, grouped, now)
            count += len(lines)
        self.lines_published += count
        return count

    def _publish(self, path: Path, lines: list[LogLine], now: float) -> None:
        for start in range(0, len(lines), MAX_LINES_PER_BATCH):
            chunk = lines[start : start + MAX_LINES_PER_BATCH]
            self.publisher.publish(
                JOB_LOGS,
                LogBatch(
                    event_id=stable_id("log", self.job_id, path, chunk[0].lineno),
                    event_time=now,
                    job_id=self.job_id,
                    source=str(path),
                    job_nodes=list(self.layout.job_nodes),
                    partition=self.partition,
                    lines=chunk,
                ),
            )
            self._publish_progress(path, chunk, now)

    def _publish_progress(self, path: Path, chunk: list[LogLine], now: float) -> None:
        samples = [s for ln in chunk if (s := self.progress.parse(ln.text, ln.ts, ln.rank, ln.node)) is not None]
        if not samples:
            return
        self.publisher.publish(
            JOB_PROGRESS,
            ProgressBatch(
                # Same origin as the log batch: a re-read is recognised downstream.
                event_id=stable_id("prg", self.job_id, path, chunk[0].lineno),
                event_time=now,
                job_id=self.job_id,
                job_nodes=list(self.layout.job_nodes),
                partition=self.partition,
                samples=samples,
            ),
        )
        self.progress_published += len(samples)

    def close(self) -> None:
        for f in self.followers:
            f.close()
