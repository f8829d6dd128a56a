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
from streams.detectors.divergence import UNRESOLVED_KINDS, DivergenceDetector, DivergenceSettings
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
        # An unresolved spike is no fault verdict: unknown, and no stronger than a warning.
        want = ("unknown", "warning") if a.signature in UNRESOLVED_KINDS else ("numerical", "error")
        assert (a.category, a.severity, a.role, a.job_id, a.detector) == (*want, "root", "j1", "divergence")
    return [a.signature for a in anomalies]


def series(*losses: float, first_step: int = 7000) -> list[ProgressSample]:
    return [
        ProgressSample(ts=1000.0 + i, step=first_step + 10 * i, loss=v, format="megatron") for i, v in enumerate(losses)
    ]


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


def test_a_jump_after_one_sample_that_stays_high_is_a_divergence() -> None:
    # tr8-104B's jump (6.44 -> 11.42 between iterations 7000 and 7010) with one earlier loss, no MAD:
    # the jump is 1.77x, over jump_rel; if the loss stays at that level to the end it diverged.
    assert run(series(6.445, 11.42, 11.3)) == ["loss_divergence"]
    assert run(series(6.445, 11.42, 11.3), DivergenceSettings(jump_rel=1.0)) == []  # a 1.77x jump under 2x
    # A rise of a quarter over one earlier loss says nothing without a noise scale.
    assert run(series(6.445, 8.0, 8.1)) == []


def test_a_transient_bump_after_one_sample_stays_healthy() -> None:
    # The same jump, back within recover_rel at the next report: a spike that recovered.
    assert run(series(6.445, 11.42, 6.5, 6.4)) == []


def test_a_jump_with_too_few_reports_after_it_is_unresolved() -> None:
    # tr8-104B as the chronicle prints it: 6.44, 11.42, then 7.16 at 7220, one report after the peak.
    # Neither at the peak nor a falling trend: unknown, not healthy.
    found = samples(DEV / "num_tr8_104b_loss_jump_stays_high" / "job.out")
    assert [round(s.loss or 0, 2) for s in found if s.phase == "train"] == [6.44, 11.42, 7.16]
    assert run(found, finish=False) == []
    assert run(found) == ["loss_spike_unresolved"]
    # Were one report after the jump enough to judge, the same log would be a spike on its way down.
    assert run(found, DivergenceSettings(settle_reports=1)) == []


def test_a_spike_coming_down_for_reports_after_the_jump_stays_healthy() -> None:
    # tr1-13B: 2.77 -> 7.34, 8.72 at 29060, then 7.65, 7.19, 6.85 (the chronicle: "took some 500
    # iterations to recover"). Four reports after the jump, coming down when the log ends.
    found = samples(DEV / "healthy_tr1_fp16_loss_spike_recovering" / "job.out")
    assert run(found) == []
    # Cut one report after the peak (two after the jump), too few to judge: unresolved.
    losses = [s.loss or 0.0 for s in found]
    peak = losses.index(max(losses))
    assert losses[peak] == pytest.approx(8.716, abs=1e-3)
    assert run(found[: peak + 2]) == ["loss_spike_unresolved"]


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 1},
        {"min_baseline": 30},
        {"nonfinite_persist": 0},
        {"spike_mads": 0.0},
        {"jump_rel": 0.0},
        {"settle_reports": 0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="DivergenceSettings"):
        DivergenceSettings(**kwargs)  # type: ignore[arg-type]


# --- gradient-norm blow-up ----------------------------------------------------------------------


def grads(losses: list[float], norms: list[float]) -> list[ProgressSample]:
    return [
        ProgressSample(ts=1000.0 + i, step=100 + i, loss=v, grad_norm=g, format="megatron")
        for i, (v, g) in enumerate(zip(losses, norms, strict=True))
    ]


def test_grad_norm_blowup_with_the_loss_off_its_low_is_a_divergence() -> None:
    # crystal-text-llm issue 6 (HF Trainer): grad norm 0.27 -> 17-23 and not back, loss 0.48 -> 0.82.
    found = samples(DEV / "num_crystal_llm_loss_climbs_grad_norm_swings" / "job.out")
    assert run(found) == ["grad_norm_blowup"]
    assert run(found, finish=False) == []  # too few reports to call it before the log ends


def test_bloom_grad_norm_spike_that_comes_back_is_healthy() -> None:
    # BLOOM-176B 31214-31251: grad norm 0.24 -> 960, back to 0.27 with the loss.
    found = samples(DEV / "healthy_bloom_loss_spike_recovered" / "job.out")
    assert max(s.grad_norm or 0.0 for s in found) > 900
    assert run(found) == []


def test_grad_norm_noise_within_an_order_of_magnitude_is_healthy() -> None:
    # epfLLM/Megatron-LLM issue 11: grad norm 0.23 -> 0.36, loss wobbling around 2.5.
    assert run(samples(DEV / "healthy_megatron_llm_slow_iterations" / "job.out")) == []


def test_grad_norm_blowup_with_a_flat_loss_needs_a_person() -> None:
    found = grads([2.0] * 8, [0.3, 0.3, 0.3, 0.3, 5.0, 6.0, 7.0, 8.0])
    assert run(found) == ["grad_norm_unresolved"]


def test_grad_norm_blowup_just_begun_when_the_log_ends_is_not_judged() -> None:
    # Fewer than settle_reports reports after the rise: nothing to tell a spike from a blow-up yet.
    assert run(grads([2.0] * 6, [0.3, 0.3, 0.3, 0.3, 5.0, 6.0])) == []


def test_grad_norm_blowup_that_lasts_fires_online() -> None:
    n = DivergenceSettings().recover_within
    found = grads([2.0] * (n + 5), [0.3] * 4 + [30.0] * (n + 1))
    assert run(found, finish=False) == ["grad_norm_blowup"]


def test_nan_grad_norms_of_overflow_steps_open_no_blowup() -> None:
    found = grads([2.0] * 8, [0.3, 0.3, 0.3, math.nan, math.nan, math.nan, 0.31, 0.3])
    assert run(found) == []
