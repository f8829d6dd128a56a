"""Edge aggregation of a node's GPU samples: fewer `gpu.samples` records, fault evidence at once.

The node producer (producers/gpu_nvml.NvmlProducer) still reads every GPU every interval; an
`EdgeSummary` decides which readings go out. It publishes:

- the first sample;
- a sample `every_s` or more after the last published one (the summary; the first summary comes
  `phase_s` early, so that nodes started together spread theirs over the period);
- at once, a sample whose HEALTH differs from the last published sample's;
- always, a sample that carries Xid events.

The published sample is the LATEST READING, not an average or a max over the suppressed ones:
averaging would invent readings no GPU gave, and every health reading that matters goes out at
once anyway. Simple on purpose.

HEALTH is, per GPU by index, what a GPU-health condition (streams/catalog/gpu_health.yaml, read
by streams/detectors/gpu_health.py) or the detector's per-GPU state reads:

- the set of GPU indexes present: the detector drops the state of a GPU missing from a sample,
  and a GPU that disappears from NVML's list is news;
- `uuid`: a different GPU in the slot starts new counter baselines in the detector;
- `lost`: the gpu_lost flag condition (signature xid_79);
- `error`: a reading that started (or stopped) failing, which also turns a health reading into
  None ("unknown") - the detector treats unknown as neither start nor end, so it must see when
  it begins; the lost reason is quoted in the gpu_lost anomaly;
- `ecc_dbe_volatile`, `ecc_dbe_aggregate`: the ecc_dbe counter condition (threshold 1 since the
  previous reading: any rise is a fault);
- `retired_pages_pending`: the retired_pages_pending flag condition;
- `remapped_rows_pending`, `remapped_rows_failed`: the row_remap_pending and row_remap_failure
  flag conditions;
- `pcie_replay_count`: the pcie_replay_burst counter condition (8 within 60 s);
- `nvlink_errors`: the nvlink_errors counter condition (10 within 60 s). Every change of a
  counter is published, so a windowed rise is measured on the same readings as without
  aggregation, only without the flat ones in between;
- `throttle_reasons`, as a set (NVML's order carries no meaning), less the routine reasons
  (`ROUTINE_THROTTLE_REASONS`: idle, power cap, ...): the hw_slowdown, thermal_throttle and
  power_brake throttle conditions. A streak starts at the sample that
  first shows the reason, published at once, so its measured duration is not cut short.

Xid events (`xid_events`) are not state but events: NVML's event API delivers each Xid once,
riding on the next sample, so a sample with Xids is never suppressed (whatever the last one
was). The sample after it is compared on the state above, not published just because it has
no Xids.

NOT health, sent only with the summary: utilization, memory, temperature, power, clocks and the
SBE (correctable) ECC counters. Correctable errors rise constantly on healthy GPUs, and
gpu_health.yaml has no condition on ecc_sbe_*; temperature matters through the thermal
throttle reasons, which are health.

What the other GPU readers see (streams/detectors/hang.py, straggler.py): one reading per
`every_s` instead of per interval. The hang detector's idle-GPU path sees a GPU go idle up to
`every_s` later (a drop in utilization is not a health change), and it treats readings older
than its `gpu_stale_s` (60 s) as stale. The straggler detector's window holds fewer readings
(it keeps at most one every ~3 s already, so every_s up to 3 costs it nothing), and it compares
nodes within 5 s buckets: an every_s above 5 leaves buckets without a node's reading. The
throttle conditions break a streak on a gap longer than their duration (60 s at the least).
Hence `MAX_EVERY_S`; 5 s or less keeps every detector's view whole.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

from schemas.events import GpuMetrics, GpuSample

#: The longest summary period: half the hang detector's gpu_stale_s and the shortest throttle
#: duration_s (60 s), so one late record does not make the node's GPUs look stale.
MAX_EVERY_S = 30.0

_GpuHealth = tuple[object, ...]
_Health = dict[int, _GpuHealth]


#: Throttle reasons whose coming and going is routine and that no GPU-health condition reads: the
#: GPU idling, application clocks, the power limit (NVML's power_cap; sw_power_cap as the simulator
#: and some exporters name it), sync boost, display clocks. A busy GPU at its power limit flips
#: power_cap several times a minute: were it health, a node of 8 such GPUs would be published
#: nearly every reading and the summary would save little. A change in these alone waits for the
#: summary. tests/unit/test_gpu_edge.py holds this set against streams/catalog/gpu_health.yaml.
ROUTINE_THROTTLE_REASONS = frozenset(
    {"gpu_idle", "clocks_setting", "power_cap", "sw_power_cap", "sync_boost", "display_clocks"}
)

#: The GpuMetrics fields that are health besides the throttle reasons (see the module docstring).
HEALTH_FIELDS = (
    "uuid",
    "lost",
    "error",
    "ecc_dbe_volatile",
    "ecc_dbe_aggregate",
    "retired_pages_pending",
    "remapped_rows_pending",
    "remapped_rows_failed",
    "pcie_replay_count",
    "nvlink_errors",
)
# What a field left out of a JSON object decodes to.
_DEFAULTS = {name: GpuMetrics.model_fields[name].default for name in HEALTH_FIELDS}


def _reasons(reasons: list[str] | None) -> frozenset[str] | None:
    # As a set: NVML's order carries no meaning.
    return None if reasons is None else frozenset(reasons) - ROUTINE_THROTTLE_REASONS


def gpu_health(gpu: GpuMetrics) -> _GpuHealth:
    """The readings of one GPU that are published at once when they change (see the module docstring)."""
    return (*(getattr(gpu, name) for name in HEALTH_FIELDS), _reasons(gpu.throttle_reasons))


def values_health(values: Mapping[str, Any]) -> _GpuHealth:
    """gpu_health of the GpuMetrics that `values` (a GPU's JSON object) decodes to, without decoding
    it: for a publisher that builds payloads as JSON objects (the benchmark's simulator)."""
    return (*(values.get(name, _DEFAULTS[name]) for name in HEALTH_FIELDS), _reasons(values.get("throttle_reasons")))


def sample_health(sample: GpuSample) -> _Health:
    """Health by GPU index; a repeated index counts once, its first reading (as the detector reads it)."""
    health: _Health = {}
    for gpu in sample.gpus:
        health.setdefault(gpu.index, gpu_health(gpu))
    return health


def payload_health(gpus: list[dict[str, Any]]) -> _Health:
    """sample_health of a sample's `gpus` JSON objects."""
    health: _Health = {}
    for gpu in gpus:
        health.setdefault(gpu["index"], values_health(gpu))
    return health


def node_phase(node: str, every_s: float) -> float:
    """A node's place in the summary period, from its name: stable across restarts, and spread
    over the period across a fleet, so that a fleet's summaries do not all arrive in the same second."""
    return (zlib.crc32(node.encode()) % 1000) / 1000 * every_s


class EdgeSummary:
    """Decides, sample by sample, which of a node's GPU samples to publish (module docstring).

    `slack_s` lets a sample up to that much early count as `every_s` after the last one: a fixed-rate
    loop wakes a few milliseconds late or early, and without it a 5 s summary of 1 s samples would
    slip to 6 s whenever the published sample was the late one. The producer passes half its interval.
    """

    def __init__(self, every_s: float, slack_s: float = 0.0, phase_s: float = 0.0) -> None:
        if not (math.isfinite(every_s) and 0 < every_s <= MAX_EVERY_S):
            raise ValueError(f"every_s must be > 0 and <= {MAX_EVERY_S:g} s, got {every_s}")
        if not (math.isfinite(slack_s) and 0 <= slack_s < every_s):
            raise ValueError(f"slack_s must be >= 0 and < every_s ({every_s:g}), got {slack_s}")
        if not (math.isfinite(phase_s) and 0 <= phase_s < every_s):
            raise ValueError(f"phase_s must be >= 0 and < every_s ({every_s:g}), got {phase_s}")
        self.every_s = every_s
        self.slack_s = slack_s
        self.phase_s = phase_s
        # A phase within the slack of a full period would make the next reading a summary for all
        # those nodes at once: it counts as that much before the period's start instead.
        self._offset_s = phase_s if phase_s < every_s - slack_s else phase_s - every_s
        self.published = 0
        self.suppressed = 0
        self._last_at: float | None = None
        self._last_health: _Health | None = None

    def publish(self, sample: GpuSample, now: float) -> bool:
        """True: publish this sample (and it becomes the last published one); False: suppressed.
        `now` is a monotonic clock's reading when the sample was taken."""
        return self.decide(sample_health(sample), any(g.xid_events for g in sample.gpus), now)

    def decide(self, health: _Health, has_xids: bool, now: float) -> bool:
        """publish() for a sample whose health (sample_health or payload_health) is known."""
        last = self._last_at
        first = last is None or self._last_health is None
        if (
            last is None
            or first
            or now - last >= self.every_s - self.slack_s
            or health != self._last_health
            or has_xids
        ):
            # The first sample starts the summaries `phase_s` early: nodes whose producers start
            # together (a rollout, the benchmark's simulator) spread their summaries over the period.
            self._last_at, self._last_health = (now - self._offset_s if first else now), health
            self.published += 1
            return True
        self.suppressed += 1
        return False

    def reset(self) -> None:
        """Forget the last published sample: the next one is published as the first. For a sample
        accepted here that then failed to go out, so that a health change it carried is not lost."""
        self._last_at = None
        self._last_health = None
