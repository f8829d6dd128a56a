"""GPU samples reach the jobs on their nodes as one record per job (gpu.samples.by_job), through
the real broker and the real streams worker:

- the samples of a running job's nodes arrive keyed by the job, each as its node published it;
- a node running no job is not forwarded;
- a lost GPU is sent at once, not held for the job's next record;
- several nodes' samples share a record (the point of gathering them);
- a single sample on gpu.samples.by_job, as a worker of the version before gpu_sample_batch
  forwarded it, is read during a rolling upgrade, not dead-lettered.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from confluent_kafka import Producer

from bus.config import producer_config
from bus.consume import read_records
from bus.publish import Publisher
from schemas.codec import decode, encode
from schemas.events import DeadLetter, GpuMetrics, GpuSample, GpuSampleBatch, SchedEvent
from schemas.topics import DEADLETTER, GPU_SAMPLES, GPU_SAMPLES_BY_JOB, SCHED_EVENTS
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for, wait_placed
from tests.integration.scenario import running_stack
from trainmedic.stack.broker import EmbeddedBroker


def _sample(node: str, t: float, lost: bool = False) -> GpuSample:
    return GpuSample(
        event_id=f"{node}-{t:.3f}",
        event_time=t,
        node=node,
        collector="nvml",
        gpus=[GpuMetrics(index=0, utilization_pct=95.0, lost=lost), GpuMetrics(index=1, utilization_pct=96.0)],
    )


def _batches(bootstrap: str, since: float) -> list[GpuSampleBatch]:
    return [decode(GpuSampleBatch, value) for _, value in read_records(bootstrap, GPU_SAMPLES_BY_JOB.name, since)]


def test_a_jobs_gpu_samples_are_gathered_into_records_keyed_by_the_job(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    all_nodes = [f"gpu{n:02d}" for n in range(1, 6)]
    sched = SimulatedScheduler(all_nodes)
    job = sched.submit("train", 4)
    nodes = list(sched.job_state(job).nodes)
    idle = next(n for n in all_nodes if n not in nodes)
    since = time.time() - 1
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path) as stack:
        assert stack.store is not None
        pub = Publisher(broker.bootstrap, "test-producer")
        pub.publish(
            SCHED_EVENTS,
            SchedEvent(
                event_id=f"run-{job}", event_time=time.time(), kind="job", job_id=job, state="RUNNING", nodes=nodes
            ),
        )
        assert pub.flush(10) == 0
        wait_placed(broker.bootstrap, [job])  # the placement first, as after the Slurm producer's snapshot
        t0 = time.time()
        sent = [_sample(n, t0 + i * 0.01) for i, n in enumerate([*nodes, idle])]
        for s in sent:
            pub.publish(GPU_SAMPLES, s)
        assert pub.flush(10) == 0

        def forwarded() -> list[GpuSample] | None:
            got = [s for b in _batches(broker.bootstrap, since) for s in b.samples]
            return got if len(got) >= len(nodes) else None

        samples = wait_for("the job's samples on gpu.samples.by_job", forwarded, 60)
        batches = _batches(broker.bootstrap, since)
        assert {b.job_id for b in batches} == {job}
        assert sorted(s.event_id for s in samples) == sorted(s.event_id for s in sent[: len(nodes)])
        by_id = {s.event_id: s for s in sent}
        assert all(s == by_id[s.event_id] for s in samples)  # as the node published it
        assert idle not in {s.node for s in samples}
        assert max(len(b.samples) for b in batches) > 1, [len(b.samples) for b in batches]

        # A lost GPU goes out when it is read: the node's next sample (read right after it, from
        # the same partition) is not in its record, as it would be had the lost GPU waited.
        since_lost = time.time()
        t1 = time.time() + 10  # past the forward period of the node's last sample
        lost, after = _sample(nodes[0], t1, lost=True), _sample(nodes[0], t1 + 3.0)
        pub.publish(GPU_SAMPLES, lost)
        pub.publish(GPU_SAMPLES, after)
        assert pub.flush(10) == 0

        def both() -> list[GpuSampleBatch] | None:
            found = [b for b in _batches(broker.bootstrap, since_lost) if lost in b.samples or after in b.samples]
            return found if sum(len(b.samples) for b in found) >= 2 else None

        carrying = wait_for("the lost GPU's record and the next one", both, 60)
        assert [b.samples for b in carrying] == [[lost], [after]]
        assert {b.job_id for b in carrying} == {job}

        # A worker of the previous version forwarded one gpu_sample per record. Then a record that
        # is neither, on the same partition (same key): once its letter is there, the single sample
        # before it was read, and it must not have a letter of its own.
        since_old = time.time()
        raw = Producer(producer_config(broker.bootstrap, "test-old-worker"))
        raw.produce(GPU_SAMPLES_BY_JOB.name, key=job.encode(), value=encode(_sample(nodes[1], time.time())))
        raw.produce(GPU_SAMPLES_BY_JOB.name, key=job.encode(), value=b'{"not": "a sample"}')
        assert raw.flush(10) == 0

        def letters() -> list[DeadLetter] | None:
            found = [
                d
                for _, v in read_records(broker.bootstrap, DEADLETTER.name, since_old)
                if (d := decode(DeadLetter, v)).original_topic == GPU_SAMPLES_BY_JOB.name
            ]
            return found or None

        found = wait_for("the dead letter of the record that is neither", letters, 60)
        assert len(found) == 1 and "gpu_sample_batch" in found[0].reason, [d.reason for d in found]
    gc.collect()
