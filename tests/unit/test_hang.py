"""Hang detector with simulated clocks: every `now` is passed explicitly, nothing sleeps."""

from __future__ import annotations

from schemas.events import Anomaly, GpuMetrics, GpuSample, ProgressBatch, ProgressSample, SchedEvent
from streams.detectors.hang import HangDetector

T0 = 1_700_000_000.0
NODES = ("gpu01", "gpu02")


def running(det: HangDetector, job: str = "1001", at: float = T0, nodes: tuple[str, ...] = NODES) -> None:
    det.observe_sched(
        SchedEvent(event_id=f"s-{job}-{at}", event_time=at, kind="job", job_id=job, state="RUNNING", nodes=list(nodes)),
        at,
    )


def ended(det: HangDetector, job: str = "1001", at: float = T0, state: str = "COMPLETED") -> None:
    det.observe_sched(SchedEvent(event_id=f"e-{job}-{at}", event_time=at, kind="job", job_id=job, state=state), at)


def step(
    det: HangDetector,
    n: int | None,
    ts: float,
    job: str = "1001",
    step_time_s: float | None = None,
    phase: str = "train",
    fmt: str = "megatron",
) -> None:
    sample = ProgressSample.model_validate(
        {"ts": ts, "rank": 0, "node": NODES[0], "step": n, "step_time_s": step_time_s, "phase": phase, "format": fmt}
    )
    det.observe_progress(
        ProgressBatch(
            event_id=f"p-{job}-{ts}-{n}-{fmt}", event_time=ts, job_id=job, job_nodes=list(NODES), samples=[sample]
        ),
        ts,
    )


def steady(det: HangDetector, start: float, n_steps: int, every: float, first_step: int = 1) -> float:
    """Report steps first_step.. every `every` seconds from `start`; returns the last report time."""
    t = start
    for i in range(n_steps):
        t = start + i * every
        step(det, first_step + i, t)
    return t


def gpu(det: HangDetector, node: str, ts: float, util: float, n: int = 8) -> None:
    det.observe_gpu(
        GpuSample(
            event_id=f"g-{node}-{ts}",
            event_time=ts,
            node=node,
            gpus=[GpuMetrics(index=i, utilization_pct=util) for i in range(n)],
        ),
        ts,
    )


def first_fire(det: HangDetector, start: float, stop: float, every: float = 1.0) -> tuple[float, list[Anomaly]]:
    """Call check() each `every` seconds of simulated time; the first time it returns anomalies."""
    t = start
    while t <= stop:
        found = det.check(t)
        if found:
            return t, found
        t += every
    return -1.0, []


def test_steady_job_then_silence_fires_after_threshold_and_long_before_600s() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0 + 60, 50, every=2.0)
    assert det.threshold_s("1001") == 30.0  # max(5 x 2 s, 30 s floor)
    assert det.check(last + 29) == []
    at, found = first_fire(det, last + 29, last + 600)
    assert last + 30 < at <= last + 32
    assert at - last < 600 / 10
    (a,) = found
    assert a.category == "hang" and a.role == "root" and a.severity == "error" and a.isolate is False
    assert a.source == "job_log" and a.job_id == "1001" and a.job_nodes == list(NODES)
    assert "no progress from job 1001 for 31 s (median step 2.0 s, k=5, threshold 30 s; last step 50 at" in a.line


def test_fires_once_and_the_event_id_is_stable() -> None:
    ids = []
    for _ in range(2):
        det = HangDetector()
        running(det)
        last = steady(det, T0, 20, every=2.0)
        _, found = first_fire(det, last, last + 100)
        assert len(found) == 1
        assert [det.check(last + t) for t in (60.0, 120.0, 500.0)] == [[], [], []]
        ids.append(found[0].event_id)
    assert ids[0] == ids[1]


def test_redelivered_progress_does_not_change_the_verdict() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    steady(det, T0, 20, every=2.0)  # the same batches again
    assert det.threshold_s("1001") == 30.0
    at, found = first_fire(det, last, last + 100)
    assert len(found) == 1 and last + 30 < at <= last + 31


def test_resumed_progress_rearms() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    _, first = first_fire(det, last, last + 100)
    assert first
    # The job comes back (a slow collective finally completed) and later hangs again.
    last = steady(det, last + 60, 10, every=2.0, first_step=21)
    assert det.check(last + 10) == []
    _, second = first_fire(det, last, last + 100)
    assert len(second) == 1
    assert second[0].event_id != first[0].event_id
    assert "last step 30" in second[0].line


