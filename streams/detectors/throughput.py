"""Throughput detector: a drop in training speed that persists (a change point, not a dip).

Pure logic with explicit state, fed with a job's progress samples in order. The speed of a
report is its tokens/s when the line prints one, else 1 / time per step (samples/s at a fixed
batch is the same ratio); each job keeps to the first of the two it saw, so that a series never
mixes units.

The baseline is the median (and MAD) of the last `window` healthy speeds after `warmup` reports
(compilation, data-loader start). A report is slow when it is below the median by at least
`drop_rel` and by `drop_mads` x 1.4826 MAD. A slowdown is a finding only after `persist` slow
reports in a row: a checkpoint save, an evaluation or a profiler dump slows one or two reports,
then speed comes back. When the log ends (`finish`: offline, or the job ended) a slowdown that
lasted to the end over `finish_min_reports` reports counts too. Slow reports never enter the baseline; a speed-up does (the new, faster
level becomes the baseline).

**Smaller drops to the end of the log** (`finish` only). Below `drop_rel` a drop is not the
slowdown of a fault by itself (NVRx's straggler detection flags a rank only below a performance
score of 0.75, a 25% drop); but a run that slows by a few percent and stays slow is no proof of
health either (BLOOM-176B lost 5% to one slow GPU, "and remained there"). So at the end of the log
a level shift - the last `notice_min_reports` or more reports each slower than every report before
them, by `notice_rel` at the median and by `drop_mads` robust sigmas of the earlier ones - is a
finding of its own, `throughput_drop_small`: `unknown` unless the evidence beside it says why.

**A decline step after step** (`finish` only, `throughput_decline`): the last `decline_min_reports`
(3) or more reports, each at least `drop_rel` slower than the one before it (two such drops compound to
36% or more), counting the warm-up reports too - warm-up is slower than what follows, so it can end such
a chain but never make one. A checkpoint or evaluation dip is one slow report; a step time that keeps
growing (epfLLM/Megatron-LLM issue 22: 84.6 s, 142.5 s, 202.4 s per iteration, a host memory leak) is
a finding however short the excerpt: `unknown` unless the evidence beside it says why.

What a slowdown means depends on the evidence beside it (`classify_slowdown`): a throttled or
slow GPU or node named in the logs makes it gpu_hardware, data-loader or I/O waits make it
storage, and with neither it is `unknown` - it needs a person; no action is taken on it. The
patterns are data (`SlowdownEvidence`), not code. Online, a straggler GPU found by the straggler
detector is that evidence, joined by attribution.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import Anomaly, ProgressBatch, ProgressSample
from schemas.ids import stable_id
from schemas.vocab import Category

MAD_TO_SIGMA = 1.4826
Unit = Literal["tokens_per_s", "steps_per_s"]

MEANING_SLOW = (
    "training speed dropped and stayed down (not a checkpoint or evaluation dip): something "
    "slowed the job; the evidence beside it says what"
)

MEANING_DECLINE = (
    "training speed fell report after report to the end of the log, each report much slower than the one "
    "before (a step time that keeps growing: a leak, a degrading node or file system); needs a person"
)

MEANING_SMALL = (
    "training speed dropped by a few percent and stayed down to the end of the log: too small to say which "
    "fault, too persistent to call healthy (a slow GPU or node costs this much); needs a person"
)


@dataclass(frozen=True)
class ThroughputSettings:
    window: int = 20
    warmup: int = 1
    min_baseline: int = 4
    drop_rel: float = 0.2
    drop_mads: float = 4.0
    persist: int = 5
    finish_min_reports: int = 3
    # A level shift to the end of the log smaller than drop_rel (see the module docstring): above the 2%
    # that the straggler detector takes as measurement noise between peers (MAD_FLOOR_FRACTION in
    # streams/detectors/straggler.py), below the 5% that BLOOM-176B's operators traced to one slow GPU
    # (bigscience tr11-176B-ml chronicles, 2022-04-28) and far below NVRx's straggler threshold (score
    # 0.75, nvidia-resiliency-ext attribution/straggler/reporting.py identify_stragglers): worth a
    # person's look, not a verdict.
    notice_rel: float = 0.03
    notice_min_reports: int = 2
    # A chain this long of reports each drop_rel slower than the one before (module docstring): three
    # reports, two drops, the fewest that show a trend rather than one dip.
    decline_min_reports: int = 3

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.min_baseline <= self.window:
            raise ValueError("ThroughputSettings: need 2 <= min_baseline <= window")
        if self.warmup < 0 or self.persist < 2 or self.finish_min_reports < 2:
            raise ValueError(
                "ThroughputSettings: warmup must be >= 0, persist and finish_min_reports >= 2 (one slow report is a dip)"
            )
        if self.decline_min_reports < 3:
            raise ValueError("ThroughputSettings: decline_min_reports must be >= 3 (two drops in a row)")
        if not 0 < self.notice_rel <= self.drop_rel or self.notice_min_reports < 2:
            raise ValueError("ThroughputSettings: need 0 < notice_rel <= drop_rel and notice_min_reports >= 2")
        if not 0 < self.drop_rel < 1 or self.drop_mads < 0:
            raise ValueError("ThroughputSettings: drop_rel must be in (0, 1), drop_mads >= 0")


@dataclass(frozen=True)
class SlowdownEvidence:
    """What in a job's logs says why it slowed.

    rules: (category, pattern, what it means): a line matching the pattern is the evidence.
    data_wait: patterns with named groups ``step`` (time of a step) and ``data`` (the part of it
    spent waiting for the next batch), as training loops print them; when at least `data_lines`
    lines show the wait taking `data_share` or more of the step, the job is starved by its data
    loader or storage.
    """

    rules: tuple[tuple[Category, str, str], ...] = (
        (
            "gpu_hardware",
            # nvidia-smi -q lists every reason with Active / Not Active: only Active counts.
            r"\b(?:HW(?: Thermal| Power Brake)? Slowdown|SW Thermal Slowdown)\s*:\s*Active\b"
            r"|(?i:\bthrottl(?:ed|ing)\b.*\bgpu\b|\bgpu\b.*\bthrottl(?:ed|ing)\b|\bslow(?:est)? (?:gpu|rank|node)\b"
            r"|\bstraggler\b)",
            "a throttled or slow GPU or node",
        ),
        (
            "storage",
            r"(?i)data ?loader\b.*\b(?:wait|slow|timeout|stall)|waiting (?:for|on) (?:data|batch|the data ?loader)"
            r"|\bI/O (?:wait|stall|slow)|\biowait\b|\b(?:lustre|gpfs|mmfs|nfs)\b.*\b(?:slow|timeout|not responding|hung)",
            "data-loader or I/O waits",
        ),
    )
    data_wait: tuple[str, ...] = (
        # PyTorch's ImageNet example and its many copies: 'Time 8.719 (0.361)\tData 8.597 (0.230)'.
        r"\bTime (?P<step>\d+(?:\.\d+)?) \([\d.]+\)\s+Data (?P<data>\d+(?:\.\d+)?) \(",
        # detectron2 / mmcv style: 'time: 12.9244 - data_time: 12.4863', 'time: 0.54  data_time: 0.01'.
        r"\btime: (?P<step>\d+(?:\.\d+)?)\b.{0,8}\bdata_time: (?P<data>\d+(?:\.\d+)?)",
    )
    data_share: float = 0.5
    data_lines: int = 2

    def compiled(self) -> list[tuple[Category, re.Pattern[str], str]]:
        return [(cat, re.compile(p), why) for cat, p, why in self.rules]


def _data_starved(lines: Sequence[str], evidence: SlowdownEvidence) -> str | None:
    """The first line of a run of data-wait lines, when enough of them show the job starved."""
    patterns = [re.compile(p) for p in evidence.data_wait]
    hits: list[str] = []
    for text in lines:
        for rx in patterns:
            m = rx.search(text)
            if m is None:
                continue
            step, data = float(m.group("step")), float(m.group("data"))
            if step > 0 and data / step >= evidence.data_share:
                hits.append(text)
            break
    return hits[0] if len(hits) >= evidence.data_lines else None


def classify_slowdown(
    lines: Sequence[str], evidence: SlowdownEvidence | None = None
) -> tuple[Category, str | None, str | None]:
    """(category, what the evidence means, the line) for a slowdown, from the job's log lines.

    The first rule (in order) with a matching line wins, then the data-wait share; no evidence:
    ('unknown', None, None)."""
    ev = evidence or SlowdownEvidence()
    rules = ev.compiled()
    found: dict[int, str] = {}
    for text in lines:
        for i, (_, rx, _) in enumerate(rules):
            if i not in found and rx.search(text):
                found[i] = text
        if len(found) == len(rules):
            break
    for i, (cat, _, why) in enumerate(rules):
        if i in found:
            return cat, why, found[i]
    starved = _data_starved(lines, ev)
    if starved is not None:
        return "storage", f"the wait for data taking {ev.data_share:.0%} or more of each step", starved
    return "unknown", None, None


@dataclass
class _SpeedJob:
    job_id: str
    unit: Unit | None = None
    partition: str | None = None
    nodes: tuple[str, ...] = ()
    seen: int = 0
    baseline: deque[float] = field(default_factory=deque)
    slow: list[tuple[ProgressSample, float]] = field(default_factory=list)
    # Every report after warmup (the last `window`), for the level shift at the end of the log.
    series: deque[tuple[ProgressSample, float]] = field(default_factory=deque)
    warm: list[tuple[ProgressSample, float]] = field(default_factory=list)  # the warm-up reports
    last_step: int | None = None
    fired: bool = False


def speed_of(s: ProgressSample, unit: Unit | None) -> tuple[Unit, float] | None:
    """The sample's speed in the job's unit (the first unit seen decides)."""
    if s.tokens_per_s is not None and s.tokens_per_s > 0 and unit in (None, "tokens_per_s"):
        return "tokens_per_s", s.tokens_per_s
    if s.step_time_s is not None and s.step_time_s > 0 and unit in (None, "steps_per_s"):
        return "steps_per_s", 1.0 / s.step_time_s
    return None


class ThroughputDetector:
    """See the module docstring. `observe(batch)` returns the slowdowns that batch confirms, as
    category `unknown`; `with_evidence` gives one the category its evidence supports."""

    name = "throughput"

    def __init__(self, settings: ThroughputSettings | None = None) -> None:
        self.settings = settings or ThroughputSettings()
        self._jobs: dict[str, _SpeedJob] = {}

    def observe(self, batch: ProgressBatch) -> list[Anomaly]:
        job = self._jobs.get(batch.job_id)
        if job is None:
            w = self.settings.window
            job = self._jobs[batch.job_id] = _SpeedJob(batch.job_id, baseline=deque(maxlen=w), series=deque(maxlen=w))
        job.partition = batch.partition or job.partition
        job.nodes = tuple(batch.job_nodes) or job.nodes
        out = []
        for s in batch.samples:
            a = self._sample(job, s)
            if a is not None:
                out.append(a)
        return out

    def finish(self, job_id: str) -> list[Anomaly]:
        """The job's log has ended (offline, or the job ended): a slowdown that lasted to the end,
        over at least `finish_min_reports` reports with no recovery, is a finding too."""
        job = self._jobs.get(job_id)
        if job is None or job.fired:
            return []
        if len(job.slow) >= self.settings.finish_min_reports:
            job.fired = True
            return [self._anomaly(job, statistics.median(job.baseline))]
        shift = self._level_shift(job)
        if shift is not None:
            job.fired = True
            before, after = shift
            job.slow = after
            return [self._anomaly(job, before, small=True)]
        chain = self._decline(job)
        if chain is None:
            return []
        job.fired = True
        job.slow = chain[1:]
        return [self._anomaly(job, chain[0][1], decline=True)]

    def _decline(self, job: _SpeedJob) -> list[tuple[ProgressSample, float]] | None:
        """The longest tail of the series (warm-up included) in which each report is `drop_rel` or more
        slower than the one before, if it has `decline_min_reports` reports or more."""
        series = job.warm + list(job.series)
        n = 1
        while n < len(series) and series[-n - 1][1] * (1 - self.settings.drop_rel) >= series[-n][1]:
            n += 1
        return series[-n:] if n >= self.settings.decline_min_reports else None

    def _level_shift(self, job: _SpeedJob) -> tuple[float, list[tuple[ProgressSample, float]]] | None:
        """(median speed before, the reports after) of the longest tail of the series that is a drop
        of `notice_rel` or more: each report slower than every one before it, the medians apart by
        `notice_rel` and by `drop_mads` robust sigmas of the reports before. None if there is none."""
        cfg, series = self.settings, list(job.series)
        # Two reports before at least: the median and MAD of one value say nothing about its noise.
        for k in range(2, len(series) - cfg.notice_min_reports + 1):
            head, tail = [v for _, v in series[:k]], [v for _, v in series[k:]]
            before, after = statistics.median(head), statistics.median(tail)
            sigma = MAD_TO_SIGMA * statistics.median(abs(v - before) for v in head)
            if (
                max(tail) < min(head)
                and after <= before * (1 - cfg.notice_rel)
                and before - after >= cfg.drop_mads * sigma
            ):
                return before, series[k:]
        return None

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def _sample(self, job: _SpeedJob, s: ProgressSample) -> Anomaly | None:
        cfg = self.settings
        if s.phase != "train":
            return None
        if s.step is not None:
            if job.last_step is not None and s.step <= job.last_step:
                return None
            job.last_step = s.step
        got = speed_of(s, job.unit)
        if got is None:
            return None
        job.unit, speed = got
        job.seen += 1
        if job.seen <= cfg.warmup:
            job.warm.append((s, speed))
            return None
        job.series.append((s, speed))
        if len(job.baseline) < cfg.min_baseline:
            job.baseline.append(speed)
            return None
        values = list(job.baseline)
        median = statistics.median(values)
        sigma = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
        if speed < median * (1 - cfg.drop_rel) and speed < median - cfg.drop_mads * sigma:
            job.slow.append((s, speed))
            if len(job.slow) >= cfg.persist and not job.fired:
                job.fired = True
                return self._anomaly(job, median)
            return None
        job.slow.clear()
        job.baseline.append(speed)
        return None

    def _anomaly(self, job: _SpeedJob, median: float, small: bool = False, decline: bool = False) -> Anomaly:
        first, last = job.slow[0][0], job.slow[-1][0]
        now = statistics.median(v for _, v in job.slow)
        unit = "tokens/s" if job.unit == "tokens_per_s" else "steps/s"
        where = f"step {first.step}" if first.step is not None else f"t={first.ts:.3f}"
        if decline:
            speeds = ", ".join(f"{v:.4g}" for _, v in job.slow)
            line = (
                f"throughput fell from {median:.4g} {unit} to {speeds} {unit} report after report since {where}, "
                f"each {self.settings.drop_rel * 100:.0f}% or more below the one before, to the end of the log"
            )
        else:
            line = (
                f"throughput {now:.4g} {unit} over {len(job.slow)} reports since {where}, "
                f"{(1 - now / median) * 100:.0f}% below the baseline {median:.4g} {unit} "
                + (
                    f"to the end of the log, each slower than every report before (noticed from "
                    f"{self.settings.notice_rel * 100:.0f}%; a slowdown needs {self.settings.drop_rel * 100:.0f}% for "
                    f"{self.settings.persist} reports)"
                    if small
                    else f"(threshold {self.settings.drop_rel * 100:.0f}% for {self.settings.persist} reports)"
                )
            )
        return Anomaly(
            event_id=stable_id("anm", self.name, job.job_id, first.step if first.step is not None else first.ts),
            event_time=last.ts,
            detector=self.name,
            signature="throughput_decline" if decline else ("throughput_drop_small" if small else "throughput_drop"),
            category="unknown",
            severity="warning",
            role="root",
            isolate=False,
            source="job_log",
            provenance="job",
            job_id=job.job_id,
            node=last.node,
            rank=last.rank,
            partition=job.partition,
            job_nodes=list(job.nodes),
            line=line[:4096],
            meaning=MEANING_DECLINE if decline else (MEANING_SMALL if small else MEANING_SLOW),
        )


def with_evidence(anomaly: Anomaly, lines: Sequence[str], evidence: SlowdownEvidence | None = None) -> Anomaly:
    """The slowdown with the category its evidence gives (see `classify_slowdown`)."""
    category, why, line = classify_slowdown(lines, evidence)
    if why is None or line is None:
        return anomaly
    meaning = f"{anomaly.meaning}; the logs show {why}: {line.strip()[:300]}"
    return anomaly.model_copy(update={"category": category, "meaning": meaning})
