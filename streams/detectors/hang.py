"""Hang detector: a RUNNING job whose training stops making progress.

Pure logic with explicit state; the caller feeds records and a clock (`now`).

Two ways to conclude "hang", both for jobs the scheduler reports RUNNING:

1. **Progress silence** (source ``job_log``). The threshold is learned per job:
   ``max(k x median interval between progress reports, floor_s)``. The interval, not the step
   time a line prints, is what matters: Megatron prints one line per ``log_interval`` steps, so
   "858 ms per iteration" may arrive every 86 s. An interval is the wall time between two
   reports that advance the step, or ``step_time_s x steps advanced`` when the tailer stamped
   both lines in one poll (whichever is larger). Medians use the last `history` intervals.
   The silence is measured from the last sign of life: a step, an evaluation result, or the end
   of a checkpoint save. Evaluations that print nothing until they end (Megatron) are learned:
   once one was seen, the silence after a step at which the next evaluation is due (a multiple
   of the evaluation steps seen) may last 1.5 x the longest evaluation seen. The first
   evaluation of a run is not known in advance: with per-step logging and evaluations longer
   than the threshold, raise `floor_s`.
2. **Idle GPUs** (source ``gpu``): every GPU of every node of the job at or below
   ``idle_util_pct`` for ``idle_for_s``, with no progress report in that time. Nodes are assumed
   to be allocated whole to the job. A hung NCCL collective keeps utilization high, so this path
   catches the other hangs (a deadlocked data loader, a stalled host) for jobs that report
   progress rarely or not at all.

Never fired:

- during a **checkpoint save** (between a ``checkpoint_start`` and a ``checkpoint_end`` sample,
  or the next step for frameworks that print no end line), unless the save runs longer than
  ``checkpoint_allowance_s`` (30 min by default): a save that never finishes is a hang too;
- during **warm-up**: until `warmup_steps` progress reports have been seen and one interval after
  them measured, the first step (compilation, data-loader start, checkpoint load) is not
  representative; both paths then wait ``warmup_allowance_s`` (30 min by default; None: never)
  instead of the learned threshold;
- for a job that has reported no progress at all this run, on the progress path (its log format
  may simply be unknown); only the idle path, with the warm-up allowance, applies to it.

With the defaults a job reporting every few seconds is declared hung after 30 s of silence, well
before NCCL's 600 s watchdog. A job that reports only every 2 minutes or more gets a threshold of
10 minutes or more: the watchdog, or the idle path, will usually be first there.

Jobs are watched while the scheduler says RUNNING. ``assume_running=True`` also watches a job
from its first progress report when no scheduler event has said anything about it (for example
jobs already running when producers.slurm made a cold start, which it does not announce); only
use it where the scheduler's end-of-job events do reach the detector, or a finished job will be
taken for a hung one.

One anomaly per hang: a job that fired stays quiet until it shows a sign of life written after
the hang began (a step, an evaluation, a checkpoint line; re-armed) or starts a new run. The
event id is derived from the job, its run, the last step seen and the start of the silence, all
taken from the inputs, so a redelivered input yields the same anomaly id.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from schemas.events import Anomaly, GpuSample, ProgressBatch, ProgressSample, SchedEvent
from schemas.ids import stable_id
from schemas.vocab import Source

JobStateKind = Literal["running", "paused", "ended", "other"]

# Slurm states that neither run nor end a job: the allocation is being set up or adjusted.
_TRANSIENT_STATES = frozenset({"CONFIGURING", "RESIZING", "SIGNALING", "UPDATE_DB", "POWER_UP_NODE"})
_PAUSED_STATES = frozenset({"SUSPENDED", "STOPPED"})
# Mirrors producers.progress: ProgressSample has no start/end field yet, the format carries it.
_CHECKPOINT_END_SUFFIX = "checkpoint_end"
# Ended jobs are remembered this long, so that a late or redelivered RUNNING event of a run
# that is over does not bring it back.
TOMBSTONE_TTL_S = 24 * 3600.0
# Jobs that are not running and show no activity for this long are dropped.
IDLE_JOB_TTL_S = 3600.0
_RECENT_BATCHES = 256
# An evaluation due at this step may last this many times the longest one seen so far.
EVAL_SLACK = 1.5

MEANING_PROGRESS = (
    "training stopped making progress for longer than its own rhythm allows: a hang (stuck "
    "collective, deadlock, stalled I/O) that NCCL's watchdog would only report at its timeout"
)
MEANING_IDLE = (
    "every GPU of the job is idle while the scheduler says it runs: the job is stuck outside the "
    "GPU (host, data loader, I/O) or waiting on something that will not come"
)


def job_state_kind(state: str) -> JobStateKind:
    """Classify a scheduler state: running, paused (may resume), ended, or other (no change)."""
    word = state.strip().split(" ")[0].upper() if state.strip() else ""
    if word == "RUNNING":
        return "running"
    if word in _PAUSED_STATES:
        return "paused"
    if word in _TRANSIENT_STATES or not word:
        return "other"
    # COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED, REQUEUED, PENDING, ... and
    # anything unknown: the run we watched is over (a requeue starts a new one).
    return "ended"


def checkpoint_marker(sample: ProgressSample) -> Literal["start", "end"] | None:
    if sample.phase != "checkpoint":
        return None
    return "end" if sample.format.endswith(_CHECKPOINT_END_SUFFIX) else "start"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _NodeGpu:
    last_ts: float
    idle_since: float | None
    gpus: int


@dataclass
class _Job:
    job_id: str
    seen_at: float
    nodes: tuple[str, ...] = ()
    partition: str | None = None
    running: bool = False
    paused: bool = False
    run_start: float | None = None  # event time of the RUNNING event of this run
    clock_floor: float | None = None  # silence is never counted from before the run (or a resume)
    max_step: int | None = None
    max_step_ts: float | None = None
    last_report_ts: float | None = None  # last report that advanced the step
    last_activity_ts: float | None = None
    reports: int = 0
    intervals: deque[tuple[float, int]] = field(default_factory=deque)  # (seconds, steps advanced)
    ckpt_since: float | None = None
    ckpt_step: int | None = None
    eval_gap: float | None = None  # longest wait seen from a step to an evaluation result
    eval_every: int | None = None  # evaluations came at multiples of this step
    fired_since: float | None = None  # start of the silence we reported; None: armed
    batches: deque[str] = field(default_factory=deque)
    batch_ids: set[str] = field(default_factory=set)

    def reset_progress(self) -> None:
        self.max_step = None
        self.max_step_ts = self.last_report_ts = self.last_activity_ts = None
        self.reports = 0
        self.intervals.clear()
        self.ckpt_since = self.ckpt_step = None
        self.fired_since = None


class HangDetector:
    """See the module docstring. Feed `observe_*`; call `check(now)` periodically (every few s)."""

    name = "hang"

    def __init__(
        self,
        k: float = 5.0,
        floor_s: float = 30.0,
        warmup_steps: int = 2,
        idle_util_pct: float = 2.0,
        idle_for_s: float = 60.0,
        warmup_allowance_s: float | None = 1800.0,
        checkpoint_allowance_s: float = 1800.0,
        gpu_stale_s: float = 60.0,
        history: int = 32,
        assume_running: bool = False,
    ) -> None:
        if k <= 0 or floor_s < 0 or warmup_steps < 0 or idle_for_s <= 0 or history < 1:
            raise ValueError("HangDetector: k and idle_for_s must be > 0, floor_s and warmup_steps >= 0, history >= 1")
        self.k = k
        self.floor_s = floor_s
        self.warmup_steps = warmup_steps
        self.idle_util_pct = idle_util_pct
        self.idle_for_s = idle_for_s
        self.warmup_allowance_s = warmup_allowance_s
        self.checkpoint_allowance_s = checkpoint_allowance_s
        self.gpu_stale_s = gpu_stale_s
        self.history = history
        self.assume_running = assume_running
        self._jobs: dict[str, _Job] = {}
        self._ended: dict[str, float] = {}  # job id -> event time of its end
        self._gpu: dict[str, _NodeGpu] = {}

    # -- inputs ------------------------------------------------------------------------------

    def observe_sched(self, ev: SchedEvent, now: float) -> None:
        if ev.kind != "job" or not ev.job_id:
            return
        kind = job_state_kind(ev.state)
        ended_at = self._ended.get(ev.job_id)
        if kind == "ended":
            self._jobs.pop(ev.job_id, None)
            self._ended[ev.job_id] = max(ev.event_time, ended_at or ev.event_time)
            return
        if ended_at is not None:
            if ev.event_time <= ended_at:
                return  # late news of a run that is already over
            del self._ended[ev.job_id]
        job = self._job(ev.job_id, now)
        if ev.nodes:
            job.nodes = tuple(ev.nodes)
        if ev.partition:
            job.partition = ev.partition
        requeued = "REQUEUED" in ev.flags and job.run_start is not None and ev.event_time > job.run_start
        if kind == "paused":
            job.running, job.paused = False, True
        elif kind == "running" and (not job.running or requeued):
            if requeued:
                # producers.slurm reports a requeue it did not see as its own state this way.
                job.reset_progress()
                job.run_start = job.clock_floor = ev.event_time
            elif job.paused:
                job.clock_floor = max(job.clock_floor or ev.event_time, ev.event_time)
            else:
                # Progress may be consumed before the RUNNING event: keep what belongs to this run.
                if job.last_activity_ts is None or job.last_activity_ts < ev.event_time:
                    job.reset_progress()
                job.run_start = job.clock_floor = ev.event_time
            job.running, job.paused = True, False

    def observe_progress(self, batch: ProgressBatch, now: float) -> None:
        job = self._job(batch.job_id, now)
        if batch.event_id in job.batch_ids:
            return  # redelivered
        job.batch_ids.add(batch.event_id)
        job.batches.append(batch.event_id)
        if len(job.batches) > _RECENT_BATCHES:
            job.batch_ids.discard(job.batches.popleft())
        if batch.job_nodes and not job.nodes:
            job.nodes = tuple(batch.job_nodes)
        if batch.partition and not job.partition:
            job.partition = batch.partition
        unannounced = not job.running and not job.paused and batch.job_id not in self._ended
        if self.assume_running and unannounced and batch.samples:
            first = min(s.ts for s in batch.samples)
            job.running, job.run_start, job.clock_floor = True, first, first
        for s in batch.samples:
            self._sample(job, s)

    def observe_gpu(self, sample: GpuSample, now: float) -> None:
        st = self._gpu.get(sample.node)
        if st is not None and sample.event_time < st.last_ts:
            return  # out of order: the newer state stands
        utils = [g.utilization_pct for g in sample.gpus if g.utilization_pct is not None and not g.lost]
        idle = bool(utils) and max(utils) <= self.idle_util_pct
        if st is None:
            st = self._gpu[sample.node] = _NodeGpu(sample.event_time, None, 0)
        st.last_ts = sample.event_time
        st.gpus = len(utils)
        if not idle:
            st.idle_since = None
        elif st.idle_since is None:
            st.idle_since = sample.event_time

    # -- output ------------------------------------------------------------------------------

    def check(self, now: float, progress_now: Callable[[str], float] | None = None) -> list[Anomaly]:
        """`progress_now(job_id)`: the time to judge that job's progress silence at (the newest
        progress read on its partition, streams/watermark.py); `now` otherwise."""
        out: list[Anomaly] = []
        for job in list(self._jobs.values()):
            if not job.running:
                if now - max(job.seen_at, job.last_activity_ts or 0.0) > IDLE_JOB_TTL_S:
                    del self._jobs[job.job_id]
                continue
            if job.fired_since is not None:
                continue
            found = self._check_progress(job, progress_now(job.job_id) if progress_now else now) or self._check_idle(
                job, now
            )
            if found is not None:
                job.fired_since, anomaly = found
                out.append(anomaly)
        for job_id in [j for j, t in self._ended.items() if now - t > TOMBSTONE_TTL_S]:
            del self._ended[job_id]
        return out

    def running(self) -> list[str]:
        """Job ids watched as RUNNING now."""
        return [j.job_id for j in self._jobs.values() if j.running]

    def threshold_s(self, job_id: str) -> float | None:
        """The job's current silence threshold (None while in warm-up or unknown)."""
        job = self._jobs.get(job_id)
        if job is None or not self._armed(job):
            return None
        return max(self.k * self._median_interval(job), self.floor_s)

    # -- internals ---------------------------------------------------------------------------

    def _job(self, job_id: str, now: float) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(job_id=job_id, seen_at=now, intervals=deque(maxlen=self.history))
        job.seen_at = now
        return job

    def _sample(self, job: _Job, s: ProgressSample) -> None:
        # A sign of life after the hang began re-arms; a late copy of the last step from a slower
        # tailer does not.
        late_copy = s.phase == "train" and s.step is not None and s.step == job.max_step
        if job.fired_since is not None and s.ts > job.fired_since and not late_copy:
            job.fired_since = None
        marker = checkpoint_marker(s)
        if marker == "start":
            if job.ckpt_since is None:
                job.ckpt_since, job.ckpt_step = s.ts, s.step
            return
        if marker == "end":
            job.ckpt_since = None
            job.last_activity_ts = max(job.last_activity_ts or s.ts, s.ts)
            return
        if s.phase == "eval":
            self._eval(job, s)
        job.last_activity_ts = max(job.last_activity_ts or s.ts, s.ts)
        if s.phase != "train":
            return
        if s.step is not None and job.max_step is not None and s.step <= job.max_step:
            # Another rank's copy of a step we have, or a restart replaying old steps:
            # a sign of life, but no new interval.
            return
        self._advance(job, s)

    @staticmethod
    def _eval(job: _Job, s: ProgressSample) -> None:
        # Megatron prints nothing while it evaluates, only the result: learn how long that takes
        # and at which steps, so that the next evaluation is not taken for a hang.
        if job.last_report_ts is not None and s.ts > job.last_report_ts:
            gap = s.ts - max(job.last_report_ts, job.last_activity_ts or job.last_report_ts)
            if gap > 0:
                job.eval_gap = max(job.eval_gap or 0.0, gap)
        if s.step:
            job.eval_every = math.gcd(job.eval_every or 0, s.step)

    def _advance(self, job: _Job, s: ProgressSample) -> None:
        if job.last_report_ts is not None and job.reports >= self.warmup_steps:
            dstep = s.step - job.max_step if s.step is not None and job.max_step is not None else 1
            est = s.ts - job.last_report_ts
            if s.step_time_s is not None:
                est = max(est, s.step_time_s * dstep)
            if est > 0:
                job.intervals.append((est, dstep))
        job.reports += 1
        job.last_report_ts = max(job.last_report_ts or s.ts, s.ts)
        if s.step is not None:
            job.max_step, job.max_step_ts = s.step, s.ts
        # A new step after a save: frameworks without an end line (HF, Lightning) are done saving.
        job.ckpt_since = job.ckpt_step = None

    def _armed(self, job: _Job) -> bool:
        return job.reports > self.warmup_steps and len(job.intervals) > 0

    @staticmethod
    def _median_interval(job: _Job) -> float:
        return statistics.median(i for i, _ in job.intervals)

    def _in_checkpoint(self, job: _Job, now: float) -> bool:
        return job.ckpt_since is not None and now - job.ckpt_since <= self.checkpoint_allowance_s

    def _last_step_text(self, job: _Job) -> str:
        if job.max_step is not None and job.max_step_ts is not None:
            return f"last step {job.max_step} at {iso(job.max_step_ts)}"
        if job.last_report_ts is not None:
            return f"last progress report at {iso(job.last_report_ts)}"
        return "no progress report seen"

    def _check_progress(self, job: _Job, now: float) -> tuple[float, Anomaly] | None:
        if job.last_activity_ts is None and job.ckpt_since is None:
            return None
        if job.ckpt_since is not None:
            if self._in_checkpoint(job, now):
                return None
            step = f" (step {job.ckpt_step})" if job.ckpt_step is not None else ""
            line = (
                f"checkpoint save of job {job.job_id}{step} started at {iso(job.ckpt_since)} has not finished "
                f"after {now - job.ckpt_since:.0f} s (allowance {self.checkpoint_allowance_s:.0f} s; "
                f"{self._last_step_text(job)})"
            )
            return self._anomaly(job, "job_log", job.ckpt_since, self.checkpoint_allowance_s, line, MEANING_PROGRESS)
        assert job.last_activity_ts is not None
        since = max(job.last_activity_ts, job.clock_floor or job.last_activity_ts)
        silence = now - since
        if self._armed(job):
            median = self._median_interval(job)
            threshold = max(self.k * median, self.floor_s)
            eval_due = (
                job.eval_gap is not None
                and job.eval_every is not None
                and job.max_step is not None
                and job.max_step % job.eval_every == 0
            )
            if eval_due:
                assert job.eval_gap is not None
                threshold = max(threshold, EVAL_SLACK * job.eval_gap)
            if silence <= threshold:
                return None
            steps = statistics.median(d for _, d in job.intervals)
            rhythm = (
                f"median step {median:.1f} s"
                if steps <= 1
                else f"median {median:.1f} s between reports of {steps:g} steps"
            )
            line = (
                f"no progress from job {job.job_id} for {silence:.0f} s ({rhythm}, k={self.k:g}, "
                f"threshold {threshold:.0f} s; {self._last_step_text(job)})"
            )
        else:
            if self.warmup_allowance_s is None:
                return None
            threshold = self.warmup_allowance_s
            if silence <= threshold:
                return None
            line = (
                f"no progress from job {job.job_id} for {silence:.0f} s during warm-up, after {job.reports} "
                f"progress report(s) (warm-up allowance {threshold:.0f} s; {self._last_step_text(job)})"
            )
        return self._anomaly(job, "job_log", since, threshold, line, MEANING_PROGRESS)

    def _check_idle(self, job: _Job, now: float) -> tuple[float, Anomaly] | None:
        if not job.nodes or self._in_checkpoint(job, now):
            return None
        since = job.clock_floor if job.clock_floor is not None else float("-inf")
        gpus = 0
        for node in job.nodes:
            st = self._gpu.get(node)
            if st is None or st.idle_since is None or now - st.last_ts > self.gpu_stale_s:
                return None
            since = max(since, st.idle_since)
            gpus += st.gpus
        if job.last_activity_ts is not None:
            # Progress while the GPUs look idle means the metric misleads, not that the job is stuck.
            since = max(since, job.last_activity_ts)
        need = self.idle_for_s if self._armed(job) else self.warmup_allowance_s
        if need is None or now - since < need:
            return None
        nodes = ",".join(job.nodes)
        line = (
            f"all {gpus} GPUs of job {job.job_id} on {nodes} at <= {self.idle_util_pct:g}% utilization for "
            f"{now - since:.0f} s while RUNNING ({self._last_step_text(job)})"
        )
        return self._anomaly(job, "gpu", since, need, line, MEANING_IDLE)

    def _anomaly(
        self, job: _Job, source: Source, since: float, allowance: float, line: str, meaning: str
    ) -> tuple[float, Anomaly]:
        """(start of the silence, the anomaly). Its time is when the silence became a hang."""
        last: object = job.max_step if job.max_step is not None else job.last_report_ts
        return since, Anomaly(
            # The silence start tells two hangs at one step apart (a restart replaying steps).
            event_id=stable_id("anm", "hang", job.job_id, job.run_start, source, last, since),
            event_time=since + allowance,
            detector=self.name,
            signature="hang" if source == "job_log" else "hang_gpu_idle",
            category="hang",
            severity="error",
            role="root",
            isolate=False,
            source=source,
            provenance="gpu" if source == "gpu" else "job",
            job_id=job.job_id,
            partition=job.partition,
            job_nodes=list(job.nodes),
            line=line[:4096],
            meaning=meaning,
        )


