"""Simulated GPU telemetry: one record per node per interval with all 8 GPUs.

Values model an 8x H100 SXM node (80 GiB, 700 W, 1980 MHz max SM clock) as
producers.gpu_nvml and gpu_dcgm report it. Each node draws its noise from its
own random stream, so a node's samples depend on the seed and the node only.

`sample_payload` builds the JSON object of a GpuSample directly (the fields of
`GpuSample.model_dump(mode="json")` that are set, defaults left out), which
costs a fraction of building the pydantic model; `sample_event` builds the model
from the same values. Both decode to the same event (tests/e2e/test_bench_smoke.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.events import SCHEMA_VERSION, GpuMetrics, GpuSample
from schemas.ids import stable_id

GPUS_PER_NODE = 8
# PCI bus ids of the 8 GPUs as the kernel prints them in Xid lines ("PCI:0000:07:00").
# 0000:07:00 and 0000:10:00 are the bus ids of the Xid lines in tests/fixtures/logs.
GPU_PCI = (
    "0000:07:00",
    "0000:0a:00",
    "0000:10:00",
    "0000:18:00",
    "0000:41:00",
    "0000:47:00",
    "0000:4d:00",
    "0000:53:00",
)
MEM_TOTAL = 85_520_809_984  # 79.6 GiB as NVML reports an H100 80GB
SM_MAX_MHZ = 1980.0
MEM_MHZ = 2619.0

Load = Literal["busy", "idle", "checkpoint"]


def gpu_index_of(pci: str | None) -> int | None:
    if not pci:
        return None
    short = pci[:10].lower()
    for i, p in enumerate(GPU_PCI):
        if p == short:
            return i
    return None


@dataclass
class NodeGpus:
    """What is true of one node's GPUs now; faults change it."""

    node: str
    rng: random.Random
    load: Load = "idle"
    throttled: bool = False  # thermal slowdown (straggler)
    lost: set[int] = field(default_factory=set)  # fallen off the bus
    dbe: dict[int, int] = field(default_factory=dict)  # volatile double-bit ECC count per GPU
    remap_failed: set[int] = field(default_factory=set)
    nvlink_errors: dict[int, int] = field(default_factory=dict)
    responding: bool = True  # False: the node is gone, its producer sends nothing
    seq: int = 0
    # Each GPU's UUID, a hash of the node and index: made once, not at every reading (hashing
    # 8 per node per second was 6 % of the simulator at 3,072 nodes).
    uuids: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.uuids = tuple(f"GPU-{stable_id('uuid', self.node, i)[4:12]}-sim" for i in range(GPUS_PER_NODE))

    def gpu_values(self) -> list[dict[str, Any]]:
        """One dict per GPU with GpuMetrics field names (only fields that are set)."""
        r = self.rng.random
        out: list[dict[str, Any]] = []
        for i in range(GPUS_PER_NODE):
            if i in self.lost:
                out.append({"index": i, "pci_bus_id": GPU_PCI[i] + ".0", "lost": True, "error": "GPU is lost"})
                continue
            if self.load == "busy":
                util = 97.0 + 3.0 * r()
                power = 610.0 + 80.0 * r()
                temp = 58.0 + 12.0 * r()
                sm = SM_MAX_MHZ - (15.0 * r() if r() < 0.2 else 0.0)
                mem_used = 71_000_000_000 + int(4_000_000_000 * r())
            elif self.load == "checkpoint":
                util = 5.0 + 20.0 * r()
                power = 180.0 + 60.0 * r()
                temp = 45.0 + 8.0 * r()
                sm = SM_MAX_MHZ
                mem_used = 71_000_000_000 + int(4_000_000_000 * r())
            else:
                util = 0.0
                power = 68.0 + 10.0 * r()
                temp = 31.0 + 5.0 * r()
                sm = 345.0
                mem_used = 520_000_000
            reasons: list[str] = []
            if self.throttled and self.load != "idle":
                # HW thermal slowdown: clocks pulled down hard, power follows.
                sm = 1290.0 + 120.0 * r()
                power = 380.0 + 70.0 * r()
                temp = 87.0 + 5.0 * r()
                reasons = ["hw_thermal"]
            elif self.load == "busy" and r() < 0.05:
                reasons = ["sw_power_cap"]  # harmless: the power limit briefly reached
            out.append(
                {
                    "index": i,
                    "uuid": self.uuids[i],
                    "pci_bus_id": GPU_PCI[i] + ".0",
                    "utilization_pct": round(util, 1),
                    "memory_used_bytes": mem_used,
                    "memory_total_bytes": MEM_TOTAL,
                    "temperature_c": round(temp, 1),
                    "power_w": round(power, 1),
                    "sm_clock_mhz": round(sm, 0),
                    "mem_clock_mhz": MEM_MHZ,
                    "throttle_reasons": reasons,
                    "ecc_sbe_volatile": 0,
                    "ecc_dbe_volatile": self.dbe.get(i, 0),
                    "remapped_rows_pending": False,
                    "remapped_rows_failed": i in self.remap_failed,
                    "pcie_replay_count": 0,
                    "nvlink_errors": self.nvlink_errors.get(i, 0),
                }
            )
        return out

    def next_id(self, event_time: float) -> str:
        self.seq += 1
        return stable_id("gpu", self.node, self.seq, round(event_time, 3))


def sample_payload(node: NodeGpus, event_time: float, produced_at: float) -> dict[str, Any]:
    """The JSON object of a GpuSample (what schemas.codec.encode would produce, minus defaults)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "event_id": node.next_id(event_time),
        "event_time": event_time,
        "produced_at": produced_at,
        "node": node.node,
        "gpus": node.gpu_values(),
        "collector": "sim",
    }


def sample_event(node: NodeGpus, event_time: float, produced_at: float) -> GpuSample:
    """The same sample as a validated pydantic event (the slower, checked path)."""
    return GpuSample(
        event_id=node.next_id(event_time),
        event_time=event_time,
        produced_at=produced_at,
        node=node.node,
        gpus=[GpuMetrics(**g) for g in node.gpu_values()],
        collector="sim",
    )