def test_slow_first_step_does_not_fire() -> None:
    det = HangDetector()
    running(det)
    # Compilation and data-loader start: the first step arrives after 5 minutes ...
    step(det, 1, T0 + 300)
    assert det.check(T0 + 299) == [] and det.check(T0 + 900) == []
    # ... the second after another 4 minutes, then the job runs at 2 s per step.
    step(det, 2, T0 + 540)
    assert det.check(T0 + 1000) == []
    last = steady(det, T0 + 542, 10, every=2.0, first_step=3)
    # The slow start is not part of the learned rhythm.
    assert det.threshold_s("1001") == 30.0
    assert det.check(last + 25) == []


def test_warm_up_uses_the_allowance_or_nothing() -> None:
    det = HangDetector(warmup_allowance_s=None)
    running(det)
    step(det, 1, T0 + 100)
    assert det.check(T0 + 100_000) == []
    det = HangDetector()
    running(det)
    step(det, 1, T0 + 100)
    assert det.check(T0 + 100 + 1800) == []
    (a,) = det.check(T0 + 100 + 1801)
    assert "during warm-up, after 1 progress report(s)" in a.line


def test_a_job_without_progress_reports_never_fires_on_silence() -> None:
    det = HangDetector()
    running(det)
    assert det.check(T0 + 10 * 3600) == []


def test_checkpoint_pause_does_not_fire() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    step(det, 20, last + 0.5, phase="checkpoint", fmt="megatron:checkpoint_start")
    for t in (40, 100, 400, 1500):
        assert det.check(last + t) == [], t
    end = last + 1600
    step(det, 20, end, phase="checkpoint", fmt="megatron:checkpoint_end")
    # After the save the silence counts from its end, with the usual threshold.
    assert det.check(end + 29) == []
    at, found = first_fire(det, end + 29, end + 100)
    assert found and end + 30 < at <= end + 31


def test_checkpoint_without_end_line_ends_at_the_next_step() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    step(det, None, last + 1, phase="checkpoint", fmt="hf:checkpoint_start")
    assert det.check(last + 300) == []
    step(det, 21, last + 400)
    assert det.check(last + 420) == []
    assert det.check(last + 431) != []


def test_checkpoint_that_never_ends_is_a_hang() -> None:
    det = HangDetector(checkpoint_allowance_s=600.0)
    running(det)
    last = steady(det, T0, 20, every=2.0)
    step(det, 20, last + 1, phase="checkpoint", fmt="torchtitan:checkpoint_start")
    assert det.check(last + 600) == []
    (a,) = det.check(last + 602)
    assert "checkpoint save of job 1001 (step 20)" in a.line and "has not finished after 601 s" in a.line


def test_all_gpus_idle_fires() -> None:
    det = HangDetector()
    running(det)
    # A job that reports rarely: every 5 minutes, so its silence threshold is 25 minutes.
    for i, t in enumerate((T0 + 100, T0 + 400, T0 + 700, T0 + 1000)):
        step(det, (i + 1) * 100, t)
    assert det.threshold_s("1001") == 1500.0
    t = T0
    while t < T0 + 1010:
        for node in NODES:
            gpu(det, node, t, util=97.0)
        t += 10
    idle_from = t
    for k in range(30):
        for node in NODES:
            gpu(det, node, idle_from + 10 * k, util=0.0)
        found = det.check(idle_from + 10 * k)
        if found:
            break
    assert found and idle_from + 60 <= idle_from + 10 * k <= idle_from + 70
    (a,) = found
    assert a.source == "gpu" and a.category == "hang"
    assert "all 16 GPUs of job 1001 on gpu01,gpu02 at <= 2% utilization for 60 s while RUNNING" in a.line
    assert det.check(idle_from + 400) == []


def test_idle_gpus_on_one_node_only_or_stale_samples_do_not_fire() -> None:
    det = HangDetector()
    running(det)
    for i, t in enumerate((T0 + 100, T0 + 400, T0 + 700)):
        step(det, (i + 1) * 100, t)
    for k in range(20):
        gpu(det, "gpu01", T0 + 710 + 10 * k, util=0.0)
        gpu(det, "gpu02", T0 + 710 + 10 * k, util=85.0)
    assert det.check(T0 + 900) == []
    # gpu02 goes idle but then stops reporting: its state is unknown, no verdict.
    gpu(det, "gpu02", T0 + 910, util=0.0)
    assert det.check(T0 + 910 + 61) == []


