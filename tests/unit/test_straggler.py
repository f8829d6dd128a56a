"""Straggler detector with simulated clocks: every `now` is passed explicitly, nothing sleeps."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.events import Anomaly, GpuMetrics, GpuSample, ProgressBatch, ProgressSample, SchedEvent
from streams.detectors.straggler import StragglerDetector, _group_medians, _peer_medians, slowdown_reason
from streams.ranks import rank_ranges

T0 = 1_700_000_000.0
NODES4 = ("gpu01", "gpu02", "gpu03", "gpu04")
RANKS_PER_NODE = 4
GPUS_PER_NODE = 8

# (node, gpu index, time) -> (SM clock MHz, power W, utilization %, throttle reasons)
GpuFn = Callable[[str, int, float], tuple[float, float, float, list[str]]]
# (node, rank, time) -> step time in seconds
StepFn = Callable[[str, int, float], float]


def healthy_gpu(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
    return 1980.0 + (idx % 3), 650.0 + idx, 98.0, []


def healthy_step(node: str, rank: int, t: float) -> float:
    return 2.0 + 0.01 * (rank % 3)


def drive(
    det: StragglerDetector,
    nodes: tuple[str, ...],
    start: float,
    stop: float,
    gpu_fn: GpuFn = healthy_gpu,
    step_fn: StepFn = healthy_step,
    every: float = 10.0,
    check: bool = True,
) -> list[Anomaly]:
    """Feed a GPU sample per node and a progress batch per node every `every` s; collect anomalies."""
    found: list[Anomaly] = []
    t = start
    while t <= stop:
        for n_i, node in enumerate(nodes):
            gpus = []
            for idx in range(GPUS_PER_NODE):
                clock, power, util, reasons = gpu_fn(node, idx, t)
                gpus.append(
                    GpuMetrics(
                        index=idx, sm_clock_mhz=clock, power_w=power, utilization_pct=util, throttle_reasons=reasons
                    )
                )
            det.observe_gpu(GpuSample(event_id=f"g-{node}-{t}", event_time=t, node=node, gpus=gpus), t)
            samples = [
                ProgressSample(
                    ts=t, rank=r, node=node, step=int(t), step_time_s=step_fn(node, r, t), format="torchtitan"
                )
                for r in range(n_i * RANKS_PER_NODE, (n_i + 1) * RANKS_PER_NODE)
            ]
            det.observe_progress(
                ProgressBatch(
                    event_id=f"p-{node}-{t}", event_time=t, job_id="1001", job_nodes=list(nodes), samples=samples
                ),
                t,
            )
        if check:
            found += det.check(t)
        t += every
    return found


def running(det: StragglerDetector, nodes: tuple[str, ...], at: float = T0) -> None:
    det.observe_sched(
        SchedEvent(event_id="s", event_time=at, kind="job", job_id="1001", state="RUNNING", nodes=list(nodes)), at
    )


def thermal_gpu5_on_gpu02(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
    if node == "gpu02" and idx == 5:
        return 1125.0, 420.0, 99.0, ["hw_slowdown", "hw_thermal"]
    return healthy_gpu(node, idx, t)


def slow_ranks_on_gpu02(node: str, rank: int, t: float) -> float:
    return 2.76 if node == "gpu02" else healthy_step(node, rank, t)


def test_one_thermal_straggler_among_four_nodes() -> None:
    det = StragglerDetector()
    running(det, NODES4)
    found = drive(det, NODES4, T0, T0 + 900, thermal_gpu5_on_gpu02, slow_ranks_on_gpu02)
    assert len(found) == 1
    (a,) = found
    assert a.node == "gpu02" and a.job_id == "1001" and a.job_nodes == list(NODES4)
    assert a.category == "gpu_hardware" and a.signature == "straggler" and a.severity == "warning"
    assert a.role == "root" and a.isolate is True and a.source == "gpu"
    assert a.line.startswith("gpu02: HW slowdown, HW thermal slowdown on GPU 5; ")
    assert "GPU 5 SM clock 1125 MHz vs 1981 MHz on the other nodes (43% lower)" in a.line
    assert "its ranks 4-7 step 38% slower than the other nodes' median (2.76 s vs 2.00 s)" in a.line
    assert a.line.endswith("over the last 90 s")
    # Warm-up (120 s) plus 45 s of persistent evidence before the verdict, not earlier.
    assert T0 + 165 <= a.event_time <= T0 + 185


def test_slow_node_without_throttle_reasons_is_a_node_fault() -> None:
    det = StragglerDetector()
    running(det, NODES4)
    # Every GPU of gpu03 at lower clock and power, no throttle reason: not attributable to a GPU.
    found = drive(
        det,
        NODES4,
        T0,
        T0 + 600,
        lambda n, i, t: (1400.0, 480.0, 97.0, []) if n == "gpu03" else healthy_gpu(n, i, t),
    )
    (a,) = found
    assert a.node == "gpu03" and a.category == "node" and a.isolate is True
    assert "it runs ranks 8-11" in a.line


def test_step_time_evidence_alone() -> None:
    det = StragglerDetector()
    running(det, NODES4)
    (a,) = drive(det, NODES4, T0, T0 + 600, step_fn=slow_ranks_on_gpu02)
    assert a.node == "gpu02" and a.category == "node" and a.source == "job_log"
    assert (
        a.line
        == "gpu02: its ranks 4-7 step 38% slower than the other nodes' median (2.76 s vs 2.00 s) over the last 90 s"
    )


def test_uniformly_slow_job_yields_nothing() -> None:
    det = StragglerDetector()
    running(det, NODES4)
    everyone_throttled = drive(
        det,
        NODES4,
        T0,
        T0 + 900,
        lambda n, i, t: (1125.0 + (i % 3), 420.0, 99.0, ["HwThermalSlowdown"]),
        lambda n, r, t: 2.76,
    )
    assert everyone_throttled == []


def test_single_node_job_yields_nothing() -> None:
    det = StragglerDetector()
    running(det, ("gpu01",))
    found = drive(
        det,
        ("gpu01",),
        T0,
        T0 + 900,
        lambda n, i, t: (1125.0, 420.0, 99.0, ["HwThermalSlowdown"]) if i == 5 else healthy_gpu(n, i, t),
    )
    assert found == []


def test_slowness_during_warm_up_only_yields_nothing() -> None:
    det = StragglerDetector()
    running(det, NODES4)

    def slow_at_start(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
        # The first 100 s: compilation on gpu02 keeps one GPU's clock down.
        return thermal_gpu5_on_gpu02(node, idx, t) if t < T0 + 100 else healthy_gpu(node, idx, t)

    assert drive(det, NODES4, T0, T0 + 900, slow_at_start, lambda n, r, t: 4.0 if t < T0 + 100 else 2.0) == []


def test_a_short_burst_is_not_persistent() -> None:
    det = StragglerDetector()
    running(det, NODES4)

    def burst(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
        return thermal_gpu5_on_gpu02(node, idx, t) if T0 + 300 <= t < T0 + 340 else healthy_gpu(node, idx, t)

    assert drive(det, NODES4, T0, T0 + 900, burst) == []


def test_one_anomaly_per_episode_then_rearmed() -> None:
    det = StragglerDetector()
    running(det, NODES4)

    def two_episodes(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
        in_episode = T0 + 200 <= t < T0 + 500 or T0 + 900 <= t < T0 + 1200
        return thermal_gpu5_on_gpu02(node, idx, t) if in_episode else healthy_gpu(node, idx, t)

    found = drive(det, NODES4, T0, T0 + 1300, two_episodes)
    assert [a.node for a in found] == ["gpu02", "gpu02"]
    assert found[0].event_id != found[1].event_id
    assert T0 + 900 < found[1].event_time < T0 + 1100


def test_two_node_job_uses_the_relative_slowdown() -> None:
    nodes = ("gpu01", "gpu02")
    det = StragglerDetector()
    running(det, nodes)
    (a,) = drive(det, nodes, T0, T0 + 600, thermal_gpu5_on_gpu02)
    assert a.node == "gpu02" and a.category == "gpu_hardware"


def test_job_end_forgets_and_event_ids_are_stable() -> None:
    ids = []
    for _ in range(2):
        det = StragglerDetector()
        running(det, NODES4)
        (a,) = drive(det, NODES4, T0, T0 + 400, thermal_gpu5_on_gpu02)
        ids.append(a.event_id)
        det.observe_sched(
            SchedEvent(event_id="e", event_time=T0 + 401, kind="job", job_id="1001", state="CANCELLED"), T0 + 401
        )
        assert det.check(T0 + 402) == []
        # Late lines of the finished job do not bring it back.
        assert drive(det, NODES4, T0 + 410, T0 + 900, thermal_gpu5_on_gpu02) == []
    assert ids[0] == ids[1]


def test_helpers() -> None:
    assert rank_ranges([15, 12, 13, 14, 20, 22, 23]) == "12-15,20,22-23"
    # producers.gpu_nvml's names (dcgm-exporter's), NVML's constants, nvidia-smi's words.
    for name in ("hw_thermal", "HwThermalSlowdown", "HW Thermal Slowdown", "nvmlClocksEventReasonHwThermalSlowdown"):
        assert slowdown_reason(name) == "HW thermal slowdown", name
    assert slowdown_reason("hw_power_brake") == slowdown_reason("HwPowerBrakeSlowdown") == "HW power brake slowdown"
    assert slowdown_reason("sw_thermal") == "SW thermal slowdown" and slowdown_reason("hw_slowdown") == "HW slowdown"
    for other in ("power_cap", "gpu_idle", "SwPowerCap", "sync_boost", "unknown_0x800"):
        assert slowdown_reason(other) is None, other


def test_throttling_that_starts_mid_run_is_a_straggler_within_a_minute() -> None:
    """The target: a straggler verdict within 60 s of the slowdown starting (past warm-up),
    with samples every second and the worker's 2 s check cadence."""
    det = StragglerDetector()
    running(det, NODES4)
    onset = T0 + 400

    def late_thermal(node: str, idx: int, t: float) -> tuple[float, float, float, list[str]]:
        return thermal_gpu5_on_gpu02(node, idx, t) if t >= onset else healthy_gpu(node, idx, t)

    found: list[Anomaly] = []
    t = T0
    while t <= onset + 120 and not found:
        found = drive(det, NODES4, t, t + 1.0, late_thermal, every=1.0, check=False)
        found += det.check(t + 1.0)
        t += 2.0
    (a,) = found
    assert a.node == "gpu02" and a.category == "gpu_hardware"
    assert onset + 30 <= a.event_time <= onset + 60, a.event_time - onset


