"""Job-log tailer: follows a job's output files and publishes batches of lines.

Understands `srun --label` prefixes ("3: ..."), torchrun's "[rank3]:" prefix,
Open MPI's tags and the hosts parallel launchers put before a line (pdsh and
DeepSpeed's "host: ", Open MPI's "[host:pid]", NCCL's "host:pid:tid [gpu]"), so
each line keeps the rank and node (by the job's layout, else the host it
names) that wrote it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bus.publish import Publisher
from producers.follow import FileFollower
from producers.metrics import LINES_READ
from producers.position import FilePosition
from producers.progress import ProgressParser
from producers.tracebacks import TracebackGrouper
from schemas.events import LogBatch, LogLine, ProgressBatch
from schemas.ids import NODE_NAME_PATTERN, node_for_host, stable_id
from schemas.topics import JOB_LOGS, JOB_PROGRESS

_SRUN_LABEL = re.compile(r"^\s*(\d{1,6}): ")
# torchrun: "[rank3]:" is the global rank (c10d's log prefix); "[default3]:" is
# "[{role}{local_rank}]:" of torchrun --tee, a LOCAL rank (the GPU index on its node).
_TORCHRUN_RANK = re.compile(r"^\[rank(\d{1,6})\]:\s?")
_TORCHRUN_LOCAL = re.compile(r"^\[default(\d{1,6})\]:\s?")
# OpenMPI --tag-output: "[jobid,rank]<stdout>:" (the second number is MPI_COMM_WORLD rank),
# sometimes behind a timestamp of --timestamp-output or of the collector.
_MPI_TAG = re.compile(r"^(?P<pre>\d{4}-\d\d-\d\dT[\d:.]+Z?: )?\[\d{1,6},(?P<rank>\d{1,6})\]<std(?:out|err|diag)>:\s?")
# The rank named inside a c10d message: "[Rank 12]", "[PG 0 (default_pg) Rank 12]",
# "[PG ID 2 PG GUID 3 Rank 2]": the number after "Rank", never the PG's.
_C10D_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d{1,6})\]")
# A Slurm node name (schemas.ids): a host a line names is one, or the line names none.
_HOST = NODE_NAME_PATTERN
# Where the line itself names the host that wrote it, most specific first.
_HOST_FORMS = (
    # NCCL: "host:pid:tid [cudaDev] NCCL ..." (cudaDev: the GPU index on that host).
    # Also behind a timestamp; a host name has a letter (so "10:53:25 [0]" is no host).
    re.compile(rf"(?:^|\s)(?P<host>(?=[\w.-]*[A-Za-z]){_HOST}):\d+:\d+ \[(?P<gpu>\d{{1,3}})\] "),
    # srun: "srun: error: HOST: task N: ..." / "tasks 0-3: ..." (a single task is its rank).
    re.compile(rf"^srun: error: (?P<host>{_HOST}): tasks? (?:(?P<rank>\d+)(?=:)|[\d,-]+)"),
    # syslog / journal: "Mon DD HH:MM:SS HOST ident[pid]: ..." and RFC 5424 / ISO stamps.
    re.compile(rf"^[A-Z][a-z]{{2}} [ \d]\d \d\d:\d\d:\d\d (?P<host>{_HOST}) [\w./-]+(?:\[\d+\])?: "),
    re.compile(rf"^\d{{4}}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d) (?P<host>{_HOST}) [\w./-]+(?:\[\d+\])?: "),
    # Monitoring naming the instance: Prometheus labels 'instance="gpu03:9400"', alert texts
    # "Xid errors on instance: gpu03, ...", 'Hostname=gpu03'.
    re.compile(rf"\binstance=\"(?P<host>{_HOST}?)(?::\d+)?\""),
    re.compile(rf"\b[Ii]nstance: (?P<host>{_HOST}?)[,;\s]"),
    re.compile(rf"\b[Hh]ostname[=:] ?\"?(?P<host>{_HOST})(?![A-Za-z0-9._-])"),  # not the start of a longer one
)
# NCCL's own prefix at the start of a line, behind an optional timestamp: the writer.
# nccl src/debug.cc ncclDebugLog (NCCL 2.18-2.23): INFO "%s:%d:%d [%d] NCCL INFO ", WARN
# "%s:%d:%d [%d] %s:%d NCCL WARN " (host, pid, tid, cudaDev[, file, line]). The writer of a
# network error is one end of a failing link: whether it is the fault's node is the
# catalog's `isolate` (trainmedic.ops.diagnose reports a culprit only then).
_NCCL_WRITER = re.compile(
    rf"^(?:\d{{4}}-\d\d-\d\dT[\d:.]+Z?: )?(?P<host>(?=[\w.-]*[A-Za-z]){_HOST}):\d+:\d+ \[\d{{1,3}}\] (?:[\w./-]+:\d+ )?NCCL "
)
# Launcher prefixes that name the host that wrote the line, stripped like the rank prefixes.
# pdsh (and DeepSpeed's default multi-node launcher, deepspeed/launcher/multinode_runner.py
# PDSHRunner, which runs `pdsh -S -f 1024 -w HOSTS`): every output line as "HOST: line"
# (pdsh 2.34 src/pdsh/dsh.c, labels on unless -N, src/pdsh/opt.c). A host here is a name with a
# digit in its first label, no "_" (RFC 1123 names), not a source file or number-format word:
# "fp16: true" or "sha256: ..." of a printed config is no host.
_PDSH_HOST = re.compile(
    r"^(?!(?:fp|bf|int|uint|float|sha|md|utf|base|x|ipv|py|python|cuda|sm|stage|zero|layer|conv|epoch|step|iter|"
    r"rank|fold|top)\d+: )(?P<host>[A-Za-z][A-Za-z0-9-]*\d[A-Za-z0-9-]*(?:\.[A-Za-z][A-Za-z0-9-]*)*): "
)
# pdsh's own errors name the remote host after "pdsh@LAUNCHER: " (pdsh's err() "%p: %S: ...").
_PDSH_ERROR = re.compile(rf"^pdsh@[\w.-]+: (?P<host>{_HOST}): ")
# Open MPI's "[HOST:PID] " of its signal handler's report and its error logs
# (opal/util/stacktrace.c, "[%s:%05d] " with the node name and pid, Open MPI 4.1 / 5.0), and
# MPICH Hydra's proxies "[proxy:PG:ID@HOST] " (src/pm/hydra). Kept in the text: catalog patterns
# match on them. A Python logger's "[file.py:123]" is no host.
_MPI_HOST = re.compile(
    r"^\[(?:proxy:\d+:\d+@(?P<proxy>[A-Za-z0-9][\w.-]*)|"
    rf"(?P<host>(?=[\w.-]*[A-Za-z])(?![\w.-]*\.(?:py|pyx|c|cc|cpp|cu|h|hpp|rs|go|java):){_HOST}):\d{{1,10}})\] "
)
MAX_LINES_PER_BATCH = 1000


@dataclass(frozen=True)
class RankedText:
    rank: int | None
    text: str
    host: str | None = None  # the node the line says wrote it
    gpu: int | None = None  # the GPU index on that node (NCCL's cudaDev, torchrun's local rank)
    # The host a launcher's prefix (pdsh, DeepSpeed, Open MPI, Hydra) or NCCL's own prefix at the
    # start of the line names as its writer: unlike a host named inside the message (a peer in an
    # IB error), the line's origin.
    writer: str | None = None


def _host_of(text: str) -> tuple[str | None, int | None, int | None]:
    for form in _HOST_FORMS:
        m = form.search(text)
        if m:
            g = m.groupdict()
            return g["host"], int(g["gpu"]) if g.get("gpu") else None, int(g["rank"]) if g.get("rank") else None
    return None, None, None


def split_rank_prefix(line: str) -> RankedText:
    """Strip the launchers' prefixes and say which rank, host and GPU the line is from.

    Prefixes nest (torchrun inside srun or pdsh, mpirun tags): the innermost rank wins. pdsh's
    "HOST: " is stripped like the rank prefixes (the program's line is what catalogs read); the
    other host-naming forms (NCCL's host:pid:tid, Open MPI's [host:pid], syslog, srun's "HOST:
    task N") stay in the text: catalog patterns match on them.
    """
    rank: int | None = None
    gpu: int | None = None
    m = _MPI_TAG.match(line)
    if m:
        rank = int(m.group("rank"))
        line = (m.group("pre") or "") + line[m.end() :]
    m = _SRUN_LABEL.match(line)
    if m:
        rank = int(m.group(1))
        line = line[m.end() :]
    writer, line = _launcher_host(line)
    m = _TORCHRUN_RANK.match(line)
    if m:
        rank = int(m.group(1))
        line = line[m.end() :]
    else:
        m = _TORCHRUN_LOCAL.match(line)
        if m:
            gpu = int(m.group(1))
            line = line[m.end() :]
    host, host_gpu, host_rank = _host_of(line)
    if rank is None:
        m = _C10D_RANK.search(line)
        rank = int(m.group(1)) if m else host_rank
    nccl = _NCCL_WRITER.match(line)
    if writer is None and nccl is not None:
        writer = nccl.group("host")
    return RankedText(rank, line, writer or host, host_gpu if host_gpu is not None else gpu, writer)


def _launcher_host(line: str) -> tuple[str | None, str]:
    """The host a parallel launcher's prefix names, and the line without pdsh's "HOST: " (the
    line as the program printed it; Open MPI's and pdsh's error prefixes stay: patterns match them)."""
    m = _PDSH_ERROR.match(line)
    if m:
        return m.group("host"), line
    m = _MPI_HOST.match(line)
    if m:
        return m.group("proxy") or m.group("host"), line
    m = _PDSH_HOST.match(line)
    if m:
        return m.group("host"), line[m.end() :]
    return None, line


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

    def node_named(self, host: str | None) -> str | None:
        """The job's node a host in its text names (by short name: an FQDN is the node), else the host."""
        if host is None or not self.job_nodes:
            return host
        return node_for_host(host, self.job_nodes) or host


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
        resume: Mapping[Path, FilePosition] | None = None,
    ) -> None:
        self.publisher = publisher
        self.job_id = job_id
        self.layout = layout or JobLayout()
        self.partition = partition
        self.node_of_path = {Path(k): v for k, v in (node_of_path or {}).items()}
        saved = {Path(k): v for k, v in (resume or {}).items()}
        self.followers = [FileFollower(Path(p), from_start=from_start, resume=saved.get(Path(p))) for p in paths]
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

    def position_key(self, path: Path) -> str:
        return f"job:{self.job_id}:{path}"

    def positions(self) -> dict[str, FilePosition]:
        """Positions safe to save: a file with lines held in an open traceback is left at its last save."""
        out = {}
        for f in self.followers:
            grouper = self._groupers.get(f.path)
            if grouper is not None and grouper.holding:
                continue
            if (pos := f.position()) is not None:
                out[self.position_key(f.path)] = pos
        return out

    def drain(self) -> None:
        """Publish what open tracebacks still hold (before a stop)."""
        now = time.time()
        for path, grouper in self._groupers.items():
            self._publish(path, grouper.flush(now, force=True), now)

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
                        # The file's node, else the rank's by layout, else the host the line names.
                        node=path_node or self.layout.node_of(r.rank) or self.layout.node_named(r.host),
                        gpu=r.gpu,
                        lineno=first + i,
                    )
                )
            grouped = [out for line in lines for out in grouper.feed(line, now)] + grouper.flush(now)
            self._publish(follower.path, grouped, now)
            count += len(lines)
        self.lines_published += count
        if count:
            LINES_READ.labels("logs").inc(count)
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
