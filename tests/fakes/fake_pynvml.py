"""A fake `pynvml` module: the NVML surface trainmedic's GPU producer uses, without a GPU.

It reuses the REAL pynvml's constants, NVMLError class hierarchy and ctypes
structures, so error codes, `except pynvml.NVMLError_GpuIsLost` and the
returned objects (`c_nvmlMemory_t`, `c_nvmlEventData_t`, device handles that are
`c_nvmlDevice_t` pointers) are the ones the real library gives. Functions keep
the real names and parameter names (a unit test checks them against pynvml).

Knobs: per-GPU values (`FakeGpu`), functions a GPU does not support
(`unsupported`), arbitrary error codes per function (`errors`), "GPU lost"
(`lose`), an nvmlInit failure (`init_error`), Xid events queued for
nvmlEventSetWait (`inject_xid`), processes using a GPU (`FakeGpu.processes`, by
NVML's process mode), and older driver/binding behaviour
(`legacy_clock_reasons`, `field_values_supported`).
"""

from __future__ import annotations

import ctypes
import threading
import types
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

NVMLError = _real.NVMLError

_NVLINK_TOTAL_TO_COUNTER = {
    _real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: _real.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    _real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: _real.NVML_NVLINK_ERROR_DL_CRC_DATA,
    _real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: _real.NVML_NVLINK_ERROR_DL_REPLAY,
    _real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: _real.NVML_NVLINK_ERROR_DL_RECOVERY,
}


@dataclass
class FakeGpu:
    """One GPU's state, in NVML's own units (milliwatts, bytes, MHz)."""

    uuid: str
    pci_bus_id: str
    utilization_pct: int = 0
    memory_used: int = 0
    memory_total: int = 80 * 1024**3
    temperature_c: int = 30
    power_mw: int = 70_000
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    clock_reasons: int = 0
    # (memory error type, counter type) -> count, e.g. (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC)
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    retired_pages_pending: int = 0
    # (correctable rows, uncorrectable rows, pending, failure) as nvmlDeviceGetRemappedRows answers
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replay: int = 0
    nvlink_links: int = 18
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    unsupported: set[str] = field(default_factory=set)  # function names answering NOT_SUPPORTED
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code it raises
    lost_code: int | None = None  # set: every call for this GPU raises this code
    # Processes using the GPU, by NVML_PROCESS_MODE_COMPUTE / _GRAPHICS / _MPS: (pid, used bytes).
    processes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


def h100_gpus(count: int = 8) -> list[FakeGpu]:
    """`count` healthy, distinguishable GPUs (values depend on the index)."""
    return [
        FakeGpu(
            uuid=f"GPU-{i:08x}-1111-2222-3333-{i:012x}",
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            utilization_pct=90 + i % 10,
            memory_used=(40 + i) * 1024**3,
            memory_total=81559 * 1024**2,
            temperature_c=40 + i,
            power_mw=500_000 + 1000 * i,
            sm_clock_mhz=1980 - i,
            mem_clock_mhz=2619,
            ecc={
                (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_VOLATILE_ECC): i,
                (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_VOLATILE_ECC): 0,
                (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_AGGREGATE_ECC): 10 * i,
                (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_AGGREGATE_ECC): 0,
            },
            pcie_replay=i,
        )
        for i in range(count)
    ]


