"""The InfiniBand / RoCE port producer through the real embedded broker:

- `trainmedic produce ib` (the command a unit and the chart run) publishes node-keyed
  net.ports records read from a sysfs tree, and exits 3 saying why where there is none;
- a port that goes down under a running job reaches attribution as the node's own evidence:
  the real producer publishes, the real streams worker's detect_net emits net_port_down
  (source net, node-keyed) and route_anomalies re-keys it to the job on the node.

The sysfs trees are input data laid out as the kernel's ABI documents them
(tests/unit/test_ib_sysfs.py `write_port`), not mocks.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from bus.config import consumer_config
from bus.publish import Publisher
from producers.ib_sysfs import IbSysfsCollector, IbSysfsProducer
from schemas.codec import decode
from schemas.events import Anomaly, NetPortSample, SchedEvent
from schemas.topics import ANOMALIES, ANOMALIES_BY_JOB, NET_PORTS, SCHED_EVENTS
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for, wait_placed
from tests.integration.scenario import running_stack
from tests.unit.test_ib_sysfs import write_port
from trainmedic.stack.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[2]
# This checkout's code, whatever the venv's `trainmedic` script was installed from.
TRAINMEDIC = [sys.executable, "-m", "trainmedic.cli.main"]


def _keyed(bootstrap: str, topic: str) -> list[tuple[bytes | None, bytes]]:
    """Every record of the topic from the start, with its key (assigned: no group join)."""
    consumer = Consumer(
        consumer_config(bootstrap, f"test-ib-{uuid.uuid4().hex}", "test-ib") | {"enable.partition.eof": True}
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
            out.append((msg.key(), msg.value() or b""))
        return out
    finally:
        consumer.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    return env | extra


def test_produce_ib_publishes_node_keyed_samples(broker: EmbeddedBroker, tmp_path: Path) -> None:
    root = tmp_path / "infiniband"
    write_port(root, "mlx5_0", 1)
    write_port(root, "mlx5_1", 1, link_layer="Ethernet", hw_counters={"out_of_sequence": 0})
    proc = subprocess.Popen(
        [*TRAINMEDIC, "produce", "ib", "--bootstrap", broker.bootstrap, "--node", "gpu07"],
        env=_env(TRAINMEDIC_IB_SYSFS_ROOT=str(root), TRAINMEDIC_IB_INTERVAL_S="0.2"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def two() -> list[tuple[bytes | None, bytes]] | None:
            got = _keyed(broker.bootstrap, NET_PORTS.name)
            return got if len(got) >= 2 else None

        records = wait_for("two records on net.ports", two, timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"from {root} every 0.2 s" in out and '"errors": 0' in out
    for key, value in records:
        sample = decode(NetPortSample, value)
        assert key == b"gpu07" and sample.node == "gpu07"
        assert {(p.device, p.link_layer, p.state) for p in sample.ports} == {
            ("mlx5_0", "InfiniBand", "ACTIVE"),
            ("mlx5_1", "Ethernet", "ACTIVE"),
        }


def test_produce_ib_without_a_sysfs_tree_exits_3_saying_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, "produce", "ib", "--sysfs-root", str(tmp_path / "none"), "--bootstrap", "127.0.0.1:1"],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no InfiniBand / RoCE device driver is loaded" in proc.stdout + proc.stderr


def test_a_port_down_under_a_job_reaches_the_job_as_the_nodes_own_evidence(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([f"gpu{n:02d}" for n in range(1, 4)])
    job = sched.submit("train", 2)
    nodes = list(sched.job_state(job).nodes)
    culprit = nodes[1]
    root = tmp_path / "infiniband"
    write_port(root, "mlx5_0", 1)
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path / "stack"):
        pub = Publisher(broker.bootstrap, "test-producer")
        pub.publish(
            SCHED_EVENTS,
            SchedEvent(
                event_id=f"run-{job}", event_time=time.time(), kind="job", job_id=job, state="RUNNING", nodes=nodes
            ),
        )
        assert pub.flush(10) == 0
        wait_placed(broker.bootstrap, [job])
        producer = IbSysfsProducer(pub, node=culprit, collector=IbSysfsCollector(root))
        assert producer.poll_once() is not None  # up
        write_port(root, "mlx5_0", 1, state="DOWN", phys="Polling", counters={"link_downed": 1})
        assert producer.poll_once() is not None  # down, and the link-down counted
        assert pub.flush(10) == 0

        def routed() -> list[tuple[bytes | None, Anomaly]] | None:
            got = [(k, decode(Anomaly, v)) for k, v in _keyed(broker.bootstrap, ANOMALIES_BY_JOB.name)]
            got = [(k, a) for k, a in got if a.detector == "net_ports"]
            return got if len(got) >= 2 else None

        by_job = wait_for("the port's anomalies on anomalies.by_job", routed, timeout=60)
        assert {k for k, _ in by_job} == {job.encode()}
        assert sorted(a.signature for _, a in by_job) == ["net_port_down", "net_port_link_downed"]
        for _, a in by_job:
            assert (a.node, a.source, a.category, a.job_id) == (culprit, "net", "interconnect", job)
            assert a.facts["device"] == "mlx5_0" and a.facts["link_layer"] == "InfiniBand"
        emitted = [decode(Anomaly, v) for _, v in _keyed(broker.bootstrap, ANOMALIES.name)]
        assert {a.signature for a in emitted if a.detector == "net_ports" and a.job_id is None} == {
            "net_port_down",
            "net_port_link_downed",
        }  # as the detector emitted them: node-keyed, no job
    gc.collect()
