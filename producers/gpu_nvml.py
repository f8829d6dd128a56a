"""GPU metrics through NVML (the `pynvml` module of nvidia-ml-py) -> gpu.samples.

One GpuSample per node per interval carries every GPU. Each metric is read on
its own so that one unsupported or failing reading costs only its own field:
"not supported" becomes None (never 0), and an error that means the GPU is gone
(GPU_IS_LOST, UNKNOWN, ...) marks that GPU `lost` while the others are still
reported. Xid errors come from NVML's event API and ride on the next sample.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pynvml

from bus.publish import Publisher
from producers.metrics import POLL_FAILURES, ProducerHealth
from schemas.errors import Unavailable
from schemas.events import GpuMetrics, GpuSample
from schemas.ids import check_node_name, stable_id
from schemas.topics import GPU_SAMPLES

log = logging.getLogger("trainmedic.gpu.nvml")

# Clock event ("throttle") reason bits, identical for nvmlClocksEventReason* and the older
# nvmlClocksThrottleReason*. Named as dcgm-exporter names them (its clock_event label), so
# samples from NVML and from DCGM read alike.
THROTTLE_REASON_NAMES: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "clocks_setting",
    0x004: "power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal",
    0x040: "hw_thermal",
    0x080: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the set bits, lowest first; a bit this table does not know stays visible as hex."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(THROTTLE_REASON_NAMES.get(bit, f"unknown_0x{bit:x}"))
        bit <<= 1
    return names


class NvmlUnavailable(Unavailable, RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission...)."""


# What an NVMLError code means for one reading.
_LOST_CODES = frozenset(
    {
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNKNOWN,
        pynvml.NVML_ERROR_RESET_REQUIRED,
        pynvml.NVML_ERROR_GPU_NOT_FOUND,
        pynvml.NVML_ERROR_IRQ_ISSUE,
    }
)
# Capabilities do not change while the process runs: stop asking after the first "no".
_NEVER_SUPPORTED_CODES = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
# Not readable right now, but nothing is wrong with the GPU.
_UNREADABLE_CODES = frozenset(
    {
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
        pynvml.NVML_ERROR_NOT_READY,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
    }
)

_INIT_HINTS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found: is the NVIDIA driver installed on this machine?",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA device files (/dev/nvidia*)",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "NVML library and kernel driver versions differ (driver upgraded without a reboot?)",
}

_NVLINK_TOTAL_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
)
_NVLINK_LINK_COUNTERS = (
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
)
_FIELD_VALUE_ATTR = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
MAX_XIDS_PER_SAMPLE = 1000


