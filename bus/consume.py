"""The one way to consume: a group consumer with the shared settings, and a read-back of a
topic's recent records (what a restarted component takes back from the log).

Decoding stays with the caller (`schemas.codec.decode` into the topic's event type), so a
record it cannot read is dead-lettered where its reader knows why.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bus.config import consumer_config


def group_consumer(bootstrap: str, group: str, client_id: str, **overrides: Any) -> Consumer:
    """A consumer in `group` with the shared settings; `overrides` are librdkafka keys."""
    return Consumer({**consumer_config(bootstrap, group, client_id), **overrides})


def read_records(bootstrap: str, topic: str, since: float, timeout_s: float = 30.0) -> list[tuple[float, bytes]]:
    """Every record of `topic` with a timestamp >= since, as (record time, value)."""
    # Assigned, not subscribed: no group join, nothing committed.
    consumer = group_consumer(
        bootstrap,
        f"trainmedic-recovery-{uuid.uuid4().hex[:8]}",
        "trainmedic-recovery",
        **{"enable.partition.eof": True},
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
