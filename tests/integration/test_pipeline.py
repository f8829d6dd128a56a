"""The loop through the real broker, the real streams worker and the real chDB audit,
with the simulated scheduler behind the executor."""

from __future__ import annotations

import base64
from pathlib import Path

from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]
from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import DeadLetter
from schemas.topics import DEADLETTER, DEFAULT_PARTITIONS, JOB_LOGS
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import FIXTURES, wait_for
from tests.integration.scenario import (
    NODES,
    incidents_of,
    publish_cascade,
    publish_log_file,
    running_stack,
    wait_incident,
)
from trainmedic.stack.broker import EmbeddedBroker


def test_xid79_beats_nccl_timeouts_one_incident_and_acts(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES + ["gpu05"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    with running_stack(broker.bootstrap, chdb_url, database, sched, "autonomous", tmp_path) as stack:
        assert stack.store is not None
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(stack.store, job)
        assert (inc["culprit_node"], inc["category"]) == ("gpu02", "gpu_hardware")
        assert '"xid_79"' in str(inc["evidence"]) and '"nccl_watchdog_timeout"' in str(inc["evidence"])
        assert "Watchdog caught collective operation timeout" in str(inc["evidence"])
        assert "fallen off the bus" in str(inc["evidence"])
        result = wait_for(
            "the action result",
            lambda: stack.store.query(  # type: ignore[union-attr]
                "SELECT * FROM {db}.action_results FINAL WHERE job_id = {j:String}", {"j": job}
            ),
        )[0]
        assert result["status"] == "done", result
        assert len(incidents_of(stack.store, job)) == 1
    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]
    after = sched.job_state(job)
    assert after.state == "RUNNING" and "gpu02" not in after.nodes
    assert sched.node_state("gpu02").reason and str(inc["incident_id"]) in str(sched.node_state("gpu02").reason)


def test_malformed_message_goes_to_dead_letter_and_pipeline_continues(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES + ["gpu05"])
    job = sched.submit("train", 4)
    bad = b'{"schema_version": 1, "event_id": "x", "lines": "\xff not a list'
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path) as stack:
        assert stack.store is not None
        pub = Publisher(broker.bootstrap, "test")
        pub.publish_raw(JOB_LOGS.name, bad, key=job.encode())
        assert pub.flush(10) == 0
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        wait_incident(stack.store, job)  # the next message was processed
        consumer = Consumer(consumer_config(broker.bootstrap, "test-dlq", "test-dlq"))
        consumer.subscribe([DEADLETTER.name])

        def one_letter() -> DeadLetter | None:
            msg = consumer.poll(0.5)
            return decode(DeadLetter, msg.value() or b"") if msg is not None and not msg.error() else None

        letter = wait_for("a dead letter", one_letter, timeout=30)
        consumer.close()
        assert letter.original_topic == JOB_LOGS.name
        assert "not valid JSON" in letter.reason
        assert base64.b64decode(letter.payload_b64) == bad
        store = stack.store
        rows = wait_for(
            "the dead letter in the audit", lambda: store.query("SELECT reason FROM {db}.dead_letters FINAL")
        )
        assert "not valid JSON" in rows[0]["reason"]
    assert sched.calls == []  # monitor mode


def _partition(key: str) -> int:
    return (murmur2(key.encode()) & 0x7FFFFFFF) % DEFAULT_PARTITIONS


def test_healthy_job_log_produces_no_incident(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES + ["gpu05", "gpu06"])
    faulty = "500"
    # A job id whose key lands on the faulty job's partition (Kafka's murmur2, as the
    # producers use): records of one partition are processed in order, so once the
    # faulty job's anomalies are in the audit, the healthy job's (none) would be too.
    healthy = next(str(j) for j in range(501, 600) if _partition(str(j)) == _partition(faulty))
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path) as stack:
        assert stack.store is not None
        publish_log_file(broker.bootstrap, healthy, FIXTURES / "logs" / "healthy_training.log", ["gpu05", "gpu06"])
        publish_cascade(broker.bootstrap, tmp_path, faulty, NODES, culprit="gpu02")
        wait_incident(stack.store, faulty)
        assert incidents_of(stack.store, healthy) == []
        assert (
            stack.store.query(
                "SELECT count() AS n FROM {db}.anomalies FINAL WHERE job_id = {j:String}", {"j": healthy}
            )[0]["n"]
            == 0
        )