def test_job_wide_checkpoint_dips_sampled_a_little_differently_are_not_a_straggler() -> None:
    """Found by the 128-node bench: every GPU of a job drops during checkpoints (half of the
    time here); a node whose samples land half a second later catches one more dip sample per
    window, and its window medians fall to the dip's level while its peers' sit in between.
    Compared with its peers of the same moment, it is exactly like them."""
    det = StragglerDetector()
    running(det, NODES4)

    def load(t: float) -> tuple[float, float, float, list[str]]:
        if (t - T0) % 90 < 45:
            return 1980.0, 190.0, 15.0, []  # checkpoint: clocks up, little work
        return 1980.0, 650.0, 98.0, []

    found: list[Anomaly] = []
    t = T0
    while t <= T0 + 600:
        for node in NODES4:
            at = t + (0.5 if node == "gpu03" else 0.0)
            gpus = [
                GpuMetrics(index=i, sm_clock_mhz=c, power_w=p, utilization_pct=u)
                for i, (c, p, u, _) in enumerate([load(at)] * GPUS_PER_NODE)
            ]
            det.observe_gpu(GpuSample(event_id=f"g-{node}-{at}", event_time=at, node=node, gpus=gpus), at)
        if int(t) % 2 == 0:
            found += det.check(t + 0.5)
        t += 1.0
    assert found == []


