"""GpuHealthDetector on the payloads the real producers build: dcgm-exporter's captured-format
fixture through producers.gpu_dcgm's scraper, and NvmlCollector over the fake pynvml module."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pynvml
import pytest
import yaml

from producers.gpu_dcgm import DcgmScraper
from producers.gpu_nvml import THROTTLE_REASON_NAMES, NvmlCollector
from producers.kernel import parse_kernel_line, to_event
from schemas.errors import ConfigError
from schemas.events import Anomaly, GpuMetrics, GpuSample, Incident, KernelEvent, SchedEvent
from schemas.ids import stable_id
from schemas.vocab import CATEGORIES, SEVERITIES
from streams.attribution import Attributor
from streams.catalog import default_xids, load_xid_catalog
from streams.detectors.gpu_health import (
    DEFAULT_PATH,
    CounterCondition,
    FlagCondition,
    GpuHealthDetector,
    ThrottleCondition,
    load_gpu_health_catalog,
)
from streams.detectors.xid import XidDetector
from tests.conftest import FIXTURES
from tests.fakes.fake_pynvml import FakeNvml

PROM = (FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom").read_text()
NODE = "gpu01"
UNC, CORR = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
VOL, AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC


def hits(anomalies: list[Anomaly]) -> list[tuple[str | None, int | None, str]]:
    return sorted((a.node, a.gpu, a.signature) for a in anomalies)


# --- payloads as the producers make them ------------------------------------------------


def prom(**changes: float) -> str:
    """The dcgm fixture with some series' values changed: key METRIC__HOST__GPU, e.g.
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL__gpu02__3=3."""
    text = PROM
    for key, value in changes.items():
        metric, host, gpu = key.split("__")
        pattern = re.compile(rf'^({metric}\{{gpu="{gpu}",[^\n]*Hostname="{host}"[^\n]*\}}) \S+$', re.M)
        text, n = pattern.subn(rf"\g<1> {value:g}", text)
        assert n == 1, key
    return text


def dcgm(scraper: DcgmScraper, text: str, t: float) -> list[GpuSample]:
    return scraper.samples_from(text, ts=t)


def scraper() -> DcgmScraper:
    return DcgmScraper("http://dcgm-exporter:9400/metrics")


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def nvml(fake: FakeNvml) -> NvmlCollector:
    return NvmlCollector(fake)


def sample(collector: NvmlCollector, t: float) -> GpuSample:
    """The collector's real sample, stamped at `t` (its own clock is time.time()) with the id it would have."""
    s = collector.sample(NODE)
    return s.model_copy(update={"event_time": t, "event_id": stable_id("gpu", NODE, "nvml", f"{t:.6f}")})