# -- stack dumps of a stuck job (offline: a log that ends in one) ------------------------------

# A thread header of py-spy ("Thread 4079 (active)", "Thread 0x7F4AA36D9700 (active)"), of
# faulthandler ("Thread 0x00007f... (most recent call first):", "Current thread 0x..."), of
# gdb's "thread apply all bt" ("Thread 4 (Thread 0x7fd0... (LWP 3913167)").
DUMP_THREAD = re.compile(
    r"^\s*(?:Current thread 0x[0-9a-fA-F]+ \(most recent call first\)|"
    r"Thread (?:0x[0-9a-fA-F]+|\d+) (?:\((?:active|idle|most recent call first)|\(Thread 0x))"
)
# Innermost frames that mean "parked": waiting in a collective, or for the data loader.
# py-spy writes "func (file:line)", faulthandler 'File "file", line N in func'.
_COLLECTIVE_FUNCS = r"(?:all_?reduce|all_?gather\w*|reduce_scatter\w*|all_to_all\w*|alltoall\w*|broadcast\w*|barrier|\w*wait\w*|recv|send)"
PARKED_IN: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "a collective",
        re.compile(
            r"nccl\w*Kernel|ProcessGroupNCCL|\b(?:all_?reduce|all_?gather\w*|reduce_scatter\w*|all_to_all\w*|"
            r"alltoall\w*|broadcast|barrier|_wait\w*)\b.*(?:distributed|c10d|deepspeed|comm|nccl)|"
            r"torch/distributed/\S*\b(?:wait|barrier)|"
            rf'File "[^"]*(?:torch/distributed|deepspeed/comm|nccl)[^"]*", line \d+ in {_COLLECTIVE_FUNCS}\b'
        ),
    ),
    (
        "the data loader",
        re.compile(
            r"torch/utils/data/\S*dataloader|_worker_loop|_next_data|_try_get_data|"
            r'File "[^"]*torch/utils/data/[^"]*", line \d+ in \w+'
        ),
    ),
)
# A dump that follows one of these is a crash report (faulthandler on SIGSEGV), not a stuck job.
CRASH_DUMP = re.compile(r"Fatal Python error|Segmentation fault|Traceback \(most recent call last\)")
DUMP_FRAMES = 3  # the innermost frames of a thread that are looked at
MEANING_DUMP = (
    "the log ends in a stack dump of threads parked in collectives or in the data loader, with no "
    "completion: the job hung and someone (or a watchdog) dumped its stacks"
)


def parked_threads(lines: Sequence[str]) -> list[tuple[str, str]]:
    """(what it is parked in, the frame line) for each dumped thread whose innermost frames wait
    in a collective or on the data loader; [] when the lines hold no such dump, or the dump
    is a crash report."""
    out: list[tuple[str, str]] = []
    frames_left = 0
    for text in lines:
        if CRASH_DUMP.search(text):
            return []
        if DUMP_THREAD.match(text):
            frames_left = DUMP_FRAMES
            continue
        if frames_left <= 0 or not text.strip():
            continue
        frames_left -= 1
        for what, rx in PARKED_IN:
            if rx.search(text):
                out.append((what, text.strip()))
                frames_left = 0
                break
    return out
