"""Kafka client settings every component shares.

Short session/heartbeat timeouts matter: a consumer group join takes about
half of `session.timeout.ms` on the embedded broker (see ENVIRONMENT-NOTES).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

# librdkafka's own log lines go through Python logging instead of raw stderr.
_KAFKA_LOG = logging.getLogger("trainmedic.kafka")


def producer_config(bootstrap: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        "acks": "all",
        "linger.ms": 5,
        # No compression: Faust's aiokafka reads lz4/zstd only with extra codec
        # libraries; an unreadable batch would crash the streams worker.
        "compression.type": "none",
        # Faust (aiokafka) partitions keys with murmur2; match it so keyed data
        # from our producers lands where Faust expects it.
        "partitioner": "murmur2_random",
        "message.timeout.ms": 300_000,
        "queue.buffering.max.messages": 100_000,
    }


def consumer_config(bootstrap: str, group: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        # The embedded broker answers "latest" wrongly; committed offsets plus
        # earliest are exact.
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 300_000,
        # The embedded broker answers a fetch only when its wait expires, not when
        # data arrives: a short wait bounds the latency each hop adds.
        "fetch.wait.max.ms": 100,
    }


def admin_config(bootstrap: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "logger": _KAFKA_LOG}


def read_records(bootstrap: str, topic: str, since: float, timeout_s: float = 30.0) -> list[tuple[float, bytes]]:
    """Every record of `topic` with a timestamp >= since, as (record time, value)."""
    consumer = Consumer(
        {
            # Assigned, not subscribed: no group join, nothing committed.
            **consumer_config(bootstrap, f"trainmedic-recovery-{uuid.uuid4().hex[:8]}", "trainmedic-recovery"),
            "enable.partition.eof": True,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s)
        if topic not in meta.topics or meta.topics[topic].error is not None:
            return []
        partitions = sorted(meta.topics[topic].partitions)
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, int(since * 1000)) for p in partitions], timeout=timeout_s
        )
        todo: list[TopicPartition] = []
        for tp in starts:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=timeout_s)
            start = tp.offset if tp.offset >= 0 else high  # -1: nothing that recent
            if start < high:
                todo.append(TopicPartition(topic, tp.partition, start))
        if not todo:
            return []
        consumer.assign(todo)
        remaining = {tp.partition for tp in todo}
        out: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading back {topic}: partitions {sorted(remaining)} not read to their end")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == -191:  # _PARTITION_EOF
                    remaining.discard(msg.partition())
                    continue
                raise KafkaException(err)
            ts_type, ts_ms = msg.timestamp()
            at = ts_ms / 1000.0 if ts_type and ts_ms > 0 else time.time()
            value = msg.value()
            if at >= since and value is not None:
                out.append((at, value))
        return out
    finally:
        consumer.close()