def uuid_of(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-{i:012x}"  # tests.fakes.fake_pynvml.h100_gpus


def bus_of(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


# --- catalog ------------------------------------------------------------------------------


def test_catalog_entries_are_valid_and_speak_the_producers_names() -> None:
    catalog = load_gpu_health_catalog()
    conds = {c.id: c for c in catalog.conditions}
    assert set(conds) == {
        "gpu_lost",
        "ecc_dbe",
        "row_remap_failure",
        "row_remap_pending",
        "retired_pages_pending",
        "nvlink_errors",
        "pcie_replay_burst",
        "hw_slowdown",
        "thermal_throttle",
        "power_brake",
    }
    hints = typing.get_type_hints(GpuMetrics)
    reason_names = set(THROTTLE_REASON_NAMES.values())
    for c in catalog.conditions:
        assert c.category in CATEGORIES and c.severity in SEVERITIES and c.meaning and c.title
        if isinstance(c, FlagCondition):
            assert hints[c.field] in (bool, bool | None), c.id
        elif isinstance(c, CounterCondition):
            assert all(hints[f] == int | None for f in c.fields), c.id
        else:
            assert isinstance(c, ThrottleCondition)
            assert set(c.reasons) | set(c.unless) <= reason_names, c.id
    # A reading that is an Xid's fault carries that Xid's signature and xid.yaml's classification.
    xids = load_xid_catalog().xids
    assert (conds["gpu_lost"].signature, conds["ecc_dbe"].signature) == ("xid_79", "xid_48")
    assert conds["row_remap_failure"].signature == "xid_64"
    for cid in ("gpu_lost", "ecc_dbe", "row_remap_failure"):
        c, x = conds[cid], xids[int(conds[cid].signature[4:])]
        assert (c.category, c.severity, c.role, c.isolate) == (x.category, x.severity, x.role, x.isolate)
        assert x.emit and c.isolate and c.category == "gpu_hardware"
    for cid in ("row_remap_pending", "retired_pages_pending", "hw_slowdown", "thermal_throttle", "power_brake"):
        assert conds[cid].severity == "warning" and not conds[cid].isolate
    assert conds["nvlink_errors"].category == "interconnect"
    assert conds["power_brake"].category == "node"
    GpuHealthDetector()  # the default catalogs agree with each other


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "gpu_health.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _entry(data: dict[str, typing.Any], cid: str) -> dict[str, typing.Any]:
    entry: dict[str, typing.Any] = next(e for e in data["conditions"] if e["id"] == cid)
    return entry


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: _entry(d, "nvlink_errors").update(threshold=0),
            r"entry 5 \(id 'nvlink_errors'\): field 'threshold'",
        ),
        (lambda d: _entry(d, "gpu_lost").update(category="gpu"), r"entry 0 \(id 'gpu_lost'\): field 'category'"),
        (lambda d: _entry(d, "power_brake").update(kind="gauge"), r"\(id 'power_brake'\):.*tag"),
        (lambda d: _entry(d, "ecc_dbe").update(fields=["ecc_dbe_volatile", "power_w"]), r"\(id 'ecc_dbe'\): field"),
        (lambda d: _entry(d, "hw_slowdown").update(unless=["hw_slowdown"]), r"\(id 'hw_slowdown'\):.*share"),
        (lambda d: _entry(d, "pcie_replay_burst").update(id="nvlink_errors"), r"entry 6.*duplicate id"),
        (lambda d: _entry(d, "thermal_throttle").pop("duration_s"), r"\(id 'thermal_throttle'\): field 'duration_s'"),
        (lambda d: d.pop("same_fault_s"), r"expected exactly the keys"),
    ],
)
def test_a_bad_entry_is_a_config_error_naming_it(
    tmp_path: Path, change: typing.Callable[[dict[str, typing.Any]], object], expected: str
) -> None:
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    change(data)
    with pytest.raises(ConfigError, match=expected):
        load_gpu_health_catalog(_write(tmp_path, data))


def test_broken_yaml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_gpu_health_catalog(_write(tmp_path, "same_fault_s: 60\nconditions: [{id: x\n"))


def test_an_xid_signature_with_another_classification_is_refused() -> None:
    catalog = load_gpu_health_catalog()
    lost = next(c for c in catalog.conditions if c.id == "gpu_lost")
    weaker = dataclasses.replace(
        catalog,
        conditions=tuple(
            c if c is not lost else lost.model_copy(update={"isolate": False}) for c in catalog.conditions
        ),
    )
    with pytest.raises(ConfigError, match="'gpu_lost'.*Xid 79"):
        GpuHealthDetector(weaker)


# --- dcgm-exporter ------------------------------------------------------------------------


def test_dcgm_fixture_first_scrape_reports_the_xid_and_the_pending_remap_only() -> None:
    det = GpuHealthDetector()
    out = [a for s in dcgm(scraper(), PROM, 1000.0) for a in det.observe(s)]
    # DBE 1 on gpu02 GPU 3 is a baseline (a count, not news); the throttles have lasted 0 s.
    assert hits(out) == [("gpu02", 3, "row_remap_pending"), ("gpu02", 3, "xid_48")]
    xid = next(a for a in out if a.signature == "xid_48")
    assert (xid.category, xid.severity, xid.role, xid.isolate) == ("gpu_hardware", "critical", "root", True)
    assert (xid.source, xid.detector, xid.event_time) == ("gpu", "gpu_health", 1000.0)
    assert "GPU 3 (GPU-e50b95bb-f234-a2ab-e25f-831d7aa302a9, 00000000:5D:00.0)" in xid.meaning
    assert "DCGM_FI_DEV_XID_ERRORS" in xid.meaning and "WORKFLOW_XID_48" in xid.meaning
    assert xid.facts["xid"] == "48" and xid.facts["collector"] == "dcgm"
    remap = next(a for a in out if a.signature == "row_remap_pending")
    assert (remap.severity, remap.isolate, remap.category) == ("warning", False, "gpu_hardware")


