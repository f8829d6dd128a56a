"""Edge aggregation of GPU samples: EdgeSummary, NvmlProducer over the fake pynvml, `produce gpu --summary-every`."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from producers.gpu_edge import (
    MAX_EVERY_S,
    ROUTINE_THROTTLE_REASONS,
    EdgeSummary,
    node_phase,
    payload_health,
    sample_health,
)
from producers.gpu_nvml import NvmlCollector, NvmlProducer
from schemas.errors import ExitCode
from schemas.events import GpuMetrics, GpuSample
from schemas.topics import GPU_SAMPLES, Topic
from tests.fakes.fake_pynvml import FakeNvml, h100_gpus


def healthy(index: int, **changes: Any) -> GpuMetrics:
    values: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index}",
        "utilization_pct": 95.0,
        "memory_used_bytes": 40 * 1024**3,
        "temperature_c": 60.0,
        "power_w": 500.0,
        "sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 2619.0,
        "throttle_reasons": [],
        "ecc_sbe_volatile": 3,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_aggregate": 30,
        "ecc_dbe_aggregate": 0,
        "retired_pages_pending": False,
        "remapped_rows_pending": False,
        "remapped_rows_failed": False,
        "pcie_replay_count": 1,
        "nvlink_errors": 0,
    }
    return GpuMetrics(**(values | changes))


def sample(t: float, gpus: list[GpuMetrics] | None = None) -> GpuSample:
    return GpuSample(
        event_id=f"gpu01-{t}", event_time=1_700_000_000 + t, node="gpu01", gpus=gpus or [healthy(0), healthy(1)]
    )


# --- EdgeSummary ------------------------------------------------------------------------------


def test_first_sample_is_published() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=100.0)
    assert (edge.published, edge.suppressed) == (1, 0)


def test_healthy_changes_wait_for_the_summary() -> None:
    edge = EdgeSummary(5.0)
    decisions = []
    for t in range(11):
        gpus = [
            healthy(
                0,
                utilization_pct=float(90 + t % 7),
                memory_used_bytes=(40 + t) * 1024**3,
                temperature_c=60.0 + t,
                power_w=480.0 + 3 * t,
                sm_clock_mhz=1980.0 - t,
                mem_clock_mhz=2619.0 - t,
                ecc_sbe_volatile=3 + t,  # correctable errors rise on healthy GPUs
                ecc_sbe_aggregate=30 + t,
            ),
            healthy(1),
        ]
        decisions.append(edge.publish(sample(t, gpus), now=float(t)))
    assert [t for t, yes in enumerate(decisions) if yes] == [0, 5, 10]
    assert (edge.published, edge.suppressed) == (3, 8)


HEALTH_CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("lost", {"lost": True}),
    ("error", {"error": "temperature: Unknown Error"}),
    ("uuid", {"uuid": "GPU-other"}),
    ("ecc_dbe_volatile", {"ecc_dbe_volatile": 1}),
    ("ecc_dbe_aggregate", {"ecc_dbe_aggregate": 1}),
    ("retired_pages_pending", {"retired_pages_pending": True}),
    ("remapped_rows_pending", {"remapped_rows_pending": True}),
    ("remapped_rows_failed", {"remapped_rows_failed": True}),
    ("pcie_replay_count", {"pcie_replay_count": 2}),
    ("nvlink_errors", {"nvlink_errors": 3}),
    ("throttle_reasons", {"throttle_reasons": ["hw_slowdown"]}),
    ("throttle_reasons unknown", {"throttle_reasons": None}),
    ("counter unknown", {"nvlink_errors": None}),
]


@pytest.mark.parametrize(("name", "change"), HEALTH_CHANGES, ids=[n for n, _ in HEALTH_CHANGES])
def test_a_health_change_is_published_at_once(name: str, change: dict[str, Any]) -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    assert not edge.publish(sample(1), now=1.0)
    assert edge.publish(sample(2, [healthy(0), healthy(1, **change)]), now=2.0), name
    # The changed state is now the reference: it repeating is not news, and neither is time passing.
    assert not edge.publish(sample(3, [healthy(0), healthy(1, **change)]), now=3.0)
    # Going back is a change too.
    assert edge.publish(sample(4), now=4.0)


def test_throttle_reasons_compare_as_a_set() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0, [healthy(0, throttle_reasons=["power_cap", "hw_thermal"])]), now=0.0)
    assert not edge.publish(sample(1, [healthy(0, throttle_reasons=["hw_thermal", "power_cap"])]), now=1.0)


def test_routine_throttle_reasons_wait_for_the_summary() -> None:
    """A GPU at its power limit flips power_cap all the time: not news; a thermal reason is."""
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    assert not edge.publish(sample(1, [healthy(0, throttle_reasons=["power_cap"]), healthy(1)]), now=1.0)
    assert not edge.publish(sample(2, [healthy(0, throttle_reasons=["sw_power_cap", "gpu_idle"]), healthy(1)]), now=2.0)
    assert edge.publish(sample(3, [healthy(0, throttle_reasons=["power_cap", "hw_thermal"]), healthy(1)]), now=3.0)


def test_no_health_condition_reads_a_routine_reason() -> None:
    """Were the catalog to watch a reason the edge holds back, its streak would start up to a
    summary period late: the two must not overlap."""
    from streams.detectors.gpu_health import ThrottleCondition, load_gpu_health_catalog

    read = set()
    for cond in load_gpu_health_catalog().conditions:
        if isinstance(cond, ThrottleCondition):
            read |= set(cond.reasons) | set(cond.unless)
    assert read, "the catalog has throttle conditions"
    assert not read & ROUTINE_THROTTLE_REASONS


@pytest.mark.parametrize(("name", "change"), HEALTH_CHANGES, ids=[n for n, _ in HEALTH_CHANGES])
def test_json_objects_have_the_health_of_the_gpus_they_decode_to(name: str, change: dict[str, Any]) -> None:
    """payload_health (a publisher building JSON objects) reads what sample_health reads of the decoded
    sample, defaults of left-out fields included."""
    for gpus in ([healthy(0), healthy(1, **change)], [GpuMetrics(index=0), GpuMetrics(index=1, **change)]):
        decoded = sample(0, gpus)
        payload = [g.model_dump(mode="json", exclude_defaults=True) | {"index": g.index} for g in gpus]
        assert payload_health(payload) == sample_health(decoded), name


def test_samples_with_xids_are_always_published() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    assert edge.publish(sample(1, [healthy(0), healthy(1, xid_events=[13])]), now=1.0)
    # The same Xid code again is a new event (NVML delivers each one once): published too.
    assert edge.publish(sample(2, [healthy(0), healthy(1, xid_events=[13])]), now=2.0)
    # An Xid is an event, not a state: the sample after it waits for the summary.
    assert not edge.publish(sample(3), now=3.0)
    assert (edge.published, edge.suppressed) == (3, 1)


def test_a_gpu_disappearing_or_appearing_is_published() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    assert edge.publish(sample(1, [healthy(0)]), now=1.0)
    assert not edge.publish(sample(2, [healthy(0)]), now=2.0)
    assert edge.publish(sample(3), now=3.0)


def test_the_summary_period_counts_from_the_last_published_sample() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    assert edge.publish(sample(2, [healthy(0), healthy(1, pcie_replay_count=9)]), now=2.0)
    assert not edge.publish(sample(5, [healthy(0), healthy(1, pcie_replay_count=9)]), now=5.0)
    assert edge.publish(sample(7, [healthy(0), healthy(1, pcie_replay_count=9)]), now=7.0)


def test_slack_absorbs_a_loop_waking_early() -> None:
    strict, slack = EdgeSummary(5.0), EdgeSummary(5.0, slack_s=0.5)
    for edge in (strict, slack):
        assert edge.publish(sample(0), now=0.003)
    assert not strict.publish(sample(5), now=5.001)
    assert slack.publish(sample(5), now=5.001)
    assert not slack.publish(sample(4), now=9.0)


def test_reset_publishes_the_next_sample() -> None:
    edge = EdgeSummary(5.0)
    assert edge.publish(sample(0), now=0.0)
    edge.reset()
    assert edge.publish(sample(1), now=1.0)


@pytest.mark.parametrize(("every_s", "slack_s"), [(0.0, 0.0), (-1.0, 0.0), (MAX_EVERY_S + 1, 0.0), (5.0, 5.0)])
def test_bad_periods_are_refused(every_s: float, slack_s: float) -> None:
    with pytest.raises(ValueError, match="every_s"):
        EdgeSummary(every_s, slack_s=slack_s)


# --- NvmlProducer over the fake NVML ------------------------------------------------------------


class RecordingPublisher:
    def __init__(self, fail: int = 0) -> None:
        self.sent: list[GpuSample] = []
        self.fail = fail  # the next `fail` publishes raise

    def publish(self, topic: Topic, event: GpuSample) -> None:
        assert topic == GPU_SAMPLES
        if self.fail:
            self.fail -= 1
            raise BufferError("Local: Queue full")
        self.sent.append(event)

    def flush(self, timeout: float = 10.0) -> int:
        return 0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# A node name whose summary phase (node_phase) is 0: its summaries fall every 5 s from its first sample.
PHASE0_NODE = "gpu-edge-115"


def producer(
    fake: FakeNvml, pub: RecordingPublisher, clock: FakeClock, summary_every_s: float | None = 5.0
) -> NvmlProducer:
    return NvmlProducer(
        pub,  # type: ignore[arg-type]  # duck-typed: publish and flush
        PHASE0_NODE,
        interval_s=1.0,
        collector=NvmlCollector(fake),
        summary_every_s=summary_every_s,
        clock=clock,
    )


def poll(p: NvmlProducer, clock: FakeClock, times: int, fake: FakeNvml | None = None) -> None:
    for i in range(times):
        if fake is not None:
            for g in fake.gpus:
                g.utilization_pct = 80 + (i * 7 + g.temperature_c) % 20  # healthy noise
                g.temperature_c += 1
        assert p.poll_once() is not None
        clock.t += 1.0


def test_producer_publishes_a_summary_and_health_changes_at_once() -> None:
    fake, pub, clock = FakeNvml(h100_gpus(8)), RecordingPublisher(), FakeClock()
    p = producer(fake, pub, clock)
    poll(p, clock, 10, fake)
    assert (p.samples, p.suppressed, p.errors, len(pub.sent)) == (2, 8, 0, 2)

    clock.t = 1009.4  # 4.4 s after the last published sample: not yet the summary's turn
    fake.lose(3)
    poll(p, clock, 1)
    assert (p.samples, p.suppressed, len(pub.sent)) == (3, 8, 3)
    assert {g.index for g in pub.sent[-1].gpus if g.lost} == {3} and p.lost_gpu_readings == 1
    poll(p, clock, 1)  # still lost: nothing new
    assert (p.samples, p.suppressed) == (3, 9)

    fake.inject_xid(5, 79)
    poll(p, clock, 1)
    assert p.samples == 4 and [(g.index, g.xid_events) for g in pub.sent[-1].gpus if g.xid_events] == [(5, [79])]


def test_producer_without_summary_publishes_every_sample() -> None:
    fake, pub, clock = FakeNvml(h100_gpus(2)), RecordingPublisher(), FakeClock()
    p = producer(fake, pub, clock, summary_every_s=None)
    poll(p, clock, 4, fake)
    assert (p.samples, p.suppressed, len(pub.sent)) == (4, 0, 4)


def test_a_failed_publish_does_not_hide_the_health_change() -> None:
    fake, pub, clock = FakeNvml(h100_gpus(2)), RecordingPublisher(), FakeClock()
    p = producer(fake, pub, clock)
    poll(p, clock, 1)
    fake.gpus[1].remapped_rows = (0, 1, 1, 0)
    pub.fail = 1
    assert p.poll_once() is None  # never raises: counted and logged
    clock.t += 1.0
    assert (p.errors, p.samples) == (1, 1)
    poll(p, clock, 1)  # the same health as the lost one: published in its place
    assert p.samples == 2 and pub.sent[-1].gpus[1].remapped_rows_pending is True


def test_producer_refuses_a_summary_faster_than_its_samples() -> None:
    fake = FakeNvml(h100_gpus(1))
    with pytest.raises(ValueError, match=r"summary_every_s \(0\.5 s\).*interval_s \(1 s\)"):
        NvmlProducer(RecordingPublisher(), "gpu01", interval_s=1.0, collector=NvmlCollector(fake), summary_every_s=0.5)  # type: ignore[arg-type]


# --- CLI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--summary-every", "0"], "--summary-every must be > 0"),
        (["--summary-every", "-5"], "--summary-every must be > 0"),
        (["--interval", "2", "--summary-every", "1"], "--summary-every (1 s) must be >= --interval (2 s)"),
        (["--summary-every", "120"], "--summary-every (120 s) must be <= 30 s"),
    ],
)
def test_produce_gpu_validates_summary_every(args: list[str], said: str) -> None:
    from trainmedic.cli.main import app

    # Refused before NVML or Kafka are looked at.
    result = CliRunner().invoke(app, ["produce", "gpu", "--bootstrap", "127.0.0.1:1", *args])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert said in result.output and "Traceback" not in result.output


class FinishingPublisher(RecordingPublisher):
    delivered: dict[str, int] = {}
    dropped: dict[str, int] = {}
    dead_lettered: dict[str, int] = {}

    def close(self, timeout: float = 10.0) -> int:
        return 0


def test_produce_gpu_says_what_summary_every_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    from collections.abc import Callable

    import trainmedic.cli.produce as produce_cli
    from trainmedic.cli.main import app

    pub = FinishingPublisher()

    def two_polls(name: str, run: Callable[[threading.Event], object], stop: threading.Event | None = None) -> None:
        gpu_producer = run.__self__  # type: ignore[attr-defined]
        gpu_producer.poll_once()
        gpu_producer.poll_once()  # within the summary period, nothing changed: held back

    monkeypatch.setattr(produce_cli, "_nvml_collector", lambda: NvmlCollector(FakeNvml(h100_gpus(2))))
    monkeypatch.setattr(produce_cli, "_publisher", lambda *_: pub)
    monkeypatch.setattr(produce_cli, "_stop_event", threading.Event)
    monkeypatch.setattr(produce_cli, "_run_loop", two_polls)
    result = CliRunner().invoke(app, ["produce", "gpu", "--node", PHASE0_NODE, "--summary-every", "5"])
    assert result.exit_code == 0, result.output
    assert "sampling every 1 s, publishing every 5 s and at once on a health change" in result.output
    assert '"samples": 1, "suppressed": 1, "errors": 0' in result.output
    assert len(pub.sent) == 1


def test_a_phase_starts_the_summaries_early_and_spreads_a_fleet() -> None:
    """Producers started together publish their summaries spread over the period, not together."""
    edge = EdgeSummary(5.0, phase_s=3.0)
    assert edge.publish(sample(0), now=100.0)  # the first sample, as always
    assert not edge.publish(sample(1), now=101.0)
    assert edge.publish(sample(2), now=102.0)  # 5 s after 97.0
    assert not edge.publish(sample(6), now=106.0)
    assert edge.publish(sample(7), now=107.0)  # then every 5 s
    assert node_phase(PHASE0_NODE, 5.0) == 0.0
    phases = [node_phase(f"gpu{i:04d}", 5.0) for i in range(1000)]
    assert all(0 <= p < 5.0 for p in phases)
    # Each second of the period gets about a fifth of the fleet's summaries.
    assert all(150 <= sum(1 for p in phases if k <= p < k + 1) <= 250 for k in range(5))
    with pytest.raises(ValueError, match="phase_s"):
        EdgeSummary(5.0, phase_s=5.0)


def test_a_fleet_started_together_spreads_its_summaries_over_the_period() -> None:
    """1,000 nodes read every second from the same start, summarised every 5 s with the producer's
    slack: each second of the period carries about a fifth of the summaries."""
    edges = [EdgeSummary(5.0, slack_s=0.5, phase_s=node_phase(f"gpu{i:04d}", 5.0)) for i in range(1000)]
    per_second = [0] * 5
    for t in range(60):
        for edge in edges:
            if edge.publish(sample(t), now=float(t)) and t >= 10:
                per_second[t % 5] += 1
    share = [n / sum(per_second) for n in per_second]
    assert all(0.15 <= x <= 0.25 for x in share), share