class _GpuLost(Unavailable):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> int:
    """Identity of an NVML device handle: its address, because the handle in an event
    record is a new ctypes object pointing at the same device."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (ctypes.ArgumentError, TypeError):
        return id(handle)


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    never_supported: set[str] = field(default_factory=set)
    throttle_fn: str | None = None
    # (link, counter) pairs for the per-link NVLink fallback; None until probed.
    nvlink_pairs: list[tuple[int, int]] | None = None
    xid_registered: bool = False


# pynvml's surface is untyped (no stubs) and tests inject a fake module: it is Any on purpose.
NvmlModule = Any
Reader = Callable[["NvmlCollector", _Gpu], dict[str, Any]]


class NvmlCollector:
    """Reads every GPU of this node through NVML. Handles are looked up once, at init."""

    def __init__(self, nvml_module: NvmlModule = pynvml, xid_wait_ms: int = 1) -> None:
        self.nv = nvml_module
        self.xid_wait_ms = xid_wait_ms
        self.xid_supported = False
        self.unmatched_xids = 0
        self._event_set: Any = None
        self._closed = False
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as exc:
            hint = _INIT_HINTS.get(exc.value)
            raise NvmlUnavailable(f"NVML unavailable: {exc}" + (f" ({hint})" if hint else "")) from exc
        except OSError as exc:
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from exc
        try:
            count = int(self.nv.nvmlDeviceGetCount())
        except self.nv.NVMLError as exc:
            self.nv.nvmlShutdown()
            raise NvmlUnavailable(f"NVML unavailable: cannot count GPUs: {exc}") from exc
        self._readers = self._reader_table()
        self.gpus = [_Gpu(index=i) for i in range(count)]
        for gpu in self.gpus:
            self._attach(gpu)
        self._open_events()
        self._by_handle = {_handle_key(g.handle): g for g in self.gpus if g.handle is not None}

    # --- setup ------------------------------------------------------------------------

    def _attach(self, gpu: _Gpu) -> None:
        """Handle and identity of one GPU; a GPU lost at start stays without a handle until it answers."""
        try:
            gpu.handle = self.nv.nvmlDeviceGetHandleByIndex(gpu.index)
        except self.nv.NVMLError as exc:
            log.warning("GPU %d: no NVML handle: %s", gpu.index, exc)
            return
        for attr, read in (
            ("uuid", lambda h: _text(self.nv.nvmlDeviceGetUUID(h))),
            ("pci_bus_id", lambda h: _text(self.nv.nvmlDeviceGetPciInfo(h).busId)),
        ):
            try:
                setattr(gpu, attr, read(gpu.handle))
            except self.nv.NVMLError as exc:
                log.warning("GPU %d: cannot read %s: %s", gpu.index, attr, exc)

    def _open_events(self) -> None:
        try:
            self._event_set = self.nv.nvmlEventSetCreate()
        except self.nv.NVMLError as exc:
            log.warning("NVML events unavailable (%s): Xid errors will not be reported by the NVML producer", exc)
            return
        for gpu in self.gpus:
            self._register_xid(gpu)
        self.xid_supported = any(g.xid_registered for g in self.gpus)

    def _register_xid(self, gpu: _Gpu) -> None:
        if self._event_set is None or gpu.handle is None or gpu.xid_registered:
            return
        try:
            self.nv.nvmlDeviceRegisterEvents(gpu.handle, self.nv.nvmlEventTypeXidCriticalError, self._event_set)
            gpu.xid_registered = True
        except self.nv.NVMLError as exc:
            log.warning("GPU %d: Xid events not available: %s", gpu.index, exc)

    # --- readers: each returns GpuMetrics fields ------------------------------------

    def _utilization(self, gpu: _Gpu) -> dict[str, Any]:
        return {"utilization_pct": float(self.nv.nvmlDeviceGetUtilizationRates(gpu.handle).gpu)}

    def _memory(self, gpu: _Gpu) -> dict[str, Any]:
        mem = self.nv.nvmlDeviceGetMemoryInfo(gpu.handle)
        return {"memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total)}

    def _temperature(self, gpu: _Gpu) -> dict[str, Any]:
        return {"temperature_c": float(self.nv.nvmlDeviceGetTemperature(gpu.handle, self.nv.NVML_TEMPERATURE_GPU))}

    def _power(self, gpu: _Gpu) -> dict[str, Any]:
        return {"power_w": self.nv.nvmlDeviceGetPowerUsage(gpu.handle) / 1000.0}  # NVML answers milliwatts

    def _sm_clock(self, gpu: _Gpu) -> dict[str, Any]:
        return {"sm_clock_mhz": float(self.nv.nvmlDeviceGetClockInfo(gpu.handle, self.nv.NVML_CLOCK_SM))}

    def _mem_clock(self, gpu: _Gpu) -> dict[str, Any]:
        return {"mem_clock_mhz": float(self.nv.nvmlDeviceGetClockInfo(gpu.handle, self.nv.NVML_CLOCK_MEM))}

    def _throttle(self, gpu: _Gpu) -> dict[str, Any]:
        if gpu.throttle_fn is None:
            # The EventReasons name arrived with driver 535; older drivers and bindings only have ThrottleReasons.
            for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
                fn = getattr(self.nv, name, None)
                if fn is None:
                    continue
                try:
                    mask = int(fn(gpu.handle))
                except self.nv.NVMLError as exc:
                    if exc.value == self.nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                        continue
                    raise
                gpu.throttle_fn = name
                return {"throttle_reasons": decode_throttle_reasons(mask)}
            raise self.nv.NVMLError(self.nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        return {"throttle_reasons": decode_throttle_reasons(int(getattr(self.nv, gpu.throttle_fn)(gpu.handle)))}

    def _ecc(self, error_type: int, counter_type: int, name: str) -> Reader:
        def read(self: NvmlCollector, gpu: _Gpu) -> dict[str, Any]:
            return {name: int(self.nv.nvmlDeviceGetTotalEccErrors(gpu.handle, error_type, counter_type))}

        return read

    def _retired_pages(self, gpu: _Gpu) -> dict[str, Any]:
        return {"retired_pages_pending": bool(self.nv.nvmlDeviceGetRetiredPagesPendingStatus(gpu.handle))}

    def _remapped_rows(self, gpu: _Gpu) -> dict[str, Any]:
        _corr, _unc, pending, failed = self.nv.nvmlDeviceGetRemappedRows(gpu.handle)
        return {"remapped_rows_pending": bool(pending), "remapped_rows_failed": bool(failed)}

    def _pcie_replay(self, gpu: _Gpu) -> dict[str, Any]:
        return {"pcie_replay_count": int(self.nv.nvmlDeviceGetPcieReplayCounter(gpu.handle))}

    def _nvlink(self, gpu: _Gpu) -> dict[str, Any]:
        # One field-values call gets the driver's all-link totals; per-link counters
        # (links x counters calls) are the fallback for drivers without it.
        if "nvlink_fields" not in gpu.never_supported:
            try:
                values = self.nv.nvmlDeviceGetFieldValues(gpu.handle, list(_NVLINK_TOTAL_FIELDS))
            except self.nv.NVMLError as exc:
                if exc.value not in _NEVER_SUPPORTED_CODES:
                    raise
                gpu.never_supported.add("nvlink_fields")
            else:
                return {"nvlink_errors": self._sum_field_values(values)}
        return {"nvlink_errors": self._sum_link_counters(gpu)}

    def _sum_field_values(self, values: Any) -> int | None:
        total: int | None = None
        for fv in values:
            ret = int(fv.nvmlReturn)
            if ret == self.nv.NVML_SUCCESS:
                total = (total or 0) + int(getattr(fv.value, _FIELD_VALUE_ATTR.get(int(fv.valueType), "ullVal")))
            elif ret in _LOST_CODES:
                raise self.nv.NVMLError(ret)
        return total

    def _sum_link_counters(self, gpu: _Gpu) -> int | None:
        if gpu.nvlink_pairs is None:
            pairs = []
            for link in range(int(self.nv.NVML_NVLINK_MAX_LINKS)):
                try:
                    self.nv.nvmlDeviceGetNvLinkState(gpu.handle, link)
                except self.nv.NVMLError as exc:
                    if exc.value in _LOST_CODES:
                        raise
                    continue
                for counter in _NVLINK_LINK_COUNTERS:
                    try:
                        self.nv.nvmlDeviceGetNvLinkErrorCounter(gpu.handle, link, counter)
                    except self.nv.NVMLError as exc:
                        if exc.value in _LOST_CODES:
                            raise
                        continue
                    pairs.append((link, counter))
            gpu.nvlink_pairs = pairs
        if not gpu.nvlink_pairs:
            raise self.nv.NVMLError(self.nv.NVML_ERROR_NOT_SUPPORTED)
        return sum(int(self.nv.nvmlDeviceGetNvLinkErrorCounter(gpu.handle, ln, c)) for ln, c in gpu.nvlink_pairs)

    def _reader_table(self) -> tuple[tuple[str, Reader], ...]:
        nv = self.nv
        corrected, uncorrected = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return (
            ("utilization", NvmlCollector._utilization),
            ("memory", NvmlCollector._memory),
            ("temperature", NvmlCollector._temperature),
            ("power", NvmlCollector._power),
            ("sm_clock", NvmlCollector._sm_clock),
            ("mem_clock", NvmlCollector._mem_clock),
            ("throttle_reasons", NvmlCollector._throttle),
            ("ecc_sbe_volatile", self._ecc(corrected, nv.NVML_VOLATILE_ECC, "ecc_sbe_volatile")),
            ("ecc_dbe_volatile", self._ecc(uncorrected, nv.NVML_VOLATILE_ECC, "ecc_dbe_volatile")),
            ("ecc_sbe_aggregate", self._ecc(corrected, nv.NVML_AGGREGATE_ECC, "ecc_sbe_aggregate")),
            ("ecc_dbe_aggregate", self._ecc(uncorrected, nv.NVML_AGGREGATE_ECC, "ecc_dbe_aggregate")),
            ("retired_pages", NvmlCollector._retired_pages),
            ("remapped_rows", NvmlCollector._remapped_rows),
            ("pcie_replay", NvmlCollector._pcie_replay),
            ("nvlink", NvmlCollector._nvlink),
        )

    # --- sampling -------------------------------------------------------------------

    def read_gpu(self, gpu: _Gpu, xids: list[int]) -> GpuMetrics:
        if gpu.handle is None:
            self._attach(gpu)
            if gpu.handle is None:
                return GpuMetrics(
                    index=gpu.index, lost=True, error="no NVML handle (GPU lost at start)", xid_events=xids
                )
            self._by_handle[_handle_key(gpu.handle)] = gpu
            self._register_xid(gpu)
            self.xid_supported = self.xid_supported or gpu.xid_registered
        values: dict[str, Any] = {}
        problems: list[str] = []
        lost: str | None = None
        for name, read in self._readers:
            if name in gpu.never_supported:
                continue
            try:
                values.update(read(self, gpu))
            except self.nv.NVMLError as exc:
                code = exc.value
                if code in _LOST_CODES:
                    # The rest would fail the same way; one error per lost GPU per sample is enough.
                    lost = f"{exc} (reading {name})"
                    break
                if code in _NEVER_SUPPORTED_CODES:
                    gpu.never_supported.add(name)
                elif code not in _UNREADABLE_CODES:
                    problems.append(f"{name}: {exc}")
        return GpuMetrics(
            index=gpu.index,
            uuid=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            lost=lost is not None,
            error=lost if lost is not None else ("; ".join(problems) or None),
            xid_events=xids,
            **values,
        )

    def drain_xids(self) -> dict[int, list[int]]:
        """Xid codes NVML queued since the last call, by GPU index."""
        found: dict[int, list[int]] = {}
        if self._event_set is None or not self.xid_supported:
            return found
        for _ in range(MAX_XIDS_PER_SAMPLE):
            try:
                data = self.nv.nvmlEventSetWait(self._event_set, self.xid_wait_ms)
            except self.nv.NVMLError as exc:
                if exc.value != self.nv.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", exc)
                break
            if not int(data.eventType) & self.nv.nvmlEventTypeXidCriticalError:
                continue
            gpu = self._by_handle.get(_handle_key(data.device))
            if gpu is None:
                self.unmatched_xids += 1
                log.warning("Xid %d from a device this collector does not know", int(data.eventData))
                continue
            found.setdefault(gpu.index, []).append(int(data.eventData))
        return found

    def sample(self, node: str) -> GpuSample:
        if self._closed:
            raise RuntimeError("NvmlCollector is closed")
        ts = time.time()
        xids = self.drain_xids()
        gpus = [self.read_gpu(g, xids.get(g.index, [])) for g in self.gpus]
        return GpuSample(
            event_id=stable_id("gpu", node, "nvml", f"{ts:.6f}"),
            event_time=ts,
            node=node,
            gpus=gpus,
            collector="nvml",
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            try:
                self.nv.nvmlEventSetFree(self._event_set)
            except self.nv.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)


class NvmlProducer:
    """Publishes this node's GpuSamples; never stops on a GPU or Kafka error.

    summary_every_s None: one sample published per interval. Set (>= interval_s): still one
    reading per interval, but published only as producers.gpu_edge.EdgeSummary decides - the
    latest reading every summary_every_s, and at once any reading whose GPU health changed or
    that carries Xids. `samples` counts published samples, `suppressed` the readings held back.
    """

    def __init__(
        self,
        publisher: Publisher,
        node: str | None = None,
        interval_s: float = 1.0,
        collector: NvmlCollector | None = None,
        summary_every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if summary_every_s is not None and not summary_every_s >= interval_s:
            raise ValueError(
                f"summary_every_s ({summary_every_s:g} s) must be >= interval_s ({interval_s:g} s): "
                "a summary cannot come more often than the samples it is made of"
            )
        from producers.gpu_edge import EdgeSummary, node_phase

        self.node = check_node_name(node or socket.gethostname(), "node name of the GPU producer")
        # After the checks above, so that a bad value leaves no NVML handle open.
        self.summary = (
            EdgeSummary(summary_every_s, slack_s=interval_s / 2, phase_s=node_phase(self.node, summary_every_s))
            if summary_every_s is not None
            else None
        )
        self.publisher = publisher
        self.interval_s = interval_s
        self.summary_every_s = summary_every_s
        self.clock = clock
        self._owns_collector = collector is None
        self.collector = collector if collector is not None else NvmlCollector()
        self.samples = 0  # published
        self.suppressed = 0  # read but held back by the edge summary
        self.errors = 0  # intervals whose reading failed or was not published
        self.lost_gpu_readings = 0  # GPU readings marked lost, summed over published samples
        self.last_error: str | None = None

    def poll_once(self) -> GpuSample | None:
        """Read every GPU and publish the sample unless the edge summary holds it back; the
        sample read (published or not: `samples` and `suppressed` tell), None when it failed."""
        accepted = False
        try:
            sample = self.collector.sample(self.node)
            if self.summary is not None and not self.summary.publish(sample, self.clock()):
                self.suppressed += 1
                return sample
            accepted = True
            self.publisher.publish(GPU_SAMPLES, sample)
        except Exception as exc:  # a producer that dies on one bad interval sees nothing afterwards
            if accepted and self.summary is not None:
                self.summary.reset()  # it did not go out: the next reading is published in its place
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            POLL_FAILURES.labels("gpu", "sample").inc()
            log.exception("GPU sample on %s failed", self.node)
            return None
        self.samples += 1
        self.lost_gpu_readings += sum(1 for g in sample.gpus if g.lost)
        return sample

    def run(self, stop_event: threading.Event) -> None:
        """Sample at a fixed rate until stop_event is set; a slow interval skips ahead, it does not bunch up."""
        next_at = time.monotonic()
        # Ready once NVML is open (it is, or the collector would not exist) and a sample was read.
        liveness = ProducerHealth("gpu", self.interval_s)
        try:
            while not stop_event.is_set():
                published = self.samples
                if self.poll_once() is None:
                    liveness.failed(f"GPU sample failed: {self.last_error}")
                else:
                    liveness.ok(self.samples - published, "NVML open, sampling")
                next_at += self.interval_s
                now = time.monotonic()
                if next_at < now:
                    next_at = now
                stop_event.wait(next_at - now)
        finally:
            liveness.stop()
            self.publisher.flush(5.0)

    def close(self) -> None:
        if self._owns_collector:
            self.collector.close()

    def __enter__(self) -> NvmlProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
