"""Node-local discovery from the bus (producers.placements): the real broker, and the real
Slurm producer and slurmctld of 22.05 and 24.11 for the end-to-end case."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bus.publish import Publisher
from producers.jobdiscovery import JobDiscovery
from producers.placements import BusPlacements
from producers.slurm import SlurmProducer
from schemas.codec import decode
from schemas.events import LogBatch, SchedEvent
from schemas.topics import JOB_LOGS, SCHED_EVENTS
from tests.conftest import Cluster, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

_seq = iter(range(1_000_000))


def _job(job: str, state: str, nodes: list[str], flags: list[str] | None = None) -> SchedEvent:
    return SchedEvent(
        event_id=f"ev-{next(_seq)}",
        event_time=time.time(),
        kind="job",
        job_id=job,
        state=state,
        nodes=nodes,
        flags=flags or [],
    )


def _publish(broker: EmbeddedBroker, *events: SchedEvent) -> None:
    pub = Publisher(broker.bootstrap, "test-sched")
    for e in events:
        pub.publish(SCHED_EVENTS, e)
    assert pub.flush(10) == 0
    pub.close()


class _Resync:
    """A stand-in for JobDiscovery.running_jobs (squeue -w NODE): what Slurm would answer."""

    def __init__(self) -> None:
        self.answer: dict[str, int] = {}
        self.calls = 0

    def __call__(self) -> dict[str, int]:
        self.calls += 1
        return dict(self.answer)


def _settle(p: BusPlacements, want: dict[str, int]) -> dict[str, int]:
    # The picture can be right before every partition has said EOF, and a resync only runs
    # once the backlog is read whole: wait for both, so what follows sees the resync's effect.
    wait_for(f"placements {want}, backlog read", lambda: p() == want and p.caught_up, timeout=20)
    return p()


def test_jobs_on_this_node_follow_the_bus_through_requeue_and_end(broker: EmbeddedBroker) -> None:
    _publish(
        broker,
        _job("101", "PENDING", []),
        _job("101", "RUNNING", ["gpu01", "gpu02"]),
        _job("102", "RUNNING", ["gpu03"]),  # another node's job
    )
    resync = _Resync()
    resync.answer = {"101": 0}
    p = BusPlacements(broker.bootstrap, "gpu01", resync=resync, resync_s=3600)
    try:
        assert _settle(p, {"101": 0}) == {"101": 0}
        assert resync.calls == 1  # once, after the backlog was read
        # Requeued onto other nodes: no longer ours. Back on ours: a new generation.
        _publish(broker, _job("101", "REQUEUED", ["gpu01", "gpu02"]), _job("101", "RUNNING", ["gpu05"]))
        _settle(p, {})
        _publish(broker, _job("101", "PENDING", []), _job("101", "RUNNING", ["gpu01"], flags=["REQUEUED"]))
        _settle(p, {"101": 1})
        # A second RUNNING event of the same run (suspend/resume) does not restart the tailer.
        _publish(broker, _job("101", "RUNNING", ["gpu01"]))
        assert _settle(p, {"101": 1}) == {"101": 1}
        # A requeue between two polls of the producer: RUNNING again, flagged REQUEUED.
        _publish(broker, _job("101", "RUNNING", ["gpu01"], flags=["REQUEUED"]))
        _settle(p, {"101": 2})
        _publish(broker, _job("101", "COMPLETED", ["gpu01"]), _job("101", "GONE", ["gpu01"]))
        _settle(p, {})
        assert resync.calls == 1  # the bus said it all; Slurm was not asked again
    finally:
        p.close()


def test_a_cold_start_of_the_producer_makes_a_resync_that_finds_what_the_bus_never_said(
    broker: EmbeddedBroker,
) -> None:
    _publish(broker, _job("201", "RUNNING", ["gpu01"]))
    resync = _Resync()
    resync.answer = {"201": 0}
    p = BusPlacements(broker.bootstrap, "gpu01", resync=resync, resync_s=3600)
    try:
        _settle(p, {"201": 0})
        # The producer restarts cold: it publishes no baseline. Slurm, asked, says 201 ended and
        # 202 (started while the producer was away) runs here.
        resync.answer = {"202": 3}
        _publish(
            broker,
            SchedEvent(event_id="snap-1", event_time=time.time(), kind="job", state="SNAPSHOT", flags=["COLD_START"]),
        )
        assert _settle(p, {"202": 3}) == {"202": 3}
        assert resync.calls == 2
    finally:
        p.close()


def test_a_failing_resync_keeps_the_bus_picture(broker: EmbeddedBroker) -> None:
    _publish(broker, _job("301", "RUNNING", ["gpu01"]))

    def broken() -> dict[str, int]:
        raise RuntimeError("slurmctld unreachable")

    p = BusPlacements(broker.bootstrap, "gpu01", resync=broken, resync_s=3600)
    try:
        assert _settle(p, {"301": 0}) == {"301": 0}
        assert p.resync_errors == 1
    finally:
        p.close()


def test_no_sched_events_topic_is_refused_naming_it() -> None:
    empty = EmbeddedBroker().start()
    try:
        with pytest.raises(ValueError, match="sched.events"):
            BusPlacements(empty.bootstrap, "gpu01", resync_s=60)
    finally:
        empty.stop(grace_s=0)


class _CountingRunner:
    """The cluster's runner, recording each Slurm command's name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.commands: list[str] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.commands.append(" ".join(argv[:2]))
        out: str = self.inner(argv, timeout)
        return out


