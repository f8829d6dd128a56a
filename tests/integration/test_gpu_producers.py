"""NvmlProducer (over the fake pynvml module) publishing to the real embedded broker."""

from __future__ import annotations

import threading
import uuid

from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from producers.gpu_nvml import NvmlCollector, NvmlProducer
from schemas.codec import decode
from schemas.events import GpuSample
from schemas.topics import GPU_SAMPLES
from tests.conftest import wait_for
from tests.fakes.fake_pynvml import FakeNvml
from trainmedic.stack.broker import EmbeddedBroker


def read_gpu_samples(bootstrap: str, expected: int) -> list[tuple[bytes | None, GpuSample]]:
    """Every GpuSample record on the topic, from the start, with its key."""
    consumer = Consumer(consumer_config(bootstrap, f"test-gpu-{uuid.uuid4().hex}", "test-gpu"))
    consumer.subscribe([GPU_SAMPLES.name])
    got: list[tuple[bytes | None, GpuSample]] = []

    def all_read() -> bool:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            got.append((msg.key(), decode(GpuSample, msg.value() or b"")))
        return len(got) >= expected

    try:
        wait_for(f"{expected} records on {GPU_SAMPLES.name}", all_read, timeout=60, interval=0)
    finally:
        consumer.close()
    return got


def test_nvml_producer_publishes_samples_keyed_by_node(broker: EmbeddedBroker) -> None:
    fake = FakeNvml()
    publisher = Publisher(broker.bootstrap, "test-nvml")
    producer = NvmlProducer(publisher, "gpu07", interval_s=0.2, collector=NvmlCollector(fake))
    stop = threading.Event()
    worker = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    worker.start()
    try:
        wait_for("two healthy samples", lambda: producer.samples >= 2)
        fake.inject_xid(2, 79)
        fake.lose(5)
        published = producer.samples
        wait_for("two samples after the fault", lambda: producer.samples >= published + 2)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive()
    assert producer.errors == 0 and producer.lost_gpu_readings >= 2
    assert publisher.flush(10) == 0

    records = read_gpu_samples(broker.bootstrap, producer.samples)
    assert len(records) == producer.samples
    assert {key for key, _ in records} == {b"gpu07"}
    samples = sorted((s for _, s in records), key=lambda s: s.event_time)
    assert all(s.node == "gpu07" and s.collector == "nvml" and len(s.gpus) == 8 for s in samples)
    assert len({s.event_id for s in samples}) == len(samples)
    assert not any(g.lost for g in samples[0].gpus)
    last = {g.index: g for g in samples[-1].gpus}
    assert last[5].lost and not any(last[i].lost for i in (0, 1, 2, 3, 4, 6, 7))
    xids = [(g.index, g.xid_events) for s in samples for g in s.gpus if g.xid_events]
    assert xids == [(2, [79])]
    producer.close()
