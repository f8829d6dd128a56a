"""NvmlCollector against a fake pynvml module (8 GPUs); the collector code is the real one."""

from __future__ import annotations

import inspect

import pynvml
import pytest

from producers.gpu_nvml import NvmlCollector, NvmlUnavailable, decode_throttle_reasons
from schemas.events import GpuMetrics
from tests.fakes.fake_pynvml import FakeNvml, h100_gpus

MEASURED = (
    "utilization_pct",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "throttle_reasons",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "retired_pages_pending",
    "remapped_rows_pending",
    "remapped_rows_failed",
    "pcie_replay_count",
    "nvlink_errors",
)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(h100_gpus(8))


def by_index(gpus: list[GpuMetrics]) -> dict[int, GpuMetrics]:
    return {g.index: g for g in gpus}


def test_eight_gpus_values_mapped(fake: FakeNvml) -> None:
    fake.gpus[3].clock_reasons = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    fake.gpus[4].remapped_rows = (2, 1, 1, 0)
    fake.gpus[5].remapped_rows = (0, 9, 0, 1)
    fake.gpus[6].retired_pages_pending = 1
    fake.gpus[7].nvlink_errors = {
        (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 5,
        (11, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 2,
        (17, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY): 1,
    }
    collector = NvmlCollector(fake)
    sample = collector.sample("gpu01")

    assert (sample.node, sample.collector, len(sample.gpus)) == ("gpu01", "nvml", 8)
    gpus = by_index(sample.gpus)
    for i, src in enumerate(fake.gpus):
        g = gpus[i]
        assert (g.uuid, g.pci_bus_id, g.lost, g.error) == (src.uuid, src.pci_bus_id, False, None)
        assert g.utilization_pct == src.utilization_pct
        assert (g.memory_used_bytes, g.memory_total_bytes) == (src.memory_used, src.memory_total)
        assert g.temperature_c == src.temperature_c
        assert g.power_w == pytest.approx(src.power_mw / 1000)
        assert (g.sm_clock_mhz, g.mem_clock_mhz) == (src.sm_clock_mhz, src.mem_clock_mhz)
        assert g.ecc_sbe_volatile == i and g.ecc_sbe_aggregate == 10 * i
        assert g.ecc_dbe_volatile == 0 and g.ecc_dbe_aggregate == 0
        assert g.pcie_replay_count == i
        assert g.xid_events == []
    assert gpus[0].throttle_reasons == []
    assert gpus[3].throttle_reasons == ["power_cap", "hw_thermal"]
    assert (gpus[4].remapped_rows_pending, gpus[4].remapped_rows_failed) == (True, False)
    assert (gpus[5].remapped_rows_pending, gpus[5].remapped_rows_failed) == (False, True)
    assert gpus[6].retired_pages_pending is True and gpus[0].retired_pages_pending is False
    assert gpus[7].nvlink_errors == 8 and gpus[0].nvlink_errors == 0
    collector.close()
    assert fake.initialized == 0


def test_handles_are_looked_up_once(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake)
    for _ in range(3):
        collector.sample("gpu01")
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 8
    assert fake.calls["nvmlDeviceGetUUID"] == 8
    assert fake.calls["nvmlDeviceGetPciInfo"] == 8
    # One field-values call per GPU per sample gets all NVLink totals.
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3 * 8
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0


def test_unsupported_metric_is_none_not_zero(fake: FakeNvml) -> None:
    fake.gpus[2].unsupported = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetRetiredPagesPendingStatus"}
    fake.gpus[4].ecc = {}  # ECC off: NVML answers NOT_SUPPORTED for every counter
    fake.gpus[4].unsupported = {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter"}
    fake.gpus[6].nvlink_links = 0  # a PCIe card: no NVLink
    fake.gpus[7].unsupported = {"nvmlDeviceGetCurrentClocksEventReasons"}
    collector = NvmlCollector(fake)
    gpus = by_index(collector.sample("gpu01").gpus)

    assert gpus[2].power_w is None and gpus[2].retired_pages_pending is None
    assert gpus[2].temperature_c == 42 and gpus[2].error is None and not gpus[2].lost
    assert gpus[4].ecc_sbe_volatile is None and gpus[4].ecc_dbe_aggregate is None
    assert gpus[4].remapped_rows_pending is None and gpus[4].remapped_rows_failed is None
    assert gpus[4].pcie_replay_count is None and gpus[4].utilization_pct == 94
    assert gpus[6].nvlink_errors is None
    assert gpus[7].throttle_reasons is None
    assert gpus[0].power_w == 500.0 and gpus[0].ecc_sbe_volatile == 0 and gpus[0].nvlink_errors == 0

    # "Not supported" does not change at run time: it is not asked again.
    asked = fake.calls["nvmlDeviceGetPowerUsage"]
    gpus = by_index(collector.sample("gpu01").gpus)
    assert fake.calls["nvmlDeviceGetPowerUsage"] == asked + 7
    assert gpus[2].power_w is None


def test_unreadable_and_unexpected_errors_keep_the_gpu(fake: FakeNvml) -> None:
    fake.gpus[1].errors = {"nvmlDeviceGetTemperature": pynvml.NVML_ERROR_NO_PERMISSION}
    fake.gpus[3].errors = {"nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_CORRUPTED_INFOROM}
    gpus = by_index(NvmlCollector(fake).sample("gpu01").gpus)
    assert gpus[1].temperature_c is None and gpus[1].error is None and not gpus[1].lost
    assert gpus[3].ecc_sbe_volatile is None and not gpus[3].lost
    assert gpus[3].error is not None and "Corrupted infoROM" in gpus[3].error
    assert gpus[3].utilization_pct == 93


def test_gpu_lost_mid_run_others_still_reported(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake)
    assert not any(g.lost for g in collector.sample("gpu01").gpus)
    fake.lose(5)
    fake.lose(6, pynvml.NVML_ERROR_UNKNOWN)
    gpus = by_index(collector.sample("gpu01").gpus)

    assert len(gpus) == 8
    assert gpus[5].lost and gpus[5].error is not None and "GPU is lost" in gpus[5].error
    assert gpus[6].lost and gpus[6].error is not None and "Unknown Error" in gpus[6].error
    # Identity read at start survives: the PCI bus id ties the lost GPU to kernel Xid lines.
    assert gpus[5].pci_bus_id == fake.gpus[5].pci_bus_id and gpus[5].uuid == fake.gpus[5].uuid
    assert all(getattr(gpus[5], f) is None for f in MEASURED)
    for i in (0, 1, 2, 3, 4, 7):
        assert not gpus[i].lost and gpus[i].utilization_pct == fake.gpus[i].utilization_pct


def test_gpu_lost_at_start_is_reported_and_picked_up_when_it_answers(fake: FakeNvml) -> None:
    fake.lose(2)
    collector = NvmlCollector(fake)
    gpus = by_index(collector.sample("gpu01").gpus)
    assert gpus[2].lost and gpus[2].uuid is None and not gpus[3].lost
    fake.gpus[2].lost_code = None  # e.g. after a GPU reset
    gpus = by_index(collector.sample("gpu01").gpus)
    assert not gpus[2].lost and gpus[2].uuid == fake.gpus[2].uuid
    fake.inject_xid(2, 94)
    gpus = by_index(collector.sample("gpu01").gpus)
    assert gpus[2].xid_events == [94]  # registered for events once it had a handle


def test_xid_event_lands_on_its_gpu_in_the_next_sample(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake)
    assert collector.xid_supported
    fake.inject_xid(6, 79)
    fake.inject_xid(2, 13)
    fake.inject_xid(6, 45)
    gpus = by_index(collector.sample("gpu01").gpus)
    assert gpus[6].xid_events == [79, 45]
    assert gpus[2].xid_events == [13]
    assert all(gpus[i].xid_events == [] for i in (0, 1, 3, 4, 5, 7))
    assert all(g.xid_events == [] for g in collector.sample("gpu01").gpus)


def test_xid_and_lost_together(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake)
    fake.inject_xid(4, 79)
    fake.lose(4)
    g = by_index(collector.sample("gpu01").gpus)[4]
    assert g.lost and g.xid_events == [79]


def test_no_event_support_still_samples() -> None:
    fake = FakeNvml(h100_gpus(8), events_supported=False)
    collector = NvmlCollector(fake)
    fake.inject_xid(1, 79)
    assert not collector.xid_supported
    sample = collector.sample("gpu01")
    assert len(sample.gpus) == 8 and all(g.xid_events == [] for g in sample.gpus)


def test_older_driver_paths() -> None:
    fake = FakeNvml(h100_gpus(8), legacy_clock_reasons=True, field_values_supported=False)
    fake.gpus[1].clock_reasons = pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
    fake.gpus[1].nvlink_errors = {(3, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA): 4}
    collector = NvmlCollector(fake)
    gpus = by_index(collector.sample("gpu01").gpus)
    assert gpus[1].throttle_reasons == ["hw_power_brake"] and gpus[0].throttle_reasons == []
    assert gpus[1].nvlink_errors == 4 and gpus[0].nvlink_errors == 0
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 8
    # 18 links x 4 counters probed once, then read: the per-link fallback.
    before = fake.calls["nvmlDeviceGetNvLinkErrorCounter"]
    collector.sample("gpu01")
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] - before == 8 * 18 * 4


def test_nvml_init_failure_names_the_problem() -> None:
    with pytest.raises(NvmlUnavailable, match=r"^NVML unavailable: NVML Shared Library Not Found .*driver installed"):
        NvmlCollector(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NvmlUnavailable, match="NVML unavailable: Driver Not Loaded"):
        NvmlCollector(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


def test_real_pynvml_samples_or_names_the_problem() -> None:
    """Without a driver (CI) the real library must give the typed error; with one, a real sample."""
    try:
        collector = NvmlCollector()
    except NvmlUnavailable as exc:
        assert str(exc).startswith("NVML unavailable: ")
        return
    try:
        sample = collector.sample("this-node")
        assert sample.gpus and all(g.uuid for g in sample.gpus if not g.lost)
    finally:
        collector.close()


def test_decode_throttle_reasons() -> None:
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x48) == ["hw_slowdown", "hw_thermal"]
    assert decode_throttle_reasons(0x1001) == ["gpu_idle", "unknown_0x1000"]


def test_fake_mirrors_real_pynvml_signatures() -> None:
    fake = FakeNvml()
    names = [n for n in dir(FakeNvml) if n.startswith("nvml")]
    assert len(names) > 20
    for name in names:
        real = inspect.signature(getattr(pynvml, name))
        mine = inspect.signature(getattr(fake, name))
        assert list(mine.parameters) == list(real.parameters), name
    assert fake.NVMLError is pynvml.NVMLError
    assert fake.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST


def test_kernel_xid_pci_bus_id_maps_to_the_nvml_gpu_index() -> None:
    from producers.gpu_nvml import NvmlCollector
    from producers.kernel import nvml_gpu_index, parse_kernel_line
    from tests.fakes.fake_pynvml import FakeNvml, h100_gpus

    index_of = nvml_gpu_index(NvmlCollector(FakeNvml(h100_gpus(8))))
    parsed = parse_kernel_line("NVRM: Xid (PCI:0000:48:00): 79, pid=0, GPU has fallen off the bus.", "gpu02")
    assert parsed is not None and parsed.pci_bus_id is not None
    assert index_of(parsed.pci_bus_id) == 3  # 0x18 + 0x10 * 3 = 0x48
    assert index_of("0000:ff:00") is None
