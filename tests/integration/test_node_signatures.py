"""Node-signed records through the real embedded broker and the real streams worker (issue 41,
item 5): with `site_secret` set, a kernel record that names gpu02 but is signed with gpu01's key
(gpu01's credentials speaking for gpu02) lands on `deadletter` as `node_signature_invalid` and
never reaches the Xid detector (as port and GPU records so signed: detect_net, detect_gpu); the
same record signed with gpu02's own key yields the anomaly. With `node_signing_required`, an
unsigned record is refused as `node_signature_missing`.

The records are written by the real kernel-log producer from a kernel log line
(tests/fixtures/logs), published through the one publish path with each node's key
(bus.publish.Publisher's `node_signer`, as `trainmedic produce kernel` does with node_key).
"""

from __future__ import annotations

import gc
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from bus.config import consumer_config
from bus.identity import NodeSigner, node_key
from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from schemas.codec import decode
from schemas.events import Anomaly, DeadLetter, GpuSample, NetPortSample
from schemas.ids import DEFAULT_CLUSTER
from schemas.topics import ANOMALIES, DEADLETTER, GPU_SAMPLES, NET_PORTS, NODE_KERNEL
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.integration.scenario import running_stack, xid79_line
from trainmedic.stack.broker import EmbeddedBroker

SITE = "integration-site-secret-0123456789abcdef"


def _values(bootstrap: str, topic: str) -> list[bytes]:
    """Every record of the topic from the start (assigned: no group join)."""
    consumer = Consumer(
        consumer_config(bootstrap, f"test-sig-{uuid.uuid4().hex}", "test-sig") | {"enable.partition.eof": True}
    )
    try:
        meta = consumer.list_topics(topic, timeout=10)
        if topic not in meta.topics or meta.topics[topic].error is not None:
            return []
        parts = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.topics[topic].partitions]
        consumer.assign(parts)
        left, out, deadline = {p.partition for p in parts}, [], time.monotonic() + 20
        while left and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    left.discard(msg.partition())
                continue
            out.append(msg.value() or b"")
        return out
    finally:
        consumer.close()


def _publish_xid(bootstrap: str, kern_log: Path, signer_node: str) -> None:
    """gpu02's Xid 79 line, as gpu02's kernel producer reads it, signed with `signer_node`'s key."""
    key = node_key(SITE.encode(), DEFAULT_CLUSTER, signer_node)
    pub = Publisher(bootstrap, f"test-{signer_node}", node_signer=NodeSigner(signer_node, key))
    KernelLogProducer(pub, kern_log, node="gpu02", from_start=True).poll_once()
    assert pub.flush(10) == 0


def _kernel_letters(bootstrap: str) -> list[DeadLetter]:
    letters = [decode(DeadLetter, v) for v in _values(bootstrap, DEADLETTER.name)]
    return [d for d in letters if d.original_topic == NODE_KERNEL.name]


def _xid_anomalies(bootstrap: str) -> list[Anomaly]:
    got = [decode(Anomaly, v) for v in _values(bootstrap, ANOMALIES.name)]
    return [a for a in got if a.detector == "xid" and a.node == "gpu02"]


def test_a_record_signed_with_another_nodes_key_is_refused_and_its_own_nodes_key_is_taken(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINMEDIC_SITE_SECRET", SITE)  # the streams worker's environment
    kern_log = tmp_path / "kern.log"
    kern_log.write_text(xid79_line("gpu02") + "\n")
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path / "stack"):
        _publish_xid(broker.bootstrap, kern_log, "gpu01")  # gpu01's key, claiming gpu02

        [letter] = wait_for("the forged record on deadletter", lambda: _kernel_letters(broker.bootstrap), timeout=60)
        assert letter.component == "streams.detect_kernel"
        assert letter.reason == "node_signature_invalid: record names node 'gpu02' but is signed by node 'gpu01'"
        # gpu01's key speaking for gpu02 on the other node topics: refused by their agents too.
        forger = Publisher(
            broker.bootstrap,
            "test-forger",
            node_signer=NodeSigner("gpu01", node_key(SITE.encode(), DEFAULT_CLUSTER, "gpu01")),
        )
        forger.publish(
            NET_PORTS, NetPortSample(event_id="ports-forged", event_time=time.time(), node="gpu02", ports=[])
        )
        forger.publish(GPU_SAMPLES, GpuSample(event_id="gpu-forged", event_time=time.time(), node="gpu02", gpus=[]))
        assert forger.flush(10) == 0

        def others() -> dict[str, DeadLetter] | None:
            letters = [decode(DeadLetter, v) for v in _values(broker.bootstrap, DEADLETTER.name)]
            got = {d.original_topic: d for d in letters if d.original_topic in (NET_PORTS.name, GPU_SAMPLES.name)}
            return got if len(got) == 2 else None

        by_topic = wait_for("the forged port and GPU records on deadletter", others, timeout=60)
        assert {t: d.component for t, d in by_topic.items()} == {
            NET_PORTS.name: "streams.detect_net",
            GPU_SAMPLES.name: "streams.detect_gpu",
        }
        assert {d.reason for d in by_topic.values()} == {letter.reason}

        # The same line, signed by gpu02's own key: it reaches the detector. Both records share
        # gpu02's partition, so once this anomaly is out the forged one was judged before it.
        _publish_xid(broker.bootstrap, kern_log, "gpu02")
        [anomaly] = wait_for("gpu02's Xid 79 anomaly", lambda: _xid_anomalies(broker.bootstrap), timeout=60)
        assert anomaly.signature == "xid_79"
        assert len(_kernel_letters(broker.bootstrap)) == 1
    gc.collect()


def test_with_node_signing_required_an_unsigned_node_record_is_refused(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINMEDIC_SITE_SECRET", SITE)
    monkeypatch.setenv("TRAINMEDIC_NODE_SIGNING_REQUIRED", "true")
    kern_log = tmp_path / "kern.log"
    kern_log.write_text(xid79_line("gpu02") + "\n")
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path / "stack"):
        pub = Publisher(broker.bootstrap, "test-unsigned")  # no node key: as before this change
        KernelLogProducer(pub, kern_log, node="gpu02", from_start=True).poll_once()
        assert pub.flush(10) == 0

        [letter] = wait_for("the unsigned record on deadletter", lambda: _kernel_letters(broker.bootstrap), timeout=60)
        assert letter.reason == "node_signature_missing: record of node 'gpu02' is not signed (node_signing_required)"
        _publish_xid(broker.bootstrap, kern_log, "gpu02")  # signed: taken, after the refused one
        [anomaly] = wait_for("gpu02's Xid 79 anomaly", lambda: _xid_anomalies(broker.bootstrap), timeout=60)
        assert anomaly.signature == "xid_79"
    gc.collect()