def test_dcgm_persistent_throttles_and_counter_bursts_fire_once() -> None:
    det, scr = GpuHealthDetector(), scraper()
    det_out = [det.observe(s) for s in dcgm(scr, PROM, 1000.0)]
    assert sum(map(len, det_out)) == 2

    def at(t: float, text: str = PROM) -> list[tuple[str | None, int | None, str]]:
        return hits([a for s in dcgm(scr, text, t) for a in det.observe(s)])

    assert at(1030.0) == []
    assert at(1061.0) == [("gpu02", 3, "hw_slowdown")]  # HW slowdown alone (8) for 61 s
    assert at(1090.0) == []
    assert at(1121.0) == [("gpu01", 5, "thermal_throttle")]  # sw_thermal + hw_thermal (96) for 121 s
    assert at(1150.0) == []
    # gpu02 GPU 3's DBE counters 1 -> 3; gpu01 GPU 6's NVLink CRC flit 12 -> 30 (total 15 -> 33);
    # gpu01 GPU 1's PCIe replays 2 -> 12.
    burst = prom(
        DCGM_FI_DEV_ECC_DBE_VOL_TOTAL__gpu02__3=3,
        DCGM_FI_DEV_ECC_DBE_AGG_TOTAL__gpu02__3=3,
        DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL__gpu01__6=30,
        DCGM_FI_DEV_PCIE_REPLAY_COUNTER__gpu01__1=12,
    )
    out = [a for s in dcgm(scr, burst, 1180.0) for a in det.observe(s)]
    assert hits(out) == [("gpu01", 1, "pcie_replay_burst"), ("gpu01", 6, "nvlink_errors"), ("gpu02", 3, "xid_48")]
    dbe = next(a for a in out if a.signature == "xid_48")
    assert dbe.meaning.startswith(
        "Uncorrectable (DBE) ECC errors: volatile 1 -> 3, aggregate 1 -> 3 on GPU 3 (GPU-e50b"
    )
    assert dbe.facts["ecc_dbe_volatile_from"] == "1" and dbe.facts["ecc_dbe_aggregate_to"] == "3"
    assert dbe.facts["condition"] == "ecc_dbe" and dbe.isolate and dbe.severity == "critical"
    nvlink = next(a for a in out if a.signature == "nvlink_errors")
    assert (
        nvlink.category == "interconnect" and nvlink.facts["rise"] == "18" and "15 -> 33 within 60 s" in nvlink.meaning
    )
    assert at(1190.0, burst) == []  # standing values: nothing new


def test_dcgm_last_xid_gauge_is_reported_once_even_by_a_restarted_producer() -> None:
    det = GpuHealthDetector()
    assert ("gpu02", 3, "xid_48") in hits([a for s in dcgm(scraper(), PROM, 1000.0) for a in det.observe(s)])
    # A restarted producer's scraper has no memory: the gauge's old 48 comes as new, long after.
    restarted = scraper()
    again = dcgm(restarted, PROM, 5000.0)
    assert [g.xid_events for s in again for g in s.gpus if g.xid_events] == [[48]]
    assert [a.signature for s in again for a in det.observe(s) if a.signature.startswith("xid_")] == []
    # A new last Xid on that GPU is news.
    text = PROM.replace('err_code="48",err_msg="DBE (Double Bit Error) ECC Error"} 48', 'err_code="79",err_msg="x"} 79')
    assert text != PROM
    out = [a for s in dcgm(restarted, text, 5010.0) for a in det.observe(s)]
    assert hits(out) == [("gpu02", 3, "xid_79")]


# --- NVML -----------------------------------------------------------------------------------


