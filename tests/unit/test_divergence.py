"""Loss detector (streams.detectors.divergence) on real training logs.

The lines are the corpus's (tests/fixtures/corpus/dev, sources in each label.yaml) and
tests/fixtures/progress (sources in SOURCES.md there), parsed by the job-log producer's
ProgressParser as the streams worker receives them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from producers.joblogs import split_rank_prefix
from producers.progress import ProgressParser
from schemas.events import ProgressBatch, ProgressSample
from streams.detectors.divergence import DivergenceDetector, DivergenceSettings
from tests.conftest import FIXTURES
from trainmedic.ops.diagnose import OfflineSettings

DEV = FIXTURES / "corpus" / "dev"
PROGRESS = FIXTURES / "progress"
# The generic "epoch/step N ... loss X" pattern diagnose adds for logs of no known framework.
GENERIC = OfflineSettings().fallback_progress[0]
BIGDL = r"\[Iteration (?P<step>\d+)\].*Loss is (?P<loss>[^ ]+?)\. "


def samples(path: Path, *patterns: str) -> list[ProgressSample]:
    parser = ProgressParser(patterns)
    out = []
    for i, raw in enumerate(path.read_text().splitlines()):
        r = split_rank_prefix(raw)
        s = parser.parse(r.text, ts=1000.0 + i, rank=r.rank)
        if s is not None:
            out.append(s)
    assert out, f"no progress parsed from {path}"
    return out


def run(found: list[ProgressSample], settings: DivergenceSettings | None = None, finish: bool = True) -> list[str]:
    det = DivergenceDetector(settings)
    batch = ProgressBatch(event_id="b1", event_time=1000.0, job_id="j1", samples=found)
    anomalies = det.observe(batch) + (det.finish("j1") if finish else [])
    for a in anomalies:
        assert (a.category, a.role, a.job_id, a.detector) == ("numerical", "root", "j1", "divergence")
    return [a.signature for a in anomalies]


def test_bloom_spike_that_recovers_is_healthy() -> None:
    # BLOOM-176B iterations 31214-31251: lm loss 2.2 -> 5.1 at 31219, back to 2.2 by 31250.
    found = samples(DEV / "healthy_bloom_loss_spike_recovered" / "job.out")
    losses = [s.loss for s in found]
    assert max(x for x in losses if x is not None) > 5.0
    assert run(found) == []


def test_the_same_spike_cut_before_it_recovers() -> None:
    # The excerpt up to 31222 (before the author's elision): loss 2.80 and falling, 4 reports after
    # the spike. Coming down when the log ends: not a divergence.
    found = [s for s in samples(DEV / "healthy_bloom_loss_spike_recovered" / "job.out") if (s.step or 0) <= 31222]
    assert run(found) == []
    # Without the end of the log, the recovery window decides: 3 reports allowed, still high -> diverged.
    assert run(found, DivergenceSettings(recover_within=3), finish=False) == ["loss_divergence"]
    # The default window (50 reports) is still open: nothing yet.
    assert run(found, finish=False) == []


def test_loss_that_climbs_and_keeps_climbing_diverged() -> None:
    # tr8-104B: 6.37, 6.60, 7.31, 9.12, 10.24 over iterations 6900-6940, then NaN.
    found = samples(DEV / "num_tr8_104b_loss_climbing_divergence" / "job.out")
    assert run(found, finish=False) == []  # online, 2 reports into the spike: too early to say
    assert run(found) == ["loss_divergence"]  # the log ends at the peak


def test_nan_that_stays_is_a_divergence_and_one_infinity_is_not() -> None:
    nan = samples(DEV / "num_loss_nan_epochs" / "job.out", GENERIC)
    assert sum(1 for s in nan if s.loss is not None and math.isnan(s.loss)) == 8
    assert run(nan) == ["loss_nonfinite"]
    # BigDL: one 'Loss is Infinity.' (an overflow step) is no divergence by itself.
    one = samples(PROGRESS / "loss_single_infinity.log", BIGDL)
    assert [s.loss for s in one][-1] == math.inf
    assert run(one) == []


def test_loss_that_stops_being_printed() -> None:
    # Megatron iterations 100-2000 with an lm loss, then iterations 5426-5428 of another run that
    # print a NaN grad norm and no loss (every step skipped). Lines of one format, two sources.
    found = samples(PROGRESS / "megatron.log")
    with_loss = [s for s in found if s.phase == "train" and s.loss is not None and (s.step or 0) <= 2000]
    without = [s for s in found if s.phase == "train" and s.loss is None and (s.step or 0) >= 5426]
    assert with_loss and len(without) == 3
    assert run(with_loss + without) == []  # 3 reports: under the default 10
    assert run(with_loss + without, DivergenceSettings(missing_after=3)) == ["loss_missing"]


def test_noisy_loss_without_a_trend_is_healthy() -> None:
    # deeplab-lfov steps 12972-13001: a loss between 0.41 and 1.82 for 30 steps, and 5.1 once at the
    # checkpoint step, back to 0.86 at the next.
    found = samples(PROGRESS / "checkpoint_step_dip.log", r"^step (?P<step>\d+) \t loss = (?P<loss>[\d.]+),")
    assert len(found) == 30
    assert run(found) == []


def test_one_anomaly_per_kind_and_stable_ids() -> None:
    nan = samples(DEV / "num_loss_nan_epochs" / "job.out", GENERIC)
    det = DivergenceDetector()
    first = det.observe(ProgressBatch(event_id="b1", event_time=1.0, job_id="j1", samples=nan))
    again = det.observe(ProgressBatch(event_id="b2", event_time=1.0, job_id="j1", samples=nan))
    assert len(first) == 1 and again == []  # replayed steps are ignored
    other = DivergenceDetector().observe(ProgressBatch(event_id="b3", event_time=1.0, job_id="j1", samples=nan))
    assert other[0].event_id == first[0].event_id


@pytest.mark.parametrize("kwargs", [{"window": 1}, {"min_baseline": 30}, {"nonfinite_persist": 0}, {"spike_mads": 0.0}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="DivergenceSettings"):
        DivergenceSettings(**kwargs)  # type: ignore[arg-type]
