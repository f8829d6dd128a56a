"""PreFailureDetector and its catalog on the samples the real producers build: NvmlCollector over
the fake pynvml module (tests/fakes/fake_pynvml.py) and dcgm-exporter's captured-format fixture
through producers.gpu_dcgm's scraper."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from producers.gpu_dcgm import DcgmScraper
from producers.gpu_nvml import NvmlCollector
from schemas.events import GpuMetrics, GpuSample
from schemas.ids import stable_id
from streams.catalog import CatalogError
from streams.detectors.prefailure import (
    DEFAULT_PATH,
    MAX_SAMPLES,
    SLOTS,
    PreFailureDetector,
    PreFailureVerdict,
    StateRule,
    TrendRule,
    load_prefailure_catalog,
    node_verdict,
)
from tests.conftest import FIXTURES
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

NODE = "gpu01"
CORR = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
VOL, AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
HW_SLOWDOWN = pynvml.nvmlClocksThrottleReasonHwSlowdown
SW_POWER_CAP = pynvml.nvmlClocksThrottleReasonSwPowerCap


class Rig:
    """A fake node (8 H100s) read by the real NVML collector, and a detector fed its samples."""

    def __init__(self) -> None:
        self.fake = FakeNvml()
        self.collector = NvmlCollector(self.fake)
        self.detector = PreFailureDetector()
        self.t = 1_800_000_000.0
        self.samples: list[GpuSample] = []

    def gpu(self, index: int = 2) -> FakeGpu:
        return self.fake.gpus[index]

    def sample(self) -> GpuSample:
        s = self.collector.sample(NODE)
        s = s.model_copy(update={"event_time": self.t, "event_id": stable_id("gpu", NODE, "nvml", f"{self.t:.6f}")})
        self.samples.append(s)
        return s

    def step(self, dt: float, change: Callable[[FakeGpu], None] | None = None) -> list[PreFailureVerdict]:
        self.t += dt
        if change is not None:
            change(self.gpu())
        return self.detector.observe(self.sample())

    def run(self, n: int, dt: float, change: Callable[[FakeGpu], None] | None = None) -> list[PreFailureVerdict]:
        out: list[PreFailureVerdict] = []
        for _ in range(n):
            out += self.step(dt, change)
        return out


def ids(verdicts: list[PreFailureVerdict]) -> list[tuple[int, str]]:
    return sorted((v.gpu, v.rule_id) for v in verdicts)


def sbe(n: int) -> Callable[[FakeGpu], None]:
    def change(gpu: FakeGpu) -> None:
        gpu.ecc[(CORR, VOL)] += n

    return change


def pcie(n: int) -> Callable[[FakeGpu], None]:
    def change(gpu: FakeGpu) -> None:
        gpu.pcie_replay += n

    return change


def nvlink(n: int) -> Callable[[FakeGpu], None]:
    def change(gpu: FakeGpu) -> None:
        key = (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
        gpu.nvlink_errors[key] = gpu.nvlink_errors.get(key, 0) + n

    return change


# --- catalog ------------------------------------------------------------------------------


def test_catalog_loads_and_every_rule_cites_a_source() -> None:
    catalog = load_prefailure_catalog()
    rules = {r.id: r for r in catalog.rules}
    assert {r.kind for r in catalog.rules} == {"state", "trend"}
    assert {"row_remap_pending", "retired_pages_pending"} <= {r.id for r in catalog.rules if r.kind == "state"}
    for rule in catalog.rules:
        assert rule.sources, rule.id
        for src in rule.sources:
            assert src.url.startswith("https://") and src.version and src.says, rule.id
        # A lead time is cited or its absence explained; a confidence says where it comes from.
        assert rule.lead_time_s is not None or rule.lead_time_note, rule.id
        assert rule.confidence.basis in ("cited", "documented", "placeholder") and rule.confidence.note
        if isinstance(rule, TrendRule):
            assert rule.threshold_basis in ("cited", "placeholder") and rule.threshold_note
    assert rules["nvlink_error_rate"].predicts.xids == (74,)
    assert rules["pcie_replay_rate"].predicts.failure == "fallen_off_bus"


def test_every_field_a_rule_reads_is_on_the_gpu_sample() -> None:
    known = set(GpuMetrics.model_fields)
    assert GpuSample.model_fields["gpus"].annotation == list[GpuMetrics]
    for rule in load_prefailure_catalog().rules:
        named: list[str] = [rule.field] if isinstance(rule, StateRule) else [*rule.fields]
        if isinstance(rule, TrendRule) and rule.measure == "share":
            named.append("throttle_reasons")
        assert named and set(named) <= known, rule.id


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("field: remapped_rows_pending", "field: remapped_rows_maybe", "rules.0.state.field"),
        (
            "    lead_time_s: null\n    lead_time_note: >-\n      not a countdown: NVIDIA",
            "    lead_time_s: null\n    x_note: >-\n      not a countdown: NVIDIA",
            "rules.0",
        ),
        ("    window_s: 60\n    threshold: 10\n", "    window_s: 60\n    threshold: 10\n    factor: 3\n", "factor"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_file_and_field(tmp_path: Path, old: str, new: str, says: str) -> None:
    text = DEFAULT_PATH.read_text()
    assert old in text
    bad = tmp_path / "prefailure.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(CatalogError) as err:
        load_prefailure_catalog(bad)
    assert str(bad) in str(err.value) and says in str(err.value)


def test_a_rule_without_a_source_is_refused(tmp_path: Path) -> None:
    text = DEFAULT_PATH.read_text()
    start = text.index("    sources:\n", text.index("id: throttle_share"))
    bad = tmp_path / "prefailure.yaml"
    bad.write_text(text[:start] + "    sources: []\n")
    with pytest.raises(CatalogError, match="sources"):
        load_prefailure_catalog(bad)


# --- state rules ----------------------------------------------------------------------------


def test_healthy_node_gives_no_verdict() -> None:
    rig = Rig()
    # Healthy H100s with standing (flat) counters and a power cap now and then: nothing foretold.
    assert rig.run(120, 10.0, lambda g: setattr(g, "clock_reasons", SW_POWER_CAP)) == []
    assert rig.detector.node_verdict(NODE) is None


@pytest.mark.parametrize(
    ("rule", "set_state", "field"),
    [
        ("row_remap_pending", lambda g: setattr(g, "remapped_rows", (0, 1, 1, 0)), "remapped_rows_pending"),
        ("retired_pages_pending", lambda g: setattr(g, "retired_pages_pending", 1), "retired_pages_pending"),
    ],
)
def test_state_rule_fires_once_on_the_documented_state_and_rearms(
    rule: str, set_state: Callable[[FakeGpu], None], field: str
) -> None:
    rig = Rig()
    assert rig.step(10.0) == []
    first = rig.step(10.0, set_state)
    assert ids(first) == [(2, rule)]
    v = first[0]
    assert v.node == NODE and v.uuid == rig.gpu().uuid and v.evidence == {field: "true"}
    assert v.predicts == "reset_required" and v.lead_time_s is None and v.lead_time_note
    assert v.first_seen == rig.t and v.confidence_basis == "documented" and v.sources
    # The state holds: one verdict per condition, however many samples show it.
    assert rig.run(5, 10.0) == []
    assert [x.rule_id for x in rig.detector.open_verdicts(NODE)] == [rule]
    # Cleared (the GPU was reset), then set again: a new condition, a new verdict and id.
    assert rig.step(10.0, reset) == []
    assert rig.detector.open_verdicts(NODE) == []
    again = rig.step(10.0, set_state)
    assert ids(again) == [(2, rule)] and again[0].event_id != v.event_id


def reset(gpu: FakeGpu) -> None:
    """What a GPU reset does to the pending states: the remap and the retirement take effect."""
    gpu.remapped_rows = (0, 1, 0, 0)
    gpu.retired_pages_pending = 0


def test_unreadable_state_neither_starts_nor_clears() -> None:
    rig = Rig()
    rig.step(10.0, lambda g: setattr(g, "remapped_rows", (0, 1, 1, 0)))
    rig.gpu().unsupported.add("nvmlDeviceGetRemappedRows")
    assert rig.step(10.0) == []
    assert [v.rule_id for v in rig.detector.open_verdicts(NODE)] == ["row_remap_pending"]
    rig.gpu().unsupported.clear()
    assert rig.step(10.0) == []  # still pending: the same condition, no second verdict


def test_dcgm_fixture_row_remap_pending_gpu_gets_a_verdict() -> None:
    text = (FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom").read_text()
    samples = DcgmScraper("http://dcgm-exporter:9400/metrics").samples_from(text, ts=1_800_000_000.0)
    det = PreFailureDetector()
    out = [v for s in samples for v in det.observe(s)]
    assert [(v.node, v.gpu, v.rule_id) for v in out] == [("gpu02", 3, "row_remap_pending")]
    assert out[0].collector == "dcgm"


# --- trend rules ----------------------------------------------------------------------------


def test_sbe_rate_fires_at_threshold_within_the_window() -> None:
    rig = Rig()
    rig.step(10.0)
    assert rig.run(4, 10.0, sbe(2)) == []  # 8 in 40 s: below 10
    out = rig.step(10.0, sbe(2))  # 10 within 50 s
    assert ids(out) == [(2, "ecc_sbe_rate")]
    ev = out[0].evidence
    assert ev["counter"] == "ecc_sbe_volatile" and ev["rise"] == "10" and ev["threshold"] == "10"
    assert float(ev["over_s"]) <= 60 and out[0].predicts == "uncorrectable_ecc" and out[0].xids == (48, 94, 95)
    assert rig.run(3, 10.0, sbe(2)) == []  # still rising: the same condition
    # Quiet for a window: cleared; a new burst is a new verdict.
    assert rig.run(7, 10.0) == [] and rig.detector.open_verdicts(NODE) == []
    assert ids(rig.run(2, 10.0, sbe(6))) == [(2, "ecc_sbe_rate")]


def test_sbe_rate_below_threshold_or_spread_past_the_window_gives_nothing() -> None:
    rig = Rig()
    rig.step(10.0)
    assert rig.run(1, 10.0, sbe(9)) == []  # 9: below
    assert rig.run(7, 10.0) == []  # quiet past the window: the 9 leaves it
    # 2 every 15 s: 8 per minute, 40 in five minutes - past 10 overall, never within 60 s.
    assert rig.run(20, 15.0, sbe(2)) == []


def test_counter_reset_rebaselines() -> None:
    rig = Rig()
    rig.step(10.0, lambda g: g.ecc.__setitem__((CORR, VOL), 5000))
    rig.step(10.0, lambda g: g.ecc.__setitem__((CORR, VOL), 0))  # driver reload: volatile counts restart
    assert rig.step(10.0, lambda g: g.ecc.__setitem__((CORR, VOL), 9)) == []
    out = rig.step(10.0, sbe(1))
    assert ids(out) == [(2, "ecc_sbe_rate")] and out[0].evidence["from"] == "0"


def test_sbe_acceleration_needs_two_windows_and_the_factor() -> None:
    def hours(first: int, second: int) -> list[PreFailureVerdict]:
        rig = Rig()
        rig.step(60.0)
        # Spread over each hour (one error every 6 minutes at most) so the minute rate rule stays quiet.
        out = [v for i in range(60) for v in rig.step(60.0, sbe(1) if i % (60 // first) == 0 else None)]
        out += [v for i in range(60) for v in rig.step(60.0, sbe(1) if i < second * 6 and i % 6 == 0 else None)]
        return [v for v in out if v.rule_id == "ecc_sbe_acceleration"]

    fired = hours(5, 10)  # 5 then 10: twice as fast, and 10 reached
    assert len(fired) == 1 and fired[0].evidence["previous_rise"] == "5" and fired[0].evidence["rise"] == "10"
    assert hours(5, 9) == []  # 9: below the threshold
    assert hours(6, 10) == []  # 10 against 6: under twice
    # 10 in the first hour watched: no whole hour before it to compare with.
    rig = Rig()
    rig.step(60.0)
    first_hour = [v for i in range(60) for v in rig.step(60.0, sbe(1) if i % 6 == 0 else None)]
    assert [v for v in first_hour if v.rule_id == "ecc_sbe_acceleration"] == []


def test_nvlink_rate_fires_above_dcgm_limits_and_not_below() -> None:
    rig = Rig()
    rig.step(10.0)
    assert rig.run(5, 10.0, nvlink(1000)) == []  # 5000 in 50 s: CRC noise under 100/s
    out = rig.step(10.0, nvlink(1000))  # 6000 within 60 s
    assert ids(out) == [(2, "nvlink_error_rate")] and out[0].xids == (74,)
    rig2 = Rig()
    rig2.step(10.0)
    assert rig2.run(30, 10.0, nvlink(900)) == []  # 900 every 10 s: 5400 a minute, forever


def test_pcie_replay_rate_needs_the_rate_held_over_five_minutes() -> None:
    rig = Rig()
    rig.step(60.0)
    # 16 in one minute, then quiet: a burst (gpu_health's warning), not a sustained rate.
    assert rig.step(60.0, pcie(16)) == [] and rig.run(8, 60.0) == []
    # 8 a minute for five minutes: 40 within 300 s.
    out = rig.run(5, 60.0, pcie(8))
    assert ids(out) == [(2, "pcie_replay_rate")] and out[0].evidence["rise"] == "40"


def test_throttle_share_over_a_full_window() -> None:
    def run(slowed_every: int, reason: int = HW_SLOWDOWN) -> list[PreFailureVerdict]:
        rig = Rig()
        out = []
        for i in range(90):  # 15 minutes at 10 s
            rig.gpu().clock_reasons = reason if i % slowed_every == 0 else 0
            out += rig.step(10.0)
        return out

    fired = run(1)
    assert ids(fired) == [(2, "throttle_share")] and fired[0].predicts == "slowdown"
    # Not before a full window was observed (60 samples at 10 s).
    assert fired[0].first_seen == 1_800_000_000.0 + 10.0 * 61
    assert run(3) == []  # a third of the samples: below half
    assert run(1, SW_POWER_CAP) == []  # power capping is normal operation


# --- ids, node verdicts, memory ----------------------------------------------------------


def test_redelivered_samples_give_the_same_verdict_ids() -> None:
    rig = Rig()
    rig.step(10.0)
    first = rig.step(10.0, lambda g: setattr(g, "remapped_rows", (0, 1, 1, 0)))
    assert rig.detector.observe(rig.samples[-1]) == first  # redelivered: the same verdicts
    assert rig.detector.observe(rig.samples[0]) == []  # older: nothing
    # A fresh detector (a restarted worker) reading the same samples gives the same ids.
    again = PreFailureDetector()
    replay = [v for s in rig.samples for v in again.observe(s)]
    assert [v.event_id for v in replay] == [v.event_id for v in first]


def test_node_verdict_summarises_its_gpus() -> None:
    rig = Rig()
    rig.step(10.0)
    rig.fake.gpus[5].retired_pages_pending = 1
    rig.step(10.0, lambda g: setattr(g, "remapped_rows", (0, 1, 1, 0)))
    nv = rig.detector.node_verdict(NODE)
    assert nv is not None and nv.node == NODE and nv.gpus == (2, 5)
    assert nv.failures == ("reset_required",) and nv.confidence == 1.0 and nv.lead_time_s is None
    assert {v.rule_id for v in nv.verdicts} == {"row_remap_pending", "retired_pages_pending"}
    with pytest.raises(ValueError, match="several nodes"):
        node_verdict([*nv.verdicts, dataclasses.replace(nv.verdicts[0], node="gpu09")])


def test_memory_stays_bounded() -> None:
    rig = Rig()
    rig.step(1.0)
    sizes = []
    errors = sbe(1)
    for _hour in range(3):
        for _ in range(1800):  # an error every 2 s, one sample every 2 s: every window moves
            rig.step(2.0, errors)
        sizes.append(rig.detector.retained())
        for gpu in rig.detector._streams.streams[(NODE, "nvml")].gpus.values():
            assert all(len(d) <= MAX_SAMPLES for d in gpu.counters.values())
            assert all(len(d) <= SLOTS + 2 for d in gpu.throttled.values())
        # Bounded by resolution, not by dropping the window: the acceleration rule still sees two hours.
        kept = (
            rig.detector._streams.streams[(NODE, "nvml")].gpus[2].counters[("ecc_sbe_acceleration", "ecc_sbe_volatile")]
        )
        assert min(rig.t - rig.samples[0].event_time, 7200) - 2 * 3600 / SLOTS <= rig.t - kept[0][0] <= 7200
    # After the longest window (two hours for acceleration) the windows hold what they held.
    assert sizes[2] == sizes[1] and sizes[2] <= 8 * 6 * MAX_SAMPLES
