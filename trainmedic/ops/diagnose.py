"""`trainmedic diagnose`: the streams worker's detectors and attribution, offline, over log files.

Inputs are files, directories (every file in them, recursively, in sorted order) and ``-``
(standard input, read as a job log). Files named kern.log*, dmesg*, syslog* (or messages*) are
kernel logs; every other file is a job log (stdout/stderr, per-rank logs). No broker is needed.

What runs, through the same functions as online:

- job logs: the log-signature detector (`SignatureDetector`) on every line; the progress parser
  of the job-log producer (`ProgressParser`) turns lines into progress samples, which feed the
  loss detector (`DivergenceDetector`), the throughput detector (`ThroughputDetector`, its
  finding classified by the evidence in the same logs) and the hang detector (`HangDetector`);
- kernel logs: the kernel producer's line parser, the Xid detector and the kernel-text detector
  (NVSwitch SXids, hung-task / D-state reports naming a filesystem), and the log-signature
  detector on the message after each line's prefix (the kernel's OOM killer, AER, file-system and
  HCA port messages of the catalogs);
- one `Attributor` over all of it, and the policy's `decide` on its incident (the default
  policy unless another is given): the reported action is the policy's, as online.

Time: each line's own timestamp where it has one (`schemas.timestamps`: ISO, Python
logging, syslog without a year, glog, epoch seconds), else the previous line's time plus a
millisecond (line order). A file with no timestamp at all runs on line order after the others.

Offline the job is over, so two things differ from online, both said in the explanation:

- a hang is found when the log's own clock shows the silence (progress, then nothing for longer
  than the job's rhythm allows until the log's last timestamped line, and no completion line),
  or when the log ends in a stack dump of threads parked in collectives or in the data loader
  (`streams.detectors.hang.parked_threads`); a log that merely ends after progress is a
  snapshot, not a hang;
- a crash (traceback, non-zero exit, ``Killed``) that no detector explains is category
  `unknown` ("needs a person"), never `healthy`.

`healthy` needs positive evidence (`streams.detectors.error_lines`): every error-level line of
every emitter (an NCCL WARN, an NVRM or kernel error, a Python exception, a CUDA error, a
`slurmstepd`/`srun` error, an MPI or launcher error) is explained, by a fault signature or as an
emitter's known non-fault; one that is not makes the verdict `unknown`, with that line quoted.
Where the log has progress, it must reach the end of the log or a completion line: progress reports
that stop with `progress_tail_lines` or more lines after them that are neither below error
level, nor metrics, nor known noise (and no completion or stop after them) make the verdict
`unknown` too ("progress stopped N lines before the end"). Numbers alone that say something is wrong
without saying what - a loss jump still unresolved when the log ends, a small throughput drop that lasts
to the end - are `unknown` as well (the loss and throughput detectors' `finish`), never `healthy`.
A run its operator or scheduler ended (scancel, time limit, preemption, a signal to every rank)
is no fault: what follows the stop (crash markers, collective timeouts, unexplained errors as the
ranks go down) is its consequence, and only a recognised cause before or after it still counts.

Rank -> node: `culprit_node_resolved` is the culprit node, or the node of the culprit rank
through a `RankMap` (node list + block/cyclic distribution, or a rank map file).
"""

from __future__ import annotations

import gzip
import re
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from producers.joblogs import RankedText, split_rank_prefix
from producers.kernel import join_continuations, parse_kernel_line, split_prefix, to_event
from producers.progress import ProgressParser
from producers.tracebacks import FailureTable
from schemas.errors import UsageError
from schemas.events import Anomaly, Incident, LogBatch, LogLine, ProgressBatch, ProgressSample
from schemas.ids import is_node_name, stable_id
from schemas.timestamps import FileClock, Stamp, parse_stamp, reference_time
from schemas.vocab import SEVERITY_RANK
from streams.attribution import Attributor
from streams.catalog import Signature
from streams.causal import tier
from streams.detectors.divergence import UNRESOLVED_KINDS, DivergenceDetector, DivergenceSettings
from streams.detectors.error_lines import ErrorLine, ErrorLineReader
from streams.detectors.hang import MEANING_DUMP, HangDetector, parked_threads
from streams.detectors.kernel_text import KernelTextDetector
from streams.detectors.signatures import SignatureDetector
from streams.detectors.throughput import ThroughputDetector, ThroughputSettings, with_evidence
from streams.detectors.xid import XidDetector
from streams.policy import Policy, decide, load_policy
from trainmedic.ops.rankmap import RankMap, RankMapError, from_nodelist, load_rank_map, ranks_per_node_from_log

OFFLINE_JOB = "offline"
STDIN = "-"
# A line that names no host: a placeholder node for the kernel event (KernelEvent.node must be a node name,
# schemas.ids), turned back into "no node" on the anomaly.
_NO_HOST = "trainmedic-no-host"
_KERNEL_NAMES = re.compile(r"(^|[_.-])(kern\.log|dmesg|syslog|messages)")  # also rotated: kern.log.2.gz
LINE_STEP_S = 0.001
BINARY_SNIFF_BYTES = 8192  # line order: a line without a timestamp is this much after the one before


