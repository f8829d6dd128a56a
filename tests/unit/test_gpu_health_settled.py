"""The GPU-health detector's shortcut for settled GPUs (a GPU reading what it read last, with
nothing open, is not evaluated again) must find exactly what evaluating every sample finds.

The oracle is the same detector with the shortcut turned off; hypothesis drives both with random
series of samples: counters that stand still, rise in bursts or reset, flags that come and go,
throttle reasons that hold or break, gaps longer than a window or a duration, Xids, a GPU swapped
for another (new uuid) or missing from a sample."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import GpuMetrics, GpuSample
from streams.catalog import load_xid_catalog
from streams.detectors.gpu_health import GpuHealthDetector, load_gpu_health_catalog

# Loaded once: a detector per hypothesis example would otherwise read xid.yaml 600 times.
CATALOG = load_gpu_health_catalog()
XIDS = load_xid_catalog().xids


class FullEvaluation(GpuHealthDetector):
    """Evaluates every condition on every sample: no skip, no history collapse."""

    SHORTCUT = False


_REASONS = st.sampled_from([None, [], ["hw_slowdown"], ["sw_thermal"], ["hw_thermal", "sw_power_cap"], ["gpu_idle"]])

# One GPU's step: how its readings change from the previous sample.
_step = st.fixed_dictionaries(
    {
        "gap_s": st.sampled_from([1.0, 1.0, 1.0, 5.0, 30.0, 31.0, 59.0, 60.0, 61.0, 130.0]),
        # -1: a reset (counter back to 0); None: unreadable in this sample
        "nvlink": st.sampled_from([0, 0, 0, 0, 1, 4, 11, -1, None]),
        "pcie": st.sampled_from([0, 0, 0, 0, 3, 9, None]),
        "dbe": st.sampled_from([0, 0, 0, 0, 0, 1]),
        "lost": st.sampled_from([False, False, False, False, True]),
        "remap_pending": st.sampled_from([False, False, False, None, True]),
        "reasons": st.one_of(st.just("same"), _REASONS),
        "xid": st.sampled_from([[], [], [], [], [], [79], [48], [13, 13]]),
        "uuid": st.sampled_from(["GPU-a", "GPU-a", "GPU-a", "GPU-a", "GPU-b", None]),
        "present": st.sampled_from([True, True, True, True, True, False]),
    }
)


def _series(steps: list[list[dict[str, Any]]]) -> list[GpuSample]:
    t = 1_000_000.0
    nvlink = [0, 0]
    pcie = [0, 0]
    dbe = [0, 0]
    reasons: list[list[str] | None] = [[], []]
    samples = []
    for n, step in enumerate(steps):
        t += float(step[0]["gap_s"])
        gpus = []
        for i, s in enumerate(step):
            if s["nvlink"] is not None:
                nvlink[i] = 0 if s["nvlink"] == -1 else nvlink[i] + int(s["nvlink"])
            if s["pcie"] is not None:
                pcie[i] += int(s["pcie"])
            dbe[i] += int(s["dbe"])
            if s["reasons"] != "same":
                reasons[i] = s["reasons"]
            if not s["present"]:
                continue
            gpus.append(
                GpuMetrics(
                    index=i,
                    uuid=f"{s['uuid']}-{i}" if s["uuid"] else None,
                    lost=bool(s["lost"]),
                    utilization_pct=float(n % 100),  # not health: changes every sample
                    throttle_reasons=reasons[i],
                    ecc_dbe_volatile=dbe[i],
                    remapped_rows_pending=s["remap_pending"],
                    pcie_replay_count=None if s["pcie"] is None else pcie[i],
                    nvlink_errors=None if s["nvlink"] is None else nvlink[i],
                    xid_events=list(s["xid"]),
                )
            )
        samples.append(GpuSample(event_id=f"s{n}", event_time=t, node="gpu01", gpus=gpus))
    return samples


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_step, min_size=2, max_size=2), min_size=1, max_size=80))
def test_settled_gpus_skipped_find_what_full_evaluation_finds(steps: list[list[dict[str, Any]]]) -> None:
    fast, full = GpuHealthDetector(CATALOG, XIDS), FullEvaluation(CATALOG, XIDS)
    for sample in _series(steps):
        got = fast.observe(sample)
        want = full.observe(sample)
        assert [a.model_dump(exclude={"produced_at"}) for a in got] == [
            a.model_dump(exclude={"produced_at"}) for a in want
        ], sample.event_id


def test_a_quiet_fleet_is_mostly_skipped() -> None:
    """The shortcut is taken: a healthy GPU is evaluated once, then only when a reading changes."""
    calls = 0

    class Counting(GpuHealthDetector):
        def _flag(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return super()._flag(*args, **kwargs)

    det = Counting()
    flags = sum(1 for c in det._catalog.conditions if c.kind == "flag")
    for n in range(100):
        det.observe(
            GpuSample(
                event_id=f"s{n}",
                event_time=1000.0 + n,
                node="gpu01",
                gpus=[GpuMetrics(index=0, uuid="GPU-a", nvlink_errors=7, throttle_reasons=[], utilization_pct=n)],
            )
        )
    assert calls == flags  # the first sample only
    # A rise then evaluates again, and a burst within the window is still seen.
    found = det.observe(
        GpuSample(
            event_id="burst",
            event_time=1100.0,
            node="gpu01",
            gpus=[GpuMetrics(index=0, uuid="GPU-a", nvlink_errors=40, throttle_reasons=[])],
        )
    )
    assert [(a.facts["condition"], a.facts["nvlink_errors_from"]) for a in found] == [("nvlink_errors", "7")]


def test_a_counter_unreadable_while_settled_keeps_the_time_of_its_last_reading() -> None:
    """nvlink_errors 0 at t=1000, unreadable at 1001, 20 at 1061: a rise over 61 s, outside the
    60 s window; the shortcut must not move the 0 reading forward to 1001."""

    def at(t: float, nvlink: int | None) -> GpuSample:
        gpu = GpuMetrics(index=0, uuid="GPU-a", nvlink_errors=nvlink, throttle_reasons=[])
        return GpuSample(event_id=f"s{t}", event_time=t, node="gpu01", gpus=[gpu])

    for det in (GpuHealthDetector(CATALOG, XIDS), FullEvaluation(CATALOG, XIDS)):
        found = [a for s in (at(1000, 0), at(1001, None), at(1061, 20)) for a in det.observe(s)]
        assert found == [], type(det).__name__
