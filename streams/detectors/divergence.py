"""Loss detector: divergence, a loss that turns NaN/inf and stays, a loss that stops being printed.

Pure logic with explicit state, fed with a job's progress samples in order (online from
job.progress, offline from a log's lines); no clock of its own. Per job:

- **Spike vs divergence.** The baseline is the median and MAD of the last `window` healthy
  losses. A loss above ``median + spike_mads x 1.4826 MAD`` *and* at least `min_rel_rise` above
  the median opens a spike (the relative floor keeps a flat series, MAD ~ 0, from calling noise
  a spike). The spike is **healthy** when the loss comes back near the pre-spike level (within
  `recover_rel` of the median, or `recover_mads` MADs) within `recover_within` reports: BLOOM's
  loss spike at iteration 31219 recovered in ~30 iterations. It is a **divergence** when it is
  still high after `recover_within` reports. Spike values never enter the baseline.
- **Drift.** A loss that climbs slowly never opens a spike (the baseline follows it). The median
  of the last `window` losses is compared with the lowest such median seen: above it by
  `drift_rel_rise` for `recover_within` reports in a row is a divergence too.
- **Few earlier losses.** The baseline needs `min_baseline` losses: a median and MAD of three
  values is the least that tolerates one outlier and gives a noise scale. With fewer (a log that
  prints the loss rarely, or an excerpt), there is no noise scale, so only a jump by
  `jump_rel` (the drift threshold: 1.5x) over every earlier loss opens a spike; it is then
  judged like any other.
- **End of the log** (`finish`): a spike still open when the log ends is a divergence if the
  loss is still at its peak (climbing, or no turn back at all). One already coming down after
  `settle_reports` reports or more is not (tr1-13B's spike took ~500 iterations to recover). One
  with fewer reports after the jump (a single report after it, or the jump on the last report)
  is unresolved: too few values to tell a spike on its way down from a new, higher level, so it
  is `unknown` ("needs a person", no action), never healthy.
- **Non-finite.** NaN/inf losses for `nonfinite_persist` reports in a row. One NaN or inf (an
  fp16 loss-scale overflow step, skipped by the scaler) is healthy.
- **Gradient-norm blow-up.** The grad norm of a report at least `grad_rise` (10x, an order of
  magnitude) above the median of the earlier ones (`min_baseline` of them at least) opens a blow-up;
  it is over when the grad norm is back within `grad_recover` (2x) of that median. Magnitude alone
  decides nothing: BLOOM's grad norm went from 0.24 to 960 and came back in ~30 iterations (a healthy
  spike). A blow-up still open after `recover_within` reports is a divergence; one still open when
  the log ends (`finish`), `settle_reports` reports or more after it began, is a divergence when the
  loss also stands `min_rel_rise` above the lowest loss seen (crystal-text-llm issue 6: grad norm
  0.27 -> 14-23 with the loss leaving its low of 0.48 for 0.8-1.0, on its way to ~6), else
  `unknown` ("needs a person"): gradients far above their level with a loss that has not moved yet.
  A loss spike still open at the end decides alone (its verdict knows whether the loss is coming back).
- **Missing loss.** The loss was printed, then `missing_after` training reports of the same
  shape advance the step without it. Megatron leaves the loss out of the line when every
  iteration of the interval was skipped (non-finite gradients), so this is a numerical fault.

Only ``phase == "train"`` samples count; a rank's copy of a step already seen is ignored. One
anomaly per kind per job. Anomaly ids derive from the job, the kind and the step (or time) where
the fault began, so a redelivered input yields the same id.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from schemas.events import Anomaly, ProgressBatch, ProgressSample
from schemas.ids import stable_id

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of a normal series

MEANING_DIVERGED = (
    "the training loss rose far above its recent level and did not come back: the run diverged "
    "(learning rate, bad data, numerics); a restart from the same checkpoint repeats it"
)
MEANING_NONFINITE = "the training loss became NaN/inf and stayed so: the run diverged numerically"
MEANING_UNRESOLVED = (
    "the training loss jumped far above its earlier level and had not come back when the log ended, "
    "with too few reports after the jump to tell a recovering spike from a divergence: needs a person"
)
MEANING_GRAD_BLOWUP = (
    "the gradient norm rose an order of magnitude above its earlier level and had not come back when "
    "the log ended, while the loss climbed off its best level: the run is diverging"
)
MEANING_GRAD_UNRESOLVED = (
    "the gradient norm rose an order of magnitude above its earlier level and had not come back when "
    "the log ended, the loss not (yet) higher: needs a person"
)
# Findings that say "the numbers look wrong" without a verdict: unknown, weaker than any error line.
UNRESOLVED_KINDS = frozenset({"loss_spike_unresolved", "grad_norm_unresolved"})
MEANING_MISSING = (
    "training steps go on but the loss is no longer printed: frameworks omit it when every step is "
    "skipped for non-finite gradients"
)


@dataclass(frozen=True)
class DivergenceSettings:
    window: int = 20
    min_baseline: int = 3
    spike_mads: float = 6.0
    min_rel_rise: float = 0.25
    recover_within: int = 50
    recover_rel: float = 0.10
    recover_mads: float = 3.0
    drift_rel_rise: float = 0.5
    nonfinite_persist: int = 3
    missing_after: int = 10
    finish_min_reports: int = 2
    # With fewer than min_baseline earlier losses there is no MAD: only a jump by the drift threshold
    # (drift_rel_rise) over every earlier loss is a spike. Divergences of the corpus jump more (tr8-104B:
    # 6.4 -> 14, bigscience tr8-104B-wide chronicles); benign early-training bumps are a few percent.
    jump_rel: float = 0.5
    # Reports after the jump needed to judge a spike still open when the log ends as on its way down: as
    # many as the baseline needs (min_baseline), the fewest whose median tolerates one stray value.
    settle_reports: int = 3
    # A grad norm this many times the median of the earlier ones opens a blow-up (an order of magnitude:
    # healthy noise of a steady run is well inside it, e.g. 0.23-0.36 in epfLLM/Megatron-LLM issue 11);
    # back within grad_recover times that median closes it (BLOOM's spike: 960 -> 0.27 against 0.24).
    grad_rise: float = 10.0
    grad_recover: float = 2.0

    def __post_init__(self) -> None:
        if self.window < 2 or self.min_baseline < 2 or self.min_baseline > self.window:
            raise ValueError("DivergenceSettings: need 2 <= min_baseline <= window")
        if min(self.recover_within, self.nonfinite_persist, self.missing_after) < 1:
            raise ValueError("DivergenceSettings: recover_within, nonfinite_persist, missing_after must be >= 1")
        if self.settle_reports < 1:
            raise ValueError("DivergenceSettings: settle_reports must be >= 1")
        if not 1 < self.grad_recover < self.grad_rise:
            raise ValueError("DivergenceSettings: need 1 < grad_recover < grad_rise")
        if min(self.spike_mads, self.min_rel_rise, self.recover_rel, self.drift_rel_rise, self.jump_rel) <= 0:
            raise ValueError("DivergenceSettings: spike_mads, min_rel_rise, recover_rel, drift_rel_rise must be > 0")


@dataclass
class _Spike:
    step: int | None
    ts: float
    baseline: float
    peak: float
    reports: int = 0


@dataclass
class _LossJob:
    job_id: str
    partition: str | None = None
    nodes: tuple[str, ...] = ()
    baseline: deque[float] = field(default_factory=deque)
    recent: deque[float] = field(default_factory=deque)  # every finite loss, for the drift check
    best_median: float | None = None
    drift_reports: int = 0
    drift_since: tuple[int | None, float] | None = None
    spike: _Spike | None = None
    nonfinite: int = 0
    nonfinite_since: ProgressSample | None = None
    loss_shapes: set[tuple[str, bool]] = field(default_factory=set)
    missing: int = 0
    missing_since: ProgressSample | None = None
    best_loss: float | None = None  # the lowest finite loss seen
    grad_base: deque[float] = field(default_factory=deque)  # grad norms outside any blow-up
    grad_blowup: _Spike | None = None
    last_grad: ProgressSample | None = None  # the last sample with a finite grad norm
    last_step: int | None = None
    last_loss: ProgressSample | None = None  # the last sample with a finite loss
    fired: set[str] = field(default_factory=set)


def _shape(s: ProgressSample) -> tuple[str, bool]:
    # HF prints losses in dict lines (no step time) and steps in tqdm bars (a rate): only a line
    # of the kind that carried a loss before can miss one.
    return (s.format, s.step_time_s is not None)


class DivergenceDetector:
    """See the module docstring. `observe(batch)` returns the anomalies that batch confirms."""

    name = "divergence"

    def __init__(self, settings: DivergenceSettings | None = None) -> None:
        self.settings = settings or DivergenceSettings()
        self._jobs: dict[str, _LossJob] = {}

    def observe(self, batch: ProgressBatch) -> list[Anomaly]:
        job = self._jobs.get(batch.job_id)
        if job is None:
            w = self.settings.window
            job = self._jobs[batch.job_id] = _LossJob(
                batch.job_id, baseline=deque(maxlen=w), recent=deque(maxlen=w), grad_base=deque(maxlen=w)
            )
        job.partition = batch.partition or job.partition
        job.nodes = tuple(batch.job_nodes) or job.nodes
        out: list[Anomaly] = []
        for s in batch.samples:
            found = self._sample(job, s)
            if found is not None:
                out.append(found)
        return out

    def finish(self, job_id: str, last_ts: float | None = None) -> list[Anomaly]:
        """The job's log has ended (offline, or the job ended): a spike still open is judged now.

        It is a divergence when the loss was still at its peak when the log ended - climbing, or
        high without any turn back (``last >= (1 - recover_rel) x peak``) for at least
        `finish_min_reports` reports. One coming down after `settle_reports` reports stays healthy;
        one with fewer reports after the jump is unresolved (`unknown`)."""
        job = self._jobs.get(job_id)
        if job is None:
            return []
        return self._finish_loss(job) + self._finish_grad(job)

    def _finish_loss(self, job: _LossJob) -> list[Anomaly]:
        if job.spike is None or job.last_loss is None or job.last_loss.loss is None:
            return []
        spike, cfg = job.spike, self.settings
        last = job.last_loss.loss
        at_peak = last >= (1 - cfg.recover_rel) * spike.peak
        if not at_peak and spike.reports >= cfg.settle_reports:
            return []
        if not at_peak or spike.reports + 1 < cfg.finish_min_reports:
            return self._unresolved(job, spike, last)
        line = (
            f"loss {last:.4g} at {self._at(job.last_loss)} still at its peak when the log ends, "
            f"{spike.reports + 1} reports after it rose from {spike.baseline:.4g} at {self._at_spike(spike)}"
        )
        found = self._fire(job, "loss_divergence", None, job.last_loss, line, MEANING_DIVERGED, spike)
        return [found] if found is not None else []

    def _finish_grad(self, job: _LossJob) -> list[Anomaly]:
        blowup, last, cfg = job.grad_blowup, job.last_grad, self.settings
        # A loss spike still open has its own verdict (at its peak, coming down, unresolved), which knows
        # whether the run is coming back; the grad norm rising with it adds nothing (BLOOM's spike cut at
        # 31222: grad norm 650, loss 5.1 -> 2.8 and falling).
        if (
            job.spike is not None
            or blowup is None
            or last is None
            or last.grad_norm is None
            or blowup.reports < cfg.settle_reports
        ):
            return []
        loss = job.last_loss.loss if job.last_loss is not None else None
        climbing = (
            loss is not None
            and job.best_loss is not None
            and loss >= job.best_loss + cfg.min_rel_rise * abs(job.best_loss)
        )
        line = (
            f"grad norm {last.grad_norm:.4g} at {self._at(last)} when the log ends, "
            f"{last.grad_norm / blowup.baseline:.0f}x its earlier median {blowup.baseline:.4g}, {blowup.reports} "
            f"report(s) after it rose at {self._at_spike(blowup)} (peak {blowup.peak:.4g}; threshold {cfg.grad_rise:g}x)"
        )
        if climbing:
            assert loss is not None and job.best_loss is not None
            line += f"; loss {loss:.4g}, {(loss / job.best_loss - 1) * 100:.0f}% above its best {job.best_loss:.4g}"
            found = self._fire(job, "grad_norm_blowup", None, last, line, MEANING_GRAD_BLOWUP, blowup)
        else:
            found = self._fire(job, "grad_norm_unresolved", None, last, line, MEANING_GRAD_UNRESOLVED, blowup)
        return [found] if found is not None else []

    def _grad(self, job: _LossJob, s: ProgressSample) -> Anomaly | None:
        g, cfg = s.grad_norm, self.settings
        if g is None or not math.isfinite(g) or g < 0:
            return None  # a NaN grad norm of an fp16 overflow step is the loss scaler's business
        job.last_grad = s
        blowup = job.grad_blowup
        if blowup is not None:
            blowup.reports += 1
            blowup.peak = max(blowup.peak, g)
            if g <= cfg.grad_recover * blowup.baseline:
                job.grad_blowup = None
                job.grad_base.append(g)
            elif blowup.reports >= cfg.recover_within and job.spike is None:  # an open loss spike decides alone
                line = (
                    f"grad norm {g:.4g} at {self._at(s)} still {g / blowup.baseline:.0f}x its earlier median "
                    f"{blowup.baseline:.4g} {blowup.reports} reports after it rose at {self._at_spike(blowup)} "
                    f"(recovery allowed within {cfg.recover_within} reports)"
                )
                return self._fire(job, "grad_norm_blowup", None, s, line, MEANING_GRAD_BLOWUP, blowup)
            return None
        if len(job.grad_base) >= cfg.min_baseline:
            median = statistics.median(job.grad_base)
            if median > 0 and g >= cfg.grad_rise * median:
                job.grad_blowup = _Spike(s.step, s.ts, median, g)
                return None
        job.grad_base.append(g)
        return None

    def _unresolved(self, job: _LossJob, spike: _Spike, last: float) -> list[Anomaly]:
        assert job.last_loss is not None
        line = (
            f"loss {last:.4g} at {self._at(job.last_loss)} when the log ends, still above the pre-spike level "
            f"{spike.baseline:.4g} ({(last / spike.baseline - 1) * 100 if spike.baseline else float('inf'):.0f}% "
            f"higher; peak {spike.peak:.4g}), {spike.reports} report(s) after the jump at {self._at_spike(spike)} "
            f"(judging a recovery needs {self.settings.settle_reports})"
        )
        found = self._fire(job, "loss_spike_unresolved", None, job.last_loss, line, MEANING_UNRESOLVED, spike)
        return [found] if found is not None else []

    def forget(self, job_id: str) -> None:
        """The job ended (or runs again from a checkpoint): its loss history no longer applies."""
        self._jobs.pop(job_id, None)

    # -- internals ---------------------------------------------------------------------------

    def _sample(self, job: _LossJob, s: ProgressSample) -> Anomaly | None:
        if s.phase != "train":
            return None
        if s.step is not None:
            if job.last_step is not None and s.step <= job.last_step:
                return None  # another rank's copy, or a replay after a restart
            job.last_step = s.step
        grad = self._grad(job, s)
        if s.loss is None:
            return self._no_loss(job, s) or grad
        job.missing, job.missing_since = 0, None
        job.loss_shapes.add(_shape(s))
        if not math.isfinite(s.loss):
            job.nonfinite += 1
            if job.nonfinite_since is None:
                job.nonfinite_since = s
            if job.nonfinite >= self.settings.nonfinite_persist:
                first = job.nonfinite_since
                line = (
                    f"loss is {s.loss} for {job.nonfinite} reports in a row since "
                    f"{self._at(first)} (threshold {self.settings.nonfinite_persist})"
                )
                return self._fire(job, "loss_nonfinite", first, s, line, MEANING_NONFINITE)
            return None
        job.nonfinite, job.nonfinite_since = 0, None
        job.best_loss = s.loss if job.best_loss is None else min(job.best_loss, s.loss)
        return self._finite(job, s, s.loss) or grad

    def _no_loss(self, job: _LossJob, s: ProgressSample) -> Anomaly | None:
        if _shape(s) not in job.loss_shapes or s.step is None:
            return None
        job.missing += 1
        if job.missing_since is None:
            job.missing_since = s
        if job.missing < self.settings.missing_after:
            return None
        first = job.missing_since
        line = (
            f"no loss in {job.missing} training reports since {self._at(first)} while steps advance "
            f"(last at step {s.step}; threshold {self.settings.missing_after})"
        )
        return self._fire(job, "loss_missing", first, s, line, MEANING_MISSING)

    def _finite(self, job: _LossJob, s: ProgressSample, loss: float) -> Anomaly | None:
        cfg = self.settings
        job.recent.append(loss)
        job.last_loss = s
        drift = self._drift(job, s)
        if job.spike is not None:
            spike = job.spike
            spike.reports += 1
            spike.peak = max(spike.peak, loss)
            if self._recovered(job, loss):
                job.spike = None
                job.baseline.append(loss)
            elif spike.reports >= cfg.recover_within:
                line = (
                    f"loss {loss:.4g} at {self._at(s)} still above the pre-spike level {spike.baseline:.4g} "
                    f"{spike.reports} reports after the spike began at {self._at_spike(spike)} "
                    f"(peak {spike.peak:.4g}; recovery allowed within {cfg.recover_within} reports)"
                )
                return self._fire(job, "loss_divergence", None, s, line, MEANING_DIVERGED, spike)
            return drift
        if len(job.baseline) >= cfg.min_baseline:
            median, sigma = self._stats(job)
            if loss > median + cfg.spike_mads * sigma and loss > median + cfg.min_rel_rise * abs(median):
                job.spike = _Spike(s.step, s.ts, median, loss)
                return drift
        elif job.baseline and loss > max(job.baseline) * (1 + cfg.jump_rel) and min(job.baseline) > 0:
            job.spike = _Spike(s.step, s.ts, statistics.median(job.baseline), loss)
            return drift
        job.baseline.append(loss)
        return drift

    def _drift(self, job: _LossJob, s: ProgressSample) -> Anomaly | None:
        cfg = self.settings
        if len(job.recent) < cfg.window:
            return None
        median = statistics.median(job.recent)
        if job.best_median is None or median < job.best_median:
            job.best_median = median
        best = job.best_median
        if median > best + cfg.drift_rel_rise * abs(best):
            job.drift_reports += 1
            if job.drift_since is None:
                job.drift_since = (s.step, s.ts)
        else:
            job.drift_reports, job.drift_since = 0, None
        if job.drift_reports < cfg.recover_within or job.drift_since is None:
            return None
        step, ts = job.drift_since
        line = (
            f"median loss of the last {cfg.window} reports {median:.4g} at {self._at(s)} is "
            f"{(median / best - 1) * 100 if best else float('inf'):.0f}% above the best level {best:.4g} for "
            f"{job.drift_reports} reports (threshold {cfg.drift_rel_rise * 100:.0f}%)"
        )
        return self._fire(job, "loss_divergence", None, s, line, MEANING_DIVERGED, _Spike(step, ts, best, median))

    def _recovered(self, job: _LossJob, loss: float) -> bool:
        assert job.spike is not None
        base = job.spike.baseline
        _, sigma = self._stats(job)
        return loss <= base + max(self.settings.recover_rel * abs(base), self.settings.recover_mads * sigma)

    @staticmethod
    def _stats(job: _LossJob) -> tuple[float, float]:
        values = list(job.baseline)
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        return median, MAD_TO_SIGMA * mad

    @staticmethod
    def _at(s: ProgressSample | None) -> str:
        if s is None:
            return "?"
        return f"step {s.step}" if s.step is not None else f"t={s.ts:.3f}"

    @staticmethod
    def _at_spike(spike: _Spike) -> str:
        return f"step {spike.step}" if spike.step is not None else f"t={spike.ts:.3f}"

    def _fire(
        self,
        job: _LossJob,
        kind: str,
        first: ProgressSample | None,
        last: ProgressSample,
        line: str,
        meaning: str,
        spike: _Spike | None = None,
    ) -> Anomaly | None:
        if kind in job.fired:
            return None
        job.fired.add(kind)
        began: object = (
            (spike.step if spike.step is not None else spike.ts)
            if spike is not None
            else (first.step if first is not None and first.step is not None else (first or last).ts)
        )
        return Anomaly(
            event_id=stable_id("anm", self.name, job.job_id, kind, began),
            event_time=last.ts,
            detector=self.name,
            signature=kind,
            # An unresolved spike is no finding of a fault: unknown, and weaker than any error line beside it.
            category="unknown" if kind in UNRESOLVED_KINDS else "numerical",
            severity="warning" if kind in UNRESOLVED_KINDS else "error",
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
            meaning=meaning,
        )