def test_gpu_idle_during_startup_needs_the_warm_up_allowance() -> None:
    det = HangDetector()
    running(det)
    for k in range(0, 2000, 10):
        for node in NODES:
            gpu(det, node, T0 + k, util=0.0)
        if det.check(T0 + k):
            break
    assert k == 1800


def test_jobs_not_running_or_ended_never_fire() -> None:
    det = HangDetector()
    last = steady(det, T0, 20, every=2.0)  # progress, but the scheduler never said RUNNING
    assert det.check(last + 1000) == []
    running(det, at=T0 - 10)
    last = steady(det, last + 2, 5, every=2.0, first_step=21)
    ended(det, at=last + 1)
    assert det.check(last + 1000) == [] and det.running() == []
    # A RUNNING event of the finished run, redelivered late, does not bring it back.
    running(det, at=T0 - 10)
    assert det.running() == []
    # A requeued run is new: it starts with a fresh warm-up.
    running(det, at=last + 500)
    step(det, 1, last + 600)
    assert det.threshold_s("1001") is None and det.check(last + 700) == []


def test_sparse_megatron_reports_use_the_report_interval() -> None:
    det = HangDetector()
    running(det)
    # One line per 100 iterations at 0.86 s each: 86 s between lines.
    for i in range(8):
        step(det, 100 * (i + 1), T0 + 86.0 * (i + 1), step_time_s=0.86)
    last = T0 + 86.0 * 8
    assert det.threshold_s("1001") == 5 * 86.0
    assert det.check(last + 400) == []
    (a,) = det.check(last + 431)
    assert "median 86.0 s between reports of 100 steps" in a.line


def test_reports_stamped_in_one_poll_use_the_printed_step_time() -> None:
    det = HangDetector()
    running(det)
    # The tailer stamped three lines with the same time; the printed step time tells the rhythm.
    for i in range(3):
        step(det, i + 1, T0 + 10, step_time_s=12.0)
    for i in range(3, 6):
        step(det, i + 1, T0 + 46, step_time_s=12.0)
    assert det.threshold_s("1001") == 60.0


def test_requeue_flag_starts_a_new_run() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    assert det.threshold_s("1001") == 30.0
    # producers.slurm: a RUNNING event whose restart count went up carries the flag REQUEUED.
    det.observe_sched(
        SchedEvent(event_id="rq", event_time=last + 5, kind="job", job_id="1001", state="RUNNING", flags=["REQUEUED"]),
        last + 5,
    )
    assert det.threshold_s("1001") is None and det.check(last + 100) == []


def test_assume_running_watches_jobs_the_scheduler_did_not_announce() -> None:
    det = HangDetector(assume_running=True)
    last = steady(det, T0, 20, every=2.0)
    assert det.running() == ["1001"]
    assert det.check(last + 31) != []
    ended(det, at=last + 40)
    step(det, 21, last + 50)  # a late line of the finished run
    assert det.running() == []


def test_evaluations_seen_once_are_not_taken_for_hangs() -> None:
    det = HangDetector()
    running(det)
    # Per-step logging at 2 s; every 100 steps Megatron evaluates for 90 s and prints the result.
    t, n = T0, 0
    fired: list[Anomaly] = []
    for _ in range(3):
        for _ in range(100):
            n += 1
            t += 2.0
            step(det, n, t)
            fired += det.check(t)
        fired += det.check(t + 60)
        t += 90.0
        step(det, n, t, phase="eval")
    # The first evaluation could not be known in advance; the next ones are.
    assert len(fired) == 1 and "last step 100 at" in fired[0].line
    assert det.threshold_s("1001") == 30.0
    # Away from an evaluation step, a hang is still found after 30 s.
    step(det, n + 1, t + 2)
    assert det.check(t + 2 + 29) == [] and det.check(t + 2 + 31) != []


def test_a_late_copy_of_the_last_step_does_not_rearm_but_a_restart_does() -> None:
    det = HangDetector()
    running(det)
    last = steady(det, T0, 20, every=2.0)
    _, first = first_fire(det, last, last + 100)
    assert first
    step(det, 20, last + 40)  # another node's tailer, late, with the same step
    assert det.check(last + 200) == []
    # torchrun restarts the workers in place: they replay steps from the last checkpoint.
    step(det, 11, last + 300)
    step(det, 12, last + 302)
    (again,) = det.check(last + 302 + 31)
    assert again.event_id != first[0].event_id