@pytest.mark.slurm
def test_a_node_follows_a_real_job_from_the_producers_events_without_polling_slurmctld(
    slurm_any: Cluster, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    pub = Publisher(broker.bootstrap, "test")
    producer = SlurmProducer(pub, runner=slurm_any.runner(), interval_s=1.0, state_path=tmp_path / "state.json")
    producer.poll_once()  # the cold start: the marker only
    out = tmp_path / "train-%j.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", "--nodelist=gpu02", f"--output={out}", "--wrap", "echo '[rank0]:hello'; sleep 600"],
        capture_output=True,
        text=True,
        env=slurm_any.env(),
        timeout=30,
        check=True,
    )
    job = proc.stdout.strip().split(";")[0]
    try:
        wait_for(
            "the producer's RUNNING event",
            lambda: any(e.job_id == job and e.state == "RUNNING" for e in producer.poll_once()),
            timeout=60,
        )
        assert pub.flush(10) == 0
        runner = _CountingRunner(slurm_any.runner())
        finder = JobDiscovery(pub, runner=runner, only_node="gpu02")
        source = BusPlacements(broker.bootstrap, "gpu02", resync=finder.running_jobs, resync_s=3600)
        finder.follow_placements(source)
        wait_for("the job followed with its line", lambda: finder.poll_once() >= 1 or None, timeout=60)
        assert job in {k[0] for k in finder.tailers}
        # The first resync waits for the whole topic; the job may have been described before it
        # (then describe's version probe was the first squeue). Either way: once, then no more.
        wait_for("the first resync", lambda: finder.poll_once() is not None and source.resyncs == 1, timeout=30)
        before = list(runner.commands)
        for _ in range(5):
            finder.poll_once()
        assert runner.commands == before, "a poll between resyncs called Slurm"
        # One resync, one version probe for describe, one describe: nothing per poll.
        assert (
            before.count("squeue --json") <= 2 and before.count("scontrol show") + before.count("scontrol --json") == 1
        ), before
        assert pub.flush(10) == 0
        batches = [decode(LogBatch, raw) for raw in read_topic(broker.bootstrap, JOB_LOGS.name, 2.0)]
        assert any(b.job_id == job and any("hello" in x.text for x in b.lines) for b in batches)

        # The job ends: the producer's event stops the tailer, still without a Slurm call.
        subprocess.run(["scancel", job], env=slurm_any.env(), timeout=30, check=True)
        wait_for(
            "the producer's end event",
            lambda: any(e.job_id == job and e.state != "RUNNING" for e in producer.poll_once()),
            timeout=60,
        )
        assert pub.flush(10) == 0
        wait_for(
            "the tailer dropped",
            lambda: (finder.poll_once() or True) and job not in {k[0] for k in finder.tailers},
            timeout=30,
        )
        assert runner.commands == before
        source.close()
    finally:
        subprocess.run(["scancel", job], env=slurm_any.env(), timeout=30, check=False)
        pub.close()
