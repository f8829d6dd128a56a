"""The job-log tailer finds a real Slurm job's output file and follows it, on
Slurm 22.05 and 24.11 (each test runs on both clusters)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from producers.jobdiscovery import JobDiscovery
from producers.joblogs import JobLogProducer
from schemas.codec import decode
from schemas.events import LogBatch
from schemas.topics import JOB_LOGS
from tests.conftest import Cluster, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


def test_discovers_stdout_and_publishes_ranked_lines(
    slurm_any: Cluster, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    out = tmp_path / "train-%j.out"
    script = "echo '0: starting'; echo '1: [rank1]:hello from rank one'; sleep 600"
    proc = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks=4", f"--output={out}", "--wrap", script],
        capture_output=True,
        text=True,
        env=slurm_any.env(),
        timeout=30,
        check=True,
    )
    job = proc.stdout.strip().split(";")[0]
    try:
        pub = Publisher(broker.bootstrap, "test")
        finder = JobDiscovery(pub, runner=slurm_any.runner())
        wait_for("the job followed with its lines", lambda: finder.poll_once() >= 2 or None, timeout=60)
        (key,) = [k for k in finder.tailers if k[0] == job]
        follower = finder.tailers[key]
        assert [str(f.path) for f in follower.followers] == [str(tmp_path / f"train-{job}.out")]
        assert len(follower.layout.job_nodes) == 2 and follower.layout.ranks_per_node == 2
        assert pub.flush(10) == 0
        consumer = Consumer(consumer_config(broker.bootstrap, "t", "t"))
        consumer.subscribe([JOB_LOGS.name])
        msg = wait_for("the log batch", lambda: (m := consumer.poll(0.5)) is not None and not m.error() and m)
        consumer.close()
        batch = decode(LogBatch, msg.value())
        assert batch.job_id == job
        line = next(x for x in batch.lines if "hello" in x.text)
        assert (line.rank, line.node, line.text) == (1, follower.layout.job_nodes[0], "hello from rank one")
    finally:
        subprocess.run(["scancel", job], env=slurm_any.env(), timeout=30, check=False)


def test_one_job_whose_tailer_fails_does_not_stop_the_others(
    slurm_any: Cluster, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    jobs = []
    for name in ("bad", "good"):
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path / name}-%j.out", "--wrap", f"echo {name} line; sleep 600"],
            capture_output=True,
            text=True,
            env=slurm_any.env(),
            timeout=30,
            check=True,
        )
        jobs.append(proc.stdout.strip().split(";")[0])
    bad, good = jobs

    class Failing(JobLogProducer):
        def poll_once(self) -> int:
            raise RuntimeError("injected: this job's input breaks its tailer")

    try:
        pub = Publisher(broker.bootstrap, "test")
        finder = JobDiscovery(pub, runner=slurm_any.runner())
        default = finder._factory
        finder._factory = lambda job: (  # type: ignore[method-assign]
            Failing(pub, job.job_id, list(job.paths)) if job.job_id == bad else default(job)
        )
        wait_for("the good job's line", lambda: finder.poll_once() >= 1 or None, timeout=60)
        assert finder.tailer_errors >= 1
        assert {k[0] for k in finder.tailers} >= {bad, good}  # the failing job is still watched
        assert pub.flush(10) == 0
        batches = [decode(LogBatch, raw) for raw in read_topic(broker.bootstrap, JOB_LOGS.name, 2.0)]
        assert {b.job_id for b in batches} == {good}
    finally:
        subprocess.run(["scancel", *jobs], env=slurm_any.env(), timeout=30, check=False)