@dataclass(frozen=True)
class OfflineSettings:
    """What offline diagnosis adds to the online detectors: all of it data, with defaults."""

    divergence: DivergenceSettings = field(default_factory=DivergenceSettings)
    throughput: ThroughputSettings = field(default_factory=ThroughputSettings)
    # Progress lines of no framework the producer knows: tried only when its formats give nothing.
    # Named groups as in ProgressParser's custom patterns.
    fallback_progress: tuple[str, ...] = (
        # 'epoch: 3451 loss: nan', 'step 12972 \t loss = 0.428, ...'
        r"^\s*(?:[Ee]poch|[Ss]tep|[Ii]ter(?:ation)?)\s*[:=]?\s*(?P<step>\d+)\b[^|]{0,80}?\bloss\s*[:=]\s*"
        r"(?P<loss>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf|NaN|Infinity))",
        # PyTorch's ImageNet example and its copies: 'Epoch: [1][100/5005]\tTime 8.719 (0.361)\tData ...'
        # (the batch index restarts every epoch: no step, each line is one report).
        r"^\s*Epoch: \[\d+\]\[\d+/\d+\]\s+Time (?P<step_time_s>\d+(?:\.\d+)?) \(",
    )
    # A line that says the run ended as planned: the silence before it is no hang.
    completion: str = (
        r"(?i)\btraining (?:is )?(?:complete|completed|finished|done)\b|\bfinished training\b|"
        r"'train_runtime'|\bafter training is done\b|Trainer\.fit` stopped|\bexiting (?:normally|cleanly)\b|"
        r"\[exiting program (?:after|at)\b|"
        r"Exited with exit code 0\b|\bexit(?:ed)? (?:code|status)[: ]+0\b"
    )
    # A completion line, then silence until the scheduler's time limit ends the job: it finished its work
    # and did not exit (Megatron-Bridge issue 1656: "[after training is done]", then 8 min of nothing,
    # then "CANCELLED ... DUE TO TIME LIMIT"). The silence must exceed the hang detector's floor (30 s,
    # HangDetector floor_s), and what lies between must be no save or evaluation still at work.
    exit_hang_min_s: float = 30.0
    exit_hang_busy: str = r"(?i)\b(?:sav(?:e|ed|ing)|checkpoint|eval(?:uat\w*)?|validat\w*|test(?:ing)?)\b"
    # Progress that stops well before the end of the log, with no completion line and no decision after it:
    # this many lines after the last progress report that nothing explains make the verdict unknown, not
    # healthy (a run does not stop reporting and go on printing something else for no reason).
    progress_tail_lines: int = 3
    # What may follow the last progress report of a healthy run: log records below error level (the level
    # names of Python logging, loguru, glog/c10, NCCL INFO), metric, evaluation and checkpoint lines (a
    # validation loss, "saving checkpoint", a timer table, a wrapped progress record), a progress bar, and
    # decoration (separator lines with no word in them). Error-level lines are judged by the error-line
    # catalog before this, and its known noise and stop-by-decision lines count as explained too.
    progress_tail_explained: str = (
        r"\b(?:INFO|WARNING|WARN|DEBUG|NOTICE|SUCCESS|TRACE)\b|^\s*\[?[IWD]\d{4} \d{2}:\d{2}:\d{2}|\[[IW] [\w.]+:\d+\]|"
        r"(?i:\b(?:loss|lr|learning[ _]rate|iter(?:ation)?s?|steps?|epochs?|grad(?:ient)?[ _]norm|samples|tokens|"
        r"throughput|tflops|ppl|perplexity|acc(?:uracy)?|eval(?:uation|uating)?|valid(?:ation)?|checkpoint|"
        r"sav(?:e|ed|ing)|time \(ms\)|it/s|s/it)\b)|\d+%\||^[^A-Za-z]*$"
    )
    # A crash whose cause no detector recognised: category unknown, never healthy.
    crash: str = (
        r"Traceback \(most recent call last\)|\bChildFailedError\b|\bexitcode\s*:\s*-?[1-9]\d*\b|"
        r"[Ee]xit(?:ed with)? (?:exit )?(?:code|status)[: ]+[1-9]\d*\b|^Killed\b|: Killed$|"
        r"\bcore dumped\b|terminate called after throwing|Fatal Python error|"
        r"srun: error: .*: tasks? [\d,-]+: (?:Exited|Killed|Terminated|Aborted)"
    )


class DiagnoseError(UsageError, ValueError):
    pass


def is_kernel_log(path: Path) -> bool:
    return bool(_KERNEL_NAMES.search(path.name))


# -- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    name: str
    lines: list[str]
    kernel: bool


def _read_bytes(path: Path) -> bytes:
    try:
        data = path.read_bytes()
        # Rotated logs come compressed (kern.log.2.gz, job-1234.out.gz).
        return gzip.decompress(data) if path.suffix == ".gz" else data
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError: first
        raise DiagnoseError(f"{path}: not a readable gzip file: {exc}") from None
    except OSError as exc:
        raise DiagnoseError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _is_binary(data: bytes) -> bool:
    # A NUL byte near the start: a core file, an image, a checkpoint - not a log.
    return b"\0" in data[:BINARY_SNIFF_BYTES]