class FakeNvml(types.ModuleType):
    """Drop-in for the `pynvml` module object. Thread-safe: tests change it while a producer runs."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        init_error: int | None = None,
        events_supported: bool = True,
        legacy_clock_reasons: bool = False,
        field_values_supported: bool = True,
    ) -> None:
        super().__init__("pynvml")
        for name in dir(_real):
            # Constants, NVMLError and its per-code subclasses, event/clock-reason masks, ctypes structures.
            if name.startswith(("NVML", "nvmlEventType", "nvmlClocks", "c_nvml", "struct_c_nvml", "nvmlPciInfo")):
                setattr(self, name, getattr(_real, name))
        self.gpus = gpus if gpus is not None else h100_gpus()
        self.init_error = init_error
        self.events_supported = events_supported
        self.legacy_clock_reasons = legacy_clock_reasons
        self.field_values_supported = field_values_supported
        self.calls: Counter[str] = Counter()
        self.initialized = 0
        self._lock = threading.RLock()
        self._structs = [_real.struct_c_nvmlDevice_t() for _ in self.gpus]
        self._handles = [ctypes.pointer(s) for s in self._structs]
        self._index_of = {ctypes.addressof(s): i for i, s in enumerate(self._structs)}
        self._pending_xids: deque[tuple[int, int]] = deque()
        self._registered: dict[int, int] = {}  # gpu index -> event type mask
        self._event_sets: list[Any] = []

    # --- test controls ----------------------------------------------------------------

    def lose(self, index: int, code: int = _real.NVML_ERROR_GPU_IS_LOST) -> None:
        with self._lock:
            self.gpus[index].lost_code = code

    def inject_xid(self, index: int, xid: int) -> None:
        """Queue a Xid critical error event, delivered if that GPU registered for it."""
        with self._lock:
            self._pending_xids.append((index, xid))

    # --- helpers ------------------------------------------------------------------------

    def _enter(self, fn: str) -> None:
        self.calls[fn] += 1
        if not self.initialized:
            raise NVMLError(_real.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any, fn: str) -> tuple[int, FakeGpu]:
        self._enter(fn)
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT) from None
        index = self._index_of.get(address or 0)
        if index is None:
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost_code is not None:
            raise NVMLError(gpu.lost_code)
        if fn in gpu.unsupported:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.errors:
            raise NVMLError(gpu.errors[fn])
        return index, gpu

    # --- library ------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._lock:
            self.calls["nvmlInit"] += 1
            if self.init_error is not None:
                raise NVMLError(self.init_error)
            self.initialized += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._enter("nvmlShutdown")
            self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._enter("nvmlDeviceGetCount")
            return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._lock:
            self._enter("nvmlDeviceGetHandleByIndex")
            if not 0 <= index < len(self.gpus):
                raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            if self.gpus[index].lost_code is not None:
                raise NVMLError(self.gpus[index].lost_code)
            # A new pointer object each call, to the same device, as the real binding returns.
            return ctypes.cast(self._handles[index], _real.c_nvmlDevice_t)

    # --- device readings ------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._lock:
            return self._gpu(handle, "nvmlDeviceGetUUID")[1].uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")[1]
            info = _real.nvmlPciInfo_t()
            info.busId = gpu.pci_bus_id.encode()
            return info

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")[1]
            return _real.c_nvmlUtilization_t(gpu=gpu.utilization_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")[1]
            return _real.c_nvmlMemory_t(
                total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used, used=gpu.memory_used
            )

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetTemperature")[1]
            if sensor != _real.NVML_TEMPERATURE_GPU:
                raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle, "nvmlDeviceGetPowerUsage")[1].power_mw

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")[1]
            if type == _real.NVML_CLOCK_SM:
                return gpu.sm_clock_mhz
            if type == _real.NVML_CLOCK_MEM:
                return gpu.mem_clock_mhz
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        with self._lock:
            if self.legacy_clock_reasons:
                # What the real binding raises when the driver lacks the symbol (before R535).
                self._enter("nvmlDeviceGetCurrentClocksEventReasons")
                raise NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
            return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")[1].clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")[1].clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")[1]
            if (errorType, counterType) not in gpu.ecc:
                raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            return gpu.ecc[(errorType, counterType)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        with self._lock:
            return self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")[1].retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        with self._lock:
            return self._gpu(device, "nvmlDeviceGetRemappedRows")[1].remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")[1].pcie_replay

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[int]) -> Any:
        with self._lock:
            if not self.field_values_supported:
                self._enter("nvmlDeviceGetFieldValues")
                raise NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
            gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")[1]
            values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
            for fv, field_id in zip(values, fieldIds, strict=True):
                fv.fieldId = field_id
                counter = _NVLINK_TOTAL_TO_COUNTER.get(field_id)
                if counter is None or gpu.nvlink_links == 0:
                    fv.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
                    continue
                fv.nvmlReturn = _real.NVML_SUCCESS
                fv.valueType = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                fv.value.ullVal = sum(n for (_link, c), n in gpu.nvlink_errors.items() if c == counter)
            return values

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        with self._lock:
            gpu = self._gpu(device, "nvmlDeviceGetNvLinkState")[1]
            if gpu.nvlink_links == 0:
                raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            if not 0 <= link < gpu.nvlink_links:
                raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        with self._lock:
            gpu = self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter")[1]
            if not 0 <= link < gpu.nvlink_links:
                raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            return gpu.nvlink_errors.get((link, counter), 0)

    def _processes(self, handle: Any, fn: str, mode: int) -> list[Any]:
        with self._lock:
            gpu = self._gpu(handle, fn)[1]
            # The objects the real binding returns: its process struct as a friendly object.
            return [
                _real.nvmlStructToFriendlyObject(
                    _real.c_nvmlProcessInfo_t(
                        pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
                    )
                )
                for pid, used in gpu.processes.get(mode, [])
            ]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetComputeRunningProcesses", _real.NVML_PROCESS_MODE_COMPUTE)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetGraphicsRunningProcesses", _real.NVML_PROCESS_MODE_GRAPHICS)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetMPSComputeRunningProcesses", _real.NVML_PROCESS_MODE_MPS)

    # --- events ---------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        with self._lock:
            self._enter("nvmlEventSetCreate")
            if not self.events_supported:
                raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            event_set = ctypes.pointer(_real.struct_c_nvmlEventSet_t())
            self._event_sets.append(event_set)
            return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._lock:
            index, _gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
            self._registered[index] = self._registered.get(index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        # Does not sleep for `timeoutms`: an empty queue answers TIMEOUT at once.
        with self._lock:
            self._enter("nvmlEventSetWait")
            while self._pending_xids:
                index, xid = self._pending_xids.popleft()
                if not self._registered.get(index, 0) & _real.nvmlEventTypeXidCriticalError:
                    continue  # NVML only reports events a device was registered for
                data = _real.c_nvmlEventData_t()
                data.device = ctypes.cast(self._handles[index], _real.c_nvmlDevice_t)
                data.eventType = _real.nvmlEventTypeXidCriticalError
                data.eventData = xid
                return data
            raise NVMLError(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._lock:
            self._enter("nvmlEventSetFree")