@given(
    st.dictionaries(
        st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(min_value=-1, max_value=7)),
        # Few distinct values, so that ties between nodes are common.
        st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.0, 1.1, 2.5, 1980.0]) | st.floats(0, 2000, allow_nan=False),
        max_size=40,
    )
)
def test_each_nodes_peer_median_is_the_median_of_the_other_nodes_values(values: dict[tuple[str, int], float]) -> None:
    expected = {
        node: statistics.median(v for (n, _), v in values.items() if n != node)
        for node in {n for n, _ in values}
        if any(n != node for n, _ in values)
    }
    assert _peer_medians(values) == expected


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=6),
            st.sampled_from([0.0, 0.5, 1.0, 1.0, 1980.0]) | st.floats(-1e6, 1e6, allow_nan=False),
        ),
        max_size=60,
    )
)
def test_each_groups_median_is_what_statistics_median_says(pairs: list[tuple[int, float]]) -> None:
    # The check's medians are taken with numpy, group by group; they must be the values the
    # definition (statistics.median: the middle value, or the mean of the two middle ones) gives.
    groups = np.array([g for g, _ in pairs], dtype=np.int64)
    values = np.array([v for _, v in pairs], dtype=np.float64)
    codes, medians, counts = _group_medians(groups, values)
    by_group: dict[int, list[float]] = {}
    for g, v in pairs:
        by_group.setdefault(g, []).append(v)
    assert codes.tolist() == sorted(by_group)
    assert counts.tolist() == [len(by_group[g]) for g in sorted(by_group)]
    assert medians.tolist() == [statistics.median(by_group[g]) for g in sorted(by_group)]


def test_a_gpu_index_past_any_real_one_is_left_out_with_a_warning_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    # The schema bounds a GPU index only below; the check keys GPUs by node and index in int64
    # arrays. A producer's bogus index (here u64's largest, as orjson still parses it) must neither
    # raise in the worker nor keep the node's other GPUs from being compared.
    det = StragglerDetector(warmup_s=0.0, check_every_s=0.0)
    det.observe_sched(
        SchedEvent(event_id="s", event_time=T0, kind="job", job_id="7", state="RUNNING", nodes=list(NODES4)), T0
    )
    found: list[Anomaly] = []
    with caplog.at_level(logging.WARNING, logger="trainmedic.straggler"):
        for k in range(40):
            t = T0 + 5.0 * k
            for node in NODES4:
                slow = node == "gpu03" and k >= 4
                gpus = [
                    GpuMetrics(index=i, sm_clock_mhz=1500.0 if slow else 1980.0, power_w=650.0, utilization_pct=98.0)
                    for i in range(GPUS_PER_NODE)
                ]
                if node == "gpu02":
                    gpus.append(GpuMetrics(index=2**64 - 1, sm_clock_mhz=1980.0, power_w=650.0, utilization_pct=98.0))
                det.observe_gpu(GpuSample(event_id=f"g-{node}-{k}", event_time=t, node=node, gpus=gpus), t)
            found += det.check(t)
    assert [a.node for a in found] == ["gpu03"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "node gpu02 reports GPU index 18446744073709551615" in warnings[0]