def test_healthy_nvml_samples_give_nothing(nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    assert [det.observe(sample(nvml, t)) for t in (0.0, 1.0, 300.0)] == [[], [], []]


def test_lost_gpu_is_xid_79_once_per_episode(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    assert det.observe(sample(nvml, 0.0)) == []
    fake.lose(5)
    (lost,) = det.observe(sample(nvml, 1.0))
    assert (lost.signature, lost.gpu, lost.node) == ("xid_79", 5, NODE)
    assert (lost.category, lost.severity, lost.role, lost.isolate) == ("gpu_hardware", "critical", "root", True)
    assert f"GPU lost (fallen off the bus) on GPU 5 ({uuid_of(5)}, {bus_of(5)})" in lost.meaning
    assert "GPU is lost" in lost.meaning and "GPU is lost" in lost.facts["error"]
    assert det.observe(sample(nvml, 2.0)) == [] and det.observe(sample(nvml, 90.0)) == []  # still lost
    fake.gpus[5].lost_code = None  # reset: it answers again
    assert det.observe(sample(nvml, 100.0)) == []
    fake.lose(5)
    assert hits(det.observe(sample(nvml, 200.0))) == [(NODE, 5, "xid_79")]


def test_nvml_xid_79_and_the_lost_reading_of_one_sample_are_one_anomaly(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    det.observe(sample(nvml, 0.0))
    fake.inject_xid(4, 79)
    fake.lose(4)
    assert hits(det.observe(sample(nvml, 1.0))) == [(NODE, 4, "xid_79")]
    fake.inject_xid(4, 79)  # a late event of the same fault
    assert det.observe(sample(nvml, 2.0)) == []


def test_lost_gpu_and_the_kernels_xid_79_lines_are_one_piece_of_evidence(fake: FakeNvml, nvml: NvmlCollector) -> None:
    lines = (FIXTURES / "logs" / "xid79_kern.log").read_text().splitlines()
    kernel = [
        a
        for line in lines
        if (p := parse_kernel_line(line, "x")) is not None
        for a in XidDetector().detect(to_event(p, 10.0))
    ]
    assert {a.signature for a in kernel} == {"xid_79"} and {a.node for a in kernel} == {NODE}
    det = GpuHealthDetector()
    det.observe(sample(nvml, 9.0))
    fake.lose(0)
    (lost,) = det.observe(sample(nvml, 10.2))
    job = SchedEvent(event_id="s1", event_time=1.0, kind="job", job_id="7", state="RUNNING", nodes=[NODE, "gpu02"])

    def incident(anomalies: list[Anomaly]) -> Incident:
        attributor = Attributor(settle_s=1.0)
        attributor.observe_sched(job, now=1.0)
        for a in anomalies:
            attributor.add(a, now=10.3)
        (inc,) = attributor.flush(12.0)
        return inc

    kernel_only, both = incident(kernel), incident([*kernel, lost])
    # NVML's reading adds no evidence of its own (the kernel's two lines stay two: one source's
    # repeats are what that source saw); it names the GPU and its id is the incident's too.
    assert [e.signature for e in both.evidence] == [e.signature for e in kernel_only.evidence]
    assert both.culprit_node == NODE and both.culprit_gpu == 0 and both.isolate
    assert set(both.anomaly_ids) == {a.event_id for a in [*kernel, lost]}


def _kernel_view(code: int) -> list[Anomaly]:
    text = f"NVRM: Xid (PCI:0000:48:00): {code}, pid=1234, name=python"
    event = KernelEvent(event_id="k", event_time=1.0, node=NODE, kind="xid", xid=code, text=text)
    return XidDetector().detect(event)


def test_nvml_xids_are_classified_as_the_kernel_path_classifies_them(fake: FakeNvml, nvml: NvmlCollector) -> None:
    assert not default_xids()[63].emit and 200 not in default_xids()  # the cases below are what they say
    det = GpuHealthDetector()
    det.observe(sample(nvml, 0.0))
    for gpu, code in ((2, 13), (3, 63), (1, 200), (6, 74), (2, 13)):
        fake.inject_xid(gpu, code)
    out = {a.gpu: a for a in det.observe(sample(nvml, 1.0)) if a.gpu is not None}
    assert sorted(out) == [1, 2, 6]  # Xid 63 is IGNORE: nothing, as on the kernel path
    assert _kernel_view(63) == []
    for gpu, code in ((2, 13), (1, 200), (6, 74)):
        (kernel,) = _kernel_view(code)
        mine = out[gpu]
        assert (mine.signature, mine.category, mine.severity, mine.role, mine.isolate) == (
            kernel.signature,
            kernel.category,
            kernel.severity,
            kernel.role,
            kernel.isolate,
        )
        assert (mine.source, mine.node, mine.facts["xid"]) == ("gpu", NODE, str(code))
    assert out[2].category == "user_code" and not out[2].isolate and out[2].facts["count"] == "2"
    assert out[1].severity == "warning" and "not in the catalog" in out[1].meaning
    assert (
        out[6].category == "interconnect"
        and out[6].isolate
        and "NVIDIA resolution WORKFLOW_NVLINK_ERR" in out[6].meaning
    )


def test_dbe_counter_baseline_rise_and_reset(fake: FakeNvml, nvml: NvmlCollector) -> None:
    ecc = fake.gpus[3].ecc
    ecc[(UNC, VOL)] = ecc[(UNC, AGG)] = 5  # old errors, from before we looked
    det = GpuHealthDetector()
    assert det.observe(sample(nvml, 0.0)) == []
    ecc[(UNC, VOL)] = ecc[(UNC, AGG)] = 7
    (dbe,) = det.observe(sample(nvml, 1.0))
    assert (dbe.signature, dbe.gpu, dbe.isolate, dbe.facts["rise"]) == ("xid_48", 3, True, "2")
    assert dbe.meaning.startswith(
        f"Uncorrectable (DBE) ECC errors: volatile 5 -> 7, aggregate 5 -> 7 on GPU 3 ({uuid_of(3)}, {bus_of(3)})"
    )
    assert dbe.line == f"{NODE} GPU 3: ecc_dbe_volatile 5->7 ecc_dbe_aggregate 5->7"
    assert det.observe(sample(nvml, 2.0)) == []
    ecc[(UNC, VOL)] = 0  # driver reloaded: volatile restarts at 0, aggregate keeps its 7
    assert det.observe(sample(nvml, 100.0)) == []
    ecc[(UNC, VOL)], ecc[(UNC, AGG)] = 1, 8
    assert hits(det.observe(sample(nvml, 200.0))) == [(NODE, 3, "xid_48")]


def test_dbe_counters_moving_one_sample_apart_are_one_episode(fake: FakeNvml, nvml: NvmlCollector) -> None:
    catalog = dataclasses.replace(load_gpu_health_catalog(), same_fault_s=0.0)  # the episode alone decides
    ecc = fake.gpus[3].ecc
    det = GpuHealthDetector(catalog)
    det.observe(sample(nvml, 0.0))
    ecc[(UNC, VOL)] = 1
    assert len(det.observe(sample(nvml, 1.0))) == 1
    ecc[(UNC, AGG)] = 1  # the lifetime counter follows a sample later
    assert det.observe(sample(nvml, 2.0)) == []
    assert det.observe(sample(nvml, 3.0)) == []
    ecc[(UNC, VOL)] = 2  # after a quiet sample: a new error
    assert len(det.observe(sample(nvml, 4.0))) == 1


def test_standing_memory_conditions_once_and_again_after_clearing(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    fake.gpus[4].remapped_rows = (0, 1, 1, 0)  # (correctable, uncorrectable, pending, failure)
    fake.gpus[6].retired_pages_pending = 1
    out = det.observe(sample(nvml, 0.0))  # a standing condition is news on first sight
    assert hits(out) == [(NODE, 4, "row_remap_pending"), (NODE, 6, "retired_pages_pending")]
    assert all(a.severity == "warning" and not a.isolate for a in out)
    assert det.observe(sample(nvml, 1.0)) == []
    fake.gpus[4].remapped_rows = (0, 1, 0, 0)  # GPU reset: the remap took effect
    assert det.observe(sample(nvml, 2.0)) == []
    fake.gpus[4].remapped_rows = (0, 2, 1, 0)
    assert hits(det.observe(sample(nvml, 300.0))) == [(NODE, 4, "row_remap_pending")]
    fake.gpus[4].remapped_rows = (0, 9, 0, 1)  # no spare row left
    (failed,) = det.observe(sample(nvml, 301.0))
    assert (failed.signature, failed.severity, failed.isolate, failed.category) == (
        "xid_64",
        "critical",
        True,
        "gpu_hardware",
    )
    assert failed.facts["field"] == "remapped_rows_failed"


def test_throttle_reports_a_persistent_slowdown_once_and_not_a_short_one(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    fake.gpus[0].clock_reasons = pynvml.nvmlClocksEventReasonHwSlowdown
    assert [det.observe(sample(nvml, t)) for t in (0.0, 30.0, 59.0)] == [[], [], []]
    (slow,) = det.observe(sample(nvml, 61.0))
    assert (slow.signature, slow.gpu, slow.category, slow.severity, slow.role, slow.isolate) == (
        "hw_slowdown",
        0,
        "gpu_hardware",
        "warning",
        "root",
        False,
    )
    assert slow.facts["lasted_s"] == "61" and "hw_slowdown for 61 s (at least 60 s)" in slow.meaning
    assert det.observe(sample(nvml, 90.0)) == []
    fake.gpus[0].clock_reasons = 0
    assert det.observe(sample(nvml, 100.0)) == []
    fake.gpus[0].clock_reasons = pynvml.nvmlClocksEventReasonHwSlowdown
    assert [det.observe(sample(nvml, t)) for t in (110.0, 150.0)] == [[], []]  # 40 s: below the duration
    fake.gpus[0].clock_reasons = 0
    assert det.observe(sample(nvml, 160.0)) == []
    fake.gpus[0].clock_reasons = pynvml.nvmlClocksEventReasonHwSlowdown
    assert det.observe(sample(nvml, 170.0)) == [] and det.observe(sample(nvml, 200.0)) == []
    assert hits(det.observe(sample(nvml, 231.0))) == [(NODE, 0, "hw_slowdown")]  # a new episode
    # Two readings far apart are not "continuously".
    det2 = GpuHealthDetector()
    assert det2.observe(sample(nvml, 0.0)) == [] and det2.observe(sample(nvml, 500.0)) == []


def test_power_brake_is_the_nodes_and_explains_the_hw_slowdown(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    fake.gpus[2].clock_reasons = (
        pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    )
    det.observe(sample(nvml, 0.0))
    (brake,) = det.observe(sample(nvml, 60.0))
    assert (brake.signature, brake.category, brake.isolate) == ("power_brake", "node", False)
    assert brake.facts["throttle_reasons"] == "hw_slowdown,hw_power_brake"


def test_nvlink_errors_fire_on_a_burst_within_the_window_not_a_creep(fake: FakeNvml, nvml: NvmlCollector) -> None:
    flit = (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
    links = fake.gpus[7].nvlink_errors
    links[flit] = 5
    det = GpuHealthDetector()

    def at(t: float, count: int) -> list[Anomaly]:
        links[flit] = count
        return det.observe(sample(nvml, t))

    assert at(0.0, 5) == [] and at(10.0, 14) == []  # +9
    (burst,) = at(20.0, 15)  # +10 within 60 s
    assert (burst.signature, burst.category, burst.gpu, burst.facts["rise"]) == (
        "nvlink_errors",
        "interconnect",
        7,
        "10",
    )
    assert at(30.0, 40) == []  # the same burst
    assert at(100.0, 40) == []  # a quiet window ends it
    assert [at(t, 40 + 3 * i) for i, t in enumerate((130.0, 160.0, 190.0, 220.0), 1)] == [[], [], [], []]
    assert hits(at(230.0, 70)) == [(NODE, 7, "nvlink_errors")]  # a new burst


def test_pcie_replay_burst(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    det.observe(sample(nvml, 0.0))  # GPU 2 starts at 2 replays (h100_gpus: the index)
    fake.gpus[2].pcie_replay = 9
    assert det.observe(sample(nvml, 30.0)) == []  # +7
    fake.gpus[2].pcie_replay = 10
    (burst,) = det.observe(sample(nvml, 40.0))
    assert (burst.signature, burst.category, burst.severity, burst.isolate) == (
        "pcie_replay_burst",
        "gpu_hardware",
        "warning",
        False,
    )
    assert burst.facts["pcie_replay_count_from"] == "2" and burst.facts["pcie_replay_count_to"] == "10"


# --- ids, order, state --------------------------------------------------------------------


def _faulty_run(fake: FakeNvml, nvml: NvmlCollector) -> list[GpuSample]:
    samples = [sample(nvml, 0.0)]
    fake.gpus[3].ecc[(UNC, VOL)] = 2
    fake.inject_xid(1, 13)
    samples.append(sample(nvml, 1.0))
    fake.lose(6)
    samples.append(sample(nvml, 2.0))
    return samples


def test_a_redelivered_sample_gives_the_same_ids(fake: FakeNvml, nvml: NvmlCollector) -> None:
    samples = _faulty_run(fake, nvml)
    first = GpuHealthDetector()
    out = [first.observe(s) for s in samples]
    ids = [[a.event_id for a in row] for row in out]
    assert [hits(row) for row in out] == [[], [(NODE, 1, "xid_13"), (NODE, 3, "xid_48")], [(NODE, 6, "xid_79")]]
    assert [a.event_id for a in first.observe(samples[-1])] == ids[-1]  # redelivered at once
    replayed = GpuHealthDetector()  # a restarted stream processor reading the topic again
    assert [[a.event_id for a in replayed.observe(s)] for s in samples] == ids
    assert len({i for row in ids for i in row}) == 3
    dbe = next(a for a in out[1] if a.gpu == 3)
    assert dbe.event_id == stable_id("anm", samples[1].event_id, "ecc_dbe", 3)


def test_an_older_sample_is_ignored_and_keeps_the_baseline(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    fake.gpus[3].ecc[(UNC, VOL)] = 4
    old = sample(nvml, 5.0)
    assert det.observe(sample(nvml, 10.0)) == []
    fake.gpus[3].ecc[(UNC, VOL)] = 0
    stale = sample(nvml, 3.0)  # late, with an id of its own: reads like a counter reset
    assert det.observe(stale) == [] and det.observe(old) == []
    fake.gpus[3].ecc[(UNC, VOL)] = 4
    assert det.observe(sample(nvml, 11.0)) == []  # had the stale sample re-baselined, 0 -> 4 would fire


def test_forget_drops_a_nodes_state(fake: FakeNvml, nvml: NvmlCollector) -> None:
    det = GpuHealthDetector()
    fake.gpus[4].remapped_rows = (0, 1, 1, 0)
    assert len(det.observe(sample(nvml, 0.0))) == 1
    det.forget("another-node")
    assert det.observe(sample(nvml, 1.0)) == []
    det.forget(NODE)
    fake.gpus[3].ecc[(UNC, VOL)] = 9
    # A fresh start: the pending remap is news again, the DBE count a baseline.
    assert hits(det.observe(sample(nvml, 2.0))) == [(NODE, 4, "row_remap_pending")]


def test_a_swapped_gpu_starts_a_new_baseline(fake: FakeNvml) -> None:
    det = GpuHealthDetector()
    assert det.observe(sample(NvmlCollector(fake), 0.0)) == []
    fake.gpus[3].uuid = "GPU-replacement"
    fake.gpus[3].ecc[(UNC, VOL)] = 3  # the replacement's own history
    assert det.observe(sample(NvmlCollector(fake), 600.0)) == []


def test_a_counter_reset_is_a_new_baseline_for_a_windowed_counter(fake: FakeNvml, nvml: NvmlCollector) -> None:
    flit = (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
    links = fake.gpus[7].nvlink_errors
    det = GpuHealthDetector()

    def at(t: float, count: int) -> list[Anomaly]:
        links[flit] = count
        return det.observe(sample(nvml, t))

    assert at(0.0, 400) == []
    assert at(10.0, 0) == []  # GPU reset: the counters start again, not a fault
    assert at(20.0, 9) == []
    assert hits(at(30.0, 12)) == [(NODE, 7, "nvlink_errors")]  # +12 since the reset, within 60 s