def _lines(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines()


def gather_inputs(args: Sequence[str | Path], stdin: TextIO | None = None) -> list[Input]:
    """Files as given, directories expanded to every file in them (recursively, sorted; binary
    files found there - core dumps, images - are left out), '-' as standard input (a job log,
    once). Files ending in .gz are decompressed."""
    if not args:
        raise DiagnoseError("no files given")
    out: list[Input] = []
    seen_stdin = False
    for arg in args:
        if str(arg) == STDIN:
            if seen_stdin:
                raise DiagnoseError("'-' (standard input) given twice")
            seen_stdin = True
            text = (stdin or sys.stdin).read()
            out.append(Input(STDIN, text.splitlines(), kernel=False))
            continue
        path = Path(arg)
        if path.is_dir():
            found = [(p, _read_bytes(p)) for p in sorted(p for p in path.rglob("*") if p.is_file())]
            texts = [(p, data) for p, data in found if not _is_binary(data)]
            if not texts:
                raise DiagnoseError(f"{path}: directory holds no text file")
            out += [Input(str(p), _lines(data), is_kernel_log(p)) for p, data in texts]
        elif path.is_file():
            out.append(Input(str(path), _lines(_read_bytes(path)), is_kernel_log(path)))
        else:
            raise DiagnoseError(f"{path}: no such file or directory")
    return out


# -- time --------------------------------------------------------------------------------------


@dataclass
class _Line:
    text: str  # rank prefix stripped (job logs), whole line (kernel logs)
    raw: str
    lineno: int
    ts: float
    stamped: bool  # the time is the line's own, not line order
    rank: int | None = None
    node: str | None = None  # the host the line says wrote it
    gpu: int | None = None  # the GPU index on that host, when the line says


def _line_host(r: RankedText) -> str | None:
    """The node a job-log line names as its writer: NCCL's own "host:pid:tid [gpu]" prefix, or a
    parallel launcher's (pdsh / DeepSpeed "host: ", Open MPI "[host:pid]", Hydra "[proxy:..@host]").

    The other host forms split_rank_prefix finds (a peer named inside an IB error, a syslog
    host) are left to the catalog patterns' `node` groups."""
    return r.writer


def _stamps(inp: Input) -> list[tuple[RankedText, Stamp | None]]:
    """Each line split as the job-log producer splits it (launcher prefixes, rank, host, GPU)
    and its own timestamp; kernel lines are kept whole."""
    out: list[tuple[RankedText, Stamp | None]] = []
    for raw in inp.lines:
        if inp.kernel:
            # The kernel prefix's own stamp (dmesg -T/-H, syslog, journald, inside collector framings),
            # else any stamp near the start.
            out.append((RankedText(None, raw), split_prefix(raw).time or parse_stamp(raw)))
            continue
        r = split_rank_prefix(raw)
        out.append((r, parse_stamp(r.text)))
    return out


def _timed(inputs: Sequence[Input]) -> list[list[_Line]]:
    """Every line of every input with a time: its own, or line order (see the module docstring)."""
    parsed = [_stamps(inp) for inp in inputs]
    reference = reference_time([s for rows in parsed for _, s in rows if s is not None])
    files: list[list[_Line]] = []
    own: list[list[float | None]] = []
    for rows in parsed:
        clock = FileClock(reference)
        own.append([clock.time_of(s) for _, s in rows])
    stamped_times = [t for times in own for t in times if t is not None]
    # Files without any timestamp run on line order after everything that has one.
    synthetic = (max(stamped_times) if stamped_times else 0.0) + LINE_STEP_S
    for inp, rows, times in zip(inputs, parsed, own, strict=True):
        lines: list[_Line] = []
        first = next((t for t in times if t is not None), None)
        if first is None:
            prev = synthetic
            synthetic += LINE_STEP_S * (len(rows) + 1)
        else:
            prev = max(0.0, first - LINE_STEP_S * (times.index(first) + 1))
        for i, ((r, _), raw, t) in enumerate(zip(rows, inp.lines, times, strict=True), 1):
            ts = t if t is not None else prev + LINE_STEP_S
            prev = ts
            lines.append(
                _Line(
                    text=r.text[:65536],
                    raw=raw,
                    lineno=i,
                    ts=ts,
                    stamped=t is not None,
                    rank=r.rank,
                    node=_line_host(r),
                    gpu=r.gpu,
                )
            )
        files.append(lines)
    return files


# -- detectors ---------------------------------------------------------------------------------


def _messages(lines: Sequence[_Line]) -> list[tuple[_Line, str]]:
    """Each kernel message of a kernel log with its first line: multi-line driver messages (NVRM, AER)
    joined (producers.kernel.join_continuations), so one message is one piece of evidence."""
    return [(lines[i], text) for i, text in join_continuations([ln.raw for ln in lines])]


def _kernel_anomalies(lines: Sequence[_Line], xids: XidDetector, text: KernelTextDetector) -> list[Anomaly]:
    out = []
    for ln, raw in _messages(lines):
        parsed = parse_kernel_line(raw, default_node=_NO_HOST)
        if parsed is None:
            continue
        event = to_event(parsed, ln.ts, reader="file")
        # As the streams worker's detect_kernel: Xids, then SXids and hung-task reports.
        for a in [*xids.detect(event), *text.detect(event)]:
            # Plain dmesg output names no host: then the culprit node is unknown, not "unknown-node".
            node = None if a.node == _NO_HOST else a.node
            out.append(a.model_copy(update={"job_id": OFFLINE_JOB, "node": node}))
    return out


def _embedded_kernel_host(text: str) -> str | None:
    """The node that logged a kernel line quoted inside `text` (a monitoring alert, a container or
    kubectl prefix, a "[time] host:" wrapper, pdsh), when the quote keeps its "<stamp> <host> kernel:"
    header or a framing names the host, and that host is a node name. The kernel producer's
    `split_prefix` reads it, its stamps through schemas.timestamps: prose ("the kernel: ...") has no
    stamp before it and names no host."""
    host = split_prefix(text).host
    return host if host and is_node_name(host) else None


def _quoted_kernel_anomalies(lines: Sequence[_Line], xids: XidDetector) -> list[Anomaly]:
    """NVIDIA fault lines quoted in a job log or an alert ("Xid errors on instance: gpu01, Error:
    May 19 07:08:57 gpu01 kernel: ... NVRM: Xid ..."): the same Xid evidence as in a kernel log.
    The host is the one the line names (split_rank_prefix's host forms), if any."""
    out = []
    for ln in lines:
        if "NVRM" not in ln.text and "SXid" not in ln.text:
            continue
        host = split_rank_prefix(ln.raw).host or _embedded_kernel_host(ln.text) or _NO_HOST
        parsed = parse_kernel_line(ln.text, default_node=host)
        if parsed is None or parsed.kind not in ("xid", "fallen_off_bus"):
            continue
        for a in xids.detect(to_event(parsed, ln.ts)):
            node = None if a.node == _NO_HOST else a.node
            # Quoted in a job's output or an alert: written by whoever wrote that text.
            out.append(a.model_copy(update={"job_id": OFFLINE_JOB, "node": node, "provenance": "job"}))
    return out


def _kernel_signature_anomalies(name: str, lines: Sequence[_Line], detector: SignatureDetector) -> list[Anomaly]:
    """The catalog's kernel and driver messages in a kernel log (the OOM killer, an uncorrectable
    PCIe error, a file-system error, an HCA port going down), read in the message after whatever
    prefix the line has (syslog, journald, dmesg -T, uptime stamps), the node being the prefix's host
    when that is a node name. A program's line in the same file (syslog) counts as the job's words,
    not the kernel's."""
    found: list[Anomaly] = []
    for ln, raw in _messages(lines):
        pre = split_prefix(raw)
        if detector.match_line(pre.message) is None:
            continue
        node = pre.host if pre.host and is_node_name(pre.host) else None
        batch = LogBatch(
            event_id=f"diag-{name}",
            event_time=0.0,
            job_id=OFFLINE_JOB,
            source=name,
            lines=[LogLine(text=pre.message, ts=ln.ts, node=node, lineno=ln.lineno)],
        )
        for a in detector.detect(batch):
            own = "job" if pre.user_space else "kernel_file"
            found.append(a.model_copy(update={"source": "kernel", "provenance": own}))
    return found


def _signature_anomalies(name: str, lines: Sequence[_Line], detector: SignatureDetector) -> list[Anomaly]:
    batch = LogBatch(
        event_id=f"diag-{name}",
        event_time=0.0,
        job_id=OFFLINE_JOB,
        source=name,
        lines=[
            LogLine(text=ln.text, ts=ln.ts, rank=ln.rank, node=ln.node, gpu=ln.gpu, lineno=ln.lineno) for ln in lines
        ],
    )
    return detector.detect(batch)


@dataclass
class _Progress:
    sample: ProgressSample
    line: _Line
    file: int


def _progress(files: Sequence[list[_Line]], job: Sequence[bool], settings: OfflineSettings) -> list[_Progress]:
    parser, fallback = ProgressParser(), ProgressParser(settings.fallback_progress)
    out: list[_Progress] = []
    for f, lines in enumerate(files):
        if not job[f]:
            continue
        for ln in lines:
            s = parser.parse(ln.text, ln.ts, ln.rank, ln.node) or fallback.parse(ln.text, ln.ts, ln.rank, ln.node)
            if s is not None:
                out.append(_Progress(s, ln, f))
    out.sort(key=lambda p: p.sample.ts)  # stable: line order among equal times
    return out


def _batch(samples: Iterable[ProgressSample], tag: str) -> ProgressBatch:
    return ProgressBatch(event_id=f"diag-progress-{tag}", event_time=0.0, job_id=OFFLINE_JOB, samples=list(samples))


def _silence_hang(
    progress: Sequence[_Progress], files: Sequence[list[_Line]], job: Sequence[bool], completion: re.Pattern[str]
) -> list[Anomaly]:
    """The hang detector on the log's own clock: progress, then silence until the last
    timestamped job-log line, with no completion line after the last progress.

    Progress lines without a timestamp of their own are placed by line order; the last one is
    then taken at the first timestamped line after it, so that the silence measured is a lower
    bound (the job went quiet at the latest then)."""
    last = progress[-1]
    after = [ln for ln in files[last.file] if ln.lineno > last.line.lineno]
    after += [
        ln for f, lines in enumerate(files) if job[f] and f != last.file for ln in lines if ln.ts > last.sample.ts
    ]
    if any(completion.search(ln.text) for ln in after):
        return []
    samples = [p.sample for p in progress if p.line.stamped]
    if not last.line.stamped:
        later = [ln.ts for ln in files[last.file] if ln.stamped and ln.lineno > last.line.lineno]
        if not later:
            return []
        samples.append(last.sample.model_copy(update={"ts": min(later)}))
    end = max((ln.ts for ln in after if ln.stamped), default=None)
    if not samples or end is None or end <= samples[-1].ts:
        return []
    hang = HangDetector(assume_running=True)
    hang.observe_progress(_batch(samples, "hang"), now=samples[0].ts)
    return hang.check(end)


def _dump_hang(progress: Sequence[_Progress], files: Sequence[list[_Line]], job: Sequence[bool]) -> list[Anomaly]:
    """A stack dump of parked threads after the last progress of its file (or in a job file
    with no progress at all)."""
    last_line: dict[int, int] = {}
    for p in progress:
        last_line[p.file] = max(last_line.get(p.file, 0), p.line.lineno)
    for f, lines in enumerate(files):
        if not job[f]:
            continue
        tail = [ln for ln in lines if ln.lineno > last_line.get(f, 0)]
        parked = parked_threads([ln.text for ln in tail])
        if not parked:
            continue
        kinds = sorted({what for what, _ in parked})
        frame_line = next(ln for ln in tail if ln.text.strip() == parked[0][1])
        after = f" after step {progress[-1].sample.step}" if progress and progress[-1].sample.step is not None else ""
        line = (
            f"stack dump{after}: {len(parked)} thread(s) parked in {' and '.join(kinds)}, innermost frame "
            f"{parked[0][1]!r}"
        )
        return [
            Anomaly(
                event_id=stable_id("anm", "hang_dump", OFFLINE_JOB, f, frame_line.lineno),
                event_time=frame_line.ts,
                detector="hang",
                signature="hang_stack_dump",
                category="hang",
                # A dump is weaker evidence than an error line: a crash cause beside it wins.
                severity="warning",
                role="root",
                isolate=False,
                source="job_log",
                job_id=OFFLINE_JOB,
                node=frame_line.node,
                rank=frame_line.rank,
                line=line[:4096],
                meaning=MEANING_DUMP,
            )
        ]
    return []


MEANING_EXIT_HANG = (
    "the job printed that training was done, then nothing until the scheduler's time limit ended it: "
    "it finished its work but did not exit (a hang at shutdown: a collective, a profiler or a writer "
    "thread that never returns)"
)
_TIME_LIMIT = "slurm_cancelled_time_limit"


def _exit_hang(
    files: Sequence[list[_Line]], job: Sequence[bool], reading: _ErrorReading, settings: OfflineSettings
) -> list[Anomaly]:
    """A time-limit stop that follows a completion line of the same job log after a silence longer than
    `exit_hang_min_s`, with no save or evaluation line between them: the job hung on its way out."""
    if reading.decision is None or reading.decision[1].entry != _TIME_LIMIT:
        return []
    stop = reading.decision[0]
    where = next((f for f, lines in enumerate(files) if job[f] and any(ln is stop for ln in lines)), None)
    if where is None or not stop.stamped:
        return []
    completion, busy = re.compile(settings.completion), re.compile(settings.exit_hang_busy)
    before = [ln for ln in files[where] if ln.lineno < stop.lineno]
    done = next((ln for ln in reversed(before) if completion.search(ln.text)), None)
    if done is None or not done.stamped:
        return []
    between = [ln for ln in before if ln.lineno > done.lineno]
    if any(busy.search(ln.text) for ln in between):
        return []
    last_sign = max([done.ts] + [ln.ts for ln in between if ln.stamped])
    silence = stop.ts - last_sign
    if silence < settings.exit_hang_min_s:
        return []
    line = (
        f"{done.text.strip()[:200]!r}, then nothing for {silence:.0f} s until the time limit: "
        f"{stop.text.strip()[:200]!r}"
    )
    return [
        Anomaly(
            event_id=stable_id("anm", "hang_exit", OFFLINE_JOB, where, done.lineno),
            event_time=done.ts,
            detector="hang",
            signature="hang_after_completion",
            category="hang",
            severity="error",
            role="root",
            isolate=False,
            source="job_log",
            job_id=OFFLINE_JOB,
            node=done.node,
            rank=done.rank,
            line=line[:4096],
            meaning=MEANING_EXIT_HANG,
        )
    ]


def _progress_anomalies(
    files: Sequence[list[_Line]], job: Sequence[bool], settings: OfflineSettings
) -> tuple[list[Anomaly], list[_Progress]]:
    progress = _progress(files, job, settings)
    out: list[Anomaly] = []
    if progress:
        batch = _batch((p.sample for p in progress), "all")
        divergence = DivergenceDetector(settings.divergence)
        out += divergence.observe(batch)
        out += divergence.finish(OFFLINE_JOB)
        job_text = [ln.text for f, lines in enumerate(files) if job[f] for ln in lines]
        throughput = ThroughputDetector(settings.throughput)
        slow = throughput.observe(batch) + throughput.finish(OFFLINE_JOB)
        out += [with_evidence(a, job_text) for a in slow]
        out += _silence_hang(progress, files, job, re.compile(settings.completion))
    out += _dump_hang(progress, files, job)
    return out, progress


def _above_warning(a: Anomaly) -> bool:
    return SEVERITY_RANK[a.severity] > SEVERITY_RANK["warning"]


def _crash_line(
    files: Sequence[list[_Line]], job: Sequence[bool], crash: re.Pattern[str], before: float | None
) -> _Line | None:
    for f, lines in enumerate(files):
        if job[f]:
            for ln in lines:
                if crash.search(ln.text) and (before is None or ln.ts < before):
                    return ln
    return None


# Error-level lines that only announce the line that carries the error: a traceback's header is
# judged by the exception line that closes it (a traceback with no such line is a crash marker).
_ANNOUNCING = frozenset({"py_traceback"})


@dataclass
class _ErrorReading:
    """The error-level lines of the logs, as their emitters' vocabularies read them."""

    error_lines: int = 0
    noise: int = 0
    decision: tuple[_Line, ErrorLine] | None = None  # the first line ending the run by decision
    decision_ts: float | None = None  # when that stop began (its traceback's header, if it closes one)
    unexplained: list[tuple[_Line, ErrorLine]] = field(default_factory=list)


def _read_error_lines(files: Sequence[list[_Line]], anomalies: Sequence[Anomaly]) -> _ErrorReading:
    reader = ErrorLineReader()
    explained = [a.line for a in anomalies if a.line]
    out = _ErrorReading()
    for lines in files:
        header: _Line | None = None  # the open traceback's header, while its frames follow
        for ln in lines:
            hit = reader.read(ln.text)
            if hit is not None and hit.entry in _ANNOUNCING:
                header = ln
                continue
            opened, header = header, (header if ln.text[:1].isspace() else None)
            if hit is None:
                continue
            out.error_lines += 1
            if hit.ends_by_decision:
                # The stop began where the traceback it closes began (a KeyboardInterrupt, a SignalException).
                start = opened if opened is not None and header is None else ln
                if out.decision_ts is None or start.ts < out.decision_ts:
                    out.decision, out.decision_ts = (ln, hit), start.ts
            elif hit.not_fault is not None:
                out.noise += 1
            elif not any(e in ln.raw or ln.text in e for e in explained):
                out.unexplained.append((ln, hit))
    if out.decision_ts is not None:
        stop = out.decision_ts
        out.unexplained = [(ln, hit) for ln, hit in out.unexplained if ln.ts < stop]
    return out


def _needs_a_person(ln: _Line, detector: str, signature: str, meaning: str) -> Anomaly:
    """An `unknown` root on one line: evidence that something is wrong with no known cause."""
    return Anomaly(
        event_id=stable_id("anm", detector, OFFLINE_JOB, ln.lineno, ln.text[:200]),
        event_time=ln.ts,
        detector=detector,
        signature=signature,
        category="unknown",
        severity="info",
        role="root",
        isolate=False,
        source="job_log",
        job_id=OFFLINE_JOB,
        node=ln.node,
        rank=ln.rank,
        line=ln.text[:4096],
        meaning=meaning,
    )


def _unexplained_error(reading: _ErrorReading) -> Anomaly:
    ln, hit = reading.unexplained[0]
    more = len(reading.unexplained) - 1
    meaning = f"an error-level line of {hit.emitter} ({hit.entry}) that no catalog entry explains"
    meaning += (f", and {more} more" if more else "") + ": needs a person"
    return _needs_a_person(ln, "error_lines", "error_line_unexplained", meaning)


@dataclass(frozen=True)
class _Tail:
    """The lines of the last progress report's file after that report."""

    lines: int = 0  # non-blank lines after the last progress report
    unexplained: tuple[_Line, ...] = ()


def _progress_tail(progress: Sequence[_Progress], files: Sequence[list[_Line]], explained: re.Pattern[str]) -> _Tail:
    if not progress:
        return _Tail()
    last = progress[-1]
    reader = ErrorLineReader()
    after = [ln for ln in files[last.file] if ln.lineno > last.line.lineno and ln.text.strip()]
    left = []
    for ln in after:
        hit = reader.read(ln.text)
        if hit is not None and hit.not_fault is not None:
            continue  # known noise or a stop by decision (the decision itself is handled before)
        if not explained.search(ln.text):
            left.append(ln)
    return _Tail(len(after), tuple(left))


def _progress_stopped(tail: _Tail) -> Anomaly:
    first = tail.unexplained[0]
    meaning = (
        f"progress stopped {tail.lines} lines before the end of the log, with no completion line after it; "
        f"{len(tail.unexplained)} of those lines are neither below error level, nor metrics, nor known noise, "
        f"and nothing explains why the reports stopped: needs a person"
    )
    return _needs_a_person(first, "progress", "progress_stopped_unexplained", meaning)


_WORD = re.compile(r"[A-Za-z]")


def _nothing_recognised(files: Sequence[list[_Line]], explained: re.Pattern[str]) -> Anomaly | None:
    """An `unknown` root when no line of the logs is recognised at all: no record below error level, no
    metric, no known noise (the caller has checked progress, completion and error-level lines). Such a
    log gives no positive evidence that the run is healthy; a separator line is no evidence either."""
    lines = [ln for lines in files for ln in lines if ln.text.strip()]
    if not lines or any(explained.search(ln.text) and _WORD.search(ln.text) for ln in lines):
        return None
    meaning = (
        f"none of the {len(lines)} lines of the logs is recognised (no progress report, no completion line, no "
        "log record below error level, no metric, no known noise), so nothing says the run is healthy: needs a person"
    )
    return _needs_a_person(lines[-1], "progress", "nothing_recognised", meaning)


def _healthy_explanation(
    reading: _ErrorReading, n_progress: int, completed: bool, tail: _Tail | None = None
) -> tuple[str, float]:
    """What was checked before calling a log healthy, and how sure that makes it."""
    checked = ["no fault signature"]
    if reading.error_lines:
        checked.append(f"{reading.error_lines} error-level line(s), each explained ({reading.noise} known noise)")
    else:
        checked.append("no error-level line")
    if n_progress:
        checked.append(f"{n_progress} progress reports checked (loss, throughput, hang)")
    if reading.decision is not None:
        ln, hit = reading.decision
        assert hit.not_fault is not None
        checked.append(f"ended by decision at line {ln.lineno}: {hit.not_fault.meaning} ({ln.text.strip()[:160]!r})")
        return "; ".join(checked), 0.9
    if completed:
        checked.append("a completion line")
        return "; ".join(checked), 0.9
    if n_progress and tail is not None and tail.lines:
        checked.append(
            f"progress until {tail.lines} line(s) before the end of the log, each after it explained (below error "
            "level, metrics, known noise)"
        )
        return "; ".join(checked), 0.75
    if n_progress:
        checked.append("progress to the end of the log")
        return "; ".join(checked), 0.8
    checked.append("no progress or completion line to confirm the run went on")
    return "; ".join(checked), 0.6


# Findings of the progress detectors that need a person: the numbers are wrong, with no known cause.
_NUMBERS_ONLY = frozenset({"throughput_drop", "throughput_drop_small", "throughput_decline"}) | UNRESOLVED_KINDS


def _unknown_crash(ln: _Line) -> Anomaly:
    return _needs_a_person(
        ln,
        "crash",
        "crash_unexplained",
        "the job crashed (traceback, non-zero exit or kill) but no known cause is in the logs: needs a person",
    )


# -- report ------------------------------------------------------------------------------------


def placement(
    nodelist: str | None = None,
    ranks_per_node: int | None = None,
    distribution: str = "block",
    rank_map: str | Path | None = None,
) -> RankMap | None:
    """The rank -> node map the options describe (None: none given); DiagnoseError if unusable."""
    try:
        if rank_map is not None:
            if nodelist is not None:
                raise DiagnoseError("give a node list (with ranks per node / distribution) or a rank map, not both")
            return load_rank_map(Path(rank_map))
        if nodelist is None:
            if ranks_per_node is not None or distribution != "block":
                raise DiagnoseError("ranks per node and distribution need a node list")
            return None
        return from_nodelist(nodelist, ranks_per_node, distribution)
    except RankMapError as exc:
        raise DiagnoseError(str(exc)) from None


def diagnose_paths(
    paths: Sequence[str | Path],
    *,
    nodelist: str | None = None,
    ranks_per_node: int | None = None,
    distribution: str = "block",
    rank_map: str | Path | None = None,
    stdin: TextIO | None = None,
    settings: OfflineSettings | None = None,
    policy: Policy | None = None,
    signatures: Sequence[Signature] | None = None,
) -> dict[str, Any]:
    """Diagnose the inputs (see the module docstring). `nodelist` (a Slurm hostlist) with
    `ranks_per_node` and `distribution` (block, cyclic), or `rank_map` (a file of RANK NODE
    lines), resolve a culprit rank to its node. `action` is what `policy` (default:
    streams/policies/default.yaml, through the streams worker's loader) decides."""
    cfg = settings or OfflineSettings()
    ranks = placement(nodelist, ranks_per_node, distribution, rank_map)
    inputs = gather_inputs(paths, stdin)
    files = _timed(inputs)
    job = [not inp.kernel for inp in inputs]
    _place_failure_tables(files, job)
    detector, xids = SignatureDetector(signatures), XidDetector()
    # Its own detector: a kernel line must not count as what a rank was last doing (ActivityTracker).
    kernel_sigs = SignatureDetector(signatures)
    anomalies: list[Anomaly] = []
    for inp, lines in zip(inputs, files, strict=True):
        if inp.kernel:
            # One kernel-text detector per file: a hung-task report spans the lines of one log.
            anomalies += _kernel_anomalies(lines, xids, KernelTextDetector())
            anomalies += _kernel_signature_anomalies(inp.name, lines, kernel_sigs)
        else:
            anomalies += _signature_anomalies(inp.name, lines, detector) + _quoted_kernel_anomalies(lines, xids)
    progress_found, progress = _progress_anomalies(files, job, cfg)
    n_progress = len(progress)
    anomalies += progress_found
    reading = _read_error_lines(files, anomalies)
    anomalies += _exit_hang(files, job, reading, cfg)
    stop = reading.decision_ts
    if stop is not None:
        # What follows an operator's or scheduler's stop is its consequence: the ranks' timeouts, exit
        # codes and the exception the signal raised in each. A recognised cause of error severity stays.
        anomalies = [a for a in anomalies if a.event_time < stop or (tier(a) == 2 and _above_warning(a))]
    if not anomalies:
        crash = _crash_line(files, job, re.compile(cfg.crash), before=stop)
        if reading.unexplained:
            anomalies.append(_unexplained_error(reading))
        elif crash is not None:
            anomalies.append(_unknown_crash(_placed_crash(crash, files, job)))
    names = [inp.name for inp in inputs]
    ranks = _with_log_ranks_per_node(ranks, files, job)
    completion = re.compile(cfg.completion)
    completed = any(completion.search(ln.text) for f, lines in enumerate(files) if job[f] for ln in lines)
    tail = _progress_tail(progress, files, re.compile(cfg.progress_tail_explained))
    if (
        not anomalies
        and not completed
        and reading.decision is None
        and len(tail.unexplained) >= cfg.progress_tail_lines
    ):
        anomalies.append(_progress_stopped(tail))
    if not anomalies and not n_progress and not completed and not reading.error_lines:
        blank = _nothing_recognised(files, re.compile(cfg.progress_tail_explained))
        anomalies += [blank] if blank is not None else []
    if not anomalies:
        explanation, confidence = _healthy_explanation(reading, n_progress, completed, tail)
        return {
            "category": "healthy",
            "culprit": None,
            "culprit_rank": None,
            "culprit_node_resolved": None,
            "action": "none",
            "confidence": confidence,
            "explanation": explanation,
            "provenance": None,
            "evidence": [],
            "files": names,
        }
    attributor = Attributor(settle_s=0.0, collateral_wait_s=0.0)
    # A line without its own timestamp is timed by line order: it must not split a cascade. Each
    # file is its own clock: only gaps within one file split cascades.
    clock = {ln.ts: f for f, lines in enumerate(files) for ln in lines if ln.stamped}
    for a in anomalies:
        at = clock.get(a.event_time)
        attributor.add(a, now=0.0, timed=at is not None, clock=None if at is None else str(at))
    incidents = attributor.flush(now=1.0)
    if not incidents:  # all anomalies carry the offline job id: one group
        raise DiagnoseError("internal: expected an incident, got none")
    # One incident per cascade, oldest first: the verdict is about the last failure, what ended the
    # run; its explanation names the earlier, separate ones.
    inc = incidents[-1]
    evidence = [
        {
            "source": e.source,
            "provenance": e.provenance,
            "signature": e.signature,
            "node": e.node,
            "rank": e.rank,
            "role": e.role,
            "line": e.line,
        }
        for e in inc.evidence
    ]
    # The action is the policy's, as the streams worker would decide it (attribution states facts).
    action = decide(policy or load_policy(), inc, now=inc.event_time)[0].action
    culprit = _culprit_node(inc)
    resolved, where = _resolve_culprit(culprit, inc.culprit_rank, ranks)
    explanation = inc.explanation
    own = ("progress_stopped_unexplained", "nothing_recognised")
    stopped = next((a for a in anomalies if a.signature in own), None)
    numbers = next((a for a in anomalies if a.signature in _NUMBERS_ONLY and a.category == "unknown"), None)
    if stopped is not None and inc.category == "unknown":
        # The attributor words an unknown root as a crash; a log that stops or says nothing known is not one.
        quoted = "first such line" if stopped.signature == own[0] else "its last line"
        explanation = f"{stopped.meaning}; {quoted}: {stopped.line.strip()[:200]!r}"
    elif numbers is not None and inc.category == "unknown":
        # Nor is a run whose numbers alone are wrong (a slowdown, a loss jump with no verdict): say what they show.
        explanation = f"{numbers.meaning}: {numbers.line.strip()[:300]}"
    explanation += where
    if action == "drain_and_requeue" and resolved is None:
        who = f"rank {inc.culprit_rank}" if inc.culprit_rank is not None else "the failing rank"
        if inc.culprit_gpu is not None:
            who += f" (GPU {inc.culprit_gpu})"
        how = (
            "not resolved: give --nodelist with --ranks-per-node, or --rank-map"
            if inc.culprit_rank is not None
            else "the logs name neither its host nor its rank"
        )
        explanation += f"; isolate the node of {who} ({how}) before the restart, or it may land on the same bad GPU"
    return {
        "category": inc.category,
        "culprit": culprit,
        "culprit_rank": inc.culprit_rank,
        "culprit_node_resolved": resolved,
        "action": action,
        "confidence": inc.confidence,
        "explanation": explanation,
        "provenance": inc.provenance,
        "evidence": evidence,
        "files": names,
    }


def _with_log_ranks_per_node(
    rank_map: RankMap | None, files: Sequence[list[_Line]], job: Sequence[bool]
) -> RankMap | None:
    """A block map without a count per node takes torchrun's local world size from the log."""
    if rank_map is None or rank_map.explicit or rank_map.distribution != "block" or rank_map.ranks_per_node:
        return rank_map
    per_node = ranks_per_node_from_log(ln.text for f, lines in enumerate(files) if job[f] for ln in lines)
    if per_node is None:
        return rank_map
    return RankMap(nodes=rank_map.nodes, ranks_per_node=per_node, distribution="block")


# -- culprit: where the text puts the fault -----------------------------------------------------

# The exitcode line of a failure-table entry ("  exitcode  : -9 (pid: 3309)").
_TABLE_EXITCODE = re.compile(r"^\s+exitcode\s*: -?\d+")


def _place_failure_tables(files: Sequence[list[_Line]], job: Sequence[bool]) -> None:
    """Give the lines of torchrun's ChildFailedError root-cause entry that entry's rank, host and
    local rank, as the job-log producer's traceback grouper does (`producers.tracebacks.FailureTable`),
    and the time of the table's start: the table lists the root cause last, but it failed first."""
    for f, lines in enumerate(files):
        # Most logs hold no table: spare them a LogLine per line.
        if not job[f] or not any("Root Cause" in ln.text for ln in lines):
            continue
        table = FailureTable()
        start: float | None = None  # the time of the table's "Failures:" line
        for ln in lines:
            if ln.text.strip() == "Failures:":
                start = ln.ts
            fed = LogLine(text=ln.text, ts=ln.ts, rank=ln.rank, node=ln.node, gpu=ln.gpu, lineno=ln.lineno)
            placed = table.feed(fed)
            if placed is fed:
                continue
            ln.rank, ln.node, ln.gpu = placed.rank, placed.node, placed.gpu
            # The table prints the other failures before the root cause, which is the first observed
            # failure: its lines take the table's start, so that it comes first as it did.
            if start is not None:
                ln.ts = min(ln.ts, start)


def _placed_crash(crash: _Line, files: Sequence[list[_Line]], job: Sequence[bool]) -> _Line:
    """A crash line that names no rank (the agent's traceback, the ChildFailedError line) takes the
    rank of the first root-cause entry of torchrun's failure table in the logs: the table is that
    crash's own report of where it began. Its host is the agent's, kept on the line, not a culprit:
    a crash with no known cause isolates nothing."""
    if crash.rank is not None:
        return crash
    for f, lines in enumerate(files):
        if job[f]:
            for ln in lines:
                if ln.rank is not None and _TABLE_EXITCODE.match(ln.text):
                    return replace(crash, rank=ln.rank, node=ln.node, gpu=ln.gpu)
    return crash


def _culprit_node(inc: Incident) -> str | None:
    """The incident's node as the culprit, except a host the job's own text gave to a fault that
    does not live on that node (not `isolate`): the host that merely wrote the line (pdsh's "host: "
    before a user's traceback, the NCCL prefix of one end of a failing link) is where the fault
    showed, not its origin. A node's own report (its kernel's OOM killer) still names it. The
    evidence keeps every node."""
    if inc.isolate or inc.provenance != "job":
        return inc.culprit_node
    return None


def _resolve_culprit(node: str | None, rank: int | None, ranks: RankMap | None) -> tuple[str | None, str]:
    """The culprit as a node of the placement, and what the explanation adds about it.

    A host the text names is matched to the node list exactly, else by its short name (torch's
    failure table prints `socket.getfqdn()`: gpu01.cluster.local is node gpu01); a host the list
    does not hold stays as the text gives it, said so. Without a named host, the culprit rank's node
    by the placement."""
    if node is not None:
        if ranks is None or not ranks.nodes:
            return node, ""
        found = ranks.resolve_host(node)
        if found is None:
            return node, f"; {node} is not in the node list ({ranks.describe()})"
        return found, (f"; {node} is node {found}" if found != node else "")
    if ranks is not None and rank is not None:
        found = ranks.node_of(rank)
        if found is not None:
            return found, f"; rank {rank} ran on {found} ({ranks.describe()})"
    return None, ""
